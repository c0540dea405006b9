"""Prefect tasks, one module per stage kind: cache key, retries, logging and Prefect artifacts around a core stage."""

from posttrain_core.env import apply_defaults

apply_defaults()
