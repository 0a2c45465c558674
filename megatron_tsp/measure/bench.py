"""Side-by-side benchmark of training steps of the modes (:data:`megatron_tsp.run.modes.MODES`:
TSP with and without its overlap, TP, TP+SP, TP+SP with the ring MLP, TP x CP) on the
machine at hand.

Every mode trains the same model (same config, data and seed) on the same ranks (gloo on a
CPU, NCCL/RCCL under torchrun on GPUs) with the same attention op
(:func:`megatron_tsp.core.block_attention.block_attention`; never TransformerEngine's, which only the
baselines could use), and every step gets a fresh batch: step n of every mode trains on the
same tokens. Modes are interleaved: repeat r runs a block of timed steps of every mode
before repeat r+1 starts, so slow drifts of a noisy machine hit all modes alike.

Like with like is checked, not assumed: each block's first step (the fresh model on the
first batch) must give the same loss in every mode (:func:`loss_rtol`), or no result is written.
Reported per sequence length and mode: median step time with its spread (min-max over
blocks of their medians), TSP with its overlap off (weight streams and K/V exchange; the
difference is the communication the overlap hides), bytes received per rank per step
(counted), peak memory of rank 0 (tracked, in a separate untimed step), ratios to TP+SP
and to TP x CP, and the first sequence length at which TSP beats TP+SP.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import time
from typing import Dict, List, Optional

import torch.distributed as dist

from megatron_tsp.core.sizes import DEFAULT_CP
from megatron_tsp.env import run_record
from megatron_tsp.errors import UserError
from megatron_tsp.measure import counts, figures, memory, waits
from megatron_tsp.measure.distributed import direct_reductions
from megatron_tsp.run import config as cfg
from megatron_tsp.run.build import initialize, stepper
from megatron_tsp.run.config import at_seq_length
from megatron_tsp.run.launch import rank_device
from megatron_tsp.run.modes import MODES, NO_OVERLAP, REFERENCE, REFERENCES, SUBJECT, get_mode, ratio_key

VS = ratio_key(REFERENCE)  # a mode's step time over TP+SP's, measured and predicted
PREDICTED_VS = "predicted_" + VS

# How far the modes' step-1 losses on a fresh model may differ: in fp32 by reduction order only
# (~1e-7); in bf16/fp16 every mode rounds its partial sums at other places (~1e-4 to 1e-3 seen).
# Still tight enough to catch another model or other data, whose loss differs by 1e-2 and more.
LOSS_RTOL = {"fp32": 1e-4, "half": 5e-3}


def loss_rtol(values: Dict) -> float:
    """The tolerance of :func:`check_same_loss` for a config's precision."""
    return LOSS_RTOL["half" if values.get("bf16") or values.get("fp16") else "fp32"]


class ModesDisagree(UserError):
    """The modes did not compute the same first-step loss: the comparison would be invalid."""


def _args(values: Dict, mode: str, seq: int):
    """Every mode initialises the same weights on the CPU (then moves them to its device)."""
    return get_mode(mode).args(dict(at_seq_length(values, seq), use_cpu_initialization=True))


def _block(values: Dict, mode: str, seq: int, steps: int, warmup: int) -> Dict:
    """On every rank of the job: build the model for ``mode``; its first step's loss, then
    ``warmup`` more untimed steps, one counted step (its collectives counted and its waits
    for TSP's transfers profiled: :mod:`waits`) and ``steps`` timed steps, each on a new
    batch. On gloo every mode's reduce-scatters and reduces move what they would on a GPU
    (:func:`megatron_tsp.measure.distributed.direct_reductions`)."""
    with direct_reductions():
        return _timed_block(values, mode, seq, steps, warmup)


def _timed_block(values: Dict, mode: str, seq: int, steps: int, warmup: int) -> Dict:
    device = rank_device()
    args = _args(values, mode, seq)
    initialize(args, device)
    step = stepper(args, device, get_mode(mode))
    first_loss = step()["loss"]
    for _ in range(warmup):
        step()
    with counts.count_collectives() as records, waits.WaitProfile() as profile:
        step()
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        device.synchronize()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    received = sum(v for phases in counts.totals(records).values() for v in phases.values())
    return {"step_s": times, "bytes_received": received, "first_step_loss": first_loss,
            "layer_spec": get_mode(mode).layer_spec(args),
            "waits": profile.summary(), "timeline": profile.timeline()}


def _memory(values: Dict, mode: str, seq: int) -> float:
    return memory.measure(dict(at_seq_length(values, seq), use_cpu_initialization=True), mode,
                          rank_device())["peak_gib"]


def check_same_loss(first_losses: Dict[str, List[float]], seq: int, rtol: float = LOSS_RTOL["fp32"]) -> None:
    """Raise :class:`ModesDisagree` unless every block of every mode had the same step-1 loss
    (to ``rtol``, relative)."""
    values = [(mode, loss) for mode, losses in first_losses.items() for loss in losses]
    ref_mode, ref = values[0]
    for mode, loss in values:
        if abs(loss - ref) > rtol * abs(ref):
            raise ModesDisagree(f"S={seq}: mode {mode} computes first-step loss {loss:.6f}, {ref_mode} {ref:.6f}; "
                                "the modes do not train the same model on the same data, so no result is written")


def check_setup(values: Dict, seqs: List[int], modes: List[str], nproc: int) -> None:
    """Every (mode, sequence length) of a benchmark is valid on ``nproc`` ranks: one
    ConfigError line otherwise, before any rank starts."""
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise cfg.ConfigError(f"--modes: unknown mode(s) {', '.join(unknown)}; use {', '.join(MODES)}")
    for seq in seqs:
        for name in modes:
            try:
                cfg.sizes(_args(values, name, seq), nproc, "--nproc")
            except cfg.ConfigError as exc:  # the sequence length is --seq's here; the sizes are the config's
                raise cfg.ConfigError(str(exc).replace(f"{cfg.named('seq_length')} {seq}", f"--seq {seq}")
                                      .replace("--tsp-size", "the config's tsp_size")) from None


def _grid(values: Dict, seqs: List[int], modes: List[str], repeats: int, steps: int, warmup: int, runner,
          peak_memory: bool) -> Dict:
    """Interleaved blocks of every mode at every S: ``{seq: {mode: entry}}``."""
    results = {}
    for seq in seqs:
        blocks = {mode: [] for mode in modes}
        first_losses = {mode: [] for mode in modes}
        layer_specs: Dict[str, str] = {}
        bytes_moved, wait_profiles, timelines = {}, {}, {}
        for _ in range(repeats):
            for mode in modes:  # interleaved
                per_rank = runner(_block, values, mode, seq, steps, warmup)
                out = per_rank[0]
                blocks[mode].append(statistics.median(out["step_s"]))
                first_losses[mode].append(out["first_step_loss"])
                layer_specs[mode] = out["layer_spec"]
                bytes_moved[mode] = out["bytes_received"]
                wait_profiles[mode] = [rank["waits"] for rank in per_rank]
                timelines[mode] = [rank["timeline"] for rank in per_rank]
        check_same_loss(first_losses, seq, loss_rtol(values))
        entry = {}
        for mode in modes:
            meds = blocks[mode]
            entry[mode] = {"step_s_median": statistics.median(meds), "step_s_min": min(meds),
                           "step_s_max": max(meds), "block_medians": meds,
                           "first_step_loss": first_losses[mode][0], "layer_spec": layer_specs[mode],
                           "bytes_received_per_step": bytes_moved[mode],
                           "waits_per_rank": wait_profiles[mode], "timeline_per_rank": timelines[mode]}
            if peak_memory:
                entry[mode]["peak_gib"] = runner(_memory, values, mode, seq)[0]
        for base in REFERENCES:
            if base in entry:
                for mode in modes:
                    entry[mode][ratio_key(base)] = entry[mode]["step_s_median"] / entry[base]["step_s_median"]
        if SUBJECT in entry and NO_OVERLAP in entry:
            entry[SUBJECT]["hidden_comm_s"] = entry[NO_OVERLAP]["step_s_median"] - entry[SUBJECT]["step_s_median"]
        results[seq] = entry
    return results


def run(config_path: str, seqs: List[int], modes: List[str], repeats: int, steps: int, warmup: int,
        runner, nproc: int, link=None, rates: Optional[List] = None, hardware_dir: Optional[str] = None) -> Dict:
    """``runner(fn, *args)`` runs ``fn`` on every rank and returns the per-rank results. The
    caller checks the setup first (:func:`check_setup`, before it starts any rank).

    With ``link`` (:class:`megatron_tsp.measure.link.Link`, the ranks inside it) and
    ``rates``: the CPU is calibrated first (:func:`megatron_tsp.measure.calibrate.profile`,
    every rate included), then the grid runs at every rate, and each measured step is set
    beside the performance model's prediction from that profile (:func:`predicted`)."""
    values = cfg.load_config(config_path)
    result = {"setup": run_record(config=config_path, ranks=nproc), "repeats": repeats, "steps": steps,
              "warmup": warmup}
    if link is None:
        result["results"] = _grid(values, seqs, modes, repeats, steps, warmup, runner, peak_memory=True)
        result["crossover_seq_length"] = crossover(result["results"])
        return result
    from megatron_tsp.measure import calibrate

    result["link"] = link.describe()
    result["profile"] = profile = calibrate.profile(values, seqs, runner, link, rates, hardware_dir)
    result["links"] = {}
    for i, (name, calibrated) in enumerate(profile["links"].items()):
        link.set(calibrated["rate_mb_s_per_rank"])
        results = _grid(values, seqs, modes, repeats, steps, warmup, runner, peak_memory=i == 0)
        predicted(results, values, profile, name, nproc)
        result["links"][name] = {"rate_mb_s_per_rank": calibrated["rate_mb_s_per_rank"],
                                 "achieved_gbs": calibrated["gbs"], "results": results,
                                 "crossover_seq_length": crossover(results)}
    link.set(None)
    result["crossover_rate"] = crossover_rates(result, values)
    return result


# the benchmark's ranks have no TransformerEngine: its baselines expose their tensor-parallel traffic
SCENARIO = "no_tp_overlap"


def _hardware_at(profile: Dict, seq: int):
    """The profile with the kernel rates calibrate measured at ``seq`` (matmul and attention
    FLOP/s and the elementwise bandwidth depend on the shapes: cache, page faults), where it
    measured them."""
    from megatron_tsp.measure import perfmodel

    hw = perfmodel.Hardware(**profile)
    at = ((profile.get("measured") or {}).get("kernels_by_seq") or {}).get(str(seq))
    if not at:
        return hw
    return dataclasses.replace(hw, peak_tflops=at["matmul_flops"] / 1e12, matmul_efficiency=1.0,
                               attention_efficiency=at["attention_flops"] / at["matmul_flops"],
                               hbm_gbs=at.get("elementwise_gbs", hw.hbm_gbs))


def predicted(results: Dict, values: Dict, profile: Dict, link_name: str, nproc: int) -> None:
    """Add the performance model's step time (:data:`SCENARIO`, the profile at ``link_name``
    and at each S) and its relative error to every measured entry, and the predicted ratios
    to TP+SP."""
    from megatron_tsp.measure import perfmodel

    for seq, entry in results.items():
        hw = _hardware_at(profile, int(seq)).at_link(link_name)
        for mode, r in entry.items():
            model = perfmodel.evaluate(at_seq_length(values, int(seq)), mode, hw, nproc, DEFAULT_CP, brief=True)
            t = model[SCENARIO]
            r["predicted_step_s"] = t["step_s"]
            r["predicted_compute_s"] = t["compute_s"]
            r["model_error"] = t["step_s"] / r["step_s_median"] - 1
        if REFERENCE in entry:
            for r in entry.values():
                r[PREDICTED_VS] = r["predicted_step_s"] / entry[REFERENCE]["predicted_step_s"]


def _primitive_efficiency(profile: Dict) -> Dict[str, float]:
    """Each primitive's bandwidth over the all-gather's on the rate-limited links calibrated
    (the median over them; the unthrottled link is CPU-bound, not link-bound)."""
    links = [at for at in (profile.get("links") or {}).values()
             if at.get("rate_mb_s_per_rank") is not None and at.get("by_primitive_gbs")]
    if not links:
        return {}
    return {p: statistics.median(at["by_primitive_gbs"][p] / at["gbs"] for at in links)
            for p in links[0]["by_primitive_gbs"]}


def model_ratio(values: Dict, profile: Dict, seq: int, nproc: int, mb_s: float) -> float:
    """The model's TSP / TP+SP step time at ``seq`` with every link at ``mb_s`` MB/s per rank
    of all-gather (the other primitives in the proportion calibrated; the unthrottled link's
    latency)."""
    from megatron_tsp.measure import perfmodel

    gbs = mb_s / 1e3
    hw = dataclasses.replace(_hardware_at(profile, seq), intra_node_gbs=gbs, inter_node_gbs=gbs,
                             primitive_gbs={p: e * gbs for p, e in _primitive_efficiency(profile).items()})
    values = at_seq_length(values, seq)
    tsp, tp_sp = (perfmodel.evaluate(values, m, hw, nproc, DEFAULT_CP, brief=True)[SCENARIO]["step_s"]
                  for m in (SUBJECT, REFERENCE))
    return tsp / tp_sp


def model_crossover_rate(values: Dict, profile: Dict, seq: int, nproc: int, lo: float, hi: float) -> Optional[float]:
    """The link rate (MB/s per rank) in [lo, hi] at which the model has TSP and TP+SP equally
    fast at ``seq`` (bisection in log rate); None where one is faster throughout."""
    f_lo, f_hi = (model_ratio(values, profile, seq, nproc, r) - 1 for r in (lo, hi))
    if f_lo * f_hi > 0:
        return None
    for _ in range(30):
        mid = math.sqrt(lo * hi)
        f_mid = model_ratio(values, profile, seq, nproc, mid) - 1
        lo, hi, f_lo = (lo, mid, f_lo) if f_lo * f_mid <= 0 else (mid, hi, f_mid)
    return math.sqrt(lo * hi)


def measured_crossover_rate(points: List) -> Optional[float]:
    """Where the measured TSP / TP+SP ratio crosses 1 between two measured rates (``points``:
    (achieved MB/s, ratio); log-linear between them); None if it does not."""
    points = sorted(points)
    for (r0, q0), (r1, q1) in zip(points, points[1:]):
        if (q0 - 1) * (q1 - 1) <= 0 and q0 != q1:
            return math.exp(math.log(r0) + (1 - q0) / (q1 - q0) * (math.log(r1) - math.log(r0)))
    return None


def crossover_rates(result: Dict, values: Dict) -> Dict:
    """Per S: the link rate at which TSP and TP+SP are equally fast, measured and predicted
    (searched from a tenth of the slowest link to ten times the fastest), and on which side
    of it TSP is the faster one."""
    links = [at for at in result["links"].values() if SUBJECT in next(iter(at["results"].values()))]
    rates = [1e3 * at["achieved_gbs"] for at in links]
    out = {}
    for seq in links[0]["results"] if links else []:
        if not all(REFERENCE in at["results"][seq] for at in links):
            continue
        points = [(r, at["results"][seq][SUBJECT][VS]) for r, at in zip(rates, links)]
        lo, hi = min(rates) / 10, max(rates) * 10
        curve = [[r, model_ratio(values, result["profile"], int(seq), result["setup"]["ranks"], r)]
                 for r in (lo * (hi / lo) ** (i / 16) for i in range(17))]
        out[seq] = {"measured_mb_s": measured_crossover_rate(points), "model_curve": curve,
                    "predicted_mb_s": model_crossover_rate(values, result["profile"], int(seq),
                                                           result["setup"]["ranks"], lo, hi),
                    "tsp_faster_below": curve[0][1] < 1, "searched_mb_s": [lo, hi]}
    return out


def reprice(result: Dict, profile: Dict, values: Dict) -> None:
    """Price a measured ``--link`` grid again with the links of ``profile`` (a later
    ``calibrate`` at the same set rates), keeping the kernel rates measured in the run:
    every prediction, error and crossover is recomputed; the measurements are untouched."""
    new = {}
    for name, at in result["links"].items():
        rate = at["rate_mb_s_per_rank"]
        found = [link for link in (profile.get("links") or {}).values()
                 if (rate is None and link["rate_mb_s_per_rank"] is None)
                 or (rate is not None and link["rate_mb_s_per_rank"] is not None
                     and abs(link["rate_mb_s_per_rank"] / rate - 1) < 0.01)]
        if not found:
            raise cfg.ConfigError(f"--reprice: profile {profile.get('name')} has no link calibrated at "
                                  f"{rate or 'no limit'} MB/s per rank (link {name} of the results); "
                                  f"calibrate --link with that rate")
        new[name] = found[0]
    result["profile"] = dict(result["profile"], links=new)
    for name, at in result["links"].items():
        predicted(at["results"], values, result["profile"], name, result["setup"]["ranks"])
    result["crossover_rate"] = crossover_rates(result, values)
    result["repriced"] = {"links_from": profile.get("name"), "date": run_record()["date"]}


def crossover(results: Dict) -> Optional[int]:
    """The shortest measured length from which on TSP's median step is at most TP+SP's
    (None if TSP is slower at the longest length)."""
    seqs = [s for s in results if SUBJECT in results[s] and REFERENCE in results[s]]
    found = None
    for s in sorted(seqs, key=int, reverse=True):
        if results[s][SUBJECT]["step_s_median"] > results[s][REFERENCE]["step_s_median"]:
            break
        found = s
    return found


def _header(result: Dict) -> str:
    s = result["setup"]
    modes = {mode for at in result.get("links", {"": result}).values() for entry in at["results"].values()
             for mode in entry}
    # what differs between the modes beyond their layout (every mode runs TSP's attention op)
    unlike = [f"{mode} {MODES[mode].unlike}" for mode in sorted(modes) if MODES[mode].unlike]
    return (f"Benchmark {s['date']}: {s['config']}, {s['ranks']} rank(s) on {s['device']} ({s['backend']}), "
            f"torch {s['torch']}, megatron-core {s['megatron-core']}, commit {str(s['commit'])[:10]}; "
            f"{result['repeats']} interleaved blocks of {result['steps']} steps (after the first step, "
            f"{result['warmup']} warm-up and 1 counted step); every mode on the same attention op, "
            f"CUDA_DEVICE_MAX_CONNECTIONS {s.get('CUDA_DEVICE_MAX_CONNECTIONS') or 'unset'}"
            + "".join(f"; {u}" for u in unlike))


def _crossover_line(crossover: Optional[int]) -> str:
    return (f"TSP at least as fast as TP+SP (median) from S = {crossover} on" if crossover is not None
            else "TSP slower than TP+SP (median) at the longest length measured")


def table(result: Dict) -> str:
    if "links" in result:
        return link_table(result)
    lines = [_header(result),
             "", "| S | mode | step ms (median) | min-max of block medians | vs TP+SP | vs TP x CP | "
             "step-1 loss | MiB received/step | peak MiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for seq, entry in result["results"].items():
        for mode, r in entry.items():
            vs = " | ".join(f"{r[k]:.2f}x" if k in r else "-" for k in map(ratio_key, REFERENCES))
            lines.append(f"| {seq} | {mode} | {1e3 * r['step_s_median']:.1f} | {1e3 * r['step_s_min']:.1f}-"
                         f"{1e3 * r['step_s_max']:.1f} | {vs} | {r['first_step_loss']:.6f} | "
                         f"{r['bytes_received_per_step'] / 2**20:.2f} | {r['peak_gib'] * 1024:.1f} |")
    lines.append("\n" + _crossover_line(result["crossover_seq_length"]))
    return "\n".join(lines + _wait_lines(result["results"]))


def _wait_lines(results: Dict, label: str = "", top: int = 5) -> List[str]:
    """The longest waits of each mode's profiled step (its last block; :mod:`waits`), per rank."""
    lines = []
    for seq, entry in results.items():
        for mode, r in entry.items():
            for rank, rows in enumerate(r.get("waits_per_rank") or []):
                if not rows:
                    continue
                total = sum(row["wait_ms"] for row in rows)
                lines.append(f"\n{label}S={seq}, {mode}, rank {rank}: waits for transfers {total:.0f} ms in the "
                             "profiled step; the longest:\n\n| posted at | waited at | waits | ms |\n|---|---|---|---|")
                lines += [f"| {w['posted_at']} | {w['waited_at']} | {w['waits']} | {w['wait_ms']:.1f} |"
                          for w in rows[:top]]
    return lines


def link_table(result: Dict) -> str:
    p = result["profile"]
    lines = [_header(result), "",
             f"Link: {result['link']['topology']}. CPU profile (measured in this run): matmul "
             f"{p['peak_tflops'] * 1e3:.1f} GFLOP/s per rank, attention {p['attention_efficiency']:.2f} of it; "
             f"model scenario {SCENARIO}.", "",
             "| link | set MB/s per rank | achieved | S | mode | step ms (median) | min-max | predicted ms | "
             "model error | vs TP+SP | predicted vs TP+SP | step-1 loss | MiB received/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, at in result["links"].items():
        for seq, entry in at["results"].items():
            for mode, r in entry.items():
                vs = f"{r[VS]:.2f}x" if VS in r else "-"
                pvs = f"{r[PREDICTED_VS]:.2f}x" if PREDICTED_VS in r else "-"
                rate = "-" if at["rate_mb_s_per_rank"] is None else f"{at['rate_mb_s_per_rank']:.3g}"
                lines.append(f"| {name} | {rate} | {at['achieved_gbs'] * 1e3:.1f} | {seq} | {mode} | "
                             f"{1e3 * r['step_s_median']:.1f} | "
                             f"{1e3 * r['step_s_min']:.1f}-{1e3 * r['step_s_max']:.1f} | "
                             f"{1e3 * r['predicted_step_s']:.1f} | {r['model_error']:+.0%} | {vs} | {pvs} | "
                             f"{r['first_step_loss']:.6f} | {r['bytes_received_per_step'] / 2**20:.2f} |")
    lines.append("")
    for name, at in result["links"].items():
        lines.append(f"{name}: " + _crossover_line(at["crossover_seq_length"]))
    for seq, c in result.get("crossover_rate", {}).items():
        side = "below" if c["tsp_faster_below"] else "above"
        found = [f"{what} {c[key]:.3g} MB/s" if c[key] is not None else f"{what}: none"
                 for what, key in (("measured", "measured_mb_s"), ("model", "predicted_mb_s"))]
        lines.append(f"S={seq}: TSP and TP+SP equally fast at a link of {', '.join(found)} per rank "
                     f"(TSP faster {side} it; model searched {c['searched_mb_s'][0]:.3g}-"
                     f"{c['searched_mb_s'][1]:.3g} MB/s)")
    for name, at in result["links"].items():
        lines += _wait_lines(at["results"], f"link {name}, ")
    return "\n".join(lines)


def plot(result: Dict, path: str) -> None:
    if "links" in result:
        return link_plot(result, path)
    plt = figures.pyplot("bench")

    seqs = [int(s) for s in result["results"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    modes = list(next(iter(result["results"].values())))
    for mode in modes:
        med = [1e3 * result["results"][s][mode]["step_s_median"] for s in result["results"]]
        lo = [m - 1e3 * result["results"][s][mode]["step_s_min"] for m, s in zip(med, result["results"])]
        hi = [1e3 * result["results"][s][mode]["step_s_max"] - m for m, s in zip(med, result["results"])]
        ax1.errorbar(seqs, med, yerr=[lo, hi], marker="o", capsize=3, label=mode)
        if VS in next(iter(result["results"].values()))[mode]:
            ax2.plot(seqs, [result["results"][s][mode][VS] for s in result["results"]], marker="o", label=mode)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.legend(fontsize=8)
    ax1.set_yscale("log")
    ax1.set_ylabel("step time (ms), median and min-max")
    ax2.axhline(1.0, color="grey", lw=0.8)
    ax2.set_ylabel("step time / TP+SP")
    fig.suptitle(f"{result['setup']['config']} on {result['setup']['ranks']} ranks ({result['setup']['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def link_plot(result: Dict, path: str) -> None:
    """Left: TSP / TP+SP against the achieved link rate per S, measured (points, min-max of
    block ratios) and predicted (lines). Right: every measured step against its prediction."""
    plt = figures.pyplot("bench")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.4))
    links = sorted(result["links"].values(), key=lambda at: at["achieved_gbs"])
    rates = [1e3 * at["achieved_gbs"] for at in links]
    for i, seq in enumerate(links[0]["results"]):
        color = f"C{i}"
        at_seq = [at["results"][seq] for at in links]
        if not all(SUBJECT in e and REFERENCE in e for e in at_seq):
            continue
        ratio = [e[SUBJECT][VS] for e in at_seq]
        blocks = [[a / b for a, b in zip(e[SUBJECT]["block_medians"], e[REFERENCE]["block_medians"])] for e in at_seq]
        spread = [[r - min(b) for r, b in zip(ratio, blocks)], [max(b) - r for r, b in zip(ratio, blocks)]]
        ax1.errorbar(rates, ratio, yerr=[[max(0, x) for x in spread[0]], [max(0, x) for x in spread[1]]], fmt="o",
                     color=color, capsize=3, label=f"S={seq} measured")
        curve = result.get("crossover_rate", {}).get(seq, {}).get("model_curve") or \
            [[r, e[SUBJECT][PREDICTED_VS]] for r, e in zip(rates, at_seq)]
        ax1.plot(*zip(*curve), "-", color=color, label=f"S={seq} model")
    ax1.axhline(1.0, color="grey", lw=0.8)
    ax1.set_xscale("log")
    ax1.set_xlabel("achieved link rate per rank (MB/s, all-gather)")
    ax1.set_ylabel("TSP step time / TP+SP")
    ax1.legend(fontsize=7)
    measured, model = [], []
    for at in links:
        for entry in at["results"].values():
            for r in entry.values():
                measured.append(1e3 * r["step_s_median"])
                model.append(1e3 * r["predicted_step_s"])
    ax2.scatter(model, measured, s=12)
    lo, hi = min(measured + model), max(measured + model)
    ax2.plot([lo, hi], [lo, hi], color="grey", lw=0.8)
    ax2.fill_between([lo, hi], [0.8 * lo, 0.8 * hi], [1.2 * lo, 1.2 * hi], color="grey", alpha=0.15, label="+-20%")
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("predicted step (ms)")
    ax2.set_ylabel("measured step (ms)")
    ax2.legend(fontsize=7)
    fig.suptitle(f"{result['setup']['config']} on {result['setup']['ranks']} ranks, rate-limited link")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(result: Dict, out_dir: str, stem: str) -> List[str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, f"{stem}.{ext}") for ext in ("json", "md", "png")]
    with open(paths[0], "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    with open(paths[1], "w", encoding="utf-8") as f:
        f.write(table(result) + "\n")
    plot(result, paths[2])
    if "results" in result and SUBJECT in next(iter(result["results"].values())):
        seq = list(result["results"])[-1]
        paths.append(os.path.join(out_dir, f"{stem}-timeline.png"))
        waits.gantt(result["results"][seq][SUBJECT]["timeline_per_rank"],
                    f"{SUBJECT} at S={seq}, the profiled step of the last block, every rank", paths[-1])
    return paths
