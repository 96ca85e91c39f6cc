"""Sizes that kernels and their host-side callers both need (plain Python: importing it loads no CuTe DSL)."""

SCHEDULE_THREADS = 512  # threads per CTA of the schedule launch
GRID_SYNC_WORDS = 4  # int32 words of a grid barrier's state (common/waits.py: grid_barrier): arrived, generation, timeouts, left
