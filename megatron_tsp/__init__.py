"""megatron_tsp: Tensor + Sequence Parallelism (TSP) for Megatron-Core.

The public names below are imported on first use, so that ``megatron-tsp env`` or ``args``
do not pay for (or print the warnings of) importing megatron-core.
"""

import importlib
import logging

__version__ = "0.1.0"


class _NoCudaToolkitNotice(logging.Filter):
    """megatron-core imports ``torch.utils.cpp_extension``, which warns "No CUDA runtime is
    found" on every import in a CUDA build of torch without the CUDA toolkit (a CPU machine
    with PyPI's default torch): megatron_tsp compiles nothing, and every command and rank
    would print it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("No CUDA runtime is found")


logging.getLogger("torch.utils.cpp_extension").addFilter(_NoCudaToolkitNotice())

_EXPORTS = {
    "TSPSelfAttention": "megatron_tsp.core.attention",
    "TSPMLP": "megatron_tsp.core.mlp",
    "TSPNorm": "megatron_tsp.core.norm",
    "TSPProcessGroupCollection": "megatron_tsp.core.parallel_state",
    "destroy_model_parallel": "megatron_tsp.core.parallel_state",
    "get_tsp_group": "megatron_tsp.core.parallel_state",
    "get_tsp_pg_collection": "megatron_tsp.core.parallel_state",
    "get_tsp_rank": "megatron_tsp.core.parallel_state",
    "get_tsp_world_size": "megatron_tsp.core.parallel_state",
    "initialize_model_parallel": "megatron_tsp.core.parallel_state",
    "get_gpt_block_tsp_spec": "megatron_tsp.core.spec",
    "get_gpt_layer_tsp_spec": "megatron_tsp.core.spec",
    "get_hybrid_stack_tsp_spec": "megatron_tsp.core.hybrid",
    "with_ring_mlp": "megatron_tsp.core.spec",
    "ZigzagBatch": "megatron_tsp.core.zigzag",
    "apply_vocab_layout": "megatron_tsp.core.vocab",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'megatron_tsp' has no attribute {name!r}")
