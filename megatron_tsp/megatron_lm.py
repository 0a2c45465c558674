"""``--tsp-size`` and ``--ring-mlp`` for Megatron-LM's ``pretrain_gpt.py`` (tags core_v0.16.1
and core_v0.19.0; :mod:`megatron_tsp.versions` says what differs).

TSP rides on Megatron-LM's tensor-parallel slot (docs/design.md section 6):

* :func:`translate_argv` turns ``--tsp-size D`` into ``--tensor-model-parallel-size D
  --sequence-parallel --spec megatron_tsp.megatron_lm <spec>`` before Megatron-LM parses its
  arguments, and rejects flags TSP does not support with one line naming the flag; beside
  ``--tensor-model-parallel-size D`` (with or without ``--sequence-parallel``),
  ``--ring-mlp`` keeps Megatron-LM's attention and puts TSP's ring MLP in the layers;
* :func:`add_tsp_args` declares ``--tsp-size``, ``--ring-mlp`` and ``--tsp-vocab`` for Megatron-LM's parser;
* :func:`zigzag_get_batch` wraps pretrain_gpt's ``get_batch`` so that its own
  ``forward_step`` feeds the TSP ranks the batch in zigzag order (with
  ``--reset-attention-mask``, packed documents found from the EOD tokens instead of the
  dataset's ``[b, 1, S, S]`` mask), and
  :func:`vocab_forward_step` its ``forward_step``, which puts the vocabulary ends in the
  layout ``--tsp-vocab`` chooses;
* the TSP groups are registered before the model is built (:func:`model_provider` on
  0.16, the ``--spec`` object itself on 0.19);
* :func:`prepare_launch` gives the ranks the mode's ``CUDA_DEVICE_MAX_CONNECTIONS`` where
  the user set none (:func:`launch_environment`), and under ``--tsp-size`` Megatron-LM's
  check that it is 1 for tensor parallelism is not applied to TSP's layers
  (:data:`TSP_CONNECTIONS`).

``scripts/pretrain_gpt_tsp.py`` runs all of it with Megatron-LM's own ``pretrain``;
``patches/<tag>/pretrain_gpt_tsp.patch`` wires the same calls into a fork's ``pretrain_gpt.py``;
``python -m megatron_tsp.megatron_lm_run SCRIPT [FLAGS]`` runs any Megatron-LM script (the
stock or a patched ``pretrain_gpt.py``) on this machine's device, the CPU included.
"""

from __future__ import annotations

import os
from functools import lru_cache, wraps
from types import SimpleNamespace
from typing import Dict, List, MutableMapping, Optional

from megatron_tsp import versions
from megatron_tsp.core import vocab
from megatron_tsp.core.documents import document_params
from megatron_tsp.core.parallel_state import adopt_megatron_groups
from megatron_tsp.core.sizes import ParallelSizes
from megatron_tsp.core.spec import get_gpt_block_tsp_spec, get_gpt_layer_tsp_spec, with_ring_mlp
from megatron_tsp.core.support import RULES, require, violations
from megatron_tsp.core.zigzag import ZigzagBatch
from megatron_tsp.env import transformer_engine_version
from megatron_tsp.run import modes
from megatron_tsp.run.upstream import Rewrite


def _register_groups() -> None:
    """Register the TSP groups (or the ring MLP's communicator) on the parallel state
    Megatron-LM initialised: collective, before the model is built."""
    from megatron.training import get_args

    args = get_args()
    if args.tsp_size > 1 or args.ring_mlp:
        adopt_megatron_groups(args.tsp_size, ring_mlp=args.ring_mlp)


def _ring_spec(qk_layernorm: bool, transformer_engine: bool):
    """Megatron-LM's own layer (TransformerEngine's or its local one) with TSP's ring MLP."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    stock = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm) if transformer_engine \
        else get_gpt_layer_local_spec(qk_layernorm=qk_layernorm)
    return with_ring_mlp(stock)


def _block_spec(qk_layernorm: bool):
    """``--num-experts``: this pipeline stage's TSP layers, with megatron's MoE module in
    those ``--moe-layer-freq`` names (:func:`get_gpt_block_tsp_spec`)."""
    def build(config, vp_stage=None):
        return get_gpt_block_tsp_spec(config, vp_stage=vp_stage, qk_layernorm=qk_layernorm)

    return build


# `--spec megatron_tsp.megatron_lm <name>`: Megatron-LM looks these up in the module's namespace.
# The ring MLP's plain names use TransformerEngine's layer where it is installed (Megatron-LM's
# default --transformer-impl), the `_local` ones megatron's local layer.
_HAS_TE = transformer_engine_version() is not None
layer_spec = versions.spec_object(get_gpt_layer_tsp_spec(), _register_groups)
layer_spec_qk_layernorm = versions.spec_object(get_gpt_layer_tsp_spec(qk_layernorm=True), _register_groups)
block_spec = versions.stage_spec_object(_block_spec(False), _register_groups)
block_spec_qk_layernorm = versions.stage_spec_object(_block_spec(True), _register_groups)
ring_layer_spec = versions.spec_object(_ring_spec(False, _HAS_TE), _register_groups)
ring_layer_spec_qk_layernorm = versions.spec_object(_ring_spec(True, _HAS_TE), _register_groups)
ring_layer_spec_local = versions.spec_object(_ring_spec(False, False), _register_groups)
ring_layer_spec_qk_layernorm_local = versions.spec_object(_ring_spec(True, False), _register_groups)


def _value(argv: List[str], flag: str) -> Optional[str]:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv) and not argv[i + 1].startswith("--"):  # a switch has no value
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _int(argv: List[str], flag: str, default: int) -> int:
    value = _value(argv, flag)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"{flag} {value}: not a whole number; give {flag} an integer such as 2") from None


def _present(argv: List[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _given(argv: List[str]):
    """The flags of the support matrix on the command line, with their values."""
    return {rule.flag: True if rule.feature or _value(argv, rule.flag) is None else rule.type(_value(argv, rule.flag))
            for rule in RULES if _present(argv, rule.flag)}


def _ring_argv(argv: List[str]) -> List[str]:
    tp = _int(argv, "--tensor-model-parallel-size", 1)
    if tp < 2:
        raise SystemExit("--ring-mlp needs --tensor-model-parallel-size 2 or more (it rotates the MLP's weight "
                         "shards over the tensor-parallel ranks); set one, or use --tsp-size")
    if _present(argv, "--spec"):
        raise SystemExit("--spec cannot be used with --ring-mlp: the layer spec is chosen by --ring-mlp; drop --spec")
    for message in violations(_given(argv), tp, ("all", "mlp"), under="--ring-mlp"):
        raise SystemExit(message)
    if _present(argv, "--num-experts"):  # the ring's spec has no experts either
        raise SystemExit(f"--num-experts cannot be used with --ring-mlp at --tensor-model-parallel-size {tp}: "
                         "the ring MLP in a mixture-of-experts model is not implemented; drop one")
    spec = "ring_layer_spec_qk_layernorm" if _present(argv, "--qk-layernorm") else "ring_layer_spec"
    if _value(argv, "--transformer-impl") == "local":
        spec += "_local"
    return list(argv) + ["--spec", "megatron_tsp.megatron_lm", spec]


# Megatron-LM asserts CUDA_DEVICE_MAX_CONNECTIONS=1 for tensor parallelism below compute
# capability 10, so that each of its TP collectives is queued ahead of the GEMM it overlaps.
# Under --tsp-size the tensor-parallel slot holds TSP's layers, which run none of those
# collectives: their weight and K/V transfers run on streams of their own beside the compute
# stream, which one hardware queue would serialise (modes.Mode.device_max_connections).
TSP_CONNECTIONS = Rewrite(
    "megatron.training.arguments", "validate_args",
    (("assert os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS') == \"1\"",
      "assert args.tsp_size > 1 or os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS') == \"1\""),),
    "training/arguments.py:951 (0.19: 1437)")


def launch_environment(argv: List[str], environ: MutableMapping[str, str] = os.environ) -> Dict[str, str]:
    """Set what a rank of the job ``argv`` describes needs before CUDA starts, where the user
    set nothing (returns what it set): the mode's ``CUDA_DEVICE_MAX_CONNECTIONS`` (1 for
    tensor and context parallelism, CUDA's default for TSP's streams). Megatron-FSDP and torch
    FSDP2 want it above 1 or unset (Megatron-LM asserts that): left as it is."""
    layout = SimpleNamespace(tsp_size=_int(argv, "--tsp-size", 1),
                             tensor_model_parallel_size=_int(argv, "--tensor-model-parallel-size", 1),
                             context_parallel_size=_int(argv, "--context-parallel-size", 1),
                             sequence_parallel=_present(argv, "--sequence-parallel"),
                             ring_mlp=_present(argv, "--ring-mlp"))
    parallel = max(layout.tsp_size, layout.tensor_model_parallel_size, layout.context_parallel_size) > 1
    fsdp = _present(argv, "--use-megatron-fsdp") or _present(argv, "--use-torch-fsdp2")
    if not parallel or fsdp:
        return {}
    unset = {key: value for key, value in modes.of(layout).environment().items() if key not in environ}
    environ.update(unset)
    return unset


def prepare_launch(argv: List[str]) -> None:
    """What a rank of the job ``argv`` (before :func:`translate_argv`) needs before Megatron-LM
    starts: its :func:`launch_environment`, and under ``--tsp-size`` :data:`TSP_CONNECTIONS`
    (Megatron-LM's checkout on ``sys.path``)."""
    launch_environment(argv)
    if _int(argv, "--tsp-size", 1) > 1:
        _exempt_tsp_from_the_connections_check()


@lru_cache(maxsize=None)
def _exempt_tsp_from_the_connections_check() -> None:
    TSP_CONNECTIONS.install()


def translate_argv(argv: List[str]) -> List[str]:
    """Map ``--tsp-size D`` onto Megatron-LM's tensor-parallel slot, or ``--ring-mlp`` onto the
    ring MLP's layer spec; ``argv[0]`` is kept."""
    tsp = _int(argv, "--tsp-size", 1)
    try:
        ParallelSizes(tsp=tsp).validate()
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if _present(argv, "--ring-mlp") and tsp > 1:
        raise SystemExit("--ring-mlp applies to a tensor-parallel model (TSP's MLP is a ring already); "
                         "drop --ring-mlp or --tsp-size")
    if _present(argv, "--ring-mlp"):
        return _ring_argv(argv)
    if tsp == 1:
        return list(argv)

    world = os.environ.get("WORLD_SIZE")  # torchrun's processes: the size is checked before the model's shapes
    if world is not None and int(world) % tsp:
        raise SystemExit(f"--tsp-size {tsp} does not divide the {world} processes torchrun started (WORLD_SIZE); "
                         "use a divisor of it, or start a multiple of it")
    # the flags on the command line, checked before Megatron-LM parses them
    for message in violations(_given(argv), tsp, ("layout", "all", "attention", "mlp", "launch")):
        raise SystemExit(message)
    if _present(argv, "--reset-attention-mask") and _int(argv, "--pipeline-model-parallel-size", 1) > 1:
        raise SystemExit("--reset-attention-mask cannot be used with --pipeline-model-parallel-size > 1 under "
                         "--tsp-size: pretrain_gpt.py gives later stages no tokens to find the documents in; "
                         "train it with megatron-tsp train, or drop one")
    dropout = _value(argv, "--attention-dropout")
    moe = _present(argv, "--num-experts")
    spec = ("block_spec" if moe else "layer_spec") + ("_qk_layernorm" if _present(argv, "--qk-layernorm") else "")
    out = list(argv)
    out += ["--tensor-model-parallel-size", str(tsp), "--sequence-parallel",
            "--spec", "megatron_tsp.megatron_lm", spec]
    if dropout is None:  # Megatron-LM's default is 0.1
        out += ["--attention-dropout", "0.0"]
    if moe and not _present(argv, "--expert-tensor-parallel-size"):
        out += ["--expert-tensor-parallel-size", "1"]  # experts whole on their ranks; Megatron-LM's default is TP's
    return out


def add_tsp_args(parser):
    """``extra_args_provider`` for Megatron-LM's ``pretrain``."""
    group = parser.add_argument_group(title="TSP (megatron_tsp)")
    group.add_argument("--tsp-size", type=int, default=1,
                       help="TSP size D: weights and tokens sharded over D GPUs (tensor-parallel slot)")
    group.add_argument("--ring-mlp", action="store_true",
                       help="TSP's ring MLP in a TP model: weight shards rotate, no activation collectives")
    group.add_argument("--tsp-vocab", choices=vocab.LAYOUTS, default="auto",
                       help="TSP's embedding and output layer: table (all-gather the vocabulary table, each rank "
                            "scores its own tokens), sequence (sequence-parallel collectives of the activations), "
                            "auto (the one that moves fewer bytes)")
    if not any("--softmax-type" in action.option_strings for action in parser._actions):
        # megatron-core's TransformerConfig.softmax_type, which Megatron-LM 0.16/0.19 have no flag for;
        # core_transformer_config_from_args copies it into the config by name
        group.add_argument("--softmax-type", choices=("vanilla", "off-by-one", "learnable"), default="vanilla",
                           help="attention softmax: off-by-one (a sink logit 0) or learnable (one per head)")
    return parser


def chain_args_providers(*providers):
    """One ``extra_args_provider`` calling several (None entries are skipped)."""
    def provider(parser):
        for p in providers:
            if p is not None:
                parser = p(parser)
        return parser
    return provider


def zigzag_get_batch(get_batch):
    """pretrain_gpt's ``get_batch``, returning the sequence-shaped tensors in zigzag order
    under TSP (``--tsp-size`` > 1), so that pretrain_gpt's own ``forward_step`` feeds each
    TSP rank its two chunks (docs/design.md section 4). The names of what it returns are
    read from its module (:func:`megatron_tsp.versions.batch_names`)."""
    names = versions.batch_names(get_batch.__globals__)
    to_zigzag = lru_cache(maxsize=1)(ZigzagBatch)  # built at the first batch: the arguments are parsed then

    @wraps(get_batch)
    def get_batch_in_zigzag_order(data_iterator, vp_stage=None):
        from megatron.training import get_args, get_tokenizer

        values = get_batch(data_iterator, vp_stage)
        args = get_args()
        if args.tsp_size == 1:
            return values
        batch = dict(zip(names, values))
        packed = batch.get("packed_seq_params", batch.get("cu_seqlens"))
        require("--sft", packed is not None, args.tsp_size, "get_batch")
        if args.reset_attention_mask and batch.get("tokens") is not None:
            # the documents from the whole sequence's EOD tokens, before the zigzag split; no S x S mask
            _documents[:] = [document_params(batch["tokens"], get_tokenizer().eod)]  # this step's, none left over
            batch["attention_mask"] = None
        batch.update(to_zigzag(args.seq_length, args.tsp_size)({k: batch.get(k) for k in (
            "tokens", "labels", "loss_mask", "attention_mask", "position_ids")}))
        return type(values)(batch[name] for name in names)

    return get_batch_in_zigzag_order


# Packed documents (--reset-attention-mask) from get_batch to the model call of the same forward
# step: pretrain_gpt's forward_step passes the model the packed_seq_params it makes itself (0.19
# builds THD ones from cu_seqlens), so a forward pre-hook puts TSP's in their place.
_documents: List = []


def _documents_into_the_model(module, args, kwargs):
    if _documents:
        kwargs["packed_seq_params"] = _documents.pop()
    return args, kwargs


def vocab_forward_step(forward_step):
    """pretrain_gpt's ``forward_step``, which first puts TSP's vocabulary ends in the layout
    ``--tsp-vocab`` chooses (:mod:`megatron_tsp.core.vocab`; parameters untouched, so it can
    happen once the model is built and wrapped, which no hook of 0.19's ``pretrain`` exposes;
    idempotent, so every call does it, for every model chunk and every rebuilt model), and with
    ``--reset-attention-mask`` hands the model the documents :func:`zigzag_get_batch` found."""
    announced = []

    @wraps(forward_step)
    def forward_step_in_vocab_layout(data_iterator, model, *args, **kwargs):
        from megatron.core.utils import unwrap_model
        from megatron.training import get_args, print_rank_0

        a = get_args()
        if a.tsp_size > 1:
            bare = unwrap_model(model)
            layout = vocab.apply_vocab_layout(bare, a.tsp_vocab, a.seq_length * a.micro_batch_size)
            if a.reset_attention_mask and not getattr(bare, "_tsp_documents", False):
                bare.register_forward_pre_hook(_documents_into_the_model, with_kwargs=True)
                bare._tsp_documents = True
            if not announced:
                print_rank_0(f"> TSP vocabulary ends: {layout} layout (--tsp-vocab {a.tsp_vocab})")
                announced.append(layout)
        return forward_step(data_iterator, model, *args, **kwargs)

    return forward_step_in_vocab_layout


def model_provider(*args, **kwargs):
    """Megatron-LM's model provider (gpt_builder), after registering the TSP groups (or the
    ring MLP's communicator). Megatron-LM 0.16's ``pretrain`` builds through it; 0.19's
    ignores model providers (the ``--spec`` object registers the groups there)."""
    from gpt_builders import gpt_builder
    from model_provider import model_provider as megatron_model_provider

    _register_groups()
    return megatron_model_provider(versions.resolving_stage_specs(gpt_builder), *args, **kwargs)


def main() -> None:
    """What pretrain_gpt.py's ``__main__`` does, with TSP's pieces (argv already translated)."""
    import pretrain_gpt

    pretrain_gpt.get_batch = zigzag_get_batch(pretrain_gpt.get_batch)
    modelopt = pretrain_gpt.add_modelopt_args if pretrain_gpt.has_nvidia_modelopt else None
    versions.run_pretrain_gpt(pretrain_gpt, model_provider, vocab_forward_step(pretrain_gpt.forward_step),
                              chain_args_providers(add_tsp_args, modelopt))
