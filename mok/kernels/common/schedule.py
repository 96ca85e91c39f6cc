"""Device schedule: routing -> row slots in one launch of many CTAs, bit for bit what ``mok/schedule.py`` computes.

Input: topk_idx flattened to P = N·k pairs in canonical order (token, then slot), with
global expert ids; this rank owns experts [lo, lo + E). Output: expert counts and padded
offsets, row_token / row_slot of every buffer row, slot_row of every pair, the expert of
every row tile, and an overflow flag (rows needed > capacity). It also zeroes a
caller-given int32 buffer (the one-launch forward's tile and ready counters), which then
needs no launch of its own.

A pair's row is offsets[e] + (pairs of expert e before it in canonical order). The pairs are
cut into one contiguous chunk per CTA. Every CTA counts, per expert, the pairs before and
after its chunk (integer shared-memory adds: a count does not depend on their order) and so
knows every expert's total and the offsets without waiting for any other CTA; inside its
chunk each warp ranks 32 pairs at a time (lanes with the same expert find each other with
match.any) and a scan over warps gives each warp's base. No CTA waits on another, no global
atomics, and every output element has exactly one writer: the rows of a chunk's pairs by
that chunk's CTA, padding rows, tail rows, tile experts and the cleared buffer by CTAs in a
fixed round robin. The result is a pure function of the routing.

``prefix_rows`` (a runtime argument, 0 for none): the buffer starts with that many rows of a
shared expert, expert E_local (after the routed ones): row r < N holds token r (row_slot k, a
slot no routed pair has), the rest of the prefix is padding; the routed experts' rows follow
it (every offset and row moves by prefix_rows). A shared expert with the routed ones' shapes
then runs in their GEMM launches.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

from ..constants import SCHEDULE_THREADS as THREADS

MAX_EXPERTS = 1024
FULL_MASK = 0xFFFFFFFF


class ScheduleKernel:
    """Static config: local experts E (<= MAX_EXPERTS), top-k, row tile ``block_m``."""

    def __init__(self, num_local_experts: int, topk: int, block_m: int) -> None:
        if not 1 <= num_local_experts <= MAX_EXPERTS:
            raise ValueError(f"num_local_experts: expected 1..{MAX_EXPERTS}, got {num_local_experts}")
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
        num_ctas: cutlass.Int32,
        prefix_rows: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        """``capacity``: the buffer's rows, the prefix's included."""
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
            prefix_rows,
        ).launch(grid=[num_ctas, 1, 1], block=[THREADS, 1, 1], stream=stream)

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
        prefix_rows: cutlass.Int32,
    ):
        smem = cutlass.memory.SmemAllocator()
        scratch = smem.allocate_tensor(cutlass.Int32, cute.make_layout(self.scratch_words(THREADS)), byte_alignment=16)
        outputs = (m_counts, m_offsets, m_row_token, m_row_slot, m_slot_row, m_tile_expert, m_overflow, m_clear)
        self.build(m_idx, outputs, scratch, THREADS, pairs, expert_lo, capacity, prefix_rows)

    def scratch_words(self, threads: int) -> int:
        """Shared-memory int32 words :meth:`build` needs with ``threads`` threads per CTA."""
        return (threads // 32 + 3) * self.num_local + self.num_local + 1

    @cute.jit
    def build(
        self,
        m_idx: cute.Tensor,
        outputs: tuple,
        scratch: cute.Tensor,
        threads: cutlass.Constexpr[int],
        pairs: cutlass.Int32,
        expert_lo: cutlass.Int32,
        capacity: cutlass.Int32,
        prefix_rows: cutlass.Int32,
    ):
        """This CTA's part of the schedule, with all ``threads`` threads of every CTA of the grid
        taking part (this launch's, or a larger kernel's prologue: the one-launch forward's);
        ``scratch``: :meth:`scratch_words` int32 words of shared memory. Ends with the CTA's
        threads synchronised after their last shared-memory use."""
        m_counts, m_offsets, m_row_token, m_row_slot, m_slot_row, m_tile_expert, m_overflow, m_clear = outputs
        warps = threads // 32
        e_local, bm, k = self.num_local, self.block_m, self.topk
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        warp = tid // 32
        lane = tid % 32
        words = scratch.iterator
        warp_base = cute.make_tensor(words, cute.make_layout(warps * e_local))
        before = cute.make_tensor(words + warps * e_local, cute.make_layout(e_local))
        after = cute.make_tensor(words + (warps + 1) * e_local, cute.make_layout(e_local))
        counts = cute.make_tensor(words + (warps + 2) * e_local, cute.make_layout(e_local))
        offs = cute.make_tensor(words + (warps + 3) * e_local, cute.make_layout(e_local + 1))

        chunk = (pairs + ctas * 32 - 1) // (ctas * 32) * 32
        begin = cutlass.min(cta * chunk, pairs)
        end = cutlass.min(begin + chunk, pairs)
        warp_chunk = (chunk + threads - 1) // threads * 32
        w_begin = cutlass.min(begin + warp * warp_chunk, end)
        w_end = cutlass.min(w_begin + warp_chunk, end)

        for i in cutlass.range(tid, warps * e_local, threads, unroll=1):
            warp_base[i] = 0
        for i in cutlass.range(tid, e_local, threads, unroll=1):
            before[i] = 0
            after[i] = 0
        cute.arch.sync_threads()

        # 1. every expert's pairs before and after this CTA's chunk (order-free integer counts)
        for p in cutlass.range(tid, begin, threads, unroll=4):
            expert = m_idx[p] - expert_lo
            if expert >= 0 and expert < e_local:
                cute.arch.atomic_add((before.iterator + expert).llvm_ptr, cutlass.Int32(1), scope="cta")
        for p in cutlass.range(end + tid, pairs, threads, unroll=4):
            expert = m_idx[p] - expert_lo
            if expert >= 0 and expert < e_local:
                cute.arch.atomic_add((after.iterator + expert).llvm_ptr, cutlass.Int32(1), scope="cta")

        # 2. each warp ranks its pairs among its earlier pairs of the same expert
        for base in cutlass.range(w_begin, w_end, 32, unroll=1):
            p = base + lane
            key = cutlass.Int32(-1)  # -1: past the chunk, or another rank's expert
            if p < w_end:
                expert = m_idx[p] - expert_lo
                if expert >= 0 and expert < e_local:
                    key = expert
            peers = cute.arch.match_sync(FULL_MASK, key)
            lower = cutlass.Int32(cute.arch.popc(peers & cute.arch.lanemask_lt()))
            seen = cutlass.Int32(0)
            if key >= 0:
                seen = warp_base[warp * e_local + key]
            cute.arch.sync_warp()
            if key >= 0 and lower == 0:  # the lowest lane of each group advances the warp's count
                warp_base[warp * e_local + key] = seen + cutlass.Int32(cute.arch.popc(peers))
            cute.arch.sync_warp()
            if p < w_end:
                rank = cutlass.Int32(-1)
                if key >= 0:
                    rank = seen + lower
                m_slot_row[p] = rank  # the rank for now; step 5 turns it into the row
        cute.arch.sync_threads()

        # 3. per expert: each warp's base (the pairs before the chunk, then a scan over warps) and the total
        for i in cutlass.range(tid, e_local, threads, unroll=1):
            run = before[i]
            for w in cutlass.range(warps, unroll=1):
                c = warp_base[w * e_local + i]
                warp_base[w * e_local + i] = run
                run = run + c
            counts[i] = run + after[i]
        cute.arch.sync_threads()

        # 4. padded offsets: warp 0 scans the experts, each lane a contiguous run of them
        per_lane = (e_local + 31) // 32
        if warp == 0:
            first = lane * per_lane
            last = cutlass.min(first + per_lane, e_local)
            mine = cutlass.Int32(0)
            for i in cutlass.range(first, last, unroll=1):
                mine = mine + (counts[i] + bm - 1) // bm * bm
            incl = mine
            for step in cutlass.range_constexpr(5):
                got = cute.arch.shuffle_sync_up(incl, 1 << step)
                if lane >= (1 << step):
                    incl = incl + got
            acc = prefix_rows + incl - mine
            for i in cutlass.range(first, last, unroll=1):
                offs[i] = acc
                acc = acc + (counts[i] + bm - 1) // bm * bm
            if lane == 31:
                offs[e_local] = prefix_rows + incl
        cute.arch.sync_threads()
        total_rows = offs[e_local]
        if cta == 0:
            for i in cutlass.range(tid, e_local + 1, threads, unroll=1):
                m_offsets[i] = offs[i]
                if i < e_local:
                    m_counts[i] = counts[i]
            if tid == 0:
                flag = cutlass.Int32(0)
                if total_rows > capacity:
                    flag = cutlass.Int32(1)
                m_overflow[0] = flag

        # 5. every pair's row; rows past capacity get none (the overflow flag says so)
        for base in cutlass.range(w_begin, w_end, 32, unroll=1):
            p = base + lane
            if p < w_end:
                rank = m_slot_row[p]  # written by this lane in step 2
                if rank >= 0:
                    expert = m_idx[p] - expert_lo
                    row = offs[expert] + warp_base[warp * e_local + expert] + rank
                    if row < capacity:
                        m_slot_row[p] = row
                        m_row_token[row] = p // k
                        m_row_slot[row] = p % k
                    else:
                        m_slot_row[p] = -1

        # 6. rows no pair uses (each expert's padding, then the unused tail) and the tile experts,
        #    experts round robin over CTAs, the tail grid-strided
        for i in cutlass.range(cta, e_local, ctas, unroll=1):
            pad_end = cutlass.min(offs[i + 1], capacity)
            for r in cutlass.range(offs[i] + counts[i] + tid, pad_end, threads, unroll=1):
                m_row_token[r] = -1
                m_row_slot[r] = -1
            for t in cutlass.range(offs[i] // bm + tid, pad_end // bm, threads, unroll=1):
                m_tile_expert[t] = i
        for r in cutlass.range(total_rows + cta * threads + tid, capacity, ctas * threads, unroll=1):
            m_row_token[r] = -1
            m_row_slot[r] = -1
        for t in cutlass.range(total_rows // bm + cta * threads + tid, capacity // bm, ctas * threads, unroll=1):
            m_tile_expert[t] = -1
        for i in cutlass.range(cta * threads + tid, cute.size(m_clear), ctas * threads, unroll=1):  # a later kernel's
            m_clear[i] = 0
        # 7. the shared expert's prefix: row r < N is token r's, the rest padding; its tiles expert E_local
        num_tokens = pairs // k
        for r in cutlass.range(cta * threads + tid, prefix_rows, ctas * threads, unroll=1):
            token, slot = cutlass.Int32(-1), cutlass.Int32(-1)
            if r < num_tokens:
                token, slot = r, cutlass.Int32(k)
            m_row_token[r] = token
            m_row_slot[r] = slot
        for t in cutlass.range(cta * threads + tid, prefix_rows // bm, ctas * threads, unroll=1):
            m_tile_expert[t] = e_local
        cute.arch.sync_threads()  # (the caller may reuse the scratch)


def compile_schedule(num_local_experts: int, topk: int, block_m: int, arch: str, options: str = ""):
    """Compile for ``arch`` without tensors."""
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    gmem = cute.AddressSpace.gmem
    i32 = lambda: make_ptr(cutlass.Int32, 0, gmem, assumed_align=4)  # noqa: E731
    args = (
        i32(), i32(), i32(), i32(), i32(), i32(), i32(), i32(), i32(),
        cutlass.Int32(1), cutlass.Int32(0), cutlass.Int32(128), cutlass.Int32(0), cutlass.Int32(1), cutlass.Int32(0),
        make_fake_stream(),
    )
    kernel = ScheduleKernel(num_local_experts, topk, block_m)
    return cute.compile(kernel, *args, options=f"--gpu-arch {arch} {options}".strip())
