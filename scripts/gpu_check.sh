#!/usr/bin/env bash
# One-GPU check (under 8 minutes on an H100/H200/MI300X): rank 0 of the D=8 7B/128K job per
# mode on real kernels with the fake process-group backend; peak memory against the
# planner and per-rank compute time of TSP against TP+SP, into one results file.
#   scripts/gpu_check.sh [OUT.json] [extra flags, e.g. --num-layers 8]
# Needs torch (CUDA or ROCm build) and megatron-core 0.16.x importable; installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
gpu=$(python -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '-') if torch.cuda.is_available() else 'cpu')")
out=${1:-bench/results/gpu-check-$gpu.json}
shift || true
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
timeout 470 python -m megatron_tsp.measure.gpucheck --out "$out" "$@"
