"""What a GPU attention kernel checks of its arguments, and what it reads by pointer without
checking: one home for the stand-ins (flash-attn's entry points here, torch's kernels under
fake CUDA in ``tests/fake_cuda``).

A kernel that *checks* raises a one-line RuntimeError, as its ``TORCH_CHECK`` does. A kernel
that *assumes* reads the tensor from its data pointer in the layout it assumes: on real
(CPU) tensors :func:`as_read` gives exactly those values, so a wrong call gives wrong
numbers, as on a GPU; fake tensors hold no values, so there it fails instead.
"""

import torch
from torch._subclasses.fake_tensor import is_fake


def require(ok: bool, kernel: str, what: str) -> None:
    if not ok:
        raise RuntimeError(f"{kernel}: {what}")


def contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(int(n), 1)
    return tuple(reversed(strides))


def as_read(t: torch.Tensor, kernel: str, name: str) -> torch.Tensor:
    """``t`` as a kernel reads it from ``t.data_ptr()`` when it assumes a contiguous tensor of
    ``t``'s shape (the softmax lse of every flash backward): ``t`` itself where that holds,
    else the memory behind the pointer seen that way (fake tensors: a RuntimeError)."""
    if t.is_contiguous():
        return t
    where = f"{name} {tuple(t.shape)} with strides {t.stride()} is read by pointer as contiguous"
    require(not is_fake(t), kernel, where)
    end = t.storage_offset() + t.numel()
    require(end * t.element_size() <= t.untyped_storage().nbytes(), kernel, where + ", past its storage")
    return t.as_strided(t.shape, contiguous_strides(t.shape), t.storage_offset())


def last_dim_contiguous(kernel: str, **tensors: torch.Tensor) -> None:
    """Rows are read by their strides, elements of a row one after another."""
    for name, t in tensors.items():
        require(t.stride(-1) == 1, kernel, f"{name} must have contiguous last dimension (strides {t.stride()})")


def half(kernel: str, **tensors: torch.Tensor) -> None:
    """fp16/bf16, every one the first one's dtype."""
    dtypes = {name: t.dtype for name, t in tensors.items()}
    first = next(iter(dtypes.values()))
    require(first in (torch.float16, torch.bfloat16), kernel, "only fp16 and bf16 are supported, got " + str(first))
    require(all(d == first for d in dtypes.values()), kernel, f"dtypes differ: {dtypes}")


def head_dim(kernel: str, d: int, multiple: int = 8, most: int = 256) -> None:
    require(d % multiple == 0, kernel, f"head dimension {d} is not a multiple of {multiple}")
    require(d <= most, kernel, f"head dimension {d} is over {most}")


def cu_seqlens(kernel: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        require(t.dtype == torch.int32, kernel, f"{name} must have dtype int32, got {t.dtype}")
        require(t.is_contiguous() and t.dim() == 1, kernel, f"{name} must be a contiguous 1-D tensor")


def shape(kernel: str, name: str, t: torch.Tensor, want) -> None:
    require(tuple(t.shape) == tuple(want), kernel, f"{name} has shape {tuple(t.shape)}, wants {tuple(want)}")
