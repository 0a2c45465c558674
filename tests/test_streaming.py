"""The overlap and error-path helpers every TSP schedule is built from."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_tsp.core import comm
from megatron_tsp.core.streaming import _FP32_OUTPUT_MM, OneBehind, ahead, grad_product


class Work:
    def __init__(self):
        self.waited = False

    def wait(self):
        self.waited = True


def test_an_error_waits_for_every_transfer_in_flight():
    with pytest.raises(ValueError, match="kernel failed"):
        with comm.InFlight() as inflight:
            done, pending = inflight.add(Work()), inflight.add([Work(), Work()])
            inflight.wait(done)
            raise ValueError("kernel failed")
    assert done.waited and all(w.waited for w in pending)


def test_ahead_starts_before_the_block_with_overlap_and_after_it_without():
    for overlap, order in ((True, ["start", "compute"]), (False, ["compute", "start"])):
        events = []

        def start(events=events):
            events.append("start")
            return "next"

        with ahead(start, overlap) as upcoming:
            events.append("compute")
        assert events == order and upcoming.value == "next"


def test_ahead_does_not_start_after_an_error():
    events = []
    with pytest.raises(RuntimeError):
        with ahead(lambda: events.append("start"), overlap=False):
            raise RuntimeError
    assert events == []


def test_one_behind_hands_items_back_a_step_late_only_with_overlap():
    late, now = OneBehind(True), OneBehind(False)
    assert [late.swap(i) for i in range(3)] + [late.flush()] == [None, 0, 1, 2]
    assert [now.swap(i) for i in range(3)] + [now.flush()] == [0, 1, 2, None]


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(not _FP32_OUTPUT_MM, reason="torch < 2.8 has no GEMM with an fp32 output")
def test_partial_weight_gradients_are_fp32_gemms_without_casts_where_the_planner_plans_a_gpu():
    dy, x = torch.randn(64, 24), torch.randn(64, 16)
    want = dy.t() @ x
    low = dy.bfloat16(), x.bfloat16()
    with _Ops() as real:  # a CPU has no fp32-output GEMM: it casts
        got = grad_product(*low)
    assert got.dtype == torch.float32 and "aten._to_copy.default" in real.ops
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    with FakeTensorMode() as fake:  # the memory planner's tensors: the GPU's GEMM, no casts
        planned_in = fake.from_tensor(low[0]), fake.from_tensor(low[1])
        with _Ops() as planned:
            out = grad_product(*planned_in)
    data_ops = [op for op in planned.ops if not op.startswith("prim.")]  # prim: metadata queries
    assert out.dtype == torch.float32 and data_ops == ["aten.t.default", "aten.mm.dtype"]
