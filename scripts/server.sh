#!/usr/bin/env bash
# A real Prefect server (UI on http://127.0.0.1:4200) and an MLflow UI (http://127.0.0.1:5000) on localhost,
# both reading the project's store. Ctrl-C stops both.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
BIN=$(dirname "$PY")
STORE=${POSTTRAIN_STORE:-$PWD/.posttrain}
mkdir -p "$STORE"
export PREFECT_SERVER_ANALYTICS_ENABLED=false MLFLOW_DISABLE_TELEMETRY=1 MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false
"$BIN/prefect" server start --host 127.0.0.1 --port "${PREFECT_PORT:-4200}" &
PREFECT_PID=$!
"$BIN/mlflow" server --host 127.0.0.1 --port "${MLFLOW_PORT:-5000}" --workers 1 \
  --backend-store-uri "sqlite:///$STORE/mlflow.db" --artifacts-destination "$STORE/mlruns" &
MLFLOW_PID=$!
trap 'kill $PREFECT_PID $MLFLOW_PID 2>/dev/null || true' EXIT INT TERM
echo "Prefect UI: http://127.0.0.1:${PREFECT_PORT:-4200}   MLflow UI: http://127.0.0.1:${MLFLOW_PORT:-5000}"
echo "In another shell: export PREFECT_API_URL=http://127.0.0.1:${PREFECT_PORT:-4200}/api"
wait
