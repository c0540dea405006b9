"""Training as a service: throughput of several tenants at once against the same tenants one after another.

    python -m bench.taas_bench [--tenants 4] [--steps 8] [--batch 8] [--seq-len 64] [--model PATH] [--rounds 2]

One `posttrain serve` (max_loras = tenants), driven by the unmodified tinker SDK from this process. Each tenant
runs the same loop on its own LoRA adapter (rank 8): `steps` x (forward_backward of `batch` sequences of `seq-len`
tokens, cross-entropy, then optim_step), then `samples` sample requests (n=4, 16 new tokens) at once. Scenarios,
alternated over rounds so that machine load hits them alike:

    one tenant     one tenant's loop alone
    serial         the tenants' loops one after another through the same server
    concurrent     the tenants' loops at the same time (threads); the worker batches their forward_backward
                   requests into shared passes over the base and their samples into shared decode batches

Reported: trained tokens/s (forward+backward tokens over the training phase), sampled tokens/s, and the latency
(submit -> result) of forward_backward and sample requests, p50/p95, under each load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

KEYS = {f"tml-bench-{i}": f"tenant{i}" for i in range(16)}


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


class Tenant:
    def __init__(self, url: str, key: str, base: str, args, seed: int):
        import tinker
        from tinker import types

        self.types = types
        self.url = url
        self.sc = tinker.ServiceClient(base_url=url, api_key=key)
        self.tc = self.sc.create_lora_training_client(base_model=base, rank=8).result()
        vocab = len(self.tc.get_tokenizer())
        rng = np.random.default_rng(seed)
        self.batch = []
        for _ in range(args.batch):
            ids = rng.integers(3, vocab, args.seq_len + 1).tolist()
            self.batch.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                                          loss_fn_inputs={"target_tokens": ids[1:]}))  # fmt: skip
        self.prompt = types.ModelInput.from_ints(rng.integers(3, vocab, 16).tolist())
        self.args = args

    def run(self, out: dict) -> None:
        types, args = self.types, self.args
        start = time.perf_counter()
        for _ in range(args.steps):
            t = time.perf_counter()
            fwd = self.tc.forward_backward(self.batch, "cross_entropy")
            opt = self.tc.optim_step(types.AdamParams(learning_rate=1e-4))
            fwd.result()
            out["fwdbwd_ms"].append((time.perf_counter() - t) * 1e3)
            opt.result()
        out["train_s"] += time.perf_counter() - start
        out["train_tokens"] += args.steps * args.batch * args.seq_len
        sampler = self.tc.save_weights_and_get_sampling_client().result()
        start = time.perf_counter()
        params = types.SamplingParams(max_tokens=16, stop=[], temperature=1.0)
        submitted = [(time.perf_counter(), sampler.sample(self.prompt, 4, params)) for _ in range(args.samples)]
        for t, future in submitted:
            result = future.result()
            out["sample_ms"].append((time.perf_counter() - t) * 1e3)
            out["sample_tokens"] += sum(len(s.tokens) for s in result.sequences)
        out["sample_s"] += time.perf_counter() - start


def _busy_s(url: str) -> float:
    """Seconds the service's worker has spent computing so far (its status counter)."""
    import json
    import urllib.request

    request = urllib.request.Request(url + "/api/v1/posttrain/status", headers={"X-API-Key": next(iter(KEYS))})
    with urllib.request.urlopen(request, timeout=60) as r:
        return sum(w["busy_s"] for w in json.loads(r.read())["workers"].values())


def _scenario(tenants: list[Tenant], concurrent: bool) -> dict:
    out = {"fwdbwd_ms": [], "sample_ms": [], "train_tokens": 0, "sample_tokens": 0, "train_s": 0.0, "sample_s": 0.0}
    lock = threading.Lock()
    busy = _busy_s(tenants[0].url)
    start = time.perf_counter()
    if concurrent:
        parts = [{k: (type(v)() if not isinstance(v, float) else 0.0) for k, v in out.items()} for _ in tenants]
        threads = [threading.Thread(target=t.run, args=(p,)) for t, p in zip(tenants, parts, strict=True)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        with lock:
            for p in parts:
                for k in ("fwdbwd_ms", "sample_ms"):
                    out[k] += p[k]
                out["train_tokens"] += p["train_tokens"]
                out["sample_tokens"] += p["sample_tokens"]
            # Concurrent phases overlap: a phase lasts as long as its slowest tenant.
            out["train_s"] = max(p["train_s"] for p in parts)
            out["sample_s"] = max(p["sample_s"] for p in parts)
    else:
        for t in tenants:
            t.run(out)
    out["wall_s"] = time.perf_counter() - start
    out["busy"] = (_busy_s(tenants[0].url) - busy) / out["wall_s"]
    return out


def main(argv: list[str] | None = None) -> None:
    from bench.common import build_model
    from posttrain_core.serve.process import ServiceProcess

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--size", default="small", choices=["tiny", "small"], help="tiny random-init model preset")
    p.add_argument("--model", help="a local HF model folder or .gguf instead of the tiny model")
    p.add_argument("--threads", type=int, help="the service worker's torch threads (default: all cores)")
    args = p.parse_args(argv)
    os.environ.setdefault("TINKER_TELEMETRY", "0")

    root = Path(tempfile.mkdtemp(prefix="taas-bench-"))
    model = Path(args.model) if args.model else Path(build_model(root / "model", args.size, vocab_size=512).path)
    service = ServiceProcess("bench/base", model, root / "store", root / "state", root / "serve.log", KEYS,
                             max_loras=args.tenants, max_queued=64,
                             **({"threads": args.threads} if args.threads else {}))  # fmt: skip
    service.start()
    try:
        keys = list(KEYS)[: args.tenants]
        tenants = [Tenant(service.url, k, "bench/base", args, seed=i) for i, k in enumerate(keys)]
        _scenario(tenants[:1], False)  # warm-up: first passes, allocator
        results: dict[str, list[dict]] = {"one tenant": [], "serial": [], "concurrent": []}
        for _ in range(args.rounds):
            results["one tenant"].append(_scenario(tenants[:1], False))
            results["serial"].append(_scenario(tenants, False))
            results["concurrent"].append(_scenario(tenants, True))
    finally:
        service.stop()

    def rate(runs: list[dict], tokens: str, seconds: str) -> float:
        return statistics.median(r[tokens] / r[seconds] for r in runs)

    serial_train = rate(results["serial"], "train_tokens", "train_s")
    print(f"\nTaaS: {args.tenants} tenants x {args.steps} steps x {args.batch} seqs x {args.seq_len} tokens "
          f"(LoRA r=8), {args.samples} x 4 samples of 16 tokens each; model {args.model or args.size}; "
          f"{os.cpu_count()} cores; median of {args.rounds} rounds")  # fmt: skip
    print(f"{'scenario':12s} {'train tok/s':>12s} {'vs serial':>9s} {'sample tok/s':>13s} "
          f"{'fwd_bwd p50/p95 ms':>19s} {'sample p50/p95 ms':>18s} {'worker busy':>11s}")  # fmt: skip
    for name, runs in results.items():
        train = rate(runs, "train_tokens", "train_s")
        fb = [x for r in runs for x in r["fwdbwd_ms"]]
        sm = [x for r in runs for x in r["sample_ms"]]
        print(f"{name:12s} {train:12.0f} {train / serial_train:8.2f}x {rate(runs, 'sample_tokens', 'sample_s'):13.0f} "
              f"{_percentile(fb, 50):9.0f}/{_percentile(fb, 95):<9.0f} {_percentile(sm, 50):8.0f}/{_percentile(sm, 95):<9.0f}"
              f" {statistics.median(r['busy'] for r in runs):10.0%}")  # fmt: skip


if __name__ == "__main__":
    main()
