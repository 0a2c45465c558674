"""Count every collective a training step issues, TSP's and megatron's alike.

:func:`count_collectives` wraps the ``torch.distributed`` calls used by megatron-core
(tensor/sequence/context parallel mappings, DDP, the distributed optimizer, pipeline p2p)
and by ``megatron_tsp.comm``, and records per process group, primitive and phase
(forward/backward/other) the logical bytes this rank sends and receives, with the same
conventions as :mod:`megatron_tsp.comm`. Groups are named after megatron's parallel state
(``tp`` is the TSP group under TSP), so the same code accounts TSP, TP, TP+SP and TP x CP.
"""

from __future__ import annotations

import contextlib
import sys
from collections import defaultdict
from typing import Callable, Dict, Iterator, Optional

import torch
import torch.distributed as dist

Records = Dict[str, Dict[str, Dict[str, Dict[str, int]]]]  # group -> phase -> primitive -> counts


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size()


def group_names() -> Dict[int, str]:
    """id(group) -> name for megatron's (and TSP's) process groups."""
    from megatron.core import parallel_state as mpu

    from megatron_tsp import parallel_state as tsp_state

    getters = {
        "tp": lambda: mpu.get_tensor_model_parallel_group(),
        "cp": lambda: mpu.get_context_parallel_group(),
        "dp": lambda: mpu.get_data_parallel_group(),
        "dp_cp": lambda: mpu.get_data_parallel_group(with_context_parallel=True),
        "pp": lambda: mpu.get_pipeline_model_parallel_group(),
        "mp": lambda: mpu.get_model_parallel_group(),
        "dist_opt": lambda: mpu.get_intra_distributed_optimizer_instance_group(check_initialized=False),
        "embd": lambda: mpu.get_embedding_group(check_initialized=False),
        "tsp_weight": lambda: tsp_state._TSP_WEIGHT_GROUP,
    }
    names: Dict[int, str] = {id(dist.group.WORLD): "world"}
    for name, get in getters.items():
        try:
            group = get()
        except (AssertionError, RuntimeError):
            continue
        if group is not None and id(group) not in names:
            names[id(group)] = name
    return names


def _phase() -> str:
    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"


@contextlib.contextmanager
def count_collectives(on_output: Optional[Callable[[torch.Tensor], None]] = None) -> Iterator[Records]:
    """Record the collectives issued inside the block; ``on_output`` sees every receive buffer."""
    records: Records = defaultdict(lambda: defaultdict(lambda: defaultdict(
        lambda: {"calls": 0, "bytes_sent": 0, "bytes_received": 0})))
    names = group_names()

    def record(group, primitive, sent, received):
        name = names.get(id(group), "world" if group is None else f"group{group.size()}")
        entry = records[name][_phase()][primitive]
        entry["calls"] += 1
        entry["bytes_sent"] += sent
        entry["bytes_received"] += received

    def size(group):
        return dist.get_world_size(group)

    def rank(group):
        return dist.get_rank(group)

    def out(t):
        if on_output is not None:
            for x in t if isinstance(t, (list, tuple)) else [t]:
                on_output(x)

    def all_gather_tensor(output, inp, group=None, **kw):
        n = (size(group) - 1) * _nbytes(inp)
        record(group, "all_gather", n, n)
        out(output)

    def all_gather_list(outputs, inp, group=None, **kw):
        n = (size(group) - 1) * _nbytes(inp)
        record(group, "all_gather", n, n)
        out(outputs)

    def reduce_scatter_tensor(output, inp, op=None, group=None, **kw):
        n = (size(group) - 1) * _nbytes(output)
        record(group, "reduce_scatter", n, n)
        out(output)

    def all_reduce(tensor, op=None, group=None, **kw):
        n = 2 * (size(group) - 1) * _nbytes(tensor) // max(size(group), 1)  # ring all-reduce
        record(group, "all_reduce", n, n)

    def broadcast(tensor, src=None, group=None, **kw):
        n = _nbytes(tensor)
        is_src = kw.get("group_src", None) == rank(group) if src is None else src == dist.get_rank()
        record(group, "broadcast", (size(group) - 1) * n if is_src else 0, 0 if is_src else n)
        if not is_src:
            out(tensor)

    def reduce(tensor, dst=None, op=None, group=None, **kw):
        n = _nbytes(tensor)
        is_dst = kw.get("group_dst", None) == rank(group) if dst is None else dst == dist.get_rank()
        record(group, "reduce", 0 if is_dst else n, (size(group) - 1) * n if is_dst else 0)

    def batch_isend_irecv(ops):
        by_group = defaultdict(lambda: [0, 0])
        for op in ops:
            recv = op.op in (dist.irecv, dist.recv)
            by_group[id(op.group)][1 if recv else 0] += _nbytes(op.tensor)
            if recv:
                out(op.tensor)
        for op in {id(o.group): o for o in ops}.values():
            sent, received = by_group[id(op.group)]
            record(op.group, "send_recv", sent, received)

    hooks = {
        "all_gather_into_tensor": all_gather_tensor,
        "all_gather_single": all_gather_tensor,
        "_all_gather_base": all_gather_tensor,
        "all_gather": all_gather_list,
        "reduce_scatter_tensor": reduce_scatter_tensor,
        "reduce_scatter_single": reduce_scatter_tensor,
        "_reduce_scatter_base": reduce_scatter_tensor,
        "all_reduce": all_reduce,
        "broadcast": broadcast,
        "reduce": reduce,
        # point-to-point goes through batch_isend_irecv (megatron's default batch_p2p_comm
        # and TSP's ring); P2POp checks its op against the unwrapped isend/irecv.
        "batch_isend_irecv": batch_isend_irecv,
    }
    originals = {name: getattr(dist, name) for name in hooks if hasattr(dist, name)}

    def wrap(name, original):
        hook = hooks[name]

        def wrapper(*args, **kwargs):
            hook(*args, **kwargs)
            return original(*args, **kwargs)

        wrapper.__wrapped__ = original
        return wrapper

    wrappers = {id(original): wrap(name, original) for name, original in originals.items()}
    # Calls as torch.distributed.<name>, and names megatron bound at import
    # (tensor_parallel/mappings.py and distributed/param_and_grad_buffer.py keep
    # ``dist_all_gather_func = torch.distributed.all_gather_into_tensor``).
    patched = [(dist, name, original) for name, original in originals.items()]
    for mod_name, mod in list(sys.modules.items()):
        if mod is not None and mod_name.startswith("megatron.") and mod is not dist:
            for attr, value in list(vars(mod).items()):
                if callable(value) and id(value) in wrappers:
                    patched.append((mod, attr, value))
    for owner, attr, original in patched:
        setattr(owner, attr, wrappers[id(original)])
    try:
        yield records
    finally:
        for owner, attr, original in patched:
            setattr(owner, attr, original)


def totals(records: Records, key: str = "bytes_received") -> Dict[str, Dict[str, int]]:
    """group -> phase -> bytes summed over primitives."""
    return {g: {ph: sum(e[key] for e in prims.values()) for ph, prims in phases.items()}
            for g, phases in records.items()}


def as_dict(records: Records) -> Dict:
    return {g: {ph: {p: dict(e) for p, e in prims.items()} for ph, prims in phases.items()}
            for g, phases in records.items()}
