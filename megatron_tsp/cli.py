"""The ``megatron-tsp`` command: its parser, from the subcommands of :mod:`megatron_tsp.commands`,
and the running of one.

A mistake gets one line (``megatron-tsp COMMAND: error: ...``) and a non-zero exit: 2 for a bad
configuration or argument, 1 for anything else that stops the command (data files,
checkpoints, a failure while running), 130 for Ctrl-C. A failed rank's traceback goes to
``error.log`` beside the run's log; ``--debug`` prints tracebacks instead. Where ranks run
(torchrun, or local workers) is :func:`megatron_tsp.run.launch.job`'s decision.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
from typing import List, Optional

from megatron_tsp.commands import measuring, training
from megatron_tsp.env import quiet_import_noise
from megatron_tsp.errors import ConfigError, UserError


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (its default prints the whole usage first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


COMMANDS = (*training.PARSERS, *measuring.PARSERS)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="megatron-tsp", description="TSP (Tensor + Sequence Parallelism) for Megatron-Core.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="print Python tracebacks instead of one-line errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in COMMANDS:
        add(sub, common)
    return parser


def _stdout_closed() -> bool:
    """Whether standard output's reader has gone (then stop writing to it for good)."""
    import select

    poll = select.poll()
    poll.register(sys.stdout.fileno(), select.POLLOUT)
    if not any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0)):
        return False
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
    return True


def main(argv: Optional[List[str]] = None) -> int:
    quiet_import_noise()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return _run_command(args)


def _with_signals(args) -> int:
    """``args.func(args)`` with SIGTERM ending it as Ctrl-C does. train notes SIGTERM instead,
    until its config says whether --exit-signal-handler saves first (so that one that comes
    while it starts is not lost). The first stop wins, and once stopped the process ignores
    both signals to its end: Python puts back the default handlers while it shuts down, and
    a second SIGTERM would then turn exit 130 (or 0, saved) into 143. Otherwise the caller's
    handlers are back afterwards (main also runs inside other programs: the tests)."""
    from megatron_tsp.run import launch

    launch.forget_sigterm()
    previous_alarm = signal.getsignal(signal.SIGALRM)  # redeliver_dropped_stops' timer takes it
    previous = signal.signal(signal.SIGTERM, launch.remember_sigterm if args.command == "train"
                             else launch.raise_terminated)
    previous_int = signal.getsignal(signal.SIGINT)
    if previous_int is signal.default_int_handler:  # not where the shell made this process ignore it
        signal.signal(signal.SIGINT, launch.raise_interrupted)
    previous_hook, sys.unraisablehook = sys.unraisablehook, launch.redeliver_dropped_stops
    stopped = False
    try:
        code = args.func(args)
    except (KeyboardInterrupt, launch.Terminated):
        stopped = True
        raise
    finally:
        sys.unraisablehook = previous_hook
        dropped = launch.take_dropped_stop()  # dropped in a finalizer, its timer not fired yet
        signal.signal(signal.SIGALRM, previous_alarm)
        if stopped or dropped is not None or launch.sigterm_received():
            launch.ignore_stops()
        else:
            signal.signal(signal.SIGTERM, previous)
            signal.signal(signal.SIGINT, previous_int)
    if dropped is not None:
        raise dropped
    return code


def _run_command(args) -> int:
    """``args.func(args)``, each way it can end turned into one line on stderr and an exit code."""
    from megatron_tsp.run.launch import PoolTimeout, RankError, Terminated, under_torchrun

    where = f"rank {os.environ['RANK']}: " if under_torchrun() else ""
    try:
        return _with_signals(args)
    except KeyboardInterrupt:
        print(f"megatron-tsp {args.command}: {where}interrupted", file=sys.stderr)
        return 130
    except Terminated as exc:
        lost = ("; nothing saved since the last checkpoint; --exit-signal-handler saves one first"
                if args.command == "train" else "")
        print(f"megatron-tsp {args.command}: {where}terminated by {exc} (every rank stopped{lost})", file=sys.stderr)
        return 128 + exc.signum
    except (UserError, RankError, PoolTimeout) as exc:
        if args.debug:
            traceback.print_exc()
            if isinstance(exc, RankError):
                print(exc.traceback, file=sys.stderr)
        line = exc.summary if isinstance(exc, RankError) else str(exc)
        print(f"megatron-tsp {args.command}: error: {where}{line}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    except Exception as exc:  # noqa: BLE001 - a bug: one line, the traceback behind --debug
        if isinstance(exc, BrokenPipeError) and _stdout_closed():
            return 128 + signal.SIGPIPE  # `megatron-tsp args ... | head`: the reader has what it wanted
        if args.debug:
            raise
        first = (str(exc).strip().splitlines() or [""])[0]
        print(f"megatron-tsp {args.command}: internal error: {where}{type(exc).__name__}: {first} "
              "(run again with --debug for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
