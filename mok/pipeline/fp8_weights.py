"""The experts' weights in FP8 with 128 x 128 block scales (precision="fp8_block"), quantized once per
weight version: as they are for the forward's products, transposed for the backward's.

A weight is quantized again only when its tensor changed: another tensor, other storage, or an
in-place update (an optimizer step bumps the tensor's version counter). The cache holds the
quantized copy beside the weight for as long as the weight lives (a weak reference: it goes with
the weight). Under CUDA graphs a replay uses the copy made when the graph was captured: capture
again after the weights change (or step the optimizer outside the graph and re-capture).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from .. import ops

_CACHE: dict[tuple, tuple] = {}  # (id(weight), transposed, power_of_two, scale order) -> (weak reference, version, data pointer, (elements, scales))


@dataclass(frozen=True)
class Fp8BlockExpertWeights:
    """Each projection's (elements float8_e4m3fn [E, N, K], scales float32 [E, N / 128, K / 128], or
    on SM100 E8M0 bytes in the MMA's order [E, N / 128, K / 128, 512]): gate and up [E, I, H], down
    [E, H, I] (mok.fp8_block's layout); ``transposed``: the backward's copies instead, gate and up
    [E, H, I], down [E, I, H]."""

    gate: tuple[torch.Tensor, torch.Tensor]
    up: tuple[torch.Tensor, torch.Tensor]
    down: tuple[torch.Tensor, torch.Tensor]
    transposed: bool = False


def quantized_once(w: torch.Tensor, transposed: bool = False, power_of_two: bool = False,
                   scale_order: str = "rows") -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [E, N, K] bf16 (``transposed``: its [E, K, N] transpose) in FP8 with 128 x 128 block
    scales (ops.quantize_fp8_weights, ``power_of_two`` and ``scale_order`` as there), from the
    cache while ``w`` is the same tensor at the same version (module docstring)."""
    key = (id(w), transposed, power_of_two, scale_order)
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is w and hit[1] == w._version and hit[2] == w.data_ptr():
        return hit[3]
    quantized = ops.quantize_fp8_weights((w.transpose(1, 2) if transposed else w).contiguous(), power_of_two=power_of_two,
                                         scale_order=scale_order)
    _CACHE[key] = (weakref.ref(w, lambda _, key=key: _CACHE.pop(key, None)), w._version, w.data_ptr(), quantized)
    return quantized


def fp8_block_weights(w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, *, transposed: bool = False,
                      power_of_two: bool = False, scale_order: str = "rows") -> Fp8BlockExpertWeights:
    """The layer's expert weights in FP8 (``transposed``: the backward's copies; ``power_of_two``:
    the scale rule; ``scale_order`` "mma": E8M0 scales for SM100's block-scaled MMAs), each
    quantized once per version (:func:`quantized_once`)."""
    return Fp8BlockExpertWeights(*(quantized_once(w, transposed, power_of_two, scale_order) for w in (w_gate, w_up, w_down)), transposed)
