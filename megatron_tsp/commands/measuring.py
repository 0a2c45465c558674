"""The subcommands that plan, predict and measure jobs: memory, predict, plan, bench, calibrate,
gpu-check, compare."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

from megatron_tsp.commands.shared import (
    CONFIGS,
    NON_NEGATIVE_INT,
    POSITIVE_FLOAT,
    POSITIVE_INT,
    check_outputs,
    cluster_flags,
    config_flags,
    fused_norm_flag,
    int_list,
    name_list,
    runnable_modes,
    write_file,
    write_json,
)
from megatron_tsp.core.sizes import DEFAULT_CP
from megatron_tsp.errors import ConfigError, UserError


# ---- memory -------------------------------------------------------------------------------------
def _memory_parser(sub, common) -> None:
    p = sub.add_parser(
        "memory", parents=[common], help="peak memory per category of one rank at full size (FakeTensorMode, no GPU)",
        description="One training step of rank 0 of the configured job under FakeTensorMode with "
                    "the fake process-group backend, for each mode at the same model-parallel "
                    "size, global shapes and recompute setting.")
    p.add_argument("config", help="YAML config")
    p.add_argument("--modes", type=name_list, default="tsp,tp,tp-sp,tp-sp-ring,tp-cp", help="comma-separated modes")
    p.add_argument("--cp", type=POSITIVE_INT, default=DEFAULT_CP, help="context-parallel size of the tp-cp mode")
    p.add_argument("--world-size", type=POSITIVE_INT, default=None,
                   help="ranks of the job (default: the model-parallel size, one replica)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="write a stacked bar chart (PNG) here")
    p.add_argument("--per-layer", action="store_true",
                   help="list every tensor layer 0 keeps for backward, and the analytic formula")
    p.add_argument("--largest", type=NON_NEGATIVE_INT, default=0, metavar="N",
                   help="list the N largest storages alive at each mode's peak (what sets it)")
    p.add_argument("--bytes-by-op", action="store_true",
                   help="memory-bound bytes one layer adds, op by op, on the slowest rank (plans 2 and 3 layers)")
    p.add_argument("--launches", action="store_true",
                   help="kernel launches one layer adds, op by op, on the slowest rank (the same plans)")
    fused_norm_flag(p)
    config_flags(p, ["num_layers", "seq_length", "max_position_embeddings", "micro_batch_size",
                      "recompute_granularity", "tsp_head_groups_per_call", "tsp_mlp_shards_per_call"])
    p.set_defaults(func=_cmd_memory)


def _cmd_memory(ns: argparse.Namespace) -> int:
    from megatron_tsp.measure import figures, memory
    from megatron_tsp.run import config

    check_outputs(json=ns.json, plot=ns.plot)
    if ns.plot:
        figures.pyplot("--plot")
    runnable_modes(ns, "memory")
    result = memory.plan_modes(ns.config, ns.modes, world_size=ns.world_size, cp=ns.cp,
                               overrides=config.overrides(ns), per_layer=ns.per_layer, fused_norm=ns.fused_norm,
                               largest=ns.largest, by_op=ns.bytes_by_op or ns.launches)
    print(memory.table(result))
    if ns.bytes_by_op:
        print(memory.bytes_by_op_table(result))
    if ns.launches:
        print(memory.launches_table(result))
    if ns.largest:
        print(memory.largest_table(result))
    if ns.per_layer:
        print(memory.per_layer_table(result))
    if ns.json:
        write_json(ns.json, result)
    if ns.plot:
        memory.plot(result, ns.plot)
    return 0


# ---- predict ------------------------------------------------------------------------------------
def _predict_parser(sub, common) -> None:
    p = sub.add_parser(
        "predict", parents=[common], help="step time and tokens/s from counted FLOPs and bytes on a hardware profile",
        description="Counts FLOPs and collective bytes of the real model with the memory planner "
                    "(2 and 3 layers, extrapolated) and times them on a hardware profile.")
    cluster_flags(p, modes="tsp,tp,tp-sp,tp-sp-ring,tp-cp")
    p.add_argument("--sweep", type=int_list, default=None,
                   help="comma-separated sequence lengths for the TSP / TP+SP crossover")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--link", default=None, help="a calibrated link of a CPU profile (megatron-tsp calibrate), by name")
    config_flags(p, ["micro_batch_size", "recompute_granularity", "tsp_head_groups_per_call",
                     "tsp_mlp_shards_per_call"])
    p.set_defaults(func=_cmd_predict)


def _cmd_predict(ns: argparse.Namespace) -> int:
    from megatron_tsp.measure import perfmodel
    from megatron_tsp.run import config

    check_outputs(json=ns.json)
    hw = perfmodel.load_hardware(ns.hardware)
    if ns.link:
        hw = hw.at_link(ns.link)
    runnable_modes(ns, "predict")
    result = perfmodel.predict(ns.config, hw, ns.nodes, ns.modes, ns.cp, ns.sweep, config.overrides(ns),
                               fused_norm=ns.fused_norm)
    print(perfmodel.table(result))
    if ns.json:
        write_json(ns.json, result)
    return 0


# ---- plan ---------------------------------------------------------------------------------------
def _plan_parser(sub, common) -> None:
    p = sub.add_parser(
        "plan", parents=[common], help="longest context that fits and fastest recompute setting per mode on a GPU",
        description="Per mode: the longest sequence length that fits in the GPU's memory (bisection on the "
                    "memory planner) and, at the config's length, every recompute choice with peak memory, "
                    "whether it fits and tokens/s from the performance model.")
    cluster_flags(p, modes="tsp,tp-sp,tp-sp-ring,tp-cp")
    p.add_argument("--scenario", default="overlap", help="performance-model scenario: overlap, no_tp_overlap, "
                                                          "no_overlap")
    p.add_argument("--grid", type=int_list, default=None,
                   help="comma-separated sequence lengths for the picture (every choice at each)")
    p.add_argument("--out", help="write OUT.json, OUT.md and (with --grid) OUT.png")
    config_flags(p, ["micro_batch_size", "seq_length", "tsp_head_groups_per_call", "tsp_mlp_shards_per_call"])
    p.set_defaults(func=_cmd_plan)


def _cmd_plan(ns: argparse.Namespace) -> int:
    from megatron_tsp.measure import figures, perfmodel, plan
    from megatron_tsp.run import config

    if ns.out:
        check_outputs(out=ns.out + ".json")
    if ns.out and ns.grid:
        figures.pyplot("--grid")
    hw = perfmodel.load_hardware(ns.hardware)
    runnable_modes(ns, "plan")
    started = time.monotonic()

    def progress(line: str) -> None:
        print(f"megatron-tsp plan: [{time.monotonic() - started:5.0f} s] {line}", file=sys.stderr, flush=True)

    result = plan.plan(ns.config, hw, ns.nodes, ns.modes, ns.cp, ns.scenario, ns.grid, config.overrides(ns),
                       fused_norm=ns.fused_norm, progress=progress)
    text = plan.table(result)
    if ns.out:
        write_json(ns.out + ".json", result)
        write_file(ns.out + ".md", text + "\n", "--out")
        if ns.grid:
            plan.plot(result, ns.out + ".png")
    print(text)
    return 0


# ---- bench and calibrate -------------------------------------------------------------------------
def _link_rates(text: str) -> list:
    from megatron_tsp.measure.link import parse_rates

    try:
        return parse_rates(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _link_flags(p, required: bool) -> None:
    p.add_argument("--link", type=_link_rates, default=None, required=required,
                   help="comma-separated link rates per rank: MB/s, 'none' (unthrottled), or the compute-to-bandwidth "
                        "ratio of h100-nvlink, h200-nvlink, mi300x-xgmi or ib-400g on this CPU; the ranks run in a "
                        "private network namespace whose loopback is rate-limited (root or a user namespace)")
    p.add_argument("--nproc", type=POSITIVE_INT, default=2, help="ranks to start without torchrun")
    p.add_argument("--timeout-s", type=POSITIVE_FLOAT, default=1800.0,
                   help="deadline of each call to the ranks (a bench block, a calibration)")


@contextlib.contextmanager
def _link_deadline(link, timeout_s: float):
    """A deadline missed over the rate-limited link names both flags that set it."""
    from megatron_tsp.run import launch

    try:
        yield
    except launch.PoolTimeout as exc:
        if link is None:
            raise
        raise launch.PoolTimeout(f"{exc} (--link {link.rate or 'none'} MB/s per rank: give it more --timeout-s than "
                                 f"{timeout_s:g}, or --link a higher rate)") from None


def _bench_parser(sub, common) -> None:
    p = sub.add_parser(
        "bench", parents=[common], help="time TSP, TP+SP and TP x CP training steps side by side on this machine",
        description="Interleaved blocks of timed training steps of every mode on the same ranks; "
                    "writes JSON, a markdown table and a PNG. With --link: at each link rate, beside "
                    "the performance model's prediction from a CPU profile calibrated in the same run.")
    p.add_argument("config", nargs="?", help="YAML config (default: configs/bench-cpu.yaml)")
    p.add_argument("--seq", type=int_list, default="256,1024,4096", help="comma-separated sequence lengths")
    p.add_argument("--modes", type=name_list, default="tsp,tsp-no-overlap,tp-sp,tp-sp-ring,tp-cp",
                   help="comma-separated modes")
    p.add_argument("--repeats", type=POSITIVE_INT, default=3, help="interleaved blocks per mode")
    p.add_argument("--steps", type=POSITIVE_INT, default=3, help="timed steps per block")
    p.add_argument("--warmup", type=NON_NEGATIVE_INT, default=1, help="untimed steps per block")
    _link_flags(p, required=False)
    p.add_argument("--out", default="bench/results", help="output folder")
    p.add_argument("--name", default="bench-cpu", help="file stem of the results")
    p.add_argument("--reprice", metavar="RESULT_JSON", help="run nothing: price the measured --link grid of "
                   "RESULT_JSON again with the links of --hardware (calibrated at the same rates), rewrite its files")
    p.add_argument("--hardware", help="with --reprice: the calibrated profile (megatron-tsp calibrate)")
    p.set_defaults(func=_cmd_bench)


def _reprice(ns: argparse.Namespace) -> int:
    from megatron_tsp.measure import bench, perfmodel
    from megatron_tsp.run import config, preflight

    if not ns.hardware:
        raise ConfigError("--reprice needs --hardware PROFILE.yaml (written by megatron-tsp calibrate --link ...)")
    try:
        with open(ns.reprice, encoding="utf-8") as f:
            result = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--reprice {ns.reprice}: cannot read a bench result ({exc})") from None
    foreign = ConfigError(f"--reprice {ns.reprice}: not a bench --link result")
    if not isinstance(result, dict) or "links" not in result or not isinstance(result.get("setup"), dict):
        raise foreign
    folder = os.path.dirname(ns.reprice) or "."
    preflight.check_writable_dir(folder, "--reprice (its folder receives the repriced files)")
    perfmodel.load_hardware(ns.hardware)  # one line for a bad profile
    path = str(result["setup"].get("config"))  # as the run named it: in another checkout, this one's configs/
    values = config.load_config(path if os.path.exists(path) else os.path.join(CONFIGS, os.path.basename(path)))
    try:
        bench.reprice(result, config.read_yaml(ns.hardware), values)
    except (KeyError, TypeError, AttributeError):  # the keys of a bench result, not all there
        raise foreign from None
    print(bench.table(result))
    stem = os.path.splitext(os.path.basename(ns.reprice))[0]
    print("wrote", ", ".join(bench.write(result, folder, stem)))
    return 0


@contextlib.contextmanager
def _on_link(ns: argparse.Namespace, world: int):
    """The private, rate-limited network namespace of ``--link`` (nothing without it), entered
    before the ranks' fork server starts, so that the ranks live in it."""
    from megatron_tsp.run import launch

    if ns.link is None:
        launch.start_importing()
        yield None
        return
    if launch.under_torchrun():
        raise ConfigError("--link limits the local ranks' loopback; it does not apply under torchrun (drop --link)")
    from megatron_tsp.measure.link import Link

    # c10d cannot name a loopback peer in the new namespace and warns on every connection
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    with Link(world) as link:
        launch.start_importing()
        yield link


def _cmd_bench(ns: argparse.Namespace) -> int:
    from megatron_tsp.run import launch

    if ns.reprice:
        return _reprice(ns)

    world = int(os.environ["WORLD_SIZE"]) if launch.under_torchrun() else ns.nproc
    with _on_link(ns, world) as link:
        from megatron_tsp.measure import bench, figures
        from megatron_tsp.run import config, preflight

        path = ns.config or os.path.join(CONFIGS, "bench-cpu.yaml")
        bench.check_setup(config.load_config(path), ns.seq, ns.modes, world)  # before any rank starts
        figures.pyplot("bench")
        preflight.check_writable_dir(ns.out, "--out")
        with _link_deadline(link, ns.timeout_s), launch.job(ns.nproc, timeout_s=ns.timeout_s) as job:
            result = bench.run(path, ns.seq, ns.modes, ns.repeats, ns.steps, ns.warmup, job.run, job.world_size,
                               link, ns.link, os.path.join(CONFIGS, "hardware"))
            if job.rank != 0:
                return 0
    print(bench.table(result))
    print("wrote", ", ".join(bench.write(result, ns.out, ns.name)))
    return 0


def _calibrate_parser(sub, common) -> None:
    p = sub.add_parser(
        "calibrate", parents=[common], help="measure this CPU's hardware profile for predict (FLOP/s, link rates)",
        description="On the local ranks at once: matmul and attention FLOP/s at the config's shapes, and "
                    "the all-gather bandwidth and latency at each --link rate. Writes a hardware profile "
                    "that predict and plan read (predict --link NAME picks a calibrated link).")
    p.add_argument("config", nargs="?", help="YAML config whose shapes to measure (default: configs/bench-cpu.yaml)")
    p.add_argument("--seq", type=int_list, default="2048,4096,8192", help="comma-separated sequence lengths")
    _link_flags(p, required=False)
    p.add_argument("--out", default=None, help="profile to write (default: configs/hardware/cpu-<host>.yaml)")
    p.set_defaults(func=_cmd_calibrate)


def _cmd_calibrate(ns: argparse.Namespace) -> int:
    import platform

    import yaml

    from megatron_tsp.run import launch

    if launch.under_torchrun():
        raise ConfigError("calibrate measures the local CPU ranks; run it without torchrun")
    out = ns.out or os.path.join(CONFIGS, "hardware", f"cpu-{platform.node() or 'host'}.yaml")
    ns.link = ns.link or ["none"]
    with _on_link(ns, ns.nproc) as link:
        from megatron_tsp.env import run_record
        from megatron_tsp.measure import bench, calibrate
        from megatron_tsp.run import config, modes

        path = ns.config or os.path.join(CONFIGS, "bench-cpu.yaml")
        values = config.load_config(path)
        bench.check_setup(values, ns.seq, [modes.SUBJECT], ns.nproc)  # a rank's heads and tokens divide evenly
        calibrate.check_memory(values, ns.seq, ns.nproc)
        with _link_deadline(link, ns.timeout_s), launch.job(ns.nproc, timeout_s=ns.timeout_s) as job:
            profile = calibrate.profile(values, ns.seq, job.run, link, ns.link, os.path.join(CONFIGS, "hardware"))
    profile["measured"]["setup"] = run_record(config=path, ranks=ns.nproc)
    profile = json.loads(json.dumps(profile, default=str))  # plain types for YAML (versions are str subclasses)
    write_file(out, f"# megatron-tsp calibrate {' '.join(sys.argv[2:])}\n" + yaml.safe_dump(profile, sort_keys=False),
           "--out")
    print(f"{profile['name']}: matmul {profile['peak_tflops'] * 1e3:.1f} GFLOP/s per rank, attention "
          f"{profile['attention_efficiency']:.2f} of it")
    for name, cal in profile["links"].items():
        print(f"  link {name}: {cal['gbs'] * 1e3:.1f} MB/s received per rank, {cal['latency_us']:.0f} us per call")
    print("wrote", out)
    return 0


# ---- gpu-check ----------------------------------------------------------------------------------
def _gpu_check_parser(sub, common) -> None:
    p = sub.add_parser(
        "gpu-check", parents=[common], help="attention backends and one rank of a D=8 job per mode on this GPU",
        description="What one GPU shows: what each attention backend resolves to and whether its check "
                    "passes, every backend against the math reference and timed at 8K-128K, packed documents "
                    "against math, then one rank of the config's job per mode with the fake process group (real "
                    "kernels, no-op collectives): peak memory against the planner and compute per step. "
                    "Results, warnings and library versions are written as they come.")
    p.add_argument("--config", default=None, help="YAML config (default: configs/7b/128k-tsp8.yaml)")
    p.add_argument("--modes", type=name_list, default="tsp,tp-sp,tp-sp-ring,tp-cp", help="comma-separated modes")
    p.add_argument("--steps", type=POSITIVE_INT, default=2, help="timed steps per mode (after one warm-up)")
    p.add_argument("--budget-s", type=POSITIVE_FLOAT, default=420.0,
                   help="time budget: what does not fit is recorded as skipped")
    p.add_argument("--parts", type=name_list, default="gemm,checks,documents,backends,modes",
                   help="comma-separated parts to run: gemm, checks, documents, backends, modes; profile: one more "
                        "step per mode under torch's profiler, its top kernels and kernel launches recorded")
    p.add_argument("--rank", type=NON_NEGATIVE_INT, default=0,
                   help="the rank of the job that the modes part runs (TSP's ranks attend different blocks)")
    p.add_argument("--attention-backend", default="auto",
                   help="the attention kernel of every mode's step: auto (on a GPU cuDNN from 16K keys, else "
                        "flash), flash, cudnn, efficient, flash_attn")
    p.add_argument("--out", default="bench/results/gpu-check.json", help="results file (JSON)")
    config_flags(p, ["num_layers", "seq_length", "max_position_embeddings", "micro_batch_size",
                      "tsp_head_groups_per_call", "tsp_mlp_shards_per_call"])
    p.set_defaults(func=_cmd_gpu_check)


def _cmd_gpu_check(ns: argparse.Namespace) -> int:
    from megatron_tsp.device import Device
    from megatron_tsp.measure import gpucheck
    from megatron_tsp.run import config

    path = ns.config or os.path.join(CONFIGS, "7b", "128k-tsp8.yaml")
    if ns.config is None and not Device.from_launch().is_gpu:
        raise UserError("gpu-check: no GPU here, and its default 7B/128K job would run for hours on the CPU; "
                        "run it on a GPU, or rehearse with --config configs/tiny-cpu.yaml")
    from megatron_tsp.core.attention_kernels import BACKENDS

    if ns.attention_backend not in BACKENDS:
        raise UserError(f"--attention-backend {ns.attention_backend}: choose from {', '.join(BACKENDS)}")
    unknown = sorted(set(ns.parts) - set(gpucheck.PARTS))
    if unknown:
        raise UserError(f"--parts: unknown part {unknown[0]!r}; choose from {', '.join(gpucheck.PARTS)}")
    world = config.sizes(config.resolve(dict(config.load_config(path), **config.overrides(ns)))).world_size
    if ns.rank >= world:  # a line now, for a bad config or rank, rather than an error per mode
        raise UserError(f"--rank {ns.rank}: the job has {world} ranks (0-{world - 1})")
    write_file(ns.out, "", "--out")  # and for an output that cannot be written, before any work
    result = gpucheck.run(ns.out, path, ns.modes, ns.steps, config.overrides(ns), ns.budget_s, parts=ns.parts,
                          attention_backend=ns.attention_backend, rank=ns.rank)
    print(gpucheck.summary(result))
    markdown = os.path.splitext(ns.out)[0] + ".md"
    write_file(markdown, gpucheck.table(result) + "\n", "--out")
    print("wrote", ns.out, "and", markdown)
    return 0


# ---- compare ------------------------------------------------------------------------------------
def _compare_parser(sub, common) -> None:
    p = sub.add_parser("compare", parents=[common],
                       help="table of several runs' iteration logs (JSON lines or Megatron text)")
    p.add_argument("runs", nargs="+", help="log files or run directories")
    p.add_argument("--warmup", type=NON_NEGATIVE_INT, default=2, help="iterations left out of the timing")
    p.add_argument("--markdown", help="write the table here")
    p.add_argument("--json", help="write the summaries here")
    p.set_defaults(func=_cmd_compare)


def _cmd_compare(ns: argparse.Namespace) -> int:
    from megatron_tsp.measure import compare

    check_outputs(markdown=ns.markdown, json=ns.json)
    runs = {name: compare.summarize(records, ns.warmup)
            for p in ns.runs for name, records in compare.read_runs(os.path.relpath(p)).items()}
    text = compare.table(runs)
    if ns.markdown:
        write_file(ns.markdown, text + "\n", "--markdown")
    if ns.json:
        write_json(ns.json, runs)
    print(text)
    return 0


PARSERS = (_memory_parser, _predict_parser, _plan_parser, _bench_parser, _calibrate_parser, _gpu_check_parser,
           _compare_parser)
