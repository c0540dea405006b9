"""The Engine protocol every generation backend implements, and the sampling settings it takes.

An engine turns a `prompts` table into a `rollouts` table (schemas in `posttrain_core.data.schemas`), with the
engine's own per-token log-probs of the sampled tokens. Engines live inside Ray actors (`rollout.worker`), one each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import pyarrow as pa

from posttrain_core.data.schemas import SCHEMAS
from posttrain_core.rollout.multiturn import ToolSettings

# The columns every engine returns, in the rollouts schema's order (declared once, in data/schemas.py).
ROLLOUT_COLUMNS: tuple[str, ...] = tuple(SCHEMAS["rollouts"].names)
# The multi-turn columns of a single-turn sample.
SINGLE_TURN = {"response_mask": None, "turns": None, "num_turns": 1, "num_tool_calls": 0, "tool_errors": 0}


def policy_lengths(rollouts: pa.Table) -> list[int]:
    """Tokens the policy sampled in each row: mask-1 tokens (tool turns are not the policy's length), or all of a
    single-turn row's."""
    ids, masks = rollouts.column("response_ids").to_pylist(), rollouts.column("response_mask").to_pylist()
    return [sum(m) if m is not None else len(x) for x, m in zip(ids, masks, strict=True)]


TEACHER_COLUMNS = ("teacher_logprobs", "teacher_topk_ids", "teacher_topk_logprobs")


def teacher_columns(
    logprobs: list[list[float]], topk_ids: list[list[list[int]]] | None, topk_logprobs: list[list[list[float]]] | None
) -> pa.Table:
    """The teacher columns of scored rows (`Engine.score`): per row, the log-prob of each response token and, with
    top-k, R x K token ids and their log-probs (null without top-k)."""
    none = [None] * len(logprobs)
    return pa.table(
        {
            "teacher_logprobs": pa.array(logprobs, pa.list_(pa.float32())),
            "teacher_topk_ids": pa.array(topk_ids or none, pa.list_(pa.list_(pa.int32()))),
            "teacher_topk_logprobs": pa.array(topk_logprobs or none, pa.list_(pa.list_(pa.float32()))),
        }
    )


@dataclass(frozen=True)
class SamplingSettings:
    """Plain, picklable sampling parameters (built from a rollout or eval config; crosses the Ray boundary)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # sample among the k most likely tokens only; 0: all
    max_tokens: int = 32
    stop: tuple[str, ...] = field(default_factory=tuple)
    seed: int = 0
    tools: ToolSettings | None = None  # multi-turn with tool calls (`rollout.multiturn`); None: one turn


class Engine(Protocol):
    """A generation backend: `hf_engine.HFEngine` (transformers, CPU or GPU) or `vllm_engine.VLLMEngine`.

    Engines are built from a model folder (full model or LoRA adapter) and the digest of the artifact it is, which
    they write into every row's `policy_digest`.
    """

    def generate(self, prompts: pa.Table, params: SamplingSettings) -> pa.Table:
        """n samples per prompt row (`prompt_id`, `messages`, optional `answer`) -> rows of the `rollouts` schema,
        ordered by (prompt row, sample_index), with the raw model log-prob of every sampled token."""
        ...

    def load(self, model_path: str, policy_digest: str) -> str:
        """Serve another policy from its folder: "updated" (in place: vLLM's weight reload or adapter swap) or
        "reloaded" (the engine loaded it anew in the same process)."""
        ...

    def load_weights(self, weights: dict[str, Any], policy_digest: str) -> None:
        """Take a full model's weights from memory (name -> array, the model's own state-dict keys), in place.

        Raises:
            NotImplementedError: the engine only loads folders (vLLM).
            ValueError: the weights do not fit the loaded model, or it serves a LoRA adapter.
        """
        ...

    def score(self, rows: pa.Table, topk: int) -> pa.Table:
        """The served model as a teacher of `rows` (`prompt_ids`, `response_ids`): one forward pass over prompt +
        response, at temperature 1 -> `teacher_columns`, in row order. Column j of a row is the raw log-prob of
        response token j given the prompt and response tokens before it; with topk > 0 also the k most likely
        tokens at that position (most likely first) and their log-probs.

        Raises:
            ValueError: a row does not fit the model's context, or topk exceeds what the engine can return.
        """
        ...

    def close(self) -> None:
        """Free the engine's memory."""
        ...
