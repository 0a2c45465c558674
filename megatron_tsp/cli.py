"""The ``megatron-tsp`` command."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import warnings
from typing import List, Optional


def _cmd_env(args: argparse.Namespace) -> int:
    from megatron_tsp.env import environment

    info = environment()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        width = max(len(k) for k in info)
        for key, value in info.items():
            shown = "not installed" if value is None else ("yes" if value is True else "no" if value is False else value)
            print(f"{key:<{width}}  {shown}")
    return 0


def default_config_path() -> str:
    """configs/tiny-cpu.yaml of the checkout this package runs from."""
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.join(os.path.dirname(here), "configs", "tiny-cpu.yaml")


def _resolve(ns: argparse.Namespace):
    from megatron_tsp import config

    path = ns.config or default_config_path()
    values = config.load_config(path)
    values.update(config.overrides(ns))
    return path, values, config.resolve(values)


def _write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, default=str)


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _init_torchrun(timeout_min: float = 10.0) -> None:
    """Join the job torchrun started: NCCL (RCCL on ROCm) on GPUs, gloo otherwise."""
    import datetime

    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                            timeout=datetime.timedelta(minutes=timeout_min))


def _cmd_args(ns: argparse.Namespace) -> int:
    from megatron_tsp import config

    _, values, _ = _resolve(ns)
    print(" ".join(shlex.quote(flag) for flag in config.to_megatron_flags(values)))
    return 0


def _train_rank(args, log_path):
    from megatron_tsp.train import train

    return train(args, log_path)


def _cmd_train(ns: argparse.Namespace) -> int:
    from megatron_tsp import config, launch

    path, _, args = _resolve(ns)
    log_path = ns.log_json or os.path.join(
        "runs", os.path.splitext(os.path.basename(path))[0], "log.jsonl")
    if _under_torchrun():
        import torch.distributed as dist

        _init_torchrun(ns.collective_timeout_min)
        _train_rank(args, log_path)
        dist.destroy_process_group()
        return 0
    nproc = ns.nproc or config.model_parallel_size(args)
    print(f"megatron-tsp train: {path}, {nproc} gloo rank(s) on this machine", flush=True)
    pool = launch.WorkerPool(nproc, collective_timeout_s=60 * ns.collective_timeout_min)
    try:
        pool.run(_train_rank, args, log_path, timeout_s=ns.timeout_s)
    finally:
        pool.close()
    return 0


def _cmd_compare(ns: argparse.Namespace) -> int:
    from megatron_tsp import compare

    runs = {os.path.relpath(p): compare.summarize(compare.read_run(p), ns.warmup)
            for p in ns.runs}
    text = compare.table(runs)
    print(text)
    if ns.markdown:
        with open(ns.markdown, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    if ns.json:
        _write_json(ns.json, runs)
    return 0


def _cmd_memory(ns: argparse.Namespace) -> int:
    from megatron_tsp import config, memory

    modes = [m.strip() for m in ns.modes.split(",") if m.strip()]
    result = memory.plan_modes(ns.config, modes, world_size=ns.world_size, cp=ns.cp,
                               overrides=config.overrides(ns))
    print(memory.table(result))
    if ns.json:
        _write_json(ns.json, result)
    if ns.plot:
        memory.plot(result, ns.plot)
    return 0


def _cmd_predict(ns: argparse.Namespace) -> int:
    from megatron_tsp import config, perfmodel

    hw = perfmodel.load_hardware(ns.hardware)
    seqs = [int(x) for x in ns.sweep.split(",")] if ns.sweep else None
    modes = [m.strip() for m in ns.modes.split(",") if m.strip()]
    result = perfmodel.predict(ns.config, hw, ns.nodes, modes, ns.cp, seqs, config.overrides(ns))
    print(perfmodel.table(result))
    if ns.json:
        _write_json(ns.json, result)
    return 0


def _cmd_bench(ns: argparse.Namespace) -> int:
    from megatron_tsp import bench, launch

    path = ns.config or os.path.join(os.path.dirname(default_config_path()), "bench-cpu.yaml")
    seqs = [int(x) for x in ns.seq.split(",")]
    modes = [m.strip() for m in ns.modes.split(",") if m.strip()]
    try:
        if _under_torchrun():  # every rank runs here
            import torch.distributed as dist

            _init_torchrun()
            result = bench.run(path, seqs, modes, ns.repeats, ns.steps, ns.warmup,
                               lambda fn, *a: [fn(*a)], dist.get_world_size())
            if dist.get_rank() != 0:
                return 0
        else:
            pool = launch.WorkerPool(ns.nproc)
            try:
                result = bench.run(path, seqs, modes, ns.repeats, ns.steps, ns.warmup,
                                   lambda fn, *a: pool.run(fn, *a, timeout_s=ns.timeout_s), ns.nproc)
            finally:
                pool.close()
    except bench.ModesDisagree as exc:
        print(f"megatron-tsp bench: error: {exc}", file=sys.stderr)
        return 1
    print(bench.table(result))
    print("wrote", ", ".join(bench.write(result, ns.out, ns.name)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-tsp",
        description="TSP (Tensor + Sequence Parallelism) for Megatron-Core.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    env = sub.add_parser("env", help="versions of torch/megatron-core/TE/apex, device and backend")
    env.add_argument("--json", action="store_true", help="print JSON")
    env.set_defaults(func=_cmd_env)

    from megatron_tsp import config

    args = sub.add_parser("args", help="render a config as Megatron-LM command-line flags")
    args.add_argument("config", help="YAML config (keys are Megatron-LM argument names)")
    config.add_arguments(args)
    args.set_defaults(func=_cmd_args)

    train = sub.add_parser(
        "train", help="train GPT with TSP (or a TP baseline) on megatron-core",
        description="Train GPT on megatron-core. CONFIG defaults to configs/tiny-cpu.yaml; "
                    "Megatron-style flags override its keys. Under torchrun every rank runs "
                    "here; otherwise --nproc gloo ranks are spawned on this machine.")
    train.add_argument("config", nargs="?", help="YAML config (default: configs/tiny-cpu.yaml)")
    train.add_argument("--nproc", type=int, default=None,
                       help="gloo ranks to spawn without torchrun (default: the model-parallel size)")
    train.add_argument("--log-json", default=None, help="JSON-lines log (default: runs/<config>/log.jsonl)")
    train.add_argument("--timeout-s", type=float, default=6 * 3600.0,
                       help="wall-clock limit of a spawned job")
    train.add_argument("--collective-timeout-min", type=float, default=10.0,
                       help="timeout of every collective")
    config.add_arguments(train)
    train.set_defaults(func=_cmd_train)

    mem = sub.add_parser(
        "memory", help="peak memory per category of one rank at full size (FakeTensorMode, no GPU)",
        description="One training step of rank 0 of the configured job under FakeTensorMode with "
                    "the fake process-group backend, for each mode at the same model-parallel "
                    "size, global shapes and recompute setting.")
    mem.add_argument("config", help="YAML config")
    mem.add_argument("--modes", default="tsp,tp,tp-sp,tp-cp", help="comma-separated: tsp,tp,tp-sp,tp-cp")
    mem.add_argument("--cp", type=int, default=2, help="context-parallel size of the tp-cp mode")
    mem.add_argument("--world-size", type=int, default=None,
                     help="ranks of the job (default: the model-parallel size, one replica)")
    mem.add_argument("--json", help="write the results here")
    mem.add_argument("--plot", help="write a stacked bar chart (PNG) here")
    config.add_arguments(mem, keys=["num_layers", "seq_length", "max_position_embeddings",
                                    "micro_batch_size", "recompute_granularity"])
    mem.set_defaults(func=_cmd_memory)

    pred = sub.add_parser(
        "predict", help="step time and tokens/s from counted FLOPs and bytes on a hardware profile",
        description="Counts FLOPs and collective bytes of the real model with the memory planner "
                    "(1 and 2 layers, extrapolated) and times them on a hardware profile.")
    pred.add_argument("config", help="YAML config")
    pred.add_argument("--hardware", required=True, help="configs/hardware/<name>.yaml")
    pred.add_argument("--nodes", type=int, default=1, help="nodes of the job")
    pred.add_argument("--modes", default="tsp,tp,tp-sp,tp-cp", help="comma-separated modes")
    pred.add_argument("--cp", type=int, default=2, help="context-parallel size of tp-cp")
    pred.add_argument("--sweep", default=None,
                      help="comma-separated sequence lengths for the TSP / TP+SP crossover")
    pred.add_argument("--json", help="write the results here")
    config.add_arguments(pred, keys=["micro_batch_size", "recompute_granularity"])
    pred.set_defaults(func=_cmd_predict)

    bn = sub.add_parser(
        "bench", help="time TSP, TP+SP and TP x CP training steps side by side on this machine",
        description="Interleaved blocks of timed training steps of every mode on the same ranks; "
                    "writes JSON, a markdown table and a PNG.")
    bn.add_argument("config", nargs="?", help="YAML config (default: configs/bench-cpu.yaml)")
    bn.add_argument("--seq", default="256,1024,4096", help="comma-separated sequence lengths")
    bn.add_argument("--modes", default="tsp,tsp-no-overlap,tp-sp,tp-cp", help="comma-separated modes")
    bn.add_argument("--repeats", type=int, default=3, help="interleaved blocks per mode")
    bn.add_argument("--steps", type=int, default=3, help="timed steps per block")
    bn.add_argument("--warmup", type=int, default=1, help="untimed steps per block")
    bn.add_argument("--nproc", type=int, default=2, help="gloo ranks to spawn without torchrun")
    bn.add_argument("--timeout-s", type=float, default=1800.0, help="deadline of one block")
    bn.add_argument("--out", default="bench/results", help="output folder")
    bn.add_argument("--name", default="bench-cpu", help="file stem of the results")
    bn.set_defaults(func=_cmd_bench)

    cmp = sub.add_parser("compare", help="table of several runs' iteration logs (JSON lines or Megatron text)")
    cmp.add_argument("runs", nargs="+", help="log files or run directories")
    cmp.add_argument("--warmup", type=int, default=2, help="iterations left out of the timing")
    cmp.add_argument("--markdown", help="write the table here")
    cmp.add_argument("--json", help="write the summaries here")
    cmp.set_defaults(func=_cmd_compare)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    # megatron-core warns at import that TransformerEngine/apex are missing; `megatron-tsp
    # env` reports them, and on a CPU they are not expected.
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).* not installed")
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    from megatron_tsp.config import ConfigError

    try:
        return args.func(args)
    except ConfigError as exc:
        parser.exit(2, f"megatron-tsp: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
