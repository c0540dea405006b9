"""Prefect task of the prepare_data stage."""

from __future__ import annotations

from prefect import task

from posttrain_core import tracking
from posttrain_core.config import DataConfig
from posttrain_core.data.prepare import DataRefs, output_keys, run_prepare_data
from tasks.common import RETRY, is_transient, report, stage_cache, store_at


@task(
    name="prepare_data",
    task_run_name="prepare_data",
    cache_key_fn=stage_cache(lambda p, store: output_keys(p["cfg"], store)["sft"]),
    persist_result=True,
    retry_condition_fn=is_transient,
    **RETRY,
)
def prepare_data(cfg: DataConfig, store_root: str | None = None, parent_run_id: str | None = None) -> DataRefs:
    store = store_at(store_root)
    with tracking.parent(parent_run_id):
        refs = run_prepare_data(cfg, store)
    for name in ("sft", "eval", "text", "preferences"):
        if getattr(refs, name) is not None:
            report(f"prepare_data.{name}", getattr(refs, name), store)
    return refs
