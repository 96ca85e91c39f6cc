"""Random inputs for the MoE layer, shared by tests (fresh random data, never zeros)."""

from __future__ import annotations

import contextlib
import os
import sys

import torch


def random_routing(num_tokens: int, num_experts: int, topk: int, generator: torch.Generator, device="cpu"):
    """Distinct experts per token (as a top-k router gives) and positive weights."""
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    topk_idx = scores.topk(topk, dim=1).indices.to(torch.int32)
    topk_w = torch.rand(num_tokens, topk, generator=generator) + 0.05
    return topk_idx.to(device), topk_w.to(device)


def random_layer(num_tokens, hidden, inter, num_experts, topk, shared_inter=None, *, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    topk_idx, topk_w = random_routing(num_tokens, num_experts, topk, g)
    scale = hidden ** -0.5
    w_gate = (torch.randn(num_experts, inter, hidden, generator=g) * scale).to(dtype)
    w_up = (torch.randn(num_experts, inter, hidden, generator=g) * scale).to(dtype)
    w_down = (torch.randn(num_experts, hidden, inter, generator=g) * inter ** -0.5).to(dtype)
    shared = None
    if shared_inter:
        shared = (
            (torch.randn(shared_inter, hidden, generator=g) * scale).to(dtype),
            (torch.randn(shared_inter, hidden, generator=g) * scale).to(dtype),
            (torch.randn(hidden, shared_inter, generator=g) * shared_inter ** -0.5).to(dtype),
        )
    return x, topk_idx, topk_w, (w_gate, w_up, w_down), shared


def rel_err(got, want):
    """||got - want|| / ||want|| in fp32."""
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).norm() / want.norm())


def worst_row_err(got, want):
    """The largest ||got_r - want_r|| / (||want_r|| + the mean row norm) over the rows r of the
    first dimension (tokens, or the experts of a weight gradient); 0 where everything is zero and
    equal, inf where the reference is all zero and the result is not. One norm over a whole
    tensor can hide a dropped (token, slot) pair (at 4096 x 8 pairs it moves the norm by less than
    1e-2); one row's cannot. (The mean in the denominator keeps a row whose reference is nearly
    zero, such as a row of a one-token weight gradient, from counting its rounding as an error.)"""
    g, w = got.float().reshape(got.shape[0], -1), want.float().reshape(want.shape[0], -1)
    diff, ref = (g - w).norm(dim=1), w.norm(dim=1)
    if not diff.numel():
        return 0.0
    if float(ref.max()) == 0:
        return 0.0 if float(diff.max()) == 0 else float("inf")
    return float((diff / (ref + ref.mean())).max())


def worst_entry_err(got, want):
    """The largest |got - want| / (|want| + rms(want)) over the entries: per value, for values
    such as router-weight gradients (a few per token, any of them may be near zero)."""
    g, w = got.float(), want.float()
    rms = w.square().mean().sqrt()
    return float(((g - w).abs() / (w.abs() + rms)).max()) if w.numel() else 0.0


def gpu_layer(num_tokens, hidden, inter, num_experts, topk, shared_inter=None, seed=0, routing="uniform"):
    """A bf16 layer on the GPU: x, topk_idx (int32), topk_w, (w_gate, w_up, w_down), shared or None."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    x = torch.randn(num_tokens, hidden, device=dev, generator=g).bfloat16()
    if routing == "uniform":
        idx = torch.rand(num_tokens, num_experts, device=dev, generator=g).topk(topk, dim=1).indices.int()
    elif routing == "one_expert":  # every token's slot 0 on expert 0, the rest distinct
        idx = torch.arange(topk, device=dev, dtype=torch.int32).repeat(num_tokens, 1)
    else:  # zipf-skewed over experts
        p = 1.0 / torch.arange(1, num_experts + 1, device=dev, dtype=torch.float32)
        idx = torch.multinomial(p.expand(num_tokens, -1), topk, replacement=False, generator=g).int()
    w = torch.rand(num_tokens, topk, device=dev, generator=g) + 0.05
    s = hidden ** -0.5
    wg = (torch.randn(num_experts, inter, hidden, device=dev, generator=g) * s).bfloat16()
    wu = (torch.randn(num_experts, inter, hidden, device=dev, generator=g) * s).bfloat16()
    wd = (torch.randn(num_experts, hidden, inter, device=dev, generator=g) * inter ** -0.5).bfloat16()
    shared = None
    if shared_inter:
        shared = tuple(t.bfloat16().contiguous() for t in (
            torch.randn(shared_inter, hidden, device=dev, generator=g) * s,
            torch.randn(shared_inter, hidden, device=dev, generator=g) * s,
            torch.randn(hidden, shared_inter, device=dev, generator=g) * shared_inter ** -0.5,
        ))
    return x, idx, w, (wg, wu, wd), shared


def poisoned(*shape):
    """A bf16 CUDA tensor of NaN: an element the kernel does not write stays NaN."""
    return torch.full(shape, float("nan"), device="cuda", dtype=torch.bfloat16)


def assert_scatters_into_two_ranks_slots(a, w, sched, want) -> None:
    """ops.grouped_gemm_scatter of rows ``a`` by ``w`` into two "ranks" of T0 = ceil(T / 2) tokens
    whose [T0, k, H] slots lie a stride apart in one buffer (token g -> rank g // T0, row g % T0):
    the slots read back as ``want`` [T, k, H], and the gap between the regions stays untouched."""
    from mok import ops

    T, k, H = want.shape
    t0 = -(-T // 2)
    stride = t0 * k * H + 1024  # (a gap of 1024 elements between the regions)
    buffer = poisoned(2 * stride)
    ops.grouped_gemm_scatter(
        a, w, sched.tile_expert, sched.row_token, sched.row_slot, buffer[: t0 * k * H].view(t0, k, H), slot_ranks=(2, stride)
    )
    got = torch.cat([buffer[: t0 * k * H], buffer[stride: stride + (T - t0) * k * H]]).view(T, k, H)
    assert torch.equal(got, want)
    assert buffer[t0 * k * H: stride].isnan().all() and buffer[stride + (T - t0) * k * H:].isnan().all()


def _gloo_rank(rank: int, init_file: str, out_dir: str, action) -> None:
    """One of two gloo ranks: run ``action(rank)`` and write the ValueError it raised (or "no error")."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        try:
            action(rank)
            msg = "no error"
        except ValueError as err:
            msg = str(err)
        with open(f"{out_dir}/{rank}.txt", "w") as f:
            f.write(msg)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # The result is on disk and the group destroyed: leave without the interpreter's teardown, in
    # which gloo's threads abort the process now and then after an all_to_all (torch 2.13 on the
    # CPU: about one run in twenty, "terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def value_errors_on_two_ranks(tmp_path, action) -> list[str]:
    """The ValueError message (or "no error") of ``action(rank)`` on each of two gloo CPU ranks
    (``action``: a module-level function, so that the spawned processes can import it)."""
    import torch.multiprocessing as mp

    mp.spawn(_gloo_rank, args=(str(tmp_path / "init"), str(tmp_path), action), nprocs=2)
    return [(tmp_path / f"{rank}.txt").read_text() for rank in range(2)]


# Expert parallelism emulated on one GPU (W ranks on W streams sharing one workspace buffer)


def split_rows(t, counts):
    """``t``'s rows cut in order into pieces of counts[0], counts[1], ... rows (contiguous copies)."""
    bounds = [sum(counts[:p]) for p in range(len(counts) + 1)]
    return [t[bounds[p]:bounds[p + 1]].contiguous() for p in range(len(counts))]


def split_ranks(world, counts, x, idx, w, experts, shared):
    """Rank p's tokens (counts[p] of them, in order) and experts (E / world of them)."""
    e_local = experts[0].shape[0] // world
    tokens = zip(split_rows(x, counts), split_rows(idx, counts), split_rows(w, counts))
    return [(*rank_tokens, *(t[p * e_local:(p + 1) * e_local].contiguous() for t in experts), shared) for p, rank_tokens in enumerate(tokens)]


def warm_up_training(layout, per_rank_args, per_rank_dout, capacity=None, **forward):
    """Launch every forward and backward kernel once, one rank at a time (their waits time out at
    once), each on its own throwaway workspaces (a forward whose waits timed out leaves an error
    that the next call of its workspace would raise). CUDA loads a kernel at its first launch and
    loading waits for the device: on one GPU, for another "rank's" spinning kernel."""
    from mok.pipeline.workspace import EPWorkspace

    forward_ws = EPWorkspace.local_group(layout, capacity=capacity)
    backward_ws = EPWorkspace.local_group(layout, capacity=capacity)
    for f, b, a, d in zip(forward_ws, backward_ws, per_rank_args, per_rank_dout):
        s = ep_moe_forward_saved(f, *a, timeout_s=1e-4, **forward)
        ep_moe_backward(b, d, *a, s, timeout_s=1e-4, **forward)
        torch.cuda.synchronize()


def run_train_ranks(workspaces, per_rank_args, per_rank_dout, timeout_s=20.0, check=True, **forward):
    """Forward (keeping h) then backward on every rank, each on its own stream (``forward``: both
    calls' MoKConfig options, as the layer passes one config to both)."""
    streams = [torch.cuda.Stream() for _ in workspaces]
    results = []
    torch.cuda.synchronize()
    for ws, args, dout, stream in zip(workspaces, per_rank_args, per_rank_dout, streams):
        with torch.cuda.stream(stream):
            saved = ep_moe_forward_saved(ws, *args, timeout_s=timeout_s, **forward)
            results.append((saved.out, ep_moe_backward(ws, dout, *args, saved, timeout_s=timeout_s, **forward)))
    torch.cuda.synchronize()
    for ws in workspaces if check else ():
        ws.check()
    return results


def warm_up_both_forwards(layout, inter: int, num_experts: int) -> None:
    """:func:`warm_up_training` on 8 tokens per rank, after the multi-launch and the one-launch
    forward: every kernel a training step of this layout and these expert shapes launches."""
    world, hidden, topk = layout.world, layout.hidden, layout.topk
    x, idx, w, experts, _ = gpu_layer(8 * world, hidden, inter, num_experts, topk, seed=world)
    per_rank = split_ranks(world, [8] * world, x, idx, w, experts, None)
    for forward in ({}, {"one_launch": True}):
        warm_up_training(layout, per_rank, [args[0] for args in per_rank], **forward)


def ep_training_case(world, counts, hidden, inter, num_experts, topk, *, seed, routing):
    """A batch of sum(counts) tokens (no shared expert) split over ``world`` ranks, and the
    single-GPU forward and backward on all of it: (per-rank arguments, per-rank dout, out,
    gradients), the bits an expert-parallel training step on it must give."""
    total = sum(counts)
    x, idx, w, experts, _ = gpu_layer(total, hidden, inter, num_experts, topk, seed=seed, routing=routing)
    dout = torch.randn(total, hidden, device="cuda").bfloat16()
    saved = moe_forward(x, idx, w, *experts, save_for_backward=True)
    want = moe_backward(dout, x, idx, w, *experts, None, saved)
    return split_ranks(world, counts, x, idx, w, experts, None), split_rows(dout, counts), saved.out, want


def ep_training_mismatches(results, want_out, want) -> list[str]:
    """The names of what :func:`run_train_ranks` gave (concatenated over ranks) that is not the
    single-GPU bits: out, dx, d_topk_w, d_w_gate, d_w_up, d_w_down."""
    grads = [g for _, g in results]
    got = {"out": torch.cat([out for out, _ in results])}
    expected = {"out": want_out}
    for name in ("dx", "d_topk_w", "d_w_gate", "d_w_up", "d_w_down"):
        got[name] = torch.cat([getattr(g, name) for g in grads])
        expected[name] = getattr(want, name)
    return [name for name in got if not torch.equal(got[name], expected[name])]


def mxfp8_forward_reference(x, idx, w, experts, shared):
    """float64: each expert's SwiGLU MLP on MXFP8-rounded x and weights, a rounded to bf16 (the
    GEMM's output) and then through MXFP8 (the down projection's input); the shared expert in bf16
    operands; the weighted sum in slot order."""
    from mok.mxfp8 import fake_quantize_mxfp8
    from mok.reference import gated_mlp, weighted_sum

    fq = lambda t: fake_quantize_mxfp8(t).double()  # noqa: E731
    x_q, (g_q, u_q, d_q) = fq(x), [fq(t) for t in experts]
    y = torch.zeros(x.shape[0], idx.shape[1], x.shape[1], dtype=torch.float64, device=x.device)
    for e in range(g_q.shape[0]):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if tok.numel():
            a = torch.nn.functional.silu(x_q[tok] @ g_q[e].T) * (x_q[tok] @ u_q[e].T)
            y[tok, slot] = fq(a.bfloat16()) @ d_q[e].T
    base = None if shared is None else gated_mlp(x.double(), *(t.double() for t in shared))
    return weighted_sum(y, w.double(), base)


def check_mxfp8_forward(T, H, I, E, k, shared_inter, routing, emulate):
    """The MXFP8 forward's output against :func:`mxfp8_forward_reference` (poisoned output first),
    called twice for the same bits, and the first half of the batch alone for the same bits of
    those tokens. Returns (out, the layer)."""
    layer = gpu_layer(T, H, I, E, k, shared_inter, seed=T + 1, routing=routing)
    x, idx, w, experts, shared = layer
    precision = "mxfp8_emulated" if emulate else "mxfp8"
    run = lambda n, **kw: moe_forward(x[:n], idx[:n], w[:n], *experts, shared, precision=precision, **kw).out  # noqa: E731
    out = run(T, out=poisoned(T, H))
    want = mxfp8_forward_reference(x, idx, w, experts, shared)
    assert not out.isnan().any() and rel_err(out, want) < 1e-2 and worst_row_err(out, want) < 5e-2
    assert torch.equal(out, run(T))
    assert torch.equal(out[: T // 2], run(T // 2))
    return out, layer


def mxfp8_backward_reference(dout, x, idx, w, experts, shared, wgrad_format="mxfp8"):
    """float64 gradients as the MXFP8 backward computes them: the saved h from MXFP8-rounded x and
    weights, rounded to bf16; per routed row dA_u = q(dout)·q(W_downᵀ)ᵀ (q: through MXFP8 along the
    product's K), dh rounded to bf16, then its halves each through MXFP8 for dx = q(dh_gate)·q(W_gateᵀ)ᵀ
    + q(dh_up)·q(W_upᵀ)ᵀ; d_topk_w = Σ dA_u·a; the weight gradients from the bf16 rows (dout, bf16(s·a), dh, x),
    with ``wgrad_format`` "mxfp8" each through MXFP8 along the rows (blocks of 32 of an expert's rows
    in canonical order, from its first); the shared expert by autograd on bf16 operands. Returns
    (dx, d_topk_w, d_gate, d_up, d_down, d_shared or None)."""
    from mok.mxfp8 import fake_quantize_mxfp8
    from mok.reference import gated_mlp

    fq = lambda t: fake_quantize_mxfp8(t.float()).double()  # noqa: E731

    def fq_rows(t):  # through MXFP8 along the rows, the expert's rows padded with zeros to blocks of 32
        if wgrad_format != "mxfp8":
            return t
        padded = torch.cat([t, t.new_zeros(-t.shape[0] % 32, t.shape[1])])
        return fq(padded.T).T[: t.shape[0]]

    bf = lambda t: t.bfloat16().double()  # noqa: E731
    w_gate, w_up, w_down = experts
    num_tokens, hidden = x.shape
    num_experts, inter, _ = w_gate.shape
    f64 = dict(dtype=torch.float64, device=x.device)
    dx = torch.zeros(num_tokens, hidden, **f64)
    d_topk_w = torch.zeros(idx.shape, **f64)
    d_gate, d_up, d_down = torch.zeros(w_gate.shape, **f64), torch.zeros(w_up.shape, **f64), torch.zeros(w_down.shape, **f64)
    x_q, dout_q = fq(x), fq(dout)
    for e in range(num_experts):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if not tok.numel():
            continue
        h_g, h_u = bf(x_q[tok] @ fq(w_gate[e]).T), bf(x_q[tok] @ fq(w_up[e]).T)
        s = w[tok, slot].double()[:, None]
        d_a = dout_q[tok] @ fq(w_down[e].T).T
        sig = torch.sigmoid(h_g)
        a = h_g * sig * h_u
        dh_g, dh_u = bf(s * d_a * h_u * sig * (1 + h_g * (1 - sig))), bf(s * d_a * h_g * sig)
        d_topk_w[tok, slot] = (d_a * a).sum(1)
        dh_q = torch.cat([fq(dh_g), fq(dh_u)], 1)  # (each half blocked on its own: the dx GEMM's two K ranges)
        dx.index_add_(0, tok, dh_q[:, :inter] @ fq(w_gate[e].T).T + dh_q[:, inter:] @ fq(w_up[e].T).T)
        x_rows = fq_rows(x[tok].double())
        d_down[e] = fq_rows(dout[tok].double()).T @ fq_rows(bf(s * a))
        d_gate[e], d_up[e] = fq_rows(dh_g).T @ x_rows, fq_rows(dh_u).T @ x_rows
    d_shared = None
    if shared is not None:
        x64 = x.double().requires_grad_()
        weights64 = [t.double().requires_grad_() for t in shared]
        gated_mlp(x64, *weights64).backward(dout.double())
        dx = dx + x64.grad
        d_shared = tuple(t.grad for t in weights64)
    return dx, d_topk_w, d_gate, d_up, d_down, d_shared


def check_mxfp8_backward(T, H, I, E, k, shared_inter, routing, emulate, wgrad_format="mxfp8"):
    """The MXFP8 backward's gradients against :func:`mxfp8_backward_reference`; the same bits twice;
    dx and d_topk_w of the first half of the batch alone the same bits. Returns the gradients."""
    x, idx, w, experts, shared = gpu_layer(T, H, I, E, k, shared_inter, seed=T + 2, routing=routing)
    dout = torch.randn(T, H, device="cuda", generator=torch.Generator(device="cuda").manual_seed(T)).bfloat16()
    precision = "mxfp8_emulated" if emulate else "mxfp8"

    def run(n):
        saved = moe_forward(x[:n], idx[:n], w[:n], *experts, shared, save_for_backward=True, precision=precision)
        return moe_backward(dout[:n], x[:n], idx[:n], w[:n], *experts, shared, saved, precision=precision, wgrad_format=wgrad_format)

    grads = run(T)
    want = mxfp8_backward_reference(dout, x, idx, w, experts, shared, wgrad_format)
    names = ("dx", "d_topk_w", "d_w_gate", "d_w_up", "d_w_down")
    for name, got, ref in zip(names, grads[:5], want[:5]):
        assert not got.isnan().any() and rel_err(got, ref) < 1e-2, (name, rel_err(got, ref))
    assert worst_row_err(grads.dx, want[0]) < 5e-2
    for got, ref in zip(grads.d_shared or (), want[5] or ()):
        assert rel_err(got, ref) < 1e-2
    again = run(T)
    assert all(torch.equal(a, b) for a, b in zip(grads[:5], again[:5]))
    half = run(T // 2)
    assert torch.equal(half.dx, grads.dx[: T // 2]) and torch.equal(half.d_topk_w, grads.d_topk_w[: T // 2])
    return grads


def check_mxfp8_main_grads_and_packed_h(emulate, wgrad_format):
    """The MXFP8 backward with ``main_grads``: each weight gradient added once into its fp32 buffer
    (buffer == old + the fresh fp32 gradient, bitwise; what comes back is the buffer), dx and
    d_topk_w unchanged; and from a packed MXFP8 h (mok.saved_mxfp8.pack_saved), the bits of the
    backward given that h rounded through MXFP8 by the reference rule (mok.mxfp8, on the CPU)."""
    import dataclasses

    from mok.mxfp8 import dequantize_mxfp8, quantize_mxfp8
    from mok.saved_mxfp8 import pack_saved

    T, H, I, E, k, shared_inter = 600, 512, 256, 8, 2, 384
    x, idx, w, experts, shared = gpu_layer(T, H, I, E, k, shared_inter, seed=14)
    dout = torch.randn(T, H, device="cuda", generator=torch.Generator(device="cuda").manual_seed(15)).bfloat16()
    precision = "mxfp8_emulated" if emulate else "mxfp8"
    saved = moe_forward(x, idx, w, *experts, shared, save_for_backward=True, precision=precision)

    def backward(state, **kw):
        g = moe_backward(dout, x, idx, w, *experts, shared, state, precision=precision, wgrad_format=wgrad_format, **kw)
        return [*g[:5], *(g.d_shared or ())]

    fresh = backward(saved, grad_dtype=torch.float32)
    buffers = [torch.randn(t.shape, device="cuda") for t in (*experts, *shared)]
    before = [b.clone() for b in buffers]
    added = backward(saved, main_grads=tuple(buffers))
    assert torch.equal(added[0], fresh[0]) and torch.equal(added[1], fresh[1])
    for got, buf, old, new in zip(added[2:], buffers, before, fresh[2:]):
        assert got.data_ptr() == buf.data_ptr()
        assert torch.equal(buf, old + new)  # one fp32 add per element, nothing else

    def through_mxfp8(h):
        return dequantize_mxfp8(*quantize_mxfp8(h.cpu())).to(torch.bfloat16).to(h.device)

    packed = pack_saved(saved)
    assert packed.h.dtype == torch.uint8 and packed.shared_h.dtype == torch.uint8
    rounded = dataclasses.replace(saved, h=through_mxfp8(saved.h), shared_h=through_mxfp8(saved.shared_h))
    got, want = backward(packed), backward(rounded)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not all(torch.equal(a, b) for a, b in zip(got, backward(saved)))  # (the rounding does reach the gradients)


@contextlib.contextmanager
def recorded_lookups():
    """The kernels the default cache is asked for inside the block, as (name, sorted config items)
    (the cache's own lookup, recorded; the GPU synchronised before the block ends)."""
    from mok.runtime.cache import default_cache

    cache, looked_up = default_cache(), set()
    lookup = cache.loaded

    def recording(name, config, arch):
        looked_up.add((name, tuple(sorted(config.items()))))
        return lookup(name, config, arch)

    cache.loaded = recording
    try:
        yield looked_up
        torch.cuda.synchronize()
    finally:
        del cache.loaded


# The pipelines called as the tests call them: a configuration made from the tensors' shapes and the
# options a test names, resolved into the plan of the tensors' GPU (mok.pipeline.forward / backward)


def layer_config(x, topk_idx, experts, shared=None, *, ep_size: int = 1, **options):
    """The MoKConfig of these tensors (E: the local experts times ``ep_size``) with ``options``."""
    from mok.config import MoKConfig

    return MoKConfig(
        hidden=x.shape[1], intermediate=experts[0].shape[1], num_experts=experts[0].shape[0] * ep_size, topk=topk_idx.shape[1],
        shared_intermediate=None if shared is None else shared[0].shape[0], ep_size=ep_size, **options,
    )


def layer_plan(x, topk_idx, experts, shared=None, **options):
    """The plan of :func:`layer_config` on x's GPU (on another device: Hopper's, so that the
    pipelines' own checks are what a test meets)."""
    from mok.plan import plan_for, plan_for_device

    config = layer_config(x, topk_idx, experts, shared, **options)
    return plan_for_device(config, x.device) if x.is_cuda else plan_for(config, "sm_90a")


def moe_forward(x, topk_idx, topk_w, w_gate, w_up, w_down, shared=None, *, save_for_backward=False, out=None, check_routing=True,
                shared_in_routed=None, **options):
    """mok.pipeline.forward at one GPU (``options``: MoKConfig's, e.g. one_launch, precision)."""
    from mok import pipeline

    experts = (w_gate, w_up, w_down)
    return pipeline.forward(
        layer_plan(x, topk_idx, experts, shared, **options), x, topk_idx, topk_w, experts, shared, save=save_for_backward, out=out,
        check_routing=check_routing, shared_in_routed=shared_in_routed,
    )


def moe_backward(dout, x, topk_idx, topk_w, w_gate, w_up, w_down, shared, saved, *, grad_dtype=torch.bfloat16, main_grads=None,
                 weight_grads=True, wgrad_format=None, **options):
    """mok.pipeline.backward at one GPU (``options``: MoKConfig's, the forward's)."""
    from mok import pipeline

    experts = (w_gate, w_up, w_down)
    return pipeline.backward(
        layer_plan(x, topk_idx, experts, shared, **options), dout, x, topk_idx, topk_w, experts, shared, saved, grad_dtype=grad_dtype,
        main_grads=main_grads, weight_grads=weight_grads, wgrad_format=wgrad_format,
    )


def ep_moe_forward_saved(ws, x, topk_idx, topk_w, w_gate, w_up, w_down, shared=None, *, save_h=True, timeout_s=5.0, **options):
    """mok.pipeline.forward of one rank over the workspace ``ws`` (``options``: MoKConfig's; with
    saved_h_format="recompute_gate" h kept as its up half, as the layer's op keeps it)."""
    from mok import pipeline
    from mok.saved_h import pack_saved

    experts = (w_gate, w_up, w_down)
    plan = layer_plan(x, topk_idx, experts, shared, ep_size=ws.layout.world, **options)
    res = pipeline.forward(plan, x, topk_idx, topk_w, experts, shared, workspace=ws, save=save_h, check_routing=False, timeout_s=timeout_s)
    return pack_saved(res, "recompute_gate") if save_h and plan.config.recomputes_gate else res


def ep_moe_forward(ws, *args, **kwargs):
    """This rank's output of :func:`ep_moe_forward_saved` without saving anything."""
    return ep_moe_forward_saved(ws, *args, save_h=False, **kwargs).out


def ep_moe_backward(ws, dout, x, topk_idx, topk_w, w_gate, w_up, w_down, shared, saved, *, grad_dtype=torch.bfloat16, main_grads=None,
                    timeout_s=5.0, weight_grads=True, **options):
    """mok.pipeline.backward of one rank over the workspace ``ws``."""
    from mok import pipeline

    experts = (w_gate, w_up, w_down)
    plan = layer_plan(x, topk_idx, experts, shared, ep_size=ws.layout.world, **options)
    return pipeline.backward(
        plan, dout, x, topk_idx, topk_w, experts, shared, saved, workspace=ws, grad_dtype=grad_dtype, main_grads=main_grads,
        weight_grads=weight_grads, timeout_s=timeout_s,
    )


def opchecked_layer_ops(**options) -> list:
    """torch.library.opcheck of mok::moe_forward and mok::moe_backward on a small CPU layer (6
    tokens, H 64, I 32, 8 experts, top-2, a shared expert of width 48) with MoKConfig ``options``;
    returns the forward op's saved outputs (h, shared_h, x_rows, routing, *schedule)."""
    from mok.config import MoKConfig
    from mok.layer import MoELayer, route
    from mok.torch_ops import config_text

    torch.manual_seed(1)
    layer = MoELayer(64, 32, 8, 2, shared_intermediate=48, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 64, generator=g)
    idx, w = route(torch.randn(6, 8, generator=g), 2)
    weights = [t.detach() for t in (layer.gate_proj, layer.up_proj, layer.down_proj, *layer.shared_weights())]
    config = config_text(MoKConfig(64, 32, 8, 2, shared_intermediate=48, **options))
    fwd_args = (x, idx, w, *weights, config, 0, True, False, 5.0)
    torch.library.opcheck(torch.ops.mok.moe_forward.default, fwd_args)
    _, *saved = torch.ops.mok.moe_forward(*fwd_args)
    bwd_args = (torch.randn(6, 64, generator=g), x, idx, w, *weights, saved, config, 0, 5.0, [])
    torch.library.opcheck(torch.ops.mok.moe_backward.default, bwd_args, test_utils=("test_schema", "test_faketensor"))
    return saved


@contextlib.contextmanager
def hang_watchdog(name: str, seconds: float):
    """Inside: if the block has not finished after ``seconds`` (a kernel that never returns blocks
    the thread in the driver, where no exception can reach it), print ``name``, the kernel launched
    last (mok.ops.common.last_kernel) and every thread's stack, and end the process with exit code
    3: a hang becomes a failure that names the kernel."""
    import faulthandler
    import threading

    def fire():
        from mok.ops.common import last_kernel

        sys.stderr.write(f"\n{name}: still running after {seconds:g} s (a hang?); the kernel launched last: {last_kernel()}\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(all_threads=True)
        os._exit(3)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
