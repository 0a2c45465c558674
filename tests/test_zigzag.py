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
