"""TSP's bf16 gradients are as precise as megatron TP+SP's.

A TP+SP layer forms each weight shard's gradient in one GEMM that accumulates in fp32; TSP
sums D partial gradients over ranks (attention weights by reduce, the MLP's around the ring,
dK/dV by reduce-scatter). Summed in bf16 those sums would lose bits; TSP forms and sums them
in fp32. Both models here hold the same bf16 weights and see the same batch; each one's
gradients (DDP's fp32 main grads after one backward pass) are compared with those of the
same weights in float64 on one rank.
"""

import pytest
import torch
import torch.distributed as dist
from gpt_models import MICRO_BATCH, SEQ, batches, setup
from megatron.core import parallel_state as mpu
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_tsp.run import step as training

D = 4


def _gradients(mode, dtype):
    """{parameter name: full fp64 gradient} on rank 0 after one backward pass."""
    kwargs = dict(tsp=D) if mode == "tsp" else dict(tp=D) if mode == "tp-sp" else {}
    chunks, _, transform = setup(mode, "modern", params_dtype=dtype, bf16=dtype == torch.bfloat16,
                                 grad_reduce_in_fp32=True, with_optimizer=False, **kwargs)
    model = chunks[0]
    if dtype == torch.float64:  # the very weights of the bf16 models
        with torch.no_grad():
            for p in model.module.parameters():
                p.copy_(p.to(torch.bfloat16))
    model.zero_grad_buffer()
    get_forward_backward_func()(forward_step_func=training.make_forward_step(transform),
                                data_iterator=iter(batches(1)), model=chunks, num_microbatches=1,
                                seq_length=SEQ, micro_batch_size=MICRO_BATCH, forward_only=False)
    grads, group = {}, mpu.get_tensor_model_parallel_group()
    for name, p in model.module.named_parameters():
        g = p.main_grad.double()
        if getattr(p, "tensor_model_parallel", False) and group.size() > 1:
            parts = [torch.empty_like(g) for _ in range(group.size())]
            dist.all_gather(parts, g.contiguous(), group=group)
            if name.endswith("linear_fc1.weight"):  # SwiGLU: each shard is [gate_p; up_p]
                parts = [half for i in range(2) for half in (part.chunk(2, dim=0)[i] for part in parts)]
            g = torch.cat(parts, dim=p.partition_dim)
        grads[name] = g
    return grads


def _errors(grads, reference):
    """Per parameter ||g - g_ref|| / ||g_ref||, and the same over all parameters."""
    per = {n: float((g - reference[n]).norm() / reference[n].norm()) for n, g in grads.items()}
    total = sum(float((g - reference[n]).norm() ** 2) for n, g in grads.items())
    per["all"] = (total / sum(float(r.norm() ** 2) for r in reference.values())) ** 0.5
    return per


@pytest.fixture(scope="module")
def reference(ranks):
    return ranks(1, _gradients, "single", torch.float64)[0]


def test_tsp_bf16_gradients_are_no_less_precise_than_tp_sp(ranks, reference):
    tsp = _errors(ranks(D, _gradients, "tsp", torch.bfloat16)[0], reference)
    tp_sp = _errors(ranks(D, _gradients, "tp-sp", torch.bfloat16)[0], reference)
    # measured: TSP 0.569%, TP+SP 0.577%; with TSP's sums in bf16, 0.586% (fails here)
    assert tsp["all"] <= tp_sp["all"], (tsp, tp_sp)
    # and parameter by parameter, within the spread of bf16 rounding between the two
    worse = {n: (tsp[n], tp_sp[n]) for n in tsp if tsp[n] > 1.25 * tp_sp[n] + 1e-3}
    assert not worse, worse
