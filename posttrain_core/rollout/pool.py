"""The engines of a warm group: `num_engines` `RolloutWorker` actors serving one policy at a time.

Rollout and evaluation stages both generate here. Within a flow run the actors outlive the stage (`WarmGroup`), and
the next stage makes them serve its policy before it generates:

- the digest they serve is the policy's: nothing to do ("kept");
- vLLM: an in-place weight update or an adapter swap ("updated");
- hf engine: the checkpoint is loaded again in the same process ("reloaded": no actor start or imports);
- hf engine, prefetched: the RL update that made the policy gave the actors its weights in memory and they
  generated this stage's batches while the update saved and published its checkpoint (`prefetch`); the stage takes
  those rows once the artifact exists ("prefetched").

Either way the stage then asks every actor for the digest it serves and refuses to go on unless it is the policy's,
and every row records the digest of the engine that generated it, so stale weights never go unnoticed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from posttrain_core.artifacts.node import NodePath
from posttrain_core.rollout.engine import SamplingSettings
from posttrain_core.rollout.worker import PENDING, RolloutWorker
from posttrain_core.warm import WarmGroup, counted

log = logging.getLogger(__name__)

ROLE = "engines"


@dataclass(frozen=True)
class EngineSpec:
    """What engine actors are started with; a stage with other settings starts other actors."""

    engine: str = "hf"
    dtype: str = "float32"
    num_engines: int = 1
    vllm_python: str | None = None

    @classmethod
    def of(cls, cfg: Any) -> EngineSpec:
        """From a config with `engine`, `dtype`, `num_engines` and `vllm_python` (a `RolloutConfig`)."""
        return cls(cfg.engine, cfg.dtype, cfg.num_engines, cfg.vllm_python)

    @property
    def key(self) -> str:
        raw = f"{self.engine}|{self.dtype}|{self.num_engines}|{self.vllm_python}"
        return f"{self.engine}-{self.num_engines}-{hashlib.sha256(raw.encode()).hexdigest()[:8]}"


class EnginePool:
    """The engine actors of `warm` with the settings `spec` (see the module docstring). `role`: which of the warm
    group's actor sets they are: the policy's engines, or a teacher's (`rollout.teacher`), which keeps its weights.

    The group keeps a set per engine count (`key`), as it does ranks: a flow's rollouts and evaluations often run on
    different counts, and each count's set stays warm for the next stage that asks for it. Settings other than the
    count (engine, dtype) replace the set of that count."""

    def __init__(self, warm: WarmGroup, spec: EngineSpec, role: str = ROLE):
        self.warm, self.spec, self.role = warm, spec, role
        self.key = counted(role, spec.num_engines)
        self.actors: list[Any] = []

    def serve(self, model_path: str | NodePath, digest: str, seed: int = 0) -> dict[str, Any]:
        """Make every actor serve the policy at `model_path` (artifact digest `digest`), starting them if needed;
        each actor reads it on its own node (`artifacts.node`).

        Returns:
            {"action": started | kept | updated | reloaded, "load_s": seconds}.

        Raises:
            RuntimeError: an actor reports another digest after the load (it would generate with stale weights).
        """
        import ray
        from ray.exceptions import RayActorError

        started_at = time.perf_counter()
        n = self.spec.num_engines

        def start() -> list[Any]:
            return self._start(model_path, digest, seed)

        self.actors, started = self.warm.get(self.key, self.spec.key, n, start)
        action = "started"
        if not started:
            try:
                actions = ray.get([a.load.remote(model_path, digest) for a in self.actors])
                action = actions[0] if len(set(actions)) == 1 else "+".join(sorted(set(actions)))
            except RayActorError as err:
                log.warning("engines of %s: an engine actor died (%s); starting new ones", self.warm.name, err)
                self.warm.discard(self.key)
                self.actors, _ = self.warm.get(self.key, self.spec.key, n, start)
        served = ray.get([a.served_digest.remote() for a in self.actors])
        if any(d != digest for d in served):
            raise RuntimeError(
                f"engines of {self.warm.name}: serve policy digests {served} after loading {model_path} (digest "
                f"{digest}); refusing to generate with stale weights"
            )
        seconds = time.perf_counter() - started_at
        log.info("engines of %s: %d %s engines %s the policy in %.1f s", self.warm.name, n, self.spec.engine, action,
                 seconds)  # fmt: skip
        return {"action": action, "load_s": seconds}

    def _start(self, model_path: str | NodePath, digest: str, seed: int) -> list[Any]:
        import ray

        from posttrain_core.cluster import spread

        options: dict[str, Any] = {"num_cpus": 0}
        if self.spec.engine == "vllm":
            from posttrain_core.rollout.vllm_env import vllm_options

            options["runtime_env"] = vllm_options(self.spec)["runtime_env"]
        threads = max(1, (os.cpu_count() or 1) // self.spec.num_engines)
        cls = ray.remote(RolloutWorker)
        return [
            cls.options(**options, scheduling_strategy=place).remote(
                engine=self.spec.engine,
                model_path=model_path,
                policy_digest=digest,
                dtype=self.spec.dtype,
                seed=seed,
                num_threads=threads,
            )  # fmt: skip
            for place in spread(self.spec.num_engines)
        ]

    def generate(self, batches: list[pa.Table], params: SamplingSettings) -> list[pa.Table]:
        """Every batch through the actors that `serve` readied, each actor taking the next batch when it is free."""
        from ray.util import ActorPool

        if not self.actors:
            raise RuntimeError("EnginePool.generate before serve")
        pool = ActorPool(self.actors)
        return list(pool.map_unordered(lambda a, b: a.generate.remote(b, params), batches))

    def score(self, batches: list[pa.Table], topk: int) -> list[pa.Table]:
        """Every batch of rollout rows scored by the served model (`RolloutWorker.score`), in batch order."""
        from ray.util import ActorPool

        if not self.actors:
            raise RuntimeError("EnginePool.score before serve")
        return list(ActorPool(self.actors).map(lambda a, b: a.score.remote(b, topk), batches))

    def prefetch(
        self,
        weights: Callable[[], Any],
        key: str,
        batches: list[pa.Table],
        params: SamplingSettings,
        serving: str,
    ) -> bool:
        """Give the actors the weights of the RL update that will publish artifact `key` (`weights()`: an object ref
        of its state dict, asked for only when the prefetch applies) and let them generate `batches` (batch j on
        actor j mod n) without waiting. Only for hf engines that are running and serve `serving` (the update's
        input policy: same architecture and tokenizer); returns whether it started. The rollout stage of the
        published artifact takes the rows (`take_prefetched`); any other load discards them."""
        import ray

        if self.spec.engine != "hf":
            return False
        actors = self.warm.find(self.key, self.spec.key, self.spec.num_engines)
        if not actors or ray.get([a.served_digest.remote() for a in actors]) != [serving] * len(actors):
            return False
        state = weights()
        for i, actor in enumerate(actors):  # Ray runs one caller's calls to an actor in order
            actor.prefetch.remote(state, key, _assigned(batches, i, len(actors)), params)
        log.info("engines of %s: generating %d batches with the weights of %s%s... before it is published",
                 self.warm.name, len(batches), PENDING, key[:12])  # fmt: skip
        return True

    def take_prefetched(
        self, key: str, digest: str, batches: list[pa.Table], params: SamplingSettings
    ) -> list[pa.Table] | None:
        """The rows a `prefetch` for artifact `key` generated, if every actor holds those of its share of `batches`
        with `params`: the actors now serve the artifact as `digest`. None when there are none (generate instead)."""
        import ray
        from ray.exceptions import RayActorError

        actors = self.warm.find(self.key, self.spec.key, self.spec.num_engines)
        if not actors:
            return None
        ids = [
            [b.column("prompt_id").to_pylist() for b in _assigned(batches, i, len(actors))] for i in range(len(actors))
        ]
        try:
            parts = ray.get([a.take_prefetched.remote(key, digest, ids[i], params) for i, a in enumerate(actors)])
        except RayActorError:
            return None
        if any(p is None for p in parts):
            return None
        self.actors = actors
        return [t for part in parts for t in part]


def _assigned(batches: list[pa.Table], i: int, n: int) -> list[pa.Table]:
    return [b for j, b in enumerate(batches) if j % n == i]
