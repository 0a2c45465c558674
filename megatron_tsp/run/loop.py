"""The training loop of ``megatron-tsp train``: GPT pretraining on megatron-core alone, TSP
or a TP / TP+SP / TP x CP baseline (the mode the config runs in, :func:`modes.of`).

Real pieces throughout: megatron-core GPTModel with the TSP spec (``tsp_size > 1``) or the
stock spec, DDP, the distributed optimizer, ``OptimizerParamScheduler``, gradient clipping,
megatron-core datasets (mock or indexed), ``dist_checkpointing`` with resume. Runs under
torchrun, or spawns its own gloo ranks on a machine without GPUs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import signal
import sys
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from megatron_tsp.device import Device
from megatron_tsp.errors import CheckpointError, TrainingStopped
from megatron_tsp.run import checkpointing, data, launch, modes, step
from megatron_tsp.run.build import build, initialize, model_args
from megatron_tsp.run.flops import flops_per_sequence_from_args


def check_grad_norm(args, iteration: int, result: Dict[str, Any]) -> None:
    """Megatron-LM's ``--check-for-nan-in-loss-and-grad`` (on by default), on the gradient norm
    of every step (the optimizer has read it anyway): stop on NaN/Inf, the same on every rank,
    before the step is saved. A step the fp16 loss scaler skipped (overflow) is not an
    error; without clipping there is no norm. The loss is checked by :func:`check_losses`."""
    checked = args.check_for_nan_in_loss_and_grad and args.clip_grad > 0 and result["update_successful"]
    if checked and not math.isfinite(result["grad_norm"]):
        raise _not_finite(args, iteration, "grad norm", result["grad_norm"])


def check_losses(args, first_iteration: int, losses: List[float]) -> None:
    """The same check on the losses of iterations ``first_iteration, ...`` (read once per log
    interval and before every save, so the host seldom waits for the device)."""
    for i, loss in enumerate(losses):
        if args.check_for_nan_in_loss_and_grad and not math.isfinite(loss):
            raise _not_finite(args, first_iteration + i, "lm loss", loss)


def _not_finite(args, iteration: int, what: str, value: float) -> TrainingStopped:
    return TrainingStopped(
        f"iteration {iteration}: {what} {value}: not finite, training stopped "
        f"(nothing saved from this step). Usual causes: a damaged checkpoint, --lr {args.lr} too high, "
        f"fp16 overflow; --no-check-for-nan-in-loss-and-grad turns this check off")


def _rng_state(device: Device) -> Dict[str, Any]:
    return {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states(),
            "cuda": device.rng_state()}


def _set_rng_state(device: Device, state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    device.set_rng_state(state["cuda"])


class EarlyExit:
    """Megatron-LM's ways to stop before ``--train-iters`` with a checkpoint, decided the same on
    every rank after each step: ``--exit-signal-handler`` (SIGTERM received by any rank),
    ``--exit-duration-in-mins`` (minutes since training started, the slowest rank's clock) and
    ``--exit-interval`` (the iteration is a multiple). The handler is this rank's while training
    and the previous one's afterwards."""

    def __init__(self, args, device: Device):
        self.args, self.device = args, device
        self.started = time.time()
        self._previous = None
        if args.exit_signal_handler:  # a rank or a torchrun process has it already: from its start
            self._previous = signal.signal(signal.SIGTERM, launch.remember_sigterm)

    def reason(self, iteration: int) -> Optional[str]:
        """Why to stop after ``iteration``, or None."""
        args = self.args
        if args.exit_signal_handler or args.exit_duration_in_mins:
            minutes = (time.time() - self.started) / 60
            received = launch.sigterm_received() if args.exit_signal_handler else None
            flags = torch.tensor([received is not None, minutes], dtype=torch.float64, device=self.device.torch)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            anywhere, minutes = flags.tolist()
            if anywhere:
                return f"{received or 'SIGTERM'} received, --exit-signal-handler"
            if args.exit_duration_in_mins and minutes > args.exit_duration_in_mins:
                return f"--exit-duration-in-mins {args.exit_duration_in_mins} reached"
        if args.exit_interval and iteration % args.exit_interval == 0:
            return f"--exit-interval {args.exit_interval}"
        return None

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


class Logger:
    """Megatron-style iteration lines on rank 0, and the same numbers as JSON lines."""

    def __init__(self, path: Optional[str], mode: str, layer_spec: str):
        self.path = path
        # every run of a config appends to the same log: each record names its run (compare)
        self.run = {"run": f"{datetime.datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}", "mode": mode,
                    "layer_spec": layer_spec}
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
                f.write(json.dumps({**self.run, **record}) + "\n")


def _schedule(args) -> Dict[str, Any]:
    """The learning-rate and weight-decay schedule of ``args``, as the scheduler keeps it."""
    return dict(max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_iters,
                lr_decay_steps=args.lr_decay_iters, lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay,
                end_wd=args.weight_decay, wd_incr_steps=args.train_iters, wd_incr_style="constant")


def scheduler_for(args, optimizer) -> OptimizerParamScheduler:
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if args.lr_warmup_iters else args.lr, **_schedule(args),
        # check_resume has refused a difference neither flag accepts: megatron-core keeps the
        # checkpoint's values unless overridden
        override_opt_param_scheduler=bool(args.override_opt_param_scheduler),
        use_checkpoint_opt_param_scheduler=not args.override_opt_param_scheduler,
    )


def _global_batch(args) -> int:
    return args.global_batch_size or args.micro_batch_size * mpu.get_data_parallel_world_size()


# The scheduler's settings a checkpoint keeps, and the flags that set them here (weight decay is
# constant, so its increment steps, --train-iters, change nothing).
_SCHEDULE = {"max_lr": "--lr", "min_lr": "--min-lr", "lr_warmup_steps": "--lr-warmup-iters",
             "lr_decay_steps": "--lr-decay-iters (default --train-iters)", "lr_decay_style": "--lr-decay-style",
             "start_wd": "--weight-decay"}


def check_resume(args, path: str, common: Dict[str, Any]) -> None:
    """Megatron-LM's rules for a resume: another schedule needs --override-opt-param-scheduler
    (this run's) or --use-checkpoint-opt-param-scheduler (the checkpoint's), and the data
    position is counted in iterations of the checkpoint's global batch. One line each, before
    anything is loaded."""
    saved_batch, batch = common.get("global_batch_size"), _global_batch(args)
    if saved_batch is not None and saved_batch != batch:
        raise CheckpointError(f"checkpoint {path} was trained with --global-batch-size {saved_batch}, this run has "
                              f"{batch}: the data it resumes from is counted in batches of {saved_batch} (another "
                              f"size would skip or repeat samples); resume with --global-batch-size {saved_batch}")
    if args.override_opt_param_scheduler or args.use_checkpoint_opt_param_scheduler:
        return
    here = _schedule(args)
    differ = [f"{flag} {common['scheduler'][key]!r} there, {here[key]!r} here"
              for key, flag in _SCHEDULE.items() if common["scheduler"].get(key) != here[key]]
    if differ:
        raise CheckpointError(f"checkpoint {path} was trained with another schedule ({'; '.join(differ)}); give "
                              "--override-opt-param-scheduler to take this run's or "
                              "--use-checkpoint-opt-param-scheduler to keep the checkpoint's")


def resume_notes(args, path: str, common: Dict[str, Any]) -> List[str]:
    """What a resume does with a sequence length or seed other than the checkpoint's (a
    longer sequence is a legitimate long-context extension): one line each, said at load."""
    saved, notes = common.get("data", {}), []
    position = common["iteration"] * common.get("global_batch_size", _global_batch(args))
    if saved.get("seq_length") not in (None, args.seq_length):
        notes.append(f"checkpoint {path} was trained at --seq-length {saved['seq_length']}, this run has "
                     f"{args.seq_length}: the weights carry over, and the data resumes after the {position} samples "
                     f"trained, now read {args.seq_length} tokens each")
    if saved.get("seed") not in (None, args.seed):
        notes.append(f"checkpoint {path} was trained with --seed {saved['seed']}, this run has {args.seed}: the random "
                     "state is the checkpoint's, and the corpus is shuffled by --seed, so the rest of the run reads "
                     f"another order from sample {position} on (some samples again, some never); resume with "
                     f"--seed {saved['seed']} to go on in the same order")
    return notes


def optimizer_args(args, path: Optional[str]):
    """The arguments to build the optimizer with: ``args``, or on a resume from ``path`` with
    the LR range the checkpoint's optimizer groups were saved with (megatron-core 0.19 finds a
    saved group by its learning rates; :func:`resume` sets this run's afterwards where asked)."""
    if path is None:
        return args
    common = checkpointing.read_common(path)
    check_resume(args, path, common)
    saved = common["scheduler"]
    return argparse.Namespace(**dict(vars(args), lr=saved["max_lr"], min_lr=saved["min_lr"]))


def resume(args, device: Device, path: Optional[str], model, optimizer, scheduler) -> int:
    """Load the checkpoint at ``path``, the newest under ``--load`` (model, optimizer,
    scheduler, RNGs); the iteration to start from."""
    if path is None:
        if args.load and dist.get_rank() == 0:
            print(f" no checkpoint in {args.load}; starting from scratch", flush=True)
        return 0
    common, rng = checkpointing.load(path, model, optimizer, per_rank=True, model_args=model_args(args))
    scheduler.load_state_dict(common["scheduler"])
    if args.override_opt_param_scheduler:  # the loaded optimizer's groups carry the checkpoint's LR range
        for group in scheduler.optimizer.param_groups:
            group.update({key: value for key, value in (("max_lr", args.lr), ("min_lr", args.min_lr)) if key in group})
        scheduler.step(0)
    if rng is not None:
        _set_rng_state(device, rng)
    if dist.get_rank() == 0:
        print(f" loaded checkpoint {path} at iteration {common['iteration']}", flush=True)
        for note in resume_notes(args, path, common):
            print(f"megatron-tsp train: note: {note}", file=sys.stderr, flush=True)
    return common["iteration"]


def save(args, device: Device, done: int, model, optimizer, scheduler) -> None:
    if args.overlap_param_gather:
        # the step updated only this rank's slice of the weights; the rest arrive in the next
        # forward's pre-hooks (Megatron-LM's disable_forward_pre_hook does the same before a save)
        for chunk in model:
            chunk.start_param_sync(force_sync=True)
    path = checkpointing.save_iteration(
        args.save, done, model, optimizer,
        common={"iteration": done, "scheduler": scheduler.state_dict(), "model_args": model_args(args),
                "global_batch_size": _global_batch(args), "data": {"seq_length": args.seq_length, "seed": args.seed}},
        per_rank=_rng_state(device))
    if dist.get_rank() == 0:
        print(f" saved checkpoint {path}", flush=True)


def train(args, device: Device, log_path: Optional[str] = None, collective_timeout_min: float = 10.0
          ) -> Dict[str, Any]:
    """Run on every rank of an initialised process group whose job passed
    ``preflight.check_run`` (data present, batch sizes dividing); returns the last log record.

    Losses stay on the device until a log line or a checkpoint needs them: one reduction
    over the pipeline and data-parallel groups then (:func:`step.global_losses`)."""
    exits = EarlyExit(args, device)  # first: a SIGTERM during the set-up is a stop after the first step
    try:
        return _train(args, device, exits, log_path, collective_timeout_min)
    finally:
        exits.close()


def _train(args, device: Device, exits: EarlyExit, log_path: Optional[str], collective_timeout_min: float
           ) -> Dict[str, Any]:
    initialize(args, device, distributed_timeout_minutes=collective_timeout_min)
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    global_batch = _global_batch(args)
    num_microbatches = global_batch // (args.micro_batch_size * dp)
    found = checkpointing.latest(args.load)
    path = found[0] if found else None
    _, model, optimizer = build(args, device, optimizer_args=optimizer_args(args, path))
    scheduler = scheduler_for(args, optimizer)
    start = resume(args, device, path, model, optimizer, scheduler)
    dataset = data.build_train_dataset(args, args.train_iters * global_batch, dp)
    transform = modes.of(args).batch_transform(args)
    eod = data.documents_eod(args)
    flops_per_step = flops_per_sequence_from_args(args, data.padded_vocab(args)) * global_batch
    logger = Logger(log_path, modes.of(args).name, modes.of(args).layer_spec(args))
    record: Dict[str, Any] = {}
    pending: List[torch.Tensor] = []  # device losses of the iterations since the last read
    interval_start = time.perf_counter()
    for iteration in range(start, args.train_iters):
        batches = data.microbatches(dataset, iteration, num_microbatches, args.micro_batch_size, dp_rank, dp,
                                    device.torch)
        result = step.train_step(model, optimizer, batches, num_microbatches, args.seq_length,
                                 args.micro_batch_size, batch_transform=transform, documents_eod=eod)
        done = iteration + 1
        check_grad_norm(args, done, result)
        pending.append(result["loss"])
        lr = optimizer.param_groups[0]["lr"]
        scheduler.step(increment=1)
        stop = exits.reason(done) if done < args.train_iters else None
        logged = done % args.log_interval == 0 or done == args.train_iters or stop
        saved = args.save and (done == args.train_iters or (args.save_interval and done % args.save_interval == 0)
                               or stop)
        if not (logged or saved):
            continue
        losses = step.global_losses(pending)  # waits for the device
        check_losses(args, done - len(pending) + 1, losses)
        # per iteration, averaged over the interval (as Megatron-LM reports it)
        elapsed = (time.perf_counter() - interval_start) / len(pending)
        pending = []
        record = {
            "iteration": done, "train_iters": args.train_iters,
            "consumed_samples": done * global_batch, "global_batch_size": global_batch,
            "loss": losses[-1], "lr": lr, "grad_norm": result["grad_norm"],
            "elapsed_ms": elapsed * 1e3,
            "tokens_per_s": global_batch * args.seq_length / elapsed,
            "tflops_per_device": flops_per_step / elapsed / dist.get_world_size() / 1e12,
            "peak_memory_gib": device.peak_memory_gib(),
        }
        if logged:
            logger.log(record)
        if saved:
            save(args, device, done, model, optimizer, scheduler)
        if stop:
            record["stopped"] = stop
            break
        interval_start = time.perf_counter()
    return record
