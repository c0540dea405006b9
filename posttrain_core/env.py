"""Process-wide defaults for the embedded (single machine, no network) setup.

Applied before Prefect, Ray, MLflow or transformers are imported; every value is only a default (`setdefault`), so a
user's environment always wins.
"""

from __future__ import annotations

import os

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


def apply_defaults() -> None:
    """Set the defaults above where the user has not set them.

    Prefect's task-result records (our cache records: small ArtifactRefs) go inside the default artifact store, so
    deleting the store deletes its cache records with it.
    """
    for name, value in DEFAULTS.items():
        os.environ.setdefault(name, value)
    store = os.path.abspath(os.environ.get("POSTTRAIN_STORE") or ".posttrain")
    os.environ.setdefault("PREFECT_RESULTS_LOCAL_STORAGE_PATH", os.path.join(store, "prefect-results"))
