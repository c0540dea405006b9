"""Reward shaping terms: pure functions of response lengths, added to the reward as their own components.

DAPO's overlong shaping (docs/algorithms.md, "DAPO") penalises responses that run into the soft buffer before L_max.
"""

from __future__ import annotations

from collections.abc import Sequence


def overlong_penalty(lengths_B: Sequence[int], max_len: int, buffer: int, penalty: float = 1.0) -> list[float]:
    """DAPO soft overlong punishment, one term per response (added to its reward).

    With L_max = max_len, L_buf = buffer and expected = L_max - L_buf:

        term = min(0, -(len - expected) / L_buf * penalty)

    0 up to `expected` tokens, falling linearly to -penalty at L_max (and further below beyond it: not clamped,
    as in docs/algorithms.md and veRL's `overlong_reward`).

    Args:
        lengths_B: response lengths in tokens.
        max_len: the length budget L_max (>= 1).
        buffer: the soft buffer L_buf, 1 <= buffer <= max_len.
        penalty: the penalty reached at L_max (>= 0).

    Returns:
        terms_B, floats <= 0.
    """
    if max_len < 1 or not 1 <= buffer <= max_len:
        raise ValueError(f"overlong_penalty: need 1 <= buffer ({buffer}) <= max_len ({max_len})")
    if penalty < 0:
        raise ValueError(f"overlong_penalty: penalty must be >= 0, got {penalty}")
    expected = max_len - buffer
    return [min(0.0, -(n - expected) / buffer * penalty) for n in lengths_B]
