"""Where TSP's schedules wait for their transfers: the wait profile of a step.

Inside :class:`WaitProfile` every transfer an ``InFlight`` posts is tagged with the line of
the schedule that posted it (the first frame outside the transfer verbs: ``core/comm.py``,
``core/streaming.py``, ``core/kv.py``), and every wait for one is timed and charged to that
line together with the line that waited (a transfer the module before posted for this one,
:mod:`megatron_tsp.core.prefetch`, where this one takes it over; the waits of a schedule
that fails or drops a prefetch are not counted). What an overlap leaves exposed is then a table, not
a guess: the benchmark profiles the untimed step it counts the collectives of (``bench``,
``waits`` per mode and rank in its JSON, the largest in its table).

The profile is also a timeline (:meth:`WaitProfile.timeline`): every schedule's span (a layer's
attention or MLP, forward or backward: :func:`comm.label`), every post and every wait, in
milliseconds from the profile's start, which ``bench --plot`` draws as a Gantt chart per rank
(:func:`gantt`): where a rank computes, where it waits, and for which transfer.
"""

from __future__ import annotations

import os
import sys
import time
from collections import defaultdict
from typing import Dict, List

from megatron_tsp.core import comm

_VERBS = {os.path.join("core", name) for name in ("comm.py", "streaming.py", "kv.py")}


def _schedule_line(depth: int) -> str:
    """``file:function:line`` of the first caller outside the transfer verbs."""
    frame = sys._getframe(depth)
    while frame is not None and any(frame.f_code.co_filename.endswith(v) for v in _VERBS):
        frame = frame.f_back
    if frame is None:
        return "?"
    code = frame.f_code
    return f"{os.path.basename(code.co_filename)}:{getattr(code, 'co_qualname', code.co_name)}:{frame.f_lineno}"


class WaitProfile:
    """Posted and waited-for transfers of the block, per (posting line, waiting line):
    ``summary()`` lists ``{"posted_at", "waited_at", "waits", "wait_ms"}``, longest first."""

    def __init__(self) -> None:
        self._posted_at: Dict[int, str] = {}
        self._totals: Dict[tuple, List[float]] = defaultdict(lambda: [0, 0.0])
        self._previous = None
        self._start = time.perf_counter()
        self._open: Dict[int, float] = {}
        self._events: List[Dict] = []

    def _ms(self, t: float) -> float:
        return round(1e3 * (t - self._start), 3)

    def opened(self, inflight) -> None:
        self._open[id(inflight)] = time.perf_counter()

    def closed(self, inflight) -> None:
        start = self._open.pop(id(inflight), None)
        if start is not None and inflight.label:  # a layer's schedule, not a helper's single transfer
            self._events.append({"span": inflight.label, "start_ms": self._ms(start),
                                 "end_ms": self._ms(time.perf_counter())})

    def posted(self, work) -> None:
        self._posted_at[id(work)] = line = _schedule_line(3)
        self._events.append({"post": line, "at_ms": self._ms(time.perf_counter())})

    def waited(self, work, seconds: float) -> None:
        posted, waited = self._posted_at.pop(id(work), "?"), _schedule_line(3)
        entry = self._totals[(posted, waited)]
        entry[0] += 1
        entry[1] += seconds
        end = time.perf_counter()
        self._events.append({"wait": waited, "for": posted, "start_ms": self._ms(end - seconds),
                             "end_ms": self._ms(end)})

    def timeline(self) -> List[Dict]:
        """The schedules' spans (``span``, ``start_ms``, ``end_ms``), the posts (``post``: the
        line, ``at_ms``) and the waits (``wait``: the line, ``for``: the posting line,
        ``start_ms``, ``end_ms``), in the order they ended."""
        return list(self._events)

    def summary(self) -> List[Dict]:
        rows = [{"posted_at": posted, "waited_at": waited, "waits": n, "wait_ms": round(1e3 * s, 1)}
                for (posted, waited), (n, s) in self._totals.items()]
        return sorted(rows, key=lambda r: -r["wait_ms"])

    def __enter__(self) -> "WaitProfile":
        self._start = time.perf_counter()
        self._previous = comm.observe(self)
        return self

    def __exit__(self, *exc) -> None:
        comm.observe(self._previous)


def gantt(timelines: List[List[Dict]], title: str, path: str) -> None:
    """One row per rank of :meth:`WaitProfile.timeline`: the schedules' spans (attention and
    MLP, forward lighter than backward), the waits over them in red, the posts as ticks."""
    from megatron_tsp.measure import figures

    plt = figures.pyplot("--plot")
    fig, ax = plt.subplots(figsize=(13, 1.5 + 0.8 * len(timelines)))
    colors = {("attention", "forward"): "#9ecae1", ("attention", "backward"): "#3182bd",
              ("mlp", "forward"): "#a1d99b", ("mlp", "backward"): "#31a354"}
    for rank, events in enumerate(timelines):
        y = len(timelines) - 1 - rank
        for e in events:
            if "span" in e:
                words = e["span"].split(" ")
                ax.barh(y, e["end_ms"] - e["start_ms"], left=e["start_ms"], height=0.6,
                        color=colors.get((words[0], words[-1]), "grey"), edgecolor="white", linewidth=0.3)
            elif "wait" in e:
                ax.barh(y - 0.2, e["end_ms"] - e["start_ms"], left=e["start_ms"], height=0.2, color="#de2d26")
            else:
                ax.plot([e["at_ms"]] * 2, [y + 0.3, y + 0.4], color="black", linewidth=0.4)
    ax.set_yticks(range(len(timelines)), [f"rank {r}" for r in reversed(range(len(timelines)))])
    ax.set_xlabel("ms from the start of the profiled step")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()] + \
        [plt.Rectangle((0, 0), 1, 1, color="#de2d26")]
    ax.legend(handles, [f"{k} {p}" for k, p in colors] + ["waiting for a transfer"], loc="upper left",
              bbox_to_anchor=(1.01, 1), fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
