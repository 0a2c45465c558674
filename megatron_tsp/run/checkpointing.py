"""Checkpoints through megatron-core ``dist_checkpointing``.

TSP shards have the tensor-parallel layout, so a checkpoint is keyed exactly like a TP(+SP)
checkpoint of the same model: one saved by a TSP run loads into a TP run, into a different
TSP size, or into a different pipeline split, and back. The optimizer state is saved in
megatron's ``fully_reshardable`` format for the same reason. Per-rank objects (RNG states)
are restored only into a job of the same world size.

Nothing loads silently wrong: a save writes ``checksums.json`` (size and CRC-32 of every
file), a load verifies it (the ranks share the reading) and compares the model's shape
arguments saved in ``common`` with the model it loads into, and every failure is one
:class:`~megatron_tsp.errors.CheckpointError` line naming the file and what is wrong.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import re
import socket
import zlib
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from torch.distributed.checkpoint.api import CheckpointException

from megatron_tsp.errors import CheckpointError
from megatron_tsp.run.step import unwrap
from megatron_tsp.run.upstream import checkpoint_writers_outlive_sigterm, fix_optimizer_checkpoints

# Per-parameter keys, the same whether megatron-core splits a MoE model's optimizer into dense
# and expert parts (EP > 1) or not: a checkpoint's optimizer state moves between the two
# (:func:`_regroup_optimizer_state`). Checkpoints saved before carry a ``chained_<i>.`` prefix.
PREFIXED_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
OPTIMIZER_METADATA = dict(PREFIXED_OPTIMIZER_METADATA, chained_optim_avoid_prefix=True)
_ITERATION = re.compile(r"iter_\d{7}")


def _model_state(model: List[torch.nn.Module]) -> Dict[str, Any]:
    if len(model) != 1:
        raise NotImplementedError("checkpointing of virtual-pipeline model chunks is not implemented")
    return {"model": unwrap(model[0]).sharded_state_dict()}


def _per_rank(obj: Any) -> ShardedObject:
    return ShardedObject("per_rank", obj, (dist.get_world_size(),), (dist.get_rank(),), replica_id=0)


def _materialize_optimizer_state(optimizer) -> None:
    """megatron-core 0.16.1's ``DistributedOptimizer.state_dict()`` asserts on an optimizer
    that has never stepped when it runs on torch's Adam (no TransformerEngine or apex). Give
    it the placeholder state megatron itself creates before loading its fsdp format; the
    load overwrites every value (parameters included)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(opt, "_init_optimizer_states_with_dummy_values") and not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()


TRACKER = "latest_checkpointed_iteration.txt"
CHECKSUMS = "checksums.json"


def iteration_dir(root: str, iteration: int) -> str:
    """Megatron-LM's layout: ``ROOT/iter_0000010`` plus a tracker file naming the latest."""
    return os.path.join(root, f"iter_{iteration:07d}")


def latest(root: Optional[str]) -> Optional[Tuple[str, int]]:
    """(directory, iteration) of the latest checkpoint under ``root`` (Megatron-LM layout), or
    None when ``root`` holds none yet (no tracker file)."""
    tracker = os.path.join(root or "", TRACKER)
    if not root or not os.path.isfile(tracker):
        return None
    with open(tracker, encoding="utf-8", errors="replace") as f:
        text = f.read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{tracker}: expected the iteration of the latest checkpoint, found {text[:40]!r}; "
                              "write the iteration of an iter_* directory into it or delete it")
    path = iteration_dir(root, int(text))
    if not os.path.isdir(path):
        raise CheckpointError(f"{tracker} names iteration {text}, but {path} does not exist")
    return path, int(text)


def check_load_root(root: str) -> Optional[int]:
    """The iteration ``--load ROOT`` resumes from, or None for an empty directory; one line
    for a directory that holds checkpoints it would not resume from (never a silent fresh
    start)."""
    found = latest(root)
    if found:
        return found[1]
    if _ITERATION.fullmatch(os.path.basename(os.path.normpath(root))) and os.path.isfile(
            os.path.join(root, ".metadata")):
        parent = os.path.dirname(os.path.normpath(root)) or "."
        raise CheckpointError(f"--load {root} is one iteration of a checkpoint; give the directory above it "
                              f"(--load {parent}), whose {TRACKER} names the iteration to resume from")
    iterations = sorted(n for n in os.listdir(root) if _ITERATION.fullmatch(n))
    if iterations:
        raise CheckpointError(
            f"--load {root} holds {', '.join(iterations[-3:])} but no {TRACKER} (a save that did not finish, or a "
            f"copy without it); write the iteration to resume from into {os.path.join(root, TRACKER)}")
    return None


class SaveLock:
    """``--save ROOT`` belongs to one run at a time: ``ROOT/.lock`` names its holder (PID, host,
    start time). A second run refuses with one line; a lock whose holder is gone (same host, no
    such process) is taken over with one line. Released when the run ends."""

    NAME = ".lock"

    def __init__(self, root: str):
        self.path = os.path.join(root, self.NAME)
        self.held = False

    def __enter__(self) -> "SaveLock":
        import psutil

        me = psutil.Process()
        record = {"pid": me.pid, "host": socket.gethostname(), "started": me.create_time()}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is not None:
                    when = datetime.datetime.fromtimestamp(holder.get("started", 0)).strftime("%Y-%m-%d %H:%M")
                    raise CheckpointError(
                        f"--save {os.path.dirname(self.path)} is in use by PID {holder.get('pid')} on "
                        f"{holder.get('host')} (running since {when}); wait for that run or save elsewhere. If "
                        f"it is gone, delete {self.path}") from None
                print(f" --save: taking over {self.path}: the run that held it is gone", flush=True)
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self.path)
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(record, f)
            self.held = True
            return self
        raise CheckpointError(f"--save: {self.path} keeps reappearing; is another run starting in "
                              f"{os.path.dirname(self.path)}?")

    def _holder(self) -> Optional[Dict[str, Any]]:
        """The lock's record if its holder may still be running, None if it is gone."""
        import psutil

        try:
            with open(self.path, encoding="utf-8") as f:
                holder = json.load(f)
            pid, host, started = holder["pid"], holder["host"], holder["started"]
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError):
            return {"pid": "?", "host": "? (unreadable lock file)"}
        if host != socket.gethostname():
            return holder  # another machine's process: it cannot be looked at from here
        try:
            alive = abs(psutil.Process(pid).create_time() - started) < 1.0  # the same process, not a reused PID
        except (psutil.NoSuchProcess, ValueError, TypeError):
            alive = False
        return holder if alive else None

    def __exit__(self, *exc) -> None:
        if self.held:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)
            self.held = False


def save_iteration(root: str, iteration: int, *args, **kwargs) -> str:
    """:func:`save` into ``ROOT/iter_N``, then point the tracker at it (a save killed halfway
    leaves the tracker at the previous checkpoint)."""
    path = iteration_dir(root, iteration)
    with _WriterErrors() as logged:
        try:
            save(path, *args, **kwargs)
        except CheckpointException as exc:  # raised on every rank together
            reasons = [None] * dist.get_world_size()
            dist.all_gather_object(reasons, _os_error([str(exc), *map(str, exc.failures.values()), *logged.lines]))
            why = next((r for r in reasons if r), None)
            if why is None:
                raise
            found = latest(root)
            kept = f"the last complete checkpoint is iteration {found[1]}" if found else \
                "no complete checkpoint is there"
            raise CheckpointError(f"--save {root}: saving iteration {iteration} failed: {why}; {kept}; free space "
                                  "there or --save elsewhere") from exc
    if dist.get_rank() == 0:
        write_tracker(root, iteration)
    dist.barrier()
    return path


def _os_error(texts: List[str]) -> Optional[str]:
    """The operating system's refusal (a full disk, a quota, permissions) behind a failed save,
    as the first ``[Errno N] ...`` in ``texts``: the exception, its ranks' failures (rank 0
    holds them all), what megatron's writer logged on this rank (megatron-core 0.19's
    exception keeps only the error's type)."""
    for text in texts:
        quoted = re.search(r"\[Errno \d+\] [^'\"\n]*", text)
        if quoted:
            return quoted.group(0).strip()
    return None


class _WriterErrors(logging.Handler):
    """The error lines megatron's checkpoint writers log in this process, while in use."""

    LOGGER = "megatron.core.dist_checkpointing"

    def __init__(self):
        super().__init__(logging.ERROR)
        self.lines: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> "_WriterErrors":
        logging.getLogger(self.LOGGER).addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger(self.LOGGER).removeHandler(self)


def write_tracker(root: str, iteration: int) -> None:
    """Point the tracker file at ``iteration``, atomically: a run killed while writing it
    leaves the previous tracker (or none), never an empty or partial one."""
    tmp = os.path.join(root, TRACKER + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, TRACKER))


def save(path: str, model: List[torch.nn.Module], optimizer=None,
         common: Optional[Dict[str, Any]] = None, per_rank: Any = None) -> None:
    """Save model (and optimizer) shards, ``common`` (plain objects, from rank 0; its
    ``model_args``, if any, are checked at load) and ``per_rank`` (one object per rank)."""
    os.makedirs(path, exist_ok=True)
    checkpoint_writers_outlive_sigterm()
    state = _model_state(model)
    if optimizer is not None:
        fix_optimizer_checkpoints()
        state["optimizer"] = optimizer.sharded_state_dict(state, metadata=OPTIMIZER_METADATA)
    state.update(common or {})
    state["world_size"] = dist.get_world_size()
    state["has_per_rank"] = per_rank is not None
    if per_rank is not None:
        state["per_rank"] = _per_rank(per_rank)
    dist_checkpointing.save(state, path)
    dist.barrier()
    _write_checksums(path)


def read_common(path: str) -> Dict[str, Any]:
    """The plain entries a checkpoint saved from rank 0 (iteration, scheduler, model args ...)."""
    try:
        return dist_checkpointing.load_common_state_dict(path)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means the same thing
        raise CheckpointError(f"{os.path.join(path, 'common.pt')}: cannot be read "
                              f"({type(exc).__name__}); the checkpoint is damaged") from exc


def load(path: str, model: List[torch.nn.Module], optimizer=None,
         per_rank: bool = False, model_args: Optional[Dict[str, Any]] = None) -> Tuple[Dict[str, Any], Any]:
    """Load into ``model`` (and ``optimizer``); return (common entries, this rank's object or
    None when it was not saved or the world size differs). ``model_args``: the shape
    arguments of ``model``, refused with one line if the checkpoint saved different ones."""
    verified = _verify(path)
    common = read_common(path)
    if not verified and "model_args" in common:  # ours: it was saved with a manifest
        raise CheckpointError(f"checkpoint {path}: {CHECKSUMS} is missing from a megatron-tsp checkpoint, so its "
                              "files cannot be verified; resume from another iteration (or restore the file)")
    _check_model_args(path, common.get("model_args"), model_args)
    state = _model_state(model)
    saved = dist_checkpointing.load_tensors_metadata(path)  # read once: every rank reads it
    _check_shapes(path, saved, state)
    if optimizer is not None:
        fix_optimizer_checkpoints()
        _materialize_optimizer_state(optimizer)
        prefixed = any(key.startswith("chained_") for key in saved)
        state["optimizer"] = optimizer.sharded_state_dict(
            state, is_loading=True, metadata=PREFIXED_OPTIMIZER_METADATA if prefixed else OPTIMIZER_METADATA)
        if prefixed:
            _check_optimizer_parts(path, state["optimizer"])
    with_rank_state = per_rank and common.get("has_per_rank") and common.get("world_size") == dist.get_world_size()
    if with_rank_state:
        state["per_rank"] = _per_rank(None)
    try:
        loaded = dist_checkpointing.load(state, path)
    except Exception as exc:  # noqa: BLE001 - megatron/torch raise KeyError, ValueError, CheckpointException ...
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"checkpoint {path} does not fit this model or is damaged: {first}") from exc
    unwrap(model[0]).load_state_dict(loaded.pop("model"))
    if optimizer is not None:
        optimizer.load_state_dict(_regroup_optimizer_state(loaded.pop("optimizer"), common.get("optimizer"), optimizer))
    rank_state = loaded.pop("per_rank", None) if with_rank_state else None
    for key in ("model", "optimizer", "per_rank"):
        common.pop(key, None)
    return common, rank_state


def _check_model_args(path: str, saved: Optional[Dict[str, Any]], expected: Optional[Dict[str, Any]]) -> None:
    if saved is None or expected is None:
        return
    differ = [f"{key} {saved.get(key)!r} there, {expected.get(key)!r} in this run"
              for key in saved.keys() | expected.keys() if saved.get(key) != expected.get(key)]
    if differ:
        raise CheckpointError(f"checkpoint {path} is of another model: {'; '.join(sorted(differ))}; "
                              "load it with the same model arguments")


def _check_optimizer_parts(path: str, optimizer_state: Dict[str, Any]) -> None:
    """A checkpoint saved with ``chained_<i>.`` keys (before :data:`OPTIMIZER_METADATA` left
    them out) loads only into as many optimizer parts: one line instead of a KeyError from
    inside the load."""
    here = any(isinstance(t, ShardedTensor) and t.key.startswith("chained_") for t in nested_values(optimizer_state))
    if not here:
        raise CheckpointError(f"checkpoint {path} keeps the optimizer state in dense and expert parts "
                              "(expert_model_parallel_size > 1, saved by an older megatron-tsp), this run in one part "
                              "(expert_model_parallel_size 1): resume with an expert_model_parallel_size > 1")


def _parts(state: Any) -> Optional[int]:
    """Optimizer parts of a state dict's plain entries: 2 for megatron-core's chained dense and
    expert optimizers ({0: ..., 1: ...}), 1 for one optimizer, None for none."""
    if not isinstance(state, dict):
        return None
    return len([k for k in state if isinstance(k, int)]) or 1


def _regroup_optimizer_state(loaded: Any, saved: Any, optimizer) -> Any:
    """The optimizer state ``dist_checkpointing.load`` returned, in this optimizer's parts.

    megatron-core keeps a mixture-of-experts model's optimizer in dense and expert parts where
    the experts are sharded over more than one rank (EP > 1), in one part where they are not
    (EP = 1, D=1 included). The parameters' states load by name either way; the plain entries
    (``saved``, the checkpoint's: parameter-group hyperparameters, Adam's step) come in the
    checkpoint's parts, merged beside this run's tensors. Each of this run's groups takes the
    saved group with its identifiers but ``is_expert_parallel`` (the one the split adds)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    ours = getattr(optimizer, "chained_optimizers", [optimizer])
    if _parts(saved) in (None, len(ours) if len(ours) > 1 else 1):
        return loaded
    if not all(isinstance(opt, DistributedOptimizer) for opt in ours):
        # megatron's other optimizers keep the parameters' states inside the parts' plain entries
        raise CheckpointError("the checkpoint's optimizer state is split into dense and expert parts where this run's "
                              "is not, or the reverse (expert_model_parallel_size 1 against > 1), which only the "
                              "distributed optimizer regroups: resume with use_distributed_optimizer, or with an "
                              "expert_model_parallel_size of the checkpoint's kind")
    saved_parts = [saved[k] for k in sorted(k for k in saved if isinstance(k, int))] if _parts(saved) > 1 else [saved]
    saved_groups = [g for part in saved_parts for g in part["optimizer"]["param_groups"]]
    keys = [k for k in param_group_identifier_keys if k != "is_expert_parallel"]
    parts = []
    for i, opt in enumerate(ours):
        tensors = loaded[i] if len(ours) > 1 else {k: v for k, v in loaded.items() if not isinstance(k, int)}
        part = {**{k: v for k, v in saved_parts[0].items() if k != "optimizer"}, **tensors}
        groups = []
        for group in opt.state_dict()["optimizer"]["param_groups"]:
            match = next((g for g in saved_groups if all(g.get(k) == group.get(k) for k in keys)), None)
            if match is None:
                wanted = {k: group.get(k) for k in keys}
                raise CheckpointError(f"the checkpoint's optimizer has no parameter group like this run's {wanted}: "
                                      "resume with the optimizer settings it saved")
            groups.append({**match, **{k: group[k] for k in param_group_identifier_keys if k in group}})
        part["optimizer"] = {**saved_parts[0]["optimizer"], "param_groups": groups}
        parts.append(part)
    return parts if len(ours) > 1 else parts[0]


def _check_shapes(path: str, saved: Dict[str, Any], state: Dict[str, Any]) -> None:
    """dist_checkpointing loads a tensor saved with another global shape without a word
    (a vocabulary padded differently, for one); refuse it, also for checkpoints that saved no
    ``model_args`` (Megatron-LM's, older ones). ``saved``: the checkpoint's tensor metadata."""
    for tensor in nested_values(state):
        if isinstance(tensor, ShardedTensor) and tensor.key in saved:
            there, here = tuple(saved[tensor.key].global_shape), tuple(tensor.global_shape)
            if there != here:
                raise CheckpointError(f"checkpoint {path} is of another model: {tensor.key} has shape {there} there, "
                                      f"{here} in this run; load it with the same model arguments")


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(path: str) -> List[str]:
    return sorted(f for f in os.listdir(path) if f != CHECKSUMS and os.path.isfile(os.path.join(path, f)))


def _write_checksums(path: str) -> None:
    """Every rank sums its share of the files; rank 0 writes the manifest."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {f: {"bytes": os.path.getsize(os.path.join(path, f)), "crc32": _crc32(os.path.join(path, f))}
            for f in _files(path)[rank::world]}
    shares: List[Any] = [None] * world
    dist.all_gather_object(shares, mine)
    if rank == 0:
        manifest = {f: entry for share in shares for f, entry in share.items()}
        with open(os.path.join(path, CHECKSUMS), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
    dist.barrier()


def _verify(path: str) -> bool:
    """Raise the same CheckpointError on every rank if a file is missing, resized or altered;
    return whether there was a manifest to check (Megatron-LM's checkpoints have none and are
    checked for completeness only)."""
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise CheckpointError(f"checkpoint {path}: .metadata is missing (an unfinished save, or not a "
                              "dist_checkpointing directory)")
    manifest_path = os.path.join(path, CHECKSUMS)
    if not os.path.isfile(manifest_path):
        return False
    manifest = _read_manifest(manifest_path)
    rank, world = dist.get_rank(), dist.get_world_size()
    problems = []
    for i, (name, entry) in enumerate(sorted(manifest.items())):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            problems.append(f"{file}: missing")
        elif os.path.getsize(file) != entry["bytes"]:
            problems.append(f"{file}: {os.path.getsize(file)} bytes, saved with {entry['bytes']} (truncated?)")
        elif i % world == rank and _crc32(file) != entry["crc32"]:
            problems.append(f"{file}: contents differ from the saved checksum (damaged)")
    found: List[Any] = [None] * world
    dist.all_gather_object(found, problems)
    problems = sorted({p for share in found for p in share})
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(f"checkpoint {problems[0]}{more}; the checkpoint cannot be used")
    return True


def _read_manifest(path: str) -> Dict[str, Dict[str, int]]:
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc})") from None
    well_formed = isinstance(manifest, dict) and all(
        isinstance(name, str) and isinstance(entry, dict) and isinstance(entry.get("bytes"), int)
        and isinstance(entry.get("crc32"), int) for name, entry in manifest.items())
    if not well_formed:
        raise CheckpointError(f"{path}: not a checksum manifest (expected {{file: {{bytes, crc32}}}}); the "
                              "checkpoint cannot be verified")
    return manifest
