"""posttrain vs TRL, side by side in one run: SFT throughput, GRPO step time, rollout throughput, memory, MFU,
scaling and per-stage orchestration overhead, printed as one table of ratios (>1.0 = posttrain is better).

    make bench                                   # builds .venv-bench (TRL on top of the main venv), full run
    .venv-bench/bin/python -m bench.trl_bench --quick     # smoke run, ~3 min, small model

Both contenders get the same model (a random-init Llama built by posttrain's model builder), the same tokenized data
in the same order (TRL's dataset is laid out as posttrain's global batches, per rank), the same batch sizes, fp32, and
the same torch thread count. Repetitions alternate contenders so that load on the machine hits both alike; medians
are reported. TRL runs in processes of its own (`bench.trl_side`; torchrun with gloo for 2 ranks), posttrain through
its real stages (Ray worker groups, the artifact store, MLflow; GRPO through `rlhf_flow` on the ephemeral Prefect API).
See bench/README.md for what each row measures and bench/NOTES.md for results.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ModelInfo, Timer, build_model, long_chats, median, tokenized, write_json

REPO = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------------ settings
def settings(quick: bool, args) -> dict:
    s = dict(
        preset="bench",
        seq_len=256,
        global_batch=8,
        sft_steps=5,  # the first step is warm-up: tokens/s is measured over steps 2..N
        reps=3,
        lr=1e-3,
        grpo_iters=4,  # the first iteration is warm-up (engine start, first allocations)
        grpo_prompts=8,
        grpo_n=4,
        grpo_max_tokens=32,
        grpo_reps=2,  # runs per contender, alternating; s/step is the median over all of their steps 2..N
        # A second GRPO row with 8x the generated tokens per step (and 4x the samples): how the ratio moves with work
        grpo_large=dict(prompts=16, n=8, max_tokens=64, iters=3),
        kl_coef=0.04,
        rollout_prompts=32,
        rollout_n=4,
        rollout_max_tokens=32,
        rollout_rounds=3,
        scaling_base=8,
        scaling_sizes=(1, 4, 16),
        scaling_workers=(1, 2),
        overhead_reps=5,
        threads=os.cpu_count() or 1,
        # Same on both sides (TRL's own default is on; posttrain's is off): recomputing activations trades ~1/3
        # more compute for memory, so a comparison with it on one side only compares settings, not stacks.
        gradient_checkpointing=False,
        grpo_lora=None,
        sft_variants=[("full, fp32", {})],
        stack_rows=True,  # SFT scaling and orchestration overhead (the tiny model's run only)
    )
    if getattr(args, "model", "tiny") == "smollm2":
        from bench.real_model import SETTINGS

        s.update(SETTINGS, stack_rows=False)
    elif quick:
        s.update(
            preset="small", sft_steps=3, reps=1, grpo_iters=2, grpo_reps=1, grpo_large=None, rollout_rounds=1,
            rollout_prompts=16,
            scaling_sizes=(1, 4), scaling_workers=(1,), overhead_reps=2,
        )  # fmt: skip
    for k in ("reps", "sft_steps", "grpo_iters", "threads"):
        if getattr(args, k, None):
            s[k] = getattr(args, k)
    s["gradient_checkpointing"] = bool(getattr(args, "gradient_checkpointing", False))
    return s


# --------------------------------------------------------------------------------------------------- setup
class Bench:
    def __init__(self, s: dict, root: Path):
        import pyarrow as pa

        from posttrain_core.artifacts import ArtifactStore
        from posttrain_core.data.io import write_dataset

        self.s, self.root = s, root
        # dtype -> [(FLOP/s at the bench's threads, at 1 thread)]
        self.peak_samples: dict[str, list[tuple[float, float]]] = {}
        self.store = ArtifactStore(root / "store")
        if s["preset"] == "smollm2":
            from bench.real_model import import_smollm2

            self.model: ModelInfo = import_smollm2(self.store)
            self.base = self.store.get(Path(self.model.path).name)
        else:
            self.model = build_model(root / "model", s["preset"], max_len=512)
            self.base = self.store.register_external(self.model.path, kind="model")
        # The SFT data of the comparison: sft_steps global batches (one epoch); the scaling runs use 1x/4x/16x.
        self.datasets: dict[int, tuple] = {}
        for n in sorted({s["sft_steps"] * s["global_batch"], *(s["scaling_base"] * k for k in s["scaling_sizes"])}):
            chats = long_chats(n, seed=n)
            folder = root / f"sft-{n}"
            write_dataset(pa.table({"messages": chats}), "sft", folder)
            ref = self.store.register_external(str(folder), kind="dataset", schema_kind="sft")
            self.datasets[n] = (ref, tokenized(self.model.path, chats, s["seq_len"]))

    # ------------------------------------------------------------------------------------------------ SFT
    def sft_cfg(self, n_examples: int, workers: int, rep: int, variant: dict | None = None):
        from posttrain_core.config import LoraConfig, SFTConfig

        variant = variant or {}
        s = self.s
        return SFTConfig(
            num_workers=workers,
            max_steps=n_examples // s["global_batch"],
            global_batch_size=s["global_batch"],
            micro_batch_size=s["global_batch"] // workers,
            max_seq_len=s["seq_len"],
            lr=s["lr"],
            warmup_steps=0,
            schedule="constant",
            checkpoint_every=0,
            log_every=10**6,
            gradient_checkpointing=s["gradient_checkpointing"],
            keep_checkpoints=rep + 1,  # unused with checkpoint_every=0: only makes every repetition a fresh stage key
            lora=LoraConfig(**variant["lora"]) if variant.get("lora") else None,
            dtype=variant.get("dtype", "float32"),
        )

    def posttrain_sft(self, n_examples: int, workers: int, rep: int, variant: dict | None = None) -> dict:
        from posttrain_core.train.sft import run_sft

        ref, _ = self.datasets[n_examples]
        with Timer() as t:
            out = run_sft(self.sft_cfg(n_examples, workers, rep, variant), ref, self.base, self.store)
        m = self.store.manifest(out)
        return {"step_seconds": m["step_seconds"], "wall_s": t.seconds, "peak_rss_mb": m["metrics"]["peak_rss_mb"]}

    def step_tokens(self, n_examples: int) -> list[int]:
        """Non-pad input tokens of every global batch, in posttrain's order (both contenders train on these)."""
        from posttrain_core.train.loop import global_batch

        _, ex = self.datasets[n_examples]
        steps = n_examples // self.s["global_batch"]
        return [sum(len(ex[i][0]) for i in global_batch(k, len(ex), self.s["global_batch"], 0)) for k in range(steps)]

    def trl_sft(self, n_examples: int, workers: int, rep: int, variant: dict | None = None) -> dict:
        from posttrain_core.train.loop import global_batch

        s = self.s
        _, ex = self.datasets[n_examples]
        steps = n_examples // s["global_batch"]
        order = []
        for k in range(steps):  # rank r of posttrain takes rows r::world of the global batch: lay them out per rank
            g = global_batch(k, len(ex), s["global_batch"], 0)
            for r in range(workers):
                order += g[r::workers]
        work = Path(tempfile.mkdtemp(dir=self.root, prefix="trl-sft-"))
        write_json(work / "data.json", [list(ex[i]) for i in order])
        spec = dict(
            mode="sft", model=self.model.path, data=str(work / "data.json"), workdir=str(work / "out"), steps=steps,
            per_device_batch=s["global_batch"] // workers, lr=s["lr"], max_len=s["seq_len"], seed=rep,
            gradient_checkpointing=s["gradient_checkpointing"], lora=(variant or {}).get("lora"),
            bf16=(variant or {}).get("dtype") == "bfloat16",
            threads=max(1, s["threads"] // workers), out=str(work / "result.json"),
        )  # fmt: skip
        write_json(work / "spec.json", spec)
        env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"])}
        if workers == 1:
            cmd = [sys.executable, "-m", "bench.trl_side", str(work / "spec.json")]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={workers}",
                   "-m", "bench.trl_side", str(work / "spec.json")]  # fmt: skip
        with Timer() as t:
            _run(cmd, env, work / "log.txt")
        name = "result.json" + (".rank0" if workers > 1 else "")
        out = json.loads((work / name).read_text())
        rss = [json.loads((work / f"result.json.rank{r}").read_text())["peak_rss_mb"] for r in range(workers)] if (
            workers > 1) else [out["peak_rss_mb"]]  # fmt: skip
        return {"step_seconds": out["step_seconds"], "wall_s": t.seconds, "peak_rss_mb": max(rss)}

    def sft_compare(self, workers: int, variant: dict | None = None) -> dict:
        n = self.s["sft_steps"] * self.s["global_batch"]
        tokens = self.step_tokens(n)
        runs: dict[str, list[dict]] = {"posttrain": [], "trl": []}
        for rep in range(self.s["reps"]):
            if workers == 1:  # the machine's matmul FLOP/s, sampled next to every repetition (load varies)
                self.sample_peak((variant or {}).get("dtype", "float32"))
            contenders = [("posttrain", self.posttrain_sft), ("trl", self.trl_sft)]
            for name, fn in _in_turn(contenders, rep):
                r = fn(n, workers, rep, variant)
                r["tokens_per_s"] = sum(tokens[1:]) / sum(r["step_seconds"][1:])
                runs[name].append(r)
                _log(f"sft {workers}w rep {rep} {name}: {r['tokens_per_s']:.0f} tok/s, wall {r['wall_s']:.1f}s")
        return {
            name: {
                "tokens_per_s": median([r["tokens_per_s"] for r in rs]),
                "wall_s": median([r["wall_s"] for r in rs]),
                "peak_rss_mb": median([r["peak_rss_mb"] for r in rs]),
                "runs": rs,
            }
            for name, rs in runs.items()
        } | {"tokens": tokens}

    # ------------------------------------------------------------------------------------------------ GRPO
    def grpo_data_cfg(self):
        from posttrain_core.config import DataConfig

        return DataConfig(n_train=200, n_eval=8, families=["arithmetic"], seed=0)

    def grpo_setting(self, large: bool = False) -> dict:
        s = self.s
        if large:
            return dict(s["grpo_large"])
        return dict(prompts=s["grpo_prompts"], n=s["grpo_n"], max_tokens=s["grpo_max_tokens"], iters=s["grpo_iters"])

    def posttrain_grpo(self, g: dict, rep: int = 0) -> dict:
        from flows.rlhf import rlhf_flow
        from posttrain_core.config import RLHFFlowConfig

        s = self.s
        cfg = RLHFFlowConfig(
            store=str(self.store.root),
            data=self.grpo_data_cfg(),
            model={"path": self.model.path},
            pretrain=None,
            sft=None,
            iterations=g["iters"],
            rollout={"n": g["n"], "max_prompts": g["prompts"], "max_tokens": g["max_tokens"], "seed": rep,
                     "temperature": 1.0, "num_engines": 2, "batch_size": g["prompts"]},
            rl={"algorithm": "grpo", "num_workers": 2, "mini_batches": 1, "ppo_epochs": 1, "seed": rep,
                "micro_batch_size": g["prompts"] * g["n"], "kl_coef": s["kl_coef"], "lr": 5e-4,
                "gradient_checkpointing": s["gradient_checkpointing"], "lora": s["grpo_lora"]},
            eval={"max_prompts": 4, "max_new_tokens": 8, "num_engines": 1},
            eval_samples=0,
        )  # fmt: skip
        result = rlhf_flow(cfg)
        timings = result["timings"]
        last = self.store.manifest(result["policy"])["metrics"]
        return {"step_seconds": [t["wall_s"] for t in timings], "timings": timings, "peak_rss_mb": last["peak_rss_mb"]}

    def trl_grpo(self, g: dict, rep: int = 0) -> dict:
        from posttrain_core.data.io import read_dataset
        from posttrain_core.data.prepare import run_prepare_data

        s = self.s
        data = run_prepare_data(self.grpo_data_cfg(), self.store)  # the flow's own prompts (a cache hit there)
        table = read_dataset(self.store.local_path(data.prompts), "prompts")
        need = g["iters"] * g["prompts"]
        rows = [
            {
                "prompt": table.column("messages")[i % table.num_rows].as_py(),
                "answer": table.column("answer")[i % table.num_rows].as_py(),
            }
            for i in range(need)
        ]  # fmt: skip  (iteration k of the flow samples prompts [(k-1)P, kP): the same windows, in order)
        work = Path(tempfile.mkdtemp(dir=self.root, prefix="trl-grpo-"))
        write_json(work / "data.json", rows)
        spec = dict(
            mode="grpo", model=self.model.path, data=str(work / "data.json"), workdir=str(work / "out"),
            steps=g["iters"], prompts=g["prompts"], n=g["n"], max_tokens=g["max_tokens"],
            temperature=1.0, kl_coef=s["kl_coef"], lr=5e-4, seed=rep, threads=s["threads"],
            gradient_checkpointing=s["gradient_checkpointing"], lora=s["grpo_lora"],
            out=str(work / "result.json"),
        )  # fmt: skip
        write_json(work / "spec.json", spec)
        _run([sys.executable, "-m", "bench.trl_side", str(work / "spec.json")],
             {**os.environ, "OMP_NUM_THREADS": str(s["threads"])}, work / "log.txt")  # fmt: skip
        out = json.loads((work / "result.json").read_text())
        return {"step_seconds": out["step_seconds"], "peak_rss_mb": out["peak_rss_mb"]}

    def grpo_compare(self, large: bool = False) -> dict:
        """Each contender `grpo_reps` times, alternating who goes first; s/step = median over every run's steps
        2..N (step 1 starts engines and workers); a run's seed is its repetition (no posttrain cache hits)."""
        g = self.grpo_setting(large)
        runs: dict[str, list[dict]] = {"posttrain": [], "trl": []}
        for rep in range(1 if large else self.s["grpo_reps"]):
            contenders = [("posttrain", self.posttrain_grpo), ("trl", self.trl_grpo)]
            for name, fn in _in_turn(contenders, rep):
                r = fn(g, rep)
                runs[name].append(r)
                _log(f"grpo{' large' if large else ''} rep {rep} {name}: {[round(x, 2) for x in r['step_seconds']]} s")
        out: dict = {"setting": g}
        for name, rs in runs.items():
            steps = [x for r in rs for x in (r["step_seconds"][1:] or r["step_seconds"])]
            out[name] = {
                "s_per_step": median(steps),
                "step_seconds": [r["step_seconds"] for r in rs],
                "peak_rss_mb": max(r["peak_rss_mb"] for r in rs),
                "timings": [t for r in rs for t in r.get("timings", [])[1:]],
            }
        return out

    # --------------------------------------------------------------------------------------------- rollout
    def rollout_compare(self) -> dict:
        """posttrain's hf engine and TRL's generation path in this process, alternating rounds; then, where the
        vLLM environment is usable, posttrain's vLLM engine (an actor in that environment, same threads) against
        TRL's path again in alternating rounds (else the reason it was skipped)."""
        import argparse

        import torch

        from bench.rollout_bench import vllm_engine
        from posttrain_core.data.synthetic import make_problems, prompts_table
        from posttrain_core.rollout.engine import SamplingSettings
        from posttrain_core.rollout.hf_engine import HFEngine

        s = self.s
        torch.set_num_threads(s["threads"])
        prompts = prompts_table(make_problems(n=s["rollout_prompts"], seed=123, families=["arithmetic"]))
        params = SamplingSettings(n=s["rollout_n"], temperature=1.0, max_tokens=s["rollout_max_tokens"])
        engine = HFEngine(self.model.path)

        def posttrain() -> int:
            out = engine.generate(prompts, params)
            return sum(len(x) for x in out.column("response_ids").to_pylist())

        trl = trl_generator(self.model.path, prompts, s["rollout_n"], s["rollout_max_tokens"], self.root)
        out = self._alternate(posttrain, trl)
        try:
            args = argparse.Namespace(n=s["rollout_n"], temperature=1.0, top_p=1.0, max_tokens=s["rollout_max_tokens"],
                                      batch_size=s["rollout_prompts"], threads=s["threads"])  # fmt: skip
            vllm = vllm_engine(self.model.path, prompts, args)
        except Exception as err:  # noqa: BLE001 - an optional contender: reported, not fatal
            out["vllm_skipped"] = f"{type(err).__name__}: {str(err)[:500]}"
            _log(f"vLLM rollout skipped: {out['vllm_skipped']}")
        else:
            try:
                vs = self._alternate(vllm, trl)
                out["vllm"], out["trl_vllm_round"] = vs["posttrain"], vs["trl"]
            finally:
                import ray

                ray.kill(vllm.actor)  # it holds the CPUs the GRPO comparison needs next
        return out

    def _alternate(self, ours, trl) -> dict:
        """Generated tokens/s of `ours` and `trl` over `rollout_rounds` alternating rounds after one warm-up each."""
        rates: dict[str, list[float]] = {"posttrain": [], "trl": []}
        ours(), trl()  # warm-up
        for rnd in range(self.s["rollout_rounds"]):
            pairs = [("posttrain", ours), ("trl", trl)]
            for name, fn in _in_turn(pairs, rnd):
                with Timer() as t:
                    tokens = fn()
                rates[name].append(tokens / t.seconds)
        _log(f"rollout tok/s: {rates}")
        return {name: {"tokens_per_s": median(x), "rounds": x} for name, x in rates.items()}

    # ------------------------------------------------------------------------------------------------- MFU
    def matmul_flops(self, threads: int, dtype: str = "float32") -> float:
        """Dense matmul FLOP/s of this machine in `dtype` at `threads` torch threads: best of square 1024/2048
        products."""
        import torch

        torch.set_num_threads(threads)
        best = 0.0
        for n in (1024, 2048):
            a, b = torch.randn(n, n, dtype=getattr(torch, dtype)), torch.randn(n, n, dtype=getattr(torch, dtype))
            for _ in range(2):
                a @ b
            times = []
            for _ in range(5):
                with Timer() as t:
                    a @ b
                times.append(t.seconds)
            best = max(best, 2 * n**3 / median(times))
        torch.set_num_threads(self.s["threads"])
        return best

    def sample_peak(self, dtype: str) -> None:
        self.peak_samples.setdefault(dtype, []).append(
            (self.matmul_flops(self.s["threads"], dtype), self.matmul_flops(1, dtype))
        )

    def peak(self, dtype: str) -> dict:
        """The machine's dense peak in `dtype`: the larger of the best multi-threaded sample and threads x the best
        1-thread one (other jobs slow the multi-threaded matmul far more than the single-threaded one)."""
        samples = self.peak_samples[dtype]
        at_threads, one = max(x for x, _ in samples), max(y for _, y in samples)
        return {"peak_flops": max(at_threads, self.s["threads"] * one), "at_threads": at_threads, "one_thread": one}

    def mfu(self, compare: dict, variant: dict) -> dict:
        """Model FLOP/s over the dtype's peak, per contender (median over repetitions)."""
        from bench.real_model import flops_per_token_factor

        n = self.s["sft_steps"] * self.s["global_batch"]
        flops = self.model_flops_per_step(n, flops_per_token_factor(variant))
        peak = self.peak(variant.get("dtype", "float32"))
        out = dict(peak, dtype=variant.get("dtype", "float32"))
        for name in ("posttrain", "trl"):
            per_rep = [sum(flops[1:]) / sum(r["step_seconds"][1:]) / peak["peak_flops"] for r in compare[name]["runs"]]
            out[name] = median(per_rep)
        return out

    def model_flops_per_step(self, n_examples: int, per_token: int = 6) -> list[float]:
        """Training FLOPs of every step: per_token (6; 4 for LoRA) x params x tokens + attention 12 x layers x
        q-width x sum(len^2)."""
        from posttrain_core.train.loop import global_batch

        m, s = self.model, self.s
        _, ex = self.datasets[n_examples]
        out = []
        for k in range(n_examples // s["global_batch"]):
            lens = [len(ex[i][0]) for i in global_batch(k, len(ex), s["global_batch"], 0)]
            out.append(
                per_token * m.params * sum(lens)
                + 12 * m.num_layers * m.num_heads * m.head_dim * sum(x * x for x in lens)
            )
        return out

    # --------------------------------------------------------------------------------------------- scaling
    def scaling(self, sft1: dict, sft2: dict | None) -> dict:
        s = self.s
        n_cmp = s["sft_steps"] * s["global_batch"]
        out: dict[tuple[int, int], float] = {}
        for k in s["scaling_sizes"]:
            n = s["scaling_base"] * k
            for w in s["scaling_workers"]:
                if n == n_cmp and (w == 1 or sft2 is not None):  # measured already in the comparison
                    out[(k, w)] = (sft1 if w == 1 else sft2)["posttrain"]["wall_s"]
                    continue
                out[(k, w)] = self.posttrain_sft(n, w, rep=100 + k)["wall_s"]
                _log(f"scaling {k}x {w}w: {out[(k, w)]:.1f}s")
        return out

    # ------------------------------------------------------------------------------------------- overhead
    def overhead(self) -> dict:
        from bench.overhead import measure

        return measure(self.store, self.s["overhead_reps"], self.datasets, self.base, self.sft_cfg, self.s)


def trl_generator(model_path: str, prompts, n: int, max_tokens: int, root: Path):
    """TRL's own generation path (`GRPOTrainer._generate_single_turn`: left-padded `model.generate` with its
    GenerationConfig) on a trainer built for these settings; every prompt repeated n times as TRL's sampler does."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from posttrain_core.data.chat import tokenize_prompt

    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    messages = prompts.column("messages").to_pylist()
    args = GRPOConfig(
        output_dir=str(root / "trl-gen"), per_device_train_batch_size=n, num_generations=n,
        max_completion_length=max_tokens, temperature=1.0, top_p=1.0, report_to="none", use_cpu=True,
        disable_tqdm=True, logging_steps=10**6,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
        train_dataset=Dataset.from_list([{"prompt": m} for m in messages]), processing_class=tokenizer,
    )  # fmt: skip
    trainer.model.eval()
    ids = [tokenize_prompt(tokenizer, m) for m in messages for _ in range(n)]

    def run() -> int:
        completion_ids, _ = trainer._generate_single_turn(ids, None, {}, n)
        return sum(len(c) for c in completion_ids)

    return run


def _run(cmd: list[str], env: dict, log: Path) -> None:
    with open(log, "w") as f:
        proc = subprocess.run(cmd, env=env, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({proc.returncode}); last lines:\n" +
                           "\n".join(log.read_text().splitlines()[-30:]))  # fmt: skip


def _in_turn(contenders: list, rep: int) -> list:
    """The contenders in the order of repetition `rep`: who goes first alternates, so machine load hits both alike."""
    return contenders if rep % 2 == 0 else contenders[::-1]


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -------------------------------------------------------------------------------------------------- report
def report(s: dict, b: Bench, res: dict, total_s: float) -> str:
    m = b.model
    rows: list[tuple[str, float | None, float | None, float | None, str]] = []

    def row(label, p, t, higher_is_better=True, fmt="{:,.0f}"):
        ratio = None
        if p is not None and t is not None and p > 0 and t > 0:
            ratio = p / t if higher_is_better else t / p
        rows.append((label, p, t, ratio, fmt))

    sft1, sft2 = res["sft1"], res.get("sft2")
    row("SFT train tokens/s, 1 worker vs 1 process", sft1["posttrain"]["tokens_per_s"], sft1["trl"]["tokens_per_s"])
    if sft2:
        row("SFT train tokens/s, 2 Ray workers vs 2 procs", sft2["posttrain"]["tokens_per_s"],
            sft2["trl"]["tokens_per_s"])  # fmt: skip
    for label, cmp in list(res.get("sft_variants", {}).items())[1:]:
        row(f"SFT train tokens/s, {label}, 1 worker", cmp["posttrain"]["tokens_per_s"], cmp["trl"]["tokens_per_s"])
    row("SFT run wall s, 1 worker (cold start->trained)", sft1["posttrain"]["wall_s"], sft1["trl"]["wall_s"], False,
        "{:,.1f}")  # fmt: skip
    g = res["grpo"]
    row("GRPO s/step (rollout + reward + update)", g["posttrain"]["s_per_step"], g["trl"]["s_per_step"], False,
        "{:,.2f}")  # fmt: skip
    gl = res.get("grpo_large")
    if gl:
        st = gl["setting"]
        row(f"GRPO s/step, {st['prompts']} prompts x {st['n']}, {st['max_tokens']} tokens", gl["posttrain"]["s_per_step"],
            gl["trl"]["s_per_step"], False, "{:,.2f}")  # fmt: skip
    r = res["rollout"]
    row("rollout generated tokens/s (hf engine)", r["posttrain"]["tokens_per_s"], r["trl"]["tokens_per_s"])
    if "vllm" in r:
        row("rollout generated tokens/s (vLLM engine, CPU)", r["vllm"]["tokens_per_s"],
            r["trl_vllm_round"]["tokens_per_s"])  # fmt: skip
    row("peak RSS MiB, SFT training process, 1 worker", sft1["posttrain"]["peak_rss_mb"], sft1["trl"]["peak_rss_mb"],
        False)  # fmt: skip
    if sft2:
        row("peak RSS MiB, SFT per rank, 2 workers", sft2["posttrain"]["peak_rss_mb"], sft2["trl"]["peak_rss_mb"],
            False)  # fmt: skip
    row("peak RSS MiB, GRPO training process", g["posttrain"]["peak_rss_mb"], g["trl"]["peak_rss_mb"], False)
    for label, m_ in res["mfu_variants"].items():
        row(f"SFT MFU, {label}, 1 worker (of the {m_['dtype']} peak)", m_["posttrain"], m_["trl"], True, "{:.1%}")

    w = max(len(x[0]) for x in rows)
    what = (
        "SmolLM2-135M-Instruct (pretrained; posttrain's GGUF import, float32 weights)"
        if s["preset"] == "smollm2"
        else f"random-init Llama ({s['preset']})"
    )
    lines = [
        "posttrain vs TRL " + res["trl_version"] + ", side by side in one run (ratio > 1.0: posttrain is better)",
        f"model: {what}, {m.params / 1e6:.2f}M params, hidden {m.hidden_size}, "
        f"{m.num_layers} layers, {m.num_heads} heads ({m.num_kv_heads} KV), head_dim {m.head_dim}, "
        f"MLP {m.intermediate_size}, vocab {m.vocab_size}; fp32 on CPU unless a row says bf16 (autocast on both "
        f"sides, fp32 weights and optimizer state); gradient checkpointing "
        f"{'on' if s['gradient_checkpointing'] else 'off'} on both sides; torch {res['torch_version']}, "
        f"transformers {res['transformers_version']}",
        f"SFT: synthetic chats, seq len <= {s['seq_len']} (mean {res['mean_len']:.0f} tokens, "
        f"{res['trained_frac']:.0%} trained), global batch {s['global_batch']}, {s['sft_steps']} steps per run "
        f"(tokens/s over steps 2..{s['sft_steps']}), lr {s['lr']} constant, AdamW(0.9, 0.95), clip 1.0; "
        f"threads: {s['threads']} for 1 worker/process, {max(1, s['threads'] // 2)} per rank for 2; "
        f"medians of {s['reps']} repetitions, contenders alternating",
        f"GRPO: {s['grpo_prompts']} prompts x group {s['grpo_n']}, max_tokens {s['grpo_max_tokens']}, temperature 1, "
        f"kl {s['kl_coef']} (k3, in the loss), 1 optimizer step per step, {s['grpo_iters']} steps per run, "
        + (f"LoRA r={s['grpo_lora']['r']} on both sides (reference = adapter disabled), " if s["grpo_lora"] else "")
        + f"{s['grpo_reps']} runs each, alternating (median of steps 2..N of all runs); "
        f"posttrain: rlhf_flow (2 hf engine actors + 2 DDP update workers, 1 thread each), TRL: GRPOTrainer in "
        f"1 process, {s['threads']} threads",
        f"rollout: {s['rollout_prompts']} prompts x n={s['rollout_n']}, max_tokens {s['rollout_max_tokens']}, "
        f"temperature 1, one batch, {s['threads']} threads, median of {s['rollout_rounds']} alternating rounds; hf "
        f"engine and TRL in this process, the vLLM engine (where its environment is usable) in a Ray actor of its own "
        f"with the same threads, against TRL again in rounds of its own",
        "",
        f"| {'measure':<{w}} | {'posttrain':>10} | {'TRL':>10} | {'ratio':>6} |",
        f"|{'-' * (w + 2)}|{'-' * 12}|{'-' * 12}|{'-' * 8}|",
    ]
    for label, p, t, ratio, fmt in rows:
        ps = fmt.format(p) if p is not None else "-"
        ts = fmt.format(t) if t is not None else "-"
        rs = f"{ratio:.2f}" if ratio is not None else "-"
        lines.append(f"| {label:<{w}} | {ps:>10} | {ts:>10} | {rs:>6} |")
    if not sft2:
        lines.append(f"(2-worker SFT skipped: {res.get('sft2_skipped', 'not run')})")
    if "vllm_skipped" in r:
        lines.append(f"(vLLM rollout row skipped: {r['vllm_skipped']})")
    peaks = {m_["dtype"]: m_ for m_ in res["mfu_variants"].values()}
    lines += [
        "",
        "MFU: machine dense matmul peak "
        + "; ".join(
            f"{dt} {p['peak_flops'] / 1e9:.1f} GFLOP/s = max(best at {s['threads']} threads {p['at_threads'] / 1e9:.1f}, "
            f"{s['threads']} x best at 1 thread {p['one_thread'] / 1e9:.1f})"
            for dt, p in peaks.items()
        )
        + "; square 1024/2048 products sampled next to every SFT repetition in this run; model FLOP/s = (6 x params "
        "x tokens (4 with LoRA: no weight gradients for the frozen base) + 12 x layers x heads x head_dim x "
        "sum(len^2)) / step time",
    ]
    parts = ("generate_s", "score_s", "train_s", "startup_s", "orchestration_s")
    for label, res_g in (("GRPO", g), ("GRPO large", gl)):
        pt = res_g["posttrain"]["timings"] if res_g else []
        if pt:
            med = {p: median([t[p] for t in pt]) for p in parts}
            lines.append(
                f"posttrain {label} iteration (median s, steps 2..N): "
                + ", ".join(f"{p[:-2]} {med[p]:.2f}" for p in parts)
            )  # fmt: skip
    sc = res.get("scaling")
    lines += [] if sc is None else ["", "SFT scaling (posttrain stage wall s, cold worker start to published model)",
              "| dataset | examples | steps | " + " | ".join(f"{w} worker{'s' if w > 1 else ''}" for w in
                                                             s["scaling_workers"]) + " |"]  # fmt: skip
    for k in s["scaling_sizes"] if sc else ():
        n = s["scaling_base"] * k
        cells = " | ".join(f"{sc[(k, w)]:.1f}" for w in s["scaling_workers"])
        lines.append(f"| {k}x | {n} | {n // s['global_batch']} | {cells} |")
    o = res.get("overhead", {})
    if o:
        lines += ["", f"per-stage orchestration overhead (median of {s['overhead_reps']}, seconds)"]
    for label, v in o.items():
        lines.append(f"| {label} | {v:.3f} |")
    la = res.get("load", {})
    lines += [
        "",
        f"total bench time {total_s / 60:.1f} min; machine load average (1 min) at start {la.get('start', 0):.1f}, "
        f"end {la.get('end', 0):.1f} on {os.cpu_count()} CPUs (other jobs slow multi-threaded steps a lot: compare "
        "ratios, not absolute numbers)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", choices=["tiny", "smollm2"], default="tiny",
        help="tiny: a random-init Llama (the stack's rows); smollm2: the real SmolLM2-135M-Instruct (bench/real_model.py)",
    )  # fmt: skip
    p.add_argument("--quick", action="store_true", help="smoke run: small model, 1 repetition, fewer steps")
    p.add_argument("--reps", type=int, default=None, help="repetitions of each SFT comparison")
    p.add_argument("--sft-steps", dest="sft_steps", type=int, default=None)
    p.add_argument("--grpo-iters", dest="grpo_iters", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch threads of a 1-process contender")
    p.add_argument("--no-sft2", action="store_true", help="skip the 2-worker SFT comparison")
    p.add_argument(
        "--gradient-checkpointing", action="store_true", help="recompute activations on both sides (TRL's default)"
    )
    p.add_argument("--json", default=None, help="also write the raw results here")
    p.add_argument("--keep", default=None, help="work folder to keep (default: a temporary one, removed)")
    args = p.parse_args(argv)
    s = settings(args.quick, args)

    from posttrain_core.env import apply_defaults

    apply_defaults()
    import torch
    import transformers
    import trl

    torch.set_num_threads(s["threads"])
    started = time.time()
    tmp = tempfile.TemporaryDirectory(prefix="posttrain-trl-bench-") if not args.keep else None
    root = Path(args.keep or tmp.name)
    root.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_RESULTS_LOCAL_STORAGE_PATH", str(root / "store" / "prefect-results"))
    b = Bench(s, root)
    _log(f"model {b.model.params / 1e6:.2f}M params at {b.model.path}")
    n_cmp = s["sft_steps"] * s["global_batch"]
    ex = b.datasets[n_cmp][1]
    res: dict = {
        "load": {"start": os.getloadavg()[0]},
        "trl_version": trl.__version__, "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "mean_len": sum(len(x) for x, _ in ex) / len(ex),
        "trained_frac": sum(sum(1 for y in lab if y != -100) for _, lab in ex) / sum(len(x) for x, _ in ex),
    }  # fmt: skip
    try:
        res["sft1"] = b.sft_compare(1)
        if not args.no_sft2:
            try:
                res["sft2"] = b.sft_compare(2)
            except Exception as err:  # noqa: BLE001 - reported in the table, the rest still runs
                res["sft2_skipped"] = f"{type(err).__name__}: {str(err)[:300]}"
                _log(f"2-worker SFT failed: {res['sft2_skipped']}")
        res["sft_variants"] = {s["sft_variants"][0][0]: res["sft1"]}
        for label, variant in s["sft_variants"][1:]:
            res["sft_variants"][label] = b.sft_compare(1, variant)
        b.sample_peak("float32")
        res["mfu_variants"] = {label: b.mfu(res["sft_variants"][label], v) for label, v in s["sft_variants"]}
        res["rollout"] = b.rollout_compare()
        res["grpo"] = b.grpo_compare()
        if s["grpo_large"]:
            res["grpo_large"] = b.grpo_compare(large=True)
        if s["stack_rows"]:
            res["scaling"] = b.scaling(res["sft1"], res.get("sft2"))
            res["overhead"] = b.overhead()
        res["load"]["end"] = os.getloadavg()[0]
        text = report(s, b, res, time.time() - started)
        print("\n" + text, flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({k: v for k, v in res.items() if k != "scaling"}, default=str))
    finally:
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    main()
