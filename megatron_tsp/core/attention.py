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
all-reduce. Backward (derived; docs/design.md section 2) re-broadcasts W_r, re-gathers K_r, V_r
(never saved full-length), reduce-scatters dK_r, dV_r to the token owners and reduces the
partial dW_r of every rank to its owner r, both in fp32. Saved for backward: ``x_p``, this
rank's own shards, and per head group the projection, attention output and log-sum-exp of
p's tokens only (1/D of what one device saves); nothing is recomputed but what a flash
kernel's own backward recomputes. The attention itself is
:func:`megatron_tsp.core.block_attention.block_attention`, the op every baseline uses too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable, List, NamedTuple, Optional, Tuple

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
from megatron_tsp.core.streaming import OneBehind, Shard, ShardStream, ahead, grad_product, linear_pair_shard
from megatron_tsp.core.support import check_attention_config


class TSPSelfAttention(SelfAttention):
    """Drop-in for megatron's ``SelfAttention`` under TSP (same parameters and checkpoints).

    ``overlap_comm``: broadcast the next head group's weights while this one computes.
    ``attention_backend``: see :func:`megatron_tsp.core.block_attention.resolve_backend`.
    ``zigzag_indices``: an :class:`~megatron_tsp.core.zigzag.IndexCache` shared by the
    layers of a model (the TSP layer spec passes one), else this layer's own.
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
        zigzag_indices: Optional[zigzag.IndexCache] = None,
        **layer_kwargs,
    ):
        group, weight_group = resolve_tsp_groups(pg_collection)
        check_attention_config(config, group.size(), attn_mask_type)
        # layer_kwargs: what the running megatron-core's TransformerLayer passes beyond these
        # (0.19: name, pp_layer_offset), for SelfAttention to take as it does
        super().__init__(config, submodules, layer_number, attn_mask_type, cp_comm_type, pg_collection, **layer_kwargs)
        if self.tp_group.size() != group.size():
            raise ValueError("TSPSelfAttention: pg_collection.tp must be the TSP group")
        self.tsp_group = group
        self.weight_group = weight_group
        self.overlap_comm = overlap_comm
        self.attention_backend = select_backend(attention_backend)
        self.softmax_scale = config.softmax_scale or 1.0 / math.sqrt(self.hidden_size_per_attention_head)
        self.chunk_ids = zigzag.rank_chunks(group.size(), group.rank())
        self.zigzag_indices = zigzag_indices if zigzag_indices is not None else zigzag.IndexCache()

    # ---- parameters streamed per head group -------------------------------------------
    def shard_tensors(self) -> List[torch.Tensor]:
        """This rank's weight shard, in the order it travels: Wqkv, (bqkv), Wproj."""
        return linear_pair_shard(self.linear_qkv, self.linear_proj)

    def replicated_parameters(self) -> List[torch.nn.Parameter]:
        """Parameters every rank holds whole and uses on its own tokens (q/k norms)."""
        return [p for m in (self.q_layernorm, self.k_layernorm) if m is not None for p in m.parameters()]

    # ---- the local stage of one head group ---------------------------------------------
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
        d_size, rank = self.tsp_group.size(), self.tsp_group.rank()
        seq_len = hidden_states.size(0) * d_size
        indices = self.zigzag_indices.get(seq_len, d_size, rank, hidden_states.device)
        freqs = None
        if rotary_pos_emb is not None:
            if isinstance(rotary_pos_emb, tuple):
                rotary_pos_emb = rotary_pos_emb[0]
            if rotary_pos_emb.size(0) < seq_len:
                raise ValueError(f"rotary table has {rotary_pos_emb.size(0)} positions, sequence has {seq_len}")
            freqs = rotary_pos_emb[indices.local_positions]
        args = AttentionScheduleArgs(
            kv_group=self.tsp_group, weight_group=self.weight_group, split_heads=self.split_heads,
            indices=indices, chunk_ids=self.chunk_ids, softmax_scale=self.softmax_scale,
            backend=self.attention_backend, hidden_size=self.config.hidden_size,
            head_dim=self.hidden_size_per_attention_head, has_bias=self.linear_qkv.bias is not None,
            overlap=self.overlap_comm)
        output = StreamAttentionHeads.apply(args, freqs, hidden_states, *self.shard_tensors(),
                                            *self.replicated_parameters())
        return output, self.linear_proj.bias


@dataclass(frozen=True)
class AttentionScheduleArgs:
    """The arguments of :class:`StreamAttentionHeads`: the group K/V are gathered over and
    the one weight shards are broadcast over; ``split_heads(qkv, freqs) -> q, k, v`` for one
    head group (q/k norms and RoPE: the layer's local stage); the zigzag index tensors; the
    attention op's ``chunk_ids`` (this rank's zigzag chunks), scale and backend; whether the
    QKV projection has a bias (a shard is then Wqkv, bqkv, Wproj); the overlap switch."""

    kv_group: dist.ProcessGroup
    weight_group: dist.ProcessGroup
    split_heads: Callable
    indices: zigzag.Indices
    chunk_ids: Tuple[int, int]
    softmax_scale: float
    backend: str
    hidden_size: int
    head_dim: int
    has_bias: bool
    overlap: bool = True

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


class HeadGroup(NamedTuple):
    """Forward, one head group: its weight shard, its queries for this rank's tokens, and its
    keys and values being gathered."""

    shard: Shard
    query: torch.Tensor
    kv: GatherKV


class Saved(NamedTuple):
    """What the forward keeps for backward (by ``save_for_backward``, so that saved-tensor
    hooks see it): per head group r the projection ``m_r``, attention output ``o_r`` and
    log-sum-exp ``lse_r`` of this rank's tokens."""

    freqs: Optional[torch.Tensor]
    x: torch.Tensor
    own: List[torch.Tensor]
    replicated: List[torch.Tensor]
    projections: List[torch.Tensor]
    outputs: List[torch.Tensor]
    lses: List[torch.Tensor]

    def save(self, ctx) -> None:
        ctx.saved_layout = (len(self.own), len(self.replicated), len(self.projections))
        ctx.save_for_backward(self.freqs, self.x, *self.own, *self.replicated, *self.projections, *self.outputs,
                              *self.lses)

    @classmethod
    def load(cls, ctx) -> "Saved":
        n_own, n_rep, d = ctx.saved_layout
        freqs, x, *rest = ctx.saved_tensors
        cuts = [n_own, n_own + n_rep, n_own + n_rep + d, n_own + n_rep + 2 * d]
        parts = [rest[a:b] for a, b in zip([0] + cuts, cuts + [len(rest)])]
        return cls(freqs, x, *(list(p) for p in parts))


class StreamAttentionHeads(torch.autograd.Function):
    """y_p = sum_r attn(x_p; W_r) Wproj_r^T with W_r broadcast from rank r (module docstring).

    Forward: the QKV projection runs one head group ahead, so that group r+1's K/V
    all-gather is in flight while group r attends (the stream meanwhile broadcasts W_{r+2}:
    group r's output projection, group r+1's shard and the one in flight are alive, three
    shards at most). Backward re-broadcasts W_r, re-gathers K_r, V_r from ``m_r`` and runs
    the attention kernels' backward from ``(o_r, lse_r)``: no attention forward and no
    projection GEMM is recomputed. Group r+1's K/V gather is started before group r's
    attention backward, and group r's dK/dV reduce-scatter is in flight while group r+1
    computes (group r's weight gradients are finished after it). Sums run in the same order
    with and without overlap (``args.overlap``), so results are bit-identical.
    """

    @staticmethod
    def forward(ctx, args: AttentionScheduleArgs, freqs, x, *params):
        own, replicated = params[: args.n_shard], params[args.n_shard :]
        d_size = args.kv_group.size()
        y = torch.zeros(x.shape[:2] + (args.hidden_size,), dtype=torch.float32, device=x.device)
        projections, outputs, lses = [], [], []
        with comm.InFlight() as inflight:
            shards = iter(ShardStream(own, args.weight_group, inflight, overlap=args.overlap))

            def project(r: int) -> Optional[HeadGroup]:
                if r == d_size:
                    return None
                _, shard = next(shards)
                mixed = F.linear(x, *shard[:-1])
                projections.append(mixed)
                query, key, value = args.split_heads(mixed, freqs)
                return HeadGroup(shard, query, GatherKV(key, value, args.kv_group, args.indices, inflight))

            group = project(0)
            for r in range(d_size):
                with ahead(partial(project, r + 1), args.overlap) as upcoming:
                    out, lse = args.attend(group.query, *group.kv.wait())
                    out = out.flatten(2)
                    y += F.linear(out, group.shard[-1])
                    outputs.append(out)
                    lses.append(lse)
                group = upcoming.value
            for _ in shards:  # let the stream finish its last step
                pass
        ctx.args = args
        Saved(freqs, x, own, replicated, projections, outputs, lses).save(ctx)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        args: AttentionScheduleArgs = ctx.args
        saved = Saved.load(ctx)
        grads = HeadGroupGradients(args, dy, saved)
        with comm.InFlight() as inflight:
            shards = ShardStream(saved.own, args.weight_group, inflight, overlap=args.overlap)
            scattering = OneBehind(args.overlap)  # a group whose dK/dV are being reduce-scattered
            inputs = grads.inputs(0, inflight)
            for r, shard in shards:
                with ahead(partial(grads.inputs, r + 1, inflight), args.overlap) as upcoming:
                    finished = scattering.swap(grads.attention(r, shard, inputs, inflight))
                    if finished is not None:
                        grads.weights(finished, shards)
                inputs = upcoming.value
            last = scattering.flush()
            if last is not None:
                grads.weights(last, shards)
            own_grads = shards.own_grads()
        return (None, None, grads.dx.to(saved.x.dtype), *own_grads,
                *(g.to(p.dtype) for g, p in zip(grads.d_replicated, saved.replicated)))


class HeadGroupInputs(NamedTuple):
    """Backward, one head group: q, k, v recomputed from the saved projection ``mixed`` (the
    local graph of norms and RoPE, kept for autograd), and its K/V being gathered."""

    mixed: torch.Tensor
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv: GatherKV


class HeadGroupAttentionGrads(NamedTuple):
    """Backward, one head group after its attention backward: dq, its dK/dV being
    reduce-scattered to the token owners, and its output projection's partial gradient."""

    r: int
    shard: Shard
    inputs: HeadGroupInputs
    dq: torch.Tensor
    dkv: ScatterKVGrads
    d_proj: torch.Tensor


class HeadGroupGradients:
    """The backward of one head group r, in three stages the schedule interleaves across
    groups: :meth:`inputs` (q, k, v from the saved projection, K/V gather started),
    :meth:`attention` (dWproj, attention backward up to dq, dK/dV reduce-scatter started),
    :meth:`weights` (dx, dWqkv reduced to its owner, norm gradients, once dK/dV are back).
    ``dx`` and the norm gradients are summed over head groups in fp32."""

    def __init__(self, args: AttentionScheduleArgs, dy, saved: Saved):
        self.args, self.dy, self.saved = args, dy, saved
        self.dy2d = dy.reshape(-1, dy.size(-1))
        self.x2d = saved.x.reshape(-1, saved.x.size(-1))
        self.dx = torch.zeros_like(saved.x, dtype=torch.float32)
        self.d_replicated = [torch.zeros_like(p, dtype=torch.float32) for p in saved.replicated]

    def inputs(self, r: int, inflight: comm.InFlight) -> Optional[HeadGroupInputs]:
        if r == len(self.saved.projections):
            return None
        mixed = self.saved.projections[r].detach().requires_grad_()
        with torch.enable_grad():
            q, k, v = self.args.split_heads(mixed, self.saved.freqs)
        return HeadGroupInputs(mixed, q, k, v, GatherKV(k.detach(), v.detach(), self.args.kv_group,
                                                        self.args.indices, inflight))

    def attention(self, r: int, shard: Shard, inputs: HeadGroupInputs, inflight: comm.InFlight
                  ) -> HeadGroupAttentionGrads:
        out = self.saved.outputs[r]
        d_proj = grad_product(self.dy2d, out.reshape(-1, out.size(-1)))
        d_out = (self.dy @ shard[-1]).view(out.shape[:2] + (-1, self.args.head_dim))
        keys, values = inputs.kv.wait()
        dq, d_keys, d_values = self.args.attend_backward(d_out, inputs.query.detach(), keys, values,
                                                         out.view_as(d_out), self.saved.lses[r])
        dkv = ScatterKVGrads(d_keys, d_values, self.args.kv_group, self.args.indices, inflight)
        return HeadGroupAttentionGrads(r, shard, inputs, dq, dkv, d_proj)

    def weights(self, g: HeadGroupAttentionGrads, shards: ShardStream) -> None:
        dk, dv = g.dkv.wait()
        key, value = g.inputs.key, g.inputs.value
        d_mixed, *d_norms = torch.autograd.grad(
            (g.inputs.query, key, value), (g.inputs.mixed, *self.saved.replicated),
            (g.dq, dk.to(key.dtype), dv.to(value.dtype)))
        for acc, d in zip(self.d_replicated, d_norms):
            acc += d
        d_mixed2d = d_mixed.reshape(-1, d_mixed.size(-1))
        self.dx += (d_mixed2d @ g.shard[0]).view_as(self.saved.x)
        d_qkv = [grad_product(d_mixed2d, self.x2d)] + ([d_mixed2d.float().sum(0)] if self.args.has_bias else [])
        shards.reduce_grad(g.r, [*d_qkv, g.d_proj])
