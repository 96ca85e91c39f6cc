"""How fast can one SM pull gathered token rows into a GEMM's swizzled shared-memory stages?

    python perf/row_feed_probe.py [--configs qwen3,dsv3-e128] [--check] [--fc1]

The twenty-second session found the backward's GEMMs slower when they gathered their rows with
cp.async than when fed pre-gathered rows by TMA (perf/NOTES.md). This probe isolates the feed:
a persistent kernel (a producer warpgroup, one consumer warp that only waits for and releases
stages) fills 128-row x 64-column K-major stages (128-byte swizzle, as the grouped GEMM's A)
for every row tile and K tile of the schedule's rows, three ways:

    tma_tile   one TMA box of 128 rows from a pre-gathered rows buffer (what the GEMMs read now)
    tma_rows   one TMA box of 1 row per row, from the token matrix at row row_token[r] (a
               negative row is outside the tensor: TMA fills zeros); the box lands at the row's
               unswizzled offset and the TMA unit swizzles by the shared-memory address bits
    cp_async   16-byte zero-filling cp.async per thread, each address worked out every stage
               (as the gather producers did before the twenty-third session; they now work
               them out once a tile, see ``fc1``)

``--check`` has the consumer write every stage back through the swizzled layout and compares
with x[row_token] (zeros on padding): whether a 1-row TMA box lands where the swizzled layout
expects it. Prints ms and GB/s of stage bytes filled per mode. ``--fc1`` also times the
layer's gate/up GEMM fed pre-gathered rows by TMA against the same GEMM gathering them.
"""

from __future__ import annotations

import argparse

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass.cute.runtime import from_dlpack
from cutlass.tensor_utils import LayoutEnum

from mok import ops
from mok.bench import time_ms_interleaved
from mok.kernels.sm90.grouped_gemm import copy_async_16b
from mok.schedule import worst_case_capacity

from bench_layer import CONFIGS, make_inputs

TILE_M, TILE_K, STAGES = 128, 64, 6
MODES = ("tma_tile", "tma_rows", "cp_async")


class RowFeedProbe:
    """Static: the mode, K, whether the consumer writes the stages back. Runtime: x, rows, row_token, out."""

    def __init__(self, mode: str, k: int, check: bool):
        self.mode, self.k, self.check = mode, k, check

    @cute.jit
    def __call__(self, m_x: cute.Tensor, m_rows: cute.Tensor, m_token: cute.Tensor, m_out: cute.Tensor, grid: cutlass.Int32,
                 stream: cuda.CUstream):
        staged = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (TILE_M, 128, TILE_K), cutlass.BFloat16, STAGES)
        one_row = cute.make_composed_layout(staged.inner, 0, cute.make_layout((1, TILE_K), stride=(TILE_K, 1)))
        op = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        tma_tile, t_rows = cute.nvgpu.cpasync.make_tiled_tma_atom(op, m_rows, cute.slice_(staged, (None, None, 0)), (TILE_M, TILE_K))
        tma_row, t_x = cute.nvgpu.cpasync.make_tiled_tma_atom(op, m_x, one_row, (1, TILE_K))

        @cute.struct
        class Storage:
            full: cute.struct.MemRange[cutlass.Int64, STAGES]
            empty: cute.struct.MemRange[cutlass.Int64, STAGES]
            stages: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(staged)], 1024]

        self.storage = Storage
        self.kernel(tma_tile, t_rows, tma_row, t_x, m_x, m_token, m_out, staged).launch(grid=[grid, 1, 1], block=[160, 1, 1],
                                                                                   stream=stream)

    @cute.kernel
    def kernel(self, tma_tile, t_rows, tma_row, t_x, m_x, m_token, m_out, staged):
        tidx, _, _ = cute.arch.thread_idx()
        first, _, _ = cute.arch.block_idx()
        step, _, _ = cute.arch.grid_dim()
        storage = cutlass.memory.SmemAllocator().allocate(self.storage)
        full, empty = storage.full.data_ptr(), storage.empty.data_ptr()
        base = storage.stages.data_ptr()
        if tidx == 0:
            for s in cutlass.range_constexpr(STAGES):
                cute.arch.mbarrier_init(full + s, 128 if cutlass.const_expr(self.mode == "cp_async") else 1)
                cute.arch.mbarrier_init(empty + s, 1)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        num_rows = m_token.shape[0]
        k_tiles = self.k // TILE_K
        all_tiles = (num_rows + TILE_M - 1) // TILE_M * k_tiles
        stage, phase = cutlass.Int32(0), cutlass.Int32(0)
        linear = first
        if tidx < 128:  # producer warpgroup
            while linear < all_tiles:
                tile_row, k_tile = linear // k_tiles, linear % k_tiles
                cute.arch.mbarrier_wait(empty + stage, phase ^ 1)
                if cutlass.const_expr(self.mode == "cp_async"):
                    x_base = cute.make_ptr(cutlass.BFloat16, m_x.iterator.toint(), cute.AddressSpace.gmem, assumed_align=16)
                    chunk, row0 = tidx % 8, tidx // 8
                    for i in cutlass.range_constexpr(TILE_M // 16):
                        row = row0 + 16 * i
                        token = cutlass.Int32(-1)
                        if tile_row * TILE_M + row < num_rows:
                            token = m_token[tile_row * TILE_M + row]
                        src = x_base + (cutlass.Int64(cutlass.max(token, 0)) * self.k + k_tile * TILE_K + chunk * 8)
                        dst = base + (stage * TILE_M * TILE_K + row * TILE_K + ((chunk ^ (row % 8)) * 8))
                        copy_async_16b(dst, src, cutlass.Int32(token >= 0) * 16)
                    cute.arch.cp_async_mbarrier_arrive_noinc(full + stage)
                elif tidx < 32:
                    if tidx == 0:
                        cute.arch.mbarrier_arrive_and_expect_tx(full + stage, TILE_M * TILE_K * 2)
                    cute.arch.sync_warp()
                    if cutlass.const_expr(self.mode == "tma_tile"):  # (the copy elects one lane of the warp)
                        s_tile = cute.make_tensor(base + stage * TILE_M * TILE_K, cute.slice_(staged, (None, None, 0)))
                        g_tile = cute.local_tile(t_rows, (TILE_M, TILE_K), (tile_row, k_tile))
                        t_s, t_g = cute.nvgpu.cpasync.tma_partition(
                            tma_tile, 0, cute.make_layout(1), cute.group_modes(s_tile, 0, 2), cute.group_modes(g_tile, 0, 2)
                        )
                        cute.copy(tma_tile, t_g, t_s, tma_bar_ptr=full + stage)
                    else:  # tma_rows: lane l loads the tokens of rows l + 32·i; one lane issues every row's copy
                        tokens = cute.make_rmem_tensor(cute.make_layout(TILE_M // 32), cutlass.Int32)
                        for i in cutlass.range_constexpr(TILE_M // 32):
                            token = cutlass.Int32(-1)
                            if tile_row * TILE_M + tidx + 32 * i < num_rows:
                                token = m_token[tile_row * TILE_M + tidx + 32 * i]
                            tokens[i] = token
                        for i in cutlass.range_constexpr(TILE_M // 32):
                            for lane in cutlass.range(32, unroll=4):
                                row = lane + 32 * i
                                token = cute.arch.shuffle_sync(tokens[i], lane)
                                s_row = cute.make_tensor(
                                    base + (stage * TILE_M * TILE_K + row * TILE_K), cute.make_layout((1, TILE_K), stride=(TILE_K, 1))
                                )
                                g_row = cute.local_tile(t_x, (1, TILE_K), (token, k_tile))
                                t_s, t_g = cute.nvgpu.cpasync.tma_partition(
                                    tma_row, 0, cute.make_layout(1), cute.group_modes(s_row, 0, 2), cute.group_modes(g_row, 0, 2)
                                )
                                cute.copy(tma_row, t_g, t_s, tma_bar_ptr=full + stage)  # (the copy elects one lane)
                stage, phase = self.advance(stage, phase)
                linear += step
            if cutlass.const_expr(self.mode == "cp_async"):
                cute.arch.cp_async_wait_group(0)
        else:  # the consumer warp: wait, (check: write the stage back through the swizzled layout), release
            lane = tidx - 128
            view = storage.stages.get_tensor(staged.outer, swizzle=staged.inner)
            while linear < all_tiles:
                tile_row, k_tile = linear // k_tiles, linear % k_tiles
                cute.arch.mbarrier_wait(full + stage, phase)
                if cutlass.const_expr(self.check):
                    for i in cutlass.range_constexpr(TILE_M // 32):
                        row = lane + 32 * i
                        if tile_row * TILE_M + row < num_rows:
                            for c in cutlass.range(TILE_K, unroll=8):
                                m_out[tile_row * TILE_M + row, k_tile * TILE_K + c] = view[row, c, stage]
                cute.arch.sync_warp()
                if lane == 0:
                    cute.arch.mbarrier_arrive(empty + stage)
                stage, phase = self.advance(stage, phase)
                linear += step

    @cute.jit
    def advance(self, stage, phase):
        stage += 1
        if stage == STAGES:
            stage, phase = cutlass.Int32(0), phase ^ 1
        return stage, phase


def make_feed(mode: str, x: torch.Tensor, rows: torch.Tensor, token: torch.Tensor, out: torch.Tensor, check: bool):
    """The probe, compiled, as a callable on these tensors: the conversions and the compile are done
    here once, so that a timed call is one launch (a ~0.1 ms fill must not time host work)."""
    args = [from_dlpack(t, assumed_align=16) for t in (x, rows, token, out)]
    grid = cutlass.Int32(torch.cuda.get_device_properties(x.device).multi_processor_count)
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    kernel = cute.compile(RowFeedProbe(mode, x.shape[1], check), *args, grid, stream)
    return lambda: kernel(*args, grid, stream)


def fc1(name, x, rows, token, idx, E, I, H) -> None:
    """The layer's gate/up GEMM (SwiGLU epilogue, h kept) on pre-gathered rows and gathering them by
    cp.async: bitwise equal outputs, and each one's time, interleaved. (Gathering by per-row TMA
    was 2.6-2.8x slower; with two of the four producer warps gathering, 1.3-1.4x slower; with the
    source addresses worked out every stage instead of once a tile, 6-9% slower; with 32-bit
    offsets instead of 64-bit addresses once a tile, 4-6% slower: perf/NOTES.md, twenty-second
    and twenty-third sessions.)"""
    g = torch.Generator(device="cuda").manual_seed(1)
    wg, wu = ((torch.randn(E, I, H, device="cuda", generator=g) * H**-0.5).bfloat16() for _ in range(2))
    tiles = ops.device_schedule(idx, E, capacity=rows.shape[0]).tile_expert
    outs = {path: (torch.full((rows.shape[0], I), float("nan"), device="cuda").bfloat16(),
                   torch.full((rows.shape[0], 2 * I), float("nan"), device="cuda").bfloat16()) for path in ("rows", "cp_async")}
    calls = {
        "rows": lambda: ops.grouped_gemm(rows, wg, tiles, b2=wu, out=outs["rows"][0], h_out=outs["rows"][1]),
        "cp_async": lambda: ops.grouped_gemm(x, wg, tiles, b2=wu, gather=token, out=outs["cp_async"][0], h_out=outs["cp_async"][1]),
    }
    for call in calls.values():
        call()
    torch.cuda.synchronize()
    used = tiles.repeat_interleave(128)[: rows.shape[0]] >= 0
    same = all(torch.equal(o[used], w[used]) for o, w in zip(outs["cp_async"], outs["rows"]))
    print(f"{name:<10}fc1 bits equal to the pre-gathered rows': {same}")
    ms = time_ms_interleaved(calls)
    print(f"{name:<10}fc1 ms: " + "  ".join(f"{path} {t:.3f}" for path, t in ms.items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="qwen3,dsv3-e128")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--fc1", action="store_true", help="also the gate/up GEMM on pre-gathered rows and gathering by cp.async")
    args = parser.parse_args()
    print(f"# {torch.cuda.get_device_name()}")
    for name in args.configs.split(","):
        T, H, I, E, k, shared, routing = CONFIGS[name]
        x, idx, *_ = make_inputs(T, H, I, E, k, shared, routing)
        token = ops.device_schedule(idx, E, capacity=worst_case_capacity(T, k, E, 128)).row_token
        rows = ops.gather_rows(x, token)  # zeros on padding rows
        if args.check:
            for mode in MODES:
                out = torch.full_like(rows, float("nan"))
                make_feed(mode, x, rows, token, out, True)()
                torch.cuda.synchronize()
                print(f"{name:<10}{mode:<10} check: stages hold x[row_token] (zeros on padding): {torch.equal(out, rows)}")
        out = torch.empty(1, 1, dtype=torch.bfloat16, device="cuda")
        ms = time_ms_interleaved({mode: make_feed(mode, x, rows, token, out, False) for mode in MODES})
        nbytes = rows.numel() * 2
        print(f"{name:<10}" + "  ".join(f"{mode} {t:.3f} ms ({nbytes / t / 1e6:.0f} GB/s)" for mode, t in ms.items()))
        if args.fc1:
            fc1(name, x, rows, token, idx, E, I, H)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
