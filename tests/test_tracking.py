"""MLflow run status: FINISHED, FAILED on an error, KILLED on a cancellation, and runs of killed processes ended."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys

import pytest

from posttrain_core import tracking


def _status(run_id: str) -> str:
    return tracking.client().get_run(run_id).info.status


@pytest.mark.parametrize(
    ("raised", "status"), [(None, "FINISHED"), (ValueError, "FAILED"), (KeyboardInterrupt, "KILLED")]
)
def test_flow_and_stage_runs_end_with_the_right_status(raised, status):
    ids = {}
    with pytest.raises(raised) if raised else contextlib.nullcontext():
        with tracking.flow_run(None, "status-test", "flow") as run:
            ids["flow"] = run.run_id
            with tracking.stage_run(None, "stage", {}) as stage:
                ids["stage"] = stage.run_id
                if raised:
                    raise raised("stop")
    assert _status(ids["flow"]) == status and _status(ids["stage"]) == status


def test_runs_of_a_killed_process_are_marked_killed():
    c = tracking.client()
    exp = tracking.experiment_id(None, "status-test")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    tags = {"posttrain.host": socket.gethostname(), "posttrain.pid": str(dead.pid), "posttrain.pid_started": "1.0"}
    orphan = c.create_run(exp, run_name="orphan", tags=tags).info.run_id
    alive = c.create_run(exp, run_name="alive", tags=tracking._owner_tags()).info.run_id
    assert tracking.end_orphaned_runs(None) >= 1
    assert _status(orphan) == "KILLED"
    assert c.get_run(orphan).data.tags["posttrain.end_reason"] == "process gone"
    assert _status(alive) == "RUNNING"  # this process is alive: its run is left alone
    c.set_terminated(alive)


def test_an_error_raised_by_a_cancellation_ends_killed():
    """A termination signal that lands inside Ray's Cython code surfaces as a SystemError whose context is the
    signal's exception (seen with `prefect flow-run cancel` during ray.wait): a cancellation, not a failure."""
    ids = {}
    with pytest.raises(SystemError):
        with tracking.flow_run(None, "status-test", "flow") as run:
            ids["flow"] = run.run_id
            try:
                raise KeyboardInterrupt  # stands for Prefect's TerminationSignal (a BaseException)
            except KeyboardInterrupt:
                raise SystemError("<cyfunction CoreWorker.wait> returned a result with an exception set")  # noqa: B904
    assert _status(ids["flow"]) == "KILLED"
    with pytest.raises(SystemError):
        with tracking.flow_run(None, "status-test", "flow") as run:
            ids["plain"] = run.run_id
            raise SystemError("a real error")
    assert _status(ids["plain"]) == "FAILED"
