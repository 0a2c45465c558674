"""What TSP supports: one row per Megatron-LM setting that TSP restricts.

Each :class:`Rule` names the flag, says which values TSP accepts at size D, why, and the fix.
Three readers, one wording (:meth:`Rule.message`):

* model build: the TSP layers check their ``TransformerConfig`` (:func:`check_attention_config`,
  :func:`check_mlp_config`), so a wrong model never runs;
* ``megatron-tsp`` configs: ``run.config`` checks the keys it knows (:func:`violations`);
* Megatron-LM: ``megatron_lm.translate_argv`` checks the command line.

Supporting a feature, or restricting one more, is one row here. Imports nothing heavy: the
command line reads it before megatron-core is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, List, Optional

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig


@dataclass(frozen=True)
class Rule:
    """``flag``: the Megatron-LM flag; its argument name (``--num-experts`` ->
    ``num_experts``) is the key of configs and of Megatron-LM's args. ``attr``: the
    ``TransformerConfig`` field, when it differs from the key (None: not on the config).
    ``ok(value, D)``: TSP at size D runs with this value. ``divisor``: a size rule (the value
    must be a multiple of ``divisor`` x D). ``layer``: which TSP layers the rule concerns
    (``all``, ``attention``, ``mlp``; ``launch``: only the command line has it)."""

    flag: str
    ok: Callable[[Any, int], bool]
    why: str
    fix: str
    attr: Optional[str] = ""
    divisor: int = 0
    layer: str = "all"
    type: Callable[[str], Any] = int  # how a command-line value reads
    must: str = ""  # what a value rule requires, in words

    @property
    def feature(self) -> bool:
        """A feature TSP does not implement: any use of the flag is refused."""
        return self.ok is _off

    @property
    def key(self) -> str:
        return self.flag[2:].replace("-", "_")

    def config_attr(self) -> Optional[str]:
        return self.key if self.attr == "" else self.attr

    def message(self, value: Any, tsp_size: int, name: Optional[str] = None) -> str:
        """One line: the setting (``name``, default the flag), what TSP at this size needs,
        why, and the fix."""
        name = name or self.flag
        if self.divisor:
            by = f"--tsp-size {tsp_size}" if self.divisor == 1 else \
                f"{self.divisor} x --tsp-size = {self.divisor * tsp_size}"
            return f"{name} {value} is not divisible by {by}: {self.why}; {self.fix}"
        if self.feature:
            return f"{name} cannot be used with --tsp-size {tsp_size}: {self.why}; {self.fix}"
        got = ("on" if value else "off") if isinstance(value, bool) else value
        return f"{name} must be {self.must} with --tsp-size {tsp_size} (got {got}): {self.why}; {self.fix}"


def _multiple(divisor: int) -> Callable[[Any, int], bool]:
    return lambda value, d: value is None or value % (divisor * d) == 0


def _off(value: Any, d: int) -> bool:
    return not value


RULES: List[Rule] = [
    # the parallel layout
    Rule("--tensor-model-parallel-size", lambda v, d: v in (None, 1), "TSP occupies the tensor-parallel slot",
         "set --tensor-model-parallel-size 1", attr=None, must="1"),
    Rule("--context-parallel-size", lambda v, d: v in (None, 1), "TSP already shards the sequence",
         "set --context-parallel-size 1", must="1"),
    Rule("--sequence-parallel", lambda v, d: bool(v), "TSP shards the sequence", "set --sequence-parallel",
         must="on"),
    Rule("--attention-dropout", lambda v, d: not v, "TSP's attention kernel has no dropout",
         "set --attention-dropout 0", layer="attention", type=float, must="0"),
    # sizes
    Rule("--num-attention-heads", _multiple(1), "every rank computes whole heads",
         "choose a TSP size that divides the head count", divisor=1, layer="attention"),
    Rule("--num-query-groups", _multiple(1), "TSP gives every rank whole KV heads",
         "choose a TSP size that divides the KV head count", divisor=1, layer="attention"),
    Rule("--ffn-hidden-size", _multiple(1), "every rank holds 1/D of the MLP",
         "choose an ffn size that is a multiple of the TSP size", divisor=1, layer="mlp"),
    Rule("--seq-length", _multiple(2), "the zigzag layout gives every rank two chunks",
         "use a multiple of 2 x the TSP size", attr=None, divisor=2),
    # features TSP does not implement
    Rule("--num-experts", _off, "mixture-of-experts is not implemented", "turn it off", attr="num_moe_experts"),
    Rule("--multi-latent-attention", _off, "multi-latent attention is not implemented", "turn it off"),
    Rule("--mtp-num-layers", _off, "multi-token prediction is not implemented", "turn it off"),
    Rule("--fp8-format", _off, "fp8 is not implemented", "turn it off", attr="fp8"),
    Rule("--fp4-format", _off, "fp4 is not implemented", "turn it off", attr="fp4"),
    Rule("--tp-comm-overlap", _off, "TransformerEngine's TP overlap does not apply to TSP, which overlaps its own",
         "turn it off"),
    Rule("--attention-output-gate", _off, "gated attention output is not implemented", "turn it off",
         layer="attention"),
    Rule("--window-size", _off, "sliding-window attention is not implemented", "turn it off", layer="attention"),
    Rule("--mrope-section", _off, "multimodal RoPE is not implemented", "turn it off", layer="attention"),
    Rule("--use-te-activation-func", _off, "TSP's MLP applies the activation itself", "turn it off", layer="mlp"),
    # Megatron-LM command line only
    Rule("--spec", _off, "the TSP layer spec is chosen by --tsp-size", "drop --spec", attr=None, layer="launch"),
    Rule("--use-legacy-models", _off, "TSP needs megatron-core models", "drop --use-legacy-models", attr=None,
         layer="launch"),
    Rule("--sft", _off, "packed (THD) sequences are not implemented", "drop --sft", attr=None, layer="launch"),
]


def violations(get: Callable[[Rule], Any], tsp_size: int, layers=("all", "attention", "mlp"),
               name: Callable[[Rule], str] = lambda rule: rule.flag) -> Iterator[str]:
    """The message of every rule of ``layers`` that ``get(rule)`` (the setting's value, or
    ``KeyError`` where the source does not have it) breaks at TSP size ``tsp_size``;
    ``name(rule)``: how the source names the setting."""
    if tsp_size <= 1:
        return
    for rule in RULES:
        if rule.layer not in layers:
            continue
        try:
            value = get(rule)
        except KeyError:
            continue
        if not rule.ok(value, tsp_size):
            yield rule.message(value, tsp_size, name(rule))


def check_parallel_sizes(
    world_size: int,
    tsp_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    tensor_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
) -> None:
    """Raise a one-line ``ValueError`` naming the flag and the fix; runs no collective."""
    if tsp_size < 1:
        raise ValueError(f"--tsp-size must be >= 1 (got {tsp_size})")
    if pipeline_model_parallel_size < 1:
        raise ValueError(
            f"--pipeline-model-parallel-size must be >= 1 (got {pipeline_model_parallel_size})"
        )
    sizes = {"--tensor-model-parallel-size": tensor_model_parallel_size,
             "--context-parallel-size": context_parallel_size}
    for message in violations(lambda rule: sizes[rule.flag], tsp_size):
        raise ValueError(message)
    model_parallel = (
        tsp_size * tensor_model_parallel_size * context_parallel_size * pipeline_model_parallel_size
    )
    if world_size % model_parallel != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by --tsp-size x "
            f"--pipeline-model-parallel-size (x tensor/context-parallel sizes) = {model_parallel}; "
            f"launch a multiple of {model_parallel} ranks or change the sizes"
        )


def _check_config(config: TransformerConfig, tsp_size: int, module: str, layer: str, **values) -> None:
    """``values``: settings of the module that override the config's (by key)."""
    if config.tensor_model_parallel_size != tsp_size:
        raise ValueError(
            f"{module}: TransformerConfig.tensor_model_parallel_size={config.tensor_model_parallel_size} "
            f"must equal --tsp-size {tsp_size} (TSP occupies the tensor-parallel slot)")

    def get(rule: Rule):
        if rule.key in values:
            return values[rule.key]
        if rule.config_attr() is None or not hasattr(config, rule.config_attr()):
            raise KeyError(rule.flag)
        return getattr(config, rule.config_attr())

    for message in violations(get, tsp_size, ("all", layer)):
        raise ValueError(f"{module}: {message}")


def check_attention_config(config: TransformerConfig, tsp_size: int, attn_mask_type=None) -> None:
    """What ``TSPSelfAttention`` checks at construction (default mask: causal): one ValueError line."""
    from megatron.core.transformer.enums import AttnMaskType

    _check_config(config, tsp_size, "TSPSelfAttention", "attention")
    if attn_mask_type not in (None, AttnMaskType.causal):
        raise ValueError(f"TSPSelfAttention supports causal attention only (got {attn_mask_type.name}); "
                         "use the TSP layer spec, which sets it")


def check_mlp_config(config: TransformerConfig, tsp_size: int, ffn_hidden_size: int) -> None:
    """What ``TSPMLP`` checks at construction (``ffn_hidden_size``: the MLP's own, which a
    spec may set apart from the config's)."""
    _check_config(config, tsp_size, "TSPMLP", "mlp", ffn_hidden_size=ffn_hidden_size)
