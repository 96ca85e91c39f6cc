"""The MoE forward with its expert GEMMs on MXFP8 operands (SM100: block-scaled tcgen05 MMAs).

    device schedule                 -> row slots, tile -> expert map (as the bf16 forward's)
    row gather                      -> x_rows [R, H] bf16, rows grouped by expert
    quantize (scales in MMA order)  -> x_rows in MXFP8
    MXFP8 grouped GEMM + SwiGLU     -> a [R, I] bf16 (fp32 accumulation)
    quantize                        -> a in MXFP8
    MXFP8 grouped GEMM              -> y_rows [R, H] bf16
    combine                         -> out[t] = shared[t] + Σ_j w[t, j]·y_rows[slot_row[t, j]]

The expert weights are quantized once (:func:`quantize_expert_weights`) and reused across calls
until they change. Only the rows the schedule uses are converted (a count on the device: no host
sync). Quantization is mok.mxfp8's rule (E4M3 elements, an E8M0 scale per 32 along K, rounded up);
every scale, row and tile decision depends on static shapes and each row's own values, so a
token's output does not depend on the rest of the batch. The shared expert (if any) runs in bf16.
With ``save_for_backward`` it keeps h (bf16) and the schedule for mok.mxfp8_backward.

Status: the MXFP8 GEMMs are compile-verified only (no SM100 GPU was available to this project).
With ``emulate=True`` the same forward runs on Hopper, its GEMMs' operands dequantized (exactly)
into the bf16 grouped GEMM: the same numerics up to the order of the fp32 sums, for studying
MXFP8's accuracy there; tests/test_mxfp8_gpu.py holds that path, and tests/test_sm100_gpu.py the
real one, to the float64 reference on MXFP8-rounded operands.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import ops
from .fused_forward import TILE_M, ForwardResult, shared_expert_forward
from .kernels import MXFP8_GEMM_ARCHS
from .mxfp8 import rows_scale_layout
from .reference import SharedExpert
from .runtime.arch import device_arch
from .schedule import worst_case_capacity
from .validation import check_index_range, check_moe_inputs, check_tensor


@dataclass(frozen=True)
class Mxfp8ExpertWeights:
    """The experts' weights in MXFP8, each as (elements float8_e4m3fn, scales uint8 in the MMA's
    order): gate and up [E, I, H] with scales [E, I/128, H/128, 512], down [E, H, I] with
    [E, H/128, I/128, 512] (mok.mxfp8.mma_scale_layout); ``transposed``: the backward's copies
    instead (gate and up [E, H, I], down [E, I, H]: the shapes alone cannot tell them apart when
    H == I, so the forward and the backward check this flag)."""

    gate: tuple[torch.Tensor, torch.Tensor]
    up: tuple[torch.Tensor, torch.Tensor]
    down: tuple[torch.Tensor, torch.Tensor]
    transposed: bool = False


def quantize_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One projection's weights [E, N, K] (bf16, CUDA, N and K multiples of 128) in MXFP8 along K:
    (elements [E, N, K], scales [E, N/128, K/128, 512] in the MMA's order), one launch."""
    check_tensor("w", w, dtypes=(torch.bfloat16,), ndim=3, contiguous=True)
    experts, n, k = w.shape
    if n % 128 or k % 128:
        raise ValueError(f"w: expected [E, N, K] with N and K multiples of 128, got {list(w.shape)}")
    elements, scales = ops.quantize_mxfp8(w.reshape(experts * n, k), scale_order="mma")
    return elements.reshape(experts, n, k), scales.reshape(experts, n // 128, k // 128, 512)


def quantize_expert_weights(
    w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, *, transposed: bool = False
) -> Mxfp8ExpertWeights:
    """The layer's expert weights (w_gate, w_up [E, I, H], w_down [E, H, I], bf16) in MXFP8 along
    their K in the forward (H for gate and up, I for down); ``transposed``: for the backward's
    products instead (mok.mxfp8_backward), each transposed and quantized along its other axis:
    gate and up [E, H, I] along I, down [E, I, H] along H."""
    if transposed:
        w_gate, w_up, w_down = (w.transpose(1, 2).contiguous() for w in (w_gate, w_up, w_down))
    return Mxfp8ExpertWeights(quantize_weights(w_gate), quantize_weights(w_up), quantize_weights(w_down), transposed)


def mxfp8_moe_forward(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    weights: Mxfp8ExpertWeights,
    shared: SharedExpert | tuple | None = None,
    *,
    check_routing: bool = True,
    out: torch.Tensor | None = None,
    save_for_backward: bool = False,
    emulate: bool = False,
) -> ForwardResult:
    """The layer output with the routed experts' GEMMs on MXFP8 operands (module docstring), as
    mok.fused_forward.moe_forward returns it: out [T, H] bf16 and the schedule, and with
    ``save_for_backward`` h (and the shared expert's h) for mok.mxfp8_backward. x [T, H] bf16;
    topk_idx [T, k] int32/int64 in [0, E); topk_w [T, k] fp32; ``weights`` from
    :func:`quantize_expert_weights`; ``shared``: bf16 (gate [I_s, H], up, down [H, I_s]).
    ``check_routing`` reads the index range back (a host sync; off under CUDA graphs).
    Needs an SM100 GPU (block-scaled MMAs), H and I multiples of 128. ``emulate``: the GEMMs'
    MXFP8 operands dequantized (exactly: E4M3 times a power of two fits bf16) and multiplied by the
    bf16 grouped GEMM, for Hopper: the same quantization and products, fp32 sums in another order
    (to study MXFP8's numerics where no block-scaled MMA exists; slower than the bf16 forward)."""
    if not isinstance(weights, Mxfp8ExpertWeights) or weights.transposed:
        got = "the backward's transposed copies" if isinstance(weights, Mxfp8ExpertWeights) else type(weights).__name__
        raise TypeError(f"weights: expected Mxfp8ExpertWeights (quantize_expert_weights, not transposed), got {got}")
    e4m3 = (torch.bfloat16, torch.float8_e4m3fn)  # x and the shared expert: bf16 (checked below); the experts: E4M3
    num_tokens, hidden, inter, num_experts, _ = check_moe_inputs(
        x, topk_idx, topk_w, weights.gate[0], weights.up[0], weights.down[0], shared, dtypes=e4m3, router_dtypes=(torch.float32,),
        check_range=False,
    )
    check_tensor("x", x, dtypes=(torch.bfloat16,))
    check_mxfp8_weights(weights, shared, x.device)
    check_mxfp8_device("mxfp8_moe_forward", x, emulate)
    if check_routing:
        check_index_range("topk_idx", topk_idx, num_experts)
    x, topk_w, topk_idx = x.contiguous(), topk_w.contiguous(), topk_idx.to(torch.int32).contiguous()
    rows = worst_case_capacity(num_tokens, topk_idx.shape[1], num_experts, TILE_M)
    sched = ops.device_schedule(topk_idx, num_experts, block_m=TILE_M, capacity=rows)
    used = sched.expert_offsets[-1:]  # the rows in use (tile-aligned), on the device
    x_rows = ops.gather_rows(x, sched.row_token)
    h = shared_h = None
    if save_for_backward:
        h = torch.empty(rows, 2 * inter, dtype=torch.bfloat16, device=x.device)
        if shared is not None:
            shared_h = torch.empty(num_tokens, 2 * shared[0].shape[0], dtype=torch.bfloat16, device=x.device)
    x_q = ops.quantize_mxfp8(x_rows, rows_used=used, scale_order="mma")
    a = mxfp8_grouped_gemm(x_q, weights.gate, sched.tile_expert, weights.up, used=used, h_out=h, emulate=emulate)
    a_q = ops.quantize_mxfp8(a, rows_used=used, scale_order="mma")
    y_rows = mxfp8_grouped_gemm(a_q, weights.down, sched.tile_expert, used=used, emulate=emulate)
    shared_out = None if shared is None else shared_expert_forward(x, shared, shared_h)
    out = ops.combine(y_rows, topk_w, shared_out, slot_row=sched.slot_row, out=out)
    return ForwardResult(out=out, schedule=sched, h=h, shared_h=shared_h)


def check_mxfp8_weights(weights: Mxfp8ExpertWeights, shared: tuple | None, device: torch.device, name: str = "weights") -> None:
    """Each projection's E4M3 elements [E, N, K] (N and K multiples of 128) and its scales in the
    MMA's order [E, N/128, K/128, 512] on ``device``; the shared expert (if any) in bf16."""
    for which, t in (("shared.gate", 0), ("shared.up", 1), ("shared.down", 2)) if shared is not None else ():
        check_tensor(which, shared[t], dtypes=(torch.bfloat16,))
    for proj in ("gate", "up", "down"):
        elements, scales = getattr(weights, proj)
        experts, n, k = elements.shape
        check_tensor(f"{name}.{proj}", elements, dtypes=(torch.float8_e4m3fn,), device=device, contiguous=True)
        if n % 128 or k % 128:
            raise ValueError(f"{name}.{proj}: expected [E, N, K] with N and K multiples of 128, got {list(elements.shape)}")
        check_tensor(f"{name}.{proj} scales", scales, dtypes=(torch.uint8,), shape=(experts, n // 128, k // 128, 512),
                     device=device, contiguous=True)


def check_mxfp8_device(op: str, x: torch.Tensor, emulate: bool) -> None:
    """The MXFP8 GEMMs need an SM100 GPU; ``emulate`` runs their numerics on any GPU MoK supports."""
    arch = device_arch(x.device.index) if x.is_cuda else None
    if arch is None or (arch not in MXFP8_GEMM_ARCHS and not emulate):
        raise NotImplementedError(
            f"{op}: needs an SM100 GPU ({', '.join(MXFP8_GEMM_ARCHS)}: block-scaled MMAs), got {arch or x.device}"
            + ("" if arch is None else " (emulate=True runs its numerics on this GPU)")
        )


def mxfp8_grouped_gemm(
    a_q: tuple, b_q: tuple, tile_expert: torch.Tensor, b2_q: tuple | None = None, *, used: torch.Tensor | None = None,
    h_out: torch.Tensor | None = None, k_split: bool = False, emulate: bool = False,
) -> torch.Tensor:
    """ops.grouped_gemm_mxfp8 on (elements, MMA-ordered scales) pairs (SwiGLU with ``b2_q``, also
    writing ``h_out``; or K's halves from b_q and b2_q with ``k_split``), or with ``emulate`` the
    same product from dequantized operands by the bf16 grouped GEMM (A's rows past the device count
    ``used`` are not dequantized: no tile reads them)."""
    if not emulate:
        b2, b2_scales = (None, None) if b2_q is None else b2_q
        return ops.grouped_gemm_mxfp8(*a_q, *b_q, tile_expert, b2=b2, b2_scales=b2_scales, k_split=k_split, h_out=h_out)
    a = dequantized_rows(a_q, used)
    b2 = None if b2_q is None else dequantized_weights(b2_q)
    return ops.grouped_gemm(a, dequantized_weights(b_q), tile_expert, b2=b2, k_split=k_split, h_out=h_out)


def dequantized_rows(a_q: tuple, used: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 [R, K] of MXFP8 rows (elements, MMA-ordered scales) (exact); only the first used[0] rows
    with a device count ``used``."""
    return ops.dequantize_mxfp8(a_q[0], rows_scale_layout(a_q[1], a_q[0].shape[0]), rows_used=used)


def dequantized_weights(w_q: tuple) -> torch.Tensor:
    """bf16 [E, N, K] of MXFP8 weights (elements, MMA-ordered scales) (exact)."""
    elements, scales = w_q
    return ops.dequantize_mxfp8(elements, rows_scale_layout(scales, elements.shape[1]))
