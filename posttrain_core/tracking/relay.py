"""Step metrics of training workers: the workers append them to a JSONL file (`MetricsFile`), and the stage's driver
relays them to the stage's MLflow run (`MetricsRelay`)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from posttrain_core.tracking.runs import RunLogger

log = logging.getLogger(__name__)


class MetricsFile:
    """Step metrics a training worker appends to a JSONL file, which the stage's driver relays to MLflow.

    Training workers never import MLflow: mlflow, SQLAlchemy and a SQLite connection cost a process ~175 MB of resident
    memory, and the driver, which has them already, logs what the workers wrote (`MetricsRelay`).
    Picklable (a path), so it crosses the Ray boundary.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        line = json.dumps({"step": step, "metrics": {k: float(v) for k, v in metrics.items() if v is not None}})
        with open(self.path, "a") as f:  # one short write per line: a reader sees whole lines or none
            f.write(line + "\n")


class MetricsRelay:
    """Logs the lines workers append to a `MetricsFile` into an MLflow run; call `pump()` while they run.

    Starts at the file's current end, so lines of an earlier attempt of the stage (a retry resumes in the same
    working folder) were logged to that attempt's run and are not logged again.
    """

    def __init__(self, path: str | os.PathLike, tracker: RunLogger):
        self.sink = MetricsFile(path)
        self.tracker = tracker
        self.offset = os.path.getsize(path) if os.path.exists(path) else 0

    @classmethod
    def in_folder(cls, folder: str | os.PathLike, tracker: RunLogger) -> MetricsRelay:
        """The relay of a stage's working folder (`metrics.jsonl` there): what the training stages use."""
        return cls(Path(folder) / "metrics.jsonl", tracker)

    def pump(self) -> int:
        """Log the complete lines written since the last call; returns how many. Never raises: a tracking hiccup
        must not fail the training it watches (the lines stay in the file)."""
        try:
            with open(self.sink.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return 0
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next call
        lines = data[:end].splitlines()
        try:
            for line in lines:
                item = json.loads(line)
                self.tracker.log_metrics(item["metrics"], step=item["step"])
        except Exception as e:  # noqa: BLE001
            log.warning("could not relay training metrics to MLflow: %s", e)
        self.offset += end
        return len(lines)
