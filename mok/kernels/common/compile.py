"""Compiling a kernel without tensors: its launch-argument record's stand-ins (common/launch_args.py)."""

from __future__ import annotations

import warnings

import cutlass.cute as cute

from .launch_args import LaunchArgs


def compile_kernel(kernel, record: LaunchArgs, arch: str, options: str = ""):
    """``cute.compile`` of ``kernel`` (its ``__call__`` takes ``record``'s arguments) for ``arch``
    without tensors: the record's stand-ins. (The epilogues' value loops are static on purpose,
    register indexing: the DSL's warning about their length is silenced.)"""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This static loop has")
        return cute.compile(kernel, *record.stand_ins(), options=f"--gpu-arch {arch} {options}".strip())
