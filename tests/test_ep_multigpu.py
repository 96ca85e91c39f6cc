"""Expert parallelism across processes through the symmetric VMM workspace.

Two processes, each a rank: on two GPUs (NVLink; written for nvidia-h200-x2, not yet run
there: no two-GPU machine was available, as of 2026-12-04), and sharing
one GPU (the same workspace code: POSIX-fd handles exchanged between the processes, VMM
mappings of the peer's memory, system-scope flags; the GPU time-slices the two contexts).
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.gpu

COUNTS = (300, 517)  # tokens per rank, uneven on purpose
H, I, E, K = 512, 256, 8, 4


def _worker(rank, init_file, out_dir, skip_rank, shared_gpu):
    from helpers import ep_moe_backward, ep_moe_forward, ep_moe_forward_saved, gpu_layer, moe_backward, moe_forward
    from mok.pipeline.workspace import EPLayout, EPWorkspace
    from mok.runtime.workspace import SymmetricWorkspace

    torch.cuda.set_device(0 if shared_gpu else rank)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    result = {}
    try:
        x, idx, w, experts, shared = gpu_layer(sum(COUNTS), H, I, E, K, 256, seed=31)  # every rank: the global batch
        saved_all = moe_forward(x, idx, w, *experts, shared, save_for_backward=True)
        want = saved_all.out
        dout = torch.randn(sum(COUNTS), H, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7)).bfloat16()
        want_grads = moe_backward(dout, x, idx, w, *experts, shared, saved_all)
        from mok.mxfp8 import fake_quantize_mxfp8

        want_mxfp8 = moe_forward(fake_quantize_mxfp8(x).bfloat16(), idx, w, *experts).out  # (no shared expert: it sees x itself)
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
                if not shared_gpu:  # the other forward over real NVLink (emulated on one GPU: test_ep_gpu.py)
                    for mode in ("one_launch",):
                        dist.barrier()  # both ranks compile the mode's kernels at about the same time
                        outs = [ep_moe_forward(ws, *args, timeout_s=60.0, **{mode: True}) for _ in range(2)]
                        torch.cuda.synchronize()
                        ws.check()
                        result[f"bitwise {mode}"] = all(torch.equal(o, want[mine]) for o in outs)
                dist.barrier()
                outs = [ep_moe_forward(ws, *args[:-1], None, timeout_s=60.0, dispatch_format="mxfp8") for _ in range(2)]
                torch.cuda.synchronize()
                ws.check()
                result["bitwise mxfp8"] = all(torch.equal(o, want_mxfp8[mine]) for o in outs)
                saved = ep_moe_forward_saved(ws, *args, timeout_s=60.0)
                grads = ep_moe_backward(ws, dout[mine].contiguous(), *args, saved, timeout_s=60.0)
                torch.cuda.synchronize()
                ws.check()
                experts_mine = slice(rank * e_local, (rank + 1) * e_local)
                result["grads_bitwise"] = (
                    torch.equal(grads.dx, want_grads.dx[mine]) and torch.equal(grads.d_topk_w, want_grads.d_topk_w[mine])
                    and all(torch.equal(getattr(grads, n), getattr(want_grads, n)[experts_mine]) for n in ("d_w_gate", "d_w_up", "d_w_down"))
                )
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


def _compile_here(one_launch=False):
    """Compile every kernel of the test's layer in this process, so that two ranks sharing the GPU only load them."""
    from mok.config import MoKConfig
    from mok.kernels import get_kernel
    from mok.plan import plan_for
    from mok.runtime.arch import device_arch

    for shared in (256, None):
        for dispatch_format in ("bf16", "mxfp8"):  # (one_launch: a forward kernel per format)
            config = MoKConfig(
                hidden=H, intermediate=I, num_experts=E, topk=K, shared_intermediate=shared, ep_size=2, one_launch=one_launch,
                saved_h_format="mxfp8",  # (all of the plain config's kernels, and the quantize pair)
                dispatch_format=dispatch_format,
            )
            for variant in plan_for(config, device_arch()).variants():
                get_kernel(variant, device_arch())


def _spawn(tmp_path, skip_rank=None, shared_gpu=False):
    if shared_gpu:
        _compile_here()
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path), skip_rank, shared_gpu), nprocs=2)
    return [torch.load(tmp_path / f"{r}.pt") for r in range(2)]


@pytest.mark.multigpu
def test_ep2_over_nvlink_equals_single_gpu_forward_and_backward_bitwise(tmp_path):
    """Both ranks' outputs are the single-GPU forward's rows bit for bit, with every forward
    (several launches, one launch; x sent in MXFP8: the forward of its rounding), and so are the
    gradients."""
    results = _spawn(tmp_path)
    assert all(r["bitwise"] for r in results)
    for mode in ("one_launch", "mxfp8"):
        assert all(r[f"bitwise {mode}"] for r in results), mode
    assert all(r["grads_bitwise"] for r in results)


@pytest.mark.multigpu
def test_rank_that_skips_the_call_makes_the_peer_raise(tmp_path):
    results = _spawn(tmp_path, skip_rank=1)
    assert "rank 0 timed out in phase publish" in results[0]["error"] and "waiting for rank 1" in results[0]["error"]


def test_ep2_as_two_processes_sharing_one_gpu_equals_single_gpu_bitwise(tmp_path):
    results = _spawn(tmp_path, shared_gpu=True)
    assert all(r["bitwise"] for r in results)
    assert all(r["bitwise mxfp8"] for r in results)  # x sent in MXFP8: the single-GPU forward of its rounding
    assert all(r["grads_bitwise"] for r in results)


def test_rank_that_skips_the_call_makes_the_peer_raise_two_processes_one_gpu(tmp_path):
    results = _spawn(tmp_path, skip_rank=1, shared_gpu=True)
    assert "rank 0 timed out in phase publish" in results[0]["error"] and "waiting for rank 1" in results[0]["error"]


def _release_worker(rank, init_file, out_dir, shared_gpu):
    """A layer's workspace, its symmetric memory and the group: reused while the layer lives, all
    released once the layer is gone and the group destroyed (MoK's workspace cache holds neither)."""
    import gc
    import weakref

    from mok import MoELayer

    torch.cuda.set_device(0 if shared_gpu else rank)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    layer = MoELayer(H, I, E, K, shared_intermediate=256, group=dist.group.WORLD, device="cuda", max_tokens=max(COUNTS))
    x = torch.randn(COUNTS[rank], H, device="cuda").bfloat16().requires_grad_()
    layer(x).float().square().mean().backward()
    torch.cuda.synchronize()
    workspace = layer.workspace()
    reused = layer.workspace() is workspace
    refs = [weakref.ref(obj) for obj in (dist.group.WORLD, workspace, workspace.owner)]
    del layer, x, workspace
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()
    torch.save({"reused": reused, "released": [ref() is None for ref in refs]}, f"{out_dir}/{rank}.pt")


@pytest.mark.parametrize("shared_gpu", [pytest.param(False, marks=pytest.mark.multigpu), True])
def test_layer_workspace_and_group_are_released_once_the_layer_is_gone_and_the_group_destroyed(tmp_path, shared_gpu):
    if shared_gpu:
        _compile_here()
    mp.spawn(_release_worker, args=(str(tmp_path / "init"), str(tmp_path), shared_gpu), nprocs=2)
    for rank in range(2):
        got = torch.load(tmp_path / f"{rank}.pt")
        assert got == {"reused": True, "released": [True, True, True]}, (rank, got)  # (group, workspace, its memory)


def _layer_worker(rank, init_file, out_dir, shared_gpu, one_launch=False):
    """mok.MoELayer(group=...) on rank ``rank`` against the single-process layer holding every expert
    (``one_launch``: the expert-parallel layer's forward in one kernel)."""
    from mok import MoELayer

    torch.cuda.set_device(0 if shared_gpu else rank)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    result = {}
    try:
        torch.manual_seed(3)
        full = MoELayer(H, I, E, K, shared_intermediate=256, device="cuda")  # the same weights on both ranks
        ep = MoELayer(
            H, I, E, K, shared_intermediate=256, group=dist.group.WORLD, device="cuda", max_tokens=max(COUNTS), one_launch=one_launch
        )
        e_local = E // 2
        with torch.no_grad():
            for name, p in ep.named_parameters():
                src = dict(full.named_parameters())[name]
                p.copy_(src[rank * e_local:(rank + 1) * e_local] if name in ("gate_proj", "up_proj", "down_proj") else src)
        g = torch.Generator(device="cuda").manual_seed(11)
        x = torch.randn(sum(COUNTS), H, device="cuda", generator=g).bfloat16()
        idx = torch.rand(sum(COUNTS), E, device="cuda", generator=g).topk(K, dim=1).indices.int()
        w = torch.softmax(torch.randn(sum(COUNTS), K, device="cuda", generator=g), 1)
        dout = torch.randn(sum(COUNTS), H, device="cuda", generator=g).bfloat16()
        lo = sum(COUNTS[:rank])
        mine = slice(lo, lo + COUNTS[rank])
        # external routing: the MoE path alone, bit for bit
        xf, wf = x.clone().requires_grad_(), w.clone().requires_grad_()
        full(xf, topk_idx=idx, topk_w=wf).backward(dout)
        xe, we = x[mine].clone().requires_grad_(), w[mine].clone().requires_grad_()
        out = ep(xe, topk_idx=idx[mine], topk_w=we)
        out.backward(dout[mine])
        torch.cuda.synchronize()
        experts_mine = slice(rank * e_local, (rank + 1) * e_local)
        result["bitwise"] = (
            torch.equal(out, full(x, topk_idx=idx, topk_w=w).detach()[mine]) and torch.equal(xe.grad, xf.grad[mine])
            and torch.equal(we.grad, wf.grad[mine])
            and all(torch.equal(getattr(ep, n).grad, getattr(full, n).grad[experts_mine]) for n in ("gate_proj", "up_proj", "down_proj"))
        )
        del out  # its autograd graph would keep the parameters' AccumulateGrad nodes (default stream) into the capture below
        experts = [getattr(ep, n) for n in ("gate_proj", "up_proj", "down_proj", "shared_gate_proj", "shared_up_proj", "shared_down_proj")]
        plain_grads = [p.grad.clone() for p in experts]
        shared_sum = [getattr(ep, n).grad.float().cpu() for n in ("shared_gate_proj", "shared_up_proj", "shared_down_proj")]
        for t in shared_sum:
            dist.all_reduce(t)
        result["shared_rel"] = max(
            float((s - getattr(full, n).grad.float().cpu()).norm() / getattr(full, n).grad.float().cpu().norm())
            for s, n in zip(shared_sum, ("shared_gate_proj", "shared_up_proj", "shared_down_proj"))
        )
        # the built-in router: runs, and learns through topk_w
        ep.zero_grad()
        ep(x[mine]).float().square().mean().backward()
        torch.cuda.synchronize()
        result["router_grad"] = bool(ep.router.weight.grad.abs().sum() > 0)
        result["compiled"] = _compiled_equals_eager(x[mine], idx[mine], w[mine], dout[mine], one_launch)
        result["graph"] = _graph_replay_equals_eager(ep, x[mine], idx[mine], w[mine], dout[mine])
        # fuse_wgrad_accumulation: the same gradients added into fp32 main_grad buffers, none returned
        starts = [torch.randn(p.shape, device="cuda", generator=g) for p in experts]
        for p, start in zip(experts, starts):
            p.main_grad = start.clone()
        ep.zero_grad(set_to_none=True)
        plain_config, ep.config = ep.config, dataclasses.replace(ep.config, fuse_wgrad_accumulation=True)
        ep(x[mine].clone().requires_grad_(), topk_idx=idx[mine], topk_w=w[mine].clone().requires_grad_()).backward(dout[mine])
        torch.cuda.synchronize()
        result["main_grad"] = all(p.grad is None for p in experts) and max(
            float(((p.main_grad - s) - want.float()).norm() / want.float().norm()) for p, s, want in zip(experts, starts, plain_grads)
        ) <= 4e-3
        # saved_h_format="mxfp8": h kept packed on both layers; EP = 2 still gives the single-GPU bits
        # (each row's blocks are quantized alone), and the gradients did change (E4M3's rounding)
        for p in experts:
            del p.main_grad
        ep.config = dataclasses.replace(plain_config, saved_h_format="mxfp8")
        full.config = dataclasses.replace(full.config, saved_h_format="mxfp8")
        full.zero_grad(set_to_none=True)
        ep.zero_grad(set_to_none=True)
        xf, wf = x.clone().requires_grad_(), w.clone().requires_grad_()
        full(xf, topk_idx=idx, topk_w=wf).backward(dout)
        plain_dx = xe.grad
        xe, we = x[mine].clone().requires_grad_(), w[mine].clone().requires_grad_()
        ep(xe, topk_idx=idx[mine], topk_w=we).backward(dout[mine])
        torch.cuda.synchronize()
        result["mxfp8_h"] = (
            torch.equal(xe.grad, xf.grad[mine]) and torch.equal(we.grad, wf.grad[mine])
            and all(torch.equal(getattr(ep, n).grad, getattr(full, n).grad[experts_mine]) for n in ("gate_proj", "up_proj", "down_proj"))
            and not torch.equal(xe.grad, plain_dx)
        )
        # dispatch_format="mxfp8": the routed experts see x's MXFP8 rounding, the shared expert x
        # itself; with the shared weights zeroed that is the single-GPU layer on the rounded x, bit for bit, and
        # dx passes through the rounding (straight-through)
        from mok.mxfp8 import fake_quantize_mxfp8

        ep.config = dataclasses.replace(plain_config, dispatch_format="mxfp8")
        full.config = dataclasses.replace(full.config, saved_h_format="bf16")
        with torch.no_grad():
            for layer in (full, ep):
                for n in ("shared_gate_proj", "shared_up_proj", "shared_down_proj"):
                    getattr(layer, n).zero_()
        full.zero_grad(set_to_none=True)
        ep.zero_grad(set_to_none=True)
        xr, wf = fake_quantize_mxfp8(x).bfloat16().requires_grad_(), w.clone().requires_grad_()
        want_out = full(xr, topk_idx=idx, topk_w=wf)
        want_out.backward(dout)
        xe, we = x[mine].clone().requires_grad_(), w[mine].clone().requires_grad_()
        out = ep(xe, topk_idx=idx[mine], topk_w=we)
        out.backward(dout[mine])
        torch.cuda.synchronize()
        result["mxfp8_dispatch"] = (
            torch.equal(out, want_out.detach()[mine]) and torch.equal(xe.grad, xr.grad[mine]) and torch.equal(we.grad, wf.grad[mine])
            and all(torch.equal(getattr(ep, n).grad, getattr(full, n).grad[experts_mine]) for n in ("gate_proj", "up_proj", "down_proj"))
            and not torch.equal(out, full(x, topk_idx=idx, topk_w=w).detach()[mine])
        )
        del out
        ep.config = plain_config
        torch.save(result, f"{out_dir}/{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _layer_grads(model, x, dout, **routing):
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out = model(x, **routing)
    out.backward(dout)
    torch.cuda.synchronize()
    return [out.detach(), x.grad] + [p.grad.clone() for p in model.parameters() if p.grad is not None]  # (later steps add into p.grad)


class _TwoLayers(torch.nn.Module):
    """Two expert-parallel layers in a row on the same routing (one without, one with a shared expert)."""

    def __init__(self, one_launch=False):
        super().__init__()
        from mok import MoELayer

        kw = dict(group=dist.group.WORLD, device="cuda", max_tokens=max(COUNTS), one_launch=one_launch)
        self.first, self.second = MoELayer(H, I, E, K, **kw), MoELayer(H, I, E, K, shared_intermediate=256, **kw)

    def forward(self, x, topk_idx, topk_w):
        return self.second(self.first(x, topk_idx=topk_idx, topk_w=topk_w), topk_idx=topk_idx, topk_w=topk_w)


def _compiled_equals_eager(x, idx, w, dout, one_launch=False):
    """torch.compile(fullgraph=True) of a model of two expert-parallel layers: eager's bits (the ops are opaque)."""
    torch.manual_seed(5)
    model = _TwoLayers(one_launch)
    eager = _layer_grads(model, x, dout, topk_idx=idx, topk_w=w)
    compiled = _layer_grads(torch.compile(model, fullgraph=True), x, dout, topk_idx=idx, topk_w=w)
    params = len([p for n, p in model.named_parameters() if not n.endswith("router.weight")])
    return len(eager) == len(compiled) == 2 + params and all(torch.equal(a, b) for a, b in zip(eager, compiled))


def _graph_replay_equals_eager(layer, x, idx, w, dout):
    """Forward and backward of the expert-parallel layer captured in a CUDA graph on every rank; a replay gives eager's bits."""
    want = _layer_grads(layer, x, dout, topk_idx=idx, topk_w=w)
    static_x = x.clone().requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (every rank makes the same calls)
        for _ in range(2):
            layer(static_x, topk_idx=idx, topk_w=w).backward(dout)
    torch.cuda.current_stream().wait_stream(side)
    layer.zero_grad(set_to_none=True)
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(static_x, topk_idx=idx, topk_w=w)
        out.backward(dout)
    graph.replay()
    torch.cuda.synchronize()
    layer.workspace().check()
    got = [out.detach(), static_x.grad] + [p.grad for p in layer.parameters() if p.grad is not None]
    if len(got) != len(want):
        return f"{len(got)} gradients, not {len(want)}"
    return all(torch.equal(a, b) for a, b in zip(got, want)) or [
        (torch.equal(a, b), float((a.float() - b.float()).abs().max())) for a, b in zip(got, want)
    ]


def _spawn_layer(tmp_path, shared_gpu, one_launch=False):
    if shared_gpu:
        _compile_here(one_launch)
    mp.spawn(_layer_worker, args=(str(tmp_path / "init"), str(tmp_path), shared_gpu, one_launch), nprocs=2)
    return [torch.load(tmp_path / f"{r}.pt") for r in range(2)]


@pytest.mark.multigpu
@pytest.mark.parametrize("one_launch", [False, True])
def test_layer_with_a_group_on_two_gpus_equals_the_single_gpu_layer(tmp_path, one_launch):
    results = _spawn_layer(tmp_path, shared_gpu=False, one_launch=one_launch)
    assert all(
        r["bitwise"] and r["shared_rel"] < 1e-2 and r["router_grad"] and r["compiled"] and r["graph"] is True and r["main_grad"]
        and r["mxfp8_h"] and r["mxfp8_dispatch"] for r in results
    ), [(r["compiled"], r["graph"], r["main_grad"], r["mxfp8_h"], r.get("mxfp8_dispatch")) for r in results]


@pytest.mark.parametrize("one_launch", [False, True])
def test_layer_with_a_group_of_two_processes_sharing_one_gpu_equals_the_single_gpu_layer(tmp_path, one_launch):
    results = _spawn_layer(tmp_path, shared_gpu=True, one_launch=one_launch)
    assert all(
        r["bitwise"] and r["shared_rel"] < 1e-2 and r["router_grad"] and r["compiled"] and r["graph"] is True and r["main_grad"]
        and r["mxfp8_h"] and r["mxfp8_dispatch"] for r in results
    ), [(r["compiled"], r["graph"], r["main_grad"], r["mxfp8_h"], r.get("mxfp8_dispatch")) for r in results]
