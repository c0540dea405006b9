"""Prefect task of the build_model stage (a user's HF folder or a tiny model with its own tokenizer)."""

from __future__ import annotations

from prefect import task

from posttrain_core import tracking
from posttrain_core.artifacts import ArtifactRef
from posttrain_core.config import ModelConfig
from posttrain_core.models.build import run_build_model
from tasks.common import RETRY, is_transient, store_at


@task(name="build_model", task_run_name="build_model", retry_condition_fn=is_transient, **RETRY)
def build_model(
    cfg: ModelConfig, corpus: ArtifactRef | None, store_root: str | None = None, parent_run_id: str | None = None
) -> ArtifactRef:
    # Not Prefect-cached on purpose: the core stage is itself a store lookup, and an external model folder must be
    # re-fingerprinted on every run so a changed folder changes every downstream key.
    with tracking.parent(parent_run_id):
        return run_build_model(cfg, corpus, store_at(store_root))
