"""Bring user data in: JSON lines, Parquet and Hugging Face `datasets` folders become validated Arrow tables.

Convenient row shapes (prompt/completion, plain prompt strings, implicit-prompt preferences, image parts) are
normalised into the kind's schema first. Everything is local: nothing here ever contacts the Hugging Face hub.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from posttrain_core.data.schemas import SCHEMAS, SchemaError, validate_table
from posttrain_core.vision.images import MESSAGE_FIELDS, ImageError, check_markers, take_images

_JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")


class RowError(ValueError):
    """A row cannot be normalised; carries the field at fault (the caller adds file and line)."""


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    )


def _messages(row: dict, field: str) -> list[dict]:
    value = row.get(field)
    if not _is_messages(value):
        raise RowError(f"field '{field}' must be a list of {{role, content}} objects")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _turn(row: dict, field: str, role: str) -> list[dict]:
    """A field given as a plain string (one `role` message) or as a list of messages."""
    value = row.get(field)
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return _messages(row, field)


def _normalise(row: Any, kind: str, position: int, stem: str, base_dir: Path | None = None) -> dict:
    """Turn one user row into the kind's columns; fields not in the schema are kept as they are.

    Args:
        row: one parsed JSON value (or table row).
        position: the line number (JSON lines) or row index (tables), used for generated prompt ids.
        stem: the file name without suffix, used for generated prompt ids.
        base_dir: the folder that relative image paths start from (the data file's).
    """
    if kind == "text" and isinstance(row, str):
        return {"text": row}
    if not isinstance(row, dict):
        raise RowError(f"expected a JSON object, got {type(row).__name__}")
    row = dict(row)
    gives_images = take_images(row, base_dir) if kind in ("prompts", "sft") else False
    if kind == "sft" and "messages" not in row:
        if "prompt" in row and ("completion" in row or "response" in row):
            answer_field = "completion" if "completion" in row else "response"
            prompt = _turn(row, "prompt", "user")
            if isinstance(row.get("system"), str):
                prompt = [{"role": "system", "content": row.pop("system")}] + prompt
            row["messages"] = prompt + _turn(row, answer_field, "assistant")
            row.pop("prompt"), row.pop(answer_field)
        else:
            raise RowError("field 'messages' is missing (or give 'prompt' and 'completion'/'response')")
    elif kind == "sft":
        row["messages"] = _messages(row, "messages")
    elif kind == "prompts":
        if "messages" not in row:
            if "prompt" not in row:
                raise RowError("field 'messages' is missing (or give 'prompt')")
            row["messages"] = _turn(row, "prompt", "user")
            row.pop("prompt")
            if isinstance(row.get("system"), str):
                row["messages"].insert(0, {"role": "system", "content": row.pop("system")})
        else:
            row["messages"] = _messages(row, "messages")
        if row.get("prompt_id") is None:
            row["prompt_id"] = f"{stem}-{position}"
        answer = row.get("answer")
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            row["answer"] = str(answer)  # {"answer": 82} is the natural way to write a numeric ground truth
        if isinstance(row.get("meta"), dict):
            row["meta"] = json.dumps(row["meta"], sort_keys=True)
    elif kind == "preferences":
        if "prompt" not in row and _is_messages(row.get("chosen")) and _is_messages(row.get("rejected")):
            # TRL's implicit-prompt form: both conversations share the prompt as their common prefix.
            chosen, rejected = _messages(row, "chosen"), _messages(row, "rejected")
            k = 0
            while k < min(len(chosen), len(rejected)) - 1 and chosen[k] == rejected[k]:
                k += 1
            row["prompt"], row["chosen"], row["rejected"] = chosen[:k], chosen[k:], rejected[k:]
        else:
            row["prompt"] = _turn(row, "prompt", "user")
            row["chosen"] = _turn(row, "chosen", "assistant")
            row["rejected"] = _turn(row, "rejected", "assistant")
    if gives_images:
        check_markers(row["messages"], row["images"])
    return row


def _read_json(path: Path) -> tuple[str, list[tuple[int, Any]]]:
    """("line", [(line number, value)]) of a JSON-lines file, or ("item", [(item number, value)]) of a JSON array."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    if text.lstrip().startswith("["):
        try:
            values = json.loads(text)
        except ValueError as err:
            raise ValueError(f"{path}: invalid JSON ({err})") from None
        return "item", list(enumerate(values, start=1))
    rows = []
    for n, line in enumerate(text.split("\n"), start=1):  # not splitlines(): U+2028 may sit inside a string
        if not line.strip():
            continue
        try:
            rows.append((n, json.loads(line)))
        except ValueError as err:
            raise ValueError(f"{path} line {n}: invalid JSON ({err})") from None
    return "line", rows


def _rows_to_table(rows: list[dict], kind: str, where: Callable[[int], str]) -> pa.Table:
    """Build columns with the schema's types, so a bad value is reported at its line, not as a pyarrow error."""
    schema = SCHEMAS[kind]
    names: dict[str, None] = {}
    for row in rows:
        names.update(dict.fromkeys(row))
    arrays, fields = [], []
    for name in names:
        values = [row.get(name) for row in rows]
        type_ = schema.field(name).type if name in schema.names else None
        try:
            arrays.append(pa.array(values, type=type_))
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            for i, value in enumerate(values):
                try:
                    pa.array([value], type=type_)
                except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as err:
                    expected = f"expected {type_}" if type_ is not None else "its type differs from earlier rows"
                    raise ValueError(
                        f"{where(i)}: field '{name}' has value {value!r:.80}; {expected} ({err})"
                    ) from None
            raise
        fields.append(name)
    for field in schema:  # absent nullable columns (answer, meta, ...) are simply unknown
        if field.name not in names and field.nullable:
            arrays.append(pa.nulls(len(rows), field.type))
            fields.append(field.name)
    return pa.Table.from_arrays(arrays, names=fields)


def _from_rows(values: list[tuple[int, Any]], kind: str, path: str, label: str, stem: str) -> pa.Table:
    if kind not in SCHEMAS:
        raise ValueError(f"unknown dataset kind {kind!r}; kinds: {', '.join(SCHEMAS)}")
    if not values:
        raise ValueError(f"{path}: no rows")
    base_dir = Path(path) if Path(path).is_dir() else Path(path).parent
    rows = []
    for position, value in values:
        try:
            rows.append(_normalise(value, kind, position, stem, base_dir))
        except (RowError, ImageError) as err:
            raise ValueError(f"{path} {label} {position}: {err}") from None
    table = _rows_to_table(rows, kind, lambda i: f"{path} {label} {values[i][0]}")
    try:
        return validate_table(table, kind, source=path)
    except SchemaError as err:
        if err.row is None:
            raise
        raise ValueError(f"{path} {label} {values[err.row][0]}: {err.detail}") from None


def _from_table(table: pa.Table, kind: str, path: str) -> pa.Table:
    """Validate a table read from parquet or `datasets`, normalising convenient shapes if the schema's columns are not all there."""
    if table.num_rows == 0:
        raise ValueError(f"{path}: no rows")
    if kind not in SCHEMAS:
        raise ValueError(f"unknown dataset kind {kind!r}; kinds: {', '.join(SCHEMAS)}")
    if kind in ("prompts", "sft") and _gives_images(table):
        # Images arrive in any form (paths, other formats, {bytes, path} structs, parts): made PNG row by row.
        return _from_rows(list(enumerate(table.to_pylist())), kind, path, "row", Path(path).stem)
    for field in SCHEMAS[kind]:
        if field.name not in table.column_names and field.nullable:
            table = table.append_column(field.name, pa.nulls(table.num_rows, field.type))
    if not set(SCHEMAS[kind].names) <= set(table.column_names):
        return _from_rows(list(enumerate(table.to_pylist())), kind, path, "row", Path(path).stem)
    return validate_table(table, kind, source=path)


def _gives_images(table: pa.Table) -> bool:
    """Whether a table has images (a non-null `images` column) or chat columns with content parts."""
    if "images" in table.column_names and table.column("images").null_count < table.num_rows:
        return True
    for name in MESSAGE_FIELDS:
        type_ = table.schema.field(name).type if name in table.column_names else None
        if type_ is None or not (pa.types.is_list(type_) or pa.types.is_large_list(type_)):
            continue
        if not pa.types.is_struct(type_.value_type):
            continue
        item = type_.value_type
        if item.get_field_index("type") >= 0:  # the field itself is a list of parts
            return True
        content = item.get_field_index("content")
        content_type = item.field(content).type if content >= 0 else None
        if content_type is not None and (pa.types.is_list(content_type) or pa.types.is_large_list(content_type)):
            return True
    return False


def import_file(path: str | Path, kind: str) -> pa.Table:
    """Import user data as a validated table of `kind`.

    Dispatches on what `path` is: `.jsonl`/`.json`/`.ndjson` (JSON lines, or one JSON array), `.parquet`, a folder
    written by `datasets.save_to_disk`, or a folder of parquet files.

    Normalised shapes: sft {"prompt", "completion"|"response"} (strings or message lists, optional "system");
    text rows that are plain JSON strings; prompts {"prompt": str} and a missing prompt_id (f"{file stem}-{line}",
    or the row index for tables), a numeric answer (made a string), a meta object (made JSON text);
    preferences with string prompt/chosen/rejected, or TRL's implicit-prompt form (chosen/rejected full chats).
    Prompts keep their other columns in `meta` (`fold_into_meta`): reward functions receive them.

    Images (prompts and sft): message contents given as parts ([{"type": "text", "text"}, {"type": "image", "image"
    | "path" | "url" | "bytes": ...}]) become text with an `<image>` marker per image part, their images the row's
    `images`; or an `images` field lists the images of the markers already in the text. An image is a path (relative
    to the data file's folder, or absolute), bytes, a {bytes, path} struct or base64 text (or a data URL), always
    stored as canonical PNG bytes (`vision.images.canonical_png`): one picture gives one dataset whatever its form.
    A row with images needs one marker per image; rows without get null `images`.

    Raises:
        FileNotFoundError naming the path; ValueError naming the file and line (or row) for bad rows.
    """
    table = _import(Path(path), kind)
    return fold_into_meta(table, str(path)) if kind == "prompts" else table


def fold_into_meta(table: pa.Table, source: str) -> pa.Table:
    """A prompts table with its columns beyond the schema's moved into `meta` (a JSON object per row, merged with a
    `meta` the row already has), so that they travel with the prompt to the reward functions."""
    names = SCHEMAS["prompts"].names
    extra = [c for c in table.column_names if c not in names]
    if not extra:
        return table
    metas = table.column("meta").to_pylist()
    columns = {c: table.column(c).to_pylist() for c in extra}
    folded = []
    for i, text in enumerate(metas):
        try:
            meta = json.loads(text) if text else {}
        except ValueError as err:
            raise ValueError(f"{source} row {i}: field 'meta' is not JSON ({err})") from None
        if not isinstance(meta, dict):
            raise ValueError(f"{source} row {i}: field 'meta' must be a JSON object, got {type(meta).__name__}")
        folded.append(json.dumps({**{c: columns[c][i] for c in extra}, **meta}, sort_keys=True, default=str))
    table = table.drop_columns(extra)
    return table.set_column(table.schema.get_field_index("meta"), "meta", pa.array(folded, pa.string()))


def _import(p: Path, kind: str) -> pa.Table:
    path = str(p)
    if not p.exists():
        raise FileNotFoundError(f"{path}: no such file or folder")
    if p.is_dir():
        if (p / "state.json").exists() or (p / "dataset_dict.json").exists():
            return import_hf(p, kind)
        files = sorted(f for f in p.glob("*.parquet") if not f.name.startswith((".", "_")))
        if not files:
            raise ValueError(f"{path}: folder holds neither parquet files nor a datasets.save_to_disk dataset")
        table = pa.concat_tables([pq.read_table(f) for f in files], promote_options="permissive")
        return _from_table(table, kind, str(path))
    suffix = p.suffix.lower()
    if suffix in _JSON_SUFFIXES:
        label, values = _read_json(p)
        return _from_rows(values, kind, str(path), label, p.stem)
    if suffix == ".parquet":
        return _from_table(pq.read_table(p), kind, str(path))
    raise ValueError(f"{path}: unsupported file type {suffix!r} (use .jsonl, .json, .parquet or a folder)")


def import_hf(path: str | Path, kind: str, split: str = "train") -> pa.Table:
    """Import a local Hugging Face dataset: a `save_to_disk` folder, or parquet/JSON files via `load_dataset`.

    Never contacts the hub: `path` must exist locally.

    Args:
        path: a `save_to_disk` folder (Dataset or DatasetDict), a parquet/JSON file, or a folder of them.
        split: the split to take from a DatasetDict.
    """
    import datasets  # heavy: imported only when used

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{path}: no such file or folder")
    if p.is_dir() and ((p / "state.json").exists() or (p / "dataset_dict.json").exists()):
        ds = datasets.load_from_disk(str(p))
    else:
        files = (
            [p]
            if p.is_file()
            else sorted(p.glob("*.parquet")) or sorted(f for s in _JSON_SUFFIXES for f in p.glob(f"*{s}"))
        )
        if not files:
            raise ValueError(f"{path}: no parquet or JSON files to load")
        builder = "parquet" if files[0].suffix == ".parquet" else "json"
        ds = datasets.load_dataset(builder, data_files=[str(f) for f in files])
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ValueError(f"{path}: no split {split!r}; splits: {', '.join(ds)}")
        ds = ds[split]
    if len(ds) == 0:
        raise ValueError(f"{path}: no rows")
    return _from_table(ds.with_format("arrow")[:], kind, str(path))
