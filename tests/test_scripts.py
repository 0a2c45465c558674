"""Launch scripts parse, and their log collector reads both log formats."""

import glob
import os
import subprocess
import sys

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


def test_pretrain_script_without_a_megatron_lm_checkout_says_so_in_one_line(tmp_path):
    env = dict(os.environ, MEGATRON_LM_PATH=str(tmp_path))
    result = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "pretrain_gpt_tsp.py"), "--tsp-size", "2"],
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"pretrain_gpt_tsp.py: error: MEGATRON_LM_PATH={tmp_path} is not a Megatron-LM checkout (no pretrain_gpt.py "
        "and megatron/training); set MEGATRON_LM_PATH to a checkout at tag core_v0.16.1 or core_v0.19.0"]


def test_args_into_a_closed_pipe_ends_quietly():
    result = subprocess.run(f"{sys.executable} -m megatron_tsp.cli args configs/7b/128k-tsp8.yaml | head -c 10",
                            shell=True, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.stdout == "--num-laye" and result.stderr == "", result.stderr


@pytest.mark.parametrize("script", [s for s in SCRIPTS if s.endswith(".sbatch")], ids=os.path.basename)
def test_batch_jobs_save_before_their_time_limit(script):
    """Slurm's SIGTERM comes before the limit, and every rank then saves (--exit-signal-handler)."""
    with open(script) as f:
        assert "#SBATCH --signal=TERM@" in f.read()
    with open(os.path.join(ROOT, "scripts", "slurm", "launch.sh")) as f:
        launch = f.read()
    entries = [line for line in launch.splitlines() if line.lstrip().startswith("ENTRY=(")]
    assert len(entries) == 2 and all("--exit-signal-handler" in e for e in entries), entries
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in launch
    assert "python3 -m megatron_tsp.run.torchrun --nnodes" in launch  # exits 0 after a save (test_faults)


def test_a_log_that_several_runs_appended_to_gives_a_row_per_run(tmp_path):
    """Every run of a config appends to runs/<config>/log.jsonl; compare printed one row of "565
    iterations" with medians and a final loss across about 50 unrelated runs."""
    import json

    tsp = [{"run": "a", "mode": "tsp", "iteration": i, "elapsed_ms": 10.0, "loss": 5.0 - i} for i in (1, 2, 3)]
    ring = [{"run": "b", "mode": "tp-sp-ring", "iteration": i, "elapsed_ms": 30.0, "loss": 9.0} for i in (1, 2)]
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in tsp + ring))
    runs = compare.read_runs(str(log))
    assert list(runs) == [f"{log} [a: iterations 1-3, tsp]", f"{log} [b: iterations 1-2, tp-sp-ring]"]
    assert [compare.summarize(r, warmup=0)["final_loss"] for r in runs.values()] == [2.0, 9.0]
    # text logs name no run: one starts where the iteration number does not go up
    text = tmp_path / "node0.log"
    text.write_text("\n".join(MEGATRON_LM_LINE.replace("      12/", f"      {i}/") for i in (1, 2, 1, 2, 3)) + "\n")
    assert [len(r) for r in compare.read_runs(str(text)).values()] == [2, 3]
