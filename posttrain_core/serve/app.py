"""`posttrain serve`: training and sampling of many tenants' LoRA adapters over HTTP, on Ray Serve.

One `Gateway` deployment (the HTTP API the tinker SDK speaks) and one `ModelWorker` deployment per base model
(the adapters, the fair queue, the compute). Ray Serve runs them as actors on the local Ray (or `$RAY_ADDRESS`)
and its proxy serves HTTP on `host:port`.

    posttrain serve --base-model tiny=/models/tiny --port 8000 [--keys keys.txt] [--max-loras 4]
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from posttrain_core.env import setting

log = logging.getLogger("posttrain.serve")

KEYS_ENV = "POSTTRAIN_SERVE_KEYS"


class ServeConfig(BaseModel):
    """What a service runs; every field that can change a number is here (and in each checkpoint's manifest)."""

    model_config = ConfigDict(extra="forbid")

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
        None, description="the service's journal and evicted adapters (default {store}/serve)"
    )
    keys_file: str | None = Field(
        None,
        description=f"API keys, one `tml-KEY TENANT` per line; else ${KEYS_ENV} ('tml-a=alice,tml-b=bob'); "
        "with neither, every tml- key is its own tenant",
    )
    max_loras: int = Field(4, ge=1, description="adapters resident per base model; others wait on disk")
    lora_alpha: int = Field(32, ge=1, description="LoRA alpha of every adapter (scale alpha / rank)")
    dtype: str = Field("float32", description="base model weights dtype")
    max_batch_tokens: int = Field(8192, ge=16, description="padded tokens per forward/backward pass")
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


def _base_paths(config: ServeConfig, store) -> dict[str, str]:
    from posttrain_core.models.build import stored_model
    from posttrain_core.models.gguf import import_gguf, is_gguf_path
    from posttrain_core.models.loading import check_model_path

    paths = {}
    for name, path in config.base_models.items():
        ref = import_gguf(path, store) if is_gguf_path(path) else stored_model(path, store, f"base_models.{name}")
        if ref is not None:
            path = str(store.local_path(ref))
        info = check_model_path(path)
        if info["is_adapter"]:
            raise ValueError(f"base_models.{name}: {path} is an adapter; serve its base model")
        paths[name] = str(Path(path).resolve())
    return paths


def start(config: ServeConfig) -> str:
    """Deploy the service on Ray Serve (starting local Ray if needed); returns its base URL once healthy."""
    from ray import serve

    from posttrain_core.artifacts import ArtifactStore
    from posttrain_core.cluster import connect
    from posttrain_core.serve.gateway import Gateway
    from posttrain_core.serve.worker import ModelWorker

    store = ArtifactStore(config.store)
    store.check_writable()
    settings: dict[str, Any] = config.model_dump()
    settings.update(
        store=store.root,
        state_dir=str(Path(config.state_dir or Path(store.root) / "serve").resolve()),
        base_models=_base_paths(config, store),
        keys=read_keys(config),
        threads=config.threads or os.cpu_count(),
    )
    if settings["keys"] is None:
        log.warning("no keys file or $%s: every tml- key is accepted as its own tenant", KEYS_ENV)
    connect()
    serve.start(http_options={"host": config.host, "port": config.port})
    unlimited = {"max_ongoing_requests": 1_000_000, "ray_actor_options": {"num_cpus": 0}}
    workers = {
        name: serve.deployment(ModelWorker, name=f"model-{i}", **unlimited).bind(name, path, settings)
        for i, (name, path) in enumerate(settings["base_models"].items())
    }
    # No per-request access log: every client heartbeats and long-polls; lifecycle events are logged instead.
    logging_config = {"enable_access_log": False, "log_level": "INFO"}
    app = Gateway.options(**unlimited).bind(settings, workers)
    serve.run(app, name="posttrain", route_prefix="/", logging_config=logging_config)
    url = f"http://{config.host}:{config.port}"
    log.info("posttrain serve: %s (bases: %s; store %s)", url, ", ".join(config.base_models), store.root)
    return url


def run_forever(config: ServeConfig) -> None:
    """Start the service and keep this process (which owns the local Ray) alive until interrupted."""
    url = start(config)
    print(f"posttrain serve: listening on {url} (TINKER_BASE_URL={url}); Ctrl-C stops", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        from ray import serve

        serve.shutdown()


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve tinker-compatible LoRA training and sampling over HTTP (Ray Serve)")
    p.add_argument("--base-model", action="append", required=True, metavar="NAME=PATH", help="repeatable")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--keys", dest="keys_file", metavar="FILE", help="API keys: `tml-KEY TENANT` per line")
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--max-queued", type=int, default=64)
    p.add_argument("--state-dir")
    p.add_argument("--threads", type=int, help="torch threads per worker (default: all cores)")


def main(args) -> None:
    """`posttrain serve ...` (parsed by `add_parser`)."""
    from pydantic import ValidationError

    bases = {}
    for item in args.base_model:
        name, eq, path = item.partition("=")
        if not eq or not name or not path:
            raise SystemExit(f"posttrain serve: --base-model {item!r}: expected NAME=PATH")
        bases[name] = path
    try:
        config = ServeConfig(
            base_models=bases,
            host=args.host,
            port=args.port,
            store=args.store,
            state_dir=args.state_dir,
            keys_file=args.keys_file,
            max_loras=args.max_loras,
            max_queued=args.max_queued,
            threads=args.threads,
        )
    except ValidationError as e:
        raise SystemExit(f"posttrain serve: {e}") from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run_forever(config)
