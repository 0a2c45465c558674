"""Side-by-side benchmark of TSP, TP+SP and TP x CP training steps on the machine at hand.

Every mode trains the same model (same config, data and seed) on the same ranks (gloo on a
CPU, NCCL/RCCL under torchrun on GPUs). Modes are interleaved: repeat r runs a block of
timed steps of every mode before repeat r+1 starts, so slow drifts of a noisy machine hit
all modes alike. Reported per sequence length and mode: median step time with its spread
(min-max over blocks of their medians), TSP with its weight-stream overlap off (the
difference is the communication the overlap hides), bytes received per rank per step
(counted), peak memory of rank 0 (tracked, in a separate untimed step), and ratios to TP+SP.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Dict, List

import torch
import torch.distributed as dist

from megatron_tsp import config as cfg
from megatron_tsp.env import run_record

BENCH_MODES = ("tsp", "tsp-no-overlap", "tp-sp", "tp-cp")


def _values_for(values: Dict, mode: str, seq: int) -> Dict:
    from megatron_tsp.memory import mode_values

    v = dict(values, seq_length=seq, max_position_embeddings=seq)
    return mode_values(v, "tsp" if mode.startswith("tsp") else mode)


def _block(values: Dict, mode: str, seq: int, steps: int, warmup: int) -> Dict:
    """On every rank: build the model for ``mode`` and time ``steps`` training steps."""
    from megatron_tsp import instrument, training
    from megatron_tsp.train import batch_transform, build, initialize

    args = cfg.resolve(_values_for(values, mode, seq))
    initialize(args)
    _, model, optimizer = build(args)
    if mode == "tsp-no-overlap":
        for module in model[0].modules():
            if hasattr(module, "overlap_comm"):
                module.overlap_comm = False
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (args.micro_batch_size, seq + 1), generator=g)
    batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
             "loss_mask": torch.ones(args.micro_batch_size, seq),
             "position_ids": torch.arange(seq).unsqueeze(0).expand(args.micro_batch_size, -1).contiguous(),
             "attention_mask": None}
    transform = batch_transform(args)

    def step():
        return training.train_step(model, optimizer, [batch], 1, seq, args.micro_batch_size, transform)

    for _ in range(warmup):
        step()
    with instrument.count_collectives() as records:
        step()
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    received = sum(v for phases in instrument.totals(records).values() for v in phases.values())
    return {"step_s": times, "bytes_received": received}


def _memory(values: Dict, mode: str, seq: int) -> float:
    from megatron_tsp import memory

    return memory.measure(_values_for(values, mode, seq), "tsp" if mode.startswith("tsp") else mode)["peak_gib"]


def run(config_path: str, seqs: List[int], modes: List[str], repeats: int, steps: int, warmup: int,
        runner, nproc: int) -> Dict:
    """``runner(fn, *args)`` runs ``fn`` on every rank and returns the per-rank results."""
    values = cfg.load_config(config_path)
    result = {"setup": run_record(config=config_path, ranks=nproc), "repeats": repeats, "steps": steps,
              "warmup": warmup, "results": {}}
    for seq in seqs:
        blocks = {mode: [] for mode in modes}
        bytes_moved = {}
        for _ in range(repeats):
            for mode in modes:  # interleaved
                out = runner(_block, values, mode, seq, steps, warmup)[0]
                blocks[mode].append(statistics.median(out["step_s"]))
                bytes_moved[mode] = out["bytes_received"]
        entry = {}
        for mode in modes:
            meds = blocks[mode]
            entry[mode] = {"step_s_median": statistics.median(meds), "step_s_min": min(meds),
                           "step_s_max": max(meds), "block_medians": meds,
                           "bytes_received_per_step": bytes_moved[mode],
                           "peak_gib": runner(_memory, values, mode, seq)[0]}
        base = entry.get("tp-sp")
        for mode in modes:
            if base:
                entry[mode]["vs_tp_sp"] = entry[mode]["step_s_median"] / base["step_s_median"]
        if "tsp" in entry and "tsp-no-overlap" in entry:
            entry["tsp"]["hidden_comm_s"] = entry["tsp-no-overlap"]["step_s_median"] - entry["tsp"]["step_s_median"]
        result["results"][seq] = entry
    tsp_wins = [s for s in seqs if "tsp" in result["results"][s] and "tp-sp" in result["results"][s]
                and result["results"][s]["tsp"]["step_s_median"] < result["results"][s]["tp-sp"]["step_s_median"]]
    result["crossover_seq_length"] = tsp_wins[0] if tsp_wins else None
    return result


def table(result: Dict) -> str:
    s = result["setup"]
    lines = [f"Benchmark {s['date']}: {s['config']}, {s['ranks']} rank(s) on {s['device']} ({s['backend']}), "
             f"torch {s['torch']}, megatron-core {s['megatron-core']}, commit {str(s['commit'])[:10]}; "
             f"{result['repeats']} interleaved blocks of {result['steps']} steps (after {result['warmup']} warm-up)",
             "", "| S | mode | step ms (median) | min-max of block medians | vs TP+SP | MiB received/step | peak MiB |",
             "|---|---|---|---|---|---|---|"]
    for seq, entry in result["results"].items():
        for mode, r in entry.items():
            vs = f"{r['vs_tp_sp']:.2f}x" if "vs_tp_sp" in r else "-"
            lines.append(f"| {seq} | {mode} | {1e3 * r['step_s_median']:.1f} | {1e3 * r['step_s_min']:.1f}-"
                         f"{1e3 * r['step_s_max']:.1f} | {vs} | {r['bytes_received_per_step'] / 2**20:.2f} | "
                         f"{r['peak_gib'] * 1024:.1f} |")
    lines.append(f"\nTSP faster than TP+SP from S = {result['crossover_seq_length']} (None: not in this sweep)")
    return "\n".join(lines)


def plot(result: Dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seqs = [int(s) for s in result["results"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    modes = list(next(iter(result["results"].values())))
    for mode in modes:
        med = [1e3 * result["results"][s][mode]["step_s_median"] for s in result["results"]]
        lo = [m - 1e3 * result["results"][s][mode]["step_s_min"] for m, s in zip(med, result["results"])]
        hi = [1e3 * result["results"][s][mode]["step_s_max"] - m for m, s in zip(med, result["results"])]
        ax1.errorbar(seqs, med, yerr=[lo, hi], marker="o", capsize=3, label=mode)
        if "vs_tp_sp" in next(iter(result["results"].values()))[mode]:
            ax2.plot(seqs, [result["results"][s][mode]["vs_tp_sp"] for s in result["results"]], marker="o", label=mode)
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


def write(result: Dict, out_dir: str, stem: str) -> List[str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, f"{stem}.{ext}") for ext in ("json", "md", "png")]
    with open(paths[0], "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    with open(paths[1], "w", encoding="utf-8") as f:
        f.write(table(result) + "\n")
    plot(result, paths[2])
    return paths
