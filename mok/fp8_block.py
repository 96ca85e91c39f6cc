"""FP8 with block scales, DeepSeek-V3's training recipe: the rule and its float64 reference.

Activations (rows) are scaled per row and per 128 consecutive values along K (1 x 128), weights
per 128 x 128 block, each block by one fp32 scale:

    amax   = max |x| over the block (in fp32)
    scale  = amax / 448                    (448: E4M3's largest finite value; an all-zero block: 1)
             or, with ``power_of_two``, 2^ceil(log2(amax / 448)), at least 2^-126 (then x / scale is
             exact before rounding)
    q      = e4m3(x · (1 / scale))         the fp32 product, rounded to nearest even, saturating at ±448

where 1 / scale is fp32's 448 / amax (one division per block; exactly 2^-e for power-of-two scales).
The elements are E4M3 (float8_e4m3fn); the scales fp32: a row matrix's kept transposed, [K / 128, R]
(the order the Hopper kernel's TMA reads a K block's row scales in), a weight's [E, N / 128, K / 128].
Where 128 does not divide K (or a weight's N) the last block is partial: it holds the values there
are (its scale from them alone), and there are ceil(K / 128) blocks. Rows may be blocked in
``segments`` (2: each half on its own, blocks restarting at the second half, for a GEMM whose two
K ranges are the halves).
A GEMM of two such operands is Σ over K blocks of (q_a·q_bᵀ)·scale_a·scale_b
(:func:`block_scaled_gemm_reference`; mok/kernels/sm90/block_scaled.py computes it on FP8 WGMMAs).
"""

from __future__ import annotations

import torch

from .validation import check_tensor

BLOCK = 128
E4M3_MAX = 448.0


def fp32_quotient(numerator: torch.Tensor | float, denominator: torch.Tensor | float) -> torch.Tensor:
    """numerator / denominator correctly rounded to fp32 (PTX's div.rn.f32), through float64 (exact
    for fp32 operands). torch may divide by multiplying with a rounded reciprocal (a scalar divided
    by a tensor does), which misses the quotient's last bit now and then."""
    as_double = [t.double() if isinstance(t, torch.Tensor) else float(t) for t in (numerator, denominator)]
    return (as_double[0] / as_double[1]).float()


def block_scales(amax: torch.Tensor, power_of_two: bool = False) -> torch.Tensor:
    """fp32 scales of blocks whose largest magnitude is ``amax`` (fp32): amax / 448, or the power of
    two at or above it (at least 2^-126, the smallest normal float); 1 for an all-zero block."""
    amax = amax.float()
    scale = fp32_quotient(amax, E4M3_MAX)
    if power_of_two:
        mantissa, exponent = torch.frexp(scale)  # scale = mantissa · 2^exponent, mantissa in [0.5, 1)
        scale = torch.ldexp(torch.ones_like(scale), torch.where(mantissa == 0.5, exponent - 1, exponent)).clamp(min=2.0**-126)
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def _quantize_blocks(x: torch.Tensor, power_of_two: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., 128·m] (each last-dim row one block) -> (E4M3 elements, fp32 scales [...]) by the module's rule."""
    x = x.float()
    amax = x.abs().amax(dim=-1)
    scale = block_scales(amax, power_of_two)
    if power_of_two:
        factor = 1.0 / scale  # (exact: a power of two)
    else:
        factor = torch.where(amax > 0, fp32_quotient(E4M3_MAX, amax), torch.ones_like(amax))
    return (x * factor[..., None]).to(torch.float8_e4m3fn), scale


def _padded(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` with zeros appended along ``dim`` up to a multiple of BLOCK (a zero changes no block's amax)."""
    extra = -t.shape[dim] % BLOCK
    if not extra:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def _segments(k: int, segments: int) -> int:
    """The width of each of a row's ``segments`` (1 or 2) blocked parts."""
    if segments not in (1, 2) or k % segments:
        raise ValueError(f"segments: expected 1, or 2 with K even, got {segments} with K={k}")
    return k // segments


def quantize_rows(x: torch.Tensor, *, power_of_two: bool = False, segments: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [R, K] -> (elements [R, K] E4M3, scales [blocks, R] fp32), 1 x 128 blocks in each of
    ``segments`` parts of a row (ceil(K / segments / 128) blocks a part; module docstring)."""
    check_tensor("x", x, ndim=2)
    rows, k = x.shape
    width = _segments(k, segments)
    parts, scales = [], []
    for part in x.split(width, dim=1):
        padded = _padded(part, 1)
        q, scale = _quantize_blocks(padded.reshape(rows, -1, BLOCK), power_of_two)
        parts.append(q.reshape(rows, -1)[:, :width])
        scales.append(scale.T)
    return torch.cat(parts, 1).contiguous(), torch.cat(scales, 0).contiguous()


def quantize_weights(w: torch.Tensor, *, power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights w [E, N, K] -> (elements [E, N, K] E4M3, scales [E, ceil(N / 128), ceil(K / 128)] fp32)."""
    check_tensor("w", w, ndim=3)
    experts, n, k = w.shape
    padded = _padded(_padded(w, 1), 2)
    nb, kb = padded.shape[1] // BLOCK, padded.shape[2] // BLOCK
    blocks = padded.reshape(experts, nb, BLOCK, kb, BLOCK).transpose(2, 3)  # [E, nb, kb, 128, 128]
    q, scale = _quantize_blocks(blocks.reshape(experts, nb, kb, BLOCK * BLOCK), power_of_two)
    q = q.reshape(experts, nb, kb, BLOCK, BLOCK).transpose(2, 3).reshape(experts, nb * BLOCK, kb * BLOCK)
    return q[:, :n, :k].contiguous(), scale


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor, segments: int = 1) -> torch.Tensor:
    """float64 rows [R, K] of (elements, scales [blocks, R]) blocked in ``segments`` parts."""
    width = _segments(q.shape[1], segments)
    per_part = scales.shape[0] // segments
    parts = [part.double() * scales[i * per_part:(i + 1) * per_part].double().T.repeat_interleave(BLOCK, dim=1)[:, :width]
             for i, part in enumerate(q.split(width, dim=1))]
    return torch.cat(parts, 1)


def dequantize_weights(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 weights [E, N, K] of (elements, scales [E, ceil(N / 128), ceil(K / 128)])."""
    _, n, k = q.shape
    return q.double() * scales.double().repeat_interleave(BLOCK, dim=1).repeat_interleave(BLOCK, dim=2)[:, :n, :k]


def block_scaled_gemm_reference(a: tuple, b: tuple, experts_of_rows: torch.Tensor) -> torch.Tensor:
    """float64 C [R, N] = the dequantized rows of ``a`` (elements, scales) times the dequantized
    weights of ``b`` of each row's expert (``experts_of_rows`` [R]; rows of expert -1 give 0), the
    product the kernels compute up to their fp32 rounding."""
    rows, weights = dequantize_rows(*a), dequantize_weights(*b)
    out = torch.zeros(rows.shape[0], weights.shape[1], dtype=torch.float64, device=rows.device)
    for e in range(weights.shape[0]):
        sel = experts_of_rows == e
        out[sel] = rows[sel] @ weights[e].T
    return out
