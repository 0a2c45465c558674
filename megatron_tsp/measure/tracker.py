"""What lives in memory during a step, by category: a dispatch mode that follows every
storage (:class:`StorageTracker`) and a log of what autograd keeps (:class:`SavedTensors`).

Categories: ``parameters``, ``gradients`` (megatron's grad buffers), ``optimizer`` (states
and fp32 main weights), ``activations`` (tensors autograd saves for backward, forward and
recomputation), ``communication`` (receive buffers of collectives while they live) and
``temporaries`` (everything else). The tracker also applies torch's FLOP formulas (those of
``FlopCounterMode``) to every op, and counts the bytes that the ops without one (elementwise,
norms, softmax pieces, copies, the optimizer) read and write: their time is memory time.

Memory-bound bytes, op by op (``memory_bytes_by_op``):

* an op reads its tensor arguments and writes its outputs; an op that only writes
  (``zero_``, ``fill_``, ``zeros``, ``zeros_like``, ...) reads nothing, ``copy_`` reads its
  source only, and ``index_copy_`` reads its source and index and writes as many rows;
* the attention op (``block_attention``) is followed inside: its kernels are its FLOPs (the
  op's own formula, counted once), and what runs around them (allocations, lse merges,
  casts, per-block gradient sums) is counted like any op, under ``block_attention/<op>``.

Kernel launches, op by op (``launches_by_op``): each op that does work on a device, one
launch, under the names above: a GEMM or another op with a FLOP formula, each attention
kernel call inside the attention op (``block_attention/<kernel>``, also counted apart in
``attention_kernel_calls``), and each op that moves memory-bound bytes. Views, allocations,
metadata queries and collectives (counted by :mod:`~megatron_tsp.measure.counts`) launch
nothing here; a fused kernel is one op, so one launch.

The optimizer step is counted under ``optimizer/<op>`` (:meth:`StorageTracker.section`),
bytes and launches: torch's Adam takes its per-tensor path for fake tensors (its multi-tensor
path checks the tensor type), a dozen launches a parameter, where a GPU's megatron runs a
multi-tensor Adam (TransformerEngine's or apex's FusedAdam, torch's foreach AdamW): a few
launches a step, whatever its parameters. Its bytes are the same either way.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Dict, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from megatron_tsp.core import block_attention  # (also registers the block_attention ops)

OPTIMIZER = "optimizer"  # the section the optimizer step is counted in
PHASE_COUNTS = ("flops", "attention_flops", "memory_bytes", "launches", "gemm_calls", "attention_calls")


def without_optimizer(launches_by_op: Dict[str, float]) -> Dict[str, float]:
    """The launches of a step or layer but the optimizer step's (module docstring)."""
    return {op: n for op, n in launches_by_op.items() if not op.startswith(f"{OPTIMIZER}/")}


CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "communication", "temporaries")
GIB = 2**30


# the attention ops, and the Python implementation of each, run under the tracker to see inside it
_ATTENTION_IMPL = block_attention.IMPLEMENTATIONS
_ATTENTION_OPS = set(_ATTENTION_IMPL)
_NOT_MEMORY_BOUND = ("c10d", "_c10d_functional", "prim")  # collectives (counts.py), metadata queries
# attention kernels (inside the attention op: its FLOPs, not memory traffic)
_KERNEL_PREFIXES = ("_scaled_dot_product_", "_flash_attention", "_efficient_attention", "_cudnn_attention")
# ops that read and write no element: allocations, and views that are not flagged as views
_NO_DATA = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "_unsafe_view", "detach",
            "lift_fresh", "resize_", "set_"}
# ops that write their output and read no tensor argument's elements
_WRITE_ONLY = {"zero_", "fill_", "zeros", "zeros_like", "new_zeros", "ones", "ones_like", "new_ones", "full",
               "full_like", "new_full", "scalar_tensor", "arange"}


def _memory_bytes(name: str, args, kwargs, out) -> int:
    """Bytes an op without a FLOP formula reads and writes (module docstring)."""
    if name in _WRITE_ONLY:
        return _nbytes(out)
    if name == "copy_":
        return 2 * _nbytes(args[1])
    if name == "index_copy_":
        return 2 * _nbytes(args[3]) + _nbytes(args[2])
    return _nbytes(args, kwargs) + _nbytes(out)


def _nbytes(*trees) -> int:
    return sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(trees)
               if isinstance(t, torch.Tensor))


class StorageTracker(TorchDispatchMode):
    """Live bytes per category over time; the per-category breakdown at the peak."""

    def __init__(self, fake_scalars: bool = True, detail: int = 0) -> None:
        super().__init__()
        self.fake_scalars = fake_scalars
        self.detail = detail  # keep the largest `detail` live storages at the peak
        self.peak_op = None
        self.peak_largest = []
        self.origin: Dict[int, str] = {}
        self.flops = 0
        self.attention_flops = 0
        self.memory_bytes = 0
        self.memory_bytes_by_op: Dict[str, int] = {}
        self.launches_by_op: Dict[str, int] = {}
        self.attention_kernel_calls = 0
        # the same three by phase of the step ("forward"; "backward": inside autograd's
        # backward, recomputation included), for the overlap model, with the launches (the
        # optimizer step's apart) and of them the GEMMs and attention kernel calls, for the
        # launch prices (perfmodel.py)
        self.by_phase: Dict[str, Dict[str, int]] = {}
        self._inside = None  # the attention op being followed inside
        self._section: Optional[str] = None  # a part of the step counted under its name (:meth:`section`)
        self.category: Dict[int, str] = {}  # storage id -> category
        self.size: Dict[int, int] = {}
        self._refs: Dict[int, weakref.ref] = {}
        self.live = dict.fromkeys(CATEGORIES, 0)
        self.peak = 0
        self.peak_by_category = dict(self.live)
        self.default = "temporaries"

    @staticmethod
    def _key(st) -> int:
        return st._cdata

    def _add(self, t: torch.Tensor, category: str) -> None:
        st = t.untyped_storage()
        key = self._key(st)
        if key in self.category:
            return
        self.category[key] = category
        self.origin[key] = self._current_op
        self.size[key] = st.nbytes()
        self.live[category] += st.nbytes()
        self._refs[key] = weakref.ref(st, lambda _, key=key: self._free(key))
        self._update_peak()

    def _free(self, key: int) -> None:
        category = self.category.pop(key, None)
        if category is not None:
            self.live[category] -= self.size.pop(key)
            self._refs.pop(key, None)
            self.origin.pop(key, None)

    def _update_peak(self) -> None:
        total = sum(self.live.values())
        if total > self.peak:
            self.peak = total
            self.peak_by_category = dict(self.live)
            self.peak_op = self._current_op
            if self.detail:
                largest = sorted(self.size, key=self.size.get, reverse=True)[: self.detail]
                self.peak_largest = [(self.size[k] / GIB, self.category[k], self.origin.get(k)) for k in largest]

    def tag(self, tensors, category: str, only_from=None) -> None:
        """(Re)attribute the storages of ``tensors`` to ``category`` (starting to track them)."""
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            key = self._key(t.untyped_storage())
            if key not in self.category:
                self._add(t, category)
            elif only_from is None or self.category[key] in only_from:
                old = self.category[key]
                self.live[old] -= self.size[key]
                self.live[category] += self.size[key]
                self.category[key] = category

    def reset_peak(self) -> None:
        self.peak = 0
        self._update_peak()

    _current_op = None

    @contextlib.contextmanager
    def section(self, name: str):
        """Inside the block, bytes and launches are counted under ``<name>/<op>``."""
        self._section = name
        try:
            yield
        finally:
            self._section = None

    def _op_key(self, name: str) -> str:
        where = self._inside or self._section
        return f"{where}/{name}" if where else name

    def _launch(self, name: str, kind: Optional[str] = None) -> None:
        """One launch of op ``name``; ``kind``: "gemm_calls" or "attention_calls"."""
        key = self._op_key(name)
        self.launches_by_op[key] = self.launches_by_op.get(key, 0) + 1
        if self._section != OPTIMIZER:
            self._count("launches", 1)
            if kind is not None:
                self._count(kind, 1)

    def _count(self, key: str, value: int) -> None:
        phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        counts = self.by_phase.setdefault(phase, dict.fromkeys(PHASE_COUNTS, 0))
        counts[key] += value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.fake_scalars and func is torch.ops.aten._local_scalar_dense.default:
            return False if args[0].dtype == torch.bool else 1
        name = func._overloadpacket.__name__
        self._current_op = f"{name}{' (backward)' if torch._C._current_graph_task_id() != -1 else ''}"
        formula = flop_registry.get(func._overloadpacket)
        if func._overloadpacket in _ATTENTION_OPS and self._inside is None:
            self._inside = name
            try:
                with self:  # the op's own operations, under this mode too
                    out = _ATTENTION_IMPL[func._overloadpacket](*args, **kwargs)
            finally:
                self._inside = None
            flops = formula(*args, **kwargs, out_val=out)
            self.flops += flops
            self.attention_flops += flops
            self._count("flops", flops)
            self._count("attention_flops", flops)
        else:
            out = func(*args, **kwargs)
            if self._inside and name.startswith(_KERNEL_PREFIXES):
                # an attention kernel inside the attention op: the op's FLOPs, counted once
                self.attention_kernel_calls += 1
                self._launch(name, "attention_calls")
            elif formula is not None:
                # torch's FLOP formulas, applied here rather than under FlopCounterMode, whose
                # module hooks keep activations alive and would distort the memory measured. An
                # out_dtype/out= overload (mm.dtype, addmm.dtype_out: GEMMs into an fp32
                # accumulator) counts as its plain form.
                if self._inside is None:
                    flops = formula(*(a for a in args if not isinstance(a, torch.dtype)),
                                    **{k: v for k, v in kwargs.items() if k not in ("out", "out_dtype")}, out_val=out)
                    self.flops += flops
                    self._count("flops", flops)
                self._launch(name, "gemm_calls" if self._inside is None else None)
            elif not (func.is_view or func.namespace in _NOT_MEMORY_BOUND or name in _NO_DATA):
                moved = _memory_bytes(name, args, kwargs, out)
                if moved:
                    self._launch(name)
                self.memory_bytes += moved
                self._count("memory_bytes", moved)
                key = self._op_key(name)
                self.memory_bytes_by_op[key] = self.memory_bytes_by_op.get(key, 0) + moved
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(t, torch.Tensor):
                self._add(t, self.default)
        return out


class SavedTensors:
    """Every storage autograd keeps from the forward pass, with the module that saved it and
    the op that made it: the activation accounting of ``megatron-tsp memory --per-layer``.

    A module stack (global forward hooks) names the innermost module running when a tensor is
    saved; storages saved twice (an input two ops keep) count once, and a view keeps its whole
    storage alive, so a storage is counted whole. Weights saved for backward are parameters,
    not activations. Recomputation in the backward pass is not recorded: only what the
    forward pass leaves behind.
    """

    def __init__(self, tracker: StorageTracker) -> None:
        self.tracker = tracker
        self.names: Dict[torch.nn.Module, str] = {}
        self.rows: Dict[int, Dict] = {}
        self._stack: List[str] = []

    def watch(self, model: torch.nn.Module) -> None:
        self.names = {module: name for name, module in model.named_modules()}

    def __enter__(self) -> "SavedTensors":
        from torch.nn.modules import module as nn_module

        def push(module, args):
            self._stack.append(self.names.get(module, type(module).__name__))

        def pop(module, args, output):
            self._stack.pop()

        self._handles = [nn_module.register_module_forward_pre_hook(push),
                         nn_module.register_module_forward_hook(pop)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()

    def saved(self, t: torch.Tensor) -> None:
        if torch._C._current_graph_task_id() != -1:  # a recomputation in backward
            return
        key = StorageTracker._key(t.untyped_storage())
        if key not in self.rows and self.tracker.category.get(key) == "activations":  # not weights
            self.rows[key] = {"module": self._stack[-1] if self._stack else "", "op": self.tracker.origin.get(key),
                              "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                              "bytes": t.untyped_storage().nbytes()}

    def layer(self, prefix: str = "decoder.layers.0.") -> List[Dict]:
        """The rows saved inside one layer (module names relative to it), largest first."""
        rows = [dict(r, module=r["module"][len(prefix):]) for r in self.rows.values()
                if r["module"].startswith(prefix)]
        return sorted(rows, key=lambda r: -r["bytes"])
