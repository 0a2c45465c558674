"""The CPU shims: each one applies and does what it says (that a GPU process never enables
them is checked by the fake-CUDA runs, tests/test_fake_cuda.py); the rewrites of megatron-core's
faults name the releases they apply to."""

import inspect
from collections import Counter

import torch

from megatron_tsp import versions
from megatron_tsp.run import compat, upstream


def _shim_checks():
    from megatron.core import tensor_parallel
    from megatron.core.transformer import utils as tutils
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    import megatron_tsp

    assert compat.cpu_support_enabled()  # the CPU worker enabled them
    compat.enable_cpu_support()  # idempotent
    megatron_tsp.initialize_model_parallel()
    out = {}
    # Every rewritten function now comes from the shim and still has its upstream name.
    rewritten = []
    for shim in (s for s in compat.SHIMS if s.applies()):
        owner, name = upstream._resolve_owner(__import__(shim.module, fromlist=["x"]), shim.qualname)
        fn = inspect.getattr_static(owner, name)
        fn = getattr(fn, "__func__", fn)
        rewritten.append(fn.__code__.co_filename.startswith("<megatron_tsp rewrite of ")
                         and fn.__qualname__ == shim.qualname)
    out["rewritten"] = rewritten
    # Causal mask: same values as upstream intends, on the CPU.
    mask = tutils.get_default_causal_mask(5)
    out["mask"] = mask.device.type == "cpu" and torch.equal(mask, torch.triu(torch.ones(5, 5), 1).bool())
    # RNG tracker: fork() gives a reproducible stream and leaves the default stream alone.
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    torch.manual_seed(0)
    expected_default = torch.rand(3)
    torch.manual_seed(0)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        forked_a = torch.rand(3)
    default_after = torch.rand(3)
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        forked_b = torch.rand(3)
    out["rng"] = torch.equal(forked_a, forked_b) and torch.equal(default_after, expected_default)
    # Norms accept sequence parallelism and mark their parameters for the TP grad all-reduce.
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                               sequence_parallel=True, tensor_model_parallel_size=2)
    norm = WrappedTorchNorm(config, hidden_size=8)
    out["norm"] = all(getattr(p, "sequence_parallel", False) for p in norm.parameters())
    assert config.sequence_parallel  # the caller's config is untouched
    out["device"] = torch.empty(1, device=torch.cuda.current_device()).device.type
    return out


def test_shims_apply_and_behave(ranks):
    (out,) = ranks(1, _shim_checks)
    assert all(out["rewritten"]) and len(out["rewritten"]) == len([s for s in compat.SHIMS if s.applies()])
    assert out["mask"] and out["rng"] and out["norm"]
    assert out["device"] == "cpu"


def test_a_moved_upstream_line_fails_loudly():
    # (a function no shim rewrites: other tests may have enabled the shims in this process)
    shim = upstream.Rewrite("megatron.core.utils", "divide", (("no such text", ""),), "utils.py")
    try:
        shim.install()
    except RuntimeError as exc:
        assert f"of megatron-core {versions.megatron_core()}; this release is not supported" in str(exc)
    else:
        raise AssertionError("a missing pattern must raise")


def test_upstream_fixes_name_their_releases_and_fit_this_one():
    """Each rewrite of a megatron-core fault names the supported releases it applies to (one
    not read yet runs megatron-core's own code), no function is rewritten twice on a release
    (the second would read the first's source), and on this release those that apply find
    their text (fix_optimizer_checkpoints raises where it moved)."""
    fixes = (*upstream.BUCKET_FIXES, *upstream.TORCH_ADAM_FIXES)
    assert all(fix.versions and set(fix.versions) <= set(versions.SUPPORTED) for fix in fixes)
    per_release = Counter((fix.module, fix.qualname, release) for fix in fixes for release in fix.versions)
    assert max(per_release.values()) == 1, per_release
    upstream.fix_optimizer_checkpoints()
