"""The ``megatron-tsp`` command."""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional


def _cmd_env(args: argparse.Namespace) -> int:
    from megatron_tsp.env import environment

    info = environment()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        width = max(len(k) for k in info)
        for key, value in info.items():
            shown = "not installed" if value is None else ("yes" if value is True else "no" if value is False else value)
            print(f"{key:<{width}}  {shown}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-tsp",
        description="TSP (Tensor + Sequence Parallelism) for Megatron-Core.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    env = sub.add_parser("env", help="versions of torch/megatron-core/TE/apex, device and backend")
    env.add_argument("--json", action="store_true", help="print JSON")
    env.set_defaults(func=_cmd_env)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
