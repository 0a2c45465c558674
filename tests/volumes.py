"""Bytes received per rank per layer, from the formulas of docs/design.md section 8.

Written from the design, not from the code, so that the tests can hold the traffic of the
real modules, counted by ``megatron_tsp.measure.counts``, against it (the performance model
counts the real modules instead, with the memory planner). ``e`` is bytes per element of
the model; TSP's gradients (partial weight gradients, dK/dV) travel in fp32. Every result
is a dict ``{"forward": {primitive: bytes}, "backward": {primitive: bytes}}``.
"""

from __future__ import annotations

from typing import Dict

Volumes = Dict[str, Dict[str, int]]


def _share(total: float, d: int) -> int:
    """What one rank receives of ``total`` bytes spread evenly over D ranks: (D-1)/D."""
    return int(round(total * (d - 1) / d))


def attention_weight_elements(hidden: int, heads: int, groups: int, head_dim: int,
                              qkv_bias: bool) -> int:
    """Elements of the streamed attention weights, all D shards: Wqkv (+bqkv) and Wproj."""
    qkv_out = (heads + 2 * groups) * head_dim
    return hidden * qkv_out + (qkv_out if qkv_bias else 0) + heads * head_dim * hidden


def mlp_weight_elements(hidden: int, ffn: int, gated: bool, fc1_bias: bool) -> int:
    """Elements of the streamed MLP weights, all D shards: W1 (+b1) and W2."""
    fc1_out = ffn * (2 if gated else 1)
    return hidden * fc1_out + (fc1_out if fc1_bias else 0) + ffn * hidden


def tsp_attention(seq: int, batch: int, hidden: int, heads: int, groups: int, head_dim: int,
                  tsp: int, e: int, qkv_bias: bool = False) -> Volumes:
    """Weights by broadcast, K/V by all-gather; backward re-broadcasts, re-gathers K/V,
    reduce-scatters dK/dV and reduces dW to the owner (both in fp32)."""
    weight_elements = attention_weight_elements(hidden, heads, groups, head_dim, qkv_bias)
    kv_elements = 2 * seq * batch * groups * head_dim
    weights, kv = _share(e * weight_elements, tsp), _share(e * kv_elements, tsp)
    return {
        "forward": {"broadcast": weights, "all_gather": kv},
        "backward": {"broadcast": weights, "all_gather": kv, "reduce_scatter": _share(4 * kv_elements, tsp),
                     "reduce": _share(4 * weight_elements, tsp)},
    }


def tsp_mlp(hidden: int, ffn: int, tsp: int, e: int, gated: bool = False,
            fc1_bias: bool = False) -> Volumes:
    """Weights around the ring; backward: weights again plus the travelling gradients (fp32)."""
    elements = mlp_weight_elements(hidden, ffn, gated, fc1_bias)
    weights = _share(e * elements, tsp)
    return {"forward": {"send_recv": weights}, "backward": {"send_recv": weights + _share(4 * elements, tsp)}}


def last_mlp(mlp: Volumes, tsp: int) -> Dict[str, int]:
    """What changes for a model's last MLP, whose backward runs right after its forward (a
    model that is not pipelined; core/prefetch.py): the backward computes first with the
    shard the forward ended with, so one weight hop (one of the forward's D-1) is not made;
    with D > 2 the backward's first exchange is posted as the forward ends."""
    hop = mlp["forward"]["send_recv"] // (tsp - 1)
    moved = hop if tsp > 2 else 0
    return {"forward": moved, "backward": -hop - moved}


def tp_sp_layer(seq: int, batch: int, hidden: int, tp: int, e: int) -> Volumes:
    """Megatron TP+SP: all-gather before and reduce-scatter after attention and MLP.

    Backward mirrors them (reduce-scatter dX of each gather, all-gather dY of each scatter)
    and all-gathers the column-parallel inputs once more for the weight gradients, because
    megatron saves only the local sequence shard.
    """
    act = _share(e * seq * batch * hidden, tp)
    return {
        "forward": {"all_gather": 2 * act, "reduce_scatter": 2 * act},
        "backward": {"all_gather": 4 * act, "reduce_scatter": 2 * act},
    }


def vocabulary_ends(layout: str, seq: int, batch: int, hidden: int, vocab: int, d: int, e: int) -> Volumes:
    """Embedding, output layer and loss of a tied model. ``sequence`` (megatron's, TP+SP's too):
    the embedding's ``[S, b, h]`` reduce-scattered and the output layer's input all-gathered,
    and in backward the reverse plus the output layer's input gathered again. ``table``
    (TSP's, core/vocab.py): each end all-gathers the ``[V, h]`` table and reduce-scatters its
    gradient in fp32, and the ``[S, b]`` fp32 per-token losses are all-gathered."""
    if layout == "table":
        table = _share(e * vocab * hidden, d)
        return {"forward": {"all_gather": 2 * table + _share(4 * seq * batch, d)},
                "backward": {"reduce_scatter": 2 * _share(4 * vocab * hidden, d)}}
    act = _share(e * seq * batch * hidden, d)
    return {"forward": {"all_gather": act, "reduce_scatter": act},
            "backward": {"all_gather": 2 * act, "reduce_scatter": act}}
