"""GEMMs that accumulate in fp32: every sum over streamed shards is made inside a GEMM.

TSP sums partial products over weight shards (the MLP's output over the ring, every input
gradient over head groups or shards) and partial weight gradients over ranks. Summed after
the GEMM, each partial is rounded to the inputs' dtype and then read and written again in
fp32 (``y += a @ b``: a full pass over ``y`` per shard). Summed inside it, the GEMM adds
its fp32 accumulator to ``out`` (beta = 1) and nothing is rounded:

    gemm(a, b)                        a @ b                  -> new fp32 tensor
    gemm(a, b, out=c)                 c  = a @ b             (c fp32, written)
    gemm(a, b, out=c, accumulate=True)  c += a @ b           (c fp32, one GEMM)

On a GPU with bf16/fp16 inputs these are ``mm(..., out_dtype=float32)`` and
``addmm(c, a, b, out_dtype=float32, out=c)`` (torch >= 2.8; an fp32 ``c`` on CUDA since
PyTorch PR #167931): whether the running torch takes them on a device is tried once per
device type, on two 1x1 matrices, not read from its version. Fake tensors (the memory
planner) stand for a GPU's and take the GPU's path. Elsewhere (the CPU, a torch without
them) both inputs are cast to fp32 first: the same sums, at the cost of the casts.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
from torch._subclasses.fake_tensor import is_fake

_FP32_OUTPUT: Dict[str, bool] = {}  # device type -> whether mm/addmm with out_dtype=float32 run there


def fp32_output_gemm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch computes a ``dtype`` GEMM with an fp32 output (and fp32 accumulator
    input) on ``device``'s type, tried once per device type."""
    if device.type not in _FP32_OUTPUT:
        try:
            a = torch.ones(1, 1, dtype=dtype, device=device)
            c = torch.zeros(1, 1, dtype=torch.float32, device=device)
            torch.mm(a, a, out_dtype=torch.float32, out=c)
            torch.addmm(c, a, a, out_dtype=torch.float32, out=c)
            ok = bool(c.item() == 2.0)
        except (RuntimeError, TypeError, NotImplementedError):  # no such overload, or no kernel here
            ok = False
        _FP32_OUTPUT[device.type] = ok
    return _FP32_OUTPUT[device.type]


def gemm(a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None, accumulate: bool = False
         ) -> torch.Tensor:
    """``a @ b`` of 2-D tensors in fp32 (module docstring): into ``out`` when given, added to
    it with ``accumulate``. Returns the fp32 result (``out`` itself when given)."""
    if accumulate and out is None:
        raise ValueError("gemm: accumulate needs an out tensor")
    if a.dtype != torch.float32 and (is_fake(a) or fp32_output_gemm(a.device, a.dtype)):
        if accumulate:
            return torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
        if out is None:
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    a, b = a.float(), b.float()
    if accumulate:
        return out.addmm_(a, b)
    if out is None:
        return a @ b
    return torch.mm(a, b, out=out)


def gemm_t(dy: torch.Tensor, x: torch.Tensor, out: Optional[torch.Tensor] = None, accumulate: bool = False
           ) -> torch.Tensor:
    """``dy^T x`` in fp32: a weight gradient from the output gradient and the input, rows
    being tokens (``[n, out]`` and ``[n, in]`` -> ``[out, in]``)."""
    return gemm(dy.t(), x, out, accumulate)
