#!/usr/bin/env python
"""Megatron-LM's pretrain_gpt.py with ``--tsp-size`` (and ``--ring-mlp``).

Needs a Megatron-LM checkout at tag core_v0.16.1 or core_v0.19.0, matching the installed
megatron-core (``MEGATRON_LM_PATH``, default: the current directory), and megatron_tsp
installed. Takes every pretrain_gpt.py flag plus ``--tsp-size D``:

    MEGATRON_LM_PATH=/path/to/Megatron-LM torchrun --nproc-per-node 8 \\
        scripts/pretrain_gpt_tsp.py $(megatron-tsp args configs/7b/128k-tsp8.yaml) ...

On a machine without a GPU it runs on the CPU over gloo (docs/design.md section 8).
"""

import os
import sys

from megatron_tsp.megatron_lm_run import prepare_device, put_checkout_on_path

if __name__ == "__main__":
    put_checkout_on_path(os.environ.get("MEGATRON_LM_PATH", os.getcwd()), "pretrain_gpt_tsp.py")
    from megatron_tsp import megatron_lm

    megatron_lm.prepare_launch(sys.argv)  # before CUDA starts
    sys.argv = megatron_lm.translate_argv(sys.argv)
    prepare_device()
    megatron_lm.main()
