#!/usr/bin/env bash
# Submit TSP and its baselines on the same model, data, seed and global batch, then a job
# that collects their iteration logs into one table (runs/compare-<seq>-<nodes>.md).
#   scripts/slurm/submit-comparison.sh 128k 1      # 1 node:  TSP-8, TP-8+SP, TP-8+SP with the ring MLP,
#                                                  #          TP-4xCP-2, TP-2xCP-4, CP-8 with FSDP2
#   scripts/slurm/submit-comparison.sh 16k 128     # 128 nodes
# The CP baselines need Megatron-LM (MEGATRON_LM_PATH); without it only TSP and TP+SP run.
set -euo pipefail
SEQ=${1:?sequence length: 16k or 128k}
NODES=${2:?nodes: 1 or 128}
case "$NODES" in
  1) SCRIPT=scripts/slurm/train-1node.sbatch ;;
  128) SCRIPT=scripts/slurm/train-128nodes.sbatch ;;
  *) echo "nodes must be 1 or 128 (got $NODES)" >&2; exit 2 ;;
esac
MODES=(tsp8 tp8-sp tp8-sp-ring)
[[ -n "${MEGATRON_LM_PATH:-}" ]] && MODES+=(tp4-cp2 tp2-cp4 cp8-fsdp)
mkdir -p runs
JOBS=()
LOGS=()
for mode in "${MODES[@]}"; do
  config="configs/7b/$SEQ-$mode.yaml"
  run_dir="runs/compare-$SEQ-$NODES/$mode"
  job=$(CONFIG="$config" RUN_DIR="$run_dir" sbatch --parsable --export=ALL "$SCRIPT")
  echo "submitted $mode: job $job ($config)"
  JOBS+=("$job")
  LOGS+=("$run_dir")
done
deps=$(IFS=:; echo "${JOBS[*]}")
sbatch --dependency="afterany:$deps" --job-name=tsp-compare --nodes=1 --ntasks=1 \
  --output="runs/compare-$SEQ-$NODES.out" \
  --wrap="megatron-tsp compare ${LOGS[*]} --markdown runs/compare-$SEQ-$NODES.md"
echo "comparison table: runs/compare-$SEQ-$NODES.md when jobs ${JOBS[*]} have finished"
