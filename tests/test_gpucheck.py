"""The one-GPU check's logic, on the CPU path: every part reported, results written as they
come, and a spent time budget recorded as such."""

import json
import os

from conftest import ROOT

from megatron_tsp import cli

TINY = os.path.join(ROOT, "configs", "tiny-cpu.yaml")


def test_gpu_check_writes_each_part(tmp_path):
    out = str(tmp_path / "check.json")
    assert cli.main(["gpu-check", "--config", TINY, "--modes", "tsp,tp-sp", "--steps", "1", "--out", out,
                     "--parts", "gemm,backends,modes,profile"]) == 0
    result = json.load(open(out))
    assert result["backends"] == {"skipped": "no GPU"}
    assert {row["name"] for row in result["modes"]["tsp"]["profile"]["ops"]["top"]} >= {"aten::mm"}
    for mode in ("tsp", "tp-sp"):
        entry = result["modes"][mode]
        assert entry["planned_peak_gib"] > 0 and len(entry["step_s"]) == 1, entry
        assert entry["parallel"]["world_size"] == 2
        assert entry["attention_kernel"] == "cpu" and entry["achieved_tflops"] > 0 and entry["tokens_per_s"] > 0
    assert set(result["gemm"]) == {"fp32_output_bfloat16", "fp32_output_float16", "fp32_output_bfloat16_fake_tensors",
                                   "fp32_output_float16_fake_tensors"}
    assert result["tsp_vs_tp_sp_compute"] > 0


def test_a_spent_budget_is_recorded(tmp_path):
    out = str(tmp_path / "check.json")
    assert cli.main(["gpu-check", "--config", TINY, "--modes", "tsp", "--budget-s", "1e-9", "--out", out]) == 0
    assert json.load(open(out))["modes"] == {"tsp": {"skipped": "time budget"}}


def test_without_a_gpu_the_default_job_is_refused_at_once(tmp_path, capsys):
    out = str(tmp_path / "check.json")
    assert cli.main(["gpu-check", "--out", out]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no GPU here" in err[0] and "--config" in err[0], err
    assert not os.path.exists(out)


def test_a_failing_mode_is_recorded_and_the_next_one_runs(tmp_path, monkeypatch):
    from megatron_tsp.measure import memory

    real = memory.plan

    def plan(values, mode, *args, **kwargs):
        if mode == "tsp":
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(values, mode, *args, **kwargs)

    monkeypatch.setattr(memory, "plan", plan)
    out = str(tmp_path / "check.json")
    assert cli.main(["gpu-check", "--config", TINY, "--modes", "tsp,tp-sp", "--steps", "1", "--out", out]) == 0
    modes = json.load(open(out))["modes"]
    assert modes["tsp"] == {"error": "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"}
    assert modes["tp-sp"]["compute_s_median"] > 0
