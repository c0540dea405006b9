"""Losses of the RL update: KL estimators, loss aggregation, policy losses (registered), the value loss.

Definitions: docs/algorithms.md. Registries, one signature each: `KL_ESTIMATORS` fn(logp_B_T, ref_logp_B_T) -> kl_B_T;
`AGGREGATIONS` fn(loss_B_T, mask_B_T, num_tokens, num_seqs, t_max) -> loss; `POLICY_LOSSES` fn(logp_B_T,
old_logp_B_T, adv_B_T, mask_B_T, LossSettings) -> (loss, metrics).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from posttrain_core.algorithms.advantages import broadcast_advantages, masked_mean
from posttrain_core.algorithms.registry import Registry

Tensor = torch.Tensor

KL_ESTIMATORS: Registry = Registry("KL estimator")
AGGREGATIONS: Registry = Registry("loss aggregation")
POLICY_LOSSES: Registry = Registry("policy loss")
register_kl_estimator = KL_ESTIMATORS.register
register_aggregation = AGGREGATIONS.register
register_policy_loss = POLICY_LOSSES.register


# ---------------------------------------------------------------------------------------------- KL estimators
def kl_estimate(logp_B_T: Tensor, ref_logp_B_T: Tensor, kind: str) -> Tensor:
    """Per-token estimate kl_B_T of KL(pi || pi_ref) by the registered estimator `kind`."""
    return KL_ESTIMATORS[kind](logp_B_T, ref_logp_B_T)


@register_kl_estimator("k1")
def kl_k1(logp_B_T: Tensor, ref_logp_B_T: Tensor) -> Tensor:
    """k1 = d = logp - ref_logp."""
    return logp_B_T - ref_logp_B_T


@register_kl_estimator("abs")
def kl_abs(logp_B_T: Tensor, ref_logp_B_T: Tensor) -> Tensor:
    """|d|."""
    return (logp_B_T - ref_logp_B_T).abs()


@register_kl_estimator("k2")
def kl_k2(logp_B_T: Tensor, ref_logp_B_T: Tensor) -> Tensor:
    """k2 = 0.5 d^2."""
    return 0.5 * (logp_B_T - ref_logp_B_T) ** 2


@register_kl_estimator("k3")
def kl_k3(logp_B_T: Tensor, ref_logp_B_T: Tensor) -> Tensor:
    """k3 (low variance) = e^x - x - 1 with x = clamp(-d, -20, 20), clamped to [-10, 10]."""
    x_B_T = (-(logp_B_T - ref_logp_B_T)).clamp(-20.0, 20.0)
    return (x_B_T.exp() - x_B_T - 1.0).clamp(-10.0, 10.0)


# ---------------------------------------------------------------------------------------------- aggregation
def _count(value: float | None, default: Tensor) -> Tensor | float:
    # Counts below 1 mean there is nothing to average: the numerator is then 0 and so is the loss (never 0 / 0).
    return default.clamp(min=1) if value is None else max(float(value), 1.0)


def _row_sums(loss_B_T: Tensor, mask_B_T: Tensor) -> tuple[Tensor, Tensor]:
    """(sum_t m L per row, sum_t m per row)."""
    m_B_T = mask_B_T.to(loss_B_T.dtype)
    return (loss_B_T * m_B_T).sum(-1), m_B_T.sum(-1)


def _num_seqs(num_seqs: float | None, n_B: Tensor, dtype: torch.dtype) -> Tensor | float:
    return _count(num_seqs, (n_B > 0).sum().to(dtype))


@register_aggregation("token-mean")
def token_mean(loss_B_T: Tensor, mask_B_T: Tensor, num_tokens=None, num_seqs=None, t_max=None) -> Tensor:
    """sum m L / num_tokens (DAPO; the GRPO family's default)."""
    tok_sum_B, n_B = _row_sums(loss_B_T, mask_B_T)
    return tok_sum_B.sum() / _count(num_tokens, n_B.sum())


@register_aggregation("token-sum")
def token_sum(loss_B_T: Tensor, mask_B_T: Tensor, num_tokens=None, num_seqs=None, t_max=None) -> Tensor:
    """sum m L, never normalised: a batch split into parts sums to the whole batch's loss and gradient whatever the
    parts (`posttrain serve`: the client chooses its normalisation through its weights or advantages)."""
    return _row_sums(loss_B_T, mask_B_T)[0].sum()


@register_aggregation("seq-mean-token-mean")
def seq_mean_token_mean(loss_B_T: Tensor, mask_B_T: Tensor, num_tokens=None, num_seqs=None, t_max=None) -> Tensor:
    """sum_i (sum_t m L / max(sum_t m, 1)) / num_seqs (the original GRPO)."""
    tok_sum_B, n_B = _row_sums(loss_B_T, mask_B_T)
    return (tok_sum_B / n_B.clamp(min=1)).sum() / _num_seqs(num_seqs, n_B, loss_B_T.dtype)


@register_aggregation("seq-mean-token-sum")
def seq_mean_token_sum(loss_B_T: Tensor, mask_B_T: Tensor, num_tokens=None, num_seqs=None, t_max=None) -> Tensor:
    """sum_i sum_t m L / num_seqs."""
    tok_sum_B, n_B = _row_sums(loss_B_T, mask_B_T)
    return tok_sum_B.sum() / _num_seqs(num_seqs, n_B, loss_B_T.dtype)


@register_aggregation("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(loss_B_T: Tensor, mask_B_T: Tensor, num_tokens=None, num_seqs=None, t_max=None) -> Tensor:
    """sum_i sum_t m L / (num_seqs t_max) (Dr.GRPO)."""
    tok_sum_B, n_B = _row_sums(loss_B_T, mask_B_T)
    seqs = _num_seqs(num_seqs, n_B, loss_B_T.dtype)
    return tok_sum_B.sum() / (seqs * max(float(mask_B_T.shape[1] if t_max is None else t_max), 1.0))


def aggregate(
    loss_B_T: Tensor,
    mask_B_T: Tensor,
    mode: str,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    t_max: float | None = None,
) -> Tensor:
    """Reduce token losses L_B_T to a 0-dim loss with the registered aggregation `mode`.

    Pass the GLOBAL counts over all data-parallel ranks: the per-rank values then sum to the full-batch value.
    Defaults (one rank): num_tokens = sum m; num_seqs = rows with at least one mask-1 token (our choice: empty rows
    contribute 0 and are not counted, in every seq mode); t_max = T. Every denominator is clamped to >= 1.
    """
    return AGGREGATIONS[mode](loss_B_T, mask_B_T, num_tokens, num_seqs, t_max)


@dataclass(frozen=True)
class LossSettings:
    """How token losses are clipped and aggregated: the config's choices and the mini-batch's global counts."""

    loss_agg: str = "token-mean"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    num_tokens: float | None = None
    num_seqs: float | None = None
    t_max: float | None = None

    def aggregate(self, loss_B_T: Tensor, mask_B_T: Tensor) -> Tensor:
        return aggregate(
            loss_B_T, mask_B_T, self.loss_agg, num_tokens=self.num_tokens, num_seqs=self.num_seqs, t_max=self.t_max
        )


# ---------------------------------------------------------------------------------------------- policy losses
def policy_loss(
    name: str, logp_B_T: Tensor, old_logp_B_T: Tensor, adv_B_T: Tensor, mask_B_T: Tensor, settings: LossSettings
) -> tuple[Tensor, dict[str, Tensor]]:
    """The registered policy loss `name`: (0-dim loss with graph, detached metrics)."""
    return POLICY_LOSSES[name](logp_B_T, old_logp_B_T, adv_B_T, mask_B_T, settings)


@register_policy_loss("clip")
def clip_policy_loss(
    logp_B_T: Tensor,
    old_logp_B_T: Tensor,
    adv_B_T: Tensor,
    mask_B_T: Tensor,
    settings: LossSettings = LossSettings(),  # noqa: B008 (frozen)
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (clip-higher when clip_high > clip_low, optional dual clip), then aggregated.

    rho = exp(clamp(logp - old, -20, 20)); L = max(-A rho, -A clip(rho, 1 - clip_low, 1 + clip_high)); where A < 0
    and dual_clip = c (> 1), L = min(L, -A c). old_logp and adv carry no gradient.

    Returns:
        (loss, metrics): loss is 0-dim with graph. metrics are detached masked means over the local tokens:
        clip_frac (the clipped term was taken: -A clip(rho) > -A rho), approx_kl (k2 between old and new policy:
        0.5 (logp - old)^2), ratio_mean, dual_clip_frac (the dual-clip cap was taken).
    """
    s = settings
    if s.dual_clip is not None and s.dual_clip <= 1.0:
        raise ValueError(f"clip policy loss: dual_clip must be > 1, got {s.dual_clip}")
    d_B_T = logp_B_T - old_logp_B_T.detach()
    adv_B_T = adv_B_T.detach()
    ratio_B_T = d_B_T.clamp(-20.0, 20.0).exp()
    unclipped_B_T = -adv_B_T * ratio_B_T
    clipped_B_T = -adv_B_T * ratio_B_T.clamp(1.0 - s.clip_low, 1.0 + s.clip_high)
    loss_B_T = torch.maximum(unclipped_B_T, clipped_B_T)
    dual_B_T = torch.zeros_like(loss_B_T, dtype=torch.bool)
    if s.dual_clip is not None:
        cap_B_T = -adv_B_T * s.dual_clip
        dual_B_T = (adv_B_T < 0) & (loss_B_T > cap_B_T)
        loss_B_T = torch.where(dual_B_T, cap_B_T, loss_B_T)
    loss = s.aggregate(loss_B_T, mask_B_T)
    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean((clipped_B_T > unclipped_B_T).float(), mask_B_T),
            "approx_kl": masked_mean(0.5 * d_B_T.float() ** 2, mask_B_T),
            "ratio_mean": masked_mean(ratio_B_T.float(), mask_B_T),
            "dual_clip_frac": masked_mean(dual_B_T.float(), mask_B_T),
        }
    return loss, metrics


@register_policy_loss("importance_sampling")
def importance_sampling_policy_loss(
    logp_B_T: Tensor,
    old_logp_B_T: Tensor,
    adv_B_T: Tensor,
    mask_B_T: Tensor,
    settings: LossSettings = LossSettings(),  # noqa: B008 (frozen)
) -> tuple[Tensor, dict[str, Tensor]]:
    """The unclipped importance-weighted policy gradient: L = -rho A, rho = exp(clamp(logp - old, -20, 20)), then
    aggregated. Its gradient is -rho A grad(logp): REINFORCE corrected for samples drawn by the `old` policy (tinker's
    `importance_sampling`). No clipping, so nothing bounds a step where rho is far from 1. Metrics: approx_kl,
    ratio_mean (masked means over the local tokens)."""
    d_B_T = logp_B_T - old_logp_B_T.detach()
    ratio_B_T = d_B_T.clamp(-20.0, 20.0).exp()
    loss = settings.aggregate(-adv_B_T.detach() * ratio_B_T, mask_B_T)
    with torch.no_grad():
        metrics = {
            "approx_kl": masked_mean(0.5 * d_B_T.float() ** 2, mask_B_T),
            "ratio_mean": masked_mean(ratio_B_T.float(), mask_B_T),
        }
    return loss, metrics


@register_policy_loss("gspo")
def gspo_policy_loss(
    logp_B_T: Tensor,
    old_logp_B_T: Tensor,
    adv_B_T: Tensor,
    mask_B_T: Tensor,
    settings: LossSettings = LossSettings(),  # noqa: B008 (frozen)
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: the PPO clip applied to a sequence-level ratio, one loss per response.

    A_i = the masked mean of row i's token advantages (its sequence advantage); s_i = exp(clamp(mean_t (logp - old)
    over the masked tokens, -20, 20)); L_i = max(-A_i s_i, -A_i clip(s_i, 1 - clip_low, 1 + clip_high));
    loss = sum_i L_i / num_seqs over rows with >= 1 mask-1 token (the loss aggregation does not apply). The paper's
    clip ranges are 3e-4 / 4e-4. We use this straight sequence-ratio form, not the paper's token-level GSPO-token
    rewrite. Metrics are token-weighted masked means (each row's value on its tokens), so they combine across ranks
    like the clip loss's: clip_frac, approx_kl (0.5 (logp - old)^2), ratio_mean.
    """
    s = settings
    m_B_T = mask_B_T.to(logp_B_T.dtype)
    adv_B = ((adv_B_T * m_B_T).sum(-1) / m_B_T.sum(-1).clamp(min=1)).detach()
    d_B_T = logp_B_T - old_logp_B_T.detach()
    n_B = m_B_T.sum(-1)
    ratio_B = ((d_B_T * m_B_T).sum(-1) / n_B.clamp(min=1)).clamp(-20.0, 20.0).exp()
    unclipped_B = -adv_B * ratio_B
    clipped_B = -adv_B * ratio_B.clamp(1.0 - s.clip_low, 1.0 + s.clip_high)
    loss_B = torch.maximum(unclipped_B, clipped_B) * (n_B > 0)
    loss = loss_B.sum() / _count(s.num_seqs, (n_B > 0).sum().to(loss_B.dtype))
    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean(broadcast_advantages((clipped_B > unclipped_B).float(), m_B_T), m_B_T),
            "approx_kl": masked_mean(0.5 * d_B_T.float() ** 2, m_B_T),
            "ratio_mean": masked_mean(broadcast_advantages(ratio_B.float(), m_B_T), m_B_T),
        }
    return loss, metrics


@register_policy_loss("cispo")
def cispo_policy_loss(
    logp_B_T: Tensor,
    old_logp_B_T: Tensor,
    adv_B_T: Tensor,
    mask_B_T: Tensor,
    settings: LossSettings = LossSettings(),  # noqa: B008 (frozen)
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1): L_t = -sg(clip(rho_t, 1 - clip_low, 1 + clip_high)) A_t logp_t, then aggregated.

    The clipped importance ratio is a stop-gradient weight on the REINFORCE term, so every token keeps a gradient
    (PPO's clip zeroes the gradient of clipped tokens). At rho = 1 the gradient equals the clip loss's. Metrics as the
    clip loss's: clip_frac (the weight was clipped), approx_kl, ratio_mean.
    """
    s = settings
    d_B_T = logp_B_T - old_logp_B_T.detach()
    ratio_B_T = d_B_T.detach().clamp(-20.0, 20.0).exp()
    weight_B_T = ratio_B_T.clamp(1.0 - s.clip_low, 1.0 + s.clip_high)
    loss = s.aggregate(-weight_B_T * adv_B_T.detach() * logp_B_T, mask_B_T)
    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean((weight_B_T != ratio_B_T).float(), mask_B_T),
            "approx_kl": masked_mean(0.5 * d_B_T.float() ** 2, mask_B_T),
            "ratio_mean": masked_mean(ratio_B_T.float(), mask_B_T),
        }
    return loss, metrics


# ------------------------------------------------------------------------------------------------- the rest
def value_loss(
    values_B_T: Tensor,
    old_values_B_T: Tensor,
    returns_B_T: Tensor,
    mask_B_T: Tensor,
    settings: LossSettings = LossSettings(),  # noqa: B008 (frozen)
    value_clip: float | None = 0.2,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped critic loss 0.5 agg(max((v - R)^2, (clip(v, v_old - eps, v_old + eps) - R)^2)), eps = value_clip.

    value_clip=None: no clipping, 0.5 agg((v - R)^2). Returns (loss, metrics) with detached masked means over the
    local tokens: vf_clip_frac (the clipped term was larger), value_mean (v), value_error ((v - R)^2).
    """
    old_B_T, ret_B_T = old_values_B_T.detach(), returns_B_T.detach()
    err_B_T = (values_B_T - ret_B_T) ** 2
    loss_B_T, clipped_frac_B_T = err_B_T, torch.zeros_like(err_B_T)
    if value_clip is not None:
        clipped_err_B_T = (old_B_T + (values_B_T - old_B_T).clamp(-value_clip, value_clip) - ret_B_T) ** 2
        loss_B_T = torch.maximum(err_B_T, clipped_err_B_T)
        clipped_frac_B_T = (clipped_err_B_T > err_B_T).to(err_B_T.dtype)
    loss = 0.5 * settings.aggregate(loss_B_T, mask_B_T)
    with torch.no_grad():
        metrics = {
            "vf_clip_frac": masked_mean(clipped_frac_B_T.float(), mask_B_T),
            "value_mean": masked_mean(values_B_T.float(), mask_B_T),
            "value_error": masked_mean(err_B_T.float(), mask_B_T),
        }
    return loss, metrics


def entropy_from_logits(logits_B_T_V: Tensor) -> Tensor:
    """H_B_T = -sum_v p_v log p_v with p = softmax(logits), in fp32; -inf logits (p = 0) contribute 0, not NaN."""
    logp_B_T_V = F.log_softmax(logits_B_T_V.float(), dim=-1)
    # 0 * -inf = NaN: a finite floor keeps p log p = 0 for p = 0 (and its gradient finite).
    return -(logp_B_T_V.exp() * logp_B_T_V.clamp(min=torch.finfo(torch.float32).min)).sum(-1)


def token_logprobs(logits_B_T_V: Tensor, labels_B_T: Tensor) -> Tensor:
    """logp_B_T = log_softmax(logits[b, t])[labels[b, t]] in fp32 (no shift: logits[t] predicts labels[t]); 0 where
    labels < 0 (e.g. -100)."""
    if logits_B_T_V.shape[:2] != labels_B_T.shape:
        raise ValueError(
            f"token_logprobs: logits {tuple(logits_B_T_V.shape)} do not match labels {tuple(labels_B_T.shape)}"
        )
    logits_B_T_V = logits_B_T_V.float()
    # log_softmax(x)[y] = x[y] - logsumexp(x): no second B x T x V tensor.
    picked_B_T = torch.gather(logits_B_T_V, -1, labels_B_T.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    logp_B_T = picked_B_T - torch.logsumexp(logits_B_T_V, dim=-1)
    return torch.where(labels_B_T >= 0, logp_B_T, torch.zeros_like(logp_B_T))


def adaptive_kl_coef(beta: float, kl: float, target: float, n_steps: int, horizon: int) -> float:
    """Adaptive KL controller: beta * (1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon)."""
    if target <= 0 or horizon <= 0:
        raise ValueError(f"adaptive_kl_coef: target and horizon must be > 0, got {target} and {horizon}")
    error = min(max(kl / target - 1.0, -0.2), 0.2)
    return beta * (1.0 + error * n_steps / horizon)
