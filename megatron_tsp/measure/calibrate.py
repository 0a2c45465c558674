"""A hardware profile of this CPU, measured on the ranks (``megatron-tsp calibrate``).

The performance model (:mod:`megatron_tsp.measure.perfmodel`) prices counted FLOPs and bytes
with a profile; for GPUs the profile's numbers are data-sheet values and assumptions, for this
machine they are measured, with every rank working at once and the thread count the
benchmark's ranks use:

* ``peak_tflops``: matmul FLOP/s per rank at the benchmark's GEMM shapes ([S, h] x [h, ffn/D],
  forward; the median over the sequence lengths), so ``matmul_efficiency`` is 1;
* ``attention_efficiency``: the attention op's FLOP/s (forward and backward of
  :func:`block_attention` with a rank's heads at S, FLOPs counted by torch's formulas, as the
  memory planner counts them) over ``peak_tflops``;
* ``hbm_gbs``: bytes read and written per second by an out-of-place elementwise product of
  two [S, ffn/D] activations (a fresh output each time, as in the step: on a CPU the
  allocator's page faults count, and small tensors stay in cache; the median over S). The
  memory-bound ops of the step are priced with it;
* per link rate (:class:`megatron_tsp.measure.link.Link`): the all-gather bytes each rank
  receives per second and the time per call, from two message sizes
  (``t = latency + bytes / bandwidth``), and the bandwidth each primitive the modes use
  achieves (``by_primitive_gbs``: gloo's reduce-scatter and reduce deliver about half their
  all-gather's): ``links`` in the profile, and the unthrottled one as its ``intra_node_gbs``.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Dict, List, Optional

from megatron_tsp.run import config as cfg

_SMALL = 1 << 16  # bytes received per rank per all-gather: latency
_LARGE_S = 0.5  # the large all-gather lasts about this long at the set rate: bandwidth
_MIN_LARGE = 8 << 20


def _timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats``, all ranks starting together."""
    import torch.distributed as dist

    fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _shapes(args, d: int):
    """(hidden, a rank's MLP width, query heads, K/V heads, head dim) of the kernels measured."""
    return (args.hidden_size, args.ffn_hidden_size * (2 if args.swiglu else 1) // d, args.num_attention_heads // d,
            args.num_query_groups // d, args.kv_channels)


def kernel_bytes(values: Dict, seq: int, d: int) -> int:
    """What :func:`rank_kernels` holds at once on one rank at ``seq`` (fp32): the GEMM's
    operands, q/k/v and their gradients with the output, and the elementwise pair."""
    h, ffn, heads, groups, dim = _shapes(cfg.resolve(dict(values)), d)
    return 4 * (seq * h + h * ffn + 3 * seq * (heads + 2 * groups) * dim + 2 * seq * ffn)


def check_memory(values: Dict, seqs: List[int], nproc: int) -> None:
    """One line, before any rank starts, where the longest ``--seq`` cannot fit this machine."""
    import psutil

    seq = max(seqs)
    need, free = nproc * kernel_bytes(values, seq, nproc), psutil.virtual_memory().available
    if need > free:
        raise cfg.ConfigError(f"--seq {seq}: {nproc} ranks need {need / 2**30:.1f} GiB for calibrate's kernels, "
                              f"this machine has {free / 2**30:.1f} GiB available; use shorter sequence lengths")


def rank_kernels(values: Dict, seqs: List[int], repeats: int = 5) -> Dict:
    """On every rank at once: matmul and attention FLOP/s and elementwise bandwidth at the
    config's shapes per S."""
    import torch
    import torch.distributed as dist
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_tsp.core.attention_kernels import resolve_backend
    from megatron_tsp.core.block_attention import block_attention

    args = cfg.resolve(dict(values))
    h, ffn, heads, groups, dim = _shapes(args, dist.get_world_size())
    backend = resolve_backend("auto", torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(dist.get_rank())

    def at(seq: int) -> Dict:
        a, w = torch.randn(seq, h, generator=g), torch.randn(h, ffn, generator=g)
        q = torch.randn(seq, 1, heads, dim, generator=g, requires_grad=True)
        k, v = (torch.randn(seq, 1, groups, dim, generator=g, requires_grad=True) for _ in range(2))

        def attention():
            block_attention(q, k, v, [0], dim ** -0.5, backend).sum().backward()

        with FlopCounterMode(display=False) as counter:
            attention()
        x, y = torch.randn(seq, ffn, generator=g), torch.randn(seq, ffn, generator=g)
        return {"matmul_flops": 2 * seq * h * ffn / _timed(lambda: a @ w, repeats),
                "attention_flops": counter.get_total_flops() / _timed(attention, repeats),
                "elementwise_gbs": 3 * x.numel() * 4 / _timed(lambda: x * y, repeats) / 1e9}

    return {seq: at(seq) for seq in seqs}


def rank_all_gather(nbytes: int, repeats: int) -> float:
    """Median seconds of an all-gather in which each rank receives ``nbytes``."""
    import torch
    import torch.distributed as dist

    d = dist.get_world_size()
    piece = torch.ones(max(1, nbytes // (4 * (d - 1))))
    gathered = torch.empty(piece.numel() * d)
    return _timed(lambda: dist.all_gather_into_tensor(gathered, piece), repeats)


def rank_primitives(nbytes: int, repeats: int) -> Dict[str, float]:
    """Seconds of one call of every primitive the modes use, sized so that a rank receives
    ``nbytes`` by the traffic rules the counts use (``core/comm.traffic``; broadcast and
    reduce: on average over the ranks, the root rotating as in the modes)."""
    import torch
    import torch.distributed as dist

    d, rank = dist.get_world_size(), dist.get_rank()
    n = max(1, nbytes // (4 * (d - 1)))  # elements of a shard
    shard, full = torch.ones(n), torch.ones(n * d)
    whole = torch.ones(n * d // 2)  # all-reduce: 2 (d-1)/d of it received
    one = torch.ones(nbytes * d // (4 * (d - 1)))  # broadcast, reduce: (d-1)/d of it received on average
    peer = torch.ones(nbytes // 4)

    def send_recv():  # a ring step: send to the next rank, receive from the previous one
        ops = [dist.P2POp(dist.isend, peer, (rank + 1) % d), dist.P2POp(dist.irecv, torch.empty_like(peer),
                                                                         (rank - 1) % d)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    calls = {"all_gather": lambda: dist.all_gather_into_tensor(full, shard),
             "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full),
             "all_reduce": lambda: dist.all_reduce(whole),
             "broadcast": lambda: [dist.broadcast(one, r) for r in range(d)],
             "reduce": lambda: [dist.reduce(one, r) for r in range(d)],
             "send_recv": send_recv}
    per_call = {"broadcast": d, "reduce": d}
    from megatron_tsp.measure.distributed import direct_reductions  # as the benchmark's modes run them

    with direct_reductions():
        return {name: _timed(fn, repeats) / per_call.get(name, 1) for name, fn in calls.items()}


def link_fit(runner, rate_mb_s: Optional[float], repeats: int = 3) -> Dict:
    """Bandwidth (GB/s received per rank) and latency (us per call) of all-gathers on the
    ranks at the link's current setting, and the bandwidth each primitive achieves
    (``by_primitive``: gloo's reduce-scatter, for one, moves more than it delivers)."""
    large = max(_MIN_LARGE, int((rate_mb_s or 1e9) * 1e6 * _LARGE_S)) if rate_mb_s else 64 << 20
    t_small = max(runner(rank_all_gather, _SMALL, repeats))
    t_large = max(runner(rank_all_gather, large, repeats))
    bandwidth = (large - _SMALL) / max(t_large - t_small, 1e-9)
    latency = max(t_small - _SMALL / bandwidth, 0.0)
    size = max(_MIN_LARGE // 4, large // 4)  # a quarter: still bandwidth-bound, 8 calls of each at every rate
    primitives = {name: max(times) for name, times in _by_name(runner(rank_primitives, size, 2)).items()}
    by_primitive = {name: size / max(t - latency, 1e-9) / 1e9 for name, t in primitives.items()}
    return {"rate_mb_s_per_rank": rate_mb_s, "gbs": bandwidth / 1e9, "latency_us": latency * 1e6,
            "by_primitive_gbs": by_primitive,
            "measured": {"bytes": [_SMALL, large], "seconds": [t_small, t_large], "primitive_bytes": size,
                         "primitive_s": primitives}}


def _by_name(per_rank: List[Dict[str, float]]) -> Dict[str, List[float]]:
    return {name: [r[name] for r in per_rank] for name in per_rank[0]}


def profile(values: Dict, seqs: List[int], runner, link, rates: List, hardware_dir: str) -> Dict:
    """The profile (the keys of :class:`perfmodel.Hardware` plus ``links`` and what was
    measured), measured through ``runner`` on ranks inside ``link`` (rates: MB/s per rank,
    ``"none"`` or a ``--like`` name, resolved with the measured matmul FLOP/s)."""
    from megatron_tsp.measure.link import like_rate

    kernels = runner(rank_kernels, values, seqs)
    per_seq = {seq: {key: statistics.median(r[seq][key] for r in kernels) for key in kernels[0][seq]}
               for seq in seqs}
    matmul = statistics.median(p["matmul_flops"] for p in per_seq.values())
    attention = statistics.median(p["attention_flops"] for p in per_seq.values())
    elementwise = statistics.median(p["elementwise_gbs"] for p in per_seq.values())
    links = {}
    for rate in rates:
        mb_s = None if rate == "none" else like_rate(rate, matmul, hardware_dir) if isinstance(rate, str) else rate
        link.set(mb_s)
        links[label(rate, mb_s)] = dict(link_fit(runner, mb_s), like=rate if isinstance(rate, str) else None)
    if link.rate is not None:
        link.set(None)
    free = links.get("none") or link_fit(runner, None)
    try:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        memory_gib = 1.0
    return {"name": f"cpu-{platform.node() or 'host'}", "gpus_per_node": link.nproc,
            "memory_gib": round(memory_gib, 1), "peak_tflops": matmul / 1e12, "matmul_efficiency": 1.0,
            "attention_efficiency": attention / matmul, "hbm_gbs": elementwise,
            "intra_node_gbs": free["gbs"], "inter_node_gbs": free["gbs"],
            "intra_node_latency_us": free["latency_us"], "inter_node_latency_us": free["latency_us"],
            "links": links, "measured": {"topology": link.describe()["topology"],
                                         "kernels_by_seq": {str(s): p for s, p in per_seq.items()}}}


def label(rate, mb_s: Optional[float]) -> str:
    """A link's name in profiles and results: the ``--link`` item (``none``, ``h100-nvlink``, ``10``)."""
    return rate if isinstance(rate, str) else f"{mb_s:g}"
