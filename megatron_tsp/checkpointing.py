"""Checkpoints through megatron-core ``dist_checkpointing``.

TSP shards have the tensor-parallel layout, so a checkpoint is keyed exactly like a TP(+SP)
checkpoint of the same model: one saved by a TSP run loads into a TP run, into a different
TSP size, or into a different pipeline split, and back. The optimizer state is saved in
megatron's ``fully_reshardable`` format for the same reason. Per-rank objects (RNG states)
are restored only into a job of the same world size.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron_tsp.compat import enable_torch_adam_checkpoints
from megatron_tsp.training import unwrap

OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _model_state(model: List[torch.nn.Module]) -> Dict[str, Any]:
    if len(model) != 1:
        raise NotImplementedError("checkpointing of virtual-pipeline model chunks is not implemented")
    return {"model": unwrap(model[0]).sharded_state_dict()}


def _per_rank(obj: Any) -> ShardedObject:
    return ShardedObject("per_rank", obj, (dist.get_world_size(),), (dist.get_rank(),), replica_id=0)


def _materialize_optimizer_state(optimizer) -> None:
    """megatron-core 0.16.1's ``DistributedOptimizer.state_dict()`` asserts on an optimizer
    that has never stepped when it runs on torch's Adam (no TransformerEngine or apex). Give
    it the placeholder state megatron itself creates before loading its fsdp format; the
    load overwrites every value (parameters included)."""
    enable_torch_adam_checkpoints()
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(opt, "_init_optimizer_states_with_dummy_values") and not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()


TRACKER = "latest_checkpointed_iteration.txt"


def iteration_dir(root: str, iteration: int) -> str:
    """Megatron-LM's layout: ``ROOT/iter_0000010`` plus a tracker file naming the latest."""
    return os.path.join(root, f"iter_{iteration:07d}")


def latest(root: Optional[str]) -> Optional[str]:
    """The latest checkpoint under ``root`` (Megatron-LM layout), or None."""
    tracker = os.path.join(root or "", TRACKER)
    if not root or not os.path.isfile(tracker):
        return None
    with open(tracker, encoding="utf-8") as f:
        return iteration_dir(root, int(f.read().strip()))


def save_iteration(root: str, iteration: int, *args, **kwargs) -> str:
    """:func:`save` into ``ROOT/iter_N``, then point the tracker at it."""
    path = iteration_dir(root, iteration)
    save(path, *args, **kwargs)
    if dist.get_rank() == 0:
        with open(os.path.join(root, TRACKER), "w", encoding="utf-8") as f:
            f.write(str(iteration))
    dist.barrier()
    return path


def save(path: str, model: List[torch.nn.Module], optimizer=None,
         common: Optional[Dict[str, Any]] = None, per_rank: Any = None) -> None:
    """Save model (and optimizer) shards, ``common`` (plain objects, from rank 0) and
    ``per_rank`` (one object per rank)."""
    os.makedirs(path, exist_ok=True)
    state = _model_state(model)
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, metadata=OPTIMIZER_METADATA)
    state.update(common or {})
    state["world_size"] = dist.get_world_size()
    state["has_per_rank"] = per_rank is not None
    if per_rank is not None:
        state["per_rank"] = _per_rank(per_rank)
    dist_checkpointing.save(state, path)
    dist.barrier()


def load(path: str, model: List[torch.nn.Module], optimizer=None,
         per_rank: bool = False) -> Tuple[Dict[str, Any], Any]:
    """Load into ``model`` (and ``optimizer``); return (common entries, this rank's object or
    None when it was not saved or the world size differs)."""
    common = dist_checkpointing.load_common_state_dict(path)
    state = _model_state(model)
    if optimizer is not None:
        _materialize_optimizer_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=True, metadata=OPTIMIZER_METADATA)
    with_rank_state = per_rank and common.get("has_per_rank") and common.get("world_size") == dist.get_world_size()
    if with_rank_state:
        state["per_rank"] = _per_rank(None)
    loaded = dist_checkpointing.load(state, path)
    unwrap(model[0]).load_state_dict(loaded.pop("model"))
    if optimizer is not None:
        optimizer.load_state_dict(loaded.pop("optimizer"))
    rank_state = loaded.pop("per_rank", None) if with_rank_state else None
    for key in ("model", "optimizer", "per_rank"):
        common.pop(key, None)
    return common, rank_state
