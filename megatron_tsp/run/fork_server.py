"""Imported first by the ranks' fork server (:mod:`megatron_tsp.run.launch`), before torch.

The server leaves the terminal's process group: a Ctrl-C, which the terminal sends to that
whole group, then reaches the launcher only, not the server while it imports torch nor a rank
before it has set itself up. The launcher handles it (and kills the ranks). The server still
ends with the launcher: it exits when its last client is gone.

It ignores SIGTERM, which Slurm sends to every process of a job step: the ranks are the
server's children and die with it, and what SIGTERM means (save first, or stop now) is the
launcher's to decide. The ranks inherit the ignore until they install their own handler.

It ignores the warnings its imports print (megatron-core's about missing CUDA extensions),
and only those: the ranks inherit its filters, and every other warning reaches the user.
"""

import os
import signal

from megatron_tsp.env import quiet_import_noise

os.setpgid(0, 0)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
quiet_import_noise()
