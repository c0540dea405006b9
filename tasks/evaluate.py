"""Prefect task of the evaluate stage (greedy generation + verifier on held-out prompts)."""

from __future__ import annotations

from prefect import task

from posttrain_core import tracking
from posttrain_core.artifacts import ArtifactRef
from posttrain_core.config import EvalConfig
from posttrain_core.evaluate import STAGE, run_evaluate
from posttrain_core.stage import key_for
from tasks.common import RETRY, is_transient, report, stage_cache, store_at


@task(
    name="evaluate",
    task_run_name="evaluate[{label}]",
    cache_key_fn=stage_cache(lambda p, store: key_for(STAGE, p["cfg"], {"prompts": p["prompts"], "model": p["model"]})),
    persist_result=True,
    retry_condition_fn=is_transient,
    **RETRY,
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
