"""Prefect tasks of the training stages (continued pretraining and SFT); the loops run on Ray workers."""

from __future__ import annotations

from prefect import task

from posttrain_core import tracking
from posttrain_core.artifacts import ArtifactRef
from posttrain_core.config import PretrainConfig, SFTConfig
from posttrain_core.stage import key_for
from posttrain_core.train.sft import run_pretrain, run_sft
from tasks.common import RETRY, is_transient, report, stage_cache, store_at


def _key(stage: str):
    return lambda p, store: key_for(stage, p["cfg"], {"data": p["data"], "base": p["base"]})


@task(
    name="pretrain",
    task_run_name="pretrain",
    cache_key_fn=stage_cache(_key("pretrain")),
    persist_result=True,
    retry_condition_fn=is_transient,
    **RETRY,
)
def pretrain(
    cfg: PretrainConfig,
    data: ArtifactRef,
    base: ArtifactRef,
    store_root: str | None = None,
    parent_run_id: str | None = None,
) -> ArtifactRef:
    store = store_at(store_root)
    with tracking.parent(parent_run_id):
        ref = run_pretrain(cfg, data, base, store)
    report("pretrain", ref, store)
    return ref


@task(
    name="sft",
    task_run_name="sft",
    cache_key_fn=stage_cache(_key("sft")),
    persist_result=True,
    retry_condition_fn=is_transient,
    **RETRY,
)
def sft(
    cfg: SFTConfig,
    data: ArtifactRef,
    base: ArtifactRef,
    store_root: str | None = None,
    parent_run_id: str | None = None,
) -> ArtifactRef:
    store = store_at(store_root)
    with tracking.parent(parent_run_id):
        ref = run_sft(cfg, data, base, store)
    report("sft", ref, store)
    return ref
