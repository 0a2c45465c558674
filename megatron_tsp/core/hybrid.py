"""TSP layers in megatron-core's ``HybridModel`` (megatron-core >= 0.19).

A hybrid layer pattern of attention (``*``) and MLP (``-``) layers computes what a GPT of
transformer layers computes, one half-layer at a time: ``*`` is a ``TransformerLayer`` with
only its input norm and self-attention, ``-`` an ``MLPLayer`` with only its pre-MLP norm and
MLP. TSP puts its attention and ring MLP there exactly as in GPTModel (:mod:`core.spec`).
Mamba, gated delta net, MLA, DSA and MoE layers are not TSP layers: a pattern with one is
refused at build, with one line from the support matrix.

megatron-core's ``HybridStack`` builds its final norm with TransformerEngine unconditionally;
:class:`HybridStackWithNorm` builds it from a spec, so that the stack also runs where
TransformerEngine is not installed (the reference of the tests uses it with torch's norm).
This module imports megatron-core's hybrid model, which 0.16 does not have.
"""

from __future__ import annotations

import copy
from typing import Optional

from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_tsp.core.parallel_state import is_tsp_group
from megatron_tsp.core.spec import get_gpt_layer_tsp_spec, norm_spec
from megatron_tsp.core.support import require

TSP_LAYERS = {Symbols.ATTENTION, Symbols.MLP}


class HybridStackWithNorm(HybridStack):
    """megatron-core's ``HybridStack`` with its final norm built from ``final_norm`` (a module
    or spec taking ``config, hidden_size, eps``). Under TSP (its ``pg_collection.tp`` is the
    TSP group) only attention and MLP layers are built."""

    def __init__(self, config: TransformerConfig, submodules: HybridStackSubmodules, *args,
                 final_norm=None, post_layer_norm: bool = True, post_process: bool = True,
                 layer_type_list: Optional[list] = None, pg_collection=None, **kwargs):
        if pg_collection is not None and is_tsp_group(pg_collection.tp):
            pattern = "".join(layer_type_list or ())
            require("--hybrid-layer-pattern", pattern if set(pattern) - TSP_LAYERS else None,
                    pg_collection.tp.size(), "HybridStackWithNorm")
        # the parent's final norm is TransformerEngine's: built here instead
        super().__init__(config, submodules, *args, post_layer_norm=False, post_process=post_process,
                         layer_type_list=layer_type_list, pg_collection=pg_collection, **kwargs)
        self.post_layer_norm = post_layer_norm
        if post_process and post_layer_norm:
            self.final_norm = build_module(final_norm, config=config, hidden_size=config.hidden_size,
                                           eps=config.layernorm_epsilon)


def hybrid_stack_spec(layer_spec: ModuleSpec, final_norm) -> ModuleSpec:
    """A hybrid stack whose attention (``*``) and MLP (``-``) layers are the two halves of the
    GPT ``layer_spec`` (its norms included), and whose final norm is ``final_norm``."""
    layer = layer_spec.submodules
    attention = copy.copy(layer)
    attention.pre_mlp_layernorm, attention.mlp, attention.mlp_bda = IdentityOp, IdentityOp, IdentityFuncOp
    mlp = copy.copy(layer)
    mlp.input_layernorm, mlp.self_attention, mlp.self_attn_bda = IdentityOp, IdentityOp, IdentityFuncOp
    return ModuleSpec(
        module=HybridStackWithNorm,
        params={"final_norm": final_norm},
        submodules=HybridStackSubmodules(
            attention_layer=ModuleSpec(module=TransformerLayer, submodules=attention),
            mlp_layer=ModuleSpec(module=MLPLayer, submodules=mlp),
        ),
    )


def get_hybrid_stack_tsp_spec(fused_norm: bool = True, **layer_kwargs) -> ModuleSpec:
    """``HybridModel(hybrid_stack_spec=...)`` with TSP attention and MLP layers and a TSP final
    norm (``layer_kwargs``: see :func:`megatron_tsp.core.spec.get_gpt_layer_tsp_spec`)."""
    return hybrid_stack_spec(get_gpt_layer_tsp_spec(fused_norm=fused_norm, **layer_kwargs), norm_spec(fused_norm))
