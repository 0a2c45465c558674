"""Causal attention of zigzag query chunks as blocks merged by log-sum-exp (DESIGN.md s. 2).

One op serves TSP and every baseline, so that a comparison is of parallelism, not of
kernels. ``block_attention(q, k, v, chunk_ids, scale, backend)``: ``q`` holds ``n`` equal
query chunks of length ``c``; chunk ``i`` sits at global chunk ``g = chunk_ids[i]`` of the
keys ``k``, ``v`` (global order). Chunk i attends to

    a *full* block    keys [0, g·c)          no mask            (absent when g = 0)
    a *causal* block  keys [g·c, (g+1)·c)    square, causal

each through the device's flash kernel, which returns the block's output ``o_j`` and
log-sum-exp ``l_j``; the blocks merge exactly as

    lse = log(sum_j exp(l_j)),      out = sum_j exp(l_j - lse) · o_j.

Plain causal attention of a whole sequence is ``chunk_ids = [0]``; a zigzag rank r of D holds
``chunk_ids = [r, 2D-1-r]``. The op saves ``(q, k, v, out, lse)``; its backward calls each
block's kernel backward with the *merged* ``out`` and ``lse`` (then every block's softmax is
already the global one: ``P_j = exp(S_j - lse)``) and sums dQ over blocks: the forward
never runs again. No ``sq x sk`` tensor exists outside a kernel, and the fake kernels the
memory planner runs allocate what the real ones do: out and lse; dq, dk and dv.

Backends, chosen once per module (:func:`select_backend`), all with GQA (fewer k/v heads):

* ``cpu``: aten's ``_scaled_dot_product_flash_attention_for_cpu`` and its backward;
* ``flash_attn``: the flash-attn package's ``_flash_attn_forward/_flash_attn_backward``;
* ``aten``: on CUDA or ROCm, torch's memory-efficient kernel and its backward;
* ``math``: a plain reference (fp32 scores, one block at a time), for tests.

The GPU backends call private entry points whose conventions change between releases, and
no GPU ran them in this project's CI: the first use of a GPU backend on a device and dtype
checks one small block, forward and backward, against ``math`` and stops with one line if
they disagree (:func:`check_backend`), rather than training on a wrong gradient.
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import List, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

BACKENDS = ("auto", "cpu", "flash_attn", "aten", "math")

Block = Tuple[int, int, int, bool]  # query chunk, first key, end key, causal


def blocks(chunk_ids: Sequence[int], chunk: int) -> List[Block]:
    """The kernel calls of a rank's query chunks, in the order the op issues them."""
    out = []
    for i, g in enumerate(chunk_ids):
        if g > 0:
            out.append((i, 0, g * chunk, False))
        out.append((i, g * chunk, (g + 1) * chunk, True))
    return out


# ---- backends: one block, [b, h, s, d] in, (out, lse [b, h, sq] fp32) out ---------------------
def _repeat_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.size(1) == heads else t.repeat_interleave(heads // t.size(1), dim=1)


def _sum_kv(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    return t if t.size(1) == kv_heads else t.unflatten(1, (kv_heads, -1)).sum(2)


class _Math:
    """Softmax attention written out (fp32 scores), the reference the kernels are tested on."""

    @staticmethod
    def _probs(q, k, causal, scale):
        s = torch.matmul(q.float(), _repeat_kv(k, q.size(1)).float().transpose(-1, -2)) * scale
        if causal:
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        return s

    @classmethod
    def forward(cls, q, k, v, causal, scale):
        s = cls._probs(q, k, causal, scale)
        lse = torch.logsumexp(s, dim=-1)
        out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), _repeat_kv(v, q.size(1)).float())
        return out.to(q.dtype), lse

    @classmethod
    def backward(cls, dout, q, k, v, out, lse, causal, scale):
        p = torch.exp(cls._probs(q, k, causal, scale) - lse.unsqueeze(-1))
        dout = dout.float()
        dv = torch.matmul(p.transpose(-1, -2), dout)
        dp = torch.matmul(dout, _repeat_kv(v, q.size(1)).float().transpose(-1, -2))
        ds = p * (dp - (dout * out.float()).sum(-1, keepdim=True)) * scale
        dq = torch.matmul(ds, _repeat_kv(k, q.size(1)).float())
        dk = torch.matmul(ds.transpose(-1, -2), q.float())
        return dq.to(q.dtype), _sum_kv(dk, k.size(1)).to(k.dtype), _sum_kv(dv, v.size(1)).to(v.dtype)


class _CPU:
    """aten's CPU flash kernel (takes GQA as it is)."""

    @staticmethod
    def forward(q, k, v, causal, scale):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal, scale):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)


class _Aten:
    """torch's memory-efficient kernel on CUDA and ROCm (any dtype; the kernel SDPA takes
    where flash is unavailable). It does not take GQA here, so k/v heads are repeated and
    their gradients summed back; it pads lse to a multiple of 32 rows."""

    @staticmethod
    def forward(q, k, v, causal, scale):
        k, v = _repeat_kv(k, q.size(1)), _repeat_kv(v, q.size(1))
        out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                              scale=scale)
        return out, lse[..., : q.size(2)]

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal, scale):
        kr, vr = _repeat_kv(k, q.size(1)), _repeat_kv(v, q.size(1))
        lse = F.pad(lse, (0, -q.size(2) % 32)).contiguous()
        no_rng = torch.empty(0, dtype=torch.long, device=q.device)  # read only with dropout
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, kr, vr, None, out, lse, no_rng, no_rng, 0.0, [True, True, True, False], causal, scale=scale)
        return dq, _sum_kv(dk, k.size(1)), _sum_kv(dv, v.size(1))


class _FlashAttn:
    """The flash-attn package ([b, s, h, d] layout; GQA native). Its private entry points
    changed their keywords across 2.x releases: arguments are matched by name."""

    @staticmethod
    @lru_cache(maxsize=None)
    def _functions():
        from flash_attn.flash_attn_interface import _flash_attn_backward, _flash_attn_forward

        def options(fn):
            params = inspect.signature(fn).parameters
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


_BACKENDS = {"cpu": _CPU, "aten": _Aten, "flash_attn": _FlashAttn, "math": _Math}


def _flash_attn_installed() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def select_backend(name: str) -> str:
    """``auto``: flash-attn on a GPU when it is installed, else torch's GPU kernels; aten's
    CPU flash kernel without a GPU."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)} (got {name!r})")
    if name == "auto":
        if not torch.cuda.is_available():
            return "cpu"
        return "flash_attn" if _flash_attn_installed() else "aten"
    if name == "flash_attn" and not _flash_attn_installed():
        raise ValueError("attention_backend 'flash_attn' needs the flash-attn package; install it or use 'auto'")
    return name


_CHECKED = set()


def check_backend(backend: str, device: torch.device, dtype: torch.dtype) -> None:
    """Once per (backend, device type, dtype): one causal and one full block of a small GQA
    problem, forward and backward with a merged lse, against ``math``; a one-line
    RuntimeError if the kernel's conventions are not the ones assumed here."""
    key = (backend, device.type, dtype)
    if backend in ("math", "cpu") or key in _CHECKED:
        return
    _CHECKED.add(key)
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v, dout = (torch.randn(1, h, 64, 64, generator=g).to(device=device, dtype=dtype) for h in (4, 2, 2, 4))
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    for causal in (True, False):
        got = _BACKENDS[backend].forward(q, k, v, causal, 0.125)
        ref = _Math.forward(q, k, v, causal, 0.125)
        got_grads = _BACKENDS[backend].backward(dout, q, k, v, ref[0], ref[1], causal, 0.125)
        ref_grads = _Math.backward(dout, q, k, v, ref[0], ref[1], causal, 0.125)
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), (*got, *got_grads), (*ref, *ref_grads)):
            if a.shape != b.shape or not torch.allclose(a.float(), b.float(), atol=tol * b.abs().max().item(), rtol=0):
                raise RuntimeError(f"attention backend {backend!r} gives a wrong {name} on {device.type} {dtype} "
                                   f"(causal={causal}); build the model with attention_backend='math' or another backend")


# ---- the op -----------------------------------------------------------------------------------
@torch.library.custom_op("megatron_tsp::block_attention", mutates_args=())
def _block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_ids: List[int], scale: float,
                     backend: str) -> Tuple[torch.Tensor, torch.Tensor]:
    check_backend(backend, q.device, q.dtype)
    kernel = _BACKENDS[backend]
    chunk = q.size(2) // len(chunk_ids)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    for i in range(len(chunk_ids)):
        rows = slice(i * chunk, (i + 1) * chunk)
        acc = acc_lse = None
        for _, k0, k1, causal in (b for b in blocks(chunk_ids, chunk) if b[0] == i):
            o, l = kernel.forward(q[:, :, rows], k[:, :, k0:k1], v[:, :, k0:k1], causal, scale)
            if acc is None:
                acc, acc_lse = o.float(), l
            else:  # exact merge of two softmax blocks (ring-flash-attention's update_out_and_lse)
                new_lse = torch.logaddexp(acc_lse, l)
                acc = acc * torch.exp(acc_lse - new_lse).unsqueeze(-1) + o.float() * torch.exp(l - new_lse).unsqueeze(-1)
                acc_lse = new_lse
        out[:, :, rows] = acc
        lse[:, :, rows] = acc_lse
    return out, lse


@_block_attention.register_fake
def _(q, k, v, chunk_ids, scale, backend):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("megatron_tsp::block_attention_backward", mutates_args=())
def _block_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              out: torch.Tensor, lse: torch.Tensor, chunk_ids: List[int], scale: float,
                              backend: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kernel = _BACKENDS[backend]
    chunk = q.size(2) // len(chunk_ids)
    dq = torch.zeros_like(q, dtype=torch.float32)
    dk = torch.zeros_like(k, dtype=torch.float32)
    dv = torch.zeros_like(v, dtype=torch.float32)
    for i, k0, k1, causal in blocks(chunk_ids, chunk):
        rows = slice(i * chunk, (i + 1) * chunk)
        g = kernel.backward(dout[:, :, rows].contiguous(), q[:, :, rows], k[:, :, k0:k1], v[:, :, k0:k1],
                            out[:, :, rows], lse[:, :, rows].contiguous(), causal, scale)
        dq[:, :, rows] += g[0]
        dk[:, :, k0:k1] += g[1]
        dv[:, :, k0:k1] += g[2]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@_block_attention_backward.register_fake
def _(dout, q, k, v, out, lse, chunk_ids, scale, backend):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, chunk_ids, scale, backend = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = (chunk_ids, scale, backend)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _block_attention_backward(dout.contiguous(), q, k, v, out, lse, *ctx.args)
    return dq, dk, dv, None, None, None


_block_attention.register_autograd(_backward, setup_context=_setup_context)


def visible_pairs(chunk_ids: Sequence[int], chunk: int) -> int:
    """(query, key) pairs the blocks compute: c·g·c per full block, c(c+1)/2 per causal one."""
    return sum(chunk * (k1 - k0) if not causal else chunk * (chunk + 1) // 2
               for _, k0, k1, causal in blocks(chunk_ids, chunk))


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
    """dq ``[sq, b, hq, d]``, dK, dV ``[sk, b, hk, d]`` from the saved forward: each block's
    kernel backward with the merged lse; no attention forward runs."""
    d_out, q, k, v, out = (t.permute(1, 2, 0, 3) for t in (d_out, query, keys, values, out))
    grads = torch.ops.megatron_tsp.block_attention_backward(d_out.contiguous(), q, k, v, out, lse, list(chunk_ids),
                                                           float(scale), backend)
    return tuple(g.permute(2, 0, 1, 3) for g in grads)
