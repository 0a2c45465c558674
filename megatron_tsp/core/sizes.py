"""How a job's ranks are laid out: the one place parallel sizes are derived and checked.

A model replica spans ``tsp x tp x cp x pp`` ranks; the world holds ``dp`` replicas. TSP and
megatron's tensor parallelism share megatron-core's tensor-parallel slot (``tensor_slot =
tsp x tp``; TSP allows only one of the two, :mod:`support`). Imports nothing heavy: the
command line reads it before megatron-core is loaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional

# The context-parallel size a TP x CP baseline gets when a mode re-lays a config out.
DEFAULT_CP = 2


@dataclass(frozen=True)
class ParallelSizes:
    tsp: int = 1
    tp: int = 1
    cp: int = 1
    pp: int = 1
    world: Optional[int] = None  # ranks of the job; None: one model replica
    split_tokens: bool = False  # the tensor-parallel ranks split the sequence (SP, or the ring MLP)

    @classmethod
    def of(cls, args: Any, world: Optional[int] = None) -> "ParallelSizes":
        """The sizes of resolved arguments (or a ``{key: value}`` dict of config keys)."""
        get = args.get if isinstance(args, dict) else lambda key, default: getattr(args, key, default)
        return cls(tsp=get("tsp_size", 1) or 1, tp=get("tensor_model_parallel_size", 1) or 1,
                   cp=get("context_parallel_size", 1) or 1, pp=get("pipeline_model_parallel_size", 1) or 1,
                   world=world, split_tokens=bool(get("sequence_parallel", False) or get("ring_mlp", False)))

    @property
    def tensor_slot(self) -> int:
        """megatron-core's ``tensor_model_parallel_size``: TSP or TP."""
        return self.tsp * self.tp

    @property
    def within_a_stage(self) -> int:
        """Ranks that share one pipeline stage of a replica: TSP x TP x CP."""
        return self.tsp * self.tp * self.cp

    @property
    def model_parallel(self) -> int:
        """Ranks of one model replica."""
        return self.within_a_stage * self.pp

    @property
    def world_size(self) -> int:
        return self.world or self.model_parallel

    @property
    def dp(self) -> int:
        return self.world_size // self.model_parallel

    @property
    def sequence_divisor(self) -> int:
        """The sequence length must be a multiple of this: the zigzag layout cuts it in 2 x TSP
        or 2 x CP chunks, sequence parallelism (and the ring MLP) in TP pieces."""
        return math.lcm(2 * self.tsp if self.tsp > 1 else 1, 2 * self.cp if self.cp > 1 else 1,
                        self.tp if self.split_tokens else 1)

    def as_dict(self) -> Dict[str, int]:
        return {"tsp": self.tsp, "tp": self.tp, "cp": self.cp, "pp": self.pp, "dp": self.dp,
                "world_size": self.world_size}

    def validate(self, source: str = "world size") -> "ParallelSizes":
        """One ``ValueError`` line naming the flag and the fix, before any collective: sizes
        below one, what TSP does not allow beside it (:mod:`support`), and a world that does
        not hold whole replicas (``source`` says where the world size came from)."""
        from megatron_tsp.core.support import violations

        for flag, value in (("--tsp-size", self.tsp), ("--tensor-model-parallel-size", self.tp),
                            ("--context-parallel-size", self.cp), ("--pipeline-model-parallel-size", self.pp)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1 (got {value})")
        for message in violations({"--tensor-model-parallel-size": self.tp, "--context-parallel-size": self.cp},
                                  self.tsp):
            raise ValueError(message)
        if self.world is not None and self.world % self.model_parallel:
            raise ValueError(
                f"world size {self.world} ({source}) is not a multiple of the model-parallel size "
                f"{self.model_parallel} (--tsp-size x --tensor-model-parallel-size x --context-parallel-size x "
                f"--pipeline-model-parallel-size); launch {self.model_parallel} ranks or a multiple")
        return self
