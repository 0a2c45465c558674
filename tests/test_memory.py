"""The memory planner: under FakeTensorMode it sees what the same step allocates for real,
its categories add up, and at long context TSP needs less than TP+SP."""

import os

import pytest
from conftest import ROOT

from megatron_tsp.device import CPU
from megatron_tsp.measure import memory
from megatron_tsp.run import config
from megatron_tsp.run.modes import get_mode

TINY = os.path.join(ROOT, "configs", "tiny-cpu.yaml")


def _values(**overrides):
    values = config.load_config(TINY)
    values.update(overrides)
    return values


# megatron's MoE layers, experts folded onto the 2 model-parallel ranks, some layers dense
MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=128, expert_model_parallel_size=2,
           moe_shared_expert_intermediate_size=128, moe_layer_freq=2, moe_aux_loss_coeff=0.01)


def _measure(mode, overrides):
    return memory.measure(_values(**overrides), mode, CPU, balanced=True)


@pytest.mark.parametrize("mode,overrides", [("tsp", {}), ("tp-sp", {}), ("tp-cp", {}), ("tsp", MOE), ("tp-sp", MOE)],
                         ids=["tsp", "tp-sp", "tp-cp", "tsp-moe", "tp-sp-moe"])
def test_planner_matches_a_real_step(ranks, mode, overrides):
    """The planned step is the real one: every category of the peak, and every byte moved.
    A mixture-of-experts model is planned with balanced routing, and measured with it too."""
    real = ranks(2, _measure, mode, overrides)[0]
    planned = memory.plan(_values(**overrides), mode, world_size=2)
    assert real["parallel"] == planned["parallel"]
    for category in memory.CATEGORIES:
        got, want = planned["by_category_gib"][category], real["by_category_gib"][category]
        assert abs(got - want) <= 0.02 * real["peak_gib"], (category, got, want)
    # (the planner does not compute the gradient norm, whose temporaries the real step has)
    assert abs(planned["peak_gib"] - real["peak_gib"]) <= 0.02 * real["peak_gib"]
    # the planner skips the gradient norm (a scalar all-reduce over the distributed
    # optimizer's instance group)
    real["comm_bytes_received"].pop("dist_opt")
    assert planned["comm_bytes_received"] == real["comm_bytes_received"]
    if overrides:  # each MoE layer's all-to-alls move (D-1)/D of the routed tokens to their experts and back,
        v = _values(**overrides)  # and their routing probabilities (fp32) along to the experts
        routed = v["seq_length"] // 2 * v["micro_batch_size"] * v["moe_router_topk"]  # per rank, both modes
        moe_layers = v["num_layers"] // v["moe_layer_freq"]
        tokens, probs = 4 * routed // 2 * v["hidden_size"] * moe_layers, 4 * routed // 2 * moe_layers
        assert planned["comm_bytes_received"]["ep"] == {"forward": 2 * tokens + probs, "backward": 2 * tokens + probs}
        assert planned["comm"]["ep"]["forward"]["all_to_all"]["calls"] == 3 * moe_layers
        assert "tp_cp" in planned["comm"]  # the router's sums: named, so priced where the group lives
    assert not [g for g in planned["comm"] if g.startswith("group")]


def test_categories_add_up_and_long_context_favours_tsp():
    values = _values(seq_length=2048, max_position_embeddings=2048, num_layers=2,
                     recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    result = {m: memory.plan(values, m, largest=4) for m in ("tsp", "tp-sp")}
    for r in result.values():
        assert abs(sum(r["by_category_gib"].values()) - r["peak_gib"]) < 1e-9
        largest = [row["gib"] for row in r["largest_at_peak"]]  # memory --largest: what sets the peak
        assert len(largest) == 4 and largest == sorted(largest, reverse=True) and sum(largest) <= r["peak_gib"]
        assert all(row["category"] in memory.CATEGORIES for row in r["largest_at_peak"])
    # weights and optimizer state are sharded alike; activations are where TSP saves
    assert result["tsp"]["by_category_gib"]["parameters"] == result["tp-sp"]["by_category_gib"]["parameters"]
    assert result["tsp"]["peak_gib"] < result["tp-sp"]["peak_gib"]


def test_the_planner_sees_every_shard_in_flight():
    """Each head-group shard of lookahead in flight at the peak is one more shard of memory."""
    values = config.load_config(os.path.join(ROOT, "configs", "7b", "128k-tsp8.yaml"))
    plans = {k: memory.plan(dict(values, num_layers=2, tsp_lookahead=k), "tsp", attention_backend="gpu")
             for k in (1, 3)}
    h, d = values["hidden_size"], values["tsp_size"]
    shard_bytes = (3 * h * h // d + h * h // d) * 2  # MHA Wqkv and Wproj rows of one head group, bf16
    grown = plans[3]["by_category_gib"]["communication"] - plans[1]["by_category_gib"]["communication"]
    assert abs(grown * 2**30 - 2 * shard_bytes) < 1e-3 * shard_bytes


def test_modes_relayout_the_same_model():
    values = config.load_config(os.path.join(ROOT, "configs", "7b", "128k-tsp8.yaml"))
    assert get_mode("tp-cp").values(values, cp=2)["tensor_model_parallel_size"] == 4
    assert get_mode("tp").values(values)["tensor_model_parallel_size"] == 8
    with pytest.raises(config.ConfigError, match="unknown mode"):
        get_mode("fsdp").values(values)


def test_memory_counts_each_layers_bytes_and_kernel_launches_op_by_op(tmp_path):
    """``megatron-tsp memory --bytes-by-op --launches``: what one layer adds on the slowest rank,
    op by op. TP+SP's layer launches its 4 GEMMs forward and 8 backward (the default config
    recomputes nothing) and one attention kernel each way; TSP's several head groups call
    the kernels more often; each table adds up to its total, the optimizer step's per-tensor
    launches counted apart."""
    import json
    import subprocess
    import sys

    out = tmp_path / "memory.json"
    run = subprocess.run([sys.executable, "-m", "megatron_tsp.cli", "memory", os.path.join(ROOT, "configs",
                          "tiny-cpu.yaml"), "--modes", "tsp,tp-sp", "--bytes-by-op", "--launches", "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Kernel launches per layer" in run.stdout and "Memory-bound bytes per layer" in run.stdout
    layers = {mode: r["by_op"] for mode, r in json.loads(out.read_text())["modes"].items()}
    for r in layers.values():
        assert sum(r["launches_by_op"].values()) == pytest.approx(r["launches"])
        assert r["attention_kernel_calls"] == sum(n for op, n in r["launches_by_op"].items()
                                                  if "/_scaled_dot_product" in op or "/_flash" in op
                                                  or "/_efficient" in op or "/_cudnn" in op)
        assert r["collective_calls"] > 0 and r["total_gb"] > 0
        assert not any(op.startswith("optimizer/") for op in r["launches_by_op"])  # a GPU's Adam: not per tensor
    # the optimizer's per-tensor launches, apart: the same parameters per layer in both modes
    assert layers["tsp"]["optimizer_launches_per_tensor"] == layers["tp-sp"]["optimizer_launches_per_tensor"] > 0
    assert layers["tp-sp"]["launches_by_op"]["mm"] == 12 and layers["tp-sp"]["attention_kernel_calls"] == 2
    assert layers["tsp"]["attention_kernel_calls"] > layers["tp-sp"]["attention_kernel_calls"]


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    from megatron_tsp.measure import bench

    cats = {c: 1.0 for c in memory.CATEGORIES}
    result = {"config": "x.yaml", "seq_length": 8,
              "modes": {m: {"peak_gib": 6.0, "by_category_gib": cats} for m in ("tsp", "tp-sp")}}
    memory.plot(result, str(tmp_path / "memory.png"))
    timing = {"step_s_median": 1.0, "step_s_min": 0.9, "step_s_max": 1.1, "vs_tp_sp": 1.0}
    bench_result = {"setup": {"config": "x.yaml", "ranks": 2, "device": "cpu"},
                    "results": {256: {"tsp": timing, "tp-sp": timing}, 512: {"tsp": timing, "tp-sp": timing}}}
    bench.plot(bench_result, str(tmp_path / "bench.png"))
    assert (tmp_path / "memory.png").stat().st_size > 0 and (tmp_path / "bench.png").stat().st_size > 0


LAYER = dict(num_layers=1, hidden_size=256, num_attention_heads=8, seq_length=4096, position_embedding_type="rope",
             normalization="RMSNorm", disable_bias_linear=True, attention_dropout=0.0, hidden_dropout=0.0,
             bf16=True, tsp_size=4, mock_data=True, vocab_size=1000)
MODELS = {"gelu-mha": dict(LAYER, ffn_hidden_size=1024),
          "swiglu-gqa": dict(LAYER, ffn_hidden_size=512, swiglu=True, group_query_attention=True, num_query_groups=4)}


@pytest.mark.parametrize("fused_norm", [True, False], ids=["fused-norm", "torch-norm"])
@pytest.mark.parametrize("mode", ["tsp", "tp-sp", "tp-sp-ring"])
@pytest.mark.parametrize("model", list(MODELS))
def test_per_layer_activations_match_the_formula(model, mode, fused_norm):
    """What one layer keeps for backward, tensor by tensor, adds up to Korthikanti et al.'s
    formula plus the documented terms of the modules measured (to 0.1%: every tensor is
    accounted for)."""
    values = MODELS[model]
    rows = memory.plan(dict(values), mode, per_layer=True, fused_norm=fused_norm)["saved_per_layer"]
    measured = sum(r["bytes"] for r in rows)
    terms = memory.activation_terms(config.resolve(get_mode(mode).values(values)), mode, fused_norm)
    expected = sum(terms["formula"].values()) + sum(terms["implementation"].values())
    assert abs(measured - expected) <= 1e-3 * expected, (measured, expected, rows)


def test_formula_is_korthikantis_for_a_gpt_layer():
    """h-sized MHA and ffn = 4h without dropout: 34 sbh/t bytes less the two 1-byte dropout
    masks, plus the flash kernel's fp32 log-sum-exp."""
    args = config.resolve(get_mode("tp-sp").values(MODELS["gelu-mha"]))
    s, b, h, t, a = args.seq_length, args.micro_batch_size, args.hidden_size, 4, args.num_attention_heads
    formula = memory.activation_terms(args, "tp-sp")["formula"]
    assert sum(formula.values()) == 32 * s * b * h / t + 4 * s * b * a / t
    tsp = memory.activation_terms(config.resolve(get_mode("tsp").values(MODELS["gelu-mha"])), "tsp")["formula"]
    assert sum(formula.values()) - sum(tsp.values()) == 2 * s * b * args.ffn_hidden_size / t  # the fc2 input


def _fsdp_traffic(values):
    """One real cp-fsdp step's collectives (after one step, as in steady state): group ->
    phase -> primitive -> counts."""
    from megatron_tsp.measure import counts
    from megatron_tsp.run.build import initialize, stepper

    args = get_mode("cp-fsdp").args(values)
    initialize(args, CPU)
    one_step = stepper(args, CPU, get_mode("cp-fsdp"), clip_grad=0.0)
    one_step()
    with counts.count_collectives() as records:
        one_step()
    return counts.as_dict(records)


def test_planned_fsdp_moves_what_a_real_fsdp_step_moves(ranks):
    """cp-fsdp is planned from DDP's plan of its layers (measure/fsdp.py): its parameters and
    gradients are 1/D of the model's, and the traffic it models on the FSDP group is what a
    real step of megatron's torch FSDP2 wrapper moves there: every unit gathered in forward and
    again in backward, every unit's gradient reduce-scattered (to FSDP2's padding of shards)."""
    values = _values(untie_embeddings_and_output_weights=True, tsp_size=1, context_parallel_size=2)
    real = ranks(2, _fsdp_traffic, values)[0]["dp_cp"]
    planned = memory.plan(values, "cp-fsdp", cp=2)
    units = planned["fsdp"]["unit_bytes"]
    total = sum(units["layers"]) + units["embedding"] + units["root"]
    assert planned["by_category_gib"]["parameters"] == pytest.approx(total / 2 / memory.GIB)
    assert planned["by_category_gib"]["gradients"] == pytest.approx(total / 2 / memory.GIB)
    model = planned["comm"]["dp_cp"]
    # besides, the real step all-reduces its gradient norm there (a scalar the planner does not compute)
    assert {(ph, p) for ph, prims in real.items() for p in prims if p != "all_reduce"} == \
        {(ph, p) for ph, prims in model.items() for p in prims}
    for phase, prims in model.items():
        for primitive, entry in prims.items():
            got = real[phase][primitive]
            assert got["calls"] == entry["calls"], (phase, primitive, got, entry)
            assert abs(got["bytes_received"] - entry["bytes_received"]) <= 0.01 * entry["bytes_received"], \
                (phase, primitive, got, entry)
