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


def combine_variant(hidden: int, topk: int, has_shared: bool, gathered: bool = False) -> KernelVariant:
    """The final weighted combine of k expert rows (plus the shared expert's row) per token."""

    def build(arch: str, options: str = "") -> Any:
        from .common.combine import compile_combine

        return compile_combine(hidden, topk, has_shared, gathered, arch, options)

    config = {"hidden": hidden, "topk": topk, "has_shared": has_shared, "gathered": gathered}
    return KernelVariant("combine", config, build)


def gather_variant(width: int) -> KernelVariant:
    """Row gather into the expert-grouped buffer (zeros for padding rows)."""

    def build(arch: str, options: str = "") -> Any:
        from .common.gather import compile_gather

        return compile_gather(width, arch, options)

    return KernelVariant("gather", {"width": width}, build)


def schedule_variant(num_local_experts: int, topk: int, block_m: int) -> KernelVariant:
    """Routing -> row slots on the GPU (one CTA), the device twin of mok/schedule.py."""

    def build(arch: str, options: str = "") -> Any:
        from .common.schedule import compile_schedule

        return compile_schedule(num_local_experts, topk, block_m, arch, options)

    return KernelVariant("schedule", {"experts": num_local_experts, "topk": topk, "block_m": block_m}, build)


def default_tile_n(n: int, k: int, swiglu: bool) -> int:
    """Column tile of the grouped GEMM, from static shapes only (batch invariance).

    SwiGLU holds two accumulators, so 128 wide; a plain GEMM takes 256 where N allows.
    Measured on H200 (perf/NOTES.md, 2026-12-01): two machines disagreed for the dsv3 down
    projection (128 ahead by 5% on one, 256 ahead by 12% on the other); 256 won at qwen3's.
    """
    return 256 if not swiglu and n % 256 == 0 else 128


def grouped_gemm_variant(n: int, k: int, swiglu: bool, tile_n: int | None = None, stages: int | None = None) -> KernelVariant:
    """Expert-grouped GEMM (sm_90a: WGMMA + TMA), with a SwiGLU epilogue for gate/up.

    ``stages``: shared-memory pipeline depth; None fills shared memory (one CTA per SM).
    """
    tile_n = default_tile_n(n, k, swiglu) if tile_n is None else tile_n

    def build(arch: str, options: str = "") -> Any:
        if arch != "sm_90a":
            raise NotImplementedError(f"grouped GEMM: only sm_90a has an implementation so far, not {arch}")
        from .sm90.grouped_gemm import compile_grouped_gemm

        return compile_grouped_gemm(n, k, swiglu, arch, options, tile_n=tile_n, stages=stages)

    config = {"n": n, "k": k, "swiglu": swiglu, "tile_n": tile_n, "stages": stages or 0}  # 0: as deep as fits
    return KernelVariant("grouped_gemm", config, build)


def variants_for(config: MoKConfig, arch: str = "sm_90a") -> list[KernelVariant]:
    """Every kernel variant a layer with this configuration uses on ``arch``."""
    h, i = config.hidden, config.intermediate
    variants = [
        schedule_variant(config.experts_per_rank, config.topk, config.block_m),
        gather_variant(h),
        combine_variant(h, config.topk, config.has_shared_expert, gathered=True),
    ]
    if arch == "sm_90a":
        variants += [grouped_gemm_variant(i, h, swiglu=True), grouped_gemm_variant(h, i, swiglu=False)]
        if config.has_shared_expert and config.shared_intermediate != i:
            s = config.shared_intermediate
            variants += [grouped_gemm_variant(s, h, swiglu=True), grouped_gemm_variant(h, s, swiglu=False)]
    return variants


def get_kernel(variant: KernelVariant, arch: str, cache: "Any | None" = None) -> Any:
    """The compiled kernel for ``arch``: JIT-compiled on first use, then cached (memory and disk)."""
    from ..runtime.arch import dsl_target, normalize_arch
    from ..runtime.cache import default_cache

    cache = cache if cache is not None else default_cache()
    fn = cache.loaded(variant.name, variant.config, arch)  # the per-call path: one dict lookup
    if fn is not None:
        return fn
    arch = normalize_arch(arch)
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
