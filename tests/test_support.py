"""The support matrix: every row stops a Megatron-LM launch, and configs word it the same."""

import pytest

from megatron_tsp import megatron_lm
from megatron_tsp.core.support import RULES
from megatron_tsp.run import config

# a value each value or size rule refuses at --tsp-size 4 (features are refused by their flag alone)
BAD = {"--tensor-model-parallel-size": "2", "--context-parallel-size": "2", "--attention-dropout": "0.1",
       "--num-attention-heads": "6", "--num-query-groups": "6", "--ffn-hidden-size": "6", "--seq-length": "12",
       "--hybrid-layer-pattern": "M*-"}
ARGV_RULES = [r for r in RULES if r.flag != "--sequence-parallel"]  # translate_argv adds that flag itself


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


@pytest.mark.parametrize("layout", [dict(tsp_size=2), dict(tensor_model_parallel_size=2, sequence_parallel=True,
                                                         ring_mlp=True)], ids=["tsp", "ring-mlp"])
def test_overlap_param_gather_is_refused_where_layers_skip_megatrons_pre_hooks(layout):
    with pytest.raises(config.ConfigError, match=r"'overlap_param_gather' \(--overlap-param-gather\) cannot be used"):
        config.resolve(dict(mock_data=True, vocab_size=256, attention_dropout=0.0, overlap_param_gather=True,
                            use_distributed_optimizer=True, **layout))
    config.resolve(dict(mock_data=True, vocab_size=256, overlap_param_gather=True, use_distributed_optimizer=True,
                        tensor_model_parallel_size=2, sequence_parallel=True))  # stock TP+SP runs its hooks
