"""Transfers across module boundaries: the next TSP module's first shards travel while this
one's last stage computes, so that the stream does not drain at every layer boundary.

Each TSP module of a model (attention and MLP, in layer order) registers with the model's
:class:`LayerChain` (the layer spec passes one to all of its modules). A module's first
transfer is the same whichever pass runs it: attention starts with the broadcasts of the
shards its stream starts with (head groups 0..lookahead), the MLP ring with the exchange of
its own shard for its neighbour's; a short layer's modules (every head group in one call,
:attr:`LayerChain.short_layers`) with the all-gathers of every shard. So when a module
reaches its last stage it posts that first transfer for the module that runs next, on its
own transport (so that without overlap it completes there:
:class:`megatron_tsp.core.comm.Blocking`), and the next module takes it instead of posting
its own (:meth:`LayerChain.take`). A posted shard is the next module's
parameters as they are when posted: reading them runs that module's forward pre-hooks, where
megatron's ``--overlap-param-gather`` waits for their all-gather
(:func:`megatron_tsp.core.streaming.run_forward_pre_hooks`).

Which module runs next is known from the pass and the recompute setting (the same on every
rank, so every rank posts the same collectives in the same order):

* forward: attention(l) -> MLP(l) -> attention(l+1); a recomputed MLP(l) (inside the
  backward pass) -> its own backward, unless several layers are recomputed together (full,
  uniform, ``recompute_num_layers`` > 1: the next layer's attention, recomputed next,
  except after a chunk's last layer, whose transfer is then dropped); the last MLP of a model that is not pipelined (its
  backward follows its forward) -> its own backward, or, with each layer recomputed on its
  own (full, uniform, one layer), the last layer's attention, recomputed first. An MLP
  whose own backward follows keeps the shard it ended with for it (``WeightRing``'s
  ``last``), and posts its backward's first exchange only where that is another (D > 2);
* backward: MLP(l) -> attention(l); attention(l) -> attention(l-1) when whole layers are
  recomputed (its forward runs again first), else MLP(l-1).

The last module's forward also posts, first, what the model asked for at the forward's end
(:meth:`LayerChain.at_forward_end`: the output layer's table gather of TSP's vocabulary
layout), so that it travels ahead of the backward's first transfers.

A transfer taken by another module than the one it was posted for (a schedule this does not
foresee) is waited for and dropped: it costs its bytes, never correctness.

The attention backward's K/V re-gather depends on nothing the backward computes (only on
what its forward saved), so it need not wait for the layer's input gradient either. An
attention forward stashes the posting of its first head group's re-gather
(:meth:`LayerChain.stash`); the MLP of its layer, whose forward runs next, claims it
(:meth:`LayerChain.claim`) and posts it when its own backward starts: the K/V travel while
the MLP's backward computes (beside the ring's own transfers and the attention's first
shards), and the attention backward, which runs right after it, finds them there.
"""

from __future__ import annotations

import weakref
from typing import Callable, List, Optional

import torch

from megatron_tsp.core import comm
from megatron_tsp.core.streaming import GatheredShards


class LayerChain:
    """The TSP modules of one model chunk in layer order, and the transfer posted for the
    next one. ``full_recompute``: whole layers run forward again before their backward."""

    def __init__(self) -> None:
        self._modules: List[weakref.ref] = []
        self._posted = None  # (module it was posted for, transfer)
        self._stashed = None  # (module it was stashed for, the posting of a backward's first transfers)
        self.full_recompute = False
        self.layer_by_layer = False  # full recompute, one layer per checkpoint
        self.chunked = False  # full uniform recompute, several layers per checkpoint
        self.backward_follows = False  # the last module's backward runs right after its forward
        # the stages of the model's TSP attention (D over its head groups per call; each
        # layer's forward says so): with one, its MLPs gather their shards too
        # (TSPMLP.shards_per_call) and the planner prices its K/V transfers as exposed
        self.attention_stages: Optional[int] = None
        self._at_forward_end: Optional[Callable[[], None]] = None

    @property
    def short_layers(self) -> bool:
        """Every head group in one call: nothing in the layer for a transfer to hide behind."""
        return self.attention_stages == 1

    def register(self, module) -> None:
        self._modules.append(weakref.ref(module))
        config = module.config
        self.full_recompute = getattr(config, "recompute_granularity", None) == "full"
        uniform = getattr(config, "recompute_method", None) == "uniform"
        self.layer_by_layer = uniform and getattr(config, "recompute_num_layers", None) == 1
        self.chunked = self.full_recompute and uniform and (getattr(config, "recompute_num_layers", None) or 1) > 1
        self.backward_follows = getattr(config, "pipeline_model_parallel_size", 1) == 1

    def _index(self, module) -> Optional[int]:
        for i, ref in enumerate(self._modules):
            if ref() is module:
                return i
        return None

    def next_after(self, module, backward: bool, then_backward: bool = True):
        """The module that runs after ``module``'s pass (``backward``), or None at the end.
        ``then_backward``: a backward pass follows this forward (else the forward's end is
        the end)."""
        i = self._index(module)
        if i is None:
            return None
        attention = getattr(module, "is_tsp_attention", False)
        if not backward:
            if not attention and torch._C._current_graph_task_id() != -1 and not self.chunked:
                return module  # an MLP recomputed in backward, alone or as the last of its layer
            j = i + 1
            if j == len(self._modules) and then_backward and self.backward_follows and not attention:
                if not self.full_recompute:
                    return module
                return self._modules[-2]() if self.layer_by_layer and len(self._modules) > 1 else None
        elif not attention:
            j = i - 1  # MLP(l) -> attention(l)
        else:
            j = i - 2 if self.full_recompute else i - 1  # attention(l) -> attention(l-1) or MLP(l-1)
        return self._modules[j]() if 0 <= j < len(self._modules) else None

    def at_forward_end(self, post: Optional[Callable[[], None]]) -> None:
        """``post()`` runs once, when the last module's forward reaches its last stage, before
        that module posts what follows it (the model's output layer's table gather:
        :mod:`megatron_tsp.core.vocab`); None: nothing."""
        self._at_forward_end = post

    def post_next(self, module, inflight: comm.InFlight, backward: bool, then_backward: bool = True) -> None:
        """During ``module``'s last stage: post the first transfer of the module after it with
        ``module``'s transport ``inflight``, which hands it over to that module. A transfer
        is a tuple whose last item is its works."""
        if not backward and self._at_forward_end is not None and self._index(module) == len(self._modules) - 1:
            post, self._at_forward_end = self._at_forward_end, None
            post()
        following = self.next_after(module, backward, then_backward)
        if following is not None and following.weight_group.size() > 1 and self._posted is None:
            transfer = (following.post_first_transfer(inflight, after_own_forward=True) if following is module
                        else following.post_first_transfer(inflight))
            if transfer is not None:
                inflight.hand_over(transfer[-1])
                self._posted = (weakref.ref(following), transfer)

    def stash(self, module, post) -> None:
        """After ``module``'s forward: ``post()`` starts the first transfers of its backward,
        for the module whose forward runs next and whose backward runs right before it
        (attention(l) -> MLP(l)) to claim. Nothing is stashed when that module is not a
        TSP one, so that nothing holds the forward's saved tensors longer."""
        i = self._index(module)
        following = self._modules[i + 1]() if i is not None and i + 1 < len(self._modules) else None
        mlp = following is not None and not getattr(following, "is_tsp_attention", False)
        self._stashed = (weakref.ref(following), post) if mlp else None

    def claim(self, module):
        """In ``module``'s forward: what was stashed for it, to call when its backward starts
        (None: nothing)."""
        if self._stashed is None:
            return None
        target, post = self._stashed
        self._stashed = None
        return post if target() is module else None

    def take(self, module, gathered: bool = False):
        """The transfer posted for ``module`` (None: post your own): every shard's gathers
        with ``gathered`` (:class:`~megatron_tsp.core.streaming.GatheredShards`), else the
        stream's or the ring's first transfer. One posted for another module, or of the other
        kind (posted before the layers' length changed), is waited for and dropped."""
        if self._posted is None:
            return None
        target, transfer = self._posted
        self._posted = None
        if target() is module and isinstance(transfer, GatheredShards) == gathered:
            return transfer
        comm.finish(transfer[-1])
        return None
