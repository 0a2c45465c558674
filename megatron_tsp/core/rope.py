"""Rotary position embedding as one op: megatron's unfused RoPE (``_apply_rotary_pos_emb_bshd``,
``t * cos + rotate_half(t) * sin``), term for term, forward and backward.

TSP rotates each head group's queries and keys as its weight shard arrives, D times a layer
and pass where TP+SP rotates once: as eager torch that is five kernels a tensor (two
products, a negation, a concatenation, a sum) and as many again backward. As one op it is one
kernel each way on a GPU (torch.compile, compiled at the first call) and the same eager
formula on the CPU and under the planner's fake tensors, which count it as one launch.
"""

from __future__ import annotations

import torch

from megatron_tsp.core.fusion import compiled_on_first_call


def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``t * cos + rotate_half(t) * sin``, rotate_half(t) = [-t2, t1] (halves of the last dim)."""
    t1, t2 = torch.chunk(t, 2, dim=-1)
    return t * cos + torch.cat((-t2, t1), dim=-1) * sin


def rotate_back(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The gradient of :func:`rotate` with respect to ``t``: ``grad * cos`` plus rotate_half's
    transpose of ``grad * sin`` ([u2, -u1]), the sum autograd forms, in its order."""
    u1, u2 = torch.chunk(grad * sin, 2, dim=-1)
    return grad * cos + torch.cat((u2, -u1), dim=-1)


def _empty(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return t.new_empty(torch.broadcast_shapes(t.shape, cos.shape, sin.shape))


_rope = torch.library.custom_op("megatron_tsp::rope", mutates_args=())(rotate)
_rope.register_fake(_empty)
_rope.register_kernel("cuda")(compiled_on_first_call(rotate))
_rope_backward = torch.library.custom_op("megatron_tsp::rope_backward", mutates_args=())(rotate_back)
_rope_backward.register_fake(_empty)
_rope_backward.register_kernel("cuda")(compiled_on_first_call(rotate_back))


def _setup_context(ctx, inputs, output):
    _, cos, sin = inputs
    ctx.save_for_backward(cos, sin)


def _backward(ctx, grad):
    cos, sin = ctx.saved_tensors
    return torch.ops.megatron_tsp.rope_backward(grad, cos, sin), None, None


_rope.register_autograd(_backward, setup_context=_setup_context)


def apply_rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`rotate` as one op, differentiable in ``t`` (the tables take no gradient)."""
    return torch.ops.megatron_tsp.rope(t, cos, sin)
