"""Prefect tasks of the training stages (continued pretraining and SFT); the loops run on Ray workers."""

from __future__ import annotations

from posttrain_core.artifacts import ArtifactRef
from posttrain_core.config import PretrainConfig, SFTConfig
from posttrain_core.stage import key_for
from posttrain_core.train.sft import run_pretrain, run_sft
from tasks.common import run_core, stage_task


def _key(stage: str):
    return lambda p, store: key_for(stage, p["cfg"], {"data": p["data"], "base": p["base"]})


@stage_task("pretrain", _key("pretrain"))
def pretrain(
    cfg: PretrainConfig,
    data: ArtifactRef,
    base: ArtifactRef,
    store_root: str | None = None,
    parent_run_id: str | None = None,
) -> ArtifactRef:
    return run_core("pretrain", store_root, parent_run_id, lambda store: run_pretrain(cfg, data, base, store))


@stage_task("sft", _key("sft"))
def sft(
    cfg: SFTConfig,
    data: ArtifactRef,
    base: ArtifactRef,
    store_root: str | None = None,
    parent_run_id: str | None = None,
) -> ArtifactRef:
    return run_core("sft", store_root, parent_run_id, lambda store: run_sft(cfg, data, base, store))
