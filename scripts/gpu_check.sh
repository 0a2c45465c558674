#!/usr/bin/env bash
# One-GPU check (about 3 minutes on an H100/H200/MI300X, within a budget of 7): every
# attention backend against the math reference and timed at 8K-128K, then rank 0 of the D=8
# 7B/128K job per mode (8 layers) with the fake process-group backend: peak memory against
# the planner and per-rank compute time of TSP against TP+SP. Results are written as they
# come, into bench/results/gpu-check-<gpu>.json (or OUT.json).
#   scripts/gpu_check.sh [OUT.json] [megatron-tsp gpu-check flags, e.g. --num-layers 4]
# Needs python3 with torch (CUDA or ROCm build) and megatron-core 0.16.x importable; installs
# nothing. On a machine that cannot download, install megatron-core's wheel first (README).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
gpu=$("$py" -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '-') if torch.cuda.is_available() else 'cpu')")
out=${1:-bench/results/gpu-check-$gpu.json}
shift || true
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
timeout 470 "$py" -m megatron_tsp.cli gpu-check --out "$out" --num-layers 8 "$@"
