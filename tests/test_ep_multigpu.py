"""Expert parallelism across two GPUs through the symmetric VMM workspace (NVLink).

Written for nvidia-h200-x2; not yet run there (that machine was not lent in the session
that wrote it, 2026-12-01): see the closing note of that session.
"""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

COUNTS = (300, 517)  # tokens per rank, uneven on purpose
H, I, E, K = 512, 256, 8, 4


def _worker(rank, init_file, out_dir, skip_rank):
    from helpers import gpu_layer
    from mok.ep import EPLayout, EPWorkspace, ep_moe_forward
    from mok.fused_forward import moe_forward
    from mok.runtime.workspace import SymmetricWorkspace

    torch.cuda.set_device(rank)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    result = {}
    try:
        x, idx, w, experts, shared = gpu_layer(sum(COUNTS), H, I, E, K, 256, seed=31)  # every rank: the global batch
        want = moe_forward(x, idx, w, *experts, shared).out
        lo = sum(COUNTS[:rank])
        mine = slice(lo, lo + COUNTS[rank])
        e_local = E // 2
        local = [t[rank * e_local:(rank + 1) * e_local].contiguous() for t in experts]
        layout = EPLayout(world=2, max_tokens=max(COUNTS), hidden=H, topk=K)
        with SymmetricWorkspace(layout.stride, spec={"ep": repr(layout)}) as sym:
            ws = EPWorkspace.from_symmetric(sym, layout)
            args = (x[mine].contiguous(), idx[mine].contiguous(), w[mine].contiguous(), *local, shared)
            if skip_rank is None:
                outs = [ep_moe_forward(ws, *args, timeout_s=60.0) for _ in range(3)]
                torch.cuda.synchronize()
                ws.check()
                result["bitwise"] = all(torch.equal(o, want[mine]) for o in outs)
            elif rank != skip_rank:
                ep_moe_forward(ws, *args, timeout_s=0.5)
                torch.cuda.synchronize()
                try:
                    ws.check()
                    result["error"] = "no error"
                except RuntimeError as err:
                    result["error"] = str(err)
            dist.barrier()
        torch.save(result, f"{out_dir}/{rank}.pt")
    finally:
        dist.destroy_process_group()


def _spawn(tmp_path, skip_rank=None):
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path), skip_rank), nprocs=2)
    return [torch.load(tmp_path / f"{r}.pt") for r in range(2)]


def test_ep2_over_nvlink_equals_single_gpu_forward_bitwise(tmp_path):
    assert all(r["bitwise"] for r in _spawn(tmp_path))


def test_rank_that_skips_the_call_makes_the_peer_raise(tmp_path):
    results = _spawn(tmp_path, skip_rank=1)
    assert "rank 0 timed out in phase publish" in results[0]["error"] and "waiting for rank 1" in results[0]["error"]
