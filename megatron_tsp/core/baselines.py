"""The TP, TP+SP and TP x CP baselines, built from stock megatron-core modules.

Only the core attention differs from ``get_gpt_layer_local_spec``: megatron's
``DotProductAttention`` materialises the ``[b, a, S, S]`` scores and refuses context
parallelism without TransformerEngine, so a fair comparison with TSP (which uses a
memory-efficient kernel) needs :class:`FlashDotProductAttention`: the same contract,
computed by a flash-style kernel, causal, and with context parallelism by all-gathering
K/V over the CP group (TransformerEngine's ``cp_comm_type="all_gather"``) on megatron's
zigzag CP layout. Its norms are :class:`megatron_tsp.core.norm.TSPNorm` (fused
TransformerEngine/apex kernels where installed): megatron-core's torch fallback refuses
sequence parallelism. With ``--transformer-engine-spec`` (and TransformerEngine installed),
``megatron-tsp train`` builds the baselines on megatron's TE spec instead.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Optional

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_tsp.core import zigzag
from megatron_tsp.core.attention_kernels import validate_backend
from megatron_tsp.core.block_attention import block_attention
from megatron_tsp.core.block_geometry import rank_chunks, window_of
from megatron_tsp.core.documents import document_starts
from megatron_tsp.core.kv import AllGatherKV
from megatron_tsp.core.spec import norm_spec, stage_layers, with_ring_mlp


class FlashDotProductAttention(MegatronModule):
    """Causal core attention for stock megatron attention, by the op TSP uses
    (:func:`megatron_tsp.core.block_attention.block_attention`), with megatron's sliding
    window (``window_size``, ``window_attn_skip_freq``) where the layer has one, and within
    packed documents where ``packed_seq_params`` has them (:mod:`megatron_tsp.core.documents`).

    Takes ``[sq, b, heads, d]`` query/key/value as ``DotProductAttention`` does and returns
    ``[sq, b, heads * d]``. Under context parallelism the local sequence is this CP rank's
    zigzag chunks; K/V are all-gathered over the CP group and each query chunk attends to
    the key prefix ending with it.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None, attention_backend: str = "auto"):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"FlashDotProductAttention supports causal attention only (got {attn_mask_type.name})")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout > 0:
            raise ValueError("FlashDotProductAttention does not support attention dropout; set --attention-dropout 0")
        from megatron.core import parallel_state

        self.window = window_of(layer_number, config, "FlashDotProductAttention")  # keys before a query; -1: all

        self.cp_group = getattr(pg_collection, "cp", None) or parallel_state.get_context_parallel_group()
        self.tp_group = getattr(pg_collection, "tp", None) or parallel_state.get_tensor_model_parallel_group()
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.backend = validate_backend(attention_backend)
        self.zigzag = zigzag.IndexCache()
        # megatron's softmax types, as its DotProductAttention holds them (the same name and
        # sharding in checkpoints: its sharded_state_dict below): a sink logit per local head
        heads = config.num_attention_heads // self.tp_group.size()
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.softmax_offset = None
        if config.softmax_type == "off-by-one":
            self.softmax_offset = torch.zeros(heads, device=device, dtype=config.params_dtype)
        elif config.softmax_type == "learnable":
            self.softmax_offset = torch.nn.Parameter(torch.empty(heads, device=device, dtype=config.params_dtype))
            if config.perform_initialization:
                config.init_method(self.softmax_offset)

    sharded_state_dict = DotProductAttention.sharded_state_dict

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise NotImplementedError("FlashDotProductAttention: attention bias is not supported")
        chunk_ids = [0]  # the whole sequence: one causal block
        size, rank = self.cp_group.size(), self.cp_group.rank()
        documents = document_starts(packed_seq_params, query.size(1), key.size(0) * size, "FlashDotProductAttention")
        if size > 1:
            indices = self.zigzag.get(key.size(0) * size, size, rank, key.device)
            key, value = AllGatherKV.apply(key, value, self.cp_group, indices)
            chunk_ids = rank_chunks(size, rank)
        out = block_attention(query, key, value, chunk_ids, self.softmax_scale, self.backend, self.softmax_offset,
                              self.window, documents)
        return out.reshape(out.size(0), out.size(1), -1)


def get_gpt_layer_baseline_spec(qk_layernorm: bool = False, attention_backend: str = "auto",
                                fused_norm: bool = True, ring_mlp: bool = False,
                                overlap_comm: bool = True, num_experts: Optional[int] = None,
                                moe_grouped_gemm: bool = False) -> ModuleSpec:
    """megatron's local spec with :class:`FlashDotProductAttention` as core attention and
    :class:`TSPNorm` norms (``fused_norm``: see :func:`megatron_tsp.core.norm.implementation`);
    with ``ring_mlp``, TSP's ring MLP in place of the MLP (:func:`with_ring_mlp`); with
    ``num_experts``, megatron's MoE module as the MLP."""
    spec = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, num_experts=num_experts,
                                    moe_grouped_gemm=moe_grouped_gemm)
    norm = norm_spec(fused_norm)
    layer, attention = spec.submodules, spec.submodules.self_attention.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = norm
    if qk_layernorm:
        attention.q_layernorm = attention.k_layernorm = norm
    else:
        assert attention.q_layernorm is IdentityOp
    # megatron calls submodules.core_attention(...) directly (no build_module): a callable
    attention.core_attention = partial(FlashDotProductAttention, attention_backend=attention_backend)
    return with_ring_mlp(spec, fused_norm, overlap_comm) if ring_mlp else spec


def get_gpt_block_baseline_spec(config: TransformerConfig, vp_stage: Optional[int] = None,
                                pp_rank: Optional[int] = None, **layer_kwargs) -> TransformerBlockSubmodules:
    """The block spec of this pipeline stage: baseline layers and a :class:`TSPNorm` final norm;
    megatron's MoE layers where ``config.moe_layer_freq`` puts them."""
    layer = get_gpt_layer_baseline_spec(**layer_kwargs)
    moe = get_gpt_layer_baseline_spec(**layer_kwargs, num_experts=config.num_moe_experts,
                                      moe_grouped_gemm=config.moe_grouped_gemm) if config.num_moe_experts else None
    return TransformerBlockSubmodules(layer_specs=stage_layers(config, layer, moe, vp_stage, pp_rank),
                                      layer_norm=norm_spec(layer_kwargs.get("fused_norm", True)))
