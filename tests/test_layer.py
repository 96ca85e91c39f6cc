"""MoELayer, the custom ops and the functional API on the CPU (the reference path behind the same ops)."""

import copy
import math
import warnings

import pytest
import torch

import mok
from mok import torch_ops
from mok.config import MoKConfig
from mok.layer import MoELayer, route
from mok.reference import moe_reference
from mok.schedule import Schedule
from mok.torch_ops import config_text

from helpers import value_errors_on_two_ranks


def small_layer(shared=48, seed=0, **kw):
    torch.manual_seed(seed)
    return MoELayer(64, 32, 8, 2, shared_intermediate=shared, dtype=torch.float32, **kw)


def reference_layer(layer, x):
    """The layer's math written with moe_reference (autograd through everything)."""
    tokens = x.reshape(-1, layer.config.hidden)
    idx, w = route(tokens @ layer.router.weight.T, layer.config.topk)
    out = moe_reference(tokens, idx, w, layer.gate_proj, layer.up_proj, layer.down_proj, layer.shared_weights())
    return out.reshape(x.shape)


def test_parameters_are_named_like_hugging_face_moe_models():
    layer = MoELayer(64, 32, 8, 2, shared_intermediate=48)
    shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    assert shapes == {
        "gate_proj": (8, 32, 64), "up_proj": (8, 32, 64), "down_proj": (8, 64, 32),
        "shared_gate_proj": (48, 64), "shared_up_proj": (48, 64), "shared_down_proj": (64, 48),
        "router.weight": (8, 64),
    }
    assert all(p.dtype == torch.bfloat16 for p in layer.parameters())  # precision="bf16"
    assert set(dict(MoELayer(64, 32, 8, 2).named_parameters())) == {"gate_proj", "up_proj", "down_proj", "router.weight"}


def test_initialisation_is_uniform_in_one_over_sqrt_fan_in():
    layer = MoELayer(256, 512, 16, 2, shared_intermediate=128, dtype=torch.float32)
    for weight in (layer.gate_proj, layer.up_proj, layer.down_proj, layer.shared_gate_proj, layer.shared_down_proj):
        bound = 1 / math.sqrt(weight.shape[-1])
        assert weight.abs().max() <= bound
        assert abs(float(weight.detach().std()) - bound / math.sqrt(3)) < 0.02 * bound  # U(-b, b) has std b/√3


def test_forward_and_gradients_match_the_reference_on_cpu():
    layer = small_layer()
    x = torch.randn(3, 5, 64, requires_grad=True)
    out = layer(x)
    dout = torch.randn_like(out)
    out.backward(dout)
    got = [x.grad] + [p.grad for p in layer.parameters()]

    layer.zero_grad()
    x2 = x.detach().clone().requires_grad_()
    want_out = reference_layer(layer, x2)
    want_out.backward(dout)
    want = [x2.grad] + [p.grad for p in layer.parameters()]
    assert torch.allclose(out, want_out, rtol=0, atol=0)  # the CPU op is the reference
    assert layer.router.weight.grad.abs().sum() > 0  # the router learns through topk_w
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=1e-4, atol=1e-6)


def test_cpu_path_warns_once():
    torch_ops._CPU_WARNED = False
    layer = small_layer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer(torch.randn(4, 64))
        layer(torch.randn(4, 64))
    assert sum("reference path" in str(w.message) for w in caught) == 1
    (warned,) = [w for w in caught if "reference path" in str(w.message)]
    assert warned.filename == __file__  # attributed to the caller's line, not to torch's dispatch


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message is for machines without a CUDA GPU")
def test_a_cuda_layer_without_a_gpu_says_so():
    with pytest.raises(RuntimeError, match=r"device='cuda', but no CUDA GPU is visible .*construct the layer on the CPU"):
        MoELayer(64, 32, 8, 2, device="cuda")


def test_refusals_name_only_the_widths_given():
    """An MXFP8 layer's width check names H and I, and the shared expert's width only when there is one."""
    with pytest.raises(ValueError, match=r"multiples of 16 \(16-byte E4M3 rows\), got \{'hidden': 72, 'intermediate': 32\}$"):
        MoELayer(72, 32, 8, 2, precision="mxfp8")
    with pytest.raises(ValueError, match=r"'shared_intermediate': 40\}$"):
        MoELayer(128, 128, 8, 2, 40, precision="mxfp8")
    with pytest.raises(ValueError, match=r"got \{'intermediate': 40\}$"):
        MoELayer(64, 40, 8, 2, saved_h_format="mxfp8")


def test_external_routing_gets_the_router_gradient():
    layer = small_layer(shared=None)
    x = torch.randn(6, 64)
    idx = torch.stack([torch.randperm(8)[:2] for _ in range(6)])
    w = torch.rand(6, 2, requires_grad=True)
    layer(x, topk_idx=idx, topk_w=w).sum().backward()
    w2 = w.detach().clone().requires_grad_()
    moe_reference(x, idx, w2, layer.gate_proj, layer.up_proj, layer.down_proj).sum().backward()
    assert torch.allclose(w.grad, w2.grad, rtol=1e-4, atol=1e-6)


def test_non_contiguous_input_is_copied_not_rejected():
    layer = small_layer()
    x = torch.randn(64, 10).T  # [10, 64], non-contiguous
    assert torch.equal(layer(x), layer(x.contiguous()))


def test_zero_tokens():
    layer = small_layer()
    x = torch.randn(0, 64, requires_grad=True)
    out = layer(x)
    assert out.shape == (0, 64)
    out.sum().backward()
    assert x.grad.shape == (0, 64)
    assert all(p.grad is None or not p.grad.any() for p in layer.parameters())


def test_nan_in_one_token_stays_in_that_token():
    """On the CPU path the NaN must not spread. The bits of the other tokens may move by an ulp:
    the NaN token routes elsewhere, the experts' row counts change, and the CPU BLAS may block a
    GEMM differently for another row count (the GPU test holds the fused kernels to the bits)."""
    layer = small_layer()
    x = torch.randn(9, 64)
    clean = layer(x)
    x[4, 7] = float("nan")
    out = layer(x)
    assert out[4].isnan().all()
    keep = torch.arange(9) != 4
    assert not out[keep].isnan().any()
    torch.testing.assert_close(out[keep], clean[keep], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda l: l(torch.randn(4, 64, dtype=torch.float64)), TypeError, "x: expected dtype float32, got float64"),
        (lambda l: l(torch.randn(4, 65)), ValueError, r"x: expected shape \[\.\.\., 64\], got \[4, 65\]"),
        (lambda l: l(torch.randn(4, 64, device="meta")), ValueError, "x: expected a tensor on cpu, got one on meta"),
        (lambda l: l(torch.randn(4, 64), topk_idx=torch.zeros(4, 2, dtype=torch.int32)), ValueError, "give both"),
        (
            lambda l: l(torch.randn(4, 64), topk_idx=torch.full((4, 2), 8), topk_w=torch.rand(4, 2)),
            ValueError, r"topk_idx: expected every entry in \[0, 8\), got 8",
        ),
        (
            lambda l: l(torch.randn(4, 64), topk_idx=torch.zeros(4, 2), topk_w=torch.rand(4, 2)),
            TypeError, "topk_idx: expected dtype int32 or int64, got float32",
        ),
        (
            lambda l: l(torch.randn(4, 64), topk_idx=torch.zeros(4, 2, dtype=torch.int64), topk_w=torch.rand(4, 3)),
            ValueError, r"topk_w: expected shape \[4, 2\], got \[4, 3\]",
        ),
    ],
    ids=["dtype", "shape", "device", "half-routing", "index-range", "index-dtype", "weight-shape"],
)
def test_bad_input_raises_a_clear_error(call, error, match):
    with pytest.raises(error, match=match):
        call(small_layer())


def test_unsupported_gpu_arch_names_the_supported_ones(monkeypatch):
    from mok.runtime import arch

    monkeypatch.setattr(arch, "device_arch", lambda device=None: "sm_100a")
    with pytest.raises(RuntimeError, match=r"runs on sm_90a \(Hopper: H100/H200\) so far; this GPU is sm_100a"):
        arch.check_fused_layer_device(0)


def test_sm100_runs_the_layer_only_when_asked_to_and_says_why(monkeypatch):
    """SM100's GEMMs are compile-verified, never run: the layer refuses them unless MOK_UNVERIFIED_SM100=1."""
    from mok.runtime import arch

    monkeypatch.setattr(arch, "device_arch", lambda device=None: "sm_100a")
    monkeypatch.delenv("MOK_UNVERIFIED_SM100", raising=False)
    with pytest.raises(RuntimeError, match=r"this GPU is sm_100a: .*never run on an SM100 GPU; set MOK_UNVERIFIED_SM100=1"):
        arch.check_fused_layer_device()
    monkeypatch.setenv("MOK_UNVERIFIED_SM100", "1")
    assert arch.check_fused_layer_device() == "sm_100a"
    assert arch.has_persistent_gemms("sm_100a") and arch.has_persistent_gemms("sm_90a") and not arch.has_persistent_gemms("sm_120a")
    monkeypatch.setattr(arch, "device_arch", lambda device=None: "sm_120a")  # (no kernels at all: refused either way)
    with pytest.raises(RuntimeError, match=r"this GPU is sm_120a \(its grouped GEMMs are not written yet"):
        arch.check_fused_layer_device()


def test_fused_layer_refuses_a_device_that_is_not_the_current_one(monkeypatch):
    """MoK's kernels launch on the current device with the tensors' device's stream: a layer on
    cuda:1 called while cuda:0 is current gets a clear error, not a driver failure."""
    from mok.runtime import arch

    monkeypatch.setattr(arch, "device_arch", lambda device=None: "sm_90a")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    arch.check_fused_layer_device(0)
    with pytest.raises(ValueError, match=r"x: on cuda:1, but the current CUDA device is cuda:0; .*torch.cuda.device\(1\)"):
        arch.check_fused_layer_device(1)


def test_custom_ops_pass_opcheck():
    layer = small_layer()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 64, generator=g)
    idx, w = route(torch.randn(6, 8, generator=g), 2)
    weights = [t.detach() for t in (layer.gate_proj, layer.up_proj, layer.down_proj, *layer.shared_weights())]
    config = config_text(layer.config)
    fwd_args = (x, idx, w, *weights, config, 0, True, False, 5.0)
    torch.library.opcheck(torch.ops.mok.moe_forward.default, fwd_args)
    one_launch = config_text(MoKConfig(**{**layer.config.as_dict(), "one_launch": True}))
    torch.library.opcheck(torch.ops.mok.moe_forward.default, (x, idx, w, *weights, one_launch, 0, True, False, 5.0))  # the same outputs
    _, *saved = torch.ops.mok.moe_forward(*fwd_args)
    bwd_args = (torch.randn(6, 64, generator=g), x, idx, w, *weights, saved, config, 0, 5.0)
    torch.library.opcheck(torch.ops.mok.moe_backward.default, (*bwd_args, []), test_utils=("test_schema", "test_faketensor"))
    mains = [torch.randn(t.shape, generator=g) for t in weights]  # (the op adds into them: declared as mutated)
    torch.library.opcheck(torch.ops.mok.moe_backward.default, (*bwd_args, mains), test_utils=("test_schema", "test_faketensor"))
    # the shared expert in the routed launches (I_s == I): its rows first, h[:T] its h, shared_h empty
    same = small_layer(shared=32)
    assert same.shared_in_routed and not small_layer().shared_in_routed
    weights = [t.detach() for t in (same.gate_proj, same.up_proj, same.down_proj, *same.shared_weights())]
    config = config_text(same.config)
    fwd_args = (x, idx, w, *weights, config, 0, True, True, 5.0)
    torch.library.opcheck(torch.ops.mok.moe_forward.default, fwd_args)
    _, *saved = torch.ops.mok.moe_forward(*fwd_args)
    h, shared_h, _, _, *schedule = saved
    row_token = dict(zip(Schedule.FIELDS, schedule))["row_token"]
    assert shared_h.shape[0] == 0 and row_token[:6].tolist() == list(range(6))  # the tokens first
    bwd_args = (torch.randn(6, 64, generator=g), x, idx, w, *weights, saved, config, 0, 5.0)
    torch.library.opcheck(torch.ops.mok.moe_backward.default, (*bwd_args, []), test_utils=("test_schema", "test_faketensor"))


def test_a_shared_expert_of_the_routed_shapes_lies_after_them_and_stays_so_after_to():
    """MoELayer with I_s == I keeps each shared projection right after the routed ones in one
    storage (what lets the forward run it in the routed launches), also after .to() and
    load_state_dict; the parameters keep their names and shapes, and the layer still matches its
    reference."""
    from mok.pipeline.stages import shared_expert_as_last

    torch.manual_seed(0)
    layer = MoELayer(64, 32, 8, 2, shared_intermediate=32)  # (bf16)
    stacked = lambda m: shared_expert_as_last(m.gate_proj, m.up_proj, m.down_proj, m.shared_weights()) is not None  # noqa: E731
    assert stacked(layer)
    assert [(n, tuple(p.shape)) for n, p in layer.named_parameters()][:4] == [
        ("gate_proj", (8, 32, 64)), ("up_proj", (8, 32, 64)), ("down_proj", (8, 64, 32)), ("shared_gate_proj", (32, 64)),
    ]
    layer.to(torch.float32)  # (new storage for every parameter, then put back together)
    assert stacked(layer) and layer.gate_proj.dtype == torch.float32
    other = small_layer(shared=32, seed=1)
    other.load_state_dict(layer.state_dict())
    assert stacked(other) and torch.equal(other.shared_down_proj, layer.shared_down_proj)
    x = torch.randn(5, 64)
    assert torch.allclose(layer(x), reference_layer(layer, x), rtol=1e-5, atol=1e-6)



def with_main_grads(layer, seed, megatron=False):
    """Random fp32 main_grad buffers on the layer's expert weights (and Megatron's flag if asked); their values."""
    g = torch.Generator().manual_seed(seed)
    experts = [layer.gate_proj, layer.up_proj, layer.down_proj, *(layer.shared_weights() or ())]
    for p in experts:
        p.main_grad = torch.randn(p.shape, generator=g)
        if megatron:
            p.grad_added_to_main_grad = False
    return experts, [p.main_grad.clone() for p in experts]


@pytest.mark.parametrize("shared", [48, None])
def test_fused_wgrad_accumulation_adds_the_weight_gradients_into_main_grad(shared):
    """fuse_wgrad_accumulation: each expert weight's gradient lands in its fp32 main_grad (on top of
    what was there) and autograd gets None for it; the router, x and the other gradients as usual."""
    plain, fused = small_layer(shared), small_layer(shared, fuse_wgrad_accumulation=True)
    x = torch.randn(2, 5, 64)
    x_plain, x_fused = x.clone().requires_grad_(), x.clone().requires_grad_()
    plain(x_plain).square().sum().backward()
    experts, before = with_main_grads(fused, seed=1)
    fused(x_fused).square().sum().backward()
    plain_experts = [plain.gate_proj, plain.up_proj, plain.down_proj, *(plain.shared_weights() or ())]
    for p, old, q in zip(experts, before, plain_experts):
        assert p.grad is None
        torch.testing.assert_close(p.main_grad, old + q.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x_fused.grad, x_plain.grad)
    torch.testing.assert_close(fused.router.weight.grad, plain.router.weight.grad)


def test_fused_wgrad_accumulation_follows_megatrons_flags():
    """A weight with Megatron's grad_added_to_main_grad gets it set and a placeholder gradient of its
    shape (zeros with zero_out_wgrad), so gradient hooks still fire; main_grad holds the sum."""
    layer = small_layer(fuse_wgrad_accumulation=True)
    experts, before = with_main_grads(layer, seed=2, megatron=True)
    layer.down_proj.zero_out_wgrad = True
    fired = []
    for p in experts:
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad_added_to_main_grad))
    layer(torch.randn(7, 64)).sum().backward()
    assert fired == [True] * len(experts)
    assert all(p.grad_added_to_main_grad and p.grad.shape == p.shape for p in experts)
    assert not layer.down_proj.grad.any()
    assert all(not torch.equal(p.main_grad, old) for p, old in zip(experts, before))


def test_fused_wgrad_accumulation_leaves_frozen_experts_alone():
    layer = small_layer(fuse_wgrad_accumulation=True)
    for p in (layer.gate_proj, layer.up_proj, layer.down_proj, *layer.shared_weights()):
        p.requires_grad_(False)  # (no main_grad either: nothing is added anywhere)
    x = torch.randn(4, 64, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and layer.router.weight.grad is not None and layer.gate_proj.grad is None


def test_fused_wgrad_accumulation_needs_a_main_grad_of_the_weights_shape():
    layer = small_layer(fuse_wgrad_accumulation=True)
    with pytest.raises(RuntimeError, match=r"expert weight 0 \(shape \[8, 32, 64\]\) has no main_grad"):
        layer(torch.randn(3, 64)).sum().backward()
    experts, _ = with_main_grads(layer, seed=3)
    layer.up_proj.main_grad = torch.zeros(8, 32, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"expert weight 1 .*expected a contiguous float32 main_grad of shape \[8, 32, 64\].*bfloat16"):
        layer(torch.randn(3, 64)).sum().backward()
    with pytest.raises(TypeError, match="fuse_wgrad_accumulation: expected a bool"):
        small_layer(fuse_wgrad_accumulation=1)


def test_fused_wgrad_accumulation_says_it_is_eager_only_under_torch_compile():
    layer = small_layer(fuse_wgrad_accumulation=True)
    with_main_grads(layer, seed=4)
    compiled = torch.compile(layer, fullgraph=True)
    with pytest.raises(Exception, match="fuse_wgrad_accumulation: eager mode only"):
        compiled(torch.randn(3, 64)).sum().backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_backward_is_what_eager_autograd_computes(dtype):
    """mok.router.route_backward (what the route op's backward runs) against autograd through the
    eager route: the same bits, fp32 and bf16 logits, ties or not."""
    from mok.router import route_backward

    g = torch.Generator().manual_seed(11)
    for num_experts, topk in ((37, 5), (8, 2), (128, 8)):
        logits = torch.randn(301, num_experts, generator=g).to(dtype).requires_grad_()
        _, weights = route(logits, topk)
        d_weights = torch.randn(weights.shape, generator=g)
        (want,) = torch.autograd.grad(weights, logits, d_weights)
        assert torch.equal(route_backward(d_weights, logits.detach(), topk), want)


def test_compiled_layer_gives_the_eager_bits_with_the_built_in_router():
    """torch.compile (inductor, fullgraph) of a layer routed by its built-in router: the output and
    every gradient are the eager step's bits (the routing is an op torch.compile does not fuse)."""
    torch.manual_seed(12)
    layer = MoELayer(128, 64, 16, 4, 64, dtype=torch.float32)
    twin = copy.deepcopy(layer)
    x = torch.randn(300, 128)
    x_eager, x_compiled = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_eager = layer(x_eager)
    out_eager.square().sum().backward()
    out_compiled = torch.compile(twin, fullgraph=True)(x_compiled)
    out_compiled.square().sum().backward()
    assert torch.equal(out_eager, out_compiled) and torch.equal(x_eager.grad, x_compiled.grad)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(layer.parameters(), twin.parameters()))


def test_torch_compile_fullgraph_two_layers_matches_eager():
    torch.manual_seed(5)
    model = torch.nn.Sequential(
        MoELayer(64, 32, 8, 2, dtype=torch.float32), torch.nn.GELU(), MoELayer(64, 32, 8, 2, 48, dtype=torch.float32)
    )
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(9, 64, requires_grad=True)
    compiled(x).square().sum().backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    x.grad = None
    model.zero_grad()
    model(x).square().sum().backward()
    want = [x.grad] + [p.grad for p in model.parameters()]
    assert all(torch.allclose(g, w, rtol=1e-5, atol=1e-6) for g, w in zip(got, want))


def test_functional_api_checks_the_config():
    config = MoKConfig(hidden=64, intermediate=32, num_experts=8, topk=2)
    assert mok.get_workspace(config) is None and mok.create_workspace(config) is None
    layer = small_layer(shared=None)
    x = torch.randn(4, 64).bfloat16()  # (the fused path's dtype: its checks run on any device, then the device is refused)
    idx, w = route(torch.randn(4, 8), 2)
    weights = tuple(p.detach().bfloat16() for p in (layer.gate_proj, layer.up_proj, layer.down_proj))
    wrong = MoKConfig(hidden=64, intermediate=32, num_experts=8, topk=4)
    with pytest.raises(ValueError, match="topk: the config says 4, the tensors have 2"):
        mok.forward(wrong, None, x, idx, w, *weights)
    with pytest.raises(ValueError, match="x: expected a CUDA tensor"):  # the fused path itself is GPU-only
        mok.forward(config, None, x, idx, w, *weights)
    with pytest.raises(ValueError, match=r"group: expected 2 ranks \(config.ep_size\), got 1"):
        mok.get_workspace(MoKConfig(hidden=64, intermediate=32, num_experts=8, topk=2, ep_size=2))
    ep = MoKConfig(hidden=64, intermediate=32, num_experts=16, topk=2, ep_size=2)  # this rank: 8 of the 16 experts
    with pytest.raises(ValueError, match=r"workspace: expected get_workspace\(config, group, max_tokens=...\) for ep_size 2"):
        mok.forward(ep, None, x, idx, w, *weights)
    with pytest.raises(ValueError, match="workspace: expected None at ep_size 1"):
        mok.forward(config, object(), x, idx, w, *weights)
    # backward: the forward's config (kept in the context), and main_grads exactly when it fuses the accumulation
    from mok.api import LayerContext

    ctx = LayerContext(x, idx, w, weights, None, saved=None, config=config)
    fused = MoKConfig(hidden=64, intermediate=32, num_experts=8, topk=2, fuse_wgrad_accumulation=True)
    with pytest.raises(ValueError, match=r"config: not the forward's \(differs in fuse_wgrad_accumulation\)"):
        mok.backward(fused, None, ctx, x)
    with pytest.raises(ValueError, match="main_grads: config.fuse_wgrad_accumulation is False, so expected None, got tuple"):
        mok.backward(config, None, ctx, x, main_grads=tuple(torch.zeros(p.shape) for p in weights))
    ctx.config = fused
    with pytest.raises(ValueError, match="main_grads: config.fuse_wgrad_accumulation is True, so expected one fp32 buffer per weight, got None"):
        mok.backward(fused, None, ctx, x)



def _build_layers_of_different_widths(rank):
    import torch.distributed as dist

    MoELayer(64, 32 if rank == 0 else 48, 8, 2, group=dist.group.WORLD, dtype=torch.float32)


def test_ranks_building_different_layers_raise_at_construction(tmp_path):
    """A shape mismatch between ranks is an error when the layer is built, not a hang in its first exchange."""
    for msg in value_errors_on_two_ranks(tmp_path, _build_layers_of_different_widths):
        assert "ranks disagree on intermediate" in msg and "32" in msg and "48" in msg, msg


def test_layer_range_checks_the_ids_it_is_given_before_narrowing_them():
    """An int64 expert id past int32 must not wrap into a valid one (2**32 + 1 would become 1)."""
    layer = small_layer(shared=None)
    x = torch.randn(4, layer.config.hidden)
    idx = torch.tensor([[2**32 + 1, 3]] * 4)
    with pytest.raises(ValueError, match=r"topk_idx: expected every entry in \[0, 8\), got 4294967297"):
        layer(x, topk_idx=idx, topk_w=torch.rand(4, 2))


def _pass_more_than_max_tokens(rank):
    import torch.distributed as dist

    MoELayer(64, 32, 8, 2, group=dist.group.WORLD, max_tokens=4, dtype=torch.float32)(torch.randn(5, 64))


def test_expert_parallel_layer_refuses_more_tokens_than_max_tokens_on_every_device(tmp_path):
    """max_tokens bounds the tokens a rank passes per call on the CPU path too (the GPU path's workspace is sized by it)."""
    for msg in value_errors_on_two_ranks(tmp_path, _pass_more_than_max_tokens):
        assert "x: expected at most max_tokens=4 tokens per rank and call, got 5" in msg, msg


def test_mxfp8_precision_is_checked_at_construction_and_refused_on_the_cpu():
    """precision="mxfp8" / "mxfp8_emulated": what it does not combine with yet raises at
    construction, naming it; on the CPU (no reference of its numerics) the call raises clearly."""
    from mok.config import MoKConfig

    with pytest.raises(ValueError, match=r"precision='mxfp8': not with one_launch \(not written yet\)"):
        MoKConfig(256, 128, 8, 2, ep_size=2, precision="mxfp8", one_launch=True, fuse_wgrad_accumulation=True)
    assert MoKConfig(256, 128, 8, 2, ep_size=2, precision="mxfp8").ep_size == 2  # (expert parallelism: the scattering MXFP8 GEMMs)
    both = MoKConfig(256, 128, 8, 2, precision="mxfp8", fuse_wgrad_accumulation=True, saved_h_format="mxfp8")
    assert both.fuse_wgrad_accumulation and both.saved_h_format == "mxfp8"
    with pytest.raises(ValueError, match=r"saved_h_format='mxfp8': expected widths that are multiples of 16 .*'intermediate': 8"):
        MoKConfig(64, 8, 4, 2, saved_h_format="mxfp8")  # (h's 2I = 16 columns: not one block of 32)
    with pytest.raises(ValueError, match=r"saved_h_format='mxfp8': .*'shared_intermediate': 40"):
        MoKConfig(64, 32, 4, 2, shared_intermediate=40, saved_h_format="mxfp8")
    with pytest.raises(ValueError, match=r"precision='mxfp8_emulated': expected widths that are multiples of 16 \(16-byte E4M3 rows\)"):
        MoKConfig(256, 88, 8, 2, precision="mxfp8_emulated")
    with pytest.raises(ValueError, match=r"precision: expected one of \('bf16', 'mxfp8', 'mxfp8_emulated', 'fp8_block'\)"):
        MoKConfig(256, 128, 8, 2, precision="fp8")
    layer = MoELayer(256, 128, 8, 2, precision="mxfp8_emulated")
    with pytest.raises(NotImplementedError, match="the FP8 layer runs on a GPU only"):
        layer(torch.randn(4, 256).bfloat16())


def test_mxfp8_ops_fake_outputs_have_the_bf16_ops_shapes():
    """torch.compile traces mok::moe_forward / moe_backward with an MXFP8 precision through their
    fake implementations: the forward's outputs have the bf16 configuration's shapes and dtypes
    (bf16 or packed h, the shared expert's own h), the backward's gradients the shapes of what they
    differentiate, or empty ones when they went into main_grad buffers."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    shapes = dict(hidden=256, intermediate=128, num_experts=8, topk=2, shared_intermediate=128)
    emulated, bf16_config = config_text(MoKConfig(**shapes, precision="mxfp8_emulated")), config_text(MoKConfig(**shapes))
    packed_config = config_text(MoKConfig(**shapes, precision="mxfp8_emulated", fuse_wgrad_accumulation=True, saved_h_format="mxfp8"))
    packed_bf16_config = config_text(MoKConfig(**shapes, fuse_wgrad_accumulation=True, saved_h_format="mxfp8"))
    with FakeTensorMode():
        x, idx, w = torch.empty(300, 256, dtype=torch.bfloat16), torch.empty(300, 2, dtype=torch.int32), torch.empty(300, 2)
        gate, down = torch.empty(8, 128, 256, dtype=torch.bfloat16), torch.empty(8, 256, 128, dtype=torch.bfloat16)
        s_gate, s_down = torch.empty(128, 256, dtype=torch.bfloat16), torch.empty(256, 128, dtype=torch.bfloat16)
        weights = (gate, gate, down, s_gate, s_gate, s_down)
        mxfp8 = torch.ops.mok.moe_forward(x, idx, w, *weights, emulated, 0, True, False, 5.0)
        bf16 = torch.ops.mok.moe_forward(x, idx, w, *weights, bf16_config, 0, True, False, 5.0)
        assert [(t.shape, t.dtype) for t in mxfp8] == [(t.shape, t.dtype) for t in bf16]
        grads = torch.ops.mok.moe_backward(x, x, idx, w, *weights, list(mxfp8[1:]), emulated, 0, 5.0, [])
        assert [t.shape for t in grads] == [t.shape for t in (x, w, *weights)] + [(0,)] * 3  # (no biases)
        # h packed in MXFP8, the weight gradients added into main_grad buffers (none returned)
        packed = torch.ops.mok.moe_forward(x, idx, w, *weights, packed_config, 0, True, False, 5.0)
        packed_bf16 = torch.ops.mok.moe_forward(x, idx, w, *weights, packed_bf16_config, 0, True, False, 5.0)
        assert [(t.shape, t.dtype) for t in packed] == [(t.shape, t.dtype) for t in packed_bf16] and packed[1].dtype == torch.uint8
        mains = [torch.empty(t.shape) for t in weights]
        added = torch.ops.mok.moe_backward(x, x, idx, w, *weights, list(packed[1:]), packed_config, 0, 5.0, mains)
        assert [t.shape for t in added] == [x.shape, w.shape] + [(0,)] * 9


def test_external_ids_are_range_checked_unless_the_caller_says_not_to(monkeypatch):
    """forward(..., check_routing=False) skips the ids' range check (its host read), for callers
    that vouch for their ids on CUDA; by default each call checks once."""
    import mok.layer

    calls = []
    real = mok.layer.check_index_range
    monkeypatch.setattr(mok.layer, "check_index_range", lambda *a: calls.append(a[0]) or real(*a))
    layer = small_layer()
    x, idx, w = torch.randn(4, 64), torch.randint(0, 8, (4, 2)), torch.rand(4, 2)
    want = layer(x, topk_idx=idx, topk_w=w)
    assert calls == ["topk_idx"]
    assert torch.equal(layer(x, topk_idx=idx, topk_w=w, check_routing=False), want) and calls == ["topk_idx"]


def test_the_forward_ops_saved_state_takes_no_gradient():
    """mok::moe_forward's h and shared_h are what its backward reads, not outputs to differentiate:
    marked non-differentiable, so a loss on them raises instead of getting a silently dropped
    gradient; the output's gradients are unchanged."""
    x = torch.randn(9, 64, requires_grad=True)
    idx, w = torch.randint(0, 4, (9, 2), dtype=torch.int32), torch.rand(9, 2, requires_grad=True)
    gate, down = torch.randn(4, 32, 64, requires_grad=True), torch.randn(4, 64, 32, requires_grad=True)
    config = config_text(MoKConfig(hidden=64, intermediate=32, num_experts=4, topk=2))
    out, h, shared_h, *_ = torch.ops.mok.moe_forward(x, idx, w, gate, gate, down, None, None, None, config, 0, True, False, 5.0)
    assert out.requires_grad and not h.requires_grad and not shared_h.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        h.float().sum().backward()


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "load_assign"])
def test_copies_and_assigning_loads_keep_the_shared_expert_after_the_routed_ones(how):
    """A shared expert of the routed experts' shapes lives right after them (one buffer per
    projection), so the fused path runs it in their launches without copying; a deepcopy, an
    unpickled layer and load_state_dict(assign=True) keep that layout, and the same values."""
    import copy
    import io

    from mok.pipeline.stages import shared_expert_as_last

    layer = MoELayer(64, 32, 8, 2, shared_intermediate=32, dtype=torch.float32)
    if how == "deepcopy":
        other = copy.deepcopy(layer)
    elif how == "pickle":
        buf = io.BytesIO()
        torch.save(layer, buf)
        buf.seek(0)
        other = torch.load(buf, weights_only=False)
    else:
        other = MoELayer(64, 32, 8, 2, shared_intermediate=32, dtype=torch.float32)
        other.load_state_dict({k: v.clone() for k, v in layer.state_dict().items()}, assign=True)
    routed = (other.gate_proj, other.up_proj, other.down_proj)
    assert shared_expert_as_last(*routed, other.shared_weights()) is not None
    assert all(torch.equal(a, b) for a, b in zip(layer.state_dict().values(), other.state_dict().values()))
    x = torch.randn(5, 64)
    assert torch.equal(other(x), layer(x))


def test_frozen_experts_get_no_weight_gradient_computed():
    """With every expert weight frozen (fine-tuning the router, say) the backward op is told so and
    runs no weight-gradient work: its nine weight outputs (routed, shared, biases) empty, autograd gets None for them; x's
    and the router's gradients those of the layer that trains everything."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if "moe_backward" in str(func):
                self.calls.append((args[-1], [tuple(t.shape) for t in out[2:]]))
            return out

    plain, frozen = small_layer(), small_layer()
    experts = [frozen.gate_proj, frozen.up_proj, frozen.down_proj, *frozen.shared_weights()]
    for p in experts:
        p.requires_grad_(False)
    x = torch.randn(7, 64)
    xp, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    plain(xp).square().sum().backward()
    with Record() as rec:
        frozen(xf).square().sum().backward()
    assert rec.calls == [(False, [(0,)] * 9)]
    assert all(p.grad is None for p in experts)
    torch.testing.assert_close(xf.grad, xp.grad)
    torch.testing.assert_close(frozen.router.weight.grad, plain.router.weight.grad)


def _deepcopy_expert_parallel_layer(rank):
    import copy

    import torch.distributed as dist

    torch.manual_seed(4)
    layer = MoELayer(64, 32, 8, 2, group=dist.group.WORLD, max_tokens=8, dtype=torch.float32)
    twin = copy.deepcopy(layer)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(rank))
    shared = twin.group is layer.group and twin.gate_proj.data_ptr() != layer.gate_proj.data_ptr()
    raise ValueError(f"shared group, own weights: {shared}; same output: {torch.equal(twin(x), layer(x))}")


def test_an_expert_parallel_layer_can_be_deepcopied(tmp_path):
    """copy.deepcopy of a layer with a process group (an EMA copy, say): the group is shared, the
    weights copied, and the copy computes what the original does (its calls collectives too)."""
    for msg in value_errors_on_two_ranks(tmp_path, _deepcopy_expert_parallel_layer):
        assert msg == "shared group, own weights: True; same output: True", msg


def test_router_logits_off_the_gpu_are_f_linear_and_bad_shapes_are_named():
    """mok.router.router_logits: on the CPU (and for dtypes other than bf16) exactly F.linear;
    a weight of the wrong width or dtype is refused with the expected shape or dtype named."""
    from mok.plan import padded_experts
    from mok.torch_ops import router_logits

    x, w = torch.randn(33, 256), torch.randn(24, 256)
    assert torch.equal(router_logits(x, w), torch.nn.functional.linear(x, w))
    assert [padded_experts(e) for e in (1, 128, 129, 256)] == [128, 128, 256, 256]
    with pytest.raises(ValueError, match=r"expected \[E, 256\]"):
        router_logits(x, torch.randn(24, 128))
    with pytest.raises(TypeError, match="router weight: expected dtype float32"):
        router_logits(x, w.bfloat16())
