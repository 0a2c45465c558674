"""The schedule of TSP attention: weight shards by broadcast, K/V by all-gather (docs/design.md section 2).

For every head group r, all ranks together (rank p holds the tokens ``x_p: [S/D, b, h]`` and
head group p's weights, :mod:`megatron_tsp.core.attention`):

    W_r       = broadcast(Wqkv_r, bqkv_r, Wproj_r; src=r)
    q, k, v   = split(x_p Wqkv_r^T + bqkv_r)          a/D query heads, g/D kv heads
    q, k      = rope(q, k) at the global positions of p's tokens
    K_r, V_r  = all_gather(k, v)                       [S, b, g/D, d], zigzag layout
    o_r       = block_attention(q, K_r, V_r)           head group r of O_p [S/D, b, h]

and then, once, ``y_p = O_p Wproj^T`` with ``Wproj`` the head groups' projection shards side
by side: one GEMM over K = h that sums the head groups in fp32 and rounds once, no fp32
accumulator in memory, and no all-reduce. Backward (derived; docs/design.md section 2)
re-broadcasts W_r, re-gathers K_r, V_r (never saved full-length), reduce-scatters dK_r, dV_r
in fp32 to the token owners, sums ``dx_p`` over head groups inside its GEMMs (fp32), and
reduces the partial dW_r of every rank to its owner r in fp32, written by its GEMMs into the
buffer the reduce sends. Saved for backward: ``x_p``, this rank's own shards, O_p, and per
head group the projection and log-sum-exp of p's tokens (1/D of what one device saves);
nothing is recomputed but q/k norms and RoPE, and what a flash kernel's own backward
recomputes. The attention itself is :mod:`megatron_tsp.core.block_attention`, the op every
baseline uses too.

What travels while what computes. Both passes run over n *stages* of G head groups side by
side (``groups_per_call``, :mod:`megatron_tsp.core.head_groups`; with G = 1 a stage is a head
group): one K/V gather, one dK/dV reduce-scatter and one kernel call per block for the whole
stage. Stage s's transfers are W(s), its head groups' weight shards, each broadcast by its
owner (on a communicator of their own: :mod:`megatron_tsp.core.streaming`); KV(s), its K/V
all-gather (every rank's first chunks, then their second chunks: :mod:`megatron_tsp.core.kv`);
dKV(s), its dK/dV reduce-scatter (every rank's second chunks, then their first chunks); and
dW(s), its head groups' fp32 weight gradients, each reduced to its owner. L is the lookahead
(``--tsp-lookahead``). Both passes start with W(0..L) posted (head groups 0..L's by the
module before, during its last stage, where it could: :mod:`megatron_tsp.core.prefetch`)
and stage 0's q, k, v computed, its K/V gather posted. Forward, step s = 0..n-1
(:meth:`BroadcastShardsGatherKV.forward`), then y = O Wproj^T:

    | step s computes                                 | waits for | in flight meanwhile                |
    |-------------------------------------------------|-----------|------------------------------------|
    | at s = n-1: posts the next module's first transfer                                               |
    | q, k, v of stage s+1 (posts W(s+1+L) first,     | W(s+1)    | W(s+2..s+1+L), KV(s)               |
    |   KV(s+1) last)                                 |           |                                    |
    | at s = 0: stage 0's blocks against its own keys |           | W(s+2..s+1+L), KV(s), KV(s+1)      |
    | at s = n-2: stage n-1's against its own keys    |           | W(s+2..s+1+L), KV(s), KV(s+1)      |
    | stage s's blocks against the gathered keys      | KV(s)     | W(s+2..s+1+L), KV(s+1)             |
    |   (merged with its own keys' part if it has one)|           |                                    |

Backward, step s = 0..n-1 (:meth:`BroadcastShardsGatherKV.backward`; KV(0) posted by the MLP
after this attention as its backward starts, where it could), then stage n-1's dx and dWqkv:

    | step s computes                                 | waits for | in flight meanwhile                |
    |-------------------------------------------------|-----------|------------------------------------|
    | posts W(s+1+L); at s = n-1 the next module's first transfer                                      |
    | q, k, v of stage s+1 (posts KV(s+1) last)       |           | W(s..s+1+L), KV(s), dKV(s-1),      |
    |                                                 |           |   a dW reduce                      |
    | dWproj and the attention backward of stage s    | W(s),     | W(s+1..s+1+L), KV(s+1), dKV(s-1),  |
    |   (posts dKV(s): the second chunks when final)  | KV(s)     |   a dW reduce                      |
    | dx and dWqkv of stage s-1, a head group at a    | dKV(s-1), | W(s+1..s+1+L), KV(s+1), dKV(s),    |
    |   time (posts its dW reduce)                    | the one   |   a dW reduce                      |
    |                                                 | before    |                                    |

A pass of one stage (every head group side by side, at short S on a GPU) has nothing to
stream behind: its shards are all-gathered at once, each kind one matrix (W(0) above is
then that gather, :class:`~megatron_tsp.core.streaming.WeightGather`), so that the QKV
projection, dO, dx and each weight gradient are one GEMM for every head group, and the
fp32 weight gradients reach their owners by one reduce-scatter each (``gathered``).

With plain causal attention (no window, no documents) and several stages, the forward's
first and last stages attend to this rank's own two key chunks, which need nothing to
arrive, before the other
ranks' (:func:`zigzag_own_keys_first`): the first stage's K/V have no earlier stage's
compute to travel behind, and the last stage's are the last transfer of a pass that waits
on its link, after which only their own blocks should be left. The last stage's backward
runs its blocks against them last, while its dK/dV travel (:func:`zigzag_own_keys_last`).
Every other stage's K/V travel behind the stage before's attention, and its blocks run
uncut: cut at the own slots they cost up to three more kernel calls and two merges a
stage, for no more compute beside any transfer. Without overlap (``overlap_comm=False``) the same steps run
on :class:`~megatron_tsp.core.comm.Blocking`, where every transfer completes where it is
posted: the sums run in the same order either way, bit-identical where the attention
kernels are deterministic (the CPU's; not flash-attn's backward on a GPU).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple, Type, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_tsp.core import comm
from megatron_tsp.core.block_attention import apply_sink, attend_backward_into, attend_into, bhsd, sink_grad
from megatron_tsp.core.block_geometry import rank_slots
from megatron_tsp.core.gemm import gemm, gemm_t, linear_into
from megatron_tsp.core.kv import GatherKV, ScatterKVGrads, grad_buffer, send_buffer
from megatron_tsp.core.prefetch import LayerChain
from megatron_tsp.core.streaming import (
    GatheredShards,
    WeightBroadcast,
    WeightGather,
    deliver_grads,
    gather_shards,
    unpack,
)

Rope = Optional[Tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class AttentionScheduleArgs:
    """The arguments of :class:`BroadcastShardsGatherKV`: the TSP group (K/V are gathered
    over it) and the one weight shards are broadcast over; ``split_heads(qkv, rope,
    local=None) -> q, k, v`` for one head group (q/k norms and RoPE: the layer's local stage;
    K and V written into ``local``, the gather's send buffer, when given) and its RoPE
    tables; this rank's query chunks, each its rows and attention blocks
    (:func:`zigzag_blocks`; the first needs only every rank's first chunk of K/V), and the
    backward's blocks over all of them and how many run before the rest
    (:func:`zigzag_backward_blocks`); scale and kernel; the width of O; whether the QKV
    projection has a bias (a shard is then Wqkv, bqkv, Wproj); the transport
    (:func:`comm.transport`) and lookahead; the model's layer chain and the module
    (:mod:`prefetch`)."""

    tsp_group: dist.ProcessGroup
    weight_group: dist.ProcessGroup
    split_heads: Callable
    rope: Rope
    chunks: List[Tuple[slice, list]]
    backward_blocks: Tuple[list, int]
    softmax_scale: float
    backend: str
    width: int  # of O, all heads: a * d (megatron's query_projection_size)
    head_dim: int
    kv_heads: int
    has_bias: bool
    transport: Type[comm.InFlight]
    lookahead: int
    chain: LayerChain
    module: object
    softmax_type: str = "vanilla"  # megatron's: vanilla, off-by-one (a sink logit 0), learnable (its parameter)
    own_keys_last: Optional[Tuple[list, int]] = None  # :func:`zigzag_own_keys_last`, for the last stage
    own_keys_first: Optional[list] = None  # :func:`zigzag_own_keys_first`, per query chunk of the forward
    backward_follows: bool = True  # grad mode at the call, or a recomputed layer's first pass
    groups_per_call: int = 1  # head groups side by side in one stage (:mod:`megatron_tsp.core.head_groups`)

    def columns(self, r: int, count: int = 1) -> slice:
        """Head groups r..r+count-1's columns of the concatenated attention output O (and
        rows of Wproj^T): their a*d/D input features of the output projection each."""
        width = self.width // self.tsp_group.size()
        return slice(r * width, (r + count) * width)

    @property
    def stages(self) -> int:
        return self.tsp_group.size() // self.groups_per_call

    @property
    def gathered(self) -> bool:
        """One stage of every head group: the shards are all-gathered, each kind one matrix
        (:class:`~megatron_tsp.core.streaming.WeightGather`), and each projection is one GEMM."""
        return self.stages == 1 and self.tsp_group.size() > 1

    def stage_groups(self, s: int) -> range:
        """The head groups of stage s, attended in one call per block (past the last stage:
        head groups no rank has, which no stream posts)."""
        return range(s * self.groups_per_call, (s + 1) * self.groups_per_call)

    def stage_columns(self, s: int) -> slice:
        return self.columns(s * self.groups_per_call, self.groups_per_call)


def group_columns(t: torch.Tensor, j: int, args: AttentionScheduleArgs) -> torch.Tensor:
    """The j-th head group's columns of a stage's tensor whose last dimension holds its head
    groups side by side (the QKV projection and its gradient, the gradient of O)."""
    width = t.size(-1) // args.groups_per_call
    return t[..., j * width:(j + 1) * width]


def post_first_shards(own: Sequence[torch.Tensor], weight_group: dist.ProcessGroup, lookahead: int,
                      inflight: Optional[comm.InFlight] = None, gathered: bool = False):
    """A pass's first transfer: the broadcasts of head groups 0..lookahead's shards
    (``({r: (buffer, work)}, works)``; None on one rank), or with ``gathered`` every shard's
    all-gathers (:func:`~megatron_tsp.core.streaming.gather_shards`). The module before posts
    it during its last stage where it can (:mod:`prefetch`; registered with its transport
    ``inflight``), else the pass itself (:func:`weight_stream`)."""
    if weight_group.size() == 1:
        return None
    if gathered:
        return gather_shards(own, weight_group, inflight)
    posted = {r: WeightBroadcast.post(own, weight_group, r, inflight)
              for r in range(min(1 + lookahead, weight_group.size()))}
    return posted, [work for _, work in posted.values()]


def weight_stream(args: AttentionScheduleArgs, own: Sequence[torch.Tensor], inflight: comm.InFlight):
    """A pass's weight stream: the broadcasts (:class:`WeightBroadcast`) with the shards of
    stages 0..lookahead posted, or every shard's gathers (:class:`WeightGather`, where the
    pass is one stage); its first transfer taken from the module before where it posted it
    (:meth:`LayerChain.take`), the rest now."""
    first = args.chain.take(args.module, args.gathered)
    if args.gathered:
        stream = WeightGather(own, args.weight_group, inflight, first=first)
        stream.start()
        return stream
    stream = WeightBroadcast(own, args.weight_group, inflight,
                             first=first or post_first_shards(own, args.weight_group, args.lookahead))
    for r in range(args.groups_per_call * (1 + args.lookahead)):
        stream.start(r)
    return stream


class BroadcastShardsGatherKV(torch.autograd.Function):
    """y_p = (concat_r attn(x_p; W_r)) Wproj^T with W_r broadcast from rank r: the two loops
    of the module docstring's tables, over the steps of :class:`ForwardPass` and
    :class:`BackwardPass`. The backward starts from the saved projections ``m_r`` and
    ``(O_r, lse_r)``: no attention forward and no projection GEMM runs again."""

    @staticmethod
    def forward(ctx, args: AttentionScheduleArgs, x, *params):
        n_shard = 3 if args.has_bias else 2
        learnable = args.softmax_type == "learnable"
        own, replicated = params[:n_shard], params[n_shard:len(params) - learnable]
        sinks = head_group_sinks(args, params[-1] if learnable else None, x.device)
        then_backward = args.backward_follows and any(ctx.needs_input_grad)
        n = args.stages
        with args.transport(comm.label("attention", args.module, "forward")) as inflight:
            fwd = ForwardPass(args, x, weight_stream(args, own, inflight), inflight, sinks)
            stage = fwd.project(0)
            for s in range(n):
                if s == n - 1:
                    args.chain.post_next(args.module, inflight, backward=False, then_backward=then_backward)
                upcoming = fwd.project(s + 1) if s + 1 < n else None
                if s == 0:  # while stage 0's and stage 1's K/V travel
                    stage = fwd.attend_own(stage)
                if s + 1 == n - 1:  # the last stage's, while its K/V travel
                    upcoming = fwd.attend_own(upcoming)
                fwd.attend_gathered(stage)
                stage = upcoming
        y = F.linear(fwd.out, fwd.proj)  # one GEMM over the head groups: fp32 inside, rounded once
        ctx.args = replace(args, rope=None)  # the tables travel as saved tensors
        Saved(x, fwd.out, own, replicated, fwd.projections, fwd.lses, list(args.rope or ()),
              [] if sinks is None else [sinks]).save(ctx)
        ctx.prefetched = []
        if args.tsp_group.size() > 1 and then_backward:
            args.chain.stash(args.module, lambda inflight: post_backward_regathers(ctx, inflight))
        return y

    @staticmethod
    def backward(ctx, dy):
        saved = Saved.load(ctx)
        args: AttentionScheduleArgs = replace(ctx.args, rope=tuple(saved.rope) or None)
        n = args.stages
        with args.transport(comm.label("attention", args.module, "backward")) as inflight:
            prefetched, ctx.prefetched = ctx.prefetched, []
            for inputs in prefetched:  # posted by the MLP before: waited for here if this fails
                inputs.kv.adopt(inflight)
            stream = weight_stream(args, saved.own, inflight)
            bwd = BackwardPass(args, dy, saved, stream, inflight, prefetched)
            inputs = bwd.inputs(0)
            finished: Optional[StageGrads] = None  # the stage before, its dK/dV travelling
            for s in range(n):
                for r in args.stage_groups(s + 1 + args.lookahead):
                    stream.start(r)
                if s == n - 1:
                    args.chain.post_next(args.module, inflight, backward=True)
                upcoming = bwd.inputs(s + 1) if s + 1 < n else None
                attended = bwd.attention(s, inputs)
                if finished is not None:
                    bwd.weights(finished)
                finished, inputs = attended, upcoming
            bwd.weights(finished)
            own_grad = stream.own_grad()
        d_sink = [bwd.own_sink_grad()] if args.softmax_type == "learnable" else []
        return (None, bwd.dx.view_as(saved.x).to(saved.x.dtype), *deliver_grads(saved.own, own_grad),
                *(g.to(p.dtype) for g, p in zip(bwd.d_replicated, saved.replicated)), *d_sink)


def head_group_sinks(args: AttentionScheduleArgs, sink: Optional[torch.Tensor], device) -> Optional[torch.Tensor]:
    """Every head group's sink logits ``[D, a/D]`` in fp32 (:func:`apply_sink`): megatron's
    learnable ones all-gathered from their owners (rank r holds head group r's, as it holds
    its weights), off-by-one's zeros; None for the vanilla softmax."""
    if args.softmax_type == "vanilla":
        return None
    d_size = args.tsp_group.size()
    heads = args.width // args.head_dim // d_size
    if sink is None:
        return torch.zeros(d_size, heads, device=device)
    sink = sink.detach().float().contiguous()
    if d_size == 1:
        return sink.view(1, heads)
    full = sink.new_empty(d_size * heads)
    dist.all_gather_into_tensor(full, sink, group=args.tsp_group)
    return full.view(d_size, heads)


class ForwardStage(NamedTuple):
    """Forward, stage s (its head groups side by side in the head dimension): its queries
    for this rank's tokens, its K/V being gathered, this rank's own K/V (the gather's send
    buffer), and, once attended, per query chunk its attention against the own keys
    (:func:`zigzag_own_keys_first`): fp32 and its lse, or the chunk's output and lse where it
    sees no other keys."""

    s: int
    query: torch.Tensor
    kv: GatherKV
    local: torch.Tensor
    own: Optional[List[Tuple[torch.Tensor, torch.Tensor]]] = None


class ForwardPass:
    """The forward's steps on a stage, and what they fill across stages: O (stage s in its
    columns), the output projection's ``proj`` (each shard in its columns), per stage its
    head groups' projections side by side ``m_s``, per stage and query chunk the lse."""

    def __init__(self, args: AttentionScheduleArgs, x, stream: WeightBroadcast, inflight: comm.InFlight,
                 sinks: Optional[torch.Tensor]):
        self.args, self.x, self.stream, self.inflight, self.sinks = args, x, stream, inflight, sinks
        own, d_size = stream.own, args.tsp_group.size()
        self.out = x.new_empty(x.shape[:2] + (args.width,))
        self.proj = own[-1] if d_size == 1 or args.gathered else own[-1].new_empty(own[-1].size(0), args.width)
        self.projections: List[Optional[torch.Tensor]] = [None] * args.stages
        self.lses: List[torch.Tensor] = []

    def columns(self, s: int) -> torch.Tensor:
        return self.out[..., self.args.stage_columns(s)].view(self.out.shape[:2] + (-1, self.args.head_dim))

    def project(self, s: int) -> ForwardStage:
        """Stage s's q, k, v: each head group's QKV GEMM into its columns of the stage's
        projection as its shard arrives (posting the shards ``lookahead`` stages on as each is
        waited for, and letting each go once read), then the stage's norms and RoPE at once,
        K and V into the gather's send buffer; its K/V gather posted. A pass of one stage
        (``gathered``): one GEMM for every head group, and the gathered Wproj^T is the output
        projection's weight as it arrived."""
        args = self.args
        if args.gathered:
            full = self.stream.gathered()
            mixed = F.linear(self.x, full.first, full.bias)
            self.proj = full.second_t.t()
        else:
            mixed = None
            for j, r in enumerate(args.stage_groups(s)):
                self.stream.start(r + args.lookahead * args.groups_per_call)
                shard = self.stream.wait(r)
                if mixed is None:
                    mixed = self.x.new_empty(self.x.shape[:2] + (args.groups_per_call * shard[0].size(0),))
                linear_into(self.x, shard[0], shard[1] if args.has_bias else None, group_columns(mixed, j, args))
                if args.tsp_group.size() > 1:
                    self.proj[:, args.columns(r)].copy_(shard[-1])
                self.stream.release(r)
        self.projections[s] = mixed
        local = send_buffer(mixed.shape[:2] + (args.groups_per_call * args.kv_heads, args.head_dim), mixed)
        query, _, _ = args.split_heads(mixed, args.rope, local)
        return ForwardStage(s, query, GatherKV(local, args.tsp_group, self.inflight), local)

    def attend_own(self, stage: ForwardStage) -> ForwardStage:
        """The stage's blocks against this rank's own keys, which need nothing to arrive."""
        args = self.args
        if args.own_keys_first is None:
            return stage
        keys, values = stage.local[:, 0], stage.local[:, 1]
        o = self.columns(stage.s)
        parts = []
        for (rows, _), (mine, others) in zip(args.chunks, args.own_keys_first):
            part = o[rows].new_empty(o[rows].shape, dtype=torch.float32) if others else o[rows]  # final if no others
            parts.append((part, attend_into(stage.query[rows], keys, values, mine, args.softmax_scale, args.backend,
                                            part)))
        return stage._replace(own=parts)

    def attend_gathered(self, stage: ForwardStage) -> None:
        """The stage's blocks against the gathered keys, query chunk by query chunk as what
        each attends to arrives (the first chunk's keys arrive first), merged with its own
        keys' part; its output into its columns of O."""
        args = self.args
        o = self.columns(stage.s)
        groups = args.stage_groups(stage.s)
        sink = None if self.sinks is None else self.sinks[groups.start:groups.stop].reshape(-1)
        for i, (rows, blocks) in enumerate(args.chunks):
            if stage.own is None:
                lse = attend_into(stage.query[rows], *self._arrived(stage, i), blocks, args.softmax_scale,
                                  args.backend, o[rows])
            else:
                (part, lse), others = stage.own[i], args.own_keys_first[i][1]
                if others:
                    lse = attend_into(stage.query[rows], *self._arrived(stage, i), others, args.softmax_scale,
                                      args.backend, o[rows], before=(part, lse))
            self.lses.append(lse if sink is None else apply_sink(bhsd(o[rows])[0], lse, sink))

    @staticmethod
    def _arrived(stage: ForwardStage, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The stage's gathered K and V, once what query chunk i attends to has arrived."""
        return stage.kv.wait_first() if i == 0 else stage.kv.wait()


class Saved(NamedTuple):
    """What the forward keeps for backward (by ``save_for_backward``, so that saved-tensor
    hooks see it): the input, the concatenated attention output O, per stage its head groups'
    projections ``m_s``, per stage and query chunk the log-sum-exp (stage-major), the
    RoPE tables of this rank's tokens (empty without RoPE), and every head group's sink
    logits ``[D, a/D]`` (empty with megatron's vanilla softmax; O and the lse are then those
    of the softmax with the sink, :func:`apply_sink`)."""

    x: torch.Tensor
    out: torch.Tensor
    own: List[torch.Tensor]
    replicated: List[torch.Tensor]
    projections: List[torch.Tensor]
    lses: List[torch.Tensor]
    rope: List[torch.Tensor]
    sinks: List[torch.Tensor]

    def save(self, ctx) -> None:
        ctx.saved_layout = [len(p) for p in (self.own, self.replicated, self.projections, self.lses, self.rope)]
        ctx.save_for_backward(self.x, self.out, *self.own, *self.replicated, *self.projections, *self.lses,
                              *self.rope, *self.sinks)

    @classmethod
    def load(cls, ctx) -> "Saved":
        x, out, *rest = ctx.saved_tensors
        cuts = list(itertools.accumulate(ctx.saved_layout))
        parts = [rest[a:b] for a, b in zip([0] + cuts, cuts + [len(rest)])]
        return cls(x, out, *(list(p) for p in parts))


class StageInputs(NamedTuple):
    """Backward, one stage: q, k, v recomputed from its saved projection ``mixed`` (the
    local graph of norms and RoPE, kept for autograd), and its K/V being gathered."""

    mixed: torch.Tensor
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv: GatherKV


def regather_inputs(args: AttentionScheduleArgs, saved: Saved, s: int, inflight: comm.InFlight) -> StageInputs:
    """Stage s's backward inputs: q, k, v from its saved projection, K/V gather posted."""
    m = saved.projections[s].detach().requires_grad_()
    with torch.enable_grad():
        q, k, v = args.split_heads(m, args.rope)
    local = send_buffer(k.shape, k)
    local[:, 0].copy_(k.detach())
    local[:, 1].copy_(v.detach())
    return StageInputs(m, q, k, v, GatherKV(local, args.tsp_group, inflight))


def post_backward_regathers(ctx, inflight: comm.InFlight) -> List[dist.Work]:
    """Start the backward's first K/V re-gather now, stage 0's, from its saved projections
    (called by the MLP after this attention, as its own backward starts: :mod:`prefetch`).
    The gathered K/V are then held through the MLP's backward, one stage's. Its transfers
    are registered with the caller's ``inflight`` (waited for if the caller fails), which
    hands them over on success (the returned works); the attention backward adopts them."""
    saved = Saved.load(ctx)
    args = replace(ctx.args, rope=tuple(saved.rope) or None)
    ctx.prefetched = [regather_inputs(args, saved, 0, inflight)]
    return [work for inputs in ctx.prefetched for work in inputs.kv.works()]


class StageGrads(NamedTuple):
    """Backward, one stage after its attention backward: its head groups' weight shards,
    dq, its dK/dV being reduce-scattered to the token owners, and per head group the fp32
    buffer its weight gradients go into (the output projection's is written already); in a
    pass of one stage (``gathered``) every shard gathered and every head group's dWproj^T. The
    last stage's blocks against this rank's own keys may be still to run (``own_keys``:
    runs them into the buffer it is given; :meth:`BackwardPass.weights`)."""

    s: int
    shards: Union[List[List[torch.Tensor]], GatheredShards]
    inputs: StageInputs
    dq: torch.Tensor
    dkv: ScatterKVGrads
    flats: List[torch.Tensor]
    own_keys: Optional[Callable[[torch.Tensor], None]] = None


class BackwardPass:
    """The backward's three steps on a stage, which its loop interleaves across stages
    (:meth:`inputs`: q, k, v from the saved projections, K/V gather posted;
    :meth:`attention`: dWproj, attention backward up to dq, dK/dV reduce-scatter posted;
    :meth:`weights`: per head group dx, dWqkv, reduce to the owner, once dK/dV are back), and
    what they sum across stages: ``dx`` inside its GEMMs, in fp32 and in head-group order,
    the norm and sink gradients in fp32."""

    def __init__(self, args: AttentionScheduleArgs, dy, saved: Saved, stream: WeightBroadcast,
                 inflight: comm.InFlight, prefetched: Sequence[StageInputs] = ()):
        self.args, self.dy, self.saved, self.stream, self.inflight = args, dy, saved, stream, inflight
        self.prefetched = list(prefetched)
        self.dy2d = dy.reshape(-1, dy.size(-1))
        self.x2d = saved.x.reshape(-1, saved.x.size(-1))
        self.out2d = saved.out.view(-1, saved.out.size(-1))
        self.dx: Optional[torch.Tensor] = None
        self._dkv: List[Optional[torch.Tensor]] = [None, None]
        self.d_replicated = [torch.zeros_like(p, dtype=torch.float32) for p in saved.replicated]
        # every head group's sink gradient from this rank's queries, summed at its owner at the end
        self.d_sinks = torch.zeros_like(saved.sinks[0]) if args.softmax_type == "learnable" else None

    def inputs(self, s: int) -> StageInputs:
        if s < len(self.prefetched) and self.prefetched[s] is not None:
            taken, self.prefetched[s] = self.prefetched[s], None
            return taken
        return regather_inputs(self.args, self.saved, s, self.inflight)

    def attention(self, s: int, inputs: StageInputs) -> StageGrads:
        args = self.args
        groups = args.stage_groups(s)
        if args.gathered:  # every head group's dWproj^T and dO, one GEMM each
            shards = self.stream.gathered()
            flats = [gemm_t(self.out2d, self.dy2d)]
            d_out = torch.mm(self.dy2d, shards.second_t.t())
        else:
            shards = [self.stream.wait(r) for r in groups]
            flats = []
            for r in groups:
                flats.append(self.stream.grad_buffer())
                # dWproj_r
                gemm_t(self.dy2d, self.out2d[:, args.columns(r)], out=unpack(flats[-1], self.saved.own)[-1])
            d_out = self.dy.new_empty(self.dy.shape[:2] + (len(shards) * shards[0][-1].size(1),))
            for j, shard in enumerate(shards):
                torch.mm(self.dy2d, shard[-1], out=group_columns(d_out, j, args).view(self.dy2d.size(0), -1))
        d_out = d_out.view(self.dy.shape[:2] + (-1, args.head_dim))
        out = self.saved.out[..., args.stage_columns(s)].view(d_out.shape)
        keys, values = inputs.kv.wait()
        dkv, fresh = self._dkv_buffer(s, keys)
        query = inputs.query.detach()
        dq = torch.empty_like(query)
        scatter = ScatterKVGrads(dkv, args.tsp_group, self.inflight)
        n = len(args.chunks)
        lse = torch.cat(self.saved.lses[s * n:(s + 1) * n], dim=-1)
        if self.d_sinks is not None:
            sinks = self.saved.sinks[0][groups.start:groups.stop]
            self.d_sinks[groups.start:groups.stop] += sink_grad(*bhsd(d_out, out), lse,
                                                                sinks.reshape(-1)).view(sinks.shape)

        def run(blocks, first, last, dkv, zero_untouched):
            attend_backward_into(d_out, query, keys, values, out, lse, blocks, args.softmax_scale, args.backend,
                                 dq, dkv[:, 0], dkv[:, 1], first, last, zero_untouched=zero_untouched)

        if s == args.stages - 1 and args.own_keys_last is not None:
            # the last stage: nothing computes beside its dK/dV unless its own blocks do.
            # The blocks against the other ranks' keys first; this rank's own rows of the
            # buffer are zeros for the reduce-scatter, and its own blocks run into another
            # buffer while it travels (:meth:`weights` adds them to what arrives).
            blocks, split = args.own_keys_last
            run(blocks, 0, split, dkv, fresh)
            for rows in self._own_rows(dkv.size(0)):
                dkv[rows].zero_()
            scatter.post_second_halves()
            scatter.post_first_halves()
            return StageGrads(s, shards, inputs, dq, scatter, flats,
                              lambda target: run(blocks, split, len(blocks), target, False))
        blocks, split = args.backward_blocks
        if split > 0:
            run(blocks, 0, split, dkv, fresh)
        scatter.post_second_halves()  # every rank's second chunk of dK/dV is final: it travels while the rest run
        if split < len(blocks):
            run(blocks, split, len(blocks), dkv, fresh and split == 0)
        scatter.post_first_halves()
        return StageGrads(s, shards, inputs, dq, scatter, flats)

    def _own_rows(self, rows: int) -> Tuple[slice, ...]:
        """This rank's first and second chunk in the zigzag layout of ``rows`` key rows
        (:func:`rank_slots`), the order :class:`ScatterKVGrads` hands them back in."""
        d, p = self.args.tsp_group.size(), self.args.tsp_group.rank()
        c = rows // (2 * d)
        return tuple(slice(slot * c, (slot + 1) * c) for slot in rank_slots(d, p))

    def own_sink_grad(self) -> torch.Tensor:
        """This rank's head group's sink gradient: every rank's part of it, summed here."""
        group = self.args.tsp_group
        if group.size() == 1:
            return self.d_sinks[0]
        own = self.d_sinks.new_empty(self.d_sinks.size(1))
        dist.reduce_scatter_tensor(own, self.d_sinks.view(-1), group=group)
        return own

    def _dkv_buffer(self, s: int, keys: torch.Tensor) -> Tuple[torch.Tensor, bool]:
        """Stage s's fp32 dK/dV buffer and whether it is fresh. Two buffers alternate (stage
        s's is free again once its reduce-scatter has finished, before stage s+2's attention
        backward): the key rows no block of this rank touches are zeroed once per buffer, not
        once per stage."""
        slot = s % 2
        if self._dkv[slot] is None:
            self._dkv[slot] = grad_buffer(keys.size(0), keys)
            return self._dkv[slot], True
        return self._dkv[slot], False

    def weights(self, g: StageGrads) -> None:
        own = None
        if g.own_keys is not None:  # the stage before it has its dK/dV back: its buffer is free
            own = self._dkv[(g.s - 1) % 2]
            if own is None:  # one stage: there was none before it
                own = torch.empty_like(self._dkv[g.s % 2])
            g.own_keys(own)
        dk, dv = g.dkv.wait()
        if own is not None:
            first, second = self._own_rows(own.size(0))
            c = first.stop - first.start
            g.dkv.local[:c] += own[first]
            g.dkv.local[c:] += own[second]
        key, value = g.inputs.key, g.inputs.value
        d_mixed, *d_norms = torch.autograd.grad((g.inputs.query, key, value), (g.inputs.mixed, *self.saved.replicated),
                                                (g.dq, dk.to(key.dtype), dv.to(value.dtype)))
        for acc, d in zip(self.d_replicated, d_norms):
            acc += d
        if self.args.gathered:  # dx and every head group's dWqkv, one GEMM each, reduce-scattered to the owners
            d_mixed2d = d_mixed.reshape(-1, d_mixed.size(-1))
            self.dx = torch.mm(d_mixed2d, g.shards.first)
            self.stream.scatter(gemm_t(d_mixed2d, self.x2d),
                                torch.sum(d_mixed2d, dim=0, dtype=torch.float32) if self.args.has_bias else None,
                                g.flats[0])
            return
        for j, r in enumerate(self.args.stage_groups(g.s)):
            d_mixed2d = group_columns(d_mixed, j, self.args).reshape(-1, d_mixed.size(-1) // self.args.groups_per_call)
            self.dx = gemm(d_mixed2d, g.shards[j][0], out=self.dx, accumulate=self.dx is not None)
            views = unpack(g.flats[j], self.saved.own)
            gemm_t(d_mixed2d, self.x2d, out=views[0])
            if self.args.has_bias:
                torch.sum(d_mixed2d, dim=0, dtype=torch.float32, out=views[1])
            self.stream.release(r)
            self.stream.reduce(r, g.flats[j])
            self.stream.wait_reduces(keep=1)  # the one before: each travels beside the next head group's GEMMs
