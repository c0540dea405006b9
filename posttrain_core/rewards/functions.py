"""Calling reward functions (built-in verifiers and the user's own) on rows, with their errors contained.

    fn(prompt: list[dict], response: str, answer: str | None, meta: dict) -> float | dict[str, float]

or, with `fn.batched = True`, the same four arguments as lists and a list back. A float is one component named after
the function; a dict names its components (reserved keys: `correct`, the sample's 0/1 verifier outcome, and
`parse_failed`). An exception, a timeout, or a value that is not a finite number is an error of that sample: its
components are 0 and the error is counted; a function that fails on every sample fails the stage.
"""

from __future__ import annotations

import inspect
import logging
import math
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from posttrain_core import plugins
from posttrain_core.rewards.verifiers import VERIFIERS

log = logging.getLogger(__name__)

RESERVED = ("correct", "parse_failed")


@dataclass(frozen=True)
class RewardSpec:
    """One reward term of a ScoreConfig, plain and picklable (Ray tasks load the function again by `name`)."""

    name: str  # a built-in verifier's name, or an absolute reference to user code
    weight: float
    params: dict[str, Any] = field(default_factory=dict)  # keyword arguments of a built-in (its ScoreConfig fields)

    @property
    def builtin(self) -> bool:
        return not plugins.is_reference(self.name)

    @property
    def label(self) -> str:
        """The component name of a float result: the verifier's name, or the user function's name."""
        return self.name if self.builtin else self.name.rsplit(":", 1)[1].rsplit(".", 1)[-1]

    def function(self) -> Callable:
        return VERIFIERS[self.name] if self.builtin else plugins.load(self.name, "ScoreConfig.reward_functions")


def specs_of(cfg: Any) -> list[RewardSpec]:
    """The reward terms of a ScoreConfig (verifiers, then reward functions), each loaded and its signature checked.

    Raises:
        ValueError: an unknown verifier, user code that cannot be imported, or a function that does not take
            (prompt, response, answer, meta); the message names the config field and key.
    """
    specs = []
    for name, weight in cfg.verifiers.items():
        if name not in VERIFIERS:
            raise ValueError(f"ScoreConfig.verifiers: unknown {name!r}; known: {', '.join(VERIFIERS)}")
        fn = VERIFIERS[name]
        specs.append(RewardSpec(name, weight, {arg: getattr(cfg, f) for arg, f in fn.config_params.items()}))
    for ref, weight in cfg.reward_functions.items():
        if not plugins.is_reference(ref):
            raise ValueError(
                f"ScoreConfig.reward_functions: {ref!r} is not 'package.module:function' nor 'path/to/file.py:"
                "function' (built-in verifiers go in ScoreConfig.verifiers)"
            )
        spec = RewardSpec(plugins.absolute(ref), weight)
        check_signature(spec.function(), f"ScoreConfig.reward_functions[{ref!r}]")
        specs.append(spec)
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"ScoreConfig: two reward terms share a name: {labels}")
    return specs


def check_signature(fn: Any, where: str) -> None:
    if not callable(fn):
        raise ValueError(f"{where}: {fn!r} is not callable")
    try:
        inspect.signature(fn).bind("prompt", "response", "answer", {})
    except TypeError as err:
        raise ValueError(f"{where}: must take (prompt, response, answer, meta): {err}") from None
    except ValueError:  # a builtin without a signature: found out on the first call
        pass


@dataclass
class Scores:
    """The reward terms of each row: components (raw, unweighted), the weighted sum, the verifier outcome."""

    components: list[dict[str, float]]
    reward: list[float]
    correct: list[bool | None]
    parse_failed: list[bool]
    errors: dict[str, int]  # function label -> samples that failed
    first_error: str | None = None  # "function, row N: traceback" of the first failure


def apply(specs: Sequence[RewardSpec], rows: list[dict], timeout_s: float, row_offset: int = 0) -> Scores:
    """Every reward term on every row (`prompt`, `response`, `answer`, `meta`), `timeout_s` per call."""
    n = len(rows)
    out = Scores([{} for _ in range(n)], [0.0] * n, [None] * n, [False] * n, {})
    for spec in specs:
        fn = spec.function()
        results = _call_all(fn, spec, rows, timeout_s)
        failed = 0
        for i, (value, error) in enumerate(results):
            if error is None:
                try:
                    value = _checked(value, spec.label)
                except ValueError as err:
                    error = str(err)
            if error is not None:
                failed += 1
                if out.first_error is None:
                    out.first_error = f"reward function {spec.label!r}, row {row_offset + i}: {error}"
                out.components[i][spec.label] = 0.0
                continue
            for name, v in value.items():
                if name == "correct":
                    out.correct[i] = bool(v) if out.correct[i] is None else out.correct[i]
                elif name == "parse_failed":
                    out.parse_failed[i] = out.parse_failed[i] or bool(v)
                else:
                    out.components[i][name] = v
                    out.reward[i] += spec.weight * v
        if failed:
            out.errors[spec.label] = failed
    return out


def _checked(value: Any, label: str) -> dict[str, float]:
    """A result as {component: finite float}; a float is one component named `label`."""
    items = value.items() if isinstance(value, dict) else [(label, value)]
    out = {}
    for name, v in items:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(
                f"returned {type(v).__name__} {v!r:.60} for {name!r}; expected a number (or a dict of them)"
            )
        if not math.isfinite(v):
            raise ValueError(f"returned {v} for {name!r}; rewards must be finite")
        out[str(name)] = float(v)
    return out


def _call_all(fn: Callable, spec: RewardSpec, rows: list[dict], timeout_s: float) -> list[tuple[Any, str | None]]:
    """(value, error) per row: one call per row, or one call for all of them when `fn.batched`."""
    args = [(r["prompt"], r["response"], r["answer"], r["meta"]) for r in rows]
    if getattr(fn, "batched", False):
        value, error = _with_timeout(lambda: fn(*map(list, zip(*args, strict=True)), **spec.params), timeout_s)
        if error is None and (not isinstance(value, list) or len(value) != len(rows)):
            error = f"a batched function must return a list of {len(rows)} results, got {type(value).__name__}"
        return list(zip(value, [None] * len(rows), strict=True)) if error is None else [(None, error)] * len(rows)
    if spec.builtin:  # ours, fast and never hanging: called directly
        return [_contained(lambda a=a: fn(*a, **spec.params)) for a in args]
    return [_with_timeout(lambda a=a: fn(*a, **spec.params), timeout_s) for a in args]


def _contained(call: Callable[[], Any]) -> tuple[Any, str | None]:
    try:
        return call(), None
    except Exception:  # noqa: BLE001 - a verifier's failure is the sample's
        return None, traceback.format_exc(limit=8)


def _with_timeout(call: Callable[[], Any], timeout_s: float) -> tuple[Any, str | None]:
    """(result, None), or (None, the traceback or 'timed out') when it raised or ran past `timeout_s`. A call past
    its time keeps running in its daemon thread; nothing waits for it."""
    [(status, value, _)] = plugins.run_all([call], timeout_s, "posttrain-reward")
    if status == "timeout":
        return None, f"timed out after {timeout_s:g} s"
    if status == "error":
        return None, "".join(traceback.format_exception(value, limit=8))
    return value, None
