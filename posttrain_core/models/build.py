"""The build_model stage: the base model of a pipeline: a user's Hugging Face folder or GGUF file, or a tiny model.

A user's folder is registered in place (fingerprinted, not copied). A tiny model gets a byte-level BPE tokenizer
trained on the pipeline's text corpus, so the whole pipeline runs offline on models it makes itself.
"""

from __future__ import annotations

import logging

from posttrain_core.artifacts import ArtifactRef, ArtifactStore
from posttrain_core.config import ModelConfig
from posttrain_core.stage import StageContext, StageOutput, run_stage

log = logging.getLogger(__name__)

STAGE = "build_model"


LATEST = "latest:"


def stored_model(path: str, store: ArtifactStore, field: str = "model.path") -> ArtifactRef | None:
    """The store's model artifact that `path` names, or None when it names none (a folder, a file):

        latest:STAGE    the newest model artifact the stage STAGE published (`latest:sft`, `latest:rl_update`)
        tinker://...    a checkpoint a tenant of `posttrain serve` saved
        KEY             an artifact key that is not also a local path

    Raises:
        LookupError: `latest:STAGE` and that stage published no model (names `field` and the stages that did).
        FileNotFoundError: a tinker path with no checkpoint in this store.
        ValueError: the key names a dataset.
    """
    from pathlib import Path

    from posttrain_core.serve.checkpoints import PREFIX, resolve

    if path.startswith(LATEST):
        stage = path[len(LATEST) :]
        manifests = [(ref, store.manifest(ref)) for ref in store.list("model")]  # one read of each manifest
        found = [(m.get("created", ""), ref) for ref, m in manifests if m.get("stage") == stage]
        if not found:
            stages = sorted({m.get("stage", "?") for _, m in manifests})
            raise LookupError(
                f"{field}: {path!r}: no model published by stage {stage!r} in {store.root} "
                f"(stages with models: {', '.join(stages) or 'none'}; run a training flow first)"
            )
        return max(found, key=lambda pair: pair[0])[1]
    if path.startswith(PREFIX):
        return resolve(store, path)
    if Path(path).expanduser().exists():
        return None
    try:
        ref = store.get(path)
    except ValueError:  # not a valid key: an ordinary (missing) path
        return None
    if ref is not None and ref.kind != "model":
        raise ValueError(f"{field}: artifact {path} is a {ref.schema_kind} dataset, not a model")
    return ref


def run_build_model(cfg: ModelConfig, corpus: ArtifactRef | None, store: ArtifactStore) -> ArtifactRef:
    """Return the base model artifact.

    Args:
        cfg: `path` = a local HF model folder (validated, registered as an external artifact), a `.gguf` file
            (imported once as a model artifact: `models.gguf`), a `tinker://` checkpoint or a model artifact's key
            (`stored_model`); else a tiny preset.
        corpus: a `text` dataset to train the tiny model's tokenizer on (unused with `path`).
        store: the artifact store.
    """
    from posttrain_core.models.gguf import import_gguf, is_gguf_path
    from posttrain_core.models.loading import check_model_path

    if cfg.path and is_gguf_path(cfg.path):
        return import_gguf(cfg.path, store)
    stored = stored_model(cfg.path, store) if cfg.path else None
    if stored is not None:
        return stored
    if cfg.path:
        info = check_model_path(cfg.path)
        log.info("%s: using %s (%s)", STAGE, cfg.path, info.get("model_type"))
        return store.register_external(cfg.path, kind="model")
    if corpus is None or corpus.schema_kind != "text":
        raise ValueError(f"{STAGE}: a tiny model needs a 'text' corpus for its tokenizer, got {corpus}")

    def build(ctx: StageContext) -> StageOutput:
        from posttrain_core.data.io import read_dataset
        from posttrain_core.models.loading import num_parameters
        from posttrain_core.models.tiny import TINY_PRESETS, build_tiny_checkpoint
        from posttrain_core.models.tokenizer import train_tokenizer

        texts = read_dataset(store.local_path(corpus), "text").column("text").to_pylist()
        tokenizer = train_tokenizer(texts, vocab_size=cfg.vocab_size)
        if cfg.arch in ("qwen2_vl", "llava"):
            from posttrain_core.vision.tiny_vlm import build_tiny_vlm_checkpoint

            build_tiny_vlm_checkpoint(
                ctx.outdir, tokenizer, cfg.arch, cfg.size, max_position_embeddings=cfg.max_position_embeddings,
                seed=cfg.seed,
            )  # fmt: skip
        else:
            build_tiny_checkpoint(
                ctx.outdir,
                tokenizer,
                arch=cfg.arch,
                max_position_embeddings=cfg.max_position_embeddings,
                seed=cfg.seed,
                **TINY_PRESETS[cfg.size],
            )
        from posttrain_core.models.loading import load_causal_lm

        n_params = num_parameters(load_causal_lm(str(ctx.outdir)))
        log.info("%s: tiny %s/%s, %d parameters, vocab %d", STAGE, cfg.arch, cfg.size, n_params, len(tokenizer))
        return StageOutput(
            manifest={
                "architecture": cfg.arch,
                "base_model": None,
                "dtype": "float32",
                "adapter": False,
                "vocab_size": len(tokenizer),
            },
            metrics={"num_parameters": float(n_params), "vocab_size": float(len(tokenizer))},
        )

    return run_stage(STAGE, cfg, {"corpus": corpus}, store, "model", build)
