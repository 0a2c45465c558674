"""`megatron-tsp plan`: the bisection lands on the boundary the planner itself draws, and the
fastest fitting recompute choice is the one marked."""

import dataclasses
import os

import pytest
from conftest import ROOT

from megatron_tsp.measure import perfmodel, plan

H100 = perfmodel.load_hardware(os.path.join(ROOT, "configs", "hardware", "h100.yaml"))
TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=8, ffn_hidden_size=256, seq_length=2048,
            position_embedding_type="rope", normalization="RMSNorm", disable_bias_linear=True,
            attention_dropout=0.0, hidden_dropout=0.0, bf16=True, tsp_size=4, mock_data=True, vocab_size=1000,
            use_distributed_optimizer=True,
            tsp_head_groups_per_call=4, tsp_mlp_shards_per_call=4)  # as auto: the model's choice is tested below


def _gpu_with_room_for(values, mode, seq):
    """An H100 whose usable memory ends at the full-recompute peak of ``seq`` tokens."""
    probe = plan.Planner(values, H100, 1, 2, "overlap").point(mode, plan.LEAST_MEMORY, seq)["peak_gib"]
    memory = (probe + perfmodel.RESERVE_GIB) / (1 - perfmodel.RESERVE_FRACTION)
    return dataclasses.replace(H100, memory_gib=memory)


@pytest.mark.parametrize("mode", ["tsp", "tp-sp"])
def test_bisection_finds_the_boundary(mode):
    hw = _gpu_with_room_for(TINY, mode, 13 * plan.GRANULARITY)
    planner = plan.Planner(TINY, hw, 1, 2, "overlap")
    longest = planner.longest(mode, start=TINY["seq_length"])
    assert longest is not None and longest % plan.GRANULARITY == 0
    assert planner.point(mode, plan.LEAST_MEMORY, longest)["fits"]
    assert not planner.point(mode, plan.LEAST_MEMORY, longest + plan.GRANULARITY)["fits"]


def test_nothing_fits_on_a_gpu_too_small():
    hw = dataclasses.replace(H100, memory_gib=perfmodel.RESERVE_GIB)
    assert plan.Planner(TINY, hw, 1, 2, "overlap").longest("tsp", start=2048) is None


def test_the_fastest_fitting_choice_is_marked():
    roomy = plan.Planner(TINY, H100, 1, 2, "overlap").at("tp-sp", 2048)
    assert set(roomy["choices"]) == set(plan.CHOICES) - {"selective moe"}  # a dense model
    assert "selective core_attn" not in plan.Planner(TINY, H100, 1, 2, "overlap").at("tsp", 2048)["choices"]
    assert all(r["fits"] for r in roomy["choices"].values()) and roomy["best"] == "none"
    # recomputation costs time and saves memory
    assert roomy["choices"]["full"]["tokens_per_s"] < roomy["choices"]["none"]["tokens_per_s"]
    assert roomy["choices"]["full"]["peak_gib"] < roomy["choices"]["none"]["peak_gib"]
    # a GPU with room for full recompute only: it is the one marked
    tight = plan.Planner(TINY, _gpu_with_room_for(TINY, "tp-sp", 2048), 1, 2, "overlap").at("tp-sp", 2048)
    assert [c for c, r in tight["choices"].items() if r["fits"]] == ["full"] and tight["best"] == "full"


def test_tsps_calls_are_the_models_choice_where_the_config_leaves_them_to_auto():
    """At a length's choices TSP's head groups and MLP shards per call are perfmodel's choice
    (test_perfmodel.py tests the choice); the bisection keeps the runtime's auto."""
    auto = dict(TINY, tsp_size=2, tsp_head_groups_per_call=0, tsp_mlp_shards_per_call=0, num_attention_heads=8)
    planner = plan.Planner(auto, H100, 1, 2, "overlap")
    chosen = planner.point("tsp", "full", 2048, choose=True)
    assert chosen["tsp_setting"]["tsp_head_groups_per_call"] in (1, 2)
    assert chosen["tsp_setting"]["tsp_mlp_shards_per_call"] in (1, 2)
    assert planner.point("tsp", "full", 2048)["tsp_setting"] is None
    assert plan.Planner(TINY, H100, 1, 2, "overlap").point("tsp", "full", 2048, choose=True)["tsp_setting"] is None


@pytest.mark.parametrize("config,mode,recompute,layers", [
    (None, "tsp", {}, 4),
    ("7b/128k-tsp8.yaml", "tp-sp-ring", {}, 4),
    (None, "tsp", dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2), 8),
    (None, "tsp", dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=3), 6),
    # every second layer global: a window layer and a global one per unit
    (None, "tsp", dict(window_size="16,0", window_attn_skip_freq=2), 8),
    (None, "tp-sp", dict(window_size="16,0", window_attn_skip_freq=2, recompute_granularity="full",
                         recompute_method="block", recompute_num_layers=1), 7),
], ids=["tiny-tsp", "7b-128k-ring-full-recompute", "uniform-2", "block-3", "window-2", "window-2-block-1"])
def test_peak_memory_and_flops_extrapolate_exactly_in_the_layer_count(config, mode, recompute, layers):
    """The 7B's ring MLP at 128K with full recompute keeps GELU's output for its layer's
    backward; a one-layer plan's peak falls elsewhere, and a line through 1 and 2 layers put
    4 layers 0.11 GiB high (32 layers 1.7 GiB). Uniform recompute of 2 layers could not be
    planned at 3 (IndexError in megatron), and block recompute of the first 3 counted every
    layer as recomputed: memory.planned_layers. Interleaved window and global layers
    (window_attn_skip_freq) are planned in whole periods."""
    from megatron_tsp.measure import memory
    from megatron_tsp.run import config as cfg

    base = TINY if config is None else cfg.load_config(os.path.join(ROOT, "configs", config))
    values = dict(base, num_layers=layers, **recompute)
    # the last rank of 2; a GPU's kernels, as the counts plan them (TSP's head groups per call follow them)
    plans = {rank: memory.plan(dict(values), mode, rank=rank, attention_backend="gpu") for rank in (0, 1)}
    total = perfmodel.totals_for(perfmodel.layer_counts(values, mode), layers)
    assert total["peak_gib"] == pytest.approx(max(p["peak_gib"] for p in plans.values()), rel=1e-9)
    # the slowest rank's (a window's first chunk sees fewer keys: rank 0 does less attention)
    assert total["flops"] == pytest.approx(max(p["flops_per_rank"] for p in plans.values()), rel=1e-9)


def test_a_mixture_of_experts_model_is_planned_with_balanced_routing():
    """Every expert gets T k / E of a rank's T routed tokens (megatron's drop-and-pad at
    capacity 1, static shapes under FakeTensorMode): the expert GEMMs' FLOPs are those of
    T k tokens, whatever E, and one MoE layer costs what a dense MLP of k experts' width does."""
    from megatron_tsp.measure import memory

    dense = memory.plan(dict(TINY, num_layers=2), "tsp")
    flops = {}
    for experts, k in ((4, 2), (8, 2)):
        moe = dict(TINY, num_layers=2, num_experts=experts, moe_router_topk=k, expert_model_parallel_size=2,
                   moe_ffn_hidden_size=TINY["ffn_hidden_size"] // k)
        flops[experts] = memory.plan(moe, "tsp")["flops_per_rank"]
    # the router's [T, h] x [h, E] GEMM is all that grows with E (forward and two backward GEMMs)
    tokens = TINY["seq_length"] // TINY["tsp_size"]  # this rank's, micro-batch 1
    assert flops[8] - flops[4] == 2 * 3 * 2 * tokens * TINY["hidden_size"] * 4
    router = 2 * 3 * 2 * tokens * TINY["hidden_size"] * 4
    assert abs(flops[4] - router - dense["flops_per_rank"]) < 0.02 * dense["flops_per_rank"]


def test_mixture_of_experts_models_may_recompute_their_moe_layers():
    """megatron's ``moe`` recompute module (the MoE layer whole) is a choice for MoE models
    only; it keeps less than no recompute and more than full recompute."""
    moe = dict(TINY, num_experts=4, moe_router_topk=2, expert_model_parallel_size=2)
    assert "selective moe" not in plan.Planner(TINY, H100, 1, 2, "overlap").choices("tsp")
    rows = plan.Planner(moe, H100, 1, 2, "overlap").at("tsp", 2048)["choices"]
    assert rows["full"]["peak_gib"] < rows["selective moe"]["peak_gib"] < rows["none"]["peak_gib"]


@pytest.mark.parametrize("settings,flag,message", [
    (dict(moe_token_dispatcher_type="allgather"), {}, "with the alltoall dispatcher only"),
    ({}, dict(per_layer=True), "--per-layer: the activation formula it compares against is a dense layer's"),
])
def test_what_the_planner_does_not_plan_of_experts_is_one_line(settings, flag, message):
    from megatron_tsp.errors import ConfigError
    from megatron_tsp.measure import memory

    moe = dict(TINY, num_experts=4, moe_router_topk=2, expert_model_parallel_size=2, **settings)
    with pytest.raises(ConfigError, match=message):
        memory.plan(moe, "tsp", **flag)


def test_plan_says_what_it_plans_while_it_works(monkeypatch):
    """plan printed nothing for minutes (547 s for the 7B at 128K on an idle 2-core machine):
    each mode's start, with what it will plan, and each point before it is planned."""
    from megatron_tsp.measure import perfmodel as model

    def evaluate(values, mode, hw, world, cp, brief=False, **_):  # peak grows with S: 64K fits
        peak = values["seq_length"] / 1024
        return {"peak_gib": peak, **{k: {"tokens_per_s_cluster": 1.0, "step_s": 1.0, "mfu": 0.5}
                                     for k in model.SCENARIOS}}

    monkeypatch.setattr(model, "evaluate", evaluate)
    said = []
    result = plan.plan(os.path.join(ROOT, "configs", "7b", "128k-tsp8.yaml"), H100, modes=["tsp", "tp-sp"],
                       progress=said.append)
    choices = len(plan.Planner({}, H100, 1, 2, "overlap").choices("tsp"))
    assert said[0] == f"mode 1 of 2: tsp, the longest S that fits, then {choices} recompute choices at 1 length(s)"
    assert said[1] == "point 1: tsp at S=131,072, recompute full"
    points = [line for line in said if line.startswith("point ")]
    assert len(points) == len({line.split(": ", 1)[1] for line in points})  # each point once
    assert any(line.startswith("mode 2 of 2: tp-sp") for line in said)
    assert result["modes"]["tsp"]["longest_seq_length"] < 131072
