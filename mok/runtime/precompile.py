"""Offline compilation: fill the kernel cache for a configuration, no GPU needed.

``python -m mok precompile --arch sm_90a [shape options]`` compiles every kernel variant
that ``mok.kernels.variants_for(config, arch)`` lists into ``$MOK_CACHE_DIR``; a later process
on a GPU of that arch loads them from disk and compiles nothing.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from ..config import MoKConfig
from ..kernels import get_kernel, unsupported_on, variants_for
from .arch import normalize_arch
from .cache import CacheStats, KernelCache


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = width * done // max(total, 1)
    return "[" + "#" * filled + "." * (width - filled) + f"] {done}/{total}"


def precompile(config: MoKConfig, arch: str, cache: KernelCache, out: TextIO = sys.stderr) -> CacheStats:
    """Compile (or find on disk) every kernel ``config`` needs for ``arch``; returns what was done.
    Raises ValueError, before compiling anything, for a configuration whose layer does not run on
    ``arch`` (mok.kernels.unsupported_on says why)."""
    arch = normalize_arch(arch)
    why = unsupported_on(config, arch)
    if why is not None:
        raise ValueError(f"precompile: a layer of this configuration does not run on {arch}: {why}")
    variants = variants_for(config, arch)
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
