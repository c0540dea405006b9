"""RL maths for LLM post-training: advantage estimators, KL estimators, loss aggregation, PPO/GSPO/value losses.

Pure tensor functions (no model, no distributed code) following /work/shared/ALGORITHMS.md; registered by name.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Tensor = torch.Tensor
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "abs", "k2", "k3")


def masked_sum(x_B_T: Tensor, mask_B_T: Tensor) -> Tensor:
    """sum(m x) over the whole batch, a 0-dim tensor."""
    return (x_B_T * mask_B_T.to(x_B_T.dtype)).sum()


def masked_mean(x_B_T: Tensor, mask_B_T: Tensor) -> Tensor:
    """sum(m x) / max(sum m, 1), a 0-dim tensor (0 when the mask is empty)."""
    return masked_sum(x_B_T, mask_B_T) / mask_B_T.to(x_B_T.dtype).sum().clamp(min=1)


def whiten(x_B_T: Tensor, mask_B_T: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x - mean_m(x)) / (std_m(x) + eps) over the masked tokens of the whole batch; 0 where m = 0.

    std is unbiased (n - 1) over the n masked tokens. Our choice: with n <= 1 std = 1 (x - mean is then 0 anyway), so
    the result is finite. shift_mean=False adds the mean back: only the spread is rescaled.
    """
    m_B_T = mask_B_T.to(x_B_T.dtype)
    n = m_B_T.sum()
    mean = masked_mean(x_B_T, m_B_T)
    var = (((x_B_T - mean) ** 2) * m_B_T).sum() / (n - 1).clamp(min=1)
    std = torch.where(n > 1, var.sqrt(), torch.ones_like(var))
    out_B_T = (x_B_T - mean) / (std + eps)
    if not shift_mean:
        out_B_T = out_B_T + mean
    return out_B_T * m_B_T


def token_level_scores(scores_B: Tensor, mask_B_T: Tensor) -> Tensor:
    """rewards_B_T: the sequence score s_i on the last token with m = 1 of row i, 0 elsewhere (all 0 if no such token)."""
    s_B = scores_B if scores_B.is_floating_point() else scores_B.float()
    m_B_T = mask_B_T > 0
    T = m_B_T.shape[1]
    # argmax of (t + 1) * m picks the last mask-1 position; rows with no such token have their score zeroed.
    last_B = (torch.arange(1, T + 1, device=m_B_T.device) * m_B_T).argmax(-1)
    rewards_B_T = torch.zeros(m_B_T.shape, dtype=s_B.dtype, device=m_B_T.device)
    rewards_B_T[torch.arange(m_B_T.shape[0], device=m_B_T.device), last_B] = s_B * m_B_T.any(-1)
    return rewards_B_T


def group_stats(scores_B: Tensor, group_B: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(mean_B, std_B, size_B): mean, unbiased std and size of the group of each row; group ids are any ints.

    Our choice (ALGORITHMS.md's rule for grpo): a group of size 1 has mean 0 and std 1. size_B is float, like scores.
    """
    s_B = scores_B if scores_B.is_floating_point() else scores_B.float()
    _, inv_B = torch.unique(group_B, return_inverse=True)
    size_G = torch.bincount(inv_B).to(s_B.dtype)
    mean_G = torch.zeros_like(size_G).index_add_(0, inv_B, s_B) / size_G
    sq_G = torch.zeros_like(size_G).index_add_(0, inv_B, (s_B - mean_G[inv_B]) ** 2)
    std_G = (sq_G / (size_G - 1).clamp(min=1)).sqrt()
    single_G = size_G == 1
    mean_G = torch.where(single_G, torch.zeros_like(mean_G), mean_G)
    std_G = torch.where(single_G, torch.ones_like(std_G), std_G)
    return mean_G[inv_B], std_G[inv_B], size_G[inv_B]


@torch.no_grad()
def grpo_advantages(scores_B: Tensor, group_B: Tensor, eps: float = 1e-6) -> Tensor:
    """adv_B = (s_i - mu_g) / (sigma_g + eps); a group of 1 uses mu = 0, sigma = 1; all-equal scores give 0."""
    mean_B, std_B, _ = group_stats(scores_B, group_B)
    return (scores_B - mean_B) / (std_B + eps)


@torch.no_grad()
def dr_grpo_advantages(scores_B: Tensor, group_B: Tensor) -> Tensor:
    """adv_B = s_i - mu_g (Dr.GRPO: no std); a group of 1 uses mu = 0."""
    return scores_B - group_stats(scores_B, group_B)[0]


@torch.no_grad()
def rloo_advantages(scores_B: Tensor, group_B: Tensor) -> Tensor:
    """adv_B = s_i - mean of the other n - 1 responses = n / (n - 1) (s_i - mu_g). Our choice: a group of 1 gives 0."""
    mean_B, _, n_B = group_stats(scores_B, group_B)
    return torch.where(n_B > 1, n_B / (n_B - 1).clamp(min=1) * (scores_B - mean_B), torch.zeros_like(mean_B))


@torch.no_grad()
def reinforce_pp_advantages(rewards_B_T: Tensor, mask_B_T: Tensor, gamma: float = 1.0) -> tuple[Tensor, Tensor]:
    """REINFORCE++: G_t = r_t + gamma G_{t+1} backwards, A = whiten(G) over the masked tokens of the batch.

    Tokens with m = 0 (tool output, padding) are skipped: there G_t = G_{t+1} and r_t is ignored, so gamma discounts
    policy tokens only. Returns (adv_B_T, returns_B_T), both 0 where m = 0.
    """
    m_B_T = mask_B_T > 0
    g_B = torch.zeros_like(rewards_B_T[:, 0])
    returns_B_T = torch.zeros_like(rewards_B_T)
    for t in reversed(range(rewards_B_T.shape[1])):
        g_B = torch.where(m_B_T[:, t], rewards_B_T[:, t] + gamma * g_B, g_B)
        returns_B_T[:, t] = g_B * m_B_T[:, t]
    return whiten(returns_B_T, m_B_T), returns_B_T


@torch.no_grad()
def reinforce_pp_baseline_advantages(scores_B: Tensor, group_B: Tensor, mask_B_T: Tensor) -> Tensor:
    """adv_B_T = whiten((s_i - mu_g) broadcast over the masked tokens); a group of 1 uses mu = 0."""
    return whiten(broadcast_advantages(dr_grpo_advantages(scores_B, group_B), mask_B_T), mask_B_T)


@torch.no_grad()
def gae_advantages(
    rewards_B_T: Tensor,
    values_B_T: Tensor,
    mask_B_T: Tensor,
    gamma: float,
    lam: float | Tensor,
    whiten_advantages: bool = True,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the policy tokens.

    delta_t = r_t + gamma V_next - V_t; A_t = delta_t + gamma lam A_next, backwards. Tokens with m = 0 are skipped:
    "next" is the next mask-1 token of the row (V_next = A_next = 0 after the last one). returns R = A + V (before
    whitening); A is whitened over the masked tokens of the batch if whiten_advantages.

    Args:
        rewards_B_T, values_B_T, mask_B_T: token rewards, critic values (old, no gradient) and the policy mask.
        gamma: discount; lam: a float or a per-row lam_B (VAPO's length-adaptive lambda, see `vapo_lambda`).

    Returns:
        (adv_B_T, returns_B_T), both 0 where m = 0.
    """
    m_B_T = mask_B_T > 0
    lam_B = torch.as_tensor(lam, dtype=values_B_T.dtype, device=values_B_T.device).expand(values_B_T.shape[0])
    next_v_B = torch.zeros_like(values_B_T[:, 0])
    next_a_B = torch.zeros_like(next_v_B)
    adv_B_T = torch.zeros_like(values_B_T)
    for t in reversed(range(values_B_T.shape[1])):
        a_B = rewards_B_T[:, t] + gamma * next_v_B - values_B_T[:, t] + gamma * lam_B * next_a_B
        next_a_B = torch.where(m_B_T[:, t], a_B, next_a_B)
        next_v_B = torch.where(m_B_T[:, t], values_B_T[:, t], next_v_B)
        adv_B_T[:, t] = a_B * m_B_T[:, t]
    returns_B_T = (adv_B_T + values_B_T) * m_B_T
    return (whiten(adv_B_T, m_B_T) if whiten_advantages else adv_B_T), returns_B_T


def vapo_lambda(lengths_B: Tensor, alpha: float = 0.05) -> Tensor:
    """VAPO length-adaptive lam_B = 1 - 1 / (alpha l_i), clamped to [0, 1] (so l_i <= 1 / alpha gives 0)."""
    return (1.0 - 1.0 / (alpha * lengths_B.float())).clamp(0.0, 1.0)


def broadcast_advantages(adv_B: Tensor, mask_B_T: Tensor) -> Tensor:
    """adv_B_T = adv_i on the masked tokens of row i, 0 elsewhere."""
    return torch.where(mask_B_T > 0, adv_B[:, None], torch.zeros((), dtype=adv_B.dtype, device=adv_B.device))


# Inputs by name: gae / vapo (rewards_B_T, values_B_T, mask_B_T, gamma, lam) -> (adv_B_T, returns_B_T), vapo with
# lam = vapo_lambda(lengths_B); reinforce_pp (rewards_B_T, mask_B_T, gamma) -> (adv_B_T, returns_B_T);
# reinforce_pp_baseline (scores_B, group_B, mask_B_T) -> adv_B_T; grpo / dr_grpo / rloo (scores_B, group_B) -> adv_B
# (spread it with `broadcast_advantages`).
ADVANTAGE_ESTIMATORS: dict[str, Callable[..., object]] = {
    "gae": gae_advantages,
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
    "reinforce_pp_baseline": reinforce_pp_baseline_advantages,
    "vapo": gae_advantages,
}


def kl_estimate(logp_B_T: Tensor, ref_logp_B_T: Tensor, kind: str) -> Tensor:
    """Per-token estimate kl_B_T of KL(pi || pi_ref) from d = logp - ref_logp.

    k1 = d; abs = |d|; k2 = 0.5 d^2; k3 = e^x - x - 1 with x = clamp(-d, -20, 20), clamped to [-10, 10].
    """
    d_B_T = logp_B_T - ref_logp_B_T
    if kind == "k1":
        return d_B_T
    if kind == "abs":
        return d_B_T.abs()
    if kind == "k2":
        return 0.5 * d_B_T**2
    if kind == "k3":
        x_B_T = (-d_B_T).clamp(-20.0, 20.0)
        return (x_B_T.exp() - x_B_T - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"kl_estimate: kind={kind!r} is not one of {KL_ESTIMATORS}")


def _count(value: float | None, default: Tensor) -> Tensor | float:
    # Counts below 1 mean there is nothing to average: the numerator is then 0 and so is the loss (never 0 / 0).
    return default.clamp(min=1) if value is None else max(float(value), 1.0)


def aggregate(
    loss_B_T: Tensor,
    mask_B_T: Tensor,
    mode: str,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    t_max: float | None = None,
) -> Tensor:
    """Reduce token losses L_B_T to a 0-dim loss.

    token-mean: sum m L / num_tokens; seq-mean-token-mean: sum_i (sum_t m L / max(sum_t m, 1)) / num_seqs;
    seq-mean-token-sum: sum_i sum_t m L / num_seqs; seq-mean-token-sum-norm: sum_i sum_t m L / (num_seqs t_max).
    Pass the GLOBAL counts over all data-parallel ranks: the per-rank values then sum to the full-batch value.
    Defaults (one rank): num_tokens = sum m; num_seqs = rows with at least one mask-1 token (our choice: empty rows
    contribute 0 and are not counted, in every seq mode); t_max = T. Every denominator is clamped to >= 1.
    """
    m_B_T = mask_B_T.to(loss_B_T.dtype)
    tok_sum_B = (loss_B_T * m_B_T).sum(-1)
    n_B = m_B_T.sum(-1)
    if mode == "token-mean":
        return tok_sum_B.sum() / _count(num_tokens, n_B.sum())
    if mode not in AGG_MODES:
        raise ValueError(f"aggregate: mode={mode!r} is not one of {AGG_MODES}")
    seqs = _count(num_seqs, (n_B > 0).sum().to(loss_B_T.dtype))
    if mode == "seq-mean-token-mean":
        return (tok_sum_B / n_B.clamp(min=1)).sum() / seqs
    if mode == "seq-mean-token-sum":
        return tok_sum_B.sum() / seqs
    return tok_sum_B.sum() / (seqs * max(float(mask_B_T.shape[1] if t_max is None else t_max), 1.0))


def policy_loss(
    logp_B_T: Tensor,
    old_logp_B_T: Tensor,
    adv_B_T: Tensor,
    mask_B_T: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    t_max: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (clip-higher when eps_high > eps_low, optional dual clip), aggregated by `aggregate`.

    rho = exp(clamp(logp - old, -20, 20)); L = max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high)); where A < 0 and
    dual_clip = c (> 1), L = min(L, -A c). old_logp and adv carry no gradient.

    Returns:
        (loss, metrics): loss is 0-dim with graph. metrics are detached masked means over the local tokens:
        clip_frac (the clipped term was taken: -A clip(rho) > -A rho), approx_kl (k2 between old and new policy:
        0.5 (logp - old)^2), ratio_mean, dual_clip_frac (the dual-clip cap was taken).
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"policy_loss: dual_clip must be > 1, got {dual_clip}")
    d_B_T = logp_B_T - old_logp_B_T.detach()
    adv_B_T = adv_B_T.detach()
    ratio_B_T = d_B_T.clamp(-20.0, 20.0).exp()
    unclipped_B_T = -adv_B_T * ratio_B_T
    clipped_B_T = -adv_B_T * ratio_B_T.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss_B_T = torch.maximum(unclipped_B_T, clipped_B_T)
    dual_B_T = torch.zeros_like(loss_B_T, dtype=torch.bool)
    if dual_clip is not None:
        cap_B_T = -adv_B_T * dual_clip
        dual_B_T = (adv_B_T < 0) & (loss_B_T > cap_B_T)
        loss_B_T = torch.where(dual_B_T, cap_B_T, loss_B_T)
    loss = aggregate(loss_B_T, mask_B_T, agg, num_tokens=num_tokens, num_seqs=num_seqs, t_max=t_max)
    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean((clipped_B_T > unclipped_B_T).float(), mask_B_T),
            "approx_kl": masked_mean(0.5 * d_B_T.float() ** 2, mask_B_T),
            "ratio_mean": masked_mean(ratio_B_T.float(), mask_B_T),
            "dual_clip_frac": masked_mean(dual_B_T.float(), mask_B_T),
        }
    return loss, metrics


def gspo_loss(
    logp_B_T: Tensor,
    old_logp_B_T: Tensor,
    adv_B: Tensor,
    mask_B_T: Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    num_seqs: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: the PPO clip applied to a sequence-level ratio, one loss per response.

    s_i = exp(clamp(mean_t (logp - old) over the masked tokens, -20, 20)); L_i = max(-A_i s_i, -A_i clip(s_i,
    1 - eps_low, 1 + eps_high)); loss = sum_i L_i / num_seqs over rows with >= 1 mask-1 token (num_seqs: global count,
    default the local such rows). We use this straight sequence-ratio form of ALGORITHMS.md, not the paper's
    token-level GSPO-token rewrite. Metrics are token-weighted masked means (each row's value on its tokens), so they
    combine across ranks like `policy_loss`'s: clip_frac, approx_kl (0.5 (logp - old)^2), ratio_mean.
    """
    m_B_T = mask_B_T.to(logp_B_T.dtype)
    d_B_T = logp_B_T - old_logp_B_T.detach()
    n_B = m_B_T.sum(-1)
    ratio_B = ((d_B_T * m_B_T).sum(-1) / n_B.clamp(min=1)).clamp(-20.0, 20.0).exp()
    adv_B = adv_B.detach()
    unclipped_B = -adv_B * ratio_B
    clipped_B = -adv_B * ratio_B.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss_B = torch.maximum(unclipped_B, clipped_B) * (n_B > 0)
    loss = loss_B.sum() / _count(num_seqs, (n_B > 0).sum().to(loss_B.dtype))
    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean(broadcast_advantages((clipped_B > unclipped_B).float(), m_B_T), m_B_T),
            "approx_kl": masked_mean(0.5 * d_B_T.float() ** 2, m_B_T),
            "ratio_mean": masked_mean(broadcast_advantages(ratio_B.float(), m_B_T), m_B_T),
        }
    return loss, metrics


def value_loss(
    values_B_T: Tensor,
    old_values_B_T: Tensor,
    returns_B_T: Tensor,
    mask_B_T: Tensor,
    *,
    clip_eps: float | None = 0.2,
    agg: str = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    t_max: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped critic loss 0.5 agg(max((v - R)^2, (clip(v, v_old - eps, v_old + eps) - R)^2)).

    clip_eps=None: no clipping, 0.5 agg((v - R)^2). Returns (loss, metrics) with detached masked means over the
    local tokens: vf_clip_frac (the clipped term was larger), value_mean (v), value_error ((v - R)^2).
    """
    old_B_T, ret_B_T = old_values_B_T.detach(), returns_B_T.detach()
    err_B_T = (values_B_T - ret_B_T) ** 2
    loss_B_T, clipped_frac_B_T = err_B_T, torch.zeros_like(err_B_T)
    if clip_eps is not None:
        clipped_err_B_T = (old_B_T + (values_B_T - old_B_T).clamp(-clip_eps, clip_eps) - ret_B_T) ** 2
        loss_B_T = torch.maximum(err_B_T, clipped_err_B_T)
        clipped_frac_B_T = (clipped_err_B_T > err_B_T).to(err_B_T.dtype)
    loss = 0.5 * aggregate(loss_B_T, mask_B_T, agg, num_tokens=num_tokens, num_seqs=num_seqs, t_max=t_max)
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
