"""Megatron-LM integration: --tsp-size onto the tensor-parallel slot.

The argument translation is tested everywhere; parsing with a real Megatron-LM checkout
(tag core_v0.16.1) and applying the patch run when MEGATRON_LM_PATH points to one.
"""

import os
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT

from megatron_tsp import megatron_lm

MEGATRON_LM = os.environ.get("MEGATRON_LM_PATH")
needs_megatron_lm = pytest.mark.skipif(
    not MEGATRON_LM or not os.path.isfile(os.path.join(MEGATRON_LM or "", "pretrain_gpt.py")),
    reason="set MEGATRON_LM_PATH to a Megatron-LM core_v0.16.1 checkout")


def test_tsp_size_maps_onto_the_tensor_parallel_slot():
    out = megatron_lm.translate_argv(["x", "--num-layers", "2", "--tsp-size", "8"])
    assert out[:5] == ["x", "--num-layers", "2", "--tsp-size", "8"]
    assert out[5:] == ["--tensor-model-parallel-size", "8", "--sequence-parallel", "--spec",
                       "megatron_tsp.megatron_lm", "layer_spec", "--attention-dropout", "0.0"]
    assert megatron_lm.translate_argv(["x", "--tsp-size=2", "--qk-layernorm"])[-3] == "layer_spec_qk_layernorm"
    assert megatron_lm.translate_argv(["x", "--tensor-model-parallel-size", "8"]) == \
        ["x", "--tensor-model-parallel-size", "8"]


@pytest.mark.parametrize("argv,message", [
    (["--tensor-model-parallel-size", "2"], "set --tensor-model-parallel-size 1"),
    (["--context-parallel-size", "2"], "set --context-parallel-size 1"),
    (["--num-experts", "8"], "--num-experts cannot be used with --tsp-size"),
    (["--attention-dropout", "0.1"], "set --attention-dropout 0"),
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


def test_spec_objects_are_layer_specs():
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_tsp.core.mlp import TSPMLP

    assert megatron_lm.layer_spec.module is TransformerLayer
    assert megatron_lm.layer_spec.submodules.self_attention.submodules.core_attention is not None
    ring = megatron_lm.ring_layer_spec  # megatron's own attention, the ring MLP, the norm apart from fc1
    assert ring.module is TransformerLayer and ring.submodules.mlp.module is TSPMLP
    assert ring.submodules.sharded_state_dict_keys_map["pre_mlp_layernorm."] == "mlp.linear_fc1.layer_norm_"


PARSE = r"""
import sys
sys.argv = ["pretrain_gpt.py"] + sys.argv[1:]
from megatron_tsp import megatron_lm
sys.argv = megatron_lm.translate_argv(sys.argv)
from megatron.training.arguments import parse_args
args = parse_args(extra_args_provider=megatron_lm.add_tsp_args)
print("|".join(map(str, (args.tsp_size, args.tensor_model_parallel_size, args.sequence_parallel,
                          args.spec, args.seq_length))))
"""


@needs_megatron_lm
@pytest.mark.parametrize("name", ["128k-tsp8", "128k-tp8-sp", "128k-tp8-sp-ring", "128k-tp4-cp2", "16k-tsp8"])
def test_rendered_configs_parse_with_megatron_lm(name):
    flags = subprocess.run([sys.executable, "-m", "megatron_tsp.cli", "args",
                            os.path.join(ROOT, "configs", "7b", f"{name}.yaml")],
                           check=True, capture_output=True, text=True).stdout.split()
    env = dict(os.environ, PYTHONPATH=MEGATRON_LM + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", PARSE, *flags], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    tsp, tp, sp, spec, seq = out.stdout.strip().splitlines()[-1].split("|")
    assert seq == ("131072" if name.startswith("128k") else "16384")
    if "tsp" in name:
        assert (tsp, tp, sp) == ("8", "8", "True") and "megatron_tsp.megatron_lm" in spec
    elif "ring" in name:
        assert (tsp, tp, sp) == ("1", "8", "True") and "ring_layer_spec" in spec
    else:
        assert tsp == "1" and spec == "None"


@needs_megatron_lm
def test_patch_applies_to_pretrain_gpt(tmp_path):
    work = tmp_path / "pretrain_gpt.py"
    shutil.copy(os.path.join(MEGATRON_LM, "pretrain_gpt.py"), work)
    subprocess.run(["patch", "--dry-run", "-p1", "-d", str(tmp_path), "-i",
                    os.path.join(ROOT, "patches", "pretrain_gpt_tsp.patch")], check=True,
                   capture_output=True)
