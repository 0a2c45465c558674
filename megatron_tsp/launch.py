"""Run a function on N gloo ranks on this machine, with a deadline.

Used by the tests (one long-lived pool per world size, so worker start-up and imports are
paid once) and by ``megatron-tsp train --nproc N`` on a machine without torchrun. A rank
that raises, dies or runs past its deadline takes the whole pool down and the caller gets
the first failing rank's traceback: a hang becomes an error message, never a stuck job.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, List, Optional

DEFAULT_TIMEOUT_S = 300.0


class RankError(RuntimeError):
    """A rank raised; the message carries its traceback."""


class PoolTimeout(TimeoutError):
    """Some rank did not answer before the deadline; the pool was killed."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(rank: int, world_size: int, port: int) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when the process that started it dies (even by SIGKILL),
    so that a killed job leaves no rank running on."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _reset() -> None:
    """Forget megatron's and TSP's groups, then destroy every process group of the task.

    megatron-core never destroys the groups it creates; a long-lived worker that did not
    would accumulate hundreds of gloo groups (each with its threads and sockets).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from megatron_tsp import parallel_state as tsp_state

    if tsp_state.is_initialized():
        tsp_state.destroy_model_parallel()
    elif mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _worker(rank: int, world_size: int, port: int, conn: Connection, path: List[str],
            collective_timeout_s: float) -> None:
    sys.path[:] = path
    _die_with_parent()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from megatron_tsp.compat import enable_cpu_support

    enable_cpu_support()
    _env(rank, world_size, port)
    timeout = datetime.timedelta(seconds=collective_timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, timeout=timeout)
    conn.send(("ready", None))
    task_id = 0
    while True:
        try:
            task = conn.recv()
        except EOFError:  # the parent is gone: do not linger
            break
        if task is None:
            break
        fn, args, kwargs = task
        task_id += 1
        try:
            # A fresh world group per task, rendezvous keys scoped to the task.
            dist.init_process_group("gloo", store=dist.PrefixStore(f"task{task_id}", store),
                                    rank=rank, world_size=world_size, timeout=timeout)
            result = fn(*args, **kwargs)
            conn.send(("ok", result))
        except BaseException:  # noqa: BLE001 - the parent decides what to do with it
            conn.send(("err", traceback.format_exc()))
        finally:
            _reset()


class WorkerPool:
    """``world_size`` processes, reused across calls; each call runs in a fresh gloo group."""

    def __init__(self, world_size: int, collective_timeout_s: float = 120.0,
                 start_timeout_s: float = 180.0):
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        port = free_port()
        self._conns: List[Connection] = []
        self._procs = []
        # megatron-core warns about missing CUDA extensions on every import, before the
        # worker function runs; keep the parent's output readable.
        saved_warnings = os.environ.get("PYTHONWARNINGS")
        os.environ["PYTHONWARNINGS"] = "ignore"
        try:
            for rank in range(world_size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=_worker,
                    args=(rank, world_size, port, child, list(sys.path), collective_timeout_s),
                    # not daemonic: megatron's checkpoint writer starts processes of its own.
                    # A worker exits when its pipe to the parent closes.
                    daemon=False,
                )
                proc.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(proc)
        finally:
            if saved_warnings is None:
                del os.environ["PYTHONWARNINGS"]
            else:
                os.environ["PYTHONWARNINGS"] = saved_warnings
        self._collect("start-up", start_timeout_s)

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable, *args, timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs) -> List[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results."""
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        return self._collect(getattr(fn, "__name__", repr(fn)), timeout_s)

    def _collect(self, what: str, timeout_s: float) -> List[Any]:
        deadline = time.monotonic() + timeout_s
        results: List[Optional[tuple]] = [None] * self.world_size
        pending = {conn: rank for rank, conn in enumerate(self._conns)}
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._procs)}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                ranks = sorted(pending.values())
                self.close(kill=True)
                raise PoolTimeout(
                    f"{what}: rank(s) {ranks} of {self.world_size} did not finish within "
                    f"{timeout_s:.0f}s; the worker pool was killed"
                )
            ready = wait(list(pending) + list(sentinels), timeout=left)
            for obj in ready:
                if obj in pending:
                    rank = pending.pop(obj)
                    try:
                        results[rank] = obj.recv()
                    except EOFError:
                        results[rank] = ("err", f"rank {rank} exited without a result")
                    if results[rank][0] == "err":
                        self.close(kill=True)
                        raise RankError(f"{what} failed on rank {rank}:\n{results[rank][1]}")
                elif obj in sentinels and sentinels[obj] in pending.values():
                    rank = sentinels[obj]
                    code = self._procs[rank].exitcode
                    self.close(kill=True)
                    raise RankError(f"{what}: rank {rank} died (exit code {code})")
        return [r[1] for r in results]

    def close(self, kill: bool = False) -> None:
        for conn, proc in zip(self._conns, self._procs):
            if not kill and proc.is_alive():
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        for proc in self._procs:
            if not kill:
                proc.join(timeout=5)
            _kill_tree(proc.pid)
            proc.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []


def _kill_tree(pid: int) -> None:
    """Kill a worker and whatever it started (megatron's checkpoint writers)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
