#!/usr/bin/env bash
# Build the benchmark environment: BENCH_VENV layered on MAIN_VENV (same interpreter; the main venv's packages are
# visible through a .pth file) plus bench/requirements.txt installed --no-deps. Idempotent: a stamp records the
# requirements it was built from. Usage: bash bench/setup_venv.sh [MAIN_VENV] [BENCH_VENV]
set -euo pipefail
cd "$(dirname "$0")/.."
MAIN_VENV=${1:-.venv}
BENCH_VENV=${2:-.venv-bench}
STAMP="$BENCH_VENV/.installed-stamp"
want=$(cat bench/requirements.txt constraints.txt | sha256sum | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$BENCH_VENV/bin/python" ]; then
  exit 0
fi
"$MAIN_VENV/bin/python" -m venv --clear "$BENCH_VENV"
main_site=$("$MAIN_VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
bench_site=$("$BENCH_VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# addsitedir (not a bare path line) so the main venv's own .pth files (the editable posttrain install) apply too.
echo "import site; site.addsitedir('$(cd "$main_site" && pwd)')" > "$bench_site/_posttrain_main_venv.pth"
"$BENCH_VENV/bin/python" -m pip install -q --no-deps -c constraints.txt -r bench/requirements.txt
"$BENCH_VENV/bin/python" - <<'PY'
"""Every requirement of the bench packages must already be met by the main venv (nothing was installed for them)."""
import sys
from importlib.metadata import PackageNotFoundError, distribution, version

from packaging.requirements import Requirement

bad = []
for line in open("bench/requirements.txt"):
    line = line.split("#")[0].strip()
    if not line:
        continue
    for spec in distribution(Requirement(line).name).requires or []:
        req = Requirement(spec)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = version(req.name)
        except PackageNotFoundError:
            bad.append(f"{req} (missing)")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            bad.append(f"{req} (have {have})")
if bad:
    sys.exit("bench venv: requirements not met by the main venv: " + "; ".join(bad))
import torch, transformers, trl  # noqa: E401
from trl import GRPOTrainer, SFTTrainer  # noqa: F401
print(f"bench venv: trl {trl.__version__} on torch {torch.__version__}, transformers {transformers.__version__}")
PY
echo "$want" > "$STAMP"
