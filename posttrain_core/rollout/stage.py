"""The rollout stage: n samples per prompt from a policy, on a pool of engine actors fed by Ray Data.

Publishes a `rollouts` dataset (one row per sample, with the engine's log-probs). `engine="hf"` runs `HFEngine`;
`engine="vllm"` runs `posttrain_core.rollout.vllm_engine.VLLMEngine` inside the vLLM environment (Ray runtime_env).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from posttrain_core.rollout.engine import SamplingSettings

if TYPE_CHECKING:  # this module is imported inside vLLM actors too: keep its imports light
    from posttrain_core.artifacts import ArtifactRef, ArtifactStore
    from posttrain_core.config import RolloutConfig

log = logging.getLogger(__name__)

STAGE = "rollout"
PENDING = "pending:"  # rows generated with an update's weights before its artifact (and digest) existed
_SECONDS = "_engine_seconds"  # per-row share of its batch's engine time; dropped before writing


def sampling_settings(cfg: RolloutConfig) -> SamplingSettings:
    """The plain, picklable sampling parameters of a rollout config."""
    return SamplingSettings(
        n=cfg.n,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        max_tokens=cfg.max_tokens,
        stop=tuple(cfg.stop),
        seed=cfg.seed,
    )


class RolloutWorker:
    """The Ray Data callable class: one engine per actor; a batch of prompt rows -> their rollout rows.

    Besides the `rollouts` columns it keeps each prompt's `messages` (reward models re-render the chat with their
    own template) and adds `_engine_seconds` for the stage's throughput metric.
    """

    def __init__(
        self,
        engine: str,
        model_path: str,
        policy_digest: str,
        params: SamplingSettings,
        dtype: str = "float32",
        num_threads: int | None = None,
    ):
        from posttrain_core.cluster import keep_freed_memory

        self.kind, self.dtype, self.params = engine, dtype, params
        keep_freed_memory()
        if engine == "hf" and num_threads:
            import torch

            torch.set_num_threads(num_threads)
        self.engine = self._new_engine(model_path, policy_digest)
        self.policy_digest = policy_digest

    def _new_engine(self, model_path: str, policy_digest: str):
        if self.kind == "hf":
            from posttrain_core.rollout.hf_engine import HFEngine

            return HFEngine(model_path, dtype=self.dtype, policy_digest=policy_digest)
        from posttrain_core.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, dtype=self.dtype, seed=self.params.seed, policy_digest=policy_digest)

    def load(self, model_path: str, policy_digest: str) -> str:
        """Serve another policy (a warm actor between rollout stages, `posttrain_core.rollout.warm`).

        Returns:
            "kept" (already serving it), "updated" (vLLM in-place weight update or adapter swap) or "reloaded" (a new
            engine in this process: the hf engine, or a vLLM engine that must change between full model and LoRA).
        """
        from posttrain_core.models.loading import check_model_path

        if policy_digest == self.policy_digest:
            return "kept"
        if self.kind == "vllm" and (self.engine.enable_lora or not check_model_path(model_path)["is_adapter"]):
            self.engine.update_weights(model_path, policy_digest)
            action = "updated"
        else:
            if hasattr(self.engine, "close"):
                self.engine.close()
            self.engine = None  # the old weights are freed before the new ones load
            self.engine = self._new_engine(model_path, policy_digest)
            action = "reloaded"
        self.policy_digest = policy_digest
        return action

    def take_weights(self, weights: dict, key: str) -> str:
        """Serve the weights of the update that will publish artifact `key`, before it is published (hf engine, full
        model). Until `adopt` names the artifact's digest, rows are stamped `pending:<key>`, which no published
        policy's digest equals, so they can only be used by `adopt`'s caller. Returns the stamp."""
        if self.kind != "hf" or weights is None:
            raise ValueError(
                f"take_weights: no in-memory weights for the {self.kind} engine (a LoRA or non-fp32 policy)"
            )
        self.policy_digest = None  # if the copy fails half-way, no policy is claimed for the weights
        self.engine.load_weights(weights, PENDING + key)
        self.policy_digest = PENDING + key
        return self.policy_digest

    def adopt(self, key: str, policy_digest: str) -> bool:
        """The update's artifact `key` was published with `policy_digest`: serve it under that digest (True), if
        these are still that update's weights (else False: a later load replaced them)."""
        if self.policy_digest != PENDING + key:
            return False
        self.policy_digest = policy_digest
        return True

    def served_digest(self) -> str:
        """The digest of the policy this actor's engine holds (what its rows will record)."""
        return self.policy_digest

    def __call__(self, batch: pa.Table) -> pa.Table:
        return self.generate(batch)

    def generate(self, batch: pa.Table, params: SamplingSettings | None = None) -> pa.Table:
        started = time.perf_counter()
        out = self.engine.generate(batch, params or self.params)
        seconds = time.perf_counter() - started
        n = out.num_rows
        # The stage, not each engine, stamps the policy: every backend's rows then name the same artifact.
        out = out.set_column(
            out.schema.get_field_index("policy_digest"), "policy_digest", pa.array([self.policy_digest] * n)
        )
        row_of = {pid: i for i, pid in enumerate(batch.column("prompt_id").to_pylist())}
        index = pa.array([row_of[pid] for pid in out.column("prompt_id").to_pylist()], pa.int64())
        out = out.append_column("messages", batch.column("messages").take(index))
        return out.append_column(_SECONDS, pa.array([seconds / max(n, 1)] * n, pa.float64()))


def prompts_per_call(cfg: RolloutConfig, n_prompts: int) -> int:
    """Prompts per engine call: `cfg.batch_size`, or fewer when that would leave engines idle.

    With 8 prompts, batch_size 32 and 2 engines, one call of 8 would keep the second engine idle and the first
    generating for both; two calls of 4 finish in about half the time. The samples do not depend on it (each draws
    from its own seeded stream), up to the float rounding that a batch's padding can change (see `HFEngine`).
    """
    return max(1, min(cfg.batch_size, -(-n_prompts // cfg.num_engines)))


def _keep_prompts(batch: pa.Table, ids: list[str]) -> pa.Table:
    import pyarrow.compute as pc

    return batch.filter(pc.is_in(batch.column("prompt_id"), value_set=pa.array(ids, pa.string())))


def _dataset_files(store: ArtifactStore, ref: ArtifactRef) -> list[str]:
    """Parquet files of a dataset artifact as paths Ray workers can open (local paths, or URIs of a remote store)."""
    from posttrain_core.data.io import parquet_files

    if "://" in ref.uri:
        scheme = ref.uri.split("://", 1)[0]
        return [f"{scheme}://{f}" for f in parquet_files(ref.uri)]
    return parquet_files(store.local_path(ref))


def vllm_options(cfg: RolloutConfig) -> dict[str, Any]:
    """Ray actor options of a vLLM engine (runtime_env into the vLLM venv); a clear error when it is missing."""
    hint = (
        "set RolloutConfig.vllm_python (or $POSTTRAIN_VLLM_PYTHON) to the python of the vLLM environment "
        "(README 'vLLM' creates .venv-vllm), or use RolloutConfig.engine='hf'"
    )
    try:
        from posttrain_core.rollout.vllm_engine import vllm_actor_options
    except ImportError as err:
        raise ValueError(
            f"RolloutConfig.engine='vllm': posttrain_core.rollout.vllm_engine is unavailable ({err}); {hint}"
        ) from None
    try:
        options = dict(vllm_actor_options(cfg))
    except (OSError, ValueError, RuntimeError) as err:
        raise ValueError(f"RolloutConfig.engine='vllm': the vLLM environment is not usable ({err}); {hint}") from None
    python = (options.get("runtime_env") or {}).get("py_executable")
    if python and not Path(python).exists():
        raise ValueError(f"RolloutConfig.engine='vllm': the vLLM python '{python}' does not exist; {hint}")
    return options


def select_prompts(cfg: RolloutConfig, prompts: ArtifactRef, store: ArtifactStore) -> pa.Table:
    """The prompt rows a rollout samples: `cfg.families` only, then the window of `max_prompts` from `prompt_start`.

    Raises:
        ValueError: a column missing (SchemaError), duplicated prompt ids, or no prompts left.
    """
    from posttrain_core.data.io import read_dataset

    table = read_dataset(store.local_path(prompts), "prompts")  # a missing/bad `messages` column fails here
    ids = table.column("prompt_id").to_pylist()
    if len(set(ids)) != len(ids):
        seen: set[str] = set()
        dup = next(i for i in ids if i in seen or seen.add(i))
        raise ValueError(f"{STAGE}: {prompts.uri}: prompt_id {dup!r} appears more than once (samples are keyed by it)")
    if cfg.families:
        families = [(json.loads(m) if m else {}).get("family") for m in table.column("meta").to_pylist()]
        table = table.filter(pa.array([f in cfg.families for f in families], pa.bool_()))
        if table.num_rows == 0:
            raise ValueError(f"{STAGE}: {prompts.uri} has no prompt whose meta.family is one of {cfg.families}")
    if table.num_rows == 0:
        raise ValueError(f"{STAGE}: {prompts.uri} holds no prompts")
    if cfg.max_prompts or cfg.prompt_start:
        n = min(cfg.max_prompts or table.num_rows, table.num_rows)
        table = table.take([(cfg.prompt_start + i) % table.num_rows for i in range(n)])
    return table


_TOKENIZERS: dict[str, Any] = {}  # sha256 of a folder's tokenizer files -> the tokenizer loaded from them
_TOKENIZER_PREFIXES = ("tokenizer", "special_tokens", "added_tokens", "chat_template", "vocab", "merges")


def _prompt_lengths(policy_path: Path, table: pa.Table) -> list[int]:
    """Token counts of `table`'s rendered prompts with the policy's tokenizer.

    The tokenizer is remembered per bytes of the folder's tokenizer files: every RL iteration checks its prompts
    against a new policy folder whose tokenizer files are the same bytes, and loading it took ~15 ms of each
    iteration's critical path. Used read-only. A folder without tokenizer files (a LoRA adapter saved without one)
    loads its tokenizer every time.
    """
    from posttrain_core.data.chat import tokenize_prompt
    from posttrain_core.models.loading import load_tokenizer

    files = sorted(p for p in Path(policy_path).iterdir() if p.is_file() and p.name.startswith(_TOKENIZER_PREFIXES))
    key = None
    if files:
        h = hashlib.sha256()
        for f in files:
            h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
        key = h.hexdigest()
    tokenizer = _TOKENIZERS.get(key) if key else None
    if tokenizer is None:
        tokenizer = load_tokenizer(policy_path, require_chat_template=True)
        if key is not None:
            if len(_TOKENIZERS) >= 4:
                _TOKENIZERS.pop(next(iter(_TOKENIZERS)))
            _TOKENIZERS[key] = tokenizer
    return [len(tokenize_prompt(tokenizer, m)) for m in table.column("messages").to_pylist()]


def engine_batches(cfg: RolloutConfig, table: pa.Table) -> list[pa.Table]:
    """The prompt batches a warm pool's engines get (`prompts_per_call` rows each)."""
    rows = table.select(["prompt_id", "messages", "answer"])
    per_call = prompts_per_call(cfg, rows.num_rows)
    return [rows.slice(i, per_call) for i in range(0, rows.num_rows, per_call)]


def check_rollout_inputs(
    cfg: RolloutConfig, prompts: ArtifactRef, policy: ArtifactRef, store: ArtifactStore
) -> pa.Table:
    """Everything that can be checked before Ray starts; returns the prompt rows to sample (after max_prompts).

    Raises:
        ValueError: not a `prompts` dataset, a column missing (SchemaError), duplicated prompt ids, no prompts, the
            longest prompt + max_tokens beyond the model's context, or engine="vllm" without its environment.
        FileNotFoundError: the policy folder is missing.
    """
    from posttrain_core.models.loading import check_model_path

    if prompts.kind != "dataset" or prompts.schema_kind != "prompts":
        raise ValueError(
            f"{STAGE}: input 'prompts' must be a 'prompts' dataset (prompt_id, messages, answer, meta), got "
            f"{prompts.kind} '{prompts.schema_kind}' at {prompts.uri}"
        )
    if policy.kind != "model":
        raise ValueError(f"{STAGE}: input 'policy' must be a model, got a {policy.kind} at {policy.uri}")
    policy_path = store.local_path(policy)
    info = check_model_path(policy_path)
    table = select_prompts(cfg, prompts, store)
    ids = table.column("prompt_id").to_pylist()
    context = info.get("max_position_embeddings")
    if context:
        lengths = _prompt_lengths(policy_path, table)
        longest = max(lengths)
        if longest + cfg.max_tokens > context:
            row = lengths.index(longest)
            raise ValueError(
                f"{STAGE}: RolloutConfig.max_tokens ({cfg.max_tokens}) + the longest prompt ({longest} tokens, "
                f"prompt_id {ids[row]!r}) = {longest + cfg.max_tokens} exceeds the model's context "
                f"(max_position_embeddings={context}); lower max_tokens to at most {context - longest}"
            )
    if cfg.engine == "vllm":
        vllm_options(cfg)
    return table


def _engine_resources(cfg: RolloutConfig) -> dict[str, Any]:
    """Ray options of one engine actor (vLLM: its runtime_env into the vLLM environment).

    Ray Data's read tasks need a CPU of their own: an actor pool holding every CPU deadlocks the pipeline (seen on
    a 2-CPU machine with 2 one-CPU actors), so on a small cluster each engine asks for a share of (CPUs - 1).
    """
    import ray

    cpus = float(ray.cluster_resources().get("CPU", 1))
    share = max(0.1, min(1.0, (cpus - 1) / cfg.num_engines))
    if cfg.engine == "vllm":
        options = vllm_options(cfg)
        options["num_cpus"] = min(float(options.get("num_cpus", 1.0)), share)
        return options
    return {"num_cpus": share}


def _check_counts(table: pa.Table, ids: list[str], n: int) -> None:
    got: dict[str, list[int]] = {}
    for pid, k in zip(table.column("prompt_id").to_pylist(), table.column("sample_index").to_pylist(), strict=True):
        got.setdefault(pid, []).append(k)
    for pid in ids:
        if sorted(got.get(pid, [])) != list(range(n)):
            raise RuntimeError(
                f"{STAGE}: prompt {pid!r} has samples {sorted(got.get(pid, []))}, expected 0..{n - 1} "
                "(an engine dropped or duplicated rows)"
            )
    extra = set(got) - set(ids)
    if extra:
        raise RuntimeError(f"{STAGE}: rollouts for prompts that were not asked for: {sorted(extra)[:5]}")


def _check_policy(table: pa.Table, policy: ArtifactRef) -> None:
    """Every row must come from `policy`: an engine still holding older weights would poison the RL update."""
    import pyarrow.compute as pc

    stale = table.filter(pc.not_equal(table.column("policy_digest"), policy.digest))
    if stale.num_rows:
        raise RuntimeError(
            f"{STAGE}: {stale.num_rows} samples (first: prompt {stale.column('prompt_id')[0].as_py()!r}) were "
            f"generated with policy digest {stale.column('policy_digest')[0].as_py()!r}, not {policy.digest!r}; "
            "nothing is published"
        )


def run_rollout(
    cfg: RolloutConfig,
    prompts: ArtifactRef,
    policy: ArtifactRef,
    store: ArtifactStore,
    engines: str | None = None,
) -> ArtifactRef:
    """Sample `cfg.n` responses to every prompt with `policy`; publish them as a `rollouts` dataset.

    Without `engines`, Ray Data reads the prompts' parquet files, cuts them into blocks of `prompts_per_call` prompts
    and streams them through an actor pool of `cfg.num_engines` engines (`RolloutWorker`) that lives for this stage.
    With `engines` (a pool name, `posttrain_core.rollout.warm`), the pool's long-lived actors take the policy's
    weights (vLLM: in place) and the driver hands them batches of `prompts_per_call` prompts. Either way the driver
    checks that every prompt got exactly n samples from the right policy, sorts them by (prompt order,
    sample_index) and writes them; both paths give the same rows (each sample has its own seeded stream).

    With a warm pool, the previous RL update may already have started this stage's generation with its weights in
    memory (`prefetch_rollout`); the stage then takes those rows, after checking that the update's artifact is this
    stage's policy and that the prompt batches and sampling settings are its own (otherwise it generates anew).

    Manifest metrics: samples, prompts, tokens, tokens_per_s (generated tokens per second of the pool while its
    engines generate: tokens / (engine-seconds / num_engines)), wall_tokens_per_s (tokens / wall time of the whole
    Ray execution, actor start-up or weight loading and model loading included), response_len_mean / _max (tokens),
    finish_length_rate, with a warm pool engine_load_s (the weight update), and for prefetched rows
    generate_overlap_s (engine time spent before this stage asked for the rows); the manifest's `engine_load` says
    how the engines got the weights (started, updated, reloaded, kept, prefetched; "stage" without a pool).

    Args:
        cfg: sampling settings and the engine pool.
        prompts: a `prompts` dataset.
        policy: a model (full or LoRA adapter folder).
        store: the artifact store.
        engines: name of a warm engine pool of this process, or None for actors that live for this stage only.
    """
    from posttrain_core.stage import StageContext, StageOutput, run_stage

    table = check_rollout_inputs(cfg, prompts, policy, store)
    ids = table.column("prompt_id").to_pylist()
    params = sampling_settings(cfg)
    model_path = str(store.local_path(policy))
    per_call = prompts_per_call(cfg, len(ids))

    def generate_on_stage_actors() -> list[pa.Table]:
        import ray

        ds = ray.data.read_parquet(_dataset_files(store, prompts), columns=["prompt_id", "messages", "answer"])
        if cfg.max_prompts or cfg.families:
            ds = ds.map_batches(_keep_prompts, fn_kwargs={"ids": ids}, batch_format="pyarrow")
        # Blocks of per_call prompts, so that the pool's actors share the work even with one parquet file.
        ds = ds.repartition(target_num_rows_per_block=per_call)
        ds = ds.map_batches(
            RolloutWorker,
            fn_constructor_kwargs=dict(
                engine=cfg.engine,
                model_path=model_path,
                policy_digest=policy.digest,
                params=params,
                dtype=cfg.dtype,
                num_threads=max(1, (os.cpu_count() or 1) // cfg.num_engines),
            ),
            compute=ray.data.ActorPoolStrategy(size=cfg.num_engines),
            batch_size=per_call,
            batch_format="pyarrow",
            **_engine_resources(cfg),
        )
        return ray.get(ds.to_arrow_refs())

    def build(ctx: StageContext) -> StageOutput:
        from posttrain_core.cluster import connect
        from posttrain_core.data.io import write_dataset

        connect()
        started = time.perf_counter()
        load: dict[str, Any] = {"action": "stage"}
        if engines is None:
            parts = generate_on_stage_actors()
        else:
            from posttrain_core.rollout.warm import get_pool

            pool = get_pool(engines)
            with pool.lock:
                load = pool.load(cfg, model_path, policy.digest, params, key=policy.key)
                started_generate = time.perf_counter()
                parts = pool.generate(engine_batches(cfg, table), params)
                waited = time.perf_counter() - started_generate
        parts = [t for t in parts if t.num_rows]
        wall = time.perf_counter() - started
        out = pa.concat_tables(parts)
        _check_counts(out, ids, cfg.n)
        _check_policy(out, policy)
        order = {pid: i for i, pid in enumerate(ids)}
        out = out.append_column("_order", pa.array([order[p] for p in out.column("prompt_id").to_pylist()], pa.int64()))
        out = out.sort_by([("_order", "ascending"), ("sample_index", "ascending")])
        engine_seconds = sum(out.column(_SECONDS).to_pylist())
        out = out.drop_columns(["_order", _SECONDS])
        write_dataset(out, "rollouts", ctx.outdir)

        lengths = [len(x) for x in out.column("response_ids").to_pylist()]
        tokens = sum(lengths)
        metrics = {
            "samples": float(out.num_rows),
            "prompts": float(len(ids)),
            "tokens": float(tokens),
            "tokens_per_s": tokens / max(engine_seconds / cfg.num_engines, 1e-9),
            "wall_tokens_per_s": tokens / max(wall, 1e-9),
            "response_len_mean": tokens / len(lengths),
            "response_len_max": float(max(lengths)),
            "finish_length_rate": out.column("finish_reason").to_pylist().count("length") / out.num_rows,
        }
        if "load_s" in load:
            metrics["engine_load_s"] = load["load_s"]
        if load["action"] == "prefetched":  # generation that ran before this stage, beside the update's publish
            metrics["generate_overlap_s"] = max(0.0, engine_seconds / cfg.num_engines - waited)
        log.info(
            "%s: %d samples of %d prompts, %.0f tokens/s (%.0f with start-up), mean length %.1f",
            STAGE,
            out.num_rows,
            len(ids),
            metrics["tokens_per_s"],
            metrics["wall_tokens_per_s"],
            metrics["response_len_mean"],
        )
        manifest = {
            "policy": policy.uri,
            "engine": cfg.engine,
            "engine_load": load["action"],
            "num_prompts": len(ids),
            "num_samples": out.num_rows,
        }
        return StageOutput(manifest=manifest, metrics=metrics)

    return run_stage(STAGE, cfg, rollout_inputs(prompts, policy), store, "dataset", build, schema_kind="rollouts")


def prefetch_rollout(
    cfg: RolloutConfig,
    prompts: ArtifactRef,
    serving: ArtifactRef,
    key: str,
    weights: Callable[[], Any],
    store: ArtifactStore,
    engines: str,
) -> bool:
    """Start the rollout stage `cfg` of the next policy on a warm pool, with that policy's weights in memory, while
    the RL update that made them still saves and publishes its artifact `key`.

    The rollout stage of the published policy then takes the rows (`EnginePool.generate`) instead of generating,
    so the checkpoint's write, flush and digest overlap generation instead of preceding it. Only for the hf engine
    on full (non-LoRA) models whose pool serves `serving` (the update's input policy: same architecture and
    tokenizer); returns False when it does not apply, and nothing changes then.

    Args:
        weights: returns a Ray object ref of the new policy's state dict (`RLWorker.policy_weights`); called only
            when the prefetch applies.
    """
    from posttrain_core.models.loading import check_model_path
    from posttrain_core.rollout.warm import get_pool

    if cfg.engine != "hf" or check_model_path(store.local_path(serving))["is_adapter"]:
        return False
    batches = engine_batches(cfg, select_prompts(cfg, prompts, store))
    return get_pool(engines).prefetch(cfg, weights, key, batches, sampling_settings(cfg), serving=serving.digest)


def rollout_inputs(prompts: ArtifactRef, policy: ArtifactRef) -> dict[str, ArtifactRef]:
    """The stage's named inputs (part of its key; the Prefect task's cache key uses the same)."""
    return {"prompts": prompts, "policy": policy}
