"""The bounded wait on an int32 counter that MoK's kernels share (expert-parallel flags, the one-launch MLP's progress count)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute


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
