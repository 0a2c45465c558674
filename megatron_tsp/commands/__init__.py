"""The subcommands of ``megatron-tsp``: each a parser function and the function that runs it,
in :mod:`training` (env, args, train) and :mod:`measuring` (memory, predict, plan, bench,
calibrate, gpu-check, compare), on the argument types and result files of :mod:`shared`.
:mod:`megatron_tsp.cli` assembles the parser and runs one.

May import every part of the package but the command line's own module.
"""
