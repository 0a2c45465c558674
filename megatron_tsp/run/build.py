"""From resolved arguments to megatron-core objects: the TransformerConfig, the process
groups, and the model and optimizer of a mode on a device (the one build every command and
test uses)."""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import torch
import torch.nn.functional as F
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_tsp import versions
from megatron_tsp.core import vocab
from megatron_tsp.core.parallel_state import initialize_model_parallel
from megatron_tsp.core.sizes import ParallelSizes
from megatron_tsp.core.support import window_pair
from megatron_tsp.device import Device
from megatron_tsp.run import data, modes, step
from megatron_tsp.run.compat import enable_cpu_support
from megatron_tsp.run.modes import Mode
from megatron_tsp.run.upstream import fix_moe_without_transformer_engine


def params_dtype(args) -> torch.dtype:
    """The model's dtype: bf16, fp16 or fp32 as ``args`` train."""
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def transformer_config(args, device: Device, layer_spec: str = "local") -> TransformerConfig:
    """``use_cpu_initialization`` on the CPU, and where asked for (``--use-cpu-initialization``:
    the same weights at every TP/TSP size, what a comparison of modes needs); else megatron
    initialises each shard on the GPU. ``layer_spec``: the layers built (:meth:`Mode.layer_spec`)."""
    dtype = params_dtype(args)
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
        tensor_model_parallel_size=ParallelSizes.of(args).tensor_slot,
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
        softmax_type=args.softmax_type,
        window_size=window_pair(args.window_size),
        window_attn_skip_freq=args.window_attn_skip_freq,
        **moe_config(args),
        hidden_dropout=args.hidden_dropout,
        init_method_std=args.init_method_std,
        layernorm_epsilon=args.norm_epsilon,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        use_cpu_initialization=args.use_cpu_initialization or not device.is_gpu,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,  # no megatron softmax: every mode attends with block_attention
        # the layers' kind, which torch FSDP2 wraps by (local: each layer whole, not its linears)
        transformer_impl="transformer_engine" if layer_spec == "transformer_engine" else "local",
        **recompute,
    )


def moe_config(args) -> Dict[str, Any]:
    """The ``TransformerConfig`` fields of megatron-core's MoE layers (none without experts):
    experts folded onto the model-parallel ranks, each whole on its rank (ETP 1), tokens
    moved to them by ``moe_token_dispatcher_type``."""
    if not args.num_experts:
        return {}
    return dict(num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
                moe_ffn_hidden_size=args.moe_ffn_hidden_size or args.ffn_hidden_size,
                moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
                moe_layer_freq=args.moe_layer_freq, moe_aux_loss_coeff=args.moe_aux_loss_coeff,
                moe_token_dispatcher_type=args.moe_token_dispatcher_type,
                expert_model_parallel_size=args.expert_model_parallel_size, expert_tensor_parallel_size=1,
                # set by the memory planner only (memory.BALANCED_ROUTING)
                moe_expert_capacity_factor=getattr(args, "moe_expert_capacity_factor", None),
                moe_pad_expert_input_to_capacity=getattr(args, "moe_pad_expert_input_to_capacity", False))


def model_args(args) -> Dict[str, Any]:
    """The arguments that decide the model's parameters and their shapes (not how it is split
    or trained): saved with a checkpoint and compared at load."""
    keys = ["num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
            "kv_channels", "position_embedding_type", "normalization", "swiglu", "disable_bias_linear",
            "add_qkv_bias", "qk_layernorm", "untie_embeddings_and_output_weights"]
    if args.position_embedding_type == "learned_absolute":
        keys.append("max_position_embeddings")
    if args.softmax_type != "vanilla":  # learnable: one more parameter; both: other math
        keys.append("softmax_type")
    if args.num_experts:  # the experts' parameters
        keys += ["num_experts", "moe_shared_expert_intermediate_size", "moe_layer_freq"]
    out = {key: getattr(args, key) for key in keys}
    if args.num_experts:
        out["moe_ffn_hidden_size"] = args.moe_ffn_hidden_size or args.ffn_hidden_size
    out["padded_vocab_size"] = data.padded_vocab(args)
    return out


def initialize(args, device: Device, seed: bool = True, **megatron_kwargs) -> None:
    """Process groups of the run (TSP, or TP/CP for a baseline) with their communicators
    created on ``device``, and, with ``seed``, the RNGs. On the CPU, megatron-core's CPU
    shims first (:mod:`compat`); for a model with experts, megatron-core's MoE fix
    (:mod:`upstream`)."""
    if not device.is_gpu:
        enable_cpu_support()
    if args.num_experts:
        fix_moe_without_transformer_engine()
    versions.forget_moe_metrics()  # an earlier model's in this process: sized by its layers, holding its tensors
    initialize_model_parallel(
        tsp_size=args.tsp_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        ring_mlp=args.ring_mlp,
        device=device.torch,
        **({"expert_model_parallel_size": args.expert_model_parallel_size, "expert_tensor_parallel_size": 1}
           if args.num_experts else {}),
        **megatron_kwargs,
    )
    if seed:
        torch.manual_seed(args.seed)
        model_parallel_cuda_manual_seed(args.seed)


def build(args, device: Device, mode: Optional[Mode] = None, attention_backend: str = "auto",
          clip_grad: Optional[float] = None, use_gloo_process_groups: bool = True,
          transformer_engine: Optional[bool] = None,
          fused_norm: bool = True, optimizer_args=None):
    """(TransformerConfig, DDP model chunks, optimizer) of the run on ``device``, as megatron-core
    builds them. ``mode`` defaults to the one ``args`` runs in (``tsp-no-overlap`` is the one
    it cannot tell); ``transformer_engine`` (default: ``--transformer-engine-spec``),
    ``fused_norm``: see :meth:`Mode.spec`;
    ``optimizer_args``: the learning rates to build the optimizer with, where not ``args``'s
    (:func:`megatron_tsp.run.loop.optimizer_args`)."""
    lrs = optimizer_args or args
    mode = mode or modes.of(args)
    config = transformer_config(args, device, mode.layer_spec(args, transformer_engine))
    spec = mode.spec(args, config, attention_backend, transformer_engine, fused_norm)
    model = step.build_model(
        config, spec, data.padded_vocab(args), device.torch,
        args.max_position_embeddings,
        position_embedding_type=args.position_embedding_type,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        fsdp=args.use_torch_fsdp2,
        ddp_config=DistributedDataParallelConfig(
            use_distributed_optimizer=args.use_distributed_optimizer,
            overlap_grad_reduce=args.overlap_grad_reduce,
            overlap_param_gather=args.overlap_param_gather,
            bucket_size=args.ddp_bucket_size,
            grad_reduce_in_fp32=args.bf16 or args.fp16,
        ),
    )
    if mode.tsp_layers:
        for chunk in model:
            vocab.apply_vocab_layout(step.unwrap(chunk), args.tsp_vocab, args.seq_length * args.micro_batch_size)
    optimizer = step.build_optimizer(model, OptimizerConfig(
        optimizer="adam", lr=lrs.lr, min_lr=lrs.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2,
        clip_grad=args.clip_grad if clip_grad is None else clip_grad,
        bf16=args.bf16, fp16=args.fp16, params_dtype=config.params_dtype,
        use_distributed_optimizer=args.use_distributed_optimizer,
    ), use_gloo_process_groups=use_gloo_process_groups)
    return config, model, optimizer


def stepper(args, device: Device, mode: Optional[Mode] = None, **build_kwargs) -> Callable[[], Dict]:
    """Build the model of ``mode`` on ``device`` and return a function that trains one
    micro-batch step on a new batch each call (seeds 0, 1, 2, ...: step n of every mode sees
    the same tokens), returning :func:`step.train_step`'s result with the loss reduced: what
    the benchmark and the GPU check time. Packed documents (``reset_attention_mask``) go the
    way training sends them; random tokens hold no EOD, so each sequence is one document."""
    mode = mode or modes.of(args)
    _, model, optimizer = build(args, device, mode, **build_kwargs)
    batches = data.make_batches(args.micro_batch_size, args.seq_length, args.vocab_size, device.torch)
    transform = mode.batch_transform(args)
    eod = data.documents_eod(args)

    def one_step() -> Dict:
        result = step.train_step(model, optimizer, [next(batches)], 1, args.seq_length, args.micro_batch_size,
                                 transform, eod)
        return dict(result, loss=step.global_losses([result["loss"]])[0])

    return one_step
