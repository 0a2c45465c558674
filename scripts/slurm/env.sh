# Collective-library environment per GPU kind, sourced by launch.sh. GPU_KIND: mi300x | h100 | h200.
# Site-specific settings (InfiniBand HCAs, network interfaces) are left to the cluster: set
# them in the environment before sbatch and they are kept.
case "${GPU_KIND:-mi300x}" in
  mi300x)
    # RCCL on AMD Instinct MI300X (ROCm): fine-grained PCIe memory for peer access, more
    # channels for the 8-GPU xGMI mesh, bounded hardware queues.
    export HSA_FORCE_FINE_GRAIN_PCIE=${HSA_FORCE_FINE_GRAIN_PCIE:-1}
    export NCCL_MIN_NCHANNELS=${NCCL_MIN_NCHANNELS:-112}
    export GPU_MAX_HW_QUEUES=${GPU_MAX_HW_QUEUES:-2}
    export TORCH_NCCL_HIGH_PRIORITY=${TORCH_NCCL_HIGH_PRIORITY:-1}
    ;;
  h100|h200)
    # NCCL on NVIDIA Hopper with NVLink/NVSwitch inside the node.
    export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-1}
    export NCCL_IB_QPS_PER_CONNECTION=${NCCL_IB_QPS_PER_CONNECTION:-2}
    ;;
  *)
    echo "env.sh: unknown GPU_KIND '${GPU_KIND}' (use mi300x, h100 or h200)" >&2
    return 1 2>/dev/null || exit 1
    ;;
esac
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-^lo,docker}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
