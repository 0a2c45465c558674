"""The ``megatron-tsp`` command: one parser function and one function per subcommand.

A mistake gets one line (``megatron-tsp COMMAND: error: ...``) and a non-zero exit: 2 for a bad
configuration or argument, 1 for anything else that stops the command (data files,
checkpoints, a failure while running), 130 for Ctrl-C. A failed rank's traceback goes to
``error.log`` beside the run's log; ``--debug`` prints tracebacks instead. Where ranks run
(torchrun, or local workers) is :func:`megatron_tsp.run.launch.job`'s decision.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shlex
import signal
import sys
import time
import traceback
from typing import Dict, List, Optional

from megatron_tsp.core.sizes import DEFAULT_CP
from megatron_tsp.env import quiet_import_noise
from megatron_tsp.errors import ConfigError, UserError

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def default_config_path() -> str:
    """configs/tiny-cpu.yaml of the checkout this package runs from."""
    return os.path.join(CONFIGS, "tiny-cpu.yaml")


# ---- argument types and shared arguments ---------------------------------------------------------
def _number(kind: type, low: float, what: str):
    """An argparse type: a ``kind`` number >= ``low`` (one usage line otherwise)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not value >= low:  # also refuses NaN
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value
    return parse


POSITIVE_INT = _number(int, 1, "a positive integer")
NON_NEGATIVE_INT = _number(int, 0, "an integer >= 0")
POSITIVE_FLOAT = _number(float, 1e-300, "a positive number")


def _name_list(text: str) -> List[str]:
    """Comma-separated names (modes), at least one."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names nothing; give a comma-separated list")
    return names


def _int_list(text: str) -> List[int]:
    """Comma-separated positive integers (sequence lengths), at least one."""
    return [POSITIVE_INT(x) for x in _name_list(text)]


def _config_flags(parser: argparse.ArgumentParser, keys=None) -> None:
    from megatron_tsp.run import config

    config.add_arguments(parser, keys)


def _fused_norm_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fused-norm", action=argparse.BooleanOptionalAction, default=True,
                        help="plan norms that keep their input and per-token statistics (TransformerEngine, apex, "
                             "TSP's RMSNorm; default), or torch's RMSNorm with fp32 weights, which keeps fp32 copies "
                             "(--no-fused-norm: megatron-core's torch fallback)")


def _cluster_flags(parser: argparse.ArgumentParser, modes: str) -> None:
    """CONFIG, the GPU profile, the job's size and the modes to compare (predict, plan)."""
    parser.add_argument("config", help="YAML config")
    parser.add_argument("--hardware", required=True, help="configs/hardware/<name>.yaml")
    parser.add_argument("--nodes", type=POSITIVE_INT, default=1, help="nodes of the job")
    parser.add_argument("--modes", type=_name_list, default=modes, help="comma-separated modes")
    parser.add_argument("--cp", type=POSITIVE_INT, default=DEFAULT_CP, help="context-parallel size of tp-cp")
    _fused_norm_flag(parser)


def _runnable_modes(ns: argparse.Namespace, command: str) -> None:
    """Drop from ``ns.modes`` those the config's model cannot run, each said in a line; one
    ConfigError line where none is left."""
    from megatron_tsp.run import config, modes

    values = config.load_config(ns.config)
    values.update(config.overrides(ns))
    ns.modes, skipped = modes.runnable(values, ns.modes, ns.cp)
    if not ns.modes:
        raise ConfigError(skipped[0])
    for line in skipped:
        print(f"megatron-tsp {command}: note: {line}", file=sys.stderr, flush=True)


def _resolve(ns: argparse.Namespace):
    from megatron_tsp.run import config

    path = ns.config or default_config_path()
    values = config.load_config(path)
    values.update(config.overrides(ns))
    return path, values, config.resolve(values)


def _write(path: str, text: str, flag: str) -> None:
    """Write a result file (creating its folder); one line if that is impossible."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as exc:
        raise UserError(f"{flag} {path}: cannot be written ({exc.strerror or exc})") from None


def _check_outputs(**paths: Optional[str]) -> None:
    """Every result file a command was asked for can be written: checked before the work."""
    from megatron_tsp.run import preflight

    for flag, path in paths.items():
        if path:
            preflight.check_writable_file(path, "--" + flag.replace("_", "-"))


def _write_json(path: str, obj) -> None:
    _write(path, json.dumps(obj, indent=2, default=str), "--json")


# ---- env ----------------------------------------------------------------------------------------
def _env_parser(sub, common) -> None:
    p = sub.add_parser("env", parents=[common], help="versions of torch/megatron-core/TE/apex, device and backend")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_env)


def _cmd_env(ns: argparse.Namespace) -> int:
    from megatron_tsp.env import environment

    info = environment()
    if ns.json:
        print(json.dumps(info, indent=2))
        return 0
    width = max(len(k) for k in info)
    for key, value in info.items():
        shown = {None: "not installed", True: "yes", False: "no"}.get(value, value)
        print(f"{key:<{width}}  {shown}")
    return 0


# ---- args ---------------------------------------------------------------------------------------
def _args_parser(sub, common) -> None:
    p = sub.add_parser("args", parents=[common], help="render a config as Megatron-LM command-line flags")
    p.add_argument("config", help="YAML config (keys are Megatron-LM argument names)")
    _config_flags(p)
    p.set_defaults(func=_cmd_args)


def _cmd_args(ns: argparse.Namespace) -> int:
    from megatron_tsp.run import config

    _, values, _ = _resolve(ns)
    print(" ".join(shlex.quote(flag) for flag in config.to_megatron_flags(values)))
    return 0


# ---- train --------------------------------------------------------------------------------------
def _train_parser(sub, common) -> None:
    p = sub.add_parser(
        "train", parents=[common], help="train GPT with TSP (or a TP baseline) on megatron-core",
        description="Train GPT on megatron-core. CONFIG defaults to configs/tiny-cpu.yaml; "
                    "Megatron-style flags override its keys. Under torchrun every rank runs "
                    "here; otherwise --nproc ranks are started on this machine (one per GPU, or gloo on the CPU).")
    p.add_argument("config", nargs="?", help="YAML config (default: configs/tiny-cpu.yaml)")
    p.add_argument("--nproc", type=POSITIVE_INT, default=None,
                   help="ranks to start without torchrun (default: the model-parallel size)")
    p.add_argument("--log-json", default=None, help="JSON-lines log (default: runs/<config>/log.jsonl)")
    p.add_argument("--timeout-s", type=POSITIVE_FLOAT, default=6 * 3600.0, help="wall-clock limit of a started job")
    p.add_argument("--collective-timeout-min", type=POSITIVE_FLOAT, default=10.0, help="timeout of every collective")
    _config_flags(p)
    p.set_defaults(func=_cmd_train)


def _train_rank(args, log_path, collective_timeout_min):
    from megatron_tsp.run.launch import rank_device
    from megatron_tsp.run.loop import train

    return train(args, rank_device(), log_path, collective_timeout_min)


def rank_environment(args) -> Dict[str, str]:
    """What a training job's ranks get where the user set nothing: the mode's
    ``CUDA_DEVICE_MAX_CONNECTIONS`` (:class:`megatron_tsp.run.modes.Mode`)."""
    from megatron_tsp.run import modes

    return modes.of(args).environment()


def _cmd_train(ns: argparse.Namespace) -> int:
    from megatron_tsp.run import launch

    path, _, args = _resolve(ns)  # a bad config is one line before anything is started or imported
    launch.start_importing()
    from megatron_tsp.run import checkpointing, config, data, preflight

    if not args.exit_signal_handler:
        launch.terminate_on_sigterm()  # main noted SIGTERM until the config said what it means
    log_path = ns.log_json or os.path.join("runs", os.path.splitext(os.path.basename(path))[0], "log.jsonl")
    preflight.check_writable_file(log_path, "--log-json")
    nproc = ns.nproc or config.sizes(args).model_parallel
    with contextlib.ExitStack() as stack:
        job = stack.enter_context(launch.job(nproc, ns.collective_timeout_min, ns.timeout_s,
                                             forward_sigterm=args.exit_signal_handler,
                                             environ=rank_environment(args)))
        if not args.mock_data:
            job.on_rank0(data.ensure_corpus, args.data_path)
        resume = preflight.check_run(args, job.world_size)
        if args.save:
            job.on_rank0(lambda: stack.enter_context(checkpointing.SaveLock(args.save)))
        if resume is not None and resume >= args.train_iters:
            if job.rank == 0:
                print(f"megatron-tsp train: the checkpoint in {args.load} is at iteration {resume} and --train-iters "
                      f"is {args.train_iters}: the run is complete, nothing to do (raise --train-iters to train on)",
                      flush=True)
            return 0
        if job.rank == 0:
            print(f"megatron-tsp train: {path}, {job.world_size} rank(s)", flush=True)
            global_batch = args.global_batch_size or args.micro_batch_size * config.sizes(args, job.world_size).dp
            epochs = 0 if args.mock_data else data.epochs_needed(args, global_batch)
            if epochs > data.EPOCHS_WARNING:  # a tiny corpus trains, each sample many times over
                print(f"megatron-tsp train: warning: {args.train_iters} iterations of {global_batch} x "
                      f"{args.seq_length} tokens are {epochs:,.0f} epochs of --data-path's training split; every "
                      "token is seen that often", file=sys.stderr, flush=True)
        try:
            record = job.run(_train_rank, args, log_path, ns.collective_timeout_min)[0]
        except launch.RankError as exc:
            if not exc.user_error:
                error_log = os.path.abspath(os.path.join(os.path.dirname(log_path), "error.log"))
                os.makedirs(os.path.dirname(error_log), exist_ok=True)
                with open(error_log, "a", encoding="utf-8") as f:
                    f.write(f"[{datetime.datetime.now():%Y-%m-%d %H:%M:%S}] {path}: rank {exc.rank}\n"
                            f"{exc.traceback}\n")
                exc.summary += f" (traceback: {error_log})"
            raise
    if record.get("stopped") and job.rank == 0:
        where = (f"checkpoint saved in {args.save}; resume with --load {args.save}" if args.save
                 else "nothing saved (no --save)")
        print(f"megatron-tsp train: stopped after iteration {record['iteration']} of {args.train_iters} "
              f"({record['stopped']}); {where}", flush=True)
    return 0


# ---- memory -------------------------------------------------------------------------------------
def _memory_parser(sub, common) -> None:
    p = sub.add_parser(
        "memory", parents=[common], help="peak memory per category of one rank at full size (FakeTensorMode, no GPU)",
        description="One training step of rank 0 of the configured job under FakeTensorMode with "
                    "the fake process-group backend, for each mode at the same model-parallel "
                    "size, global shapes and recompute setting.")
    p.add_argument("config", help="YAML config")
    p.add_argument("--modes", type=_name_list, default="tsp,tp,tp-sp,tp-sp-ring,tp-cp", help="comma-separated modes")
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
    _fused_norm_flag(p)
    _config_flags(p, ["num_layers", "seq_length", "max_position_embeddings", "micro_batch_size",
                      "recompute_granularity"])
    p.set_defaults(func=_cmd_memory)


def _cmd_memory(ns: argparse.Namespace) -> int:
    from megatron_tsp.measure import figures, memory
    from megatron_tsp.run import config

    _check_outputs(json=ns.json, plot=ns.plot)
    if ns.plot:
        figures.pyplot("--plot")
    _runnable_modes(ns, "memory")
    result = memory.plan_modes(ns.config, ns.modes, world_size=ns.world_size, cp=ns.cp,
                               overrides=config.overrides(ns), per_layer=ns.per_layer, fused_norm=ns.fused_norm,
                               largest=ns.largest, by_op=ns.bytes_by_op)
    print(memory.table(result))
    if ns.bytes_by_op:
        print(memory.bytes_by_op_table(result))
    if ns.largest:
        print(memory.largest_table(result))
    if ns.per_layer:
        print(memory.per_layer_table(result))
    if ns.json:
        _write_json(ns.json, result)
    if ns.plot:
        memory.plot(result, ns.plot)
    return 0


# ---- predict ------------------------------------------------------------------------------------
def _predict_parser(sub, common) -> None:
    p = sub.add_parser(
        "predict", parents=[common], help="step time and tokens/s from counted FLOPs and bytes on a hardware profile",
        description="Counts FLOPs and collective bytes of the real model with the memory planner "
                    "(2 and 3 layers, extrapolated) and times them on a hardware profile.")
    _cluster_flags(p, modes="tsp,tp,tp-sp,tp-sp-ring,tp-cp")
    p.add_argument("--sweep", type=_int_list, default=None,
                   help="comma-separated sequence lengths for the TSP / TP+SP crossover")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--link", default=None, help="a calibrated link of a CPU profile (megatron-tsp calibrate), by name")
    _config_flags(p, ["micro_batch_size", "recompute_granularity"])
    p.set_defaults(func=_cmd_predict)


def _cmd_predict(ns: argparse.Namespace) -> int:
    from megatron_tsp.measure import perfmodel
    from megatron_tsp.run import config

    _check_outputs(json=ns.json)
    hw = perfmodel.load_hardware(ns.hardware)
    if ns.link:
        hw = hw.at_link(ns.link)
    _runnable_modes(ns, "predict")
    result = perfmodel.predict(ns.config, hw, ns.nodes, ns.modes, ns.cp, ns.sweep, config.overrides(ns),
                               fused_norm=ns.fused_norm)
    print(perfmodel.table(result))
    if ns.json:
        _write_json(ns.json, result)
    return 0


# ---- plan ---------------------------------------------------------------------------------------
def _plan_parser(sub, common) -> None:
    p = sub.add_parser(
        "plan", parents=[common], help="longest context that fits and fastest recompute setting per mode on a GPU",
        description="Per mode: the longest sequence length that fits in the GPU's memory (bisection on the "
                    "memory planner) and, at the config's length, every recompute choice with peak memory, "
                    "whether it fits and tokens/s from the performance model.")
    _cluster_flags(p, modes="tsp,tp-sp,tp-sp-ring,tp-cp")
    p.add_argument("--scenario", default="overlap", help="performance-model scenario: overlap, no_tp_overlap, "
                                                          "no_overlap")
    p.add_argument("--grid", type=_int_list, default=None,
                   help="comma-separated sequence lengths for the picture (every choice at each)")
    p.add_argument("--out", help="write OUT.json, OUT.md and (with --grid) OUT.png")
    _config_flags(p, ["micro_batch_size", "seq_length"])
    p.set_defaults(func=_cmd_plan)


def _cmd_plan(ns: argparse.Namespace) -> int:
    from megatron_tsp.measure import figures, perfmodel, plan
    from megatron_tsp.run import config

    if ns.out:
        _check_outputs(out=ns.out + ".json")
    if ns.out and ns.grid:
        figures.pyplot("--grid")
    hw = perfmodel.load_hardware(ns.hardware)
    _runnable_modes(ns, "plan")
    started = time.monotonic()

    def progress(line: str) -> None:
        print(f"megatron-tsp plan: [{time.monotonic() - started:5.0f} s] {line}", file=sys.stderr, flush=True)

    result = plan.plan(ns.config, hw, ns.nodes, ns.modes, ns.cp, ns.scenario, ns.grid, config.overrides(ns),
                       fused_norm=ns.fused_norm, progress=progress)
    text = plan.table(result)
    if ns.out:
        _write_json(ns.out + ".json", result)
        _write(ns.out + ".md", text + "\n", "--out")
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
    p.add_argument("--seq", type=_int_list, default="256,1024,4096", help="comma-separated sequence lengths")
    p.add_argument("--modes", type=_name_list, default="tsp,tsp-no-overlap,tp-sp,tp-sp-ring,tp-cp",
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
    p.add_argument("--seq", type=_int_list, default="2048,4096,8192", help="comma-separated sequence lengths")
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
    _write(out, f"# megatron-tsp calibrate {' '.join(sys.argv[2:])}\n" + yaml.safe_dump(profile, sort_keys=False),
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
        description="What one GPU shows: every attention backend against the math reference and timed at "
                    "8K-128K, then rank 0 of the config's job per mode with the fake process group (real "
                    "kernels, no-op collectives): peak memory against the planner and compute per step. "
                    "Results are written as they come.")
    p.add_argument("--config", default=None, help="YAML config (default: configs/7b/128k-tsp8.yaml)")
    p.add_argument("--modes", type=_name_list, default="tsp,tp-sp,tp-sp-ring,tp-cp", help="comma-separated modes")
    p.add_argument("--steps", type=POSITIVE_INT, default=2, help="timed steps per mode (after one warm-up)")
    p.add_argument("--budget-s", type=POSITIVE_FLOAT, default=420.0,
                   help="time budget: what does not fit is recorded as skipped")
    p.add_argument("--parts", type=_name_list, default="gemm,backends,modes",
                   help="comma-separated parts to run: gemm, backends, modes; profile: one more step per mode "
                        "under torch's profiler, its top kernels recorded")
    p.add_argument("--attention-backend", default="auto",
                   help="the attention kernel of every mode's step: auto (on a GPU cuDNN from 16K keys, else "
                        "flash), flash, cudnn, efficient, flash_attn")
    p.add_argument("--out", default="bench/results/gpu-check.json", help="results file (JSON)")
    _config_flags(p, ["num_layers", "seq_length", "max_position_embeddings", "micro_batch_size",
                      "tsp_head_groups_per_call"])
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
    config.resolve(dict(config.load_config(path), **config.overrides(ns)))  # one line for a bad config, now
    _write(ns.out, "", "--out")  # and for an output that cannot be written, before any work
    result = gpucheck.run(ns.out, path, ns.modes, ns.steps, config.overrides(ns), ns.budget_s, parts=ns.parts,
                          attention_backend=ns.attention_backend)
    print(gpucheck.summary(result))
    markdown = os.path.splitext(ns.out)[0] + ".md"
    _write(markdown, gpucheck.table(result) + "\n", "--out")
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

    _check_outputs(markdown=ns.markdown, json=ns.json)
    runs = {name: compare.summarize(records, ns.warmup)
            for p in ns.runs for name, records in compare.read_runs(os.path.relpath(p)).items()}
    text = compare.table(runs)
    if ns.markdown:
        _write(ns.markdown, text + "\n", "--markdown")
    if ns.json:
        _write_json(ns.json, runs)
    print(text)
    return 0


# ---- the command --------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (its default prints the whole usage first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


COMMANDS = (_env_parser, _args_parser, _train_parser, _memory_parser, _predict_parser, _plan_parser, _bench_parser,
            _calibrate_parser, _gpu_check_parser, _compare_parser)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="megatron-tsp", description="TSP (Tensor + Sequence Parallelism) for Megatron-Core.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="print Python tracebacks instead of one-line errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in COMMANDS:
        add(sub, common)
    return parser


def _stdout_closed() -> bool:
    """Whether standard output's reader has gone (then stop writing to it for good)."""
    import select

    poll = select.poll()
    poll.register(sys.stdout.fileno(), select.POLLOUT)
    if not any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0)):
        return False
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
    return True


def main(argv: Optional[List[str]] = None) -> int:
    quiet_import_noise()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return _run_command(args)


def _with_signals(args) -> int:
    """``args.func(args)`` with SIGTERM ending it as Ctrl-C does. train notes SIGTERM instead,
    until its config says whether --exit-signal-handler saves first (so that one that comes
    while it starts is not lost). The first stop wins, and once stopped the process ignores
    both signals to its end: Python puts back the default handlers while it shuts down, and
    a second SIGTERM would then turn exit 130 (or 0, saved) into 143. Otherwise the caller's
    handlers are back afterwards (main also runs inside other programs: the tests)."""
    from megatron_tsp.run import launch

    launch.forget_sigterm()
    previous_alarm = signal.getsignal(signal.SIGALRM)  # redeliver_dropped_stops' timer takes it
    previous = signal.signal(signal.SIGTERM, launch.remember_sigterm if args.command == "train"
                             else launch.raise_terminated)
    previous_int = signal.getsignal(signal.SIGINT)
    if previous_int is signal.default_int_handler:  # not where the shell made this process ignore it
        signal.signal(signal.SIGINT, launch.raise_interrupted)
    previous_hook, sys.unraisablehook = sys.unraisablehook, launch.redeliver_dropped_stops
    stopped = False
    try:
        code = args.func(args)
    except (KeyboardInterrupt, launch.Terminated):
        stopped = True
        raise
    finally:
        sys.unraisablehook = previous_hook
        dropped = launch.take_dropped_stop()  # dropped in a finalizer, its timer not fired yet
        signal.signal(signal.SIGALRM, previous_alarm)
        if stopped or dropped is not None or launch.sigterm_received():
            launch.ignore_stops()
        else:
            signal.signal(signal.SIGTERM, previous)
            signal.signal(signal.SIGINT, previous_int)
    if dropped is not None:
        raise dropped
    return code


def _run_command(args) -> int:
    """``args.func(args)``, each way it can end turned into one line on stderr and an exit code."""
    from megatron_tsp.run.launch import PoolTimeout, RankError, Terminated, under_torchrun

    where = f"rank {os.environ['RANK']}: " if under_torchrun() else ""
    try:
        return _with_signals(args)
    except KeyboardInterrupt:
        print(f"megatron-tsp {args.command}: {where}interrupted", file=sys.stderr)
        return 130
    except Terminated as exc:
        lost = ("; nothing saved since the last checkpoint; --exit-signal-handler saves one first"
                if args.command == "train" else "")
        print(f"megatron-tsp {args.command}: {where}terminated by {exc} (every rank stopped{lost})", file=sys.stderr)
        return 128 + exc.signum
    except (UserError, RankError, PoolTimeout) as exc:
        if args.debug:
            traceback.print_exc()
            if isinstance(exc, RankError):
                print(exc.traceback, file=sys.stderr)
        line = exc.summary if isinstance(exc, RankError) else str(exc)
        print(f"megatron-tsp {args.command}: error: {where}{line}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    except Exception as exc:  # noqa: BLE001 - a bug: one line, the traceback behind --debug
        if isinstance(exc, BrokenPipeError) and _stdout_closed():
            return 128 + signal.SIGPIPE  # `megatron-tsp args ... | head`: the reader has what it wanted
        if args.debug:
            raise
        first = (str(exc).strip().splitlines() or [""])[0]
        print(f"megatron-tsp {args.command}: internal error: {where}{type(exc).__name__}: {first} "
              "(run again with --debug for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
