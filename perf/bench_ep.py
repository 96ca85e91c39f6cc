"""Expert-parallel MoE forward (or forward + backward) on N GPUs: MoK's EP path against the PyTorch-native EP baseline.

    python perf/bench_ep.py --ep 2 [--configs dsv3,qwen3] [--backward] [--profile N]     (one process per GPU)

Per rank, on the same inputs in one run: ``mok.forward`` with ``ep_size=N`` over the symmetric
VMM workspace (``mok.get_workspace``), and what users write with NCCL: all_to_all_single
dispatch with split sizes read back to the host, torch._grouped_mm experts, all_to_all_single
back, index_add combine. "mok gr" replays MoK's path from a CUDA graph (captured once per rank):
the device-bound time, without the host's launch work; "mok 1L" is the whole
forward in one kernel per rank (``one_launch``), "mok 1Lg" that replayed from a graph; "mok fp8"
sends x in MXFP8 (``dispatch_format="mxfp8"``: other bits, those of x's rounding), "mok 1L8" does
so in one launch (the bits of "mok fp8"); "mok q" runs the experts on DeepSeek-V3's FP8
(``precision="fp8_block"``, x sent in bf16) and "mok q8" sends x as its FP8 rows
(``dispatch_format="fp8_block"``: the forward's bits those of "mok q"). Reported:
the median over batches of the slowest rank's time (each path alone at its own steady state,
with rank 0's SM clock, power and temperature; ``--sustained 0``: the paths timed in turn), the speedup,
the bytes each rank sends to other ranks (dispatch + combine: the baseline sends a row per
remote (token, slot) pair each way, MoK's dispatch a token once per rank) and the effective
NVLink GB/s per GPU, and whether every MoK path gave the default path's bits. With
``--backward`` each path runs forward + backward: MoK's ``mok.forward`` + ``mok.backward``,
and autograd through the baseline with torch.distributed.nn's differentiable all_to_all_single
(gradients of x, router weights and this rank's expert weights); bytes sent double.

``--share-gpu`` puts every process on GPU 0 over gloo and times MoK's paths only (NCCL refuses
two ranks on one GPU): a smoke run of this script where two GPUs are not to be had, not a
measurement. Its NCCL baseline and the NVLink figures need two GPUs (last run: 2026-12-01,
perf/RESULTS.md; docs/notes/expert-parallel-exchange.md).
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
import mok
from mok.bench import (
    expert_offsets, format_gpu, graph_of, host_profile, kernel_times, same_bits, time_ms_interleaved, time_ms_sustained,
)

CONFIGS = {  # name: (T per rank, H, I, E over all ranks, k)
    "dsv3": (4096, 7168, 2048, 256, 8),
    "qwen3": (8192, 2048, 768, 128, 8),
}


def _exchange(out, inp, out_splits, in_splits, group):
    dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)
    return out


def torch_ep_forward(x, idx, w, experts, group, exchange=_exchange):
    """The PyTorch-native expert-parallel forward (host-read split sizes: one sync per exchange).

    ``exchange(out, inp, out_splits, in_splits, group)`` moves the activations (differentiable
    for the training step)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    wg, wu, wd = experts
    e_local = wg.shape[0]
    T, k = idx.shape
    flat = idx.flatten().long()
    dest = flat // e_local
    order = dest.argsort(stable=True)
    send_counts = torch.bincount(dest, minlength=world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send, recv = send_counts.tolist(), recv_counts.tolist()
    x_recv = x.new_empty(sum(recv), x.shape[1])
    x_recv = exchange(x_recv, x[order // k], recv, send, group)
    e_recv = flat.new_empty(sum(recv))
    dist.all_to_all_single(e_recv, flat[order], recv, send, group=group)
    local = e_recv - rank * e_local
    by_expert = local.argsort(stable=True)
    offs = expert_offsets(local, e_local)
    xs = x_recv[by_expert]
    a = F.silu(torch._grouped_mm(xs, wg.transpose(1, 2), offs=offs)) * torch._grouped_mm(xs, wu.transpose(1, 2), offs=offs)
    y_sorted = torch._grouped_mm(a, wd.transpose(1, 2), offs=offs)
    y_recv = torch.empty_like(y_sorted).index_copy(0, by_expert, y_sorted)
    y_back = x.new_empty(T * k, x.shape[1])
    y_back = exchange(y_back, y_recv, send, recv, group)
    out = torch.zeros(T, x.shape[1], device=x.device, dtype=torch.float32)
    out.index_add_(0, order // k, y_back * w.flatten()[order, None])  # (bf16 times fp32 weights: fp32, one pass)
    return out.bfloat16()


def torch_ep_train_step(x, idx, w, experts, dout, group):
    """Autograd through the baseline: gradients of x, the router weights and this rank's expert weights."""
    from torch.distributed.nn.functional import all_to_all_single

    def exchange(out, inp, out_splits, in_splits, group):
        return all_to_all_single(out, inp, out_splits, in_splits, group=group)

    leaves = [t.detach().requires_grad_() for t in (x, w, *experts)]
    out = torch_ep_forward(leaves[0], idx, leaves[1], tuple(leaves[2:]), group, exchange)
    return torch.autograd.grad(out, leaves, dout)


def _max_over_ranks(value: float, group) -> float:
    """The largest of the ranks' ``value`` (every rank calls it: a collective)."""
    mine = torch.tensor([value], device="cuda" if dist.get_backend(group) == "nccl" else "cpu")
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
    return float(mine)


def _time_in_turn(fns: dict, group, iters: int = 20, warmup: int = 3) -> dict:
    """Per callable, the median over iterations of the slowest rank's milliseconds, the callables
    taken in turn (mok.bench.time_ms_interleaved); every rank runs the same order."""
    return time_ms_interleaved(
        fns, batch=1, repeats=iters, warmup=warmup, before_batch=lambda: dist.barrier(group=group),
        per_batch=lambda ms: _max_over_ranks(ms, group),
    )


def _time_sustained(fns: dict, group, seconds: float) -> tuple[dict, dict]:
    """Per callable, alone at its own steady state (mok.bench.time_ms_sustained, batches of 5
    after a barrier, until any rank's time is up): the median of the slowest rank's milliseconds,
    and this rank's GPU clock, power and temperature while it was timed."""

    ms, gpu = {}, {}
    for name, fn in fns.items():
        ms[name], gpu[name] = time_ms_sustained(
            fn, seconds, batch=5, before_batch=lambda: dist.barrier(group=group), per_batch=lambda t: _max_over_ranks(t, group),
            agree_done=lambda done: bool(_max_over_ranks(float(done), group)),
        )
    return ms, gpu


def _host_ms(fn, calls: int = 10) -> float:
    """Host milliseconds to launch one call (no device sync inside): above the device time, the call is host-bound."""
    import time

    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e3
    torch.cuda.synchronize()
    return host


def _worker(
    rank: int, world: int, configs: list[str], init_file: str, backward: bool, profile_top: int = 0, sustained: float = 3.0,
    share_gpu: bool = False,
) -> None:
    torch.cuda.set_device(0 if share_gpu else rank)
    backend = "gloo" if share_gpu else "nccl"  # (NCCL refuses two ranks on one GPU)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    group = dist.group.WORLD
    try:
        if rank == 0:
            shared = ", SHARING ONE GPU (a smoke run: no baseline, times mean nothing)" if share_gpu else ""
            print(f"# {world}x {torch.cuda.get_device_name()}, torch {torch.__version__}{shared}")
            clocks = " MHz, W, C (rank 0)" if sustained else ""
            print(f"{'config':<8}{'path':<8}{'ms':>9}{'vs torch':>9}{'MB sent':>9}{'GB/s':>8}{clocks}")
        for name in configs:
            T, H, I, E, k = CONFIGS[name]
            g = torch.Generator(device="cuda").manual_seed(1000 + rank)
            x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
            idx = torch.rand(T, E, device="cuda", generator=g).topk(k, dim=1).indices.int()
            w = torch.softmax(torch.randn(T, k, device="cuda", generator=g), 1)
            e_local = E // world
            gw = torch.Generator(device="cuda").manual_seed(7 + rank)  # this rank's experts
            experts = tuple(
                (torch.randn(e_local, *shape, device="cuda", generator=gw) * shape[1] ** -0.5).bfloat16()
                for shape in ((I, H), (I, H), (H, I))
            )
            config = mok.MoKConfig(H, I, E, k, ep_size=world)
            ws = mok.create_workspace(config, group, max_tokens=T)  # (one layout serves every option below)

            def mok_forward(**options):
                cfg = mok.MoKConfig(H, I, E, k, ep_size=world, **options)
                return mok.forward(cfg, ws, x, idx, w, *experts, save_for_backward=False, check_routing=False, timeout_s=30.0)[0]

            if backward:
                dout = torch.randn(T, H, device="cuda", generator=g).bfloat16()

                def mok_step(**options):
                    cfg = mok.MoKConfig(H, I, E, k, ep_size=world, **options)
                    _, ctx = mok.forward(cfg, ws, x, idx, w, *experts, check_routing=False, timeout_s=30.0)
                    return mok.backward(cfg, ws, ctx, dout, timeout_s=30.0).dx

                paths = {
                    "mok": mok_step,
                    "mok gr": graph_of(mok_step),
                    "mok 1L": lambda: mok_step(one_launch=True),  # the forward in one kernel
                    "mok 1Lg": graph_of(lambda: mok_step(one_launch=True)),
                    "mok fp8": lambda: mok_step(dispatch_format="mxfp8"),  # x sent in MXFP8 (other bits)
                    "mok 1L8": lambda: mok_step(one_launch=True, dispatch_format="mxfp8"),  # both
                    "mok q": lambda: mok_step(precision="fp8_block"),  # the experts on FP8 (other bits)
                    "mok q8": lambda: mok_step(precision="fp8_block", dispatch_format="fp8_block"),  # x sent as its FP8 rows
                    "torch": lambda: torch_ep_train_step(x, idx, w, experts, dout, group)[0],
                }
            else:
                paths = {
                    "mok": mok_forward,
                    "mok gr": graph_of(mok_forward),
                    "mok 1L": lambda: mok_forward(one_launch=True),  # one kernel
                    "mok 1Lg": graph_of(lambda: mok_forward(one_launch=True)),
                    # x sent in MXFP8: 33/64 of the dispatch bytes, the routed experts on its rounding (other bits)
                    "mok fp8": lambda: mok_forward(dispatch_format="mxfp8"),
                    "mok 1L8": lambda: mok_forward(one_launch=True, dispatch_format="mxfp8"),
                    "mok q": lambda: mok_forward(precision="fp8_block"),  # the experts on FP8 (other bits)
                    "mok q8": lambda: mok_forward(precision="fp8_block", dispatch_format="fp8_block"),  # x as its FP8 rows: "mok q"'s bits
                    "torch": lambda: torch_ep_forward(x, idx, w, experts, group),
                }
            if share_gpu:  # the baseline needs NCCL
                del paths["torch"]
            if sustained:
                ms, gpu = _time_sustained(paths, group, sustained)
            else:
                ms, gpu = _time_in_turn(paths, group), {}
            want = paths["mok"]().clone()
            fp8_paths = ("mok fp8", "mok 1L8", "mok q", "mok q8")
            same = {p: same_bits(fn(), want) for p, fn in paths.items() if p not in ("mok", "torch", *fp8_paths)}  # the same bits
            same["mok 1L8 = mok fp8"] = same_bits(paths["mok 1L8"](), paths["mok fp8"]())
            same["mok q8 = mok q"] = same_bits(paths["mok q8"](), paths["mok q"]())  # (out; with --backward dx: x's rows do not enter it)
            fp8_diff = float((paths["mok fp8"]().float() - want.float()).norm() / want.float().norm())
            agree = None if share_gpu else float((want.float() - paths["torch"]().float()).norm() / paths["torch"]().float().norm())
            ws.check()
            owner = idx.long() // e_local
            remote_pairs = int((owner != rank).sum())  # (token, slot) pairs whose expert is elsewhere: torch sends each
            remote_tokens = sum(int((owner == r).any(1).sum()) for r in range(world) if r != rank)  # MoK: each token once per rank
            # x (dout) out, y (dx) back, bf16 rows; "mok fp8": x in MXFP8 (H·33/32 bytes a row), the rest bf16
            forward_bytes = {"torch": 2 * remote_pairs * H * 2, "mok": (remote_tokens + remote_pairs) * H * 2}
            forward_bytes["mok fp8"] = forward_bytes["mok 1L8"] = remote_tokens * H * 33 // 32 + remote_pairs * H * 2
            backward_bytes = {p: forward_bytes["torch" if p == "torch" else "mok"] if backward else 0 for p in forward_bytes}  # (bf16)
            path_bytes = {p: forward_bytes[p] + backward_bytes[p] for p in forward_bytes}
            sent = torch.tensor(list(path_bytes.values()), device="cpu" if share_gpu else "cuda", dtype=torch.float64)
            dist.all_reduce(sent, op=dist.ReduceOp.MAX, group=group)
            sent_by = dict(zip(path_bytes, sent.tolist()))
            if rank == 0:
                for p in paths:
                    nbytes = sent_by[p if p in sent_by else "mok"]
                    clock = format_gpu(gpu.get(p) or {})
                    sent = f"{nbytes / 1e6:>9.0f}{nbytes / ms[p] / 1e6:>8.0f}"
                    ratio = f"{ms['torch'] / ms[p]:>8.2f}x" if "torch" in ms else f"{'-':>9}"
                    print(f"{name:<8}{p:<8}{ms[p]:>9.3f}{ratio}{sent}{clock}")
                if agree is not None:
                    print(f"{name:<8}mok vs torch {'dx' if backward else 'output'} (rank 0): relative difference {agree:.2e}")
                print(f"{name:<8}every other MoK path gives the default path's bits (rank 0): {same}")
                print(f"{name:<8}mok fp8 vs mok {'dx' if backward else 'output'} (rank 0): relative difference {fp8_diff:.2e}")
            if profile_top:
                host = _host_ms(paths["mok"])
                stats = host_profile(paths["mok"], 5)  # (every rank calls it together)
                if rank == 0:
                    print(f"{name:<8}mok on rank 0: {host:.3f} ms of host time to launch one call; where it goes (cProfile, 5 calls):")
                    stats.sort_stats("tottime").print_stats(profile_top)
                rows = kernel_times(paths["mok"], profile_top)
                if rank == 0:
                    print(f"{name:<8}mok on rank 0, device ms per kernel (one call; waits include the peer's lag):")
                    for kernel, ms_k, calls in rows:
                        print(f"{'':<10}{ms_k:8.3f} ms {calls:>3}x  {kernel[:90]}")
            dist.barrier(group=group)
            ws.close()
    finally:
        dist.destroy_process_group()


def run(
    world: int, configs: list[str], backward: bool = False, profile_top: int = 0, sustained: float = 3.0, share_gpu: bool = False
) -> int:
    """Spawn one process per GPU and run the comparison.
    ``share_gpu``: every process on GPU 0 over gloo, MoK's paths only: a smoke run of this script
    on one GPU (the baseline's NCCL refuses two ranks on one GPU), not a measurement."""
    import torch.multiprocessing as mp

    if not share_gpu and torch.cuda.device_count() < world:
        print(f"--ep {world}: needs {world} GPUs, this machine has {torch.cuda.device_count()}")
        return 1
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(world, configs, os.path.join(d, "init"), backward, profile_top, sustained, share_gpu), nprocs=world)
    return 0


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel ranks, one process per GPU (default 2)")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--backward", action="store_true", help="time forward + backward")
    parser.add_argument("--sustained", type=float, default=3.0, metavar="S",
                        help="each path alone at its own steady state for S s (default 3); 0: the paths timed in turn")
    parser.add_argument("--profile", type=int, default=0, help="print rank 0's N most expensive kernels and its host profile")
    parser.add_argument(
        "--share-gpu", action="store_true",
        help="all processes on GPU 0 over gloo, MoK's paths only (a smoke run of this benchmark on one GPU; its times mean nothing)",
    )
    args = parser.parse_args()
    if args.ep < 2:
        parser.error("--ep: expected 2 or more ranks")
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        parser.error(f"--configs: no config(s) {sorted(unknown)}; known: {list(CONFIGS)}")
    return run(args.ep, args.configs.split(","), backward=args.backward, profile_top=args.profile, sustained=args.sustained,
               share_gpu=args.share_gpu)


if __name__ == "__main__":
    raise SystemExit(main())
