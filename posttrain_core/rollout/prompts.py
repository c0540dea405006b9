"""Which prompts a generating stage samples, checked before any Ray work, and how they are cut into engine calls."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

if TYPE_CHECKING:
    from posttrain_core.artifacts import ArtifactRef, ArtifactStore
    from posttrain_core.config import RolloutConfig


def select_prompts(cfg: RolloutConfig, prompts: ArtifactRef, store: ArtifactStore, stage: str = "rollout") -> pa.Table:
    """The prompt rows a rollout samples: `cfg.families` only, then the window of `max_prompts` from `prompt_start`.

    Raises:
        ValueError: a column missing (SchemaError), duplicated prompt ids, or no prompts left.
    """
    from posttrain_core.data.io import read_dataset

    table = read_dataset(store.local_path(prompts), "prompts")  # a missing/bad `messages` column fails here
    check_unique_ids(table, prompts.uri, stage)
    if cfg.families:
        families = prompt_families(table)  # ids are unique (checked above)
        table = table.filter(pa.array([families[p] in cfg.families for p in table.column("prompt_id").to_pylist()]))
        if table.num_rows == 0:
            raise ValueError(f"{stage}: {prompts.uri} has no prompt whose meta.family is one of {cfg.families}")
    if table.num_rows == 0:
        raise ValueError(f"{stage}: {prompts.uri} holds no prompts")
    if cfg.max_prompts or cfg.prompt_start:
        n = min(cfg.max_prompts or table.num_rows, table.num_rows)
        table = table.take([(cfg.prompt_start + i) % table.num_rows for i in range(n)])
    return table


def prompt_meta(prompts: pa.Table, field: str) -> dict[str, Any]:
    """prompt_id -> `field` of the row's `meta` (e.g. {"family": ..., "needs_tool": ...}, as the synthetic tasks
    write it), or None."""
    return {
        pid: (json.loads(meta) if meta else {}).get(field)
        for pid, meta in zip(prompts.column("prompt_id").to_pylist(), prompts.column("meta").to_pylist(), strict=True)
    }


def prompt_families(prompts: pa.Table) -> dict[str, str | None]:
    """prompt_id -> the family named in the row's `meta`, or None."""
    return prompt_meta(prompts, "family")


def check_unique_ids(table: pa.Table, where: str, stage: str) -> None:
    """Samples are keyed by prompt_id: a duplicated one is an error naming it."""
    ids = table.column("prompt_id").to_pylist()
    if len(set(ids)) != len(ids):
        seen: set[str] = set()
        dup = next(i for i in ids if i in seen or seen.add(i))
        raise ValueError(f"{stage}: {where}: prompt_id {dup!r} appears more than once (samples are keyed by it)")


def check_context(policy_path: Path, info: dict, table: pa.Table, max_tokens: int, field: str, stage: str) -> None:
    """The longest prompt + `max_tokens` must fit the model's context; the error names `field` and the prompt."""
    context = info.get("max_position_embeddings")
    if not context:
        return
    lengths = prompt_lengths(policy_path, table)
    longest = max(lengths)
    if longest + max_tokens > context:
        pid = table.column("prompt_id")[lengths.index(longest)].as_py()
        raise ValueError(
            f"{stage}: {field} ({max_tokens}) + the longest prompt ({longest} tokens, prompt_id {pid!r}) = "
            f"{longest + max_tokens} exceeds the model's context (max_position_embeddings={context}); lower "
            f"{field} to at most {context - longest}"
        )


_TOKENIZERS: dict[str, Any] = {}  # a memo: sha256 of a folder's tokenizer files -> the tokenizer loaded from them
_TOKENIZER_PREFIXES = ("tokenizer", "special_tokens", "added_tokens", "chat_template", "vocab", "merges")


def prompt_lengths(policy_path: Path, table: pa.Table) -> list[int]:
    """Token counts of `table`'s rendered prompts with the policy's tokenizer.

    The tokenizer is remembered by the bytes of the folder's tokenizer files: every RL iteration checks its prompts
    against a new policy folder whose tokenizer files are the same bytes, and loading one is on the iteration's
    critical path. Used read-only. A folder without tokenizer files (a LoRA adapter saved without one) loads its
    tokenizer every time.
    """
    from posttrain_core.data.chat import tokenize_prompt
    from posttrain_core.models.loading import load_tokenizer

    files = sorted(p for p in Path(policy_path).iterdir() if p.is_file() and p.name.startswith(_TOKENIZER_PREFIXES))
    key = None
    if files:
        h = hashlib.sha256()
        for f in files:
            h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
        key = h.hexdigest()
    tokenizer = _TOKENIZERS.get(key) if key else None
    if tokenizer is None:
        tokenizer = load_tokenizer(policy_path, require_chat_template=True)
        if key is not None:
            if len(_TOKENIZERS) >= 4:
                _TOKENIZERS.pop(next(iter(_TOKENIZERS)))
            _TOKENIZERS[key] = tokenizer
    return [len(tokenize_prompt(tokenizer, m)) for m in table.column("messages").to_pylist()]


def prompts_per_call(batch_size: int, num_engines: int, n_prompts: int) -> int:
    """Prompts per engine call: `batch_size`, or fewer when that would leave engines idle.

    With 8 prompts, batch_size 32 and 2 engines, one call of 8 would keep the second engine idle and the first
    generating for both; two calls of 4 finish in about half the time. The samples do not depend on it (each draws
    from its own seeded stream), up to the float rounding that a batch's padding can change (see `HFEngine`).
    """
    return max(1, min(batch_size, -(-n_prompts // num_engines)))


def engine_batches(table: pa.Table, batch_size: int, num_engines: int) -> list[pa.Table]:
    """The prompt batches the engines get, in order (`prompts_per_call` rows each)."""
    rows = table.select(["prompt_id", "messages", "answer", "meta"] + ["images"] * ("images" in table.column_names))
    per_call = prompts_per_call(batch_size, num_engines, rows.num_rows)
    return [rows.slice(i, per_call) for i in range(0, rows.num_rows, per_call)]
