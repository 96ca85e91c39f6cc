"""Compile-only checks of every kernel variant for sm_90a and sm_100a: the PTX uses the intended instructions."""

import re

import pytest

from mok.config import DEFAULT_CONFIG, MoKConfig
from mok.kernels import combine_variant, compiled_ptx, grouped_gemm_variant, schedule_variant, variants_for


def count(pattern, text):
    return len(re.findall(pattern, text))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a", "sm_103a"])
@pytest.mark.parametrize("gathered", [False, True])
@pytest.mark.parametrize("hidden,topk,has_shared", [(7168, 8, True), (7168, 8, False), (2048, 1, True), (200, 6, False)])
def test_combine_ptx(arch, hidden, topk, has_shared, gathered):
    ptx = compiled_ptx(combine_variant(hidden, topk, has_shared, gathered), arch)
    assert f".target {arch}" in ptx
    per_thread = 8  # bf16 columns per thread
    # one 16-byte load per slot (+ the shared row), one 16-byte store, nothing narrower
    assert count(r"ld\.global\.v4\.b32", ptx) == topk + has_shared
    assert count(r"st\.global\.v4\.b32", ptx) == 1
    assert count(r"st\.global\.(?!v4)", ptx) == 0
    # the fixed order: one single-rounding fma per slot and column, nothing else on the values
    assert count(r"\bfma\.rn\.f32\b", ptx) == per_thread * topk
    assert count(r"\b(add|mul)\.(rn\.)?f32(x2)?\b", ptx) == 0
    assert count(r"\.local", ptx) == 0  # no spills to local memory


def test_every_variant_of_the_default_config_compiles_for_both_archs():
    configs = [DEFAULT_CONFIG, MoKConfig(hidden=2048, intermediate=768, num_experts=64, topk=8, shared_intermediate=1024)]
    for config in configs:
        for arch in ("sm_90a", "sm_100a"):
            for variant in variants_for(config, arch):
                assert f".target {arch}" in compiled_ptx(variant, arch)


@pytest.mark.parametrize("n,k,swiglu", [(2048, 7168, True), (7168, 2048, False), (768, 2048, True)])
def test_grouped_gemm_ptx_uses_wgmma_and_tma(n, k, swiglu):
    variant = grouped_gemm_variant(n, k, swiglu)
    ptx = compiled_ptx(variant, "sm_90a")
    tile_n = variant.config["tile_n"]
    assert ".target sm_90a" in ptx
    k_blocks = 4  # 64-deep shared-memory stage / 16-deep bf16 WGMMA
    assert count(rf"wgmma\.mma_async\.sync\.aligned\.m64n{tile_n}k16\.f32\.bf16\.bf16", ptx) == k_blocks * (2 if swiglu else 1)
    assert count(r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global", ptx) == 2 * (3 if swiglu else 2)  # fill + steady state
    assert count(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta", ptx) >= 1  # TMA store epilogue
    assert count(r"\bmma\.sync", ptx) == 0 and count(r"\.local", ptx) == 0
    assert (count(r"ex2\.approx", ptx) > 0) == swiglu


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_schedule_ptx_places_rows_without_atomics(arch):
    ptx = compiled_ptx(schedule_variant(256, 8, 128), arch)
    assert f".target {arch}" in ptx
    assert count(r"match\.any\.sync", ptx) == 1  # lanes of one expert find each other
    assert count(r"\batom\.|\bred\.", ptx) == 0  # placement decided by scans, not atomics
    assert count(r"\.local", ptx) == 0
