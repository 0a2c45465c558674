"""Causal attention of zigzag query chunks as blocks merged by log-sum-exp (docs/design.md s. 5).

One op serves TSP and every baseline, so that a comparison is of parallelism, not of
kernels: attention over a list of *blocks* (query rows, key rows, causal or not), each one
kernel call, merged per query rows by log-sum-exp. ``block_attention(q, k, v, chunk_ids,
scale, backend)`` (the baselines): ``q`` holds ``n`` equal query chunks of length ``c``;
chunk ``i`` sits at global chunk ``g = chunk_ids[i]`` of the keys ``k``, ``v`` (global
order), and sees keys ``[0, (g+1)·c)`` causally (:func:`blocks`). TSP gathers its keys in
another order and attends through :func:`attend_into` with :func:`zigzag_blocks`. A kernel whose
causal mask is aligned bottom-right when ``sq < sk`` (query ``i`` sees keys up to
``sk - sq + i``: flash-attn >= 2.1) computes that in one call per chunk. Any other kernel
gets two blocks per chunk,

    a *full* block    keys [0, g·c)          no mask            (absent when g = 0)
    a *causal* block  keys [g·c, (g+1)·c)    square, causal

each returning its output ``o_j`` and log-sum-exp ``l_j``, merged exactly as

    lse = log(sum_j exp(l_j)),      out = sum_j exp(l_j - lse) · o_j

(per block ``exp(l_j - lse)`` in fp32, and the weighted outputs summed in fp32, the last
product written rounded once into ``out``).

Plain causal attention of a whole sequence is ``chunk_ids = [0]``; a zigzag rank r of D holds
``chunk_ids = [r, 2D-1-r]``. The op saves ``(q, k, v, out, lse)``; its backward calls each
block's kernel backward with the *merged* ``out`` and ``lse`` (then every block's softmax is
already the global one: ``P_j = exp(S_j - lse)``) and sums dQ over the blocks of each query
row and dK, dV over the blocks of each key row in fp32, dK and dV into a buffer the caller
may give (TSP's reduce-scatter buffer, with blocks of its own: :func:`zigzag_backward_blocks`,
in calls that each run some of them): the forward never runs again. No ``sq x sk`` tensor
exists outside a kernel. Under FakeTensorMode (the memory planner, the fake-CUDA tests) the
op runs the same kernel calls through their meta functions, so a wrong argument or shape
fails there as on a GPU.

Backends (:data:`BACKENDS`), all ``[b, h, s, d]`` in, ``(out, lse [b, h, sq] fp32)`` out,
with grouped-query K/V (fewer k/v heads):

* ``flash``: torch's flash kernel (CUDA and ROCm; fp16/bf16; GQA native) and its backward;
* ``cudnn``: torch's cuDNN attention (CUDA; fp16/bf16; lse ``[b,h,sq,1]`` from torch 2.9);
* ``efficient``: torch's memory-efficient kernel (CUDA and ROCm, any dtype; lse padded to 32
  rows on CUDA; its backward reads ``out`` as a ``[b, s, h, d]`` tensor);
* ``flash_attn``: the flash-attn package (2.x; ``[b, s, h, d]``; GQA native; bottom-right);
* ``cpu``: aten's CPU flash kernel and its backward;
* ``math``: softmax attention written out (fp32 scores), the reference of the tests.

``auto`` (:func:`resolve_backend`) is, on a GPU for fp16/bf16, ``cudnn`` from
:data:`AUTO_CUDNN_FROM_KEYS` keys on (NVIDIA, where it runs) and ``flash`` below; ``efficient``
for fp32, ``cpu`` on the CPU: decided by the device, dtype and sequence length; ``gpu``
is what ``auto`` picks on a GPU, on the memory planner's fake tensors wherever they live. The
first use of a GPU backend on a device and dtype checks it (:func:`check_backend`) in the
real layout against ``math``, and learns whether its causal mask is aligned bottom-right.

Sliding windows (megatron's ``window_size = (w, 0)``) are blocks too (:func:`window_blocks`):
key pieces out of a query piece's reach are never called, and a piece the window's edge
crosses is a square block with a band of diagonals, which ``flash`` and ``flash_attn`` take
as their own ``window_size`` and ``cpu`` and ``math`` as a mask of the block (``cudnn`` and
``efficient`` have none: ``auto`` picks ``flash``).
"""

from __future__ import annotations

import bisect
import inspect
import itertools
import warnings
from functools import lru_cache
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch.utils.flop_counter import register_flop_formula

BACKENDS = ("auto", "gpu", "flash", "cudnn", "efficient", "flash_attn", "cpu", "math")
GPU_BACKENDS = ("flash", "cudnn", "efficient", "flash_attn")
HALF_ONLY = ("flash", "cudnn", "flash_attn")
WINDOW_NATIVE = ("flash", "flash_attn")  # take a sliding window themselves; cpu and math: a mask per block
NO_WINDOW = ("cudnn", "efficient")

# query rows [q0, q1), key rows [k0, k1), causal; a sliding window's blocks (:func:`window_blocks`)
# carry a sixth entry, ``left`` >= 0: row x of the block sees key y only if y >= x + (k1-k0) -
# (q1-q0) - left (aligned bottom-right, as causal is; in a square block x - y <= left): a band of
# the diagonals (-1: none); packed documents' blocks (:func:`document_blocks`) a seventh, the
# one sample of the micro-batch they are of
Block = Tuple[int, ...]


class _Call(NamedTuple):
    """A block with every entry (the op's flat form): ``left`` -1 without a band, ``sample``
    -1 for every sample of the micro-batch."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool
    left: int
    sample: int

# ``auto`` on an NVIDIA GPU in fp16/bf16: cuDNN's attention from this many keys, flash below. On
# one H200 with torch 2.11 (bench/results/gpu-check-H200-run1.md: one TSP head group, fwd+bwd)
# flash took 1.98 / 3.73 / 25.1 ms at 8K / 32K / 128K keys and cuDNN 2.86 / 3.17 / 14.0; the 7B's
# whole step at 128K ran 1.6x faster on cuDNN in TSP and TP+SP alike (gpu-check-H200-2layers-*).
# TransformerEngine, which Megatron-LM's baselines run, prefers cuDNN's fused attention on Hopper too.
AUTO_CUDNN_FROM_KEYS = 16384


def blocks(chunk_ids: Sequence[int], chunk: int, bottom_right: bool = False, window: int = -1,
           backend: str = "math", documents: Optional[Sequence[Sequence[int]]] = None) -> List[Block]:
    """The kernel calls of query chunks against keys in *global order* (chunk i of the
    queries is global chunk ``chunk_ids[i]``): one causal call on the whole key prefix per
    chunk when the kernel aligns its causal mask bottom-right, else a full block (keys
    before the chunk) and a square causal block; with a sliding ``window`` (>= 0), the
    window's blocks (:func:`window_blocks`, pieces as ``backend`` wants them); with
    ``documents`` (each sample's document starts), :func:`document_blocks`."""
    if documents is not None:
        return document_blocks([(i * chunk, g) for i, g in enumerate(chunk_ids)], chunk, lambda h: h * chunk,
                               documents, window=window)
    if window >= 0:
        piece = window_piece(chunk, window, backend)
        per = chunk // piece
        queries = [(i * chunk + j * piece, g * per + j) for i, g in enumerate(chunk_ids) for j in range(per)]
        return window_blocks(queries, piece, lambda h: h * piece, window)
    out = []
    for i, g in enumerate(chunk_ids):
        rows = (i * chunk, (i + 1) * chunk)
        if bottom_right:
            out.append((*rows, 0, (g + 1) * chunk, True))
            continue
        if g > 0:
            out.append((*rows, 0, g * chunk, False))
        out.append((*rows, g * chunk, (g + 1) * chunk, True))
    return out


def zigzag_blocks(size: int, rank: int, chunk: int, bottom_right: bool = False) -> List[Block]:
    """The kernel calls of TSP rank ``rank``'s queries (its chunks r and 2D-1-r, in that
    order) against keys gathered in the *zigzag layout* (:class:`megatron_tsp.core.kv.GatherKV`):
    key slot q < D holds chunk 2D-1-q, slot D+q chunk q. Query chunk r sees the contiguous
    natural prefix of chunks 0..r (slots D..D+r): one bottom-right causal call (or a full
    block and a square causal one). Query chunk 2D-1-r sees its own chunk (slot r: a square
    causal block) and every chunk in slots r+1..2D-1, all of them earlier: one full block.
    The caller groups the blocks by query chunk (TSP attends chunk by chunk)."""
    d, r, c = size, rank, chunk
    first, second = (0, c), (c, 2 * c)
    out = [(*second, r * c, (r + 1) * c, True), (*second, (r + 1) * c, 2 * d * c, False)]
    if bottom_right:
        out.append((*first, d * c, (d + r + 1) * c, True))
    else:
        if r > 0:
            out.append((*first, d * c, (d + r) * c, False))
        out.append((*first, (d + r) * c, (d + r + 1) * c, True))
    return out


def zigzag_backward_blocks(size: int, rank: int, chunk: int) -> Tuple[List[Block], int]:
    """The backward's kernel calls of TSP rank ``rank``'s queries (rows ``[0, c)`` chunk r,
    ``[c, 2c)`` chunk 2D-1-r) against keys in the zigzag layout, and how many run first.

    Forward merges each query chunk's blocks by lse; backward merges nothing (each block's
    kernel backward takes the merged lse), so it groups the blocks by keys instead. The key
    chunks both query chunks see (natural 0..r-1, slots D..D+r-1) are one full block of both
    chunks' queries: the kernel sums their dK/dV, which are then written once instead of
    written and added again. Every block but the first chunk's causal one (slot D+r) touches
    key rows no other does: those are copied into the buffer, that one is added. The
    blocks that run first write every row of slots 0..D-1 (the ranks' second chunks) for
    good, so those can travel while the last block runs. The same blocks serve kernels
    whatever their causal alignment (each causal block is square). Per head group: 3 kernel
    calls on rank 0, 4 on rank D-1, 5 between (the forward's: 3, or 4 off rank 0 with a kernel
    aligned top-left): fewer bytes at long sequences, up to two more launches at short ones."""
    d, r, c = size, rank, chunk
    if r == 0:  # no key chunk is seen by both: chunk 2D-1's full block is one
        out = [(c, 2 * c, 0, c, True), (c, 2 * c, c, 2 * d * c, False)]
    else:
        out = [(c, 2 * c, r * c, (r + 1) * c, True), (0, 2 * c, d * c, (d + r) * c, False),
               (c, 2 * c, (d + r) * c, 2 * d * c, False)]
        if r + 1 < d:
            out.insert(1, (c, 2 * c, (r + 1) * c, d * c, False))
    return out + [(0, c, (d + r) * c, (d + r + 1) * c, True)], len(out)


def zigzag_own_keys_last(size: int, rank: int, chunk: int) -> Tuple[List[Block], int]:
    """:func:`zigzag_backward_blocks` of rank ``rank`` reordered for a backward whose dK/dV
    travel while it computes: first every block against the other ranks' key chunks, then
    those against its own two (slots ``rank`` and D+rank, whose dK/dV stay here), and how
    many come first. A full block across an own slot is cut at the slot's edges (exact: dq
    sums over keys, dK/dV are per key row); causal blocks are one slot each. Once the first
    ones have run, every row the reduce-scatter sends is final; the rest (1/D of the
    compute) runs while it travels."""
    others, mine = [], []
    for q0, q1, k0, k1, causal in zigzag_backward_blocks(size, rank, chunk)[0]:
        for a, b, slot in _cut_at_own_slots(k0, k1, size, rank, chunk):
            (others if slot is None else mine).append((q0, q1, a, b, causal))
    return others + mine, len(others)


def _cut_at_own_slots(k0: int, k1: int, size: int, rank: int, chunk: int) -> List[Tuple[int, int, Optional[int]]]:
    """Key rows ``[k0, k1)`` of the zigzag layout cut at the edges of rank ``rank``'s own two
    slots (``rank`` and D+rank): ``(a, b, first row of the own slot it lies in, or None)``."""
    own = (rank * chunk, (size + rank) * chunk)
    cuts = sorted({k0, k1, *(x for s in own for x in (s, s + chunk) if k0 < x < k1)})
    return [(a, b, next((s for s in own if s <= a and b <= s + chunk), None)) for a, b in zip(cuts, cuts[1:])]


def zigzag_own_keys_first(size: int, rank: int, chunk: int, chunk_blocks: Sequence[Sequence[Block]]
                          ) -> List[Tuple[List[Block], List[Block]]]:
    """The forward's blocks of each query chunk of TSP rank ``rank`` (``chunk_blocks``: rows
    relative to the chunk, keys in the zigzag layout, as :func:`zigzag_blocks` grouped by
    chunk) split into those against this rank's own two key chunks, which run before any
    K/V arrive, in the rows of its own K/V (``[2c]``: its first chunk, then its second), and
    those against the other ranks' chunks, in the zigzag layout. A block is cut at the own
    slots' edges (slot D+rank: rows 0..c; slot rank: rows c..2c), and a bottom-right causal
    block over more keys than queries into a full block and its square causal end: exact
    once each query chunk's two parts are merged by lse."""
    own = {(size + rank) * chunk: 0, rank * chunk: chunk}  # slot's first key row -> own row
    split = []
    for blocks_ in chunk_blocks:
        mine, others = [], []
        for q0, q1, k0, k1, causal in blocks_:
            square = q1 - q0
            pieces = [(k0, k1 - square, False), (k1 - square, k1, True)] if causal and k1 - k0 > square else \
                [(k0, k1, causal)]
            for a, b, c in pieces:
                for x, y, slot in _cut_at_own_slots(a, b, size, rank, chunk):
                    if slot is None:
                        others.append((q0, q1, x, y, c))
                    else:
                        mine.append((q0, q1, x - slot + own[slot], y - slot + own[slot], c))
        split.append((mine, others))
    return split


def window_of(layer_number: int, config, where: str) -> int:
    """The causal sliding window of megatron's layer ``layer_number`` (1-based, global):
    ``config.window_size[0]``, the keys before a query that it sees, where megatron-core makes
    the layer a window layer (``window_attn_skip_freq``: every N-th layer, or a list, is
    global); -1 where it sees every earlier key. A window that is not causal, ``(W, 0)`` with
    W >= 0, is a one-line ValueError naming ``where`` (the attention module)."""
    from megatron.core.transformer.utils import is_layer_window_attention

    from megatron_tsp.core.support import causal_window

    window = getattr(config, "window_size", None)
    if not causal_window(window):
        raise ValueError(f"{where}: window_size must be W,0 with W >= 0, a causal sliding window (got {window})")
    if not window or window[0] < 0 or not is_layer_window_attention(window, config.window_attn_skip_freq,
                                                                       layer_number):
        return -1
    return int(window[0])


def window_piece(chunk: int, window: int, backend: str) -> int:
    """The query rows of a window's blocks (:func:`window_blocks`): the whole chunk where the
    kernel takes the window itself (fewest calls), else (the kernel is handed a mask of the
    block) the smallest divisor of the chunk longer than the window."""
    if backend in WINDOW_NATIVE:
        return chunk
    return next(p for p in range(min(window + 1, chunk), chunk + 1) if chunk % p == 0)


def window_blocks(queries: Sequence[Tuple[int, int]], piece: int, key_row: Callable[[int], int], window: int,
                  cuts: Sequence[int] = ()) -> List[Block]:
    """The kernel calls of causal attention with a sliding window of ``window`` keys before
    each query (megatron's ``window_size = (window, 0)``: query i sees keys i-window..i).
    ``queries``: (first row, global piece index g) of query pieces of ``piece`` rows; the keys
    of global piece h sit at rows ``key_row(h)`` ... ``+ piece``. Per query piece, the key
    pieces it reaches, nearest first: its own (causal, with ``left`` where the window ends
    inside it), then earlier ones whose pairs satisfy ``key - query >= t``, ``t = (g-h)·piece -
    window``: all of them (a full block), a band (``left = -t``; rows with no key and keys with
    no row cut off, so that the block stays square and no row is empty), or none (skipped,
    with every earlier piece). Adjacent full blocks of the same rows merge, unless the key row
    between them is in ``cuts``."""
    out: List[Block] = []
    for row, g in queries:
        full: List[Block] = []
        for h in range(g, -1, -1):
            k0 = key_row(h)
            if h == g:
                out.append((row, row + piece, k0, k0 + piece, True) + ((window,) if window < piece - 1 else ()))
                continue
            t = (g - h) * piece - window
            if t > piece - 1:
                break
            if t <= 1 - piece:
                full.append((row, row + piece, k0, k0 + piece, False))
            elif t > 0:
                out.append((row, row + piece - t, k0 + t, k0 + piece, False, 0))
            else:
                out.append((row, row + piece, k0, k0 + piece, False, -t))
        _append_merged(out, full, cuts)
    return out


def _append_merged(out: List[Block], full: List[Block], cuts: Sequence[int]) -> None:
    """Append the full blocks of one query range, adjacent ones (by key rows, not across a
    row in ``cuts``) merged into one."""
    start = len(out)
    for b in sorted(full, key=lambda b: b[2]):
        last = out[-1] if len(out) > start else None
        if last and last[:2] == b[:2] and last[3] == b[2] and b[2] not in cuts:
            out[-1] = (*b[:2], last[2], b[3], *b[4:])
        else:
            out.append(b)


def document_blocks(queries: Sequence[Tuple[int, int]], chunk: int, key_row: Callable[[int], int],
                    starts: Sequence[Sequence[int]], cuts: Sequence[int] = (), window: int = -1) -> List[Block]:
    """The kernel calls of causal attention within packed documents (Megatron-LM's
    ``--reset-attention-mask``: a query sees the keys of its own document up to itself;
    with a sliding ``window`` >= 0, only the ``window`` keys before it of them).
    ``queries``: (first row, global chunk index g) of query chunks of ``chunk`` rows; the keys
    of natural chunk h sit at rows ``key_row(h)`` ... ``+ chunk``; ``starts[s]``: where sample
    s's documents start (sorted, 0 first). Each query chunk is cut at the document starts
    inside it; a piece [a, b) of document d sees its own rows causally (a square block, with
    ``left`` where the window ends inside it) and, where d started in an earlier chunk, the
    keys of d there, nearest chunk first: a full block per chunk (adjacent ones merged unless
    the key row between them is in ``cuts``), a band where the window's edge crosses it (rows
    with no key and keys with no row cut off), none beyond. Nothing outside a document or a
    window is called. A block is of one sample (seventh entry) unless every sample has the
    same documents."""
    shared = all(list(s) == list(starts[0]) for s in starts)
    out: List[Block] = []
    for sample, doc_starts in ([(-1, starts[0])] if shared else list(enumerate(starts))):
        for row, g in queries:
            lo, hi = g * chunk, (g + 1) * chunk
            first, last = bisect.bisect_right(doc_starts, lo), bisect.bisect_left(doc_starts, hi)
            bounds = [lo, *doc_starts[first:last], hi]
            for i, (a, b) in enumerate(zip(bounds, bounds[1:])):  # the first piece's document began at or before lo
                start = doc_starts[first - 1] if i == 0 else a
                _document_piece(out, row - lo, a, b, start, chunk, key_row(g) - lo, key_row, window, cuts, sample)
    return out


def _document_piece(out: List[Block], row_of: int, a: int, b: int, start: int, chunk: int, own: int,
                    key_row: Callable[[int], int], window: int, cuts: Sequence[int], sample: int) -> None:
    """:func:`document_blocks` of the queries at positions [a, b) (rows ``row_of`` + position)
    of a document starting at ``start``, their chunk's keys at rows ``own`` + position."""
    tag = () if sample < 0 else (-1, sample)
    n = b - a
    left = window if 0 <= window < n - 1 else -1
    out.append((row_of + a, row_of + b, own + a, own + b, True, *((left, *tag[1:]) if left >= 0 else tag)))
    full = []
    for h in range(a // chunk - 1, start // chunk - 1, -1):
        k0, k1 = max(start, h * chunk), (h + 1) * chunk
        m = k1 - k0
        t = a - k0 - window  # in the window: key y - query x >= t (block rows and keys)
        if window >= 0 and t > m - 1:
            break  # out of the window, as is every earlier chunk
        rows = (row_of + a, row_of + b)
        keys = key_row(h) + k0 - h * chunk
        if window < 0 or t <= 1 - n:
            full.append((*rows, keys, keys + m, False, *tag))
            continue
        first = max(0, t)  # keys before it are seen by no row; rows from m - t on see no key
        n_, m_ = min(n, m - t), m - first
        out.append((rows[0], rows[0] + n_, keys + first, keys + m, False, m_ - n_ - min(t, 0), *tag[1:]))
    _append_merged(out, full, cuts)


def _zigzag_slot(size: int, natural: int) -> int:
    """The key slot of natural chunk ``natural`` in the zigzag layout (:func:`zigzag_blocks`)."""
    return size + natural if natural < size else 2 * size - 1 - natural


def _early_first(size: int, chunk: int, forward: List[Block]) -> Tuple[List[Block], int]:
    """The backward's order of blocks none of which spans the slots' halves: those on slots
    0..D-1 (only the rank's chunk 2D-1-r reaches them) first, which then travel."""
    early = [b for b in forward if b[2] < size * chunk]
    return early + [b for b in forward if b[2] >= size * chunk], len(early)


def zigzag_window_blocks(size: int, rank: int, chunk: int, window: int,
                         backend: str) -> Tuple[List[Block], Tuple[List[Block], int]]:
    """:func:`zigzag_blocks` and :func:`zigzag_backward_blocks` of a layer with a sliding
    ``window``: the window's blocks (:func:`window_blocks`) of the rank's two query chunks
    against the zigzag layout, none spanning the slots' halves (:func:`_early_first`)."""
    d, c = size, chunk
    piece = window_piece(c, window, backend)
    per = c // piece
    queries = [(i * c + j * piece, g * per + j) for i, g in enumerate((rank, 2 * d - 1 - rank)) for j in range(per)]
    forward = window_blocks(queries, piece, lambda h: _zigzag_slot(d, h // per) * c + (h % per) * piece, window,
                            cuts=(d * c,))
    return forward, _early_first(d, c, forward)


def zigzag_document_blocks(size: int, rank: int, chunk: int, starts: Sequence[Sequence[int]],
                           window: int = -1) -> Tuple[List[Block], Tuple[List[Block], int]]:
    """:func:`zigzag_window_blocks` for packed documents (:func:`document_blocks`), with a
    sliding ``window`` where >= 0: built once per micro-batch's documents, not per layer
    (the lists returned are shared: read them, do not change them)."""
    return _zigzag_document_blocks(size, rank, chunk, tuple(tuple(s) for s in starts), window)


@lru_cache(maxsize=16)
def _zigzag_document_blocks(size: int, rank: int, chunk: int, starts: Tuple[Tuple[int, ...], ...],
                            window: int) -> Tuple[List[Block], Tuple[List[Block], int]]:
    d, c = size, chunk
    forward = document_blocks([(0, rank), (c, 2 * d - 1 - rank)], c, lambda h: _zigzag_slot(d, h) * c, starts,
                              cuts=(d * c,), window=window)
    return forward, _early_first(d, c, forward)


def _pairs(n: int, m: int, causal: bool, left: int) -> int:
    if left < 0 or left >= m - 1:
        return n * m - (n * (n - 1) // 2 if causal else 0)
    # row x sees keys max(0, x + m - n - left) .. (x + m - n if causal else m - 1): both aligned bottom-right
    x = numpy.arange(n, dtype=numpy.int64)
    lo = numpy.maximum(0, x + m - n - left)
    hi = numpy.minimum(m - 1, x + m - n) if causal else numpy.full(n, m - 1)
    return int(numpy.maximum(0, hi - lo + 1).sum())


def visible_pairs_of(blocks_: Sequence[Block]) -> int:
    """(query, key) pairs the blocks compute: a full block all of its rows x keys, a causal
    one (aligned bottom-right) a row i of n sees all but the last n-1-i keys, a window's
    band (``left``) what :func:`window_blocks` says."""
    return sum(_pairs(b[1] - b[0], b[3] - b[2], b[4], b[5] if len(b) > 5 else -1) for b in blocks_)  # per sample


def _flat(blocks_: Sequence[Block]) -> List[int]:
    return [int(x) for b in blocks_ for x in (*b[:5], *b[5:], *(-1,) * (7 - len(b)))]


def _unflat(flat: Sequence[int]) -> List[_Call]:
    return [_Call(*flat[i:i + 4], bool(flat[i + 4]), *flat[i + 5:i + 7]) for i in range(0, len(flat), 7)]


def _by_sample(calls: Sequence[_Call]) -> Dict[int, List[int]]:
    """Indices of the calls of each sample (-1: of every sample), in order."""
    out: Dict[int, List[int]] = {}
    for i, c in enumerate(calls):
        out.setdefault(c.sample, []).append(i)
    return out


def _of(t: torch.Tensor, sample: int) -> torch.Tensor:
    """``t`` ``[b, ...]``, or its one sample (a view)."""
    return t if sample < 0 else t[sample:sample + 1]


# ---- backends: one block, [b, h, s, d] in, (out, lse [b, h, sq] fp32) out ---------------------
def _repeat_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.size(1) == heads else t.repeat_interleave(heads // t.size(1), dim=1)


def _sum_kv(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    return t if t.size(1) == kv_heads else t.unflatten(1, (kv_heads, -1)).sum(2)


def _bshd(t: torch.Tensor) -> torch.Tensor:
    """``t`` ([b, h, s, d]) with the memory layout of a ``[b, s, h, d]`` tensor."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _hidden(sq: int, sk: int, causal: bool, left: int, device) -> Optional[torch.Tensor]:
    """The (query, key) pairs a block hides, ``[sq, sk]`` bool (causal and the band aligned
    bottom-right, as flash-attn's window: row x sees keys from x + sk - sq - left); None when
    it hides none."""
    ones = torch.ones(sq, sk, dtype=torch.bool, device=device)
    hidden = ones.triu(sk - sq + 1) if causal else None
    if left >= 0:
        band = ones.tril(sk - sq - left - 1)
        hidden = band if hidden is None else hidden | band
    return hidden


def _window_mask(q: torch.Tensor, k: torch.Tensor, causal: bool, left: int) -> torch.Tensor:
    """A window block's additive mask (0 / -inf) in q's dtype, for kernels that take one."""
    hidden = _hidden(q.size(2), k.size(2), causal, left, q.device)
    return torch.zeros(hidden.shape, dtype=q.dtype, device=q.device).masked_fill(hidden, float("-inf"))


class _Math:
    """Softmax attention written out (fp32 scores); causal masks aligned bottom-right."""

    bottom_right = True

    @staticmethod
    def _scores(q, k, causal, scale, left):
        s = torch.matmul(q.float(), _repeat_kv(k, q.size(1)).float().transpose(-1, -2)) * scale
        hidden = _hidden(*s.shape[-2:], causal, left, s.device)
        return s if hidden is None else s.masked_fill(hidden, float("-inf"))

    @classmethod
    def forward(cls, q, k, v, causal, scale, left=-1):
        s = cls._scores(q, k, causal, scale, left)
        lse = torch.logsumexp(s, dim=-1)
        out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), _repeat_kv(v, q.size(1)).float())
        return out.to(q.dtype), lse

    @classmethod
    def backward(cls, dout, q, k, v, out, lse, causal, scale, left=-1):
        p = torch.exp(cls._scores(q, k, causal, scale, left) - lse.unsqueeze(-1))
        dout = dout.float()
        dv = torch.matmul(p.transpose(-1, -2), dout)
        dp = torch.matmul(dout, _repeat_kv(v, q.size(1)).float().transpose(-1, -2))
        ds = p * (dp - (dout * out.float()).sum(-1, keepdim=True)) * scale
        dq = torch.matmul(ds, _repeat_kv(k, q.size(1)).float())
        dk = torch.matmul(ds.transpose(-1, -2), q.float())
        return dq.to(q.dtype), _sum_kv(dk, k.size(1)).to(k.dtype), _sum_kv(dv, v.size(1)).to(v.dtype)


class _CPU:
    """aten's CPU flash kernel (GQA as it is; causal mask aligned top-left; a window's
    blocks as an additive mask of the block)."""

    bottom_right = False

    @staticmethod
    def forward(q, k, v, causal, scale, left=-1):
        if left >= 0:
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, False, attn_mask=_window_mask(q, k, causal, left), scale=scale)[:2]
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)[:2]

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal, scale, left=-1):
        if left >= 0:
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout.contiguous(), q, k, v, out, lse, 0.0, False, attn_mask=_window_mask(q, k, causal, left),
                scale=scale)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(), q, k, v, out, lse, 0.0, causal, scale=scale)


def _no_window(left: int) -> None:
    """cuDNN's and the memory-efficient kernel have no sliding window (:func:`resolve_backend`
    keeps window layers off them): a window's block reaching one is a mistake, said in a line."""
    if left >= 0:
        raise ValueError("a sliding window's block reached a kernel without a window (cudnn, efficient); use "
                         "attention backend 'auto', 'flash' or 'flash_attn'")


def _no_rng(device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Philox seed and offset for a backward without dropout (read only with dropout)."""
    return torch.empty(2, dtype=torch.int64, device=device), torch.empty((), dtype=torch.int64, device=device)


class _Flash:
    """torch's flash kernel (FlashAttention-2 inside torch; CUDA and ROCm, fp16/bf16, GQA
    native). Whether its causal mask is aligned bottom-right is learned by the check: on ROCm
    it is AOTriton, whose backward refuses a causal block with sq != sk."""

    bottom_right = None

    @staticmethod
    def forward(q, k, v, causal, scale, left=-1):
        if left >= 0:  # the kernel's own window (FlashAttention-2's window_size), [b, s, h, d]
            out, lse, *_ = torch.ops.aten._flash_attention_forward(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, q.size(2), k.size(2), 0.0,
                causal, False, scale=scale, window_size_left=left, window_size_right=0 if causal else -1)
            return out.transpose(1, 2), lse
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return out, lse

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal, scale, left=-1):
        seed, offset = _no_rng(q.device)
        if left >= 0:
            dq, dk, dv = torch.ops.aten._flash_attention_backward(
                dout.transpose(1, 2).contiguous(), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                out.transpose(1, 2), lse, None, None, q.size(2), k.size(2), 0.0, causal, seed, offset, scale=scale,
                window_size_left=left, window_size_right=0 if causal else -1)
            return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout.contiguous(), q, k, v, out, lse, None, None, q.size(2), k.size(2), 0.0, causal, seed, offset,
            scale=scale)

    @staticmethod
    def has_varlen() -> bool:
        """torch's CUDA flash kernel takes ``cum_seq_q/k``; ROCm's (AOTriton) is not relied on."""
        return not getattr(torch.version, "hip", None)

    @staticmethod
    def forward_varlen(q, k, v, cu, longest, scale):
        out, lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, longest, longest, 0.0, True, False,
                                                               scale=scale)
        return out, lse

    @staticmethod
    def backward_varlen(dout, q, k, v, out, lse, cu, longest, scale):
        seed, offset = _no_rng(q.device)
        return torch.ops.aten._flash_attention_backward(dout, q, k, v, out, lse, cu, cu, longest, longest, 0.0, True,
                                                        seed, offset, scale=scale)


# torch 2.9 made the cuDNN kernel's lse [b, h, sq, 1]
_CUDNN_LSE_4D = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 9)


class _CuDNN:
    """torch's cuDNN attention (CUDA, fp16/bf16). K/V heads are repeated for GQA; ``out``
    and ``dout`` are handed over with the same (contiguous) strides, as its backward wants."""

    bottom_right = None

    @staticmethod
    def forward(q, k, v, causal, scale, left=-1):
        _no_window(left)
        k, v = _repeat_kv(k, q.size(1)), _repeat_kv(v, q.size(1))
        out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                          scale=scale)
        return out, lse.reshape(lse.shape[:3])

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal, scale, left=-1):
        _no_window(left)
        kr, vr = _repeat_kv(k, q.size(1)), _repeat_kv(v, q.size(1))
        seed, offset = _no_rng(q.device)
        lse = lse.unsqueeze(-1) if _CUDNN_LSE_4D else lse
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout.contiguous(), q, kr, vr, out.contiguous(), lse.contiguous(), seed, offset, None, None, None,
            q.size(2), kr.size(2), 0.0, causal, scale=scale)
        return dq, _sum_kv(dk, k.size(1)), _sum_kv(dv, v.size(1))


class _Efficient:
    """torch's memory-efficient kernel (CUDA and ROCm, any dtype; the SDPA fallback). K/V
    heads are repeated for GQA. Its lse has ``ceil(sq/32)*32`` rows on CUDA and ``sq`` on
    ROCm; its backward reads ``out`` and ``dout`` with the strides of a ``[b, s, h, d]``
    tensor (rows ``h*d`` apart), which its forward returns."""

    bottom_right = None

    @staticmethod
    def _lse_rows(sq: int) -> int:
        return sq if torch.version.hip else -(-sq // 32) * 32

    @staticmethod
    def forward(q, k, v, causal, scale, left=-1):
        _no_window(left)
        k, v = _repeat_kv(k, q.size(1)), _repeat_kv(v, q.size(1))
        out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                              scale=scale)
        return out, lse[..., : q.size(2)]

    @classmethod
    def backward(cls, dout, q, k, v, out, lse, causal, scale, left=-1):
        _no_window(left)
        kr, vr = _repeat_kv(k, q.size(1)), _repeat_kv(v, q.size(1))
        lse = F.pad(lse, (0, cls._lse_rows(q.size(2)) - q.size(2))).contiguous()
        seed, offset = _no_rng(q.device)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            _bshd(dout), q, kr, vr, None, _bshd(out), lse, seed, offset, 0.0, [True, True, True, False], causal,
            scale=scale)
        return dq, _sum_kv(dk, k.size(1)), _sum_kv(dv, v.size(1))


class _FlashAttn:
    """The flash-attn package (2.x: ``[b, s, h, d]``, GQA native, causal mask aligned
    bottom-right). From 2.6 its private entry points are ``torch.library.custom_op``s whose
    signature reads ``(*args, **kwargs)``: arguments are matched on the undecorated
    function (``_init_fn``), so that 2.8's required ``softcap`` is passed."""

    bottom_right = True

    @staticmethod
    @lru_cache(maxsize=None)
    def _functions():
        from flash_attn.flash_attn_interface import _flash_attn_backward, _flash_attn_forward

        def options(fn):
            params = inspect.signature(getattr(fn, "_init_fn", fn)).parameters
            opts = {"alibi_slopes": None}
            if "softcap" in params:
                opts["softcap"] = 0.0
            return opts, "window_size" in params

        return _flash_attn_forward, options(_flash_attn_forward), _flash_attn_backward, options(_flash_attn_backward)

    @staticmethod
    @lru_cache(maxsize=None)
    def _varlen_functions():
        """The package's varlen entry points where they take ``window_size_left`` (2.6 on, whose
        lse is ``[h, total]``); None before."""
        from flash_attn import flash_attn_interface as fa

        fwd, bwd = (getattr(fa, name, None) for name in ("_flash_attn_varlen_forward", "_flash_attn_varlen_backward"))
        if fwd is None or bwd is None or "window_size_left" not in inspect.signature(
                getattr(fwd, "_init_fn", fwd)).parameters:
            return None
        return fwd, bwd

    @classmethod
    def has_varlen(cls) -> bool:
        return cls._varlen_functions() is not None

    @classmethod
    def forward_varlen(cls, q, k, v, cu, longest, scale):
        fwd, _ = cls._varlen_functions()
        out, lse, *_ = fwd(q, k, v, cu, cu, longest, longest, 0.0, scale, True, window_size_left=-1,
                           window_size_right=0, softcap=0.0, alibi_slopes=None, return_softmax=False)
        return out, lse

    @classmethod
    def backward_varlen(cls, dout, q, k, v, out, lse, cu, longest, scale):
        _, bwd = cls._varlen_functions()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        bwd(dout, q, k, v, out, lse, dq, dk, dv, cu, cu, longest, longest, 0.0, scale, True, -1, 0, 0.0, None, False,
            None)
        return dq, dk, dv

    @staticmethod
    def _with_window(options, causal: bool, left: int) -> dict:
        opts, one_argument = options
        right = 0 if causal and left >= 0 else -1
        window = dict(window_size=(left, right)) if one_argument else dict(window_size_left=left,
                                                                           window_size_right=right)
        return {**opts, **window}

    @classmethod
    def forward(cls, q, k, v, causal, scale, left=-1):
        fwd, opts, _, _ = cls._functions()
        ret = fwd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=0.0, softmax_scale=scale,
                  causal=causal, return_softmax=False, **cls._with_window(opts, causal, left))
        out, lse = (ret[0], ret[5]) if len(ret) == 8 else (ret[0], ret[1])  # before 2.6: 8 values
        return out.transpose(1, 2), lse

    @classmethod
    def backward(cls, dout, q, k, v, out, lse, causal, scale, left=-1):
        _, _, bwd, opts = cls._functions()
        q, k, v, out, dout = (t.transpose(1, 2) for t in (q, k, v, out, dout))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        bwd(dout.contiguous(), q, k, v, out, lse, dq, dk, dv, dropout_p=0.0, softmax_scale=scale, causal=causal,
            deterministic=False, rng_state=None, **cls._with_window(opts, causal, left))
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


_KERNELS = {"flash": _Flash, "cudnn": _CuDNN, "efficient": _Efficient, "flash_attn": _FlashAttn, "cpu": _CPU,
            "math": _Math}


def flash_attn_installed() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def validate_backend(name: str) -> str:
    """Validate a backend name when a module is built (``auto`` is resolved per call)."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)} (got {name!r})")
    if name == "flash_attn" and not flash_attn_installed():
        raise ValueError("attention_backend 'flash_attn' needs the flash-attn package; install it or use 'auto'")
    return name


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype, planned: bool = False,
                    keys: Optional[int] = None, windowed: bool = False, documents: bool = False,
                    head_dim: int = 64) -> str:
    """The kernel a backend name means on ``device`` for ``dtype`` (``auto``: the fastest
    there is, for attention over ``keys`` keys where given; ``gpu``: what ``auto`` picks on a
    GPU), or a one-line ValueError when the kernel cannot run there. ``planned``: the tensors
    are fake (the memory planner), and a GPU kernel's meta function runs on any device.
    ``windowed``: the layer has a sliding window; ``documents``: packed documents;
    ``head_dim``: the model's, at which a real GPU's cuDNN is checked.

    ``auto`` on a GPU in fp16/bf16 is cuDNN's attention from :data:`AUTO_CUDNN_FROM_KEYS` keys
    on where it runs here (NVIDIA, and its check at this head dim and dtype passes), else
    flash; fp32 is the memory-efficient kernel. A window layer takes flash (fp16/bf16) or math
    (fp32): the others have no window. Packed documents take flash, whose varlen form makes a
    chunk's document pieces one call (cuDNN has none here: a call per piece, whose shapes
    change every micro-batch, and a cuDNN graph built for each new shape). Every mode resolves
    the same name at the same sequence length to the same kernel."""
    gpu = device.type == "cuda" or planned
    if name == "gpu" and not gpu:
        raise ValueError("attention backend 'gpu' plans a GPU's kernels, on fake tensors only (the memory planner); "
                         "use 'auto'")
    if windowed and name in NO_WINDOW:
        raise ValueError(f"attention backend {name!r} has no sliding window (--window-size); use 'auto', 'flash' or "
                         "'flash_attn'")
    if name == "auto" and device.type != "cuda":
        return "cpu"
    if name in ("auto", "gpu"):
        if dtype not in (torch.float16, torch.bfloat16):
            return "math" if windowed else "efficient"
        long = keys is not None and keys >= AUTO_CUDNN_FROM_KEYS and not windowed and not documents
        return "cudnn" if long and _cudnn_runs(device, dtype, planned, head_dim) else "flash"
    if name in GPU_BACKENDS and not gpu:
        raise ValueError(f"attention backend {name!r} runs on CUDA/ROCm GPUs only (tensors on {device.type}); "
                         "use 'auto'")
    if name == "cpu" and device.type == "cuda":
        raise ValueError("attention backend 'cpu' runs on the CPU only; use 'auto'")
    if name in HALF_ONLY and dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"attention backend {name!r} takes fp16/bf16 only (got {dtype}); use 'auto' or 'efficient'")
    return name


_CUDNN_RUNS: Dict[Tuple[str, torch.dtype, int], bool] = {}


def _cudnn_runs(device: torch.device, dtype: torch.dtype, planned: bool, head_dim: int) -> bool:
    """Whether ``auto`` may take cuDNN's attention: never on ROCm (torch has none there); on
    fake tensors as on an NVIDIA GPU; on a real one when its check at this head dim and dtype
    passes (a head dim, dtype, GPU or cuDNN it does not take raises there, and ``auto`` takes
    flash)."""
    if getattr(torch.version, "hip", None):
        return False
    if planned:
        return True
    key = (device.type, dtype, head_dim)
    if key not in _CUDNN_RUNS:
        try:
            check_backend("cudnn", device, dtype, head_dim=head_dim)
            _CUDNN_RUNS[key] = True
        except RuntimeError:
            _CUDNN_RUNS[key] = False
    return _CUDNN_RUNS[key]


# (backend, device type, dtype, head dim) -> bottom_right, of the checked ones
_CHECKED: Dict[Tuple[str, str, torch.dtype, int], bool] = {}
_WINDOW_CHECKED: set = set()  # (backend, device type, dtype, head dim) whose window blocks were checked
# How torch's GPU kernels align a causal mask when sq < sk, on CUDA: its flash kernel is
# FlashAttention-2 (bottom-right since 2.1); the memory-efficient and cuDNN kernels take
# ``is_causal`` top-left. What the memory planner's fake tensors assume; a real device checks.
# On ROCm torch's flash kernel is AOTriton, whose backward refuses a non-square causal block.
_ON_A_GPU = {"flash": True, "cudnn": False, "efficient": False}


def bottom_right(backend: str, device: torch.device, dtype: torch.dtype, planned: bool = False) -> bool:
    """Whether ``backend``'s causal mask is aligned bottom-right when sq < sk: known, or as
    :func:`check_backend` found it; for fake tensors (``planned``), as on a CUDA or ROCm GPU;
    else False before a check."""
    known = _KERNELS[backend].bottom_right
    if known is not None:
        return known
    found = [aligned for (b, kind, d, _), aligned in _CHECKED.items() if (b, kind, d) == (backend, device.type, dtype)]
    if found:
        return found[0]
    return planned and _ON_A_GPU.get(backend, False) and not getattr(torch.version, "hip", None)


def prepare_backend(name: str, device: torch.device, dtype: torch.dtype, planned: bool, keys: int,
                    windowed: bool, documents: bool, head_dim: int) -> Tuple[str, bool]:
    """A layer's kernel (:func:`resolve_backend`), checked on a real device before anything
    asks how it aligns a causal mask (:func:`check_backend`), and that alignment
    (:func:`bottom_right`): the blocks of the first step are those of every later one."""
    backend = resolve_backend(name, device, dtype, planned=planned, keys=keys, windowed=windowed,
                              documents=documents, head_dim=head_dim)
    if not planned:
        check_backend(backend, device, dtype, windowed, head_dim)
    return backend, bottom_right(backend, device, dtype, planned=planned)


def check_backend(backend: str, device: torch.device, dtype: torch.dtype, windowed: bool = False,
                  head_dim: int = 64) -> None:
    """Once per (backend, device type, dtype, head dim): a small GQA problem with micro-batch 2
    at the model's head dim in the real layout (``[s, b, h, d]`` memory seen as ``[b, h, s,
    d]``), forward and backward with
    the lse handed back, for a square causal, a full and (where the kernel may align it
    bottom-right) a non-square causal block, against ``math``; the first time a sliding
    window (``windowed``) runs there, also a window's blocks (a causal one, a square and a
    non-square band); where the kernel has a varlen form (:func:`_varlen_runs`), three
    documents a sample in one call, which is not used where it disagrees (a warning; the
    blocks are exact without it). Records the alignment; a one-line RuntimeError if the
    kernel's conventions are not the ones assumed here."""
    key = (backend, device.type, dtype, head_dim)
    if backend in ("math", "cpu") or (key in _CHECKED and (not windowed or key in _WINDOW_CHECKED)):
        return
    g = torch.Generator(device="cpu").manual_seed(0)

    def tensor(s, h):  # [s, b, h, d] in memory, [b, h, s, d] as the op hands it to a kernel
        return torch.randn(s, 2, h, head_dim, generator=g).to(device=device, dtype=dtype).permute(1, 2, 0, 3)

    kernel, tol = _KERNELS[backend], (1e-3 if dtype == torch.float32 else 3e-2)

    def agrees(sq, sk, causal, left=-1, reference=_Math):
        q, dout, k, v = tensor(sq, 4), tensor(sq, 4), tensor(sk, 2), tensor(sk, 2)
        ref = reference.forward(q, k, v, causal, 0.125, left)
        ref_grads = reference.backward(dout, q, k, v, *ref, causal, 0.125, left)
        got = kernel.forward(q, k, v, causal, 0.125, left)
        got_grads = kernel.backward(dout, q, k, v, *ref, causal, 0.125, left)
        return close((*got, *got_grads), (*ref, *ref_grads))

    def close(got, ref):
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
            if a.shape != b.shape or not torch.allclose(a.float(), b.float(), atol=tol * b.abs().max().item(), rtol=0):
                return name
        return None

    def varlen_agrees():  # three documents of each of 2 samples in one call (_varlen_runs)
        q, dout, k, v = tensor(64, 4), tensor(64, 4), tensor(64, 2), tensor(64, 2)
        run = [_Call(a, b, a, b, True, -1, -1) for a, b in ((0, 16), (16, 56), (56, 64))]
        parts = [(c.q0, c.q1) for c in run]
        ref = [_Math.forward(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], True, 0.125) for a, b in parts]
        out, lse = (torch.cat(t, 2) for t in zip(*ref))
        ref_grads = [_Math.backward(dout[:, :, a:b], q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], out[:, :, a:b],
                                    lse[:, :, a:b], True, 0.125) for a, b in parts]
        got = _varlen_forward(kernel, q, k, v, run, 0.125)
        got_grads = _varlen_backward(kernel, dout, q, k, v, out, lse, run, 0.125)
        return close([torch.cat([got[c][i] for c in run], 2) for i in (0, 1)] + list(got_grads),
                     [out, lse] + [torch.cat(t, 2) for t in zip(*ref_grads)])

    def check(cases):
        for sq, sk, causal, left in cases:
            try:
                wrong = agrees(sq, sk, causal, left)
            except RuntimeError as exc:
                if left < 0:
                    raise
                wrong = f"result (it refuses a window here: {str(exc).splitlines()[0]})"
            if wrong:
                raise RuntimeError(f"attention backend {backend!r} gives a wrong {wrong} on {device.type} {dtype} "
                                   f"(head dim {head_dim}, causal={causal}, window {left}, {sq}x{sk}); build the "
                                   "model with attention_backend='math' or another backend")

    if windowed and key not in _WINDOW_CHECKED:  # a window's blocks: causal, a band, a band not square
        check([(64, 64, True, 16), (64, 64, False, 8), (32, 64, False, 40)])
        _WINDOW_CHECKED.add(key)
    if key in _CHECKED:
        return
    check([(64, 64, True, -1), (64, 128, False, -1)])
    if getattr(kernel, "has_varlen", lambda: False)():
        try:
            wrong = varlen_agrees()
        except RuntimeError as exc:
            wrong = f"result (it raised: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
        if wrong:  # the blocks are right without it: a call per document piece
            _VARLEN_BROKEN.add((kernel, device.type, dtype, head_dim))
            warnings.warn(f"attention backend {backend!r} gives a wrong {wrong} in its varlen form (cu_seqlens) on "
                          f"{device.type} {dtype}: packed documents run a kernel call per piece", stacklevel=2)
    aligned = kernel.bottom_right
    if aligned is None:
        try:
            aligned = agrees(64, 128, True) is None
        except RuntimeError:  # refuses causal with sq != sk (ROCm's AOTriton backward): square blocks only
            aligned = False
    _CHECKED[key] = aligned


# ---- the op ----------------------------------------------------------------------------------
def _kernel(backend: str, q: torch.Tensor, calls: Sequence[_Call]) -> Tuple[str, type]:
    windowed = any(c.left >= 0 for c in calls)
    backend = resolve_backend(backend, q.device, q.dtype, planned=is_fake(q), windowed=windowed, head_dim=q.size(-1))
    if not is_fake(q):
        check_backend(backend, q.device, q.dtype, windowed, q.size(-1))
    return backend, _KERNELS[backend]


_VARLEN_BROKEN: set = set()  # (kernel, device type, dtype, head dim) whose varlen form failed check_backend


def _varlen_runs(kernel, calls: Sequence[_Call], q: torch.Tensor) -> List[List[_Call]]:
    """Runs of square causal blocks one after the other in both queries and keys (packed
    documents' pieces of a query chunk, :func:`document_blocks`, and any other such blocks),
    each run one varlen call (``cu_seqlens``) where the kernel has one for ``q``'s device and
    dtype (its form passed :func:`check_backend`), not one call each."""
    if not getattr(kernel, "has_varlen", lambda: False)() or \
            (kernel, q.device.type, q.dtype, q.size(-1)) in _VARLEN_BROKEN:
        return []
    runs: List[List[_Call]] = []
    for c in sorted(calls, key=lambda c: c.q0):
        if not (c.causal and c.left < 0 and c.q1 - c.q0 == c.k1 - c.k0):
            continue
        if runs and runs[-1][-1].q1 == c.q0 and runs[-1][-1].k1 == c.k0:
            runs[-1].append(c)
        else:
            runs.append([c])
    return [run for run in runs if len(run) > 1]


def _span(run: Sequence[_Call]) -> Tuple[int, int, int, int]:
    """A run's query rows and key rows, each one range (its blocks follow one another)."""
    return run[0].q0, run[-1].q1, run[0].k0, run[-1].k1


def _thd(t: torch.Tensor) -> torch.Tensor:
    """``[b, h, L, d]`` as a varlen kernel's ``[b·L, h, d]`` (the samples one after another)."""
    return t.permute(0, 2, 1, 3).reshape(-1, t.size(1), t.size(3))


def _bhsd_of(t: torch.Tensor, b: int) -> torch.Tensor:
    return t.view(b, -1, *t.shape[1:]).permute(0, 2, 1, 3)


def _cu_seqlens(run: Sequence[_Call], q: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """The run's pieces of every sample as a varlen kernel's sequences: int32 offsets and the
    longest. To a GPU from pinned memory without waiting (a plain copy would wait for the
    stream: for everything queued, the transfers TSP overlaps included)."""
    lengths = [c.q1 - c.q0 for c in run] * q.size(0)
    offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    if q.device.type == "cuda" and not is_fake(q):
        return offsets.pin_memory().to(q.device, non_blocking=True), max(lengths)
    return offsets.to(q.device), max(lengths)


def _varlen_forward(kernel, q, k, v, calls: Sequence[_Call], scale: float) -> Dict[_Call, Tuple[torch.Tensor, ...]]:
    """The outputs and lse of the blocks :func:`_varlen_runs` finds, one kernel call a run."""
    found = {}
    for run in _varlen_runs(kernel, calls, q):
        q0, q1, k0, k1 = _span(run)
        cu, longest = _cu_seqlens(run, q)
        out, lse = kernel.forward_varlen(_thd(q[:, :, q0:q1]), _thd(k[:, :, k0:k1]), _thd(v[:, :, k0:k1]), cu,
                                         longest, scale)
        out, lse = _bhsd_of(out, q.size(0)), lse.view(lse.size(0), q.size(0), -1).transpose(0, 1)
        for c in run:
            found[c] = (out[:, :, c.q0 - q0:c.q1 - q0], lse[:, :, c.q0 - q0:c.q1 - q0])
    return found


def _varlen_backward(kernel, dout, q, k, v, out, lse, run: Sequence[_Call], scale: float):
    """A run's backward in one varlen call: dq, dk, dv over its rows and keys, ``[b, h, L, d]``.
    The kernels read the lse by pointer as a contiguous ``[h, b·L]`` and check no strides: a
    run of part of the rows (a zigzag rank's chunk) at micro-batch 1 is a strided view, copied."""
    q0, q1, k0, k1 = _span(run)
    b = q.size(0)
    cu, longest = _cu_seqlens(run, q)
    grads = kernel.backward_varlen(_thd(dout[:, :, q0:q1]), _thd(q[:, :, q0:q1]), _thd(k[:, :, k0:k1]),
                                   _thd(v[:, :, k0:k1]), _thd(out[:, :, q0:q1]),
                                   lse[:, :, q0:q1].transpose(0, 1).reshape(lse.size(1), -1).contiguous(), cu,
                                   longest, scale)
    return tuple(_bhsd_of(g, b) for g in grads[:3])


def _by_query(blocks_: Sequence[_Call]) -> Dict[Tuple[int, int], List[_Call]]:
    """Blocks grouped by the query rows they merge over: a window's band that covers only
    the first rows of a piece (:func:`window_blocks`) joins the block of the whole piece."""
    rows: Dict[Tuple[int, int], List[_Call]] = {}
    for b in sorted(blocks_, key=lambda b: b[0] - b[1]):  # widest first, stable
        whole = next((r for r in rows if r[0] <= b[0] and b[1] <= r[1]), (b[0], b[1]))
        rows.setdefault(whole, []).append(b)
    return rows


def _forward_into(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks_flat: List[int], scale: float,
                  backend: str, out: torch.Tensor, before: Optional[torch.Tensor] = None,
                  before_lse: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of ``q`` ``[b, h, sq, d]`` against ``k``, ``v`` over the blocks, written into
    ``out`` (any strides); returns the log-sum-exp ``[b, h, sq]`` (fp32). Blocks of the same
    query rows are merged by their lse, out = sum_j exp(l_j - lse) o_j, summed in fp32 and
    rounded once as it is written into ``out`` (a block of fewer rows adds to its rows).
    ``before``, ``before_lse``: these queries' attention over other keys (``[b, h, sq, d]``,
    fp32, and its lse), merged in as one more block of each row group the blocks form (the
    caller's blocks cover every row: :func:`attend_into`)."""
    calls = _unflat(blocks_flat)
    _, kernel = _kernel(backend, q, calls)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    for sample, indices in _by_sample(calls).items():
        prior = None if before is None else (_of(before, sample), _of(before_lse, sample))
        _merge_into(kernel, *(_of(t, sample) for t in (q, k, v, out, lse)), [calls[i] for i in indices], scale,
                    prior)
    return lse


def _merge_into(kernel, q, k, v, out, lse, calls: List[_Call], scale: float, before=None) -> None:
    varlen = _varlen_forward(kernel, q, k, v, calls, scale)
    for (q0, q1), row_blocks in _by_query(calls).items():
        results = [(c.q0 - q0, c.q1 - q0, *(varlen.get(c) or kernel.forward(
                        q[:, :, c.q0:c.q1], k[:, :, c.k0:c.k1], v[:, :, c.k0:c.k1], c.causal, scale, c.left)))
                   for c in row_blocks]
        if before is not None:  # the first term: fp32 already, the accumulator starts from it
            results.insert(0, (0, q1 - q0, before[0][:, :, q0:q1], before[1][:, :, q0:q1]))
        if len(results) == 1:
            out[:, :, q0:q1].copy_(results[0][2])
            lse[:, :, q0:q1].copy_(results[0][3])
            continue
        whole = all((a, b) == (0, q1 - q0) for a, b, _, _ in results)
        merged = results[0][3] if whole else results[0][3].clone()
        for a, b, _, o_lse in results[1:]:
            if (a, b) == (0, q1 - q0):
                merged = torch.logaddexp(merged, o_lse)
            else:
                merged[:, :, a:b] = torch.logaddexp(merged[:, :, a:b], o_lse)
        acc = None
        for i, (a, b, o, o_lse) in enumerate(results):
            weight = torch.exp(o_lse - merged[:, :, a:b]).unsqueeze(-1)
            if acc is None:
                acc = o * weight  # fp32: the weight is; the first block covers every row
            elif i < len(results) - 1 or not whole:
                acc[:, :, a:b].addcmul_(o, weight)
            else:  # the last term, in fp32, rounded once into out
                torch.addcmul(acc, o, weight, out=out[:, :, q0:q1])
        if not whole:
            out[:, :, q0:q1].copy_(acc)
        lse[:, :, q0:q1].copy_(merged)


def _forward_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks_flat: List[int], scale: float,
                  backend: str) -> Tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty_like(q)
    return out, _forward_into(q, k, v, blocks_flat, scale, backend, out)


def _backward_into(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, blocks_flat: List[int], first: int, last: int, scale: float, backend: str,
                   dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, zero_untouched: bool) -> None:
    """The kernel backward of ``blocks[first:last]`` with the merged ``out`` and ``lse``;
    ``blocks[:first]`` ran into the same buffers in an earlier call (a schedule that sends
    part of dK/dV while the rest is computed). Each gradient is copied where no block wrote
    before and added where one did: dq (q's dtype) by query rows, dK and dV (the caller's
    fp32 buffers, any strides) by key rows. Query rows with two terms in this call are
    summed by one add, rounded once; with more, in fp32, rounded once. ``zero_untouched``:
    zero the key rows that no block of the whole list touches."""
    every = _unflat(blocks_flat)
    _, kernel = _kernel(backend, q, every)
    for sample, indices in _by_sample(every).items():
        views = [_of(t, sample) for t in (dout, q, k, v, out, lse, dq, dk, dv)]
        _backward_of(kernel, *views, [every[i] for i in indices if i < first],
                     [every[i] for i in indices if first <= i < last], [every[i] for i in indices], scale,
                     zero_untouched)


def _backward_of(kernel, dout, q, k, v, out, lse, dq, dk, dv, earlier: List[_Call], now: List[_Call],
                 every: List[_Call], scale: float, zero_untouched: bool) -> None:
    """:func:`_backward_into` of one sample's blocks (or of blocks of every sample)."""
    keys_written = [(c.k0, c.k1) for c in earlier]
    rows_written = [(c.q0, c.q1) for c in earlier]
    runs = {run[0]: run for run in _varlen_runs(kernel, now, q)}  # a run: one call over its rows and keys
    in_runs = {c for run in runs.values() for c in run}
    dq_parts = []
    for c in now:
        if c in runs:
            q0, q1, k0, k1 = _span(runs[c])
            g = _varlen_backward(kernel, dout, q, k, v, out, lse, runs[c], scale)
        elif c in in_runs:
            continue
        else:
            q0, q1, k0, k1 = c.q0, c.q1, c.k0, c.k1
            g = kernel.backward(dout[:, :, q0:q1], q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1],
                                out[:, :, q0:q1], lse[:, :, q0:q1].contiguous(), c.causal, scale, c.left)
        dq_parts.append((q0, q1, g[0]))
        for a, b, add in _cover(keys_written, k0, k1):
            for buf, grad in ((dk, g[1]), (dv, g[2])):
                if add:
                    buf[:, :, a:b].add_(grad[:, :, a - k0:b - k0])
                else:
                    buf[:, :, a:b].copy_(grad[:, :, a - k0:b - k0])
    lo, hi = min((q0 for q0, _, _ in dq_parts), default=0), max((q1 for _, q1, _ in dq_parts), default=0)
    cuts = sorted({lo, hi, *(x for q0, q1, _ in dq_parts for x in (q0, q1)),
                   *(x for a, b in rows_written for x in (a, b) if lo < x < hi)})
    for a, b in zip(cuts, cuts[1:]):
        terms = [g[:, :, a - q0:b - q0] for q0, q1, g in dq_parts if q0 <= a and b <= q1]
        if not terms:
            continue
        total = terms[0] if len(terms) == 1 else torch.add(*terms) if len(terms) == 2 else _fp32_sum(terms)
        if any(ta <= a and b <= tb for ta, tb in rows_written):
            dq[:, :, a:b].add_(total)
        else:
            dq[:, :, a:b].copy_(total)
    for a, b in _gaps([(c.k0, c.k1) for c in every], dk.size(2)) if zero_untouched else ():
        dk[:, :, a:b].zero_()
        dv[:, :, a:b].zero_()


def _fp32_sum(terms: List[torch.Tensor]) -> torch.Tensor:
    total = terms[0].float()
    for t in terms[1:]:
        total.add_(t)
    return total


def _cover(touched: List[Tuple[int, int]], k0: int, k1: int) -> List[Tuple[int, int, bool]]:
    """Split key rows [k0, k1) into pieces already written (add) or not (copy); record them."""
    cuts = sorted({k0, k1, *(x for a, b in touched for x in (a, b) if k0 < x < k1)})
    pieces = [(a, b, any(ta <= a and b <= tb for ta, tb in touched)) for a, b in zip(cuts, cuts[1:])]
    touched.append((k0, k1))
    return pieces


def _gaps(touched: List[Tuple[int, int]], n: int) -> List[Tuple[int, int]]:
    gaps, pos = [], 0
    for a, b in sorted(touched):
        if a > pos:
            gaps.append((pos, a))
        pos = max(pos, b)
    if pos < n:
        gaps.append((pos, n))
    return gaps


# The fake implementations are the real ones: under FakeTensorMode every kernel call runs
# through its meta function, with the arguments a GPU would get.
_block_attention = torch.library.custom_op("megatron_tsp::block_attention", mutates_args=())(_forward_impl)
_block_attention.register_fake(_forward_impl)
_block_attention_into = torch.library.custom_op("megatron_tsp::block_attention_into",
                                                mutates_args=("out",))(_forward_into)
_block_attention_into.register_fake(_forward_into)
_block_attention_backward = torch.library.custom_op("megatron_tsp::block_attention_backward",
                                                    mutates_args=("dq", "dk", "dv"))(_backward_into)
_block_attention_backward.register_fake(_backward_into)

# the Python implementation of each op (the memory tracker follows them inside)
IMPLEMENTATIONS = {torch.ops.megatron_tsp.block_attention: _forward_impl,
                   torch.ops.megatron_tsp.block_attention_into: _forward_into,
                   torch.ops.megatron_tsp.block_attention_backward: _backward_into}


def _setup_context(ctx, inputs, output):
    q, k, v, blocks_flat, scale, backend = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = (blocks_flat, scale, backend)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    return (*_whole_backward(dout, q, k, v, out, lse, *ctx.args), None, None, None)


def _whole_backward(dout, q, k, v, out, lse, blocks_flat, scale, backend):
    """dq, dK, dV (the inputs' dtypes) of every block, into fresh buffers."""
    dq = torch.empty_like(q)
    dk = torch.empty_like(k, dtype=torch.float32)
    dv = torch.empty_like(v, dtype=torch.float32)
    _block_attention_backward(dout, q, k, v, out, lse, blocks_flat, 0, len(blocks_flat) // 7, scale, backend,
                              dq, dk, dv, True)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


_block_attention.register_autograd(_backward, setup_context=_setup_context)


def _flops_of(q_shape, blocks_flat) -> int:
    b, h, _, d = q_shape
    return 2 * 2 * h * d * sum((b if c.sample < 0 else 1) * visible_pairs_of([c]) for c in _unflat(blocks_flat))


def _flops(q_shape, k_shape, v_shape, blocks_flat, *args, out_shape=None, **kwargs) -> int:
    return _flops_of(q_shape, blocks_flat)


for _op in (torch.ops.megatron_tsp.block_attention, torch.ops.megatron_tsp.block_attention_into):
    register_flop_formula(_op)(_flops)  # each registration wraps the function it is given


@register_flop_formula(torch.ops.megatron_tsp.block_attention_backward)
def _flops_backward(dout_shape, q_shape, k_shape, v_shape, out_shape_, lse_shape, blocks_flat, first, last, *args,
                    out_shape=None, **kwargs) -> int:
    # a flash backward recomputes QK^T and computes dV, dP, dQ, dK: 5 GEMMs to forward's 2
    return _flops_of(q_shape, blocks_flat[7 * first:7 * last]) * 5 // 2


def bhsd(*tensors):
    """Megatron's ``[s, b, h, d]`` as the kernels' ``[b, h, s, d]`` (views)."""
    return tuple(t.permute(1, 2, 0, 3) for t in tensors)


def apply_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """A softmax with one more logit per head, ``sink`` (megatron's ``softmax_type``: 0 for
    off-by-one, a parameter for learnable), whose value vector is zero: it takes its share
    of each row's probability mass, out' = out · σ(lse − sink), lse' = logaddexp(lse, sink).
    ``out`` ``[b, h, sq, d]`` is rescaled in place; returns lse' ``[b, h, sq]``. The kernels'
    backward from (out', lse') is then exact for q, k and v (their softmax Jacobian sums over
    the sink's column too, whose dP is 0); :func:`sink_grad` is the sink's."""
    merged = torch.logaddexp(lse, sink.float().view(1, -1, 1))
    out.mul_(torch.exp(lse - merged).unsqueeze(-1))
    return merged


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """d loss / d sink_h = −Σ_{b,q} p_sink · rowsum(dout ∘ out'), p_sink = exp(sink − lse'),
    from :func:`apply_sink`'s out' and lse' (``[b, h, sq, d]``, ``[b, h, sq]``); fp32 ``[h]``."""
    delta = (dout.float() * out.float()).sum(-1)
    return -(torch.exp(sink.float().view(1, -1, 1) - lse) * delta).sum((0, 2))


class _SinkAttention(torch.autograd.Function):
    """:func:`block_attention` with a sink logit per head (:func:`apply_sink`)."""

    @staticmethod
    def forward(ctx, q, k, v, sink, blocks_flat, scale, backend):
        out, lse = _block_attention(q, k, v, blocks_flat, scale, backend)
        lse = apply_sink(out, lse, sink)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.args = (blocks_flat, scale, backend)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sink = ctx.saved_tensors
        return (*_whole_backward(dout, q, k, v, out, lse, *ctx.args), sink_grad(dout, out, lse, sink).to(sink.dtype),
                None, None, None)


def block_attention(query, keys, values, chunk_ids: Sequence[int], scale: float, backend: str,
                    sink: Optional[torch.Tensor] = None, window: int = -1,
                    documents: Optional[Sequence[Sequence[int]]] = None) -> torch.Tensor:
    """Megatron layout: query ``[sq, b, hq, d]`` (its chunks at ``chunk_ids``), keys/values
    ``[sk, b, hk, d]`` in global order, hq a multiple of hk; ``sink``: a logit per query head
    (:func:`apply_sink`); ``window``: keys before each query it sees (-1: all);
    ``documents``: each sample's document starts (packed documents). Returns ``out [sq, b,
    hq, d]``, differentiable by the op's own backward (from the saved lse)."""
    q, k, v = bhsd(query, keys, values)
    backend, aligned = prepare_backend(backend, query.device, query.dtype, is_fake(query), keys.size(0), window >= 0,
                                       documents is not None, query.size(-1))
    chunk_blocks = _flat(blocks(chunk_ids, q.size(2) // len(chunk_ids), aligned, window, backend, documents))
    if sink is None:
        out, _ = _block_attention(q, k, v, chunk_blocks, float(scale), backend)
    else:
        out = _SinkAttention.apply(q, k, v, sink, chunk_blocks, float(scale), backend)
    return out.permute(2, 0, 1, 3)


def attend_into(query, keys, values, blocks_: Sequence[Block], scale: float, backend: str, out,
                before: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """Megatron layout, for a hand-written schedule: attention over explicit ``blocks_`` (rows
    of query and keys) written into ``out`` ``[sq, b, hq, d]`` (a view of a bigger buffer
    will do); returns the lse ``[b, hq, sq]`` to save for :func:`attend_backward_into`.
    ``before``: these queries' attention over other keys, ``(fp32 [sq, b, hq, d], lse)`` as
    an earlier call into an fp32 ``out`` left it, merged in (summed in fp32, rounded once);
    the blocks must then cover every query row."""
    q, k, v, o = bhsd(query, keys, values, out)
    if before is not None and _gaps([(b[0], b[1]) for b in blocks_], query.size(0)):
        raise ValueError("attend_into: with `before`, the blocks must cover every query row (it is merged into theirs)")
    if before is None:
        return _block_attention_into(q, k, v, _flat(blocks_), float(scale), backend, o)
    return _block_attention_into(q, k, v, _flat(blocks_), float(scale), backend, o, bhsd(before[0])[0], before[1])


def attend_backward_into(d_out, query, keys, values, out, lse, blocks_: Sequence[Block], scale: float,
                         backend: str, d_query, d_keys, d_values, first: int = 0, last: Optional[int] = None,
                         zero_untouched: bool = True) -> None:
    """From the saved forward (each block's kernel backward with the merged lse; no attention
    forward), for ``blocks_[first:last]``, after ``blocks_[:first]`` ran into the same
    buffers: dq into ``d_query`` ``[sq, b, hq, d]`` (the query's dtype), dK and dV into the
    caller's fp32 ``d_keys``, ``d_values`` ``[sk, b, hk, d]`` (views of the reduce-scatter
    buffer), each copied where no block wrote before and added where one did.
    ``zero_untouched``: zero the key rows no block of ``blocks_`` touches (False: they are
    zero already)."""
    last = len(blocks_) if last is None else last
    if not 0 <= first < last <= len(blocks_):
        raise ValueError(f"attend_backward_into: blocks [{first}:{last}] of {len(blocks_)}")
    do, q, k, v, o, dq, dk, dv = bhsd(d_out, query, keys, values, out, d_query, d_keys, d_values)
    _block_attention_backward(do, q, k, v, o, lse, _flat(blocks_), first, last, float(scale), backend, dq, dk, dv,
                              zero_untouched)
