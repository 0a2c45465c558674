"""``--tsp-size`` and ``--ring-mlp`` for Megatron-LM's ``pretrain_gpt.py`` (tag core_v0.16.1).

TSP rides on Megatron-LM's tensor-parallel slot (docs/design.md section 6):

* :func:`translate_argv` turns ``--tsp-size D`` into ``--tensor-model-parallel-size D
  --sequence-parallel --spec megatron_tsp.megatron_lm <spec>`` before Megatron-LM parses its
  arguments, and rejects flags TSP does not support with one line naming the flag; beside
  ``--tensor-model-parallel-size D`` (with or without ``--sequence-parallel``),
  ``--ring-mlp`` keeps Megatron-LM's attention and puts TSP's ring MLP in the layers;
* :func:`add_tsp_args` declares ``--tsp-size`` (``pretrain(extra_args_provider=...)``);
* :func:`forward_step` is pretrain_gpt's, with the batch put into zigzag order;
* :func:`model_provider` registers the TSP groups before building the model.

``scripts/pretrain_gpt_tsp.py`` runs all of it with Megatron-LM's own ``pretrain``;
``patches/pretrain_gpt_tsp.patch`` wires the same calls into a fork's ``pretrain_gpt.py``.
Importing this module needs a Megatron-LM checkout on ``sys.path`` only for
:func:`forward_step`, :func:`model_provider` and :func:`main`.
"""

from __future__ import annotations

from functools import partial
from typing import List, Optional

from megatron_tsp.core.parallel_state import adopt_megatron_groups
from megatron_tsp.core.sizes import ParallelSizes
from megatron_tsp.core.spec import get_gpt_layer_tsp_spec, with_ring_mlp
from megatron_tsp.core.support import RULES, require, violations
from megatron_tsp.core.zigzag import zigzag_batch
from megatron_tsp.env import transformer_engine_version

# `--spec megatron_tsp.megatron_lm <name>`: Megatron-LM imports these objects as they are.
layer_spec = get_gpt_layer_tsp_spec()
layer_spec_qk_layernorm = get_gpt_layer_tsp_spec(qk_layernorm=True)
RING_SPECS = {"ring_layer_spec": False, "ring_layer_spec_qk_layernorm": True}  # name -> qk_layernorm


def __getattr__(name: str):
    """The ring MLP's layer specs, built when Megatron-LM imports them: Megatron-LM's own
    layer (TransformerEngine's where it is installed, else its local one) with TSP's ring MLP."""
    if name not in RING_SPECS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    qk = RING_SPECS[name]
    stock = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk) if transformer_engine_version() \
        else get_gpt_layer_local_spec(qk_layernorm=qk)
    return with_ring_mlp(stock)


def _value(argv: List[str], flag: str) -> Optional[str]:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv) and not argv[i + 1].startswith("--"):  # a switch has no value
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _present(argv: List[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _given(argv: List[str]):
    """The flags of the support matrix on the command line, with their values."""
    return {rule.flag: True if rule.feature or _value(argv, rule.flag) is None else rule.type(_value(argv, rule.flag))
            for rule in RULES if _present(argv, rule.flag)}


def _ring_argv(argv: List[str]) -> List[str]:
    tp = int(_value(argv, "--tensor-model-parallel-size") or 1)
    if tp < 2:
        raise SystemExit("--ring-mlp needs --tensor-model-parallel-size 2 or more (it rotates the MLP's weight "
                         "shards over the tensor-parallel ranks); set one, or use --tsp-size")
    if _present(argv, "--spec"):
        raise SystemExit("--spec cannot be used with --ring-mlp: the layer spec is chosen by --ring-mlp; drop --spec")
    for message in violations(_given(argv), tp, ("all", "mlp"), under="--ring-mlp"):
        raise SystemExit(message)
    spec = "ring_layer_spec_qk_layernorm" if _present(argv, "--qk-layernorm") else "ring_layer_spec"
    return list(argv) + ["--spec", "megatron_tsp.megatron_lm", spec]


def translate_argv(argv: List[str]) -> List[str]:
    """Map ``--tsp-size D`` onto Megatron-LM's tensor-parallel slot, or ``--ring-mlp`` onto the
    ring MLP's layer spec; ``argv[0]`` is kept."""
    size = _value(argv, "--tsp-size")
    tsp = int(size) if size is not None else 1
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

    # the flags on the command line, checked before Megatron-LM parses them
    for message in violations(_given(argv), tsp, ("layout", "all", "attention", "mlp", "launch")):
        raise SystemExit(message)
    dropout = _value(argv, "--attention-dropout")
    spec = "layer_spec_qk_layernorm" if _present(argv, "--qk-layernorm") else "layer_spec"
    out = list(argv)
    out += ["--tensor-model-parallel-size", str(tsp), "--sequence-parallel",
            "--spec", "megatron_tsp.megatron_lm", spec]
    if dropout is None:  # Megatron-LM's default is 0.1
        out += ["--attention-dropout", "0.0"]
    return out


def add_tsp_args(parser):
    """``extra_args_provider`` for Megatron-LM's ``pretrain``."""
    group = parser.add_argument_group(title="TSP (megatron_tsp)")
    group.add_argument("--tsp-size", type=int, default=1,
                       help="TSP size D: weights and tokens sharded over D GPUs (tensor-parallel slot)")
    group.add_argument("--ring-mlp", action="store_true",
                       help="TSP's ring MLP in a TP model: weight shards rotate, no activation collectives")
    return parser


def chain_args_providers(*providers):
    """One ``extra_args_provider`` calling several (None entries are skipped)."""
    def provider(parser):
        for p in providers:
            if p is not None:
                parser = p(parser)
        return parser
    return provider


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """pretrain_gpt's forward step with the batch in zigzag order for the TSP ranks."""
    import pretrain_gpt
    from megatron.core.utils import get_attr_wrapped_model
    from megatron.training import get_args

    require("--overlap-moe-expert-parallel-comm", return_schedule_plan, get_args().tsp_size, "forward_step")
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, attention_mask, position_ids, packed = pretrain_gpt.get_batch(data_iterator, vp_stage)
    require("--sft", packed is not None, get_args().tsp_size, "forward_step")
    batch = zigzag_batch(dict(tokens=tokens, labels=labels, loss_mask=loss_mask,
                              attention_mask=attention_mask, position_ids=position_ids),
                         get_args().tsp_size)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"], loss_mask=batch["loss_mask"])
    return output, partial(pretrain_gpt.loss_func, batch["loss_mask"], model=model)


def model_provider(*args, **kwargs):
    """Megatron-LM's model provider (gpt_builder), after registering the TSP groups (or the
    ring MLP's communicator)."""
    from gpt_builders import gpt_builder
    from megatron.training import get_args
    from model_provider import model_provider as megatron_model_provider

    args = get_args()
    if args.tsp_size > 1 or args.ring_mlp:
        adopt_megatron_groups(args.tsp_size, ring_mlp=args.ring_mlp)
    return megatron_model_provider(gpt_builder, *args, **kwargs)


def main() -> None:
    """What pretrain_gpt.py's ``__main__`` does, with TSP's pieces (argv already translated)."""
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training import inprocess_restart, pretrain

    pretrain_gpt.train_valid_test_datasets_provider.is_distributed = True
    run, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)
    modelopt = pretrain_gpt.add_modelopt_args if pretrain_gpt.has_nvidia_modelopt else None
    run(
        pretrain_gpt.train_valid_test_datasets_provider,
        model_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
        extra_args_provider=chain_args_providers(add_tsp_args, modelopt),
        store=store,
        get_embedding_ranks=pretrain_gpt.get_embedding_ranks,
    )
