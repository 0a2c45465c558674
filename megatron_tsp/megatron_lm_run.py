"""Run a Megatron-LM script from a checkout on this machine's device.

``python -m megatron_tsp.megatron_lm_run PATH/TO/pretrain_gpt.py [FLAGS]`` runs the script as
its ``__main__`` the way ``torchrun pretrain_gpt.py`` does (its directory first on
``sys.path``, so the checkout's ``megatron`` is the one imported), after checking that the
checkout pairs with this Python and the installed megatron-core, and, on a machine without a
GPU, with the CPU shims of :mod:`megatron_tsp.run.compat_megatron_lm`. It runs the stock and a
patched ``pretrain_gpt.py`` beside ``scripts/pretrain_gpt_tsp.py`` on the same footing.

Nothing here imports megatron-core before the checkout is on the path.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import List

from megatron_tsp import versions


def is_checkout(path: str) -> bool:
    """Whether ``path`` holds Megatron-LM's training code (``pretrain_gpt.py``, ``megatron/training``)."""
    return os.path.isfile(os.path.join(path, "pretrain_gpt.py")) and \
        os.path.isdir(os.path.join(path, "megatron", "training"))


def put_checkout_on_path(checkout: str, program: str) -> None:
    """Exit with one line when ``checkout`` is not a Megatron-LM checkout or does not pair
    with this Python and the installed megatron-core; else put it first on ``sys.path``."""
    if not is_checkout(checkout):
        where = f"MEGATRON_LM_PATH={checkout}" if "MEGATRON_LM_PATH" in os.environ else f"the directory {checkout}"
        tags = " or ".join(tag for _, tag in versions.SUPPORTED.values())
        sys.exit(f"{program}: error: {where} is not a Megatron-LM checkout (no pretrain_gpt.py and "
                 "megatron/training); set "
                 f"MEGATRON_LM_PATH to a checkout at tag {tags}")
    problem = versions.checkout_problem(checkout)
    if problem:
        sys.exit(f"{program}: error: {problem}")
    sys.path.insert(0, checkout)


def prepare_device():
    """This process's device (:meth:`Device.from_launch`); on the CPU, with the shims that let
    Megatron-LM's training code run there; on every device, megatron-core's distributed
    optimizer checkpoints fixed (:func:`~megatron_tsp.run.upstream.fix_optimizer_checkpoints`),
    its checkpoint writers' queue served by a process that outlives SIGTERM
    (:func:`~megatron_tsp.run.upstream.checkpoint_writers_outlive_sigterm`), and below 0.19
    its ``--use-torch-fsdp2`` gradient sync (:func:`~megatron_tsp.run.upstream.fix_torch_fsdp2_grad_sync`).
    Call after :func:`put_checkout_on_path`."""
    from megatron_tsp.device import Device
    from megatron_tsp.run.upstream import (
        checkpoint_writers_outlive_sigterm,
        fix_optimizer_checkpoints,
        fix_torch_fsdp2_grad_sync,
    )

    device = Device.from_launch()
    if not device.is_gpu:
        from megatron_tsp.run.compat_megatron_lm import enable_megatron_lm_cpu_support

        enable_megatron_lm_cpu_support()
    fix_optimizer_checkpoints()
    checkpoint_writers_outlive_sigterm()
    fix_torch_fsdp2_grad_sync()
    return device


def run_script(argv: List[str]) -> None:
    if not argv or not argv[0].endswith(".py") or not os.path.isfile(argv[0]):
        sys.exit("usage: python -m megatron_tsp.megatron_lm_run PATH/TO/pretrain_gpt.py [Megatron-LM flags]")
    script = os.path.abspath(argv[0])
    here = os.path.dirname(script)
    # the checkout: the script's own, or MEGATRON_LM_PATH for a script kept elsewhere
    checkout = here if is_checkout(here) else os.environ.get("MEGATRON_LM_PATH", here)
    put_checkout_on_path(checkout, os.path.basename(script))
    if here != checkout:
        sys.path.insert(0, here)
    from megatron_tsp.megatron_lm import launch_environment

    launch_environment(argv)
    prepare_device()
    sys.argv = [script] + argv[1:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    run_script(sys.argv[1:])
