"""The fake-CUDA process: ``python -m fake_cuda RUNTIME.so < cases.json`` (see __init__)."""

import ctypes
import json
import os
import sys
import traceback

RUNTIME = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)  # before torch: see runtime.cpp

import fake_cuda  # noqa: E402

fake_cuda.install_torch_cuda()  # imports torch
RUNTIME.fake_cuda_take_over()
sys.path.insert(0, os.path.join(fake_cuda.TESTS, "standins"))  # flash_attn

import torch  # noqa: E402

from megatron_tsp.device import Device  # noqa: E402
from megatron_tsp.measure import memory  # noqa: E402
from megatron_tsp.run import compat  # noqa: E402
from megatron_tsp.run import config as cfg  # noqa: E402

fake_cuda.install_kernel_contracts()  # after megatron-core's imports, which register aten ops by name
fake_cuda.forbid_host_reads_in_the_step()


def documents_op(case):
    """The attention op on packed documents forward and backward on fake CUDA tensors: the
    baselines' op at micro-batch 2 (each sample its own documents, and shared), and TSP's
    zigzag blocks of every rank of D=2 at micro-batch 1 and 2 through attend_into and the
    backward in the schedule's two calls (a rank's chunks are separate runs, whose lse rows
    are strided views at micro-batch 1); a chunk's document pieces as varlen calls (counted)."""
    from reference import DOCUMENTS, TSP_DOCUMENTS, KernelCalls
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_tsp.core.block_attention import attend_backward_into, attend_into, block_attention
    from megatron_tsp.core.block_geometry import zigzag_document_blocks

    def tensors(*shapes):
        return [torch.randn(*shape, device="cuda", dtype=torch.bfloat16) for shape in shapes]

    with KernelCalls(case["backend"], ("forward_varlen", "backward_varlen")) as counted, FakeTensorMode():
        for documents in DOCUMENTS:
            q, k, v = (t.requires_grad_() for t in tensors((32, 2, 4, 64), (48, 2, 2, 64), (48, 2, 2, 64)))
            out = block_attention(q, k, v, [1, 2], 0.125, case["backend"], documents=documents)
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        for documents in TSP_DOCUMENTS:
            for rank in (0, 1):
                forward, (backward, split) = zigzag_document_blocks(2, rank, 16, documents)
                b = len(documents)
                q, dout, k, v = tensors((32, b, 4, 64), (32, b, 4, 64), (64, b, 2, 64), (64, b, 2, 64))
                out = torch.empty_like(q)
                lse = attend_into(q, k, v, forward, 0.125, case["backend"], out)
                dq, dk, dv = torch.empty_like(q), k.float(), v.float()
                for first, last in ((0, split), (split, len(backward))) if split else ((0, len(backward)),):
                    attend_backward_into(dout, q, k, v, out, lse, backward, 0.125, case["backend"], dq, dk, dv, first,
                                         last, zero_untouched=first == 0)
    return counted.calls


def one(case):
    if case.get("op") == "documents":
        return documents_op(case)
    fake_cuda.READ_IN_THE_STEP[:] = [True] if case.get("host_read") else []
    values = cfg.load_config(os.path.join(fake_cuda.ROOT, case["config"]))
    values.update(case.get("overrides", {}))
    torch.version.hip = "6.4" if case.get("rocm") else None  # torch-ROCm: its flash kernel is AOTriton
    try:
        result = memory.plan(values, case["mode"], attention_backend=case.get("backend", "auto"),
                             device=Device("cuda"), fused_norm=case.get("fused_norm", True))
    finally:
        torch.version.hip = None
    return {"peak_gib": result["peak_gib"], "flops": result["flops_per_rank"]}


def main():
    results = []
    for case in json.load(sys.stdin):
        try:
            results.append({"case": case, "error": None, **one(case)})
        except Exception as exc:  # noqa: BLE001 - reported per case
            results.append({"case": case, "error": f"{type(exc).__name__}: {exc}",
                            "traceback": traceback.format_exc()})
    # a GPU process never enables megatron-core's CPU shims (they would put tensors on the CPU)
    results.append({"case": "cpu shims", "error": "enabled" if compat.cpu_support_enabled() else None})
    print(json.dumps(results), flush=True)


main()
# A CUDA build of torch tears down its CUDA state at exit, which the stand-in runtime never
# set up (the process would abort after its results are written).
sys.stdout.flush()
os._exit(0)
