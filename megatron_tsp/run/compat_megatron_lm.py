"""Run Megatron-LM's own training code (``megatron/training``, ``pretrain_gpt.py``) on CPU with
gloo: opt-in, for the tests and for trying the Megatron-LM integration without a GPU.

On top of megatron-core's CPU shims (:mod:`megatron_tsp.run.compat`), Megatron-LM's training
loop assumes CUDA in the places below, each covered by one shim that names where it applies
(tags core_v0.16.1 and core_v0.19.0; a shim for one of them names its megatron-core release).
As in :mod:`compat`, a shim changes where a tensor lives, or skips a GPU-only step (kernel
builds and warm-ups), never a value. The CPU also needs the Megatron-LM flags of
:data:`CPU_FLAGS`, which a user passes as on a GPU without TransformerEngine or apex (the fused
paths compile CUDA kernels, or torch.compile them on first use).
"""

from __future__ import annotations

from typing import Sequence, Union

import torch

from megatron_tsp.run.compat import enable_cpu_support
from megatron_tsp.run.upstream import Rewrite, RewriteEach

_V016, _V019 = ((0, 16),), ((0, 19),)

CPU_FLAGS = ("--distributed-backend", "gloo", "--transformer-impl", "local", "--no-gradient-accumulation-fusion",
             "--no-persist-layer-norm", "--no-rope-fusion", "--no-bias-dropout-fusion", "--no-bias-gelu-fusion",
             "--no-masked-softmax-fusion")

TRAINING_SHIMS: Sequence[Union[Rewrite, RewriteEach]] = (
    Rewrite("megatron.training.initialize", "initialize_megatron",
            (('assert torch.cuda.is_available(), "Megatron requires CUDA."', "pass"),),
            "training/initialize.py:62 (0.19: 66)"),
    # torch.distributed starts with no device to bind; the model-parallel groups are created
    # only where a device was counted.
    Rewrite("megatron.training.initialize", "_initialize_distributed",
            (("device_count = torch.cuda.device_count()", "device_count = 1"),
             ("torch.cuda.set_device(args.local_rank)", "pass"),
             ("device_id = torch.device(f'cuda:{args.local_rank}')", "device_id = None")),
            "training/initialize.py:319-332 (0.19: 270-283)"),
    # The model-parallel RNG tracker is seeded only where a GPU is counted.
    Rewrite("megatron.training.initialize", "_set_random_seed",
            (("if torch.cuda.device_count() > 0:", "if True:"),), "training/initialize.py:422 (0.19: 447)"),
    # Warming up the fused kernels draws random CUDA tensors; nothing to warm on the CPU.
    Rewrite("megatron.training.initialize", "set_jit_fusion_options",
            (("_warmup_jit_function(", "(lambda **_: None)("),), "training/initialize.py:460 (0.19: 494)"),
    Rewrite("megatron.training.initialize", "_compile_dependencies",
            (("fused_kernels.load(args)", "pass"),), "training/initialize.py:224/227", _V016),
    # The GPU's compute capability gates CUDA_DEVICE_MAX_CONNECTIONS checks and stream priorities.
    Rewrite("megatron.training.utils", "get_device_arch_version",
            (('return torch.cuda.get_device_properties(torch.device("cuda:0")).major', "return 0"),),
            "training/utils.py:448", _V016),
    Rewrite("megatron.training.utils.common_utils", "get_device_arch_version",
            (('return torch.cuda.get_device_properties(torch.device("cuda:0")).major', "return 0"),),
            "training/utils/common_utils.py:502", _V019),
    # --use-torch-fsdp2 asks for high-priority NCCL streams on any GPU (arguments.py's
    # `fsdp2 or megatron_fsdp and arch >= 10`); gloo's groups take no NCCL options.
    Rewrite("megatron.core.parallel_state", "get_nccl_options",
            (("if pg_name in nccl_comm_cfgs:",
              "if pg_name in nccl_comm_cfgs and torch.distributed.get_backend() == 'nccl':"),),
            "core/parallel_state.py:158 (0.19: 176)"),
    # Scalars of the loop (timers, loss sums, exit flags, data-loader flags) made on cuda.
    *(RewriteEach(module, (("device='cuda'", "device='cpu'"),))
      for module in ("megatron.training.training", "megatron.training.checkpointing",
                     "megatron.core.rerun_state_machine")),
    RewriteEach("megatron.training.utils", (("device='cuda'", "device='cpu'"),), _V016),
    RewriteEach("megatron.training.utils.common_utils", (("device='cuda'", "device='cpu'"),), _V019),
)


def _tensor_stays(self, device=None, non_blocking=False, **kwargs):
    """``Tensor.cuda()`` on the CPU: the tensor stays where it is (batches, the model)."""
    return self


def _module_stays(self, device=None):
    return self


def _no_cuda_rng_state(device="cuda") -> torch.Tensor:
    """There is no CUDA generator: its state is empty (checkpoints and the rerun state
    machine save it; the CPU generator's state is saved apart)."""
    return torch.empty(0, dtype=torch.uint8)


def _set_no_cuda_rng_state(new_state, device="cuda") -> None:
    pass


_ENABLED = False


def enable_megatron_lm_cpu_support() -> None:
    """Make Megatron-LM's ``pretrain()`` run on the CPU (idempotent; CPU processes only)."""
    global _ENABLED
    if _ENABLED:
        return
    enable_cpu_support()
    torch.Tensor.cuda = _tensor_stays
    torch.nn.Module.cuda = _module_stays
    torch.cuda.get_rng_state = _no_cuda_rng_state
    torch.cuda.set_rng_state = _set_no_cuda_rng_state
    for shim in TRAINING_SHIMS:
        shim.install()
    _ENABLED = True
