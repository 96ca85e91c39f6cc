"""Expert-parallel forward over a symmetric workspace: the multi-launch version (one launch: mok/ep_one_launch.py).

Each rank holds E / W experts and its own T_r <= T_max tokens. Per call, on each rank's
stream and with no host synchronisation:

    publish     x and topk_idx (and T_r) into this rank's workspace; signal every rank (one launch;
                with dispatch_format="mxfp8" the same launch quantizes x on its way in)
    routing     once every rank published this epoch (a bounded wait in the same launch): all
                ranks' routing -> [W·T_max, k] (token g = p·T_max + t; -1 past T_p)
    schedule    the device schedule of this rank's experts over that routing (canonical order)
    dispatch    pull each row's x from its owner's workspace (or, with fused_dispatch, the
                gate/up GEMM pulls them itself; MXFP8 rows are dequantized on arrival)
    experts     grouped gate/up GEMM + SwiGLU, grouped down GEMM (the single-GPU kernels); the
                down projection writes each y row straight into its token's rank, slot [t, j]
    signal      every rank (after NaN into the slots a capacity bound dropped, if one is set)
    wait        until every rank pushed (bounded)
    combine     out[t] = shared(x[t]) + Σ_j w[t, j]·y[t, j] from the pushed slots (fp32, j in order)

Every row is computed exactly as the single-GPU forward computes it (same kernels, same
row order inside each expert), so the output equals ``moe_forward`` on the concatenated
batch bit for bit. A wait that times out records (phase, peer, epoch) in the workspace;
:meth:`EPWorkspace.check` raises with it. After a timeout the workspace is out of step
with its peers and must be rebuilt. ``ep_moe_forward_saved`` also returns what the
expert-parallel backward (mok/ep_backward.py) needs: the schedule, the pulled rows, h.

The workspace is one address range holding every rank's region at ``rank·stride``: the
symmetric VMM mapping of mok/runtime/workspace.py across GPUs
(:meth:`EPWorkspace.from_symmetric`), or, for tests on one GPU, one buffer shared by W
"ranks" running on W streams (:meth:`EPWorkspace.local_group`). The push (and, opt-in, the
dispatch) run inside the expert kernels; publishing, the routing gather (with the publish
wait) and the done signal and wait are launches of their own.
"""

from __future__ import annotations

import functools
import itertools
import math
import weakref
from dataclasses import dataclass

import torch

from . import ops
from .config import DISPATCH_FORMATS
from .fused_forward import check_tile_multiples, shared_expert_forward
from .kernels import GRID_SYNC_WORDS, ep_variant, get_kernel
from .kernels.common.ep import ERROR_CAPACITY, PHASE_DONE, PHASE_PUBLISH, error_slot, flag_words, grid_sync_slot
from .runtime.arch import check_fused_layer_device, device_arch, has_persistent_gemms
from .schedule import Schedule, worst_case_capacity
from .validation import check_capacity_factor, check_moe_inputs, check_tensor, check_timeout

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
    """The live workspace with this ``handle`` (how the custom ops of mok/ep_ops.py name theirs)."""
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
        self._kernels = None  # the EP kernels of its layout, loaded at its first call (mok.ep._kernels)
        self._one_launch = {}  # what its one-launch forwards launch with, per weight shapes (mok/ep_one_launch.py)
        self.handle = next(_NEXT_HANDLE)  # names it to the custom ops (mok/ep_ops.py)
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

    def count_own_timeouts(self, flag: torch.Tensor) -> None:
        """Add a kernel's own timeout flag (one int32 on the device, 0 or 1) to the record's count of
        waits on this rank's own work that expired (queued on the current stream, no host sync), so
        that :meth:`check` raises for it as for the one-launch forward's grid-barrier timeouts."""
        timeouts = self._timeouts_index()
        self._record()[timeouts:timeouts + 1].add_(flag)

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
                "resident at once, e.g. other kernels held SMs), or overlap_dispatch's wait for a row tile's copy; those "
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


def _kernels(ws: EPWorkspace, device: torch.device) -> dict:
    """The EP kernels this layout uses (compiled or loaded once, before anything waits on a peer;
    the overflow markers only with a capacity bound); kept on the workspace after the first call."""
    if ws._kernels is None:
        ws._kernels = _load_kernels(ws, device)
    return ws._kernels


def _load_kernels(ws: EPWorkspace, device: torch.device) -> dict:
    lay, arch = ws.layout, device_arch(device.index)
    overflow = {} if ws.capacity is None else {
        f"overflow_{phase}": get_kernel(ep_variant("overflow", lay.world, phase=phase, width=lay.hidden, topk=lay.topk), arch)
        for phase in (PHASE_PUBLISH, PHASE_DONE)
    }
    return overflow | {
        "publish": get_kernel(ep_variant("publish", lay.world, width=lay.hidden, topk=lay.topk), arch),
        "signal_done": get_kernel(ep_variant("signal", lay.world, phase=PHASE_DONE), arch),
        "wait_done": get_kernel(ep_variant("wait", lay.world, phase=PHASE_DONE), arch),
        "routing": get_kernel(ep_variant("routing", lay.world, topk=lay.topk), arch),
        "dispatch": get_kernel(ep_variant("dispatch", lay.world, width=lay.hidden, topk=lay.topk), arch),
    }


def _mxfp8_kernels(ws: EPWorkspace, device: torch.device) -> dict:
    """:func:`_kernels` plus the MXFP8 dispatch's two (loaded at the first such call, before it waits)."""
    kernels = _kernels(ws, device)
    if "dispatch_mxfp8" not in kernels:
        lay, arch = ws.layout, device_arch(device.index)
        for kind in ("publish_mxfp8", "dispatch_mxfp8"):
            kernels[kind] = get_kernel(ep_variant(kind, lay.world, width=lay.hidden, topk=lay.topk), arch)
    return kernels


def mark_overflow(ws: EPWorkspace, kernels: dict, routing: torch.Tensor, sched: Schedule, stream, *, gradient: bool) -> None:
    """With a capacity bound: NaN into the pushed slots (and, for ``gradient``, the router-gradient
    pieces) of the pairs that got no row, and the overflow into every rank's error record."""
    if ws.capacity is None:
        return
    lay = ws.layout
    kernels[f"overflow_{PHASE_DONE if gradient else PHASE_PUBLISH}"](
        *(ops._ptr("i32", t, 4) for t in (ws.region("flags", 0), routing, sched.slot_row, sched.overflow, sched.expert_offsets)),
        ops._ptr("bf16", ws.region("slots", 0)), ops._ptr("f32", ws.region("dw"), 4), ops._i32(ws.rank),
        ops._i32(sched.expert_counts.shape[0]), ops._i32(sched.capacity), ops._i32(lay.max_tokens),
        ops._i32(ws.stride_elems("flags")), ops._i32(ws.stride_elems("slots")), stream,
    )


@dataclass
class EPForwardResult:
    """This rank's output and what its backward needs (``ep_moe_backward``): the schedule of
    this rank's experts over every rank's tokens, the rows it pulled (x_rows), h of those rows
    and of the shared expert (h and shared_h only when saved)."""

    out: torch.Tensor
    schedule: Schedule
    x_rows: torch.Tensor | None  # None after a fused dispatch (forward only)
    h: torch.Tensor | None = None
    shared_h: torch.Tensor | None = None
    routing: torch.Tensor | None = None  # every rank's routing [W·T_max, k] (marks the pairs a capacity bound dropped)


def ep_moe_forward(
    ws: EPWorkspace,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    shared: tuple | None = None,
    *,
    timeout_s: float = 5.0,
    fused_dispatch: bool = False,
    overlap_dispatch: bool = False,
    one_launch: bool = False,
    dispatch_format: str = "bf16",
) -> torch.Tensor:
    """This rank's layer output [T_r, H] bf16; its experts are global ids rank·E_local .. (rank+1)·E_local - 1.

    x [T_r, H] bf16 (T_r <= the layout's max_tokens), topk_idx [T_r, k] int32 global expert
    ids, topk_w [T_r, k] fp32, this rank's expert weights (and the replicated shared expert).
    The ids are not range-checked here (that reads the device back; mok.api.forward and
    mok.MoELayer check them): an id outside [0, E) reaches no rank, and its slot keeps whatever an
    earlier call left there. Every rank of the workspace must make the same sequence of calls,
    each ordered after the previous one on the GPU (one stream, or the caller's events between
    streams: the calls share the workspace's regions and epoch). ``fused_dispatch``: the
    gate/up GEMM pulls its rows from the peers itself (no dispatch kernel, no x_rows buffer).
    ``overlap_dispatch``: the gate/up GEMM's idle producer warps copy the rows into x_rows row
    tile by row tile while its tiles run, each tile waiting for its rows (no dispatch kernel; a
    wait that outlasts ``timeout_s`` is counted where :meth:`EPWorkspace.check` raises for it).
    ``one_launch``: the whole forward in one persistent kernel (mok/ep_one_launch.py; plus 2
    launches for a shared expert), the same bits. ``dispatch_format="mxfp8"`` (the default
    dispatch or one_launch): x crosses to the experts' ranks in MXFP8 (mok.mxfp8's rule: E4M3 elements, a scale
    byte per 32; ~half the bytes) and the routed experts compute on its bf16 dequantization,
    every token's on every rank alike (the shared expert on x itself): the output is the
    single-GPU forward's of the dequantized x, bit for bit; the backward passes the gradient
    of x through the rounding unchanged (straight-through, as FP8 dispatch does elsewhere).
    """
    return ep_moe_forward_saved(
        ws, x, topk_idx, topk_w, w_gate, w_up, w_down, shared, timeout_s=timeout_s, save_h=False, fused_dispatch=fused_dispatch,
        overlap_dispatch=overlap_dispatch, one_launch=one_launch, dispatch_format=dispatch_format,
    ).out


def check_ep_inputs(ws: EPWorkspace, x, topk_idx, topk_w, w_gate, w_up, w_down, shared) -> tuple[int, int, int, int]:
    """Validate one rank's inputs against each other and the workspace layout: (T_r, H, E_local, k)."""
    lay, world = ws.layout, ws.layout.world
    experts_total = (w_gate.shape[0] if isinstance(w_gate, torch.Tensor) and w_gate.dim() == 3 else 0) * world
    num_tokens, hidden, _, num_local, topk = check_moe_inputs(
        x, topk_idx, topk_w, w_gate, w_up, w_down, shared, dtypes=(torch.bfloat16,), router_dtypes=(torch.float32,),
        contiguous=True, experts_total=experts_total, check_range=False,
    )
    if (hidden, topk) != (lay.hidden, lay.topk) or num_tokens > lay.max_tokens:
        raise ValueError(
            f"x, topk_idx: expected H={lay.hidden}, k={lay.topk}, T <= {lay.max_tokens} (the workspace layout), "
            f"got H={hidden}, k={topk}, T={num_tokens}"
        )
    if topk_idx.dtype != torch.int32:
        raise TypeError(f"topk_idx: expected dtype int32, got {topk_idx.dtype}")
    check_tensor("topk_idx", topk_idx, contiguous=True)  # (published as T·k int32s from its start)
    if x.device != ws.buffer.device:
        raise ValueError(f"x: expected a tensor on the workspace's device {ws.buffer.device}, got one on {x.device}")
    check_rows_aligned("x", x)
    if x.is_cuda:  # a Hopper GPU, and the current device (the kernels launch there)
        arch = check_fused_layer_device(x.device.index)
        if not has_persistent_gemms(arch):
            raise NotImplementedError(f"expert parallelism: not on {arch} yet (its exchanges run in Hopper's persistent GEMMs)")
    if ws.closed:
        raise RuntimeError(
            "workspace: its symmetric memory was closed (close()); build a new one (mok.get_workspace; a MoELayer does so on "
            "its next eager call, or, compiled, on layer.workspace())"
        )
    return num_tokens, hidden, num_local, topk


def check_dispatch_format(dispatch_format: str, hidden: int, other_mode: bool) -> None:
    """``dispatch_format``: "bf16", or "mxfp8" for the default dispatch or one_launch (H a multiple of 32)."""
    if dispatch_format not in DISPATCH_FORMATS:
        raise ValueError(f"dispatch_format: expected one of {DISPATCH_FORMATS}, got {dispatch_format!r}")
    if dispatch_format == "mxfp8":
        if other_mode:
            raise ValueError("dispatch_format='mxfp8': not with fused_dispatch or overlap_dispatch (their GEMMs read the published x as bf16)")
        if hidden % 32:
            raise ValueError(f"dispatch_format='mxfp8': expected H a multiple of 32 (the MXFP8 block), got H={hidden}")


def check_rows_aligned(name: str, rows: torch.Tensor) -> None:
    """Rows the publish kernel copies with 16-byte vectors start 16-byte aligned."""
    if rows.data_ptr() % 16:
        raise ValueError(f"{name}: expected a 16-byte aligned data pointer, got address {rows.data_ptr():#x}")


def flag_args(ws: EPWorkspace) -> tuple:
    """The arguments every flag kernel takes: rank 0's flags, this rank, the flags' rank stride."""
    return (ops._ptr("i32", ws.region("flags", 0), 4), ops._i32(ws.rank), ops._i32(ws.stride_elems("flags")))


def publish(ws: EPWorkspace, kernels: dict, rows: tuple, values: tuple, stream) -> None:
    """One launch: ``rows`` = (region name, [T, H] bf16) and ``values`` = (region name, [T, k]
    32-bit) into this rank's regions, then the publish signal of a new epoch to every rank (the
    wait for the peers' is in :func:`gather_ranks`)."""
    (rows_name, rows_src), (values_name, values_src) = rows, values
    kernels["publish"](
        ops._ptr("i32", ws.region("flags", 0), 4), ops._ptr("bf16", ws.region(rows_name, 0)),
        ops._ptr("i32", ws.region(values_name, 0), 4), ops._ptr("bf16", rows_src), ops._ptr("i32", values_src, 4),
        ops._i32(ws.rank), ops._i32(rows_src.shape[0]), ops._i32(4 * ops._sm_count(rows_src.device)), ops._i32(ws.stride_elems("flags")),
        ops._i32(ws.stride_elems(rows_name)), ops._i32(ws.stride_elems(values_name)), stream,
    )


def gather_ranks(ws: EPWorkspace, kernels: dict, name: str, timeout_s: float, stream) -> torch.Tensor:
    """Once every rank published this epoch (a bounded wait in the same launch): every rank's
    [T_max, k] 32-bit region ``name`` -> [W·T_max, k] (row p·T_max + t; bits -1 past T_p)."""
    lay = ws.layout
    source = ws.region(name, 0).view(torch.int32)
    out = torch.empty(lay.world * lay.max_tokens, lay.topk, dtype=torch.int32, device=ws.buffer.device)
    kernels["routing"](
        ops._ptr("i32", ws.region("flags", 0), 4), ops._ptr("i32", source, 4), ops._ptr("i32", out, 4), ops._i32(ws.rank),
        ops._i32(lay.max_tokens), ops._i32(ws.stride_elems("flags")), ops._i32(ws.stride_elems(name)),
        ops._i64(int(timeout_s * 1e9)), stream,
    )
    return out


def pull_rows(ws: EPWorkspace, kernels: dict, name: str, sched: Schedule, stream, out: torch.Tensor | None = None) -> torch.Tensor:
    """rows[r] = row g = row_token[r] of the owner's bf16 [T_max, H] region ``name`` (zeros for the
    padding rows; the unused rows past the schedule's end are left as they are), into ``out``
    ([capacity, H] bf16) if given.

    Token-major (sched.slot_row): each token's row is read from its owner once, however many
    of this rank's experts it goes to."""
    lay = ws.layout
    rows = ops._bf16_out(out, (sched.capacity, lay.hidden), ws.buffer.device)
    kernels["dispatch"](
        ops._ptr("bf16", ws.region(name, 0)), ops._ptr("i32", sched.slot_row, 4), ops._ptr("i32", sched.expert_counts, 4),
        ops._ptr("i32", sched.expert_offsets, 4), ops._ptr("bf16", rows), ops._i32(lay.max_tokens), ops._i32(ws.stride_elems(name)),
        ops._i32(sched.capacity), ops._i32(sched.expert_counts.shape[0]), stream,
    )
    return rows


def mxfp8_region(ws: EPWorkspace, rank: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s region "x" holding MXFP8 rows: (elements float8_e4m3fn [T, H] from its first
    byte, scales uint8 [T, H / 32] from byte T_max·H); both fit in the T_max·H bf16 it holds."""
    lay = ws.layout
    region = ws.region("x", rank).view(torch.uint8)
    start = lay.max_tokens * lay.hidden
    elements = region[: num_tokens * lay.hidden].view(torch.float8_e4m3fn).view(num_tokens, lay.hidden)
    scales = region[start:start + num_tokens * lay.hidden // 32].view(num_tokens, lay.hidden // 32)
    return elements, scales


def publish_mxfp8(ws: EPWorkspace, kernels: dict, x: torch.Tensor, topk_idx: torch.Tensor, stream) -> None:
    """:func:`publish` of x in MXFP8, one launch: x quantized (mok.ops.quantize_mxfp8's bytes) into
    this rank's region "x" (:func:`mxfp8_region`), topk_idx into "idx", then the publish signal."""
    elements, scales = mxfp8_region(ws, ws.rank, x.shape[0])
    kernels["publish_mxfp8"](
        ops._ptr("i32", ws.region("flags", 0), 4), ops._ptr("e4m3", elements), ops._ptr("u8", scales, 1),
        ops._ptr("i32", ws.region("idx", 0), 4), ops._ptr("bf16", x), ops._ptr("i32", topk_idx, 4), ops._i32(ws.rank),
        ops._i32(x.shape[0]), ops._i32(4 * ops._sm_count(x.device)), ops._i32(ws.stride_elems("flags")),
        ops._i32(ws.stride_elems("idx")), stream,
    )


def pull_rows_mxfp8(ws: EPWorkspace, kernels: dict, sched: Schedule, stream) -> torch.Tensor:
    """:func:`pull_rows` of MXFP8-published x: each row dequantized to bf16 on arrival
    (mok.ops.dequantize_mxfp8's bits), H·33/32 bytes a token over the link instead of 2H."""
    lay = ws.layout
    rows = torch.empty(sched.capacity, lay.hidden, dtype=torch.bfloat16, device=ws.buffer.device)
    elements, scales = mxfp8_region(ws, 0, lay.max_tokens)  # rank 0's; the kernel steps by the rank stride
    kernels["dispatch_mxfp8"](
        ops._ptr("e4m3", elements), ops._ptr("u8", scales, 1),
        ops._ptr("i32", sched.slot_row, 4), ops._ptr("i32", sched.expert_counts, 4), ops._ptr("i32", sched.expert_offsets, 4),
        ops._ptr("bf16", rows), ops._i32(lay.max_tokens), ops._i64(ws.rank_stride), ops._i32(sched.capacity),
        ops._i32(sched.expert_counts.shape[0]), stream,
    )
    return rows


def scatter_into_slots(ws: EPWorkspace, a: torch.Tensor, b: torch.Tensor, sched: Schedule, **gemm_options) -> None:
    """The grouped GEMM of this rank's rows ``a`` with ``b`` (:func:`mok.ops.grouped_gemm_scatter`
    and its options), each row written into its token's rank, slot [t, j] of region "slots"."""
    lay = ws.layout
    slots_of_rank0 = ws.region("slots", 0)[: lay.max_tokens * lay.topk * lay.hidden].view(lay.max_tokens, lay.topk, lay.hidden)
    ops.grouped_gemm_scatter(
        a, b, sched.tile_expert, sched.row_token, sched.row_slot, slots_of_rank0, slot_ranks=(lay.world, ws.stride_elems("slots")),
        **gemm_options,
    )


def announce_pushed(ws: EPWorkspace, kernels: dict, sched, routing: torch.Tensor, stream, *, gradient: bool) -> None:
    """After this rank's rows are in their owners' slots (stream order): NaN into the slots of the
    pairs a capacity bound dropped (:func:`mark_overflow`), then signal every rank (phase done)."""
    mark_overflow(ws, kernels, routing, sched, stream, gradient=gradient)  # before the signal: peers read the slots after it
    kernels["signal_done"](*flag_args(ws), stream)


def wait_pushed(ws: EPWorkspace, kernels: dict, timeout_s: float, stream) -> None:
    """Wait (bounded) until every rank pushed this epoch's rows."""
    kernels["wait_done"](*flag_args(ws), ops._i64(int(timeout_s * 1e9)), stream)


def ep_moe_forward_saved(
    ws: EPWorkspace,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    shared: tuple | None = None,
    *,
    timeout_s: float = 5.0,
    save_h: bool = True,
    fused_dispatch: bool = False,
    overlap_dispatch: bool = False,
    one_launch: bool = False,
    dispatch_format: str = "bf16",
) -> EPForwardResult:
    """:func:`ep_moe_forward` that also returns what :func:`mok.ep_backward.ep_moe_backward` needs
    (h of this rank's rows and of the shared expert when ``save_h``; the schedule and x_rows
    always, except after a ``fused_dispatch``, which is for forwards without ``save_h``: the
    published x it pulls from is overwritten by the workspace's next call, e.g. another layer's)."""
    num_tokens, hidden, num_local, topk = check_ep_inputs(ws, x, topk_idx, topk_w, w_gate, w_up, w_down, shared)
    check_timeout(timeout_s)
    if fused_dispatch and save_h:
        raise ValueError("fused_dispatch: only with save_h=False (a backward needs the pulled rows kept; the unfused dispatch keeps them)")
    if fused_dispatch + overlap_dispatch + one_launch > 1:
        raise ValueError("fused_dispatch, overlap_dispatch, one_launch: at most one (different ways of running the forward)")
    check_dispatch_format(dispatch_format, hidden, fused_dispatch or overlap_dispatch)
    check_tile_multiples(hidden, w_gate.shape[1], None if shared is None else tuple(shared))
    ws.raise_pending()
    if one_launch:
        from .ep_one_launch import ep_one_launch_forward

        return ep_one_launch_forward(
            ws, x, topk_idx, topk_w, w_gate, w_up, w_down, shared, timeout_s=timeout_s, save_h=save_h, dispatch_format=dispatch_format
        )
    dev, world = x.device, ws.layout.world
    k = _kernels(ws, dev)
    stream = ops._stream(dev)

    if dispatch_format == "mxfp8":
        k = _mxfp8_kernels(ws, dev)
        publish_mxfp8(ws, k, x, topk_idx, stream)
    else:
        publish(ws, k, ("x", x), ("idx", topk_idx), stream)
    routing = gather_ranks(ws, k, "idx", timeout_s, stream)  # every rank's routing -> this rank's schedule -> dispatch
    counters = None  # overlap_dispatch: [error, next, ready per row tile], zeroed by the schedule launch
    if overlap_dispatch:
        rows = ws.expert_rows(num_local)
        counters = torch.empty(2 + -(-rows // 128), dtype=torch.int32, device=dev)
    sched = ops.device_schedule(routing, num_local * world, rank=ws.rank, world_size=world, capacity=ws.capacity, clear=counters)

    h = torch.empty(sched.capacity, 2 * w_gate.shape[1], dtype=x.dtype, device=dev) if save_h else None
    shared_h = torch.empty(num_tokens, 2 * shared[0].shape[0], dtype=x.dtype, device=dev) if save_h and shared is not None else None
    if fused_dispatch:  # the gate/up GEMM's producer pulls each row from its owner's published x
        x_rows = None
        x_all = ws.region("x", 0)[: ws.layout.max_tokens * hidden].view(ws.layout.max_tokens, hidden)
        a = ops.grouped_gemm(
            x_all, w_gate, sched.tile_expert, b2=w_up, h_out=h, gather=sched.row_token, gather_ranks=(world, ws.stride_elems("x"))
        )
    elif overlap_dispatch:  # the gate/up GEMM's idle warps fill x_rows tile by tile as its tiles run
        x_rows = torch.empty(sched.capacity, hidden, dtype=x.dtype, device=dev)
        x_all = ws.region("x", 0)[: ws.layout.max_tokens * hidden].view(ws.layout.max_tokens, hidden)
        pull = (x_all, (world, ws.stride_elems("x")), sched.row_token, counters)
        a = ops.grouped_gemm(x_rows, w_gate, sched.tile_expert, b2=w_up, h_out=h, pull=pull, timeout_s=timeout_s)
        ws.count_own_timeouts(counters[:1])  # a row tile's wait that expired: where check() looks
    else:
        x_rows = pull_rows_mxfp8(ws, k, sched, stream) if dispatch_format == "mxfp8" else pull_rows(ws, k, "x", sched, stream)
        a = ops.grouped_gemm(x_rows, w_gate, sched.tile_expert, b2=w_up, h_out=h)  # experts, then every y row to its token's rank
    scatter_into_slots(ws, a, w_down, sched)  # each y row straight into its token's slot on the token's rank
    announce_pushed(ws, k, sched, routing, stream, gradient=False)

    shared_out = None if shared is None else shared_expert_forward(x, shared, shared_h)  # (overlaps the peers' pushes)
    wait_pushed(ws, k, timeout_s, stream)
    slots = ws.region("slots")[: num_tokens * topk * hidden].view(num_tokens, topk, hidden)
    out = ops.combine(slots, topk_w, shared_out)
    ws.copy_record()
    return EPForwardResult(out, sched, x_rows, h, shared_h, routing)
