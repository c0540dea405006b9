"""The user's reward functions, written in a temporary folder outside the package as a user would: how they are
referenced, called, combined, keyed, and how their errors are contained."""

from __future__ import annotations

import json
import textwrap

import pyarrow as pa
import pytest

from posttrain_core.config import ScoreConfig

USER_FILE = '''
import math, time

calls = []

def shouty(prompt, response, answer, meta):
    """0.5 per exclamation mark, at most 1; remembers what it was given."""
    calls.append((prompt, response, answer, meta))
    return min(1.0, 0.5 * response.count("!"))

def graded(prompt, response, answer, meta):
    """Several components and the verifier outcome."""
    right = response.strip() == answer
    return {"right": float(right), "brevity": -len(response) / 100, "correct": int(right)}

def fragile(prompt, response, answer, meta):
    if meta.get("row") == 3:
        raise RuntimeError("cannot score row 3")
    if meta.get("row") == 4:
        time.sleep(5)
    if meta.get("row") == 5:
        return math.nan
    return 1.0

def judge(prompts, responses, answers, metas):
    return [float(len(r)) for r in responses]
judge.batched = True

def broken(prompt, response, answer, meta):
    raise ValueError("always")

def wrong_signature(response):
    return 0.0
'''


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "user_rewards" / "rewards.py"
    path.parent.mkdir()
    path.write_text(USER_FILE)
    return path


def _rollouts(n: int = 8) -> pa.Table:
    return pa.table(
        {
            "prompt_id": [f"p{i}" for i in range(n)],
            "sample_index": [0] * n,
            "prompt_ids": [[1, 2]] * n,
            "response_ids": [[3, 4]] * n,
            "response_text": ["42!", "41", "42", "nope!!", "42", "42", "!!!", "42"][:n],
            "logprobs": [[-0.1, -0.2]] * n,
            "finish_reason": ["stop"] * n,
            "policy_digest": ["d"] * n,
            "answer": ["42"] * n,
            "response_mask": pa.nulls(n, pa.list_(pa.int8())),
            "turns": pa.nulls(n, pa.string()),
            "num_turns": [1] * n,
            "num_tool_calls": [0] * n,
            "tool_errors": [0] * n,
            "messages": [[{"role": "user", "content": f"q{i}"}] for i in range(n)],
            "meta": [json.dumps({"row": i, "topic": "maths"}) for i in range(n)],
        }
    )


def _components(table: pa.Table) -> list[dict]:
    return [dict(row) for row in table.column("reward_components").to_pylist()]


def test_a_reward_function_gets_the_row_and_its_components_are_kept(user_file):
    from posttrain_core.plugins import load
    from posttrain_core.rewards.score import score_rollouts

    cfg = ScoreConfig(
        verifiers={"exact_match": 1.0},
        reward_functions={f"{user_file}:shouty": 0.5, f"{user_file}:graded": 2.0},
    )
    out = score_rollouts(_rollouts(), cfg)
    calls = load(f"{user_file}:calls")
    assert calls[0] == ([{"role": "user", "content": "q0"}], "42!", "42", {"row": 0, "topic": "maths"})
    comps = _components(out)
    assert comps[0] == {"exact_match": 0.0, "shouty": 0.5, "right": 0.0, "brevity": pytest.approx(-0.03)}
    assert comps[2] == {"exact_match": 1.0, "shouty": 0.0, "right": 1.0, "brevity": pytest.approx(-0.02)}
    rewards = out.column("reward").to_pylist()
    assert rewards[2] == pytest.approx(1.0 + 0.5 * 0 + 2.0 * (1.0 - 0.02))
    # `correct` comes from the first term that decides it: here exact_match, then graded agrees
    assert out.column("correct").to_pylist()[:3] == [False, False, True]


def test_errors_are_contained_counted_and_named(user_file, caplog):
    from posttrain_core.rewards.functions import apply, specs_of
    from posttrain_core.rewards.score import reward_rows

    cfg = ScoreConfig(verifiers={}, reward_functions={f"{user_file}:fragile": 1.0}, reward_timeout_s=0.5)
    scores = apply(specs_of(cfg), reward_rows(_rollouts()), cfg.reward_timeout_s)
    assert scores.errors == {"fragile": 3}  # the exception, the timeout, the NaN
    assert scores.reward == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    assert "row 3" in scores.first_error and "cannot score row 3" in scores.first_error


def test_batched_functions_take_lists(user_file):
    from posttrain_core.rewards.score import score_rollouts

    out = score_rollouts(_rollouts(3), ScoreConfig(verifiers={}, reward_functions={f"{user_file}:judge": 0.1}))
    assert out.column("reward").to_pylist() == pytest.approx([0.3, 0.2, 0.2])


def test_bad_references_fail_before_any_work_naming_the_field(user_file, tmp_path):
    from posttrain_core.rewards.score import check_score_config

    for ref, message in [
        (f"{user_file}:missing", "has no 'missing'"),
        (f"{tmp_path}/nowhere.py:fn", "cannot import"),
        (f"{user_file}:wrong_signature", "must take \\(prompt, response, answer, meta\\)"),
        ("exact_match", "is not 'package.module:function'"),
        ("no_such_package_xyz.mod:fn", "cannot import 'no_such_package_xyz.mod'"),
    ]:
        with pytest.raises(ValueError, match=f"ScoreConfig.reward_functions.*{message}"):
            check_score_config(ScoreConfig(reward_functions={ref: 1.0}), has_reward_model=False)
    with pytest.raises(ValueError, match="ScoreConfig.verifiers: unknown 'exactmatch'"):
        check_score_config(ScoreConfig(verifiers={"exactmatch": 1.0}), has_reward_model=False)
    with pytest.raises(ValueError, match="ScoreConfig.format_pattern"):
        check_score_config(ScoreConfig(verifiers={"format": 1.0}), has_reward_model=False)


def test_the_source_of_a_reward_function_is_part_of_the_key(user_file):
    from posttrain_core.artifacts import ArtifactRef
    from posttrain_core.stage import key_for

    rollouts = ArtifactRef(kind="dataset", key="k" * 64, uri="/x", digest="blake3:" + "0" * 64)
    cfg = ScoreConfig(reward_functions={f"{user_file}:shouty": 1.0})
    before = key_for("score", cfg, {"rollouts": rollouts})
    assert key_for("score", cfg, {"rollouts": rollouts}) == before  # unchanged file: the same key
    user_file.write_text(USER_FILE.replace("0.5 * response", "0.25 * response"))
    assert key_for("score", cfg, {"rollouts": rollouts}) != before  # edited reward: scored again
    plain = key_for("score", ScoreConfig(), {"rollouts": rollouts})
    assert key_for("score", ScoreConfig(), {"rollouts": rollouts}) == plain


@pytest.mark.slow
def test_a_function_failing_on_every_sample_fails_the_stage(user_file, tiny_inputs, ray_session, tmp_path):
    """Through the stage (Ray tasks): one failing function on every row stops it, naming the function and row."""
    from posttrain_core.artifacts import ArtifactStore
    from posttrain_core.data.io import write_dataset
    from posttrain_core.rewards.score import run_score

    store = ArtifactStore(tmp_path / "store")
    folder = tmp_path / "rollouts"
    write_dataset(_rollouts(), "rollouts", folder)
    ref = store.register_external(folder, kind="dataset", schema_kind="rollouts")
    good = run_score(ScoreConfig(verifiers={}, reward_functions={f"{user_file}:fragile": 1.0}, reward_timeout_s=1),
                     ref, store)  # fmt: skip
    metrics = store.manifest(good)["metrics"]
    assert metrics["reward_errors"] == 3.0 and metrics["reward_errors/fragile"] == 3.0
    with pytest.raises(RuntimeError, match=r"(?s)'broken' failed on every sample; the first: .*row 0.*always"):
        run_score(ScoreConfig(verifiers={}, reward_functions={f"{user_file}:broken": 1.0}), ref, store)


def test_a_module_reference_works_too(tmp_path, monkeypatch):
    (tmp_path / "my_pkg").mkdir()
    (tmp_path / "my_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_pkg" / "rewards.py").write_text(textwrap.dedent(USER_FILE))
    monkeypatch.syspath_prepend(str(tmp_path))
    from posttrain_core.rewards.score import score_rollouts

    out = score_rollouts(_rollouts(2), ScoreConfig(verifiers={}, reward_functions={"my_pkg.rewards:shouty": 1.0}))
    assert out.column("reward").to_pylist() == [0.5, 0.0]


def test_a_reward_function_from_yaml_and_as_a_deployment_parameter(user_file, tmp_path):
    """`posttrain run cfg.yaml` and a Prefect deployment's JSON parameters name the function the same way."""
    from flows.cli import load_run_config
    from posttrain_core.config import RLHFFlowConfig
    from posttrain_core.rewards.score import check_score_config

    path = tmp_path / "rl.yaml"
    path.write_text(
        f"flow: rlhf\nconfig:\n  data: {{prompts_path: prompts.jsonl}}\n"
        f"  score: {{verifiers: {{}}, reward_functions: {{'{user_file}:graded': 1.0}}}}\n"
        f"  eval: {{verifier: '{user_file}:graded'}}\n"
    )
    flow, config = load_run_config(str(path), ["score.reward_timeout_s=5"], str(tmp_path / "store"))
    assert flow == "rlhf" and config.score.reward_functions == {f"{user_file}:graded": 1.0}
    assert [s.label for s in check_score_config(config.score, has_reward_model=False)] == ["graded"]
    assert RLHFFlowConfig.model_validate_json(config.model_dump_json()) == config  # as deployment parameters
