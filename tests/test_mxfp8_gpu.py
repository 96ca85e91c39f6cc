"""The MXFP8 quantizer and dequantizer kernels on the GPU: the reference's bytes (mok/mxfp8.py,
itself checked against a float64 oracle in tests/test_mxfp8.py), every output byte written,
capturable."""

import pytest
import torch

from mok.mxfp8 import BLOCK, SCALE_NAN, dequantize_mxfp8 as dequantize_reference, quantize_mxfp8 as quantize_reference
from mok.ops import dequantize_mxfp8, quantize_mxfp8

pytestmark = pytest.mark.gpu


def awkward_blocks() -> torch.Tensor:
    """Rows of 32 that sit on the rule's edges (bf16 on the GPU)."""
    bf16 = torch.finfo(torch.bfloat16)
    rows = [
        [0.0] * BLOCK,
        [-0.0] * BLOCK,
        [1.75] + [0.3] * (BLOCK - 1),
        [1.7578125] + [-0.3] * (BLOCK - 1),
        [448.0] + [1.0] * (BLOCK - 1),
        [bf16.max] + [-bf16.max / 5] * (BLOCK - 1),
        [bf16.smallest_normal * 3] + [bf16.smallest_normal / 8] * (BLOCK - 1),
        [1.0 + i / 16 for i in range(BLOCK)],
        [float("nan")] + [1.0] * (BLOCK - 1),
        [2.0] * (BLOCK - 1) + [float("-inf")],
        [float("inf")] * BLOCK,
    ]
    return torch.tensor(rows).to(torch.bfloat16).cuda()


def random_rows(shape, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    magnitudes = torch.exp2(torch.randint(-60, 60, (*shape[:-1], shape[-1] // BLOCK, 1), device="cuda", generator=g).float())
    x = torch.randn(*shape[:-1], shape[-1] // BLOCK, BLOCK, device="cuda", generator=g) * magnitudes
    return x.reshape(shape).to(torch.bfloat16)


def quantize_poisoned(x, byte):
    """The kernel's output into buffers filled with ``byte`` first (two fills catch an unwritten byte)."""
    elements = torch.full(x.shape, byte, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    scales = torch.full((*x.shape[:-1], x.shape[-1] // BLOCK), byte, dtype=torch.uint8, device="cuda")
    return quantize_mxfp8(x, out=(elements, scales))


@pytest.mark.parametrize("shape", [(1, 32), (3, 7168), (4096, 2048), (2, 5, 96), (1000, 2080)])
def test_quantizer_gives_the_reference_bytes(shape):
    x = random_rows(shape, seed=sum(shape))
    if shape[-1] == 7168:  # the edge cases among ordinary blocks, in every row
        edges = awkward_blocks().reshape(1, -1)
        x[:, 64: 64 + edges.shape[1]] = edges
    want_elements, want_scales = quantize_reference(x.cpu())
    for byte in (0x00, 0xFF):
        elements, scales = quantize_poisoned(x, byte)
        assert torch.equal(elements.view(torch.uint8).cpu(), want_elements.view(torch.uint8))
        assert torch.equal(scales.cpu(), want_scales)


def test_awkward_blocks_on_their_own():
    x = awkward_blocks()
    elements, scales = quantize_mxfp8(x)
    want_elements, want_scales = quantize_reference(x.cpu())
    assert torch.equal(scales.cpu(), want_scales) and (scales[-3:] == SCALE_NAN).all()
    assert torch.equal(elements.view(torch.uint8).cpu(), want_elements.view(torch.uint8))


def test_quantizer_replays_from_a_cuda_graph_and_handles_no_rows():
    x = random_rows((256, 1024), seed=3)
    elements, scales = quantize_mxfp8(x)
    out = (torch.empty_like(elements), torch.empty_like(scales))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        quantize_mxfp8(x, out=out)
    x.copy_(random_rows((256, 1024), seed=4))
    graph.replay()
    want_elements, want_scales = quantize_mxfp8(x)
    assert torch.equal(out[0].view(torch.uint8), want_elements.view(torch.uint8)) and torch.equal(out[1], want_scales)
    empty = quantize_mxfp8(torch.empty(0, 64, dtype=torch.bfloat16, device="cuda"))
    assert empty[0].shape == (0, 64) and empty[1].shape == (0, 2)


@pytest.mark.parametrize(
    "make,error,match",
    [
        (lambda: torch.zeros(4, 64, dtype=torch.bfloat16), ValueError, "CUDA"),
        (lambda: torch.zeros(4, 64, device="cuda"), TypeError, "bfloat16"),
        (lambda: torch.zeros(4, 40, dtype=torch.bfloat16, device="cuda"), ValueError, "multiple of 16"),
        (lambda: torch.zeros(64, 4, dtype=torch.bfloat16, device="cuda").T, ValueError, "contiguous"),
    ],
)
def test_bad_input_raises_before_launch(make, error, match):
    with pytest.raises(error, match=match):
        quantize_mxfp8(make())


def test_wrong_out_raises():
    x = random_rows((4, 64), seed=1)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        quantize_mxfp8(x, out=(torch.empty(4, 64, dtype=torch.uint8, device="cuda"), torch.empty(4, 2, dtype=torch.uint8, device="cuda")))
    with pytest.raises(ValueError, match=r"\[4, 2\]"):
        quantize_mxfp8(x, out=(torch.empty(4, 64, device="cuda").to(torch.float8_e4m3fn), torch.empty(4, 3, dtype=torch.uint8, device="cuda")))


def test_dequantizer_gives_the_references_values_rounded_to_bf16_for_every_byte():
    # every E4M3 byte under every scale byte: 256 blocks (one per scale), each holding 32 element
    # bytes, all 256 element bytes over 8 blocks of a row
    element_bytes = torch.arange(256, dtype=torch.uint8).reshape(8, BLOCK)
    elements = element_bytes.repeat(256, 1).reshape(256, 8 * BLOCK)
    scales = torch.arange(256, dtype=torch.uint8).reshape(256, 1).repeat(1, 8)
    elements = elements.view(torch.float8_e4m3fn)
    want = dequantize_reference(elements, scales).to(torch.bfloat16)
    out = torch.full(elements.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    got = dequantize_mxfp8(elements.cuda(), scales.cuda(), out=out).cpu()
    same = (got.view(torch.int16) == want.view(torch.int16)) | (got.isnan() & want.isnan())
    assert same.all(), (got[~same][:8], want[~same][:8])
    assert got.isnan().sum() == want.isnan().sum()


@pytest.mark.parametrize("shape", [(7, 7168), (4096, 2048), (3, 96), (1000, 2080)])
def test_quantize_then_dequantize_is_the_reference_round_trip(shape):
    # (3, 96) and (1000, 2080): the dequantizer's quarter blocks do not fill its last CTA
    x = random_rows(shape, seed=11)
    out = torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda")  # an unwritten element shows
    back = dequantize_mxfp8(*quantize_mxfp8(x), out=out)
    want = dequantize_reference(*quantize_reference(x.cpu())).to(torch.bfloat16)
    assert torch.equal(back.cpu(), want)


def test_bounded_conversions_touch_only_the_rows_in_use_and_read_the_count_on_the_device():
    """rows_used (a device count, as a schedule's last expert offset): the first rows converted to
    the reference's bytes, every later byte left as it was; a count past the rows converts them all;
    the count may change between replays of one CUDA graph (it is never read by the host)."""
    rows, width = 300, 2080  # (65 blocks a row: the bound falls inside CTAs)
    x = random_rows((rows, width), seed=21)
    want_elements, want_scales = quantize_reference(x.cpu())
    want_back = dequantize_reference(want_elements, want_scales).to(torch.bfloat16)
    count = torch.zeros(1, dtype=torch.int32, device="cuda")
    elements = torch.full((rows, width), 0xAB, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    scales = torch.full((rows, width // BLOCK), 0xAB, dtype=torch.uint8, device="cuda")
    back = torch.full((rows, width), float("nan"), dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        quantize_mxfp8(x, out=(elements, scales), rows_used=count)
        dequantize_mxfp8(elements, scales, out=back, rows_used=count)
    for used in (0, 1, 77, 299, 300, 5000):
        elements.view(torch.uint8).fill_(0xAB)
        scales.fill_(0xAB)
        back.fill_(float("nan"))
        count.fill_(used)
        graph.replay()
        n = min(used, rows)
        got_e, got_s, got_b = elements.view(torch.uint8).cpu(), scales.cpu(), back.cpu()
        assert torch.equal(got_e[:n], want_elements.view(torch.uint8)[:n]) and torch.equal(got_s[:n], want_scales[:n]), used
        assert (got_e[n:] == 0xAB).all() and (got_s[n:] == 0xAB).all(), used
        assert torch.equal(got_b[:n], want_back[:n]) and got_b[n:].isnan().all(), used


def test_bounded_conversions_check_the_count():
    x = random_rows((4, 64), seed=1)
    with pytest.raises(TypeError, match=r"rows_used: .*int32"):
        quantize_mxfp8(x, rows_used=torch.zeros(1, dtype=torch.int64, device="cuda"))
    with pytest.raises(ValueError, match=r"rows_used: expected one element \(a count of rows\), got shape \(2,\)"):
        quantize_mxfp8(x, rows_used=torch.zeros(2, dtype=torch.int32, device="cuda"))
    elements, scales = quantize_mxfp8(x)
    with pytest.raises(ValueError, match=r"rows_used: .*cuda"):
        dequantize_mxfp8(elements, scales, rows_used=torch.zeros(1, dtype=torch.int32))


@pytest.mark.parametrize("rows,width", [(300, 2048), (128, 7168), (1, 128), (4096, 768)])
def test_quantizer_writes_scales_in_the_mma_order(rows, width):
    """scale_order="mma" (what grouped_gemm_mxfp8 reads on SM100; the kernel is arch-neutral): the
    reference's elements, and its scales at the places mok.mxfp8.mma_scale_layout gives them, every
    byte of rows < R written (two fills), the padding rows' bytes left alone; bounded by a device
    count too, the rows past it untouched."""
    from mok.mxfp8 import mma_scale_layout

    x = random_rows((rows, width), seed=rows + width)
    want_elements, want_scales = quantize_reference(x.cpu())
    want = mma_scale_layout(want_scales)
    filled = mma_scale_layout(torch.ones_like(want_scales)) == 1  # the bytes of real rows (padding holds 127)
    for byte in (0x00, 0xFF):
        elements = torch.full((rows, width), byte, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
        scales = torch.full(tuple(want.shape), byte, dtype=torch.uint8, device="cuda")
        quantize_mxfp8(x, out=(elements, scales), scale_order="mma")
        assert torch.equal(elements.view(torch.uint8).cpu(), want_elements.view(torch.uint8))
        got = scales.cpu()
        assert torch.equal(got[filled], want[filled]) and (got[~filled] == byte).all()
    used = rows // 2
    count = torch.full((1,), used, dtype=torch.int32, device="cuda")
    scales = torch.full(tuple(want.shape), 0xAB, dtype=torch.uint8, device="cuda")
    elements = torch.empty((rows, width), dtype=torch.float8_e4m3fn, device="cuda")
    quantize_mxfp8(x, out=(elements, scales), rows_used=count, scale_order="mma")
    used_bytes = mma_scale_layout(torch.zeros_like(want_scales).index_fill_(0, torch.arange(used), 1)) == 1
    got = scales.cpu()
    assert torch.equal(got[used_bytes], want[used_bytes]) and (got[~used_bytes] == 0xAB).all()


@pytest.mark.parametrize("T,H,I,E,k,shared_inter,routing", [
    (4096, 7168, 2048, 32, 8, None, "uniform"), (1000, 512, 256, 8, 2, 384, "uniform"), (300, 256, 128, 8, 1, None, "one_expert"),
])
def test_mxfp8_forward_emulated_matches_the_reference_on_mxfp8_rounded_operands(T, H, I, E, k, shared_inter, routing):
    """The MXFP8 forward, emulated (precision="mxfp8_emulated"; Hopper: the MXFP8 operands dequantized, exactly, into
    the bf16 grouped GEMM): the schedule, the row gather, the quantizer writing MMA-ordered scales
    (x and a, the rows in use; the weights whole), the scales' way back and the combine, against the
    float64 reference of the same roundings; the same bits call after call and for half the batch."""
    from helpers import check_mxfp8_forward

    check_mxfp8_forward(T, H, I, E, k, shared_inter, routing, emulate=True)


def test_mxfp8_forward_without_emulation_asks_for_a_gpu_with_block_scaled_mmas():
    from helpers import gpu_layer, moe_forward

    x, idx, w, experts, _ = gpu_layer(64, 256, 128, 4, 2)
    if torch.cuda.get_device_capability()[0] == 10:
        pytest.skip("an SM100 GPU has block-scaled MMAs")
    with pytest.raises(NotImplementedError, match=r"needs block-scaled MMAs .*precision='mxfp8_emulated' runs the same numerics there"):
        moe_forward(x, idx, w, *experts, precision="mxfp8")


def test_mxfp8_forward_replays_from_a_cuda_graph_with_new_routing():
    """No host sync in the MXFP8 forward (check_routing=False; emulated on Hopper): captured once,
    replayed on a new batch and routing in the same buffers, the bits of an eager call on them."""
    from helpers import gpu_layer, moe_forward

    x, idx, w, experts, shared = gpu_layer(512, 256, 128, 8, 2, 128, seed=5)
    precision = "mxfp8_emulated" if torch.cuda.get_device_capability()[0] != 10 else "mxfp8"
    run = lambda: moe_forward(x, idx, w, *experts, shared, check_routing=False, precision=precision).out  # noqa: E731
    run()  # compile and warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    x2, idx2, w2, _, _ = gpu_layer(512, 256, 128, 8, 2, 128, seed=6, routing="skewed")
    x.copy_(x2), idx.copy_(idx2), w.copy_(w2)
    graph.replay()
    assert torch.equal(out, run())


@pytest.mark.parametrize("T,H,I,E,k,shared_inter,routing,wgrad_format", [
    (2048, 7168, 2048, 32, 8, None, "uniform", "mxfp8"), (1000, 512, 256, 8, 2, 384, "uniform", "mxfp8"),
    (300, 256, 128, 8, 1, None, "one_expert", "mxfp8"), (1000, 512, 256, 8, 2, 384, "uniform", "bf16"),
])
def test_mxfp8_backward_emulated_matches_the_reference_on_mxfp8_rounded_operands(T, H, I, E, k, shared_inter, routing, wgrad_format):
    """The MXFP8 backward, emulated (its GEMMs on dequantized MXFP8 operands: dout and dh
    quantized in MMA order, the transposed weights' copies, and for the weight gradients the rows
    quantized down the columns): every gradient against the float64 reference of the same
    roundings; the same bits twice and for half the batch. wgrad_format="bf16": bf16 weight gradients."""
    from helpers import check_mxfp8_backward

    check_mxfp8_backward(T, H, I, E, k, shared_inter, routing, emulate=True, wgrad_format=wgrad_format)


@pytest.mark.parametrize("wgrad_format", ["mxfp8", "bf16"])
def test_mxfp8_backward_adds_into_main_grads_and_takes_a_packed_h(wgrad_format):
    """main_grads (fuse_wgrad_accumulation) and a packed MXFP8 h (saved_h_format="mxfp8") on the
    MXFP8 backward, emulated: tests/helpers.py, check_mxfp8_main_grads_and_packed_h."""
    from helpers import check_mxfp8_main_grads_and_packed_h

    check_mxfp8_main_grads_and_packed_h(emulate=True, wgrad_format=wgrad_format)


@pytest.mark.parametrize("rows,columns", [(256, 2048), (4096, 768), (32, 96), (384, 7168)])
def test_column_quantizer_gives_the_transposes_reference_bytes(rows, columns):
    """ops.quantize_mxfp8_columns (blocks of 32 rows down each column, the weight gradients' K):
    its elements are those of mok.mxfp8.quantize_mxfp8(x.T) in x's own layout, its scales that
    call's, or in the MMA's order (where rows allow) mma_scale_layout's bytes; bounded by a device
    count, the rows past it untouched (the elements; their scales' bytes left as they were)."""
    from mok.mxfp8 import mma_scale_layout
    from mok.ops import quantize_mxfp8_columns

    x = random_rows((rows, columns), seed=rows + columns)
    want_elements, want_scales = quantize_reference(x.cpu().T.contiguous())
    elements, scales = quantize_mxfp8_columns(x)
    assert torch.equal(elements.view(torch.uint8).cpu(), want_elements.view(torch.uint8).T)
    assert torch.equal(scales.cpu(), want_scales)
    if rows % 128 == 0:
        elements, scales = quantize_mxfp8_columns(x, scale_order="mma")
        real = mma_scale_layout(torch.ones_like(want_scales)) == 1  # the bytes of real columns
        assert torch.equal(scales.cpu()[real], mma_scale_layout(want_scales)[real])
        assert torch.equal(elements.view(torch.uint8).cpu(), want_elements.view(torch.uint8).T)
    used = rows // 2 // 32 * 32
    count = torch.full((1,), used, dtype=torch.int32, device="cuda")
    elements, scales = quantize_mxfp8_columns(x, rows_used=count)
    assert torch.equal(elements.view(torch.uint8).cpu()[:used], want_elements.view(torch.uint8).T[:used])
    assert torch.equal(scales.cpu()[:, : used // 32], want_scales[:, : used // 32])


@pytest.mark.parametrize("rows,columns", [(256, 2080), (384, 5760), (128, 4096)])
def test_column_quantizer_chunks_dhs_halves_apart(rows, columns):
    """ops.quantize_mxfp8_columns(segments=2, scale_order="mma") (dh for the split-out weight
    gradient, 128 dividing a half or not): the elements of one segment, and each half's scales
    mma_scale_layout's bytes of that half's transpose, the second half's chunks after the first's
    (the same bytes as one segment where 128 divides a half)."""
    from mok.mxfp8 import mma_scale_layout
    from mok.ops import quantize_mxfp8_columns

    x = random_rows((rows, columns), seed=rows + columns)
    elements, scales = quantize_mxfp8_columns(x, scale_order="mma", segments=2)
    whole_elements, _ = quantize_mxfp8_columns(x, scale_order="mma")
    assert torch.equal(elements.view(torch.uint8), whole_elements.view(torch.uint8))
    half = columns // 2
    assert scales.shape == (2 * -(-half // 128), rows // 128, 512)
    for part, want_part in zip(scales.cpu().chunk(2), x.cpu().split(half, dim=1)):
        _, want_scales = quantize_reference(want_part.T.contiguous())
        real = mma_scale_layout(torch.ones_like(want_scales)) == 1  # the bytes of real columns
        assert torch.equal(part[real], mma_scale_layout(want_scales)[real])
    if half % 128 == 0:
        assert torch.equal(scales, quantize_mxfp8_columns(x, scale_order="mma")[1])


@pytest.mark.parametrize("shared", [None, 256])
def test_mxfp8_emulated_layer_gives_the_functional_paths_bits_eager_and_compiled(shared):
    """MoELayer(precision="mxfp8_emulated") through its custom ops (mok/torch_ops.py): output and
    every gradient the same bits as the pipelines' forward / backward called directly on the
    layer's weights (emulated), eager and under torch.compile(fullgraph=True); a shared expert of the
    routed experts' width (kept in their buffers) included."""
    from mok.layer import MoELayer

    from helpers import moe_backward, moe_forward
    from test_layer_gpu import external_routing, grads_of

    torch.manual_seed(9)
    layer = MoELayer(512, 256, 16, 4, shared_intermediate=shared, device="cuda", precision="mxfp8_emulated")
    x = torch.randn(333, 512, device="cuda").bfloat16()
    idx, w = external_routing(333, seed=3)
    dout = torch.randn(333, 512, device="cuda").bfloat16()
    got = grads_of(layer, x, idx, w, dout)
    with torch.no_grad():
        experts = (layer.gate_proj, layer.up_proj, layer.down_proj)
        shared_w = layer.shared_weights()
        res = moe_forward(x, idx, w, *experts, shared_w, save_for_backward=True, precision="mxfp8_emulated")
        g = moe_backward(dout, x, idx, w, *experts, shared_w, res, precision="mxfp8_emulated")
    want = [res.out, g.dx, g.d_topk_w, g.d_w_gate, g.d_w_up, g.d_w_down, *(g.d_shared or ())]
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    compiled = torch.compile(layer, fullgraph=True)
    xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    out = compiled(xc, topk_idx=idx, topk_w=wc)
    out.backward(dout)
    again = [out.detach(), xc.grad, wc.grad] + [p.grad for n, p in layer.named_parameters() if not n.startswith("router")]
    assert all(torch.equal(a, b) for a, b in zip(again, want))


def test_mxfp8_emulated_layer_and_functional_api_add_into_main_grad_from_a_packed_h():
    """MoELayer(precision="mxfp8_emulated", fuse_wgrad_accumulation=True, saved_h_format="mxfp8"):
    h is kept packed (uint8, 33/64 of bf16's bytes), each expert weight's main_grad ends as what it
    held plus the fp32 gradient the MXFP8 backward gives from that packed h (bitwise), autograd gets
    None for those weights, and out, dx and d_topk_w are the functional path's bits; mok.api's
    forward/backward with the layer's config give the same bits."""
    from mok import api
    from mok.layer import MoELayer
    from mok.saved_mxfp8 import pack_saved

    from helpers import moe_backward, moe_forward
    from test_layer_gpu import external_routing

    torch.manual_seed(10)
    layer = MoELayer(512, 256, 16, 4, shared_intermediate=384, device="cuda", precision="mxfp8_emulated",
                     fuse_wgrad_accumulation=True, saved_h_format="mxfp8")
    params = [layer.gate_proj, layer.up_proj, layer.down_proj, *layer.shared_weights()]
    experts, shared = params[:3], tuple(params[3:])
    x = torch.randn(333, 512, device="cuda").bfloat16()
    idx, w = external_routing(333, seed=4)
    dout = torch.randn(333, 512, device="cuda").bfloat16()
    with torch.no_grad():
        res = moe_forward(x, idx, w, *experts, shared, save_for_backward=True, precision="mxfp8_emulated")
        packed = pack_saved(res)
        g = moe_backward(dout, x, idx, w, *experts, shared, packed, grad_dtype=torch.float32, precision="mxfp8_emulated")
    fresh = [g.d_w_gate, g.d_w_up, g.d_w_down, *g.d_shared]
    starts = [torch.randn(p.shape, device="cuda") for p in params]
    for p, start in zip(params, starts):
        p.main_grad = start.clone()
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    saved_dtypes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved_dtypes.append(t.dtype) or t, lambda t: t):
        out = layer(xg, topk_idx=idx, topk_w=wg)
    out.backward(dout)
    assert torch.uint8 in saved_dtypes  # (h and the shared expert's h, packed)
    assert torch.equal(out, res.out) and torch.equal(xg.grad, g.dx) and torch.equal(wg.grad, g.d_topk_w)
    for p, start, new in zip(params, starts, fresh):
        assert p.grad is None and torch.equal(p.main_grad, start + new)
    mains = [start.clone() for start in starts]
    out2, ctx = api.forward(layer.config, None, x, idx, w, *experts, shared)
    assert torch.equal(out2, res.out) and ctx.saved.h.dtype == torch.uint8
    g2 = api.backward(layer.config, None, ctx, dout, main_grads=tuple(mains))
    assert torch.equal(g2.dx, g.dx) and torch.equal(g2.d_topk_w, g.d_topk_w)
    assert all(torch.equal(m, start + new) for m, start, new in zip(mains, starts, fresh))
    for p in params:
        del p.main_grad


def test_mxfp8_layer_on_hopper_asks_for_the_emulated_precision():
    from mok.layer import MoELayer

    if torch.cuda.get_device_capability()[0] == 10:
        pytest.skip("an SM100 GPU has block-scaled MMAs")
    layer = MoELayer(512, 256, 16, 4, device="cuda", precision="mxfp8")
    with pytest.raises(NotImplementedError, match="precision='mxfp8_emulated' runs the same numerics there"):
        layer(torch.randn(8, 512, device="cuda").bfloat16())


@pytest.mark.parametrize("fuse,saved_h_format", [(False, "bf16"), (True, "mxfp8")])
def test_precompile_lists_every_kernel_the_emulated_mxfp8_layer_looks_up(fuse, saved_h_format):
    """The plan's variants of an MXFP8-emulated layer (what `mok precompile --precision
    mxfp8_emulated` builds) name every kernel variant its forward and backward look up."""
    from mok.layer import MoELayer
    from mok.plan import plan_for

    from helpers import recorded_lookups

    torch.manual_seed(11)
    layer = MoELayer(512, 256, 8, 2, shared_intermediate=384, device="cuda", precision="mxfp8_emulated",
                     fuse_wgrad_accumulation=fuse, saved_h_format=saved_h_format)
    if fuse:
        for p in layer.parameters():
            p.main_grad = torch.zeros(p.shape, device="cuda")
    with recorded_lookups() as looked_up:
        x = torch.randn(300, 512, device="cuda").bfloat16().requires_grad_()
        layer(x).float().square().sum().backward()
    listed = {(v.name, tuple(sorted(v.config.items()))) for v in plan_for(layer.config, "sm_90a").variants()}
    assert looked_up and looked_up <= listed, sorted(looked_up - listed)


def random_partial_rows(shape, seed):
    """bf16 rows of a width 32 need not divide (a multiple of 16), each block of 32 its own magnitude."""
    width = shape[-1]
    padded = random_rows((*shape[:-1], width + (-width % BLOCK)), seed)
    return padded[..., :width].contiguous()


def row_of_chunk_bytes(shape, rows: int) -> torch.Tensor:
    """Of MMA-ordered scales ``shape`` [chunks, chunks along K, 512] (or with leading matrices), the
    bytes that belong to rows < ``rows`` (of each matrix), their padding blocks' included."""
    byte = torch.arange(512)
    in_chunk = byte // 16 + byte % 16 // 4 * 32  # byte (r % 32)·16 + (r // 32)·4 + c of a chunk: its row
    row = torch.arange(shape[-3])[:, None, None] * 128 + in_chunk
    return (row < rows).expand(shape)


@pytest.mark.parametrize("shape", [(300, 2064), (7, 1040), (5, 2880), (3, 16), (2, 4, 48)])
def test_quantizer_at_widths_32_does_not_divide_gives_the_reference_bytes(shape):
    """Rows a multiple of 16 wide (2064, 1040: half a block at a row's end; 2880: whole blocks, 22.5
    chunks of 128): by rows, the reference's elements and ceil(width / 32) scales a row, every
    byte written (outputs poisoned with 0x00, then 0xFF)."""
    x = random_partial_rows(shape, seed=sum(shape))
    x.view(-1, x.shape[-1])[0, -5] = float("nan")  # (a NaN in the last block of a row)
    want_elements, want_scales = quantize_reference(x.cpu())
    for byte in (0x00, 0xFF):
        elements = torch.full(x.shape, byte, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
        scales = torch.full(tuple(want_scales.shape), byte, dtype=torch.uint8, device="cuda")
        quantize_mxfp8(x, out=(elements, scales))
        assert torch.equal(elements.view(torch.uint8).cpu(), want_elements.view(torch.uint8))
        assert torch.equal(scales.cpu(), want_scales)


@pytest.mark.parametrize("rows,width,segments", [(300, 2880, 1), (129, 2064, 1), (1, 1040, 1), (300, 2080, 2), (200, 2880, 2)])
def test_quantizer_in_the_mma_order_at_widths_128_does_not_divide_writes_finite_padding(rows, width, segments):
    """scale_order="mma" at widths 128 does not divide: ceil(width / 128) chunks a row (with
    ``segments`` 2, dh's halves blocked apart, each half's chunks in turn), every byte of rows < R
    the reference's (mok.mxfp8.mma_scale_layout of each half's scales), their padding blocks'
    bytes 127 (finite: the MMA multiplies them by TMA's zeros) written too (two poisons), the
    padding rows' left alone; bounded by a device count, the rows past it untouched."""
    from mok.mxfp8 import mma_scale_layout

    x = random_partial_rows((rows, width), seed=rows + width)
    references = [quantize_reference(half) for half in x.cpu().chunk(segments, dim=1)]
    want_elements = torch.cat([e.view(torch.uint8) for e, _ in references], dim=1)
    want = torch.cat([mma_scale_layout(s) for _, s in references], dim=-2)  # (padding blocks and rows: 127)
    written = row_of_chunk_bytes(want.shape, rows)
    for byte in (0x00, 0xFF):
        elements = torch.full((rows, width), byte, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
        scales = torch.full(tuple(want.shape), byte, dtype=torch.uint8, device="cuda")
        quantize_mxfp8(x, out=(elements, scales), scale_order="mma", segments=segments)
        got = scales.cpu()
        assert torch.equal(elements.view(torch.uint8).cpu(), want_elements)
        assert torch.equal(got[written], want[written]) and (got[~written] == byte).all()
    used = rows // 2
    count = torch.full((1,), used, dtype=torch.int32, device="cuda")
    scales = torch.full(tuple(want.shape), 0xAB, dtype=torch.uint8, device="cuda")
    quantize_mxfp8(x, out=(torch.empty_like(elements), scales), rows_used=count, scale_order="mma", segments=segments)
    used_bytes = row_of_chunk_bytes(want.shape, used)
    got = scales.cpu()
    assert torch.equal(got[used_bytes], want[used_bytes]) and (got[~used_bytes] == 0xAB).all()


@pytest.mark.parametrize("experts,n,k", [(3, 1040, 2064), (2, 2880, 2880), (4, 136, 256)])
def test_quantizer_chunks_a_stack_of_weights_one_matrix_at_a_time(experts, n, k):
    """Weights [E, N, K] with N no multiple of 128 in the MMA's order: [E, ceil(N / 128),
    ceil(K / 128), 512], each expert's matrix chunked on its own (its padding rows' and padding
    blocks' bytes 127: finite scales where the MMA reads past N), the reference's bytes for every
    row of every expert, whatever the buffer held."""
    from mok.mxfp8 import mma_scale_layout

    w = random_partial_rows((experts, n, k), seed=n + k)
    want_elements, want_scales = quantize_reference(w.cpu())
    want = mma_scale_layout(want_scales)
    written = row_of_chunk_bytes(want.shape, n)
    for byte in (0x00, 0xFF):
        elements = torch.full(w.shape, byte, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
        scales = torch.full(tuple(want.shape), byte, dtype=torch.uint8, device="cuda")
        quantize_mxfp8(w, out=(elements, scales), scale_order="mma")
        got = scales.cpu()
        assert torch.equal(elements.view(torch.uint8).cpu(), want_elements.view(torch.uint8))
        assert torch.equal(got[written], want[written]) and (got[~written] == 127).all()


@pytest.mark.parametrize("rows,width,segments", [(300, 2064, 1), (33, 1040, 1), (300, 2080, 2), (5, 48, 1)])
def test_dequantizer_at_widths_32_does_not_divide_gives_the_references_values(rows, width, segments):
    """The dequantizer of rows ending in half a block (``segments`` 2: each half of a row its own
    blocks): random E4M3 bytes (NaN included) and E8M0 scales (0, 254 and NaN's 255 among them)
    give the reference's values rounded to bf16, the output poisoned first; bounded by a device
    count, the rows past it untouched."""
    g = torch.Generator(device="cuda").manual_seed(rows + width)
    elements = torch.randint(0, 256, (rows, width), dtype=torch.uint8, device="cuda", generator=g).view(torch.float8_e4m3fn)
    blocks = -(-width // segments // BLOCK)
    scales = torch.randint(100, 155, (rows, segments * blocks), dtype=torch.uint8, device="cuda", generator=g)
    scales[:3, 0] = torch.tensor([0, 254, SCALE_NAN], dtype=torch.uint8)
    halves = zip(elements.cpu().chunk(segments, dim=1), scales.cpu().chunk(segments, dim=1))
    want = torch.cat([dequantize_reference(e, s) for e, s in halves], dim=1).to(torch.bfloat16)
    out = torch.full((rows, width), float("nan"), dtype=torch.bfloat16, device="cuda")
    same = lambda got, ref: ((got.view(torch.int16) == ref.view(torch.int16)) | (got.isnan() & ref.isnan())).all()  # noqa: E731
    dequantize_mxfp8(elements, scales, out=out, segments=segments)
    got = out.cpu()
    assert same(got, want) and got.isnan().sum() == want.isnan().sum()
    used = rows // 2
    out = torch.full((rows, width), 3.0, dtype=torch.bfloat16, device="cuda")
    dequantize_mxfp8(elements, scales, out=out, segments=segments, rows_used=torch.full((1,), used, dtype=torch.int32, device="cuda"))
    assert same(out[:used].cpu(), want[:used]) and (out[used:] == 3.0).all()


@pytest.mark.parametrize("T,H,I,E,k", [(1000, 2880, 2880, 32, 4), (700, 2064, 1040, 16, 4)])
def test_mxfp8_emulated_layer_at_widths_that_are_multiples_of_16(T, H, I, E, k):
    """precision="mxfp8_emulated" at gpt-oss's 2880 (22.5 chunks of 128) and at 2064, 1040 (half a
    block of 32 at a row's end): the forward and every gradient against the float64 reference on
    the same MXFP8 roundings (a partial last block scaled by the values it holds; dh's halves
    blocked apart), relative error; the same bits twice and for half the batch."""
    from helpers import check_mxfp8_backward, check_mxfp8_forward

    check_mxfp8_forward(T, H, I, E, k, None, "uniform", emulate=True)
    check_mxfp8_backward(T, H, I, E, k, None, "uniform", emulate=True)
