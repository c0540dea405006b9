"""The Engine protocol every generation backend implements, and the sampling settings it takes.

An engine turns a `prompts` table into a `rollouts` table (schemas in `posttrain_core.data.schemas`), with the
engine's own per-token log-probs of the sampled tokens. Engines live inside Ray actors (one per actor).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import pyarrow as pa

from posttrain_core.data.schemas import SCHEMAS

# The columns every engine returns, in the rollouts schema's order (declared once, in data/schemas.py).
ROLLOUT_COLUMNS: tuple[str, ...] = tuple(SCHEMAS["rollouts"].names)


@dataclass(frozen=True)
class SamplingSettings:
    """Plain, picklable sampling parameters (built from `RolloutConfig`; crosses the Ray boundary)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 32
    stop: tuple[str, ...] = field(default_factory=tuple)
    seed: int = 0


class Engine(Protocol):
    """A generation backend (HF generate, vLLM)."""

    def generate(self, prompts: pa.Table, params: SamplingSettings) -> pa.Table:
        """n samples per prompt row -> rows of the `rollouts` schema (prompt_id, sample_index, prompt_ids,
        response_ids, response_text, logprobs, finish_reason, policy_digest, answer, ...)."""
        ...

    def update_weights(self, model_path: str) -> None:
        """Load new policy weights in place (the RL loop calls this every iteration)."""
        ...
