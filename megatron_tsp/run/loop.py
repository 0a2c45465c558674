"""The training loop of ``megatron-tsp train``: GPT pretraining on megatron-core alone, TSP
or a TP / TP+SP / TP x CP baseline (the mode the config runs in, :func:`modes.of`).

Real pieces throughout: megatron-core GPTModel with the TSP spec (``tsp_size > 1``) or the
stock spec, DDP, the distributed optimizer, ``OptimizerParamScheduler``, gradient clipping,
megatron-core datasets (mock or indexed), ``dist_checkpointing`` with resume. Runs under
torchrun, or spawns its own gloo ranks on a machine without GPUs.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import resource
import time
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from megatron_tsp.errors import TrainingStopped
from megatron_tsp.run import checkpointing, data, modes, step
from megatron_tsp.run.build import build, initialize, model_args
from megatron_tsp.run.flops import flops_per_sequence_from_args


def check_finite(args, iteration: int, result: Dict[str, Any]) -> None:
    """Megatron-LM's ``--check-for-nan-in-loss-and-grad`` (on by default): stop on a NaN/Inf
    loss or gradient norm (the same on every rank, so every rank stops) before it is saved.
    A step the fp16 loss scaler skipped (overflow) is not an error; without clipping there
    is no norm."""
    loss, grad_norm = result["loss"], result["grad_norm"]
    norm_checked = args.clip_grad > 0 and result["update_successful"]
    finite = math.isfinite(loss) and (not norm_checked or math.isfinite(grad_norm))
    if args.check_for_nan_in_loss_and_grad and not finite:
        raise TrainingStopped(
            f"iteration {iteration}: lm loss {loss}, grad norm {grad_norm}: not finite, training stopped "
            f"(nothing saved from this step). Usual causes: a damaged checkpoint, --lr {args.lr} too high, "
            f"fp16 overflow; --no-check-for-nan-in-loss-and-grad turns this check off")


def _peak_memory_gib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # peak RSS


def _rng_state() -> Dict[str, Any]:
    return {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def _set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"])


class Logger:
    """Megatron-style iteration lines on rank 0, and the same numbers as JSON lines."""

    def __init__(self, path: Optional[str]):
        self.path = path
        if path and dist.get_rank() == 0:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def log(self, record: Dict[str, Any]) -> None:
        if dist.get_rank() != 0:
            return
        stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        print(
            f" [{stamp}] iteration {record['iteration']:>8d}/{record['train_iters']:>8d} |"
            f" consumed samples: {record['consumed_samples']:>10d} |"
            f" elapsed time per iteration (ms): {record['elapsed_ms']:.1f} |"
            f" tokens/s: {record['tokens_per_s']:.0f} |"
            f" TFLOP/s/device: {record['tflops_per_device']:.3f} |"
            f" learning rate: {record['lr']:.6E} |"
            f" global batch size: {record['global_batch_size']:>5d} |"
            f" lm loss: {record['loss']:.6E} |"
            f" grad norm: {record['grad_norm']:.3f} |"
            f" peak memory (GiB): {record['peak_memory_gib']:.2f} |",
            flush=True,
        )
        if self.path:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")


def scheduler_for(args, optimizer) -> OptimizerParamScheduler:
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if args.lr_warmup_iters else args.lr, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters, lr_decay_steps=args.lr_decay_iters,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters, wd_incr_style="constant",
    )


def resume(args, model, optimizer, scheduler) -> int:
    """Load the newest checkpoint under ``--load`` (model, optimizer, scheduler, RNGs); the
    iteration to start from."""
    found = checkpointing.latest(args.load)
    if not found:
        if args.load and dist.get_rank() == 0:
            print(f" no checkpoint in {args.load}; starting from scratch", flush=True)
        return 0
    path, _ = found
    common, rng = checkpointing.load(path, model, optimizer, per_rank=True, model_args=model_args(args))
    scheduler.load_state_dict(common["scheduler"])
    if rng is not None:
        _set_rng_state(rng)
    if dist.get_rank() == 0:
        print(f" loaded checkpoint {path} at iteration {common['iteration']}", flush=True)
    return common["iteration"]


def save(args, done: int, model, optimizer, scheduler) -> None:
    path = checkpointing.save_iteration(
        args.save, done, model, optimizer,
        common={"iteration": done, "scheduler": scheduler.state_dict(), "model_args": model_args(args)},
        per_rank=_rng_state())
    if dist.get_rank() == 0:
        print(f" saved checkpoint {path}", flush=True)


def train(args, log_path: Optional[str] = None, collective_timeout_min: float = 10.0) -> Dict[str, Any]:
    """Run on every rank of an initialised process group whose job passed
    ``preflight.check_run`` (data present, batch sizes dividing); returns the last log record."""
    initialize(args, distributed_timeout_minutes=collective_timeout_min)
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    global_batch = args.global_batch_size or args.micro_batch_size * dp
    num_microbatches = global_batch // (args.micro_batch_size * dp)
    _, model, optimizer = build(args)
    scheduler = scheduler_for(args, optimizer)
    start = resume(args, model, optimizer, scheduler)
    dataset = data.build_train_dataset(args, args.train_iters * global_batch, dp)
    transform = modes.of(args).batch_transform(args)
    flops_per_step = flops_per_sequence_from_args(args, data.padded_vocab(args)) * global_batch
    logger = Logger(log_path)
    record: Dict[str, Any] = {}
    for iteration in range(start, args.train_iters):
        batches = data.microbatches(dataset, iteration, num_microbatches, args.micro_batch_size, dp_rank, dp)
        t0 = time.perf_counter()
        result = step.train_step(model, optimizer, batches, num_microbatches, args.seq_length,
                                 args.micro_batch_size, batch_transform=transform)
        elapsed = time.perf_counter() - t0
        done = iteration + 1
        check_finite(args, done, result)
        lr = optimizer.param_groups[0]["lr"]
        scheduler.step(increment=1)
        record = {
            "iteration": done, "train_iters": args.train_iters,
            "consumed_samples": done * global_batch, "global_batch_size": global_batch,
            "loss": result["loss"], "lr": lr, "grad_norm": result["grad_norm"],
            "elapsed_ms": elapsed * 1e3,
            "tokens_per_s": global_batch * args.seq_length / elapsed,
            "tflops_per_device": flops_per_step / elapsed / dist.get_world_size() / 1e12,
            "peak_memory_gib": _peak_memory_gib(),
        }
        if done % args.log_interval == 0 or done == args.train_iters:
            logger.log(record)
        if args.save and (done == args.train_iters or (args.save_interval and done % args.save_interval == 0)):
            save(args, done, model, optimizer, scheduler)
    return record
