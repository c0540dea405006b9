"""Distillation: a student S learns from a teacher T's next-token distributions, per response position t.

Two families (docs/distillation.md):
- **On-policy distillation** (the policy-gradient form): the student samples y_t, the teacher scores it, and the
  token's advantage is `A_t = -coef (log S(y_t) - log T(y_t))` (the negative single-sample reverse-KL estimate), summed
  over later tokens with a discount, plus the task reward's advantage times a weight (`opd_advantages`). It runs
  through the ordinary policy-gradient update.
- **Supervised distillation** (GKD): a divergence between S and T at every response position, backpropagated
  directly (`DIVERGENCES`). Over the vocabulary, on the teacher's top-k tokens plus one tail bucket holding the rest
  of each distribution's mass (with k = V the buckets are the vocabulary, and the value is the full divergence); or a
  single-sample estimator on the sampled token (k1, k2, k3).

Registry signature: `fn(DistillInputs) -> loss_B_T` (per-token losses with graph, aggregated by the update).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from posttrain_core.algorithms.losses import kl_estimate
from posttrain_core.algorithms.registry import Registry

Tensor = torch.Tensor

DIVERGENCES: Registry = Registry("distillation divergence")
register_divergence = DIVERGENCES.register
# A tail bucket never holds less than this mass: with k = V the tails are 0 up to float rounding, and a term
# S_tail log(S_tail / T_tail) must not divide rounding by zero.
TAIL_FLOOR = 1e-10
# Estimators whose gradient carries the teacher (E_S[grad k1] = 0: `k1` trains nothing supervised).
SAMPLED = ("k1", "k2", "k3")


@dataclass(frozen=True)
class DistillInputs:
    """What a divergence may use, B responses x T positions (x K teacher top-k tokens).

    logp_B_T: the student's log-prob of each sampled token (with graph); teacher_logp_B_T: the teacher's of the same.
    student_topk_B_T_K: the student's log-probs of the teacher's top-k tokens (with graph); teacher_topk_B_T_K: the
    teacher's (both None without top-k). beta: the generalized JSD's mixture weight.
    """

    logp_B_T: Tensor
    teacher_logp_B_T: Tensor
    student_topk_B_T_K: Tensor | None = None
    teacher_topk_B_T_K: Tensor | None = None
    beta: float = 0.5


def with_tail(logp_K: Tensor) -> Tensor:
    """The K log-probs and a last bucket: log(1 - sum exp(logp_K)), its mass at least TAIL_FLOOR."""
    mass = logp_K.float().exp().sum(-1, keepdim=True)
    return torch.cat([logp_K.float(), (1.0 - mass).clamp(min=TAIL_FLOOR).log()], dim=-1)


def _buckets(inp: DistillInputs, name: str) -> tuple[Tensor, Tensor]:
    if inp.student_topk_B_T_K is None or inp.teacher_topk_B_T_K is None:
        raise ValueError(f"distillation divergence {name!r} needs the teacher's top-k log-probs (distill.topk > 0)")
    return with_tail(inp.student_topk_B_T_K), with_tail(inp.teacher_topk_B_T_K)


def kl(logp_a: Tensor, logp_b: Tensor) -> Tensor:
    """KL(a || b) = sum_v a_v (log a_v - log b_v) over the last axis; a_v = 0 contributes 0."""
    a = logp_a.exp()
    return torch.where(a > 0, a * (logp_a - logp_b), torch.zeros_like(a)).sum(-1)


@register_divergence("forward_kl")
def forward_kl(inp: DistillInputs) -> Tensor:
    """KL(T || S) over the top-k buckets: mean-covering; its gradient is SFT on the teacher's soft targets."""
    s, t = _buckets(inp, "forward_kl")
    return kl(t, s)


@register_divergence("reverse_kl")
def reverse_kl(inp: DistillInputs) -> Tensor:
    """KL(S || T) over the top-k buckets: mode-seeking, what on-policy distillation estimates with one sample."""
    s, t = _buckets(inp, "reverse_kl")
    return kl(s, t)


@register_divergence("jsd")
def generalized_jsd(inp: DistillInputs) -> Tensor:
    """GKD's generalized Jensen-Shannon divergence over the top-k buckets: with M = (1 - beta) S + beta T,
    JSD_beta = beta KL(T || M) + (1 - beta) KL(S || M); at beta = 0 it is KL(T || S), at beta = 1 KL(S || T) (the
    limits' directions; JSD_beta itself tends to 0 at both ends), and symmetric in S and T at beta = 0.5."""
    s, t = _buckets(inp, "jsd")
    if inp.beta <= 0.0:
        return kl(t, s)
    if inp.beta >= 1.0:
        return kl(s, t)
    m = torch.logsumexp(torch.stack([s + math.log1p(-inp.beta), t + math.log(inp.beta)]), dim=0)
    return inp.beta * kl(t, m) + (1.0 - inp.beta) * kl(s, m)


@register_divergence("k1")
def k1(inp: DistillInputs) -> Tensor:
    """log S(y) - log T(y) on the sampled token: the reverse-KL estimate. As a loss its expected gradient is 0
    (E_S[grad log S] = 0), so the supervised form refuses it; on-policy distillation uses it as the advantage."""
    return kl_estimate(inp.logp_B_T, inp.teacher_logp_B_T.detach(), "k1")


@register_divergence("k2")
def k2(inp: DistillInputs) -> Tensor:
    """0.5 (log S(y) - log T(y))^2 on the sampled token; E_S[grad k2] = grad KL(S || T)."""
    return kl_estimate(inp.logp_B_T, inp.teacher_logp_B_T.detach(), "k2")


@register_divergence("k3")
def k3(inp: DistillInputs) -> Tensor:
    """T/S - 1 - log(T/S) on the sampled token (clamped as the KL estimator is); E_S[grad k3] = grad KL(T || S)."""
    return kl_estimate(inp.logp_B_T, inp.teacher_logp_B_T.detach(), "k3")


def opd_advantages(
    logp_B_T: Tensor,
    teacher_logp_B_T: Tensor,
    mask_B_T: Tensor,
    coef: float = 1.0,
    discount: float = 0.0,
    task_B_T: Tensor | None = None,
    task_weight: float = 0.0,
) -> Tensor:
    """On-policy distillation's advantages, B x T: r_t = -coef (logp_t - teacher_logp_t) on the policy's tokens
    (m = 1), then A_t = sum_{s >= t} discount^(s - t) m_s r_s (discount 0: A_t = r_t), plus task_weight times the task
    reward's advantages `task_B_T`; 0 where m = 0 (a tool turn's tokens carry no signal).

    Args:
        logp_B_T: the student's log-probs of the sampled tokens (the sampler's); teacher_logp_B_T: the teacher's of
            the same tokens, aligned to them.
    """
    m_B_T = mask_B_T.to(torch.float32)
    r_B_T = -coef * (logp_B_T.float() - teacher_logp_B_T.float()) * m_B_T
    if discount > 0.0:
        adv_B_T = torch.zeros_like(r_B_T)
        running = torch.zeros_like(r_B_T[:, 0])
        for t in range(r_B_T.shape[1] - 1, -1, -1):
            running = r_B_T[:, t] + discount * running
            adv_B_T[:, t] = running
        r_B_T = adv_B_T
    if task_B_T is not None and task_weight != 0.0:
        r_B_T = r_B_T + task_weight * task_B_T
    return r_B_T * m_B_T


def topk_agreement(
    student_on_teacher_B_T_K: Tensor, student_ids_B_T_K: Tensor, teacher_ids_B_T_K: Tensor, mask_B_T: Tensor
) -> tuple[float, float]:
    """Sums over the masked positions of the student's probability mass on the teacher's top-k tokens
    (`student_mass`), and of the share of the student's own top-k that is in the teacher's (`topk_overlap`)."""
    m = mask_B_T.float()
    mass = (student_on_teacher_B_T_K.detach().float().exp().sum(-1) * m).sum()
    shared = (student_ids_B_T_K[..., :, None] == teacher_ids_B_T_K[..., None, :]).any(-1).float().mean(-1)
    return float(mass), float((shared * m).sum())
