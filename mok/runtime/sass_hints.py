"""Warp-scheduling hints in compiled Hopper code: the FP8 promotion's FFMAs allowed to yield.

Every 128 of K the FP8 kernels promote a block's product into the running sums, one FFMA per
accumulator value (mok/kernels/sm90/block_scaled.py): runs of 64 FFMAs a thread that share one
scale operand. ptxas marks every other one of them to keep its warp issuing (control bit 45 of the
128-bit sm_90 instruction) so that the shared operand can come from the operand-reuse cache (bits
58-61). The hypothesis: while a warp runs such a burst, the scheduler of its SM sub-partition turns
less to the other warps there (the other MMA warpgroup's WGMMA issue and barrier waits, the
producer's TMA issue). Clearing both bits on those FFMAs (all of a burst's, or those of its first
part) lets the scheduler switch warps there; the shared operand is then read from the register
file. The arithmetic is untouched: the same instructions, operands and order, so the same bits.
(The bits' meaning is NVIDIA's and not documented; it is known from disassembly, and DeepSeek's
DeepGEMM reported its FP8 kernels faster with part of its FFMAs so marked.)

The hints are applied to the cubins a compiled kernel's object file embeds (CuTe DSL's
``export_to_c`` stores each as raw bytes), by the kernel cache (mok/runtime/cache.py) before it
loads the object: only sm_90 cubins, only FFMAs inside runs of them (the promotions), nothing else.
Off by default (mok.kernels.variants.PROMOTIONS_YIELD, the share of each burst): on an H100 the
forward's FP8 GEMMs ran 0-10% slower with half or all of every burst's, and the weight gradient
gained at neither share (docs/notes/fp8-block-hopper.md).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

EM_CUDA = 190  # the ELF machine of a cubin
FFMA_REGISTERS = 0x223  # the low 12 bits of FFMA Rd, Ra, Rb, Rc in sm_90's encoding
KEEP_ISSUING = 1 << 45  # control bit of the instruction's high 64 bits: do not switch warps after it
OPERAND_REUSE = 0xF << 58  # control bits: keep these operands in the reuse cache for the next instruction
INSTRUCTION_BYTES = 16


def embedded_cubins(data: bytes, sm: int) -> list[int]:
    """Offsets of the sm_``sm`` cubins inside ``data`` (a cubin, or an object file embedding some):
    64-bit ELF images of machine EM_CUDA whose flags name that SM."""
    found, at = [], data.find(b"\x7fELF")
    while at != -1:
        if len(data) >= at + 64 and data[at + 4] == 2 and struct.unpack_from("<H", data, at + 18)[0] == EM_CUDA:
            flags = struct.unpack_from("<I", data, at + 0x30)[0]
            if (flags >> 8) & 0xFF == sm:
                found.append(at)
        at = data.find(b"\x7fELF", at + 1)
    return found


def code_sections(data: bytes, base: int) -> Iterator[tuple[str, int, int]]:
    """(name, offset in ``data``, size) of each ``.text.*`` section of the cubin at ``base``."""
    section_table = struct.unpack_from("<Q", data, base + 0x28)[0]
    entry_size, entries, names_index = struct.unpack_from("<HHH", data, base + 0x3A)

    def section(i: int) -> tuple:  # (name offset, type, flags, address, offset, size, ...)
        return struct.unpack_from("<IIQQQQIIQQ", data, base + section_table + i * entry_size)

    names = base + section(names_index)[4]
    for i in range(entries):
        name_at, _, _, _, offset, size, *_ = section(i)
        name = data[names + name_at: data.index(b"\0", names + name_at)].decode()
        if name.startswith(".text."):
            yield name, base + offset, size


def ffma_runs(words: list[tuple[int, int]], least: int = 8, gap: int = 4) -> list[list[int]]:
    """Indices of the FFMAs (register form) of each run in ``words`` (an instruction's two 64-bit
    words each): FFMAs at most ``gap`` instructions apart, at least ``least`` of them (the
    promotions' bursts, not an epilogue's scattered FFMAs)."""
    runs: list[list[int]] = []
    current: list[int] = []
    for i, (low, _) in enumerate(words):
        if low & 0xFFF != FFMA_REGISTERS:
            continue
        if current and i - current[-1] > gap:
            runs.append(current)
            current = []
        current.append(i)
    runs.append(current)
    return [r for r in runs if len(r) >= least]


def let_promotions_yield(data: bytearray, share: float = 1.0) -> int:
    """In every run of FFMAs of the sm_90 code in ``data`` (:func:`ffma_runs`), clear the keep-issuing
    and reuse bits of those among the run's first ``share`` of FFMAs that have both, in place (a
    share below 1 lets the warp yield early in the burst and finish it without switching); returns
    how many were changed."""
    changed, original = 0, bytes(data)  # (the patches below touch no ELF header or section table)
    for base in embedded_cubins(original, 90):
        for _, offset, size in code_sections(original, base):
            words = [struct.unpack_from("<QQ", original, offset + i * INSTRUCTION_BYTES) for i in range(size // INSTRUCTION_BYTES)]
            for run in ffma_runs(words):
                for i in run[: round(share * len(run))]:
                    high = words[i][1]
                    if high & KEEP_ISSUING and high & OPERAND_REUSE:
                        struct.pack_into("<Q", data, offset + i * INSTRUCTION_BYTES + 8, high & ~(KEEP_ISSUING | OPERAND_REUSE))
                        changed += 1
    return changed
