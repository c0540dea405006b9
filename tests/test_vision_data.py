"""Tests of images in datasets: canonical PNG from every input form, markers, the importers and the shapes task."""

from __future__ import annotations

import base64
import io
import json
import random
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image, PngImagePlugin

from posttrain_core.artifacts.digest import content_digest
from posttrain_core.config import DataConfig
from posttrain_core.data import import_file, validate_table, write_dataset
from posttrain_core.data import shapes as shapes_task
from posttrain_core.data.prepare import build_tables, chats_as_prompts, flatten_chats, output_keys
from posttrain_core.data.synthetic import corpus_for_tokenizer, make_problems, prompts_table, split_train_eval
from posttrain_core.rewards.verifiers import exact_match
from posttrain_core.vision.images import IMAGE_MARKER, ImageError, canonical_png, check_markers, decode_png

QUESTION = f"{IMAGE_MARKER}\nWhat is in the picture?"


def picture(seed: int = 0, size: tuple[int, int] = (40, 30)) -> Image.Image:
    """A noisy RGB picture: every pixel differs, so any lossy step would show."""
    rng = random.Random(seed)
    return Image.frombytes("RGB", size, bytes(rng.randrange(256) for _ in range(size[0] * size[1] * 3)))


def encoded(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def png_with_metadata(image: Image.Image) -> bytes:
    """The same pixels as another PNG: maximum compression, a text chunk and an alpha channel (fully opaque)."""
    info = PngImagePlugin.PngInfo()
    info.add_text("Software", "a camera")
    return encoded(image.convert("RGBA"), "PNG", compress_level=9, pnginfo=info)


def chat_row(answer: str = "noise") -> list[dict]:
    return [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": answer}]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def digest_of(table: pa.Table, kind: str, out: Path) -> str:
    write_dataset(table, kind, out)
    return content_digest(out)


# ---- canonical PNG ----


def test_every_form_of_one_picture_gives_the_same_png(tmp_path):
    image = picture()
    (tmp_path / "pic.png").write_bytes(png_with_metadata(image))
    want = canonical_png(encoded(image, "BMP"))
    b64 = base64.b64encode(encoded(image, "TIFF")).decode()
    forms = [
        "pic.png",
        str(tmp_path / "pic.png"),
        f"file://{tmp_path / 'pic.png'}",
        png_with_metadata(image),
        {"bytes": encoded(image, "PNG"), "path": "elsewhere.png"},
        {"bytes": None, "path": "pic.png"},
        b64,
        f"data:image/tiff;base64,{b64}",
    ]
    for form in forms:
        assert canonical_png(form, base_dir=tmp_path) == want, form if isinstance(form, str) else type(form)
    assert canonical_png(want) == want  # canonical bytes stay as they are
    out = decode_png(want)
    assert out.mode == "RGB" and out.size == (40, 30) and out.tobytes() == image.tobytes()


def test_transparency_is_composited_on_white():
    rgba = Image.new("RGBA", (2, 1), (10, 20, 30, 0))
    rgba.putpixel((1, 0), (10, 20, 30, 255))
    assert list(decode_png(canonical_png(encoded(rgba, "PNG"))).getdata()) == [(255, 255, 255), (10, 20, 30)]


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("missing.png", r"neither an image file \(no image file .*missing.png\) nor base64 image data"),
        ("aGVsbG8gd29ybGQhIQ==", "base64 image data is not a decodable image"),
        (b"not an image at all", "image bytes is not a decodable image"),
        ("data:image/png;base64,@@@", "is not a base64 data URL"),
        ("https://example.com/a.png", "remote images are not fetched"),
        ({"bytes": None, "path": None}, "neither 'bytes' nor 'path'"),
        (3, "got int"),
    ],
)
def test_bad_images_are_refused(tmp_path, value, match):
    with pytest.raises(ImageError, match=match):
        canonical_png(value, base_dir=tmp_path)


def test_check_markers_names_both_counts():
    check_markers(chat_row(), [b"png"])
    check_markers([{"role": "user", "content": "text only"}], None)
    with pytest.raises(ValueError, match=r"^data.jsonl line 3: 1 <image> markers in the messages but 2 images$"):
        check_markers(chat_row(), [b"a", b"b"], where="data.jsonl line 3")


# ---- importers ----


TEXTS = (QUESTION, f"Compare {IMAGE_MARKER} with {IMAGE_MARKER}.", "No picture here.")


def chats() -> list[list[dict]]:
    """Three chats: one image, two images, none."""
    answers = ("noise", "they differ", "ok")
    return [
        [{"role": "user", "content": t}, {"role": "assistant", "content": a}]
        for t, a in zip(TEXTS, answers, strict=True)
    ]


def with_images(first, second) -> list[dict]:  # noqa: ANN001 (any image form)
    """Rows of `chats()` with an `images` field holding the images of their markers."""
    return [{"messages": m, "images": i} for m, i in zip(chats(), [[first], [first, second], None], strict=True)]


def with_parts(first: dict, second: dict) -> list[list[dict]]:
    """`chats()` with the images as parts of the contents: `first`/`second` are the image parts."""
    rows = chats()
    rows[0][0]["content"] = [first, {"type": "text", "text": "\nWhat is in the picture?"}]
    text = [{"type": "text", "text": t} for t in ("Compare ", " with ", ".")]
    rows[1][0]["content"] = [text[0], first, text[1], second, text[2]]
    return rows


def test_every_input_form_gives_the_same_dataset_digest(tmp_path):
    """Paths relative to the file, bytes in Parquet, base64 in JSON lines, HF {bytes, path} structs and image parts
    inside the messages are one dataset: equal tables, hence one digest."""
    images = [picture(1), picture(2, (20, 24))]
    (tmp_path / "imgs").mkdir()
    for i, image in enumerate(images):
        (tmp_path / "imgs" / f"{i}.png").write_bytes(png_with_metadata(image))
    b64 = [base64.b64encode(encoded(image, "BMP")).decode() for image in images]
    tiff = [encoded(image, "TIFF") for image in images]
    hf = [{"bytes": encoded(image, "PNG"), "path": f"{i}.png"} for i, image in enumerate(images)]

    variants = {
        "relative paths": write_jsonl(tmp_path / "paths.jsonl", with_images("imgs/0.png", "imgs/1.png")),
        "base64": write_jsonl(tmp_path / "b64.jsonl", with_images(*b64)),
        "parts": write_jsonl(
            tmp_path / "parts.jsonl",
            [
                {"messages": m}
                for m in with_parts(
                    {"type": "image", "path": str(tmp_path / "imgs" / "0.png")},
                    {"type": "image_url", "image_url": {"url": f"data:image/bmp;base64,{b64[1]}"}},
                )
            ],
        ),
    }
    pq.write_table(pa.Table.from_pylist(with_images(*tiff)), tmp_path / "bytes.parquet")
    pq.write_table(pa.Table.from_pylist(with_images(*hf)), tmp_path / "hf.parquet")
    # In Parquet every content is a list of parts (text alone too), and every part has every key, null where unused.
    parts = with_parts(*({"type": "image", "text": None, "image": b} for b in tiff))
    for m in (m for msgs in parts for m in msgs):
        listed = m["content"] if isinstance(m["content"], list) else [{"type": "text", "text": m["content"]}]
        m["content"] = [{"text": None, "image": None, **part} for part in listed]
    pq.write_table(pa.table({"messages": parts}), tmp_path / "parts.parquet")
    variants.update({name: tmp_path / f"{name}.parquet" for name in ("bytes", "hf", "parts")})

    tables = {name: import_file(path, "sft") for name, path in variants.items()}
    first = tables["relative paths"]
    assert first.column("messages").to_pylist() == chats()
    stored = first.column("images").to_pylist()
    assert stored[2] is None and len(stored[0]) == 1 and len(stored[1]) == 2
    assert [decode_png(b).tobytes() for b in stored[1]] == [image.tobytes() for image in images]
    for name, table in tables.items():
        assert table.equals(first), name
    digests = {
        name: digest_of(table, "sft", tmp_path / "out" / name.replace(" ", "-")) for name, table in tables.items()
    }
    assert len(set(digests.values())) == 1, digests


def test_prompts_keep_images_and_refuse_a_bad_one(tmp_path):
    (tmp_path / "a.png").write_bytes(encoded(picture(), "PNG"))
    rows = [{"prompt": QUESTION, "images": ["a.png"], "answer": 3, "source": "cam"}, {"prompt": "2 + 2?", "answer": 4}]
    table = import_file(write_jsonl(tmp_path / "p.jsonl", rows), "prompts")
    assert table.column("prompt_id").to_pylist() == ["p-1", "p-2"]
    assert table.column("images").to_pylist() == [[canonical_png(encoded(picture(), "BMP"))], None]
    assert json.loads(table.column("meta")[0].as_py()) == {"source": "cam"}  # images are a column, not meta
    rows.append({"prompt": QUESTION, "images": ["gone.png"]})
    with pytest.raises(ValueError, match=r"p.jsonl line 3: field 'images\[0\]': .*no image file .*gone.png"):
        import_file(write_jsonl(tmp_path / "p.jsonl", rows), "prompts")


def test_unreadable_image_names_file_row_and_field(tmp_path):
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n but truncated")
    rows = [{"messages": chat_row()}, {"messages": chat_row()}]
    rows[0]["images"] = [encoded(picture(), "PNG")]
    rows[1]["images"] = ["broken.png"]
    pq.write_table(
        pa.table({"messages": [r["messages"] for r in rows], "images": [[b"x"], None]}), tmp_path / "b.parquet"
    )
    with pytest.raises(ValueError, match=r"b.parquet row 0: field 'images\[0\]': image bytes is not a decodable image"):
        import_file(tmp_path / "b.parquet", "sft")
    rows[0]["images"] = [base64.b64encode(rows[0]["images"][0]).decode()]
    with pytest.raises(
        ValueError, match=r"c.jsonl line 2: field 'images\[0\]': image file .*broken.png is not a decod"
    ):
        import_file(write_jsonl(tmp_path / "c.jsonl", rows), "sft")
    bad_part = [{"role": "user", "content": [{"type": "image", "image": "nope.png"}]}, chat_row()[1]]
    with pytest.raises(ValueError, match=r"d.jsonl line 1: field 'messages\[0\].content\[0\]': .*nope.png"):
        import_file(write_jsonl(tmp_path / "d.jsonl", [{"messages": bad_part}]), "sft")


def test_marker_and_image_counts_must_match(tmp_path):
    (tmp_path / "a.png").write_bytes(encoded(picture(), "PNG"))
    good = {"messages": chat_row(), "images": ["a.png"]}
    two_markers = {"messages": chat_row(f"{IMAGE_MARKER}{IMAGE_MARKER}"), "images": ["a.png"]}
    with pytest.raises(ValueError, match=r"m.jsonl line 2: 3 <image> markers in the messages but 1 images"):
        import_file(write_jsonl(tmp_path / "m.jsonl", [good, two_markers]), "sft")
    no_images = {"messages": chat_row(), "images": None}  # an images field, even null: the markers must match it
    with pytest.raises(ValueError, match=r"n.jsonl line 2: 1 <image> markers in the messages but 0 images"):
        import_file(write_jsonl(tmp_path / "n.jsonl", [good, no_images]), "sft")
    both = {"messages": [{"role": "user", "content": [{"type": "image", "path": "a.png"}]}], "images": ["a.png"]}
    with pytest.raises(ValueError, match=r"o.jsonl line 1: images are given both as message parts and in field"):
        import_file(write_jsonl(tmp_path / "o.jsonl", [both]), "prompts")
    pq.write_table(
        pa.table({"messages": [chat_row()], "images": [[encoded(picture(), "PNG")] * 2]}), tmp_path / "m.parquet"
    )
    with pytest.raises(ValueError, match=r"m.parquet row 0: 1 <image> markers in the messages but 2 images"):
        import_file(tmp_path / "m.parquet", "sft")


def test_text_datasets_validate_unchanged(tmp_path):
    """No images column: it is added as nulls; a literal <image> in a text-only row stays plain text."""
    text_chat = [{"role": "user", "content": "What does <image> mean in SVG?"}, {"role": "assistant", "content": "a"}]
    table = validate_table(pa.table({"messages": [text_chat]}), "sft")
    assert table.column_names == ["messages", "images"] and table.column("images").to_pylist() == [None]
    imported = import_file(write_jsonl(tmp_path / "t.jsonl", [{"messages": text_chat}]), "sft")
    assert imported.equals(table)
    with pytest.raises(ValueError, match=r"kind 'sft' needs: messages\)"):
        validate_table(pa.table({"text": ["x"]}), "sft")


def test_schema_checks_images(tmp_path):
    png = canonical_png(encoded(picture(), "PNG"))
    ok = validate_table(pa.table({"messages": [chat_row()], "images": [[png]]}), "sft")
    assert ok.schema.field("images").type == pa.list_(pa.binary())
    with pytest.raises(ValueError, match=r"^ds row 1: 1 <image> markers in the messages but 0 images$"):
        validate_table(pa.table({"messages": [chat_row()] * 2, "images": [[png], []]}), "sft", source="ds")
    with pytest.raises(ValueError, match=r"^ds row 0: column 'images' holds a value that is not PNG bytes$"):
        validate_table(pa.table({"messages": [chat_row()], "images": [[encoded(picture(), "BMP")]]}), "sft", "ds")
    rollout = {
        "prompt_id": ["p"],
        "sample_index": [0],
        "prompt_ids": [[1]],
        "response_ids": [[2]],
        "response_text": ["x"],
        "logprobs": [[-1.0]],
        "finish_reason": ["stop"],
        "policy_digest": ["d"],
        "answer": [None],
        "response_mask": [None],
        "turns": [None],
        "num_turns": [1],
        "num_tool_calls": [0],
        "tool_errors": [0],
    }
    assert validate_table(pa.table(rollout), "rollouts").column("images").to_pylist() == [None]
    carried = validate_table(pa.table({**rollout, "images": [[png]]}), "rollouts")
    assert carried.column("images").to_pylist() == [[png]]


def test_prepare_helpers_carry_or_drop_images():
    png = canonical_png(encoded(picture(), "PNG"))
    chats = [
        chat_row(),
        [
            {"role": "user", "content": f"{IMAGE_MARKER} first"},
            {"role": "assistant", "content": f"see {IMAGE_MARKER}"},
        ],
        [{"role": "user", "content": "text"}, {"role": "assistant", "content": "a"}],
    ]
    sft = validate_table(pa.table({"messages": chats, "images": [[png], [png, png], None]}), "sft")
    prompts = validate_table(chats_as_prompts(sft), "prompts")
    assert prompts.column("images").to_pylist() == [[png], [png], None]  # the answer turn's image went with it
    assert flatten_chats(sft).column("text").to_pylist() == ["What is in the picture?\nnoise", "first\nsee", "text\na"]


# ---- the shapes task ----


def test_shapes_are_deterministic_and_decode_to_56x56_rgb():
    a, b = make_problems(("shapes",), n=60, seed=3), make_problems(("shapes",), n=60, seed=3)
    assert a == b
    assert [p.image for p in make_problems(("shapes",), n=60, seed=4)] != [p.image for p in a]
    for p in a:
        image = Image.open(io.BytesIO(p.image))
        assert image.format == "PNG" and image.mode == "RGB" and image.size == (56, 56)
        assert canonical_png(p.image) == p.image
        assert p.solution == f"The answer is {p.answer}"
        assert exact_match(None, p.solution, p.answer)["correct"] == 1.0


def _foreground(image: Image.Image) -> list[tuple[int, int, tuple]]:
    w = image.size[0]
    return [(i % w, i // w, px) for i, px in enumerate(image.getdata()) if px != shapes_task.BACKGROUND]


def test_shapes_questions_do_not_reveal_answers_and_pictures_do():
    problems = make_problems(("shapes",), n=1000, seed=0)
    by_question: dict[str, Counter] = {}
    for p in problems:
        by_question.setdefault(p.question, Counter())[p.answer] += 1
    assert set(by_question) == set(shapes_task.QUESTIONS.values())
    for kind, question in shapes_task.QUESTIONS.items():
        counts = by_question[question]
        assert set(counts) == set(shapes_task.ANSWERS[kind]), question  # one text, every answer
        expected = sum(counts.values()) / len(counts)
        assert min(counts.values()) > 0.6 * expected and max(counts.values()) < 1.4 * expected, (question, counts)
    kind_of = {q: k for k, q in shapes_task.QUESTIONS.items()}
    for p in problems[:300]:
        pixels = _foreground(decode_png(p.image))
        kind = kind_of[p.question]
        if kind == "colour":
            assert {px for _, _, px in pixels} == {shapes_task.COLOURS[p.answer]}
        elif kind == "horizontal":
            assert all((x < 28) == (p.answer == "left") for x, _, _ in pixels)
        elif kind == "vertical":
            assert all((y < 28) == (p.answer == "top") for _, y, _ in pixels)
        elif kind == "count":
            assert len({(x // 28, y // 28) for x, y, _ in pixels}) == int(p.answer)
        else:  # the share of its bounding box a shape fills: 1 square, pi/4 circle, 1/2 triangle
            xs, ys = [x for x, _, _ in pixels], [y for _, y, _ in pixels]
            fill = len(pixels) / ((max(xs) - min(xs) + 1) * (max(ys) - min(ys) + 1))
            want = {"square": 1.0, "circle": 0.785, "triangle": 0.5}[p.answer]
            assert abs(fill - want) < 0.1, (p.answer, fill)


def test_shapes_tables():
    problems = make_problems(("shapes", "arithmetic"), n=40, seed=0)
    train, held = split_train_eval(problems, 10, seed=0)
    assert len(train) == 30 and not {(p.question, p.image) for p in train} & {(p.question, p.image) for p in held}
    table = prompts_table(problems)
    rows = table.to_pylist()
    assert rows[0]["messages"] == [{"role": "user", "content": f"{IMAGE_MARKER}\n{problems[0].question}"}]
    assert rows[0]["images"] == [problems[0].image] and rows[1]["images"] is None
    assert json.loads(rows[0]["meta"]) == {"family": "shapes"}
    corpus = corpus_for_tokenizer(problems)
    assert "What colour is the shape?" in corpus or "What shape is it?" in corpus
    assert not any(IMAGE_MARKER in text for text in corpus)


def test_prepare_data_with_shapes_validates(store):
    cfg = DataConfig(families=["shapes"], n_train=40, n_eval=8, n_rl_prompts=16, seed=1)
    tables = build_tables(cfg)
    assert set(tables) == set(output_keys(cfg, store)) == {"sft", "eval", "text", "prompts"}
    for name in ("sft", "eval", "prompts"):
        table, kind = tables[name]
        assert kind in ("sft", "prompts") and table.column("images").null_count == 0, name
    assert tables["prompts"][0].num_rows == 16 and tables["eval"][0].num_rows == 8
    texts = tables["text"][0].column("text").to_pylist()
    assert not any(IMAGE_MARKER in t for t in texts) and any("How many shapes are there?" in t for t in texts)
    mixed = build_tables(DataConfig(families=["shapes", "reverse"], n_train=20, n_eval=4, n_rl_prompts=4))
    preferences = mixed["preferences"][0]
    assert preferences.num_rows > 0 and all(
        r[0]["content"].startswith("Reverse") for r in preferences.column("prompt").to_pylist()
    )


def test_prepare_data_from_a_user_file_with_images(tmp_path):
    (tmp_path / "a.png").write_bytes(encoded(picture(), "PNG"))
    rows = [{"messages": chat_row(str(i)), "images": ["a.png"]} for i in range(5)]
    rows.append({"prompt": "Say hi.", "completion": "hi"})
    cfg = DataConfig(train_path=str(write_jsonl(tmp_path / "train.jsonl", rows)), n_eval=2, seed=0)
    tables = build_tables(cfg)
    assert set(tables) == {"sft", "eval", "text", "prompts"}
    png = canonical_png(encoded(picture(), "BMP"))
    held = tables["eval"][0]
    for msgs, images in zip(held.column("messages").to_pylist(), held.column("images").to_pylist(), strict=True):
        assert images == ([png] if IMAGE_MARKER in msgs[0]["content"] else None)
    assert not any(IMAGE_MARKER in t for t in tables["text"][0].column("text").to_pylist())


def test_mislabelled_pictures_keep_the_true_answer_for_the_verifier():
    """`slip_rate` on a visual family: that fraction of the demonstrations names another answer of the question's kind
    (a careless labeller); the answer the verifier checks stays the picture's."""
    from posttrain_core.data.synthetic import ANSWER_PREFIX, with_slips

    problems = make_problems(("shapes",), n=600, seed=2)
    shown = with_slips(problems, 0.3, max_digits=2, seed=2)
    assert [p.answer for p in shown] == [p.answer for p in problems]
    wrong = [s for s in shown if s.solution != ANSWER_PREFIX + s.answer]
    assert 0.24 < len(wrong) / 600 < 0.36
    for s in wrong:
        kind = next(k for k, text in shapes_task.QUESTIONS.items() if text == s.question)
        assert s.solution.removeprefix(ANSWER_PREFIX) in shapes_task.ANSWERS[kind]
    assert with_slips(problems, 0.0, 2) == problems
