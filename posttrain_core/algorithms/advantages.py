"""Advantage estimators: pure tensor functions with the formula and the shapes in each docstring, and their registry.

Definitions: docs/algorithms.md. Every estimator is registered in `ADVANTAGES` with one signature,
`fn(AdvantageInputs) -> (adv_B_T, returns_B_T | None)`, so the RL update looks it up by the config's name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain_core.algorithms.registry import Registry

Tensor = torch.Tensor


def masked_sum(x_B_T: Tensor, mask_B_T: Tensor) -> Tensor:
    """sum(m x) over the whole batch, a 0-dim tensor."""
    return (x_B_T * mask_B_T.to(x_B_T.dtype)).sum()


def masked_mean(x_B_T: Tensor, mask_B_T: Tensor) -> Tensor:
    """sum(m x) / max(sum m, 1), a 0-dim tensor (0 when the mask is empty)."""
    return masked_sum(x_B_T, mask_B_T) / mask_B_T.to(x_B_T.dtype).sum().clamp(min=1)


def _float_dtype(x: Tensor) -> torch.dtype:
    return x.dtype if x.is_floating_point() else torch.float32


def whiten(x_B_T: Tensor, mask_B_T: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x - mean_m(x)) / (std_m(x) + eps) over the masked tokens of the whole batch; 0 where m = 0.

    std is unbiased (n - 1) over the n masked tokens. Our choice: with n <= 1 std = 1 (x - mean is then 0 anyway), so
    the result is finite. shift_mean=False adds the mean back: only the spread is rescaled. Computed in float64 and
    returned in x's dtype: a batch of equal values has a mean of exactly that value (a float32 sum would carry a
    rounding error, which divided by a std of pure rounding error gives full-size values of one arbitrary sign).
    """
    x64, m64 = x_B_T.double(), mask_B_T.double()
    n = m64.sum()
    mean = masked_mean(x64, m64)
    var = (((x64 - mean) ** 2) * m64).sum() / (n - 1).clamp(min=1)
    std = torch.where(n > 1, var.sqrt(), torch.ones_like(var))
    out_B_T = (x64 - mean) / (std + eps)
    if not shift_mean:
        out_B_T = out_B_T + mean
    return (out_B_T * m64).to(_float_dtype(x_B_T))


def token_level_rewards(rewards_B: Tensor, mask_B_T: Tensor) -> Tensor:
    """rewards_B_T: the sequence reward s_i on the last token with m = 1 of row i, 0 elsewhere (all 0 if no such
    token)."""
    s_B = rewards_B if rewards_B.is_floating_point() else rewards_B.float()
    m_B_T = mask_B_T > 0
    T = m_B_T.shape[1]
    # argmax of (t + 1) * m picks the last mask-1 position; rows with no such token have their score zeroed.
    last_B = (torch.arange(1, T + 1, device=m_B_T.device) * m_B_T).argmax(-1)
    rewards_B_T = torch.zeros(m_B_T.shape, dtype=s_B.dtype, device=m_B_T.device)
    rewards_B_T[torch.arange(m_B_T.shape[0], device=m_B_T.device), last_B] = s_B * m_B_T.any(-1)
    return rewards_B_T


def group_stats(rewards_B: Tensor, group_B: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(mean_B, std_B, size_B): mean, unbiased std and size of the group of each row; group ids are any ints.

    Our choice (docs/algorithms.md, grpo): a group of size 1 has mean 0 and std 1. All three are float64: a group of
    equal rewards has a mean of exactly their value and a std of exactly 0, whatever the value (0.7, 1/3).
    """
    s_B = rewards_B.double()
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
def grpo_advantages(rewards_B: Tensor, group_B: Tensor, eps: float = 1e-6) -> Tensor:
    """adv_B = (s_i - mu_g) / (sigma_g + eps); a group of 1 uses mu = 0, sigma = 1; all-equal rewards give 0."""
    mean_B, std_B, _ = group_stats(rewards_B, group_B)
    return ((rewards_B.double() - mean_B) / (std_B + eps)).to(_float_dtype(rewards_B))


@torch.no_grad()
def dr_grpo_advantages(rewards_B: Tensor, group_B: Tensor) -> Tensor:
    """adv_B = s_i - mu_g (Dr.GRPO: no std); a group of 1 uses mu = 0."""
    return (rewards_B.double() - group_stats(rewards_B, group_B)[0]).to(_float_dtype(rewards_B))


@torch.no_grad()
def rloo_advantages(rewards_B: Tensor, group_B: Tensor) -> Tensor:
    """adv_B = s_i - mean of the other n - 1 responses = n / (n - 1) (s_i - mu_g). Our choice: a group of 1 gives 0."""
    mean_B, _, n_B = group_stats(rewards_B, group_B)
    adv_B = torch.where(n_B > 1, n_B / (n_B - 1).clamp(min=1) * (rewards_B.double() - mean_B), torch.zeros_like(mean_B))
    return adv_B.to(_float_dtype(rewards_B))


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
def reinforce_pp_baseline_advantages(rewards_B: Tensor, group_B: Tensor, mask_B_T: Tensor) -> Tensor:
    """adv_B_T = whiten((s_i - mu_g) broadcast over the masked tokens); a group of 1 uses mu = 0."""
    return whiten(broadcast_advantages(dr_grpo_advantages(rewards_B, group_B), mask_B_T), mask_B_T)


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


# ------------------------------------------------------------------------------------------------ the registry
@dataclass(frozen=True)
class AdvantageInputs:
    """What an advantage estimator may use, for a batch of B responses in response coordinates (B x T).

    rewards_B_T: token rewards: each response's reward on its last policy token, minus the KL penalty on every token
        when the KL is placed in the reward. mask_B_T: the response mask (1 on tokens the policy generated).
    group_B: responses with the same id answer the same prompt. values_B_T: the critic's values (None without one).
    gamma, lam: discount and GAE lambda of the policy advantages; critic_lam: GAE lambda of the value targets;
    vapo_alpha: VAPO's length-adaptive lambda scale. sampler_logp_B_T / teacher_logp_B_T: the sampling engine's and
    the teacher's log-probs of the sampled tokens (on-policy distillation; None without a teacher), distill_coef,
    distill_discount, task_weight, task_advantage: its settings (`DistillConfig`). process_B_T: the implicit PRM's
    process rewards (PRIME; None without one), prime_gt_coef, prime_dpo_coef, prime_norm: its settings
    (`PrimeConfig`).
    """

    rewards_B_T: Tensor
    mask_B_T: Tensor
    group_B: Tensor
    values_B_T: Tensor | None = None
    gamma: float = 1.0
    lam: float = 0.95
    critic_lam: float = 0.95
    vapo_alpha: float = 0.05
    sampler_logp_B_T: Tensor | None = None
    teacher_logp_B_T: Tensor | None = None
    distill_coef: float = 1.0
    distill_discount: float = 0.0
    task_weight: float = 0.0
    task_advantage: str = "grpo"
    process_B_T: Tensor | None = None
    prime_gt_coef: float = 5.0
    prime_dpo_coef: float = 5.0
    prime_norm: str = "batch_norm"

    @property
    def sequence_rewards_B(self) -> Tensor:
        """s_i = sum_t m r_t: what the sequence-level estimators compare within a group."""
        return (self.rewards_B_T * self.mask_B_T).sum(-1)


ADVANTAGES: Registry = Registry("advantage estimator")
register_advantage = ADVANTAGES.register


def _critic_values(inp: AdvantageInputs, name: str) -> Tensor:
    if inp.values_B_T is None:
        raise ValueError(f"advantage estimator {name!r} needs critic values")
    return inp.values_B_T


@register_advantage("gae")
def gae(inp: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """PPO: whitened GAE(gamma, lam) advantages; value targets from GAE(gamma, critic_lam)."""
    values = _critic_values(inp, "gae")
    adv, _ = gae_advantages(inp.rewards_B_T, values, inp.mask_B_T, inp.gamma, inp.lam)
    _, returns = gae_advantages(
        inp.rewards_B_T, values, inp.mask_B_T, inp.gamma, inp.critic_lam, whiten_advantages=False
    )
    return adv, returns


@register_advantage("vapo")
def vapo(inp: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """VAPO: GAE with the length-adaptive lam_i = 1 - 1/(alpha l_i) for the policy; value targets with critic_lam."""
    values = _critic_values(inp, "vapo")
    lam_B = vapo_lambda(inp.mask_B_T.sum(-1), inp.vapo_alpha)
    adv, _ = gae_advantages(inp.rewards_B_T, values, inp.mask_B_T, inp.gamma, lam_B)
    _, returns = gae_advantages(
        inp.rewards_B_T, values, inp.mask_B_T, inp.gamma, inp.critic_lam, whiten_advantages=False
    )
    return adv, returns


@register_advantage("grpo")
def grpo(inp: AdvantageInputs) -> tuple[Tensor, None]:
    return broadcast_advantages(grpo_advantages(inp.sequence_rewards_B, inp.group_B), inp.mask_B_T), None


@register_advantage("dr_grpo")
def dr_grpo(inp: AdvantageInputs) -> tuple[Tensor, None]:
    return broadcast_advantages(dr_grpo_advantages(inp.sequence_rewards_B, inp.group_B), inp.mask_B_T), None


@register_advantage("rloo")
def rloo(inp: AdvantageInputs) -> tuple[Tensor, None]:
    return broadcast_advantages(rloo_advantages(inp.sequence_rewards_B, inp.group_B), inp.mask_B_T), None


@register_advantage("reinforce_pp")
def reinforce_pp(inp: AdvantageInputs) -> tuple[Tensor, None]:
    return reinforce_pp_advantages(inp.rewards_B_T, inp.mask_B_T, inp.gamma)[0], None


@register_advantage("reinforce_pp_baseline")
def reinforce_pp_baseline(inp: AdvantageInputs) -> tuple[Tensor, None]:
    return reinforce_pp_baseline_advantages(inp.sequence_rewards_B, inp.group_B, inp.mask_B_T), None


@register_advantage("opd")
def opd(inp: AdvantageInputs) -> tuple[Tensor, None]:
    """On-policy distillation: -coef (log pi(y_t) - log pi_teacher(y_t)) per token (discounted over later tokens),
    plus task_weight times the task reward's advantage (`distill.opd_advantages`)."""
    from posttrain_core.algorithms.distill import opd_advantages  # distill -> losses -> this module

    if inp.teacher_logp_B_T is None or inp.sampler_logp_B_T is None:
        raise ValueError("advantage estimator 'opd' needs the teacher's log-probs (rl.distill)")
    task = ADVANTAGES[inp.task_advantage](inp)[0] if inp.task_weight else None
    return opd_advantages(
        inp.sampler_logp_B_T, inp.teacher_logp_B_T, inp.mask_B_T, inp.distill_coef, inp.distill_discount, task,
        inp.task_weight,
    ), None  # fmt: skip


@register_advantage("prime")
def prime(inp: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """PRIME: RLOO of the outcome x gt_coef on the last token plus RLOO of the process rewards x dpo_coef, summed
    backwards and whitened (`prime.prime_advantages`); without process rewards, the outcome part alone."""
    from posttrain_core.algorithms.prime import prime_advantages

    return prime_advantages(
        inp.sequence_rewards_B, inp.process_B_T, inp.mask_B_T, inp.group_B, inp.prime_gt_coef, inp.prime_dpo_coef,
        inp.prime_norm,
    )[0], None  # fmt: skip


@register_advantage("none")
def no_advantage(inp: AdvantageInputs) -> tuple[Tensor, None]:
    """0 everywhere: no policy-gradient term (GKD's supervised loss alone)."""
    return torch.zeros_like(inp.rewards_B_T, dtype=torch.float32), None
