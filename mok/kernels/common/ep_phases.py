"""The expert-parallel phases of the one-launch EP forward (mok/kernels/common/expert_mlp.py, ``ep_world``).

The multi-launch EP forward (mok/pipeline/forward.py) runs these steps as separate kernels; here every CTA of
the one persistent launch runs its share of each, with grid barriers (common/waits.py) where a
step needs the previous one complete on this rank, and the workspace's epoch flags (common/ep.py:
system-scope release/acquire, bounded by %globaltimer, a timeout recorded as (1, phase, peer,
epoch) in the error record) where it needs the peers:

    publish    copy this rank's x (or, in MXFP8, quantize it) and routing into its published
               regions; grid barrier; CTA 0 advances the epoch and signals every rank; every CTA
               waits for every rank
    routing    every rank's routing -> [W·T_max, k] (-1 past a rank's tokens), and each token
               routed to one of this rank's experts copied once from its rank into x_all[g]
               (g = p·T_max + t; MXFP8 rows dequantized on the way), one warp per token (the
               schedule and fc1 then read them here)
    overflow   only when the schedule overflowed a capacity bound: NaN into the slots of the
               pairs that got no row, on their tokens' ranks, and the error into every rank's record
    done       after fc2 has pushed every y row into its token's rank (slot [t, j]): CTA 0 signals
               every rank, every CTA waits for every rank
    combine    out[t] = shared[t] + Σ_j topk_w[t, j]·slots[t, j] (fp32, j in order)

The argument ``ep`` is the tuple ExpertMlp (common/expert_mlp.py) packs: (flags [W, words], published x [W, T_max·H]
(in MXFP8: the pair elements [W, T_max·H], scales [W, T_max·H/32]),
published routing [W, T_max·k], this rank's x [T·H], this rank's routing [T·k], routing out
[W·T_max·k], x_all [W·T_max, H], rank, T_max, T, first local expert, slots [W, T_max·k, H]).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from .ep import VECTOR, claim_capacity_error, poison_dropped_pair, signal_all, wait_all
from .flag_layout import PHASE_DONE, PHASE_PUBLISH, epoch_slot, tokens_slot
from .mxfp8_quantize import BLOCK, e8m0_factor, quantize_rows_strided
from .waits import grid_barrier

COPY_DEPTH = 4  # 16-byte loads a lane keeps in flight while copying a token's row


@cute.jit
def publish_and_wait(ep: tuple, world: cutlass.Constexpr[int], topk: cutlass.Constexpr[int], threads: cutlass.Constexpr[int],
                     sync, timeout_ns: cutlass.Int64, mxfp8: cutlass.Constexpr[bool], hidden: cutlass.Constexpr[int]):
    """All threads of every CTA: this rank's x (``mxfp8``: quantized, a thread per block of 32, as
    common/ep.py's EpPublishQuantizedKernel; rows ``hidden`` wide) and routing into its published
    regions, then the epoch's publish handshake with every rank (see the module docstring)."""
    m_flags, m_x_pub, m_idx_pub, m_x_in, m_idx_in, _, _, rank, _, num_tokens, _, _ = ep
    tid, _, _ = cute.arch.thread_idx()
    cta, _, _ = cute.arch.block_idx()
    ctas, _, _ = cute.arch.grid_dim()
    epoch = m_flags[rank, epoch_slot()] + 1  # read by all before the barrier; CTA 0 writes it after
    if cutlass.const_expr(mxfp8):
        m_el_pub, m_sc_pub = m_x_pub
        quantize_rows_strided(m_x_in.iterator, m_el_pub[rank, None].iterator, m_sc_pub[rank, None].iterator, num_tokens, hidden,
                              cta * threads + tid, ctas * threads)
    else:
        src = cute.zipped_divide(m_x_in, (VECTOR,))
        dst = cute.zipped_divide(m_x_pub[rank, None], (VECTOR,))
        for v in cutlass.range(cta * threads + tid, cute.size(m_x_in) // VECTOR, ctas * threads, unroll=1):
            dst[None, v].store(src[None, v].load())
    for i in cutlass.range(cta * threads + tid, num_tokens * topk, ctas * threads, unroll=1):
        m_idx_pub[rank, i] = m_idx_in[i]
    if cta == 0:
        if tid == 0:
            m_flags[rank, tokens_slot(world)] = num_tokens
    grid_barrier(sync, timeout_ns, last=False)
    if cta == 0:
        if tid == 0:
            m_flags[rank, epoch_slot()] = epoch
            signal_all(m_flags, rank, world, PHASE_PUBLISH, epoch)
    wait_all(m_flags, rank, world, PHASE_PUBLISH, epoch, timeout_ns, tid)
    cute.arch.sync_threads()


@cute.jit
def gather_routing_and_rows(ep: tuple, world: cutlass.Constexpr[int], topk: cutlass.Constexpr[int], hidden: cutlass.Constexpr[int],
                            num_local: cutlass.Constexpr[int], threads: cutlass.Constexpr[int], mxfp8: cutlass.Constexpr[bool]):
    """All threads of every CTA, after :func:`publish_and_wait`: one warp per global token g =
    p·T_max + t (grid-strided): lanes j < k write routing[g, j] (rank p's topk_idx[t, j], -1 past
    its tokens); if one of them is a local expert, the warp copies x of g from rank p into
    x_all[g] (once, however many local experts it goes to; ``mxfp8``: dequantized, see
    :func:`copy_row_mxfp8`). The caller meets a grid barrier after."""
    m_flags, m_x_pub, m_idx_pub, _, _, m_routing, m_x_all, rank, t_max, _, expert_lo, _ = ep
    tid, _, _ = cute.arch.thread_idx()
    cta, _, _ = cute.arch.block_idx()
    ctas, _, _ = cute.arch.grid_dim()
    lane = tid % 32
    warps = threads // 32
    tokens = [m_flags[p, tokens_slot(world)] for p in range(world)]  # every rank's token count (published)
    vectors = hidden // VECTOR
    for g in cutlass.range(cta * warps + tid // 32, world * t_max, ctas * warps, unroll=1):
        p = g // t_max
        t = g - p * t_max
        count = tokens[0]
        for q in cutlass.range_constexpr(1, world):
            if p == q:
                count = tokens[q]
        expert = cutlass.Int32(-1)
        if lane < topk:
            if t < count:
                expert = m_idx_pub[p, t * topk + lane]
            m_routing[g * topk + lane] = expert
        local = cutlass.Boolean(False)
        if expert >= expert_lo:
            if expert < expert_lo + num_local:
                local = cutlass.Boolean(True)
        if cute.arch.vote_any_sync(local):
            dst = cute.zipped_divide(m_x_all[g, None], (VECTOR,))
            if cutlass.const_expr(mxfp8):
                copy_row_mxfp8(m_x_pub, p, t, dst, hidden, lane)
            else:
                src = cute.zipped_divide(m_x_pub[p, None], (VECTOR,))
                first = t * vectors
                for base in cutlass.range(lane, vectors, 32 * COPY_DEPTH, unroll=1):
                    vals = []
                    for i in cutlass.range_constexpr(COPY_DEPTH):
                        v = cutlass.min(base + i * 32, vectors - 1)  # (a clamped lane re-reads the last vector, stores nothing)
                        vals.append(src[None, first + v].load())
                    for i in cutlass.range_constexpr(COPY_DEPTH):
                        if base + i * 32 < vectors:
                            dst[None, base + i * 32].store(vals[i])


@cute.jit
def copy_row_mxfp8(m_x_pub: tuple, p, t, dst: cute.Tensor, hidden: cutlass.Constexpr[int], lane):
    """A warp: token t of rank p's MXFP8 region into ``dst`` (its bf16 row as 16-byte vectors): per
    unit of 8 elements an 8-byte load and the block's scale byte, bf16(element·2**(scale - 127))
    (common/ep.py's EpDispatchQuantizedKernel's bits), COPY_DEPTH units a lane loaded before it stores."""
    m_el_pub, m_sc_pub = m_x_pub
    units = hidden // VECTOR
    src = cute.zipped_divide(m_el_pub[p, None], (VECTOR,))
    first, first_scale = t * units, t * -(-hidden // BLOCK)  # (a partial last block's scale too)
    for base in cutlass.range(lane, units, 32 * COPY_DEPTH, unroll=1):
        vals, exponents = [], []
        for i in cutlass.range_constexpr(COPY_DEPTH):
            u = cutlass.min(base + i * 32, units - 1)  # (a clamped lane re-reads the last unit, stores nothing)
            vals.append(src[None, first + u].load())
            exponents.append(cutlass.Int32(m_sc_pub[p, first_scale + (u >> 2)]) & 0xFF)  # (the byte comes in sign-extended)
        for i in cutlass.range_constexpr(COPY_DEPTH):
            if base + i * 32 < units:
                dst[None, base + i * 32].store((vals[i].to(cutlass.Float32) * e8m0_factor(exponents[i])).to(dst.element_type))


@cute.jit
def signal_done_and_wait(ep: tuple, world: cutlass.Constexpr[int], timeout_ns: cutlass.Int64, tid, leader):
    """After every CTA's pushes are complete (a grid barrier): CTA 0's ``leader`` thread signals
    the done phase of the epoch to every rank; threads ``tid`` < W of every CTA wait for every
    rank's. The caller synchronises its threads after."""
    m_flags, _, _, _, _, _, _, rank, _, _, _, _ = ep
    cta, _, _ = cute.arch.block_idx()
    epoch = m_flags[rank, epoch_slot()]  # this call's (CTA 0 wrote it before its publish signal, which every CTA acquired)
    if cta == 0:
        if tid == leader:
            signal_all(m_flags, rank, world, PHASE_DONE, epoch)
    wait_all(m_flags, rank, world, PHASE_DONE, epoch, timeout_ns, tid)


@cute.jit
def mark_overflow(ep: tuple, sched_outputs: tuple, capacity, world: cutlass.Constexpr[int], topk: cutlass.Constexpr[int],
                  hidden: cutlass.Constexpr[int], num_local: cutlass.Constexpr[int], threads: cutlass.Constexpr[int], tid):
    """``threads`` threads of every CTA (``tid`` among them), before the grid barrier that precedes
    the done signal: if the schedule overflowed ``capacity``, every pair of this rank's experts
    that got no row has its slot on its token's rank set to NaN (grid-strided; common/ep.py's
    EpOverflowKernel does the same in the multi-launch forward) and CTA 0 records the error in
    every rank's record; then a system-scope fence, so peers see the NaN after the signal."""
    m_flags, _, _, _, _, m_routing, _, rank, t_max, _, _, m_slots = ep
    _, m_offsets, _, _, m_slot_row, _, m_over, _ = sched_outputs
    cta, _, _ = cute.arch.block_idx()
    ctas, _, _ = cute.arch.grid_dim()
    if m_over[0] != 0:
        if cta == 0:
            if tid == 0:
                claim_capacity_error(m_flags, world, rank, m_offsets[num_local], capacity)
        for i in cutlass.range(cta * threads + tid, world * t_max * topk, ctas * threads, unroll=1):
            poison_dropped_pair(  # (no router-gradient pieces in a forward: m_routing stands in for them, unused)
                m_routing, m_slot_row, m_slots, m_routing, i, rank, num_local, t_max, topk, hidden, False
            )
        cute.arch.fence_acq_rel_sys()
