"""Calling conventions (mok/runtime/launch.py): what each passes, and TVM-FFI kernels through the cache (no GPU needed)."""

import importlib.util

import pytest
import torch

from mok.kernels import get_kernel
from mok.kernels.variants import combine_variant
from mok.runtime import launch
from mok.runtime.cache import KernelCache

HAS_TVM_FFI = importlib.util.find_spec("tvm_ffi") is not None


@pytest.fixture
def calling(monkeypatch):
    """Select a calling convention for the test (the choice is cached per process: reset around it)."""

    def select(name: str) -> None:
        monkeypatch.setenv(launch.TVM_FFI_ENV, "1" if name == "tvm_ffi" else "0")
        launch.convention.cache_clear()
        assert launch.convention() == name

    yield select
    monkeypatch.undo()
    launch.convention.cache_clear()


def test_tvm_ffi_is_the_default_where_it_imports_and_env_zero_opts_out(monkeypatch):
    monkeypatch.delenv(launch.TVM_FFI_ENV, raising=False)
    launch.convention.cache_clear()
    try:
        assert launch.convention() == ("tvm_ffi" if HAS_TVM_FFI else "dsl")
        monkeypatch.setenv(launch.TVM_FFI_ENV, "0")
        launch.convention.cache_clear()
        assert launch.convention() == "dsl"
    finally:
        launch.convention.cache_clear()


def test_dsl_convention_passes_the_dsls_own_pointer_and_scalar_objects(calling):
    import cutlass
    from cutlass.cute.runtime import make_ptr

    calling("dsl")
    assert launch.compile_options() == ""
    t = torch.zeros(8, 8, dtype=torch.bfloat16)
    for name, dtype, align in (("bf16", cutlass.BFloat16, 16), ("f32", cutlass.Float32, 4), ("i32", cutlass.Int32, 4)):
        got, want = launch.ptr(name, t, align), make_ptr(dtype, t.data_ptr(), cutlass.cute.AddressSpace.gmem, assumed_align=align)
        assert type(got) is type(want) and got._dtype is want._dtype
        assert (got._pointer, got._addr_space, got._assumed_align) == (want._pointer, want._addr_space, want._assumed_align)
    assert launch.ptr("bf16", None)._pointer == 0  # an argument the kernel does not use: null
    assert type(launch.i32(7)) is cutlass.Int32 and launch.i32(7).value == 7
    assert type(launch.i64(2**40)) is cutlass.Int64 and launch.i64(2**40).value == 2**40


@pytest.mark.skipif(not HAS_TVM_FFI, reason="needs apache-tvm-ffi")
def test_tvm_ffi_convention_passes_plain_ints(calling):
    calling("tvm_ffi")
    assert launch.compile_options() == "--enable-tvm-ffi"
    t = torch.zeros(8, 8, dtype=torch.bfloat16)
    assert launch.ptr("bf16", t) == t.data_ptr() and launch.ptr("i32", None, 4) == 0
    assert launch.i32(7) == 7 and launch.i64(2**40) == 2**40


def test_the_cache_keeps_each_conventions_kernels_apart(calling, tmp_path):
    variant = combine_variant(64, 2, True)
    calling("dsl")
    cache = KernelCache(tmp_path)
    get_kernel(variant, "sm_90a", cache)
    if HAS_TVM_FFI:
        calling("tvm_ffi")
        get_kernel(variant, "sm_90a", cache)
    assert cache.stats.compiles == (2 if HAS_TVM_FFI else 1)
    assert sorted(e["key"]["calling"] for e in cache.entries()) == (["dsl", "tvm_ffi"] if HAS_TVM_FFI else ["dsl"])


@pytest.mark.skipif(not HAS_TVM_FFI, reason="needs apache-tvm-ffi")
@pytest.mark.skipif(torch.cuda.is_available(), reason="calls a kernel with host addresses: only where no GPU can run it")
def test_tvm_ffi_kernel_from_disk_takes_the_launch_arguments_and_checks_them(calling, tmp_path):
    """A TVM-FFI kernel compiled, stored and loaded back by a fresh cache accepts the arguments
    MoK passes (ints for pointers, sizes and the stream) up to the CUDA launch, which fails here
    for want of a GPU; wrong argument counts and types are refused with a TypeError first."""
    calling("tvm_ffi")
    variant = combine_variant(64, 2, False, gathered=True)
    get_kernel(variant, "sm_90a", KernelCache(tmp_path))
    fresh = KernelCache(tmp_path)
    kernel = get_kernel(variant, "sm_90a", fresh)
    assert (fresh.stats.compiles, fresh.stats.disk_loads) == (0, 1)
    y, out = torch.zeros(16, 64, dtype=torch.bfloat16), torch.zeros(8, 64, dtype=torch.bfloat16)
    slot_row, w = torch.zeros(8, 2, dtype=torch.int32), torch.zeros(8, 2)
    args = [launch.ptr("bf16", y), launch.ptr("i32", slot_row, 4), launch.ptr("f32", w, 4), launch.ptr("bf16", None),
            launch.ptr("bf16", out), launch.i32(8), launch.i32(16), 0]
    with pytest.raises(RuntimeError, match="CUDA|cuda"):
        kernel(*args)
    with pytest.raises(TypeError, match="Expects 8 parameters"):
        kernel(*args[:-1])
    with pytest.raises(TypeError, match="Mismatched type on argument #5"):
        kernel(*args[:5], 8.5, *args[6:])
