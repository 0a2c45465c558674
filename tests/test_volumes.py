"""Counted bytes of real code paths against docs/design.md section 8 (megatron_tsp.measure.volumes).

The planner's collective counts (torch.distributed wrapped, so TSP's and megatron's traffic
alike) for L layers equal L times the per-layer formula plus the embedding and output
layer, which TSP and TP+SP share (sequence-parallel scatter in, gather out).
"""

import os

import pytest
import volumes
from conftest import ROOT

from megatron_tsp.measure import memory
from megatron_tsp.run import config

D, SEQ, LAYERS = 2, 256, 2


def _plan(mode):
    values = config.load_config(os.path.join(ROOT, "configs", "tiny-cpu.yaml"))
    values.update(seq_length=SEQ, max_position_embeddings=SEQ, num_layers=LAYERS)
    args = config.resolve(values)
    return args, memory.plan(values, mode)["comm"]


def _bytes(comm, group, phase, primitive):
    return comm.get(group, {}).get(phase, {}).get(primitive, {}).get("bytes_received", 0)


@pytest.fixture(scope="module")
def shared():
    """Embedding scatter and output-layer gather of [S, b, h], fp32."""
    args, _ = _plan("tsp")
    act = volumes._share(4 * SEQ * args.micro_batch_size * args.hidden_size, D)
    return args, act


def test_tsp_counts_match_the_formula(shared):
    args, act = shared
    _, comm = _plan("tsp")
    attn = volumes.tsp_attention(SEQ, args.micro_batch_size, args.hidden_size, args.num_attention_heads,
                                 args.num_query_groups, args.kv_channels, D, e=4)
    mlp = volumes.tsp_mlp(args.hidden_size, args.ffn_hidden_size, D, e=4, gated=args.swiglu)
    for phase in ("forward", "backward"):
        assert _bytes(comm, "tsp_weight", phase, "broadcast") == LAYERS * attn[phase]["broadcast"]
        assert _bytes(comm, "tsp_weight", phase, "send_recv") == LAYERS * mlp[phase]["send_recv"]
    assert _bytes(comm, "tsp_weight", "backward", "reduce") == LAYERS * attn["backward"]["reduce"]
    # K/V on the TSP group (megatron's tensor-parallel slot), plus the embedding/output traffic there
    assert _bytes(comm, "tsp", "forward", "all_gather") == LAYERS * attn["forward"]["all_gather"] + act
    assert _bytes(comm, "tsp", "forward", "reduce_scatter") == act
    assert _bytes(comm, "tsp", "backward", "all_gather") == LAYERS * attn["backward"]["all_gather"] + 2 * act
    assert _bytes(comm, "tsp", "backward", "reduce_scatter") == LAYERS * attn["backward"]["reduce_scatter"] + act
    # The only all-reduces are the vocab-parallel cross entropy's ([S, b] statistics, shared
    # with TP+SP): the layers issue none.
    _, tp_sp = _plan("tp-sp")
    assert _bytes(comm, "tsp", "forward", "all_reduce") == _bytes(tp_sp, "tp", "forward", "all_reduce")
    assert _bytes(comm, "tsp", "forward", "all_reduce") <= 4 * 4 * SEQ * args.micro_batch_size


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
        assert _bytes(comm, "tsp_weight", phase, "send_recv") == LAYERS * mlp[phase]["send_recv"]
