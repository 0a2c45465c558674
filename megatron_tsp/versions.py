"""The megatron-core releases megatron_tsp runs on, and what differs between them: one place.

| megatron-core | Python  | Megatron-LM tag (training code) | tested with          |
|---------------|---------|---------------------------------|----------------------|
| 0.16.x        | >= 3.10 | core_v0.16.1                    | 0.16.1, Python 3.11  |
| 0.19.x        | >= 3.12 | core_v0.19.0                    | 0.19.2, Python 3.12  |

What 0.16 -> 0.19 changed that TSP meets, and where it is bridged:

* Layers are built with more keyword arguments (``name``, ``pp_layer_offset`` for attention;
  ``pg_collection``, ``is_mtp_layer``, ``name`` for the MLP): the TSP modules take what
  their megatron base class takes and pass it on (``core/attention.py``, ``core/mlp.py``),
  with no version test.
* ``SelfAttention`` refuses q/k norms in the spec when the config has ``qk_layernorm`` off:
  configs say what their specs build (tests).
* Megatron-LM's ``pretrain()`` takes a config container built from the parsed arguments,
  not ``extra_args_provider`` and a model provider; its model builder calls a callable
  ``--spec`` object with the model config (:func:`spec_object`, :func:`run_pretrain_gpt`).
* ``get_batch_on_this_cp_rank`` takes ``is_hybrid_cp``, and its group no longer defaults to
  the context-parallel one (:func:`context_parallel_slice`).
* ``NullTokenizer(n)`` has n ids with end-of-document ``n - 1``, not ``n + 1`` ids
  (:func:`null_tokenizer`).
* The CPU needs two more shims (CUDA streams in the DDP gradient sync, a grad-norm flag
  made on cuda; ``run/compat.py``). Of megatron-core's faults fixed on every device, one
  moved (torch Adam's checkpoint ``step``) and two are gone (MoE without TransformerEngine,
  the experts' gradients at expert-parallel size 1); ``run/upstream.py`` names the releases
  of each.
* ``pretrain_gpt.get_batch`` returns ten values in ``BATCH_KEYS`` order, not six
  (:func:`batch_names`).
* Megatron-LM's CPU shims differ where the code moved (``run/compat_megatron_lm.py``
  names the versions each applies to).

Imports no megatron-core module but ``package_info`` (the command line reads it first).
"""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import os
import sys
from typing import Callable, Dict, List, Optional, Tuple

Version = Tuple[int, int]

# megatron-core minor release -> (oldest Python, the Megatron-LM tag whose training code pairs with it)
SUPPORTED: Dict[Version, Tuple[Tuple[int, int], str]] = {
    (0, 16): ((3, 10), "core_v0.16.1"),
    (0, 19): ((3, 12), "core_v0.19.0"),
}


def _minor(version: str) -> Version:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def megatron_core() -> str:
    """The version of the megatron-core that ``import megatron.core`` loads."""
    from megatron.core.package_info import __version__

    return __version__


def mcore() -> Version:
    """(major, minor) of the megatron-core that ``import megatron.core`` loads."""
    return _minor(megatron_core())


def at_least(major: int, minor: int) -> bool:
    return mcore() >= (major, minor)


def installed_megatron_core() -> Optional[str]:
    """The megatron-core release pip installed (None when none is)."""
    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return None


def checkout_core_version(checkout: str) -> Optional[str]:
    """The megatron-core version of a Megatron-LM checkout (its ``megatron/core/package_info.py``),
    read without importing it; None when the file is not there."""
    path = os.path.join(checkout, "megatron", "core", "package_info.py")
    if not os.path.isfile(path):
        return None
    parts = {}
    for node in ast.parse(open(path, encoding="utf-8").read()).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id in ("MAJOR", "MINOR", "PATCH"):
                    parts[target.id] = node.value.value
    if len(parts) < 3:
        return None
    return f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}"


def checkout_problem(checkout: str, installed: Optional[str] = None,
                     python: Tuple[int, int] = sys.version_info[:2]) -> Optional[str]:
    """One line when the Megatron-LM checkout, the installed megatron-core and this Python do
    not go together (None when they do): the checkout's training code needs the megatron-core
    of its own release, and that release's Python."""
    installed = installed if installed is not None else installed_megatron_core()
    theirs = checkout_core_version(checkout)
    if theirs is None:
        return None  # not a release tree we can read: Megatron-LM's own imports will tell
    tags = ", ".join(f"{tag} (megatron-core {a}.{b}.x, Python >= {p[0]}.{p[1]})"
                     for (a, b), (p, tag) in SUPPORTED.items())
    if _minor(theirs) not in SUPPORTED:
        return (f"the Megatron-LM checkout {checkout} is megatron-core {theirs}, which megatron_tsp does not "
                f"support; check out one of {tags}")
    oldest, tag = SUPPORTED[_minor(theirs)]
    here = f"{python[0]}.{python[1]}"
    if python < oldest:
        return (f"the Megatron-LM checkout {checkout} ({tag}, megatron-core {theirs}) needs Python >= "
                f"{oldest[0]}.{oldest[1]}, this is Python {here}; run it with python{oldest[0]}.{oldest[1]}, "
                f"or check out a tag this Python runs ({tags})")
    if installed is not None and _minor(installed) != _minor(theirs):
        major, minor = _minor(theirs)
        return (f"the Megatron-LM checkout {checkout} is {tag} (megatron-core {theirs}) but the installed "
                f"megatron-core is {installed}; pip install 'megatron-core=={major}.{minor}.*', or check out "
                f"the tag of the installed release ({SUPPORTED.get(_minor(installed), (None, 'none supported'))[1]})")
    return None


# ---- megatron-core ------------------------------------------------------------------------

def context_parallel_slice(batch: dict) -> dict:
    """This context-parallel rank's part of a batch (megatron's ``get_batch_on_this_cp_rank``,
    whose 0.19 form takes ``is_hybrid_cp``, and the group, which would default to the world)."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    if at_least(0, 19):
        return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False,
                                         cp_group=parallel_state.get_context_parallel_group())
    return get_batch_on_this_cp_rank(batch)


def null_tokenizer(vocab_size: int):
    """megatron's NullTokenizer with ``vocab_size`` ids and the end-of-document id after them
    (``vocab_size + 1`` in all): 0.16's meaning of ``NullTokenizer(vocab_size)``. 0.19's puts
    the end-of-document id at ``vocab_size - 1``, on a byte corpus's byte 255."""
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    if at_least(0, 19):
        return NullTokenizer(vocab_size + 1, eod_id=vocab_size)
    return NullTokenizer(vocab_size)


# ---- Megatron-LM's pretrain_gpt.py ------------------------------------------------------

_BATCH_0_16 = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids", "packed_seq_params")


def forget_moe_metrics() -> None:
    """Drop megatron's per-layer MoE metrics (the load-balancing loss of each layer), which it
    sizes by the layer count of the first model that records one: a later model in the same
    process (another plan, test or benchmark mode) with more layers would index past it.
    0.16 keeps them in a dict, 0.19 in a tracker object."""
    if at_least(0, 19):
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

        destroy_moe_metrics_tracker()
    else:
        from megatron.core.transformer.moe import moe_utils

        moe_utils.get_moe_layer_wise_logging_tracker().clear()


def batch_names(namespace: dict) -> List[str]:
    """The names of what ``get_batch`` of a pretrain_gpt.py (its module ``namespace``) returns,
    in order (0.16: six values, the last packed-sequence params; 0.19: ``BATCH_KEYS``)."""
    return list(namespace.get("BATCH_KEYS", _BATCH_0_16))


def spec_object(spec, prepare: Callable[[], None]):
    """What ``--spec MODULE NAME`` must name for Megatron-LM's GPT builder: 0.16 uses the
    object as the layer spec and builds through the model provider, which runs ``prepare``
    (:func:`megatron_tsp.megatron_lm.model_provider`); 0.19 builds from a config container
    with no model provider, and calls a callable spec with the model config before it
    builds, so the spec runs ``prepare`` itself."""
    if not at_least(0, 19):
        return spec

    def build_spec(model_config, vp_stage=None):
        prepare()
        return spec

    build_spec.spec = spec
    return build_spec


def stage_spec_object(build: Callable, prepare: Callable[[], None]):
    """What ``--spec MODULE NAME`` must name for a spec that depends on the model's config and
    its pipeline stage (a block spec: which of the stage's layers are MoE layers), from
    ``build(transformer_config, vp_stage)``. 0.19 calls it with the model config and the
    stage, as :func:`spec_object`'s; 0.16's builder passes the object to the model as it is,
    so there it is a block spec that :func:`resolving_stage_specs` fills for each stage
    before the builder reads it."""
    if at_least(0, 19):
        def build_spec(model_config, vp_stage=None):
            prepare()
            return build(getattr(model_config, "transformer", model_config), vp_stage)

        build_spec.build = build
        return build_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    spec = TransformerBlockSubmodules(layer_specs=[])
    spec.build = build
    return spec


def resolving_stage_specs(builder: Callable) -> Callable:
    """0.16's ``gpt_builder`` (``builder``), with a :func:`stage_spec_object` that ``--spec``
    names filled for the stage being built first."""
    def build_stage(args, pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
        from megatron.core.transformer.spec_utils import import_module
        from megatron.training.arguments import core_transformer_config_from_args
        from megatron.training.yaml_arguments import core_transformer_config_from_yaml

        spec = import_module(args.spec) if args.spec else None
        if hasattr(spec, "build") and hasattr(spec, "layer_specs"):
            if config is None:  # as gpt_builder makes it
                config = core_transformer_config_from_yaml(args, "language_model") if args.yaml_cfg is not None \
                    else core_transformer_config_from_args(args)
            stage = spec.build(config, vp_stage)
            spec.layer_specs, spec.layer_norm = stage.layer_specs, stage.layer_norm
        return builder(args, pre_process, post_process, vp_stage=vp_stage, config=config, pg_collection=pg_collection)

    return build_stage


def run_pretrain_gpt(pretrain_gpt, model_provider, forward_step, extra_args_provider) -> None:
    """What ``pretrain_gpt.py``'s ``__main__`` does, with TSP's model provider, forward step
    and arguments (``sys.argv`` already translated)."""
    from megatron.core.enums import ModelType
    from megatron.training import inprocess_restart, pretrain

    pretrain_gpt.train_valid_test_datasets_provider.is_distributed = True
    run, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)
    defaults = {"tokenizer_type": "GPT2BPETokenizer"}
    if not at_least(0, 19):
        run(pretrain_gpt.train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder,
            forward_step, args_defaults=defaults, extra_args_provider=extra_args_provider, store=store,
            get_embedding_ranks=pretrain_gpt.get_embedding_ranks)
        return
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args(extra_args_provider=extra_args_provider, args_defaults=defaults)
    modelopt = {}
    if pretrain_gpt.has_nvidia_modelopt:
        pretrain_gpt.maybe_enable_modelopt(args)
        if getattr(args, "modelopt_enabled", False):
            modelopt["model_config_cls"] = pretrain_gpt.ModelOptModelConfig
    model_config = gpt_config_from_args(args, **modelopt)
    run(pretrain_cfg_container_from_args(args, model_config), pretrain_gpt.train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder, forward_step, store=store, get_embedding_ranks=pretrain_gpt.get_embedding_ranks)
