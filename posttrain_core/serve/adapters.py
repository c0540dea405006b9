"""Many LoRA adapters on one base model: at most `max_loras` resident, each with its own AdamW; the rest on disk.

One peft model holds the frozen base and every resident adapter; a pass runs with one of them active (`active`). A
pass that mixed several adapters' rows (peft's mixed-adapter batch) cost 2-9x more per token on a CPU than one
adapter's rows alone (peft copies each adapter's rows in and out of every adapted layer, the head's [tokens x vocab]
output included), for no saving: the base weights are read once per pass either way. An adapter
that must make room is written to disk with its weights, optimizer state and pending gradients, in the same
folder format as a saved checkpoint (`save` / `load`), and comes back bit-exact. Adapters are made by the library's
LoRA helpers (`models.lora`: seeded, from a `LoraConfig`) and stepped by its optimizer (`train.loop.adamw`,
`optimizer_step`), as the pipeline's trainers are.

The pool is not thread-safe: the worker's single compute thread owns it.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from posttrain_core.config import LoraConfig
from posttrain_core.serve.memory import adapter_bytes
from posttrain_core.serve.wire import UserError
from posttrain_core.train.rl_state import STATE_FILE

log = logging.getLogger("ray.serve")  # Serve formats and forwards its replicas' log lines to the driver

BASE = "__base__"  # peft's name for "no adapter" in a mixed batch
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
MAX_RANK = 512


def lora_from_request(request: dict, alpha: int, available: set[str]) -> tuple[LoraConfig, int]:
    """(LoraConfig, seed) of a `create_model` request's `lora_config` (rank, seed, train_attn, train_mlp,
    train_unembed), with the server's alpha.

    Raises:
        UserError: the rank is not an int in [1, MAX_RANK], or no adapted module exists in the base (names the field).
    """
    rank = request.get("rank")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= MAX_RANK:
        raise UserError(f"lora_config.rank: expected an int in [1, {MAX_RANK}], got {rank!r}")
    targets = [*(ATTN if request.get("train_attn", True) else ()), *(MLP if request.get("train_mlp", True) else ())]
    if request.get("train_unembed", False):
        targets.append("lm_head")
    targets = [t for t in targets if t in available]
    if not targets:
        raise UserError("lora_config: train_attn, train_mlp and train_unembed select no module of this base model")
    seed = request.get("seed")
    return LoraConfig(r=rank, alpha=alpha, dropout=0.0, target_modules=targets), int(seed) if seed is not None else 0


@dataclass
class _Adapter:
    lora: LoraConfig
    trainable: bool
    parameters: int = 0
    optimizer: torch.optim.Optimizer | None = None
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
        from posttrain_core.models.lora import apply_lora, linear_names

        for p in model.parameters():
            p.requires_grad_(False)
        self.linear_names = linear_names(model)
        # peft needs one adapter to build its wrapper; this rank-1 one is never used by any row.
        idle = LoraConfig(r=1, alpha=1, target_modules=[sorted(self.linear_names - {"lm_head"})[0]])
        self.model = apply_lora(model, idle, seed=0).eval().requires_grad_(False)
        self.max_loras = max_loras
        self.spill_dir = Path(spill_dir)
        self.adapters: dict[str, _Adapter] = {}
        self.evictions = 0

    # ------------------------------------------------------------------------------------------- residency
    def resident(self) -> list[str]:
        return [n for n, a in self.adapters.items() if a.spilled is None]

    def resident_bytes(self) -> int:
        """Memory of the resident adapters (weights; gradients and optimizer moments of the trainable ones)."""
        return sum(self.adapter_bytes(n) for n in self.resident())

    def adapter_bytes(self, name: str) -> int:
        """Memory of adapter `name` when resident (0: the base, or an unknown name)."""
        adapter = self.adapters.get(name)
        return adapter_bytes(adapter.parameters, adapter.trainable) if adapter is not None else 0

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

    @contextlib.contextmanager
    def active(self, name: str) -> Iterator[None]:
        """Run the block's passes through adapter `name` (resident), or the base model alone for `BASE`."""
        if name == BASE:
            with self.model.disable_adapter():
                yield
            return
        self.model.set_adapter(name)
        try:
            yield
        finally:
            self._trainable_flags()

    def _trainable_flags(self) -> None:
        """peft's set_adapter and add_adapter mark adapters trainable as they go: put every resident one's flag back."""
        for name in self.resident():
            for p in self._params(name).values():
                p.requires_grad_(self.adapters[name].trainable)

    def free(self, need: int, keep: set[str], room) -> bool:
        """Evict least recently used adapters outside `keep` until `room()` (bytes) is at least `need`; whether it is."""
        while room() < need:
            others = [n for n in self.resident() if n not in keep]
            if not others:
                return False
            self._evict(min(others, key=lambda n: self.adapters[n].last_used))
        return True

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
        self._inject(name, adapter, seed=0)  # the weights come from the folder next
        self._load_into(name, folder, with_state=True)
        shutil.rmtree(folder, ignore_errors=True)
        log.info("restored adapter %s (%d resident)", name, len(self.resident()))

    # -------------------------------------------------------------------------------------------- lifecycle
    def create(self, name: str, lora: LoraConfig, seed: int = 0, trainable: bool = True) -> None:
        """A fresh adapter (B = 0: it starts as the base model), A drawn from `seed`."""
        if name in self.adapters:
            raise ValueError(f"adapter {name!r} exists")
        self._make_room(keep=set())
        self.adapters[name] = adapter = _Adapter(lora, trainable, last_used=time.monotonic())
        self._inject(name, adapter, seed)

    def snapshot(self, source: str, name: str) -> None:
        """A frozen copy of `source`'s current weights (a sampler's view of a training adapter)."""
        self.ensure([source])
        self.create(name, self.adapters[source].lora, trainable=False)
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

    def _inject(self, name: str, adapter: _Adapter, seed: int) -> None:
        from posttrain_core.models.lora import add_adapter
        from posttrain_core.train.loop import adamw

        add_adapter(self.model, name, adapter.lora, seed)
        self.model.eval()
        self._trainable_flags()
        params = list(self._params(name).values())
        adapter.parameters = sum(p.numel() for p in params)
        if adapter.trainable:
            adapter.optimizer = adamw(params, lr=1e-4)  # each optim_step sets the request's AdamParams

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
        from posttrain_core.train.loop import optimizer_step

        self.ensure([name])
        adapter = self.adapters[name]
        if adapter.optimizer is None:
            raise UserError(f"model {name!r} is a sampler snapshot; it has no optimizer")
        for group in adapter.optimizer.param_groups:
            group.update(
                lr=float(adam.get("learning_rate", 1e-4)),
                betas=(float(adam.get("beta1", 0.9)), float(adam.get("beta2", 0.95))),
                eps=float(adam.get("eps", 1e-12)),
                weight_decay=float(adam.get("weight_decay", 0.0)),
            )
        params = list(self._params(name).values())
        norm, _ = optimizer_step(params, adapter.optimizer, None, float(adam.get("grad_clip_norm") or 0.0))
        adapter.steps += 1
        return {"grad_norm:max": norm}

    # ------------------------------------------------------------------------------------------ save / load
    def save(self, name: str, folder: Path, with_state: bool, base_path: str | None = None) -> None:
        """Write a peft adapter folder (adapter_config.json + adapter_model.safetensors) and, `with_state`, the
        optimizer state, pending gradients and step count (`STATE_FILE`)."""
        from safetensors.torch import save_file

        from posttrain_core.models.lora import peft_config

        self.ensure([name])
        adapter = self.adapters[name]
        folder.mkdir(parents=True, exist_ok=True)
        params = self._params(name)
        save_file({k: p.detach().contiguous() for k, p in params.items()}, str(folder / "adapter_model.safetensors"))
        peft_config(adapter.lora, base_model_name_or_path=base_path).save_pretrained(str(folder))
        if with_state:
            state = {
                "optimizer": adapter.optimizer.state_dict() if adapter.optimizer is not None else None,
                "grads": {k: p.grad for k, p in params.items() if p.grad is not None},
                "steps": adapter.steps,
            }
            torch.save(state, folder / STATE_FILE)

    def load(self, name: str, folder: Path, with_state: bool, trainable: bool = True) -> LoraConfig:
        """A new adapter `name` from a folder `save` wrote (weights; `with_state`: optimizer state too).

        Raises:
            UserError: `with_state` and the folder holds no optimizer state (a sampler checkpoint).
        """
        import peft

        if with_state and not (folder / STATE_FILE).exists():
            raise UserError("path: this checkpoint holds no optimizer state (save it with save_state to resume one)")
        saved = peft.LoraConfig.from_pretrained(str(folder))  # its adapter_config.json; the weights come next
        lora = LoraConfig(r=saved.r, alpha=saved.lora_alpha, target_modules=sorted(saved.target_modules))
        self.create(name, lora, trainable=trainable)
        self._load_into(name, folder, with_state)
        return lora

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
        if with_state:
            state = torch.load(folder / STATE_FILE, weights_only=True)
            if adapter.optimizer is not None and state["optimizer"] is not None:
                adapter.optimizer.load_state_dict(state["optimizer"])
            for k, g in state["grads"].items():
                params[k].grad = g
            adapter.steps = state["steps"]
