import subprocess
import sys

import pytest
import torch

from megatron_tsp.core import zigzag


def test_local_positions_hold_chunks_r_and_2d_minus_1_minus_r():
    assert zigzag.local_positions(16, 4, 0).tolist() == [0, 1, 14, 15]
    assert zigzag.local_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    assert zigzag.local_positions(16, 4, 3).tolist() == [6, 7, 8, 9]
    assert zigzag.local_positions(8, 1, 0).tolist() == list(range(8))


@pytest.mark.parametrize("seq,d", [(8, 1), (8, 2), (16, 4), (48, 8)])
def test_permutation_round_trip(seq, d):
    perm = zigzag.permutation(seq, d)
    assert sorted(perm.tolist()) == list(range(seq))
    x = torch.randn(3, seq, 5)
    z = zigzag.to_zigzag(x, d, dim=1)
    assert torch.equal(zigzag.from_zigzag(z, d, dim=1), x)
    # rank r's contiguous slice of the zigzag sequence is exactly its two chunks
    local = seq // d
    for r in range(d):
        assert torch.equal(z[:, r * local : (r + 1) * local], x[:, zigzag.local_positions(seq, d, r)])


def test_every_rank_does_the_same_causal_work():
    seq, d = 64, 4
    work = [int((zigzag.local_positions(seq, d, r) + 1).sum()) for r in range(d)]
    assert len(set(work)) == 1


def test_indivisible_sequence_is_a_clear_error():
    with pytest.raises(ValueError, match=r"--seq-length 10 is not divisible by 2 x --tsp-size = 4"):
        zigzag.local_positions(10, 2, 0)


def test_the_batch_transform_checks_the_sizes_once_when_built_not_per_batch(monkeypatch):
    calls = []
    real = zigzag.check_seq_len
    monkeypatch.setattr(zigzag, "check_seq_len", lambda *a: calls.append(a) or real(*a))
    to_zigzag = zigzag.ZigzagBatch(16, 4)
    batch = {key: torch.arange(32).reshape(2, 16) for key in zigzag.SEQUENCE_KEYS}
    batch["attention_mask"] = torch.rand(2, 1, 16, 16) > 0.5
    outs = [to_zigzag(batch) for _ in range(3)]
    assert calls == [(16, 4)]
    for out in outs:
        for key in zigzag.SEQUENCE_KEYS:
            assert torch.equal(out[key], zigzag.to_zigzag(batch[key], 4, dim=1))
        mask = zigzag.to_zigzag(zigzag.to_zigzag(batch["attention_mask"], 4, dim=-1), 4, dim=-2)
        assert torch.equal(out["attention_mask"], mask)
    with pytest.raises(ValueError, match=r"^--seq-length 10 is not divisible by 2 x --tsp-size = 4"):
        zigzag.ZigzagBatch(10, 2)
    with pytest.raises(ValueError, match="^ZigzagBatch: the batch's sequences have 8 tokens, it was built for 16$"):
        to_zigzag({"tokens": torch.zeros(2, 8, dtype=torch.long)})


@pytest.mark.parametrize("d", [1, 2, 3, 4, 8])
def test_the_ranks_chunks_and_their_key_slots(d):
    """Rank r holds chunks r and 2D-1-r, every chunk once; gathered, rank q's second chunk
    sits in key slot q and its first in slot D+q (GatherKV's two all-gathers, in rank order)."""
    from megatron_tsp.core.block_geometry import rank_chunks, rank_slots, zigzag_slot

    assert sorted(c for r in range(d) for c in rank_chunks(d, r)) == list(range(2 * d))
    natural = [2 * d - 1 - q for q in range(d)] + list(range(d))  # the chunk in each key slot
    assert [zigzag_slot(d, c) for c in natural] == list(range(2 * d))
    for r in range(d):
        assert rank_chunks(d, r) == (r, 2 * d - 1 - r) and rank_slots(d, r) == (d + r, r)
        assert [p // 3 for p in zigzag.local_positions(6 * d, d, r).tolist()[::3]] == list(rank_chunks(d, r))


def _pairs(blocks):
    """Every (query row, key row) a list of blocks computes, once per block that computes it
    (causal and a window's band ``left`` aligned bottom-right)."""
    pairs = []
    for q0, q1, k0, k1, causal, *rest in blocks:
        left, shift = (rest[0] if rest else -1), (k1 - k0) - (q1 - q0)  # causal and the band: bottom-right
        pairs += [(i, j) for i in range(q0, q1) for j in range(k0, k1)
                  if (not causal or j - k0 <= i - q0 + shift) and (left < 0 or j - k0 >= i - q0 + shift - left)]
    return pairs


@pytest.mark.parametrize("d", [2, 3, 4, 8])
def test_backward_blocks_compute_the_forwards_pairs_and_write_each_key_once_but_one_chunk(d):
    """zigzag_backward_blocks regroups the forward's blocks by keys: the same (query, key)
    pairs, each once; the key rows of every block but the last are disjoint (each dK/dV row
    written once, not written and added), the last adds onto one chunk; and the blocks that
    run first finish the key slots 0..D-1 (the other ranks' second chunks), which the last
    does not touch. The forward's blocks added onto r+1 chunks on rank r."""
    from megatron_tsp.core.block_geometry import zigzag_backward_blocks, zigzag_blocks

    c = 2
    for r in range(d):
        blocks, split = zigzag_backward_blocks(d, r, c)
        pairs = _pairs(blocks)
        assert len(pairs) == len(set(pairs))
        assert sorted(pairs) == sorted(_pairs(zigzag_blocks(d, r, c)))
        keys = [set(range(k0, k1)) for _, _, k0, k1, _ in blocks]
        first = set().union(*keys[:-1])
        assert sum(map(len, keys[:-1])) == len(first)
        assert keys[-1] <= first and len(keys[-1]) == c
        assert split == len(blocks) - 1 and min(keys[-1]) >= d * c


@pytest.mark.parametrize("d", [2, 3, 4, 8])
def test_own_keys_last_computes_the_same_pairs_and_sends_only_what_is_final(d):
    """zigzag_own_keys_last: the backward's (query, key) pairs, each once; the blocks before
    the split touch no key row of the rank's own chunks (slots r and D+r), those after touch
    only those: one full block and two causal diagonals, about 1/D of the rank's work."""
    from megatron_tsp.core.block_geometry import zigzag_backward_blocks, zigzag_own_keys_last

    c = 2
    for r in range(d):
        blocks, split = zigzag_own_keys_last(d, r, c)
        assert sorted(_pairs(blocks)) == sorted(_pairs(zigzag_backward_blocks(d, r, c)[0]))
        own = set(range(r * c, (r + 1) * c)) | set(range((d + r) * c, (d + r + 1) * c))
        assert all(not own & set(range(k0, k1)) for _, _, k0, k1, _ in blocks[:split])
        assert all(set(range(k0, k1)) <= own for _, _, k0, k1, _ in blocks[split:])
        assert len(_pairs(blocks[split:])) == c * c + c * (c + 1)


@pytest.mark.parametrize("bottom_right", [False, True])
@pytest.mark.parametrize("d", [2, 3, 4, 8])
def test_own_keys_first_computes_the_same_pairs_own_keys_from_the_ranks_own_rows(d, bottom_right):
    """zigzag_own_keys_first: each query chunk's forward pairs, each once, split into those
    against the rank's own key chunks (slots D+r and r, read from its own K/V: rows 0..c its
    first chunk, c..2c its second) and those against the others' (the zigzag layout, none in
    an own slot); every query row has an own key (its diagonal), so both parts merge by lse."""
    from megatron_tsp.core.block_geometry import zigzag_blocks, zigzag_own_keys_first

    c = 3
    for r in range(d):
        forward = zigzag_blocks(d, r, c, bottom_right)
        by_chunk = [[(b[0] - q0, b[1] - q0, *b[2:]) for b in forward if b[0] == q0] for q0 in (0, c)]
        slot_row = {**{i: (d + r) * c + i for i in range(c)}, **{c + i: r * c + i for i in range(c)}}
        own_rows = set(slot_row.values())
        for blocks_, (mine, others) in zip(by_chunk, zigzag_own_keys_first(d, r, c, by_chunk)):
            mapped = [(i, slot_row[j]) for i, j in _pairs(mine)]
            assert all(j in own_rows for _, j in mapped) and not own_rows & {j for _, j in _pairs(others)}
            together = mapped + _pairs(others)
            assert len(together) == len(set(together)) and sorted(together) == sorted(_pairs(blocks_))
            assert {i for i, _ in mapped} == set(range(c))


@pytest.mark.parametrize("backend", ["flash", "math"])  # a window's pieces: whole chunks, or cut for masks
@pytest.mark.parametrize("d", [2, 3, 4])
def test_window_blocks_compute_each_pair_in_the_window_once(d, backend):
    """A sliding window of w keys: every TSP rank's blocks compute the (query, key) pairs with
    i - w <= j <= i once each, and no other; no block has a row without a key (its lse would
    be -inf); none spans the key slots' halves, and the backward runs first every block on
    slots 0..D-1, which then travel. The FLOP count sees exactly the window's pairs; the
    global-order blocks of the baselines likewise."""
    from megatron_tsp.core.block_geometry import blocks, visible_pairs_of, zigzag_window_blocks

    c = 4
    natural = [2 * d - 1 - q for q in range(d)] + list(range(d))  # the natural chunk in each key slot
    for w in (0, 1, 2, 3, 5, 7, 9, 4 * d * c):
        expected_total = 0
        for r in range(d):
            forward, (backward, split) = zigzag_window_blocks(d, r, c, w, backend)
            position = {row: ch * c + row % c for row, ch in zip(range(2 * c), (r,) * c + (2 * d - 1 - r,) * c)}
            pairs = [(position[i], natural[j // c] * c + j % c) for i, j in _pairs(forward)]
            assert len(pairs) == len(set(pairs))
            queries = sorted(position.values())
            assert set(pairs) == {(i, j) for i in queries for j in range(max(0, i - w), i + 1)}
            assert visible_pairs_of(forward) == len(pairs)
            expected_total += len(pairs)
            for b in forward:
                assert {i for i, _ in _pairs([b])} == set(range(b[0], b[1])), b
                assert b[3] <= d * c or b[2] >= d * c, b
            assert sorted(backward) == sorted(forward)
            assert all(b[2] < d * c for b in backward[:split]) and all(b[2] >= d * c for b in backward[split:])
        seq = 2 * d * c
        assert expected_total == sum(min(i, w) + 1 for i in range(seq))
        for chunk_ids, chunk in (([0], seq), ([1, 2], seq // 4)):
            global_blocks = blocks(chunk_ids, chunk, window=w, backend=backend)
            rows = [g * chunk + a for g in chunk_ids for a in range(chunk)]
            pairs = [(rows[i], j) for i, j in _pairs(global_blocks)]
            assert len(pairs) == len(set(pairs))
            assert set(pairs) == {(i, j) for i in rows for j in range(max(0, i - w), i + 1)}


@pytest.mark.parametrize("piece", [1, 2, 3, 4, 6])
def test_a_window_without_documents_computes_each_pair_once_in_any_layout(piece):
    """document_blocks with a sliding window and no documents: query pieces in any order,
    against key pieces in natural order or scattered (with a cut between slots), compute the
    (query, key) pairs with i - w <= j <= i once each, and no other; every row of a block
    sees a key, no merged block spans a cut, and the FLOP count sees exactly those pairs.
    No documents is one document a sample."""
    from megatron_tsp.core.block_geometry import document_blocks, visible_pairs_of

    n, slots = 6, [3, 5, 0, 2, 4, 1]  # natural key piece h in slot slots[h] of the scattered layout
    queries = [(i * piece, g) for i, g in enumerate([4, 0, 5, 2])]
    query_position = {row + x: g * piece + x for row, g in queries for x in range(piece)}
    for key_row, cuts in ((lambda h: h * piece, ()), (lambda h: slots[h] * piece, (3 * piece,))):
        key_position = {key_row(h) + x: h * piece + x for h in range(n) for x in range(piece)}
        for window in range(n * piece + 1):
            got = document_blocks(queries, piece, key_row, cuts=cuts, window=window)
            assert got == document_blocks(queries, piece, key_row, [[0], [0]], cuts, window)
            pairs = [(query_position[i], key_position[j]) for i, j in _pairs(got)]
            assert len(pairs) == len(set(pairs))
            assert set(pairs) == {(i, j) for i in query_position.values() for j in range(max(0, i - window), i + 1)}
            assert visible_pairs_of(got) == len(pairs)
            for b in got:
                assert {i for i, _ in _pairs([b])} == set(range(b[0], b[1])), b
                assert not any(b[2] < c < b[3] for c in cuts), b


def test_a_window_without_documents_has_the_blocks_window_blocks_had():
    """document_blocks took over window_blocks (a window without documents): the same blocks
    in the same order, so the same kernel calls, merged in the same order. Expected lists
    recorded from window_blocks: bands cut short and square, full blocks merged but across a
    cut, a window of 0, and a TSP rank's zigzag blocks cut into pieces for a mask."""
    from megatron_tsp.core.block_geometry import document_blocks, zigzag_window_blocks

    assert document_blocks([(0, 0), (4, 3)], 4, lambda h: h * 4, window=5) == \
        [(0, 4, 0, 4, True), (4, 8, 12, 16, True), (4, 8, 8, 12, False, 1), (4, 5, 7, 8, False, 0)]
    assert document_blocks([(0, 2), (4, 5)], 4, lambda h: h * 4, cuts=(12,), window=9) == \
        [(0, 4, 8, 12, True), (0, 4, 0, 4, False, 1), (0, 4, 4, 8, False), (4, 8, 20, 24, True),
         (4, 8, 12, 16, False, 1), (4, 5, 11, 12, False, 0), (4, 8, 16, 20, False)]
    assert document_blocks([(0, 1), (2, 6)], 2, lambda h: (h % 4) * 2 + 10 * (h // 4), window=0) == \
        [(0, 2, 2, 4, True, 0), (2, 4, 14, 16, True, 0)]
    forward = [(0, 4, 8, 12, True, 2), (4, 8, 0, 4, True, 2), (4, 6, 6, 8, False, 0)]
    assert zigzag_window_blocks(2, 0, 4, 2, "math") == (forward, ([forward[1], forward[2], forward[0]], 2))


def test_the_block_geometry_imports_no_torch():
    """The geometry is pure Python: its proofs here need no tensors, nor does a tool that
    reads block lists."""
    subprocess.run([sys.executable, "-c", "import sys, megatron_tsp.core.block_geometry; "
                    "assert 'torch' not in sys.modules, 'block_geometry imports torch'"], check=True)


# documents of 32 tokens (2D chunks of 4 at D=4): one longer than a chunk that crosses ranks' chunks, one
# of a token, one starting at a chunk boundary, and a sample that is one document
DOCUMENTS = [[0, 3, 4, 13, 14, 22], [0]]


def _doc_of(starts, position):
    return max(p for p in starts if p <= position)


@pytest.mark.parametrize("window", [-1, 0, 2, 5, 9, 40])
@pytest.mark.parametrize("d", [1, 2, 4])
def test_document_blocks_compute_each_pair_of_a_document_once(d, window):
    """Packed documents (with a sliding window where >= 0): every TSP rank's blocks compute,
    per sample, the (query, key) pairs of one document with key <= query (and at most
    ``window`` before it) once each, and no other; every row of a block sees a key; none
    spans the key slots' halves, and the backward runs first every block on slots 0..D-1.
    The global-order blocks of the baselines likewise; samples with the same documents share
    their blocks (no sample entry)."""
    from megatron_tsp.core.block_geometry import blocks, document_blocks, visible_pairs_of, zigzag_document_blocks

    seq = 32
    c = seq // (2 * d)
    natural = [2 * d - 1 - q for q in range(d)] + list(range(d))

    def expected(rows, starts):
        return {(i, j) for i in rows for j in range(max(_doc_of(starts, i), i - window if window >= 0 else 0), i + 1)}

    def by_sample(block_list, n):
        out = {s: [] for s in range(n)}
        for b in block_list:
            for s in ([b[6]] if len(b) > 6 else range(n)):
                out[s].append(b)
        return out

    for r in range(d):
        if d == 1:
            break
        forward, (backward, split) = zigzag_document_blocks(d, r, c, DOCUMENTS, window)
        position = {row: ch * c + row % c for row, ch in zip(range(2 * c), (r,) * c + (2 * d - 1 - r,) * c)}
        for s, mine in by_sample(forward, len(DOCUMENTS)).items():
            pairs = [(position[i], natural[j // c] * c + j % c) for i, j in _pairs(mine)]
            assert len(pairs) == len(set(pairs))
            assert set(pairs) == expected(position.values(), DOCUMENTS[s])
            assert visible_pairs_of(mine) == len(pairs)
        for b in forward:
            assert {i for i, _ in _pairs([b])} == set(range(b[0], b[1])), b
        assert all(b[3] <= d * c or b[2] >= d * c for b in forward)
        assert sorted(backward) == sorted(forward)
        assert all(b[2] < d * c for b in backward[:split]) and all(b[2] >= d * c for b in backward[split:])
    for chunk_ids, chunk in (([0], seq), ([1, 2], seq // 4), ([0, 3], seq // 4)):
        rows = [g * chunk + a for g in chunk_ids for a in range(chunk)]
        for s, mine in by_sample(blocks(chunk_ids, chunk, window=window, documents=DOCUMENTS), len(DOCUMENTS)).items():
            pairs = [(rows[i], j) for i, j in _pairs(mine)]
            assert len(pairs) == len(set(pairs)) and set(pairs) == expected(rows, DOCUMENTS[s])
    shared = document_blocks([(0, 0)], seq, lambda h: h * seq, [DOCUMENTS[0]] * 2, window=window)
    assert all(len(b) <= 6 for b in shared) and len(shared) == len(DOCUMENTS[0])
