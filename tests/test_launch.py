"""The multi-rank harness itself: results per rank, tracebacks, and timeouts."""

import multiprocessing
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
import torch.distributed as dist
from conftest import ROOT, left_behind

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


def _kill_rank_1_with_a_child(folder):
    """As in a checkpoint save: the rank has forked a writer (which inherits its pipes and
    sockets) when it is killed."""
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(300,))
    child.start()
    with open(os.path.join(folder, f"child-{dist.get_rank()}"), "w") as f:
        f.write(str(child.pid))
    dist.barrier()
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(300)


def _hang_on_rank_1():
    if dist.get_rank() == 1:
        time.sleep(3600)
    return dist.get_rank()


def test_results_come_back_per_rank(ranks):
    assert ranks(4, _all_reduce_rank) == [(r, 6.0) for r in range(4)]


def _gloo_threads():
    return sum(open(f"/proc/self/task/{t}/comm").read().startswith("gloo_tcp")  # one a group, from its start
               for t in os.listdir("/proc/self/task"))


def _tsp_groups_and_a_rotary_table():
    """What test_attention's tasks do: TSP's groups (and megatron's, some of which its
    destroy_model_parallel forgets) and a rotary table on a group of its own (megatron's
    RotaryEmbedding caches itself, and so its cp_group, on its class)."""
    from reference import configs, init_tsp, rotary_table, solo_pg_collection

    init_tsp(2)
    rotary_table(configs(2)[0], 16, solo_pg_collection().cp)


def _build_a_tsp_model():
    from megatron_tsp.device import CPU
    from megatron_tsp.run import config
    from megatron_tsp.run.build import build, initialize

    args = config.resolve(dict(mock_data=True, vocab_size=64, num_layers=1, hidden_size=16, num_attention_heads=2,
                               seq_length=8, attention_dropout=0.0, tsp_size=2, micro_batch_size=1))
    initialize(args, CPU)
    build(args, CPU)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_task_leaves_no_process_groups_behind(ranks):
    """Each task's groups go with it: a gloo group keeps threads that wake every 10 ms, and the
    tasks of a long-lived worker would pile them up (megatron builds dozens per job; a full
    test run left 480 a worker, half of two cores, before megatron's forgotten groups and
    the rotary cache were cleared)."""
    ranks(2, _build_a_tsp_model)
    before = ranks(2, _gloo_threads)
    for _ in range(2):
        ranks(2, _build_a_tsp_model)
        ranks(2, _tsp_groups_and_a_rotary_table)
    assert ranks(2, _gloo_threads) == before


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


def test_a_rank_killed_beside_its_child_is_named_within_seconds_and_nothing_is_left(tmp_path):
    pool = WorkerPool(2, device_type="cpu")
    workers = [psutil.Process(pid) for pid in pool.pids]
    start = time.monotonic()
    with pytest.raises(RankError) as failure:
        pool.run(_kill_rank_1_with_a_child, str(tmp_path), timeout_s=120)
    assert failure.value.summary == "rank 1 was killed by SIGKILL"
    assert time.monotonic() - start < 20
    children = [psutil.Process(int((tmp_path / f"child-{r}").read_text())) for r in range(2)]
    _, alive = psutil.wait_procs(workers + children, timeout=10)
    assert alive == []


def _hang_with_a_child():
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(300,))
    child.start()
    time.sleep(300)


_LAUNCHER = f"""
import sys
sys.path[:0] = [{ROOT!r}, {os.path.join(ROOT, "tests")!r}]
from megatron_tsp.run.launch import WorkerPool
from test_launch import _hang_with_a_child
if __name__ == "__main__":
    pool = WorkerPool(2, device_type="cpu")
    print("started", flush=True)
    pool.run(_hang_with_a_child, timeout_s=600)
"""


def test_a_launcher_killed_with_sigkill_leaves_no_process():
    proc = subprocess.Popen([sys.executable, "-c", _LAUNCHER], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "started"
        time.sleep(2)  # the ranks have forked their children
        proc.kill()
        proc.wait()
        assert left_behind(session=proc.pid) == []
    finally:
        subprocess.run(["pkill", "-KILL", "-s", str(proc.pid)], check=False)


@pytest.mark.parametrize("node,preloaded", [("/dev/nvidiactl", ["megatron_tsp.run.fork_server", "torch"]),
                                             ("/dev/kfd", ["megatron_tsp.run.fork_server"])], ids=["nvidia", "amd"])
def test_where_there_are_gpus_the_fork_server_preloads_no_megatron(monkeypatch, node, preloaded):
    """megatron-core's imports ask torch whether CUDA is available, which poisons every later
    fork for CUDA: on a GPU machine the ranks' fork server must not import it (found on an H200:
    'Cannot re-initialize CUDA in forked subprocess' at every rank's set_device). On ROCm it
    imports no torch either: a ROCm torch loads the HIP runtime, whose state does not survive
    a fork."""
    from multiprocessing import forkserver

    from megatron_tsp.run import launch

    saved = list(forkserver._forkserver._preload_modules)
    exists = os.path.exists
    try:
        monkeypatch.setattr(launch.os.path, "exists", lambda path: path == node or exists(path))
        launch._context()
        assert forkserver._forkserver._preload_modules == preloaded
        monkeypatch.setattr(launch.os.path, "exists", lambda path: path not in ("/dev/kfd", "/dev/nvidiactl",
                                                                                  "/dev/dxg") and exists(path))
        launch._context()
        assert "megatron.core.models.gpt" in forkserver._forkserver._preload_modules
    finally:
        forkserver.set_forkserver_preload(saved)


def test_more_local_ranks_than_gpus_is_one_line(monkeypatch):
    """bench's default --nproc 2 on a one-GPU machine put both ranks on cuda:0 with NCCL."""
    from megatron_tsp.errors import UserError
    from megatron_tsp.run import launch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UserError, match=r"--nproc 2: this machine has 1 GPU\(s\).*CUDA_VISIBLE_DEVICES="):
        with launch.job(2):
            pass


class _SignalledWhileCollected:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs here, inside the finalizer, which drops its exception
            pass


def _collect_then_work(args):
    _SignalledWhileCollected()
    for _ in range(10**7):
        pass
    return 0


def _collect_then_return(args):
    _SignalledWhileCollected()
    return 0


@pytest.mark.parametrize("work", [_collect_then_work, _collect_then_return], ids=["then-works", "then-returns"])
def test_a_sigterm_raised_inside_a_finalizer_still_stops_the_command(work):
    """gpu-check ignored SIGTERM (and exited 0 seconds later) when it came while torch ran a
    weakref callback, where Python drops what a signal handler raises."""
    import argparse

    from megatron_tsp import cli
    from megatron_tsp.run.launch import Terminated

    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(Terminated):
            cli._with_signals(argparse.Namespace(command="gpu-check", func=work))
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _environ(key):
    return os.environ.get(key)


@pytest.mark.parametrize("user", [None, "8"], ids=["unset", "set-by-the-user"])
def test_a_jobs_ranks_get_its_environment_unless_the_user_set_it(monkeypatch, user):
    """CUDA_DEVICE_MAX_CONNECTIONS per mode: the fork server started before the launcher knew
    the mode, so the ranks set it themselves, before they touch a device."""
    from megatron_tsp.run import launch

    if user is None:
        monkeypatch.delenv("MEGATRON_TSP_TEST_VAR", raising=False)
    else:
        monkeypatch.setenv("MEGATRON_TSP_TEST_VAR", user)
    with launch.job(2, environ={"MEGATRON_TSP_TEST_VAR": "1"}) as job:
        assert job.run(_environ, "MEGATRON_TSP_TEST_VAR") == [user or "1"] * 2


def _warnings_shown():
    import warnings

    with warnings.catch_warnings(record=True) as shown:  # the filters the rank has, as they are
        warnings.warn("attention backend 'flash' gives a wrong lse in its varlen form", UserWarning, stacklevel=1)
        warnings.warn("Transformer Engine and Apex are not installed. Falling back", UserWarning, stacklevel=1)
    return [str(w.message) for w in shown]


def test_a_ranks_warnings_reach_the_user_and_import_noise_does_not():
    """The fork server quiets what its imports print; it started with PYTHONWARNINGS=ignore,
    which its ranks inherited: the varlen fallback's and the slow GEMM's warnings were lost."""
    from megatron_tsp.run import launch

    with launch.job(2) as job:
        assert job.run(_warnings_shown) == [["attention backend 'flash' gives a wrong lse in its varlen form"]] * 2


def test_train_sets_device_connections_per_mode():
    from megatron_tsp.commands.training import rank_environment
    from megatron_tsp.run import config

    tiny = dict(mock_data=True, vocab_size=256, attention_dropout=0.0)
    assert rank_environment(config.resolve(dict(tiny, tsp_size=2))) == {}  # CUDA's default: TSP's streams
    for layout in (dict(tensor_model_parallel_size=2, sequence_parallel=True), dict(context_parallel_size=2),
                   dict(tensor_model_parallel_size=2, sequence_parallel=True, ring_mlp=True)):
        assert rank_environment(config.resolve(dict(tiny, **layout))) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def _noted(args):
    from megatron_tsp.run import launch

    return launch.sigterm_received()


def test_a_command_starts_with_no_sigterm_noted():
    """The note outlived its command: a later train in the same process stopped at once."""
    import argparse

    from megatron_tsp import cli
    from megatron_tsp.run import launch

    launch.remember_sigterm(signal.SIGTERM, None)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert cli._with_signals(argparse.Namespace(command="train", func=_noted)) is None
    finally:
        launch.forget_sigterm()
        signal.signal(signal.SIGTERM, previous)


def _exit_reason_without_the_handler():
    from megatron_tsp.device import CPU
    from megatron_tsp.run import config, launch
    from megatron_tsp.run.loop import EarlyExit

    exits = EarlyExit(config.resolve(dict(mock_data=True, vocab_size=256, attention_dropout=0.0,
                                          exit_duration_in_mins=60)), CPU)
    launch.remember_sigterm(signal.SIGTERM, None)  # what a pool worker notes whatever the run
    try:
        return exits.reason(1)
    finally:
        launch.forget_sigterm()
        exits.close()


def test_a_noted_sigterm_stops_only_a_run_with_the_handler(ranks):
    """--exit-duration-in-mins alone read the worker's note: a SIGTERM stopped the run "with
    --exit-signal-handler", which was not given (the launcher decides then)."""
    assert ranks(1, _exit_reason_without_the_handler) == [None]
