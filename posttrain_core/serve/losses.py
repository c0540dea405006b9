"""The built-in losses of `forward_backward`, per token, summed (never averaged) over a request's tokens.

Every loss reads the trainer's log-prob of each target token (`logp`, one per input position) and the datum's
`loss_fn_inputs`. Sums, not means, so that a batch the client splits into several requests accumulates exactly the
gradient of the whole batch, and the client chooses its own normalisation (through `weights` or `advantages`).

    cross_entropy        -sum w * logp                                      (target_tokens, weights = 1)
    importance_sampling  -sum exp(logp - q) * A                             (target_tokens, logprobs q, advantages A)
    ppo                  -sum min(r * A, clip(r, lo, hi) * A), r = exp(logp - q)
    cispo                -sum sg(clip(r, lo, hi)) * logp * A

`lo` and `hi` are `loss_fn_config`'s `clip_low_threshold` (0.8) and `clip_high_threshold` (1.2).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from posttrain_core.serve.wire import Datum, UserError

LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor], dict[str, float]], torch.Tensor]


def _ratio(logp: torch.Tensor, x: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.exp(logp - x["logprobs"])


def _clip(config: dict[str, float]) -> tuple[float, float]:
    return config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)


def _cross_entropy(logp, x, config):
    return -(x["weights"] * logp)


def _importance_sampling(logp, x, config):
    return -(_ratio(logp, x) * x["advantages"])


def _ppo(logp, x, config):
    r, (lo, hi) = _ratio(logp, x), _clip(config)
    return -torch.minimum(r * x["advantages"], r.clamp(lo, hi) * x["advantages"])


def _cispo(logp, x, config):
    r, (lo, hi) = _ratio(logp, x).detach(), _clip(config)
    return -(r.clamp(lo, hi) * logp * x["advantages"])


# name -> (required loss_fn_inputs besides target_tokens, optional inputs with their default, per-token loss)
LOSSES: dict[str, tuple[tuple[str, ...], dict[str, float], LossFn]] = {
    "cross_entropy": ((), {"weights": 1.0}, _cross_entropy),
    "importance_sampling": (("logprobs", "advantages"), {}, _importance_sampling),
    "ppo": (("logprobs", "advantages"), {}, _ppo),
    "cispo": (("logprobs", "advantages"), {}, _cispo),
}


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
    required, optional, _ = LOSSES[loss_fn]
    for name in ("target_tokens", *required):
        if name not in datum.inputs:
            raise UserError(f"data[{i}].loss_fn_inputs: {loss_fn} needs {name!r} (got {sorted(datum.inputs)})")
    for name, value in datum.inputs.items():
        if name in ("target_tokens", *required, *optional) and value.size != n:
            raise UserError(
                f"data[{i}].loss_fn_inputs[{name!r}]: {value.size} values for {n} input tokens (one per position)"
            )
    for name, ids in (("model_input", np.asarray(datum.tokens)), ("loss_fn_inputs['target_tokens']",
                                                                   datum.inputs["target_tokens"])):  # fmt: skip
        bad = ids[(ids < 0) | (ids >= vocab_size)]
        if bad.size:
            raise UserError(f"data[{i}].{name}: token id {int(bad[0])} is outside the vocabulary [0, {vocab_size})")


def token_losses(loss_fn: str, logp: torch.Tensor, datum: Datum, config: dict[str, float]) -> torch.Tensor:
    """The per-token loss of one datum (same length as `logp`); `check_datum` has passed."""
    _, optional, fn = LOSSES[loss_fn]
    x = {name: torch.as_tensor(np.asarray(v, dtype=np.float32)) for name, v in datum.inputs.items()}
    for name, default in optional.items():
        x.setdefault(name, torch.full_like(logp, default))
    return fn(logp, x, config)
