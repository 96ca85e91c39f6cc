"""A persistent kernel's result does not depend on how many CTAs walk its tiles.

The layer's training step on 3 and 7 CTAs a persistent GEMM (grouped and weight-gradient GEMMs)
against one per SM, bit for bit: bf16; fp8_block with FP8 weight gradients (the gate/up GEMM's
activation out in FP8 over pairs of column tiles, the SwiGLU backward's h in shared memory, the
weight gradient's epilogue under the next tile); bf16 on row-tile pairs (clusters of two CTAs).
With so few CTAs each walks dozens of tiles, which most other tests' shapes (often one tile a
CTA) never make it do: what a kernel carries from tile to tile (barrier phases, pipeline states,
buffers reused, the walk itself) is exercised here. The bf16 plain GEMM that takes its walk's
last round in half tiles (variants.TAIL_SPLIT), whose choice depends on the CTA count, likewise;
and every form with its walk bounded at the last row tile with rows (variants.BOUNDED_WALK).
"""

import pytest
import torch

from mok import ops, pipeline
from mok.ops import gemm as gemm_ops
from mok.ops import weight_grads as weight_grad_ops

from helpers import gpu_layer, layer_plan, rel_err

pytestmark = pytest.mark.gpu


def training_step(plan, inputs, dout, wgrad_format):
    """The step's output and every gradient tensor, in order."""
    x, idx, w, experts = inputs
    saved = pipeline.forward(plan, x, idx, w, experts, None, save=True)
    grads = pipeline.backward(plan, dout, x, idx, w, experts, None, saved, wgrad_format=wgrad_format)
    return [saved.out] + [g for g in grads if isinstance(g, torch.Tensor)]


@pytest.mark.parametrize("options", [{}, {"precision": "fp8_block", "wgrad_format": "fp8_block"}, {"row_tile_pairs": True},
                                     {"bounded_walk": True}, {"precision": "fp8_block", "wgrad_format": "fp8_block", "bounded_walk": True},
                                     {"row_tile_pairs": True, "bounded_walk": True}])
def test_layer_step_gives_the_same_bits_on_a_few_ctas(monkeypatch, options):
    """The step on 3 and 7 CTAs a persistent GEMM against one a SM, bit for bit (the module
    docstring); with ``bounded_walk`` the walks bounded at the last row tile with rows
    (variants.BOUNDED_WALK) against the default's over the capacity's row tiles too."""
    from mok.kernels import variants

    options = dict(options)
    wgrad_format = options.pop("wgrad_format", None)
    bounded_walk = options.pop("bounded_walk", False)
    T, H, I, E, k = 1024, 1024, 768, 8, 4
    x, idx, w, experts, _ = gpu_layer(T, H, I, E, k, seed=41)
    plan = layer_plan(x, idx, experts, **options)
    inputs = (x, idx, w, experts)
    dout = torch.randn(T, H, device="cuda", generator=torch.Generator(device="cuda").manual_seed(42)).bfloat16()
    want = training_step(plan, inputs, dout, wgrad_format)
    assert len(want) == 6 and not any(t.isnan().any() for t in want)
    if bounded_walk:
        monkeypatch.setattr(variants, "BOUNDED_WALK", True)
        got = training_step(plan, inputs, dout, wgrad_format)
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), ("bounded walk", i)
    for ctas in (3, 7):
        monkeypatch.setattr(gemm_ops, "sm_count", lambda device, ctas=ctas: ctas)
        monkeypatch.setattr(weight_grad_ops, "sm_count", lambda device, ctas=ctas: ctas)
        got = training_step(plan, inputs, dout, wgrad_format)
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), (ctas, i)


@pytest.mark.parametrize("form", ["down", "dx", "scatter"])
def test_tail_split_gives_the_whole_tiles_bits(monkeypatch, form):
    """bf16's plain grouped GEMM with 256-wide tiles taking its walk's last round in 128-wide halves
    (variants.TAIL_SPLIT) against the same GEMM taking it whole, bit for bit, and both against
    float64: on 7, 10, 13 and 240 CTAs (the walk's 108 tiles: a last round of 3, 8, 4 and 108 tiles,
    taken in halves where they are at most half the CTAs: all but 10), with N's last tile partial
    (its second half past N: not computed), a partial K tile, row tiles without an expert inside
    the walk and past it. The down projection's form, dx's (K split over two N-major B), and EP's
    scatter form (each row into its token's slot, padding rows inside the tiles written nowhere)."""
    from mok.kernels import variants

    gen = torch.Generator(device="cuda").manual_seed(51)
    N, K, E, row_tiles = 576, 1008, 5, 80
    tiles = torch.sort(torch.randint(0, E, (36,), generator=gen, device="cuda")).values.int()
    tiles[[5, 17]] = -1
    tiles = torch.cat([tiles, torch.full((row_tiles - 36,), -1, dtype=torch.int32, device="cuda")])
    a = torch.randn(row_tiles * 128, K, generator=gen, device="cuda").bfloat16()
    if form in ("down", "scatter"):
        b = (torch.randn(E, N, K, generator=gen, device="cuda") * K**-0.5).bfloat16()
        options, weights = {}, b.double().transpose(1, 2)
    else:
        b, b2 = ((torch.randn(E, K // 2, N, generator=gen, device="cuda") * K**-0.5).bfloat16() for _ in range(2))
        options, weights = dict(b2=b2, b_major="n", k_split=True), torch.cat([b, b2], 1).double()
    used = tiles.repeat_interleave(128) >= 0
    want = torch.cat([a[m * 128:(m + 1) * 128].double() @ weights[e] for m, e in enumerate(tiles.tolist()) if e >= 0])

    monkeypatch.setattr(variants, "TAIL_SPLIT_MIN_K", 0)  # (a K this short takes whole tiles by default)

    def run(split, ctas=None, scatter=False):
        monkeypatch.setattr(variants, "TAIL_SPLIT", split)
        if ctas is not None:
            monkeypatch.setattr(gemm_ops, "sm_count", lambda device: ctas)
        out = torch.full((row_tiles * 128, N), float("nan"), device="cuda").bfloat16()
        if not scatter:
            return ops.grouped_gemm(a, b, tiles, out=out, tile_n=256, **options)
        slots = torch.full((tokens, topk, N), float("nan"), device="cuda").bfloat16()
        ops.grouped_gemm_scatter(a, b, tiles, row_token, row_slot, slots)
        written = row_token >= 0
        out[written] = slots[row_token[written].long(), row_slot[written].long()]
        return out

    whole = run(False)
    assert not whole[used].isnan().any() and whole[~used].isnan().all()
    assert rel_err(whole[used], want) < 1e-2
    if form == "scatter":  # rows to (token, slot) pairs in a random order; some rows of used tiles are padding
        topk = 2
        real = used & (torch.rand(used.shape, generator=gen, device="cuda") > 0.05)
        tokens = -(-int(real.sum()) // topk)
        pairs = torch.randperm(tokens * topk, generator=gen, device="cuda")[: int(real.sum())].int()
        row_token = torch.full(used.shape, -1, dtype=torch.int32, device="cuda")
        row_slot = torch.zeros(used.shape, dtype=torch.int32, device="cuda")
        row_token[real], row_slot[real] = pairs // topk, pairs % topk
        used = real
    for ctas in (7, 10, 13, 240):
        got = run(True, ctas, scatter=form == "scatter")
        assert torch.equal(got[used], whole[used]), ctas
        assert got[~used].isnan().all(), ctas
