"""`posttrain serve`'s settings (`ServeConfig`), its API keys, and the command line generated from the settings.

Every field is a flag (`--max-loras 2`, `--memory-gb 8`, ...) whose help is the field's description and whose default
is the field's: the defaults are stated once, here. The config travels typed to the gateway and the workers.
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from posttrain_core.env import setting

KEYS_ENV = "POSTTRAIN_SERVE_KEYS"


class ServeConfig(BaseModel):
    """What a service runs. The fields that decide a checkpoint's numbers (base model, dtype, LoRA alpha) are in each
    checkpoint's manifest; the others decide only how the work is scheduled."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base_models: dict[str, str] = Field(
        min_length=1,
        description="public name (the SDK's base_model) -> local Hugging Face folder, .gguf file (imported once), "
        "'latest:STAGE' (the newest model a pipeline stage published, e.g. latest:sft) or a model artifact's key",
    )
    host: str = Field("127.0.0.1", description="address the HTTP proxy binds")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port")
    store: str | None = Field(
        None, description="artifact store for checkpoints (default $POSTTRAIN_STORE or ./.posttrain)"
    )
    state_dir: str | None = Field(
        None,
        description="the service's journal, on the machine that starts it (default {store}/serve; for a remote store "
        "serve/ beside this machine's cache)",
    )
    keys_file: str | None = Field(
        None,
        description=f"API keys, one `tml-KEY TENANT` per line; else ${KEYS_ENV} ('tml-a=alice,tml-b=bob'); "
        "with neither, every tml- key is its own tenant",
    )
    max_loras: int = Field(4, ge=1, description="adapters resident per base model; others wait on disk")
    lora_alpha: int = Field(32, ge=1, description="LoRA alpha of every adapter (scale alpha / rank)")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="base model weights dtype")
    memory_gb: float | None = Field(
        None,
        gt=0,
        description="GiB of memory for the model workers together, split evenly across the base models: each "
        "worker sizes its forward/backward passes and decode batches to stay within its share (default: 80% of "
        "the memory this machine has free at start, at most what Ray offers)",
    )
    worker_resources: dict[str, float] = Field(
        default_factory=dict,
        description="custom Ray resources each model worker needs, as JSON ('{\"trainer\": 1}'): on a cluster, the "
        "workers go to the nodes started with them (`ray start --resources`)",
    )
    max_queued: int = Field(64, ge=1, description="unfinished requests per tenant before 429")
    long_poll_s: float = Field(20.0, gt=0, le=40, description="how long retrieve_future waits before try_again")
    threads: int | None = Field(None, ge=1, description="torch threads per worker (default: all cores)")


def read_keys(config: ServeConfig) -> dict[str, str] | None:
    """API key -> tenant from the keys file or $POSTTRAIN_SERVE_KEYS; None: open (any tml- key, its own tenant).

    Raises:
        ValueError: a malformed line or entry (names the file and line).
    """
    entries: list[tuple[str, str, str]] = []
    if config.keys_file:
        for n, line in enumerate(Path(config.keys_file).read_text().splitlines(), 1):
            if line.strip() and not line.lstrip().startswith("#"):
                parts = line.split()
                entries.append((parts[0], parts[1] if len(parts) == 2 else "", f"{config.keys_file}:{n}"))
    elif setting(KEYS_ENV):
        for i, item in enumerate(setting(KEYS_ENV).split(",")):
            key, _, tenant = item.strip().partition("=")
            entries.append((key, tenant, f"${KEYS_ENV} entry {i}"))
    else:
        return None
    keys = {}
    for key, tenant, where in entries:
        if not key.startswith("tml-") or not tenant:
            raise ValueError(f"{where}: expected `tml-KEY TENANT` (the SDK only sends keys starting with tml-)")
        keys[key] = tenant
    return keys


# ------------------------------------------------------------------------------------------- command line
# Flags named otherwise than `--field-name`: the SDK's words (`--base-model NAME=PATH`, repeated) and the short form.
FLAG_NAMES = {"base_models": "--base-model", "keys_file": "--keys"}
# `--store` also goes before the subcommand (`posttrain --store S serve`), as for every posttrain command.
STORE_FIELD = "store"


def flag(name: str) -> str:
    """The command-line flag of a `ServeConfig` field."""
    return FLAG_NAMES.get(name, "--" + name.replace("_", "-"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per `ServeConfig` field (but `store`, which `posttrain_core.cli.add_subcommand` adds); a flag left
    out keeps the field's default."""
    for name, field in ServeConfig.model_fields.items():
        if name == STORE_FIELD:
            continue
        stated = field.is_required() or field.default is None  # a None default is described in words
        default = "" if stated else f" (default: {field.default})"
        if name == "base_models":
            parser.add_argument(flag(name), dest=name, action="append", required=True, metavar="NAME=PATH",
                                help=f"{field.description}; repeat for several base models")  # fmt: skip
            continue
        kind, choices = _argument_type(field.annotation)
        help_text = f"{field.description}{default}".replace("%", "%%")  # argparse formats help with %
        parser.add_argument(flag(name), dest=name, type=kind, choices=choices, default=argparse.SUPPRESS,
                            help=help_text)  # fmt: skip


def _argument_type(annotation: Any) -> tuple[type, list | None]:
    """(type to parse with, choices) of a field annotation: a scalar, an optional scalar or a Literal."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is dict:
        return json.loads, None
    if typing.get_origin(annotation) is Literal:
        return type(args[0]), list(args)
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return _argument_type(args[0])
    return annotation, None


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The `ServeConfig` of parsed `posttrain serve` arguments.

    Raises:
        SystemExit: a malformed --base-model or a value the config refuses (the message names the flag).
    """
    fields = [n for n in ServeConfig.model_fields if n != STORE_FIELD]
    values: dict[str, Any] = {n: getattr(args, n) for n in fields if hasattr(args, n)}
    bases = {}
    for item in values.pop("base_models"):
        name, eq, path = item.partition("=")
        if not eq or not name or not path:
            raise SystemExit(f"posttrain serve: --base-model {item!r}: expected NAME=PATH")
        bases[name] = path
    store = getattr(args, STORE_FIELD, None)
    try:
        return ServeConfig(base_models=bases, **({"store": store} if store else {}), **values)
    except ValidationError as e:
        problems = "; ".join(f"{flag(str(err['loc'][0]))}: {err['msg']}" for err in e.errors())
        raise SystemExit(f"posttrain serve: {problems}") from None
