"""MLflow run status: FINISHED, FAILED on an error, KILLED on a cancellation, and runs of killed processes ended."""

from __future__ import annotations

import contextlib
import os
import pickle
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


def test_metrics_relay_logs_what_the_worker_posted_once_in_order():
    from posttrain_core.tracking.relay import take_posted

    take_posted()  # nothing left over from another test in this process
    with tracking.stage_run(None, "relay-test", {}) as run:
        relay = tracking.MetricsRelay(run, source=take_posted)  # a rank's `posted_metrics`, here in-process
        sink = pickle.loads(pickle.dumps(relay.sink))  # what a Ray worker gets
        sink.log_metrics({"train/loss": 2.5, "train/lr": 1e-3}, step=10)
        sink.log_metrics({"train/loss": 2.0, "skipped": None}, step=20)
        assert relay.pump() == 2 and relay.pump() == 0
        sink.log_metrics({"train/loss": 1.5}, step=30)
        assert relay.pump() == 1
    history = tracking.client().get_metric_history(run.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(10, 2.5), (20, 2.0), (30, 1.5)]
    assert [m.value for m in tracking.client().get_metric_history(run.run_id, "train/lr")] == [1e-3]


def test_a_failing_tracking_store_or_a_lost_worker_does_not_fail_the_relay(caplog):
    from posttrain_core.tracking.relay import take_posted

    class Broken:
        def log_metrics(self, metrics, step=None):
            raise ConnectionError("tracking server down")

    relay = tracking.MetricsRelay(Broken(), source=take_posted)
    relay.sink.log_metrics({"train/loss": 1.0}, step=1)
    assert relay.pump() == 1 and "tracking server down" in caplog.text

    def lost():
        raise RuntimeError("the actor died")

    assert tracking.MetricsRelay(Broken(), source=lost).pump() == 0


def test_stage_records_are_written_in_the_background_and_complete_after_flush():
    """A stage's closing records leave its critical path; `client()` (and the flow's end) waits for them."""
    import threading

    with tracking.flow_run(None, "background-test", "flow") as flow:
        with tracking.stage_run(None, "stage", {"config": {"lr": 0.1}}) as run:
            # The writer is busy: these calls queue and return at once, in order.
            gate = threading.Event()
            tracking._WRITER.submit("hold the writer", lambda: gate.wait(30))
            run.log_metrics({"loss": 2.0}, step=1)
            run.log_metrics({"loss": 1.0}, step=2)
            run.set_tags({"posttrain.artifact_uri": "file:///x"})
            from mlflow.tracking import MlflowClient

            raw = MlflowClient(tracking_uri=tracking.tracking_uri(None))
            assert raw.get_metric_history(run.run_id, "loss") == []  # not written yet: the writer is held
            gate.set()
        flow_id = flow.run_id
    c = tracking.client()  # flushes first
    data = c.get_run(run.run_id)
    assert [m.value for m in c.get_metric_history(run.run_id, "loss")] == [2.0, 1.0]
    assert data.data.params["config.lr"] == "0.1" and data.data.tags["posttrain.artifact_uri"] == "file:///x"
    assert data.info.status == "FINISHED" and c.get_run(flow_id).info.status == "FINISHED"


def test_metric_names_mlflow_refuses_are_written_under_a_valid_name(caplog):
    """'pass@1' is a posttrain metric; MLflow refuses '@' in a name, which would lose the whole batch."""
    with tracking.flow_run(None, "names-test", "flow"):
        with tracking.stage_run(None, "evaluate", {}) as run:
            run.log_metrics({"final/pass@1": 0.5, "final/accuracy": 0.25})
    c = tracking.client()
    assert c.get_run(run.run_id).data.metrics == {"final/pass_at_1": 0.5, "final/accuracy": 0.25}
    assert "failed" not in caplog.text


def test_a_stage_starts_without_waiting_for_the_writer_and_its_run_id_waits_for_the_creation():
    """The stage's run is created on the writer behind the earlier records: the stage's work starts at once."""
    import threading
    import time

    with tracking.flow_run(None, "background-test", "flow") as flow:
        gate = threading.Event()
        tracking._WRITER.submit("hold the writer", lambda: gate.wait(30))  # an earlier stage's slow records
        started = time.time()
        with tracking.stage_run(None, "stage", {"config": {"lr": 0.1}}) as run:
            entered = time.time() - started
            run.log_metrics({"loss": 1.0}, step=1)
            assert not run._run_id.done()  # its creation is queued behind the held writer
            threading.Timer(0.3, gate.set).start()
            run_id = run.run_id  # waits for the creation, then is an ordinary id
        assert entered < 10 and isinstance(run_id, str)  # the writer is held for up to 30 s
    c = tracking.client()
    data = c.get_run(run_id)
    assert data.data.tags["mlflow.parentRunId"] == flow.run_id and data.data.params["config.lr"] == "0.1"
    assert data.data.metrics["loss"] == 1.0 and data.info.status == "FINISHED"


def test_a_failing_background_write_is_logged_counted_and_tagged_not_raised(caplog):
    with tracking.flow_run(None, "background-test", "flow") as flow:
        with tracking.stage_run(None, "stage", {}) as run:
            run.log_artifact("/nonexistent/file.png")  # fails in the writer, after this call returned
            run.log_metrics({"after": 1.0})  # later writes still happen
    c = tracking.client()
    assert "could not log artifact /nonexistent/file.png" in caplog.text
    assert c.get_run(flow.run_id).data.tags["posttrain.tracking_errors"] == "1"
    assert c.get_run(run.run_id).data.metrics["after"] == 1.0 and c.get_run(run.run_id).info.status == "FINISHED"
    assert tracking.flush() == []  # counted once, by the flow that saw it


def test_background_records_are_written_by_the_helper_process_which_restarts_after_dying():
    """The writer thread's MLflow calls run in the helper process; a dead helper costs the write in flight, not
    the next ones."""
    from posttrain_core.tracking import process

    def stage(value: float) -> str:
        with tracking.flow_run(None, "helper-test", "flow"):
            with tracking.stage_run(None, "stage", {"config": {"v": value}}) as run:
                run.log_metrics({"value": value})
            return run.run_id

    first = stage(1.0)
    tracking.flush()
    helper = process._HELPER._proc
    assert helper is not None and helper.poll() is None and helper.pid != os.getpid()
    helper.kill()
    helper.wait()
    second = stage(2.0)  # the run's creation finds the helper dead and starts a new one
    tracking.flush()
    assert process._HELPER._proc.pid != helper.pid
    c = tracking.client()
    assert c.get_run(first).data.metrics["value"] == 1.0 and c.get_run(second).data.metrics["value"] == 2.0
    assert c.get_run(second).info.status == "FINISHED"
