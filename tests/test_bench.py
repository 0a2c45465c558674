"""The side-by-side benchmark compares like with like: every mode trains the same model on
the same fresh batches, and a run whose modes disagree on the first-step loss is refused."""

import os

import pytest
import torch
from conftest import ROOT

from megatron_tsp.device import CPU
from megatron_tsp.measure import bench
from megatron_tsp.run.data import make_batch

BENCH_CONFIG = os.path.join(ROOT, "configs", "bench-cpu.yaml")  # RoPE, GQA, SwiGLU, RMSNorm


def test_modes_agree_on_a_rope_gqa_swiglu_model(ranks, tmp_path):
    modes = ["tsp", "tsp-no-overlap", "tp-sp", "tp-sp-ring", "tp-cp"]
    result = bench.run(BENCH_CONFIG, [64], modes, repeats=1, steps=1, warmup=0,
                       runner=lambda fn, *args: ranks(2, fn, *args), nproc=2)
    entry = result["results"][64]
    losses = {mode: r["first_step_loss"] for mode, r in entry.items()}
    ref = losses["tp-sp"]
    assert all(abs(loss - ref) <= 1e-5 * ref for loss in losses.values()), losses
    assert entry["tp-sp"]["vs_tp_sp"] == 1.0 and entry["tp-cp"]["vs_tp_cp"] == 1.0
    # TP x CP moves K/V of the whole sequence: the CP transform did not shrink later batches
    assert entry["tp-cp"]["bytes_received_per_step"] > 0
    # the profiled step: TSP's waits, charged to the schedule lines that posted and waited, on every rank
    for rows in entry["tsp"]["waits_per_rank"]:
        sites = {row["posted_at"].split(":")[0] for row in rows} | {row["waited_at"].split(":")[0] for row in rows}
        assert {"attention_schedule.py", "mlp.py"} <= sites, sites
        assert all(row["waits"] >= 1 and row["wait_ms"] >= 0 for row in rows)
    assert not any(entry["tp-sp"]["waits_per_rank"])  # megatron's collectives are not TSP's schedules
    assert "waits for transfers" in bench.table(result)
    # the same step as a timeline: every layer's attention and MLP, forward and backward, on
    # every rank, each wait inside a schedule's span; a Gantt chart of it beside the results
    for events in entry["tsp"]["timeline_per_rank"]:
        spans = [e for e in events if "span" in e]
        assert {e["span"] for e in spans} == {f"{kind} {layer} {phase}" for kind in ("attention", "mlp")
                                              for layer in (1, 2) for phase in ("forward", "backward")}
        assert all(0 <= e["start_ms"] <= e["end_ms"] for e in spans)
        for wait in (e for e in events if "wait" in e):
            assert any(s["start_ms"] <= wait["start_ms"] <= wait["end_ms"] <= s["end_ms"] for s in spans), wait
        assert any("post" in e for e in events)
    assert not any(entry["tp-sp"]["timeline_per_rank"])
    pytest.importorskip("matplotlib")
    paths = bench.write(result, str(tmp_path), "bench")
    assert paths[-1].endswith("bench-timeline.png") and os.path.getsize(paths[-1]) > 0


def test_disagreeing_modes_are_refused():
    bench.check_same_loss({"tsp": [6.3175, 6.3175], "tp-sp": [6.3175000001]}, seq=256)
    with pytest.raises(bench.ModesDisagree, match="S=256: mode tp-cp computes first-step loss 6.024800"):
        bench.check_same_loss({"tsp": [6.3175], "tp-cp": [6.0248]}, seq=256)
    # bf16: modes round at other places, so the losses of one model differ by ~1e-3 relative;
    # another model still differs by more
    rtol = bench.loss_rtol({"bf16": True})
    bench.check_same_loss({"tsp": [6.3175], "tp-sp": [6.3235]}, seq=256, rtol=rtol)
    with pytest.raises(bench.ModesDisagree):
        bench.check_same_loss({"tsp": [6.3175], "tp-sp": [6.3235]}, seq=256, rtol=bench.loss_rtol({}))
    with pytest.raises(bench.ModesDisagree):
        bench.check_same_loss({"tsp": [6.3175], "tp-cp": [6.0248]}, seq=256, rtol=rtol)


def test_every_batch_is_new_and_the_same_across_modes():
    first = make_batch(1, 16, 100, 3, CPU.torch)
    first["tokens"] = first["tokens"][:, :8]  # what megatron's CP slice does to the dict it gets
    again = make_batch(1, 16, 100, 3, CPU.torch)
    assert again["tokens"].shape == (1, 16)
    assert torch.equal(again["labels"][:, :-1], again["tokens"][:, 1:])
    assert not torch.equal(make_batch(1, 16, 100, 4, CPU.torch)["tokens"], again["tokens"])


def test_crossover_is_where_tsp_stays_at_most_tp_sp():
    def entry(tsp, tp_sp):
        return {"tsp": {"step_s_median": tsp}, "tp-sp": {"step_s_median": tp_sp}}

    assert bench.crossover({512: entry(2, 1), 1024: entry(1, 1), 2048: entry(1, 2)}) == 1024
    assert bench.crossover({512: entry(1, 2), 1024: entry(2, 1)}) is None


def test_the_crossover_rate_is_where_the_ratio_crosses_one():
    assert abs(bench.measured_crossover_rate([(100, 1.2), (10, 0.8)]) - 10 ** 1.5) < 1e-9  # log-linear
    assert bench.measured_crossover_rate([(10, 0.7), (40, 0.6), (450, 0.9)]) is None

    # a CPU-like profile: at S=1024 TP+SP is faster on slow links (TSP moves its weights), TSP on fast ones
    profile = dict(name="cpu", gpus_per_node=2, memory_gib=8, peak_tflops=0.07, matmul_efficiency=1.0,
                   attention_efficiency=0.5, hbm_gbs=20, intra_node_gbs=0.4, inter_node_gbs=0.4,
                   intra_node_latency_us=300, inter_node_latency_us=300)
    values = bench.cfg.load_config(BENCH_CONFIG)
    rate = bench.model_crossover_rate(values, profile, 1024, 2, 1.0, 1e6)
    assert rate is not None and abs(bench.model_ratio(values, profile, 1024, 2, rate) - 1) < 1e-3
    assert bench.model_crossover_rate(values, profile, 1024, 2, 2 * rate, 20 * rate) is None  # not in the range
