"""The device a rank runs on, chosen once at launch and passed down.

:meth:`Device.from_launch` and :meth:`Device.gpus_here` are the places that ask torch whether a
GPU is there (NVIDIA CUDA or AMD ROCm, which torch calls ``cuda`` too); everything else takes a
:class:`Device`:
the model, batches, losses and collective buffers are created on ``device.torch``, the
collectives run on ``device.backend`` (NCCL/RCCL on GPUs, gloo on the CPU), and the few
calls that differ between a GPU and the CPU (synchronise, peak memory, RNG state) are its
methods.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass(frozen=True)
class Device:
    type: str  # "cuda" (NVIDIA or ROCm) or "cpu"
    index: int = 0

    @staticmethod
    def gpus_here() -> int:
        """How many GPUs torch sees on this machine (0 without any)."""
        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    @classmethod
    def from_launch(cls, local_rank: Optional[int] = None) -> "Device":
        """This process's device: GPU ``local_rank`` (default ``$LOCAL_RANK``, or 0) when torch
        sees a GPU, else the CPU."""
        if not torch.cuda.is_available():
            return cls("cpu")
        rank = int(os.environ.get("LOCAL_RANK", 0)) if local_rank is None else local_rank
        return cls("cuda", rank % torch.cuda.device_count())

    @property
    def torch(self) -> torch.device:
        return torch.device(self.type, self.index) if self.is_gpu else torch.device("cpu")

    @property
    def is_gpu(self) -> bool:
        return self.type == "cuda"

    @property
    def vendor(self) -> str:
        if not self.is_gpu:
            return "cpu"
        return "rocm" if getattr(torch.version, "hip", None) else "cuda"

    @property
    def backend(self) -> str:
        """The collective library: NCCL (RCCL on ROCm, under the same name) or gloo."""
        return "nccl" if self.is_gpu else "gloo"

    @property
    def process_group_device(self) -> Optional[torch.device]:
        """``init_process_group``'s ``device_id``: a GPU rank's communicator is bound to its GPU
        (created at once, and megatron's subgroups split from it); None on the CPU (gloo)."""
        return self.torch if self.is_gpu else None

    def activate(self) -> None:
        """Make this the current device (megatron-core allocates on the current device)."""
        if self.is_gpu:
            torch.cuda.set_device(self.index)

    def synchronize(self) -> None:
        if self.is_gpu:
            torch.cuda.synchronize(self.index)

    def reset_peak_memory(self) -> None:
        if self.is_gpu:
            torch.cuda.reset_peak_memory_stats(self.index)

    def peak_memory_gib(self) -> float:
        """Peak allocated memory on the GPU; on the CPU, the process's peak resident size."""
        if self.is_gpu:
            return torch.cuda.max_memory_allocated(self.index) / 2**30
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30

    def rng_state(self) -> Optional[torch.Tensor]:
        """The device generator's state (None on the CPU, whose generator is saved apart)."""
        return torch.cuda.get_rng_state(self.index) if self.is_gpu else None

    def set_rng_state(self, state: Optional[Any]) -> None:
        if self.is_gpu and state is not None:
            torch.cuda.set_rng_state(state, self.index)

    def __str__(self) -> str:
        return f"{self.vendor}:{self.index}" if self.is_gpu else "cpu"


CPU = Device("cpu")
