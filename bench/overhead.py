"""Per-stage orchestration overhead: what a stage costs beyond its work, with and without Prefect.

Measured on the ephemeral Prefect API inside one flow run (its start-up is not counted), each a median of `reps`:
- a cached SFT stage: the core cache hit (`run_sft` on a key already published) and the Prefect task cache hit
  (the `sft` task called again with the same inputs);
- a trivial stage (its build writes a one-row dataset) through `run_stage` alone (key, lock, MLflow run, atomic
  publish, manifest) and through a Prefect task wrapping it (`tasks.common.stage_task`: cache key, persisted result,
  task run); every repetition is a fresh key;
- a bare Prefect task that returns at once: the floor of a task run.
A stage's MLflow records and Prefect result table are written in the background (`posttrain_core.tracking`); every
repetition starts once its predecessor's are written, and one row also times a trivial stage until its own are.
"""

from __future__ import annotations

import statistics
import time

from pydantic import BaseModel


class TrivialConfig(BaseModel):
    i: int
    tag: str = "bench"


STAGE = "bench_trivial"


def run_trivial(cfg: TrivialConfig, store):
    import pyarrow as pa

    from posttrain_core.data.io import write_dataset
    from posttrain_core.stage import StageOutput, run_stage

    def build(ctx):
        write_dataset(pa.table({"text": [f"row {cfg.i}"]}), "text", ctx.outdir)
        return StageOutput(manifest={}, metrics={})

    return run_stage(STAGE, cfg, {}, store, "dataset", build, schema_kind="text")


def measure(store, reps: int, datasets: dict, base, sft_cfg, s: dict) -> dict[str, float]:
    from prefect import flow, task

    from posttrain_core import tracking
    from posttrain_core.stage import key_for
    from posttrain_core.train.sft import run_sft
    from tasks.common import stage_task, store_at
    from tasks.train import sft as sft_task

    @stage_task(STAGE, lambda p, st: key_for(STAGE, p["cfg"], {}))
    def trivial_task(cfg: TrivialConfig, store_root: str | None = None):
        return run_trivial(cfg, store_at(store_root))

    @task
    def bare_task(i: int) -> int:
        return i

    n = s["sft_steps"] * s["global_batch"]
    data, _ = datasets[n]
    cfg = sft_cfg(n, 1, 0)  # published by the first SFT comparison run
    root = str(store.root)
    stamp = int(time.time() * 1000)

    def timed(fn, written: bool = False) -> float:
        """Median seconds of fn(i); the tracking records of each call are written before the next starts (outside
        the timer, unless `written`: then inside), so no call pays for its predecessor's records."""
        out = []
        for i in range(reps):
            tracking.flush()
            t0 = time.perf_counter()
            fn(i)
            if written:
                tracking.flush()
            out.append(time.perf_counter() - t0)
        return statistics.median(out)

    @flow(name="bench-overhead")
    def overhead_flow() -> dict[str, float]:
        sft_task(cfg, data, base, root)  # writes the Prefect cache record (the core stage is already cached)
        bare_task(-1)
        return {
            "cached SFT stage, core (run_sft, key already published)": timed(lambda i: run_sft(cfg, data, base, store)),
            "cached SFT stage, Prefect task cache hit": timed(lambda i: sft_task(cfg, data, base, root)),
            "trivial stage, core run_stage (key, lock, MLflow run, publish)": timed(
                lambda i: run_trivial(TrivialConfig(i=i, tag=f"core-{stamp}"), store)
            ),
            "  the same, until its MLflow records are written": timed(
                lambda i: run_trivial(TrivialConfig(i=i, tag=f"written-{stamp}"), store), written=True
            ),
            "trivial stage, through its Prefect task": timed(
                lambda i: trivial_task(TrivialConfig(i=i, tag=f"task-{stamp}"), root)
            ),
            "bare Prefect task (returns at once)": timed(lambda i: bare_task(i)),
        }

    return overhead_flow()
