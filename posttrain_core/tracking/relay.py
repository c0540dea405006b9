"""Step metrics of training workers: rank 0 posts them into its own process (`MetricsMailbox`), and the stage's driver
takes them from there through Ray and logs them to the stage's MLflow run (`MetricsRelay`). Nothing goes through a
file, so it works wherever Ray places the rank, on a node that shares no folder with the driver."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from posttrain_core.tracking.runs import RunLogger

log = logging.getLogger(__name__)

_POSTED: deque[tuple[int | None, dict[str, float]]] = deque()  # this process's lines not yet taken


class MetricsMailbox:
    """Where a training worker logs its step metrics: kept in the worker's process until the driver takes them.

    Training workers never import MLflow: mlflow, SQLAlchemy and a SQLite connection cost a process ~175 MB of
    resident memory, and the driver, which has them already, logs what the workers posted. Stateless and picklable,
    so it crosses the Ray boundary inside a job.
    """

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        _POSTED.append((step, {k: float(v) for k, v in metrics.items() if v is not None}))


def take_posted() -> list[tuple[int | None, dict[str, float]]]:
    """The lines posted in this process since the last call, oldest first (safe while another thread posts)."""
    out = []
    while _POSTED:
        out.append(_POSTED.popleft())
    return out


class MetricsRelay:
    """Logs what a worker posted to its `MetricsMailbox` into an MLflow run; call `pump()` while it runs.

    `source` fetches the posted lines (`cluster.RankActor.posted_metrics` of rank 0, through Ray); the relay of a
    retried stage starts with a new worker process, so no line is logged twice.
    """

    def __init__(self, tracker: RunLogger, source: Callable[[], list] | None = None):
        self.sink = MetricsMailbox()
        self.tracker = tracker
        self.source = source

    def pump(self) -> int:
        """Log the lines posted since the last call; returns how many. Never raises: a tracking hiccup or a lost
        worker must not fail (or hide the error of) the training it watches."""
        if self.source is None:
            return 0
        try:
            lines = self.source()
        except Exception as e:  # noqa: BLE001
            log.debug("no training metrics to relay: %s", e)
            return 0
        try:
            for step, metrics in lines:
                self.tracker.log_metrics(metrics, step=step)
        except Exception as e:  # noqa: BLE001
            log.warning("could not relay training metrics to MLflow: %s", e)
        return len(lines)
