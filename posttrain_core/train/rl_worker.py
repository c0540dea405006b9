"""The RL update inside Ray ranks: recompute log-probs and values, then PPO-style epochs over mini-batches (DDP).

What it really is. The driver (`train/rl_stage.py`) hands every rank the same batch of scored rollouts. `prepare`
(when the advantages need it): each rank computes, for its shard of rows and with the weights that sampled them, the
old log-probs of the response tokens, the reference log-probs (a frozen copy, or for LoRA the same model with its
adapter disabled) and the critic's values; the driver gathers them and computes advantages and returns over the
whole batch (group statistics and whitening need all of it). `update`: `epochs` passes; each pass shuffles the rows
(seeded by the optimizer step) and cuts them into `mini_batches` optimizer steps; rank r takes the r-th contiguous
share of a mini-batch's rows sorted by group, in micro-batches, so a group's rows meet and its prompt runs once in the
forward (`encode_shared`). Every loss term is aggregated with the *mini-batch's global* token / sequence counts, so the
summed gradient over ranks and micro-batches equals the full mini-batch's, whatever the number of ranks. With one
optimizer step per batch and nothing else needing them first, `prepare` is skipped: the update's first forward runs
with the weights that sampled the batch, so its log-probs are the old ones, and each micro-step computes its rows'
reference log-probs itself. The policy loss, KL estimator and aggregation are looked up by the config's names.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any

from posttrain_core.artifacts.node import on_node
from posttrain_core.train.loop import data_parallel, peak_rss_mb
from posttrain_core.train.rl_batch import (
    BatchTensors,
    Prepared,
    RLBatch,
    RLJob,
    Targets,
    chunks,
    encode,
    encode_shared,
    pad,
    response_logprobs,
)
from posttrain_core.train.rl_state import load_trainer_state, optimizer_settings, save_update
from posttrain_core.train.rl_stats import LogpChecks, UpdateStats


class RLWorker:
    """The role of one data-parallel rank (`cluster.RankActor`): `load` -> (`prepare`) -> `update` -> `save`."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world = rank, world_size
        self._pixels_of, self._pixels = None, {}  # a VLM batch's decoded images by row (`_images`)

    def load(self, job: RLJob) -> dict[str, Any]:
        """Policy (trainable), reference, critic, optimizers and the previous update's trainer state.

        Returns {"state": "continued" | "loaded", "dropout": bool}. "continued": this rank built the job's policy
        (and critic) itself in its last update and kept them; weights, optimizer moments, scheduler and step counters
        are then exactly what the published artifact holds (fp32 safetensors and torch.save round-trip bit for bit;
        a resumed run relies on it, and a test compares the two paths' digests), so nothing is reloaded. "dropout":
        the policy's train-mode forward is stochastic, so its old log-probs need an eval-mode pass of their own.
        """
        import torch

        if self._continues(job):
            self.given, self.job = job, on_node(job, fetch=False)
            torch.manual_seed(job.cfg.seed)  # as a fresh load does
            return {"state": "continued", "dropout": _dropout_active(self.policy)}
        self.release()

        from posttrain_core.models.critic import build_critic
        from posttrain_core.models.heads import TokenLogprobs, plain_head
        from posttrain_core.models.loading import (
            _is_peft,
            check_model_path,
            enable_gradient_checkpointing,
            load_causal_lm,
            load_tokenizer,
        )
        from posttrain_core.models.lora import apply_lora
        from posttrain_core.train.loop import build_optimizer
        from posttrain_core.vision.inputs import VisionSpec, freeze_tower

        cfg = self.cfg = job.cfg
        self.given, self.job = job, on_node(job)  # `given` (the job as sent) is what the next update compares
        job = self.job
        torch.manual_seed(cfg.seed)
        self.tokenizer = load_tokenizer(job.policy_path)
        pad_id = self.tokenizer.pad_token_id
        self.pad_id = pad_id if pad_id is not None else self.tokenizer.eos_token_id
        is_adapter = check_model_path(job.policy_path)["is_adapter"]
        self.policy = load_causal_lm(job.policy_path, trainable_adapter=is_adapter and job.train_policy)
        if cfg.lora is not None and not is_adapter:
            self.policy = apply_lora(self.policy, cfg.lora, seed=cfg.seed)
        self.lora = _is_peft(self.policy)
        self.vision = VisionSpec.of(job.policy_path)
        if self.vision is not None and not cfg.train_vision:
            freeze_tower(self.policy)
        # Each distinct prompt of a micro-batch runs once (`encode_shared`): plain-head models, and not with gradient
        # checkpointing (its training forward keeps no KV cache).
        self.can_share = plain_head(self.policy) and not cfg.gradient_checkpointing
        if cfg.gradient_checkpointing and job.train_policy:
            enable_gradient_checkpointing(self.policy)
        self.reference = None
        if job.reference_path is not None and not self.lora:
            self.reference = load_causal_lm(job.reference_path).eval().requires_grad_(False)
        if not job.train_policy:
            self.policy.eval().requires_grad_(False)
        self.critic = build_critic(job.critic_path) if job.critic_path else None
        if self.critic is not None and self.vision is not None:
            raise ValueError(f"{job.stage}: a critic on a vision-language model is not supported: use grpo or another "
                             "critic-free algorithm")  # fmt: skip
        if cfg.gradient_checkpointing and self.critic is not None:
            enable_gradient_checkpointing(self.critic)

        state = load_trainer_state(job.state_path)
        self.step = state.get("step", 0)
        self.critic_step = state.get("critic_step", 0)
        self.opt = self.critic_opt = None
        wrap = functools.partial(data_parallel, world=self.world)
        if job.train_policy:
            self.params, self.opt, self.sched = build_optimizer(self.policy, optimizer_settings(cfg, cfg.lr))
            if "policy_optimizer" in state:
                self.opt.load_state_dict(state["policy_optimizer"])
                self.sched.load_state_dict(state["policy_scheduler"])
            self.ddp_policy = wrap(TokenLogprobs(self.policy.train()))
        if self.critic is not None:
            self.critic_params, self.critic_opt, self.critic_sched = build_optimizer(
                self.critic, optimizer_settings(cfg, cfg.critic_lr)
            )
            if "critic_optimizer" in state:
                self.critic_opt.load_state_dict(state["critic_optimizer"])
                self.critic_sched.load_state_dict(state["critic_scheduler"])
            self.ddp_critic = wrap(self.critic.train())
        return {"state": "loaded", "dropout": _dropout_active(self.policy)}

    def _continues(self, job: RLJob) -> bool:
        """Whether the models in memory are what `job` would load: the policy (and critic) artifact is the one this
        rank's last update built, with the same reference and settings."""
        kept = self.__dict__.get("kept")
        if kept is None or not job.train_policy or job.policy_key is None:
            return False
        critic_ok = job.critic_path is None or job.critic_key == job.policy_key
        return critic_ok and kept == (job.policy_key, job.reference_path, job.cfg)

    def keep(self) -> None:
        """After a successful update: keep the models for an update that continues from its artifact."""
        job = self.__dict__.get("given")
        if job is not None and job.train_policy and job.output_key is not None:
            self.kept = (job.output_key, job.reference_path, job.cfg)

    def release(self) -> None:
        """Drop the models and optimizers of the last update (the process stays, warm, for the next one)."""
        import gc

        for name in ("policy", "reference", "critic", "ddp_policy", "ddp_critic", "opt", "critic_opt", "sched",
                     "critic_sched", "params", "critic_params", "job", "given", "tokenizer", "kept"):  # fmt: skip
            self.__dict__.pop(name, None)
        gc.collect()

    def prepare(self, batch: RLBatch, rows: list[int], need_old: bool) -> Prepared:
        """Old log-probs (if `need_old`), reference log-probs and values of `rows` with the current weights."""
        import torch

        from posttrain_core.models.critic import token_values

        old_rows: list[list[float]] | None = [] if need_old else None
        ref_rows: list[list[float]] = []
        value_rows: list[list[float]] = []
        checks = LogpChecks() if need_old else None
        with torch.no_grad(), self.autocast():
            for chunk in chunks(rows, 2 * self.cfg.micro_batch_size):
                ids, attn, pos, labels, mask = encode(batch, chunk, self.pad_id)
                shared = self.shared(batch, chunk)
                images = self.images(batch, chunk, ids, attn)
                lengths = [len(batch.response_ids[i]) for i in chunk]
                old = self._eval_logp(ids, attn, pos, labels, shared, images) if old_rows is not None else None
                ref = self.reference_logp(ids, attn, pos, labels, shared, images)  # after: a LoRA policy is in eval
                if old is not None:
                    old_rows += [old[b, :n].tolist() for b, n in enumerate(lengths)]
                    checks.add(pad([batch.logprobs[i] for i in chunk], mask.shape[1]), old, ref, mask)
                if ref is not None:
                    ref_rows += [ref[b, :n].tolist() for b, n in enumerate(lengths)]
                if self.critic is not None:
                    values = token_values(self.critic.eval(), ids, attn).gather(1, pos)
                    value_rows += [values[b, :n].tolist() for b, n in enumerate(lengths)]
        if self.job.train_policy:
            self.policy.train()
        if self.critic is not None:
            self.critic.train()
        return Prepared(old_rows, ref_rows, value_rows, checks)

    def shared(self, batch: RLBatch, rows: list[int]):
        """`encode_shared` of `rows` when the models allow it, else None."""
        return encode_shared(batch, rows, self.pad_id) if self.can_share else None

    def images(self, batch: RLBatch, rows: list[int], ids, attn):
        """A VLM policy's pixels and 3-D positions of the encoded `rows` (`vision.inputs`); None for a text model."""
        if self.vision is None:
            if batch.images is not None and any(batch.images[i] for i in rows):
                raise ValueError(f"{self.job.stage}: the rollouts have images, but the policy is a text-only model")
            return None
        from posttrain_core.vision.inputs import batch_inputs

        if self._pixels_of is not batch:  # decoded once per batch, not per micro-step and epoch
            self._pixels_of, self._pixels = batch, {}
        for i in rows:
            if i not in self._pixels:
                self._pixels[i] = self.vision.pixels(batch.images[i]) if batch.images and batch.images[i] else None
        images = [self._pixels[i] for i in rows]
        return batch_inputs(self.policy, self.vision, ids, attn, images, f"{self.job.stage} rows {rows[0]}..")

    def _eval_logp(self, ids, attn, pos, labels, shared=None, images=None):
        """The policy's log-probs of one encoded chunk in eval mode (dropout off), without gradients. The policy is
        left in eval mode; the caller puts it back in train mode."""
        import torch

        with torch.no_grad():
            return response_logprobs(self.policy.eval(), ids, attn, pos, labels, shared, vision=images).logp

    def reference_logp(self, ids, attn, pos, labels, shared=None, images=None):
        """Reference log-probs of one encoded chunk, without gradients: the frozen reference model, or for LoRA the
        policy with its adapter disabled; None when the job has no reference."""
        import torch

        if self.job.reference_path is None:
            return None
        with torch.no_grad():
            if self.lora:
                with self.policy.disable_adapter():
                    return response_logprobs(self.policy, ids, attn, pos, labels, shared, vision=images).logp
            if self.reference is not None:
                return response_logprobs(self.reference, ids, attn, pos, labels, shared, vision=images).logp
        return None

    def update(self, batch: RLBatch, targets: Targets, save: bool = True) -> dict[str, Any]:
        """`targets.epochs` shuffled passes of `cfg.mini_batches` optimizer steps; returns metrics.

        save=True: rank 0 then saves the checkpoint (`save`) and its `model_info` is in the metrics; False: the driver
        calls `save` itself afterwards (after taking the weights for the rollout engines, `policy_weights`).
        """
        import torch

        from posttrain_core.algorithms.losses import LossSettings
        from posttrain_core.cluster import split
        from posttrain_core.train.loop import optimizer_step

        cfg, world = self.cfg, self.world
        full = BatchTensors.of(batch, targets)
        mask = full.mask
        stats = UpdateStats()
        self._checks = LogpChecks() if targets.old_logp is None and self.job.train_policy else None
        grad_norms, critic_norms, t0 = [], [], time.time()
        for epoch in range(targets.epochs):
            g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.step * 7919 + self.critic_step * 31 + epoch)
            order = torch.randperm(len(batch), generator=g).tolist()
            for mb in split(order, cfg.mini_batches):
                settings = LossSettings(
                    loss_agg=cfg.loss_agg, clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip,
                    num_tokens=max(float(mask[mb].sum()), 1.0),
                    num_seqs=max(float((mask[mb].sum(-1) > 0).sum()), 1.0),
                    t_max=float(cfg.t_max or targets.t_max),
                )  # fmt: skip
                nll_tokens = float((mask[mb] * full.correct[mb, None]).sum())
                # This rank's rows: a contiguous share of the mini-batch sorted by group, so that a group's rows
                # (one prompt) meet in one micro-batch and its prompt runs once (`encode_shared`). Losses use the
                # mini-batch's global counts: any split of it sums to the same gradient.
                by_group = sorted(mb, key=lambda i: (batch.groups[i], i))
                mine = by_group[len(mb) * self.rank // world : len(mb) * (self.rank + 1) // world]
                micro = chunks(mine, cfg.micro_batch_size)
                for j, rows in enumerate(micro):
                    sync = world == 1 or j == len(micro) - 1
                    stats.add(self._micro_step(batch, rows, full, targets, settings, nll_tokens, sync))
                if self.job.train_policy:
                    grad_norms.append(optimizer_step(self.params, self.opt, self.sched, cfg.max_grad_norm)[0])
                    self.step += 1
                if self.critic is not None:
                    critic_norms.append(
                        optimizer_step(self.critic_params, self.critic_opt, self.critic_sched, cfg.max_grad_norm)[0]
                    )
                    self.critic_step += 1
        checks = self._checks
        if world > 1:
            stats = stats.all_reduce()
            if checks is not None:
                checks = checks.all_reduce()
        steps = max(1, targets.epochs * cfg.mini_batches)
        tok = max(stats.tokens, 1.0)
        metrics: dict[str, Any] = {
            "pg_loss": stats.pg_loss / steps,
            "kl_loss": stats.kl_loss / steps,
            "entropy": stats.entropy_sum / tok,
            "clip_frac": stats.clip_sum / tok,
            "approx_kl": stats.approx_kl_sum / tok,
            "value_loss": stats.value_loss / steps,
            "vf_clip_frac": stats.vf_clip_sum / tok,
            "nll_loss": stats.nll_loss / steps,
            "distill_loss": stats.distill_loss / steps,
            # the share of the policy's sequence tokens that shared prompts spared from running (`encode_shared`)
            "prompt_tokens_shared_frac": 1.0 - stats.seq_tokens_run / max(stats.seq_tokens, 1.0),
            "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else 0.0,
            "critic_grad_norm": sum(critic_norms) / len(critic_norms) if critic_norms else 0.0,
            "optimizer_steps": float(self.step),
            "update_s": time.time() - t0,
            "peak_rss_mb": peak_rss_mb(),
        }
        if full.teacher_ids is not None:  # the student's agreement with the teacher's top-k, as it was sampled
            metrics |= {"student_mass": stats.student_mass_sum / tok, "topk_overlap": stats.topk_overlap_sum / tok}
        if checks is not None:  # what `prepare` would have reported
            metrics |= checks.metrics()
        self._next_kl_coef = targets.next_kl_coef
        if save and self.rank == 0:
            metrics["model_info"] = self.save()
        if save and world > 1:
            import torch.distributed as dist

            dist.barrier()
        return metrics

    def _micro_step(
        self,
        batch: RLBatch,
        rows: list[int],
        full: BatchTensors,
        targets: Targets,
        settings: Any,
        nll_tokens: float,
        sync,
    ) -> UpdateStats:
        """Forward + backward of one micro-batch; returns its share of the stats."""
        import torch

        from posttrain_core.algorithms.distill import topk_agreement
        from posttrain_core.algorithms.losses import kl_estimate, policy_loss, value_loss
        from posttrain_core.models.critic import token_values

        cfg, out = self.cfg, UpdateStats()
        ids, attn, pos, labels, mask = encode(batch, rows, self.pad_id)
        shared = self.shared(batch, rows) if self.job.train_policy else None
        images = self.images(batch, rows, ids, attn)
        out.seq_tokens = float(attn.sum())
        out.seq_tokens_run = float(shared[1].sum() + shared[3].mask_U_P.sum()) if shared is not None else out.seq_tokens
        out.tokens = float(full.mask[rows].sum())
        R = mask.shape[1]
        adv, m = full.adv[rows, :R], full.mask[rows, :R]
        old = full.old[rows, :R] if full.old is not None else None
        ref = full.ref[rows, :R] if full.ref is not None else None
        if targets.ref_in_update and self.job.train_policy:
            with self.autocast():
                ref = self.reference_logp(ids, attn, pos, labels, shared, images)
        scale = float(self.world)  # DDP averages gradients over ranks; our losses are already global sums
        if self.job.train_policy:
            no_sync = contextlib.nullcontext() if sync else self.ddp_policy.no_sync()
            top = full.teacher_ids[rows, :R] if full.teacher_ids is not None else None
            with no_sync, self.autocast():
                scores = response_logprobs(
                    self.ddp_policy, ids, attn, pos, labels, shared, entropy=True, gather=top,
                    topk=top.shape[-1] if top is not None else 0, vision=images,
                )  # fmt: skip
                logp, entropy = scores.logp, scores.entropy
                if old is None:  # the only optimizer step on this batch: these weights sampled it
                    old = logp.detach()
                    self._checks.add(full.logprobs[rows, :R], old, ref, m)
                pg, info = policy_loss(cfg.policy_loss, logp, old, adv, m, settings)
                loss = pg
                kl_term = torch.zeros(())
                if cfg.kl_placement == "loss" and targets.kl_coef > 0 and ref is not None:
                    kl_term = targets.kl_coef * settings.aggregate(kl_estimate(logp, ref, cfg.kl_estimator), m)
                    loss = loss + kl_term
                if cfg.entropy_coef > 0:
                    loss = loss - cfg.entropy_coef * settings.aggregate(entropy, m)
                distill = torch.zeros(())
                if cfg.distill_loss_coef > 0:
                    distill = settings.aggregate(self._divergence(logp, scores.gathered, full, rows, R), m)
                    loss = loss + cfg.distill_loss_coef * distill
                nll = torch.zeros(())
                if cfg.nll_coef > 0 and nll_tokens > 0:
                    nll = -(logp * m * full.correct[rows, None]).sum() / nll_tokens
                    loss = loss + cfg.nll_coef * nll
                (loss * scale).backward()
            n_tok = float(m.sum())
            out.pg_loss, out.kl_loss, out.nll_loss = pg.item(), kl_term.item(), cfg.nll_coef * nll.item()
            out.distill_loss = distill.item()
            if top is not None:
                out.student_mass_sum, out.topk_overlap_sum = topk_agreement(scores.gathered, scores.topk_ids, top, m)
            out.entropy_sum = float((entropy.detach() * m).sum())
            out.clip_sum = float(info.get("clip_frac", 0.0)) * n_tok
            out.approx_kl_sum = float(info.get("approx_kl", 0.0)) * n_tok
        if self.critic is not None:
            no_sync = contextlib.nullcontext() if sync else self.ddp_critic.no_sync()
            with no_sync, self.autocast():
                values = token_values(self.ddp_critic, ids, attn).gather(1, pos)
                vl, vinfo = value_loss(
                    values, full.values[rows, :R], full.returns[rows, :R], m, settings, value_clip=cfg.value_clip
                )
                (vl * scale).backward()
            out.value_loss = vl.item()
            out.vf_clip_sum = float(vinfo.get("vf_clip_frac", 0.0)) * float(m.sum())
        return out

    def _divergence(self, logp, gathered, full: BatchTensors, rows: list[int], R: int):
        """Per-token supervised divergence to the teacher (`algorithms.distill.DIVERGENCES`), B x R with graph."""
        from posttrain_core.algorithms.distill import DIVERGENCES, DistillInputs

        d = self.cfg.distill
        inputs = DistillInputs(
            logp, full.teacher[rows, :R], gathered,
            full.teacher_topk[rows, :R] if full.teacher_topk is not None else None, d.beta,
        )  # fmt: skip
        return DIVERGENCES[d.divergence](inputs)

    def policy_weights(self) -> dict[str, Any] | None:
        """The updated policy's weights as numpy arrays (zero-copy in Ray's object store), for rollout engines that
        take them in memory (`EnginePool.prefetch`); None for a LoRA or non-fp32 policy."""
        import torch

        if self.lora or not self.job.train_policy:
            return None
        state = self.policy.state_dict()
        if any(t.dtype != torch.float32 for t in state.values()):
            return None
        return {name: t.detach().numpy() for name, t in state.items()}

    def autocast(self):
        import torch

        return torch.autocast("cpu", dtype=torch.bfloat16) if self.cfg.dtype == "bfloat16" else contextlib.nullcontext()

    def save(self) -> dict:
        """Policy, critic and trainer state as of the last `update`, into the job's output folder (`rl_state`)."""
        state = {"step": self.step, "critic_step": self.critic_step, "kl_coef": self._next_kl_coef}
        if self.opt is not None:
            state.update(policy_optimizer=self.opt.state_dict(), policy_scheduler=self.sched.state_dict())
        if self.critic_opt is not None:
            state.update(critic_optimizer=self.critic_opt.state_dict(), critic_scheduler=self.critic_sched.state_dict())
        policy = self.policy if self.job.train_policy else None
        info = save_update(self.job.outdir, policy, self.tokenizer, self.critic, state)
        if self.job.outbox is not None:  # a remote store: the driver publishes what this rank uploads
            info["uploaded"] = self.job.outbox.ship(self.job.outdir)
        return info


def _dropout_active(model) -> bool:
    """Whether a train-mode forward of `model` is stochastic (a Dropout module or a config dropout rate > 0)."""
    import torch

    if any(isinstance(mod, torch.nn.Dropout) and mod.p > 0 for mod in model.modules()):
        return True
    config = getattr(model, "config", None)
    rates = [v for k, v in (vars(config).items() if config is not None else []) if "dropout" in k]
    return any(isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in rates)
