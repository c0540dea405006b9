"""PRIME's implicit process reward model as two stages of the RL loop (docs/algorithms.md, PRIME).

`prm_update`: scored rollouts + PRM(k-1) -> PRM(k), one optimizer step of `prime.prm_loss` (the sequence score
beta sum_t q_t as the logit of the verifier's outcome) on the rows the update trains on. `process_rewards`: scored
rollouts + a PRM -> the same rows plus `process_rewards` (r_t = beta q_t per response token), which the `prime`
advantage reads. Two stages, not one, because a stage publishes one artifact: the PRM is a model artifact (lineage,
loadable for evaluation like any policy), the rewards a dataset; `prime.update` decides which PRM scores the batch.

The PRM is a causal LM started from the start policy and scored against the frozen start model (or, under LoRA, the
base with the adapter disabled): the ranks are `RLWorker`s loading the PRM as their "policy" with the start model as
their reference, so loading, LoRA, data parallelism, the warm reuse of a PRM a rank just built, and the checkpoint
format are the policy update's. The PRM's optimizer state continues from one iteration to the next.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from posttrain_core.artifacts import ArtifactRef, ArtifactStore
from posttrain_core.artifacts.node import node_path, outbox_of
from posttrain_core.cluster import split
from posttrain_core.config import LoraConfig, PrimeConfig, RLConfig
from posttrain_core.stage import StageContext, StageOutput, run_stage
from posttrain_core.train.rl_batch import RLBatch, RLJob, chunks, encode, load_batch
from posttrain_core.train.rl_state import STATE_FILE
from posttrain_core.train.rl_worker import RLWorker
from posttrain_core.warm import WarmGroup

log = logging.getLogger(__name__)

STAGE, SCORE_STAGE, ROLE = "prm_update", "process_rewards", "prm"


class PRMSettings(BaseModel):
    """What the PRM stages read of the RL config (their key): another policy setting reuses their artifacts."""

    prime: PrimeConfig
    accuracy_band: tuple[float, float] | None
    oversample_factor: int
    seed: int
    lora: LoraConfig | None
    num_workers: int
    micro_batch_size: int
    dtype: Literal["float32", "bfloat16"]
    gradient_checkpointing: bool
    train_vision: bool

    @classmethod
    def of(cls, rl: RLConfig) -> PRMSettings:
        r = rl.resolved()
        if r.prime is None:
            raise ValueError("the PRM stages need rl.prime (algorithm='prime')")
        return cls(**{name: getattr(r, name) for name in cls.model_fields})

    def rl_config(self, rl: RLConfig) -> RLConfig:
        """The RL config the PRM ranks run with: the PRM's optimizer (lr, clipping, no decay or warm-up)."""
        return rl.resolved().model_copy(
            update=dict(lr=self.prime.lr, max_grad_norm=self.prime.grad_clip, weight_decay=0.0, warmup_steps=0)
        )


class PRMWorker:
    """One data-parallel rank of the PRM (`cluster.RankActor`): an `RLWorker` holding the PRM as its policy."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world = rank, world_size
        self.lm = RLWorker(rank, world_size)

    def load(self, job: RLJob) -> dict[str, Any]:
        return self.lm.load(job)

    def keep(self) -> None:
        self.lm.keep()

    def _logp(self, batch: RLBatch, rows: list[int], grad: bool):
        """(PRM log-probs, reference log-probs, mask) of `rows`, B x R; the PRM's keep their graph when `grad`."""
        import torch

        from posttrain_core.train.rl_batch import response_logprobs

        lm = self.lm
        ids, attn, pos, labels, mask = encode(batch, rows, lm.pad_id)
        shared, images = lm.shared(batch, rows) if grad else None, lm.images(batch, rows, ids, attn)
        with lm.autocast():
            ref = lm.reference_logp(ids, attn, pos, labels, shared, images)
            with contextlib.nullcontext() if grad else torch.no_grad():
                model = lm.ddp_policy if grad else lm.policy.eval()
                logp = response_logprobs(model, ids, attn, pos, labels, shared, vision=images).logp
        return logp.float(), ref.float(), mask

    def update(self, batch: RLBatch, beta: float) -> dict[str, Any]:
        """One optimizer step of the CE loss over the whole batch (this rank: a contiguous share of the rows);
        returns this rank's rows' sequence scores before and after it, the loss and the gradient norm."""
        import torch

        from posttrain_core.algorithms.prime import implicit_rewards, prm_loss
        from posttrain_core.train.loop import optimizer_step

        lm, n = self.lm, len(batch)
        mine = split(list(range(n)), self.world)[self.rank]
        micro = chunks(mine, lm.cfg.micro_batch_size)
        before, loss_sum = [], 0.0
        lm.policy.train()
        for j, rows in enumerate(micro):
            sync = self.world == 1 or j == len(micro) - 1
            with contextlib.nullcontext() if sync else lm.ddp_policy.no_sync():
                logp, ref, mask = self._logp(batch, rows, grad=True)
                correct = torch.tensor([float(batch.correct[i]) for i in rows])
                loss = prm_loss(logp, ref, mask, correct, beta, float(n))
                (loss * float(self.world)).backward()  # DDP averages over ranks; the loss is a global mean
            before += implicit_rewards(logp.detach(), ref, mask, beta).sum(-1).tolist()
            loss_sum += float(loss.detach())
        grad_norm, _ = optimizer_step(lm.params, lm.opt, lm.sched, lm.cfg.max_grad_norm)
        lm.step += 1
        after = [sum(r) for r in self.score(batch, mine, beta)]
        lm.policy.train()
        return {"rows": mine, "before": before, "after": after, "loss": loss_sum, "grad_norm": grad_norm}

    def score(self, batch: RLBatch, rows: list[int], beta: float) -> list[list[float]]:
        """r_t = beta (log pi_prm - log pi_ref) of each of `rows` (0.0 on tool tokens), without gradients."""
        from posttrain_core.algorithms.prime import implicit_rewards

        out = []
        for chunk in chunks(rows, 2 * self.lm.cfg.micro_batch_size):
            r = implicit_rewards(*self._logp(batch, chunk, grad=False), beta)
            out += [r[b, : len(batch.response_ids[i])].tolist() for b, i in enumerate(chunk)]
        return out

    def save(self) -> dict:
        self.lm._next_kl_coef = 0.0
        return self.lm.save()


def prm_inputs(scored: list[ArtifactRef], policy: ArtifactRef, prm: ArtifactRef, reference: ArtifactRef) -> dict:
    """The PRM stages' named inputs (their key; the Prefect tasks' cache keys use the same)."""
    return {f"scored_{i}": s for i, s in enumerate(scored)} | {"policy": policy, "prm": prm, "reference": reference}


def _job(rl: RLConfig, store: ArtifactStore, prm: ArtifactRef, reference: ArtifactRef, ctx: StageContext | None,
         train: bool) -> RLJob:  # fmt: skip
    state = Path(store.metadata_path(prm)) / STATE_FILE
    return RLJob(
        cfg=PRMSettings.of(rl).rl_config(rl),
        policy_path=node_path(store, prm),
        reference_path=node_path(store, reference),
        critic_path=None,
        state_path=node_path(store, prm, STATE_FILE) if train and state.exists() else None,
        outdir=str(ctx.outdir) if ctx is not None else "",
        train_policy=train,
        stage=STAGE if train else SCORE_STAGE,
        policy_key=prm.key,
        output_key=ctx.key if ctx is not None else None,
        outbox=outbox_of(store, ctx.key) if ctx is not None else None,
    )


def _batch(rl: RLConfig, scored: list[ArtifactRef], policy: ArtifactRef, store: ArtifactStore, stage: str):
    batch, metrics = load_batch(store, scored, policy, rl.resolved(), stage)
    n = PRMSettings.of(rl).num_workers
    if len(batch) < n:
        raise ValueError(f"{stage}: {len(batch)} samples cannot be shared by rl.num_workers={n} workers")
    return batch, metrics


def run_prm_update(rl: RLConfig, scored: list[ArtifactRef], policy: ArtifactRef, prm: ArtifactRef,
                   reference: ArtifactRef, store: ArtifactStore, warm: WarmGroup | None = None) -> ArtifactRef:  # fmt: skip
    """PRM(k) from PRM(k-1) = `prm` on the rows of `scored` (sampled by `policy`) the policy update trains on.

    Returns a model artifact (the PRM, full or adapter, with `trainer_state.pt`); its metrics: prm_ce_loss,
    prm_grad_norm, and prm_acc_before / prm_acc_after (`prime.ranking_accuracy` of the sequence scores before and
    after the step; absent when no prompt has both right and wrong samples).
    """
    import ray

    from posttrain_core.algorithms.prime import ranking_accuracy
    from posttrain_core.train.rl_stage import ranks_of

    settings = PRMSettings.of(rl)

    def build(ctx: StageContext) -> StageOutput:
        batch, data_metrics = _batch(rl, scored, policy, store, STAGE)
        job = _job(rl, store, prm, reference, ctx, train=True)
        log.info("%s: %d samples, %d workers, beta %g, lr %g", STAGE, len(batch), settings.num_workers,
                 settings.prime.beta, settings.prime.lr)  # fmt: skip
        with ranks_of(warm, settings.num_workers, ROLE, PRMWorker) as ranks:
            ranks.run("load", job)
            parts = ranks.run("update", ray.put(batch), settings.prime.beta)
            info = ranks.run_each("save", [()])[0]
        metrics = {**data_metrics, "prm_ce_loss": sum(p["loss"] for p in parts), "prm_grad_norm": parts[0]["grad_norm"]}
        metrics |= _accuracies(batch, parts, ranking_accuracy)
        log.info("%s: %s", STAGE, " ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
        manifest = {
            "objective": "implicit_prm",
            "base_model": info.get("base_model") or prm.uri,
            "architecture": info.get("architecture"),
            "dtype": info.get("dtype"),
            "adapter": info.get("adapter", False),
            "prime": settings.prime.model_dump(mode="json"),
        }
        return StageOutput(manifest=manifest, metrics=metrics, uploaded=info.pop("uploaded", None))

    return run_stage(STAGE, settings, prm_inputs(scored, policy, prm, reference), store, "model", build)


def _accuracies(batch: RLBatch, parts: list[dict], ranking_accuracy) -> dict[str, float]:
    import torch

    rows = [i for p in parts for i in p["rows"]]
    correct, groups = torch.tensor([batch.correct[i] for i in rows]), torch.tensor([batch.groups[i] for i in rows])
    out = {}
    for when in ("before", "after"):
        acc = ranking_accuracy(torch.tensor([s for p in parts for s in p[when]]), correct, groups)
        if acc is not None:
            out[f"prm_acc_{when}"] = acc
    return out


def run_process_rewards(rl: RLConfig, scored: list[ArtifactRef], policy: ArtifactRef, prm: ArtifactRef,
                        reference: ArtifactRef, store: ArtifactStore, warm: WarmGroup | None = None) -> ArtifactRef:  # fmt: skip
    """The rows of `scored` the policy update trains on, with `process_rewards` from `prm`: a `process_rewards`
    dataset. Its metrics: process_reward_mean, and prm_acc (the PRM's ranking accuracy on these rows)."""
    import pyarrow as pa
    import ray
    import torch

    from posttrain_core.algorithms.prime import ranking_accuracy
    from posttrain_core.data.io import read_dataset, write_dataset
    from posttrain_core.train.rl_stage import ranks_of

    settings = PRMSettings.of(rl)

    def build(ctx: StageContext) -> StageOutput:
        batch, _ = _batch(rl, scored, policy, store, SCORE_STAGE)
        job = _job(rl, store, prm, reference, None, train=False)
        shards = split(list(range(len(batch))), settings.num_workers)
        with ranks_of(warm, settings.num_workers, ROLE, PRMWorker) as ranks:
            ranks.run("load", job)
            ref = ray.put(batch)
            rewards = [
                r for part in ranks.run_each("score", [(ref, s, settings.prime.beta) for s in shards]) for r in part
            ]
        table = pa.concat_tables([read_dataset(store.local_path(s), "scored_rollouts") for s in scored])
        where = {(p, i): n for n, (p, i) in enumerate(zip(table.column("prompt_id").to_pylist(),
                                                         table.column("sample_index").to_pylist(), strict=True))}  # fmt: skip
        out = table.take([where[k] for k in batch.keys]).append_column(
            "process_rewards", pa.array(rewards, pa.list_(pa.float32()))
        )
        write_dataset(out, "process_rewards", ctx.outdir)
        tokens = sum(sum(m) for m in batch.response_mask)
        metrics = {"rows": float(len(batch)),
                   "process_reward_mean": sum(map(sum, rewards)) / max(tokens, 1)}  # fmt: skip
        acc = ranking_accuracy(torch.tensor([sum(r) for r in rewards]), torch.tensor(batch.correct),
                               torch.tensor(batch.groups))  # fmt: skip
        if acc is not None:
            metrics["prm_acc"] = acc
        return StageOutput(manifest={"prm": prm.uri}, metrics=metrics)

    return run_stage(SCORE_STAGE, settings, prm_inputs(scored, policy, prm, reference), store, "dataset", build,
                     schema_kind="process_rewards")  # fmt: skip
