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
from typing import TYPE_CHECKING, Any, Callable, Iterator, List, Mapping, Optional

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig


@dataclass(frozen=True)
class Rule:
    """One setting TSP restricts, of one of three kinds: a *size* the TSP size must divide
    (``divisor`` x D), a *value* TSP needs (``ok(value, D)``, ``must`` says it in words), or a
    *feature* TSP does not implement (any use refused). ``flag``: the Megatron-LM flag; its
    argument name (``--num-experts`` -> ``num_experts``) is the key of configs and of
    Megatron-LM's args. ``attr``: the ``TransformerConfig`` field when it differs from the
    key (None: not on the config). ``layer``: what it concerns (``layout``: TSP's place among
    the parallel dimensions; ``all``, ``attention``, ``mlp``: the TSP layers; ``launch``: only
    the command line has it; the ring MLP in a TP model reads ``all`` and ``mlp``). ``type``:
    how a command-line value reads."""

    flag: str
    why: str
    fix: str
    divisor: int = 0
    ok: Optional[Callable[[Any, int], bool]] = None
    must: str = ""
    attr: Optional[str] = ""
    layer: str = "all"
    type: Callable[[str], Any] = int

    @property
    def feature(self) -> bool:
        return not self.divisor and self.ok is None

    @property
    def key(self) -> str:
        return self.flag[2:].replace("-", "_")

    def config_attr(self) -> Optional[str]:
        return self.key if self.attr == "" else self.attr

    def allows(self, value: Any, tsp_size: int) -> bool:
        if self.divisor:
            return value is None or value % (self.divisor * tsp_size) == 0
        if self.feature:
            return not value
        return self.ok(value, tsp_size)

    def message(self, value: Any, tsp_size: int, name: Optional[str] = None, under: str = "--tsp-size") -> str:
        """One line: the setting (``name``, default the flag), what TSP (``under``: the flag
        that turned TSP's layer on, and whose size D is) needs at this size, why, and the fix."""
        name = name or self.flag
        size_flag = "--tsp-size" if under == "--tsp-size" else "--tensor-model-parallel-size"
        with_ = f"--tsp-size {tsp_size}" if under == "--tsp-size" else f"{under} at {size_flag} {tsp_size}"
        if self.divisor:
            by = f"{size_flag} {tsp_size}" if self.divisor == 1 else \
                f"{self.divisor} x {size_flag} = {self.divisor * tsp_size}"
            return f"{name} {value} is not divisible by {by}: {self.why}; {self.fix}"
        if self.feature:
            return f"{name} cannot be used with {with_}: {self.why}; {self.fix}"
        got = ("on" if value else "off") if isinstance(value, bool) else value
        return f"{name} must be {self.must} with {with_} (got {got}): {self.why}; {self.fix}"


def _size(flag: str, divisor: int, why: str, fix: str, **kw) -> Rule:
    return Rule(flag, why, fix, divisor=divisor, **kw)


def _value(flag: str, must: str, ok: Callable[[Any, int], bool], why: str, **kw) -> Rule:
    return Rule(flag, why, f"set {flag}" + (f" {must}" if must != "on" else ""), ok=ok, must=must, **kw)


def _feature(flag: str, why: str, fix: str = "turn it off", **kw) -> Rule:
    return Rule(flag, why, fix, **kw)


RULES: List[Rule] = [
    # the parallel layout
    _value("--tensor-model-parallel-size", "1", lambda v, d: v in (None, 1), "TSP occupies the tensor-parallel slot",
           attr=None, layer="layout"),
    _value("--context-parallel-size", "1", lambda v, d: v in (None, 1), "TSP already shards the sequence",
           layer="layout"),
    _value("--sequence-parallel", "on", lambda v, d: bool(v), "TSP shards the sequence", layer="layout"),
    _value("--attention-dropout", "0", lambda v, d: not v, "TSP's attention kernel has no dropout",
           layer="attention", type=float),
    # sizes
    _size("--num-attention-heads", 1, "every rank computes whole heads",
          "choose a TSP size that divides the head count", layer="attention"),
    _size("--num-query-groups", 1, "TSP gives every rank whole KV heads",
          "choose a TSP size that divides the KV head count", layer="attention"),
    _size("--ffn-hidden-size", 1, "every rank holds 1/D of the MLP",
          "choose an ffn size that is a multiple of D", layer="mlp"),
    _size("--seq-length", 2, "the zigzag layout gives every rank two chunks", "use a multiple of 2 x the TSP size",
          attr=None, layer="layout"),
    # features TSP does not implement
    _feature("--num-experts", "mixture-of-experts is not implemented", attr="num_moe_experts"),
    _feature("--multi-latent-attention", "multi-latent attention is not implemented"),
    _feature("--mtp-num-layers", "multi-token prediction is not implemented"),
    _feature("--fp8-format", "fp8 is not implemented", attr="fp8"),
    _feature("--fp4-format", "fp4 is not implemented", attr="fp4"),
    _feature("--tp-comm-overlap", "TransformerEngine's TP overlap does not apply to TSP, which overlaps its own"),
    _feature("--attention-output-gate", "gated attention output is not implemented", layer="attention"),
    _feature("--window-size", "sliding-window attention is not implemented", layer="attention"),
    _feature("--mrope-section", "multimodal RoPE is not implemented", layer="attention"),
    _feature("--use-te-activation-func", "the ring MLP applies the activation itself", layer="mlp"),
    _feature("--overlap-param-gather", "TSP's layers send their weights without running the forward pre-hooks that "
             "wait for the distributed optimizer's parameter all-gather", "drop --overlap-param-gather", attr=None),
    Rule("--hybrid-layer-pattern", "Mamba, gated delta net, MLA, DSA and MoE layers are not TSP layers",
         "use attention (*) and MLP (-) layers, with | between pipeline stages",
         ok=lambda v, d: v is None or set(v) <= set("*-|"), must="attention (*) and MLP (-) layers only",
         attr=None, layer="launch", type=str),
    # Megatron-LM command line only
    _feature("--spec", "the TSP layer spec is chosen by --tsp-size", "drop --spec", attr=None, layer="launch"),
    _feature("--use-legacy-models", "TSP needs megatron-core models", "drop --use-legacy-models", attr=None,
             layer="launch"),
    _feature("--sft", "packed (THD) sequences are not implemented", "drop --sft", attr=None, layer="launch"),
    _feature("--overlap-moe-expert-parallel-comm", "mixture-of-experts is not implemented", attr=None,
             layer="launch"),
]


def violations(values: Mapping[str, Any], tsp_size: int, layers=("layout", "all", "attention", "mlp"),
               name: Callable[[Rule], str] = lambda rule: rule.flag, under: str = "--tsp-size") -> Iterator[str]:
    """The message of every rule of ``layers`` that a setting of ``values`` (``{flag: value}``;
    a flag that is not there is not checked) breaks at TSP size ``tsp_size``; ``name(rule)``:
    how the source names the setting; ``under``: see :meth:`Rule.message`."""
    if tsp_size <= 1:
        return
    for rule in RULES:
        if rule.layer in layers and rule.flag in values and not rule.allows(values[rule.flag], tsp_size):
            yield rule.message(values[rule.flag], tsp_size, name(rule), under)


def require(flag: str, value: Any, tsp_size: int, where: str = "", under: str = "--tsp-size") -> None:
    """Raise the one-line ValueError of ``flag``'s rule when ``value`` breaks it (``where``:
    the module or function that found it, as a prefix): for checks made at run time, by code
    that runs only under TSP (at any size)."""
    rule = next(r for r in RULES if r.flag == flag)
    if not rule.allows(value, tsp_size):
        message = rule.message(value, tsp_size, under=under)
        raise ValueError(f"{where}: {message}" if where else message)


def _check_config(config: TransformerConfig, tsp_size: int, module: str, layers, under: str = "--tsp-size",
                  **values) -> None:
    """``values``: settings of the module that override the config's (by key)."""
    if config.tensor_model_parallel_size != tsp_size:
        raise ValueError(
            f"{module}: TransformerConfig.tensor_model_parallel_size={config.tensor_model_parallel_size} "
            f"must equal the size of its group, {tsp_size} (TSP and the ring MLP occupy the tensor-parallel slot)")
    settings = {rule.flag: values[rule.key] if rule.key in values else getattr(config, rule.config_attr())
                for rule in RULES
                if rule.key in values or (rule.config_attr() is not None and hasattr(config, rule.config_attr()))}
    for message in violations(settings, tsp_size, layers, under=under):
        raise ValueError(f"{module}: {message}")


def check_attention_config(config: TransformerConfig, tsp_size: int, attn_mask_type=None) -> None:
    """What ``TSPSelfAttention`` checks at construction (default mask: causal): one ValueError line."""
    from megatron.core.transformer.enums import AttnMaskType

    _check_config(config, tsp_size, "TSPSelfAttention", ("layout", "all", "attention"))
    if attn_mask_type not in (None, AttnMaskType.causal):
        raise ValueError(f"TSPSelfAttention supports causal attention only (got {attn_mask_type.name}); "
                         "use the TSP layer spec, which sets it")


def check_mlp_config(config: TransformerConfig, size: int, ffn_hidden_size: int, under: str = "--tsp-size") -> None:
    """What ``TSPMLP`` checks at construction, in a TSP model or (``under="--ring-mlp"``) as
    the ring MLP of a TP model (``ffn_hidden_size``: the MLP's own, which a spec may set apart
    from the config's). Not the layout rules: the ring is token-wise, so it runs beside
    context parallelism and without sequence parallelism alike."""
    _check_config(config, size, "TSPMLP", ("all", "mlp"), under, ffn_hidden_size=ffn_hidden_size)
