"""The Blackwell grouped GEMM (mok/kernels/sm100/grouped_gemm.py) against the float32 reference.

For a B200 / GB200 / B300: skipped everywhere else. No such GPU was available to this project, so
these tests have never run; the kernel is compile-verified only (tests/test_kernels_ptx.py). Run
them with ``CUDA_LAUNCH_BLOCKING=1 python -m pytest -q -x -m sm100`` on one.
"""

import pytest
import torch

from mok import ops
from mok.kernels.variants import default_tile_n

from helpers import assert_scatters_into_two_ranks_slots, poisoned, rel_err

pytestmark = pytest.mark.sm100


def _operands(rows, n, k, experts, epilogue, b_major, k_split, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
    b_k = k // 2 if k_split else k
    shape = (experts, n, b_k) if b_major == "k" else (experts, b_k, n)
    b = (torch.randn(shape, device="cuda", generator=g) * k ** -0.5).bfloat16()
    b2 = (torch.randn(shape, device="cuda", generator=g) * k ** -0.5).bfloat16() if epilogue != "plain" or k_split else None
    tiles = -(-rows // 128)
    tile_expert = torch.randint(0, experts, (tiles,), device="cuda", dtype=torch.int32, generator=g)
    if tiles > 1:
        tile_expert[1] = -1  # a skipped tile keeps its (poisoned) output rows
    return a, b, b2, tile_expert


def _expert_matrix(b, e, b_major):
    """Expert e's weights as the [K, N] matrix the GEMM multiplies by."""
    return b[e].float().T if b_major == "k" else b[e].float()


@pytest.mark.parametrize(
    "rows,n,k,experts,epilogue,b_major,k_split",
    [
        (1000, 256, 192, 5, "plain", "k", False),  # a partial last tile, K of three stages
        (384, 7168, 2048, 2, "plain", "k", False),  # the down projection's shapes (256-wide tiles)
        (300, 768, 2048, 3, "swiglu", "k", False),
        (520, 768, 2048, 4, "swiglu_save", "k", False),
        (400, 2048, 1536, 3, "plain", "n", True),  # the backward's dx: N-major weights, K in two halves
        (37, 128, 64, 1, "swiglu_save", "k", False),  # one partial tile, one K tile
        (520, 1032, 2056, 3, "swiglu_save", "k", False),  # widths the tiles do not divide: the last column and K tiles partial
        (400, 2056, 2064, 3, "plain", "n", True),  # dx with halves of K = 1032: each half's last K tile partial
    ],
)
@pytest.mark.parametrize("persistent", [True, False])
def test_sm100_grouped_gemm_matches_the_float32_reference(rows, n, k, experts, epilogue, b_major, k_split, persistent):
    a, b, b2, tile_expert = _operands(rows, n, k, experts, epilogue, b_major, k_split, seed=rows + n)
    h = poisoned(rows, 2 * n) if epilogue == "swiglu_save" else None
    out = ops.grouped_gemm(a, b, tile_expert, b2=b2, out=poisoned(rows, n), h_out=h, b_major=b_major, k_split=k_split,
                           persistent=persistent)
    again = ops.grouped_gemm(a, b, tile_expert, b2=b2, out=poisoned(rows, n), h_out=poisoned(*h.shape) if h is not None else None,
                             b_major=b_major, k_split=k_split, persistent=persistent)
    for t in range(-(-rows // 128)):
        rs = slice(128 * t, min(128 * (t + 1), rows))
        e = int(tile_expert[t])
        if e < 0:
            assert out[rs].isnan().all() and (h is None or h[rs].isnan().all())
            continue
        af = a[rs].float()
        if k_split:
            want = af[:, : k // 2] @ _expert_matrix(b, e, b_major) + af[:, k // 2 :] @ _expert_matrix(b2, e, b_major)
        else:
            want = af @ _expert_matrix(b, e, b_major)
        if epilogue != "plain":
            gate, up = want, af @ _expert_matrix(b2, e, b_major)
            want = torch.nn.functional.silu(gate) * up
            if h is not None:
                assert not h[rs].isnan().any()
                assert rel_err(h[rs, :n], gate) < 1e-2 and rel_err(h[rs, n:], up) < 1e-2
        assert not out[rs].isnan().any()
        assert rel_err(out[rs], want) < 1e-2
    assert torch.equal(out.nan_to_num(), again.nan_to_num())  # deterministic


@pytest.mark.parametrize("epilogue", ["plain", "swiglu_save"])
def test_sm100_persistent_ctas_walking_many_tiles_give_the_one_tile_kernels_bits(epilogue):
    """More output tiles than SMs (each persistent CTA takes several, through both accumulator
    stages, skipped tiles among them): the same bits as one CTA per tile, and the reference."""
    rows, n, k = 20000, 1024 if epilogue == "plain" else 512, 512
    a, b, b2, tile_expert = _operands(rows, n, k, 6, epilogue, "k", False, seed=11)
    tile_expert[5::7] = -1
    outs = []
    for persistent in (True, False):
        h = poisoned(rows, 2 * n) if epilogue == "swiglu_save" else None
        outs.append((ops.grouped_gemm(a, b, tile_expert, b2=b2, out=poisoned(rows, n), h_out=h, persistent=persistent), h))
    (out, h), (one_tile, h_one_tile) = outs
    assert torch.equal(out.nan_to_num(), one_tile.nan_to_num())
    if h is not None:
        assert torch.equal(h.nan_to_num(), h_one_tile.nan_to_num())
    for t in range(-(-rows // 128)):
        rs, e = slice(128 * t, min(128 * (t + 1), rows)), int(tile_expert[t])
        if e < 0:
            assert out[rs].isnan().all()
            continue
        gate = a[rs].float() @ b[e].float().T
        want = gate if epilogue == "plain" else torch.nn.functional.silu(gate) * (a[rs].float() @ b2[e].float().T)
        assert rel_err(out[rs], want) < 1e-2


@pytest.mark.parametrize("T,H,I,E,k", [(1000, 512, 256, 8, 2), (333, 384, 128, 4, 3)])
def test_sm100_scatter_gemm_writes_each_row_into_its_slot_with_the_gemms_bits(T, H, I, E, k):
    """grouped_gemm_scatter (expert parallelism's push) writes row r into slots[token, slot] with the
    bits grouped_gemm gives row r: one GPU, then two "ranks" whose slots lie a stride apart in one
    buffer (the gap between them untouched)."""
    g = torch.Generator(device="cuda").manual_seed(T + k)
    idx = torch.stack([torch.randperm(E, device="cuda", generator=g)[:k] for _ in range(T)]).int()
    sched = ops.device_schedule(idx, E)
    a = torch.randn(sched.row_token.shape[0], I, device="cuda", generator=g).bfloat16()
    wd = (torch.randn(E, H, I, device="cuda", generator=g) * I ** -0.5).bfloat16()
    want = ops.grouped_gemm(a, wd, sched.tile_expert)[sched.slot_row.long()]  # [T, k, H]
    slots = poisoned(T, k, H)
    ops.grouped_gemm_scatter(a, wd, sched.tile_expert, sched.row_token, sched.row_slot, slots)
    assert torch.equal(slots, want)
    assert_scatters_into_two_ranks_slots(a, wd, sched, want)


def test_sm100_grouped_gemm_adds_the_experts_biases_before_the_activation():
    """bias, bias2 [E, N]: h = [a·Bᵀ + b | a·B2ᵀ + b2] and the output SwiGLU of those (swiglu_save)."""
    rows, n, k, experts = 520, 256, 512, 4
    a, b, b2, tile_expert = _operands(rows, n, k, experts, "swiglu_save", "k", False, seed=5)
    g = torch.Generator(device="cuda").manual_seed(6)
    bias, bias2 = (torch.randn(experts, n, device="cuda", generator=g).bfloat16() for _ in range(2))
    h = poisoned(rows, 2 * n)
    out = ops.grouped_gemm(a, b, tile_expert, b2=b2, out=poisoned(rows, n), h_out=h, bias=bias, bias2=bias2)
    for t in range(-(-rows // 128)):
        rs, e = slice(128 * t, min(128 * (t + 1), rows)), int(tile_expert[t])
        if e < 0:
            continue
        gate = a[rs].float() @ b[e].float().T + bias[e].float()
        up = a[rs].float() @ b2[e].float().T + bias2[e].float()
        assert rel_err(h[rs, :n], gate) < 1e-2 and rel_err(h[rs, n:], up) < 1e-2
        assert rel_err(out[rs], torch.nn.functional.silu(gate) * up) < 1e-2


@pytest.mark.parametrize("tokens,hidden,inter", [(700, 512, 256), (300, 2056, 1032)])
def test_sm100_gathering_gate_up_gemm_gives_the_bits_of_rows_gathered_first(tokens, hidden, inter):
    """gather=row_token (the gather warps copy x's rows, zeros for padding rows): h and the output
    bitwise those of the same GEMM on rows gathered first."""
    g = torch.Generator(device="cuda").manual_seed(tokens)
    experts, topk = 4, 2
    idx = torch.stack([torch.randperm(experts, device="cuda", generator=g)[:topk] for _ in range(tokens)]).int()
    sched = ops.device_schedule(idx, experts)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    wg, wu = ((torch.randn(experts, inter, hidden, device="cuda", generator=g) * hidden ** -0.5).bfloat16() for _ in range(2))
    rows = ops.gather_rows(x, sched.row_token)
    h_want = poisoned(rows.shape[0], 2 * inter)
    want = ops.grouped_gemm(rows, wg, sched.tile_expert, b2=wu, h_out=h_want, out=poisoned(rows.shape[0], inter))
    h = poisoned(rows.shape[0], 2 * inter)
    got = ops.grouped_gemm(x, wg, sched.tile_expert, b2=wu, h_out=h, gather=sched.row_token, out=poisoned(rows.shape[0], inter))
    used = int(sched.expert_offsets[-1])  # the schedule's rows; the worst case's tiles past them are skipped: NaN in both
    assert not got[:used].isnan().any() and got[used:].isnan().all()
    assert torch.equal(got[:used], want[:used]) and torch.equal(h[:used], h_want[:used])


def test_sm100_grouped_gemm_rows_do_not_depend_on_the_other_tiles():
    """Batch invariance: a row tile's output is the same bits whatever the other tiles hold."""
    a, b, b2, tile_expert = _operands(640, 768, 2048, 3, "swiglu", "k", False, seed=7)
    tile_expert[1] = 2
    first = ops.grouped_gemm(a, b, tile_expert, b2=b2)
    other = a.clone()
    other[128:] = torch.randn_like(other[128:].float()).bfloat16()
    second = ops.grouped_gemm(other, b, tile_expert, b2=b2)
    assert torch.equal(first[:128], second[:128])


@pytest.mark.parametrize("rows,hidden,inter,experts,topk", [(700, 512, 256, 3, 4), (300, 2048, 768, 2, 8), (130, 256, 128, 1, 1), (260, 1032, 2056, 3, 4)])
def test_sm100_swiglu_backward_gemm_matches_the_float32_reference(rows, hidden, inter, experts, topk):
    """dh, s·a and the router gradient's per-tile pieces from dA_u = dout_rows·W_down (ops.swiglu_backward_gemm)."""
    g = torch.Generator(device="cuda").manual_seed(rows + hidden)
    tokens = 97
    dout_rows = torch.randn(rows, hidden, device="cuda", generator=g).bfloat16()
    w_down = (torch.randn(experts, hidden, inter, device="cuda", generator=g) * hidden ** -0.5).bfloat16()
    h = torch.randn(rows, 2 * inter, device="cuda", generator=g).bfloat16()
    row_token = torch.randint(-1, tokens, (rows,), device="cuda", dtype=torch.int32, generator=g)  # -1: padding rows
    row_slot = torch.randint(0, topk, (rows,), device="cuda", dtype=torch.int32, generator=g)
    topk_w = torch.rand(tokens, topk, device="cuda", generator=g)
    tile_expert = torch.randint(0, experts, (-(-rows // 128),), device="cuda", dtype=torch.int32, generator=g)
    dh, a_scaled, partial = ops.swiglu_backward_gemm(
        dout_rows, w_down, tile_expert, h, row_token=row_token, row_slot=row_slot, topk_w=topk_w
    )
    tile_n = default_tile_n(inter, hidden, True)
    col_tiles = -(-inter // tile_n)  # (the last one partial where the tile does not divide I)
    assert partial.shape[1] == col_tiles
    e_of_row = tile_expert.repeat_interleave(128)[:rows].long()
    d_a = torch.einsum("rh,rhi->ri", dout_rows.float(), w_down[e_of_row].float())
    s = torch.where(row_token >= 0, topk_w[row_token.clamp(min=0).long(), row_slot.long()], torch.zeros((), device="cuda"))[:, None]
    h_g, h_u = h[:, :inter].float(), h[:, inter:].float()
    sig = torch.sigmoid(h_g)
    a = h_g * sig * h_u
    want_dh = torch.cat([s * d_a * h_u * sig * (1 + h_g * (1 - sig)), s * d_a * h_g * sig], dim=1)
    want_partial = torch.nn.functional.pad(d_a * a, (0, col_tiles * tile_n - inter)).reshape(rows, col_tiles, tile_n).sum(-1)
    assert rel_err(dh, want_dh) < 1e-2 and rel_err(a_scaled, s * a) < 1e-2
    assert rel_err(partial, want_partial) < 1e-3
    again = ops.swiglu_backward_gemm(
        dout_rows, w_down, tile_expert, h, row_token=row_token, row_slot=row_slot, topk_w=topk_w
    )
    assert all(torch.equal(x, y) for x, y in zip((dh, a_scaled, partial), again))  # deterministic


@pytest.mark.parametrize("m,n,split_out,accumulate", [(256, 384, False, False), (512, 256, True, False), (256, 256, True, True),
                                                       (384, 128, False, True),
                                                       (272, 200, True, False), (136, 264, False, True),  # partial row and column tiles
                                                       (768, 256, True, True)])  # 3 row tiles a half: a pair's second CTA past it
@pytest.mark.parametrize("persistent", [True, False])
def test_sm100_weight_grad_matches_the_float32_reference(m, n, split_out, accumulate, persistent):
    """out[e] (+)= a[rows of e]ᵀ·b[rows of e] (ops.weight_grad): experts of 128-row blocks with
    zero padding rows, one expert without rows (zeros, or left as it was when accumulating). Every
    M here but split_out's 256 (one row tile a half) runs on CTA pairs (cta_group::2)."""
    g = torch.Generator(device="cuda").manual_seed(m + n)
    counts = torch.tensor([200, 0, 77, 128], dtype=torch.int32)
    blocks = (counts + 127) // 128
    offsets = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(blocks * 128, 0).to(torch.int32)])
    rows = int(offsets[-1])
    used = torch.zeros(rows, dtype=torch.bool)
    for e, c in enumerate(counts.tolist()):
        used[int(offsets[e]) : int(offsets[e]) + c] = True
    used = used.cuda()[:, None]
    a = torch.where(used, torch.randn(rows, m, device="cuda", generator=g), torch.zeros((), device="cuda")).bfloat16()
    b = torch.where(used, torch.randn(rows, n, device="cuda", generator=g), torch.zeros((), device="cuda")).bfloat16()
    experts = counts.shape[0]
    want = torch.stack([a[int(offsets[e]) : int(offsets[e + 1])].float().T @ b[int(offsets[e]) : int(offsets[e + 1])].float()
                        for e in range(experts)])
    offsets, counts = offsets.cuda(), counts.cuda()
    kw = dict(counts=counts, split_out=split_out, persistent=persistent)
    if accumulate:
        shape = (experts, m // 2, n) if split_out else (experts, m, n)
        before = [torch.randn(shape, device="cuda", generator=g) for _ in range(2 if split_out else 1)]
        out = [t.clone() for t in before]
        got = ops.weight_grad(a, b, offsets, out=tuple(out) if split_out else out[0], accumulate=True, **kw)
        got = torch.cat(got, dim=1) if split_out else got
        want = want + torch.cat(before, dim=1)
        assert torch.equal(got[1], torch.cat(before, dim=1)[1])  # the expert without rows: untouched
    else:
        got = ops.weight_grad(a, b, offsets, **kw)
        got = torch.cat(got, dim=1) if split_out else got
        assert torch.equal(got[1], torch.zeros_like(got[1]))  # the expert without rows: zeros
    for e in (0, 2, 3):
        assert rel_err(got[e], want[e]) < 1e-2


@pytest.mark.parametrize("T,H,I,E,k,shared_inter,routing", [
    (4096, 7168, 2048, 32, 8, None, "uniform"), (1000, 512, 256, 8, 2, 384, "uniform"), (300, 256, 128, 8, 1, None, "one_expert"),
])
def test_sm100_layer_forward_and_backward_match_the_float32_reference(T, H, I, E, k, shared_inter, routing, monkeypatch):
    """The single-GPU layer on SM100 (``MOK_UNVERIFIED_SM100=1``): its forward against the fp32
    reference, its gradients against autograd of it (tests/test_backward_gpu.py's checks)."""
    from mok.reference import moe_reference

    from helpers import gpu_layer, moe_forward, worst_row_err
    from test_backward_gpu import check_backward_against_autograd

    monkeypatch.setenv("MOK_UNVERIFIED_SM100", "1")
    x, idx, w, experts, shared = gpu_layer(T, H, I, E, k, shared_inter, seed=T, routing=routing)
    out = moe_forward(x, idx, w, *experts, shared, out=poisoned(T, H)).out
    f32 = lambda t: t.float()  # noqa: E731
    want = moe_reference(f32(x), idx, w, *map(f32, experts), tuple(map(f32, shared)) if shared else None)
    assert not out.isnan().any() and rel_err(out, want) < 1e-2 and worst_row_err(out, want) < 5e-2
    again = moe_forward(x, idx, w, *experts, shared).out
    assert torch.equal(out, again)
    check_backward_against_autograd(T, H, I, E, k, shared_inter, routing)


@pytest.mark.parametrize(
    "rows,n,k,experts,epilogue,tile_n",
    [
        (1000, 256, 384, 5, "plain", 128),  # a partial last tile, K of three stages
        (384, 7168, 2048, 2, "plain", 256),  # the down projection's shapes
        (300, 768, 2048, 3, "swiglu", 128),
        (520, 2048, 7168, 4, "swiglu_save", 128),  # the gate/up projection's shapes (dsv3-like)
        (37, 128, 128, 1, "swiglu_save", 128),  # one partial tile, one K tile
        (400, 2048, 1536, 3, "k_split", 256),  # the backward's dx: K's halves from B and B2 (transposed weights)
    ],
)
def test_sm100_mxfp8_grouped_gemm_matches_the_float64_product_of_its_dequantized_operands(rows, n, k, experts, epilogue, tile_n):
    """ops.grouped_gemm on MXFP8 operands quantized by mok.mxfp8 (blocks' magnitudes spread over
    2^-6..2^6 so a misplaced scale shows): against float64 products of the dequantized operands (every product
    exact; the kernel's only rounding is its fp32 sums and the bf16 output)."""
    from mok.mxfp8 import dequantize_mxfp8, mma_scale_layout, quantize_mxfp8

    g = torch.Generator(device="cuda").manual_seed(rows + n + k)

    def spread(shape):  # values whose blocks of 32 have very different magnitudes
        x = torch.randn(shape, device="cuda", generator=g)
        blocks = torch.randint(-6, 7, (*shape[:-1], shape[-1] // 32), device="cuda", generator=g).float()
        return (x * torch.exp2(blocks).repeat_interleave(32, dim=-1)).bfloat16()

    tiles = -(-rows // 128)
    k_split = epilogue == "k_split"
    a_q, a_s = quantize_mxfp8(spread((rows, k)))
    weights = [quantize_mxfp8(spread((experts, n, k // 2 if k_split else k))) for _ in range(1 if epilogue == "plain" else 2)]
    tile_expert = torch.randint(0, experts, (tiles,), device="cuda", dtype=torch.int32, generator=g)
    if tiles > 1:
        tile_expert[1] = -1  # a skipped tile keeps its (poisoned) output rows
    b, b_s = weights[0]
    b2, b2_s = weights[1] if len(weights) == 2 else (None, None)
    h = poisoned(rows, 2 * n) if epilogue == "swiglu_save" else None

    def run():
        return ops.grouped_gemm(
            (a_q, mma_scale_layout(a_s)), (b, mma_scale_layout(b_s)), tile_expert, b2=None if b2 is None else (b2, mma_scale_layout(b2_s)),
            k_split=k_split, out=poisoned(rows, n), h_out=h, tile_n=tile_n,
        )

    out = run()
    a_f = dequantize_mxfp8(a_q, a_s).double()
    b_f = [dequantize_mxfp8(q, s).double() for q, s in weights]
    for t in range(tiles):
        rs = slice(128 * t, min(128 * (t + 1), rows))
        e = int(tile_expert[t])
        if e < 0:
            assert out[rs].isnan().all() and (h is None or h[rs].isnan().all())
            continue
        gate = a_f[rs] @ b_f[0][e].T if not k_split else a_f[rs, : k // 2] @ b_f[0][e].T + a_f[rs, k // 2 :] @ b_f[1][e].T
        want = gate
        if epilogue in ("swiglu", "swiglu_save"):
            up = a_f[rs] @ b_f[1][e].T
            want = torch.nn.functional.silu(gate) * up
            if h is not None:
                assert rel_err(h[rs, :n], gate) < 1e-2 and rel_err(h[rs, n:], up) < 1e-2
        assert not out[rs].isnan().any()
        assert rel_err(out[rs], want) < 1e-2
    assert torch.equal(out.nan_to_num(), run().nan_to_num())  # deterministic


@pytest.mark.parametrize("T,H,I,E,k,shared_inter,routing", [
    (4096, 7168, 2048, 32, 8, None, "uniform"), (1000, 512, 256, 8, 2, 384, "uniform"), (300, 256, 128, 8, 1, None, "one_expert"),
])
def test_sm100_mxfp8_forward_matches_the_reference_on_mxfp8_rounded_operands(T, H, I, E, k, shared_inter, routing):
    """The MXFP8 forward (precision="mxfp8": the routed experts' GEMMs on MXFP8 operands): against the float64
    reference of the same roundings; deterministic, and a token's output the same bits whatever
    the rest of the batch (the first half of the tokens alone); close to its emulation."""
    from helpers import check_mxfp8_forward, moe_forward

    out, layer = check_mxfp8_forward(T, H, I, E, k, shared_inter, routing, emulate=False)
    x, idx, w, experts, shared = layer
    emulated = moe_forward(x, idx, w, *experts, shared, precision="mxfp8_emulated").out  # Hopper's way to the same numbers
    assert rel_err(out, emulated) < 1e-2


@pytest.mark.parametrize("T,H,I,E,k,shared_inter,routing", [
    (2048, 7168, 2048, 32, 8, None, "uniform"), (1000, 512, 256, 8, 2, 384, "uniform"), (300, 256, 128, 8, 1, None, "one_expert"),
])
def test_sm100_mxfp8_backward_matches_the_reference_on_mxfp8_rounded_operands(T, H, I, E, k, shared_inter, routing):
    """The MXFP8 backward on SM100 (precision="mxfp8": the SwiGLU-backward and dx GEMMs on MXFP8 operands): every
    gradient against the float64 reference of the same roundings; the same bits twice and for half
    the batch (tests/helpers.py: check_mxfp8_backward)."""
    from helpers import check_mxfp8_backward

    check_mxfp8_backward(T, H, I, E, k, shared_inter, routing, emulate=False)


@pytest.mark.parametrize("T,H,I,E,k", [(1000, 2880, 2880, 32, 4), (700, 2064, 1040, 16, 4)])
def test_sm100_mxfp8_layer_at_widths_that_are_multiples_of_16_matches_its_emulation(T, H, I, E, k):
    """precision="mxfp8" at gpt-oss's 2880 (22.5 chunks of 128: partial K, column and row tiles) and
    at 2064, 1040 (half a block of 32 at a row's end; dh's halves chunked apart for the dx GEMM and
    the split-out weight gradient): the forward and every gradient against the float64 reference on
    the same roundings (deterministic, batch-invariant: tests/helpers.py), and against
    precision="mxfp8_emulated" (Hopper's way to the same numbers: the bf16 GEMMs on the dequantized
    operands), which the emulated layer's own GPU test holds to the same reference."""
    from helpers import check_mxfp8_backward, check_mxfp8_forward, moe_forward

    out, layer = check_mxfp8_forward(T, H, I, E, k, None, "uniform", emulate=False)
    x, idx, w, experts, _ = layer
    emulated = moe_forward(x, idx, w, *experts, None, precision="mxfp8_emulated").out
    assert rel_err(out, emulated) < 1e-2
    grads = check_mxfp8_backward(T, H, I, E, k, None, "uniform", emulate=False)
    emulated_grads = check_mxfp8_backward(T, H, I, E, k, None, "uniform", emulate=True)
    for name, got, want in zip(("dx", "d_topk_w", "d_w_gate", "d_w_up", "d_w_down"), grads[:5], emulated_grads[:5]):
        assert rel_err(got, want) < 1e-2, name


@pytest.mark.parametrize("wgrad_format", ["mxfp8", "bf16"])
def test_sm100_mxfp8_backward_adds_into_main_grads_and_takes_a_packed_h(wgrad_format):
    """The MXFP8 weight-gradient GEMMs adding into fp32 main_grad buffers (TMA reduce-add), and the
    backward from a packed MXFP8 h (tests/helpers.py: check_mxfp8_main_grads_and_packed_h)."""
    from helpers import check_mxfp8_main_grads_and_packed_h

    check_mxfp8_main_grads_and_packed_h(emulate=False, wgrad_format=wgrad_format)


@pytest.mark.parametrize("split_out,m,n", [(False, 256, 384), (True, 512, 384), (False, 2064, 1040), (True, 2080, 2880)])
def test_sm100_mxfp8_weight_grad_matches_the_float64_product_of_its_dequantized_operands(split_out, m, n):
    """ops.weight_grad on MXFP8 operands (both quantized down their columns by
    ops.quantize_mxfp8_columns; split_out's A with each half chunked on its own): each expert's Aᵀ·B
    over its rows against float64 of the dequantized operands (every product exact), an expert
    without rows zeros; deterministic. Widths 128 does not divide (each half's): partial row and
    column tiles."""
    from mok.pipeline.stages import dequantized_columns

    g = torch.Generator(device="cuda").manual_seed(11 + split_out)
    rows = 640
    offsets = torch.tensor([0, 256, 256, 512, 640], dtype=torch.int32, device="cuda")  # expert 1 has no rows
    a = torch.randn(rows, m, device="cuda", generator=g).bfloat16()
    b = torch.randn(rows, n, device="cuda", generator=g).bfloat16()
    segments = 2 if split_out else 1
    a_q = ops.quantize_mxfp8_columns(a, scale_order="mma", segments=segments)
    b_q = ops.quantize_mxfp8_columns(b, scale_order="mma")
    got = ops.weight_grad(a_q, b_q, offsets, split_out=split_out)
    again = ops.weight_grad(a_q, b_q, offsets, split_out=split_out)
    if split_out:
        got, again = torch.cat(got, dim=1), torch.cat(again, dim=1)
    a_f, b_f = dequantized_columns(a_q, segments).double(), dequantized_columns(b_q).double()
    for e in range(4):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        if lo == hi:
            assert torch.equal(got[e], torch.zeros_like(got[e]))
            continue
        assert rel_err(got[e], a_f[lo:hi].T @ b_f[lo:hi]) < 1e-2
    assert torch.equal(got, again)


def hopper_layer_tests():
    """Layer tests written for Hopper whose bodies name no arch (the device's plan: on SM100 the
    tcgen05 kernels): expert parallelism emulated on one GPU (scatter pushes, gradients, recompute),
    widths the tiles do not divide, the one-launch forward (its bits those of the staged launches,
    at one GPU and per rank, with gpt-oss's activation, biases and weights in place), fp8_block with
    power-of-two scales (on the block-scaled MMAs) against its float64 recipe, MXFP8 and fp8_block
    at EP (the scattering MXFP8 GEMMs) against one GPU, fp8_block's weight gradients on FP8 (the
    MXFP8 weight-gradient kernel) and its FP8 dispatch (scales as E8M0 in the MMA order)."""
    import test_activations_gpu
    import test_backward_gpu
    import test_ep_gpu
    import test_expert_bias_gpu
    import test_fp8_block_gpu
    import test_partial_tiles_gpu

    ep = dict(world=2, counts=(300, 517), E=8, k=4, shared_inter=256, routing="uniform")
    partial = dict(zip(("T", "H", "I", "E", "k", "shared_inter", "routing"), test_partial_tiles_gpu.CASES[1]))
    return [
        (test_ep_gpu.test_ep_equals_single_gpu_forward_bitwise, dict(ep, dispatch={})),
        (test_ep_gpu.test_ep_gradients_equal_single_gpu_backward_bitwise, dict(ep, forward={})),
        (test_ep_gpu.test_ep_gradients_equal_single_gpu_backward_bitwise, dict(ep, forward={"saved_h_format": "recompute"})),
        (test_partial_tiles_gpu.test_forward_matches_reference, partial),
        (test_partial_tiles_gpu.test_backward_matches_autograd, partial),
        (test_partial_tiles_gpu.test_weight_grad_partial_row_and_column_tiles, dict(split_out=True)),
        (test_ep_gpu.test_ep_equals_single_gpu_forward_bitwise, dict(ep, dispatch={"one_launch": True})),
        (test_ep_gpu.test_ep_gradients_equal_single_gpu_backward_bitwise, dict(ep, forward={"one_launch": True})),
        (test_activations_gpu.test_one_launch_and_recompute_give_the_staged_bits_deterministically_and_batch_invariant,
         dict(activation="clamped_swiglu")),
        (test_expert_bias_gpu.test_bits_are_deterministic_batch_invariant_and_equal_with_h_recomputed_or_in_one_launch, {}),
        (test_backward_gpu.test_gate_up_parts_of_one_tensor_give_the_bits_of_packed_weights,
         dict(T=1000, H=512, I=256, E=8, k=2, shared_inter=384, options={"one_launch": True}, layout="interleaved")),
        (test_fp8_block_gpu.test_power_of_two_scales_follow_their_recipe, {}),
        (test_ep_gpu.test_quantized_ep_training_step_equals_single_gpu_bitwise,
         dict(world=2, counts=(300, 517), shared_inter=256, options={"precision": "mxfp8"})),
        (test_ep_gpu.test_quantized_ep_training_step_equals_single_gpu_bitwise,
         dict(world=2, counts=(300, 517), shared_inter=None, options={"precision": "fp8_block", "fp8_scales": "power_of_two"})),
        (test_fp8_block_gpu.test_fp8_weight_gradients_in_the_backward, dict(fp8_scales="power_of_two")),  # (the MXFP8 wgrad kernel)
        (test_ep_gpu.test_fp8_dispatch_training_step_crosses_the_rows_its_fc1_takes,  # (E8M0 scales in the MMA order)
         dict(world=2, counts=(300, 517), scales="power_of_two", H=512)),
    ]


HOPPER_LAYER_TESTS = 16  # len(hopper_layer_tests()), which imports the GPU test modules: called by the test only


@pytest.mark.parametrize("index", range(HOPPER_LAYER_TESTS))
def test_sm100_passes_the_hopper_layer_tests_of_expert_parallelism_and_partial_tiles(index, monkeypatch):
    """What the SM100 layer now takes beside Hopper's (EP, partial widths, one launch), held to the same tests."""
    monkeypatch.setenv("MOK_UNVERIFIED_SM100", "1")
    tests = hopper_layer_tests()
    assert len(tests) == HOPPER_LAYER_TESTS
    test, kwargs = tests[index]
    test(**kwargs)



@pytest.mark.parametrize("form", ["plain", "swiglu_gather", "k_split", "bias_partial_width"])
def test_sm100_row_tile_pairs_sharing_b_give_the_single_cta_bits(form):
    """cluster_m=2 on SM100 (B multicast between the two CTAs of a row-tile pair): the Hopper test's
    pairs of every kind (tests/test_forward_gpu.py), the bits of cluster_m=1."""
    from test_forward_gpu import test_row_tile_pairs_sharing_b_give_the_single_cta_bits as same_bits_in_every_pair

    same_bits_in_every_pair(form)
