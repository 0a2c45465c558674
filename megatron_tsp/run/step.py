"""The megatron-core training loop pieces shared by tests, benchmarks and ``megatron-tsp train``.

Stock megatron-core throughout: ``GPTModel``, ``DistributedDataParallel``,
``get_megatron_optimizer``, ``get_forward_backward_func`` and ``finalize_model_grads``.
Nothing here knows about TSP except that a batch may need to be put into zigzag order
(``batch_transform``), so the same loop runs TSP and its TP/TP+SP baselines.
"""

from __future__ import annotations

import itertools
import logging
from functools import partial
from typing import Callable, Dict, Iterable, List, Optional

import torch
from megatron.core import parallel_state as mpu
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    TorchFullyShardedDataParallel,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_tsp.core.documents import document_params
from megatron_tsp.run.upstream import fix_torch_fsdp2_grad_sync

Batch = Dict[str, Optional[torch.Tensor]]


def _not_a_choice_of_ours(record: logging.LogRecord) -> bool:
    """megatron-core 0.19 warns on every rank that GPTModel is deprecated in favour of
    HybridModel, and that DDP computes the distributed optimizer's parameter layout itself:
    both are how this loop builds the model, on purpose and on every release."""
    message = str(record.msg)
    return not (message.startswith("GPTModel IS DEPRECATED") or "full_param_layout not provided" in message)


for _name in ("megatron.core.models.gpt.gpt_model", "megatron.core.distributed.distributed_data_parallel"):
    logging.getLogger(_name).addFilter(_not_a_choice_of_ours)


def build_model(
    config: TransformerConfig,
    layer_spec: ModuleSpec,
    vocab_size: int,
    device: torch.device,
    max_sequence_length: int,
    position_embedding_type: str = "rope",
    share_embeddings_and_output_weights: bool = True,
    ddp_config: Optional[DistributedDataParallelConfig] = None,
    fsdp: bool = False,
) -> List[DistributedDataParallel]:
    """One ``GPTModel`` for this pipeline stage on ``device``, wrapped in megatron DDP, or with
    ``fsdp`` in megatron's torch FSDP2 wrapper over the data-parallel x context-parallel ranks
    (Megatron-LM's ``--use-torch-fsdp2``: each layer's weights all-gathered as it runs), a list
    of chunks. With ``config.use_cpu_initialization`` the model is built on the CPU and, as
    Megatron-LM's ``get_model`` does, moved to the device before DDP lays its parameters and
    gradients out in buffers there; otherwise every tensor must have been created there (a
    module that initialises on the CPU and is moved afterwards costs the host the full
    tensor, at 7B scale)."""
    config.finalize_model_grads_func = finalize_model_grads
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=mpu.is_pipeline_first_stage(),
        post_process=mpu.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        position_embedding_type=position_embedding_type,
    )
    misplaced = [(name, t.device) for name, t in itertools.chain(model.named_parameters(), model.named_buffers())
                 if t.device != device]
    if misplaced and not config.use_cpu_initialization:
        name, where = misplaced[0]
        raise RuntimeError(f"{name} was created on {where}, not on {device}: with GPU initialisation every "
                           "parameter and buffer is created on the device")
    if misplaced:
        model.to(device)
    # bf16/fp16 runs create their parameters in that dtype (config.params_dtype); megatron's
    # Float16Module would only cast them again (and cannot, under the memory planner's
    # FakeTensorMode).
    ddp_config = ddp_config or DistributedDataParallelConfig()
    if fsdp:  # every rank built the same weights (one seed, CPU initialisation); each keeps its shard
        fix_torch_fsdp2_grad_sync()
        return [TorchFullyShardedDataParallel(config, ddp_config, model)]
    ddp = DistributedDataParallel(config, ddp_config, model)
    # Same initial weights on every data-parallel replica, as Megatron-LM does.
    ddp.broadcast_params()
    return [ddp]


def unwrap(chunk: torch.nn.Module) -> GPTModel:
    """The GPTModel inside DDP or FSDP."""
    while isinstance(chunk, (DistributedDataParallel, TorchFullyShardedDataParallel)):
        chunk = chunk.module
    return chunk


def build_optimizer(model: List[DistributedDataParallel], optimizer_config: OptimizerConfig,
                    use_gloo_process_groups: bool = True):
    return get_megatron_optimizer(optimizer_config, model, use_gloo_process_groups=use_gloo_process_groups)


def masked_mean_loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Mean of the per-token losses over the tokens the mask keeps.

    Under context parallelism a rank holds part of each sequence: it returns its share
    (local sum over the *global* token count); megatron's schedule scales it by the CP size
    and DDP averages over DP x CP, so the gradient is that of the global mean.
    """
    losses = output_tensor.float().view(-1)
    mask = loss_mask.float().view(-1)
    count = mask.sum()
    cp_group = mpu.get_context_parallel_group()
    if cp_group.size() > 1:
        torch.distributed.all_reduce(count, group=cp_group)
    loss = torch.sum(losses * mask) / count.clamp(min=1.0)
    report = loss.detach().clone()  # clone: the schedule scales the loss in place
    if cp_group.size() > 1:
        torch.distributed.all_reduce(report, group=cp_group)
    return loss, {"lm loss": report}


def make_forward_step(batch_transform: Optional[Callable[[Batch], Batch]] = None, documents_eod: Optional[int] = None):
    """A megatron ``forward_step_func`` over an iterator of batch dicts; ``documents_eod``:
    attend within the documents this token ends (packed documents, read from the tokens in
    natural order, before ``batch_transform``: :mod:`megatron_tsp.core.documents`), from the
    batch's ``host_tokens`` where it has them (:func:`megatron_tsp.run.data.microbatches`: a
    GPU's tokens would be read with a device sync per micro-batch)."""

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        host_tokens = batch.pop("host_tokens", batch["tokens"])
        documents = {}
        if documents_eod is not None:
            documents["packed_seq_params"] = document_params(host_tokens, documents_eod,
                                                             mpu.get_context_parallel_group())
        if batch_transform is not None:
            batch = batch_transform(batch)
        output = model(
            batch["tokens"],
            batch["position_ids"],
            batch.get("attention_mask"),
            labels=batch["labels"],
            **documents,
        )
        return output, partial(masked_mean_loss, batch["loss_mask"])

    return forward_step


def train_step(
    model: List[DistributedDataParallel],
    optimizer,
    microbatches: Iterable[Batch],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    batch_transform: Optional[Callable[[Batch], Batch]] = None,
    documents_eod: Optional[int] = None,
) -> Dict[str, float]:
    """One optimizer step over ``num_microbatches``: ``loss``, this rank's mean loss over its
    micro-batches as a tensor on the model's device (zero off the last pipeline stage; read
    no value here, so that the host does not wait for the device), the grad norm and whether
    the update was applied. :func:`global_losses` reduces the losses of several steps."""
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=make_forward_step(batch_transform, documents_eod),
        data_iterator=iter(microbatches),
        model=model,
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=False,
    )
    update_successful, grad_norm, _ = optimizer.step()
    if mpu.is_pipeline_last_stage():
        loss = torch.stack([x["lm loss"].reshape(()).float() for x in losses]).mean()
    else:
        loss = torch.zeros((), device=next(model[0].parameters()).device)
    return {
        "loss": loss,
        "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
        "update_successful": bool(update_successful),
    }


def global_losses(losses: List[torch.Tensor]) -> List[float]:
    """The losses of several steps (:func:`train_step`'s), each averaged over data-parallel
    replicas and taken from the last pipeline stage: two all-reduces on the device for all
    of them, then one read by the host."""
    stacked = torch.stack(losses)
    torch.distributed.all_reduce(stacked, group=mpu.get_pipeline_model_parallel_group())
    torch.distributed.all_reduce(stacked, group=mpu.get_data_parallel_group())
    return (stacked / mpu.get_data_parallel_world_size()).tolist()
