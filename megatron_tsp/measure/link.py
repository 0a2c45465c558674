"""A rate-limited link between the local ranks: a cluster's compute-to-bandwidth ratio on a CPU.

A CPU running gloo over loopback is compute-bound (~250 MB/s of link against a few GFLOP/s),
so the traffic TSP saves and hides cannot show. :class:`Link` moves this process, and every
process it starts from then on (the ranks' fork server, hence the ranks), into a network
namespace of its own whose loopback has a token-bucket qdisc::

    ip link set lo up
    tc qdisc replace dev lo root tbf rate <nproc x rate per rank> burst <...> latency <...>

Topology: a shared medium. Every byte any rank sends crosses the one loopback qdisc, so a
step whose ranks send B bytes in all takes B / (nproc x r) seconds of link time at r bytes/s
per rank. Summed over the ranks, bytes sent equal bytes received, and every mode's traffic
is symmetric over a step (ring collectives, TSP's broadcast roots rotate), so that is each
rank's received bytes / r: the per-rank link of the performance model, with the same r.
Unlike per-rank links, one rank sending alone (a broadcast root, a pipeline stage) gets the
whole medium.

Nothing outlives the process: the namespace and its qdisc go with the last process in it.
Making one needs CAP_SYS_ADMIN (root, or a user namespace: ``unshare --user
--map-root-user megatron-tsp bench ...``) and iproute2's ``ip`` and ``tc``.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from typing import Dict, Optional

from megatron_tsp.errors import UserError

CLONE_NEWNET = 0x40000000
# The GPU and link whose ratio of sustained matmul FLOP/s to link bytes/s `--like` gives the
# CPU: (hardware profile, which of its links)
LIKE = {
    "h100-nvlink": ("h100", "intra_node_gbs"),
    "h200-nvlink": ("h200", "intra_node_gbs"),
    "mi300x-xgmi": ("mi300x", "intra_node_gbs"),
    "ib-400g": ("h100", "inter_node_gbs"),
}
# loopback's MTU is 64 KiB: a bucket smaller than two packets would drop them
_MIN_BURST = 2 * 65536 + 2048
_QUEUE_S = 2.0  # tbf's queue: what TCP has in flight waits, never dropped


class LinkError(UserError):
    """A rate-limited link cannot be made here (privileges, tools)."""


def flops_per_byte(like: str, hardware_dir: str) -> float:
    """Sustained matmul FLOP/s of the GPU over the link's bytes/s (both from its profile)."""
    from megatron_tsp.measure.perfmodel import load_hardware

    gpu, link = LIKE[like]
    hw = load_hardware(os.path.join(hardware_dir, f"{gpu}.yaml"))
    return hw.peak_tflops * 1e12 * hw.matmul_efficiency / (getattr(hw, link) * 1e9)


def like_rate(like: str, cpu_flops: float, hardware_dir: str) -> float:
    """MB/s per rank that gives a CPU of ``cpu_flops`` per rank the FLOP-per-byte of ``like``."""
    return cpu_flops / flops_per_byte(like, hardware_dir) / 1e6


def parse_rates(text: str) -> list:
    """``--link``: comma-separated MB/s per rank, ``none`` (unthrottled) or a ``--like`` name."""
    rates = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        if item == "none" or item in LIKE:
            rates.append(item)
            continue
        try:
            value = float(item)
        except ValueError:
            value = float("nan")
        if not value > 0 or value == float("inf"):
            raise ValueError(f"{item!r} is not a rate in MB/s per rank, 'none' or one of {', '.join(LIKE)}")
        if not RATE_RANGE[0] <= value <= RATE_RANGE[1]:  # tc refused 1e12; 0.001 ran past every deadline
            raise ValueError(f"{item} MB/s per rank is outside {RATE_RANGE[0]:g}-{RATE_RANGE[1]:g}: slower takes hours "
                             "per step, and loopback is not faster ('none' for no limit)")
        rates.append(value)
    if not rates:
        raise ValueError(f"{text!r} names no rate")
    return rates


_PRIVILEGE = "run as root, or inside `unshare --user --map-root-user --net`"
RATE_RANGE = (1.0, 1e5)  # MB/s per rank


def _run(*cmd: str) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        said = ((out.stderr or out.stdout).strip().splitlines() or ["no message"])[-1]
        fix = ("; changing a network device needs CAP_NET_ADMIN: " + _PRIVILEGE) if "not permitted" in said else ""
        raise LinkError(f"--link: `{' '.join(cmd)}` failed: {said}{fix}")


class Link:
    """This process in a private network namespace with loopback up; :meth:`set` limits it.

    Enter before any rank, fork server or socket of the job exists (they must live in the
    namespace). Leaving removes the qdisc and returns this process to its namespace; the
    private one disappears with the last of its processes."""

    def __init__(self, nproc: int):
        self.nproc = nproc
        self.rate: Optional[float] = None  # MB/s per rank; None: unthrottled
        self._home: Optional[int] = None

    def __enter__(self) -> "Link":
        missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
        if missing:
            raise LinkError(f"--link needs iproute2's {' and '.join(missing)} on PATH (apt install iproute2)")
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        home = os.open("/proc/self/ns/net", os.O_RDONLY)
        if libc.unshare(CLONE_NEWNET) != 0:
            os.close(home)
            err = ctypes.get_errno()
            raise LinkError(f"--link cannot make a network namespace ({os.strerror(err)}): {_PRIVILEGE}")
        self._home, self._libc = home, libc
        try:
            _run("ip", "link", "set", "lo", "up")
        except BaseException:
            self._leave()
            raise
        return self

    def set(self, rate: Optional[float]) -> None:
        """``rate`` MB/s per rank (``nproc`` x that on the shared loopback), or None: no limit."""
        if rate is None:
            if self.rate is not None:
                _run("tc", "qdisc", "del", "dev", "lo", "root")
        else:
            total = rate * 1e6 * self.nproc  # bytes/s
            burst = max(_MIN_BURST, int(total * 0.002))
            _run("tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", f"{int(total * 8)}bit",
                 "burst", str(burst), "latency", f"{int(_QUEUE_S * 1000)}ms")
        self.rate = rate

    def qdisc(self) -> str:
        """``tc qdisc show dev lo`` in the namespace (what limits the link now)."""
        return subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True,
                              timeout=30).stdout.strip()

    def _leave(self) -> None:
        if self._home is not None:
            self._libc.setns(self._home, CLONE_NEWNET)  # cannot fail for the namespace it came from
            os.close(self._home)
            self._home = None

    def __exit__(self, *exc) -> None:
        try:
            if self.rate is not None:
                self.set(None)
        finally:
            self._leave()

    def describe(self) -> Dict:
        return {"topology": "shared medium: one token bucket on the loopback of a private network namespace",
                "rate_mb_s_per_rank": self.rate, "total_mb_s": None if self.rate is None else self.rate * self.nproc}
