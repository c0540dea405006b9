"""Tools a policy may call during a multi-turn rollout: user functions by reference, the parsers that find calls in
a reply, and calls run under a deadline whose failures become observations.

A tool is a plain Python function with type hints and a Google-style docstring (its JSON schema, for the chat
template's `tools=`, is derived by transformers' `get_json_schema`), referenced like a reward function:
`"pkg.module:fn"` or `"path/to/file.py:fn"`. It returns a string, or `(string, reward)`.

Nothing a tool or the model does raises out of a rollout: an unknown tool, arguments that do not parse or do not fit
the signature, an exception and a timeout all become an `Error: ...` observation that the model sees and the row
counts.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from posttrain_core import plugins


@dataclass(frozen=True)
class ToolCall:
    """One call found in a reply: the tool's name, its keyword arguments, the raw text, and why it did not parse."""

    name: str
    arguments: dict[str, Any]
    raw: str
    error: str | None = None


@dataclass(frozen=True)
class ToolResult:
    content: str
    status: str  # "ok" | "error" | "timeout"
    reward: float = 0.0
    latency_ms: float = 0.0


# ----------------------------------------------------------------------------------------------------- parsers
PARSERS: dict[str, Callable[[str], list[ToolCall]]] = {}


def register_parser(name: str):
    """Register `fn(reply_text) -> list[ToolCall]` under `name` (RolloutConfig.tool_parser)."""

    def add(fn):
        PARSERS[name] = fn
        return fn

    return add


_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@register_parser("hermes")
def hermes(text: str) -> list[ToolCall]:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as Qwen, Hermes and SmolLM-style templates emit."""
    calls = []
    for m in _CALL.finditer(text):
        raw = m.group(1).strip()
        try:
            obj = json.loads(raw)
            name, args = obj["name"], obj.get("arguments", {})
            if isinstance(args, str):  # some models emit the arguments as a JSON string
                args = json.loads(args)
            if not isinstance(name, str) or not isinstance(args, dict):
                raise TypeError("'name' must be a string and 'arguments' an object")
            calls.append(ToolCall(name, args, raw))
        except (ValueError, KeyError, TypeError) as err:
            calls.append(ToolCall(_guess_name(raw), {}, raw, f"unparsable tool call ({type(err).__name__}: {err})"))
    return calls


@register_parser("compact")
def compact(text: str) -> list[ToolCall]:
    """`<tool_call>name arg1 arg2</tool_call>`: positional, space-separated arguments, for tiny models that cannot
    spend tokens on JSON. Positions map to the tool's parameters in order (`ToolBox.call` converts their types)."""
    calls = []
    for m in _CALL.finditer(text):
        raw = m.group(1).strip()
        parts = raw.split()
        if not parts:
            calls.append(ToolCall("", {}, raw, "empty tool call"))
        else:
            calls.append(ToolCall(parts[0], {"__positional__": parts[1:]}, raw))
    return calls


def _guess_name(raw: str) -> str:
    m = re.search(r'"name"\s*:\s*"([^"]*)"', raw)
    return m.group(1) if m else ""


# ------------------------------------------------------------------------------------------------------- tools
@dataclass
class ToolBox:
    """The tools of a rollout, loaded from their references, with their JSON schemas.

    Raises (at construction, before any generation):
        ValueError: a reference does not load, is not callable, or its docstring/type hints give no schema; the
            message names `config_field` and the reference.
    """

    references: tuple[str, ...]
    config_field: str = "rollout.tools"
    functions: dict[str, Callable[..., Any]] = field(init=False, default_factory=dict)
    schemas: list[dict] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        from transformers.utils import get_json_schema

        for ref in self.references:
            fn = plugins.load(ref, self.config_field)
            if not callable(fn):
                raise ValueError(f"{self.config_field}: {ref!r} is not a function")
            try:
                schema = get_json_schema(fn)
            except Exception as err:  # noqa: BLE001 - transformers raises several types for a bad docstring
                raise ValueError(
                    f"{self.config_field}: {ref!r} needs type hints and a Google-style docstring with an Args section "
                    f"({type(err).__name__}: {err})"
                ) from err
            name = schema["function"]["name"]
            if name in self.functions:
                raise ValueError(f"{self.config_field}: two tools are named {name!r}")
            self.functions[name] = fn
            self.schemas.append(schema)

    def call_all(self, calls: list[ToolCall], pool: concurrent.futures.Executor, timeout_s: float) -> list[ToolResult]:
        """Run calls concurrently on `pool`, each with its own deadline; every failure is an `Error: ...` result,
        never an exception. A call past its deadline is abandoned (its thread cannot be killed; a tool that may hang
        for good should run its work in a subprocess of its own)."""
        started = time.perf_counter()
        pending: list[concurrent.futures.Future | ToolResult] = []
        for call in calls:
            fn = self.functions.get(call.name)
            if call.error:
                pending.append(ToolResult(f"Error: {call.error}", "error"))
            elif fn is None:
                pending.append(
                    ToolResult(f"Error: unknown tool {call.name!r} (tools: {', '.join(self.functions)})", "error")
                )
            else:
                try:
                    pending.append(pool.submit(fn, **_bind(fn, call.arguments)))
                except (TypeError, ValueError) as err:
                    pending.append(ToolResult(f"Error: bad arguments for {call.name}: {err}", "error"))
        results = []
        for call, p in zip(calls, pending, strict=True):
            if isinstance(p, ToolResult):
                results.append(p)
                continue
            left = max(0.0, started + timeout_s - time.perf_counter())
            try:
                out = p.result(timeout=left)
            except concurrent.futures.TimeoutError:
                p.cancel()
                results.append(ToolResult(f"Error: {call.name} timed out after {timeout_s:g} s", "timeout"))
                continue
            except Exception as err:  # noqa: BLE001 - the tool's error is the model's observation
                results.append(ToolResult(f"Error: {call.name} raised {type(err).__name__}: {err}", "error"))
                continue
            results.append(_result(call.name, out))
        ms = round((time.perf_counter() - started) * 1000, 3)
        return [ToolResult(r.content, r.status, r.reward, ms) for r in results]


def _result(name: str, out: Any) -> ToolResult:
    reward: Any = 0.0
    if isinstance(out, tuple) and len(out) == 2:
        out, reward = out
    if not isinstance(out, str) or isinstance(reward, bool) or not isinstance(reward, int | float):
        return ToolResult(f"Error: {name} must return a string or (string, reward), got {out!r}", "error")
    if not math.isfinite(reward):
        return ToolResult(f"Error: {name} returned a non-finite reward {reward!r}", "error")
    return ToolResult(out, "ok", float(reward))


def _bind(fn: Callable[..., Any], arguments: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for `fn`: positional ones (compact parser) mapped to its parameters in order, every value
    converted to its annotated int/float/str/bool; missing or unknown names raise TypeError."""
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if "__positional__" in arguments:
        values = arguments["__positional__"]
        if len(values) > len(params):
            raise TypeError(f"takes {len(params)} arguments, got {len(values)}")
        arguments = {p.name: v for p, v in zip(params, values, strict=False)}
    bound = sig.bind(**arguments)  # TypeError naming a missing or unexpected argument
    hints = {p.name: p.annotation for p in params}
    out = {}
    for name, value in bound.arguments.items():
        kind = hints.get(name)
        if kind in (int, "int") and not isinstance(value, bool):
            value = int(value)
        elif kind in (float, "float"):
            value = float(value)
        elif kind in (str, "str"):
            value = str(value)
        out[name] = value
    return out
