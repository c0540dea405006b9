"""The prepare_data stage: synthetic task or user files -> validated Arrow dataset artifacts in the store.

Outputs (one artifact each): `sft` (training chats), `eval` (held-out prompts with answers), `text` (raw text for
continued pretraining), `prompts` (RL prompts with answers: `prompts_path` when given, else for the synthetic task
problems of their own, for a user's training file its chats) and, for the synthetic task's text families,
`preferences` (right vs wrong answers, for RM/DPO).
"""

from __future__ import annotations

import json
import logging
import random
import time

import pyarrow as pa
from pydantic import BaseModel, ConfigDict

from posttrain_core import tracking
from posttrain_core.artifacts import ArtifactRef, ArtifactStore
from posttrain_core.artifacts.keys import stage_key
from posttrain_core.config import DataConfig
from posttrain_core.vision.images import IMAGE_MARKER

log = logging.getLogger(__name__)

STAGE = "prepare_data"


class DataRefs(BaseModel):
    """The datasets one prepare_data run publishes."""

    model_config = ConfigDict(frozen=True)

    sft: ArtifactRef
    eval: ArtifactRef
    text: ArtifactRef
    prompts: ArtifactRef | None = None
    preferences: ArtifactRef | None = None


def _inputs(cfg: DataConfig, store: ArtifactStore) -> dict[str, ArtifactRef]:
    """User files are inputs (their fingerprint is part of the key); the synthetic task has none."""
    files = {
        "train_file": cfg.train_path,
        "eval_file": cfg.eval_path,
        "text_file": cfg.text_path,
        "prompts_file": cfg.prompts_path,
    }
    return {name: store.register_external(path, kind="dataset") for name, path in files.items() if path}


def output_keys(cfg: DataConfig, store: ArtifactStore) -> dict[str, str]:
    inputs = [ref.digest for ref in _inputs(cfg, store).values()]
    names = ["sft", "eval", "text", "prompts"] + (["preferences"] if _makes_preferences(cfg) else [])
    return {name: stage_key(f"{STAGE}.{name}", cfg, inputs) for name in names}


def _makes_preferences(cfg: DataConfig) -> bool:
    """Only the synthetic text families make preference pairs (the preferences schema has no images)."""
    from posttrain_core.data.synthetic import VISUAL_FAMILIES

    return not cfg.train_path and any(f not in VISUAL_FAMILIES for f in cfg.families)


def holdout_prompts(sft: pa.Table, n_eval: int, seed: int, source: str) -> tuple[pa.Table, pa.Table]:
    """Split chats into (train chats, eval prompts): an eval prompt is a chat up to its last assistant turn, whose
    content becomes the answer."""
    n_rows = sft.num_rows
    if n_eval >= n_rows:
        raise ValueError(f"{source}: n_eval={n_eval} leaves no training rows ({n_rows} rows in all)")
    order = list(range(n_rows))
    random.Random(seed).shuffle(order)
    held, kept = sorted(order[:n_eval]), sorted(order[n_eval:])
    return sft.take(kept), chats_as_prompts(sft, held)


def _images(sft: pa.Table) -> list:
    return sft.column("images").to_pylist() if "images" in sft.column_names else [None] * sft.num_rows


def chats_as_prompts(sft: pa.Table, rows: list[int] | None = None) -> pa.Table:
    """Chats (all, or `rows`) as prompts: each chat up to its last assistant turn, whose content is the answer.

    A prompt keeps the images of its markers (images come in marker order, so the first ones); images of the answer
    turn or later go with it.
    """
    chats, images = sft.column("messages").to_pylist(), _images(sft)
    prompts: dict[str, list] = {"prompt_id": [], "messages": [], "answer": [], "meta": [], "images": []}
    for i in range(len(chats)) if rows is None else rows:
        msgs = chats[i]
        last = max(j for j, m in enumerate(msgs) if m["role"] == "assistant")
        kept = sum(m["content"].count(IMAGE_MARKER) for m in msgs[:last]) if images[i] else 0
        prompts["prompt_id"].append(f"row-{i}")
        prompts["messages"].append(msgs[:last])
        prompts["answer"].append(msgs[last]["content"])
        prompts["meta"].append(json.dumps({"source_row": i}))
        prompts["images"].append(images[i][:kept] if kept else None)
    return pa.table(prompts)


def flatten_chats(sft: pa.Table) -> pa.Table:
    """Chats as raw text (contents joined by newlines), for continued pretraining when no text file is given.

    Pretraining text has no pixels: a chat with images keeps its text with the `<image>` markers taken out (its words
    still belong in the tokenizer's corpus), and a message that was only an image is left out.
    """
    texts = []
    for msgs, images in zip(sft.column("messages").to_pylist(), _images(sft), strict=True):
        contents = [m["content"] for m in msgs]
        if images:
            contents = [c for c in (c.replace(IMAGE_MARKER, "").strip() for c in contents) if c]
        texts.append("\n".join(contents))
    return pa.table({"text": texts})


def build_tables(cfg: DataConfig) -> dict[str, tuple[pa.Table, str]]:
    """All output tables, validated; raises (naming file, line, field) before anything is written."""
    from posttrain_core.data import importers, schemas, synthetic

    tables: dict[str, tuple[pa.Table, str]] = {}
    if cfg.train_path:
        sft = importers.import_file(cfg.train_path, "sft")
        if cfg.eval_path:
            eval_ = importers.import_file(cfg.eval_path, "prompts")
        else:
            sft, eval_ = holdout_prompts(sft, cfg.n_eval, cfg.seed, cfg.train_path)
        text = importers.import_file(cfg.text_path, "text") if cfg.text_path else flatten_chats(sft)
        tables = {
            "sft": (sft, "sft"),
            "eval": (eval_, "prompts"),
            "text": (text, "text"),
            "prompts": (chats_as_prompts(sft), "prompts"),
        }
        if cfg.prompts_path:
            tables["prompts"] = (importers.import_file(cfg.prompts_path, "prompts"), "prompts")
    else:
        problems = synthetic.make_problems(
            families=tuple(cfg.families),
            n=cfg.n_train + cfg.n_eval + cfg.n_rl_prompts,
            seed=cfg.seed,
            max_digits=cfg.max_digits,
            worked=cfg.worked_solutions,
        )
        # RL prompts of their own (the last ones: families stay interleaved, and every question is distinct), as RL
        # prompt sets usually are: the policy is then trained on problems it has not memorised answers to, like the
        # held-out ones. They come after the SFT and held-out problems, which therefore do not depend on their number.
        head = cfg.n_train + cfg.n_eval
        train, held = synthetic.split_train_eval(problems[:head], cfg.n_eval, cfg.seed)
        rl = problems[head:] if cfg.n_rl_prompts else train
        shown = synthetic.with_slips(train, cfg.slip_rate, cfg.max_digits, cfg.seed)  # the demonstrations
        tables = {
            "sft": (synthetic.sft_table(shown), "sft"),
            "eval": (synthetic.prompts_table(held), "prompts"),
            "text": (synthetic.text_table(shown, cfg.seed), "text"),
            "prompts": (synthetic.prompts_table(rl), "prompts"),
        }
        if _makes_preferences(cfg):
            tables["preferences"] = (synthetic.preferences_table(train, cfg.seed), "preferences")
        if cfg.prompts_path:
            tables["prompts"] = (importers.import_file(cfg.prompts_path, "prompts"), "prompts")
        if cfg.eval_path:
            tables["eval"] = (importers.import_file(cfg.eval_path, "prompts"), "prompts")
    for name, (table, kind) in tables.items():
        if table.num_rows == 0:
            raise ValueError(f"prepare_data: the '{name}' dataset is empty")
        table = schemas.validate_table(table, kind, source=f"prepare_data.{name}")
        if cfg.blank_images and "images" in table.column_names:
            table = _blanked(table)
        tables[name] = (table, kind)
    return tables


def _blanked(table: pa.Table) -> pa.Table:
    """`table` with every image a white one of the same size (`DataConfig.blank_images`)."""
    from posttrain_core.vision.images import blank_png

    rows = table.column("images").to_pylist()
    blank = pa.array([[blank_png(b) for b in r] if r else r for r in rows], table.schema.field("images").type)
    return table.set_column(table.schema.get_field_index("images"), table.schema.field("images"), blank)


def run_prepare_data(cfg: DataConfig, store: ArtifactStore) -> DataRefs:
    """Publish the datasets (all validated before the first is written); cached by config and input files."""
    from posttrain_core.data.io import write_dataset

    inputs = _inputs(cfg, store)
    keys = output_keys(cfg, store)
    found = {name: store.get(key) for name, key in keys.items()}
    if all(found.values()):
        log.info("%s: cache hit (%s)", STAGE, ", ".join(f"{n}={k[:12]}" for n, k in keys.items()))
        return DataRefs(**found)
    started = time.time()
    tables = build_tables(cfg)
    refs: dict[str, ArtifactRef] = {}
    with tracking.stage_run(store.root, STAGE, {"config": cfg.model_dump(mode="json")}) as tracker:
        tracking.log_inputs(tracker, inputs)
        for name, (table, kind) in tables.items():
            if found.get(name):
                refs[name] = found[name]
                continue
            out = store.new_output_dir(keys[name])
            info = write_dataset(table, kind, out)
            manifest = {
                "stage": f"{STAGE}.{name}",
                "config": cfg.model_dump(mode="json"),
                "inputs": [{"name": n, **r.model_dump()} for n, r in inputs.items()],
                "mlflow_run_id": tracker.run_id,
                "num_rows": info["num_rows"],
                "metrics": {"num_rows": float(info["num_rows"])},
                "arrow_schema": info["schema"],
            }
            refs[name] = store.publish(keys[name], "dataset", out, manifest, schema_kind=kind)
            store.clear_staging(keys[name])
            tracker.log_metrics({f"{name}/num_rows": table.num_rows})
            log.info("%s: %s -> %d rows (%s)", STAGE, name, table.num_rows, refs[name].key[:12])
        tracker.log_metrics({"duration_s": time.time() - started})
    return DataRefs(**refs)
