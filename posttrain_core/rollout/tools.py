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

import dataclasses
import functools
import inspect
import json
import math
import re
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
    done: bool = False  # an environment ended the episode


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
        for ref in self.references:
            fn = plugins.load(ref, self.config_field)
            if not callable(fn):
                raise ValueError(f"{self.config_field}: {ref!r} is not a function")
            schema = tool_schema(fn, f"{self.config_field}: {ref!r}")
            name = schema["function"]["name"]
            if name in self.functions:
                raise ValueError(f"{self.config_field}: two tools are named {name!r}")
            self.functions[name] = fn
            self.schemas.append(schema)

    def close(self) -> None:
        """Nothing to release: tools are plain functions (an environment's instances are closed)."""

    def call_all(self, calls: list[ToolCall], timeout_s: float, owners: list[Any] | None = None) -> list[ToolResult]:
        """Run calls at once (`plugins.run_all`), each under the deadline; every failure is an `Error: ...` result, never
        an exception. Tools are stateless: `owners` (the calling trajectories) does not matter here."""
        results: list[ToolResult | None] = []
        jobs = []
        for call in calls:
            fn = self.functions.get(call.name)
            if call.error:
                results.append(ToolResult(f"Error: {call.error}", "error"))
            elif fn is None:
                known = ", ".join(self.functions)
                results.append(ToolResult(f"Error: unknown tool {call.name!r} (tools: {known})", "error"))
            else:
                try:
                    jobs.append(functools.partial(fn, **_bind(fn, call.arguments)))
                    results.append(None)
                except (TypeError, ValueError) as err:
                    results.append(ToolResult(f"Error: bad arguments for {call.name}: {err}", "error"))
        ran = iter(plugins.run_all(jobs, timeout_s, "posttrain-tool"))
        out = []
        for call, r in zip(calls, results, strict=True):
            if r is None:
                status, value, ms = next(ran)
                if status == "timeout":
                    r = ToolResult(f"Error: {call.name} timed out after {timeout_s:g} s", "timeout", latency_ms=ms)
                elif status == "error":
                    r = ToolResult(f"Error: {call.name} raised {type(value).__name__}: {value}", "error", 0.0, ms)
                else:
                    r = dataclasses.replace(_result(call.name, value), latency_ms=ms)
            out.append(r)
        return out


def tool_schema(fn: Callable[..., Any], where: str) -> dict:
    """`fn`'s JSON schema for the chat template's `tools=` (ValueError naming `where` when it has none)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as err:  # noqa: BLE001 - transformers raises several types for a bad docstring
        raise ValueError(
            f"{where} needs type hints and a Google-style docstring with an Args section ({type(err).__name__}: {err})"
        ) from err


def is_number(value: Any) -> bool:
    """An int or float (a bool is not a reward)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _result(name: str, out: Any) -> ToolResult:
    reward: Any = 0.0
    if isinstance(out, tuple) and len(out) == 2:
        out, reward = out
    if not isinstance(out, str) or not is_number(reward):
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
