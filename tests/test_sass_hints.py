"""The FP8 promotion's warp-scheduling hints (mok/runtime/sass_hints.py) on compiled sm_90 code, and
their way through the kernel cache: compiled here, no GPU (tests/test_fp8_block_gpu.py runs the
patched kernels)."""

from __future__ import annotations

import struct

import pytest

from mok.kernels import compiled_cubin, cuobjdump, disassembled, get_kernel, variants
from mok.kernels.variants import grouped_gemm_variant
from mok.runtime.cache import KernelCache
from mok.runtime.sass_hints import FFMA_REGISTERS, INSTRUCTION_BYTES, KEEP_ISSUING, OPERAND_REUSE, code_sections, embedded_cubins, let_promotions_yield


@pytest.fixture(scope="module")
def gate_up_cubin() -> bytes:
    """The FP8 gate/up GEMM's cubin (stacked SwiGLU, h saved, a out in E4M3), as ptxas made it."""
    return compiled_cubin(grouped_gemm_variant(2048, 7168, epilogue="swiglu_save", tile_n=64, operand="e4m3_block",
                                               out_format="e4m3_block"), "sm_90a")


def instructions(cubin: bytes) -> list[tuple[int, int]]:
    """(low, high) 64-bit words of every instruction of the sm_90 cubin's code sections."""
    (base,) = embedded_cubins(cubin, 90)
    found = []
    for _, offset, size in code_sections(cubin, base):
        found += [struct.unpack_from("<QQ", cubin, offset + i * INSTRUCTION_BYTES) for i in range(size // INSTRUCTION_BYTES)]
    return found


def marked_ffmas_in_runs(binary: bytes) -> int:
    """FFMAs of the sm_90 code in ``binary`` with both bits set and eight FFMAs within eight instructions."""
    found = instructions(binary)
    ffma = [low & 0xFFF == FFMA_REGISTERS for low, _ in found]
    return sum(1 for i, (_, high) in enumerate(found)
               if ffma[i] and high & KEEP_ISSUING and high & OPERAND_REUSE and sum(ffma[max(0, i - 8): i + 9]) - 1 >= 8)


def test_only_the_promotions_ffmas_lose_their_keep_issuing_and_reuse_bits(gate_up_cubin):
    """Each instruction that changes is an FFMA of register operands whose low word (opcode,
    registers) stays and whose high word loses exactly the keep-issuing and reuse bits it had; at
    least one promotion's worth change (the promotions' FFMAs keep every other one so marked for the
    shared scale's reuse), every FFMA left with both bits stands apart from a run; the cubin's other
    bytes stay, and the disassembly differs only in those FFMAs' ``.reuse``."""
    patched = bytearray(gate_up_cubin)
    changed = let_promotions_yield(patched)
    before, after = instructions(gate_up_cubin), instructions(bytes(patched))
    differing = [(b, a) for b, a in zip(before, after) if b != a]
    assert len(differing) == changed >= 64
    for (low, high), (low_after, high_after) in differing:
        assert low & 0xFFF == FFMA_REGISTERS and low_after == low
        assert high & KEEP_ISSUING and high & OPERAND_REUSE
        assert high_after == high & ~(KEEP_ISSUING | OPERAND_REUSE)
    assert marked_ffmas_in_runs(gate_up_cubin) == changed and marked_ffmas_in_runs(bytes(patched)) == 0
    assert sum(x != y for x, y in zip(gate_up_cubin, patched)) <= 8 * changed and len(patched) == len(gate_up_cubin)
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
    """variants.PROMOTIONS_YIELD on: FP8 (e4m3_block) variants name the hints in their config and
    carry the patch (off, or bf16: neither); get_kernel stores the patched object (its sm_90
    cubin's promotion FFMAs without the two bits, where the compiled cubin has them) and hands back
    the kernel loaded from it; a second cache on the same folder loads it without compiling."""
    monkeypatch.setattr(variants, "PROMOTIONS_YIELD", False)
    plain = grouped_gemm_variant(1024, 512, operand="e4m3_block")
    assert plain.patch_binary is None and "yield_hints" not in plain.config
    monkeypatch.setattr(variants, "PROMOTIONS_YIELD", True)
    hinted = grouped_gemm_variant(1024, 512, operand="e4m3_block")
    assert hinted.config == {**plain.config, "yield_hints": True} and hinted.patch_binary is let_promotions_yield
    assert grouped_gemm_variant(1024, 512).patch_binary is None
    cache = KernelCache(tmp_path)
    assert get_kernel(hinted, "sm_90a", cache) is not None and (cache.stats.compiles, cache.stats.disk_loads) == (1, 0)
    (entry,) = cache.entries()
    with open(entry["path"], "rb") as f:
        stored = f.read()
    assert marked_ffmas_in_runs(compiled_cubin(hinted, "sm_90a")) > 0 and marked_ffmas_in_runs(stored) == 0
    fresh = KernelCache(tmp_path)
    assert get_kernel(hinted, "sm_90a", fresh) is not None and fresh.stats.compiles == 0 and fresh.stats.disk_loads == 1
