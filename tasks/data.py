"""Prefect task of the prepare_data stage."""

from __future__ import annotations

from posttrain_core import tracking
from posttrain_core.config import DataConfig
from posttrain_core.data.prepare import DataRefs, output_keys, run_prepare_data
from tasks.common import report, stage_task, store_at


@stage_task("prepare_data", lambda p, store: output_keys(p["cfg"], store)["sft"])
def prepare_data(cfg: DataConfig, store_root: str | None = None, parent_run_id: str | None = None) -> DataRefs:
    store = store_at(store_root)
    with tracking.parent(parent_run_id):
        refs = run_prepare_data(cfg, store)
    for name in ("sft", "eval", "text", "prompts", "preferences"):
        if getattr(refs, name) is not None:
            report(f"prepare_data.{name}", getattr(refs, name), store)
    return refs
