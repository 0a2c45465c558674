"""TSP self-attention: megatron's ``SelfAttention`` with TSP's forward (docs/design.md section 2).

Rank p of a TSP group of size D holds the tokens ``x_p: [S/D, b, h]`` (zigzag chunks p and
2D-1-p) and head group p's weights, in exactly megatron's tensor-parallel layout (this class
*is* a megatron ``SelfAttention``; only ``forward`` differs). The layer does what is local to
a rank: q/k norms and RoPE at its tokens' global positions (:meth:`TSPSelfAttention.split_heads`),
its queries' blocks against the gathered keys (:mod:`megatron_tsp.core.block_geometry`) and
how many head groups a kernel call takes (:mod:`megatron_tsp.core.head_groups`). What travels
between the ranks, weight shards by broadcast and K/V by all-gather, and the gradients back,
is :class:`~megatron_tsp.core.attention_schedule.BroadcastShardsGatherKV`.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple, Union

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from torch._subclasses.fake_tensor import is_fake

from megatron_tsp.core import comm, zigzag
from megatron_tsp.core.attention_kernels import prepare_backend, validate_backend
from megatron_tsp.core.attention_schedule import (
    AttentionScheduleArgs,
    BroadcastShardsGatherKV,
    Rope,
    post_first_shards,
)
from megatron_tsp.core.block_geometry import blocks as global_blocks
from megatron_tsp.core.block_geometry import (
    window_of,
    zigzag_backward_blocks,
    zigzag_blocks,
    zigzag_document_blocks,
    zigzag_own_keys_first,
    zigzag_own_keys_last,
    zigzag_window_blocks,
)
from megatron_tsp.core.documents import document_starts
from megatron_tsp.core.head_groups import head_groups_per_call
from megatron_tsp.core.parallel_state import resolve_tsp_groups
from megatron_tsp.core.prefetch import LayerChain
from megatron_tsp.core.rope import apply_rope
from megatron_tsp.core.streaming import linear_pair_shard, run_forward_pre_hooks
from megatron_tsp.core.support import check_attention_config


class TSPSelfAttention(SelfAttention):
    """Drop-in for megatron's ``SelfAttention`` under TSP (same parameters and checkpoints).

    ``overlap_comm``: the next head groups' weights and K/V travel while one computes (else
    every transfer completes where it is posted: :class:`~megatron_tsp.core.comm.Blocking`).
    ``attention_backend``: see :func:`megatron_tsp.core.attention_kernels.resolve_backend`.
    ``zigzag_indices``: an :class:`~megatron_tsp.core.zigzag.IndexCache` shared by the
    layers of a model (the TSP layer spec passes one), else this layer's own.
    ``chain``: the model's :class:`~megatron_tsp.core.prefetch.LayerChain` (the spec passes
    one): the next layer's first shard travels during this layer's last head group.
    ``lookahead``: head-group shards in flight ahead of the one in use (1 or more: each one
    more shard of memory); with several head groups a stage, stages' shards.
    ``head_groups_per_call``: head groups attended side by side, in one kernel call per
    block and one K/V gather (:func:`~megatron_tsp.core.head_groups.head_groups_per_call`;
    ``auto``, also written 0, or a divisor of D). The support matrix checks both
    (:func:`~megatron_tsp.core.support.check_attention_config`).
    """

    is_tsp_attention = True

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
        chain: Optional[LayerChain] = None,
        lookahead: int = 1,
        head_groups_per_call: Union[int, str] = "auto",
        **layer_kwargs,
    ):
        group, weight_group = resolve_tsp_groups(pg_collection)
        check_attention_config(config, group.size(), attn_mask_type, lookahead, head_groups_per_call)
        # layer_kwargs: what the running megatron-core's TransformerLayer passes beyond these
        # (0.19: name, pp_layer_offset), for SelfAttention to take as it does
        super().__init__(config, submodules, layer_number, attn_mask_type, cp_comm_type, pg_collection, **layer_kwargs)
        if self.tp_group.size() != group.size():
            raise ValueError("TSPSelfAttention: pg_collection.tp must be the TSP group")
        self.head_groups_per_call = head_groups_per_call
        self.tsp_group = group
        self.weight_group = weight_group
        self.overlap_comm = overlap_comm
        self.lookahead = lookahead
        self.attention_backend = validate_backend(attention_backend)
        self.softmax_scale = config.softmax_scale or 1.0 / math.sqrt(self.hidden_size_per_attention_head)
        self.window = window_of(layer_number, config, "TSPSelfAttention")  # keys before a query it sees; -1: all
        self.zigzag_indices = zigzag_indices if zigzag_indices is not None else zigzag.IndexCache()
        self.chain = chain if chain is not None else LayerChain()
        self.chain.register(self)

    # ---- parameters streamed per head group -------------------------------------------
    def shard_tensors(self) -> List[torch.Tensor]:
        """This rank's weight shard, in the order it travels: Wqkv, (bqkv), Wproj."""
        return linear_pair_shard(self.linear_qkv, self.linear_proj)

    def replicated_parameters(self) -> List[torch.nn.Parameter]:
        """Parameters every rank holds whole and uses on its own tokens (q/k norms)."""
        return [p for m in (self.q_layernorm, self.k_layernorm) if m is not None for p in m.parameters()]

    def post_first_transfer(self, inflight: comm.InFlight):
        """Post this layer's first transfer on the poster's transport ``inflight``
        (:func:`~megatron_tsp.core.attention_schedule.post_first_shards`): :mod:`prefetch`."""
        return post_first_shards(self.shard_tensors(), self.weight_group, self.lookahead, inflight,
                                 gathered=self.chain.short_layers)

    # ---- the local stage of one head group ---------------------------------------------
    def rope_tables(self, freqs: Optional[torch.Tensor], dtype: torch.dtype) -> Rope:
        """RoPE for this rank's tokens, once per layer and pass: ``(cos, sin)`` in the
        activations' dtype, computed as megatron's unfused RoPE computes them; megatron's
        fused RoPE (``apply_rope_fusion``) and interleaved RoPE take the frequencies."""
        if freqs is None:
            return None
        if self.config.apply_rope_fusion or self.config.rotary_interleaved:
            return (freqs,)
        return torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)

    def _rope(self, t: torch.Tensor, rope: Rope, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """RoPE of ``t`` (into ``out`` when given: the K/V send buffer)."""
        if len(rope) == 1:
            rotated = apply_rotary_pos_emb(t, rope[0], config=self.config, cp_group=self.pg_collection.cp)
            return rotated if out is None else out.copy_(rotated)
        cos, sin = rope
        rot_dim = cos.size(-1)
        if rot_dim == t.size(-1):  # megatron's _apply_rotary_pos_emb_bshd, term for term
            rotated = apply_rope(t, cos, sin)
            return rotated if out is None else out.copy_(rotated)
        head, rest = t[..., :rot_dim], t[..., rot_dim:]
        return torch.cat((apply_rope(head, cos, sin), rest), dim=-1, out=out)

    def split_heads(self, mixed: torch.Tensor, rope: Rope, local: Optional[torch.Tensor] = None):
        """A stage's QKV projection, its G head groups' side by side ``[s, b, G * (a/D + 2g/D) d]``
        -> q [s, b, G a/D, d], k and v [s, b, G g/D, d]: megatron's interleaved layout, whose
        query groups side by side are again that layout, so that the stage takes its q/k norms
        and RoPE (at the tokens' global positions) in one op each, not one per head group.
        With ``local`` (a K/V send buffer, outside autograd) k and v are written into it."""
        heads_per_group = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        d = self.hidden_size_per_attention_head
        mixed = mixed.view(*mixed.shape[:2], -1, (heads_per_group + 2) * d)
        query, key, value = torch.split(mixed, [heads_per_group * d, d, d], dim=3)
        query = query.reshape(*query.shape[:2], -1, d)
        if self.q_layernorm is not None:
            query = self.q_layernorm(query)
        if self.k_layernorm is not None:
            key = self.k_layernorm(key)
        if rope is not None:
            query = self._rope(query, rope)
            key = self._rope(key, rope, None if local is None else local[:, 0])
        elif local is not None:
            local[:, 0].copy_(key)
        if local is not None:
            local[:, 1].copy_(value)
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
        TransformerEngine does for ``AttnMaskType.causal``, within the packed documents of
        ``packed_seq_params`` where given (:mod:`megatron_tsp.core.documents`).
        """
        for name, value in (("key_value_states", key_value_states),
                            ("inference_context", inference_context or inference_params),
                            ("attention_bias", attention_bias),
                            ("rotary_pos_cos/sin", rotary_pos_cos if rotary_pos_cos is not None else rotary_pos_sin)):
            if value is not None:
                raise NotImplementedError(f"TSPSelfAttention: {name} is not supported")
        d_size, rank = self.tsp_group.size(), self.tsp_group.rank()
        seq_len = hidden_states.size(0) * d_size
        documents = document_starts(packed_seq_params, hidden_states.size(1), seq_len, "TSPSelfAttention")
        own_keys_last = own_keys_first = None
        freqs = None
        if rotary_pos_emb is not None:
            if isinstance(rotary_pos_emb, tuple):
                rotary_pos_emb = rotary_pos_emb[0]
            if rotary_pos_emb.size(0) < seq_len:
                raise ValueError(f"rotary table has {rotary_pos_emb.size(0)} positions, sequence has {seq_len}")
            indices = self.zigzag_indices.get(seq_len, d_size, rank, hidden_states.device)
            freqs = rotary_pos_emb[indices.local_positions]
        chunk = hidden_states.size(0) // 2 if d_size > 1 else hidden_states.size(0)
        backend, aligned = prepare_backend(self.attention_backend, hidden_states.device, hidden_states.dtype,
                                           is_fake(hidden_states), seq_len, self.window >= 0, documents is not None,
                                           self.hidden_size_per_attention_head)
        groups_per_call = head_groups_per_call(self.head_groups_per_call, d_size, hidden_states.size(1),
                                               self.num_attention_heads_per_partition, chunk, hidden_states.device,
                                               backend, planned=is_fake(hidden_states))
        if d_size == 1:
            blocks = global_blocks([0], chunk, aligned, self.window, backend, documents)
            backward_blocks = (blocks, len(blocks))
        elif documents is not None:
            blocks, backward_blocks = zigzag_document_blocks(d_size, rank, chunk, documents, self.window)
        elif self.window >= 0:
            blocks, backward_blocks = zigzag_window_blocks(d_size, rank, chunk, self.window, backend)
        else:
            blocks = zigzag_blocks(d_size, rank, chunk, aligned)
            backward_blocks = zigzag_backward_blocks(d_size, rank, chunk)
            # in a pass of one stage (short S) the own keys' blocks are all that could run beside
            # the one K/V transfer, 1/D of the attention: not worth three more calls and two merges
            if groups_per_call < d_size:
                own_keys_last = zigzag_own_keys_last(d_size, rank, chunk)
        starts = sorted({b[0] // chunk * chunk for b in blocks})  # a query chunk's blocks may cut it in pieces
        chunks = [(slice(q0, q0 + chunk), [(b[0] - q0, b[1] - q0, *b[2:]) for b in blocks if q0 <= b[0] < q0 + chunk])
                  for q0 in starts]
        if own_keys_last is not None:
            own_keys_first = zigzag_own_keys_first(d_size, rank, chunk, [b for _, b in chunks])
        args = AttentionScheduleArgs(
            tsp_group=self.tsp_group, weight_group=self.weight_group, split_heads=self.split_heads,
            rope=self.rope_tables(freqs, hidden_states.dtype), chunks=chunks, backward_blocks=backward_blocks,
            softmax_scale=self.softmax_scale,
            backend=backend, width=self.query_projection_size, head_dim=self.hidden_size_per_attention_head,
            kv_heads=self.num_query_groups_per_partition, has_bias=self.linear_qkv.bias is not None,
            transport=comm.transport(self.overlap_comm), lookahead=self.lookahead,
            chain=self.chain, module=self, softmax_type=self.config.softmax_type, own_keys_last=own_keys_last,
            own_keys_first=own_keys_first,
            backward_follows=torch.is_grad_enabled() or self.config.recompute_granularity == "full",
            groups_per_call=groups_per_call)
        self.chain.attention_stages = d_size // groups_per_call
        sink = []
        if self.config.softmax_type == "learnable":  # read, not called: its pre-hooks stand in (streaming.py)
            run_forward_pre_hooks(self.core_attention)
            sink = [self.core_attention.softmax_offset]
        output = BroadcastShardsGatherKV.apply(args, hidden_states, *self.shard_tensors(),
                                               *self.replicated_parameters(), *sink)
        return output, self.linear_proj.bias
