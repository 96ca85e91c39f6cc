"""Device schedule: routing -> row slots in one CTA, bit for bit what ``mok/schedule.py`` computes.

Input: topk_idx flattened to P = N·k pairs in canonical order (token, then slot), with
global expert ids; this rank owns experts [lo, lo + E). Output: expert counts and padded
offsets, row_token / row_slot of every buffer row, slot_row of every pair, the expert of
every row tile, and an overflow flag (rows needed > capacity). It also zeroes a
caller-given int32 buffer (the arrival counters of the down projection that combines as it
goes), which then needs no launch of its own.

No atomics decide placement. Each of the 32 warps walks a contiguous chunk of pairs, 32 at
a time: lanes with the same expert find each other (match.any), a lane's rank among them
is the number of matching lower lanes, and the lowest lane advances the warp's per-expert
count in shared memory. A scan over warps then gives each warp's base per expert, a scan
over experts the padded offsets, and a second walk writes every pair's row. The result is
a pure function of the routing.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

WARPS = 32
THREADS = WARPS * 32
FULL_MASK = 0xFFFFFFFF


class ScheduleKernel:
    """Static config: local experts E (<= THREADS), top-k, row tile ``block_m``."""

    def __init__(self, num_local_experts: int, topk: int, block_m: int) -> None:
        if not 1 <= num_local_experts <= THREADS:
            raise ValueError(f"num_local_experts: expected 1..{THREADS}, got {num_local_experts}")
        self.num_local = num_local_experts
        self.topk = topk
        self.block_m = block_m

    @cute.jit
    def __call__(
        self,
        topk_idx_ptr: cute.Pointer,
        counts_ptr: cute.Pointer,
        offsets_ptr: cute.Pointer,
        row_token_ptr: cute.Pointer,
        row_slot_ptr: cute.Pointer,
        slot_row_ptr: cute.Pointer,
        tile_expert_ptr: cute.Pointer,
        overflow_ptr: cute.Pointer,
        clear_ptr: cute.Pointer,
        num_tokens: cutlass.Int32,
        expert_lo: cutlass.Int32,
        capacity: cutlass.Int32,
        num_clear: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        pairs = num_tokens * self.topk
        e = self.num_local
        vec = lambda ptr, n: cute.make_tensor(ptr, cute.make_layout((n,)))  # noqa: E731
        self.kernel(
            vec(topk_idx_ptr, pairs),
            vec(counts_ptr, e),
            vec(offsets_ptr, e + 1),
            vec(row_token_ptr, capacity),
            vec(row_slot_ptr, capacity),
            vec(slot_row_ptr, pairs),
            vec(tile_expert_ptr, capacity // self.block_m),
            vec(overflow_ptr, 1),
            vec(clear_ptr, num_clear),
            pairs,
            expert_lo,
            capacity,
        ).launch(grid=[1, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        m_idx: cute.Tensor,
        m_counts: cute.Tensor,
        m_offsets: cute.Tensor,
        m_row_token: cute.Tensor,
        m_row_slot: cute.Tensor,
        m_slot_row: cute.Tensor,
        m_tile_expert: cute.Tensor,
        m_overflow: cute.Tensor,
        m_clear: cute.Tensor,
        pairs: cutlass.Int32,
        expert_lo: cutlass.Int32,
        capacity: cutlass.Int32,
    ):
        e_local, bm, k = self.num_local, self.block_m, self.topk
        tid, _, _ = cute.arch.thread_idx()
        warp = tid // 32
        lane = tid % 32
        smem = cutlass.memory.SmemAllocator()
        hist = smem.allocate_tensor(cutlass.Int32, cute.make_layout(WARPS * e_local), byte_alignment=16)
        offs = smem.allocate_tensor(cutlass.Int32, cute.make_layout(e_local + 1), byte_alignment=16)

        # 0. clear the per-warp counts and every output row
        for i in cutlass.range(tid, WARPS * e_local, THREADS, unroll=1):
            hist[i] = 0
        for r in cutlass.range(tid, capacity, THREADS, unroll=1):
            m_row_token[r] = -1
            m_row_slot[r] = -1
        for t in cutlass.range(tid, capacity // bm, THREADS, unroll=1):
            m_tile_expert[t] = -1
        for i in cutlass.range(tid, cute.size(m_clear), THREADS, unroll=1):  # a later kernel's counters
            m_clear[i] = 0
        cute.arch.sync_threads()

        # 1. each warp ranks the pairs of its chunk among its earlier pairs of the same expert
        chunk = (pairs + WARPS * 32 - 1) // (WARPS * 32) * 32
        begin = warp * chunk
        end = cutlass.min(begin + chunk, pairs)
        # (each lane loads its next pair's expert one step ahead: the walk is serial, the loads need not be)
        next_expert = cutlass.Int32(-1)
        if begin + lane < end:
            next_expert = m_idx[begin + lane] - expert_lo
        for base in cutlass.range(begin, end, 32, unroll=1):
            p = base + lane
            expert = next_expert
            if p + 32 < end:
                next_expert = m_idx[p + 32] - expert_lo
            key = cutlass.Int32(-1)  # -1: past the chunk, or another rank's expert
            if p < end:
                if expert >= 0:
                    if expert < e_local:
                        key = expert
            peers = cute.arch.match_sync(FULL_MASK, key)
            lower = cutlass.Int32(cute.arch.popc(peers & cute.arch.lanemask_lt()))
            before = cutlass.Int32(0)
            if key >= 0:
                before = hist[warp * e_local + key]
            cute.arch.sync_warp()
            if key >= 0:
                if lower == 0:  # the lowest lane of each group advances the warp's count
                    hist[warp * e_local + key] = before + cutlass.Int32(cute.arch.popc(peers))
            cute.arch.sync_warp()
            if p < end:
                rank = cutlass.Int32(-1)
                if key >= 0:
                    rank = before + lower
                m_slot_row[p] = rank
        cute.arch.sync_threads()

        # 2. per expert: each warp's base (scan over warps) and the expert's count
        if tid < e_local:
            run = cutlass.Int32(0)
            for w in cutlass.range(WARPS, unroll=1):
                c = hist[w * e_local + tid]
                hist[w * e_local + tid] = run
                run = run + c
            m_counts[tid] = run
            offs[tid] = (run + bm - 1) // bm * bm
        cute.arch.sync_threads()

        # 3. padded offsets (one thread, E steps) and the overflow flag
        if tid == 0:
            acc = cutlass.Int32(0)
            for i in cutlass.range(e_local, unroll=1):
                padded = offs[i]
                offs[i] = acc
                m_offsets[i] = acc
                acc = acc + padded
            offs[e_local] = acc
            m_offsets[e_local] = acc
            flag = cutlass.Int32(0)
            if acc > capacity:
                flag = cutlass.Int32(1)
            m_overflow[0] = flag
        cute.arch.sync_threads()

        # 4. every pair's row; rows past capacity get none (the overflow flag says so)
        next_rank = cutlass.Int32(-1)
        next_expert = cutlass.Int32(0)
        if begin + lane < end:
            next_rank = m_slot_row[begin + lane]
            next_expert = m_idx[begin + lane] - expert_lo
        for base in cutlass.range(begin, end, 32, unroll=1):
            p = base + lane
            rank = next_rank
            expert = next_expert
            if p + 32 < end:  # one step ahead, as in step 1 (p + 32 is not written below)
                next_rank = m_slot_row[p + 32]
                next_expert = m_idx[p + 32] - expert_lo
            if p < end:
                if rank >= 0:
                    row = offs[expert] + hist[warp * e_local + expert] + rank
                    if row < capacity:
                        m_slot_row[p] = row
                        m_row_token[row] = p // k
                        m_row_slot[row] = p % k
                    else:
                        m_slot_row[p] = -1

        # 5. the expert of every used row tile
        if tid < e_local:
            last = cutlass.min(offs[tid + 1], capacity) // bm
            for t in cutlass.range(offs[tid] // bm, last, unroll=1):
                m_tile_expert[t] = tid


def compile_schedule(num_local_experts: int, topk: int, block_m: int, arch: str, options: str = ""):
    """Compile for ``arch`` without tensors."""
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    gmem = cute.AddressSpace.gmem
    i32 = lambda: make_ptr(cutlass.Int32, 0, gmem, assumed_align=4)  # noqa: E731
    args = (
        i32(), i32(), i32(), i32(), i32(), i32(), i32(), i32(), i32(),
        cutlass.Int32(1), cutlass.Int32(0), cutlass.Int32(128), cutlass.Int32(0), make_fake_stream(),
    )
    kernel = ScheduleKernel(num_local_experts, topk, block_m)
    return cute.compile(kernel, *args, options=f"--gpu-arch {arch} {options}".strip())
