"""Built-in verifiers on hand-made cases, malformed responses and answers included (none may raise)."""

from __future__ import annotations

import pytest

from posttrain_core.rewards.verifiers import (
    VERIFIERS,
    exact_match,
    extract_answer,
    format_match,
    last_boxed,
    length,
    math_verify,
    numeric,
    regex,
)


def test_extract_answer():
    assert extract_answer(" 82 ") == "82"
    assert extract_answer("82.") == "82"
    assert extract_answer("The answer is 82.") == "82"
    assert extract_answer("Q: What is 37 + 45? A: 82") == "82"
    assert extract_answer("") is None and extract_answer("   ") is None and extract_answer(None) is None


@pytest.mark.parametrize(
    "response, reward, parse_failed",
    [("82", 1.0, False), (" 82 ", 1.0, False), ("82.", 1.0, False), ("the answer is 82", 1.0, False),
     ("eighty-two", 0.0, False), ("83", 0.0, False), ("", 0.0, True), (None, 0.0, True), (b"\x00", 0.0, True),
     ("\x00\ufffd garbage", 0.0, False)],
)  # fmt: skip
def test_exact_match(response, reward, parse_failed):
    out = exact_match([], response, "82", {})
    assert out == {"exact_match": reward, "parse_failed": float(parse_failed), "correct": reward}
    assert "correct" not in exact_match([], "82", None, {})  # no answer: no verifier outcome


@pytest.mark.parametrize(
    "response, reward, parse_failed",
    [("82", 1.0, False), ("The answer is 82.", 1.0, False), (" 82 ", 1.0, False), ("82.0", 1.0, False),
     ("eighty-two", 0.0, True), ("", 0.0, True), (None, 0.0, True), ("}{%$", 0.0, True), ("81", 0.0, False),
     ("8.2e1", 1.0, False), ("about 82.0", 1.0, False)],
)  # fmt: skip
def test_numeric(response, reward, parse_failed):
    assert numeric([], response, "82", {}) == {
        "numeric": reward,
        "parse_failed": float(parse_failed),
        "correct": reward,
    }


def test_numeric_edge_cases():
    assert numeric([], "-7", "-7", {})["correct"] and numeric([], "1,234", "1234", {})["correct"]
    assert not numeric([], "82", "not a number", {})["correct"]


MATH_CASES = [
    # (response, answer, correct)
    (r"so the result is \boxed{42}.", "42", True),
    (r"\boxed{42}", "#### 42", True),
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72", True),
    ("#### 72", "#### 72", True),
    ("#### 1,234", "1234", True),
    (r"\boxed{1,234}", "1234", True),
    (r"\boxed{\frac{1}{2}}", "0.5", True),
    (r"\boxed{\dfrac{3}{4}}", "3/4", True),
    (r"\boxed{\tfrac{6}{8}}", r"\frac{3}{4}", True),
    (r"\boxed{0.75}", "3/4", True),
    (r"\boxed{-\frac{2}{3}}", "-2/3", True),  # a sign outside the fraction
    (r"\boxed{-2/3}", "-2/3", True),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}", True),  # nested braces, compared as text
    (r"\boxed{x^{2}+1}", "x^{2}+1", True),
    (r"\boxed{ x^{2} + 1 }", "x^{2}+1", True),
    (r"\boxed{\left( 1, 2 \right)}", "(1,2)", True),
    (r"\boxed{\text{Monday}}", "Monday", True),
    (r"\boxed{12 \text{ dollars}}", "12", True),
    ("The answer is 12 dollars.", "12", True),
    (r"\boxed{50\%}", "50", True),
    (r"$\boxed{7}$", "7", True),
    (r"first \boxed{3}, then corrected: \boxed{5}", "5", True),  # the last box counts
    (r"first \boxed{3}, then corrected: \boxed{5}", "3", False),
    (r"\boxed{5.0}", "5", True),
    (r"\boxed{5.01}", "5", False),
    (r"\boxed{90^\circ}", "90", True),
    ("I think it is 41", "42", False),
    ("The answer is 42", "42", True),
    (r"\boxed{}", "42", False),  # an empty box: no answer
    (r"\boxed{42", "42", False),  # unbalanced braces: no box, the text is compared
    ("no answer here at all", "42", False),
    (r"\boxed{1/0}", "1/0", True),  # not a number: compared as text
    (r"\fbox{8}", "8", True),
]


@pytest.mark.parametrize("response, answer, correct", MATH_CASES)
def test_math(response, answer, correct):
    out = math_verify([], response, answer, {})
    assert out["correct"] == float(correct), (response, answer, out)
    assert out["math"] == float(correct)


def test_math_malformed_inputs_never_raise():
    assert math_verify([], None, "42", {}) == {"math": 0.0, "parse_failed": 1.0, "correct": 0.0}
    assert math_verify([], "", "42", {})["parse_failed"] == 1.0
    assert "correct" not in math_verify([], r"\boxed{42}", None, {})
    assert math_verify([], r"\boxed{42}", "", {})["correct"] == 0.0
    assert last_boxed(r"\boxed{a{b}c}") == "a{b}c" and last_boxed("none") is None and last_boxed(r"\boxed") is None


def test_regex_format_and_length():
    assert regex([], "A: 82", None, {}, pattern=r"A: \d+") == {"regex": 1.0, "parse_failed": 0.0}
    assert regex([], None, None, {}, pattern=".*")["parse_failed"] == 1.0
    think = r"<think>.*</think>\s*The answer is .+"
    assert format_match([], "<think>7+5=12\nso 12</think> The answer is 12", None, {}, pattern=think)["format"] == 1.0
    assert format_match([], "The answer is 12", None, {}, pattern=think)["format"] == 0.0
    assert format_match([], "<think>x</think> The answer is 12 extra\n", None, {}, pattern=think)["format"] == 1.0
    assert length([], "x" * 10, None, {}, limit=10) == 0.0
    assert length([], "x" * 15, None, {}, limit=10) == pytest.approx(-0.5)
    assert length([], "x" * 100, None, {}, limit=10) == -1.0 and length([], None, None, {}, limit=10) == 0.0


def test_registry_and_config_params():
    assert set(VERIFIERS) >= {"exact_match", "numeric", "math", "regex", "format", "length"}
    assert VERIFIERS["regex"].config_params == {"pattern": "regex"}
    assert VERIFIERS["format"].config_params == {"pattern": "format_pattern"}
    assert VERIFIERS["length"].config_params == {"limit": "length_limit"}
