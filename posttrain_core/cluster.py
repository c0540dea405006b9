"""Ray: connect once, run groups of torch.distributed ranks, and keep actors warm across the stages of a flow run.

- `connect()` starts Ray on this machine, or joins `$RAY_ADDRESS`.
- `WorkerGroup` places N `RankActor`s, wires them into one process group and calls coarse methods of their role
  object on all of them (a single controller), failing fast when one dies.
- Actors that outlive a stage (rollout engines, training ranks) are held by `warm.WarmGroup`.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from posttrain_core.env import apply_defaults, setting

log = logging.getLogger(__name__)


def connect(num_cpus: int | None = None) -> None:
    """Start or join Ray once per process (idempotent).

    With `RAY_ADDRESS` set, joins that cluster; otherwise starts a local one (no dashboard: our worker groups do not
    need Ray Train's State API, and it costs ~1 GB of memory). Worker output is forwarded so stage progress shows in
    the driver's log.
    """
    apply_defaults()
    import ray

    if ray.is_initialized():
        return
    address = setting("RAY_ADDRESS")
    kwargs: dict[str, Any] = dict(
        address=address, log_to_driver=True, logging_level=logging.WARNING, configure_logging=True
    )
    if address is None:
        # At least 2 logical CPUs so the 2-worker default runs on small machines; torch threads are set per worker.
        kwargs.update(num_cpus=num_cpus or max(2, os.cpu_count() or 1), include_dashboard=False)
    log.info("connecting to Ray (%s)", address or "local")
    # ray.init replaces the SIGTERM handler with a bare sys.exit. Inside a Prefect flow run the handler already
    # installed is Prefect's cancellation bridge (SIGTERM -> TerminationSignal -> state Cancelled, MLflow KILLED);
    # under Ray's, a run cancelled from the CLI or UI would end Crashed. Keep a handler a caller installed.
    previous = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    ray.init(**kwargs)
    if callable(previous):
        signal.signal(signal.SIGTERM, previous)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters (malloc.h)


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep the memory a training or generation step frees, for the next step to reuse.

    By default glibc serves large blocks with fresh mmaps and gives freed heap back to the kernel, so a worker that
    allocates and frees the same activations every step takes a page fault for every 4 KiB of them, every step. With
    both thresholds at 1 GiB the pages stay mapped; a long-lived worker's resident memory then stays at its peak
    instead of falling between steps (the peak itself does not change). Memory only: no result depends on it.
    Returns False where it does not apply (not glibc).
    """
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30) == 1
    return libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1 and ok


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def split(items: Sequence[Any], n: int) -> list[list[Any]]:
    """Split into n contiguous, nearly equal shards (empty shards dropped)."""
    k, r = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        end = start + k + (1 if i < r else 0)
        if end > start:
            out.append(list(items[start:end]))
        start = end
    return out


# ------------------------------------------------------------------------------------------ distributed ranks
class RankActor:
    """One rank of a torch.distributed group, as a Ray actor.

    The actor owns the process, its thread count and the process group; the work belongs to its role: an object of
    any class taking (rank, world_size), whose methods the driver calls through `WorkerGroup.run` (composition: the
    SFT, preference and RL trainers are plain classes, none of them a subclass of a worker base).
    """

    def __init__(self, role: type, rank: int, world_size: int):
        import torch

        self.rank, self.world = rank, world_size
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        keep_freed_memory()
        self.role: Any = role(rank, world_size)

    def become(self, role: type) -> None:
        """Host a `role` object (kept when it already is one): a warm rank trains an SFT stage, then RL updates, in
        the same process and process group. The old role's models and optimizers are dropped first."""
        if type(self.role) is not role:
            self.drop()
            self.role = role(self.rank, self.world)

    def drop(self) -> None:
        """Drop the role and what it holds (the process stays, warm); step metrics it left unread go with it."""
        import gc

        import torch

        from posttrain_core.tracking.relay import take_posted

        if hasattr(self.role, "release"):
            self.role.release()
        self.role = None
        gc.collect()
        if torch.cuda.is_available():  # an idle rank keeps no GPU memory cached for the next role
            torch.cuda.empty_cache()
        take_posted()

    def rendezvous(self) -> tuple[str, int, str]:
        """(ip, free port, node id) of this rank's node: rank 0's address is the group's rendezvous."""
        import ray

        return ray.util.get_node_ip_address(), free_port(), ray.get_runtime_context().get_node_id()

    def setup(self, master_addr: str, master_port: int) -> None:
        import torch
        import torch.distributed as dist

        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group(
                "nccl" if torch.cuda.is_available() else "gloo",
                init_method=f"tcp://{master_addr}:{master_port}",
                rank=self.rank,
                world_size=self.world,
                timeout=timedelta(minutes=10),
            )

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.role, method)(*args, **kwargs)

    def posted_metrics(self) -> list:
        """The step metrics the role posted since the last call (`tracking.MetricsMailbox`); runs in the actor's
        `relay` concurrency group, beside a `call` in progress."""
        from posttrain_core.tracking.relay import take_posted

        return take_posted()


class WorkerGroup:
    """N `RankActor`s forming one torch.distributed group; the driver calls coarse methods of their roles.

    `WorkerGroup.start(role, n)` places new actors; `WorkerGroup(actors)` wraps actors that already form a group
    (a `WarmGroup`'s).
    """

    def __init__(self, actors: list[Any]):
        self.actors = actors

    @classmethod
    def start(cls, role: type, num_workers: int, num_cpus: float = 1.0) -> WorkerGroup:
        """Place `num_workers` ranks, dealt over the cluster's nodes (`spread`), and form their process group."""
        import ray
        from ray.exceptions import RayActorError

        connect()
        remote = ray.remote(num_cpus=num_cpus, concurrency_groups={"relay": 1})(RankActor)
        for attempt in range(3):
            strategies = spread(num_workers, num_cpus)
            group = cls([remote.options(scheduling_strategy=s).remote(role, r, num_workers)
                         for r, s in enumerate(strategies)])  # fmt: skip
            places, lost = [], {}
            for strategy, ref in zip(strategies, [a.rendezvous.remote() for a in group.actors], strict=True):
                try:
                    places.append(ray.get(ref))
                except RayActorError as err:
                    lost[strategy.node_id] = err
            if not lost:
                break
            # A node that just died stays listed as alive until Ray's health checks give up on it (seconds): place
            # the group again, around the nodes where a rank could not start.
            group.shutdown()
            if attempt == 2:
                raise next(iter(lost.values()))
            log.warning("%s: ranks could not start on node(s) %s; placing them again", role.__name__,
                        sorted(n[:12] for n in lost))  # fmt: skip
            _LOST.update(dict.fromkeys(lost, time.monotonic()))
        for actor, (ip, _, node) in zip(group.actors, places, strict=True):
            _NODES[actor._actor_id.hex()] = (node, ip)
        if len({node for _, _, node in places}) > 1:
            log.info(
                "%s: %d ranks on nodes %s", role.__name__, num_workers, [f"{n[:12]} ({ip})" for ip, _, n in places]
            )
        addr, port, _ = places[0]
        group._wait([a.setup.remote(addr, port) for a in group.actors])
        return group

    def become(self, role: type) -> None:
        """Make every rank host a `role` object (`RankActor.become`)."""
        self._wait([a.become.remote(role) for a in self.actors])

    def drop(self) -> None:
        """Make every rank drop its role (`RankActor.drop`)."""
        self._wait([a.drop.remote() for a in self.actors])

    def metrics_source(self) -> Callable[[], list]:
        """A function returning what rank 0's role posted since the last call (`tracking.MetricsRelay.source`)."""
        import ray

        rank0 = self.actors[0]
        return lambda: ray.get(rank0.posted_metrics.options(concurrency_group="relay").remote(), timeout=30)

    def run(
        self, method: str, *args: Any, poll: Callable[[], Any] | None = None, poll_s: float = 2.0, **kwargs: Any
    ) -> list[Any]:
        """Call the role's `method` on every rank; return the results in rank order.

        If any rank fails or dies, the others are killed at once (a peer blocked in a collective would otherwise
        wait for the gloo timeout) and the first error is raised. `poll` (e.g. `MetricsRelay.pump`) is called every
        `poll_s` seconds while the ranks work, and once more when they are done or have failed.
        """
        return self._wait([a.call.remote(method, *args, **kwargs) for a in self.actors], poll, poll_s)

    def run_each(self, method: str, args: Sequence[tuple]) -> list[Any]:
        """Call the role's `method` with `args[i]` on rank i (the first len(args) ranks), failing as `run` does."""
        return self._wait([a.call.remote(method, *a_args) for a, a_args in zip(self.actors, args, strict=False)])

    def _wait(self, refs: list[Any], poll: Callable[[], Any] | None = None, poll_s: float = 2.0) -> list[Any]:
        import ray

        pending = list(refs)
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1, timeout=poll_s if poll else None)
                if not done:
                    poll()
                    continue
                try:
                    ray.get(done[0])
                except Exception as err:
                    died = _peer_death(pending, err)
                    self.shutdown()
                    lost = died if died is not None else err
                    _name_lost_node(lost)
                    if died is not None:
                        raise died from err
                    raise
        finally:
            if poll:
                poll()
        return ray.get(refs)

    def shutdown(self) -> None:
        kill(self.actors)
        self.actors = []


def _peer_death(pending: list, err: Exception, wait_s: float = 3.0) -> Exception | None:
    """When one rank fails, the error to raise may be another's: a rank whose peer was killed fails in its next
    collective ("Connection reset by peer") about when Ray reports the peer's death, and whichever comes first
    decides whether the stage is retried (`tasks.common.is_transient` retries lost workers only). So a failure that
    is not itself a lost worker waits up to `wait_s` for the other ranks and returns a lost worker's error if there
    is one."""
    import ray
    from ray.exceptions import RayActorError

    if isinstance(err, RayActorError) or not pending:
        return None
    ready, _ = ray.wait(pending, num_returns=len(pending), timeout=wait_s)
    for ref in ready:
        try:
            ray.get(ref)
        except RayActorError as died:
            return died
        except Exception:  # noqa: BLE001 - another rank's own error: the first one is raised
            continue
    return None


_NODES: dict[str, tuple[str, str]] = {}  # actor id -> (node id, ip) of the ranks this process placed
# node id -> when an actor of this process was lost there. A node that dies stays listed as alive until Ray's health
# checks give up on it (~15-30 s): for `LOST_S` seconds nothing is placed there.
_LOST: dict[str, float] = {}
LOST_S = 60.0


def spread(count: int, num_cpus: float = 0.0) -> list[Any]:
    """Scheduling strategies for `count` actors dealt round-robin over the live nodes with `num_cpus` CPUs, this
    process's node first (rank 0, the rendezvous, lands beside the driver; on one machine everything stays there),
    none on a node where one was lost in the last `LOST_S` seconds.
    The affinity is strict (Ray's soft affinity picks another node whenever the chosen one is busy for a moment, which
    in practice often stacks a group on one node); the nodes are those alive now. Placement never changes what is
    computed: only where."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    nodes = [
        n["NodeID"] for n in ray.nodes()
        if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) >= num_cpus
        and time.monotonic() - _LOST.get(n["NodeID"], -LOST_S) >= LOST_S
    ]  # fmt: skip
    nodes = sorted(nodes, key=lambda n: n != here) or [here]
    return [NodeAffinitySchedulingStrategy(nodes[i % len(nodes)], soft=False) for i in range(count)]


def _name_lost_node(err: Exception) -> None:
    """Add to a lost rank's error which node it ran on and whether Ray has declared that node dead, and place
    nothing there for a while (`spread`)."""
    import ray
    from ray.exceptions import ActorUnavailableError, RayActorError

    if not isinstance(err, RayActorError | ActorUnavailableError):
        return
    actor_id = getattr(err, "actor_id", None)
    actor_id = actor_id.hex() if isinstance(actor_id, bytes) else actor_id
    if actor_id not in _NODES:
        return
    node, ip = _NODES[actor_id]
    _LOST[node] = time.monotonic()
    try:
        dead = not any(n["NodeID"] == node and n.get("Alive") for n in ray.nodes())
    except Exception:  # noqa: BLE001 - naming the node is best effort
        dead = False
    note = f"the lost rank ran on node {node[:12]} ({ip}){', which Ray has marked dead' if dead else ''}"
    err.add_note(note)
    log.error("%s: %s", type(err).__name__, note)


def kill(actors: Sequence[Any]) -> None:
    import ray

    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception as err:  # already dead, or Ray shut down first
            log.debug("kill: %s", err)
