"""The GPU code path on this CPU: one training step of rank 0 of every mode, with every
tensor on device ``cuda`` (FakeTensorMode), torch's ``fake`` process group and the GPU
attention kernels through their meta functions (tests/fake_cuda). A tensor on the wrong
device, a collective on a CPU tensor, a kernel called with the wrong arguments or an lse of
the wrong shape fails its case, as it would on a GPU."""

import concurrent.futures
import json
import os
import shutil

import fake_cuda
import pytest

MODES = ("tsp", "tsp-no-overlap", "tp", "tp-sp", "tp-sp-ring", "tp-ring", "tp-cp")
BACKENDS = ("flash", "cudnn", "efficient", "flash_attn")
TINY, SEVEN_B = "configs/tiny-cpu.yaml", "configs/7b/128k-tsp8.yaml"
ODD = {"bf16": True, "seq_length": 120, "max_position_embeddings": 120}  # zigzag chunks of 30 and 60 tokens
WINDOW = dict(ODD, window_size="16,0", window_attn_skip_freq=2)  # a band of the previous chunk, then every key
CASES = (
    # every GPU kernel, bf16, on the default config at a length no kernel tile divides
    [dict(config=TINY, mode=m, backend=b, overrides=ODD)
     for m in ("tsp", "tp-sp", "tp-sp-ring", "tp-cp") for b in BACKENDS]
    # the default config as it is (fp32: auto picks the memory-efficient kernel)
    + [dict(config=TINY, mode=m) for m in MODES]
    # torch-ROCm (the paper's MI300X): auto is the flash kernel, AOTriton, whose backward refuses
    # a non-square causal block (the planner planned CUDA's bottom-right ones)
    + [dict(config=TINY, mode=m, overrides=ODD, rocm=True) for m in ("tsp", "tp-cp")]
    # a sliding window on the kernels that take one themselves (auto: flash), and the fp32 fallback (math)
    + [dict(config=TINY, mode=m, backend=b, overrides=WINDOW) for m in ("tsp", "tp-sp", "tp-cp")
       for b in ("flash", "flash_attn")]
    + [dict(config=TINY, mode="tsp", overrides=dict(WINDOW, bf16=False))]
    # packed documents through the attention op: a chunk's document pieces as one varlen call
    + [dict(config=TINY, mode="op", op="documents", backend=b) for b in ("flash", "flash_attn")]
    # the paper's 7B at 128K (D=8, bf16, full recompute) at 2 layers, auto (the flash kernel)
    + [dict(config=SEVEN_B, mode=m, overrides={"num_layers": 2}) for m in ("tsp", "tp", "tp-sp", "tp-sp-ring", "tp-cp")]
)


def _key(case):
    return json.dumps(case, sort_keys=True)


_STARTED = []


def _compiler() -> bool:
    return shutil.which(os.environ.get("CXX", "c++")) is not None


SEVEN_B_STEPS = [dict(config=SEVEN_B, mode=m, overrides={"num_layers": 2}) for m in ("tsp", "tp")]


HOST_READ = dict(config=TINY, mode="tsp", host_read=True)  # a step that reads a device scalar on the host


def _cases(items) -> list:
    """The cases the selected tests read (all of them where none were given)."""
    if items is None:
        return list(CASES) + [HOST_READ]
    wanted = [item.callspec.params["case"] for item in items if hasattr(item, "callspec")]
    if any(item.name == "test_tsp_needs_less_memory_at_long_context" for item in items):
        wanted += [c for c in SEVEN_B_STEPS if c not in wanted]
    if any(item.name == "test_a_host_read_inside_the_step_fails_its_case" for item in items):
        wanted.append(HOST_READ)
    return wanted


def start_in_background(items=None) -> None:
    """Called by conftest with the selected tests: the fake-CUDA process (a compile and a
    planned step per case they read, in a process of its own) runs beside the tests before
    them."""
    if _compiler() and not _STARTED:
        _STARTED.append(concurrent.futures.ThreadPoolExecutor(1).submit(fake_cuda.run, _cases(items)))


@pytest.fixture(scope="module")
def results():
    if not _compiler():
        pytest.skip("no C++ compiler to build the fake CUDA runtime (tests/fake_cuda/runtime.cpp)")
    start_in_background()
    return {_key(r["case"]): r for r in _STARTED[0].result()}


# the default tier's: a TSP step on the flash kernel, and packed documents through both varlen forms
REPRESENTATIVES = [dict(config=TINY, mode="tsp", backend="flash", overrides=ODD)] + [
    c for c in CASES if c.get("op") == "documents"]


def _id(c) -> str:
    return (f"{os.path.basename(c['config'])}-{c['mode']}-{c.get('backend', 'auto')}"
            + ("-rocm" if c.get("rocm") else "") + ("-window" if "window_size" in c.get("overrides", {}) else "")
            + ("-fp32" if c.get("overrides", {}).get("bf16") is False else "") + ("-documents" if c.get("op") else ""))


@pytest.mark.parametrize("case", [c if c in REPRESENTATIVES else pytest.param(c, marks=pytest.mark.full)
                                  for c in CASES], ids=[_id(c) for c in CASES])
def test_a_gpu_training_step_runs(results, case):
    result = results[_key(case)]
    assert result["error"] is None, result["traceback"]
    if case.get("op") == "documents":
        forward, backward = _varlen_runs(case["backend"])
        assert (result["forward_varlen"], result["backward_varlen"]) == (forward, backward)
        assert min(forward, backward) > 0
    else:
        assert result["peak_gib"] > 0 and result["flops"] > 0


def test_a_host_read_inside_the_step_fails_its_case(results):
    """The guard every case above runs its step under catches a read (``.item()`` of a device
    scalar, here at the start of the schedule): the steps above read none."""
    result = results[_key(HOST_READ)]
    assert result["error"] is not None and "HostRead" in result["traceback"], result
    assert "_local_scalar_dense" in result["traceback"]


def _varlen_runs(backend):
    """The varlen calls fake_cuda's documents op makes: (forward, backward)."""
    from reference import DOCUMENTS, TSP_DOCUMENTS, kernel_calls

    from megatron_tsp.core.block_geometry import blocks, zigzag_document_blocks

    op = sum(kernel_calls(blocks([1, 2], 16, True, -1, backend, documents), varlen=True)[0]
             for documents in DOCUMENTS)
    forward = backward = op
    for documents in TSP_DOCUMENTS:
        for rank in (0, 1):
            blocks_, (backward_blocks, split) = zigzag_document_blocks(2, rank, 16, documents)
            forward += kernel_calls(blocks_, varlen=True)[0]
            backward += sum(kernel_calls(part, varlen=True)[0]
                            for part in (backward_blocks[:split], backward_blocks[split:]))
    return forward, backward


def test_a_gpu_process_never_enables_the_cpu_shims(results):
    assert results[_key("cpu shims")]["error"] is None


@pytest.mark.full
def test_tsp_needs_less_memory_at_long_context(results):
    peak = {m: results[_key(dict(config=SEVEN_B, mode=m, overrides={"num_layers": 2}))]["peak_gib"]
            for m in ("tsp", "tp")}
    assert peak["tsp"] < peak["tp"]
