"""TSPNorm, the norm of TSP layers and of the baselines' stock layers."""

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
