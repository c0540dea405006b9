"""End to end: the rlhf flow on a user's prompts file with a reward function from a file of theirs, written in a
temporary folder outside the package, on the tiny model; and the README's quick start, run as written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]

USER_REWARD = '''
import json
from pathlib import Path

LOG = Path(__file__).with_name("calls.jsonl")
failed = []

def rate(prompt, response, answer, meta):
    """Logs what it is given; fails once on prompt 7 (one sample of 64), then scores a digit and brevity."""
    with LOG.open("a") as f:
        f.write(json.dumps({"answer": answer, "meta": meta, "user": prompt[-1]["content"]}) + "\\n")
    if meta["id"] == 7 and not failed:
        failed.append(1)
        raise RuntimeError("a bad sample")
    return {"digit": float(any(c.isdigit() for c in response)), "brevity": -len(response) / 50 * BREVITY}

BREVITY = 1.0
'''


def _prompts(folder: Path) -> Path:
    path = folder / "prompts.jsonl"
    rows = [{"prompt": f"What is {i} + {i + 1}?", "answer": str(2 * i + 1), "id": i, "level": i % 3} for i in range(16)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _config(folder: Path, model_path: str, reward: Path):
    from posttrain_core.config import RLHFFlowConfig

    return RLHFFlowConfig(
        store=str(folder / "store"),
        model={"path": model_path},
        pretrain=None,
        sft=None,
        data={"prompts_path": str(_prompts(folder)), "eval_path": str(folder / "prompts.jsonl"), "n_train": 200},
        iterations=2,
        rollout={"n": 4, "max_prompts": 16, "max_tokens": 8, "num_engines": 1, "batch_size": 16},
        score={"verifiers": {}, "reward_functions": {f"{reward}:rate": 1.0}},
        rl={"algorithm": "grpo", "lr": 1e-3, "micro_batch_size": 16, "mini_batches": 2},
        eval={"max_new_tokens": 4, "num_engines": 1, "max_prompts": 8},
        eval_samples=0,
    )


def _scores(store) -> list[dict]:
    out = [store.manifest(r) for r in store.list()]
    return sorted((m for m in out if m.get("stage") == "score"), key=lambda m: m["created"])


def test_rl_on_a_prompts_file_with_a_reward_function_of_the_user(prefect_api, ray_session, tiny_inputs, tmp_path):
    from flows.rlhf import rlhf_flow
    from posttrain_core.artifacts import ArtifactStore
    from posttrain_core.data.io import read_dataset

    _, _, base = tiny_inputs
    folder = tmp_path / "user"
    folder.mkdir()
    reward = folder / "my_reward.py"
    reward.write_text(USER_REWARD)
    cfg = _config(folder, str(base.uri), reward)
    result = rlhf_flow(cfg)
    store = ArtifactStore(cfg.store)

    # The function saw each row's answer and its other columns (in meta).
    calls = [json.loads(line) for line in (folder / "calls.jsonl").read_text().splitlines()]
    assert len(calls) == 2 * 64
    for c in calls:
        i = int(re.search(r"What is (\d+) \+", c["user"]).group(1))
        assert c["answer"] == str(2 * i + 1) and c["meta"] == {"id": i, "level": i % 3}
    # Its components land in reward_components; the one failing sample was counted, the run went on.
    scores = _scores(store)
    assert len(scores) == 2 and scores[0]["metrics"]["reward_errors"] == 1.0
    assert scores[1]["metrics"]["reward_errors"] <= 1.0  # a Ray worker that had not loaded the file fails once too
    assert {"reward/digit", "reward/brevity"} <= set(scores[0]["metrics"])
    first = read_dataset(
        store.local_path(next(r for r in store.list() if r.key == scores[0]["key"])), "scored_rollouts"
    )
    names = {name for row in first.column("reward_components").to_pylist() for name, _ in row}
    assert names == {"digit", "brevity", "rate"}  # `rate`: the zero of the failed sample
    assert scores[0]["user_code"] == {f"{reward}:rate": scores[0]["user_code"][f"{reward}:rate"]}
    assert len(result["curve"]) == 2

    # Editing the reward scores again; the samples of iteration 1 are a cache hit.
    rollouts_before = {m["key"] for m in map(store.manifest, store.list()) if m.get("stage") == "rollout"}
    reward.write_text(USER_REWARD.replace("BREVITY = 1.0", "BREVITY = 2.0"))
    rlhf_flow(cfg)
    again = _scores(store)
    assert len(again) >= 3 and again[2]["key"] not in {s["key"] for s in scores}
    rollouts_after = {m["key"] for m in map(store.manifest, store.list()) if m.get("stage") == "rollout"}
    assert len(rollouts_after & rollouts_before) >= 1  # iteration 1's rollout reused
    assert again[2]["metrics"]["reward/brevity"] == pytest.approx(2 * scores[0]["metrics"]["reward/brevity"])


def _blocks(markdown: str, heading: str) -> list[str]:
    section = markdown[markdown.index(heading) :]
    section = section[: section.index("**(d)")]
    return re.findall(r"```\w*\n(.*?)```", section, re.DOTALL)


def test_the_readme_quick_start_on_your_own_prompts_and_reward_runs_as_written(
    prefect_api, ray_session, tiny_inputs, tmp_path, monkeypatch
):
    """The three blocks of README (c), written to the files they name; only the model path is replaced."""
    _, _, base = tiny_inputs
    prompts, reward, snippet = _blocks((REPO / "README.md").read_text(), "**(c) RL on your own prompts and reward**")
    monkeypatch.chdir(tmp_path)
    Path("prompts.jsonl").write_text(prompts)
    Path("my_reward.py").write_text(reward)
    code = snippet.replace("/models/my-sft-model", str(base.uri)).replace("print(", "_ = (")
    scope: dict = {}
    exec(compile(code, "README.md quick start (c)", "exec"), scope)
    result = scope["result"]
    assert len(result["curve"]) == 2 and Path(result["policy"].uri).exists()
    assert "accuracy" in result["eval"][0] and "accuracy" in result["eval"][2]
