"""The expert-parallel workspace layout and its error record, on the CPU."""

import pytest
import torch

from mok.ep import ALIGN, EPLayout, EPWorkspace, ep_moe_forward
from mok.kernels.common.ep import PHASE_DONE, error_slot, flag_words, tokens_slot

from helpers import random_layer


def test_layout_regions_are_aligned_and_disjoint():
    layout = EPLayout(world=8, max_tokens=4096, hidden=7168, topk=8)
    spans = sorted((off, off + n * dt.itemsize) for off, n, dt in layout.regions.values())
    assert all(off % ALIGN == 0 for off, _ in spans)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    assert layout.stride >= spans[-1][1] and layout.stride % ALIGN == 0
    assert tokens_slot(8) < flag_words(8)


def test_workspace_regions_are_per_rank_views_and_the_error_record_raises():
    layout = EPLayout(world=3, max_tokens=10, hidden=16, topk=2)
    buffer = torch.zeros(3 * layout.stride, dtype=torch.uint8)
    ranks = [EPWorkspace(buffer, layout, r) for r in range(3)]
    ranks[2].region("idx").fill_(7)
    assert ranks[0].region("idx", 2).eq(7).all() and not ranks[0].region("idx", 1).any()
    assert ranks[1].region("x").numel() == 10 * 16 and ranks[1].stride_elems("slots") * 2 == layout.stride
    ranks[1].check()  # a clean record
    flags = ranks[1].region("flags")
    flags[error_slot(3):error_slot(3) + 4] = torch.tensor([1, PHASE_DONE, 2, 5], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"rank 1 timed out in phase combine .* waiting for rank 2 \(epoch 5\)"):
        ranks[1].check()


def test_bad_workspace_and_inputs_raise_before_any_launch():
    layout = EPLayout(world=2, max_tokens=8, hidden=16, topk=2)
    with pytest.raises(ValueError, match="buffer: expected"):
        EPWorkspace(torch.zeros(10, dtype=torch.uint8), layout, 0)
    with pytest.raises(ValueError, match=r"rank: expected 0\.\.1, got 2"):
        EPWorkspace(torch.zeros(2 * layout.stride, dtype=torch.uint8), layout, 2)
    ws = EPWorkspace(torch.zeros(2 * layout.stride, dtype=torch.uint8), layout, 0)
    x, idx, w, experts, _ = random_layer(9, 16, 8, 2, 2, seed=1, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"T <= 8 \(the workspace layout\), got H=16, k=2, T=9"):
        ep_moe_forward(ws, x, idx, w, *experts)
