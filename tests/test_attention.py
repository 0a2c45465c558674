"""TSPSelfAttention against stock megatron-core SelfAttention at world size 1."""

import dataclasses
import inspect
import itertools
import os

import pytest
import torch
import volumes
from conftest import ROOT
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from reference import (
    KernelCalls,
    SavedBytes,
    assert_within,
    configs,
    init_tsp,
    kernel_calls,
    local_rows,
    rel_err,
    replicated_bias_error,
    rotary_table,
    shard_of,
    solo_pg_collection,
    summed,
)

import megatron_tsp
from megatron_tsp.core.attention import TSPSelfAttention
from megatron_tsp.core.norm import TSPNorm
from megatron_tsp.measure import counts

SEQ, BATCH, HIDDEN, HEADS = 16, 2, 64, 8


def _submodules(qk_norm, norm=WrappedTorchNorm):
    norm = norm if qk_norm else IdentityOp
    return SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear, core_attention=DotProductAttention,
                                   linear_proj=RowParallelLinear, q_layernorm=norm, k_layernorm=norm)


def _build(tsp_size, dtype, groups, qkv_bias, proj_bias, qk_norm, overlap=True, kv_channels=None,
           softmax_type="vanilla", window_size=None, reference_window=True):
    """(stock reference at world 1, TSP module, solo groups), same seed and dtype. In bf16
    the TSP module runs the math backend of the attention op, whose rounding is that of the
    stock module's unfused attention: what is tested here is the TSP schedule; the flash
    kernel's own bf16 rounding is tested against float64 with the op."""
    ref_cfg, tsp_cfg = configs(tsp_size, dtype, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               num_query_groups=groups, add_bias_linear=proj_bias, add_qkv_bias=qkv_bias,
                               qk_layernorm=qk_norm, kv_channels=kv_channels, softmax_type=softmax_type,
                               window_size=window_size)
    if not reference_window:
        ref_cfg = dataclasses.replace(ref_cfg, window_size=None)
    solo = solo_pg_collection()
    torch.manual_seed(0)
    ref = SelfAttention(ref_cfg, _submodules(qk_norm), layer_number=1,
                        attn_mask_type=AttnMaskType.causal, pg_collection=solo)
    torch.manual_seed(0)
    tsp = TSPSelfAttention(tsp_cfg, _submodules(qk_norm, TSPNorm), layer_number=1, overlap_comm=overlap,
                           attention_backend="auto" if dtype == torch.float32 else "math")
    if softmax_type == "learnable":
        # the sinks' initialisation draws a per-rank shard, and the weights drawn after it then
        # differ: copy them. Sinks of either sign and some weight; the owner's heads' (megatron's TP shard).
        group = megatron_tsp.get_tsp_group()
        with torch.no_grad():
            ref.core_attention.softmax_offset.copy_(torch.linspace(-2.0, 2.0, HEADS))
            for name, dim in (("core_attention.softmax_offset", 0), ("linear_qkv.weight", 0), ("linear_qkv.bias", 0),
                              ("linear_proj.weight", 1), ("linear_proj.bias", None)):
                mine, full = tsp.get_parameter(name) if _has(tsp, name) else None, _get(ref, name)
                if mine is not None:
                    mine.copy_(full if dim is None else shard_of(full, dim, group))
    return ref, tsp, solo


def _has(module, name):
    return _get(module, name) is not None


def _get(module, name):
    owner, _, leaf = name.rpartition(".")
    return getattr(module.get_submodule(owner), leaf, None)


def _run_tsp(tsp, x_full, dy_full, rope, packed_seq_params=None):
    group = megatron_tsp.get_tsp_group()
    x = local_rows(x_full, group).clone().requires_grad_()
    out, bias = tsp(x, None, rotary_pos_emb=rope, packed_seq_params=packed_seq_params)
    out.backward(local_rows(dy_full, group))
    return out, bias, x


def _documents(starts, seq):
    """(megatron's [b, 1, S, S] mask, True where hidden, as its dataset builds it for
    --reset-attention-mask; our PackedSeqParams) of documents starting at ``starts``."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    from megatron_tsp.core.documents import document_params

    eod = 1
    tokens = torch.zeros(len(starts), seq, dtype=torch.long)
    for sample, ps in enumerate(starts):
        tokens[sample, [p - 1 for p in ps if p > 0]] = eod
    mask = torch.stack([_get_ltor_masks_and_position_ids(t, eod, False, True, False, True)[0] for t in tokens])
    return mask, document_params(tokens, eod)


def _one_case(tsp_size, dtype, groups, rope, qkv_bias, proj_bias, qk_norm, kv_channels=None, softmax_type="vanilla",
              window_size=None, seq=SEQ, documents=None, overlap=True, per_call="auto"):
    group = megatron_tsp.get_tsp_group()
    ref, tsp, solo = _build(tsp_size, dtype, groups, qkv_bias, proj_bias, qk_norm, kv_channels=kv_channels,
                            softmax_type=softmax_type, window_size=window_size,
                            reference_window=not (documents and window_size), overlap=overlap)
    tsp.head_groups_per_call = per_call
    g = torch.Generator().manual_seed(1)
    x_full = torch.randn(seq, BATCH, HIDDEN, generator=g).to(dtype)
    dy_full = torch.randn(seq, BATCH, HIDDEN, generator=g).to(dtype)
    table = rotary_table(ref.config, seq, solo.cp) if rope else None

    mask, packed = _documents(documents, seq) if documents else (None, None)
    if documents and window_size:  # megatron's local attention would drop the documents' mask for the window's
        position = torch.arange(seq)
        mask = mask | (position.view(-1, 1) - position.view(1, -1) > window_size[0])
    x_ref = x_full.clone().requires_grad_()
    out_ref, bias_ref = ref(x_ref, mask, rotary_pos_emb=table)
    out_ref.backward(dy_full)
    out, bias, x = _run_tsp(tsp, x_full, dy_full, table, packed)

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
    if softmax_type == "learnable":
        errors["dsink"] = rel_err(tsp.core_attention.softmax_offset.grad,
                                  shard_of(ref.core_attention.softmax_offset.grad, 0, group))
    if qk_norm:
        errors["dq_norm"] = rel_err(summed(tsp.q_layernorm.weight.grad, group), ref.q_layernorm.weight.grad)
        errors["dk_norm"] = rel_err(summed(tsp.k_layernorm.weight.grad, group), ref.k_layernorm.weight.grad)
    return errors


CASES = [
    dict(groups=g, rope=r, qkv_bias=qb, proj_bias=pb, qk_norm=qn)
    for g, r, (qb, pb), qn in itertools.product((8, 4), (True, False), ((False, False), (True, True)), (False,))
] + [dict(groups=4, rope=True, qkv_bias=False, proj_bias=False, qk_norm=True),
      dict(groups=4, rope=True, qkv_bias=False, proj_bias=True, qk_norm=False, kv_channels=12),  # a*d != h
      # megatron's softmax types (gpt-oss's attention sinks): a sink logit per head, learnable or 0
      dict(groups=4, rope=True, qkv_bias=False, proj_bias=False, qk_norm=False, softmax_type="learnable"),
      dict(groups=8, rope=False, qkv_bias=True, proj_bias=True, qk_norm=False, softmax_type="off-by-one"),
      # megatron's sliding window (W, 0) against its explicit mask, at 48 tokens (chunks of 12 at D=2, 6 at D=4):
      # a window inside a chunk, one that reaches three chunks back, and one with sinks
      dict(groups=4, rope=True, qkv_bias=False, proj_bias=False, qk_norm=False, window_size=(5, 0), seq=48),
      dict(groups=8, rope=True, qkv_bias=True, proj_bias=False, qk_norm=False, window_size=(13, 0), seq=48),
      dict(groups=4, rope=True, qkv_bias=False, proj_bias=False, qk_norm=False, window_size=(20, 0), seq=48,
           softmax_type="learnable"),
      # packed documents (--reset-attention-mask) against megatron's [b, 1, S, S] mask, 48 tokens: per sample, one
      # crossing chunks and ranks, one of a token, one starting at a chunk boundary (D=2: 12, D=4: 6)
      dict(groups=4, rope=True, qkv_bias=False, proj_bias=False, qk_norm=False, seq=48,
           documents=[[0, 5, 6, 20, 33], [0, 24]]),
      dict(groups=8, rope=False, qkv_bias=True, proj_bias=True, qk_norm=False, seq=48, softmax_type="learnable",
           documents=[[0, 18], [0, 18]]),
      # and a window of 7 within them (megatron's local attention drops the mask it is given for the window's,
      # so its reference gets the window in the mask: _one_case)
      dict(groups=4, rope=True, qkv_bias=False, proj_bias=False, qk_norm=False, seq=48, window_size=(7, 0),
           documents=[[0, 5, 6, 20, 33], [0, 24]])]


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


def _per_call(tsp_size):
    """PER_CALL_CASES with each divisor G > 1 of D head groups per stage, against world=1."""
    init_tsp(tsp_size)
    return [(dict(case, per_call=g), _one_case(tsp_size, torch.float32, per_call=g, **case))
            for g in range(2, tsp_size + 1) if tsp_size % g == 0 for case in PER_CALL_CASES]


PER_CALL_CASES = [
    dict(groups=4, rope=True, qkv_bias=True, proj_bias=True, qk_norm=True),
    dict(groups=8, rope=True, qkv_bias=False, proj_bias=False, qk_norm=False, overlap=False),
    dict(groups=4, rope=True, qkv_bias=False, proj_bias=False, qk_norm=False, softmax_type="learnable"),
    dict(groups=4, rope=True, qkv_bias=False, proj_bias=False, qk_norm=False, window_size=(13, 0), seq=48),
    dict(groups=4, rope=True, qkv_bias=False, proj_bias=False, qk_norm=False, seq=48,
         documents=[[0, 5, 6, 20, 33], [0, 24]]),
]


@pytest.mark.parametrize("tsp_size", [2, 4])
def test_several_head_groups_per_call_match_stock_self_attention(ranks, tsp_size):
    """Head groups side by side in one stage (one K/V gather, one kernel call per block; the
    GPU default at short S): forward, input, weight, bias, norm and sink gradients against
    world=1 megatron-core, with and without overlap, with a window and with documents."""
    assert_within(ranks(tsp_size, _per_call, tsp_size), torch.float32)


def test_head_groups_per_call_fill_the_gpu_at_short_sequences():
    from megatron_tsp.core.head_groups import head_groups_per_call

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    # the 7B at D=8: 4 query heads a head group, rows S/16, the planner's 132 SMs (its fake
    # tensors plan a GPU's kernels on either device)
    for device in (cuda, cpu):
        picked = {s: head_groups_per_call("auto", 8, 1, 4, s // 16, device, "flash", planned=True)
                  for s in (8192, 16384, 32768, 65536, 131072)}
        assert picked == {8192: 8, 16384: 8, 32768: 4, 65536: 2, 131072: 1}
    # the planned GPU's count from its hardware profile: MI300X's 304 CUs, A100's 108 SMs
    from megatron_tsp.core.head_groups import planned_multiprocessors
    from megatron_tsp.measure.perfmodel import load_hardware

    mi300x = load_hardware(os.path.join(ROOT, "configs", "hardware", "mi300x.yaml")).multiprocessors
    for sms, want in ((mi300x, {16384: 8, 32768: 8, 65536: 4, 131072: 2}),
                      (108, {16384: 4, 32768: 2, 65536: 1, 131072: 1})):
        with planned_multiprocessors(sms):
            assert {s: head_groups_per_call("auto", 8, 1, 4, s // 16, cpu, "flash", planned=True) for s in want} == want
    assert head_groups_per_call("auto", 8, 1, 4, 1024, cpu, "cpu") == 1
    assert head_groups_per_call("auto", 8, 1, 4, 1024, cpu, "math", planned=True) == 1
    assert head_groups_per_call(2, 8, 1, 4, 8192, cuda, "flash", planned=True) == 2
    assert head_groups_per_call(0, 8, 1, 4, 16384 // 16, cpu, "flash", planned=True) == 8  # a config's 0 is auto


def _saved_and_counted(tsp_size, seq):
    init_tsp(tsp_size)
    _, tsp, solo = _build(tsp_size, torch.float32, 4, True, False, False)
    g = torch.Generator().manual_seed(1)
    x_full = torch.randn(seq, BATCH, HIDDEN, generator=g)
    table = rotary_table(tsp.config, seq, solo.cp)
    group = megatron_tsp.get_tsp_group()
    x = local_rows(x_full, group).clone().requires_grad_()
    with counts.count_collectives() as records:
        with SavedBytes(tsp.parameters()) as saved:
            out, _ = tsp(x, None, rotary_pos_emb=table)
        out.backward(torch.ones_like(out))
    shard_bytes = sum(t.numel() * t.element_size() for t in tsp.shard_tensors())
    return saved.total, saved.largest_activation, shard_bytes, counts.by_phase(records)


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
        assert counted == expected


def _bad_configs():
    from megatron_tsp.core.support import check_attention_config

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


GROUPS_MUST = "--tsp-head-groups-per-call must be 0 (auto) or a divisor of the TSP size"


@pytest.mark.parametrize("size,setting,message", [
    (4, dict(lookahead=0), "--tsp-lookahead must be 1 or more with --tsp-size 4 (got 0)"),
    (4, dict(head_groups_per_call=3), f"{GROUPS_MUST} with --tsp-size 4 (got 3)"),
    (4, dict(head_groups_per_call=-2), f"{GROUPS_MUST} with --tsp-size 4 (got -2)"),
    (4, dict(head_groups_per_call="two"), f"{GROUPS_MUST} with --tsp-size 4 (got two)"),
    (4, dict(head_groups_per_call=True), f"{GROUPS_MUST} with --tsp-size 4 (got on)"),
    (1, dict(head_groups_per_call=2), f"{GROUPS_MUST} with --tsp-size 1 (got 2)"),  # the layer reads it at any size
])
def test_the_layers_own_settings_fail_at_construction(size, setting, message):
    """The support matrix's rows of TSP's own settings, as the layer checks them."""
    from megatron_tsp.core.support import check_attention_config

    with pytest.raises(ValueError) as err:
        check_attention_config(configs(size)[1], size, **setting)
    line, flag = str(err.value), message.split()[0]
    assert line.startswith(f"TSPSelfAttention: {message}: ") and f"; set {flag} " in line and "\n" not in line


def _softmax_attention(q, k, v, scale, visible):
    """Attention by autograd in float64 (the op's reference): [s, b, h, d] layout, GQA."""
    q, k, v = (t.double().permute(1, 2, 0, 3) for t in (q, k, v))
    k, v = (t.repeat_interleave(q.size(1) // t.size(1), dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).permute(2, 0, 1, 3)


@pytest.mark.parametrize("backend", ["cpu", "math"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk_ids", [[0], [0, 3], [1, 2], [2, 5]], ids=str)
def test_block_attention_matches_softmax_attention(backend, dtype, chunk_ids, window=-1, chunk=4, documents=None):
    """Query chunks at their global chunk index against all keys (``window`` >= 0: the
    ``window`` keys before each query and itself; ``documents``: each of the 2 samples'
    document starts, a query sees its own document's keys): forward and gradients."""
    from megatron_tsp.core.block_attention import block_attention

    seq = chunk * (max(chunk_ids) + 1)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(seq, 2, 2, 8, generator=g).to(dtype).requires_grad_()
    v = torch.randn(seq, 2, 2, 8, generator=g).to(dtype).requires_grad_()
    rows = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in chunk_ids])
    q = torch.randn(len(rows), 2, 4, 8, generator=g).to(dtype).requires_grad_()
    dout = torch.randn(len(rows), 2, 4, 8, generator=g).to(dtype)
    behind = rows.unsqueeze(1) - torch.arange(seq).unsqueeze(0)
    visible = (behind >= 0) & ((behind <= window) if window >= 0 else True)
    if documents is not None:  # [b, 1, sq, sk]: the key's document is the query's
        doc = torch.tensor([[sum(p <= i for p in starts) for i in range(seq)] for starts in documents])
        visible = visible & (doc[:, rows].unsqueeze(-1) == doc.unsqueeze(1)).unsqueeze(1)
    ref = _softmax_attention(q, k, v, 0.3, visible)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout.double())
    out = block_attention(q, k, v, chunk_ids, 0.3, backend, window=window, documents=documents)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    errors = {name: rel_err(a, b) for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads))}
    assert_within([[(chunk_ids, errors)]], dtype)


@pytest.mark.parametrize("backend", ["cpu", "math"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk_ids", [[0], [1, 2], [0, 3]], ids=str)
@pytest.mark.parametrize("window", [1, 3, 8, 13])  # 0: dq and dK are 0, no relative error
def test_block_attention_with_a_window_matches_the_masked_softmax(backend, dtype, chunk_ids, window):
    """megatron's window_size (w, 0): windows inside a chunk of 8, one that reaches one and
    two chunks back; pieces of the chunk (a mask per block) on these kernels."""
    test_block_attention_matches_softmax_attention(backend, dtype, chunk_ids, window, chunk=8)


@pytest.mark.parametrize("backend", ["cpu", "math"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk_ids", [[0], [1, 2], [0, 3]], ids=str)
@pytest.mark.parametrize("documents", [[[0, 3, 4, 13, 14, 22], [0, 16]], [[0, 9, 20]] * 2],
                         ids=["per-sample", "shared"])
@pytest.mark.parametrize("window", [-1, 5])
def test_block_attention_within_documents_matches_the_masked_softmax(backend, dtype, chunk_ids, documents, window):
    """Packed documents of 32 tokens in chunks of 8: one longer than a chunk, one of a token,
    one starting at a chunk boundary; samples with their own documents, or the same; and a
    window of 5 keys within them (bands that are not square)."""
    test_block_attention_matches_softmax_attention(backend, dtype, chunk_ids, window, chunk=8, documents=documents)


def _kernel_calls(tsp_size, per_call):
    init_tsp(tsp_size)
    _, tsp, solo = _build(tsp_size, torch.float32, 4, False, False, False)
    tsp.head_groups_per_call = per_call
    g = torch.Generator().manual_seed(1)
    x_full = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    x = local_rows(x_full, megatron_tsp.get_tsp_group()).clone().requires_grad_()
    with KernelCalls() as forward:
        out, _ = tsp(x, None, rotary_pos_emb=rotary_table(tsp.config, SEQ, solo.cp))
    with KernelCalls() as backward:
        out.backward(torch.ones_like(out))
    return forward.calls, backward.calls


@pytest.mark.parametrize("tsp_size,per_call", [(1, 1), (2, 1), (4, 1), (4, 2), (4, 4)])
def test_tsp_backward_runs_no_attention_forward(ranks, tsp_size, per_call):
    # per head group, in the zigzag layout with a top-left kernel (aten's CPU flash): forward,
    # rank p's chunk 2D-1-p a causal and a full block, chunk p a causal block and, but on
    # rank 0, a full block before it; in the first and last stage of several cut at the
    # edges of the rank's own key chunks, which run first (zigzag_own_keys_first). Backward
    # (zigzag_backward_blocks): chunk 2D-1-p's causal block, its full blocks before slot D
    # (but on rank D-1) and from slot D+p (on rank 0 one full block), both chunks' full block
    # over slots D..D+p-1 (but on rank 0), and chunk p's causal block; the last stage of
    # several cut at the edges of the rank's own key chunks, which run last
    # (zigzag_own_keys_last). At D=1 the sequence is one causal block. With several head
    # groups per call, each stage of them makes the calls of one.
    from megatron_tsp.core.block_geometry import zigzag_blocks, zigzag_own_keys_first, zigzag_own_keys_last

    d, stages = tsp_size, tsp_size // per_call
    for rank, (forward, backward) in enumerate(ranks(tsp_size, _kernel_calls, tsp_size, per_call)):
        by_chunk = [[b for b in zigzag_blocks(d, rank, 1) if b[0] == q0] for q0 in (0, 1)]
        assert sum(map(len, by_chunk)) == 3 + (rank != 0)
        cut = sum(len(mine) + len(others) for mine, others in zigzag_own_keys_first(d, rank, 1, by_chunk))
        uncut = 3 + (rank != 0)
        forward_blocks = (1 if d == 1 else uncut if stages == 1
                          else 2 * cut + (stages - 2) * uncut)
        uncut = 3 if rank == 0 else 4 + (rank + 1 < d)
        backward_blocks = (1 if d == 1 else uncut if stages == 1
                           else (stages - 1) * uncut + len(zigzag_own_keys_last(d, rank, 1)[0]))
        assert forward == {"forward": forward_blocks, "backward": 0}
        assert backward == {"forward": 0, "backward": backward_blocks}


def test_gpu_backend_self_check_accepts_a_right_kernel_and_stops_a_wrong_one(monkeypatch):
    from megatron_tsp.core import attention_kernels as kernels

    class Transposed(kernels._CPU):  # a convention mistake: keys read as values
        @staticmethod
        def forward(q, k, v, causal, scale, left=-1):
            return kernels._CPU.forward(q, v, k, causal, scale, left)

    class Unknown(kernels._Math):  # a bottom-right kernel whose alignment is not declared
        bottom_right = None

    monkeypatch.setattr(kernels, "_CHECKED", {})
    cpu = torch.device("cpu")
    monkeypatch.setitem(kernels._KERNELS, "efficient", kernels._CPU)
    kernels.check_backend("efficient", cpu, torch.float32)
    assert kernels.bottom_right("efficient", cpu, torch.float32) is False  # aten's CPU kernel: top-left
    monkeypatch.setitem(kernels._KERNELS, "cudnn", Unknown)
    kernels.check_backend("cudnn", cpu, torch.float32)
    assert kernels.bottom_right("cudnn", cpu, torch.float32) is True  # learned by the check
    monkeypatch.setitem(kernels._KERNELS, "flash", Transposed)
    with pytest.raises(RuntimeError, match="attention backend 'flash' gives a wrong out on cpu"):
        kernels.check_backend("flash", cpu, torch.float32)


def test_the_self_check_sets_aside_a_varlen_form_with_another_lse_layout(flash_attn_on_cpu, monkeypatch):
    """A varlen kernel whose lse is [total, h] (not flash-attn's [h, total]) fails the check:
    one warning, and packed documents run as blocks, exact, on that kernel."""
    from megatron_tsp.core import attention_kernels as kernels

    class OtherLayout(kernels._FlashAttn):
        @classmethod
        def forward_varlen(cls, q, k, v, cu, longest, scale):
            out, lse = kernels._FlashAttn.forward_varlen(q, k, v, cu, longest, scale)
            return out, lse.t().contiguous().view(lse.shape)

    monkeypatch.setattr(kernels, "_CHECKED", {})
    monkeypatch.setattr(kernels, "_VARLEN_BROKEN", set())
    cpu = torch.device("cpu")
    kernels.check_backend("flash_attn", cpu, torch.bfloat16)  # the right one passes
    assert not kernels._VARLEN_BROKEN
    monkeypatch.setattr(kernels, "_CHECKED", {})
    monkeypatch.setitem(kernels._KERNELS, "flash_attn", OtherLayout)
    with pytest.warns(UserWarning, match="attention backend 'flash_attn' gives a wrong lse in its varlen form"):
        kernels.check_backend("flash_attn", cpu, torch.bfloat16)
    assert kernels._VARLEN_BROKEN == {(OtherLayout, "cpu", torch.bfloat16, 64)}
    test_block_attention_matches_softmax_attention("flash_attn", torch.bfloat16, [1, 2], chunk=8,
                                                   documents=[[0, 3, 4, 13, 14, 22], [0, 16]])


def test_a_kernel_that_refuses_non_square_causal_blocks_gets_square_ones(monkeypatch):
    """torch-ROCm's flash kernel (AOTriton): 'For backwards kernel seqlen_q must equal seqlen_k
    for causal kernels'. The alignment probe must not stop there: such a kernel gets a square
    causal block and a full one per chunk, and the result is exact."""
    from megatron_tsp.core import attention_kernels as kernels
    from megatron_tsp.core.block_attention import block_attention

    class AOTriton(kernels._Math):
        bottom_right = None

        @staticmethod
        def backward(dout, q, k, v, out, lse, causal, scale, left=-1):
            if causal and q.size(2) != k.size(2):
                raise RuntimeError("For backwards kernel seqlen_q must equal seqlen_k for causal kernels")
            return kernels._Math.backward(dout, q, k, v, out, lse, causal, scale, left)

    monkeypatch.setattr(kernels, "_CHECKED", {})
    monkeypatch.setitem(kernels._KERNELS, "flash", AOTriton)
    monkeypatch.setattr(kernels, "GPU_BACKENDS", ("cudnn", "efficient"))  # 'flash' takes CPU tensors here
    monkeypatch.setattr(kernels, "HALF_ONLY", ())
    cpu = torch.device("cpu")
    kernels.check_backend("flash", cpu, torch.float32)
    assert kernels.bottom_right("flash", cpu, torch.float32) is False
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(2 * 16, 2, 4, 8, generator=g) for _ in range(2))
    k, v = (torch.randn(4 * 16, 2, 2, 8, generator=g) for _ in range(2))
    grads = {}
    for backend in ("flash", "math"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = block_attention(*leaves, [1, 2], 8 ** -0.5, backend)
        grads[backend] = (out, *torch.autograd.grad(out, leaves, dout))
    for got, want in zip(grads["flash"], grads["math"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_window_layer_takes_a_kernel_with_a_window():
    """cuDNN's and the memory-efficient kernel have no sliding window: auto takes flash (fp32:
    math) for a window layer at any length, and naming them is one line."""
    from megatron_tsp.core.attention_kernels import resolve_backend

    cpu = torch.device("cpu")
    assert resolve_backend("gpu", cpu, torch.bfloat16, planned=True, keys=1 << 17) == "cudnn"
    assert resolve_backend("gpu", cpu, torch.bfloat16, planned=True, keys=1 << 17, windowed=True) == "flash"
    assert resolve_backend("gpu", cpu, torch.float32, planned=True, windowed=True) == "math"
    for name in ("cudnn", "efficient"):
        with pytest.raises(ValueError, match=f"attention backend '{name}' has no sliding window"):
            resolve_backend(name, cpu, torch.bfloat16, planned=True, windowed=True)


def test_auto_takes_cudnn_for_long_sequences_where_it_runs(monkeypatch):
    """On an H200, cuDNN's attention ran the 7B's 128K step 1.6x faster than flash in every mode,
    flash is faster at 8K: auto picks by the number of keys, the same in every mode."""
    from megatron_tsp.core import attention_kernels as kernels

    cpu, cuda, bf16 = torch.device("cpu"), torch.device("cuda"), torch.bfloat16
    long, short = kernels.AUTO_CUDNN_FROM_KEYS, kernels.AUTO_CUDNN_FROM_KEYS - 1
    assert kernels.resolve_backend("gpu", cpu, bf16, planned=True, keys=long) == "cudnn"  # the planner
    assert kernels.resolve_backend("gpu", cpu, bf16, planned=True, keys=short) == "flash"
    assert kernels.resolve_backend("gpu", cpu, bf16, planned=True) == "flash"
    assert kernels.resolve_backend("gpu", cpu, torch.float32, planned=True, keys=long) == "efficient"
    assert kernels.resolve_backend("auto", cpu, bf16, keys=long) == "cpu"
    monkeypatch.setattr(torch.version, "hip", "6.4", raising=False)  # ROCm: torch has no cuDNN attention
    assert kernels.resolve_backend("gpu", cpu, bf16, planned=True, keys=long) == "flash"
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    # a real GPU where cuDNN's attention does not run (an older GPU or cuDNN): flash, once decided
    monkeypatch.setattr(kernels, "_CUDNN_RUNS", {})
    tried = []

    def refuses(backend, device, dtype, windowed=False, head_dim=64):
        tried.append((backend, head_dim))
        raise RuntimeError("No available kernel. Aborting execution.")

    monkeypatch.setattr(kernels, "check_backend", refuses)
    assert kernels.resolve_backend("auto", cuda, bf16, keys=long) == "flash"
    assert kernels.resolve_backend("auto", cuda, bf16, keys=long) == "flash"
    assert tried == [("cudnn", 64)]
    monkeypatch.setattr(kernels, "_CUDNN_RUNS", {})
    monkeypatch.setattr(kernels, "check_backend", lambda *args, **kwargs: None)
    assert kernels.resolve_backend("auto", cuda, bf16, keys=long) == "cudnn"


def test_cudnn_is_checked_at_the_models_head_dim_and_dtype(monkeypatch):
    """A cuDNN that takes head dim 64 may refuse 256, or fp16, in the middle of a step: auto's
    check runs at the model's head dim and dtype, is remembered by them, and where cuDNN
    refuses auto takes flash. Packed documents take flash's varlen form at any length (cuDNN
    has none here: a call per document piece, a cuDNN graph per new shape)."""
    from megatron_tsp.core import attention_kernels as kernels

    cpu, cuda, bf16, fp16 = torch.device("cpu"), torch.device("cuda"), torch.bfloat16, torch.float16
    long = kernels.AUTO_CUDNN_FROM_KEYS
    monkeypatch.setattr(kernels, "_CUDNN_RUNS", {})
    tried = []

    def up_to_128_in_bf16(backend, device, dtype, windowed=False, head_dim=64):
        tried.append((dtype, head_dim))
        if head_dim > 128 or dtype != bf16:
            raise RuntimeError("cuDNN Frontend error: No valid execution plans built.")

    monkeypatch.setattr(kernels, "check_backend", up_to_128_in_bf16)
    for _ in range(2):
        assert kernels.resolve_backend("auto", cuda, bf16, keys=long, head_dim=128) == "cudnn"
        assert kernels.resolve_backend("auto", cuda, bf16, keys=long, head_dim=256) == "flash"
        assert kernels.resolve_backend("auto", cuda, fp16, keys=long, head_dim=128) == "flash"
    assert tried == [(bf16, 128), (bf16, 256), (fp16, 128)]  # each once
    assert kernels.resolve_backend("auto", cuda, bf16, keys=long, head_dim=128, documents=True) == "flash"
    assert kernels.resolve_backend("gpu", cpu, bf16, planned=True, keys=long, documents=True) == "flash"


def test_a_kernels_alignment_is_learned_before_its_first_blocks(monkeypatch):
    """Whether a kernel aligns a causal mask bottom-right is learned by its first check; the
    blocks were chosen before it ran, so step 1 ran a full and a causal block per chunk and
    later steps one (with full recompute, step 1's recomputed forward differed from its own
    forward). The first call's blocks are now those of every later call."""
    from megatron_tsp.core import attention_kernels as kernels
    from megatron_tsp.core import block_geometry as geometry
    from megatron_tsp.core.block_attention import block_attention

    class Unknown(kernels._Math):  # a bottom-right kernel whose alignment is not declared
        bottom_right = None

    monkeypatch.setattr(kernels, "_CHECKED", {})
    monkeypatch.setitem(kernels._KERNELS, "cudnn", Unknown)
    monkeypatch.setattr(kernels, "GPU_BACKENDS", ("flash", "efficient", "flash_attn"))  # 'cudnn' on CPU tensors
    monkeypatch.setattr(kernels, "HALF_ONLY", ())
    asked = []
    blocks = geometry.blocks
    monkeypatch.setattr(geometry, "blocks", lambda chunk_ids, chunk, aligned, *rest: asked.append(aligned) or
                        blocks(chunk_ids, chunk, aligned, *rest))
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(16, 2, 4, 8, generator=g), torch.randn(24, 2, 2, 8, generator=g), torch.randn(
        24, 2, 2, 8, generator=g)
    for _ in range(2):
        block_attention(q, k, v, [1, 2], 0.3, "cudnn")
    assert asked == [True, True]


@pytest.fixture
def flash_attn_on_cpu(monkeypatch):
    """flash-attn 2.8's entry points (tests/standins) as a backend on CPU tensors."""
    from megatron_tsp.core import attention_kernels as kernels

    monkeypatch.syspath_prepend(os.path.join(ROOT, "tests", "standins"))
    monkeypatch.setattr(kernels, "GPU_BACKENDS", ("flash", "cudnn", "efficient"))
    kernels._FlashAttn._functions.cache_clear()
    yield
    kernels._FlashAttn._functions.cache_clear()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_flash_attn_backend_with_the_packages_signatures(flash_attn_on_cpu, dtype):
    """flash-attn >= 2.6 hides its signature behind torch.library.custom_op: the backend
    reads the undecorated function's (2.8 needs softcap), and calls one bottom-right causal
    block per query chunk (no merge). fp32 is refused in a line, as the package refuses it."""
    from flash_attn.flash_attn_interface import _flash_attn_forward

    from megatron_tsp.core import attention_kernels as kernels
    from megatron_tsp.core.block_geometry import blocks

    with pytest.raises(ValueError, match="attention backend 'flash_attn' takes fp16/bf16 only"):
        kernels.resolve_backend("flash_attn", torch.device("cpu"), torch.float32, planned=True)

    assert "softcap" not in str(inspect.signature(_flash_attn_forward))  # the trap
    for chunk_ids in ([0], [1, 2], [2, 5]):
        test_block_attention_matches_softmax_attention("flash_attn", dtype, chunk_ids)
    for window in (3, 13):  # the package's own window_size, on whole chunks
        test_block_attention_matches_softmax_attention("flash_attn", dtype, [1, 2], window, chunk=8)
    for window in (-1, 5):
        test_block_attention_matches_softmax_attention("flash_attn", dtype, [1, 2], window, chunk=8,
                                                       documents=[[0, 3, 4, 13, 14, 22], [0, 16]])
    assert blocks([1, 2], 4, kernels.bottom_right("flash_attn", torch.device("cpu"), dtype)) == \
        [(0, 4, 0, 8, True), (4, 8, 0, 12, True)]


@pytest.mark.parametrize("documents", [[[0, 3, 4, 13, 14, 22], [0, 16]], [[0, 2, 5, 9, 20, 21]] * 2],
                         ids=["per-sample", "shared"])
def test_a_chunks_documents_are_one_varlen_call(flash_attn_on_cpu, documents):
    """Where the kernel has a varlen form (flash-attn's ``cu_seqlens``), the square causal
    blocks of a query chunk's document pieces, one after another in queries and keys, are one
    call forward and one backward, per sample or for the micro-batch (the samples one after
    another); a piece's blocks against its document's earlier chunks stay blocks. Exact against
    the masked softmax, and the calls counted."""
    from megatron_tsp.core import attention_kernels as kernels
    from megatron_tsp.core.block_geometry import blocks

    kernels.check_backend("flash_attn", torch.device("cpu"), torch.bfloat16, windowed=True)  # its calls, not counted
    chunk_ids = [1, 2]
    with KernelCalls("flash_attn", ("forward", "forward_varlen", "backward", "backward_varlen")) as counted:
        for window in (-1, 5):
            test_block_attention_matches_softmax_attention("flash_attn", torch.bfloat16, chunk_ids, window, chunk=8,
                                                           documents=documents)
    runs, other, without = 0, 0, 0
    for window in (-1, 5):
        plan = blocks(chunk_ids, 8, True, window, "flash_attn", documents)
        found, rest = kernel_calls(plan, varlen=True)
        runs, other, without = runs + found, other + rest, without + kernel_calls(plan, varlen=False)[1]
    assert 0 < runs and runs + other < without
    assert counted.calls == {"forward": other, "forward_varlen": runs, "backward": other, "backward_varlen": runs}


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("documents", [[[0, 5, 9, 20, 21, 26, 47, 50]],
                                       [[0, 3, 4, 13, 14, 22, 27, 40, 57], [0, 16, 30]],
                                       [[0, 2, 5, 9, 20, 21, 26, 44]] * 2], ids=["batch-1", "per-sample", "shared"])
def test_tsp_zigzag_document_blocks_as_varlen_calls(flash_attn_on_cpu, size, documents):
    """TSP's blocks of packed documents in the zigzag layout (every rank; the backward in the
    schedule's two calls) at micro-batch 1 and 2, bf16: flash-attn's varlen form (whose
    backward reads the lse by pointer as a contiguous ``[h, total_q]``) computes what the
    math kernel computes block by block, gradients written into the fp32 dK/dV buffer. A
    rank's two chunks are separate runs, so at micro-batch 1 the lse rows of one are a
    strided view: handed to the kernel as they were, dq, dK and dV were wrong."""
    from megatron_tsp.core.block_attention import attend_backward_into, attend_into
    from megatron_tsp.core.block_geometry import zigzag_document_blocks

    chunk, batch = 8, len(documents)
    documents = [[p for p in starts if p < 2 * size * chunk] for starts in documents]
    g = torch.Generator().manual_seed(0)
    for rank in range(size):
        forward, (backward, split) = zigzag_document_blocks(size, rank, chunk, documents)
        assert kernel_calls(forward, varlen=True)[0] > 0
        q, dout = (torch.randn(2 * chunk, batch, 4, 8, generator=g).bfloat16() for _ in range(2))
        k, v = (torch.randn(2 * size * chunk, batch, 2, 8, generator=g).bfloat16() for _ in range(2))
        results = []
        for backend in ("math", "flash_attn"):
            out = torch.zeros_like(q)
            lse = attend_into(q, k, v, forward, 0.3, backend, out)
            dq = torch.empty_like(q)
            dk, dv = (torch.empty_like(t, dtype=torch.float32) for t in (k, v))
            for first, last in ((0, split), (split, len(backward))):
                if first < last:
                    attend_backward_into(dout, q, k, v, out, lse, backward, 0.3, backend, dq, dk, dv, first, last,
                                         zero_untouched=first == 0)
            results.append((out, lse, dq, dk, dv))
        errors = {name: rel_err(a, b) for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results)}
        assert_within([[(rank, errors)]], torch.bfloat16)


def test_backward_in_calls_writes_what_one_call_writes():
    """attend_backward_into over blocks[first:last] after blocks[:first] (TSP's backward posts
    part of dK/dV between two calls): dq, dK, dV as one call over every block writes them,
    also where a later block's query rows only partly overlap an earlier one's (a copy there
    erased the earlier call's dq), and as the forward's own blocks give them."""
    from megatron_tsp.core.block_attention import attend_backward_into, attend_into

    g = torch.Generator().manual_seed(0)
    q, k, v, d_out = (torch.randn(8, 1, 2, 4, generator=g) for _ in range(4))
    forward_blocks = [(0, 4, 4, 8, False), (4, 8, 0, 4, False), (4, 8, 4, 8, False)]
    out = torch.empty_like(q)
    lse = attend_into(q, k, v, forward_blocks, 0.5, "math", out)

    def grads(blocks, calls):
        dq, dk, dv = torch.empty_like(q), torch.empty(8, 1, 2, 4), torch.empty(8, 1, 2, 4)
        for first, last in calls:
            attend_backward_into(d_out, q, k, v, out, lse, blocks, 0.5, "math", dq, dk, dv, first, last,
                                 zero_untouched=first == 0)
        return dq, dk, dv

    by_keys = [(4, 8, 0, 4, False), (0, 8, 4, 8, False)]  # the second's rows 4..8 were written by the first
    whole = grads(by_keys, [(0, 2)])
    for got, want in zip(grads(by_keys, [(0, 1), (1, 2)]), whole, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for got, want in zip(grads(forward_blocks, [(0, 3)]), whole, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_fused_ops_compiled_equal_eager():
    """The lse merge and RoPE (forward and backward) as a GPU runs them (torch.compile: one
    kernel each) give the eager functions' numbers, which the CPU and the planner run: to 1e-6
    in fp32, to bf16's rounding in bf16."""
    import shutil

    from megatron_tsp.core.block_attention import merge_by_lse
    from megatron_tsp.core.fusion import compiled_on_first_call
    from megatron_tsp.core.rope import rotate, rotate_back

    if shutil.which("c++") is None:
        pytest.skip("torch.compile on a CPU needs a C++ compiler")
    merge = compiled_on_first_call(merge_by_lse)
    generator = torch.Generator().manual_seed(0)
    for blocks, dtype in ((2, torch.float32), (3, torch.float32), (2, torch.bfloat16)):
        outs = [torch.randn(2, 4, 24, 16, generator=generator).to(dtype) for _ in range(blocks)]
        lses = [4 * torch.randn(2, 4, 24, generator=generator) for _ in range(blocks)]
        # into views of bigger buffers, as the op writes a query chunk's rows of O and lse
        out_buffer, ref_buffer = (torch.zeros(2, 4, 40, 16, dtype=dtype) for _ in range(2))
        lse_buffer, ref_lse_buffer = torch.zeros(2, 4, 40), torch.zeros(2, 4, 40)
        merge(outs, lses, out_buffer[:, :, 8:32], lse_buffer[:, :, 8:32])
        merge_by_lse(outs, lses, ref_buffer[:, :, 8:32], ref_lse_buffer[:, :, 8:32])
        out, ref, lse, ref_lse = out_buffer[:, :, 8:32], ref_buffer[:, :, 8:32], lse_buffer, ref_lse_buffer
        assert out_buffer[:, :, :8].eq(0).all() and out_buffer[:, :, 32:].eq(0).all()
        torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-6)
        tolerance = 1e-6 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(out.float(), ref.float(), rtol=tolerance, atol=tolerance)
    t, grad = (torch.randn(12, 2, 4, 16, generator=generator) for _ in range(2))
    angles = torch.randn(12, 1, 1, 16, generator=generator)
    for fn, x in ((rotate, t), (rotate_back, grad)):
        torch.testing.assert_close(compiled_on_first_call(fn)(x, angles.cos(), angles.sin()),
                                   fn(x, angles.cos(), angles.sin()), rtol=1e-6, atol=1e-6)
