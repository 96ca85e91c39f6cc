"""The stages the forward and backward pipelines compose, each written once.

    forward                                   backward
    gate_up   rows · [W_gate | W_up] + SwiGLU  down_backward    dout_rows · W_down, SwiGLU backward,
              (+ h kept for the backward)                       router-gradient pieces
    down      a · W_down                       gate_up_backward dh · [W_gate; W_up]
    shared expert, forward                     expert_weight_grads, shared expert backward

Precision is a parameter of each GEMM stage (``plan.precision``): bf16 operands, MXFP8 (rows
quantized on the way in, the weights quantized once per call: :func:`quantize_expert_weights`;
block-scaled MMAs on SM100, or with ``plan.emulate`` the same operands dequantized, exactly, into
the bf16 GEMMs), or FP8 with block scales (rows quantized on the way in, the weights once per
version, transposed for the backward: fp8_weights.py; Hopper's FP8 WGMMAs with fp32 scales, or
SM100's MXFP8 kernels with the power-of-two scales as E8M0 bytes, ``plan.fp8_scale_order``; the
weight gradients in bf16 or, with wgrad_format "fp8_block", on FP8 too). Where the rows come
from (gathered inside the GEMM, gathered first, pulled from the peers) and where they go (rows,
or the peers' combine slots) is the pipelines' business (forward.py, backward.py, exchange.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import ops
from ..kernels.variants import default_tile_n
from ..mxfp8 import rows_scale_layout
from ..plan import Plan
from ..schedule import Schedule
from ..validation import check_tensor, warn_at_caller
from .fp8_weights import fp8_block_weights

TILE_M = 128  # row tile of the grouped GEMMs: each expert's rows are padded to it


@dataclass
class ForwardResult:
    """The layer output and what the backward needs: the schedule, h (and the shared expert's h)
    when saved; at EP > 1 also the rows this rank pulled (x_rows) and every rank's routing. out
    is None when an op rebuilds the saved state for its backward."""

    out: torch.Tensor | None
    schedule: Schedule
    h: torch.Tensor | None = None
    shared_h: torch.Tensor | None = None
    x_rows: torch.Tensor | None = None
    routing: torch.Tensor | None = None


def single_expert_tiles(num_rows: int, device: torch.device) -> torch.Tensor:
    """tile_expert for a GEMM over all rows with one expert (the shared expert)."""
    return torch.zeros(-(-num_rows // TILE_M), dtype=torch.int32, device=device)


# ----- the shared expert: one expert over every token, unit weight


def shared_expert_gate_up(plan: Plan, x: torch.Tensor, shared: tuple, h_out: torch.Tensor | None = None,
                          tiles: torch.Tensor | None = None) -> torch.Tensor:
    """The shared expert's a [T, I_s] = act(x·W_gateᵀ, x·W_upᵀ), one expert over all of x (and its
    h into ``h_out``); ``tiles``: :func:`single_expert_tiles` of x where the caller has them."""
    tiles = single_expert_tiles(x.shape[0], x.device) if tiles is None else tiles
    return ops.grouped_gemm(x, shared[0][None], tiles, b2=shared[1][None], h_out=h_out, activation=plan.activation)


def shared_expert_forward(plan: Plan, x: torch.Tensor, shared: tuple, h_out: torch.Tensor | None = None) -> torch.Tensor:
    """The shared expert as grouped GEMMs with one expert over all of x (``h_out``: keep h for backward)."""
    tiles = single_expert_tiles(x.shape[0], x.device)
    return ops.grouped_gemm(shared_expert_gate_up(plan, x, shared, h_out, tiles), shared[2][None], tiles)


def shared_expert_backward(plan: Plan, x, dout, shared, shared_h, grad_dtype, main_grads, weight_grads=True):
    """dx, (dW_gate, dW_up, dW_down) of the shared expert (s = 1); the weight gradients None
    unless ``weight_grads``."""
    tiles = single_expert_tiles(x.shape[0], x.device)
    w_gate, w_up, w_down = shared
    dh, a, _ = ops.swiglu_backward_gemm(dout, w_down[None], tiles, shared_h, activation=plan.activation)
    dx = ops.grouped_gemm(dh, w_gate[None], tiles, b2=w_up[None], b_major="n", k_split=True)
    return dx, (shared_weight_grads(dout, a, dh, x, grad_dtype, main_grads) if weight_grads else None)


def shared_weight_grads(dout, a, dh, x, grad_dtype, main_grads):
    """(dW_gate, dW_up, dW_down) of the shared expert from its T rows: dout, a (s = 1), dh, x."""
    offsets = torch.arange(2, dtype=torch.int32, device=x.device) * x.shape[0]  # [0, T]: all rows
    d_down = weight_grad(dout, a, offsets, grad_dtype, None if main_grads is None else main_grads[2][None])
    d_gate, d_up = gate_up_weight_grads(dh, x, offsets, grad_dtype, None if main_grads is None else (main_grads[0][None], main_grads[1][None]))
    return d_gate[0], d_up[0], d_down[0]


def shared_expert_as_last(w_gate, w_up, w_down, shared) -> tuple | None:
    """(w_gate, w_up, w_down) over E + 1 experts, the shared expert the last, when each of its
    weights lies right after the routed experts' in the same storage with their shapes (as
    mok.MoELayer allocates them); else None (then the shared expert runs in launches of its own)."""
    if shared is None:
        return None
    stacked = []
    for routed, one in zip((w_gate, w_up, w_down), tuple(shared)):
        if (
            one.shape != routed.shape[1:] or one.dtype != routed.dtype or not one.is_contiguous() or not routed.is_contiguous()
            or one.device != routed.device
            or one.untyped_storage().data_ptr() != routed.untyped_storage().data_ptr()
            or one.storage_offset() != routed.storage_offset() + routed.numel()
        ):
            return None
        stacked.append(routed.as_strided((routed.shape[0] + 1, *routed.shape[1:]), routed.stride(), routed.storage_offset()))
    return tuple(stacked)


_COPY_WARNED = False


def stacked_weights(w_gate, w_up, w_down, shared) -> tuple:
    """The routed and shared experts' weights as [E + 1, ...] tensors, the shared expert last: views
    where they lie so (:func:`shared_expert_as_last`), else copies (one warning per process)."""
    global _COPY_WARNED
    stacked = shared_expert_as_last(w_gate, w_up, w_down, shared)
    if stacked is None:
        if not _COPY_WARNED:
            _COPY_WARNED = True
            warn_at_caller(
                "MoK: the shared expert's weights do not lie right after the routed experts' (one [E + 1, ...] "
                "buffer per projection, as mok.MoELayer allocates them): copying them together on every call"
            )
        stacked = tuple(torch.cat([routed, one[None]]) for routed, one in zip((w_gate, w_up, w_down), tuple(shared)))
    return stacked


# ----- MXFP8 weights


@dataclass(frozen=True)
class Mxfp8ExpertWeights:
    """The experts' weights in MXFP8, each as (elements float8_e4m3fn, scales uint8 in the MMA's
    order): gate and up [E, I, H] with scales [E, ceil(I/128), ceil(H/128), 512], down [E, H, I]
    with [E, ceil(H/128), ceil(I/128), 512] (mok.mxfp8.mma_scale_layout, each expert chunked on its
    own); ``transposed``: the backward's copies instead (gate and up [E, H, I], down [E, I, H]: the
    shapes alone cannot tell them apart when H == I)."""

    gate: tuple[torch.Tensor, torch.Tensor]
    up: tuple[torch.Tensor, torch.Tensor]
    down: tuple[torch.Tensor, torch.Tensor]
    transposed: bool = False


def quantize_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One projection's weights [E, N, K] (bf16, CUDA, N and K multiples of 16) in MXFP8 along K:
    (elements [E, N, K], scales [E, ceil(N/128), ceil(K/128), 512] in the MMA's order), one launch."""
    check_tensor("w", w, dtypes=(torch.bfloat16,), ndim=3, contiguous=True)
    return ops.quantize_mxfp8(w, scale_order="mma")


def quantize_expert_weights(w_gate, w_up, w_down, *, transposed: bool = False) -> Mxfp8ExpertWeights:
    """The layer's expert weights (w_gate, w_up [E, I, H], w_down [E, H, I], bf16) in MXFP8 along
    their K in the forward (H for gate and up, I for down); ``transposed``: for the backward's
    products, each transposed and quantized along its other axis (gate and up [E, H, I] along I,
    down [E, I, H] along H). (Gate and up may be the halves of one [E, 2I, H] tensor: the quantizer
    reads them packed.)"""
    if transposed:
        w_gate, w_up, w_down = (w.transpose(1, 2) for w in (w_gate, w_up, w_down))
    w_gate, w_up, w_down = (w.contiguous() for w in (w_gate, w_up, w_down))
    return Mxfp8ExpertWeights(quantize_weights(w_gate), quantize_weights(w_up), quantize_weights(w_down), transposed)


def dequantized_rows(a_q: tuple, used: torch.Tensor | None = None, segments: int = 1) -> torch.Tensor:
    """bf16 [R, K] of MXFP8 rows (elements, MMA-ordered scales; ``segments`` 2: each half of a row
    blocked on its own), exact; only the first used[0] rows with a device count ``used``."""
    elements, scales = a_q
    rows, width = elements.shape
    halves = scales.unflatten(-2, (segments, -1)).movedim(-3, 0)  # [segments, chunks, chunks along K, 512]
    by_rows = torch.cat(list(rows_scale_layout(halves, rows, width // segments)), dim=-1)
    return ops.dequantize_mxfp8(elements, by_rows, rows_used=used, segments=segments)


def dequantized_weights(w_q: tuple) -> torch.Tensor:
    """bf16 [E, N, K] of MXFP8 weights (elements, MMA-ordered scales), exact."""
    elements, scales = w_q
    return ops.dequantize_mxfp8(elements, rows_scale_layout(scales, elements.shape[1], elements.shape[2]))


def dequantized_columns(q: tuple, segments: int = 1) -> torch.Tensor:
    """bf16 [R, M] of a matrix quantized along its rows (ops.quantize_mxfp8_columns; ``segments`` 2:
    each half of the columns chunked on its own), exact (rows the quantizer left unconverted come
    out as whatever they hold: no expert's range reads them)."""
    elements, scales = q
    half = elements.shape[1] // segments
    by_rows = torch.cat([rows_scale_layout(part, half) for part in scales.chunk(segments)])
    transposed = ops.dequantize_mxfp8(elements.T.contiguous(), by_rows)
    return transposed.T.contiguous()


def packed_fp8_width(hidden: int) -> int:
    """Bytes a row of a :func:`packed_fp8_rows` buffer: H E4M3 elements and 4 per 128-block of scales."""
    return hidden + 4 * -(-hidden // 128)


def packed_fp8_rows(num_rows: int, hidden: int, device) -> torch.Tensor:
    """One uint8 buffer [R, :func:`packed_fp8_width`] for R FP8 rows with 1 x 128 block scales (the
    rows dispatch_format="fp8_block" pulls, which the backward keeps as one tensor): :func:`fp8_rows`
    gives its parts."""
    return torch.empty(num_rows, packed_fp8_width(hidden), dtype=torch.uint8, device=device)


def fp8_rows(packed: torch.Tensor, hidden: int, scale_order: str = "rows") -> tuple[torch.Tensor, torch.Tensor]:
    """The parts of a :func:`packed_fp8_rows` buffer, as the FP8 GEMMs take A: (elements
    float8_e4m3fn [R, H] from its first byte, scales from byte R·H: float32 [ceil(H / 128), R], or
    with ``scale_order`` "mma" (Plan.fp8_scale_order: SM100, R a multiple of 128) E8M0 bytes in
    the MMA order, uint8 [R / 128, ceil(H / 128), 512]: the same 4·ceil(H / 128) bytes a row)."""
    num_rows, flat = packed.shape[0], packed.view(-1)
    elements = flat[: num_rows * hidden].view(torch.float8_e4m3fn).view(num_rows, hidden)
    if scale_order == "mma":
        if num_rows % 128:
            raise ValueError(f"packed: expected R a multiple of 128 for scale_order='mma', got R={num_rows}")
        return elements, flat[num_rows * hidden:].view(num_rows // 128, -(-hidden // 128), 512)
    scales = flat[num_rows * hidden:].view(torch.float32).view(-(-hidden // 128), num_rows)
    return elements, scales


def bf16_rows(plan: Plan, rows: torch.Tensor, sched: Schedule) -> torch.Tensor:
    """Rows [R, H] as bf16: themselves, or (a :func:`packed_fp8_rows` buffer: x's rows that crossed
    in FP8) their values, the rows ``sched`` uses: element times scale, by the scales' order
    (SM100's E8M0 rows are MXFP8 rows: :func:`dequantized_rows`, the same values)."""
    if rows.dtype != torch.uint8:
        return rows
    order = plan.fp8_scale_order
    rows_q = fp8_rows(rows, plan.config.hidden, order)
    if order == "mma":
        return dequantized_rows(rows_q, rows_in_use(sched))
    return ops.dequantize_fp8_rows(*rows_q, rows_used=rows_in_use(sched))


def rows_in_use(sched: Schedule) -> torch.Tensor:
    """The rows the schedule uses (its last expert offset, tile-aligned), as a device count."""
    return sched.expert_offsets[-1:]


def quantized_rows(plan: Plan, rows: torch.Tensor, sched: Schedule | None, segments: int = 1, *, gathered: bool = False,
                   rows_out: torch.Tensor | None = None):
    """``rows`` as a quantized precision's GEMMs take them: the rows ``sched`` uses, or all of them
    (x, whose rows a GEMM gathers). fp8_block: FP8 with 1 x 128 block scales by the plan's scale
    rule (fp8_scales), the scales in the order its GEMMs take (plan.fp8_scale_order), ``segments``
    as ops.quantize_fp8_rows takes it, and with ``gathered`` the rows of x the schedule names:
    each token quantized once and its FP8 row gathered (plan.gathers_fp8_rows), or gathered as
    they are quantized (and with ``rows_out`` their bf16 copy written there by the same pass);
    MXFP8: its elements and MMA-ordered scales, or with
    ``plan.emulate`` their exact bf16 values for the bf16 GEMM; ``segments`` 2 (dh): each half
    blocked on its own, each starting a chunk of the MMA's scales (the same bytes as one segment
    where 128 divides I)."""
    used = None if sched is None else rows_in_use(sched)
    if plan.precision == "fp8_block":
        pow2, order = plan.config.fp8_power_of_two, plan.fp8_scale_order
        if gathered and rows_out is None and plan.gathers_fp8_rows:  # (each token quantized once, its E4M3 row gathered)
            return ops.gather_fp8_rows(ops.quantize_fp8_rows(rows, power_of_two=pow2), sched.row_token, rows_used=used)
        return ops.quantize_fp8_rows(rows, power_of_two=pow2, rows_used=used, segments=segments, scale_order=order,
                                     row_source=sched.row_token if gathered else None, rows_out=rows_out)
    if gathered:
        raise ValueError(f"quantized_rows: gathered rows are fp8_block's, got precision {plan.precision!r}")
    rows_q = ops.quantize_mxfp8(rows, rows_used=used, scale_order="mma", segments=segments)
    return dequantized_rows(rows_q, used, segments) if plan.emulate else rows_q


def operand_rows(plan: Plan, rows, sched: Schedule | None):
    """A quantized precision's GEMM operand from ``rows``: as they are where quantized already (a
    :func:`quantized_rows` pair, or FP8 rows packed as they crossed the link: :func:`fp8_rows`),
    else :func:`quantized_rows` of them."""
    if isinstance(rows, tuple):
        return rows
    if rows.dtype == torch.uint8:
        return fp8_rows(rows, plan.config.hidden, plan.fp8_scale_order)
    return quantized_rows(plan, rows, sched)


def gemm_weight(plan: Plan, w_q: tuple):
    """One of a quantized precision's weight copies as its GEMMs take it: itself, or with MXFP8's
    emulation its exact bf16 values (the bf16 GEMM reads them K-major, as the copy is)."""
    return dequantized_weights(w_q) if plan.emulate else w_q


# ----- the expert GEMMs


def gate_up(plan: Plan, rows: torch.Tensor, sched: Schedule, weights, h_out: torch.Tensor | None, *, gather: bool,
            biases: tuple | None = None) -> torch.Tensor | tuple:
    """a [R, I] = act(rows·W_gateᵀ, rows·W_upᵀ) (and h = [rows·W_gateᵀ | rows·W_upᵀ] into ``h_out``),
    or where the plan quantizes it there (:attr:`Plan.quantizes_activation_in_gemm`) a's FP8 rows
    as :func:`quantized_rows` gives them.
    ``gather``: ``rows`` is x [T, H] and the GEMM's producer gathers row r = x[row_token[r]]; else
    ``rows`` holds the rows [R, H], bf16 or (a quantized precision) as :func:`quantized_rows` gives
    them, or FP8 rows in a :func:`packed_fp8_rows` buffer. ``weights``: (w_gate, w_up, w_down)
    bf16, or a quantized precision's copies. ``biases`` (bf16): (b_gate, b_up, b_down), the first
    two added to the products (inside h too)."""
    bias = {} if biases is None else dict(bias=biases[0], bias2=biases[1])
    if plan.precision == "bf16":
        return ops.grouped_gemm(rows, weights[0], sched.tile_expert, b2=weights[1], h_out=h_out, gather=sched.row_token if gather else None,
                                activation=plan.activation, **bias, **plan.pairs)
    rows_q = operand_rows(plan, rows, None if gather else sched)  # (gathering: each token once)
    out = dict(out_format="fp8_block", power_of_two=plan.config.fp8_power_of_two) if plan.quantizes_activation_in_gemm else {}
    return ops.grouped_gemm(rows_q, gemm_weight(plan, weights.gate), sched.tile_expert, b2=gemm_weight(plan, weights.up), h_out=h_out,
                            gather=sched.row_token if gather else None, activation=plan.activation, **bias, **plan.gate_up_pairs, **out)


def backward_weights(plan: Plan, weights: tuple, stacked: tuple | None):
    """The weights a one-GPU backward's dgrad GEMMs take: the transposed MXFP8 copies (MXFP8), the
    transposed FP8 block-scaled ones (fp8_block), the [E + 1, ...] stack with the shared expert
    (``stacked``), or ``weights`` themselves (read N-major)."""
    if stacked is None and plan.precision == "mxfp8":
        return quantize_expert_weights(*weights, transposed=True)
    if stacked is None and plan.precision == "fp8_block":
        return fp8_block_weights(*weights, transposed=True, power_of_two=plan.config.fp8_power_of_two, scale_order=plan.fp8_scale_order)
    return weights if stacked is None else stacked


def routed_weights(plan: Plan, weights: tuple, stacked: tuple | None):
    """The weights a one-GPU forward's routed GEMMs take: their MXFP8 copies (MXFP8 precision), the
    [E + 1, ...] stack with the shared expert (``stacked``, when it runs in the routed launches), or
    ``weights`` (w_gate, w_up, w_down) themselves."""
    if plan.precision == "mxfp8":
        return quantize_expert_weights(*weights)
    if plan.precision == "fp8_block":
        return fp8_block_weights(*weights, power_of_two=plan.config.fp8_power_of_two, scale_order=plan.fp8_scale_order)
    return stacked if stacked is not None else weights


def gate_up_from_tokens(plan: Plan, x: torch.Tensor, sched: Schedule, weights, h_out: torch.Tensor | None,
                        biases: tuple | None = None) -> torch.Tensor:
    """:func:`gate_up` at one GPU on the rows of x the schedule names: gathered by the GEMM's
    producer where the plan allows it (``plan.gather_in_gemm``), else gathered first (fp8_block:
    as they are quantized, ``plan.quantizes_gathered_rows``)."""
    if plan.quantizes_gathered_rows:
        rows = quantized_rows(plan, x, sched, gathered=True)
    else:
        rows = x if plan.gather_in_gemm else ops.gather_rows(x, sched.row_token, rows_used=rows_in_use(sched))
    return gate_up(plan, rows, sched, weights, h_out, gather=plan.gather_in_gemm, biases=biases)


def gate_from_tokens(plan: Plan, x: torch.Tensor, sched: Schedule, weights, biases: tuple | None = None, *,
                     rows: torch.Tensor | None = None) -> torch.Tensor:
    """h's gate half again, [R, I] = x_row·W_gateᵀ (+ b_gate) for the rows the schedule names (bf16;
    saved_h_format="recompute_gate"): a plain GEMM in the gate/up GEMM's 128-column tile, its rows
    gathered the way :func:`gate_up_from_tokens` gathers them (or ``rows``, the rows themselves: the
    ones an EP forward pulled), so the same MMAs in the same order as the gate product the forward
    wrote into h: the same bits."""
    w_gate = weights[0]
    options = dict(tile_n=default_tile_n(w_gate.shape[1], w_gate.shape[2], swiglu=True), **plan.pairs)  # (the gate/up GEMM's column tile)
    if biases is not None:
        options["bias"] = biases[0]
    if rows is not None:
        return ops.grouped_gemm(rows, w_gate, sched.tile_expert, **options)
    gather = plan.gather_in_gemm
    a = x if gather else ops.gather_rows(x, sched.row_token, rows_used=rows_in_use(sched))
    return ops.grouped_gemm(a, w_gate, sched.tile_expert, gather=sched.row_token if gather else None, **options)


def down(plan: Plan, a: torch.Tensor, sched: Schedule, weights, biases: tuple | None = None) -> torch.Tensor:
    """y_rows [R, H] = a·W_downᵀ (+ b_down, the last of ``biases``) per expert."""
    bias = {} if biases is None else dict(bias=biases[2])
    return ops.grouped_gemm(*down_operands(plan, a, sched, weights), sched.tile_expert, **bias, **plan.pairs)


def down_operands(plan: Plan, a: torch.Tensor, sched: Schedule, weights) -> tuple:
    """The down projection's (A, B) in the plan's precision (:func:`down`, and the EP forward's
    scattering GEMM), ``weights`` as :func:`routed_weights` gives them: a and w_down (bf16); a's
    rows in use quantized (or as the gate/up GEMM quantized them) and w_down's FP8 copy (fp8_block,
    MXFP8); with MXFP8's emulation the same operands dequantized for the bf16 GEMM."""
    if plan.precision == "bf16":
        return a, weights[2]
    return operand_rows(plan, a, sched), gemm_weight(plan, weights.down)


def gathered_dout(plan: Plan, dout: torch.Tensor, sched: Schedule, bf16_needed: bool) -> tuple:
    """(dout's rows in the schedule's order in bf16 where ``bf16_needed``, else None; the same rows
    quantized) for the one-GPU backward of a precision whose rows are gathered as they are
    quantized (:attr:`Plan.quantizes_gathered_rows`): one pass writes both, the FP8 rows the
    SwiGLU backward takes and the bf16 rows the weight gradients and bias sums read."""
    rows = torch.empty(sched.row_token.shape[0], dout.shape[1], dtype=torch.bfloat16, device=dout.device) if bf16_needed else None
    return rows, quantized_rows(plan, dout, sched, gathered=True, rows_out=rows)


def down_backward(plan: Plan, dout_rows: torch.Tensor | None, sched: Schedule, weights_t, h: torch.Tensor, topk_w: torch.Tensor,
                  biases: tuple | None = None, dout_q: tuple | None = None) -> tuple:
    """(dh [R, 2I], a_scaled = s·a [R, I], router-gradient pieces [R, parts]) from dout_rows [R, H]
    (bf16, or at EP with dispatch_format="fp8_block" FP8 rows packed as they crossed) and the saved
    h: ops.swiglu_backward_gemm with each row's router weight s from ``topk_w``.
    ``weights_t``: (w_gate, w_up, w_down) bf16, or the transposed Mxfp8ExpertWeights. ``biases``
    (bf16): the last piece of each row is the down bias's, <dout_row, b_down[e]>. ``dout_q``: the
    rows quantized already (:func:`gathered_dout`; ``dout_rows`` then bf16 or None)."""
    route = dict(row_token=sched.row_token, row_slot=sched.row_slot, topk_w=topk_w, activation=plan.activation)
    operands = swiglu_backward_operands(plan, dout_rows if dout_q is None else dout_q, sched, weights_t)
    dh, a_scaled, pieces = ops.swiglu_backward_gemm(*operands, sched.tile_expert, h, bias_piece=biases is not None, **route)
    if biases is not None:
        ops.bias_router_pieces(bf16_rows(plan, dout_rows, sched), biases[2], sched, pieces)
    return dh, a_scaled, pieces


def swiglu_backward_operands(plan: Plan, dout_rows, sched: Schedule, weights_t) -> tuple:
    """The SwiGLU-backward GEMM's (A, B) in the plan's precision: the dout rows and w_down (bf16,
    read N-major); the rows in use quantized (as they are where quantized already: :func:`operand_rows`)
    with w_down's transposed FP8 copy (fp8_block, MXFP8); with MXFP8's emulation the same operands
    dequantized, w_down [E, H, I] read N-major as the bf16 GEMM does."""
    if plan.precision == "bf16":
        return dout_rows, weights_t[2]
    w_down = gemm_weight(plan, weights_t.down)
    return operand_rows(plan, dout_rows, sched), w_down.transpose(1, 2).contiguous() if plan.emulate else w_down


def gate_up_backward(plan: Plan, dh: torch.Tensor, sched: Schedule, weights_t) -> torch.Tensor:
    """dx_rows [R, H] = dh_gate·W_gate + dh_up·W_up (the two K halves of dh in one GEMM)."""
    a, b, options = dx_operands(plan, dh, sched, weights_t)
    return ops.grouped_gemm(a, b, sched.tile_expert, **options)


def dx_operands(plan: Plan, dh: torch.Tensor, sched: Schedule, weights_t) -> tuple:
    """The dx GEMM's (A, B, options) in the plan's precision (:func:`gate_up_backward`, and the EP
    backward's scattering GEMM), ``weights_t`` as :func:`backward_weights` gives them: dh with
    w_gate and w_up read N-major (bf16); dh's rows in use quantized with the weights' transposed
    FP8 copies (fp8_block: each half of dh blocked on its own, the GEMM's two K ranges; MXFP8);
    with MXFP8's emulation the same operands dequantized for the bf16 GEMM; K split into dh's two
    halves every way."""
    if plan.precision == "bf16":
        return dh, weights_t[0], dict(b2=weights_t[1], b_major="n", k_split=True, **plan.pairs)
    return quantized_rows(plan, dh, sched, segments=2), gemm_weight(plan, weights_t.gate), dict(b2=gemm_weight(plan, weights_t.up), k_split=True)


def expert_bias_grads(dout_rows: torch.Tensor, dh: torch.Tensor, sched: Schedule, topk_w: torch.Tensor, biases: tuple) -> tuple:
    """(d b_gate, d b_up [E, I], d b_down [E, H]) in the biases' dtype: the sums over each expert's
    rows of dh's two halves (the router weight is inside dh) and of the dout rows each times its
    router weight (``topk_w``: the weights the schedule's rows index; at EP every rank's), each in one
    fixed order (mok/kernels/common/bias_grads.py)."""
    inter = dh.shape[1] // 2
    d_gate_up = ops.expert_column_sums(dh, sched)
    d_down = ops.expert_column_sums(dout_rows, sched, topk_w=topk_w)
    return tuple(g.to(b.dtype) for g, b in zip((d_gate_up[:, :inter], d_gate_up[:, inter:], d_down), biases))


def weight_grad(a, b, offsets, dtype, main_grad, counts=None):
    """One weight gradient, fresh in ``dtype`` or added into ``main_grad``; ``counts``: the experts'
    unpadded row counts (the kernel then skips the K tiles of padding alone)."""
    if main_grad is not None:
        return ops.weight_grad(a, b, offsets, counts=counts, out=main_grad, accumulate=True)
    return ops.weight_grad(a, b, offsets, counts=counts, out_dtype=dtype)


def gate_up_weight_grads(dh, x_rows, offsets, dtype, main_grads, counts=None, layout: str = "separate"):
    """dW_gate, dW_up from the two column halves of dh, each into its own tensor, in one launch;
    ``layout`` (MoKConfig.gate_up_layout) "concatenated" or "interleaved": (one [E, 2I, H] tensor,
    each expert's dW_gate rows then its dW_up rows, or the two interleaved row by row: the layout
    of the one gate/up weight; None), the same tiles, the same bits. (dh and the x rows bf16, or
    their FP8 transposes: :func:`fp8_weight_grad_operands`.)"""
    if layout == "concatenated":
        return ops.weight_grad(dh, x_rows, offsets, counts=counts, out_dtype=dtype), None
    if layout == "interleaved":
        experts, inter2, hidden = offsets.shape[0] - 1, operand_columns(dh), operand_columns(x_rows)
        whole = torch.empty(experts, inter2, hidden, dtype=dtype, device=offsets.device)
        ops.weight_grad(dh, x_rows, offsets, counts=counts, out=(whole[:, 0::2], whole[:, 1::2]), split_out=True)
        return whole, None
    if main_grads is None:
        return ops.weight_grad(dh, x_rows, offsets, counts=counts, out_dtype=dtype, split_out=True)
    return ops.weight_grad(dh, x_rows, offsets, counts=counts, out=tuple(main_grads), accumulate=True, split_out=True)


def operand_columns(operand) -> int:
    """M of a weight gradient's operand: bf16 rows [R, M], or FP8 transposes (elements [M, R], scales)."""
    return operand[0].shape[0] if isinstance(operand, tuple) else operand.shape[1]


def fp8_weight_grad_operands(plan: Plan, rows: tuple, sched: Schedule, tokens: tuple = (None, None)) -> tuple:
    """The weight gradients' operands on FP8 (wgrad_format="fp8_block"): the transposes of
    ``rows`` = (dout_rows, a_scaled, dh, x_rows) with 1 x 128 blocks along the rows
    (ops.quantize_fp8_columns, the plan's scale rule), the row blocks in use only; where dout_rows
    or x_rows is None, the rows of its token matrix in ``tokens`` = (dout, x) gathered as they are
    quantized. On SM100 (plan.fp8_scale_order "mma") the same values as the MXFP8 operands its
    weight-gradient kernel reads: the rows' own layout, E8M0 scales in the MMA order, dh's halves
    (the split-out gradient's two M ranges) each starting a chunk."""
    order = plan.fp8_scale_order
    options = dict(power_of_two=plan.config.fp8_power_of_two, rows_used=rows_in_use(sched), scale_order=order)

    def transpose(t: torch.Tensor | None, token_matrix: torch.Tensor | None = None, segments: int = 1):
        if t is None:
            return ops.quantize_fp8_columns(token_matrix, row_source=sched.row_token, **options)
        return ops.quantize_fp8_columns(t, segments=segments, **options)

    dout_rows, a_scaled, dh, x_rows = rows
    return (transpose(dout_rows, tokens[0]), transpose(a_scaled), transpose(dh, segments=2 if order == "mma" else 1),
            transpose(x_rows, tokens[1]))


def expert_weight_grads(
    plan: Plan, rows: tuple, sched: Schedule, grad_dtype, main_grads, wgrad_format: str, gate_up_layout: str = "separate",
    tokens: tuple = (None, None),
) -> tuple:
    """(dW_gate, dW_up, dW_down) of the routed experts over their rows in canonical order, from
    ``rows`` = (dout_rows, a_scaled, dh, x_rows); fresh in ``grad_dtype`` or added into
    ``main_grads`` (gate, up, down). ``wgrad_format`` (MoKConfig.weight_grad_format): "bf16", the
    rows as they are; "mxfp8", quantized along the rows (blocks of 32 rows down each column);
    "fp8_block", their transposes with 1 x 128 blocks along the rows (Hopper's FP8 kernel), or on
    SM100 the same blocks as MXFP8 operands (its MXFP8 kernel; :func:`fp8_weight_grad_operands`;
    ``tokens`` = (dout, x), whose rows are gathered as they are quantized where dout_rows or x_rows
    is None). ``gate_up_layout`` "concatenated" or "interleaved" (fresh):
    dW_gate and dW_up as one [E, 2I, H] tensor (:func:`gate_up_weight_grads`)."""
    offsets, counts = sched.expert_offsets, sched.expert_counts
    if wgrad_format == "fp8_block":
        rows = fp8_weight_grad_operands(plan, rows, sched, tokens)
    dout_rows, a_scaled, dh, x_rows = rows
    if wgrad_format != "mxfp8":  # (bf16 rows, or FP8 transposes: ops.weight_grad takes either)
        d_down = weight_grad(dout_rows, a_scaled, offsets, grad_dtype, None if main_grads is None else main_grads[2], counts)
        d_gate, d_up = gate_up_weight_grads(
            dh, x_rows, offsets, grad_dtype, None if main_grads is None else main_grads[:2], counts, layout=gate_up_layout
        )
        return d_gate, d_up, d_down
    used = rows_in_use(sched)
    segments = (1, 1, 2, 1)  # (dh: each half chunked on its own, the split-out gradient's two row ranges)
    columns = [ops.quantize_mxfp8_columns(t, rows_used=used, scale_order="mma", segments=n) for t, n in zip(rows, segments)]
    if plan.emulate:
        columns = [dequantized_columns(q, n) for q, n in zip(columns, segments)]
    wgrad = dict(offsets=offsets, counts=counts, out_dtype=grad_dtype)
    down_into, gate_up_into = {}, {}  # (fresh tensors, or added into the main_grad buffers)
    if main_grads is not None:
        down_into, gate_up_into = dict(out=main_grads[2], accumulate=True), dict(out=tuple(main_grads[:2]), accumulate=True)
    d_down = ops.weight_grad(columns[0], columns[1], **wgrad, **down_into)
    d_gate, d_up = ops.weight_grad(columns[2], columns[3], split_out=True, **wgrad, **gate_up_into)
    return d_gate, d_up, d_down
