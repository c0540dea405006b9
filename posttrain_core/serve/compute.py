"""The work of one scheduler batch on a `LoraPool`: forward/backward of many requests and their samples, each
adapter's rows in passes of their own (`LoraPool.active`), every pass and decode batch sized to the worker's memory
budget (`Budget`). Sampling is the project's one decode loop, `rollout.hf_engine.decode`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from posttrain_core.models.heads import TokenLogprobs
from posttrain_core.rollout.engine import SamplingSettings
from posttrain_core.rollout.hf_engine import decode, sample_seed
from posttrain_core.serve.adapters import LoraPool
from posttrain_core.serve.losses import inputs_B_T, request_loss
from posttrain_core.serve.memory import RESERVE, Shape, gib, pass_bytes, sample_bytes
from posttrain_core.serve.wire import ForwardBackward, UserError


@dataclass(frozen=True)
class Budget:
    """A worker's memory: `total` bytes in all, `base` of them taken by the process with its model loaded."""

    total: int
    base: int
    shape: Shape

    def room(self, pool: LoraPool) -> int:
        """Bytes one pass may take now: what the resident adapters and `RESERVE` leave."""
        return self.total - self.base - pool.resident_bytes() - RESERVE

    def room_alone(self, pool: LoraPool, adapter: str) -> int:
        """Bytes one pass may take with `adapter` the only one resident (the others evicted to make room)."""
        return self.total - self.base - pool.adapter_bytes(adapter) - RESERVE

    def check(self, what: str, need: int, pool: LoraPool, adapter: str) -> None:
        """Refuse work that cannot fit one pass even with every other adapter evicted.

        Raises:
            UserError: names `what`, what it needs and what the budget leaves.
        """
        room = self.room_alone(pool, adapter)
        if need > room:
            raise UserError(
                f"{what} needs ~{gib(need)} of memory in one pass; this worker's budget leaves {gib(room)} per pass "
                f"(of {gib(self.total)}: posttrain serve --memory-gb)"
            )


@dataclass
class _Row:
    job: int
    datum: int
    adapter: str
    tokens: list[int]


def _by_adapter(rows: list[_Row]) -> dict[str, list[_Row]]:
    """The rows of each adapter, in order of first appearance."""
    groups: dict[str, list[_Row]] = {}
    for row in rows:
        groups.setdefault(row.adapter, []).append(row)
    return groups


def _passes(rows: list[_Row], budget: Budget, pool: LoraPool) -> list[list[_Row]]:
    """One adapter's rows, shortest first, cut into passes that each fit the budget's room (evicting other adapters
    if the longest row alone does not fit).

    Raises:
        UserError: a row that cannot fit alone.
    """
    order = sorted(rows, key=lambda r: len(r.tokens))
    if not order:
        return []
    adapter = order[0].adapter
    rank = pool.adapters[adapter].lora.r if adapter in pool.adapters else 0
    longest = len(order[-1].tokens)
    need = pass_bytes(budget.shape, 1, longest, rank)
    if not pool.free(need, {adapter}, lambda: budget.room(pool)):
        raise UserError(
            f"a datum of {longest} tokens needs ~{gib(need)} of memory in one pass, and this worker's budget leaves "
            f"{gib(budget.room(pool))}"
        )
    room = budget.room(pool)
    passes: list[list[_Row]] = [[]]
    for row in order:  # sorted: the row joining a pass is its longest
        if passes[-1] and pass_bytes(budget.shape, len(passes[-1]) + 1, len(row.tokens), rank) > room:
            passes.append([])
        passes[-1].append(row)
    return passes


def _logprobs(net: TokenLogprobs, rows: list[_Row], targets: list, pad_id: int) -> list[torch.Tensor]:
    """log p(target_t | tokens_<=t) of each row, in one right-padded pass of the active adapter (grad as enabled)."""
    longest = max(len(r.tokens) for r in rows)
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r.tokens)] = torch.tensor(r.tokens)
        mask[i, : len(r.tokens)] = 1
    labels = torch.cat([torch.as_tensor(t, dtype=torch.long) for t in targets])
    logp_N = net(ids, mask, mask.bool(), labels).logp
    return list(logp_N.split([len(r.tokens) for r in rows]))


def forward_backward(
    pool: LoraPool, net: TokenLogprobs, jobs: list[tuple[str, ForwardBackward]], pad_id: int, budget: Budget
) -> tuple[list[tuple[list[dict[str, np.ndarray]], dict[str, float]]], int]:
    """Run every job's datums, each adapter's in passes of their own; gradients of the jobs that are not
    `forward_only` accumulate in their adapters until `optim_step`.

    Returns:
        Per job: per-datum outputs (`logprobs`, float32, one per input position) and its metrics (`loss:sum`); and
        the number of passes run.
    """
    rows = [
        _Row(j, d, adapter, datum.tokens) for j, (adapter, req) in enumerate(jobs) for d, datum in enumerate(req.data)
    ]
    outputs: list[list[dict[str, np.ndarray]]] = [[{} for _ in req.data] for _, req in jobs]
    totals = [0.0] * len(jobs)
    count = 0
    for adapter, mine in _by_adapter(rows).items():
        pool.ensure([adapter])
        with pool.active(adapter):
            for batch in _passes(mine, budget, pool):
                count += 1
                _train(net, batch, jobs, pad_id, outputs, totals)
    return [(outputs[j], {"loss:sum": totals[j]}) for j in range(len(jobs))], count


def _train(net: TokenLogprobs, batch: list[_Row], jobs: list, pad_id: int, outputs: list, totals: list) -> None:
    """One pass: each request's summed loss over its rows in it, backpropagated unless the request is forward-only."""
    targets = [jobs[r.job][1].data[r.datum].inputs["target_tokens"] for r in batch]
    with torch.set_grad_enabled(any(not jobs[r.job][1].forward_only for r in batch)):
        logps = _logprobs(net, batch, targets, pad_id)
        trained = []
        for j in sorted({r.job for r in batch}):
            req = jobs[j][1]
            mine = [k for k, r in enumerate(batch) if r.job == j]
            width = max(len(batch[k].tokens) for k in mine)
            logp_B_T = torch.zeros((len(mine), width))
            mask_B_T = torch.zeros((len(mine), width))
            for b, k in enumerate(mine):
                logp_B_T[b, : len(logps[k])] = logps[k]
                mask_B_T[b, : len(logps[k])] = 1.0
            datums = [req.data[batch[k].datum] for k in mine]
            x = inputs_B_T(req.loss_fn, datums, width)
            loss = request_loss(req.loss_fn, req.loss_config, logp_B_T, mask_B_T, x)
            totals[j] += float(loss.detach())
            if not req.forward_only:
                trained.append(loss)
        if trained:
            torch.stack(trained).sum().backward()
    for r, logp in zip(batch, logps, strict=True):
        outputs[r.job][r.datum] = {"logprobs": logp.detach().numpy().astype(np.float32)}


@dataclass
class SampleJob:
    adapter: str
    prompt: list[int]
    n: int
    params: SamplingSettings  # temperature, top-p/k, max_tokens and stop strings; its `n` is unused (1)
    seed: int | None
    stop_ids: tuple[int, ...] | None  # None: the base model's end-of-sequence tokens
    prompt_logprobs: bool


def check_sample(job: SampleJob, budget: Budget, pool: LoraPool) -> None:
    """Refuse a sample whose one row cannot fit the worker's budget (before any compute).

    Raises:
        UserError: names the prompt and max_tokens.
    """
    need = sample_bytes(budget.shape, 1, len(job.prompt), job.params.max_tokens)
    what = f"a sample of a {len(job.prompt)}-token prompt and max_tokens {job.params.max_tokens}"
    budget.check(what, need, pool, job.adapter)


def sample(
    pool: LoraPool,
    net: TokenLogprobs,
    tokenizer,
    pad_id: int,
    eos_ids: list[int],
    jobs: list[SampleJob],
    budget: Budget,
) -> list[dict]:
    """Every job's n samples; jobs of one adapter with the same sampling settings share decode batches.

    Returns:
        Per job: {"sequences": [{"tokens", "logprobs", "stop_reason"}], "prompt_logprobs": [None, ...] or None}.
        Log-probs are the raw model distribution's (temperature 1, no top-k/top-p), as the trainer computes them.
    """
    results: list[dict] = [{"sequences": [], "prompt_logprobs": None} for _ in jobs]
    groups: dict[tuple, list[int]] = {}
    for i, job in enumerate(jobs):
        groups.setdefault((job.adapter, job.params, job.stop_ids), []).append(i)
    with torch.no_grad():
        for (adapter, params, stop_ids), members in groups.items():
            contexts, seeds, owners = [], [], []
            for i in members:
                job = jobs[i]
                base_seed = job.seed if job.seed is not None else random.getrandbits(62)
                for k in range(job.n):
                    contexts.append(job.prompt)
                    seeds.append(sample_seed(base_seed, "tinker", k))
                    owners.append(i)
            stops = list(stop_ids) if stop_ids is not None else eos_ids
            per_row = sample_bytes(budget.shape, 1, max(len(c) for c in contexts), params.max_tokens)
            pool.ensure([adapter])
            pool.free(per_row, {adapter}, lambda: budget.room(pool))
            size = max(1, budget.room(pool) // per_row)
            with pool.active(adapter):
                for start in range(0, len(contexts), size):
                    part = slice(start, start + size)
                    outs = decode(pool.model, tokenizer, pad_id, stops, contexts[part], seeds[part], params)
                    for owner, out in zip(owners[part], outs, strict=True):
                        results[owner]["sequences"].append(
                            {
                                "tokens": out["response_ids"],
                                "logprobs": out["logprobs"],
                                "stop_reason": out["finish_reason"],
                            }
                        )
        wanted = [i for i, job in enumerate(jobs) if job.prompt_logprobs and len(job.prompt) > 1]
        rows = [_Row(i, 0, jobs[i].adapter, jobs[i].prompt[:-1]) for i in wanted]
        for adapter, mine in _by_adapter(rows).items():
            pool.ensure([adapter])
            with pool.active(adapter):
                for batch in _passes(mine, budget, pool):
                    logps = _logprobs(net, batch, [jobs[r.job].prompt[1:] for r in batch], pad_id)
                    for r, logp in zip(batch, logps, strict=True):
                        results[r.job]["prompt_logprobs"] = [None, *logp.tolist()]
        for i, job in enumerate(jobs):
            if job.prompt_logprobs and len(job.prompt) == 1:
                results[i]["prompt_logprobs"] = [None]
    return results
