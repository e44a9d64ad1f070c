#!/usr/bin/env bash
# An MLflow tracking server for shared runs: a SQL store, artifacts proxied by the server (clients need no storage
# keys; their runs' artifacts are mlflow-artifacts:/ URIs that the server resolves against ARTIFACTS).
#   infra/mlflow-server.sh PORT STORE [ARTIFACTS [MLFLOW-SERVER-OPTIONS...]]
# STORE: a folder (SQLite in STORE/mlflow.db, made on first start) or a SQLAlchemy URL such as
#   postgresql+psycopg://USER@HOST:5432/DB (password in PGPASSWORD, not in the URL: the URL is on the command line).
# ARTIFACTS: a folder (default: STORE/artifacts for a folder STORE) or s3://BUCKET/PREFIX, written with the
#   server's own AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (AWS_DEFAULT_REGION; MLFLOW_S3_ENDPOINT_URL for an
#   S3-compatible server such as infra/s3-local.sh): the only place the keys live.
# It serves http://127.0.0.1:PORT, one worker; options after ARTIFACTS go to `mlflow server` and win (to serve a
# team: --host 0.0.0.0 --allowed-hosts mlflow.example.org --workers 4). Clients:
#   MLFLOW_TRACKING_URI=http://127.0.0.1:PORT arlflow pipeline
# MLflow's GenAI job runner (seven worker processes, ~20 s more start-up) stays off unless
# MLFLOW_SERVER_ENABLE_JOB_EXECUTION=true; telemetry is off unless MLFLOW_DISABLE_TELEMETRY=false.
# Stop it with Ctrl-C, or `kill -- -PGID` when started under setsid (the server spawns a uvicorn worker).
set -euo pipefail
usage="usage: infra/mlflow-server.sh PORT STORE [ARTIFACTS [MLFLOW-SERVER-OPTIONS...]]"
port=${1:?$usage}
store=${2:?$usage}
artifacts=${3:-}
shift $(( $# < 3 ? $# : 3 ))
mlflow=${MLFLOW:-$(dirname "$0")/../.venv/bin/mlflow}
[ -x "$mlflow" ] || mlflow=$(command -v mlflow) || { echo "mlflow not found: run make install" >&2; exit 2; }
if [[ $store != *://* ]]; then
  mkdir -p "$store"
  store=$(cd "$store" && pwd)
  artifacts=${artifacts:-$store/artifacts}
  store="sqlite:///$store/mlflow.db"
fi
[ -n "$artifacts" ] || { echo "a database STORE needs ARTIFACTS (a folder or s3://BUCKET/PREFIX); $usage" >&2; exit 2; }
if [[ $artifacts != *://* ]]; then
  mkdir -p "$artifacts"
  artifacts=$(cd "$artifacts" && pwd)
fi
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false}
export MLFLOW_DISABLE_TELEMETRY=${MLFLOW_DISABLE_TELEMETRY:-true}
exec "$mlflow" server --backend-store-uri "$store" --serve-artifacts --artifacts-destination "$artifacts" \
  --host 127.0.0.1 --port "$port" --workers 1 "$@"
