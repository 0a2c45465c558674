"""``python -m megatron_tsp.run.torchrun [torchrun's arguments]``: torchrun, with SIGTERM a
request to stop that the job's exit code follows.

torchrun's agent answers SIGTERM (Slurm's preemption, ``scancel``, time limit) by passing it
to its ranks and then raising ``SignalException``: it exits 1 with a traceback even when every
rank saved a checkpoint and exited 0 (``--exit-signal-handler``), and Slurm's requeue logic
reads that as a failure. Here the agent is told not to handle SIGTERM (torchrun's
``--signals-to-handle``, torch >= 2.9); this process passes it on to the ranks and goes on
waiting, so the job ends as its ranks do: 0 after they saved. SIGINT, SIGHUP and SIGQUIT
stay torchrun's. With an older torch this is torchrun unchanged, and says so. A rank that
fails has printed its own error: the job exits with its code and a line naming it, not
torchrun's traceback of the agent.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from typing import List, Optional

import psutil
from torch.distributed import run
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

KEEP = "SIGINT,SIGHUP,SIGQUIT"  # torchrun's default set without SIGTERM


def pass_on(signum: int, frame) -> None:
    """To the ranks: the processes torchrun started (each a session of its own)."""
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.NoSuchProcess):
            child.send_signal(signum)


def main(argv: Optional[List[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(action.dest == "signals_to_handle" for action in run.get_args_parser()._actions):
        print("megatron_tsp.run.torchrun: this torch's torchrun has no --signals-to-handle (torch >= 2.9): on "
              "SIGTERM it exits 1 after the ranks have saved", file=sys.stderr)
    elif not any(arg.startswith(("--signals-to-handle", "--signals_to_handle")) for arg in argv):
        argv = ["--signals-to-handle", KEEP] + argv
        signal.signal(signal.SIGTERM, pass_on)
    try:
        run.main(argv)
    except ChildFailedError as exc:  # each rank printed its own error: their exit codes, not torchrun's traceback
        first, failure = exc.get_first_failure()
        codes = ", ".join(f"rank {rank} exited {f.exitcode}" for rank, f in sorted(exc.failures.items()))
        print(f"megatron_tsp.run.torchrun: rank {first} failed first ({codes}; their output is above)",
              file=sys.stderr)
        sys.exit(failure.exitcode if failure.exitcode > 0 else 1)


if __name__ == "__main__":
    main()
