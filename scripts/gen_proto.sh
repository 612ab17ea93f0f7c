#!/usr/bin/env bash
# Regenerates the committed Python stubs from proto/tandem/v1/*.proto.
# Usage: scripts/gen_proto.sh [OUT_DIR]   (default: proto/, in place)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-proto}"
py="${PYTHON:-.venv/bin/python}"
"$py" -m grpc_tools.protoc -I proto \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  proto/tandem/v1/*.proto
