"""Compile-only checks of every kernel variant for sm_90a and sm_100a: the PTX uses the intended instructions."""

import re

import pytest

from mok.config import DEFAULT_CONFIG, MoKConfig
from mok.kernels import combine_variant, compiled_ptx, variants_for


def count(pattern, text):
    return len(re.findall(pattern, text))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a", "sm_103a"])
@pytest.mark.parametrize("hidden,topk,has_shared", [(7168, 8, True), (7168, 8, False), (2048, 1, True), (200, 6, False)])
def test_combine_ptx(arch, hidden, topk, has_shared):
    ptx = compiled_ptx(combine_variant(hidden, topk, has_shared), arch)
    assert f".target {arch}" in ptx
    per_thread = 8  # bf16 columns per thread
    # one 16-byte load per slot (+ the shared row), one 16-byte store, nothing narrower
    assert count(r"ld\.global\.v4\.b32", ptx) == topk + has_shared
    assert count(r"st\.global\.v4\.b32", ptx) == 1
    assert count(r"st\.global\.(?!v4)", ptx) == 0
    # the fixed order: one single-rounding fma per slot and column after the first product
    assert count(r"\bfma\.rn\.f32\b", ptx) == per_thread * (topk - 1 + has_shared)
    assert count(r"\badd\.(rn\.)?f32", ptx) == 0
    assert count(r"\.local", ptx) == 0  # no spills to local memory


def test_every_variant_of_the_default_config_compiles_for_both_archs():
    configs = [DEFAULT_CONFIG, MoKConfig(hidden=2048, intermediate=768, num_experts=64, topk=8)]
    for config in configs:
        for variant in variants_for(config):
            for arch in ("sm_90a", "sm_100a"):
                assert f".target {arch}" in compiled_ptx(variant, arch)
