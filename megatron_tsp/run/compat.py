"""Run megatron-core on CPU with gloo (opt-in, for tests and the CPU main job).

megatron-core assumes CUDA in a handful of places (docs/design.md section 7). Each place is
covered by one shim below, listed in ``SHIMS`` with the upstream location it covers, so
that a megatron-core upgrade that moves the code fails loudly in ``enable_cpu_support()``
instead of silently running the stock path.

Two kinds of shim:

* :class:`~megatron_tsp.run.upstream.Rewrite`: the named function's source with literal
  replacements (``device="cuda"`` becomes ``device="cpu"``, a ``torch.cuda.FloatTensor`` type
  check accepts its CPU twin). The function is recompiled in its own module's globals, so
  nothing else about it changes.
* a few direct replacements (``torch.cuda.current_device`` names the CPU, the RNG tracker
  keeps CPU generator states, megatron's torch norms accept sequence parallelism).

Only a process whose device is the CPU enables them (``build.initialize`` and the worker
pool, from the :class:`~megatron_tsp.device.Device` chosen at launch): a process that runs
on a GPU never does. On the CPU every shim only changes *where* a tensor lives or *which*
generator a state belongs to, never a value. What megatron-core gets wrong on every device is
corrected in :mod:`megatron_tsp.run.upstream`.
"""

from __future__ import annotations

import contextlib
from typing import List, Sequence

import torch

from megatron_tsp.run.upstream import Rewrite, fix_moe_without_transformer_engine

_ENABLED = False

_CUDA = '"cuda"'
_CUDA_Q = "'cuda'"

SHIMS: Sequence[Rewrite] = (
    # Causal masks are built on cuda.
    Rewrite("megatron.core.transformer.utils", "get_default_causal_mask",
            ((f"device={_CUDA}", 'device="cpu"'),), "transformer/utils.py:35"),
    Rewrite("megatron.core.transformer.utils", "get_sliding_window_causal_mask",
            ((f"device={_CUDA}", 'device="cpu"'),), "transformer/utils.py:40"),
    # Context-parallel RoPE slice: pinned memory and .cuda().
    Rewrite("megatron.core.models.common.embeddings.rope_utils", "get_pos_emb_on_this_cp_rank",
            (("pin_memory=True", "pin_memory=False"), (".cuda(non_blocking=True)", "")),
            "models/common/embeddings/rope_utils.py:62"),
    # Pipeline parallel with tied embeddings: the last stage's copy is moved to cuda before
    # the first/last-stage all-reduce.
    Rewrite("megatron.core.models.common.language_module.language_module",
            "LanguageModule.setup_embeddings_and_output_layer",
            (("weight.data = weight.data.cuda()", "weight.data = weight.data"),),
            "models/common/language_module/language_module.py:244"),
    # Token counters of the pipeline schedules.
    *(
        Rewrite("megatron.core.pipeline_parallel.schedules", name,
                 ((f"device={_CUDA}", 'device="cpu"'),), f"pipeline_parallel/schedules.py:{line}")
        for name, line in (
            ("forward_backward_no_pipelining", 596),
            ("forward_backward_pipelining_with_interleaving", 983),
            ("forward_backward_pipelining_without_interleaving", 2138),
        )
    ),
    # Optimizer scalars and dtype checks spelled with torch.cuda.* type names.
    Rewrite("megatron.core.optimizer.optimizer", "MixedPrecisionOptimizer.__init__",
            ((f"device={_CUDA_Q}", "device='cpu'"),), "optimizer/optimizer.py:473-485"),
    Rewrite("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__",
            (("'torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor'",
              "'torch.HalfTensor', 'torch.BFloat16Tensor'"),
             ("== 'torch.cuda.FloatTensor'", "== 'torch.FloatTensor'")),
            "optimizer/optimizer.py:671/690"),
    # 0.19: whether a rank holds parameters of a grad-norm group, agreed over the ranks.
    Rewrite("megatron.core.optimizer.optimizer", "MegatronOptimizer.has_grad_norm_group",
            ((f"device={_CUDA_Q}", "device='cpu'"),), "optimizer/optimizer.py:315 (0.19)", ((0, 19),)),
    Rewrite("megatron.core.optimizer.optimizer", "FP32Optimizer.__init__",
            ((f"device={_CUDA_Q}", "device='cpu'"),), "optimizer/optimizer.py:907"),
    Rewrite("megatron.core.optimizer.distrib_optimizer",
            "DistributedOptimizer._build_model_and_main_param_groups",
            (("'torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor'",
              "'torch.HalfTensor', 'torch.BFloat16Tensor'"),
             ("== 'torch.cuda.FloatTensor'", "== 'torch.FloatTensor'")),
            "optimizer/distrib_optimizer.py:361/420"),
    Rewrite("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.__init__",
            (("'torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor'",
              "'torch.HalfTensor', 'torch.BFloat16Tensor'"),),
            "optimizer/distrib_optimizer.py:582"),
    # Optimizer state in the resharding checkpoint format is gathered on DP rank 0 via cuda.
    Rewrite("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.get_parameter_state_dp_zero",
            (("send_tensor = send_tensor.cuda()", "send_tensor = send_tensor"),),
            "optimizer/distrib_optimizer.py:1089"),
    # Gradient norm and clipping.
    Rewrite("megatron.core.optimizer.clip_grads", "get_grad_norm_fp32",
            ((f"device={_CUDA_Q}", "device='cpu'"),), "optimizer/clip_grads.py:90/103/115"),
    Rewrite("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32",
            ((f"device={_CUDA_Q}", "device='cpu'"),
             ("== 'torch.cuda.FloatTensor'", "== 'torch.FloatTensor'")),
            "optimizer/clip_grads.py:167/174"),
    Rewrite("megatron.core.optimizer.clip_grads", "count_zeros_fp32",
            ((f"device={_CUDA_Q}", "device='cpu'"),), "optimizer/clip_grads.py:207"),
    Rewrite("megatron.core.utils", "local_multi_tensor_l2_norm",
            ((f"device={_CUDA}", 'device="cpu"'),), "utils.py:1207"),
    # torch FSDP2 (--use-torch-fsdp2, the cp-fsdp mode): its device mesh is made on cuda.
    Rewrite("megatron.core.distributed.torch_fully_sharded_data_parallel", "TorchFullyShardedDataParallel.__init__",
            (('DeviceMesh.from_group(self.process_group, "cuda")',
              'DeviceMesh.from_group(self.process_group, "cpu")'),),
            "distributed/torch_fully_sharded_data_parallel.py:81"),
    # The CUDA RNG tracker: same bookkeeping, CPU generator.
    Rewrite("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker.add",
            (("torch.cuda.get_rng_state()", "torch.get_rng_state()"),
             ("torch.cuda.manual_seed(seed)", "torch.manual_seed(seed)")),
            "tensor_parallel/random.py:235"),
)


def _cpu_all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                           async_op=False):
    """torch's ``all_to_all_single`` with the split sizes megatron's MoE token dispatcher hands
    it on the CPU: CPU tensors, which it moves to NumPy only from a GPU (the binding takes
    sequences of ints)."""
    def ints(sizes):
        return None if sizes is None else [int(s) for s in sizes]

    return _ALL_TO_ALL_SINGLE(output, input, ints(output_split_sizes), ints(input_split_sizes), group=group,
                              async_op=async_op)


_ALL_TO_ALL_SINGLE = torch.distributed.all_to_all_single


def _cpu_get_rng_state(device=-1, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device=-1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _cpu_synchronize(device=None) -> None:
    """CPU work is synchronous: nothing to wait for."""


class CPUStream:
    """Stands in for ``torch.cuda.Stream`` and ``torch.cuda.current_stream()`` on the CPU,
    where work is synchronous: there is nothing to order or wait for."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else CPUEvent()

    def synchronize(self) -> None:
        pass


class CPUEvent:
    """Stands in for a recorded ``torch.cuda.Event`` on the CPU: the work before it is done
    (megatron's MoE token dispatcher synchronizes on one)."""

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


def _cpu_current_stream(device=None) -> CPUStream:
    return CPUStream()


def _cpu_stream(stream=None):
    return contextlib.nullcontext()


def _patch_rng() -> None:
    """tensor_parallel/random.py:41/72: the tracker's fork() (dot_product_attention.py:217,
    transformer_block.py:707, language_model_embedding.py:145) and activation checkpointing
    save and restore the *CPU* generator instead of a CUDA one."""
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = _cpu_get_rng_state
    mrandom._set_cuda_rng_state = _cpu_set_rng_state


def _patch_torch_norm() -> None:
    """transformer/torch_norm.py:32: megatron's torch norms refuse sequence_parallel. Accept it
    and mark the parameters ``sequence_parallel=True`` the way megatron's FusedLayerNorm does,
    so that finalize_model_grads sums their gradients over the tensor-parallel group. The
    project's specs never build this norm (they use ``TSPNorm``, on every device); what does
    is megatron's default final norm under a bare layer spec (Megatron-LM's ``--spec``),
    which on a GPU is TransformerEngine's or apex's."""
    from megatron.core.transformer import torch_norm

    original_new = torch_norm.WrappedTorchNorm.__new__
    if getattr(original_new, "_megatron_tsp", False):
        return

    def __new__(cls, config, *args, **kwargs):
        sequence_parallel = config.sequence_parallel
        if sequence_parallel:
            config = _with(config, sequence_parallel=False)
        norm = original_new(cls, config, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = sequence_parallel
        return norm

    __new__._megatron_tsp = True
    torch_norm.WrappedTorchNorm.__new__ = __new__


def _with(config, **changes):
    import copy

    config = copy.copy(config)
    for key, value in changes.items():
        object.__setattr__(config, key, value)
    return config


def enable_cpu_support() -> None:
    """Make megatron-core's GPTModel + DDP + optimizer + schedules path run on CPU (idempotent;
    for CPU processes only, see the module docstring)."""
    global _ENABLED
    if _ENABLED:
        return
    # utils.py:631, tensor_parallel/mappings.py:91/141/148/181, layers.py:552,
    # distributed/param_and_grad_buffer.py:783/800/806 and every other
    # `device=torch.cuda.current_device()` allocate on the current device: name the CPU.
    torch.cuda.current_device = _cpu_current_device
    # pipeline_parallel/p2p_communication.py:242/398 (batch_p2p_sync) and DDP's
    # free/allocate paths call torch.cuda.synchronize().
    torch.cuda.synchronize = _cpu_synchronize
    # distributed/param_and_grad_buffer.py (0.19: start_grad_sync), distributed_data_parallel.py
    # and Megatron-LM's training.py order work on CUDA streams.
    torch.cuda.Stream = CPUStream
    torch.cuda.current_stream = _cpu_current_stream
    torch.cuda.stream = _cpu_stream
    # transformer/moe/token_dispatcher.py:899 passes the split sizes as CPU tensors here
    torch.distributed.all_to_all_single = _cpu_all_to_all_single
    fix_moe_without_transformer_engine()
    _patch_rng()
    _patch_torch_norm()
    for shim in SHIMS:
        shim.install()
    _ENABLED = True


def cpu_support_enabled() -> bool:
    return _ENABLED


__all__: List[str] = ["enable_cpu_support", "cpu_support_enabled", "SHIMS"]
