"""The algorithm: TSP process groups, layers, schedules, the attention op, specs, and the
support matrix of what TSP runs.

May import megatron-core, torch, ``megatron_tsp.env`` and ``megatron_tsp.errors``; never
``megatron_tsp.run`` or ``megatron_tsp.measure``.
"""
