"""The benchmarks' gloo reduce-scatter and reduce (measure/distributed.py): the same sums as gloo's
own, asynchronous like them, counted as what they stand for, and moving the bytes the GPU
libraries move where gloo's own move two and more times that."""

import pytest
import torch
import torch.distributed as dist

from megatron_tsp.core import comm
from megatron_tsp.measure import counts
from megatron_tsp.measure.distributed import direct_reductions


def _loopback_bytes() -> int:
    with open("/proc/net/dev") as f:
        for line in f:
            if line.strip().startswith("lo:"):
                return int(line.split()[9])  # transmitted
    raise RuntimeError("no loopback device")


def _sent_on_loopback(fn) -> int:
    """Bytes every rank together put on the loopback during ``fn`` (ranks in step)."""
    dist.barrier()
    before = _loopback_bytes()
    fn()
    dist.barrier()
    return _loopback_bytes() - before


def rank_bytes_moved():
    """(gloo's own, direct) loopback bytes of a reduce-scatter and a reduce of 8 MiB."""
    n = 2 << 20  # floats: an 8 MiB reduce input, a 4 MiB reduce-scatter output at D=2
    d = dist.get_world_size()
    full, out, whole = torch.ones(n), torch.empty(n // d), torch.ones(n)
    calls = {"reduce_scatter": lambda: dist.reduce_scatter_tensor(out, full),
             "reduce": lambda: dist.reduce(whole, dst=0)}
    own = {name: _sent_on_loopback(fn) for name, fn in calls.items()}
    with direct_reductions():
        direct = {name: _sent_on_loopback(fn) for name, fn in calls.items()}
    return own, direct, 4 * n


def test_direct_reductions_move_what_the_gpu_libraries_move(ranks):
    own, direct, nbytes = ranks(2, rank_bytes_moved)[0]
    # a ring moves (D-1)/D of the input per rank (both ranks: the input once); a reduce n into the root
    for name in ("reduce_scatter", "reduce"):
        assert direct[name] == pytest.approx(nbytes, rel=0.1), (name, direct[name])
        assert own[name] > 1.8 * nbytes, (name, own[name])  # what this module exists for


def rank_same_sums(seed: int):
    rank, d = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed + rank)
    full = torch.randn(6 * d, 5)
    tensor = torch.randn(4, 3, dtype=torch.bfloat16)
    expected = torch.empty(6, 5), tensor.clone()
    dist.reduce_scatter_tensor(expected[0], full)
    dist.reduce(expected[1], dst=1)
    got = torch.empty(6, 5), tensor.clone()
    from megatron.core.tensor_parallel import mappings
    bound = mappings.dist_reduce_scatter_func
    with direct_reductions(), counts.count_collectives() as records:
        assert mappings.dist_reduce_scatter_func.__wrapped__.__wrapped__ is bound  # megatron's bound name too
        group = dist.new_group(list(range(d)))
        with comm.InFlight() as inflight:  # asynchronous, as TSP's schedules use them
            works = [comm.reduce_scatter(got[0], full, group, inflight), comm.reduce(got[1], 1, group, inflight)]
            inflight.wait(works)
    assert mappings.dist_reduce_scatter_func is bound  # and put back
    primitives = {p for phases in records.values() for prims in phases.values() for p in prims}
    return [(e, g) for e, g in zip(expected, got)][: 2 if rank == 1 else 1], primitives


@pytest.mark.parametrize("world", [2, 3])
def test_direct_reductions_give_gloos_sums_and_are_counted_as_theirs(ranks, world):
    for pairs, primitives in ranks(world, rank_same_sums, 7):
        assert primitives == {"reduce_scatter", "reduce"}
        for expected, got in pairs:
            if world == 2:  # a + b, one rounding either way
                assert torch.equal(expected, got)
            else:
                torch.testing.assert_close(got, expected)
