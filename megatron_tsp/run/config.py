"""Run configurations: YAML whose keys are Megatron-LM argument names.

One format, three consumers: ``megatron-tsp train`` (megatron-core only), Megatron-LM's
``pretrain_gpt.py`` through ``megatron-tsp args`` (rendered as command-line flags) and the
planners of ``megatron-tsp memory`` / ``predict``. A file may ``extends:`` another (path
relative to itself); later keys win. Every key must be in :data:`ARGUMENTS`, the subset of
Megatron-LM (core_v0.16.1) arguments this project understands, plus ``tsp_size``.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional

import yaml

from megatron_tsp.core.sizes import ParallelSizes
from megatron_tsp.core.support import RULES, causal_window, violations
from megatron_tsp.errors import ConfigError


@dataclass(frozen=True)
class Arg:
    type: type
    default: Any
    help: str
    # Megatron-LM's flag where it is not ``--`` + the key with dashes (on-by-default switches)
    flag: Optional[str] = None
    # a str that Megatron-LM reads as "a,b": a YAML list is written so
    comma: bool = False


def _b(help_: str) -> Arg:
    return Arg(bool, False, help_)


ARGUMENTS: Dict[str, Arg] = {
    # model
    "num_layers": Arg(int, 2, "transformer layers"),
    "hidden_size": Arg(int, 64, "hidden size h"),
    "ffn_hidden_size": Arg(int, None, "MLP hidden size (default 4h)"),
    "num_attention_heads": Arg(int, 4, "attention heads a"),
    "group_query_attention": _b("use grouped-query attention"),
    "num_query_groups": Arg(int, None, "KV heads g (with group_query_attention)"),
    "kv_channels": Arg(int, None, "head dim (default h/a)"),
    "seq_length": Arg(int, 64, "sequence length S"),
    "max_position_embeddings": Arg(int, None, "position table size (default seq_length)"),
    "position_embedding_type": Arg(str, "learned_absolute", "rope or learned_absolute"),
    "rotary_base": Arg(int, 10000, "RoPE base"),
    "normalization": Arg(str, "LayerNorm", "LayerNorm or RMSNorm"),
    "swiglu": _b("SwiGLU MLP"),
    "disable_bias_linear": _b("no biases in linear layers"),
    "add_qkv_bias": _b("QKV bias even with disable_bias_linear"),
    "qk_layernorm": _b("layer norm on queries and keys"),
    "softmax_type": Arg(str, "vanilla", "attention softmax: vanilla, off-by-one (a sink logit 0) or learnable "
                                        "(a sink logit per head, trained; gpt-oss's attention sinks)"),
    "window_size": Arg(str, None, "sliding-window attention 'W,0': a query sees itself and the W keys before it "
                                  "(megatron-core's window_size)", comma=True),
    "window_attn_skip_freq": Arg(int, None, "with window_size: every N-th layer attends to every earlier key"),
    "untie_embeddings_and_output_weights": _b("separate output layer weights"),
    # mixture-of-experts (megatron-core's MoE layers; experts folded onto the model-parallel ranks, each whole)
    "num_experts": Arg(int, None, "experts per MoE layer (megatron-core's MoE layers)"),
    "moe_router_topk": Arg(int, 2, "experts each token is routed to"),
    "moe_ffn_hidden_size": Arg(int, None, "an expert's MLP hidden size (default ffn_hidden_size)"),
    "moe_shared_expert_intermediate_size": Arg(int, None, "the shared experts' MLP hidden size (none by default)"),
    "moe_layer_freq": Arg(int, 1, "every N-th layer is an MoE layer, from the first"),
    "moe_aux_loss_coeff": Arg(float, 0.0, "load-balancing loss coefficient"),
    "moe_token_dispatcher_type": Arg(str, "alltoall", "how tokens reach their experts: alltoall or allgather"),
    "expert_model_parallel_size": Arg(int, 1, "ranks the experts are sharded over (a divisor of the TSP size, or of "
                                              "TP x CP: folded onto the model-parallel ranks)"),
    "attention_dropout": Arg(float, 0.1, "attention dropout (TSP needs 0)"),
    "hidden_dropout": Arg(float, 0.1, "hidden dropout"),
    "init_method_std": Arg(float, 0.02, "weight init std"),
    "use_cpu_initialization": _b("initialise weights on the CPU (the same at every TP/TSP size), then move them"),
    "norm_epsilon": Arg(float, 1e-5, "norm epsilon"),
    # parallelism
    "tsp_size": Arg(int, 1, "TSP size D (megatron_tsp)"),
    "tensor_model_parallel_size": Arg(int, 1, "tensor parallel size"),
    "sequence_parallel": _b("Megatron sequence parallelism (implied by tsp_size > 1)"),
    "ring_mlp": _b("TSP's ring MLP in a tensor-parallel model: weight shards rotate, no activation collectives"),
    "tsp_lookahead": Arg(int, 1, "TSP attention: head-group weight shards in flight ahead of the one in use (each "
                                 "one more shard of memory; stages' shards with tsp_head_groups_per_call > 1)"),
    "tsp_head_groups_per_call": Arg(int, 0, "TSP attention: head groups attended side by side, with one K/V gather "
                                            "and one kernel call per block (a divisor of tsp_size; 0: on a GPU the "
                                            "fewest that fill it at this sequence length, 1 on the CPU)"),
    "tsp_mlp_shards_per_call": Arg(int, 0, "TSP MLP: weight shards computed with at once: 1 (round the ring), "
                                           "tsp_size (every shard gathered: one GEMM each), or 0 (tsp_size where "
                                           "the attention puts every head group in one call, else 1)"),
    "tsp_vocab": Arg(str, "auto", "TSP's embedding and output layer: table (all-gather the vocabulary table, each "
                                  "rank scores its own tokens), sequence (megatron's sequence-parallel collectives "
                                  "of the activations), auto (the one that moves fewer bytes)"),
    "transformer_engine_spec": Arg(bool, None, "baselines (TP, TP+SP, TP x CP, cp-fsdp) on megatron's "
                                               "TransformerEngine layer spec, as Megatron-LM builds them (default: "
                                               "where TE is installed and applies); --no-transformer-engine-spec: on "
                                               "the attention op and norms TSP uses, the same kernels as TSP's"),
    "context_parallel_size": Arg(int, 1, "context parallel size"),
    "pipeline_model_parallel_size": Arg(int, 1, "pipeline parallel size"),
    "use_distributed_optimizer": _b("shard optimizer state over data parallel"),
    "gradient_accumulation_fusion": Arg(bool, True, "Megatron-LM's weight-gradient GEMMs accumulating into "
                                                    "main_grad (with TransformerEngine or apex; megatron-tsp's own "
                                                    "loop does not fuse them)",
                                        flag="--no-gradient-accumulation-fusion"),
    "use_torch_fsdp2": _b("torch FSDP2 (megatron's TorchFullyShardedDataParallel, as Megatron-LM's --use-torch-fsdp2): "
                          "parameters, gradients and optimizer state sharded over the data-parallel x "
                          "context-parallel ranks, each layer's weights all-gathered as it runs"),
    "overlap_grad_reduce": _b("overlap DP gradient reduce with backward"),
    "overlap_param_gather": _b("overlap DP parameter gather with forward (distributed optimizer)"),
    "ddp_bucket_size": Arg(int, None, "parameters per DP communication bucket (default: megatron's, "
                                      "max(40M, 1M x DP))"),
    # training
    "micro_batch_size": Arg(int, 1, "micro-batch size"),
    "global_batch_size": Arg(int, None, "global batch size (default micro x DP)"),
    "train_iters": Arg(int, 20, "iterations"),
    "lr": Arg(float, 1e-3, "peak learning rate"),
    "min_lr": Arg(float, 0.0, "final learning rate"),
    "lr_decay_style": Arg(str, "cosine", "constant, linear or cosine"),
    "lr_warmup_iters": Arg(int, 0, "warm-up iterations"),
    "lr_decay_iters": Arg(int, None, "decay iterations (default train_iters)"),
    "weight_decay": Arg(float, 0.01, "weight decay"),
    "clip_grad": Arg(float, 1.0, "gradient clipping norm"),
    "adam_beta1": Arg(float, 0.9, "Adam beta1"),
    "adam_beta2": Arg(float, 0.999, "Adam beta2"),
    "seed": Arg(int, 1234, "random seed"),
    "bf16": _b("bf16 training"),
    "fp16": _b("fp16 training"),
    "recompute_granularity": Arg(str, None, "full or selective"),
    "recompute_method": Arg(str, None, "uniform or block"),
    "recompute_num_layers": Arg(int, None, "layers per recompute unit"),
    "recompute_modules": Arg(list, None, "selective recompute of: core_attn (default), mlp, layernorm, moe"),
    "log_interval": Arg(int, 1, "iterations between log lines"),
    "check_for_nan_in_loss_and_grad": Arg(bool, True, "stop on a NaN/Inf loss or gradient norm",
                                          flag="--no-check-for-nan-in-loss-and-grad"),
    # data
    "mock_data": _b("synthetic data"),
    "data_path": Arg(list, None, "megatron indexed dataset prefixes"),
    "split": Arg(str, "99,1,0", "train,valid,test split"),
    "tokenizer_type": Arg(str, "NullTokenizer", "tokenizer"),
    "vocab_size": Arg(int, None, "vocabulary size (NullTokenizer)"),
    "make_vocab_size_divisible_by": Arg(int, 128, "pad the vocabulary to a multiple of this (and of the TP/TSP size)"),
    "reset_attention_mask": _b("packed documents: a token attends to its own document only (its end: the EOD token)"),
    "reset_position_ids": _b("positions restart at every document"),
    "eod_mask_loss": _b("no loss on the EOD token"),
    # checkpoints
    "save": Arg(str, None, "checkpoint directory to save to"),
    "load": Arg(str, None, "checkpoint directory to resume from"),
    "save_interval": Arg(int, None, "iterations between checkpoints"),
    # stopping early (Megatron-LM's meaning): save, then exit 0
    "exit_signal_handler": _b("on SIGTERM (preemption, scancel, a time limit) finish the step, save, exit 0"),
    "exit_duration_in_mins": Arg(int, None, "save and exit after this many minutes of training"),
    "exit_interval": Arg(int, None, "save and exit at the first iteration divisible by this"),
    # resuming with another learning-rate or weight-decay schedule (Megatron-LM's choice of two)
    "override_opt_param_scheduler": _b("on --load, take this run's schedule over the checkpoint's"),
    "use_checkpoint_opt_param_scheduler": _b("on --load, keep the checkpoint's schedule over this run's"),
}

# Keys whose value names no Megatron-LM flag (read by megatron_tsp only).
META_KEYS = ("extends",)


def load_config(path: str) -> Dict[str, Any]:
    """The merged key/value dict of ``path`` and the files it ``extends``."""
    return _load(os.path.abspath(path), seen=())


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error naming the
    key and both lines (plain YAML keeps the last one without a word)."""

    def construct_mapping(self, node, deep=False):
        first_line: Dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                line = first_line.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:  # an unhashable key: the safe loader's own error follows
                break
            if line != key_node.start_mark.line + 1:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice (lines {line} and {key_node.start_mark.line + 1}); "
                                "keep one", key_node.start_mark)
        return super().construct_mapping(node, deep)


def read_yaml(path: str, extended_by: Optional[str] = None) -> Any:
    """The parsed YAML file; one ConfigError line for a missing, unreadable or invalid file."""
    by = f" (extended by {extended_by})" if extended_by else ""
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.load(f, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}{by}") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}{by}: is a directory; give a YAML config file") from None
    except PermissionError:
        raise ConfigError(f"{path}{by}: cannot be read (permission denied)") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}{by}: not a text file; a config is YAML") from None
    except RecursionError:
        raise ConfigError(f"{path}{by}: nested too deeply; a config is a flat mapping of keys to values") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else path
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{where}{by}: not valid YAML ({problem})") from None


def _load(path: str, seen: tuple, extended_by: Optional[str] = None) -> Dict[str, Any]:
    if path in seen:
        raise ConfigError(f"{path}: 'extends' cycle through {' -> '.join(seen)}")
    data = read_yaml(path, extended_by)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config is a mapping of Megatron-LM argument names to values "
                          f"(got a {type(data).__name__})")
    merged: Dict[str, Any] = {}
    parent = data.pop("extends", None)
    if parent is not None:
        if not isinstance(parent, str):
            raise ConfigError(f"{path}: 'extends' must be the path of one config file (got {parent!r})")
        merged.update(_load(os.path.join(os.path.dirname(path), parent), seen + (path,), path))
    merged.update(typed(data, path))
    return merged


def typed(values: Dict[str, Any], where: str) -> Dict[str, Any]:
    """``values`` with every key known and every value of its key's type.

    A string is converted where Megatron-LM's command line would convert it: YAML reads
    ``lr: 3e-3`` (no dot) as a string, ``--lr 3e-3`` is a float. A single ``data_path``
    string is a one-element list.
    """
    out = {}
    for key, value in values.items():
        if key not in ARGUMENTS:
            raise ConfigError(f"{where}: unknown key '{key}' (not a supported Megatron-LM argument)")
        arg = ARGUMENTS[key]
        if isinstance(value, str) and arg.type in (int, float):
            try:
                value = arg.type(value)
            except ValueError:
                pass
        elif isinstance(value, str) and arg.type is list:
            value = [value]
        elif isinstance(value, list) and arg.comma:
            value = ",".join(str(v) for v in value)
        ok = value is None or isinstance(value, arg.type) or (arg.type is float and isinstance(value, int))
        if arg.type is list and isinstance(value, list):
            ok = all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value)
        if arg.type in (int, float) and isinstance(value, bool):
            ok = False
        if not ok:
            raise ConfigError(f"{where}: key '{key}' must be {arg.type.__name__} (got {value!r})")
        out[key] = value
    return out


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def named(key: str) -> str:
    """How a message names a setting: the config key and the command-line flag."""
    return f"'{key}' ({_flag(key)})"


def resolve(values: Dict[str, Any]) -> argparse.Namespace:
    """All arguments with defaults filled in and derived values set; checks values and
    combinations (one :class:`ConfigError` naming the key)."""
    args = {key: arg.default for key, arg in ARGUMENTS.items()}
    args.update(values)
    ns = argparse.Namespace(**args)
    check_values(ns)
    if ns.ffn_hidden_size is None:
        ns.ffn_hidden_size = 4 * ns.hidden_size
    if ns.kv_channels is None:
        if ns.hidden_size % ns.num_attention_heads:
            raise ConfigError(f"{named('hidden_size')} {ns.hidden_size} must be divisible by "
                              f"num_attention_heads {ns.num_attention_heads}, or set kv_channels")
        ns.kv_channels = ns.hidden_size // ns.num_attention_heads
    if ns.num_query_groups is None or not ns.group_query_attention:
        ns.num_query_groups = ns.num_attention_heads
    if ns.max_position_embeddings is None:
        ns.max_position_embeddings = ns.seq_length
    if ns.lr_decay_iters is None:
        ns.lr_decay_iters = ns.train_iters
    if ns.tsp_size > 1:
        ns.sequence_parallel = True
    check_combinations(ns)
    return ns


def te_spec_conflicts(ns: argparse.Namespace) -> List[tuple]:
    """``(key, why)`` for each setting of ``ns`` that megatron's TransformerEngine layer spec
    does not take here: a TSP layout, experts, packed documents. ``transformer_engine_spec``
    unset (None) is decided where the layers are built, with the device up
    (:meth:`~megatron_tsp.run.modes.Mode.layer_spec`): TransformerEngine's import may start
    CUDA, which must not happen before a job's environment is set."""
    return [(key, why) for conflict, key, why in (
        (sizes(ns).tsp > 1, "transformer_engine_spec", "applies to the baselines; TSP's layers are its own"),
        (ns.num_experts, "transformer_engine_spec", "with num_experts is not implemented here (its layers would be "
                                                    "dense); drop it"),
        (ns.reset_attention_mask, "reset_attention_mask", "reaches the attention as the documents' starts, which "
                                                          "TransformerEngine's layers do not take here; drop "
                                                          "--transformer-engine-spec"),
    ) if conflict]


POSITIVE_INTS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "seq_length", "max_position_embeddings", "rotary_base", "tsp_size", "tensor_model_parallel_size",
    "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_layer_freq",
    "expert_model_parallel_size",
    "context_parallel_size", "pipeline_model_parallel_size", "micro_batch_size", "global_batch_size",
    "train_iters", "lr_decay_iters", "recompute_num_layers", "log_interval", "vocab_size",
    "make_vocab_size_divisible_by", "save_interval", "exit_duration_in_mins", "exit_interval", "ddp_bucket_size",
    "window_attn_skip_freq",
)
NON_NEGATIVE = ("lr", "min_lr", "lr_warmup_iters", "weight_decay", "clip_grad", "seed", "moe_aux_loss_coeff")
POSITIVE_FLOATS = ("init_method_std", "norm_epsilon")
FRACTIONS = ("attention_dropout", "hidden_dropout", "adam_beta1", "adam_beta2")  # in [0, 1)
MAX_SEED = 2**31
RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm", "moe")  # megatron's; moe: its MoE layers whole
CHOICES = {
    "position_embedding_type": ("rope", "learned_absolute"),
    "softmax_type": ("vanilla", "off-by-one", "learnable"),
    "tsp_vocab": ("auto", "table", "sequence"),
    "moe_token_dispatcher_type": ("alltoall", "allgather"),
    "normalization": ("LayerNorm", "RMSNorm"),
    "lr_decay_style": ("constant", "linear", "cosine", "inverse-square-root"),
    "recompute_granularity": (None, "full", "selective"),
    "recompute_method": (None, "uniform", "block"),
}


def check_values(ns: argparse.Namespace) -> None:
    """Each value on its own: sizes positive, rates finite, choices known."""
    def bad(key: str, must: str) -> ConfigError:
        return ConfigError(f"{named(key)} must be {must} (got {getattr(ns, key)!r})")

    for key in POSITIVE_INTS:
        value = getattr(ns, key)
        if (value is None and ARGUMENTS[key].default is not None) or (value is not None and value < 1):
            raise bad(key, "a positive integer")
    for key in NON_NEGATIVE + POSITIVE_FLOATS + FRACTIONS:
        if getattr(ns, key) is None or not math.isfinite(getattr(ns, key)):
            raise bad(key, "a finite number")
    for key in NON_NEGATIVE:
        if getattr(ns, key) < 0:
            raise bad(key, ">= 0")
    if ns.seed >= MAX_SEED:  # megatron adds rank offsets; numpy takes seeds below 2**32
        raise bad("seed", f"below {MAX_SEED}")
    for key in POSITIVE_FLOATS:
        if getattr(ns, key) <= 0:
            raise bad(key, "> 0")
    for key in FRACTIONS:
        if not 0 <= getattr(ns, key) < 1:
            raise bad(key, "in [0, 1)")
    for key, choices in CHOICES.items():
        if getattr(ns, key) not in choices:
            raise bad(key, "one of " + ", ".join(str(c) for c in choices if c is not None))
    unknown = set(ns.recompute_modules or ()) - set(RECOMPUTE_MODULES)
    if unknown:
        raise bad("recompute_modules", f"a list of {', '.join(RECOMPUTE_MODULES)}")
    if "moe" in (ns.recompute_modules or ()) and not ns.num_experts:
        raise bad("recompute_modules", "without moe: the model has no mixture-of-experts layers (num_experts)")
    if ns.min_lr > ns.lr:
        raise bad("min_lr", f"<= lr {ns.lr}")
    try:
        causal = causal_window(ns.window_size)
    except ValueError:
        causal = False
    if not causal:  # every mode's attention is causal (the TSP rule says it again, in its words)
        raise bad("window_size", "W,0 with W >= 0: a query sees itself and the W keys before it")
    parts = ns.split.split(",")
    if len(parts) != 3 or not all(re.fullmatch(r"\d+(\.\d*)?", p.strip()) for p in parts) \
            or float(parts[0]) <= 0:
        raise bad("split", "three numbers train,valid,test with train > 0, for example 99,1,0")


def sizes(ns: argparse.Namespace, world_size: Optional[int] = None, source: str = "world size") -> ParallelSizes:
    """The parallel layout of resolved arguments on ``world_size`` ranks (None: one replica),
    checked (one ConfigError line; ``source`` says where the world size came from)."""
    try:
        return ParallelSizes.of(ns, world_size).validate(source)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def check_combinations(ns: argparse.Namespace) -> None:
    """Impossible combinations, each naming its key, after what TSP does not support
    (:mod:`megatron_tsp.core.support`, the only statement of it)."""
    if ns.override_opt_param_scheduler and ns.use_checkpoint_opt_param_scheduler:
        raise ConfigError(f"{named('override_opt_param_scheduler')} and "
                          f"{named('use_checkpoint_opt_param_scheduler')} exclude each other; choose one")
    layout = sizes(ns)
    tsp_settings = {rule.flag: getattr(ns, rule.key) for rule in RULES if rule.key in ARGUMENTS}
    for message in violations(tsp_settings, layout.tsp, name=lambda rule: named(rule.key)):
        raise ConfigError(message)
    if ns.ring_mlp and layout.tsp == 1:  # the ring's rows, as Megatron-LM's --ring-mlp reads them
        for message in violations(tsp_settings, layout.tp, ("all", "mlp"), name=lambda rule: named(rule.key),
                                  under="--ring-mlp"):
            raise ConfigError(message)
    tp = layout.tp  # megatron's own tensor-parallel constraints (TSP's are the rules above)
    checks = [
        (ns.num_attention_heads % tp == 0, "num_attention_heads", "must be divisible by tensor_model_parallel_size"),
        (ns.num_query_groups % tp == 0, "num_query_groups", "must be divisible by tensor_model_parallel_size"),
        (ns.num_attention_heads % ns.num_query_groups == 0, "num_query_groups",
         "must divide num_attention_heads"),
        (ns.ffn_hidden_size % tp == 0, "ffn_hidden_size", "must be divisible by tensor_model_parallel_size"),
        (layout.tsp > 1 or ns.seq_length % layout.sequence_divisor == 0, "seq_length",
         f"must be divisible by {layout.sequence_divisor} (2 x context_parallel_size for the zigzag layout, "
         "and tensor_model_parallel_size with sequence parallelism or the ring MLP)"),
        (not ns.ring_mlp or (layout.tsp == 1 and tp > 1), "ring_mlp",
         "applies to a tensor-parallel model (tensor_model_parallel_size > 1, tsp_size 1; TSP's MLP is a ring "
         "already)"),
        (ns.position_embedding_type != "learned_absolute" or ns.max_position_embeddings >= ns.seq_length,
         "max_position_embeddings", "must be at least seq_length with learned_absolute positions"),
        (not (ns.bf16 and ns.fp16), "bf16", "cannot be combined with fp16"),
        (ns.mock_data or ns.data_path, "data_path", "is required unless mock_data is true"),
        (ns.recompute_granularity != "full" or ns.recompute_method in ("uniform", "block"),
         "recompute_method", "must be uniform or block with recompute_granularity full"),
        (not ns.recompute_modules or ns.recompute_granularity == "selective", "recompute_modules",
         "applies to recompute_granularity selective only"),
        (ns.lr_warmup_iters < ns.lr_decay_iters, "lr_warmup_iters",
         f"must be below lr_decay_iters {ns.lr_decay_iters} (default: train_iters, here {ns.train_iters}); "
         "lower the warm-up or raise --train-iters / --lr-decay-iters"),
        *((not bad, "use_torch_fsdp2", why) for bad, why in (
            (ns.pipeline_model_parallel_size > 1, "is not supported with pipeline parallelism (as in Megatron-LM)"),
            (ns.use_distributed_optimizer, "shards the optimizer state itself: set use_distributed_optimizer false "
                                           "(as in Megatron-LM)"),
            (not ns.untie_embeddings_and_output_weights, "needs untie_embeddings_and_output_weights (as in "
                                                         "Megatron-LM)"),
            (ns.fp16, "is not supported with fp16 (as in Megatron-LM); use bf16"),
            (ns.gradient_accumulation_fusion, "is not supported with gradient accumulation fusion (as in "
                                              "Megatron-LM): set gradient_accumulation_fusion false"),
            (layout.tsp > 1, "applies to the baselines; TSP shards its weights itself"),
            (ns.num_experts, "is not supported with experts (as in Megatron-LM)"),
            (ns.save or ns.load, "checkpoints are not implemented for it here (Megatron-LM writes them with "
                                 "--ckpt-format torch_dist); drop --save and --load"),
        ) if ns.use_torch_fsdp2),
        (not ns.overlap_param_gather or (ns.use_distributed_optimizer and ns.overlap_grad_reduce),
         "overlap_param_gather", "needs use_distributed_optimizer and overlap_grad_reduce (as in Megatron-LM)"),
        (ns.attention_dropout == 0 or ns.transformer_engine_spec, "attention_dropout",
         "must be 0: the attention op TSP and these baselines run has no dropout (TransformerEngine's layer spec, "
         "--transformer-engine-spec, has)"),
        (ns.tokenizer_type != "NullTokenizer" or ns.vocab_size, "vocab_size",
         "is required with tokenizer_type NullTokenizer"),
        (ns.window_attn_skip_freq is None or ns.window_size, "window_attn_skip_freq", "applies with window_size"),
        (ns.num_experts is None or ns.moe_router_topk <= ns.num_experts, "moe_router_topk",
         f"must be at most num_experts {ns.num_experts}"),
        (ns.num_experts is None or ns.num_experts % ns.expert_model_parallel_size == 0, "num_experts",
         f"must be divisible by expert_model_parallel_size {ns.expert_model_parallel_size}"),
        (ns.expert_model_parallel_size == 1 or ns.num_experts, "expert_model_parallel_size",
         "applies with num_experts"),
        (ns.num_experts or not (ns.moe_ffn_hidden_size or ns.moe_shared_expert_intermediate_size
                                or ns.moe_layer_freq != 1 or ns.moe_aux_loss_coeff), "num_experts",
         "is needed by the moe_* settings given (they apply to mixture-of-experts layers)"),
        (not ns.moe_shared_expert_intermediate_size or ns.moe_shared_expert_intermediate_size % layout.tensor_slot == 0,
         "moe_shared_expert_intermediate_size", f"must be divisible by the model-parallel size {layout.tensor_slot} "
         "(the shared experts are split over it, as a TP MLP)"),
        (layout.tsp > 1 or (layout.tp * layout.cp) % ns.expert_model_parallel_size == 0, "expert_model_parallel_size",
         f"must divide tensor_model_parallel_size x context_parallel_size = {layout.tp * layout.cp} (the experts "
         "are folded onto the model-parallel ranks)"),
        (not (ns.num_experts and ns.ring_mlp), "ring_mlp", "with num_experts is not implemented; drop one"),
        *((False, key, why) for key, why in (te_spec_conflicts(ns) if ns.transformer_engine_spec else ())),
    ]
    for ok, key, message in checks:
        if not ok:
            raise ConfigError(f"{named(key)} {message} (got {getattr(ns, key)!r})")


def to_megatron_flags(values: Dict[str, Any]) -> List[str]:
    """Megatron-LM command-line flags for the keys set in a config (not the defaults)."""
    flags: List[str] = []
    for key, value in values.items():
        if key in META_KEYS or value is None:
            continue
        arg = ARGUMENTS[key]
        if key == "transformer_engine_spec":  # Megatron-LM picks a baseline's layers by --transformer-impl
            flags.extend(["--transformer-impl", "transformer_engine" if value else "local"])
        elif arg.flag:  # an on-by-default switch: Megatron-LM only has its --no- flag
            if value != arg.default:
                flags.append(arg.flag)
        elif isinstance(value, bool):
            if value:
                flags.append(_flag(key))
        elif isinstance(value, list):
            flags.append(_flag(key))
            flags.extend(str(v) for v in value)
        else:
            flags.extend([_flag(key), str(value)])
    return flags


def add_arguments(parser: argparse.ArgumentParser, keys: Optional[Iterable[str]] = None) -> None:
    """Megatron-style ``--flag`` overrides for every config key (default: unset)."""
    for key in keys or ARGUMENTS:
        arg = ARGUMENTS[key]
        if arg.flag:
            parser.add_argument(arg.flag, dest=key, action="store_const", const=not arg.default, default=None,
                                help=f"turn off: {arg.help}")
        elif arg.type is bool:
            parser.add_argument(_flag(key), dest=key, action="store_const", const=True, default=None, help=arg.help)
            parser.add_argument("--no-" + _flag(key)[2:], dest=key, action="store_const", const=False,
                                help=f"turn off {_flag(key)} where a config turns it on")
        elif arg.type is list:
            parser.add_argument(_flag(key), dest=key, nargs="+", default=None, help=arg.help)
        else:
            parser.add_argument(_flag(key), dest=key, type=arg.type, default=None, help=arg.help)


def overrides(ns: argparse.Namespace) -> Dict[str, Any]:
    """The config keys given on the command line."""
    return {k: getattr(ns, k) for k in ARGUMENTS if getattr(ns, k, None) is not None}


def at_seq_length(values: Dict, seq: int) -> Dict:
    """The config at sequence length ``seq`` (the position table grown to cover it)."""
    return dict(values, seq_length=seq, max_position_embeddings=max(seq, values.get("max_position_embeddings") or 0))
