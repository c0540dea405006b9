"""Many LoRA adapters on one base model: at most `max_loras` resident, each with its own AdamW; the rest on disk.

One peft model holds the frozen base and every resident adapter. A forward pass names each row's adapter
(peft's mixed-adapter batch), so the work of several tenants shares one pass over the base weights. An adapter
that must make room is written to disk with its weights, optimizer state and pending gradients, in the same
folder format as a saved checkpoint (`save` / `load`), and comes back bit-exact.

The pool is not thread-safe: the worker's single compute thread owns it.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from posttrain_core.serve.wire import UserError

log = logging.getLogger("ray.serve")  # Serve formats and forwards its replicas' log lines to the driver

BASE = "__base__"  # peft's name for "no adapter" in a mixed batch
STATE_FILE = "training_state.pt"  # optimizer state, pending gradients, step count (not read by peft)
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterSpec:
    """What defines an adapter's shape: tinker's `lora_config` and the server's alpha."""

    rank: int
    alpha: int
    targets: tuple[str, ...]
    seed: int = 0


def spec_from_request(lora: dict, alpha: int, linear_names: set[str]) -> AdapterSpec:
    """An AdapterSpec from a `create_model` request's `lora_config` (train_attn, train_mlp, train_unembed).

    Raises:
        UserError: the rank is not a positive int, or no adapted module exists in the base (names the field).
    """
    rank = lora.get("rank")
    if not isinstance(rank, int) or not 1 <= rank <= 512:
        raise UserError(f"lora_config.rank: expected an int in [1, 512], got {rank!r}")
    targets = [*(ATTN if lora.get("train_attn", True) else ()), *(MLP if lora.get("train_mlp", True) else ())]
    if lora.get("train_unembed", False):
        targets.append("lm_head")
    targets = [t for t in targets if t in linear_names]
    if not targets:
        raise UserError("lora_config: train_attn, train_mlp and train_unembed select no module of this base model")
    seed = lora.get("seed")
    return AdapterSpec(rank=rank, alpha=alpha, targets=tuple(targets), seed=int(seed) if seed is not None else 0)


@dataclass
class _Adapter:
    spec: AdapterSpec
    trainable: bool
    optimizer: torch.optim.AdamW | None = None
    steps: int = 0
    last_used: float = 0.0
    spilled: Path | None = None  # set while not resident


class LoraPool:
    """The base model and its adapters (see the module docstring).

    Args:
        model: the base causal LM (eval mode; its weights are frozen here).
        max_loras: adapters resident at once (trainable ones and sampler snapshots alike).
        spill_dir: where evicted adapters go (a folder of the service's own).
    """

    def __init__(self, model: torch.nn.Module, max_loras: int, spill_dir: Path):
        from peft import LoraConfig, get_peft_model

        for p in model.parameters():
            p.requires_grad_(False)
        self.linear_names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        # peft needs one adapter to build its wrapper; this rank-1 one is never used by any row.
        idle = LoraConfig(r=1, target_modules=[sorted(self.linear_names - {"lm_head"})[0]], lora_dropout=0.0)
        self.model = get_peft_model(model, idle, adapter_name="posttrain_idle").eval()
        self.max_loras = max_loras
        self.spill_dir = Path(spill_dir)
        self.adapters: dict[str, _Adapter] = {}
        self.evictions = 0

    # ------------------------------------------------------------------------------------------- residency
    def resident(self) -> list[str]:
        return [n for n, a in self.adapters.items() if a.spilled is None]

    def ensure(self, names: list[str]) -> None:
        """Make `names` resident, evicting the least recently used others.

        Raises:
            UserError: an unknown adapter.
            ValueError: more names than `max_loras` (the scheduler never batches that many).
        """
        wanted = [n for n in dict.fromkeys(names) if n != BASE]
        for n in wanted:
            if n not in self.adapters:
                raise UserError(
                    f"adapter {n!r} is not on this server (its session closed, a newer sampler snapshot replaced it,"
                    " or it was never created)"
                )
        if len(wanted) > self.max_loras:
            raise ValueError(f"{len(wanted)} adapters in one batch exceed max_loras={self.max_loras}")
        now = time.monotonic()
        for n in wanted:
            self.adapters[n].last_used = now
            if self.adapters[n].spilled is not None:
                self._make_room(keep=set(wanted))
                self._restore(n)

    def _make_room(self, keep: set[str]) -> None:
        resident = self.resident()
        while len(resident) >= self.max_loras:
            victim = min((n for n in resident if n not in keep), key=lambda n: self.adapters[n].last_used)
            self._evict(victim)
            resident.remove(victim)

    def _evict(self, name: str) -> None:
        folder = self.spill_dir / name
        shutil.rmtree(folder, ignore_errors=True)
        self.save(name, folder, with_state=True)
        self.model.delete_adapter(name)
        self.adapters[name].optimizer = None
        self.adapters[name].spilled = folder
        self.evictions += 1
        log.info("evicted adapter %s to %s (%d resident)", name, folder, len(self.resident()))

    def _restore(self, name: str) -> None:
        adapter = self.adapters[name]
        folder, adapter.spilled = adapter.spilled, None
        self._inject(name, adapter.spec, adapter.trainable)
        self._load_into(name, folder, with_state=True)
        shutil.rmtree(folder, ignore_errors=True)
        log.info("restored adapter %s (%d resident)", name, len(self.resident()))

    # -------------------------------------------------------------------------------------------- lifecycle
    def create(self, name: str, spec: AdapterSpec, trainable: bool = True) -> None:
        """A fresh adapter (B = 0: it starts as the base model), A drawn from `spec.seed`."""
        if name in self.adapters:
            raise ValueError(f"adapter {name!r} exists")
        self._make_room(keep=set())
        self.adapters[name] = _Adapter(spec, trainable, last_used=time.monotonic())
        self._inject(name, spec, trainable)

    def snapshot(self, source: str, name: str) -> None:
        """A frozen copy of `source`'s current weights (a sampler's view of a training adapter)."""
        self.ensure([source])
        spec = self.adapters[source].spec
        self.create(name, spec, trainable=False)
        self.ensure([source, name])
        with torch.no_grad():
            mine = self._params(name)
            for key, p in self._params(source).items():
                mine[key].copy_(p)

    def drop(self, name: str) -> None:
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            return
        if adapter.spilled is None:
            self.model.delete_adapter(name)
        else:
            shutil.rmtree(adapter.spilled, ignore_errors=True)

    def _inject(self, name: str, spec: AdapterSpec, trainable: bool) -> None:
        from peft import LoraConfig

        config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets), lora_dropout=0.0)
        rng = torch.random.get_rng_state()
        try:
            torch.manual_seed(spec.seed)
            self.model.add_adapter(name, config)
        finally:
            torch.random.set_rng_state(rng)
        self.model.eval()
        # peft re-applies its own active-adapter flags to every layer it touches: set all of them again.
        for other in self.resident():
            for p in self._params(other).values():
                p.requires_grad_(self.adapters[other].trainable)
        if trainable:
            self.adapters[name].optimizer = torch.optim.AdamW(list(self._params(name).values()))

    def _params(self, name: str) -> dict[str, torch.nn.Parameter]:
        """The adapter's parameters by a name without the adapter's (stable across evictions), sorted."""
        tag = f".{name}."
        found = {k.replace(tag, "."): p for k, p in self.model.named_parameters() if tag in k}
        return dict(sorted(found.items()))

    # ---------------------------------------------------------------------------------------------- training
    def optim_step(self, name: str, adam: dict) -> dict[str, float]:
        """One AdamW step on the adapter's accumulated gradients, then clear them; returns `{"grad_norm:max": g}`.

        Args:
            adam: tinker's AdamParams: learning_rate, beta1, beta2, eps, weight_decay, grad_clip_norm (0: off).
        """
        self.ensure([name])
        adapter = self.adapters[name]
        if adapter.optimizer is None:
            raise UserError(f"model {name!r} is a sampler snapshot; it has no optimizer")
        params = list(self._params(name).values())
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])) if grads else 0.0
        clip = float(adam.get("grad_clip_norm") or 0.0)
        if clip > 0 and grads:
            torch.nn.utils.clip_grads_with_norm_(params, clip, norm)
        for group in adapter.optimizer.param_groups:
            group.update(
                lr=float(adam.get("learning_rate", 1e-4)),
                betas=(float(adam.get("beta1", 0.9)), float(adam.get("beta2", 0.95))),
                eps=float(adam.get("eps", 1e-12)),
                weight_decay=float(adam.get("weight_decay", 0.0)),
            )
        adapter.optimizer.step()
        adapter.optimizer.zero_grad(set_to_none=True)
        adapter.steps += 1
        return {"grad_norm:max": float(norm)}

    # ------------------------------------------------------------------------------------------ save / load
    def save(self, name: str, folder: Path, with_state: bool, base_path: str | None = None) -> None:
        """Write a peft adapter folder (adapter_config.json + adapter_model.safetensors) and, `with_state`, the
        optimizer state, pending gradients and step count (`training_state.pt`)."""
        from peft import LoraConfig
        from safetensors.torch import save_file

        self.ensure([name])
        adapter = self.adapters[name]
        folder.mkdir(parents=True, exist_ok=True)
        params = self._params(name)
        save_file({k: p.detach().contiguous() for k, p in params.items()}, str(folder / "adapter_model.safetensors"))
        spec = adapter.spec
        config = LoraConfig(
            r=spec.rank,
            lora_alpha=spec.alpha,
            target_modules=list(spec.targets),
            lora_dropout=0.0,
            task_type="CAUSAL_LM",
            base_model_name_or_path=base_path,
        )
        config.save_pretrained(str(folder))
        if with_state:
            state = {
                "optimizer": adapter.optimizer.state_dict() if adapter.optimizer is not None else None,
                "grads": {k: p.grad for k, p in params.items() if p.grad is not None},
                "steps": adapter.steps,
            }
            torch.save(state, folder / STATE_FILE)

    def load(self, name: str, folder: Path, with_state: bool, trainable: bool = True) -> AdapterSpec:
        """A new adapter `name` from a folder `save` wrote (weights; `with_state`: optimizer state too)."""
        from peft import LoraConfig

        config = LoraConfig.from_pretrained(str(folder))  # its adapter_config.json; the weights come next
        spec = AdapterSpec(rank=config.r, alpha=config.lora_alpha, targets=tuple(sorted(config.target_modules)))
        self.create(name, spec, trainable=trainable)
        self._load_into(name, folder, with_state)
        return spec

    def _load_into(self, name: str, folder: Path, with_state: bool) -> None:
        from safetensors.torch import load_file

        weights = load_file(str(folder / "adapter_model.safetensors"))
        params = self._params(name)
        if set(weights) != set(params):
            raise ValueError(f"{folder}: its tensors do not match adapter {name!r} on this base model")
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(weights[k])
        adapter = self.adapters[name]
        if with_state and (folder / STATE_FILE).exists():
            state = torch.load(folder / STATE_FILE, weights_only=True)
            if adapter.optimizer is not None and state["optimizer"] is not None:
                adapter.optimizer.load_state_dict(state["optimizer"])
            for k, g in state["grads"].items():
                params[k].grad = g
            adapter.steps = state["steps"]
