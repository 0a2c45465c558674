"""Ops fused into one kernel on a GPU: torch.compile at the first call there; the CPU and the
planner's fake tensors run the same function eagerly (the planner counts one launch an op)."""

from __future__ import annotations

from typing import Callable


def compiled_on_first_call(fn: Callable) -> Callable:
    """``fn`` compiled by torch.compile (one kernel for a chain of pointwise ops; any shapes)
    when first called: a custom op's GPU kernel."""
    import torch

    compiled = []

    def run(*args):
        if not compiled:
            compiled.append(torch.compile(fn, dynamic=True, fullgraph=True))
        return compiled[0](*args)

    return run
