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
PyTorch PR #167931). Whether the running torch computes each on a device is tried once per
device type and dtype, at a real GEMM's shape with each operand in both layouts, not read
from its version: a torch with the first
and not the second adds an fp32 product into ``c`` (one more pass over ``c``, nothing
rounded); one with neither casts both inputs to fp32 first (the same sums, at the cost of the
casts and an fp32 GEMM: on a GPU, said once). The CPU takes the casts. Fake tensors (the
memory planner) stand for a GPU's and take the GPU's path where this torch's fake tensors
compute it, tried the same way.
"""

from __future__ import annotations

import warnings
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import _disable_current_modes


class Fp32Output(NamedTuple):
    """What this torch computes with an fp32 output for low-precision inputs on a device."""

    mm: bool  # mm(a, b, out_dtype=float32)
    addmm: bool  # addmm(c, a, b, out_dtype=float32, out=c) with an fp32 c


_TRIED: Dict[Tuple[str, torch.dtype], Fp32Output] = {}
_FAKE_TRIED: Dict[Tuple[str, torch.dtype], Fp32Output] = {}

# (M, K, N) of the probe: a GEMM library can take 1x1 and refuse a real shape or a transposed operand
PROBE_SHAPE = (384, 256, 320)


def _probes(dtype: torch.dtype, device: torch.device) -> List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(a, b, a @ b in fp64)`` at :data:`PROBE_SHAPE`, each operand row-major and as the
    transpose of a row-major tensor (``dy.t()``, a weight's ``.t()``): small integers, which
    every low-precision dtype holds and an fp32 accumulator sums exactly."""
    m, k, n = PROBE_SHAPE
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randint(-2, 3, shape, generator=g).to(dtype) for shape in ((m, k), (k, n)))
    want = a.double() @ b.double()
    return [(x.to(device), y.to(device), want) for x in (a, a.t().contiguous().t())
            for y in (b, b.t().contiguous().t())]


def _computes(op) -> bool:
    try:
        return bool(op())
    except (RuntimeError, TypeError, NotImplementedError):  # no such overload, or no kernel here
        return False


def _fp32_output(probes, exact: bool) -> Fp32Output:
    """Which fp32-output GEMMs give an fp32 result (``exact``: the exact one) for every probe."""
    def mm(a, b, want):
        got = torch.mm(a, b, out_dtype=torch.float32)
        return got.dtype == torch.float32 and (not exact or torch.equal(got.double(), want))

    def addmm(a, b, want):
        acc = torch.ones(a.size(0), b.size(1), dtype=torch.float32, device=a.device)
        got = torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        return got.dtype == torch.float32 and (not exact or torch.equal(got.double(), want.to(got.device) + 1))

    return Fp32Output(_computes(lambda: all(mm(*p) for p in probes)), _computes(lambda: all(addmm(*p) for p in probes)))


def fake_fp32_output_gemm(a: torch.Tensor) -> Fp32Output:
    """Which fp32-output GEMMs this torch's fake tensors compute (the planner's tensors stand for
    a GPU's), tried once per device type and dtype in ``a``'s own fake mode: the overloads can
    exist without a fake kernel (torch 2.11 decomposes ``addmm.dtype_out`` into an error)."""
    key = (a.device.type, a.dtype)
    if key not in _FAKE_TRIED:
        with _disable_current_modes():  # the probe is not the step's: no tracker sees it
            probes = _probes(a.dtype, torch.device("cpu"))
        with _disable_current_modes(), a.fake_mode:
            fake = [tuple(a.fake_mode.from_tensor(t).to(a.device) for t in p) for p in probes]
            _FAKE_TRIED[key] = _fp32_output(fake, exact=False)
    return _FAKE_TRIED[key]


def fp32_output_gemm(device: torch.device, dtype: torch.dtype) -> Fp32Output:
    """Which of the fp32-output GEMMs this torch computes exactly for ``dtype`` inputs on
    ``device``'s type, tried once per device type and dtype at :data:`PROBE_SHAPE` in both
    layouts of each operand."""
    key = (device.type, dtype)
    if key not in _TRIED:
        found = _fp32_output(_probes(dtype, device), exact=True)
        if device.type != "cpu" and not found.mm:
            warnings.warn(f"this torch has no {dtype} GEMM with an fp32 output on {device.type}: TSP's sums cast "
                          "their inputs to fp32 and run fp32 GEMMs (slow); torch >= 2.8 has them", stacklevel=2)
        _TRIED[key] = found
    return _TRIED[key]


def gemm(a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None, accumulate: bool = False
         ) -> torch.Tensor:
    """``a @ b`` of 2-D tensors in fp32 (module docstring): into ``out`` when given, added to
    it with ``accumulate``. Returns the fp32 result (``out`` itself when given)."""
    if accumulate and out is None:
        raise ValueError("gemm: accumulate needs an out tensor")
    takes = Fp32Output(False, False)
    if a.dtype != torch.float32:
        takes = fake_fp32_output_gemm(a) if is_fake(a) else fp32_output_gemm(a.device, a.dtype)
    if accumulate and takes.addmm:
        return torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
    if takes.mm:
        if accumulate:
            return out.add_(torch.mm(a, b, out_dtype=torch.float32))
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


def linear_into(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor) -> None:
    """``out = x weight^T (+ bias)`` as ``F.linear`` computes it, written into ``out``: a slice
    of a wider tensor (a head group's columns of its stage's projection), whose rows a GEMM
    writes with their stride, so that the head groups of a stage need no concatenation."""
    x2d, out2d = x.reshape(-1, x.size(-1)), out.view(-1, out.size(-1))
    if bias is None:
        torch.mm(x2d, weight.t(), out=out2d)
    else:
        torch.addmm(bias, x2d, weight.t(), out=out2d)
