"""One base model's worker: a fair queue in front of a `LoraPool`, run by a single compute thread.

Requests arrive on the replica's event loop (`submit`), are checked there (a bad one fails at once, category
`user`), and wait in their tenant's FIFO queue. Each scheduling round takes one turn per tenant, round-robin: the
head of its queue, plus the requests right behind it of the same kind that can share the pass (the chunks of one
forward_backward, a burst of samples). The round then runs every tenant's forward_backward in shared passes over
the base (up to `max_loras` adapters at once), every sample request in shared decode batches, and the rest
(optim_step, saves, loads) one by one. A tenant's own requests keep their order; no tenant waits behind another's
backlog for more than one round.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
        path: its local Hugging Face folder.
        settings: `ServeConfig` fields as a dict (max_loras, lora_alpha, dtype, max_batch_tokens, spill dir...).
    """

    def __init__(self, name: str, path: str, settings: dict[str, Any]):
        import torch

        from posttrain_core.models.loading import check_model_path, load_causal_lm, load_tokenizer
        from posttrain_core.rollout.hf_engine import eos_and_pad
        from posttrain_core.serve.adapters import LoraPool

        if settings.get("threads"):
            torch.set_num_threads(int(settings["threads"]))
        info = check_model_path(path)
        self.name, self.path, self.settings = name, str(Path(path).resolve()), settings
        self.tokenizer = load_tokenizer(path)
        model = load_causal_lm(path, dtype=settings.get("dtype", "float32")).eval()
        self.eos_ids, self.pad_id = eos_and_pad(self.tokenizer, model)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_length = int(info.get("max_position_embeddings") or 2048)
        spill = Path(settings["state_dir"]) / "spill" / name.replace("/", "_")
        self.pool = LoraPool(model, int(settings["max_loras"]), spill)
        self.queues: dict[str, deque[_Item]] = {}
        self.turns: deque[str] = deque()  # tenants in round-robin order
        self.wakeup = threading.Condition()
        self.stats = {"rounds": 0, "busy_s": 0.0, "fwdbwd_tokens": 0, "sampled_tokens": 0}
        threading.Thread(target=self._run, name=f"compute-{name}", daemon=True).start()
        log.info("worker %s: %s loaded (vocab %d, context %d)", name, path, self.vocab_size, self.max_length)

    # ----------------------------------------------------------------------------------------------- public
    def describe(self) -> dict[str, Any]:
        return {
            "model_name": self.name,
            "path": self.path,
            "vocab_size": self.vocab_size,
            "max_context_length": self.max_length,
            "resident": self.pool.resident(),
            "evictions": self.pool.evictions,
            "queued": sum(len(q) for q in self.queues.values()),
            **self.stats,
        }

    async def submit(self, tenant: str, kind: str, payload: dict) -> dict[str, Any]:
        """Queue one request and wait for it: `{"result": ...}` or `{"error": message, "category": ...}`."""
        try:
            self._check(kind, payload)
        except UserError as e:
            return {"error": str(e), "category": "user"}
        loop = asyncio.get_running_loop()
        item = _Item(kind, payload, loop, loop.create_future())
        with self.wakeup:
            if tenant not in self.queues:
                self.queues[tenant] = deque()
                self.turns.append(tenant)
            self.queues[tenant].append(item)
            self.wakeup.notify()
        return await item.future

    # ------------------------------------------------------------------------------------------------ checks
    def _check(self, kind: str, payload: dict) -> None:
        from posttrain_core.serve.losses import check_datum

        if kind == "forward_backward":
            request = payload["request"]
            if not request.data:
                raise UserError("data: no datums")
            for i, datum in enumerate(request.data):
                check_datum(request.loss_fn, datum, i, self.vocab_size, self.max_length)
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
        """One round: every tenant's forward_backward in shared passes, samples in shared batches, the rest alone."""
        self.stats["rounds"] += 1
        started = time.perf_counter()
        fwdbwd = [i for _, items in picked for i in items if i.kind == "forward_backward"]
        samples = [i for _, items in picked for i in items if i.kind == "sample"]
        others = [i for _, items in picked for i in items if i.kind not in BATCHABLE]
        for group in self._by_adapters(fwdbwd):
            self._execute(group, self._forward_backward)
        for group in self._by_adapters(samples):
            self._execute(group, self._sample)
        for item in others:
            self._execute([item], lambda items: [self._single(items[0])])
        self.stats["busy_s"] += time.perf_counter() - started

    def _by_adapters(self, items: list[_Item]) -> list[list[_Item]]:
        """Split a round's batchable items into groups of at most `max_loras` distinct adapters each."""
        groups: list[list[_Item]] = []
        names: list[set[str]] = []
        for item in items:
            adapter = item.payload["adapter"]
            for group, seen in zip(groups, names, strict=True):
                if adapter in seen or len(seen) < self.pool.max_loras:
                    group.append(item)
                    seen.add(adapter)
                    break
            else:
                groups.append([item])
                names.append({adapter})
        return groups

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
        results = forward_backward(self.pool, jobs, self.pad_id, int(self.settings["max_batch_tokens"]))
        self.stats["fwdbwd_tokens"] += sum(len(d.tokens) for _, r in jobs for d in r.data)
        return [encode_forward_backward(outputs, metrics) for outputs, metrics in results]

    def _sample(self, items: list[_Item]) -> list[bytes]:
        from posttrain_core.serve.compute import sample
        from posttrain_core.serve.wire import encode_sample

        results = sample(self.pool, self.tokenizer, self.pad_id, self.eos_ids, [i.payload["job"] for i in items])
        self.stats["sampled_tokens"] += sum(len(s["tokens"]) for r in results for s in r["sequences"])
        return [encode_sample(r["sequences"], r["prompt_logprobs"]) for r in results]

    def _single(self, item: _Item) -> Any:
        from posttrain_core.serve.adapters import spec_from_request

        p, pool = item.payload, self.pool
        if item.kind == "create":
            pool.create(
                p["adapter"], spec_from_request(p["lora_config"], self.settings["lora_alpha"], pool.linear_names)
            )
            return {}
        if item.kind == "optim_step":
            return pool.optim_step(p["adapter"], p["adam"])
        if item.kind == "save":
            pool.save(p["adapter"], Path(p["folder"]), with_state=p["with_state"], base_path=self.path)
            self.tokenizer.save_pretrained(p["folder"])
            return {"steps": pool.adapters[p["adapter"]].steps, "rank": pool.adapters[p["adapter"]].spec.rank}
        if item.kind == "load":
            spec = pool.load(p["adapter"], Path(p["folder"]), with_state=p["with_state"], trainable=p["trainable"])
            return {"rank": spec.rank}
        if item.kind == "snapshot":
            pool.snapshot(p["source"], p["adapter"])
            return {}
        if item.kind == "drop":
            for name in p["adapters"]:
                pool.drop(name)
            return {}
        raise ValueError(f"unknown request kind {item.kind!r}")


def _resolve(future: asyncio.Future, result: dict) -> None:
    if not future.done():  # the caller may have gone (cancelled)
        future.set_result(result)
