"""A `sample` request's JSON (`SampleRequest`) as a `compute.SampleJob`, checked field by field.

Stops follow the SDK's `SamplingParams.stop`: absent -> the base model's end-of-sequence tokens; strings -> those
strings and end-of-sequence; token ids -> those tokens only; `[]` -> nothing but `max_tokens`.
"""

from __future__ import annotations

from typing import Any

from posttrain_core.rollout.engine import SamplingSettings
from posttrain_core.serve.adapters import BASE
from posttrain_core.serve.compute import SampleJob
from posttrain_core.serve.wire import UserError, json_tokens

MAX_SAMPLES = 128
DEFAULT_MAX_TOKENS = 64


def _number(params: dict, name: str, default: float, low: float, high: float) -> float:
    value = params.get(name)
    if value is None:
        return default
    if not isinstance(value, int | float) or not low <= value <= high:
        raise UserError(f"sampling_params.{name}: expected a number in [{low}, {high}], got {value!r}")
    return float(value)


def sample_job(body: dict[str, Any], adapter: str) -> SampleJob:
    """The job of one `asample` body on `adapter` ('' = the base model).

    Raises:
        UserError: a field is missing or out of range (names it).
    """
    n = body.get("num_samples", 1)
    if not isinstance(n, int) or not 1 <= n <= MAX_SAMPLES:
        raise UserError(f"num_samples: expected an int in [1, {MAX_SAMPLES}], got {n!r}")
    prompt = json_tokens(body.get("prompt"), "prompt")
    params = body.get("sampling_params") or {}
    max_tokens = params.get("max_tokens") or DEFAULT_MAX_TOKENS
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise UserError(f"sampling_params.max_tokens: expected a positive int, got {max_tokens!r}")
    top_k = params.get("top_k", -1)
    if not isinstance(top_k, int) or top_k < -1:
        raise UserError(f"sampling_params.top_k: expected -1 (off) or a positive int, got {top_k!r}")
    seed = params.get("seed")
    if seed is not None and not isinstance(seed, int):
        raise UserError(f"sampling_params.seed: expected an int, got {seed!r}")
    stop = params.get("stop")
    strings: tuple[str, ...] = ()
    stop_ids: tuple[int, ...] | None = None
    if isinstance(stop, str):
        strings = (stop,)
    elif isinstance(stop, list) and stop and all(isinstance(s, str) for s in stop):
        strings = tuple(stop)
    elif isinstance(stop, list) and all(isinstance(s, int) for s in stop):
        stop_ids = tuple(stop)
    elif stop is not None:
        raise UserError(f"sampling_params.stop: expected a string, a list of strings or of token ids, got {stop!r}")
    settings = SamplingSettings(
        n=1,
        temperature=_number(params, "temperature", 1.0, 0.0, 100.0),
        top_p=_number(params, "top_p", 1.0, 1e-6, 1.0),
        top_k=max(top_k, 0),
        max_tokens=max_tokens,
        stop=strings,
    )
    return SampleJob(adapter or BASE, prompt, n, settings, seed, stop_ids, bool(body.get("prompt_logprobs")))
