"""The attention op's blocks: which query rows meet which key rows in each kernel call.

Pure Python, so that the geometry can be reasoned about and tested without tensors
(tests/test_zigzag.py proves each list covers every visible (query, key) pair once).
A block is query rows, key rows and causal or not (:data:`Block`). Causal attention of query
chunks over keys in global order (the baselines) is :func:`blocks`: a kernel whose causal
mask is aligned bottom-right when ``sq < sk`` (query ``i`` sees keys up to ``sk - sq + i``:
flash-attn >= 2.1) takes one call per chunk; any other gets two blocks per chunk,

    a *full* block    keys [0, g·c)          no mask            (absent when g = 0)
    a *causal* block  keys [g·c, (g+1)·c)    square, causal

TSP gathers its keys in the zigzag layout (:func:`zigzag_blocks`; which chunks a rank holds
and which key slot a chunk sits in, :func:`rank_chunks` and :func:`zigzag_slot`, are stated
here for every module, so that the geometry needs no torch) and regroups the blocks for
its backward and its overlapped schedules (:func:`zigzag_backward_blocks`,
:func:`zigzag_own_keys_last`, :func:`zigzag_own_keys_first`). Sliding windows and packed
documents are blocks too (:func:`document_blocks`): key pieces out of a query piece's reach
are never called, and a piece the window's edge crosses is a block with a band of diagonals.
:func:`visible_pairs_of` counts the pairs a list computes (the FLOP formulas). The op
(:mod:`megatron_tsp.core.block_attention`) runs the blocks through a kernel
(:mod:`megatron_tsp.core.attention_kernels`).
"""

from __future__ import annotations

import bisect
from functools import lru_cache
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import numpy

# The kernels that take a sliding window themselves (attention_kernels' flash and flash_attn):
# a window's blocks are whole chunks for them. cpu and math are handed a mask of each block, so
# their pieces are cut as short as the window allows (:func:`window_piece`).
WINDOW_NATIVE = ("flash", "flash_attn")

# query rows [q0, q1), key rows [k0, k1), causal; a sliding window's blocks (:func:`document_blocks`)
# carry a sixth entry, ``left`` >= 0: row x of the block sees key y only if y >= x + (k1-k0) -
# (q1-q0) - left (aligned bottom-right, as causal is; in a square block x - y <= left): a band of
# the diagonals (-1: none); packed documents' blocks a seventh, the one sample of the micro-batch
# they are of
Block = Tuple[int, ...]


class Call(NamedTuple):
    """A block with every entry (the op's flat form): ``left`` -1 without a band, ``sample``
    -1 for every sample of the micro-batch."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool
    left: int
    sample: int


def blocks(chunk_ids: Sequence[int], chunk: int, bottom_right: bool = False, window: int = -1,
           backend: str = "math", documents: Optional[Sequence[Sequence[int]]] = None) -> List[Block]:
    """The kernel calls of query chunks against keys in *global order* (chunk i of the
    queries is global chunk ``chunk_ids[i]``): one causal call on the whole key prefix per
    chunk when the kernel aligns its causal mask bottom-right, else a full block (keys
    before the chunk) and a square causal block; with a sliding ``window`` (>= 0) or
    ``documents`` (each sample's document starts), :func:`document_blocks` (a window's
    pieces as ``backend`` wants them, :func:`window_piece`)."""
    if documents is not None:
        return document_blocks([(i * chunk, g) for i, g in enumerate(chunk_ids)], chunk, lambda h: h * chunk,
                               documents, window=window)
    if window >= 0:
        piece = window_piece(chunk, window, backend)
        per = chunk // piece
        queries = [(i * chunk + j * piece, g * per + j) for i, g in enumerate(chunk_ids) for j in range(per)]
        return document_blocks(queries, piece, lambda h: h * piece, window=window)
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


def rank_chunks(size: int, rank: int) -> Tuple[int, int]:
    """The global chunks (of 2D) that TSP rank ``rank`` of ``size`` holds, its first and its
    second: ``rank`` and ``2D-1-rank``, so that every rank does the same causal work (the
    zigzag layout, docs/design.md section 4)."""
    return rank, 2 * size - 1 - rank


def zigzag_slot(size: int, chunk: int) -> int:
    """The key slot of global chunk ``chunk`` in the zigzag layout K/V are gathered into
    (:class:`megatron_tsp.core.kv.GatherKV`): the ranks' second chunks in rank order (slot q
    holds chunk 2D-1-q), then their first chunks (slot D+q holds chunk q)."""
    return size + chunk if chunk < size else 2 * size - 1 - chunk


def rank_slots(size: int, rank: int) -> Tuple[int, int]:
    """The key slots of TSP rank ``rank``'s first and second chunk: D+rank and rank."""
    first, second = rank_chunks(size, rank)
    return zigzag_slot(size, first), zigzag_slot(size, second)


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
    slots (:func:`rank_slots`): ``(a, b, first row of the own slot it lies in, or None)``."""
    own = [slot * chunk for slot in rank_slots(size, rank)]
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
    own = {slot * chunk: i * chunk for i, slot in enumerate(rank_slots(size, rank))}  # slot's first key row -> own row
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
    """The query rows of a window's blocks (:func:`document_blocks`): the whole chunk where the
    kernel takes the window itself (fewest calls), else (the kernel is handed a mask of the
    block) the smallest divisor of the chunk longer than the window."""
    if backend in WINDOW_NATIVE:
        return chunk
    return next(p for p in range(min(window + 1, chunk), chunk + 1) if chunk % p == 0)


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
                    starts: Optional[Sequence[Sequence[int]]] = None, cuts: Sequence[int] = (),
                    window: int = -1) -> List[Block]:
    """The kernel calls of causal attention with a sliding ``window`` (>= 0: megatron's
    ``window_size = (window, 0)``, query i sees keys i-window..i; -1: every earlier key),
    within packed documents where ``starts`` are given (Megatron-LM's
    ``--reset-attention-mask``: a query sees the keys of its own document up to itself;
    ``starts[s]``: where sample s's documents start, sorted, 0 first; None: each sample is
    one document). ``queries``: (first row, global piece index g) of query pieces of
    ``chunk`` rows; the keys of natural piece h sit at rows ``key_row(h)`` ... ``+ chunk``.
    Each query piece is cut at the document starts inside it; a part [a, b) of a document
    sees its own rows causally (a square block, with ``left`` where the window ends inside
    it) and, where the document started in an earlier piece, its keys there, nearest piece
    first, through the pairs with ``key - query >= t`` (``t`` = a minus the piece's first
    key minus the window): all of them (a full block; adjacent ones merged unless the key
    row between them is in ``cuts``), a band (``left = -t``; rows with no key and keys with
    no row cut off, so that no row is empty), or none (skipped, with every earlier piece).
    Nothing outside a document or a window is called. A block is of one sample (seventh
    entry) unless every sample has the same documents."""
    starts = [[0]] if starts is None else starts
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


def _early_first(size: int, chunk: int, forward: List[Block]) -> Tuple[List[Block], int]:
    """The backward's order of blocks none of which spans the slots' halves: those on slots
    0..D-1 (only the rank's chunk 2D-1-r reaches them) first, which then travel."""
    early = [b for b in forward if b[2] < size * chunk]
    return early + [b for b in forward if b[2] >= size * chunk], len(early)


def zigzag_window_blocks(size: int, rank: int, chunk: int, window: int,
                         backend: str) -> Tuple[List[Block], Tuple[List[Block], int]]:
    """:func:`zigzag_blocks` and :func:`zigzag_backward_blocks` of a layer with a sliding
    ``window``: the window's blocks (:func:`document_blocks`) of the rank's two query chunks
    against the zigzag layout, none spanning the slots' halves (:func:`_early_first`)."""
    d, c = size, chunk
    piece = window_piece(c, window, backend)
    per = c // piece
    queries = [(i * c + j * piece, g * per + j) for i, g in enumerate(rank_chunks(d, rank)) for j in range(per)]
    forward = document_blocks(queries, piece, lambda h: zigzag_slot(d, h // per) * c + (h % per) * piece,
                              cuts=(d * c,), window=window)
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
    forward = document_blocks([(i * c, g) for i, g in enumerate(rank_chunks(d, rank))], c,
                              lambda h: zigzag_slot(d, h) * c, starts, cuts=(d * c,), window=window)
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
    band (``left``) what :func:`document_blocks` says."""
    return sum(_pairs(b[1] - b[0], b[3] - b[2], b[4], b[5] if len(b) > 5 else -1) for b in blocks_)  # per sample


def flatten(blocks_: Sequence[Block]) -> List[int]:
    """The blocks as the op's custom ops take them: seven ints a block (:class:`Call`)."""
    return [int(x) for b in blocks_ for x in (*b[:5], *b[5:], *(-1,) * (7 - len(b)))]


def unflatten(flat: Sequence[int]) -> List[Call]:
    """:func:`flatten`'s list back as calls."""
    return [Call(*flat[i:i + 4], bool(flat[i + 4]), *flat[i + 5:i + 7]) for i in range(0, len(flat), 7)]

