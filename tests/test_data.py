"""Tests of the data layer: schema validation, Parquet round trips, importers, synthetic tasks and verifiers."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from posttrain_core.data import SCHEMAS, import_file, import_hf, read_dataset, validate_table, write_dataset
from posttrain_core.data.synthetic import (
    make_problems,
    preferences_table,
    prompts_table,
    sft_table,
    split_train_eval,
    text_table,
    with_slips,
    worked_solution,
    wrong_solution,
)
from posttrain_core.rewards.verifiers import exact_match


def chat(*pairs: tuple[str, str]) -> list[dict]:
    return [{"role": r, "content": c} for r, c in pairs]


ROLLOUT = {
    "prompt_id": ["p0", "p1"],
    "sample_index": [0, 1],
    "prompt_ids": [[1, 2], [3]],
    "response_ids": [[4, 5, 6], [7]],
    "response_text": ["abc", "d"],
    "logprobs": [[-0.1, -0.2, -0.3], [-1.0]],
    "finish_reason": ["stop", "length"],
    "policy_digest": ["sha256:aa", "sha256:aa"],
    "answer": ["82", None],
    "response_mask": [[1, 0, 1], None],
    "turns": [None, json.dumps([{"role": "assistant", "start": 0}])],
    "num_turns": [1, 1],
    "num_tool_calls": [0, 0],
    "tool_errors": [0, 0],
}

GOOD = {
    "text": {"text": ["hello", "world"]},
    "prompts": {
        "prompt_id": ["a", "b"],
        "messages": [chat(("user", "What is 1 + 1?")), chat(("system", "Be brief."), ("user", "Hi"))],
        "answer": ["2", None],
        "meta": ['{"family": "arithmetic"}', None],
    },
    "sft": {"messages": [chat(("user", "q"), ("assistant", "a")), chat(("user", "q"), ("assistant", "a"), ("user", "q2"), ("assistant", "b"))]},
    "preferences": {
        "prompt": [chat(("user", "q"))],
        "chosen": [chat(("assistant", "right"))],
        "rejected": [chat(("assistant", "wrong"))],
    },
    "rollouts": ROLLOUT,
    "scored_rollouts": {
        **ROLLOUT,
        "reward": [1.0, 0.0],
        "reward_components": [[("exact_match", 1.0)], [("exact_match", 0.0), ("format", 0.5)]],
        "correct": [True, None],
        "parse_failed": [False, True],
    },
    "process_rewards": {
        **ROLLOUT,
        "reward": [1.0, 0.0],
        "reward_components": [[("exact_match", 1.0)], [("exact_match", 0.0)]],
        "correct": [True, False],
        "parse_failed": [False, False],
        "process_rewards": [[0.01, -0.02, 0.0], [0.5]],
    },
    "teacher_logprobs": {
        **ROLLOUT,
        "teacher_logprobs": [[-0.5, -1.5, -0.1], [-0.25]],
        "teacher_topk_ids": [[[7, 3], [2, 9], [4, 1]], None],
        "teacher_topk_logprobs": [[[-0.5, -1.0], [-1.5, -2.0], [-0.1, -3.0]], None],
    },
    "eval": {
        "prompt_id": ["a"],
        "sample_index": [0],
        "response_text": ["82"],
        "answer": ["82"],
        "correct": [True],
        "reward": [1.0],
    },
}


def good_table(kind: str) -> pa.Table:
    columns = dict(GOOD[kind])
    if kind in ("scored_rollouts", "process_rewards"):
        columns["reward_components"] = pa.array(columns["reward_components"], pa.map_(pa.string(), pa.float64()))
    return pa.table(columns)  # inferred types: int64, double, ... are cast by validate_table


# ---- schemas ----


def test_every_kind_has_a_good_example():
    assert set(GOOD) == set(SCHEMAS)


@pytest.mark.parametrize("kind", sorted(SCHEMAS))
def test_good_table_is_accepted_and_cast(kind):
    table = good_table(kind).append_column("extra", pa.array(["x"] * len(good_table(kind))))
    out = validate_table(table, kind)
    assert out.schema.names == SCHEMAS[kind].names + ["extra"]
    for field in SCHEMAS[kind]:
        assert out.schema.field(field.name).type == field.type
    assert out.num_rows == table.num_rows


def test_unknown_kind():
    with pytest.raises(ValueError, match="kinds: text, prompts, sft"):
        validate_table(good_table("sft"), "chats")


def test_missing_column_is_named():
    with pytest.raises(ValueError, match=r"^data.parquet: column 'messages' is missing \(kind 'sft' needs: messages\)"):
        validate_table(pa.table({"text": ["x"]}), "sft", source="data.parquet")


def test_wrong_type_is_named():
    table = good_table("prompts").set_column(2, "answer", pa.array([2, 3]))
    with pytest.raises(ValueError, match="^ds: column 'answer' has type int64, expected string$"):
        validate_table(table, "prompts", source="ds")


def test_safe_casts():
    table = pa.table(
        {
            "prompt_id": pa.array(["a"], pa.large_string()),
            "sample_index": pa.array([3], pa.int64()),
            "response_text": pa.array(["x"], pa.large_string()),
            "answer": pa.nulls(1),
            "correct": [False],
            "reward": pa.array([0.5], pa.float64()),
        }
    )
    out = validate_table(table, "eval")
    assert out.schema.field("answer").type == pa.string()
    assert out.column("sample_index").to_pylist() == [3]


def test_int_out_of_range_is_rejected():
    table = good_table("eval").set_column(1, "sample_index", pa.array([2**40]))
    with pytest.raises(ValueError, match="column 'sample_index' has type int64, expected int32"):
        validate_table(table, "eval")


def test_null_in_required_column_names_row():
    table = good_table("text").set_column(0, "text", pa.array(["a", None]))
    with pytest.raises(ValueError, match="^src row 1: column 'text' is null$"):
        validate_table(table, "text", source="src")


def test_empty_messages_names_row():
    table = pa.table({"messages": [chat(("user", "q"), ("assistant", "a")), []]})
    with pytest.raises(ValueError, match="^f.parquet row 1: column 'messages' is empty$"):
        validate_table(table, "sft", source="f.parquet")


def test_bad_role_names_row_and_message():
    table = pa.table({"messages": [chat(("user", "q"), ("assistant", "a")), chat(("user", "q"), ("robot", "a"))]})
    with pytest.raises(ValueError, match="row 1: column 'messages' message 1 has role 'robot'"):
        validate_table(table, "sft")


def test_null_content_names_row():
    table = pa.table({"prompt_id": ["a"], "messages": [[{"role": "user", "content": None}]], "answer": [None], "meta": [None]})
    with pytest.raises(ValueError, match="row 0: column 'messages' message 0 has null content"):
        validate_table(table, "prompts")


def test_sft_needs_an_assistant_turn():
    table = pa.table({"messages": [chat(("user", "q"), ("assistant", "a")), chat(("user", "only a question"))]})
    with pytest.raises(ValueError, match="row 1: column 'messages' has no assistant message"):
        validate_table(table, "sft")


def test_meta_must_be_a_json_object():
    table = good_table("prompts").set_column(3, "meta", pa.array(["{}", "[1]"]))
    with pytest.raises(ValueError, match="row 1: column 'meta' must be a JSON object"):
        validate_table(table, "prompts")


def test_response_mask_length_must_match():
    table = good_table("rollouts").set_column(9, "response_mask", pa.array([[1, 0], None], pa.list_(pa.int8())))
    with pytest.raises(ValueError, match="row 0: column 'response_mask' has a different length"):
        validate_table(table, "rollouts")


# ---- io ----


def test_write_read_round_trip(tmp_path):
    table = prompts_table(make_problems(n=25))
    info = write_dataset(table, "prompts", tmp_path / "ds", rows_per_file=10)
    assert info["num_rows"] == 25 and info["schema_kind"] == "prompts"
    assert info["files"] == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    assert sorted(p.name for p in (tmp_path / "ds").iterdir()) == info["files"]
    assert read_dataset(tmp_path / "ds", "prompts").equals(table)
    assert read_dataset(tmp_path / "ds" / "part-00002.parquet", "prompts").num_rows == 5


def test_write_invalid_writes_nothing(tmp_path):
    with pytest.raises(ValueError, match="column 'messages' is missing"):
        write_dataset(pa.table({"text": ["x"]}), "sft", tmp_path / "ds")
    assert not (tmp_path / "ds").exists()
    with pytest.raises(ValueError, match="empty"):
        write_dataset(good_table("text").slice(0, 0), "text", tmp_path / "ds")
    assert not (tmp_path / "ds").exists()


def test_write_refuses_to_mix_with_existing_files(tmp_path):
    write_dataset(good_table("text"), "text", tmp_path)
    with pytest.raises(FileExistsError):
        write_dataset(good_table("text"), "text", tmp_path)


def test_read_names_the_bad_file(tmp_path):
    write_dataset(good_table("text"), "text", tmp_path)
    pq.write_table(pa.table({"txt": ["x"]}), tmp_path / "part-00001.parquet")
    with pytest.raises(ValueError, match=r"part-00001.parquet: column 'text' is missing"):
        read_dataset(tmp_path, "text")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        read_dataset(tmp_path / "nowhere", "text")


# ---- importers ----


def write_lines(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_malformed_line_is_named(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [{"text": "a"}, {"text": "b"}, '{"text": "c"'])
    with pytest.raises(ValueError, match=r"d.jsonl line 3: invalid JSON"):
        import_file(path, "text")


def test_jsonl_empty_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match=r"empty.jsonl: no rows"):
        import_file(path, "text")
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        import_file(tmp_path / "missing.jsonl", "text")


def test_jsonl_bad_messages_and_bad_values_name_the_line(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [{"messages": chat(("user", "q"), ("assistant", "a"))}, {"messages": "hi"}])
    with pytest.raises(ValueError, match=r"d.jsonl line 2: field 'messages' must be a list of \{role, content\} objects"):
        import_file(path, "sft")
    path = write_lines(tmp_path / "e.jsonl", [{"messages": chat(("user", "q"), ("assistant", "a"))}, {"messages": chat(("user", "q"))}])
    with pytest.raises(ValueError, match=r"e.jsonl line 2: column 'messages' has no assistant message"):
        import_file(path, "sft")
    path = write_lines(tmp_path / "f.jsonl", [{"text": "a"}, {"text": ["not", "text"]}])
    with pytest.raises(ValueError, match=r"f.jsonl line 2: field 'text'"):
        import_file(path, "text")


def test_prompt_completion_normalisation(tmp_path):
    path = write_lines(
        tmp_path / "sft.jsonl",
        [{"prompt": "What is 1 + 1?", "completion": "2"}, {"prompt": "Hi", "response": "Hello", "system": "Be kind."}],
    )
    table = import_file(path, "sft")
    assert table.column("messages").to_pylist() == [
        chat(("user", "What is 1 + 1?"), ("assistant", "2")),
        chat(("system", "Be kind."), ("user", "Hi"), ("assistant", "Hello")),
    ]


def test_prompts_and_text_normalisation(tmp_path):
    path = write_lines(tmp_path / "qs.jsonl", [{"prompt": "What is 2 + 2?", "answer": 4, "meta": {"family": "arithmetic"}}, {"prompt_id": "x", "prompt": "Hi"}])
    table = import_file(path, "prompts")
    assert table.column("prompt_id").to_pylist() == ["qs-1", "x"]
    assert table.column("messages").to_pylist()[1] == chat(("user", "Hi"))
    assert table.column("answer").to_pylist() == ["4", None]
    assert json.loads(table.column("meta")[0].as_py()) == {"family": "arithmetic"}
    text = import_file(write_lines(tmp_path / "t.jsonl", [{"text": "a", "source": "web"}, '"b"']), "text")
    assert text.column("text").to_pylist() == ["a", "b"]
    assert text.column("source").to_pylist() == ["web", None]


def test_preferences_implicit_prompt(tmp_path):
    row = {"chosen": chat(("user", "q"), ("assistant", "good")), "rejected": chat(("user", "q"), ("assistant", "bad"))}
    table = import_file(write_lines(tmp_path / "p.jsonl", [row]), "preferences")
    assert table.to_pylist()[0] == {"prompt": chat(("user", "q")), "chosen": chat(("assistant", "good")), "rejected": chat(("assistant", "bad"))}


def test_parquet_import(tmp_path):
    pq.write_table(pa.table({"prompt": ["q"], "completion": ["a"]}), tmp_path / "pc.parquet")
    assert import_file(tmp_path / "pc.parquet", "sft").column("messages").to_pylist() == [chat(("user", "q"), ("assistant", "a"))]
    folder = tmp_path / "folder"
    write_dataset(sft_table(make_problems(n=6)), "sft", folder, rows_per_file=4)
    assert import_file(folder, "sft").num_rows == 6
    pq.write_table(pa.table({"text": [None]}), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"bad.parquet row 0: column 'text' is null"):
        import_file(tmp_path / "bad.parquet", "text")


def test_hf_save_to_disk_import(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = {"messages": [chat(("user", "q"), ("assistant", "a"))] * 3, "source": ["s"] * 3}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "ds"))
    table = import_file(tmp_path / "ds", "sft")
    assert table.num_rows == 3 and table.column_names == ["messages", "images", "source"]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a", "b"]})}).save_to_disk(str(tmp_path / "dd"))
    assert import_hf(tmp_path / "dd", "text").column("text").to_pylist() == ["a", "b"]
    with pytest.raises(ValueError, match="no split 'test'; splits: train"):
        import_hf(tmp_path / "dd", "text", split="test")


# ---- synthetic ----


def test_problems_are_deterministic_and_unique():
    a, b = make_problems(n=300, seed=3), make_problems(n=300, seed=3)
    assert a == b
    assert a != make_problems(n=300, seed=4)
    assert len({p.question for p in a}) == 300 and len({p.prompt_id for p in a}) == 300
    assert [p.family for p in a[:4]] == ["arithmetic", "reverse", "arithmetic", "reverse"]
    assert make_problems(n=100, seed=3) == a[:100]  # per-family streams: a prefix does not depend on n


def test_problem_answers_are_right():
    for p in make_problems(n=200, seed=1):
        if p.family == "arithmetic":
            a, op, b = p.question.removeprefix("What is ").removesuffix("?").split()
            assert str(eval(f"{a} {op} {b}")) == p.answer  # noqa: S307 - our own generated text
            assert op != "*" or (len(a) == 1 and len(b) == 1)
        else:
            letters = p.question.removeprefix("Reverse the letters: ").split(" ")
            assert 3 <= len(letters) <= 5 and all(len(c) == 1 and c.islower() for c in letters)
            assert p.answer == " ".join(reversed(letters))


def test_operand_lengths_are_mixed():
    lengths = Counter()
    for p in make_problems(families=("arithmetic",), n=600, seed=5):
        a, op, b = p.question.removeprefix("What is ").removesuffix("?").split()
        if op != "*":
            lengths[len(a), len(b)] += 1
    # the length of each operand is drawn first: short and long operands are both common (not 90% two-digit)
    assert set(lengths) == {(1, 1), (1, 2), (2, 1), (2, 2)}
    assert min(lengths[1, 2], lengths[2, 1], lengths[2, 2]) > 60


@pytest.mark.parametrize(
    "question, solution",
    [("What is 37 + 45?", "7 + 5 = 12, 3 + 4 + 1 = 8. The answer is 82"),
     ("What is 57 + 95?", "7 + 5 = 12, 5 + 9 + 1 = 15. The answer is 152"),
     ("What is 8 + 9?", "8 + 9 = 17, 0 + 0 + 1 = 1. The answer is 17"),
     ("What is 52 - 17?", "12 - 7 = 5, 5 - 1 - 1 = 3. The answer is 35"),
     ("What is 40 - 3?", "10 - 3 = 7, 4 - 0 - 1 = 3. The answer is 37"),
     ("What is 16 - 16?", "6 - 6 = 0, 1 - 1 = 0. The answer is 0"),
     ("What is 7 * 8?", "7 * 8 = 56. The answer is 56")],
)  # fmt: skip
def test_worked_solution_examples(question, solution):
    assert worked_solution(question, max_digits=2) == solution


def test_worked_solutions_are_right_step_by_step():
    for max_digits in (1, 2, 3):
        for p in make_problems(families=("arithmetic",), n=200, seed=2, max_digits=max_digits):
            steps, final = p.solution.split(". The answer is ")
            assert final == p.answer and exact_match(None, p.solution, p.answer)["correct"]
            for step in steps.split(", "):
                left, right = step.split(" = ")
                assert eval(left) == int(right), (p.question, step)  # noqa: S307 - our own generated text
    bare = make_problems(n=20, worked=False)
    assert all(p.solution == p.answer for p in bare)
    assert [p.question for p in bare] == [p.question for p in make_problems(n=20)]


@pytest.mark.parametrize(
    "question, slip, solution",
    [("What is 37 + 45?", (0, 1), "7 + 5 = 13, 3 + 4 + 1 = 8. The answer is 83"),
     ("What is 37 + 45?", (1, -1), "7 + 5 = 12, 3 + 4 + 1 = 7. The answer is 72"),
     ("What is 38 + 41?", (0, 1), "8 + 1 = 10, 3 + 4 + 1 = 8. The answer is 80"),  # the slip makes a carry
     ("What is 52 - 17?", (0, 1), "12 - 7 = 6, 5 - 1 - 1 = 3. The answer is 36"),
     ("What is 59 - 10?", (0, 1), "9 - 0 = 8, 5 - 1 = 4. The answer is 48"),  # 10 is out of range: the other way
     ("What is 7 * 8?", (0, -1), "7 * 8 = 55. The answer is 55")],
)  # fmt: skip
def test_worked_solution_with_a_slip(question, slip, solution):
    assert worked_solution(question, max_digits=2, slip=slip) == solution


def test_slipped_demonstrations_are_consistent_and_keep_the_true_answer():
    problems = make_problems(n=1000, seed=6)
    shown = with_slips(problems, 0.25, max_digits=2, seed=6)
    assert [p.answer for p in shown] == [p.answer for p in problems]  # what the verifier checks stays right
    slipped = [s for p, s in zip(problems, shown, strict=True) if s.solution != p.solution]
    assert all(s.family == "arithmetic" for s in slipped)
    assert 0.18 < len(slipped) / 500 < 0.32
    for s in slipped:  # one step off by one, the rest (carries, final answer) follows from it
        steps, final = s.solution.split(". The answer is ")
        assert final != s.answer and abs(int(final) - int(s.answer)) in (1, 10, 100)
        wrong = [step for step in steps.split(", ") if eval(step.split(" = ")[0]) != int(step.split(" = ")[1])]  # noqa: S307
        assert len(wrong) == 1, s
    assert with_slips(problems, 0.25, 2, seed=6) == shown and with_slips(problems, 0.0, 2) == problems
    with pytest.raises(ValueError, match="slip rate"):
        with_slips(problems, 1.5, 2)


def test_wrong_solution_keeps_the_steps_and_changes_the_answer():
    import random

    rng = random.Random(0)
    for p in make_problems(n=100, seed=4):
        wrong = wrong_solution(p, rng)
        assert wrong != p.solution and not exact_match(None, wrong, p.answer)["correct"]
        if p.family == "arithmetic":
            assert wrong.rsplit(" ", 1)[0] == p.solution.rsplit(" ", 1)[0]


def test_split_is_disjoint():
    problems = make_problems(n=200)
    train, evals = split_train_eval(problems, n_eval=50, seed=0)
    assert len(evals) == 50 and len(train) == 150
    assert not {p.question for p in train} & {p.question for p in evals}
    assert split_train_eval(problems, n_eval=50, seed=0) == (train, evals)


def test_tables_are_valid():
    problems = make_problems(n=40)
    assert prompts_table(problems).num_rows == 40
    assert sft_table(problems).column("messages")[0].as_py()[1] == {"role": "assistant", "content": problems[0].solution}
    assert text_table(problems).num_rows >= 40
    prefs = preferences_table(problems, seed=0).to_pylist()
    assert all(r["chosen"] != r["rejected"] for r in prefs)


@pytest.mark.parametrize("n_rl", [0, 300])
def test_prepared_rl_prompts_are_their_own_problems(n_rl):
    from posttrain_core.config import DataConfig
    from posttrain_core.data.prepare import build_tables

    tables = build_tables(DataConfig(n_train=500, n_eval=40, n_rl_prompts=n_rl))
    questions = {
        name: {m[0]["content"] for m in tables[name][0].column(col).to_pylist()}
        for name, col in (("sft", "messages"), ("eval", "messages"), ("prompts", "messages"))
    }
    assert len(questions["sft"]) == 500 and len(questions["eval"]) == 40
    assert not questions["eval"] & (questions["sft"] | questions["prompts"])
    if n_rl:  # RL trains on problems SFT never showed, like the held-out ones
        assert len(questions["prompts"]) == n_rl and not questions["prompts"] & questions["sft"]
        families = Counter(json.loads(m)["family"] for m in tables["prompts"][0].column("meta").to_pylist())
        assert families == {"arithmetic": 150, "reverse": 150}
    else:
        assert questions["prompts"] == questions["sft"]


def test_the_number_of_rl_prompts_leaves_the_sft_and_held_out_data_as_they_are():
    """More RL prompts must not change what SFT trains on or what the evaluation holds out (a demo that raises
    `n_rl_prompts` compares its RL against the same SFT)."""
    from posttrain_core.config import DataConfig
    from posttrain_core.data.prepare import build_tables

    few, many = (build_tables(DataConfig(n_train=300, n_eval=30, n_rl_prompts=n)) for n in (20, 400))
    for name in ("sft", "eval", "text"):
        assert few[name][0].equals(many[name][0]), name
    rl_few, rl_many = (t["prompts"][0].column("messages").to_pylist() for t in (few, many))
    assert len(rl_few) == 20 and rl_many[:20] == rl_few
