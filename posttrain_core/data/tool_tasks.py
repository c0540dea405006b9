"""Synthetic tasks that need a tool, the tools themselves, and imperfect demonstrations of their use.

Two families of the synthetic data (`DataConfig.families`):
- `lookup`: "What is the code of kqz?" The code of a key is a hash that only the `lookup` tool knows: guessing it is
  right one time in 900.
- `calc`: products of two 3-digit numbers ("What is 347 * 582?", which a tiny model cannot do in its head: the
  `calc` tool can), next to easy products by 0 or 1 ("What is 347 * 0?", "What is 0 * 347?", "What is 347 * 1?")
  that it answers reliably without the tool. Their meta family is `calc-easy`, so accuracy and tool-call rate are
  reported apart. The easy ones must be easy for the model: with products by 10 and 100 its head answers were
  unreliable and RL rightly kept calling the tool on them; with products by 0 alone it never learned to copy digits
  (bench/NOTES.md).

Every problem's `meta` says whether it needs a tool (`needs_tool`); rollout and evaluation metrics then report tool-use
precision (calls made where a tool was needed / all calls) and recall.

The demonstrations call the tools in the compact format (`<tool_call>calc 347 * 582</tool_call>`, the `compact`
parser). `imperfect` makes a share of them wrong the ways real tool-use data is: the call skipped and the answer
guessed, the arguments mangled (a wrong key or operand: the tool answers a different question), or a call made where
none was needed (right, but it costs a call). SFT imitates all three; RL with a verifier and a per-call cost
(`ScoreConfig.tool_call_cost`) unlearns them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import string
from collections.abc import Sequence

TOOLS = ("posttrain_core.data.tool_tasks:lookup", "posttrain_core.data.tool_tasks:calc")
TOOL_FAMILIES = ("lookup", "calc")


def lookup(key: str) -> str:
    """The code of a key, from a table only this tool knows.

    Args:
        key: three lowercase letters, e.g. kqz
    """
    if len(key) != 3 or not key.isalpha() or not key.islower():
        return f"Error: no key {key!r} (keys are three lowercase letters)"
    return str(int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "big") % 900 + 100)


def calc(a: int, op: str, b: int) -> str:
    """The result of a op b.

    Args:
        a: the first integer
        op: one of +, - and *
        b: the second integer
    """
    ops = {"+": a + b, "-": a - b, "*": a * b}
    if op not in ops:
        return f"Error: unknown operator {op!r} (use +, - or *)"
    return str(ops[op])


def _call(text: str) -> str:
    return f"<tool_call>{text}</tool_call>"


def _answer(value: str) -> str:
    from posttrain_core.data.synthetic import ANSWER_PREFIX

    return f"{ANSWER_PREFIX}{value}"


def generate_lookup(rng: random.Random) -> tuple[str, str, str, tuple]:
    """(family, question, answer, demonstration) of one `lookup` problem."""
    key = "".join(rng.choice(string.ascii_lowercase) for _ in range(3))
    code = lookup(key)
    return "lookup", f"What is the code of {key}?", code, _used(f"lookup {key}", code)


def generate_calc(rng: random.Random) -> tuple[str, str, str, tuple]:
    """(family, question, answer, demonstration) of one `calc` problem: a hard product or one by 0."""
    a = rng.randint(100, 999)
    if rng.random() < 0.5:
        b = rng.randint(100, 999)
        return "calc", f"What is {a} * {b}?", str(a * b), _used(f"calc {a} * {b}", str(a * b))
    a, b = rng.choice(((a, 0), (0, a), (a, 1)))
    return "calc-easy", f"What is {a} * {b}?", str(a * b), (("assistant", _answer(str(a * b))),)


def _used(call: str, result: str) -> tuple:
    return (("assistant", _call(call)), ("tool", result), ("assistant", _answer(result)))


def imperfect(problem, rate: float, seed: int):
    """`problem` whose demonstration, with probability `rate`, is one of the three mistakes (module docstring);
    which problems go wrong, and how, is a function of (seed, prompt_id). The answer a verifier checks stays right."""
    rng = random.Random(f"{seed}-tool-mistake-{problem.prompt_id}")
    if rng.random() >= rate:
        return problem
    q = problem.question
    if problem.family == "calc-easy":  # the only mistake open here: a needless call
        a, _, b = q.removeprefix("What is ").removesuffix("?").split()
        demo = _used(f"calc {a} * {b}", problem.answer)
    elif rng.random() < 0.5:  # skip the call and guess
        guess = str(rng.randint(10 ** (len(problem.answer) - 1), 10 ** len(problem.answer) - 1))
        demo = (("assistant", _answer(guess)),)
    elif problem.family == "lookup":  # a wrong key
        key = q.removeprefix("What is the code of ").removesuffix("?")
        i = rng.randrange(3)
        wrong = key[:i] + rng.choice([c for c in string.ascii_lowercase if c != key[i]]) + key[i + 1 :]
        demo = _used(f"lookup {wrong}", lookup(wrong))
    else:  # a wrong operand digit
        a, _, b = q.removeprefix("What is ").removesuffix("?").split()
        i = rng.randrange(1, 3)
        wrong = a[:i] + str((int(a[i]) + rng.randint(1, 9)) % 10) + a[i + 1 :]
        demo = _used(f"calc {wrong} * {b}", calc(int(wrong), "*", int(b)))
    return dataclasses.replace(problem, demo=demo)


def demonstration(problem) -> list[dict]:
    """The messages after the user's question in the SFT data."""
    return [{"role": role, "content": text} for role, text in problem.demo]


def needs_tool(family: str) -> bool | None:
    """Whether problems of `family` need a tool (None: a family without tools)."""
    return {"lookup": True, "calc": True, "calc-easy": False}.get(family)


def tool_texts(problems: Sequence) -> list[str]:
    """Every message of the demonstrations (for the tokenizer corpus)."""
    return [text for p in problems for _, text in p.demo]
