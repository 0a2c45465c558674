"""K/V exchange of zigzag-sharded attention: all-gather K/V, reduce-scatter dK/dV.

A rank holds the tokens of zigzag chunks r and 2D-1-r (:mod:`megatron_tsp.core.zigzag`). Its keys
and values are gathered over the group in *rank order* and re-indexed to global order, which
is what :func:`megatron_tsp.core.block_attention.block_attention` expects; the gradient goes the other way
(re-index to rank order, reduce-scatter: each rank receives the sum over ranks of the
gradient of its own tokens, summed in the gradient's dtype: fp32 from the attention op).
Both run asynchronously, so that a caller can attend with one head group while the next
one's K/V travel (TSP).
"""

from __future__ import annotations

from typing import Tuple

import torch

from megatron_tsp.core import comm
from megatron_tsp.core.zigzag import Indices


class GatherKV:
    """Start ``K, V = all_gather_seq(k, v)``; :meth:`wait` returns them ``[S, b, g, d]`` in
    global order. ``k``, ``v``: this rank's ``[S/D, b, g, d]`` in zigzag (rank) order."""

    def __init__(self, key: torch.Tensor, value: torch.Tensor, group, indices: Indices, inflight: comm.InFlight):
        local = torch.stack([key, value], dim=1).contiguous()  # [s, 2, b, g, d]: sequence first
        self.full = local.new_empty((local.size(0) * group.size(),) + tuple(local.shape[1:]))
        self.to_natural = indices.to_natural
        self.inflight = inflight
        self.handle = comm.all_gather(self.full, local, group, inflight)
        self._local = local  # alive until the collective has read it

    def wait(self) -> Tuple[torch.Tensor, torch.Tensor]:
        self.inflight.wait(self.handle)
        full = self.full.index_select(0, self.to_natural)
        del self.full, self._local
        return full[:, 0], full[:, 1]


class ScatterKVGrads:
    """Start ``dk, dv = reduce_scatter_seq(dK, dV)`` from full-sequence gradients in global
    order; :meth:`wait` returns this rank's ``[S/D, b, g, d]`` (rank order), summed over ranks."""

    def __init__(self, d_keys: torch.Tensor, d_values: torch.Tensor, group, indices: Indices,
                 inflight: comm.InFlight):
        # written in rank order in place: a stack and a re-index would hold two more copies of
        # the group's fp32 dK/dV at the peak of a layer's backward
        full = d_keys.new_empty((d_keys.size(0), 2) + tuple(d_keys.shape[1:]))
        full[:, 0].index_copy_(0, indices.to_natural, d_keys)
        full[:, 1].index_copy_(0, indices.to_natural, d_values)
        self.local = full.new_empty((full.size(0) // group.size(),) + tuple(full.shape[1:]))
        self.inflight = inflight
        self.handle = comm.reduce_scatter(self.local, full, group, inflight)
        self._full = full  # alive until the collective has read it

    def wait(self) -> Tuple[torch.Tensor, torch.Tensor]:
        self.inflight.wait(self.handle)
        del self._full
        return self.local[:, 0], self.local[:, 1]


class AllGatherKV(torch.autograd.Function):
    """K, V = all_gather_seq(k, v) in global order; backward: dk, dv = reduce_scatter(dK, dV).

    For layers that differentiate through the exchange with autograd (the context-parallel
    baseline); TSP attention runs :class:`GatherKV` and :class:`ScatterKVGrads` inside its
    own schedule.
    """

    @staticmethod
    def forward(ctx, key, value, group, indices: Indices):
        ctx.group, ctx.indices = group, indices
        with comm.InFlight() as inflight:
            return GatherKV(key, value, group, indices, inflight).wait()

    @staticmethod
    def backward(ctx, d_keys, d_values):
        with comm.InFlight() as inflight:
            dk, dv = ScatterKVGrads(d_keys, d_values, ctx.group, ctx.indices, inflight).wait()
        return dk, dv, None, None
