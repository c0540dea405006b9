"""PRIME (process reinforcement through implicit rewards): the implicit process reward model's scores, its
cross-entropy loss, its ranking accuracy, the `prime` advantage, and the accuracy-band filter of prompts.

Pure tensor functions; definitions and where posttrain departs from the reference recipe: docs/algorithms.md, PRIME.
The implicit PRM is a causal LM pi_phi scored against a frozen reference pi_ref; on response token t of row i

    q_t = log pi_phi(y_t | y_<t) - log pi_ref(y_t | y_<t)        (0 where the mask is 0: tool output, padding)
    r_t = beta q_t                                              (the process reward of token t)

and its sequence score beta sum_t q_t is trained as a logit of the outcome (`prm_loss`), so the per-token credit is
learned from 0/1 outcomes alone, without labelled steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from posttrain_core.algorithms.advantages import group_stats, reinforce_pp_advantages, rloo_advantages

Tensor = torch.Tensor


def implicit_rewards(logp_B_T: Tensor, ref_B_T: Tensor, mask_B_T: Tensor, beta: float) -> Tensor:
    """r_B_T = beta (log pi_phi - log pi_ref) on the masked tokens, 0 elsewhere (keeps the graph of logp)."""
    return beta * (logp_B_T - ref_B_T) * (mask_B_T > 0).to(logp_B_T.dtype)


def prm_loss(logp_B_T: Tensor, ref_B_T: Tensor, mask_B_T: Tensor, correct_B: Tensor, beta: float,
             num_rows: float) -> Tensor:  # fmt: skip
    """The PRM's cross-entropy: sum_i BCE(sigmoid(beta sum_t q_it), correct_i) / num_rows.

    num_rows is the whole batch's row count (not this micro-batch's), so the sum over micro-batches and ranks is the
    batch mean whatever the split.
    """
    score_B = implicit_rewards(logp_B_T, ref_B_T, mask_B_T, beta).sum(-1)
    return F.binary_cross_entropy_with_logits(score_B, correct_B.to(score_B.dtype), reduction="sum") / num_rows


def ranking_accuracy(score_B: Tensor, correct_B: Tensor, group_B: Tensor) -> float | None:
    """Over every (correct, wrong) pair of rows answering the same prompt: the share the PRM ranks the right way
    (score of the correct row above the wrong one's; a tie counts half). None when no group has both outcomes."""
    s, c, g = score_B.double(), correct_B.bool(), group_B
    same = g[:, None] == g[None, :]
    pairs = same & c[:, None] & ~c[None, :]  # row i correct, row j wrong, same prompt
    n = int(pairs.sum())
    if n == 0:
        return None
    diff = s[:, None] - s[None, :]
    won = ((diff > 0).double() + 0.5 * (diff == 0).double())[pairs].sum()
    return float(won / n)


def batch_norm(rewards_B_T: Tensor, mask_B_T: Tensor) -> Tensor:
    """r / (max over the batch of |sum_{s >= t} r_s| + 1e-6): the largest process return becomes ~1 in size."""
    m = (mask_B_T > 0).to(rewards_B_T.dtype)
    r = rewards_B_T * m
    returns_B_T = torch.flip(torch.cumsum(torch.flip(r, dims=[1]), dim=1), dims=[1])
    return r / (returns_B_T.abs().max() + 1e-6)


def process_rloo(rewards_B_T: Tensor, mask_B_T: Tensor, group_B: Tensor) -> Tensor:
    """Leave-one-out baseline of the process rewards: r_it - mean_{j != i} mbar_j, where mbar_j is row j's mean
    reward per masked token and j runs over the other rows of i's group; 0 where the mask is 0. A row alone in its
    group keeps r_it (it has no other row to compare with)."""
    m = (mask_B_T > 0).to(torch.float64)
    r = rewards_B_T.double() * m
    mbar_B = r.sum(-1) / m.sum(-1).clamp(min=1)
    mean_B, _, n_B = group_stats(mbar_B, group_B)  # mean over the whole group, its size
    others_B = torch.where(n_B > 1, (mean_B * n_B - mbar_B) / (n_B - 1).clamp(min=1), torch.zeros_like(mean_B))
    return ((r - others_B[:, None]) * m).to(rewards_B_T.dtype)


@torch.no_grad()
def prime_advantages(outcome_B: Tensor, process_B_T: Tensor | None, mask_B_T: Tensor, group_B: Tensor,
                     gt_coef: float, dpo_coef: float, norm: str = "batch_norm") -> tuple[Tensor, Tensor]:  # fmt: skip
    """PRIME's advantage: gt_coef RLOO(outcome) on the last policy token, plus dpo_coef RLOO(process rewards) on
    every policy token; then the return sum_{s >= t} over the policy tokens (gamma = 1) and whitening over the batch.

    Args:
        outcome_B: each row's sequence reward (the verifier's 0/1, or the weighted reward).
        process_B_T: the PRM's r_t (`implicit_rewards`), None or all 0 for no process credit.
        norm: "batch_norm" (`batch_norm`, before the baseline) or "none".

    Returns:
        (adv_B_T, returns_B_T), both 0 where the mask is 0.
    """
    from posttrain_core.algorithms.advantages import token_level_rewards

    m = mask_B_T > 0
    token_B_T = gt_coef * token_level_rewards(rloo_advantages(outcome_B.float(), group_B), mask_B_T)
    if process_B_T is not None:
        r = batch_norm(process_B_T.float(), mask_B_T) if norm == "batch_norm" else process_B_T.float() * m
        token_B_T = token_B_T + dpo_coef * process_rloo(r, mask_B_T, group_B)
    return reinforce_pp_advantages(token_B_T, m, 1.0)


def band_filter(accuracy: dict[str, float], band: tuple[float, float], oversample: int) -> tuple[list[str], int]:
    """The prompts to train on, and how many were inside the band.

    accuracy: each prompt's group accuracy, in sampling order. Keeps exactly len(accuracy) // oversample prompts
    (at least 1): those with lo <= accuracy <= hi first, in order, then, if too few pass, the others in order (the
    band is a priority, not a guarantee: the batch keeps its size).
    """
    lo, hi = band
    passing = [p for p, a in accuracy.items() if lo <= a <= hi]
    failing = [p for p, a in accuracy.items() if not lo <= a <= hi]
    want = max(1, len(accuracy) // oversample)
    return (passing + failing)[:want], len(passing)
