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


@pytest.mark.parametrize("width", [16, 48, 2064, 1040])
def test_a_partial_last_block_is_scaled_by_the_values_it_holds(width):
    """Rows 16 values past whole blocks (a multiple of 16: 16-byte E4M3 rows): ceil(width / 32)
    scales a row, the last block's scale and elements the float64 oracle's for its 16 values alone
    (zeros past the row raise no maximum), the whole blocks as ever; back through the dequantizer,
    each value its element times its block's scale. Every magnitude, the partial block's own
    largest value the row's largest or smallest, and a NaN only in a partial block."""
    g = torch.Generator().manual_seed(width)
    rows = 6
    magnitudes = torch.exp2(torch.randint(-30, 30, (rows, -(-width // BLOCK)), generator=g).float())
    x = torch.randn(rows, width, generator=g) * magnitudes.repeat_interleave(BLOCK, dim=1)[:, :width]
    x[1, -16:] *= 1e6
    x[2, -16:] *= 1e-6
    x[3, -3] = float("nan")
    x = x.to(torch.bfloat16)
    elements, scales = quantize_mxfp8(x)
    assert elements.shape == x.shape and scales.shape == (rows, -(-width // BLOCK))
    for r in range(rows):
        for c in range(scales.shape[1]):
            values = x[r, c * BLOCK: (c + 1) * BLOCK].double().numpy()
            scale, codes = oracle(values)
            assert scales[r, c].item() == scale, (r, c)
            assert elements[r, c * BLOCK: (c + 1) * BLOCK].view(torch.uint8).tolist() == codes[: len(values)], (r, c)
    assert scales[3, -1].item() == SCALE_NAN and (scales[[0, 1, 2, 4, 5]] != SCALE_NAN).all()
    back = dequantize_mxfp8(elements, scales)
    factor = torch.exp2(scales.double() - 127).repeat_interleave(BLOCK, dim=1)[:, :width]
    finite = scales.repeat_interleave(BLOCK, dim=1)[:, :width] != SCALE_NAN
    assert torch.equal(back.double()[finite], (elements.double() * factor)[finite]) and back[~finite].isnan().all()


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
        (lambda: quantize_mxfp8(torch.zeros(4, 40)), ValueError, r"multiple of 16 \(16-byte E4M3 rows"),
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
        (torch.zeros(4, 40, dtype=torch.bfloat16), ValueError, "multiple of 16"),
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
    with pytest.raises(ValueError, match="multiple of 16"):
        dequantize_on_gpu(torch.zeros(4, 40).to(torch.float8_e4m3fn), torch.zeros(4, 2, dtype=torch.uint8))


@pytest.mark.parametrize("shape", [(300, 8), (2, 128, 4), (3, 256, 12), (130, 3), (2, 129, 5), (40, 90)])
def test_mma_scale_layout_puts_each_scale_where_the_ptx_isa_says(shape):
    """Every scale lands at the byte the block-scaled MMA's layout gives it (a 512-byte chunk per
    128 rows and 4 blocks, K's chunks innermost; in a chunk (r % 32)·16 + (r // 32)·4 + c),
    checked position by position; rows past the end, and blocks past a row's last where K is no
    multiple of 128 (3 blocks: K = 80 or 96; 90 blocks: gpt-oss's 2880), hold scale 1 (127): a
    finite byte, since the MMA multiplies it by the zeros TMA loads past K (NaN's 0xFF would not do)."""
    from mok.mxfp8 import mma_scale_layout

    scales = torch.randint(0, 255, shape, dtype=torch.uint8)
    *lead, rows, blocks = shape
    chunks, k_chunks = -(-rows // 128), -(-blocks // 4)
    got = mma_scale_layout(scales)
    assert got.shape == (*lead, chunks, k_chunks, 512) and got.dtype == torch.uint8
    flat_in = scales.reshape(-1, rows, blocks)
    flat_out = got.reshape(-1, chunks * k_chunks * 512)
    for m in range(flat_in.shape[0]):
        for r in range(chunks * 128):
            for c in range(k_chunks * 4):
                at = ((r // 128) * k_chunks + c // 4) * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4
                expected = flat_in[m, r, c].item() if r < rows and c < blocks else 127
                assert flat_out[m, at].item() == expected, (m, r, c)


def test_mma_scale_layout_is_the_layout_the_sm100_kernel_reads():
    """The same placement as CuTe's own scale-factor layout (cutlass.utils.blockscaled_layout
    .tile_atom_to_shape_SF, what the SM100 MXFP8 GEMM's TMA reads), offset by offset, for
    two 256 x 512 operands (experts): the kernel and the host agree on where each scale lives."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.blockscaled_layout as blockscaled_layout

    from mok.mxfp8 import mma_scale_layout
    from mok.runtime.arch import dsl_target

    rows, k, experts = 256, 512, 2
    offsets = {}

    @cute.jit
    def layout_offsets():
        layout = blockscaled_layout.tile_atom_to_shape_SF((rows, k, experts), 32)
        for e in cutlass.range_constexpr(experts):
            for r in cutlass.range_constexpr(rows):
                for c in cutlass.range_constexpr(k // 32):
                    offsets[(e, r, c)] = cute.crd2idx((r, c * 32, e), layout)

    with dsl_target("sm_100a"):
        cute.compile(layout_offsets)
    scales = torch.randint(0, 255, (experts, rows, k // 32), dtype=torch.uint8)
    flat = mma_scale_layout(scales).reshape(-1)
    assert len(offsets) == experts * rows * k // 32
    for (e, r, c), at in offsets.items():
        assert flat[int(at)].item() == scales[e, r, c].item(), (e, r, c)


def test_mma_scale_layout_refuses_what_it_cannot_lay_out():
    from mok.mxfp8 import mma_scale_layout

    with pytest.raises(TypeError, match="uint8"):
        mma_scale_layout(torch.zeros(128, 8))
    with pytest.raises(TypeError, match="uint8"):
        mma_scale_layout(torch.zeros(8, dtype=torch.uint8))


def test_the_mxfp8_gemm_op_refuses_bad_input_before_any_launch():
    from mok.ops import grouped_gemm

    e4m3 = torch.float8_e4m3fn
    a, a_scales = torch.zeros(200, 256).to(e4m3), torch.zeros(2, 2, 512, dtype=torch.uint8)
    b, b_scales = torch.zeros(3, 128, 256).to(e4m3), torch.zeros(3, 1, 2, 512, dtype=torch.uint8)
    tiles = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        grouped_gemm((a.to(torch.bfloat16), a_scales), (b, b_scales), tiles)
    with pytest.raises(ValueError, match=r"a scales: expected shape \[2, 2, 512\]"):
        grouped_gemm((a, a_scales[:1]), (b, b_scales), tiles)
    with pytest.raises(ValueError, match=r"b scales: expected shape \[3, 1, 2, 512\]"):
        grouped_gemm((a, a_scales), (b, b_scales[:, :, :1]), tiles)
    a200, b200 = (torch.zeros(200, 200).to(e4m3), a_scales), (torch.zeros(3, 128, 200).to(e4m3), b_scales)
    with pytest.raises(ValueError, match="a: expected K a multiple of 16 with MXFP8 operands"):  # (16-byte E4M3 rows)
        grouped_gemm(a200, b200, tiles)
    # widths that are multiples of 16: the scales ceil()'d to whole chunks (N = 144: two chunks of rows), k_split's A a chunk
    # range per half (K = 2 x 144: 2 x 2 chunks, where ceil(288 / 128) is 3)
    a144, b144 = (a[:, :144].contiguous(), a_scales), (torch.zeros(3, 144, 144).to(e4m3), torch.zeros(3, 2, 2, 512, dtype=torch.uint8))
    with pytest.raises(ValueError, match="expected a CUDA tensor"):  # (every shape accepted: the device is what is refused)
        grouped_gemm(a144, b144, tiles)
    a288 = torch.zeros(200, 288).to(e4m3)
    with pytest.raises(ValueError, match=r"a scales: expected shape \[2, 4, 512\], got \[2, 3, 512\]"):
        grouped_gemm((a288, torch.zeros(2, 3, 512, dtype=torch.uint8)), b144, tiles, b2=b144, k_split=True)
    with pytest.raises(ValueError, match="expected a CUDA tensor"):
        grouped_gemm((a288, torch.zeros(2, 4, 512, dtype=torch.uint8)), b144, tiles, b2=b144, k_split=True)
    with pytest.raises(TypeError, match=r"a, b, b2: expected MXFP8 \(elements, scales\) pairs for all of them, or bf16 tensors for all"):
        grouped_gemm((a, a_scales), (b, b_scales), tiles, b2=b)
    with pytest.raises(ValueError, match="h_out: only with the SwiGLU epilogue"):
        grouped_gemm((a, a_scales), (b, b_scales), tiles, h_out=torch.zeros(200, 256, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="expected a CUDA tensor"):
        grouped_gemm((a, a_scales), (b, b_scales), tiles)


def test_the_quantizer_op_refuses_an_mma_scale_order_it_cannot_write():
    from mok.ops import quantize_mxfp8 as quantize_on_gpu

    with pytest.raises(ValueError, match="scale_order: expected 'rows' or 'mma'"):
        quantize_on_gpu(torch.zeros(4, 128, dtype=torch.bfloat16), scale_order="cols")
    with pytest.raises(ValueError, match=r"expected \[R, n\], or a stack \[E, N, n\] \(whole, one segment\), for scale_order='mma', got shape \(2, 2, 4, 128\)"):
        quantize_on_gpu(torch.zeros(2, 2, 4, 128, dtype=torch.bfloat16), scale_order="mma")
    with pytest.raises(ValueError, match=r"segments: expected 1, or 2 with halves of a multiple of 16 values, got 2 for shape \(4, 48\)"):
        quantize_on_gpu(torch.zeros(4, 48, dtype=torch.bfloat16), scale_order="mma", segments=2)


def test_the_mxfp8_forward_refuses_bad_input_before_any_launch():
    """The MXFP8 forward (its plan on sm_100a; the pipeline quantizes the bf16 weights itself)
    checks the call on any device, then refuses CPU data; Hopper's plan refuses it up front."""
    from mok import pipeline
    from mok.config import MoKConfig
    from mok.plan import plan_for

    num_tokens, hidden, inter, experts, topk = 8, 256, 128, 4, 2
    x = torch.zeros(num_tokens, hidden, dtype=torch.bfloat16)
    idx = torch.zeros(num_tokens, topk, dtype=torch.int32)
    idx[:, 1] = 1
    w = torch.rand(num_tokens, topk)
    weights = (torch.zeros(experts, inter, hidden, dtype=torch.bfloat16), torch.zeros(experts, inter, hidden, dtype=torch.bfloat16),
               torch.zeros(experts, hidden, inter, dtype=torch.bfloat16))
    config = MoKConfig(hidden, inter, experts, topk, precision="mxfp8")
    plan = plan_for(config, "sm_100a")
    with pytest.raises(TypeError, match="w_gate: expected a torch.Tensor, got NoneType"):
        pipeline.forward(plan, x, idx, w, (None, None, None))
    with pytest.raises(TypeError, match="x: expected dtype bfloat16"):
        pipeline.forward(plan, x.float(), idx, w, weights)
    with pytest.raises(ValueError, match=r"topk_w: expected shape \[8, 2\]"):
        pipeline.forward(plan, x, idx, w[:, :1], weights)
    with pytest.raises(ValueError, match="x: expected a CUDA tensor, got one on cpu"):
        pipeline.forward(plan, x, idx, w, weights)
    with pytest.raises(NotImplementedError, match=r"precision='mxfp8': needs block-scaled MMAs \(sm_100a, sm_103a: SM100\), got sm_90a"):
        plan_for(config, "sm_90a")


@pytest.mark.parametrize("shape", [(300, 8), (2, 128, 4), (3, 256, 12), (1, 4)])
def test_rows_scale_layout_undoes_mma_scale_layout(shape):
    from mok.mxfp8 import mma_scale_layout, rows_scale_layout

    scales = torch.randint(0, 255, shape, dtype=torch.uint8)
    assert torch.equal(rows_scale_layout(mma_scale_layout(scales), shape[-2]), scales)


@pytest.mark.parametrize("rows,width", [(300, 2880), (130, 80), (1, 2064), (129, 1040)])
def test_rows_scale_layout_drops_the_padding_blocks_of_a_width_128_does_not_divide(rows, width):
    """Rows of a width 128 does not divide: the MMA order holds ceil(width / 128) chunks along K,
    the blocks past ceil(width / 32) padded with 127; given the width, the way back returns the
    row's scales alone."""
    from mok.mxfp8 import mma_scale_layout, rows_scale_layout

    scales = torch.randint(0, 255, (rows, -(-width // BLOCK)), dtype=torch.uint8)
    ordered = mma_scale_layout(scales)
    assert ordered.shape == (-(-rows // 128), -(-width // 128), 512)
    assert torch.equal(rows_scale_layout(ordered, rows, width), scales)
    padding = rows_scale_layout(ordered, rows)[:, scales.shape[1]:]
    assert padding.shape[1] == -scales.shape[1] % 4 and (padding == 127).all()
    with pytest.raises(ValueError, match=rf"width: expected one of {ordered.shape[1]} chunks of 128 along K, got {width + 128}"):
        rows_scale_layout(ordered, rows, width + 128)


def test_rows_scale_layout_refuses_what_is_not_in_the_mma_order():
    from mok.mxfp8 import rows_scale_layout

    with pytest.raises(TypeError, match=r"uint8 \[..., chunks, K // 128, 512\]"):
        rows_scale_layout(torch.zeros(2, 3, 256, dtype=torch.uint8), 200)
    with pytest.raises(ValueError, match=r"rows: expected 0..256 for 2 chunks of 128, got 300"):
        rows_scale_layout(torch.zeros(2, 3, 512, dtype=torch.uint8), 300)


def test_the_mxfp8_backward_refuses_bad_input_before_any_launch():
    from mok import pipeline
    from mok.config import MoKConfig
    from mok.pipeline import ForwardResult
    from mok.plan import plan_for

    num_tokens, hidden, inter, experts, topk = 8, 256, 128, 4, 2
    x = torch.zeros(num_tokens, hidden, dtype=torch.bfloat16)
    idx = torch.zeros(num_tokens, topk, dtype=torch.int32)
    idx[:, 1] = 1
    w = torch.rand(num_tokens, topk)
    gate, down = torch.zeros(experts, inter, hidden, dtype=torch.bfloat16), torch.zeros(experts, hidden, inter, dtype=torch.bfloat16)
    plan = plan_for(MoKConfig(hidden, inter, experts, topk, precision="mxfp8"), "sm_100a")
    saved = ForwardResult(out=None, schedule=None, h=None)
    with pytest.raises(TypeError, match=r"weights: expected \(w_gate, w_up, w_down\), got NoneType"):
        pipeline.backward(plan, x, x, idx, w, None, None, saved)
    with pytest.raises(ValueError, match=r"dout: expected shape \[8, 256\]"):
        pipeline.backward(plan, x[:4], x, idx, w, (gate, gate, down), None, saved)
    with pytest.raises(ValueError, match=r"saved: the forward did not keep h; call it with save=True"):
        pipeline.backward(plan, x, x, idx, w, (gate, gate, down), None, saved)
    with pytest.raises(ValueError, match="w_gate"):  # gate in the backward's orientation [E, H, I]: refused, not transposed
        pipeline.backward(plan, x, x, idx, w, (down, gate, down), None, saved)


def test_the_column_quantizer_op_refuses_bad_input_before_any_launch():
    from mok.ops import quantize_mxfp8_columns

    with pytest.raises(ValueError, match=r"multiple of 32, got shape \(40, 64\)"):
        quantize_mxfp8_columns(torch.zeros(40, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"multiple of 128, got shape \(64, 64\)"):
        quantize_mxfp8_columns(torch.zeros(64, 64, dtype=torch.bfloat16), scale_order="mma")
    with pytest.raises(ValueError, match="2-d"):
        quantize_mxfp8_columns(torch.zeros(2, 64, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="expected a CUDA tensor"):
        quantize_mxfp8_columns(torch.zeros(64, 64, dtype=torch.bfloat16))


def test_the_mxfp8_weight_gradient_op_refuses_bad_input_before_any_launch():
    from mok.ops import weight_grad

    e4m3 = torch.float8_e4m3fn
    a = (torch.zeros(256, 128).to(e4m3), torch.zeros(1, 2, 512, dtype=torch.uint8))
    b = (torch.zeros(256, 256).to(e4m3), torch.zeros(2, 2, 512, dtype=torch.uint8))
    offsets = torch.tensor([0, 128, 256], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"b scales: expected shape \[2, 2, 512\]"):
        weight_grad(a, (b[0], b[1][:1]), offsets)
    with pytest.raises(ValueError, match=r"\(R, M, N\): expected M, N multiples of 16, R of 128, got \(200, 128, 256\)"):
        weight_grad((a[0][:200], a[1]), (b[0][:200], b[1]), offsets)
    with pytest.raises(ValueError, match=r"\(R, M, N\): expected M, N multiples of 16, R of 128, got \(256, 136, 256\)"):
        weight_grad((torch.zeros(256, 136).to(e4m3), a[1]), b, offsets)
    with pytest.raises(ValueError, match=r"\(R, M, N\): expected M a multiple of 32, N of 16, R of 128, got \(256, 144, 256\)"):
        weight_grad((torch.zeros(256, 144).to(e4m3), a[1]), b, offsets, split_out=True)  # (each half 16-byte rows)
    # M = 2 x 144 split out: each half's two chunks (ceil(288 / 128) would be 3)
    a288 = torch.zeros(256, 288).to(e4m3)
    with pytest.raises(ValueError, match=r"a scales: expected shape \[4, 2, 512\], got \[3, 2, 512\]"):
        weight_grad((a288, torch.zeros(3, 2, 512, dtype=torch.uint8)), b, offsets, split_out=True)
    with pytest.raises(ValueError, match="expected a CUDA tensor"):
        weight_grad((a288, torch.zeros(4, 2, 512, dtype=torch.uint8)), b, offsets, split_out=True)
    with pytest.raises(ValueError, match="expected a CUDA tensor"):
        weight_grad(a, b, offsets)


@pytest.mark.parametrize("hidden,inter", [(2880, 2880), (2064, 1040)])
def test_mxfp8_emulated_plans_widths_that_are_multiples_of_16(hidden, inter):
    """precision="mxfp8_emulated" takes widths that are multiples of 16 (gpt-oss's 2880 = 22.5 x 128;
    2064 and 1040 end in half a block of 32): its plan lists the conversions of static widths, the
    rows in use (dh: each half blocked on its own), each weight stack chunked per expert where N is
    no multiple of 128, and their way back; a multiple of 8 that is not of 16 is refused naming the
    rule; the same as bf16 rows and at whole widths the kernels that do not know the width."""
    from mok.config import MoKConfig
    from mok.plan import Plan

    plan = Plan(MoKConfig(hidden, inter, 32, 4, precision="mxfp8_emulated", saved_h_format="mxfp8"), "sm_90a")
    conversions = {(v.name, tuple(sorted(v.config.items()))) for v in plan.variants() if "mxfp8" in v.name}
    key = lambda name, **config: (name, tuple(sorted(config.items())))  # noqa: E731
    for n, k in ((inter, hidden), (hidden, inter)):  # [E, N, K] weights, forward and transposed (N % 128 != 0 here)
        assert key("quantize_mxfp8", mma_order=True, width=k, matrix_rows=n) in conversions
        assert key("quantize_mxfp8", bounded=True, mma_order=True, width=k) in conversions
        assert key("dequantize_mxfp8", **({} if k % 32 == 0 else dict(width=k))) in conversions
    assert key("quantize_mxfp8", bounded=True, mma_order=True, width=inter, segments=2) in conversions  # dh
    assert key("dequantize_mxfp8", bounded=True, **({} if inter % 32 == 0 else dict(width=inter, segments=2))) in conversions
    assert ("quantize_mxfp8", (("bounded", True),)) in conversions  # (saved h [R, 2I]: 2I whole blocks of 32)
    for width in (2056, 2072):  # multiples of 8, not of 16
        with pytest.raises(ValueError, match=r"precision='mxfp8_emulated': expected widths that are multiples of 16 \(16-byte E4M3 rows\), got "
                                             rf"{{'hidden': {hidden}, 'intermediate': {width}}}"):
            MoKConfig(hidden, width, 32, 4, precision="mxfp8_emulated")
    whole = Plan(MoKConfig(7168, 2048, 32, 4, precision="mxfp8_emulated"), "sm_90a").variants()
    assert all("width" not in v.config for v in whole if "mxfp8" in v.name)
