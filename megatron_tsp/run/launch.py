"""Where a job's ranks run: in place under torchrun, or N local workers with a deadline.

:func:`job` decides: under torchrun this process is one rank of the job torchrun started
(it joins it on its device); otherwise a :class:`WorkerPool` of N processes on this machine
runs the ranks, started at the job's first task, so that the caller's checks come first.
Either way a task runs on every rank and the rank's device (:func:`rank_device`) was chosen
once, when the rank joined (:meth:`Device.from_launch`).

The pool is also the tests' (one long-lived pool per world size, so worker start-up and
imports are paid once). A rank that raises, dies or runs past its deadline takes the whole
pool down and the caller gets the first failing rank's error: a hang becomes an error
message, never a stuck job.

A rank that stops answering (stopped, deadlocked) makes the others fail in their next
collective after the collective timeout; the error then names the ranks that did not report
(the culprit), and a rank the operating system has stopped is named as the stopped one.
Workers ignore Ctrl-C: the parent gets it and kills them.

No process outlives a pool. Its workers and everything they start (megatron-core's checkpoint
writers and their result-queue manager) live in one process group led by a small reaper
process, which kills the group when the launcher dies, even by SIGKILL; closing the pool kills
the group too. A rank's death is noticed from its exit status, which the fork server reports,
also when a child it forked still holds its pipes.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Dict, Iterator, List, Optional

from megatron_tsp.errors import UserError

DEFAULT_TIMEOUT_S = 300.0
# After a rank's collective timed out, how long to wait for the other ranks' reports: the
# ones that stay silent are the ones that stopped answering.
_STRAGGLER_GRACE_S = 5.0


class RankError(RuntimeError):
    """A rank failed. ``str()`` carries its traceback; ``summary`` is the one line for a user
    (rank, error, and which ranks stopped answering), ``traceback`` the full text."""

    def __init__(self, message: str, rank: int, summary: str, traceback_text: str = "",
                 user_error: bool = False):
        super().__init__(message)
        self.rank = rank
        self.summary = summary
        self.traceback = traceback_text
        self.user_error = user_error  # the rank raised a UserError: its line says it all


class PoolTimeout(TimeoutError):
    """Some rank did not answer before the deadline; the pool was killed."""


class Terminated(BaseException):
    """This process received SIGTERM (preemption, ``scancel``, a time limit) and nothing in
    the job handles it: every rank is killed. A BaseException, like KeyboardInterrupt, so that
    no ``except Exception`` on the way swallows it."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_STOPS = (signal.SIGINT, signal.SIGTERM)


def ignore_stops() -> None:
    """The first stop wins: a SIGTERM after Ctrl-C (or a second one) does not interrupt the
    cleanup, nor change the exit code and line of the first. SIG_IGN, not a handler that does
    nothing: Python puts SIG_DFL back for its own handlers as it shuts down. A stop whose C
    handler ran just before (its Python one had not yet) is then reported by Python as
    "OSError: Signal 15 ignored due to race condition", with a traceback: it is the later
    stop being ignored, as meant, and the unraisable hook drops that report."""
    if not getattr(sys.unraisablehook, "drops_ignored_stops", False):
        sys.unraisablehook = _dropping_ignored_stops(sys.unraisablehook)
    for signum in _STOPS:
        signal.signal(signum, signal.SIG_IGN)


def _dropping_ignored_stops(hook: Callable) -> Callable:
    ignored = {f"Signal {int(s)} ignored due to race condition" for s in _STOPS}

    def drop(unraisable) -> None:
        if not (isinstance(unraisable.exc_value, OSError) and str(unraisable.exc_value) in ignored):
            hook(unraisable)

    drop.drops_ignored_stops = True
    return drop


def raise_terminated(signum: int, frame: Any) -> None:
    """A signal handler: SIGTERM ends this process as Ctrl-C would (cleanup, one line)."""
    ignore_stops()
    raise Terminated(signum)


def raise_interrupted(signum: int, frame: Any) -> None:
    """Python's Ctrl-C, after which further signals are ignored (:func:`ignore_stops`)."""
    ignore_stops()
    raise KeyboardInterrupt


def redeliver_dropped_stops(unraisable) -> None:
    """A ``sys.unraisablehook``: a stop raised while Python ran a finalizer (a ``__del__``, a
    weakref callback: torch runs many) is dropped there, and the work went on to exit 0. It is
    raised again 10 ms later from a timer's signal, once the finalizer is done (or dropped and
    raised again, until it is not inside one); anything else goes to Python's hook."""
    global _DROPPED
    error = unraisable.exc_value
    if isinstance(error, (Terminated, KeyboardInterrupt)):
        def again(signum, frame):
            global _DROPPED
            _DROPPED = None
            raise error

        _DROPPED = error
        signal.signal(signal.SIGALRM, again)
        signal.setitimer(signal.ITIMER_REAL, 0.01)
        return
    sys.__unraisablehook__(unraisable)


_DROPPED: Optional[BaseException] = None  # a stop redeliver_dropped_stops will raise again


def take_dropped_stop() -> Optional[BaseException]:
    """The stop :func:`redeliver_dropped_stops` has not raised yet (its timer cancelled), or None:
    for a caller that ends before the timer fires."""
    global _DROPPED
    signal.setitimer(signal.ITIMER_REAL, 0)
    dropped, _DROPPED = _DROPPED, None
    return dropped


_SIGTERM_RECEIVED: Optional[str] = None


def forget_sigterm() -> None:
    """A new command of this process starts with no SIGTERM noted (main runs inside other
    programs: the tests)."""
    global _SIGTERM_RECEIVED
    _SIGTERM_RECEIVED = None


def remember_sigterm(signum: int, frame: Any) -> None:
    """A signal handler for ``--exit-signal-handler``: note the signal; the training loop reads
    it after each step (:func:`sigterm_received`). Installed for the whole life of a rank and
    of a ``train`` launcher, so that a signal that arrives while they start is not lost."""
    global _SIGTERM_RECEIVED
    _SIGTERM_RECEIVED = signal.Signals(signum).name


def sigterm_received() -> Optional[str]:
    """The name of the signal :func:`remember_sigterm` noted in this process, or None."""
    return _SIGTERM_RECEIVED


def terminate_on_sigterm() -> None:
    """From now on SIGTERM ends this process (:func:`raise_terminated`); one noted before
    (:func:`remember_sigterm`) does so at once."""
    signal.signal(signal.SIGTERM, raise_terminated)
    if _SIGTERM_RECEIVED is not None:
        raise_terminated(signal.Signals[_SIGTERM_RECEIVED], None)


def _report(exc: BaseException) -> tuple:
    """(one line for a user, the traceback, whether it is a UserError) of a rank's exception:
    a UserError's own message, else the exception's type and the last line of its message."""
    text = str(exc).strip().splitlines()
    if isinstance(exc, UserError):
        return text[0] if text else type(exc).__name__, traceback.format_exc(), True
    return f"{type(exc).__name__}: {text[-1] if text else ''}".rstrip(": "), traceback.format_exc(), False


def _exit_reason(code: Optional[int]) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


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
    from megatron.core.models.common.embeddings import rotary_pos_embedding

    from megatron_tsp.core import parallel_state as tsp_state

    if tsp_state.is_initialized():
        tsp_state.destroy_model_parallel()
    elif mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    # megatron-core's destroy_model_parallel forgets some groups it made (0.16 and 0.19:
    # _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP and its gloo twin): forget every one left
    for name, value in list(vars(mpu).items()):
        if isinstance(value, dist.ProcessGroup):
            setattr(mpu, name, None)
    # RotaryEmbedding.forward is an lru_cache on the class: it keeps every rotary embedding
    # built (and its cp_group) alive past its model
    cached = getattr(rotary_pos_embedding.RotaryEmbedding.forward, "cache_clear", None)
    if cached is not None:
        cached()
    if dist.is_initialized():
        dist.destroy_process_group()
    # A group lives while anything refers to it, and the task's models, optimizers and
    # megatron's process-group collections refer to them in cycles: collect those now, or
    # the gloo groups (three threads each, one waking every 10 ms) pile up task after task:
    # in a full test run 480 groups a worker took half of two cores (tests/test_launch.py).
    gc.collect()


_DEVICE = None  # this rank's megatron_tsp.device.Device, once it joined a job


def rank_device():
    """The device of this rank (its GPU, or the CPU), chosen when it joined its job."""
    if _DEVICE is None:
        raise RuntimeError("rank_device() is for functions that run on the ranks of a job (launch.job)")
    return _DEVICE


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


class Job:
    """The ranks of one job, seen from where the caller runs. ``rank``: this process's rank (the
    launcher counts as rank 0 of a local job); ``world_size``; ``run(fn, *args)`` runs
    ``fn(*args)`` on every rank and returns what this process sees of the results (every
    rank's for a local job, its own under torchrun)."""

    def __init__(self, world_size: int, rank: int, run: Callable, torchrun: bool = False):
        self.world_size, self.rank, self.run, self._torchrun = world_size, rank, run, torchrun

    def on_rank0(self, fn: Callable, *args) -> None:
        """``fn(*args)`` once, on rank 0 (the launcher of a local job), before the others go on.
        Under torchrun a UserError there is raised on every rank with the same line, instead
        of leaving the others waiting for rank 0 until the collective timeout."""
        if not self._torchrun:
            fn(*args)
            return
        import torch.distributed as dist

        outcome: List[Any] = [None]
        if self.rank == 0:
            try:
                fn(*args)
            except UserError as exc:
                outcome[0] = exc
        dist.broadcast_object_list(outcome, src=0)
        if outcome[0] is not None:
            raise outcome[0]


@contextlib.contextmanager
def job(nproc: int, collective_timeout_min: float = 10.0, timeout_s: float = DEFAULT_TIMEOUT_S,
        forward_sigterm: bool = False, environ: Optional[Dict[str, str]] = None) -> Iterator[Job]:
    """Under torchrun: join its job on this rank's device (NCCL/RCCL on GPUs, gloo on the
    CPU). Otherwise: ``nproc`` local ranks, one per GPU where there are GPUs (more ranks than
    GPUs: one line) and gloo on the CPU where there are none, the pool started at the first
    ``run``.

    ``forward_sigterm``: the ranks handle SIGTERM themselves (``--exit-signal-handler``), so a
    local launcher that receives it passes it on to them and waits for them to finish (one
    that arrives before they have started, or was noted by :func:`remember_sigterm` before
    this job, reaches them once they have); otherwise SIGTERM kills the ranks
    (:class:`Terminated`). ``environ``: variables the ranks get where the user set none,
    before they touch a device (``CUDA_DEVICE_MAX_CONNECTIONS`` is read when CUDA starts)."""
    global _DEVICE
    environ = {key: os.environ.get(key, value) for key, value in (environ or {}).items()}  # the user's first
    if under_torchrun():
        import torch.distributed as dist

        missing = [key for key in ("MASTER_ADDR", "MASTER_PORT") if key not in os.environ]
        if missing:
            raise UserError(f"RANK and WORLD_SIZE are set but {' and '.join(missing)} not, as torchrun would: a "
                            "leftover environment? Unset RANK and WORLD_SIZE for a local run, or launch with torchrun")

        from megatron_tsp.device import Device

        os.environ.update(environ)
        _DEVICE = Device.from_launch()
        _DEVICE.activate()
        dist.init_process_group(_DEVICE.backend, timeout=datetime.timedelta(minutes=collective_timeout_min),
                                device_id=_DEVICE.process_group_device)
        try:
            yield Job(dist.get_world_size(), dist.get_rank(), lambda fn, *args, **kw: [fn(*args, **kw)], torchrun=True)
        finally:
            dist.destroy_process_group()
        return
    from megatron_tsp.device import Device

    gpus = Device.gpus_here()
    if 0 < gpus < nproc:
        raise UserError(f"--nproc {nproc}: this machine has {gpus} GPU(s), and NCCL/RCCL cannot put two ranks on one; "
                        f"use --nproc {gpus} or fewer, or hide the GPUs (CUDA_VISIBLE_DEVICES=) for {nproc} gloo "
                        "ranks on the CPU")
    pools: List[WorkerPool] = []

    def run(fn, *args, **kwargs):
        if not pools:
            pools.append(WorkerPool(nproc, collective_timeout_s=60 * collective_timeout_min, environ=environ))
            if forward_sigterm and _SIGTERM_RECEIVED is not None:  # came while they started
                pools[0].signal(signal.Signals[_SIGTERM_RECEIVED])
        return pools[0].run(fn, *args, timeout_s=timeout_s, **kwargs)

    def forward(signum, frame):
        remember_sigterm(signum, frame)
        for pool in pools:
            pool.signal(signum)

    previous = signal.signal(signal.SIGTERM, forward) if forward_sigterm else None
    try:
        yield Job(nproc, 0, run)
    except BaseException:
        for pool in pools:
            pool.close(kill=True)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    for pool in pools:
        pool.close()


def _worker(rank: int, world_size: int, port: int, conn: Connection, path: List[str],
            collective_timeout_s: float, device_type: Optional[str], group: int,
            environ: Optional[Dict[str, str]]) -> None:
    global _DEVICE
    sys.path[:] = path
    os.environ.update(environ or {})  # the launcher's, not the fork server's (started before it knew)
    try:
        os.setpgid(0, group)  # the pool's process group: whatever this rank starts is in it too
    except PermissionError:  # the group is gone: the launcher closed the pool while this rank was born
        os._exit(1)
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    # SIGTERM too, unless the run handles it (--exit-signal-handler reads what this notes);
    # noted from the start, because the launcher passes one on as soon as the pool is up
    signal.signal(signal.SIGTERM, remember_sigterm)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from megatron_tsp.device import Device

    _DEVICE = Device("cpu") if device_type == "cpu" else Device.from_launch(local_rank=rank)
    _DEVICE.activate()
    if not _DEVICE.is_gpu:
        from megatron_tsp.run.compat import enable_cpu_support

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
            dist.init_process_group(_DEVICE.backend, store=dist.PrefixStore(f"task{task_id}", store),
                                    rank=rank, world_size=world_size, timeout=timeout,
                                    device_id=_DEVICE.process_group_device)
            result = fn(*args, **kwargs)
            conn.send(("ok", result))
        except BaseException as exc:  # noqa: BLE001 - the parent decides what to do with it
            conn.send(("err", _report(exc)))
        finally:
            _reset()


# What every rank imports: loaded once by the fork server, so that a worker starts as a fork
# of it in a fraction of a second instead of importing torch and megatron-core on its own;
# fork_server first, which takes the server out of the terminal's reach. Where there are
# NVIDIA GPUs the server loads torch only: megatron-core's imports ask torch whether CUDA is
# available, and torch's answer (cudaGetDeviceCount) marks every later fork as unable to use
# CUDA. Where there are AMD GPUs it loads no torch: a ROCm build of torch loads the HIP
# runtime with it, whose state made at load does not survive a fork, so each rank imports
# torch itself after the fork (seconds more at start, side by side).
_PRELOAD = ["megatron_tsp.run.fork_server", "torch", "torch.distributed", "megatron.core.parallel_state",
            "megatron.core.models.gpt"]
# Device nodes of NVIDIA's, AMD's (ROCm) and WSL's GPU drivers: looked at instead of asking torch,
# which the launcher has not imported when it starts the server.
_PRELOAD_WHERE = (("/dev/kfd", _PRELOAD[:1]), ("/dev/nvidiactl", _PRELOAD[:2]), ("/dev/dxg", _PRELOAD[:2]))


def preloaded() -> List[str]:
    """What the ranks' fork server imports before it forks them, on this machine."""
    return next((modules for node, modules in _PRELOAD_WHERE if os.path.exists(node)), _PRELOAD)


def _context():
    """A fork server with what every rank imports preloaded (:func:`preloaded`). Forking the
    caller instead would copy whatever threads and state it has (pytest's, a CLI's); the fork
    server is a clean process, started once per launcher."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(preloaded())
    return ctx


def start_importing() -> None:
    """Start the ranks' fork server now, before the launcher imports megatron-core to read its
    configuration: both imports then run at once (seconds saved on every local launch). No
    rank starts here; the server ends with the launcher, a failed configuration check included."""
    if under_torchrun():
        return
    from multiprocessing import forkserver

    _context()
    forkserver.ensure_running()


# The reaper: the leader of a pool's process group. It ignores the signals a terminal or a
# scheduler sends to everybody, and kills its group (itself included) once the launcher that
# started it is gone.
_REAPER = """
import os, signal, sys, time
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
while os.getppid() == int(sys.argv[1]):
    time.sleep(0.5)
os.killpg(0, signal.SIGKILL)
"""


def _start_reaper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-S", "-c", _REAPER, str(os.getpid())], process_group=0,
                            stdin=subprocess.DEVNULL, close_fds=True)


class WorkerPool:
    """``world_size`` processes, reused across calls; each call runs in a fresh process group.
    Rank r runs on GPU r (modulo the GPUs there are; NCCL/RCCL) where torch sees GPUs, else
    on the CPU (gloo); ``device_type="cpu"`` keeps it on the CPU (the tests)."""

    def __init__(self, world_size: int, collective_timeout_s: float = 120.0,
                 start_timeout_s: float = 180.0, device_type: Optional[str] = None,
                 environ: Optional[Dict[str, str]] = None):
        self.world_size = world_size
        ctx = _context()
        port = free_port()
        self._reaper = _start_reaper()
        self._conns: List[Connection] = []
        self._procs = []
        try:  # a failure or Ctrl-C while the ranks start leaves none of them behind
            for rank in range(world_size):  # the first start also starts the fork server
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=_worker,
                    args=(rank, world_size, port, child, list(sys.path), collective_timeout_s, device_type,
                          self._reaper.pid, environ),
                    # not daemonic: megatron's checkpoint writer starts processes of its own.
                    # A worker exits when its pipe to the parent closes.
                    daemon=False,
                )
                proc.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(proc)
            self._collect("start-up", start_timeout_s)
        except BaseException:
            self.close(kill=True)
            raise

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(kill=exc_type is not None)  # a failure or Ctrl-C: no waiting for busy ranks

    @property
    def pids(self) -> List[int]:
        """The workers' process ids, by rank."""
        return [p.pid for p in self._procs]

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
        failed: Optional[int] = None
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                if failed is not None:
                    break
                ranks = sorted(pending.values())
                stopped = self._stopped(ranks)
                self.close(kill=True)
                why = f" (rank(s) {stopped} stopped by the operating system: SIGSTOP, a debugger?)" if stopped else ""
                raise PoolTimeout(
                    f"{what}: rank(s) {ranks} of {self.world_size} did not finish within "
                    f"{timeout_s:.0f}s{why}; the worker pool was killed"
                )
            ready = wait(list(pending) + list(sentinels), timeout=left)
            for obj in ready:
                if obj in pending:
                    rank = pending.pop(obj)
                    try:
                        results[rank] = obj.recv()
                    except EOFError:
                        self._died(what, rank)
                    if results[rank][0] == "err" and failed is None:
                        failed = rank
                        if not _is_timeout(results[rank][1][0]):
                            pending.clear()
                            break
                        # a collective timed out: give the others a moment to report theirs,
                        # unless the operating system has stopped every one of them
                        quiet = sorted(pending.values())
                        grace = 0.0 if self._stopped(quiet) == quiet else _STRAGGLER_GRACE_S
                        deadline = min(deadline, time.monotonic() + grace)
                elif obj in sentinels and sentinels[obj] in pending.values():
                    self._died(what, sentinels.pop(obj))
        if failed is not None:
            summary, text, user_error = results[failed][1]
            quiet = sorted(pending.values())
            stopped = self._stopped(quiet)
            self.close(kill=True)
            if stopped:  # the cause, and the failed rank only its victim
                culprit = stopped[0]
                line = (f"rank(s) {stopped} stopped by the operating system (SIGSTOP, a debugger?); "
                        f"rank {failed} gave up waiting: {summary}")
                raise RankError(f"{what}: {line}:\n{text}", culprit, line, text)
            silent = f"; rank(s) {quiet} stopped answering" if quiet else ""
            raise RankError(f"{what} failed on rank {failed}{silent}:\n{text}", failed,
                            f"rank {failed}: {summary}{silent}", text, user_error and not silent)
        return [r[1] for r in results]

    def _died(self, what: str, rank: int) -> None:
        self._procs[rank].join(timeout=5)
        reason = f"rank {rank} {_exit_reason(self._procs[rank].exitcode)}"
        self.close(kill=True)
        raise RankError(f"{what}: {reason}", rank, reason)

    def _stopped(self, ranks: List[int]) -> List[int]:
        """Those of ``ranks`` the operating system has stopped (SIGSTOP, a debugger)."""
        import psutil

        stopped = []
        for rank in ranks:
            try:
                if psutil.Process(self._procs[rank].pid).status() == psutil.STATUS_STOPPED:
                    stopped.append(rank)
            except psutil.NoSuchProcess:
                pass
        return stopped

    def signal(self, signum: int) -> None:
        """Send ``signum`` to every rank (not to what they started)."""
        for proc in self._procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signum)

    def close(self, kill: bool = False) -> None:
        """Stop the workers (asked to exit, or killed), then kill whatever is left of the
        process group: checkpoint writers and managers the ranks started."""
        for conn, proc in zip(self._conns, self._procs):
            if not kill and proc.is_alive():
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        for proc in self._procs:
            if not kill:
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
        if self._reaper is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._reaper.pid, signal.SIGKILL)
            self._reaper.wait()
            self._reaper = None
        for proc in self._procs:
            proc.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []


def _is_timeout(line: str) -> bool:
    """Whether a rank's error says a collective waited too long (gloo: "timed out", "Application
    timeout caused pair closure"; NCCL: "Watchdog caught collective operation timeout")."""
    line = line.lower()
    return "timed out" in line or "timeout" in line
