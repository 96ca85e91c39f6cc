"""Static config validation and the op's checks that run before any GPU is touched."""

import pytest
import torch

from mok import MoKConfig, combine


def test_config_derived_values():
    c = MoKConfig(hidden=7168, intermediate=2048, num_experts=256, topk=8, shared_intermediate=2048, ep_size=8)
    assert c.experts_per_rank == 32 and c.has_shared_expert
    assert hash(c) == hash(MoKConfig(**c.as_dict()))


@pytest.mark.parametrize("ep_size", [1, 2])
def test_one_launch_config_adds_its_kernels(ep_size):
    """The plan's variants (what precompile builds) hold the one-launch forward (h saved or not)
    only when the config asks for it; at EP > 1 it is the expert-parallel one."""
    from mok.plan import plan_for

    base = dict(hidden=512, intermediate=256, num_experts=8, topk=2, ep_size=ep_size)
    one = [v.config for v in plan_for(MoKConfig(**base, one_launch=True), "sm_90a").variants() if v.name == "expert_mlp"]
    assert sorted(c["save_h"] for c in one) == [False, True]
    assert all(c["num_experts"] == 8 // ep_size and c.get("ep_world") == (ep_size if ep_size > 1 else None) for c in one)
    assert not any(v.name == "expert_mlp" for v in plan_for(MoKConfig(**base), "sm_90a").variants())


@pytest.mark.parametrize("options", [
    dict(), dict(shared_intermediate=2048), dict(ep_size=8), dict(ep_size=8, shared_intermediate=2048, dispatch_format="mxfp8"),
    dict(expert_bias=True, activation="clamped_swiglu"), dict(saved_h_format="recompute", fuse_wgrad_accumulation=True),
    dict(gate_up_layout="concatenated"), dict(hidden=2880, intermediate=2880), dict(one_launch=True),
    dict(one_launch=True, shared_intermediate=2048), dict(one_launch=True, ep_size=8, dispatch_format="mxfp8"),
])
def test_the_sm100_plan_runs_the_hopper_plans_kernels_in_bf16(options):
    """In bf16 the SM100 layer takes every option the Hopper layer does and launches the same kernel
    list (the variants, built for its arch: rows gathered in the GEMM, scattered at EP, biases,
    partial widths, the one-launch forward at one GPU and at EP)."""
    from mok.plan import plan_for, refusal

    config = MoKConfig(**{"hidden": 7168, "intermediate": 2048, "num_experts": 64, "topk": 8, **options})
    keys = lambda arch: sorted((v.name, tuple(sorted(v.config.items()))) for v in plan_for(config, arch).variants())  # noqa: E731
    assert keys("sm_100a") == keys("sm_90a") == keys("sm_103a")
    assert refusal(config, "sm_100a") is None


def test_sm100_precompile_list_holds_the_mxfp8_forward_and_hopper_does_not():
    """On sm_100a precompile builds the MXFP8 path's kernels for precision="mxfp8" (the pipelines'
    MXFP8 stages, forward and backward): its GEMMs on E4M3 operands at the layer's widths and the
    quantizer writing MMA-ordered scales (bounded, and whole for the weights), not the bf16 routed
    GEMMs; a bf16 layer none of them; sm_90a has no block-scaled MMA, so such a layer is refused
    there (plan_for raises). The built-in router's bf16 GEMMs are the same in both."""
    from mok.plan import plan_for, refusal, router_variants

    def keys(config, arch="sm_100a"):
        return {(v.name, tuple(sorted(v.config.items()))) for v in plan_for(config, arch).variants()}

    config = MoKConfig(hidden=7168, intermediate=2048, num_experts=32, topk=8, precision="mxfp8")
    sm100 = keys(config)
    bf16 = keys(MoKConfig(7168, 2048, 32, 8))
    assert not any(name.endswith("_mxfp8") or dict(c).get("operand") or dict(c).get("mma_order") for name, c in bf16)
    router = {(v.name, tuple(sorted(v.config.items()))) for v in router_variants(7168, 32)}
    routed_bf16 = {(name, c) for name, c in bf16 if name in ("grouped_gemm", "weight_grad")} - router
    assert routed_bf16 and not routed_bf16 & sm100 and router <= sm100 & bf16
    assert "block-scaled MMAs" in refusal(config, "sm_90a") and refusal(config, "sm_100a") is None
    e4m3 = lambda name: [dict(c) for n, c in sm100 if n == name and dict(c).get("operand") == "e4m3"]  # noqa: E731
    gemms = sorted((c["n"], c["k"], c["epilogue"], c.get("k_split", False)) for c in e4m3("grouped_gemm"))
    assert gemms == [(2048, 7168, "swiglu", False), (2048, 7168, "swiglu_bwd", False), (2048, 7168, "swiglu_save", False),
                     (7168, 2048, "plain", False), (7168, 4096, "plain", True)]
    quantizers = sorted((dict(c).get("bounded", False), dict(c).get("columns", False)) for name, c in sm100
                        if name == "quantize_mxfp8" and dict(c).get("mma_order"))
    assert quantizers == [(False, False), (True, False), (True, True)]
    wgrads = sorted((c["m"], c["n"], c.get("split_out", False)) for c in e4m3("weight_grad"))
    assert wgrads == [(4096, 7168, True), (7168, 2048, False)]
    fused = MoKConfig(hidden=7168, intermediate=2048, num_experts=32, topk=8, fuse_wgrad_accumulation=True, precision="mxfp8")
    added = [dict(c) for name, c in keys(fused) - sm100
             if name == "weight_grad" and dict(c).get("operand") == "e4m3"]  # fuse_wgrad_accumulation: the fp32 ones adding into main_grad
    assert sorted((c["m"], c["n"], c["a_stride"], c.get("split_out", False)) for c in added if c["accumulate"] and c["out_dtype"] == "f32") == [
        (2048, 7168, 4096, False), (4096, 7168, 4096, True), (7168, 2048, 7168, False)
    ] and len(added) == 3
    with pytest.raises(NotImplementedError, match="precision='mxfp8': needs block-scaled MMAs"):
        plan_for(config, "sm_90a")


def test_mxfp8_emulated_config_adds_its_quantizers_dequantizers_and_gemms_and_the_cli_sets_it():
    """precision="mxfp8_emulated" (any arch): the MMA-ordered quantizers, the dequantizers and the
    bf16 GEMMs on dequantized rows (gate/up without gathering, dx on the transposed weights' K-major
    copies) take the place of the bf16 plan's gathering gate/up GEMMs and N-major dx GEMM, the
    rest of the bf16 list as it is; the precompile CLI's --precision sets it."""
    import argparse

    from mok.cli import _add_shape_options, _config_from
    from mok.kernels.variants import grouped_gemm_variant, quantize_mxfp8_variant
    from mok.plan import plan_for

    base = dict(hidden=512, intermediate=256, num_experts=8, topk=2)
    for arch in ("sm_90a", "sm_100a"):
        keys = lambda variants: {(v.name, tuple(sorted(v.config.items()))) for v in variants}  # noqa: E731
        plain = keys(plan_for(MoKConfig(**base), arch).variants())
        emulated = keys(plan_for(MoKConfig(**base, precision="mxfp8_emulated"), arch).variants())
        extra = keys([
            quantize_mxfp8_variant(bounded=True, mma_order=True), quantize_mxfp8_variant(mma_order=True),
            quantize_mxfp8_variant(bounded=True, mma_order=True, columns=True), quantize_mxfp8_variant(back=True),
            quantize_mxfp8_variant(back=True, bounded=True),
            grouped_gemm_variant(256, 512, epilogue="swiglu"),
            grouped_gemm_variant(256, 512, epilogue="swiglu_save"),
            grouped_gemm_variant(512, 512, k_split=True),
        ])
        replaced = keys([grouped_gemm_variant(512, 512, b_major="n", k_split=True)] + [
            grouped_gemm_variant(256, 512, epilogue=epilogue, gather_a=True) for epilogue in ("swiglu", "swiglu_save")
        ])
        assert replaced <= plain and emulated == (plain - replaced) | extra and not extra <= plain
    parser = argparse.ArgumentParser()
    _add_shape_options(parser)
    assert _config_from(parser.parse_args(["--ep-size", "1", "--precision", "mxfp8_emulated"])).precision == "mxfp8_emulated"
    assert _config_from(parser.parse_args([])).precision == "bf16"


def test_mxfp8_dispatch_config_adds_its_kernels_and_the_cli_sets_it():
    """The plan's variants with dispatch_format="mxfp8": the quantizing publish and the dequantizing
    dispatch, nothing else; with one_launch also the one-launch forwards that quantize and
    dequantize (h saved or not) in place of the bf16 ones; `precompile --dispatch-format mxfp8` sets it."""
    import argparse

    from mok.cli import _add_shape_options, _config_from
    from mok.plan import plan_for

    variants_for = lambda config: plan_for(config, "sm_90a").variants()  # noqa: E731

    base = dict(hidden=512, intermediate=256, num_experts=8, topk=2, ep_size=2)
    plain = {(v.name, tuple(sorted(v.config.items()))) for v in variants_for(MoKConfig(**base))}
    mxfp8 = {(v.name, tuple(sorted(v.config.items()))) for v in variants_for(MoKConfig(**base, dispatch_format="mxfp8"))}
    assert plain < mxfp8
    assert sorted(name for name, _ in mxfp8 - plain) == ["ep_dispatch_mxfp8", "ep_publish_mxfp8"]
    one = {v.config.get("dispatch_format"): v.config["save_h"] for v in variants_for(MoKConfig(**base, one_launch=True)) if "ep_world" in v.config}
    one_mxfp8 = [v.config for v in variants_for(MoKConfig(**base, one_launch=True, dispatch_format="mxfp8")) if "ep_world" in v.config]
    assert list(one) == [None] and sorted(c["save_h"] for c in one_mxfp8) == [False, True]
    assert all(c["dispatch_format"] == "mxfp8" for c in one_mxfp8)
    parser = argparse.ArgumentParser()
    _add_shape_options(parser)
    config = _config_from(parser.parse_args(["--ep-size", "8", "--dispatch-format", "mxfp8"]))
    assert config.dispatch_format == "mxfp8" and _config_from(parser.parse_args([])).dispatch_format == "bf16"


def test_fp8_dispatch_config_adds_its_kernels_on_either_arch():
    """dispatch_format="fp8_block" (precision fp8_block, EP > 1): the plan adds the quantizing
    publish (by the config's scale rule), the dispatch that keeps the rows in FP8 and the
    dequantizer of the backward's x rows, nothing else; on SM100 (power-of-two scales, whole 128
    blocks) the dispatch writes the scales as E8M0 in the MMA order and MXFP8's dequantizer takes
    the rows back; `precompile --dispatch-format fp8_block` sets it; the saved rows are one uint8
    buffer of the FP8 rows and their scales, the same bytes in either scale order."""
    import argparse

    from mok.cli import _add_shape_options, _config_from
    from mok.pipeline.forward import x_rows_shape
    from mok.pipeline.stages import fp8_rows, packed_fp8_rows
    from mok.plan import plan_for, refusal

    def variants_for(config):
        return {(v.name, tuple(sorted(v.config.items()))) for v in plan_for(config, "sm_90a").variants()}

    base = dict(hidden=528, intermediate=256, num_experts=8, topk=2, ep_size=2, precision="fp8_block")
    plain, fp8 = variants_for(MoKConfig(**base)), variants_for(MoKConfig(**base, dispatch_format="fp8_block"))
    assert plain < fp8
    added = sorted((name, dict(config).get("power_of_two", False), dict(config).get("back", False)) for name, config in fp8 - plain)
    assert added == [("ep_dispatch_fp8_block", False, False), ("ep_publish_fp8_block", False, False), ("quantize_fp8_block", False, True)]
    pow2 = variants_for(MoKConfig(**base, dispatch_format="fp8_block", fp8_scales="power_of_two"))
    assert any(name == "ep_publish_fp8_block" and dict(config).get("power_of_two") for name, config in pow2)
    config = MoKConfig(**base, dispatch_format="fp8_block", fp8_scales="power_of_two")
    whole = MoKConfig(**{**base, "hidden": 512}, dispatch_format="fp8_block", fp8_scales="power_of_two")  # (SM100: whole 128 blocks)
    assert refusal(config, "sm_90a") is None and refusal(MoKConfig(**{**base, "hidden": 512}, fp8_scales="power_of_two"), "sm_100a") is None
    assert refusal(whole, "sm_100a") is None and "needs fp8_scales='power_of_two'" in refusal(MoKConfig(**base, dispatch_format="fp8_block"), "sm_100a")
    sm100_added = {(v.name, tuple(sorted(v.config.items()))) for v in plan_for(whole, "sm_100a").variants()} - {
        (v.name, tuple(sorted(v.config.items()))) for v in plan_for(MoKConfig(**{**base, "hidden": 512}, fp8_scales="power_of_two"), "sm_100a").variants()}
    assert sorted((name, dict(config).get("scale_order")) for name, config in sm100_added) == [
        ("dequantize_mxfp8", None), ("ep_dispatch_fp8_block", "mma"), ("ep_publish_fp8_block", None)]
    assert x_rows_shape(config, 384) == (384, 528 + 4 * 5) and x_rows_shape(MoKConfig(**base), 384) == (384, 528)
    packed = packed_fp8_rows(384, 512, "cpu")  # (SM100's packed rows: the scales' bytes as E8M0 in the MMA order, the same bytes)
    (elements, fp32_scales), (_, mma_scales) = fp8_rows(packed, 512), fp8_rows(packed, 512, "mma")
    assert elements.shape == (384, 512) and fp32_scales.shape == (4, 384) and mma_scales.shape == (3, 4, 512)
    assert mma_scales.dtype == torch.uint8 and mma_scales.data_ptr() == fp32_scales.data_ptr() == packed.data_ptr() + 384 * 512
    with pytest.raises(ValueError, match=r"packed: expected R a multiple of 128 for scale_order='mma', got R=200"):
        fp8_rows(packed_fp8_rows(200, 512, "cpu"), 512, "mma")
    assert fp8_rows(packed_fp8_rows(256, 2880, "cpu"), 2880, "mma")[1].shape == (2, 23, 512)  # (a partial last 128-block: its chunk)
    parser = argparse.ArgumentParser()
    _add_shape_options(parser)
    args = parser.parse_args(["--ep-size", "8", "--precision", "fp8_block", "--dispatch-format", "fp8_block"])
    assert _config_from(args).dispatch_format == "fp8_block"


def test_row_tile_pairs_config_puts_the_staged_bf16_gemms_on_clusters():
    """row_tile_pairs: the plan's routed gate/up, down and dx GEMMs (their EP forms too) with
    cluster_m=2, every other kernel as it was (the SwiGLU backward's ping-pong, the weight
    gradients, the shared expert's); refused with MXFP8 or one_launch (fp8_block takes it: its
    gate/up GEMM, below); the CLI sets it."""
    import argparse

    from mok.cli import _add_shape_options, _config_from
    from mok.plan import plan_for

    for base in (dict(hidden=512, intermediate=256, num_experts=8, topk=2, shared_intermediate=256),
                 dict(hidden=512, intermediate=256, num_experts=8, topk=2, ep_size=2)):
        plain = {(v.name, tuple(sorted(v.config.items()))) for v in plan_for(MoKConfig(**base), "sm_90a").variants()}
        pairs = {(v.name, tuple(sorted(v.config.items()))) for v in plan_for(MoKConfig(**base, row_tile_pairs=True), "sm_90a").variants()}
        clustered = {(name, config) for name, config in pairs if dict(config).get("cluster_m") == 2}
        assert {(name, tuple(kv for kv in config if kv[0] != "cluster_m")) for name, config in pairs} == plain  # (the same kernels else)
        forms = sorted((dict(c)["epilogue"], dict(c)["k_split"], dict(c).get("scatter", False)) for _, c in clustered)
        want = [("plain", False, base.get("ep_size", 1) > 1), ("plain", True, base.get("ep_size", 1) > 1), ("swiglu", False, False),
                ("swiglu_save", False, False)]
        assert forms == sorted(want), forms
    for bad in (dict(precision="mxfp8"), dict(one_launch=True)):
        with pytest.raises(ValueError, match="row_tile_pairs: the staged bf16 GEMMs' and fp8_block's option"):
            MoKConfig(512, 256, 8, 2, row_tile_pairs=True, **bad)
    with pytest.raises(TypeError, match="row_tile_pairs: expected a bool, got 1"):
        MoKConfig(512, 256, 8, 2, row_tile_pairs=1)
    parser = argparse.ArgumentParser()
    _add_shape_options(parser)
    assert _config_from(parser.parse_args(["--hidden", "512", "--row-tile-pairs"])).row_tile_pairs


def test_fused_wgrad_accumulation_config_adds_the_fp32_accumulating_weight_gradients():
    """The plan's variants with fuse_wgrad_accumulation: each expert MLP's weight gradients also as the
    fp32 kernels that add into main_grad (dW_down; dW_gate with dW_up; a half of dh alone), nothing else."""
    from mok.plan import plan_for

    variants_for = lambda config: plan_for(config, "sm_90a").variants()  # noqa: E731

    base = dict(hidden=512, intermediate=256, num_experts=8, topk=2, shared_intermediate=384)
    plain = {(v.name, tuple(sorted(v.config.items()))) for v in variants_for(MoKConfig(**base))}
    fused = {(v.name, tuple(sorted(v.config.items()))) for v in variants_for(MoKConfig(**base, fuse_wgrad_accumulation=True))}
    assert plain < fused
    added = [dict(c) for name, c in fused - plain]
    assert all(c["accumulate"] and c["out_dtype"] == "f32" for c in added) and len(added) == 6  # routed and shared
    assert sorted((c["m"], c["n"], c["a_stride"], c.get("split_out", False)) for c in added) == sorted(
        [(512, i, 512, False) for i in (256, 384)] + [(2 * i, 512, 2 * i, True) for i in (256, 384)] + [(i, 512, 2 * i, False) for i in (256, 384)]
    )


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        (dict(hidden=100), ValueError, "hidden: expected a multiple of 8"),
        (dict(intermediate=0), ValueError, "intermediate: expected an int >= 1, got 0"),
        (dict(num_experts=4.0), TypeError, "num_experts: expected an int, got float"),
        (dict(topk=300), ValueError, "topk: expected at most num_experts=256, got 300"),
        (dict(ep_size=3), ValueError, "num_experts: expected a multiple of ep_size=3, got 256"),
        (dict(shared_intermediate=-1), ValueError, "shared_intermediate: expected an int >= 1"),
        (dict(precision="fp16"), ValueError, "precision: expected one of ('bf16', 'mxfp8', 'mxfp8_emulated', 'fp8_block'), got 'fp16'"),
        (dict(topk=True), TypeError, "topk: expected an int, got bool"),
        (dict(one_launch=1), TypeError, "one_launch: expected a bool, got 1"),
        (dict(fuse_wgrad_accumulation="yes"), TypeError, "fuse_wgrad_accumulation: expected a bool, got 'yes'"),
        (dict(block_m=64), ValueError, "block_m: expected 128 (the row tile every MoK kernel is built for), got 64"),
        (dict(dispatch_format="fp8", ep_size=8), ValueError, "dispatch_format: expected one of ('bf16', 'mxfp8', 'fp8_block'), got 'fp8'"),
        (dict(dispatch_format="fp8_block", ep_size=8), ValueError, "dispatch_format='fp8_block': only with precision='fp8_block'"),
        (dict(dispatch_format="fp8_block", precision="fp8_block"), ValueError, "dispatch_format='fp8_block': only with ep_size > 1"),
        (dict(dispatch_format="mxfp8"), ValueError, "dispatch_format='mxfp8': only with ep_size > 1"),
        (dict(dispatch_format="mxfp8", ep_size=8, hidden=7176), ValueError, "expected hidden a multiple of 16 (16-byte E4M3 rows), got 7176"),
    ],
)
def test_config_rejects_bad_values(kwargs, error, words):
    args = dict(hidden=7168, intermediate=2048, num_experts=256, topk=8)
    args.update(kwargs)
    with pytest.raises(error) as info:
        MoKConfig(**args)
    assert words in str(info.value)


@pytest.mark.parametrize(
    "args,error,words",
    [
        ((torch.zeros(4, 2, 16, dtype=torch.bfloat16), torch.rand(4, 2)), ValueError, "y: expected a CUDA tensor, got one on cpu"),
        ((torch.zeros(4, 2, 16, dtype=torch.float16), torch.rand(4, 2)), TypeError, "y: expected dtype bfloat16, got float16"),
        ((torch.zeros(4, 16, dtype=torch.bfloat16), torch.rand(4, 2)), ValueError, "y: expected a 3-d tensor"),
        (("y", torch.rand(4, 2)), TypeError, "y: expected a torch.Tensor, got str"),
    ],
)
def test_combine_rejects_bad_input_before_launch(args, error, words):
    with pytest.raises(error) as info:
        combine(*args)
    assert words in str(info.value)


def test_one_launch_counters_are_sized_by_row_tiles():
    """The one-launch forward's counters: an error word, the next tile, one per row tile (the
    per-token arrival counters were fc2's epilogue combine's, which is gone)."""
    from mok.ops.one_launch import expert_mlp_counters
    from mok.schedule import build_schedule

    T, E, k = 64, 4, 2
    idx = torch.randint(0, E, (T, k), dtype=torch.int32)
    full = build_schedule(idx, E, block_m=128)
    assert expert_mlp_counters(full.capacity) == (2 + 5,)  # 640 rows = 5 row tiles


def test_one_launch_forward_op_rejects_bad_input_before_launch():
    """scheduled_expert_mlp (the forward in one launch) checks routing, weights, combine and barrier arguments first."""
    from mok.ops import scheduled_expert_mlp

    T, H, I, E, k = 64, 256, 128, 4, 2
    bf16 = dict(dtype=torch.bfloat16)
    x, wg, wu, wd = torch.randn(T, H).to(**bf16), torch.randn(E, I, H).to(**bf16), torch.randn(E, I, H).to(**bf16), torch.randn(E, H, I).to(**bf16)
    idx, w = torch.randint(0, E, (T, k), dtype=torch.int32), torch.rand(T, k)
    with pytest.raises(TypeError, match=r"x: expected a torch.Tensor, got list"):
        scheduled_expert_mlp([[1.0]], idx, w, wg, wu, wd)
    with pytest.raises(TypeError, match=r"topk_idx: expected dtype int32, got int64"):
        scheduled_expert_mlp(x, idx.long(), w, wg, wu, wd)
    with pytest.raises(ValueError, match=r"topk_idx: expected one row per token of x \(64\), got 32"):
        scheduled_expert_mlp(x, idx[:32].contiguous(), w, wg, wu, wd)
    with pytest.raises(ValueError, match=r"topk_w: expected shape \[64, 2\]"):
        scheduled_expert_mlp(x, idx, w[:, :1].contiguous(), wg, wu, wd)
    with pytest.raises(ValueError, match=r"grid_sync: expected shape \[4\]"):
        scheduled_expert_mlp(x, idx, w, wg, wu, wd, grid_sync=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="timeout_s: expected a positive number"):
        scheduled_expert_mlp(x, idx, w, wg, wu, wd, timeout_s=0)
    with pytest.raises(ValueError, match="x: expected a CUDA tensor"):  # the checks pass; then the launch checks refuse CPU data
        scheduled_expert_mlp(x, idx, w, wg, wu, wd)
    with pytest.raises(ValueError, match="shared_in_routed: .*shared_out given"):
        scheduled_expert_mlp(x, idx, w, wg, wu, wd, shared_in_routed=True, shared_out=x)


def test_grouped_gemm_scatter_rejects_bad_slots_before_launch():
    """The scattering down projection checks where its rows go: the slots' width, the rank layout
    (every rank's slots addressable with 32-bit offsets), then refuses CPU data."""
    from mok.ops import grouped_gemm_scatter

    R, H, I, E, T, k = 256, 256, 128, 2, 50, 4
    a, b = torch.zeros(R, I, dtype=torch.bfloat16), torch.zeros(E, H, I, dtype=torch.bfloat16)
    tiles, rows = torch.zeros(2, dtype=torch.int32), torch.zeros(R, dtype=torch.int32)
    slots = torch.zeros(T, k, H, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"slots: expected \[T, k, 256\] \(N of b\), got \[50, 4, 128\]"):
        grouped_gemm_scatter(a, b, tiles, rows, rows, torch.zeros(T, k, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="slot_ranks: expected .*rank stride >= 51200 elements"):
        grouped_gemm_scatter(a, b, tiles, rows, rows, slots, slot_ranks=(2, 1000))
    with pytest.raises(ValueError, match="slot_ranks: expected .*within 2\\^31 - 8 elements"):
        grouped_gemm_scatter(a, b, tiles, rows, rows, slots, slot_ranks=(8, 2**29))
    with pytest.raises(TypeError, match="row_slot: expected dtype int32, got int64"):
        grouped_gemm_scatter(a, b, tiles, rows, rows.long(), slots)
    with pytest.raises(ValueError, match="b2: only with k_split"):
        grouped_gemm_scatter(a, b, tiles, rows, rows, slots, b2=b)
    with pytest.raises(ValueError, match=r"b: expected shape \[2, 64, 128\], got \[2, 256, 128\]"):  # k_split, N-major: [E, K/2, N]
        grouped_gemm_scatter(a, b, tiles, rows, rows, slots, b2=b, b_major="n", k_split=True)
    with pytest.raises(ValueError, match="a: expected a CUDA tensor"):  # the checks pass; the launch checks refuse CPU data
        grouped_gemm_scatter(a, b, tiles, rows, rows, slots, slot_ranks=(2, 51200))


def test_fp8_gate_up_runs_in_turns_of_4_and_on_row_tile_pairs_only_with_row_tile_pairs():
    """fp8_block on Hopper: the plan's FP8 gate/up GEMM (with and without h) and its SwiGLU backward
    run two block sets in turns of 4 stages; the gate/up GEMM on one CTA a tile unless
    row_tile_pairs puts it (and no other kernel) on row-tile pairs (Plan.gate_up_pairs; the bf16
    GEMMs' ``pairs`` then stay off); never on pairs with bf16's gate_up_pairs or on SM100 (its
    fp8_block runs the MXFP8 kernels)."""
    from mok.plan import plan_for

    def gate_ups(plan):
        return [dict(v.config) for v in plan.variants() if v.config.get("operand") == "e4m3_block" and v.config.get("epilogue") in ("swiglu", "swiglu_save")]

    E, k = 8, 4
    plan = plan_for(MoKConfig(1024, 512, E, k, precision="fp8_block"), "sm_90a")
    assert sorted(c["epilogue"] for c in gate_ups(plan)) == ["swiglu", "swiglu_save"]
    assert all(c["deep_turn"] == 4 and c["block_buffers"] == 2 and c.get("cluster_m", 1) == 1 for c in gate_ups(plan))
    assert plan.gate_up_pairs == {} and not any(v.config.get("cluster_m") == 2 for v in plan.variants())
    swiglu_bwd = [dict(v.config) for v in plan.variants() if v.config.get("operand") == "e4m3_block" and v.config.get("epilogue") == "swiglu_bwd"]
    assert swiglu_bwd and all(c["deep_turn"] == 4 and c["block_buffers"] == 2 for c in swiglu_bwd)
    for options in (dict(), dict(ep_size=2)):
        pairs = plan_for(MoKConfig(1024, 512, E, k, precision="fp8_block", row_tile_pairs=True, **options), "sm_90a")
        clustered = [dict(v.config) for v in pairs.variants() if v.config.get("cluster_m") == 2]
        assert sorted(c["epilogue"] for c in clustered) == ["swiglu", "swiglu_save"]
        assert all(c["operand"] == "e4m3_block" and c["n"] == 512 and c["k"] == 1024 for c in clustered)
        assert pairs.gate_up_pairs == {"cluster_m": 2} and pairs.pairs == {}
    bf16 = plan_for(MoKConfig(1024, 512, E, k, row_tile_pairs=True), "sm_90a")
    sm100 = plan_for(MoKConfig(1024, 512, E, k, precision="fp8_block", fp8_scales="power_of_two", row_tile_pairs=True), "sm_100a")
    assert bf16.gate_up_pairs == {} and bf16.pairs == {"cluster_m": 2} and sm100.gate_up_pairs == {}


def test_grouped_gemm_cluster_m_is_checked_before_launch():
    """cluster_m: 1 or 2, and 2 only with bf16 or FP8 block-scaled operands in the persistent
    kernel (not MXFP8's; FP8 rows gathered first; the SwiGLU backward on FP8 only); a valid one
    goes on to the launch checks (which refuse CPU data)."""
    from mok import fp8_block as fp8
    from mok.ops import grouped_gemm, grouped_gemm_scatter, swiglu_backward_gemm

    a, b, tiles = torch.zeros(256, 128, dtype=torch.bfloat16), torch.zeros(2, 256, 128, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="cluster_m: expected 1 or 2, got 4"):
        grouped_gemm(a, b, tiles, cluster_m=4)
    with pytest.raises(ValueError, match="cluster_m=2: bf16 or FP8 block-scaled operands in the persistent kernel, got operand='bf16', "
                                         "persistent=False"):
        grouped_gemm(a, b, tiles, cluster_m=2, persistent=False)
    with pytest.raises(ValueError, match="got operand='e4m3', persistent=None"):
        mxfp8 = (torch.zeros(256, 128, dtype=torch.float8_e4m3fn), torch.zeros(2, 1, 512, dtype=torch.uint8))
        grouped_gemm(mxfp8, (torch.zeros(2, 256, 128, dtype=torch.float8_e4m3fn), torch.zeros(2, 2, 1, 512, dtype=torch.uint8)), tiles, cluster_m=2)
    with pytest.raises(ValueError, match="a: expected a CUDA tensor"):  # (FP8 block scales: on pairs too)
        grouped_gemm(fp8.quantize_rows(torch.randn(256, 128)), fp8.quantize_weights(torch.randn(2, 256, 128)), tiles, cluster_m=2)
    with pytest.raises(ValueError, match="rows gathered first .* not by the GEMM's producer"):  # (FP8: pairs on gathered rows)
        grouped_gemm(fp8.quantize_rows(torch.randn(256, 128)), fp8.quantize_weights(torch.randn(2, 256, 128)), tiles, cluster_m=2,
                     gather=torch.zeros(256, dtype=torch.int32))
    h = torch.zeros(256, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cluster_m: 1, or 2 with FP8 block-scaled operands .*, got 2 with bf16 operands"):
        swiglu_backward_gemm(a, torch.zeros(2, 128, 128, dtype=torch.bfloat16), tiles, h, cluster_m=2)
    with pytest.raises(ValueError, match="a: expected a CUDA tensor"):  # (FP8: on pairs too)
        swiglu_backward_gemm(fp8.quantize_rows(torch.randn(256, 128)), fp8.quantize_weights(torch.randn(2, 128, 128)), tiles, h, cluster_m=2)
    rows = torch.zeros(256, dtype=torch.int32)
    with pytest.raises(ValueError, match="cluster_m: expected 1 or 2, got 0"):
        grouped_gemm_scatter(a, b, tiles, rows, rows, torch.zeros(50, 4, 256, dtype=torch.bfloat16), cluster_m=0)
    with pytest.raises(ValueError, match="a: expected a CUDA tensor"):
        grouped_gemm(a, b, tiles, cluster_m=2)


def test_main_grads_are_checked_before_anything_runs():
    from mok.validation import check_main_grads

    weights = (torch.zeros(4, 8, 16), torch.zeros(4, 8, 16), torch.zeros(4, 16, 8))
    good = tuple(torch.zeros(w.shape) for w in weights)
    check_main_grads(None, weights, None)
    check_main_grads(good, weights, None)
    with pytest.raises(ValueError, match="main_grads: expected 3 fp32 buffers, got 2"):
        check_main_grads(good[:2], weights, None)
    with pytest.raises(TypeError, match=r"main_grads \(d_w_up\): expected dtype"):
        check_main_grads((good[0], good[1].bfloat16(), good[2]), weights, None)
    with pytest.raises(ValueError, match=r"main_grads \(d_w_down\): expected shape"):
        check_main_grads((good[0], good[1], torch.zeros(4, 8, 16)), weights, None)
    square = [torch.zeros(4, 16, 16) for _ in range(3)]  # (H == I: gate, up and down of one shape)
    with pytest.raises(ValueError, match=r"main_grads \(d_w_gate, d_w_down\): expected separate buffers, got two that overlap"):
        check_main_grads((square[0], square[1], square[0]), square, None)
    base = torch.zeros(4 * 16 * 16 + 1)
    with pytest.raises(ValueError, match=r"main_grads \(d_w_up\): expected a 16-byte aligned start"):
        check_main_grads((square[0], base[1:].view(4, 16, 16), square[2]), square, None)
    check_main_grads(None, weights, None, weight_grads=False)  # (frozen experts, no buffers: fine)
    with pytest.raises(ValueError, match=r"main_grads: given with weight_grads=False \(nothing would be added into them\)"):
        check_main_grads(good, weights, None, weight_grads=False)


def test_raise_grid_timeouts_reports_the_barriers_timeout_count():
    from mok.ops import raise_grid_timeouts

    raise_grid_timeouts(torch.tensor([0, 7, 0, 0], dtype=torch.int32))  # none counted: no error
    with pytest.raises(RuntimeError, match="3 grid-barrier timeouts"):
        raise_grid_timeouts(torch.tensor([0, 7, 3, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"grid_sync: expected shape \[4\]"):
        raise_grid_timeouts(torch.zeros(3, dtype=torch.int32))


def test_swiglu_backward_gemm_refuses_pingpong_where_it_has_no_kernel():
    """Ping-pong is the persistent kernel's."""
    from mok import ops

    rows, hidden, inter, experts = 256, 128, 128, 2
    dout = torch.zeros(rows, hidden, dtype=torch.bfloat16)
    w_down = torch.zeros(experts, hidden, inter, dtype=torch.bfloat16)
    tiles = torch.tensor([0, 1], dtype=torch.int32)
    h = torch.zeros(rows, 2 * inter, dtype=torch.bfloat16)
    routing = dict(row_token=torch.zeros(rows, dtype=torch.int32), row_slot=torch.zeros(rows, dtype=torch.int32), topk_w=torch.ones(rows, 1))
    with pytest.raises(ValueError, match=r"^pingpong: only with persistent=True$"):
        ops.swiglu_backward_gemm(dout, w_down, tiles, h, **routing, persistent=False, pingpong=True)
    with pytest.raises(ValueError, match="expected a CUDA tensor"):  # the defaults pass the checks; the launch checks refuse CPU data
        ops.swiglu_backward_gemm(dout, w_down, tiles, h, **routing)


def test_weight_grad_rejects_a_bad_tile_before_launch():
    """The weight-gradient op takes 128- or 256-column tiles (ping-pong: 128, persistent; on
    Hopper N need not be a multiple of the tile), M and N multiples of 8, and says so otherwise."""
    from mok import ops

    a, b = torch.zeros(256, 256, dtype=torch.bfloat16), torch.zeros(256, 384, dtype=torch.bfloat16)
    offsets = torch.tensor([0, 128, 256], dtype=torch.int32)
    with pytest.raises(ValueError, match="tile_n: expected 128 or 256, got 64"):
        ops.weight_grad(a, b, offsets, tile_n=64)
    with pytest.raises(ValueError, match=r"\(R, M, N\): expected M, N multiples of 8, got \(256, 256, 380\)"):
        ops.weight_grad(a, torch.zeros(256, 380, dtype=torch.bfloat16), offsets)
    with pytest.raises(ValueError, match="a: expected a CUDA tensor"):  # a partial column tile passes the checks
        ops.weight_grad(a, b, offsets, tile_n=256)
    with pytest.raises(ValueError, match="pingpong: only with persistent=True and tile_n=128"):
        ops.weight_grad(a, b, offsets, pingpong=True, persistent=False)
    with pytest.raises(ValueError, match="a: expected a CUDA tensor"):  # the checks pass; the launch checks refuse CPU data
        ops.weight_grad(a, b, offsets, tile_n=128, pingpong=True)
    with pytest.raises(ValueError, match="counts: expected shape"):  # one count per expert
        ops.weight_grad(a, b, offsets, counts=torch.tensor([128, 128, 0], dtype=torch.int32))
    with pytest.raises(TypeError, match="counts: expected dtype"):
        ops.weight_grad(a, b, offsets, counts=torch.tensor([128, 128]))


def test_backward_checks_the_saved_forward_against_its_inputs_before_launch():
    """The backward reads the saved schedule and h with the kernels: one of another batch, other
    tiles or another width is refused by name before anything launches."""
    from mok.pipeline import ForwardResult
    from mok.schedule import build_schedule

    from helpers import moe_backward

    T, H, I, E, k = 50, 128, 128, 4, 2
    bf16 = dict(dtype=torch.bfloat16)
    x, dout = torch.randn(T, H).to(**bf16), torch.randn(T, H).to(**bf16)
    wg, wu, wd = torch.randn(E, I, H).to(**bf16), torch.randn(E, I, H).to(**bf16), torch.randn(E, H, I).to(**bf16)
    idx, w = torch.randint(0, E, (T, k), dtype=torch.int32), torch.rand(T, k)
    mine = build_schedule(idx, E, block_m=128)
    h = torch.randn(mine.capacity, 2 * I).to(**bf16)
    other_batch = build_schedule(torch.randint(0, E, (4 * T, k), dtype=torch.int32), E, block_m=128)
    with pytest.raises(ValueError, match=r"saved.schedule: expected one for 50 tokens x top-2, got slot_row of shape \[200, 2\]"):
        moe_backward(dout, x, idx, w, wg, wu, wd, None, ForwardResult(None, other_batch, torch.randn(other_batch.capacity, 2 * I).to(**bf16)))
    with pytest.raises(ValueError, match=r"saved.schedule: expected 128-row tiles \(block_m=128\), got block_m=64"):
        moe_backward(dout, x, idx, w, wg, wu, wd, None, ForwardResult(None, build_schedule(idx, E, block_m=64), h))
    with pytest.raises(ValueError, match=r"saved.schedule: expected one over 4 experts, got expert_counts of shape \[8\]"):
        moe_backward(dout, x, idx, w, wg, wu, wd, None, ForwardResult(None, build_schedule(idx, 8, block_m=128), h))
    with pytest.raises(ValueError, match=rf"saved.h: expected shape \[{mine.capacity}, 256\], got \[{mine.capacity}, 128\]"):
        moe_backward(dout, x, idx, w, wg, wu, wd, None, ForwardResult(None, mine, h[:, :I].contiguous()))
    # (the widths are the configuration's, refused by it before the tensors are looked at)
    widths = r"intermediate: expected a multiple of 8 \(16-byte bf16 vectors\), got 60"
    with pytest.raises(ValueError, match=widths):
        moe_backward(dout, x, idx, w, wg[:, :60].contiguous(), wu[:, :60].contiguous(), wd[..., :60].contiguous(), None,
                     ForwardResult(None, mine, h[:, :120].contiguous()), one_launch=True)
    with pytest.raises(ValueError, match="x: expected a CUDA tensor"):  # the checks pass; then the device check refuses CPU data
        moe_backward(dout, x, idx, w, wg, wu, wd, None, ForwardResult(None, mine, h))


def test_ops_refuse_a_one_launch_forward_without_weights():
    """The one-launch forward always combines, so it needs topk_w; the router gradient's partial
    sums must be on the GPU."""
    from mok.ops import router_grad, scheduled_expert_mlp
    from mok.schedule import build_schedule

    T, H, I, E, k = 64, 256, 128, 4, 2
    bf16 = dict(dtype=torch.bfloat16)
    x, wg, wu, wd = torch.zeros(T, H, **bf16), torch.zeros(E, I, H, **bf16), torch.zeros(E, I, H, **bf16), torch.zeros(E, H, I, **bf16)
    idx = torch.randint(0, E, (T, k), dtype=torch.int32)
    with pytest.raises(TypeError, match="topk_w: expected a torch.Tensor, got NoneType"):
        scheduled_expert_mlp(x, idx, None, wg, wu, wd)
    with pytest.raises(ValueError, match="partial: expected a CUDA tensor, got one on cpu"):
        router_grad(torch.zeros(384, 2), build_schedule(idx, E, block_m=128).slot_row)


def test_forward_takes_cpu_tensors_through_its_checks_then_refuses_them():
    """The forward (multi-launch and one-launch) checks the call, then refuses CPU data (the device
    check) before any launch."""
    from helpers import moe_forward

    T, H, I, E, k = 8, 256, 128, 4, 2
    x, wg, wu, wd = (torch.randn(*s).bfloat16() for s in ((T, H), (E, I, H), (E, I, H), (E, H, I)))
    idx, w = torch.randint(0, E, (T, k), dtype=torch.int32), torch.rand(T, k)
    for form in ({}, {"one_launch": True}):  # accepted; then the device check
        with pytest.raises(ValueError, match="x: expected a CUDA tensor"):
            moe_forward(x, idx, w, wg, wu, wd, **form)


def test_precompile_options_set_the_configs_flags():
    import argparse

    from mok.cli import _add_shape_options, _config_from

    parser = argparse.ArgumentParser()
    _add_shape_options(parser)
    config = _config_from(parser.parse_args(["--hidden", "512", "--fuse-wgrad-accumulation"]))
    assert config.fuse_wgrad_accumulation and not config.one_launch and config.hidden == 512
    assert not _config_from(parser.parse_args([])).fuse_wgrad_accumulation
    fp8 = _config_from(parser.parse_args(["--hidden", "512", "--precision", "fp8_block", "--wgrad-format", "fp8_block"]))
    assert fp8.wgrad_format == "fp8_block" and fp8.weight_grad_format == "fp8_block" and _config_from(parser.parse_args([])).wgrad_format is None


def test_zero_widths_and_schedules_of_partial_tiles_are_refused():
    """A width of 0 is no multiple of the 128-wide tile (the compiler would be the first to complain);
    a schedule whose capacity is not whole tiles would have the kernels read a tile_expert entry past
    its end."""
    import dataclasses

    from mok.plan import check_tiled_widths
    from mok.schedule import build_schedule, check_schedule

    with pytest.raises(ValueError, match=r"multiples of 128 \(the fused kernels' tile\), got hidden=0, intermediate=128"):
        check_tiled_widths("config", {"hidden": 0, "intermediate": 128})
    sched = build_schedule(torch.randint(0, 8, (40, 2), dtype=torch.int32), 8)
    check_schedule("s", sched, num_tokens=40, topk=2, num_experts=8, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="s: expected a capacity that is a multiple of block_m=128, got 1000 rows"):
        check_schedule("s", dataclasses.replace(sched, capacity=1000), num_tokens=40, topk=2, num_experts=8, device=torch.device("cpu"))


def test_an_expert_parallel_schedule_knows_its_world_size():
    from mok.schedule import build_schedule

    idx = torch.randint(0, 8, (40, 2), dtype=torch.int32)
    ep = build_schedule(idx, 8, world_size=2, rank=1)
    assert ep.world_size == 2 and build_schedule(idx, 8).world_size == 1


def test_public_submodules_are_reachable_after_import_mok():
    """``import mok`` then ``mok.ops``, ``mok.plan``, ``mok.pipeline``...: each loads on first use,
    in a fresh interpreter (nothing imported them before), and CuTe DSL is not loaded by it."""
    import subprocess
    import sys

    code = (
        "import sys, mok; names = ('ops', 'plan', 'pipeline', 'reference_backward', 'mxfp8', 'torch_ops', 'kernels', 'runtime', 'bench');"
        "mods = [getattr(mok, n) for n in names]; assert mok.ops.grouped_gemm and mok.plan.plan_for and mok.pipeline.forward;"
        "print('cutlass' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_expert_weights_may_be_the_halves_of_one_tensor_and_anything_else_is_named():
    """Per-expert weights: contiguous, or each expert's block contiguous with the experts further
    apart (the halves of one [E, 2I, H] tensor: their stride, read in place); a layout whose
    blocks are not contiguous is refused naming the strides, as are partner weights strided
    differently."""
    from mok.validation import expert_stride

    gate_up = torch.randn(4, 2 * 16, 24)
    gate, up = gate_up[:, :16], gate_up[:, 16:]
    assert expert_stride("w_gate", gate) == expert_stride("w_up", up, like=gate) == 2 * 16 * 24
    assert expert_stride("w", gate_up[:, :16].contiguous()) is None
    assert expert_stride("w", gate_up[:1, :16]) is None  # one expert: no stride to speak of
    with pytest.raises(ValueError, match=r"w_gate: expected each expert's \[16, 24\] block contiguous .* got strides \(384, 1, 16\)"):
        expert_stride("w_gate", torch.randn(4, 24, 16).transpose(1, 2))
    with pytest.raises(ValueError, match=r"w_up: expected the strides of its partner weights"):
        expert_stride("w_up", torch.randn(4, 16, 24), like=gate)
    odd = torch.randn(4 * (16 * 24 + 4))[: 4 * (16 * 24 + 4)].as_strided((4, 16, 24), (16 * 24 + 4, 24, 1))
    with pytest.raises(ValueError, match=r"the experts multiples of 8 elements \(16 bytes\) apart"):
        expert_stride("w", odd)


def test_concatenated_gate_up_layout_is_checked_and_precompiled():
    """gate_up_layout="concatenated": refused beside what has no joined gradient yet; the weights
    must be the two halves of one [E, 2I, H] tensor (checked before anything runs); the plan lists
    the kernels that read them in place (expert stride 2·I·H) and the one-tensor weight gradient."""
    from mok.pipeline.forward import check_inputs
    from mok.plan import plan_for

    with pytest.raises(ValueError, match=r"gate_up_layout: expected one of \('separate', 'concatenated', 'interleaved'\)"):
        MoKConfig(256, 128, 8, 2, gate_up_layout="fused")
    with pytest.raises(ValueError, match=r"gate_up_layout='concatenated': not with precision='mxfp8_emulated'"):
        MoKConfig(256, 128, 8, 2, gate_up_layout="concatenated", precision="mxfp8_emulated")
    config = MoKConfig(256, 128, 8, 2, gate_up_layout="concatenated")
    x, idx, w = torch.randn(5, 256).bfloat16(), torch.randint(0, 8, (5, 2), dtype=torch.int32), torch.rand(5, 2)
    gate_up, down = torch.randn(8, 256, 256).bfloat16(), torch.randn(8, 256, 128).bfloat16()
    assert check_inputs(config, None, x, idx, w, (gate_up[:, :128], gate_up[:, 128:], down), None)[:3] == (5, 256, 128)
    separate = (gate_up[:, :128].contiguous(), gate_up[:, 128:].contiguous(), down)
    with pytest.raises(ValueError, match=r"gate_up_layout='concatenated' expects the halves \[:, :128\] and \[:, 128:\] of one \[8, 256, 256\]"):
        check_inputs(config, None, x, idx, w, separate, None)
    with pytest.raises(ValueError, match=r"expects the halves"):  # swapped halves
        check_inputs(config, None, x, idx, w, (gate_up[:, 128:], gate_up[:, :128], down), None)
    stride = 2 * 128 * 256
    listed = {(v.name, tuple(sorted(v.config.items()))) for v in plan_for(config, "sm_90a").variants()}
    strided = [dict(c) for name, c in listed if name == "grouped_gemm" and dict(c).get("b_expert_stride") == stride]
    assert sorted((c["epilogue"], c["b_major"], c["k_split"]) for c in strided) == [
        ("plain", "n", True), ("swiglu", "k", False), ("swiglu_save", "k", False)
    ]
    joined = [dict(c) for name, c in listed
              if name == "weight_grad" and (dict(c)["m"], dict(c)["n"]) == (256, 256) and not dict(c).get("split_out")]  # M = 2I, N = H
    assert len(joined) == 1 and joined[0]["out_dtype"] == "bf16"
    packed = {(v.name, tuple(sorted(v.config.items()))) for v in plan_for(MoKConfig(256, 128, 8, 2), "sm_90a").variants()}
    assert packed < listed and not any("b_expert_stride" in dict(c) for _, c in packed)


def test_interleaved_gate_up_layout_is_checked_and_precompiled():
    """gate_up_layout="interleaved" (gpt-oss's gate and up alternating row by row, stored for MoK):
    refused beside what has no joined gradient; the weights must be the even and odd rows of one
    [E, 2I, H] tensor; the plan lists the GEMMs that read them in place (expert stride 2·I·H, row
    stride 2·H; with one_launch its kernels, with the biases too) and the weight gradient that
    writes dW_gate and dW_up into the even and odd rows of one tensor."""
    from mok.pipeline.forward import check_inputs
    from mok.plan import plan_for

    one = plan_for(MoKConfig(256, 128, 8, 2, gate_up_layout="interleaved", one_launch=True, expert_bias=True), "sm_90a").variants()
    in_place = [v.config for v in one if v.name == "expert_mlp" and v.config.get("gate_up_row_stride") == 2 * 256]
    assert sorted(c["save_h"] for c in in_place) == [False, True] and all(c["gate_up_stride"] == 2 * 128 * 256 and c["bias"] for c in in_place)
    with pytest.raises(ValueError, match=r"gate_up_layout='interleaved': not with fuse_wgrad_accumulation"):
        MoKConfig(256, 128, 8, 2, gate_up_layout="interleaved", fuse_wgrad_accumulation=True)
    config = MoKConfig(256, 128, 8, 2, gate_up_layout="interleaved")
    x, idx, w = torch.randn(5, 256).bfloat16(), torch.randint(0, 8, (5, 2), dtype=torch.int32), torch.rand(5, 2)
    gate_up, down = torch.randn(8, 256, 256).bfloat16(), torch.randn(8, 256, 128).bfloat16()
    assert check_inputs(config, None, x, idx, w, (gate_up[:, 0::2], gate_up[:, 1::2], down), None)[:3] == (5, 256, 128)
    for wrong in ((gate_up[:, :128], gate_up[:, 128:], down), (gate_up[:, 1::2], gate_up[:, 0::2], down)):  # halves; swapped rows
        with pytest.raises(ValueError, match=r"gate_up_layout='interleaved' expects the even and odd rows \[:, 0::2\] and \[:, 1::2\]"):
            check_inputs(config, None, x, idx, w, wrong, None)
    listed = {(v.name, tuple(sorted(v.config.items()))) for v in plan_for(config, "sm_90a").variants()}
    strided = [dict(c) for name, c in listed if name == "grouped_gemm" and dict(c).get("b_row_stride") == 2 * 256]
    assert sorted((c["epilogue"], c["b_major"], c["k_split"], c["b_expert_stride"]) for c in strided) == [
        ("plain", "n", True, 2 * 128 * 256), ("swiglu", "k", False, 2 * 128 * 256), ("swiglu_save", "k", False, 2 * 128 * 256)
    ]
    joined = [dict(c) for name, c in listed if name == "weight_grad" and dict(c).get("interleaved_out")]
    assert len(joined) == 1 and (joined[0]["m"], joined[0]["n"], joined[0]["split_out"]) == (256, 256, True)


def test_weight_strides_read_rows_in_place_and_refuse_what_tma_cannot():
    """Per-expert weights [E, N, K] the GEMMs read in place: packed, the halves of one [E, 2N, K]
    tensor (an expert stride), its even and odd rows (and a row stride); refused: rows not
    contiguous, rows or experts not 16 bytes apart, partner weights strided otherwise."""
    from mok.validation import weight_strides

    w = torch.randn(3, 8, 24)
    assert weight_strides("w", w) == (None, None)
    assert weight_strides("w", w[:, :4]) == (8 * 24, None)
    assert weight_strides("w", w[:, 0::2]) == weight_strides("w", w[:, 1::2], like=w[:, 0::2]) == (8 * 24, 2 * 24)
    assert weight_strides("w", w[:1, 0::2]) == (4 * 2 * 24, 2 * 24)  # (one expert: its rows' extent)
    for bad in (w.transpose(1, 2), torch.randn(3, 8, 28)[..., :24], w[:, 0::3]):  # columns strided; rows 28 apart; an expert's
        # rows reaching into the next's
        with pytest.raises(ValueError, match="expected each row contiguous, the rows and the experts multiples of 8 elements"):
            weight_strides("w", bad)
    with pytest.raises(ValueError, match=r"expected the strides of its partner weights"):
        weight_strides("w2", w[:, :4], like=w[:, 0::2])
