"""TSP self-attention: broadcast weight shards, all-gather K/V, zigzag causal mask.

Rank p of a TSP group of size D holds the tokens ``x_p: [S/D, b, h]`` (zigzag chunks p and
2D-1-p) and head group p's weights, in exactly megatron's tensor-parallel layout (this class
*is* a megatron ``SelfAttention``; only ``forward`` differs). For every head group r, all
ranks together:

    W_r       = broadcast(Wqkv_r, bqkv_r, Wproj_r; src=r)
    q, k, v   = split(x_p Wqkv_r^T + bqkv_r)          a/D query heads, g/D kv heads
    q, k      = rope(q, k) at the global positions of p's tokens
    K_r, V_r  = all_gather_seq(k, v)                   [S, b, g/D, d], global order
    y_p      += causal_attention(q, K_r, V_r) Wproj_r^T

so ``y_p = sum_r attn_r(x_p) Wproj_r^T`` is the full attention output for p's tokens: no
all-reduce. Backward (derived; DESIGN.md section 2) re-broadcasts W_r, re-gathers K_r, V_r
(never saved full-length), reduce-scatters dK_r, dV_r to the token owners and reduces the
partial dW_r of every rank to its owner r. Saved for backward: ``x_p``, this rank's own
shards, and per head group the projection and attention output of p's tokens only (1/D of
what one device saves); the attention scores are recomputed, no projection is.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_tsp import comm, zigzag
from megatron_tsp.checks import check_attention_config
from megatron_tsp.kernels import causal_attention, select_backend
from megatron_tsp.parallel_state import resolve_tsp_groups
from megatron_tsp.streaming import ShardStream, linear_pair_shard


class TSPSelfAttention(SelfAttention):
    """Drop-in for megatron's ``SelfAttention`` under TSP (same parameters and checkpoints).

    ``overlap_comm``: broadcast the next head group's weights while this one computes.
    ``attention_backend``: see :func:`megatron_tsp.kernels.select_backend`.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: SelfAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        overlap_comm: bool = True,
        attention_backend: str = "auto",
    ):
        group, weight_group = resolve_tsp_groups(pg_collection)
        check_attention_config(config, group.size(), attn_mask_type)
        super().__init__(config, submodules, layer_number, attn_mask_type, cp_comm_type, pg_collection)
        if self.tp_group.size() != group.size():
            raise ValueError("TSPSelfAttention: pg_collection.tp must be the TSP group")
        self.tsp_group = group
        self.weight_group = weight_group
        self.overlap_comm = overlap_comm
        self.attention_backend = select_backend(attention_backend)
        self.softmax_scale = config.softmax_scale or 1.0 / math.sqrt(self.hidden_size_per_attention_head)
        self.comm_scope = f"layer{self.layer_number}/attention"

    # ---- parameters streamed per head group -------------------------------------------
    def shard_tensors(self) -> List[torch.Tensor]:
        """This rank's weight shard, in the order it travels: Wqkv, (bqkv), Wproj."""
        return linear_pair_shard(self.linear_qkv, self.linear_proj)

    def replicated_parameters(self) -> List[torch.nn.Parameter]:
        """Parameters every rank holds whole and uses on its own tokens (q/k norms)."""
        return [p for m in (self.q_layernorm, self.k_layernorm) if m is not None for p in m.parameters()]

    # ---- the two local stages of one head group ----------------------------------------
    def split_heads(self, mixed: torch.Tensor, freqs: Optional[torch.Tensor]):
        """A head group's QKV projection -> q [s, b, a/D, d], k and v [s, b, g/D, d]
        (megatron's interleaved layout, q/k norms, RoPE at the tokens' global positions)."""
        groups = self.num_query_groups_per_partition
        heads_per_group = self.num_attention_heads_per_partition // groups
        d = self.hidden_size_per_attention_head
        mixed = mixed.view(*mixed.shape[:2], groups, (heads_per_group + 2) * d)
        query, key, value = torch.split(mixed, [heads_per_group * d, d, d], dim=3)
        query = query.reshape(*query.shape[:2], -1, d)
        if self.q_layernorm is not None:
            query = self.q_layernorm(query)
        if self.k_layernorm is not None:
            key = self.k_layernorm(key)
        if freqs is not None:
            query = apply_rotary_pos_emb(query, freqs, config=self.config, cp_group=self.pg_collection.cp)
            key = apply_rotary_pos_emb(key, freqs, config=self.config, cp_group=self.pg_collection.cp)
        return query, key, value

    def attend(self, query, keys, values, rank: int) -> torch.Tensor:
        """Causal attention of local queries against the gathered keys: ``[s, b, a/D, d]``."""
        return zigzag_attention(query, keys, values, self.tsp_group.size(), rank,
                                self.softmax_scale, self.attention_backend)

    # ---- forward -----------------------------------------------------------------------
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        key_value_states: Optional[torch.Tensor] = None,
        inference_context=None,
        rotary_pos_emb=None,
        rotary_pos_cos=None,
        rotary_pos_sin=None,
        rotary_pos_cos_sin=None,
        attention_bias=None,
        packed_seq_params=None,
        sequence_len_offset=None,
        *,
        inference_params=None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``hidden_states``: this rank's ``[S/D, b, h]`` in zigzag order.

        ``attention_mask`` is not read: the mask is causal by global position, as
        TransformerEngine does for ``AttnMaskType.causal``.
        """
        for name, value in (("key_value_states", key_value_states),
                            ("inference_context", inference_context or inference_params),
                            ("packed_seq_params", packed_seq_params),
                            ("attention_bias", attention_bias),
                            ("rotary_pos_cos/sin", rotary_pos_cos if rotary_pos_cos is not None else rotary_pos_sin)):
            if value is not None:
                raise NotImplementedError(f"TSPSelfAttention: {name} is not supported")
        freqs = None
        if rotary_pos_emb is not None:
            if isinstance(rotary_pos_emb, tuple):
                rotary_pos_emb = rotary_pos_emb[0]
            d_size, rank = self.tsp_group.size(), self.tsp_group.rank()
            seq_len = hidden_states.size(0) * d_size
            if rotary_pos_emb.size(0) < seq_len:
                raise ValueError(f"rotary table has {rotary_pos_emb.size(0)} positions, sequence has {seq_len}")
            freqs = rotary_pos_emb[zigzag.local_positions(seq_len, d_size, rank, rotary_pos_emb.device)]
        output = _TSPAttentionFunction.apply(
            self, freqs, hidden_states, *self.shard_tensors(), *self.replicated_parameters()
        )
        return output, self.linear_proj.bias


def zigzag_attention(query, keys, values, size: int, rank: int, scale: float, backend: str):
    """Causal attention of a rank's zigzag query chunks against full-sequence keys.

    ``query`` ``[s/D, b, hq, d]`` holds chunks r and 2D-1-r; ``keys``/``values``
    ``[S, b, hk, d]`` are in global order. Chunk c sees every key before it and itself
    causally, so each chunk attends to the key prefix that ends with it.
    """
    chunk = query.size(0) // 2
    outputs = []
    for i, global_chunk in enumerate(zigzag.rank_chunks(size, rank)):
        visible = (global_chunk + 1) * chunk
        outputs.append(causal_attention(query[i * chunk : (i + 1) * chunk], keys[:visible],
                                        values[:visible], scale, backend))
    return torch.cat(outputs, dim=0)


def gather_kv(key, value, group, rank_order_to_global: torch.Tensor):
    """[s/D, b, g, d] x2 -> full-sequence K, V in global (natural) order."""
    local = torch.stack([key, value])  # [2, s/D, b, g, d]
    local = local.transpose(0, 1).contiguous()  # sequence first for the gather
    full = local.new_empty((local.size(0) * group.size(),) + tuple(local.shape[1:]))
    comm.all_gather(full, local, group)
    full = full.index_select(0, rank_order_to_global)
    return full[:, 0], full[:, 1]


def scatter_kv_grads(d_keys, d_values, group, global_to_rank_order: torch.Tensor):
    """Full-sequence dK, dV (global order) -> this rank's tokens, summed over ranks."""
    full = torch.stack([d_keys, d_values], dim=1).index_select(0, global_to_rank_order).contiguous()
    local = full.new_empty((full.size(0) // group.size(),) + tuple(full.shape[1:]))
    comm.reduce_scatter(local, full, group)
    return local[:, 0], local[:, 1]


class AllGatherKV(torch.autograd.Function):
    """K, V = all_gather_seq(k, v) in global order; backward: dk, dv = reduce_scatter(dK, dV).

    For layers that differentiate through the gather with autograd (context-parallel
    baselines); TSP attention calls :func:`gather_kv` inside its own backward schedule.
    """

    @staticmethod
    def forward(ctx, key, value, group):
        seq = key.size(0) * group.size()
        ctx.group = group
        return gather_kv(key, value, group, zigzag.inverse_permutation(seq, group.size(), key.device))

    @staticmethod
    def backward(ctx, d_keys, d_values):
        group = ctx.group
        perm = zigzag.permutation(d_keys.size(0), group.size(), d_keys.device)
        dk, dv = scatter_kv_grads(d_keys.contiguous(), d_values.contiguous(), group, perm)
        return dk, dv, None


class _TSPAttentionFunction(torch.autograd.Function):
    """y_p = sum_r attn(x_p; W_r) Wproj_r^T with W_r broadcast from rank r (module docstring).

    Saved per head group r, for this rank's tokens only: the QKV projection ``m_r`` and the
    attention output ``o_r`` (together 1/D of what one device would save). Backward
    re-broadcasts W_r, re-gathers K_r, V_r from ``m_r`` and recomputes only the attention
    scores (inside the attention backward); no projection GEMM is recomputed.
    """

    @staticmethod
    def forward(ctx, layer: TSPSelfAttention, freqs, x, *params):
        n_shard = len(layer.shard_tensors())
        own = params[:n_shard]
        group = layer.tsp_group
        d_size, rank = group.size(), group.rank()
        # zigzag.permutation maps rank order -> global positions; gathering in rank order
        # and indexing with its inverse gives the natural order the causal mask assumes.
        to_global = zigzag.inverse_permutation(x.size(0) * d_size, d_size, x.device)
        y = torch.zeros(x.shape[:2] + (layer.config.hidden_size,), dtype=x.dtype, device=x.device)
        projections, outputs = [], []
        stream = ShardStream(own, layer.weight_group, overlap=layer.overlap_comm)
        with comm.scope(f"{layer.comm_scope}/forward"):
            for r, shard in stream:
                mixed = F.linear(x, *shard[:-1])
                q, k, v = layer.split_heads(mixed, freqs)
                keys, values = gather_kv(k, v, group, to_global)
                out = layer.attend(q, keys, values, rank).flatten(2)
                del keys, values
                y += F.linear(out, shard[-1])
                projections.append(mixed)
                outputs.append(out)
        ctx.layer = layer
        ctx.n_shard = n_shard
        ctx.save_for_backward(freqs, x, *own, *projections, *outputs)
        return y

    @staticmethod
    def backward(ctx, dy):
        layer: TSPSelfAttention = ctx.layer
        freqs, x, *rest = ctx.saved_tensors
        own, rest = rest[: ctx.n_shard], rest[ctx.n_shard :]
        projections, outputs = rest[: len(rest) // 2], rest[len(rest) // 2 :]
        replicated = layer.replicated_parameters()
        group = layer.tsp_group
        d_size, rank = group.size(), group.rank()
        to_global = zigzag.inverse_permutation(x.size(0) * d_size, d_size, x.device)
        to_rank_order = zigzag.permutation(x.size(0) * d_size, d_size, x.device)
        dy2d = dy.reshape(-1, dy.size(-1))
        x2d = x.reshape(-1, x.size(-1))
        dx = torch.zeros_like(x)
        d_replicated = [torch.zeros_like(p) for p in replicated]
        stream = ShardStream(own, layer.weight_group, overlap=layer.overlap_comm)
        with comm.scope(f"{layer.comm_scope}/backward"):
            for r, shard in stream:
                w_proj, out = shard[-1], outputs[r]
                d_proj = dy2d.t() @ out.reshape(-1, out.size(-1))
                d_out = (dy @ w_proj).view(out.shape[:2] + (-1, layer.hidden_size_per_attention_head))
                mixed = projections[r].detach().requires_grad_()
                with torch.enable_grad():
                    q, k, v = layer.split_heads(mixed, freqs)
                keys, values = gather_kv(k.detach(), v.detach(), group, to_global)
                q_in, keys, values = (t.detach().requires_grad_() for t in (q, keys, values))
                with torch.enable_grad():
                    attended = layer.attend(q_in, keys, values, rank)
                dq, d_keys, d_values = torch.autograd.grad(attended, (q_in, keys, values), d_out)
                del attended, keys, values
                dk, dv = scatter_kv_grads(d_keys, d_values, group, to_rank_order)
                del d_keys, d_values
                d_mixed, *d_norms = torch.autograd.grad((q, k, v), (mixed, *replicated), (dq, dk, dv))
                for acc, g in zip(d_replicated, d_norms):
                    acc += g
                d_mixed2d = d_mixed.reshape(-1, d_mixed.size(-1))
                dx += (d_mixed2d @ shard[0]).view_as(x)
                d_qkv = [d_mixed2d.t() @ x2d] + ([d_mixed2d.sum(0)] if len(shard) == 3 else [])
                stream.reduce_grad(r, [*d_qkv, d_proj])
            own_grads = stream.own_grads()
        return (None, None, dx, *own_grads, *d_replicated)
