"""What an RL update's artifact holds besides the policy: `critic/` and `trainer_state.pt` (optimizer moments, step
counters, the adaptive KL coefficient), so that the next update continues them; written and read here.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from posttrain_core.config import RLConfig

# The optimizer state and counters beside a trained model's weights, here and in a `posttrain serve` checkpoint: what
# lets training continue exactly where it stopped. peft and transformers never read it.
STATE_FILE = "trainer_state.pt"
CRITIC_DIR = "critic"


def save_update(outdir: str | os.PathLike, policy: Any, tokenizer: Any, critic: Any, state: dict[str, Any]) -> dict:
    """Policy (HF folder or adapter; None: not trained), critic (`critic/`) and trainer state, each file written
    atomically; returns the policy's model info."""
    import torch

    from posttrain_core.artifacts import start_writeback
    from posttrain_core.models.loading import save_checkpoint

    out = Path(outdir)
    info: dict = save_checkpoint(policy, tokenizer, out) if policy is not None else {}
    if critic is not None:
        critic.save_pretrained(str(out / CRITIC_DIR), safe_serialization=True)
    start_writeback(out)  # the disk takes the weights while the optimizer state is written
    tmp = out / f".{STATE_FILE}.tmp"
    torch.save(_interned(state), tmp)
    os.replace(tmp, out / STATE_FILE)
    start_writeback(out / STATE_FILE)
    return info


def load_trainer_state(path: str | None) -> dict[str, Any]:
    """The trainer state of a previous update (empty for a policy that no update produced)."""
    import torch

    return torch.load(path, weights_only=False) if path else {}


def optimizer_settings(cfg: RLConfig, lr: float) -> SimpleNamespace:
    """The TrainConfig fields `build_optimizer` reads, for a constant learning rate after `cfg.warmup_steps`."""
    return SimpleNamespace(
        lr=lr, weight_decay=cfg.weight_decay, warmup_steps=cfg.warmup_steps, schedule="constant",
        min_lr_ratio=1.0, max_steps=1,
    )  # fmt: skip


def _interned(obj: Any) -> Any:
    """`obj` with every string dict key interned, so that its pickle does not depend on where the keys came from.

    Pickle writes a string once and refers back to it when the *same object* recurs. The optimizer's state keys
    ("step", "exp_avg", ...) are interned literals when AdamW created them, and fresh strings when
    `load_state_dict` unpickled them: the same state would give two byte streams (warm ranks continuing in memory
    vs fresh ranks reloading), hence two artifact digests for one policy.
    """
    if isinstance(obj, dict):
        return {(sys.intern(k) if isinstance(k, str) else k): _interned(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_interned(v) for v in obj)
    return obj
