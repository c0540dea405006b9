"""What the RL update measures as it goes: the log-prob checks over a sampled batch (`LogpChecks`) and the sums over a
rank's micro-steps (`UpdateStats`), both summed over the ranks at the end."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

TURN_BINS = 4  # the per-turn log-prob gap: turns 1, 2, 3, and 4 with every later turn


@dataclass
class LogpChecks:
    """Sums over policy tokens of the engine-vs-trainer log-prob gap (overall and per assistant turn) and of the KL
    to the reference, as the trainer sees the sampled batch (old log-probs): the silent failures of RL that every
    update reports."""

    turn_tokens: list[float] = dataclasses.field(default_factory=lambda: [0.0] * TURN_BINS)
    turn_mismatch: list[float] = dataclasses.field(default_factory=lambda: [0.0] * TURN_BINS)
    mismatch_max: float = 0.0
    ref_tokens: float = 0.0
    k1_sum: float = 0.0
    k3_sum: float = 0.0

    @property
    def tokens(self) -> float:
        return sum(self.turn_tokens)

    @property
    def mismatch_sum(self) -> float:
        return sum(self.turn_mismatch)

    def add(self, logprobs_B_R: Any, old_logp_B_R: Any, ref_logp_B_R: Any | None, response_mask_B_R: Any) -> None:
        """Add rows: the engine's log-probs, the trainer's old ones, the reference's (or None), the response mask."""
        from posttrain_core.algorithms.losses import kl_estimate

        m_B_R = response_mask_B_R
        gap = (logprobs_B_R - old_logp_B_R).abs() * m_B_R
        self.mismatch_max = max(self.mismatch_max, float(gap.max()) if gap.numel() else 0.0)
        # assistant turns are the runs of mask-1 tokens: a run starts where the mask rises from 0 (or at column 0)
        rises = m_B_R.clone()
        rises[:, 1:] = (m_B_R[:, 1:] > m_B_R[:, :-1]).to(m_B_R.dtype)
        turn_B_R = (rises.cumsum(dim=1) - 1).clamp(0, TURN_BINS - 1)
        for b in range(TURN_BINS):
            sel = m_B_R * (turn_B_R == b)
            self.turn_tokens[b] += float(sel.sum())
            self.turn_mismatch[b] += float((gap * sel).sum())
        if ref_logp_B_R is not None:
            self.ref_tokens += float(m_B_R.sum())
            self.k1_sum += float((kl_estimate(old_logp_B_R, ref_logp_B_R, "k1") * m_B_R).sum())
            self.k3_sum += float((kl_estimate(old_logp_B_R, ref_logp_B_R, "k3") * m_B_R).sum())

    def _sums(self) -> list[float]:
        return [*self.turn_tokens, *self.turn_mismatch, self.ref_tokens, self.k1_sum, self.k3_sum]

    @staticmethod
    def _of(sums: list[float], mismatch_max: float) -> LogpChecks:
        turns, (ref_tokens, k1, k3) = sums[: 2 * TURN_BINS], sums[2 * TURN_BINS :]
        return LogpChecks(turns[:TURN_BINS], turns[TURN_BINS:], mismatch_max, ref_tokens, k1, k3)

    @staticmethod
    def merge(parts: list[LogpChecks]) -> LogpChecks | None:
        if not parts:
            return None
        sums = [sum(v) for v in zip(*(p._sums() for p in parts), strict=True)]
        return LogpChecks._of(sums, max(p.mismatch_max for p in parts))

    def all_reduce(self) -> LogpChecks:
        """Summed (the maximum: maxed) over the ranks of the process group."""
        import torch
        import torch.distributed as dist

        sums = torch.tensor(self._sums(), dtype=torch.float64)
        top = torch.tensor([self.mismatch_max], dtype=torch.float64)
        dist.all_reduce(sums)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        return LogpChecks._of(sums.tolist(), float(top[0]))

    def metrics(self) -> dict[str, float]:
        out = {
            "logp_mismatch_mean": self.mismatch_sum / max(self.tokens, 1.0),
            "logp_mismatch_max": self.mismatch_max,
        }
        if self.turn_tokens[1]:  # multi-turn rows: the gap per assistant turn (a template or masking bug shows here)
            for b, (n, x) in enumerate(zip(self.turn_tokens, self.turn_mismatch, strict=True)):
                if n:
                    out[f"logp_mismatch_mean/turn{b + 1}"] = x / n  # turn4: the 4th and later turns
        if self.ref_tokens:
            out |= {"kl_k1": self.k1_sum / self.ref_tokens, "kl_k3": self.k3_sum / self.ref_tokens}
        return out


@dataclass
class UpdateStats:
    """Sums over a rank's micro-steps, summed over ranks at the end of the update."""

    pg_loss: float = 0.0  # per optimizer step (the losses are already means over the mini-batch)
    kl_loss: float = 0.0
    value_loss: float = 0.0
    nll_loss: float = 0.0
    entropy_sum: float = 0.0  # per policy token
    clip_sum: float = 0.0
    approx_kl_sum: float = 0.0
    vf_clip_sum: float = 0.0
    tokens: float = 0.0  # policy tokens
    seq_tokens: float = 0.0  # tokens of the policy's forward passes in full, and of them actually run (shared prompts)
    seq_tokens_run: float = 0.0
    distill_loss: float = 0.0  # per optimizer step, as pg_loss
    student_mass_sum: float = 0.0  # per policy token with the teacher's top-k
    topk_overlap_sum: float = 0.0

    def add(self, other: UpdateStats) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def all_reduce(self) -> UpdateStats:
        import torch
        import torch.distributed as dist

        t = torch.tensor(dataclasses.astuple(self), dtype=torch.float64)
        dist.all_reduce(t)
        return UpdateStats(*t.tolist())
