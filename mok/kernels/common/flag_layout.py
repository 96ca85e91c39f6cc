"""The layout of one rank's flag region in the expert-parallel workspace, in int32 words (plain
Python: the kernels and the host's workspace both read it; importing it loads no CuTe DSL).

    [0] epoch   [1, 1+W) published-by-rank   [1+W, 1+2W) done-by-rank
    [1+2W, 1+2W+4) error record   [5+2W] this rank's token count
    [6+2W, 10+2W) the grid-barrier words of this rank's one-launch forward
    [10+2W] the CTAs of this rank's publish launch that are done (the last one signals, resets it)

The error record is (1, phase, peer, epoch) for a wait that timed out, or (2, rank, rows
needed, capacity) when rank's experts were given more rows than a bounded capacity holds;
the first error stays.
"""

from __future__ import annotations

from ..constants import GRID_SYNC_WORDS

PHASE_PUBLISH, PHASE_DONE = 0, 1
ERROR_TIMEOUT, ERROR_CAPACITY = 1, 2


def flag_words(world: int) -> int:
    """int32 words of one rank's flag region (padded to 128 bytes)."""
    return -(-(publish_count_slot(world) + 1) // 32) * 32


def epoch_slot() -> int:
    return 0


def flag_slot(phase: int, peer: int, world: int) -> int:
    return 1 + phase * world + peer


def error_slot(world: int) -> int:
    return 1 + 2 * world


def tokens_slot(world: int) -> int:
    return 5 + 2 * world


def grid_sync_slot(world: int) -> int:
    """The first of the one-launch forward's grid-barrier words: per workspace and rank (not per
    stream: the ranks' CUDA graphs may all be captured on one stream and replayed at once)."""
    return 6 + 2 * world


def publish_count_slot(world: int) -> int:
    return grid_sync_slot(world) + GRID_SYNC_WORDS
