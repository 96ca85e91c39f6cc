"""The device schedule: routing -> expert-grouped row slots in one launch, the bits of mok.schedule.build_schedule."""

from __future__ import annotations

import torch

from ..kernels.variants import schedule_ctas, schedule_variant
from ..runtime import launch
from ..schedule import Schedule, check_schedule_args, shared_prefix_rows
from ..validation import check_tensor
from .common import I32, check_32bit, kernel_for, sm_count


def device_schedule(
    topk_idx: torch.Tensor, num_experts: int, *, block_m: int = 128, capacity: int | None = None, rank: int = 0, world_size: int = 1,
    shared_prefix: bool = False,
) -> Schedule:
    """:func:`mok.schedule.build_schedule` computed by one kernel launch (many CTAs), bit for bit.

    topk_idx: [N, k] int32 on the GPU (global expert ids, canonical token order). The
    overflow field is an int32 flag (non-zero: the routing needed more than ``capacity`` rows).
    ``shared_prefix``: a shared expert's rows in front of the routed ones (the same launch writes
    them; ``capacity`` is the routed rows').
    """
    num_tokens, topk, num_local, capacity = check_schedule_args(topk_idx, num_experts, block_m, capacity, rank, world_size)
    prefix = shared_prefix_rows(num_tokens, block_m) if shared_prefix else 0
    check_tensor("topk_idx", topk_idx, dtypes=I32, contiguous=True)
    if topk_idx.device.type != "cuda":
        raise ValueError(f"topk_idx: expected a CUDA tensor, got one on {topk_idx.device}")
    check_32bit("topk_idx", topk_idx)
    dev = topk_idx.device
    sched = Schedule.empty(num_tokens, topk, num_local, prefix + capacity, block_m, dev, shared_rows=prefix, world_size=world_size)
    if not num_tokens:  # nothing routed: no launch
        return sched.mark_unrouted()
    kernel = kernel_for(schedule_variant(num_local, topk, block_m), dev)
    kernel(
        launch.ptr("i32", topk_idx, 4), *(launch.ptr("i32", t, 4) for t in sched.tensors()),
        launch.ptr("i32", None, 4),  # (no buffer to clear: the kernel's clear is the one-launch forward's)
        launch.i32(num_tokens), launch.i32(rank * num_local), launch.i32(prefix + capacity), launch.i32(0),
        launch.i32(schedule_ctas(num_tokens * topk, sm_count(dev))), launch.i32(prefix), launch.stream(dev),
    )
    return sched
