"""The FP8 block-scaled grouped GEMM on the H200 (DeepSeek-V3's recipe: mok.fp8_block's operands on
Hopper's FP8 WGMMAs, promoted into fp32 every 128 of K: mok/kernels/sm90/block_scaled.py).

Against the float64 product of the same (dequantized) operands: the plain, SwiGLU (with h) and
k-split forms, a last row tile that is partial, unused tiles left unwritten (outputs poisoned
first), expert biases in the epilogue, and the same bits on every run and for each row alone."""

import pytest
import torch

from mok import fp8_block as fp8
from mok import ops

from helpers import poisoned, rel_err

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


@pytest.mark.parametrize("R,N,K,E", [(1000, 256, 2048, 4), (644, 2048, 7168, 3)])
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
