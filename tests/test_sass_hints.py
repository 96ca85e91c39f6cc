"""The FP8 promotion's warp-scheduling hints (mok/runtime/sass_hints.py) on compiled sm_90 code, and
their way through the kernel cache: compiled here, no GPU (tests/test_fp8_block_gpu.py runs the
patched kernels)."""

from __future__ import annotations

import struct

import pytest

from mok.kernels import compiled_cubin, cuobjdump, disassembled, get_kernel, variants
from mok.kernels.variants import grouped_gemm_variant
from mok.runtime.cache import KernelCache
from mok.runtime.sass_hints import (FFMA_REGISTERS, INSTRUCTION_BYTES, KEEP_ISSUING, OPERAND_REUSE, code_sections, embedded_cubins,
                                    ffma_runs, let_promotions_yield)


@pytest.fixture(scope="module")
def gate_up_cubin() -> bytes:
    """The FP8 gate/up GEMM's cubin (stacked SwiGLU, h saved, a out in E4M3), as ptxas made it."""
    return compiled_cubin(grouped_gemm_variant(2048, 7168, epilogue="swiglu_save", tile_n=64, operand="e4m3_block",
                                               out_format="e4m3_block"), "sm_90a")


def instructions(binary: bytes) -> list[tuple[int, int]]:
    """(low, high) 64-bit words of every instruction of the sm_90 cubin's code sections in ``binary``."""
    (base,) = embedded_cubins(binary, 90)
    found = []
    for _, offset, size in code_sections(binary, base):
        found += [struct.unpack_from("<QQ", binary, offset + i * INSTRUCTION_BYTES) for i in range(size // INSTRUCTION_BYTES)]
    return found


def marked(word: tuple[int, int]) -> bool:
    """An FFMA of register operands with both the keep-issuing and a reuse bit."""
    low, high = word
    return low & 0xFFF == FFMA_REGISTERS and bool(high & KEEP_ISSUING) and bool(high & OPERAND_REUSE)


@pytest.mark.parametrize("share", [1.0, 0.5])
def test_only_the_promotions_ffmas_lose_their_keep_issuing_and_reuse_bits(gate_up_cubin, share):
    """Each instruction that changes is an FFMA of register operands whose low word (opcode,
    registers) stays and whose high word loses exactly the keep-issuing and reuse bits it had; at
    least one promotion's worth change (a promotion keeps every other FFMA so marked, for the shared
    scale's reuse); with share 1 no run of FFMAs (sass_hints.ffma_runs) keeps a marked FFMA, with
    1/2 only each run's second half does; the cubin's length stays, and its disassembly differs only in those FFMAs' ``.reuse``."""
    patched = bytearray(gate_up_cubin)
    changed = let_promotions_yield(patched, share)
    before, after = instructions(gate_up_cubin), instructions(bytes(patched))
    differing = [(b, a) for b, a in zip(before, after) if b != a]
    assert len(differing) == changed >= 32 / share and len(patched) == len(gate_up_cubin)
    for (low, high), (low_after, high_after) in differing:
        assert marked((low, high)) and low_after == low and high_after == high & ~(KEEP_ISSUING | OPERAND_REUSE)
    for burst in ffma_runs(before):
        first = burst[: round(share * len(burst))]
        assert not any(marked(after[i]) for i in first)
        assert all(after[i] == before[i] for i in burst[len(first):])
    if cuobjdump() is None:
        pytest.skip("no cuobjdump: the dev extra's nvidia-cuda-cuobjdump")
    lines_before, lines_after = disassembled(gate_up_cubin).splitlines(), disassembled(bytes(patched)).splitlines()
    text = [(b, a) for b, a in zip(lines_before, lines_after) if b != a and not b.strip().startswith("/* 0x")]
    assert len(lines_before) == len(lines_after) and len(text) == changed
    for b, a in text:
        assert " FFMA " in b and ".reuse" in b and ".reuse" not in a and b.split("/*")[-1] == a.split("/*")[-1]


def test_other_architectures_and_plain_bytes_are_left_alone(gate_up_cubin):
    """A cubin for another SM (its ELF flags saying sm_100) and bytes with no cubin pass unchanged."""
    other = bytearray(gate_up_cubin)
    flags = struct.unpack_from("<I", other, 0x30)[0]
    struct.pack_into("<I", other, 0x30, (flags & ~0xFF00) | (100 << 8))
    untouched = bytes(other)
    assert let_promotions_yield(other) == 0 and bytes(other) == untouched
    plain = bytearray(b"\x7fELF not a cubin" * 8)
    assert let_promotions_yield(plain) == 0 and plain == bytearray(b"\x7fELF not a cubin" * 8)


def test_fp8_variants_carry_the_hints_when_asked_and_the_cache_stores_them_patched(tmp_path, monkeypatch):
    """variants.PROMOTIONS_YIELD a share: FP8 (e4m3_block) variants name it in their config and carry
    the patch (0, or bf16: neither; a share past 1 refused); get_kernel stores the patched object
    (its sm_90 cubin's FFMA runs without marked FFMAs, where the compiled cubin has them) and hands
    back the kernel loaded from it; a second cache on the same folder loads it without compiling."""
    monkeypatch.setattr(variants, "PROMOTIONS_YIELD", 0.0)
    plain = grouped_gemm_variant(1024, 512, operand="e4m3_block")
    assert plain.patch_binary is None and "yield_hints" not in plain.config
    monkeypatch.setattr(variants, "PROMOTIONS_YIELD", 1.5)
    with pytest.raises(ValueError, match=r"PROMOTIONS_YIELD: expected a share in \[0, 1\], got 1.5"):
        grouped_gemm_variant(1024, 512, operand="e4m3_block")
    monkeypatch.setattr(variants, "PROMOTIONS_YIELD", 1.0)
    hinted = grouped_gemm_variant(1024, 512, operand="e4m3_block")
    assert hinted.config == {**plain.config, "yield_hints": 1.0} and hinted.patch_binary is not None
    assert grouped_gemm_variant(1024, 512).patch_binary is None
    cache = KernelCache(tmp_path)
    assert get_kernel(hinted, "sm_90a", cache) is not None and (cache.stats.compiles, cache.stats.disk_loads) == (1, 0)
    (entry,) = cache.entries()
    with open(entry["path"], "rb") as f:
        stored = instructions(f.read())
    compiled = instructions(compiled_cubin(hinted, "sm_90a"))
    assert any(marked(compiled[i]) for burst in ffma_runs(compiled) for i in burst)
    assert not any(marked(stored[i]) for burst in ffma_runs(stored) for i in burst)
    fresh = KernelCache(tmp_path)
    assert get_kernel(hinted, "sm_90a", fresh) is not None and fresh.stats.compiles == 0 and fresh.stats.disk_loads == 1
