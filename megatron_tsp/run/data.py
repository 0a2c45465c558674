"""Training data through megatron-core's datasets: mock data or indexed (.bin/.idx) corpora.

``make_tiny_corpus`` writes a small byte-level corpus in megatron's indexed-dataset format
(generated, so nothing is downloaded or shipped): English-like sentences and sums, enough
structure that a tiny model's loss visibly falls within a minute on a CPU. Batches come in
Megatron's order: iteration i, micro-batch m, data-parallel rank r reads samples
``i*GBS + m*mbs*DP + r*mbs ...``, so a resumed run sees exactly the data it would have seen.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import random
import sys
from typing import Dict, List, Optional

import numpy
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

from megatron_tsp import versions
from megatron_tsp.core.sizes import ParallelSizes
from megatron_tsp.errors import ConfigError, DataError

TINY_CORPUS_NAME = "tsp-tiny-corpus"
_INDEX_HEADER = b"MMIDIDX\x00\x00"  # the first bytes of megatron-core's .idx (indexed_dataset._INDEX_HEADER)
BYTE_VOCAB = 256

_SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "a small bird", "the teacher",
             "our neighbour", "the river", "a young girl", "the machine"]
_VERBS = ["sees", "likes", "follows", "finds", "carries", "watches", "builds", "remembers"]
_OBJECTS = ["the red ball", "a long road", "the blue house", "an apple", "the garden",
            "a quiet song", "the last train", "a wooden box"]
_ENDINGS = ["in the morning", "after the rain", "every day", "near the sea", "at night", ""]


def _sentence(rng: random.Random) -> str:
    if rng.random() < 0.25:
        a, b = rng.randrange(100), rng.randrange(100)
        return f"{a} plus {b} is {a + b}."
    words = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS), rng.choice(_ENDINGS)]
    text = " ".join(w for w in words if w)
    return text[0].upper() + text[1:] + "."


def make_tiny_corpus(prefix: str, num_docs: int = 2000, seed: int = 0) -> str:
    """Write ``prefix.bin``/``prefix.idx`` (bytes as token ids, each document ended by the
    end-of-document id :data:`BYTE_VOCAB`, the NullTokenizer's at ``--vocab-size 256``, as
    Megatron-LM's ``preprocess_data.py --append-eod`` ends them); return ``prefix``."""
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    rng = random.Random(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for _ in range(num_docs):
        text = " ".join(_sentence(rng) for _ in range(rng.randint(3, 12)))
        builder.add_item(torch.tensor(list(text.encode("utf-8")) + [BYTE_VOCAB], dtype=torch.int64))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def ensure_corpus(prefixes: List[str]) -> None:
    """Generate the built-in tiny corpus where a prefix names it and it does not exist yet."""
    for prefix in prefixes:
        if os.path.basename(prefix) == TINY_CORPUS_NAME and not os.path.exists(prefix + ".idx"):
            try:
                make_tiny_corpus(prefix)
            except OSError as exc:  # a read-only working directory, for the default runs/data/
                raise DataError(f"--data-path {prefix}: the built-in corpus is written there on first use, and that "
                                f"failed ({exc.strerror or exc}); run from a writable folder, or give --data-path "
                                "a writable place") from None


def tokenizer_for(args):
    """Byte-level corpora and mock data use megatron's NullTokenizer (ids as given), with
    megatron-core 0.16's vocabulary on every release: ``--vocab-size`` ids plus the
    end-of-document id after them (:func:`megatron_tsp.versions.null_tokenizer`)."""
    if args.tokenizer_type != "NullTokenizer":
        raise ConfigError(f"'tokenizer_type' (--tokenizer-type) {args.tokenizer_type!r} is not supported by "
                          "megatron-tsp train: use NullTokenizer (pre-tokenized ids), or Megatron-LM's pretrain_gpt.py")
    return versions.null_tokenizer(args.vocab_size)


def check_corpus(prefixes: List[str], vocab_size: int, eod: Optional[int] = None) -> None:
    """Each ``--data-path`` prefix is a complete megatron indexed dataset whose token ids are
    below ``vocab_size`` and, where documents are packed (``eod``), that holds the
    end-of-document token: one :class:`DataError` line otherwise. Reads the ``.bin`` once
    (memory-mapped, about a second per GB)."""
    for prefix in prefixes:
        idx, bin_ = prefix + ".idx", prefix + ".bin"
        missing = [p for p in (idx, bin_) if not os.path.isfile(p)]
        if missing:
            raise DataError(f"--data-path {prefix}: {' and '.join(missing)} not found (a prefix names a "
                            "megatron .bin/.idx pair)")
        if os.path.getsize(bin_) == 0:
            raise DataError(f"{bin_}: empty, the dataset holds no tokens")
        index = _read_index(prefix)
        if len(index) == 0:
            raise DataError(f"{idx}: the index lists no sequences (an empty dataset)")
        lengths = numpy.asarray(index.sequence_lengths, dtype=numpy.int64)
        pointers = numpy.asarray(index.sequence_pointers, dtype=numpy.int64)
        documents = numpy.asarray(index.document_indices, dtype=numpy.int64)
        consistent = (pointers[0] == 0 and numpy.array_equal(numpy.diff(pointers), lengths[:-1] * index.dtype_size)
                      and documents[0] == 0 and documents[-1] == len(index) and numpy.all(numpy.diff(documents) >= 0))
        if not consistent:
            raise DataError(f"{idx}: its sequence offsets, lengths and document boundaries disagree (a damaged "
                            "index); rebuild the dataset")
        tokens = int(lengths.sum())
        size = os.path.getsize(bin_)
        if size != tokens * index.dtype_size:
            what = "truncated" if size < tokens * index.dtype_size else "longer than its index: another corpus's .bin?"
            raise DataError(f"{bin_}: {size} bytes, its index describes {tokens * index.dtype_size} ({what}); "
                            "use the .bin and .idx written together, or rebuild the dataset")
        ids = numpy.memmap(bin_, dtype=index.dtype, mode="r", shape=(tokens,))
        largest = max(int(ids[i:i + (1 << 26)].max()) for i in range(0, tokens, 1 << 26))
        if largest >= vocab_size:
            raise DataError(f"{bin_}: token id {largest} is outside the vocabulary of {vocab_size} ids "
                            f"(--vocab-size {vocab_size - 1} + end-of-document); set --vocab-size {largest} or more")
        if eod is not None and not any(bool((ids[i:i + (1 << 26)] == eod).any()) for i in range(0, tokens, 1 << 26)):
            raise DataError(f"--reset-attention-mask: {bin_} holds no end-of-document token (id {eod}), so every "
                            "sequence would be one document; end each document with it (Megatron-LM's "
                            "preprocess_data.py --append-eod)")


EPOCHS_WARNING = 5  # more passes over the training split than this, and a run says so


def epochs_needed(args, global_batch: int) -> float:
    """Passes over the training split of ``--data-path`` that ``--train-iters`` of
    ``global_batch`` sequences need (as Megatron-LM's dataset builder counts them)."""
    tokens = 0
    for prefix in args.data_path:
        index = _read_index(prefix)  # held: its lengths are a view of the index's memory map
        tokens += int(numpy.asarray(index.sequence_lengths, dtype=numpy.int64).sum())
    parts = [float(p) for p in args.split.split(",")]
    return args.train_iters * global_batch * args.seq_length / max(1.0, tokens * parts[0] / sum(parts))


def _read_index(prefix: str):
    """The index of megatron's indexed dataset ``prefix``, or one DataError line."""
    with open(prefix + ".idx", "rb") as f:
        header = f.read(len(_INDEX_HEADER))
    if header != _INDEX_HEADER:
        raise DataError(f"{prefix}.idx: not a megatron index (its header is {header[:9]!r}, not {_INDEX_HEADER!r})")
    error = None
    # A dataset whose construction failed half-way complains again from its __del__.
    hook, sys.unraisablehook = sys.unraisablehook, lambda unraisable: None
    try:
        try:
            return IndexedDataset(prefix, multimodal=False, mmap=True).index
        except Exception as exc:  # noqa: BLE001 - megatron asserts on a bad header, numpy on a short file
            error = f"{type(exc).__name__}: {exc}"
    finally:
        sys.unraisablehook = hook
    raise DataError(f"{prefix}.idx: not a readable megatron index ({error}); rebuild the dataset")


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int) -> int:
    """The vocabulary padded to a multiple of ``divisible_by`` that splits over the TP/TSP
    ranks: lcm(divisible_by, tensor_parallel), not Megatron-LM's ``divisible_by x TP``, so
    that the model (its padded logits take part in the softmax) is the same at every TSP or
    TP size, and a checkpoint or a comparison across sizes is of the same model."""
    multiple = math.lcm(divisible_by, tensor_parallel)
    return ((vocab_size + multiple - 1) // multiple) * multiple


def documents_eod(args) -> Optional[int]:
    """The token that ends a document where the run packs documents (``reset_attention_mask``)."""
    return tokenizer_for(args).eod if args.reset_attention_mask else None


def padded_vocab(args) -> int:
    """The run's vocabulary, padded (see :func:`padded_vocab_size`)."""
    return padded_vocab_size(tokenizer_for(args).vocab_size, args.make_vocab_size_divisible_by,
                             ParallelSizes.of(args).tensor_slot)


def _not_cache_warning(record: logging.LogRecord) -> bool:
    # megatron warns on every rank's stderr that mock data's sample indexes are not cached;
    # they are rebuilt in milliseconds and nothing should be cached for them
    return "because path_to_cache is None" not in record.getMessage()


logging.getLogger("megatron.core.datasets.gpt_dataset").addFilter(_not_cache_warning)


def build_train_dataset(args, num_samples: int, data_parallel_size: int):
    tokenizer = tokenizer_for(args)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None if args.mock_data else (list(args.data_path), None),
        split=args.split,
        tokenizer=tokenizer,
        # documents: positions and loss mask from the dataset; attention reads the EOD tokens
        # (run.step's documents_eod), never an [S, S] mask
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=False,
        data_parallel_size=data_parallel_size,
        path_to_cache=None,
        mid_level_dataset_surplus=0.005,
    )
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    train, _, _ = BlendedMegatronDatasetBuilder(
        dataset_type, [num_samples, 0, 0], lambda: True, config
    ).build()
    return train


def microbatches(dataset, iteration: int, num_microbatches: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int, device: torch.device) -> List[Dict[str, torch.Tensor]]:
    """This rank's micro-batches of global batch ``iteration`` (Megatron's sample order), on
    ``device``, each with its tokens' host copy (``host_tokens``: where packed documents are
    read, without waiting for the device)."""
    global_batch = num_microbatches * micro_batch_size * dp_size
    out = []
    for m in range(num_microbatches):
        start = iteration * global_batch + m * micro_batch_size * dp_size + dp_rank * micro_batch_size
        samples = [dataset[(start + i) % len(dataset)] for i in range(micro_batch_size)]
        host = {key: torch.stack([torch.as_tensor(s[key]) for s in samples])
                for key in ("tokens", "labels", "loss_mask", "position_ids")}
        batch = {key: t.to(device, non_blocking=True) for key, t in host.items()}
        batch.update(attention_mask=None, host_tokens=host["tokens"])
        out.append(batch)
    return out


def make_batch(micro_batch_size: int, seq_length: int, vocab_size: int, seed: int,
               device: torch.device) -> Dict[str, torch.Tensor]:
    """A new micro-batch of uniformly random tokens (benchmark, GPU check, memory planner,
    tests).

    Every call returns new tensors: megatron's ``get_batch_on_this_cp_rank`` slices the dict it
    is given in place, so a batch must never be fed twice. ``host_tokens``: as
    :func:`microbatches`' (on the CPU, the tokens themselves). The same ``seed`` gives the same
    tokens, so that every mode of a comparison sees the same data.
    """
    g = torch.Generator().manual_seed(seed)  # on the CPU: the same tokens on every device
    drawn = torch.randint(0, vocab_size, (micro_batch_size, seq_length + 1), generator=g)
    tokens = drawn[:, :-1].contiguous()
    return {"tokens": tokens.to(device), "labels": drawn[:, 1:].contiguous().to(device),
            "loss_mask": torch.ones(micro_batch_size, seq_length, device=device),
            "position_ids": torch.arange(seq_length, device=device).expand(micro_batch_size, -1).contiguous(),
            "attention_mask": None, "host_tokens": tokens}


def make_batches(micro_batch_size: int, seq_length: int, vocab_size: int, device: torch.device):
    """:func:`make_batch` with seeds 0, 1, 2, ...: step n of every mode gets the same tokens."""
    for seed in itertools.count():
        yield make_batch(micro_batch_size, seq_length, vocab_size, seed, device)
