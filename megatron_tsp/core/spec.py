"""Layer and block specs: TSP modules where megatron's local spec has SelfAttention and MLP.

Parameters, initialisation and checkpoint keys are those of ``get_gpt_layer_local_spec``, so
a TSP checkpoint and a TP(+SP) checkpoint of the same model hold the same tensors.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import List, Optional, Union

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
    get_transformer_layer_offset,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megatron_tsp import versions
from megatron_tsp.core.attention import TSPSelfAttention
from megatron_tsp.core.mlp import TSPMLP
from megatron_tsp.core.moe import SequenceShardedMoELayer
from megatron_tsp.core.norm import TSPNorm
from megatron_tsp.core.prefetch import LayerChain
from megatron_tsp.core.support import moe_layers
from megatron_tsp.core.zigzag import IndexCache


class _ExpectedMLPWarning(logging.Filter):
    """megatron-core 0.16.1's TransformerLayer warns "Unknown MLP type: <class 'ModuleSpec'>"
    once per layer for every MLP class it does not special-case; the message cannot say which
    class. TSPMLP is expected there (it takes its group from the TSP state, not from the
    layer). The TSP specs install this filter, so only a process that builds TSP layers loses
    that warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Unknown MLP type")


_EXPECTED_MLP_WARNING = _ExpectedMLPWarning()


def norm_spec(fused: bool = True) -> ModuleSpec:
    """A :class:`TSPNorm` (``fused``: see :func:`megatron_tsp.core.norm.implementation`)."""
    return ModuleSpec(module=TSPNorm, params={"fused": fused})


def get_gpt_layer_tsp_spec(
    qk_layernorm: bool = False,
    overlap_comm: bool = True,
    attention_backend: str = "auto",
    fused_norm: bool = True,
    lookahead: int = 1,
    head_groups_per_call: Union[int, str] = "auto",
    mlp_shards_per_call: Union[int, str] = "auto",
) -> ModuleSpec:
    """A ``TransformerLayer`` spec with TSP attention and MLP.

    The norm type (LayerNorm/RMSNorm) follows ``config.normalization``, as megatron's norms do.
    ``core_attention`` stays in the spec (unused by TSP) because Megatron-LM's builder may
    write to ``spec.submodules.self_attention.submodules.core_attention``. The layers built
    from one spec share its zigzag index cache and layer chain (:mod:`prefetch`); ``lookahead``:
    head-group shards in flight ahead of the one in use (each one more shard of memory);
    ``head_groups_per_call``: see :func:`megatron_tsp.core.head_groups.head_groups_per_call`;
    ``mlp_shards_per_call``: see :meth:`megatron_tsp.core.mlp.TSPMLP.shards_per_call`.
    """
    chain = LayerChain()  # one per model, not per layer
    logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(_EXPECTED_MLP_WARNING)
    norm = norm_spec(fused_norm)
    qk_norm = norm if qk_layernorm else IdentityOp
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=TSPSelfAttention,
                params={
                    "attn_mask_type": AttnMaskType.causal,
                    "overlap_comm": overlap_comm,
                    "attention_backend": attention_backend,
                    "zigzag_indices": IndexCache(),  # one per model, not per layer
                    "chain": chain,
                    "lookahead": lookahead,
                    "head_groups_per_call": head_groups_per_call,
                },
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=DotProductAttention,
                    linear_proj=RowParallelLinear,
                    q_layernorm=qk_norm,
                    k_layernorm=qk_norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=ModuleSpec(
                module=TSPMLP,
                params={"overlap_comm": overlap_comm, "chain": chain, "shards_per_call": mlp_shards_per_call},
                submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            ),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={
                "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
            },
        ),
    )


def get_gpt_block_tsp_spec(
    config: TransformerConfig,
    vp_stage: Optional[int] = None,
    pp_rank: Optional[int] = None,
    **layer_kwargs,
) -> TransformerBlockSubmodules:
    """The block spec for this pipeline stage: TSP layers and a TSP final norm; with
    mixture-of-experts (``config.num_moe_experts``), megatron's MoE module in the layers
    ``moe_layer_freq`` names (:func:`with_moe`).

    Prefer it to a bare layer spec on GPUs without TransformerEngine or apex, where
    megatron's default final norm (torch) refuses sequence parallelism.
    """
    layer = get_gpt_layer_tsp_spec(**layer_kwargs)
    return TransformerBlockSubmodules(layer_specs=stage_layers(config, layer, with_moe(layer, config), vp_stage,
                                                               pp_rank),
                                      layer_norm=norm_spec(layer_kwargs.get("fused_norm", True)))


def stage_layers(config: TransformerConfig, dense: ModuleSpec, moe: Optional[ModuleSpec], vp_stage: Optional[int],
                 pp_rank: Optional[int]) -> List[ModuleSpec]:
    """The layer specs of this pipeline stage: ``moe`` where :func:`moe_layers` says, else
    ``dense``. Below megatron-core 0.19 the MoE module is a
    :class:`~megatron_tsp.core.moe.SequenceShardedMoELayer`."""
    if moe is not None and not versions.at_least(0, 19):
        mlp = dataclasses.replace(moe.submodules.mlp, module=SequenceShardedMoELayer)
        moe = dataclasses.replace(moe, submodules=dataclasses.replace(moe.submodules, mlp=mlp))
    offset = get_transformer_layer_offset(config, vp_stage, pp_rank)
    pattern = moe_layers(config)
    return [moe if pattern[offset + i] else dense for i in range(get_num_layers_to_build(config, vp_stage, pp_rank))]


def with_moe(layer_spec: ModuleSpec, config: TransformerConfig) -> Optional[ModuleSpec]:
    """``layer_spec`` with megatron's MoE module (router, token dispatcher, experts: its local
    spec's) as the MLP; None without experts. The layer's other modules are the same objects
    (a TSP layer spec's index cache and layer chain stay one per model). Under TSP the MoE
    layer takes this rank's 1/D of the tokens and its experts are folded onto the TSP group
    (``expert_model_parallel_size`` D or a divisor, ``expert_tensor_parallel_size`` 1)."""
    if not config.num_moe_experts:
        return None
    moe = get_gpt_layer_local_spec(num_experts=config.num_moe_experts,
                                   moe_grouped_gemm=config.moe_grouped_gemm).submodules.mlp
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(layer_spec.submodules, mlp=moe))


def with_ring_mlp(layer_spec: ModuleSpec, fused_norm: bool = True, overlap_comm: bool = True) -> ModuleSpec:
    """``layer_spec`` (megatron's local or TransformerEngine layer spec) with TSP's ring MLP in
    place of its MLP, over the tensor-parallel group (``--ring-mlp``). The pre-MLP norm is a
    module of its own (TransformerEngine's spec fuses it into fc1, whose weights the ring
    sends), saved under the fused norm's checkpoint key, so that checkpoints of the stock
    layer load unchanged."""
    logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(_EXPECTED_MLP_WARNING)
    spec = copy.deepcopy(layer_spec)
    layer = spec.submodules
    layer.pre_mlp_layernorm = norm_spec(fused_norm)
    layer.mlp = ModuleSpec(module=TSPMLP, params={"overlap_comm": overlap_comm, "chain": LayerChain()},
                           submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
    layer.sharded_state_dict_keys_map = dict(layer.sharded_state_dict_keys_map or {},
                                             **{"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"})
    return spec
