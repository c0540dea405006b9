"""`posttrain serve` as a Prefect flow, so a work pool runs (and the UI starts, watches and cancels) the service.

The flow run lasts as long as the service: it starts `posttrain serve` in this process's Ray, logs where it
listens, then checks its health every minute; cancelling the flow run stops the service. Deployment:
`deployments/prefect.yaml` (`serve/tinker`).
    python -m flows.serve --base-model tiny=/models/tiny      # the same as `posttrain serve ...`
"""

from __future__ import annotations

import time
import urllib.request

from prefect import flow, get_run_logger

from posttrain_core.serve.app import start
from posttrain_core.serve.config import ServeConfig


@flow(name="serve", log_prints=True)
def serve_flow(config: ServeConfig, check_every_s: float = 60.0, stop_after_s: float | None = None) -> str:
    """Run the service until the flow run is cancelled (or `stop_after_s` passes); returns its URL."""
    from ray import serve

    logger = get_run_logger()
    url = start(config)
    logger.info("posttrain serve is up: TINKER_BASE_URL=%s (bases: %s)", url, ", ".join(config.base_models))
    started = time.monotonic()
    try:
        while stop_after_s is None or time.monotonic() - started < stop_after_s:
            time.sleep(check_every_s if stop_after_s is None else min(check_every_s, stop_after_s))
            with urllib.request.urlopen(url + "/api/v1/healthz", timeout=30) as r:
                if r.status != 200:
                    raise RuntimeError(f"posttrain serve at {url} is unhealthy (HTTP {r.status})")
    finally:  # the end of the service window, a cancellation or a failure: the service goes with the flow run
        serve.shutdown()
        logger.info("posttrain serve at %s stopped", url)
    return url


if __name__ == "__main__":
    import sys

    from flows.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
