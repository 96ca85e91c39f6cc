"""The combine kernel on the GPU: exact against its reference, deterministic, capturable, cached."""

import os
import subprocess
import sys

import pytest
import torch

from mok.ops import combine
from mok.reference import combine_reference

pytestmark = pytest.mark.gpu


def make(num_tokens, topk, hidden, with_shared, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    y = torch.randn(num_tokens, topk, hidden, device="cuda", generator=g).bfloat16()
    w = torch.rand(num_tokens, topk, device="cuda", generator=g)
    s = torch.randn(num_tokens, hidden, device="cuda", generator=g).bfloat16() if with_shared else None
    return y, w, s


def poisoned(num_tokens, hidden):
    return torch.full((num_tokens, hidden), float("nan"), device="cuda", dtype=torch.bfloat16)


SHAPES = [(1, 1, 8, False), (1, 8, 7168, True), (17, 2, 200, True), (1000, 6, 2056, False), (4096, 8, 7168, True), (333, 8, 7168, False)]


@pytest.mark.parametrize("num_tokens,topk,hidden,with_shared", SHAPES)
def test_combine_matches_reference(num_tokens, topk, hidden, with_shared):
    y, w, s = make(num_tokens, topk, hidden, with_shared, seed=num_tokens + hidden)
    out = combine(y, w, s, out=poisoned(num_tokens, hidden))
    assert not out.isnan().any(), "unwritten output elements"
    # exactly the documented operation order
    assert torch.equal(out, combine_reference(y, w, s))
    # and against the exact (float64) sum: fp32 accumulation error plus one bf16 rounding
    y64, w64 = y.double(), w.double()
    exact = (w64[..., None] * y64).sum(1) + (0 if s is None else s.double())
    magnitude = (w64[..., None] * y64).abs().sum(1) + (0 if s is None else s.double().abs())
    fp32_bound = (topk + 1) * 2.0**-24 * magnitude
    half_bf16_ulp = torch.ldexp(torch.ones_like(exact), torch.frexp(exact.abs().maximum(out.double().abs())).exponent - 9)
    assert ((out.double() - exact).abs() <= fp32_bound + half_bf16_ulp).all()


def test_zero_and_tiny_weights():
    y, w, s = make(64, 8, 512, True, seed=5)
    w[:, ::2] = 0.0
    w[:, 1] = 1e-30
    w[7] = 0.0
    out = combine(y, w, s)
    assert torch.equal(out, combine_reference(y, w, s))
    assert torch.equal(out[7], s[7])  # all weights zero: the shared row, unchanged


def test_deterministic_over_20_runs():
    y, w, s = make(4096, 8, 7168, True, seed=1)
    first = combine(y, w, s)
    for _ in range(19):
        assert torch.equal(combine(y, w, s, out=poisoned(4096, 7168)), first)


def test_batch_invariance():
    y, w, s = make(4096, 8, 7168, True, seed=2)
    full = combine(y, w, s)
    for size in (1, 17):
        rows = torch.randperm(4096, device="cuda")[:size]
        part = combine(y[rows].contiguous(), w[rows].contiguous(), s[rows].contiguous())
        assert torch.equal(part, full[rows])


def test_cuda_graph_capture_without_host_sync():
    y, w, s = make(512, 8, 1024, True, seed=3)
    out = poisoned(512, 1024)
    combine(y, w, s, out=out)  # compile and load outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            combine(y, w, s, out=out)
        out.fill_(float("nan"))
        graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.equal(out, combine_reference(y, w, s))


_CHILD = """
import sys, torch
from mok.ops import combine
from mok.runtime.cache import default_cache
g = torch.Generator(device="cuda").manual_seed(9)
y = torch.randn(300, 4, 3072, device="cuda", generator=g).bfloat16()
w = torch.rand(300, 4, device="cuda", generator=g)
torch.save(combine(y, w).cpu(), sys.argv[1])
st = default_cache().stats
print(st.compiles, st.disk_loads)
"""


def test_second_process_loads_from_disk_without_compiling(tmp_path):
    env = dict(os.environ, MOK_CACHE_DIR=str(tmp_path / "cache"))
    runs = []
    for i in range(2):
        res = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / f"{i}.pt")], capture_output=True, text=True, env=env, timeout=300)
        assert res.returncode == 0, res.stderr
        runs.append(tuple(map(int, res.stdout.split()[-2:])))
    assert runs == [(1, 0), (0, 1)]
    assert torch.equal(torch.load(tmp_path / "0.pt"), torch.load(tmp_path / "1.pt"))


def test_empty_batch_launches_nothing():
    y, w, _ = make(0, 8, 256, False, seed=0)
    assert combine(y, w).shape == (0, 256)


@pytest.mark.parametrize(
    "change,error,words",
    [
        (lambda a: a.update(y=a["y"].half()), TypeError, "y: expected dtype bfloat16, got float16"),
        (lambda a: a.update(topk_w=a["topk_w"].cpu()), ValueError, "topk_w: expected a tensor on cuda:0"),
        (lambda a: a.update(topk_w=a["topk_w"].double()), TypeError, "topk_w: expected dtype float32"),
        (lambda a: a.update(shared_out=a["shared_out"][:, :128]), ValueError, "shared_out: expected shape [16, 256]"),
        (lambda a: a.update(out=torch.empty(16 * 256 + 1, device="cuda", dtype=torch.bfloat16)[1:].view(16, 256)), ValueError, "out: expected a 16-byte aligned"),
        (lambda a: a.update(y=a["y"].transpose(0, 1).contiguous().transpose(0, 1)), ValueError, "y: expected a contiguous tensor"),
    ],
)
def test_gpu_bad_input(change, error, words):
    y, w, s = make(16, 2, 256, True, seed=4)
    args = dict(y=y, topk_w=w, shared_out=s)
    change(args)
    with pytest.raises(error) as info:
        combine(**args)
    assert words in str(info.value)


def test_gathered_combine_reads_rows_by_slot():
    g = torch.Generator(device="cuda").manual_seed(11)
    rows = torch.randn(700, 1024, device="cuda", generator=g).bfloat16()
    slot_row = torch.randint(-1, 700, (200, 6), device="cuda", dtype=torch.int32, generator=g)
    w = torch.rand(200, 6, device="cuda", generator=g)
    s = torch.randn(200, 1024, device="cuda", generator=g).bfloat16()
    for shared in (s, None):
        out = combine(rows, w, shared, slot_row=slot_row, out=poisoned(200, 1024))
        dense = torch.where((slot_row >= 0)[..., None], rows[slot_row.clamp(min=0).long()], torch.zeros((), dtype=rows.dtype, device="cuda"))
        assert torch.equal(out, combine_reference(dense, w, shared))  # a -1 slot adds nothing
        # weights of 1, read from nowhere (the backward's dx sum): the same bits as a tensor of ones
        unit = combine(rows, None, shared, slot_row=slot_row, out=poisoned(200, 1024))
        assert torch.equal(unit, combine(rows, torch.ones_like(w), shared, slot_row=slot_row))


def test_gathered_combine_of_no_rows_gives_the_shared_output_or_zeros():
    """Every slot without a row and y empty (a schedule where nothing landed): out is the shared
    expert's output (or zeros), the router gradient zeros, as the kernel gives them for -1 slots;
    nothing reads y (it has no row 0)."""
    g = torch.Generator(device="cuda").manual_seed(12)
    slot_row = torch.full((50, 4), -1, device="cuda", dtype=torch.int32)
    w = torch.rand(50, 4, device="cuda", generator=g)
    s = torch.randn(50, 256, device="cuda", generator=g).bfloat16()
    empty = torch.empty(0, 256, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(combine(empty, w, s, slot_row=slot_row, out=poisoned(50, 256)), s)
    assert torch.equal(combine(empty, w, None, slot_row=slot_row, out=poisoned(50, 256)), torch.zeros_like(s))
    d_topk_w = torch.full((50, 4), float("nan"), device="cuda")
    out = combine(empty, None, s, slot_row=slot_row, router=(torch.empty(0, 2, device="cuda"), d_topk_w), out=poisoned(50, 256))
    assert torch.equal(out, s) and torch.equal(d_topk_w, torch.zeros_like(d_topk_w))


@pytest.mark.parametrize("topk,parts", [(6, 16), (1, 1), (8, 6)])
def test_dx_combine_with_the_router_gradient_in_the_same_launch(topk, parts):
    """The backward's combine with router=(partial, d_topk_w): dx bitwise the plain unit-weight
    combine, d_topk_w bitwise mok.ops.router_grad (column pieces added in order; 0 for a
    pair without a row), and both against float64 sums."""
    from mok.ops import router_grad

    g = torch.Generator(device="cuda").manual_seed(31 + topk)
    num_rows, tokens, hidden = 700, 200, 1032  # (1032: a second, partial column block)
    rows = torch.randn(num_rows, hidden, device="cuda", generator=g).bfloat16()
    slot_row = torch.randint(-1, num_rows, (tokens, topk), device="cuda", dtype=torch.int32, generator=g)
    partial = torch.randn(num_rows, parts, device="cuda", generator=g) * 10
    s = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    for shared in (s, None):
        d_w = torch.full((tokens, topk), float("nan"), device="cuda")
        dx = combine(rows, None, shared, slot_row=slot_row, out=poisoned(tokens, hidden), router=(partial, d_w))
        assert torch.equal(dx, combine(rows, None, shared, slot_row=slot_row))
        assert torch.equal(d_w, router_grad(partial, slot_row))
        has_row = slot_row >= 0
        want = torch.where(has_row, partial.double()[slot_row.clamp(min=0).long()].sum(-1), torch.zeros((), dtype=torch.float64, device="cuda"))
        assert (d_w.double() - want).abs().max() <= 1e-5 * want.abs().max()
        assert not d_w[~has_row].any()
    with pytest.raises(ValueError, match="router"):
        combine(rows, torch.rand(tokens, topk, device="cuda"), None, slot_row=slot_row, router=(partial, d_w))
    with pytest.raises(ValueError, match="router partial"):
        combine(rows, None, None, slot_row=slot_row, router=(partial[:-1], d_w))
