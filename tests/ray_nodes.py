"""A Ray cluster of two nodes on one machine whose nodes share no folder: the head (the flow's machine) and a worker
node started by `ray start --address` inside a mount namespace of its own (`unshare --mount`) with a fresh tmpfs over
/tmp. The flow's store root, staging and cache folders, the MLflow database and the Ray session of the head all live
under /tmp, so the worker node cannot open any of them: whatever it reads or writes goes through the store's S3 API or
through Ray. Both nodes share the network (127.0.0.1) and the read-only code (the repository, the venv).

Processes are stopped by what is theirs (their temp dir in the command line, their process groups), never with
`ray stop`, which would end every Ray instance on the machine (the test session's own included).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from posttrain_core.cluster import free_port

REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).parent / "ray")
WORKER_TMP = "/tmp/posttrain-node-b"  # inside the worker node's own /tmp: the head never sees it
WORKER_CACHE = f"{WORKER_TMP}/cache"
# An address of its own (any 127.x reaches this machine): with two raylets on one address, a driver could attach to
# either, and would then be on the worker node.
WORKER_IP = "127.0.0.2"
WORKER_RESOURCE = "posttrain_node_b"  # a custom resource only the worker node offers: work asked to go there


def _own_mount_ns() -> str:
    return os.readlink("/proc/self/ns/mnt")


def _procs() -> list[tuple[int, str, str]]:
    """(pid, command line, mount namespace) of the machine's processes."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            ns = os.readlink(f"/proc/{entry}/ns/mnt")
        except OSError:
            continue
        out.append((int(entry), cmd, ns))
    return out


def _descendants(root: int) -> set[int]:
    """`root` and the processes below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        out.add(pid)
        todo.extend(children.get(pid, []))
    return out


@dataclass
class TwoNodes:
    address: str
    env: dict[str, str]  # the environment of the nodes and of a driver joining them (RAY_ADDRESS, S3, cache, code)
    head_tmp: str
    log_dir: Path
    procs: list[subprocess.Popen] = field(default_factory=list)
    worker: subprocess.Popen | None = None
    worker_starts: int = 0

    def start_worker(self) -> None:
        """Start the worker node (again): a fresh tmpfs over /tmp in a mount namespace of its own."""
        script = (
            "set -e; mount -t tmpfs -o size=8g posttrain-node-b /tmp; "
            f"mkdir -p {WORKER_CACHE}; exec {RAY} start --address={self.address} --num-cpus=2 --node-ip-address={WORKER_IP} "
            f"--resources='{{\"{WORKER_RESOURCE}\": 1}}' --temp-dir={WORKER_TMP}/ray --disable-usage-stats --block"
        )
        env = {**self.env, "POSTTRAIN_CACHE_DIR": WORKER_CACHE}
        log = (self.log_dir / "node-b.log").open("a")
        self.worker = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self.procs.append(self.worker)
        self.worker_starts += 1

    def worker_raylet(self) -> int:
        """The pid of the running worker node's raylet (a descendant of its `ray start`)."""
        assert self.worker is not None
        ours = _descendants(self.worker.pid)
        found = [pid for pid, cmd, _ in _procs() if pid in ours and cmd.split(" ", 1)[0].endswith("/raylet")]
        assert len(found) == 1, found
        return found[0]

    def kill_worker(self) -> None:
        """SIGKILL every process of the worker node (what losing the machine does)."""
        mine = _own_mount_ns()
        for pid, cmd, ns in _procs():
            if ns != mine and WORKER_TMP in cmd:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if self.worker is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.worker.pid, signal.SIGKILL)
            self.worker.wait()

    def stop(self) -> None:
        self.kill_worker()
        for pid, cmd, _ in _procs():
            if self.head_tmp in cmd:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def two_nodes(log_dir: Path, env: dict[str, str], head_cache: Path) -> Iterator[TwoNodes]:
    """Start the head (2 CPUs, cache and staging in `head_cache`) and the isolated worker node (2 CPUs)."""
    port = free_port()
    # Short paths: Ray's unix sockets live in the temp dir and must fit 107 characters.
    head_tmp = tempfile.mkdtemp(prefix="ptrh-", dir="/tmp")
    base = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    base.update(env)
    base["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    base.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    nodes = TwoNodes(f"127.0.0.1:{port}", {**base, "RAY_ADDRESS": f"127.0.0.1:{port}"}, head_tmp, log_dir)
    head = subprocess.Popen(
        [RAY, "start", "--head", f"--port={port}", "--num-cpus=2", f"--temp-dir={head_tmp}",
         "--include-dashboard=false", "--disable-usage-stats", "--block"],
        env={**base, "POSTTRAIN_CACHE_DIR": str(head_cache)}, stdout=(log_dir / "head.log").open("w"),
        stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    nodes.procs.append(head)
    try:
        nodes.start_worker()  # it retries until the head's GCS answers
        wait_for_nodes(nodes, 2, head)
        yield nodes
    finally:
        nodes.stop()


STARTED = "Ray runtime started."  # what `ray start` prints once its node runs


def _wait_started(log: Path, times: int, proc: subprocess.Popen | None, deadline: float) -> None:
    """Wait until `log` (a `ray start` output, appended to by each start) says `times` starts succeeded. Cheaper than
    polling `ray status`, a Python process of its own that would compete with the starting node for the CPUs."""
    while not (log.is_file() and log.read_text(errors="replace").count(STARTED) >= times):
        assert proc is None or proc.poll() is None, log.read_text(errors="replace")[-3000:]
        assert time.time() < deadline, f"{log} did not report {times} starts"
        time.sleep(0.2)


def wait_for_nodes(nodes: TwoNodes, n: int, proc: subprocess.Popen | None, timeout: float = 120) -> None:
    """Wait until the cluster has `n` live nodes: both `ray start`s have succeeded, then `ray status` from another
    process counts the nodes the head knows."""
    deadline = time.time() + timeout
    _wait_started(nodes.log_dir / "head.log", 1, proc, deadline)
    _wait_started(nodes.log_dir / "node-b.log", nodes.worker_starts, nodes.worker, deadline)
    while True:
        out = subprocess.run(
            [RAY, "status", f"--address={nodes.address}"], env=nodes.env, capture_output=True, text=True
        ).stdout
        active = out.split("Active:")[-1].split("Pending:")[0] if "Active:" in out else ""
        if active.count("node_") >= n:
            return
        assert proc is None or proc.poll() is None, sorted(p.name for p in nodes.log_dir.iterdir())
        assert time.time() < deadline, out
        time.sleep(1)
