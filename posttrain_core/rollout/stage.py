"""The rollout stage: n samples per prompt from a policy, on the engine actors of a warm group (`rollout.pool`).

Publishes a `rollouts` dataset (one row per sample, with the engine's log-probs and the digest of the policy that
generated it). `engine="hf"` runs `HFEngine`; `engine="vllm"` runs `VLLMEngine` inside the vLLM environment.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from posttrain_core.artifacts.node import NodePath, node_path
from posttrain_core.plugins import absolute
from posttrain_core.rollout.engine import SamplingSettings, policy_lengths
from posttrain_core.rollout.environments import Environments
from posttrain_core.rollout.multiturn import ToolSettings
from posttrain_core.rollout.pool import EnginePool, EngineSpec
from posttrain_core.rollout.prompts import check_context, engine_batches, prompt_families, prompt_meta, select_prompts
from posttrain_core.rollout.tools import ToolBox
from posttrain_core.rollout.worker import ENGINE_SECONDS
from posttrain_core.warm import WarmGroup

if TYPE_CHECKING:
    from posttrain_core.artifacts import ArtifactRef, ArtifactStore
    from posttrain_core.config import RolloutConfig, ToolConfig

log = logging.getLogger(__name__)

STAGE = "rollout"


def sampling_settings(cfg: RolloutConfig) -> SamplingSettings:
    """The plain, picklable sampling parameters of a rollout config."""
    return SamplingSettings(
        n=cfg.n, temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens, stop=tuple(cfg.stop),
        seed=cfg.seed, tools=tool_settings(cfg.tools),
    )  # fmt: skip


def tool_settings(cfg: ToolConfig | None) -> ToolSettings | None:
    """The engines' tool settings; engine actors load the tools again by these references (file paths absolute)."""
    if cfg is None:
        return None
    return ToolSettings(
        tools=tuple(absolute(ref) for ref in cfg.tools),
        environment=absolute(cfg.environment) if cfg.environment else None, parser=cfg.parser, max_turns=cfg.max_turns,
        max_tool_calls_per_turn=cfg.max_tool_calls_per_turn, tool_timeout_s=cfg.tool_timeout_s,
        max_tool_response_tokens=cfg.max_tool_response_tokens, max_total_tokens=cfg.max_total_tokens,
    )  # fmt: skip


def check_tools(cfg: ToolConfig | None, max_tokens: int, field: str) -> int:
    """Every tool loads and has a schema, the environment class loads and has reset/step (before any Ray work);
    returns the response budget to check against the model's context: max_total_tokens with tools, else
    `max_tokens`."""
    if cfg is None:
        return max_tokens
    ToolBox(tuple(cfg.tools), f"{field}.tools")
    if cfg.environment:
        Environments(cfg.environment, f"{field}.environment")
    return cfg.max_total_tokens


def check_rollout_inputs(
    cfg: RolloutConfig, prompts: ArtifactRef, policy: ArtifactRef, store: ArtifactStore
) -> pa.Table:
    """Everything that can be checked before Ray starts; returns the prompt rows to sample (after max_prompts).

    Raises:
        ValueError: not a `prompts` dataset, a column missing (SchemaError), duplicated prompt ids, no prompts, the
            longest prompt + max_tokens beyond the model's context, or engine="vllm" without its environment or
            with a vision-language policy.
        FileNotFoundError: the policy folder is missing.
    """
    from posttrain_core.models.loading import check_model_path

    if prompts.kind != "dataset" or prompts.schema_kind != "prompts":
        raise ValueError(
            f"{STAGE}: input 'prompts' must be a 'prompts' dataset (prompt_id, messages, answer, meta), got "
            f"{prompts.kind} '{prompts.schema_kind}' at {prompts.uri}"
        )
    if policy.kind != "model":
        raise ValueError(f"{STAGE}: input 'policy' must be a model, got a {policy.kind} at {policy.uri}")
    policy_path = store.metadata_path(policy)  # checks only: no weights downloaded for them
    info = check_model_path(policy_path)
    table = select_prompts(cfg, prompts, store, STAGE)
    budget = check_tools(cfg.tools, cfg.max_tokens, "RolloutConfig.tools")
    field = "RolloutConfig.tools.max_total_tokens" if cfg.tools else "RolloutConfig.max_tokens"
    check_context(policy_path, info, table, budget, field, STAGE)
    if cfg.engine == "vllm":
        from posttrain_core.rollout.vllm_env import check_vllm_model, vllm_options

        check_vllm_model(policy_path, "RolloutConfig.engine='vllm'")
        vllm_options(cfg)
    return table


def generate(
    pool: EnginePool,
    table: pa.Table,
    policy: ArtifactRef,
    model_path: str | NodePath,
    params: SamplingSettings,
    batch_size: int,
    stage: str = STAGE,
) -> tuple[pa.Table, dict[str, float], str]:
    """`params.n` samples of every prompt row of `table` with `policy` on `pool`: (the rows in (prompt order,
    sample_index) order, every prompt's n samples checked to be there and from `policy`; the metrics; how the
    engines got the policy).

    Rows that an RL update prefetched for this very policy (`EnginePool.prefetch`) are taken instead of generated.
    """
    started = time.perf_counter()
    batches = engine_batches(table, batch_size, pool.spec.num_engines)
    with pool.warm.busy(pool.role):  # another stage of the flow, in another thread, waits for these engines
        parts = pool.take_prefetched(policy.key, policy.digest, batches, params)
        load: dict[str, Any] = {"action": "prefetched", "load_s": 0.0}
        waited = time.perf_counter() - started
        if parts is None:
            load = pool.serve(model_path, policy.digest, params.seed)
            generating = time.perf_counter()
            parts = pool.generate(batches, params)
            waited = time.perf_counter() - generating
    wall = time.perf_counter() - started
    ids = table.column("prompt_id").to_pylist()
    out = pa.concat_tables([t for t in parts if t.num_rows])
    _check_counts(out, ids, params.n, stage)
    _check_policy(out, policy, stage)
    order = {pid: i for i, pid in enumerate(ids)}
    out = out.append_column("_order", pa.array([order[p] for p in out.column("prompt_id").to_pylist()], pa.int64()))
    out = out.sort_by([("_order", "ascending"), ("sample_index", "ascending")])
    engine_seconds = sum(out.column(ENGINE_SECONDS).to_pylist())
    out = out.drop_columns(["_order", ENGINE_SECONDS])
    lengths = policy_lengths(out)  # generated tokens: tool turns were not generated
    tokens = sum(lengths)
    metrics = {
        "samples": float(out.num_rows),
        "prompts": float(len(ids)),
        "tokens": float(tokens),
        "tokens_per_s": tokens / max(engine_seconds / pool.spec.num_engines, 1e-9),
        "wall_tokens_per_s": tokens / max(wall, 1e-9),
        "response_len_mean": tokens / len(lengths),
        "response_len_max": float(max(lengths)),
        "finish_length_rate": out.column("finish_reason").to_pylist().count("length") / out.num_rows,
        "engine_load_s": load["load_s"],
    }
    if params.tools is not None:
        metrics |= tool_metrics(out, table)
    if load["action"] == "prefetched":  # generation that ran before this stage, beside the update's publish
        metrics["generate_overlap_s"] = max(0.0, engine_seconds / pool.spec.num_engines - waited)
    return out, metrics, load["action"]


def run_rollout(
    cfg: RolloutConfig,
    prompts: ArtifactRef,
    policy: ArtifactRef,
    store: ArtifactStore,
    warm: WarmGroup | None = None,
) -> ArtifactRef:
    """Sample `cfg.n` responses to every prompt with `policy`; publish them as a `rollouts` dataset.

    The driver cuts the prompts into batches of `prompts_per_call` and hands them to `cfg.num_engines` engine
    actors, each taking the next batch when it is free; it checks that every prompt got exactly n samples from the
    right policy, sorts them by (prompt order, sample_index) and writes them. Each sample draws from its own seeded
    stream, so the rows do not depend on the batching or on which engine generated them.

    Manifest metrics: samples, prompts, tokens, tokens_per_s (generated tokens per second of the engines while they
    generate: tokens / (engine-seconds / num_engines)), wall_tokens_per_s (tokens / wall time, the engines' loading
    included), response_len_mean / _max (policy tokens), finish_length_rate, engine_load_s, and for rows an RL update
    prefetched generate_overlap_s (engine time spent before this stage asked for the rows); the manifest's
    `engine_load` says how the engines got the policy (started, kept, updated, reloaded, prefetched).

    Args:
        cfg: sampling settings and the engines.
        prompts: a `prompts` dataset.
        policy: a model (full or LoRA adapter folder).
        store: the artifact store.
        warm: the warm group (`warm.WarmGroup`) whose engines generate and outlive this stage; None: the process's.
    """
    from posttrain_core.data.io import write_dataset
    from posttrain_core.stage import StageContext, StageOutput, run_stage

    table = check_rollout_inputs(cfg, prompts, policy, store)

    def build(ctx: StageContext) -> StageOutput:
        out, metrics, action = generate(
            EnginePool(WarmGroup.use(warm), EngineSpec.of(cfg)), table, policy, node_path(store, policy),
            sampling_settings(cfg), cfg.batch_size,
        )  # fmt: skip
        write_dataset(out, "rollouts", ctx.outdir)
        log.info(
            "%s: %d samples of %d prompts, %.0f tokens/s (%.0f with loading), mean length %.1f", STAGE,
            out.num_rows, table.num_rows, metrics["tokens_per_s"], metrics["wall_tokens_per_s"],
            metrics["response_len_mean"],
        )  # fmt: skip
        manifest = {
            "policy": policy.uri,
            "engine": cfg.engine,
            "engine_load": action,
            "num_prompts": table.num_rows,
            "num_samples": out.num_rows,
        }
        return StageOutput(manifest=manifest, metrics=metrics)

    return run_stage(STAGE, cfg, rollout_inputs(prompts, policy), store, "dataset", build, schema_kind="rollouts")


def prefetch_rollout(
    warm: WarmGroup,
    cfg: RolloutConfig,
    prompts: ArtifactRef,
    serving: ArtifactRef,
    key: str,
    weights: Callable[[], Any],
    store: ArtifactStore,
) -> bool:
    """Start the rollout stage `cfg` of the next policy on the warm group's engines, with that policy's weights in
    memory, while the RL update that made them still saves and publishes its artifact `key`.

    The rollout stage of the published policy then takes the rows instead of generating, so the checkpoint's write,
    flush and digest overlap generation instead of preceding it. Only for hf engines on full (non-LoRA) models whose
    engines serve `serving` (the update's input policy); returns False when it does not apply, and nothing changes.

    Args:
        weights: returns a Ray object ref of the new policy's state dict; called only when the prefetch applies.
    """
    from posttrain_core.models.loading import check_model_path

    if cfg.engine != "hf" or check_model_path(store.metadata_path(serving))["is_adapter"]:
        return False
    batches = engine_batches(select_prompts(cfg, prompts, store, STAGE), cfg.batch_size, cfg.num_engines)
    pool = EnginePool(warm, EngineSpec.of(cfg))
    return pool.prefetch(weights, key, batches, sampling_settings(cfg), serving=serving.digest)


def tool_metrics(rollouts: pa.Table, prompts: pa.Table) -> dict[str, float]:
    """Multi-turn metrics of a rollouts table: turns, tool calls and errors per sample, call latency p50/p95 (ms),
    the max_turns rate, the share of samples that called a tool per prompt family (meta.family), and where the
    prompts' meta says which need a tool (meta.needs_tool), tool-use precision (samples that called a tool where one
    was needed / all that called one) and recall (samples that needed one and called it / all that needed one)."""
    import json

    import numpy as np

    n = rollouts.num_rows
    calls = rollouts.column("num_tool_calls").to_pylist()
    errors = sum(rollouts.column("tool_errors").to_pylist())
    latency = [s["latency_ms"] for t in rollouts.column("turns").to_pylist() for s in json.loads(t or "[]")
               if s["role"] == "tool"]  # fmt: skip
    out = {
        "turns_mean": sum(rollouts.column("num_turns").to_pylist()) / n,
        "tool_calls_per_sample": sum(calls) / n,
        "tool_call_rate": sum(1 for c in calls if c) / n,
        "tool_error_rate": errors / max(sum(calls), 1),
        "finish_max_turns_rate": rollouts.column("finish_reason").to_pylist().count("max_turns") / n,
    }
    if latency:
        out |= {
            "tool_latency_p50_ms": float(np.percentile(latency, 50)),
            "tool_latency_p95_ms": float(np.percentile(latency, 95)),
        }
    ids = rollouts.column("prompt_id").to_pylist()
    family, needs = prompt_families(prompts), prompt_meta(prompts, "needs_tool")
    by: dict[str, list[int]] = {}
    for p, c in zip(ids, calls, strict=True):
        if family.get(p):
            by.setdefault(family[p], []).append(int(c > 0))
    out |= {f"tool_call_rate/{f}": sum(v) / len(v) for f, v in by.items()}
    labelled = [(bool(needs[p]), c > 0) for p, c in zip(ids, calls, strict=True) if needs.get(p) is not None]
    if labelled:
        called, needed = [x for x in labelled if x[1]], [x for x in labelled if x[0]]
        if called:  # undefined without calls: left out rather than guessed
            out["tool_precision"] = sum(1 for x in called if x[0]) / len(called)
        if needed:
            out["tool_recall"] = sum(1 for x in needed if x[1]) / len(needed)
    return out


def rollout_inputs(prompts: ArtifactRef, policy: ArtifactRef) -> dict[str, ArtifactRef]:
    """The stage's named inputs (part of its key; the Prefect task's cache key uses the same)."""
    return {"prompts": prompts, "policy": policy}


def _check_counts(table: pa.Table, ids: list[str], n: int, stage: str) -> None:
    got: dict[str, list[int]] = {}
    for pid, k in zip(table.column("prompt_id").to_pylist(), table.column("sample_index").to_pylist(), strict=True):
        got.setdefault(pid, []).append(k)
    for pid in ids:
        if sorted(got.get(pid, [])) != list(range(n)):
            raise RuntimeError(
                f"{stage}: prompt {pid!r} has samples {sorted(got.get(pid, []))}, expected 0..{n - 1} "
                "(an engine dropped or duplicated rows)"
            )
    extra = set(got) - set(ids)
    if extra:
        raise RuntimeError(f"{stage}: rows for prompts that were not asked for: {sorted(extra)[:5]}")


def _check_policy(table: pa.Table, policy: ArtifactRef, stage: str) -> None:
    """Every row must come from `policy`: an engine still holding older weights would poison the RL update."""
    import pyarrow.compute as pc

    stale = table.filter(pc.not_equal(table.column("policy_digest"), policy.digest))
    if stale.num_rows:
        raise RuntimeError(
            f"{stage}: {stale.num_rows} samples (first: prompt {stale.column('prompt_id')[0].as_py()!r}) were "
            f"generated with policy digest {stale.column('policy_digest')[0].as_py()!r}, not {policy.digest!r}; "
            "nothing is published"
        )
