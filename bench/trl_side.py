"""The TRL contender of `bench.trl_bench`, run in a process of its own (or one per rank under torchrun).

    python -m bench.trl_side SPEC.json          # SPEC: {"mode": "sft" | "grpo" | "rollout", ..., "out": RESULT.json}

Reads the spec the driver wrote (model folder, data, settings), runs TRL's trainer on it and writes the per-step
timings and this process's peak RSS. Under torchrun every rank writes RESULT.json.rank{N}.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _optimizer_args(spec: dict) -> dict:
    """What both TRL trainers share with posttrain's side: constant lr, AdamW(0.9, 0.95), clip 1, and gradient
    checkpointing as set for both (TRL turns it on by default; posttrain's default is off)."""
    return dict(
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.95,
        max_grad_norm=1.0,
        gradient_checkpointing=bool(spec.get("gradient_checkpointing", False)),
    )


def _peft_config(spec: dict):
    """LoRA adapters as posttrain builds them from the same settings (its LoraConfig defaults: the attention
    projections), or None for full training."""
    if not spec.get("lora"):
        return None
    from peft import LoraConfig

    from posttrain_core.config import LoraConfig as Ours

    ours = Ours(**spec["lora"])
    return LoraConfig(
        r=ours.r, lora_alpha=ours.alpha, lora_dropout=ours.dropout, target_modules=ours.target_modules,
        task_type="CAUSAL_LM",
    )  # fmt: skip


def _threads(spec: dict) -> None:
    import torch

    torch.set_num_threads(int(spec["threads"]))


class _StepClock:
    """A TrainerCallback recording wall time at train begin and at every optimizer step's end."""

    def __init__(self):
        from transformers import TrainerCallback

        clock = self

        class CB(TrainerCallback):
            def on_train_begin(self, args, state, control, **kw):
                clock.begin = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                clock.ends.append(time.perf_counter())

        self.begin, self.ends, self.callback = 0.0, [], CB()

    def step_seconds(self) -> list[float]:
        marks = [self.begin, *self.ends]
        return [b - a for a, b in zip(marks, marks[1:], strict=False)]


def run_sft(spec: dict) -> dict:
    import torch
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    class InOrderSFTTrainer(SFTTrainer):
        """Examples in the dataset's order: the driver laid them out as posttrain's global batches, per rank."""

        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    examples = json.loads(open(spec["data"]).read())  # [[input_ids, labels], ...] in step order
    ds = Dataset.from_dict({"input_ids": [e[0] for e in examples], "labels": [e[1] for e in examples]})
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    args = SFTConfig(
        output_dir=spec["workdir"],
        max_steps=spec["steps"],
        per_device_train_batch_size=spec["per_device_batch"],
        gradient_accumulation_steps=1,
        **_optimizer_args(spec),
        max_length=spec["max_len"],
        packing=False,
        padding_free=False,
        logging_steps=10**6,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=bool(spec.get("bf16")),  # on CPU: torch.autocast(bfloat16), fp32 weights, as posttrain's dtype field
        fp16=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=spec["seed"],
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
    )
    clock = _StepClock()
    trainer = InOrderSFTTrainer(
        model=model, args=args, train_dataset=ds, processing_class=tokenizer, callbacks=[clock.callback],
        peft_config=_peft_config(spec),
    )  # fmt: skip
    t0 = time.perf_counter()
    trainer.train()
    return {"step_seconds": clock.step_seconds(), "train_s": time.perf_counter() - t0}


def run_grpo(spec: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from posttrain_core.rewards.verifiers import exact_match

    prompts = json.loads(open(spec["data"]).read())  # [{"prompt": messages, "answer": str}, ...] in order
    ds = Dataset.from_list(prompts)
    tokenizer = AutoTokenizer.from_pretrained(spec["model"], padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)

    def reward(prompts, completions, answer, **kw):  # posttrain's own verifier on both sides
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [exact_match(None, t, a)["exact_match"] for t, a in zip(texts, answer, strict=True)]

    n, batch = spec["n"], spec["prompts"] * spec["n"]
    args = GRPOConfig(
        output_dir=spec["workdir"],
        max_steps=spec["steps"],
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        num_generations=n,
        max_completion_length=spec["max_tokens"],
        temperature=spec["temperature"],
        top_p=1.0,
        beta=spec["kl_coef"],
        epsilon=0.2,
        loss_type="dapo",  # token-mean over the batch: posttrain's grpo preset
        **_optimizer_args(spec),
        shuffle_dataset=False,
        logging_steps=10**6,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
        seed=spec["seed"],
        log_completions=False,
    )
    clock = _StepClock()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=ds,
        processing_class=tokenizer,
        callbacks=[clock.callback],
        peft_config=_peft_config(spec),
    )
    t0 = time.perf_counter()
    trainer.train()
    return {"step_seconds": clock.step_seconds(), "train_s": time.perf_counter() - t0}


def main(argv: list[str]) -> None:
    from posttrain_core.env import apply_defaults

    apply_defaults()
    spec = json.loads(open(argv[0]).read())
    _threads(spec)
    import transformers

    transformers.logging.set_verbosity_error()
    result = {"sft": run_sft, "grpo": run_grpo}[spec["mode"]](spec)
    from bench.common import peak_rss_mb

    result["peak_rss_mb"] = peak_rss_mb()
    rank = os.environ.get("RANK")
    out = spec["out"] + (f".rank{rank}" if rank is not None else "")
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1:])
