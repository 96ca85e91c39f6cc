"""MoK's CuTe DSL kernels and how one is named, compiled and cached.

A :class:`KernelVariant` names one kernel specialisation by static configuration and knows how
to compile it for a target; :mod:`mok.kernels.variants` has one constructor per kernel family,
:func:`get_kernel` compiles a variant on first use and caches it (memory and disk). The device
code: ``common/`` (arch-neutral: schedule, flags and barriers, exchanges, quantization,
combine, epilogue math, launch-argument records), ``sm90/`` (WGMMA + TMA mainloops),
``sm100/`` (tcgen05 + tensor-memory mainloops).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class KernelVariant:
    """One compiled kernel: ``name`` + static ``config``; ``compile(arch, options)`` builds it.
    ``patch_binary``: applied to its exported object's bytes before the cache loads it (scheduling
    hints only: mok/runtime/sass_hints.py; the config names it, so that it has entries of its own)."""

    name: str
    config: Mapping[str, Any]
    compile: Callable[[str, str], Any] = field(compare=False, repr=False)
    patch_binary: Callable[[bytearray], int] | None = field(default=None, compare=False, repr=False)

    def describe(self) -> str:
        params = ", ".join(f"{k}={v}" for k, v in sorted(self.config.items()))
        return f"{self.name}({params})"


def get_kernel(variant: KernelVariant, arch: str, cache: "Any | None" = None) -> Any:
    """The compiled kernel for ``arch``: JIT-compiled on first use, then cached (memory and disk)."""
    from ..runtime.arch import dsl_target, normalize_arch
    from ..runtime.cache import default_cache
    from ..runtime.launch import compile_options

    cache = cache if cache is not None else default_cache()
    fn = cache.loaded(variant.name, variant.config, arch)  # the per-call path: one dict lookup
    if fn is not None:
        return fn
    arch = normalize_arch(arch)
    with dsl_target(arch):  # compile and export for arch, whatever GPU this machine has
        return cache.get(variant.name, variant.config, arch, lambda: variant.compile(arch, compile_options()), variant.patch_binary)


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


def cuobjdump() -> str | None:
    """The cuobjdump that disassembles cubins: the CUDA toolkit's on PATH, else the one the
    nvidia-cuda-cuobjdump wheel installs beside nvidia-cuda-nvdisasm's nvdisasm, which it runs
    (the dev extra: a machine without a toolkit), else None."""
    import shutil

    found = shutil.which("cuobjdump")
    if found is None:
        try:
            import nvidia.cu13 as cuda_wheels  # (the namespace NVIDIA's CUDA 13 wheels install into)
        except ImportError:
            return None
        candidates = (os.path.join(root, "bin", "cuobjdump") for root in cuda_wheels.__path__)
        found = next((c for c in candidates if os.access(c, os.X_OK)), None)
    return found


def compiled_cubin(variant: KernelVariant, arch: str) -> bytes:
    """The cubin of a fresh compile of ``variant`` for ``arch``, as ptxas made it (bypasses the cache
    and ``variant.patch_binary``)."""
    import glob

    from ..runtime.arch import dsl_target, normalize_arch

    arch = normalize_arch(arch)
    with dsl_target(arch), tempfile.TemporaryDirectory() as dump_dir:
        variant.compile(arch, f"--keep-cubin --dump-dir {dump_dir}")
        (cubin,) = glob.glob(os.path.join(dump_dir, "*.cubin"))
        with open(cubin, "rb") as f:
            return f.read()


def required_cuobjdump() -> str:
    """:func:`cuobjdump`, or a RuntimeError saying how to get one."""
    tool = cuobjdump()
    if tool is None:
        raise RuntimeError("disassembling needs cuobjdump: the CUDA toolkit's on PATH, or `pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`")
    return tool


def disassembled(cubin: bytes) -> str:
    """SASS text of a cubin (``cuobjdump -sass``; :func:`cuobjdump` says which)."""
    import subprocess

    tool = required_cuobjdump()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout


def compiled_sass(variant: KernelVariant, arch: str) -> str:
    """SASS (``cuobjdump -sass``) of a fresh compile of ``variant`` for ``arch``: what ptxas made of
    the PTX, for any target on any machine that has cuobjdump (:func:`cuobjdump`; bypasses the cache)."""
    required_cuobjdump()  # (before the compile)
    return disassembled(compiled_cubin(variant, arch))
