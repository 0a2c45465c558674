#!/usr/bin/env bash
# Run one training job on the current Slurm allocation: srun starts one torchrun per node,
# torchrun starts GPUS_PER_NODE ranks and meets the other nodes at a c10d rendezvous on the
# first node. Called by the *.sbatch scripts; reads:
#   CONFIG            configs/...yaml (required)
#   GPU_KIND          mi300x | h100 | h200 (collective-library environment, default mi300x)
#   MEGATRON_LM_PATH  a Megatron-LM checkout (core_v0.16.1 or core_v0.19.0, the installed
#                     megatron-core's tag): run its pretrain_gpt.py through
#                     scripts/pretrain_gpt_tsp.py; unset: run `megatron-tsp train`
#   RUN_DIR           logs and checkpoints (default runs/<config>-<job id>)
#   EXTRA_ARGS        more Megatron-style flags, appended last
set -euo pipefail
: "${CONFIG:?set CONFIG=configs/...yaml}"
: "${SLURM_JOB_ID:?run inside a Slurm allocation (sbatch scripts/slurm/train-1node.sbatch)}"
REPO=${REPO:-${SLURM_SUBMIT_DIR:-$(pwd)}}
cd "$REPO"
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
RUN_DIR=${RUN_DIR:-runs/$(basename "$CONFIG" .yaml)-$SLURM_JOB_ID}
mkdir -p "$RUN_DIR/logs" "$RUN_DIR/checkpoints"
# shellcheck source=scripts/slurm/env.sh
source scripts/slurm/env.sh

MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-29500}
CKPT="$RUN_DIR/checkpoints"
read -r -a EXTRA <<< "${EXTRA_ARGS:-}"

# Preemption, scancel and the time limit send SIGTERM (the *.sbatch scripts ask for it 180 s
# before the limit: #SBATCH --signal=TERM@180). With --exit-signal-handler every rank finishes
# its step, saves a checkpoint and exits 0; the next job resumes from it (--load).
# megatron_tsp.run.torchrun is torchrun that passes SIGTERM on to the ranks and then exits as
# they do (torchrun itself exits 1 after they saved, and Slurm would count a failure); a
# torchrun that stops them kills those still saving after TORCH_ELASTIC_SHUTDOWN_TIMEOUT.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-170}
if [[ -n "${MEGATRON_LM_PATH:-}" ]]; then
  read -r -a FLAGS <<< "$(megatron-tsp args "$CONFIG")"
  ENTRY=(scripts/pretrain_gpt_tsp.py "${FLAGS[@]}" --save "$CKPT" --load "$CKPT" --exit-signal-handler
         --tensorboard-dir "$RUN_DIR/tensorboard" "${EXTRA[@]}")
else
  ENTRY=(-m megatron_tsp.cli train "$CONFIG" --save "$CKPT" --load "$CKPT" --exit-signal-handler
         --log-json "$RUN_DIR/log.jsonl" "${EXTRA[@]}")
fi

echo "job $SLURM_JOB_ID: $SLURM_NNODES node(s) x $GPUS_PER_NODE $GPU_KIND, config $CONFIG, run dir $RUN_DIR"
srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
  --output "$RUN_DIR/logs/%N.log" \
  python3 -m megatron_tsp.run.torchrun --nnodes "$SLURM_NNODES" --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$SLURM_JOB_ID" \
    --log-dir "$RUN_DIR/logs/torchrun" \
    "${ENTRY[@]}"
