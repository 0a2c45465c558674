"""Collect iteration logs of several runs into one comparison table.

Reads ``megatron-tsp train`` JSON lines or Megatron-style text logs (``iteration N/ M |
... elapsed time per iteration (ms): T | ... lm loss: L |``, as printed by this project and
by Megatron-LM). A run directory is searched for ``log.jsonl`` first, then for the text log
that holds iteration lines. A log that several runs appended to gives one row per run. The
first ``warmup`` iterations of each run are left out of the timing.
"""

from __future__ import annotations

import glob
import json
import os
import re
import statistics
from typing import Dict, List, Optional

from megatron_tsp.errors import UserError

_FIELDS = {
    "iteration": r"iteration\s+(\d+)/",
    "elapsed_ms": r"elapsed time per iteration \(ms\):\s*([\d.]+)",
    "loss": r"lm loss:\s*([\d.Ee+-]+)",
    "tflops_per_device": r"(?:TFLOP/s/device|throughput per GPU \(TFLOP/s/GPU\)):\s*([\d.]+)",
    "tokens_per_s": r"tokens/s:\s*([\d.]+)",
    "peak_memory_gib": r"peak memory \(GiB\):\s*([\d.]+)",
}


def parse_text(lines: List[str]) -> List[Dict[str, float]]:
    records = []
    for line in lines:
        if "iteration" not in line or "elapsed time per iteration" not in line:
            continue
        record = {}
        for key, pattern in _FIELDS.items():
            m = re.search(pattern, line)
            if m:
                record[key] = float(m.group(1))
        records.append(record)
    return records


def split_runs(records: List[Dict]) -> List[List[Dict]]:
    """The runs of one log, in order. Every run of a config appends to the same log: a
    ``megatron-tsp train`` record names its run (``run``); for records without one (Megatron-LM
    text logs), a run starts where the iteration number does not go up."""
    runs: List[List[Dict]] = []
    for record in records:
        if not runs or _starts_a_run(runs[-1][-1], record):
            runs.append([])
        runs[-1].append(record)
    return runs


def _starts_a_run(previous: Dict, record: Dict) -> bool:
    if "run" in record or "run" in previous:
        return record.get("run") != previous.get("run")
    return record["iteration"] <= previous["iteration"]


def read_runs(path: str) -> Dict[str, List[Dict]]:
    """The runs of a log file or a run directory by name: ``path``, or ``path [run]`` for each
    run where the log holds several (:func:`split_runs`), so that no row mixes runs."""
    runs = split_runs(read_run(path))
    if len(runs) == 1:
        return {path: runs[0]}
    return {f"{path} [{run[0].get('run') or f'run {n} of {len(runs)}'}: iterations {run[0]['iteration']}-"
            f"{run[-1]['iteration']}{', ' + run[0]['mode'] if 'mode' in run[0] else ''}]": run
            for n, run in enumerate(runs, 1)}


def read_run(path: str) -> List[Dict[str, float]]:
    """Iteration records of a log file or a run directory; one :class:`UserError` line when
    there are none (missing, empty, half-written or not a log)."""
    log = _find_log(path) if os.path.isdir(path) else path
    try:
        with open(log, encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
    except OSError as exc:
        raise UserError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    records = _parse_jsonl(log, lines) if log.endswith(".jsonl") else parse_text(lines)
    if not records:
        raise UserError(f"{log}: no iteration records (an empty log, or not a megatron-tsp / Megatron-LM log)")
    return records


def _find_log(path: str) -> str:
    """``log.jsonl`` under a run directory, else the first text log with iteration lines."""
    jsonl = sorted(glob.glob(os.path.join(path, "**", "log.jsonl"), recursive=True))
    if jsonl:
        return jsonl[0]
    for candidate in sorted(glob.glob(os.path.join(path, "**", "*.log"), recursive=True)) + \
            sorted(glob.glob(os.path.join(path, "**", "*.out"), recursive=True)):
        with open(candidate, encoding="utf-8", errors="replace") as f:
            if parse_text(f.readlines()):
                return candidate
    raise UserError(f"{path}: no log.jsonl and no *.log / *.out with iteration lines in this directory")


def _parse_jsonl(path: str, lines: List[str]) -> List[Dict[str, float]]:
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise UserError(f"{path}:{number}: not a JSON record (a half-written or damaged log)") from None
        if not isinstance(record, dict) or "iteration" not in record:
            raise UserError(f"{path}:{number}: not an iteration record (no 'iteration' key)")
        records.append(record)
    return records


def summarize(records: List[Dict[str, float]], warmup: int = 2) -> Dict[str, Optional[float]]:
    timed = [r for r in records[warmup:] if "elapsed_ms" in r] or [r for r in records if "elapsed_ms" in r]
    steps = sorted(r["elapsed_ms"] for r in timed)

    def median(key):
        values = [r[key] for r in timed if key in r]
        return statistics.median(values) if values else None

    def pct(q):
        return steps[min(len(steps) - 1, int(q * (len(steps) - 1) + 0.5))] if steps else None

    return {
        "iterations": len(records),
        "step_ms_median": statistics.median(steps) if steps else None,
        "step_ms_p10": pct(0.1),
        "step_ms_p90": pct(0.9),
        "tokens_per_s": median("tokens_per_s"),
        "tflops_per_device": median("tflops_per_device"),
        "peak_memory_gib": max((r["peak_memory_gib"] for r in records if "peak_memory_gib" in r), default=None),
        "final_loss": records[-1].get("loss") if records else None,
    }


def table(runs: Dict[str, Dict[str, Optional[float]]]) -> str:
    """Markdown table; the step-time ratio is relative to the first run."""
    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    names = list(runs)
    base = runs[names[0]]["step_ms_median"] if names else None
    lines = ["| run | iters | step ms (median) | p10-p90 | vs first | tokens/s | TFLOP/s/device | peak GiB "
             "| final loss |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in names:
        s = runs[name]
        ratio = s["step_ms_median"] / base if base and s["step_ms_median"] else None
        lines.append(
            f"| {name} | {s['iterations']} | {fmt(s['step_ms_median'], '.1f')} | "
            f"{fmt(s['step_ms_p10'], '.1f')}-{fmt(s['step_ms_p90'], '.1f')} | {fmt(ratio, '.2f')}x | "
            f"{fmt(s['tokens_per_s'], '.0f')} | {fmt(s['tflops_per_device'], '.1f')} | "
            f"{fmt(s['peak_memory_gib'], '.1f')} | {fmt(s['final_loss'], '.4f')} |")
    return "\n".join(lines)
