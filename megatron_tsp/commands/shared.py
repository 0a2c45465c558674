"""What the subcommands share: argument types, the config arguments, the config a command
runs, and result files written with one line for a path that cannot be."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

from megatron_tsp.core.sizes import DEFAULT_CP
from megatron_tsp.errors import ConfigError, UserError

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")


def default_config_path() -> str:
    """configs/tiny-cpu.yaml of the checkout this package runs from."""
    return os.path.join(CONFIGS, "tiny-cpu.yaml")


# ---- argument types and shared arguments ---------------------------------------------------------
def _number(kind: type, low: float, what: str):
    """An argparse type: a ``kind`` number >= ``low`` (one usage line otherwise)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not value >= low:  # also refuses NaN
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value
    return parse


POSITIVE_INT = _number(int, 1, "a positive integer")
NON_NEGATIVE_INT = _number(int, 0, "an integer >= 0")
POSITIVE_FLOAT = _number(float, 1e-300, "a positive number")


def name_list(text: str) -> List[str]:
    """Comma-separated names (modes), at least one."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names nothing; give a comma-separated list")
    return names


def int_list(text: str) -> List[int]:
    """Comma-separated positive integers (sequence lengths), at least one."""
    return [POSITIVE_INT(x) for x in name_list(text)]


def config_flags(parser: argparse.ArgumentParser, keys=None) -> None:
    from megatron_tsp.run import config

    config.add_arguments(parser, keys)


def fused_norm_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fused-norm", action=argparse.BooleanOptionalAction, default=True,
                        help="plan norms that keep their input and per-token statistics (TransformerEngine, apex, "
                             "TSP's RMSNorm; default), or torch's RMSNorm with fp32 weights, which keeps fp32 copies "
                             "(--no-fused-norm: megatron-core's torch fallback)")


def cluster_flags(parser: argparse.ArgumentParser, modes: str) -> None:
    """CONFIG, the GPU profile, the job's size and the modes to compare (predict, plan)."""
    parser.add_argument("config", help="YAML config")
    parser.add_argument("--hardware", required=True, help="configs/hardware/<name>.yaml")
    parser.add_argument("--nodes", type=POSITIVE_INT, default=1, help="nodes of the job")
    parser.add_argument("--modes", type=name_list, default=modes, help="comma-separated modes")
    parser.add_argument("--cp", type=POSITIVE_INT, default=DEFAULT_CP, help="context-parallel size of tp-cp")
    fused_norm_flag(parser)


def runnable_modes(ns: argparse.Namespace, command: str) -> None:
    """Drop from ``ns.modes`` those the config's model cannot run, each said in a line; one
    ConfigError line where none is left."""
    from megatron_tsp.run import config, modes

    values = config.load_config(ns.config)
    values.update(config.overrides(ns))
    ns.modes, skipped = modes.runnable(values, ns.modes, ns.cp)
    if not ns.modes:
        raise ConfigError(skipped[0])
    for line in skipped:
        print(f"megatron-tsp {command}: note: {line}", file=sys.stderr, flush=True)


def resolve_config(ns: argparse.Namespace):
    """(path, values, resolved arguments) of the command's config (default: configs/tiny-cpu.yaml)
    with the flags that override its keys."""
    from megatron_tsp.run import config

    path = ns.config or default_config_path()
    values = config.load_config(path)
    values.update(config.overrides(ns))
    return path, values, config.resolve(values)


def write_file(path: str, text: str, flag: str) -> None:
    """Write a result file (creating its folder); one line if that is impossible."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as exc:
        raise UserError(f"{flag} {path}: cannot be written ({exc.strerror or exc})") from None


def check_outputs(**paths: Optional[str]) -> None:
    """Every result file a command was asked for can be written: checked before the work."""
    from megatron_tsp.run import preflight

    for flag, path in paths.items():
        if path:
            preflight.check_writable_file(path, "--" + flag.replace("_", "-"))


def write_json(path: str, obj) -> None:
    write_file(path, json.dumps(obj, indent=2, default=str), "--json")
