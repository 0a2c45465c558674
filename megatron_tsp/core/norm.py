"""Layer norms for TSP layers and the baselines' stock layers.

Every rank normalises only its own tokens (TSP, and megatron's sequence parallelism), so a
norm's weight gradient is a partial sum over the tensor-parallel group: its parameters must
carry ``sequence_parallel=True`` for megatron's ``finalize_model_grads`` to all-reduce them
(a norm without it silently diverges after the first step, docs/design.md section 6).
megatron-core 0.16.1's own torch fallback (``WrappedTorchNorm``) refuses sequence
parallelism, so without TransformerEngine or apex the baselines use this norm too.
"""

from __future__ import annotations

import importlib

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_tsp.env import nvidia_apex_available, transformer_engine_version


class RMSNormFunction(torch.autograd.Function):
    """``y = x · rsqrt(mean(x², -1) + eps) · w``, computed in fp32 and rounded once (as
    torch's RMSNorm computes it), keeping for backward only ``x`` in its own dtype and the
    fp32 ``rstd`` of each token, as fused kernels do; torch's own RMSNorm (2.13, training)
    keeps four fp32 tensors of the input's size. Backward, with ``x̂ = x · rstd`` and
    ``g = dy · w``: ``dx = rstd · (g - x̂ · mean(g · x̂, -1))``, ``dw = sum(dy · x̂)``. In place
    where it can, so that at most three fp32 tensors of the input's size exist at once."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.to(torch.float32, copy=True)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True).add_(eps))
        ctx.save_for_backward(x, weight, rstd)
        return xf.mul_(rstd).mul_(weight).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        x_hat = x.to(torch.float32, copy=True).mul_(rstd)
        dw = (dy * x_hat).reshape(-1, x.size(-1)).sum(0)
        g = dy.to(torch.float32, copy=True).mul_(weight)
        dx = g.sub_(x_hat.mul_((g * x_hat).mean(-1, keepdim=True))).mul_(rstd)
        return dx.to(x.dtype), dw.to(weight.dtype), None


class RMSNorm(torch.nn.Module):
    """torch.nn.RMSNorm's parameters and result, through :class:`RMSNormFunction`. With
    ``zero_centered_gamma`` (megatron's ``--apply-layernorm-1p``, as TransformerEngine computes
    it) the weight starts at 0 and scales by ``1 + weight``."""

    def __init__(self, hidden_size: int, eps: float, device=None, dtype=None, zero_centered_gamma: bool = False):
        super().__init__()
        self.eps = eps
        self.zero_centered_gamma = zero_centered_gamma
        init = torch.zeros if zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        return RMSNormFunction.apply(x, weight, self.eps)


def implementation(config: TransformerConfig, fused: bool = True) -> str:
    """Which norm :class:`TSPNorm` builds: ``te`` or ``apex`` (fused kernels, where
    installed), else ``torch``: parameters in the model's dtype, LayerNorm by torch (one
    kernel, keeping its input and per-token mean and rstd), RMSNorm by
    :class:`RMSNormFunction` (keeping its input and rstd, as a fused kernel does). With
    ``fused=False``, ``torch-unfused``: torch's own norms with fp32 weights, as megatron's
    torch fallback builds them (RMSNorm then keeps fp32 copies of its input: the path of a
    GPU without TransformerEngine or apex in megatron-core; the planner's ``--no-fused-norm``)."""
    if not fused:
        return "torch-unfused"
    if transformer_engine_version() is not None:
        return "te"
    if nvidia_apex_available():
        return "apex"
    return "torch"


class TSPNorm:
    """A factory, as megatron's ``TENorm`` is (a ``ModuleSpec`` builds classes, and calls no
    function): ``TSPNorm(config, hidden_size)`` returns a LayerNorm or RMSNorm module
    (``config.normalization``) of the implementation :func:`implementation` picks, never a
    ``TSPNorm``. Its parameters are marked for the gradient all-reduce over the
    tensor-parallel group, in the model's dtype on the model's device
    (``config.use_cpu_initialization``: the CPU, else the current GPU)."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, fused: bool = True):
        if config.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"--normalization {config.normalization} is not supported; use LayerNorm or RMSNorm")
        kind = implementation(config, fused)
        if kind == "te":
            from megatron.core.extensions.transformer_engine import TENorm

            return TENorm(config, hidden_size, eps)  # marks sequence_parallel itself
        zero_centered = config.layernorm_zero_centered_gamma
        if zero_centered and config.normalization == "RMSNorm":
            kind = "torch"  # apex's FusedRMSNorm has no zero-centred gamma: x/rms·γ with γ from 1, not x/rms·(1+γ)
        elif zero_centered and kind != "apex":
            raise ValueError("--apply-layernorm-1p with LayerNorm needs TransformerEngine or apex; install one, "
                             "use RMSNorm or turn it off")
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        dtype = torch.float32 if kind == "torch-unfused" else config.params_dtype
        if kind == "apex" and config.normalization == "LayerNorm":
            from megatron.core.fusions.fused_layer_norm import FusedLayerNorm

            norm = FusedLayerNorm(config, hidden_size, eps, zero_centered_gamma=config.layernorm_zero_centered_gamma)
            norm.to(device=device, dtype=dtype)
        elif kind == "apex":
            norm = importlib.import_module("apex.normalization").FusedRMSNorm(hidden_size, eps=eps)
            norm.to(device=device, dtype=dtype)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps, device=device, dtype=dtype)
        elif kind == "torch":
            norm = RMSNorm(hidden_size, eps=eps, device=device, dtype=dtype, zero_centered_gamma=zero_centered)
        else:
            norm = torch.nn.RMSNorm(hidden_size, eps=eps, device=device, dtype=dtype)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm
