"""`posttrain serve`: training and sampling of many tenants' LoRA adapters over HTTP, on Ray Serve.

One `Gateway` deployment (the HTTP API the tinker SDK speaks) and one `ModelWorker` deployment per base model
(the adapters, the fair queue, the compute). Ray Serve runs them as actors on the local Ray (or `$RAY_ADDRESS`)
and its proxy serves HTTP on `host:port`. Each worker reserves its share of the memory budget as Ray's `memory`
resource, so Ray places no more workers on a machine than its memory holds, and sizes its passes to stay within it.
On a Ray cluster the workers may run on any node: they read base models and checkpoints through the store (a
remote store is fetched into the node's cache) and upload what they save; the gateway stays on the node that
started the service, beside its journal.

    posttrain serve --base-model tiny=/models/tiny --port 8000 [--keys keys.txt] [--max-loras 4] [--memory-gb 8]
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from posttrain_core.serve.config import KEYS_ENV, ServeConfig, add_arguments, config_from_args, read_keys
from posttrain_core.serve.memory import GiB, gib

log = logging.getLogger("posttrain.serve")

READY = "posttrain serve: listening on"  # printed once every deployment runs (`ServiceProcess` waits for it)
DEFAULT_MEMORY_SHARE = 0.8  # of the memory this machine has free at start, when --memory-gb is not given


def _bases(config: ServeConfig, store) -> dict[str, dict]:
    """Each base model by its public name: `ref`, its artifact (a store artifact: a .gguf imported once,
    `latest:STAGE`, a key, which a worker on any node fetches from the store; or a local folder, which every node
    that runs a worker must have), `path`, a folder of its configs and tokenizer on this machine
    (`ArtifactStore.metadata_path`), and `check_model_path`'s facts."""
    from posttrain_core.models.build import stored_model
    from posttrain_core.models.gguf import import_gguf, is_gguf_path
    from posttrain_core.models.loading import check_model_path
    from posttrain_core.serve import checkpoints

    bases = {}
    for name, path in config.base_models.items():
        ref = import_gguf(path, store) if is_gguf_path(path) else stored_model(path, store, f"base_models.{name}")
        if ref is None:
            ref = checkpoints.base_ref(store, path)
        folder = str(store.metadata_path(ref))
        info = check_model_path(folder)
        if info["is_adapter"]:
            raise ValueError(f"base_models.{name}: {path} is an adapter; serve its base model")
        bases[name] = {"ref": ref, "path": folder, **info}
    return bases


def _here() -> dict[str, float]:
    """A Ray resource only the node of this process has: the gateway runs there, beside its journal."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    (ip,) = [n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node]
    return {f"node:{ip}": 0.001}


def memory_budget(config: ServeConfig) -> int:
    """Bytes for all the model workers together: `memory_gb`, else `DEFAULT_MEMORY_SHARE` of this machine's free
    memory, and never more than Ray offers (its `memory` resource, which the workers reserve).

    Raises:
        ValueError: `memory_gb` asks more than Ray offers (names both).
    """
    import psutil
    import ray

    offered = int(ray.available_resources().get("memory", 0))
    if config.memory_gb is not None:
        wanted = int(config.memory_gb * GiB)
        if wanted > offered:
            raise ValueError(
                f"memory_gb: --memory-gb {config.memory_gb:g} asks for {gib(wanted)} for the model workers, but this "
                f"Ray cluster offers {gib(offered)} of memory to tasks and actors now"
            )
        return wanted
    return min(int(DEFAULT_MEMORY_SHARE * psutil.virtual_memory().available), offered)


def start(config: ServeConfig) -> str:
    """Deploy the service on Ray Serve (starting local Ray if needed); returns its base URL once healthy."""
    from ray import serve

    from posttrain_core.artifacts import ArtifactStore
    from posttrain_core.cluster import connect
    from posttrain_core.serve.gateway import Gateway
    from posttrain_core.serve.worker import ModelWorker

    store = ArtifactStore(config.store)
    store.check_writable()
    keys = read_keys(config)
    config = config.model_copy(
        update=dict(
            store=store.root,
            state_dir=str(Path(config.state_dir or store.own_dir("serve")).resolve()),
            threads=config.threads or os.cpu_count(),
        )
    )
    bases = _bases(config, store)
    if keys is None:
        log.warning("no keys file or $%s: every tml- key is accepted as its own tenant", KEYS_ENV)
    connect()
    share = memory_budget(config) // len(config.base_models)
    # One HTTP proxy, on the head node: the service's address is the head's.
    serve.start(proxy_location="HeadOnly", http_options={"host": config.host, "port": config.port})
    # Queues are the gateway's own (bounded, 429 beyond). On Ctrl-C a replica gives its requests in flight 5 s, not
    # Serve's 20: a tenant's unsaved state is lost at a stop anyway, and saved states reload on the next start.
    options = {
        "max_ongoing_requests": 1_000_000,
        "graceful_shutdown_timeout_s": 5,
        "graceful_shutdown_wait_loop_s": 0.5,
    }
    workers = {
        name: serve.deployment(
            ModelWorker,
            name=f"model-{i}",
            ray_actor_options={"num_cpus": 0, "memory": share, "resources": config.worker_resources},
            **options,
        ).bind(name, base["ref"], config, share)
        for i, (name, base) in enumerate(bases.items())
    }
    # No per-request access log: every client heartbeats and long-polls; lifecycle events are logged instead.
    logging_config = {"enable_access_log": False, "log_level": "INFO"}
    gateway = Gateway.options(ray_actor_options={"num_cpus": 0, "resources": _here()}, **options)
    app = gateway.bind(config, keys, workers, bases)
    serve.run(app, name="posttrain", route_prefix="/", logging_config=logging_config)
    url = f"http://{config.host}:{config.port}"
    log.info(
        "posttrain serve: %s (bases: %s; store %s; %s of memory per model worker)",
        url, ", ".join(config.base_models), store.root, gib(share),
    )  # fmt: skip
    return url


def run_forever(config: ServeConfig) -> None:
    """Start the service and keep this process (which owns the local Ray) alive until interrupted."""
    url = start(config)
    print(f"{READY} {url} (TINKER_BASE_URL={url}); Ctrl-C stops", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        from ray import serve

        serve.shutdown()


def add_parser(sub) -> None:
    """`posttrain serve`: one flag per `ServeConfig` field (`--store` before or after `serve`)."""
    from posttrain_core.cli import add_subcommand

    parser = add_subcommand(
        sub,
        "serve",
        help="serve tinker-compatible LoRA training and sampling over HTTP (Ray Serve)",
        description="Serve tinker-compatible LoRA training and sampling of many tenants over HTTP (docs/serve.md).",
    )
    add_arguments(parser)


def main(args) -> None:
    """`posttrain serve ...` (parsed by `add_parser`)."""
    config = config_from_args(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        run_forever(config)
    except ValueError as e:  # a setting the machine or the models cannot honour, named
        raise SystemExit(f"posttrain serve: {e}") from None
