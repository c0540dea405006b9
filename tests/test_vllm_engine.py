"""The vLLM engine for real: a Ray actor in the vLLM environment (.venv-vllm), started from this (Prefect) venv.

Checked against Hugging Face in this process: greedy tokens, per-token log-probs, weight reloads and LoRA adapters.
One engine actor serves the whole module (start-up is the expensive part); every test first loads the policy it
needs with `load`, so the tests do not depend on their order.

Without the vLLM environment the engine tests skip, naming `scripts/vllm_env.sh`; with POSTTRAIN_REQUIRE_VLLM=1
(set by `make test` after it creates the environment) they fail instead, so CI cannot skip them silently.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from posttrain_core.config import RolloutConfig
from posttrain_core.rollout.engine import SamplingSettings

CALL_TIMEOUT_S = 300  # a generous bound on any engine call (a loaded 2-core machine is slow), so a hang fails
PROMPTS = [
    [{"role": "user", "content": f"What is {a} + {b}?"}] for a, b in [(1, 2), (13, 4), (7, 7), (40, 2), (5, 9), (22, 3)]
] + [[{"role": "system", "content": "Reverse the word."}, {"role": "user", "content": "hello"}]]


def _vllm_python_or_skip() -> str:
    from posttrain_core.rollout.vllm_env import vllm_python

    try:
        return vllm_python(RolloutConfig(engine="vllm"))
    except RuntimeError as err:
        if os.environ.get("POSTTRAIN_REQUIRE_VLLM") == "1":
            raise
        pytest.skip(f"no vLLM environment: {err}")


def _sharpen(path: Path, factor: float) -> None:
    """Scale every non-norm weight: a random tiny model's next-token distribution is nearly uniform (greedy repeats
    one token, top-2 gaps ~1e-3); scaled by 16 it gives varied greedy outputs with top-2 gaps well above fp32 noise."""
    from posttrain_core.models.loading import load_causal_lm

    model = load_causal_lm(path)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(factor)
    model.save_pretrained(str(path), safe_serialization=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Two tiny Llamas (head_dim 32, one tokenizer) and a LoRA adapter on the first, built here in the main venv."""
    from posttrain_core.config import LoraConfig
    from posttrain_core.models.loading import load_causal_lm, load_tokenizer, save_checkpoint
    from posttrain_core.models.lora import apply_lora
    from posttrain_core.models.tiny import build_tiny_checkpoint
    from posttrain_core.models.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("vllm-models")
    texts = [f"What is {a} + {b}? {a + b}" for a in range(50) for b in range(20)] + [
        "Reverse the word. hello olleh"
    ] * 20
    tokenizer = train_tokenizer(texts, vocab_size=320)
    paths = {}
    for name, seed in (("m0", 0), ("m1", 1)):
        paths[name] = build_tiny_checkpoint(
            root / name, tokenizer, hidden_size=64, num_layers=2, num_heads=2, seed=seed
        )
        _sharpen(paths[name], 16.0)
    peft_model = apply_lora(load_causal_lm(paths["m0"]), LoraConfig(r=4, alpha=8), seed=0)
    with torch.no_grad():  # B starts at zero (adapter == base): perturb it
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 2.0)
    save_checkpoint(peft_model, load_tokenizer(paths["m0"]), root / "adapter", base_model=paths["m0"])
    paths["adapter"] = root / "adapter"
    other = apply_lora(load_causal_lm(paths["m1"]), LoraConfig(r=4, alpha=8), seed=0)
    save_checkpoint(other, load_tokenizer(paths["m1"]), root / "adapter-m1", base_model=paths["m1"])
    paths["adapter-m1"] = root / "adapter-m1"
    # Another architecture on the same tokenizer (wider, one more layer): not loadable in place.
    paths["wide"] = build_tiny_checkpoint(root / "wide", tokenizer, hidden_size=96, num_layers=3, num_heads=3, seed=2)
    _sharpen(paths["wide"], 16.0)
    return paths


@pytest.fixture(scope="module")
def hf(models):
    """The Hugging Face twins of the engine's policies (the adapter unmerged through peft, as the trainer runs it)."""
    from posttrain_core.models.loading import load_causal_lm, load_tokenizer

    return {"tokenizer": load_tokenizer(models["m0"])} | {
        name: load_causal_lm(models[name]).eval() for name in ("m0", "m1", "adapter", "wide")
    }


@pytest.fixture(scope="module")
def engine(models, ray_session):
    """One `VLLMEngine` actor in the vLLM venv, started from the adapter folder (base + LoRARequest path).

    Yields (actor, info, first) where `first` is the greedy output of the adapter right after start-up.
    """
    import ray

    from posttrain_core.rollout.vllm_engine import VLLMEngine
    from posttrain_core.rollout.vllm_env import vllm_actor_options

    python = _vllm_python_or_skip()
    options = vllm_actor_options(RolloutConfig(engine="vllm", vllm_python=python))
    started = time.perf_counter()
    actor = ray.remote(VLLMEngine).options(**options).remote(str(models["adapter"]), max_lora_rank=8)
    info = ray.get(actor.info.remote(), timeout=CALL_TIMEOUT_S)
    info["actor_start_seconds"] = time.perf_counter() - started
    print(
        f"vLLM engine actor up in {info['actor_start_seconds']:.1f} s (engine {info['startup_seconds']:.1f} s): {info}"
    )
    first = ray.get(actor.generate.remote(_prompts(), GREEDY), timeout=CALL_TIMEOUT_S)
    yield actor, info, first
    try:
        ray.get(actor.close.remote(), timeout=60)
    finally:
        ray.kill(actor, no_restart=True)


GREEDY = SamplingSettings(n=2, temperature=0.0, max_tokens=12)


def _prompts(rows: list[int] | None = None) -> pa.Table:
    rows = list(range(len(PROMPTS))) if rows is None else rows
    return pa.table(
        {
            "prompt_id": [f"p{i}" for i in rows],
            "messages": [PROMPTS[i] for i in rows],
            "answer": [str(i) for i in rows],
        }
    )


def _call(engine, method: str, *args):
    import ray

    actor = engine[0]
    return ray.get(getattr(actor, method).remote(*args), timeout=CALL_TIMEOUT_S)


def _use(engine, models, name: str) -> None:
    _call(engine, "load", str(models[name]))


def _hf_greedy(model, tokenizer, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """HF greedy generate on exactly the engine's prompt ids, one prompt at a time (no padding); eos kept."""
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([prompt_ids]),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    ids = out[0, len(prompt_ids) :].tolist()
    return ids[: ids.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in ids else ids


def _hf_logprobs(model, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """What the trainer computes: one forward over prompt + response, log_softmax(logits / T) of each response token."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt_ids + response_ids])).logits[0].float()
    P = len(prompt_ids)
    logp = torch.log_softmax(logits[P - 1 : -1] / temperature, -1)
    return logp.gather(-1, torch.tensor(response_ids)[:, None]).squeeze(-1)


def _max_gap(model, table: pa.Table, temperature: float = 1.0) -> float:
    worst = 0.0
    for r in table.to_pylist():
        assert len(r["logprobs"]) == len(r["response_ids"]) > 0
        ref = _hf_logprobs(model, r["prompt_ids"], r["response_ids"], temperature)
        worst = max(worst, (ref - torch.tensor(r["logprobs"])).abs().max().item())
    return worst


def _assert_greedy_matches(model, tokenizer, table: pa.Table, max_tokens: int) -> None:
    from posttrain_core.data.chat import tokenize_prompt

    for r in table.to_pylist():
        assert r["prompt_ids"] == tokenize_prompt(tokenizer, PROMPTS[int(r["prompt_id"][1:])])  # the chat template
        expected = _hf_greedy(model, tokenizer, r["prompt_ids"], max_tokens)
        assert r["response_ids"] == expected, r["prompt_id"]
        assert r["response_text"] == tokenizer.decode(expected, skip_special_tokens=True)
        assert r["finish_reason"] == ("stop" if expected[-1] == tokenizer.eos_token_id else "length")


def test_missing_vllm_python_gives_a_clear_error(tmp_path, monkeypatch):
    import posttrain_core.rollout.vllm_env as vllm_env

    with pytest.raises(RuntimeError, match=r"RolloutConfig\.vllm_python.*does not exist.*scripts/vllm_env\.sh"):
        vllm_env.vllm_python(RolloutConfig(engine="vllm", vllm_python=str(tmp_path / "nope/bin/python")))
    with pytest.raises(RuntimeError, match=r"RolloutConfig\.vllm_python"):
        vllm_env.vllm_actor_options(RolloutConfig(engine="vllm", vllm_python=str(tmp_path / "nope/bin/python")))
    monkeypatch.setenv("POSTTRAIN_VLLM_PYTHON", str(tmp_path / "env/bin/python"))
    with pytest.raises(RuntimeError, match=r"\$POSTTRAIN_VLLM_PYTHON.*scripts/vllm_env\.sh"):
        vllm_env.vllm_python(None)
    monkeypatch.delenv("POSTTRAIN_VLLM_PYTHON")
    monkeypatch.setattr(vllm_env, "DEFAULT_VLLM_VENV", tmp_path / ".venv-vllm")
    with pytest.raises(RuntimeError, match=r"\.venv-vllm/bin/python.*RolloutConfig\.vllm_python"):
        vllm_env.vllm_python(RolloutConfig())
    # A python that runs but has no vLLM (this one): caught before Ray starts a worker with it.
    with pytest.raises(RuntimeError, match="has no vllm"):
        vllm_env.vllm_actor_options(RolloutConfig(engine="vllm", vllm_python=sys.executable))


def test_actor_options_point_at_the_vllm_env():
    from posttrain_core.rollout.vllm_env import REPO_ROOT, vllm_actor_options

    python = _vllm_python_or_skip()
    options = vllm_actor_options(RolloutConfig(engine="vllm", vllm_python=python))
    env = options["runtime_env"]
    assert env["py_executable"] == python and options["num_cpus"] == 1
    assert env["env_vars"]["PYTHONPATH"] == str(REPO_ROOT)
    assert {"HF_HUB_OFFLINE", "VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING"} <= set(env["env_vars"])


@pytest.mark.slow
def test_engine_runs_in_the_vllm_environment(engine):
    import fastapi

    _, info, _ = engine
    assert Path(info["python"]).parent.parent == Path(info["prefix"])
    assert info["prefix"] == str(Path(_vllm_python_or_skip()).parent.parent)
    assert info["prefix"] != sys.prefix
    # The reason for the second environment: vLLM's fastapi pin and Prefect's cannot share one.
    assert info["fastapi"] != fastapi.__version__


@pytest.mark.slow
def test_greedy_equals_hf_generate(engine, models, hf):
    _use(engine, models, "m0")
    out = _call(engine, "generate", _prompts(), GREEDY)
    assert out.num_rows == 2 * len(PROMPTS)
    assert out.column("sample_index").to_pylist() == [0, 1] * len(PROMPTS)
    ids = out.column("response_ids").to_pylist()
    assert ids[0::2] == ids[1::2]  # greedy: all n samples equal
    assert len({tuple(x) for x in ids}) > 2  # varied outputs: the comparison means something
    _assert_greedy_matches(hf["m0"], hf["tokenizer"], out, GREEDY.max_tokens)
    assert out.schema.field("prompt_ids").type == pa.list_(pa.int32())
    assert out.schema.field("response_ids").type == pa.list_(pa.int32())
    assert out.column("answer").to_pylist()[0::2] == [str(i) for i in range(len(PROMPTS))]


@pytest.mark.slow
def test_logprobs_are_the_raw_model_distribution(engine, models, hf):
    """vLLM returns log_softmax(logits) of the sampled token: temperature and top_p are not applied."""
    _use(engine, models, "m0")
    gaps = {}
    for params in (
        SamplingSettings(n=2, temperature=1.0, max_tokens=12, seed=1),
        SamplingSettings(n=2, temperature=0.7, top_p=0.9, max_tokens=12, seed=1),
    ):
        out = _call(engine, "generate", _prompts(), params)
        gaps[params.temperature] = _max_gap(hf["m0"], out)
        if params.temperature != 1.0:
            assert _max_gap(hf["m0"], out, temperature=params.temperature) > 0.05  # not log_softmax(logits / T)
    print(f"max |logp_vllm - logp_hf|: {gaps}")
    assert max(gaps.values()) < 1e-2


@pytest.mark.slow
def test_seeded_samples_are_reproducible(engine, models):
    _use(engine, models, "m0")
    params = SamplingSettings(n=3, temperature=1.0, max_tokens=10, seed=7)

    def samples(table: pa.Table) -> dict[tuple[str, int], list[int]]:
        return {(r["prompt_id"], r["sample_index"]): r["response_ids"] for r in table.to_pylist()}

    a = _call(engine, "generate", _prompts(), params)
    assert a.num_rows == 3 * len(PROMPTS) and a.column("sample_index").to_pylist() == [0, 1, 2] * len(PROMPTS)
    assert samples(_call(engine, "generate", _prompts(), params)) == samples(a)
    # Fewer prompts, in another order: each (prompt_id, sample_index) keeps its own stream.
    part = samples(_call(engine, "generate", _prompts([5, 2, 0]), params))
    assert part == {k: v for k, v in samples(a).items() if k in part}
    assert len({tuple(v) for v in samples(a).values()}) > len(PROMPTS)  # the n samples of a prompt differ
    assert samples(
        _call(engine, "generate", _prompts(), SamplingSettings(n=3, temperature=1.0, max_tokens=10, seed=8))
    ) != samples(a)
    for r in a.to_pylist():
        assert r["finish_reason"] in ("stop", "length")
        assert (len(r["response_ids"]) == 10) or r["finish_reason"] == "stop"


@pytest.mark.slow
def test_load_in_place_gives_the_new_checkpoints_outputs(engine, models, hf):
    _use(engine, models, "m0")
    before = _call(engine, "generate", _prompts(), GREEDY)
    _use(engine, models, "m1")
    after = _call(engine, "generate", _prompts(), GREEDY)
    assert after.column("response_ids").to_pylist() != before.column("response_ids").to_pylist()
    _assert_greedy_matches(hf["m1"], hf["tokenizer"], after, GREEDY.max_tokens)
    # Log-probs too: on CPU a tied LM head kept the old weights until `WeightReload` re-packed it.
    sampled = _call(engine, "generate", _prompts(), SamplingSettings(n=2, temperature=1.0, max_tokens=12, seed=3))
    assert _max_gap(hf["m1"], sampled) < 1e-2
    _use(engine, models, "m0")
    assert _call(engine, "generate", _prompts(), GREEDY).column("response_ids") == before.column("response_ids")


@pytest.mark.slow
def test_lora_adapter_generates_through_the_adapter(engine, models, hf):
    _, info, first = engine
    assert info["lora"] == str(models["adapter"]) and info["base_path"] == str(models["m0"])
    # Started from the adapter folder: vLLM's base model + LoRARequest equals peft's unmerged adapter.
    _assert_greedy_matches(hf["adapter"], hf["tokenizer"], first, GREEDY.max_tokens)
    _use(engine, models, "m0")
    base = _call(engine, "generate", _prompts(), GREEDY)
    assert base.column("response_ids").to_pylist() != first.column("response_ids").to_pylist()
    _use(engine, models, "adapter")  # back to the adapter, in place
    assert _call(engine, "generate", _prompts(), GREEDY).column("response_ids") == first.column("response_ids")
    sampled = _call(engine, "generate", _prompts(), SamplingSettings(n=2, temperature=1.0, max_tokens=12, seed=3))
    assert _max_gap(hf["adapter"], sampled) < 1e-2
    # An adapter on another base: the engine starts again in its process, on that base.
    assert _call(engine, "load", str(models["adapter-m1"])) == "reloaded"
    assert _call(engine, "info")["base_path"] == str(models["m1"])


@pytest.mark.slow
def test_a_model_of_another_architecture_restarts_the_engine_in_its_process(engine, models, hf):
    """A warm engine of the process may next serve another flow's model: one that its weights cannot be reloaded
    into is served by a new vLLM engine in the same actor process, and generates as that model does."""
    pid = _call(engine, "info")["pid"]
    assert _call(engine, "load", str(models["wide"])) == "reloaded"
    _assert_greedy_matches(
        hf["wide"], hf["tokenizer"], _call(engine, "generate", _prompts(), GREEDY), GREEDY.max_tokens
    )
    assert _call(engine, "load", str(models["m0"])) == "reloaded" and _call(engine, "info")["pid"] == pid
    _assert_greedy_matches(hf["m0"], hf["tokenizer"], _call(engine, "generate", _prompts(), GREEDY), GREEDY.max_tokens)
    assert _call(engine, "load", str(models["m1"])) == "updated"  # the same architecture: in place


@pytest.mark.slow
def test_stop_strings_and_finish_reasons(engine, models, hf):
    _use(engine, models, "m0")
    tokenizer = hf["tokenizer"]
    out = _call(engine, "generate", _prompts(), SamplingSettings(n=4, temperature=1.0, max_tokens=12, stop=(" ",)))
    reasons = out.column("finish_reason").to_pylist()
    assert "stop" in reasons
    for r in out.to_pylist():
        full = tokenizer.decode(r["response_ids"], skip_special_tokens=True)
        if r["finish_reason"] == "length":
            assert len(r["response_ids"]) == 12 and " " not in r["response_text"] and r["response_text"] == full
        elif r["response_ids"][-1] == tokenizer.eos_token_id:
            assert r["response_text"] == full  # eos kept in the ids, not in the text
        else:  # the last token completed the stop string: text cut before it, ids keep that token
            assert " " not in r["response_text"] and full.startswith(r["response_text"] + " ")
            assert " " not in tokenizer.decode(r["response_ids"][:-1], skip_special_tokens=True)


@pytest.mark.slow
def test_throughput_on_the_tiny_model(engine, models):
    _use(engine, models, "m0")
    many = pa.table(
        {"prompt_id": [f"q{i}" for i in range(64)], "messages": [PROMPTS[i % len(PROMPTS)] for i in range(64)]}
    )
    out = _call(engine, "generate", many, SamplingSettings(n=1, temperature=1.0, max_tokens=32, seed=0))
    stats = _call(engine, "info")["last_stats"]
    assert stats["tokens"] == sum(len(x) for x in out.column("response_ids").to_pylist()) > 0
    assert out.column("answer").null_count == 64  # prompts without an answer column
    print(
        f"vLLM tiny model: {stats['tokens']} tokens in {stats['seconds']:.2f} s = {stats['tokens'] / stats['seconds']:.0f} tokens/s"
    )
