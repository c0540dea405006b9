"""Multi-turn tool rollouts against a scripted engine (canned replies and log-probs): spans, mask, log-prob
alignment, the template delta, budgets, error and timeout observations, a hung tool, and reruns."""

from __future__ import annotations

import json
import textwrap
import time

import pytest

from posttrain_core.models.tokenizer import train_tokenizer
from posttrain_core.rollout.multiturn import TemplateDelta, ToolSettings, Trajectory, row, run
from posttrain_core.rollout.tools import ToolBox, compact, hermes

TOOLS = textwrap.dedent(
    '''
    import time


    def calc(a: int, b: int) -> str:
        """Multiply two numbers.

        Args:
            a: the first factor
            b: the second factor
        """
        return str(a * b)


    def lookup(key: str) -> tuple:
        """The code of a key.

        Args:
            key: the key to look up
        """
        if key == "boom":
            raise KeyError(key)
        return f"code-{key}", 0.5


    def sleepy(seconds: float) -> str:
        """Sleep, then answer.

        Args:
            seconds: how long to sleep
        """
        time.sleep(seconds)
        return "awake"
    '''
)


@pytest.fixture(scope="module")
def tokenizer():
    corpus = ["What is 12 * 34? <tool_call>calc 12 34</tool_call> 408 The answer is 408", "code key lookup"] * 20
    return train_tokenizer(corpus, vocab_size=300)


@pytest.fixture
def toolbox(tmp_path):
    path = tmp_path / "my_tools.py"  # user code outside the package
    path.write_text(TOOLS)
    return ToolBox(tuple(f"{path}:{name}" for name in ("calc", "lookup", "sleepy")))


class Scripted:
    """A token-level engine that replies with canned texts in order per trajectory; log-prob of token j = -(j+1)/100,
    so alignment is visible. Records what it was fed."""

    def __init__(self, tokenizer, replies: dict[str, list[str]], eos: bool = True, max_tokens: int = 32):
        self.tok, self.replies, self.eos, self.max_tokens, self.fed = tokenizer, replies, eos, max_tokens, []

    def __call__(self, contexts, seeds, rows=None):  # `run` passes the prompts' rows, `generate_rows` does not
        max_tokens = self.max_tokens
        outs = []
        for ctx, seed in zip(contexts, seeds, strict=True):
            self.fed.append((list(ctx), seed))
            key, turn = seed
            ids = list(self.tok(self.replies[key][turn], add_special_tokens=False)["input_ids"])
            ids += [self.tok.eos_token_id] if self.eos else []
            finish = "stop" if len(ids) <= max_tokens else "length"
            ids = ids[:max_tokens]
            outs.append(
                {"response_ids": ids, "logprobs": [-(j + 1) / 100 for j in range(len(ids))], "finish_reason": finish}
            )
        return outs


def _trajectories(delta, keys):
    prompt = delta.prompt_ids([{"role": "user", "content": "What is 12 * 34?"}])
    return [Trajectory(k, 0, prompt) for k in keys]


def _run(tokenizer, toolbox, replies, **settings):
    engine = Scripted(tokenizer, replies)
    delta = TemplateDelta(tokenizer, toolbox.schemas)
    trajs = _trajectories(delta, list(replies))
    cfg = ToolSettings(tools=toolbox.references, parser="compact", **settings)
    run(engine, delta, trajs, lambda t, turn: (t.prompt_id, turn), cfg, toolbox)
    return engine, {t.prompt_id: t for t in trajs}


def test_parsers_find_calls_and_report_what_does_not_parse():
    calls = hermes(
        'x <tool_call>{"name": "calc", "arguments": {"a": 1, "b": 2}}</tool_call> <tool_call>{"name": "calc", bad}</tool_call>'
    )
    assert (calls[0].name, calls[0].arguments, calls[0].error) == ("calc", {"a": 1, "b": 2}, None)
    assert calls[1].name == "calc" and "unparsable" in calls[1].error
    assert [(c.name, c.arguments) for c in compact("<tool_call>calc 1 2</tool_call>")] == [
        ("calc", {"__positional__": ["1", "2"]})
    ]
    assert hermes("no call here") == [] and compact("<tool_call></tool_call>")[0].error == "empty tool call"


def test_a_tool_turn_is_spliced_in_as_the_templates_tokens_with_mask_0(tokenizer, toolbox):
    engine, trajs = _run(tokenizer, toolbox, {"p": ["<tool_call>calc 12 34</tool_call>", "The answer is 408"]})
    t = trajs["p"]
    r = row(t)
    assert r["finish_reason"] == "stop" and r["num_turns"] == 2 and r["num_tool_calls"] == 1 and r["tool_errors"] == 0
    a1, tool, a2 = t.turns
    assert tool["status"] == "ok" and tool["content"] == "408" and a2["text"] == "The answer is 408"
    # mask 1 exactly on the sampled tokens; their log-probs as the engine gave them; 0.0 on the tool turn
    assert r["response_mask"] == [1] * (a1["span"][1]) + [0] * (tool["span"][1] - tool["span"][0]) + [1] * (
        a2["span"][1] - a2["span"][0]
    )
    assert r["logprobs"][: a1["span"][1]] == [-(j + 1) / 100 for j in range(a1["span"][1])]
    assert set(r["logprobs"][tool["span"][0] : tool["span"][1]]) == {0.0}
    # token in, token out: the second turn was fed prompt + turn 1 + the delta, and the delta is the suffix a full
    # render of the whole chat has after the first assistant turn
    second_context = engine.fed[1][0]
    assert second_context == t.prompt_ids + t.response_ids[: a2["span"][0]]
    chat = [{"role": "user", "content": "What is 12 * 34?"}, {"role": "assistant", "content": "<tool_call>calc 12 34</tool_call>"},
            {"role": "tool", "content": "408"}]  # fmt: skip
    full = tokenizer(
        tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )["input_ids"]
    assert second_context == list(full)
    assert r["response_text"] == "The answer is 408"


def test_errors_become_observations_and_are_counted(tokenizer, toolbox):
    replies = {
        "unknown": ["<tool_call>nope 1</tool_call>", "done"],
        "raises": ["<tool_call>lookup boom</tool_call>", "done"],
        "badargs": ["<tool_call>calc x y</tool_call>", "done"],
        "toomany": ["<tool_call>calc 1 2 3</tool_call>", "done"],
        "reward": ["<tool_call>lookup k</tool_call>", "done"],
    }
    _, trajs = _run(tokenizer, toolbox, replies)
    content = {k: t.turns[1]["content"] for k, t in trajs.items()}
    assert content["unknown"].startswith("Error: unknown tool 'nope'")
    assert content["raises"] == "Error: lookup raised KeyError: 'boom'"
    assert content["badargs"].startswith("Error: bad arguments for calc")
    assert content["toomany"].startswith("Error: bad arguments for calc: takes 2 arguments, got 3")
    assert trajs["reward"].turns[1]["reward"] == 0.5 and content["reward"] == "code-k"
    assert [row(trajs[k])["tool_errors"] for k in replies] == [1, 1, 1, 1, 0]
    assert all(t.finish == "stop" for t in trajs.values())


def test_a_hung_tool_is_an_observation_at_its_deadline(tokenizer, toolbox):
    started = time.perf_counter()
    _, trajs = _run(tokenizer, toolbox, {"p": ["<tool_call>sleepy 30</tool_call>", "ok"]}, tool_timeout_s=0.5)
    assert time.perf_counter() - started < 5
    tool = trajs["p"].turns[1]
    assert tool["status"] == "timeout" and tool["content"] == "Error: sleepy timed out after 0.5 s"


def test_budgets_end_trajectories(tokenizer, toolbox):
    calling = ["<tool_call>calc 1 2</tool_call>"] * 3
    _, trajs = _run(tokenizer, toolbox, {"p": calling}, max_turns=2)
    assert trajs["p"].finish == "max_turns" and row(trajs["p"])["num_turns"] == 2
    _, trajs = _run(tokenizer, toolbox, {"p": calling}, max_total_tokens=12)
    r = row(trajs["p"])
    assert r["finish_reason"] == "length" and len(r["response_ids"]) <= 12
    _, trajs = _run(tokenizer, toolbox, {"p": ["<tool_call>lookup abcdefghijklmnop</tool_call>", "x"]},
                    max_tool_response_tokens=3)  # fmt: skip
    assert trajs["p"].turns[1]["content"].endswith("...(truncated)")


def test_reruns_are_identical(tokenizer, toolbox):
    replies = {"a": ["<tool_call>calc 2 3</tool_call>", "6"], "b": ["7"]}
    first = [row(t) for t in _run(tokenizer, toolbox, replies)[1].values()]
    again = [row(t) for t in _run(tokenizer, toolbox, replies)[1].values()]
    for x, y in zip(first, again, strict=True):
        x_turns, y_turns = json.loads(x.pop("turns")), json.loads(y.pop("turns"))
        for s in x_turns + y_turns:
            s.pop("latency_ms", None)
        assert x == y and x_turns == y_turns


def test_a_template_that_rewrites_history_is_refused(tokenizer):
    from copy import deepcopy

    tok = deepcopy(tokenizer)
    # renders only the last two messages: adding a turn changes how the earlier ones render
    tok.chat_template = (
        "{% for message in messages[-2:] %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
        "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    with pytest.raises(ValueError, match="not prefix-preserving"):
        TemplateDelta(tok).ids([{"role": "tool", "content": "1"}])


def test_a_tool_without_a_docstring_is_refused_naming_it(tmp_path):
    path = tmp_path / "bad_tools.py"
    path.write_text("def f(x):\n    return str(x)\n")
    with pytest.raises(ValueError, match=r"rollout.tools: '.*bad_tools.py:f' needs type hints and a Google-style"):
        ToolBox((f"{path}:f",))


def test_the_log_prob_gap_is_reported_per_assistant_turn():
    """Assistant turns are the runs of mask-1 tokens; tool tokens (mask 0) never count, whatever their values."""
    import torch

    from posttrain_core.train.rl_stats import LogpChecks

    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 0, 1.0], [1, 1, 1, 0, 0, 0, 0, 0, 0]])
    trainer = torch.tensor([[0.1, 0.1, 9, 9, 0.2, 0.2, 0.2, 9, 0.3], [0.1, 0.1, 0.1, 5, 5, 5, 5, 5, 5]])
    checks = LogpChecks()
    checks.add(torch.zeros(2, 9), trainer, None, mask)
    both = LogpChecks.merge([checks, checks]).metrics()
    got = checks.metrics()
    assert got == pytest.approx(both)
    assert got["logp_mismatch_mean/turn1"] == pytest.approx(0.1)
    assert got["logp_mismatch_mean/turn2"] == pytest.approx(0.2)
    assert got["logp_mismatch_mean/turn3"] == pytest.approx(0.3)
    assert got["logp_mismatch_mean"] == pytest.approx((5 * 0.1 + 3 * 0.2 + 0.3) / 9)
    single = LogpChecks()
    single.add(torch.zeros(1, 3), torch.full((1, 3), 0.1), None, torch.ones(1, 3))
    assert not any("/turn" in k for k in single.metrics())  # single-turn rows: no per-turn keys
