"""Widths the 128-wide tiles do not divide, on the H200: H and I any multiples of 8 (gpt-oss's
2880, odd multiples such as 2056 and 1032). The last column and K tiles are partial: TMA
zero-fills the loads past N and K (each half of dh on its own) and clips the stores, so every
output element is written once, no padded copy of anything is made, and nothing spills into a
neighbouring half (h = [gate | up], dh) or expert. Outputs are poisoned first so that an unwritten
element shows as NaN."""

import pytest
import torch

from mok import ops
from mok.saved_h import pack_saved

from helpers import (
    ep_training_case, ep_training_mismatches, gpu_layer, moe_backward, moe_forward, poisoned, rel_err, run_train_ranks,
    warm_up_training, worst_row_err,
)
from test_backward_gpu import check_backward_against_autograd, check_main_grad_adds_once, flat, fused

pytestmark = pytest.mark.gpu

CASES = [
    # T, H, I, E, k, shared I_s, routing
    (1000, 2880, 2880, 32, 4, None, "uniform"),  # gpt-oss's widths
    (700, 2056, 1032, 16, 4, 520, "zipf"),  # odd multiples of 8, a shared expert of a third width
    (333, 264, 136, 8, 2, 136, "uniform"),  # one whole and one partial tile in N and K (shared expert in the routed launches)
    (1, 2056, 1032, 8, 2, None, "uniform"),
]


@pytest.mark.parametrize("T,H,I,E,k,shared_inter,routing", CASES)
def test_forward_matches_reference(T, H, I, E, k, shared_inter, routing):
    from mok.reference import moe_reference

    x, idx, w, experts, shared = gpu_layer(T, H, I, E, k, shared_inter, seed=T + H, routing=routing)
    res = moe_forward(x, idx, w, *experts, shared, out=poisoned(T, H), save_for_backward=True)
    assert not res.out.isnan().any(), "unwritten output elements"
    want = moe_reference(x, idx, w, *experts, shared)
    assert rel_err(res.out, want) <= 1e-2
    assert worst_row_err(res.out, want) <= 5e-2


@pytest.mark.parametrize("T,H,I,E,k,shared_inter,routing", CASES)
def test_backward_matches_autograd(T, H, I, E, k, shared_inter, routing):
    check_backward_against_autograd(T, H, I, E, k, shared_inter, routing)


def test_forward_and_backward_deterministic_over_20_runs_and_batch_invariant():
    x, idx, w, experts, shared = gpu_layer(2048, 2056, 1032, 16, 4, 520, seed=21)
    dout = torch.randn(2048, 2056, device="cuda").bfloat16()
    out, grads = fused(x, idx, w, experts, shared, dout)
    first = [out, *flat(grads)]
    for _ in range(19):
        out, grads = fused(x, idx, w, experts, shared, dout)
        assert all(torch.equal(a, b) for a, b in zip([out, *flat(grads)], first))
    for size in (1, 17):
        rows = torch.randperm(2048, device="cuda")[:size]
        part_out, part = fused(*(t[rows].contiguous() for t in (x, idx, w)), experts, shared, dout[rows].contiguous())
        assert torch.equal(part_out, first[0][rows])
        assert torch.equal(part.dx, grads.dx[rows]) and torch.equal(part.d_topk_w, grads.d_topk_w[rows])


@pytest.mark.parametrize("options", [dict(saved_h_format="recompute"), dict(gate_up_layout="concatenated"), dict(row_tile_pairs=True),
                                     dict(row_tile_pairs=True, saved_h_format="recompute_gate")])
def test_recompute_and_in_place_gate_up_give_the_default_bits(options):
    T, H, I, E, k = 700, 2056, 1032, 16, 4
    x, idx, w, experts, _ = gpu_layer(T, H, I, E, k, None, seed=22)
    dout = torch.randn(T, H, device="cuda").bfloat16()
    saved = moe_forward(x, idx, w, *experts, save_for_backward=True)
    want = moe_backward(dout, x, idx, w, *experts, None, saved)
    if options.get("gate_up_layout"):  # w_gate and w_up as the halves of one [E, 2I, H] tensor, read in place
        joined = torch.cat([experts[0], experts[1]], dim=1)
        experts = (joined[:, :I], joined[:, I:], experts[2])
    saved = moe_forward(x, idx, w, *experts, save_for_backward=True, **options)
    if options.get("saved_h_format") == "recompute_gate":  # (h's up half kept, as the layer's op keeps it)
        saved = pack_saved(saved, "recompute_gate")
    got = moe_backward(dout, x, idx, w, *experts, None, saved, **options)
    assert torch.equal(saved.out, moe_forward(x, idx, w, *experts).out)
    d_gate_up = (got.d_w_gate[:, :I], got.d_w_gate[:, I:]) if got.d_w_up is None else (got.d_w_gate, got.d_w_up)
    assert torch.equal(got.dx, want.dx) and torch.equal(got.d_topk_w, want.d_topk_w)
    assert torch.equal(d_gate_up[0], want.d_w_gate) and torch.equal(d_gate_up[1], want.d_w_up)
    assert torch.equal(got.d_w_down, want.d_w_down)


def test_main_grad_accumulation_adds_once_into_fp32():
    check_main_grad_adds_once(600, 2056, 1032, 8, 2, 520, seed=23)


# ---- the kernels, each output element against an fp32 product ----------------------------------

def test_swiglu_gemm_writes_both_halves_of_h_and_nothing_past_n():
    """N = 1032 (8 whole 128-wide tiles and one of 8 columns), K = 2056: h = [gate | up] [R, 2N]
    exactly, the gate's partial tile not spilling into up's first columns."""
    g = torch.Generator(device="cuda").manual_seed(31)
    rows, n, k, experts = 600, 1032, 2056, 3
    a = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
    b, b2 = ((torch.randn(experts, n, k, device="cuda", generator=g) * k ** -0.5).bfloat16() for _ in range(2))
    tile_expert = torch.randint(0, experts, (-(-rows // 128),), device="cuda", dtype=torch.int32, generator=g)
    h = poisoned(rows, 2 * n)
    out = ops.grouped_gemm(a, b, tile_expert, b2=b2, out=poisoned(rows, n), h_out=h)
    experts_of_rows = tile_expert.long().repeat_interleave(128)[:rows]
    gate = torch.einsum("rk,rnk->rn", a.float(), b.float()[experts_of_rows])
    up = torch.einsum("rk,rnk->rn", a.float(), b2.float()[experts_of_rows])
    assert not h.isnan().any() and not out.isnan().any()
    assert rel_err(h[:, :n], gate) <= 1e-2 and rel_err(h[:, n:], up) <= 1e-2
    assert worst_row_err(h[:, n:].T, up.T) <= 2e-2  # every column of up, its first ones included
    assert rel_err(out, torch.nn.functional.silu(gate) * up) <= 1e-2


def test_k_split_gemm_bounds_each_half_of_k():
    """dx = dh_gate·W_gate + dh_up·W_up with I = 1032 (K = 2I): each half's last K tile stops at I."""
    g = torch.Generator(device="cuda").manual_seed(32)
    rows, n, inter, experts = 500, 2056, 1032, 2
    dh = torch.randn(rows, 2 * inter, device="cuda", generator=g).bfloat16()
    w_gate, w_up = ((torch.randn(experts, inter, n, device="cuda", generator=g) * inter ** -0.5).bfloat16() for _ in range(2))
    tile_expert = torch.tensor([0, 1, 1, 0], device="cuda", dtype=torch.int32)
    out = ops.grouped_gemm(dh, w_gate, tile_expert, b2=w_up, b_major="n", k_split=True, out=poisoned(rows, n))
    e = tile_expert.long().repeat_interleave(128)[:rows]
    want = torch.einsum("rk,rkn->rn", dh[:, :inter].float(), w_gate.float()[e]) + torch.einsum("rk,rkn->rn", dh[:, inter:].float(), w_up.float()[e])
    assert not out.isnan().any()
    assert rel_err(out, want) <= 1e-2 and worst_row_err(out, want) <= 2e-2


@pytest.mark.parametrize("split_out", [False, True])
def test_weight_grad_partial_row_and_column_tiles(split_out):
    """M = 2·1032 (split: each half 1032 rows, 8 whole tiles and one of 8 rows), N = 2056."""
    g = torch.Generator(device="cuda").manual_seed(33)
    m, n = 2 * 1032, 2056
    offsets = torch.tensor([0, 128, 128, 512, 640], dtype=torch.int32, device="cuda")  # expert 1 empty
    rows = int(offsets[-1])
    a = torch.randn(rows, m, device="cuda", generator=g).bfloat16()
    b = torch.randn(rows, n, device="cuda", generator=g).bfloat16()
    nan = lambda *shape: torch.full(shape, float("nan"), device="cuda")  # noqa: E731
    experts = len(offsets) - 1
    if split_out:
        got = ops.weight_grad(a, b, offsets, out=(nan(experts, m // 2, n), nan(experts, m // 2, n)), split_out=True)
        got = torch.cat(got, dim=1)
    else:
        got = ops.weight_grad(a, b, offsets, out=nan(experts, m, n))
    for e in range(experts):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        if hi == lo:
            assert not got[e].any()
        else:
            assert rel_err(got[e], a[lo:hi].float().T @ b[lo:hi].float()) <= 1e-5  # fp32 out: only the order differs


# ---- expert parallelism (ranks emulated on one GPU) -------------------------------------------

def test_expert_parallel_training_step_equals_single_gpu_bitwise():
    from mok.pipeline.workspace import EPLayout, EPWorkspace

    world, counts, H, I, E, k = 2, (300, 517), 2056, 1032, 8, 4
    args, douts, want_out, want = ep_training_case(world, counts, H, I, E, k, seed=41, routing="uniform")
    layout = EPLayout(world=world, max_tokens=max(counts) + 5, hidden=H, topk=k)
    warm_up_training(layout, args, douts)
    results = run_train_ranks(EPWorkspace.local_group(layout), args, douts)
    assert ep_training_mismatches(results, want_out, want) == []


def test_router_logits_and_gradients_at_h_2056():
    from mok.torch_ops import router_logits

    g = torch.Generator(device="cuda").manual_seed(42)
    x = torch.randn(700, 2056, device="cuda", generator=g).bfloat16()
    w = (torch.randn(72, 2056, device="cuda", generator=g) * 2056 ** -0.5).bfloat16()
    d_logits = torch.randn(700, 72, device="cuda", generator=g).bfloat16()
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    router_logits(xg, wg).backward(d_logits)
    xf, wf = x.double().requires_grad_(), w.double().requires_grad_()
    (xf @ wf.T).backward(d_logits.double())
    assert rel_err(xg.grad, xf.grad) <= 1e-2 and rel_err(wg.grad, wf.grad) <= 1e-2
    assert rel_err(router_logits(x, w), x.double() @ w.double().T) <= 1e-2


@pytest.mark.parametrize("T,H,I,E,k", [(1000, 2880, 2880, 32, 4), (700, 2056, 1032, 16, 4), (1, 264, 136, 8, 2)])
def test_one_launch_kernel_with_partial_tiles_gives_the_staged_bits(T, H, I, E, k):
    """ops.scheduled_expert_mlp (the one-launch forward's kernel) at partial widths: out and h the
    staged forward's bits."""
    x, idx, w, experts, _ = gpu_layer(T, H, I, E, k, None, seed=T + I)
    staged = moe_forward(x, idx, w, *experts, save_for_backward=True)
    h = torch.full_like(staged.h, float("nan"))
    out, _ = ops.scheduled_expert_mlp(x, idx, w, *experts, h_out=h, out=poisoned(T, H))
    assert torch.equal(out, staged.out)
    used = int(staged.schedule.expert_offsets[-1])
    assert torch.equal(h[:used], staged.h[:used])


def test_one_launch_layer_forward_at_partial_widths_gives_the_staged_bits():
    """The layer's one-launch forward (schedule in the launch too) at H 2056, I 1032 with a shared
    expert: the staged forward's output and saved h, bit for bit."""
    x, idx, w, experts, shared = gpu_layer(300, 2056, 1032, 8, 2, 520, seed=43)
    staged = moe_forward(x, idx, w, *experts, shared, save_for_backward=True)
    one = moe_forward(x, idx, w, *experts, shared, save_for_backward=True, one_launch=True, out=poisoned(300, 2056))
    used = int(staged.schedule.expert_offsets[-1])
    assert torch.equal(one.out, staged.out) and torch.equal(one.h[:used], staged.h[:used])
    assert torch.equal(one.shared_h, staged.shared_h)
