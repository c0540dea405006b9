"""The environment variables posttrain reads (`SETTINGS`, documented in docs/operations.md), and the process defaults
it sets for the embedded, offline setup (`DEFAULTS`; a user's own value always wins).

None of them selects a code path or changes a result: what can change a number is a config field, and so part of a
stage key. Every read goes through `setting(name)`; a test holds the code to this list.
"""

from __future__ import annotations

import os

SETTINGS: dict[str, str] = {
    "POSTTRAIN_STORE": "the artifact store when a config names none (a folder or fsspec URI; default ./.posttrain)",
    "POSTTRAIN_CODE_VERSION": "pins the code version in every stage key (default: package version + a hash of "
    "posttrain_core/**/*.py), e.g. for a deployment whose store should survive edits that change no result",
    "POSTTRAIN_VLLM_PYTHON": "the python of the vLLM environment when RolloutConfig.vllm_python is empty "
    "(default .venv-vllm/bin/python)",
    "POSTTRAIN_MLFLOW_UI": "the MLflow UI address the Prefect flow runs link to (default http://127.0.0.1:5000)",
    "MLFLOW_TRACKING_URI": "the MLflow tracking server (default: a SQLite file in the local store root)",
    "RAY_ADDRESS": "the Ray cluster to join (default: start one on this machine)",
    "POSTTRAIN_SERVE_KEYS": "`posttrain serve`'s API keys when no keys file is given: 'tml-a=alice,tml-b=bob' (default: "
    "any tml- key is its own tenant)",
    "POSTTRAIN_CACHE_DIR": "this machine's folder for a remote store's downloaded artifacts and staging, on the flow's "
    "machine and on every Ray node (default ~/.cache/posttrain)",
    "POSTTRAIN_CACHE_GB": "the bound of this machine's cache of a remote store's artifacts, in GiB (default 100)",
}

DEFAULTS = {
    # Prefect: no telemetry (no network here), and room for a cold ephemeral-API start (migrations take ~20 s).
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
    "PREFECT_LOGGING_LEVEL": "INFO",
    # posttrain_core's own progress lines (stage built or cached, waits, engine loads) in the flow-run logs and the UI.
    "PREFECT_LOGGING_EXTRA_LOGGERS": "posttrain_core",
    # ... and no warning per line when core code runs outside a flow run (the core is usable without Prefect).
    "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
    # Ray: no usage stats, no auth token written into $HOME, fewer background threads.
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_DEDUP_LOGS": "0",
    # MLflow / Hugging Face: offline, quiet.
    "MLFLOW_DISABLE_TELEMETRY": "1",
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false",
}

# The environment of a vLLM engine process (set before vLLM is imported); a value in the driver's environment wins.
ENGINE_DEFAULTS: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",  # model folders are local; never reach for a hub
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # vLLM's INFO start-up lines (a config dump per engine) would flood the driver's log through Ray.
    "VLLM_LOGGING_LEVEL": "WARNING",
    # GiB of KV cache on CPU: vLLM's default sizing fails on small machines; 1 GiB holds ~2M tokens of a tiny model.
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # The engine core in the actor's own process: engine init ~4-9 s instead of 25-45 s, one process instead of two.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


def setting(name: str) -> str | None:
    """The value of one of `SETTINGS` in this process's environment (None or empty: unset)."""
    if name not in SETTINGS:
        raise KeyError(f"{name} is not one of posttrain's settings ({', '.join(SETTINGS)})")
    return os.environ.get(name) or None


def default_store() -> str:
    """The store root when a config names none: $POSTTRAIN_STORE, else ./.posttrain."""
    return setting("POSTTRAIN_STORE") or "./.posttrain"


def results_path(store_root: str) -> str:
    """Where Prefect keeps its task-result records (our cache records) for a local store: inside it, so deleting
    the store deletes them too."""
    return os.path.join(os.path.abspath(store_root.removeprefix("file://")), "prefect-results")


def apply_defaults() -> None:
    """Set `DEFAULTS` where the user has not, and put Prefect's task-result records in the default store."""
    for name, value in DEFAULTS.items():
        os.environ.setdefault(name, value)
    os.environ.setdefault("PREFECT_RESULTS_LOCAL_STORAGE_PATH", results_path(default_store()))


def engine_environment() -> dict[str, str]:
    """`ENGINE_DEFAULTS`, with the values this process's environment sets for those names instead."""
    return {name: os.environ.get(name, default) for name, default in ENGINE_DEFAULTS.items()}


def own_ray_environment() -> dict[str, str]:
    """This process's environment for a child that must start its own local Ray (`posttrain serve` under the tests
    and the benchmark): without `RAY_ADDRESS`, so that its actors live and die with it, not with the parent's Ray."""
    return {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}


def apply_engine_defaults() -> None:
    """Set `ENGINE_DEFAULTS` in a vLLM engine's process where its environment has not (before vLLM is imported)."""
    for name, value in ENGINE_DEFAULTS.items():
        os.environ.setdefault(name, value)


def use_results_path(store_root: str) -> None:
    """Keep Prefect's task-result records in `store_root` (a local store a flow run was given), unless the user set
    their place; must run before Prefect is imported to take effect."""
    if "://" in store_root and not store_root.startswith("file://"):
        return
    if os.environ.get("PREFECT_RESULTS_LOCAL_STORAGE_PATH") in (None, results_path(default_store())):
        os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = results_path(store_root)
