"""Imported first by the ranks' fork server (:mod:`megatron_tsp.run.launch`), before torch.

The server leaves the terminal's process group: a Ctrl-C, which the terminal sends to that
whole group, then reaches the launcher only, not the server while it imports torch nor a rank
before it has set itself up. The launcher handles it (and kills the ranks). The server still
ends with the launcher: it exits when its last client is gone.
"""

import os

os.setpgid(0, 0)
