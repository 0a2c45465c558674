"""TSP's vocabulary ends: every rank embeds, projects and scores its own tokens against the
whole vocabulary table, gathered from the rows each rank owns.

megatron's embedding and output layer split the vocabulary V over the tensor-parallel slot
(TSP's group). Under sequence parallelism the *tokens* are split too, so megatron moves
activations at both ends of the model: the embedding's ``[S, b, h]`` output is
reduce-scattered to the token owners, the last hidden states are all-gathered before the
output layer, and backward does the reverse, ``5 S b h (D-1)/D`` elements per micro-batch, none
of it behind compute (:func:`traffic`). The *table* layout moves the table instead (rank p owns rows
``W_p``, exactly megatron's vocab-parallel shard, so parameters and checkpoints do not change):

    W      = all_gather(W_p)                 [V, h]
    e_p    = W[ids_p]                        rank p's tokens' embeddings
    z_p    = y_p W^T                         their logits over the whole vocabulary
    l_p    = CE(z_p, labels_p)               megatron's cross entropy with no collective
    l      = all_gather(l_p)                 the per-token losses [b, S] megatron returns

    dW_p   = reduce_scatter(sum over p's tokens of dW) in fp32, for each end

``2 V h (D-1)/D`` elements in the parameters' dtype and as many in fp32 per micro-batch,
whatever S is. ``auto`` takes the table where it moves fewer bytes than
megatron's sequence-parallel collectives (long sequences, a vocabulary up to a few times
S b); ``sequence`` keeps megatron's layers. The logits a table model returns without
labels are this rank's tokens over the whole vocabulary, ``[b, S/D, V]``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from megatron_tsp.core import comm
from megatron_tsp.core.gemm import gemm_t
from megatron_tsp.core.prefetch import LayerChain
from megatron_tsp.core.streaming import deliver_grads, run_forward_pre_hooks

LAYOUTS = ("auto", "table", "sequence")


def traffic(layout: str, vocab: int, hidden: int, tokens: int, size: int, dtype: torch.dtype,
            positions: int = 0) -> int:
    """Bytes one rank receives per micro-batch at the vocabulary ends in ``layout`` (``tokens``:
    S b; ``positions``: rows of a learned position table, 0 for none). The table: two gathers in
    ``dtype``, two fp32 reduce-scatters, the fp32 losses' gather and, with learned positions,
    the all-reduce of their fp32 gradient (once per step, counted per micro-batch). The
    sequence layout: megatron's five collectives of ``[S, b, h]`` in ``dtype`` (the output
    layer gathers its input again in backward; with learned positions the embedding
    all-reduces, twice a reduce-scatter's bytes) and its cross entropy's three ``[S, b]`` fp32
    all-reduces."""
    share = (size - 1) / size
    width = dtype.itemsize
    if layout == "table":
        return int(share * (2 * vocab * hidden * (width + 4) + 4 * tokens + 2 * 4 * positions * hidden))
    return int(share * ((6 if positions else 5) * tokens * hidden * width + 2 * 3 * 4 * tokens))


def choose(layout: str, vocab: int, hidden: int, tokens: int, size: int, dtype: torch.dtype,
           positions: int = 0) -> str:
    """``table`` or ``sequence``: ``layout`` itself, or for ``auto`` the one that moves fewer
    bytes (``sequence`` on one rank, where neither moves any)."""
    _check(layout)
    if layout != "auto":
        return layout
    if size == 1:
        return "sequence"
    table, sequence = (traffic(each, vocab, hidden, tokens, size, dtype, positions)
                       for each in ("table", "sequence"))
    return "table" if table < sequence else "sequence"


def _check(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"tsp_vocab must be one of {', '.join(LAYOUTS)} (got {layout!r})")


def table_blocker(model: GPTModel) -> Optional[str]:
    """Why ``model`` cannot take the table layout (a class other than the megatron ones it
    replaces, or a setting that needs megatron's own embedding or output layer), or None."""
    config = model.config
    swapped = [(model, GPTModel, TableGPTModel)]
    if model.pre_process:
        swapped.append((model.embedding, LanguageModelEmbedding, TableEmbedding))
    if model.post_process:
        swapped.append((model.output_layer, ColumnParallelLinear, TableOutputLayer))
    for module, base, table in swapped:
        if type(module) not in (base, table):
            return f"{type(module).__name__} (the table layout replaces megatron's {base.__name__})"
    if getattr(model, "mtp_process", False):
        return "multi-token prediction (--mtp-num-layers)"
    if getattr(config, "defer_embedding_wgrad_compute", False):
        return "--defer-embedding-wgrad-compute (megatron's output layer keeps its activations for it)"
    if model.pre_process:
        if getattr(model.embedding, "tokentype_embeddings", None) is not None:
            return "token-type embeddings"
        if not getattr(model.embedding, "scatter_to_sequence_parallel", True):
            return "an embedding that does not scatter the sequence (the model scatters it later)"
    if model.post_process and model.output_layer.bias is not None:
        return "an output layer bias"
    return None


def _post_gather_rows(shard: torch.Tensor, group: dist.ProcessGroup, inflight: comm.InFlight):
    """Start ``all_gather(shard)`` over vocabulary rows: (the ``[V, h]`` buffer, the work)."""
    full = shard.new_empty((shard.size(0) * group.size(),) + tuple(shard.shape[1:]))
    return full, comm.all_gather(full, shard.contiguous(), group, inflight)


def _gather_rows(shard: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    with comm.InFlight() as inflight:
        full, work = _post_gather_rows(shard, group, inflight)
        inflight.wait(work)
    return full


class PrefetchedRows:
    """An all-gather of the output layer's table posted before the output layer runs: by the
    decoder's last TSP module as its forward's last stage starts (:class:`TableGPTModel`), so
    that it travels beside that stage, ahead of the backward's first transfers, instead of
    queueing behind them at the output layer. Registered with the model forward's
    ``inflight``, which waits for it if the forward fails."""

    def __init__(self, shard: torch.Tensor, group: dist.ProcessGroup, inflight: comm.InFlight):
        self.shard, self.inflight = shard, inflight
        with torch.no_grad():  # as every transfer inside an autograd function: gloo writes through views of full
            self.full, self.work = _post_gather_rows(shard, group, inflight)

    def table(self, shard: torch.Tensor) -> Optional[torch.Tensor]:
        """The gathered table of ``shard`` once it has arrived (None: posted for another one)."""
        if shard is not self.shard:
            return None
        self.inflight.wait(self.work)
        return self.full


def _reduce_scatter_rows(full: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    own = full.new_empty((full.size(0) // group.size(),) + tuple(full.shape[1:]))
    with comm.InFlight() as inflight:
        inflight.wait(comm.reduce_scatter(own, full, group, inflight))
    return own


class GatherTableLookup(torch.autograd.Function):
    """e_p = W[ids_p], W = all_gather(W_p) over vocabulary rows.

    Backward: dW = sum over this rank's tokens of de at their ids (fp32, ``index_put_``),
    reduce-scattered so that rank p gets the sum over ranks of its rows' gradient, added to
    megatron's fp32 ``main_grad`` (:func:`deliver_grads`). The gathered table is not kept."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup):
        ctx.group = group
        ctx.save_for_backward(ids, shard)
        return F.embedding(ids, _gather_rows(shard, group))

    @staticmethod
    def backward(ctx, d_embedded):
        ids, shard = ctx.saved_tensors
        full = torch.zeros((shard.size(0) * ctx.group.size(), shard.size(1)), dtype=torch.float32,
                           device=d_embedded.device)
        # index_put_'s accumulation sorts the ids on a GPU: deterministic, where index_add_'s atomics are not
        full.index_put_((ids.reshape(-1),), d_embedded.reshape(-1, shard.size(1)).float(), accumulate=True)
        own = _reduce_scatter_rows(full, ctx.group)
        return None, *deliver_grads([shard], own.view(-1)), None


class GatherTableProjection(torch.autograd.Function):
    """z_p = y_p W^T, W = all_gather(W_p) over vocabulary rows: this rank's tokens' logits
    over the whole vocabulary.

    Backward: dy_p = dz_p W (whole, no collective); dW = dz_p^T y_p summed over this rank's
    tokens inside its GEMM (fp32), reduce-scattered to the row owners and added to their
    ``main_grad``. The gathered table is kept for backward instead of gathered again; it may
    have been posted before (``prefetched``)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup,
                prefetched: Optional[PrefetchedRows] = None):
        table = prefetched.table(shard) if prefetched is not None else None
        if table is None:
            table = _gather_rows(shard, group)
        ctx.group = group
        ctx.save_for_backward(hidden, shard, table)
        return F.linear(hidden, table)

    @staticmethod
    def backward(ctx, d_logits):
        hidden, shard, table = ctx.saved_tensors
        d2d = d_logits.reshape(-1, d_logits.size(-1))
        d_hidden = (d2d @ table).view_as(hidden)
        own = _reduce_scatter_rows(gemm_t(d2d, hidden.reshape(-1, hidden.size(-1))), ctx.group)
        return d_hidden, *deliver_grads([shard], own.view(-1)), None, None


class LocalCrossEntropy(torch.autograd.Function):
    """megatron's vocab-parallel cross entropy over a whole vocabulary, with no collective:
    its own steps (``VocabParallelCrossEntropy``), as it computes them on one rank."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor):
        logits, logits_max = VocabParallelCrossEntropy.calculate_logits_max(logits)
        target_mask, masked_target_1d, predicted, sum_exp, exp_logits = (
            VocabParallelCrossEntropy.calculate_predicted_logits(logits, target, logits_max, 0, logits.size(-1)))
        softmax, loss = VocabParallelCrossEntropy.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)
        ctx.save_for_backward(softmax, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, d_loss):
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_2d, arange_1d, update, grad = VocabParallelCrossEntropy.prepare_gradient_calculation_operands(
            softmax, target_mask)
        return VocabParallelCrossEntropy.calculate_gradients(grad_2d, arange_1d, masked_target_1d, update, grad,
                                                             d_loss), None


def _own(t: torch.Tensor, group: dist.ProcessGroup, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of a whole sequence in zigzag order (``dim``: the sequence's)."""
    s = t.size(dim) // group.size()
    return t.narrow(dim, group.rank() * s, s)


class TableEmbedding(LanguageModelEmbedding):
    """megatron's ``LanguageModelEmbedding`` in the table layout: this rank's tokens of the
    whole zigzag-ordered ``input_ids`` looked up in the gathered table (same parameters).
    Learned positions are looked up locally too; their gradient is then partial per rank and
    megatron's ``finalize_model_grads`` sums it over the group (``sequence_parallel`` on the
    parameter, as for the norms)."""

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, tokentype_ids=None) -> torch.Tensor:
        if tokentype_ids is not None:
            raise NotImplementedError("TSP's table embedding: token types are not supported")
        run_forward_pre_hooks(self.word_embeddings)  # its weight is read, not called: streaming.py
        # looked up in [s, b] order: the activations come out [s, b, h], not transposed after
        embeddings = GatherTableLookup.apply(_own(input_ids, self.tp_group).t(), self.word_embeddings.weight,
                                             self.tp_group)
        if self.add_position_embedding:
            embeddings = embeddings + self.position_embeddings(_own(position_ids, self.tp_group).t())
        if self.config.fp32_residual_connection:
            embeddings = embeddings.float()
        with tensor_parallel.get_cuda_rng_tracker().fork():  # per rank, as megatron's sequence-parallel dropout
            return self.embedding_dropout(embeddings)


class TableOutputLayer(ColumnParallelLinear):
    """megatron's output layer in the table layout: ``[S/D, b, h]`` -> ``[S/D, b, V]``."""

    prefetched: Optional[PrefetchedRows] = None  # its table's gather, posted by the model

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None, runtime_gather_output=None):
        if runtime_gather_output:
            raise NotImplementedError("TSP's table layout: gathered logits (runtime_gather_output) are not supported")
        prefetched, self.prefetched = self.prefetched, None
        return GatherTableProjection.apply(input_, self.weight if weight is None else weight, self.tp_group,
                                           prefetched), None


class TableGPTModel(GPTModel):
    """megatron's ``GPTModel`` whose loss is this rank's tokens' cross entropy, all-gathered
    into the ``[b, S]`` losses megatron's loss functions take. The gather's backward keeps
    this rank's part (every rank computes the same loss from them).

    With ``table_chain`` (the layer chain of the model's TSP layers, where they overlap their
    transfers: :func:`apply_vocab_layout`), the output layer's table gather is posted by the
    decoder's last TSP module as its last stage starts (:meth:`LayerChain.at_forward_end`):
    there it travels beside that stage's compute, ahead of the backward's first transfers
    that the module posts next, and the output layer's parameters are read when the
    distributed optimizer's last bucket has been gathered (``--overlap-param-gather``), not
    before the decoder, and the first layer's transfers do not queue behind it."""

    table_chain: Optional[LayerChain] = None

    def forward(self, *args, **kwargs):
        chain = self.table_chain
        if chain is None:
            return super().forward(*args, **kwargs)
        with comm.InFlight() as inflight:
            chain.at_forward_end(lambda: self._post_table(inflight))
            try:
                return super().forward(*args, **kwargs)
            finally:
                chain.at_forward_end(None)
                self.output_layer.prefetched = None

    def _post_table(self, inflight: comm.InFlight) -> None:
        run_forward_pre_hooks(self.output_layer)  # its weight is read before it is called
        weight = (self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights
                  else self.output_layer.weight)
        self.output_layer.prefetched = PrefetchedRows(weight, self.output_layer.tp_group, inflight)

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        group = self.pg_collection.tp
        loss = LocalCrossEntropy.apply(logits, _own(labels, group).transpose(0, 1).contiguous())
        loss = gather_from_sequence_parallel_region(loss, tensor_parallel_output_grad=False, group=group)
        return loss.transpose(0, 1).contiguous()


def _overlapping_chain(decoder: torch.nn.Module) -> Optional[LayerChain]:
    """The layer chain of ``decoder``'s TSP modules where they overlap their transfers (None:
    no TSP module, or no overlap)."""
    return next((m.chain for m in decoder.modules()
                 if isinstance(getattr(m, "chain", None), LayerChain) and getattr(m, "overlap_comm", False)), None)


def apply_vocab_layout(model: GPTModel, layout: str, tokens: Optional[int] = None) -> str:
    """Put ``model`` (one pipeline stage of a TSP model) in ``layout`` and return the layout it
    took: ``table`` swaps its embedding, output layer and loss for the table layout's
    (parameters untouched, so this may run after DDP wrapped it, and again: it is idempotent);
    ``sequence`` leaves megatron's; ``auto`` (which needs ``tokens``, S b of a micro-batch)
    takes what :func:`choose` does, and ``sequence`` where :func:`table_blocker` objects. The
    output layer's table is gathered ahead (:class:`TableGPTModel`) where the model's TSP
    layers overlap their transfers."""
    _check(layout)
    asked = layout
    if layout == "auto":
        if tokens is None:
            raise ValueError("apply_vocab_layout: auto needs tokens (sequence length x micro-batch size)")
        # every stage of a pipeline decides alike: from what the model is, not from what the stage holds
        positions = model.max_sequence_length if model.position_embedding_type == "learned_absolute" else 0
        layout = choose(layout, model.vocab_size, model.config.hidden_size, tokens, model.pg_collection.tp.size(),
                        model.config.params_dtype, positions)
    if layout == "sequence":
        return layout
    blocker = table_blocker(model)
    if blocker is not None and asked == "auto":
        return "sequence"
    if blocker is not None:
        raise ValueError(f"--tsp-vocab table cannot be used with {blocker}; use --tsp-vocab sequence")
    if model.pre_process:
        model.embedding.__class__ = TableEmbedding  # exactly megatron's class: table_blocker checked
        if model.embedding.add_position_embedding:
            model.embedding.position_embeddings.weight.sequence_parallel = True
    if model.post_process:
        model.output_layer.__class__ = TableOutputLayer
        model.__class__ = TableGPTModel
        model.table_chain = _overlapping_chain(model.decoder)  # found once, not at every forward
    return layout
