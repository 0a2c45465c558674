"""Every mistake a user can make before a rank starts is one line and a non-zero exit.

Runs the ``megatron-tsp`` command line in this process: configuration files and values, the
parent-side checks of ``train`` (world size, batch, tokenizer, data files, vocabulary,
``--save``/``--load``), and the inputs of ``predict``, ``memory`` and ``compare``. Nothing
here starts a rank, so each case takes milliseconds.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import psutil
import pytest
from conftest import ROOT

from megatron_tsp import cli
from megatron_tsp.errors import CheckpointError
from megatron_tsp.measure import perfmodel
from megatron_tsp.run import checkpointing, config, data, preflight

TINY = os.path.join(ROOT, "configs", "tiny-cpu.yaml")
MODEL_7B = os.path.join(ROOT, "configs", "7b", "128k-tsp8.yaml")
H100 = os.path.join(ROOT, "configs", "hardware", "h100.yaml")
LINK_RESULT = os.path.join(ROOT, "bench", "results", "bench-cpu-link.json")


def one_line(capsys, argv, code=None):
    """Run the command; assert it failed with exactly one line on stderr and no traceback."""
    try:
        rc = cli.main(argv)
    except SystemExit as exc:  # argparse
        rc = exc.code
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert rc not in (0, None) and len(lines) == 1, (rc, out.out[-2000:], out.err[-4000:])
    assert "Traceback" not in out.err + out.out
    if code is not None:
        assert rc == code, (rc, lines)
    return lines[0]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return data.make_tiny_corpus(str(tmp_path_factory.mktemp("data") / "corpus"), num_docs=50)


def _write(tmp_path, name, content, mode="w"):
    path = tmp_path / name
    with open(path, mode) as f:
        f.write(content)
    return str(path)


# --- configuration files ------------------------------------------------------------------

@pytest.mark.parametrize("content,mode,message", [
    ("num_layers: [2,\n", "w", "not valid YAML"),
    (bytes(range(256)) * 4, "wb", "not a text file"),
    ("- 1\n- 2\n", "w", "a config is a mapping"),
    ("extends: [base.yaml]\n", "w", "'extends' must be the path of one config file"),
    ("extends: missing.yaml\n", "w", "missing.yaml (extended by"),
    ("hiden_size: 64\n", "w", "unknown key 'hiden_size'"),
    ("num_layers: two\n", "w", "key 'num_layers' must be int"),
], ids=["yaml", "binary", "list", "extends-list", "missing-parent", "unknown-key", "type"])
def test_bad_config_files(capsys, tmp_path, content, mode, message):
    path = _write(tmp_path, "run.yaml", content, mode)
    line = one_line(capsys, ["args", path], code=2)
    assert message in line and "run.yaml" in line


@pytest.mark.parametrize("key,message", [("num_layers", "must be a positive integer (got None)"),
                                         ("lr", "must be a finite number (got None)")])
def test_a_required_value_set_to_null(capsys, tmp_path, key, message):
    path = _write(tmp_path, "run.yaml", f"extends: {TINY}\n{key}: null\n")
    assert message in one_line(capsys, ["args", path], code=2)


def test_a_directory_is_not_a_config(capsys, tmp_path):
    assert "is a directory" in one_line(capsys, ["args", str(tmp_path)], code=2)


def test_numbers_yaml_reads_as_strings_are_numbers(capsys, tmp_path):
    path = _write(tmp_path, "run.yaml", f"extends: {TINY}\nlr: 3e-3\nmin_lr: 1e-4\n")
    assert cli.main(["args", path]) == 0
    assert "--lr 0.003" in capsys.readouterr().out


@pytest.mark.parametrize("flags,message", [
    (["--num-layers", "0"], "'num_layers' (--num-layers) must be a positive integer"),
    (["--hidden-size", "-64"], "'hidden_size'"),
    (["--num-attention-heads", "0"], "'num_attention_heads'"),
    (["--micro-batch-size", "0"], "'micro_batch_size'"),
    (["--global-batch-size", "0"], "'global_batch_size'"),
    (["--seq-length", "0"], "'seq_length'"),
    (["--vocab-size", "0"], "'vocab_size'"),
    (["--ffn-hidden-size", "0"], "'ffn_hidden_size'"),
    (["--num-query-groups", "0"], "'num_query_groups'"),
    (["--make-vocab-size-divisible-by", "0"], "'make_vocab_size_divisible_by'"),
    (["--tensor-model-parallel-size", "0"], "'tensor_model_parallel_size'"),
    (["--context-parallel-size", "0"], "'context_parallel_size'"),
    (["--tsp-size", "0"], "'tsp_size'"),
    (["--lr", "-1"], "'lr' (--lr) must be >= 0"),
    (["--lr", "nan"], "'lr' (--lr) must be a finite number"),
    (["--lr-decay-style", "cosin"], "'lr_decay_style' (--lr-decay-style) must be one of constant, linear, cosine"),
    (["--split", "99,1"], "'split' (--split) must be three numbers"),
    (["--log-interval", "0"], "'log_interval'"),
    (["--recompute-granularity", "selective", "--recompute-modules", "attn"], "'recompute_modules'"),
    (["--recompute-modules", "mlp"], "applies to recompute_granularity selective only"),
    (["--train-iters", "3"], "'lr_warmup_iters' (--lr-warmup-iters) must be below lr_decay_iters 3 "
                             "(default: train_iters, here 3)"),
])
@pytest.mark.parametrize("command", ["args", "train"])
def test_bad_values_name_the_key_before_anything_starts(capsys, command, flags, message):
    assert message in one_line(capsys, [command, TINY, *flags], code=2)


@pytest.mark.parametrize("flags,message", [
    (["--nproc", "0"], "argument --nproc: '0' is not a positive integer"),
    (["--collective-timeout-min", "0"], "argument --collective-timeout-min"),
])
def test_bad_command_line_numbers(capsys, flags, message):
    assert message in one_line(capsys, ["train", TINY, *flags], code=2)


# --- what `train` checks before it starts a rank ----------------------------------------

def _train(corpus, *flags):
    return ["train", TINY, "--data-path", corpus, "--train-iters", "10", *flags]


@pytest.mark.parametrize("flags,message", [
    (["--nproc", "3"], "world size 3 (--nproc"),
    (["--global-batch-size", "6"],
     "'global_batch_size' (--global-batch-size) 6 is not divisible by micro_batch_size 4"),
    (["--tokenizer-type", "GPT2BPETokenizer"],
     "'tokenizer_type' (--tokenizer-type) 'GPT2BPETokenizer' is not supported"),
    (["--vocab-size", "100"], "is outside the vocabulary of 101 ids (--vocab-size 100 + end-of-document)"),
    (["--recompute-granularity", "selective", "--recompute-modules", "layernorm"], "layernorm needs TransformerEngine"),
    # packed documents on a corpus whose documents end in another id (the built-in corpus's is 256)
    (["--reset-attention-mask", "--vocab-size", "300"], "holds no end-of-document token (id 300), so every sequence "
                                                        "would be one document"),
])
def test_train_checks_the_job_before_starting_ranks(capsys, corpus, flags, message):
    assert message in one_line(capsys, _train(corpus, *flags))


def _broken_corpus(corpus, tmp_path, how):
    prefix = str(tmp_path / "broken")
    if how == "empty":
        return data.make_tiny_corpus(prefix, num_docs=0)
    shutil.copy(corpus + ".idx", prefix + ".idx")
    if how == "truncated":
        with open(corpus + ".bin", "rb") as f:
            content = f.read()
        with open(prefix + ".bin", "wb") as f:
            f.write(content[: len(content) // 2])
    elif how == "garbage-index":
        shutil.copy(corpus + ".bin", prefix + ".bin")
        with open(prefix + ".idx", "wb") as f:
            f.write(b"not an index" * 10)
    elif how == "short-index":  # a good header, then nothing
        shutil.copy(corpus + ".bin", prefix + ".bin")
        with open(corpus + ".idx", "rb") as f:
            head = f.read(40)
        with open(prefix + ".idx", "wb") as f:
            f.write(head)
    elif how == "another-bin":  # this index with a longer corpus's tokens
        data.make_tiny_corpus(str(tmp_path / "other"), num_docs=4000)
        shutil.copy(str(tmp_path / "other.bin"), prefix + ".bin")
    return prefix  # "no-bin": the .idx alone


@pytest.mark.parametrize("how,message", [
    ("no-bin", "broken.bin not found"),
    ("empty", "empty, the dataset holds no tokens"),
    ("truncated", "(truncated); use the .bin and .idx written together, or rebuild the dataset"),
    ("garbage-index", "broken.idx: not a megatron index (its header is b'not an in'"),
    ("short-index", "broken.idx: not a readable megatron index"),
    ("another-bin", "(longer than its index: another corpus's .bin?)"),
])
def test_train_checks_the_data_files(capsys, corpus, tmp_path, how, message):
    prefix = _broken_corpus(corpus, tmp_path, how)
    assert message in one_line(capsys, _train(prefix), code=1)


def test_missing_data_path(capsys, tmp_path):
    line = one_line(capsys, _train(str(tmp_path / "nothing")))
    assert "nothing.idx and " in line and "not found" in line


def test_a_default_corpus_that_cannot_be_written_is_one_line(capsys, tmp_path):
    """From a read-only working directory the default runs/data/ was an internal error (OSError)."""
    prefix = os.path.join(_write(tmp_path, "a-file", ""), data.TINY_CORPUS_NAME)
    line = one_line(capsys, _train(prefix), code=1)
    assert line.startswith(f"megatron-tsp train: error: --data-path {prefix}: the built-in corpus is written there on "
                           "first use, and that failed (File exists)"), line


def test_save_that_cannot_be_written_fails_at_start(capsys, corpus, tmp_path):
    blocker = _write(tmp_path, "a-file", "")
    assert "--save " in one_line(capsys, _train(corpus, "--save", os.path.join(blocker, "ckpt")), code=2)


def test_load_of_a_missing_path_is_an_error(capsys, corpus, tmp_path):
    line = one_line(capsys, _train(corpus, "--load", str(tmp_path / "typo")), code=1)
    assert "does not exist" in line and "start from scratch" in line


@pytest.mark.parametrize("tracker", ["", "latest\n"])
def test_load_with_a_damaged_tracker(capsys, corpus, tmp_path, tracker):
    _write(tmp_path, "latest_checkpointed_iteration.txt", tracker)
    assert "expected the iteration of the latest checkpoint" in one_line(
        capsys, _train(corpus, "--load", str(tmp_path)), code=1)


def test_load_of_checkpoints_without_a_tracker_is_refused(capsys, corpus, tmp_path):
    os.makedirs(tmp_path / "iter_0000010")
    line = one_line(capsys, _train(corpus, "--load", str(tmp_path)), code=1)
    assert "holds iter_0000010 but no latest_checkpointed_iteration.txt" in line, line


def test_load_of_one_iteration_names_the_directory_above(capsys, corpus, tmp_path):
    os.makedirs(tmp_path / "iter_0000010")
    _write(tmp_path / "iter_0000010", ".metadata", "")
    line = one_line(capsys, _train(corpus, "--load", str(tmp_path / "iter_0000010")), code=1)
    assert f"is one iteration of a checkpoint; give the directory above it (--load {tmp_path})" in line, line


def _lock(root, pid, started):
    _write(root, checkpointing.SaveLock.NAME, json.dumps({"pid": pid, "host": socket.gethostname(),
                                                           "started": started}))


def test_save_in_use_by_a_running_process_is_refused(capsys, corpus, tmp_path):
    holder = psutil.Process(os.getppid())  # alive for the whole test
    _lock(tmp_path, holder.pid, holder.create_time())
    line = one_line(capsys, _train(corpus, "--save", str(tmp_path)), code=1)
    assert f"--save {tmp_path} is in use by PID {holder.pid} on {socket.gethostname()}" in line, line


def test_a_stale_save_lock_is_taken_over_and_released(capsys, tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _lock(tmp_path, gone.pid, time.time())
    with checkpointing.SaveLock(str(tmp_path)) as lock:
        with open(lock.path) as f:
            assert json.load(f)["pid"] == os.getpid()
        with pytest.raises(CheckpointError, match="is in use by PID"):
            checkpointing.SaveLock(str(tmp_path)).__enter__()
    assert "taking over" in capsys.readouterr().out
    assert not os.path.exists(lock.path)


def test_output_files_are_checked_before_the_work(capsys, corpus, tmp_path):
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o500)
    try:
        if os.access(read_only, os.W_OK):
            pytest.skip("running as a user who can write anywhere")
        assert "--log-json " in one_line(capsys, _train(corpus, "--log-json", str(read_only / "log.jsonl")), code=2)
        assert "--out " in one_line(capsys, ["bench", "--out", str(read_only / "results")], code=2)
    finally:
        read_only.chmod(0o700)
    assert "is a directory" in one_line(capsys, ["memory", MODEL_7B, "--plot", str(tmp_path) + "/"], code=2)


def test_fp16_on_a_cpu_is_refused_at_once(capsys, corpus):
    assert "'fp16' (--fp16) needs a GPU" in one_line(capsys, _train(corpus, "--fp16"), code=2)


@pytest.mark.parametrize("content,message", [
    ("seed: 1\nlr: 0.1\nseed: 2\n", ":3: not valid YAML (key 'seed' given twice (lines 1 and 3); keep one)"),
    ("a: " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"),
    ("recompute_modules: [{a: 1}]\n", "key 'recompute_modules' must be list"),
    ("seed: 100000000000000000000000\n", "'seed' (--seed) must be below 2147483648"),
])
def test_config_mistakes_found_by_a_new_user(capsys, tmp_path, content, message):
    assert message in one_line(capsys, ["args", _write(tmp_path, "c.yaml", content)], code=2)


def test_load_of_an_empty_directory_starts_from_scratch(corpus, tmp_path):
    values = dict(config.load_config(TINY), data_path=[corpus], load=str(tmp_path))
    assert preflight.check_run(config.resolve(values), world_size=2) is None


def test_load_of_a_finished_run_says_so(capsys, corpus, tmp_path):
    _write(tmp_path, "latest_checkpointed_iteration.txt", "20")
    os.makedirs(tmp_path / "iter_0000020")
    assert cli.main(_train(corpus, "--load", str(tmp_path))) == 0
    out = capsys.readouterr().out
    assert "at iteration 20 and --train-iters is 10: the run is complete" in out


# --- predict, memory, compare -----------------------------------------------------------

@pytest.mark.parametrize("hardware,message", [
    ("missing.yaml", "config file not found"),
    ("- a\n", "a hardware profile is a mapping"),
    ("name: x\npeak_tflops: 1\n", "missing gpus_per_node"),
    ("binary", "not a text file"),
])
def test_predict_with_a_bad_hardware_file(capsys, tmp_path, hardware, message):
    if hardware == "binary":
        path = _write(tmp_path, "hw.yaml", bytes(range(256)), "wb")
    elif hardware.endswith(".yaml"):
        path = str(tmp_path / hardware)
    else:
        path = _write(tmp_path, "hw.yaml", hardware)
    assert message in one_line(capsys, ["predict", MODEL_7B, "--hardware", path], code=2)


def test_predict_with_a_mistyped_hardware_value(capsys, tmp_path):
    with open(H100) as f:
        text = f.read().replace("peak_tflops:", "peak_tflops: fast #")
    path = _write(tmp_path, "hw.yaml", text)
    assert "'peak_tflops' must be a positive number" in one_line(
        capsys, ["predict", MODEL_7B, "--hardware", path], code=2)


@pytest.mark.parametrize("command", ["predict", "plan", "memory"])
def test_comparing_modes_of_a_config_without_a_parallel_size_names_the_missing_size(capsys, command):
    """It blamed ring_mlp, which the user never set."""
    base = os.path.join(ROOT, "configs", "7b", "model.yaml")
    hardware = [] if command == "memory" else ["--hardware", H100]
    line = one_line(capsys, [command, base, *hardware], code=2)
    assert "sets no model-parallel size" in line and "tsp_size" in line and "ring" not in line


@pytest.mark.parametrize("hidden,ok", [(0, True), (0.7, True), (1, True), (1.5, False), (-0.1, False)])
def test_te_overlap_fraction_may_be_zero_and_no_more_than_one(tmp_path, hidden, ok):
    with open(H100) as f:
        path = _write(tmp_path, "hw.yaml", f.read() + f"\nte_tp_overlap_hidden: {hidden}\n")
    if ok:
        assert perfmodel.load_hardware(path).te_tp_overlap_hidden == hidden
    else:
        with pytest.raises(config.ConfigError, match=r"'te_tp_overlap_hidden' is a fraction in \[0, 1\]"):
            perfmodel.load_hardware(path)


@pytest.mark.parametrize("flags,message", [
    (["--num-layers", "0"], "'num_layers' (--num-layers) must be a positive integer"),
    (["--cp", "0"], "argument --cp"),
    (["--world-size", "12"], "world size 12 (--world-size) is not a multiple of the model-parallel size 8"),
    (["--modes", "tsp,fsdp"], "unknown mode 'fsdp'"),
    (["--modes", ","], "argument --modes: ',' names nothing"),
])
def test_memory_checks_before_planning(capsys, flags, message):
    assert message in one_line(capsys, ["memory", MODEL_7B, *flags], code=2)


@pytest.mark.parametrize("flags,message", [
    (["--modes", "tsp,fsdp"], "--modes: unknown mode(s) fsdp"),
    (["--seq", "66"], "--seq 66 is not divisible by 2 x the config's tsp_size = 4"),  # not --seq-length or --tsp-size
    (["--nproc", "3"], "world size 3 (--nproc)"),
    (["--reprice", LINK_RESULT], "--reprice needs --hardware PROFILE.yaml"),
    (["--reprice", os.path.join(ROOT, "bench", "results", "bench-cpu-2rank-2k-4k.json"), "--hardware", H100],
     "not a bench --link result"),
    (["--reprice", LINK_RESULT, "--hardware", H100],
     "--reprice: profile h100 has no link calibrated at no limit MB/s per rank (link none of the results)"),
])
def test_bench_checks_before_starting_ranks(capsys, flags, message):
    assert message in one_line(capsys, ["bench", *flags], code=2)


@pytest.mark.parametrize("content", ['[1, 2]', '{"links": {"h100-nvlink": 1}, "setup": {"config": "bench-cpu.yaml"}}'],
                         ids=["a-list", "links-of-another-kind"])
def test_repricing_a_foreign_json_is_one_line(capsys, tmp_path, content):
    """It was an internal error after 13-15 s of work."""
    path = _write(tmp_path, "other.json", content)
    assert one_line(capsys, ["bench", "--reprice", path, "--hardware", H100], code=2) == (
        f"megatron-tsp bench: error: --reprice {path}: not a bench --link result")


@pytest.mark.parametrize("flags,message", [
    (["--seq", "3"], "--seq 3 is not divisible by 2 x the config's tsp_size = 4"),
    (["--seq", "1000000000"], "--seq 1000000000: 2 ranks need 22888.2 GiB for calibrate's kernels"),  # allocated
])
def test_calibrate_checks_before_starting_ranks(capsys, tmp_path, flags, message):
    assert message in one_line(capsys, ["calibrate", *flags, "--out", str(tmp_path / "p.yaml")], code=2)


@pytest.mark.parametrize("flags,message", [
    (["--scenario", "fastest"], "--scenario 'fastest': use one of overlap"),
    (["--nodes", "0"], "argument --nodes"),
    (["--modes", "tsp,fsdp"], "unknown mode 'fsdp'"),
])
def test_plan_checks_before_planning(capsys, flags, message):
    assert message in one_line(capsys, ["plan", MODEL_7B, "--hardware", H100, *flags], code=2)


@pytest.mark.parametrize("argv,flag", [
    (["memory", MODEL_7B, "--plot", "m.png"], "--plot"),
    (["plan", MODEL_7B, "--hardware", H100, "--grid", "8192", "--out", "p"], "--grid"),
    (["bench"], "bench"),
])
def test_pictures_without_matplotlib_stop_before_the_work(capsys, monkeypatch, argv, flag):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises
    assert f"{flag} draws a PNG with matplotlib" in one_line(capsys, argv, code=1)

def test_memory_with_a_non_yaml_config(capsys, tmp_path):
    path = _write(tmp_path, "c.yaml", "a: [\n")
    assert "not valid YAML" in one_line(capsys, ["memory", path], code=2)


@pytest.fixture
def run_log(tmp_path):
    records = [{"iteration": i, "elapsed_ms": 100.0 + i, "loss": 3.0 - 0.1 * i} for i in range(1, 6)]
    return _write(tmp_path, "log.jsonl", "".join(json.dumps(r) + "\n" for r in records))


@pytest.mark.parametrize("content,message", [
    (None, "cannot be read"),
    ("", "no iteration records"),
    ('{"iteration": 1, "elapsed_ms": 1.0}\n{"iteration": 2, "ela', "log.jsonl:2: not a JSON record"),
    ("[1, 2]\n", "not an iteration record"),
], ids=["missing", "empty", "half-written", "garbled"])
def test_compare_with_bad_logs(capsys, tmp_path, content, message):
    path = str(tmp_path / "log.jsonl") if content is None else _write(tmp_path, "log.jsonl", content)
    assert message in one_line(capsys, ["compare", path], code=1)


def test_compare_of_a_directory_without_logs(capsys, tmp_path):
    assert "no log.jsonl" in one_line(capsys, ["compare", str(tmp_path)], code=1)


def test_compare_creates_the_markdown_folder(capsys, tmp_path, run_log):
    target = tmp_path / "new" / "table.md"
    assert cli.main(["compare", run_log, "--markdown", str(target)]) == 0
    assert "| run |" in target.read_text()


def test_compare_refuses_a_negative_warmup(capsys, run_log):
    assert "argument --warmup" in one_line(capsys, ["compare", run_log, "--warmup", "-5"], code=2)


def test_a_leftover_torchrun_environment_is_one_line(capsys, monkeypatch):
    """WORLD_SIZE=2 RANK=0 left in a shell without torchrun was an internal error (env:// rendezvous)."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    line = one_line(capsys, ["train", TINY, "--train-iters", "10"])
    assert "MASTER_ADDR and MASTER_PORT not" in line and "Unset RANK and WORLD_SIZE" in line
    assert "internal error" not in line


def test_saving_over_another_runs_checkpoints_is_refused(capsys, tmp_path):
    """--save into a directory of another run's checkpoints, without --load, overwrote its
    iteration with a different model and moved its tracker back, with one megatron notice."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000020").mkdir(parents=True)
    (ckpt / checkpointing.TRACKER).write_text("20")
    line = one_line(capsys, ["train", TINY, "--mock-data", "--save", str(ckpt)])
    assert f"--save {ckpt} holds checkpoints up to iteration 20 of another run" in line and "--load" in line


def test_a_bad_config_for_train_is_one_line_before_the_ranks_start_importing(capsys, monkeypatch):
    """`train` with a config error printed its line only once the ranks' fork server, started
    first to import torch and megatron-core beside the launcher, had done so (8-88 s under
    load; `megatron-tsp args` prints it in 0.3 s): the config is checked first."""
    from megatron_tsp.run import launch

    started = []
    monkeypatch.setattr(launch, "start_importing", lambda: started.append(True))
    line = one_line(capsys, ["train", TINY, "--num-attention-heads", "3"])
    assert "num_attention_heads" in line and not started


def test_calibrate_names_its_own_flags():
    """calibrate and bench take the TSP size from their config: a --seq it does not divide
    named a --tsp-size flag they do not have."""
    from megatron_tsp.measure import bench

    with pytest.raises(config.ConfigError) as err:
        bench.check_setup(config.load_config(os.path.join(ROOT, "configs", "bench-cpu.yaml")), [127], ["tsp"], 2)
    assert str(err.value).startswith("--seq 127 is not divisible by 2 x the config's tsp_size")


def test_a_mode_the_model_cannot_run_is_skipped_and_said(capsys):
    """plan/predict/memory on the shipped Mixtral and OLMoE configs stopped at the default mode
    list's ring MLP, which has no experts: that mode is skipped, in a line; a list of only such
    modes is the one line it was."""
    import argparse

    from megatron_tsp.commands.shared import runnable_modes

    for model in ("mixtral-8x7b", "olmoe"):
        ns = argparse.Namespace(config=os.path.join(ROOT, "configs", model, "128k-tsp8.yaml"), cp=2,
                                modes=["tsp", "tp-sp", "tp-sp-ring", "tp-cp"])
        runnable_modes(ns, "plan")
        assert ns.modes == ["tsp", "tp-sp", "tp-cp"]
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("megatron-tsp plan: note: mode tp-sp-ring skipped: 'ring_mlp'")
    line = one_line(capsys, ["predict", os.path.join(ROOT, "configs", "olmoe", "128k-tsp8.yaml"), "--hardware", H100,
                             "--modes", "tp-sp-ring"])
    assert "ring_mlp" in line and "num_experts" in line
