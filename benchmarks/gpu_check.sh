#!/usr/bin/env bash
# The GPU check in one command, for the borrowed GPU machine (one H200; its own python3 with torch and
# CUDA, no virtual environment, no package index, no Ray), or with --dry-run on this machine's CPU:
#
#   benchmarks/gpu_check.sh [--dry-run] OUT_DIR
#
# 1. The interpreter: on the GPU machine `python3`, with the wheels of scripts/gpu_wheels.txt that it lacks
#    (or holds at another version) installed from the carried .cache/gpu-carry/wheels into a folder of their
#    own; with --dry-run `.venv/bin/python`, under benchmarks/gpu_dry_site.py, which lets it import only what
#    the GPU machine has or the check carries (so importing Ray fails, as it would there).
# 2. The checkout goes on PYTHONPATH (and proto/, for the generated stubs): no install of Tandem itself.
# 3. benchmarks/gpu_check.py runs the steps (docs/gpu.md) and writes OUT_DIR/gpu_check.json and its
#    plots; everything printed goes to OUT_DIR/gpu_check.log as well. At most 5 files land in OUT_DIR.
# Exits 0 when every step passed (the NCCL pair, which needs two GPUs, is reported as not run).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
dry=()
if [ "${1:-}" = "--dry-run" ]; then
    dry=(--dry-run)
    shift
fi
if [ $# -ne 1 ]; then
    echo "usage: benchmarks/gpu_check.sh [--dry-run] OUT_DIR" >&2
    exit 2
fi
mkdir -p "$1"
out=$(cd "$1" && pwd)
log="$out/gpu_check.log"
: >"$log"
carry="$root/.cache/gpu-carry/wheels"
site=$(mktemp -d "${TMPDIR:-/tmp}/tandem-gpu-site.XXXXXX")
trap 'rm -rf "$site"' EXIT

if [ ${#dry[@]} -gt 0 ]; then
    py="$root/.venv/bin/python"
    [ -x "$py" ] || py=python3
    "$py" benchmarks/gpu_dry_site.py "$site/dry" 2>&1 | tee -a "$log"
    export PYTHONPATH="$site/dry:$site/wheels:$root:$root/proto"
else
    py=python3
    export PYTHONPATH="$site/wheels:$root:$root/proto"
fi
export PYTHONUNBUFFERED=1
# Tandem's C++ CPU kernels are for CPU serving: here the CPU runs only references (the CUDA tests' CPU
# side) and the dry run's tiny shapes, on torch's own kernels, which spares a minute of compiling them.
export TANDEM_CPU_KERNELS=0

# The carried wheels whose distribution the interpreter lacks or holds at another version.
mapfile -t wheels < <("$py" - "$carry" <<'EOF'
import sys
from importlib import metadata
from pathlib import Path

for wheel in sorted(Path(sys.argv[1]).glob("*.whl")):
    name, version = wheel.name.split("-")[:2]
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        have = None
    if have != version:
        print(wheel)
EOF
)
if [ ${#wheels[@]} -gt 0 ] && [ ${#dry[@]} -gt 0 ]; then
    # The wheels are for the GPU machine's CPython 3.12; here the interpreter's own packages stand in.
    echo "dry run: would install ${#wheels[@]} carried wheels: ${wheels[*]##*/}" | tee -a "$log"
elif [ ${#wheels[@]} -gt 0 ]; then
    echo "installing ${#wheels[@]} carried wheels: ${wheels[*]##*/}" | tee -a "$log"
    "$py" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site/wheels" "${wheels[@]}" 2>&1 | tee -a "$log" || exit 1
elif [ ! -d "$carry" ]; then
    echo "no carried wheels ($carry): using the interpreter's own packages" | tee -a "$log"
else
    echo "every carried wheel is installed already" | tee -a "$log"
fi

"$py" benchmarks/gpu_check.py "$out" "${dry[@]}" 2>&1 | tee -a "$log"
exit "${PIPESTATUS[0]}"
