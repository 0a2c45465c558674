"""`--link`: the ranks in a private network namespace with a rate-limited loopback. The
all-gather bandwidth the ranks achieve is the set rate, and nothing outlives the command."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import yaml
from conftest import ROOT, left_behind

from megatron_tsp.measure.link import Link, LinkError

RATE = 8.0  # MB/s per rank


def _can_make_namespaces():
    try:
        with Link(2):
            return None
    except LinkError as exc:
        return str(exc)


WHY_NOT = _can_make_namespaces() if shutil.which("tc") else "no tc (iproute2)"


@pytest.mark.skipif(WHY_NOT is not None, reason=f"no rate-limited link here: {WHY_NOT}")
def test_two_ranks_all_gather_at_the_set_rate_and_leave_nothing(tmp_path):
    out = tmp_path / "cpu.yaml"
    proc = subprocess.Popen([sys.executable, "-m", "megatron_tsp.cli", "calibrate", "--seq", "256", "--link",
                             f"none,{RATE:g}", "--out", str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    links = yaml.safe_load(out.read_text())["links"]
    achieved = links[f"{RATE:g}"]["gbs"] * 1e3
    assert abs(achieved - RATE) <= 0.25 * RATE, (achieved, RATE)
    assert links["none"]["gbs"] * 1e3 > 4 * RATE  # the limit is what slowed it
    # the namespace and its qdisc go with the last process in it: none is left
    assert not left_behind(session=proc.pid)
    assert "tbf" not in subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout


def _namespaces():
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            found.add(os.readlink(f"/proc/{pid}/ns/net"))
        except OSError:
            pass
    return found


@pytest.mark.skipif(WHY_NOT is not None or shutil.which("nsenter") is None,
                    reason=f"no rate-limited link here: {WHY_NOT or 'no nsenter'}")
def test_ctrl_c_while_the_link_is_limited_leaves_nothing(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "megatron_tsp.cli", "calibrate", "--seq", "64", "--link", "1",
                             "--out", str(tmp_path / "cpu.yaml")], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        qdisc, deadline = "", time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:  # until the token bucket is on
            namespace = os.readlink(f"/proc/{proc.pid}/ns/net")
            qdisc = subprocess.run(["nsenter", f"--net=/proc/{proc.pid}/ns/net", "tc", "qdisc", "show", "dev", "lo"],
                                   capture_output=True, text=True).stdout
            if "tbf" in qdisc:
                break
            time.sleep(0.1)
        assert "tbf" in qdisc and namespace != os.readlink("/proc/self/ns/net"), qdisc
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == ["megatron-tsp calibrate: interrupted"], err
    assert not left_behind(session=proc.pid)
    assert namespace not in _namespaces()  # it went with its last process, and its qdisc with it


def test_rates_are_checked():
    from megatron_tsp.measure.link import parse_rates

    assert parse_rates("none,h100-nvlink,2.5") == ["none", "h100-nvlink", 2.5]
    for bad in ("0", "fast", "-1", ""):
        with pytest.raises(ValueError):
            parse_rates(bad)
    # tc refused 1e12 after 6.5 s with a raw message; 0.001 ran past the deadline naming neither flag
    for bad in ("1e12", "0.001"):
        with pytest.raises(ValueError, match=f"{bad} MB/s per rank is outside 1-100000"):
            parse_rates(bad)


def test_a_link_command_refused_for_privilege_says_how_to_get_it():
    """Without CAP_NET_ADMIN the raw RTNETLINK line was all a user saw."""
    from megatron_tsp.measure import link

    with pytest.raises(LinkError) as exc:
        link._run("sh", "-c", "echo 'RTNETLINK answers: Operation not permitted' >&2; exit 2")
    assert str(exc.value).endswith("failed: RTNETLINK answers: Operation not permitted; changing a network device "
                                   "needs CAP_NET_ADMIN: run as root, or inside `unshare --user --map-root-user --net`")


@pytest.mark.skipif(WHY_NOT is not None, reason=f"no rate-limited link here: {WHY_NOT}")
def test_a_call_past_its_deadline_over_the_link_names_both_flags(tmp_path):
    """It named neither --link nor --timeout-s (bench and calibrate share the flags; calibrate
    needs no matplotlib)."""
    out = subprocess.run([sys.executable, "-m", "megatron_tsp.cli", "calibrate", "--link", "1", "--seq", "64",
                          "--timeout-s", "1", "--out", str(tmp_path / "cpu.yaml")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    [line] = out.stderr.strip().splitlines()
    assert "did not finish within 1s" in line and "(--link " in line and line.endswith(
        "MB/s per rank: give it more --timeout-s than 1, or --link a higher rate)"), line
