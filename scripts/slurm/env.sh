# Collective-library environment per GPU kind, sourced by launch.sh. GPU_KIND: mi300x | h100 | h200.
# Site-specific settings (InfiniBand HCAs, network interfaces) are left to the cluster: set
# them in the environment before sbatch and they are kept.
#
# Sized for several communicators and streams per rank: a TSP rank talks on three
# communicators of its group (K/V collectives, weight broadcasts and reduces, the MLP ring's
# point-to-point pairs), plus data and pipeline parallel, each on its own stream beside the
# compute stream. Channel buffers are allocated per communicator (channels x peers x
# NCCL_BUFFSIZE), so a channel count tuned for one all-reduce communicator multiplies; and a
# GPU's hardware queues are shared by all streams, so too few of them serialise the
# transfers TSP overlaps with compute.
case "${GPU_KIND:-mi300x}" in
  mi300x)
    # RCCL on AMD Instinct MI300X (ROCm): fine-grained PCIe memory for peer access; RCCL's
    # own channel count (112 channels, tuned for one all-reduce, cost ~3 GB per
    # communicator); 4 hardware queues (HIP's default) for compute plus two transfer streams.
    export HSA_FORCE_FINE_GRAIN_PCIE=${HSA_FORCE_FINE_GRAIN_PCIE:-1}
    export GPU_MAX_HW_QUEUES=${GPU_MAX_HW_QUEUES:-4}
    export TORCH_NCCL_HIGH_PRIORITY=${TORCH_NCCL_HIGH_PRIORITY:-1}
    ;;
  h100|h200)
    # NCCL on NVIDIA Hopper with NVLink/NVSwitch inside the node. NVLink SHARP (NVLS) speeds
    # up the baselines' reduce-scatters and the data-parallel reduce; its multicast buffers
    # are reserved per communicator that runs an NVLS collective (TSP's weight and ring
    # communicators run none). Kept on so that every mode of a comparison runs alike.
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
