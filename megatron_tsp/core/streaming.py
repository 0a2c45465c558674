"""Moving weight shards past the tokens: broadcast stream (attention) and ring (MLP).

A *shard* is the list of one rank's weight tensors of a layer (all of one dtype). On the wire
it travels as one flat buffer (:func:`pack`); the receiver computes on views into it
(:func:`unpack`). Each stream holds at most two shards of a layer, the one in use and the
one in flight (docs/design.md section 9); a caller that keeps a shard for one more step holds
three (TSP attention keeps group r's output projection while group r+1 projects).

Every overlap in TSP is one pattern, :class:`ahead`: the transfer a step needs next is
started before this step computes (so it runs during the compute) or, with
``overlap=False``, after it, so that results are bit-identical either way.

Partial weight gradients are formed and summed over ranks in fp32 (:func:`grad_product`),
as a tensor-parallel layer forms each shard's gradient in one fp32-accumulating GEMM; the
owner rounds the sum once, to the parameter's dtype.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

from megatron_tsp.core import comm

Shard = List[torch.Tensor]


class ahead:
    """``with ahead(start, overlap) as upcoming: <compute>``, then ``upcoming.value``: with
    ``overlap`` ``start()`` runs before the block, so that what it starts (a transfer) is in
    flight while the block computes; without, it runs after the block. Either way the same
    operations happen, in the same order of every sum."""

    def __init__(self, start: Callable[[], object], overlap: bool):
        self.start, self.overlap, self.value = start, overlap, None

    def __enter__(self) -> "ahead":
        if self.overlap:
            self.value = self.start()
        return self

    def __exit__(self, exc_type, *exc) -> bool:
        if exc_type is None and not self.overlap:
            self.value = self.start()
        return False


class OneBehind:
    """Finishing one step late: with ``overlap``, :meth:`swap` holds each item until the next
    one arrives and hands back the previous (whose transfer ran meanwhile); without, it
    hands the item back at once. :meth:`flush` returns the one still held."""

    def __init__(self, overlap: bool):
        self.overlap, self.held = overlap, None

    def swap(self, item):
        if not self.overlap:
            return item
        previous, self.held = self.held, item
        return previous

    def flush(self):
        item, self.held = self.held, None
        return item


def grad_product(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``dy^T x`` of 2-D tensors, accumulated and returned in fp32: one rank's partial weight
    gradient, to be summed over ranks before it is rounded. On a GPU the GEMM runs in the
    inputs' precision with an fp32 output (``torch.mm(..., out_dtype=...)``, torch >= 2.8);
    a CPU has no such kernel and casts both inputs. The memory planner's fake tensors stand
    for a GPU's, so they take the GPU's path: the bytes it counts are the GPU's."""
    if dy.dtype == torch.float32:
        return dy.t() @ x
    if _FP32_OUTPUT_MM and (dy.is_cuda or is_fake(dy)):
        return torch.mm(dy.t(), x, out_dtype=torch.float32)
    return dy.t().float() @ x.float()


_FP32_OUTPUT_MM = hasattr(torch.ops.aten.mm, "dtype")


def linear_pair_shard(first: torch.nn.Module, second: torch.nn.Module) -> Shard:
    """A layer's shard as it travels: the first linear's weight (and bias: it is split
    with the weight) and the second linear's weight (its bias is replicated, not sent)."""
    return [first.weight] + ([first.bias] if first.bias is not None else []) + [second.weight]


def pack(tensors: Sequence[torch.Tensor], dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    return torch.cat([t.reshape(-1).to(dtype or t.dtype) for t in tensors])


def unpack(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> Shard:
    out, offset = [], 0
    for t in like:
        out.append(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    return out


def _owner_grads(flat: torch.Tensor, own: Sequence[torch.Tensor]) -> Shard:
    """The summed fp32 gradient of this rank's shard, rounded to its parameters' dtype."""
    return [g.to(p.dtype) for g, p in zip(unpack(flat, own), own)]


class ShardStream:
    """Yield ``(r, shard_r)`` for r = 0..D-1, shard r broadcast from its owner r (with
    ``overlap``, shard r+1's broadcast is in flight while the caller computes with shard r).

    ``reduce_grad(r, grads)`` sends the caller's fp32 partial gradient of shard r to its
    owner (``reduce(dst=r)``, asynchronous, at most two in flight); ``own_grads()`` returns
    the summed gradient of this rank's shard. Transfers are registered with ``inflight``.
    """

    def __init__(self, own: Sequence[torch.Tensor], group: dist.ProcessGroup, inflight: comm.InFlight,
                 overlap: bool = True):
        self.own = list(own)
        self.group = group
        self.inflight = inflight
        self.overlap = overlap
        self._grad_pending: List[Tuple[int, torch.Tensor, dist.Work]] = []
        self._own_grad: Optional[torch.Tensor] = None

    def _start(self, r: int) -> Optional[Tuple[torch.Tensor, dist.Work]]:
        if r >= self.group.size():
            return None
        if r == self.group.rank():
            buf = pack(self.own)
        else:
            numel = sum(t.numel() for t in self.own)
            buf = torch.empty(numel, dtype=self.own[0].dtype, device=self.own[0].device)
        return buf, comm.broadcast(buf, r, self.group, self.inflight)

    def __iter__(self) -> Iterator[Tuple[int, Shard]]:
        d_size, rank = self.group.size(), self.group.rank()
        if d_size == 1:
            yield 0, self.own
            return
        arriving = self._start(0)
        for r in range(d_size):
            buf, handle = arriving
            self.inflight.wait(handle)
            with ahead(partial(self._start, r + 1), self.overlap) as upcoming:
                yield r, (self.own if r == rank else unpack(buf, self.own))
            del buf, handle
            arriving = upcoming.value

    def reduce_grad(self, r: int, grads: Sequence[torch.Tensor]) -> None:
        flat = pack(grads, torch.float32)
        if self.group.size() == 1:
            self._own_grad = flat
            return
        self._grad_pending.append((r, flat, comm.reduce(flat, r, self.group, self.inflight)))
        self._drain(keep=1 if self.overlap else 0)

    def _drain(self, keep: int) -> None:
        while len(self._grad_pending) > keep:
            r, flat, handle = self._grad_pending.pop(0)
            self.inflight.wait(handle)
            if r == self.group.rank():
                self._own_grad = flat

    def own_grads(self) -> Shard:
        self._drain(keep=0)
        return _owner_grads(self._own_grad, self.own)


class ShardRing:
    """Yield ``(j, shard_j)`` for t = 0..D-1 where rank p holds shard ``j = (p - t) mod D``.

    Each step sends the current shard to p+1 and receives the next from p-1 (point to point,
    every link busy with a different shard, no collective barrier); with ``overlap`` the
    transfer runs while the caller computes.

    Backward: ``add_grad(contribution)`` after computing with shard j adds this rank's partial
    gradient of j (fp32) to an accumulator that travels the ring one step behind the weights.
    The owner keeps its own contribution from step 0; the accumulator starts at the next
    holder, adds every other rank's contribution and reaches the owner after D-1 hops (the
    last one after the loop). ``own_grads()`` returns the summed gradient of this rank's shard.
    """

    def __init__(self, own: Sequence[torch.Tensor], group: dist.ProcessGroup, inflight: comm.InFlight,
                 overlap: bool = True):
        self.own = list(own)
        self.group = group
        self.inflight = inflight
        self.overlap = overlap
        self._contribution: Optional[torch.Tensor] = None
        self._own_grad: Optional[torch.Tensor] = None
        self._acc_out: Optional[torch.Tensor] = None

    def _start(self, weights: Optional[torch.Tensor]):
        """Send ``weights`` (the shard just used; None on the last step) and the travelling
        accumulator to the next rank, receive their successors from the previous one."""
        d_size, rank = self.group.size(), self.group.rank()
        nxt, prv = (rank + 1) % d_size, (rank - 1) % d_size
        sends, recvs, incoming, acc_in = [], [], None, None
        if weights is not None:
            incoming = torch.empty_like(weights)
            sends.append((weights, nxt))
            recvs.append((incoming, prv))
        if self._acc_out is not None:
            acc_in = torch.empty_like(self._acc_out)
            sends.append((self._acc_out, nxt))
            recvs.append((acc_in, prv))
        return incoming, acc_in, comm.send_recv(sends, recvs, self.group, self.inflight)

    def __iter__(self) -> Iterator[Tuple[int, Shard]]:
        d_size, rank = self.group.size(), self.group.rank()
        current = pack(self.own) if d_size > 1 else None
        for t in range(d_size):
            onward = current if t < d_size - 1 else None
            with ahead(partial(self._start, onward), self.overlap) as transfer:
                yield (rank - t) % d_size, (self.own if current is None else unpack(current, self.own))
            incoming, acc_in, handles = transfer.value
            self.inflight.wait(handles)
            self._accumulate(t, acc_in)
            current = incoming
        if self._acc_out is not None:  # the last hop: the accumulators reach their owners
            _, acc_in, handles = self._start(None)
            self.inflight.wait(handles)
            self._own_grad += acc_in
            self._acc_out = None

    def add_grad(self, grads: Sequence[torch.Tensor]) -> None:
        self._contribution = pack(grads, torch.float32)

    def _accumulate(self, t: int, acc_in: Optional[torch.Tensor]) -> None:
        contribution, self._contribution = self._contribution, None
        if contribution is None:  # forward: no gradients travel
            return
        if t == 0:
            self._own_grad = contribution
        elif acc_in is None:
            self._acc_out = contribution
        else:
            self._acc_out = acc_in.add_(contribution)

    def own_grads(self) -> Shard:
        return _owner_grads(self._own_grad, self.own)
