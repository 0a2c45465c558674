#!/usr/bin/env python
"""Megatron-LM's pretrain_gpt.py with ``--tsp-size``.

Needs a Megatron-LM checkout at tag core_v0.16.1 (``MEGATRON_LM_PATH``, default: the current
directory) and megatron_tsp installed. Takes every pretrain_gpt.py flag plus ``--tsp-size D``:

    MEGATRON_LM_PATH=/path/to/Megatron-LM torchrun --nproc-per-node 8 \\
        scripts/pretrain_gpt_tsp.py $(megatron-tsp args configs/7b/128k-tsp8.yaml) ...
"""

import os
import sys

CHECKOUT = os.environ.get("MEGATRON_LM_PATH", os.getcwd())
if not os.path.isfile(os.path.join(CHECKOUT, "pretrain_gpt.py")):
    where = f"MEGATRON_LM_PATH={CHECKOUT}" if "MEGATRON_LM_PATH" in os.environ else f"the current directory {CHECKOUT}"
    sys.exit(f"pretrain_gpt_tsp.py: error: {where} is not a Megatron-LM checkout (no pretrain_gpt.py); set "
             "MEGATRON_LM_PATH to a checkout at tag core_v0.16.1")
sys.path.insert(0, CHECKOUT)

from megatron_tsp import megatron_lm  # noqa: E402

if __name__ == "__main__":
    sys.argv = megatron_lm.translate_argv(sys.argv)
    megatron_lm.main()
