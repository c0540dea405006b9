"""Multi-turn rollouts with tool calls, token in, token out, over any engine's token-level generate.

One trajectory per (prompt, sample): the engine samples an assistant turn for every trajectory still running (one
batched call per turn), the parser finds its tool calls, the tools run under a deadline, and each tool turn is
appended as the chat template's own tokens for it. The policy's sampled ids are never decoded and re-encoded: what
the trainer scores is exactly what the engine sampled, with `response_mask` 1 on those tokens and 0 (log-prob exactly
0.0) on the template's tool turns and boundary tokens.

The template delta of a tool turn is `render(prefix + tool messages, generation prompt)` minus `render(prefix)` for a
fixed synthetic prefix ending in an assistant turn, plus the boundary text the template puts after the end-of-turn
token (ChatML's newline after `<|im_end|>`, which generation stops before). A template that does not render the
prefix as a prefix of the longer chat (one that rewrites history) is refused, naming it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from posttrain_core.rollout.environments import Environments, environment_seed
from posttrain_core.rollout.tools import PARSERS, ToolBox, ToolCall, ToolResult

Caller = ToolBox | Environments  # what runs the calls: stateless tools, or one environment instance per trajectory

# sample(contexts, seeds[, vision=]) -> per context {"response_ids", "logprobs", "finish_reason"}: one assistant turn
# each, at most the sampling settings' max_tokens (an engine's `_sample` with its settings bound)
TokenGenerate = Callable[..., list[dict]]

_PREFIX = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]


@dataclass(frozen=True)
class ToolSettings:
    """The multi-turn limits (from `RolloutConfig`; plain and picklable, it crosses the Ray boundary)."""

    tools: tuple[str, ...]
    environment: str | None = None
    parser: str = "hermes"
    max_turns: int = 4
    max_tool_calls_per_turn: int = 1
    tool_timeout_s: float = 10.0
    max_tool_response_tokens: int = 64
    max_total_tokens: int = 256


@dataclass
class Trajectory:
    prompt_id: str
    sample_index: int
    prompt_ids: list[int]
    row: int = 0  # its prompt's row in the prompts table
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)
    finish: str | None = None
    last_text: str = ""

    @property
    def key(self) -> tuple[str, int]:
        return self.prompt_id, self.sample_index

    def append(self, ids: list[int], logprobs: list[float] | None) -> tuple[int, int]:
        start = len(self.response_ids)
        self.response_ids += ids
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.response_mask += [1 if logprobs is not None else 0] * len(ids)
        return start, len(self.response_ids)


class TemplateDelta:
    """Token ids of tool turns as the tokenizer's chat template renders them after a finished assistant turn."""

    def __init__(self, tokenizer: Any, tool_schemas: list[dict] | None = None):
        self.tokenizer, self.schemas = tokenizer, tool_schemas or None
        eos = tokenizer.eos_token
        base = self._render(_PREFIX, False)
        cut = base.rfind(eos) if eos else -1
        if cut < 0:
            raise ValueError(f"chat template of {self._name()}: the end-of-turn token {eos!r} is not in its render")
        self.boundary = base[cut + len(eos) :]  # e.g. ChatML's "\n" after <|im_end|>
        self.base = base

    def ids(self, messages: list[dict]) -> list[int]:
        full = self._render(_PREFIX + messages, True)
        if not full.startswith(self.base):
            raise ValueError(
                f"chat template of {self._name()} is not prefix-preserving: rendering a tool turn after a chat "
                "changes how the earlier turns render, so token-in-token-out rollouts would train on a context the "
                "template never shows; use a template that renders earlier turns unchanged"
            )
        delta = self.boundary + full[len(self.base) :]
        return list(self.tokenizer(delta, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The first prompt, with the tools' schemas for templates that render them."""
        text = self._render(list(messages), True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        kwargs = {"tools": self.schemas} if self.schemas else {}
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
        )

    def _name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "") or type(self.tokenizer).__name__


def run(
    generate: Callable[[list[list[int]], list[int], list[int]], list[dict]],
    delta: TemplateDelta,
    trajectories: list[Trajectory],
    seeds: Callable[[Trajectory, int], int],
    settings: ToolSettings,
    caller: Caller,
) -> None:
    """Run every trajectory to its end (in place): "stop" (a turn with no tool call, or the environment said done),
    "length" (the token budget) or "max_turns" (still calling tools after the last turn).

    Args:
        generate: the engine's token-level sampler, given the contexts, their seeds and their prompts' rows.
        delta: the chat template's tool turns, for the tokenizer the engine samples with.
        seeds: the seed of a trajectory's turn (each turn its own stream: same seed, same trajectories).
        caller: runs the calls of a turn (its owners are the trajectories' `key`s).
    """
    parse = PARSERS[settings.parser]
    tokenizer = delta.tokenizer
    for turn in range(settings.max_turns):
        active = [t for t in trajectories if t.finish is None]
        if not active:
            break
        contexts = [t.prompt_ids + t.response_ids for t in active]
        outs = generate(contexts, [seeds(t, turn) for t in active], [t.row for t in active])
        calling: list[tuple[Trajectory, list[ToolCall]]] = []
        for t, out in zip(active, outs, strict=True):
            calls = _append_assistant_turn(t, out, tokenizer, parse, settings)
            if calls:
                calling.append((t, calls))
        owners = [t.key for t, calls in calling for _ in calls]
        results = iter(caller.call_all([c for _, calls in calling for c in calls], settings.tool_timeout_s, owners))
        for t, calls in calling:
            done = _append_tool_turns(t, calls, [next(results) for _ in calls], delta, tokenizer, settings)
            if done and t.finish is None:
                t.finish = "stop"
    for t in trajectories:
        if t.finish is None:
            t.finish = "max_turns"


def _append_assistant_turn(
    t: Trajectory, out: dict, tokenizer: Any, parse: Callable[[str], list[ToolCall]], settings: ToolSettings
) -> list[ToolCall]:
    """Append one sampled turn (cut to the token budget); the calls to run, or [] when the trajectory ended."""
    left = settings.max_total_tokens - len(t.response_ids)
    ids, logps = out["response_ids"][:left], out["logprobs"][:left]
    span = t.append(ids, logps)
    t.last_text = tokenizer.decode(ids, skip_special_tokens=True)
    calls = parse(t.last_text)
    t.turns.append(
        {"role": "assistant", "span": list(span), "text": t.last_text, "finish": out["finish_reason"],
         "calls": [{"name": c.name, "arguments": c.arguments, "raw": c.raw, "parse_error": c.error} for c in calls]}
    )  # fmt: skip
    if len(ids) < len(out["response_ids"]) or out["finish_reason"] == "length":
        t.finish = "length"
    elif not calls:
        t.finish = "stop"
    return calls[: settings.max_tool_calls_per_turn] if t.finish is None else []


def _append_tool_turns(
    t: Trajectory, calls: list[ToolCall], results: list[ToolResult], delta: TemplateDelta, tokenizer: Any,
    settings: ToolSettings,
) -> bool:  # fmt: skip
    """Append the turn's tool results; whether the environment ended the episode."""
    messages = []
    for r in results:
        ids = tokenizer(r.content, add_special_tokens=False)["input_ids"]
        content = r.content
        if len(ids) > settings.max_tool_response_tokens:  # cut before appending, so the budget counts what is kept
            content = tokenizer.decode(ids[: settings.max_tool_response_tokens]) + " ...(truncated)"
        messages.append({"role": "tool", "content": content})
    ids = delta.ids(messages)
    if len(t.response_ids) + len(ids) > settings.max_total_tokens:
        t.finish = "length"
        return False
    span = t.append(ids, None)
    for c, r, m in zip(calls, results, messages, strict=True):
        t.turns.append(
            {"role": "tool", "span": list(span), "name": c.name, "content": m["content"], "status": r.status,
             "latency_ms": r.latency_ms, "reward": r.reward}
        )  # fmt: skip
    return any(r.done for r in results)


def row(t: Trajectory) -> dict:
    """The trajectory as a `rollouts` row's multi-turn columns, after checking its invariants."""
    n = len(t.response_ids)
    if not (n == len(t.logprobs) == len(t.response_mask)):
        raise AssertionError(f"trajectory {t.prompt_id}/{t.sample_index}: ids, log-probs and mask differ in length")
    policy = {i for s in t.turns if s["role"] == "assistant" for i in range(*s["span"])}
    if policy != {i for i, m in enumerate(t.response_mask) if m}:
        raise AssertionError(f"trajectory {t.prompt_id}/{t.sample_index}: mask-1 tokens are not the assistant spans")
    if any(lp != 0.0 for lp, m in zip(t.logprobs, t.response_mask, strict=True) if not m):
        raise AssertionError(f"trajectory {t.prompt_id}/{t.sample_index}: a tool token has a nonzero log-prob")
    tools = [s for s in t.turns if s["role"] == "tool"]
    return {
        "response_ids": t.response_ids,
        "logprobs": t.logprobs,
        "response_mask": t.response_mask,
        "response_text": t.last_text,
        "finish_reason": t.finish or "length",
        "turns": json.dumps(t.turns),
        "num_turns": sum(1 for s in t.turns if s["role"] == "assistant"),
        "num_tool_calls": len(tools),
        "tool_errors": sum(1 for s in tools if s["status"] != "ok"),
    }


def generate_rows(
    sample: TokenGenerate, tokenizer: Any, prompts: Any, params: Any, policy_digest: str, vision: Any = None
) -> list[dict]:
    """`params.n` trajectories of every prompt row (a `prompts` table) as `rollouts` rows, for an engine whose
    token-level sampler is `sample` (contexts, seeds). Turn 0 of a sample draws the stream a single-turn sample would;
    turn k > 0 its own, so the same seed gives the same trajectories. With an environment, each trajectory's instance
    is reset first (its observation joins the prompt as a user message), its final `reward()` becomes a last `turns`
    segment {"role": "environment", "reward": r}, and every instance is closed at the end.

    With `vision` (a VLM's `VisionSpec`), a prompt's images are expanded into its ids as for one turn, every turn's
    forward gets its prompt's pixels (`sample(contexts, seeds, vision=Vision)`), and the rows keep the images for
    training."""
    from posttrain_core.rollout.hf_engine import Vision, sample_seed

    settings: ToolSettings = params.tools
    caller: Caller = Environments(settings.environment) if settings.environment else ToolBox(settings.tools)
    try:
        delta = TemplateDelta(tokenizer, caller.schemas)
        rows = prompts.to_pylist()
        trajectories = [Trajectory(r["prompt_id"], k, [], i) for i, r in enumerate(rows) for k in range(params.n)]
        encoded: dict[Any, list[int]] = {}
        built: dict[int, Any] = {}  # row -> its prompt's pixels (`vision.inputs.Prompt`)
        for t, r in zip(trajectories, (r for r in rows for _ in range(params.n)), strict=True):
            messages = list(r["messages"])
            if isinstance(caller, Environments):
                first = caller.reset(t.key, _env_row(r), settings.tool_timeout_s)
                messages += [{"role": "user", "content": first}] if first is not None else []
            text = json.dumps(messages) if vision is None else (json.dumps(messages), t.row)  # a row's own images
            if text not in encoded:
                if vision is None:
                    encoded[text] = delta.prompt_ids(messages)
                else:
                    where = f"prompt {r['prompt_id']!r}"
                    built[t.row] = vision.prompt(tokenizer, messages, r.get("images"), where, delta.prompt_ids)
                    encoded[text] = built[t.row].ids
            t.prompt_ids = encoded[text]

        def generate(contexts: list[list[int]], seeds: list[int], of: list[int]) -> list[dict]:
            if vision is None:
                return sample(contexts, seeds)
            pixels = [built[i].pixel_values for i in of]
            return sample(contexts, seeds, vision=Vision(vision, pixels, [built[i].grid_thw for i in of], list(of)))

        def seed(t: Trajectory, turn: int) -> int:
            return sample_seed(
                params.seed, t.prompt_id if turn == 0 else f"{t.prompt_id}\x1eturn{turn}", t.sample_index
            )

        run(generate, delta, trajectories, seed, settings, caller)
        if isinstance(caller, Environments):
            for t in trajectories:
                final = caller.final_reward(t.key)
                if final is not None:
                    t.turns.append({"role": "environment", "reward": final})
    finally:
        caller.close()
    return [
        {"prompt_id": t.prompt_id, "sample_index": t.sample_index, "prompt_ids": t.prompt_ids,
         "answer": rows[t.row].get("answer"), "policy_digest": policy_digest,
         "images": (rows[t.row].get("images") or None) if vision is not None else None, **row(t)}
        for t in trajectories
    ]  # fmt: skip


def _env_row(r: dict) -> dict:
    """What an environment's reset sees: prompt_id, answer, messages, seed (a function of prompt_id) and the meta
    columns."""
    meta = json.loads(r["meta"]) if r.get("meta") else {}
    return {**meta, "prompt_id": r["prompt_id"], "answer": r.get("answer"), "messages": r["messages"],
            "seed": environment_seed(r["prompt_id"])}  # fmt: skip
