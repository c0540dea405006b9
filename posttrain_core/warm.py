"""Warm actors: rollout engines and training ranks that outlive the stage that started them.

Starting an actor (a process, torch or vLLM imports, a process group, a model) costs seconds, every RL iteration and
every flow run. So the actors a stage starts are kept, by role, in a `WarmGroup`, and the next stage that needs the
same kind of actors takes them as they are. By default every flow run and every stage of a process uses the
process's group (`WarmGroup.process()`): a second flow run in the same process (a notebook, a sweep, a test session)
finds its engines and ranks already started.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from posttrain_core.cluster import WorkerGroup, connect, kill

log = logging.getLogger(__name__)

RANKS = "ranks"  # the training ranks every trainer shares (SFT, reward model, DPO, RL update)


def counted(role: str, count: int) -> str:
    """The warm-group key of the set of `count` actors of `role` ("ranks:2", "engines:1"): a group keeps a set per
    count (`WarmGroup.ranks`, `rollout.pool.EnginePool`)."""
    return f"{role}:{count}"


_BUSY: dict[tuple[str, str], threading.RLock] = {}  # (group name, role) -> its lock (`WarmGroup.busy`)
_GUARD = threading.Lock()
_PROCESS: WarmGroup | None = None


class WarmGroup:
    """Actors kept alive between stages, by role ("engines:2", "teacher:1", "ranks:2", "prm:1": a set per count).

    A stage asks the group for the actors of a role (`get`, `ranks`): they are started on first use, started again
    when the stage's settings (`spec`) differ from theirs or when one of them no longer answers (a fault in an
    earlier stage), and otherwise reused as they are. A stage never relies on what a warm actor holds without
    checking it: it loads every input from the store by digest, and a warm actor only skips the load when it already
    holds that digest. So whether an actor is warm changes how long a stage takes, never what it computes.

    The group holds the actors' handles, and with them their lives: Ray ends an actor once its owner process exits.
    So the actors die with the process that started them (a crashed flow process leaves none behind; the resumed
    run starts new ones from the latest published artifacts), and `release()` kills them at once. They reserve no
    Ray CPUs: an idle warm actor must not block other stages' work; each sets its own thread count instead.
    """

    def __init__(self, purpose: str = "flow"):
        self.name = f"{purpose}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._roles: dict[str, tuple[str, list[Any]]] = {}  # role -> (spec, actor handles)
        self._job: str | None = None  # the Ray job (driver connection) the handles belong to

    @classmethod
    def process(cls) -> WarmGroup:
        """This process's group, which flow runs and stages use unless given another. Its actors live until the
        process exits or `WarmGroup.process().release()` frees them (a notebook that is done training)."""
        global _PROCESS
        with _GUARD:
            if _PROCESS is None:
                _PROCESS = cls("process")
            return _PROCESS

    @classmethod
    @contextlib.contextmanager
    def owned(cls, purpose: str) -> Iterator[WarmGroup]:
        """A group of the caller's own, released when the block ends (a test or a benchmark that must start its
        actors afresh)."""
        group = cls(purpose)
        try:
            yield group
        finally:
            group.release()

    @classmethod
    def use(cls, group: WarmGroup | None) -> WarmGroup:
        """`group`, or, for None, the process's."""
        return group if group is not None else cls.process()

    def get(self, role: str, spec: str, count: int, start: Callable[[], list[Any]]) -> tuple[list[Any], bool]:
        """The `count` actors of `role`, and whether they were just started.

        Args:
            role: what the actors do ("engines", "ranks").
            spec: the settings they were started with; other settings start new actors.
            count: how many.
            start: starts the actors and returns their handles, in order.
        """
        import ray

        connect()
        job = ray.get_runtime_context().get_job_id()
        if job != self._job:  # Ray was shut down and started again in this process: the handles are void
            self._roles.clear()
            self._job = job
        actors = self.find(role, spec, count)
        if actors is not None:
            try:
                ray.get([a.__ray_ready__.remote() for a in actors])
                return actors, False
            except ray.exceptions.RayActorError as err:
                log.warning("warm group %s: a %s actor is gone (%s); starting new ones", self.name, role, err)
        self.discard(role)
        log.info("warm group %s: starting %d %s actors", self.name, count, role)
        actors = start()
        self._roles[role] = (spec, actors)
        return actors, True

    @contextlib.contextmanager
    def ranks(self, cls: type, num_workers: int, role: str = RANKS) -> Iterator[WorkerGroup]:
        """`num_workers` training ranks of `role`, each hosting a `cls` object (`RankActor.become`: kept if it
        already is one, so an RL update can continue from the state the previous one left), held for the block. A
        failure in the block kills them (no half-updated rank is reused).

        The group keeps one set of ranks per rank count (`counted`): the stages of a flow, and the flow runs of a
        process, often differ in it (a 1-rank reward model between 2-rank SFT and RL), and a rank's process group is
        fixed at its start. The sets of other counts stay started but drop what they host, so an idle set holds
        processes, not models."""
        key = counted(role, num_workers)
        with self.busy(role):
            for other in [r for r in self._roles if r.startswith(f"{role}:") and r != key]:
                try:
                    WorkerGroup(self.members(other)).drop()
                except Exception as err:  # noqa: BLE001 (a dead set is discarded, whatever killed it)
                    log.warning("warm group %s: %s ranks are gone (%s)", self.name, other, err)
                    self.discard(other)
            actors, _ = self.get(
                key, "ranks", num_workers, lambda: WorkerGroup.start(cls, num_workers, num_cpus=0).actors
            )
            ranks = WorkerGroup(actors)
            try:
                ranks.become(cls)
                yield ranks
            except BaseException:
                self.discard(key)
                raise

    def busy(self, role: str) -> threading.RLock:
        """The lock a stage holds while it uses the actors of `role`: a flow may run stages in threads (an
        off-policy lag's rollout beside the update and an evaluation), and flow runs in threads of one process share
        its group; one engine serves one policy at a time. Kept outside the group, which travels as a task
        parameter."""
        with _GUARD:
            return _BUSY.setdefault((self.name, role), threading.RLock())

    def find(self, role: str, spec: str, count: int) -> list[Any] | None:
        """The `count` actors of `role` started with `spec`, if the group has them (not checked, never started)."""
        held = self._roles.get(role)
        return held[1] if held is not None and held[0] == spec and len(held[1]) == count else None

    def members(self, role: str) -> list[Any]:
        """The handles of the actors of `role` (empty when there are none)."""
        held = self._roles.get(role)
        return list(held[1]) if held is not None else []

    def discard(self, role: str | None = None) -> None:
        """Kill the actors of `role` (every role when None)."""
        for name in [role] if role is not None else list(self._roles):
            _, actors = self._roles.pop(name, (None, []))
            kill(actors)

    def release(self) -> None:
        self.discard()
        with _GUARD:
            for key in [k for k in _BUSY if k[0] == self.name]:
                del _BUSY[key]
