"""MLflow tracking: one parent run per flow run, one nested run per stage, step metrics relayed from training workers.
Modules: runs (flow and stage runs), writer (background writes), process (its helper), relay, orphans, backend."""

from posttrain_core.tracking.backend import tracking_uri
from posttrain_core.tracking.orphans import _owner_tags, end_orphaned_runs
from posttrain_core.tracking.relay import MetricsMailbox, MetricsRelay
from posttrain_core.tracking.runs import (
    RunLogger,
    current_parent,
    experiment_id,
    flatten,
    flow_run,
    log_inputs,
    parent,
    stage_run,
)
from posttrain_core.tracking.writer import _WRITER, client, flush, in_background

__all__ = [
    "_WRITER",  # the tests hold the writer with it
    "_owner_tags",  # and tag runs as this process's with it
    "MetricsMailbox",
    "MetricsRelay",
    "RunLogger",
    "client",
    "current_parent",
    "end_orphaned_runs",
    "experiment_id",
    "flatten",
    "flow_run",
    "flush",
    "in_background",
    "log_inputs",
    "parent",
    "stage_run",
    "tracking_uri",
]
