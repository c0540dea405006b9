"""The score stage: rollouts -> scored rollouts, with every reward term kept as its own component.

Terms (raw values in `reward_components`): each built-in verifier of `ScoreConfig.verifiers` and each user reward
function of `ScoreConfig.reward_functions` (`rewards.functions`), a reward model's score (`reward_model`, batched on
Ray actors) and DAPO's overlong shaping (`overlong`). `reward` = the weighted sum of the functions' components +
reward_model_weight * reward_model + overlong. The functions run on Ray tasks, so a slow one scales out.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import pyarrow as pa

from posttrain_core.rewards.functions import RewardSpec, Scores, apply, specs_of
from posttrain_core.rewards.shaping import overlong_penalty

if TYPE_CHECKING:
    from posttrain_core.artifacts import ArtifactRef, ArtifactStore
    from posttrain_core.config import ScoreConfig

log = logging.getLogger(__name__)

STAGE = "score"
RM_COMPONENT, OVERLONG_COMPONENT = "reward_model", "overlong"
TOOL_REWARD_COMPONENT, TOOL_CALLS_COMPONENT = "tool_reward", "tool_calls"

# A reward model given to `score_rollouts`: precomputed scores (one per row), or fn(prompts, responses) -> scores.
RewardModelScores = Sequence[float] | Callable[[list[list[dict]], list[str]], Sequence[float]]


def check_score_config(cfg: ScoreConfig, has_reward_model: bool) -> list[RewardSpec]:
    """Config errors, raised before any work: unknown verifiers, user reward functions that cannot be imported or
    take the wrong arguments, a missing pattern, a reward model weight without a reward model, an overlong buffer
    larger than the budget. Returns the reward terms."""
    specs = specs_of(cfg)
    if not specs and not has_reward_model and cfg.overlong_max_tokens is None:
        raise ValueError("ScoreConfig: no reward term (no verifier, no reward function, no reward model, no shaping)")
    for name, field in (("regex", "regex"), ("format", "format_pattern")):
        if name in cfg.verifiers:
            pattern = getattr(cfg, field)
            if not pattern:
                raise ValueError(f"ScoreConfig.verifiers has {name!r} but ScoreConfig.{field} (the pattern) is empty")
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"ScoreConfig.{field} {pattern!r} is not a valid pattern ({err})") from None
    if cfg.reward_model_weight != 0 and not has_reward_model:
        raise ValueError(f"ScoreConfig.reward_model_weight is {cfg.reward_model_weight} but no reward model was given")
    if cfg.overlong_max_tokens is not None and cfg.overlong_buffer > cfg.overlong_max_tokens:
        raise ValueError(
            f"ScoreConfig.overlong_buffer ({cfg.overlong_buffer}) exceeds overlong_max_tokens "
            f"({cfg.overlong_max_tokens}): expected length L_max - L_buf would be negative"
        )
    return specs


def reward_rows(table: pa.Table) -> list[dict]:
    """What a reward function sees of each rollout row: prompt (messages), response, answer, meta (a dict)."""
    n = table.num_rows
    prompts = table.column("messages").to_pylist() if "messages" in table.column_names else [[]] * n
    metas = table.column("meta").to_pylist() if "meta" in table.column_names else [None] * n
    return [
        {"prompt": p, "response": r, "answer": a, "meta": json.loads(m) if m else {}}
        for p, r, a, m in zip(
            prompts, table.column("response_text").to_pylist(), table.column("answer").to_pylist(), metas, strict=True
        )
    ]


def score_rollouts(
    table: pa.Table, cfg: ScoreConfig, rm: RewardModelScores | None = None, scores: Scores | None = None
) -> pa.Table:
    """Score a `rollouts` table; returns it as `scored_rollouts` (input columns kept, in the same row order).

    Per row: each reward term of `cfg` on (prompt, response_text, answer, meta) (`rewards.functions.apply`, or the
    precomputed `scores`); the reward model's score if `rm` is given; DAPO overlong shaping on len(response_ids) if
    `cfg.overlong_max_tokens` is set. Each is stored raw under its name in `reward_components`; `reward` is the
    weighted sum. `correct` is the first term's verifier outcome (null without one, or without an answer);
    `parse_failed` is true when a verifier could not parse the response.

    Args:
        table: a `rollouts` table.
        cfg: the terms, weights and shaping.
        rm: the reward model's scores, one per row in order, or a function (prompts, responses) -> scores that gets
            every row's `messages` (needs that column, which `run_rollout` keeps) and `response_text`.
        scores: the reward terms already computed for these rows (the stage computes them on Ray tasks).
    """
    from posttrain_core.data.schemas import validate_table

    specs = check_score_config(cfg, rm is not None)
    table = validate_table(table, "rollouts", source="score_rollouts")
    n = table.num_rows
    if scores is None:
        scores = apply(specs, reward_rows(table), cfg.reward_timeout_s)
    components, rewards = scores.components, list(scores.reward)
    if rm is not None:
        if callable(rm):
            if "messages" not in table.column_names:
                raise ValueError("score_rollouts: reward-model scoring needs the prompts' `messages` column")
            rm_scores = list(rm(table.column("messages").to_pylist(), table.column("response_text").to_pylist()))
        else:
            rm_scores = list(rm)
        if len(rm_scores) != n:
            raise ValueError(f"score_rollouts: {len(rm_scores)} reward-model scores for {n} rollouts")
        for i, s in enumerate(rm_scores):
            s = float(s)
            if not math.isfinite(s):
                raise ValueError(f"score_rollouts: row {i}: the reward model's score is {s}")
            components[i][RM_COMPONENT] = s
            rewards[i] += cfg.reward_model_weight * s
    turns = table.column("turns").to_pylist()
    for i, t in enumerate(turns):  # multi-turn rows: the tools' and environment's rewards, and the price of each call
        if t is None:
            continue
        segments = json.loads(t)
        tool_turns = [s for s in segments if s["role"] == "tool"]
        components[i][TOOL_REWARD_COMPONENT] = sum(
            float(s.get("reward", 0.0)) for s in segments if s["role"] != "assistant"
        )
        components[i][TOOL_CALLS_COMPONENT] = float(len(tool_turns))
        rewards[i] += components[i][TOOL_REWARD_COMPONENT] - cfg.tool_call_cost * len(tool_turns)
    if cfg.overlong_max_tokens is not None:  # policy tokens only: tool output is not the policy's length
        from posttrain_core.rollout.engine import policy_lengths

        terms = overlong_penalty(policy_lengths(table), cfg.overlong_max_tokens, cfg.overlong_buffer, cfg.overlong_penalty)
        for i, t in enumerate(terms):
            components[i][OVERLONG_COMPONENT] = t
            rewards[i] += t
    scored = (
        table.append_column("reward", pa.array(rewards, pa.float32()))
        .append_column(
            "reward_components",
            pa.array([list(c.items()) for c in components], pa.map_(pa.string(), pa.float32())),
        )
        .append_column("correct", pa.array(scores.correct, pa.bool_()))
        .append_column("parse_failed", pa.array(scores.parse_failed, pa.bool_()))
    )
    return validate_table(scored, "scored_rollouts", source="score_rollouts")


def summarize_scores(scored: pa.Table, errors: dict[str, int] | None = None) -> dict[str, float]:
    """Manifest metrics: reward mean/std, accuracy, parse failures (count and rate), each component's mean, and the
    samples whose reward functions failed (`reward_errors`, and per function `reward_errors/<name>`)."""
    rewards = scored.column("reward").to_pylist()
    n = len(rewards)
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1)) if n > 1 else 0.0
    outcomes = [c for c in scored.column("correct").to_pylist() if c is not None]
    failures = sum(scored.column("parse_failed").to_pylist())
    metrics = {
        "samples": float(n),
        "reward_mean": mean,
        "reward_std": std,
        "parse_failures": float(failures),
        "parse_failure_rate": failures / n,
        "reward_errors": float(sum((errors or {}).values())),
    }
    metrics.update({f"reward_errors/{name}": float(k) for name, k in (errors or {}).items()})
    if outcomes:
        metrics["accuracy"] = sum(outcomes) / len(outcomes)
    sums: dict[str, float] = {}
    for row in scored.column("reward_components").to_pylist():
        for name, value in row:
            sums[name] = sums.get(name, 0.0) + value
    metrics.update({f"reward/{name}": total / n for name, total in sorted(sums.items())})
    return metrics


def score_on_ray(specs: list[RewardSpec], rows: list[dict], cfg: ScoreConfig) -> Scores:
    """`rewards.functions.apply` over `cfg.num_workers` Ray tasks (contiguous shards), merged in row order; the
    tasks load every function again by its reference."""
    import ray

    from posttrain_core.cluster import connect, split

    connect()
    shards = split(list(range(len(rows))), cfg.num_workers)
    task = ray.remote(num_cpus=1)(apply)
    parts = ray.get([task.remote(specs, [rows[i] for i in shard], cfg.reward_timeout_s, shard[0]) for shard in shards])
    out = Scores([], [], [], [], {})
    for part in parts:
        out.components += part.components
        out.reward += part.reward
        out.correct += part.correct
        out.parse_failed += part.parse_failed
        for name, k in part.errors.items():
            out.errors[name] = out.errors.get(name, 0) + k
        out.first_error = out.first_error or part.first_error
    return out


class RewardModelWorker:
    """Ray Data callable class: a reward model per actor; a batch of (messages, response_text) -> scores."""

    def __init__(self, model_path: str, batch_size: int, num_threads: int | None = None):
        import torch

        from posttrain_core.models.reward import load_reward_model

        if num_threads:
            torch.set_num_threads(num_threads)
        self.model, self.tokenizer = load_reward_model(model_path)
        self.batch_size = batch_size

    def __call__(self, batch: pa.Table) -> pa.Table:
        from posttrain_core.models.reward import reward_scores

        scores = reward_scores(
            self.model,
            self.tokenizer,
            batch.column("messages").to_pylist(),
            batch.column("response_text").to_pylist(),
            batch_size=self.batch_size,
        )
        return pa.table({"_row": batch.column("_row"), "score": pa.array(scores, pa.float64())})


def score_inputs(rollouts: ArtifactRef, reward_model: ArtifactRef | None) -> dict[str, ArtifactRef]:
    """The stage's named inputs (part of its key; the Prefect task's cache key uses the same)."""
    return {"rollouts": rollouts} if reward_model is None else {"rollouts": rollouts, "reward_model": reward_model}


def _ray_reward_scores(table: pa.Table, cfg: ScoreConfig, model_path: str) -> list[float]:
    """Reward-model scores of every row, on `cfg.num_workers` actors fed by Ray Data, in row order."""
    import ray

    from posttrain_core.cluster import connect

    connect()
    rows = table.select(["messages", "response_text"]).append_column(
        "_row", pa.array(range(table.num_rows), pa.int64())
    )
    cpus = float(ray.cluster_resources().get("CPU", 1))
    ds = ray.data.from_arrow(rows).repartition(target_num_rows_per_block=cfg.batch_size)
    ds = ds.map_batches(
        RewardModelWorker,
        fn_constructor_kwargs=dict(
            model_path=model_path,
            batch_size=cfg.batch_size,
            num_threads=max(1, (os.cpu_count() or 1) // cfg.num_workers),
        ),
        compute=ray.data.ActorPoolStrategy(size=cfg.num_workers),
        batch_size=cfg.batch_size,
        batch_format="pyarrow",
        # Ray Data's read tasks need a CPU of their own: an actor pool holding every CPU deadlocks the pipeline.
        num_cpus=max(0.1, min(1.0, (cpus - 1) / cfg.num_workers)),
    )
    out = pa.concat_tables([t for t in ray.get(ds.to_arrow_refs()) if t.num_rows])
    if sorted(out.column("_row").to_pylist()) != list(range(table.num_rows)):
        raise RuntimeError(f"{STAGE}: reward-model scoring returned {out.num_rows} scores for {table.num_rows} rows")
    return out.sort_by("_row").column("score").to_pylist()


def _column_names(store: ArtifactStore, ref: ArtifactRef) -> list[str]:
    """Column names of a dataset artifact, from its first parquet file's footer (no data read)."""
    import pyarrow.parquet as pq

    from posttrain_core.data.io import parquet_files

    return pq.read_schema(parquet_files(store.local_path(ref))[0]).names


def run_score(
    cfg: ScoreConfig, rollouts: ArtifactRef, store: ArtifactStore, reward_model: ArtifactRef | None = None
) -> ArtifactRef:
    """Score a `rollouts` dataset (`score_rollouts`); publish a `scored_rollouts` dataset.

    The reward functions and verifiers run on `cfg.num_workers` Ray tasks; the reward model, if given, scores on as
    many Ray actors in batches of `cfg.batch_size`. A sample whose function raised, timed out
    (`cfg.reward_timeout_s`) or returned no finite number scores 0 for that function and is counted
    (`reward_errors`; the first traceback is logged with its row); a function that fails on every sample fails the
    stage. Manifest metrics: `summarize_scores`. The key holds the source of every user reward function.

    Args:
        cfg: terms, weights, shaping and the workers.
        rollouts: a `rollouts` dataset (from `run_rollout`: it keeps the prompts' `messages` and `meta`).
        store: the artifact store.
        reward_model: a reward model folder (from the reward-model stage), or None.
    """
    from posttrain_core.data.io import read_dataset, write_dataset
    from posttrain_core.stage import StageContext, StageOutput, run_stage

    if rollouts.kind != "dataset" or rollouts.schema_kind != "rollouts":
        raise ValueError(f"{STAGE}: input must be a 'rollouts' dataset, got {rollouts.kind} '{rollouts.schema_kind}'")
    specs = check_score_config(cfg, reward_model is not None)
    if reward_model is not None:
        from posttrain_core.models.loading import check_model_path

        if reward_model.kind != "model":
            raise ValueError(f"{STAGE}: reward_model must be a model, got a {reward_model.kind} at {reward_model.uri}")
        check_model_path(store.local_path(reward_model))
        if "messages" not in _column_names(store, rollouts):
            raise ValueError(
                f"{STAGE}: {rollouts.uri} has no `messages` column (the prompts), which reward-model scoring needs; "
                "rollouts from run_rollout keep it"
            )

    def build(ctx: StageContext) -> StageOutput:
        table = read_dataset(store.local_path(rollouts), "rollouts")
        scores = score_on_ray(specs, reward_rows(table), cfg) if specs else None
        if scores is not None and scores.errors:
            log.warning("%s: reward functions failed on %s samples; the first: %s", STAGE, scores.errors,
                        scores.first_error)  # fmt: skip
            every = [name for name, k in scores.errors.items() if k == table.num_rows]
            if every:
                raise RuntimeError(f"{STAGE}: {every[0]!r} failed on every sample; the first: {scores.first_error}")
        rm = _ray_reward_scores(table, cfg, str(store.local_path(reward_model))) if reward_model else None
        scored = score_rollouts(table, cfg, rm=rm, scores=scores)
        write_dataset(scored, "scored_rollouts", ctx.outdir)
        metrics = summarize_scores(scored, scores.errors if scores else None)
        log.info(
            "%s: %d samples, reward %.3f, accuracy %s, %d parse failures, %d reward errors", STAGE, scored.num_rows,
            metrics["reward_mean"], f"{metrics['accuracy']:.3f}" if "accuracy" in metrics else "n/a",
            int(metrics["parse_failures"]), int(metrics["reward_errors"]),
        )  # fmt: skip
        manifest = {"rollouts": rollouts.uri, "reward_model": reward_model.uri if reward_model else None}
        return StageOutput(manifest=manifest, metrics=metrics)

    return run_stage(
        STAGE, cfg, score_inputs(rollouts, reward_model), store, "dataset", build, schema_kind="scored_rollouts"
    )
