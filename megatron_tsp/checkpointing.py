"""Checkpoints through megatron-core ``dist_checkpointing``.

TSP shards have the tensor-parallel layout, so a checkpoint is keyed exactly like a TP(+SP)
checkpoint of the same model: one saved by a TSP run loads into a TP run, into a different
TSP size, or into a different pipeline split, and back. The optimizer state is saved in
megatron's ``fully_reshardable`` format for the same reason.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

import torch
from megatron.core import dist_checkpointing

from megatron_tsp.compat import enable_torch_adam_checkpoints

OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _model_state(model: List[torch.nn.Module]) -> Dict[str, Any]:
    if len(model) != 1:
        raise NotImplementedError("checkpointing of virtual-pipeline model chunks is not implemented")
    return {"model": model[0].module.sharded_state_dict()}


def _materialize_optimizer_state(optimizer) -> None:
    """megatron-core 0.16.1's ``DistributedOptimizer.state_dict()`` asserts on an optimizer
    that has never stepped when it runs on torch's Adam (no TransformerEngine or apex). Give
    it the placeholder state megatron itself creates before loading its fsdp format; the
    load overwrites every value (parameters included)."""
    enable_torch_adam_checkpoints()
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(opt, "_init_optimizer_states_with_dummy_values") and not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()


def save(path: str, model: List[torch.nn.Module], optimizer=None,
         common: Optional[Dict[str, Any]] = None) -> None:
    """Save model (and optimizer) shards plus ``common`` (plain objects, from rank 0)."""
    os.makedirs(path, exist_ok=True)
    state = _model_state(model)
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, metadata=OPTIMIZER_METADATA)
    state.update(common or {})
    dist_checkpointing.save(state, path)
    torch.distributed.barrier()


def load(path: str, model: List[torch.nn.Module], optimizer=None) -> Dict[str, Any]:
    """Load into ``model`` (and ``optimizer``); return the common entries saved with it."""
    state = _model_state(model)
    if optimizer is not None:
        _materialize_optimizer_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=True, metadata=OPTIMIZER_METADATA)
    loaded = dist_checkpointing.load(state, path)
    model[0].module.load_state_dict(loaded.pop("model"))
    if optimizer is not None:
        optimizer.load_state_dict(loaded.pop("optimizer"))
    return loaded
