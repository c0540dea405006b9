"""A vision-language model through the engine and the trainer, without Ray: tiny random-init Qwen2-VL and LLaVA
built by the project (`vision.tiny_vlm`), prompts with images of several sizes.

- the hf engine's KV-cache decode (left-padded prefill with pixels and positions, then text steps) gives the
  log-probs of a full forward of each row alone, and the trainer's (`TokenLogprobs`, a right-padded batch with the
  same pixels) too;
- a vision token is never sampled, however likely the model makes it;
- images given to a text-only model, or cut by max_seq_len, fail naming the prompt or row;
- LoRA adapts the language model; the vision tower is frozen unless asked to train.
"""

from __future__ import annotations

import io

import pyarrow as pa
import pytest
import torch
from PIL import Image

from posttrain_core.rollout.engine import SamplingSettings


def png(colour: tuple[int, int, int], size: tuple[int, int] = (56, 56)) -> bytes:
    buf = io.BytesIO()
    image = Image.new("RGB", size, (255, 255, 255))
    image.paste(colour, (size[0] // 4, size[1] // 4, size[0] // 2, size[1] // 2))
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module", params=["qwen2_vl", "llava"])
def vlm(request, tmp_path_factory):
    """Each family: Qwen2-VL (patch grids, M-RoPE) and LLaVA (fixed-size images, 1-D positions)."""
    from posttrain_core.models.tokenizer import train_tokenizer
    from posttrain_core.vision import tiny_vlm

    texts = ["What colour is the shape? The answer is red.", "Which shape is it? The answer is circle."] * 40
    tokenizer = train_tokenizer(texts, vocab_size=320)
    return str(tiny_vlm.build_tiny_vlm_checkpoint(tmp_path_factory.mktemp(request.param), tokenizer, request.param))


def prompts(n_images: list[int]) -> pa.Table:
    """One prompt per entry, with that many images (of different sizes), and a text-only prompt at the end."""
    sizes = [(56, 56), (84, 56), (56, 112), (112, 112)]
    messages, images = [], []
    for i, k in enumerate(n_images):
        messages.append([{"role": "user", "content": "<image>" * k + f"\nWhat colour is shape {i}?"}])
        images.append([png((40 * i % 255, 200, 30 * k), sizes[(i + j) % len(sizes)]) for j in range(k)])
    messages.append([{"role": "user", "content": "No image here. What colour?"}])
    images.append(None)
    n = len(messages)
    return pa.table({"prompt_id": [f"p{i}" for i in range(n)], "messages": messages, "answer": ["red"] * n,
                     "images": images})  # fmt: skip


def test_engine_log_probs_equal_a_full_forward_and_the_trainers(vlm):
    from posttrain_core.models.heads import TokenLogprobs
    from posttrain_core.models.loading import load_causal_lm
    from posttrain_core.rollout.hf_engine import HFEngine
    from posttrain_core.train.rl_batch import encode
    from posttrain_core.vision.inputs import VisionSpec, backbone, batch_inputs

    engine = HFEngine(vlm)
    out = engine.generate(prompts([1, 2, 1]), SamplingSettings(n=2, max_tokens=6, temperature=1.0, seed=3))
    rows = out.to_pylist()
    assert len(rows) == 8 and rows[-1]["images"] is None and len(rows[0]["images"]) == 1
    spec = VisionSpec.of(vlm)
    assert sum(t == spec.image_token for t in rows[2]["prompt_ids"]) > 4  # expanded: 2 images, several tokens each

    model = load_causal_lm(vlm).eval()
    pixels = [spec.pixels(r["images"]) if r["images"] else None for r in rows]
    with torch.no_grad():
        for r, px in zip(rows, pixels, strict=True):  # one row alone, unpadded, the whole sequence at once
            seq = torch.tensor([r["prompt_ids"] + r["response_ids"]])
            kw = batch_inputs(model, spec, seq, torch.ones_like(seq), [px], "test")
            logits = model(input_ids=seq, **kw).logits[0].float()
            logits[:, spec.banned_ids] = -1e9
            P, n = len(r["prompt_ids"]), len(r["response_ids"])
            logp = torch.log_softmax(logits[P - 1 : P - 1 + n], -1).gather(1, torch.tensor(r["response_ids"])[:, None])
            assert torch.allclose(logp[:, 0], torch.tensor(r["logprobs"]), atol=1e-5), r["prompt_id"]

        batch = pa.table({k: [r[k] for r in rows] for k in ("prompt_ids", "response_ids")}).to_pydict()
        batch["response_mask"] = [[1] * len(r["response_ids"]) for r in rows]
        ids, attn, pos, labels, _ = encode(type("Rows", (), batch), list(range(len(rows))), engine.pad_id)
        kw = batch_inputs(model, spec, ids, attn, pixels, "test")
        trainer = TokenLogprobs(model)(ids, attn, pos, labels, vision=kw).logp
    for b, r in enumerate(rows):
        assert torch.allclose(trainer[b, : len(r["logprobs"])], torch.tensor(r["logprobs"]), atol=1e-5)
    assert backbone(model) is model.model


def test_a_vision_token_is_never_sampled(vlm, tmp_path):
    """The image-pad token's output row is pushed along the final hidden states: unbanned, greedy decoding picks it
    at every step; the engine never samples it, nor any other vision token."""
    from posttrain_core.models.loading import load_causal_lm, load_tokenizer, save_checkpoint
    from posttrain_core.rollout.hf_engine import HFEngine
    from posttrain_core.vision.inputs import VisionSpec, batch_inputs

    spec = VisionSpec.of(vlm)
    model = load_causal_lm(vlm).eval()
    table = prompts([1, 1])
    engine = HFEngine(vlm)
    first = engine.generate(table, SamplingSettings(n=1, max_tokens=4, temperature=0.0)).to_pylist()[0]
    seq = torch.tensor([first["prompt_ids"] + first["response_ids"]])
    with torch.no_grad():
        kw = batch_inputs(model, spec, seq, torch.ones_like(seq), [spec.pixels(first["images"])], "test")
        hidden = model.model(input_ids=seq, **kw).last_hidden_state[0]
        head = model.get_output_embeddings().weight
        head[spec.image_token] = 50 * hidden.mean(0) / hidden.mean(0).norm()  # tied: the pad's input row is unused
        assert (model(input_ids=seq, **kw).logits[0].argmax(-1) == spec.image_token).float().mean() > 0.8
    forced = tmp_path / "forced"
    save_checkpoint(model, load_tokenizer(vlm), forced)  # with the image processor of the folder it came from
    out = HFEngine(str(forced)).generate(table, SamplingSettings(n=8, max_tokens=6, temperature=1.0, seed=1))
    sampled = {t for ids in out.column("response_ids").to_pylist() for t in ids}
    assert sampled and not sampled & set(spec.banned_ids), sampled


def test_images_for_a_text_model_and_images_cut_by_max_seq_len_are_refused(vlm, tiny_inputs):
    from posttrain_core.models.loading import load_tokenizer
    from posttrain_core.rollout.hf_engine import HFEngine
    from posttrain_core.vision.inputs import VisionSpec

    store, _, base = tiny_inputs
    with pytest.raises(ValueError, match=r"prompt 'p0' has images, but .* is a text-only model"):
        HFEngine(str(store.local_path(base))).generate(prompts([1]), SamplingSettings(n=1, max_tokens=2))
    spec = VisionSpec.of(vlm)
    chat = [{"role": "user", "content": "Look: <image>"}, {"role": "assistant", "content": "red"}]
    tokenizer = load_tokenizer(vlm)
    ids, labels, px = spec.chat(tokenizer, chat, [png((255, 0, 0), (112, 112))], 512, "sft.jsonl row 3")
    assert len(ids) == len(labels) and px is not None
    assert all(label == -100 for t, label in zip(ids, labels, strict=True) if t == spec.image_token)
    cut = ids.index(spec.image_token) + 2
    with pytest.raises(ValueError, match=rf"sft.jsonl row 3: .* max_seq_len={cut} would cut through an image"):
        spec.chat(tokenizer, chat, [png((255, 0, 0), (112, 112))], cut, "sft.jsonl row 3")
    with pytest.raises(ValueError, match="row 3: 1 <image> markers in the messages but 0 images"):
        spec.chat(tokenizer, chat, [], 512, "sft.jsonl row 3")


def test_lora_adapts_the_language_model_and_the_tower_stays_frozen(vlm):
    from posttrain_core.config import LoraConfig
    from posttrain_core.models.loading import load_causal_lm
    from posttrain_core.models.lora import apply_lora
    from posttrain_core.vision.inputs import freeze_tower

    model = load_causal_lm(vlm)
    tower = sum(
        p.numel() for n, p in model.named_parameters() if n.startswith(("model.visual.", "model.vision_tower."))
    )
    assert tower > 0 and freeze_tower(model) == tower
    assert not any(p.requires_grad for n, p in model.named_parameters() if ".visual." in n or ".vision_tower." in n)
    adapted = apply_lora(load_causal_lm(vlm), LoraConfig(r=4, alpha=8))
    trained = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert trained and all("language_model" in n and "lora_" in n for n in trained), trained[:4]


TOOL = '''
def lookup(key: str) -> str:
    """The code of a key.

    Args:
        key: the key
    """
    return {"red": "41", "blue": "77"}[key]
'''
COLOURS = {"red": (220, 40, 40), "blue": (40, 80, 220)}


def _tool_chat(colour: str) -> list[dict]:
    code = {"red": "41", "blue": "77"}[colour]
    return [
        {"role": "user", "content": "<image>\nWhat is the code of this colour?"},
        {"role": "assistant", "content": f"<tool_call>lookup {colour}</tool_call>"},
        {"role": "tool", "content": code},
        {"role": "assistant", "content": f"The answer is {code}"},
    ]


def test_the_tool_loop_runs_on_a_vlm_and_the_trainer_gets_the_engines_log_probs(vlm, tmp_path):
    """A tiny VLM overfitted (in this process) on two tool-using chats whose tool argument is the picture's colour:
    the engine's trajectories read the picture, call the user's tool, answer; every turn's forward had the prompt's
    pixels, the rows keep the images, and the trainer's log-probs of the policy tokens equal the engine's."""
    from posttrain_core.data.chat import IGNORE_INDEX
    from posttrain_core.models.heads import TokenLogprobs
    from posttrain_core.models.loading import load_causal_lm, load_tokenizer, save_checkpoint
    from posttrain_core.rollout.hf_engine import HFEngine
    from posttrain_core.rollout.multiturn import ToolSettings
    from posttrain_core.train.rl_batch import encode
    from posttrain_core.vision.inputs import VisionSpec, batch_inputs

    (tmp_path / "my_tools.py").write_text(TOOL)
    spec, tokenizer = VisionSpec.of(vlm), load_tokenizer(vlm)
    model = load_causal_lm(vlm).train()
    chats = [(_tool_chat(c), [png(rgb)]) for c, rgb in COLOURS.items()]
    encoded = [spec.chat(tokenizer, m, im, 512, f"chat {i}") for i, (m, im) in enumerate(chats)]
    width = max(len(ids) for ids, _, _ in encoded)
    ids = torch.tensor([x + [tokenizer.pad_token_id] * (width - len(x)) for x, _, _ in encoded])
    labels = torch.tensor([y + [IGNORE_INDEX] * (width - len(y)) for _, y, _ in encoded])
    mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x, _, _ in encoded])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for _ in range(200):
        kw = batch_inputs(model, spec, ids, mask, [px for _, _, px in encoded], "train")
        loss = model(input_ids=ids, attention_mask=mask, labels=labels, **kw).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert loss.item() < 0.05, loss.item()
    trained = tmp_path / "trained"
    save_checkpoint(model.eval(), tokenizer, trained)

    prompts = pa.table({"prompt_id": list(COLOURS), "messages": [m[:1] for m, _ in chats],
                        "answer": ["41", "77"], "images": [im for _, im in chats]})  # fmt: skip
    tools = ToolSettings(tools=(f"{tmp_path / 'my_tools.py'}:lookup",), parser="compact", max_turns=3,
                         max_total_tokens=160)  # fmt: skip
    rows = HFEngine(str(trained)).generate(prompts, SamplingSettings(n=2, max_tokens=48, tools=tools)).to_pylist()
    for r in rows:
        assert r["num_tool_calls"] == 1 and r["tool_errors"] == 0, r["turns"]
        assert r["response_text"] == f"The answer is {r['answer']}", r["turns"]  # it read the colour
        assert r["images"] == chats[list(COLOURS).index(r["prompt_id"])][1]  # kept for the trainer
    batch = {k: [r[k] for r in rows] for k in ("prompt_ids", "response_ids", "response_mask")}
    ids, attn, pos, labels, _ = encode(type("Rows", (), batch), list(range(len(rows))), tokenizer.pad_token_id)
    pixels = [spec.pixels(r["images"]) for r in rows]
    with torch.no_grad():
        kw = batch_inputs(model, spec, ids, attn, pixels, "test")
        trainer = TokenLogprobs(model)(ids, attn, pos, labels, vision=kw).logp
    for b, r in enumerate(rows):
        policy = [i for i, m in enumerate(r["response_mask"]) if m]
        ours = trainer[b, policy]
        assert torch.allclose(ours, torch.tensor([r["logprobs"][i] for i in policy]), atol=1e-5), r["prompt_id"]
