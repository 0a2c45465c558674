"""megatron-core's faults that megatron_tsp corrects on every device, GPUs included, each on the
releases that have it; and the rewriting of megatron's functions that these fixes, the CPU
shims (:mod:`compat`, :mod:`compat_megatron_lm`) and the Megatron-LM integration use.

| fix                                   | corrects                                        | megatron-core | applied by |
|---------------------------------------|-------------------------------------------------|---------------|------------|
| BUCKET_FIXES                          | optimizer state of several buckets saved offset | 0.16, 0.19    | (1)        |
| TORCH_ADAM_FIXES                      | torch Adam's per-parameter ``step`` at load     | 0.16, 0.19    | (1)        |
| checkpoint_writers_outlive_sigterm    | SIGTERM kills the writers' queue mid-save       | 0.16, 0.19    | (2)        |
| fix_moe_without_transformer_engine    | the MoE router's NameError without TE           | below 0.19    | (3)        |
| fix_torch_fsdp2_grad_sync             | --use-torch-fsdp2's first gradient sync fails   | below 0.19    | (5)        |
| core.moe.SequenceShardedMoELayer      | experts at EP 1, ETP < TP: own tokens' grads    | below 0.19    | (4)        |

(1) :func:`fix_optimizer_checkpoints`, by ``checkpointing.save`` and ``load`` and by
``megatron_lm_run.prepare_device``; the torch Adam fixes only where megatron-core has neither
TransformerEngine's nor apex's optimizer. (2) ``checkpointing.save``,
``megatron_lm_run.prepare_device``. (3) ``build.initialize`` of a model with experts,
``compat.enable_cpu_support``. (4) ``core/spec.stage_layers``: the class is in ``core``, which
imports no ``run`` module, and is listed here only. (5) ``step.build_model`` of a torch FSDP2
model (the cp-fsdp mode), ``megatron_lm_run.prepare_device``.

Each fix says what megatron-core does wrong and why the fix is right. The releases come from
reading megatron-core 0.16.1's and 0.19.2's sources: a fix of "0.16, 0.19" runs on those only,
so a release not read yet runs megatron-core's own code rather than a correction of code that
may have changed; "below 0.19" is a fault 0.19 corrected itself. A rewrite whose text is gone
from a release it names raises (:class:`Rewrite`) instead of running the stock code.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import multiprocessing
import signal
import sys
import textwrap
from dataclasses import dataclass
from multiprocessing.managers import SyncManager
from typing import Any, Callable, Dict, List, Sequence, Tuple

from megatron_tsp import versions

Release = Tuple[int, int]
_0_16, _0_19 = (0, 16), (0, 19)


def _on(releases: Tuple[Release, ...]) -> bool:
    """Whether the loaded megatron-core is one of ``releases`` (empty: every release)."""
    return not releases or versions.mcore() in releases


@dataclass(frozen=True)
class Rewrite:
    """Recompile ``module.qualname`` with each ``old`` string replaced by ``new``, on the
    megatron-core releases of ``versions`` ((major, minor) pairs; empty: every release).
    A replacement whose ``old`` is not in the source raises: the code it corrects moved."""

    module: str
    qualname: str
    replacements: Tuple[Tuple[str, str], ...]
    upstream: str  # file:line upstream (0.16.1 where not said), for the reader
    versions: Tuple[Release, ...] = ()

    def applies(self) -> bool:
        return _on(self.versions)

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
                    f"megatron_tsp: '{old}' not found in {self.module}.{self.qualname} ({self.upstream}) of "
                    f"megatron-core {versions.megatron_core()}; this release is not supported"
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
    versions: Tuple[Release, ...] = ()

    def applies(self) -> bool:
        return _on(self.versions)

    def install(self) -> None:
        if not self.applies():
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
            raise RuntimeError(f"megatron_tsp: none of {[old for old, _ in self.replacements]} in {self.module} of "
                               f"megatron-core {versions.megatron_core()}; this release is not supported")


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
    code = compile(factory, f"<megatron_tsp rewrite of {func.__module__}.{func.__qualname__}>", "exec")
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


# ---- the distributed optimizer's checkpoints ----------------------------------------------------

# megatron-core saves the fully_reshardable optimizer state of the wrong elements when a buffer
# has more than one bucket (--overlap-grad-reduce with buckets smaller than the model): it
# gathers each bucket without its end padding, one after the other, but slices the result at
# the buffer's padded offsets, so every parameter after a padded bucket end is saved with its
# neighbour's values (its warning that cites "issue #504"). Slice at the offsets the gathered
# tensor has: the parameter's, less the padding of the buckets before it. 0.19.2 gathers and
# slices as 0.16.1 does. A checkpoint of one bucket is saved as before.
BUCKET_FIXES: Sequence[Rewrite] = (
    Rewrite("megatron.core.optimizer.distrib_optimizer",
            "DistributedOptimizer.sharded_param_state_fully_reshardable",
            (("tensors = {}",
              "tensors = {}; padding = buffer.buckets[_].offset - sum("
              "(b.numel_unpadded for b in buffer.buckets[:_]))"),
             ("world_tensors[state_key][param_world_start:param_world_end]",
              "world_tensors[state_key][param_world_start - padding:param_world_end - padding]")),
            "optimizer/distrib_optimizer.py:1501 (0.19: 1790)", (_0_16, _0_19)),
)

# megatron-core checkpoints the DistributedOptimizer assuming TransformerEngine's or apex's
# Adam. On torch's Adam (every CPU, and GPUs without either) the per-parameter state also
# holds a "step" tensor, which loading gets wrong twice, in 0.16.1 and 0.19.2 alike.
TORCH_ADAM_FIXES: Sequence[Rewrite] = (
    # The resharding format has no per-parameter "step" (it comes from the param groups):
    # 0.16 copies every state tensor, 0.19 looks each one up in the loaded state.
    Rewrite("megatron.core.optimizer.distrib_optimizer",
            "DistributedOptimizer._set_main_param_and_optimizer_states",
            (("dst_tensors[key].copy_(tensors[key])",
              "if key != 'step': dst_tensors[key].copy_(tensors[key])"),),
            "optimizer/distrib_optimizer.py:940", (_0_16,)),
    Rewrite("megatron.core.optimizer.distrib_optimizer",
            "DistributedOptimizer._set_main_param_and_optimizer_states",
            (("if not isinstance(tensors[key], torch.Tensor):",
              "if key == 'step' or not isinstance(tensors[key], torch.Tensor):"),),
            "optimizer/distrib_optimizer.py:1223 (0.19)", (_0_19,)),
    # One "step" tensor was shared by every parameter, so torch's Adam advanced it once
    # per parameter per step and the bias correction drifted after a resume.
    Rewrite("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.load_state_dict",
            (('s["step"] = step', 's["step"] = step.clone()'),),
            "optimizer/distrib_optimizer.py:820 (0.19: 1032)", (_0_16, _0_19)),
)

_CHECKPOINTS_FIXED = False


def fix_optimizer_checkpoints() -> None:
    """Fix megatron-core's DistributedOptimizer checkpoints: the state of a buffer of several
    buckets (:data:`BUCKET_FIXES`), and loading on torch's Adam (:data:`TORCH_ADAM_FIXES`;
    not applied when megatron-core uses TransformerEngine's or apex's optimizer). Idempotent;
    every device."""
    global _CHECKPOINTS_FIXED
    from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE

    if not _CHECKPOINTS_FIXED:
        for fix in (*BUCKET_FIXES, *(() if HAVE_APEX_OR_TE else TORCH_ADAM_FIXES)):
            fix.install()
        _CHECKPOINTS_FIXED = True


def checkpoint_writers_outlive_sigterm() -> None:
    """megatron-core's checkpoint writers report to a queue served by a manager process it
    spawns at the first save (``filesystem_async._results_queue``, made by
    ``_get_write_results_queue`` in 0.16.1 and ``get_write_results_queue`` in 0.19.2). A
    spawned process has SIGTERM's default action, so Slurm's SIGTERM to every process of the
    job killed it while a save ran, and the save failed with BrokenPipeError instead of
    finishing (with ``--exit-signal-handler`` the ranks save, then stop). The queue is made
    here, before megatron-core makes it, by a manager that ignores SIGTERM; it ends with the
    rank. Idempotent; every device."""
    if not _on((_0_16, _0_19)):
        return
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
        manager.start(initializer=signal.signal, initargs=(signal.SIGTERM, signal.SIG_IGN))
        filesystem_async._results_queue = manager.Queue()  # the proxy keeps its manager


def fix_torch_fsdp2_grad_sync() -> None:
    """megatron-core's ``finalize_model_grads`` calls every chunk's
    ``finish_grad_sync(force_all_reduce=...)``, which ``TorchFullyShardedDataParallel`` (its
    base class's, a no-op) does not take below 0.19: a ``--use-torch-fsdp2`` model fails at
    its first step's gradient sync. 0.19 gives the class the argument and ignores it (FSDP2
    reduce-scatters the gradients in its own backward hooks); below 0.19 the class gets that
    method. Idempotent; every device."""
    if versions.at_least(0, 19):
        return
    from megatron.core.distributed.torch_fully_sharded_data_parallel import TorchFullyShardedDataParallel

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """FSDP2's gradients are reduce-scattered by its backward hooks: nothing to finish."""

    TorchFullyShardedDataParallel.finish_grad_sync = finish_grad_sync


# ---- mixture of experts -------------------------------------------------------------------------

# What megatron-core 0.16.1's moe_utils imports from TransformerEngine and, without it, leaves
# undefined: its router reads ``te_general_gemm is not None`` (a NameError). 0.19 sets them None.
_MOE_TE_NAMES = ("fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
                 "fused_permute_and_pad_with_probs", "fused_permute_with_probs", "fused_sort_chunks_by_index",
                 "fused_sort_chunks_by_index_with_probs", "fused_topk_with_score_function", "fused_unpermute",
                 "te_general_gemm")


def fix_moe_without_transformer_engine() -> None:
    """megatron-core's MoE layers where TransformerEngine is not installed (below 0.19): the
    names its moe_utils takes from TransformerEngine are None, as 0.19 makes them. Idempotent;
    every device."""
    if versions.at_least(0, 19):
        return
    from megatron.core.transformer.moe import moe_utils

    for name in _MOE_TE_NAMES:
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)
