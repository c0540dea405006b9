"""Synthetic tasks with verifiable answers (arithmetic, letter reversal, tasks that need a tool: `tool_tasks`, and
questions about a picture: `shapes`), deterministic from a seed.

They feed every stage of the demo pipeline: tokenizer corpus, pretraining text, SFT, preferences, RL prompts, eval.
Arithmetic solutions are worked column by column before "The answer is N" (a short chain of thought): a 0.8M-parameter
model learns the steps from a few thousand examples, where it stays near chance on bare answers (docs/performance.md).
"""

from __future__ import annotations

import dataclasses
import json
import random
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pyarrow as pa

from posttrain_core.data import shapes, tool_tasks
from posttrain_core.data.schemas import IMAGES, validate_table
from posttrain_core.vision.images import IMAGE_MARKER

FAMILIES = ("arithmetic", "reverse")  # the demo's; tool_tasks.TOOL_FAMILIES and VISUAL_FAMILIES are the others

FILLER_SENTENCES = (
    "Arithmetic is the study of numbers and the operations on them.",
    "To reverse a word, read its letters from the last to the first.",
    "Each question below is followed by its answer.",
    "Addition combines two numbers into their sum.",
    "Subtraction finds the difference between two numbers.",
    "Multiplication is repeated addition.",
    "A careful reader checks every answer twice.",
    "Letters can be read forwards or backwards.",
)


@dataclass(frozen=True)
class Problem:
    """One task instance: the question a user asks and the exact answer a verifier checks."""

    prompt_id: str
    family: str
    question: str
    answer: str
    solution: str  # what the assistant says in the SFT data: the answer, or worked steps ending in it
    demo: tuple[tuple[str, str], ...] = ()  # tool families: the (role, text) turns after the question instead
    image: bytes | None = None  # visual families: the picture (PNG) the question is about, shown before it


def _operand(rng: random.Random, max_digits: int) -> int:
    digits = rng.randint(1, max_digits)  # the length first, then the value: short operands are as common as long
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def _arithmetic(rng: random.Random, max_digits: int) -> tuple[str, str]:
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randint(0, 9), rng.randint(0, 9)  # products of single digits keep the task learnable
    else:
        a, b = _operand(rng, max_digits), _operand(rng, max_digits)
    if op == "-" and a < b:
        a, b = b, a  # non-negative results only
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"What is {a} {op} {b}?", str(value)


def _reverse(rng: random.Random, max_digits: int) -> tuple[str, str]:
    # Letters are space-separated so that any BPE tokenizer sees one token per letter: the task is then about
    # positions (learnable by a tiny model in a few hundred steps), not about undoing arbitrary subword merges.
    letters = [rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 5))]
    return f"Reverse the letters: {' '.join(letters)}", " ".join(reversed(letters))


_GENERATORS: dict[str, Callable[[random.Random, int], tuple[str, str]]] = {
    "arithmetic": _arithmetic,
    "reverse": _reverse,
}
_TOOL_GENERATORS = {"lookup": tool_tasks.generate_lookup, "calc": tool_tasks.generate_calc}
_VISUAL_GENERATORS = {"shapes": shapes.generate}
VISUAL_FAMILIES = tuple(_VISUAL_GENERATORS)

ANSWER_PREFIX = "The answer is "


def worked_solution(question: str, max_digits: int, slip: tuple[int, int] | None = None) -> str:
    """The arithmetic question's solution worked column by column, units first, ending in "The answer is N".

    Every + and - has `max_digits` columns (short operands padded with 0), so each step sits at the same place:
        37 + 45 -> "7 + 5 = 12, 3 + 4 + 1 = 8. The answer is 82"
        52 - 17 -> "12 - 7 = 5, 5 - 1 - 1 = 3. The answer is 35"   (a borrow shows as 10 + digit, then - 1)
        7 * 8   -> "7 * 8 = 56. The answer is 56"                   (single digits: one fact)

    Args:
        slip: (column, +1 or -1): that column's result is written off by one and the rest of the solution follows
            from it, carries and final answer included (37 + 45 with (0, +1): "7 + 5 = 13, 3 + 4 + 1 = 8. The
            answer is 83"): a consistent worked solution with one arithmetic slip, as imperfect demonstrations
            have. A result that would leave its range (below 0; above 9 for a borrow column) moves the other way.
    """
    x, op, y = question.removeprefix("What is ").removesuffix("?").split()
    a, b = int(x), int(y)
    col, delta = slip or (-1, 0)
    if op == "*":
        value = a * b + (delta if col == 0 and a * b + delta >= 0 else -delta)
        return f"{a} * {b} = {value}. {ANSWER_PREFIX}{value}"
    steps, carry, value = [], 0, 0
    columns = max(max_digits, len(x), len(y))
    for i in range(columns):
        da, db = a // 10**i % 10, b // 10**i % 10
        if op == "+":
            total = da + db + carry
            total += (delta if total + delta >= 0 else -delta) if i == col else 0
            steps.append(f"{da} + {db}{' + 1' if carry else ''} = {total}")
            value += (total if i == columns - 1 else total % 10) * 10**i
            carry = total // 10
        else:
            borrow = int(da - carry < db)
            result = da + 10 * borrow - db - carry
            result += (delta if 0 <= result + delta <= 9 else -delta) if i == col else 0
            steps.append(f"{da + 10 * borrow} - {db}{' - 1' if carry else ''} = {result}")
            value += result * 10**i
            carry = borrow
    return f"{', '.join(steps)}. {ANSWER_PREFIX}{value}"


def with_slips(problems: Sequence[Problem], rate: float, max_digits: int, seed: int = 0) -> list[Problem]:
    """`problems` where a `rate` fraction of the worked arithmetic solutions carry one slip (`worked_solution`), a
    `rate` fraction of the tool demonstrations one mistake (`tool_tasks.imperfect`), and a `rate` fraction of the
    pictures a wrong label (`shapes.mislabel`).

    The `answer` (what verifiers check) stays right: only the demonstration is wrong. Which problems slip, in which
    column and which way is a function of (seed, prompt_id), so a problem slips the same way in every dataset.
    """
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"slip rate must be within [0, 1], got {rate}")
    out = []
    for p in problems:
        rng = random.Random(f"{seed}-slip-{p.prompt_id}")
        if p.demo:
            p = tool_tasks.imperfect(p, rate, seed)
        elif p.family == "arithmetic" and p.solution != p.answer and rng.random() < rate:
            columns = 1 if "*" in p.question else max(max_digits, *(len(t) for t in p.question.split()[2::2]))
            slip = (rng.randrange(columns), rng.choice((-1, 1)))
            p = dataclasses.replace(p, solution=worked_solution(p.question, max_digits, slip))
        elif p.family in _VISUAL_GENERATORS and rng.random() < rate:
            p = dataclasses.replace(p, solution=ANSWER_PREFIX + shapes.mislabel(p.question, p.answer, rng))
        out.append(p)
    return out


def make_problems(
    families: Sequence[str] = FAMILIES, n: int = 1000, seed: int = 0, max_digits: int = 2, worked: bool = True
) -> list[Problem]:
    """n problems with distinct questions, round-robin over `families`, the same for the same arguments.

    Each family draws from its own generator seeded by (seed, family), so the first k problems of a family do not
    depend on n or on the other families. Visual families repeat their few question texts: what is distinct there
    is the (question, picture) pair.

    Args:
        families: names from `FAMILIES`.
        n: how many problems in all.
        seed: the random seed.
        max_digits: most digits of an arithmetic operand (+ and -; * always uses single digits). Each operand's
            length is drawn uniformly from 1..max_digits, then its value among the numbers of that length.
        worked: arithmetic solutions show their column-by-column steps (`worked_solution`); False: the bare answer.
    """
    known = (*_GENERATORS, *_TOOL_GENERATORS, *_VISUAL_GENERATORS)
    unknown = [f for f in families if f not in known]
    if unknown or not families:
        raise ValueError(f"unknown families {unknown or list(families)}; known: {', '.join(known)}")
    if max_digits < 1:
        raise ValueError(f"max_digits must be >= 1, got {max_digits}")
    rngs = {f: random.Random(f"{seed}-{f}") for f in families}
    counts = dict.fromkeys(families, 0)
    seen: set[tuple[str, bytes | None]] = set()
    problems = []
    for i in range(n):
        family = families[i % len(families)]
        for _ in range(10_000):
            image = None
            if family in _TOOL_GENERATORS:
                kind, question, answer, demo = _TOOL_GENERATORS[family](rngs[family])
            elif family in _VISUAL_GENERATORS:
                kind, (question, answer, image), demo = family, _VISUAL_GENERATORS[family](rngs[family]), ()
            else:
                kind, (question, answer), demo = family, _GENERATORS[family](rngs[family], max_digits), ()
            if (question, image) not in seen:
                break
        else:
            raise ValueError(
                f"family {family!r} ran out of distinct questions after {counts[family]} (raise max_digits)"
            )
        seen.add((question, image))
        if family in _VISUAL_GENERATORS:
            solution = ANSWER_PREFIX + answer  # a one-word answer in the form exact_match reads
        else:
            solution = worked_solution(question, max_digits) if worked and family == "arithmetic" else answer
        problems.append(Problem(f"{family}-{counts[family]:05d}", kind, question, answer, solution, demo, image))
        counts[family] += 1
    return problems


def split_train_eval(problems: Sequence[Problem], n_eval: int, seed: int = 0) -> tuple[list[Problem], list[Problem]]:
    """A random eval set of n_eval problems and the rest as train; no question (with its picture) appears in both.

    Both lists keep the input order. Duplicated questions in the input all go to the side their first copy drew.
    """
    questions = list(dict.fromkeys((p.question, p.image) for p in problems))
    if not 0 <= n_eval <= len(questions):
        raise ValueError(f"n_eval={n_eval} is not within 0..{len(questions)} (distinct questions)")
    eval_questions = set(random.Random(seed).sample(questions, n_eval))
    train = [p for p in problems if (p.question, p.image) not in eval_questions]
    evals = [p for p in problems if (p.question, p.image) in eval_questions]
    return train, evals


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _ask(p: Problem) -> list[dict]:
    """The user turn: the question, after its picture's marker for a visual problem."""
    return _user(f"{IMAGE_MARKER}\n{p.question}" if p.image is not None else p.question)


def _images(problems: Sequence[Problem]) -> pa.Array:
    return pa.array([None if p.image is None else [p.image] for p in problems], IMAGES)


def _assistant(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def _reply(p: Problem) -> list[dict]:
    return tool_tasks.demonstration(p) if p.demo else _assistant(p.solution)


def _meta(p: Problem) -> str:
    needs = tool_tasks.needs_tool(p.family)
    return json.dumps({"family": p.family} if needs is None else {"family": p.family, "needs_tool": needs})


def prompts_table(problems: Sequence[Problem]) -> pa.Table:
    """A `prompts` table: one user message per problem, its answer, and meta {"family": ...} (tool families: and
    "needs_tool"); visual problems: an `<image>` marker before the question and the picture in `images`."""
    return validate_table(
        pa.table(
            {
                "prompt_id": [p.prompt_id for p in problems],
                "messages": [_ask(p) for p in problems],
                "answer": [p.answer for p in problems],
                "meta": [_meta(p) for p in problems],
                "images": _images(problems),
            }
        ),
        "prompts",
        source="prompts_table",
    )


def sft_table(problems: Sequence[Problem]) -> pa.Table:
    """An `sft` table: [user question, assistant solution] per problem (tool families: the demonstration's turns),
    plus prompt_id; visual problems: the picture in `images`, its marker before the question."""
    return validate_table(
        pa.table(
            {
                "messages": [_ask(p) + _reply(p) for p in problems],
                "images": _images(problems),
                "prompt_id": [p.prompt_id for p in problems],
            }
        ),
        "sft",
        source="sft_table",
    )


def _qa_line(p: Problem) -> str:
    return f"Q: {p.question} A: {' '.join(m['content'] for m in _reply(p))}"


def text_table(problems: Sequence[Problem], seed: int = 0) -> pa.Table:
    """A `text` table for continued pretraining: "Q: <question> A: <answer>" rows with a filler sentence about
    every tenth row.

    Visual problems come as their text alone (no marker, no picture): it teaches their words and answer format, and
    since every answer goes with every question text, it teaches no answer.
    """
    rng = random.Random(seed)
    texts = []
    for p in problems:
        if rng.random() < 0.1:
            texts.append(rng.choice(FILLER_SENTENCES))
        texts.append(_qa_line(p))
    return validate_table(pa.table({"text": texts}), "text", source="text_table")


def wrong_answer(problem: Problem, rng: random.Random) -> str:
    """A plausible wrong answer: off by one or two digits swapped (arithmetic), the letters shuffled (reverse)."""
    answer = problem.answer
    if problem.family == "arithmetic" or answer.isdigit():
        value = int(answer)
        candidates = [str(value + 1)] + ([str(value - 1)] if value > 0 else [])
        if len(answer) >= 2 and answer[-1] != answer[-2] and not (len(answer) == 2 and answer[-1] == "0"):
            candidates.append(answer[:-2] + answer[-1] + answer[-2])  # swap the last two digits
        return rng.choice(candidates)
    letters = answer.split(" ")
    for _ in range(20):
        rng.shuffle(letters)
        if " ".join(letters) != answer:
            return " ".join(letters)
    # all letters equal (or unlucky): change one letter instead
    i = rng.randrange(len(letters))
    letters[i] = chr((ord(letters[i]) - 97 + 1) % 26 + 97)
    return " ".join(letters)


def wrong_solution(problem: Problem, rng: random.Random) -> str:
    """The solution with its final answer replaced by `wrong_answer` (worked steps kept: the slip is at the end)."""
    wrong = wrong_answer(problem, rng)
    if problem.solution != problem.answer and problem.solution.endswith(ANSWER_PREFIX + problem.answer):
        return problem.solution[: -len(problem.answer)] + wrong
    return wrong


def preferences_table(problems: Sequence[Problem], seed: int = 0) -> pa.Table:
    """A `preferences` table: prompt [user question], chosen [right solution], rejected [a plausible wrong one].

    Visual problems are left out: the preferences schema holds no images, and without its picture a pair would teach a
    reward model nothing true.
    """
    rng = random.Random(seed)
    problems = [p for p in problems if p.image is None]
    return validate_table(
        pa.table(
            {
                "prompt": [_user(p.question) for p in problems],
                "chosen": [_assistant(p.solution) for p in problems],
                "rejected": [_assistant(wrong_solution(p, rng)) for p in problems],
                "prompt_id": [p.prompt_id for p in problems],
            }
        ),
        "preferences",
        source="preferences_table",
    )


def corpus_for_tokenizer(problems: Sequence[Problem]) -> list[str]:
    """Texts to train a tokenizer on: questions, solutions, the pretraining lines, filler, and the chat role names.

    The `<image>` marker is not among them: the model side adds it as a special token.
    """
    return (
        [p.question for p in problems]
        + [p.solution for p in problems]
        + [_qa_line(p) for p in problems]
        + tool_tasks.tool_texts(problems)
        + list(FILLER_SENTENCES)
        + ["system\n", "user\n", "assistant\n", "tool\n"]
    )
