"""The expert-parallel stages: what moves between ranks over the workspace, each a bounded exchange.

    publish        a rank's tokens (bf16, or quantized to MXFP8 on the way in) and routing into its
                   region, then the publish signal of a new epoch to every rank
    gather_ranks   once every rank published (a bounded wait, same launch): all ranks' routing
    pull_rows      each row of this rank's experts from its token's owner (MXFP8 rows dequantized on arrival)
    push_rows      the down projection (or the backward's dx GEMM) writing each row straight into its
                   token's slot [t, j] on the token's rank
    announce/wait  the done signal (after NaN into the slots a capacity bound dropped) and its bounded wait
    one launch     all of the forward's exchanges as phases of the one-launch kernel

Every wait is bounded: a timeout lands in the workspace's error record (workspace.py), which the
next call, or :meth:`EPWorkspace.check`, raises.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import ops
from ..kernels.common.flag_layout import PHASE_DONE, PHASE_PUBLISH, grid_sync_slot
from ..kernels.constants import GRID_SYNC_WORDS
from ..kernels.variants import ep_variant, expert_mlp_variant
from ..ops.common import bf16_out, check_cuda_aligned, kernel_for, sm_count
from ..ops.one_launch import TILE, bias_arguments, expert_mlp_counters, launch_expert_mlp, schedule_arguments
from ..runtime import launch
from ..schedule import Schedule
from ..validation import check_tensor, gate_up_strides
from .stages import fp8_rows, packed_fp8_rows, packed_fp8_width
from .workspace import EPWorkspace


def quantized_kernel(kind: str, power_of_two: bool = False, scale_order: str = "rows") -> tuple[str, dict]:
    """(the name a workspace's kernels hold it under, its ep_variant options) of a quantized
    dispatch's kernel ``kind`` (publish_mxfp8, dispatch_mxfp8, publish_fp8_block by the scale rule
    ``power_of_two``, dispatch_fp8_block writing its scales in ``scale_order``: Plan.fp8_scale_order)."""
    if kind == "publish_fp8_block" and power_of_two:
        return f"{kind}_pow2", dict(power_of_two=True)
    if kind == "dispatch_fp8_block" and scale_order != "rows":
        return f"{kind}_{scale_order}", dict(scale_order=scale_order)
    return kind, {}


def exchange_kernels(ws: EPWorkspace, device: torch.device, dispatch_format: str = "bf16", power_of_two: bool = False,
                     scale_order: str = "rows") -> dict:
    """The exchange kernels this workspace's layout uses, loaded (compiled, or read from the cache)
    once, before anything waits on a peer; the overflow markers only with a capacity bound, a
    quantized dispatch's two (MXFP8's, or fp8_block's by its scale rule, ``power_of_two``, and
    scale order, ``scale_order``: :func:`quantized_kernel`) at the first call that uses them."""
    kernels = ws.kernels
    quantized = (f"publish_{dispatch_format}", f"dispatch_{dispatch_format}") if dispatch_format != "bf16" else ()
    names = {kind: quantized_kernel(kind, power_of_two, scale_order) for kind in quantized}
    if kernels and all(name in kernels for name, _ in names.values()):  # (the per-call path: nothing to build)
        return kernels
    lay = ws.layout
    rows = dict(width=lay.hidden, topk=lay.topk)
    wanted = {
        "publish": ep_variant("publish", lay.world, **rows),
        "routing": ep_variant("routing", lay.world, topk=lay.topk),
        "dispatch": ep_variant("dispatch", lay.world, **rows),
        "signal_done": ep_variant("signal", lay.world, phase=PHASE_DONE),
        "wait_done": ep_variant("wait", lay.world, phase=PHASE_DONE),
    }
    if ws.capacity is not None:
        wanted |= {f"overflow_{phase}": ep_variant("overflow", lay.world, phase=phase, **rows) for phase in (PHASE_PUBLISH, PHASE_DONE)}
    wanted |= {name: ep_variant(kind, lay.world, **rows, **options) for kind, (name, options) in names.items()}
    for name, variant in wanted.items():
        if name not in kernels:
            kernels[name] = kernel_for(variant, device)
    return kernels


def flag_args(ws: EPWorkspace) -> tuple:
    """The arguments every flag kernel takes: rank 0's flags, this rank, the flags' rank stride."""
    return launch.ptr("i32", ws.region("flags", 0), 4), launch.i32(ws.rank), launch.i32(ws.stride_elems("flags"))


ROW_SCALES = {"mxfp8": (torch.uint8, 32), "fp8_block": (torch.float32, 128)}  # a quantized dispatch's scales: dtype, elements each


def quantized_region(ws: EPWorkspace, rank: int, num_tokens: int, rows_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s region "x" holding quantized rows: (elements float8_e4m3fn [T, H] from its
    first byte, scales [T, ceil(H / block)] from byte T_max·H: ``rows_format`` "mxfp8"'s E8M0 bytes a
    32-block, "fp8_block"'s fp32 a 128-block); both fit in the T_max·H bf16 it holds."""
    lay = ws.layout
    dtype, block = ROW_SCALES[rows_format]
    region = ws.region("x", rank).view(torch.uint8)
    start, blocks = lay.max_tokens * lay.hidden, -(-lay.hidden // block)
    elements = region[: num_tokens * lay.hidden].view(torch.float8_e4m3fn).view(num_tokens, lay.hidden)
    scales = region[start:start + num_tokens * blocks * dtype.itemsize].view(dtype).view(num_tokens, blocks)
    return elements, scales


def publish(ws: EPWorkspace, kernels: dict, rows: tuple, values: tuple, stream, rows_format: str = "bf16",
            power_of_two: bool = False) -> None:
    """One launch: ``rows`` = (region name, [T, H] bf16) and ``values`` = (region name, [T, k]
    32-bit) into this rank's regions, then the publish signal of a new epoch to every rank (the
    wait for the peers' is in :func:`gather_ranks`). ``rows_format`` "mxfp8": the rows quantized on
    their way in (mok.ops.quantize_mxfp8's bytes); "fp8_block": quantized with 1 x 128 block scales
    (mok.ops.quantize_fp8_rows's elements and scales by the rule ``power_of_two`` says); either in
    :func:`quantized_region`'s layout of region "x"."""
    (rows_name, rows_src), (values_name, values_src) = rows, values
    flags = launch.ptr("i32", ws.region("flags", 0), 4)
    ctas, rank, tokens = launch.i32(4 * sm_count(rows_src.device)), launch.i32(ws.rank), launch.i32(rows_src.shape[0])
    values_region = launch.ptr("i32", ws.region(values_name, 0), 4)
    if rows_format != "bf16":
        elements, scales = quantized_region(ws, ws.rank, rows_src.shape[0], rows_format)
        name, _ = quantized_kernel(f"publish_{rows_format}", power_of_two)
        scale_ptr = launch.ptr("f32", scales, 16) if rows_format == "fp8_block" else launch.ptr("u8", scales, 1)
        kernels[name](
            flags, launch.ptr("e4m3", elements), scale_ptr, values_region, launch.ptr("bf16", rows_src), launch.ptr("i32", values_src, 4),
            rank, tokens, ctas, launch.i32(ws.stride_elems("flags")), launch.i32(ws.stride_elems(values_name)), stream,
        )
        return
    kernels["publish"](
        flags, launch.ptr("bf16", ws.region(rows_name, 0)), values_region, launch.ptr("bf16", rows_src), launch.ptr("i32", values_src, 4),
        rank, tokens, ctas, launch.i32(ws.stride_elems("flags")), launch.i32(ws.stride_elems(rows_name)),
        launch.i32(ws.stride_elems(values_name)), stream,
    )


def gather_ranks(ws: EPWorkspace, kernels: dict, name: str, timeout_s: float, stream) -> torch.Tensor:
    """Once every rank published this epoch (a bounded wait in the same launch): every rank's
    [T_max, k] 32-bit region ``name`` -> [W·T_max, k] (row p·T_max + t; bits -1 past T_p)."""
    lay = ws.layout
    source = ws.region(name, 0).view(torch.int32)
    out = torch.empty(lay.world * lay.max_tokens, lay.topk, dtype=torch.int32, device=ws.buffer.device)
    kernels["routing"](
        launch.ptr("i32", ws.region("flags", 0), 4), launch.ptr("i32", source, 4), launch.ptr("i32", out, 4), launch.i32(ws.rank),
        launch.i32(lay.max_tokens), launch.i32(ws.stride_elems("flags")), launch.i32(ws.stride_elems(name)),
        launch.i64(int(timeout_s * 1e9)), stream,
    )
    return out


def pull_rows(ws: EPWorkspace, kernels: dict, name: str, sched: Schedule, stream, rows_format: str = "bf16", *,
              out: torch.Tensor | None = None, scale_order: str = "rows") -> torch.Tensor:
    """rows[r] = row g = row_token[r] of the owner's [T_max, H] region ``name`` (zeros for the
    padding rows; the unused rows past the schedule's end are left as they are), bf16 [capacity, H],
    into ``out`` when given.
    Token-major (sched.slot_row): each token's row is read from its owner once, however many of
    this rank's experts it goes to. ``rows_format`` "mxfp8": the rows were published in MXFP8, and
    each is dequantized to bf16 on arrival (mok.ops.dequantize_mxfp8's bits), H·33/32 bytes a
    token over the link instead of 2H; "fp8_block": published with 1 x 128 block scales, and kept
    so, in one uint8 buffer (mok.pipeline.stages.packed_fp8_rows: elements [capacity, H] and scales
    [ceil(H / 128), capacity] as the FP8 GEMM takes its A; zeros with scale 0 in the padding rows),
    H + 4·ceil(H / 128) bytes a token; with ``scale_order`` "mma" (SM100: power-of-two scales, H a
    multiple of 128) the scales as E8M0 bytes in the MMA order, the MXFP8 rows its GEMMs take
    (stages.fp8_rows); ``out`` then such a packed buffer."""
    lay = ws.layout
    schedule = (launch.ptr("i32", sched.slot_row, 4), launch.ptr("i32", sched.expert_counts, 4), launch.ptr("i32", sched.expert_offsets, 4))
    tail = (launch.i32(sched.capacity), launch.i32(sched.expert_counts.shape[0]), stream)
    if rows_format != "bf16":
        elements, scales = quantized_region(ws, 0, lay.max_tokens, rows_format)  # rank 0's; the kernel steps by the rank stride
        if rows_format == "fp8_block":
            rows = packed_fp8_rows(sched.capacity, lay.hidden, ws.buffer.device) if out is None else out
            check_tensor("out", rows, dtypes=(torch.uint8,), shape=(sched.capacity, packed_fp8_width(lay.hidden)), device=ws.buffer.device,
                         contiguous=True)
            rows_out, scales_out = fp8_rows(rows, lay.hidden, scale_order)
            outs = (launch.ptr("u8", rows_out.view(torch.uint8), 16), launch.ptr("f32", scales_out, 16))
            sources = (launch.ptr("u8", elements.view(torch.uint8), 16), launch.ptr("f32", scales, 16))
        else:
            rows = bf16_out(out, (sched.capacity, lay.hidden), ws.buffer.device)
            outs = (launch.ptr("bf16", rows), launch.ptr("f32", None))
            sources = (launch.ptr("e4m3", elements), launch.ptr("u8", scales, 1))
        dispatch, _ = quantized_kernel(f"dispatch_{rows_format}", scale_order=scale_order)
        kernels[dispatch](*sources, *schedule, *outs, launch.i32(lay.max_tokens), launch.i64(ws.rank_stride), *tail)
        return rows
    rows = bf16_out(out, (sched.capacity, lay.hidden), ws.buffer.device)
    kernels["dispatch"](
        launch.ptr("bf16", ws.region(name, 0)), *schedule, launch.ptr("bf16", rows), launch.i32(lay.max_tokens),
        launch.i32(ws.stride_elems(name)), *tail,
    )
    return rows


def push_rows(ws: EPWorkspace, a, b, sched: Schedule, **gemm_options) -> None:
    """The grouped GEMM of this rank's rows ``a`` with ``b`` (bf16, or FP8 with block scales:
    :func:`mok.ops.grouped_gemm_scatter` and its options), each row written into its token's rank,
    slot [t, j] of region "slots"."""
    lay = ws.layout
    slots_of_rank0 = ws.region("slots", 0)[: lay.max_tokens * lay.topk * lay.hidden].view(lay.max_tokens, lay.topk, lay.hidden)
    ops.grouped_gemm_scatter(
        a, b, sched.tile_expert, sched.row_token, sched.row_slot, slots_of_rank0, slot_ranks=(lay.world, ws.stride_elems("slots")),
        **gemm_options,
    )


def own_slots(ws: EPWorkspace, num_tokens: int) -> torch.Tensor:
    """This rank's combine slots [T_r, k, H], where every rank pushed its tokens' rows."""
    lay = ws.layout
    return ws.region("slots")[: num_tokens * lay.topk * lay.hidden].view(num_tokens, lay.topk, lay.hidden)


def mark_overflow(ws: EPWorkspace, kernels: dict, routing: torch.Tensor, sched: Schedule, stream, *, gradient: bool) -> None:
    """With a capacity bound: NaN into the pushed slots (and, for ``gradient``, the router-gradient
    pieces) of the pairs that got no row, and the overflow into every rank's error record."""
    if ws.capacity is None:
        return
    lay = ws.layout
    kernels[f"overflow_{PHASE_DONE if gradient else PHASE_PUBLISH}"](
        *(launch.ptr("i32", t, 4) for t in (ws.region("flags", 0), routing, sched.slot_row, sched.overflow, sched.expert_offsets)),
        launch.ptr("bf16", ws.region("slots", 0)), launch.ptr("f32", ws.region("dw"), 4), launch.i32(ws.rank),
        launch.i32(sched.expert_counts.shape[0]), launch.i32(sched.capacity), launch.i32(lay.max_tokens),
        launch.i32(ws.stride_elems("flags")), launch.i32(ws.stride_elems("slots")), stream,
    )


def announce_pushed(ws: EPWorkspace, kernels: dict, sched: Schedule, routing: torch.Tensor, stream, *, gradient: bool) -> None:
    """After this rank's rows are in their owners' slots (stream order): NaN into the slots of the
    pairs a capacity bound dropped (:func:`mark_overflow`), then signal every rank (phase done)."""
    mark_overflow(ws, kernels, routing, sched, stream, gradient=gradient)  # before the signal: peers read the slots after it
    kernels["signal_done"](*flag_args(ws), stream)


def wait_pushed(ws: EPWorkspace, kernels: dict, timeout_s: float, stream) -> None:
    """Wait (bounded) until every rank pushed this epoch's rows."""
    kernels["wait_done"](*flag_args(ws), launch.i64(int(timeout_s * 1e9)), stream)


def owned_router_grads(ws: EPWorkspace, topk_idx: torch.Tensor, num_local: int, num_tokens: int) -> torch.Tensor:
    """d_topk_w[t, j] of this rank's tokens, each read from the "dw" region of the rank owning expert topk_idx[t, j]."""
    lay, rank = ws.layout, ws.rank
    first = rank * lay.max_tokens
    per_rank = torch.stack([
        ws.region("dw", p)[first * lay.topk:(first + num_tokens) * lay.topk].view(num_tokens, lay.topk) for p in range(lay.world)
    ])
    owner = (topk_idx // num_local).long()
    return per_rank.gather(0, owner[None]).squeeze(0)


def router_pieces(ws: EPWorkspace) -> torch.Tensor:
    """This rank's "dw" region as [W·T_max, k]: the router-weight gradient of every rank's (token,
    slot) pairs that this rank's experts computed (peers read it after the done signal)."""
    lay = ws.layout
    return ws.region("dw")[: lay.world * lay.max_tokens * lay.topk].view(lay.world * lay.max_tokens, lay.topk)


# ----- the forward's exchanges in the one-launch kernel


@dataclass(frozen=True)
class OneLaunchStatics:
    """What every one-launch call of one workspace with the same weight shapes launches with (built once)."""

    variant: object
    capacity: int
    counters: tuple
    regions: dict  # rank 0's flags, x_pub, idx_pub and slots regions, and their rank strides in elements
    grid_sync: torch.Tensor  # this rank's grid-barrier words, zeroed with the workspace
    max_ctas: int


def one_launch_statics(
    ws: EPWorkspace, dev: torch.device, num_local: int, inter: int, save_h: bool, has_shared: bool, dispatch_format: str,
    gate_up_strides: tuple = (None, None), activation: str = "swiglu", bias: bool = False,
) -> OneLaunchStatics:
    """The launch's statics for these options (``gate_up_strides``: w_gate's and w_up's expert and
    row strides, mok.validation.gate_up_strides), built on the workspace's first such call."""
    key = (num_local, inter, save_h, has_shared, dispatch_format, gate_up_strides, activation, bias)
    found = ws.one_launch_statics.get(key)
    if found is None:
        lay = ws.layout
        capacity = ws.expert_rows(num_local, TILE)
        variant = expert_mlp_variant(
            lay.hidden, inter, lay.topk, num_local, save_h=save_h, has_shared=has_shared, ep_world=lay.world,
            dispatch_format=dispatch_format, gate_up_stride=gate_up_strides[0], gate_up_row_stride=gate_up_strides[1],
            activation=activation, bias=bias,
        )
        names = {"flags": "flags", "x_pub": "x", "idx_pub": "idx", "slots": "slots"}
        regions = {arg: ws.region(name, 0) for arg, name in names.items()}
        regions |= {f"{arg.split('_')[0]}_stride": ws.stride_elems(name) for arg, name in names.items()}
        first = grid_sync_slot(lay.world)
        found = ws.one_launch_statics[key] = OneLaunchStatics(
            variant, capacity, expert_mlp_counters(capacity), regions,
            ws.region("flags")[first:first + GRID_SYNC_WORDS],
            max(sm_count(dev) // ws.ranks_on_device, 1),  # ranks on one GPU (emulated, or processes sharing it) all resident at once
        )
    return found


def one_launch_forward(ws: EPWorkspace, x, topk_idx, topk_w, weights, shared_out, h, *, timeout_s: float, dispatch_format: str,
                       max_ctas: int | None = None, activation: str = "swiglu", biases: tuple | None = None):
    """The expert-parallel forward of this rank in ONE launch (mok/kernels/common/expert_mlp.py with
    ``ep_world``): every CTA publishes its share of x and the routing, the ranks meet on the epoch
    flags, every CTA gathers every rank's routing and copies the tokens routed here into x_all,
    builds its part of the schedule, runs the expert MLP's tiles (fc2 pushing each y row into its
    token's slot on its token's rank) and, after the done handshake, combines this rank's tokens.
    Returns (out, schedule, routing, x_all). ``h``: h's buffer (saving it) or None. ``max_ctas``:
    the CTA cap (default: every SM, or an equal share when several ranks run on this GPU);
    ``activation``: the experts' gated activation; ``biases``: this rank's experts' (b_gate, b_up,
    b_down), as mok.ops.scheduled_expert_mlp takes them."""
    check_cuda_aligned("x", x)  # (the launch copies it in 16-byte vectors)
    lay, dev = ws.layout, x.device
    w_gate, w_up, w_down = weights
    num_local, inter = w_gate.shape[0], w_gate.shape[1]
    static = one_launch_statics(
        ws, dev, num_local, inter, h is not None, shared_out is not None, dispatch_format, gate_up_strides(w_gate, w_up), activation,
        biases is not None,
    )
    tokens_all = lay.world * lay.max_tokens
    sched = Schedule.empty(tokens_all, lay.topk, num_local, static.capacity, TILE, dev, world_size=lay.world)
    routing = torch.empty(tokens_all, lay.topk, dtype=torch.int32, device=dev)
    x_all = torch.empty(tokens_all, lay.hidden, dtype=x.dtype, device=dev)  # the tokens routed here, by global id
    a = torch.empty(static.capacity, inter, dtype=x.dtype, device=dev)
    out = torch.empty(x.shape[0], lay.hidden, dtype=x.dtype, device=dev)
    counters = torch.empty(static.counters, dtype=torch.int32, device=dev)  # zeroed by the launch's schedule
    launch_expert_mlp(
        static.variant, dev, timeout_s, **bias_arguments(biases), x=x_all, w_gate=w_gate, w_up=w_up, w_down=w_down, a=a, h=h, topk_w=topk_w, shared=shared_out,
        out=out, counters=counters, topk_idx=routing, sync=static.grid_sync, x_in=x, idx_in=topk_idx, rank=ws.rank, t_max=lay.max_tokens,
        my_tokens=x.shape[0], num_rows=static.capacity, num_experts=num_local, num_tokens=tokens_all,
        max_ctas=max_ctas or static.max_ctas, **static.regions, **schedule_arguments(sched),
    )
    return out, sched, routing, x_all
