"""The overlap and error-path helpers every TSP schedule is built from."""

import pytest

from megatron_tsp.core import comm
from megatron_tsp.core.streaming import OneBehind, ahead


class Work:
    def __init__(self):
        self.waited = False

    def wait(self):
        self.waited = True


def test_an_error_waits_for_every_transfer_in_flight():
    with pytest.raises(ValueError, match="kernel failed"):
        with comm.InFlight() as inflight:
            done, pending = inflight.add(Work()), inflight.add([Work(), Work()])
            inflight.wait(done)
            raise ValueError("kernel failed")
    assert done.waited and all(w.waited for w in pending)


def test_ahead_starts_before_the_block_with_overlap_and_after_it_without():
    for overlap, order in ((True, ["start", "compute"]), (False, ["compute", "start"])):
        events = []

        def start(events=events):
            events.append("start")
            return "next"

        with ahead(start, overlap) as upcoming:
            events.append("compute")
        assert events == order and upcoming.value == "next"


def test_ahead_does_not_start_after_an_error():
    events = []
    with pytest.raises(RuntimeError):
        with ahead(lambda: events.append("start"), overlap=False):
            raise RuntimeError
    assert events == []


def test_one_behind_hands_items_back_a_step_late_only_with_overlap():
    late, now = OneBehind(True), OneBehind(False)
    assert [late.swap(i) for i in range(3)] + [late.flush()] == [None, 0, 1, 2]
    assert [now.swap(i) for i in range(3)] + [now.flush()] == [0, 1, 2, None]
