"""vLLM as a teacher (`VLLMEngine.score`): a real vLLM engine actor in the vLLM environment (.venv-vllm) scores
rows, checked against `HFEngine.score` on the same model folder in this process.

Two of the rows share a long prefix that the prefix cache holds, response tokens included (see `rows`): vLLM has
no prompt log-probs for cached positions, so `score` must not read the cache.
"""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from posttrain_core.config import RolloutConfig
from posttrain_core.rollout.engine import SamplingSettings

CALL_TIMEOUT_S = 300  # a generous bound on any engine call (a loaded 2-core machine is slow), so a hang fails
TOPK = 5
BLOCK, SPLIT = 128, 100  # vLLM's KV block size on CPU; where the long rows' responses start
SHORT = [[{"role": "user", "content": f"What is {a} + {b}?"}] for a, b in [(1, 2), (13, 4), (7, 7), (40, 2)]]
LONG = [
    {"role": "system", "content": " ".join(f"What is {a} + {a + 1}? {2 * a + 1}." for a in range(30))},
    {"role": "user", "content": "What is 3 + 5?"},
]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    """A tiny Llama (head_dim 32, as vLLM's CPU kernels need) with every non-norm weight scaled by 16: a random
    model's distribution is nearly flat (top-2 gaps ~1e-3); sharpened, its top-1 tokens are well separated."""
    from posttrain_core.models.loading import load_causal_lm
    from posttrain_core.models.tiny import build_tiny_checkpoint
    from posttrain_core.models.tokenizer import train_tokenizer

    texts = [f"What is {a} + {b}? {a + b}" for a in range(50) for b in range(20)]
    path = build_tiny_checkpoint(
        tmp_path_factory.mktemp("teacher") / "m0",
        train_tokenizer(texts, vocab_size=320),
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        seed=0,
    )
    model = load_causal_lm(path)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(16.0)
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module")
def engine(model_path, ray_session, vllm_or_skip):
    """One `VLLMEngine` actor in the vLLM venv for the module."""
    import ray

    from posttrain_core.rollout.vllm_engine import VLLMEngine
    from posttrain_core.rollout.vllm_env import vllm_options

    cfg = RolloutConfig(engine="vllm")
    vllm_or_skip(cfg)
    actor = ray.remote(VLLMEngine).options(**vllm_options(cfg)).remote(model_path)
    ray.get(actor.info.remote(), timeout=CALL_TIMEOUT_S)
    yield actor
    try:
        ray.get(actor.close.remote(), timeout=60)
    finally:
        ray.kill(actor, no_restart=True)


def _call(actor, method: str, *args):
    import ray

    return ray.get(getattr(actor, method).remote(*args), timeout=CALL_TIMEOUT_S)


@pytest.fixture(scope="module")
def rows(engine) -> pa.Table:
    """Sampled rows: one per short prompt and two on the long one. The long ones are split at token SPLIT instead
    of where their prompt ends, so their responses start inside the first 128-token KV block, which generating
    them put in the prefix cache: scoring must not take those positions from the cache (they carry no log-probs)."""
    messages = SHORT + [LONG, LONG]  # two prompt ids: two seeds, two responses to one prompt
    prompts = pa.table({"prompt_id": [f"p{i}" for i in range(len(messages))], "messages": messages})
    out = _call(engine, "generate", prompts, SamplingSettings(n=1, temperature=1.0, max_tokens=12, seed=1))
    split = []
    for r in out.to_pylist():
        full, cut = r["prompt_ids"] + r["response_ids"], len(r["prompt_ids"])
        if cut > BLOCK:
            assert len(full) >= BLOCK + 12 and r["response_ids"] != []  # the long prompt fills block 0
            cut = SPLIT
        split.append({"prompt_ids": full[:cut], "response_ids": full[cut:]})
    assert sum(len(r["prompt_ids"]) == SPLIT for r in split) == 2
    return pa.Table.from_pylist(split, schema=out.select(["prompt_ids", "response_ids"]).schema)


@pytest.mark.slow
def test_vllm_scores_equal_hf_scores(engine, rows, model_path):
    from posttrain_core.rollout.hf_engine import HFEngine

    ours = _call(engine, "score", rows, TOPK).to_pylist()
    ref = HFEngine(model_path).score(rows, topk=TOPK).to_pylist()
    responses = rows.column("response_ids").to_pylist()
    gap, compared = 0.0, 0
    for got, want, tokens in zip(ours, ref, responses, strict=True):
        n = len(tokens)
        assert len(got["teacher_logprobs"]) == len(got["teacher_topk_ids"]) == len(got["teacher_topk_logprobs"]) == n
        gap = max(gap, max(abs(a - b) for a, b in zip(got["teacher_logprobs"], want["teacher_logprobs"], strict=True)))
        for j, token in enumerate(tokens):
            ids, logps = got["teacher_topk_ids"][j], got["teacher_topk_logprobs"][j]
            assert len(ids) == len(logps) == TOPK and logps == sorted(logps, reverse=True)
            gap = max(gap, max(abs(a - b) for a, b in zip(logps, want["teacher_topk_logprobs"][j], strict=True)))
            if token in ids:
                assert logps[ids.index(token)] == pytest.approx(got["teacher_logprobs"][j], abs=1e-6)
            hf_logps = want["teacher_topk_logprobs"][j]
            if hf_logps[0] - hf_logps[1] > 1e-3:
                assert ids[0] == want["teacher_topk_ids"][j][0]
                compared += 1
    print(f"max |vLLM - HF| log-prob over {sum(map(len, responses))} tokens: {gap:.2e}")
    assert gap < 1e-3, f"max |vLLM - HF| log-prob = {gap:.2e}"
    assert compared > sum(map(len, responses)) // 2  # the top-1 check covered most positions


@pytest.mark.slow
def test_topk_zero_and_limits(engine, rows):
    from posttrain_core.rollout.vllm_engine import MAX_TOPK

    plain = _call(engine, "score", rows, 0)
    assert (
        plain.column("teacher_topk_ids").null_count == plain.column("teacher_topk_logprobs").null_count == rows.num_rows
    )
    with_topk = _call(engine, "score", rows, TOPK)
    assert plain.column("teacher_logprobs").to_pylist() == with_topk.column("teacher_logprobs").to_pylist()
    with pytest.raises(ValueError, match=rf"distill\.topk.*{MAX_TOPK}"):
        _call(engine, "score", rows, MAX_TOPK + 1)
    too_long = pa.table({"prompt_ids": [[5], [5] * 400], "response_ids": [[6], [6] * 200]}, schema=rows.schema)
    with pytest.raises(ValueError, match="row 1 has 600 tokens"):
        _call(engine, "score", too_long, 0)
    empty = _call(engine, "score", pa.table({"prompt_ids": [[5]], "response_ids": [[]]}, schema=rows.schema), TOPK)
    assert empty.to_pylist() == [{"teacher_logprobs": [], "teacher_topk_ids": [], "teacher_topk_logprobs": []}]


@pytest.mark.slow
def test_the_teacher_stage_on_vllm_publishes_what_the_hf_engine_does(tiny_inputs, ray_session, vllm_or_skip):
    """The teacher_logprobs stage on each engine, over the same rollouts of the tiny base: the engine is part of the
    key, and the two artifacts hold the same log-probs."""
    from posttrain_core.config import DistillConfig
    from posttrain_core.data.io import read_dataset
    from posttrain_core.rollout.stage import run_rollout
    from posttrain_core.rollout.teacher import run_teacher_logprobs

    store, data, base = tiny_inputs
    rollouts = run_rollout(RolloutConfig(n=2, max_prompts=4, max_tokens=8, num_engines=1), data.prompts, base, store)
    on_vllm = DistillConfig(topk=TOPK, engine="vllm")
    vllm_or_skip(on_vllm)
    refs = {e: run_teacher_logprobs(DistillConfig(topk=TOPK, engine=e), rollouts, base, store) for e in ("hf", "vllm")}
    assert refs["hf"].key != refs["vllm"].key and store.manifest(refs["vllm"])["engine"] == "vllm"
    hf, vl = (read_dataset(store.local_path(refs[e]), "teacher_logprobs").to_pydict() for e in ("hf", "vllm"))
    assert hf["response_ids"] == vl["response_ids"]
    for name in ("teacher_logprobs", "teacher_topk_logprobs"):  # top-k values: the random model's near-ties may
        a = torch.tensor([x for row in hf[name] for x in row])  # order its ids differently, not their values
        b = torch.tensor([x for row in vl[name] for x in row])
        assert (a - b).abs().max() < 1e-3, (name, float((a - b).abs().max()))


def test_the_config_bound_on_top_k_is_the_engines():
    from pydantic import ValidationError

    from posttrain_core.config import VLLM_MAX_TOPK, DistillConfig
    from posttrain_core.rollout.vllm_engine import MAX_TOPK

    assert VLLM_MAX_TOPK == MAX_TOPK
    DistillConfig(topk=512)  # the hf engine: any k, up to the whole vocabulary (the exact divergence)
    with pytest.raises(ValidationError, match="distill.topk=65: the vLLM engine returns at most 64"):
        DistillConfig(topk=MAX_TOPK + 1, engine="vllm")
