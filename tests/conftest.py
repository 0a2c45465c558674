"""Multi-rank test harness: run a function on N gloo ranks, reusing worker processes.

``ranks(world_size, fn, *args)`` runs ``fn`` on every rank of a long-lived pool of that
size and returns the per-rank results, or raises with the first failing rank's traceback.
A rank that hangs past ``timeout_s`` kills the pool (a later call starts a fresh one), so a
deadlock is a test failure with a message, never a stuck CI job. ``fn`` must be a
module-level function of an importable module (workers unpickle it by name).
"""

import os
import time

import psutil
import pytest
import tiers

from megatron_tsp.run.launch import WorkerPool

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository

_POOLS = {}


def run_on_pool(world_size, fn, *args, timeout_s=300.0, **kwargs):
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive:
        pool = _POOLS[world_size] = WorkerPool(world_size, device_type="cpu")
    return pool.run(fn, *args, timeout_s=timeout_s, **kwargs)


def _close_pools():
    for pool in _POOLS.values():
        pool.close(kill=True)  # nothing to finish: no graceful shutdown to wait for
    _POOLS.clear()


@pytest.fixture(scope="session")
def ranks():
    yield run_on_pool
    _close_pools()


@pytest.fixture(scope="module", autouse=True)
def _workers_per_module():
    """Each test module's ranks are fresh processes (a fork each, in a fraction of a second):
    what a module's tasks leave behind that ``launch._reset`` cannot free (megatron-core's
    MoE layers outlive their task, and their gloo groups' threads with them) does not slow
    the modules after it, the Megatron-LM torchruns among them."""
    yield
    _close_pools()


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="the full matrix (CI): also the tests marked full, beyond each guarantee's representative")


def pytest_configure(config):
    config.addinivalue_line("markers", "full: more of a matrix whose representative runs in the default tier; "
                                       "run with --full (.ci/run does)")


@pytest.hookimpl(trylast=True)  # after -k/-m deselected what they deselect
def pytest_collection_modifyitems(session, config, items):
    """The default tier leaves out the tests marked ``full`` (``--full`` keeps them). Work a
    selected test module can do in a process of its own (its ``start_in_background(items)``,
    given its selected tests) starts now and runs beside the tests before it."""
    for item in items:
        if tiers.tier_of(item.nodeid) == "full":
            item.add_marker(pytest.mark.full)
    if not config.getoption("--full"):
        deselected = [item for item in items if item.get_closest_marker("full")]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = [item for item in items if not item.get_closest_marker("full")]
    if config.option.collectonly:
        return
    for module in {item.module for item in items}:
        if hasattr(module, "start_in_background"):
            module.start_in_background([item for item in items if item.module is module])


def processes(session=None, group=None):
    """Live processes (zombies aside) of a session or a process group, this one excluded."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid == os.getpid() or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if (session is None or os.getsid(proc.pid) == session) and (group is None or os.getpgid(proc.pid) == group):
                found.append(proc)
        except (psutil.NoSuchProcess, ProcessLookupError, PermissionError):
            pass
    return found


def left_behind(timeout_s=15.0, **where):
    """What is still alive of a session or process group after ``timeout_s`` (a process that
    exits on its own, like a resource tracker, has that long to go)."""
    deadline = time.monotonic() + timeout_s
    while (alive := processes(**where)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in alive if p.is_running()]


def _strays():
    """Processes the suite started and did not end: anything below this process but the
    multiprocessing fork server and resource tracker, which leave with it."""
    me = psutil.Process()
    strays = []
    for child in me.children(recursive=True):
        try:
            helper = child.ppid() == me.pid and "multiprocessing" in " ".join(child.cmdline())
            if not helper and child.status() != psutil.STATUS_ZOMBIE:
                strays.append(child)
        except psutil.NoSuchProcess:
            pass
    return strays


def pytest_sessionfinish(session, exitstatus):
    """No test may leave a process running (a worker left on a GPU node holds its memory)."""
    for pool in _POOLS.values():
        pool.close(kill=True)
    _POOLS.clear()
    deadline = time.monotonic() + 15
    while (strays := _strays()) and time.monotonic() < deadline:
        time.sleep(0.2)
    if strays:
        listed = "; ".join(f"{p.pid} {' '.join(p.cmdline())[:100]}" for p in strays)
        session.config.get_terminal_writer().line(f"processes left running by the tests: {listed}", red=True)
        for p in strays:
            p.kill()
        session.exitstatus = 1
