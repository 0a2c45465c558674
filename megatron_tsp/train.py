"""``megatron-tsp train``: GPT pretraining on megatron-core alone, TSP or a TP/TP+SP baseline.

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
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_batch_on_this_cp_rank

import megatron_tsp
from megatron_tsp import checkpointing, data, training
from megatron_tsp.baselines import get_gpt_layer_baseline_spec
from megatron_tsp.compat import enable_cpu_support
from megatron_tsp.env import transformer_engine_version
from megatron_tsp.errors import TrainingStopped
from megatron_tsp.flops import flops_per_sequence_from_args
from megatron_tsp.zigzag import zigzag_batch


def transformer_config(args) -> TransformerConfig:
    on_gpu = torch.cuda.is_available()
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    recompute = {}
    if args.recompute_granularity:
        recompute = dict(recompute_granularity=args.recompute_granularity,
                         recompute_method=args.recompute_method,
                         recompute_num_layers=args.recompute_num_layers,
                         recompute_modules=args.recompute_modules)
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        tensor_model_parallel_size=args.tsp_size * args.tensor_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        context_parallel_size=args.context_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        normalization=args.normalization,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=not args.disable_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        qk_layernorm=args.qk_layernorm,
        attention_dropout=args.attention_dropout,
        hidden_dropout=args.hidden_dropout,
        init_method_std=args.init_method_std,
        layernorm_epsilon=args.norm_epsilon,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        use_cpu_initialization=not on_gpu,
        bias_activation_fusion=False,
        masked_softmax_fusion=on_gpu,
        **recompute,
    )


def layer_spec(args, attention_backend: str = "auto", config: Optional[TransformerConfig] = None,
               overlap_comm: bool = True, transformer_engine: bool = True):
    """TSP block spec for --tsp-size > 1 (its final norm accepts sequence parallelism where
    megatron's torch norm would not); else megatron's TransformerEngine spec where TE runs
    and ``transformer_engine`` allows it, else the local spec with the attention op TSP uses
    (baselines.py). Comparisons (benchmark, planner, GPU check) pass ``transformer_engine=False``
    so that every mode runs the same attention kernels."""
    if args.tsp_size > 1:
        return megatron_tsp.get_gpt_block_tsp_spec(config or transformer_config(args),
                                                   qk_layernorm=args.qk_layernorm,
                                                   attention_backend=attention_backend,
                                                   overlap_comm=overlap_comm)
    if transformer_engine and torch.cuda.is_available() and transformer_engine_version() is not None:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=args.qk_layernorm)
    return get_gpt_layer_baseline_spec(qk_layernorm=args.qk_layernorm, normalization=args.normalization,
                                       attention_backend=attention_backend)


def model_args(args) -> Dict[str, Any]:
    """The arguments that decide the model's parameters and their shapes (not how it is split
    or trained): saved with a checkpoint and compared at load."""
    keys = ["num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
            "kv_channels", "position_embedding_type", "normalization", "swiglu", "disable_bias_linear",
            "add_qkv_bias", "qk_layernorm", "untie_embeddings_and_output_weights"]
    if args.position_embedding_type == "learned_absolute":
        keys.append("max_position_embeddings")
    out = {key: getattr(args, key) for key in keys}
    out["padded_vocab_size"] = data.padded_vocab(args)
    return out


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


def batch_transform(args):
    """Zigzag order for TSP; megatron's context-parallel slice for CP; nothing otherwise."""
    if args.tsp_size > 1:
        return lambda b: zigzag_batch(b, args.tsp_size)
    if args.context_parallel_size > 1:
        return get_batch_on_this_cp_rank
    return None


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


def initialize(args, seed: bool = True, **megatron_kwargs) -> None:
    """Process groups of the run (TSP, or TP/CP for a baseline) and, with ``seed``, the RNGs."""
    if not torch.cuda.is_available():
        enable_cpu_support()
    megatron_tsp.initialize_model_parallel(
        tsp_size=args.tsp_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        **megatron_kwargs,
    )
    if seed:
        torch.manual_seed(args.seed)
        model_parallel_cuda_manual_seed(args.seed)


def build(args, attention_backend: str = "auto", clip_grad: Optional[float] = None,
          use_gloo_process_groups: bool = True, overlap_comm: bool = True, transformer_engine: bool = True):
    """(TransformerConfig, DDP model chunks, optimizer) of the run, as megatron-core builds them
    (``overlap_comm``, ``transformer_engine``: see :func:`layer_spec`)."""
    config = transformer_config(args)
    model = training.build_model(
        config, layer_spec(args, attention_backend, config, overlap_comm, transformer_engine), data.padded_vocab(args),
        args.max_position_embeddings,
        position_embedding_type=args.position_embedding_type,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        ddp_config=DistributedDataParallelConfig(
            use_distributed_optimizer=args.use_distributed_optimizer,
            overlap_grad_reduce=args.overlap_grad_reduce,
            overlap_param_gather=args.overlap_param_gather,
            grad_reduce_in_fp32=args.bf16 or args.fp16,
        ),
    )
    optimizer = training.build_optimizer(model, OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2,
        clip_grad=args.clip_grad if clip_grad is None else clip_grad,
        bf16=args.bf16, fp16=args.fp16, params_dtype=config.params_dtype,
        use_distributed_optimizer=args.use_distributed_optimizer,
    ), use_gloo_process_groups=use_gloo_process_groups)
    return config, model, optimizer


def train(args, log_path: Optional[str] = None, collective_timeout_min: float = 10.0) -> Dict[str, Any]:
    """Run on every rank of an initialised process group whose job passed
    ``preflight.check_run`` (data present, batch sizes dividing); returns the last log record."""
    initialize(args, distributed_timeout_minutes=collective_timeout_min)
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    global_batch = args.global_batch_size or args.micro_batch_size * dp
    num_microbatches = global_batch // (args.micro_batch_size * dp)
    config, model, optimizer = build(args)
    vocab = data.padded_vocab(args)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if args.lr_warmup_iters else args.lr, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters, lr_decay_steps=args.lr_decay_iters,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters, wd_incr_style="constant",
    )

    start = 0
    resume_from = checkpointing.latest(args.load)
    if resume_from:
        resume_from, _ = resume_from
        common, rng = checkpointing.load(resume_from, model, optimizer, per_rank=True, model_args=model_args(args))
        start = common["iteration"]
        scheduler.load_state_dict(common["scheduler"])
        if rng is not None:
            _set_rng_state(rng)
        if dist.get_rank() == 0:
            print(f" loaded checkpoint {resume_from} at iteration {start}", flush=True)
    elif args.load and dist.get_rank() == 0:
        print(f" no checkpoint in {args.load}; starting from scratch", flush=True)

    dataset = data.build_train_dataset(args, args.train_iters * global_batch, dp)
    transform = batch_transform(args)
    flops_per_step = flops_per_sequence_from_args(args, vocab) * global_batch
    logger = Logger(log_path)
    record: Dict[str, Any] = {}
    for iteration in range(start, args.train_iters):
        batches = data.microbatches(dataset, iteration, num_microbatches, args.micro_batch_size, dp_rank, dp)
        t0 = time.perf_counter()
        result = training.train_step(model, optimizer, batches, num_microbatches, args.seq_length,
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
            path = checkpointing.save_iteration(
                args.save, done, model, optimizer,
                common={"iteration": done, "scheduler": scheduler.state_dict(), "model_args": model_args(args)},
                per_rank=_rng_state())
            if dist.get_rank() == 0:
                print(f" saved checkpoint {path}", flush=True)
    return record
