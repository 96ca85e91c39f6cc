"""How MoK passes arguments to its compiled kernels: CuTe DSL's TVM-FFI convention, or the DSL's own.

A MoK kernel takes raw pointers, 32/64-bit integers and a CUDA stream. With the DSL's own
convention every argument becomes a Python object (a ``cute.Pointer`` per address, a
``cutlass.Int32`` per integer) that the DSL then marshals through ctypes, 1-2 µs per argument
and ~15 arguments per GEMM launch. Kernels compiled with ``--enable-tvm-ffi`` take plain
Python ints for all three kinds and convert them in C: on an H200 a combine call costs 37 µs of
host time instead of 72, and an eager forward + backward of 256 tokens 0.87 ms instead of 2.04
(docs/notes/tvm-ffi.md). MoK uses TVM-FFI whenever the ``apache-tvm-ffi`` package (a
dependency) can be imported, unless ``MOK_TVM_FFI=0``; else the DSL's own. The choice is made
once per process, and the kernel cache keys entries by it (a kernel compiled for one
convention is never called with the other's arguments).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

TVM_FFI_ENV = "MOK_TVM_FFI"


@functools.cache
def convention() -> str:
    """"tvm_ffi" or "dsl" for this process (see the module docstring)."""
    if os.environ.get(TVM_FFI_ENV, "1") == "0" or importlib.util.find_spec("tvm_ffi") is None:
        return "dsl"
    return "tvm_ffi"


def compile_options() -> str:
    """The CuTe DSL compile options this process's calling convention needs."""
    return "--enable-tvm-ffi" if convention() == "tvm_ffi" else ""


@functools.cache
def _dsl():
    """CuTe DSL's pointer factory and scalar types, imported once."""
    import cutlass
    from cutlass.cute.runtime import make_ptr

    dtypes = {"bf16": cutlass.BFloat16, "f32": cutlass.Float32, "i32": cutlass.Int32, "e4m3": cutlass.Float8E4M3FN, "u8": cutlass.Uint8,
              "e8m0": cutlass.Float8E8M0FNU}
    return make_ptr, dtypes, cutlass.cute.AddressSpace.gmem, cutlass.Int32, cutlass.Int64


def ptr(dtype_name: str, t: torch.Tensor | None, align: int = 16):
    """A kernel's pointer argument: ``t``'s data (elements "bf16", "f32", "i32", "e4m3", "u8" or "e8m0", ``align``-byte
    aligned, as the kernel was compiled for), or null for an argument the kernel does not use."""
    address = 0 if t is None else t.data_ptr()
    if convention() == "tvm_ffi":
        return address
    make_ptr, dtypes, gmem, _, _ = _dsl()
    return make_ptr(dtypes[dtype_name], address, gmem, assumed_align=align)


def i32(value: int):
    """A kernel's 32-bit integer argument."""
    return value if convention() == "tvm_ffi" else _dsl()[3](value)


def i64(value: int):
    """A kernel's 64-bit integer argument."""
    return value if convention() == "tvm_ffi" else _dsl()[4](value)


def stream(device: torch.device):
    """The current CUDA stream of ``device``, as the kernel's stream argument. The kernels launch
    in the current device's context, so ``device`` must be the current device (else the launch
    would fail in the driver, or run on the wrong GPU): a clear error instead."""
    current = torch.cuda.current_device()
    if device.index is not None and device.index != current:
        raise ValueError(
            f"tensors on {device}, but the current CUDA device is cuda:{current}: MoK launches on the current device; "
            f"call torch.cuda.set_device({device.index}) or run under `with torch.cuda.device({device.index}):`"
        )
    handle = torch.cuda.current_stream(device).cuda_stream
    if convention() == "tvm_ffi":
        return handle
    import cuda.bindings.driver as cuda

    return cuda.CUstream(handle)
