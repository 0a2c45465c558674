"""Measuring: memory tracker and planner, collective counts, performance model, what fits
(plan), benchmark, GPU check, log comparison, and their report writers.

May import ``megatron_tsp.core`` and ``megatron_tsp.run``; imported by nobody but the command line
(``megatron_tsp.cli`` and ``megatron_tsp.commands``).
"""
