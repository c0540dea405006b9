"""The RL update stage (driver side): scored rollouts + policy -> new policy (and critic), on a group of Ray ranks.

`run_rl_update` reads the scored rollouts, checks they were sampled by the policy it is given (never train on stale
samples), lets the ranks recompute old/reference log-probs and values where the advantages need them
(`RLWorker.prepare`), computes advantages over the whole batch here (group statistics, whitening, KL in the reward),
then runs the update on the ranks and publishes the new policy with `critic/` and `trainer_state.pt` inside.
`run_value_pretrain` is VAPO's critic-only variant.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from posttrain_core.artifacts import ArtifactRef, ArtifactStore
from posttrain_core.artifacts.node import NodePath, node_path, outbox_of
from posttrain_core.cluster import WorkerGroup, split
from posttrain_core.config import RLConfig, RolloutConfig
from posttrain_core.stage import StageContext, StageOutput, run_stage
from posttrain_core.train.rl_batch import Prepared, RLBatch, RLJob, load_batch
from posttrain_core.train.rl_state import CRITIC_DIR, STATE_FILE
from posttrain_core.train.rl_targets import compute_targets, needs_old_logprobs
from posttrain_core.train.rl_worker import RLWorker
from posttrain_core.warm import RANKS, WarmGroup

log = logging.getLogger(__name__)

STAGE, VALUE_STAGE = "rl_update", "value_pretrain"


class NextRollout(BaseModel):
    """The rollout stage that follows an update on the flow run's warm engines: they get the new policy's weights in
    memory and generate while the update publishes (`rollout.stage.prefetch_rollout`). Not part of the update's key:
    it changes when the next samples are generated, not the update's artifact or the samples."""

    rollout: RolloutConfig
    prompts: ArtifactRef


# -------------------------------------------------------------------------------------------------- the ranks
@contextlib.contextmanager
def ranks_of(
    warm: WarmGroup | None, num_workers: int, role: str = RANKS, cls: type = RLWorker
) -> Iterator[WorkerGroup]:
    """A stage's ranks of `role`, each hosting a `cls` (`WarmGroup.ranks`); after a success each keeps its models for
    an update that continues from the artifact it built."""
    with WarmGroup.use(warm).ranks(cls, num_workers, role) as ranks:
        yield ranks
        ranks.run("keep")


def _launch(
    job: RLJob,
    batch: RLBatch,
    cfg: RLConfig,
    kl_coef: float,
    epochs: int,
    warm: WarmGroup | None,
    prefetch: Callable[[Callable[[], Any]], bool] | None = None,
) -> tuple[dict, dict]:
    """load -> prepare (sharded, if needed) -> targets on the driver -> update -> save; returns (update metrics,
    driver metrics). Between the update and the save, `prefetch` gets a function that returns the new policy's
    weights (a Ray object ref) if it uses them."""
    import ray

    if len(batch) < cfg.num_workers * cfg.mini_batches:
        raise ValueError(
            f"{job.stage}: {len(batch)} samples cannot fill {cfg.mini_batches} mini-batches on {cfg.num_workers} "
            "workers (every worker needs a row per mini-batch): sample more prompts or lower rl.mini_batches"
        )
    t0 = time.time()
    with ranks_of(warm, cfg.num_workers) as ranks:
        loads = ranks.run("load", job)
        t1 = time.time()
        batch_ref = ray.put(batch)
        need_old = needs_old_logprobs(cfg, epochs, job.train_policy, any(x["dropout"] for x in loads))
        prepared = Prepared()
        ref_in_update = False
        if need_old or job.critic_path is not None:
            shards = split(list(range(len(batch))), cfg.num_workers)
            # shards are contiguous and in rank order
            prepared = Prepared.concat(ranks.run_each("prepare", [(batch_ref, s, need_old) for s in shards]))
        else:
            ref_in_update = job.reference_path is not None
        targets, metrics = compute_targets(cfg, batch, prepared, kl_coef, epochs, ref_in_update)
        if prepared.checks is not None:
            metrics |= prepared.checks.metrics()
        t2 = time.time()
        result = ranks.run("update", batch_ref, targets, prefetch is None)[0]
        if prefetch is not None:
            rank0 = ranks.actors[0]
            try:
                prefetched = prefetch(lambda: rank0.call.remote("policy_weights"))
            except Exception as err:  # noqa: BLE001 - the update does not depend on it: the next rollout generates
                log.warning("%s: could not start the next rollout early (%s: %s)", job.stage, type(err).__name__, err)
                prefetched = False
            result["model_info"] = ranks.run_each("save", [()])[0]
            result["prefetched_next_rollout"] = float(prefetched)
    # start-up (actors, process group, model loading) vs the work: old/ref log-probs + advantages, then the update
    metrics.update(startup_s=t1 - t0, prepare_s=t2 - t1, train_s=time.time() - t2)
    metrics["continued_in_memory"] = float(all(x["state"] == "continued" for x in loads))
    metrics["reference_in_update"] = float(ref_in_update)
    return result, metrics


# ------------------------------------------------------------------------------------------------- the stages
def check_rl_inputs(
    cfg: RLConfig,
    scored: list[ArtifactRef],
    policy: ArtifactRef,
    store: ArtifactStore,
    teacher: list[ArtifactRef] | None = None,
    process: ArtifactRef | None = None,
) -> None:
    from posttrain_core.algorithms.advantages import ADVANTAGES
    from posttrain_core.algorithms.losses import POLICY_LOSSES
    from posttrain_core.models.loading import check_model_path

    rcfg = cfg.resolved()
    for field, registry in (("advantage", ADVANTAGES), ("policy_loss", POLICY_LOSSES)):
        try:
            registry[getattr(rcfg, field)]
        except ValueError as err:
            raise ValueError(f"RLConfig.{field}: {err}") from None

    if not scored:
        raise ValueError(f"{STAGE}: no scored rollouts given")
    for ref in scored:
        if ref.kind != "dataset" or ref.schema_kind != "scored_rollouts":
            raise ValueError(f"{STAGE}: inputs must be 'scored_rollouts' datasets, got {ref.schema_kind} at {ref.uri}")
    if policy.kind != "model":
        raise ValueError(f"{STAGE}: policy must be a model, got a {policy.kind} at {policy.uri}")
    check_model_path(store.metadata_path(policy))  # checks only: the ranks fetch the weights they need
    if rcfg.distill is not None:
        try:
            ADVANTAGES[rcfg.distill.task_advantage]
            if rcfg.distill_loss_coef > 0:
                from posttrain_core.algorithms.distill import DIVERGENCES

                DIVERGENCES[rcfg.distill.divergence]
        except ValueError as err:
            raise ValueError(f"RLConfig.distill: {err}") from None
    needs_teacher = rcfg.advantage == "opd" or rcfg.distill_loss_coef > 0
    if needs_teacher and len(teacher or []) != len(scored):
        raise ValueError(
            f"{STAGE}: algorithm '{rcfg.algorithm}' learns from the teacher: give one 'teacher_logprobs' dataset per "
            f"scored rollouts ({len(scored)}), got {len(teacher or [])}"
        )
    for ref in teacher or []:
        if ref.kind != "dataset" or ref.schema_kind != "teacher_logprobs":
            raise ValueError(f"{STAGE}: teacher inputs must be 'teacher_logprobs' datasets, got {ref.schema_kind} at "
                             f"{ref.uri}")  # fmt: skip
    if rcfg.advantage == "prime" and process is None:
        raise ValueError(f"{STAGE}: algorithm '{rcfg.algorithm}' takes PRIME's process rewards: give the "
                         "'process_rewards' dataset of these rollouts (the rlhf flow's process_rewards stage)")  # fmt: skip
    if process is not None and (process.kind != "dataset" or process.schema_kind != "process_rewards"):
        raise ValueError(f"{STAGE}: process must be a 'process_rewards' dataset, got {process.schema_kind} at "
                         f"{process.uri}")  # fmt: skip


def policy_version(store: ArtifactStore, policy: ArtifactRef) -> int:
    """How many RL updates led to `policy` (0: a policy no update made, e.g. the SFT model)."""
    if policy.external:
        return 0
    manifest = store.manifest(policy)
    return int(manifest.get("version", 0)) if manifest.get("stage") == STAGE else 0


def check_staleness(cfg: RLConfig, store: ArtifactStore, policy: ArtifactRef, sampler: ArtifactRef) -> int:
    """Versions between the policy being updated and the one that sampled its rows; refused above
    rl.max_staleness (default rl.rollout_lag), naming both. Rows are never dropped silently."""
    current, behind = policy_version(store, policy), policy_version(store, sampler)
    staleness = current - behind
    bound = cfg.rollout_lag if cfg.max_staleness is None else cfg.max_staleness
    if staleness > bound:
        raise ValueError(
            f"{STAGE}: the rows were sampled by policy version {behind} ({sampler.key[:12]}), {staleness} update(s) "
            f"behind the policy being updated (version {current}, {policy.key[:12]}); rl.max_staleness={bound} "
            "refuses them"
        )
    return staleness


def critic_source(store: ArtifactStore, ref: ArtifactRef | None) -> NodePath | None:
    """The critic folder inside an update or value-pretraining artifact (None if it has none)."""
    if ref is None:
        return None
    path = Path(store.metadata_path(ref)) / CRITIC_DIR
    return node_path(store, ref, CRITIC_DIR) if path.exists() else None


def run_rl_update(
    cfg: RLConfig,
    scored: list[ArtifactRef],
    policy: ArtifactRef,
    reference: ArtifactRef,
    store: ArtifactStore,
    critic: ArtifactRef | None = None,
    warm: WarmGroup | None = None,
    next_rollout: NextRollout | None = None,
    teacher: list[ArtifactRef] | None = None,
    sampler: ArtifactRef | None = None,
    process: ArtifactRef | None = None,
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
        warm: the warm group (`warm.WarmGroup`) whose ranks train, outlive this stage, and continue from the models
            they hold when this update starts from the artifact they built; None: the process's.
        next_rollout: the rollout stage that will sample from the new policy on the warm group's hf engines: they
            get the new weights in memory and generate while this stage saves, flushes and digests its checkpoint.
            The artifact is the same with or without it.
        teacher: the teacher's log-probs of the same rollouts (`rollout.teacher`), one per scored artifact, for
            on-policy distillation and GKD (`cfg.distill`).
        sampler: the model that sampled `scored` when it is not `policy` (the teacher, under distill.seq_kd/lmbda).
        process: PRIME's process rewards of the same rollouts (a `process_rewards` dataset, `train.prm`).

    Returns:
        A model artifact: the new policy (full or adapter folder), `critic/` when the algorithm has one and
        `trainer_state.pt`; its manifest holds the metrics docs/algorithms.md lists.
    """
    check_rl_inputs(cfg, scored, policy, store, teacher, process)
    rcfg = cfg.resolved()
    inputs = update_inputs(scored, policy, reference, critic, teacher, sampler, process)
    version, staleness = policy_version(store, policy) + 1, 0
    if rcfg.distill is None and sampler is not None:
        staleness = check_staleness(rcfg, store, policy, sampler)

    def build(ctx: StageContext) -> StageOutput:
        batch, data_metrics = load_batch(store, scored, policy, rcfg, STAGE, teacher, sampler, process)
        policy_path = node_path(store, policy)
        state = Path(store.metadata_path(policy)) / STATE_FILE
        prev = store.manifest(policy) if not policy.external else {}
        kl_coef = float(prev.get("next_kl_coef", rcfg.kl_coef))
        critic_path = (critic_source(store, critic) or policy_path) if rcfg.uses_critic else None
        job = RLJob(
            cfg=rcfg,
            policy_path=policy_path,
            reference_path=node_path(store, reference),
            critic_path=critic_path,
            state_path=node_path(store, policy, STATE_FILE) if state.exists() else None,
            outdir=str(ctx.outdir),
            policy_key=policy.key,
            critic_key=critic.key if critic is not None else None,
            output_key=ctx.key,
            outbox=outbox_of(store, ctx.key),
        )
        log.info(
            "%s: %s on %d samples (%d groups), %d workers, %d epochs x %d mini-batches",
            STAGE, rcfg.algorithm, len(batch), int(data_metrics["groups"]), rcfg.num_workers, rcfg.ppo_epochs,
            rcfg.mini_batches,
        )  # fmt: skip
        prefetch = None
        if warm is not None and next_rollout is not None and rcfg.lora is None:
            from posttrain_core.rollout.stage import prefetch_rollout

            def prefetch(weights) -> bool:
                return prefetch_rollout(
                    warm, next_rollout.rollout, next_rollout.prompts, policy, ctx.key, weights, store
                )

        result, driver_metrics = _launch(job, batch, rcfg, kl_coef, rcfg.ppo_epochs, warm, prefetch)
        info = result.pop("model_info")
        uploaded = info.pop("uploaded", None)
        metrics = {**data_metrics, **driver_metrics, **{k: float(v) for k, v in result.items()}}
        if rcfg.rollout_lag:
            metrics |= {"staleness_mean": float(staleness), "staleness_max": float(staleness)}
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
            "next_kl_coef": driver_metrics["next_kl_coef"],
            "version": version,  # updates since the start policy (version 0); staleness is counted in these
        }
        return StageOutput(manifest=manifest, metrics=metrics, uploaded=uploaded)

    return run_stage(STAGE, cfg, inputs, store, "model", build)


def run_value_pretrain(
    cfg: RLConfig, scored: ArtifactRef, policy: ArtifactRef, store: ArtifactStore, warm: WarmGroup | None = None
) -> ArtifactRef:
    """VAPO value pretraining: `value_pretrain_steps` passes of the critic alone over samples of the fixed initial
    policy (each pass `mini_batches` optimizer steps), towards the GAE(gamma, critic_lam) returns of the estimator
    (Monte-Carlo with VAPO's preset critic_lam = 1). Publishes an artifact holding only `critic/`."""
    check_rl_inputs(cfg, [scored], policy, store)
    rcfg = cfg.resolved()
    if not rcfg.value_pretrain_steps:
        raise ValueError(f"{VALUE_STAGE}: value_pretrain_steps is 0 for algorithm '{rcfg.algorithm}'")

    def build(ctx: StageContext) -> StageOutput:
        no_filter = rcfg.model_copy(update={"dynamic_sampling": False})
        batch, data_metrics = load_batch(store, [scored], policy, no_filter, VALUE_STAGE)
        policy_path = node_path(store, policy)
        job = RLJob(
            cfg=rcfg,
            policy_path=policy_path,
            reference_path=None,
            critic_path=policy_path,
            state_path=None,
            outdir=str(ctx.outdir),
            train_policy=False,
            stage=VALUE_STAGE,
            outbox=outbox_of(store, ctx.key),
        )
        result, driver_metrics = _launch(job, batch, rcfg, 0.0, rcfg.value_pretrain_steps, warm)
        uploaded = result["model_info"].pop("uploaded", None)
        metrics = {**data_metrics, **{k: float(v) for k, v in result.items() if k in _VALUE_KEYS}}
        metrics["value_mean_before"] = driver_metrics.get("value_mean", 0.0)
        manifest = {"objective": "value_pretrain", "critic": CRITIC_DIR}
        return StageOutput(manifest=manifest, metrics=metrics, uploaded=uploaded)

    return run_stage(VALUE_STAGE, cfg, {"scored": scored, "policy": policy}, store, "model", build)


_VALUE_KEYS = ("value_loss", "vf_clip_frac", "critic_grad_norm", "update_s")


def update_inputs(
    scored: list[ArtifactRef], policy, reference, critic, teacher=None, sampler=None, process=None
) -> dict[str, Any]:
    """The update stage's named inputs (its key; the Prefect task's cache key uses the same)."""
    inputs = {f"scored_{i}": s for i, s in enumerate(scored)} | {"policy": policy, "reference": reference}
    inputs |= {f"teacher_{i}": t for i, t in enumerate(teacher or [])}
    inputs |= {"sampler": sampler} if sampler is not None else {}
    inputs |= {"process": process} if process is not None else {}
    return inputs | ({"critic": critic} if critic is not None else {})
