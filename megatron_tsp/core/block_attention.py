"""Causal attention of zigzag query chunks as blocks merged by log-sum-exp (docs/design.md s. 5).

One op serves TSP and every baseline, so that a comparison is of parallelism, not of
kernels. ``block_attention(q, k, v, chunk_ids, scale, backend)``: ``q`` holds ``n`` equal
query chunks of length ``c``; chunk ``i`` sits at global chunk ``g = chunk_ids[i]`` of the
keys ``k``, ``v`` (global order), and sees keys ``[0, (g+1)·c)`` causally. A kernel whose
causal mask is aligned bottom-right when ``sq < sk`` (query ``i`` sees keys up to
``sk - sq + i``: flash-attn >= 2.1) computes that in one call per chunk. Any other kernel
gets two blocks per chunk,

    a *full* block    keys [0, g·c)          no mask            (absent when g = 0)
    a *causal* block  keys [g·c, (g+1)·c)    square, causal

each returning its output ``o_j`` and log-sum-exp ``l_j``, merged exactly as

    lse = log(sum_j exp(l_j)),      out = sum_j exp(l_j - lse) · o_j.

Plain causal attention of a whole sequence is ``chunk_ids = [0]``; a zigzag rank r of D holds
``chunk_ids = [r, 2D-1-r]``. The op saves ``(q, k, v, out, lse)``; its backward calls each
block's kernel backward with the *merged* ``out`` and ``lse`` (then every block's softmax is
already the global one: ``P_j = exp(S_j - lse)``) and sums dQ, dK, dV over blocks in fp32:
the forward never runs again. No ``sq x sk`` tensor exists outside a kernel. Under
FakeTensorMode (the memory planner, the fake-CUDA tests) the op runs the same kernel calls
through their meta functions, so a wrong argument or shape fails there as on a GPU.

Backends (:data:`BACKENDS`), all ``[b, h, s, d]`` in, ``(out, lse [b, h, sq] fp32)`` out,
with grouped-query K/V (fewer k/v heads):

* ``flash``: torch's flash kernel (CUDA and ROCm; fp16/bf16; GQA native) and its backward;
* ``cudnn``: torch's cuDNN attention (CUDA; fp16/bf16; lse ``[b,h,sq,1]`` from torch 2.9);
* ``efficient``: torch's memory-efficient kernel (CUDA and ROCm, any dtype; lse padded to 32
  rows on CUDA; its backward reads ``out`` as a ``[b, s, h, d]`` tensor);
* ``flash_attn``: the flash-attn package (2.x; ``[b, s, h, d]``; GQA native; bottom-right);
* ``cpu``: aten's CPU flash kernel and its backward;
* ``math``: softmax attention written out (fp32 scores), the reference of the tests.

``auto`` (:func:`resolve_backend`) is ``flash`` on a GPU for fp16/bf16, ``efficient`` for
fp32, ``cpu`` on the CPU: decided by the tensors' device and dtype at the first call. The
first use of a GPU backend on a device and dtype checks it (:func:`check_backend`) in the
real layout against ``math``, and learns whether its causal mask is aligned bottom-right.
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch.utils.flop_counter import register_flop_formula

BACKENDS = ("auto", "flash", "cudnn", "efficient", "flash_attn", "cpu", "math")
GPU_BACKENDS = ("flash", "cudnn", "efficient", "flash_attn")
HALF_ONLY = ("flash", "cudnn", "flash_attn")

Block = Tuple[int, int, int, bool]  # query chunk, first key, end key, causal


def blocks(chunk_ids: Sequence[int], chunk: int, bottom_right: bool = False) -> List[Block]:
    """The kernel calls of a rank's query chunks, in the order the op issues them: one
    causal call on the whole key prefix per chunk when the kernel aligns its causal mask
    bottom-right, else a full block (keys before the chunk) and a square causal block."""
    out = []
    for i, g in enumerate(chunk_ids):
        if bottom_right:
            out.append((i, 0, (g + 1) * chunk, True))
            continue
        if g > 0:
            out.append((i, 0, g * chunk, False))
        out.append((i, g * chunk, (g + 1) * chunk, True))
    return out


# ---- backends: one block, [b, h, s, d] in, (out, lse [b, h, sq] fp32) out ---------------------
def _repeat_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.size(1) == heads else t.repeat_interleave(heads // t.size(1), dim=1)


def _sum_kv(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    return t if t.size(1) == kv_heads else t.unflatten(1, (kv_heads, -1)).sum(2)


def _bshd(t: torch.Tensor) -> torch.Tensor:
    """``t`` ([b, h, s, d]) with the memory layout of a ``[b, s, h, d]`` tensor."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


class _Math:
    """Softmax attention written out (fp32 scores); causal masks aligned bottom-right."""

    bottom_right = True

    @staticmethod
    def _scores(q, k, causal, scale):
        s = torch.matmul(q.float(), _repeat_kv(k, q.size(1)).float().transpose(-1, -2)) * scale
        if causal:
            sq, sk = s.shape[-2:]
            hidden = torch.ones(sq, sk, dtype=torch.bool, device=s.device).triu(sk - sq + 1)
            s = s.masked_fill(hidden, float("-inf"))
        return s

    @classmethod
    def forward(cls, q, k, v, causal, scale):
        s = cls._scores(q, k, causal, scale)
        lse = torch.logsumexp(s, dim=-1)
        out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), _repeat_kv(v, q.size(1)).float())
        return out.to(q.dtype), lse

    @classmethod
    def backward(cls, dout, q, k, v, out, lse, causal, scale):
        p = torch.exp(cls._scores(q, k, causal, scale) - lse.unsqueeze(-1))
        dout = dout.float()
        dv = torch.matmul(p.transpose(-1, -2), dout)
        dp = torch.matmul(dout, _repeat_kv(v, q.size(1)).float().transpose(-1, -2))
        ds = p * (dp - (dout * out.float()).sum(-1, keepdim=True)) * scale
        dq = torch.matmul(ds, _repeat_kv(k, q.size(1)).float())
        dk = torch.matmul(ds.transpose(-1, -2), q.float())
        return dq.to(q.dtype), _sum_kv(dk, k.size(1)).to(k.dtype), _sum_kv(dv, v.size(1)).to(v.dtype)


class _CPU:
    """aten's CPU flash kernel (GQA as it is; causal mask aligned top-left)."""

    bottom_right = False

    @staticmethod
    def forward(q, k, v, causal, scale):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)[:2]

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal, scale):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(), q, k, v, out, lse, 0.0, causal, scale=scale)


def _no_rng(device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Philox seed and offset for a backward without dropout (read only with dropout)."""
    return torch.empty(2, dtype=torch.int64, device=device), torch.empty((), dtype=torch.int64, device=device)


class _Flash:
    """torch's flash kernel (FlashAttention-2 inside torch; CUDA and ROCm, fp16/bf16, GQA
    native). Whether its causal mask is aligned bottom-right is learned by the check."""

    bottom_right = None

    @staticmethod
    def forward(q, k, v, causal, scale):
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return out, lse

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal, scale):
        seed, offset = _no_rng(q.device)
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout.contiguous(), q, k, v, out, lse, None, None, q.size(2), k.size(2), 0.0, causal, seed, offset,
            scale=scale)


# torch 2.9 made the cuDNN kernel's lse [b, h, sq, 1]
_CUDNN_LSE_4D = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 9)


class _CuDNN:
    """torch's cuDNN attention (CUDA, fp16/bf16). K/V heads are repeated for GQA; ``out``
    and ``dout`` are handed over with the same (contiguous) strides, as its backward wants."""

    bottom_right = None

    @staticmethod
    def forward(q, k, v, causal, scale):
        k, v = _repeat_kv(k, q.size(1)), _repeat_kv(v, q.size(1))
        out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                          scale=scale)
        return out, lse.reshape(lse.shape[:3])

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal, scale):
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
    def forward(q, k, v, causal, scale):
        k, v = _repeat_kv(k, q.size(1)), _repeat_kv(v, q.size(1))
        out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                              scale=scale)
        return out, lse[..., : q.size(2)]

    @classmethod
    def backward(cls, dout, q, k, v, out, lse, causal, scale):
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
            if "window_size" in params:
                opts["window_size"] = (-1, -1)
            else:
                opts.update(window_size_left=-1, window_size_right=-1)
            if "softcap" in params:
                opts["softcap"] = 0.0
            return opts

        return _flash_attn_forward, options(_flash_attn_forward), _flash_attn_backward, options(_flash_attn_backward)

    @classmethod
    def forward(cls, q, k, v, causal, scale):
        fwd, opts, _, _ = cls._functions()
        ret = fwd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=0.0, softmax_scale=scale,
                  causal=causal, return_softmax=False, **opts)
        out, lse = (ret[0], ret[5]) if len(ret) == 8 else (ret[0], ret[1])  # before 2.6: 8 values
        return out.transpose(1, 2), lse

    @classmethod
    def backward(cls, dout, q, k, v, out, lse, causal, scale):
        _, _, bwd, opts = cls._functions()
        q, k, v, out, dout = (t.transpose(1, 2) for t in (q, k, v, out, dout))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        bwd(dout.contiguous(), q, k, v, out, lse, dq, dk, dv, dropout_p=0.0, softmax_scale=scale, causal=causal,
            deterministic=False, rng_state=None, **opts)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


_KERNELS = {"flash": _Flash, "cudnn": _CuDNN, "efficient": _Efficient, "flash_attn": _FlashAttn, "cpu": _CPU,
            "math": _Math}


def flash_attn_installed() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def select_backend(name: str) -> str:
    """Validate a backend name when a module is built (``auto`` is resolved per call)."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)} (got {name!r})")
    if name == "flash_attn" and not flash_attn_installed():
        raise ValueError("attention_backend 'flash_attn' needs the flash-attn package; install it or use 'auto'")
    return name


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """The kernel a backend name means on ``device`` for ``dtype`` (``auto``: the fastest
    there is), or a one-line ValueError when the kernel cannot run there."""
    gpu = device.type == "cuda"
    if name == "auto":
        if not gpu:
            return "cpu"
        return "flash" if dtype in (torch.float16, torch.bfloat16) else "efficient"
    if name in GPU_BACKENDS and not gpu:
        raise ValueError(f"attention backend {name!r} runs on CUDA/ROCm GPUs only (tensors on {device.type}); "
                         "use 'auto'")
    if name == "cpu" and gpu:
        raise ValueError("attention backend 'cpu' runs on the CPU only; use 'auto'")
    if name in HALF_ONLY and dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"attention backend {name!r} takes fp16/bf16 only (got {dtype}); use 'auto' or 'efficient'")
    return name


_CHECKED: Dict[Tuple[str, str, torch.dtype], bool] = {}  # (backend, device type, dtype) -> bottom_right


def bottom_right(backend: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``backend``'s causal mask is aligned bottom-right when sq < sk: known, or as
    :func:`check_backend` found it; False before a check (fake tensors cannot be checked)."""
    known = _KERNELS[backend].bottom_right
    return known if known is not None else _CHECKED.get((backend, device.type, dtype), False)


def check_backend(backend: str, device: torch.device, dtype: torch.dtype) -> None:
    """Once per (backend, device type, dtype): a small GQA problem with micro-batch 2 in the
    real layout (``[s, b, h, d]`` memory seen as ``[b, h, s, d]``), forward and backward with
    the lse handed back, for a square causal, a full and (where the kernel may align it
    bottom-right) a non-square causal block, against ``math``. Records the alignment; a
    one-line RuntimeError if the kernel's conventions are not the ones assumed here."""
    key = (backend, device.type, dtype)
    if backend in ("math", "cpu") or key in _CHECKED:
        return
    g = torch.Generator(device="cpu").manual_seed(0)

    def tensor(s, h):  # [s, b, h, d] in memory, [b, h, s, d] as the op hands it to a kernel
        return torch.randn(s, 2, h, 64, generator=g).to(device=device, dtype=dtype).permute(1, 2, 0, 3)

    kernel, tol = _KERNELS[backend], (1e-3 if dtype == torch.float32 else 3e-2)

    def agrees(sq, sk, causal, reference=_Math):
        q, dout, k, v = tensor(sq, 4), tensor(sq, 4), tensor(sk, 2), tensor(sk, 2)
        ref = reference.forward(q, k, v, causal, 0.125)
        ref_grads = reference.backward(dout, q, k, v, *ref, causal, 0.125)
        got = kernel.forward(q, k, v, causal, 0.125)
        got_grads = kernel.backward(dout, q, k, v, *ref, causal, 0.125)
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), (*got, *got_grads), (*ref, *ref_grads)):
            if a.shape != b.shape or not torch.allclose(a.float(), b.float(), atol=tol * b.abs().max().item(), rtol=0):
                return name
        return None

    for sq, sk, causal in ((64, 64, True), (64, 128, False)):
        wrong = agrees(sq, sk, causal)
        if wrong:
            raise RuntimeError(f"attention backend {backend!r} gives a wrong {wrong} on {device.type} {dtype} "
                               f"(causal={causal}, {sq}x{sk}); build the model with attention_backend='math' "
                               "or another backend")
    aligned = kernel.bottom_right
    if aligned is None:
        aligned = agrees(64, 128, True) is None
    _CHECKED[key] = aligned


# ---- the op -----------------------------------------------------------------------------------
def _forward_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_ids: List[int], scale: float,
                  backend: str) -> Tuple[torch.Tensor, torch.Tensor]:
    fake = is_fake(q)
    backend = resolve_backend(backend, q.device, q.dtype)
    if not fake:
        check_backend(backend, q.device, q.dtype)
    kernel = _KERNELS[backend]
    chunk = q.size(2) // len(chunk_ids)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    calls = blocks(chunk_ids, chunk, bottom_right(backend, q.device, q.dtype))
    for i in range(len(chunk_ids)):
        rows = slice(i * chunk, (i + 1) * chunk)
        acc = acc_lse = None
        for _, k0, k1, causal in (b for b in calls if b[0] == i):
            o, o_lse = kernel.forward(q[:, :, rows], k[:, :, k0:k1], v[:, :, k0:k1], causal, scale)
            if acc is None:
                acc, acc_lse = o, o_lse
            else:  # exact merge of two softmax blocks (ring-flash-attention's update_out_and_lse), in fp32
                new_lse = torch.logaddexp(acc_lse, o_lse)
                acc = (acc.float() * torch.exp(acc_lse - new_lse).unsqueeze(-1)
                       + o.float() * torch.exp(o_lse - new_lse).unsqueeze(-1))
                acc_lse = new_lse
        out[:, :, rows] = acc
        lse[:, :, rows] = acc_lse
    return out, lse


def _backward_impl(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, chunk_ids: List[int], scale: float,
                   backend: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    backend = resolve_backend(backend, q.device, q.dtype)
    kernel = _KERNELS[backend]
    chunk = q.size(2) // len(chunk_ids)
    dq = torch.zeros_like(q, dtype=torch.float32)
    dk = torch.zeros_like(k, dtype=torch.float32)
    dv = torch.zeros_like(v, dtype=torch.float32)
    for i, k0, k1, causal in blocks(chunk_ids, chunk, bottom_right(backend, q.device, q.dtype)):
        rows = slice(i * chunk, (i + 1) * chunk)
        g = kernel.backward(dout[:, :, rows], q[:, :, rows], k[:, :, k0:k1], v[:, :, k0:k1],
                            out[:, :, rows], lse[:, :, rows].contiguous(), causal, scale)
        dq[:, :, rows] += g[0]
        dk[:, :, k0:k1] += g[1]
        dv[:, :, k0:k1] += g[2]
    return dq.to(q.dtype), dk, dv


# The fake implementations are the real ones: under FakeTensorMode every kernel call runs
# through its meta function, with the arguments a GPU would get.
_block_attention = torch.library.custom_op("megatron_tsp::block_attention", mutates_args=())(_forward_impl)
_block_attention.register_fake(_forward_impl)
_block_attention_backward = torch.library.custom_op("megatron_tsp::block_attention_backward",
                                                    mutates_args=())(_backward_impl)
_block_attention_backward.register_fake(_backward_impl)


def _setup_context(ctx, inputs, output):
    q, k, v, chunk_ids, scale, backend = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = (chunk_ids, scale, backend)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _block_attention_backward(dout, q, k, v, out, lse, *ctx.args)
    return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None


_block_attention.register_autograd(_backward, setup_context=_setup_context)


def visible_pairs(chunk_ids: Sequence[int], chunk: int) -> int:
    """(query, key) pairs a causal chunk sees: c·g·c keys before it plus c(c+1)/2 of its own
    (the kernels' work, however the blocks are cut)."""
    return sum(chunk * g * chunk + chunk * (chunk + 1) // 2 for g in chunk_ids)


def _forward_flops(q_shape, chunk_ids) -> int:
    b, h, sq, d = q_shape
    return 2 * 2 * b * h * d * visible_pairs(chunk_ids, sq // len(chunk_ids))  # QK^T and PV


@register_flop_formula(torch.ops.megatron_tsp.block_attention)
def _flops(q_shape, k_shape, v_shape, chunk_ids, *args, out_shape=None, **kwargs) -> int:
    return _forward_flops(q_shape, chunk_ids)


@register_flop_formula(torch.ops.megatron_tsp.block_attention_backward)
def _flops_backward(dout_shape, q_shape, k_shape, v_shape, out_shape_, lse_shape, chunk_ids, *args,
                    out_shape=None, **kwargs) -> int:
    # a flash backward recomputes QK^T and computes dV, dP, dQ, dK: 5 GEMMs to forward's 2
    return _forward_flops(q_shape, chunk_ids) * 5 // 2


def block_attention_forward(query, keys, values, chunk_ids: Sequence[int], scale: float, backend: str):
    """Megatron layout: query ``[sq, b, hq, d]`` (its chunks at ``chunk_ids``), keys/values
    ``[sk, b, hk, d]`` in global order, hq a multiple of hk. Returns ``out [sq, b, hq, d]``
    and ``lse [b, hq, sq]`` (fp32): under autograd the op's own backward applies; a
    hand-written schedule saves both for :func:`block_attention_backward`."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, keys, values))
    out, lse = _block_attention(q, k, v, list(chunk_ids), float(scale), backend)
    return out.permute(2, 0, 1, 3), lse


def block_attention(query, keys, values, chunk_ids: Sequence[int], scale: float, backend: str) -> torch.Tensor:
    """The attention output of :func:`block_attention_forward`, differentiable by autograd."""
    return block_attention_forward(query, keys, values, chunk_ids, scale, backend)[0]


def block_attention_backward(d_out, query, keys, values, out, lse, chunk_ids: Sequence[int], scale: float,
                             backend: str):
    """dq ``[sq, b, hq, d]`` in the query's dtype and dK, dV ``[sk, b, hk, d]`` in fp32 (a
    caller sums them over ranks before rounding) from the saved forward: each block's kernel
    backward with the merged lse; no attention forward runs."""
    d_out, q, k, v, out = (t.permute(1, 2, 0, 3) for t in (d_out, query, keys, values, out))
    grads = _block_attention_backward(d_out, q, k, v, out, lse, list(chunk_ids), float(scale), backend)
    return tuple(g.permute(2, 0, 1, 3) for g in grads)

