"""Warm rollout engines: actors that outlive one rollout stage and take each new policy's weights in memory.

Without a pool, every rollout stage starts its engine actors (process, torch/vLLM imports, model load: most of a
short RL iteration on CPU) and they die with the stage. An `EnginePool`, owned by the flow run's process, keeps
`num_engines` named actors (`posttrain-rollout-<pool>-<i>`) alive between stages; the next rollout stage calls
`load(policy)` on each before it generates:

- same policy digest: nothing to do ("kept");
- vLLM, full model: an in-place weight update (`VLLMEngine.update_weights`, no restart) ("updated");
- vLLM, LoRA adapter: an adapter swap on the same base ("updated"); an engine started without LoRA is rebuilt;
- hf engine: the published checkpoint is loaded again in the same process ("reloaded": no actor start or imports);
- hf engine, prefetched: the RL update that made the policy already gave the actors its weights in memory and
  started this stage's generation while it saved and published its checkpoint (`prefetch`); the stage takes the
  rows once the artifact is published ("prefetched").

The stage then asks every actor for the digest it now serves and refuses to generate unless it is the policy's, and
every row records the digest of the engine that generated it, so stale weights can never go unnoticed.

The actors are not detached: they die with the process that made them (a crashed flow leaves none behind; the
resumed run starts new ones from the latest published checkpoint). They reserve no Ray CPUs, so the trainer
workers of the RL update can be scheduled while they idle; each sets its own thread count instead.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

if TYPE_CHECKING:
    from posttrain_core.config import RolloutConfig
    from posttrain_core.rollout.engine import SamplingSettings

log = logging.getLogger(__name__)

_POOLS: dict[str, EnginePool] = {}
_LOCK = threading.Lock()


def new_pool_name(prefix: str = "flow") -> str:
    """A name no other process of the Ray cluster uses (two flow runs at once each get their own engines)."""
    return f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def get_pool(name: str) -> EnginePool:
    """The pool called `name` in this process (made empty on first use)."""
    with _LOCK:
        if name not in _POOLS:
            _POOLS[name] = EnginePool(name)
        return _POOLS[name]


def release_pool(name: str) -> None:
    """Stop the pool's actors and forget it (a no-op for an unknown name)."""
    with _LOCK:
        pool = _POOLS.pop(name, None)
    if pool is not None:
        pool.close()


@dataclass
class _Prefetch:
    """Generation started with an RL update's weights before its artifact `key` was published."""

    key: str
    spec: tuple
    prompt_ids: list[list[str]]  # per batch
    params: SamplingSettings
    taken: list[Any]  # per actor: `take_weights` (returns the stamp; raises if the weights did not fit)
    futures: list[Any]  # per batch: the actor's rows (stamped PENDING + key)
    adopted: str | None = None  # the published artifact's digest, once `load` matched it
    adopting: list[Any] | None = None  # per actor: `adopt` (True)


class EnginePool:
    """`num_engines` long-lived `RolloutWorker` actors serving one policy at a time (see the module docstring)."""

    def __init__(self, name: str):
        self.name = name
        self.actors: list[Any] = []
        self.spec: tuple | None = None  # (engine, dtype, num_engines, vllm_python) the actors were started with
        self.digest: str | None = None  # the policy the actors serve (after `load`)
        self.prefetched: _Prefetch | None = None
        self.lock = threading.Lock()  # one stage at a time uses the pool

    def _spec(self, cfg: RolloutConfig) -> tuple:
        return (cfg.engine, cfg.dtype, cfg.num_engines, cfg.vllm_python)

    def _start(self, cfg: RolloutConfig, model_path: str, digest: str, params: SamplingSettings) -> None:
        import ray

        from posttrain_core.rollout.stage import RolloutWorker, vllm_options

        options: dict[str, Any] = {"num_cpus": 0}
        if cfg.engine == "vllm":
            options["runtime_env"] = vllm_options(cfg)["runtime_env"]
        threads = max(1, (os.cpu_count() or 1) // cfg.num_engines)
        cls = ray.remote(RolloutWorker)
        self.actors = [
            cls.options(name=f"posttrain-rollout-{self.name}-{i}", **options).remote(
                engine=cfg.engine,
                model_path=model_path,
                policy_digest=digest,
                params=params,
                dtype=cfg.dtype,
                num_threads=threads,
            )
            for i in range(cfg.num_engines)
        ]
        self.spec = self._spec(cfg)

    def load(
        self, cfg: RolloutConfig, model_path: str, digest: str, params: SamplingSettings, key: str | None = None
    ) -> dict[str, Any]:
        """Make every actor serve `model_path` (digest `digest`, artifact key `key`); start them if there are none or
        the engine settings changed, or if one died (a fault in an earlier stage). If a prefetch (`prefetch`) ran
        with the weights of artifact `key`, the actors keep them and `generate` can take its rows.

        Returns:
            {"action": started | kept | updated | reloaded | prefetched, "load_s": seconds}.

        Raises:
            RuntimeError: an actor reports another digest after the load (it would generate with stale weights).
        """
        import ray
        from ray.exceptions import RayActorError

        started = time.perf_counter()
        action = "started"
        prefetched, self.prefetched = self.prefetched, None
        if prefetched is not None and self._adopt(prefetched, cfg, key, digest):
            self.prefetched, self.digest = prefetched, digest
            seconds = time.perf_counter() - started
            log.info("rollout pool %s: %d engines generated with the policy's weights before it was published",
                     self.name, len(self.actors))  # fmt: skip
            return {"action": "prefetched", "load_s": seconds}
        if self.actors and self.spec == self._spec(cfg):
            try:
                actions = ray.get([a.load.remote(model_path, digest) for a in self.actors])
                action = actions[0] if len(set(actions)) == 1 else "+".join(sorted(set(actions)))
            except RayActorError as err:
                log.warning("rollout pool %s: an engine actor died (%s); starting new ones", self.name, err)
                self.close()
        elif self.actors:
            self.close()
        if not self.actors:
            self._start(cfg, model_path, digest, params)
        served = ray.get([a.served_digest.remote() for a in self.actors])
        if any(d != digest for d in served):
            raise RuntimeError(
                f"rollout pool {self.name}: engines serve policy digests {served} after loading {model_path} "
                f"(digest {digest}); refusing to generate with stale weights"
            )
        self.digest = digest
        seconds = time.perf_counter() - started
        log.info("rollout pool %s: %d %s engines %s the policy in %.1f s", self.name, len(self.actors),
                 cfg.engine, action, seconds)  # fmt: skip
        return {"action": action, "load_s": seconds}

    def _adopt(self, pre: _Prefetch, cfg: RolloutConfig, key: str | None, digest: str) -> bool:
        """Whether the prefetch's actors hold the weights of artifact `key` and now serve them as `digest`."""
        import ray

        from posttrain_core.rollout.stage import PENDING

        if key != pre.key or pre.spec != self._spec(cfg) or not self.actors:
            return False
        try:  # the weights were taken before the actors started generating; the rows are not waited for here
            stamps = ray.get(pre.taken)
        except Exception as err:  # noqa: BLE001 - weights that did not fit, or a dead actor: `load` handles it
            log.warning("rollout pool %s: prefetch unusable (%s: %s)", self.name, type(err).__name__, err)
            return False
        if stamps != [PENDING + key] * len(self.actors):
            return False
        pre.adopting = [a.adopt.remote(key, digest) for a in self.actors]  # after their prefetched generate calls
        pre.adopted = digest
        return True

    def prefetch(
        self,
        cfg: RolloutConfig,
        weights: Callable[[], Any],
        key: str,
        batches: list[pa.Table],
        params: SamplingSettings,
        serving: str,
    ) -> bool:
        """Give the actors the weights of the RL update that will publish artifact `key` (`weights()`: an object
        ref of its state dict, asked for only when the prefetch applies) and start generating
        `batches` (batch i on actor i mod n), without waiting. Only when the actors run the same engine settings
        and serve `serving` (the update's input policy: same architecture and tokenizer); returns whether it
        started. The rows are stamped `pending:<key>`; `load(..., key=key)` and `generate` take them for the
        artifact's digest, and any other load or batch discards them.
        """
        from posttrain_core.rollout.stage import PENDING

        with self.lock:
            if not self.actors or self.spec != self._spec(cfg) or self.digest != serving or cfg.engine != "hf":
                return False
            self.digest = None  # the actors are about to hold other weights
            # Ray runs one caller's calls to an actor in order: every actor takes the weights, then generates.
            state = weights()
            taken = [a.take_weights.remote(state, key) for a in self.actors]
            futures = [self.actors[i % len(self.actors)].generate.remote(b, params) for i, b in enumerate(batches)]
            ids = [b.column("prompt_id").to_pylist() for b in batches]
            self.prefetched = _Prefetch(key, self._spec(cfg), ids, params, taken, futures)
            log.info("rollout pool %s: generating %d batches of the next rollout with the weights of %s (%s...)",
                     self.name, len(batches), PENDING.rstrip(":"), key[:12])  # fmt: skip
            return True

    def generate(self, batches: list[pa.Table], params: SamplingSettings) -> list[pa.Table]:
        """Every batch through the actors, each actor taking the next batch when it is free; or the rows of an
        adopted prefetch of these very batches and settings, stamped with the adopted digest."""
        import ray
        from ray.util import ActorPool

        pre, self.prefetched = self.prefetched, None
        ids = [b.column("prompt_id").to_pylist() for b in batches]
        if pre is not None and pre.adopted and pre.prompt_ids == ids and pre.params == params:
            rows = ray.get(pre.futures)
            if not all(ray.get(pre.adopting)):
                raise RuntimeError(f"rollout pool {self.name}: an engine changed weights during a prefetch")
            return [_restamp(t, pre) for t in rows]
        pool = ActorPool(self.actors)
        return list(pool.map_unordered(lambda a, b: a.generate.remote(b, params), batches))

    def close(self) -> None:
        import ray

        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception as err:  # already dead, or Ray shut down first
                log.debug("rollout pool %s: kill: %s", self.name, err)
        self.actors, self.spec, self.digest, self.prefetched = [], None, None, None


def _restamp(table: pa.Table, pre: _Prefetch) -> pa.Table:
    """Prefetched rows under the adopted digest; every row must carry the prefetch's pending stamp."""
    from posttrain_core.rollout.stage import PENDING

    stamps = set(table.column("policy_digest").to_pylist())
    if stamps != {PENDING + pre.key}:
        raise RuntimeError(f"prefetched rollout rows carry policy stamps {sorted(stamps)}, not {PENDING}{pre.key}")
    column = pa.array([pre.adopted] * table.num_rows, pa.string())
    return table.set_column(table.schema.get_field_index("policy_digest"), "policy_digest", column)
