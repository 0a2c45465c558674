"""The multi-rank harness itself: results per rank, tracebacks, and timeouts."""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from megatron_tsp.run.launch import PoolTimeout, RankError, WorkerPool


def _all_reduce_rank():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def _fail_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # rank 0 waits forever: the pool must not


def _kill_rank_1():
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def _hang_on_rank_1():
    if dist.get_rank() == 1:
        time.sleep(3600)
    return dist.get_rank()


def test_results_come_back_per_rank(ranks):
    assert ranks(4, _all_reduce_rank) == [(r, 6.0) for r in range(4)]


def test_failure_reports_the_rank_in_one_line_and_its_traceback():
    pool = WorkerPool(2, device_type="cpu")
    start = time.monotonic()
    with pytest.raises(RankError, match="(?s)rank 1.*boom on purpose") as failure:
        pool.run(_fail_on_rank_1, timeout_s=60)
    assert time.monotonic() - start < 30
    assert not pool.alive
    assert failure.value.summary == "rank 1: ValueError: boom on purpose"
    assert "Traceback" in failure.value.traceback


def test_a_killed_rank_names_its_signal():
    pool = WorkerPool(2, device_type="cpu")
    with pytest.raises(RankError) as failure:
        pool.run(_kill_rank_1, timeout_s=60)
    assert failure.value.summary == "rank 1 was killed by SIGKILL"


def test_hang_becomes_a_timeout():
    pool = WorkerPool(2, device_type="cpu")
    start = time.monotonic()
    with pytest.raises(PoolTimeout, match=r"rank\(s\) \[1\] of 2 did not finish within 3s"):
        pool.run(_hang_on_rank_1, timeout_s=3)
    assert time.monotonic() - start < 20
    assert not pool.alive
