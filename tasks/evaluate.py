"""Prefect task of the evaluate stage (greedy generation + verifier on held-out prompts)."""

from __future__ import annotations

from posttrain_core import tracking
from posttrain_core.artifacts import ArtifactRef
from posttrain_core.config import EvalConfig
from posttrain_core.evaluate import STAGE, run_evaluate
from posttrain_core.stage import key_for
from tasks.common import report, stage_task, store_at


@stage_task(
    "evaluate",
    lambda p, store: key_for(STAGE, p["cfg"], {"prompts": p["prompts"], "model": p["model"]}),
    run_name="evaluate[{label}]",
)
def evaluate(
    cfg: EvalConfig,
    prompts: ArtifactRef,
    model: ArtifactRef,
    label: str = "model",
    store_root: str | None = None,
    parent_run_id: str | None = None,
) -> ArtifactRef:
    store = store_at(store_root)
    with tracking.parent(parent_run_id):
        ref = run_evaluate(cfg, prompts, model, store)
    report(f"evaluate-{label}", ref, store)
    return ref
