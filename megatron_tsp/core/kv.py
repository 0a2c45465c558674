"""K/V exchange of zigzag-sharded attention: all-gather K/V, reduce-scatter dK/dV.

A rank r of D holds the tokens of zigzag chunks r and 2D-1-r (:mod:`megatron_tsp.core.zigzag`),
``[2c, ...]`` with its first chunk on top. TSP gathers K/V with two all-gathers, of every
rank's second chunks and of every rank's first chunks, into the *zigzag layout*
(:func:`megatron_tsp.core.block_geometry.zigzag_slot`)

    slot q < D: chunk 2D-1-q (rank q's second chunk)      slot D+q: chunk q (rank q's first)

so that no re-indexing is needed: every query chunk's keys are contiguous there
(:func:`megatron_tsp.core.block_geometry.zigzag_blocks`). The gradient goes back the same
way: two reduce-scatters of the fp32 ``[2Dc, 2, b, g, d]`` buffer the attention backward
wrote dK/dV into hand each rank the sum over ranks of the gradient of its own two chunks.
Both run asynchronously, so that a caller attends with one head group while the next one's
K/V travel. The context-parallel baseline, which wants keys in global order, re-indexes
(:class:`AllGatherKV`).
"""

from __future__ import annotations

from typing import Tuple

import torch

from megatron_tsp.core import comm
from megatron_tsp.core.block_geometry import rank_slots
from megatron_tsp.core.zigzag import Indices


def _halves(full: torch.Tensor, d: int, c: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The rows of every rank's first chunk and of every rank's second chunk in the zigzag
    layout ``full`` (chunks of ``c`` rows): each in rank order, since rank q's slots are
    those of rank 0 plus q."""
    first, second = rank_slots(d, 0)
    return full[first * c:(first + d) * c], full[second * c:(second + d) * c]


def send_buffer(key_shape, like: torch.Tensor) -> torch.Tensor:
    """This rank's ``[s, 2, b, g, d]`` K/V to gather (k at ``[:, 0]``, v at ``[:, 1]``), for a
    caller to write its keys and values into (``key_shape``: ``[s, b, g, d]``; ``like``: a
    tensor of the dtype and device)."""
    return like.new_empty((key_shape[0], 2) + tuple(key_shape[1:]))


class GatherKV:
    """Start ``K, V = all_gather(k, v)`` into the zigzag layout, every rank's first chunks
    first (what this rank's first query chunk attends to: :meth:`wait_first`), then their
    second chunks; :meth:`wait` returns both, ``[2Dc, b, g, d]`` views of one buffer.
    ``local``: this rank's :func:`send_buffer`; on a group of one rank it is the result, and
    nothing travels."""

    def __init__(self, local: torch.Tensor, group, inflight: comm.InFlight):
        self.inflight = inflight
        self._local = local  # alive until the collectives have read it
        if group.size() == 1:
            self.full, self.first, self.second = local, None, None
            return
        d, c = group.size(), local.size(0) // 2
        self.full = local.new_empty((2 * d * c,) + tuple(local.shape[1:]))
        firsts, seconds = _halves(self.full, d, c)
        self.first = comm.all_gather(firsts, local[:c], group, inflight)
        self.second = comm.all_gather(seconds, local[c:], group, inflight)

    def works(self):
        """The two all-gathers' works (none on one rank)."""
        return [work for work in (self.first, self.second) if work is not None]

    def adopt(self, inflight: comm.InFlight) -> None:
        """Be waited for by ``inflight`` from now on (a gather another schedule posted and
        handed over: :meth:`comm.InFlight.hand_over`)."""
        self.inflight = inflight
        inflight.add(self.works())

    def wait_first(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """K and V once every rank's first chunk (slots D..2D-1) has arrived; slots 0..D-1
        are still arriving."""
        self.inflight.wait(self.first)
        return self.full[:, 0], self.full[:, 1]

    def wait(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """K and V (views): the gathered buffer lives as long as they do, not as this object."""
        self.inflight.wait(self.works())
        full, self.full, self._local = self.full, None, None
        return full[:, 0], full[:, 1]


def grad_buffer(rows: int, like: torch.Tensor) -> torch.Tensor:
    """The fp32 ``[2Dc, 2, b, g, d]`` dK/dV of a head group in the zigzag layout, for the
    attention backward to write into (``like``: a gathered key)."""
    return like.new_empty((rows, 2) + tuple(like.shape[1:]), dtype=torch.float32)


class ScatterKVGrads:
    """``dk, dv = reduce_scatter(dK, dV)`` from the fp32 buffer of :func:`grad_buffer`, in two
    halves posted as they are final: :meth:`post_second_halves` (slots 0..D-1, every rank's
    second chunk: final once the query chunk that attends to them has run its backward) and
    :meth:`post_first_halves`; :meth:`wait` returns this rank's ``[2c, b, g, d]`` (its own
    order), summed over ranks: on a group of one rank the buffer itself, and nothing travels."""

    def __init__(self, full: torch.Tensor, group, inflight: comm.InFlight):
        self.d, self.c = group.size(), full.size(0) // (2 * group.size())
        self.full, self.group, self.inflight = full, group, inflight
        self.local = full if self.d == 1 else full.new_empty((2 * self.c,) + tuple(full.shape[1:]))
        self.handles = []

    def post_second_halves(self) -> None:
        if self.d > 1:
            seconds = _halves(self.full, self.d, self.c)[1]
            self.handles.append(comm.reduce_scatter(self.local[self.c:], seconds, self.group, self.inflight))

    def post_first_halves(self) -> None:
        if self.d > 1:
            firsts = _halves(self.full, self.d, self.c)[0]
            self.handles.append(comm.reduce_scatter(self.local[:self.c], firsts, self.group, self.inflight))

    def wait(self) -> Tuple[torch.Tensor, torch.Tensor]:
        self.inflight.wait(self.handles)
        self.full = None  # read by the collectives, now done (the caller may still hold the buffer)
        return self.local[:, 0], self.local[:, 1]


class AllGatherKV(torch.autograd.Function):
    """K, V = all_gather_seq(k, v) in *global* order; backward: dk, dv = reduce_scatter(dK, dV).

    For the context-parallel baseline (keys in global order for megatron's chunk layout, a
    re-index each way); TSP attention gathers into the zigzag layout inside its own schedule.
    """

    @staticmethod
    def forward(ctx, key, value, group, indices: Indices):
        ctx.group, ctx.indices = group, indices
        with comm.InFlight() as inflight:
            local = torch.stack([key, value], dim=1).contiguous()
            full = local.new_empty((local.size(0) * group.size(),) + tuple(local.shape[1:]))
            inflight.wait(comm.all_gather(full, local, group, inflight))
        full = full.index_select(0, indices.to_natural)
        return full[:, 0], full[:, 1]

    @staticmethod
    def backward(ctx, d_keys, d_values):
        indices, group = ctx.indices, ctx.group
        full = d_keys.new_empty((d_keys.size(0), 2) + tuple(d_keys.shape[1:]))
        full[:, 0].index_copy_(0, indices.to_natural, d_keys)
        full[:, 1].index_copy_(0, indices.to_natural, d_values)
        local = full.new_empty((full.size(0) // group.size(),) + tuple(full.shape[1:]))
        with comm.InFlight() as inflight:
            inflight.wait(comm.reduce_scatter(local, full, group, inflight))
        return local[:, 0], local[:, 1], None, None
