"""How many head groups a stage of TSP attention puts side by side (``--tsp-head-groups-per-call``;
docs/design.md section 2): one K/V gather and one kernel call per block for all of them,
as few as fill the GPU. Which settings TSP takes is the support matrix's
(:mod:`megatron_tsp.core.support`).
"""

from __future__ import annotations

import contextlib
from typing import Dict, Union

import torch

from megatron_tsp.core import attention_kernels

PLANNED_SMS = 132  # the H100's and H200's streaming multiprocessors: the planner's GPU, unless told
TILE_ROWS = 128  # query rows per thread block of a flash kernel's forward (flash-attn 2, head dim 128)
_SMS: Dict[int, int] = {}
_PLANNED = [PLANNED_SMS]  # the planner's GPU's (planned_multiprocessors)


@contextlib.contextmanager
def planned_multiprocessors(count: int):
    """Inside the block the planner's fake tensors plan a GPU of ``count`` SMs or CUs (a
    hardware profile's ``multiprocessors``: 132 on H100 and H200, 304 on MI300X, 108 on A100)."""
    _PLANNED.append(count)
    try:
        yield
    finally:
        _PLANNED.pop()


def multiprocessors_of(device: torch.device) -> int:
    """A real GPU's SMs (NVIDIA) or CUs (AMD), read once per device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def head_groups_per_call(setting: Union[int, str], d_size: int, batch: int, heads: int, rows: int,
                         device: torch.device, backend: str, planned: bool = False) -> int:
    """How many head groups a stage of TSP attention puts side by side: one K/V gather and
    one kernel call per block for all of them. A positive int is taken as it is. ``auto`` (or
    0, as configs write it): 1 for the CPU's kernels (``backend``, resolved), which split any
    call across their threads; for a GPU kernel the fewest (a divisor of D) whose calls fill
    the GPU, ``batch x G x heads x ceil(rows / TILE_ROWS)`` thread blocks at least its SM
    count (for the planner's fake tensors, which plan a GPU's kernels wherever they live,
    :func:`planned_multiprocessors`). One head group per call keeps the most overlap, but at
    short S its calls leave most SMs idle: the 7B at D=8 (4 heads a group) has 32 thread
    blocks a call at 16K, so all 8 groups go in one stage on 132 SMs; 4 at 32K, 2 at 64K, 1
    from 128K. ``heads``: query heads per head group; ``rows``: query rows per call (a zigzag
    chunk, S/2D)."""
    if setting not in ("auto", 0):
        return setting
    if backend not in attention_kernels.GPU_BACKENDS:
        return 1
    sms = _PLANNED[-1] if planned or device.type != "cuda" else multiprocessors_of(device)
    tiles = batch * heads * -(-rows // TILE_ROWS)
    return next(g for g in range(1, d_size + 1) if d_size % g == 0 and (g * tiles >= sms or g == d_size))
