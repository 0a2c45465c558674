"""`megatron-tsp train`, the main job: through its command line the loss falls and a killed
run resumes from its checkpoint with the losses of an uninterrupted run; the same checkpoint
resumes at D=1, on one rank or two data-parallel ranks, and in TP=2+SP (the padded
vocabulary does not depend on the layout), and the TP+SP baseline and TP+SP with the ring MLP
start from the same loss (those through the training loop on the tests' worker pools)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT

ITERS = 12
QUICK = ["--num-layers", "2", "--log-interval", "1", "--train-iters", str(ITERS),
         "--data-path", None]  # data path filled per test
TINY = os.path.join(ROOT, "configs", "tiny-cpu.yaml")


def _cmd(tmp_path, log, *extra):
    flags = list(QUICK)
    flags[-1] = str(tmp_path.parent / "data" / "tsp-tiny-corpus")
    return [sys.executable, "-m", "megatron_tsp.cli", "train", os.path.join(ROOT, "configs", "tiny-cpu.yaml"),
            *flags, "--log-json", str(log), *extra]


def _records(log):
    with open(log) as f:
        return [json.loads(line) for line in f]


def _run(cmd, timeout=600):
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("full")
    log = tmp / "log.jsonl"
    stdout = _run(_cmd(tmp, log))
    assert f"iteration       {ITERS}/      {ITERS}" in stdout and "lm loss:" in stdout
    return {r["iteration"]: r for r in _records(log)}


def test_default_config_trains_and_loss_falls(uninterrupted):
    assert sorted(uninterrupted) == list(range(1, ITERS + 1))
    assert len({(r["run"], r["mode"]) for r in uninterrupted.values()}) == 1  # compare tells runs apart
    assert uninterrupted[1]["mode"] == "tsp"
    first, last = uninterrupted[1]["loss"], uninterrupted[ITERS]["loss"]
    assert last < 0.8 * first, (first, last)
    for key in ("lr", "grad_norm", "elapsed_ms", "tokens_per_s", "tflops_per_device", "peak_memory_gib"):
        assert uninterrupted[ITERS][key] > 0


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """A run killed (SIGKILL, whole process group) after its first checkpoint: (its checkpoint
    directory, a pristine copy of it, the iteration saved)."""
    tmp = tmp_path_factory.mktemp("killed")
    ckpt = tmp / "ckpt"
    proc = subprocess.Popen(_cmd(tmp, tmp / "killed.jsonl", "--save", str(ckpt), "--save-interval", "4"),
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    deadline = time.monotonic() + 300
    while not tracker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    saved = int(tracker.read_text())
    assert saved < ITERS, "the run finished before it could be killed"
    pristine = tmp / "pristine"
    shutil.copytree(ckpt / f"iter_{saved:07d}", pristine / f"iter_{saved:07d}")
    shutil.copy(tracker, pristine)
    return ckpt, pristine, saved


def test_killed_run_resumes_with_the_same_losses(tmp_path, killed, uninterrupted):
    ckpt, _, saved = killed
    log = tmp_path / "resumed.jsonl"
    stdout = _run(_cmd(tmp_path, log, "--load", str(ckpt), "--save", str(ckpt), "--save-interval", "4"))
    assert f"at iteration {saved}" in stdout
    resumed = _records(log)
    assert [r["iteration"] for r in resumed] == list(range(saved + 1, ITERS + 1))
    for r in resumed:
        ref = uninterrupted[r["iteration"]]
        assert (r["loss"], r["grad_norm"], r["lr"]) == (ref["loss"], ref["grad_norm"], ref["lr"]), r["iteration"]


def _train_logged(overrides, tmp_path, log):
    from megatron_tsp.device import CPU
    from megatron_tsp.run import config
    from megatron_tsp.run.loop import train

    values = dict(config.load_config(TINY), num_layers=2, log_interval=1, lr_decay_iters=ITERS,
                  data_path=[str(tmp_path.parent / "data" / "tsp-tiny-corpus")], **overrides)
    train(config.resolve(values), CPU, str(log))


@pytest.mark.parametrize("world,layout", [
    (1, dict(tsp_size=1)),
    (2, dict(tsp_size=1)),
    (2, dict(tsp_size=1, tensor_model_parallel_size=2, sequence_parallel=True)),
], ids=["d1", "d1-dp2", "tp2-sp"])
def test_d2_checkpoint_resumes_in_other_layouts(ranks, tmp_path, killed, uninterrupted, world, layout):
    _, pristine, saved = killed
    log = tmp_path / "resumed.jsonl"
    ranks(world, _train_logged, dict(layout, load=str(pristine), train_iters=saved + 3), tmp_path, log)
    resumed = _records(log)
    assert [r["iteration"] for r in resumed] == [saved + 1, saved + 2, saved + 3]
    for r in resumed:  # a different layout sums in another order: close, not equal
        ref = uninterrupted[r["iteration"]]
        assert abs(r["loss"] - ref["loss"]) <= 1e-4 * ref["loss"], (r["iteration"], r["loss"], ref["loss"])


def test_tp_sp_baseline_starts_from_the_same_loss(ranks, tmp_path, uninterrupted):
    log = tmp_path / "tp.jsonl"
    baseline = dict(tsp_size=1, tensor_model_parallel_size=2, sequence_parallel=True, train_iters=1)
    ranks(2, _train_logged, baseline, tmp_path, log)
    first = _records(log)[0]
    assert abs(first["loss"] - uninterrupted[1]["loss"]) <= 1e-5 * uninterrupted[1]["loss"]


def test_ring_mlp_in_tp_sp_trains_from_the_same_loss(ranks, tmp_path, uninterrupted):
    """`megatron-tsp train --tsp-size 1 --tensor-model-parallel-size 2 --sequence-parallel --ring-mlp`
    (the flags as the command line reads them, the run through the training loop)."""
    from megatron_tsp.cli import build_parser
    from megatron_tsp.run import config

    ns = build_parser().parse_args(["train", TINY, "--tsp-size", "1", "--tensor-model-parallel-size", "2",
                                    "--sequence-parallel", "--ring-mlp"])
    layout = config.overrides(ns)
    assert layout == dict(tsp_size=1, tensor_model_parallel_size=2, sequence_parallel=True, ring_mlp=True), layout
    log = tmp_path / "ring.jsonl"
    ranks(2, _train_logged, dict(layout, train_iters=2), tmp_path, log)
    first, second = _records(log)
    assert abs(first["loss"] - uninterrupted[1]["loss"]) <= 1e-5 * uninterrupted[1]["loss"]
    assert abs(second["loss"] - uninterrupted[2]["loss"]) <= 1e-4 * uninterrupted[2]["loss"]


def test_a_resume_with_another_schedule_or_batch_says_so(ranks, tmp_path, killed, uninterrupted):
    """Megatron-LM's rules: another LR schedule needs --override-opt-param-scheduler (this run's)
    or --use-checkpoint-opt-param-scheduler (the checkpoint's); another global batch would skip
    data (iteration 11 of batch 16 reads samples 160-175). Both were silent."""
    _, pristine, saved = killed
    log = tmp_path / "resumed.jsonl"
    for overrides, words in (({"lr": 1e-2}, "--lr 0.003 there, 0.01 here"),
                             ({"lr_warmup_iters": 2}, "--lr-warmup-iters 5 there, 2 here"),
                             ({"global_batch_size": 16}, "--global-batch-size 8, this run has 16")):
        with pytest.raises(Exception, match=re.escape(words)):
            ranks(1, _train_logged, dict(tsp_size=1, load=str(pristine), train_iters=saved + 1, **overrides),
                  tmp_path, log)
    # this run's schedule on request: the LR the uninterrupted run would not have used
    ranks(1, _train_logged, dict(tsp_size=1, load=str(pristine), train_iters=saved + 1, lr=1e-2,
                                 override_opt_param_scheduler=True), tmp_path, log)
    assert _records(log)[-1]["lr"] != uninterrupted[saved + 1]["lr"]
    # the checkpoint's on request: the uninterrupted run's LR
    ranks(1, _train_logged, dict(tsp_size=1, load=str(pristine), train_iters=saved + 1, lr=1e-2,
                                 use_checkpoint_opt_param_scheduler=True), tmp_path, log)
    assert _records(log)[-1]["lr"] == uninterrupted[saved + 1]["lr"]


@pytest.mark.parametrize("layout", [dict(tsp_size=2), dict(tsp_size=1, tensor_model_parallel_size=2,
                                                         sequence_parallel=True, ring_mlp=True)],
                         ids=["tsp", "ring-mlp"])
def test_overlap_param_gather_over_several_buckets_trains_as_without_it(ranks, tmp_path, uninterrupted, layout):
    """DP=2 with the distributed optimizer and a bucket for each parameter (so that the norms,
    which TSP calls, share none with the linear weights, which it reads). Under
    --overlap-param-gather megatron waits for a bucket's all-gather, and starts the next one's,
    in the forward pre-hooks of the modules that own its parameters. TSP's schedules read those
    weights without calling their modules: they must run the hooks, or they compute on weights
    this rank did not update. A checkpoint saved under it holds the gathered weights: resumed
    without it, the run goes on with the losses of a run that never used it. (``uninterrupted``:
    its command line writes the corpus.)"""
    dp2 = dict(layout, use_distributed_optimizer=True, overlap_grad_reduce=True, ddp_bucket_size=1)
    plain, overlapped, resumed = (tmp_path / f"{name}.jsonl" for name in ("plain", "overlapped", "resumed"))
    ckpt = tmp_path / "ckpt"
    ranks(4, _train_logged, dict(dp2, train_iters=4), tmp_path, plain)
    ranks(4, _train_logged, dict(dp2, train_iters=2, overlap_param_gather=True, save=str(ckpt)), tmp_path,
          overlapped)
    ranks(4, _train_logged, dict(dp2, train_iters=4, load=str(ckpt)), tmp_path, resumed)
    got = [(r["iteration"], r["loss"], r["grad_norm"]) for r in _records(overlapped) + _records(resumed)]
    assert got == [(r["iteration"], r["loss"], r["grad_norm"]) for r in _records(plain)]


def test_optimizer_state_of_several_buckets_resumes_exactly_and_in_another_layout(ranks, tmp_path, uninterrupted):
    """megatron-core saved the distributed optimizer's state of a buffer of several buckets at
    offsets shifted by the padding of the buckets before it (upstream.BUCKET_FIXES): each
    parameter after a padded bucket end resumed with its neighbour's Adam moments. A bucket per
    parameter and the learnable sinks (4 elements, a bucket padded to 128) show it: the resumed
    run's third loss was 5.70 where the run that went on has 4.59. Resumed on one rank (one
    bucket), it goes on as the run that went on, too."""
    dp2 = dict(tsp_size=1, use_distributed_optimizer=True, overlap_grad_reduce=True, ddp_bucket_size=1,
               softmax_type="learnable", lr_warmup_iters=0)
    plain, saved, resumed, elsewhere = (tmp_path / f"{name}.jsonl" for name in ("plain", "saved", "resumed", "d1"))
    ckpt = tmp_path / "ckpt"
    ranks(2, _train_logged, dict(dp2, train_iters=4), tmp_path, plain)
    ranks(2, _train_logged, dict(dp2, train_iters=2, save=str(ckpt)), tmp_path, saved)
    ranks(2, _train_logged, dict(dp2, train_iters=4, load=str(ckpt)), tmp_path, resumed)
    went_on = _records(plain)
    got = [(r["iteration"], r["loss"], r["grad_norm"]) for r in _records(saved) + _records(resumed)]
    assert got == [(r["iteration"], r["loss"], r["grad_norm"]) for r in went_on]
    ranks(1, _train_logged, dict(tsp_size=1, softmax_type="learnable", lr_warmup_iters=0, train_iters=4,
                                 load=str(ckpt)), tmp_path, elsewhere)
    for r, ref in zip(_records(elsewhere), went_on[2:], strict=True):
        assert abs(r["loss"] - ref["loss"]) <= 1e-5 * ref["loss"], (r["iteration"], r["loss"], ref["loss"])


def test_overlap_param_gather_needs_the_distributed_optimizer_and_overlapped_reduce():
    from megatron_tsp.run import config

    for missing in ("use_distributed_optimizer", "overlap_grad_reduce"):
        values = dict(mock_data=True, vocab_size=256, overlap_param_gather=True, use_distributed_optimizer=True,
                      overlap_grad_reduce=True)
        values[missing] = False
        with pytest.raises(config.ConfigError, match=r"'overlap_param_gather' \(--overlap-param-gather\) needs "
                                                     r"use_distributed_optimizer and overlap_grad_reduce"):
            config.resolve(values)


def test_a_run_that_needs_many_epochs_of_its_corpus_says_so(tmp_path):
    """One 10-token document and 128-token sequences trained without a word (about 600 epochs)."""
    import numpy
    import torch

    from megatron_tsp.run.data import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(tmp_path / "one.bin"), dtype=numpy.uint16)
    builder.add_item(torch.arange(10))
    builder.end_document()
    builder.finalize(str(tmp_path / "one.idx"))
    out = subprocess.run([sys.executable, "-m", "megatron_tsp.cli", "train", TINY, "--data-path", str(tmp_path / "one"),
                          "--train-iters", "2", "--lr-warmup-iters", "0", "--num-layers", "1", "--log-json",
                          str(tmp_path / "log.jsonl")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.strip().splitlines() == [
        "megatron-tsp train: warning: 2 iterations of 8 x 128 tokens are 205 epochs of --data-path's training split; "
        "every token is seen that often"], out.stderr


def test_cp_with_fully_sharded_weights_trains_from_tsps_first_loss(ranks, tmp_path, uninterrupted):
    """`megatron-tsp train --tsp-size 1 --context-parallel-size 2 --use-torch-fsdp2
    --no-use-distributed-optimizer --no-gradient-accumulation-fusion` (the cp-fsdp mode:
    megatron's torch FSDP2 over the CP ranks; untied, as Megatron-LM requires it) starts from
    the loss TSP2 and TP2+SP start from on the same untied model, and trains."""
    from megatron_tsp.cli import build_parser
    from megatron_tsp.run import config, modes

    ns = build_parser().parse_args(["train", TINY, "--tsp-size", "1", "--context-parallel-size", "2",
                                    "--use-torch-fsdp2", "--no-use-distributed-optimizer",
                                    "--no-gradient-accumulation-fusion", "--untie-embeddings-and-output-weights"])
    layout = config.overrides(ns)
    assert modes.of(config.resolve(dict(config.load_config(TINY), **layout))).name == "cp-fsdp"
    untied = dict(untie_embeddings_and_output_weights=True)
    losses = {}
    for name, run in (("cp-fsdp", dict(layout, train_iters=3)), ("tsp", dict(untied, train_iters=1)),
                      ("tp-sp", dict(untied, tsp_size=1, tensor_model_parallel_size=2, sequence_parallel=True,
                                     train_iters=1))):
        log = tmp_path / f"{name}.jsonl"
        ranks(2, _train_logged, run, tmp_path, log)
        records = _records(log)
        assert {r["mode"] for r in records} == {name}
        losses[name] = [r["loss"] for r in records]
    for name in ("tsp", "tp-sp"):
        assert abs(losses["cp-fsdp"][0] - losses[name][0]) <= 1e-5 * losses[name][0], losses
    assert losses["cp-fsdp"][-1] < losses["cp-fsdp"][0]


DOCUMENTS = dict(reset_attention_mask=True, reset_position_ids=True, eod_mask_loss=True)


@pytest.mark.parametrize("flags,keys", [(["--softmax-type", "learnable"], dict(softmax_type="learnable")),
                                        (["--window-size", "64,0"], dict(window_size="64,0")),
                                        (["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"],
                                         DOCUMENTS),
                                        (["--num-experts", "4", "--moe-router-topk", "2",
                                          "--expert-model-parallel-size", "2"],
                                         dict(num_experts=4, moe_router_topk=2, expert_model_parallel_size=2))],
                         ids=["learnable-sinks", "sliding-window", "packed-documents", "moe"])
def test_attention_variants_train_tsp_and_tp_sp_from_the_same_loss(ranks, tmp_path, uninterrupted, flags, keys):
    """`megatron-tsp train --softmax-type learnable` (megatron-core's TransformerConfig.softmax_type,
    which Megatron-LM has no flag for), `--window-size 64,0` (a sliding window of 64 keys
    over 128 tokens), packed documents (the built-in corpus ends each with EOD) and
    megatron-core's MoE layers (4 experts, top-2, folded onto the 2 ranks): TSP2 and TP2+SP
    start from the same loss, and the variant changes it (the default model's first loss
    differs)."""
    from megatron_tsp.cli import build_parser
    from megatron_tsp.run import config

    ns = build_parser().parse_args(["train", TINY, *flags])
    assert config.overrides(ns) == keys
    first = {}
    for name, layout in (("tsp", dict(tsp_size=2)),
                         ("tp-sp", dict(tsp_size=1, tensor_model_parallel_size=2, sequence_parallel=True))):
        log = tmp_path / f"{name}.jsonl"
        ranks(2, _train_logged, dict(layout, **keys, train_iters=1), tmp_path, log)
        first[name] = _records(log)[0]["loss"]
    assert abs(first["tsp"] - first["tp-sp"]) <= 1e-5 * first["tp-sp"], first
    assert first["tsp"] != uninterrupted[1]["loss"]


def test_packed_documents_are_read_from_the_host_copy_of_the_tokens(monkeypatch):
    """Packed documents are found from the EOD tokens before the zigzag split: read from a
    GPU's tokens that is a device sync per micro-batch. The training loop's batches carry the
    tokens' host copy, and the forward step reads that one."""
    import torch

    from megatron_tsp.run import data, step

    class OnTheDevice(torch.Tensor):  # a GPU's tokens: a read on the host would wait for the device
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func in (torch.Tensor.nonzero, torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.item):
                raise AssertionError(f"{func.__name__} of the device's tokens")
            return super().__torch_function__(func, types, args, kwargs or {})

    monkeypatch.setattr(step.mpu, "get_context_parallel_group", lambda: None)
    batch = data.make_batch(1, 16, 100, 0, torch.device("cpu"))
    assert batch["host_tokens"] is batch["tokens"]  # on the CPU, the tokens themselves
    batch["host_tokens"] = batch["tokens"].clone()
    batch["host_tokens"][0, 5] = 7  # an EOD: documents [0, 6) and [6, 16)
    batch["tokens"] = batch["tokens"].as_subclass(OnTheDevice)
    seen = {}

    def model(tokens, position_ids, attention_mask, labels=None, packed_seq_params=None):
        seen["cu_seqlens"] = packed_seq_params.cu_seqlens_q.tolist()
        return torch.zeros(1, 16)

    step.make_forward_step(documents_eod=7)(iter([batch]), model)
    assert seen["cu_seqlens"] == [0, 6, 16] and "host_tokens" not in batch


def test_a_resume_at_another_sequence_length_or_seed_says_what_it_does():
    """A resume with another --seq-length (a long-context extension) or --seed was accepted
    without a word: the data position carries over in samples, the random state is the
    checkpoint's, and the corpus order is --seed's."""
    from types import SimpleNamespace

    from megatron_tsp.run.loop import resume_notes

    common = {"iteration": 3, "global_batch_size": 8, "data": {"seq_length": 64, "seed": 1234}}
    args = SimpleNamespace(seq_length=64, seed=1234, global_batch_size=8, micro_batch_size=4)
    assert resume_notes(args, "ckpt", common) == []
    assert resume_notes(args, "ckpt", {"iteration": 3, "global_batch_size": 8}) == []  # saved before: no record
    longer, seeded = resume_notes(SimpleNamespace(**{**vars(args), "seq_length": 256, "seed": 7}), "ckpt", common)
    assert "--seq-length 64, this run has 256" in longer and "after the 24 samples trained" in longer
    assert "--seed 1234, this run has 7" in seeded and "resume with --seed 1234" in seeded
