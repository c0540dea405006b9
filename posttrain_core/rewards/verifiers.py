"""Built-in verifiers: registered functions with the signature every reward function has (docs/rewards.md).

    fn(prompt: list[dict], response: str, answer: str | None, meta: dict, **params) -> float | dict[str, float]

A dict names its components; the reserved keys `correct` (the sample's verifier outcome, 0/1) and `parse_failed`
are not rewards. Verifiers never raise on a malformed response: it scores 0 and counts as a parse failure.
`params` are the ScoreConfig fields a verifier reads (`config_params`), e.g. the regex pattern.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from posttrain_core.algorithms.registry import Registry

VERIFIERS: Registry = Registry("verifier")


def register_verifier(name: str, **config_params: str) -> Callable:
    """Register a built-in under `name`; `config_params` maps its keyword arguments to ScoreConfig fields."""

    def add(fn: Callable) -> Callable:
        fn.config_params = config_params
        return VERIFIERS.register(name)(fn)

    return add


def _outcome(name: str, correct: bool | None, parse_failed: bool = False) -> dict[str, float]:
    out = {name: 1.0 if correct else 0.0, "parse_failed": float(parse_failed)}
    return out if correct is None else {**out, "correct": float(correct)}


# ----------------------------------------------------------------------------------- exact and numeric answers
_MARKER = re.compile(r"(?i:answer is)|A:")
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?")


def extract_answer(text: Any) -> str | None:
    """The answer in a response: the text after the last "answer is" / "A:" if any, else all of it; whitespace, a
    leading ':' and one trailing period stripped. None for an empty result or a non-string."""
    if not isinstance(text, str):
        return None
    text = text.strip()
    markers = list(_MARKER.finditer(text))
    if markers:
        text = text[markers[-1].end() :].strip().lstrip(":").strip()
    if text.endswith("."):
        text = text[:-1].rstrip()
    return text or None


@register_verifier("exact_match")
def exact_match(prompt: Any, response: Any, answer: Any, meta: Any = None) -> dict[str, float]:
    """1 iff the extracted answer (`extract_answer`) equals `answer`, both stripped; `correct` with an answer."""
    pred = extract_answer(response)
    if pred is None:
        return _outcome("exact_match", False if answer is not None else None, parse_failed=True)
    if answer is None:
        return _outcome("exact_match", None)
    return _outcome("exact_match", pred == str(answer).strip())


def _last_number(text: Any) -> float | None:
    if not isinstance(text, str):
        return None
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        value = float(found[-1].replace(",", ""))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


@register_verifier("numeric")
def numeric(prompt: Any, response: Any, answer: Any, meta: Any = None, tol: float = 1e-6) -> dict[str, float]:
    """1 iff the last number in the response is within `tol` (absolute or relative) of the answer's last number."""
    pred = _last_number(response)
    if pred is None:
        return _outcome("numeric", False if answer is not None else None, parse_failed=True)
    ref = _last_number(str(answer)) if answer is not None else None
    if answer is None:
        return _outcome("numeric", None)
    return _outcome("numeric", ref is not None and math.isclose(pred, ref, rel_tol=tol, abs_tol=tol))


# ------------------------------------------------------------------------------------------------------- maths
def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}), nested braces balanced; None if there is none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth, j = 0, i
    while j < len(text):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
        j += 1
    return None


def math_answer(text: Any) -> str | None:
    """The final answer of a worked solution: the last \\boxed{...}, else what follows GSM8K's last '####', else the
    `extract_answer` text; None when there is nothing."""
    if not isinstance(text, str):
        return None
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip() or None
    if "####" in text:
        return text.rsplit("####", 1)[1].strip() or None
    return extract_answer(text)


_LATEX_DROP = (
    "\\left",
    "\\right",
    "\\!",
    "\\,",
    "\\;",
    "\\:",
    "\\displaystyle",
    "$",
    "\\%",
    "%",
    "^\\circ",
    "^{\\circ}",
)
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_UNIT_WORD = re.compile(r"^\s*([-+]?[\d.,/]+)\s*[a-zA-Z ]+$")


def normalize_math(text: str) -> str:
    """A canonical form for comparing final answers: LaTeX spacing, \\left/\\right, $ and % dropped, \\text{...}
    unwrapped, \\frac{a}{b} as a/b, a trailing unit word after a number dropped ("12 dollars" -> "12"), thousands
    separators removed, whitespace removed, one trailing period removed."""
    s = text.strip()
    s = _TEXT.sub(r"\1", s)
    for token in _LATEX_DROP:
        s = s.replace(token, "")
    while _FRAC.search(s):
        s = _FRAC.sub(r"(\1)/(\2)", s)
    unit = _UNIT_WORD.match(s)
    if unit:
        s = unit.group(1)
    s = s.strip().rstrip(".").strip()
    if re.fullmatch(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return re.sub(r"\s+", "", s)


def _as_number(s: str) -> Fraction | None:
    """A normalized answer as an exact number: an integer, decimal, a/b or (a)/(b), with an optional sign in front;
    None otherwise."""
    if s[:1] in "+-" and s[1:2] == "(":
        value = _as_number(s[1:])
        return None if value is None else (-value if s[0] == "-" else value)
    m = re.fullmatch(r"\(?([-+]?\d+(?:\.\d+)?)\)?/\(?([-+]?\d+(?:\.\d+)?)\)?", s)
    try:
        if m:
            den = Fraction(m.group(2))
            return Fraction(m.group(1)) / den if den else None
        if re.fullmatch(r"[-+]?(\d+(\.\d*)?|\.\d+)(e[-+]?\d+)?", s, re.IGNORECASE):
            return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return None


@register_verifier("math")
def math_verify(prompt: Any, response: Any, answer: Any, meta: Any = None) -> dict[str, float]:
    """1 iff the response's final answer (`math_answer`: last \\boxed{}, GSM8K's '#### N', or after "answer is")
    equals the answer's, compared as exact numbers when both parse (0.5 = 1/2 = \\frac{1}{2}), else as normalized
    strings (`normalize_math`)."""
    pred = math_answer(response)
    if answer is None:
        return _outcome("math", None, parse_failed=pred is None)
    if pred is None:
        return _outcome("math", False, parse_failed=True)
    ref = math_answer(str(answer)) or str(answer)
    p, r = normalize_math(pred), normalize_math(ref)
    pn, rn = _as_number(p), _as_number(r)
    return _outcome("math", pn == rn if pn is not None and rn is not None else p == r)


# -------------------------------------------------------------------------------------------- format and length
@register_verifier("regex", pattern="regex")
def regex(prompt: Any, response: Any, answer: Any, meta: Any = None, pattern: str = "") -> dict[str, float]:
    """1 iff `re.search(pattern, response)` matches (ScoreConfig.regex); says nothing of correctness."""
    if not isinstance(response, str):
        return {"regex": 0.0, "parse_failed": 1.0}
    return {"regex": float(re.search(pattern, response) is not None), "parse_failed": 0.0}


@register_verifier("format", pattern="format_pattern")
def format_match(prompt: Any, response: Any, answer: Any, meta: Any = None, pattern: str = "") -> dict[str, float]:
    """1 iff the whole response matches `pattern` (ScoreConfig.format_pattern; `re.fullmatch`, '.' matching newlines),
    e.g. r"<think>.*</think>\\s*The answer is .+" for reasoning then an answer."""
    if not isinstance(response, str):
        return {"format": 0.0, "parse_failed": 1.0}
    return {"format": float(re.fullmatch(pattern, response.strip(), re.DOTALL) is not None), "parse_failed": 0.0}


@register_verifier("length", limit="length_limit")
def length(prompt: Any, response: Any, answer: Any, meta: Any = None, limit: int = 1) -> float:
    """A penalty for characters beyond `limit` (ScoreConfig.length_limit): -min(1, (len - limit) / limit), 0 within."""
    n = len(response) if isinstance(response, str) else 0
    return -min(1.0, max(0, n - limit) / max(limit, 1))
