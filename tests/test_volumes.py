"""Counted bytes of real code paths against docs/design.md section 8 (megatron_tsp.measure.volumes).

The planner's collective counts (torch.distributed wrapped, so TSP's and megatron's traffic
alike) for L layers equal L times the per-layer formula plus the embedding and output
layer: megatron's sequence-parallel scatter in and gather out (TP+SP, and TSP's sequence
layout), or TSP's gathered vocabulary table (its table layout).
"""

import os

import pytest
import volumes
from conftest import ROOT

from megatron_tsp.measure import memory
from megatron_tsp.run import config
from megatron_tsp.run.data import padded_vocab

D, SEQ, LAYERS = 2, 256, 2


def _plan(mode, **values):
    loaded = config.load_config(os.path.join(ROOT, "configs", "tiny-cpu.yaml"))
    loaded.update(seq_length=SEQ, max_position_embeddings=SEQ, num_layers=LAYERS, **values)
    args = config.resolve(loaded)
    return args, memory.plan(loaded, mode)["comm"]


def _bytes(comm, group, phase, primitive):
    return comm.get(group, {}).get(phase, {}).get(primitive, {}).get("bytes_received", 0)


@pytest.fixture(scope="module")
def shared():
    """Embedding scatter and output-layer gather of [S, b, h], fp32."""
    args, _ = _plan("tsp")
    act = volumes._share(4 * SEQ * args.micro_batch_size * args.hidden_size, D)
    return args, act


@pytest.mark.parametrize("layout", ["table", "sequence"])
def test_tsp_counts_match_the_formula(shared, layout):
    """``auto`` takes the table here: it moves fewer bytes than the sequence layout."""
    args, _ = shared
    _, comm = _plan("tsp", **({} if layout == "table" else {"tsp_vocab": layout}))
    attn = volumes.tsp_attention(SEQ, args.micro_batch_size, args.hidden_size, args.num_attention_heads,
                                 args.num_query_groups, args.kv_channels, D, e=4)
    mlp = volumes.tsp_mlp(args.hidden_size, args.ffn_hidden_size, D, e=4, gated=args.swiglu)
    ends = volumes.vocabulary_ends(layout, SEQ, args.micro_batch_size, args.hidden_size, padded_vocab(args), D, e=4)
    for phase in ("forward", "backward"):
        assert _bytes(comm, "tsp_weight", phase, "broadcast") == LAYERS * attn[phase]["broadcast"]
        assert _bytes(comm, "tsp_weight", phase, "send_recv") == LAYERS * mlp[phase]["send_recv"] + \
            volumes.last_mlp(mlp, D)[phase]
        for primitive in ("all_gather", "reduce_scatter"):  # K/V and the vocabulary ends on the TSP group
            assert _bytes(comm, "tsp", phase, primitive) == \
                LAYERS * attn[phase].get(primitive, 0) + ends[phase].get(primitive, 0), (phase, primitive)
    assert _bytes(comm, "tsp_weight", "backward", "reduce") == LAYERS * attn["backward"]["reduce"]
    # All-reduces: the norms' gradients (finalize_model_grads) and, in the sequence layout as in
    # TP+SP, the vocab-parallel cross entropy's three [S, b] fp32 statistics; the layers issue none.
    statistics = volumes._share(2 * 3 * 4 * SEQ * args.micro_batch_size, D)  # a ring all-reduce: 2(D-1)/D
    _, tp_sp = _plan("tp-sp")
    everything = _bytes(tp_sp, "tp", "forward", "all_reduce")
    assert everything > statistics
    assert _bytes(comm, "tsp", "forward", "all_reduce") == everything - (statistics if layout == "table" else 0)
    assert _bytes(comm, "tsp", "backward", "all_reduce") == 0


def test_tp_sp_counts_match_the_formula(shared):
    args, act = shared
    _, comm = _plan("tp-sp")
    layer = volumes.tp_sp_layer(SEQ, args.micro_batch_size, args.hidden_size, D, e=4)
    assert _bytes(comm, "tp", "forward", "all_gather") == LAYERS * layer["forward"]["all_gather"] + act
    assert _bytes(comm, "tp", "forward", "reduce_scatter") == LAYERS * layer["forward"]["reduce_scatter"] + act
    assert _bytes(comm, "tp", "backward", "all_gather") == LAYERS * layer["backward"]["all_gather"] + 2 * act
    assert _bytes(comm, "tp", "backward", "reduce_scatter") == LAYERS * layer["backward"]["reduce_scatter"] + act


def test_ring_mlp_moves_weights_instead_of_activations(shared):
    """tp-sp-ring: the attention's TP+SP collectives stay (half of a TP+SP layer's), the MLP's
    are gone, and the ring's weight and gradient traffic takes their place."""
    args, act = shared
    _, comm = _plan("tp-sp-ring")
    layer = volumes.tp_sp_layer(SEQ, args.micro_batch_size, args.hidden_size, D, e=4)
    mlp = volumes.tsp_mlp(args.hidden_size, args.ffn_hidden_size, D, e=4, gated=args.swiglu)
    for phase, extra in (("forward", {"all_gather": act, "reduce_scatter": act}),
                         ("backward", {"all_gather": 2 * act, "reduce_scatter": act})):
        for primitive in ("all_gather", "reduce_scatter"):
            attention_only = LAYERS * layer[phase][primitive] // 2
            assert _bytes(comm, "tp", phase, primitive) == attention_only + extra[primitive], (phase, primitive)
        assert _bytes(comm, "tsp_weight", phase, "send_recv") == LAYERS * mlp[phase]["send_recv"] + \
            volumes.last_mlp(mlp, D)[phase]


def test_every_recomputed_mlp_keeps_its_last_shard_for_its_backward():
    """Full recompute, one layer at a time: each MLP's backward runs right after its forward
    runs again, which keeps the shard it ended with, so every layer's backward makes one
    weight hop fewer (as the last layer's does without recompute). The first forward (no
    grad) keeps nothing, and moves what the forward always moves."""
    args, comm = _plan("tsp", recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    mlp = volumes.tsp_mlp(args.hidden_size, args.ffn_hidden_size, D, e=4, gated=args.swiglu)
    kept = volumes.last_mlp(mlp, D)
    assert kept["backward"] < 0
    assert _bytes(comm, "tsp_weight", "forward", "send_recv") == LAYERS * mlp["forward"]["send_recv"]
    assert _bytes(comm, "tsp_weight", "backward", "send_recv") == \
        LAYERS * (mlp["forward"]["send_recv"] + mlp["backward"]["send_recv"] + kept["forward"] + kept["backward"])
