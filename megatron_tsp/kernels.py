"""A causal attention op with the memory behaviour of a flash kernel.

``flash_attention(q, k, v, scale)``: queries ``[b, h, sq, d]`` sitting at the *end* of
``sk`` keys (causal mask aligned lower right: query i sees keys ``0 .. sk - sq + i``).
It is a registered torch op whose real implementation is torch's SDPA, and whose fake
(meta) implementation allocates what a flash kernel allocates: the output, and in
backward dq, dk, dv, with q, k, v and the output saved in between; never the ``sq x sk``
score matrix. The memory planner runs models under ``FakeTensorMode`` on this op, so that
TSP and its baselines are compared with the same memory-efficient attention, and
``FlopCounterMode`` counts it with :func:`attention_flops`.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula


def _sdpa(q, k, v, scale: float):
    from torch.nn.attention.bias import causal_lower_right

    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.size(2), k.size(2)), scale=scale)


@torch.library.custom_op("megatron_tsp::flash_attention", mutates_args=())
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    return _sdpa(q, k, v, scale)


@flash_attention.register_fake
def _(q, k, v, scale):
    return torch.empty_like(q)


@torch.library.custom_op("megatron_tsp::flash_attention_backward", mutates_args=())
def flash_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             scale: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Explicit softmax-attention gradients (an op body runs below autograd). The reference
    # implementation materialises the scores; its fake kernel is what the planner measures.
    sq, sk = q.size(2), k.size(2)
    visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(diagonal=sk - sq)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    p = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    dout = dout.float()
    dv = torch.matmul(p.transpose(-1, -2), dout)
    dp = torch.matmul(dout, v.float().transpose(-1, -2))
    ds = p * (dp - (dp * p).sum(dim=-1, keepdim=True)) * scale
    dq = torch.matmul(ds, k.float())
    dk = torch.matmul(ds.transpose(-1, -2), q.float())
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@flash_attention_backward.register_fake
def _(dout, q, k, v, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, scale = inputs
    ctx.save_for_backward(q, k, v, output)  # what flash saves (its log-sum-exp is O(sq))
    ctx.scale = scale


def _backward(ctx, dout):
    q, k, v, _ = ctx.saved_tensors
    dq, dk, dv = flash_attention_backward(dout.contiguous(), q, k, v, ctx.scale)
    return dq, dk, dv, None


flash_attention.register_autograd(_backward, setup_context=_setup_context)


def attention_flops(q_shape, k_shape) -> int:
    """FLOPs of causal (lower-right) attention forward: QK^T and PV over visible pairs."""
    b, h, sq, d = q_shape
    sk = k_shape[2]
    pairs = sq * (sk - sq) + sq * (sq + 1) // 2
    return 2 * 2 * b * h * pairs * d


@register_flop_formula(torch.ops.megatron_tsp.flash_attention)
def _flops(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    return attention_flops(q_shape, k_shape)


@register_flop_formula(torch.ops.megatron_tsp.flash_attention_backward)
def _flops_backward(dout_shape, q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    # a flash backward recomputes QK^T and computes dV, dP, dQ, dK: 5 GEMMs to forward's 2
    return attention_flops(q_shape, k_shape) * 5 // 2


ATTENTION_BACKENDS = ("auto", "sdpa", "flash_attn", "flash_op")


def select_backend(name: str) -> str:
    """``sdpa``: torch SDPA (flash/efficient kernels on GPU); ``flash_attn``: the flash-attn
    package; ``flash_op``: :func:`flash_attention` (the memory planner's); ``auto``:
    flash-attn on a GPU when it is installed, else SDPA."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS} (got {name!r})")
    if name == "auto":
        return "flash_attn" if torch.cuda.is_available() and _flash_attn_func() is not None else "sdpa"
    if name == "flash_attn" and _flash_attn_func() is None:
        raise ValueError("attention_backend='flash_attn' needs the flash-attn package; install it or use 'sdpa'")
    return name


def _flash_attn_func() -> Optional[object]:
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return None
    return flash_attn_func


def causal_attention(query, keys, values, scale: float, backend: str = "sdpa") -> torch.Tensor:
    """Attention of ``sq`` queries that sit at the *end* of ``sk`` keys (causal, lower right).

    query ``[sq, b, hq, d]``, keys/values ``[sk, b, hk, d]`` with hq a multiple of hk (GQA);
    query i sees keys ``0 .. sk - sq + i``. Returns ``[sq, b, hq, d]``.
    """
    if backend == "flash_attn":
        # flash-attn's causal mask is lower-right aligned and it handles GQA itself.
        out = _flash_attn_func()(query.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                 softmax_scale=scale, causal=True)
        return out.transpose(0, 1)
    q = query.permute(1, 2, 0, 3)
    k = keys.permute(1, 2, 0, 3)
    v = values.permute(1, 2, 0, 3)
    if k.size(1) != q.size(1):
        repeat = q.size(1) // k.size(1)
        k = k.repeat_interleave(repeat, dim=1)
        v = v.repeat_interleave(repeat, dim=1)
    out = flash_attention(q, k, v, scale) if backend == "flash_op" else _sdpa(q, k, v, scale)
    return out.permute(2, 0, 1, 3)
