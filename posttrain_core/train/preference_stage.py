"""Stage functions of preference training: validate the inputs, then train a reward model or DPO on Ray ranks
(`preference_loop`), with DPO's reference log-probs computed once by their own cached stage."""

from __future__ import annotations

import math
import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from posttrain_core.artifacts import ArtifactRef, ArtifactStore
from posttrain_core.artifacts.node import NodePath, node_path
from posttrain_core.config import DPOConfig, RewardModelConfig
from posttrain_core.stage import StageContext, StageOutput, key_for, run_stage
from posttrain_core.train.preference_loop import REF_COLUMNS, PreferenceJob, PreferenceTrainer, reference_shard
from posttrain_core.train.steps import launch


class ReferenceLogprobsConfig(BaseModel):
    """What the reference log-probs depend on besides the data and the model (their stage key)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_seq_len: int = Field(128, ge=8, description="tokens per prompt + response (longer rows are truncated)")


def validate_preference_inputs(
    stage: str, cfg: RewardModelConfig | DPOConfig, data: ArtifactRef, models: dict[str, ArtifactRef], store
) -> dict[str, dict]:
    """Fail before any Ray work: wrong dataset kind, a model path that is not a model (or has no chat template),
    max_seq_len beyond a model's context, too many held-out pairs, label smoothing without cDPO."""
    from posttrain_core.models.loading import check_model_path, load_tokenizer

    if data.kind != "dataset" or data.schema_kind != "preferences":
        raise ValueError(f"{stage}: input data must be a 'preferences' dataset, got {data.kind}/{data.schema_kind}")
    infos = {}
    for name, ref in models.items():
        if ref.kind != "model":
            raise ValueError(f"{stage}: input '{name}' must be a model artifact, got a {ref.kind} ({ref.uri})")
        path = store.metadata_path(ref)
        info = infos[name] = check_model_path(path)
        ctx = info.get("max_position_embeddings")
        if ctx and cfg.max_seq_len > ctx:
            raise ValueError(
                f"{stage}: max_seq_len={cfg.max_seq_len} exceeds the context ({ctx}) of '{name}' at {ref.uri}"
            )
        load_tokenizer(str(path), require_chat_template=True)
    sizes = {name: info.get("vocab_size") for name, info in infos.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"{stage}: the models' vocabularies differ ({sizes}): the reference must share the tokenizer")
    n_rows = store.manifest(data).get("num_rows") if not data.external else None
    if n_rows is not None and cfg.eval_pairs >= n_rows:
        raise ValueError(
            f"{stage}: eval_pairs={cfg.eval_pairs} leaves no training pair out of {n_rows} rows ({data.uri})"
        )
    if isinstance(cfg, DPOConfig) and cfg.label_smoothing > 0 and cfg.loss_type != "cdpo":
        raise ValueError(
            f"{stage}: label_smoothing={cfg.label_smoothing} only applies to loss_type='cdpo' (got '{cfg.loss_type}')"
        )
    return infos


def _train(objective: Literal["rm", "dpo"], cfg, data_path: NodePath, model_path: NodePath, ctx: StageContext) -> dict:
    """Rank 0's result of `preference_loop` on `cfg.num_workers` ranks."""
    job = dict(objective=objective, cfg=cfg, data_path=data_path, model_path=model_path, stage=objective)
    return launch(PreferenceTrainer, PreferenceJob, ctx, "pairs", **job)


def _output(result: dict, extra: dict) -> StageOutput:
    info, history, probes = result.pop("model_info"), result.pop("history"), result.pop("probes")
    return StageOutput(
        uploaded=result.pop("uploaded", None),
        manifest={
            **extra,
            "architecture": info.get("architecture"),
            "dtype": info.get("dtype"),
            "adapter": info.get("adapter", False),
            "resumed_from_step": result["resumed_from_step"],
            "loss_history": [round(x, 6) for x in history["loss"]],
            "accuracy_history": [round(x, 6) for x in history["accuracy"]],
            "margin_history": [round(x, 6) for x in history["margin"]],
            **({"probe_scores": probes} if probes else {}),
        },
        metrics={k: float(v) for k, v in result.items() if isinstance(v, int | float) and k != "rank"},
    )


def run_reward_model(cfg: RewardModelConfig, data: ArtifactRef, base: ArtifactRef, store: ArtifactStore) -> ArtifactRef:
    """Train a Bradley-Terry reward model on a `preferences` dataset, initialised from the causal LM `base`.

    Returns:
        A model artifact: a `*ForSequenceClassification` folder (num_labels=1, full weights even with LoRA) that
        `models.reward.load_reward_model` opens; its manifest holds the held-out pairwise accuracy.
    """
    infos = validate_preference_inputs("reward_model", cfg, data, {"base": base}, store)

    def build(ctx: StageContext) -> StageOutput:
        result = _train("rm", cfg, node_path(store, data), node_path(store, base), ctx)
        extra = {"objective": "reward_model", "base_model": base.uri, "model_type": infos["base"].get("model_type")}
        return _output(result, extra)

    return run_stage("reward_model", cfg, {"data": data, "base": base}, store, "model", build)


def run_reference_logprobs(
    data: ArtifactRef, reference_model: ArtifactRef, store: ArtifactStore, cfg: DPOConfig
) -> ArtifactRef:
    """The reference model's summed response log-probs of every preference row, as their own cached artifact.

    The key holds only the data, the model and `max_seq_len` (`ReferenceLogprobsConfig`), so DPO runs that differ in
    beta, loss type, steps or worker count share it. Computed on `cfg.num_workers` Ray tasks.

    Returns:
        A `preferences` dataset: the input rows (same order) plus float64 columns `ref_chosen_logp`,
        `ref_rejected_logp` (NaN where the response lies beyond max_seq_len).
    """
    validate_preference_inputs("reference_logprobs", cfg, data, {"reference": reference_model}, store)
    key_cfg = ReferenceLogprobsConfig(max_seq_len=cfg.max_seq_len)

    def build(ctx: StageContext) -> StageOutput:
        import pyarrow as pa
        import ray

        from posttrain_core.cluster import connect, split
        from posttrain_core.data.io import read_dataset, write_dataset

        data_path, model_path = node_path(store, data), node_path(store, reference_model)
        table = read_dataset(store.local_path(data), "preferences")
        table = table.drop_columns([c for c in REF_COLUMNS if c in table.column_names])
        shards = split(list(range(table.num_rows)), cfg.num_workers)
        connect()
        threads = max(1, (os.cpu_count() or 1) // len(shards))
        task = ray.remote(num_cpus=1)(reference_shard)
        refs = [
            task.remote(model_path, data_path, s, cfg.max_seq_len, 2 * cfg.micro_batch_size, threads) for s in shards
        ]
        values = [v for part in ray.get(refs) for v in part]
        for name, col in zip(REF_COLUMNS, zip(*values, strict=True), strict=True):
            table = table.append_column(name, pa.array(col, pa.float64()))
        info = write_dataset(table, "preferences", ctx.outdir)
        finite = [(c, r) for c, r in values if not (math.isnan(c) or math.isnan(r))]
        metrics = {
            "num_rows": float(table.num_rows),
            "truncated_rows": float(table.num_rows - len(finite)),
            "mean_ref_chosen_logp": sum(c for c, _ in finite) / max(1, len(finite)),
            "mean_ref_rejected_logp": sum(r for _, r in finite) / max(1, len(finite)),
        }
        manifest = {
            "num_rows": info["num_rows"],
            "arrow_schema": info["schema"],
            "reference_model": reference_model.uri,
        }
        return StageOutput(manifest=manifest, metrics=metrics)

    inputs = {"data": data, "reference": reference_model}
    return run_stage("reference_logprobs", key_cfg, inputs, store, "dataset", build, schema_kind="preferences")


def run_dpo(
    cfg: DPOConfig,
    data: ArtifactRef,
    policy: ArtifactRef,
    store: ArtifactStore,
    reference: ArtifactRef | None = None,
) -> ArtifactRef:
    """DPO (or IPO / cDPO) of `policy` on a `preferences` dataset against `reference` (default: the policy itself).

    The reference log-probs come from `run_reference_logprobs` (built once, then a cache hit). The stage key is
    (cfg, data, policy, reference): the log-probs are a function of those, so they are recorded in the manifest
    (`reference_logprobs`) and logged as an MLflow input but are not a key input.

    Returns:
        A model artifact: the full policy, or a LoRA adapter folder with `cfg.lora` (merged with `cfg.merge_lora`).
    """
    reference = reference or policy
    infos = validate_preference_inputs("dpo", cfg, data, {"policy": policy, "reference": reference}, store)
    inputs = {"data": data, "policy": policy, "reference": reference}
    # On a cache hit of the DPO stage itself, the reference log-probs are not even looked up.
    ref_lp = (
        run_reference_logprobs(data, reference, store, cfg) if store.get(key_for("dpo", cfg, inputs)) is None else None
    )

    def build(ctx: StageContext) -> StageOutput:
        from posttrain_core import tracking

        assert ref_lp is not None
        tracking.log_inputs(ctx.tracker, {"reference_logprobs": ref_lp})
        result = _train("dpo", cfg, node_path(store, ref_lp), node_path(store, policy), ctx)
        extra = {
            "objective": "dpo",
            "base_model": policy.uri,
            "reference_model": reference.uri,
            "reference_logprobs": ref_lp.model_dump(),
            "model_type": infos["policy"].get("model_type"),
        }
        return _output(result, extra)

    return run_stage("dpo", cfg, inputs, store, "model", build)
