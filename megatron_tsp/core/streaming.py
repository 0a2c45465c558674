"""Moving weight shards past the tokens: broadcast stream (attention) and ring (MLP).

A *shard* is the list of one rank's weight tensors of a layer (all of one dtype). On the wire
it travels as one flat buffer (:func:`pack`); the receiver computes on views into it
(:func:`unpack`). Both schedules keep at most two shards alive per layer, the one in use
and the one in flight (DESIGN.md section 5), and with ``overlap=False`` they issue the same
transfers after the compute instead of before it, so results are bit-identical either way.
"""

from __future__ import annotations

from typing import Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_tsp.core import comm

Shard = List[torch.Tensor]


def linear_pair_shard(first: torch.nn.Module, second: torch.nn.Module) -> Shard:
    """A layer's shard as it travels: the first linear's weight (and bias: it is split
    with the weight) and the second linear's weight (its bias is replicated, not sent)."""
    return [first.weight] + ([first.bias] if first.bias is not None else []) + [second.weight]


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def unpack(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> Shard:
    out, offset = [], 0
    for t in like:
        out.append(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    return out


class ShardStream:
    """Yield ``(r, shard_r)`` for r = 0..D-1, shard r broadcast from its owner r.

    With ``overlap`` the broadcast of shard r+1 is in flight while the caller computes with
    shard r. ``reduce_grad(r, grads)`` sends the caller's partial gradient of shard r to its
    owner (``reduce(dst=r)``, asynchronous, at most two in flight); ``own_grads()`` returns
    the summed gradient of this rank's shard.
    """

    def __init__(self, own: Sequence[torch.Tensor], group: dist.ProcessGroup, overlap: bool = True):
        self.own = list(own)
        self.group = group
        self.overlap = overlap
        self._grad_pending: List[Tuple[int, torch.Tensor, object]] = []
        self._own_grad: Optional[torch.Tensor] = None

    def _start(self, r: int) -> Tuple[torch.Tensor, object]:
        if r == self.group.rank():
            buf = pack(self.own)
        else:
            numel = sum(t.numel() for t in self.own)
            buf = torch.empty(numel, dtype=self.own[0].dtype, device=self.own[0].device)
        return buf, comm.broadcast(buf, r, self.group, async_op=True)

    def __iter__(self) -> Iterator[Tuple[int, Shard]]:
        d_size, rank = self.group.size(), self.group.rank()
        if d_size == 1:
            yield 0, self.own
            return
        pending = self._start(0)
        for r in range(d_size):
            buf, handle = pending
            if self.overlap and r + 1 < d_size:
                pending = self._start(r + 1)
            comm.wait(handle)
            yield r, (self.own if r == rank else unpack(buf, self.own))
            del buf, handle
            if not self.overlap and r + 1 < d_size:
                pending = self._start(r + 1)

    def reduce_grad(self, r: int, grads: Sequence[torch.Tensor]) -> None:
        flat = pack(grads)
        if self.group.size() == 1:
            self._own_grad = flat
            return
        self._grad_pending.append((r, flat, comm.reduce(flat, r, self.group, async_op=True)))
        self._drain(keep=1 if self.overlap else 0)

    def _drain(self, keep: int) -> None:
        while len(self._grad_pending) > keep:
            r, flat, handle = self._grad_pending.pop(0)
            comm.wait(handle)
            if r == self.group.rank():
                self._own_grad = flat

    def own_grads(self) -> Shard:
        self._drain(keep=0)
        return unpack(self._own_grad, self.own)


class ShardRing:
    """Yield ``(j, shard_j)`` for t = 0..D-1 where rank p holds shard ``j = (p - t) mod D``.

    Each step sends the current shard to p+1 and receives the next from p-1 (point to point,
    every link busy with a different shard, no collective barrier). With ``overlap`` the
    transfer runs while the caller computes.

    Backward: ``add_grad(contribution)`` after computing with shard j adds this rank's partial
    gradient of j to an accumulator that travels the ring behind the weights. The owner
    keeps its own contribution from step 0; the accumulator starts at the next holder, adds
    every other rank's contribution and reaches the owner after D-1 hops (the last one after
    the loop). ``own_grads()`` returns the summed gradient of this rank's shard.
    """

    def __init__(self, own: Sequence[torch.Tensor], group: dist.ProcessGroup, overlap: bool = True):
        self.own = list(own)
        self.group = group
        self.overlap = overlap
        self._contribution: Optional[torch.Tensor] = None
        self._own_grad: Optional[torch.Tensor] = None
        self._acc_out: Optional[torch.Tensor] = None

    def __iter__(self) -> Iterator[Tuple[int, Shard]]:
        d_size, rank = self.group.size(), self.group.rank()
        nxt, prv = (rank + 1) % d_size, (rank - 1) % d_size
        current = pack(self.own) if d_size > 1 else None
        for t in range(d_size):
            sends, recvs = [], []
            incoming = acc_in = None
            if t < d_size - 1:
                incoming = torch.empty_like(current)
                sends.append((current, nxt))
                recvs.append((incoming, prv))
            if self._acc_out is not None:
                acc_in = torch.empty_like(self._acc_out)
                sends.append((self._acc_out, nxt))
                recvs.append((acc_in, prv))
            handles = comm.send_recv(sends, recvs, self.group) if self.overlap else None
            yield (rank - t) % d_size, (self.own if current is None else unpack(current, self.own))
            if not self.overlap:
                handles = comm.send_recv(sends, recvs, self.group)
            comm.wait(handles)
            self._accumulate(t, acc_in)
            current = incoming
        if self._acc_out is not None:
            acc_in = torch.empty_like(self._acc_out)
            comm.wait(comm.send_recv([(self._acc_out, nxt)], [(acc_in, prv)], self.group))
            self._own_grad += acc_in
            self._acc_out = None

    def add_grad(self, grads: Sequence[torch.Tensor]) -> None:
        self._contribution = pack(grads)

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
        return unpack(self._own_grad, self.own)
