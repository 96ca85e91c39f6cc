"""A persistent kernel's result does not depend on how many CTAs walk its tiles.

The layer's training step on 3 and 7 CTAs a persistent GEMM (grouped and weight-gradient GEMMs)
against one per SM, bit for bit: bf16; fp8_block with FP8 weight gradients (the gate/up GEMM's
activation out in FP8 over pairs of column tiles, the SwiGLU backward's h in shared memory, the
weight gradient's epilogue under the next tile); bf16 on row-tile pairs (clusters of two CTAs).
With so few CTAs each walks dozens of tiles, which most other tests' shapes (often one tile a
CTA) never make it do: what a kernel carries from tile to tile (barrier phases, pipeline states,
buffers reused, the walk itself) is exercised here.
"""

import pytest
import torch

from mok import pipeline
from mok.ops import gemm as gemm_ops
from mok.ops import weight_grads as weight_grad_ops

from helpers import gpu_layer, layer_plan

pytestmark = pytest.mark.gpu


def training_step(plan, inputs, dout, wgrad_format):
    """The step's output and every gradient tensor, in order."""
    x, idx, w, experts = inputs
    saved = pipeline.forward(plan, x, idx, w, experts, None, save=True)
    grads = pipeline.backward(plan, dout, x, idx, w, experts, None, saved, wgrad_format=wgrad_format)
    return [saved.out] + [g for g in grads if isinstance(g, torch.Tensor)]


@pytest.mark.parametrize("options", [{}, {"precision": "fp8_block", "wgrad_format": "fp8_block"}, {"row_tile_pairs": True}])
def test_layer_step_gives_the_same_bits_on_a_few_ctas(monkeypatch, options):
    options = dict(options)
    wgrad_format = options.pop("wgrad_format", None)
    T, H, I, E, k = 1024, 1024, 768, 8, 4
    x, idx, w, experts, _ = gpu_layer(T, H, I, E, k, seed=41)
    plan = layer_plan(x, idx, experts, **options)
    inputs = (x, idx, w, experts)
    dout = torch.randn(T, H, device="cuda", generator=torch.Generator(device="cuda").manual_seed(42)).bfloat16()
    want = training_step(plan, inputs, dout, wgrad_format)
    assert len(want) == 6 and not any(t.isnan().any() for t in want)
    for ctas in (3, 7):
        monkeypatch.setattr(gemm_ops, "sm_count", lambda device, ctas=ctas: ctas)
        monkeypatch.setattr(weight_grad_ops, "sm_count", lambda device, ctas=ctas: ctas)
        got = training_step(plan, inputs, dout, wgrad_format)
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), (ctas, i)
