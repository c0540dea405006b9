"""Rewards: verifiers on hand-made responses (malformed ones included), weights, overlong shaping, pass@k, RM scoring."""

from __future__ import annotations

import pyarrow as pa
import pytest

from posttrain_core.config import ScoreConfig
from posttrain_core.rewards.passk import pass_at_k, pass_at_k_by_family, pass_at_k_table
from posttrain_core.rewards.score import score_rollouts
from posttrain_core.rewards.shaping import overlong_penalty

USER = [{"role": "user", "content": "What is 40 + 2?"}]


def rollouts(responses: list[str], answers: list[str | None], lengths: list[int] | None = None) -> pa.Table:
    """A `rollouts` table of hand-made responses (response_ids are dummies of the given lengths)."""
    from posttrain_core.data.schemas import validate_table

    n = len(responses)
    lengths = lengths or [3] * n
    return validate_table(
        pa.table(
            {
                "prompt_id": [f"p{i // 2}" for i in range(n)],
                "sample_index": [i % 2 for i in range(n)],
                "prompt_ids": [[1, 2]] * n,
                "response_ids": [[5] * k for k in lengths],
                "response_text": responses,
                "logprobs": [[-1.0] * k for k in lengths],
                "finish_reason": ["stop"] * n,
                "policy_digest": ["d"] * n,
                "answer": answers,
                "response_mask": [None] * n,
                "turns": [None] * n,
                "num_turns": [1] * n,
                "num_tool_calls": [0] * n,
                "tool_errors": [0] * n,
                "messages": [USER] * n,
            }
        ),
        "rollouts",
    )


def _components(table: pa.Table) -> list[dict[str, float]]:
    return [dict(row) for row in table.column("reward_components").to_pylist()]


def test_verifier_outcomes_become_the_reward_correct_and_parse_failed_columns():
    """What `score_rollouts` makes of each verifier's outcome (test_verifiers.py checks the verifiers' cases): the
    reward, `correct` (None where a row has no answer, or no verifier compares with one) and `parse_failed` columns,
    with the input columns kept."""
    table = rollouts(["42", "41", "", "\x00\ufffd garbage", "42", "42"], ["42", "42", "42", "42", None, "42"])
    out = score_rollouts(table, ScoreConfig(verifiers={"exact_match": 1.0}))
    assert out.column("reward").to_pylist() == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert out.column("correct").to_pylist() == [True, False, False, False, None, True]
    assert out.column("parse_failed").to_pylist() == [False, False, True, False, False, False]
    assert _components(out)[0] == {"exact_match": 1.0}
    # input columns (including the extra `messages`) are kept
    assert out.column("messages").to_pylist() == table.column("messages").to_pylist()

    num = score_rollouts(
        rollouts(["4.2e1", "no number here", "7"], ["42", "42", None]), ScoreConfig(verifiers={"numeric": 1.0})
    )
    assert num.column("reward").to_pylist() == [1.0, 0.0, 0.0]
    assert num.column("parse_failed").to_pylist() == [False, True, False]
    assert num.column("correct").to_pylist() == [True, False, None]

    fmt = score_rollouts(
        rollouts(["42", "forty-two", "", "42 "], ["42"] * 4), ScoreConfig(verifiers={"regex": 1.0}, regex=r"^\d+$")
    )
    assert fmt.column("reward").to_pylist() == [1.0, 0.0, 0.0, 0.0]
    assert fmt.column("correct").null_count == 4  # no answer verifier: no verifier outcome


def test_weights_combine_as_configured():
    """exact_match x 1.0 + regex x 0.5 + 0.25 x RM score + overlong (L_max 10, L_buf 4, penalty 2), by hand."""
    table = rollouts(["42", "The answer is 42", "41", "x"], ["42"] * 4, lengths=[3, 8, 10, 12])
    cfg = ScoreConfig(
        verifiers={"exact_match": 1.0, "regex": 0.5},
        regex=r"^\d+$",
        reward_model_weight=0.25,
        overlong_max_tokens=10,
        overlong_buffer=4,
        overlong_penalty=2.0,
    )
    out = score_rollouts(table, cfg, rm=[2.0, -1.0, 0.0, 4.0])
    # overlong: expected = 6 -> lengths 3, 8, 10, 12 give 0, -1, -2, -3
    assert _components(out) == [
        {"exact_match": 1.0, "regex": 1.0, "reward_model": 2.0, "overlong": 0.0},
        {"exact_match": 1.0, "regex": 0.0, "reward_model": -1.0, "overlong": -1.0},
        {"exact_match": 0.0, "regex": 1.0, "reward_model": 0.0, "overlong": -2.0},
        {"exact_match": 0.0, "regex": 0.0, "reward_model": 4.0, "overlong": -3.0},
    ]
    assert out.column("reward").to_pylist() == pytest.approx([2.0, -0.25, -1.5, -2.0])
    # a callable RM gets the prompts' messages and the responses
    seen = {}

    def rm(prompts, responses):
        seen["args"] = (prompts, responses)
        return [0.0] * len(responses)

    score_rollouts(table, cfg, rm=rm)
    assert seen["args"] == ([USER] * 4, ["42", "The answer is 42", "41", "x"])


def test_config_errors():
    table = rollouts(["42"], ["42"])
    with pytest.raises(ValueError, match="unknown"):
        score_rollouts(table, ScoreConfig(verifiers={"bleu": 1.0}))
    with pytest.raises(ValueError, match="ScoreConfig.regex"):
        score_rollouts(table, ScoreConfig(verifiers={"regex": 1.0}))
    with pytest.raises(ValueError, match="not a valid pattern"):
        score_rollouts(table, ScoreConfig(verifiers={"regex": 1.0}, regex="("))
    with pytest.raises(ValueError, match="reward_model_weight"):
        score_rollouts(table, ScoreConfig(reward_model_weight=1.0))
    with pytest.raises(ValueError, match="overlong_buffer"):
        score_rollouts(table, ScoreConfig(overlong_max_tokens=4, overlong_buffer=8))
    with pytest.raises(ValueError, match="2 reward-model scores for 1"):
        score_rollouts(table, ScoreConfig(reward_model_weight=1.0), rm=[1.0, 2.0])


def test_overlong_shaping_by_hand():
    # L_max 10, L_buf 4 -> expected 6; term = min(0, -(len - 6) / 4 * penalty)
    assert overlong_penalty([0, 5, 6, 7, 8, 10, 12], 10, 4) == [0.0, 0.0, 0.0, -0.25, -0.5, -1.0, -1.5]
    assert overlong_penalty([8], 10, 4, penalty=0.5) == [-0.25]
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty([1], 4, 5)


def test_pass_at_k_by_hand():
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(5, 4, 2) == 1.0  # n - c < k
    assert pass_at_k(200, 3, 100) == pytest.approx(1 - (100 * 99 * 98) / (200 * 199 * 198))
    with pytest.raises(ValueError):
        pass_at_k(5, 6, 1)
    table = pa.table({"prompt_id": ["a"] * 5 + ["b"] * 5, "correct": [1, 1, 0, 0, 0] + [0] * 5})
    table = table.set_column(1, "correct", table.column("correct").cast(pa.bool_()))
    assert pass_at_k_table(table, (1, 2)) == pytest.approx({"pass@1": 0.2, "pass@2": 0.35, "num_prompts": 2.0})
    prompts = pa.table({"prompt_id": ["a", "b", "c"], "meta": ['{"family": "x"}', '{"family": "y"}', None]})
    assert pass_at_k_by_family(table, prompts, (1, 2)) == pytest.approx(
        {"pass@1": 0.2, "pass@2": 0.35, "num_prompts": 2.0, "pass@1/x": 0.4, "pass@2/x": 0.7, "pass@1/y": 0.0,
         "pass@2/y": 0.0}
    )  # fmt: skip


def _register_rollouts(store, table: pa.Table, folder):
    from posttrain_core.data.io import write_dataset

    write_dataset(table, "rollouts", folder)
    return store.register_external(folder, kind="dataset", schema_kind="rollouts")


@pytest.mark.slow
def test_run_score_counts_parse_failures(store, tmp_path):
    """The stage without a reward model (its verifiers run on Ray tasks)."""
    from posttrain_core.data.io import read_dataset
    from posttrain_core.rewards.score import run_score

    table = rollouts(["42", "", "no idea", "The answer is 42"], ["42", "42", "42", "42"])
    ref = _register_rollouts(store, table, tmp_path / "rollouts")
    scored = run_score(ScoreConfig(), ref, store)
    assert scored.schema_kind == "scored_rollouts"
    metrics = store.manifest(scored)["metrics"]
    assert metrics["parse_failures"] == 1.0  # "" (nothing to extract); "no idea" parses and is wrong
    assert metrics["accuracy"] == 0.5 and metrics["reward/exact_match"] == 0.5
    assert read_dataset(store.local_path(scored), "scored_rollouts").column("reward").to_pylist() == [1, 0, 0, 1]
    with pytest.raises(ValueError, match="'rollouts' dataset"):
        run_score(ScoreConfig(), store.register_external(tmp_path / "rollouts", kind="dataset"), store)


@pytest.mark.slow
def test_score_task_uses_the_stage_key(prefect_api, store, tmp_path):
    """The Prefect task of a stage that already ran is a cache hit on the stage key: same ref, nothing re-run."""
    from prefect import flow

    from posttrain_core.rewards.score import run_score
    from tasks.rollout import score

    ref = _register_rollouts(store, rollouts(["42", "7"], ["42", "42"]), tmp_path / "rollouts")
    scored = run_score(ScoreConfig(), ref, store)

    @flow
    def one_score():
        return score(ScoreConfig(), ref, store_root=str(store.root))

    assert one_score() == scored


@pytest.mark.slow
def test_reward_model_scores_through_run_score(ray_session, tiny_inputs, tmp_path):
    """A tiny RM (the tiny causal LM with a fresh scalar head) scores on 2 Ray actors = the same RM in-process."""
    from transformers import AutoModelForSequenceClassification

    from posttrain_core.data.io import read_dataset
    from posttrain_core.models.loading import load_tokenizer
    from posttrain_core.models.reward import load_reward_model, reward_scores
    from posttrain_core.rewards.score import run_score

    store, _, base = tiny_inputs
    tokenizer = load_tokenizer(base.uri)
    rm = AutoModelForSequenceClassification.from_pretrained(base.uri, num_labels=1)
    rm.config.pad_token_id = tokenizer.pad_token_id
    rm.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    rm_ref = store.register_external(tmp_path / "rm", kind="model")

    responses = ["42", "The answer is 42.", "41", "", "hello there", "4 2"]
    table = rollouts(responses, ["42"] * 6)
    ref = _register_rollouts(store, table, tmp_path / "rollouts")
    cfg = ScoreConfig(verifiers={"exact_match": 1.0}, reward_model_weight=0.5, num_workers=2, batch_size=2)
    scored = read_dataset(store.local_path(run_score(cfg, ref, store, reward_model=rm_ref)), "scored_rollouts")

    model, tok = load_reward_model(tmp_path / "rm")
    expected = reward_scores(model, tok, [USER] * 6, responses)
    got = [c["reward_model"] for c in _components(scored)]
    assert got == pytest.approx(expected, abs=1e-5)
    em = [c["exact_match"] for c in _components(scored)]
    assert scored.column("reward").to_pylist() == pytest.approx(
        [e + 0.5 * s for e, s in zip(em, expected, strict=True)], abs=1e-5
    )
