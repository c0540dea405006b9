"""Multi-turn tool rollouts on the real engines: a tiny model overfitted on a few tool-using chats calls a user's tool
(defined in a file outside the package) through the HF engine and through the vLLM engine (a Ray actor in its own
environment); both give the same greedy trajectories, and rows satisfy the token-in-token-out invariants."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from posttrain_core.config import RolloutConfig
from posttrain_core.rollout.engine import SamplingSettings
from posttrain_core.rollout.multiturn import ToolSettings

TOOL = textwrap.dedent(
    '''
    def lookup(key: str) -> str:
        """The secret code of a key.

        Args:
            key: the key
        """
        return str(sum(ord(c) for c in key) % 900 + 100)


    class Lookups:
        """The same table as a stateful environment: a small bonus for exactly one lookup."""

        def reset(self, row):
            self.calls, self.pid = 0, row["prompt_id"]
            return None

        def step(self, call):
            self.calls += 1
            return lookup(call.arguments["__positional__"][0]), 0.0, False

        def reward(self):
            return 0.1 if self.calls == 1 else 0.0
    '''
)
KEYS = ["qz", "ab", "mo", "te"]


def _code(key: str) -> str:
    return str(sum(ord(c) for c in key) % 900 + 100)


def _chat(key: str) -> list[dict]:
    return [
        {"role": "user", "content": f"What is the code of {key}?"},
        {"role": "assistant", "content": f"<tool_call>lookup {key}</tool_call>"},
        {"role": "tool", "content": _code(key)},
        {"role": "assistant", "content": f"The answer is {_code(key)}"},
    ]


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory) -> dict:
    """A tiny Llama trained (in this process, 150 steps) until greedy decoding reproduces the tool-using chats."""
    from posttrain_core.data.chat import IGNORE_INDEX, tokenize_chat
    from posttrain_core.models.loading import load_causal_lm
    from posttrain_core.models.tiny import build_tiny_checkpoint
    from posttrain_core.models.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("tool-model")
    (root / "my_tools.py").write_text(TOOL)
    corpus = [m["content"] for k in KEYS for m in _chat(k)] * 20 + ["system\n", "user\n", "assistant\n", "tool\n"]
    tokenizer = train_tokenizer(corpus, vocab_size=320)
    path = build_tiny_checkpoint(root / "model", tokenizer, seed=0)
    model = load_causal_lm(path).train()
    rows = [tokenize_chat(tokenizer, _chat(k)) for k in KEYS]
    width = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([x + [tokenizer.pad_token_id] * (width - len(x)) for x, _ in rows])
    labels = torch.tensor([y + [IGNORE_INDEX] * (width - len(y)) for _, y in rows])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for _ in range(150):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert loss.item() < 0.05, loss.item()
    model.save_pretrained(str(path), safe_serialization=True)
    return {"path": str(path), "tool": f"{root / 'my_tools.py'}:lookup", "env": f"{root / 'my_tools.py'}:Lookups"}


def _prompts() -> pa.Table:
    return pa.table(
        {
            "prompt_id": [f"p-{k}" for k in KEYS],
            "messages": [_chat(k)[:1] for k in KEYS],
            "answer": [_code(k) for k in KEYS],
        }
    )


def _settings(tool: str, temperature: float = 0.0) -> SamplingSettings:
    tools = ToolSettings(tools=(tool,), parser="compact", max_turns=3, max_total_tokens=64)
    return SamplingSettings(n=2, temperature=temperature, max_tokens=16, seed=3, tools=tools)


def _check_rows(table: pa.Table) -> list[dict]:
    rows = table.to_pylist()
    for r in rows:
        n = len(r["response_ids"])
        assert n == len(r["logprobs"]) == len(r["response_mask"])
        turns = json.loads(r["turns"])
        policy = {i for s in turns if s["role"] == "assistant" for i in range(*s["span"])}
        assert policy == {i for i, m in enumerate(r["response_mask"]) if m}
        assert all(lp == 0.0 for lp, m in zip(r["logprobs"], r["response_mask"], strict=True) if not m)
    return rows


def test_the_hf_engine_runs_a_users_tool_over_turns(tool_model):
    from posttrain_core.rollout.hf_engine import HFEngine

    engine = HFEngine(tool_model["path"])
    table = engine.generate(_prompts(), _settings(tool_model["tool"]))
    rows = _check_rows(table)
    for r in rows:
        key = r["prompt_id"].removeprefix("p-")
        turns = json.loads(r["turns"])
        assert r["num_turns"] == 2 and r["num_tool_calls"] == 1 and r["tool_errors"] == 0, turns
        assert turns[1]["content"] == _code(key) and turns[1]["status"] == "ok"
        assert r["response_text"] == f"The answer is {_code(key)}" and r["finish_reason"] == "stop"
    # sampled: the same seed gives the same trajectories
    again = [engine.generate(_prompts(), _settings(tool_model["tool"], 1.0)) for _ in range(2)]
    assert again[0].drop_columns(["turns"]).equals(again[1].drop_columns(["turns"]))


@pytest.mark.slow
def test_the_vllm_engine_gives_the_same_greedy_trajectories(tool_model, ray_session, vllm_or_skip):
    import ray

    from posttrain_core.rollout.hf_engine import HFEngine
    from posttrain_core.rollout.vllm_engine import VLLMEngine
    from posttrain_core.rollout.vllm_env import vllm_actor_options

    cfg = RolloutConfig(engine="vllm")
    vllm_or_skip(cfg)
    actor = ray.remote(VLLMEngine).options(**vllm_actor_options(cfg)).remote(tool_model["path"])
    try:
        ours = ray.get(actor.generate.remote(_prompts(), _settings(tool_model["tool"])), timeout=600)
    finally:
        ray.kill(actor, no_restart=True)
    hf = HFEngine(tool_model["path"]).generate(_prompts(), _settings(tool_model["tool"]))
    rows, hf_rows = _check_rows(ours), hf.to_pylist()
    assert [r["response_ids"] for r in rows] == [r["response_ids"] for r in hf_rows]
    assert [r["response_mask"] for r in rows] == [r["response_mask"] for r in hf_rows]
    gaps = [
        abs(a - b)
        for r, h in zip(rows, hf_rows, strict=True)
        for a, b in zip(r["logprobs"], h["logprobs"], strict=True)
    ]
    assert max(gaps) < 1e-3
    assert all(r["num_tool_calls"] == 1 for r in rows)
    assert Path(tool_model["tool"].split(":")[0]).is_file()


@pytest.mark.slow
# On the hf engine: the vLLM engine's multi-turn sampling is the greedy-equality test's above; what a flow adds (tool
# metrics, the environment's reward, the update's per-turn gap, cache hits) does not depend on the engine.
@pytest.mark.parametrize("kind", ["tool", "env"])
def test_an_rl_flow_with_a_users_tool(tool_model, kind, tmp_path, session_dir, prefect_api, ray_session):
    """2 GRPO iterations with the user's tool or environment: trajectories call it, the update trains on policy tokens
    only and reports the log-prob gap per turn, the rollout stage reports the tool metrics, the environment's final
    reward reaches the score, and a re-run is all cache hits."""
    from flows.rlhf import rlhf_flow
    from posttrain_core.artifacts import ArtifactStore
    from posttrain_core.config import RLHFFlowConfig

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": _chat(k)[0]["content"], "answer": _code(k)}) + "\n" for k in KEYS))
    tools = {"tools": [tool_model["tool"]]} if kind == "tool" else {"environment": tool_model["env"]}
    tools |= {"parser": "compact", "max_turns": 3, "max_total_tokens": 64}
    rollout = dict(engine="hf", n=2, max_prompts=4, max_tokens=16, num_engines=1, tools=tools)
    config = RLHFFlowConfig(
        store=str(session_dir / f"tools-{kind}"), model={"path": tool_model["path"]}, pretrain=None, sft=None,
        data={"prompts_path": str(prompts), "eval_path": str(prompts)}, iterations=2, rollout=rollout,
        score={"verifiers": {"numeric": 1.0}, "tool_call_cost": 0.05},
        rl={"algorithm": "grpo", "mini_batches": 1, "micro_batch_size": 8, "lr": 1e-4},
        eval={"verifier": "numeric", "max_new_tokens": 16, "num_engines": 1}, eval_samples=0,
    )  # fmt: skip
    result = rlhf_flow(config)
    store = ArtifactStore(config.store)
    rollouts = [store.manifest(r) for r in store.list() if store.manifest(r)["stage"] == "rollout"]
    assert len(rollouts) == 2
    scores = [store.manifest(r)["metrics"] for r in store.list() if store.manifest(r)["stage"] == "score"]
    bonus = [m["reward/tool_reward"] for m in scores]
    assert all(b > 0.05 for b in bonus) if kind == "env" else all(b == 0.0 for b in bonus), bonus
    for m in rollouts:
        assert m["metrics"]["tool_calls_per_sample"] > 0.5 and m["metrics"]["tool_error_rate"] == 0.0, m["metrics"]
        assert "tool_latency_p95_ms" in m["metrics"] and m["metrics"]["turns_mean"] >= 1.5
    assert all(row["turns_mean"] >= 1.5 and row["tool_error_rate"] == 0.0 for row in result["curve"])  # Prefect table
    update = store.manifest(result["policy"])["metrics"]
    assert math.isfinite(update["pg_loss"]) and update["logp_mismatch_mean"] < 1e-2, update
    assert update["logp_mismatch_mean/turn2"] < 1e-2 and update["response_len_max"] <= 16 * 3, update
    again = rlhf_flow(config)
    assert again["policy"].key == result["policy"].key
