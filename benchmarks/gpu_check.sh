#!/usr/bin/env bash
# The CUDA checks, for a machine with an NVIDIA GPU (CI has none and does not run this):
# the GPU-marked tests, KV transfer between two CUDA processes over NCCL (bit for bit; needs two
# GPUs, says it is skipped otherwise), then the decode roofline benchmark on CUDA against the HBM
# bandwidth it measures in the same run. Results land in benchmarks/results/decode_roofline_cuda.{json,png}.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-.venv/bin/python}"
"$py" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
"$py" -m pytest -q -m gpu tests
"$py" benchmarks/gpu_kv_nccl.py
"$py" benchmarks/decode_roofline.py --device cuda --threads 8 "$@"
