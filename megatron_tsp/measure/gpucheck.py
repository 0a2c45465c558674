"""One-GPU check (``megatron-tsp gpu-check``, ``scripts/gpu_check.sh``): what one GPU shows.

Parts, each written to the results file as soon as it is done (a run cut short keeps what it
measured), within a time budget; every warning raised meanwhile, and the library versions,
are in the file too:

- **gemm**: fp32-accumulating GEMMs (:mod:`megatron_tsp.core.gemm`): which of ``mm`` and
  ``addmm`` with an fp32 output this torch computes, and, for 8 accumulated bf16 partial
  products of a TSP MLP's shape, the error against fp64 and the time of the path TSP takes
  against a bf16 GEMM per partial summed afterwards in fp32.
- **checks**: what each attention backend name resolves to here in bf16
  (:func:`~megatron_tsp.core.attention_kernels.resolve_backend`: ``auto`` at short and long
  keys, with packed documents, with a window) and whether each kernel's own check
  (:func:`~megatron_tsp.core.attention_kernels.check_backend`) passes, per head dim.
- **documents**: packed documents at micro-batch 1 through the block attention op in bf16,
  forward and backward, per backend against ``math`` in fp32.
- **backends**: every backend this GPU runs (``flash``, ``cudnn``, ``efficient``,
  ``flash_attn`` where installed) through the block attention op, forward and backward:
  correctness against ``math`` in the real layout (micro-batch 2, GQA, a zigzag rank's
  chunks; the first use of a backend also checks it and learns its causal alignment),
  then time at 8K-128K for one head group of a TSP rank of D=8 of the 7B (its two query
  chunks against all keys), and agreement between the backends there.
- **modes**: one rank (``rank``, 0 by default) of a D=8 job per mode, with torch's ``fake``
  process group (every kernel real, collectives no-ops) at a layer count that fits the
  budget: peak ``torch.cuda.max_memory_allocated`` against the memory planner's plan of the
  same rank on the same device, peak reserved memory, compute seconds per step (TSP against
  TP+SP), tokens/s and achieved TFLOP/s of that compute, and the attention kernel ``auto``
  chose. Models are freed between modes, so that each peak is its own, and a mode that
  fails (out of memory, say) is recorded as such while the next one runs.
- **profile** (with modes): one more step per mode under torch's profiler: its top ops and
  kernels by device time, and the kernels it launched.

On a machine without a GPU the backends part is skipped, the others run their CPU path (the
script's logic, tested in the suite), and a mode too big for a CPU is planned, then skipped.
"""

from __future__ import annotations

import gc
import importlib.metadata
import json
import os
import statistics
import time
import warnings
from functools import partial
from typing import Callable, Dict, List, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from megatron_tsp.core import attention_kernels as kernels
from megatron_tsp.core import gemm as gemms
from megatron_tsp.core.block_attention import block_attention
from megatron_tsp.core.head_groups import PLANNED_SMS, multiprocessors_of
from megatron_tsp.core.parallel_state import destroy_model_parallel
from megatron_tsp.device import Device
from megatron_tsp.env import run_record, shown_path
from megatron_tsp.measure import memory
from megatron_tsp.measure.distributed import fake_world
from megatron_tsp.run import config as cfg
from megatron_tsp.run.build import initialize, params_dtype, stepper
from megatron_tsp.run.modes import REFERENCE, SUBJECT, get_mode

SEQS = (8192, 32768, 131072)
HEAD_DIMS = (64, 128, 256)  # the checks part's: a smaller model's, every 7B-class config's, flash's largest
TOLERANCE = 2e-2  # bf16 against math in fp32: max error relative to the largest value
# The most a mode's step may compute on a CPU (about a second or two on a few cores): a bigger
# one (the 7B's rank) is planned, then skipped, so that the script rehearses on a CPU.
CPU_STEP_FLOPS = 1e11


def _timed(fn: Callable[[], object], device: Device, repeats: int = 3) -> float:
    fn()  # warm-up (and the backend's own check)
    times = []
    for _ in range(repeats):
        device.synchronize()
        t0 = time.perf_counter()
        fn()
        device.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _problem(seq: int, ranks: int, chunk_ids, batch: int, q_heads: int, kv_heads: int, head_dim: int,
             device: Device, dtype: torch.dtype, seed: int = 0):
    """q (a zigzag rank's chunks of a sequence cut in ``2 x ranks``), k, v (all keys) and dout,
    in megatron's ``[s, b, h, d]`` layout."""
    g = torch.Generator().manual_seed(seed)
    n_q = seq // (2 * ranks) * len(chunk_ids)

    def rand(s, h):
        return torch.randn(s, batch, h, head_dim, generator=g).to(device=device.torch, dtype=dtype)

    return rand(n_q, q_heads).requires_grad_(), rand(seq, kv_heads).requires_grad_(), \
        rand(seq, kv_heads).requires_grad_(), rand(n_q, q_heads)


def _fwd_bwd(backend: str, q, k, v, dout, chunk_ids, scale: float, documents=None):
    out = block_attention(q, k, v, chunk_ids, scale, backend, documents=documents)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return out, grads


def _max_rel_errs(got, ref) -> Dict[str, float]:
    """Max error of out, dq, dk, dv against the reference's, relative to its largest value."""
    return {n: float((a.detach().float() - b.detach().float()).abs().max() / b.detach().float().abs().max())
            for n, a, b in zip(("out", "dq", "dk", "dv"), got, ref)}


def _error(exc: BaseException) -> str:
    """An exception as a result: its type and first line."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _backend_names(device: Device) -> List[str]:
    """The attention backends this device runs: the GPU's (flash-attn's where installed), or the CPU's."""
    if not device.is_gpu:
        return ["cpu"]
    return [b for b in kernels.GPU_BACKENDS if b != "flash_attn" or kernels.flash_attn_installed()]


def check_gemms(device: Device, save: Callable[[], None], result: Dict) -> None:
    """Which fp32-output GEMMs this torch computes; on a GPU, :func:`_accumulated_products`."""
    part = result.setdefault("gemm", {})
    for dtype in (torch.bfloat16, torch.float16):
        name = str(dtype).split(".")[-1]
        part[f"fp32_output_{name}"] = gemms.fp32_output_gemm(device.torch, dtype)._asdict()
        with FakeTensorMode():  # what the memory planner's tensors take on this torch
            fake = torch.empty(1, 1, dtype=dtype, device=device.torch)
            part[f"fp32_output_{name}_fake_tensors"] = gemms.fake_fp32_output_gemm(fake)._asdict()
    save()
    if device.is_gpu:
        part.update(_accumulated_products(device))
        torch.cuda.empty_cache()
        save()


def _accumulated_products(device: Device, stages: int = 8, shape=(8192, 4096, 4096)) -> Dict:
    """``stages`` partial products ``a_i @ b_i`` ([m, k] @ [k, n], bf16) summed into one fp32
    output: by :func:`gemm.gemm` (what TSP runs) and by a bf16 GEMM per partial added in fp32
    (what it ran before), each against fp64 and timed."""
    m, k, n = shape
    g = torch.Generator().manual_seed(0)
    a = [torch.randn(m, k, generator=g).to(device.torch, torch.bfloat16) for _ in range(stages)]
    b = [torch.randn(k, n, generator=g).to(device.torch, torch.bfloat16) for _ in range(stages)]
    ref = sum(x.double() @ y.double() for x, y in zip(a, b))
    acc = torch.empty(m, n, device=device.torch, dtype=torch.float32)

    def inside():
        for i, (x, y) in enumerate(zip(a, b)):
            gemms.gemm(x, y, out=acc, accumulate=i > 0)
        return acc

    def after():
        acc.zero_()
        for x, y in zip(a, b):
            acc.add_(x @ y)
        return acc

    found: Dict = {"shape": {"m": m, "k": k, "n": n, "stages": stages}}
    for name, fn in (("accumulate_in_gemm", inside), ("bf16_gemm_then_fp32_add", after)):
        seconds = _timed(fn, device)
        found[name] = {"max_rel_err_vs_fp64": float((fn().double() - ref).abs().max() / ref.abs().max()),
                       "ms": 1e3 * seconds, "tflops": 2 * m * k * n * stages / seconds / 1e12}
    return found


def _outcome(fn: Callable[[], Dict]) -> Dict:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a kernel this GPU, torch or head dim lacks is a result
        return {"error": _error(exc)}


def _checked(name: str, device: Device, dtype: torch.dtype, head_dim: int) -> Dict:
    """The kernel ``name`` means here, its check, and the check of its window's blocks."""
    kernel = kernels.resolve_backend(kernels.validate_backend(name), device.torch, dtype, head_dim=head_dim)
    kernels.check_backend(kernel, device.torch, dtype, head_dim=head_dim)
    found = {"kernel": kernel, "bottom_right_causal": kernels.bottom_right(kernel, device.torch, dtype)}

    def window():
        kernels.resolve_backend(kernel, device.torch, dtype, windowed=True, head_dim=head_dim)
        kernels.check_backend(kernel, device.torch, dtype, windowed=True, head_dim=head_dim)
        return {"ok": True}

    found["window"] = _outcome(window)
    return found


def _auto(device: Device, dtype: torch.dtype, head_dim: int, options: Dict) -> Dict:
    return {"kernel": kernels.resolve_backend("auto", device.torch, dtype, head_dim=head_dim, **options)}


def check_kernels(device: Device, save: Callable[[], None], result: Dict) -> None:
    """Per head dim, in bf16: the kernel ``auto`` resolves to at 8K and 128K keys, with packed
    documents and with a window; each GPU backend's kernel and check (:func:`_checked`)."""
    dtype, part = torch.bfloat16, result.setdefault("checks", {})
    cases = {"keys_8192": {"keys": 8192}, "keys_131072": {"keys": 131072},
             "documents_131072": {"keys": 131072, "documents": True},
             "window_131072": {"keys": 131072, "windowed": True}}
    for head_dim in HEAD_DIMS:
        part.setdefault("auto", {})[head_dim] = {case: _outcome(partial(_auto, device, dtype, head_dim, options))
                                                 for case, options in cases.items()}
        for name in kernels.GPU_BACKENDS:
            part.setdefault(name, {})[head_dim] = _outcome(partial(_checked, name, device, dtype, head_dim))
        save()


def check_backends(device: Device, seqs, budget_end: float, save: Callable[[], None], result: Dict) -> None:
    if not device.is_gpu:
        result["backends"] = {"skipped": "no GPU"}
        return
    dtype, part = torch.bfloat16, result.setdefault("backends", {})
    names = _backend_names(device)
    # correctness: rank 1 of D=8 (chunks 1 and 14 of 16), 64-token chunks, GQA 8:2, micro-batch 2
    chunk_ids, scale = [1, 14], 128 ** -0.5
    q, k, v, dout = _problem(1024, 8, chunk_ids, 2, 8, 2, 128, device, dtype)
    ref_out, ref_grads = _fwd_bwd("math", q, k, v, dout, chunk_ids, scale)
    for name in names:
        entry = part.setdefault(name, {})
        try:
            out, grads = _fwd_bwd(name, q, k, v, dout, chunk_ids, scale)
            entry["max_rel_err_vs_math"] = _max_rel_errs((out, *grads), (ref_out, *ref_grads))
            entry["bottom_right_causal"] = kernels.bottom_right(name, device.torch, dtype)
        except Exception as exc:  # noqa: BLE001 - a backend this GPU or torch lacks is a result
            entry["error"] = _error(exc)
        save()
    # speed: one head group of a TSP rank of D=8 of the 7B (4 heads of 128), chunks 0 and 15
    working = [n for n in names if "error" not in part[n]]
    for seq in seqs:
        if time.monotonic() > budget_end:
            part.setdefault("skipped", []).append(f"S={seq}: time budget")
            continue
        q, k, v, dout = _problem(seq, 8, [0, 15], 1, 4, 4, 128, device, dtype, seed=seq)
        outputs = {}
        for name in working:
            try:
                part[name].setdefault("fwd_bwd_ms", {})[seq] = 1e3 * _timed(
                    partial(_fwd_bwd, name, q, k, v, dout, [0, 15], scale), device)
                outputs[name] = _fwd_bwd(name, q, k, v, dout, [0, 15], scale)[0].detach().float()
            except Exception as exc:  # noqa: BLE001 - out of memory at 128K, say
                part[name].setdefault("errors_at", {})[seq] = _error(exc)
            save()
        base = next(iter(outputs.values()), None)
        for name, out in outputs.items():
            part[name].setdefault("max_rel_diff_vs_" + working[0], {})[seq] = float(
                (out - base).abs().max() / base.abs().max())
        del q, k, v, dout, outputs, base
        torch.cuda.empty_cache()
        save()


def check_documents(device: Device, seq: int, save: Callable[[], None], result: Dict) -> None:
    """Packed documents at micro-batch 1: rank 3 of D=8's zigzag chunks (3 and 12 of 16) of a
    ``seq``-token sample, one 7B head group (4 heads of 128), in bf16 through every backend
    here, forward and backward, against ``math`` in fp32 (max errors relative to its largest
    values, within :data:`TOLERANCE`). The documents: two of 3 and 1 tokens at the start, one
    starting at chunk 3's first token and one inside it, one ending a token before chunk 7,
    one of a token at chunk 12's start, and one starting inside chunk 15."""
    c, chunk_ids, scale = seq // 16, [3, 12], 128 ** -0.5
    documents = [[0, 3, 4, 3 * c, 3 * c + c // 3, 7 * c - 1, 12 * c, 12 * c + 1, 15 * c + 5]]
    auto = kernels.resolve_backend("auto", device.torch, torch.bfloat16, keys=seq, documents=True, head_dim=128)
    result["documents"] = {"seq": seq, "chunk_ids": chunk_ids, "documents": documents, "tolerance": TOLERANCE,
                           "auto_kernel": auto, "backends": {}}
    part = result["documents"]["backends"]
    q, k, v, dout = _problem(seq, 8, chunk_ids, 1, 4, 4, 128, device, torch.bfloat16, seed=3)
    fp32 = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref_out, ref_grads = _fwd_bwd("math", *fp32, dout.float(), chunk_ids, scale, documents)
    for name in _backend_names(device):
        try:
            out, grads = _fwd_bwd(name, q, k, v, dout, chunk_ids, scale, documents)
            errs = _max_rel_errs((out, *grads), (ref_out, *ref_grads))
            part[name] = {"max_rel_err_vs_math_fp32": errs, "within_tolerance": max(errs.values()) <= TOLERANCE}
        except Exception as exc:  # noqa: BLE001 - a backend that refuses documents here is a result
            part[name] = {"error": _error(exc)}
        save()
    del q, k, v, dout, fp32, ref_out, ref_grads
    if device.is_gpu:
        torch.cuda.empty_cache()


def _profiled(step: Callable[[], None], device: Device, top: int = 30) -> Dict:
    """One more step under torch's profiler: the ops that took the most device time (on the
    CPU, CPU time) and, on a GPU, the kernels, by name, with their calls and milliseconds, and
    the kernel launches the host made (the CUDA/HIP runtime's and driver's launch calls: what
    a host-bound step pays per kernel)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.is_gpu:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        step()
        device.synchronize()
    events = prof.key_averages()

    def ms(e):
        return (e.self_device_time_total if device.is_gpu else e.self_cpu_time_total) / 1e3

    def table(rows):
        rows = sorted((e for e in rows if ms(e) > 0), key=ms, reverse=True)
        return {"total_ms": sum(map(ms, rows)),
                "top": [{"name": e.key[:160], "calls": e.count, "ms": ms(e)} for e in rows[:top]]}

    found = {"ops": table(e for e in events if e.device_type.name == "CPU")}
    if device.is_gpu:
        found["kernels"] = table(e for e in events if e.device_type.name != "CPU")
        found["kernels"]["launches"] = sum(e.count for e in events
                                           if e.device_type.name == "CPU" and "LaunchKernel" in e.key)
    return found


def _measure_mode(args, mode: str, steps: int, device: Device, entry: Dict, profile: bool = False,
                  attention_backend: str = "auto", rank: int = 0) -> None:
    with fake_world(cfg.sizes(args).world_size, rank):
        initialize(args, device, create_gloo_process_groups=False)
        step = stepper(args, device, get_mode(mode), clip_grad=0.0, use_gloo_process_groups=False,
                       attention_backend=attention_backend)
        step()  # warm-up; also creates Adam's moments
        device.synchronize()
        device.reset_peak_memory()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            device.synchronize()
            times.append(time.perf_counter() - t0)
        if profile:
            entry["profile"] = _profiled(step, device)
    seconds = statistics.median(times)
    tokens = args.seq_length * args.micro_batch_size * cfg.sizes(args).dp  # one micro-batch per replica a step
    entry.update(step_s=times, compute_s_median=seconds, tokens_per_s=tokens / seconds,
                 achieved_tflops=entry["flops_per_rank"] / seconds / 1e12)
    if device.is_gpu:
        entry.update(measured_peak_gib=device.peak_memory_gib(),
                     measured_peak_reserved_gib=torch.cuda.max_memory_reserved() / 2 ** 30)


def check_modes(values: Dict, modes: List[str], steps: int, device: Device, budget_end: float,
                save: Callable[[], None], result: Dict, profile: bool = False,
                attention_backend: str = "auto", rank: int = 0) -> None:
    part = result.setdefault("modes", {})
    for mode in modes:
        if time.monotonic() > budget_end:
            part[mode] = {"skipped": "time budget"}
            save()
            continue
        entry = part[mode] = {}
        try:
            planned = memory.plan(dict(values), mode, device=device, attention_backend=attention_backend, rank=rank,
                                  multiprocessors=multiprocessors_of(device.torch) if device.is_gpu else PLANNED_SMS)
            args = get_mode(mode).args(values)
            layers = get_mode(mode).layer_spec(args)
            # TransformerEngine's layers attend with TE's own kernels; the planner plans local ones
            kernel = "transformer_engine" if layers == "transformer_engine" else \
                kernels.resolve_backend(attention_backend, device.torch, params_dtype(args), keys=args.seq_length,
                                        documents=args.reset_attention_mask, head_dim=args.kv_channels)
            entry.update(parallel=planned["parallel"], planned_peak_gib=planned["peak_gib"],
                         planned_by_category_gib=planned["by_category_gib"],
                         flops_per_rank=planned["flops_per_rank"], layer_spec=layers, attention_kernel=kernel,
                         **({"planned_as": "local"} if layers == "transformer_engine" else {}))
            entry.update(head_groups_per_call=planned["head_groups_per_call"],
                         mlp_shards_per_call=planned["mlp_shards_per_call"])
            if not device.is_gpu and planned["flops_per_rank"] > CPU_STEP_FLOPS:
                entry["skipped"] = f"no GPU: {planned['flops_per_rank'] / 1e12:.1f} TFLOP a step is minutes on a CPU"
            else:
                _measure_mode(args, mode, steps, device, entry, profile, attention_backend, rank)
        except Exception as exc:  # noqa: BLE001 - out of memory, say: a result, and the next mode runs
            entry["error"] = _error(exc)
        finally:
            destroy_model_parallel()
            gc.collect()
            if device.is_gpu:
                torch.cuda.empty_cache()
        save()
    if all("compute_s_median" in part.get(m, {}) for m in (SUBJECT, REFERENCE)):
        result["tsp_vs_tp_sp_compute"] = part[SUBJECT]["compute_s_median"] / part[REFERENCE]["compute_s_median"]
        save()


PARTS = ("gemm", "checks", "documents", "backends", "modes", "profile")


def _versions() -> Dict[str, Optional[str]]:
    """The GPU libraries' versions that :func:`run_record` leaves out (it has torch's,
    megatron-core's and TransformerEngine's); None where absent."""
    try:
        flash_attn = importlib.metadata.version("flash-attn")
    except importlib.metadata.PackageNotFoundError:
        flash_attn = None
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {"cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None),
            "cudnn": None if cudnn is None else str(cudnn), "flash-attn": flash_attn}


def _warnings(caught: List[warnings.WarningMessage]) -> List[Dict]:
    """Each distinct warning (category and message) once, with where it was first raised."""
    found: Dict = {}
    for w in caught:
        key = (w.category.__name__, str(w.message))
        found.setdefault(key, {"category": key[0], "message": key[1], "where": f"{shown_path(w.filename)}:{w.lineno}"})
    return list(found.values())


def run(out: str, config_path: str, modes: List[str], steps: int, overrides: Dict, budget_s: float,
        seqs=SEQS, device: Optional[Device] = None, parts=PARTS, attention_backend: str = "auto",
        rank: int = 0) -> Dict:
    device = device or Device.from_launch()
    device.activate()
    end = time.monotonic() + budget_s
    values = cfg.load_config(config_path)
    values.update(overrides)
    config = os.path.relpath(config_path)
    result: Dict = {"setup": run_record(config=config, overrides=overrides, modes=modes, steps=steps, rank=rank,
                                        parts=list(parts), attention_backend=attention_backend, **_versions()),
                    "config": config}
    # every warning of the run goes into the results (the filters the command line set still hold:
    # what is known noise stays out), since a kernel set aside says so in a warning
    with warnings.catch_warnings(record=True) as caught:

        def save() -> None:
            result["warnings"] = _warnings(caught)
            os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
            with open(out + ".tmp", "w", encoding="utf-8") as f:
                json.dump(result, f, indent=2, default=str)
            os.replace(out + ".tmp", out)

        save()
        if "gemm" in parts:
            check_gemms(device, save, result)
        if "checks" in parts:
            check_kernels(device, save, result)
        if "documents" in parts:
            check_documents(device, 8192 if device.is_gpu else 1024, save, result)  # a CPU's: seconds
        if "backends" in parts:
            check_backends(device, seqs, end - budget_s / 2, save, result)  # half the budget at most
        if "modes" in parts:
            check_modes(values, modes, steps, device, end, save, result, "profile" in parts, attention_backend,
                        rank)
        save()
    return result


def summary(result: Dict) -> str:
    setup = result["setup"]
    lines = [f"{setup.get('device')}: torch {setup.get('torch')}, CUDA {setup.get('cuda')}, HIP {setup.get('hip')}, "
             f"cuDNN {setup.get('cudnn')}, flash-attn {setup.get('flash-attn')}"]
    for name, entry in result.get("gemm", {}).items():
        lines.append(f"gemm {name}: {entry}")
    for name, by_dim in result.get("checks", {}).items():
        lines.append(f"check {name}: " + ", ".join(f"d={d} {_checks_cell(e)}" for d, e in by_dim.items()))
    for name, entry in result.get("backends", {}).items():
        if isinstance(entry, dict):
            err = entry.get("error") or max(entry.get("max_rel_err_vs_math", {}).values(), default=None)
            lines.append(f"backend {name}: vs math {err}, fwd+bwd ms {entry.get('fwd_bwd_ms')}")
    for name, entry in result.get("documents", {}).get("backends", {}).items():
        lines.append(f"documents {name}: {entry.get('error') or entry.get('max_rel_err_vs_math_fp32')}")
    for mode, entry in result.get("modes", {}).items():
        lines.append(f"{mode} (rank {setup.get('rank', 0)}): compute {entry.get('compute_s_median')} s/step, "
                     f"{entry.get('achieved_tflops')} TFLOP/s, kernel {_kernel(entry)}, peak measured "
                     f"{entry.get('measured_peak_gib')} GiB (reserved {entry.get('measured_peak_reserved_gib')}), "
                     f"planned {entry.get('planned_peak_gib')} GiB"
                     + "".join(f", {entry[k]}" for k in ("error", "skipped") if k in entry))
    lines += [f"warning {w['category']}: {w['message']}" for w in result.get("warnings", [])]
    return "\n".join(lines)


def _checks_cell(entry: Dict) -> str:
    """A checks part's entry in a few words: auto's kernel per case, or a kernel, its causal
    alignment and its window's check, or an error."""
    if "error" in entry:
        return entry["error"]
    if "kernel" not in entry:  # auto: a case each
        return " ".join(f"{case}:{e.get('kernel') or e.get('error')}" for case, e in entry.items())
    window = entry["window"].get("error", "ok")
    return f"{entry['kernel']} (bottom-right {entry['bottom_right_causal']}, window {window})"


def _kernel(entry: Dict) -> str:
    groups, shards = entry.get("head_groups_per_call"), entry.get("mlp_shards_per_call")
    return f"{entry.get('attention_kernel')}" + (f", {groups} head groups a call" if groups else "") + \
        (f", {shards} MLP shards a call" if shards else "")


def table(result: Dict, top: int = 12) -> str:
    """The results file as markdown: GEMMs, kernel checks, backends, documents, modes, each
    mode's profile, and the warnings."""
    setup = result["setup"]
    lines = [f"# gpu-check: {setup.get('device')}, torch {setup.get('torch')}, megatron-core "
             f"{setup.get('megatron-core')}", "", f"config {result['config']}, overrides {setup.get('overrides')}, "
             f"{setup.get('date')}"]
    gemm = result.get("gemm", {})
    if gemm:
        lines += ["", "| fp32-output GEMM | mm | addmm |", "|---|---|---|"]
        lines += [f"| {name} | {v['mm']} | {v['addmm']} |" for name, v in gemm.items()
                  if name.startswith("fp32_output")]
        paths = [(name, v) for name, v in gemm.items() if isinstance(v, dict) and "ms" in v]
        if paths:
            shape = gemm["shape"]
            lines += ["", f"{shape['stages']} bf16 products [{shape['m']}x{shape['k']}] @ [{shape['k']}x{shape['n']}] "
                      "summed in fp32:", "", "| path | ms | TFLOP/s | max rel. error vs fp64 |", "|---|---|---|---|"]
            lines += [f"| {name} | {v['ms']:.2f} | {v['tflops']:.0f} | {v['max_rel_err_vs_fp64']:.1e} |"
                      for name, v in paths]
    checks = result.get("checks", {})
    if checks:
        dims = list(next(iter(checks.values())))
        lines += ["", "Attention kernels in bf16 (resolve_backend, check_backend) per head dim:", "",
                  "| backend | " + " | ".join(f"d={d}" for d in dims) + " |", "|---|" + "---|" * len(dims)]
        lines += [f"| {name} | " + " | ".join(_checks_cell(by_dim[d]) for d in dims) + " |"
                  for name, by_dim in checks.items()]
    backends = {n: v for n, v in result.get("backends", {}).items() if isinstance(v, dict) and "fwd_bwd_ms" in v}
    if backends:
        seqs = sorted({int(s) for v in backends.values() for s in v["fwd_bwd_ms"]})
        lines += ["", "Attention backends, one head group of a TSP rank of D=8 of the 7B, fwd+bwd ms:", "",
                  "| backend | bottom-right causal | max rel. err vs math | "
                  + " | ".join(f"S={s}" for s in seqs) + " |",
                  "|---|---|---|" + "---|" * len(seqs)]
        for name, v in backends.items():
            times = {int(s): ms for s, ms in v["fwd_bwd_ms"].items()}
            lines.append(f"| {name} | {v.get('bottom_right_causal')} | {max(v['max_rel_err_vs_math'].values()):.1e} | "
                         + " | ".join(f"{times[s]:.2f}" if s in times else "-" for s in seqs) + " |")
    documents = result.get("documents", {})
    if documents:
        lines += ["", f"Packed documents, micro-batch 1, S={documents['seq']}, chunks {documents['chunk_ids']}, "
                  f"document starts {documents['documents'][0]}; bf16 against math in fp32 (auto: "
                  f"{documents['auto_kernel']}):", "", "| backend | out | dq | dk | dv |", "|---|---|---|---|---|"]
        for name, v in documents["backends"].items():
            if "error" in v:
                lines.append(f"| {name} | {v['error']} | | | |")
            else:
                lines.append(f"| {name} | " + " | ".join(f"{e:.1e}" for e in v["max_rel_err_vs_math_fp32"].values())
                             + " |")
    modes = result.get("modes", {})
    if modes:
        lines += ["", f"Rank {setup.get('rank', 0)}, fake process group (collectives no-ops):", "",
                  "| mode | compute s/step | TFLOP/s | job tokens/s | kernel | peak GiB measured | planned "
                  "| reserved |",
                  "|---|---|---|---|---|---|---|---|"]
        for mode, e in modes.items():
            if "compute_s_median" not in e:  # what was planned before it failed or was skipped
                planned = f"{e['planned_peak_gib']:.2f}" if "planned_peak_gib" in e else ""
                kernel = _kernel(e) if "attention_kernel" in e else ""
                lines.append(f"| {mode} | {e.get('error') or e.get('skipped')} | | | {kernel} | | {planned} | |")
                continue
            lines.append(f"| {mode} | {e['compute_s_median']:.3f} | {e['achieved_tflops']:.0f} | "
                         f"{e['tokens_per_s']:.0f} | {_kernel(e)} | {e.get('measured_peak_gib') or 0:.2f} | "
                         f"{e['planned_peak_gib']:.2f} | {e.get('measured_peak_reserved_gib') or 0:.2f} |")
        if "tsp_vs_tp_sp_compute" in result:
            lines += ["", f"TSP / TP+SP compute: {result['tsp_vs_tp_sp_compute']:.3f}"]
    for mode, e in modes.items():
        for kind, prof in e.get("profile", {}).items():
            launches = f", {prof['launches']} kernel launches" if "launches" in prof else ""
            lines += ["", f"{mode}: top {kind} by device time, one step ({prof['total_ms']:.1f} ms in all{launches})",
                      "", "| ms | calls | name |", "|---|---|---|"]
            lines += [f"| {row['ms']:.1f} | {row['calls']} | `{row['name'][:100]}` |" for row in prof["top"][:top]]
    if result.get("warnings"):
        lines += ["", "Warnings:", ""] + [f"- {w['category']}: {w['message']} ({w['where']})"
                                         for w in result["warnings"]]
    return "\n".join(lines)
