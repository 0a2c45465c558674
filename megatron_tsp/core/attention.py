"""TSP self-attention: broadcast weight shards, all-gather K/V, zigzag causal mask.

Rank p of a TSP group of size D holds the tokens ``x_p: [S/D, b, h]`` (zigzag chunks p and
2D-1-p) and head group p's weights, in exactly megatron's tensor-parallel layout (this class
*is* a megatron ``SelfAttention``; only ``forward`` differs). For every head group r, all
ranks together:

    W_r       = broadcast(Wqkv_r, bqkv_r, Wproj_r; src=r)
    q, k, v   = split(x_p Wqkv_r^T + bqkv_r)          a/D query heads, g/D kv heads
    q, k      = rope(q, k) at the global positions of p's tokens
    K_r, V_r  = all_gather_seq(k, v)                   [S, b, g/D, d], global order
    y_p      += block_attention(q, K_r, V_r) Wproj_r^T

so ``y_p = sum_r attn_r(x_p) Wproj_r^T`` is the full attention output for p's tokens: no
all-reduce. Backward (derived; DESIGN.md section 2) re-broadcasts W_r, re-gathers K_r, V_r
(never saved full-length), reduce-scatters dK_r, dV_r to the token owners and reduces the
partial dW_r of every rank to its owner r. Saved for backward: ``x_p``, this rank's own
shards, and per head group the projection, attention output and log-sum-exp of p's tokens
only (1/D of what one device saves); nothing is recomputed but what a flash kernel's own
backward recomputes. The attention itself is :func:`megatron_tsp.core.block_attention.block_attention`,
the op every baseline uses too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_tsp.core import comm, zigzag
from megatron_tsp.core.block_attention import block_attention_backward, block_attention_forward, select_backend
from megatron_tsp.core.kv import GatherKV, ScatterKVGrads
from megatron_tsp.core.parallel_state import resolve_tsp_groups
from megatron_tsp.core.streaming import ShardStream, linear_pair_shard
from megatron_tsp.core.support import check_attention_config


class TSPSelfAttention(SelfAttention):
    """Drop-in for megatron's ``SelfAttention`` under TSP (same parameters and checkpoints).

    ``overlap_comm``: broadcast the next head group's weights while this one computes.
    ``attention_backend``: see :func:`megatron_tsp.core.block_attention.select_backend`.
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
        self.chunk_ids = zigzag.rank_chunks(group.size(), group.rank())

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
        shard = self.shard_tensors()
        stream = HeadGroupStream(
            kv_group=self.tsp_group, weight_group=self.weight_group, split_heads=self.split_heads,
            chunk_ids=self.chunk_ids, softmax_scale=self.softmax_scale, backend=self.attention_backend,
            hidden_size=self.config.hidden_size, head_dim=self.hidden_size_per_attention_head,
            has_bias=self.linear_qkv.bias is not None, overlap=self.overlap_comm, scope=self.comm_scope)
        output = StreamAttentionHeads.apply(stream, freqs, hidden_states, *shard, *self.replicated_parameters())
        return output, self.linear_proj.bias


class _OneGroupBehind:
    """Finishes head group r while group r+1's communication is in flight: with ``overlap``,
    ``push(item)`` runs ``finish`` on the previous item; without, on this one at once.
    ``flush()`` finishes the last. The order of the finishes is the same either way."""

    def __init__(self, finish, overlap: bool):
        self.finish, self.overlap, self.pending = finish, overlap, None

    def push(self, item) -> None:
        if not self.overlap:
            self.finish(*item)
            return
        if self.pending is not None:
            self.finish(*self.pending)
        self.pending = item

    def flush(self) -> None:
        if self.pending is not None:
            self.finish(*self.pending)
            self.pending = None


@dataclass(frozen=True)
class HeadGroupStream:
    """The arguments of the attention schedule: the group K/V are gathered over and the one
    weight shards are broadcast over; ``split_heads(qkv, freqs) -> q, k, v`` for one head group
    (q/k norms and RoPE: the layer's local stage); the attention op's ``chunk_ids`` (this
    rank's zigzag chunks), scale and backend; whether the QKV projection has a bias (a shard
    is then Wqkv, bqkv, Wproj); the overlap switch and the traffic's name in ``comm.COUNTER``."""

    kv_group: dist.ProcessGroup
    weight_group: dist.ProcessGroup
    split_heads: Callable
    chunk_ids: Tuple[int, int]
    softmax_scale: float
    backend: str
    hidden_size: int
    head_dim: int
    has_bias: bool
    overlap: bool = True
    scope: str = "attention"

    @property
    def n_shard(self) -> int:
        return 3 if self.has_bias else 2

    def attend(self, query, keys, values):
        """Causal attention of local queries against the gathered keys: out ``[s, b, a/D, d]``
        and its log-sum-exp ``[b, a/D, s]``."""
        return block_attention_forward(query, keys, values, self.chunk_ids, self.softmax_scale, self.backend)

    def attend_backward(self, d_out, query, keys, values, out, lse):
        return block_attention_backward(d_out, query, keys, values, out, lse, self.chunk_ids,
                                        self.softmax_scale, self.backend)


class StreamAttentionHeads(torch.autograd.Function):
    """y_p = sum_r attn(x_p; W_r) Wproj_r^T with W_r broadcast from rank r (module docstring).

    Saved per head group r, for this rank's tokens only: the QKV projection ``m_r``, the
    attention output ``o_r`` and its log-sum-exp (together 1/D of what one device would
    save). Backward re-broadcasts W_r, re-gathers K_r, V_r from ``m_r`` and runs the
    attention kernels' backward from ``(o_r, lse_r)``: no attention forward and no
    projection GEMM is recomputed.

    K/V overlap (``stream.overlap``): in forward the QKV projection runs one head group
    ahead, so that group r+1's K/V all-gather is in flight while group r attends; in backward
    group r+1's K/V gather is started before group r's attention backward, and group r's
    dK/dV reduce-scatter is in flight while group r+1 computes (group r's weight gradients
    are finished after it). The order of every sum is the same with and without overlap, so
    results are bit-identical. The cost: the previous head group's shard stays alive one
    step longer (three shards per layer at most, one of them in flight).
    """

    @staticmethod
    def forward(ctx, stream: HeadGroupStream, freqs, x, *params):
        own = params[: stream.n_shard]
        y = torch.zeros(x.shape[:2] + (stream.hidden_size,), dtype=x.dtype, device=x.device)
        projections, outputs, lses = [], [], []

        def finish(query, gather, w_proj):
            nonlocal y
            out, lse = stream.attend(query, *gather.wait())
            out = out.flatten(2)
            y += F.linear(out, w_proj)
            outputs.append(out)
            lses.append(lse)

        groups = _OneGroupBehind(finish, stream.overlap)  # items: (q, K/V gather in flight, Wproj)
        shards = ShardStream(own, stream.weight_group, overlap=stream.overlap)
        with comm.scope(f"{stream.scope}/forward"):
            for _, shard in shards:
                mixed = F.linear(x, *shard[:-1])
                q, k, v = stream.split_heads(mixed, freqs)
                projections.append(mixed)
                groups.push((q, GatherKV(k, v, stream.kv_group), shard[-1]))
                del q, k, v
            groups.flush()
        ctx.stream = stream
        ctx.n_replicated = len(params) - stream.n_shard
        ctx.save_for_backward(freqs, x, *params, *projections, *outputs, *lses)
        return y

    @staticmethod
    def backward(ctx, dy):
        stream: HeadGroupStream = ctx.stream
        freqs, x, *rest = ctx.saved_tensors
        n_params = stream.n_shard + ctx.n_replicated
        own, replicated, rest = rest[: stream.n_shard], rest[stream.n_shard : n_params], rest[n_params:]
        d_size = stream.kv_group.size()
        saved = _HeadGroupsBackward(stream, dy, x, freqs, replicated, projections=rest[:d_size],
                                    outputs=rest[d_size : 2 * d_size], lses=rest[2 * d_size :])
        shards = ShardStream(own, stream.weight_group, overlap=stream.overlap)
        groups = _OneGroupBehind(lambda *item: saved.weights(shards, *item), stream.overlap)  # awaiting dK/dV
        with comm.scope(f"{stream.scope}/backward"):
            upcoming = saved.heads(0)
            for r, shard in shards:
                graph, gather = upcoming
                if stream.overlap and r + 1 < d_size:
                    upcoming = saved.heads(r + 1)
                groups.push(saved.attention(r, shard, graph, gather))
                del graph, gather
                if not stream.overlap and r + 1 < d_size:
                    upcoming = saved.heads(r + 1)
            groups.flush()
            own_grads = shards.own_grads()
        return (None, None, saved.dx, *own_grads,
                *(g.to(p.dtype) for g, p in zip(saved.d_replicated, replicated)))


class _HeadGroupsBackward:
    """The backward of one head group r, in three stages the schedule interleaves across
    groups: :meth:`heads` (q, k, v from the saved projection, K/V gather started),
    :meth:`attention` (dWproj, attention backward up to dq, dK/dV reduce-scatter started),
    :meth:`weights` (dx, dWqkv reduced to its owner, norm gradients, once dK/dV are back)."""

    def __init__(self, stream: HeadGroupStream, dy, x, freqs, replicated, projections, outputs, lses):
        self.stream, self.dy, self.x, self.freqs, self.replicated = stream, dy, x, freqs, replicated
        self.projections, self.outputs, self.lses = projections, outputs, lses
        self.dy2d = dy.reshape(-1, dy.size(-1))
        self.x2d = x.reshape(-1, x.size(-1))
        self.dx = torch.zeros_like(x)
        # summed over head groups in fp32: D partial sums of a bf16 norm gradient lose bits
        self.d_replicated = [torch.zeros_like(p, dtype=torch.float32) for p in replicated]

    def heads(self, r):
        mixed = self.projections[r].detach().requires_grad_()
        with torch.enable_grad():
            q, k, v = self.stream.split_heads(mixed, self.freqs)
        return (mixed, q, k, v), GatherKV(k.detach(), v.detach(), self.stream.kv_group)

    def attention(self, r, shard, graph, gather):
        out = self.outputs[r]
        d_proj = self.dy2d.t() @ out.reshape(-1, out.size(-1))
        d_out = (self.dy @ shard[-1]).view(out.shape[:2] + (-1, self.stream.head_dim))
        keys, values = gather.wait()
        dq, d_keys, d_values = self.stream.attend_backward(d_out, graph[1].detach(), keys, values,
                                                           out.view_as(d_out), self.lses[r])
        return r, shard, graph, dq, ScatterKVGrads(d_keys, d_values, self.stream.kv_group), d_proj

    def weights(self, shards: ShardStream, r, shard, graph, dq, scatter, d_proj):
        mixed, q, k, v = graph
        dk, dv = scatter.wait()
        d_mixed, *d_norms = torch.autograd.grad((q, k, v), (mixed, *self.replicated), (dq, dk, dv))
        for acc, g in zip(self.d_replicated, d_norms):
            acc += g
        d_mixed2d = d_mixed.reshape(-1, d_mixed.size(-1))
        self.dx += (d_mixed2d @ shard[0]).view_as(self.x)
        d_qkv = [d_mixed2d.t() @ self.x2d] + ([d_mixed2d.sum(0)] if self.stream.has_bias else [])
        shards.reduce_grad(r, [*d_qkv, d_proj])
