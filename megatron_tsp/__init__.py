"""megatron_tsp: Tensor + Sequence Parallelism (TSP) for Megatron-Core."""

from megatron_tsp.parallel_state import (
    TSPProcessGroupCollection,
    destroy_model_parallel,
    get_tsp_group,
    get_tsp_pg_collection,
    get_tsp_rank,
    get_tsp_world_size,
    initialize_model_parallel,
)

__version__ = "0.1.0"

__all__ = [
    "TSPProcessGroupCollection",
    "destroy_model_parallel",
    "get_tsp_group",
    "get_tsp_pg_collection",
    "get_tsp_rank",
    "get_tsp_world_size",
    "initialize_model_parallel",
]
