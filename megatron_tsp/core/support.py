"""What TSP supports: one row per Megatron-LM setting that TSP restricts, and per setting of
TSP's own.

Each :class:`Rule` names the flag, says which values TSP accepts at size D, why, and the fix.
Every reader gets one wording (:meth:`Rule.message`):

* model build: the TSP layers check their ``TransformerConfig`` and their own settings
  (:func:`check_attention_config`, :func:`check_mlp_config`; ``core.attention``,
  ``core.mlp``, ``core.hybrid``), so a wrong model never runs; a config field that no rule
  reads and that TSP does not implement (:data:`CONFIG_IMPLEMENTED`) or ignore harmlessly
  (:data:`CONFIG_NEUTRAL`) is refused away from its default, so what this list forgets is
  refused, not passed;
* sizes and layouts: ``core.sizes``, ``core.zigzag`` and ``core.prefetch`` call :func:`require`;
* ``megatron-tsp`` configs: ``run.config`` checks the keys it knows (:func:`violations`);
* Megatron-LM: ``megatron_lm.translate_argv`` checks the command line.

Supporting a feature, or restricting one more, is one row here. Imports nothing heavy: the
command line reads it before megatron-core is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, List, Mapping, Optional, Tuple

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig


@dataclass(frozen=True)
class Rule:
    """One setting TSP restricts, of one of three kinds: a *size* the TSP size must divide
    (``divisor`` x D), a *value* TSP needs (``ok(value, D)``, ``must`` says it in words), or a
    *feature* TSP does not implement (any use refused). ``flag``: the Megatron-LM flag; its
    argument name (``--num-experts`` -> ``num_experts``) is the key of configs and of
    Megatron-LM's args. ``attr``: the ``TransformerConfig`` field when it differs from the
    key (None: not on the config). ``layer``: what it concerns (``layout``: TSP's place among
    the parallel dimensions; ``all``, ``attention``, ``mlp``: the TSP layers; ``launch``: only
    the command line has it; ``tsp``: TSP's own settings, of megatron-tsp's configs and the
    TSP layers, which Megatron-LM does not have; the ring MLP in a TP model reads ``all`` and
    ``mlp``). ``type``: how a command-line value reads. ``moe``: the setting concerns
    mixture-of-experts layers, and a model without experts is not held to it."""

    flag: str
    why: str
    fix: str
    divisor: int = 0
    ok: Optional[Callable[[Any, int], bool]] = None
    must: str = ""
    attr: Optional[str] = ""
    layer: str = "all"
    type: Callable[[str], Any] = int
    moe: bool = False

    @property
    def feature(self) -> bool:
        return not self.divisor and self.ok is None

    @property
    def key(self) -> str:
        return self.flag[2:].replace("-", "_")

    def config_attr(self) -> Optional[str]:
        return self.key if self.attr == "" else self.attr

    def allows(self, value: Any, tsp_size: int) -> bool:
        if self.divisor:
            return value is None or value % (self.divisor * tsp_size) == 0
        if self.feature:
            return not value
        return self.ok(value, tsp_size)

    def message(self, value: Any, tsp_size: int, name: Optional[str] = None, under: str = "--tsp-size") -> str:
        """One line: the setting (``name``, default the flag), what TSP (``under``: the flag
        that turned TSP's layer on, and whose size D is) needs at this size, why, and the fix."""
        name = name or self.flag
        size_flag = "--tsp-size" if under == "--tsp-size" else "--tensor-model-parallel-size"
        with_ = f"--tsp-size {tsp_size}" if under == "--tsp-size" else f"{under} at {size_flag} {tsp_size}"
        if self.divisor:
            by = f"{size_flag} {tsp_size}" if self.divisor == 1 else \
                f"{self.divisor} x {size_flag} = {self.divisor * tsp_size}"
            return f"{name} {value} is not divisible by {by}: {self.why}; {self.fix}"
        if self.feature:
            return f"{name} cannot be used with {with_}: {self.why}; {self.fix}"
        got = ("on" if value else "off") if isinstance(value, bool) else value
        return f"{name} must be {self.must} with {with_} (got {got}): {self.why}; {self.fix}"


def _size(flag: str, divisor: int, why: str, fix: str, **kw) -> Rule:
    return Rule(flag, why, fix, divisor=divisor, **kw)


def _value(flag: str, must: str, ok: Callable[[Any, int], bool], why: str, **kw) -> Rule:
    return Rule(flag, why, f"set {flag}" + (f" {must}" if must != "on" else ""), ok=ok, must=must, **kw)


def _feature(flag: str, why: str, fix: str = "turn it off", **kw) -> Rule:
    return Rule(flag, why, fix, **kw)


def window_pair(value: Any) -> Optional[Tuple[int, ...]]:
    """megatron's ``window_size`` from any of its spellings: a tuple or list (a config, a
    ``TransformerConfig``) or Megatron-LM's ``"W,0"``; None when unset; a ValueError line when
    it is not integers."""
    if value is None or isinstance(value, tuple):
        return value
    try:
        parts = value.strip("()[] ").split(",") if isinstance(value, str) else list(value)
        return tuple(int(p) for p in parts)
    except (TypeError, ValueError):
        raise ValueError(f"--window-size must be two integers W,0 (got {value!r})") from None


def _groups_per_call_ok(value: Any, tsp_size: int) -> bool:
    """``--tsp-head-groups-per-call``: auto (``auto``, or 0 as configs write it) or a
    positive divisor of the TSP size: a layer's D head groups run in stages of that many."""
    if isinstance(value, bool):
        return False
    return value in ("auto", 0) or (isinstance(value, int) and value > 0 and tsp_size % value == 0)


def causal_window(value: Any) -> bool:
    """Whether ``window_size`` is unset or a causal sliding window ``(W, 0)``, W >= 0: the
    query sees itself and the W keys before it. megatron-core's local attention masks
    ``(-1, 0)`` as no key at all, and a right window makes it non-causal."""
    pair = window_pair(value)
    return pair is None or (len(pair) == 2 and pair[0] >= 0 and pair[1] == 0)


# CUDA graphs: megatron captures a layer's forward and backward; TSP's (and the ring MLP's)
# post asynchronous collectives on the TSP group's own communicators and wait on them between
# kernels, which no capture has been shown to replay (no GPU has tried it)
_NOT_CAPTURED = "capturing the TSP layers' streamed collectives in a CUDA graph is not implemented"

RULES: List[Rule] = [
    # the parallel layout
    _value("--tensor-model-parallel-size", "1", lambda v, d: v in (None, 1), "TSP occupies the tensor-parallel slot",
           attr=None, layer="layout"),
    _value("--context-parallel-size", "1", lambda v, d: v in (None, 1), "TSP already shards the sequence",
           layer="layout"),
    _value("--sequence-parallel", "on", lambda v, d: bool(v), "TSP shards the sequence", layer="layout"),
    _value("--attention-dropout", "0", lambda v, d: not v, "TSP's attention kernel has no dropout",
           layer="attention", type=float),
    # sizes
    _size("--num-attention-heads", 1, "every rank computes whole heads",
          "choose a TSP size that divides the head count", layer="attention"),
    _size("--num-query-groups", 1, "TSP gives every rank whole KV heads",
          "choose a TSP size that divides the KV head count", layer="attention"),
    _size("--ffn-hidden-size", 1, "every rank holds 1/D of the MLP",
          "choose an ffn size that is a multiple of D", layer="mlp"),
    _size("--seq-length", 2, "the zigzag layout gives every rank two chunks", "use a multiple of 2 x the TSP size",
          attr=None, layer="layout"),
    # mixture-of-experts: megatron's MoE layers with their experts folded onto the TSP group
    _value("--expert-model-parallel-size", "--tsp-size or a divisor of it", lambda v, d: v is None or d % v == 0,
           "the experts are sharded over the TSP group, whose ranks hold the MoE layer's tokens", layer="layout",
           moe=True),
    _value("--expert-tensor-parallel-size", "1", lambda v, d: v in (None, 1),
           "each expert is whole on the rank that holds it, the tokens travel to it", layer="layout", moe=True),
    # features TSP does not implement
    _feature("--multi-latent-attention", "multi-latent attention is not implemented"),
    _feature("--mtp-num-layers", "multi-token prediction is not implemented"),
    _feature("--fp8-format", "fp8 is not implemented", attr="fp8"),
    _feature("--fp4-format", "fp4 is not implemented", attr="fp4"),
    _feature("--tp-comm-overlap", "TransformerEngine's TP overlap does not apply to TSP, which overlaps its own"),
    _value("--cuda-graph-impl", "none", lambda v, d: v in (None, "none"), _NOT_CAPTURED, type=str),
    _feature("--enable-cuda-graph", _NOT_CAPTURED, "use --cuda-graph-impl none"),
    _feature("--external-cuda-graph", _NOT_CAPTURED, "use --cuda-graph-impl none"),
    _feature("--attention-output-gate", "gated attention output is not implemented", layer="attention"),
    _value("--window-size", "W,0 with W >= 0", lambda v, d: causal_window(v),
           "the attention is causal: a query sees itself and the W keys before it", layer="attention",
           type=window_pair),
    _feature("--mrope-section", "multimodal RoPE is not implemented", layer="attention"),
    _feature("--use-te-activation-func", "the ring MLP applies the activation itself", layer="mlp"),
    Rule("--hybrid-layer-pattern", "Mamba, gated delta net, MLA, DSA and MoE layers are not TSP layers",
         "use attention (*) and MLP (-) layers, with | between pipeline stages",
         ok=lambda v, d: v is None or set(v) <= set("*-|"), must="attention (*) and MLP (-) layers only",
         attr=None, layer="launch", type=str),
    # TSP's own settings
    _value("--tsp-lookahead", "1 or more", lambda v, d: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
           "it counts the weight shards in flight ahead of the one in use (to overlap nothing, run the "
           "tsp-no-overlap mode)", attr=None, layer="tsp"),
    _value("--tsp-head-groups-per-call", "0 (auto) or a divisor of the TSP size", _groups_per_call_ok,
           "the attention runs its D head groups in stages of that many", attr=None, layer="tsp"),
    _value("--tsp-mlp-shards-per-call", "0 (auto), 1 (the ring) or the TSP size (every shard gathered)",
           lambda v, d: not isinstance(v, bool) and v in ("auto", 0, 1, d),
           "the MLP computes with one shard at a time round the ring, or with all of them at once", attr=None,
           layer="tsp"),
    # Megatron-LM command line only
    _feature("--spec", "the TSP layer spec is chosen by --tsp-size", "drop --spec", attr=None, layer="launch"),
    _feature("--use-legacy-models", "TSP needs megatron-core models", "drop --use-legacy-models", attr=None,
             layer="launch"),
    _feature("--sft", "packed (THD) sequences are not implemented", "drop --sft", attr=None, layer="launch"),
    _feature("--overlap-moe-expert-parallel-comm", "mixture-of-experts is not implemented", attr=None,
             layer="launch"),
]


# TransformerConfig, field by field: what a TSP layer may be given. Every field of megatron-core
# 0.16's and 0.19's config that is neither below nor read by a rule of RULES changes a layer's
# math in a way TSP does not compute (no_rope_freq, qk_l2_norm, use_mup, ...), or was added
# after someone last looked (a later megatron-core's): it is refused at any value but its
# default (:func:`unlisted_settings`).
CONFIG_IMPLEMENTED = frozenset({
    # what the TSP layers compute at any value, as megatron's layers do
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size",
    "softmax_scale", "apply_query_key_layer_scaling", "attention_softmax_in_fp32", "rotary_interleaved",
    "apply_rope_fusion", "fused_single_qkv_rope", "qk_layernorm", "normalization", "layernorm_epsilon",
    "layernorm_zero_centered_gamma", "add_bias_linear", "add_qkv_bias", "gated_linear_unit", "activation_func",
    "glu_linear_offset", "activation_func_clamp_value", "hidden_dropout", "fp32_residual_connection",
    "params_dtype", "fp16", "bf16", "init_method", "output_layer_init_method", "init_method_std",
    "embedding_init_method", "embedding_init_method_std", "perform_initialization", "use_cpu_initialization",
    "calculate_per_token_loss", "softmax_type", "window_attn_skip_freq",
    # megatron's MoE layers, which TSP runs as they are (their moe_* settings: CONFIG_NEUTRAL_PREFIXES)
    "num_moe_experts",
})
CONFIG_NEUTRAL = frozenset({
    # how the math runs, not what it is: fusions, kernels, recompute, offloading, graphs, logging
    "bias_activation_fusion", "masked_softmax_fusion", "persist_layer_norm", "memory_efficient_layer_norm",
    "bias_dropout_fusion", "gradient_accumulation_fusion", "cross_entropy_loss_fusion", "cross_entropy_fusion_impl",
    "async_tensor_model_parallel_allreduce", "attention_backend", "transformer_impl", "flash_attention_version",
    "fused_residual_rmsnorm", "use_transformer_engine_op_fuser", "use_grouped_gemm_for_dense_mlp",
    "mlp_chunks_for_prefill", "mlp_chunks_for_training", "disable_bf16_reduced_precision_matmul",
    "deterministic_mode", "batch_invariant_mode", "test_mode", "autocast_dtype", "recompute_granularity",
    "recompute_method", "recompute_num_layers", "distribute_saved_activations", "recompute_modules",
    "num_microbatches_with_partial_activation_checkpoints", "fine_grained_activation_offloading",
    "offload_modules", "min_offloaded_tensor_size", "activation_offload_fraction", "delay_offload_until_cuda_graph",
    "delta_offload_bytes_across_pp_ranks", "clone_scatter_output_in_embedding", "disable_parameter_transpose_cache",
    "config_logger_dir", "timers", "finalize_model_grads_func", "grad_scale_func", "no_sync_func",
    "grad_sync_func", "param_sync_func", "barrier_with_L1_time", "init_model_with_meta_device",
    "use_te_rng_tracker", "flash_decode", "symmetric_ar_type",
    "use_inference_optimized_layers", "is_hybrid_model", "variable_seq_lengths",
    "hetereogenous_dist_checkpoint", "nccl_all_reduce_for_prefill", "high_priority_a2a_comm_stream",
    # the parallel layout and the pipeline schedule (RULES restrict what concerns TSP)
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
    "pipeline_model_parallel_comm_backend", "pipeline_dtype", "pipeline_model_parallel_layout",
    "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
    "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
    "microbatch_group_size_per_vp_stage", "overlap_p2p_comm", "batch_p2p_comm", "batch_p2p_sync",
    "use_ring_exchange_p2p", "deallocate_pipeline_outputs", "defer_embedding_wgrad_compute",
    "wgrad_deferral_limit", "overlap_p2p_comm_warmup_flush", "delay_wgrad_compute",
    "ep_overlap_early_attn_memory_release", "hierarchical_context_parallel_sizes", "max_seqlen_per_dp_cp_rank",
    "hybrid_context_parallel", "cp_comm_type", "expert_model_parallel_size", "expert_tensor_parallel_size",
    "moe_extended_tp",
    # read only by layers that RULES refuse (experts, MTP, fp8/fp4, Mamba, DSA, linear attention)
    "activation_func_fp8_input_store", "first_last_layers_bf16", "num_layers_at_start_in_bf16",
    "num_layers_at_end_in_bf16", "use_fused_weighted_squared_relu", "fp8_output_proj",
    "dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk", "dsa_indexer_loss_coeff",
    "dsa_indexer_use_sparse_loss", "linear_attention_freq", "linear_conv_kernel_dim", "linear_key_head_dim",
    "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "kitchen_attention_backend",
    "mup_attn_scale_power", "mup_base_head_dim", "mup_base_hidden_size", "mup_embedding_mult", "mup_output_mult",
    "mup_width_mult", "experimental_attention_variant_loss_scale_func", "expert_tensor_parallel_num_weight_shards",
    "expert_gtp_weight_remat_size",
})
# Fields whose value Megatron-LM derives from others when the user leaves them unset: at that
# value they change nothing (megatron-core 0.19's weight sharding beyond TP, resolved to the TP size).
CONFIG_DERIVED_DEFAULTS = {"tensor_parallel_num_weight_shards": lambda config: config.tensor_model_parallel_size}
CONFIG_NEUTRAL_PREFIXES = ("moe_", "mtp_", "fp8_", "fp4_", "tp_comm_", "cuda_graph_", "cpu_offloading", "dsa_",
                           "mamba_", "inference_", "fine_grained_offloading_", "_cpu_offloading")


def moe_layers(config: TransformerConfig) -> List[bool]:
    """Which of the model's layers are mixture-of-experts layers: megatron's ``moe_layer_freq``
    (every N-th from the first, or a list of 0/1), none without experts."""
    if not getattr(config, "num_moe_experts", None):
        return [False] * config.num_layers
    freq = config.moe_layer_freq
    pattern = [i % freq == 0 for i in range(config.num_layers)] if isinstance(freq, int) else [bool(x) for x in freq]
    if len(pattern) != config.num_layers:
        raise ValueError(f"--moe-layer-freq names {len(pattern)} layers, the model has {config.num_layers}")
    return pattern


def unlisted_settings(config: TransformerConfig) -> Iterator[Tuple[str, Any, Any]]:
    """``(field, value, default)`` of every field of ``config`` that is set away from its default
    and that TSP neither implements, nor ignores harmlessly, nor checks by a rule."""
    import dataclasses

    ruled = {rule.config_attr() for rule in RULES}
    for field in dataclasses.fields(config):
        name = field.name
        if name in CONFIG_IMPLEMENTED or name in CONFIG_NEUTRAL or name in ruled or \
                name.startswith(CONFIG_NEUTRAL_PREFIXES):
            continue
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            continue
        value = getattr(config, name)
        derived = CONFIG_DERIVED_DEFAULTS.get(name)
        if value is not default and value != default and not (derived and value == derived(config)):
            yield name, value, default


def violations(values: Mapping[str, Any], tsp_size: int, layers=("layout", "all", "attention", "mlp", "tsp"),
               name: Callable[[Rule], str] = lambda rule: rule.flag, under: str = "--tsp-size") -> Iterator[str]:
    """The message of every rule of ``layers`` that a setting of ``values`` (``{flag: value}``;
    a flag that is not there is not checked) breaks at TSP size ``tsp_size``; ``name(rule)``:
    how the source names the setting; ``under``: see :meth:`Rule.message`."""
    if tsp_size <= 1:
        return
    for rule in RULES:
        if rule.layer in layers and rule.flag in values and not rule.allows(values[rule.flag], tsp_size):
            yield rule.message(values[rule.flag], tsp_size, name(rule), under)


def require(flag: str, value: Any, tsp_size: int, where: str = "", under: str = "--tsp-size") -> None:
    """Raise the one-line ValueError of ``flag``'s rule when ``value`` breaks it (``where``:
    the module or function that found it, as a prefix): for checks made at run time, by code
    that runs only under TSP (at any size)."""
    rule = next(r for r in RULES if r.flag == flag)
    if not rule.allows(value, tsp_size):
        message = rule.message(value, tsp_size, under=under)
        raise ValueError(f"{where}: {message}" if where else message)


def _check_config(config: TransformerConfig, tsp_size: int, module: str, layers, under: str = "--tsp-size",
                  **values) -> None:
    """``values``: settings of the module that override the config's (by key)."""
    if config.tensor_model_parallel_size != tsp_size:
        raise ValueError(
            f"{module}: TransformerConfig.tensor_model_parallel_size={config.tensor_model_parallel_size} "
            f"must equal the size of its group, {tsp_size} (TSP and the ring MLP occupy the tensor-parallel slot)")
    moe = bool(getattr(config, "num_moe_experts", None))
    settings = {rule.flag: values[rule.key] if rule.key in values else getattr(config, rule.config_attr())
                for rule in RULES
                if (moe or not rule.moe)
                and (rule.key in values or (rule.config_attr() is not None and hasattr(config, rule.config_attr())))}
    for message in violations(settings, tsp_size, layers, under=under):
        raise ValueError(f"{module}: {message}")
    for name, value, default in unlisted_settings(config):
        raise ValueError(f"{module}: TransformerConfig.{name}={value!r} changes the layer's math in a way TSP does not "
                         f"implement; leave it at its default ({default!r})")


def check_attention_config(config: TransformerConfig, tsp_size: int, attn_mask_type=None, lookahead: int = 1,
                           head_groups_per_call: Any = "auto") -> None:
    """What ``TSPSelfAttention`` checks at construction (default mask: causal; its own
    settings ``--tsp-lookahead`` and ``--tsp-head-groups-per-call`` at any size, since it
    reads them at any): one ValueError line."""
    from megatron.core.transformer.enums import AttnMaskType

    _check_config(config, tsp_size, "TSPSelfAttention", ("layout", "all", "attention"))
    if attn_mask_type not in (None, AttnMaskType.causal):
        raise ValueError(f"TSPSelfAttention supports causal attention only (got {attn_mask_type.name}); "
                         "use the TSP layer spec, which sets it")
    require("--tsp-lookahead", lookahead, tsp_size, "TSPSelfAttention")
    require("--tsp-head-groups-per-call", head_groups_per_call, tsp_size, "TSPSelfAttention")


def check_mlp_config(config: TransformerConfig, size: int, ffn_hidden_size: int, under: str = "--tsp-size") -> None:
    """What ``TSPMLP`` checks at construction, in a TSP model or (``under="--ring-mlp"``) as
    the ring MLP of a TP model (``ffn_hidden_size``: the MLP's own, which a spec may set apart
    from the config's). Not the layout rules: the ring is token-wise, so it runs beside
    context parallelism and without sequence parallelism alike."""
    _check_config(config, size, "TSPMLP", ("all", "mlp"), under, ffn_hidden_size=ffn_hidden_size)
