"""The one-GPU check's logic, on the CPU path: every part reported, results written as they
come, a spent time budget recorded as such; and the script's worst case within a lent GPU's
time."""

import json
import os
import re

import pytest
from conftest import ROOT

from megatron_tsp import cli

TINY = os.path.join(ROOT, "configs", "tiny-cpu.yaml")


def test_gpu_check_writes_each_part(tmp_path):
    out = str(tmp_path / "check.json")
    assert cli.main(["gpu-check", "--config", TINY, "--modes", "tsp,tp-sp", "--steps", "1", "--out", out,
                     "--parts", "gemm,checks,backends,documents,modes,profile", "--rank", "1"]) == 0
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
    # checks: what each name resolves to on the CPU, a GPU backend's refusal as its result
    assert {case["kernel"] for case in result["checks"]["auto"]["128"].values()} == {"cpu"}
    assert "GPUs only" in result["checks"]["flash"]["128"]["error"]
    # packed documents through the CPU's kernel against math in fp32
    documents = result["documents"]
    assert documents["auto_kernel"] == "cpu" and documents["backends"]["cpu"]["within_tolerance"], documents
    assert set(documents["backends"]["cpu"]["max_rel_err_vs_math_fp32"]) == {"out", "dq", "dk", "dv"}
    setup = result["setup"]
    assert setup["rank"] == 1 and {"torch", "cuda", "hip", "cudnn", "megatron-core", "flash-attn",
                                   "transformer-engine"} <= set(setup)
    assert isinstance(result["warnings"], list)
    markdown = open(str(tmp_path / "check.md")).read()
    assert "Rank 1, fake process group" in markdown and "Packed documents, micro-batch 1" in markdown


@pytest.mark.filterwarnings("default::UserWarning")  # as outside the suite
def test_warnings_of_the_run_are_recorded(tmp_path, monkeypatch):
    import warnings

    from megatron_tsp.measure import gpucheck

    def check_gemms(device, save, result):
        warnings.warn("attention backend 'flash' gives a wrong out in its varlen form", stacklevel=1)
        save()

    monkeypatch.setattr(gpucheck, "check_gemms", check_gemms)
    out = str(tmp_path / "check.json")
    assert cli.main(["gpu-check", "--config", TINY, "--parts", "gemm", "--out", out]) == 0
    assert [w["message"] for w in json.load(open(out))["warnings"]] == [
        "attention backend 'flash' gives a wrong out in its varlen form"]


def test_a_mode_too_big_for_the_cpu_is_planned_then_skipped(tmp_path, monkeypatch):
    from megatron_tsp.measure import gpucheck

    monkeypatch.setattr(gpucheck, "CPU_STEP_FLOPS", 0)
    out = str(tmp_path / "check.json")
    assert cli.main(["gpu-check", "--config", TINY, "--modes", "tp-sp", "--parts", "modes", "--out", out]) == 0
    entry = json.load(open(out))["modes"]["tp-sp"]
    assert entry["planned_peak_gib"] > 0 and entry["skipped"].startswith("no GPU: ") and "step_s" not in entry


def test_a_rank_outside_the_job_is_refused_at_once(tmp_path, capsys):
    out = str(tmp_path / "check.json")
    assert cli.main(["gpu-check", "--config", TINY, "--rank", "2", "--out", out]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--rank 2: the job has 2 ranks" in err[0], err
    assert not os.path.exists(out)


def test_the_gpu_script_ends_within_420_s():
    """Its worst case, every step's limit and kill allowance, fits a lent GPU's 15 minutes with
    the machine's start (../shared/gpu/README.md): each command runs through ``step`` (one
    ``timeout``), once (no loop)."""
    text = open(os.path.join(ROOT, "scripts", "gpu_check.sh")).read()
    code = "\n".join(line.split("#")[0] for line in text.splitlines())
    assert len(re.findall(r"\btimeout\b", code)) == 1, "every command runs through step"
    kill = int(re.search(r"timeout -k (\d+) ", code).group(1))
    assert not re.search(r"^\s*(for|while|until)\b", code, re.M)
    limits = [int(n) for n in re.findall(r"\bstep (\d+) ", code)]
    assert len(limits) == len(re.findall(r"\bstep\b", code)) - 1  # every call but the definition has a limit
    assert len(limits) >= 8 and sum(limit + kill for limit in limits) <= 420, limits


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
