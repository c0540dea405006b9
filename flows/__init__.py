"""Prefect flows: each composes stages into a pipeline and reads like the plan."""

from posttrain_core.env import apply_defaults

apply_defaults()
