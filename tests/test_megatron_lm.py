"""Megatron-LM integration: ``--tsp-size`` onto the tensor-parallel slot, run through
Megatron-LM's own ``pretrain()`` on 2 gloo ranks, from the Megatron-LM tree whose tag pairs with
the installed megatron-core (``MEGATRON_LM_PATH``, default ``../shared/megatron-lm/<tag>``).

Each run is one ``torchrun`` of a tiny model for 6 iterations (about 12 s): Megatron-LM keeps
one run's state in module globals (arguments, timers, microbatch calculator, rerun state
machine), so runs do not share worker processes. Megatron-LM's iteration lines print 7
significant digits, finer than the 1e-5 compared here.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig

import pytest
from conftest import ROOT

from megatron_tsp import megatron_lm, versions
from megatron_tsp.run.compat_megatron_lm import CPU_FLAGS

TAG = versions.SUPPORTED[versions.mcore()][1]
MEGATRON_LM = os.environ.get("MEGATRON_LM_PATH") or os.path.join(os.path.dirname(ROOT), "shared", "megatron-lm", TAG)
ITERS, SAVED = 6, 3
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--max-position-embeddings", "64", "--position-embedding-type", "rope", "--attention-dropout", "0",
         "--hidden-dropout", "0", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", str(ITERS),
         "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
         "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0", *CPU_FLAGS]
TP_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """A writable copy of the Megatron-LM tree, with megatron-core's dataset helpers built for
    this Python (Megatron-LM compiles them into its own tree at start)."""
    if not os.path.isfile(os.path.join(MEGATRON_LM, "pretrain_gpt.py")):
        pytest.fail(f"no Megatron-LM tree at {MEGATRON_LM}: set MEGATRON_LM_PATH to a {TAG} checkout")
    problem = versions.checkout_problem(MEGATRON_LM)
    assert problem is None, problem
    copy = tmp_path_factory.mktemp("megatron-lm") / TAG
    shutil.copytree(MEGATRON_LM, copy)
    for folder, _, files in os.walk(copy):
        os.chmod(folder, 0o755)
        for name in files:
            os.chmod(os.path.join(folder, name), 0o644)
    _build_dataset_helpers(copy / "megatron" / "core" / "datasets")
    return copy


def _build_dataset_helpers(folder):
    """The installed megatron-core's build when its source is the tree's, byte for byte;
    otherwise a build with pybind11, as Megatron-LM's Makefile does it."""
    import megatron.core.datasets as installed

    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    target = folder / f"helpers_cpp{suffix}"
    theirs = os.path.dirname(installed.__file__)
    built = os.path.join(theirs, f"helpers_cpp{suffix}")
    with open(folder / "helpers.cpp", "rb") as a, open(os.path.join(theirs, "helpers.cpp"), "rb") as b:
        same = a.read() == b.read()
    if same and os.path.isfile(built):
        shutil.copy(built, target)
        return
    includes = subprocess.run([sys.executable, "-m", "pybind11", "--includes"], capture_output=True, text=True)
    assert includes.returncode == 0, "building Megatron-LM's dataset helpers needs pybind11: pip install pybind11"
    subprocess.run(["c++", "-O3", "-shared", "-std=c++17", "-fPIC", *includes.stdout.split(), "helpers.cpp",
                    "-o", target.name], cwd=folder, check=True, timeout=300)


def _pretrain(tree, script, *flags, timeout=600):
    """One 2-rank torchrun of ``script`` (``pretrain_gpt_tsp.py``, or a pretrain_gpt.py run by
    ``megatron_tsp.megatron_lm_run``): {iteration: lm loss}, and the arguments it printed."""
    entry = [os.path.join(ROOT, "scripts", "pretrain_gpt_tsp.py")] if script is None else \
        ["-m", "megatron_tsp.megatron_lm_run", str(script)]
    env = dict(os.environ, MEGATRON_LM_PATH=str(tree), OMP_NUM_THREADS="1",
               # Megatron-LM's Makefile names the helpers after `python3-config`, which may be
               # another Python's: name them after this one's, which _build_dataset_helpers built
               MAKEFLAGS=f"LIBEXT={sysconfig.get_config_var('EXT_SUFFIX')}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *entry,
           *MODEL, *flags]
    out = subprocess.run(cmd, cwd=str(tree), env=env, capture_output=True, text=True, timeout=timeout)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-5000:]
    losses = {int(m.group(1)): float(m.group(2))
              for m in re.finditer(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)", text)}
    printed = dict(re.findall(r"^  (\w+) \.+ (.*)$", out.stdout, re.M), _output=text)
    return losses, printed


def _close(a, b, rtol=1e-5):
    assert sorted(a) == sorted(b), (a, b)
    for it in a:
        assert abs(a[it] - b[it]) <= rtol * abs(b[it]), f"iteration {it}: {a[it]} vs {b[it]}"


@pytest.fixture(scope="module")
def stock(tree):
    return _pretrain(tree, tree / "pretrain_gpt.py", *TP_SP)


@pytest.fixture(scope="module")
def tsp(tree, tmp_path_factory):
    """``--tsp-size 2`` through Megatron-LM's own pretrain_gpt.py with README's patch
    (patches/<tag>), saving at iteration 3. The script's runs below are compared with it or
    continue it (:func:`test_a_load_continues_the_uninterrupted_run`): both entries, one run."""
    patched = tmp_path_factory.mktemp("patched")
    shutil.copy(tree / "pretrain_gpt.py", patched / "pretrain_gpt.py")
    patch = os.path.join(ROOT, "patches", TAG, "pretrain_gpt_tsp.patch")
    subprocess.run(["patch", "-p1", "-d", str(patched), "-i", patch], check=True, capture_output=True)
    ckpt = tmp_path_factory.mktemp("tsp-ckpt")
    losses, printed = _pretrain(tree, patched / "pretrain_gpt.py", "--tsp-size", "2", "--save", str(ckpt),
                                "--save-interval", str(SAVED))
    return losses, printed, ckpt


def test_tsp_through_pretrain_equals_stock_tp_sp(stock, tsp):
    (stock_losses, _), (tsp_losses, printed, _) = stock, tsp
    assert sorted(tsp_losses) == list(range(1, ITERS + 1))
    assert (printed["tsp_size"], printed["tensor_model_parallel_size"], printed["sequence_parallel"]) == \
        ("2", "2", "True")
    assert printed["spec"] == "['megatron_tsp.megatron_lm', 'layer_spec']"
    _close(tsp_losses, stock_losses)


def test_table_vocabulary_through_pretrain_equals_stock_tp_sp(tree, stock, tsp):
    """``--tsp-vocab table`` (the default run above takes the sequence layout: at this size
    neither moves fewer bytes)."""
    losses, printed = _pretrain(tree, None, "--tsp-size", "2", "--tsp-vocab", "table")
    assert printed["tsp_vocab"] == "table"
    assert "TSP vocabulary ends: sequence layout (--tsp-vocab auto)" in tsp[1]["_output"]
    assert "TSP vocabulary ends: table layout (--tsp-vocab table)" in printed["_output"]
    _close(losses, stock[0])


def test_ring_mlp_through_pretrain_equals_stock_tp_sp(tree, stock):
    losses, printed = _pretrain(tree, None, *TP_SP, "--ring-mlp")
    assert printed["spec"] == "['megatron_tsp.megatron_lm', 'ring_layer_spec_local']"
    _close(losses, stock[0])


def test_a_load_continues_the_uninterrupted_run(tree, tsp):
    """Resumed from iteration 3 by the script, iterations 4-6 are the patched
    pretrain_gpt.py's uninterrupted run's (the two entries agree). Megatron-LM
    prints a run's first iteration without resetting its loss sums, so its second line (here
    iteration 5, in the uninterrupted run iteration 2) is the mean of both iterations."""
    full, _, ckpt = tsp
    losses, printed = _pretrain(tree, None, "--tsp-size", "2", "--load", str(ckpt), "--ckpt-step", str(SAVED))
    assert sorted(losses) == list(range(SAVED + 1, ITERS + 1))
    expected = {it: full[it] for it in losses}
    expected[SAVED + 2] = (full[SAVED + 1] + full[SAVED + 2]) / 2
    _close(losses, expected)


def test_tsp_size_maps_onto_the_tensor_parallel_slot():
    out = megatron_lm.translate_argv(["x", "--num-layers", "2", "--tsp-size", "8"])
    assert out[:5] == ["x", "--num-layers", "2", "--tsp-size", "8"]
    assert out[5:] == ["--tensor-model-parallel-size", "8", "--sequence-parallel", "--spec",
                       "megatron_tsp.megatron_lm", "layer_spec", "--attention-dropout", "0.0"]
    assert megatron_lm.translate_argv(["x", "--tsp-size=2", "--qk-layernorm"])[-3] == "layer_spec_qk_layernorm"
    # experts: a block spec of each stage's layers, the experts whole on their ranks unless told otherwise
    moe = megatron_lm.translate_argv(["x", "--tsp-size", "2", "--num-experts", "4", "--qk-layernorm"])
    assert moe[-5:] == ["block_spec_qk_layernorm", "--attention-dropout", "0.0", "--expert-tensor-parallel-size", "1"]
    assert megatron_lm.translate_argv(["x", "--tensor-model-parallel-size", "8"]) == \
        ["x", "--tensor-model-parallel-size", "8"]


@pytest.mark.parametrize("argv,message", [
    (["--tensor-model-parallel-size", "2"], "set --tensor-model-parallel-size 1"),
    (["--context-parallel-size", "2"], "set --context-parallel-size 1"),
    (["--num-experts", "8", "--expert-model-parallel-size", "3"],
     "--expert-model-parallel-size must be --tsp-size or a divisor"),
    (["--num-experts", "8", "--expert-tensor-parallel-size", "4"], "set --expert-tensor-parallel-size 1"),
    (["--attention-dropout", "0.1"], "set --attention-dropout 0"),
    (["--reset-attention-mask", "--pipeline-model-parallel-size", "2"],
     "--reset-attention-mask cannot be used with --pipeline-model-parallel-size > 1"),
])
def test_unsupported_flags_are_one_line_errors(argv, message):
    with pytest.raises(SystemExit, match=message):
        megatron_lm.translate_argv(["x", "--tsp-size", "4", *argv])


def test_ring_mlp_keeps_the_tensor_parallel_layout_and_adds_its_spec():
    argv = ["x", "--tensor-model-parallel-size", "2", "--sequence-parallel", "--ring-mlp"]
    assert megatron_lm.translate_argv(argv) == argv + ["--spec", "megatron_tsp.megatron_lm", "ring_layer_spec"]
    assert megatron_lm.translate_argv(["x", "--tensor-model-parallel-size=4", "--ring-mlp", "--qk-layernorm"])[-1] == \
        "ring_layer_spec_qk_layernorm"


@pytest.mark.parametrize("argv,message", [
    (["--ring-mlp"], "--ring-mlp needs --tensor-model-parallel-size 2 or more"),
    (["--tsp-size", "2", "--ring-mlp"], "--ring-mlp applies to a tensor-parallel model"),
    (["--tensor-model-parallel-size", "2", "--ring-mlp", "--num-experts", "8"],
     "--num-experts cannot be used with --ring-mlp at --tensor-model-parallel-size 2"),
    (["--tensor-model-parallel-size", "4", "--ring-mlp", "--ffn-hidden-size", "6"],
     "--ffn-hidden-size 6 is not divisible by --tensor-model-parallel-size 4"),
    (["--tensor-model-parallel-size", "2", "--ring-mlp", "--spec", "a", "b"], "--spec cannot be used with --ring-mlp"),
])
def test_ring_mlp_misuse_is_one_line(argv, message):
    with pytest.raises(SystemExit, match=message):
        megatron_lm.translate_argv(["x", *argv])


def _spec(name):
    """The layer spec Megatron-LM's ``--spec megatron_tsp.megatron_lm NAME`` gets: the object
    itself (0.16), or what the callable it calls with the model config returns (0.19)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    obj = vars(megatron_lm)[name]  # how Megatron-LM looks it up: no module __getattr__
    return obj if isinstance(obj, ModuleSpec) else obj.spec


def test_spec_objects_are_layer_specs():
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_tsp.core.mlp import TSPMLP

    for name in ("layer_spec", "layer_spec_qk_layernorm"):
        spec = _spec(name)
        assert spec.module is TransformerLayer
        assert spec.submodules.self_attention.submodules.core_attention is not None
    for name in ("block_spec", "block_spec_qk_layernorm"):  # built for each stage from its config (MoE layers)
        assert callable(vars(megatron_lm)[name].build)
    for name in ("ring_layer_spec", "ring_layer_spec_local", "ring_layer_spec_qk_layernorm",
                 "ring_layer_spec_qk_layernorm_local"):
        ring = _spec(name)  # megatron's own attention, the ring MLP, the norm apart from fc1
        assert ring.module is TransformerLayer and ring.submodules.mlp.module is TSPMLP
        assert ring.submodules.sharded_state_dict_keys_map["pre_mlp_layernorm."] == "mlp.linear_fc1.layer_norm_"
    from megatron.core.transformer.spec_utils import ModuleSpec

    assert isinstance(vars(megatron_lm)["layer_spec"], ModuleSpec) != versions.at_least(0, 19)


PARSE = r"""
import json, sys
from megatron_tsp import megatron_lm
from megatron.training.arguments import parse_args
for line in sys.stdin:  # one command line a config: parsed as Megatron-LM parses it, in one process
    sys.argv = megatron_lm.translate_argv(["pretrain_gpt.py"] + json.loads(line))
    args = parse_args(extra_args_provider=megatron_lm.add_tsp_args)
    print("|".join(map(str, (args.tsp_size, args.tensor_model_parallel_size, args.sequence_parallel,
                              args.spec, args.seq_length))))
"""
RENDERED = [("7b", "128k-tsp8"), ("7b", "128k-tp8-sp"), ("7b", "128k-tp8-sp-ring"), ("7b", "128k-tp4-cp2"),
            ("7b", "128k-cp8-fsdp"), ("7b", "16k-tsp8"), ("mixtral-8x7b", "128k-tsp8"), ("olmoe", "128k-tsp8")]


@pytest.fixture(scope="module")
def parsed():
    """{(model, name): what Megatron-LM's parser made of ``megatron-tsp args`` of the config}."""
    lines = [json.dumps(subprocess.run([sys.executable, "-m", "megatron_tsp.cli", "args",
                                        os.path.join(ROOT, "configs", model, f"{name}.yaml")],
                                       check=True, capture_output=True, text=True).stdout.split())
             for model, name in RENDERED]
    env = dict(os.environ, PYTHONPATH=MEGATRON_LM + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", PARSE], input="\n".join(lines) + "\n", env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    results = [line for line in out.stdout.splitlines() if line.count("|") == 4]
    assert len(results) == len(RENDERED), out.stdout[-3000:]
    return dict(zip(RENDERED, results))


@pytest.mark.parametrize("model,name", RENDERED)
def test_rendered_configs_parse_with_megatron_lm(parsed, model, name):
    tsp, tp, sp, spec, seq = parsed[model, name].split("|")
    assert seq == ("131072" if name.startswith("128k") else "16384")
    if "tsp" in name:
        assert (tsp, tp, sp) == ("8", "8", "True") and "megatron_tsp.megatron_lm" in spec
        assert ("block_spec" in spec) == (model != "7b")  # MoE layers where --moe-layer-freq says
    elif "ring" in name:
        assert (tsp, tp, sp) == ("1", "8", "True") and "ring_layer_spec" in spec
    else:
        assert tsp == "1" and spec == "None"


def test_a_bad_flag_under_torchrun_is_its_line_and_the_rank_that_exited():
    """Under torchrun every bad flag printed its line per rank, then torchrun's 40-70-line
    ChildFailedError traceback; --tsp-size 3 on 2 processes spoke of 4 heads not divisible by
    3, never of the world size. megatron_tsp.run.torchrun (the launch README and the Slurm
    scripts use) ends with a line naming the ranks' exit codes."""
    env = dict(os.environ, MEGATRON_LM_PATH=MEGATRON_LM, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "megatron_tsp.run.torchrun", "--standalone", "--nproc-per-node", "2",
                          os.path.join(ROOT, "scripts", "pretrain_gpt_tsp.py"), *MODEL, "--tsp-size", "3"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "--tsp-size 3 does not divide the 2 processes torchrun started" in out.stderr
    assert "Traceback" not in out.stderr and "ChildFailedError" not in out.stderr, out.stderr[-3000:]
    # the rank that failed first exited 1; torchrun may have stopped the other (-15)
    assert re.search(r"megatron_tsp\.run\.torchrun: rank (\d) failed first \(.*rank \1 exited 1", out.stderr), \
        out.stderr[-1000:]


CONNECTIONS = r"""
import json, os, sys
from megatron_tsp import megatron_lm
from megatron_tsp.run.compat_megatron_lm import enable_megatron_lm_cpu_support
enable_megatron_lm_cpu_support()
import megatron.training.arguments as arguments
arguments.get_device_arch_version = lambda: 9  # Hopper: Megatron-LM checks the connections below 10
results, cases, model = [], json.loads(sys.argv[1]), json.loads(sys.argv[2])
for flags, user in cases:
    os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    os.environ.update({"CUDA_DEVICE_MAX_CONNECTIONS": user} if user else {})
    argv = ["pretrain_gpt_tsp.py", *model, *flags]
    megatron_lm.prepare_launch(argv)
    sys.argv = megatron_lm.translate_argv(argv)
    try:
        arguments.validate_args(arguments.parse_args(extra_args_provider=megatron_lm.add_tsp_args), {})
        results.append([os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"), None])
    except AssertionError as exc:
        results.append([os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"), str(exc)])
print(json.dumps(results))
"""


def test_the_entry_passes_megatron_lms_checks_on_hopper():
    """Megatron-LM asserts CUDA_DEVICE_MAX_CONNECTIONS=1 for TP > 1 below compute capability
    10 (A100, H100, H200; MI300X reports 9): the entry gives TP+SP ranks 1 where the user set
    nothing; TSP's ranks keep CUDA's default (their transfers run on streams of their own) and
    pass the check, which is for layers TSP does not run; a user's 8 under TP+SP still fails it."""
    import json

    cases = [(["--tsp-size", "2"], None), (TP_SP, None), (["--tsp-size", "2"], "8"), (TP_SP, "8")]
    env = dict(os.environ, PYTHONPATH=MEGATRON_LM + os.pathsep + os.environ.get("PYTHONPATH", ""), WORLD_SIZE="2",
               RANK="0")
    out = subprocess.run([sys.executable, "-c", CONNECTIONS, json.dumps(cases), json.dumps(MODEL)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (tsp, tsp_error), (tp, tp_error), (tsp_user, tsp_user_error), (tp_user, tp_user_error) = \
        json.loads(out.stdout.strip().splitlines()[-1])
    assert (tsp, tsp_error) == (None, None)
    assert (tp, tp_error) == ("1", None)
    assert (tsp_user, tsp_user_error) == ("8", None)
    assert tp_user == "8" and "CUDA_DEVICE_MAX_CONNECTIONS to 1" in tp_user_error


DOCUMENTS = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]


def test_packed_documents_through_pretrain_equal_stock_tp_sp(tree, stock):
    """``--reset-attention-mask`` with ``--tsp-size 2``: the documents found from the whole
    sequence's EOD tokens, no ``[b, 1, S, S]`` mask (the dataloader does not build one); the
    same losses as stock pretrain_gpt.py's TP2+SP, which applies the dataset's mask
    (megatron's local attention). Not the plain run's losses: the mock data has EOD tokens
    (without them the three flags change nothing), so its sequences hold several documents
    and the mask is not all-causal."""
    tsp_losses, printed = _pretrain(tree, None, "--tsp-size", "2", *DOCUMENTS,
                                    "--no-create-attention-mask-in-dataloader")
    assert printed["reset_attention_mask"] == "True"
    stock_losses, _ = _pretrain(tree, tree / "pretrain_gpt.py", *TP_SP, *DOCUMENTS)
    _close(tsp_losses, stock_losses)
    assert stock_losses[1] != stock[0][1]


MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
       "--moe-token-dispatcher-type", "alltoall", "--moe-aux-loss-coeff", "0.01", "--moe-layer-freq", "2"]


def test_mixture_of_experts_through_pretrain_equals_stock_tp_sp(tree):
    """Megatron-LM's MoE flags with ``--tsp-size 2``: megatron's MoE layer where
    ``--moe-layer-freq`` says (the first of the two layers), TSP's ring MLP in the other, the
    experts folded onto the TSP group; the same losses as stock pretrain_gpt.py's TP2+SP with
    its experts folded onto the TP group (EP 2, ETP 1), load-balancing loss included."""
    tsp_losses, printed = _pretrain(tree, None, "--tsp-size", "2", *MOE)
    assert printed["spec"] == "['megatron_tsp.megatron_lm', 'block_spec']"
    assert (printed["num_experts"], printed["expert_tensor_parallel_size"]) == ("4", "1")
    assert "load_balancing_loss" in printed["_output"]
    stock_losses, _ = _pretrain(tree, tree / "pretrain_gpt.py", *TP_SP, *MOE, "--expert-tensor-parallel-size", "1")
    _close(tsp_losses, stock_losses)


VARIANTS = ["--softmax-type", "learnable", "--window-size", "16,0", "--window-attn-skip-freq", "2"]


def test_attention_variants_through_pretrain_tsp_equal_tp_sp(tree, stock):
    """`--softmax-type` (megatron-core's TransformerConfig.softmax_type; Megatron-LM has no flag
    for it: the script adds it) and Megatron-LM's `--window-size` with `--window-attn-skip-freq`,
    in one model (learnable sinks in every layer, a window in every other): the config takes
    them by name, and TSP2 trains as Megatron-LM's own TP2+SP layers do."""
    tsp_losses, printed = _pretrain(tree, None, "--tsp-size", "2", *VARIANTS)
    assert (printed["softmax_type"], printed["window_size"], printed["window_attn_skip_freq"]) == \
        ("learnable", "(16, 0)", "2")
    tp_losses, _ = _pretrain(tree, None, *TP_SP, *VARIANTS)
    _close(tsp_losses, tp_losses)
    assert tsp_losses[1] != stock[0][1]  # the variants are there: not the plain model's loss


def test_fsdp2_through_stock_pretrain_equals_stock_data_parallel(tree):
    """The weights-sharding half of ``cp-fsdp`` as a Megatron-LM user launches it: stock
    pretrain_gpt.py with ``--use-torch-fsdp2`` over 2 data-parallel ranks, Megatron-LM's own
    flags, trains as stock data parallelism does (its context-parallel half needs
    TransformerEngine's attention in stock pretrain_gpt.py; ``megatron-tsp train`` runs the
    whole mode, test_train.py)."""
    untied = ("--untie-embeddings-and-output-weights",)
    losses, printed = _pretrain(tree, tree / "pretrain_gpt.py", "--use-torch-fsdp2", *untied)
    assert (printed["use_torch_fsdp2"], printed["data_parallel_size"]) == ("True", "2")
    assert sorted(losses) == list(range(1, ITERS + 1))
    ddp, _ = _pretrain(tree, tree / "pretrain_gpt.py", "--use-distributed-optimizer", *untied)
    _close(losses, ddp)
