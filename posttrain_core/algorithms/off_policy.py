"""Off-policy corrections for rows sampled by an older policy than the one being updated (`rl.rollout_lag`).

Three policies meet in a lagged update: mu, the behaviour policy whose engine sampled the row (its log-probs are
stored with the row); pi_prox, the proximal policy, i.e. the weights the update starts from (the recomputed
`logp_old`, at which the PPO clip is centred); and pi_theta, the weights being trained. Every correction is a
per-token weight on the policy loss, computed from w = pi_prox / mu (detached) over the whole batch before the update;
since every registered policy loss is linear in the advantage for a weight >= 0, the weight multiplies the
advantages. `OFF_POLICY_CORRECTIONS` registers them by name, one signature: fn(OffPolicyInputs) -> weight_B_T.
Definitions and when to use which: docs/algorithms.md, "Off-policy RL with a bounded lag".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain_core.algorithms.registry import Registry

Tensor = torch.Tensor

OFF_POLICY_CORRECTIONS: Registry = Registry("off-policy correction")
register_correction = OFF_POLICY_CORRECTIONS.register

# log w is clamped to [-20, 20] before exp: a token the behaviour policy found ~impossible must not give inf.
_LOG_CLAMP = 20.0


@dataclass(frozen=True)
class OffPolicyInputs:
    """prox_logp_B_T: the proximal log-probs (the update's starting weights); behaviour_logp_B_T: the sampling
    engine's; mask_B_T: the policy tokens; cap: the tis truncation; low, high: the masks' bounds on w."""

    prox_logp_B_T: Tensor
    behaviour_logp_B_T: Tensor
    mask_B_T: Tensor
    cap: float = 2.0
    low: float = 0.5
    high: float = 2.0

    @property
    def log_w_B_T(self) -> Tensor:
        m = self.mask_B_T > 0
        d = (self.prox_logp_B_T.double() - self.behaviour_logp_B_T.double()).clamp(-_LOG_CLAMP, _LOG_CLAMP)
        return torch.where(m, d, torch.zeros_like(d))

    @property
    def w_B_T(self) -> Tensor:
        """w = pi_prox / mu per token (1 where the mask is 0)."""
        return self.log_w_B_T.exp()


def _on_mask(inp: OffPolicyInputs, weight_B_T: Tensor) -> Tensor:
    return torch.where(inp.mask_B_T > 0, weight_B_T, torch.zeros_like(weight_B_T)).float()


@register_correction("none")
def no_correction(inp: OffPolicyInputs) -> Tensor:
    """1 on every policy token: the rows are trained on as if the proximal policy had sampled them."""
    return _on_mask(inp, torch.ones_like(inp.w_B_T))


@register_correction("tis")
def truncated_importance_sampling(inp: OffPolicyInputs) -> Tensor:
    """Token-level truncated importance sampling: min(w, cap)."""
    return _on_mask(inp, inp.w_B_T.clamp(max=inp.cap))


@register_correction("token_mask")
def token_mask(inp: OffPolicyInputs) -> Tensor:
    """1 where low <= w <= high, 0 elsewhere (the token is rejected; it still counts in the token-mean's size)."""
    w = inp.w_B_T
    return _on_mask(inp, ((w >= inp.low) & (w <= inp.high)).double())


@register_correction("seq_mask")
def sequence_mask(inp: OffPolicyInputs) -> Tensor:
    """1 on every token of a row whose geometric-mean weight exp(mean_t log w_t) lies in [low, high], 0 on every
    token of the others (a product of per-token weights grows with length; the geometric mean does not)."""
    m = (inp.mask_B_T > 0).double()
    mean_log_B = (inp.log_w_B_T * m).sum(-1) / m.sum(-1).clamp(min=1)
    w_B = mean_log_B.exp()
    keep_B = (w_B >= inp.low) & (w_B <= inp.high)
    return _on_mask(inp, keep_B[:, None].double().expand_as(m))


@register_correction("decoupled")
def decoupled(inp: OffPolicyInputs) -> Tensor:
    """Decoupled PPO (the clip centred on the proximal policy, as every posttrain update does): the full weight w,
    not truncated."""
    return _on_mask(inp, inp.w_B_T)


def correction_metrics(inp: OffPolicyInputs, weight_B_T: Tensor) -> dict[str, float]:
    """Over the policy tokens: is_weight_mean/min/max of w; is_clip_frac, the share with w > cap (what tis
    truncates); is_masked_frac, the share the correction gave weight 0; is_ess = (sum w)^2 / (N sum w^2) of w, in
    (0, 1] (1: the rows are as good as on-policy)."""
    m = inp.mask_B_T > 0
    if not m.any():
        return {}
    w = inp.w_B_T[m]
    return {
        "is_weight_mean": float(w.mean()),
        "is_weight_min": float(w.min()),
        "is_weight_max": float(w.max()),
        "is_clip_frac": float((w > inp.cap).double().mean()),
        "is_masked_frac": float((weight_B_T[m] == 0).double().mean()),
        "is_ess": float(w.sum() ** 2 / (len(w) * (w**2).sum())),
    }
