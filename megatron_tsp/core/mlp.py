"""The ring MLP: weight shards rotate around a ring of point-to-point sends.

Rank p holds its tokens ``x_p: [S/D, b, h]`` and fc1/fc2 shard p in megatron's
tensor-parallel layout (this class *is* a megatron ``MLP``; only ``forward`` differs). The
ffn dimension is elementwise, so

    y_p = sum_j act(x_p W1_j^T + b1_j) W2_j^T

exactly, summed over the D shards j as they pass through rank p (shard j = (p - t) mod D at
step t, sent on to p+1 while the next arrives from p-1). Nothing leaves the rank but weights:
no all-reduce, no all-gather. Backward runs the ring again, with a gradient accumulator
travelling behind each shard to its owner (``streaming.ShardRing``). Saved for backward:
``x_p`` and the fc1 output of every shard for this rank's tokens (1/D of what one device
saves); only the elementwise activation is recomputed.

It is TSP's MLP, and it drops into a tensor-parallel model as it is (``--ring-mlp``): TP's
fc1 column and fc2 row shards are its shards, and TP+SP's pre-MLP norm hands it the
sequence-sharded ``[S/D, b, h]`` its output goes back to; the MLP's activation collectives
(all-gather before fc1, reduce-scatter after fc2, the all-gather again in backward) become
weight traffic that does not grow with S. Without sequence parallelism each rank takes its
1/D of the (replicated) tokens, and one all-gather of the output replaces TP's all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_tsp.core import comm
from megatron_tsp.core.parallel_state import is_tsp_group, resolve_ring_groups
from megatron_tsp.core.streaming import ShardRing, grad_product, linear_pair_shard
from megatron_tsp.core.support import check_mlp_config, require


class TSPMLP(MLP):
    """Drop-in for megatron's ``MLP`` under TSP, or as the ring MLP of a TP model (same
    parameters, init and checkpoints; :func:`resolve_ring_groups` says which).

    ``overlap_comm``: the next shard travels while this one computes.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MLPSubmodules,
        is_expert: bool = False,
        input_size: Optional[int] = None,
        ffn_hidden_size: Optional[int] = None,
        tp_group: Optional[torch.distributed.ProcessGroup] = None,
        overlap_comm: bool = True,
        pg_collection=None,
        is_mtp_layer: bool = False,
        **layer_kwargs,
    ):
        """``pg_collection``, ``is_mtp_layer`` and ``layer_kwargs`` are what the running
        megatron-core's ``TransformerLayer`` passes its MLP (0.19: all three, ``name`` among
        the last; 0.16: none). A collection with a ``.tsp`` group names the ring's group;
        megatron's default collection does not, and the registered groups apply."""
        group, weight_group = resolve_ring_groups(group=tp_group if tp_group is not None
                                                  else getattr(pg_collection, "tsp", None))
        self.under = "--tsp-size" if is_tsp_group(group) else "--ring-mlp"
        require("--num-experts", is_expert, group.size(), "TSPMLP", self.under)
        require("--mtp-num-layers", is_mtp_layer, group.size(), "TSPMLP", self.under)
        ffn_hidden_size = ffn_hidden_size or config.ffn_hidden_size
        check_mlp_config(config, group.size(), ffn_hidden_size, self.under)
        super().__init__(config, submodules, False, input_size, ffn_hidden_size, group, **layer_kwargs)
        self.tsp_group = group
        self.weight_group = weight_group
        self.overlap_comm = overlap_comm

    def shard_tensors(self) -> List[torch.Tensor]:
        """This rank's shard, in the order it travels: W1, (b1), W2."""
        return linear_pair_shard(self.linear_fc1, self.linear_fc2)

    def activation(self, h: torch.Tensor) -> torch.Tensor:
        """megatron's unfused MLP activation (mlp.py, MLP.forward), on one shard."""
        config = self.config
        if not config.gated_linear_unit:
            return self.activation_func(h)
        x_glu, x_linear = torch.chunk(h, 2, dim=-1)
        if (val := config.activation_func_clamp_value) is not None:
            x_glu = x_glu.clamp(min=None, max=val)
            x_linear = x_linear.clamp(min=-val, max=val)
        return config.activation_func(x_glu) * (x_linear + config.glu_linear_offset)

    def forward(self, hidden_states: torch.Tensor, per_token_scale=None, **kwargs
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        require("--num-experts", per_token_scale is not None, self.tsp_group.size(), "TSPMLP", self.under)
        args = MLPScheduleArgs(self.weight_group, self.activation, self.config.hidden_size,
                               has_bias=self.linear_fc1.bias is not None, overlap=self.overlap_comm)
        if self.config.sequence_parallel:
            return RotateMLPShards.apply(args, hidden_states, *self.shard_tensors()), self.linear_fc2.bias
        # replicated tokens: this rank's 1/D in, everyone's out (backward: the slice, then the gather)
        mine = scatter_to_sequence_parallel_region(hidden_states, group=self.tsp_group)
        output = RotateMLPShards.apply(args, mine, *self.shard_tensors())
        full = gather_from_sequence_parallel_region(output, tensor_parallel_output_grad=False, group=self.tsp_group)
        return full, self.linear_fc2.bias


@dataclass(frozen=True)
class MLPScheduleArgs:
    """The arguments of :class:`RotateMLPShards`: the group the shards rotate over, the
    elementwise activation, the output width, whether fc1 has a bias (a shard is then W1, b1,
    W2) and the overlap switch."""

    weight_group: dist.ProcessGroup
    activation: Callable[[torch.Tensor], torch.Tensor]
    hidden_size: int
    has_bias: bool
    overlap: bool = True


class RotateMLPShards(torch.autograd.Function):
    """y_p = sum_j act(x_p W1_j^T + b1_j) W2_j^T over shards arriving on the ring, summed in
    fp32 and rounded once.

    Saved: x_p and, per shard, this rank's fc1 output ``h_j`` (together 1/D of what one
    device would save). Backward recomputes only the activation from ``h_j``; each shard's
    partial weight gradients travel back to its owner in fp32 (``streaming.ShardRing``).
    """

    @staticmethod
    def forward(ctx, args: MLPScheduleArgs, x, *own):
        y = torch.zeros(x.shape[:-1] + (args.hidden_size,), dtype=torch.float32, device=x.device)
        hidden = [None] * args.weight_group.size()
        with comm.InFlight() as inflight:
            for j, shard in ShardRing(own, args.weight_group, inflight, overlap=args.overlap):
                h = F.linear(x, *shard[:-1])
                y += F.linear(args.activation(h), shard[-1])
                hidden[j] = h
        ctx.args = args
        ctx.n_shard = len(own)
        ctx.save_for_backward(x, *own, *hidden)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        args: MLPScheduleArgs = ctx.args
        x, *rest = ctx.saved_tensors
        own, hidden = rest[: ctx.n_shard], rest[ctx.n_shard :]
        dy2d = dy.reshape(-1, dy.size(-1))
        x2d = x.reshape(-1, x.size(-1))
        dx = torch.zeros_like(x, dtype=torch.float32)
        with comm.InFlight() as inflight:
            shards = ShardRing(own, args.weight_group, inflight, overlap=args.overlap)
            for j, shard in shards:
                h = hidden[j].detach().requires_grad_()
                with torch.enable_grad():
                    a = args.activation(h)
                d_w2 = grad_product(dy2d, a.detach().reshape(-1, a.size(-1)))
                (d_h,) = torch.autograd.grad(a, h, (dy2d @ shard[-1]).view_as(a))
                d_h2d = d_h.reshape(-1, d_h.size(-1))
                dx += (d_h2d @ shard[0]).view_as(x)
                d_fc1 = [grad_product(d_h2d, x2d)] + ([d_h2d.float().sum(0)] if args.has_bias else [])
                shards.add_grad([*d_fc1, d_w2])
            own_grads = shards.own_grads()
        return (None, dx.to(x.dtype), *own_grads)
