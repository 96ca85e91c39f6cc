"""The single-GPU fused backward and its kernels on the H200, against fp32 autograd of the reference."""

import importlib

import pytest
import torch

from mok import ops
from mok.pipeline.stages import single_expert_tiles
from mok.reference import expert_rows, moe_reference

from helpers import gpu_layer, moe_backward, moe_forward, poisoned, rel_err, worst_entry_err, worst_row_err

pytestmark = pytest.mark.gpu


def cosine(got, want):
    return float(torch.nn.functional.cosine_similarity(got.float().flatten(), want.float().flatten(), dim=0))


def autograd_reference(x, idx, w, experts, shared, dout):
    """Gradients of moe_reference in fp32: (dx, d_topk_w, dW_gate, dW_up, dW_down, shared grads or None)."""
    leaves = [t.float().requires_grad_() for t in (x, w, *experts, *(shared or ()))]
    xf, wf, wg, wu, wd, *sh = leaves
    moe_reference(xf, idx, wf, wg, wu, wd, tuple(sh) if sh else None).backward(dout.float())
    grads = [t.grad for t in leaves]
    return (*grads[:5], tuple(grads[5:]) if shared else None)


def router_grad_term_sizes(x, idx, experts, dout):
    """Σ_i |dz_i·h_i| per (token, slot) in fp32, for d_topk_w[t, j] = <dz, h> = Σ_i dz_i·h_i with
    h = silu(x_t·W_gate[e])⊙(x_t·W_up[e]) and dz = dout_t·W_down[e] of the pair's expert e.

    The yardstick for one router-gradient value: the kernel keeps h (and may keep dz) in bf16,
    which moves each term by up to 2^-9 of its size, so the dot can move by a few 2^-9 of Σ|terms|
    however much its terms cancel. Relative to the value itself the error is unbounded: one token
    with H = 512 and I = 256 is off by more than 1% in about one draw of 20 (a CPU emulation)."""
    w_gate, w_up, w_down = (t.float() for t in experts)
    sizes = torch.zeros(idx.shape, device=x.device)
    for e in idx.unique().tolist():
        tokens, slots = expert_rows(idx, e)
        xe = x[tokens].float()
        h = torch.nn.functional.silu(xe @ w_gate[e].T) * (xe @ w_up[e].T)
        dz = dout[tokens].float() @ w_down[e]
        sizes[tokens, slots] = (dz * h).abs().sum(1)
    return sizes


def fused(x, idx, w, experts, shared, dout, **kw):
    saved = moe_forward(x, idx, w, *experts, shared, save_for_backward=True)
    return saved.out, moe_backward(dout, x, idx, w, *experts, shared, saved, **kw)


def flat(grads):
    """The gradients as a list of tensors (shared ones appended)."""
    return [*grads[:5], *(grads[5] or ())]


NAMES = ["dx", "d_topk_w", "d_w_gate", "d_w_up", "d_w_down", "d_shared_gate", "d_shared_up", "d_shared_down"]

CASES = [
    # T, H, I, E, k, shared, routing
    (4096, 7168, 2048, 32, 8, None, "uniform"),  # dsv3-like rank
    (2048, 2048, 768, 64, 8, 768, "zipf"),  # qwen3-like widths, skewed routing
    (1000, 512, 256, 8, 2, 384, "uniform"),  # T not a multiple of any tile, I_s != I
    (513, 256, 128, 64, 6, 128, "uniform"),
    (200, 256, 128, 256, 8, None, "uniform"),  # most experts empty
    (300, 256, 128, 8, 1, None, "one_expert"),  # k = 1, every token on expert 0
    (1, 512, 256, 8, 2, 256, "uniform"),
]


@pytest.mark.parametrize("T,H,I,E,k,shared_inter,routing", CASES)
def test_backward_matches_autograd(T, H, I, E, k, shared_inter, routing):
    check_backward_against_autograd(T, H, I, E, k, shared_inter, routing)


def check_backward_against_autograd(T, H, I, E, k, shared_inter, routing):
    """The fused forward + backward's gradients against autograd of the fp32 reference (tests/test_sm100_gpu.py too)."""
    seed = T + E + 7
    x, idx, w, experts, shared = gpu_layer(T, H, I, E, k, shared_inter, seed=seed, routing=routing)
    dout = torch.randn(T, H, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)).bfloat16()
    _, grads = fused(x, idx, w, experts, shared, dout)
    want = autograd_reference(x, idx, w, experts, shared, dout)
    for name, got, ref in zip(NAMES, flat(grads), flat(want)):
        assert got.shape == ref.shape, name
        assert not got.isnan().any(), f"{name}: unwritten or NaN elements"
        if name == "d_topk_w":  # each value against the size of its dot's terms (a dropped pair shows, unless its terms cancel to < 2^-8)
            worst = float(((got - ref).abs() / router_grad_term_sizes(x, idx, experts, dout)).max())
            assert worst <= 2**-8, f"d_topk_w: worst |error| / Σ|terms| {worst:.2e}"
            if got.numel() < 256:  # (a norm over a few cancelling dots measures their luck, not the kernel)
                continue
        assert rel_err(got, ref) <= 1e-2, f"{name}: rel err {rel_err(got, ref):.2e}"
        assert cosine(got, ref) >= 0.9999, f"{name}: cosine {cosine(got, ref):.6f}"
        if name != "d_topk_w":  # per token (dx), per expert (weights): a dropped row shows here
            worst = worst_row_err(got, ref)
            assert worst <= 5e-2, f"{name}: worst row err {worst:.2e}"


@pytest.mark.parametrize("shared_inter", [None, 256])
def test_backward_reads_no_gathered_row_past_those_in_use(shared_inter):
    """The backward gathers dout's and x's rows only up to the schedule's rows in use: the capacity's
    row tiles past them are left as the allocator hands them over. Here NaN (blocks of that size
    freed just before, which the caching allocator hands back): gradients still match autograd, so
    no GEMM, sum or combine reads a row there. Every token on the same 4 of 64 experts: most of
    the capacity's rows (sized for any routing) unused."""
    T, H, I, E, k = 600, 512, 256, 64, 4
    x, idx, w, experts, shared = gpu_layer(T, H, I, E, k, shared_inter, seed=21, routing="one_expert")
    dout = torch.randn(T, H, device="cuda", generator=torch.Generator(device="cuda").manual_seed(21)).bfloat16()
    saved = moe_forward(x, idx, w, *experts, shared, save_for_backward=True)
    capacity, used = saved.schedule.row_token.shape[0], int(saved.schedule.expert_offsets[-1])
    assert used < capacity // 2  # (most of the capacity unused: the case this test is about)
    blocks = [poisoned(capacity, H) for _ in range(4)]
    del blocks
    probe = torch.empty(capacity, H, device="cuda", dtype=torch.bfloat16)
    assert probe.isnan().all()  # (the allocator hands a poisoned block back to the next buffer of the size)
    del probe
    grads = moe_backward(dout, x, idx, w, *experts, shared, saved)
    want = autograd_reference(x, idx, w, experts, shared, dout)
    for name, got, ref in zip(NAMES, flat(grads), flat(want)):
        assert not got.isnan().any(), f"{name}: NaN (a row past those in use read?)"
        if name != "d_topk_w":
            assert rel_err(got, ref) <= 1e-2, f"{name}: rel err {rel_err(got, ref):.2e}"


def test_router_gradient_with_weights_zero_and_tiny():
    """d_topk_w = <dout, y> does not depend on the weight itself: 0 and 1e-30 get their full gradient."""
    x, idx, w, experts, shared = gpu_layer(700, 512, 256, 16, 4, None, seed=11)
    w[::3, 0] = 0.0
    w[1::3, 1] = 1e-30
    dout = torch.randn(700, 512, device="cuda").bfloat16()
    _, grads = fused(x, idx, w, experts, shared, dout)
    want = autograd_reference(x, idx, w, experts, shared, dout)[1]
    for rows, slot in ((slice(0, None, 3), 0), (slice(1, None, 3), 1)):
        got, ref = grads.d_topk_w[rows, slot], want[rows, slot]
        assert ref.abs().min() > 0  # these pairs do have a gradient
        assert rel_err(got, ref) <= 1e-2 and worst_entry_err(got, ref) <= 5e-2
    assert rel_err(grads.d_topk_w, want) <= 1e-2


def test_backward_deterministic_over_20_runs():
    x, idx, w, experts, shared = gpu_layer(2048, 2048, 768, 64, 8, 768, seed=12)
    dout = torch.randn(2048, 2048, device="cuda").bfloat16()
    first = flat(fused(x, idx, w, experts, shared, dout)[1])
    for _ in range(19):
        again = flat(fused(x, idx, w, experts, shared, dout)[1])
        assert all(torch.equal(a, b) for a, b in zip(again, first))


def test_backward_batch_invariance():
    """A token's dx and router gradient are bitwise the same in a batch of 1, of 17 and of 4096."""
    x, idx, w, experts, shared = gpu_layer(4096, 2048, 768, 64, 8, 768, seed=13)
    dout = torch.randn(4096, 2048, device="cuda").bfloat16()
    full = fused(x, idx, w, experts, shared, dout)[1]
    for size in (1, 17):
        rows = torch.randperm(4096, device="cuda")[:size]
        part = fused(*(t[rows].contiguous() for t in (x, idx, w)), experts, shared, dout[rows].contiguous())[1]
        assert torch.equal(part.dx, full.dx[rows])
        assert torch.equal(part.d_topk_w, full.d_topk_w[rows])


def test_main_grad_accumulation_adds_once_into_fp32():
    check_main_grad_adds_once(600, 512, 256, 8, 2, 256, seed=14)


def check_main_grad_adds_once(T, H, I, E, k, shared_inter, seed):
    """main_grads: each weight's fp32 buffer gets the fresh fp32 gradient added once (and is the one returned)."""
    x, idx, w, experts, shared = gpu_layer(T, H, I, E, k, shared_inter, seed=seed)
    dout = torch.randn(T, H, device="cuda").bfloat16()
    fresh = flat(fused(x, idx, w, experts, shared, dout, grad_dtype=torch.float32)[1])[2:]
    buffers = [torch.randn(t.shape, device="cuda") for t in (*experts, *shared)]
    before = [b.clone() for b in buffers]
    grads = flat(fused(x, idx, w, experts, shared, dout, main_grads=tuple(buffers))[1])[2:]
    for got, buf, old, new in zip(grads, buffers, before, fresh):
        assert got.data_ptr() == buf.data_ptr()
        assert torch.equal(buf, old + new)  # one fp32 add per element (TMA reduce-add), nothing else


def test_forward_backward_graph_capture_without_host_sync():
    x, idx, w, experts, shared = gpu_layer(512, 512, 256, 16, 4, 256, seed=15)
    dout = torch.randn(512, 512, device="cuda").bfloat16()
    want = flat(fused(x, idx, w, experts, shared, dout)[1])  # compiles outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            saved = moe_forward(x, idx, w, *experts, shared, check_routing=False, save_for_backward=True)
            got = flat(moe_backward(dout, x, idx, w, *experts, shared, saved))
        graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(got, want))


# ---- kernels one by one ---------------------------------------------------------------------

# 30 output tiles (one per CTA), or 320 at M = N = 1024 (several per CTA; with ping-pong both
# warpgroups take tiles in turn)
@pytest.mark.parametrize(
    "m,n,tile_n,pingpong",
    [(256, 384, 128, False), (256, 512, 256, False), (256, 384, 128, True), (1024, 1024, 128, False), (1024, 1024, 128, True)],
)
def test_weight_grad_per_expert_with_empty_experts_and_strided_a(m, n, tile_n, pingpong):
    g = torch.Generator(device="cuda").manual_seed(16)
    rows = 1024
    wide = torch.randn(rows, 2 * m, device="cuda", generator=g).bfloat16()
    a = wide[:, m:]  # a column slice: row stride 2m
    b = torch.randn(rows, n, device="cuda", generator=g).bfloat16()
    offsets = torch.tensor([0, 128, 128, 512, 1024, 1024], dtype=torch.int32, device="cuda")  # experts 1 and 4 empty
    out = ops.weight_grad(a, b, offsets, out=torch.full((5, m, n), float("nan"), device="cuda"), tile_n=tile_n, pingpong=pingpong)
    one_tile_per_cta = ops.weight_grad(
        a, b, offsets, out=torch.full((5, m, n), float("nan"), device="cuda"), persistent=False, tile_n=tile_n
    )
    assert torch.equal(out, one_tile_per_cta)  # the persistent kernel reduces each tile in the same order
    acc = torch.randn(5, m, n, device="cuda")
    want_acc = acc + out
    for persistent in (True, False):
        got = ops.weight_grad(
            a, b, offsets, out=acc.clone(), accumulate=True, persistent=persistent, tile_n=tile_n, pingpong=pingpong and persistent
        )
        assert torch.equal(got, want_acc)
    for e in range(5):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        want = a[lo:hi].float().T @ b[lo:hi].float()
        if hi == lo:
            assert torch.equal(out[e], torch.zeros_like(out[e]))
        else:
            assert rel_err(out[e], want) <= 1e-5  # fp32 out: only the summation order differs


def expert_rows_as_scheduled(counts: list[int], m: int, n: int, g: torch.Generator):
    """Random bf16 operands a [R, m], b [R, n] laid out as a schedule lays expert rows: expert e's
    ``counts[e]`` rows from offsets[e], each expert padded to 128 rows of zeros. Returns a, b,
    offsets [E + 1] and counts [E] (int32, on the GPU) and the real-row mask [R]."""
    counts = torch.tensor(counts, dtype=torch.int32)
    padded = (counts + 127) // 128 * 128
    offsets = torch.cat([torch.zeros(1, dtype=torch.int32), padded.cumsum(0).int()])
    rows = int(offsets[-1])
    real = torch.zeros(rows, dtype=torch.bool)
    for e in range(len(counts)):
        real[int(offsets[e]) : int(offsets[e]) + int(counts[e])] = True
    real = real.cuda()
    a = torch.randn(rows, m, device="cuda", generator=g).bfloat16() * real[:, None]
    b = torch.randn(rows, n, device="cuda", generator=g).bfloat16() * real[:, None]
    return a, b, offsets.cuda(), counts.cuda(), real


@pytest.mark.parametrize("persistent,pingpong", [(True, True), (True, False), (False, False)])
def test_weight_grad_split_out_gives_each_half_the_bits_of_its_own_launch(persistent, pingpong, monkeypatch):
    """split_out (dW_gate and dW_up from one launch over dh): each half bitwise the launch over its
    column half of a, fresh (bf16, fp32) and accumulated, with the second tensor above or below the
    first in memory, with counts and empty experts, and through the fallback (a launch per half)
    where the halves' distance is not a TMA stride."""
    g = torch.Generator(device="cuda").manual_seed(23)
    m, n = 512, 384
    a, b, offsets, counts, _ = expert_rows_as_scheduled([0, 100, 256, 129, 0, 64], m, n, g)
    experts = len(counts)
    opts = dict(counts=counts, persistent=persistent, pingpong=pingpong)
    halves = (a[:, : m // 2], a[:, m // 2 :])
    for dtype in (torch.bfloat16, torch.float32):
        want = [ops.weight_grad(h, b, offsets, out=torch.full((experts, m // 2, n), float("nan"), device="cuda", dtype=dtype), **opts) for h in halves]
        fresh = ops.weight_grad(a, b, offsets, out_dtype=dtype, split_out=True, **opts)
        assert all(torch.equal(got, w) for got, w in zip(fresh, want))
        storage = torch.full((2 * experts + 1, m // 2, n), float("nan"), device="cuda", dtype=dtype)
        for first, second in ((storage[:experts], storage[experts + 1 :]), (storage[experts + 1 :], storage[:experts])):
            got = ops.weight_grad(a, b, offsets, out=(first, second), split_out=True, **opts)
            assert got[0] is first and got[1] is second
            assert torch.equal(first, want[0]) and torch.equal(second, want[1])
    acc = [torch.randn(experts, m // 2, n, device="cuda", generator=g) for _ in range(2)]
    want = [ops.weight_grad(h, b, offsets, out=t.clone(), accumulate=True, **opts) for h, t in zip(halves, acc)]
    for first_below in (True, False):
        pair = torch.empty(2, experts, m // 2, n, device="cuda")
        lo, hi = (0, 1) if first_below else (1, 0)
        pair[lo], pair[hi] = acc[0], acc[1]
        got = ops.weight_grad(a, b, offsets, out=(pair[lo], pair[hi]), accumulate=True, split_out=True, **opts)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    monkeypatch.setattr(importlib.import_module("mok.ops.weight_grads"), "TMA_STRIDE_LIMIT", 0)  # every distance too far: one launch per half
    nan32 = lambda: torch.full((experts, m // 2, n), float("nan"), device="cuda")  # noqa: E731 (fp32 out)
    fallback = ops.weight_grad(a, b, offsets, out=(nan32(), nan32()), split_out=True, **opts)
    fresh = [ops.weight_grad(h, b, offsets, out=nan32(), **opts) for h in halves]
    assert torch.equal(fallback[0], fresh[0]) and torch.equal(fallback[1], fresh[1])
    for e in range(experts):  # and against fp32 products of the real rows (fp32 out: only the order differs)
        lo, c = int(offsets[e]), int(counts[e])
        for h, got in zip(halves, fresh):
            if c == 0:
                assert not got[e].any()
            else:
                assert rel_err(got[e], h[lo : lo + c].float().T @ b[lo : lo + c].float()) <= 1e-5


@pytest.mark.parametrize("pingpong", [False, True])
def test_weight_grad_with_counts_skips_padding_blocks_and_keeps_the_bits(pingpong):
    """With the experts' row counts the kernel stops at the 64-row block holding an expert's last
    row. On rows laid out as a schedule lays them (each expert padded to 128 rows, padding rows
    zero, as the backward's buffers have them) that gives the bits of the kernel reducing every
    padded row, fresh or accumulated; counts at and next to the block edges (0, 1, 64, 65, 128,
    129, 192) are in it. A padding block left in by mistake would add nothing, so rows past the
    counts hold garbage in a second run: the counted kernel must not read them."""
    g = torch.Generator(device="cuda").manual_seed(21)
    m, n = 256, 384
    a, b, offsets, counts, real = expert_rows_as_scheduled([0, 1, 64, 65, 128, 129, 192, 200, 300, 17], m, n, g)
    rows, experts = a.shape[0], len(counts)
    full = ops.weight_grad(a, b, offsets, out=torch.full((experts, m, n), float("nan"), device="cuda"), pingpong=pingpong)
    counted = ops.weight_grad(a, b, offsets, counts=counts, out=torch.full((experts, m, n), float("nan"), device="cuda"), pingpong=pingpong)
    assert torch.equal(counted, full)
    acc = torch.randn(experts, m, n, device="cuda", generator=g)
    got = ops.weight_grad(a, b, offsets, counts=counts, out=acc.clone(), accumulate=True, pingpong=pingpong)
    assert torch.equal(got, acc + full)
    # garbage in the padding rows: whole padding blocks are not read, and the rows of a block
    # the last real row shares would show (so only check experts whose count is a multiple of 64)
    junk = torch.randn(rows, m, device="cuda", generator=g).bfloat16() * 1e3
    a_junk = torch.where(real[:, None], a, junk)
    b_junk = torch.where(real[:, None], b, junk[:, :1].expand(rows, n))
    skipped = ops.weight_grad(  # (into NaN: an empty expert's zeros must be written, not found)
        a_junk, b_junk.contiguous(), offsets, counts=counts, out=poisoned(experts, m, n), pingpong=pingpong
    )
    for e in range(experts):
        lo, c = int(offsets[e]), int(counts[e])
        if c == 0:
            assert not counted[e].any() and not skipped[e].any()
            continue
        want = a[lo : lo + c].float().T @ b[lo : lo + c].float()
        assert rel_err(counted[e], want) <= 1e-5  # fp32 out: only the summation order differs
        if c % 64 == 0:
            assert rel_err(skipped[e].float(), want) <= 1e-2  # bf16 out


def test_grouped_gemm_n_major_and_k_split():
    g = torch.Generator(device="cuda").manual_seed(17)
    rows, n, half, experts = 640, 512, 256, 3
    a = torch.randn(rows, 2 * half, device="cuda", generator=g).bfloat16()
    b = (torch.randn(experts, half, n, device="cuda", generator=g) * half ** -0.5).bfloat16()
    b2 = (torch.randn(experts, half, n, device="cuda", generator=g) * half ** -0.5).bfloat16()
    tile_expert = torch.tensor([2, -1, 0, 1, 1], dtype=torch.int32, device="cuda")
    split = ops.grouped_gemm(a, b, tile_expert, b2=b2, b_major="n", k_split=True, out=poisoned(rows, n))
    whole = ops.grouped_gemm(a[:, :half].contiguous(), b, tile_expert, b_major="n", out=poisoned(rows, n))
    for t, e in enumerate(tile_expert.tolist()):
        rs = slice(128 * t, 128 * (t + 1))
        if e < 0:
            assert split[rs].isnan().all() and whole[rs].isnan().all()
            continue
        assert rel_err(whole[rs], a[rs, :half].float() @ b[e].float()) < 1e-2
        want = a[rs, :half].float() @ b[e].float() + a[rs, half:].float() @ b2[e].float()
        assert rel_err(split[rs], want) < 1e-2


def test_swiglu_backward_pingpong_gives_the_same_bits():
    """Ping-pong (each MMA warpgroup a whole tile, the two in turn) against the cooperative kernel:
    ~400 tiles (about three per CTA), unused tiles, and the shared expert's partial last tile."""
    x, idx, w, (wg, wu, wd), _ = gpu_layer(3000, 512, 512, 8, 4, None, seed=27, routing="zipf")
    s = moe_forward(x, idx, w, wg, wu, wd, None).schedule
    dout = torch.randn(3000, 512, device="cuda").bfloat16()
    g = ops.gather_rows(dout, s.row_token)
    h = torch.randn(g.shape[0], 1024, device="cuda").bfloat16()
    used = s.tile_expert.repeat_interleave(128) >= 0
    routed = {
        pp: ops.swiglu_backward_gemm(g, wd, s.tile_expert, h, row_token=s.row_token, row_slot=s.row_slot, topk_w=w, pingpong=pp)
        for pp in (False, True)
    }
    for cooperative, pingpong in zip(routed[False], routed[True]):
        assert not pingpong[used].isnan().any()
        assert torch.equal(pingpong[used], cooperative[used])
    one_tile = single_expert_tiles(3000, x.device)  # the shared expert: 3000 rows, a partial last tile
    h_shared = torch.randn(3000, 1024, device="cuda").bfloat16()
    shared = {pp: ops.swiglu_backward_gemm(dout, wd[:1], one_tile, h_shared, pingpong=pp) for pp in (False, True)}
    assert shared[True][2] is None
    for cooperative, pingpong in zip(shared[False][:2], shared[True][:2]):
        assert not pingpong.isnan().any()
        assert torch.equal(pingpong, cooperative)


def test_backward_rejects_missing_saved_activations():
    x, idx, w, experts, shared = gpu_layer(16, 256, 128, 8, 2, None, seed=18)
    saved = moe_forward(x, idx, w, *experts, shared)
    with pytest.raises(ValueError, match="the forward did not keep h; call it with save=True"):
        moe_backward(torch.randn_like(x), x, idx, w, *experts, shared, saved)


def test_persistent_kernels_give_the_same_bits():
    """The persistent warp-specialised GEMM computes each tile exactly as the one-tile-per-CTA GEMM."""
    x, idx, w, (wg, wu, wd), _ = gpu_layer(1500, 512, 256, 8, 4, None, seed=19, routing="zipf")
    s = moe_forward(x, idx, w, wg, wu, wd, None).schedule
    xr = ops.gather_rows(x, s.row_token)
    dout = torch.randn(1500, 512, device="cuda").bfloat16()
    g = ops.gather_rows(dout, s.row_token)
    used = s.tile_expert.repeat_interleave(128) >= 0

    def all_epilogues(persistent):
        h = poisoned(xr.shape[0], 512)
        a = ops.grouped_gemm(xr, wg, s.tile_expert, b2=wu, h_out=h, persistent=persistent)
        y256 = ops.grouped_gemm(a, wd, s.tile_expert, persistent=persistent)  # H = 512: 256-wide tiles
        y128 = ops.grouped_gemm(a, wd, s.tile_expert, tile_n=128, persistent=persistent)
        dh, a_s, part = ops.swiglu_backward_gemm(
            g, wd, s.tile_expert, h, row_token=s.row_token, row_slot=s.row_slot, topk_w=w, persistent=persistent
        )
        dx = ops.grouped_gemm(dh, wg, s.tile_expert, b2=wu, b_major="n", k_split=True, persistent=persistent)
        return [t[used] for t in (h, a, y256, y128, dh, a_s, part, dx)]

    base, persistent = all_epilogues(False), all_epilogues(True)
    assert not any(t.isnan().any() for t in persistent)
    assert all(torch.equal(p, q) for p, q in zip(persistent, base))


def test_branch_free_reciprocal_rounds_as_the_ieee_reciprocal():
    """The SwiGLU backward's 1/(1 + exp(-h)) without rcp.rn's branch: bit for bit rcp.rn below
    2^126 (where its fast path is the same approximate reciprocal and Newton step), 2^-126 above."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import from_dlpack

    from mok.kernels.common.gated_activation import RECIPROCAL_MAX_DENOMINATOR, reciprocal_at_least_one

    @cute.kernel
    def both(d: cute.Tensor, fast: cute.Tensor, ieee: cute.Tensor):
        i = cute.arch.block_idx()[0] * 256 + cute.arch.thread_idx()[0]
        if i < cute.size(d):
            fast[i] = reciprocal_at_least_one(d[i])
            ieee[i] = 1.0 / d[i]

    @cute.jit
    def launch(d: cute.Tensor, fast: cute.Tensor, ieee: cute.Tensor):
        both(d, fast, ieee).launch(grid=[(cute.size(d) + 255) // 256, 1, 1], block=[256, 1, 1])

    g = torch.Generator(device="cuda").manual_seed(28)
    h = torch.cat([torch.randn(1 << 20, device="cuda", generator=g) * 8, torch.linspace(-87, 80, 1 << 18, device="cuda")])
    d = torch.cat([
        1 + torch.exp(-h),  # what the epilogue takes the reciprocal of
        torch.exp2(torch.rand(1 << 20, device="cuda", generator=g) * 125.9),  # every exponent in [1, 2^126)
        torch.tensor([1.0, 2.0, 3.0, RECIPROCAL_MAX_DENOMINATOR * (1 - 2**-24)], device="cuda"),
    ])
    d = d[d < RECIPROCAL_MAX_DENOMINATOR]
    big = torch.tensor([RECIPROCAL_MAX_DENOMINATOR, 2.0**127, float("inf")], device="cuda")
    d = torch.cat([d, big])
    fast, ieee = torch.full_like(d, float("nan")), torch.full_like(d, float("nan"))
    launch(from_dlpack(d), from_dlpack(fast), from_dlpack(ieee))
    torch.cuda.synchronize()
    n = d.numel() - big.numel()
    assert torch.equal(fast[:n].view(torch.int32), ieee[:n].view(torch.int32))
    assert torch.equal(fast[n:], torch.full_like(big, 2.0**-126))


def cutlass_launches(fn) -> int:
    """How many CuTe DSL kernels one call of ``fn`` launches (torch.profiler), after a warm-up call."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "cutlass" in e.name)


def test_backward_launches_six_kernels_and_four_more_for_a_shared_expert():
    """The backward's launch count (issue: as few as it can be): the rows gathered (dout and x in one
    launch), the SwiGLU backward, dx rows, dW_down, dW_gate with dW_up, and dx with the router
    gradient; a shared expert adds its SwiGLU backward, dx, dW_down and dW_gate/up. Counted with
    torch.profiler as the CuTe DSL kernels run (not the small torch ops that set a shared expert's
    offsets up)."""
    for shared_inter, want in ((None, 6), (256, 10)):
        x, idx, w, experts, shared = gpu_layer(300, 512, 256, 8, 4, shared_inter, seed=37)
        saved = moe_forward(x, idx, w, *experts, shared, save_for_backward=True)
        dout = torch.randn_like(x)
        assert cutlass_launches(lambda: moe_backward(dout, x, idx, w, *experts, shared, saved)) == want


@pytest.mark.parametrize("T,H,I,E,k", [(300, 512, 256, 8, 4), (1000, 1024, 512, 16, 8)])
def test_shared_expert_in_the_routed_launches_gives_the_bits_of_its_own_launches(T, H, I, E, k, monkeypatch):
    """A shared expert whose weights lie right after the routed experts' (one [E + 1, ...] buffer
    per projection, as mok.MoELayer allocates them) runs as expert E in the routed launches, its
    rows first: the output, h and every gradient (fresh and added into main_grads) bitwise those
    of the same weights in tensors of their own, in 4 + 8 launches instead of 6 + 10, and with
    one_launch=True in ONE forward launch (3 before)."""
    from mok.pipeline import stages
    from mok.pipeline.stages import shared_expert_as_last

    x, idx, w, experts, shared = gpu_layer(T, H, I, E, k, I, seed=41)
    bufs = [torch.cat([routed, one[None]]) for routed, one in zip(experts, shared)]
    stacked, stacked_shared = tuple(b[:E] for b in bufs), tuple(b[E] for b in bufs)
    assert shared_expert_as_last(*stacked, stacked_shared) is not None and shared_expert_as_last(*experts, shared) is None
    want = moe_forward(x, idx, w, *experts, shared, save_for_backward=True)
    got = moe_forward(x, idx, w, *stacked, stacked_shared, save_for_backward=True, out=poisoned(T, H))
    assert got.schedule.shared_rows == -(-T // 128) * 128 and want.schedule.shared_rows == 0
    assert torch.equal(got.out, want.out) and torch.equal(got.shared_h, want.shared_h)
    monkeypatch.setattr(stages, "_COPY_WARNED", False)  # (it warns once per process)
    with pytest.warns(UserWarning, match="copying them together"):  # weights elsewhere, asked for anyway: copied
        copied = moe_forward(x, idx, w, *experts, shared, shared_in_routed=True)
    assert torch.equal(copied.out, want.out)
    pairs_got, pairs_want = got.schedule.slot_row.flatten().long(), want.schedule.slot_row.flatten().long()
    assert torch.equal(got.h[pairs_got], want.h[pairs_want])  # every pair's h row
    dout = torch.randn_like(x)
    g_want = moe_backward(dout, x, idx, w, *experts, shared, want)
    g_got = moe_backward(dout, x, idx, w, *stacked, stacked_shared, got)
    for name in ("dx", "d_topk_w", "d_w_gate", "d_w_up", "d_w_down"):
        assert torch.equal(getattr(g_got, name), getattr(g_want, name)), name
    assert all(torch.equal(a, b) for a, b in zip(g_got.d_shared, g_want.d_shared))
    mains = [torch.randn(t.shape, device="cuda") for t in (*experts, *shared)]
    m_want = moe_backward(dout, x, idx, w, *experts, shared, want, main_grads=tuple(t.clone() for t in mains))
    m_got = moe_backward(dout, x, idx, w, *stacked, stacked_shared, got, main_grads=tuple(t.clone() for t in mains))
    for a, b in zip((m_got.d_w_gate, m_got.d_w_up, m_got.d_w_down, *m_got.d_shared),
                    (m_want.d_w_gate, m_want.d_w_up, m_want.d_w_down, *m_want.d_shared)):
        assert torch.equal(a, b)
    one = moe_forward(x, idx, w, *stacked, stacked_shared, save_for_backward=True, one_launch=True, out=poisoned(T, H))
    used = int(got.schedule.expert_offsets[-1])  # (rows past the last expert's padding are never written)
    assert used > got.schedule.shared_rows and torch.equal(one.schedule.expert_offsets, got.schedule.expert_offsets)
    assert torch.equal(one.out, want.out) and torch.equal(one.h[:used], got.h[:used])  # the one-launch forward: the same bits
    g_one = moe_backward(dout, x, idx, w, *stacked, stacked_shared, one)
    assert all(torch.equal(a, b) for a, b in zip((*g_one[:5], *g_one.d_shared), (*g_want[:5], *g_want.d_shared)))
    assert cutlass_launches(lambda: moe_forward(x, idx, w, *stacked, stacked_shared, one_launch=True, check_routing=False)) == 1
    assert cutlass_launches(lambda: moe_forward(x, idx, w, *stacked, stacked_shared, check_routing=False)) == 4
    assert cutlass_launches(lambda: moe_forward(x, idx, w, *experts, shared, check_routing=False)) == 6
    assert cutlass_launches(lambda: moe_backward(dout, x, idx, w, *stacked, stacked_shared, got)) == 8


def test_precompiled_variants_are_the_ones_a_training_step_launches():
    """The plan's variants (what `mok precompile` builds) name every kernel variant a forward and backward
    look up, so a precompiled cache leaves nothing to JIT (a default that changes in an op but not
    in the list — ping-pong weight gradients — would otherwise compile on the first step)."""
    from mok.config import MoKConfig
    from mok.plan import plan_for

    from helpers import recorded_lookups

    x, idx, w, experts, shared = gpu_layer(300, 512, 256, 8, 4, 256, seed=29)
    with recorded_lookups() as looked_up:
        saved = moe_forward(x, idx, w, *experts, shared, save_for_backward=True)
        moe_backward(torch.randn_like(x), x, idx, w, *experts, shared, saved)
    listed = {(v.name, tuple(sorted(v.config.items()))) for v in plan_for(MoKConfig(512, 256, 8, 4, shared_intermediate=256), "sm_90a").variants()}
    assert looked_up and looked_up <= listed, sorted(looked_up - listed)


@pytest.mark.parametrize("layout", ["concatenated", "interleaved"])
@pytest.mark.parametrize("options", [dict(), dict(one_launch=True), dict(saved_h_format="recompute")])
@pytest.mark.parametrize("T,H,I,E,k,shared_inter", [(1000, 512, 256, 8, 2, 384), (2048, 2048, 768, 64, 8, None)])
def test_gate_up_parts_of_one_tensor_give_the_bits_of_packed_weights(T, H, I, E, k, shared_inter, options, layout):
    """w_gate and w_up as the two halves of one [E, 2I, H] tensor (transformers' gate_up_proj: each
    expert's block contiguous, 2·I·H apart), or as its even and odd rows (gpt-oss's, stored for
    MoK: rows 2·H apart), read in place by the forward's gate/up GEMM (or the one-launch kernel, or
    the recompute) and the backward's dx GEMM: the output and every gradient
    bitwise those of packed copies; with gate_up_layout set so, dW_gate and dW_up come as one
    [E, 2I, H] tensor of the same layout holding those bits."""
    x, idx, w, (wg, wu, wd), shared = gpu_layer(T, H, I, E, k, shared_inter, seed=21)
    interleaved = layout == "interleaved"
    gate_up = torch.stack([wg, wu], dim=2).flatten(1, 2) if interleaved else torch.cat([wg, wu], dim=1)  # [E, 2I, H]
    parts = (gate_up[:, 0::2], gate_up[:, 1::2], wd) if interleaved else (gate_up[:, :I], gate_up[:, I:], wd)
    assert torch.equal(parts[0], wg) and torch.equal(parts[1], wu) and parts[0].stride(0) == 2 * I * H
    dout = torch.randn(T, H, device="cuda").bfloat16()
    want_out = moe_forward(x, idx, w, wg, wu, wd, shared, save_for_backward=True, **options)
    want = moe_backward(dout, x, idx, w, wg, wu, wd, shared, want_out, **options)
    got_out = moe_forward(x, idx, w, *parts, shared, save_for_backward=True, **options)
    got = moe_backward(dout, x, idx, w, *parts, shared, got_out, **options)
    assert torch.equal(got_out.out, want_out.out)
    for name, a, b in zip(NAMES, flat(got), flat(want)):
        assert torch.equal(a, b), name
    joined = moe_backward(dout, x, idx, w, *parts, shared, got_out, gate_up_layout=layout, **options)
    assert joined.d_w_up is None and joined.d_w_gate.shape == gate_up.shape
    both = torch.stack([want.d_w_gate, want.d_w_up], dim=2).flatten(1, 2) if interleaved else torch.cat([want.d_w_gate, want.d_w_up], dim=1)
    assert torch.equal(joined.d_w_gate, both)
    assert torch.equal(joined.d_w_down, want.d_w_down) and torch.equal(joined.dx, want.dx)
