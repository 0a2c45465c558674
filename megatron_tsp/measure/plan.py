"""``megatron-tsp plan``: before booking, what fits on a GPU and how fast it runs.

Per mode: (a) the longest sequence length that fits in the GPU's memory, with the recompute
setting that allows it (full recompute keeps the least), found by bisection on the planner to
within :data:`GRANULARITY` tokens; (b) at the config's sequence length, every recompute
choice megatron-core offers that applies, each with rank 0's peak memory, whether it fits,
and cluster tokens/s from the performance model; the fastest that fits is marked; (c) the
same on a grid of sequence lengths, for the picture.

Every point is one :func:`megatron_tsp.measure.perfmodel.evaluate`: the memory planner at 1 and 2
layers (FakeTensorMode, rank 0 of the job), extrapolated linearly in the layer count, so
memory and speed come from one planning. A setting fits when its peak is at most the GPU's
memory less a reserve for what the planner does not see (:attr:`perfmodel.Hardware.usable_gib`).
TSP's head groups and MLP shards per call, where the config leaves them to ``auto``, are the
model's choice at the config's length and the grid's (the fastest that fits,
:func:`perfmodel.evaluate`); the longest length is bisected with the runtime's ``auto``,
which at such lengths is one head group a call and the MLP's ring, the least memory. The
choices are megatron-core's for a dense GPT layer but ``layernorm``, which megatron-core
0.16.1 runs only with TransformerEngine (see ``preflight``).
"""

from __future__ import annotations

import copy
from typing import Callable, Dict, List, Optional

from megatron_tsp.core.sizes import DEFAULT_CP
from megatron_tsp.env import run_record, shown_path
from megatron_tsp.measure import figures, perfmodel
from megatron_tsp.run import config as cfg
from megatron_tsp.run.modes import REFERENCES, SUBJECT, check_layouts, get_mode

GRANULARITY = 1024  # tokens; a multiple of 2 x D x CP for every D x CP up to 512
MAX_SEQ = 4 * 1024 * 1024
RECOMPUTE_KEYS = ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules")
CHOICES = {
    "none": {},
    "selective core_attn": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
    "selective mlp": dict(recompute_granularity="selective", recompute_modules=["mlp"]),
    "selective moe": dict(recompute_granularity="selective", recompute_modules=["moe"]),  # MoE models only
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}
LEAST_MEMORY = "full"


def not_applicable(mode: str) -> Dict[str, str]:
    """The recompute choices that change nothing for ``mode``, with the reason (:class:`Mode`)."""
    inert = get_mode(mode).inert_recompute
    return {choice: inert[m] for choice, v in CHOICES.items() for m in v.get("recompute_modules", ()) if m in inert}


class Planner:
    """Memoised :func:`perfmodel.evaluate` of (mode, recompute choice, sequence length);
    ``progress``: told of each point before it is planned (a few fake steps each, seconds to
    minutes at long S)."""

    def __init__(self, values: Dict, hw: perfmodel.Hardware, nodes: int, cp: int, scenario: str,
                 fused_norm: bool = True, progress: Optional[Callable[[str], None]] = None):
        self.values = {k: v for k, v in values.items() if k not in RECOMPUTE_KEYS}
        self.hw, self.world, self.cp, self.scenario = hw, nodes * hw.gpus_per_node, cp, scenario
        self.fused_norm = fused_norm
        self.limit = hw.usable_gib
        self.progress = progress or (lambda line: None)
        self._points: Dict = {}

    def point(self, mode: str, choice: str, seq: int, choose: bool = False) -> Dict:
        """One setting; with ``choose``, TSP's head groups and MLP shards per call are the
        model's choice (``tsp_setting``, where the config leaves them to ``auto``)."""
        choose = choose and bool(perfmodel.tsp_choices(self.values, mode, self.cp))
        key = (mode, choice, seq, choose)
        if key not in self._points:
            self.progress(f"point {len(self._points) + 1}: {mode} at S={seq:,}, recompute {choice}"
                          + (", TSP's head groups and MLP shards per call chosen" if choose else ""))
            v = dict(cfg.at_seq_length(self.values, seq), **CHOICES[choice])
            r = perfmodel.evaluate(copy.deepcopy(v), mode, self.hw, self.world, self.cp, brief=True,
                                   fused_norm=self.fused_norm, choose_by=self.scenario if choose else None,
                                   limit_gib=self.limit)
            self._points[key] = {"peak_gib": r["peak_gib"], "fits": r["peak_gib"] <= self.limit,
                                 "tsp_setting": r.get("tsp_setting"),
                                 "tokens_per_s": r[self.scenario]["tokens_per_s_cluster"],
                                 "step_s": r[self.scenario]["step_s"], "mfu": r[self.scenario]["mfu"],
                                 "tokens_per_s_by_scenario": {k: r[k]["tokens_per_s_cluster"]
                                                              for k in perfmodel.SCENARIOS}}
        return self._points[key]

    def choices(self, mode: str) -> List[str]:
        moe = bool(self.values.get("num_experts"))
        return [c for c, v in CHOICES.items()
                if c not in not_applicable(mode) and (moe or "moe" not in v.get("recompute_modules", ()))]

    def longest(self, mode: str, start: int) -> Optional[int]:
        """The longest multiple of GRANULARITY that fits with the least-memory choice (None
        if not even GRANULARITY tokens fit): doubling or halving from ``start``, then bisection."""
        fits = lambda seq: self.point(mode, LEAST_MEMORY, seq)["fits"]  # noqa: E731
        lo = hi = max(GRANULARITY, start // GRANULARITY * GRANULARITY)
        if fits(lo):
            while hi < MAX_SEQ and fits(hi):
                lo, hi = hi, min(2 * hi, MAX_SEQ)
            if fits(hi):
                return hi
        else:
            while lo > GRANULARITY and not fits(lo):
                hi, lo = lo, max(GRANULARITY, lo // 2 // GRANULARITY * GRANULARITY)
            if not fits(lo):
                return None
        while hi - lo > GRANULARITY:
            mid = (lo + hi) // 2 // GRANULARITY * GRANULARITY
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def at(self, mode: str, seq: int) -> Dict:
        """Every applicable choice at ``seq``; ``best``: the fastest that fits (or None)."""
        rows = {c: self.point(mode, c, seq, choose=True) for c in self.choices(mode)}
        fitting = [c for c, r in rows.items() if r["fits"]]
        return {"choices": rows, "best": max(fitting, key=lambda c: rows[c]["tokens_per_s"]) if fitting else None}


def plan(config_path: str, hw: perfmodel.Hardware, nodes: int = 1, modes: List[str] = (SUBJECT,) + REFERENCES,
         cp: int = DEFAULT_CP, scenario: str = "overlap", grid: Optional[List[int]] = None,
         overrides: Optional[Dict] = None, fused_norm: bool = True,
         progress: Optional[Callable[[str], None]] = None) -> Dict:
    """For each mode the longest S that fits (bisection on the least-memory choice), every
    recompute choice at the config's S and at each of ``grid``'s; ``progress`` is told of
    each mode's start and each point planned."""
    values = cfg.load_config(config_path)
    values.update(overrides or {})
    if scenario not in perfmodel.SCENARIOS:
        raise cfg.ConfigError(f"--scenario {scenario!r}: use one of {', '.join(perfmodel.SCENARIOS)}")
    world = nodes * hw.gpus_per_node
    check_layouts(values, modes, world, cp, "--nodes x gpus_per_node")  # before the first (slow) plan
    planner = Planner(values, hw, nodes, cp, scenario, fused_norm, progress)
    seq = cfg.resolve(values).seq_length
    result = {"setup": run_record(config=config_path), "config": shown_path(config_path), "hardware": hw.__dict__,
              "nodes": nodes, "scenario": scenario, "fused_norm": fused_norm, "seq_length": seq,
              "usable_gib": planner.limit, "granularity": GRANULARITY,
              "reserve": {"fraction": perfmodel.RESERVE_FRACTION, "gib": perfmodel.RESERVE_GIB},
              "not_applicable": {f"{m} {c}": why for m in modes for c, why in not_applicable(m).items()},
              "modes": {}}
    for n, mode in enumerate(modes, 1):
        planner.progress(f"mode {n} of {len(modes)}: {mode}, the longest S that fits, then {len(planner.choices(mode))}"
                         f" recompute choices at {1 + len(grid or [])} length(s)")
        longest = planner.longest(mode, seq)
        result["modes"][mode] = {
            "longest_seq_length": longest, "longest_with": LEAST_MEMORY if longest else None,
            "at_seq_length": planner.at(mode, seq),
            "grid": {s: planner.at(mode, s) for s in (grid or [])},
        }
    return result


def table(result: Dict) -> str:
    hw = result["hardware"]
    lines = [f"{result['config']} on {result['nodes']} node(s) x {hw['gpus_per_node']} {hw['name']} "
             f"({hw['memory_gib']:.1f} GiB; usable {result['usable_gib']:.1f} GiB after a "
             f"{result['reserve']['fraction']:.0%}"
             f" + {result['reserve']['gib']:.0f} GiB reserve), tokens/s in scenario '{result['scenario']}', "
             + ("fused norms" if result.get("fused_norm", True) else "torch's unfused RMSNorm"),
             "", "| mode | longest S that fits | with recompute |", "|---|---|---|"]
    for mode, r in result["modes"].items():
        longest = f"{r['longest_seq_length']:,}" if r["longest_seq_length"] else "none fits"
        lines.append(f"| {mode} | {longest} | {r['longest_with'] or '-'} |")
    others = [k for k in perfmodel.SCENARIOS if k != result["scenario"]]
    lines += ["", f"At S = {result['seq_length']:,} (cluster tokens/s; the fastest that fits is marked in "
                  f"'{result['scenario']}'):", "",
              f"| mode | recompute | peak GiB | fits | {result['scenario']} | MFU | " + " | ".join(others)
              + " | best |",
              "|---|---|---|---|---|---|" + "---|" * len(others) + "---|"]
    for mode, r in result["modes"].items():
        at = r["at_seq_length"]
        for choice, p in at["choices"].items():
            rest = " | ".join(f"{p['tokens_per_s_by_scenario'][k]:,.0f}" for k in others)
            groups = f", {perfmodel.choice_name(p['tsp_setting'])}" if p.get("tsp_setting") else ""
            lines.append(f"| {mode} | {choice}{groups} | {p['peak_gib']:.1f} | {'yes' if p['fits'] else 'no'} | "
                         f"{p['tokens_per_s']:,.0f} | {p['mfu']:.1%} | {rest} | "
                         f"{'<- fastest that fits' if choice == at['best'] else ''} |")
    for what, why in result["not_applicable"].items():
        lines.append(f"\n{what}: not applicable ({why})")
    return "\n".join(lines)


def plot(result: Dict, path: str) -> None:
    """Left: peak memory (least-memory choice) against S per mode, with the usable limit;
    right: tokens/s of the fastest fitting choice against S."""
    plt = figures.pyplot("--grid")

    fig, (mem, speed) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode, r in result["modes"].items():
        seqs = sorted(int(s) for s in r["grid"])
        mem.plot(seqs, [r["grid"][s]["choices"][LEAST_MEMORY]["peak_gib"] for s in seqs], marker="o", label=mode)
        best = [(s, r["grid"][s]["choices"][r["grid"][s]["best"]]["tokens_per_s"])
                for s in seqs if r["grid"][s]["best"]]
        if best:
            speed.plot(*zip(*best), marker="o", label=mode)
    mem.axhline(result["usable_gib"], color="k", linestyle="--", label=f"usable {result['usable_gib']:.0f} GiB")
    for ax, ylabel in ((mem, f"peak GiB of rank 0 ({LEAST_MEMORY} recompute)"),
                       (speed, f"cluster tokens/s, fastest fitting recompute ({result['scenario']})")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    hw = result["hardware"]
    fig.suptitle(f"{result['config']}: {result['nodes']} x {hw['gpus_per_node']} {hw['name']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
