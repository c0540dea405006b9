"""The work of one scheduler batch on a `LoraPool`: forward/backward of many requests (any adapters) in shared
passes, and sampling (the project's one decode loop, `rollout.hf_engine.decode`, with each row's adapter).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from posttrain_core.algorithms.losses import token_logprobs as logprobs_of
from posttrain_core.rollout.engine import SamplingSettings
from posttrain_core.rollout.hf_engine import decode, sample_seed
from posttrain_core.serve.adapters import LoraPool
from posttrain_core.serve.losses import token_losses
from posttrain_core.serve.wire import ForwardBackward


@dataclass
class _Row:
    job: int
    datum: int
    adapter: str
    tokens: list[int]


def _micro_batches(rows: list[_Row], max_tokens: int) -> list[list[_Row]]:
    """Consecutive rows whose padded size (rows x longest) stays within `max_tokens` (at least one row each)."""
    batches: list[list[_Row]] = []
    current: list[_Row] = []
    longest = 0
    for row in rows:
        grown = max(longest, len(row.tokens))
        if current and grown * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, grown = [], len(row.tokens)
        current.append(row)
        longest = grown
    return [*batches, current] if current else batches


def token_logprobs(pool: LoraPool, rows: list[_Row], targets: list[list[int]], pad_id: int) -> list[torch.Tensor]:
    """log p(target_t | tokens_<=t) of each row under its adapter, in one right-padded pass (grad as enabled)."""
    longest = max(len(r.tokens) for r in rows)
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r.tokens)] = torch.tensor(r.tokens)
        mask[i, : len(r.tokens)] = 1
    labels = torch.full((len(rows), longest), -100, dtype=torch.long)
    for i, target in enumerate(targets):
        labels[i, : len(target)] = torch.tensor(target)
    logits = pool.model(input_ids=ids, attention_mask=mask, adapter_names=[r.adapter for r in rows]).logits
    logp_B_T = logprobs_of(logits, labels)
    return [logp_B_T[i, : len(r.tokens)] for i, r in enumerate(rows)]


def forward_backward(
    pool: LoraPool, jobs: list[tuple[str, ForwardBackward]], pad_id: int, max_batch_tokens: int
) -> list[tuple[list[dict[str, np.ndarray]], dict[str, float]]]:
    """Run every job's datums (each on its own adapter) in shared micro-batches; gradients of the jobs that are not
    `forward_only` accumulate in their adapters until `optim_step`.

    Returns:
        Per job: per-datum outputs (`logprobs` and `elementwise_loss`, float32, one per input position) and its
        metrics (`loss:sum`).
    """
    pool.ensure([adapter for adapter, _ in jobs])
    rows = [
        _Row(j, d, adapter, datum.tokens) for j, (adapter, req) in enumerate(jobs) for d, datum in enumerate(req.data)
    ]
    outputs: list[list[dict[str, np.ndarray]]] = [[{} for _ in req.data] for _, req in jobs]
    totals = [0.0] * len(jobs)
    for batch in _micro_batches(rows, max_batch_tokens):
        datums = [jobs[r.job][1].data[r.datum] for r in batch]
        train = [not jobs[r.job][1].forward_only for r in batch]
        targets = [d.inputs["target_tokens"].astype(np.int64).tolist() for d in datums]
        with torch.set_grad_enabled(any(train)):
            logps = token_logprobs(pool, batch, targets, pad_id)
            losses = [
                token_losses(jobs[r.job][1].loss_fn, logp, d, jobs[r.job][1].loss_config)
                for r, logp, d in zip(batch, logps, datums, strict=True)
            ]
            trained = [loss.sum() for loss, t in zip(losses, train, strict=True) if t]
            if trained:
                torch.stack(trained).sum().backward()
        for r, logp, loss in zip(batch, logps, losses, strict=True):
            outputs[r.job][r.datum] = {
                "logprobs": logp.detach().numpy().astype(np.float32),
                "elementwise_loss": loss.detach().numpy().astype(np.float32),
            }
            totals[r.job] += float(loss.detach().sum())
    return [(outputs[j], {"loss:sum": totals[j]}) for j in range(len(jobs))]


@dataclass
class SampleJob:
    adapter: str
    prompt: list[int]
    n: int
    params: SamplingSettings  # n, seed and stop strings of the request; `n` here is unused
    seed: int | None
    stop_ids: tuple[int, ...] | None  # None: the base model's end-of-sequence tokens
    prompt_logprobs: bool


def sample(pool: LoraPool, tokenizer, pad_id: int, eos_ids: list[int], jobs: list[SampleJob]) -> list[dict]:
    """Every job's n samples; jobs with the same sampling settings share decode batches whatever their adapters.

    Returns:
        Per job: {"sequences": [{"tokens", "logprobs", "stop_reason"}], "prompt_logprobs": [None, ...] or None}.
        Log-probs are the raw model distribution's (temperature 1, no top-k/top-p), as the trainer computes them.
    """
    pool.ensure([j.adapter for j in jobs])
    results: list[dict] = [{"sequences": [], "prompt_logprobs": None} for _ in jobs]
    groups: dict[tuple, list[int]] = {}
    for i, job in enumerate(jobs):
        groups.setdefault((job.params, job.stop_ids), []).append(i)
    with torch.no_grad():
        for (params, stop_ids), members in groups.items():
            contexts, seeds, adapters, owners = [], [], [], []
            for i in members:
                job = jobs[i]
                base_seed = job.seed if job.seed is not None else random.getrandbits(62)
                for k in range(job.n):
                    contexts.append(job.prompt)
                    seeds.append(sample_seed(base_seed, "tinker", k))
                    adapters.append(job.adapter)
                    owners.append(i)
            stops = list(stop_ids) if stop_ids is not None else eos_ids
            outs = decode(pool.model, tokenizer, pad_id, stops, contexts, seeds, params, adapters=adapters)
            for owner, out in zip(owners, outs, strict=True):
                results[owner]["sequences"].append(
                    {"tokens": out["response_ids"], "logprobs": out["logprobs"], "stop_reason": out["finish_reason"]}
                )
        wanted = [i for i, job in enumerate(jobs) if job.prompt_logprobs]
        if wanted:
            rows = [_Row(i, 0, jobs[i].adapter, jobs[i].prompt[:-1] or jobs[i].prompt) for i in wanted]
            targets = [jobs[i].prompt[1:] or [] for i in wanted]
            logps = token_logprobs(pool, rows, [t or [0] for t in targets], pad_id)
            for i, target, logp in zip(wanted, targets, logps, strict=True):
                results[i]["prompt_logprobs"] = [None] + logp[: len(target)].tolist()
    return results
