"""FP8 with block scales (DeepSeek-V3's recipe, mok.fp8_block) on the CPU: the quantization rule,
the scales' layouts, the float64 GEMM reference, and the op's checks of such operands before any
launch. (The Hopper kernel: tests/test_fp8_block_gpu.py; its PTX: tests/test_kernels_ptx.py.)"""

import re

import pytest
import torch

from mok import fp8_block as fp8
from mok import ops
from mok.kernels.variants import grouped_gemm_variant


def test_row_blocks_scale_by_their_largest_magnitude_and_round_to_e4m3():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 512, generator=g) * torch.logspace(-3, 3, 37)[:, None]
    x[5, 128:256] = 0.0  # an all-zero block
    q, scales = fp8.quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (4, 37) and scales.dtype == torch.float32
    blocks = x.reshape(37, 4, 128)
    assert torch.equal(scales.T, torch.where(blocks.abs().amax(-1) > 0, blocks.abs().amax(-1) / 448, torch.ones(37, 4)))
    assert scales[1, 5] == 1 and not q[5, 128:256].float().any()
    back = fp8.dequantize_rows(q, scales)
    per_block_scale = scales.double().T.repeat_interleave(128, 1)
    # E4M3: 3 mantissa bits (half an ulp: 2^-4 relative), subnormals down to 2^-9 of the scale
    assert ((back - x.double()).abs() <= torch.maximum(x.double().abs() * 2**-4, per_block_scale * 2**-10)).all()
    assert q.float().abs().max() <= 448 and (q.float().abs().reshape(37, 4, 128).amax(-1)[blocks.abs().amax(-1) > 0] == 448).all()


def test_weight_blocks_are_128_by_128_and_power_of_two_scales_are_exact():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(3, 256, 384, generator=g)
    w[1, 128:, :128] *= 1000  # one block much larger: only its scale changes
    q, scales = fp8.quantize_weights(w)
    assert q.shape == w.shape and scales.shape == (3, 2, 3)
    blocks = w.reshape(3, 2, 128, 3, 128).transpose(2, 3).abs().amax((-1, -2))
    assert torch.equal(scales, blocks / 448)
    assert scales[1, 1, 0] > 500 * scales[1, 0, 0]
    q2, s2 = fp8.quantize_weights(w, power_of_two=True)
    assert torch.equal(s2, torch.exp2(torch.log2(s2).round())) and (s2 >= blocks / 448).all() and (s2 < 2 * blocks / 448).all()
    # x / scale is exact for a power of two: the elements are x's own values rounded once to E4M3
    assert torch.equal(q2.float(), (w / s2.repeat_interleave(128, 1).repeat_interleave(128, 2)).to(torch.float8_e4m3fn).float())
    assert ((fp8.dequantize_weights(q, scales) - w.double()).norm() / w.double().norm()) < 0.04


def test_partial_last_blocks_scale_by_the_values_there_are():
    """Widths 128 does not divide (multiples of 16): a row's last block holds its last K % 128
    values, scaled by their own largest magnitude; with segments=2 each half is blocked on its own
    (the second half's blocks start at its first value); a weight's last row and column blocks
    likewise; elements and scales as a loop over the blocks written out here computes them."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(9, 2 * 208, generator=g) * torch.logspace(-2, 2, 9)[:, None]

    def block_scale(values):
        amax = values.abs().amax(-1).float()
        return torch.where(amax > 0, fp8.fp32_quotient(amax, 448.0), torch.ones_like(amax))

    for segments, bounds in ((1, [(0, 128), (128, 256), (256, 384), (384, 416)]), (2, [(0, 128), (128, 208), (208, 336), (336, 416)])):
        q, scales = fp8.quantize_rows(x, segments=segments)
        assert q.shape == x.shape and scales.shape == (len(bounds), 9)
        for b, (lo, hi) in enumerate(bounds):
            scale = block_scale(x[:, lo:hi])
            assert torch.equal(scales[b], scale), (segments, b)
            factor = torch.where(scale == 1, torch.ones_like(scale), fp8.fp32_quotient(448.0, x[:, lo:hi].abs().amax(-1).float()))
            assert torch.equal(q[:, lo:hi].float(), (x[:, lo:hi] * factor[:, None]).to(torch.float8_e4m3fn).float())
        back = fp8.dequantize_rows(q, scales, segments)
        assert ((back - x.double()).norm() / x.double().norm()) < 0.04
    w = torch.randn(2, 144, 176, generator=g)
    q, scales = fp8.quantize_weights(w)
    assert q.shape == w.shape and scales.shape == (2, 2, 2)
    for e in range(2):
        for i, (r0, r1) in enumerate(((0, 128), (128, 144))):
            for j, (c0, c1) in enumerate(((0, 128), (128, 176))):
                assert scales[e, i, j] == block_scale(w[e, r0:r1, c0:c1].reshape(1, -1))[0]
    assert ((fp8.dequantize_weights(q, scales) - w.double()).norm() / w.double().norm()) < 0.04


def test_gemm_reference_is_the_product_of_the_dequantized_operands_per_expert():
    g = torch.Generator().manual_seed(2)
    a = fp8.quantize_rows(torch.randn(300, 256, generator=g))
    b = fp8.quantize_weights(torch.randn(3, 128, 256, generator=g))
    experts = torch.randint(-1, 3, (300,), generator=g)
    got = fp8.block_scaled_gemm_reference(a, b, experts)
    rows, weights = fp8.dequantize_rows(*a), fp8.dequantize_weights(*b)
    for r in range(0, 300, 37):
        want = rows[r] @ weights[experts[r]].T if experts[r] >= 0 else torch.zeros(128, dtype=torch.float64)
        assert torch.allclose(got[r], want, rtol=1e-12, atol=1e-12)


def test_op_checks_block_scaled_operands_before_any_launch():
    a = fp8.quantize_rows(torch.randn(256, 256))
    b = fp8.quantize_weights(torch.randn(2, 128, 256))
    tiles = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"a scales: expected shape \[2, 256\], got \[256, 2\]"):
        ops.grouped_gemm((a[0], a[1].T.contiguous()), b, tiles)
    with pytest.raises(ValueError, match=r"b: expected N a positive multiple of 16 with FP8 block-scaled operands, got N=72"):
        ops.grouped_gemm(a, (b[0][:, :72].contiguous(), b[1][:, :1].contiguous()), tiles)
    wide = fp8.quantize_weights(torch.randn(2, 144, 256))  # (N = 144: a whole block and a partial one)
    with pytest.raises(ValueError, match=r"b scales: expected shape \[2, 2, 2\], got \[2, 1, 2\]"):
        ops.grouped_gemm(a, (wide[0], b[1]), tiles)
    with pytest.raises(ValueError, match="FP8 block-scaled operands: K-major B .*, the persistent kernel"):
        ops.grouped_gemm(a, b, tiles, persistent=False)
    with pytest.raises(ValueError, match=r"a: expected K a positive multiple of 16 with FP8 block-scaled operands \(16-byte rows\), got K=72"):
        ops.grouped_gemm((torch.zeros(256, 72, dtype=torch.float8_e4m3fn), torch.ones(1, 256)), b, tiles)
    halves = fp8.quantize_rows(torch.randn(256, 2 * 144), segments=2)  # (k_split: each half of K blocked on its own)
    assert halves[1].shape == (4, 256)
    with pytest.raises(ValueError, match=r"a scales: expected shape \[4, 256\], got \[3, 256\]"):
        ops.grouped_gemm((halves[0], fp8.quantize_rows(torch.randn(256, 288))[1]), fp8.quantize_weights(torch.randn(2, 128, 144)), tiles,
                         b2=fp8.quantize_weights(torch.randn(2, 128, 144)), k_split=True)


def test_dequantizer_checks_its_operands_before_any_launch():
    """ops.dequantize_fp8_rows: E4M3 rows with K a multiple of 16 and their fp32 scales [ceil(K / 128), R];
    valid operands go on to the launch checks (which refuse CPU data)."""
    q, scales = fp8.quantize_rows(torch.randn(256, 272))
    assert scales.shape == (3, 256)
    with pytest.raises(TypeError, match="elements: expected dtype float8_e4m3fn, got bfloat16"):
        ops.dequantize_fp8_rows(q.bfloat16(), scales)
    with pytest.raises(ValueError, match=r"elements: expected \[R, K\] with K a positive multiple of 16"):
        ops.dequantize_fp8_rows(q[:, :264].contiguous(), scales)
    with pytest.raises(ValueError, match=r"scales: expected shape \[3, 256\], got \[256, 3\]"):
        ops.dequantize_fp8_rows(q, scales.T.contiguous())
    with pytest.raises(ValueError, match="elements: expected a CUDA tensor"):
        ops.dequantize_fp8_rows(q, scales)


def test_two_block_buffers_and_deep_turns_are_refused_where_the_kernel_has_none():
    a = fp8.quantize_rows(torch.randn(256, 256))
    b = fp8.quantize_weights(torch.randn(2, 128, 256))
    tiles = torch.zeros(2, dtype=torch.int32)
    rule = r"block_buffers: expected 1, or 2 with operand='e4m3_block', got "
    with pytest.raises(ValueError, match=rule + "2 with operand='bf16'"):
        ops.grouped_gemm(torch.zeros(256, 256, dtype=torch.bfloat16), torch.zeros(2, 128, 256, dtype=torch.bfloat16), tiles, block_buffers=2)
    with pytest.raises(ValueError, match=rule + "3 with operand='e4m3_block'"):
        grouped_gemm_variant(256, 256, operand="e4m3_block", epilogue="swiglu_bwd", topk=2, block_buffers=3)
    with pytest.raises(ValueError, match=rule + "2 with operand='bf16'"):
        ops.swiglu_backward_gemm(torch.zeros(256, 256, dtype=torch.bfloat16), torch.zeros(2, 256, 128, dtype=torch.bfloat16), tiles,
                                 torch.zeros(256, 256, dtype=torch.bfloat16), block_buffers=2)
    turn_rule = r"deep_turn: expected 0, or an even count >= 2 with block_buffers=2, got "
    with pytest.raises(ValueError, match=turn_rule + "8 with block_buffers=1"):
        ops.grouped_gemm(a, b, tiles, b2=b, block_buffers=1, deep_turn=8)
    for odd in (1, 3):
        with pytest.raises(ValueError, match=turn_rule + f"{odd} with block_buffers=2"):
            ops.grouped_gemm(a, b, tiles, deep_turn=odd)


def test_fp8_weight_grad_checks_its_operands_before_any_launch():
    """ops.weight_grad on FP8 block-scaled transposes: the pair forms, shapes, the kernel's options."""
    def operand(mn, rows, scale_rows=None):
        return (torch.zeros(mn, rows, dtype=torch.float8_e4m3fn), torch.ones((scale_rows or rows // 128), mn))

    offsets = torch.tensor([0, 128, 256], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"b: expected \[N, R\] with R=256 like a's \[M, R\]"):
        ops.weight_grad(operand(256, 256), operand(128, 384), offsets)
    with pytest.raises(ValueError, match=r"expected M a multiple of 16, N of 16 and R of 128, got \(256, 136, 256\)"):
        ops.weight_grad(operand(256, 256), operand(136, 256), offsets)
    with pytest.raises(ValueError, match=r"expected M a multiple of 32, N of 16 and R of 128, got \(272, 128, 256\)"):
        ops.weight_grad(operand(272, 256), operand(128, 256), offsets, split_out=True)
    with pytest.raises(ValueError, match=r"a scales: expected shape \[2, 256\], got \[3, 256\]"):
        ops.weight_grad(operand(256, 256, scale_rows=3), operand(128, 256), offsets)
    with pytest.raises(ValueError, match="the persistent kernel, no ping-pong, tile_n 128"):
        ops.weight_grad(operand(256, 256), operand(128, 256), offsets, pingpong=True)
    with pytest.raises(ValueError, match="b as an \\(elements, float32 scales\\) pair too"):
        ops.weight_grad(operand(256, 256), torch.zeros(128, 256, dtype=torch.float8_e4m3fn), offsets)
    with pytest.raises(ValueError, match="expected a CUDA tensor"):
        ops.weight_grad(operand(256, 256), operand(128, 256), offsets)


def test_quantize_ops_check_their_input_before_any_launch():
    with pytest.raises(ValueError, match=r"x: expected \[R, K\] with K a positive multiple of 16 \(16-byte E4M3 rows\), got \[8, 200\]"):
        ops.quantize_fp8_rows(torch.zeros(8, 200, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"w: expected \[E, N, K\] with N and K positive multiples of 16, got \[2, 72, 128\]"):
        ops.quantize_fp8_weights(torch.zeros(2, 72, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"x: expected \[R, K\] with K a positive multiple of 32 \(16-byte E4M3 rows in each half\), got \[8, 208\]"):
        ops.quantize_fp8_rows(torch.zeros(8, 208, dtype=torch.bfloat16), segments=2)
    with pytest.raises(ValueError, match=r"scale_order='mma': E8M0 scales need power_of_two=True, got power_of_two=False"):
        ops.quantize_fp8_rows(torch.zeros(8, 272, dtype=torch.bfloat16), scale_order="mma")
    with pytest.raises(ValueError, match="expected a CUDA tensor"):
        ops.quantize_fp8_rows(torch.zeros(8, 256, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"rows_out: the gathered rows' bf16 copy, given with row_source only"):
        ops.quantize_fp8_rows(torch.zeros(8, 256, dtype=torch.bfloat16), rows_out=torch.zeros(8, 256, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"rows_out: expected shape \[6, 256\], got \[8, 256\]"):
        ops.quantize_fp8_rows(torch.zeros(8, 256, dtype=torch.bfloat16), row_source=torch.zeros(6, dtype=torch.int32),
                              rows_out=torch.zeros(8, 256, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"x: expected \[R, M\] rows with R a multiple of 128 and M a positive multiple of 16, got R=200, M=256"):
        ops.quantize_fp8_columns(torch.zeros(200, 256, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"got R=300, M=256 \(R: row_source\)"):
        ops.quantize_fp8_columns(torch.zeros(8, 256, dtype=torch.bfloat16), row_source=torch.zeros(300, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"got R=256, M=200"):
        ops.quantize_fp8_columns(torch.zeros(256, 200, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match=r"row_source: expected dtype int32, got int64"):
        ops.quantize_fp8_columns(torch.zeros(8, 256, dtype=torch.bfloat16), row_source=torch.zeros(256, dtype=torch.int64))
    with pytest.raises(ValueError, match="expected a CUDA tensor"):
        ops.quantize_fp8_columns(torch.zeros(256, 256, dtype=torch.bfloat16))
    from mok.kernels.variants import quantize_fp8_block_variant

    with pytest.raises(ValueError, match="columns: rows \\(block_rows 1\\) in one segment \\(columns: two with mma_scales\\) only"):
        quantize_fp8_block_variant(256, 128, columns=True)
    with pytest.raises(ValueError, match=r"back: fp32 scales only \(E8M0 rows in the MMA order are MXFP8's"):
        quantize_fp8_block_variant(256, back=True, mma_scales=True)
    with pytest.raises(ValueError, match=r"segments: 1, or 2 with scale_order='mma' and M a multiple of 32, got 2 with "
                                         r"scale_order='rows', M=2880"):
        ops.quantize_fp8_columns(torch.zeros(256, 2880, dtype=torch.bfloat16), power_of_two=True, segments=2)


def test_fp8_block_on_sm100_runs_power_of_two_scales_on_the_block_scaled_mmas():
    """precision="fp8_block" on SM100: with power-of-two scales, the MXFP8 kernels (tcgen05
    block-scaled MMAs) on the same E4M3 elements, the scales quantized straight into E8M0 bytes in
    the MMAs' order; the rows gathered first; the weight gradients bf16; at EP the scattering MXFP8
    GEMMs, with biases their bias epilogues (the bf16 kernel's: the bias rows loaded, the scattered
    rows stored from registers); at widths 128 does not divide (gpt-oss's 2880) the same kernels,
    dh's rows blocked a half at a time, and with FP8 weight gradients dh's columns likewise; refused,
    naming the reason, with fp32 scales (compile-verified, never run)."""
    from test_kernels_ptx import count, ptxas_spill_bytes

    from mok.config import MoKConfig
    from mok.kernels import compiled_ptx
    from mok.kernels.variants import grouped_gemm_variant
    from mok.plan import Plan, refusal

    config = MoKConfig(2048, 768, 64, 8, precision="fp8_block", fp8_scales="power_of_two", saved_h_format="recompute")
    assert refusal(config, "sm_100a") is None and refusal(config, "sm_103a") is None
    variants = Plan(config, "sm_100a").variants()
    gemms = [v for v in variants if v.name == "grouped_gemm" and v.config.get("operand")]
    assert sorted((v.config["epilogue"], v.config["operand"]) for v in gemms) == [
        ("plain", "e4m3"), ("plain", "e4m3"), ("swiglu", "e4m3"), ("swiglu_bwd", "e4m3"), ("swiglu_save", "e4m3")]
    quantizers = [v.config for v in variants if v.name == "quantize_fp8_block"]
    assert quantizers and all(c.get("mma_scales") and c.get("power_of_two") for c in quantizers)
    assert not any(v.config.get("gather_a") for v in variants) and any(v.name == "gather" for v in variants)
    assert all(v.config.get("operand") is None for v in variants if v.name == "weight_grad")
    for v in gemms[:2]:
        ptx = compiled_ptx(v, "sm_100a")
        assert "kind::mxf8f6f4.block_scale" in ptx and "wgmma" not in ptx
    fields = dict(hidden=2048, intermediate=768, num_experts=64, topk=8, precision="fp8_block", fp8_scales="fp32")
    assert "fp8_scales='power_of_two'" in refusal(MoKConfig(**fields), "sm_100a")
    fp8_wgrads = MoKConfig(2048, 784, 64, 8, precision="fp8_block", fp8_scales="power_of_two", wgrad_format="fp8_block")
    assert refusal(fp8_wgrads, "sm_100a") is None
    columns = sorted((v.config["width"], v.config.get("segments", 1)) for v in Plan(fp8_wgrads, "sm_100a").variants()
                     if v.name == "quantize_fp8_block" and v.config.get("columns"))
    assert columns == [(784, 1), (1568, 2), (2048, 1)]  # (s·a's; dh's halves each starting a chunk; x's and dout's gathered)
    gpt_oss = MoKConfig(2880, 2880, 32, 4, precision="fp8_block", fp8_scales="power_of_two", ep_size=2, dispatch_format="fp8_block")
    assert refusal(gpt_oss, "sm_100a") is None
    rows = sorted((v.config["width"], v.config.get("segments", 1)) for v in Plan(gpt_oss, "sm_100a").variants()
                  if v.name == "quantize_fp8_block" and v.config["block_rows"] == 1)
    assert rows == [(2880, 1), (5760, 2)]  # (a's and dout's rows; dh a half at a time; x crosses quantized)
    ep = MoKConfig(2048, 768, 64, 8, ep_size=2, precision="fp8_block", fp8_scales="power_of_two", expert_bias=True)
    assert refusal(ep, "sm_100a") is None
    ep_gemms = {(v.config["epilogue"], v.config.get("scatter", False), v.config.get("bias", False)): v for v in Plan(ep, "sm_100a").variants()
                if v.name == "grouped_gemm" and v.config.get("operand") == "e4m3"}
    assert set(ep_gemms) == {("plain", True, True), ("plain", True, False), ("swiglu", False, True), ("swiglu_save", False, True),
                             ("swiglu_bwd", False, True)}  # (down with its bias, dx without: k_split)
    plain = compiled_ptx(grouped_gemm_variant(2048, 768, operand="e4m3", persistent=True), "sm_100a")  # (one GPU's down projection)
    for key, v in ep_gemms.items():
        ptx = compiled_ptx(v, "sm_100a")
        assert "kind::mxf8f6f4.block_scale" in ptx and count(r"\.local", ptx) == 0 and ptxas_spill_bytes(ptx, "sm_100a") in (None, 0), key
        if key[1]:  # scattered rows: 16-byte register stores (the TMA-stored plain epilogue has none)
            assert count(r"st\.global\.v4", ptx) > 0 and count(r"st\.global\.v4", plain) == 0, key
    twin = compiled_ptx(grouped_gemm_variant(768, 2048, epilogue="swiglu_save", operand="e4m3", persistent=True), "sm_100a")
    biased = compiled_ptx(ep_gemms[("swiglu_save", False, True)], "sm_100a")
    assert count(r"ld\.global", biased) > count(r"ld\.global", twin)  # (the bias rows)


@pytest.mark.parametrize("arch", ["sm_100a", "sm_103a"])
def test_fp8_weight_gradients_and_dispatch_on_sm100_take_the_mxfp8_kernels(arch):
    """wgrad_format="fp8_block" and dispatch_format="fp8_block" on SM100 (power-of-two scales): the
    weight gradients on the MXFP8 weight-gradient kernel (operand "e4m3": fresh, added into
    main_grad, dh's half at its row stride), fed by the column quantizer in the MMA order (each
    column's 128-row blocks as E8M0 bytes, the rows' own layout; x's and dout's gathered as
    quantized at one GPU, the pulled rows at EP); the dispatch writing the owner's scales as E8M0
    words in the MMA order, the backward's x rows back to bf16 by MXFP8's dequantizer; fp32 scales
    still refused, naming the rule. The new kernels compile (compile-checked, never run): the
    elements and scale words 4-byte stores, nothing in local memory, no spills."""
    from test_kernels_ptx import count, ptxas_spill_bytes

    from mok.config import MoKConfig
    from mok.kernels import compiled_ptx
    from mok.plan import plan_for, refusal

    base = dict(hidden=2048, intermediate=768, num_experts=64, topk=8, precision="fp8_block", fp8_scales="power_of_two",
                wgrad_format="fp8_block", fuse_wgrad_accumulation=True)
    one_gpu = plan_for(MoKConfig(**base), arch).variants()
    ep_config = MoKConfig(**base, ep_size=2, dispatch_format="fp8_block")
    assert refusal(ep_config, arch) is None
    ep = plan_for(ep_config, arch).variants()
    for variants, gathered_x in ((one_gpu, True), (ep, False)):
        wgrads = sorted((v.config["m"], v.config["n"], v.config["out_dtype"], v.config.get("split_out", False), v.config["a_stride"])
                        for v in variants if v.name == "weight_grad" and v.config.get("operand") == "e4m3")
        assert wgrads == [(768, 2048, "f32", False, 1536), (1536, 2048, "bf16", True, 1536), (1536, 2048, "f32", True, 1536),
                          (2048, 768, "bf16", False, 2048), (2048, 768, "f32", False, 2048)]
        assert not any(v.config.get("operand") == "e4m3_block" for v in variants)
        columns = sorted((v.config["width"], v.config.get("gathered", False)) for v in variants if v.config.get("columns"))
        assert columns == [(768, False), (1536, False), (2048, gathered_x)]
        assert all(v.config.get("mma_scales") and v.config.get("power_of_two") for v in variants if v.config.get("columns"))
    dispatch = [v for v in ep if v.name == "ep_dispatch_fp8_block"]
    assert [v.config.get("scale_order") for v in dispatch] == ["mma"]
    assert any(v.name == "dequantize_mxfp8" and v.config == {"bounded": True} for v in ep)
    assert not any(v.config.get("back") for v in ep if v.name == "quantize_fp8_block")
    hopper = plan_for(MoKConfig(**{**base, "fp8_scales": "fp32"}, ep_size=2, dispatch_format="fp8_block"), "sm_90a").variants()
    assert [v.config.get("scale_order") for v in hopper if v.name == "ep_dispatch_fp8_block"] == [None]  # (fp32 rows: Hopper's)
    fp32 = MoKConfig(**{**base, "fp8_scales": "fp32"}, ep_size=2, dispatch_format="fp8_block")
    assert "needs fp8_scales='power_of_two' (the MMAs' scales are E8M0: powers of two)" in refusal(fp32, arch)
    with pytest.raises(NotImplementedError, match="fp8_scales='power_of_two'"):
        plan_for(fp32, arch)
    new = [v for v in ep + one_gpu if v.config.get("columns")] + dispatch
    for v in {v.describe(): v for v in new}.values():
        ptx = compiled_ptx(v, arch)
        assert count(r"\.local", ptx) == 0 and ptxas_spill_bytes(ptx, arch) in (None, 0), v.describe()
        if v.name == "quantize_fp8_block":  # a lane's 32 rows x 4 columns (4 bytes a row) and its 4 scale words
            assert count(r"st\.global\.b32", ptx) == 32 + 4 and count(r"st\.global\.v4", ptx) == 0, v.describe()
        else:  # (the exponent field as E8M0 bytes, four a word)
            assert "16843009" in ptx and "16843009" not in compiled_ptx(next(v for v in hopper if v.name == "ep_dispatch_fp8_block"), "sm_90a")


def test_fp8_block_precision_plans_fp8_gemms_and_bf16_weight_gradients():
    """precision="fp8_block" on Hopper: every expert GEMM but the weight gradients' on E4M3 with block
    scales (rows quantized once gathered or produced, the weights' 128 x 128 quantizer for them and
    their transposes; x's tokens quantized once and their FP8 rows gathered, dout's rows gathered
    as they are quantized with their bf16 copy; the gate/up GEMM in turns of 4, on one CTA a tile,
    its activation out in FP8 from its epilogue, with row-tile pairs quantized after it), the weight gradients bf16, the
    router pieces of the 128-wide SwiGLU-backward tiles (with the register hand-over: 64-wide ones
    measured slower), h recomputed on the forward's FP8 GEMM; refused on SM100; widths multiples of 128; at EP
    the pushing down and dx GEMMs on FP8 too, the pulled rows quantized once they arrive."""
    from mok.config import MoKConfig
    from mok.plan import Plan, plan_for, refusal

    config = MoKConfig(2048, 768, 64, 8, precision="fp8_block", saved_h_format="recompute")
    variants = Plan(config, "sm_90a").variants()
    fp8_gemms = [v.config for v in variants if v.name == "grouped_gemm" and v.config.get("operand") == "e4m3_block"]
    assert sorted((c["epilogue"], c["n"], c["k"], c["k_split"], c.get("cluster_m", 1), c.get("deep_turn", 0), c.get("out_format"))
                  for c in fp8_gemms) == [
        ("plain", 2048, 768, False, 1, 4, None), ("plain", 2048, 1536, True, 1, 4, None), ("swiglu", 768, 2048, False, 1, 4, "e4m3_block"),
        ("swiglu_bwd", 768, 2048, False, 1, 4, None), ("swiglu_save", 768, 2048, False, 1, 4, "e4m3_block")]
    assert all(v.config.get("operand") is None for v in variants if v.name == "weight_grad")
    quantizers = sorted((v.config["width"], v.config["block_rows"], v.config.get("bounded", False), v.config.get("segments", 1),
                         v.config.get("gathered", False), v.config.get("copies_rows", False))
                        for v in variants if v.name == "quantize_fp8_block")  # (the rows in use)
    # (dh a half at a time: the dx GEMM's two K ranges; x's tokens whole, then gathered; dout's rows gathered as quantized with their
    # bf16 copy; no quantizer of the activation, which the gate/up GEMM quantizes, but with row-tile pairs)
    assert quantizers == [(768, 128, False, 1, False, False), (1536, 1, True, 2, False, False),
                          (2048, 1, False, 1, False, False), (2048, 1, True, 1, True, True), (2048, 128, False, 1, False, False)]
    paired = Plan(MoKConfig(2048, 768, 64, 8, precision="fp8_block", saved_h_format="recompute", row_tile_pairs=True), "sm_90a").variants()
    assert {(v.config["epilogue"], v.config.get("cluster_m"), v.config.get("out_format")) for v in paired
            if v.name == "grouped_gemm" and v.config["epilogue"] in ("swiglu", "swiglu_save")} == {("swiglu", 2, None), ("swiglu_save", 2, None)}
    assert any(v.name == "quantize_fp8_block" and v.config["width"] == 768 and v.config["block_rows"] == 1 for v in paired)
    gathers = sorted((v.config.get("sources", 1), v.config.get("fp8", False)) for v in variants if v.name == "gather")
    assert gathers == [(1, False), (1, True)]  # (x's bf16 rows for the weight gradients; x's FP8 rows)
    plan = Plan(config, "sm_90a")  # (x's FP8 rows gathered: no bf16 gather in the forward, the GEMM's producer gathers nothing)
    assert plan.quantizes_gathered_rows and plan.gathers_fp8_rows and not plan.gather_in_gemm
    assert not any(v.config.get("gather_a") for v in variants)
    assert {tuple(sorted(v.config.items())) for v in plan._forward_variants() if v.name == "gather"} == {(("fp8", True), ("width", 2048))}
    fp8_wgrads = Plan(MoKConfig(2048, 768, 64, 8, precision="fp8_block", wgrad_format="fp8_block"), "sm_90a")
    assert [v.config for v in fp8_wgrads._swiglu_backward_variants(768, 2048, 8) if v.name == "gather"] == [dict(width=2048, fp8=True)]
    assert [v.config["router_parts"] for v in variants if v.name == "combine" and "router_parts" in v.config] == [768 // 128]
    assert [v.config["tile_n"] for v in variants if v.name == "grouped_gemm" and v.config["epilogue"] == "swiglu_bwd"] == [128]
    assert "needs fp8_scales='power_of_two' (the MMAs' scales are E8M0" in refusal(config, "sm_100a")
    assert plan_for(config, "sm_90a").variants() == variants
    ep = Plan(MoKConfig(2048, 768, 64, 8, precision="fp8_block", ep_size=2, expert_bias=True), "sm_90a").variants()
    scattering = sorted((v.config["n"], v.config["k"], v.config["k_split"], v.config.get("bias", False), v.config.get("operand"))
                        for v in ep if v.name == "grouped_gemm" and v.config.get("scatter"))
    assert scattering == [(2048, 768, False, True, "e4m3_block"), (2048, 1536, True, False, "e4m3_block")]
    assert not any(v.config.get("gather_a") for v in ep)  # (the rows are pulled, then quantized: bounded quantizers; a by the gate/up GEMM)
    assert {(v.config["width"], v.config.get("bounded", False)) for v in ep if v.name == "quantize_fp8_block"
            and v.config["block_rows"] == 1} == {(1536, True), (2048, True)}
    with pytest.raises(ValueError, match=r"precision='fp8_block': not with one_launch"):
        MoKConfig(2048, 768, 64, 8, precision="fp8_block", ep_size=2, one_launch=True)
    with pytest.raises(ValueError, match=r"precision='fp8_block': expected widths that are multiples of 16 \(16-byte E4M3 rows\)"):
        MoKConfig(2048, 776, 64, 8, precision="fp8_block")
    pow2 = Plan(MoKConfig(2048, 768, 64, 8, precision="fp8_block", fp8_scales="power_of_two"), "sm_90a").variants()
    assert {v.config.get("power_of_two", False) for v in pow2 if v.name == "quantize_fp8_block"} == {True}  # (every quantizer)
    with pytest.raises(ValueError, match=r"fp8_scales='power_of_two': only with precision='fp8_block' \(its scale rule\), got precision='bf16'"):
        MoKConfig(2048, 768, 64, 8, fp8_scales="power_of_two")
    with pytest.raises(ValueError, match=r"fp8_scales: expected one of \('fp32', 'power_of_two'\), got 'e8m0'"):
        MoKConfig(2048, 768, 64, 8, precision="fp8_block", fp8_scales="e8m0")
    partial = Plan(MoKConfig(2880, 1040, 32, 4, precision="fp8_block"), "sm_90a").variants()  # (gpt-oss's H; I 8 x 128 + 16)
    quantizers = {tuple(sorted(v.config.items())) for v in partial if v.name == "quantize_fp8_block"}
    assert (("block_rows", 1), ("bounded", True), ("segments", 2), ("width", 2080)) in quantizers  # (dh: a half at a time)
    assert (("block_rows", 128), ("matrix_rows", 1040), ("width", 2880)) in quantizers  # (w_gate, w_up: N = 1040)
    assert (("block_rows", 128), ("matrix_rows", 2880), ("width", 1040)) in quantizers  # (w_down [E, 2880, 1040], w_gate's transpose)


def test_fp8_weight_gradients_are_refused_where_they_do_not_run():
    """pipeline.backward(wgrad_format="fp8_block"): for precision="fp8_block" only: a bf16 layer is
    refused before anything runs (and so is a format of another precision); fp8_block on SM100
    takes it (its MXFP8 weight-gradient kernel), so the call goes on to check its saved forward."""
    from mok import pipeline
    from mok.config import MoKConfig
    from mok.plan import Plan

    T, H, I, E, k = 8, 256, 128, 4, 2
    x, dout = torch.randn(T, H).bfloat16(), torch.randn(T, H).bfloat16()
    idx, w = torch.zeros(T, k, dtype=torch.int32), torch.rand(T, k)
    experts = (torch.randn(E, I, H).bfloat16(), torch.randn(E, I, H).bfloat16(), torch.randn(E, H, I).bfloat16())
    for precision, arch, extra, wgrad, why in (
        ("bf16", "sm_90a", {}, "fp8_block", re.escape("wgrad_format='fp8_block': only with precision 'fp8_block' (its quantizers and "
                                                      "scale rule), got precision='bf16'")),
        ("fp8_block", "sm_90a", {}, "mxfp8", "wgrad_format='mxfp8': only with precision 'mxfp8' or 'mxfp8_emulated'"),
    ):
        plan = Plan(MoKConfig(H, I, E, k, precision=precision, **extra), arch)
        with pytest.raises(ValueError, match=why):
            pipeline.backward(plan, dout, x, idx, w, experts, None, None, wgrad_format=wgrad)
    sm100 = Plan(MoKConfig(H, I, E, k, precision="fp8_block", fp8_scales="power_of_two"), "sm_100a")
    with pytest.raises(TypeError, match="saved: expected the ForwardResult of a forward with save=True, got NoneType"):
        pipeline.backward(sm100, dout, x, idx, w, experts, None, None, wgrad_format="fp8_block")


def test_wgrad_format_is_a_config_option_with_its_kernels():
    """MoKConfig.wgrad_format: None takes the precision's own weight-gradient operands (bf16 for
    bf16 and fp8_block, MXFP8 for the MXFP8 precisions); "fp8_block" goes with precision fp8_block
    only and adds its kernels to the plan (the transposing quantizers of dout, s·a, dh and of x
    gathered as quantized; the FP8 weight-gradient GEMMs, cooperative, fresh and with main_grad
    accumulation, dh's half packed), in place of the bf16 ones; SM100 takes it too;
    the layer, the precompile CLI and the ops' config text carry it. (dout's rows gathered as they
    are quantized where no bias sum reads them.)"""
    from mok.config import MoKConfig
    from mok.layer import MoELayer
    from mok.plan import Plan, refusal
    from mok.torch_ops import config_of, config_text

    base = dict(hidden=2048, intermediate=768, num_experts=64, topk=8)
    assert [MoKConfig(**base, precision=p).weight_grad_format for p in ("bf16", "fp8_block")] == ["bf16", "bf16"]
    assert MoKConfig(**{**base, "intermediate": 1024}, precision="mxfp8_emulated").weight_grad_format == "mxfp8"
    config = MoKConfig(**base, precision="fp8_block", wgrad_format="fp8_block", fuse_wgrad_accumulation=True)
    assert config.weight_grad_format == "fp8_block" and config_of(config_text(config)) == config
    variants = Plan(config, "sm_90a").variants()
    wgrads = sorted((v.config["m"], v.config["n"], v.config["out_dtype"], v.config.get("split_out", False), v.config.get("pingpong", False),
                     v.config["a_stride"]) for v in variants if v.name == "weight_grad" and v.config.get("operand") == "e4m3_block")
    assert wgrads == [(768, 2048, "f32", False, False, 768), (1536, 2048, "bf16", True, False, 1536), (1536, 2048, "f32", True, False, 1536),
                      (2048, 768, "bf16", False, False, 2048), (2048, 768, "f32", False, False, 2048)]
    assert not any(v.name == "weight_grad" and v.config.get("operand") is None and v.config["m"] in (768, 1536, 2048) and v.config["n"] in (768, 2048)
                   for v in variants)  # (no bf16 expert weight gradients beside them)
    columns = sorted((v.config["width"], v.config.get("gathered", False)) for v in variants if v.config.get("columns"))
    assert columns == [(768, False), (1536, False), (2048, True)]  # (s·a, dh; x and dout gathered as they are quantized)
    biased = Plan(MoKConfig(**base, precision="fp8_block", wgrad_format="fp8_block", expert_bias=True), "sm_90a").variants()
    assert (2048, False) in {(v.config["width"], v.config.get("gathered", False)) for v in biased if v.config.get("columns")}
    plain = Plan(MoKConfig(**base, precision="fp8_block"), "sm_90a").variants()
    assert not any(v.config.get("columns") or v.config.get("operand") == "e4m3_block" for v in plain if v.name != "grouped_gemm")
    ep = Plan(MoKConfig(**base, precision="fp8_block", wgrad_format="fp8_block", ep_size=2), "sm_90a").variants()
    assert sorted((v.config["width"], v.config.get("gathered", False)) for v in ep if v.config.get("columns")) == [
        (768, False), (1536, False), (2048, False)]  # (at EP: the pulled rows of x and dout, quantized as they are)
    pow2 = MoKConfig(**base, precision="fp8_block", fp8_scales="power_of_two", wgrad_format="fp8_block")
    assert refusal(pow2, "sm_100a") is None and refusal(pow2, "sm_90a") is None  # (SM100: tests/test_fp8_block.py's sm100 test)
    with pytest.raises(ValueError, match=r"wgrad_format: expected None \(the precision's own\) or one of \('bf16', 'fp8_block', 'mxfp8'\), got 'fp16'"):
        MoKConfig(**base, precision="fp8_block", wgrad_format="fp16")
    with pytest.raises(ValueError, match="wgrad_format='fp8_block': only with precision 'fp8_block'"):
        MoELayer(2048, 768, 64, 8, wgrad_format="fp8_block")
    assert MoELayer(256, 128, 4, 2, precision="fp8_block", wgrad_format="fp8_block").config.wgrad_format == "fp8_block"


def test_gather_fp8_rows_checks_its_operands_before_launching():
    """ops.gather_fp8_rows: (elements, scales) as quantize_fp8_rows gives them, an int32 index and
    count; each wrong one named with what was expected, before anything launches."""
    from mok import ops

    elements, scales = torch.zeros(10, 256, dtype=torch.float8_e4m3fn), torch.zeros(2, 10)
    index = torch.zeros(12, dtype=torch.int32)
    with pytest.raises(TypeError, match="rows: expected \\(elements, scales\\)"):
        ops.gather_fp8_rows(elements, index)
    with pytest.raises(TypeError, match="elements: expected dtype float8_e4m3fn, got uint8"):
        ops.gather_fp8_rows((elements.view(torch.uint8), scales), index)
    with pytest.raises(ValueError, match="K a positive multiple of 16"):
        ops.gather_fp8_rows((torch.zeros(10, 200, dtype=torch.float8_e4m3fn), scales), index)
    with pytest.raises(ValueError, match="scales: expected shape \\[2, 10\\]"):
        ops.gather_fp8_rows((elements, torch.zeros(10, 2)), index)
    with pytest.raises(TypeError, match="index: expected dtype int32"):
        ops.gather_fp8_rows((elements, scales), index.long())
    with pytest.raises(ValueError, match="rows_used: expected one element"):
        ops.gather_fp8_rows((elements, scales), index, rows_used=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="elements: expected a CUDA tensor"):  # (the launch checks refuse CPU data)
        ops.gather_fp8_rows((elements, scales), index)
