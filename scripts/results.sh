#!/usr/bin/env bash
# Regenerates the committed results of bench/results/ that a CPU can produce (memory plans,
# predictions, plans; the CPU benchmarks have their own commands in docs/measuring.md).
#   scripts/results.sh [memory|predict|plan|all]     (hours for all on 2 cores: TSP's every head-group and MLP setting is planned)
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench/results
what=${1:-all}
run() { echo "+ $*" >&2; "$@" > /dev/null; }

if [[ $what == memory || $what == all ]]; then
  for s in 16k 128k; do
    run megatron-tsp memory "configs/7b/$s-tsp8.yaml" --json "$out/memory-7b-$s.json" --plot "$out/memory-7b-$s.png"
  done
  cmd=(megatron-tsp memory configs/7b/128k-tsp8-norecompute.yaml --modes tsp,tp-sp,tp-sp-ring --per-layer
       --json "$out/memory-7b-128k-per-layer.json")
  { echo "\`${cmd[*]}\` (CPU planner, FakeTensorMode)"; echo; "${cmd[@]}"; } > "$out/memory-7b-128k-per-layer.md"
fi

if [[ $what == predict || $what == all ]]; then
  for gpu in h100 h200 mi300x; do
    for nodes in 1 128; do
      run megatron-tsp predict configs/7b/128k-tsp8.yaml --hardware "configs/hardware/$gpu.yaml" --nodes "$nodes" \
        --json "$out/predict-7b-128k-$gpu-${nodes}node.json"
    done
    for nodes in 1 128; do
      run megatron-tsp predict configs/7b/128k-tsp8.yaml --hardware "configs/hardware/$gpu.yaml" --nodes "$nodes" \
        --modes tsp,tp-sp,tp-sp-ring --sweep 4096,8192,16384,32768,65536,131072,262144 \
        --json "$out/predict-7b-sweep-$gpu-${nodes}node.json"
    done
  done
  # against CP with fully sharded weights (docs/results.md)
  for nodes in 1 128; do
    run megatron-tsp predict configs/7b/128k-tsp8.yaml --hardware configs/hardware/h100.yaml --nodes "$nodes" \
      --modes tsp,tp-sp,cp-fsdp --json "$out/predict-7b-128k-cp-fsdp-h100-${nodes}node.json"
  done
  # one GPU per node: the TSP group's traffic crosses 400G IB (what `bench --like ib-400g` emulates)
  run megatron-tsp predict configs/7b/128k-tsp8.yaml --hardware configs/hardware/h100-ib.yaml --nodes 8 \
    --json "$out/predict-7b-128k-h100-ib-8node.json"
  # interleaved 4K windows: what skipping the blocks out of reach does to TSP against TP+SP
  run megatron-tsp predict configs/7b/128k-window-tsp8.yaml --hardware configs/hardware/h100.yaml --nodes 1 \
    --json "$out/predict-7b-128k-window-h100-1node.json"
  run megatron-tsp predict configs/7b/128k-tsp8-norecompute.yaml --hardware configs/hardware/mi300x.yaml --nodes 128 \
    --modes tsp,tp-sp --sweep 4096,8192,16384,32768,65536,131072,262144 \
    --json "$out/predict-7b-sweep-norecompute-mi300x-128node.json"
  # mixture of experts, experts folded onto the model-parallel ranks in every mode (EP 8); Mixtral's
  # optimizer state needs 16 data-parallel ranks to fit (configs/mixtral-8x7b/model.yaml)
  run megatron-tsp predict configs/mixtral-8x7b/128k-tsp8.yaml --hardware configs/hardware/h100.yaml --nodes 16 \
    --modes tsp,tp-sp,tp-cp --json "$out/predict-mixtral-8x7b-128k-h100-16node.json"
  run megatron-tsp predict configs/olmoe/128k-tsp8.yaml --hardware configs/hardware/h100.yaml --nodes 1 \
    --modes tsp,tp-sp,tp-cp --json "$out/predict-olmoe-128k-h100-1node.json"
fi

if [[ $what == plan || $what == all ]]; then
  grid=32768,65536,131072,262144,524288,1048576
  for gpu in h100 h200 mi300x; do
    run megatron-tsp plan configs/7b/128k-tsp8.yaml --hardware "configs/hardware/$gpu.yaml" --grid "$grid" \
      --out "$out/plan-7b-128k-$gpu"
  done
  run megatron-tsp plan configs/llama3-8b/128k-tsp8.yaml --hardware configs/hardware/h100.yaml --grid "$grid" \
    --out "$out/plan-llama3-8b-128k-h100"
  run megatron-tsp plan configs/7b/128k-window-tsp8.yaml --hardware configs/hardware/h100.yaml --grid 131072,262144 \
    --out "$out/plan-7b-128k-window-h100"
  run megatron-tsp plan configs/mixtral-8x7b/128k-tsp8.yaml --hardware configs/hardware/h100.yaml --nodes 16 \
    --modes tsp,tp-sp,tp-cp --grid "$grid" --out "$out/plan-mixtral-8x7b-128k-h100-16node"
  run megatron-tsp plan configs/olmoe/128k-tsp8.yaml --hardware configs/hardware/h100.yaml \
    --modes tsp,tp-sp,tp-cp --grid "$grid" --out "$out/plan-olmoe-128k-h100"
  run megatron-tsp plan configs/7b/128k-tsp8.yaml --hardware configs/hardware/h100.yaml --modes cp-fsdp \
    --out "$out/plan-7b-128k-h100-cp-fsdp"
  # today's H100 plan of TSP (its calls the model's choice) and TP+SP, without the grid's hours
  run megatron-tsp plan configs/7b/128k-tsp8.yaml --hardware configs/hardware/h100.yaml --modes tsp,tp-sp \
    --out "$out/plan-7b-128k-h100-chosen"
  # what fused norms change: the same plan with megatron-core's torch RMSNorm fallback
  run megatron-tsp plan configs/7b/128k-tsp8.yaml --hardware configs/hardware/h100.yaml --no-fused-norm \
    --out "$out/plan-7b-128k-h100-unfused-norm"
fi
