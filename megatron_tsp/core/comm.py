"""The collectives TSP issues, each counted in bytes.

Every TSP byte on the wire goes through one of the functions below, which call
``torch.distributed`` on an explicit group (group-local ranks in, global ranks resolved
here) and record the call in :data:`COUNTER` under the current :func:`scope`
(for example ``"layer1/attention/forward"``).

What is counted is the *logical* traffic of the primitive seen from this rank, the quantity
of DESIGN.md section 5, independent of how the backend routes it:

===================  ==================================  =================================
primitive            received by this rank                sent by this rank
===================  ==================================  =================================
broadcast            n (0 on the source)                  (D-1)·n on the source, else 0
all_gather           (D-1)·n_local                        (D-1)·n_local
reduce_scatter       (D-1)·n_out                          (D-1)·n_out
reduce               (D-1)·n on the destination, else 0   n off the destination, else 0
all_reduce (ring)    2(D-1)/D·n                           2(D-1)/D·n
send / recv          n per recv                           n per send
===================  ==================================  =================================

:func:`traffic` is that table; :mod:`megatron_tsp.measure.counts` counts megatron's collectives
with it too, so every count in the project follows one convention.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Dict, Iterator, List, Sequence, Tuple, Union

import torch
import torch.distributed as dist


class CommCounter:
    """Per-scope, per-primitive call and byte counts for this rank."""

    def __init__(self) -> None:
        self._scopes: List[str] = []
        self.reset()

    def reset(self) -> None:
        self.records: Dict[str, Dict[str, Dict[str, int]]] = defaultdict(
            lambda: defaultdict(lambda: {"calls": 0, "bytes_sent": 0, "bytes_received": 0})
        )

    @property
    def current_scope(self) -> str:
        return "/".join(self._scopes) or "global"

    def record(self, primitive: str, sent: int, received: int) -> None:
        entry = self.records[self.current_scope][primitive]
        entry["calls"] += 1
        entry["bytes_sent"] += sent
        entry["bytes_received"] += received

    def as_dict(self) -> Dict[str, Dict[str, Dict[str, int]]]:
        return {scope: {p: dict(e) for p, e in prims.items()} for scope, prims in self.records.items()}


COUNTER = CommCounter()


@contextlib.contextmanager
def scope(name: str) -> Iterator[None]:
    """Label the collectives issued inside the block (scopes nest with '/')."""
    COUNTER._scopes.append(name)
    try:
        yield
    finally:
        COUNTER._scopes.pop()


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


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup, async_op: bool = False):
    """``tensor`` on every rank := ``tensor`` on group rank ``src``."""
    COUNTER.record("broadcast", *traffic("broadcast", logical_bytes(tensor), group.size(), group.rank() == src))
    return dist.broadcast(tensor, src=dist.get_global_rank(group, src), group=group, async_op=async_op)


def all_gather(output: torch.Tensor, local: torch.Tensor, group: dist.ProcessGroup,
               async_op: bool = False):
    """``output`` = concatenation over group ranks of ``local`` along dim 0."""
    COUNTER.record("all_gather", *traffic("all_gather", logical_bytes(local), group.size()))
    return _all_gather_single()(output, local, group=group, async_op=async_op)


def reduce_scatter(output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup,
                   async_op: bool = False):
    """``output`` on rank r = sum over ranks of the r-th dim-0 slice of ``full``."""
    COUNTER.record("reduce_scatter", *traffic("reduce_scatter", logical_bytes(output), group.size()))
    return _reduce_scatter_single()(output, full, group=group, async_op=async_op)


def reduce(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup, async_op: bool = False):
    """``tensor`` on group rank ``dst`` := sum over ranks of ``tensor``."""
    COUNTER.record("reduce", *traffic("reduce", logical_bytes(tensor), group.size(), group.rank() == dst))
    return dist.reduce(tensor, dst=dist.get_global_rank(group, dst), group=group, async_op=async_op)


def send_recv(sends: Sequence[Tuple[torch.Tensor, int]], recvs: Sequence[Tuple[torch.Tensor, int]],
              group: dist.ProcessGroup) -> List[dist.Work]:
    """Start point-to-point sends and receives (group ranks) together; return their handles."""
    if not sends and not recvs:
        return []
    COUNTER.record("send_recv", logical_bytes([t for t, _ in sends]), logical_bytes([t for t, _ in recvs]))
    ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(group, peer), group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(group, peer), group) for t, peer in recvs]
    return dist.batch_isend_irecv(ops)


def wait(handles) -> None:
    """Wait for async handles (a handle, a list, or None). The group's timeout applies."""
    if handles is None:
        return
    for handle in handles if isinstance(handles, (list, tuple)) else (handles,):
        handle.wait()


# torch >= 2.13 renamed the tensor-in/tensor-out collectives; older releases have only the
# original names. Looked up per call, so that a wrapper installed on torch.distributed (the
# memory planner's) sees these calls too.
def _all_gather_single():
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter_single():
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
