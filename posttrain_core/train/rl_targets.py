"""The RL update's targets, computed on the driver over the whole batch: token rewards (the KL in the reward, when
placed there), the registered advantage estimator, value targets, and the metrics they yield; and whether the old
log-probs need a pass of their own before the update."""

from __future__ import annotations

from posttrain_core.config import RLConfig
from posttrain_core.train.rl_batch import Prepared, RLBatch, Targets, pad, pad_topk


def compute_targets(
    cfg: RLConfig, batch: RLBatch, prepared: Prepared, kl_coef: float, epochs: int, ref_in_update: bool = False
) -> tuple[Targets, dict[str, float]]:
    """Advantages and returns over the whole batch (`cfg` resolved), and the metrics they yield.

    Token rewards: the sequence reward on the last policy token, minus kl_coef * KL_t on every token when the KL is
    placed in the reward; then the registered advantage estimator `cfg.advantage`. ref_in_update: the update computes
    the reference log-probs itself (prepare was skipped), so their absence here is no error.
    """
    import torch

    from posttrain_core.algorithms.advantages import (
        ADVANTAGES,
        AdvantageInputs,
        gae_advantages,
        masked_mean,
        token_level_rewards,
    )
    from posttrain_core.algorithms.losses import adaptive_kl_coef, kl_estimate

    width = max(1, max(len(r) for r in batch.response_ids))
    mask = pad([[float(x) for x in m] for m in batch.response_mask], width)
    old = pad(prepared.old_logp, width) if prepared.old_logp is not None else None
    ref = pad(prepared.ref_logp, width) if prepared.ref_logp else None
    values = pad(prepared.values, width) if prepared.values else None
    rewards = torch.tensor(batch.rewards, dtype=torch.float32)
    groups = torch.tensor(batch.groups, dtype=torch.long)
    token_rewards = token_level_rewards(rewards, mask)
    if ref is not None:
        if cfg.kl_placement == "reward" and kl_coef > 0:
            token_rewards = token_rewards - kl_coef * kl_estimate(old, ref, cfg.kl_estimator) * mask
    elif cfg.kl_placement != "none" and kl_coef > 0 and not ref_in_update:
        raise ValueError(f"rl_update: kl_placement='{cfg.kl_placement}' needs a reference model")
    if values is None and cfg.uses_critic:
        raise ValueError(f"rl_update: algorithm '{cfg.algorithm}' needs a critic")
    teacher = pad(batch.teacher_logp, width) if batch.teacher_logp is not None else None
    process = pad(batch.process_rewards, width) if batch.process_rewards is not None else None
    d, pr = cfg.distill, cfg.prime
    inputs = AdvantageInputs(
        token_rewards, mask, groups, values, cfg.gamma, cfg.lam, cfg.critic_lam, cfg.vapo_alpha,
        sampler_logp_B_T=pad(batch.logprobs, width) if teacher is not None else None, teacher_logp_B_T=teacher,
        **(dict(distill_coef=d.coef, distill_discount=d.discount, task_weight=d.task_weight,
                task_advantage=d.task_advantage) if d is not None else {}),
        process_B_T=process,
        **(dict(prime_gt_coef=pr.reward_gt_coef, prime_dpo_coef=pr.reward_dpo_coef, prime_norm=pr.norm)
           if pr is not None else {}),
    )  # fmt: skip
    adv, returns = ADVANTAGES[cfg.advantage](inputs)
    off_policy = {}
    if cfg.rollout_lag or cfg.off_policy != "none":
        adv, off_policy = _correct(cfg, adv, old, pad(batch.logprobs, width), mask)
    if values is not None and returns is None:  # a critic under a critic-free estimator: Monte-Carlo targets
        _, returns = gae_advantages(token_rewards, values, mask, cfg.gamma, 1.0, whiten_advantages=False)

    metrics = {
        "advantage_mean": float(masked_mean(adv, mask)),
        "advantage_abs_mean": float(masked_mean(adv.abs(), mask)),
        "zero_advantage_frac": float(((adv.abs() < 1e-8).float() * mask).sum() / mask.sum().clamp(min=1)),
        "kl_coef": kl_coef,
    }
    if values is not None:
        metrics["value_mean"] = float(masked_mean(values, mask))
    metrics |= off_policy
    if teacher is not None:
        metrics |= teacher_metrics(batch, inputs.sampler_logp_B_T, teacher, mask, width)
    if process is not None:  # the PRM's credit as the update took it
        metrics |= {"process_reward_mean": float(masked_mean(process, mask)),
                    "process_reward_abs_mean": float(masked_mean(process.abs(), mask))}  # fmt: skip
    next_kl = kl_coef
    if cfg.kl_target is not None and ref is not None:
        seq_kl = float((kl_estimate(old, ref, "k1") * mask).sum(-1).mean())
        next_kl = adaptive_kl_coef(kl_coef, seq_kl, cfg.kl_target, len(batch), cfg.kl_horizon)
    metrics["next_kl_coef"] = next_kl
    lengths = [len(r) for r in batch.response_ids]

    def rows(t):
        return [t[i, :n].tolist() for i, n in enumerate(lengths)]

    targets = Targets(
        advantages=rows(adv),
        old_logp=prepared.old_logp,
        ref_logp=prepared.ref_logp or None,
        returns=rows(returns) if returns is not None else None,
        old_values=prepared.values or None,
        epochs=epochs,
        t_max=width,
        kl_coef=kl_coef if cfg.kl_placement == "loss" else 0.0,
        next_kl_coef=next_kl,
        ref_in_update=ref_in_update,
    )
    return targets, metrics


def _correct(cfg: RLConfig, adv_B_T, prox_B_T, behaviour_B_T, mask_B_T):
    """The advantages times the registered off-policy correction's weights (`algorithms.off_policy`), and its
    metrics. `prox_B_T`: the old log-probs, recomputed with the update's starting weights."""
    from posttrain_core.algorithms.off_policy import OFF_POLICY_CORRECTIONS, OffPolicyInputs, correction_metrics

    if prox_B_T is None:
        raise ValueError("rl_update: an off-policy correction needs the recomputed old log-probs")
    inp = OffPolicyInputs(prox_B_T, behaviour_B_T, mask_B_T, cfg.is_cap, cfg.is_low, cfg.is_high)
    weight_B_T = OFF_POLICY_CORRECTIONS[cfg.off_policy](inp)
    if weight_B_T.shape != adv_B_T.shape or bool((weight_B_T < 0).any()):
        raise ValueError(f"rl.off_policy={cfg.off_policy!r} must return a weight >= 0 per token, of shape "
                         f"{tuple(adv_B_T.shape)}")  # fmt: skip
    return adv_B_T * weight_B_T.to(adv_B_T.dtype), correction_metrics(inp, weight_B_T)


def teacher_metrics(batch: RLBatch, sampler_B_T, teacher_B_T, mask_B_T, width: int) -> dict[str, float]:
    """teacher_kl: the per-token reverse-KL estimate E[log pi(y) - log pi_teacher(y)] over the sampled tokens; with
    top-k, teacher_mass: the teacher's probability mass on its top-k tokens, per token."""

    from posttrain_core.algorithms.advantages import masked_mean

    out = {"teacher_kl": float(masked_mean(sampler_B_T - teacher_B_T, mask_B_T))}
    if batch.teacher_topk_logp is not None:
        mass_B_T = pad_topk(batch.teacher_topk_logp, width).exp().sum(-1)
        out["teacher_mass"] = float(masked_mean(mass_B_T, mask_B_T))
    return out


def needs_old_logprobs(cfg: RLConfig, epochs: int, train_policy: bool, dropout: bool) -> bool:
    """Whether the old log-probs must come from a pass of their own before the update.

    Not when the update takes a single optimizer step on the batch (1 epoch x 1 mini-batch) and nothing before the
    update reads them (no KL in the reward, no adaptive KL): its first forward then runs with the very weights that
    sampled the batch, so old = its log-probs, detached. A policy whose train-mode forward is stochastic (dropout)
    needs the eval-mode pass all the same; value pretraining trains no policy and needs none.
    """
    if not train_policy:
        return False
    if cfg.rollout_lag or cfg.off_policy != "none":  # the proximal log-probs weigh the rows before the update
        return True
    one_step = epochs * cfg.mini_batches == 1
    return dropout or not (one_step and cfg.kl_placement != "reward" and cfg.kl_target is None)
