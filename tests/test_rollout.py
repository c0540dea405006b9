"""The HF rollout engine and the rollout stage: seeded samples, trainer-exact log-probs, LoRA, the actor pool."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from posttrain_core.config import RolloutConfig
from posttrain_core.rollout.engine import SamplingSettings


@pytest.fixture(scope="module")
def prompts_table(tiny_inputs):
    from posttrain_core.data.io import read_dataset

    store, data, _ = tiny_inputs
    return read_dataset(store.local_path(data.eval), "prompts")


@pytest.fixture(scope="module")
def engine(tiny_inputs):
    from posttrain_core.rollout.hf_engine import HFEngine

    _, _, base = tiny_inputs
    return HFEngine(base.uri, policy_digest=base.digest)


def _samples(table: pa.Table) -> dict[tuple[str, int], list[int]]:
    return {(r["prompt_id"], r["sample_index"]): r["response_ids"] for r in table.to_pylist()}


def _trainer_logprobs(model, prompt_ids: list[int], response_ids: list[int]) -> torch.Tensor:
    """What the trainer computes: one forward over prompt + response, log_softmax at each response position."""
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    P = len(prompt_ids)
    return torch.log_softmax(logits[P - 1 : -1], -1).gather(-1, torch.tensor(response_ids)[:, None]).squeeze(-1)


def test_same_seed_same_samples_whatever_the_batch(tiny_inputs, engine, prompts_table):
    from posttrain_core.rollout.hf_engine import HFEngine

    _, _, base = tiny_inputs
    prompts = prompts_table.slice(0, 6)
    params = SamplingSettings(n=3, temperature=1.0, max_tokens=8, seed=7)
    a = engine.generate(prompts, params)
    assert a.num_rows == 18
    assert a.column("sample_index").to_pylist() == [0, 1, 2] * 6
    # Another engine, smaller forward batches, the prompts in another order and fewer of them.
    b = HFEngine(base.uri, max_batch_size=4).generate(prompts.take([5, 2, 0, 3]), params)
    sa, sb = _samples(a), _samples(b)
    assert all(sa[k] == v for k, v in sb.items())
    assert len({tuple(v) for v in sa.values()}) > 1  # it does sample
    other = _samples(engine.generate(prompts, SamplingSettings(n=3, temperature=1.0, max_tokens=8, seed=8)))
    assert other != sa


def test_each_distinct_prompt_is_prefilled_once_for_all_its_samples(tiny_inputs, engine, prompts_table):
    """The n samples of a prompt share its prefill; they decode as each sample would alone."""
    from posttrain_core.rollout.hf_engine import HFEngine

    _, _, base = tiny_inputs
    prompts, params = prompts_table.slice(0, 3), SamplingSettings(n=4, temperature=1.0, max_tokens=6, seed=3)
    shapes: list[tuple[int, ...]] = []
    hook = engine.model.register_forward_pre_hook(
        lambda _m, _args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    try:
        shared = engine.generate(prompts, params)
    finally:
        hook.remove()
    assert shapes[0][0] == 3 and set(shapes[1:]) == {(12, 1)}, shapes  # 3 prompt rows, then 12 sample rows
    alone = HFEngine(base.uri, max_batch_size=1).generate(prompts, params)  # one sample per batch: nothing shared
    assert shared.column("response_ids").to_pylist() == alone.column("response_ids").to_pylist()
    gap = max(
        abs(x - y)
        for u, v in zip(shared.column("logprobs").to_pylist(), alone.column("logprobs").to_pylist(), strict=True)
        for x, y in zip(u, v, strict=True)
    )
    assert gap < 1e-5


def test_logprobs_equal_the_trainers(engine, prompts_table):
    """Raw-distribution log-probs (temperature 1, no top-p) whatever the sampling settings: |diff| < 1e-4 in fp32."""
    prompts = prompts_table.slice(0, 4)
    for params in (
        SamplingSettings(n=2, temperature=1.0, max_tokens=10, seed=1),
        SamplingSettings(n=2, temperature=0.7, top_p=0.9, max_tokens=10, seed=1),
    ):
        out = engine.generate(prompts, params)
        worst = 0.0
        for r in out.to_pylist():
            assert len(r["logprobs"]) == len(r["response_ids"]) > 0
            ref = _trainer_logprobs(engine.model, r["prompt_ids"], r["response_ids"])
            worst = max(worst, (ref - torch.tensor(r["logprobs"])).abs().max().item())
        assert worst < 1e-4


def _hf_generate(model, tokenizer, chats: list[list[dict]], max_new_tokens: int) -> list[str]:
    """Greedy answers from transformers' own `generate` (left-padded batch), for comparison with the engine."""
    from posttrain_core.data.chat import tokenize_prompt
    from posttrain_core.models.heads import left_padded

    ids, mask = left_padded([tokenize_prompt(tokenizer, c) for c in chats], tokenizer.pad_token_id)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
    return tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)


def test_greedy_matches_generate_and_finish_reasons(engine, prompts_table):
    """Greedy answers equal transformers' `generate` (what evaluation reports), and finish reasons follow the stops."""
    prompts = prompts_table.slice(0, 6)
    greedy = engine.generate(prompts, SamplingSettings(n=2, temperature=0.0, max_tokens=8))
    texts = greedy.column("response_text").to_pylist()
    assert texts[0::2] == texts[1::2]  # greedy: all n samples equal
    assert texts[0::2] == _hf_generate(engine.model, engine.tokenizer, prompts.column("messages").to_pylist(), 8)

    out = engine.generate(prompts, SamplingSettings(n=4, temperature=1.0, max_tokens=8, seed=0, stop=(" ",)))
    assert set(out.column("policy_digest").to_pylist()) == {engine.policy_digest}
    assert out.column("response_mask").null_count == out.num_rows
    for r in out.to_pylist():
        if r["finish_reason"] == "length":
            assert len(r["response_ids"]) == 8 and " " not in r["response_text"]
        else:
            assert r["finish_reason"] == "stop"
            assert r["response_ids"][-1] in engine.eos_ids or " " not in r["response_text"]
    assert "stop" in out.column("finish_reason").to_pylist()


def test_lora_adapter_generates_through_the_adapter(tiny_inputs, engine, prompts_table, tmp_path):
    from posttrain_core.config import LoraConfig
    from posttrain_core.models.loading import load_causal_lm, save_checkpoint
    from posttrain_core.models.lora import apply_lora
    from posttrain_core.rollout.hf_engine import HFEngine

    _, _, base = tiny_inputs
    peft_model = apply_lora(load_causal_lm(base.uri), LoraConfig(r=4, alpha=8), seed=0)
    with torch.no_grad():  # B starts at zero (adapter == base): perturb it
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.5)
    save_checkpoint(peft_model, engine.tokenizer, tmp_path / "adapter", base_model=base.uri)

    prompts = prompts_table.slice(0, 4)
    params = SamplingSettings(n=1, temperature=0.0, max_tokens=8)
    adapter_engine = HFEngine(str(tmp_path / "adapter"))
    with_adapter = adapter_engine.generate(prompts, params)
    assert (
        with_adapter.column("response_ids").to_pylist()
        != engine.generate(prompts, params).column("response_ids").to_pylist()
    )
    for r in with_adapter.to_pylist():  # log-probs are the adapter's
        ref = _trainer_logprobs(adapter_engine.model, r["prompt_ids"], r["response_ids"])
        assert (ref - torch.tensor(r["logprobs"])).abs().max().item() < 1e-4
    # load swaps the policy in place.
    swapped = HFEngine(base.uri)
    assert swapped.load(str(tmp_path / "adapter"), policy_digest="new") == "reloaded"
    again = swapped.generate(prompts, params)
    assert again.column("response_ids").to_pylist() == with_adapter.column("response_ids").to_pylist()
    assert set(again.column("policy_digest").to_pylist()) == {"new"}


def test_bad_input_fails_before_ray(tiny_inputs, tmp_path, monkeypatch):
    import posttrain_core.cluster
    from posttrain_core.data.schemas import SchemaError
    from posttrain_core.rollout.stage import run_rollout

    def no_ray(*a, **k):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(posttrain_core.cluster, "connect", no_ray)
    store, data, base = tiny_inputs
    before = len(store.list())
    cfg = RolloutConfig(n=2, max_tokens=8)
    with pytest.raises(ValueError, match="'prompts' dataset"):
        run_rollout(cfg, data.text, base, store)

    folder = tmp_path / "no-messages"
    folder.mkdir()
    pq.write_table(pa.table({"prompt_id": ["a"], "answer": ["1"], "meta": [None]}), folder / "part-00000.parquet")
    no_messages = store.register_external(folder, kind="dataset", schema_kind="prompts")
    with pytest.raises(SchemaError, match="column 'messages' is missing"):
        run_rollout(cfg, no_messages, base, store)

    with pytest.raises(ValueError, match=r"max_tokens \(600\).*max_position_embeddings=512"):
        run_rollout(RolloutConfig(max_tokens=600), data.eval, base, store)
    with pytest.raises(ValueError, match="RolloutConfig.engine='vllm'"):
        run_rollout(RolloutConfig(engine="vllm", vllm_python=str(tmp_path / "nope/python")), data.eval, base, store)
    assert len(store.list()) == before  # nothing published


def test_the_context_check_loads_a_tokenizer_once_per_tokenizer_bytes(
    tiny_inputs, prompts_table, tmp_path, monkeypatch
):
    """Another policy folder with the same tokenizer files reuses the tokenizer; changed files load it again."""
    import shutil

    import posttrain_core.models.loading as loading
    from posttrain_core.rollout import prompts

    store, _, base = tiny_inputs
    first, same, other = (tmp_path / name for name in ("first", "same", "other"))
    for folder in (first, same, other):
        shutil.copytree(store.local_path(base), folder)
    template = other / "chat_template.jinja"
    assert template.exists()
    template.write_text(template.read_text() + "\n")
    loads = []
    real = loading.load_tokenizer
    monkeypatch.setattr(loading, "load_tokenizer", lambda *a, **k: loads.append(a[0]) or real(*a, **k))
    monkeypatch.setattr(prompts, "_TOKENIZERS", {})  # earlier tests of this process loaded the same tokenizer bytes
    lengths = prompts.prompt_lengths(first, prompts_table.slice(0, 5))
    assert prompts.prompt_lengths(same, prompts_table.slice(0, 5)) == lengths and loads == [first]
    assert prompts.prompt_lengths(same, prompts_table.slice(1, 5))[:4] == lengths[1:] and loads == [first]
    prompts.prompt_lengths(other, prompts_table.slice(0, 5))
    assert loads == [first, other]  # other tokenizer bytes: loaded again


def test_what_crosses_ray_pickles(tiny_inputs):
    import pickle

    import ray.cloudpickle

    from posttrain_core.rollout.stage import sampling_settings
    from posttrain_core.rollout.worker import RolloutWorker

    params = sampling_settings(RolloutConfig(n=3, stop=["\n"], top_p=0.9, seed=5))
    assert pickle.loads(pickle.dumps(params)) == params
    assert params.stop == ("\n",)
    assert pickle.loads(ray.cloudpickle.dumps(RolloutWorker)) is RolloutWorker  # by reference: importable in workers
    _, _, base = tiny_inputs
    assert pickle.loads(pickle.dumps(base)) == base


def test_prompts_per_call_keeps_every_engine_busy():
    from posttrain_core.rollout.prompts import prompts_per_call

    assert prompts_per_call(32, 2, 8) == 4  # one call of 8 would leave an engine idle
    assert prompts_per_call(32, 2, 9) == 5  # 5 + 4
    assert prompts_per_call(32, 2, 256) == 32  # enough work: batch_size caps it
    assert prompts_per_call(32, 2, 1) == 1
    assert prompts_per_call(32, 1, 8) == 8


POOL_CFG = RolloutConfig(n=3, temperature=1.0, max_tokens=6, num_engines=2, batch_size=4, max_prompts=10, seed=11)


@pytest.mark.slow
def test_two_engines_give_every_prompt_exactly_n_samples(ray_session, tiny_inputs, engine, prompts_table):
    from posttrain_core.data.io import read_dataset
    from posttrain_core.rollout.stage import run_rollout, sampling_settings

    store, data, base = tiny_inputs
    ref = run_rollout(POOL_CFG, data.eval, base, store)
    assert ref.schema_kind == "rollouts"
    out = read_dataset(store.local_path(ref), "rollouts")
    ids = prompts_table.column("prompt_id").to_pylist()[:10]
    assert out.num_rows == 30
    assert [(r["prompt_id"], r["sample_index"]) for r in out.to_pylist()] == [(p, k) for p in ids for k in range(3)]
    assert set(out.column("policy_digest").to_pylist()) == {base.digest}
    assert "messages" in out.column_names
    # Batches of 4 prompts over 2 actors give the samples one in-process engine gives.
    alone = engine.generate(prompts_table.slice(0, 10), sampling_settings(POOL_CFG))
    assert _samples(out) == _samples(alone)
    metrics = store.manifest(ref)["metrics"]
    assert metrics["samples"] == 30 and metrics["tokens_per_s"] > 0
    assert metrics["response_len_max"] <= 6
    assert run_rollout(POOL_CFG, data.eval, base, store) == ref  # cached: nothing runs


@pytest.mark.slow
def test_sampled_evaluation_reports_pass_at_k_from_the_rollout_engines(ray_session, tiny_inputs, engine, prompts_table):
    """The evaluate stage with several samples per prompt: the rollout stage's samples (same engines, seeds and
    batches give the same rows), scored by the verifier, and pass@1 <= pass@k."""
    from posttrain_core.config import EvalConfig
    from posttrain_core.data.io import read_dataset
    from posttrain_core.evaluate import run_evaluate

    store, data, base = tiny_inputs
    cfg = EvalConfig(samples=3, temperature=1.0, max_new_tokens=6, seed=11, num_engines=2, batch_size=4, max_prompts=10)
    ref = run_evaluate(cfg, data.eval, base, store)
    metrics = store.manifest(ref)["metrics"]
    assert metrics["num_prompts"] == 10
    assert 0.0 <= metrics["pass@1"] <= metrics["pass@3"] <= 1.0
    assert metrics["pass@1"] == pytest.approx(metrics["accuracy"])  # pass@1 is the mean over all samples
    rows = read_dataset(store.local_path(ref), "eval")
    alone = engine.generate(prompts_table.slice(0, 10), SamplingSettings(n=3, temperature=1.0, max_tokens=6, seed=11))
    assert rows.column("response_text").to_pylist() == alone.column("response_text").to_pylist()


@pytest.mark.slow
def test_vllm_engine_through_the_stage(ray_session, tiny_inputs, engine, prompts_table, vllm_or_skip, vllm_warm):
    """engine="vllm" runs VLLMEngine in the vLLM environment through the same stage (skipped without it)."""
    from posttrain_core.data.io import read_dataset
    from posttrain_core.rollout.stage import run_rollout, sampling_settings

    cfg = RolloutConfig(engine="vllm", n=2, temperature=0.0, max_tokens=6, num_engines=1, batch_size=4, max_prompts=4)
    vllm_or_skip(cfg)
    store, data, base = tiny_inputs
    out = read_dataset(store.local_path(run_rollout(cfg, data.eval, base, store, warm=vllm_warm)), "rollouts")
    hf = engine.generate(prompts_table.slice(0, 4), sampling_settings(cfg))
    assert out.column("response_ids").to_pylist() == hf.column("response_ids").to_pylist()  # greedy: same tokens
    assert set(out.column("policy_digest").to_pylist()) == {base.digest}
    for a, b in zip(out.column("logprobs").to_pylist(), hf.column("logprobs").to_pylist(), strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-2
