"""torch FSDP2 (the ``cp-fsdp`` mode, Megatron-LM's ``--use-torch-fsdp2``) in the memory planner.

FakeTensorMode cannot build FSDP2 (its device mesh reads values; its parameters are DTensors),
so the planner runs the same layers under DDP with the distributed optimizer over the same
data-parallel x context-parallel ranks (ZeRO-1: the optimizer state is 1/D either way), and
this module turns that plan into FSDP2's. Per rank, with D the FSDP group's size and the
*units* megatron's wrapper shards separately (``TorchFullyShardedDataParallel``: every
``TransformerLayer``, the embedding, and the root, which holds the rest: the output layer and
the final norm):

* ``parameters``: 1/D of every unit, in the parameters' dtype, not all of them;
* ``gradients``: 1/D, in the parameters' dtype (FSDP2 accumulates each reduce-scattered
  gradient into its shard; megatron's wrapper sets no reduce dtype), not DDP's buffer of all
  of them (fp32 under bf16);
* ``communication`` at the peak: what FSDP2 holds unsharded in backward, the unit running
  and the one its prefetch has gathered (two layers, or the root and the last layer: megatron's
  wrapper reshards the root after forward too);
* ``temporaries``: the running layer's unsharded gradient before its reduce-scatter;
* collectives on ``dp_cp`` (in place of ZeRO-1's gradient reduce-scatter and parameter
  all-gather): an all-gather of every unit in forward and again in backward (a layer
  recomputed under full recompute runs inside its backward's gather), and a reduce-scatter
  of every unit's gradient (checked against a real step: ``tests/test_memory.py``).

These are modelled, not planned op by op: the plan's peak is moved by the sum of the changes
(the categories changed are static through the step but for the transients, which are added at
the peak). FSDP2's own copy-in and copy-out kernels are not counted among the launches.
"""

from __future__ import annotations

import copy
from typing import Dict

import torch

from megatron_tsp.measure import counts
from megatron_tsp.measure.tracker import GIB


def planned_as(args):
    """The arguments the planner runs for an FSDP2 run: DDP with the distributed optimizer."""
    planned = copy.copy(args)
    planned.use_torch_fsdp2, planned.use_distributed_optimizer = False, True
    return planned


def unit_bytes(model: torch.nn.Module) -> Dict[str, object]:
    """Bytes of parameters of each unit FSDP2 shards separately (megatron's wrapper): every
    transformer layer (a list), the embedding, and the root (all the rest)."""
    def size(module):
        return sum(p.numel() * p.element_size() for p in module.parameters())

    layers = [size(layer) for layer in model.decoder.layers] if hasattr(model, "decoder") else []
    embedding = size(model.embedding) if hasattr(model, "embedding") else 0
    return {"layers": layers, "embedding": embedding, "root": size(model) - sum(layers) - embedding}


def sharded(plan: Dict, units: Dict, group_size: int) -> Dict:
    """``plan`` (of :func:`planned_as`'s run) as FSDP2 over ``group_size`` ranks (module
    docstring); the changes are under ``fsdp``."""
    d = group_size
    layers, embedding, root = units["layers"], units["embedding"], units["root"]
    total = sum(layers) + embedding + root
    layer = max(layers, default=0)
    by = dict(plan["by_category_gib"])
    change = {
        "parameters": total / d / GIB - by["parameters"],
        "gradients": total / d / GIB - by["gradients"],
        "communication": (layer + max(layer, root)) / GIB,
        "temporaries": layer / GIB,
    }
    for category, delta in change.items():
        by[category] += delta
    share = (d - 1) / d

    def entry(calls, nbytes):
        moved = int(share * nbytes)
        return {"calls": calls, "bytes_sent": moved, "bytes_received": moved}

    comm = dict(plan["comm"])
    # the plan's other traffic there stays (the loss's all-reduce); ZeRO-1's goes
    group = {phase: {p: e for p, e in prims.items() if p not in ("all_gather", "reduce_scatter")}
             for phase, prims in comm.pop("dp_cp", {}).items()}
    if d > 1:
        units_n = len(layers) + 2
        group.setdefault("forward", {})["all_gather"] = entry(units_n, total)
        group.setdefault("backward", {}).update(all_gather=entry(units_n, total), reduce_scatter=entry(units_n, total))
    if any(group.values()):
        comm["dp_cp"] = {phase: prims for phase, prims in group.items() if prims}
    return dict(
        plan,
        by_category_gib=by,
        peak_gib=plan["peak_gib"] + sum(change.values()),
        static_gib=plan["static_gib"] + change["parameters"] + change["gradients"],
        comm=comm,
        comm_bytes_received=counts.totals(comm),
        fsdp={"group_size": d, "unit_bytes": units, "modelled_gib": change},
    )
