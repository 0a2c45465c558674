"""TSPSelfAttention against stock megatron-core SelfAttention at world size 1."""

import itertools

import pytest
import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.torch_norm import WrappedTorchNorm

import megatron_tsp
from megatron_tsp import comm, volumes
from megatron_tsp.attention import TSPSelfAttention
from reference import (SavedBytes, assert_within, configs, init_tsp, local_rows, rel_err,
                       replicated_bias_error, rotary_table, shard_of, solo_pg_collection, summed)

SEQ, BATCH, HIDDEN, HEADS = 16, 2, 64, 8


def _submodules(qk_norm):
    norm = WrappedTorchNorm if qk_norm else IdentityOp
    return SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear, core_attention=DotProductAttention,
                                   linear_proj=RowParallelLinear, q_layernorm=norm, k_layernorm=norm)


def _build(tsp_size, dtype, groups, qkv_bias, proj_bias, qk_norm, overlap=True):
    ref_cfg, tsp_cfg = configs(tsp_size, dtype, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               num_query_groups=groups, add_bias_linear=proj_bias, add_qkv_bias=qkv_bias)
    solo = solo_pg_collection()
    torch.manual_seed(0)
    ref = SelfAttention(ref_cfg, _submodules(qk_norm), layer_number=1,
                        attn_mask_type=AttnMaskType.causal, pg_collection=solo)
    torch.manual_seed(0)
    tsp = TSPSelfAttention(tsp_cfg, _submodules(qk_norm), layer_number=1, overlap_comm=overlap)
    return ref, tsp, solo


def _run_tsp(tsp, x_full, dy_full, rope):
    group = megatron_tsp.get_tsp_group()
    x = local_rows(x_full, group).clone().requires_grad_()
    out, bias = tsp(x, None, rotary_pos_emb=rope)
    out.backward(local_rows(dy_full, group))
    return out, bias, x


def _one_case(tsp_size, dtype, groups, rope, qkv_bias, proj_bias, qk_norm):
    group = megatron_tsp.get_tsp_group()
    ref, tsp, solo = _build(tsp_size, dtype, groups, qkv_bias, proj_bias, qk_norm)
    g = torch.Generator().manual_seed(1)
    x_full = torch.randn(SEQ, BATCH, HIDDEN, generator=g).to(dtype)
    dy_full = torch.randn(SEQ, BATCH, HIDDEN, generator=g).to(dtype)
    table = rotary_table(ref.config, SEQ, solo.cp) if rope else None

    x_ref = x_full.clone().requires_grad_()
    out_ref, bias_ref = ref(x_ref, None, rotary_pos_emb=table)
    out_ref.backward(dy_full)
    out, bias, x = _run_tsp(tsp, x_full, dy_full, table)

    assert torch.equal(tsp.linear_qkv.weight, shard_of(ref.linear_qkv.weight, 0, group))
    assert torch.equal(tsp.linear_proj.weight, shard_of(ref.linear_proj.weight, 1, group))
    errors = {
        "output": rel_err(out, local_rows(out_ref, group)),
        "dx": rel_err(x.grad, local_rows(x_ref.grad, group)),
        "dWqkv": rel_err(tsp.linear_qkv.weight.grad, shard_of(ref.linear_qkv.weight.grad, 0, group)),
        "dWproj": rel_err(tsp.linear_proj.weight.grad, shard_of(ref.linear_proj.weight.grad, 1, group)),
    }
    if qkv_bias:
        errors["dbqkv"] = rel_err(tsp.linear_qkv.bias.grad, shard_of(ref.linear_qkv.bias.grad, 0, group))
    if proj_bias:
        assert bias is tsp.linear_proj.bias and torch.equal(bias, bias_ref)
        errors["dbproj"] = replicated_bias_error(bias, bias_ref, dy_full, group)
    else:
        assert bias is None and bias_ref is None
    if qk_norm:
        errors["dq_norm"] = rel_err(summed(tsp.q_layernorm.weight.grad, group), ref.q_layernorm.weight.grad)
        errors["dk_norm"] = rel_err(summed(tsp.k_layernorm.weight.grad, group), ref.k_layernorm.weight.grad)
    return errors


CASES = [
    dict(groups=g, rope=r, qkv_bias=qb, proj_bias=pb, qk_norm=qn)
    for g, r, (qb, pb), qn in itertools.product((8, 4), (True, False), ((False, False), (True, True)), (False,))
] + [dict(groups=4, rope=True, qkv_bias=False, proj_bias=False, qk_norm=True)]


def _all_cases(tsp_size, dtype):
    init_tsp(tsp_size)
    return [(case, _one_case(tsp_size, dtype, **case)) for case in CASES]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tsp_size", [1, 2, 4])
def test_matches_stock_self_attention(ranks, tsp_size, dtype):
    assert_within(ranks(tsp_size, _all_cases, tsp_size, dtype), dtype)


def _overlap_and_determinism(tsp_size):
    init_tsp(tsp_size)
    results = []
    for overlap in (True, False, True):
        _, tsp, solo = _build(tsp_size, torch.float32, 4, True, True, False, overlap=overlap)
        g = torch.Generator().manual_seed(1)
        x_full = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
        dy_full = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
        out, _, x = _run_tsp(tsp, x_full, dy_full, rotary_table(tsp.config, SEQ, solo.cp))
        results.append([out.detach(), x.grad] + [p.grad for p in tsp.shard_tensors()])
    return [all(torch.equal(a, b) for a, b in zip(results[0], other)) for other in results[1:]]


def test_overlap_off_and_reruns_are_bit_identical(ranks):
    for same in ranks(4, _overlap_and_determinism, 4):
        assert same == [True, True]


def _saved_and_counted(tsp_size, seq):
    init_tsp(tsp_size)
    _, tsp, solo = _build(tsp_size, torch.float32, 4, True, False, False)
    g = torch.Generator().manual_seed(1)
    x_full = torch.randn(seq, BATCH, HIDDEN, generator=g)
    table = rotary_table(tsp.config, seq, solo.cp)
    group = megatron_tsp.get_tsp_group()
    x = local_rows(x_full, group).clone().requires_grad_()
    comm.COUNTER.reset()
    with SavedBytes(tsp.parameters()) as saved:
        out, _ = tsp(x, None, rotary_pos_emb=table)
    out.backward(torch.ones_like(out))
    shard_bytes = sum(t.numel() * t.element_size() for t in tsp.shard_tensors())
    return saved.total, saved.largest_activation, shard_bytes, comm.COUNTER.as_dict()


@pytest.mark.parametrize("tsp_size", [2, 4])
def test_saved_for_backward_is_one_over_d(ranks, tsp_size):
    seq = 32
    (single, _, _, _), = ranks(1, _saved_and_counted, 1, seq)
    for total, largest, shard_bytes, _ in ranks(tsp_size, _saved_and_counted, tsp_size, seq):
        assert total <= single / tsp_size + 2 * shard_bytes
        # nothing of the full sequence times all heads (S*b*h elements) is saved
        assert largest < seq * BATCH * HIDDEN


@pytest.mark.parametrize("tsp_size", [2, 4])
def test_counted_bytes_match_design_formula(ranks, tsp_size):
    seq = 32
    expected = volumes.tsp_attention(seq=seq, batch=BATCH, hidden=HIDDEN, heads=HEADS, groups=4, head_dim=8,
                                     tsp=tsp_size, e=4, qkv_bias=True)
    for *_, counted in ranks(tsp_size, _saved_and_counted, tsp_size, seq):
        for phase, prims in expected.items():
            got = {p: v["bytes_received"] for p, v in counted[f"layer1/attention/{phase}"].items()}
            assert got == prims, (phase, got, prims)


def _bad_configs():
    from megatron_tsp.checks import check_attention_config

    messages = []
    for change in (dict(), dict(attention_dropout=0.1)):
        _, c = configs(4, num_query_groups=2, **change)
        try:
            check_attention_config(c, 4)
        except ValueError as exc:
            messages.append(str(exc))
    try:
        check_attention_config(configs(2, num_attention_heads=4, num_query_groups=4)[1], 2,
                               AttnMaskType.padding)
    except ValueError as exc:
        messages.append(str(exc))
    return messages


def test_unsupported_settings_fail_at_construction():
    messages = _bad_configs()
    assert any("--num-query-groups 2 is not divisible by --tsp-size 4" in m for m in messages)
    assert any("--attention-dropout 0" in m for m in messages)
    assert any("causal attention only" in m for m in messages)


def test_flash_op_matches_sdpa_forward_and_backward():
    from megatron_tsp.kernels import causal_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, 2, 4, 8, generator=g, requires_grad=True)
    k = torch.randn(10, 2, 2, 8, generator=g, requires_grad=True)
    v = torch.randn(10, 2, 2, 8, generator=g, requires_grad=True)
    dout = torch.randn(6, 2, 4, 8, generator=g)
    results = []
    for backend in ("sdpa", "flash_op"):
        out = causal_attention(q, k, v, 0.3, backend)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        results.append((out, *grads))
    for a, b in zip(*results):
        assert rel_err(b, a) < 1e-5
