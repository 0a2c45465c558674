"""Configuration checks for TSP layers: one-line errors at model build, never a wrong run.

Each message names the setting and the fix. ``check_layer_config`` holds what every TSP
layer needs; the attention and MLP checks add what their schedules do not implement.
"""

from __future__ import annotations

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig


def check_layer_config(config: TransformerConfig, tsp_size: int, module: str) -> None:
    if tsp_size > 1 and not config.sequence_parallel:
        raise ValueError(f"{module}: TSP shards the sequence and needs sequence_parallel=True; set --sequence-parallel")
    if config.tensor_model_parallel_size != tsp_size:
        raise ValueError(
            f"{module}: TransformerConfig.tensor_model_parallel_size={config.tensor_model_parallel_size} "
            f"must equal --tsp-size {tsp_size} (TSP occupies the tensor-parallel slot)"
        )
    unsupported = {
        "--context-parallel-size > 1": config.context_parallel_size > 1,
        "--num-experts (MoE)": bool(config.num_moe_experts),
        "--multi-latent-attention": config.multi_latent_attention,
        "--mtp-num-layers": bool(config.mtp_num_layers),
        "--fp8-format": bool(config.fp8),
        "--fp4-format": bool(getattr(config, "fp4", None)),
        "--tp-comm-overlap": config.tp_comm_overlap,
    }
    for flag, on in unsupported.items():
        if on:
            raise ValueError(f"{module}: {flag} is not supported with --tsp-size; turn it off")


def check_attention_config(config: TransformerConfig, tsp_size: int,
                           attn_mask_type: AttnMaskType = AttnMaskType.causal) -> None:
    check_layer_config(config, tsp_size, "TSPSelfAttention")
    if attn_mask_type != AttnMaskType.causal:
        raise ValueError(f"TSPSelfAttention supports causal attention only (got {attn_mask_type.name})")
    if config.attention_dropout > 0:
        raise ValueError(
            f"TSPSelfAttention does not support attention dropout (got {config.attention_dropout}); "
            "set --attention-dropout 0"
        )
    if config.num_attention_heads % tsp_size:
        raise ValueError(
            f"--num-attention-heads {config.num_attention_heads} is not divisible by "
            f"--tsp-size {tsp_size}; choose a TSP size that divides the head count"
        )
    groups = config.num_query_groups or config.num_attention_heads
    if groups % tsp_size:
        raise ValueError(
            f"--num-query-groups {groups} is not divisible by --tsp-size {tsp_size}; "
            "TSP gives every rank whole KV heads"
        )
    unsupported = {
        "--attention-output-gate": config.attention_output_gate,
        "--window-size (sliding window)": config.window_size is not None,
        "--mrope-section": config.mrope_section is not None,
    }
    for flag, on in unsupported.items():
        if on:
            raise ValueError(f"TSPSelfAttention: {flag} is not supported with --tsp-size; turn it off")


def check_mlp_config(config: TransformerConfig, tsp_size: int, ffn_hidden_size: int) -> None:
    check_layer_config(config, tsp_size, "TSPMLP")
    if ffn_hidden_size % tsp_size:
        raise ValueError(
            f"--ffn-hidden-size {ffn_hidden_size} is not divisible by --tsp-size {tsp_size}; "
            "choose an ffn size that is a multiple of the TSP size"
        )
    if config.use_te_activation_func:
        raise ValueError("TSPMLP: --use-te-activation-func is not supported with --tsp-size; turn it off")
