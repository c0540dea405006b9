"""Stateful environments for multi-turn rollouts: the user's class, one instance per trajectory.

An environment is referenced like a tool (`"pkg.module:Class"` or `"path/file.py:Class"`, `ToolConfig.environment`)
and has:
    reset(row) -> str | None         the trajectory's start; `row` holds prompt_id, answer, seed and the prompt's meta
                                     columns; a string is appended to the prompt as a user message
    step(call) -> (observation, reward, done)
                                     one tool call the policy made (`tools.ToolCall`: name, arguments, raw)
    reward() -> float                optional: the trajectory's final reward, asked for once it ends
    close()                          optional: always called, also when the rollout fails
    tools                            optional class attribute: functions whose JSON schemas the chat template renders

`row["seed"]` is a function of prompt_id alone, so every sample of a GRPO group starts from the same state. Calls of
one trajectory run in order, on a thread of their own, under the tool deadline; like tools, an exception, a
malformed return or a timeout is an `Error: ...` observation. A step past its deadline also ends its trajectory: the
instance may still be inside that call, so nothing else may touch it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import logging
import math
from typing import Any

from posttrain_core import plugins
from posttrain_core.rollout.tools import ToolCall, ToolResult, is_number, tool_schema

REQUIRED = ("reset", "step")
log = logging.getLogger(__name__)


def environment_seed(prompt_id: str) -> int:
    """The seed of every trajectory of a prompt (a GRPO group shares its start)."""
    return int.from_bytes(hashlib.blake2b(prompt_id.encode(), digest_size=8).digest(), "big") >> 1


class Environments:
    """The instances of one environment class, by trajectory.

    Raises (at construction, before any generation):
        ValueError: the reference does not load, is not a class, lacks reset/step, or its `tools` give no schema;
            the message names `config_field` and the reference.
    """

    def __init__(self, reference: str, config_field: str = "rollout.tools.environment"):
        self.reference, self.field = reference, config_field
        self.cls = plugins.load(reference, config_field)
        if not inspect.isclass(self.cls):
            raise ValueError(f"{config_field}: {reference!r} is not a class")
        missing = [m for m in REQUIRED if not callable(getattr(self.cls, m, None))]
        if missing:
            raise ValueError(f"{config_field}: {reference!r} has no {' or '.join(missing)} method")
        where = f"{config_field}: {reference!r}.tools"
        self.schemas = [
            tool_schema(fn, f"{where}: {getattr(fn, '__name__', fn)!r}") for fn in getattr(self.cls, "tools", ())
        ]
        self.instances: dict[Any, Any] = {}
        self.hung: set[Any] = set()

    def reset(self, owner: Any, row: dict, timeout_s: float) -> str | None:
        """A new instance for `owner` (a trajectory), reset on `row`; its first observation or None.

        Raises:
            RuntimeError: the constructor or reset raised, hung past `timeout_s`, or returned neither a string nor
                None; the message names the class and the prompt (a broken start is the environment's bug, not
                something the policy did).
        """
        where = f"{self.field} {self.reference!r}, prompt {row.get('prompt_id')!r}"
        [(status, first, _)] = plugins.run_all([functools.partial(self._start, owner, row)], timeout_s, "posttrain-env")
        if status == "timeout":
            self.hung.add(owner)
            raise RuntimeError(f"{where}: reset took longer than {timeout_s:g} s")
        if status == "error":
            raise RuntimeError(f"{where}: reset raised {type(first).__name__}: {first}") from first
        if first is not None and not isinstance(first, str):
            raise RuntimeError(f"{where}: reset must return a string or None, got {first!r}")
        return first

    def _start(self, owner: Any, row: dict) -> Any:
        env = self.cls()
        self.instances[owner] = env
        return env.reset(row)

    def call_all(self, calls: list[ToolCall], timeout_s: float, owners: list[Any] | None = None) -> list[ToolResult]:
        """Step each owner's instance with its calls, in order; owners run at once (`plugins.run_all`), under the
        deadline."""
        by_owner: dict[Any, list[int]] = {}
        for i, owner in enumerate(owners or []):
            by_owner.setdefault(owner, []).append(i)
        jobs = [functools.partial(self._steps, o, [calls[i] for i in idx]) for o, idx in by_owner.items()]
        ran = plugins.run_all(jobs, timeout_s, "posttrain-env")
        results: list[ToolResult | None] = [None] * len(calls)
        for (owner, idx), (status, got, ms) in zip(by_owner.items(), ran, strict=True):
            if status != "ok":  # _steps catches the environment's exceptions: a timeout (or a BaseException) gets here
                self.hung.add(owner)
                got = [ToolResult(f"Error: the environment timed out after {timeout_s:g} s", "timeout", done=True)]
                got += [ToolResult("Error: not run (the environment timed out)", "error", done=True)] * (len(idx) - 1)
            for i, r in zip(idx, got, strict=True):
                results[i] = dataclasses.replace(r, latency_ms=ms)
        return [r for r in results if r is not None]

    def _steps(self, owner: Any, calls: list[ToolCall]) -> list[ToolResult]:
        env, out = self.instances[owner], []
        for call in calls:
            if call.error:
                out.append(ToolResult(f"Error: {call.error}", "error"))
                continue
            try:
                got = env.step(call)
            except Exception as err:  # noqa: BLE001 - the environment's error is the model's observation
                out.append(ToolResult(f"Error: {call.name} raised {type(err).__name__}: {err}", "error"))
                continue
            out.append(_step_result(got))
            if out[-1].done:
                break  # the episode is over: later calls of this turn are not run
        return out + [ToolResult("Error: not run (the episode ended)", "error", done=True)] * (len(calls) - len(out))

    def final_reward(self, owner: Any) -> float | None:
        """The instance's `reward()`, if it has one (an error or a non-finite value: the RuntimeError names it)."""
        env = self.instances.get(owner)
        if owner in self.hung or env is None or not callable(getattr(env, "reward", None)):
            return None
        value = env.reward()
        if not is_number(value) or not math.isfinite(value):
            raise RuntimeError(f"{self.field} {self.reference!r}: reward() must return a finite number, got {value!r}")
        return float(value)

    def close(self) -> None:
        """Close every instance that is not stuck in a call (a failing close is logged: the rows are kept)."""
        for owner, env in self.instances.items():
            if owner not in self.hung and callable(getattr(env, "close", None)):
                try:
                    env.close()
                except Exception:  # noqa: BLE001 - a failing close must not lose the trajectories
                    log.warning("%s %r: close() raised for %s", self.field, self.reference, owner, exc_info=True)
        self.instances.clear()


def _step_result(got: Any) -> ToolResult:
    if not (isinstance(got, tuple) and len(got) == 3):
        return ToolResult(f"Error: step must return (observation, reward, done), got {got!r}", "error")
    observation, reward, done = got
    if not isinstance(observation, str) or not is_number(reward):
        return ToolResult(f"Error: step must return (str, float, bool), got {got!r}", "error")
    if not math.isfinite(reward):
        return ToolResult(f"Error: step returned a non-finite reward {reward!r}", "error")
    return ToolResult(observation, "ok", float(reward), done=bool(done))
