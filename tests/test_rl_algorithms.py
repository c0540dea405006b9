"""RL maths against hand-computed numbers: advantages, whitening, KL estimators, aggregation, policy/value losses."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from posttrain_core.algorithms.advantages import (
    ADVANTAGES,
    AdvantageInputs,
    broadcast_advantages,
    dr_grpo_advantages,
    gae_advantages,
    group_stats,
    grpo_advantages,
    masked_mean,
    masked_sum,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    token_level_rewards,
    vapo_lambda,
    whiten,
)
from posttrain_core.algorithms.losses import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    LossSettings,
    adaptive_kl_coef,
    aggregate,
    clip_policy_loss,
    entropy_from_logits,
    gspo_policy_loss,
    kl_estimate,
    token_logprobs,
    value_loss,
)

AGG_MODES = AGGREGATIONS.names()


def _close(actual: torch.Tensor, expected: list, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def _whitened(values: list[float]) -> list[float]:
    """Reference whitening of a plain list: (x - mean) / unbiased std."""
    mu, sd = statistics.mean(values), statistics.stdev(values)
    return [(v - mu) / sd for v in values]


# Two groups of unequal size with non-contiguous ids: group 7 = [1, 0, 1], group 3 = [2, 4].
SCORES = torch.tensor([1.0, 0.0, 1.0, 2.0, 4.0])
GROUPS = torch.tensor([7, 7, 7, 3, 3])


def test_masked_sum_and_mean():
    x, m = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[1, 0], [1, 1]])
    assert masked_sum(x, m).item() == 8.0
    assert masked_mean(x, m).item() == pytest.approx(8 / 3)
    assert masked_mean(x, torch.zeros(2, 2)).item() == 0.0  # empty mask: 0, not NaN


def test_group_stats():
    mean, std, size = group_stats(SCORES, GROUPS)
    # group 7: mean 2/3, deviations (1/3, -2/3, 1/3), var = (1/9 + 4/9 + 1/9) / 2 = 1/3; group 3: mean 3, var 2
    assert mean.tolist() == pytest.approx([2 / 3] * 3 + [3.0] * 2)
    assert std.tolist() == pytest.approx([math.sqrt(1 / 3)] * 3 + [math.sqrt(2)] * 2)
    assert size.tolist() == [3.0, 3.0, 3.0, 2.0, 2.0]
    mean1, std1, size1 = group_stats(torch.tensor([5.0]), torch.tensor([0]))
    assert (mean1.item(), std1.item(), size1.item()) == (0.0, 1.0, 1.0)  # a group of 1: mu = 0, sigma = 1


def test_grpo_two_groups_unequal_sizes():
    adv = grpo_advantages(SCORES, GROUPS)
    # group 7: (1/3, -2/3, 1/3) / 0.577350 = (0.577350, -1.154701, 0.577350); group 3: (-1, 1) / 1.414214
    assert adv.tolist() == pytest.approx([0.577350, -1.154701, 0.577350, -0.707107, 0.707107], abs=1e-5)


def test_grpo_singleton_group_and_all_equal_group():
    adv = grpo_advantages(torch.tensor([3.0, 1.0, 1.0]), torch.tensor([0, 1, 1]))
    assert adv[0].item() == pytest.approx(3.0 / (1.0 + 1e-6))  # mu = 0, sigma = 1
    assert adv[1:].tolist() == [0.0, 0.0]  # all equal: 0 / (0 + eps) = 0, no NaN
    assert torch.isfinite(adv).all()


def test_dr_grpo():
    assert dr_grpo_advantages(SCORES, GROUPS).tolist() == pytest.approx([1 / 3, -2 / 3, 1 / 3, -1.0, 1.0])
    assert dr_grpo_advantages(torch.tensor([2.5]), torch.tensor([9])).tolist() == [2.5]  # group of 1: mu = 0


def test_rloo_is_leave_one_out():
    adv = rloo_advantages(SCORES, GROUPS)
    # row 0: 1 - mean(0, 1) = 0.5; row 1: 0 - mean(1, 1) = -1; row 3: 2 - 4 = -2; = n/(n-1) (s - mu)
    assert adv.tolist() == pytest.approx([0.5, -1.0, 0.5, -2.0, 2.0])
    assert rloo_advantages(torch.tensor([3.0, 1.0, 2.0]), torch.tensor([0, 1, 1])).tolist() == [0.0, -1.0, 1.0]


def test_token_level_rewards_on_last_mask_token():
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]])
    rewards = token_level_rewards(torch.tensor([2.0, 3.0, -1.0]), mask)
    assert rewards.tolist() == [[0, 0, 0, 2, 0], [0, 0, 0, 0, 0], [-1, 0, 0, 0, 0]]


def test_broadcast_advantages():
    out = broadcast_advantages(torch.tensor([2.0, -1.0]), torch.tensor([[1, 0, 1], [0, 1, 0]]))
    assert out.tolist() == [[2.0, 0.0, 2.0], [0.0, -1.0, 0.0]]


def test_whiten_hand_computed():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    m = torch.tensor([[1, 1, 1, 0]])
    # masked mean 2, unbiased std sqrt((1 + 0 + 1) / 2) = 1; the masked 100 is ignored and set to 0
    _close(whiten(x, m), [[-1.0, 0.0, 1.0, 0.0]], 1e-6)
    _close(whiten(x, m, shift_mean=False), [[1.0, 2.0, 3.0, 0.0]], 1e-6)
    assert whiten(x, torch.tensor([[0, 1, 0, 0]])).tolist() == [[0.0, 0.0, 0.0, 0.0]]  # n = 1: std = 1
    assert whiten(x, torch.zeros(1, 4)).tolist() == [[0.0, 0.0, 0.0, 0.0]]  # n = 0: no NaN


def test_whiten_random_mean0_std1():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, generator=g) * 3 + 5
    m = (torch.rand(4, 6, generator=g) > 0.4).float()
    w = whiten(x, m)
    vals = w[m > 0].tolist()
    assert statistics.mean(vals) == pytest.approx(0.0, abs=1e-5)
    assert statistics.stdev(vals) == pytest.approx(1.0, abs=1e-5)
    assert (w[m == 0] == 0).all()


def test_reinforce_pp_gap_and_padding():
    # row 0: t=2 is tool output (m=0, its reward 9 is ignored), t=4 padding; row 1: right padding.
    rewards = torch.tensor([[0.1, 0.0, 9.0, 1.0, 5.0], [0.0, 0.0, 2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 1, 1, 0, 0]])
    adv, returns = reinforce_pp_advantages(rewards, mask, gamma=0.5)
    # row 0 backwards: G3 = 1; G2 carried = 1; G1 = 0 + 0.5 * 1 = 0.5; G0 = 0.1 + 0.5 * 0.5 = 0.35
    # row 1: G2 = 2; G1 = 1; G0 = 0.5
    _close(returns, [[0.35, 0.5, 0.0, 1.0, 0.0], [0.5, 1.0, 2.0, 0.0, 0.0]], 1e-6)
    w = _whitened([0.35, 0.5, 1.0, 0.5, 1.0, 2.0])
    expected = [[w[0], w[1], 0.0, w[2], 0.0], [w[3], w[4], w[5], 0.0, 0.0]]
    _close(adv, expected, 1e-5)


def test_reinforce_pp_baseline():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    adv = reinforce_pp_baseline_advantages(torch.tensor([1.0, 3.0, 5.0]), torch.tensor([0, 0, 1]), mask)
    # s - mu: group 0 (mean 2) -> -1, 1; group 1 is a singleton (mu = 0) -> 5; spread over tokens, then whitened
    w = _whitened([-1.0, -1.0, 1.0, 5.0, 5.0, 5.0])
    _close(adv, [[w[0], w[1], 0.0], [w[2], 0.0, 0.0], [w[3], w[4], w[5]]], 1e-5)


# One row with a tool-output gap at t=1 and padding at t=4; the values/rewards there must be ignored.
GAE_R = torch.tensor([[0.0, 7.0, 0.0, 1.0, 0.0]])
GAE_V = torch.tensor([[0.5, 100.0, 0.2, 0.4, 50.0]])
GAE_M = torch.tensor([[1, 0, 1, 1, 0]])


def test_gae_one_row_with_gap():
    adv, returns = gae_advantages(GAE_R, GAE_V, GAE_M, gamma=0.9, lam=0.8, whiten_advantages=False)
    # t=3: delta = 1 + 0.9 * 0 - 0.4 = 0.6, A = 0.6
    # t=2: delta = 0 + 0.9 * 0.4 - 0.2 = 0.16, A = 0.16 + 0.72 * 0.6 = 0.592
    # t=0 (next is t=2, across the gap): delta = 0.9 * 0.2 - 0.5 = -0.32, A = -0.32 + 0.72 * 0.592 = 0.10624
    _close(adv, [[0.10624, 0.0, 0.592, 0.6, 0.0]], 1e-6)
    _close(returns, [[0.60624, 0.0, 0.792, 1.0, 0.0]], 1e-6)  # A + V
    adv_w, returns_w = gae_advantages(GAE_R, GAE_V, GAE_M, gamma=0.9, lam=0.8)
    w = _whitened([0.10624, 0.592, 0.6])
    _close(adv_w, [[w[0], 0.0, w[1], w[2], 0.0]], 1e-5)
    torch.testing.assert_close(returns_w, returns)  # returns use the unwhitened A


def test_gae_per_row_lambda():
    r, v, m = GAE_R.repeat(3, 1), GAE_V.repeat(3, 1), GAE_M.repeat(3, 1)
    adv, returns = gae_advantages(r, v, m, gamma=0.9, lam=torch.tensor([0.8, 0.0, 1.0]), whiten_advantages=False)
    assert adv[0].tolist() == pytest.approx([0.10624, 0.0, 0.592, 0.6, 0.0], abs=1e-6)
    assert adv[1].tolist() == pytest.approx([-0.32, 0.0, 0.16, 0.6, 0.0], abs=1e-6)  # lam = 0: A = delta
    # lam = 1, gamma = 0.9: A_t = discounted return - V_t: 0.9^2 * 1 - 0.5 = 0.31, 0.9 - 0.2 = 0.7, 1 - 0.4 = 0.6
    assert adv[2].tolist() == pytest.approx([0.31, 0.0, 0.7, 0.6, 0.0], abs=1e-6)
    assert returns[2].tolist() == pytest.approx([0.81, 0.0, 0.9, 1.0, 0.0], abs=1e-6)


def test_vapo_lambda():
    lam = vapo_lambda(torch.tensor([10, 20, 40, 100, 0]), alpha=0.05)
    # 1 - 1 / (0.05 l): 1 - 2 -> clamp 0; 1 - 1 = 0; 1 - 1/2; 1 - 1/5; l = 0 -> -inf -> clamp 0
    assert lam.tolist() == pytest.approx([0.0, 0.0, 0.5, 0.8, 0.0])


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])  # d = 0.5, -1
    assert kl_estimate(logp, ref, "k1").tolist() == pytest.approx([0.5, -1.0])
    assert kl_estimate(logp, ref, "abs").tolist() == pytest.approx([0.5, 1.0])
    assert kl_estimate(logp, ref, "k2").tolist() == pytest.approx([0.125, 0.5])
    # k3 = e^-d + d - 1: e^-0.5 - 0.5 = 0.106531; e^1 - 2 = 0.718282
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx([0.106531, 0.718282], abs=1e-6)


def test_k3_clamping():
    d = torch.tensor([-30.0, 30.0, 3.0])
    k3 = kl_estimate(d, torch.zeros(3), "k3")
    # d = -30: x = 20, e^20 - 21 -> 10; d = 30: x = -20, e^-20 + 19 -> 10; d = 3: e^-3 + 2 = 2.049787
    assert k3.tolist() == pytest.approx([10.0, 10.0, 2.049787], abs=1e-6)


def test_unknown_names_raise():
    with pytest.raises(ValueError, match="k3"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k4")
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), "sum")
    with pytest.raises(ValueError, match="token-mean"):
        clip_policy_loss(*_zeros4(), LossSettings(loss_agg="seq-sum"))
    with pytest.raises(ValueError, match="dual_clip"):
        clip_policy_loss(*_zeros4(), LossSettings(dual_clip=0.5))
    with pytest.raises(ValueError, match="clip, gspo"):
        POLICY_LOSSES["cispo-typo"]


def _zeros4() -> tuple[torch.Tensor, ...]:
    return torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1)


AGG_L = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
AGG_M = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # the last row has no token


def test_aggregate_modes_by_hand():
    assert aggregate(AGG_L, AGG_M, "token-mean").item() == pytest.approx(7 / 3)  # (1 + 2 + 4) / 3
    assert aggregate(AGG_L, AGG_M, "seq-mean-token-mean").item() == pytest.approx(2.75)  # (1.5 + 4) / 2 rows
    assert aggregate(AGG_L, AGG_M, "seq-mean-token-sum").item() == pytest.approx(3.5)  # (3 + 4) / 2
    assert aggregate(AGG_L, AGG_M, "seq-mean-token-sum-norm").item() == pytest.approx(7 / 6)  # 7 / (2 * 3)
    assert aggregate(AGG_L, AGG_M, "token-mean", num_tokens=10).item() == pytest.approx(0.7)
    assert aggregate(AGG_L, AGG_M, "seq-mean-token-sum-norm", num_seqs=4, t_max=7).item() == pytest.approx(0.25)
    assert aggregate(AGG_L, torch.zeros(3, 3), "seq-mean-token-mean").item() == 0.0  # nothing to average: 0


def _shards(B: int, n: int) -> list[slice]:
    bounds = [round(i * B / n) for i in range(n + 1)]
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _random_batch(B: int = 6, T: int = 5):
    g = torch.Generator().manual_seed(1)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[2] = 0  # an empty row
    return torch.randn(B, T, generator=g), mask, g


@pytest.mark.parametrize("n_workers", [2, 3])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_invariant_to_dp_workers(mode, n_workers):
    L, mask, _ = _random_batch()
    counts = {"num_tokens": float(mask.sum()), "num_seqs": float((mask.sum(-1) > 0).sum()), "t_max": 5.0}
    full = aggregate(L, mask, mode)
    assert aggregate(L, mask, mode, **counts).item() == pytest.approx(full.item())  # the defaults are these counts
    shard_sum = sum(aggregate(L[s], mask[s], mode, **counts) for s in _shards(6, n_workers))
    assert shard_sum.item() == pytest.approx(full.item(), abs=1e-6)


@pytest.mark.parametrize("n_workers", [2, 3])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_policy_and_value_losses_invariant_to_dp_workers(mode, n_workers):
    L, mask, g = _random_batch()
    logp, old, adv = -torch.rand(6, 5, generator=g), -torch.rand(6, 5, generator=g), L
    counts = {"num_tokens": float(mask.sum()), "num_seqs": float((mask.sum(-1) > 0).sum()), "t_max": 5.0}
    shards = _shards(6, n_workers)
    local = LossSettings(clip_low=0.2, clip_high=0.28, dual_clip=3.0, loss_agg=mode)
    glob = LossSettings(clip_low=0.2, clip_high=0.28, dual_clip=3.0, loss_agg=mode, **counts)
    full = clip_policy_loss(logp, old, adv, mask, local)[0]
    parts = sum(clip_policy_loss(logp[s], old[s], adv[s], mask[s], glob)[0] for s in shards)
    assert parts.item() == pytest.approx(full.item(), rel=1e-6, abs=1e-6)
    full_v = value_loss(logp, old, adv, mask, local)[0]
    parts_v = sum(value_loss(logp[s], old[s], adv[s], mask[s], glob)[0] for s in shards)
    assert parts_v.item() == pytest.approx(full_v.item(), rel=1e-6, abs=1e-6)  # token-sum: not normalised
    adv_B_T = broadcast_advantages(adv[:, 0], mask)
    full_g = gspo_policy_loss(logp, old, adv_B_T, mask, local)[0]
    parts_g = sum(gspo_policy_loss(logp[s], old[s], adv_B_T[s], mask[s], glob)[0] for s in shards)
    assert parts_g.item() == pytest.approx(full_g.item(), abs=1e-6)


def _logp_for(ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp with grad, old = 0) so that exp(logp - old) = the given ratios, one row."""
    return torch.tensor([[math.log(r) for r in ratios]], requires_grad=True), torch.zeros(1, len(ratios))


def test_policy_loss_clipping_cases():
    # (A, rho): (1, 1.5) clipped to 1.2; (-1, 0.5) clipped to 0.8; (2, 1.1) inside; (-1, 1.5) not clipped (A < 0
    # with a high ratio keeps -A rho); (1, 0.5) not clipped (A > 0 with a low ratio keeps -A rho).
    ratios = [1.5, 0.5, 1.1, 1.5, 0.5]
    logp, old = _logp_for(ratios)
    adv = torch.tensor([[1.0, -1.0, 2.0, -1.0, 1.0]])
    loss, info = clip_policy_loss(logp, old, adv, torch.ones(1, 5))
    # L = (-1.2, 0.8, -2.2, 1.5, -0.5), token-mean: -1.6 / 5
    assert loss.item() == pytest.approx(-0.32)
    assert info["clip_frac"].item() == pytest.approx(0.4)
    assert info["ratio_mean"].item() == pytest.approx(5.1 / 5)
    assert info["approx_kl"].item() == pytest.approx(sum(0.5 * math.log(r) ** 2 for r in ratios) / 5)
    assert info["dual_clip_frac"].item() == 0.0
    loss.backward()
    # dL/dlogp = -A rho where unclipped, 0 where clipped; / 5 tokens
    _close(logp.grad, [[0.0, 0.0, -2.2 / 5, 1.5 / 5, -0.5 / 5]], 1e-6)


def test_policy_loss_dual_clip():
    logp, old = _logp_for([5.0, 2.0, 5.0])
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    loss, info = clip_policy_loss(logp, old, adv, torch.ones(1, 3), LossSettings(dual_clip=3.0))
    # (A=-1, rho=5): max(5, 1.2) = 5 capped at 3; (A=-1, rho=2): 2 < 3 kept; (A=1, rho=5): -1.2, no dual clip
    assert loss.item() == pytest.approx((3.0 + 2.0 - 1.2) / 3)
    assert info["dual_clip_frac"].item() == pytest.approx(1 / 3)
    assert info["clip_frac"].item() == pytest.approx(1 / 3)
    loss.backward()
    _close(logp.grad, [[0.0, 2.0 / 3, 0.0]], 1e-6)
    no_dual, _ = clip_policy_loss(logp, old, adv, torch.ones(1, 3))
    assert no_dual.item() == pytest.approx((5.0 + 2.0 - 1.2) / 3)


def test_policy_loss_clip_higher():
    logp, old = _logp_for([1.25, 1.3, 0.75])
    adv, mask = torch.tensor([[1.0, 1.0, -1.0]]), torch.ones(1, 3)
    sym, _ = clip_policy_loss(logp, old, adv, mask, LossSettings(clip_low=0.2, clip_high=0.2))
    high, info = clip_policy_loss(logp, old, adv, mask, LossSettings(clip_low=0.2, clip_high=0.28))
    assert sym.item() == pytest.approx((-1.2 - 1.2 + 0.8) / 3)  # all three clipped
    assert high.item() == pytest.approx((-1.25 - 1.28 + 0.8) / 3)  # 1.25 < 1.28 is no longer clipped
    assert info["clip_frac"].item() == pytest.approx(2 / 3)


def test_gspo_sequence_ratio():
    # row 0: mean d over its 2 tokens = 0.2 (the masked 99 is ignored), s = e^0.2 = 1.221403, A = 1
    # row 1: s = e^-0.05 = 0.951229, A = -2; row 2 has no token (excluded, A = 5 ignored)
    logp = torch.tensor([[0.1, 0.3, 99.0], [-0.05, 0.0, 0.0], [0.0, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    old, adv = torch.zeros(3, 3), broadcast_advantages(torch.tensor([1.0, -2.0, 5.0]), mask)
    loss, info = gspo_policy_loss(logp, old, adv, mask, LossSettings(clip_low=0.2, clip_high=0.2))
    # L_0 = max(-1.221403, -1.2) = -1.2 (clipped); L_1 = max(1.902459, 2 * 0.951229) = 1.902459; / 2 sequences
    assert loss.item() == pytest.approx((-1.2 + 1.902459) / 2, abs=1e-6)
    assert info["clip_frac"].item() == pytest.approx(2 / 3)  # row 0's two tokens out of three
    loss.backward()
    # row 1: d/dlogp (-A s) / 2 = 2 * s * (1 / 1 token) / 2 = s; row 0 clipped: 0
    assert logp.grad[1, 0].item() == pytest.approx(0.951229, abs=1e-6)
    assert logp.grad[0].abs().sum().item() == 0.0
    paper = LossSettings(clip_low=3e-4, clip_high=4e-4)
    default, info_d = gspo_policy_loss(logp, old, adv, mask, paper)  # both clipped: -1.0004 and 2 * 0.9997
    assert default.item() == pytest.approx((-1.0004 + 1.9994) / 2, abs=1e-6)
    assert info_d["clip_frac"].item() == pytest.approx(1.0)


V = torch.tensor([[1.0, 2.0, 0.5, 5.0]])
V_OLD = torch.tensor([[0.9, 1.5, 0.0, 5.0]])
RET = torch.tensor([[1.2, 1.0, 1.0, 0.0]])
V_MASK = torch.tensor([[1, 1, 1, 0]])


def test_value_loss_clipped_and_unclipped():
    loss, info = value_loss(V, V_OLD, RET, V_MASK, value_clip=0.2)
    # t0: (1 - 1.2)^2 = 0.04, clip(1.0, 0.7, 1.1) = 1.0 -> 0.04; t1: 1 vs (1.7 - 1)^2 = 0.49 -> 1;
    # t2: (0.5 - 1)^2 = 0.25 vs (clip(0.5, -0.2, 0.2) - 1)^2 = 0.64 -> 0.64 (clipped); t3 masked
    assert loss.item() == pytest.approx(0.5 * (0.04 + 1.0 + 0.64) / 3)
    assert info["vf_clip_frac"].item() == pytest.approx(1 / 3)
    assert info["value_mean"].item() == pytest.approx(3.5 / 3)
    assert info["value_error"].item() == pytest.approx((0.04 + 1.0 + 0.25) / 3)
    plain, info_p = value_loss(V, V_OLD, RET, V_MASK, value_clip=None)
    assert plain.item() == pytest.approx(0.5 * (0.04 + 1.0 + 0.25) / 3)
    assert info_p["vf_clip_frac"].item() == 0.0


def test_entropy_from_logits():
    _close(entropy_from_logits(torch.zeros(2, 3, 7)), [[math.log(7)] * 3] * 2)
    # p = (0.25, 0.75): -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.562335; a -inf logit contributes 0, not NaN
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, -math.inf]]], requires_grad=True)
    h = entropy_from_logits(logits)
    _close(h, [[0.562335, 0.0]], 1e-6)
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()
    assert entropy_from_logits(torch.zeros(1, 1, 4, dtype=torch.bfloat16)).dtype == torch.float32


def test_token_logprobs():
    logits = torch.tensor([[[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0], [5.0, 5.0, 5.0, 5.0]]])
    labels = torch.tensor([[3, 0, -100]])
    # 4 - logsumexp(1, 2, 3, 4) = 4 - 4.4401897; uniform: -log 4; label -100 -> 0
    _close(token_logprobs(logits, labels), [[4 - 4.4401897, -math.log(4), 0.0]], 1e-6)
    with pytest.raises(ValueError, match="do not match"):
        token_logprobs(logits, labels[:, :2])


def test_adaptive_kl_coef_both_clip_ends():
    # n_steps / horizon = 64 / 640 = 0.1
    assert adaptive_kl_coef(0.1, kl=2.0, target=1.0, n_steps=64, horizon=640) == pytest.approx(0.102)  # +0.2 cap
    assert adaptive_kl_coef(0.1, kl=0.0, target=1.0, n_steps=64, horizon=640) == pytest.approx(0.098)  # -0.2 cap
    assert adaptive_kl_coef(0.1, kl=1.05, target=1.0, n_steps=64, horizon=640) == pytest.approx(0.1005)


def test_registered_advantages_equal_their_pure_functions():
    """Each registered estimator (one signature: AdvantageInputs -> (adv_B_T, returns_B_T | None)) computes what its
    pure function does; the critic's estimators refuse to run without values."""
    r_B_T = token_level_rewards(SCORES, torch.ones(5, 3))
    mask = torch.ones(5, 3)
    values = torch.rand(5, 3, generator=torch.Generator().manual_seed(0))
    inp = AdvantageInputs(r_B_T, mask, GROUPS, values, gamma=0.9, lam=0.8, critic_lam=1.0)
    torch.testing.assert_close(ADVANTAGES["grpo"](inp)[0], broadcast_advantages(grpo_advantages(SCORES, GROUPS), mask))
    torch.testing.assert_close(ADVANTAGES["rloo"](inp)[0], broadcast_advantages(rloo_advantages(SCORES, GROUPS), mask))
    adv, returns = ADVANTAGES["gae"](inp)
    torch.testing.assert_close(adv, gae_advantages(r_B_T, values, mask, 0.9, 0.8)[0])
    torch.testing.assert_close(returns, gae_advantages(r_B_T, values, mask, 0.9, 1.0, whiten_advantages=False)[1])
    with pytest.raises(ValueError, match="'vapo' needs critic values"):
        ADVANTAGES["vapo"](AdvantageInputs(r_B_T, mask, GROUPS))
    assert set(ADVANTAGES) >= {"gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "vapo"}
    assert set(KL_ESTIMATORS) >= {"k1", "abs", "k2", "k3"} and set(POLICY_LOSSES) >= {"clip", "gspo"}


def test_dynamic_sampling_stops_when_filled_and_gives_up_only_with_nothing():
    from posttrain_core.train.rl_plan import DynamicSamplingError, check_dynamic_sampling

    assert check_dynamic_sampling([(5, 8), (3, 8)], want=8, max_gen_batches=3)  # filled after 2 batches
    assert not check_dynamic_sampling([(2, 8)], want=8, max_gen_batches=3)  # sample another batch
    assert check_dynamic_sampling([(1, 8), (0, 8), (2, 8)], want=8, max_gen_batches=3)  # 3 groups: train on them
    with pytest.raises(DynamicSamplingError, match=r"only 0 of the 8 wanted prompts .*\(24 prompts sampled"):
        check_dynamic_sampling([(0, 8), (0, 8), (0, 8)], want=8, max_gen_batches=3)


@pytest.mark.parametrize("value", [0.7, 2.7, 1 / 3])
def test_equal_rewards_give_exactly_zero_advantages(value):
    """No signal, no step: a group (and for the batch-whitened estimators, a batch) of equal rewards that are not
    exact binary fractions gives advantages of exactly 0, not float32 rounding error divided by a std of rounding
    error (which gave full-size advantages of one arbitrary sign)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 9, (16,), generator=g)
    mask = (torch.arange(8)[None, :] < lengths[:, None]).float()
    rewards = torch.full((16,), value, dtype=torch.float32)
    inp = AdvantageInputs(token_level_rewards(rewards, mask), mask, torch.zeros(16, dtype=torch.long))
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"):
        adv, _ = ADVANTAGES[name](inp)
        assert adv.dtype == torch.float32
        assert adv.abs().max().item() == 0.0, (name, adv.abs().max().item())
    # two groups, each of one value: the group estimators still give 0
    two = torch.cat([torch.full((8,), value), torch.full((8,), 2 * value)])
    groups = torch.tensor([0] * 8 + [1] * 8)
    for name in ("grpo", "dr_grpo", "rloo"):
        assert ADVANTAGES[name](AdvantageInputs(token_level_rewards(two, mask), mask, groups))[0].abs().max() == 0


def test_a_batch_without_signal_gives_a_zero_policy_gradient():
    mask = torch.ones(16, 4)
    rewards = torch.full((16,), 0.7)
    adv, _ = ADVANTAGES["grpo"](AdvantageInputs(token_level_rewards(rewards, mask), mask, torch.zeros(16).long()))
    logp = (-torch.rand(16, 4, generator=torch.Generator().manual_seed(1))).requires_grad_()
    loss, _ = clip_policy_loss(logp, logp.detach() + 0.1, adv, mask, LossSettings(dual_clip=3.0))
    loss.backward()
    assert loss.item() == 0.0 and logp.grad.abs().max().item() == 0.0


def test_cispo_weights_every_token_by_its_clipped_ratio():
    """CISPO: L = -sg(clip(rho, 1 - low, 1 + high)) A logp, token-mean. Unlike the clip loss, a clipped token keeps a
    gradient (the clipped weight times A); at rho = 1 both losses have the same gradient."""
    ratios = [1.5, 0.5, 1.1]
    logp, old = _logp_for(ratios)
    adv, mask = torch.tensor([[1.0, -1.0, 2.0]]), torch.ones(1, 3)
    loss, info = POLICY_LOSSES["cispo"](logp, old, adv, mask, LossSettings(clip_low=0.2, clip_high=0.28))
    w = [1.28, 0.8, 1.1]  # clip(rho, 0.8, 1.28)
    assert loss.item() == pytest.approx(
        -sum(wi * a * math.log(r) for wi, a, r in zip(w, [1, -1, 2], ratios, strict=True)) / 3
    )
    assert info["clip_frac"].item() == pytest.approx(2 / 3)
    loss.backward()
    _close(logp.grad, [[-1.28 / 3, 0.8 / 3, -2.2 / 3]], 1e-6)  # dL/dlogp = -w A / 3: every token has a gradient
    at_one, old1 = _logp_for([1.0, 1.0, 1.0])
    clip_at_one = at_one.detach().clone().requires_grad_()
    POLICY_LOSSES["cispo"](at_one, old1, adv, mask)[0].backward()
    clip_policy_loss(clip_at_one, old1, adv, mask)[0].backward()
    torch.testing.assert_close(at_one.grad, clip_at_one.grad)


def test_importance_sampling_is_the_unclipped_ratio_times_the_advantage():
    """L = -rho A (no clip), here with token-sum: -(1.5 * 1 + 0.5 * -1 + 1.1 * 2); dL/dlogp = -rho A."""
    ratios = [1.5, 0.5, 1.1]
    logp, old = _logp_for(ratios)
    adv, mask = torch.tensor([[1.0, -1.0, 2.0]]), torch.ones(1, 3)
    loss, info = POLICY_LOSSES["importance_sampling"](logp, old, adv, mask, LossSettings(loss_agg="token-sum"))
    assert loss.item() == pytest.approx(-(1.5 - 0.5 + 2.2))
    assert info["ratio_mean"].item() == pytest.approx(3.1 / 3)
    loss.backward()
    _close(logp.grad, [[-1.5, 0.5, -2.2]], 1e-6)


def test_token_sum_is_never_normalised():
    L = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert aggregate(L, mask, "token-sum").item() == 7.0
    assert aggregate(L, mask, "token-sum", num_tokens=100.0, num_seqs=9.0, t_max=50.0).item() == 7.0


def test_user_functions_are_found_by_reference(tmp_path):
    """A registry takes 'path/to/file.py:function' (or 'package.module:function') besides its own names."""
    (tmp_path / "my_loss.py").write_text(
        "def half_clip(logp, old, adv, mask, settings=None):\n"
        "    from posttrain_core.algorithms.losses import LossSettings, clip_policy_loss\n"
        "    loss, info = clip_policy_loss(logp, old, adv, mask, settings or LossSettings())\n"
        "    return 0.5 * loss, info\n"
    )
    fn = POLICY_LOSSES[f"{tmp_path}/my_loss.py:half_clip"]
    args = (torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))
    assert fn(*args)[0].item() == pytest.approx(0.5 * clip_policy_loss(*args)[0].item())
    with pytest.raises(ValueError, match="has no 'nope'"):
        POLICY_LOSSES[f"{tmp_path}/my_loss.py:nope"]
    with pytest.raises(ValueError, match="unknown policy loss 'clp'.*path/to/file.py:function"):
        POLICY_LOSSES["clp"]
