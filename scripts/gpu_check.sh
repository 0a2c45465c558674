#!/usr/bin/env bash
# One-GPU check (about 7 minutes on an H100/H200/MI300X, within a budget of 9.7):
#  1. fp32-accumulating GEMMs, every attention backend against the math reference and timed at
#     8K-128K, then rank 0 of the D=8 7B/128K job (full recompute) per mode, 8 layers, with the
#     fake process-group backend: peak memory against the planner, compute time, TFLOP/s;
#  2. the same rank without recompute, TSP against TP+SP;
#  3. a D=1 training run of the tiny config in bf16 on this GPU, through `megatron-tsp train`;
#  4. TSP's rank at 16K, where `auto` attends all 8 head groups in one call, against one a call.
# Results are written as they come: OUT.json (default bench/results/gpu-check-<gpu>.json),
# OUT-norecompute.json, OUT-train-d1.log, OUT-16k-groups{0,1}.json (0: auto).
#   scripts/gpu_check.sh [OUT.json] [megatron-tsp gpu-check flags for part 1, e.g. --budget-s 200]
# Needs python3 with torch (CUDA or ROCm build) and megatron-core 0.16.x or 0.19.x importable;
# installs nothing. On a machine that cannot download, install megatron-core's wheel first (README).
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
gpu=$("$py" -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '-') if torch.cuda.is_available() else 'cpu')")
out=${1:-bench/results/gpu-check-$gpu.json}
shift || true
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
timeout 300 "$py" -m megatron_tsp.cli gpu-check --out "$out" --num-layers 8 --budget-s 250 "$@" || status=1
timeout 110 "$py" -m megatron_tsp.cli gpu-check --config configs/7b/128k-tsp8-norecompute.yaml --parts modes \
  --modes tsp,tp-sp --num-layers 8 --budget-s 60 --out "${out%.json}-norecompute.json" || status=1
timeout 60 "$py" -m megatron_tsp.cli train configs/tiny-cpu.yaml --tsp-size 1 --nproc 1 --train-iters 20 --bf16 \
  --log-json "${out%.json}-train-d1.jsonl" > "${out%.json}-train-d1.log" 2>&1 || status=1
tail -3 "${out%.json}-train-d1.log"
for groups in 0 1; do
  timeout 55 "$py" -m megatron_tsp.cli gpu-check --config configs/7b/16k-tsp8.yaml --parts modes --modes tsp \
    --num-layers 8 --budget-s 40 --tsp-head-groups-per-call "$groups" --out "${out%.json}-16k-groups$groups.json" \
    || status=1
done
exit $status
