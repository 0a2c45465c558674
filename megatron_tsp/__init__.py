"""megatron_tsp: Tensor + Sequence Parallelism (TSP) for Megatron-Core."""

from megatron_tsp.attention import TSPSelfAttention
from megatron_tsp.mlp import TSPMLP
from megatron_tsp.norm import TSPNorm
from megatron_tsp.parallel_state import (
    TSPProcessGroupCollection,
    destroy_model_parallel,
    get_tsp_group,
    get_tsp_pg_collection,
    get_tsp_rank,
    get_tsp_world_size,
    initialize_model_parallel,
)
from megatron_tsp.spec import get_gpt_block_tsp_spec, get_gpt_layer_tsp_spec
from megatron_tsp.zigzag import zigzag_batch

__version__ = "0.1.0"

__all__ = [
    "TSPMLP",
    "TSPNorm",
    "TSPSelfAttention",
    "get_gpt_block_tsp_spec",
    "get_gpt_layer_tsp_spec",
    "zigzag_batch",
    "TSPProcessGroupCollection",
    "destroy_model_parallel",
    "get_tsp_group",
    "get_tsp_pg_collection",
    "get_tsp_rank",
    "get_tsp_world_size",
    "initialize_model_parallel",
]
