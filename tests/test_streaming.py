"""The pieces every TSP schedule is built from: transfers waited for on errors, GEMMs that
accumulate in fp32, shards and their gradients, the layer chain's predictions."""

import pytest
import torch
from reference import AtenOps
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

from megatron_tsp.core import comm
from megatron_tsp.core import gemm as gemm_module
from megatron_tsp.core.gemm import fp32_output_gemm, gemm, gemm_t
from megatron_tsp.core.prefetch import LayerChain
from megatron_tsp.core.streaming import deliver_grads, pack, unpack


class Work:
    def __init__(self):
        self.waited = 0

    def wait(self):
        self.waited += 1


def test_an_error_waits_for_every_transfer_in_flight():
    with pytest.raises(ValueError, match="kernel failed"):
        with comm.InFlight() as inflight:
            done, pending = inflight.add(Work()), inflight.add([Work(), Work()])
            inflight.wait(done)
            raise ValueError("kernel failed")
    assert done.waited == 1 and all(w.waited == 1 for w in pending)


def test_a_transfer_waited_for_twice_is_waited_for_once():
    with comm.InFlight() as inflight:
        work = inflight.add(Work())
        inflight.wait(work)
        inflight.wait([work])
        with pytest.raises(RuntimeError, match="never added to this schedule"):
            inflight.wait(Work())  # waiting would not make its buffer safe to read
    assert work.waited == 1


def test_without_overlap_a_transfer_completes_where_it_is_posted_and_is_waited_for_once():
    """comm.Blocking (tsp-no-overlap): the post waits; the schedule's own wait, the schedule
    it is handed to (core/prefetch.py) and a dropped prefetch do not wait again (gloo's
    point-to-point works never return from a second wait)."""
    assert comm.transport(True) is comm.InFlight and comm.transport(False) is comm.Blocking
    with comm.Blocking() as blocking:
        work = blocking.add(Work())
        assert work.waited == 1
        blocking.wait(work)
        blocking.hand_over(work)
    with comm.InFlight() as taker:
        taker.wait(taker.add(work))
    comm.finish(work)
    assert work.waited == 1


def test_gemm_accumulates_in_fp32_and_writes_where_it_is_told():
    a, b, c = torch.randn(5, 7), torch.randn(7, 3), torch.randn(5, 3)
    out = c.clone()
    assert gemm(a, b, out=out, accumulate=True) is out
    torch.testing.assert_close(out, c + a @ b)
    torch.testing.assert_close(gemm(a, b, out=out), a @ b)
    torch.testing.assert_close(gemm_t(a, c), a.t() @ c)
    with pytest.raises(ValueError, match="accumulate needs an out tensor"):
        gemm(a, b, accumulate=True)


def test_bf16_gemms_cast_where_this_torch_has_no_fp32_output_kernel():
    takes = fp32_output_gemm(torch.device("cpu"), torch.bfloat16)  # tried once, cached
    assert fp32_output_gemm(torch.device("cpu"), torch.bfloat16) is takes
    a, b = torch.randn(64, 24), torch.randn(24, 16)
    low = a.bfloat16(), b.bfloat16()
    acc = torch.zeros(64, 16)
    with AtenOps() as real:
        gemm(*low, out=acc, accumulate=True)
    assert ("aten._to_copy.default" in real.ops) == (not takes.mm) and acc.dtype == torch.float32
    torch.testing.assert_close(acc, low[0].float() @ low[1].float())


def test_the_fp32_output_probe_runs_a_real_shape_in_both_layouts(monkeypatch):
    """cuBLASLt/hipBLASLt can take 1x1 matrices and refuse a real shape or a transposed
    operand: the probe runs a real GEMM's shape with each operand row-major and transposed,
    and takes the fp32-output kernels only where every one gives the exact product. This
    CPU has none: a GPU's are stood in for by fp32 GEMMs, then broken two ways."""
    cpu = torch.device("cpu")
    mm, addmm = torch.mm, torch.addmm

    def a_gpus(fn):
        def fp32_output(*args, out_dtype=None, out=None):
            if out_dtype is None:
                return fn(*args) if out is None else fn(*args, out=out)
            *c, a, b = args
            got = fn(*(t.float() for t in (*c, a, b)))
            return got if out is None else out.copy_(got)
        return fp32_output

    def refuses_a_transposed_operand(fn):
        def checked(*args, **kwargs):
            if "out_dtype" in kwargs and any(not t.is_contiguous() for t in args[-2:]):
                raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul")
            return fn(*args, **kwargs)
        return checked

    def wrong_past_one_tile(fn):
        def computed(*args, **kwargs):
            out = fn(*args, **kwargs)
            if "out_dtype" in kwargs and out.numel() > 1:
                out[-1, -1] += 1
            return out
        return computed

    for broken, want in ((lambda fn: fn, (True, True)), (refuses_a_transposed_operand, (False, False)),
                         (wrong_past_one_tile, (False, False))):
        monkeypatch.setattr(torch, "mm", broken(a_gpus(mm)))
        monkeypatch.setattr(torch, "addmm", broken(a_gpus(addmm)))
        monkeypatch.setattr(gemm_module, "_TRIED", {})
        assert fp32_output_gemm(cpu, torch.bfloat16) == want
        low = torch.randn(64, 24).bfloat16(), torch.randn(24, 16).bfloat16()
        torch.testing.assert_close(gemm(low[0].t().contiguous().t(), low[1]), low[0].float() @ low[1].float())


def _planned_gemm_ops():
    low = torch.randn(64, 24).bfloat16(), torch.randn(24, 16).bfloat16()
    with FakeTensorMode() as fake:  # the memory planner's tensors: the GPU's GEMMs, no casts
        fa, fb, facc = fake.from_tensor(low[0]), fake.from_tensor(low[1]), fake.from_tensor(torch.zeros(64, 16))
        with AtenOps() as planned:
            first = gemm(fa, fb)
            gemm(fa, fb, out=facc, accumulate=True)
    assert first.dtype == torch.float32
    return [op for op in planned.ops if not op.startswith("prim.")]  # prim: metadata queries


@pytest.mark.skipif("dtype_out" not in torch.ops.aten.addmm.overloads(),
                    reason="this torch has no GEMM with an fp32 output (>= 2.8)")
def test_the_planner_plans_a_gpus_fp32_output_gemms(monkeypatch):
    monkeypatch.setattr(gemm_module, "_FAKE_TRIED", {})
    assert _planned_gemm_ops() == ["aten.mm.dtype", "aten.addmm.dtype_out"]
    # torch 2.11: the overload is there, its fake kernel is not (a decomposition that raises
    # TypeError): the planner plans what such a torch's fake tensors compute, an fp32 product added
    monkeypatch.setattr(gemm_module, "_FAKE_TRIED", {})
    addmm = torch.addmm

    def addmm_as_in_torch_2_11(*args, **kwargs):
        if "out_dtype" in kwargs and is_fake(args[0]):
            raise TypeError("unsupported operand type(s) for *: 'torch.dtype' and 'FakeTensor'")
        return addmm(*args, **kwargs)

    monkeypatch.setattr(torch, "addmm", addmm_as_in_torch_2_11)
    assert _planned_gemm_ops() == ["aten.mm.dtype", "aten.mm.dtype", "aten.add_.Tensor"]


def test_gradients_reach_main_grad_without_rounding():
    own = [torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.bfloat16)),
           torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))]
    flat = torch.randn(10, dtype=torch.float32)
    plain = deliver_grads(own, flat)  # no DDP: the gradient in the parameter's dtype
    assert [g.dtype for g in plain] == [torch.bfloat16] * 2
    torch.testing.assert_close(torch.cat([g.reshape(-1) for g in plain]), flat.bfloat16())
    for p in own:
        p.main_grad = torch.ones(p.shape, dtype=torch.float32)
    deliver_grads(own, flat)
    torch.testing.assert_close(torch.cat([p.main_grad.reshape(-1) for p in own]), 1 + flat)
    assert all(p.grad_added_to_main_grad for p in own)
    assert torch.equal(unpack(pack([p.main_grad for p in own]), own)[1], own[1].main_grad)


class _Module:
    def __init__(self, chain, attention, recompute=None, pipeline=1, method="uniform", layers=1):
        self.is_tsp_attention = attention
        self.config = type("Config", (), {"recompute_granularity": recompute, "recompute_method": method,
                                          "recompute_num_layers": layers,
                                          "pipeline_model_parallel_size": pipeline})()
        chain.register(self)


@pytest.mark.parametrize("recompute", [None, "full"])
def test_the_chain_names_the_module_that_runs_next(recompute):
    chain = LayerChain()
    attn0, mlp0, attn1, mlp1 = (_Module(chain, a, recompute) for a in (True, False, True, False))
    assert chain.next_after(attn0, backward=False) is mlp0
    assert chain.next_after(mlp0, backward=False) is attn1
    # the forward's end: the backward that follows starts with the last MLP, or recomputes the last layer
    assert chain.next_after(mlp1, backward=False) is (attn1 if recompute else mlp1)
    assert chain.next_after(mlp1, backward=False, then_backward=False) is None
    assert chain.next_after(mlp1, backward=True) is attn1
    assert chain.next_after(attn1, backward=True) is (attn0 if recompute else mlp0)
    assert chain.next_after(attn0, backward=True) is None
    pipelined = LayerChain()  # a stage's forward is followed by other micro-batches' passes
    _Module(pipelined, True, recompute, pipeline=2)
    last = _Module(pipelined, False, recompute, pipeline=2)
    assert pipelined.next_after(last, backward=False) is None
    chunked = LayerChain()  # two layers per checkpoint: the first recomputed is not the last layer's
    _Module(chunked, True, recompute, layers=2)
    last = _Module(chunked, False, recompute, layers=2)
    assert chunked.next_after(last, backward=False) is (None if recompute else last)


def test_an_mlp_recomputed_with_the_next_layer_is_followed_by_that_layers_attention(monkeypatch):
    """Inside the backward pass (a recompute), an MLP recomputed on its own, or as the last of
    its layer, runs its backward next, and so keeps its last shard for it
    (``MLPScheduleArgs.backward_follows_at_once``); one recomputed together with the next
    layer (full uniform recompute, two layers per checkpoint) is followed by that layer's
    attention, and keeps nothing."""
    from megatron_tsp.core.mlp import MLPScheduleArgs

    monkeypatch.setattr(torch._C, "_current_graph_task_id", lambda: 7)
    for layers, follows in ((1, True), (2, False)):
        chain = LayerChain()
        _, mlp0, attn1, _ = (_Module(chain, a, "full", layers=layers) for a in (True, False, True, False))
        assert chain.next_after(mlp0, backward=False) is (mlp0 if follows else attn1)
        args = MLPScheduleArgs(None, None, 1, has_bias=False, chain=chain, module=mlp0)
        assert args.backward_follows_at_once(then_backward=True) is follows
        assert not args.backward_follows_at_once(then_backward=False)


def test_an_attention_stashes_its_backwards_first_transfers_for_its_layers_mlp():
    chain = LayerChain()
    attn0, mlp0, attn1, attn2 = (_Module(chain, a) for a in (True, False, True, True))  # layer 1: megatron's MoE

    def post():
        return "posted"

    chain.stash(attn0, post)
    assert chain.claim(attn1) is None and chain.claim(mlp0) is None  # claimed by another: dropped
    chain.stash(attn0, post)
    assert chain.claim(mlp0) is post and chain.claim(mlp0) is None
    chain.stash(attn1, post)  # the module after it is an attention: nothing is held for it
    assert chain.claim(attn2) is None and chain._stashed is None
