"""Symmetric workspace across two processes (on two GPUs, or sharing one): peer mappings carry
data both ways, SM loads read a peer's memory, teardown returns the memory."""

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.gpu

ROWS, WIDTH = 64, 1024  # bf16


def _worker(rank, init_file, out_dir, shared_gpu):
    import cutlass
    from cuda.bindings import driver
    from cutlass.cute.runtime import make_ptr

    from mok.kernels import get_kernel
    from mok.kernels.variants import gather_variant
    from mok.runtime.launch import i32, ptr, stream
    from mok.runtime.arch import device_arch
    from mok.runtime.workspace import SymmetricWorkspace, get_workspace

    torch.cuda.set_device(0 if shared_gpu else rank)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    result = []
    try:
        nbytes = ROWS * WIDTH * 2
        ws = get_workspace(nbytes, spec={"rows": ROWS, "width": WIDTH})
        assert get_workspace(nbytes, spec={"rows": ROWS, "width": WIDTH}) is ws  # reused
        result.append(ws.handle_type)  # fabric where every rank can, else POSIX descriptors
        mine = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(100 + rank)).bfloat16()
        host = mine.view(torch.int16).numpy().tobytes()
        assert driver.cuMemcpyHtoD(ws.local_ptr, host, len(host))[0] == driver.CUresult.CUDA_SUCCESS
        torch.cuda.synchronize()
        dist.barrier()
        peer = 1 - rank
        want = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(100 + peer)).bfloat16()
        # copy engine read of the peer's buffer
        buf = np.empty(ROWS * WIDTH, dtype=np.int16)
        assert driver.cuMemcpyDtoH(buf, ws.peer_ptr(peer), len(host))[0] == driver.CUresult.CUDA_SUCCESS
        result.append(torch.equal(torch.from_numpy(buf).view(torch.bfloat16).view(ROWS, WIDTH), want))
        # SM loads straight from the peer's memory: the gather kernel with the peer address as source
        index = torch.arange(ROWS - 1, -1, -1, device="cuda", dtype=torch.int32)
        out = torch.full((ROWS, WIDTH), float("nan"), device="cuda", dtype=torch.bfloat16)
        kernel = get_kernel(gather_variant(WIDTH), device_arch())
        src = make_ptr(cutlass.BFloat16, ws.peer_ptr(peer), cutlass.cute.AddressSpace.gmem, assumed_align=16)
        kernel(src, ptr("i32", index, 4), ptr("bf16", out), ptr("i32", None), i32(ROWS), i32(ROWS), stream(out.device))
        torch.cuda.synchronize()
        result.append(torch.equal(out.cpu(), want.flip(0)))
        dist.barrier()
        # teardown leaves device memory where it was
        ws.close()
        assert ws.closed
        free_before = driver.cuMemGetInfo()[1]
        for _ in range(5):
            with SymmetricWorkspace(64 << 20, spec={"round": 1}) as w:
                assert w.peer_table.tolist() == [w.peer_ptr(0), w.peer_ptr(1)]
            dist.barrier()
        result.append(abs(driver.cuMemGetInfo()[1] - free_before) < (8 << 20))
        dist.barrier()
    finally:
        torch.save(result, f"{out_dir}/{rank}.pt")
        dist.destroy_process_group()


@pytest.mark.parametrize("shared_gpu", [pytest.param(False, marks=pytest.mark.multigpu), True])
def test_workspace_across_two_processes(tmp_path, shared_gpu):
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path), shared_gpu), nprocs=2)
    for rank in range(2):
        handle_type, *checks = torch.load(tmp_path / f"{rank}.pt")
        assert handle_type in ("fabric", "posix") and checks == [True, True, True], (rank, handle_type, checks)
