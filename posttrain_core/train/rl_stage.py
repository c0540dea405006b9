"""The RL update stage (driver side): scored rollouts + policy -> new policy (and critic), on a Ray worker group.

`run_rl_update` reads the scored rollouts, checks they were sampled by the policy it is given (never train on stale
samples), lets the workers recompute old/reference log-probs and values where the advantages need them
(`RLWorker.prepare`; else the update computes the reference log-probs of the KL term itself), computes advantages
over the whole batch here (group statistics, whitening, KL in the reward), then runs the update on the workers and
publishes the new policy with `critic/` and `trainer_state.pt` inside. Also: VAPO's value pretraining, the
per-iteration rollout settings and DAPO's dynamic-sampling bookkeeping, which the flow calls.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
from pydantic import BaseModel

from posttrain_core.artifacts import ArtifactRef, ArtifactStore
from posttrain_core.config import RLConfig, RolloutConfig, ScoreConfig
from posttrain_core.stage import StageContext, StageOutput, run_stage
from posttrain_core.train.rl import CRITIC_DIR, STATE_FILE, RLBatch, RLJob, RLWorker, Targets

log = logging.getLogger(__name__)

STAGE, VALUE_STAGE = "rl_update", "value_pretrain"


class NextRollout(BaseModel):
    """The rollout stage that follows an update (for `run_rl_update`'s prefetch): the warm engine pool it will run
    on, its settings and prompts. Not part of the update's key: it changes when the next samples are generated,
    not the update's artifact or the samples."""

    engines: str
    rollout: RolloutConfig
    prompts: ArtifactRef


class DynamicSamplingError(RuntimeError):
    """Every generation batch so far had too few prompts with non-uniform rewards."""


# ------------------------------------------------------------------------------------------- flow helpers
def iteration_rollout(
    cfg: RolloutConfig, iteration: int, gen_batch: int = 0, max_gen_batches: int = 1
) -> RolloutConfig:
    """The rollout settings of one iteration: the next window of `max_prompts` prompts and a seed of its own.

    Iteration k (from 1; 0 is the initial policy's batch for value pretraining), generation batch j takes the
    window starting at ((k - 1) * max_gen_batches + j) * max_prompts, wrapping around the prompts.
    """
    window = (max(iteration - 1, 0) * max_gen_batches + gen_batch) * (cfg.max_prompts or 0)
    return cfg.model_copy(update={"prompt_start": window, "seed": cfg.seed + 1000 * iteration + gen_batch})


def score_config_for(rl: RLConfig, score: ScoreConfig, rollout: RolloutConfig) -> ScoreConfig:
    """DAPO turns on overlong shaping (budget = rollout.max_tokens, buffer a quarter of it) unless already set."""
    if rl.preset("overlong") and score.overlong_max_tokens is None:
        buffer = max(1, rollout.max_tokens // 4)
        return score.model_copy(update={"overlong_max_tokens": rollout.max_tokens, "overlong_buffer": buffer})
    return score


def informative_groups(store: ArtifactStore, scored: ArtifactRef) -> tuple[int, int]:
    """(groups whose rewards are not all equal, groups) of a scored-rollouts artifact."""
    from posttrain_core.data.io import read_dataset

    table = read_dataset(store.local_path(scored), "scored_rollouts").select(["prompt_id", "reward"])
    groups: dict[str, set[float]] = {}
    for pid, r in zip(table.column("prompt_id").to_pylist(), table.column("reward").to_pylist(), strict=True):
        groups.setdefault(pid, set()).add(round(r, 6))
    return sum(len(v) > 1 for v in groups.values()), len(groups)


def check_dynamic_sampling(counts: list[tuple[int, int]], want: int, max_gen_batches: int) -> bool:
    """Whether to stop sampling: True once the batches so far hold `want` informative groups, or after
    `max_gen_batches` batches with at least one (the update then trains on fewer groups, with a warning).

    Raises:
        DynamicSamplingError: `max_gen_batches` batches and not one group with non-uniform rewards.
    """
    have = sum(k for k, _ in counts)
    if have >= want:
        return True
    if len(counts) < max_gen_batches:
        return False
    seen = sum(n for _, n in counts)
    if have == 0:
        raise DynamicSamplingError(
            f"dynamic sampling: only 0 of the {want} wanted prompts have non-uniform rewards after "
            f"max_gen_batches={max_gen_batches} generation batches ({seen} prompts sampled; every group was "
            "all-correct or all-wrong, so every advantage is zero). Raise rl.max_gen_batches or rollout.n, use "
            "easier prompts or a stronger starting policy, or set rl.dynamic_sampling=false"
        )
    log.warning(
        "dynamic sampling: %d of the %d wanted prompts have non-uniform rewards after max_gen_batches=%d "
        "(%d prompts sampled); updating on those", have, want, max_gen_batches, seen,
    )  # fmt: skip
    return True


def critic_source(store: ArtifactStore, ref: ArtifactRef | None) -> str | None:
    """The critic folder inside an update or value-pretraining artifact (None if it has none)."""
    if ref is None:
        return None
    path = Path(store.local_path(ref)) / CRITIC_DIR
    return str(path) if path.exists() else None


# ------------------------------------------------------------------------------------------------- batch
def load_batch(
    store: ArtifactStore, scored: list[ArtifactRef], policy: ArtifactRef, cfg: RLConfig
) -> tuple[RLBatch, dict[str, float]]:
    """The rows to train on, as an RLBatch, and data metrics.

    Raises:
        ValueError: a row was sampled by another policy than `policy` (stale weights), or nothing is left to train on.
    """
    from posttrain_core.data.io import read_dataset

    tables = [read_dataset(store.local_path(s), "scored_rollouts") for s in scored]
    for ref, table in zip(scored, tables, strict=True):
        digests = table.column("policy_digest").to_pylist()
        bad = next((i for i, d in enumerate(digests) if d != policy.digest), None)
        if bad is not None:
            raise ValueError(
                f"{STAGE}: {ref.uri} row {bad} was sampled by policy {digests[bad][:12]}, not by the policy being "
                f"updated ({policy.digest[:12]}): the rollout engine generated with stale weights"
            )
    table = pa.concat_tables([t.select(_COLUMNS) for t in tables])
    want = len(set(tables[0].column("prompt_id").to_pylist()))
    rows = table.to_pylist()
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(f"{r['prompt_id']}", []).append(i)
    uniform = [g for g, idx in groups.items() if len({round(rows[i]["reward"], 6) for i in idx}) == 1]
    keep = list(groups)
    if cfg.dynamic_sampling:
        keep = [g for g in groups if g not in set(uniform)][:want]
        if not keep:
            raise ValueError(f"{STAGE}: dynamic sampling left no group with non-uniform rewards")
    picked = [i for g in keep for i in groups[g]]
    gid = {g: k for k, g in enumerate(keep)}
    batch = RLBatch(
        prompt_ids=[rows[i]["prompt_ids"] for i in picked],
        response_ids=[rows[i]["response_ids"] for i in picked],
        policy_mask=[rows[i]["response_mask"] or [1] * len(rows[i]["response_ids"]) for i in picked],
        rollout_logprobs=[rows[i]["logprobs"] for i in picked],
        scores=[float(rows[i]["reward"]) for i in picked],
        groups=[gid[rows[i]["prompt_id"]] for i in picked],
        correct=[bool(rows[i]["correct"]) for i in picked],
    )
    empty = [i for i, r in enumerate(batch.response_ids) if not r]
    if len(empty) == len(batch):
        raise ValueError(f"{STAGE}: every response is empty; nothing to train on")
    lengths = [len(r) for r in batch.response_ids]
    outcomes = [rows[i]["correct"] for i in picked if rows[i]["correct"] is not None]
    metrics = {
        "samples": float(len(batch)),
        "groups": float(len(keep)),
        "uniform_group_frac": len(uniform) / max(1, len(groups)),
        "reward_mean": sum(batch.scores) / len(batch),
        "reward_std": _std(batch.scores),
        "response_len_mean": sum(lengths) / len(lengths),
        "response_len_max": float(max(lengths)),
    }
    if outcomes:
        metrics["accuracy"] = sum(outcomes) / len(outcomes)
    return batch, metrics


_COLUMNS = ["prompt_id", "prompt_ids", "response_ids", "response_mask", "logprobs", "reward", "correct"]


def _std(xs: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


# ------------------------------------------------------------------------------------------- advantages
def compute_targets(
    cfg: RLConfig,
    batch: RLBatch,
    prepared: dict[str, list],
    kl_coef: float,
    epochs: int,
    reference_in_update: bool = False,
) -> tuple[Targets, dict[str, float]]:
    """Advantages and returns over the whole batch (`cfg` resolved), and the metrics they yield.

    Token rewards: the sequence score on the last policy token, minus kl_coef * KL_t on every token when the KL is
    placed in the reward. Sequence estimators (grpo, dr_grpo, rloo, reinforce_pp_baseline) use s_i = sum_t r_t.
    reference_in_update: there is a reference, and the update computes its log-probs itself (`_prepare_needed`), so
    its absence here is no error.
    """
    import torch

    from posttrain_core.algorithms import rl as A
    from posttrain_core.train.rl import pad

    width = max(1, max(len(r) for r in batch.response_ids))
    mask = pad([[float(x) for x in m] for m in batch.policy_mask], width)
    old = pad(prepared["old_logp"], width) if prepared["old_logp"] is not None else None  # None: see need_old
    ref = pad(prepared["ref_logp"], width) if prepared["ref_logp"] else None
    values = pad(prepared["values"], width) if prepared["values"] else None
    scores = torch.tensor(batch.scores, dtype=torch.float32)
    groups = torch.tensor(batch.groups, dtype=torch.long)
    rewards = A.token_level_scores(scores, mask)
    metrics: dict[str, float] = {}
    if ref is not None:
        if old is not None:  # else the update reports them
            metrics["kl_k1"] = float(A.masked_mean(A.kl_estimate(old, ref, "k1"), mask))
            metrics["kl_k3"] = float(A.masked_mean(A.kl_estimate(old, ref, "k3"), mask))
        if cfg.kl_placement == "reward" and kl_coef > 0:
            rewards = rewards - kl_coef * A.kl_estimate(old, ref, cfg.kl_estimator) * mask
    elif cfg.kl_placement != "none" and kl_coef > 0 and not reference_in_update:
        raise ValueError(f"{STAGE}: kl_placement='{cfg.kl_placement}' needs a reference model")
    seq = (rewards * mask).sum(-1)
    returns = None
    name = cfg.advantage
    if name in ("gae", "vapo"):
        assert values is not None, "a critic is required"
        lengths = mask.sum(-1)
        lam = A.vapo_lambda(lengths, cfg.vapo_alpha) if name == "vapo" else cfg.lam
        adv, _ = A.gae_advantages(rewards, values, mask, cfg.gamma, lam)
        _, returns = A.gae_advantages(rewards, values, mask, cfg.gamma, cfg.critic_lam, whiten_advantages=False)
    elif name == "reinforce_pp":
        adv, _ = A.reinforce_pp_advantages(rewards, mask, cfg.gamma)
    elif name == "reinforce_pp_baseline":
        adv = A.reinforce_pp_baseline_advantages(seq, groups, mask)
    else:
        adv = A.broadcast_advantages(A.ADVANTAGE_ESTIMATORS[name](seq, groups), mask)
    if values is None and cfg.uses_critic:
        raise ValueError(f"{STAGE}: algorithm '{cfg.algorithm}' needs a critic")
    if values is not None and returns is None:  # value pretraining: Monte-Carlo (lambda = 1) targets
        _, returns = A.gae_advantages(rewards, values, mask, cfg.gamma, 1.0, whiten_advantages=False)

    if old is not None:  # else the update reports these from its own forward pass
        gap = (pad(batch.rollout_logprobs, width) - old).abs() * mask
        metrics.update(
            logp_mismatch_mean=float(gap.sum() / mask.sum().clamp(min=1)), logp_mismatch_max=float(gap.max())
        )
    metrics.update(
        advantage_mean=float(A.masked_mean(adv, mask)),
        advantage_abs_mean=float(A.masked_mean(adv.abs(), mask)),
        zero_advantage_frac=float(((adv.abs() < 1e-8).float() * mask).sum() / mask.sum().clamp(min=1)),
        kl_coef=kl_coef,
    )
    if values is not None:
        metrics["value_mean"] = float(A.masked_mean(values, mask))
    next_kl = kl_coef
    if cfg.kl_target is not None and ref is not None:
        seq_kl = float((A.kl_estimate(old, ref, "k1") * mask).sum(-1).mean())
        next_kl = A.adaptive_kl_coef(kl_coef, seq_kl, cfg.kl_target, len(batch), cfg.kl_horizon)
    metrics["next_kl_coef"] = next_kl
    lengths = [len(r) for r in batch.response_ids]

    def rows(t):
        return [t[i, :n].tolist() for i, n in enumerate(lengths)]

    targets = Targets(
        advantages=rows(adv),
        old_logp=prepared["old_logp"],
        ref_logp=prepared["ref_logp"] or None,
        returns=rows(returns) if returns is not None else None,
        old_values=prepared["values"] or None,
        epochs=epochs,
        t_max=width,
        kl_coef=kl_coef if cfg.kl_placement == "loss" else 0.0,
        next_kl_coef=next_kl,
    )
    return targets, metrics


# -------------------------------------------------------------------------------------------- the stages
def _launch(
    job: RLJob,
    batch: RLBatch,
    cfg: RLConfig,
    kl_coef: float,
    epochs: int,
    prefetch: Callable[[Callable[[], Any]], bool] | None = None,
) -> tuple[dict, dict]:
    """load -> prepare (sharded) -> targets on the driver -> update -> save; returns (update metrics, target
    metrics). Between the update and the save, `prefetch` gets a function that returns the new policy's weights (a
    Ray object ref) if it uses them."""
    import ray

    from posttrain_core.cluster import split

    if len(batch) < cfg.num_workers * cfg.mini_batches:
        raise ValueError(
            f"{job.stage}: {len(batch)} samples cannot fill {cfg.mini_batches} mini-batches on {cfg.num_workers} "
            "workers (every worker needs a row per mini-batch): sample more prompts or lower rl.mini_batches"
        )
    t0 = time.time()
    group = acquire_workers(cfg.num_workers)
    done = False
    try:
        loads = group.run("load", job)
        t1 = time.time()
        batch_ref = ray.put(batch)
        need_old = _needs_old_pass(job, cfg, epochs)
        prepared: dict[str, Any] = {"old_logp": [], "ref_logp": [], "values": []}
        if _prepare_needed(job, need_old):
            shards = split(list(range(len(batch))), cfg.num_workers)
            parts = ray.get(
                [a.call.remote("prepare", batch_ref, s, need_old) for a, s in zip(group.actors, shards, strict=False)]
            )
            for part in parts:  # shards are contiguous and in rank order
                for k in prepared:
                    prepared[k] = None if part[k] is None or prepared[k] is None else prepared[k] + part[k]
            targets, target_metrics = compute_targets(cfg, batch, prepared, kl_coef, epochs)
        else:
            prepared["old_logp"] = None
            in_update = job.reference_path is not None
            targets, target_metrics = compute_targets(cfg, batch, prepared, kl_coef, epochs, in_update)
            targets = dataclasses.replace(targets, prepare_in_update=True)
        t2 = time.time()
        result = group.run("update", batch_ref, targets, prefetch is None)[0]
        if prefetch is not None:
            rank0 = group.actors[0]
            try:
                prefetched = prefetch(lambda: rank0.call.remote("policy_weights"))
            except Exception as err:  # noqa: BLE001 - the update does not depend on it: the next rollout generates
                log.warning("%s: could not start the next rollout early (%s: %s)", job.stage, type(err).__name__, err)
                prefetched = False
            result["model_info"] = ray.get(rank0.call.remote("save"))
            result["prefetched_next_rollout"] = float(prefetched)
        done = True
    finally:
        if done:
            release_workers(group, cfg.num_workers)
        else:
            group.shutdown()
    # start-up (actors, process group, model loading) vs the work: old/ref log-probs + advantages, then the update
    target_metrics.update(startup_s=t1 - t0, prepare_s=t2 - t1, train_s=time.time() - t2)
    target_metrics["continued_in_memory"] = float(all(x == "continued" for x in loads))
    target_metrics["reference_in_update"] = float(targets.prepare_in_update and job.reference_path is not None)
    return result, target_metrics


PREFETCH_ENV = "POSTTRAIN_PREFETCH_ROLLOUT"  # "0": the next rollout starts only after the update is published
OLD_PASS_ENV = "POSTTRAIN_RL_OLD_LOGP_PASS"  # "1": always compute old log-probs in a pass of their own
SHARE_PROMPTS_ENV = "POSTTRAIN_SHARE_PROMPTS"  # "0": every row runs its prompt in full (`RLJob.share_prompts`)
PREPARE_ENV = "POSTTRAIN_RL_PREPARE_PASS"  # "1": reference log-probs in `prepare` even when nothing else needs it


def _prepare_needed(job: RLJob, need_old: bool) -> bool:
    """Whether the driver needs `RLWorker.prepare`'s results before the update: old log-probs (`_needs_old_pass`)
    or critic values. When it does not, advantages come from the scores alone, and each update micro-step computes
    its own rows' reference log-probs (for the KL loss term) just before its forward pass: the same numbers (up to
    the float rounding of another padding), without a round trip through the driver between two passes of the
    workers. The driver then also skips the old-log-prob checks that `compute_targets` makes; the update reports them.
    """
    return need_old or job.critic_path is not None or os.environ.get(PREPARE_ENV) == "1"


def _needs_old_pass(job: RLJob, cfg: RLConfig, epochs: int) -> bool:
    """Whether `prepare` must compute the old log-probs in a forward pass of their own.

    Not when the update takes a single optimizer step on the batch (1 epoch x 1 mini-batch) and nothing before the
    update reads them (no KL in the reward, no adaptive KL): the update's first forward then runs with the very
    weights that sampled the batch, so old = its log-probs, detached (TRL does the same when num_iterations=1).
    """
    if os.environ.get(OLD_PASS_ENV) == "1" or not job.train_policy:
        return True
    return not (epochs * cfg.mini_batches == 1 and cfg.kl_placement != "reward" and cfg.kl_target is None)


# ------------------------------------------------------------------------------------- warm update workers
WARM_ENV = "POSTTRAIN_WARM_RL_WORKERS"  # "0": a fresh worker group for every update
WARM_IDLE_S = 300.0  # an idle warm group is shut down after this long
_warm_lock = threading.Lock()
_warm: dict[int, tuple[Any, str, int]] = {}  # num_workers -> (idle group, its Ray cluster, release number)
_releases = itertools.count()


def _cluster_id() -> str:
    import ray

    ctx = ray.get_runtime_context()
    return f"{ctx.gcs_address}/{ctx.get_job_id()}"


def acquire_workers(num_workers: int):
    """A worker group of `num_workers` RLWorkers: the idle one a previous update of this process left, else new.

    Starting a group (Ray actors, imports, the gloo process group) costs seconds on every RL iteration; a warm group
    only loads the new policy. Every update still loads everything it uses from the artifacts (`RLWorker.load`), so
    a warm group computes exactly what a fresh one does. A warm group is taken out of the pool while in use (two
    concurrent updates never share one) and health-checked first; a dead or stale one is replaced. Warm groups
    reserve no Ray CPUs (like the warm rollout engines): idle, they must not block the other stages' tasks.
    """
    from posttrain_core.cluster import WorkerGroup, connect

    connect()
    if os.environ.get(WARM_ENV, "1") == "0":
        return WorkerGroup.start(RLWorker, num_workers)
    with _warm_lock:
        entry = _warm.pop(num_workers, None)
    if entry is not None:
        group, cluster, _ = entry
        try:
            import ray

            if cluster == _cluster_id() and group.actors:
                ray.get([a.rendezvous.remote() for a in group.actors], timeout=30)
                return group
        except Exception as err:  # a worker died while idle: start a fresh group
            log.info("%s: warm update workers unusable (%s); starting new ones", STAGE, type(err).__name__)
        group.shutdown()
    return WorkerGroup.start(RLWorker, num_workers, num_cpus=0)


def release_workers(group, num_workers: int) -> None:
    """Put `group` back in the pool for the next update (shut down after WARM_IDLE_S idle). Its models stay in
    memory: an update that continues from the artifact this one built uses them (`RLWorker.load`)."""
    if os.environ.get(WARM_ENV, "1") == "0":
        group.shutdown()
        return
    try:
        group.run("keep")
        cluster = _cluster_id()
    except Exception:  # noqa: BLE001 - nothing to keep
        group.shutdown()
        return
    with _warm_lock:
        old = _warm.pop(num_workers, None)
        release = next(_releases)
        _warm[num_workers] = (group, cluster, release)
    if old is not None:
        old[0].shutdown()
    timer = threading.Timer(WARM_IDLE_S, _expire, (num_workers, release))
    timer.daemon = True
    timer.start()


def _expire(num_workers: int, release: int) -> None:
    """Shut the group down if it has sat idle since `release` (not if it was used and released again since: the
    timer of an earlier release would otherwise end a group a few seconds after its latest update)."""
    with _warm_lock:
        entry = _warm.get(num_workers)
        if entry is None or entry[2] != release:
            return  # in use, replaced, or released again later
        del _warm[num_workers]
    entry[0].shutdown()


def check_rl_inputs(cfg: RLConfig, scored: list[ArtifactRef], policy: ArtifactRef, store: ArtifactStore) -> None:
    from posttrain_core.models.loading import check_model_path

    if not scored:
        raise ValueError(f"{STAGE}: no scored rollouts given")
    for ref in scored:
        if ref.kind != "dataset" or ref.schema_kind != "scored_rollouts":
            raise ValueError(f"{STAGE}: inputs must be 'scored_rollouts' datasets, got {ref.schema_kind} at {ref.uri}")
    if policy.kind != "model":
        raise ValueError(f"{STAGE}: policy must be a model, got a {policy.kind} at {policy.uri}")
    check_model_path(store.local_path(policy))


def run_rl_update(
    cfg: RLConfig,
    scored: list[ArtifactRef],
    policy: ArtifactRef,
    reference: ArtifactRef,
    store: ArtifactStore,
    critic: ArtifactRef | None = None,
    next_rollout: NextRollout | None = None,
) -> ArtifactRef:
    """One RL update of `policy` on `scored` (one artifact, or several generation batches with dynamic sampling).

    Args:
        cfg: the update (empty fields take the algorithm's preset).
        scored: scored rollouts sampled by `policy` (checked row by row through `policy_digest`).
        policy: the current policy; if it is a previous update's artifact its optimizer state is continued.
        reference: the frozen reference policy (with LoRA: the adapter's base, run with the adapter disabled).
        store: the artifact store.
        critic: an artifact holding `critic/` (the previous update, or value pretraining); PPO/VAPO start a fresh
            critic from the policy when None.
        next_rollout: the rollout stage that will sample from the new policy on a warm hf engine pool: its engines
            get the new weights in memory and start generating while this stage saves, flushes and digests its
            checkpoint (`rollout.stage.prefetch_rollout`); that stage takes the rows once this artifact is
            published. The artifact is the same with or without it.

    Returns:
        A model artifact: the new policy (full or adapter folder), `critic/` when the algorithm has one and
        `trainer_state.pt`; its manifest holds every metric of ALGORITHMS.md's list.
    """
    check_rl_inputs(cfg, scored, policy, store)
    rcfg = cfg.resolved()
    inputs = update_inputs(scored, policy, reference, critic)

    def build(ctx: StageContext) -> StageOutput:
        batch, data_metrics = load_batch(store, scored, policy, rcfg)
        policy_path = str(store.local_path(policy))
        state = Path(policy_path) / STATE_FILE
        prev = store.manifest(policy) if not policy.external else {}
        kl_coef = float(prev.get("next_kl_coef", rcfg.kl_coef))
        critic_path = (critic_source(store, critic) or policy_path) if rcfg.uses_critic else None
        job = RLJob(
            cfg=rcfg,
            policy_path=policy_path,
            reference_path=str(store.local_path(reference)),
            critic_path=critic_path,
            state_path=str(state) if state.exists() else None,
            outdir=str(ctx.outdir),
            policy_key=policy.key,
            critic_key=critic.key if critic is not None else None,
            output_key=ctx.key,
            share_prompts=os.environ.get(SHARE_PROMPTS_ENV, "1") != "0",
        )
        log.info(
            "%s: %s on %d samples (%d groups), %d workers, %d epochs x %d mini-batches",
            STAGE, rcfg.algorithm, len(batch), int(data_metrics["groups"]), rcfg.num_workers, rcfg.ppo_epochs,
            rcfg.mini_batches,
        )  # fmt: skip
        prefetch = None
        if next_rollout is not None and rcfg.lora is None and os.environ.get(PREFETCH_ENV, "1") != "0":
            from posttrain_core.rollout.stage import prefetch_rollout

            def prefetch(weights) -> bool:
                return prefetch_rollout(
                    next_rollout.rollout, next_rollout.prompts, policy, ctx.key, weights, store, next_rollout.engines
                )

        result, target_metrics = _launch(job, batch, rcfg, kl_coef, rcfg.ppo_epochs, prefetch)
        info = result.pop("model_info")
        metrics = {**data_metrics, **target_metrics, **{k: float(v) for k, v in result.items() if k != "rank"}}
        log.info("%s: %s", STAGE, " ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
        manifest = {
            "objective": "rl",
            "algorithm": rcfg.algorithm,
            "resolved_config": rcfg.model_dump(mode="json"),
            "base_model": info.get("base_model") or policy.uri,
            "architecture": info.get("architecture"),
            "dtype": info.get("dtype"),
            "adapter": info.get("adapter", False),
            "critic": CRITIC_DIR if rcfg.uses_critic else None,
            "next_kl_coef": target_metrics["next_kl_coef"],
        }
        return StageOutput(manifest=manifest, metrics=metrics)

    return run_stage(STAGE, cfg, inputs, store, "model", build)


def run_value_pretrain(cfg: RLConfig, scored: ArtifactRef, policy: ArtifactRef, store: ArtifactStore) -> ArtifactRef:
    """VAPO value pretraining: `value_pretrain_steps` passes of the critic alone over samples of the fixed initial
    policy, towards Monte-Carlo (lambda = 1) returns. Publishes an artifact holding only `critic/`."""
    check_rl_inputs(cfg, [scored], policy, store)
    rcfg = cfg.resolved()
    if not rcfg.value_pretrain_steps:
        raise ValueError(f"{VALUE_STAGE}: value_pretrain_steps is 0 for algorithm '{rcfg.algorithm}'")

    def build(ctx: StageContext) -> StageOutput:
        batch, data_metrics = load_batch(store, [scored], policy, rcfg.model_copy(update={"dynamic_sampling": False}))
        policy_path = str(store.local_path(policy))
        job = RLJob(
            cfg=rcfg,
            policy_path=policy_path,
            reference_path=None,
            critic_path=policy_path,
            state_path=None,
            outdir=str(ctx.outdir),
            train_policy=False,
            stage=VALUE_STAGE,
        )
        result, target_metrics = _launch(job, batch, rcfg, 0.0, rcfg.value_pretrain_steps)
        result.pop("model_info", None)
        metrics = {**data_metrics, **{k: float(v) for k, v in result.items() if k in _VALUE_KEYS}}
        metrics["value_mean_before"] = target_metrics.get("value_mean", 0.0)
        return StageOutput(manifest={"objective": "value_pretrain", "critic": CRITIC_DIR}, metrics=metrics)

    return run_stage(VALUE_STAGE, cfg, {"scored": scored, "policy": policy}, store, "model", build)


_VALUE_KEYS = ("value_loss", "vf_clip_frac", "critic_grad_norm", "update_s")


def update_inputs(scored: list[ArtifactRef], policy, reference, critic) -> dict[str, Any]:
    """The update stage's named inputs (its key; the Prefect task's cache key uses the same)."""
    inputs = {f"scored_{i}": s for i, s in enumerate(scored)} | {"policy": policy, "reference": reference}
    return inputs | ({"critic": critic} if critic is not None else {})
