"""The routed experts' whole forward in ONE launch (Hopper; SM100 compile-verified): schedule, both expert GEMMs, combine.

    schedule (every CTA its share)  -> grid barrier -> fc1 + SwiGLU and fc2 tiles in one global order
    (each fc2 row tile waiting for its fc1 row tile) -> grid barrier -> combine

The same operations in the same order as the multi-launch forward (device_schedule, the gathering
gate/up GEMM, the down GEMM, combine): the same bits (mok/kernels/common/expert_mlp.py). Its CTAs
meet at grid barriers whose words outlive the launch (:func:`grid_sync_words`); a barrier that
cannot complete counts a timeout instead of hanging (:func:`raise_grid_timeouts`). The
expert-parallel forward in one launch (mok/pipeline/exchange.py) is the same kernel with the
exchanges as phases of their own.
"""

from __future__ import annotations

import threading

import torch

from ..kernels.common.records import EXPERT_MLP_ARGS
from ..kernels.constants import GRID_SYNC_WORDS
from ..kernels.variants import expert_mlp_variant
from ..runtime import launch
from ..schedule import Schedule, shared_prefix_rows, worst_case_capacity
from ..validation import check_tensor, check_timeout, gate_up_strides
from .common import BF16, I32, bf16_out, check_32bit_rows, check_launchable, check_weights_launchable, kernel_for, sm_count

TILE = 128  # the one-launch forward's row tile and fc1's column tile


def expert_mlp_counters(num_rows: int) -> tuple[int]:
    """The shape of the int32 counters a one-launch forward over ``num_rows`` expert rows uses (an
    error word, the next tile to take, one ready counter per row tile); the launch zeroes them
    itself, in its schedule phase."""
    return (2 + -(-num_rows // TILE),)


def launch_expert_mlp(variant, device: torch.device, timeout_s: float, **arguments) -> None:
    """Launch a checked one-launch variant with the record's named arguments (a pointer not given is
    null; max_ctas defaults to the SM count)."""
    arguments.setdefault("max_ctas", sm_count(device))
    values = EXPERT_MLP_ARGS.values(timeout_ns=int(timeout_s * 1e9), **arguments)
    kernel_for(variant, device)(*values, launch.stream(device))


def schedule_arguments(schedule: Schedule) -> dict:
    """The record's schedule arguments (what the launch's schedule phase writes)."""
    return dict(
        tile_expert=schedule.tile_expert, row_token=schedule.row_token, row_slot=schedule.row_slot, slot_row=schedule.slot_row,
        offsets=schedule.expert_offsets, counts=schedule.expert_counts, overflow=schedule.overflow,
    )


def bias_arguments(biases: tuple | None) -> dict:
    """The record's bias arguments of the experts' (b_gate, b_up, b_down), or none."""
    return {} if biases is None else dict(zip(("bias_gate", "bias_up", "bias_down"), biases))


def scheduled_expert_mlp(
    x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
    *,
    grid_sync: torch.Tensor | None = None,
    h_out: torch.Tensor | None = None,
    shared_out: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    timeout_s: float = 10.0,
    shared_in_routed: bool = False,
    activation: str = "swiglu",
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, Schedule]:
    """The routed experts' whole forward in ONE launch (module docstring). Returns (out [T, H] bf16,
    the schedule), the bits of ``device_schedule``, ``grouped_gemm(x, w_gate, ..., b2=w_up,
    gather=row_token)``, ``grouped_gemm(a, w_down, ...)`` and ``combine`` in four launches.

    x [T, H] bf16; topk_idx [T, k] int32 (ids in [0, E), not checked here:
    :func:`mok.validation.check_moe_inputs`); topk_w [T, k] fp32; w_gate, w_up [E, I, H]; w_down
    [E, H, I] (H, I multiples of 8; w_gate and w_up may be the halves or the even and odd rows of one
    [E, 2I, H] tensor, read in place: mok.validation.weight_strides). ``h_out`` [R, 2I]: keep h for the backward (R the worst
    case's rows); ``shared_out`` [T, H]: a shared expert's output, added by the combine.
    ``grid_sync``: the barriers' GRID_SYNC_WORDS int32 words, zero when first used and kept across
    calls (the barrier leaves them ready for the next); two launches that may run at the same time
    must not share them. Default: the current stream's set (:func:`grid_sync_words`). A barrier, or
    an fc2 tile's wait for its rows, that waits longer than ``timeout_s`` counts it in grid_sync[2]
    and goes on (wrong output, no hang; :func:`raise_grid_timeouts` reports it), leaving the words
    ready for the next call. ``shared_in_routed``: the weights hold E + 1 experts, the last a
    shared expert that runs as one more expert, its T rows in front of the routed ones (the
    schedule's shared prefix); its output rows are the combine's shared input (so no
    ``shared_out``), h_out then has the prefix's rows too (its h is h_out[:T]). ``activation``: fc1's
    gated activation (mok.kernels.constants.ACTIVATIONS; SwiGLU by default). ``biases``: the
    experts' (b_gate [E, I], b_up [E, I], b_down [E, H] bf16, contiguous), added to their GEMMs'
    products before anything else, as the grouped GEMMs add them (not with ``shared_in_routed``).
    """
    check_tensor("x", x, dtypes=BF16, ndim=2, contiguous=True)
    num_tokens, hidden = x.shape
    check_tensor("topk_idx", topk_idx, dtypes=I32, ndim=2, device=x.device, contiguous=True)
    check_tensor("w_gate", w_gate, dtypes=BF16, ndim=3, device=x.device)
    topk = topk_idx.shape[1]
    num_experts, inter = w_gate.shape[:2]
    check_tensor("w_gate", w_gate, shape=(num_experts, inter, hidden))
    check_tensor("w_up", w_up, dtypes=BF16, shape=(num_experts, inter, hidden), device=x.device)
    gate_up_stride, gate_up_row_stride = gate_up_strides(w_gate, w_up)
    check_tensor("w_down", w_down, dtypes=BF16, shape=(num_experts, hidden, inter), device=x.device, contiguous=True)
    if hidden % 8 or inter % 8:
        raise ValueError(f"w_gate: expected H and I multiples of 8 (16-byte rows), got H={hidden}, I={inter}")
    if shared_in_routed:
        if shared_out is not None or num_experts < 2:
            raise ValueError(
                f"shared_in_routed: expected E + 1 >= 2 experts' weights and no shared_out, got {num_experts} experts, "
                f"shared_out {'given' if shared_out is not None else 'None'}"
            )
        num_experts -= 1  # (routed)
    if biases is not None:
        if shared_in_routed or len(biases) != 3:
            raise ValueError("biases: expected (b_gate, b_up, b_down) of the routed experts, without shared_in_routed")
        for name, bias, width in (("b_gate", biases[0], inter), ("b_up", biases[1], inter), ("b_down", biases[2], hidden)):
            check_tensor(name, bias, dtypes=BF16, shape=(num_experts, width), device=x.device, contiguous=True)
    if topk_idx.shape[0] != num_tokens:
        raise ValueError(f"topk_idx: expected one row per token of x ({num_tokens}), got {topk_idx.shape[0]}")
    check_tensor("topk_w", topk_w, dtypes=(torch.float32,), shape=(num_tokens, topk), device=x.device, contiguous=True)
    prefix = shared_prefix_rows(num_tokens, TILE) if shared_in_routed else 0
    capacity = prefix + worst_case_capacity(num_tokens, topk, num_experts, TILE)
    if shared_out is not None:
        check_tensor("shared_out", shared_out, dtypes=BF16, shape=(num_tokens, hidden), device=x.device, contiguous=True)
    if h_out is not None:
        check_tensor("h_out", h_out, dtypes=BF16, shape=(capacity, 2 * inter), device=x.device, contiguous=True)
    check_timeout(timeout_s)
    if grid_sync is not None:
        check_tensor("grid_sync", grid_sync, dtypes=I32, shape=(GRID_SYNC_WORDS,), device=x.device, contiguous=True)
    out = bf16_out(out, (num_tokens, hidden), x.device)
    y_rows = torch.empty(capacity, hidden, dtype=torch.bfloat16, device=x.device)
    if shared_in_routed:
        shared_out = y_rows[:num_tokens]
    bias_args = bias_arguments(biases)
    check_launchable(x=x, topk_idx=topk_idx, y_rows=y_rows, h_out=h_out, shared_out=shared_out, out=out, **bias_args)
    check_weights_launchable(w_gate=w_gate, w_up=w_up, w_down=w_down)
    check_32bit_rows("a (fc1's output)", capacity, inter)
    schedule = Schedule.empty(num_tokens, topk, num_experts, capacity, TILE, x.device, shared_rows=prefix)
    if num_tokens == 0:  # nothing routed: no launch
        return out, schedule.mark_unrouted()
    counters = torch.empty(expert_mlp_counters(capacity), dtype=torch.int32, device=x.device)
    a = torch.empty(capacity, inter, dtype=torch.bfloat16, device=x.device)
    variant = expert_mlp_variant(
        hidden, inter, topk, num_experts, save_h=h_out is not None, has_shared=shared_out is not None, shared_prefix=shared_in_routed,
        gate_up_stride=gate_up_stride, gate_up_row_stride=gate_up_row_stride, activation=activation, bias=biases is not None,
    )
    launch_expert_mlp(
        variant, x.device, timeout_s, **bias_args, x=x, w_gate=w_gate, w_up=w_up, w_down=w_down, a=a, h=h_out, y=y_rows, topk_w=topk_w,
        shared=shared_out, out=out, counters=counters, topk_idx=topk_idx, sync=grid_sync_words(x.device) if grid_sync is None else grid_sync,
        num_rows=capacity, num_experts=num_experts, num_tokens=num_tokens, **schedule_arguments(schedule),
    )
    return out, schedule


GRID_SYNC_STREAMS = 64  # word sets per pool: a device's streams (and captured launches) take sets of their own
_GRID_SYNC_POOLS: dict[int, list[torch.Tensor]] = {}  # per device, pools of GRID_SYNC_STREAMS sets
_GRID_SYNC_TAKEN: dict[int, int] = {}  # per device, sets handed out so far
_GRID_SYNC_SET: dict[tuple[int, int], torch.Tensor] = {}  # (device, stream) -> its set (eager launches)
_GRID_SYNC_CAPTURED: list[torch.Tensor] = []  # sets made inside captures (kept: the graphs point at them)
_GRID_SYNC_LOCK = threading.Lock()


def grid_sync_words(device: torch.device) -> torch.Tensor:
    """The default grid-barrier words of :func:`scheduled_expert_mlp`: a set no launch that may run
    at the same time shares. Eager launches get their stream's set (a set of its own per stream of
    ``device``); a launch captured into a CUDA graph gets a set of its own, whatever the capture
    stream (graphs captured on one stream may be replayed at once on several). The sets come from
    pools of GRID_SYNC_STREAMS, zeroed when made, which happens outside capture only (the
    device's first use, a warm-up call as capture needs anyway, or when a stream finds every set
    taken) and waits for its zero fill once (a host sync), so a set used on another stream never
    reads the fill before it lands. A capture that finds every pooled set taken (many captured
    one-launch forwards) makes a set of its own inside the capture: its zero fill is captured too,
    so every replay starts it from zeros, before the launch that uses it."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    capturing = torch.cuda.is_current_stream_capturing()
    key = (index, torch.cuda.current_stream(index).cuda_stream)
    if not capturing:
        words = _GRID_SYNC_SET.get(key)
        if words is not None:
            return words
    with _GRID_SYNC_LOCK:
        pools = _GRID_SYNC_POOLS.setdefault(index, [])
        taken = _GRID_SYNC_TAKEN.get(index, 0)
        if taken == len(pools) * GRID_SYNC_STREAMS:
            if capturing:  # (no host sync allowed here: a set of this graph's own, zeroed by the graph itself)
                words = torch.zeros(GRID_SYNC_WORDS, dtype=torch.int32, device=torch.device("cuda", index))
                _GRID_SYNC_CAPTURED.append(words)
                return words
            shape = (GRID_SYNC_STREAMS, GRID_SYNC_WORDS)
            pools.append(torch.zeros(shape, dtype=torch.int32, device=torch.device("cuda", index)))
            torch.cuda.synchronize(index)  # (once per pool) the zeros land before any stream reads a set
        words = pools[taken // GRID_SYNC_STREAMS][taken % GRID_SYNC_STREAMS]
        _GRID_SYNC_TAKEN[index] = taken + 1
        if not capturing:
            _GRID_SYNC_SET[key] = words
    return words


def raise_grid_timeouts(grid_sync: torch.Tensor) -> None:
    """Raise if the one-launch forwards or one-launch MLPs using these words (:func:`grid_sync_words`,
    or a caller's) have timed out since their timeout count was last cleared (at a grid barrier, or
    an fc2 tile waiting for its rows): the outputs of those launches are wrong.
    Reads one int back from the GPU (a host sync): call it off the hot path, e.g. every N steps."""
    check_tensor("grid_sync", grid_sync, dtypes=(torch.int32,), shape=(GRID_SYNC_WORDS,))
    timeouts = int(grid_sync[2])
    if timeouts:
        raise RuntimeError(
            f"MoK one-launch forward: {timeouts} grid-barrier timeouts or fc2 waits that timed out (CTAs of a launch "
            "were not all resident at once, e.g. other work held SMs); those outputs are wrong. Clear with grid_sync[2] = 0."
        )
