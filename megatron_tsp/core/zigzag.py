"""Zigzag sequence layout (docs/design.md section 4).

The sequence is cut into ``2D`` equal chunks; TSP rank ``r`` holds chunks ``r`` and
``2D-1-r`` (:func:`megatron_tsp.core.block_geometry.rank_chunks`), so that every rank does
the same causal-attention work (Megatron context parallelism uses the same layout).
Permuting a whole sequence into *zigzag order* (chunks 0, 2D-1, 1, 2D-2, ...) before the
embedding lets megatron's sequence-parallel scatter hand each rank exactly its two chunks.
"""

from __future__ import annotations

from typing import Dict, NamedTuple, Tuple

import torch

from megatron_tsp.core.block_geometry import rank_chunks
from megatron_tsp.core.sizes import ParallelSizes
from megatron_tsp.core.support import violations


def check_seq_len(seq_len: int, tsp_size: int) -> int:
    """Return the chunk length; raise a one-line error when the sequence does not divide."""
    ParallelSizes(tsp=tsp_size).validate()
    for message in violations({"--seq-length": seq_len}, tsp_size):
        raise ValueError(message)
    return seq_len // (2 * tsp_size)


def local_positions(
    seq_len: int, tsp_size: int, tsp_rank: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Global positions, in local order, of the ``seq_len / tsp_size`` tokens of a rank."""
    return _positions(check_seq_len(seq_len, tsp_size), tsp_size, tsp_rank, device)


def _positions(chunk: int, tsp_size: int, tsp_rank: int, device) -> torch.Tensor:
    first, second = rank_chunks(tsp_size, tsp_rank)
    return torch.cat(
        [
            torch.arange(first * chunk, (first + 1) * chunk, device=device),
            torch.arange(second * chunk, (second + 1) * chunk, device=device),
        ]
    )


def permutation(seq_len: int, tsp_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``perm`` such that ``x[perm]`` is ``x`` in zigzag order (rank 0's tokens first)."""
    chunk = check_seq_len(seq_len, tsp_size)
    return torch.cat([_positions(chunk, tsp_size, r, device) for r in range(tsp_size)])


def inverse_permutation(
    seq_len: int, tsp_size: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """``inv`` such that ``x_zigzag[inv]`` is back in natural order."""
    return _inverse(permutation(seq_len, tsp_size, device))


class Indices(NamedTuple):
    """The index tensors a rank of a zigzag group uses at one sequence length."""

    local_positions: torch.Tensor  # global positions of this rank's tokens, in local order
    to_natural: torch.Tensor  # rank order (a gathered sequence) -> natural order
    to_rank_order: torch.Tensor  # natural order -> rank order (for a reduce-scatter)


class IndexCache:
    """:class:`Indices` of one rank of a group of ``size``, built once per (sequence length,
    device) and shared by every layer that holds the cache (a layer spec passes one to all
    of its layers), rather than rebuilt per head group and layer."""

    def __init__(self) -> None:
        self._built: Dict[Tuple[int, int, int, torch.device], Indices] = {}

    def get(self, seq_len: int, size: int, rank: int, device: torch.device) -> Indices:
        key = (seq_len, size, rank, torch.device(device))
        if key not in self._built:
            perm = permutation(seq_len, size, device)
            self._built[key] = Indices(local_positions(seq_len, size, rank, device), _inverse(perm), perm)
        return self._built[key]


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def to_zigzag(x: torch.Tensor, tsp_size: int, dim: int) -> torch.Tensor:
    """Permute the sequence dimension ``dim`` of ``x`` into zigzag order."""
    return x.index_select(dim, permutation(x.size(dim), tsp_size, x.device))


def from_zigzag(x: torch.Tensor, tsp_size: int, dim: int) -> torch.Tensor:
    """Undo :func:`to_zigzag`."""
    return x.index_select(dim, inverse_permutation(x.size(dim), tsp_size, x.device))


SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


class ZigzagBatch:
    """The batch transform of a run whose sequences have ``seq_len`` tokens, at TSP size
    ``tsp_size``: a ``forward_step`` batch with every sequence-shaped tensor in zigzag order.
    The sizes are checked when it is built (a sequence 2D does not divide is a one-line
    ValueError), and the permutation made then, not per batch.

    ``tokens``, ``labels``, ``loss_mask`` and ``position_ids`` are ``[b, s]``;
    ``attention_mask`` (``[b, 1, s, s]`` or None) is permuted on both sequence dimensions.
    Fed to a stock ``GPTModel`` with the TSP spec, megatron's sequence-parallel embedding
    hands TSP rank r its chunks r and 2D-1-r; learned absolute positions follow the
    permuted ``position_ids`` and TSP attention picks its RoPE rows by global position.
    """

    def __init__(self, seq_len: int, tsp_size: int):
        self.seq_len, self.tsp_size = seq_len, tsp_size
        cpu = torch.device("cpu")
        self._perm: Dict[torch.device, torch.Tensor] = {cpu: permutation(seq_len, tsp_size, cpu)} \
            if tsp_size > 1 else {}

    def _on(self, device: torch.device) -> torch.Tensor:
        """The permutation on ``device``, copied there once."""
        if device not in self._perm:
            self._perm[device] = self._perm[torch.device("cpu")].to(device)
        return self._perm[device]

    def __call__(self, batch: dict) -> dict:
        if self.tsp_size == 1:
            return batch
        present = [key for key in SEQUENCE_KEYS if batch.get(key) is not None]
        if not present:
            return batch
        length = batch[present[0]].size(1)
        if length != self.seq_len:  # another length's permutation would drop tokens or index past the end
            raise ValueError(f"ZigzagBatch: the batch's sequences have {length} tokens, it was built for "
                             f"{self.seq_len}")
        out = dict(batch)
        for key in present:
            out[key] = out[key].index_select(1, self._on(out[key].device))
        mask = out.get("attention_mask")
        if mask is not None:
            perm = self._on(mask.device)
            out["attention_mask"] = mask.index_select(-1, perm).index_select(-2, perm)
        return out
