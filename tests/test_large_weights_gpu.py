"""Per-expert weights of more elements than 32 bits index (a DeepSeek-V3-sized layer's 256 experts on
one GPU: 3.8e9 per weight): TMA reads and writes them by (column, k, expert) coordinates, so the
experts past element 2^31 must come out as right as the first ones."""

import pytest
import torch

from mok import ops

from helpers import poisoned, rel_err, worst_row_err

pytestmark = pytest.mark.gpu

E, I, H = 150, 2048, 7168  # 150 * 2048 * 7168 = 2.2e9 elements per weight tensor
LAST = E - 1  # its weights start past element 2^31 (149 * 2048 * 7168 = 2.19e9)


def test_experts_past_2_31_elements_are_multiplied_and_their_gradients_written():
    assert LAST * I * H > 2**31
    g = torch.Generator(device="cuda").manual_seed(41)
    T = 256
    experts = torch.tensor([0, 73, LAST], device="cuda", dtype=torch.int32)
    idx = torch.stack([experts[torch.arange(T, device="cuda") % 3], experts[(torch.arange(T, device="cuda") + 1) % 3]], 1)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    w_gate, w_up = (torch.randn(E, I, H, device="cuda", generator=g, dtype=torch.bfloat16) * H**-0.5 for _ in range(2))
    sched = ops.device_schedule(idx.contiguous(), E)
    rows = sched.row_token.shape[0]
    a = ops.grouped_gemm(x, w_gate, sched.tile_expert, b2=w_up, gather=sched.row_token, out=poisoned(rows, I))

    token = sched.row_token.long()
    used = token >= 0
    expert_of_row = torch.repeat_interleave(sched.tile_expert.long(), 128)[:rows]
    for e in experts.tolist():  # fp32 reference of each routed expert's rows
        mine = used & (expert_of_row == e)
        xs = x[token[mine]].float()
        want = torch.nn.functional.silu(xs @ w_gate[e].float().T) * (xs @ w_up[e].float().T)
        assert int(mine.sum()) > 0 and rel_err(a[mine], want) <= 1e-2 and worst_row_err(a[mine], want) <= 5e-2, e

    dW = ops.weight_grad(  # every expert's tile is written (zeros for the empty ones), the last past 2^31
        a, ops.gather_rows(x, sched.row_token), sched.expert_offsets, counts=sched.expert_counts, out=poisoned(E, I, H)
    )
    for e in experts.tolist():
        mine = used & (expert_of_row == e)
        want = a[mine].float().T @ x[token[mine]].float()
        assert rel_err(dW[e], want) <= 1e-2, e
    assert not dW[1].isnan().any() and not dW[1].any() and not dW[LAST - 1].any()  # empty experts: zeros, written
