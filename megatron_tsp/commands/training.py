"""The subcommands that run a job or show what it would run: env, args, train."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shlex
import sys
from typing import Dict

from megatron_tsp.commands.shared import POSITIVE_FLOAT, POSITIVE_INT, config_flags, resolve_config


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
    config_flags(p)
    p.set_defaults(func=_cmd_args)


def _cmd_args(ns: argparse.Namespace) -> int:
    from megatron_tsp.run import config

    _, values, _ = resolve_config(ns)
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
    config_flags(p)
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

    path, _, args = resolve_config(ns)  # a bad config is one line before anything is started or imported
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


PARSERS = (_env_parser, _args_parser, _train_parser)
