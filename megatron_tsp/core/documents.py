"""Packed documents (Megatron-LM's ``--reset-attention-mask``): where they start, carried to
the attention as megatron-core's ``PackedSeqParams``.

Megatron-LM's dataset marks a document's end with the EOD token and, with
``--reset-attention-mask``, builds a ``[b, 1, S, S]`` mask in which a token sees only its
own document's tokens up to itself (``_get_ltor_masks_and_position_ids``). At 128K nobody can
build that mask. Here the boundaries are read from the tokens of the whole sequence, in
natural order, before the zigzag permutation (every rank has the whole batch then), and
travel as ``PackedSeqParams(qkv_format="sbhd")``: ``cu_seqlens_q`` the documents' starts over
the micro-batch's samples laid end to end (THD's convention: sample s's documents start at
``s·S + p``, and ``b·S`` ends the list), a CPU tensor, read without a device sync. The
attention op turns them into blocks (``block_geometry.document_blocks``): no ``S x S``
tensor anywhere. Positions (``--reset-position-ids``) are the dataset's; RoPE, as in
megatron-core's GPTModel, rotates by global position, which within a document gives the
scores of positions restarted at its start.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams


def document_params(tokens: torch.Tensor, eod: int, cp_group=None) -> PackedSeqParams:
    """``tokens`` ``[b, S]`` in natural order: a document starts at 0 and after every EOD."""
    batch, seq = tokens.shape
    after_eod = (tokens[:, :-1] == eod).nonzero().cpu()
    starts = [[0] for _ in range(batch)]
    for sample, position in after_eod.tolist():
        starts[sample].append(position + 1)
    flat = [s * seq + p for s, ps in enumerate(starts) for p in ps] + [batch * seq]
    # max_seqlen: the RoPE table's length megatron-core's GPTModel builds for packed params
    return PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=torch.tensor(flat, dtype=torch.int32),
                           cu_seqlens_kv=torch.tensor(flat, dtype=torch.int32), max_seqlen_q=seq, max_seqlen_kv=seq,
                           cp_group=cp_group)


def document_starts(params: Optional[PackedSeqParams], batch: int, seq: int, where: str) -> Optional[List[List[int]]]:
    """Each sample's document starts from :func:`document_params`' ``params`` (None: none);
    a ValueError line for packed sequences of another kind (THD)."""
    if params is None:
        return None
    cu = params.cu_seqlens_q
    made = "packed sequences are taken as megatron_tsp.core.documents.document_params makes them"
    if params.qkv_format != "sbhd":
        raise ValueError(f"{where}: {made} (qkv_format 'sbhd'); got qkv_format {params.qkv_format!r}")
    if cu is None or cu.device.type != "cpu":
        raise ValueError(f"{where}: {made} (cu_seqlens_q on the CPU); got "
                         f"{'none' if cu is None else 'a tensor on ' + cu.device.type}")
    flat = cu.tolist()
    starts: List[List[int]] = [[] for _ in range(batch)]
    for p in flat[:-1]:
        if 0 <= p < batch * seq:
            starts[p // seq].append(p % seq)
    if flat[-1] != batch * seq or flat != sorted(flat) or any(not s or s[0] != 0 for s in starts):
        raise ValueError(f"{where}: packed documents must start at 0 of each of the micro-batch's {batch} "
                         f"sequences of {seq}, in order, and end at {batch * seq} (got {flat[:8]}...)")
    return starts
