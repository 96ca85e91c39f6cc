"""The single-GPU fused forward and its kernels on the H200, against the fp32 reference."""

import pytest
import torch

from mok import ops
from mok.kernels import compiled_sass
from mok.kernels.variants import expert_mlp_variant, grouped_gemm_variant
from mok.ops import one_launch as one_launch_ops
from mok.reference import moe_reference

from helpers import assert_scatters_into_two_ranks_slots, gpu_layer as layer, moe_forward, poisoned, rel_err, worst_row_err

pytestmark = pytest.mark.gpu


# ---- kernels one by one ---------------------------------------------------------------------

@pytest.mark.parametrize("rows,width", [(1000, 512), (1001, 520), (3, 7168)])  # (rows not a multiple of a CTA's 4)
def test_gather_rows(rows, width):
    src = torch.randn(300, width, device="cuda").bfloat16()
    index = torch.randint(-1, 300, (rows,), device="cuda", dtype=torch.int32)
    out = ops.gather_rows(src, index, out=poisoned(rows, width))
    want = torch.where((index >= 0)[:, None], src[index.clamp(min=0).long()], torch.zeros((), dtype=src.dtype, device="cuda"))
    assert torch.equal(out, want)
    second = torch.randn(300, width, device="cuda").bfloat16()
    pair = ops.gather_rows_pair(src, second, index, out=(poisoned(rows, width), poisoned(rows, width)))  # one launch, both
    want_second = torch.where((index >= 0)[:, None], second[index.clamp(min=0).long()], torch.zeros((), dtype=src.dtype, device="cuda"))
    assert torch.equal(pair[0], want) and torch.equal(pair[1], want_second)


@pytest.mark.parametrize("used", [0, 1, 517, 1001, 5000])
def test_gather_rows_up_to_a_device_count(used):
    """rows_used: the rows below the count (a schedule's rows in use) gathered as without it, those
    at or past it left unwritten (still NaN), one source or two; a count past the rows writes all."""
    rows, width = 1001, 520
    src, second = (torch.randn(300, width, device="cuda").bfloat16() for _ in range(2))
    index = torch.randint(-1, 300, (rows,), device="cuda", dtype=torch.int32)
    count = torch.tensor([used], device="cuda", dtype=torch.int32)
    written = min(used, rows)
    for got, source in ((ops.gather_rows(src, index, out=poisoned(rows, width), rows_used=count), src),
                        *zip(ops.gather_rows_pair(src, second, index, out=(poisoned(rows, width), poisoned(rows, width)), rows_used=count),
                             (src, second))):
        want = ops.gather_rows(source, index)
        assert torch.equal(got[:written], want[:written])
        assert got[written:].isnan().all()


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("rows,n,k,experts", [(1000, 256, 192, 5), (384, 2048, 7168, 2), (37, 768, 2048, 1)])
def test_grouped_gemm(rows, n, k, experts, swiglu):
    g = torch.Generator(device="cuda").manual_seed(rows)
    a = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
    b = (torch.randn(experts, n, k, device="cuda", generator=g) * k ** -0.5).bfloat16()
    b2 = (torch.randn(experts, n, k, device="cuda", generator=g) * k ** -0.5).bfloat16() if swiglu else None
    tiles = -(-rows // 128)
    tile_expert = torch.randint(0, experts, (tiles,), device="cuda", dtype=torch.int32, generator=g)
    if tiles > 1:
        tile_expert[1] = -1  # a skipped tile keeps its (poisoned) output rows
    out = ops.grouped_gemm(a, b, tile_expert, b2=b2, out=poisoned(rows, n))
    for t in range(tiles):
        rs = slice(128 * t, min(128 * (t + 1), rows))
        e = int(tile_expert[t])
        if e < 0:
            assert out[rs].isnan().all()
            continue
        af = a[rs].float()
        want = af @ b[e].float().T
        if swiglu:
            want = torch.nn.functional.silu(want) * (af @ b2[e].float().T)
        assert not out[rs].isnan().any()
        assert rel_err(out[rs], want) < 1e-2


@pytest.mark.parametrize("save_h", [False, True])
@pytest.mark.parametrize("tokens,rows,n,k,experts", [(700, 1000, 256, 192, 5), (300, 384, 2048, 7168, 2), (1, 37, 768, 2048, 1)])
def test_grouped_gemm_gathering_a_equals_a_gathered_first(tokens, rows, n, k, experts, save_h):
    """gather: the producer's cp.async row gather gives the same bits as the gather kernel + GEMM,
    and zero rows (hence zero h) where the index is negative."""
    g = torch.Generator(device="cuda").manual_seed(rows + save_h)
    x = torch.randn(tokens, k, device="cuda", generator=g).bfloat16()
    b = (torch.randn(experts, n, k, device="cuda", generator=g) * k ** -0.5).bfloat16()
    b2 = (torch.randn(experts, n, k, device="cuda", generator=g) * k ** -0.5).bfloat16()
    index = torch.randint(0, tokens, (rows,), device="cuda", dtype=torch.int32, generator=g)
    index[torch.rand(rows, device="cuda", generator=g) < 0.2] = -1  # padding rows, scattered
    tiles = -(-rows // 128)
    tile_expert = torch.randint(0, experts, (tiles,), device="cuda", dtype=torch.int32, generator=g)
    h_fused = poisoned(rows, 2 * n) if save_h else None
    h_plain = poisoned(rows, 2 * n) if save_h else None
    fused = ops.grouped_gemm(x, b, tile_expert, b2=b2, h_out=h_fused, gather=index, out=poisoned(rows, n))
    plain = ops.grouped_gemm(ops.gather_rows(x, index), b, tile_expert, b2=b2, h_out=h_plain, out=poisoned(rows, n))
    assert not fused.isnan().any()
    assert torch.equal(fused, plain)
    if save_h:
        assert torch.equal(h_fused, h_plain)
        assert (h_fused[index < 0] == 0).all()


# Row tiles of a pair: (0, 1) one expert's (B shared by multicast), (2, 3) two experts', (4, 5) a
# skipped tile beside one with rows, (6, 7) both skipped, (8, 9) one expert's again, and 11 tiles:
# the last pair's second tile lies past the row tiles.
PAIR_TILES = [3, 3, 0, 4, -1, 2, -1, -1, 1, 1, 4]


@pytest.mark.parametrize("form", ["plain", "swiglu_gather", "k_split", "bias_partial_width"])
def test_row_tile_pairs_sharing_b_give_the_single_cta_bits(form):
    """cluster_m=2 (two CTAs on two row tiles of one column tile, B's tile multicast to both where
    one expert has both tiles) gives the bits of cluster_m=1 in every kind of pair, writes nothing
    for skipped tiles, and matches the fp32 product."""
    g = torch.Generator(device="cuda").manual_seed(len(form))
    rows = 128 * (len(PAIR_TILES) - 1) + 77
    n, k, experts = (2888, 1032, 5) if form == "bias_partial_width" else (768, 512, 5)
    tile_expert = torch.tensor(PAIR_TILES, device="cuda", dtype=torch.int32)
    b = (torch.randn(experts, n, k, device="cuda", generator=g) * k ** -0.5).bfloat16()
    b2 = (torch.randn(experts, n, k // 2 if form == "k_split" else k, device="cuda", generator=g) * k ** -0.5).bfloat16()
    b = b[:, :, : k // 2].contiguous() if form == "k_split" else b
    options, tokens = {}, None
    if form == "swiglu_gather":
        tokens = torch.randn(600, k, device="cuda", generator=g).bfloat16()
        gather = torch.randint(0, 600, (rows,), device="cuda", dtype=torch.int32, generator=g)
        gather[torch.rand(rows, device="cuda", generator=g) < 0.1] = -1
        options = dict(b2=b2, gather=gather)
        a = tokens
    else:
        a = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
        if form == "k_split":
            options = dict(b2=b2, k_split=True)
        elif form == "bias_partial_width":
            options = dict(bias=torch.randn(experts, n, device="cuda", generator=g).bfloat16())
    outs, hs = [], []
    for cluster_m in (1, 2):
        h = poisoned(rows, 2 * n) if form == "swiglu_gather" else None
        outs.append(ops.grouped_gemm(a, b, tile_expert, out=poisoned(rows, n), h_out=h, cluster_m=cluster_m, **options))
        hs.append(h)
    single, pair = outs
    assert torch.equal(pair.isnan(), single.isnan()) and torch.equal(pair.nan_to_num(), single.nan_to_num())
    if form == "swiglu_gather":
        assert torch.equal(hs[1].nan_to_num(), hs[0].nan_to_num()) and torch.equal(hs[1].isnan(), hs[0].isnan())
    a_rows = ops.gather_rows(tokens, options["gather"]) if form == "swiglu_gather" else a
    for t, e in enumerate(PAIR_TILES):
        rs = slice(128 * t, min(128 * (t + 1), rows))
        if e < 0:
            assert pair[rs].isnan().all()
            continue
        af = a_rows[rs].float()
        if form == "k_split":
            want = af[:, : k // 2] @ b[e].float().T + af[:, k // 2:] @ b2[e].float().T
        else:
            want = af @ b[e].float().T
        if form == "swiglu_gather":
            want = torch.nn.functional.silu(want) * (af @ b2[e].float().T)
        if form == "bias_partial_width":
            want = want + options["bias"][e].float()
        assert not pair[rs].isnan().any() and rel_err(pair[rs], want) < 1e-2


def test_row_tile_pairs_scatter_into_slots_with_the_single_cta_bits():
    """grouped_gemm_scatter with cluster_m=2 writes each row's slot with the bits of cluster_m=1
    (one GPU and two emulated ranks' slots)."""
    x, idx, w, (wg, wu, wd), _ = layer(1000, 512, 256, 8, 2, seed=11, routing="zipf")
    sched = ops.device_schedule(idx, 8)
    a = ops.grouped_gemm(x, wg, sched.tile_expert, b2=wu, gather=sched.row_token)
    slots = [poisoned(1000, 2, 512) for _ in range(2)]
    for cluster_m, out in zip((1, 2), slots):
        ops.grouped_gemm_scatter(a, wd, sched.tile_expert, sched.row_token, sched.row_slot, out, cluster_m=cluster_m)
    assert not slots[0].isnan().any() and torch.equal(slots[1], slots[0])


@pytest.mark.parametrize(
    "T,H,I,E,k,routing",
    [(4096, 7168, 2048, 32, 8, "uniform"), (1000, 512, 256, 8, 2, "zipf"), (333, 384, 128, 4, 3, "one_expert"), (1, 256, 128, 2, 1, "uniform")],
)
def test_down_projection_scattering_into_slots_equals_gemm_then_reorder(T, H, I, E, k, routing):
    """grouped_gemm_scatter writes row r into slots[token, slot] with the bits grouped_gemm gives row r:
    one GPU, then two "ranks" whose slots lie a stride apart in one buffer (rows of tokens g >= T0
    go to the second region; the gap between the regions stays untouched)."""
    x, idx, w, (wg, wu, wd), _ = layer(T, H, I, E, k, seed=T + 3 * k, routing=routing)
    sched = ops.device_schedule(idx, E)
    a = ops.grouped_gemm(x, wg, sched.tile_expert, b2=wu, gather=sched.row_token)
    y_rows = ops.grouped_gemm(a, wd, sched.tile_expert)
    want = y_rows[sched.slot_row.long()]  # [T, k, H]: every pair has a row on one GPU

    slots = poisoned(T, k, H)
    ops.grouped_gemm_scatter(a, wd, sched.tile_expert, sched.row_token, sched.row_slot, slots)
    assert torch.equal(slots, want)

    assert_scatters_into_two_ranks_slots(a, wd, sched, want)


def test_grouped_gemm_sass_has_hgmma():
    """The compiled GEMM runs on the tensor cores' Hopper path (SASS HGMMA), not HMMA/FFMA."""
    variants = [grouped_gemm_variant(2048, 7168, epilogue="swiglu"), grouped_gemm_variant(7168, 2048), expert_mlp_variant(7168, 2048, 8, 32)]
    for variant in variants:
        sass = compiled_sass(variant, "sm_90a")
        assert "HGMMA.64x" in sass and ".F32.BF16" in sass
        assert " HMMA" not in sass


# ---- the layer ------------------------------------------------------------------------------

CASES = [
    # T, H, I, E, k, shared, routing
    (4096, 7168, 2048, 32, 8, None, "uniform"),  # dsv3-like rank
    (8192, 2048, 768, 64, 8, None, "uniform"),  # qwen3-like
    (4096, 7168, 2048, 32, 8, 2048, "zipf"),
    (1000, 512, 256, 8, 2, 384, "uniform"),  # T not a multiple of any tile, I_s != I
    (333, 256, 128, 1, 1, None, "uniform"),
    (513, 256, 128, 64, 6, 128, "uniform"),
    (200, 256, 128, 256, 8, None, "uniform"),  # most experts empty
    (300, 256, 128, 8, 4, None, "one_expert"),
    (1, 512, 256, 8, 2, 256, "uniform"),
]


@pytest.mark.parametrize("T,H,I,E,k,shared_inter,routing", CASES)
def test_forward_matches_reference(T, H, I, E, k, shared_inter, routing):
    x, idx, w, experts, shared = layer(T, H, I, E, k, shared_inter, seed=T + E, routing=routing)
    res = moe_forward(x, idx, w, *experts, shared, out=poisoned(T, H))
    assert not res.out.isnan().any(), "unwritten output elements"
    want = moe_reference(x, idx, w, *experts, shared)
    assert rel_err(res.out, want) <= 1e-2
    assert worst_row_err(res.out, want) <= 5e-2  # every token's row (a dropped or misplaced pair shows here)
    whole = moe_forward(x, idx, w, *experts, shared, out=poisoned(T, H), one_launch=True).out  # schedule in the launch too
    assert torch.equal(whole, res.out)


@pytest.mark.parametrize("T,H,I,E,k,shared_inter,routing", [CASES[0], CASES[5], CASES[6], CASES[7], CASES[8]])
def test_one_launch_forward_builds_the_same_schedule_and_h(T, H, I, E, k, shared_inter, routing):
    """The forward in one launch: its schedule (every field) is the schedule launch's, bit for bit,
    and the h it saves for the backward is the separate launches' h."""
    x, idx, w, experts, shared = layer(T, H, I, E, k, shared_inter, seed=T + 11, routing=routing)
    four = moe_forward(x, idx, w, *experts, shared, save_for_backward=True)
    one = moe_forward(x, idx, w, *experts, shared, save_for_backward=True, one_launch=True)
    for field in ("expert_counts", "expert_offsets", "row_token", "row_slot", "slot_row", "tile_expert", "overflow"):
        assert torch.equal(getattr(one.schedule, field), getattr(four.schedule, field)), field
    used = int(four.schedule.expert_offsets[-1])
    assert torch.equal(one.out, four.out)
    assert torch.equal(one.h[:used], four.h[:used])
    if shared is not None:
        assert torch.equal(one.shared_h, four.shared_h)


def test_one_launch_forward_is_one_kernel_and_leaves_its_barrier_ready():
    """Without a shared expert the whole forward is one CUDA kernel (torch.profiler); its grid
    barrier's words come back to arrived = 0 with the generation one further a barrier, so the next call
    (and a fresh set of words) work without any clearing."""
    x, idx, w, experts, _ = layer(1000, 512, 256, 8, 2, None, seed=12)
    want = moe_forward(x, idx, w, *experts, check_routing=False).out
    sync = torch.zeros(4, dtype=torch.int32, device="cuda")
    sync[1] = 2**31 - 1  # the generation wraps
    generation = 2**31 - 1
    for _ in range(2):  # two grid barriers a launch (after the schedule, before the combine)
        out, _ = ops.scheduled_expert_mlp(x, idx, w, *experts, grid_sync=sync)
        assert torch.equal(out, want)
        generation = (generation + 2 + 2**31) % 2**32 - 2**31
        assert sync.tolist() == [0, generation, 0, 0]
    moe_forward(x, idx, w, *experts, check_routing=False, one_launch=True)  # compiled and warm
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        moe_forward(x, idx, w, *experts, check_routing=False, one_launch=True)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1, [e.name for e in kernels]


def test_one_launch_forward_gives_each_stream_and_each_captured_launch_its_own_barrier_words():
    """Default barrier words: the same set for every call on one stream, another set on another
    stream (two one-launch forwards in flight on two streams never share a barrier), all zero."""
    here = ops.grid_sync_words(torch.device("cuda"))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        there = ops.grid_sync_words(torch.device("cuda"))
    assert ops.grid_sync_words(torch.device("cuda")).data_ptr() == here.data_ptr()
    assert there.data_ptr() != here.data_ptr()
    graph = torch.cuda.CUDAGraph()  # captured launches: a set each, whatever the capture stream (graphs may replay at once)
    with torch.cuda.graph(graph):
        first, second = (ops.grid_sync_words(torch.device("cuda")) for _ in range(2))
        torch.ones(1, device="cuda").add_(1)  # (something to capture)
    assert len({here.data_ptr(), there.data_ptr(), first.data_ptr(), second.data_ptr()}) == 4
    torch.cuda.synchronize()
    assert here.tolist()[0] == 0 and there.tolist()[0] == 0
    x, idx, w, experts, _ = layer(300, 256, 128, 8, 4, None, seed=14)
    want = moe_forward(x, idx, w, *experts).out
    with torch.cuda.stream(side):  # both streams at once, each with its words
        side.wait_stream(torch.cuda.current_stream())
        out_side = moe_forward(x, idx, w, *experts, check_routing=False, one_launch=True).out
    out_here = moe_forward(x, idx, w, *experts, check_routing=False, one_launch=True).out
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(out_here, want) and torch.equal(out_side, want)


def test_one_launch_forward_grid_barrier_is_bounded_and_leaves_its_words_ready():
    """Barrier words that can never complete (arrived far below zero): every CTA stops waiting
    after the timeout, at each barrier, and counts it in grid_sync[2]; the launch finishes
    instead of hanging, its last CTA out sets the words back to arrived = 0, and the next call
    with them is right and times out nowhere."""
    x, idx, w, experts, _ = layer(64, 256, 128, 4, 2, None, seed=13)
    want = moe_forward(x, idx, w, *experts).out
    sync = torch.tensor([-(10**6), 0, 0, 0], dtype=torch.int32, device="cuda")
    barriers = 2  # (after the schedule, before the combine)
    ops.scheduled_expert_mlp(x, idx, w, *experts, grid_sync=sync, timeout_s=0.02)
    torch.cuda.synchronize()
    timeouts = int(sync[2])  # every CTA, at each of its 2 barriers
    assert timeouts >= barriers and timeouts % barriers == 0
    assert sync.tolist() == [0, 0, timeouts, 0]
    with pytest.raises(RuntimeError, match=f"{timeouts} grid-barrier timeouts"):
        ops.raise_grid_timeouts(sync)
    out, _ = ops.scheduled_expert_mlp(x, idx, w, *experts, grid_sync=sync)
    assert torch.equal(out, want)
    assert sync.tolist() == [0, barriers, timeouts, 0]
    sync[2] = 0
    ops.raise_grid_timeouts(sync)  # none: no error


FORWARDS = [{}, {"one_launch": True}]  # four launches; one


@pytest.mark.parametrize("opts", FORWARDS)
def test_forward_deterministic_over_20_runs(opts):
    x, idx, w, experts, shared = layer(2048, 2048, 768, 64, 8, 768, seed=1)
    first = moe_forward(x, idx, w, *experts, shared, **opts).out
    for _ in range(19):
        assert torch.equal(moe_forward(x, idx, w, *experts, shared, **opts).out, first)


@pytest.mark.parametrize("opts", FORWARDS)
def test_forward_batch_invariance(opts):
    x, idx, w, experts, shared = layer(4096, 2048, 768, 64, 8, 768, seed=2)
    full = moe_forward(x, idx, w, *experts, shared, **opts).out
    for size in (1, 17):
        rows = torch.randperm(4096, device="cuda")[:size]
        part = moe_forward(x[rows].contiguous(), idx[rows].contiguous(), w[rows].contiguous(), *experts, shared, **opts).out
        assert torch.equal(part, full[rows])


@pytest.mark.parametrize("opts", [{}, {"one_launch": True}])
def test_forward_graph_capture_without_host_sync(opts):
    x, idx, w, experts, shared = layer(512, 512, 256, 16, 4, 256, seed=3)
    want = moe_forward(x, idx, w, *experts, shared, **opts).out  # compiles outside the capture
    out = poisoned(512, 512)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            moe_forward(x, idx, w, *experts, shared, check_routing=False, out=out, **opts)
        graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for _ in range(3):  # more replays: the counters are zeroed again each time
        torch.cuda.synchronize()
        assert torch.equal(out, want)
        out.fill_(float("nan"))
        graph.replay()


def test_captures_past_the_pooled_barrier_words_get_words_of_their_own(monkeypatch):
    """Every pooled set of grid-barrier words taken (as after 64 captured one-launch forwards): a
    further capture makes a set inside the graph, zeroed by the graph itself, and its replays give
    the eager bits, replay after replay (no host sync in the capture)."""
    x, idx, w, experts, shared = layer(512, 512, 256, 16, 4, 256, seed=5)
    want = moe_forward(x, idx, w, *experts, shared, one_launch=True).out  # (compiles; makes the device's first pool)
    index = torch.cuda.current_device()
    monkeypatch.setitem(one_launch_ops._GRID_SYNC_TAKEN, index, len(one_launch_ops._GRID_SYNC_POOLS[index]) * one_launch_ops.GRID_SYNC_STREAMS)
    out = poisoned(512, 512)
    made = len(one_launch_ops._GRID_SYNC_CAPTURED)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graphs = [torch.cuda.CUDAGraph() for _ in range(2)]
        for graph in graphs:
            with torch.cuda.graph(graph):
                moe_forward(x, idx, w, *experts, shared, check_routing=False, out=out, one_launch=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(one_launch_ops._GRID_SYNC_CAPTURED) == made + 2
    for graph in graphs * 2:
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


def test_forward_rejects_bad_input():
    x, idx, w, experts, shared = layer(16, 256, 128, 8, 2, 128, seed=4)
    with pytest.raises(TypeError, match="x: expected dtype bfloat16, got float16"):
        moe_forward(x.half(), idx, w, *experts)
    with pytest.raises(ValueError, match=r"topk_idx: expected every entry in \[0, 8\), got 8"):
        moe_forward(x, idx + 8 - idx.max(), w, *experts)
    with pytest.raises(ValueError, match=r"w_down: expected shape \[8, 256, 128\]"):
        moe_forward(x, idx, w, experts[0], experts[1], experts[2].transpose(1, 2).contiguous())
    with pytest.raises(ValueError, match=r"topk_w: expected shape \[16, 2\]"):
        moe_forward(x, idx, w[:, :1].contiguous(), *experts)


@pytest.mark.parametrize(
    "N,E,k,world,rank,capacity,routing",
    [
        (4096, 32, 8, 1, 0, None, "uniform"),
        (1000, 256, 8, 1, 0, None, "uniform"),
        (777, 64, 6, 4, 3, None, "zipf"),
        (300, 8, 4, 1, 0, None, "one_expert"),
        (1, 8, 2, 2, 1, None, "uniform"),
        (500, 16, 4, 1, 0, 1024, "uniform"),  # overflow: rows past capacity get no slot
        (8192, 64, 8, 1, 0, None, "uniform"),  # qwen3-like: one CTA per SM, chunks cut tokens
        (8192, 8, 8, 1, 0, None, "one_expert"),  # every chunk's pairs on the same few experts
        (16384, 256, 8, 8, 5, None, "zipf"),  # EP = 8 share of a large global batch
        (2000, 1024, 8, 1, 0, None, "uniform"),  # the most experts the kernel takes
        (3000, 64, 8, 1, 0, 4096, "zipf"),  # overflow with many CTAs
    ],
)
@pytest.mark.parametrize("shared_prefix", [False, True])
def test_device_schedule_equals_python_schedule(N, E, k, world, rank, capacity, routing, shared_prefix):
    from mok.schedule import build_schedule

    _, idx, _, _, _ = layer(N, 8, 8, E, k, seed=N + E, routing=routing)
    opts = dict(block_m=128, capacity=capacity, rank=rank, world_size=world, shared_prefix=shared_prefix)
    dev = ops.device_schedule(idx, E, **opts)
    ref = build_schedule(idx, E, **opts)
    for field in ("expert_counts", "expert_offsets", "row_token", "row_slot", "slot_row", "tile_expert"):
        assert torch.equal(getattr(dev, field), getattr(ref, field)), field
    assert bool(dev.overflow) == bool(ref.overflow)
    assert bool(ref.overflow) == (capacity is not None)
    assert (dev.capacity, dev.shared_rows) == (ref.capacity, ref.shared_rows)


def test_branch_free_division_rounds_as_the_ieee_division():
    """SiLU's gate / (1 + exp(-gate)) without div.rn's branch: bit for bit div.rn over gate values
    (|gate| from 2^-60 to 87, both signs), and over quotients of numerators in [2^-60, 2^60) by
    denominators in [1, 2^60) (every quotient a normal float, as SiLU's are)."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import from_dlpack

    from mok.kernels.common.gated_activation import divide_by_at_least_one

    @cute.kernel
    def both(a: cute.Tensor, d: cute.Tensor, fast: cute.Tensor, ieee: cute.Tensor):
        i = cute.arch.block_idx()[0] * 256 + cute.arch.thread_idx()[0]
        if i < cute.size(d):
            fast[i] = divide_by_at_least_one(a[i], d[i])
            ieee[i] = a[i] / d[i]

    @cute.jit
    def launch(a: cute.Tensor, d: cute.Tensor, fast: cute.Tensor, ieee: cute.Tensor):
        both(a, d, fast, ieee).launch(grid=[(cute.size(d) + 255) // 256, 1, 1], block=[256, 1, 1])

    g = torch.Generator(device="cuda").manual_seed(30)
    n = 1 << 20
    sign = torch.where(torch.rand(n, device="cuda", generator=g) < 0.5, -1.0, 1.0)
    gate = torch.cat([
        torch.randn(n, device="cuda", generator=g) * 6,
        sign * torch.exp2(torch.rand(n, device="cuda", generator=g) * 66 - 60),  # |gate| in [2^-60, 64)
        torch.linspace(-87, 80, 1 << 18, device="cuda"),
    ])
    numerators = sign * torch.exp2(torch.rand(n, device="cuda", generator=g) * 120 - 60)
    a = torch.cat([gate, numerators])
    d = torch.cat([1 + torch.exp(-gate), torch.exp2(torch.rand(n, device="cuda", generator=g) * 60)])
    fast, ieee = torch.full_like(d, float("nan")), torch.full_like(d, float("nan"))
    launch(from_dlpack(a), from_dlpack(d), from_dlpack(fast), from_dlpack(ieee))
    torch.cuda.synchronize()
    assert torch.equal(fast.view(torch.int32), ieee.view(torch.int32))


@pytest.mark.parametrize("one_launch", [False, True])
def test_expert_rows_past_32_bit_indexing_are_refused_before_any_launch(one_launch):
    """40000 tokens x top-8 over 8 experts need ~320k expert rows: at H = 7168 their y [rows, H]
    holds more than 2^31 elements, which the kernels index in 32 bits. The forward refuses the
    shapes before it launches anything (the schedule included), whatever the path (ids not
    range-checked here: that check's reductions would be launches of their own)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    T, H, I, E, k = 40000, 7168, 128, 8, 8
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    idx = torch.rand(T, E, device="cuda", generator=g).topk(k, dim=1).indices.int()
    w = torch.rand(T, k, device="cuda", generator=g)
    experts = [torch.randn(E, I, H, device="cuda", generator=g).bfloat16() for _ in range(2)]
    experts.append(torch.randn(E, H, I, device="cuda", generator=g).bfloat16())
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        with pytest.raises(ValueError, match=r"the expert rows \(h, a, y\): expected fewer than 2\*\*31 elements"):
            moe_forward(x, idx, w, *experts, one_launch=one_launch, check_routing=False)
        torch.cuda.synchronize()
    launched = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert not launched, launched


@pytest.mark.multigpu
def test_tensors_on_another_device_than_the_current_one_raise_clearly():
    """MoK launches in the current device's context: tensors on cuda:1 while cuda:0 is current get
    an error naming both (and how to switch), not a driver error or work on the wrong GPU; under
    `with torch.cuda.device(1)` the same call runs."""
    src = torch.randn(64, 256, device="cuda:1").bfloat16()
    index = torch.arange(64, device="cuda:1", dtype=torch.int32).flip(0)
    with torch.cuda.device(0):
        with pytest.raises(ValueError, match=r"tensors on cuda:1, but the current CUDA device is cuda:0"):
            ops.gather_rows(src, index)
    with torch.cuda.device(1):
        assert torch.equal(ops.gather_rows(src, index), src.flip(0))


def test_outputs_that_overlap_an_input_are_refused_before_launch():
    """The kernels read rows that other threads write: an ``out`` sharing memory with what an op
    reads would give wrong values silently, so it is refused (an out of its own is fine)."""
    g = torch.Generator(device="cuda").manual_seed(3)
    src = torch.randn(512, 256, device="cuda", generator=g).bfloat16()
    index = torch.randperm(512, device="cuda", generator=g).int()
    with pytest.raises(ValueError, match="out: expected memory of its own, got a tensor that overlaps src"):
        ops.gather_rows(src, index, out=src)
    with pytest.raises(ValueError, match=r"out\[1\]: expected memory of its own, got a tensor that overlaps first"):
        ops.gather_rows_pair(src, src.clone(), index, out=(torch.empty_like(src), src))
    slot_row = torch.arange(512, device="cuda", dtype=torch.int32).view(256, 2)
    with pytest.raises(ValueError, match="out: expected memory of its own, got a tensor that overlaps y"):
        ops.combine(src, torch.rand(256, 2, device="cuda"), slot_row=slot_row, out=src[256:])
    b = torch.randn(2, 256, 256, device="cuda", generator=g).bfloat16()
    tiles = torch.tensor([0, 1, 0, 1], device="cuda", dtype=torch.int32)
    with pytest.raises(ValueError, match="out: expected memory of its own, got a tensor that overlaps a"):
        ops.grouped_gemm(src, b, tiles, out=src)
    assert torch.equal(ops.gather_rows(src, index, out=torch.empty_like(src)), src[index.long()])
