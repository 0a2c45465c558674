"""Tiny GPT models trained the same way in every parallel mode (shared by the tests).

``run(mode, model, ...)`` executes inside one rank of a pool: it sets up the process groups,
builds megatron-core's GPTModel with the stock local spec (``single``, ``tp``) or the TSP
spec (``tsp``), wraps it in megatron DDP with the distributed optimizer and trains a few
Adam steps through ``get_forward_backward_func``. Data-parallel replicas take disjoint
micro-batches of the same global batch, so every mode sees the same data.
"""

from types import SimpleNamespace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

import megatron_tsp
from megatron_tsp.core import vocab as vocab_layout
from megatron_tsp.run import checkpointing
from megatron_tsp.run import step as training
from megatron_tsp.run.data import make_batch
from megatron_tsp.run.modes import get_mode

VOCAB = 128
SEQ = 32
MICRO_BATCH = 2
SEED = 1234

MODELS = {
    # RoPE, GQA, SwiGLU, RMSNorm, no bias
    "modern": (dict(num_query_groups=4, gated_linear_unit=True, activation_func=F.silu,
                    normalization="RMSNorm", add_bias_linear=False), "rope"),
    # GELU, LayerNorm, bias, learned absolute positions
    "classic": (dict(activation_func=F.gelu, normalization="LayerNorm", add_bias_linear=True),
                "learned_absolute"),
}


def tiny_config(**overrides) -> TransformerConfig:
    kwargs = dict(
        num_layers=2, hidden_size=64, num_attention_heads=8, ffn_hidden_size=128,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=torch.float32, pipeline_dtype=torch.float32,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


EOD = VOCAB - 1
# where each sample's documents end (an EOD token), SEQ 32: documents of 3 tokens, 1, 9 (from a chunk boundary at
# D=4, across ranks), 9 and 10; and 16 and 16 (the boundary of D=2's chunks)
DOCUMENT_ENDS = ([2, 3, 12, 21], [15])


def batches(n, seq=SEQ, micro_batch=MICRO_BATCH, vocab=VOCAB, seed=0, documents=False, mask_window=None):
    """``n`` deterministic micro-batches; the last quarter of each sequence is masked out.
    ``documents``: packed documents ending at :data:`DOCUMENT_ENDS`, with what Megatron-LM's
    dataset makes of them (``--reset-position-ids --reset-attention-mask --eod-mask-loss``):
    positions restarting per document, EOD not a target, and the ``[b, 1, S, S]`` mask, which
    hides also what is more than ``mask_window`` tokens back where given."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    out = []
    for i in range(n):
        batch = make_batch(micro_batch, seq, vocab, 1000 * seed + i, torch.device("cpu"))
        batch["loss_mask"][:, -seq // 4 :] = 0.0
        if documents:
            tokens = batch["tokens"]
            tokens[tokens == EOD] = 0
            for sample in range(micro_batch):
                tokens[sample, DOCUMENT_ENDS[sample % len(DOCUMENT_ENDS)]] = EOD
            made = [_get_ltor_masks_and_position_ids(t, EOD, True, True, True, True) for t in tokens]
            batch["attention_mask"] = torch.stack([m for m, _, _ in made])
            if mask_window is not None:
                position = torch.arange(seq)
                batch["attention_mask"] |= position.view(-1, 1) - position.view(1, -1) > mask_window
            batch["loss_mask"] = batch["loss_mask"] * torch.stack([lm for _, lm, _ in made])
            batch["position_ids"] = torch.stack([p for _, _, p in made])
        out.append(batch)
    return out


class Step(NamedTuple):
    loss: float
    grad_norm: float


def setup(mode, model="modern", tsp=1, tp=1, cp=1, pp=1, recompute=None, overlap_grad_reduce=False,
          use_distributed_optimizer=True, block_spec=False, init=True, grad_reduce_in_fp32=False,
          with_optimizer=True, ring_mlp=False, lookahead=1, per_call=0, mlp_shards=0, ep=None, vocab="sequence",
          tied=True,
          **config_overrides):
    """Process groups (unless ``init`` is false), model (DDP-wrapped chunks), optimizer and
    batch transform for ``single`` (the world=1 reference: megatron's stock local spec) or a
    mode of ``megatron_tsp.run.modes`` (its layers and batch transform, as training builds
    them; ``block_spec=False`` gives TSP the bare layer spec Megatron-LM's ``--spec`` uses);
    ``config_overrides`` go to the TransformerConfig; ``ep``: mixture-of-experts, its experts
    over ``ep`` model-parallel ranks, each whole; ``vocab``: TSP's vocabulary layout
    (:mod:`megatron_tsp.core.vocab`); ``tied``: the output layer shares the
    embedding's weight; ``cp-fsdp``: CP ``cp`` under megatron's torch FSDP2 (untied, as
    Megatron-LM requires, and no distributed optimizer). The one builder of the tests' GPT models."""
    size = tsp if mode == "tsp" else tp
    fsdp = mode == "cp-fsdp"
    if fsdp:
        tied, use_distributed_optimizer = False, False
        config_overrides.setdefault("transformer_impl", "local")
    ring = mode.endswith("-ring") or ring_mlp  # ring_mlp: beside context parallelism (tp-cp)
    experts = {} if ep is None else dict(expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    if init and mode == "tsp":
        megatron_tsp.initialize_model_parallel(tsp_size=tsp, pipeline_model_parallel_size=pp, **experts)
    elif init:
        megatron_tsp.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                               pipeline_model_parallel_size=pp, ring_mlp=ring, **experts)
    overrides, position_embedding_type = MODELS[model]
    extra = {}
    if recompute:  # "full", "selective" or "selective:mod1,mod2" (megatron's recompute_modules)
        granularity, _, modules = recompute.partition(":")
        extra = dict(recompute_granularity=granularity)
        if modules:
            extra.update(recompute_modules=modules.split(","))
        if recompute == "full":
            extra.update(recompute_method="uniform", recompute_num_layers=1)
    config = tiny_config(**dict(dict(overrides, **extra, tensor_model_parallel_size=size,
                                     pipeline_model_parallel_size=pp, context_parallel_size=cp,
                                     sequence_parallel=(mode == "tsp" and tsp > 1) or mode.startswith("tp-sp")
                                     or (mode == "tp-cp" and tp > 1)), **experts, **config_overrides))
    args = SimpleNamespace(tsp_size=size if mode == "tsp" else 1, context_parallel_size=cp, qk_layernorm=False,
                           tsp_lookahead=lookahead, tsp_head_groups_per_call=per_call,
                           tsp_mlp_shards_per_call=mlp_shards, ring_mlp=ring, seq_length=SEQ)
    if mode == "single":
        spec = get_gpt_layer_local_spec(normalization=config.normalization, num_experts=config.num_moe_experts)
    elif mode == "tsp" and not block_spec:
        spec = megatron_tsp.get_gpt_layer_tsp_spec()
    else:
        spec = get_mode(mode).spec(args, config, transformer_engine=False)
    torch.manual_seed(SEED)
    model_parallel_cuda_manual_seed(SEED)
    chunks = training.build_model(
        config, spec, VOCAB, torch.device("cpu"), SEQ, position_embedding_type=position_embedding_type,
        share_embeddings_and_output_weights=tied, fsdp=fsdp,
        ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=use_distributed_optimizer,
                                                 overlap_grad_reduce=overlap_grad_reduce,
                                                 grad_reduce_in_fp32=grad_reduce_in_fp32),
    )
    if mode == "tsp":  # as megatron_tsp.run.build does
        for chunk in chunks:
            vocab_layout.apply_vocab_layout(training.unwrap(chunk), vocab)
    optimizer = training.build_optimizer(
        chunks, OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0, weight_decay=0.01,
                                use_distributed_optimizer=use_distributed_optimizer)) if with_optimizer else None
    transform = None if mode == "single" else get_mode(mode).batch_transform(args)
    return chunks, optimizer, transform


def step(chunks, optimizer, transform, global_microbatches=2, seed=0, documents=False, mask=False, mask_window=None):
    """One training step on this rank's share of a fixed global batch (``documents``: packed,
    read from the EOD tokens; ``mask``: packed, through megatron's explicit mask)."""
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    mine = batches(global_microbatches, seed=seed, documents=documents or mask, mask_window=mask_window)[dp_rank::dp]
    if not mask:
        for batch in mine:
            batch["attention_mask"] = None
    result = training.train_step(chunks, optimizer, mine, len(mine), SEQ, MICRO_BATCH,
                                 batch_transform=transform, documents_eod=EOD if documents else None)
    return Step(training.global_losses([result["loss"]])[0], result["grad_norm"])


def run(mode, model="modern", steps=3, global_microbatches=2, load=None, save=None, documents=False,
        mask_window=None, **setup_kwargs):
    """Train ``steps`` steps; return a :class:`Step` per step (the same on every rank).

    ``load``: start from this checkpoint's weights; ``save``: checkpoint the weights first;
    ``documents``: packed documents (:func:`batches`), which the world=1 reference sees as
    megatron's mask (with ``mask_window``: and a window in it) and every other mode as EOD
    tokens.
    """
    chunks, optimizer, transform = setup(mode, model, **setup_kwargs)
    if load:
        checkpointing.load(load, chunks)
    if save:
        checkpointing.save(save, chunks)
    return [step(chunks, optimizer, transform, global_microbatches, documents=documents and (mode != "single"),
                 mask=documents and mode == "single", mask_window=mask_window) for _ in range(steps)]


def assert_history_close(actual, expected, rtol=1e-5):
    assert len(actual) == len(expected)
    for i, ((loss, gn), (ref_loss, ref_gn)) in enumerate(zip(actual, expected)):
        assert abs(loss - ref_loss) <= rtol * abs(ref_loss), f"step {i}: loss {loss} vs {ref_loss}"
        assert abs(gn - ref_gn) <= rtol * abs(ref_gn), f"step {i}: grad norm {gn} vs {ref_gn}"
