"""The losses of `forward_backward`: tinker's names, mapped onto the library's policy-loss registry.

Every loss reads the trainer's log-prob of each target token (`logp`, one per input position) and the datum's
`loss_fn_inputs`, and is summed (never averaged) over a request's tokens: the registry's `token-sum` aggregation, so
that a batch the client splits into several requests accumulates exactly the gradient of the whole batch, and the
client chooses its own normalisation (through `weights` or `advantages`).

    cross_entropy        -sum w * logp                                  (target_tokens, weights = 1)
    importance_sampling  -sum r * A,  r = exp(logp - q)                 (target_tokens, logprobs q, advantages A)
    ppo                  -sum min(r * A, clip(r, lo, hi) * A)           registry `clip`, no dual clip
    cispo                -sum sg(clip(r, lo, hi)) * logp * A            registry `cispo`

`lo` and `hi` are `loss_fn_config`'s `clip_low_threshold` (0.8) and `clip_high_threshold` (1.2), absolute bounds on
the ratio; the registry takes them as `clip_low = 1 - lo`, `clip_high = hi - 1`. Cross-entropy is the plain weighted
negative log-likelihood (the pipeline's SFT loss before its normalisation), not a policy loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from posttrain_core.algorithms.losses import LossSettings, policy_loss
from posttrain_core.serve.wire import Datum, UserError


@dataclass(frozen=True)
class TinkerLoss:
    """A tinker loss: its inputs besides target_tokens and the registered policy loss it runs (None: cross-entropy)."""

    required: tuple[str, ...]
    optional: dict[str, float]
    registry: str | None


LOSSES: dict[str, TinkerLoss] = {
    "cross_entropy": TinkerLoss((), {"weights": 1.0}, None),
    "importance_sampling": TinkerLoss(("logprobs", "advantages"), {}, "importance_sampling"),
    "ppo": TinkerLoss(("logprobs", "advantages"), {}, "clip"),
    "cispo": TinkerLoss(("logprobs", "advantages"), {}, "cispo"),
}


def settings(config: dict[str, float]) -> LossSettings:
    """The registry's settings for tinker's `loss_fn_config`: absolute ratio bounds, token sums, no dual clip."""
    low, high = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    return LossSettings(loss_agg="token-sum", clip_low=1.0 - low, clip_high=high - 1.0, dual_clip=None)


def check_datum(loss_fn: str, datum: Datum, i: int, vocab_size: int, max_length: int) -> None:
    """Refuse a datum this loss cannot use, naming `data[i]` and the field (before any compute).

    Raises:
        UserError: unknown loss, empty or too long input, a token id outside the vocabulary, a missing input, or an
            input whose length differs from the input tokens'.
    """
    if loss_fn not in LOSSES:
        raise UserError(f"loss_fn: unknown loss {loss_fn!r}; this server has {', '.join(LOSSES)}")
    n = len(datum.tokens)
    if n == 0:
        raise UserError(f"data[{i}].model_input: no tokens")
    if n > max_length:
        raise UserError(f"data[{i}].model_input: {n} tokens exceed the base model's context of {max_length}")
    loss = LOSSES[loss_fn]
    for name in ("target_tokens", *loss.required):
        if name not in datum.inputs:
            raise UserError(f"data[{i}].loss_fn_inputs: {loss_fn} needs {name!r} (got {sorted(datum.inputs)})")
    for name, value in datum.inputs.items():
        if name in ("target_tokens", *loss.required, *loss.optional) and value.size != n:
            raise UserError(
                f"data[{i}].loss_fn_inputs[{name!r}]: {value.size} values for {n} input tokens (one per position)"
            )
    for name, ids in (("model_input", np.asarray(datum.tokens)), ("loss_fn_inputs['target_tokens']",
                                                                   datum.inputs["target_tokens"])):  # fmt: skip
        bad = ids[(ids < 0) | (ids >= vocab_size)]
        if bad.size:
            raise UserError(f"data[{i}].{name}: token id {int(bad[0])} is outside the vocabulary [0, {vocab_size})")


def inputs_B_T(loss_fn: str, datums: list[Datum], width: int) -> dict[str, torch.Tensor]:
    """The loss inputs of `datums` (all of one request), right-padded to `width` with 0 (float32, B x width)."""
    loss = LOSSES[loss_fn]
    out = {}
    for name in (*loss.required, *loss.optional):
        rows = torch.zeros((len(datums), width))
        for b, d in enumerate(datums):
            value = d.inputs.get(name)
            rows[b, : len(d.tokens)] = (
                loss.optional[name] if value is None else torch.as_tensor(value, dtype=torch.float32)
            )
        out[name] = rows
    return out


def request_loss(
    loss_fn: str, config: dict[str, float], logp_B_T: torch.Tensor, mask_B_T: torch.Tensor, x: dict[str, torch.Tensor]
) -> torch.Tensor:
    """The summed loss of one request's datums in a pass (0-dim, with graph); `check_datum` has passed.

    Args:
        logp_B_T: the trainer's log-prob of each target token, right-padded; mask_B_T: 1 on the datums' positions.
        x: `inputs_B_T` of the same rows.
    """
    loss = LOSSES[loss_fn]
    if loss.registry is None:
        return -(x["weights"] * logp_B_T * mask_B_T).sum()
    return policy_loss(loss.registry, logp_B_T, x["logprobs"], x["advantages"], mask_B_T, settings(config))[0]
