"""What ``megatron-tsp train`` checks before it starts a rank.

Everything that can be known without the ranks is checked here, in the launching process
(under torchrun, on every rank before the first collective), so that a mistake is one line
and no process starts: the world size against the parallel sizes, the batch sizes, what
needs TransformerEngine, the tokenizer, the data files (present, complete, token ids inside
the vocabulary), that ``--save`` can be written and that ``--load`` exists and names a
readable checkpoint.
"""

from __future__ import annotations

import os
import tempfile
from typing import Optional

from megatron_tsp.env import transformer_engine_version
from megatron_tsp.errors import CheckpointError, ConfigError
from megatron_tsp.run import checkpointing, config, data


def check_run(args, world_size: int) -> Optional[int]:
    """Raise one :class:`~megatron_tsp.errors.UserError` for the first problem; return the
    iteration the run resumes from (None when it starts from scratch)."""
    dp = config.sizes(args, world_size, "--nproc, or the processes torchrun started").dp
    per_step = args.micro_batch_size * dp
    if args.global_batch_size is not None and args.global_batch_size % per_step:
        raise ConfigError(
            f"'global_batch_size' (--global-batch-size) {args.global_batch_size} is not divisible by "
            f"micro_batch_size {args.micro_batch_size} x data-parallel size {dp} = {per_step}; change one of them")
    if "layernorm" in (args.recompute_modules or ()) and transformer_engine_version() is None:
        raise ConfigError("'recompute_modules' (--recompute-modules) layernorm needs TransformerEngine here "
                          "(megatron-core 0.16.1's CheckpointWithoutOutput reads its FP8 state); recompute "
                          "core_attn or mlp")
    tokenizer = data.tokenizer_for(args)
    if not args.mock_data:
        data.check_corpus(args.data_path, tokenizer.vocab_size)
    if args.save:
        _check_writable(args.save)
    return _resume_iteration(args.load)


def _check_writable(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as exc:
        raise ConfigError(f"--save {path}: cannot be written ({exc.strerror or exc}); choose a writable "
                          "directory") from None


def _resume_iteration(path: Optional[str]) -> Optional[int]:
    if not path:
        return None
    if not os.path.exists(path):
        raise CheckpointError(f"--load {path} does not exist; leave --load out (or give an empty directory) "
                              "to start from scratch")
    if not os.path.isdir(path):
        raise CheckpointError(f"--load {path} is a file; give the checkpoint directory (the one holding "
                              f"{checkpointing.TRACKER})")
    found = checkpointing.latest(path)
    return found[1] if found else None
