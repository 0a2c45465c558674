"""flash-attn 2.8.3's ``_flash_attn_forward`` / ``_flash_attn_backward`` and their varlen twins: same names,
parameters, outputs and conventions, computed by fp32 softmax attention (tests only).

As strict as the package (``tests/standins/kernel_contract.py``): the Python wrapper makes
a tensor whose last dimension is strided contiguous (``maybe_contiguous``); the C++ entry
points then check dtypes (fp16/bf16, int32 ``cu_seqlens``), the head dimension (a multiple
of 8, at most 256), shapes and the gradient buffers' last dimension, and read the softmax
lse of a backward by pointer as a contiguous ``[b, h, sq]`` (``[h, total_q]`` varlen)
without checking its strides: a strided lse gives the wrong gradients here as there."""

from typing import Optional, Tuple

import kernel_contract as contract
import torch

KERNEL = "flash-attn"


def _maybe_contiguous(*tensors):
    return [t.contiguous() if t is not None and t.stride(-1) != 1 else t for t in tensors]


def _check_inputs(q, k, v, varlen: bool):
    """mha_(varlen_)fwd/bwd's checks of q, k, v: ``[b, s, h, d]`` (``[total, h, d]`` varlen)."""
    contract.half(KERNEL, q=q, k=k, v=v)
    contract.require(q.dim() == (3 if varlen else 4), KERNEL, f"q has {q.dim()} dimensions")
    contract.head_dim(KERNEL, q.size(-1))
    contract.require(k.shape == v.shape and k.size(-1) == q.size(-1), KERNEL, "k, v and q's head dimensions differ")
    contract.require(q.size(-2) % k.size(-2) == 0, KERNEL,
                     "Number of heads in key/value must divide number of heads in query")


def _check_gradients(q, k, v, out, dout, dq, dk, dv):
    contract.half(KERNEL, q=q, out=out, dout=dout, dq=dq, dk=dk, dv=dv)
    contract.last_dim_contiguous(KERNEL, out=out, dout=dout, dq=dq, dk=dk, dv=dv)
    for name, t, like in (("out", out, q), ("dout", dout, q), ("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        contract.shape(KERNEL, name, t, like.shape)


def _scores(q, k, causal, scale, left=-1, right=-1):
    """[b, h, sq, sk] fp32 scores of [b, s, h, d] inputs; causal and the window aligned
    bottom-right: query i sees keys i + sk - sq - left ... i + sk - sq + right (-1: no bound;
    causal: right 0)."""
    heads = q.size(2)
    k = k.repeat_interleave(heads // k.size(2), dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
    sq, sk = q.size(1), k.size(1)
    ones = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    right = 0 if causal else right
    if right >= 0:
        s = s.masked_fill(ones.triu(sk - sq + right + 1), float("-inf"))
    if left >= 0:
        s = s.masked_fill(ones.tril(sk - sq - left - 1), float("-inf"))
    return s


def _attention(q, k, v, causal, scale, left, right):
    s = _scores(q, k, causal, scale, left, right)
    lse = torch.logsumexp(s, dim=-1)
    v = v.repeat_interleave(q.size(2) // v.size(2), dim=2)
    return torch.einsum("bhqk,bkhd->bqhd", torch.exp(s - lse.unsqueeze(-1)), v.float()).to(q.dtype), lse


def _attention_backward(dout, q, k, v, out, lse, dq, dk, dv, causal, scale, left, right):
    """Writes dq, dk, dv from ``lse`` ``[b, h, sq]`` (as read); returns delta ``[b, h, sq]``."""
    groups = q.size(2) // k.size(2)
    p = torch.exp(_scores(q, k, causal, scale, left, right) - lse.unsqueeze(-1))
    do = dout.float()
    vr = v.repeat_interleave(groups, dim=2).float()
    kr = k.repeat_interleave(groups, dim=2).float()
    dv_full = torch.einsum("bhqk,bqhd->bkhd", p, do)
    dp = torch.einsum("bqhd,bkhd->bhqk", do, vr)
    delta = (do * out.float()).sum(-1).transpose(1, 2)  # [b, h, sq]
    ds = p * (dp - delta.unsqueeze(-1)) * scale
    dq.copy_(torch.einsum("bhqk,bkhd->bqhd", ds, kr))
    dk.copy_(torch.einsum("bhqk,bqhd->bkhd", ds, q.float()).unflatten(2, (k.size(2), groups)).sum(3))
    dv.copy_(dv_full.unflatten(2, (v.size(2), groups)).sum(3))
    return delta


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, softmax_scale: float,
             causal: bool, window_size_left: int, window_size_right: int, softcap: float,
             alibi_slopes: Optional[torch.Tensor], return_softmax: bool
             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    assert dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None
    q, k, v = _maybe_contiguous(q, k, v)
    _check_inputs(q, k, v, varlen=False)
    out, lse = _attention(q, k, v, causal, softmax_scale, window_size_left, window_size_right)
    return out, lse, torch.empty(0, dtype=q.dtype, device=q.device), torch.empty(2, dtype=torch.int64, device=q.device)


def _forward_fake(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                  alibi_slopes, return_softmax):
    _check_inputs(q, k, v, varlen=False)
    b, sq, h, _ = q.shape
    return (torch.empty_like(q), q.new_empty((b, h, sq), dtype=torch.float32), q.new_empty(0),
            q.new_empty(2, dtype=torch.int64))


def _check_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, lse_shape, varlen):
    _check_inputs(q, k, v, varlen)
    _check_gradients(q, k, v, out, dout, dq, dk, dv)
    contract.require(softmax_lse.dtype == torch.float32, KERNEL, f"softmax_lse must be fp32, got {softmax_lse.dtype}")
    contract.shape(KERNEL, "softmax_lse", softmax_lse, lse_shape)
    return contract.as_read(softmax_lse, KERNEL, "softmax_lse")


def _backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor],
              dv: Optional[torch.Tensor], dropout_p: float, softmax_scale: float, causal: bool,
              window_size_left: int, window_size_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor],
              deterministic: bool, rng_state: Optional[torch.Tensor] = None) -> torch.Tensor:
    dout, q, k, v, out = _maybe_contiguous(dout, q, k, v, out)
    lse = _check_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, (q.size(0), q.size(2), q.size(1)), False)
    return _attention_backward(dout, q, k, v, out, lse, dq, dk, dv, causal, softmax_scale, window_size_left,
                               window_size_right)


def _backward_fake(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size_left,
                   window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
    dout, q, k, v, out = _maybe_contiguous(dout, q, k, v, out)
    _check_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, (q.size(0), q.size(2), q.size(1)), False)
    b, sq, h, _ = q.shape
    return q.new_empty((b, h, -(-sq // 128) * 128), dtype=torch.float32)


_flash_attn_forward = torch.library.custom_op("flashattn_standin::_flash_attn_forward", mutates_args=(),
                                              device_types=None)(_forward)
_flash_attn_forward.register_fake(_forward_fake)
_flash_attn_backward = torch.library.custom_op("flashattn_standin::_flash_attn_backward",
                                               mutates_args=("dq", "dk", "dv"), device_types=None)(_backward)
_flash_attn_backward.register_fake(_backward_fake)


def _per_sequence(cu_seqlens_q, cu_seqlens_k):
    """(query rows, key rows) of each sequence of a varlen call."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return [(slice(a, b), slice(c, d)) for a, b, c, d in zip(cq, cq[1:], ck, ck[1:])]


def _check_varlen(q, k, cu_seqlens_q, cu_seqlens_k):
    contract.cu_seqlens(KERNEL, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    contract.require(cu_seqlens_q.numel() == cu_seqlens_k.numel(), KERNEL, "cu_seqlens_q and cu_seqlens_k differ "
                     "in length")


def _varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                    softmax_scale: float, causal: bool, window_size_left: int = -1, window_size_right: int = -1,
                    softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None, return_softmax: bool = False,
                    block_table: Optional[torch.Tensor] = None, leftpad_k: Optional[torch.Tensor] = None,
                    seqused_k: Optional[torch.Tensor] = None
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[total, h, d]`` sequences one after another (``cu_seqlens``), lse ``[h, total_q]``."""
    assert dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None
    assert block_table is None and leftpad_k is None and seqused_k is None
    q, k, v = _maybe_contiguous(q, k, v)
    _check_inputs(q, k, v, varlen=True)
    _check_varlen(q, k, cu_seqlens_q, cu_seqlens_k)
    out = torch.empty_like(q)
    lse = q.new_empty((q.size(1), q.size(0)), dtype=torch.float32)
    for rows, keys in _per_sequence(cu_seqlens_q, cu_seqlens_k):
        assert rows.stop - rows.start <= max_seqlen_q and keys.stop - keys.start <= max_seqlen_k
        o, sequence_lse = _attention(q[None, rows], k[None, keys], v[None, keys], causal, softmax_scale,
                                     window_size_left, window_size_right)
        out[rows], lse[:, rows] = o[0], sequence_lse[0]
    return out, lse, q.new_empty(0), q.new_empty(2, dtype=torch.int64)


def _varlen_forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                         causal, window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                         return_softmax=False, block_table=None, leftpad_k=None, seqused_k=None):
    _check_inputs(q, k, v, varlen=True)
    _check_varlen(q, k, cu_seqlens_q, cu_seqlens_k)
    return (torch.empty_like(q), q.new_empty((q.size(1), q.size(0)), dtype=torch.float32), q.new_empty(0),
            q.new_empty(2, dtype=torch.int64))


def _varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor],
                     dv: Optional[torch.Tensor], cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool,
                     window_size_left: int, window_size_right: int, softcap: float,
                     alibi_slopes: Optional[torch.Tensor], deterministic: bool,
                     rng_state: Optional[torch.Tensor] = None) -> torch.Tensor:
    dout, q, k, v, out = _maybe_contiguous(dout, q, k, v, out)
    lse = _check_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, (q.size(1), q.size(0)), True)
    _check_varlen(q, k, cu_seqlens_q, cu_seqlens_k)
    delta = lse.new_empty((q.size(1), q.size(0)))
    for rows, keys in _per_sequence(cu_seqlens_q, cu_seqlens_k):
        delta[:, rows] = _attention_backward(dout[None, rows], q[None, rows], k[None, keys], v[None, keys],
                                             out[None, rows], lse[None, :, rows], dq[None, rows], dk[None, keys],
                                             dv[None, keys], causal, softmax_scale, window_size_left,
                                             window_size_right)[0]
    return delta


def _varlen_backward_fake(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                          alibi_slopes, deterministic, rng_state=None):
    dout, q, k, v, out = _maybe_contiguous(dout, q, k, v, out)
    _check_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, (q.size(1), q.size(0)), True)
    _check_varlen(q, k, cu_seqlens_q, cu_seqlens_k)
    return q.new_empty((q.size(1), q.size(0) + 128 * (cu_seqlens_q.numel() - 1)), dtype=torch.float32)


_flash_attn_varlen_forward = torch.library.custom_op("flashattn_standin::_flash_attn_varlen_forward",
                                                     mutates_args=(), device_types=None)(_varlen_forward)
_flash_attn_varlen_forward.register_fake(_varlen_forward_fake)
_flash_attn_varlen_backward = torch.library.custom_op("flashattn_standin::_flash_attn_varlen_backward",
                                                      mutates_args=("dq", "dk", "dv"),
                                                      device_types=None)(_varlen_backward)
_flash_attn_varlen_backward.register_fake(_varlen_backward_fake)
