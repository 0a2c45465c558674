"""YAML run configs: merging, one-line errors naming the key, Megatron-LM flags, and every
shipped config checked against megatron-core's TransformerConfig."""

import glob
import os
import re

import pytest
from conftest import ROOT

from megatron_tsp.run import config

CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "**", "*.yaml"), recursive=True))
RUN_CONFIGS = [c for c in CONFIGS if "hardware" not in c]


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_extends_merges_and_later_keys_win(tmp_path):
    _write(tmp_path, "base.yaml", "hidden_size: 64\nnum_layers: 2\nmock_data: true\nvocab_size: 8\n")
    child = _write(tmp_path, "child.yaml", "extends: base.yaml\nnum_layers: 4\n")
    assert config.load_config(child) == {"hidden_size": 64, "num_layers": 4, "mock_data": True, "vocab_size": 8}


@pytest.mark.parametrize("text,message", [
    ("hiden_size: 64\n", "unknown key 'hiden_size'"),
    ("num_layers: two\n", "key 'num_layers' must be int"),
    ("extends: self.yaml\n", "'extends' cycle"),
])
def test_bad_files_name_the_key(tmp_path, text, message):
    path = _write(tmp_path, "self.yaml", text)
    with pytest.raises(config.ConfigError, match=message):
        config.load_config(path)


@pytest.mark.parametrize("values,message", [
    (dict(tsp_size=2, tensor_model_parallel_size=2), "--tensor-model-parallel-size 1"),
    # TSP's rules, in the support matrix's words
    (dict(tsp_size=2, seq_length=66), "'seq_length' (--seq-length) 66 is not divisible by 2 x --tsp-size = 4"),
    (dict(tsp_size=2, attention_dropout=0.1), "'attention_dropout' (--attention-dropout) must be 0"),
    (dict(tsp_size=8, num_attention_heads=4), "'num_attention_heads' (--num-attention-heads) 4 is not divisible by "
                                              "--tsp-size 8"),
    (dict(tsp_size=4, tsp_head_groups_per_call=3),
     "'tsp_head_groups_per_call' (--tsp-head-groups-per-call) must be 0 (auto) or a divisor of the TSP size with "
     "--tsp-size 4 (got 3)"),
    (dict(tsp_size=4, tsp_mlp_shards_per_call=2),
     "'tsp_mlp_shards_per_call' (--tsp-mlp-shards-per-call) must be 0 (auto), 1 (the ring) or the TSP size (every "
     "shard gathered) with --tsp-size 4 (got 2)"),
    (dict(tsp_size=2, tsp_lookahead=0),
     "'tsp_lookahead' (--tsp-lookahead) must be 1 or more with --tsp-size 2 (got 0)"),
    # megatron's own
    (dict(tensor_model_parallel_size=8, num_attention_heads=4),
     "'num_attention_heads' (--num-attention-heads) must be divisible by tensor_model_parallel_size"),
    (dict(context_parallel_size=2, seq_length=66), "'seq_length' (--seq-length) must be divisible by 4"),
    (dict(mock_data=False), "'data_path' (--data-path) is required"),
    (dict(bf16=True, fp16=True), "'bf16' (--bf16) cannot be combined with fp16"),
    (dict(hidden_size=66), "'hidden_size' (--hidden-size) 66 must be divisible by num_attention_heads 4"),
    (dict(num_attention_heads=4, group_query_attention=True, num_query_groups=3),
     "'num_query_groups' (--num-query-groups) must divide num_attention_heads"),
    (dict(min_lr=0.1, lr=0.01), "'min_lr' (--min-lr) must be <= lr 0.01"),
    # every mode's attention is causal: a window reaches back only
    (dict(window_size="64,8"), "'window_size' (--window-size) must be W,0 with W >= 0"),
    (dict(window_size="-1,0"), "'window_size' (--window-size) must be W,0 with W >= 0"),
    (dict(window_size="sixty"), "'window_size' (--window-size) must be W,0 with W >= 0"),
    (dict(window_attn_skip_freq=2), "'window_attn_skip_freq' (--window-attn-skip-freq) applies with window_size"),
    # mixture-of-experts: experts folded onto the model-parallel ranks
    (dict(tsp_size=4, num_experts=6, expert_model_parallel_size=3),
     "'expert_model_parallel_size' (--expert-model-parallel-size) must be --tsp-size or a divisor of it"),
    (dict(tsp_size=2, num_experts=3, expert_model_parallel_size=2),
     "'num_experts' (--num-experts) must be divisible by expert_model_parallel_size 2"),
    (dict(num_experts=4, moe_router_topk=5), "'moe_router_topk' (--moe-router-topk) must be at most num_experts 4"),
    (dict(expert_model_parallel_size=2), "'expert_model_parallel_size' (--expert-model-parallel-size) applies with "
                                         "num_experts"),
    (dict(tensor_model_parallel_size=2, sequence_parallel=True, num_experts=4, expert_model_parallel_size=4),
     "must divide tensor_model_parallel_size x context_parallel_size = 2"),
    (dict(tensor_model_parallel_size=2, ring_mlp=True, sequence_parallel=True, num_experts=4),
     "'ring_mlp' (--ring-mlp) with num_experts is not implemented"),
    (dict(moe_ffn_hidden_size=64), "'num_experts' (--num-experts) is needed by the moe_* settings given"),
    (dict(recompute_granularity="selective", recompute_modules=["moe"]),
     "'recompute_modules' (--recompute-modules) must be without moe: the model has no mixture-of-experts layers"),
    (dict(tsp_size=4, num_experts=4, expert_model_parallel_size=4, moe_shared_expert_intermediate_size=6),
     "'moe_shared_expert_intermediate_size' (--moe-shared-expert-intermediate-size) must be divisible by the "
     "model-parallel size 4"),
    (dict(reset_attention_mask=True, transformer_engine_spec=True, tsp_size=1, tensor_model_parallel_size=2,
          sequence_parallel=True), "'reset_attention_mask' (--reset-attention-mask) reaches the attention as the "
                                   "documents' starts"),
])
def test_impossible_combinations_name_the_key(values, message):
    base = dict(mock_data=True, vocab_size=256, attention_dropout=0.0)
    base.update(values)
    with pytest.raises(config.ConfigError, match=re.escape(message)):
        config.resolve(base)


def test_flags_render_in_megatron_lm_form():
    flags = config.to_megatron_flags({"num_layers": 2, "swiglu": True, "bf16": False,
                                      "data_path": ["a", "b"], "lr": 3e-4, "extends": "x",
                                      "check_for_nan_in_loss_and_grad": False})
    assert flags == ["--num-layers", "2", "--swiglu", "--data-path", "a", "b", "--lr", "0.0003",
                     "--no-check-for-nan-in-loss-and-grad"]
    assert config.to_megatron_flags({"check_for_nan_in_loss_and_grad": True}) == []
    # megatron-LM's tuple_type reads "64,0"; a YAML list is written so
    assert config.to_megatron_flags(config.typed({"window_size": [64, 0]}, "x")) == ["--window-size", "64,0"]
    for te, impl in ((True, "transformer_engine"), (False, "local")):
        assert config.to_megatron_flags({"transformer_engine_spec": te}) == ["--transformer-impl", impl]


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=[os.path.relpath(c, ROOT) for c in RUN_CONFIGS])
def test_every_config_resolves_to_a_transformer_config(path):
    from megatron_tsp.device import Device
    from megatron_tsp.run.build import transformer_config

    args = config.resolve(config.load_config(path))
    tc = transformer_config(args, Device("cuda"))  # a config describes a GPU run
    assert not tc.use_cpu_initialization
    assert tc.num_layers == args.num_layers and tc.hidden_size == args.hidden_size
    assert tc.tensor_model_parallel_size == args.tsp_size * args.tensor_model_parallel_size
    assert tc.sequence_parallel == (args.tsp_size > 1 or args.sequence_parallel)
    assert config.to_megatron_flags(config.load_config(path))
