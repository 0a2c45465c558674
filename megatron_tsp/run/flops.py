"""Model FLOPs of a dense GPT, counted the way Megatron-LM counts them.

Megatron-LM core_v0.16.1, ``training.num_floating_point_operations`` (MHA/GQA, no MoE): every
GEMM runs three times (forward, data gradient, weight gradient), two FLOPs per multiply-add,
causal attention counts half the score matrix. Recomputation is *not* counted (model FLOPs).
"""

from __future__ import annotations


def flops_per_sequence(num_layers: int, hidden: int, ffn: int, heads: int, groups: int,
                       head_dim: int, seq: int, vocab: int, swiglu: bool) -> float:
    """Forward + backward FLOPs of one sequence of ``seq`` tokens."""
    q = head_dim * heads
    kv = head_dim * groups
    attention = 3 * 2 * (hidden * (q + 2 * kv) + q * seq / 2 * 2 + q * hidden)
    mlp = 3 * 2 * (3 if swiglu else 2) * hidden * ffn
    logits = 3 * 2 * hidden * vocab
    return seq * (num_layers * (attention + mlp) + logits)


def flops_per_sequence_from_args(args, padded_vocab: int) -> float:
    return flops_per_sequence(args.num_layers, args.hidden_size, args.ffn_hidden_size,
                              args.num_attention_heads, args.num_query_groups, args.kv_channels,
                              args.seq_length, padded_vocab, args.swiglu)
