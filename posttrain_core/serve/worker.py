"""One base model's worker: a fair queue in front of a `LoraPool`, run by a single compute thread.

Requests arrive on the replica's event loop (`submit`), are checked there (a bad one fails at once, category
`user`), and wait in their tenant's FIFO queue. Each scheduling round takes one turn per tenant, round-robin: the
head of its queue, plus the requests right behind it of the same kind that can share the pass (the chunks of one
forward_backward, a burst of samples). The round then runs each adapter's forward_backward requests together in
passes sized to the memory budget, each adapter's samples in shared decode batches, and the rest (optim_step,
saves, loads) one by one. A tenant's own requests keep their order; no tenant waits behind another's backlog for
more than one round.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import resource
import shutil
import threading
import time
import traceback
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain_core.artifacts.ref import ArtifactRef
from posttrain_core.serve.config import ServeConfig
from posttrain_core.serve.wire import UserError

log = logging.getLogger("ray.serve")  # Serve formats and forwards its replicas' log lines to the driver

BATCHABLE = ("forward_backward", "sample")
MAX_TURN = 64  # requests of one kind one tenant may add to a round


@dataclass
class _Item:
    kind: str
    payload: dict
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    queued: float = field(default_factory=time.monotonic)


class ModelWorker:
    """Serves one base model (see the module docstring); Ray Serve wraps it as a deployment.

    Args:
        name: the base model's public name (`base_model` in the SDK).
        base: its artifact (fetched into this node's cache when the store is remote).
        config: the service's settings (store, max_loras, lora_alpha, dtype, threads...).
        memory: bytes this worker may use in all (its share of `ServeConfig.memory_gb`).
    """

    def __init__(self, name: str, base: ArtifactRef, config: ServeConfig, memory: int):
        import ray
        import torch

        from posttrain_core.artifacts.node import node_store
        from posttrain_core.models.heads import TokenLogprobs
        from posttrain_core.models.loading import check_model_path, load_causal_lm, load_tokenizer
        from posttrain_core.rollout.hf_engine import eos_and_pad
        from posttrain_core.serve.adapters import LoraPool
        from posttrain_core.serve.compute import Budget
        from posttrain_core.serve.memory import RESERVE, Shape, gib, pass_bytes

        _first_to_go()
        _return_large_blocks()
        if config.threads:
            torch.set_num_threads(config.threads)
        self.store = node_store(config.store)
        path = str(self.store.local_path(base))
        info = check_model_path(path)
        self.name, self.path, self.config = name, str(Path(path).resolve()), config
        self.incarnation = uuid.uuid4().hex[:12]  # a restarted worker (after a crash or an OOM kill) has another
        self.node = ray.util.get_node_ip_address()
        self.tokenizer = load_tokenizer(path)
        model = load_causal_lm(path, dtype=config.dtype).eval()
        self.eos_ids, self.pad_id = eos_and_pad(self.tokenizer, model)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_length = int(info.get("max_position_embeddings") or 2048)
        # Evicted adapters live as long as this process: on this node, whatever node that is (removed by `__del__`,
        # which Serve calls when it stops a replica).
        self.spill = self.store.own_dir("serve") / "spill" / f"{name.replace('/', '_')}-{self.incarnation}"
        self.pool = LoraPool(model, config.max_loras, self.spill)
        self.net = TokenLogprobs(self.pool.model)
        with torch.no_grad():  # every weight paged in before the resident size is read (safetensors maps them)
            self.pool.model(input_ids=torch.zeros((1, 1), dtype=torch.long))
        self.budget = Budget(memory, _rss(), Shape.of(model.config))
        smallest = pass_bytes(self.budget.shape, 1, 64, 8)  # a 64-token datum of a rank-8 adapter
        if self.budget.room(self.pool) < smallest:
            raise ValueError(
                f"base model {name}: the worker takes {gib(self.budget.base)} with the model loaded, and its memory "
                f"budget is {gib(memory)}: nothing is left for a pass (RESERVE {gib(RESERVE)}); raise --memory-gb"
            )
        self.queues: dict[str, deque[_Item]] = {}
        self.turns: deque[str] = deque()  # tenants in round-robin order
        self.wakeup = threading.Condition()
        self.stats = {"rounds": 0, "busy_s": 0.0, "fwdbwd_tokens": 0, "fwdbwd_passes": 0, "sampled_tokens": 0}
        threading.Thread(target=self._run, name=f"compute-{name}", daemon=True).start()
        log.info(
            "worker %s (pid %d, node %s): %s loaded (vocab %d, context %d); memory budget %s, %s resident, %s per pass",
            name, os.getpid(), self.node, path, self.vocab_size, self.max_length, gib(memory), gib(self.budget.base),
            gib(self.budget.room(self.pool)),
        )  # fmt: skip

    def __del__(self) -> None:
        if hasattr(self, "spill"):  # not when __init__ failed before it
            shutil.rmtree(self.spill, ignore_errors=True)

    # ----------------------------------------------------------------------------------------------- public
    def describe(self) -> dict[str, Any]:
        from posttrain_core.serve.memory import MiB

        return {
            "model_name": self.name,
            "path": self.path,
            "pid": os.getpid(),
            "node": self.node,
            "incarnation": self.incarnation,
            "vocab_size": self.vocab_size,
            "max_context_length": self.max_length,
            "resident": self.pool.resident(),
            "evictions": self.pool.evictions,
            "queued": sum(len(q) for q in self.queues.values()),
            "memory_budget_mb": self.budget.total / MiB,
            "pass_room_mb": self.budget.room(self.pool) / MiB,
            "rss_mb": _rss() / MiB,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            **self.stats,
        }

    async def submit(self, tenant: str, kind: str, payload: dict) -> dict[str, Any]:
        """Queue one request and wait for it: `{"result": ..., "incarnation": ...}` or `{"error": message,
        "category": ..., "incarnation": ...}` (the gateway tells a restarted worker by its incarnation)."""
        try:
            self._check(kind, payload)
        except UserError as e:
            return {"error": str(e), "category": "user", "incarnation": self.incarnation}
        loop = asyncio.get_running_loop()
        item = _Item(kind, payload, loop, loop.create_future())
        with self.wakeup:
            if tenant not in self.queues:
                self.queues[tenant] = deque()
                self.turns.append(tenant)
            self.queues[tenant].append(item)
            self.wakeup.notify()
        return {**await item.future, "incarnation": self.incarnation}

    # ------------------------------------------------------------------------------------------------ checks
    def _check(self, kind: str, payload: dict) -> None:
        from posttrain_core.serve.compute import check_sample
        from posttrain_core.serve.losses import check_datum
        from posttrain_core.serve.memory import pass_bytes

        if kind == "forward_backward":
            request, adapter = payload["request"], payload["adapter"]
            if not request.data:
                raise UserError("data: no datums")
            rank = self.pool.adapters[adapter].lora.r if adapter in self.pool.adapters else 0
            for i, datum in enumerate(request.data):
                check_datum(request.loss_fn, datum, i, self.vocab_size, self.max_length)
                need = pass_bytes(self.budget.shape, 1, len(datum.tokens), rank)
                self.budget.check(f"data[{i}] ({len(datum.tokens)} tokens)", need, self.pool, adapter)
        elif kind == "sample":
            job = payload["job"]
            if not job.prompt:
                raise UserError("prompt: no tokens")
            bad = [t for t in job.prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise UserError(f"prompt: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
            if len(job.prompt) + job.params.max_tokens > self.max_length:
                raise UserError(
                    f"sampling_params.max_tokens: prompt ({len(job.prompt)}) + max_tokens ({job.params.max_tokens})"
                    f" exceed the base model's context of {self.max_length}"
                )
            check_sample(job, self.budget, self.pool)

    # --------------------------------------------------------------------------------------------- schedule
    def _round(self) -> list[tuple[str, list[_Item]]]:
        """One turn per tenant with queued work: (tenant, its items for this round)."""
        picked = []
        for _ in range(len(self.turns)):
            tenant = self.turns[0]
            self.turns.rotate(-1)
            queue = self.queues[tenant]
            if not queue:
                continue
            items = [queue.popleft()]
            if items[0].kind in BATCHABLE:
                while queue and queue[0].kind == items[0].kind and len(items) < MAX_TURN:
                    items.append(queue.popleft())
            picked.append((tenant, items))
        return picked

    def _run(self) -> None:
        while True:
            with self.wakeup:
                while not any(self.queues.values()):
                    self.wakeup.wait()
                picked = self._round()
            try:
                self._work(picked)
            except Exception as e:  # never leave the thread (every later request would wait forever)
                log.error("worker %s: a round failed:\n%s", self.name, traceback.format_exc())
                failed = {"error": f"{type(e).__name__}: {e}", "category": "server"}
                for item in (item for _, items in picked for item in items):
                    item.loop.call_soon_threadsafe(_resolve, item.future, failed)

    def _work(self, picked: list[tuple[str, list[_Item]]]) -> None:
        """One round: each adapter's forward_backward requests together, its samples together, the rest alone."""
        self.stats["rounds"] += 1
        started = time.perf_counter()
        fwdbwd = [i for _, items in picked for i in items if i.kind == "forward_backward"]
        samples = [i for _, items in picked for i in items if i.kind == "sample"]
        others = [i for _, items in picked for i in items if i.kind not in BATCHABLE]
        for group in _by_adapter(fwdbwd):
            self._execute(group, self._forward_backward)
        for group in _by_adapter(samples):
            self._execute(group, self._sample)
        for item in others:
            self._execute([item], lambda items: [self._single(items[0])])
        if fwdbwd or samples:
            _release_freed_memory()
        self.stats["busy_s"] += time.perf_counter() - started

    def _execute(self, items: list[_Item], fn) -> None:
        try:
            results = [{"result": r} for r in fn(items)]
        except UserError as e:
            results = [{"error": str(e), "category": "user"}] * len(items)
        except Exception as e:  # a bug or an OOM: the request fails, the server stays up
            log.error("worker %s: %s failed:\n%s", self.name, items[0].kind, traceback.format_exc())
            results = [{"error": f"{type(e).__name__}: {e}", "category": "server"}] * len(items)
        for item, result in zip(items, results, strict=True):
            item.loop.call_soon_threadsafe(_resolve, item.future, result)

    # ------------------------------------------------------------------------------------------------- work
    def _forward_backward(self, items: list[_Item]) -> list[bytes]:
        from posttrain_core.serve.compute import forward_backward
        from posttrain_core.serve.wire import encode_forward_backward

        jobs = [(i.payload["adapter"], i.payload["request"]) for i in items]
        results, passes = forward_backward(self.pool, self.net, jobs, self.pad_id, self.budget)
        self.stats["fwdbwd_tokens"] += sum(len(d.tokens) for _, r in jobs for d in r.data)
        self.stats["fwdbwd_passes"] += passes
        return [encode_forward_backward(outputs, metrics) for outputs, metrics in results]

    def _sample(self, items: list[_Item]) -> list[bytes]:
        from posttrain_core.serve.compute import sample
        from posttrain_core.serve.wire import encode_sample

        jobs = [i.payload["job"] for i in items]
        results = sample(self.pool, self.net, self.tokenizer, self.pad_id, self.eos_ids, jobs, self.budget)
        self.stats["sampled_tokens"] += sum(len(s["tokens"]) for r in results for s in r["sequences"])
        return [encode_sample(r["sequences"], r["prompt_logprobs"]) for r in results]

    def _create(self, adapter: str, request: dict) -> None:
        """A tenant's new adapter, refused (naming its rank) if it leaves no room for a pass in this worker's budget."""
        from posttrain_core.models.lora import lora_parameters
        from posttrain_core.serve.adapters import BASE, lora_from_request
        from posttrain_core.serve.memory import adapter_bytes, pass_bytes

        lora, seed = lora_from_request(request, self.config.lora_alpha, self.pool.linear_names)
        need = adapter_bytes(lora_parameters(self.pool.model, lora), True) + pass_bytes(
            self.budget.shape, 1, 64, lora.r
        )
        self.budget.check(f"lora_config.rank: an adapter of rank {lora.r} (its weights, gradients and optimizer "
                          "state) with a 64-token pass", need, self.pool, BASE)  # fmt: skip
        self.pool.create(adapter, lora, seed)

    def _single(self, item: _Item) -> Any:
        p, pool = item.payload, self.pool
        if item.kind == "create":
            self._create(p["adapter"], p["lora_config"])
            return {}
        if item.kind == "optim_step":
            return pool.optim_step(p["adapter"], p["adam"])
        if item.kind == "save":
            return self._save(p["adapter"], p["key"], p["with_state"])
        if item.kind == "load":
            folder = self.store.local_path(p["ref"])  # fetched into this node's cache when the store is remote
            lora = pool.load(p["adapter"], folder, with_state=p["with_state"], trainable=p["trainable"])
            return {"rank": lora.r}
        if item.kind == "snapshot":
            pool.snapshot(p["source"], p["adapter"])
            return {}
        if item.kind == "drop":
            for name in p["adapters"]:
                pool.drop(name)
            return {}
        raise ValueError(f"unknown request kind {item.kind!r}")

    def _save(self, adapter: str, key: str, with_state: bool) -> dict:
        """Write an adapter folder for the artifact `key`: in the store's staging when the store is a folder (the
        gateway publishes it), else on this node and uploaded into the store (the gateway publishes the upload)."""
        from posttrain_core.artifacts.node import outbox_of

        outbox = outbox_of(self.store, key)
        folder = outbox.outdir() if outbox else self.store.new_output_dir(key)
        shutil.rmtree(folder, ignore_errors=True)  # what an interrupted save left
        folder.mkdir(parents=True)
        self.pool.save(adapter, folder, with_state=with_state, base_path=self.path)
        self.tokenizer.save_pretrained(folder)
        state = self.pool.adapters[adapter]
        return {"steps": state.steps, "rank": state.lora.r, "src": outbox.ship(folder) if outbox else str(folder)}


def _by_adapter(items: list[_Item]) -> list[list[_Item]]:
    """The round's items of each adapter (a failed pass fails only its own adapter's requests)."""
    groups: dict[str, list[_Item]] = {}
    for item in items:
        groups.setdefault(item.payload["adapter"], []).append(item)
    return list(groups.values())


def _resolve(future: asyncio.Future, result: dict) -> None:
    if not future.done():  # the caller may have gone (cancelled)
        future.set_result(result)


def _rss() -> int:
    """This process's resident memory now, in bytes."""
    import psutil

    return psutil.Process().memory_info().rss


def _first_to_go() -> None:
    """If the machine runs out of memory after all, the kernel's OOM killer takes this worker first (the process
    whose passes grow), not the gateway, the Serve controller or Ray's own processes: a restarted worker costs its
    tenants only their unsaved steps."""
    with contextlib.suppress(OSError):
        Path("/proc/self/oom_score_adj").write_text("1000")


def _return_large_blocks() -> None:
    """Blocks of 1 MiB and more are mapped and unmapped on their own, not carved from the heap.

    glibc serves an allocation below its mmap threshold from the heap, and raises that threshold (up to 32 MiB) each
    time a larger block is freed; a pass's many activation tensors of a few MiB then fragment the heap, which keeps
    their peak long after the pass and beyond what the pass itself holds. Measured on SmolLM2-135M, passes of 400
    datums of 10 tokens grew the process to 13.2 GB with the default and to 5.8 GB with the threshold fixed at
    1 MiB, at ~10% more time. The budget's per-token estimate assumes this setting.
    """
    m_mmap_threshold = -3  # mallopt's parameter number in glibc's malloc.h
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(m_mmap_threshold, 1 << 20)


def _release_freed_memory() -> None:
    """Give the heap's freed pages back to the system after a round (glibc keeps them otherwise), so the process's
    resident size is what it holds, not the largest pass it ever ran."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
