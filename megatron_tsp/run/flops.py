"""Model FLOPs of a dense GPT, counted the way Megatron-LM counts them.

Megatron-LM core_v0.16.1, ``training.num_floating_point_operations`` (MHA/GQA, no MoE): every
GEMM runs three times (forward, data gradient, weight gradient), two FLOPs per multiply-add,
causal attention counts half the score matrix. Recomputation is *not* counted (model FLOPs).
Megatron-LM counts a sliding window's layers as global ones; here a window layer counts the
keys its window reaches (on average over the sequence), so that MFU is of work done. Packed
documents are not counted (their sizes are the data's). A mixture-of-experts layer counts the
top-k experts a token goes to, the shared experts and the router, as Megatron-LM does.
"""

from __future__ import annotations

from megatron_tsp.core.support import window_pair


def window_keys(seq: int, window: int) -> float:
    """Keys before a query, on average over ``seq`` queries, that a causal ``window`` reaches
    (-1: all of them, counted as Megatron-LM does, seq / 2)."""
    if window < 0 or window >= seq:
        return seq / 2
    return (window * (window + 1) / 2 + (seq - window - 1) * window) / seq


def flops_per_sequence(num_layers: int, hidden: int, ffn: int, heads: int, groups: int,
                       head_dim: int, seq: int, vocab: int, swiglu: bool, window: int = -1,
                       window_layers: int = 0, moe_layers: int = 0, moe_ffn: int = 0, experts: int = 0) -> float:
    """Forward + backward FLOPs of one sequence of ``seq`` tokens; ``window_layers`` of the
    layers attend through a sliding ``window``; ``moe_layers`` of them route each token to
    experts of ``moe_ffn`` hidden units in all (top-k x the expert's, plus the shared ones)
    out of ``experts``."""
    q = head_dim * heads
    kv = head_dim * groups

    def attention(keys: float) -> float:
        return 3 * 2 * (hidden * (q + 2 * kv) + q * keys * 2 + q * hidden)

    mlp = 3 * 2 * (3 if swiglu else 2) * hidden * ffn
    moe = 3 * 2 * ((3 if swiglu else 2) * hidden * moe_ffn + hidden * experts)  # the experts and the router
    logits = 3 * 2 * hidden * vocab
    layers = (num_layers - window_layers) * attention(seq / 2) + window_layers * attention(window_keys(seq, window)) \
        + (num_layers - moe_layers) * mlp + moe_layers * moe
    return seq * (layers + logits)


def flops_per_sequence_from_args(args, padded_vocab: int) -> float:
    pair = window_pair(getattr(args, "window_size", None))
    window, window_layers = -1, 0
    if pair:
        freq = getattr(args, "window_attn_skip_freq", None)
        window = pair[0]
        window_layers = sum(1 for n in range(1, args.num_layers + 1) if not freq or n % freq != 0)
    experts = getattr(args, "num_experts", None) or 0
    moe_layers = moe_ffn = 0
    if experts:
        moe_layers = sum(1 for i in range(args.num_layers) if i % args.moe_layer_freq == 0)
        moe_ffn = args.moe_router_topk * (args.moe_ffn_hidden_size or args.ffn_hidden_size) + \
            (args.moe_shared_expert_intermediate_size or 0)
    return flops_per_sequence(args.num_layers, args.hidden_size, args.ffn_hidden_size,
                              args.num_attention_heads, args.num_query_groups, args.kv_channels,
                              args.seq_length, padded_vocab, args.swiglu, window, window_layers,
                              moe_layers, moe_ffn, experts)
