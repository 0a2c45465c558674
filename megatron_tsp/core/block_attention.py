"""The attention op: blocks merged by log-sum-exp, forward and backward (docs/design.md s. 5).

One op serves TSP and every baseline, so that a comparison is of parallelism, not of
kernels: attention over a list of *blocks* (query rows, key rows, causal or not:
:mod:`megatron_tsp.core.block_geometry`), each one kernel call
(:mod:`megatron_tsp.core.attention_kernels`), merged per query rows by log-sum-exp.
``block_attention(q, k, v, chunk_ids, scale, backend)`` (the baselines): ``q`` holds ``n``
equal query chunks of length ``c``; chunk ``i`` sits at global chunk ``g = chunk_ids[i]`` of
the keys ``k``, ``v`` (global order), and sees keys ``[0, (g+1)·c)`` causally
(:func:`~megatron_tsp.core.block_geometry.blocks`). TSP gathers its keys in another order and
attends through :func:`attend_into` with
:func:`~megatron_tsp.core.block_geometry.zigzag_blocks`. Each block returns its output
``o_j`` and log-sum-exp ``l_j``, merged exactly as

    lse = log(sum_j exp(l_j)),      out = sum_j exp(l_j - lse) · o_j

(per block ``exp(l_j - lse)`` in fp32, and the weighted outputs summed in fp32, the last
product written rounded once into ``out``).

Plain causal attention of a whole sequence is ``chunk_ids = [0]``; a zigzag rank r of D holds
``chunk_ids = [r, 2D-1-r]``. The op saves ``(q, k, v, out, lse)``; its backward calls each
block's kernel backward with the *merged* ``out`` and ``lse`` (then every block's softmax is
already the global one: ``P_j = exp(S_j - lse)``) and sums dQ over the blocks of each query
row and dK, dV over the blocks of each key row in fp32, dK and dV into a buffer the caller
may give (TSP's reduce-scatter buffer, with blocks of its own:
:func:`~megatron_tsp.core.block_geometry.zigzag_backward_blocks`, in calls that each run some
of them): the forward never runs again. No ``sq x sk`` tensor exists outside a kernel. Under
FakeTensorMode (the memory planner, the fake-CUDA tests) the op runs the same kernel calls
through their meta functions, so a wrong argument or shape fails there as on a GPU.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils.flop_counter import register_flop_formula

# Names of these two are looked up on the module at each call, not imported, so that a patch
# of one (a test's kernel, its checked backends, its block lists) is what the op calls.
from megatron_tsp.core import attention_kernels as kernels
from megatron_tsp.core import block_geometry as geometry
from megatron_tsp.core.fusion import compiled_on_first_call


def _by_sample(calls: Sequence[geometry.Call]) -> Dict[int, List[int]]:
    """Indices of the calls of each sample (-1: of every sample), in order."""
    out: Dict[int, List[int]] = {}
    for i, c in enumerate(calls):
        out.setdefault(c.sample, []).append(i)
    return out


def _of(t: torch.Tensor, sample: int) -> torch.Tensor:
    """``t`` ``[b, ...]``, or its one sample (a view)."""
    return t if sample < 0 else t[sample:sample + 1]


def _by_query(blocks_: Sequence[geometry.Call]) -> Dict[Tuple[int, int], List[geometry.Call]]:
    """Blocks grouped by the query rows they merge over: a window's band that covers only
    the first rows of a piece (:func:`~megatron_tsp.core.block_geometry.document_blocks`) joins
    the block of the whole piece."""
    rows: Dict[Tuple[int, int], List[geometry.Call]] = {}
    for b in sorted(blocks_, key=lambda b: b[0] - b[1]):  # widest first, stable
        whole = next((r for r in rows if r[0] <= b[0] and b[1] <= r[1]), (b[0], b[1]))
        rows.setdefault(whole, []).append(b)
    return rows


def _forward_into(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks_flat: List[int], scale: float,
                  backend: str, out: torch.Tensor, before: Optional[torch.Tensor] = None,
                  before_lse: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of ``q`` ``[b, h, sq, d]`` against ``k``, ``v`` over the blocks, written into
    ``out`` (any strides); returns the log-sum-exp ``[b, h, sq]`` (fp32). Blocks of the same
    query rows are merged by their lse, out = sum_j exp(l_j - lse) o_j, summed in fp32 and
    rounded once as it is written into ``out`` (a block of fewer rows adds to its rows).
    ``before``, ``before_lse``: these queries' attention over other keys (``[b, h, sq, d]``,
    fp32, and its lse), merged in as one more block of each row group the blocks form (the
    caller's blocks cover every row: :func:`attend_into`)."""
    calls = geometry.unflatten(blocks_flat)
    kernel = kernels.checked_kernel(backend, q, any(c.left >= 0 for c in calls))
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    for sample, indices in _by_sample(calls).items():
        prior = None if before is None else (_of(before, sample), _of(before_lse, sample))
        _merge_into(kernel, *(_of(t, sample) for t in (q, k, v, out, lse)), [calls[i] for i in indices], scale,
                    prior)
    return lse


def _merge_into(kernel, q, k, v, out, lse, calls: List[geometry.Call], scale: float, before=None) -> None:
    varlen = kernels.varlen_forward(kernel, q, k, v, calls, scale)
    for (q0, q1), row_blocks in _by_query(calls).items():
        results = [(c.q0 - q0, c.q1 - q0, *(varlen.get(c) or kernel.forward(
                        q[:, :, c.q0:c.q1], k[:, :, c.k0:c.k1], v[:, :, c.k0:c.k1], c.causal, scale, c.left)))
                   for c in row_blocks]
        if before is not None:  # the first term: fp32 already, the accumulator starts from it
            results.insert(0, (0, q1 - q0, before[0][:, :, q0:q1], before[1][:, :, q0:q1]))
        if len(results) == 1:
            out[:, :, q0:q1].copy_(results[0][2])
            lse[:, :, q0:q1].copy_(results[0][3])
            continue
        if all((a, b) == (0, q1 - q0) for a, b, _, _ in results):
            torch.ops.megatron_tsp.merge_blocks([r[2] for r in results], [r[3] for r in results], out[:, :, q0:q1],
                                                lse[:, :, q0:q1])
            continue
        merged = results[0][3].clone()  # a band of some rows merges into the whole piece's rows
        for a, b, _, o_lse in results[1:]:
            merged[:, :, a:b] = torch.logaddexp(merged[:, :, a:b], o_lse)
        acc = None
        for a, b, o, o_lse in results:
            weight = torch.exp(o_lse - merged[:, :, a:b]).unsqueeze(-1)
            if acc is None:
                acc = o * weight  # fp32: the weight is; the first block covers every row
            else:
                acc[:, :, a:b].addcmul_(o, weight)
        out[:, :, q0:q1].copy_(acc)
        lse[:, :, q0:q1].copy_(merged)


def merge_by_lse(outs: List[torch.Tensor], lses: List[torch.Tensor], out: torch.Tensor, lse: torch.Tensor) -> None:
    """Blocks of the same query rows merged by their log-sum-exps into ``out`` and ``lse``
    (views of the op's buffers, any strides): lse = log(sum_j exp(l_j)), out = sum_j exp(l_j -
    lse) o_j summed in fp32 and rounded once as it is written. One kernel on a GPU
    (:mod:`~megatron_tsp.core.fusion`), its stores included, where eager torch launches about
    four a block and two copies; the CPU and the planner run it eagerly, with the same numbers."""
    merged = lses[0]
    for block_lse in lses[1:]:
        merged = torch.logaddexp(merged, block_lse)
    acc = outs[0] * torch.exp(lses[0] - merged).unsqueeze(-1)
    for o, block_lse in zip(outs[1:], lses[1:]):
        acc = torch.addcmul(acc, o, torch.exp(block_lse - merged).unsqueeze(-1))
    out.copy_(acc)
    lse.copy_(merged)


def _forward_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks_flat: List[int], scale: float,
                  backend: str) -> Tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty_like(q)
    return out, _forward_into(q, k, v, blocks_flat, scale, backend, out)


def _backward_into(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, blocks_flat: List[int], first: int, last: int, scale: float, backend: str,
                   dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, zero_untouched: bool) -> None:
    """The kernel backward of ``blocks[first:last]`` with the merged ``out`` and ``lse``;
    ``blocks[:first]`` ran into the same buffers in an earlier call (a schedule that sends
    part of dK/dV while the rest is computed). Each gradient is copied where no block wrote
    before and added where one did: dq (q's dtype) by query rows, dK and dV (the caller's
    fp32 buffers, any strides) by key rows. Query rows with two terms in this call are
    summed by one add, rounded once; with more, in fp32, rounded once. ``zero_untouched``:
    zero the key rows that no block of the whole list touches."""
    every = geometry.unflatten(blocks_flat)
    kernel = kernels.checked_kernel(backend, q, any(c.left >= 0 for c in every))
    for sample, indices in _by_sample(every).items():
        views = [_of(t, sample) for t in (dout, q, k, v, out, lse, dq, dk, dv)]
        _backward_of(kernel, *views, [every[i] for i in indices if i < first],
                     [every[i] for i in indices if first <= i < last], [every[i] for i in indices], scale,
                     zero_untouched)


def _backward_of(kernel, dout, q, k, v, out, lse, dq, dk, dv, earlier: List[geometry.Call],
                 now: List[geometry.Call], every: List[geometry.Call], scale: float, zero_untouched: bool) -> None:
    """:func:`_backward_into` of one sample's blocks (or of blocks of every sample)."""
    keys_written = [(c.k0, c.k1) for c in earlier]
    rows_written = [(c.q0, c.q1) for c in earlier]
    runs = {run[0]: run for run in kernels.varlen_runs(kernel, now, q)}  # a run: one call over its rows and keys
    in_runs = {c for run in runs.values() for c in run}
    dq_parts = []
    for c in now:
        if c in runs:
            q0, q1, k0, k1 = kernels.run_span(runs[c])
            g = kernels.varlen_backward(kernel, dout, q, k, v, out, lse, runs[c], scale)
        elif c in in_runs:
            continue
        else:
            q0, q1, k0, k1 = c.q0, c.q1, c.k0, c.k1
            g = kernel.backward(dout[:, :, q0:q1], q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1],
                                out[:, :, q0:q1], lse[:, :, q0:q1].contiguous(), c.causal, scale, c.left)
        dq_parts.append((q0, q1, g[0]))
        for a, b, add in _cover(keys_written, k0, k1):
            for buf, grad in ((dk, g[1]), (dv, g[2])):
                if add:
                    buf[:, :, a:b].add_(grad[:, :, a - k0:b - k0])
                else:
                    buf[:, :, a:b].copy_(grad[:, :, a - k0:b - k0])
    lo, hi = min((q0 for q0, _, _ in dq_parts), default=0), max((q1 for _, q1, _ in dq_parts), default=0)
    cuts = sorted({lo, hi, *(x for q0, q1, _ in dq_parts for x in (q0, q1)),
                   *(x for a, b in rows_written for x in (a, b) if lo < x < hi)})
    for a, b in zip(cuts, cuts[1:]):
        terms = [g[:, :, a - q0:b - q0] for q0, q1, g in dq_parts if q0 <= a and b <= q1]
        if not terms:
            continue
        total = terms[0] if len(terms) == 1 else torch.add(*terms) if len(terms) == 2 else _fp32_sum(terms)
        if any(ta <= a and b <= tb for ta, tb in rows_written):
            dq[:, :, a:b].add_(total)
        else:
            dq[:, :, a:b].copy_(total)
    for a, b in _gaps([(c.k0, c.k1) for c in every], dk.size(2)) if zero_untouched else ():
        dk[:, :, a:b].zero_()
        dv[:, :, a:b].zero_()


def _fp32_sum(terms: List[torch.Tensor]) -> torch.Tensor:
    total = terms[0].float()
    for t in terms[1:]:
        total.add_(t)
    return total


def _cover(touched: List[Tuple[int, int]], k0: int, k1: int) -> List[Tuple[int, int, bool]]:
    """Split key rows [k0, k1) into pieces already written (add) or not (copy); record them."""
    cuts = sorted({k0, k1, *(x for a, b in touched for x in (a, b) if k0 < x < k1)})
    pieces = [(a, b, any(ta <= a and b <= tb for ta, tb in touched)) for a, b in zip(cuts, cuts[1:])]
    touched.append((k0, k1))
    return pieces


def _gaps(touched: List[Tuple[int, int]], n: int) -> List[Tuple[int, int]]:
    gaps, pos = [], 0
    for a, b in sorted(touched):
        if a > pos:
            gaps.append((pos, a))
        pos = max(pos, b)
    if pos < n:
        gaps.append((pos, n))
    return gaps


# The fake implementations are the real ones: under FakeTensorMode every kernel call runs
# through its meta function, with the arguments a GPU would get.
_block_attention = torch.library.custom_op("megatron_tsp::block_attention", mutates_args=())(_forward_impl)
_block_attention.register_fake(_forward_impl)
_block_attention_into = torch.library.custom_op("megatron_tsp::block_attention_into",
                                                mutates_args=("out",))(_forward_into)
_block_attention_into.register_fake(_forward_into)
_block_attention_backward = torch.library.custom_op("megatron_tsp::block_attention_backward",
                                                    mutates_args=("dq", "dk", "dv"))(_backward_into)
_block_attention_backward.register_fake(_backward_into)

# the merge: one op (the planner counts one launch), compiled on GPUs
_merge = torch.library.custom_op("megatron_tsp::merge_blocks", mutates_args=("out", "lse"))(merge_by_lse)
_merge.register_fake(merge_by_lse)
_merge.register_kernel("cuda")(compiled_on_first_call(merge_by_lse))

# the Python implementation of each op (the memory tracker follows them inside)
IMPLEMENTATIONS = {torch.ops.megatron_tsp.block_attention: _forward_impl,
                   torch.ops.megatron_tsp.block_attention_into: _forward_into,
                   torch.ops.megatron_tsp.block_attention_backward: _backward_into}


def _setup_context(ctx, inputs, output):
    q, k, v, blocks_flat, scale, backend = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = (blocks_flat, scale, backend)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    return (*_whole_backward(dout, q, k, v, out, lse, *ctx.args), None, None, None)


def _whole_backward(dout, q, k, v, out, lse, blocks_flat, scale, backend):
    """dq, dK, dV (the inputs' dtypes) of every block, into fresh buffers."""
    dq = torch.empty_like(q)
    dk = torch.empty_like(k, dtype=torch.float32)
    dv = torch.empty_like(v, dtype=torch.float32)
    _block_attention_backward(dout, q, k, v, out, lse, blocks_flat, 0, len(blocks_flat) // 7, scale, backend,
                              dq, dk, dv, True)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


_block_attention.register_autograd(_backward, setup_context=_setup_context)


def _flops_of(q_shape, blocks_flat) -> int:
    b, h, _, d = q_shape
    return 2 * 2 * h * d * sum((b if c.sample < 0 else 1) * geometry.visible_pairs_of([c])
                               for c in geometry.unflatten(blocks_flat))


def _flops(q_shape, k_shape, v_shape, blocks_flat, *args, out_shape=None, **kwargs) -> int:
    return _flops_of(q_shape, blocks_flat)


for _op in (torch.ops.megatron_tsp.block_attention, torch.ops.megatron_tsp.block_attention_into):
    register_flop_formula(_op)(_flops)  # each registration wraps the function it is given


@register_flop_formula(torch.ops.megatron_tsp.block_attention_backward)
def _flops_backward(dout_shape, q_shape, k_shape, v_shape, out_shape_, lse_shape, blocks_flat, first, last, *args,
                    out_shape=None, **kwargs) -> int:
    # a flash backward recomputes QK^T and computes dV, dP, dQ, dK: 5 GEMMs to forward's 2
    return _flops_of(q_shape, blocks_flat[7 * first:7 * last]) * 5 // 2


def bhsd(*tensors):
    """Megatron's ``[s, b, h, d]`` as the kernels' ``[b, h, s, d]`` (views)."""
    return tuple(t.permute(1, 2, 0, 3) for t in tensors)


def apply_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """A softmax with one more logit per head, ``sink`` (megatron's ``softmax_type``: 0 for
    off-by-one, a parameter for learnable), whose value vector is zero: it takes its share
    of each row's probability mass, out' = out · σ(lse − sink), lse' = logaddexp(lse, sink).
    ``out`` ``[b, h, sq, d]`` is rescaled in place; returns lse' ``[b, h, sq]``. The kernels'
    backward from (out', lse') is then exact for q, k and v (their softmax Jacobian sums over
    the sink's column too, whose dP is 0); :func:`sink_grad` is the sink's."""
    merged = torch.logaddexp(lse, sink.float().view(1, -1, 1))
    out.mul_(torch.exp(lse - merged).unsqueeze(-1))
    return merged


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """d loss / d sink_h = −Σ_{b,q} p_sink · rowsum(dout ∘ out'), p_sink = exp(sink − lse'),
    from :func:`apply_sink`'s out' and lse' (``[b, h, sq, d]``, ``[b, h, sq]``); fp32 ``[h]``."""
    delta = (dout.float() * out.float()).sum(-1)
    return -(torch.exp(sink.float().view(1, -1, 1) - lse) * delta).sum((0, 2))


class _SinkAttention(torch.autograd.Function):
    """:func:`block_attention` with a sink logit per head (:func:`apply_sink`)."""

    @staticmethod
    def forward(ctx, q, k, v, sink, blocks_flat, scale, backend):
        out, lse = _block_attention(q, k, v, blocks_flat, scale, backend)
        lse = apply_sink(out, lse, sink)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.args = (blocks_flat, scale, backend)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sink = ctx.saved_tensors
        return (*_whole_backward(dout, q, k, v, out, lse, *ctx.args), sink_grad(dout, out, lse, sink).to(sink.dtype),
                None, None, None)


def block_attention(query, keys, values, chunk_ids: Sequence[int], scale: float, backend: str,
                    sink: Optional[torch.Tensor] = None, window: int = -1,
                    documents: Optional[Sequence[Sequence[int]]] = None) -> torch.Tensor:
    """Megatron layout: query ``[sq, b, hq, d]`` (its chunks at ``chunk_ids``), keys/values
    ``[sk, b, hk, d]`` in global order, hq a multiple of hk; ``sink``: a logit per query head
    (:func:`apply_sink`); ``window``: keys before each query it sees (-1: all);
    ``documents``: each sample's document starts (packed documents). Returns ``out [sq, b,
    hq, d]``, differentiable by the op's own backward (from the saved lse)."""
    q, k, v = bhsd(query, keys, values)
    backend, aligned = kernels.prepare_backend(backend, query.device, query.dtype, is_fake(query), keys.size(0),
                                               window >= 0, documents is not None, query.size(-1))
    chunk_blocks = geometry.flatten(geometry.blocks(chunk_ids, q.size(2) // len(chunk_ids), aligned, window, backend,
                                                  documents))
    if sink is None:
        out, _ = _block_attention(q, k, v, chunk_blocks, float(scale), backend)
    else:
        out = _SinkAttention.apply(q, k, v, sink, chunk_blocks, float(scale), backend)
    return out.permute(2, 0, 1, 3)


def attend_into(query, keys, values, blocks_: Sequence[geometry.Block], scale: float, backend: str, out,
                before: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """Megatron layout, for a hand-written schedule: attention over explicit ``blocks_`` (rows
    of query and keys) written into ``out`` ``[sq, b, hq, d]`` (a view of a bigger buffer
    will do); returns the lse ``[b, hq, sq]`` to save for :func:`attend_backward_into`.
    ``before``: these queries' attention over other keys, ``(fp32 [sq, b, hq, d], lse)`` as
    an earlier call into an fp32 ``out`` left it, merged in (summed in fp32, rounded once);
    the blocks must then cover every query row."""
    q, k, v, o = bhsd(query, keys, values, out)
    if before is not None and _gaps([(b[0], b[1]) for b in blocks_], query.size(0)):
        raise ValueError("attend_into: with `before`, the blocks must cover every query row (it is merged into theirs)")
    if before is None:
        return _block_attention_into(q, k, v, geometry.flatten(blocks_), float(scale), backend, o)
    return _block_attention_into(q, k, v, geometry.flatten(blocks_), float(scale), backend, o, bhsd(before[0])[0],
                                 before[1])


def attend_backward_into(d_out, query, keys, values, out, lse, blocks_: Sequence[geometry.Block], scale: float,
                         backend: str, d_query, d_keys, d_values, first: int = 0, last: Optional[int] = None,
                         zero_untouched: bool = True) -> None:
    """From the saved forward (each block's kernel backward with the merged lse; no attention
    forward), for ``blocks_[first:last]``, after ``blocks_[:first]`` ran into the same
    buffers: dq into ``d_query`` ``[sq, b, hq, d]`` (the query's dtype), dK and dV into the
    caller's fp32 ``d_keys``, ``d_values`` ``[sk, b, hk, d]`` (views of the reduce-scatter
    buffer), each copied where no block wrote before and added where one did.
    ``zero_untouched``: zero the key rows no block of ``blocks_`` touches (False: they are
    zero already)."""
    last = len(blocks_) if last is None else last
    if not 0 <= first < last <= len(blocks_):
        raise ValueError(f"attend_backward_into: blocks [{first}:{last}] of {len(blocks_)}")
    do, q, k, v, o, dq, dk, dv = bhsd(d_out, query, keys, values, out, d_query, d_keys, d_values)
    _block_attention_backward(do, q, k, v, o, lse, geometry.flatten(blocks_), first, last, float(scale), backend, dq,
                              dk, dv, zero_untouched)
