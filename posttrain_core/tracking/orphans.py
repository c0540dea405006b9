"""Runs left RUNNING by killed processes: every run is tagged with the process that owns it (`_owner_tags`), and
`end_orphaned_runs` marks KILLED the runs of this host whose process is gone."""

from __future__ import annotations

import logging
import os

from posttrain_core.tracking.writer import client

log = logging.getLogger(__name__)


def _owner_tags() -> dict[str, str]:
    """Which process owns a run: a run still RUNNING whose process is gone was killed (see `end_orphaned_runs`)."""
    import socket

    import psutil

    pid = os.getpid()
    return {
        "posttrain.host": socket.gethostname(),
        "posttrain.pid": str(pid),
        "posttrain.pid_started": f"{psutil.Process(pid).create_time():.2f}",
    }


def _process_alive(pid: int, started: str | None) -> bool:
    import psutil

    try:
        proc = psutil.Process(pid)
        return started is None or abs(proc.create_time() - float(started)) < 1.0  # not a reused pid
    except (psutil.NoSuchProcess, ValueError):
        return False


def end_orphaned_runs(store_root: str | os.PathLike | None) -> int:
    """Mark KILLED every RUNNING posttrain run of this host whose process no longer exists; return how many.

    A process killed with SIGKILL (or a machine that lost power) cannot end its MLflow runs; the next flow run on
    the same host (every `flow_run` calls this) ends them, tagged `posttrain.end_reason = process gone`. Runs of
    other hosts are left alone (their processes cannot be checked from here).
    """
    import socket

    c = client(store_root)
    host = socket.gethostname()
    ended = 0
    try:
        experiments = [e.experiment_id for e in c.search_experiments()]
        runs = c.search_runs(
            experiments, filter_string=f"attributes.status = 'RUNNING' and tags.`posttrain.host` = '{host}'"
        ) if experiments else []  # fmt: skip
    except Exception as err:  # a store that cannot be searched must not stop the flow
        log.warning("could not look for orphaned MLflow runs: %s", err)
        return 0
    for run in runs:
        pid = run.data.tags.get("posttrain.pid")
        if pid and not _process_alive(int(pid), run.data.tags.get("posttrain.pid_started")):
            c.set_tag(run.info.run_id, "posttrain.end_reason", "process gone")
            c.set_terminated(run.info.run_id, "KILLED")
            ended += 1
    if ended:
        log.warning("marked %d MLflow runs KILLED: their processes on %s are gone (killed or crashed)", ended, host)
    return ended
