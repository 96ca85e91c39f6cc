"""Expert-parallel exchange kernels over a symmetric workspace (arch-neutral; first, multi-launch version).

Every rank's workspace has the same layout and sits at ``base + rank·stride`` in one address
range (mok/runtime/workspace.py maps the peers' memory there; a single-GPU test puts W
"ranks" in one buffer), so a kernel reaches rank p's copy of a region as row p of one tensor.
The flag region's words are laid out in flag_layout.py (the workspace's byte layout:
mok/pipeline/workspace.py).

Flags carry the epoch they belong to (a counter each rank advances once per forward, on the
device, so graph replays keep working): a writer stores ``epoch`` into the reader's slot
with a system-scope release after a system-scope fence; the reader polls its slot with
system-scope acquire loads until it holds at least its own epoch. Every wait is bounded by
%globaltimer: on expiry the kernel writes (1, phase, peer, epoch) to its error record and
returns, and the Python side raises instead of hanging. Flags are integers: no float
atomics anywhere, and no data ever depends on arrival order.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

from .flag_layout import (
    ERROR_CAPACITY, ERROR_TIMEOUT, PHASE_DONE, PHASE_PUBLISH, epoch_slot, error_slot, flag_slot, flag_words, publish_count_slot,
    tokens_slot,
)
from .fp8_block_quantize import BLOCK as FP8_BLOCK, QuantizeFp8BlockKernel, block_e8m0_word, last_block_32s, mma_scale_word
from .mxfp8_quantize import BLOCK, e8m0_factor, quantize_rows_strided
from .row_vectors import VECTOR
from .waits import wait_at_least
def check_width(width: int) -> None:
    """A row width the 16-byte vector copies can take."""
    if width % VECTOR:
        raise ValueError(f"width: expected a multiple of {VECTOR}, got {width}")


FP8_ROW_VECTOR = 16  # E4M3 bytes of a 16-byte vector: fp8_block rows are multiples of it


def check_quantized_rows(row_format: str, width: int) -> None:
    """A quantized exchange's row format and a row width it takes: "mxfp8" or "fp8_block", either
    with 16-byte E4M3 rows (a partial last 32- or 128-block)."""
    if row_format not in ("mxfp8", "fp8_block"):
        raise ValueError(f"row_format: expected 'mxfp8' or 'fp8_block', got {row_format!r}")
    if width % FP8_ROW_VECTOR:
        raise ValueError(f"width: expected a multiple of {FP8_ROW_VECTOR} (16-byte E4M3 rows), got {width}")


@cute.jit
def record_timeout(m_flags: cute.Tensor, rank, world: cutlass.Constexpr[int], phase: cutlass.Constexpr[int], peer, epoch):
    """A wait for ``peer``'s ``phase`` of ``epoch`` timed out: (1, phase, peer, epoch) into this
    rank's error record, unless one is there already (the first error stays)."""
    claim_record(m_flags, rank, world, ERROR_TIMEOUT, phase, peer, epoch)


@cute.jit
def claim_record(m_flags: cute.Tensor, owner, world: cutlass.Constexpr[int], code: cutlass.Constexpr[int], a, b, c):
    """(code, a, b, c) into rank ``owner``'s error record if it is still clean: a system-scope
    compare-and-swap on its code word, so the first error recorded stays."""
    err = error_slot(world)
    record = m_flags[owner, None].iterator + err
    if cute.arch.atomic_cas(record, cmp=cutlass.Int32(0), val=cutlass.Int32(code), scope="sys") == 0:
        m_flags[owner, err + 1] = a
        m_flags[owner, err + 2] = b
        m_flags[owner, err + 3] = c


@cute.jit
def signal_all(m_flags: cute.Tensor, rank, world: cutlass.Constexpr[int], phase: cutlass.Constexpr[int], epoch):
    """One thread: after a system-scope fence, ``epoch`` into every rank's slot (phase, this rank), release."""
    cute.arch.fence_acq_rel_sys()
    for peer in cutlass.range(world, unroll=1):
        slot = m_flags[peer, None].iterator + flag_slot(phase, rank, world)
        cute.arch.atomic_exch(slot, epoch, sem="release", scope="sys")


@cute.jit
def wait_all(m_flags: cute.Tensor, rank, world: cutlass.Constexpr[int], phase: cutlass.Constexpr[int], epoch,
             timeout_ns: cutlass.Int64, tid):
    """Threads ``tid`` < W: wait (acquire, system scope, bounded) until rank ``tid`` signalled
    ``phase`` of ``epoch``; on timeout record it and go on. The caller synchronises its threads after."""
    if tid < world:
        seen = wait_at_least(m_flags[rank, None].iterator + flag_slot(phase, tid, world), epoch, timeout_ns, "sys")
        if seen < epoch:
            record_timeout(m_flags, rank, world, phase, tid, epoch)


class EpSignalKernel:
    """Tell every rank (self included) that this rank reached the done phase of its current epoch.

    Launched after the kernels whose writes it announces (stream order), with a system-scope
    fence before the release stores. (The publish phase, which also advances the epoch, is
    signalled by EpPublishKernel.)
    """

    def __init__(self, world: int, phase: int) -> None:
        if phase != PHASE_DONE:
            raise ValueError(f"phase: expected PHASE_DONE ({PHASE_DONE}); the publish signal is EpPublishKernel's, got {phase}")
        self.world, self.phase = world, phase

    @cute.jit
    def __call__(self, flags_ptr: cute.Pointer, rank: cutlass.Int32, stride: cutlass.Int32, stream: cuda.CUstream):
        m_flags = cute.make_tensor(flags_ptr, cute.make_layout((self.world, flag_words(self.world)), stride=(stride, 1)))
        self.kernel(m_flags, rank).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, m_flags: cute.Tensor, rank: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        if tidx == 0:
            signal_all(m_flags, rank, self.world, self.phase, m_flags[rank, epoch_slot()])


class EpWaitKernel:
    """Wait (bounded) until every rank announced ``phase`` of this rank's current epoch."""

    def __init__(self, world: int, phase: int) -> None:
        if world > 32:
            raise ValueError(f"world: expected at most 32 ranks (one lane each), got {world}")
        self.world, self.phase = world, phase

    @cute.jit
    def __call__(
        self, flags_ptr: cute.Pointer, rank: cutlass.Int32, stride: cutlass.Int32, timeout_ns: cutlass.Int64,
        stream: cuda.CUstream,
    ):
        m_flags = cute.make_tensor(flags_ptr, cute.make_layout((self.world, flag_words(self.world)), stride=(stride, 1)))
        self.kernel(m_flags, rank, timeout_ns).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, m_flags: cute.Tensor, rank: cutlass.Int32, timeout_ns: cutlass.Int64):
        lane, _, _ = cute.arch.thread_idx()
        wait_all(m_flags, rank, self.world, self.phase, m_flags[rank, epoch_slot()], timeout_ns, lane)


class EpRowsKernel:
    """Base of the EP kernels over rows of ``width`` bf16 (a multiple of VECTOR) and ``topk`` slots
    a token, for ``world`` ranks, ``threads`` per CTA (the class's default unless given)."""

    threads = 256

    def __init__(self, world: int, width: int, topk: int, threads: int | None = None) -> None:
        check_width(width)
        self.world, self.width, self.topk = world, width, topk
        if threads is not None:
            self.threads = threads


class EpPublishKernel(EpRowsKernel):
    """This rank's call inputs into its published regions, then the publish signal: one launch for
    what were two copies, the token count's fill and the signal kernel.

    Every CTA copies its share of the rows ([T, width] bf16, e.g. x or dout) and of the 32-bit
    values ([T, k], e.g. topk_idx or the router weights' bits) grid-strided, then counts itself
    done (a system-scope fence first, then an acq_rel add at gpu scope); the last CTA resets the
    count, writes the token count, advances the epoch and signals every rank (EpSignalKernel's
    release stores). No CTA waits for another: any grid size is safe.
    """

    @cute.jit
    def __call__(
        self, flags_ptr: cute.Pointer, rows_ptr: cute.Pointer, values_ptr: cute.Pointer, src_rows_ptr: cute.Pointer,
        src_values_ptr: cute.Pointer, rank: cutlass.Int32, num_tokens: cutlass.Int32, max_ctas: cutlass.Int32,
        flags_stride: cutlass.Int32, rows_stride: cutlass.Int32, values_stride: cutlass.Int32, stream: cuda.CUstream,
    ):
        h = self.width
        rows_stride = cute.assume(rows_stride, divby=VECTOR)
        m_rows = cute.make_tensor(rows_ptr, cute.make_layout((self.world, num_tokens * h), stride=(rows_stride, 1)))
        m_src_rows = cute.make_tensor(src_rows_ptr, cute.make_layout((num_tokens * h,)))
        m_flags, m_values, m_src_values = self.value_tensors(flags_ptr, values_ptr, src_values_ptr, num_tokens, flags_stride, values_stride)
        self.kernel(m_flags, m_rows, m_values, m_src_rows, m_src_values, rank, num_tokens).launch(
            **self.launch_shape(num_tokens * (h // VECTOR), max_ctas, stream)
        )

    def value_tensors(self, flags_ptr, values_ptr, src_values_ptr, num_tokens, flags_stride, values_stride) -> tuple:
        """Every rank's flags and values regions, and this rank's values to publish."""
        w, k = self.world, self.topk
        m_flags = cute.make_tensor(flags_ptr, cute.make_layout((w, flag_words(w)), stride=(flags_stride, 1)))
        m_values = cute.make_tensor(values_ptr, cute.make_layout((w, num_tokens * k), stride=(values_stride, 1)))
        m_src_values = cute.make_tensor(src_values_ptr, cute.make_layout((num_tokens * k,)))
        return m_flags, m_values, m_src_values

    def launch_shape(self, units, max_ctas, stream) -> dict:
        """A thread per unit of row work, at most ``max_ctas`` CTAs and at least one (the signal)."""
        ctas = cutlass.max(cutlass.min((units + self.threads - 1) // self.threads, max_ctas), 1)
        return dict(grid=[ctas, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self, m_flags: cute.Tensor, m_rows: cute.Tensor, m_values: cute.Tensor, m_src_rows: cute.Tensor, m_src_values: cute.Tensor,
        rank: cutlass.Int32, num_tokens: cutlass.Int32,
    ):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        src = cute.zipped_divide(m_src_rows, (VECTOR,))
        dst = cute.zipped_divide(m_rows[rank, None], (VECTOR,))
        for v in cutlass.range(cta * self.threads + tid, num_tokens * (self.width // VECTOR), ctas * self.threads, unroll=1):
            dst[None, v].store(src[None, v].load())
        self.publish_values(m_flags, m_values, m_src_values, rank, num_tokens, tid, cta, ctas)

    @cute.jit
    def publish_values(
        self, m_flags: cute.Tensor, m_values: cute.Tensor, m_src_values: cute.Tensor, rank, num_tokens, tid, cta, ctas,
    ):
        """This CTA's share of the values, then its count; the last CTA in signals (the class docstring)."""
        for i in cutlass.range(cta * self.threads + tid, num_tokens * self.topk, ctas * self.threads, unroll=1):
            m_values[rank, i] = m_src_values[i]
        cute.arch.sync_threads()
        if tid == 0:
            cute.arch.fence_acq_rel_sys()  # this CTA's copies (ordered before by the bar.sync) before its count
            count = m_flags[rank, None].iterator + publish_count_slot(self.world)
            if cute.arch.atomic_add(count, cutlass.Int32(1), sem="acq_rel", scope="gpu") == ctas - 1:
                cute.arch.atomic_exch(count, cutlass.Int32(0), sem="relaxed", scope="gpu")  # ready for the next call
                m_flags[rank, tokens_slot(self.world)] = num_tokens
                epoch = m_flags[rank, epoch_slot()] + 1
                m_flags[rank, epoch_slot()] = epoch
                signal_all(m_flags, rank, self.world, PHASE_PUBLISH, epoch)


class EpPublishQuantizedKernel(EpPublishKernel):
    """EpPublishKernel whose rows go out quantized, into this rank's own region (the peers' are not
    written), then the values and the signal as EpPublishKernel: one launch where a quantizer and a
    publish of the values were two. ``row_format``:

    - "mxfp8": every thread quantizes blocks of 32 of x (mok.ops.quantize_mxfp8's bytes,
      :func:`quantize_rows_strided`; a row's last block partial where H ≡ 16 mod 32): E4M3 elements
      [T, H], then E8M0 scales [T, ceil(H / 32)] (mok.pipeline.exchange.quantized_region);
    - "fp8_block" (precision fp8_block's activations: mok.ops.quantize_fp8_rows's elements and
      scales, by the row quantizer's own steps, common/fp8_block_quantize.py, with ``power_of_two``
      its scale rule): a warp per (token, 128-column block), E4M3 elements [T, H], then fp32 scales
      [T, ceil(H / 128)] (mok.pipeline.exchange.quantized_region)."""

    def __init__(self, world: int, width: int, topk: int, row_format: str, power_of_two: bool = False, threads: int | None = None) -> None:
        check_quantized_rows(row_format, width)
        super().__init__(world, width, topk, threads)
        self.row_format = row_format
        self.rows = QuantizeFp8BlockKernel(width, power_of_two=power_of_two) if row_format == "fp8_block" else None

    @cute.jit
    def __call__(
        self, flags_ptr: cute.Pointer, elements_ptr: cute.Pointer, scales_ptr: cute.Pointer, values_ptr: cute.Pointer,
        src_rows_ptr: cute.Pointer, src_values_ptr: cute.Pointer, rank: cutlass.Int32, num_tokens: cutlass.Int32,
        max_ctas: cutlass.Int32, flags_stride: cutlass.Int32, values_stride: cutlass.Int32, stream: cuda.CUstream,
    ):
        """``elements_ptr`` and ``scales_ptr``: this rank's region."""
        if cutlass.const_expr(self.row_format == "mxfp8"):  # (a thread a block)
            blocks = -(-self.width // BLOCK)
            units = num_tokens * blocks
            rows = cute.make_layout((num_tokens, self.width), stride=(self.width, 1))
            m_x, m_elements = cute.make_tensor(src_rows_ptr, rows), cute.make_tensor(elements_ptr, rows)
            m_scales = cute.make_tensor(scales_ptr, cute.make_layout((num_tokens, blocks), stride=(blocks, 1)))
        else:
            rows = cute.make_layout((num_tokens, self.width), stride=(self.width, 1))
            m_x, m_elements = cute.make_tensor(src_rows_ptr, rows), cute.make_tensor(elements_ptr, rows)
            k_blocks = self.rows.k_blocks
            m_scales = cute.make_tensor(scales_ptr, cute.make_layout((num_tokens, k_blocks), stride=(k_blocks, 1)))
            units = num_tokens * k_blocks * 32  # (a warp a block)
        m_flags, m_values, m_src_values = self.value_tensors(flags_ptr, values_ptr, src_values_ptr, num_tokens, flags_stride, values_stride)
        self.kernel_quantized(m_flags, m_x, m_elements, m_scales, m_values, m_src_values, rank, num_tokens).launch(
            **self.launch_shape(units, max_ctas, stream)
        )

    @cute.kernel
    def kernel_quantized(
        self, m_flags: cute.Tensor, m_x: cute.Tensor, m_elements: cute.Tensor, m_scales: cute.Tensor, m_values: cute.Tensor,
        m_src_values: cute.Tensor, rank: cutlass.Int32, num_tokens: cutlass.Int32,
    ):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        if cutlass.const_expr(self.row_format == "mxfp8"):
            quantize_rows_strided(m_x.iterator, m_elements.iterator, m_scales.iterator, num_tokens, self.width,
                                  cta * self.threads + tid, ctas * self.threads)
        else:
            warps, k_blocks = self.threads // 32, self.rows.k_blocks
            warp, lane = cute.arch.make_warp_uniform(tid // 32), tid % 32
            for unit in cutlass.range(cta * warps + warp, num_tokens * k_blocks, ctas * warps, unroll=1):
                token, k_block = unit // k_blocks, unit % k_blocks
                scale = self.rows.quantize_row_block(m_x, m_elements, token, token, k_block, lane)
                if lane == 0:
                    self.rows.store_row_scale(m_scales, token, k_block, scale)
        self.publish_values(m_flags, m_values, m_src_values, rank, num_tokens, tid, cta, ctas)


class EpRoutingGatherKernel:
    """routing[p·T_max + t, :] = rank p's published topk_idx[t, :] for t < T_p, else -1 (no token),
    once every rank published this rank's epoch: each CTA first waits for that (bounded; a timeout
    is recorded as phase publish), so no wait kernel of its own is launched before it."""

    def __init__(self, world: int, topk: int, threads: int = 256) -> None:
        self.world, self.topk, self.threads = world, topk, threads

    @cute.jit
    def __call__(
        self, flags_ptr: cute.Pointer, idx_ptr: cute.Pointer, routing_ptr: cute.Pointer, rank: cutlass.Int32, t_max: cutlass.Int32,
        flags_stride: cutlass.Int32, idx_stride: cutlass.Int32, timeout_ns: cutlass.Int64, stream: cuda.CUstream,
    ):
        w, k = self.world, self.topk
        m_flags = cute.make_tensor(flags_ptr, cute.make_layout((w, flag_words(w)), stride=(flags_stride, 1)))
        m_idx = cute.make_tensor(idx_ptr, cute.make_layout((w, t_max * k), stride=(idx_stride, 1)))
        m_routing = cute.make_tensor(routing_ptr, cute.make_layout((w, t_max * k), stride=(t_max * k, 1)))
        self.kernel(m_flags, m_idx, m_routing, rank, t_max, timeout_ns).launch(
            grid=[(t_max * k + self.threads - 1) // self.threads, w, 1], block=[self.threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self, m_flags: cute.Tensor, m_idx: cute.Tensor, m_routing: cute.Tensor, rank: cutlass.Int32, t_max: cutlass.Int32,
        timeout_ns: cutlass.Int64,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        block, peer, _ = cute.arch.block_idx()
        # every rank's publish of this epoch (the publish launch advanced it)
        wait_all(m_flags, rank, self.world, PHASE_PUBLISH, m_flags[rank, epoch_slot()], timeout_ns, tidx)
        cute.arch.sync_threads()
        i = block * self.threads + tidx
        if i < t_max * self.topk:
            value = cutlass.Int32(-1)
            if i < m_flags[peer, tokens_slot(self.world)] * self.topk:
                value = m_idx[peer, i]
            m_routing[peer, i] = value


class EpDispatchKernel:
    """rows[slot_row[g, j]] = x of global token g (g = p·T_max + t, from rank p's published x) for
    every pair (g, j) placed on this rank; zeros for every expert's padding rows.

    Token-major: one CTA per token reads its whole x row once (over NVLink when the token's
    rank is a peer; each thread keeps all its 16-byte vectors in flight at once) and stores it
    into each of its rows here, so a token with several local experts crosses the link once,
    not once per expert (4x fewer remote bytes at k = 8 over two ranks). One CTA per local
    expert e then zeros its padding rows [offsets[e] + counts[e], offsets[e + 1]) (clipped to the
    buffer): the GEMMs read them; nothing reads the unused rows past the schedule's end.
    """

    vector = VECTOR  # elements of a 16-byte vector of the rows copied (bf16 out: 8)

    def __init__(self, world: int, width: int, topk: int, max_threads: int = 128) -> None:
        check_width(width)
        vectors = width // self.vector
        self.world, self.width, self.topk = world, width, topk
        # the fewest vectors a thread, then the fewest threads for them: every thread the same
        # vectors where a divisor allows (H = 7168: 128 x 7), else the last thread's few idle (H = 2056: 86 x 3 for 257)
        self.per_thread = -(-vectors // max_threads)
        self.threads = -(-vectors // self.per_thread)
        self.vectors = vectors

    @cute.jit
    def __call__(
        self, x_ptr: cute.Pointer, slot_row_ptr: cute.Pointer, counts_ptr: cute.Pointer, offsets_ptr: cute.Pointer,
        out_ptr: cute.Pointer, t_max: cutlass.Int32, x_stride: cutlass.Int32, num_rows: cutlass.Int32, num_local: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        h = self.width
        x_stride = cute.assume(x_stride, divby=VECTOR)  # (ep.py keeps every region 128-byte aligned)
        m_x = cute.make_tensor(x_ptr, cute.make_layout((self.world, t_max, h), stride=(x_stride, h, 1)))
        rows = self.row_tensors(slot_row_ptr, counts_ptr, offsets_ptr, out_ptr, t_max, num_rows, num_local)
        self.kernel(m_x, *rows, t_max, num_rows).launch(**self.launch_shape(t_max, num_local, stream))

    def row_tensors(self, slot_row_ptr, counts_ptr, offsets_ptr, out_ptr, t_max, num_rows, num_local) -> tuple:
        """(slot_row [W·T_max, k], expert counts, expert offsets, rows out [R, H]) of the schedule."""
        m_slot_row = cute.make_tensor(slot_row_ptr, cute.make_layout((self.world * t_max, self.topk), stride=(self.topk, 1)))
        m_counts = cute.make_tensor(counts_ptr, cute.make_layout((num_local,)))
        m_offsets = cute.make_tensor(offsets_ptr, cute.make_layout((num_local + 1,)))
        m_out = cute.make_tensor(out_ptr, cute.make_layout((num_rows, self.width), stride=(self.width, 1)))
        return m_slot_row, m_counts, m_offsets, m_out

    def launch_shape(self, t_max, num_local, stream) -> dict:
        """A CTA per token of every rank, then one per local expert (its padding rows)."""
        return dict(grid=[self.world * t_max + num_local, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self, m_x: cute.Tensor, m_slot_row: cute.Tensor, m_counts: cute.Tensor, m_offsets: cute.Tensor, m_out: cute.Tensor,
        t_max: cutlass.Int32, num_rows: cutlass.Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        tokens = self.world * t_max
        if block < tokens:
            if self.local_rows(m_slot_row, block) > 0:
                src = cute.zipped_divide(m_x[block // t_max, block % t_max, None], (VECTOR,))
                vecs = [src[None, self.vector_of(tidx, i)].load() for i in range(self.per_thread)]  # all loads first
                self.store_rows(vecs, m_slot_row, m_out, block, tidx)
        else:
            self.zero_padding(m_counts, m_offsets, m_out, block - tokens, num_rows, tidx)

    def vector_of(self, tidx, i: int):
        """The row's vector that thread ``tidx`` loads ``i``-th: its own, or where the threads hold
        more slots than the row has vectors, the last one for the idle slots (a valid address, not stored)."""
        vector = tidx + i * self.threads
        if self.threads * self.per_thread == self.vectors:
            return vector
        return cutlass.min(vector, self.vectors - 1)

    def owns(self, tidx, i: int):
        """Whether thread ``tidx``'s ``i``-th slot is a vector of the row (always, where the threads divide the row)."""
        if self.threads * self.per_thread == self.vectors:
            return True
        return tidx + i * self.threads < self.vectors

    @cute.jit
    def local_rows(self, m_slot_row: cute.Tensor, token) -> cutlass.Int32:
        """How many of a token's slots have a row here (its experts on this rank)."""
        local = cutlass.Int32(0)
        for j in cutlass.range_constexpr(self.topk):
            if m_slot_row[token, j] >= 0:
                local = local + 1
        return local

    @cute.jit
    def store_rows(self, vecs: list, m_slot_row: cute.Tensor, m_out: cute.Tensor, token, tidx):
        """This thread's vectors of a token's row into each of its rows here."""
        for j in cutlass.range(self.topk, unroll_full=True):
            dest = m_slot_row[token, j]
            if dest >= 0:
                dst = cute.zipped_divide(m_out[dest, None], (self.vector,))
                for i in cutlass.range_constexpr(self.per_thread):
                    if self.owns(tidx, i):
                        dst[None, tidx + i * self.threads].store(vecs[i])

    @cute.jit
    def zero_padding(self, m_counts: cute.Tensor, m_offsets: cute.Tensor, m_out: cute.Tensor, expert, num_rows, tidx):
        """Zeros into local expert ``expert``'s padding rows (clipped to the buffer)."""
        first = m_offsets[expert] + m_counts[expert]
        end = cutlass.min(m_offsets[expert + 1], num_rows)
        for row in cutlass.range(first, end, unroll=1):
            dst = cute.zipped_divide(m_out[row, None], (self.vector,))
            for i in cutlass.range_constexpr(self.per_thread):
                if self.owns(tidx, i):
                    out_vec = dst[None, tidx + i * self.threads]
                    out_vec.store(cute.full(out_vec.shape, 0.0, m_out.element_type))


class EpDispatchQuantizedKernel(EpDispatchKernel):
    """EpDispatchKernel for rows published quantized (EpPublishQuantizedKernel), rank p's region
    holding its tokens' E4M3 elements [T_max, H] and then their scales. All of a token's loads
    first, as in the bf16 dispatch; then, by ``row_format``:

    - "mxfp8" (E8M0 scales [T_max, ceil(H / 32)]): each row here gets bf16(element·2**(scale - 127)),
      mok.ops.dequantize_mxfp8's bits; a thread's unit is 8 elements (an 8-byte load and its scale
      byte), a 16-byte store per row. A token crosses the link as H·33/32 bytes instead of 2H;
    - "fp8_block" (fp32 scales [T_max, ceil(H / 128)]): each row here gets the token's elements
      and scales as they are (no conversion: the FP8 GEMM reads them), the elements as bytes, 16 a
      vector, the scales into [ceil(H / 128), R], the layout the GEMM's TMA reads; padding rows get
      zero elements and zero scales. A token crosses as H + 4·ceil(H / 128) bytes. ``scale_order``
      "mma" (power-of-two scales: SM100's block-scaled MMAs): each scale goes into the rows' MXFP8
      scales instead, its exponent field as the E8M0 byte of each of the block's 32-blocks (127
      past a partial last block's), in the order the MMAs read (uint8 [R / 128, ceil(H / 128),
      512], a row's block one 4-byte word; the padding rows' bytes zero), exact for a power of two."""

    def __init__(self, world: int, width: int, topk: int, row_format: str, max_threads: int = 128, scale_order: str = "rows") -> None:
        check_quantized_rows(row_format, width)
        if scale_order not in ("rows", "mma"):
            raise ValueError(f"scale_order: expected 'rows' or 'mma', got {scale_order!r}")
        if scale_order == "mma" and row_format != "fp8_block":
            raise ValueError(f"scale_order='mma': fp8_block rows, got row_format={row_format!r}")
        self.row_format, self.scale_order = row_format, scale_order
        if row_format == "fp8_block":
            self.vector = FP8_ROW_VECTOR  # (the elements copied as bytes)
        super().__init__(world, width, topk, max_threads)
        self.k_blocks = -(-width // FP8_BLOCK)
        self.last_32s = last_block_32s(width)  # (scale_order "mma": the rest of a row's last E8M0 word padding)

    @cute.jit
    def __call__(
        self, elements_ptr: cute.Pointer, scales_ptr: cute.Pointer, slot_row_ptr: cute.Pointer, counts_ptr: cute.Pointer,
        offsets_ptr: cute.Pointer, out_ptr: cute.Pointer, out_scales_ptr: cute.Pointer, t_max: cutlass.Int32, x_stride_bytes: cutlass.Int64,
        num_rows: cutlass.Int32, num_local: cutlass.Int32, stream: cuda.CUstream,
    ):
        """``elements_ptr``, ``scales_ptr``: rank 0's region (the ranks' regions ``x_stride_bytes``
        apart); ``out_ptr`` the rows [R, H] (bf16, or fp8_block's elements as bytes),
        ``out_scales_ptr`` fp8_block's scales [ceil(H / 128), R] (``scale_order`` "mma": [R / 128,
        H / 128, 512] E8M0 as 4-byte words; unused with mxfp8)."""
        h = self.width
        x_stride_bytes = cute.assume(x_stride_bytes, divby=16)  # (64-bit: bytes, twice the bf16 regions' element offsets)
        m_el = cute.make_tensor(elements_ptr, cute.make_layout((self.world, t_max, h), stride=(x_stride_bytes, h, 1)))
        if cutlass.const_expr(self.row_format == "mxfp8"):
            blocks = -(-h // BLOCK)
            m_sc = cute.make_tensor(scales_ptr, cute.make_layout((self.world, t_max, blocks), stride=(x_stride_bytes, blocks, 1)))
        else:
            m_sc = cute.make_tensor(scales_ptr, cute.make_layout((self.world, t_max, self.k_blocks), stride=(x_stride_bytes // 4, self.k_blocks, 1)))
        if cutlass.const_expr(self.scale_order == "mma"):
            m_out_scales = cute.make_tensor(out_scales_ptr, cute.make_layout(((num_rows + FP8_BLOCK - 1) // FP8_BLOCK * self.k_blocks * FP8_BLOCK,)))
        else:
            m_out_scales = cute.make_tensor(out_scales_ptr, cute.make_layout((self.k_blocks, num_rows), stride=(num_rows, 1)))
        rows = self.row_tensors(slot_row_ptr, counts_ptr, offsets_ptr, out_ptr, t_max, num_rows, num_local)
        self.kernel_quantized(m_el, m_sc, *rows, m_out_scales, t_max, num_rows).launch(**self.launch_shape(t_max, num_local, stream))

    @cute.kernel
    def kernel_quantized(
        self, m_el: cute.Tensor, m_sc: cute.Tensor, m_slot_row: cute.Tensor, m_counts: cute.Tensor, m_offsets: cute.Tensor,
        m_out: cute.Tensor, m_out_scales: cute.Tensor, t_max: cutlass.Int32, num_rows: cutlass.Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        tokens = self.world * t_max
        if block < tokens:
            if self.local_rows(m_slot_row, block) > 0:
                rank, t = block // t_max, block % t_max
                src = cute.zipped_divide(m_el[rank, t, None], (self.vector,))
                loaded = [src[None, self.vector_of(tidx, i)].load() for i in range(self.per_thread)]  # all loads first
                vecs = loaded
                if cutlass.const_expr(self.row_format == "mxfp8"):
                    exponents = [cutlass.Int32(m_sc[rank, t, self.vector_of(tidx, i) >> 2]) & 0xFF for i in range(self.per_thread)]
                    vecs = [(loaded[i].to(cutlass.Float32) * e8m0_factor(exponents[i])).to(m_out.element_type) for i in range(self.per_thread)]
                self.store_rows(vecs, m_slot_row, m_out, block, tidx)
                if cutlass.const_expr(self.row_format == "fp8_block"):  # the token's scales into each of its rows'
                    for k_block in cutlass.range(tidx, self.k_blocks, self.threads, unroll=1):
                        scale = m_sc[rank, t, k_block]
                        for j in cutlass.range(self.topk, unroll_full=True):
                            dest = m_slot_row[block, j]
                            if dest >= 0:
                                self.store_scale(m_out_scales, dest, k_block, scale)
        else:
            expert = block - tokens
            self.zero_padding(m_counts, m_offsets, m_out, expert, num_rows, tidx)
            if cutlass.const_expr(self.row_format == "fp8_block"):
                for row in cutlass.range(m_offsets[expert] + m_counts[expert], cutlass.min(m_offsets[expert + 1], num_rows), unroll=1):
                    for k_block in cutlass.range(tidx, self.k_blocks, self.threads, unroll=1):
                        self.store_scale(m_out_scales, row, k_block, cutlass.Float32(0.0))

    @cute.jit
    def store_scale(self, m_out_scales: cute.Tensor, row, k_block, scale):
        """fp8_block: row ``row``'s scale of K block ``k_block``, fp32 at [k_block, row], or
        (``scale_order`` "mma") its E8M0 word at the row's place in the MMA order."""
        if cutlass.const_expr(self.scale_order == "mma"):
            m_out_scales[mma_scale_word(row, k_block, self.k_blocks)] = block_e8m0_word(scale, k_block, self.k_blocks, self.last_32s)
        else:
            m_out_scales[k_block, row] = scale


class EpOverflowKernel(EpRowsKernel):
    """Make a capacity overflow loud: every (token, slot) pair routed to this rank's experts that
    got no row (slot_row < 0: past the capacity) has its pushed slot row set to NaN on the
    token's rank, and with ``gradient`` its router-gradient piece in this rank's "dw" region
    too; when the schedule overflowed, thread 0 records (2, rank, rows needed, capacity) in
    every rank's error record whose record is still clean (compare-and-swap on the code).

    Launched between the push of the same call and its done signal (stream order: peers read
    the slots and pieces after the signal), only when a capacity bound is set.
    """

    def __init__(self, world: int, width: int, topk: int, gradient: bool, threads: int | None = None) -> None:
        super().__init__(world, width, topk, threads)
        self.gradient = gradient

    @cute.jit
    def __call__(
        self, flags_ptr: cute.Pointer, routing_ptr: cute.Pointer, slot_row_ptr: cute.Pointer, overflow_ptr: cute.Pointer,
        offsets_ptr: cute.Pointer, slots_ptr: cute.Pointer, dw_ptr: cute.Pointer, rank: cutlass.Int32, num_local: cutlass.Int32,
        capacity: cutlass.Int32, t_max: cutlass.Int32, flags_stride: cutlass.Int32, slots_stride: cutlass.Int32, stream: cuda.CUstream,
    ):
        w, h, k = self.world, self.width, self.topk
        slots_stride = cute.assume(slots_stride, divby=VECTOR)
        pairs = w * t_max * k
        m_flags = cute.make_tensor(flags_ptr, cute.make_layout((w, flag_words(w)), stride=(flags_stride, 1)))
        m_routing = cute.make_tensor(routing_ptr, cute.make_layout((pairs,)))
        m_slot_row = cute.make_tensor(slot_row_ptr, cute.make_layout((pairs,)))
        m_over = cute.make_tensor(overflow_ptr, cute.make_layout((1,)))
        m_offsets = cute.make_tensor(offsets_ptr, cute.make_layout((num_local + 1,)))
        m_slots = cute.make_tensor(slots_ptr, cute.make_layout((w, t_max * k, h), stride=(slots_stride, h, 1)))
        m_dw = cute.make_tensor(dw_ptr, cute.make_layout((pairs,)))
        self.kernel(m_flags, m_routing, m_slot_row, m_over, m_offsets, m_slots, m_dw, rank, num_local, capacity, t_max).launch(
            grid=[(pairs + self.threads - 1) // self.threads, 1, 1], block=[self.threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self, m_flags: cute.Tensor, m_routing: cute.Tensor, m_slot_row: cute.Tensor, m_over: cute.Tensor, m_offsets: cute.Tensor,
        m_slots: cute.Tensor, m_dw: cute.Tensor, rank: cutlass.Int32, num_local: cutlass.Int32, capacity: cutlass.Int32,
        t_max: cutlass.Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        i = block * self.threads + tidx
        if i == 0:
            if m_over[0] != 0:
                claim_capacity_error(m_flags, self.world, rank, m_offsets[num_local], capacity)
        if i < self.world * t_max * self.topk:
            poison_dropped_pair(m_routing, m_slot_row, m_slots, m_dw, i, rank, num_local, t_max, self.topk, self.width, self.gradient)


@cute.jit
def claim_capacity_error(m_flags: cute.Tensor, world: cutlass.Constexpr[int], rank, rows_needed, capacity):
    """One thread: (2, rank, rows needed, capacity) into every rank's error record still clean
    (the first error stays)."""
    for peer in cutlass.range(world, unroll=1):
        claim_record(m_flags, peer, world, ERROR_CAPACITY, rank, rows_needed, capacity)


@cute.jit
def poison_dropped_pair(
    m_routing: cute.Tensor, m_slot_row: cute.Tensor, m_slots: cute.Tensor, m_dw: cute.Tensor, i, rank, num_local, t_max,
    topk: cutlass.Constexpr[int], width: cutlass.Constexpr[int], gradient: cutlass.Constexpr[bool],
):
    """Pair ``i`` (global token i // k, slot i % k): if it went to one of this rank's experts but got
    no row (past the capacity), NaN into its slot on the token's rank (m_slots: [W, T_max·k, H]),
    and with ``gradient`` into its router-gradient piece here."""
    expert = m_routing[i] - rank * num_local
    if expert >= 0:
        if expert < num_local:
            if m_slot_row[i] < 0:
                g = i // topk
                dst = cute.zipped_divide(m_slots[g // t_max, (g % t_max) * topk + i % topk, None], (VECTOR,))
                nan = cute.full((VECTOR,), float("nan"), m_slots.element_type)
                for chunk in cutlass.range(width // VECTOR, unroll=1):
                    dst[None, chunk].store(nan)
                if cutlass.const_expr(gradient):
                    m_dw[i] = cutlass.Float32(float("nan"))


def _ptr(dtype, align):
    from cutlass.cute.runtime import make_ptr

    return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=align)


def compile_ep(kind: str, world: int, arch: str, options: str = "", *, phase: int = 0, width: int = 8, topk: int = 1,
               power_of_two: bool = False, scale_order: str = "rows"):
    """Compile one EP kernel (``kind``: signal, wait, publish, publish_mxfp8, publish_fp8_block, routing, dispatch,
    dispatch_mxfp8, dispatch_fp8_block, overflow) for ``arch`` without tensors.

    For ``overflow``, ``phase`` PHASE_DONE selects the backward's variant (it poisons the router-gradient pieces too);
    ``power_of_two``: publish_fp8_block's scale rule; ``scale_order``: dispatch_fp8_block's (EpDispatchQuantizedKernel).
    """
    if scale_order != "rows" and kind != "dispatch_fp8_block":
        raise ValueError(f"scale_order: dispatch_fp8_block's option, got {scale_order!r} for {kind}")
    from cutlass.cute.runtime import make_fake_stream

    i32, bf16, i = cutlass.Int32, cutlass.BFloat16, cutlass.Int32(1)
    stream = make_fake_stream()
    if kind == "signal":
        kernel, args = EpSignalKernel(world, phase), (_ptr(i32, 4), i, i, stream)
    elif kind == "wait":
        kernel, args = EpWaitKernel(world, phase), (_ptr(i32, 4), i, i, cutlass.Int64(1), stream)
    elif kind == "publish":
        kernel = EpPublishKernel(world, width, topk)
        args = (_ptr(i32, 4), _ptr(bf16, 16), _ptr(i32, 4), _ptr(bf16, 16), _ptr(i32, 4), i, i, i, i, i, i, stream)
    elif kind == "publish_mxfp8":
        kernel = EpPublishQuantizedKernel(world, width, topk, "mxfp8")
        args = (_ptr(i32, 4), _ptr(cutlass.Float8E4M3FN, 16), _ptr(cutlass.Uint8, 1), _ptr(i32, 4), _ptr(bf16, 16), _ptr(i32, 4), i, i, i, i, i, stream)
    elif kind == "publish_fp8_block":
        kernel = EpPublishQuantizedKernel(world, width, topk, "fp8_block", power_of_two)
        args = (
            _ptr(i32, 4), _ptr(cutlass.Float8E4M3FN, 16), _ptr(cutlass.Float32, 16), _ptr(i32, 4), _ptr(bf16, 16), _ptr(i32, 4),
            i, i, i, i, i, stream,
        )
    elif kind == "routing":
        kernel = EpRoutingGatherKernel(world, topk)
        args = (_ptr(i32, 4), _ptr(i32, 4), _ptr(i32, 4), i, i, i, i, cutlass.Int64(1), stream)
    elif kind == "dispatch":
        kernel = EpDispatchKernel(world, width, topk)
        args = (_ptr(bf16, 16), _ptr(i32, 4), _ptr(i32, 4), _ptr(i32, 4), _ptr(bf16, 16), i, i, i, i, stream)
    elif kind == "dispatch_mxfp8":
        kernel = EpDispatchQuantizedKernel(world, width, topk, "mxfp8")
        args = (
            _ptr(cutlass.Float8E4M3FN, 16), _ptr(cutlass.Uint8, 1), *(_ptr(i32, 4) for _ in range(3)), _ptr(bf16, 16), _ptr(cutlass.Float32, 16),
            i, cutlass.Int64(16), i, i, stream,
        )
    elif kind == "dispatch_fp8_block":
        kernel = EpDispatchQuantizedKernel(world, width, topk, "fp8_block", scale_order=scale_order)
        args = (
            _ptr(cutlass.Uint8, 16), _ptr(cutlass.Float32, 16), *(_ptr(i32, 4) for _ in range(3)), _ptr(cutlass.Uint8, 16),
            _ptr(cutlass.Float32, 16), i, cutlass.Int64(16), i, i, stream,
        )
    elif kind == "overflow":
        kernel = EpOverflowKernel(world, width, topk, gradient=phase == PHASE_DONE)
        args = (*(_ptr(i32, 4) for _ in range(5)), _ptr(bf16, 16), _ptr(cutlass.Float32, 4), i, i, i, i, i, i, stream)
    else:
        raise ValueError(
            f"kind: expected signal, wait, publish, publish_mxfp8, publish_fp8_block, routing, dispatch, dispatch_mxfp8, "
            f"dispatch_fp8_block or overflow, got {kind!r}"
        )
    return cute.compile(kernel, *args, options=f"--gpu-arch {arch} {options}".strip())
