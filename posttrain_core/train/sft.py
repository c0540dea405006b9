"""Stage functions for SFT and continued pretraining: validate, then run `train_loop` on a Ray worker group.

`run_sft(cfg, data, base, store) -> model ref`. A cached key returns at once; a retried stage resumes from the newest
in-stage checkpoint in the stage's staging folder.
"""

from __future__ import annotations

from posttrain_core.artifacts import ArtifactRef, ArtifactStore
from posttrain_core.artifacts.node import node_path
from posttrain_core.config import PretrainConfig, SFTConfig, TrainConfig
from posttrain_core.stage import StageContext, StageOutput, run_stage
from posttrain_core.train.loop import Trainer, TrainJob
from posttrain_core.train.steps import checkpoints, launch


def run_sft(cfg: SFTConfig, data: ArtifactRef, base: ArtifactRef, store: ArtifactStore) -> ArtifactRef:
    """Supervised fine-tuning of `base` on an `sft` dataset (loss on assistant tokens only)."""
    return _run_training("sft", "sft", cfg, data, base, store)


def run_pretrain(cfg: PretrainConfig, data: ArtifactRef, base: ArtifactRef, store: ArtifactStore) -> ArtifactRef:
    """Continued pretraining of `base` on a `text` dataset (packed sequences, every token trained on)."""
    return _run_training("pretrain", "pretrain", cfg, data, base, store)


def validate_inputs(
    objective: str, cfg: TrainConfig, data: ArtifactRef, base: ArtifactRef, store: ArtifactStore | None = None
) -> dict:
    """Fail before any Ray work: wrong dataset kind, a model path that is not a model, a too long max_seq_len.
    `base` is read through `store` (from a remote store: its copy in this machine's cache)."""
    from posttrain_core.models.loading import check_model_path

    want = "text" if objective == "pretrain" else "sft"
    if data.kind != "dataset" or data.schema_kind != want:
        raise ValueError(f"{objective}: input data must be a '{want}' dataset, got {data.kind}/{data.schema_kind}")
    info = check_model_path(store.metadata_path(base) if store is not None else base.uri)
    ctx = info.get("max_position_embeddings")
    if ctx and cfg.max_seq_len > ctx:
        raise ValueError(f"max_seq_len={cfg.max_seq_len} exceeds the model's context ({ctx}) at {base.uri}")
    return info


def _run_training(
    stage: str, objective: str, cfg: TrainConfig, data: ArtifactRef, base: ArtifactRef, store: ArtifactStore
) -> ArtifactRef:
    base_info = validate_inputs(objective, cfg, data, base, store)

    def build(ctx: StageContext) -> StageOutput:
        paths = dict(data_path=node_path(store, data), base_path=node_path(store, base))
        result = launch(Trainer, TrainJob, ctx, objective=objective, cfg=cfg, stage=stage, **paths)
        info = result.pop("model_info")
        history = result.pop("loss_history")
        step_seconds = result.pop("step_seconds")
        return StageOutput(
            uploaded=result.pop("uploaded", None),
            manifest={
                "objective": objective,
                "base_model": base.uri,
                "architecture": info.get("architecture"),
                "dtype": info.get("dtype"),
                "adapter": info.get("adapter", False),
                "model_type": base_info.get("model_type"),
                "resumed_from_step": result["resumed_from_step"],
                "loss_history": [round(x, 6) for x in history],
                "step_seconds": [round(x, 4) for x in step_seconds],
            },
            metrics={k: float(v) for k, v in result.items() if isinstance(v, int | float) and k != "rank"},
        )

    return run_stage(stage, cfg, {"data": data, "base": base}, store, "model", build)


def checkpoint_steps(store: ArtifactStore, key: str) -> list[int]:
    """In-stage checkpoint steps present for a stage key (for inspection and tests)."""
    return [int(p.stem.split("_")[1]) for p in checkpoints(store.staging_dir(key))]
