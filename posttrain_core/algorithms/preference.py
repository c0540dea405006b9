"""Preference losses: Bradley-Terry for reward models, DPO and its IPO / cDPO variants, summed sequence log-probs.

Pure tensor functions (no model, no distributed code); `LOSSES` and `DPO_LOSSES` register them by name.
Every loss is a *mean* over the pairs given; a caller that normalises over a larger (global) batch rescales it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def bradley_terry_loss(
    r_chosen_B: torch.Tensor, r_rejected_B: torch.Tensor, margin: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bradley-Terry pairwise loss of a scalar reward model.

    loss = mean_i -log sigmoid(r_chosen_i - r_rejected_i - margin); accuracy = mean_i [r_chosen_i > r_rejected_i]
    (a tie counts as wrong; the margin does not enter the accuracy).

    Args:
        r_chosen_B, r_rejected_B: rewards of the chosen and rejected response of each pair, shape (B,).
        margin: required reward gap (>= 0); 0 is the plain Bradley-Terry model.

    Returns:
        (loss, accuracy): 0-dim tensors; loss keeps the graph, accuracy is detached.
    """
    if r_chosen_B.shape != r_rejected_B.shape or r_chosen_B.dim() != 1:
        raise ValueError(
            f"bradley_terry_loss: expected two (B,) tensors, got {tuple(r_chosen_B.shape)} and "
            f"{tuple(r_rejected_B.shape)}"
        )
    diff_B = r_chosen_B.float() - r_rejected_B.float()
    loss = -F.logsigmoid(diff_B - margin).mean()
    accuracy = (diff_B > 0).float().mean().detach()
    return loss, accuracy


def _sigmoid(delta_B: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    return -F.logsigmoid(beta * delta_B)


def _ipo(delta_B: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    return (delta_B - 1.0 / (2.0 * beta)) ** 2


def _cdpo(delta_B: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    eps = label_smoothing
    return -(1.0 - eps) * F.logsigmoid(beta * delta_B) - eps * F.logsigmoid(-beta * delta_B)


# Per-pair loss of a DPO variant: f(delta_B, beta, label_smoothing) -> loss_B.
DPO_LOSSES: dict[str, Callable[[torch.Tensor, float, float], torch.Tensor]] = {
    "sigmoid": _sigmoid,
    "ipo": _ipo,
    "cdpo": _cdpo,
}


def dpo_loss(
    logp_c_B: torch.Tensor,
    logp_r_B: torch.Tensor,
    ref_c_B: torch.Tensor,
    ref_r_B: torch.Tensor,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> dict[str, torch.Tensor]:
    """Direct preference optimisation from summed response log-probs of the policy and of a frozen reference.

    With Delta_i = (logp_c_i - ref_c_i) - (logp_r_i - ref_r_i), the per-pair loss is
      sigmoid (DPO):  -log sigmoid(beta Delta)
      ipo:            (Delta - 1 / (2 beta))^2
      cdpo:           -(1 - eps) log sigmoid(beta Delta) - eps log sigmoid(-beta Delta),  eps = label_smoothing
    and `loss` is its mean over the B pairs. The implicit rewards are beta (logp - ref), detached.

    Where we differ from a reference: IPO here uses the same *summed* log-probs as DPO (TRL's IPO averages them over
    the response tokens), as docs/algorithms.md defines the variants as one-line changes of the same Delta.

    Args:
        logp_c_B, logp_r_B: policy log-probs of the chosen / rejected responses, summed over response tokens, (B,).
        ref_c_B, ref_r_B: the same under the reference model, (B,) (no gradient needed).
        beta: inverse temperature of the implicit reward (> 0).
        loss_type: a key of `DPO_LOSSES`.
        label_smoothing: cDPO's label-flip probability eps in [0, 0.5); only "cdpo" uses it.

    Returns:
        {"loss": 0-dim (with graph), "chosen_reward_B": (B,), "rejected_reward_B": (B,),
         "margin": 0-dim mean of chosen_reward - rejected_reward, "accuracy": 0-dim mean [chosen_reward > rejected_reward]}.
    """
    if loss_type not in DPO_LOSSES:
        raise ValueError(f"dpo_loss: loss_type={loss_type!r} is not one of {sorted(DPO_LOSSES)}")
    if beta <= 0:
        raise ValueError(f"dpo_loss: beta must be > 0, got {beta}")
    shapes = {tuple(t.shape) for t in (logp_c_B, logp_r_B, ref_c_B, ref_r_B)}
    if len(shapes) != 1 or logp_c_B.dim() != 1:
        raise ValueError(f"dpo_loss: expected four (B,) tensors of one shape, got {sorted(shapes)}")
    ref_c_B, ref_r_B = ref_c_B.detach().float(), ref_r_B.detach().float()
    chosen_logratio_B = logp_c_B.float() - ref_c_B
    rejected_logratio_B = logp_r_B.float() - ref_r_B
    delta_B = chosen_logratio_B - rejected_logratio_B
    loss = DPO_LOSSES[loss_type](delta_B, beta, label_smoothing).mean()
    chosen_reward_B = (beta * chosen_logratio_B).detach()
    rejected_reward_B = (beta * rejected_logratio_B).detach()
    return {
        "loss": loss,
        "chosen_reward_B": chosen_reward_B,
        "rejected_reward_B": rejected_reward_B,
        "margin": (chosen_reward_B - rejected_reward_B).mean(),
        "accuracy": (chosen_reward_B > rejected_reward_B).float().mean(),
    }


LOSSES: dict[str, Callable[..., object]] = {
    "bradley_terry": bradley_terry_loss,
    "dpo": dpo_loss,
}
