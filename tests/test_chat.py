"""Tests of chat rendering and the SFT loss mask: exactly the assistant turns (content + end-of-turn) are trained."""

from __future__ import annotations

import pytest

from posttrain_core.data.chat import IGNORE_INDEX, pack_texts, render_chat, tokenize_chat, tokenize_prompt
from posttrain_core.data.synthetic import corpus_for_tokenizer, make_problems

CHAT = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 37 + 45?"},
    {"role": "assistant", "content": "82"},
    {"role": "user", "content": "Reverse the letters: kqxe"},
    {"role": "assistant", "content": "The answer is exqk."},
]


@pytest.fixture(scope="module")
def tokenizer():
    from posttrain_core.models.tokenizer import train_tokenizer

    return train_tokenizer(corpus_for_tokenizer(make_problems(n=200)), vocab_size=300)


def labelled(labels: list[int]) -> list[int]:
    return [t for t in labels if t != IGNORE_INDEX]


def test_render_uses_the_template(tokenizer):
    text = render_chat(tokenizer, CHAT[:2], add_generation_prompt=True)
    assert text == "<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nWhat is 37 + 45?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenize_prompt(tokenizer, CHAT[:2]) == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_mask_covers_exactly_the_assistant_turns(tokenizer):
    input_ids, labels = tokenize_chat(tokenizer, CHAT)
    assert len(input_ids) == len(labels)
    assert tokenizer.decode(input_ids) == render_chat(tokenizer, CHAT)
    assert tokenizer.decode(labelled(labels)) == "82<|im_end|>\nThe answer is exqk.<|im_end|>\n"
    # labels equal input_ids where trained, and the trained tokens are two contiguous runs
    trained = [i for i, t in enumerate(labels) if t != IGNORE_INDEX]
    assert all(labels[i] == input_ids[i] for i in trained)
    runs = sum(1 for i in trained if i - 1 not in trained)
    assert runs == 2
    # nothing before the first assistant content (system, user, header) is trained
    header_end = len(tokenizer(render_chat(tokenizer, CHAT[:2], add_generation_prompt=True), add_special_tokens=False)["input_ids"])
    assert trained[0] == header_end and all(t == IGNORE_INDEX for t in labels[:header_end])


def test_no_assistant_means_nothing_trained(tokenizer):
    _, labels = tokenize_chat(tokenizer, CHAT[:2])
    assert labelled(labels) == []


def test_truncation_keeps_the_start(tokenizer):
    full_ids, full_labels = tokenize_chat(tokenizer, CHAT)
    ids, labels = tokenize_chat(tokenizer, CHAT, max_length=10)
    assert ids == full_ids[:10] and labels == full_labels[:10]


def test_inconsistent_template_is_rejected(tokenizer, monkeypatch):
    # A template that rewrites history (drops earlier assistant turns) cannot be masked by prefix rendering.
    template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
        "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    monkeypatch.setattr(tokenizer, "chat_template", template)
    with pytest.raises(ValueError, match="not prefix-consistent"):
        tokenize_chat(tokenizer, CHAT)


def test_pack_texts(tokenizer):
    texts = [f"Q: What is {i} + {i}? A: {2 * i}" for i in range(50)]
    total = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) + 1 for t in texts)
    blocks = pack_texts(tokenizer, texts, seq_len=32, batch_size=7)
    assert len(blocks) == total // 32 and all(len(b) == 32 for b in blocks)
    stream = [t for b in blocks for t in b]
    assert stream.count(tokenizer.eos_token_id) >= len(texts) - 2  # one eos per text (the tail dropped)
    assert tokenizer.decode(stream).startswith("Q: What is 0 + 0? A: 0<|im_end|>Q: What is 1 + 1?")
    only = pack_texts(tokenizer, ["hi"], seq_len=64)
    assert len(only) == 1 and only[0][-1] == tokenizer.eos_token_id  # a lone partial block is kept
