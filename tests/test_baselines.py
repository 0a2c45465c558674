"""Stock megatron-core GPT on CPU/gloo: world=1, TP=2, TP=2+SP and TP=4+SP train alike.

These are the baselines TSP is measured against; they also exercise every CPU shim on the
GPTModel + DDP + DistributedOptimizer + get_forward_backward_func path.
"""

import pytest
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

import megatron_tsp
from gpt_models import assert_history_close, tiny_config, train


def _train_baseline(tp, sp, use_distributed_optimizer=True):
    megatron_tsp.initialize_model_parallel(tsp_size=1, tensor_model_parallel_size=tp)
    config = tiny_config(tensor_model_parallel_size=tp, sequence_parallel=sp)
    return train(config, get_gpt_layer_local_spec(), use_distributed_optimizer=use_distributed_optimizer)


@pytest.fixture(scope="module")
def reference(ranks):
    (history,) = ranks(1, _train_baseline, 1, False)
    return history


@pytest.mark.parametrize("tp,sp", [(2, False), (2, True), (4, True)])
def test_tensor_parallel_matches_single_process(ranks, reference, tp, sp):
    results = ranks(tp, _train_baseline, tp, sp)
    for history in results:
        assert_history_close(history, reference)
    assert reference[-1][0] < reference[0][0], "loss should fall over 3 Adam steps"


def test_plain_optimizer_matches_distributed_optimizer(ranks, reference):
    (history,) = ranks(1, _train_baseline, 1, False, use_distributed_optimizer=False)
    assert_history_close(history, reference)
