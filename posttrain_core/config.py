"""Pydantic configs for every stage; they are also the flow parameters that the Prefect UI renders as forms.

One flat, frozen model per stage, every field documented. Cross-field checks run in validators, before any work starts.
Longer than ~400 lines on purpose: every setting a user can change is in this one file, next to its default.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from posttrain_core.plugins import absolute, is_reference


class _Config(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    def code_refs(self) -> list[str]:
        """The references to user code this config holds (fields marked `USER_CODE`), sorted: their source is part
        of the key of the stage that runs them."""
        refs: set[str] = set()
        for name, field in type(self).model_fields.items():
            value = getattr(self, name)
            if isinstance(value, _Config):  # a nested config's references (RolloutConfig.tools)
                refs.update(value.code_refs())
                continue
            if not (isinstance(field.json_schema_extra, dict) and field.json_schema_extra.get("user_code")):
                continue
            items = list(value) if isinstance(value, list | dict) else [value]
            refs.update(v for v in items if isinstance(v, str) and is_reference(v))
        return sorted(refs)


USER_CODE = {"user_code": True}  # json_schema_extra of fields that may name user code (`plugins`)


class DataConfig(_Config):
    """Where the training and evaluation data come from: the synthetic task by default, or the user's files."""

    train_path: str | None = Field(
        None,
        description="JSONL, Parquet or `datasets.save_to_disk` folder of chat rows ({'messages': [{role, content}]}, "
        "or {'prompt', 'completion'}). Empty: generate the synthetic task.",
    )
    eval_path: str | None = Field(
        None,
        description="Held-out prompts with answers, in the columns of prompts_path. Empty: hold out `n_eval` rows of "
        "the training data (the last assistant turn is the answer).",
    )
    prompts_path: str | None = Field(
        None,
        description="RL prompts: JSONL, Parquet or `datasets` folder of {'messages'|'prompt', 'answer' (optional), any "
        "other columns (kept in `meta`, passed to reward functions)}. Empty: the synthetic task's RL prompts, or the "
        "training chats (their last assistant turn as the answer)",
    )
    text_path: str | None = Field(
        None,
        description="Raw text ({'text': ...}) for continued pretraining. Empty: the synthetic corpus, or the "
        "training chats flattened to text.",
    )
    families: list[Literal["arithmetic", "reverse", "lookup", "calc", "shapes"]] = Field(
        default_factory=lambda: ["arithmetic", "reverse"],
        description="synthetic task families; lookup and calc need a tool (posttrain_core.data.tool_tasks, "
        "docs/tools.md)",
    )
    n_train: int = Field(6000, ge=1, description="synthetic training problems")
    n_eval: int = Field(200, ge=1, description="held-out evaluation prompts (never seen in training)")
    slip_rate: float = Field(
        0.2,
        ge=0.0,
        le=1.0,
        description="synthetic tasks: fraction of the SFT (and pretraining) demonstrations with one mistake, as in "
        "imperfect human- or model-written data: arithmetic slips a step and carries it to a wrong answer; tool "
        "families skip the call, mangle its arguments, or call where no tool is needed; a picture gets a wrong "
        "label. SFT imitates the mistakes; RL against the verifier removes them (0: clean demonstrations)",
    )
    n_rl_prompts: int = Field(
        4096,
        ge=0,
        description="synthetic RL prompts, distinct from the SFT problems and the held-out ones and drawn after them, "
        "so their number never changes those (0: RL samples the SFT problems again)",
    )
    blank_images: bool = Field(
        False,
        description="replace every image by a blank (white) one of its size: an ablation that shows what a "
        "vision-language model learns without seeing",
    )
    max_digits: int = Field(2, ge=1, le=6, description="synthetic arithmetic: most digits per operand")
    worked_solutions: bool = Field(
        True,
        description="synthetic arithmetic: SFT answers work the sum column by column before 'The answer is N' "
        "(the tiny demo model learns the steps; on bare answers it stays near chance)",
    )
    seed: int = Field(0, description="seed of the synthetic generator and of the held-out split")


class ModelConfig(_Config):
    """The base model: any local Hugging Face folder, or a tiny random-init model built with its own tokenizer."""

    path: str | None = Field(
        None,
        description="local Hugging Face model folder (full model or peft adapter), a .gguf file (imported once "
        "as a float32 model artifact), a model artifact's key, or a tinker:// checkpoint of `posttrain serve`. "
        "Empty: build a tiny model.",
    )
    arch: Literal["llama", "qwen2", "qwen2_vl", "llava"] = Field(
        "llama", description="tiny model: architecture (qwen2_vl, llava: vision-language models, docs/vlm.md)"
    )
    size: Literal["tiny", "small"] = Field(
        "small", description="tiny model preset: tiny = 64 hidden x 2 layers, small = 128 hidden x 4 layers"
    )
    vocab_size: int = Field(512, ge=300, le=65536, description="tiny model: BPE vocabulary trained on the corpus")
    max_position_embeddings: int = Field(512, ge=16, description="tiny model: context length")
    seed: int = Field(0, description="tiny model: initialisation seed")


class LoraConfig(_Config):
    """Low-rank adapters (peft) instead of full fine-tuning."""

    r: int = Field(8, ge=1, description="adapter rank")
    alpha: int = Field(16, ge=1, description="scaling numerator (scale = alpha / r)")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapter input")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], description="module names to adapt"
    )


class TrainConfig(_Config):
    """One data-parallel training loop on Ray workers (SFT and continued pretraining share it)."""

    num_workers: int = Field(2, ge=1, description="Ray workers (torch.distributed data-parallel ranks)")
    max_steps: int = Field(1000, ge=1, description="optimizer steps")
    global_batch_size: int = Field(32, ge=1, description="sequences per optimizer step, summed over workers")
    micro_batch_size: int = Field(16, ge=1, description="sequences per forward pass on one worker")
    lr: float = Field(3e-3, gt=0, description="peak learning rate (AdamW)")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="final learning rate as a fraction of `lr`")
    warmup_steps: int = Field(20, ge=0, description="linear warm-up steps")
    schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="decay after warm-up")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    max_grad_norm: float = Field(1.0, ge=0, description="gradient clipping (0 = off)")
    max_seq_len: int = Field(128, ge=8, description="tokens per sequence (longer rows are truncated)")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="compute dtype (bfloat16 = autocast)")
    gradient_checkpointing: bool = Field(
        False, description="recompute activations in the backward pass: less memory, about a third more compute"
    )
    train_vision: bool = Field(
        False, description="vision-language models: train the vision tower too (frozen by default)"
    )
    checkpoint_every: int = Field(100, ge=0, description="in-stage checkpoint interval in steps (0 = never)")
    keep_checkpoints: int = Field(2, ge=1, description="in-stage checkpoints kept")
    log_every: int = Field(10, ge=1, description="steps between progress lines and MLflow metrics")
    seed: int = Field(0, description="data order and initialisation seed")
    lora: LoraConfig | None = Field(None, description="train LoRA adapters instead of all weights")
    merge_lora: bool = Field(False, description="save the merged model instead of the adapter")

    @model_validator(mode="after")
    def _check_batch(self) -> TrainConfig:
        per_step = self.num_workers * self.micro_batch_size
        if self.global_batch_size % per_step:
            raise ValueError(
                f"global_batch_size ({self.global_batch_size}) must be a multiple of num_workers x micro_batch_size "
                f"({self.num_workers} x {self.micro_batch_size} = {per_step})"
            )
        return self

    @property
    def grad_accum_steps(self) -> int:
        return self.global_batch_size // (self.num_workers * self.micro_batch_size)


class PretrainConfig(TrainConfig):
    """Continued pretraining: packed raw text, every token trained on."""

    max_steps: int = Field(50, ge=1, description="optimizer steps")
    lr: float = Field(1e-3, gt=0, description="peak learning rate (AdamW)")
    warmup_steps: int = Field(10, ge=0, description="linear warm-up steps")


class SFTConfig(TrainConfig):
    """Supervised fine-tuning on chats: the loss covers assistant tokens only."""

    # 1,500 rather than the loop's 1,000: the demo model's letter-reversal circuit forms late, and near 1,000 steps
    # whether it has formed depends on float rounding; by 1,500 it has, well before the end.
    max_steps: int = Field(1500, ge=1, description="optimizer steps")


class ToolConfig(_Config):
    """Tools, or an environment, a policy may call over several turns of one rollout (docs/tools.md)."""

    tools: list[str] = Field(
        default_factory=list, json_schema_extra=USER_CODE,
        description="functions with type hints and a Google-style docstring, as 'package.module:fn' or "
        "'path/to/file.py:fn'",
    )  # fmt: skip
    environment: str | None = Field(
        None, json_schema_extra=USER_CODE,
        description="a class with reset(row) and step(call) (optional reward(), close(), tools), one instance per "
        "trajectory, as 'package.module:Class' or 'path/to/file.py:Class' (instead of tools)",
    )  # fmt: skip
    parser: Literal["hermes", "compact"] = Field(
        "hermes", description="how calls are written: hermes <tool_call>{json}</tool_call>; compact <tool_call>name "
        "arg ...</tool_call> (tiny models)",
    )  # fmt: skip
    max_turns: int = Field(4, ge=1, description="most assistant turns of a trajectory")
    max_tool_calls_per_turn: int = Field(1, ge=1, description="calls run per assistant turn (the first N)")
    tool_timeout_s: float = Field(10.0, gt=0, description="a call's deadline; past it the model sees an error")
    max_tool_response_tokens: int = Field(64, ge=1, description="a tool's result is cut to this many tokens")
    max_total_tokens: int = Field(
        256, ge=1, description="most response tokens of a trajectory (assistant and tool turns together)"
    )

    @model_validator(mode="after")
    def _tools_or_environment(self) -> ToolConfig:
        if bool(self.tools) == bool(self.environment):
            raise ValueError("give either tools (functions) or an environment (a class), not both or neither")
        return self


class EvalConfig(_Config):
    """Answers to held-out prompts, scored by a verifier: greedy accuracy by default, pass@k with several samples."""

    verifier: str = Field(
        "exact_match", json_schema_extra=USER_CODE,
        description="how answers are checked: a built-in verifier that decides correctness (exact_match, numeric, "
        "math) or your reward function returning {'correct': 0/1, ...} ('package.module:fn' or 'file.py:fn')",
    )  # fmt: skip
    max_new_tokens: int = Field(
        32, ge=1, description="generated tokens per answer (the demo's worked arithmetic takes up to 29)"
    )
    samples: int = Field(
        1,
        ge=1,
        description="answers per prompt; accuracy is over all of them, and with more than one the metrics "
        "also hold pass@1 and pass@samples (sample at a temperature > 0)",
    )
    temperature: float = Field(0.0, ge=0, description="sampling temperature (0 = greedy)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass")
    seed: int = Field(0, description="sampling seed")
    engine: Literal["hf", "vllm"] = Field("hf", description="generation engine, as RolloutConfig.engine")
    num_engines: int = Field(2, ge=1, description="engine actors generating in parallel")
    batch_size: int = Field(64, ge=1, description="most prompts per engine call")
    max_prompts: int | None = Field(None, ge=1, description="evaluate only the first N prompts")
    tools: ToolConfig | None = Field(
        None, description="multi-turn with tool calls (the rlhf flow: empty takes the rollout's tools)"
    )


class SFTFlowConfig(_Config):
    """The SFT pipeline: data -> base model -> (continued pretraining) -> SFT -> evaluation."""

    store: str | None = Field(
        None, description="artifact store root (local folder or fsspec URI). Empty: $POSTTRAIN_STORE or ./.posttrain"
    )
    experiment: str = Field("posttrain", description="MLflow experiment name")
    data: DataConfig = Field(default_factory=DataConfig, description="training and evaluation data")
    model: ModelConfig = Field(default_factory=ModelConfig, description="base model")
    pretrain: PretrainConfig | None = Field(
        default_factory=PretrainConfig, description="continued pretraining before SFT (empty: skip)"
    )
    sft: SFTConfig = Field(default_factory=SFTConfig, description="supervised fine-tuning")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="held-out evaluation")


class RewardModelConfig(TrainConfig):
    """Bradley-Terry reward model: a scalar head on the last non-pad token of a causal LM backbone."""

    max_steps: int = Field(200, ge=1, description="optimizer steps")
    margin: float = Field(0.0, ge=0, description="loss = -log sigmoid(r_chosen - r_rejected - margin)")
    eval_pairs: int = Field(200, ge=0, description="held-out pairs for pairwise accuracy (taken from the data)")


class DPOConfig(TrainConfig):
    """Direct preference optimisation from a reference (the base) model; IPO and cDPO as variants."""

    max_steps: int = Field(200, ge=1, description="optimizer steps")
    lr: float = Field(5e-4, gt=0, description="peak learning rate (AdamW)")
    beta: float = Field(0.1, gt=0, description="inverse temperature of the implicit reward")
    loss_type: Literal["sigmoid", "ipo", "cdpo"] = Field("sigmoid", description="DPO, IPO or label-smoothed cDPO")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="cDPO: probability that a label is flipped")
    eval_pairs: int = Field(200, ge=0, description="held-out pairs for reward accuracy/margin")


class RolloutConfig(_Config):
    """Sampling n responses per prompt on a pool of engine actors."""

    engine: Literal["hf", "vllm"] = Field("hf", description="hf = transformers generate (CPU/GPU); vllm = vLLM")
    n: int = Field(4, ge=1, description="samples per prompt")
    temperature: float = Field(1.0, ge=0, description="sampling temperature (0 = greedy)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass")
    max_tokens: int = Field(32, ge=1, description="generated tokens per sample")
    stop: list[str] = Field(default_factory=list, description="extra stop strings (eos always stops)")
    seed: int = Field(0, description="sampling seed: same seed, same samples")
    num_engines: int = Field(2, ge=1, description="engine actors")
    batch_size: int = Field(
        32, ge=1, description="most prompts per engine call (fewer prompts than engines x batch_size are split evenly)"
    )
    max_prompts: int | None = Field(None, ge=1, description="use only N prompts (the RL flow: prompts per iteration)")
    prompt_start: int = Field(
        0, ge=0, description="first prompt of the window of max_prompts (wraps around the end of the dataset)"
    )
    families: list[str] = Field(
        default_factory=list, description="only prompts whose meta.family is one of these (empty: every prompt)"
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="engine weights dtype")
    vllm_python: str | None = Field(
        None, description="python of the vLLM environment (default: $POSTTRAIN_VLLM_PYTHON or .venv-vllm/bin/python)"
    )
    tools: ToolConfig | None = Field(None, description="multi-turn with tool calls (empty: one turn; docs/tools.md)")


class ScoreConfig(_Config):
    """Rewards for rollouts: weighted verifiers, the user's reward functions, a reward model and shaping terms, each
    kept as its own column (docs/rewards.md)."""

    verifiers: dict[str, float] = Field(
        default_factory=lambda: {"exact_match": 1.0},
        description="built-in verifier -> weight: exact_match, numeric, math (\\boxed{} or '#### N'), regex, format, "
        "length",
    )
    reward_functions: dict[str, float] = Field(
        default_factory=dict, json_schema_extra=USER_CODE,
        description="your reward functions -> weight, as 'package.module:function' or 'path/to/file.py:function': "
        "fn(prompt, response, answer, meta) -> float | dict[str, float] (docs/rewards.md)",
    )  # fmt: skip
    reward_timeout_s: float = Field(
        30.0, gt=0, description="a reward function call running longer fails that sample (counted in reward_errors)"
    )
    regex: str | None = Field(None, description="pattern of the regex verifier (re.search)")
    format_pattern: str | None = Field(None, description="pattern of the format verifier (the whole response)")
    length_limit: int = Field(1000, ge=1, description="length verifier: characters before the penalty starts")
    reward_model_weight: float = Field(0.0, description="weight of the reward model's score (needs a reward model)")
    tool_call_cost: float = Field(
        0.0, ge=0, description="multi-turn: subtracted from the reward per tool call (teaches when to call)"
    )
    overlong_max_tokens: int | None = Field(None, ge=1, description="DAPO overlong shaping: length budget L_max")
    overlong_buffer: int = Field(8, ge=1, description="DAPO overlong shaping: soft buffer L_buf")
    overlong_penalty: float = Field(1.0, ge=0, description="DAPO overlong shaping: penalty at L_max")
    num_workers: int = Field(2, ge=1, description="Ray tasks running the reward functions, and reward-model actors")
    batch_size: int = Field(64, ge=1, description="rollouts per reward-model forward")


class DistillConfig(_Config):
    """A teacher the student learns from (docs/distillation.md): its log-probs of every sampled token (on-policy
    distillation's advantage) and, with top-k, its most likely tokens at each position (GKD's supervised loss)."""

    teacher: str | None = Field(
        None,
        description="the teacher: a local Hugging Face folder (full model or peft adapter), a .gguf file, "
        "'latest:STAGE', a model artifact's key or a tinker:// checkpoint; it must share the student's tokenizer",
    )
    topk: int = Field(
        16, ge=0,
        description="teacher tokens kept per position with their log-probs (0: the sampled token's only); the "
        "supervised divergences compare the two distributions on them plus one bucket for the rest, exactly with "
        "topk = the vocabulary size (hf engine; vLLM returns at most 64)",
    )  # fmt: skip
    coef: float = Field(
        1.0, gt=0, description="on-policy distillation: A_t = -coef (log pi_student(y_t) - log pi_teacher(y_t))"
    )
    discount: float = Field(
        0.0, ge=0, le=1, description="on-policy distillation: discount of the sum over later tokens (0: per token)"
    )
    task_weight: float = Field(
        0.0, ge=0, description="on-policy distillation: plus this weight times the task reward's advantage"
    )
    task_advantage: str = Field(
        "grpo", description="on-policy distillation: the advantage estimator of the task reward (with task_weight)"
    )
    divergence: str = Field(
        "jsd", json_schema_extra=USER_CODE,
        description="supervised loss per response token: jsd (generalized JSD(beta)), forward_kl, reverse_kl (over "
        "the teacher's top-k plus a tail bucket), k2, k3 (on the sampled token), or your registered function",
    )  # fmt: skip
    beta: float = Field(0.5, ge=0, le=1, description="jsd: 0 = KL(teacher || student), 1 = KL(student || teacher)")
    loss_coef: float | None = Field(
        None, ge=0, description="weight of the supervised divergence in the update's loss (empty: 1 for gkd, else 0)"
    )
    lmbda: float = Field(
        1.0, ge=0, le=1,
        description="the share of iterations whose rollouts the student samples (drawn per iteration from the "
        "seed); the others are sampled by the teacher",
    )  # fmt: skip
    seq_kd: bool = Field(
        False, description="every iteration's rollouts are sampled by the teacher: SFT on its completions (lmbda 0)"
    )
    engine: Literal["hf", "vllm"] = Field("hf", description="the teacher's engine (one forward pass per batch)")
    num_engines: int = Field(1, ge=1, description="teacher engine actors")
    batch_size: int = Field(64, ge=1, description="rows per teacher forward pass call")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="the teacher's weights dtype")
    vllm_python: str | None = Field(
        None, description="python of the vLLM environment (default: $POSTTRAIN_VLLM_PYTHON or .venv-vllm/bin/python)"
    )

    @model_validator(mode="after")
    def _check(self) -> DistillConfig:
        if self.engine == "vllm" and self.topk > VLLM_MAX_TOPK:
            raise ValueError(f"distill.topk={self.topk}: the vLLM engine returns at most {VLLM_MAX_TOPK} log-probs per "
                             "position; use engine='hf' for more")  # fmt: skip
        return self

    def scoring(self) -> DistillConfig:
        """Only what the teacher_logprobs stage uses (its key): another loss setting reuses the teacher's log-probs."""
        return DistillConfig(**{name: getattr(self, name) for name in _SCORING_FIELDS})

    def student_samples(self, iteration: int, seed: int) -> bool:
        """Whether the student samples iteration `iteration`'s rollouts (else the teacher does): seq_kd never, else
        with probability lmbda, drawn from (seed, iteration) so that a rerun makes the same choice."""
        import random

        if self.seq_kd:
            return False
        return self.lmbda >= 1.0 or random.Random(seed * 1_000_003 + iteration).random() < self.lmbda


class PrimeConfig(_Config):
    """PRIME's implicit process reward model (docs/algorithms.md, PRIME): a causal LM started from the start policy,
    scored against the frozen start model, trained online on the verifier's outcomes. Defaults: the reference
    recipe's."""

    beta: float = Field(0.05, gt=0, description="r_t = beta (log pi_prm(y_t) - log pi_ref(y_t)); the CE's logit scale")
    lr: float = Field(1e-6, gt=0, description="PRM learning rate (AdamW, constant, no weight decay)")
    grad_clip: float = Field(10.0, ge=0, description="PRM gradient clipping (0 = off)")
    reward_gt_coef: float = Field(5.0, ge=0, description="weight of the outcome's RLOO advantage")
    reward_dpo_coef: float = Field(5.0, ge=0, description="weight of the process rewards' RLOO advantage")
    granularity: Literal["token"] = Field("token", description="process rewards per token (the recipe's only one)")
    norm: Literal["batch_norm", "none"] = Field(
        "batch_norm", description="batch_norm: divide the process rewards by the batch's largest |return|"
    )
    update: Literal["before", "after", "none"] = Field(
        "before",
        description="before: update the PRM on the batch, then score it; after: score with the PRM as it was, then "
        "update; none: never update (the start model's credit)",
    )  # fmt: skip


VLLM_MAX_TOPK = 64  # the vLLM engine's max_logprobs (`vllm_engine.MAX_TOPK`)
_SCORING_FIELDS = ("topk", "engine", "num_engines", "batch_size", "dtype", "vllm_python")

Algorithm = Literal[
    "ppo", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "dapo", "vapo", "gspo", "cispo",
    "opd", "gkd", "prime",
]  # fmt: skip
AggMode = Literal["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]

# What each algorithm means when a field is left empty (None). Definitions: docs/algorithms.md.
_CLIP = dict(policy_loss="clip", clip_low=0.2, clip_high=0.2)
RL_PRESETS: dict[str, dict] = {
    "ppo": dict(advantage="gae", critic=True, loss_agg="token-mean", **_CLIP,
                kl_placement="reward", kl_estimator="k1", kl_coef=0.02),
    "grpo": dict(advantage="grpo", critic=False, loss_agg="token-mean", **_CLIP,
                 kl_placement="loss", kl_estimator="k3", kl_coef=0.04),
    "dr_grpo": dict(advantage="dr_grpo", critic=False, loss_agg="seq-mean-token-sum-norm", **_CLIP,
                    kl_placement="none", kl_estimator="k3", kl_coef=0.0),
    "rloo": dict(advantage="rloo", critic=False, loss_agg="token-mean", **_CLIP,
                 kl_placement="reward", kl_estimator="k1", kl_coef=0.02),
    "reinforce_pp": dict(advantage="reinforce_pp", critic=False, loss_agg="token-mean", **_CLIP,
                         kl_placement="reward", kl_estimator="k1", kl_coef=0.02),
    "reinforce_pp_baseline": dict(advantage="reinforce_pp_baseline", critic=False, loss_agg="token-mean", **_CLIP,
                                  kl_placement="reward", kl_estimator="k1", kl_coef=0.02),
    "dapo": dict(advantage="grpo", critic=False, loss_agg="token-mean", policy_loss="clip", clip_low=0.2,
                 clip_high=0.28, kl_placement="none", kl_estimator="k3", kl_coef=0.0, dynamic_sampling=True,
                 overlong=True),
    "vapo": dict(advantage="vapo", critic=True, loss_agg="token-mean", policy_loss="clip", clip_low=0.2,
                 clip_high=0.28, kl_placement="none", kl_estimator="k3", kl_coef=0.0, critic_lam=1.0, nll_coef=0.1,
                 value_pretrain_steps=20),
    # GSPO: the clip on the sequence ratio, with the paper's ranges (a sequence ratio moves far less than a token's)
    "gspo": dict(advantage="grpo", critic=False, loss_agg="seq-mean-token-mean", policy_loss="gspo", clip_low=3e-4,
                 clip_high=4e-4, kl_placement="none", kl_estimator="k3", kl_coef=0.0),
    # CISPO: the clipped ratio only weights each token's gradient; no lower clip (1 - 0.99), clip-higher as DAPO's
    "cispo": dict(advantage="grpo", critic=False, loss_agg="token-mean", policy_loss="cispo", clip_low=0.99,
                  clip_high=0.28, kl_placement="none", kl_estimator="k3", kl_coef=0.0),
    # On-policy distillation: the teacher's per-token reverse KL as the advantage, through the clipped update
    "opd": dict(advantage="opd", critic=False, loss_agg="token-mean", **_CLIP,
                kl_placement="none", kl_estimator="k3", kl_coef=0.0),
    # GKD: the supervised divergence alone (no advantage), on the student's samples (distill.lmbda, seq_kd)
    "gkd": dict(advantage="none", critic=False, loss_agg="token-mean", **_CLIP,
                kl_placement="none", kl_estimator="k3", kl_coef=0.0),
    # PRIME: RLOO on the outcome and on the implicit PRM's process rewards, PPO's clip; no KL (as the recipe runs)
    "prime": dict(advantage="prime", critic=False, loss_agg="token-mean", **_CLIP,
                  kl_placement="none", kl_estimator="k3", kl_coef=0.0, accuracy_band=(0.2, 0.8)),
}  # fmt: skip
DISTILL_ALGORITHMS = ("opd", "gkd")
TOPK_DIVERGENCES = ("jsd", "forward_kl", "reverse_kl")


class RLConfig(_Config):
    """One RL update of the policy (and critic) on a batch of scored rollouts, on Ray workers (DDP).

    Fields left empty take the algorithm's preset (`RL_PRESETS`); `resolved()` fills them in.
    """

    algorithm: Algorithm = Field("grpo", description="RL algorithm preset (docs/algorithms.md)")
    num_workers: int = Field(2, ge=1, description="Ray workers (torch.distributed data-parallel ranks)")
    # lr and mini_batches default to what the embedded 0.8M-parameter demo model learns with (LLMs want lr ~1e-6).
    # Not higher: Adam's first steps move every weight by ~lr whatever the gradient, and at 5e-4 the demo policy's
    # first update moved it far from the samples it learned from (approx_kl ~1.5) and the reward fell.
    lr: float = Field(1e-4, gt=0, description="policy learning rate (AdamW, constant after warm-up)")
    critic_lr: float = Field(1e-4, gt=0, description="critic learning rate (PPO, VAPO)")
    warmup_steps: int = Field(0, ge=0, description="linear warm-up in optimizer steps, counted across iterations")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    max_grad_norm: float = Field(1.0, ge=0, description="gradient clipping (0 = off)")
    ppo_epochs: int = Field(1, ge=1, description="passes over the batch per update")
    mini_batches: int = Field(4, ge=1, description="optimizer steps per epoch (the batch is cut into this many)")
    micro_batch_size: int = Field(32, ge=1, description="sequences per forward pass on one worker")
    advantage: str | None = Field(
        None,
        json_schema_extra=USER_CODE,
        description="advantage estimator: gae, vapo, grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline, or "
        "your own registered function as 'package.module:function' / 'path/to/file.py:function' (empty: preset)",
    )
    critic: bool | None = Field(None, description="train a critic (value model) beside the policy (empty: preset)")
    policy_loss: str | None = Field(
        None, json_schema_extra=USER_CODE,
        description="policy loss: clip (PPO token ratio), gspo (sequence ratio), cispo (clipped ratio as a weight), "
        "importance_sampling (unclipped ratio), or your own function as 'package.module:function' / 'path/to/file.py:function' (empty: preset)",
    )  # fmt: skip
    clip_low: float | None = Field(None, gt=0, lt=1, description="ratio clip below 1 - clip_low (empty: preset)")
    clip_high: float | None = Field(None, gt=0, description="ratio clip above 1 + clip_high (empty: preset)")
    dual_clip: float | None = Field(3.0, gt=1, description="dual-clip bound c for negative advantages (empty: off)")
    loss_agg: AggMode | None = Field(None, description="how token losses are aggregated (empty: preset)")
    t_max: int | None = Field(None, ge=1, description="seq-mean-token-sum-norm divisor (empty: longest response)")
    kl_placement: Literal["none", "reward", "loss"] | None = Field(
        None, description="KL to the reference: subtracted from the reward, added to the loss, or off (empty: preset)"
    )
    kl_estimator: Literal["k1", "abs", "k2", "k3"] | None = Field(None, description="KL estimator (empty: preset)")
    kl_coef: float | None = Field(None, ge=0, description="KL coefficient beta (empty: preset)")
    kl_target: float | None = Field(
        None,
        gt=0,
        description="adaptive KL (in-reward placement): target KL per response, summed over its tokens "
        "(empty: fixed beta)",
    )
    kl_horizon: int = Field(10_000, ge=1, description="adaptive KL: horizon in samples")
    entropy_coef: float = Field(0.0, ge=0, description="entropy bonus coefficient")
    gamma: float = Field(1.0, ge=0, le=1, description="discount")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda of the policy advantages (PPO)")
    critic_lam: float | None = Field(None, ge=0, le=1, description="GAE lambda of the value targets (empty: preset)")
    vapo_alpha: float = Field(0.05, gt=0, description="VAPO length-adaptive lambda: 1 - 1/(alpha * length)")
    value_clip: float | None = Field(0.2, gt=0, description="value clipping range (empty: off)")
    nll_coef: float | None = Field(None, ge=0, description="NLL loss on correct samples (VAPO; empty: preset)")
    dynamic_sampling: bool | None = Field(
        None, description="drop groups whose rewards are all equal and sample more (DAPO; empty: preset)"
    )
    max_gen_batches: int = Field(3, ge=1, description="dynamic sampling: generation batches before giving up")
    accuracy_band: tuple[float, float] | None = Field(
        None,
        description="train on prompts whose group accuracy lies in [low, high] first: of the rollout's prompts "
        "(max_prompts x oversample_factor) the update keeps 1 / oversample_factor, those in the band first "
        "(empty: preset; prime: (0.2, 0.8))",
    )  # fmt: skip
    oversample_factor: int = Field(
        1, ge=1, description="accuracy band: the rollout samples this many times rollout.max_prompts prompts"
    )
    value_pretrain_steps: int | None = Field(
        None, ge=0, description="critic steps on the initial policy's samples before RL (VAPO; empty: preset)"
    )
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="compute dtype (bfloat16 = autocast)")
    gradient_checkpointing: bool = Field(
        False, description="recompute activations in the backward pass: less memory, about a third more compute"
    )
    train_vision: bool = Field(
        False, description="vision-language models: train the vision tower too (frozen by default)"
    )
    seed: int = Field(0, description="mini-batch order seed")
    lora: LoraConfig | None = Field(
        None, description="train LoRA adapters; the reference is then the base with the adapter disabled"
    )
    distill: DistillConfig | None = Field(
        None, description="a teacher to learn from (opd, gkd; or any algorithm with distill.loss_coef > 0)"
    )
    prime: PrimeConfig | None = Field(
        None, description="PRIME's implicit process reward model (empty: its defaults with algorithm='prime')"
    )
    rollout_lag: int = Field(
        0, ge=0,
        description="off-policy lag L: rollout k+1 samples with policy max(k - L, 0), so with L >= 1 it runs while "
        "update k trains (0: on-policy)",
    )  # fmt: skip
    max_staleness: int | None = Field(
        None, ge=0, description="refuse rows sampled more than this many policy versions ago (empty: rollout_lag)"
    )
    off_policy: str = Field(
        "none", json_schema_extra=USER_CODE,
        description="correction of off-policy rows, a weight on each token's loss from w = pi_prox / mu: none, tis "
        "(min(w, is_cap)), token_mask / seq_mask (w outside [is_low, is_high] rejected), decoupled (w), or your "
        "registered function as 'package.module:function' / 'path/to/file.py:function'",
    )  # fmt: skip
    is_cap: float = Field(2.0, gt=0, description="tis: the truncation of the importance weight")
    is_low: float = Field(0.5, ge=0, description="token_mask, seq_mask: the lowest importance weight kept")
    is_high: float = Field(2.0, gt=0, description="token_mask, seq_mask: the highest importance weight kept")

    def preset(self, name: str):
        """The algorithm's preset value of `name` (None when it has none)."""
        return RL_PRESETS[self.algorithm].get(name)

    def resolved(self) -> RLConfig:
        """This config with every empty field set to the algorithm's preset."""
        defaults = {"critic_lam": self.lam, "nll_coef": 0.0, "dynamic_sampling": False, "value_pretrain_steps": 0}
        update = {}
        names = ("advantage", "critic", "policy_loss", "clip_low", "clip_high", "loss_agg", "kl_placement",
                 "kl_estimator", "kl_coef", "accuracy_band")  # fmt: skip
        for name in (*names, *defaults):
            if getattr(self, name) is None:
                value = self.preset(name)
                update[name] = defaults.get(name) if value is None else value
        for name in ("advantage", "policy_loss", "off_policy"):  # Ray workers load user code by the same reference
            value = update.get(name, getattr(self, name))
            if is_reference(value):
                update[name] = absolute(value)
        if self.distill is not None and self.distill.loss_coef is None:
            coef = 1.0 if self.algorithm == "gkd" else 0.0
            update["distill"] = self.distill.model_copy(update={"loss_coef": coef})
        if self.prime is None and update.get("advantage", self.advantage) == "prime":
            update["prime"] = PrimeConfig()
        if self.distill is not None and is_reference(self.distill.divergence):
            d = update.get("distill", self.distill)
            update["distill"] = d.model_copy(update={"divergence": absolute(d.divergence)})
        return self.model_copy(update=update)

    @property
    def distill_loss_coef(self) -> float:
        """The weight of the supervised divergence (0 without a teacher)."""
        if self.distill is None:
            return 0.0
        return self.distill.loss_coef if self.distill.loss_coef is not None else float(self.algorithm == "gkd")

    @property
    def uses_critic(self) -> bool:
        return bool(self.preset("critic") if self.critic is None else self.critic)

    @model_validator(mode="after")
    def _check(self) -> RLConfig:
        if self.kl_target is not None and (self.kl_placement or self.preset("kl_placement")) != "reward":
            raise ValueError("kl_target (adaptive KL) needs kl_placement='reward'")
        if (self.policy_loss or self.preset("policy_loss")) == "gspo" and self.uses_critic:
            raise ValueError(f"policy_loss='gspo' takes sequence advantages; algorithm '{self.algorithm}' has a critic")
        if self.algorithm in DISTILL_ALGORITHMS and (self.distill is None or not self.distill.teacher):
            raise ValueError(f"rl.algorithm='{self.algorithm}' learns from a teacher: set rl.distill.teacher")
        if (self.advantage or self.preset("advantage")) == "opd" and self.distill is None:
            raise ValueError("rl.advantage='opd' needs the teacher's log-probs: set rl.distill.teacher")
        if (self.advantage or self.preset("advantage")) == "opd" and (self.distill.seq_kd or self.distill.lmbda < 1):
            raise ValueError(
                "on-policy distillation (advantage 'opd') scores the student's own samples: leave rl.distill.lmbda at "
                "1 and seq_kd off (the teacher's samples are for a supervised divergence, e.g. algorithm='gkd')"
            )
        if self.distill_loss_coef > 0 and self.distill.divergence == "k1":
            raise ValueError(
                "rl.distill.divergence='k1' as a supervised loss: its expected gradient is 0 (E[grad log pi] = 0), "
                "nothing of the teacher; use k2, k3, a top-k divergence, or algorithm='opd' (k1 as the advantage)"
            )
        if self.distill_loss_coef > 0 and self.distill.divergence in TOPK_DIVERGENCES and not self.distill.topk:
            raise ValueError(
                f"rl.distill.divergence='{self.distill.divergence}' compares distributions on the teacher's top-k "
                "tokens: set rl.distill.topk > 0"
            )
        band = self.accuracy_band or self.preset("accuracy_band")
        if band is not None and not 0.0 <= band[0] <= band[1] <= 1.0:
            raise ValueError(f"rl.accuracy_band={tuple(band)}: want 0 <= low <= high <= 1")
        if band is not None and (self.dynamic_sampling or self.preset("dynamic_sampling")):
            raise ValueError("rl.accuracy_band and rl.dynamic_sampling both choose the prompts to train on: set one")
        if self.oversample_factor > 1 and band is None:
            raise ValueError(
                "rl.oversample_factor > 1 samples extra prompts for rl.accuracy_band to choose from: set it"
            )
        if self.rollout_lag and (self.distill is not None or self.dynamic_sampling or self.preset("dynamic_sampling")):
            raise ValueError("rl.rollout_lag > 0 cannot be combined with rl.distill or dynamic sampling")
        if self.rollout_lag and (self.advantage or self.preset("advantage")) == "prime":
            raise ValueError("rl.rollout_lag > 0 cannot be combined with PRIME (its PRM trains on the update's rows)")
        if self.is_low > self.is_high:
            raise ValueError(f"rl.is_low={self.is_low} is above rl.is_high={self.is_high}")
        if self.prime is not None and (self.advantage or self.preset("advantage")) != "prime":
            raise ValueError("rl.prime is set, but the advantage is not 'prime': use algorithm='prime'")
        if self.uses_critic and (self.advantage or self.preset("advantage")) not in ("gae", "vapo"):
            if not is_reference(self.advantage or ""):
                raise ValueError(
                    f"critic=True needs a critic's advantage estimator (gae, vapo), not {self.advantage!r}"
                )
        return self


class RLHFFlowConfig(_Config):
    """The RLHF pipeline: data -> base -> (pretraining) -> SFT -> (reward model) -> N x [rollout -> score -> update]."""

    store: str | None = Field(
        None, description="artifact store root (local folder or fsspec URI). Empty: $POSTTRAIN_STORE or ./.posttrain"
    )
    experiment: str = Field("posttrain", description="MLflow experiment name")
    data: DataConfig = Field(default_factory=DataConfig, description="training and evaluation data")
    model: ModelConfig = Field(
        default_factory=ModelConfig, description="base model; with pretrain and sft empty, the policy to start from"
    )
    pretrain: PretrainConfig | None = Field(
        default_factory=PretrainConfig, description="continued pretraining before SFT (empty: skip)"
    )
    sft: SFTConfig | None = Field(default_factory=SFTConfig, description="SFT before RL (empty: start from the model)")
    reward_model: RewardModelConfig | None = Field(
        None, description="train a Bradley-Terry reward model and add its score (score.reward_model_weight)"
    )
    iterations: int = Field(8, ge=1, description="RL iterations of rollout -> score -> update")
    rollout: RolloutConfig = Field(
        # 4,096 samples per iteration: with 1,024 the tiny demo model's updates were mostly noise (docs/performance.md)
        default_factory=lambda: RolloutConfig(n=16, max_prompts=256, max_tokens=32),
        description="sampling; max_prompts = prompts per iteration, taken in turn from the training prompts",
    )
    score: ScoreConfig = Field(default_factory=ScoreConfig, description="rewards")
    rl: RLConfig = Field(default_factory=RLConfig, description="the RL update")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="held-out evaluation before and after RL")
    eval_every: int = Field(
        0, ge=0, description="also evaluate every k iterations, greedy and sampled (0 = only before and after)"
    )
    eval_samples: int = Field(
        8,
        ge=0,
        description="held-out sampled accuracy: samples per held-out prompt at the rollout temperature (0 = off)",
    )

    @model_validator(mode="after")
    def _check(self) -> RLHFFlowConfig:
        if self.rollout.max_prompts is None:
            raise ValueError("rollout.max_prompts (prompts per iteration) must be set for RL")
        if self.rl.algorithm != "rloo" and self.rl.resolved().advantage in ("grpo", "dr_grpo") and self.rollout.n < 2:
            raise ValueError(f"rl.algorithm='{self.rl.algorithm}' compares samples of a prompt: rollout.n must be >= 2")
        if self.rl.algorithm == "rloo" and self.rollout.n < 2:
            raise ValueError("rl.algorithm='rloo' needs rollout.n >= 2 (leave-one-out baseline)")
        if self.score.reward_model_weight and self.reward_model is None:
            raise ValueError("score.reward_model_weight is set but reward_model (its training config) is empty")
        return self
