"""Tests of posttrain_core.models: tokenizer, tiny models, loading/saving by path, LoRA (CPU, offline, a few s)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# The environment is set before transformers is imported (huggingface_hub reads it at import).

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from posttrain_core.config import LoraConfig  # noqa: E402
from posttrain_core.models import (  # noqa: E402
    CHAT_TEMPLATE,
    TINY_PRESETS,
    apply_lora,
    build_tiny_checkpoint,
    build_tiny_model,
    check_model_path,
    load_causal_lm,
    load_tokenizer,
    merge_lora,
    num_parameters,
    save_checkpoint,
    train_tokenizer,
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is 12 + 30? The answer is 42.",
    "def f(x):\n    return x * 2  # double it\n",
    "Prices rose 3.5% in 2024; analysts (mostly) agreed!",
] * 8
TEXT = "  Hello, world!\n\nx = 3.14 * (2 - 7) / 9; print(x)\t# ok? 99%\n"


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(CORPUS, vocab_size=320)


@pytest.fixture(scope="module")
def checkpoint(tokenizer, tmp_path_factory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"), tokenizer, arch="llama", seed=3)


def _ids(tokenizer, text: str = TEXT) -> torch.Tensor:
    return tokenizer(text, return_tensors="pt")["input_ids"]


@torch.no_grad()
def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    return model(input_ids=ids).logits


# --- tokenizer ----------------------------------------------------------------------------------------------


def test_tokenizer_round_trips_text(tokenizer):
    for text in [TEXT, "0123456789", "!@#$%^&*()[]{}<>?/\\|~`'\"", "a\nb\r\n\tc  ", "naïve café 🙂", ""]:
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids) == text
    assert len(tokenizer) == 320


def test_tokenizer_special_tokens_and_offsets(tokenizer):
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|pad|>"
    assert tokenizer.eos_token_id != tokenizer.pad_token_id
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") is not None
    assert tokenizer.model_max_length == 512
    enc = tokenizer(TEXT, return_offsets_mapping=True)
    assert "".join(TEXT[a:b] for a, b in enc["offset_mapping"]) == TEXT


def test_tokenizer_is_deterministic(tokenizer):
    again = train_tokenizer(CORPUS, vocab_size=320)
    assert again.get_vocab() == tokenizer.get_vocab()
    assert again(TEXT)["input_ids"] == tokenizer(TEXT)["input_ids"]


def test_chat_template_renders(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages, tokenize=False)
    assert no_prompt == text.removesuffix("<|im_start|>assistant\n")
    assert tokenizer.chat_template == CHAT_TEMPLATE


def test_tokenizer_save_and_reload(tokenizer, tmp_path):
    train_tokenizer(CORPUS, vocab_size=320, out_dir=tmp_path)
    assert (tmp_path / "chat_template.jinja").exists()
    reloaded = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert reloaded.get_vocab() == tokenizer.get_vocab()
    assert reloaded(TEXT)["input_ids"] == tokenizer(TEXT)["input_ids"]
    assert (reloaded.eos_token, reloaded.pad_token) == ("<|im_end|>", "<|pad|>")
    assert reloaded.chat_template == CHAT_TEMPLATE
    assert load_tokenizer(tmp_path, require_chat_template=True).pad_token == "<|pad|>"


def test_load_tokenizer_pad_fallback_and_chat_template_check(tmp_path, caplog):
    bare = train_tokenizer(CORPUS, vocab_size=300)
    bare.pad_token = None
    bare.chat_template = None
    bare.save_pretrained(str(tmp_path))
    with caplog.at_level("WARNING", logger="posttrain_core.models.loading"):
        loaded = load_tokenizer(tmp_path)
    assert loaded.pad_token == loaded.eos_token == "<|im_end|>"
    assert "no pad_token" in caplog.text
    with pytest.raises(ValueError, match="no chat_template") as err:
        load_tokenizer(tmp_path, require_chat_template=True)
    assert str(tmp_path) in str(err.value)
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "missing")


# --- tiny models ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_model_forward_and_generate(arch, tokenizer):
    model = build_tiny_model(arch, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    ids = _ids(tokenizer)
    assert _logits(model, ids).shape == (1, ids.shape[1], len(tokenizer))
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    assert out.shape[1] <= ids.shape[1] + 3 and torch.equal(out[:, : ids.shape[1]], ids)
    assert next(model.parameters()).dtype == torch.float32
    assert model.config.model_type == arch


def test_tiny_model_seed_is_deterministic_and_local():
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a = build_tiny_model(seed=0, **TINY_PRESETS["tiny"])
    assert torch.equal(torch.rand(1), expected_next)  # the caller's RNG stream is untouched
    b = build_tiny_model(seed=0, **TINY_PRESETS["tiny"])
    c = build_tiny_model(seed=1, **TINY_PRESETS["tiny"])
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.self_attn.q_proj.weight"], sc["model.layers.0.self_attn.q_proj.weight"])


def test_small_preset_builds():
    model = build_tiny_model("qwen2", **TINY_PRESETS["small"])
    assert model.config.num_hidden_layers == 4
    assert model.config.hidden_size // model.config.num_attention_heads == 32


def test_bad_head_dim_names_fields():
    with pytest.raises(ValueError, match="head_dim") as err:
        build_tiny_model(hidden_size=48, num_heads=2)
    assert "hidden_size" in str(err.value) and "num_heads" in str(err.value) and "24" in str(err.value)
    with pytest.raises(ValueError, match="num_kv_heads"):
        build_tiny_model(hidden_size=128, num_heads=4, num_kv_heads=3)


def test_checkpoint_reloads_identically(checkpoint, tokenizer):
    assert (checkpoint / "model.safetensors").exists() and (checkpoint / "tokenizer.json").exists()
    gen = json.loads((checkpoint / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tokenizer.eos_token_id and gen["pad_token_id"] == tokenizer.pad_token_id
    ids = _ids(tokenizer)
    same = build_tiny_model(
        vocab_size=len(tokenizer),
        seed=3,
        pad_token_id=tokenizer.pad_token_id,  # the pad row of the embedding starts at zero
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    expected = _logits(same, ids)
    hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), local_files_only=True)
    ours = load_causal_lm(checkpoint)
    torch.testing.assert_close(_logits(hf, ids), expected, rtol=0, atol=0)
    torch.testing.assert_close(_logits(ours, ids), expected, rtol=0, atol=0)
    assert load_tokenizer(checkpoint)(TEXT)["input_ids"] == tokenizer(TEXT)["input_ids"]


def test_check_model_path(checkpoint, tmp_path):
    info = check_model_path(checkpoint)
    assert info["model_type"] == "llama" and info["architectures"] == ["LlamaForCausalLM"]
    assert info["is_adapter"] is False and info["base_model"] is None
    assert info["vocab_size"] == 320 and info["max_position_embeddings"] == 512 and info["dtype"] == "float32"
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="does not exist") as err:
        check_model_path(missing)
    assert str(missing) in str(err.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no config.json") as err:
        check_model_path(empty)
    assert str(empty) in str(err.value)


def test_save_checkpoint_full_model(checkpoint, tokenizer, tmp_path):
    model = load_causal_lm(checkpoint)
    info = save_checkpoint(model, tokenizer, tmp_path / "copy")
    assert info == {
        "architecture": "LlamaForCausalLM",
        "dtype": "float32",
        "adapter": False,
        "base_model": None,
        "num_parameters": num_parameters(model),
    }
    ids = _ids(tokenizer)
    torch.testing.assert_close(_logits(load_causal_lm(tmp_path / "copy"), ids), _logits(model, ids), rtol=0, atol=0)


def test_bfloat16_load(checkpoint):
    assert next(load_causal_lm(checkpoint, dtype="bfloat16").parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        load_causal_lm(checkpoint, dtype="float8")


# --- LoRA ------------------------------------------------------------------------------------------------------


def test_lora_trains_saves_merges_and_disables(checkpoint, tokenizer, tmp_path):
    ids = _ids(tokenizer)
    base_logits = _logits(load_causal_lm(checkpoint), ids)
    model = apply_lora(load_causal_lm(checkpoint), LoraConfig(r=4, alpha=8), seed=0)

    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert num_parameters(model, trainable_only=True) == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert num_parameters(model, trainable_only=True) < num_parameters(model)
    torch.testing.assert_close(_logits(model, ids), base_logits, rtol=0, atol=0)  # B starts at zero

    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    lora_logits = _logits(model, ids)
    assert not torch.allclose(lora_logits, base_logits)

    with model.disable_adapter():
        torch.testing.assert_close(_logits(model, ids), base_logits, rtol=0, atol=0)

    info = save_checkpoint(model, tokenizer, tmp_path / "adapter")
    assert info["adapter"] is True and info["base_model"] == str(checkpoint.resolve())
    assert info["num_parameters"] == num_parameters(model)
    adapter_cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter_cfg["base_model_name_or_path"] == str(checkpoint.resolve())
    assert not (tmp_path / "adapter" / "model.safetensors").exists()
    assert check_model_path(tmp_path / "adapter")["is_adapter"] is True
    reloaded = load_causal_lm(tmp_path / "adapter")
    torch.testing.assert_close(_logits(reloaded, ids), lora_logits, rtol=0, atol=1e-6)
    assert not any(p.requires_grad for p in reloaded.parameters())
    resumed = load_causal_lm(tmp_path / "adapter", trainable_adapter=True)
    assert all("lora_" in n for n, p in resumed.named_parameters() if p.requires_grad)
    assert load_tokenizer(tmp_path / "adapter").get_vocab() == tokenizer.get_vocab()

    merged_info = save_checkpoint(model, tokenizer, tmp_path / "merged", merge_lora=True)
    assert merged_info["adapter"] is False
    torch.testing.assert_close(_logits(load_causal_lm(tmp_path / "merged"), ids), lora_logits, rtol=0, atol=1e-5)
    assert any(p.requires_grad for p in model.parameters())  # the caller's model is still a PeftModel

    merged = merge_lora(model)
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(_logits(merged, ids), lora_logits, rtol=0, atol=1e-5)


def test_lora_errors_and_pickle(tokenizer):
    with pytest.raises(ValueError, match="wq"):
        apply_lora(build_tiny_model(vocab_size=len(tokenizer)), LoraConfig(target_modules=["wq", "wk"]))
    settings = LoraConfig(r=2, target_modules=["q_proj"])
    assert pickle.loads(pickle.dumps(settings)) == settings
    with pytest.raises(ValueError, match="base_model"):
        save_checkpoint(apply_lora(build_tiny_model(vocab_size=len(tokenizer)), settings), None, "/nonexistent/x")


@pytest.mark.filterwarnings("ignore:Could not find a config file")
def test_adapter_with_missing_base(checkpoint, tmp_path):
    adapter = tmp_path / "adapter"
    model = apply_lora(load_causal_lm(checkpoint), LoraConfig(r=2), seed=0)
    save_checkpoint(model, None, adapter, base_model=tmp_path / "gone")
    with pytest.raises(FileNotFoundError, match="gone"):
        check_model_path(adapter)


def test_import_is_light():
    code = "import sys, posttrain_core.models; assert not {'torch', 'transformers', 'peft'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("lora", [False, True])
def test_token_logprobs_equal_the_full_forward_and_its_gradients(arch, lora, monkeypatch):
    """The LM head on selected positions only, a few positions per chunk (recomputed in the backward pass), gives
    the full forward's log-probs, entropies, log-probs of given tokens and top-k tokens there, and the same
    gradients."""
    from posttrain_core.algorithms.losses import entropy_from_logits, token_logprobs
    from posttrain_core.models import heads

    monkeypatch.setattr(heads, "LOGIT_CHUNK_BYTES", 4 * 300 * 2)  # 2 positions per chunk: several chunks per pass

    def build():
        m = build_tiny_model(arch=arch, vocab_size=300, seed=3)
        return apply_lora(m, LoraConfig(r=4, alpha=8), seed=0) if lora else m

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 300, (3, 9), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 6:] = 0  # right padding
    keep = torch.rand(3, 9, generator=g) > 0.5
    labels = torch.randint(0, 300, (3, 9), generator=g)
    first = keep.nonzero()[0]
    labels[first[0], first[1]] = -100  # a selected position without a label: log-prob 0
    pos = torch.tensor([[2, 3, 4], [1, 5, 5], [0, 7, 8]])
    full_model, net = build(), heads.TokenLogprobs(build())
    assert net.plain and net.rows == 2  # llama / qwen2 (and LoRA around them) take the hidden-state path
    full = full_model(input_ids=ids, attention_mask=attn).logits
    want = token_logprobs(full[keep][None], labels[keep][None])[0]
    some = torch.randint(0, 300, (int(keep.sum()), 4), generator=g)  # 4 given tokens per position
    scores = net(ids, attn, keep, labels[keep], entropy=True, gather=some, topk=3)
    logp, entropy, gathered = scores.logp, scores.entropy, scores.gathered
    assert torch.allclose(logp, want, atol=1e-5) and logp[0] == 0.0
    assert torch.allclose(entropy, entropy_from_logits(full[keep]), atol=1e-5)
    all_logp = full[keep].log_softmax(-1)
    assert torch.allclose(gathered, all_logp.gather(-1, some), atol=1e-5)
    best = all_logp.topk(3, dim=-1)
    assert torch.equal(scores.topk_ids, best.indices) and torch.allclose(scores.topk_logp, best.values, atol=1e-5)
    picked = net(ids, attn, pos, labels[:, :3]).logp
    assert picked.shape == (3, 3) and torch.allclose(picked[1, 1], token_logprobs(full[1:2, 5:6], labels[1:2, 1:2]))

    weights = torch.arange(1.0, 1 + keep.sum())  # a loss that weighs every position differently
    ((want * weights).sum() + entropy_from_logits(full[keep]).sum() + all_logp.gather(-1, some).sum()).backward()
    ((logp * weights).sum() + entropy.sum() + gathered.sum()).backward()
    grads = {n: p.grad for n, p in full_model.named_parameters() if p.requires_grad}
    for name, p in net.lm.named_parameters():
        if p.requires_grad:
            assert torch.allclose(p.grad, grads[name], atol=1e-5), name


def test_sequence_logprobs_sum_each_rows_scored_tokens():
    """DPO's per-row sums: position t - 1 predicts labels[t]; -100 is not scored; labels[0] never is."""
    from posttrain_core.models.heads import TokenLogprobs, sequence_logprobs

    model = build_tiny_model(vocab_size=300, seed=3)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(4, 300, (3, 6), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    labels[2, 1:] = -100  # nothing scored: 0
    logits = model(input_ids=ids).logits
    ce = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, 300), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="none"
    ).view(3, 5)
    got = sequence_logprobs(TokenLogprobs(model), ids, torch.ones_like(ids), labels)
    assert got.tolist() == pytest.approx((-ce.sum(-1)).tolist(), abs=1e-5) and got[2] == 0.0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("lora", [False, True])
def test_shared_prompts_give_the_full_rows_logits_and_gradients(arch, lora):
    """Rows that repeat prompts (GRPO's n samples) with each distinct prompt run once: the full rows' response
    logits and gradients, with prompts of different lengths (one of a single token), an empty response, right
    padding, and rows in any order."""
    from posttrain_core.models.heads import TokenLogprobs
    from posttrain_core.train.rl_batch import RLBatch, encode, encode_shared, response_logprobs

    def build():
        m = build_tiny_model(arch=arch, vocab_size=300, seed=3)
        return apply_lora(m, LoraConfig(r=4, alpha=8), seed=0) if lora else m

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 300, (n,), generator=g).tolist() for n in (7, 4, 1)]
    which = [0, 1, 0, 2, 1, 0, 2]
    lengths = [5, 3, 0, 4, 5, 1, 2]
    responses = [torch.randint(4, 300, (n,), generator=g).tolist() for n in lengths]
    batch = RLBatch(
        prompt_ids=[prompts[w] for w in which], response_ids=responses, response_mask=[[1] * n for n in lengths],
        logprobs=[[0.0] * n for n in lengths], rewards=[0.0] * 7, groups=which, correct=[False] * 7,
    )  # fmt: skip
    rows = [6, 0, 3, 1, 2, 5, 4]
    ids, attn, pos, labels, mask = encode(batch, rows, 0)
    shared = encode_shared(batch, rows, 0)
    assert shared is not None and shared[3].ids_U_P.shape == (3, 6)  # 3 distinct prompts, all but their last token
    assert encode_shared(batch, [0, 1, 3], 0) is None  # no prompt repeats: nothing to share

    full_net, shared_net = TokenLogprobs(build()), TokenLogprobs(build())
    full, full_entropy = response_logprobs(full_net, ids, attn, pos, labels, entropy=True)[:2]
    got, entropy = response_logprobs(shared_net, ids, attn, pos, labels, shared, entropy=True)[:2]
    assert got.shape == full.shape == (7, 5)
    real = mask.bool()
    assert torch.allclose(got[real], full[real], atol=1e-5)
    assert torch.allclose(entropy[real], full_entropy[real], atol=1e-5)
    ((full[real] + full_entropy[real]) * torch.arange(1.0, 1 + real.sum())).sum().backward()
    ((got[real] + entropy[real]) * torch.arange(1.0, 1 + real.sum())).sum().backward()
    grads = dict(full_net.named_parameters())
    for name, p in shared_net.named_parameters():
        if p.requires_grad:
            assert torch.allclose(p.grad, grads[name].grad, atol=1e-5), name

    model = build_tiny_model(vocab_size=300, seed=3)
    model.config.model_type = "gemma2"  # not a plain head: no shared path
    with pytest.raises(ValueError, match="plain-head"):
        response_logprobs(TokenLogprobs(model), ids, attn, pos, labels, shared)


def test_token_logprobs_fall_back_to_the_models_own_forward():
    """An architecture whose logits are not a plain projection (or is unknown) keeps its own forward."""
    from posttrain_core.algorithms.losses import token_logprobs
    from posttrain_core.models.heads import TokenLogprobs

    model = build_tiny_model(vocab_size=300, seed=3)
    model.config.model_type = "gemma2"  # soft-caps its logits in the CausalLM forward
    net = TokenLogprobs(model)
    assert not net.plain
    ids = torch.randint(4, 300, (2, 5))
    keep = torch.ones(2, 5, dtype=torch.bool)
    want = token_logprobs(model(input_ids=ids).logits, ids)[keep]
    assert torch.equal(net(ids, torch.ones_like(ids), keep, ids[keep])[0], want)
