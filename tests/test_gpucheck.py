"""The one-GPU check's logic, on the CPU path: every part reported, results written as they
come, and a spent time budget recorded as such."""

import json
import os

from conftest import ROOT

from megatron_tsp import cli

TINY = os.path.join(ROOT, "configs", "tiny-cpu.yaml")


def test_gpu_check_writes_each_part(tmp_path):
    out = str(tmp_path / "check.json")
    assert cli.main(["gpu-check", "--config", TINY, "--modes", "tsp,tp-sp", "--steps", "1", "--out", out]) == 0
    result = json.load(open(out))
    assert result["backends"] == {"skipped": "no GPU"}
    for mode in ("tsp", "tp-sp"):
        entry = result["modes"][mode]
        assert entry["planned_peak_gib"] > 0 and len(entry["step_s"]) == 1, entry
        assert entry["parallel"]["world_size"] == 2
    assert result["tsp_vs_tp_sp_compute"] > 0


def test_a_spent_budget_is_recorded(tmp_path):
    out = str(tmp_path / "check.json")
    assert cli.main(["gpu-check", "--config", TINY, "--modes", "tsp", "--budget-s", "1e-9", "--out", out]) == 0
    assert json.load(open(out))["modes"] == {"tsp": {"skipped": "time budget"}}
