"""The engine actor: one `Engine` per Ray actor, serving one policy at a time; every generating stage runs on it.

It is imported inside vLLM actors too (another environment): module-level imports stay light (pyarrow only).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from posttrain_core.rollout.engine import SamplingSettings

if TYPE_CHECKING:
    from posttrain_core.artifacts.node import NodePath

log = logging.getLogger(__name__)

# Rows generated with an RL update's weights before its artifact (and so its digest) existed carry this stamp and
# the artifact's key: no published policy's digest equals it, so only the rollout stage of that very artifact can
# take them (`take_prefetched`).
PENDING = "pending:"
ENGINE_SECONDS = "_engine_seconds"  # each row's share of its batch's engine time (a stage metric); dropped on write


@dataclass(frozen=True)
class _Prefetched:
    key: str
    params: SamplingSettings
    prompt_ids: list[list[str]]  # per batch
    rows: list[pa.Table]  # per batch, stamped PENDING + key


class RolloutWorker:
    """A Ray actor holding one engine (`hf` or `vllm`): load a policy, generate, take a policy's weights in memory.

    Besides the `rollouts` columns, `generate` keeps each prompt's `messages` (reward models re-render the chat
    with their own template) and `meta` (reward functions read the prompt's other columns), and adds
    `_engine_seconds` for the stage's throughput metric. The rows record the
    digest of the policy this actor serves, whatever the engine wrote.
    """

    def __init__(
        self,
        engine: str,
        model_path: str | NodePath,
        policy_digest: str,
        dtype: str = "float32",
        seed: int = 0,
        num_threads: int | None = None,
    ):
        from posttrain_core.artifacts.node import at
        from posttrain_core.cluster import keep_freed_memory

        keep_freed_memory()
        model_path = at(model_path)  # a NodePath: the policy is fetched into this node's cache
        if engine == "hf" and num_threads:
            import torch

            torch.set_num_threads(num_threads)
        self.kind = engine
        if engine == "hf":
            from posttrain_core.rollout.hf_engine import HFEngine

            self.engine = HFEngine(model_path, dtype=dtype, policy_digest=policy_digest)
        else:
            from posttrain_core.rollout.vllm_engine import VLLMEngine

            self.engine = VLLMEngine(model_path, dtype=dtype, seed=seed, policy_digest=policy_digest)
        self.policy_digest: str | None = policy_digest
        self.prefetched: _Prefetched | None = None

    def load(self, model_path: str | NodePath, policy_digest: str) -> str:
        """Serve the policy at `model_path` (digest `policy_digest`): "kept" (already served), else the engine's
        "updated" (in place) or "reloaded"."""
        self.prefetched = None
        if policy_digest == self.policy_digest:
            return "kept"
        from posttrain_core.artifacts.node import at

        self.policy_digest = None  # if the load fails half-way, no policy is claimed for the weights
        action = self.engine.load(at(model_path), policy_digest)
        self.policy_digest = policy_digest
        return action

    def served_digest(self) -> str | None:
        """The digest of the policy this actor serves (what its rows record)."""
        return self.policy_digest

    def generate(self, batch: pa.Table, params: SamplingSettings) -> pa.Table:
        started = time.perf_counter()
        out = self.engine.generate(batch, params)
        seconds = time.perf_counter() - started
        n = out.num_rows
        stamp = pa.array([self.policy_digest] * n, pa.string())
        out = out.set_column(out.schema.get_field_index("policy_digest"), "policy_digest", stamp)
        row_of = {pid: i for i, pid in enumerate(batch.column("prompt_id").to_pylist())}
        index = pa.array([row_of[pid] for pid in out.column("prompt_id").to_pylist()], pa.int64())
        out = out.append_column("messages", batch.column("messages").take(index))
        if "meta" in batch.column_names:  # the prompt's other columns, for reward functions
            out = out.append_column("meta", batch.column("meta").take(index))
        return out.append_column(ENGINE_SECONDS, pa.array([seconds / max(n, 1)] * n, pa.float64()))

    def score(self, rows: pa.Table, topk: int) -> pa.Table:
        """The served model as a teacher of `rows` (`Engine.score`): the teacher columns, in row order."""
        return self.engine.score(rows, topk)

    def prefetch(self, weights: dict[str, Any], key: str, batches: list[pa.Table], params: SamplingSettings) -> bool:
        """Take the weights of the RL update that will publish artifact `key` and generate `batches` with them now,
        keeping the rows for `take_prefetched`. On failure (the weights do not fit, an engine that only loads
        folders) nothing is kept and no policy is claimed: the next `load` reloads from the store."""
        self.prefetched, self.policy_digest = None, None
        try:
            self.engine.load_weights(weights, PENDING + key)
            self.policy_digest = PENDING + key
            rows = [self.generate(b, params) for b in batches]
        except Exception as err:  # noqa: BLE001 - the stage that follows generates instead
            log.warning("prefetch of %s failed (%s: %s); the rollout stage will load the policy", key[:12],
                        type(err).__name__, err)  # fmt: skip
            self.policy_digest = None
            return False
        ids = [b.column("prompt_id").to_pylist() for b in batches]
        self.prefetched = _Prefetched(key, params, ids, rows)
        return True

    def take_prefetched(
        self, key: str, policy_digest: str, prompt_ids: list[list[str]], params: SamplingSettings
    ) -> list[pa.Table] | None:
        """The rows `prefetch` made for artifact `key`, now published as `policy_digest`, if they are these very
        batches and settings: the actor then serves the policy under that digest and the rows record it. None
        (nothing changed) otherwise."""
        pre, self.prefetched = self.prefetched, None
        if pre is None or self.policy_digest != PENDING + key:
            return None
        if pre.key != key or pre.params != params or pre.prompt_ids != prompt_ids:
            return None
        self.policy_digest = policy_digest
        out = []
        for table in pre.rows:
            column = pa.array([policy_digest] * table.num_rows, pa.string())
            out.append(table.set_column(table.schema.get_field_index("policy_digest"), "policy_digest", column))
        return out

    def close(self) -> None:
        self.engine.close()
