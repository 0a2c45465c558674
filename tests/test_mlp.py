"""TSPMLP against stock megatron-core MLP at world size 1: under TSP, and as the ring MLP of
a tensor-parallel model with and without sequence parallelism."""

import itertools

import pytest
import torch
import torch.nn.functional as F
import volumes
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from reference import (
    AtenOps,
    SavedBytes,
    assert_within,
    configs,
    init_tsp,
    local_rows,
    rel_err,
    replicated_bias_error,
    shard_of,
    solo_pg_collection,
)

from megatron_tsp.core.mlp import TSPMLP
from megatron_tsp.measure import counts

SEQ, BATCH, HIDDEN, FFN = 16, 2, 32, 64
SUBMODULES = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)


def _group():
    from megatron.core import parallel_state as mpu

    return mpu.get_tensor_model_parallel_group()  # TSP's group, or the TP group the ring runs over


def _build(tsp_size, dtype, swiglu, bias, overlap=True, sequence_parallel=True, shards_per_call=1):
    act = dict(gated_linear_unit=True, activation_func=F.silu) if swiglu else dict(activation_func=F.gelu)
    ref_cfg, tsp_cfg = configs(tsp_size, dtype, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=8,
                               add_bias_linear=bias, **act)
    if not sequence_parallel:
        tsp_cfg.sequence_parallel = False
    solo = solo_pg_collection()
    torch.manual_seed(0)
    ref = MLP(ref_cfg, SUBMODULES, ffn_hidden_size=FFN, tp_group=solo.tp)
    torch.manual_seed(0)
    tsp = TSPMLP(tsp_cfg, SUBMODULES, ffn_hidden_size=FFN, overlap_comm=overlap, shards_per_call=shards_per_call)
    return ref, tsp


def _fc1_shard(full, swiglu, group):
    """megatron's fc1 shard: gated fc1 is [gate; up] with stride 2, so each rank holds a
    slice of the gate rows and the same slice of the up rows."""
    if not swiglu:
        return shard_of(full, 0, group)
    gate, up = full.chunk(2, dim=0)
    return torch.cat([shard_of(gate, 0, group), shard_of(up, 0, group)])


def _inputs(dtype):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(SEQ, BATCH, HIDDEN, generator=g).to(dtype),
            torch.randn(SEQ, BATCH, HIDDEN, generator=g).to(dtype))


def _rows(full, group, sequence_parallel):
    return local_rows(full, group) if sequence_parallel else full


def _run_tsp(tsp, x_full, dy_full, saved=None):
    """Forward (with ``saved`` counting what it keeps for backward), then backward."""
    group, sp = _group(), tsp.config.sequence_parallel
    x = _rows(x_full, group, sp).clone().requires_grad_()
    with saved or SavedBytes():
        out, bias = tsp(x)
    out.backward(_rows(dy_full, group, sp))
    return out, bias, x


def _one_case(tsp_size, dtype, swiglu, bias, sequence_parallel=True, shards_per_call=1):
    group = _group()
    ref, tsp = _build(tsp_size, dtype, swiglu, bias, sequence_parallel=sequence_parallel,
                      shards_per_call=shards_per_call)
    x_full, dy_full = _inputs(dtype)
    x_ref = x_full.clone().requires_grad_()
    out_ref, bias_ref = ref(x_ref)
    out_ref.backward(dy_full)
    out, out_bias, x = _run_tsp(tsp, x_full, dy_full)

    assert torch.equal(tsp.linear_fc1.weight, _fc1_shard(ref.linear_fc1.weight, swiglu, group))
    assert torch.equal(tsp.linear_fc2.weight, shard_of(ref.linear_fc2.weight, 1, group))
    errors = {
        "output": rel_err(out, _rows(out_ref, group, sequence_parallel)),
        "dx": rel_err(x.grad, _rows(x_ref.grad, group, sequence_parallel)),
        "dW1": rel_err(tsp.linear_fc1.weight.grad, _fc1_shard(ref.linear_fc1.weight.grad, swiglu, group)),
        "dW2": rel_err(tsp.linear_fc2.weight.grad, shard_of(ref.linear_fc2.weight.grad, 1, group)),
    }
    if bias:
        errors["db1"] = rel_err(tsp.linear_fc1.bias.grad, _fc1_shard(ref.linear_fc1.bias.grad, swiglu, group))
        assert out_bias is tsp.linear_fc2.bias and torch.equal(out_bias, bias_ref)
        if sequence_parallel:
            errors["db2"] = replicated_bias_error(out_bias, bias_ref, dy_full, group)
    else:
        assert out_bias is None and bias_ref is None
    return errors


def _all_cases(tsp_size, dtype, layout="tsp", shards_per_call=1):
    if layout == "tsp":
        init_tsp(tsp_size)
    else:  # the ring MLP of a TP model: tp-sp-ring, or tp-ring without sequence parallelism
        init_tsp(1, tensor_model_parallel_size=tsp_size, ring_mlp=True)
    return [((swiglu, bias), _one_case(tsp_size, dtype, swiglu, bias, layout != "tp-ring", shards_per_call))
            for swiglu, bias in itertools.product((False, True), (False, True))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tsp_size", [1, 2, 4, 8])
def test_matches_stock_mlp(ranks, tsp_size, dtype):
    assert_within(ranks(tsp_size, _all_cases, tsp_size, dtype), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tsp_size", [2, 4])
def test_gathered_shards_match_stock_mlp(ranks, tsp_size, dtype):
    """Every shard gathered at once (``shards_per_call`` = D, a short layer's MLP): the same
    output, input gradient and every weight gradient as megatron's MLP at world size 1."""
    assert_within(ranks(tsp_size, _all_cases, tsp_size, dtype, "tsp", tsp_size), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["tp-sp-ring", "tp-ring"])
def test_ring_mlp_in_a_tensor_parallel_model_matches_stock_mlp(ranks, layout, dtype):
    assert_within(ranks(4, _all_cases, 4, dtype, layout), dtype)


def _overlap_determinism_and_traffic(tsp_size):
    init_tsp(tsp_size)
    results, traffic = [], []
    for overlap in (True, False, True):
        _, tsp = _build(tsp_size, torch.float32, swiglu=True, bias=True, overlap=overlap)
        x_full, dy_full = _inputs(torch.float32)
        saved = SavedBytes(tsp.parameters())
        with counts.count_collectives() as records:
            out, _, x = _run_tsp(tsp, x_full, dy_full, saved)
        results.append([out.detach(), x.grad] + [p.grad for p in tsp.shard_tensors()])
        traffic.append(counts.by_phase(records))
    same = [all(torch.equal(a, b) for a, b in zip(results[0], other)) for other in results[1:]]
    shard_bytes = sum(t.numel() * t.element_size() for t in tsp.shard_tensors())
    return same, traffic[0], saved.total, saved.largest_activation, shard_bytes


@pytest.mark.parametrize("tsp_size", [1, 4])
def test_overlap_determinism_traffic_and_saved_memory(ranks, tsp_size):
    (_, _, single, _, _), = ranks(1, _overlap_determinism_and_traffic, 1)
    expected = volumes.tsp_mlp(hidden=HIDDEN, ffn=FFN, tsp=tsp_size, e=4, gated=True, fc1_bias=True)
    for same, traffic, saved, largest, shard_bytes in ranks(tsp_size, _overlap_determinism_and_traffic, tsp_size):
        assert same == [True, True]
        # only point-to-point: no all-reduce, no all-gather, no collective of any kind
        assert {p for prims in traffic.values() for p in prims} <= {"send_recv"}
        if tsp_size > 1:
            # this MLP is the whole model: its backward keeps the forward's last shard, and its
            # first exchange travels as its forward ends
            moved = volumes.last_mlp(expected, tsp_size)
            assert moved["forward"] == shard_bytes
            assert traffic == {phase: {"send_recv": n["send_recv"] + moved[phase]} for phase, n in expected.items()}
        assert saved <= single / tsp_size + 2 * shard_bytes
        # the largest saved activation is one shard's (gated) fc1 output for this rank's
        # tokens: [S/D, b, 2f/D], never anything of the whole sequence
        assert largest <= SEQ * BATCH * 2 * FFN // tsp_size**2


def test_indivisible_ffn_is_a_clear_error():
    from megatron_tsp.core.support import check_mlp_config

    _, cfg = configs(4, ffn_hidden_size=66)
    with pytest.raises(ValueError, match="--ffn-hidden-size 66 is not divisible by --tsp-size 4"):
        check_mlp_config(cfg, 4, 66)


def _ring_without_modules(tsp_size):
    """The ring schedule on plain tensors: no megatron module, no TSP state."""
    import torch.distributed as dist

    from megatron_tsp.core.mlp import MLPScheduleArgs, RotateMLPShards

    group = dist.new_group(list(range(tsp_size)))
    rank = group.rank()
    g = torch.Generator().manual_seed(3)
    w1, b1 = torch.randn(FFN, HIDDEN, generator=g), torch.randn(FFN, generator=g)
    w2 = torch.randn(HIDDEN, FFN, generator=g)
    x_all, dy_all = torch.randn(2, tsp_size * SEQ, HIDDEN, generator=g).unbind(0)
    ref = [t.clone().requires_grad_() for t in (x_all, w1, b1, w2)]
    (F.gelu(ref[0] @ ref[1].t() + ref[2]) @ ref[3].t()).backward(dy_all)
    rows = slice(rank * SEQ, (rank + 1) * SEQ)
    x = x_all[rows].clone().requires_grad_()
    own = [t.chunk(tsp_size, dim)[rank].clone().requires_grad_() for t, dim in ((w1, 0), (b1, 0), (w2, 1))]
    args = MLPScheduleArgs(group, F.gelu, HIDDEN, has_bias=True)
    y = RotateMLPShards.apply(args, x, *own)
    y.backward(dy_all[rows])
    expected_y = (F.gelu(x_all @ w1.t() + b1) @ w2.t())[rows]
    expected_grads = [ref[0].grad[rows]] + [r.grad.chunk(tsp_size, dim)[rank]
                                             for r, dim in ((ref[1], 0), (ref[2], 0), (ref[3], 1))]
    return [rel_err(y, expected_y)] + [rel_err(a.grad, e) for a, e in zip([x, *own], expected_grads)]


def test_ring_schedule_runs_without_modules(ranks):
    """The schedule takes its group, activation and bias flag as arguments (no module)."""
    for errors in ranks(2, _ring_without_modules, 2):
        assert max(errors) < 1e-5, errors


def _kept_activation(tsp_size, dtype):
    """A GELU MLP with and without selective ``mlp`` recompute: (outputs and gradients
    bit-equal, GELUs run by backward, bytes saved for backward, which settings keep it)."""
    init_tsp(tsp_size)
    group = _group()
    x_full, dy_full = _inputs(dtype)
    results, gelus, saved = [], [], []
    for recompute in (False, True):
        _, tsp = _build(tsp_size, dtype, swiglu=False, bias=True)
        if recompute:
            tsp.config.recompute_granularity, tsp.config.recompute_modules = "selective", ["mlp"]
        x = _rows(x_full, group, True).clone().requires_grad_()
        with SavedBytes(tsp.parameters()) as kept:
            out, _ = tsp(x)
        with AtenOps() as ops:
            out.backward(_rows(dy_full, group, True))
        results.append([out.detach(), x.grad] + [p.grad for p in tsp.shard_tensors()])
        gelus.append(ops.ops.count("aten.gelu.default"))
        saved.append(kept.total)
    same = all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    keeps = {}
    for name, changes in (("full uniform", dict(recompute_granularity="full", recompute_method="uniform")),
                          ("full block", dict(recompute_granularity="full", recompute_method="block")),
                          ("none", dict(recompute_granularity=None)),
                          ("swiglu", dict(recompute_granularity="full", recompute_method="uniform",
                                          gated_linear_unit=True))):
        _, tsp = _build(tsp_size, dtype, swiglu=False, bias=False)
        for key, value in changes.items():
            setattr(tsp.config, key, value)
        keeps[name] = tsp.activation_grad() is not None
    return same, gelus, saved, keeps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_recomputed_gelu_mlp_keeps_its_activation_and_backward_does_not_run_it(ranks, dtype):
    """Recomputed, the MLP's saved tensors live one layer's backward only, so it keeps GELU's
    output as megatron's MLP keeps fc2's input: backward runs no GELU (it ran one per shard),
    and gives the same bits (aten's gelu_backward is GELU's autograd formula)."""
    tsp_size = 2
    esize = torch.tensor([], dtype=dtype).element_size()
    for same, gelus, saved, keeps in ranks(tsp_size, _kept_activation, tsp_size, dtype):
        assert same
        assert gelus == [tsp_size, 0]
        assert saved[1] - saved[0] == SEQ // tsp_size * BATCH * FFN * esize  # a [S/D, b, FFN/D] per shard
        assert keeps == {"full uniform": True, "full block": False, "none": False, "swiglu": False}
