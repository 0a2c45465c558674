"""Run configurations: YAML whose keys are Megatron-LM argument names.

One format, three consumers: ``megatron-tsp train`` (megatron-core only), Megatron-LM's
``pretrain_gpt.py`` through ``megatron-tsp args`` (rendered as command-line flags) and the
planners of ``megatron-tsp memory`` / ``predict``. A file may ``extends:`` another (path
relative to itself); later keys win. Every key must be in :data:`ARGUMENTS`, the subset of
Megatron-LM (core_v0.16.1) arguments this project understands, plus ``tsp_size``.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional

import yaml


@dataclass(frozen=True)
class Arg:
    type: type
    default: Any
    help: str


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
    "untie_embeddings_and_output_weights": _b("separate output layer weights"),
    "attention_dropout": Arg(float, 0.1, "attention dropout (TSP needs 0)"),
    "hidden_dropout": Arg(float, 0.1, "hidden dropout"),
    "init_method_std": Arg(float, 0.02, "weight init std"),
    "norm_epsilon": Arg(float, 1e-5, "norm epsilon"),
    # parallelism
    "tsp_size": Arg(int, 1, "TSP size D (megatron_tsp)"),
    "tensor_model_parallel_size": Arg(int, 1, "tensor parallel size"),
    "sequence_parallel": _b("Megatron sequence parallelism (implied by tsp_size > 1)"),
    "context_parallel_size": Arg(int, 1, "context parallel size"),
    "pipeline_model_parallel_size": Arg(int, 1, "pipeline parallel size"),
    "use_distributed_optimizer": _b("shard optimizer state over data parallel"),
    "overlap_grad_reduce": _b("overlap DP gradient reduce with backward"),
    "overlap_param_gather": _b("overlap DP parameter gather with forward"),
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
    "log_interval": Arg(int, 1, "iterations between log lines"),
    # data
    "mock_data": _b("synthetic data"),
    "data_path": Arg(list, None, "megatron indexed dataset prefixes"),
    "split": Arg(str, "99,1,0", "train,valid,test split"),
    "tokenizer_type": Arg(str, "NullTokenizer", "tokenizer"),
    "vocab_size": Arg(int, None, "vocabulary size (NullTokenizer)"),
    "make_vocab_size_divisible_by": Arg(int, 128, "pad the vocabulary to a multiple of this (and of the TP/TSP size)"),
    # checkpoints
    "save": Arg(str, None, "checkpoint directory to save to"),
    "load": Arg(str, None, "checkpoint directory to resume from"),
    "save_interval": Arg(int, None, "iterations between checkpoints"),
}

# Keys whose value names no Megatron-LM flag (read by megatron_tsp only).
META_KEYS = ("extends",)


class ConfigError(ValueError):
    """A bad configuration; the message names the file and the key."""


def load_config(path: str) -> Dict[str, Any]:
    """The merged key/value dict of ``path`` and the files it ``extends``."""
    return _load(os.path.abspath(path), seen=())


def _load(path: str, seen: tuple) -> Dict[str, Any]:
    if path in seen:
        raise ConfigError(f"{path}: 'extends' cycle through {' -> '.join(seen)}")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config is a mapping of Megatron-LM argument names to values")
    merged: Dict[str, Any] = {}
    parent = data.pop("extends", None)
    if parent is not None:
        merged.update(_load(os.path.join(os.path.dirname(path), parent), seen + (path,)))
    check_keys(data, path)
    merged.update(data)
    return merged


def check_keys(values: Dict[str, Any], where: str) -> None:
    for key, value in values.items():
        if key not in ARGUMENTS:
            raise ConfigError(f"{where}: unknown key '{key}' (not a supported Megatron-LM argument)")
        arg = ARGUMENTS[key]
        ok = value is None or isinstance(value, arg.type) or (arg.type is float and isinstance(value, int))
        if arg.type is int and isinstance(value, bool):
            ok = False
        if not ok:
            raise ConfigError(f"{where}: key '{key}' must be {arg.type.__name__} (got {value!r})")


def resolve(values: Dict[str, Any]) -> argparse.Namespace:
    """All arguments with defaults filled in and derived values set; checks combinations."""
    args = {key: arg.default for key, arg in ARGUMENTS.items()}
    args.update(values)
    ns = argparse.Namespace(**args)
    if ns.ffn_hidden_size is None:
        ns.ffn_hidden_size = 4 * ns.hidden_size
    if ns.kv_channels is None:
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


def model_parallel_size(ns: argparse.Namespace) -> int:
    """Ranks of one model replica: TSP x TP x CP x PP."""
    return (ns.tsp_size * ns.tensor_model_parallel_size * ns.context_parallel_size
            * ns.pipeline_model_parallel_size)


def check_combinations(ns: argparse.Namespace) -> None:
    """Impossible or unsupported combinations, each naming its key."""
    from megatron_tsp.parallel_state import check_parallel_sizes

    d = ns.tsp_size
    try:
        check_parallel_sizes(model_parallel_size(ns), d,
                             ns.pipeline_model_parallel_size, ns.tensor_model_parallel_size,
                             ns.context_parallel_size)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    checks = [
        (ns.num_attention_heads % (d * ns.tensor_model_parallel_size) == 0, "num_attention_heads",
         "must be divisible by tsp_size x tensor_model_parallel_size"),
        (ns.num_query_groups % (d * ns.tensor_model_parallel_size) == 0, "num_query_groups",
         "must be divisible by tsp_size x tensor_model_parallel_size"),
        (ns.ffn_hidden_size % (d * ns.tensor_model_parallel_size) == 0, "ffn_hidden_size",
         "must be divisible by tsp_size x tensor_model_parallel_size"),
        (ns.seq_length % (2 * d * ns.context_parallel_size) == 0 or (d == 1 and ns.context_parallel_size == 1),
         "seq_length", "must be divisible by 2 x tsp_size (zigzag) and 2 x context_parallel_size"),
        (d == 1 or ns.attention_dropout == 0, "attention_dropout", "must be 0 with tsp_size > 1"),
        (ns.position_embedding_type in ("rope", "learned_absolute"), "position_embedding_type",
         "must be rope or learned_absolute"),
        (ns.normalization in ("LayerNorm", "RMSNorm"), "normalization", "must be LayerNorm or RMSNorm"),
        (not (ns.bf16 and ns.fp16), "bf16", "cannot be combined with fp16"),
        (ns.mock_data or ns.data_path, "data_path", "is required unless mock_data is true"),
        (ns.recompute_granularity in (None, "full", "selective"), "recompute_granularity",
         "must be full or selective"),
        (ns.recompute_granularity != "full" or ns.recompute_method in ("uniform", "block"),
         "recompute_method", "must be uniform or block with recompute_granularity full"),
        (ns.lr_warmup_iters < ns.lr_decay_iters, "lr_warmup_iters", "must be below lr_decay_iters "
         "(default train_iters)"),
        (ns.tokenizer_type != "NullTokenizer" or ns.vocab_size, "vocab_size",
         "is required with tokenizer_type NullTokenizer"),
    ]
    for ok, key, message in checks:
        if not ok:
            raise ConfigError(f"'{key}' {message} (got {getattr(ns, key)!r})")


def to_megatron_flags(values: Dict[str, Any]) -> List[str]:
    """Megatron-LM command-line flags for the keys set in a config (not the defaults)."""
    flags: List[str] = []
    for key, value in values.items():
        if key in META_KEYS or value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            if value:
                flags.append(flag)
        elif isinstance(value, list):
            flags.append(flag)
            flags.extend(str(v) for v in value)
        else:
            flags.extend([flag, str(value)])
    return flags


def add_arguments(parser: argparse.ArgumentParser, keys: Optional[Iterable[str]] = None) -> None:
    """Megatron-style ``--flag`` overrides for every config key (default: unset)."""
    for key in keys or ARGUMENTS:
        arg = ARGUMENTS[key]
        flag = "--" + key.replace("_", "-")
        if arg.type is bool:
            parser.add_argument(flag, dest=key, action="store_const", const=True, default=None, help=arg.help)
        elif arg.type is list:
            parser.add_argument(flag, dest=key, nargs="+", default=None, help=arg.help)
        else:
            parser.add_argument(flag, dest=key, type=arg.type, default=None, help=arg.help)


def overrides(ns: argparse.Namespace) -> Dict[str, Any]:
    """The config keys given on the command line."""
    return {k: getattr(ns, k) for k in ARGUMENTS if getattr(ns, k, None) is not None}
