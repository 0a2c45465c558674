#!/usr/bin/env bash
# One-GPU check for a lent H100/H200 (docs/measuring.md; ../shared/gpu/README.md): at most 420 s
# in all, the sum of its steps' limits and kill allowances (tests/test_gpucheck.py holds it to
# that), so that a machine's start and this fit in 15 minutes of device time. What the H200
# measured (bench/results/gpu-check-H200*) is left out: the ring MLP and TP x CP at 128K, and
# the comparison without recompute. Each step is its own process, so that a hang, a crash or a
# spoiled CUDA context ends that step only:
#  1. kernels: fp32-accumulating GEMMs; what each attention backend resolves to here and whether
#     its check passes, per head dim; packed documents at micro-batch 1 in bf16 against math in
#     fp32; every backend against math and timed at 8K-128K (what 30 s allow); warnings and
#     library versions;
#  2. 8K, 2 layers (as gpu-check-H200-2layers-auto-8k), rank 0 of the D=8 7B per mode, TSP and
#     TP+SP on auto, with a profiled step each: top kernels by device time and kernel launches;
#  3. the same TSP at rank 3, whose zigzag chunks (3 and 12) attend other blocks than rank 0's;
#  4. the same TSP with one head group per call (and so the ring MLP), against auto's (2): all
#     8 head groups in one call, every shard gathered at once in attention and MLP;
#  5. 16K, TSP and TP+SP on auto (all 8 head groups in one call there too), and 6. TSP with one;
#  7. 128K with full recompute, 4 layers, TSP and TP+SP on auto (cuDNN from 16K keys; one
#     head group a call, the MLP's ring), and 8. TSP as the model chooses for an H100 or H200
#     (`megatron-tsp predict`, predict-7b-128k-h{100,200}-1node.json): 4 head groups and all
#     8 MLP shards a call;
#  9. a D=1 training run of the tiny config in bf16 through `megatron-tsp train`.
# Results, as they come: OUT.json (1), OUT-8k.json (2), OUT-8k-rank3.json, OUT-8k-groups1.json,
# OUT-16k.json, OUT-16k-groups1.json, OUT-128k.json, OUT-128k-chosen.json, each with a .md table, and
# OUT-train-d1.{log,jsonl}.
#   scripts/gpu_check.sh [OUT.json]   (default bench/results/gpu-check-<gpu>.json)
# Without a GPU it rehearses: the 7B's modes are planned and recorded as skipped, the rest runs.
# Needs python3 with torch (CUDA or ROCm build) and megatron-core 0.16.x or 0.19.x importable;
# installs nothing. On a machine that cannot download, install megatron-core's wheel first (README).
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0

# step SECONDS COMMAND...: COMMAND and what it starts, stopped after SECONDS (SIGTERM: a run's
# results so far are on disk) and killed 5 s later where it does not end; a failure is noted
# and the next step runs.
step() {
  local limit=$1 rc
  shift
  timeout -k 5 "$limit" "$@"
  rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "gpu_check.sh: stopped after ${limit}s: $*" >&2
  fi
  [ "$rc" -eq 0 ] || status=1
}

if [ $# -ge 1 ]; then
  out=$1
else
  gpu=$(step 15 "$py" -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '-') \
if torch.cuda.is_available() else 'cpu')")
  out=bench/results/gpu-check-${gpu:-unknown}.json
fi
base=${out%.json}
check=("$py" -m megatron_tsp.cli gpu-check)
at8k=(--config configs/7b/16k-tsp8.yaml --seq-length 8192 --num-layers 2)
at16k=(--config configs/7b/16k-tsp8.yaml --num-layers 2)

step 55 "${check[@]}" "${at8k[@]}" --parts gemm,checks,documents,backends --budget-s 45 --out "$out"
step 40 "${check[@]}" "${at8k[@]}" --parts modes,profile --modes tsp,tp-sp --budget-s 22 --out "$base-8k.json"
step 25 "${check[@]}" "${at8k[@]}" --parts modes --modes tsp --rank 3 --out "$base-8k-rank3.json"
step 30 "${check[@]}" "${at8k[@]}" --parts modes --modes tsp --tsp-head-groups-per-call 1 \
  --out "$base-8k-groups1.json"
step 40 "${check[@]}" "${at16k[@]}" --parts modes --modes tsp,tp-sp --budget-s 22 --out "$base-16k.json"
step 30 "${check[@]}" "${at16k[@]}" --parts modes --modes tsp --tsp-head-groups-per-call 1 \
  --out "$base-16k-groups1.json"
at128k=(--config configs/7b/128k-tsp8.yaml --num-layers 4 --parts modes)
step 60 "${check[@]}" "${at128k[@]}" --modes tsp,tp-sp --budget-s 35 --out "$base-128k.json"
step 35 "${check[@]}" "${at128k[@]}" --modes tsp --tsp-head-groups-per-call 4 --tsp-mlp-shards-per-call 8 \
  --budget-s 20 --out "$base-128k-chosen.json"
step 40 "$py" -m megatron_tsp.cli train configs/tiny-cpu.yaml --tsp-size 1 --nproc 1 --train-iters 20 --bf16 \
  --log-json "$base-train-d1.jsonl" > "$base-train-d1.log" 2>&1
tail -3 "$base-train-d1.log"
exit $status
