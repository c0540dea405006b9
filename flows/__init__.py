"""Prefect flows: each composes stages into a pipeline and reads like the plan."""

import logging

from posttrain_core.env import apply_defaults

apply_defaults()
# The core's progress lines (stage built / cache hit / waiting for a concurrent run, engine loads) reach the flow-run
# logs and the UI through PREFECT_LOGGING_EXTRA_LOGGERS (env.DEFAULTS); the logger's level lets INFO through.
logging.getLogger("posttrain_core").setLevel(logging.INFO)
