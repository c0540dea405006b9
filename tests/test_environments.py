"""Stateful environments (the user's class, one instance per trajectory) driven by a scripted policy: seeded starts
shared by a prompt's samples, observations and per-step rewards as tool turns, `done`, the final reward, `close`,
and a failing or hung environment as an observation (or, for a broken reset, a clear error)."""

from __future__ import annotations

import json
import re
import textwrap
import time

import pyarrow as pa
import pytest

from posttrain_core.models.tokenizer import train_tokenizer
from posttrain_core.rollout.engine import SamplingSettings
from posttrain_core.rollout.multiturn import ToolSettings, generate_rows

ENV = textwrap.dedent(
    '''
    import random
    import time


    def guess(digit: int) -> str:
        """Guess the hidden digit.

        Args:
            digit: a digit from 0 to 9
        """


    class Guess:
        """Find a hidden digit: each wrong guess is told "higher" or "lower"."""

        tools = [guess]

        def reset(self, row):
            if row["prompt_id"] == "broken":
                raise KeyError("no such board")
            self.target = random.Random(row["seed"]).randint(0, 9)
            self.log, self.pid, self.solved = row["log"], row["prompt_id"], False
            return "I picked a digit."

        def step(self, call):
            if call.name == "hang":
                time.sleep(30)
            if call.name == "boom":
                raise ValueError("the board broke")
            digit = int(call.arguments["__positional__"][0])
            if digit == self.target:
                self.solved = True
                return "correct", 0.25, True
            return ("higher" if digit < self.target else "lower"), 0.0, False

        def reward(self):
            return 1.0 if self.solved else 0.0

        def close(self):
            with open(self.log, "a") as f:
                f.write(self.pid + "\\n")
    '''
)


@pytest.fixture(scope="module")
def tokenizer():
    corpus = ["I picked a digit. <tool_call>guess 5</tool_call> higher lower correct boom hang"] * 20
    return train_tokenizer(corpus, vocab_size=300)


@pytest.fixture
def env_ref(tmp_path):
    path = tmp_path / "my_env.py"  # user code outside the package
    path.write_text(ENV)
    return f"{path}:Guess"


def bisect(tokenizer, special=None):
    """A scripted policy: binary search on the observations it has seen (or a fixed call for prompt `special`)."""

    def generate(contexts, seeds):
        outs = []
        for ctx in contexts:
            text = tokenizer.decode(ctx)
            seen = re.findall(r"<\|im_start\|>tool\n(\w+)<\|im_end\|>", text)
            lo, hi = 0, 9
            guesses = [int(g) for g in re.findall(r"<tool_call>guess (\d)</tool_call>", text)]
            for g, obs in zip(guesses, seen, strict=False):
                lo, hi = (g + 1, hi) if obs == "higher" else (lo, g - 1) if obs == "lower" else (lo, hi)
            reply = f"<tool_call>guess {(lo + hi) // 2}</tool_call>"
            if special and special[0] in text and not seen:
                reply = special[1]
            if seen and seen[-1] != "higher" and seen[-1] != "lower":
                reply = "found it"
            ids = list(tokenizer(reply, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
            outs.append({"response_ids": ids, "logprobs": [-0.5] * len(ids), "finish_reason": "stop"})
        return outs

    return generate


def _prompts(log, ids=("p1", "p2")) -> pa.Table:
    return pa.table(
        {
            "prompt_id": list(ids),
            "messages": [[{"role": "user", "content": f"Find the digit ({i})."}] for i in ids],
            "meta": [json.dumps({"family": "guess", "log": str(log)}) for _ in ids],
        }
    )


def _settings(env_ref, **kw) -> SamplingSettings:
    tools = ToolSettings(tools=(), environment=env_ref, parser="compact", max_turns=5, max_total_tokens=200, **kw)
    return SamplingSettings(n=2, temperature=1.0, max_tokens=16, seed=0, tools=tools)


def test_an_environment_runs_each_trajectory_to_done(tokenizer, env_ref, tmp_path):
    log = tmp_path / "closed.txt"
    rows = generate_rows(bisect(tokenizer), tokenizer, _prompts(log), _settings(env_ref), "digest")
    assert len(rows) == 4
    by = {(r["prompt_id"], r["sample_index"]): r for r in rows}
    for pid in ("p1", "p2"):  # a prompt's samples start from the same hidden digit: same observations
        a, b = by[(pid, 0)], by[(pid, 1)]
        assert a["response_ids"] == b["response_ids"] and a["prompt_ids"] == b["prompt_ids"]
    for r in rows:
        turns = json.loads(r["turns"])
        tools = [s for s in turns if s["role"] == "tool"]
        assert tools[-1]["content"] == "correct" and tools[-1]["reward"] == 0.25
        assert all(s["content"] in ("higher", "lower") and s["reward"] == 0.0 for s in tools[:-1])
        assert r["finish_reason"] == "stop" and r["num_tool_calls"] == len(tools) == r["num_turns"]
        assert turns[-1] == {"role": "environment", "reward": 1.0}
        # the reset's observation is part of the prompt, as a user message
        assert "I picked a digit." in tokenizer.decode(r["prompt_ids"])
    assert sorted(log.read_text().split()) == ["p1", "p1", "p2", "p2"]  # every instance closed


def test_a_failing_or_hung_step_is_an_observation(tokenizer, env_ref, tmp_path):
    log = tmp_path / "closed.txt"
    policy = bisect(tokenizer, ("(p1)", "<tool_call>boom</tool_call>"))
    rows = generate_rows(policy, tokenizer, _prompts(log), _settings(env_ref), "d")
    first = json.loads(next(r for r in rows if r["prompt_id"] == "p1")["turns"])[1]
    assert first["status"] == "error" and first["content"] == "Error: boom raised ValueError: the board broke"

    started = time.perf_counter()
    policy = bisect(tokenizer, ("(p1)", "<tool_call>hang</tool_call>"))
    rows = generate_rows(policy, tokenizer, _prompts(log), _settings(env_ref, tool_timeout_s=0.5), "d")
    assert time.perf_counter() - started < 10
    hung = [r for r in rows if r["prompt_id"] == "p1"]
    for r in hung:  # the instance may still be inside the call: its trajectory ends there, and it is not closed
        turns = json.loads(r["turns"])
        assert turns[1]["status"] == "timeout" and r["finish_reason"] == "stop" and r["num_turns"] == 1
    assert all(json.loads(r["turns"])[-1]["reward"] == 1.0 for r in rows if r["prompt_id"] == "p2")


def test_a_broken_reset_fails_naming_the_class_and_prompt(tokenizer, env_ref, tmp_path):
    with pytest.raises(RuntimeError, match=r"my_env.py:Guess'.*prompt 'broken': reset raised KeyError"):
        generate_rows(bisect(tokenizer), tokenizer, _prompts(tmp_path / "l", ("broken",)), _settings(env_ref), "d")


def test_an_environment_without_step_is_refused(tmp_path):
    from posttrain_core.rollout.environments import Environments

    path = tmp_path / "half_env.py"
    path.write_text("class Half:\n    def reset(self, row):\n        return None\n")
    with pytest.raises(ValueError, match=r"half_env.py:Half' has no step method"):
        Environments(f"{path}:Half")
