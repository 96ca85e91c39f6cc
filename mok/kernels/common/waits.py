"""The bounded waits MoK's kernels share: on an int32 counter (expert-parallel flags, the one-launch
MLP's progress counts) and across the whole grid (the one-launch forward, after its schedule)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from ..constants import GRID_SYNC_WORDS  # noqa: F401 (the size of grid_barrier's ``sync``: [arrived, generation, timeouts, left])


@cute.jit
def wait_at_least(counter: cute.Pointer, target: cutlass.Int32, timeout_ns: cutlass.Int64, scope: cutlass.Constexpr[str]):
    """Poll ``counter`` with acquire reads at ``scope`` ("gpu" or "sys") until it holds at least
    ``target`` or ``timeout_ns`` of %globaltimer have passed; returns the last value read (still
    below ``target``: timed out, the caller records it and goes on instead of hanging)."""
    start = cute.arch.globaltimer()
    seen = cute.arch.atomic_add(counter, cutlass.Int32(0), sem="acquire", scope=scope)
    waited = cutlass.Int64(0)
    while seen < target and waited < timeout_ns:
        seen = cute.arch.atomic_add(counter, cutlass.Int32(0), sem="acquire", scope=scope)
        waited = cute.arch.globaltimer() - start
    return seen


@cute.jit
def grid_barrier(
    sync: cute.Pointer, timeout_ns: cutlass.Int64, leader: cutlass.Constexpr[int] = 0, last: cutlass.Constexpr[bool] = True
):
    """Every CTA of the (1-D, fully resident) grid waits here until all have arrived; called by all
    threads of every CTA. ``sync``: GRID_SYNC_WORDS int32 in global memory that outlive the launch,
    zero when first used. Sense reversal: the leader reads the generation, arrives (acq_rel, gpu
    scope, after a fence that makes its CTA's writes visible); the last to arrive resets
    ``arrived`` to 0 for the next launch and advances the generation (release), the others poll it
    (acquire) for a change. So the words need no clearing between launches and the generation may
    wrap. The poll is bounded by %globaltimer: on expiry it counts a timeout in sync[2] (never
    cleared by a kernel: the host reads and clears it) and goes on instead of hanging. ``leader``:
    the thread that arrives and polls for its CTA (the others only meet it at bar.sync 0).
    ``last``: the launch's last barrier. Past it each leader counts its CTA out in sync[3]; the
    last CTA out sets ``arrived`` and sync[3] back to 0, so the words are ready for the next
    launch even after a timeout (which leaves ``arrived`` counting CTAs that were late)."""
    cute.arch.sync_threads()
    tid, _, _ = cute.arch.thread_idx()
    if tid == leader:
        ctas, _, _ = cute.arch.grid_dim()
        generation = cute.arch.atomic_add(sync + 1, cutlass.Int32(0), sem="acquire", scope="gpu")
        cute.arch.fence_acq_rel_gpu()
        arrived = cute.arch.atomic_add(sync, cutlass.Int32(1), sem="acq_rel", scope="gpu")
        if arrived == ctas - 1:
            cute.arch.atomic_exch(sync, cutlass.Int32(0), sem="relaxed", scope="gpu")
            cute.arch.atomic_add(sync + 1, cutlass.Int32(1), sem="release", scope="gpu")
        else:
            start = cute.arch.globaltimer()
            seen = cute.arch.atomic_add(sync + 1, cutlass.Int32(0), sem="acquire", scope="gpu")
            waited = cutlass.Int64(0)
            while seen == generation and waited < timeout_ns:
                seen = cute.arch.atomic_add(sync + 1, cutlass.Int32(0), sem="acquire", scope="gpu")
                waited = cute.arch.globaltimer() - start
            if seen == generation:
                cute.arch.atomic_add(sync + 2, cutlass.Int32(1), scope="gpu")
        cute.arch.fence_acq_rel_gpu()
        if cutlass.const_expr(last):
            left = cute.arch.atomic_add(sync + 3, cutlass.Int32(1), sem="acq_rel", scope="gpu")
            if left == ctas - 1:
                cute.arch.atomic_exch(sync, cutlass.Int32(0), sem="relaxed", scope="gpu")
                cute.arch.atomic_exch(sync + 3, cutlass.Int32(0), sem="relaxed", scope="gpu")
    cute.arch.sync_threads()
