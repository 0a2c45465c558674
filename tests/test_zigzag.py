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


def test_a_batch_is_checked_and_permuted_once_not_per_key_and_rank(monkeypatch):
    calls = []
    real = zigzag.check_seq_len
    monkeypatch.setattr(zigzag, "check_seq_len", lambda *a: calls.append(a) or real(*a))
    batch = {key: torch.arange(32).reshape(2, 16) for key in zigzag.SEQUENCE_KEYS}
    batch["attention_mask"] = torch.ones(2, 1, 16, 16, dtype=torch.bool)
    out = zigzag.zigzag_batch(batch, 4)
    assert calls == [(16, 4)]
    for key in zigzag.SEQUENCE_KEYS:
        assert torch.equal(out[key], zigzag.to_zigzag(batch[key], 4, dim=1))


def _pairs(blocks):
    """Every (query row, key row) a list of blocks computes, once per block that computes it."""
    pairs = []
    for q0, q1, k0, k1, causal in blocks:
        pairs += [(i, j) for i in range(q0, q1) for j in range(k0, k1)
                  if not causal or j - k0 <= i - q0]  # causal blocks are square
    return pairs


@pytest.mark.parametrize("d", [2, 3, 4, 8])
def test_backward_blocks_compute_the_forwards_pairs_and_write_each_key_once_but_one_chunk(d):
    """zigzag_backward_blocks regroups the forward's blocks by keys: the same (query, key)
    pairs, each once; the key rows of every block but the last are disjoint (each dK/dV row
    written once, not written and added), the last adds onto one chunk; and the blocks that
    run first finish the key slots 0..D-1 (the other ranks' second chunks), which the last
    does not touch. The forward's blocks added onto r+1 chunks on rank r."""
    from megatron_tsp.core.block_attention import zigzag_backward_blocks, zigzag_blocks

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
