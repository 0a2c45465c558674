"""TSP in megatron-core's HybridModel (0.19+): an attention-and-MLP pattern trains exactly like
the world=1 HybridModel of megatron's local modules, and a pattern with a Mamba layer is
refused with one line."""

import pytest
import torch
from megatron.core import parallel_state as mpu
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

import megatron_tsp
from megatron_tsp import versions
from megatron_tsp.run import step as training
from megatron_tsp.run.modes import get_mode

pytestmark = pytest.mark.skipif(not versions.at_least(0, 19), reason="HybridModel is megatron-core 0.19's")

from gpt_models import MICRO_BATCH, MODELS, SEED, SEQ, VOCAB, Step, assert_history_close, batches, tiny_config  # noqa: E402,I001

PATTERN = "*-*-"


def _model(mode, model, pattern):
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_tsp.core.hybrid import get_hybrid_stack_tsp_spec, hybrid_stack_spec

    tsp = mode == "tsp"
    overrides, position_embedding_type = MODELS[model]
    config = tiny_config(**overrides, num_layers=len(pattern.replace("|", "")),
                         tensor_model_parallel_size=2 if tsp else 1, sequence_parallel=tsp)
    spec = get_hybrid_stack_tsp_spec() if tsp else \
        hybrid_stack_spec(get_gpt_layer_local_spec(normalization=config.normalization), WrappedTorchNorm)
    config.finalize_model_grads_func = finalize_model_grads
    torch.manual_seed(SEED)
    model_parallel_cuda_manual_seed(SEED)
    return config, HybridModel(config, spec, VOCAB, SEQ, hybrid_layer_pattern=pattern,
                               position_embedding_type=position_embedding_type,
                               share_embeddings_and_output_weights=True)


def _train(mode, model, steps=3):
    megatron_tsp.initialize_model_parallel(tsp_size=2 if mode == "tsp" else 1)
    config, hybrid = _model(mode, model, PATTERN)
    chunks = [DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True), hybrid)]
    optimizer = training.build_optimizer(chunks, OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0,
                                                                 weight_decay=0.01, use_distributed_optimizer=True))
    args = type("Args", (), dict(tsp_size=2, context_parallel_size=1, seq_length=SEQ))()
    transform = get_mode("tsp").batch_transform(args) if mode == "tsp" else None
    history = []
    for _ in range(steps):
        dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
        mine = batches(2)[dp_rank::dp]
        result = training.train_step(chunks, optimizer, mine, len(mine), SEQ, MICRO_BATCH, batch_transform=transform)
        history.append(Step(training.global_losses([result["loss"]])[0], result["grad_norm"]))
    return history


def _refused(pattern):
    megatron_tsp.initialize_model_parallel(tsp_size=2)
    try:
        _model("tsp", "modern", pattern)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("model", ["modern", "classic"])
def test_tsp_hybrid_model_trains_like_the_single_process_one(ranks, model):
    (reference,) = ranks(1, _train, "single", model)
    for history in ranks(2, _train, "tsp", model):
        assert_history_close(history, reference)


def test_a_mamba_layer_under_tsp_is_one_line(ranks):
    message = ranks(2, _refused, "M*-")[0]
    message = message.split(" when instantiating")[0]  # megatron's build_module adds where it was building
    assert message == ("HybridStackWithNorm: --hybrid-layer-pattern must be attention (*) and MLP (-) layers only "
                       "with --tsp-size 2 (got M*-): Mamba, gated delta net, MLA, DSA and MoE layers are not TSP "
                       "layers; use attention (*) and MLP (-) layers, with | between pipeline stages")
