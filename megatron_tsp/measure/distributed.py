"""The measurements' stand-ins for ``torch.distributed`` functions, each for the length of a block.

:func:`replaced` is how: it swaps ``torch.distributed.<name>`` and every name megatron bound
to it at import (``dist_all_gather_func = torch.distributed.all_gather_into_tensor`` in
tensor_parallel/mappings.py and distributed/param_and_grad_buffer.py), and puts both back
after. On it:

* :func:`observed`: every call seen first (``counts`` records and checks collectives);
* :func:`direct_reductions`: gloo's reduce-scatter and reduce moving the bytes NCCL and RCCL
  move (the CPU benchmarks);
* :func:`fake_world`: the memory planner's rank of a job on torch's ``fake`` backend.

gloo runs ``reduce_scatter_tensor`` as an all-reduce of the whole input, and ``reduce`` with
more traffic still: on loopback at D=2, 2.1x and 2.6x the bytes of the GPU libraries' ring
((D-1)/D of the input sent per rank; (D-1) n into the root), against 1.0x for its
all-gather, all-reduce and broadcast (``tests/test_gloo.py`` counts them). The CPU
benchmarks stand in for a GPU link, so every mode's reduce-scatters (TP+SP's layers, TSP's
dK/dV and vocabulary rows, the distributed optimizer) and reduces (TSP's weight gradients)
would pay for gloo's algorithm, not for what they move. Inside :func:`direct_reductions`,
on a gloo group:

* reduce-scatter = an all-to-all of the D slices, summed where they land;
* reduce = a gather to the root, summed there.

Both are asynchronous like the originals (the sum runs when the transfer completes, and the
returned work completes after it), give the same sum (at D=2 bit for bit: a + b in one
rounding), and are counted by :mod:`counts` as the primitive they stand for. Other backends,
and calls inside a coalescing block (megatron's DDP buckets), take the original.

The CPU's own ``all_to_all_single`` (split sizes as ints) is not one of these: it is a CPU
shim, installed for the life of a CPU process with the others (:mod:`megatron_tsp.run.compat`).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from megatron_tsp.run.upstream import rebind_in_megatron


@contextlib.contextmanager
def replaced(wrap: Callable[[str, Any], Any], names: Sequence[str]) -> Iterator[None]:
    """Inside the block, each ``torch.distributed.<name>`` of ``names`` (those this torch has)
    is ``wrap(name, original)``, and so is every name megatron bound to the original at
    import (:func:`~megatron_tsp.run.upstream.rebind_in_megatron`); both are put back after.
    A megatron module first imported inside the block would keep the stand-in: import it before."""
    originals = {name: getattr(dist, name) for name in names if hasattr(dist, name)}
    replacements = {name: wrap(name, fn) for name, fn in originals.items()}
    for name, fn in replacements.items():
        setattr(dist, name, fn)
    changed = rebind_in_megatron({id(originals[name]): fn for name, fn in replacements.items()})
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        for owner, attr, fn in changed:
            setattr(owner, attr, fn)


def observed(before: Callable[..., None], names: Sequence[str]):
    """Inside the block, every ``torch.distributed`` call of ``names`` calls ``before(name,
    *args, **kwargs)`` first, called by that name or through one megatron bound at import;
    ``before`` gets the arguments in the order of torch's signature, whichever of them the
    caller named (torch FSDP2 names ``output`` and ``input``)."""
    def wrap(name, original):
        signature = inspect.signature(original)

        def wrapper(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            before(name, *bound.args, **bound.kwargs)
            return original(*args, **kwargs)

        wrapper.__wrapped__ = original
        return wrapper

    return replaced(wrap, names)


# ---- gloo's reductions, as the GPU libraries move them ------------------------------------------

REDUCE_SCATTER = ("reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base")


def _direct(group) -> bool:
    group = group if group is not None else dist.group.WORLD
    return dist.get_backend(group) == "gloo" and group not in distributed_c10d._world.pg_coalesce_state


def _summed(work: dist.Work, parts: torch.Tensor, out: torch.Tensor) -> dist.Work:
    """A work that completes once ``work`` has and ``out`` holds the sum of ``parts`` over dim 0."""
    future = work.get_future().then(lambda _: torch.sum(parts, dim=0, out=out))
    return torch._C._distributed_c10d._create_work_from_future(future)


def _finish(work: dist.Work, async_op: bool):
    if async_op:
        return work
    work.wait()
    return None


def _reduce_scatter(original):
    def reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if op != dist.ReduceOp.SUM or not _direct(group):
            return original(output, input, op=op, group=group, async_op=async_op)
        size = dist.get_world_size(group)
        parts = output.new_empty((size,) + tuple(output.shape))
        # the unwrapped call: counts counts this as the reduce-scatter it stands for, not as an all-to-all too
        work = distributed_c10d.all_to_all_single(parts, input.contiguous(), group=group, async_op=True)
        return _finish(_summed(work, parts, output), async_op)

    reduce_scatter.__wrapped__ = original
    return reduce_scatter


def _reduce(original):
    def reduce(tensor, dst=None, op=dist.ReduceOp.SUM, group=None, async_op=False, **kwargs):
        if op != dist.ReduceOp.SUM or not _direct(group):
            return original(tensor, dst=dst, op=op, group=group, async_op=async_op, **kwargs)
        root = dst if dst is not None else dist.get_global_rank(group or dist.group.WORLD, kwargs["group_dst"])
        if dist.get_rank() != root:
            return dist.gather(tensor, None, dst=root, group=group, async_op=async_op)
        parts = tensor.new_empty((dist.get_world_size(group),) + tuple(tensor.shape))
        work = dist.gather(tensor, list(parts.unbind(0)), dst=root, group=group, async_op=True)
        return _finish(_summed(work, parts, tensor), async_op)

    reduce.__wrapped__ = original
    return reduce


def direct_reductions():
    """Inside the block, ``torch.distributed``'s reduce-scatters and reduce (and the names
    megatron bound to them at import) move on a gloo group what they move on a GPU."""
    return replaced(lambda name, fn: (_reduce if name == "reduce" else _reduce_scatter)(fn),
                    REDUCE_SCATTER + ("reduce",))


# ---- the memory planner's world -----------------------------------------------------------------

def _mirrored_all_gather_object(object_list, obj, group=None):
    """Every other rank mirrors this one, so each returns its object."""
    object_list[:] = [copy.deepcopy(obj) for _ in object_list]


class _NoCoalescing(contextlib.AbstractContextManager):
    """FakeTensorMode has no kernel for coalesced collectives: the (no-op) collectives of a
    coalescing block are issued one by one."""

    def __init__(self, group=None, device=None, async_ops=False):
        pass

    def __exit__(self, *exc):
        return False

    def wait(self):
        pass


_FAKE_WORLD = {"all_gather_object": _mirrored_all_gather_object, "_coalescing_manager": _NoCoalescing}


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """Rank ``rank`` of ``world_size`` on torch's ``fake`` backend (collectives are no-ops),
    whose object all-gather returns this rank's object for all, and whose coalescing blocks
    (megatron's gradient buffers) issue their collectives one by one."""
    from megatron.core.distributed import param_and_grad_buffer  # noqa: F401 - binds _coalescing_manager
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with replaced(lambda name, fn: _FAKE_WORLD[name], list(_FAKE_WORLD)):
            yield
    finally:
        dist.destroy_process_group()
