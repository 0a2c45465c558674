"""Checkpoints move between TSP sizes, D=1 and TP+SP: the next steps' losses carry on.

A TSP=2 run saves model and optimizer after 3 steps and trains 2 more; the same checkpoint
loaded into TSP=2 reproduces those 2 steps bit for bit, and loaded into TP=2+SP, TSP=4 or
D=1 (one rank, or two ranks of data parallelism) reproduces them to 1e-5. TP=2+SP and D=1
checkpoints load back into TSP=2 the same way.
"""

import pytest
from gpt_models import assert_history_close, setup, step

from megatron_tsp.run import checkpointing

BEFORE, AFTER = 3, 2


def _train_save_continue(mode, size, path, **moe):
    chunks, optimizer, transform = setup(mode, "modern", tsp=size, tp=size, **moe)
    for _ in range(BEFORE):
        step(chunks, optimizer, transform)
    checkpointing.save(path, chunks, optimizer, common={"iteration": BEFORE})
    return [step(chunks, optimizer, transform) for _ in range(AFTER)]


def _load_continue(mode, size, path, **moe):
    chunks, optimizer, transform = setup(mode, "modern", tsp=size, tp=size, **moe)
    common, _ = checkpointing.load(path, chunks, optimizer)
    assert common["iteration"] == BEFORE
    return [step(chunks, optimizer, transform) for _ in range(AFTER)]


@pytest.fixture(scope="module")
def tsp2_checkpoint(ranks, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "tsp2")
    return path, ranks(2, _train_save_continue, "tsp", 2, path)[0]


def test_same_layout_resumes_bit_exactly(ranks, tsp2_checkpoint):
    path, expected = tsp2_checkpoint
    for history in ranks(2, _load_continue, "tsp", 2, path):
        assert history == expected


@pytest.mark.parametrize("mode,size,world", [("tp-sp", 2, 2), ("tsp", 4, 4), ("single", 1, 1), ("single", 1, 2)],
                         ids=["tp2-sp", "tsp4", "d1", "d1-dp2"])
def test_other_layouts_resume(ranks, tsp2_checkpoint, mode, size, world):
    path, expected = tsp2_checkpoint
    for history in ranks(world, _load_continue, mode, size, path):
        assert_history_close(history, expected)


@pytest.mark.parametrize("mode,size", [("tp-sp", 2), ("single", 1)], ids=["tp2-sp", "d1"])
def test_other_checkpoints_load_into_tsp(ranks, tmp_path, mode, size):
    path = str(tmp_path / mode)
    expected = ranks(size, _train_save_continue, mode, size, path)[0]
    for history in ranks(2, _load_continue, "tsp", 2, path):
        assert_history_close(history, expected)


@pytest.mark.parametrize("saved,loaded", [("tp-sp", "tp-sp-ring"), ("tp-sp-ring", "tp-sp")],
                         ids=["tp2-sp-into-ring", "ring-into-tp2-sp"])
def test_ring_mlp_checkpoints_move_both_ways(ranks, tmp_path, saved, loaded):
    """The ring MLP keeps TP+SP's parameters, names and sharding: a checkpoint of either
    resumes in the other with the uninterrupted run's losses."""
    path = str(tmp_path / saved)
    expected = ranks(2, _train_save_continue, saved, 2, path)[0]
    for history in ranks(2, _load_continue, loaded, 2, path):
        assert_history_close(history, expected)


MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, moe_aux_loss_coeff=0.01,
           moe_token_dispatcher_type="alltoall", block_spec=True)


@pytest.mark.parametrize("saved,loaded", [(("tsp", 2, 2), ("tp-sp", 2, 2)), (("tsp", 2, 2), ("tsp", 4, 4)),
                                          (("tp-sp", 2, 2), ("tsp", 2, 2)), (("tsp", 2, 2), ("single", 1, 1)),
                                          (("single", 1, 1), ("tsp", 2, 2)), (("tsp", 2, 2), ("tsp", 2, 1)),
                                          (("tsp", 2, 1), ("tp-sp", 2, 2))],
                         ids=["tsp2-into-tp2-sp", "tsp2-ep2-into-tsp4-ep4", "tp2-sp-into-tsp2", "tsp2-ep2-into-d1",
                              "d1-into-tsp2-ep2", "tsp2-ep2-into-tsp2-ep1", "tsp2-ep1-into-tp2-sp-ep2"])
def test_moe_checkpoints_move_between_layouts(ranks, tmp_path, saved, loaded):
    """Mixture-of-experts models (experts folded onto the model-parallel ranks, sharded over EP
    of them): model and optimizer saved in one layout resume in another with the uninterrupted
    run's losses, between expert-parallel sizes and D=1 included, whose optimizer megatron-core
    keeps in one part where 2 ranks keep dense and expert parts."""
    (mode, size, ep), (mode_to, size_to, ep_to) = saved, loaded
    path = str(tmp_path / "moe")
    expected = ranks(size, _train_save_continue, mode, size, path, ep=ep, **MOE)[0]
    for history in ranks(size_to, _load_continue, mode_to, size_to, path, ep=ep_to, **MOE):
        assert_history_close(history, expected)


def _save_prefixed(path):
    """A checkpoint as megatron-tsp saved them before: ``chained_<i>.`` optimizer keys."""
    current = checkpointing.OPTIMIZER_METADATA
    checkpointing.OPTIMIZER_METADATA = checkpointing.PREFIXED_OPTIMIZER_METADATA
    try:  # the worker process runs other tests after this one
        return _train_save_continue("tsp", 2, path, ep=2, **MOE)
    finally:
        checkpointing.OPTIMIZER_METADATA = current


def _load_optimizer_of_another_split(path, **settings):
    from megatron_tsp.errors import CheckpointError

    chunks, optimizer, _ = setup("single", "modern", ep=1, **MOE, **settings)
    try:
        checkpointing.load(path, chunks, optimizer)
    except CheckpointError as exc:
        return str(exc)
    return None


def test_moe_optimizer_state_of_an_older_checkpoint_is_one_line(ranks, tmp_path):
    """A checkpoint saved with ``chained_<i>.`` keys (dense and expert parts, EP > 1) does
    not load into one part (EP = 1): one line, not a KeyError from inside the load."""
    path = str(tmp_path / "moe")
    ranks(2, _save_prefixed, path)
    message = ranks(1, _load_optimizer_of_another_split, path)[0]
    assert "keeps the optimizer state in dense and expert parts" in message and "\n" not in message


def test_moe_optimizer_regrouping_needs_the_distributed_optimizer(ranks, tmp_path):
    """megatron's other optimizers keep the parameters' states in the parts' plain entries,
    which are not regrouped: one line, not a KeyError."""
    path = str(tmp_path / "moe")
    ranks(2, _train_save_continue, "tsp", 2, path, ep=2, use_distributed_optimizer=False, **MOE)
    message = ranks(1, _load_optimizer_of_another_split, path, use_distributed_optimizer=False)[0]
    assert "only the distributed optimizer regroups" in message and "\n" not in message

