"""Launch scripts parse, and their log collector reads both log formats."""

import glob
import os
import subprocess

import pytest
from conftest import ROOT

from megatron_tsp.measure import compare

SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "scripts", "**", "*.sh"), recursive=True)
                 + glob.glob(os.path.join(ROOT, "scripts", "**", "*.sbatch"), recursive=True)
                 + glob.glob(os.path.join(ROOT, ".ci", "run")))


@pytest.mark.parametrize("script", SCRIPTS, ids=[os.path.relpath(s, ROOT) for s in SCRIPTS])
def test_bash_syntax(script):
    subprocess.run(["bash", "-n", script], check=True)


MEGATRON_LM_LINE = (
    " [2026-12-01 10:00:00] iteration       12/     100 | consumed samples:          1536 | "
    "elapsed time per iteration (ms): 9876.5 | throughput per GPU (TFLOP/s/GPU): 312.4 | "
    "learning rate: 2.9E-04 | global batch size:   128 | lm loss: 7.123400E+00 | loss scale: 1.0 | "
    "grad norm: 1.234 | number of skipped iterations:   0 | number of nan iterations:   0 |"
)


def test_megatron_lm_text_logs_parse(tmp_path):
    log = tmp_path / "node0.log"
    log.write_text("startup noise\n" + MEGATRON_LM_LINE + "\n")
    (record,) = compare.read_run(str(tmp_path))
    assert record == {"iteration": 12, "elapsed_ms": 9876.5, "loss": 7.1234, "tflops_per_device": 312.4}


def test_table_reports_ratio_to_first_run():
    runs = {"tsp": compare.summarize([{"elapsed_ms": 10.0, "loss": 2.0}] * 5, warmup=2),
            "tp": compare.summarize([{"elapsed_ms": 25.0, "loss": 2.0}] * 5, warmup=2)}
    text = compare.table(runs)
    assert "| tp | 5 | 25.0 | 25.0-25.0 | 2.50x |" in text
