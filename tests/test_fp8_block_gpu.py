"""FP8 with 128-block scales (DeepSeek-V3's recipe) on the H200: the grouped GEMM (mok.fp8_block's
operands on Hopper's FP8 WGMMAs, promoted into fp32 every 128 of K: mok/kernels/sm90/block_scaled.py),
the quantizers, and the layer's precision="fp8_block".

The GEMM against the float64 product of the same (dequantized) operands: the plain, SwiGLU (with h)
and k-split forms, a last row tile that is partial, unused tiles left unwritten (outputs poisoned
first), expert biases in the epilogue, the same bits on every run and for a tile alone. The
quantizers against the rule's bits. The layer against a float64 emulation of the recipe and the
bf16 model, its bits run to run, per sub-batch and with h recomputed, the weights' cache, and
``MoELayer(precision="fp8_block")`` under autograd giving the pipeline's bits."""

import pytest
import torch

from mok import fp8_block as fp8
from mok import ops, pipeline
from mok.kernels import variants
from mok.kernels.common.grouped_gemm import EPILOGUES
from mok.ops import gemm as gemm_ops

from helpers import gpu_layer, poisoned, rel_err

pytestmark = pytest.mark.gpu


def operands(R, N, K, E, seed, two=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(R, K, device="cuda", generator=g)
    b = torch.randn(E, N, K, device="cuda", generator=g) * K**-0.5
    tiles = torch.randint(0, E, (-(-R // 128),), device="cuda", generator=g, dtype=torch.int32)
    tiles[1] = -1  # an unused tile: its rows stay as they were
    a_q, b_q = fp8.quantize_rows(a), fp8.quantize_weights(b)
    b2_q = fp8.quantize_weights(torch.randn(E, N, K, device="cuda", generator=g) * K**-0.5) if two else None
    experts = tiles.long().repeat_interleave(128)[:R]
    return a_q, b_q, b2_q, tiles, experts


@pytest.mark.parametrize("R,N,K,E", [(1000, 256, 2048, 4), (644, 2048, 7168, 3), (700, 2064, 2880, 3)])  # (partial N and K blocks)
def test_plain_product_matches_float64_of_its_operands(R, N, K, E):
    a_q, b_q, _, tiles, experts = operands(R, N, K, E, seed=R)
    out = poisoned(R, N)
    ops.grouped_gemm(a_q, b_q, tiles, out=out)
    used = experts >= 0
    want = fp8.block_scaled_gemm_reference(a_q, b_q, experts)
    assert out[~used].isnan().all() and not out[used].isnan().any()
    assert rel_err(out[used], want[used]) < 5e-3
    again = ops.grouped_gemm(a_q, b_q, tiles)
    assert torch.equal(again[used], out[used])
    one = ops.grouped_gemm((a_q[0][:128].contiguous(), a_q[1][:, :128].contiguous()), b_q, tiles[:1])  # the first tile alone
    assert torch.equal(one, out[:128])


@pytest.mark.parametrize("form", ["plain", "k_split", "swiglu"])
@pytest.mark.parametrize("k_blocks", [9, 10, 1, 2, 21])
def test_two_block_buffers_and_deep_turns_give_the_same_bits(form, k_blocks):
    """block_buffers=2 (a stage's WGMMAs overlapping the previous stage's promotion, the register
    hand-over on; the plain epilogue's default), alone and with deep turns (two stages' WGMMAs in
    flight for turns of 4 or 8 stages): the same sums in the same order, so the one-set kernel's
    bits; odd and even K block counts (a half's with k_split; 1: no loop, 2: its even end; 9, 10
    and 21: whole turns and a remainder of pairs), SwiGLU's two products with h, unused tiles left
    unwritten."""
    k_split, swiglu = form == "k_split", form == "swiglu"
    R, N, K, E = 900, 1024 if not swiglu else 384, 128 * k_blocks * (2 if k_split else 1), 3
    a_q, b_q, b2_q, tiles, experts = operands(R, N, K, E, seed=11 + k_blocks, two=swiglu)
    used = experts >= 0
    if k_split:
        b_q = fp8.quantize_weights(torch.randn(E, N, K // 2, device="cuda") * K**-0.5)
        b2_q = fp8.quantize_weights(torch.randn(E, N, K // 2, device="cuda") * K**-0.5)
    h_one = poisoned(R, 2 * N) if swiglu else None
    one = poisoned(R, N)
    ops.grouped_gemm(a_q, b_q, tiles, b2=b2_q, k_split=k_split, out=one, h_out=h_one, block_buffers=1)
    for deep_turn in (0, 4, 8):
        two = poisoned(R, N)
        h_two = poisoned(R, 2 * N) if swiglu else None
        ops.grouped_gemm(a_q, b_q, tiles, b2=b2_q, k_split=k_split, out=two, h_out=h_two, block_buffers=2, deep_turn=deep_turn)
        assert two[~used].isnan().all() and torch.equal(two[used], one[used]), deep_turn
        if swiglu:
            assert torch.equal(h_two[used], h_one[used]), deep_turn
    if form == "plain":
        assert rel_err(one[used], fp8.block_scaled_gemm_reference(a_q, b_q, experts)[used]) < 5e-3
    if swiglu:
        gate, up = (fp8.block_scaled_gemm_reference(a_q, b, experts)[used] for b in (b_q, b2_q))
        assert rel_err(h_one[used].double(), torch.cat([gate, up], dim=1)) < 5e-3



@pytest.mark.parametrize("k_blocks", [1, 2, 9, 10])
def test_swiglu_backward_on_two_block_sets_gives_the_one_set_bits(k_blocks):
    """The SwiGLU backward on two block sets (its default: h then loaded after the mainloop, which
    an L2 prefetch before it brings near), alone and with deep turns of 4: dh, s·a and the router
    pieces bit for bit the one-set kernel's (h loaded before the mainloop), at odd and even K
    block counts, with a partial last row tile and an unused one."""
    R, I, H, E = 128 * 4 + 40, 256, 128 * k_blocks, 3
    g = torch.Generator(device="cuda").manual_seed(100 + k_blocks)
    tiles = torch.tensor([1, -1, 0, 2, 2], device="cuda", dtype=torch.int32)
    used = tiles.long().repeat_interleave(128)[:R] >= 0
    dout_q = fp8.quantize_rows(torch.randn(R, H, device="cuda", generator=g))
    w_q = fp8.quantize_weights(torch.randn(E, I, H, device="cuda", generator=g) * H**-0.5)
    h = torch.randn(R, 2 * I, device="cuda", generator=g).bfloat16()
    rows = torch.arange(R, device="cuda", dtype=torch.int32)
    router = dict(row_token=rows // 2, row_slot=rows % 2, topk_w=torch.rand(-(-R // 2), 2, device="cuda", generator=g))
    one = ops.swiglu_backward_gemm(dout_q, w_q, tiles, h, block_buffers=1, **router)
    assert not one[0][used].isnan().any()
    for deep_turn in (0, 4):
        two = ops.swiglu_backward_gemm(dout_q, w_q, tiles, h, block_buffers=2, deep_turn=deep_turn, **router)
        for got, want in zip(two, one):
            assert torch.equal(got[used], want[used]), deep_turn


def test_swiglu_backward_with_h_in_shared_memory_over_several_tiles_a_cta():
    """The FP8 SwiGLU backward's default (h TMA-loaded into shared memory, one barrier phase a
    tile) over 480 tiles, several for each persistent CTA (the test above gives each CTA one):
    bit for bit the one-set kernel's, which loads h into registers."""
    R, I, H, E = 128 * 40, 1536, 256, 4
    g = torch.Generator(device="cuda").manual_seed(7)
    tiles = torch.arange(R // 128, device="cuda", dtype=torch.int32) % E
    dout_q = fp8.quantize_rows(torch.randn(R, H, device="cuda", generator=g))
    w_q = fp8.quantize_weights(torch.randn(E, I, H, device="cuda", generator=g) * H**-0.5)
    h = torch.randn(R, 2 * I, device="cuda", generator=g).bfloat16()
    rows = torch.arange(R, device="cuda", dtype=torch.int32)
    router = dict(row_token=rows // 4, row_slot=rows % 4, topk_w=torch.rand(R // 4, 4, device="cuda", generator=g))
    one = ops.swiglu_backward_gemm(dout_q, w_q, tiles, h, block_buffers=1, **router)
    two = ops.swiglu_backward_gemm(dout_q, w_q, tiles, h, **router)
    assert not one[0].isnan().any()
    for got, want in zip(two, one):
        assert torch.equal(got, want)


def test_swiglu_with_h_and_biases_and_the_k_split_form():
    R, N, K, E = 768, 512, 1024, 4
    a_q, b_q, b2_q, tiles, experts = operands(R, N, K, E, seed=3, two=True)
    used = experts >= 0
    bias = (torch.randn(E, N, device="cuda") * 0.3).bfloat16()
    bias2 = (torch.randn(E, N, device="cuda") * 0.3).bfloat16()
    h = poisoned(R, 2 * N)
    act = ops.grouped_gemm(a_q, b_q, tiles, b2=b2_q, h_out=h, bias=bias, bias2=bias2)
    e = experts.clamp(min=0)
    gate = fp8.block_scaled_gemm_reference(a_q, b_q, experts) + bias.double()[e]
    up = fp8.block_scaled_gemm_reference(a_q, b2_q, experts) + bias2.double()[e]
    assert rel_err(h[used], torch.cat([gate, up], 1)[used]) < 5e-3 and h[~used].isnan().all()
    assert rel_err(act[used], (torch.nn.functional.silu(gate) * up)[used]) < 1e-2
    # k_split: [dh_gate | dh_up] against two weights, each half of K with its own scales
    dh = fp8.quantize_rows(torch.randn(R, 2 * K, device="cuda"))
    w1, w2 = (fp8.quantize_weights(torch.randn(E, N, K, device="cuda") * K**-0.5) for _ in range(2))
    got = ops.grouped_gemm(dh, w1, tiles, b2=w2, k_split=True)
    halves = [(dh[0][:, :K].contiguous(), dh[1][: K // 128].contiguous()), (dh[0][:, K:].contiguous(), dh[1][K // 128:].contiguous())]
    want = fp8.block_scaled_gemm_reference(halves[0], w1, experts) + fp8.block_scaled_gemm_reference(halves[1], w2, experts)
    assert rel_err(got[used], want[used]) < 5e-3


@pytest.mark.parametrize("N,K,power_of_two,save_h,biased,activation,ctas", [
    (512, 1024, False, True, False, "swiglu", None),  # whole blocks: four pairs of column tiles
    (2880, 640, True, True, True, "swiglu", None),  # 45 column tiles: the last block alone (64 wide); biases
    (1008, 384, False, False, False, "geglu", None),  # a partial last tile (48 wide) in a partial block; no h
    (512, 1024, False, True, False, "swiglu", 3),  # ~11 pairs a CTA: the buffer and the stores from unit to unit
    (2880, 640, False, True, False, "swiglu", 5),  # ~37 units a CTA, blocks alone among them
])
def test_swiglu_activation_out_in_fp8_is_the_rule_on_its_bf16_values(N, K, power_of_two, save_h, biased, activation, ctas, monkeypatch):
    """out_format="fp8_block": the SwiGLU GEMM returns its activation as E4M3 with 1 x 128 row
    block scales, bit for bit mok.fp8_block's rule (the float64-checked torch reference) on the
    bf16 activation the bf16-output kernel writes, on every used row (a partial last row tile
    too); h the same bits; the elements times their scales within E4M3's rounding of float64's
    activation of the same operands. With ``ctas`` the FP8-output kernel runs on that many CTAs
    (each walking many pairs of tiles), the bf16 one on every SM."""
    R, E = 1000, 4
    a_q, b_q, b2_q, tiles, experts = operands(R, N, K, E, seed=N + K, two=True)
    used = experts >= 0
    biases = {}
    if biased:
        biases = dict(bias=(torch.randn(E, N, device="cuda") * 0.3).bfloat16(), bias2=(torch.randn(E, N, device="cuda") * 0.3).bfloat16())
    h_bf16, h = (poisoned(R, 2 * N), poisoned(R, 2 * N)) if save_h else (None, None)
    act = ops.grouped_gemm(a_q, b_q, tiles, b2=b2_q, h_out=h_bf16, activation=activation, **biases)
    if ctas is not None:
        monkeypatch.setattr(gemm_ops, "sm_count", lambda device: ctas)
    q, scales = ops.grouped_gemm(a_q, b_q, tiles, b2=b2_q, h_out=h, activation=activation, out_format="fp8_block",
                                 power_of_two=power_of_two, **biases)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (R, N) and scales.shape == (-(-N // 128), R)
    want_q, want_s = fp8.quantize_rows(act[used].float().cpu(), power_of_two=power_of_two)
    assert torch.equal(q[used].view(torch.uint8).cpu(), want_q.view(torch.uint8)) and torch.equal(scales[:, used].cpu(), want_s)
    if save_h:
        assert torch.equal(h[used], h_bf16[used]) and h[~used].isnan().all()
    e = experts.clamp(min=0)
    gate = fp8.block_scaled_gemm_reference(a_q, b_q, experts) + (biases["bias"].double()[e] if biased else 0)
    up = fp8.block_scaled_gemm_reference(a_q, b2_q, experts) + (biases["bias2"].double()[e] if biased else 0)
    act64 = (torch.nn.functional.silu(gate) if activation == "swiglu" else torch.nn.functional.gelu(gate, approximate="tanh")) * up
    assert rel_err(fp8.dequantize_rows(q[used], scales[:, used].contiguous()), act64[used]) < 4e-2


# Row tiles of a pair (cluster_m=2): (0, 1) one expert's (B multicast to both CTAs), (2, 3) two
# experts', (4, 5) a skipped tile beside one with rows, (6, 7) both skipped, (8, 9) one expert's
# again, and 11 tiles: the last pair's second tile lies past the row tiles (partial rows too).
FP8_PAIR_TILES = [2, 2, 0, 1, -1, 2, -1, -1, 1, 1, 0]


@pytest.mark.parametrize("form", ["swiglu_h", "plain", "k_split", "swiglu_bwd"])
def test_row_tile_pairs_on_fp8_give_the_single_cta_bits(form):
    """cluster_m=2 on FP8 block-scaled operands (two CTAs on two row tiles of one column tile, B's
    tile multicast to both where one expert has both; B's scales read by the expert whose B the
    stages hold): the bits of cluster_m=1 in every kind of pair, in each form (the gate/up GEMM
    with h, which the layer runs on pairs; the plain, k_split and SwiGLU-backward ones), nothing
    written for skipped tiles, and the float64 product of the operands."""
    R, N, K, E = 128 * (len(FP8_PAIR_TILES) - 1) + 76, 384, 1024 + 256, 3  # (R a multiple of 4: the row scales by TMA)
    g = torch.Generator(device="cuda").manual_seed(len(form))
    tiles = torch.tensor(FP8_PAIR_TILES, device="cuda", dtype=torch.int32)
    experts = tiles.long().repeat_interleave(128)[:R]
    used = experts >= 0
    halves = 2 if form == "k_split" else 1
    a_q = fp8.quantize_rows(torch.randn(R, K, device="cuda", generator=g), segments=halves)
    b_q, b2_q = (fp8.quantize_weights(torch.randn(E, N, K // halves, device="cuda", generator=g) * K**-0.5) for _ in range(2))
    h = torch.randn(R, 2 * N, device="cuda", generator=g).bfloat16()
    topk_w = torch.rand(R, 1, device="cuda", generator=g)
    rows = torch.arange(R, device="cuda", dtype=torch.int32)
    outs = []
    for cluster_m in (1, 2):
        if form == "swiglu_bwd":
            outs.append(ops.swiglu_backward_gemm(a_q, b_q, tiles, h, row_token=rows, row_slot=rows * 0, topk_w=topk_w, cluster_m=cluster_m))
            continue
        out, h_out = poisoned(R, N), poisoned(R, 2 * N) if form == "swiglu_h" else None
        two = dict(b2=b2_q, h_out=h_out) if form == "swiglu_h" else dict(b2=b2_q, k_split=True) if form == "k_split" else {}
        ops.grouped_gemm(a_q, b_q, tiles, out=out, cluster_m=cluster_m, **two)
        outs.append((out,) if h_out is None else (out, h_out))
    for single, pair in zip(*outs):
        if pair is not None:
            assert torch.equal(pair[used], single[used])
    if form == "swiglu_bwd":
        return
    out = outs[1][0]
    assert out[~used].isnan().all() and not out[used].isnan().any()
    if form == "swiglu_h":
        want = torch.cat([fp8.block_scaled_gemm_reference(a_q, b, experts) for b in (b_q, b2_q)], 1)
        assert rel_err(outs[1][1][used], want[used]) < 5e-3 and outs[1][1][~used].isnan().all()
    elif form == "k_split":
        parts = [(a_q[0][:, i * K // 2:(i + 1) * K // 2].contiguous(), a_q[1][i * K // 256:(i + 1) * K // 256].contiguous()) for i in range(2)]
        want = fp8.block_scaled_gemm_reference(parts[0], b_q, experts) + fp8.block_scaled_gemm_reference(parts[1], b2_q, experts)
        assert rel_err(out[used], want[used]) < 5e-3
    else:
        assert rel_err(out[used], fp8.block_scaled_gemm_reference(a_q, b_q, experts)[used]) < 5e-3


@pytest.mark.parametrize("power_of_two", [False, True])
def test_quantizers_give_the_rule_s_bits(power_of_two):
    """ops.quantize_fp8_rows / quantize_fp8_weights against mok.fp8_block's rule computed on the CPU:
    the same E4M3 bytes and fp32 scales (an all-zero block, magnitudes over twelve decades); with
    rows_used, the rows in use the same."""
    g = torch.Generator(device="cuda").manual_seed(9)
    x = (torch.randn(1000, 2048, device="cuda", generator=g) * torch.logspace(-6, 6, 1000, device="cuda")[:, None]).bfloat16()
    x[3, 128:256] = 0
    q, s = ops.quantize_fp8_rows(x, power_of_two=power_of_two)
    want_q, want_s = fp8.quantize_rows(x.cpu(), power_of_two=power_of_two)
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s.cpu(), want_s)
    used = torch.tensor([300], dtype=torch.int32, device="cuda")
    q_used, s_used = ops.quantize_fp8_rows(x, power_of_two=power_of_two, rows_used=used)
    assert torch.equal(q_used[:300].view(torch.uint8), q[:300].view(torch.uint8)) and torch.equal(s_used[:, :300], s[:, :300])
    w = (torch.randn(3, 256, 384, device="cuda", generator=g) * 0.02).bfloat16()
    w[1, :128, 128:256] *= 1e4
    wq, ws = ops.quantize_fp8_weights(w, power_of_two=power_of_two)
    want_wq, want_ws = fp8.quantize_weights(w.cpu(), power_of_two=power_of_two)
    assert torch.equal(wq.cpu().view(torch.uint8), want_wq.view(torch.uint8)) and torch.equal(ws.cpu(), want_ws)


@pytest.mark.parametrize("K", [2048, 2896])  # (a partial last block)
def test_dequantizer_gives_each_element_times_its_scale_in_bf16(K):
    """ops.dequantize_fp8_rows: bf16 of the fp32 product element · scale (the exact float64 product
    rounded to fp32, then to bf16), fp32 and power-of-two scales, magnitudes over twelve decades;
    with rows_used, the rows in use the same."""
    g = torch.Generator(device="cuda").manual_seed(K)
    x = (torch.randn(900, K, device="cuda", generator=g) * torch.logspace(-6, 6, 900, device="cuda")[:, None]).bfloat16()
    for power_of_two in (False, True):
        q, s = ops.quantize_fp8_rows(x, power_of_two=power_of_two)
        want = fp8.dequantize_rows(q.cpu(), s.cpu()).float().bfloat16()  # (the float64 product is exact: 4 + 24 bits)
        got = ops.dequantize_fp8_rows(q, s)
        assert torch.equal(got.cpu(), want)
        assert rel_err(got, x) < 0.05  # (E4M3's rounding of x)
    used = torch.tensor([300], dtype=torch.int32, device="cuda")
    partial = ops.dequantize_fp8_rows(q, s, rows_used=used)
    assert torch.equal(partial[:300], got[:300])


def mma_order_reference(scales, rows_per_chunk_row=1, width=None, rows=None):
    """Power-of-two fp32 block scales as E8M0 bytes in the MMA's order, written out independently
    of the kernel: rows' [K / 128, R] -> each row's byte at its four 32-blocks -> mok.mxfp8's
    layout; weights' [E, N / 128, K / 128] (``rows_per_chunk_row`` 128) -> every row of the block.
    ``width``: K no multiple of 128 (the last block's byte at the ceil(K / 32) 32-blocks the row
    has; mok.mxfp8's layout pads the rest with 127); ``rows``: the weights' N (rows past it padding)."""
    from mok.mxfp8 import mma_scale_layout

    exponent = torch.log2(scales.double()).round().long() + 127
    assert torch.equal(torch.exp2(exponent.double() - 127), scales.double())
    if scales.dim() == 2:
        per_block = exponent.T.repeat_interleave(4, dim=1)  # [R, K / 32]
    else:
        per_block = exponent.repeat_interleave(rows_per_chunk_row, dim=1).repeat_interleave(4, dim=2)  # [E, N, K / 32]
        per_block = per_block[:, :rows] if rows is not None else per_block
    if width is not None:
        per_block = per_block[..., : -(-width // 32)]
    return mma_scale_layout(per_block.to(torch.uint8).contiguous())


@pytest.mark.parametrize("width,segments", [(2880, 1), (2064, 1), (2080, 2)])
def test_e8m0_scales_in_the_mma_order_at_widths_128_does_not_divide(width, segments):
    """scale_order="mma" where a row ends in a partial 128-block (SM100's fp8_block at gpt-oss's
    2880, at 2064, dh's halves of 1040 each starting a chunk): the fp32-scale form's E4M3 bytes, each
    scale's E8M0 byte at the 32-blocks its block has and 127 past them (mok.mxfp8's layout of the
    rule's scales); weights whose N and K end in a partial block: padding rows' and blocks' bytes
    127."""
    from mok.mxfp8 import rows_scale_layout

    g = torch.Generator(device="cuda").manual_seed(width)
    x = (torch.randn(300, width, device="cuda", generator=g) * torch.logspace(-4, 4, 300, device="cuda")[:, None]).bfloat16()
    q, s = ops.quantize_fp8_rows(x, power_of_two=True, segments=segments)
    q_mma, s_mma = ops.quantize_fp8_rows(x, power_of_two=True, segments=segments, scale_order="mma")
    assert torch.equal(q_mma.view(torch.uint8), q.view(torch.uint8))
    half = width // segments
    want = torch.cat([mma_order_reference(part, width=half) for part in s.chunk(segments)], dim=-2)
    assert s_mma.shape == want.shape == (3, segments * -(-half // 128), 512)
    assert torch.equal(s_mma[:2], want[:2])  # (chunks of whole rows: the padding blocks' bytes too)
    for got_part, want_part in zip(s_mma.chunk(segments, dim=-2), want.chunk(segments, dim=-2)):  # (rows past 300: unwritten)
        assert torch.equal(rows_scale_layout(got_part.contiguous(), 300, half), rows_scale_layout(want_part.contiguous(), 300, half))
    for n, k in ((1040, 2880), (2880, 1040)):
        w = (torch.randn(3, n, k, device="cuda", generator=g) * 0.02).bfloat16()
        wq, ws = ops.quantize_fp8_weights(w, power_of_two=True)
        wq_mma, ws_mma = ops.quantize_fp8_weights(w, power_of_two=True, scale_order="mma")
        assert torch.equal(wq_mma.view(torch.uint8), wq.view(torch.uint8))
        assert torch.equal(ws_mma, mma_order_reference(ws, 128, width=k, rows=n)), (n, k)


def test_e8m0_scales_in_the_mma_order_carry_the_power_of_two_rule():
    """scale_order="mma" (SM100's block-scaled MMAs take fp8_block this way; the quantizer is
    arch-neutral, so checked here): the same E4M3 bytes as the fp32-scale form, and each scale's
    E8M0 byte at every 32-block it covers, in mok.mxfp8's MMA order (rows past R: not compared,
    left unwritten); weights likewise, a whole chunk per 128 x 128 block."""
    from mok.mxfp8 import rows_scale_layout

    g = torch.Generator(device="cuda").manual_seed(19)
    x = (torch.randn(300, 1024, device="cuda", generator=g) * torch.logspace(-4, 4, 300, device="cuda")[:, None]).bfloat16()
    q, s = ops.quantize_fp8_rows(x, power_of_two=True)
    q_mma, s_mma = ops.quantize_fp8_rows(x, power_of_two=True, scale_order="mma")
    assert s_mma.shape == (3, 8, 512) and s_mma.dtype == torch.uint8
    assert torch.equal(q_mma.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(rows_scale_layout(s_mma, 300), rows_scale_layout(mma_order_reference(s), 300))
    w = (torch.randn(3, 256, 384, device="cuda", generator=g) * 0.02).bfloat16()
    w[1, 128:, :128] *= 1e3
    wq, ws = ops.quantize_fp8_weights(w, power_of_two=True)
    wq_mma, ws_mma = ops.quantize_fp8_weights(w, power_of_two=True, scale_order="mma")
    assert torch.equal(wq_mma.view(torch.uint8), wq.view(torch.uint8))
    assert ws_mma.shape == (3, 2, 3, 512) and torch.equal(ws_mma, mma_order_reference(ws, 128))
    with pytest.raises(ValueError, match=r"scale_order='mma': E8M0 scales need power_of_two=True"):
        ops.quantize_fp8_rows(x, scale_order="mma")


def test_partial_blocks_in_the_quantizers_and_every_gemm_form():
    """Widths 128 does not divide (multiples of 16; gpt-oss's 2880, 1040 = 8 x 128 + 16): the
    quantizers give the rule's bits (rows, rows a half at a time, weights whose N and K end in a
    partial block); the k_split form (dh blocked a half at a time) and the gathering SwiGLU form
    with h against float64 of their operands; nothing written past N."""
    g = torch.Generator(device="cuda").manual_seed(13)
    x = (torch.randn(300, 2880, device="cuda", generator=g) * torch.logspace(-3, 3, 300, device="cuda")[:, None]).bfloat16()
    for segments, rows in ((1, x), (2, x[:, :2080].contiguous())):
        q, sc = ops.quantize_fp8_rows(rows, segments=segments)
        want_q, want_s = fp8.quantize_rows(rows.cpu(), segments=segments)
        assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(sc.cpu(), want_s), segments
    for shape in ((3, 1040, 2880), (3, 2880, 1040)):
        w = (torch.randn(shape, device="cuda", generator=g) * 0.02).bfloat16()
        wq, ws = ops.quantize_fp8_weights(w)
        want_wq, want_ws = fp8.quantize_weights(w.cpu())
        assert torch.equal(wq.cpu().view(torch.uint8), want_wq.view(torch.uint8)) and torch.equal(ws.cpu(), want_ws), shape
    R, N, I, E = 640, 2064, 1040, 3
    tiles = torch.tensor([0, -1, 2, 1, 0], device="cuda", dtype=torch.int32)
    experts = tiles.long().repeat_interleave(128)
    used = experts >= 0
    dh = ops.quantize_fp8_rows(torch.randn(R, 2 * I, device="cuda", generator=g).bfloat16(), segments=2)
    w1, w2 = (ops.quantize_fp8_weights((torch.randn(E, N, I, device="cuda", generator=g) * I**-0.5).bfloat16()) for _ in range(2))
    got = ops.grouped_gemm(dh, w1, tiles, b2=w2, k_split=True, out=poisoned(R, N))
    blocks = -(-I // 128)
    halves = [(dh[0][:, :I].contiguous(), dh[1][:blocks].contiguous()), (dh[0][:, I:].contiguous(), dh[1][blocks:].contiguous())]
    want = fp8.block_scaled_gemm_reference(halves[0], w1, experts) + fp8.block_scaled_gemm_reference(halves[1], w2, experts)
    assert rel_err(got[used], want[used]) < 5e-3 and got[~used].isnan().all()
    T, H = 500, 2880
    tokens = ops.quantize_fp8_rows(torch.randn(T, H, device="cuda", generator=g).bfloat16())
    row_token = torch.randint(0, T, (R,), device="cuda", generator=g, dtype=torch.int32)
    row_token[200:256] = -1  # padding rows: zeros in h
    wg, wu = (ops.quantize_fp8_weights((torch.randn(E, I, H, device="cuda", generator=g) * H**-0.5).bfloat16()) for _ in range(2))
    h = poisoned(R, 2 * I)
    act = ops.grouped_gemm(tokens, wg, tiles, b2=wu, h_out=h, gather=row_token)
    picked = row_token.clamp(min=0).long()
    rows = (tokens[0].view(torch.uint8)[picked].view(torch.float8_e4m3fn), tokens[1][:, picked].contiguous())
    real = used & (row_token >= 0)
    gate, up = fp8.block_scaled_gemm_reference(rows, wg, experts), fp8.block_scaled_gemm_reference(rows, wu, experts)
    assert rel_err(h[real], torch.cat([gate, up], 1)[real]) < 5e-3 and rel_err(act[real], (torch.nn.functional.silu(gate) * up)[real]) < 1e-2
    assert not h[used & (row_token < 0)].float().any() and h[~used].isnan().all()


def fp8_plan(x, idx, experts, **options):
    """The device's plan of precision="fp8_block" (Hopper's FP8 WGMMAs; SM100's block-scaled MMAs)."""
    from mok.config import MoKConfig
    from mok.plan import Plan
    from mok.runtime.arch import device_arch

    E, I, H = experts[0].shape
    return Plan(MoKConfig(H, I, E, idx.shape[1], precision="fp8_block", **options), device_arch())


def fp8_recipe_reference(x, idx, w, experts, power_of_two=False):
    """float64 of the recipe: x per token and the weights per block quantized (mok.fp8_block, by
    the ``power_of_two`` rule or not), the FP8 products exact, a = silu(gate)·up rounded to bf16 (as
    the kernel hands it on) and quantized per row, the down product, the router-weighted sum."""
    q_x = fp8.quantize_rows(x, power_of_two=power_of_two)
    rows = fp8.dequantize_rows(*q_x)
    gate_w, up_w, down_w = (fp8.dequantize_weights(*fp8.quantize_weights(t, power_of_two=power_of_two)) for t in experts)
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in range(gate_w.shape[0]):
        token, slot = (idx == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        a = (torch.nn.functional.silu(rows[token] @ gate_w[e].T) * (rows[token] @ up_w[e].T)).bfloat16()
        y = fp8.dequantize_rows(*fp8.quantize_rows(a, power_of_two=power_of_two)) @ down_w[e].T
        out.index_add_(0, token, w[token, slot].double()[:, None] * y)
    return out


@pytest.mark.parametrize("T,H,I,E,k", [(1500, 2048, 768, 16, 4), (700, 2880, 1040, 8, 4)])  # (gpt-oss's H, I a partial block)
def test_fp8_block_layer_forward_follows_the_recipe_and_trains(T, H, I, E, k):
    """precision="fp8_block": the forward within 1e-2 of the float64 recipe (and within FP8's ~6% of
    the bf16 model), the backward (FP8 dgrad GEMMs, bf16 weight gradients, on the FP8 forward's h)
    within FP8's error of autograd of the bf16 model; the same bits on every run, for a sub-batch
    (per-token scales), with h recomputed; also at widths 128 does not divide."""
    from mok.reference import moe_reference

    x, idx, w, experts, _ = gpu_layer(T, H, I, E, k, seed=4)
    plan = fp8_plan(x, idx, experts)
    saved = pipeline.forward(plan, x, idx, w, experts, None, save=True, out=poisoned(T, H))
    assert not saved.out.isnan().any()
    assert rel_err(saved.out, fp8_recipe_reference(x, idx, w, experts)) < 1e-2
    leaves = [t.float().requires_grad_() for t in (x, w, *experts)]
    want = moe_reference(leaves[0], idx, leaves[1], *leaves[2:])
    assert rel_err(saved.out, want) < 0.1  # (E4M3 keeps 3 mantissa bits: ~6% of a bf16 model, measured on the CPU)
    dout = torch.randn(T, H, device="cuda").bfloat16()
    grads = pipeline.backward(plan, dout, x, idx, w, experts, None, saved)
    want.backward(dout.float())
    for name, got, leaf in zip(["dx", "d_topk_w", "d_w_gate", "d_w_up", "d_w_down"],
                               [grads.dx, grads.d_topk_w, grads.d_w_gate, grads.d_w_up, grads.d_w_down], leaves):
        assert rel_err(got, leaf.grad) < 0.15, (name, rel_err(got, leaf.grad))  # (two FP8 products in a row: ~9%)
    again = pipeline.forward(plan, x, idx, w, experts, None, save=True)
    used = int(saved.schedule.expert_offsets[-1])  # (rows past the last expert's are not written)
    assert torch.equal(again.out, saved.out) and torch.equal(again.h[:used], saved.h[:used])
    rows = torch.randperm(T, device="cuda")[:17]
    part = pipeline.forward(plan, *(t[rows].contiguous() for t in (x, idx, w)), experts, None)
    assert torch.equal(part.out, saved.out[rows])
    recomputed = pipeline.backward(fp8_plan(x, idx, experts, saved_h_format="recompute"), dout, x, idx, w, experts, None,
                                   pipeline.forward(fp8_plan(x, idx, experts, saved_h_format="recompute"), x, idx, w, experts, None, save=True))
    assert torch.equal(recomputed.dx, grads.dx) and torch.equal(recomputed.d_w_gate, grads.d_w_gate)


def test_fp8_gate_up_on_row_tile_pairs_gives_the_one_cta_bits_batch_invariantly():
    """row_tile_pairs puts the FP8 gate/up GEMM on row-tile pairs (Plan.gate_up_pairs): the layer's
    output and dx are the one-CTA layer's bits, and a sub-batch gives each of its tokens the same
    bits as the batch."""
    T, H, I, E, k = 2048, 1024, 512, 8, 4
    x, idx, w, experts, _ = gpu_layer(T, H, I, E, k, seed=12)
    plan, single = fp8_plan(x, idx, experts, row_tile_pairs=True), fp8_plan(x, idx, experts)
    assert plan.gate_up_pairs == {"cluster_m": 2} and single.gate_up_pairs == {}
    saved = pipeline.forward(plan, x, idx, w, experts, None, save=True)
    one_cta = pipeline.forward(single, x, idx, w, experts, None, save=True)
    assert torch.equal(saved.out, one_cta.out)
    rows = torch.randperm(T, device="cuda")[:64]
    part = pipeline.forward(plan, *(t[rows].contiguous() for t in (x, idx, w)), experts, None, save=True)
    assert torch.equal(part.out, saved.out[rows])
    dout = torch.randn(T, H, device="cuda").bfloat16()
    dx = pipeline.backward(plan, dout, x, idx, w, experts, None, saved, weight_grads=False).dx
    assert torch.equal(dx, pipeline.backward(single, dout, x, idx, w, experts, None, one_cta, weight_grads=False).dx)
    dx_part = pipeline.backward(plan, dout[rows].contiguous(), *(t[rows].contiguous() for t in (x, idx, w)), experts, None, part,
                                weight_grads=False).dx
    assert torch.equal(dx_part, dx[rows])


def test_power_of_two_scales_follow_their_recipe():
    """fp8_scales="power_of_two": the forward within 1e-2 of the float64 recipe with power-of-two
    scales (and, on Hopper, not the fp32-scale forward's bits), every weight scale a power of two,
    the backward within FP8's error of the bf16 model, the same bits on a second run. (On SM100
    too, through its block-scaled MMAs: tests/test_sm100_gpu.py runs it there.)"""
    from mok.pipeline.fp8_weights import quantized_once
    from mok.reference import moe_reference

    T, H, I, E, k = 900, 1024, 512, 8, 4
    x, idx, w, experts, _ = gpu_layer(T, H, I, E, k, seed=17)
    plan = fp8_plan(x, idx, experts, fp8_scales="power_of_two")
    saved = pipeline.forward(plan, x, idx, w, experts, None, save=True, out=poisoned(T, H))
    assert rel_err(saved.out, fp8_recipe_reference(x, idx, w, experts, power_of_two=True)) < 1e-2
    if not plan.fp8_on_block_scaled_mma:  # (SM100 takes power-of-two scales only)
        assert not torch.equal(saved.out, pipeline.forward(fp8_plan(x, idx, experts), x, idx, w, experts, None).out)
    for weight in experts:
        scales = quantized_once(weight, power_of_two=True)[1]
        assert torch.equal(scales, torch.exp2(torch.log2(scales).round()))
    dout = torch.randn(T, H, device="cuda").bfloat16()
    grads = pipeline.backward(plan, dout, x, idx, w, experts, None, saved)
    leaves = [t.float().requires_grad_() for t in (x, w, *experts)]
    moe_reference(leaves[0], idx, leaves[1], *leaves[2:]).backward(dout.float())
    for name, got, leaf in zip(["dx", "d_topk_w", "d_w_gate", "d_w_up", "d_w_down"],
                               [grads.dx, grads.d_topk_w, grads.d_w_gate, grads.d_w_up, grads.d_w_down], leaves):
        assert rel_err(got, leaf.grad) < 0.15, (name, rel_err(got, leaf.grad))
    again = pipeline.backward(plan, dout, x, idx, w, experts, None, pipeline.forward(plan, x, idx, w, experts, None, save=True))
    assert torch.equal(again.dx, grads.dx) and torch.equal(again.d_w_down, grads.d_w_down)


@pytest.mark.parametrize("wgrad_format", [None, "fp8_block"])
def test_fp8_block_layer_gives_the_pipeline_s_bits(wgrad_format):
    """MoELayer(precision="fp8_block") under autograd (the custom ops, the weights' cache): output
    and every gradient the pipeline's, bit for bit; with ``wgrad_format="fp8_block"`` (the config's)
    the pipeline's FP8 weight gradients."""
    from mok import MoELayer

    T, H, I, E, k = 700, 1024, 512, 8, 2
    x, idx, w, experts, _ = gpu_layer(T, H, I, E, k, seed=12)
    layer = MoELayer(H, I, E, k, precision="fp8_block", device="cuda", wgrad_format=wgrad_format)
    with torch.no_grad():
        for param, weight in zip((layer.gate_proj, layer.up_proj, layer.down_proj), experts):
            param.copy_(weight)
    x_leaf, w_leaf = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = layer(x_leaf, topk_idx=idx, topk_w=w_leaf)
    dout = torch.randn_like(out)
    out.backward(dout)
    plan = fp8_plan(x, idx, experts)
    saved = pipeline.forward(plan, x, idx, w, experts, None, save=True)
    grads = pipeline.backward(plan, dout, x, idx, w, experts, None, saved, wgrad_format=wgrad_format)
    assert torch.equal(out, saved.out) and torch.equal(x_leaf.grad, grads.dx) and torch.equal(w_leaf.grad, grads.d_topk_w)
    for param, want in zip((layer.gate_proj, layer.up_proj, layer.down_proj), (grads.d_w_gate, grads.d_w_up, grads.d_w_down)):
        assert torch.equal(param.grad, want)


def test_fp8_weights_are_quantized_once_per_version():
    """The weights' FP8 copies come from the cache while the weight is unchanged, and again after an
    in-place update: doubling w_down doubles every scale exactly, so the output doubles bit for bit."""
    from mok.pipeline.fp8_weights import quantized_once

    x, idx, w, experts, _ = gpu_layer(512, 1024, 512, 8, 2, seed=6)
    assert quantized_once(experts[2]) is quantized_once(experts[2])
    plan = fp8_plan(x, idx, experts)
    first = pipeline.forward(plan, x, idx, w, experts, None).out
    cached = quantized_once(experts[2])
    experts[2].mul_(2)
    assert quantized_once(experts[2]) is not cached
    assert torch.equal(pipeline.forward(plan, x, idx, w, experts, None).out, first * 2)


@pytest.mark.parametrize("tile_n", [64, 128])
def test_swiglu_backward_on_fp8_matches_float64_of_its_operands(tile_n):
    """ops.swiglu_backward_gemm on FP8 rows of dout and w_down's transpose (block scales): dh, s·a and
    the router pieces against float64 of the dequantized operands and the same saved h, in 64- and
    128-wide column tiles (the latter with the register hand-over: each value the same sums in the
    same order, so dh's and s·a's bits are the 64-wide tile's)."""
    from mok.reference_backward import gated_activation_partials

    R, H, I, E, k = 640, 1024, 256, 4, 2
    g = torch.Generator(device="cuda").manual_seed(8)
    tiles = torch.randint(0, E, (R // 128,), device="cuda", generator=g, dtype=torch.int32)
    experts = tiles.long().repeat_interleave(128)
    dout_q = fp8.quantize_rows(torch.randn(R, H, device="cuda", generator=g))
    w_t = fp8.quantize_weights(torch.randn(E, I, H, device="cuda", generator=g) * H**-0.5)
    h = torch.randn(R, 2 * I, device="cuda", generator=g).bfloat16()
    row_token = torch.arange(R, device="cuda", dtype=torch.int32) // k
    row_slot = torch.arange(R, device="cuda", dtype=torch.int32) % k
    topk_w = torch.rand(R // k, k, device="cuda", generator=g)
    router = dict(row_token=row_token, row_slot=row_slot, topk_w=topk_w)
    dh, a_scaled, pieces = ops.swiglu_backward_gemm(dout_q, w_t, tiles, h, tile_n=tile_n, **router)
    d_a = fp8.block_scaled_gemm_reference(dout_q, w_t, experts)
    s = topk_w.double().flatten()[:, None]
    h_g, h_u = h.double()[:, :I], h.double()[:, I:]
    da_dg, da_du = gated_activation_partials("swiglu", h_g, h_u)
    a = torch.nn.functional.silu(h_g) * h_u
    assert rel_err(dh, torch.cat([s * d_a * da_dg, s * d_a * da_du], 1)) < 1e-2
    assert rel_err(a_scaled, s * a) < 1e-2
    assert rel_err(pieces.sum(1), (d_a * a).sum(1)) < 1e-2 and pieces.shape == (R, I // tile_n)
    if tile_n == 128:
        dh_64, a_scaled_64, _ = ops.swiglu_backward_gemm(dout_q, w_t, tiles, h, tile_n=64, **router)
        assert torch.equal(dh, dh_64) and torch.equal(a_scaled, a_scaled_64)


def test_gathered_fp8_rows_with_their_scales_match_the_rows_gathered_first():
    """The gate/up GEMM gathering x's E4M3 rows and their scales in its producer (each token quantized
    once) against the same product on rows gathered first and quantized per row: the same bits
    (quantizing is per row, so either way a row gets the same elements and scale); padding rows are
    zeros in h."""
    T, H, I, E, k = 1001, 1024, 256, 8, 2
    x, idx, _, (wg, wu, _), _ = gpu_layer(T, H, I, E, k, seed=12)
    sched = ops.device_schedule(idx, E, block_m=128)
    gate, up = fp8.quantize_weights(wg), fp8.quantize_weights(wu)
    h_gathered, h_first = poisoned(sched.capacity, 2 * I), poisoned(sched.capacity, 2 * I)
    a_gathered = ops.grouped_gemm(ops.quantize_fp8_rows(x), gate, sched.tile_expert, b2=up, h_out=h_gathered, gather=sched.row_token)
    rows = ops.gather_rows(x, sched.row_token)
    a_first = ops.grouped_gemm(ops.quantize_fp8_rows(rows), gate, sched.tile_expert, b2=up, h_out=h_first)
    used = sched.tile_expert.long().repeat_interleave(128)[: sched.capacity] >= 0
    assert torch.equal(h_gathered[used], h_first[used]) and torch.equal(a_gathered[used], a_first[used])
    padding = used & (sched.row_token.long() < 0)
    assert padding.any() and (h_gathered[padding] == 0).all()


def tokens_across_magnitudes(H: int, T: int = 777, E: int = 8, k: int = 4):
    """(x [T, H] bf16 with rows from 1e-3 to 1e3, the schedule of a random top-k routing, its rows in use [1] on the device)."""
    g = torch.Generator(device="cuda").manual_seed(H)
    x = (torch.randn(T, H, device="cuda", generator=g) * torch.logspace(-3, 3, T, device="cuda")[:, None]).bfloat16()
    idx = torch.randint(0, E, (T, k), device="cuda", generator=g, dtype=torch.int32)
    sched = ops.device_schedule(idx, E, block_m=128)
    return x, sched, sched.expert_offsets[-1:]


@pytest.mark.parametrize("H,power_of_two", [(2048, False), (2880, True), (7168, False)])  # (2880: a partial last block)
def test_gathering_fp8_rows_gives_the_bits_of_quantizing_the_gathered_rows(H, power_of_two):
    """ops.gather_fp8_rows on x quantized once per token (the one-GPU layer's gate/up rows on
    Hopper) against quantizing the rows as they are gathered: the same bytes and scales over the
    rows in use (padding rows zeros with scale 1, rows of tokens across the whole range of
    magnitudes); the whole index without a count; no rows."""
    x, sched, used_count = tokens_across_magnitudes(H)
    used = int(used_count)
    tokens = ops.quantize_fp8_rows(x, power_of_two=power_of_two)
    q, s = ops.gather_fp8_rows(tokens, sched.row_token, rows_used=used_count)
    want_q, want_s = ops.quantize_fp8_rows(x, power_of_two=power_of_two, row_source=sched.row_token, rows_used=used_count)
    assert (sched.row_token[:used] < 0).any() and (sched.row_token[:used] >= 0).any()
    assert torch.equal(q[:used].view(torch.uint8), want_q[:used].view(torch.uint8)) and torch.equal(s[:, :used], want_s[:, :used])
    padding = sched.row_token[:used] < 0
    assert (q[:used][padding].view(torch.uint8) == 0).all() and (s[:, :used][:, padding] == 1).all()
    index = sched.row_token[:used].contiguous()  # (no count: every row of the index)
    whole_q, whole_s = ops.gather_fp8_rows(tokens, index)
    assert torch.equal(whole_q.view(torch.uint8), want_q[:used].view(torch.uint8)) and torch.equal(whole_s, want_s[:, :used])
    none_q, none_s = ops.gather_fp8_rows(tokens, index[:0])
    assert none_q.shape == (0, H) and none_s.shape == (-(-H // 128), 0)


@pytest.mark.parametrize("H,power_of_two,order", [(2048, False, "rows"), (2880, True, "rows"), (1024, True, "mma")])
def test_quantizing_gathered_rows_gives_the_bits_of_gathering_first(H, power_of_two, order):
    """ops.quantize_fp8_rows(x, row_source=...) (the one-GPU layer's gate/up rows: gathered as they
    are quantized) against the CPU rule on the rows gathered with torch (zeros for padding rows),
    and against quantizing ops.gather_rows' rows: the same bytes and scales over the rows in use;
    padding rows zeros with scale 1. With ``rows_out`` (the backward's dout rows) the same bytes,
    and the bf16 rows ops.gather_rows gives written beside them (poisoned first), none past the rows in use."""
    x, sched, used_count = tokens_across_magnitudes(H)
    options = dict(power_of_two=power_of_two, rows_used=used_count, scale_order=order)
    q, s = ops.quantize_fp8_rows(x, row_source=sched.row_token, **options)
    gathered = ops.gather_rows(x, sched.row_token)
    first_q, first_s = ops.quantize_fp8_rows(gathered, **options)
    used = int(used_count)
    copy = torch.full_like(gathered, float("nan"))
    copy_q, copy_s = ops.quantize_fp8_rows(x, row_source=sched.row_token, rows_out=copy, **options)
    assert torch.equal(copy[:used].view(torch.int16), gathered[:used].view(torch.int16)) and copy[used:].isnan().all()
    assert torch.equal(copy_q[:used].view(torch.uint8), q[:used].view(torch.uint8))
    assert torch.equal(copy_s[: used // 128], s[: used // 128]) if order == "mma" else torch.equal(copy_s[:, :used], s[:, :used])
    source = sched.row_token[:used].long().cpu()
    assert bool((source < 0).any()) and bool((source >= 0).any())
    assert torch.equal(q[:used].view(torch.uint8), first_q[:used].view(torch.uint8))
    if order == "mma":
        assert torch.equal(s[: used // 128], first_s[: used // 128])
        return
    assert torch.equal(s[:, :used], first_s[:, :used])
    rows = torch.where(source[:, None] >= 0, x.cpu()[source.clamp(min=0)], torch.zeros((), dtype=x.dtype))
    want_q, want_s = fp8.quantize_rows(rows, power_of_two=power_of_two)
    assert torch.equal(q[:used].cpu().view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s[:, :used].cpu(), want_s)
    padding = source < 0
    assert (q[:used].cpu()[padding].float() == 0).all() and (s[:, :used].cpu()[:, padding] == 1).all()


@pytest.mark.parametrize("M,power_of_two,gathered", [(2048, False, False), (2880, True, False), (1040, False, True)])
def test_column_quantizer_gives_the_transpose_s_row_bits(M, power_of_two, gathered):
    """ops.quantize_fp8_columns (a weight gradient's K-major FP8 operands: K is the rows) against
    the CPU rule on the transpose: elements [M, R] and scales [R / 128, M] the bytes of
    mok.fp8_block.quantize_rows(rows.T), over the row blocks in use (rows_used), the same on a
    second run; gathered, the rows x[row_token] with zeros for the padding rows; a partial last
    column tile (M % 128); every column scaled differently (magnitudes over six decades)."""
    T, E, k = 600, 8, 4
    g = torch.Generator(device="cuda").manual_seed(M)
    x = (torch.randn(T, M, device="cuda", generator=g) * torch.logspace(-3, 3, M, device="cuda")).bfloat16()
    if gathered:
        sched = ops.device_schedule(torch.randint(0, E, (T, k), device="cuda", generator=g, dtype=torch.int32), E, block_m=128)
        source, used_count = sched.row_token, sched.expert_offsets[-1:]
        rows = torch.where(source[:, None].long() >= 0, x[source.long().clamp(min=0)], torch.zeros((), dtype=x.dtype, device="cuda"))
        q, s = ops.quantize_fp8_columns(x, power_of_two=power_of_two, rows_used=used_count, row_source=source)
    else:
        rows = x[:512].contiguous()
        used_count = torch.tensor([384], dtype=torch.int32, device="cuda")
        q, s = ops.quantize_fp8_columns(rows, power_of_two=power_of_two, rows_used=used_count)
    used = int(used_count)
    assert used % 128 == 0 and 0 < used < rows.shape[0]
    want_q, want_s = fp8.quantize_rows(rows[:used].T.contiguous().cpu(), power_of_two=power_of_two)
    assert q.shape == (M, rows.shape[0]) and s.shape == (rows.shape[0] // 128, M)
    assert torch.equal(q[:, :used].cpu().view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s[: used // 128].cpu(), want_s)
    again_q, again_s = ops.quantize_fp8_columns(*((x,) if gathered else (rows,)), power_of_two=power_of_two, rows_used=used_count,
                                                **(dict(row_source=source) if gathered else {}))
    assert torch.equal(again_q[:, :used].view(torch.uint8), q[:, :used].view(torch.uint8))


@pytest.mark.parametrize("M,segments", [(1024, 1), (2880, 1), (2080, 2)])
@pytest.mark.parametrize("gathered", [False, True])
def test_column_quantizer_in_the_mma_order_gives_the_blocks_as_e8m0(gathered, M, segments):
    """ops.quantize_fp8_columns(scale_order="mma") (SM100's weight gradients on FP8 take it as the
    MXFP8 weight-gradient kernel's operands; the quantizer is arch-neutral, so checked here), into
    outputs poisoned with 0xFF (NaN as E4M3 and as E8M0): the elements in the rows' own layout, the
    bytes of mok.fp8_block.quantize_rows(rows.T) (power-of-two rule) transposed back, also those of
    the fp32-scale form; each column's 128-row block scale as its E8M0 byte at the block's four
    32-blocks in mok.mxfp8's MMA order (mma_order_reference); the row blocks past rows_used left
    as they were; gathered: the rows x[row_token], zeros for the padding rows; magnitudes over six
    decades across the columns. M = 2880: the chunk rows past M padding (127); 2080 in two segments
    (dh's halves of 1040): each half's columns starting a chunk."""
    T, E, k = 600, 8, 4
    g = torch.Generator(device="cuda").manual_seed(23 + gathered)
    x = (torch.randn(T, M, device="cuda", generator=g) * torch.logspace(-3, 3, M, device="cuda")).bfloat16()
    if gathered:
        sched = ops.device_schedule(torch.randint(0, E, (T, k), device="cuda", generator=g, dtype=torch.int32), E, block_m=128)
        source, used_count = sched.row_token, sched.expert_offsets[-1:]
        rows = torch.where(source[:, None].long() >= 0, x[source.long().clamp(min=0)], torch.zeros((), dtype=x.dtype, device="cuda"))
        call = dict(x=x, row_source=source)
    else:
        rows, used_count = x[:512].contiguous(), torch.tensor([384], dtype=torch.int32, device="cuda")
        call = dict(x=rows)
    R, used = rows.shape[0], int(used_count)
    assert used % 128 == 0 and 0 < used < R
    out = (torch.full((R, M), 0xFF, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn),
           torch.full((segments * -(-M // segments // 128), R // 128, 512), 0xFF, dtype=torch.uint8, device="cuda"))
    q, s = ops.quantize_fp8_columns(**call, power_of_two=True, rows_used=used_count, scale_order="mma", out=out, segments=segments)
    assert q.data_ptr() == out[0].data_ptr() and s.data_ptr() == out[1].data_ptr()
    want_q, want_s = fp8.quantize_rows(rows[:used].T.contiguous().cpu(), power_of_two=True)
    assert torch.equal(q[:used].cpu().view(torch.uint8), want_q.T.contiguous().view(torch.uint8))
    assert torch.equal(s[:, : used // 128].cpu(), torch.cat([mma_order_reference(half) for half in want_s.chunk(segments, dim=1)]))
    assert bool((q[used:].view(torch.uint8) == 0xFF).all()) and bool((s[:, used // 128:] == 0xFF).all())  # (past the count: untouched)
    fp32_form, _ = ops.quantize_fp8_columns(**call, power_of_two=True, rows_used=used_count)
    assert torch.equal(q[:used].view(torch.uint8), fp32_form[:, :used].T.contiguous().view(torch.uint8))


@pytest.mark.parametrize("form", ["plain", "split_out", "accumulate"])
def test_weight_grad_on_fp8_matches_float64_of_its_operands(form, monkeypatch):
    """ops.weight_grad on FP8 block-scaled transposes (ops.quantize_fp8_columns of the rows) against
    float64 of the same dequantized operands, expert by expert: experts of 300, 0, 128, 77, 250 and
    600 rows (3, 0, 1, 1, 2 and 5 row blocks: the two-stage loop's odd and even ends; offsets at
    128-row blocks, padding rows zero), a partial last column tile (N = 400); into a
    new gradient; split_out into two poisoned halves with the padding row blocks skipped
    (``counts``); or added into a random fp32 gradient (main_grad), counted too. An expert without
    rows gets zeros (or is left as it was); the same bits on a second run, with deep turns, and
    (fp32) without them, where a tile's epilogue does not run under the next tile's first stage;
    with one stage of a tile issued before the previous tile's epilogue as with two (the default
    variants.WEIGHT_GRAD_STAGES_UNDER_EPILOGUE: tiles of 0, 1, 2, 3 and 5 stages), and with either
    when the two MMA warpgroups issue each stage in a fixed order (variants.ISSUE_ORDER's
    "weight_grad")."""
    counts = [300, 0, 128, 77, 250, 600]
    E, M, N = len(counts), 512, 400
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + -(-c // 128) * 128)
    R = offsets[-1]
    g = torch.Generator(device="cuda").manual_seed(31)
    a, b = torch.zeros(R, M, device="cuda"), torch.zeros(R, N, device="cuda")
    for e, c in enumerate(counts):
        a[offsets[e]:offsets[e] + c] = torch.randn(c, M, device="cuda", generator=g)
        b[offsets[e]:offsets[e] + c] = torch.randn(c, N, device="cuda", generator=g) * torch.logspace(-2, 2, N, device="cuda")
    a_q, b_q = ops.quantize_fp8_columns(a.bfloat16()), ops.quantize_fp8_columns(b.bfloat16())
    a_deq, b_deq = fp8.dequantize_rows(*a_q).double(), fp8.dequantize_rows(*b_q).double()  # [M, R], [N, R]
    want = torch.stack([a_deq[:, offsets[e]:offsets[e + 1]] @ b_deq[:, offsets[e]:offsets[e + 1]].T for e in range(E)])
    offsets_t = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    counted = dict(counts=torch.tensor(counts, dtype=torch.int32, device="cuda"))
    if form == "accumulate":
        start = torch.randn(E, M, N, device="cuda", generator=g)
        got, again = start.clone(), start.clone()
        for out in (got, again):
            ops.weight_grad(a_q, b_q, offsets_t, out=out, accumulate=True, **counted)
        one_at_a_time = start.clone()  # (fp32 out without deep turns: each tile's epilogue after its own mainloop)
        ops.weight_grad(a_q, b_q, offsets_t, out=one_at_a_time, accumulate=True, deep_turn=0, **counted)
        assert torch.equal(one_at_a_time, got)
        want = want + start.double()
    elif form == "split_out":
        halves = tuple(poisoned(E * M // 2, N).view(E, M // 2, N) for _ in range(2))
        got = torch.cat(ops.weight_grad(a_q, b_q, offsets_t, out=halves, split_out=True, **counted), 1)
        again = torch.cat(ops.weight_grad(a_q, b_q, offsets_t, split_out=True, **counted), 1)
    else:
        got, again = (ops.weight_grad(a_q, b_q, offsets_t) for _ in range(2))
        for deep_turn in (2, 4):  # (two stages in flight for turns of 2 or 4: 600 rows' 5 blocks are one or two turns and an end)
            assert torch.equal(ops.weight_grad(a_q, b_q, offsets_t, deep_turn=deep_turn), got), deep_turn
    assert got.shape == (E, M, N) and not got.isnan().any()
    assert rel_err(got, want) < (2e-3 if form == "accumulate" else 5e-3)
    assert torch.equal(got[1], want[1].to(got.dtype))  # (no rows: zeros, or the gradient as it was)
    assert torch.equal(again, got)

    def under_settings():  # (the form again, under variants' settings as they are now)
        if form == "accumulate":
            out = start.clone()
            ops.weight_grad(a_q, b_q, offsets_t, out=out, accumulate=True, **counted)
            return out
        if form == "split_out":
            return torch.cat(ops.weight_grad(a_q, b_q, offsets_t, split_out=True, **counted), 1)
        return ops.weight_grad(a_q, b_q, offsets_t)

    monkeypatch.setattr(variants, "WEIGHT_GRAD_STAGES_UNDER_EPILOGUE", 1)
    assert torch.equal(under_settings(), got)
    if form == "plain":
        assert torch.equal(ops.weight_grad(a_q, b_q, offsets_t, deep_turn=2), got)  # (turns of 2 from stage 1: set 1 first)
    monkeypatch.setattr(variants, "ISSUE_ORDER", frozenset({"weight_grad"}))
    for under in (1, 2):
        monkeypatch.setattr(variants, "WEIGHT_GRAD_STAGES_UNDER_EPILOGUE", under)
        assert torch.equal(under_settings(), got), under


def test_fp8_weight_gradients_in_the_backward(fp8_scales="fp32"):
    """pipeline.backward(wgrad_format="fp8_block"): the weight gradients on the FP8 transposes of the
    same rows (x's gathered as they are quantized) within FP8's error of the same backward's bf16
    weight gradients, dx and d_topk_w the same bits (the weight gradients take no part in them);
    added into main_grad as the fresh ones; the same bits on a second run. (SM100, which takes
    power-of-two scales only, runs it with them: tests/test_sm100_gpu.py.)"""
    T, H, I, E, k = 900, 1024, 512, 8, 4
    x, idx, w, experts, _ = gpu_layer(T, H, I, E, k, seed=41)
    plan = fp8_plan(x, idx, experts, fp8_scales=fp8_scales)
    if plan.fp8_on_block_scaled_mma and not plan.config.fp8_power_of_two:
        pytest.skip("SM100's block-scaled MMAs take power-of-two scales (tests/test_sm100_gpu.py runs this with them)")
    saved = pipeline.forward(plan, x, idx, w, experts, None, save=True)
    dout = torch.randn(T, H, device="cuda").bfloat16()
    bf16 = pipeline.backward(plan, dout, x, idx, w, experts, None, saved)
    fp8w, again = (pipeline.backward(plan, dout, x, idx, w, experts, None, saved, wgrad_format="fp8_block") for _ in range(2))
    assert torch.equal(fp8w.dx, bf16.dx) and torch.equal(fp8w.d_topk_w, bf16.d_topk_w)
    names = ("d_w_gate", "d_w_up", "d_w_down")
    for name in names:
        assert rel_err(getattr(fp8w, name), getattr(bf16, name)) < 0.1, (name, rel_err(getattr(fp8w, name), getattr(bf16, name)))
        assert torch.equal(getattr(again, name), getattr(fp8w, name))
    mains = tuple(torch.randn(t.shape, device="cuda") for t in experts)
    start = tuple(m.clone() for m in mains)
    pipeline.backward(plan, dout, x, idx, w, experts, None, saved, main_grads=mains, wgrad_format="fp8_block")
    for main, before, name in zip(mains, start, names):
        assert rel_err(main - before, getattr(fp8w, name).float()) < 1e-2, name


def test_promotions_allowed_to_yield_give_the_same_bits(monkeypatch):
    """variants.PROMOTIONS_YIELD (a share of the promotions' FFMAs patched to let the scheduler switch
    warps: mok/runtime/sass_hints.py), all of them or each burst's first half: a forward and a
    backward with FP8 weight gradients, every FP8 kernel of the layer among them, give the bits they
    give without it."""
    T, H, I, E, k = 900, 2048, 768, 8, 4
    x, idx, w, experts, _ = gpu_layer(T, H, I, E, k, seed=43)
    dout = torch.randn(T, H, device="cuda", generator=torch.Generator(device="cuda").manual_seed(44)).bfloat16()
    results = []
    for share in (0.0, 1.0, 0.5):
        monkeypatch.setattr(variants, "PROMOTIONS_YIELD", share)
        plan = fp8_plan(x, idx, experts)
        saved = pipeline.forward(plan, x, idx, w, experts, None, save=True)
        grads = pipeline.backward(plan, dout, x, idx, w, experts, None, saved, wgrad_format="fp8_block")
        results.append((saved.out, grads.dx, grads.d_topk_w, grads.d_w_gate, grads.d_w_up, grads.d_w_down))
    for hinted in results[1:]:
        for plain, patched in zip(results[0], hinted):
            assert torch.equal(plain, patched)


@pytest.mark.parametrize("k_blocks", [1, 2, 9, 10])
def test_ordered_issue_gives_the_free_order_s_bits(k_blocks, monkeypatch):
    """variants.ISSUE_ORDER in every form (the two MMA warpgroups issue each stage's WGMMAs in a
    fixed order, through a named barrier both meet once a stage): the plain GEMM on one set and on
    two in turns of 4, the SwiGLU forward with h and the SwiGLU backward, at odd and even K block
    counts with an unused tile, give the free order's bits (the unused tile left unwritten; the
    plain product against the float64 one of its operands)."""
    R, N, K, E = 900, 384, 128 * k_blocks, 3
    a_q, b_q, b2_q, tiles, experts = operands(R, N, K, E, seed=200 + k_blocks, two=True)
    used = experts >= 0
    g = torch.Generator(device="cuda").manual_seed(300 + k_blocks)
    h = torch.randn(R, 2 * N, device="cuda", generator=g).bfloat16()
    w_q = fp8.quantize_weights(torch.randn(E, N, K, device="cuda", generator=g) * K**-0.5)
    rows = torch.arange(R, device="cuda", dtype=torch.int32)
    router = dict(row_token=rows // 2, row_slot=rows % 2, topk_w=torch.rand(-(-R // 2), 2, device="cuda", generator=g))

    def forms():
        outs = []
        for sets in (1, 2):
            out = poisoned(R, N)
            ops.grouped_gemm(a_q, b_q, tiles, out=out, block_buffers=sets)
            outs.append(out)
        out, h_out = poisoned(R, N), poisoned(R, 2 * N)
        ops.grouped_gemm(a_q, b_q, tiles, b2=b2_q, out=out, h_out=h_out)
        outs += [out, h_out, *(t for t in ops.swiglu_backward_gemm(a_q, w_q, tiles, h, **router) if t is not None)]
        return outs

    monkeypatch.setattr(variants, "ISSUE_ORDER", frozenset())
    free = forms()
    monkeypatch.setattr(variants, "ISSUE_ORDER", frozenset(EPILOGUES))
    ordered = forms()
    for i, (want, got) in enumerate(zip(free, ordered)):
        if i < 4:  # (the forward forms' rows of the unused tile stay as they were)
            assert got[~used].isnan().all(), i
        assert torch.equal(got[used], want[used]), i
    assert rel_err(ordered[1][used], fp8.block_scaled_gemm_reference(a_q, b_q, experts)[used]) < 5e-3
