"""TSP process groups beside TP, PP and DP.

TSP occupies megatron-core's tensor-parallel slot (docs/design.md section 6): to megatron-core a
TSP job of size D is ``tensor_model_parallel_size=D`` with sequence parallelism, so its
data-parallel groups, DDP, optimizers, grad-norm de-duplication and checkpoint sharding
all work unchanged. This module creates that layout and registers the group under its own
name, so that TSP code never has to say "tensor parallel" when it means TSP.

Rank layout (innermost first): ``tsp-dp-pp``. World 8, tsp 2, pp 2 gives TSP groups
[0,1] [2,3] [4,5] [6,7], DP groups [0,2] [1,3] [4,6] [5,7], PP groups [0,4] [1,5] ...
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_tsp.core.sizes import ParallelSizes

_TSP_GROUP: Optional[dist.ProcessGroup] = None
# Same ranks as _TSP_GROUP, a second communicator: weight-shard traffic (broadcasts, ring
# sends, gradient reduces) must not queue behind the K/V all-gathers on the same stream.
_TSP_WEIGHT_GROUP: Optional[dist.ProcessGroup] = None
_INITIALIZED = False  # by initialize_model_parallel (any layout) or adopt_megatron_groups
# The ring MLP in a plain tensor-parallel model (--ring-mlp): its weight-traffic communicator
# over the tensor-parallel ranks.
_RING_WEIGHT_GROUP: Optional[dist.ProcessGroup] = None


@dataclasses.dataclass(init=False, repr=False)
class TSPProcessGroupCollection(ProcessGroupCollection):
    """megatron-core's process-group collection plus the TSP group as ``.tsp``.

    ``.tp`` is the same group: megatron modules that read ``pg_collection.tp`` (embedding,
    output layer, norms' gradient reduction) see TSP as tensor parallelism.
    """

    tsp: dist.ProcessGroup = dataclasses.field(init=False)
    tsp_weight: dist.ProcessGroup = dataclasses.field(init=False)


def initialize_model_parallel(
    tsp_size: int = 1, pipeline_model_parallel_size: int = 1, device: Optional[torch.device] = None,
    ring_mlp: bool = False, **megatron_kwargs
) -> None:
    """Set up megatron-core's parallel state with TSP on the tensor-parallel slot.

    ``megatron_kwargs`` go to ``megatron.core.parallel_state.initialize_model_parallel``
    (for example ``virtual_pipeline_model_parallel_size``, ``distributed_timeout_minutes``).
    With ``tsp_size == 1`` a ``tensor_model_parallel_size`` > 1 gives a plain TP baseline.
    ``device``: the device of this rank's collectives; the communicators of every group a
    step talks on (TSP's and megatron's) are then created now (:func:`warm_up`) rather than
    in the middle of the first step. ``ring_mlp``
    (plain TP): the ring MLP's communicator over the tensor-parallel ranks
    (:func:`resolve_ring_groups`).
    """
    global _TSP_GROUP, _TSP_WEIGHT_GROUP, _INITIALIZED, _RING_WEIGHT_GROUP
    if _INITIALIZED or mpu.model_parallel_is_initialized():
        raise ValueError(
            "model parallel state is already initialized; call "
            "megatron_tsp.destroy_model_parallel() before initializing it again"
        )
    if not dist.is_initialized():
        raise ValueError(
            "torch.distributed is not initialized; call torch.distributed.init_process_group "
            "(or launch with torchrun) before megatron_tsp.initialize_model_parallel"
        )
    tp = megatron_kwargs.pop("tensor_model_parallel_size", 1)
    if tsp_size > 1:  # experts fold onto the TSP group whole (megatron's default would split them over it)
        megatron_kwargs.setdefault("expert_tensor_parallel_size", 1)
    cp = megatron_kwargs.get("context_parallel_size", 1)
    sizes = ParallelSizes(tsp=tsp_size, tp=tp, cp=cp, pp=pipeline_model_parallel_size, world=dist.get_world_size())
    sizes.validate("the processes of torch.distributed")
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=sizes.tensor_slot,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        order="tp-cp-ep-dp-pp",
        **megatron_kwargs,
    )
    _INITIALIZED = True
    # The TSP group is the tensor-parallel group; it does not exist as such when TSP is off
    # and plain TP is on (a TSP module there would be a mistake).
    weight_group = None
    if tp == 1:
        _TSP_GROUP = mpu.get_tensor_model_parallel_group()
        _TSP_WEIGHT_GROUP = weight_group = _new_weight_group(_TSP_GROUP, megatron_kwargs)
    elif ring_mlp:
        _RING_WEIGHT_GROUP = weight_group = _new_weight_group(mpu.get_tensor_model_parallel_group(), megatron_kwargs)
    if device is not None:
        weights = [weight_group] if weight_group is not None else []
        warm_up(device, _megatron_groups() + weights, rings=weights + [mpu.get_pipeline_model_parallel_group()])


def adopt_megatron_groups(tsp_size: int, ring_mlp: bool = False) -> None:
    """Register TSP (``tsp_size`` > 1) or the ring MLP (``ring_mlp``) on a megatron parallel
    state someone else initialised with ``tensor_model_parallel_size = tsp_size`` or the
    ring's TP size (Megatron-LM's ``initialize_megatron``). Collective (creates the
    weight-traffic groups); a second call is a no-op."""
    global _TSP_GROUP, _TSP_WEIGHT_GROUP, _INITIALIZED, _RING_WEIGHT_GROUP
    if _INITIALIZED or _RING_WEIGHT_GROUP is not None:
        return
    tp = mpu.get_tensor_model_parallel_world_size()
    group = mpu.get_tensor_model_parallel_group()
    # Megatron-LM has set the current device already; its collectives run there
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else \
        torch.device("cpu")
    if ring_mlp and tsp_size == 1:
        _RING_WEIGHT_GROUP = _new_weight_group(group, {})
        warm_up(device, [group, _RING_WEIGHT_GROUP], rings=[_RING_WEIGHT_GROUP])
        return
    if tp != tsp_size:
        raise ValueError(f"--tsp-size {tsp_size} but megatron's tensor-parallel size is {tp}; "
                         "launch through megatron_tsp.megatron_lm.translate_argv")
    _INITIALIZED = True
    _TSP_GROUP = group
    _TSP_WEIGHT_GROUP = _new_weight_group(group, {})
    warm_up(device, [_TSP_GROUP, _TSP_WEIGHT_GROUP], rings=[_TSP_WEIGHT_GROUP])


def warm_up(device: torch.device, groups: Sequence[dist.ProcessGroup],
            rings: Sequence[dist.ProcessGroup] = ()) -> None:
    """Create communicators now: NCCL/RCCL create a communicator at its first collective and a
    point-to-point pair at its first send, which would otherwise happen in the middle of the
    first step (a data-parallel one inside its backward hooks; counted in its time). One
    all-reduce on each of ``groups`` and one ring exchange (to the next rank, from the
    previous) on each of ``rings``, as the layers use them. Every rank calls it with its own
    groups of each kind in the same order: collective over each group."""
    probe = torch.zeros(1, device=device)
    for group in {id(g): g for g in groups if g.size() > 1}.values():
        dist.all_reduce(probe, group=group)
    for ring in {id(g): g for g in rings if g.size() > 1}.values():
        rank, size = ring.rank(), ring.size()
        incoming = torch.empty_like(probe)
        ops = [dist.P2POp(dist.isend, probe, dist.get_global_rank(ring, (rank + 1) % size), ring),
               dist.P2POp(dist.irecv, incoming, dist.get_global_rank(ring, (rank - 1) % size), ring)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _megatron_groups() -> List[dist.ProcessGroup]:
    """megatron's groups a training step talks on, besides TSP's: the tensor-parallel and
    context-parallel layers', the gradient reduce's and the distributed optimizer's, the
    pipeline's."""
    return [mpu.get_tensor_model_parallel_group(), mpu.get_context_parallel_group(),
            mpu.get_data_parallel_group(), mpu.get_data_parallel_group(with_context_parallel=True),
            mpu.get_intra_distributed_optimizer_instance_group(), mpu.get_pipeline_model_parallel_group()]


def _new_weight_group(group: dist.ProcessGroup, megatron_kwargs) -> dist.ProcessGroup:
    """A second communicator over the ranks of ``group``, one of the consecutive-rank groups
    megatron lays the tensor-parallel slot out as."""
    size = group.size()
    if size == 1:
        return group
    timeout = datetime.timedelta(minutes=megatron_kwargs.get("distributed_timeout_minutes", 30))
    mine = None
    # new_group is collective over the world: every rank creates every group, in order.
    for start in range(0, dist.get_world_size(), size):
        ranks = list(range(start, start + size))
        new = dist.new_group(ranks, timeout=timeout)
        if dist.get_rank() in ranks:
            mine = new
    assert dist.get_process_group_ranks(mine) == dist.get_process_group_ranks(group)
    return mine


def destroy_model_parallel() -> None:
    global _TSP_GROUP, _TSP_WEIGHT_GROUP, _INITIALIZED, _RING_WEIGHT_GROUP
    # Like megatron's destroy_model_parallel, forget the groups without destroying them:
    # a destroyed gloo group's rendezvous keys can be picked up by the next group created
    # over the same ranks, which then connects to closed sockets.
    _TSP_GROUP = None
    _TSP_WEIGHT_GROUP = None
    _INITIALIZED = False
    _RING_WEIGHT_GROUP = None
    mpu.destroy_model_parallel()


def is_initialized() -> bool:
    return _INITIALIZED or _RING_WEIGHT_GROUP is not None


def get_tsp_group() -> dist.ProcessGroup:
    if _TSP_GROUP is None:
        if not _INITIALIZED:
            raise RuntimeError(
                "TSP groups are not initialized; call megatron_tsp.initialize_model_parallel()"
            )
        raise RuntimeError(
            "no TSP group: this job runs plain tensor parallelism (--tsp-size 1 with "
            "--tensor-model-parallel-size > 1); TSP modules need --tsp-size > 1 or TP 1"
        )
    return _TSP_GROUP


def get_tsp_weight_group() -> dist.ProcessGroup:
    """A second communicator over the TSP ranks, for weight-shard traffic."""
    get_tsp_group()
    return _TSP_WEIGHT_GROUP


def is_tsp_group(group: dist.ProcessGroup) -> bool:
    return _TSP_GROUP is not None and group is _TSP_GROUP


def get_weight_group() -> Optional[dist.ProcessGroup]:
    """The communicator of weight-shard traffic: TSP's, or the ring MLP's in a TP model (None
    when neither runs)."""
    return _TSP_WEIGHT_GROUP if _TSP_GROUP is not None else _RING_WEIGHT_GROUP


def get_tsp_world_size() -> int:
    return get_tsp_group().size()


def get_tsp_rank() -> int:
    return get_tsp_group().rank()


def get_tsp_pg_collection() -> TSPProcessGroupCollection:
    """megatron-core's default process groups with the TSP group attached as ``.tsp``."""
    megatron_groups = [f.name for f in dataclasses.fields(ProcessGroupCollection)]
    pgs = TSPProcessGroupCollection.use_mpu_process_groups(required_pgs=megatron_groups)
    pgs.tsp = get_tsp_group()
    pgs.tsp_weight = get_tsp_weight_group()
    return pgs


def resolve_tsp_groups(
    pg_collection: Optional[ProcessGroupCollection] = None,
    group: Optional[dist.ProcessGroup] = None,
) -> Tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(TSP group, weight-traffic group) for a module.

    Explicit wins: ``group``, else ``pg_collection.tsp``, else ``pg_collection.tp`` (a
    stock collection: TSP sits on the TP slot), else the registered TSP group. The weight
    group is the registered second communicator when the group is the registered TSP
    group, else the group itself.
    """
    if group is None and pg_collection is not None:
        group = getattr(pg_collection, "tsp", None) or getattr(pg_collection, "tp", None)
        weight = getattr(pg_collection, "tsp_weight", None)
        if weight is not None:
            return group, weight
    if group is None:
        group = get_tsp_group()
    if _TSP_GROUP is not None and group is _TSP_GROUP:
        return group, _TSP_WEIGHT_GROUP
    return group, group


def resolve_ring_groups(group: Optional[dist.ProcessGroup] = None) -> Tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(group, weight-traffic group) of the ring MLP: ``group`` if given; else TSP's groups;
    else, in a tensor-parallel model initialised with ``ring_mlp``, the tensor-parallel group
    and the ring's communicator."""
    if group is None and _TSP_GROUP is None and _RING_WEIGHT_GROUP is not None:
        return mpu.get_tensor_model_parallel_group(), _RING_WEIGHT_GROUP
    if group is None and not _INITIALIZED:
        raise RuntimeError("the ring MLP needs TSP groups or a ring over the tensor-parallel group; call "
                           "megatron_tsp.initialize_model_parallel(tsp_size=D) or (tensor_model_parallel_size=D, "
                           "ring_mlp=True)")
    return resolve_tsp_groups(group=group)
