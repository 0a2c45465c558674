"""Multi-rank test harness: run a function on N gloo ranks, reusing worker processes.

``ranks(world_size, fn, *args)`` runs ``fn`` on every rank of a long-lived pool of that
size and returns the per-rank results, or raises with the first failing rank's traceback.
A rank that hangs past ``timeout_s`` kills the pool (a later call starts a fresh one), so a
deadlock is a test failure with a message, never a stuck CI job. ``fn`` must be a
module-level function of an importable module (workers unpickle it by name).
"""

import os

import pytest

from megatron_tsp.run.launch import WorkerPool

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository

_POOLS = {}


def run_on_pool(world_size, fn, *args, timeout_s=300.0, **kwargs):
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive:
        pool = _POOLS[world_size] = WorkerPool(world_size, device_type="cpu")
    return pool.run(fn, *args, timeout_s=timeout_s, **kwargs)


@pytest.fixture(scope="session")
def ranks():
    yield run_on_pool
    for pool in _POOLS.values():
        pool.close(kill=True)  # nothing to finish: no graceful shutdown to wait for
    _POOLS.clear()
