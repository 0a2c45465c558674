"""What ``megatron-tsp train`` checks before it starts a rank.

Everything that can be known without the ranks is checked here, in the launching process
(under torchrun, on every rank before the first collective), so that a mistake is one line
and no process starts: the world size against the parallel sizes, the batch sizes, what
needs TransformerEngine, the tokenizer, the data files (present, complete, token ids inside
the vocabulary), that ``--save`` can be written and that ``--load`` exists and names a
readable checkpoint; and that the files and folders it will write can be written.
"""

from __future__ import annotations

import os
import tempfile
from typing import Optional

from megatron_tsp.device import Device
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
    if args.fp16 and not Device.from_launch().is_gpu:
        raise ConfigError("'fp16' (--fp16) needs a GPU (megatron-core's fp16 loss scaling runs on CUDA/ROCm); on the "
                          "CPU train in fp32, or with --bf16")
    tokenizer = data.tokenizer_for(args)
    if not args.mock_data:
        data.check_corpus(args.data_path, tokenizer.vocab_size, data.documents_eod(args))
    if args.save:
        check_writable_dir(args.save, "--save")
        _check_save_root(args.save, args.load)
    return _resume_iteration(args.load)


def _check_save_root(save: str, load: Optional[str]) -> None:
    """A run saves over its own checkpoints only: a ``--save`` that holds checkpoints is
    refused unless ``--load`` resumes from it (it would overwrite another run's iterations with
    a different model and move its tracker back)."""
    found = checkpointing.latest(save)
    if found and not (load and os.path.isdir(load) and os.path.samefile(load, save)):
        raise CheckpointError(f"--save {save} holds checkpoints up to iteration {found[1]} of another run; resume "
                              f"it with --load {save}, or save into another directory")


def check_writable_dir(path: str, flag: str) -> None:
    """``path`` is (or can be made) a directory this process can write into; one line otherwise."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot be written ({exc.strerror or exc}); choose a writable "
                          "directory") from None


def check_writable_file(path: str, flag: str) -> None:
    """``path`` names a file this process can write (its folder is created; the file is not)."""
    if os.path.isdir(path) or path.endswith(os.sep):
        raise ConfigError(f"{flag} {path}: is a directory; give a file name")
    check_writable_dir(os.path.dirname(os.path.abspath(path)), flag)
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ConfigError(f"{flag} {path}: cannot be written (permission denied); choose another file")


def _resume_iteration(path: Optional[str]) -> Optional[int]:
    if not path:
        return None
    if not os.path.exists(path):
        raise CheckpointError(f"--load {path} does not exist; leave --load out (or give an empty directory) "
                              "to start from scratch")
    if not os.path.isdir(path):
        raise CheckpointError(f"--load {path} is a file; give the checkpoint directory (the one holding "
                              f"{checkpointing.TRACKER})")
    return checkpointing.check_load_root(path)
