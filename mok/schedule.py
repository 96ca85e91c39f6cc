"""Routing -> row slots: the deterministic schedule of DESIGN.md, in plain PyTorch.

Every (global token g, slot j) routed to one of this rank's experts gets one row of the
rank's expert-grouped buffer. Experts are laid out one after another in increasing id;
each expert's region is padded to a multiple of ``block_m`` (so a GEMM row tile never
holds two experts); inside a region rows follow the canonical order g, then j.

Placement is a pure function of the routing (prefix sums over counts, no atomics), so
the device kernel that computes it later must reproduce this module bit for bit. It runs
on CPU and GPU and never reads a count back to the host: capacity overflow is reported
through the ``overflow`` tensor, and rows that do not fit get no slot (-1), never a
silently shared one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .validation import INDEX_DTYPES, check_positive_int, check_tensor


@dataclass(frozen=True)
class Schedule:
    """Row placement for one rank's experts.

    expert_counts [E_local]: rows routed to each local expert (unpadded).
    expert_offsets [E_local + 1]: padded start row of each expert; the last entry is the
        number of rows the routing needs, which may exceed ``capacity`` (see overflow).
    row_token [capacity]: global token id g of each row, -1 for padding and unused rows.
    row_slot [capacity]: slot j of each row, -1 likewise.
    slot_row [N, k]: row of (g, j) in this rank's buffer; -1 when its expert is not local
        or it did not fit.
    tile_expert [capacity // block_m]: local expert of each row tile, -1 for unused tiles.
    overflow []: True when the routing needs more than ``capacity`` rows.
    shared_rows: rows in front of the routed experts' that hold a shared expert (0: none):
        ceil(N / block_m)·block_m rows, row r < N token r's with slot k (no routed pair has
        it), their tiles expert E_local; ``capacity`` counts them, every offset starts after them.
    world_size: the ranks the routing's tokens come from (> 1: one rank's expert-parallel
        schedule, its experts holding only some of each token's slots).
    """

    expert_counts: torch.Tensor
    expert_offsets: torch.Tensor
    row_token: torch.Tensor
    row_slot: torch.Tensor
    slot_row: torch.Tensor
    tile_expert: torch.Tensor
    overflow: torch.Tensor
    block_m: int
    capacity: int
    shared_rows: int = 0
    world_size: int = 1

    FIELDS = ("expert_counts", "expert_offsets", "row_token", "row_slot", "slot_row", "tile_expert", "overflow")  # its tensors

    @staticmethod
    def shapes(num_tokens: int, topk: int, num_local: int, capacity: int, block_m: int) -> tuple[tuple[int, ...], ...]:
        """Its tensors' shapes in FIELDS order, for N = ``num_tokens`` pairs' tokens and ``capacity`` rows."""
        return (num_local,), (num_local + 1,), (capacity,), (capacity,), (num_tokens, topk), (capacity // block_m,), ()

    @classmethod
    def empty(
        cls, num_tokens: int, topk: int, num_local: int, capacity: int, block_m: int, device: torch.device, *, shared_rows: int = 0,
        world_size: int = 1,
    ) -> "Schedule":
        """A schedule's int32 tensors, unwritten (a schedule launch fills them)."""
        shapes = cls.shapes(num_tokens, topk, num_local, capacity, block_m)
        tensors = [torch.empty(shape, dtype=torch.int32, device=device) for shape in shapes]
        return cls(*tensors, block_m, capacity, shared_rows, world_size)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors in FIELDS order (what an op returns, and :meth:`of_tensors` takes back)."""
        return tuple(getattr(self, name) for name in self.FIELDS)

    @classmethod
    def of_tensors(cls, tensors, block_m: int, *, shared_rows: int = 0, world_size: int = 1) -> "Schedule":
        """The schedule of :meth:`tensors`' output (its capacity: the row maps' length)."""
        fields = dict(zip(cls.FIELDS, tensors))
        return cls(**fields, block_m=block_m, capacity=fields["row_token"].shape[0], shared_rows=shared_rows, world_size=world_size)

    def mark_unrouted(self) -> "Schedule":
        """Fill it as the schedule of no tokens: no rows, every row unused."""
        self.expert_counts.zero_(), self.expert_offsets.zero_(), self.overflow.zero_()
        self.row_token.fill_(-1), self.row_slot.fill_(-1), self.tile_expert.fill_(-1)
        return self

    def check_overflow(self) -> None:
        """Raise if the routing did not fit (reads one flag back: call it off the hot path)."""
        if bool(self.overflow):
            needed = int(self.expert_offsets[-1])
            raise RuntimeError(
                f"MoK schedule overflow: the routing needs {needed} expert rows on this rank, "
                f"capacity is {self.capacity}; raise the capacity (the worst case is "
                f"worst_case_capacity(...))"
            )


def check_schedule(
    name: str, schedule: object, *, num_tokens: int, topk: int, num_experts: int, device: torch.device, block_m: int = 128
) -> Schedule:
    """Check that a kernel can read ``schedule`` for these shapes: a :class:`Schedule` of
    ``num_tokens`` x ``topk`` pairs over ``num_experts`` local experts in ``block_m``-row tiles,
    its tensors int32, contiguous and on ``device``, sized for its capacity."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"{name}: expected a mok.schedule.Schedule, got {type(schedule).__name__}")
    if schedule.block_m != block_m:
        raise ValueError(f"{name}: expected {block_m}-row tiles (block_m={block_m}), got block_m={schedule.block_m}")
    if tuple(schedule.slot_row.shape) != (num_tokens, topk):
        raise ValueError(f"{name}: expected one for {num_tokens} tokens x top-{topk}, got slot_row of shape {list(schedule.slot_row.shape)}")
    if schedule.expert_counts.shape != (num_experts,):
        raise ValueError(f"{name}: expected one over {num_experts} experts, got expert_counts of shape {list(schedule.expert_counts.shape)}")
    rows = schedule.capacity
    if rows % block_m:  # (the kernels read a tile_expert entry per block_m rows, ceil(rows / block_m) of them)
        raise ValueError(f"{name}: expected a capacity that is a multiple of block_m={block_m}, got {rows} rows")
    i32 = (torch.int32,)
    for field, shape in (("expert_counts", (num_experts,)), ("expert_offsets", (num_experts + 1,)), ("row_token", (rows,)),
                         ("row_slot", (rows,)), ("slot_row", (num_tokens, topk)), ("tile_expert", (rows // block_m,))):
        check_tensor(f"{name}.{field}", getattr(schedule, field), dtypes=i32, shape=shape, device=device, contiguous=True)
    return schedule


def worst_case_capacity(num_tokens: int, topk: int, num_local_experts: int, block_m: int) -> int:
    """Rows that any routing of ``num_tokens`` global tokens can need on one rank.

    All N·k (token, slot) pairs may land on this rank's experts; each expert that holds
    any row adds fewer than ``block_m`` rows of padding. Rounded up to whole tiles.
    """
    pairs = num_tokens * topk
    padded = pairs + min(num_local_experts, pairs) * (block_m - 1)
    return -(-padded // block_m) * block_m


def check_schedule_args(
    topk_idx: torch.Tensor, num_experts: int, block_m: int, capacity: int | None, rank: int, world_size: int
) -> tuple[int, int, int, int]:
    """Validate a schedule request; returns (N, k, local experts, capacity with its default)."""
    check_tensor("topk_idx", topk_idx, dtypes=INDEX_DTYPES, ndim=2)
    check_positive_int("num_experts", num_experts)
    check_positive_int("block_m", block_m)
    check_positive_int("world_size", world_size)
    if num_experts % world_size:
        raise ValueError(f"num_experts: expected a multiple of world_size={world_size}, got {num_experts}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank: expected an int in [0, {world_size}), got {rank!r}")
    num_tokens, topk = topk_idx.shape
    num_local = num_experts // world_size
    if capacity is None:
        capacity = worst_case_capacity(num_tokens, topk, num_local, block_m)
    check_positive_int("capacity", capacity, minimum=0)
    if capacity % block_m:
        raise ValueError(f"capacity: expected a multiple of block_m={block_m}, got {capacity}")
    return num_tokens, topk, num_local, capacity


def build_schedule(
    topk_idx: torch.Tensor, num_experts: int, *, block_m: int = 128, capacity: int | None = None, rank: int = 0, world_size: int = 1,
    shared_prefix: bool = False,
) -> Schedule:
    """Schedule of rank ``rank``'s experts for the global routing ``topk_idx`` [N, k].

    ``topk_idx`` holds all ranks' routing concatenated in rank order (row g is global
    token g) with global expert ids; rank r owns experts [r·E/W, (r+1)·E/W). ``capacity``
    (a multiple of ``block_m``) defaults to :func:`worst_case_capacity`. ``shared_prefix``:
    the routed rows follow a shared expert's (see :class:`Schedule`; ``capacity`` is then the
    routed rows', the schedule's capacity that plus the prefix).
    """
    num_tokens, topk, num_local, capacity = check_schedule_args(topk_idx, num_experts, block_m, capacity, rank, world_size)
    if shared_prefix:
        return _with_shared_prefix(build_schedule(topk_idx, num_experts, block_m=block_m, capacity=capacity, rank=rank,
                                                  world_size=world_size))

    device = topk_idx.device
    i64 = dict(dtype=torch.int64, device=device)
    pairs = num_tokens * topk
    local = topk_idx.reshape(-1).to(torch.int64) - rank * num_local
    is_local = (local >= 0) & (local < num_local)
    bucket = torch.where(is_local, local, num_local)  # pairs of other ranks' experts go to bucket E_local

    bucket_counts = torch.zeros(num_local + 1, **i64).scatter_add_(0, bucket, torch.ones(pairs, **i64))
    counts = bucket_counts[:num_local]
    padded = (counts + block_m - 1) // block_m * block_m
    offsets = torch.zeros(num_local + 1, **i64)
    offsets[1:] = torch.cumsum(padded, 0)

    # Rank of each pair inside its bucket: a stable sort keeps canonical (g, j) order.
    bucket_start = torch.zeros(num_local + 1, **i64)
    bucket_start[1:] = torch.cumsum(bucket_counts, 0)[:-1]
    sorted_bucket, perm = torch.sort(bucket, stable=True)
    rank_in_bucket = torch.arange(pairs, **i64) - bucket_start[sorted_bucket]
    row_sorted = torch.cat([offsets[:-1], offsets.new_zeros(1)])[sorted_bucket] + rank_in_bucket
    row = torch.empty(pairs, **i64).scatter_(0, perm, row_sorted)

    placed = is_local & (row < capacity)
    slot_row = torch.where(placed, row, -1)
    target = torch.where(placed, row, capacity)  # unplaced pairs land in a dropped sink entry
    pair_id = torch.arange(pairs, **i64)
    row_token = torch.full((capacity + 1,), -1, **i64).scatter_(0, target, pair_id // topk)[:capacity]
    row_slot = torch.full((capacity + 1,), -1, **i64).scatter_(0, target, pair_id % topk)[:capacity]

    tile_start = torch.arange(capacity // block_m, **i64) * block_m
    tile_expert = torch.searchsorted(offsets[1:], tile_start, right=True)
    tile_expert = torch.where(tile_start < offsets[-1], tile_expert, -1)

    i32 = torch.int32
    return Schedule(
        expert_counts=counts.to(i32),
        expert_offsets=offsets.to(i32),
        row_token=row_token.to(i32),
        row_slot=row_slot.to(i32),
        slot_row=slot_row.to(i32).view(num_tokens, topk),
        tile_expert=tile_expert.to(i32),
        overflow=offsets[-1] > capacity,
        block_m=block_m,
        capacity=capacity,
        world_size=world_size,
    )


def shared_prefix_rows(num_tokens: int, block_m: int) -> int:
    """Rows of a shared expert's prefix in front of the routed rows: the tokens, whole tiles."""
    return -(-num_tokens // block_m) * block_m


def _with_shared_prefix(routed: Schedule) -> Schedule:
    """``routed`` moved behind a shared expert's prefix of rows (see :class:`Schedule`)."""
    num_tokens, topk = routed.slot_row.shape
    bm, num_local = routed.block_m, routed.expert_counts.shape[0]
    prefix = shared_prefix_rows(num_tokens, bm)
    like = dict(dtype=torch.int32, device=routed.row_token.device)
    rows = torch.arange(prefix, **like)
    is_token = rows < num_tokens
    return Schedule(
        expert_counts=routed.expert_counts,
        expert_offsets=routed.expert_offsets + prefix,
        row_token=torch.cat([torch.where(is_token, rows, -1), routed.row_token]),
        row_slot=torch.cat([torch.where(is_token, topk, -1).to(torch.int32), routed.row_slot]),
        slot_row=torch.where(routed.slot_row >= 0, routed.slot_row + prefix, -1),
        tile_expert=torch.cat([torch.full((prefix // bm,), num_local, **like), routed.tile_expert]),
        overflow=routed.overflow,
        block_m=bm,
        capacity=prefix + routed.capacity,
        shared_rows=prefix,
    )

