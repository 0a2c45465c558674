"""TSP process groups: layout beside PP/DP, and one-line errors before any collective."""

import pytest
import torch.distributed as dist
from megatron.core import parallel_state as mpu

import megatron_tsp
from megatron_tsp.core.sizes import ParallelSizes


def _layout(tsp_size, pp_size):
    megatron_tsp.initialize_model_parallel(tsp_size=tsp_size, pipeline_model_parallel_size=pp_size)
    pgs = megatron_tsp.get_tsp_pg_collection()
    assert pgs.tsp is pgs.tp is megatron_tsp.get_tsp_group()
    return {
        "tsp": dist.get_process_group_ranks(megatron_tsp.get_tsp_group()),
        "tsp_rank": megatron_tsp.get_tsp_rank(),
        "tsp_size": megatron_tsp.get_tsp_world_size(),
        "dp": dist.get_process_group_ranks(mpu.get_data_parallel_group()),
        "pp": dist.get_process_group_ranks(mpu.get_pipeline_model_parallel_group()),
        "sp_size": mpu.get_tensor_model_parallel_world_size(),
    }


def _groups(results, key):
    return sorted({tuple(r[key]) for r in results})


def test_layout_8_ranks_tsp2_pp2(ranks):
    results = ranks(8, _layout, 2, 2)
    assert _groups(results, "tsp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert _groups(results, "dp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert _groups(results, "pp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert [r["tsp_rank"] for r in results] == [0, 1] * 4
    assert all(r["tsp_size"] == 2 == r["sp_size"] for r in results)


def test_layout_8_ranks_tsp8(ranks):
    results = ranks(8, _layout, 8, 1)
    assert _groups(results, "tsp") == [tuple(range(8))]
    assert _groups(results, "dp") == [(r,) for r in range(8)]


@pytest.mark.parametrize(
    "tsp,pp,expected_tsp,expected_dp,expected_pp",
    [
        (2, 1, [(0, 1), (2, 3)], [(0, 2), (1, 3)], [(0,), (1,), (2,), (3,)]),
        (4, 1, [(0, 1, 2, 3)], [(0,), (1,), (2,), (3,)], [(0,), (1,), (2,), (3,)]),
        (2, 2, [(0, 1), (2, 3)], [(0,), (1,), (2,), (3,)], [(0, 2), (1, 3)]),
        (1, 1, [(0,), (1,), (2,), (3,)], [(0, 1, 2, 3)], [(0,), (1,), (2,), (3,)]),
    ],
)
def test_layout_4_ranks(ranks, tsp, pp, expected_tsp, expected_dp, expected_pp):
    results = ranks(4, _layout, tsp, pp)
    assert _groups(results, "tsp") == expected_tsp
    assert _groups(results, "dp") == expected_dp
    assert _groups(results, "pp") == expected_pp


def _errors():
    """Every bad input, on every rank, before any collective (a collective would hang)."""
    messages = []
    for kwargs in (
        dict(tsp_size=3),
        dict(tsp_size=0),
        dict(tsp_size=2, pipeline_model_parallel_size=3),
        dict(tsp_size=2, tensor_model_parallel_size=2),
        dict(tsp_size=2, context_parallel_size=2),
    ):
        try:
            megatron_tsp.initialize_model_parallel(**kwargs)
        except ValueError as exc:
            messages.append(str(exc))
        else:
            messages.append(None)
        assert not mpu.model_parallel_is_initialized()
    megatron_tsp.initialize_model_parallel(tsp_size=2)
    try:
        megatron_tsp.initialize_model_parallel(tsp_size=2)
    except ValueError as exc:
        messages.append(str(exc))
    return messages


def test_bad_input_errors(ranks):
    results = ranks(4, _errors)
    assert all(r == results[0] for r in results)
    not_divisible, zero, pp_not_divisible, with_tp, with_cp, twice = results[0]
    assert "world size 4 (the processes of torch.distributed) is not a multiple" in not_divisible
    assert "--tsp-size" in not_divisible
    assert "--tsp-size must be >= 1" in zero
    assert "--pipeline-model-parallel-size" in pp_not_divisible
    assert "--tensor-model-parallel-size 1" in with_tp
    assert "--context-parallel-size 1" in with_cp
    assert "destroy_model_parallel" in twice
    for message in results[0]:
        assert "\n" not in message


def test_sizes_are_derived_and_checked_locally():
    sizes = ParallelSizes(tsp=2, pp=2, world=8).validate()
    assert (sizes.tensor_slot, sizes.model_parallel, sizes.dp, sizes.sequence_divisor) == (2, 4, 2, 4)
    assert ParallelSizes(tp=4, cp=2, split_tokens=True).sequence_divisor == 4
    assert ParallelSizes(tp=2, split_tokens=True).sequence_divisor == 2 and ParallelSizes(tp=2).sequence_divisor == 1
    with pytest.raises(ValueError, match="world size 6 .* is not a multiple of the model-parallel size 4"):
        ParallelSizes(tsp=4, world=6).validate()


def _plain_tp_has_no_tsp_group():
    megatron_tsp.initialize_model_parallel(tsp_size=1, tensor_model_parallel_size=2)
    try:
        megatron_tsp.get_tsp_group()
    except RuntimeError as exc:
        return str(exc)


def test_plain_tp_has_no_tsp_group(ranks):
    assert "plain tensor parallelism" in ranks(2, _plain_tp_has_no_tsp_group)[0]


def test_uninitialized_errors():
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        megatron_tsp.get_tsp_group()


def _groups_warmed_at_initialization():
    """Which of megatron's groups an initialisation on a device talks on (NCCL creates a
    communicator at its first collective: for the data-parallel group that was inside the
    first step's backward hooks)."""
    import torch

    from megatron_tsp.core import parallel_state as tsp_state

    talked, real = [], dist.all_reduce

    def recording(tensor, *args, group=None, **kwargs):
        talked.append(group)
        return real(tensor, *args, group=group, **kwargs)

    dist.all_reduce = recording
    try:
        megatron_tsp.initialize_model_parallel(tsp_size=2, pipeline_model_parallel_size=2,
                                               device=torch.device("cpu"))
    finally:
        dist.all_reduce = real
    try:
        wanted = {"tsp": tsp_state.get_tsp_group(), "tsp weights": tsp_state.get_weight_group(),
                  "dp": mpu.get_data_parallel_group(), "pp": mpu.get_pipeline_model_parallel_group()}
        return sorted(name for name, group in wanted.items() if any(g is group for g in talked))
    finally:
        megatron_tsp.destroy_model_parallel()


def test_every_group_a_step_talks_on_is_warmed_up(ranks):
    assert ranks(8, _groups_warmed_at_initialization) == [["dp", "pp", "tsp", "tsp weights"]] * 8
