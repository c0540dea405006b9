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


def run_build_model(cfg: ModelConfig, corpus: ArtifactRef | None, store: ArtifactStore) -> ArtifactRef:
    """Return the base model artifact.

    Args:
        cfg: `path` = a local HF model folder (validated, registered as an external artifact), or a `.gguf` file
            (imported once as a model artifact: `models.gguf`); else a tiny preset.
        corpus: a `text` dataset to train the tiny model's tokenizer on (unused with `path`).
        store: the artifact store.
    """
    from posttrain_core.models.gguf import import_gguf, is_gguf_path
    from posttrain_core.models.loading import check_model_path

    if cfg.path and is_gguf_path(cfg.path):
        return import_gguf(cfg.path, store)
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
