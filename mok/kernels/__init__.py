"""Registry of MoK's compiled kernels.

A :class:`KernelVariant` names one kernel specialisation by static configuration only
(shapes, top-k, flags, never token counts) and knows how to compile it for a target.
``variants_for(config)`` lists every variant a layer configuration needs; the ops and
the offline precompiler both ask it, so they always agree on what exists.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..config import MoKConfig


@dataclass(frozen=True)
class KernelVariant:
    """One compiled kernel: ``name`` + static ``config``; ``compile(arch, options)`` builds it."""

    name: str
    config: Mapping[str, Any]
    compile: Callable[[str, str], Any] = field(compare=False, repr=False)

    def describe(self) -> str:
        params = ", ".join(f"{k}={v}" for k, v in sorted(self.config.items()))
        return f"{self.name}({params})"


def combine_variant(hidden: int, topk: int, has_shared: bool) -> KernelVariant:
    """The final weighted combine of k expert rows (plus the shared expert's row) per token."""

    def build(arch: str, options: str = "") -> Any:
        from .common.combine import compile_combine

        return compile_combine(hidden, topk, has_shared, arch, options)

    return KernelVariant("combine", {"hidden": hidden, "topk": topk, "has_shared": has_shared}, build)


def variants_for(config: MoKConfig) -> list[KernelVariant]:
    """Every kernel variant a layer with this configuration uses (the same for every arch so far)."""
    return [combine_variant(config.hidden, config.topk, config.has_shared_expert)]


def get_kernel(variant: KernelVariant, arch: str, cache: "Any | None" = None) -> Any:
    """The compiled kernel for ``arch``: JIT-compiled on first use, then cached (memory and disk)."""
    from ..runtime.arch import dsl_target, normalize_arch
    from ..runtime.cache import default_cache

    arch = normalize_arch(arch)
    cache = cache if cache is not None else default_cache()

    with dsl_target(arch):  # compile and export for arch, whatever GPU this machine has
        return cache.get(variant.name, variant.config, arch, lambda: variant.compile(arch, ""))


def compiled_ptx(variant: KernelVariant, arch: str) -> str:
    """PTX of a fresh compile of ``variant`` for ``arch`` (for inspection and tests; bypasses the cache)."""
    from ..runtime.arch import dsl_target, normalize_arch

    arch = normalize_arch(arch)
    with dsl_target(arch), tempfile.TemporaryDirectory() as dump_dir:  # --keep-ptx also writes a file: keep it out of the cwd
        ptx = variant.compile(arch, f"--keep-ptx --dump-dir {dump_dir}").__ptx__
        if ptx and len(ptx) < 4096 and os.path.exists(ptx):  # some DSL versions hand back the path
            with open(ptx) as f:
                ptx = f.read()
    if not ptx:
        raise RuntimeError(f"CuTe DSL returned no PTX for {variant.describe()} on {arch}")
    return ptx
