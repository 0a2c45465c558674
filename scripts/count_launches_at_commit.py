"""Kernel launches, GEMM and attention kernel calls, FLOPs and memory-bound bytes of rank 0's
step as an earlier commit's code runs it: the counts of the code a GPU measured, for the
launch prices (``perfmodel.launch_prices``; ``bench/results/launch-counts-H200-measured.json``).

Run in a worktree of that commit, with today's ``measure/tracker.py`` over its own (it counts
launches; the commit's planner runs the step)::

    git worktree add --detach /tmp/at COMMIT
    cp megatron_tsp/measure/tracker.py /tmp/at/megatron_tsp/measure/tracker.py
    (cd /tmp/at && PYTHONPATH=. python "$OLDPWD/scripts/count_launches_at_commit.py" \\
        configs/7b/128k-tsp8.yaml 8192 2 flash out.json)

The optimizer step is counted apart, as today's planner counts it (tracker.py): megatron's
optimizer classes' ``step`` runs inside the tracker's optimizer section.
"""

import inspect
import json
import sys

import megatron.core.optimizer.distrib_optimizer as distrib_optimizer
import megatron.core.optimizer.optimizer as optimizer

import megatron_tsp.measure.tracker as tracker
from megatron_tsp.measure import memory
from megatron_tsp.run import config as cfg

TRACKERS = []
_init, _reset_peak = tracker.StorageTracker.__init__, tracker.StorageTracker.reset_peak


def _recorded(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    TRACKERS.append(self)


def _step_starts(self, *args, **kwargs):  # the planner resets the peak as the step starts
    self.before_step = dict(self.launches_by_op), self.attention_kernel_calls
    return _reset_peak(self, *args, **kwargs)


def _apart(step):
    def run(self, *args, **kwargs):
        if TRACKERS[-1]._section is not None:  # a subclass's step calling its parent's
            return step(self, *args, **kwargs)
        with TRACKERS[-1].section(tracker.OPTIMIZER):
            return step(self, *args, **kwargs)
    return run


def main(config: str, seq: int, layers: int, backend: str, out: str) -> None:
    tracker.StorageTracker.__init__, tracker.StorageTracker.reset_peak = _recorded, _step_starts
    for module in (optimizer, distrib_optimizer):
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__ and "step" in cls.__dict__:
                cls.step = _apart(cls.__dict__["step"])
    result = {}
    for mode in ("tsp", "tp-sp"):
        values = cfg.load_config(config)
        values.update(num_layers=layers, seq_length=seq,
                      max_position_embeddings=max(seq, values.get("max_position_embeddings") or 0))
        plan = memory.plan(values, mode, attention_backend=backend)
        t = TRACKERS[-1]
        before, calls_before = t.before_step
        launches = tracker.without_optimizer({op: n - before.get(op, 0) for op, n in t.launches_by_op.items()})
        result[mode] = {"launches": sum(launches.values()),
                        "gemm_calls": sum(n for op, n in launches.items() if op in ("mm", "addmm", "bmm", "baddbmm")),
                        "attention_calls": t.attention_kernel_calls - calls_before,
                        "flops": plan["flops_per_rank"], "attention_flops": plan["attention_flops_per_rank"],
                        "memory_bytes": plan["memory_bytes_per_rank"]}
        print(mode, result[mode], flush=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
