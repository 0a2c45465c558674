"""Running a job: config, modes, model build, training step and loop, data, checkpoints,
launching ranks, and the megatron-core compatibility shims.

May import ``megatron_tsp.core`` (and ``env``, ``errors``); never ``megatron_tsp.measure``.
"""
