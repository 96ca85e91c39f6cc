"""The expert-parallel workspace: one address range holding every rank's region, and its error record.

Each rank's region (the same layout on every rank, :class:`EPLayout`) holds its flags, its
published routing and tokens, the combine slots its tokens' expert outputs are pushed into, and
the backward's router weights and router-gradient pieces. The range is the symmetric VMM mapping
of mok/runtime/workspace.py across GPUs (:meth:`EPWorkspace.from_symmetric`), or, for tests on
one GPU, one buffer shared by W "ranks" running on W streams (:meth:`EPWorkspace.local_group`).
A wait that times out, or a routing that overflows a capacity bound, is recorded in the
workspace; :meth:`EPWorkspace.check` raises with it, and every later call raises it too.
"""

from __future__ import annotations

import functools
import itertools
import math
import weakref
from dataclasses import dataclass

import torch

from ..kernels.common.flag_layout import ERROR_CAPACITY, PHASE_DONE, PHASE_PUBLISH, error_slot, flag_words, grid_sync_slot
from ..kernels.constants import GRID_SYNC_WORDS
from ..schedule import worst_case_capacity
from ..validation import check_capacity_factor

ALIGN = 256  # bytes: every region starts on it (16-byte vectors, TMA)
PHASES = {PHASE_PUBLISH: "publish (waiting for the peer's tokens)", PHASE_DONE: "combine (waiting for the peer's expert outputs)"}


def _round(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class EPLayout:
    """Byte layout of one rank's workspace region (the same on every rank)."""

    world: int
    max_tokens: int
    hidden: int
    topk: int

    @functools.cached_property
    def regions(self) -> dict[str, tuple[int, int, torch.dtype]]:
        """name -> (byte offset, elements, dtype) (computed once: every call reads it many times)."""
        sizes = {
            "flags": (flag_words(self.world), torch.int32),
            "idx": (self.max_tokens * self.topk, torch.int32),
            "x": (self.max_tokens * self.hidden, torch.bfloat16),
            "slots": (self.max_tokens * self.topk * self.hidden, torch.bfloat16),
            # backward: this rank's router weights, and the router-weight gradient of every
            # rank's (token, slot) pairs that this rank's experts computed
            "w": (self.max_tokens * self.topk, torch.float32),
            "dw": (self.world * self.max_tokens * self.topk, torch.float32),
        }
        out, offset = {}, 0
        for name, (count, dtype) in sizes.items():
            out[name] = (offset, count, dtype)
            offset += _round(count * dtype.itemsize)
        return out

    @property
    def stride(self) -> int:
        """Bytes from one rank's region to the next."""
        offset, count, dtype = list(self.regions.values())[-1]
        return _round(offset + count * dtype.itemsize)


class _DeviceRange:
    """A raw device address range as a CUDA array (so torch can view memory it did not allocate)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def capacity_rows(layout: EPLayout, num_local: int, capacity_factor: float | None, block_m: int = 128) -> int | None:
    """Expert rows one rank holds per call for ``capacity_factor`` (None: the worst case, nothing can overflow).

    A factor f admits f times the rows of a perfectly even routing (T_max·k per rank), plus
    each local expert's tile padding; capped at the worst case, where no bound is needed.
    """
    if capacity_factor is None:
        return None
    check_capacity_factor(capacity_factor)
    worst = worst_case_capacity(layout.world * layout.max_tokens, layout.topk, num_local, block_m)
    rows = math.ceil(capacity_factor * layout.max_tokens * layout.topk) + num_local * (block_m - 1)
    return min(-(-rows // block_m) * block_m, worst)


_BY_HANDLE: "weakref.WeakValueDictionary[int, EPWorkspace]" = weakref.WeakValueDictionary()
_NEXT_HANDLE = itertools.count(1)


def workspace_by_handle(handle: int) -> "EPWorkspace":
    """The live workspace with this ``handle`` (how the torch ops of mok/torch_ops.py name theirs)."""
    ws = _BY_HANDLE.get(handle)
    if ws is None:
        raise ValueError(f"workspace: no live MoK expert-parallel workspace has handle {handle}")
    return ws


REBUILD = ("rebuild the workspace: close() it on every rank; the next call builds a new one (of a torch.compile'd "
           "MoELayer: call layer.workspace() eagerly first).")  # (the error records' advice)
REBUILD_SENTENCE = REBUILD[0].upper() + REBUILD[1:]  # (as a sentence of its own; capitalize() would lower "MoELayer")


class EPWorkspace:
    """One rank's handle on the workspace: the whole range (all ranks' regions, ``rank_stride``
    bytes apart, default the layout's stride) and its rank.

    ``capacity``: expert rows this rank holds per call (a multiple of 128; None: the worst
    case). A routing that needs more gives the pairs that did not fit NaN outputs (and NaN
    gradients) and records the overflow in every rank's error record, which
    :meth:`check` raises and every later call of the workspace raises (:meth:`raise_pending`).
    """

    def __init__(
        self, buffer: torch.Tensor, layout: EPLayout, rank: int, rank_stride: int | None = None, *, capacity: int | None = None,
        ranks_on_device: int = 1,
    ) -> None:
        rank_stride = layout.stride if rank_stride is None else rank_stride
        if rank_stride < layout.stride or rank_stride % ALIGN:
            raise ValueError(f"rank_stride: expected a multiple of {ALIGN} that is >= {layout.stride}, got {rank_stride}")
        if buffer.dtype != torch.uint8 or buffer.numel() < layout.world * rank_stride:
            raise ValueError(f"buffer: expected >= {layout.world * rank_stride} uint8 bytes, got {buffer.numel()} {buffer.dtype}")
        if buffer.dim() != 1 or not buffer.is_contiguous() or (buffer.is_cuda and buffer.data_ptr() % ALIGN):
            raise ValueError(
                f"buffer: expected a contiguous 1-D uint8 tensor starting on a {ALIGN}-byte boundary (the regions' offsets "
                f"are from it), got shape {list(buffer.shape)} at {buffer.data_ptr():#x}"
            )
        if not 0 <= rank < layout.world:
            raise ValueError(f"rank: expected 0..{layout.world - 1}, got {rank}")
        if layout.world * rank_stride // 2 >= 2**31:  # the kernels index bf16 elements across all ranks in 32 bits
            raise ValueError(f"layout: {layout.world} ranks of {rank_stride} bytes exceed 32-bit element offsets; lower max_tokens")
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1 or capacity % 128):
            raise ValueError(f"capacity: expected a positive multiple of 128 rows (or None: the worst case), got {capacity!r}")
        self.buffer, self.layout, self.rank, self.rank_stride = buffer, layout, rank, rank_stride
        self.capacity = capacity
        self.ranks_on_device = ranks_on_device  # ranks whose kernels share this GPU (a one-launch forward takes its share of SMs)
        self.owner = None  # the SymmetricWorkspace behind the buffer, when there is one (kept alive here)
        self._record_copy = self._record_ready = None  # the error record as last copied to the host (raise_pending)
        self.kernels: dict = {}  # the exchange kernels of its layout, loaded at its first call (exchange.exchange_kernels)
        self.one_launch_statics: dict = {}  # what its one-launch forwards launch with, per weight shapes (exchange.py)
        self.handle = next(_NEXT_HANDLE)  # names it to the torch ops (mok/torch_ops.py)
        _BY_HANDLE[self.handle] = self

    @classmethod
    def from_symmetric(cls, symmetric, layout: EPLayout, *, capacity: int | None = None) -> "EPWorkspace":
        """This rank's handle on a :class:`mok.runtime.workspace.SymmetricWorkspace` (every rank mapped in one range).

        Zeroes this rank's region, then waits for every rank (host barrier, once) so that no
        peer signals into flags that are still being cleared.
        """
        import torch.distributed as dist

        if symmetric.world != layout.world or symmetric.nbytes < layout.stride:
            raise ValueError(
                f"symmetric: expected {layout.world} ranks of >= {layout.stride} bytes, got {symmetric.world} of {symmetric.nbytes}"
            )
        buffer = torch.as_tensor(_DeviceRange(symmetric.base, symmetric.size * symmetric.world), device=f"cuda:{symmetric.device}")
        uuids = [None] * symmetric.world  # which ranks share a GPU (processes sharing one, e.g. under MPS)
        dist.all_gather_object(uuids, str(torch.cuda.get_device_properties(symmetric.device).uuid), group=symmetric.group)
        ranks_on_device = uuids.count(uuids[symmetric.rank])
        ws = cls(buffer, layout, symmetric.rank, rank_stride=symmetric.size, capacity=capacity, ranks_on_device=ranks_on_device)
        ws.owner = symmetric
        ws.buffer[symmetric.rank * symmetric.size:(symmetric.rank + 1) * symmetric.size].zero_()
        torch.cuda.synchronize(symmetric.device)
        dist.barrier(group=symmetric.group)
        return ws

    @classmethod
    def local_group(cls, layout: EPLayout, device: torch.device | str = "cuda", *, capacity: int | None = None) -> list["EPWorkspace"]:
        """W ranks sharing one zeroed buffer on one GPU (each rank runs on its own stream): for tests."""
        buffer = torch.zeros(layout.world * layout.stride, dtype=torch.uint8, device=device)
        return [cls(buffer, layout, r, capacity=capacity, ranks_on_device=layout.world) for r in range(layout.world)]

    @property
    def closed(self) -> bool:
        """Whether the symmetric memory behind this workspace was released (:meth:`close`)."""
        return self.owner is not None and self.owner.closed

    def close(self) -> None:
        """Release the symmetric memory behind this workspace (on every rank of its group, together:
        e.g. after an error it recorded). :func:`mok.get_workspace` and the layers using it build a
        new one at their next call; CUDA graphs captured with this one must be captured again."""
        if self.owner is not None:
            self.owner.close()

    def region(self, name: str, rank: int | None = None) -> torch.Tensor:
        """Rank ``rank``'s (default: this rank's) region ``name`` as a flat typed tensor."""
        offset, count, dtype = self.layout.regions[name]
        start = (self.rank if rank is None else rank) * self.rank_stride + offset
        return self.buffer[start:start + count * dtype.itemsize].view(dtype)

    def expert_rows(self, num_local: int, block_m: int = 128) -> int:
        """Rows this rank's ``num_local`` experts hold per call: the capacity bound, else the worst case."""
        lay = self.layout
        return self.capacity or worst_case_capacity(lay.world * lay.max_tokens, lay.topk, num_local, block_m)

    def stride_elems(self, name: str) -> int:
        """Elements of region ``name``'s dtype from one rank's copy to the next."""
        return self.rank_stride // self.layout.regions[name][2].itemsize

    def _record(self) -> torch.Tensor:
        """The error record and, past it, the one-launch forward's grid-barrier words (timeouts: the 3rd)."""
        err = error_slot(self.layout.world)
        return self.region("flags")[err:grid_sync_slot(self.layout.world) + GRID_SYNC_WORDS]

    def _timeouts_index(self) -> int:
        """Where in :meth:`_record` the count of expired waits on this rank's own work lies (the
        grid-barrier words' third)."""
        return grid_sync_slot(self.layout.world) - error_slot(self.layout.world) + 2

    def check(self) -> None:
        """Raise if this rank's error record holds an error (reads it back: call it off the hot path)."""
        self._raise_for(self._record().tolist())

    def _raise_for(self, record: list[int]) -> None:
        code, a, b, c = record[:4]
        grid_timeouts = record[self._timeouts_index()]
        if code == ERROR_CAPACITY:
            raise RuntimeError(
                f"MoK expert parallelism: the experts of rank {a} were routed {b} rows (tile padding included), "
                f"capacity is {c}; the (token, slot) pairs that did not fit have NaN outputs and gradients. "
                f"Raise capacity_factor (None: the worst case, which never overflows) and {REBUILD}"
            )
        if code:
            raise RuntimeError(
                f"MoK expert parallelism: rank {self.rank} timed out in phase {PHASES.get(a, a)} waiting for "
                f"rank {b} (epoch {c}); the peer did not reach the same call. {REBUILD_SENTENCE}"
            )
        if grid_timeouts:
            raise RuntimeError(
                f"MoK expert parallelism: a wait of rank {self.rank}'s kernels on their own work timed out {grid_timeouts} "
                "time(s): a one-launch forward's grid barrier or an fc2 tile's wait for its rows (its CTAs were not all "
                "resident at once, e.g. other kernels held SMs); those "
                f"outputs are wrong. {REBUILD_SENTENCE}"
            )

    def raise_pending(self) -> None:
        """Raise for an error an earlier call recorded, as far as its copy to the host has landed
        (never waits; nothing to do while capturing a CUDA graph)."""
        if not self.buffer.is_cuda:
            self.check()
        elif torch.cuda.is_current_stream_capturing():
            return
        elif self._record_ready is not None and self._record_ready.query():
            self._raise_for(self._record_copy.tolist())

    def copy_record(self) -> None:
        """Queue a copy of the error record to the host after this call's work on the current stream
        (read by :meth:`raise_pending`; skipped during CUDA-graph capture)."""
        if not self.buffer.is_cuda or torch.cuda.is_current_stream_capturing():
            return
        if self._record_copy is None:
            self._record_copy = torch.zeros(self._record().numel(), dtype=torch.int32, pin_memory=True)
            self._record_ready = torch.cuda.Event()
        self._record_copy.copy_(self._record(), non_blocking=True)
        self._record_ready.record()
