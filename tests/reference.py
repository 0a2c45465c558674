"""Single-process megatron-core reference modules inside a multi-rank job, and comparisons.

Every TSP module is checked against the stock megatron-core module at world size 1, built
from the same seed with ``use_cpu_initialization`` (so that the TSP shards are exact slices
of the reference's full weights). The reference runs redundantly on every rank, over a
process group of size one.
"""

import torch
import torch.distributed as dist
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_tsp.core import zigzag


def solo_pg_collection() -> ProcessGroupCollection:
    """tp and cp groups of size one (collective: call on every rank)."""
    mine, _ = dist.new_subgroups(group_size=1)
    return ProcessGroupCollection(tp=mine, cp=mine)


def configs(tsp_size, dtype=torch.float32, **kwargs):
    """(reference config at world 1, TSP config at size D) for the same model."""
    common = dict(
        num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
    )
    common.update(kwargs)
    ref = TransformerConfig(**common)
    tsp = TransformerConfig(**common, tensor_model_parallel_size=tsp_size,
                            sequence_parallel=tsp_size > 1)
    return ref, tsp


def rotary_table(config: TransformerConfig, seq_len: int, cp_group) -> torch.Tensor:
    rope = RotaryEmbedding(config.kv_channels, rotary_percent=1.0, use_cpu_initialization=True,
                           cp_group=cp_group)
    return rope(seq_len)


def local_rows(full: torch.Tensor, group) -> torch.Tensor:
    """This rank's tokens of a full ``[S, ...]`` tensor, in zigzag order."""
    d = group.size()
    return full.index_select(0, zigzag.local_positions(full.size(0), d, group.rank()))


def shard_of(full: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Megatron's stride-1 tensor-parallel shard of ``full`` along ``dim``."""
    return full.chunk(group.size(), dim=dim)[group.rank()]


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - b| / max |b|: the error relative to the reference's scale."""
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-30))


def replicated_bias_error(bias, bias_ref, dy_full, group) -> float:
    """Relative error of a replicated output bias's gradient, summed over the group.

    The bias is added by the layer's bias-dropout-add, so the test applies it: each rank to
    its own tokens, the reference to all of them.
    """
    (bias * local_rows(dy_full, group).sum((0, 1))).sum().backward()
    (bias_ref * dy_full.sum((0, 1))).sum().backward()
    return rel_err(summed(bias.grad, group), bias_ref.grad)


def summed(t: torch.Tensor, group) -> torch.Tensor:
    """Sum of a replicated parameter's partial gradients over the group."""
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t


class SavedBytes:
    """Bytes of every tensor autograd saves for backward inside the block.

    ``largest_activation``: elements of the largest saved tensor that is not one of the
    ``parameters`` (matched by storage).
    """

    def __init__(self, parameters=()):
        self.total = 0
        self.largest_activation = 0
        self._params = {p.data_ptr() for p in parameters}
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        self.total += t.numel() * t.element_size()
        if t.data_ptr() not in self._params:
            self.largest_activation = max(self.largest_activation, t.numel())
        return t

    def __enter__(self):
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


class AtenOps(TorchDispatchMode):
    """The names of the aten ops run inside the block, in order."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def assert_within(per_rank_cases, dtype) -> None:
    """Every relative error of every case on every rank is within the dtype's tolerance."""
    tol = TOLERANCE[dtype]
    failures = [(case, {k: v for k, v in errors.items() if not v <= tol})
                for cases in per_rank_cases for case, errors in cases]
    failures = [f for f in failures if f[1]]
    assert not failures, failures


def init_tsp(tsp_size: int, **kwargs) -> None:
    """TSP groups plus megatron's RNG tracker (stock attention forks it)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import megatron_tsp

    megatron_tsp.initialize_model_parallel(tsp_size=tsp_size, **kwargs)
    model_parallel_cuda_manual_seed(1234)


# packed documents' starts in samples of 48 tokens: the baselines' op at micro-batch 2 (each
# sample its own, and shared); TSP's zigzag of 64 tokens at D=2, micro-batch 1 and 2
DOCUMENTS = ([[0, 3, 4, 13, 14, 22], [0, 16]], [[0, 2, 5, 9, 20, 21]] * 2)
TSP_DOCUMENTS = ([[0, 3, 4, 13, 14, 22, 40, 57]], [[0, 3, 4, 13, 14, 22, 40, 57], [0, 16, 30, 47]])


def kernel_calls(blocks_, varlen: bool):
    """(varlen calls, other calls) the attention op makes each way for ``blocks_``, on a kernel
    with a varlen form (``varlen``) or without."""
    from megatron_tsp.core import attention_kernels, block_attention, block_geometry

    calls = block_geometry.unflatten(block_geometry.flatten(blocks_))
    if not varlen:
        return 0, len(calls)

    class Varlen:
        has_varlen = staticmethod(lambda: True)

    runs = [run for indices in block_attention._by_sample(calls).values()
            for run in attention_kernels.varlen_runs(Varlen, [calls[i] for i in indices], torch.empty(0))]
    return len(runs), len(calls) - sum(map(len, runs))


class KernelCalls:
    """Counts calls of an attention kernel's methods (``attention_kernels._KERNELS[backend]``),
    by name, while in the ``with`` block; ``calls``: {name: count}."""

    def __init__(self, backend: str = "cpu", names=("forward", "backward")):
        from megatron_tsp.core import attention_kernels

        self.kernel = attention_kernels._KERNELS[backend]
        self.calls = dict.fromkeys(names, 0)

    def __enter__(self):
        self._saved = {name: self.kernel.__dict__[name] for name in self.calls}  # static- or classmethods
        for name in self.calls:
            setattr(self.kernel, name, staticmethod(self._counted(name, getattr(self.kernel, name))))
        return self

    def _counted(self, name: str, original):
        def counted(*args):
            self.calls[name] += 1
            return original(*args)

        return counted

    def __exit__(self, *exc):
        for name, method in self._saved.items():
            setattr(self.kernel, name, method)
