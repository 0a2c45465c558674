"""The ring MLP: weight shards rotate around a ring of point-to-point sends.

Rank p holds its tokens ``x_p: [S/D, b, h]`` and fc1/fc2 shard p in megatron's
tensor-parallel layout (this class *is* a megatron ``MLP``; only ``forward`` differs). The
ffn dimension is elementwise, so

    y_p = sum_j act(x_p W1_j^T + b1_j) W2_j^T

exactly, summed over the D shards j as they pass through rank p (shard j = (p - t) mod D at
step t, sent on to p+1 while the next arrives from p-1). Nothing leaves the rank but weights:
no all-reduce, no all-gather. Backward runs the ring again, with a gradient accumulator
travelling behind each shard to its owner (``streaming.WeightRing``); where it runs right
after the forward (the last layer, or one recomputed on its own), the shard the forward
ended with is kept for it, one hop of D-1 fewer. Saved for backward:
``x_p`` and the fc1 output of every shard for this rank's tokens (1/D of what one device
saves); only the elementwise activation is recomputed. Where the layer is recomputed anyway
(full or ``mlp`` recompute), what it saves lives for one layer's backward only: a GELU MLP
then also keeps the activation, as megatron's MLP keeps fc2's input, and backward takes
GELU's gradient from its input without running it again (one read and write of
``[S/D, b, ffn]`` fewer per layer).

Every sum over shards is made inside a GEMM, in fp32 (:mod:`megatron_tsp.core.gemm`): the output
and the input gradient accumulate over the ring without a rounding, and each shard's weight
gradient is written, then added to by the next holders, inside the fp32 buffer that carries
it to its owner.

A short layer's MLP gathers its shards instead (``shards_per_call`` D, and by default where
its attention puts every head group in one call: :meth:`TSPMLP.shards_per_call`): every
shard all-gathered at once, the same bytes as the ring's, so that fc1, the activation and
fc2 are one GEMM or kernel each rather than one per shard and step; each rank's weight
gradients go to their owners by an fp32 reduce-scatter, not in accumulators round the ring
(:class:`GatherMLPShards`). At short sequence lengths a ring step's GEMMs are too small to
keep a GPU busy and the step is bound by its launches; the ring's overlap is then worth
less than D times fewer kernels.

It is TSP's MLP, and it drops into a tensor-parallel model as it is (``--ring-mlp``): TP's
fc1 column and fc2 row shards are its shards, and TP+SP's pre-MLP norm hands it the
sequence-sharded ``[S/D, b, h]`` its output goes back to; the MLP's activation collectives
(all-gather before fc1, reduce-scatter after fc2, the all-gather again in backward) become
weight traffic that does not grow with S. Without sequence parallelism each rank takes its
1/D of the (replicated) tokens, and one all-gather of the output replaces TP's all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple, Type, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_tsp.core import comm
from megatron_tsp.core.gemm import gemm, gemm_t
from megatron_tsp.core.parallel_state import is_tsp_group, resolve_ring_groups
from megatron_tsp.core.prefetch import LayerChain
from megatron_tsp.core.streaming import (
    GatheredShards,
    WeightRing,
    deliver_grads,
    gather_shards,
    linear_pair_shard,
    scatter_grads,
    unpack,
)
from megatron_tsp.core.support import check_mlp_config, moe_layers, require

_NOT_AN_EXPERT = ("TSPMLP: a mixture-of-experts layer's experts are megatron's MLPs, each whole on the rank that "
                  "holds it (megatron_tsp.get_gpt_block_tsp_spec builds MoE layers so); TSPMLP is a dense layer's")


class TSPMLP(MLP):
    """Drop-in for megatron's ``MLP`` under TSP, or as the ring MLP of a TP model (same
    parameters, init and checkpoints; :func:`resolve_ring_groups` says which).

    ``overlap_comm``: the next shard travels while this one computes (else every transfer
    completes where it is posted: :class:`~megatron_tsp.core.comm.Blocking`). ``chain``: the
    model's :class:`~megatron_tsp.core.prefetch.LayerChain` (the spec passes one).
    ``shards_per_call``: 1 (the ring), D (every shard gathered, :class:`GatherMLPShards`), or
    ``auto`` (also written 0): :meth:`shards_per_call`.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MLPSubmodules,
        is_expert: bool = False,
        input_size: Optional[int] = None,
        ffn_hidden_size: Optional[int] = None,
        tp_group: Optional[torch.distributed.ProcessGroup] = None,
        overlap_comm: bool = True,
        chain: Optional[LayerChain] = None,
        shards_per_call: Union[int, str] = 1,
        pg_collection=None,
        is_mtp_layer: bool = False,
        **layer_kwargs,
    ):
        """``pg_collection``, ``is_mtp_layer`` and ``layer_kwargs`` are what the running
        megatron-core's ``TransformerLayer`` passes its MLP (0.19: all three, ``name`` among
        the last; 0.16: none). A collection with a ``.tsp`` group names the ring's group;
        megatron's default collection does not, and the registered groups apply."""
        group, weight_group = resolve_ring_groups(group=tp_group if tp_group is not None
                                                  else getattr(pg_collection, "tsp", None))
        self.under = "--tsp-size" if is_tsp_group(group) else "--ring-mlp"
        if is_expert:
            raise ValueError(_NOT_AN_EXPERT)
        if config.num_moe_experts and self.under == "--ring-mlp":
            raise ValueError("TSPMLP: the ring MLP in a mixture-of-experts model (--num-experts with --ring-mlp) is "
                             "not implemented; drop one")
        require("--mtp-num-layers", is_mtp_layer, group.size(), "TSPMLP", self.under)
        require("--tsp-mlp-shards-per-call", shards_per_call, group.size(), "TSPMLP", self.under)
        ffn_hidden_size = ffn_hidden_size or config.ffn_hidden_size
        check_mlp_config(config, group.size(), ffn_hidden_size, self.under)
        super().__init__(config, submodules, False, input_size, ffn_hidden_size, group, **layer_kwargs)
        self.tsp_group = group
        self.weight_group = weight_group
        self.overlap_comm = overlap_comm
        self.shards_setting = shards_per_call
        self.chain = chain if chain is not None else LayerChain()
        self.chain.register(self)

    def shards_per_call(self) -> int:
        """1: the shards rotate round the ring; D: every shard is gathered at once. ``auto``:
        D where the model's TSP attention puts all its head groups in one call, which it does
        where a head group's calls leave the GPU idle (:func:`~megatron_tsp.core.head_groups
        .head_groups_per_call`; its layers tell the chain), the same shortness that leaves a
        ring step's GEMMs bound by their launches; else the ring (on the CPU always)."""
        d_size = self.weight_group.size()
        if self.shards_setting in ("auto", 0):
            return d_size if d_size > 1 and self.chain.short_layers else 1
        return self.shards_setting

    def shard_tensors(self) -> List[torch.Tensor]:
        """This rank's shard, in the order it travels: W1, (b1), W2."""
        return linear_pair_shard(self.linear_fc1, self.linear_fc2)

    def post_first_transfer(self, inflight: comm.InFlight, after_own_forward: bool = False):
        """Post this layer's first ring exchange (own shard out, the neighbour's in) on the
        poster's transport ``inflight``: :mod:`prefetch`. ``after_own_forward``: for the
        backward that follows this layer's forward at once, which keeps the shard it ended
        with; with D = 2 that is the backward's first, and nothing is posted (None)."""
        if self.shards_per_call() > 1:  # a backward that follows at once keeps the forward's
            return None if after_own_forward else gather_shards(self.shard_tensors(), self.weight_group, inflight)
        if after_own_forward and self.weight_group.size() == 2:
            return None
        return WeightRing.post(self.shard_tensors(), self.weight_group, inflight=inflight)

    def activation(self, h: torch.Tensor) -> torch.Tensor:
        """megatron's unfused MLP activation (mlp.py, MLP.forward), on one shard."""
        config = self.config
        if not config.gated_linear_unit:
            return self.activation_func(h)
        x_glu, x_linear = torch.chunk(h, 2, dim=-1)
        if (val := config.activation_func_clamp_value) is not None:
            x_glu = x_glu.clamp(min=None, max=val)
            x_linear = x_linear.clamp(min=-val, max=val)
        return config.activation_func(x_glu) * (x_linear + config.glu_linear_offset)

    def activation_grad(self) -> Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
        """``(h, d_a) -> d_h`` without running the activation again, where backward may keep
        its output: the activation is GELU, whose backward kernel reads its input alone, and
        this MLP is recomputed (full uniform recompute, or selective with ``mlp``), so what
        it saves is released with the backward of its recompute chunk (``recompute_num_layers``
        layers). None elsewhere: a gated activation's
        gradient needs its parts, recomputed in backward either way, and a layer that is not
        recomputed would hold one more ``[S/D, b, ffn]`` until its backward."""
        config = self.config
        recomputed = ((config.recompute_granularity == "full" and config.recompute_method == "uniform")
                      or (config.recompute_granularity == "selective" and "mlp" in (config.recompute_modules or ())))
        if not recomputed or config.gated_linear_unit or self.activation_func is not F.gelu:
            return None
        return lambda h, d_a: torch.ops.aten.gelu_backward(d_a, h)

    def set_layer_number(self, layer_number: int) -> None:
        """Called by megatron's ``TransformerLayer`` with its (global) layer number (kept for
        the schedule's name, :func:`comm.label`): a layer that ``moe_layer_freq`` makes a
        mixture-of-experts layer must not be built dense."""
        self.layer_number = layer_number
        if moe_layers(self.config)[layer_number - 1]:
            raise ValueError(f"TSPMLP: layer {layer_number} is a mixture-of-experts layer (--num-experts, "
                             "--moe-layer-freq); build the model with megatron_tsp.get_gpt_block_tsp_spec, which "
                             "puts megatron's MoE module there")

    def forward(self, hidden_states: torch.Tensor, per_token_scale=None, **kwargs
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if per_token_scale is not None:
            raise ValueError(_NOT_AN_EXPERT)
        args = MLPScheduleArgs(self.weight_group, self.activation, self.config.hidden_size,
                               has_bias=self.linear_fc1.bias is not None,
                               transport=comm.transport(self.overlap_comm),
                               chain=self.chain, module=self, activation_grad=self.activation_grad(),
                               backward_follows=torch.is_grad_enabled()
                               or self.config.recompute_granularity == "full")
        schedule = GatherMLPShards if self.shards_per_call() > 1 else RotateMLPShards
        if self.config.sequence_parallel:
            return schedule.apply(args, hidden_states, *self.shard_tensors()), self.linear_fc2.bias
        # replicated tokens: this rank's 1/D in, everyone's out (backward: the slice, then the gather)
        mine = scatter_to_sequence_parallel_region(hidden_states, group=self.tsp_group)
        output = schedule.apply(args, mine, *self.shard_tensors())
        full = gather_from_sequence_parallel_region(output, tensor_parallel_output_grad=False, group=self.tsp_group)
        return full, self.linear_fc2.bias


@dataclass(frozen=True)
class MLPScheduleArgs:
    """The arguments of :class:`RotateMLPShards`: the group the shards rotate over, the
    elementwise activation, the output width, whether fc1 has a bias (a shard is then W1, b1,
    W2), the transport (:func:`comm.transport`), the model's layer chain and the module
    (:mod:`prefetch`), and the activation's gradient from its input alone where backward
    keeps its output (:meth:`TSPMLP.activation_grad`)."""

    weight_group: dist.ProcessGroup
    activation: Callable[[torch.Tensor], torch.Tensor]
    hidden_size: int
    has_bias: bool
    transport: Type[comm.InFlight] = comm.InFlight
    chain: Optional[LayerChain] = None
    module: object = None
    activation_grad: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None
    backward_follows: bool = True  # grad mode at the call, or a recomputed layer's first pass

    def first_transfer(self, gathered: bool = False):
        """The first transfer the module before posted for this one (:meth:`LayerChain.take`;
        None: post your own): the gathers with ``gathered``, else the ring's first exchange."""
        return self.chain.take(self.module, gathered) if self.chain is not None else None

    def first_gather(self, own, inflight: comm.InFlight) -> GatheredShards:
        """The all-gathers of every shard: posted by the module before, else now."""
        first = self.first_transfer(gathered=True)
        if first is None:
            return gather_shards(own, self.weight_group, inflight)
        inflight.add(first.works)
        return first

    def post_next(self, inflight: comm.InFlight, backward: bool, then_backward: bool = True) -> None:
        if self.chain is not None:
            self.chain.post_next(self.module, inflight, backward, then_backward)

    def backward_follows_at_once(self, then_backward: bool) -> bool:
        """This forward's own backward runs next (:meth:`LayerChain.next_after`): the forward
        keeps its last shard for it."""
        return (then_backward and self.chain is not None
                and self.chain.next_after(self.module, backward=False, then_backward=True) is self.module)

    def claim_backward_prefetch(self):
        """What the attention before this MLP stashed for its backward (:mod:`prefetch`)."""
        return self.chain.claim(self.module) if self.chain is not None else None


class RotateMLPShards(torch.autograd.Function):
    """y_p = sum_j act(x_p W1_j^T + b1_j) W2_j^T over shards arriving on the ring, summed in
    fp32 inside the fc2 GEMMs and rounded once.

    Each step t: post the ring exchange (this shard on, the next in), compute with shard
    j = (p - t) mod D, take the next shard (without overlap the exchange completed where it
    was posted: :class:`~megatron_tsp.core.comm.Blocking`).
    Backward takes the steps in :meth:`WeightRing.steps` order, this rank's own shard last,
    so that the last gradient hop travels while the owner computes its own part; a
    backward that runs right after this forward takes the forward's last shard, kept in
    ``ctx.last``, instead of receiving it again. The
    layer after this one gets its first shard posted during the last step
    (:mod:`prefetch`); its backward starts by posting the K/V re-gather of the attention
    backward that follows it. Saved: x_p and, per shard, this rank's fc1 output ``h_j`` (together 1/D
    of what one device would save), and its activation ``a_j`` with ``activation_grad``.
    Backward recomputes only the activation from ``h_j``, or nothing with ``a_j``;
    each shard's weight gradients are written into, then added to, the fp32 accumulator that
    travels the ring to their owner (:class:`~megatron_tsp.core.streaming.WeightRing`), and
    the owner adds the sum into megatron's ``main_grad``.
    """

    @staticmethod
    def forward(ctx, args: MLPScheduleArgs, x, *own):
        d_size = args.weight_group.size()
        y = None
        hidden = [None] * d_size
        acts = [None] * d_size if args.activation_grad is not None else []
        then_backward = args.backward_follows and any(ctx.needs_input_grad)
        with args.transport(comm.label("mlp", args.module, "forward")) as inflight:
            ring = WeightRing(own, args.weight_group, inflight, first=args.first_transfer())
            for t in range(d_size):
                shard = ring.shard()
                ring.start(t)
                if t == d_size - 1:
                    args.post_next(inflight, backward=False, then_backward=then_backward)
                h = F.linear(x, *shard[:-1])
                a = args.activation(h)
                y = gemm(a.reshape(-1, a.size(-1)), shard[-1].t(), out=y, accumulate=y is not None)
                hidden[ring.shard_index(t)] = h
                if acts:
                    acts[ring.shard_index(t)] = a
                ring.advance()
        ctx.args = args
        ctx.n_shard = len(own)
        # the shard computed with last, for the backward's step D-1 (WeightRing's ``last``)
        ctx.last = ring.current if args.backward_follows_at_once(then_backward) else None
        # the attention backward that runs right after this backward: its K/V re-gather
        ctx.post_at_backward = args.claim_backward_prefetch()
        ctx.save_for_backward(x, *own, *hidden, *acts)
        return y.view(x.shape[:-1] + (args.hidden_size,)).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        args: MLPScheduleArgs = ctx.args
        x, *rest = ctx.saved_tensors
        d_size = args.weight_group.size()
        own, hidden, acts = rest[: ctx.n_shard], rest[ctx.n_shard : ctx.n_shard + d_size], rest[ctx.n_shard + d_size :]
        dy2d = dy.reshape(-1, dy.size(-1))
        x2d = x.reshape(-1, x.size(-1))
        dx = None
        with args.transport(comm.label("mlp", args.module, "backward")) as inflight:
            ring = WeightRing(own, args.weight_group, inflight, backward=True, first=args.first_transfer(),
                              last=ctx.last)
            ctx.last = None
            ring.first()
            handed = []
            if ctx.post_at_backward is not None:
                handed = ctx.post_at_backward(inflight)
                ctx.post_at_backward = None
            for t in ring.steps():  # 1, ..., D-1, then this rank's own shard
                if t == 0:
                    ring.last_hop()
                    shard = own
                else:
                    ring.advance()
                    shard = ring.shard()
                    ring.start(t)
                if t == d_size - 1:  # the next module's first shard: during this and the own step
                    args.post_next(inflight, backward=True)
                j = ring.shard_index(t)
                if acts:
                    a = acts[j]
                    d_h = args.activation_grad(hidden[j], (dy2d @ shard[-1]).view_as(a))
                else:
                    h = hidden[j].detach().requires_grad_()
                    with torch.enable_grad():
                        a = args.activation(h)
                    (d_h,) = torch.autograd.grad(a, h, (dy2d @ shard[-1]).view_as(a))
                d_h2d = d_h.reshape(-1, d_h.size(-1))
                dx = gemm(d_h2d, shard[0], out=dx, accumulate=dx is not None)
                # the weight gradients last: the accumulator they add into arrives meanwhile
                flat, add = ring.grad_buffer(t)
                w1, *b1, w2 = unpack(flat, own)
                gemm_t(d_h2d, x2d, out=w1, accumulate=add)
                if args.has_bias:
                    if add:
                        b1[0].add_(d_h2d.sum(0, dtype=torch.float32))
                    else:
                        torch.sum(d_h2d, dim=0, dtype=torch.float32, out=b1[0])
                gemm_t(dy2d, a.detach().reshape(-1, a.size(-1)), out=w2, accumulate=add)
                ring.finish_grad(t, flat)
            own_grad = ring.own_grad()
            inflight.hand_over(handed)  # to the attention backward that runs next
        return (None, dx.view_as(x).to(x.dtype), *deliver_grads(own, own_grad))


def per_shard(activation: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, shards: int) -> torch.Tensor:
    """The activation of fc1's output ``h`` ``[..., D r]`` (the shards' columns side by side)
    applied shard by shard, as the ring applies it (a gated unit's two halves are each
    shard's own): ``[..., D c]``, in one call."""
    a = activation(h.view(*h.shape[:-1], shards, h.size(-1) // shards))
    return a.view(*h.shape[:-1], -1)


class GatherMLPShards(torch.autograd.Function):
    """y_p = act(x_p W1^T + b1) W2^T with every shard gathered (:func:`gather_shards`): fc1,
    the activation and fc2 one call each over all D shards, the sum over the ffn dimension
    inside fc2's GEMM (fp32, rounded once).

    Forward: take the gathers (posted by the module before, :mod:`prefetch`), post the next
    module's first transfer, wait, compute. Backward: the gathers again (or the forward's,
    kept where the backward follows it at once), the K/V re-gather of the attention backward
    that runs next posted, then the activation's gradient, fc2's weight gradient, dx and
    fc1's weight gradient, each one call; the weight gradients, fp32, reduce-scattered to
    their owners (:func:`scatter_grads`).
    Saved: x_p and fc1's output for this rank's tokens (and the activation's with
    ``activation_grad``), as the ring saves them; not the gathered weights."""

    @staticmethod
    def forward(ctx, args: MLPScheduleArgs, x, *own):
        d_size = args.weight_group.size()
        then_backward = args.backward_follows and any(ctx.needs_input_grad)
        with args.transport(comm.label("mlp", args.module, "forward")) as inflight:
            full = args.first_gather(own, inflight)
            args.post_next(inflight, backward=False, then_backward=then_backward)
            inflight.wait(full.works)
            h = F.linear(x, full.first, full.bias)
            a = per_shard(args.activation, h, d_size)
            y = torch.mm(a.reshape(-1, a.size(-1)), full.second_t)
        ctx.args = args
        ctx.n_shard = len(own)
        ctx.kept = full._replace(works=[]) if args.backward_follows_at_once(then_backward) else None
        ctx.post_at_backward = args.claim_backward_prefetch()
        ctx.save_for_backward(x, *own, h, *([a] if args.activation_grad is not None else []))
        return y.view(x.shape[:-1] + (args.hidden_size,))

    @staticmethod
    def backward(ctx, dy):
        args: MLPScheduleArgs = ctx.args
        x, *rest = ctx.saved_tensors
        own, h, acts = rest[:ctx.n_shard], rest[ctx.n_shard], rest[ctx.n_shard + 1:]
        d_size = args.weight_group.size()
        dy2d = dy.reshape(-1, dy.size(-1))
        with args.transport(comm.label("mlp", args.module, "backward")) as inflight:
            full, ctx.kept = ctx.kept or args.first_gather(own, inflight), None
            handed = []
            if ctx.post_at_backward is not None:
                handed = ctx.post_at_backward(inflight)
                ctx.post_at_backward = None
            args.post_next(inflight, backward=True)
            inflight.wait(full.works)
            d_a = torch.mm(dy2d, full.second_t.t()).view(*h.shape[:-1], -1)
            if acts:
                a = acts[0]
                d_h = args.activation_grad(h, d_a)
            else:
                h_ = h.detach().requires_grad_()
                with torch.enable_grad():
                    a = per_shard(args.activation, h_, d_size)
                (d_h,) = torch.autograd.grad(a, h_, d_a)
            d_h2d = d_h.reshape(-1, d_h.size(-1))
            x2d = x.reshape(-1, x.size(-1))
            d_second_t = gemm_t(a.detach().reshape(-1, a.size(-1)), dy2d)
            dx = torch.mm(d_h2d, full.first)
            d_first = gemm_t(d_h2d, x2d)
            d_bias = torch.sum(d_h2d, dim=0, dtype=torch.float32) if args.has_bias else None
            own_grad = scatter_grads(own, d_first, d_bias, d_second_t, args.weight_group, inflight)
            inflight.hand_over(handed)  # to the attention backward that runs next
        return (None, dx.view_as(x), *deliver_grads(own, own_grad))
