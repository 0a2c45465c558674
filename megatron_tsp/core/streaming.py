"""Moving weight shards past the tokens: the broadcast stream (attention) and the ring (MLP).

A *shard* is the list of one rank's weight tensors of a layer (all of one dtype). On the wire
it travels as one flat buffer (:func:`pack`); the receiver computes on views into it
(:func:`unpack`). Gradients travel the same way, in fp32: a shard's partial weight gradients
are written by their GEMMs straight into views of the flat buffer that carries them
(:mod:`megatron_tsp.core.gemm`), and the owner adds the sum into megatron's fp32 ``main_grad``
(:func:`deliver_grads`), with no rounding in between.

The schedules call the verbs below at the lines where the transfers start and end, as
ring-flash-attention's ``RingComm`` does:

* :class:`WeightBroadcast` (attention; shard r from its owner r, all ranks together):
  ``start(r)``, ``wait(r)``, ``release(r)``; gradients: ``grad_buffer()``,
  ``reduce(r, flat)``, ``wait_reduces(keep)``, ``own_grad()``;
* :class:`WeightRing` (MLP; at step t rank p holds shard ``(p - t) mod D``, in the order
  ``steps()``): ``start(t)`` (send the current shard to p+1, receive the next from p-1; in
  backward also the gradient accumulators), ``advance()``; backward also ``first()`` and
  ``last_hop()``, and no hop for a shard its forward kept (``last``); gradients:
  ``grad_buffer(t)``, ``finish_grad(t, flat)``, ``own_grad()``;
* :func:`gather_shards` (a short layer's MLP, and its attention through
  :class:`WeightGather`: every shard at once, the same bytes as the ring's hops or the D
  broadcasts): ``GatheredShards``, every rank's shard stacked so that one GEMM reads them;
  gradients: :func:`scatter_grads`, a reduce-scatter in fp32 in place of the accumulators
  and the reduces.

The first transfer of a layer's stream may already be in flight when the layer starts: the
layer before it started it during its last stage (:mod:`megatron_tsp.core.prefetch`). A
stream holds the shards in flight (``lookahead`` ahead of the one in use in the forward,
``lookahead + 1`` in the backward) and the one in use; the attention backward also keeps the
previous head group's until its weight gradients, which wait for its dK/dV, are formed
(docs/design.md section 9).
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_tsp.core import comm

Shard = List[torch.Tensor]


def run_forward_pre_hooks(module: torch.nn.Module) -> None:
    """What calling ``module`` would run before its forward, for a module whose weights a
    schedule reads without calling it. megatron's DDP waits there, under
    ``--overlap-param-gather``, for the distributed optimizer's all-gather of the module's
    parameters and starts the next bucket's (``DistributedDataParallel._make_forward_pre_hook``);
    without it TSP would compute on stale or half-gathered weights."""
    for key, hook in list(module._forward_pre_hooks.items()):
        if key in module._forward_pre_hooks_with_kwargs:
            hook(module, (), {})
        else:
            hook(module, ())


def linear_pair_shard(first: torch.nn.Module, second: torch.nn.Module) -> Shard:
    """A layer's shard as it travels: the first linear's weight (and bias: it is split
    with the weight) and the second linear's weight (its bias is replicated, not sent).
    Reading them stands in for calling both modules (:func:`run_forward_pre_hooks`)."""
    run_forward_pre_hooks(first)
    run_forward_pre_hooks(second)
    return [first.weight] + ([first.bias] if first.bias is not None else []) + [second.weight]


def numel(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() for t in tensors)


def fp32_flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """An uninitialised flat fp32 buffer of ``tensors``' elements (a shard's gradient
    accumulator), on their device."""
    return torch.empty(numel(tensors), dtype=torch.float32, device=tensors[0].device)


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def unpack(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> Shard:
    out, offset = [], 0
    for t in like:
        out.append(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    return out


def deliver_grads(own: Sequence[torch.Tensor], flat: torch.Tensor) -> List[torch.Tensor]:
    """The summed fp32 gradient ``flat`` of this rank's shard, as autograd's result for its
    parameters. Under megatron's DDP (a parameter with ``main_grad``) it is added to the fp32
    ``main_grad`` here and autograd gets an unread placeholder with
    ``grad_added_to_main_grad`` set, as megatron's gradient-accumulation fusion does (zeros
    where megatron set ``zero_out_wgrad``: a weight two layers of one stage share, whose
    placeholders DDP's hook adds); otherwise the gradient in the parameter's dtype."""
    grads = []
    for p, g in zip(own, unpack(flat, own)):
        if getattr(p, "main_grad", None) is not None:
            p.main_grad.add_(g)
            p.grad_added_to_main_grad = True
            grads.append(torch.zeros_like(p) if getattr(p, "zero_out_wgrad", False) else torch.empty_like(p))
        else:
            grads.append(g.to(p.dtype))
    return grads


class WeightBroadcast:
    """Head-group shards by broadcast: shard r is rank r's, and every rank computes with it.

    ``start(r)`` posts the broadcast of shard r into a fresh flat buffer (the owner sends its
    packed own tensors), ``wait(r)`` returns the shard (views of the buffer; the owner's own
    tensors) once it has arrived, ``release(r)`` lets its buffer go. Gradients: the caller
    writes its fp32 partial gradient of shard r into ``grad_buffer()``, ``reduce(r, flat)``
    posts ``reduce(dst=r)``, ``wait_reduces(keep)`` waits for all but the ``keep`` newest, and
    ``own_grad()`` for the rest, returning the summed gradient of this rank's shard.
    ``first``: the broadcasts of the first shards already posted (by the layer before:
    :mod:`prefetch`), ``({r: (buffer, work)}, works)``."""

    def __init__(self, own: Sequence[torch.Tensor], group: dist.ProcessGroup, inflight: comm.InFlight,
                 first: Optional[Tuple[Dict[int, Tuple[torch.Tensor, comm.Handle]], List[dist.Work]]] = None):
        self.own = list(own)
        self.group = group
        self.size, self.rank = group.size(), group.rank()
        self.inflight = inflight
        self._arriving: Dict[int, Tuple[torch.Tensor, comm.Handle]] = {}
        if first is not None:
            shards, works = first
            self._arriving.update(shards)
            inflight.add(works)
        self._reducing: List[Tuple[int, torch.Tensor, comm.Handle]] = []
        self._own_grad: Optional[torch.Tensor] = None

    @staticmethod
    def post(own: Sequence[torch.Tensor], group: dist.ProcessGroup, r: int, inflight: Optional[comm.InFlight] = None
             ) -> Tuple[torch.Tensor, comm.Handle]:
        """Post the broadcast of shard r over ``group`` (``own``: this rank's shard)."""
        if r == group.rank():
            buf = pack(own)
        else:
            buf = torch.empty(numel(own), dtype=own[0].dtype, device=own[0].device)
        return buf, comm.broadcast(buf, r, group, inflight)

    def start(self, r: int) -> None:
        if self.size > 1 and r < self.size and r not in self._arriving:
            self._arriving[r] = self.post(self.own, self.group, r, self.inflight)

    def wait(self, r: int) -> Shard:
        if self.size == 1 or r == self.rank:
            if r in self._arriving:  # the owner's broadcast only has to leave
                self.inflight.wait(self._arriving[r][1])
            return self.own
        buf, work = self._arriving[r]
        self.inflight.wait(work)
        return unpack(buf, self.own)

    def release(self, r: int) -> None:
        self._arriving.pop(r, None)

    def grad_buffer(self) -> torch.Tensor:
        return fp32_flat(self.own)

    def reduce(self, r: int, flat: torch.Tensor) -> None:
        if self.size == 1:
            self._own_grad = flat
            return
        self._reducing.append((r, flat, comm.reduce(flat, r, self.group, self.inflight)))

    def wait_reduces(self, keep: int) -> None:
        """Wait for the reduces posted, oldest first, until ``keep`` are left in flight (each
        holds its fp32 gradient buffer until then)."""
        while len(self._reducing) > keep:
            r, flat, work = self._reducing.pop(0)
            self.inflight.wait(work)
            if r == self.rank:
                self._own_grad = flat

    def own_grad(self) -> torch.Tensor:
        self.wait_reduces(keep=0)
        return self._own_grad


class WeightRing:
    """The MLP's shards around the ring: at step t rank p holds shard ``j = (p - t) mod D``.

    ``start(t)`` posts, together, the send of the current shard to p+1 and the receive of
    the next from p-1 (not on the last step: every link carries a different shard, no
    collective barrier), and in backward the gradient accumulators (below); ``shard()`` is
    the current shard, ``advance()`` makes the next one current once it has arrived.
    ``first`` is the first exchange (own shard out, p-1's in) already posted (by the layer
    before: :mod:`prefetch`). Forward runs steps 0, 1, ..., D-1.

    Backward runs steps 1, ..., D-1 and then 0, this rank's own shard last: the gradients
    that travel are formed first, and the last hop is in flight while the owner forms its
    own part. The accumulator of shard j is started by its first holder after the owner
    (step 1, a fresh buffer, ``grad_buffer(1)``); every later holder receives it during its
    step and adds its contribution (``grad_buffer(t)`` waits for it); the holder at step
    D-1 sends it on to the owner (``last_hop()``), which writes its own part into a fresh
    buffer (``grad_buffer(0)``) and adds what arrived (``own_grad()``).

    ``last`` (backward): the shard of step D-1, shard p+1, which the forward computed with
    last, kept by a forward whose backward runs right after it (:mod:`prefetch`). Its hop
    is not made: with D = 2 the backward moves no weights at all, only the accumulators."""

    def __init__(self, own: Sequence[torch.Tensor], group: dist.ProcessGroup, inflight: comm.InFlight,
                 backward: bool = False, first: Optional[Tuple[torch.Tensor, comm.Handle]] = None,
                 last: Optional[torch.Tensor] = None):
        self.own = list(own)
        self.group = group
        self.size, self.rank = group.size(), group.rank()
        self.inflight = inflight
        self.backward = backward
        self._last = last if backward and self.size > 1 else None
        # the own shard travels packed first, unless the one shard it would fetch is kept (D = 2)
        self.current = pack(own) if self.size > 1 and (not backward or self._receives(1)) else None
        self._incoming: Optional[Tuple[torch.Tensor, comm.Handle]] = None
        self._acc_in: Optional[Tuple[torch.Tensor, comm.Handle]] = None
        self._acc_out: Optional[torch.Tensor] = None  # finished accumulator, sent at the next start
        self._own_grad: Optional[torch.Tensor] = None
        if first is not None:
            self.current, incoming, work = first
            self._incoming = (incoming, inflight.add(work))

    @staticmethod
    def post(own: Sequence[torch.Tensor], group: dist.ProcessGroup, current: Optional[torch.Tensor] = None,
             inflight: Optional[comm.InFlight] = None):
        """Post the first weight exchange over ``group``: (the packed own shard, the receive
        buffer, the work)."""
        current = pack(own) if current is None else current
        incoming = torch.empty_like(current)
        return current, incoming, _exchange(group, [(current, 1)], [(incoming, -1)], inflight)

    def steps(self) -> List[int]:
        """The order of the steps: 0..D-1 forward; 1..D-1, then 0, backward."""
        if self.backward and self.size > 1:
            return list(range(1, self.size)) + [0]
        return list(range(self.size))

    def shard_index(self, t: int) -> int:
        return (self.rank - t) % self.size

    def shard(self) -> Shard:
        return self.own if self.current is None else unpack(self.current, self.own)

    def start(self, t: int) -> None:
        """Post step t's transfers: the next shard (forward: after step t; backward: the
        first one before step 1, then after step t < D-1), and in backward the accumulator
        step t adds into (t >= 2) with the one step t-1 finished."""
        if self.size == 1:
            return
        sends, recvs = [], []
        incoming = None
        if self._incoming is None and (t < self.size - 1 if not self.backward else self._receives(t + 1)):
            incoming = torch.empty_like(self.current)
            sends.append((self.current, 1))
            recvs.append((incoming, -1))
        acc_in = None
        if self.backward:
            if self._acc_out is not None:
                sends.append((self._acc_out, 1))
            if t >= 2:
                acc_in = fp32_flat(self.own)
                recvs.append((acc_in, -1))
        works = _exchange(self.group, sends, recvs, self.inflight)
        if incoming is not None:
            self._incoming = (incoming, works)
        if acc_in is not None:
            self._acc_in = (acc_in, works)
        self._acc_out = None

    def _receives(self, t: int) -> bool:
        """Backward: whether step t's shard travels (steps 1..D-1, less a kept one)."""
        return 1 <= t < self.size and not (t == self.size - 1 and self._last is not None)

    def first(self) -> None:
        """Backward, before step 1: the first exchange (own shard out, p-1's in), unless posted
        or kept."""
        if self.size > 1 and self._incoming is None and self._receives(1):
            self._incoming = self.post(self.own, self.group, self.current, self.inflight)[1:]

    def last_hop(self) -> None:
        """Backward, after step D-1: the finished accumulator to its owner, this rank's own in."""
        if self.size > 1:
            acc_in = fp32_flat(self.own)
            self._acc_in = (acc_in, _exchange(self.group, [(self._acc_out, 1)], [(acc_in, -1)], self.inflight))
            self._acc_out = self.current = None  # the last shard that came in: the own step needs none

    def advance(self) -> None:
        """The next shard, once its transfer has arrived (or the kept one, which did not
        travel), becomes the current one."""
        if self._incoming is not None:
            incoming, works = self._incoming
            self.inflight.wait(works)
            self.current, self._incoming = incoming, None
        elif self._last is not None:
            self.current, self._last = self._last, None

    def grad_buffer(self, t: int) -> Tuple[torch.Tensor, bool]:
        """(flat fp32 buffer of step t's shard gradient, whether to add into it rather than
        write it). Steps 0 and 1 start a buffer; later steps add into the accumulator that
        arrives from p-1 (waited for here). Call :meth:`finish_grad` when written."""
        if self.size == 1 or t <= 1:
            return fp32_flat(self.own), False
        acc_in, works = self._acc_in
        self.inflight.wait(works)
        self._acc_in = None
        return acc_in, True

    def finish_grad(self, t: int, flat: torch.Tensor) -> None:
        if t == 0 or self.size == 1:
            self._own_grad = flat
        else:
            self._acc_out = flat

    def own_grad(self) -> torch.Tensor:
        """The summed gradient of this rank's shard: its own part, plus what the last hop brought."""
        if self.size > 1:
            acc_in, works = self._acc_in
            self.inflight.wait(works)
            self._own_grad.add_(acc_in)
        return self._own_grad


class GatheredShards(NamedTuple):
    """Every rank's shard of a linear pair (:func:`linear_pair_shard`), all-gathered in shard
    order: the first linear's weights ``[D r, h]`` and bias ``[D r]`` (None without), whose
    rows are the full column-parallel layer's; the second linear's transposed ``[D c, h]``,
    the full row-parallel weight's transpose; and the gathers' works (last: a transfer)."""

    first: torch.Tensor
    bias: Optional[torch.Tensor]
    second_t: torch.Tensor
    works: List[dist.Work]


def gather_shards(own: Sequence[torch.Tensor], group: dist.ProcessGroup, inflight: comm.InFlight) -> GatheredShards:
    """Post the all-gathers of every rank's shard ``own`` = (W1, (b1), W2): one per tensor, so
    that each arrives as one matrix; W2 travels transposed (a copy of the own shard)."""
    works = []

    def gather(local: torch.Tensor) -> torch.Tensor:
        full = local.new_empty((group.size() * local.size(0),) + local.shape[1:])
        works.append(comm.all_gather(full, local, group, inflight))
        return full

    first, *bias, second = own
    return GatheredShards(gather(first), gather(bias[0]) if bias else None, gather(second.t().contiguous()), works)


def scatter_grads(own: Sequence[torch.Tensor], d_first: torch.Tensor, d_bias: Optional[torch.Tensor],
                  d_second_t: torch.Tensor, group: dist.ProcessGroup, inflight: comm.InFlight) -> torch.Tensor:
    """The fp32 weight gradients of every shard (:class:`GatheredShards`' layout), summed over
    the ranks and each rank's own shard's kept: reduce-scatters into the flat buffer of
    ``own``'s layout (:func:`deliver_grads` takes it), W2's transposed back."""
    flat = fp32_flat(own)
    first, *bias, second = unpack(flat, own)
    second_t = d_second_t.new_empty(second.t().shape)
    works = [comm.reduce_scatter(first, d_first, group, inflight),
             comm.reduce_scatter(second_t, d_second_t, group, inflight)]
    if bias:
        works.append(comm.reduce_scatter(bias[0], d_bias, group, inflight))
    for work in works:
        inflight.wait(work)
    second.copy_(second_t.t())
    return flat


class WeightGather:
    """Every rank's shard at once, for a schedule whose one stage computes with all of them
    (TSP attention with every head group in one call): ``start(r)`` (any r: every shard comes
    at once) posts :func:`gather_shards` (unless ``first``, posted by the module before,
    :mod:`prefetch`),
    ``gathered()`` waits for it; ``scatter(...)`` reduce-scatters the fp32 gradients
    (:func:`scatter_grads`) and ``own_grad()`` returns this rank's."""

    def __init__(self, own: Sequence[torch.Tensor], group: dist.ProcessGroup, inflight: comm.InFlight,
                 first: Optional[GatheredShards] = None):
        self.own, self.group, self.inflight = list(own), group, inflight
        self._full = first
        if first is not None:
            inflight.add(first.works)
        self._own_grad: Optional[torch.Tensor] = None

    def start(self, r: int = 0) -> None:
        if self._full is None:
            self._full = gather_shards(self.own, self.group, self.inflight)

    def gathered(self) -> GatheredShards:
        self.start()
        self.inflight.wait(self._full.works)
        return self._full

    def scatter(self, d_first: torch.Tensor, d_bias: Optional[torch.Tensor], d_second_t: torch.Tensor) -> None:
        self._own_grad = scatter_grads(self.own, d_first, d_bias, d_second_t, self.group, self.inflight)

    def own_grad(self) -> torch.Tensor:
        return self._own_grad


def _exchange(group: dist.ProcessGroup, sends, recvs, inflight: Optional[comm.InFlight]) -> List[dist.Work]:
    """Post point-to-point sends and receives with ring neighbours (offsets +1/-1 in the group)."""
    size, rank = group.size(), group.rank()
    return comm.send_recv([(t, (rank + k) % size) for t, k in sends], [(t, (rank + k) % size) for t, k in recvs],
                          group, inflight)
