"""The expert-parallel workspace layout and its error record, on the CPU."""

import pytest
import torch

import mok
from mok.kernels.common.flag_layout import PHASE_DONE, error_slot, flag_words, grid_sync_slot, tokens_slot
from mok.kernels.constants import GRID_SYNC_WORDS
from mok.pipeline.workspace import ALIGN, EPLayout, EPWorkspace
from mok.schedule import worst_case_capacity

from helpers import ep_moe_forward, ep_moe_forward_saved, random_layer


def test_layout_regions_are_aligned_and_disjoint():
    layout = EPLayout(world=8, max_tokens=4096, hidden=7168, topk=8)
    spans = sorted((off, off + n * dt.itemsize) for off, n, dt in layout.regions.values())
    assert all(off % ALIGN == 0 for off, _ in spans)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    assert layout.stride >= spans[-1][1] and layout.stride % ALIGN == 0
    for world in (1, 2, 8, 32):  # the error record, the token count, the grid-barrier words: in order, inside the flags
        assert error_slot(world) + 4 == tokens_slot(world) < grid_sync_slot(world) <= flag_words(world) - GRID_SYNC_WORDS


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
    ranks[0].region("flags")[grid_sync_slot(3) + 2] = 3  # the one-launch forward's grid barrier counted 3 timeouts
    with pytest.raises(RuntimeError, match=r"a wait of rank 0's kernels on their own work timed out 3 time\(s\): a one-launch"):
        ranks[0].check()


def test_ranks_emulated_on_one_device_know_they_share_it():
    """local_group's W ranks share one buffer and one GPU: each one-launch forward then takes 1/W of the SMs."""
    layout = EPLayout(world=3, max_tokens=4, hidden=16, topk=2)
    assert [ws.ranks_on_device for ws in EPWorkspace.local_group(layout, device="cpu")] == [3, 3, 3]
    assert EPWorkspace(torch.zeros(3 * layout.stride, dtype=torch.uint8), layout, 1).ranks_on_device == 1


def test_bad_workspace_and_inputs_raise_before_any_launch():
    layout = EPLayout(world=2, max_tokens=8, hidden=16, topk=2)
    with pytest.raises(ValueError, match="buffer: expected"):
        EPWorkspace(torch.zeros(10, dtype=torch.uint8), layout, 0)
    with pytest.raises(ValueError, match=r"rank: expected 0\.\.1, got 2"):
        EPWorkspace(torch.zeros(2 * layout.stride, dtype=torch.uint8), layout, 2)
    with pytest.raises(ValueError, match=r"buffer: expected a contiguous 1-D uint8 tensor .* got shape \[2, "):
        EPWorkspace(torch.zeros(2, layout.stride, dtype=torch.uint8), layout, 0)
    ws = EPWorkspace(torch.zeros(2 * layout.stride, dtype=torch.uint8), layout, 0)
    x, idx, w, experts, _ = random_layer(9, 16, 8, 2, 2, seed=1, dtype=torch.bfloat16)
    config = mok.MoKConfig(hidden=16, intermediate=8, num_experts=4, topk=2, ep_size=2)  # (the checks come before the plan's widths)
    with pytest.raises(ValueError, match=r"x: expected at most the workspace's max_tokens=8 tokens, got 9"):
        mok.forward(config, ws, x, idx, w, *experts)
    wide = torch.zeros(8, 4, dtype=torch.int32)  # ids are published from their first element: a strided view is copied first
    with pytest.raises(ValueError, match="x: expected a CUDA tensor"):  # (accepted; then the device check)
        mok.forward(config, ws, x[:8], wide[:, :2], w[:8], *experts)


def test_capacity_rows_scale_an_even_routing_and_never_exceed_the_worst_case():
    from mok.pipeline.workspace import capacity_rows
    from mok.schedule import worst_case_capacity

    layout = EPLayout(world=8, max_tokens=4096, hidden=7168, topk=8)
    assert capacity_rows(layout, 32, None) is None
    assert capacity_rows(layout, 32, 1.0) == -(-(4096 * 8 + 32 * 127) // 128) * 128
    assert capacity_rows(layout, 32, 1.25) == -(-(5 * 4096 * 8 // 4 + 32 * 127) // 128) * 128
    assert capacity_rows(layout, 32, 100.0) == worst_case_capacity(8 * 4096, 8, 32, 128)
    for bad in (0, -1.0, True, "2", float("inf"), float("nan")):
        with pytest.raises(ValueError, match="capacity_factor: expected a positive finite number"):
            capacity_rows(layout, 32, bad)


def test_capacity_overflow_record_raises_on_check_and_on_the_next_call():
    layout = EPLayout(world=2, max_tokens=8, hidden=16, topk=2)
    with pytest.raises(ValueError, match="capacity: expected a positive multiple of 128"):
        EPWorkspace(torch.zeros(2 * layout.stride, dtype=torch.uint8), layout, 0, capacity=100)
    ws = EPWorkspace(torch.zeros(2 * layout.stride, dtype=torch.uint8), layout, 1, capacity=128)
    assert ws.expert_rows(4) == 128  # the bound; without one, the worst case of every rank's tokens
    assert EPWorkspace(ws.buffer, layout, 1).expert_rows(4) == worst_case_capacity(2 * 8, 2, 4, 128)
    ws.raise_pending()  # a clean record
    flags = ws.region("flags")
    flags[error_slot(2):error_slot(2) + 4] = torch.tensor([2, 0, 300, 128], dtype=torch.int32)
    message = r"experts of rank 0 were routed 300 rows \(tile padding included\), capacity is 128"
    with pytest.raises(RuntimeError, match=message):
        ws.check()
    with pytest.raises(RuntimeError, match=message):
        ws.raise_pending()


def test_layer_refuses_a_bad_capacity_factor():
    from mok import MoELayer

    with pytest.raises(ValueError, match=r"capacity_factor: expected a positive finite number \(or None: no bound\), got 0"):
        MoELayer(16, 8, 4, 2, capacity_factor=0)


def test_ep_custom_ops_output_shapes_follow_the_layout_not_the_routing():
    """mok::moe_forward / moe_backward with an expert-parallel workspace under fake tensors (what
    torch.compile traces): the saved tensors take the workspace's worst case, or its capacity bound."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import mok.layer  # noqa: F401  (registers the ops)
    from mok.pipeline.workspace import workspace_by_handle
    from mok.schedule import worst_case_capacity
    from mok.torch_ops import config_text

    layout = EPLayout(world=2, max_tokens=40, hidden=64, topk=2)
    config = config_text(mok.MoKConfig(hidden=64, intermediate=32, num_experts=6, topk=2, shared_intermediate=16, ep_size=2))
    for capacity in (None, 256):
        ws = EPWorkspace(torch.zeros(2 * layout.stride, dtype=torch.uint8), layout, 1, capacity=capacity)
        rows = capacity or worst_case_capacity(80, 2, 3, 128)
        with FakeTensorMode():
            bf16 = dict(dtype=torch.bfloat16, device="meta")
            x, idx, w = torch.empty(30, 64, **bf16), torch.empty(30, 2, dtype=torch.int32, device="meta"), torch.empty(30, 2, device="meta")
            experts = (torch.empty(3, 32, 64, **bf16), torch.empty(3, 32, 64, **bf16), torch.empty(3, 64, 32, **bf16))
            shared = (torch.empty(16, 64, **bf16), torch.empty(16, 64, **bf16), torch.empty(64, 16, **bf16))
            outs = torch.ops.mok.moe_forward(x, idx, w, *experts, *shared, config, ws.handle, True, False, 5.0)
            grads = torch.ops.mok.moe_backward(x, x, idx, w, *experts, *shared, list(outs[1:]), config, ws.handle, 5.0, [])
            mains = [torch.empty(t.shape, device="meta") for t in (*experts, *shared)]
            added = torch.ops.mok.moe_backward(x, x, idx, w, *experts, *shared, list(outs[1:]), config, ws.handle, 5.0, mains)
        assert [tuple(o.shape) for o in outs] == [  # out, h, shared_h, x_rows, routing, then the schedule's tensors
            (30, 64), (rows, 64), (30, 32), (rows, 64), (80, 2), (3,), (4,), (rows,), (rows,), (80, 2), (rows // 128,), (),
        ]
        assert [tuple(g.shape) for g in grads] == [(30, 64), (30, 2), (3, 32, 64), (3, 32, 64), (3, 64, 32), (16, 64), (16, 64), (64, 16)] + [(0,)] * 3
        assert [tuple(g.shape) for g in added] == [(30, 64), (30, 2)] + [(0,)] * 9  # (into main_grads: nothing returned)
    with pytest.raises(ValueError, match="no live MoK expert-parallel workspace has handle -1"):
        workspace_by_handle(-1)


def test_layer_refuses_a_bad_timeout():
    from mok import MoELayer

    with pytest.raises(ValueError, match=r"timeout_s: expected a positive number of seconds up to 1e\+09, got -1"):
        MoELayer(16, 8, 4, 2, timeout_s=-1)
    for bad in (float("inf"), float("nan"), 1e10):  # the kernels take the bound in int64 nanoseconds
        with pytest.raises(ValueError, match=r"timeout_s: expected a positive number of seconds up to 1e\+09"):
            MoELayer(16, 8, 4, 2, timeout_s=bad)


def test_mxfp8_dispatch_is_refused_where_it_cannot_run_before_launching():
    """dispatch_format: "bf16" or "mxfp8"; MXFP8 only with H a multiple of 16 (16-byte E4M3 rows)."""
    layout = EPLayout(world=2, max_tokens=8, hidden=24, topk=2)
    x, idx, w, experts, _ = random_layer(8, 24, 8, 4, 2, seed=3, dtype=torch.bfloat16)
    local = [e[:2].contiguous() for e in experts]
    ws = EPWorkspace(torch.zeros(2 * layout.stride, dtype=torch.uint8), layout, 0)
    with pytest.raises(ValueError, match=r"dispatch_format: expected one of \('bf16', 'mxfp8', 'fp8_block'\), got 'fp8'"):
        ep_moe_forward(ws, x, idx.int(), w, *local, dispatch_format="fp8")
    for mode in ({}, {"one_launch": True}):
        with pytest.raises(ValueError, match=r"dispatch_format='mxfp8': expected hidden a multiple of 16 \(16-byte E4M3 rows\), got 24"):
            ep_moe_forward(ws, x, idx.int(), w, *local, dispatch_format="mxfp8", **mode)


def test_ep_inputs_the_kernels_could_not_take_are_refused_before_any_launch():
    """At EP > 1: an expert id out of range (it would reach no rank) with check_routing, rows the
    publish kernel cannot copy with 16-byte vectors, a workspace whose memory was closed, widths
    the kernels do not tile."""
    from types import SimpleNamespace

    config = mok.MoKConfig(hidden=128, intermediate=128, num_experts=4, topk=2, ep_size=2)
    layout = EPLayout(world=2, max_tokens=8, hidden=128, topk=2)
    ws = EPWorkspace(torch.zeros(2 * layout.stride, dtype=torch.uint8), layout, 0)
    x, idx, w, experts, _ = random_layer(8, 128, 128, 4, 2, seed=5, dtype=torch.bfloat16)
    local = [e[:2].contiguous() for e in experts]
    bad = idx.int().clone()
    bad[3, 1] = 4  # one past the last of the 4 experts (2 per rank)
    with pytest.raises(ValueError, match=r"topk_idx: expected every entry in \[0, 4\), got 4"):
        mok.forward(config, ws, x, bad, w, *local)
    with pytest.raises(Exception) as info:  # int64 ids pass the checks (cast for the kernels): on a CPU it fails at the kernels
        mok.forward(config, ws, x, idx.long(), w, *local)
    assert "topk_idx" not in str(info.value), info.value
    shifted = torch.zeros(x.numel() + 1, dtype=torch.bfloat16)[1:].view(8, 128)  # contiguous, 2 bytes off alignment
    with pytest.raises(ValueError, match="x: expected a 16-byte aligned data pointer"):
        ep_moe_forward_saved(ws, shifted, idx.int(), w, *local)
    ws.owner = SimpleNamespace(closed=True)
    with pytest.raises(RuntimeError, match=r"workspace: its symmetric memory was closed"):
        ep_moe_forward_saved(ws, x, idx.int(), w, *local)
    ws.owner = None
    narrow = EPLayout(world=2, max_tokens=8, hidden=64, topk=2)
    ws = EPWorkspace(torch.zeros(2 * narrow.stride, dtype=torch.uint8), narrow, 0)
    x, idx, w, experts, _ = random_layer(8, 64, 124, 4, 2, seed=6, dtype=torch.bfloat16)
    widths = r"intermediate: expected a multiple of 8 \(16-byte bf16 vectors\), got 124"
    with pytest.raises(ValueError, match=widths):  # (the widths are the configuration's: it refuses them)
        ep_moe_forward_saved(ws, x, idx.int(), w, *(e[:2].contiguous() for e in experts), one_launch=True)
