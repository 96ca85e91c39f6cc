"""Offline compilation: fill the kernel cache for a configuration, no GPU needed.

``python -m mok precompile --arch sm_90a [shape options]`` compiles every kernel variant
that the configuration's plan on that target lists (``mok.plan.plan_for(config, arch).variants()``)
into ``$MOK_CACHE_DIR``; a later process
on a GPU of that arch loads them from disk and compiles nothing.
"""

from __future__ import annotations

import sys
import tempfile
import time
from typing import TextIO

from ..config import MoKConfig
from ..kernels import get_kernel
from .arch import normalize_arch
from .cache import CacheStats, KernelCache


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = width * done // max(total, 1)
    return "[" + "#" * filled + "." * (width - filled) + f"] {done}/{total}"


def precompile(config: MoKConfig, arch: str, cache: KernelCache, out: TextIO | None = None) -> CacheStats:
    """Compile (or find on disk) every kernel ``config`` needs for ``arch``; returns what was done.
    Raises ValueError, before compiling anything, for a configuration whose layer does not run on
    ``arch`` (the plan says why). Progress goes to ``out`` (default: the current sys.stderr)."""
    from ..plan import plan_for

    out = sys.stderr if out is None else out
    arch = normalize_arch(arch)
    try:
        variants = plan_for(config, arch).variants()
    except NotImplementedError as why:
        raise ValueError(f"precompile: a layer of this configuration does not run on {arch}: {why}") from None
    try:  # (a cache a process cannot write is only read, what it lacks compiled in memory: here that is an error)
        cache.directory.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=cache.directory).close()
    except OSError as err:
        raise OSError(f"precompile: cannot write to the cache directory {cache.directory}: {err.strerror or err}") from None
    before = CacheStats(**vars(cache.stats))
    for i, variant in enumerate(variants):
        out.write(f"\r{_bar(i, len(variants))} {variant.describe()} for {arch} ...")
        out.flush()
        start = time.perf_counter()
        get_kernel(variant, arch, cache)
        out.write(f"\r{_bar(i + 1, len(variants))} {variant.describe()} for {arch}: {time.perf_counter() - start:.2f}s\n")
    return CacheStats(
        compiles=cache.stats.compiles - before.compiles,
        disk_loads=cache.stats.disk_loads - before.disk_loads,
        memory_hits=cache.stats.memory_hits - before.memory_hits,
    )
