"""Run megatron-core 0.16.1 on CPU with gloo (opt-in, for tests and the CPU main job).

megatron-core assumes CUDA in a handful of places (docs/design.md section 7). Each place is
covered by one shim below, listed in ``SHIMS`` with the upstream location it covers, so
that a megatron-core upgrade that moves the code fails loudly in ``enable_cpu_support()``
instead of silently running the stock path.

Two kinds of shim:

* :class:`Rewrite`: the named function's source with literal replacements (``device="cuda"``
  becomes ``device="cpu"``, a ``torch.cuda.FloatTensor`` type check accepts its CPU twin).
  The function is recompiled in its own module's globals, so nothing else about it changes.
* a few direct replacements (``torch.cuda.current_device`` names the CPU, the RNG tracker
  keeps CPU generator states, megatron's torch norms accept sequence parallelism).

Only a process whose device is the CPU enables them (``build.initialize`` and the worker
pool, from the :class:`~megatron_tsp.device.Device` chosen at launch): a process that runs
on a GPU never does. On the CPU every shim only changes *where* a tensor lives or *which*
generator a state belongs to, never a value.

Apart from those, :func:`fix_optimizer_checkpoints` corrects two faults of megatron-core's
distributed optimizer checkpoints on every device (:data:`BUCKET_SHIMS`,
:data:`TORCH_ADAM_SHIMS`): checkpointing applies it before it saves or loads optimizer state;
and :func:`fix_moe_without_transformer_engine` a fault of megatron-core 0.16's MoE router
without TransformerEngine, on every device.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import multiprocessing
import signal
import sys
import textwrap
from dataclasses import dataclass
from multiprocessing.managers import SyncManager
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch

from megatron_tsp import versions

_ENABLED = False


@dataclass(frozen=True)
class Rewrite:
    """Recompile ``module.qualname`` with each ``old`` string replaced by ``new``, on the
    megatron-core releases of ``versions`` ((major, minor) pairs; empty: every supported one)."""

    module: str
    qualname: str
    replacements: Tuple[Tuple[str, str], ...]
    upstream: str  # file:line upstream (0.16.1 where not said), for the reader
    versions: Tuple[Tuple[int, int], ...] = ()

    def applies(self) -> bool:
        return not self.versions or versions.mcore() in self.versions

    def install(self) -> None:
        if not self.applies():
            return
        mod = importlib.import_module(self.module)
        owner, name = _resolve_owner(mod, self.qualname)
        raw = inspect.getattr_static(owner, name)
        func = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
        src = textwrap.dedent(inspect.getsource(func))
        for old, new in self.replacements:
            if old not in src:
                raise RuntimeError(
                    f"megatron_tsp.run.compat: '{old}' not found in {self.module}.{self.qualname} "
                    f"({self.upstream}); this megatron-core version is not supported on CPU"
                )
            src = src.replace(old, new)
        new_func = _compile_like(func, src, owner if inspect.isclass(owner) else None)
        if isinstance(raw, classmethod):
            new_obj = classmethod(new_func)
        elif isinstance(raw, staticmethod):
            new_obj = staticmethod(new_func)
        else:
            new_obj = new_func
        setattr(owner, name, new_obj)
        if not inspect.isclass(owner):
            rebind_in_megatron({id(func): new_func})


@dataclass(frozen=True)
class RewriteEach:
    """:class:`Rewrite` of every function and method defined in ``module`` whose source holds
    one of the ``old`` strings (at least one must), on the megatron-core releases of
    ``versions``: for the modules that spell the device the same way in many places."""

    module: str
    replacements: Tuple[Tuple[str, str], ...]
    versions: Tuple[Tuple[int, int], ...] = ()

    def install(self) -> None:
        if self.versions and versions.mcore() not in self.versions:
            return
        mod = importlib.import_module(self.module)
        found = 0
        for qualname, func in _functions(mod):
            try:
                src = inspect.getsource(func)
            except (OSError, TypeError):  # built without source (e.g. a C extension's)
                continue
            hits = tuple((old, new) for old, new in self.replacements if old in src)
            if hits:
                Rewrite(self.module, qualname, hits, self.module).install()
                found += 1
        if not found:
            raise RuntimeError(f"megatron_tsp.run.compat: none of {[old for old, _ in self.replacements]} in "
                               f"{self.module}; this megatron-core version is not supported on CPU")


def _functions(mod):
    """(qualname, function) of every function and method ``mod`` defines itself."""
    for name, obj in list(vars(mod).items()):
        if getattr(obj, "__module__", None) != mod.__name__:
            continue
        if inspect.isfunction(obj):
            yield name, obj
        elif inspect.isclass(obj):
            for attr, member in list(vars(obj).items()):
                func = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
                if inspect.isfunction(func):
                    yield f"{name}.{attr}", func


def _resolve_owner(mod, qualname: str):
    parts = qualname.split(".")
    owner = mod
    for part in parts[:-1]:
        owner = getattr(owner, part)
    return owner, parts[-1]


def _compile_like(func: Callable, src: str, cls) -> Callable:
    """Compile ``src`` (one ``def``) with ``func``'s globals; its decorators are applied again,
    but for ``classmethod`` and ``staticmethod``, which the caller re-applies.

    Methods are compiled inside a factory that binds ``__class__`` so that zero-argument
    ``super()`` keeps working.
    """
    tree = ast.parse(src)
    fdef = tree.body[0]
    fdef.decorator_list = [d for d in fdef.decorator_list
                           if not (isinstance(d, ast.Name) and d.id in ("classmethod", "staticmethod"))]
    body = ast.unparse(fdef)
    factory = "def __tsp_factory__(__class__):\n" + textwrap.indent(body, "    ")
    factory += f"\n    return {fdef.name}\n"
    namespace: dict = {}
    code = compile(factory, f"<megatron_tsp.run.compat: {func.__module__}.{func.__qualname__}>", "exec")
    exec(code, func.__globals__, namespace)
    new_func = namespace["__tsp_factory__"](cls)
    new_func.__qualname__ = func.__qualname__
    new_func.__module__ = func.__module__
    new_func.__doc__ = func.__doc__
    return new_func


def rebind_in_megatron(replacements: Dict[int, Any]) -> List[Tuple[Any, str, Any]]:
    """Point every attribute of a loaded megatron module that holds an object of
    ``replacements`` (keyed by ``id``) at its replacement: ``from x import f`` elsewhere keeps
    the old object. Returns (module, attribute, old object) of each change, to undo it."""
    changed = []
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not mod_name.startswith("megatron."):
            continue
        for attr, value in list(vars(mod).items()):
            new = replacements.get(id(value))
            if new is not None and new is not value:
                setattr(mod, attr, new)
                changed.append((mod, attr, value))
    return changed


@contextlib.contextmanager
def distributed_replaced(wrap: Callable[[str, Any], Any], names: Sequence[str]):
    """Inside the block, each ``torch.distributed.<name>`` of ``names`` (those this torch has)
    is ``wrap(name, original)``, and so is every name megatron bound to the original at
    import (:func:`rebind_in_megatron`); both are put back after."""
    import torch.distributed as dist

    originals = {name: getattr(dist, name) for name in names if hasattr(dist, name)}
    replacements = {name: wrap(name, fn) for name, fn in originals.items()}
    for name, fn in replacements.items():
        setattr(dist, name, fn)
    changed = rebind_in_megatron({id(originals[name]): fn for name, fn in replacements.items()})
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        for owner, attr, fn in changed:
            setattr(owner, attr, fn)


_CUDA = '"cuda"'
_CUDA_Q = "'cuda'"

SHIMS: Sequence[Rewrite] = (
    # Causal masks are built on cuda.
    Rewrite("megatron.core.transformer.utils", "get_default_causal_mask",
            ((f"device={_CUDA}", 'device="cpu"'),), "transformer/utils.py:35"),
    Rewrite("megatron.core.transformer.utils", "get_sliding_window_causal_mask",
            ((f"device={_CUDA}", 'device="cpu"'),), "transformer/utils.py:40"),
    # Context-parallel RoPE slice: pinned memory and .cuda().
    Rewrite("megatron.core.models.common.embeddings.rope_utils", "get_pos_emb_on_this_cp_rank",
            (("pin_memory=True", "pin_memory=False"), (".cuda(non_blocking=True)", "")),
            "models/common/embeddings/rope_utils.py:62"),
    # Pipeline parallel with tied embeddings: the last stage's copy is moved to cuda before
    # the first/last-stage all-reduce.
    Rewrite("megatron.core.models.common.language_module.language_module",
            "LanguageModule.setup_embeddings_and_output_layer",
            (("weight.data = weight.data.cuda()", "weight.data = weight.data"),),
            "models/common/language_module/language_module.py:244"),
    # Token counters of the pipeline schedules.
    *(
        Rewrite("megatron.core.pipeline_parallel.schedules", name,
                 ((f"device={_CUDA}", 'device="cpu"'),), f"pipeline_parallel/schedules.py:{line}")
        for name, line in (
            ("forward_backward_no_pipelining", 596),
            ("forward_backward_pipelining_with_interleaving", 983),
            ("forward_backward_pipelining_without_interleaving", 2138),
        )
    ),
    # Optimizer scalars and dtype checks spelled with torch.cuda.* type names.
    Rewrite("megatron.core.optimizer.optimizer", "MixedPrecisionOptimizer.__init__",
            ((f"device={_CUDA_Q}", "device='cpu'"),), "optimizer/optimizer.py:473-485"),
    Rewrite("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__",
            (("'torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor'",
              "'torch.HalfTensor', 'torch.BFloat16Tensor'"),
             ("== 'torch.cuda.FloatTensor'", "== 'torch.FloatTensor'")),
            "optimizer/optimizer.py:671/690"),
    # 0.19: whether a rank holds parameters of a grad-norm group, agreed over the ranks.
    Rewrite("megatron.core.optimizer.optimizer", "MegatronOptimizer.has_grad_norm_group",
            ((f"device={_CUDA_Q}", "device='cpu'"),), "optimizer/optimizer.py:315 (0.19)", ((0, 19),)),
    Rewrite("megatron.core.optimizer.optimizer", "FP32Optimizer.__init__",
            ((f"device={_CUDA_Q}", "device='cpu'"),), "optimizer/optimizer.py:907"),
    Rewrite("megatron.core.optimizer.distrib_optimizer",
            "DistributedOptimizer._build_model_and_main_param_groups",
            (("'torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor'",
              "'torch.HalfTensor', 'torch.BFloat16Tensor'"),
             ("== 'torch.cuda.FloatTensor'", "== 'torch.FloatTensor'")),
            "optimizer/distrib_optimizer.py:361/420"),
    Rewrite("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.__init__",
            (("'torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor'",
              "'torch.HalfTensor', 'torch.BFloat16Tensor'"),),
            "optimizer/distrib_optimizer.py:582"),
    # Optimizer state in the resharding checkpoint format is gathered on DP rank 0 via cuda.
    Rewrite("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.get_parameter_state_dp_zero",
            (("send_tensor = send_tensor.cuda()", "send_tensor = send_tensor"),),
            "optimizer/distrib_optimizer.py:1089"),
    # Gradient norm and clipping.
    Rewrite("megatron.core.optimizer.clip_grads", "get_grad_norm_fp32",
            ((f"device={_CUDA_Q}", "device='cpu'"),), "optimizer/clip_grads.py:90/103/115"),
    Rewrite("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32",
            ((f"device={_CUDA_Q}", "device='cpu'"),
             ("== 'torch.cuda.FloatTensor'", "== 'torch.FloatTensor'")),
            "optimizer/clip_grads.py:167/174"),
    Rewrite("megatron.core.optimizer.clip_grads", "count_zeros_fp32",
            ((f"device={_CUDA_Q}", "device='cpu'"),), "optimizer/clip_grads.py:207"),
    Rewrite("megatron.core.utils", "local_multi_tensor_l2_norm",
            ((f"device={_CUDA}", 'device="cpu"'),), "utils.py:1207"),
    # The CUDA RNG tracker: same bookkeeping, CPU generator.
    Rewrite("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker.add",
            (("torch.cuda.get_rng_state()", "torch.get_rng_state()"),
             ("torch.cuda.manual_seed(seed)", "torch.manual_seed(seed)")),
            "tensor_parallel/random.py:235"),
)


# megatron-core 0.16.1 checkpoints the DistributedOptimizer assuming TransformerEngine's or
# apex's Adam. On torch's Adam (every CPU, and GPUs without either) the per-parameter state
# also holds a "step" tensor, which loading gets wrong twice.
TORCH_ADAM_SHIMS: Sequence[Rewrite] = (
    # The resharding format has no per-parameter "step" (it comes from the param groups).
    Rewrite("megatron.core.optimizer.distrib_optimizer",
            "DistributedOptimizer._set_main_param_and_optimizer_states",
            (("dst_tensors[key].copy_(tensors[key])",
              "if key != 'step': dst_tensors[key].copy_(tensors[key])"),),
            "optimizer/distrib_optimizer.py:940", ((0, 16),)),
    Rewrite("megatron.core.optimizer.distrib_optimizer",
            "DistributedOptimizer._set_main_param_and_optimizer_states",
            (("if not isinstance(tensors[key], torch.Tensor):",
              "if key == 'step' or not isinstance(tensors[key], torch.Tensor):"),),
            "optimizer/distrib_optimizer.py:1223 (0.19)", ((0, 19),)),
    # One "step" tensor was shared by every parameter, so torch's Adam advanced it once
    # per parameter per step and the bias correction drifted after a resume.
    Rewrite("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.load_state_dict",
            (('s["step"] = step', 's["step"] = step.clone()'),),
            "optimizer/distrib_optimizer.py:820"),
)
# megatron-core (0.16.1 and 0.19) saves the fully_reshardable optimizer state of the wrong
# elements when a buffer has more than one bucket (--overlap-grad-reduce with buckets smaller
# than the model): it gathers each bucket without its end padding, one after the other, but
# slices the result at the buffer's padded offsets, so every parameter after a padded bucket
# end is saved with its neighbour's values (its warning that cites "issue #504"). Slice at the
# offsets the gathered tensor has: the parameter's, less the padding of the buckets before it.
# Every device; a checkpoint of one bucket is saved as before.
BUCKET_SHIMS: Sequence[Rewrite] = (
    Rewrite("megatron.core.optimizer.distrib_optimizer",
            "DistributedOptimizer.sharded_param_state_fully_reshardable",
            (("tensors = {}",
              "tensors = {}; padding = buffer.buckets[_].offset - sum("
              "(b.numel_unpadded for b in buffer.buckets[:_]))"),
             ("world_tensors[state_key][param_world_start:param_world_end]",
              "world_tensors[state_key][param_world_start - padding:param_world_end - padding]")),
            "optimizer/distrib_optimizer.py:1501 (0.19: 1790)"),
)
def checkpoint_writers_outlive_sigterm() -> None:
    """megatron-core's checkpoint writers report to a queue served by a manager process it
    spawns at the first save (``filesystem_async._results_queue``, 0.16 and 0.19). A spawned
    process has SIGTERM's default action, so Slurm's SIGTERM to every process of the job
    killed it while a save ran, and the save failed with BrokenPipeError instead of finishing
    (with ``--exit-signal-handler`` the ranks save, then stop). The queue is made here, before
    megatron-core makes it, by a manager that ignores SIGTERM; it ends with the rank.
    Idempotent; every device."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
        manager.start(initializer=signal.signal, initargs=(signal.SIGTERM, signal.SIG_IGN))
        filesystem_async._results_queue = manager.Queue()  # the proxy keeps its manager


_CHECKPOINTS_FIXED = False


def fix_optimizer_checkpoints() -> None:
    """Fix megatron-core's DistributedOptimizer checkpoints: the state of a buffer of several
    buckets (:data:`BUCKET_SHIMS`), and loading on torch's Adam (:data:`TORCH_ADAM_SHIMS`;
    not applied when megatron-core uses TransformerEngine's or apex's optimizer). Idempotent;
    every device."""
    global _CHECKPOINTS_FIXED
    from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE

    if not _CHECKPOINTS_FIXED:
        for shim in (*BUCKET_SHIMS, *(() if HAVE_APEX_OR_TE else TORCH_ADAM_SHIMS)):
            shim.install()
        _CHECKPOINTS_FIXED = True


# What megatron-core 0.16.1's moe_utils imports from TransformerEngine and, without it, leaves
# undefined: its router reads ``te_general_gemm is not None`` (a NameError; 0.19 sets them None).
_MOE_TE_NAMES = ("fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
                 "fused_permute_and_pad_with_probs", "fused_permute_with_probs", "fused_sort_chunks_by_index",
                 "fused_sort_chunks_by_index_with_probs", "fused_topk_with_score_function", "fused_unpermute",
                 "te_general_gemm")


def fix_moe_without_transformer_engine() -> None:
    """megatron-core's MoE layers where TransformerEngine is not installed (0.16.1): the names
    its moe_utils takes from TransformerEngine are None, as 0.19 makes them. Idempotent;
    every device."""
    from megatron.core.transformer.moe import moe_utils

    for name in _MOE_TE_NAMES:
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


def _cpu_all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                           async_op=False):
    """torch's ``all_to_all_single`` with the split sizes megatron's MoE token dispatcher hands
    it on the CPU: CPU tensors, which it moves to NumPy only from a GPU (the binding takes
    sequences of ints)."""
    def ints(sizes):
        return None if sizes is None else [int(s) for s in sizes]

    return _ALL_TO_ALL_SINGLE(output, input, ints(output_split_sizes), ints(input_split_sizes), group=group,
                              async_op=async_op)


_ALL_TO_ALL_SINGLE = torch.distributed.all_to_all_single


def _cpu_get_rng_state(device=-1, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device=-1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _cpu_synchronize(device=None) -> None:
    """CPU work is synchronous: nothing to wait for."""


class CPUStream:
    """Stands in for ``torch.cuda.Stream`` and ``torch.cuda.current_stream()`` on the CPU,
    where work is synchronous: there is nothing to order or wait for."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else CPUEvent()

    def synchronize(self) -> None:
        pass


class CPUEvent:
    """Stands in for a recorded ``torch.cuda.Event`` on the CPU: the work before it is done
    (megatron's MoE token dispatcher synchronizes on one)."""

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


def _cpu_current_stream(device=None) -> CPUStream:
    return CPUStream()


def _cpu_stream(stream=None):
    return contextlib.nullcontext()


def _patch_rng() -> None:
    """tensor_parallel/random.py:41/72: the tracker's fork() (dot_product_attention.py:217,
    transformer_block.py:707, language_model_embedding.py:145) and activation checkpointing
    save and restore the *CPU* generator instead of a CUDA one."""
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = _cpu_get_rng_state
    mrandom._set_cuda_rng_state = _cpu_set_rng_state


def _patch_torch_norm() -> None:
    """transformer/torch_norm.py:32: megatron's torch norms refuse sequence_parallel. Accept it
    and mark the parameters ``sequence_parallel=True`` the way megatron's FusedLayerNorm does,
    so that finalize_model_grads sums their gradients over the tensor-parallel group. The
    project's specs never build this norm (they use ``TSPNorm``, on every device); what does
    is megatron's default final norm under a bare layer spec (Megatron-LM's ``--spec``),
    which on a GPU is TransformerEngine's or apex's."""
    from megatron.core.transformer import torch_norm

    original_new = torch_norm.WrappedTorchNorm.__new__
    if getattr(original_new, "_megatron_tsp", False):
        return

    def __new__(cls, config, *args, **kwargs):
        sequence_parallel = config.sequence_parallel
        if sequence_parallel:
            config = _with(config, sequence_parallel=False)
        norm = original_new(cls, config, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = sequence_parallel
        return norm

    __new__._megatron_tsp = True
    torch_norm.WrappedTorchNorm.__new__ = __new__


def _with(config, **changes):
    import copy

    config = copy.copy(config)
    for key, value in changes.items():
        object.__setattr__(config, key, value)
    return config


def enable_cpu_support() -> None:
    """Make megatron-core's GPTModel + DDP + optimizer + schedules path run on CPU (idempotent;
    for CPU processes only, see the module docstring)."""
    global _ENABLED
    if _ENABLED:
        return
    # utils.py:631, tensor_parallel/mappings.py:91/141/148/181, layers.py:552,
    # distributed/param_and_grad_buffer.py:783/800/806 and every other
    # `device=torch.cuda.current_device()` allocate on the current device: name the CPU.
    torch.cuda.current_device = _cpu_current_device
    # pipeline_parallel/p2p_communication.py:242/398 (batch_p2p_sync) and DDP's
    # free/allocate paths call torch.cuda.synchronize().
    torch.cuda.synchronize = _cpu_synchronize
    # distributed/param_and_grad_buffer.py (0.19: start_grad_sync), distributed_data_parallel.py
    # and Megatron-LM's training.py order work on CUDA streams.
    torch.cuda.Stream = CPUStream
    torch.cuda.current_stream = _cpu_current_stream
    torch.cuda.stream = _cpu_stream
    # transformer/moe/token_dispatcher.py:899 passes the split sizes as CPU tensors here
    torch.distributed.all_to_all_single = _cpu_all_to_all_single
    fix_moe_without_transformer_engine()
    _patch_rng()
    _patch_torch_norm()
    for shim in SHIMS:
        shim.install()
    _ENABLED = True


def cpu_support_enabled() -> bool:
    return _ENABLED


__all__: List[str] = ["enable_cpu_support", "cpu_support_enabled", "fix_optimizer_checkpoints",
                      "fix_moe_without_transformer_engine", "SHIMS", "TORCH_ADAM_SHIMS", "BUCKET_SHIMS"]
