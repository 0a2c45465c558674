"""Count every collective a training step issues, TSP's and megatron's alike.

:func:`count_collectives` wraps the ``torch.distributed`` calls used by megatron-core
(tensor/sequence/context parallel mappings, DDP, the distributed optimizer, pipeline p2p)
and by ``megatron_tsp.core.comm``, and records per process group, primitive and phase
(forward/backward/other) the logical bytes this rank sends and receives, with the same
conventions as :mod:`megatron_tsp.core.comm`. Groups are named after megatron's parallel state
(under TSP the tensor-parallel group is TSP's, named ``tsp``), so the same code accounts TSP, TP, TP+SP and TP x CP.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Callable, Dict, Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from megatron_tsp.core import parallel_state as tsp_state
from megatron_tsp.core.comm import logical_bytes, traffic
from megatron_tsp.measure.distributed import observed

Records = Dict[str, Dict[str, Dict[str, Dict[str, int]]]]  # group -> phase -> primitive -> counts


def group_names() -> Dict[int, str]:
    """id(group) -> name for megatron's (and TSP's) process groups."""
    getters = {  # the first name of a group wins: under TSP the tensor-parallel group is TSP's
        "tsp": lambda: tsp_state.get_tsp_group(),
        "tp": lambda: mpu.get_tensor_model_parallel_group(),
        "cp": lambda: mpu.get_context_parallel_group(),
        "tp_cp": lambda: mpu.get_tensor_and_context_parallel_group(),  # the MoE router's aux-loss sums
        "dp": lambda: mpu.get_data_parallel_group(),
        "dp_cp": lambda: mpu.get_data_parallel_group(with_context_parallel=True),
        "pp": lambda: mpu.get_pipeline_model_parallel_group(),
        "mp": lambda: mpu.get_model_parallel_group(),
        "dist_opt": lambda: mpu.get_intra_distributed_optimizer_instance_group(check_initialized=False),
        "embd": lambda: mpu.get_embedding_group(check_initialized=False),
        "tsp_weight": lambda: tsp_state.get_weight_group(),
        # mixture-of-experts: the token all-to-all, and the experts' gradient reduce
        "ep": lambda: mpu.get_expert_model_parallel_group(),
        "edp": lambda: mpu.get_expert_data_parallel_group(),
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


class _Recorder:
    """Counts of one :func:`count_collectives` block. Its methods are the hooks, one per
    ``torch.distributed`` call (:data:`HOOKS`), each called with that call's arguments in
    torch's order (those past the ones a hook reads, ``async_op``, in ``*_``);
    bytes follow :func:`megatron_tsp.core.comm.traffic`."""

    def __init__(self, on_output: Optional[Callable[[torch.Tensor], None]]):
        self.records: Records = defaultdict(lambda: defaultdict(lambda: defaultdict(
            lambda: {"calls": 0, "bytes_sent": 0, "bytes_received": 0})))
        self.names = group_names()
        self.on_output = on_output

    def record(self, group, primitive: str, sent: int, received: int) -> None:
        name = self.names.get(id(group), "world" if group is None else f"group{group.size()}")
        entry = self.records[name][_phase()][primitive]
        entry["calls"] += 1
        entry["bytes_sent"] += sent
        entry["bytes_received"] += received

    def collective(self, primitive: str, n: int, group, root: bool = False) -> None:
        self.record(group, primitive, *traffic(primitive, n, dist.get_world_size(group), root))

    def received(self, t) -> None:
        if self.on_output is not None:
            for x in t if isinstance(t, (list, tuple)) else [t]:
                self.on_output(x)

    def all_gather(self, output, inp, group=None, *_, **kw):
        self.collective("all_gather", logical_bytes(inp), group)
        self.received(output)

    def reduce_scatter(self, output, inp, op=None, group=None, *_, **kw):
        self.collective("reduce_scatter", logical_bytes(output), group)
        self.received(output)

    def all_reduce(self, tensor, op=None, group=None, *_, **kw):
        self.collective("all_reduce", logical_bytes(tensor), group)

    def broadcast(self, tensor, src=None, group=None, *_, **kw):
        is_src = kw.get("group_src", None) == dist.get_rank(group) if src is None else src == dist.get_rank()
        self.collective("broadcast", logical_bytes(tensor), group, root=is_src)
        if not is_src:
            self.received(tensor)

    def reduce(self, tensor, dst=None, op=None, group=None, *_, **kw):
        is_dst = kw.get("group_dst", None) == dist.get_rank(group) if dst is None else dst == dist.get_rank()
        self.collective("reduce", logical_bytes(tensor), group, root=is_dst)

    def all_to_all_single(self, output, inp, output_split_sizes=None, input_split_sizes=None, group=None, *_,
                          **kw):
        size, rank = dist.get_world_size(group), dist.get_rank(group)

        def foreign(t, splits):  # the bytes of ``t`` that are not this rank's own slice
            whole = logical_bytes(t)
            if splits is None or len(splits) == 0:
                return whole - whole // size
            splits = [int(s) for s in splits]  # megatron hands tensors on the CPU
            return whole - whole * splits[rank] // max(sum(splits), 1)

        self.record(group, "all_to_all", foreign(inp, input_split_sizes), foreign(output, output_split_sizes))
        self.received(output)

    def batch_isend_irecv(self, ops):
        by_group = defaultdict(lambda: [0, 0])
        for op in ops:
            recv = op.op in (dist.irecv, dist.recv)
            by_group[id(op.group)][1 if recv else 0] += logical_bytes(op.tensor)
            if recv:
                self.received(op.tensor)
        for op in {id(o.group): o for o in ops}.values():
            self.record(op.group, "send_recv", *by_group[id(op.group)])


# torch.distributed name -> hook. Point-to-point goes through batch_isend_irecv (megatron's
# default batch_p2p_comm and TSP's ring); P2POp checks its op against the unwrapped isend/irecv.
HOOKS = {
    "all_gather_into_tensor": _Recorder.all_gather,
    "all_gather_single": _Recorder.all_gather,
    "_all_gather_base": _Recorder.all_gather,
    "all_gather": _Recorder.all_gather,
    "reduce_scatter_tensor": _Recorder.reduce_scatter,
    "reduce_scatter_single": _Recorder.reduce_scatter,
    "_reduce_scatter_base": _Recorder.reduce_scatter,
    "all_reduce": _Recorder.all_reduce,
    "broadcast": _Recorder.broadcast,
    "reduce": _Recorder.reduce,
    "all_to_all_single": _Recorder.all_to_all_single,
    "batch_isend_irecv": _Recorder.batch_isend_irecv,
}


@contextlib.contextmanager
def count_collectives(on_output: Optional[Callable[[torch.Tensor], None]] = None) -> Iterator[Records]:
    """Record the collectives issued inside the block; ``on_output`` sees every receive buffer."""
    recorder = _Recorder(on_output)
    with observed(lambda name, *args, **kwargs: HOOKS[name](recorder, *args, **kwargs), list(HOOKS)):
        yield recorder.records


def _tensors(args, kwargs) -> Iterator[torch.Tensor]:
    for value in list(args) + list(kwargs.values()):
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, dist.P2POp):
                item = item.tensor
            if isinstance(item, torch.Tensor):
                yield item


@contextlib.contextmanager
def devices_checked(device: torch.device) -> Iterator[None]:
    """Every collective inside the block must move tensors on ``device``'s type: a CPU tensor
    in a collective of a GPU job is what NCCL/RCCL refuse at run time ("No backend type
    associated with device type cpu"), found here on any machine (the fake-CUDA runs)."""
    def check(name, *args, **kwargs):
        for t in _tensors(args, kwargs):
            if t.device.type != device.type:
                raise RuntimeError(f"torch.distributed.{name} on a {t.device.type} tensor {tuple(t.shape)} in a job "
                                   f"whose collectives run on {device.type}")

    with observed(check, list(HOOKS)):
        yield


def totals(records: Records, key: str = "bytes_received") -> Dict[str, Dict[str, int]]:
    """group -> phase -> bytes summed over primitives."""
    return {g: {ph: sum(e[key] for e in prims.values()) for ph, prims in phases.items()}
            for g, phases in records.items()}


def by_phase(records: Records, key: str = "bytes_received") -> Dict[str, Dict[str, int]]:
    """phase -> primitive -> bytes summed over groups (one layer's traffic, as docs/design.md
    section 8 tabulates it)."""
    out: Dict[str, Dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for phases in records.values():
        for phase, prims in phases.items():
            for primitive, entry in prims.items():
                out[phase][primitive] += entry[key]
    return {phase: dict(prims) for phase, prims in out.items()}


def as_dict(records: Records) -> Dict:
    return {g: {ph: {p: dict(e) for p, e in prims.items()} for ph, prims in phases.items()}
            for g, phases in records.items()}
