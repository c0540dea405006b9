"""Prefect flows: each composes stages into a pipeline and reads like the plan."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from posttrain_core.env import apply_defaults, setting

apply_defaults()
# The core's progress lines (stage built / cache hit / waiting for a concurrent run, engine loads) reach the flow-run
# logs and the UI through PREFECT_LOGGING_EXTRA_LOGGERS (env.DEFAULTS); the logger's level lets INFO through.
logging.getLogger("posttrain_core").setLevel(logging.INFO)

MLFLOW_UI_DEFAULT = "http://127.0.0.1:5000"  # where `make server` serves the MLflow UI


@contextlib.contextmanager
def tracked(flow: str, config: Any, store_root: str, tags: dict[str, str] | None = None) -> Iterator[Any]:
    """The MLflow parent run of this flow run, cross-linked with Prefect; every flow body runs inside one.

    The run is named `{flow}/{flow-run name}`, holds the whole config as params, and carries the Prefect flow-run id
    and UI address as tags; the flow run gets a link artifact to the MLflow run (UI at $POSTTRAIN_MLFLOW_UI,
    default the `make server` address).
    """
    from prefect.artifacts import create_link_artifact
    from prefect.runtime import flow_run
    from prefect.settings import PREFECT_UI_URL

    from posttrain_core import tracking

    ui = PREFECT_UI_URL.value()
    run_tags = {"prefect.flow_run_id": flow_run.id, "posttrain.flow": flow, **(tags or {})}
    if ui and flow_run.id:
        run_tags["prefect.flow_run_url"] = f"{ui}/runs/flow-run/{flow_run.id}"
    with tracking.flow_run(store_root, config.experiment, name=f"{flow}/{flow_run.name}", tags=run_tags) as run:
        run.log_params(config.model_dump(mode="json"))
        base = (setting("POSTTRAIN_MLFLOW_UI") or MLFLOW_UI_DEFAULT).rstrip("/")
        exp = tracking.client(store_root).get_run(run.run_id).info.experiment_id
        create_link_artifact(
            f"{base}/#/experiments/{exp}/runs/{run.run_id}",
            link_text=f"MLflow run {run.run_id}",
            key="mlflow-run",
            description=f"the MLflow parent run of this {flow} flow run (nested stage runs and metrics)",
        )
        yield run
