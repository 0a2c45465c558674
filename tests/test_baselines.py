"""Stock megatron-core GPT on CPU/gloo: world=1, TP=2, TP=2+SP and TP=4+SP train alike.

These are the baselines TSP is measured against; they also exercise every CPU shim on the
GPTModel + DDP + DistributedOptimizer + get_forward_backward_func path. TP x CP uses the
baseline spec (stock modules, memory-efficient core attention with all-gather CP).
"""

import pytest
from gpt_models import assert_history_close, run


@pytest.fixture(scope="module")
def reference(ranks):
    return ranks(1, run, "single", "classic")[0]


@pytest.mark.parametrize("mode,tp", [("tp", 2), ("tp-sp", 2), ("tp-sp", 4)])
def test_tensor_parallel_matches_single_process(ranks, reference, mode, tp):
    for history in ranks(tp, run, mode, "classic", tp=tp):
        assert_history_close(history, reference)
    assert reference[-1][0] < reference[0][0], "loss should fall over 3 Adam steps"


@pytest.fixture(scope="module")
def modern_reference(ranks):
    return ranks(1, run, "single", "modern")[0]


@pytest.mark.parametrize("tp,cp", [(1, 2), (2, 2)])
def test_tp_cp_baseline_with_flash_core_attention_matches(ranks, reference, tp, cp):
    for history in ranks(tp * cp, run, "tp-cp", "classic", tp=tp, cp=cp):
        assert_history_close(history, reference)


@pytest.mark.parametrize("tp,cp", [(1, 2), (1, 4), (2, 2)])
def test_tp_cp_baseline_matches_on_rope_gqa_swiglu(ranks, modern_reference, tp, cp):
    for history in ranks(tp * cp, run, "tp-cp", "modern", tp=tp, cp=cp):
        assert_history_close(history, modern_reference)


def test_plain_optimizer_matches_distributed_optimizer(ranks, reference):
    (history,) = ranks(1, run, "single", "classic", use_distributed_optimizer=False)
    assert_history_close(history, reference)
