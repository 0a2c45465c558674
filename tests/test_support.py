"""The support matrix: every row stops a Megatron-LM launch, and configs word it the same."""

import pytest

from megatron_tsp import megatron_lm
from megatron_tsp.core.support import RULES
from megatron_tsp.run import config

# a value each value or size rule refuses at --tsp-size 4 (features are refused by their flag alone)
BAD = {"--tensor-model-parallel-size": "2", "--context-parallel-size": "2", "--attention-dropout": "0.1",
       "--num-attention-heads": "6", "--num-query-groups": "6", "--ffn-hidden-size": "6", "--seq-length": "12",
       "--hybrid-layer-pattern": "M*-", "--window-size": "64,8", "--expert-model-parallel-size": "3",
       "--expert-tensor-parallel-size": "2", "--cuda-graph-impl": "local"}
# translate_argv adds --sequence-parallel itself; TSP's own settings are not Megatron-LM flags
ARGV_RULES = [r for r in RULES if r.flag != "--sequence-parallel" and r.layer != "tsp"]


@pytest.mark.parametrize("rule", ARGV_RULES, ids=lambda r: r.flag)
def test_every_rule_stops_the_megatron_lm_launch(rule):
    assert rule.feature or rule.flag in BAD
    with pytest.raises(SystemExit) as exc:
        megatron_lm.translate_argv(["x", "--tsp-size", "4", rule.flag, *([BAD[rule.flag]] if rule.flag in BAD else [])])
    message = str(exc.value)
    assert message.startswith(rule.flag) and "--tsp-size" in message and message.endswith(rule.fix)
    assert "\n" not in message


def test_configs_read_the_same_rows():
    rule = next(r for r in RULES if r.flag == "--attention-dropout")
    with pytest.raises(config.ConfigError) as exc:
        config.resolve(dict(mock_data=True, vocab_size=256, tsp_size=2, attention_dropout=0.1))
    assert str(exc.value) == rule.message(0.1, 2, "'attention_dropout' (--attention-dropout)")


def _non_default(value):
    """A value of the same kind as a field's default, other than it."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "-other"
    if value is None:
        return 2
    return object()


def _default_only_fields():
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_tsp.core import support

    ruled = {rule.config_attr() for rule in RULES}
    return [f for f in dataclasses.fields(TransformerConfig)
            if not (f.name in support.CONFIG_IMPLEMENTED or f.name in support.CONFIG_NEUTRAL or f.name in ruled
                    or f.name.startswith(support.CONFIG_NEUTRAL_PREFIXES))]


def test_every_config_field_tsp_does_not_implement_is_refused_away_from_its_default():
    """An allow-list: softmax_type='learnable' (0.16.1's local attention has it) once gave vanilla
    softmax and no sink without a word (it is implemented now: test_attention, test_gpt). Walk
    TransformerConfig: each field that is neither implemented, nor harmless, nor a rule's is
    refused, at construction, in one line naming it."""
    import dataclasses

    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_tsp.core.support import CONFIG_DERIVED_DEFAULTS, check_attention_config, check_mlp_config

    fields = _default_only_fields()
    names = {f.name for f in fields}
    assert {"no_rope_freq", "qk_l2_norm"} <= names
    base = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                             tensor_model_parallel_size=2, sequence_parallel=True, params_dtype=torch.float32,
                             attention_dropout=0.0)
    check_attention_config(base, 2)  # the defaults pass
    check_mlp_config(base, 2, 256)
    for field in fields:
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        config = dataclasses.replace(base)
        derived = CONFIG_DERIVED_DEFAULTS.get(field.name)
        if derived:  # what Megatron-LM resolves an unset value to passes; anything else does not
            setattr(config, field.name, derived(config))
            check_attention_config(config, 2)
            setattr(config, field.name, 2 * derived(config))
        else:
            setattr(config, field.name, _non_default(default))
        for check, args in ((check_attention_config, (config, 2)), (check_mlp_config, (config, 2, 256))):
            with pytest.raises(ValueError, match=rf"TransformerConfig\.{field.name}=.* leave it at its default") as err:
                check(*args)
            assert "\n" not in str(err.value)
