"""A GPU training step on this CPU: every tensor on device ``cuda`` under FakeTensorMode,
torch's ``fake`` process group, GPU kernels through their meta functions.

What a CPU build of torch lacks for that is supplied by stand-ins, none of which computes:

* ``runtime.cpp``, a CUDA device guard and CUDA hooks (compiled here once per torch build
  with the C++ compiler torch extensions use, loaded before torch is imported), without
  which autograd cannot run on fake CUDA tensors;
* the ``torch.cuda`` functions a one-GPU process calls (:func:`install_torch_cuda`);
* flash-attn 2.8's entry points (``tests/standins/flash_attn``);
* what torch's GPU attention kernels require of their inputs beyond what their meta
  functions check (:func:`install_kernel_contracts`).

:func:`run` starts a fresh Python that loads them and plans one training step of rank 0
(``megatron_tsp.measure.memory.plan`` with ``device=cuda``: the build, the batch, the step
and the loss reduction of a GPU run, every collective checked to move CUDA tensors) per
case, and returns what each case raised, if anything. Importing this package does not
import torch.
"""

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import sysconfig

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
ROOT = os.path.dirname(TESTS)
SOURCE = os.path.join(HERE, "runtime.cpp")


def build() -> str:
    """The runtime library for the torch of this Python (compiled on first use, into
    ``build/fake_cuda/``)."""
    import torch
    from torch.utils import cpp_extension

    with open(SOURCE, "rb") as f:
        digest = hashlib.sha1(f.read() + torch.__version__.encode()).hexdigest()[:12]
    out = os.path.join(ROOT, "build", "fake_cuda", f"runtime-{digest}.so")
    if os.path.exists(out):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    cxx = os.environ.get("CXX", "c++")
    cmd = [cxx, "-O1", "-std=c++20", "-shared", "-fPIC", "-w", SOURCE, "-o", out + ".tmp",
           *(f"-I{p}" for p in cpp_extension.include_paths()), f"-I{sysconfig.get_paths()['include']}",
           f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    os.replace(out + ".tmp", out)
    return out


def run(cases, timeout_s: float = 900.0):
    """Plan every case (``{"config", "mode", "overrides", "backend", "fused_norm"}``) in a
    fresh process on fake CUDA; the per-case results (``{"case", "error", ...}``)."""
    library = build()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "fake_cuda", library], input=json.dumps(cases), cwd=TESTS,
                          env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"the fake-CUDA process failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


class _FakeStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass


def install_torch_cuda() -> None:
    """``torch.cuda`` as a process on one GPU sees it (a CPU build's functions raise), and
    the two ways megatron-core puts a CPU tensor of values on the GPU, ``torch.tensor(data,
    device="cuda")`` and ``tensor.cuda()``: a CPU build cannot run either even under
    FakeTensorMode (the copy to the device happens below the dispatcher, or runs for real on
    a constant), so they make an empty tensor of the same shape and dtype on the device,
    which the fake mode fakes (fake tensors hold no values). ``pin_memory`` is dropped."""
    import torch
    from torch._subclasses.fake_tensor import is_fake

    stand_ins = {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": lambda device: None,
        "synchronize": lambda device=None: None,
        "get_device_name": lambda device=None: "fake CUDA device",
        "get_device_capability": lambda device=None: (9, 0),
        "max_memory_allocated": lambda device=None: 0,
        "reset_peak_memory_stats": lambda device=None: None,
    }
    for name, fn in stand_ins.items():
        setattr(torch.cuda, name, fn)
    # megatron-core 0.19 orders the DDP gradient sync on the current CUDA stream; one stream,
    # on which everything is already in order.
    torch.cuda.Stream = _FakeStream
    torch.cuda.current_stream = lambda device=None: _FakeStream()
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()

    tensor, cuda = torch.tensor, torch.Tensor.cuda

    def tensor_on_fake_cuda(data, *args, device=None, pin_memory=False, **kwargs):
        if device is not None and torch.device(device).type == "cuda":
            like = tensor(data, *args, **kwargs)
            return torch.empty(like.shape, dtype=like.dtype, device=device)
        return tensor(data, *args, device=device, **kwargs)

    def to_fake_cuda(self, device=None, non_blocking=False, **kwargs):
        if is_fake(self):
            return cuda(self, device, non_blocking, **kwargs)
        return torch.empty(self.shape, dtype=self.dtype, device="cuda" if device is None else device)

    torch.tensor = tensor_on_fake_cuda
    torch.Tensor.cuda = to_fake_cuda


def _bshd(t) -> bool:
    """Memory laid out as a [b, s, h, d] tensor (seen as [b, h, s, d])."""
    return t.transpose(1, 2).is_contiguous()


def install_kernel_contracts() -> None:
    """Wrap torch's GPU attention kernels with what their CUDA implementations check or
    assume of their inputs and their meta functions do not check (docs/design.md section 5;
    ``tests/standins/kernel_contract.py``): fp16/bf16 and a head dimension the kernel takes;
    int32 ``cu_seqlens``; the log-sum-exp each backward reads by pointer, in the shape its
    forward wrote it and contiguous (a fake tensor cannot give the wrong numbers a strided
    one gives on a GPU, so it fails); the memory layout of ``out``/``grad_out`` (the
    memory-efficient backward reads them as ``[b, s, h, d]`` tensors; cuDNN's wants both
    with the same strides); ROCm's flash backward (AOTriton) refuses a non-square causal block."""
    import kernel_contract as contract
    import torch

    aten = torch.ops.aten
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])

    def flash_inputs(kernel, q, k, v):
        contract.half(kernel, q=q, k=k, v=v)
        contract.head_dim(kernel, q.size(-1))

    def lse_read(kernel, lse, want):
        contract.require(lse.dtype == torch.float32, kernel, f"lse must be fp32, got {lse.dtype}")
        contract.shape(kernel, "lse", lse, want)
        contract.as_read(lse, kernel, "lse")

    def aotriton(kernel, causal, sq, sk):
        contract.require(not (torch.version.hip and causal and sq != sk), kernel + " (AOTriton)",
                         "For backwards kernel seqlen_q must equal seqlen_k for causal kernels")

    def flash(q, k, v, *args, **kwargs):  # [b, h, s, d]
        flash_inputs("flash", q, k, v)
        return flash.original(q, k, v, *args, **kwargs)

    def flash_backward(grad_out, q, k, v, out, lse, *args, **kwargs):
        flash_inputs("flash backward", q, k, v)
        contract.half("flash backward", q=q, grad_out=grad_out, out=out)
        lse_read("flash backward", lse, (q.size(0), q.size(1), q.size(2)))
        aotriton("flash backward", kwargs.get("is_causal", args[5] if len(args) > 5 else False), q.size(2), k.size(2))
        return flash_backward.original(grad_out, q, k, v, out, lse, *args, **kwargs)

    def flash_varlen(q, k, v, cum_seq_q, cum_seq_k, *args, **kwargs):  # [b, s, h, d], or [total, h, d]
        flash_inputs("flash (cum_seq)", q, k, v)
        if cum_seq_q is not None:
            contract.cu_seqlens("flash (cum_seq)", cum_seq_q=cum_seq_q, cum_seq_k=cum_seq_k)
        return flash_varlen.original(q, k, v, cum_seq_q, cum_seq_k, *args, **kwargs)

    def flash_varlen_backward(grad_out, q, k, v, out, lse, cum_seq_q, cum_seq_k, *args, **kwargs):
        kernel = "flash backward (cum_seq)"
        flash_inputs(kernel, q, k, v)
        contract.half(kernel, q=q, grad_out=grad_out, out=out)
        if cum_seq_q is None:  # [b, s, h, d]: lse [b, h, sq]
            lse_read(kernel, lse, (q.size(0), q.size(2), q.size(1)))
        else:  # [total, h, d]: lse [h, total_q]
            contract.cu_seqlens(kernel, cum_seq_q=cum_seq_q, cum_seq_k=cum_seq_k)
            lse_read(kernel, lse, (q.size(1), q.size(0)))
        return flash_varlen_backward.original(grad_out, q, k, v, out, lse, cum_seq_q, cum_seq_k, *args, **kwargs)

    def cudnn(q, k, v, *args, **kwargs):
        contract.half("cuDNN", q=q, k=k, v=v)
        contract.head_dim("cuDNN", q.size(-1))  # the fake device is a Hopper (9, 0): up to 256
        return cudnn.original(q, k, v, *args, **kwargs)

    def cudnn_backward(grad_out, q, k, v, out, lse, *args, **kwargs):
        want = (q.size(0), q.size(1), q.size(2)) + ((1,) if version >= (2, 9) else ())
        lse_read("cuDNN backward", lse, want)
        contract.require(grad_out.stride() == out.stride(), "cuDNN backward", "grad_out and out strides differ")
        return cudnn_backward.original(grad_out, q, k, v, out, lse, *args, **kwargs)

    def efficient_backward(grad_out, q, k, v, bias, out, lse, *args, **kwargs):
        lse_read("efficient backward", lse, (q.size(0), q.size(1), -(-q.size(2) // 32) * 32))
        contract.require(_bshd(out) and _bshd(grad_out), "efficient backward",
                         "out/grad_out not in [b, s, h, d] memory")
        return efficient_backward.original(grad_out, q, k, v, bias, out, lse, *args, **kwargs)

    for name, check in (("_scaled_dot_product_flash_attention", flash),
                        ("_scaled_dot_product_flash_attention_backward", flash_backward),
                        ("_flash_attention_forward", flash_varlen),
                        ("_flash_attention_backward", flash_varlen_backward),
                        ("_scaled_dot_product_cudnn_attention", cudnn),
                        ("_scaled_dot_product_cudnn_attention_backward", cudnn_backward),
                        ("_scaled_dot_product_efficient_attention_backward", efficient_backward)):
        check.original = getattr(aten, name)
        setattr(aten, name, _Checked(check))


class _Checked:
    """An op packet whose call checks a contract first (attributes: the original's)."""

    def __init__(self, check):
        self.check = check

    def __call__(self, *args, **kwargs):
        return self.check(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.check.original, name)


class HostRead(RuntimeError):
    """A device tensor read by the host inside a training step."""


READ_IN_THE_STEP = []  # a case that reads a loss on the host inside the step (the guard's own check)


def forbid_host_reads_in_the_step() -> None:
    """Every planned step's schedule (from the batch to the gradients, before the optimizer)
    runs under a dispatch mode that fails on a read of a device tensor by the host:
    ``.item()``, ``.tolist()``, ``bool()`` (``_local_scalar_dense``), ``.nonzero()``,
    ``torch.equal``, ``.cpu()`` / ``.to("cpu")``. On a GPU each is a sync that stalls the
    host until the device has caught up, so that it cannot queue the next kernels ahead."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from megatron_tsp.run import step

    aten = torch.ops.aten
    reads = {aten._local_scalar_dense.default, aten.nonzero.default, aten.equal.default, aten.is_nonzero.default}

    class NoHostReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            on_device = any(isinstance(t, torch.Tensor) and t.device.type != "cpu"
                            for t in tree_leaves((args, kwargs)))
            to_host = (func is aten._to_copy.default and str(kwargs.get("device")) == "cpu") or \
                (func is aten.copy_.default and args[0].device.type == "cpu")
            if on_device and (func in reads or to_host):
                raise HostRead(f"{func} reads a device tensor on the host inside the step")
            return func(*args, **kwargs)

    schedule = step.get_forward_backward_func

    def guarded():
        run = schedule()

        def run_without_host_reads(**kwargs):
            with NoHostReads():
                if READ_IN_THE_STEP:
                    torch.zeros((), device="cuda").item()
                return run(**kwargs)
        return run_without_host_reads

    step.get_forward_backward_func = guarded
