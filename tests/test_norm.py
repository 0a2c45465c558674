"""TSPNorm, the norm of TSP layers and of the baselines' stock layers."""

import pytest
import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_tsp.core.norm import TSPNorm, implementation


def _config(**kw):
    return TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True,
                             tensor_model_parallel_size=2, sequence_parallel=True, **kw)


def test_parameters_in_the_models_dtype_and_marked_for_the_gradient_all_reduce():
    for normalization in ("LayerNorm", "RMSNorm"):
        config = _config(normalization=normalization, bf16=True, params_dtype=torch.bfloat16)
        assert implementation(config) == "torch"  # no TransformerEngine, no apex here
        norm = TSPNorm(config, 16)
        for p in norm.parameters():
            assert p.dtype == torch.bfloat16 and p.device.type == "cpu" and p.sequence_parallel
        # the memory planner's --no-fused-norm: fp32 weights, torch's upcasting path
        assert all(p.dtype == torch.float32 for p in TSPNorm(config, 16, fused=False).parameters())


def test_rmsnorm_keeps_its_input_and_statistics_only():
    """TSP's RMSNorm keeps the bf16 input and an fp32 statistic per token for backward, as a
    fused kernel does; torch's own (--no-fused-norm) keeps fp32 copies of the input."""
    def saved(norm):
        x = torch.randn(64, 16, dtype=torch.bfloat16, requires_grad=True)
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            norm(x)
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept if t is not x}

    config = _config(normalization="RMSNorm", bf16=True, params_dtype=torch.bfloat16)
    fused, unfused = saved(TSPNorm(config, 16)), saved(TSPNorm(config, 16, fused=False))
    assert sum(fused.values()) <= 64 * 4 + 16 * 2  # rstd (fp32 per token) and the weight
    assert sum(unfused.values()) >= 64 * 16 * 4  # an fp32 copy of the input at least


def test_rmsnorm_equals_torchs():
    for dtype in (torch.float32, torch.bfloat16):
        config = _config(normalization="RMSNorm", params_dtype=dtype, bf16=dtype == torch.bfloat16)
        mine, ref = TSPNorm(config, 16), torch.nn.RMSNorm(16, eps=1e-5, dtype=dtype)
        with torch.no_grad():
            w = torch.randn(16).to(dtype)
            mine.weight.copy_(w)
            ref.weight.copy_(w)
        x = torch.randn(8, 3, 16).to(dtype).requires_grad_()
        dy = torch.randn(8, 3, 16).to(dtype)
        outs, grads = [], []
        for norm in (mine, ref):
            x.grad = None
            y = norm(x)
            y.backward(dy)
            outs.append(y)
            grads.append((x.grad.clone(), norm.weight.grad))
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        assert torch.equal(outs[0], outs[1])  # the same fp32 arithmetic, rounded once
        for a, b in zip(*grads):
            assert torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)


def test_layernorm_1p_rmsnorm_is_zero_centred_with_or_without_apex(monkeypatch):
    """--apply-layernorm-1p with RMSNorm computes x/rms·(1+γ) with γ from 0, as
    TransformerEngine does. apex's FusedRMSNorm (here a stand-in with its signature and
    semantics: x/rms·γ, γ from 1) has no such option, so it must not be the one built."""
    import sys
    import types

    from megatron_tsp.core import norm as norm_module

    class FusedRMSNorm(torch.nn.Module):  # apex.normalization.FusedRMSNorm(normalized_shape, eps, elementwise_affine)
        def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True):
            super().__init__()
            self.eps = eps
            self.weight = torch.nn.Parameter(torch.ones(normalized_shape))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    apex = types.ModuleType("apex")
    apex.normalization = types.SimpleNamespace(FusedRMSNorm=FusedRMSNorm)
    monkeypatch.setitem(sys.modules, "apex", apex)
    monkeypatch.setitem(sys.modules, "apex.normalization", apex.normalization)
    for apex_there in (True, False):
        monkeypatch.setattr(norm_module, "nvidia_apex_available", lambda there=apex_there: there)
        config = _config(normalization="RMSNorm", layernorm_zero_centered_gamma=True)
        norm = TSPNorm(config, 16)
        assert not isinstance(norm, FusedRMSNorm)
        assert torch.equal(norm.weight.detach(), torch.zeros(16)) and norm.weight.sequence_parallel
        with torch.no_grad():
            norm.weight.copy_(torch.linspace(-0.5, 0.5, 16))
        x = torch.randn(8, 16)
        want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * (1 + norm.weight.detach())
        torch.testing.assert_close(norm(x), want)
        norm(x).sum().backward()  # the gradient reaches γ through 1 + γ
        assert norm.weight.grad is not None and norm.weight.grad.abs().sum() > 0
    # LayerNorm 1p without TransformerEngine or apex: one line, with the fix
    monkeypatch.setattr(norm_module, "nvidia_apex_available", lambda: False)
    with pytest.raises(ValueError, match="--apply-layernorm-1p with LayerNorm needs TransformerEngine or apex"):
        TSPNorm(_config(normalization="LayerNorm", layernorm_zero_centered_gamma=True), 16)
