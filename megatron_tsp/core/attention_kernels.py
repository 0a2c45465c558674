"""The attention op's kernels: one block per call, and which kernel a backend name means.

Every backend takes ``[b, h, s, d]`` tensors and returns ``(out, lse [b, h, sq] fp32)``, with
grouped-query K/V (fewer k/v heads), and computes one block (:mod:`megatron_tsp.core.block_geometry`):
full, causal, or a sliding window's band (``left``). Backends (:data:`BACKENDS`):

* ``flash``: torch's flash kernel (CUDA and ROCm; fp16/bf16; GQA native) and its backward;
* ``cudnn``: torch's cuDNN attention (CUDA; fp16/bf16; lse ``[b,h,sq,1]`` from torch 2.9);
* ``efficient``: torch's memory-efficient kernel (CUDA and ROCm, any dtype; lse padded to 32
  rows on CUDA; its backward reads ``out`` as a ``[b, s, h, d]`` tensor);
* ``flash_attn``: the flash-attn package (2.x; ``[b, s, h, d]``; GQA native; bottom-right);
* ``cpu``: aten's CPU flash kernel and its backward;
* ``math``: softmax attention written out (fp32 scores), the reference of the tests.

``flash`` and ``flash_attn`` take a window's band as their own ``window_size``, ``cpu`` and
``math`` as a mask of the block; ``cudnn`` and ``efficient`` have none. ``auto``
(:func:`resolve_backend`) is, on a GPU for fp16/bf16, ``cudnn`` from
:data:`AUTO_CUDNN_FROM_KEYS` keys on (NVIDIA, where it runs) and ``flash`` below (and for
window layers); ``efficient`` for fp32, ``cpu`` on the CPU: decided by the device, dtype and
sequence length; ``gpu`` is what ``auto`` picks on a GPU, on the memory planner's fake
tensors wherever they live. The first use of a GPU backend on a device and dtype checks it
(:func:`check_backend`) in the real layout against ``math``, and learns whether its causal
mask is aligned bottom-right. Where a kernel has a varlen form (``cu_seqlens``), a run of
square causal blocks one after another is one call (:func:`varlen_runs`).
"""

from __future__ import annotations

import inspect
import itertools
import warnings
from functools import lru_cache
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from megatron_tsp.core.block_geometry import Call

BACKENDS = ("auto", "gpu", "flash", "cudnn", "efficient", "flash_attn", "cpu", "math")
GPU_BACKENDS = ("flash", "cudnn", "efficient", "flash_attn")
HALF_ONLY = ("flash", "cudnn", "flash_attn")
NO_WINDOW = ("cudnn", "efficient")

# ``auto`` on an NVIDIA GPU in fp16/bf16: cuDNN's attention from this many keys, flash below. On
# one H200 with torch 2.11 (bench/results/gpu-check-H200-run1.md: one TSP head group, fwd+bwd)
# flash took 1.98 / 3.73 / 25.1 ms at 8K / 32K / 128K keys and cuDNN 2.86 / 3.17 / 14.0; the 7B's
# whole step at 128K ran 1.6x faster on cuDNN in TSP and TP+SP alike (gpu-check-H200-2layers-*).
# TransformerEngine, which Megatron-LM's baselines run, prefers cuDNN's fused attention on Hopper too.
AUTO_CUDNN_FROM_KEYS = 16384


def _repeat_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.size(1) == heads else t.repeat_interleave(heads // t.size(1), dim=1)


def _sum_kv(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    return t if t.size(1) == kv_heads else t.unflatten(1, (kv_heads, -1)).sum(2)


def _bshd(t: torch.Tensor) -> torch.Tensor:
    """``t`` ([b, h, s, d]) with the memory layout of a ``[b, s, h, d]`` tensor."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _hidden(sq: int, sk: int, causal: bool, left: int, device) -> Optional[torch.Tensor]:
    """The (query, key) pairs a block hides, ``[sq, sk]`` bool (causal and the band aligned
    bottom-right, as flash-attn's window: row x sees keys from x + sk - sq - left); None when
    it hides none."""
    ones = torch.ones(sq, sk, dtype=torch.bool, device=device)
    hidden = ones.triu(sk - sq + 1) if causal else None
    if left >= 0:
        band = ones.tril(sk - sq - left - 1)
        hidden = band if hidden is None else hidden | band
    return hidden


def _window_mask(q: torch.Tensor, k: torch.Tensor, causal: bool, left: int) -> torch.Tensor:
    """A window block's additive mask (0 / -inf) in q's dtype, for kernels that take one."""
    hidden = _hidden(q.size(2), k.size(2), causal, left, q.device)
    return torch.zeros(hidden.shape, dtype=q.dtype, device=q.device).masked_fill(hidden, float("-inf"))


class _Math:
    """Softmax attention written out (fp32 scores); causal masks aligned bottom-right."""

    bottom_right = True

    @staticmethod
    def _scores(q, k, causal, scale, left):
        s = torch.matmul(q.float(), _repeat_kv(k, q.size(1)).float().transpose(-1, -2)) * scale
        hidden = _hidden(*s.shape[-2:], causal, left, s.device)
        return s if hidden is None else s.masked_fill(hidden, float("-inf"))

    @classmethod
    def forward(cls, q, k, v, causal, scale, left=-1):
        s = cls._scores(q, k, causal, scale, left)
        lse = torch.logsumexp(s, dim=-1)
        out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), _repeat_kv(v, q.size(1)).float())
        return out.to(q.dtype), lse

    @classmethod
    def backward(cls, dout, q, k, v, out, lse, causal, scale, left=-1):
        p = torch.exp(cls._scores(q, k, causal, scale, left) - lse.unsqueeze(-1))
        dout = dout.float()
        dv = torch.matmul(p.transpose(-1, -2), dout)
        dp = torch.matmul(dout, _repeat_kv(v, q.size(1)).float().transpose(-1, -2))
        ds = p * (dp - (dout * out.float()).sum(-1, keepdim=True)) * scale
        dq = torch.matmul(ds, _repeat_kv(k, q.size(1)).float())
        dk = torch.matmul(ds.transpose(-1, -2), q.float())
        return dq.to(q.dtype), _sum_kv(dk, k.size(1)).to(k.dtype), _sum_kv(dv, v.size(1)).to(v.dtype)


class _CPU:
    """aten's CPU flash kernel (GQA as it is; causal mask aligned top-left; a window's
    blocks as an additive mask of the block)."""

    bottom_right = False

    @staticmethod
    def forward(q, k, v, causal, scale, left=-1):
        if left >= 0:
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, False, attn_mask=_window_mask(q, k, causal, left), scale=scale)[:2]
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)[:2]

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal, scale, left=-1):
        if left >= 0:
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout.contiguous(), q, k, v, out, lse, 0.0, False, attn_mask=_window_mask(q, k, causal, left),
                scale=scale)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(), q, k, v, out, lse, 0.0, causal, scale=scale)


def _no_window(left: int) -> None:
    """cuDNN's and the memory-efficient kernel have no sliding window (:func:`resolve_backend`
    keeps window layers off them): a window's block reaching one is a mistake, said in a line."""
    if left >= 0:
        raise ValueError("a sliding window's block reached a kernel without a window (cudnn, efficient); use "
                         "attention backend 'auto', 'flash' or 'flash_attn'")


def _no_rng(device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Philox seed and offset for a backward without dropout (read only with dropout)."""
    return torch.empty(2, dtype=torch.int64, device=device), torch.empty((), dtype=torch.int64, device=device)


class _Flash:
    """torch's flash kernel (FlashAttention-2 inside torch; CUDA and ROCm, fp16/bf16, GQA
    native). Whether its causal mask is aligned bottom-right is learned by the check: on ROCm
    it is AOTriton, whose backward refuses a causal block with sq != sk."""

    bottom_right = None

    @staticmethod
    def forward(q, k, v, causal, scale, left=-1):
        if left >= 0:  # the kernel's own window (FlashAttention-2's window_size), [b, s, h, d]
            out, lse, *_ = torch.ops.aten._flash_attention_forward(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, q.size(2), k.size(2), 0.0,
                causal, False, scale=scale, window_size_left=left, window_size_right=0 if causal else -1)
            return out.transpose(1, 2), lse
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return out, lse

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal, scale, left=-1):
        seed, offset = _no_rng(q.device)
        if left >= 0:
            dq, dk, dv = torch.ops.aten._flash_attention_backward(
                dout.transpose(1, 2).contiguous(), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                out.transpose(1, 2), lse, None, None, q.size(2), k.size(2), 0.0, causal, seed, offset, scale=scale,
                window_size_left=left, window_size_right=0 if causal else -1)
            return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout.contiguous(), q, k, v, out, lse, None, None, q.size(2), k.size(2), 0.0, causal, seed, offset,
            scale=scale)

    @staticmethod
    def has_varlen() -> bool:
        """torch's CUDA flash kernel takes ``cum_seq_q/k``; ROCm's (AOTriton) is not relied on."""
        return not getattr(torch.version, "hip", None)

    @staticmethod
    def forward_varlen(q, k, v, cu, longest, scale):
        out, lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, longest, longest, 0.0, True, False,
                                                               scale=scale)
        return out, lse

    @staticmethod
    def backward_varlen(dout, q, k, v, out, lse, cu, longest, scale):
        seed, offset = _no_rng(q.device)
        return torch.ops.aten._flash_attention_backward(dout, q, k, v, out, lse, cu, cu, longest, longest, 0.0, True,
                                                        seed, offset, scale=scale)


# torch 2.9 made the cuDNN kernel's lse [b, h, sq, 1]
_CUDNN_LSE_4D = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 9)


class _CuDNN:
    """torch's cuDNN attention (CUDA, fp16/bf16). K/V heads are repeated for GQA; ``out``
    and ``dout`` are handed over with the same (contiguous) strides, as its backward wants."""

    bottom_right = None

    @staticmethod
    def forward(q, k, v, causal, scale, left=-1):
        _no_window(left)
        k, v = _repeat_kv(k, q.size(1)), _repeat_kv(v, q.size(1))
        out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                          scale=scale)
        return out, lse.reshape(lse.shape[:3])

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal, scale, left=-1):
        _no_window(left)
        kr, vr = _repeat_kv(k, q.size(1)), _repeat_kv(v, q.size(1))
        seed, offset = _no_rng(q.device)
        lse = lse.unsqueeze(-1) if _CUDNN_LSE_4D else lse
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout.contiguous(), q, kr, vr, out.contiguous(), lse.contiguous(), seed, offset, None, None, None,
            q.size(2), kr.size(2), 0.0, causal, scale=scale)
        return dq, _sum_kv(dk, k.size(1)), _sum_kv(dv, v.size(1))


class _Efficient:
    """torch's memory-efficient kernel (CUDA and ROCm, any dtype; the SDPA fallback). K/V
    heads are repeated for GQA. Its lse has ``ceil(sq/32)*32`` rows on CUDA and ``sq`` on
    ROCm; its backward reads ``out`` and ``dout`` with the strides of a ``[b, s, h, d]``
    tensor (rows ``h*d`` apart), which its forward returns."""

    bottom_right = None

    @staticmethod
    def _lse_rows(sq: int) -> int:
        return sq if torch.version.hip else -(-sq // 32) * 32

    @staticmethod
    def forward(q, k, v, causal, scale, left=-1):
        _no_window(left)
        k, v = _repeat_kv(k, q.size(1)), _repeat_kv(v, q.size(1))
        out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                              scale=scale)
        return out, lse[..., : q.size(2)]

    @classmethod
    def backward(cls, dout, q, k, v, out, lse, causal, scale, left=-1):
        _no_window(left)
        kr, vr = _repeat_kv(k, q.size(1)), _repeat_kv(v, q.size(1))
        lse = F.pad(lse, (0, cls._lse_rows(q.size(2)) - q.size(2))).contiguous()
        seed, offset = _no_rng(q.device)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            _bshd(dout), q, kr, vr, None, _bshd(out), lse, seed, offset, 0.0, [True, True, True, False], causal,
            scale=scale)
        return dq, _sum_kv(dk, k.size(1)), _sum_kv(dv, v.size(1))


class _FlashAttn:
    """The flash-attn package (2.x: ``[b, s, h, d]``, GQA native, causal mask aligned
    bottom-right). From 2.6 its private entry points are ``torch.library.custom_op``s whose
    signature reads ``(*args, **kwargs)``: arguments are matched on the undecorated
    function (``_init_fn``), so that 2.8's required ``softcap`` is passed."""

    bottom_right = True

    @staticmethod
    @lru_cache(maxsize=None)
    def _functions():
        from flash_attn.flash_attn_interface import _flash_attn_backward, _flash_attn_forward

        def options(fn):
            params = inspect.signature(getattr(fn, "_init_fn", fn)).parameters
            opts = {"alibi_slopes": None}
            if "softcap" in params:
                opts["softcap"] = 0.0
            return opts, "window_size" in params

        return _flash_attn_forward, options(_flash_attn_forward), _flash_attn_backward, options(_flash_attn_backward)

    @staticmethod
    @lru_cache(maxsize=None)
    def _varlen_functions():
        """The package's varlen entry points where they take ``window_size_left`` (2.6 on, whose
        lse is ``[h, total]``); None before."""
        from flash_attn import flash_attn_interface as fa

        fwd, bwd = (getattr(fa, name, None) for name in ("_flash_attn_varlen_forward", "_flash_attn_varlen_backward"))
        if fwd is None or bwd is None or "window_size_left" not in inspect.signature(
                getattr(fwd, "_init_fn", fwd)).parameters:
            return None
        return fwd, bwd

    @classmethod
    def has_varlen(cls) -> bool:
        return cls._varlen_functions() is not None

    @classmethod
    def forward_varlen(cls, q, k, v, cu, longest, scale):
        fwd, _ = cls._varlen_functions()
        out, lse, *_ = fwd(q, k, v, cu, cu, longest, longest, 0.0, scale, True, window_size_left=-1,
                           window_size_right=0, softcap=0.0, alibi_slopes=None, return_softmax=False)
        return out, lse

    @classmethod
    def backward_varlen(cls, dout, q, k, v, out, lse, cu, longest, scale):
        _, bwd = cls._varlen_functions()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        bwd(dout, q, k, v, out, lse, dq, dk, dv, cu, cu, longest, longest, 0.0, scale, True, -1, 0, 0.0, None, False,
            None)
        return dq, dk, dv

    @staticmethod
    def _with_window(options, causal: bool, left: int) -> dict:
        opts, one_argument = options
        right = 0 if causal and left >= 0 else -1
        window = dict(window_size=(left, right)) if one_argument else dict(window_size_left=left,
                                                                           window_size_right=right)
        return {**opts, **window}

    @classmethod
    def forward(cls, q, k, v, causal, scale, left=-1):
        fwd, opts, _, _ = cls._functions()
        ret = fwd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=0.0, softmax_scale=scale,
                  causal=causal, return_softmax=False, **cls._with_window(opts, causal, left))
        out, lse = (ret[0], ret[5]) if len(ret) == 8 else (ret[0], ret[1])  # before 2.6: 8 values
        return out.transpose(1, 2), lse

    @classmethod
    def backward(cls, dout, q, k, v, out, lse, causal, scale, left=-1):
        _, _, bwd, opts = cls._functions()
        q, k, v, out, dout = (t.transpose(1, 2) for t in (q, k, v, out, dout))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        bwd(dout.contiguous(), q, k, v, out, lse, dq, dk, dv, dropout_p=0.0, softmax_scale=scale, causal=causal,
            deterministic=False, rng_state=None, **cls._with_window(opts, causal, left))
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


_KERNELS = {"flash": _Flash, "cudnn": _CuDNN, "efficient": _Efficient, "flash_attn": _FlashAttn, "cpu": _CPU,
            "math": _Math}


def flash_attn_installed() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def validate_backend(name: str) -> str:
    """Validate a backend name when a module is built (``auto`` is resolved per call)."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)} (got {name!r})")
    if name == "flash_attn" and not flash_attn_installed():
        raise ValueError("attention_backend 'flash_attn' needs the flash-attn package; install it or use 'auto'")
    return name


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype, planned: bool = False,
                    keys: Optional[int] = None, windowed: bool = False, documents: bool = False,
                    head_dim: int = 64) -> str:
    """The kernel a backend name means on ``device`` for ``dtype`` (``auto``: the fastest
    there is, for attention over ``keys`` keys where given; ``gpu``: what ``auto`` picks on a
    GPU), or a one-line ValueError when the kernel cannot run there. ``planned``: the tensors
    are fake (the memory planner), and a GPU kernel's meta function runs on any device.
    ``windowed``: the layer has a sliding window; ``documents``: packed documents;
    ``head_dim``: the model's, at which a real GPU's cuDNN is checked.

    ``auto`` on a GPU in fp16/bf16 is cuDNN's attention from :data:`AUTO_CUDNN_FROM_KEYS` keys
    on where it runs here (NVIDIA, and its check at this head dim and dtype passes), else
    flash; fp32 is the memory-efficient kernel. A window layer takes flash (fp16/bf16) or math
    (fp32): the others have no window. Packed documents take flash, whose varlen form makes a
    chunk's document pieces one call (cuDNN has none here: a call per piece, whose shapes
    change every micro-batch, and a cuDNN graph built for each new shape). Every mode resolves
    the same name at the same sequence length to the same kernel."""
    gpu = device.type == "cuda" or planned
    if name == "gpu" and not gpu:
        raise ValueError("attention backend 'gpu' plans a GPU's kernels, on fake tensors only (the memory planner); "
                         "use 'auto'")
    if windowed and name in NO_WINDOW:
        raise ValueError(f"attention backend {name!r} has no sliding window (--window-size); use 'auto', 'flash' or "
                         "'flash_attn'")
    if name == "auto" and device.type != "cuda":
        return "cpu"
    if name in ("auto", "gpu"):
        if dtype not in (torch.float16, torch.bfloat16):
            return "math" if windowed else "efficient"
        long = keys is not None and keys >= AUTO_CUDNN_FROM_KEYS and not windowed and not documents
        return "cudnn" if long and _cudnn_runs(device, dtype, planned, head_dim) else "flash"
    if name in GPU_BACKENDS and not gpu:
        raise ValueError(f"attention backend {name!r} runs on CUDA/ROCm GPUs only (tensors on {device.type}); "
                         "use 'auto'")
    if name == "cpu" and device.type == "cuda":
        raise ValueError("attention backend 'cpu' runs on the CPU only; use 'auto'")
    if name in HALF_ONLY and dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"attention backend {name!r} takes fp16/bf16 only (got {dtype}); use 'auto' or 'efficient'")
    return name


_CUDNN_RUNS: Dict[Tuple[str, torch.dtype, int], bool] = {}


def _cudnn_runs(device: torch.device, dtype: torch.dtype, planned: bool, head_dim: int) -> bool:
    """Whether ``auto`` may take cuDNN's attention: never on ROCm (torch has none there); on
    fake tensors as on an NVIDIA GPU; on a real one when its check at this head dim and dtype
    passes (a head dim, dtype, GPU or cuDNN it does not take raises there, and ``auto`` takes
    flash)."""
    if getattr(torch.version, "hip", None):
        return False
    if planned:
        return True
    key = (device.type, dtype, head_dim)
    if key not in _CUDNN_RUNS:
        try:
            check_backend("cudnn", device, dtype, head_dim=head_dim)
            _CUDNN_RUNS[key] = True
        except RuntimeError:
            _CUDNN_RUNS[key] = False
    return _CUDNN_RUNS[key]


# (backend, device type, dtype, head dim) -> bottom_right, of the checked ones
_CHECKED: Dict[Tuple[str, str, torch.dtype, int], bool] = {}
_WINDOW_CHECKED: set = set()  # (backend, device type, dtype, head dim) whose window blocks were checked
# How torch's GPU kernels align a causal mask when sq < sk, on CUDA: its flash kernel is
# FlashAttention-2 (bottom-right since 2.1); the memory-efficient and cuDNN kernels take
# ``is_causal`` top-left. What the memory planner's fake tensors assume; a real device checks.
# On ROCm torch's flash kernel is AOTriton, whose backward refuses a non-square causal block.
_ON_A_GPU = {"flash": True, "cudnn": False, "efficient": False}


def bottom_right(backend: str, device: torch.device, dtype: torch.dtype, planned: bool = False) -> bool:
    """Whether ``backend``'s causal mask is aligned bottom-right when sq < sk: known, or as
    :func:`check_backend` found it; for fake tensors (``planned``), as on a CUDA or ROCm GPU;
    else False before a check."""
    known = _KERNELS[backend].bottom_right
    if known is not None:
        return known
    found = [aligned for (b, kind, d, _), aligned in _CHECKED.items() if (b, kind, d) == (backend, device.type, dtype)]
    if found:
        return found[0]
    return planned and _ON_A_GPU.get(backend, False) and not getattr(torch.version, "hip", None)


def checked_kernel(name: str, q: torch.Tensor, windowed: bool) -> type:
    """The kernel ``name`` means for ``q`` (:func:`resolve_backend`; ``windowed``: a block has
    a window's band), checked on its first use on a real device (:func:`check_backend`)."""
    backend = resolve_backend(name, q.device, q.dtype, planned=is_fake(q), windowed=windowed, head_dim=q.size(-1))
    if not is_fake(q):
        check_backend(backend, q.device, q.dtype, windowed, q.size(-1))
    return _KERNELS[backend]


def prepare_backend(name: str, device: torch.device, dtype: torch.dtype, planned: bool, keys: int,
                    windowed: bool, documents: bool, head_dim: int) -> Tuple[str, bool]:
    """A layer's kernel (:func:`resolve_backend`), checked on a real device before anything
    asks how it aligns a causal mask (:func:`check_backend`), and that alignment
    (:func:`bottom_right`): the blocks of the first step are those of every later one."""
    backend = resolve_backend(name, device, dtype, planned=planned, keys=keys, windowed=windowed,
                              documents=documents, head_dim=head_dim)
    if not planned:
        check_backend(backend, device, dtype, windowed, head_dim)
    return backend, bottom_right(backend, device, dtype, planned=planned)


def check_backend(backend: str, device: torch.device, dtype: torch.dtype, windowed: bool = False,
                  head_dim: int = 64) -> None:
    """Once per (backend, device type, dtype, head dim): a small GQA problem with micro-batch 2
    at the model's head dim in the real layout (``[s, b, h, d]`` memory seen as ``[b, h, s,
    d]``), forward and backward with
    the lse handed back, for a square causal, a full and (where the kernel may align it
    bottom-right) a non-square causal block, against ``math``; the first time a sliding
    window (``windowed``) runs there, also a window's blocks (a causal one, a square and a
    non-square band); where the kernel has a varlen form (:func:`varlen_runs`), three
    documents a sample in one call, which is not used where it disagrees (a warning; the
    blocks are exact without it). Records the alignment; a one-line RuntimeError if the
    kernel's conventions are not the ones assumed here."""
    key = (backend, device.type, dtype, head_dim)
    if backend in ("math", "cpu") or (key in _CHECKED and (not windowed or key in _WINDOW_CHECKED)):
        return
    g = torch.Generator(device="cpu").manual_seed(0)

    def tensor(s, h):  # [s, b, h, d] in memory, [b, h, s, d] as the op hands it to a kernel
        return torch.randn(s, 2, h, head_dim, generator=g).to(device=device, dtype=dtype).permute(1, 2, 0, 3)

    kernel, tol = _KERNELS[backend], (1e-3 if dtype == torch.float32 else 3e-2)

    def agrees(sq, sk, causal, left=-1, reference=_Math):
        q, dout, k, v = tensor(sq, 4), tensor(sq, 4), tensor(sk, 2), tensor(sk, 2)
        ref = reference.forward(q, k, v, causal, 0.125, left)
        ref_grads = reference.backward(dout, q, k, v, *ref, causal, 0.125, left)
        got = kernel.forward(q, k, v, causal, 0.125, left)
        got_grads = kernel.backward(dout, q, k, v, *ref, causal, 0.125, left)
        return close((*got, *got_grads), (*ref, *ref_grads))

    def close(got, ref):
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
            if a.shape != b.shape or not torch.allclose(a.float(), b.float(), atol=tol * b.abs().max().item(), rtol=0):
                return name
        return None

    def varlen_agrees():  # three documents of each of 2 samples in one call (varlen_runs)
        q, dout, k, v = tensor(64, 4), tensor(64, 4), tensor(64, 2), tensor(64, 2)
        run = [Call(a, b, a, b, True, -1, -1) for a, b in ((0, 16), (16, 56), (56, 64))]
        parts = [(c.q0, c.q1) for c in run]
        ref = [_Math.forward(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], True, 0.125) for a, b in parts]
        out, lse = (torch.cat(t, 2) for t in zip(*ref))
        ref_grads = [_Math.backward(dout[:, :, a:b], q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], out[:, :, a:b],
                                    lse[:, :, a:b], True, 0.125) for a, b in parts]
        got = varlen_forward(kernel, q, k, v, run, 0.125)
        got_grads = varlen_backward(kernel, dout, q, k, v, out, lse, run, 0.125)
        return close([torch.cat([got[c][i] for c in run], 2) for i in (0, 1)] + list(got_grads),
                     [out, lse] + [torch.cat(t, 2) for t in zip(*ref_grads)])

    def check(cases):
        for sq, sk, causal, left in cases:
            try:
                wrong = agrees(sq, sk, causal, left)
            except RuntimeError as exc:
                if left < 0:
                    raise
                wrong = f"result (it refuses a window here: {str(exc).splitlines()[0]})"
            if wrong:
                raise RuntimeError(f"attention backend {backend!r} gives a wrong {wrong} on {device.type} {dtype} "
                                   f"(head dim {head_dim}, causal={causal}, window {left}, {sq}x{sk}); build the "
                                   "model with attention_backend='math' or another backend")

    if windowed and key not in _WINDOW_CHECKED:  # a window's blocks: causal, a band, a band not square
        check([(64, 64, True, 16), (64, 64, False, 8), (32, 64, False, 40)])
        _WINDOW_CHECKED.add(key)
    if key in _CHECKED:
        return
    check([(64, 64, True, -1), (64, 128, False, -1)])
    if getattr(kernel, "has_varlen", lambda: False)():
        try:
            wrong = varlen_agrees()
        except RuntimeError as exc:
            wrong = f"result (it raised: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
        if wrong:  # the blocks are right without it: a call per document piece
            _VARLEN_BROKEN.add((kernel, device.type, dtype, head_dim))
            warnings.warn(f"attention backend {backend!r} gives a wrong {wrong} in its varlen form (cu_seqlens) on "
                          f"{device.type} {dtype}: packed documents run a kernel call per piece", stacklevel=2)
    aligned = kernel.bottom_right
    if aligned is None:
        try:
            aligned = agrees(64, 128, True) is None
        except RuntimeError:  # refuses causal with sq != sk (ROCm's AOTriton backward): square blocks only
            aligned = False
    _CHECKED[key] = aligned



_VARLEN_BROKEN: set = set()  # (kernel, device type, dtype, head dim) whose varlen form failed check_backend


def varlen_runs(kernel, calls: Sequence[Call], q: torch.Tensor) -> List[List[Call]]:
    """Runs of square causal blocks one after the other in both queries and keys (packed
    documents' pieces of a query chunk, :func:`~megatron_tsp.core.block_geometry.document_blocks`,
    and any other such blocks), each run one varlen call (``cu_seqlens``) where the kernel has
    one for ``q``'s device and dtype (its form passed :func:`check_backend`), not one call each."""
    if not getattr(kernel, "has_varlen", lambda: False)() or \
            (kernel, q.device.type, q.dtype, q.size(-1)) in _VARLEN_BROKEN:
        return []
    runs: List[List[Call]] = []
    for c in sorted(calls, key=lambda c: c.q0):
        if not (c.causal and c.left < 0 and c.q1 - c.q0 == c.k1 - c.k0):
            continue
        if runs and runs[-1][-1].q1 == c.q0 and runs[-1][-1].k1 == c.k0:
            runs[-1].append(c)
        else:
            runs.append([c])
    return [run for run in runs if len(run) > 1]


def run_span(run: Sequence[Call]) -> Tuple[int, int, int, int]:
    """A run's query rows and key rows, each one range (its blocks follow one another)."""
    return run[0].q0, run[-1].q1, run[0].k0, run[-1].k1


def _thd(t: torch.Tensor) -> torch.Tensor:
    """``[b, h, L, d]`` as a varlen kernel's ``[b·L, h, d]`` (the samples one after another)."""
    return t.permute(0, 2, 1, 3).reshape(-1, t.size(1), t.size(3))


def _bhsd_of(t: torch.Tensor, b: int) -> torch.Tensor:
    return t.view(b, -1, *t.shape[1:]).permute(0, 2, 1, 3)


def _cu_seqlens(run: Sequence[Call], q: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """The run's pieces of every sample as a varlen kernel's sequences: int32 offsets and the
    longest. To a GPU from pinned memory without waiting (a plain copy would wait for the
    stream: for everything queued, the transfers TSP overlaps included)."""
    lengths = [c.q1 - c.q0 for c in run] * q.size(0)
    offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    if q.device.type == "cuda" and not is_fake(q):
        return offsets.pin_memory().to(q.device, non_blocking=True), max(lengths)
    return offsets.to(q.device), max(lengths)


def varlen_forward(kernel, q, k, v, calls: Sequence[Call], scale: float) -> Dict[Call, Tuple[torch.Tensor, ...]]:
    """The outputs and lse of the blocks :func:`varlen_runs` finds, one kernel call a run."""
    found = {}
    for run in varlen_runs(kernel, calls, q):
        q0, q1, k0, k1 = run_span(run)
        cu, longest = _cu_seqlens(run, q)
        out, lse = kernel.forward_varlen(_thd(q[:, :, q0:q1]), _thd(k[:, :, k0:k1]), _thd(v[:, :, k0:k1]), cu,
                                         longest, scale)
        out, lse = _bhsd_of(out, q.size(0)), lse.view(lse.size(0), q.size(0), -1).transpose(0, 1)
        for c in run:
            found[c] = (out[:, :, c.q0 - q0:c.q1 - q0], lse[:, :, c.q0 - q0:c.q1 - q0])
    return found


def varlen_backward(kernel, dout, q, k, v, out, lse, run: Sequence[Call], scale: float):
    """A run's backward in one varlen call: dq, dk, dv over its rows and keys, ``[b, h, L, d]``.
    The kernels read the lse by pointer as a contiguous ``[h, b·L]`` and check no strides: a
    run of part of the rows (a zigzag rank's chunk) at micro-batch 1 is a strided view, copied."""
    q0, q1, k0, k1 = run_span(run)
    b = q.size(0)
    cu, longest = _cu_seqlens(run, q)
    grads = kernel.backward_varlen(_thd(dout[:, :, q0:q1]), _thd(q[:, :, q0:q1]), _thd(k[:, :, k0:k1]),
                                   _thd(v[:, :, k0:k1]), _thd(out[:, :, q0:q1]),
                                   lse[:, :, q0:q1].transpose(0, 1).reshape(lse.size(1), -1).contiguous(), cu,
                                   longest, scale)
    return tuple(_bhsd_of(g, b) for g in grads[:3])
