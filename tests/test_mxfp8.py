"""MXFP8 reference quantizer (mok/mxfp8.py) against a float64 brute-force oracle written from the
format's definition: E4M3 decoded from its bit fields, the scale as the smallest power of two
that brings the block's maximum within 448, every element the nearest E4M3 value (ties to the
even code)."""

import math

import numpy as np
import pytest
import torch

from mok.mxfp8 import BLOCK, ELEMENT_NAN, SCALE_NAN, dequantize_mxfp8, fake_quantize_mxfp8, quantize_mxfp8


def e4m3_value(code: int) -> float:
    """The value of an E4M3 (fn) byte from its fields: bias 7, subnormals at exponent 0, 0x7F/0xFF NaN."""
    sign = -1.0 if code & 0x80 else 1.0
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * mantissa / 8 * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


CODES = np.array([c for c in range(256) if not math.isnan(e4m3_value(c))])
VALUES = np.array([e4m3_value(c) for c in CODES])


def oracle(block: np.ndarray) -> tuple[int, list[int]]:
    """(scale byte, element codes) of one block of 32 float64 values."""
    if not np.isfinite(block).all():
        return SCALE_NAN, [ELEMENT_NAN] * BLOCK
    amax = np.abs(block).max()
    e = next(e for e in range(-127, 128) if 448.0 * 2.0**e >= amax)
    codes = []
    for v in block * 2.0**-e:
        distance = np.abs(VALUES - v)
        nearest = CODES[distance == distance.min()]
        # a tie: the even code (mantissa LSB 0); +0 and -0 tie for a zero: keep the value's sign
        if len(nearest) > 1:
            nearest = [c for c in nearest if (c & 1) == 0 and (c & 0x80) == (0x80 if math.copysign(1, v) < 0 else 0)] or nearest
        codes.append(int(nearest[0]))
    return e + 127, codes


def check_against_oracle(x: torch.Tensor) -> None:
    elements, scales = quantize_mxfp8(x)
    assert elements.dtype == torch.float8_e4m3fn and elements.shape == x.shape
    assert scales.dtype == torch.uint8 and scales.shape == (*x.shape[:-1], x.shape[-1] // BLOCK)
    blocks = x.double().reshape(-1, BLOCK).numpy()
    got_codes = elements.view(torch.uint8).reshape(-1, BLOCK).tolist()
    got_scales = scales.reshape(-1).tolist()
    for i, block in enumerate(blocks):
        scale, codes = oracle(block)
        assert got_scales[i] == scale, (i, block, got_scales[i], scale)
        assert got_codes[i] == codes, (i, block, got_codes[i], codes)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_random_blocks_of_every_magnitude_match_the_oracle(dtype):
    g = torch.Generator().manual_seed(7)
    magnitudes = torch.exp2(torch.randint(-40, 40, (48, 1), generator=g).float())
    x = (torch.randn(48, 4 * BLOCK, generator=g) * magnitudes).to(dtype)
    check_against_oracle(x)


def test_edge_values_match_the_oracle():
    bf16 = torch.finfo(torch.bfloat16)
    rows = [
        [0.0] * BLOCK,  # an all-zero block: the smallest scale, zero elements
        [-0.0] + [0.0] * (BLOCK - 1),
        [1.75] + [0.3] * (BLOCK - 1),  # amax exactly 1.75·2^k: scale 2^-8 ...
        [1.7578125] + [0.3] * (BLOCK - 1),  # ... the next bf16 above: 2^-7
        [448.0] + [-1.0] * (BLOCK - 1),
        [bf16.max] + [-bf16.max / 3] * (BLOCK - 1),  # near the top of bf16's range
        [bf16.smallest_normal * 3] + [bf16.smallest_normal / 8] * (BLOCK - 1),  # subnormals: scale clamped
        [1.0 + i / 16 for i in range(BLOCK)],  # halfway cases of E4M3's 3 mantissa bits (ties to even)
        [-(2.0**-9) * (i % 4) for i in range(BLOCK - 1)] + [100.0],  # elements below E4M3's subnormals
    ]
    check_against_oracle(torch.tensor(rows, dtype=torch.float32).to(torch.bfloat16))


def test_a_non_finite_block_is_nan_and_stays_in_its_block():
    x = torch.randn(3, 2 * BLOCK)
    x[0, 5] = float("nan")
    x[1, BLOCK + 3] = float("inf")
    x[2, 0] = float("-inf")
    elements, scales = quantize_mxfp8(x)
    assert scales.tolist() == [[SCALE_NAN, scales[0, 1].item()], [scales[1, 0].item(), SCALE_NAN], [SCALE_NAN, scales[2, 1].item()]]
    assert SCALE_NAN not in (scales[0, 1].item(), scales[1, 0].item(), scales[2, 1].item())
    back = dequantize_mxfp8(elements, scales)
    assert back[0, :BLOCK].isnan().all() and back[0, BLOCK:].isfinite().all()
    assert back[1, BLOCK:].isnan().all() and back[1, :BLOCK].isfinite().all()
    check_against_oracle(x)


def test_round_trip_error_is_within_e4m3_precision():
    x = torch.randn(64, 8 * BLOCK, dtype=torch.float64) * torch.exp2(torch.randint(-20, 20, (64, 1))).double()
    back = fake_quantize_mxfp8(x.float()).double()
    blocks, back_blocks = x.reshape(-1, BLOCK), back.reshape(-1, BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    # E4M3 keeps 3 mantissa bits: half an ulp is 2^-4 of the value; values below 2^-6 of the block's
    # scale are subnormal there, with an absolute step of 2^-9 of it (scale <= 2·amax / 448)
    bound = torch.maximum(blocks.abs() * 2.0**-4, amax / 448 * 2 * 2.0**-10)
    assert ((back_blocks - blocks).abs() <= bound * (1 + 1e-12)).all()


def test_dequantize_decodes_fields():
    elements = torch.tensor([[0x38, 0xB8, 0x01, 0x7E] + [0] * (BLOCK - 4)], dtype=torch.uint8).view(torch.float8_e4m3fn)
    for byte, factor in [(127, 1.0), (130, 8.0), (0, 2.0**-127), (254, 2.0**127)]:
        got = dequantize_mxfp8(elements, torch.tensor([[byte]], dtype=torch.uint8))
        expected = torch.tensor([1.0, -1.0, 2.0**-9, 448.0], dtype=torch.float64) * factor  # 448·2^127 is past fp32: inf
        assert got[0, :4].tolist() == expected.float().tolist()
    assert dequantize_mxfp8(elements, torch.tensor([[SCALE_NAN]], dtype=torch.uint8)).isnan().all()


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda: quantize_mxfp8(torch.zeros(4, 48)), ValueError, "multiple of 32"),
        (lambda: quantize_mxfp8(torch.zeros(4, 32, dtype=torch.int32)), TypeError, "bf16, fp16 or fp32"),
        (lambda: dequantize_mxfp8(torch.zeros(2, 32), torch.zeros(2, 1, dtype=torch.uint8)), TypeError, "float8_e4m3fn"),
        (lambda: dequantize_mxfp8(torch.zeros(2, 32).to(torch.float8_e4m3fn), torch.zeros(2, 1)), TypeError, "uint8"),
        (lambda: dequantize_mxfp8(torch.zeros(2, 64).to(torch.float8_e4m3fn), torch.zeros(2, 1, dtype=torch.uint8)), ValueError, r"\(2, 2\)"),
    ],
)
def test_bad_arguments_raise(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize(
    "x,error,match",
    [
        (torch.zeros(4, 64, dtype=torch.bfloat16), ValueError, "expected a CUDA tensor"),
        (torch.zeros(4, 64), TypeError, "expected dtype bfloat16"),
        (torch.zeros(4, 48, dtype=torch.bfloat16), ValueError, "multiple of 32"),
        (torch.zeros(64, 4, dtype=torch.bfloat16).T, ValueError, "contiguous"),
    ],
)
def test_the_kernel_op_refuses_bad_input_before_any_launch(x, error, match):
    from mok.ops import quantize_mxfp8 as quantize_on_gpu

    with pytest.raises(error, match=match):
        quantize_on_gpu(x)


def test_the_dequantizer_op_refuses_bad_input_before_any_launch():
    from mok.ops import dequantize_mxfp8 as dequantize_on_gpu

    elements = torch.zeros(4, 64).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="expected a CUDA tensor"):
        dequantize_on_gpu(elements, torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        dequantize_on_gpu(torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 32"):
        dequantize_on_gpu(torch.zeros(4, 40).to(torch.float8_e4m3fn), torch.zeros(4, 1, dtype=torch.uint8))
