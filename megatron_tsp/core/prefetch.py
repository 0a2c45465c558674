"""Weight transfers across layer boundaries: the next TSP module's first shard travels while
this one's last stage computes, so that the stream does not drain at every layer boundary.

Each TSP module of a model (attention and MLP, in layer order) registers with the model's
:class:`LayerChain` (the layer spec passes one to all of its modules). A module's first
transfer is the same whichever pass runs it: attention starts with the broadcast of head
group 0's shard, the MLP ring with the exchange of its own shard for its neighbour's. So when
a module reaches its last stage it posts that first transfer for the module that runs next,
and the next module takes it instead of posting its own (:meth:`LayerChain.take`).

Which module runs next is known from the pass and the recompute setting (the same on every
rank, so every rank posts the same collectives in the same order):

* forward: attention(l) -> MLP(l) -> attention(l+1); a recomputed MLP(l) (inside the
  backward pass) -> its own backward;
* backward: MLP(l) -> attention(l); attention(l) -> attention(l-1) when whole layers are
  recomputed (its forward runs again first), else MLP(l-1).

A transfer taken by another module than the one it was posted for (a schedule this does not
foresee) is waited for and dropped: it costs its bytes, never correctness. A posted shard is
the next module's parameters as they are when posted: reading them runs that module's
forward pre-hooks, where megatron's ``--overlap-param-gather`` waits for their all-gather
(:func:`megatron_tsp.core.streaming.run_forward_pre_hooks`).
"""

from __future__ import annotations

import weakref
from typing import List, Optional

import torch


class LayerChain:
    """The TSP modules of one model chunk in layer order, and the transfer posted for the
    next one. ``full_recompute``: whole layers run forward again before their backward."""

    def __init__(self) -> None:
        self._modules: List[weakref.ref] = []
        self._posted = None  # (module it was posted for, transfer)
        self.full_recompute = False

    def register(self, module) -> None:
        self._modules.append(weakref.ref(module))
        self.full_recompute = getattr(module.config, "recompute_granularity", None) == "full"

    def _index(self, module) -> Optional[int]:
        for i, ref in enumerate(self._modules):
            if ref() is module:
                return i
        return None

    def next_after(self, module, backward: bool):
        """The module that runs after ``module``'s pass (``backward``), or None at the end."""
        i = self._index(module)
        if i is None:
            return None
        attention = getattr(module, "is_tsp_attention", False)
        if not backward:
            if not attention and torch._C._current_graph_task_id() != -1:  # MLP recomputed in backward
                return module
            j = i + 1
        elif not attention:
            j = i - 1  # MLP(l) -> attention(l)
        else:
            j = i - 2 if self.full_recompute else i - 1  # attention(l) -> attention(l-1) or MLP(l-1)
        return self._modules[j]() if 0 <= j < len(self._modules) else None

    def post_next(self, module, backward: bool) -> None:
        """During ``module``'s last stage: post the first transfer of the module after it."""
        following = self.next_after(module, backward)
        if following is not None and following.weight_group.size() > 1 and self._posted is None:
            self._posted = (weakref.ref(following), following.post_first_transfer())

    def take(self, module):
        """The transfer posted for ``module`` (None: post your own). One posted for another
        module is waited for and dropped."""
        if self._posted is None:
            return None
        target, transfer = self._posted
        self._posted = None
        if target() is module:
            return transfer
        for work in transfer[-1] if isinstance(transfer[-1], (list, tuple)) else [transfer[-1]]:
            work.wait()
        return None
