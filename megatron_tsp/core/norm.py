"""Layer norms for TSP layers.

Every rank normalises only its own tokens, so a norm's weight gradient is a partial sum over
the TSP group: its parameters must carry ``sequence_parallel=True`` for megatron's
``finalize_model_grads`` to all-reduce them (a norm without it silently diverges after the
first step, DESIGN.md section 6).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_tsp.env import nvidia_apex_available, transformer_engine_version


class TSPNorm:
    """LayerNorm or RMSNorm (``config.normalization``) for TSP layers.

    TransformerEngine's when it is usable, apex's fused LayerNorm when apex is, torch's
    otherwise (CPU included); all three mark their parameters for the gradient all-reduce.
    """

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5):
        on_gpu = torch.cuda.is_available()
        if on_gpu and transformer_engine_version() is not None:
            from megatron.core.extensions.transformer_engine import TENorm

            return TENorm(config, hidden_size, eps)
        if on_gpu and config.normalization == "LayerNorm" and nvidia_apex_available():
            from megatron.core.fusions.fused_layer_norm import FusedLayerNorm

            return FusedLayerNorm(config, hidden_size, eps)
        if config.layernorm_zero_centered_gamma:
            raise ValueError("--apply-layernorm-1p needs TransformerEngine or apex; install one or turn it off")
        if config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"--normalization {config.normalization} is not supported; use LayerNorm or RMSNorm")
        for param in norm.parameters():
            setattr(param, "sequence_parallel", config.sequence_parallel)
        return norm
