"""Where TSP's schedules wait for their transfers: the wait profile of a step.

Inside :class:`WaitProfile` every transfer an ``InFlight`` posts is tagged with the line of
the schedule that posted it (the first frame outside the transfer verbs: ``core/comm.py``,
``core/streaming.py``, ``core/kv.py``), and every wait for one is timed and charged to that
line together with the line that waited (a transfer the module before posted for this one,
:mod:`megatron_tsp.core.prefetch`, where this one takes it over; the waits of a schedule
that fails or drops a prefetch are not counted). What an overlap leaves exposed is then a table, not
a guess: the benchmark profiles the untimed step it counts the collectives of (``bench``,
``waits`` per mode and rank in its JSON, the largest in its table).
"""

from __future__ import annotations

import os
import sys
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

    def posted(self, work) -> None:
        self._posted_at[id(work)] = _schedule_line(3)

    def waited(self, work, seconds: float) -> None:
        entry = self._totals[(self._posted_at.pop(id(work), "?"), _schedule_line(3))]
        entry[0] += 1
        entry[1] += seconds

    def summary(self) -> List[Dict]:
        rows = [{"posted_at": posted, "waited_at": waited, "waits": n, "wait_ms": round(1e3 * s, 1)}
                for (posted, waited), (n, s) in self._totals.items()]
        return sorted(rows, key=lambda r: -r["wait_ms"])

    def __enter__(self) -> "WaitProfile":
        self._previous = comm.observe(self)
        return self

    def __exit__(self, *exc) -> None:
        comm.observe(self._previous)
