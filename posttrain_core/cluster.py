"""Connect to Ray and run groups of worker actors under a single controller.

`connect()` starts Ray on the local machine (or joins `$RAY_ADDRESS`); `WorkerGroup` places N actors of one class,
wires them into a torch.distributed process group, and runs coarse methods on all of them, failing fast if any dies.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

from posttrain_core.env import apply_defaults

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
    address = os.environ.get("RAY_ADDRESS") or None
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


MALLOC_ENV = "POSTTRAIN_KEEP_FREED_MEMORY"  # "0": leave glibc's malloc on its defaults in worker processes
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters (malloc.h)


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep the memory that a training or generation step frees, for the next step to reuse.

    By default glibc serves blocks above a (dynamic, at most 32 MiB) threshold with fresh mmaps and gives heap memory
    back to the kernel once enough of it is free at the top. A worker that allocates and frees the same activations,
    gradients and logits every step then takes a page fault for every 4 KiB of them, every step (measured in an RL
    update worker of the bench model: ~30,000 minor faults per update, 0.1-0.15 s of kernel time of ~1 s). With both
    thresholds at 1 GiB the pages stay mapped; a long-lived worker's resident memory then stays at its peak instead of
    falling between steps (the peak itself does not change). Call once per worker process; returns False where it
    does not apply (not glibc, or disabled with POSTTRAIN_KEEP_FREED_MEMORY=0).
    """
    import ctypes
    import platform

    if os.environ.get(MALLOC_ENV, "1") == "0" or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
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


def node_address() -> tuple[str, int]:
    """(ip, free port) of the calling process's node: the rendezvous of a process group."""
    import ray

    return ray.util.get_node_ip_address(), free_port()


class WorkerGroup:
    """N actors of one class forming a torch.distributed group; the driver calls coarse methods on all of them.

    Args:
        actor_cls: a plain class with `__init__(self, rank, world_size)` and a `setup(self, master_addr, master_port)`
            method that calls `torch.distributed.init_process_group`.
        num_workers: group size.
        num_cpus: logical CPUs reserved per actor.
    """

    def __init__(self, actor_cls: type, num_workers: int, num_cpus: float = 1.0):
        import ray

        connect()
        remote_cls = ray.remote(num_cpus=num_cpus)(actor_cls)
        self.actors = [remote_cls.remote(rank, num_workers) for rank in range(num_workers)]
        addr, port = ray.get(self.actors[0].rendezvous.remote())
        self.run("setup", addr, port)

    def run(
        self, method: str, *args: Any, poll: Callable[[], Any] | None = None, poll_s: float = 2.0, **kwargs: Any
    ) -> list[Any]:
        """Call `method` on every actor; return the results in rank order.

        If any actor fails or dies, the others are killed at once (a peer blocked in a collective would otherwise
        wait for the gloo timeout) and the first error is raised. `poll` (e.g. `MetricsRelay.pump`) is called
        every `poll_s` seconds while the actors work, and once more when they are done or have failed.
        """
        import ray

        refs = [getattr(a, method).remote(*args, **kwargs) for a in self.actors]
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
                    if died is not None:
                        raise died from err
                    raise
        finally:
            if poll:
                poll()
        return ray.get(refs)

    def shutdown(self) -> None:
        import ray

        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already dead
                pass
        self.actors = []


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
