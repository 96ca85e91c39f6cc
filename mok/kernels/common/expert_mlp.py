"""What the one-launch expert MLP (the routed experts' whole forward in one persistent launch) is on
every arch: its configuration, the tensors its launch arguments describe, and the phases that do
not depend on the MMA unit.

    schedule of the routing (row_token, row_slot, slot_row, tile_expert, offsets)  (phase 0)
    a      [R, I] = act(x[row_token]·w_gateᵀ, x[row_token]·w_upᵀ)             (phase 1: fc1 tiles)
    y_rows [R, H] = a·w_downᵀ                                           (phase 2: fc2 tiles)
    out    [T, H] = shared[t] + Σ_j topk_w[t, j]·y_rows[slot_row[t, j]]   (phase 3: the combine)

Every CTA builds its part of the schedule (:meth:`ExpertMlp.build_schedule`, scratch in the
operand stages' shared memory; it also zeroes the counters [error, next tile, ready per row
tile]) and the CTAs meet at a grid barrier (common/waits.py: bounded, on words that outlive the
launch). Then fc1 and fc2 tiles, every fc1 tile in the order before any fc2 tile: an fc2 tile of
row tile m needs a's row tile m, so ``ready[m]`` counts the fc1 column tiles of m whose stores are
complete (:meth:`ExpertMlp.publish_stores`: integer atomic, release, gpu scope) and the thread
that loads an fc2 tile's a waits for all of them (:meth:`ExpertMlp.wait_ready`: acquire, bounded;
on expiry an error flag and a timeout count, wrong output, never a hang). After the last fc2 tile
a second grid barrier, then every CTA combines tokens with the combine launch's per-vector code
(:meth:`ExpertMlp.combine_all`). No deadlock: the grid is at most one CTA per SM (all resident),
fc1 tiles wait on nothing, and a CTA issues every fc1 tile's work before any fc2 tile's.

Expert parallelism (``ep_world`` = W): before the schedule every CTA publishes its share of this
rank's x and routing, the ranks meet on the workspace's flags, and one warp per global token
copies its row into x_all when one of its experts is local (common/ep_phases.py); fc2's rows are
pushed into their tokens' slots on their ranks (the grouped GEMM's ``scatter``); after the second
grid barrier the done handshake, then the combine reads this rank's slots.

With ``has_shared`` the combine adds a shared expert's output rows; with ``shared_prefix`` (one
GPU) that shared expert, of the routed ones' shapes, runs as expert E of the weights (E + 1 of
them), the schedule putting its T rows first, and the combine reads its output rows. With
``bias`` the GEMMs add the experts' biases in their epilogues, as the grouped GEMMs do alone;
w_gate and w_up may be the halves or the even and odd rows of one [E, 2I, H] tensor
(``gate_up_stride``, ``gate_up_row_stride``: their expert and row strides).

The arch's subclass (sm90/expert_mlp.py: WGMMA; sm100/expert_mlp.py: tcgen05) builds ``fc1``
and ``fc2`` (its grouped GEMMs: the gathering SwiGLU one and the down projection), sets
``threads`` and writes ``launch`` (the host side from :class:`MlpTensors` on) and its kernel.
Results are the bits of the separate launches on the same arch: each output tile is computed by
one CTA with the same operations in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

from . import ep_phases
from .combine import VECTOR, combine_vector
from .flag_layout import flag_words
from .gemm_args import halves
from .mxfp8_quantize import BLOCK as MXFP8_BLOCK
from .schedule import ScheduleKernel
from .waits import grid_barrier, wait_at_least

TILE = 128  # row tile of both GEMMs (the schedule's) and fc1's column tile


@dataclass
class MlpTensors:
    """The tensors and scalars the launch arguments describe (:meth:`ExpertMlp.__call__`), for the
    arch's ``launch``. ``sched_args`` = (routing, the schedule's outputs, grid-barrier words,
    routed pairs, first local expert); ``ep_args``: common/ep_phases.py's tuple (None at one GPU);
    ``scatter_dst``: where fc2's rows go at EP (None at one GPU); ``combine_args`` = (y rows or this
    rank's slots, topk_w, slot_row, shared, out)."""

    m_x: cute.Tensor  # (tokens, H, 1): fc1's A, its rows gathered
    m_a3: cute.Tensor  # (R, I, 1): fc2's A
    m_a: cute.Tensor  # [R, I] row-major
    m_y: cute.Tensor  # [R, H] row-major
    m_h: cute.Tensor  # (R, I, 2): h's halves (swiglu_save)
    m_a_st: cute.Tensor  # (R, I, 1): a as fc1's epilogue stores it
    m_y_st: cute.Tensor  # (R, H, 1): y rows as fc2's epilogue stores them
    m_wg: cute.Tensor  # (I, H, E): w_gate, w_up, w_down as the GEMMs' B
    m_wu: cute.Tensor
    m_wd: cute.Tensor
    m_row_token: cute.Tensor
    m_row_slot: cute.Tensor
    m_topk_w: cute.Tensor  # [tokens·k]: the epilogues' view
    m_tiles: cute.Tensor  # tile_expert [row tiles]
    m_flags: cute.Tensor  # counters [error, next tile]
    m_ready: cute.Tensor  # counters: ready per row tile
    m_offsets: cute.Tensor
    sched_args: tuple
    ep_args: tuple | None
    scatter_dst: tuple | None
    combine_args: tuple
    biases: tuple  # the experts' gate, up and down bias rows [E·I], [E·I], [E·H] (read with ``bias``)
    sync_ptr: cute.Pointer
    num_rows: cutlass.Int32
    num_experts: cutlass.Int32
    num_row_tiles: cutlass.Int32
    max_ctas: cutlass.Int32
    timeout_ns: cutlass.Int64


class ExpertMlp:
    """Arch-neutral base of the one-launch expert MLP (see the module docstring). A subclass calls
    :meth:`configure`, builds ``fc1`` and ``fc2``, sets ``threads`` (a CTA's) and writes ``launch``."""

    def configure(
        self, hidden: int, inter: int, topk: int, *, has_shared: bool, num_experts: int, ep_world: int | None, shared_prefix: bool,
        dispatch_format: str, bias: bool,
    ) -> None:
        """Check and keep the static configuration shared by every arch (the subclass's arguments of
        the same names)."""
        if bias and shared_prefix:
            raise ValueError("bias: not with shared_prefix (the shared expert has no biases)")
        if hidden % VECTOR or inter % VECTOR:
            raise ValueError(f"hidden, inter: expected multiples of {VECTOR} (16-byte rows), got H={hidden}, I={inter}")
        if ep_world is not None and (not 1 <= ep_world <= 32 or topk > 32):
            raise ValueError(f"ep_world: expected 1..32 ranks, top-k <= 32 (a lane per slot); got {ep_world}, topk={topk}")
        if shared_prefix and (ep_world is not None or not has_shared):
            raise ValueError("shared_prefix: only with has_shared, without ep_world")
        if dispatch_format not in ("bf16", "mxfp8") or (dispatch_format == "mxfp8" and (ep_world is None or hidden % (MXFP8_BLOCK // 2))):
            raise ValueError(f"dispatch_format: expected 'bf16', or 'mxfp8' with ep_world and H a multiple of 16; got {dispatch_format!r}"
                             f"{'' if dispatch_format == 'bf16' else f' with H={hidden}'}")
        self.shared_prefix, self.mxfp8_dispatch = shared_prefix, dispatch_format == "mxfp8"
        self.ep_world = ep_world
        self.schedule = ScheduleKernel(num_experts, topk, TILE)
        self.hidden, self.inter, self.topk = hidden, inter, topk
        self.has_shared = has_shared
        self.bias = bias

    def check_scratch(self, region_bytes: int) -> None:
        """Raise unless the schedule's scratch (``threads`` per CTA) fits the ``region_bytes`` of
        operand stages it borrows."""
        if self.schedule.scratch_words(self.threads) * 4 > region_bytes:
            raise ValueError(f"num_experts: {self.schedule.num_local} experts' schedule scratch does not fit the operand region")

    @cute.jit
    def __call__(
        self,
        x_ptr: cute.Pointer,
        w_gate_ptr: cute.Pointer,
        w_up_ptr: cute.Pointer,
        w_down_ptr: cute.Pointer,
        a_ptr: cute.Pointer,
        h_ptr: cute.Pointer,
        y_ptr: cute.Pointer,
        tile_expert_ptr: cute.Pointer,
        row_token_ptr: cute.Pointer,
        row_slot_ptr: cute.Pointer,
        topk_w_ptr: cute.Pointer,
        slot_row_ptr: cute.Pointer,
        shared_ptr: cute.Pointer,
        out_ptr: cute.Pointer,
        counters_ptr: cute.Pointer,
        offsets_ptr: cute.Pointer,
        topk_idx_ptr: cute.Pointer,
        counts_ptr: cute.Pointer,
        overflow_ptr: cute.Pointer,
        sync_ptr: cute.Pointer,
        bias_gate_ptr: cute.Pointer,
        bias_up_ptr: cute.Pointer,
        bias_down_ptr: cute.Pointer,
        flags_ptr: cute.Pointer,
        x_pub_ptr: cute.Pointer,
        idx_pub_ptr: cute.Pointer,
        slots_ptr: cute.Pointer,
        x_in_ptr: cute.Pointer,
        idx_in_ptr: cute.Pointer,
        num_rows: cutlass.Int32,
        num_experts: cutlass.Int32,
        num_tokens: cutlass.Int32,
        max_ctas: cutlass.Int32,
        timeout_ns: cutlass.Int64,
        rank: cutlass.Int32,
        t_max: cutlass.Int32,
        my_tokens: cutlass.Int32,
        flags_stride: cutlass.Int32,
        x_stride: cutlass.Int32,
        idx_stride: cutlass.Int32,
        slots_stride: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        """EXPERT_MLP_ARGS' arguments (mok/kernels/common/records.py), in its order. Without
        ``ep_world`` the EP arguments (flags_ptr ... idx_in_ptr, rank ... slots_stride) are unused.
        With it: x_ptr is x_all [W·T_max, H] and topk_idx_ptr the routing [W·T_max, k] this launch
        fills, num_tokens = W·T_max; topk_w, shared and out are this rank's ``my_tokens`` rows;
        flags, x_pub, idx_pub and slots are rank 0's regions of the workspace (each rank's
        ``*_stride`` elements further), x_in and idx_in this rank's inputs. The biases are read
        with ``bias`` only."""
        hid, inter = self.hidden, self.inter
        num_row_tiles = (num_rows + TILE - 1) // TILE
        row_major = lambda ptr, rows, cols: cute.make_tensor(ptr, cute.make_layout((rows, cols), stride=(cols, 1)))  # noqa: E731
        m_x = cute.make_tensor(x_ptr, cute.make_layout((num_tokens, hid, 1), stride=(hid, 1, num_tokens * hid)))
        m_a3 = cute.make_tensor(a_ptr, cute.make_layout((num_rows, inter, 1), stride=(inter, 1, num_rows * inter)))
        m_a, m_y = row_major(a_ptr, num_rows, inter), row_major(y_ptr, num_rows, hid)
        m_h = halves(h_ptr, num_rows, inter, 2)  # the epilogues store through (R, N, halves) tensors
        m_a_st, m_y_st = halves(a_ptr, num_rows, inter, 1), halves(y_ptr, num_rows, hid, 1)
        weights = num_experts + 1 if cutlass.const_expr(self.shared_prefix) else num_experts  # (shared_prefix: E + 1)
        m_wg, m_wu = self.fc1.b_tensor(w_gate_ptr, weights), self.fc1.b_tensor(w_up_ptr, weights)
        m_wd = self.fc2.b_tensor(w_down_ptr, weights)
        m_row_token = cute.make_tensor(row_token_ptr, cute.make_layout((num_rows,)))
        m_row_slot = cute.make_tensor(row_slot_ptr, cute.make_layout((num_rows,)))
        m_tiles = cute.make_tensor(tile_expert_ptr, cute.make_layout((num_row_tiles,)))
        tokens_by_slot = cute.make_layout((num_tokens, self.topk), stride=(self.topk, 1))
        combined = num_tokens if cutlass.const_expr(self.ep_world is None) else my_tokens  # the tokens the combine writes
        m_token_w = cute.make_tensor(topk_w_ptr, cute.make_layout((combined, self.topk), stride=(self.topk, 1)))
        m_slot_row = cute.make_tensor(slot_row_ptr, tokens_by_slot)
        # counters: [error, next tile | ready per row tile], zeroed by the schedule phase
        m_flags = cute.make_tensor(counters_ptr, cute.make_layout((2,)))
        m_ready = cute.make_tensor(counters_ptr + 2, cute.make_layout((num_row_tiles,)))
        m_offsets = cute.make_tensor(offsets_ptr, cute.make_layout((num_experts + 1,)))
        pairs = num_tokens * self.topk  # the schedule's input and outputs (the counters: zeroed by it)
        vec = lambda ptr, n: cute.make_tensor(ptr, cute.make_layout((n,)))  # noqa: E731
        outputs = (
            vec(counts_ptr, num_experts), m_offsets, m_row_token, m_row_slot, vec(slot_row_ptr, pairs), m_tiles,
            vec(overflow_ptr, 1), vec(counters_ptr, 2 + num_row_tiles),
        )
        sched_args = (vec(topk_idx_ptr, pairs), outputs, sync_ptr, pairs, rank * num_experts)
        ep_args = scatter_dst = None
        m_y_combined = m_y
        if cutlass.const_expr(self.ep_world is not None):
            w, k = self.ep_world, self.topk
            x_stride = cute.assume(x_stride, divby=VECTOR)  # (ep.py keeps every region 128-byte aligned)
            slots_stride = cute.assume(slots_stride, divby=VECTOR)
            m_x_pub = cute.make_tensor(x_pub_ptr, cute.make_layout((w, t_max * hid), stride=(x_stride, 1)))
            if cutlass.const_expr(self.mxfp8_dispatch):  # (elements [W, T_max·H], scales [W, T_max·H/32] from byte T_max·H of each region)
                m_x_pub = self.mxfp8_regions(x_pub_ptr, x_stride, t_max)
            ep_args = (
                cute.make_tensor(flags_ptr, cute.make_layout((w, flag_words(w)), stride=(flags_stride, 1))),
                m_x_pub,
                cute.make_tensor(idx_pub_ptr, cute.make_layout((w, t_max * k), stride=(idx_stride, 1))),
                cute.make_tensor(x_in_ptr, cute.make_layout((my_tokens * hid,))),
                cute.make_tensor(idx_in_ptr, cute.make_layout((my_tokens * k,))),
                cute.make_tensor(topk_idx_ptr, cute.make_layout((num_tokens * k,))),
                row_major(x_ptr, num_tokens, hid),
                rank, t_max, my_tokens, rank * num_experts,
                cute.make_tensor(slots_ptr, cute.make_layout((w, t_max * k, hid), stride=(slots_stride, hid, 1))),
            )
            # fc2's pushes: rank 0's slots on as 16-byte vectors (the grouped GEMM's scatter); the combine: this rank's [T_max·k, H]
            scatter_dst = self.fc2.scatter_target((slots_ptr, t_max, slots_stride))
            m_y_combined = row_major(slots_ptr + rank * slots_stride, t_max * k, hid)
        m_topk_w = cute.make_tensor(topk_w_ptr, cute.make_layout((num_tokens * self.topk,)))
        biases = (vec(bias_gate_ptr, weights * inter), vec(bias_up_ptr, weights * inter), vec(bias_down_ptr, weights * hid))
        combine_args = (m_y_combined, m_token_w, m_slot_row, row_major(shared_ptr, combined, hid), row_major(out_ptr, combined, hid))
        self.launch(
            MlpTensors(
                m_x, m_a3, m_a, m_y, m_h, m_a_st, m_y_st, m_wg, m_wu, m_wd, m_row_token, m_row_slot, m_topk_w, m_tiles, m_flags,
                m_ready, m_offsets, sched_args, ep_args, scatter_dst, combine_args, biases, sync_ptr, num_rows, num_experts,
                num_row_tiles, max_ctas, timeout_ns,
            ),
            stream,
        )

    def launch(self, t: MlpTensors, stream: cuda.CUstream) -> None:
        """Host side, the arch's: the MMAs, the TMA atoms and the kernel's launch from ``t`` on."""
        raise NotImplementedError

    def mxfp8_regions(self, x_pub_ptr: cute.Pointer, x_stride, t_max) -> tuple:
        """Every rank's region "x" holding MXFP8 rows (mok.pipeline.exchange.quantized_region): E4M3 elements [W, T_max·H]
        from its first byte, E8M0 scales [W, T_max·ceil(H / 32)] from byte T_max·H; the rank stride in bytes
        (64-bit: twice the bf16 element stride)."""
        hid = self.hidden
        stride = cute.assume(cutlass.Int64(x_stride) * 2, divby=16)
        elements = cute.recast_ptr(x_pub_ptr, dtype=cutlass.Float8E4M3FN)
        scales = cute.recast_ptr(x_pub_ptr, dtype=cutlass.Uint8) + t_max * hid
        return (
            cute.make_tensor(elements, cute.make_layout((self.ep_world, t_max * hid), stride=(stride, 1))),
            cute.make_tensor(scales, cute.make_layout((self.ep_world, t_max * -(-hid // MXFP8_BLOCK)), stride=(stride, 1))),
        )

    @cute.jit
    def build_schedule(self, sched_args, ep_args, region, num_rows, timeout_ns, m_offsets, num_experts):
        """The launch's prologue, all ``threads`` threads of every CTA: (EP: the exchanges of x and the
        routing first) every CTA builds its part of the schedule (scratch in the operand region
        ``region``, which the pipelines take over afterwards; it also zeroes the counters), then
        all wait for all (grid barrier), as the next launch would have. Returns the schedule's row
        count (``m_offsets[num_experts]``), read once by thread 0 for the whole CTA: after a barrier
        that timed out, a late CTA may still be writing it, and warps that read different values
        would disagree on the tile count and wait on each other's barriers forever (the output is
        wrong then, as the timeout count says, but nothing hangs)."""
        m_idx, outputs, sync_ptr, pairs, expert_lo = sched_args
        if cutlass.const_expr(self.ep_world is not None):  # the routing (and x rows) of every rank first
            ep_phases.publish_and_wait(ep_args, self.ep_world, self.topk, self.threads, sync_ptr, timeout_ns, self.mxfp8_dispatch,
                                       self.hidden)
            ep_phases.gather_routing_and_rows(
                ep_args, self.ep_world, self.topk, self.hidden, self.schedule.num_local, self.threads, self.mxfp8_dispatch
            )
            grid_barrier(sync_ptr, timeout_ns, last=False)
        scratch = cute.make_tensor(
            cute.recast_ptr(region, dtype=cutlass.Int32), cute.make_layout(self.schedule.scratch_words(self.threads))
        )
        prefix_rows = cutlass.Int32(0)
        if cutlass.const_expr(self.shared_prefix):  # the shared expert's rows: the tokens, whole tiles
            prefix_rows = (pairs // self.topk + TILE - 1) // TILE * TILE
        self.schedule.build(m_idx, outputs, scratch, self.threads, pairs, expert_lo, num_rows, prefix_rows)
        grid_barrier(sync_ptr, timeout_ns, last=False)  # (the last: the one before the combine)
        tidx, _, _ = cute.arch.thread_idx()
        if tidx == 0:
            scratch[0] = m_offsets[num_experts]
        cute.arch.fence_proxy("async.shared", space="cta")  # the scratch's generic writes before TMA writes to the region
        cute.arch.sync_threads()
        total = scratch[0]
        cute.arch.sync_threads()  # (every thread has it before the pipelines take the region over)
        return total

    @cute.jit
    def combine_all(self, worker, workers: cutlass.Constexpr[int], combine_args):
        """After every CTA's last tile (the second grid barrier), ``workers`` threads of every CTA
        (``worker`` among them) combine the tokens, 8 columns per thread per step, grid-strided,
        with the combine launch's own per-vector code (the same operations in the same order: the
        same bits)."""
        m_y, m_token_w, m_slot_row, m_shared, m_out = combine_args
        cta, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        chunks = self.hidden // VECTOR
        total = cute.size(m_out, mode=[0]) * chunks
        for v in cutlass.range(cta * workers + worker, total, ctas * workers, unroll=1):
            token = v // chunks
            combine_vector(  # EP: the slots [t, j] the ranks pushed, in j order (dense)
                m_y, m_slot_row, m_token_w, m_shared, m_out, token, v - token * chunks, self.topk, self.has_shared, False,
                self.ep_world is None,
            )

    @cute.jit
    def publish_stores(self, m_ready, tile_row):
        """The warp that issued fc1's TMA stores: once they are complete (and visible to the async
        proxy's readers), count fc1 row tile ``tile_row`` (-1: none) one column tile further
        (release, gpu scope)."""
        cute.arch.cp_async_bulk_wait_group(0, read=False)
        cute.arch.fence_proxy("async.global")
        cute.arch.sync_warp()
        if tile_row >= 0:
            if cute.arch.lane_idx() == 0:
                cute.arch.atomic_add(m_ready.iterator + tile_row, cutlass.Int32(1), sem="release", scope="gpu")

    @cute.jit
    def wait_ready(self, m_ready, m_flags, tile_row, timeout_ns, sync_ptr):
        """The thread that loads an fc2 tile's a: wait (acquire, bounded) until every fc1 column tile
        of ``tile_row`` is published. On timeout set flags[0], count one in sync[2] (the grid-barrier
        words' timeout count, which outlives the launch and which the host reads:
        :func:`mok.ops.raise_grid_timeouts`, the EP workspace's check; flags[0] does not, the next
        schedule launch clears it) and go on: wrong output, no hang."""
        target = self.fc1.col_tiles
        if wait_at_least(m_ready.iterator + tile_row, target, timeout_ns, "gpu") < target:
            m_flags[0] = 1
            cute.arch.atomic_add(sync_ptr + 2, cutlass.Int32(1), scope="gpu")
