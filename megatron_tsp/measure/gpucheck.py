"""One-GPU check: rank 0 of a D=8 job on real kernels, against the memory planner.

Runs one rank of the 7B / 128K configuration per mode on this machine's GPU with torch's
``fake`` process-group backend (collectives are no-ops, every kernel is real): peak
``torch.cuda.max_memory_allocated`` of a training step against the planner's prediction
for the same rank, and the per-rank compute time of TSP against TP+SP (no communication
is timed: that is the performance model's part). Writes one JSON file.

    python -m megatron_tsp.measure.gpucheck --out bench/results/gpu-check.json     (scripts/gpu_check.sh)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Dict

import torch

from megatron_tsp.core.parallel_state import destroy_model_parallel
from megatron_tsp.env import run_record
from megatron_tsp.measure import memory
from megatron_tsp.run import config as cfg
from megatron_tsp.run.build import initialize, stepper
from megatron_tsp.run.modes import get_mode


def check_mode(values: Dict, mode: str, steps: int) -> Dict:
    planned = memory.plan(dict(values), mode)
    args = get_mode(mode).args(values)
    on_gpu = torch.cuda.is_available()
    with memory.fake_world(cfg.model_parallel_size(args)):
        initialize(args, create_gloo_process_groups=False)
        try:
            step = stepper(args, get_mode(mode), clip_grad=0.0, use_gloo_process_groups=False,
                           transformer_engine=False)
            step()  # warm-up; also creates Adam's moments
            if on_gpu:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                step()
                if on_gpu:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            peak = torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None
        finally:
            destroy_model_parallel()
    return {"parallel": planned["parallel"], "measured_peak_gib": peak, "planned_peak_gib": planned["peak_gib"],
            "planned_by_category_gib": planned["by_category_gib"], "step_s": times,
            "compute_s_median": sorted(times)[len(times) // 2], "flops_per_rank": planned["flops_per_rank"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                        "configs", "7b", "128k-tsp8.yaml"))
    parser.add_argument("--modes", default="tsp,tp-sp,tp-cp")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default="bench/results/gpu-check.json")
    cfg.add_arguments(parser, keys=["num_layers", "seq_length", "max_position_embeddings"])
    ns = parser.parse_args(argv)
    values = cfg.load_config(ns.config)
    values.update(cfg.overrides(ns))
    result = {"setup": run_record(), "config": ns.config, "overrides": cfg.overrides(ns), "modes": {}}
    for mode in ns.modes.split(","):
        result["modes"][mode] = r = check_mode(values, mode, ns.steps)
        print(f"{mode}: compute {r['compute_s_median']:.3f} s/step, peak measured {r['measured_peak_gib']} GiB, "
              f"planned {r['planned_peak_gib']:.2f} GiB", flush=True)
    if "tsp" in result["modes"] and "tp-sp" in result["modes"]:
        result["tsp_vs_tp_sp_compute"] = (result["modes"]["tsp"]["compute_s_median"]
                                          / result["modes"]["tp-sp"]["compute_s_median"])
    os.makedirs(os.path.dirname(os.path.abspath(ns.out)), exist_ok=True)
    with open(ns.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    print("wrote", ns.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
