"""The collectives TSP issues, on explicit groups with group-local ranks, and the byte
convention every count in the project follows.

Each function calls ``torch.distributed`` on an explicit group (group-local ranks in, global
ranks resolved here). An asynchronous call is registered with the schedule's transport,
:class:`InFlight`, which waits for whatever is still in flight when the schedule stops on an
error: a buffer must outlive its transfer, and a collective library must not be left with
work on freed memory. Without overlap the transport is :class:`Blocking`, on which a
transfer completes where it is posted.

What a count means (:func:`traffic`) is the *logical* traffic of the primitive seen from one
rank, the quantity of docs/design.md section 8, independent of how the backend routes it;
:mod:`megatron_tsp.measure.counts` counts TSP's and megatron's collectives with it:

===================  ==================================  =================================
primitive            received by this rank                sent by this rank
===================  ==================================  =================================
broadcast            n (0 on the source)                  (D-1)·n on the source, else 0
all_gather           (D-1)·n_local                        (D-1)·n_local
reduce_scatter       (D-1)·n_out                          (D-1)·n_out
reduce               (D-1)·n on the destination, else 0   n off the destination, else 0
all_reduce (ring)    2(D-1)/D·n                           2(D-1)/D·n
all_to_all           the output less this rank's slice    the input less this rank's slice
send / recv          n per recv                           n per send
===================  ==================================  =================================

(all_to_all's slices are its split sizes, equal where none are given: (D-1)/D of either
tensor, as megatron's MoE token dispatcher moves tokens to their experts and back.)
"""

from __future__ import annotations

import time
import weakref
from typing import List, Optional, Sequence, Tuple, Type, Union

import torch
import torch.distributed as dist


def logical_bytes(t: Union[torch.Tensor, Sequence[torch.Tensor]]) -> int:
    """Bytes of a tensor, or of a list of tensors."""
    if isinstance(t, (list, tuple)):
        return sum(logical_bytes(x) for x in t)
    return t.numel() * t.element_size()


def traffic(primitive: str, n: int, group_size: int, root: bool = False) -> Tuple[int, int]:
    """(sent, received) bytes of this rank for one collective, as in the table above. ``n``:
    the local shard of an all-gather, the output shard of a reduce-scatter, the tensor
    otherwise; ``root``: this rank is the broadcast's source or the reduce's destination."""
    d = group_size
    if primitive in ("all_gather", "reduce_scatter"):
        return (d - 1) * n, (d - 1) * n
    if primitive == "all_reduce":
        return 2 * (d - 1) * n // max(d, 1), 2 * (d - 1) * n // max(d, 1)
    if primitive == "broadcast":
        return ((d - 1) * n, 0) if root else (0, n)
    if primitive == "reduce":
        return (0, (d - 1) * n) if root else (n, 0)
    raise ValueError(f"no traffic rule for {primitive!r}")


Handle = Optional[Union[dist.Work, List[dist.Work]]]

_observer = None


def observe(observer):
    """Let ``observer`` see the schedules and the transfers every :class:`InFlight` posts and
    waits for (None: nobody): its ``opened(inflight)`` and ``closed(inflight)`` as a schedule
    starts and ends (``inflight.label`` names it), ``posted(work)`` as a transfer starts,
    ``waited(work, seconds)`` after each wait
    for one (:mod:`megatron_tsp.measure.waits`). Returns the observer it replaces."""
    global _observer
    previous, _observer = _observer, observer
    return previous


# every transfer waited for, by any schedule, weakly (a process group's work may hold its
# tensors: gloo's do): one schedule may post a transfer for the next (core/prefetch.py) and
# both wait for it, and gloo's point-to-point works never return from a second wait
_waited: weakref.WeakSet = weakref.WeakSet()


def _wait_once(work: dist.Work) -> None:
    if work not in _waited:
        work.wait()
        _waited.add(work)


def finish(handle: Handle) -> None:
    """Wait for ``handle`` outside a schedule (a transfer posted for a module that did not
    take it), unless a schedule waited for it already."""
    for work in _works(handle):
        _wait_once(work)


class InFlight:
    """The asynchronous transfers of one schedule (one layer's forward or backward).

    ``add(handle)`` when a transfer starts, ``wait(handle)`` before its buffer is read; used
    as a context manager, an exception waits for every transfer still in flight before it
    propagates (and so does a normal exit, which should find none). ``label`` names the
    schedule for an observer's timeline (``"attention 3 forward"``)."""

    def __init__(self, label: str = "") -> None:
        self.label = label
        self._handles: List[dist.Work] = []
        # this schedule's finished works, weakly: a schedule that lets a buffer go must not
        # keep it alive until the schedule ends
        self._done: weakref.WeakSet = weakref.WeakSet()

    def add(self, handle: Handle) -> Handle:
        for work in _works(handle):
            self._handles.append(work)
            if _observer is not None:
                _observer.posted(work)
        return handle

    def wait(self, handle: Handle) -> None:
        """Wait for ``handle`` (a second wait of the same transfer returns at once; one this
        schedule never started is an error, not a read before arrival)."""
        for work in _works(handle):
            if work in self._handles:
                if _observer is None or work in _waited:
                    _wait_once(work)
                else:
                    start = time.perf_counter()
                    _wait_once(work)
                    _observer.waited(work, time.perf_counter() - start)
                self._handles.remove(work)
                self._done.add(work)
            elif work not in self._done:
                raise RuntimeError("InFlight.wait: a transfer that was never added to this schedule")

    def hand_over(self, handle: Handle) -> None:
        """Stop tracking ``handle`` without waiting: another schedule adopts it (its buffers
        live on with whoever reads them). One already waited for needs nothing."""
        for work in _works(handle):
            if work not in self._done:
                self._handles.remove(work)

    def __enter__(self) -> "InFlight":
        if _observer is not None:
            _observer.opened(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        pending, self._handles = self._handles, []
        for work in pending:
            try:
                _wait_once(work)
            except Exception:  # noqa: BLE001 - the schedule's own error is the one to report
                if exc_type is None:
                    raise
        if _observer is not None:
            _observer.closed(self)


class Blocking(InFlight):
    """The transport without overlap (``overlap_comm=False``, mode ``tsp-no-overlap``): every
    transfer completes where it is posted, so the schedule's waits find it done and nothing
    travels while anything computes. The schedules run the same steps on either transport,
    so that tsp-no-overlap differs from tsp by what the overlap hides, and by nothing else."""

    def add(self, handle: Handle) -> Handle:
        super().add(handle)
        self.wait(handle)
        return handle


def label(kind: str, module, phase: str) -> str:
    """A schedule's name on an observer's timeline: ``"attention 3 forward"`` (its layer's
    number where the module has one)."""
    return f"{kind} {getattr(module, 'layer_number', '?')} {phase}"


def transport(overlap: bool) -> Type[InFlight]:
    """The transport a layer's schedules run on: :class:`InFlight`, whose transfers travel
    from their post to their wait, or :class:`Blocking`."""
    return InFlight if overlap else Blocking


def _works(handle: Handle) -> List[dist.Work]:
    if handle is None:
        return []
    return list(handle) if isinstance(handle, (list, tuple)) else [handle]


def _started(handle: Handle, inflight: Optional[InFlight]) -> Handle:
    """Registered with ``inflight`` when given; else the caller registers it where it is waited."""
    return handle if inflight is None else inflight.add(handle)


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup, inflight: Optional[InFlight] = None
              ) -> dist.Work:
    """Start: ``tensor`` on every rank := ``tensor`` on group rank ``src``."""
    return _started(dist.broadcast(tensor, src=dist.get_global_rank(group, src), group=group, async_op=True),
                    inflight)


def all_gather(output: torch.Tensor, local: torch.Tensor, group: dist.ProcessGroup,
               inflight: InFlight) -> dist.Work:
    """Start: ``output`` = concatenation over group ranks of ``local`` along dim 0."""
    return inflight.add(_all_gather_single()(output, local, group=group, async_op=True))


def reduce_scatter(output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup,
                   inflight: InFlight) -> dist.Work:
    """Start: ``output`` on rank r = sum over ranks of the r-th dim-0 slice of ``full``."""
    return inflight.add(_reduce_scatter_single()(output, full, group=group, async_op=True))


def reduce(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup, inflight: Optional[InFlight] = None
           ) -> dist.Work:
    """Start: ``tensor`` on group rank ``dst`` := sum over ranks of ``tensor``."""
    return _started(dist.reduce(tensor, dst=dist.get_global_rank(group, dst), group=group, async_op=True), inflight)


def send_recv(sends: Sequence[Tuple[torch.Tensor, int]], recvs: Sequence[Tuple[torch.Tensor, int]],
              group: dist.ProcessGroup, inflight: Optional[InFlight] = None) -> List[dist.Work]:
    """Start point-to-point sends and receives (group ranks) together."""
    if not sends and not recvs:
        return []
    ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(group, peer), group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(group, peer), group) for t, peer in recvs]
    return _started(dist.batch_isend_irecv(ops), inflight)


# torch >= 2.13 renamed the tensor-in/tensor-out collectives; older releases have only the
# original names. Looked up per call, so that a wrapper installed on torch.distributed (the
# collective counter's) sees these calls too.
def _all_gather_single():
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter_single():
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
