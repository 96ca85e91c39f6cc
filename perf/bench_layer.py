"""MoE layer on one GPU: MoK's fused path against the plain PyTorch path, side by side.

    python perf/bench_layer.py [--configs dsv3,qwen3,dsv3-zipf] [--backward]
    python perf/bench_layer.py --ep 2 [--configs dsv3,qwen3] [--backward]     (expert parallel: perf/bench_ep.py)

For each config, on the same inputs in one process: MoK's forward, the PyTorch path users
write (router-grouped torch._grouped_mm for gate/up and down, SwiGLU, weighting and
index_add combine), and a dense bf16 GEMM of the same FLOPs as the ceiling. Prints ms,
TFLOP/s (6·T·k·H·I per forward, plus 6·T·H·I_s for a shared expert), the ratios, and the
number of kernel launches per forward (torch.profiler). "mok 3-launch" is the forward whose
down projection also combines (moe_forward(combine_in_gemm=True)); "mok 1-MLP" runs both
grouped GEMMs in one launch (one_launch_mlp=True), "mok 1-MLP+c" the combine in it too (2
launches with the schedule), "mok 1-launch" the schedule in it as well (one_launch=True: one
launch, plus 2 for a shared expert; "mok 1L shared-in": one, the shared expert in it). With ``--backward`` each path runs
forward + backward (MoK: moe_forward(save_for_backward=True) + moe_backward; PyTorch:
autograd through the same path, gradients of x, router weights and all weights), counted
as 3x the forward's FLOPs, against the dense GEMM at 3x its FLOPs; "main_grad fused" adds the
weight gradients into fp32 main_grad buffers inside the backward (moe_backward(main_grads=...)),
"main_grad add" takes bf16 gradients and adds them afterwards, as a loop without it would;
"mok mxfp8 h" keeps h in MXFP8 between forward and backward (mok/saved_mxfp8.py: other bits, so
it is left out of the same-bits check).

Each path is timed alone at its own steady state (``--sustained S``, mok.bench.time_ms_sustained),
with the SM clock, power and temperature it ran at: an H200 under these loads sits at its 700 W
limit, and a path that draws less keeps a higher clock on its own. Timed in turn instead
(``--sustained 0``), the paths share clocks, which flatters the power-hungry ones
(docs/notes/timing-method.md: at dsv3-e128 PyTorch's path took 9.06 ms alone, 10.15 amid MoK's).
The current figures are in perf/RESULTS.md.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from mok.fused_backward import moe_backward
from mok.bench import format_gpu, smi_command, time_ms_interleaved, time_ms_sustained
from mok.fused_forward import moe_forward
from mok.saved_mxfp8 import pack_saved

CONFIGS = {
    # name: (T, H, I, E, k, shared I_s, routing)
    "dsv3": (4096, 7168, 2048, 32, 8, None, "uniform"),
    "qwen3": (8192, 2048, 768, 64, 8, None, "uniform"),
    "dsv3-zipf": (4096, 7168, 2048, 32, 8, None, "zipf"),
    "dsv3-e128": (4096, 7168, 2048, 128, 8, None, "uniform"),  # one EP=2 rank's expert work (bench_ep's dsv3)
    "dsv3-shared": (4096, 7168, 2048, 32, 8, 2048, "uniform"),  # with DeepSeek-V3's shared expert
    "qwen3-small": (256, 2048, 768, 64, 8, None, "uniform"),  # few tokens: launch-bound
}


def make_inputs(T, H, I, E, k, shared_inter, routing, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    if routing == "uniform":
        idx = torch.rand(T, E, device="cuda", generator=g).topk(k, dim=1).indices.int()
    else:
        p = 1.0 / torch.arange(1, E + 1, device="cuda", dtype=torch.float32)
        idx = torch.multinomial(p.expand(T, -1), k, replacement=False, generator=g).int()
    w = torch.softmax(torch.randn(T, k, device="cuda", generator=g), dim=1)
    wg = (torch.randn(E, I, H, device="cuda", generator=g) * H**-0.5).bfloat16()
    wu = (torch.randn(E, I, H, device="cuda", generator=g) * H**-0.5).bfloat16()
    wd = (torch.randn(E, H, I, device="cuda", generator=g) * I**-0.5).bfloat16()
    shared = None
    if shared_inter:
        shared = tuple(
            (torch.randn(*shape, device="cuda", generator=g) * shape[1] ** -0.5).bfloat16()
            for shape in ((shared_inter, H), (shared_inter, H), (H, shared_inter))
        )
    return x, idx, w, (wg, wu, wd), shared


def stacked_inputs(inputs):
    """The inputs with each projection's routed and shared weights in one [E + 1, ...] buffer (the
    shared expert last, as mok.MoELayer allocates them), or None without a shared expert of the
    routed experts' shapes: MoK then runs the shared expert in the routed launches."""
    x, idx, w, experts, shared = inputs
    if shared is None or shared[0].shape != experts[0].shape[1:]:
        return None
    bufs = [torch.cat([routed, one[None]]) for routed, one in zip(experts, shared)]
    return x, idx, w, tuple(b[:-1] for b in bufs), tuple(b[-1] for b in bufs)


def torch_forward(x, idx, w, experts, shared):
    """The plain PyTorch path: sort by expert, grouped GEMMs, SwiGLU, weight, index_add."""
    wg, wu, wd = experts
    T, k = idx.shape
    flat = idx.flatten().long()
    order = flat.argsort(stable=True)
    offs = expert_offsets(flat, wg.shape[0])
    tok = order // k
    xs = x[tok]
    a = F.silu(torch._grouped_mm(xs, wg.transpose(1, 2), offs=offs)) * torch._grouped_mm(xs, wu.transpose(1, 2), offs=offs)
    y = torch._grouped_mm(a, wd.transpose(1, 2), offs=offs)
    out = torch.zeros(T, x.shape[1], device=x.device, dtype=torch.float32)
    if shared is not None:
        out += (F.silu(x @ shared[0].T) * (x @ shared[1].T)) @ shared[2].T
    out.index_add_(0, tok, y * w.flatten()[order, None])  # (bf16 y times fp32 weights: fp32, one pass)
    return out.bfloat16()


def expert_offsets(flat: torch.Tensor, num_experts: int) -> torch.Tensor:
    """End row of each expert's sorted rows (torch._grouped_mm's offs), without a host sync
    (torch.bincount on CUDA reads the ids' range back to the host)."""
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).index_add_(0, flat, torch.ones_like(flat))
    return counts.cumsum(0).int()


def mok_train_step(inputs, dout, main_grads=None, mxfp8_h=False, **forward):
    """MoK forward (keeping h; ``forward``: moe_forward's options) and backward: all gradients
    (``main_grads``: fp32 buffers the weight gradients are added into, in the backward's GEMMs;
    ``mxfp8_h``: h kept packed in MXFP8 between the two, mok/saved_mxfp8.py)."""
    x, idx, w, experts, shared = inputs
    saved = moe_forward(x, idx, w, *experts, shared, check_routing=False, save_for_backward=True, **forward)
    if mxfp8_h:
        saved = pack_saved(saved)
    return moe_backward(dout, x, idx, w, *experts, shared, saved, main_grads=main_grads)


def mok_train_step_then_add(inputs, dout, main_grads):
    """What a training loop without the fused accumulation does: bf16 weight gradients, then an
    add of each into its fp32 main_grad."""
    grads = mok_train_step(inputs, dout)
    for buffer, grad in zip(main_grads, (grads.d_w_gate, grads.d_w_up, grads.d_w_down, *(grads.d_shared or ()))):
        buffer.add_(grad)
    return grads


def torch_train_step(inputs, dout):
    """The PyTorch path's forward and autograd backward: gradients of x, router weights and weights."""
    x, idx, w, experts, shared = inputs
    leaves = [t.detach().requires_grad_() for t in (x, w, *experts, *(shared or ()))]
    xl, wl, wg, wu, wd, *sh = leaves
    out = torch_forward(xl, idx, wl, (wg, wu, wd), tuple(sh) if sh else None)
    return torch.autograd.grad(out, leaves, dout)


def graph_of(fn):
    """fn captured once in a CUDA graph after one eager call (with expert parallelism every rank
    makes it together); the returned callable replays it (no host launch work) and returns what
    fn returned during the capture (the graph's output tensors, rewritten by each replay)."""
    fn()  # compile and load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay():
        graph.replay()
        return out

    return replay


def gpu_state() -> str:
    """The GPU's SM clock, power draw and temperature now (nvidia-smi), or "" where it cannot say:
    printed after the timing, it tells how far power and heat held the clock down (an H200 at
    sustained bf16 load ran at ~1.45 GHz, not 1.98)."""
    import subprocess

    try:
        command = smi_command("clocks.sm,clocks.max.sm,power.draw,temperature.gpu", torch.cuda.current_device())
        line = subprocess.run(command, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return f"SM clock, max, power, temperature just after: {line}" if line else ""


def same_bits(a, b) -> bool:
    """Whether two results (tensors, or tuples of them and None, as Gradients) are bitwise equal."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b))
    return a is None and b is None


def profiled(fn, calls: int = 1):
    """torch.profiler's record (CUDA activity) of ``calls`` back-to-back calls of fn, after one warm-up
    call (with expert parallelism every rank must call it together: the paths synchronise with their peers)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof


def device_events(prof) -> list:
    """The record's events that ran on the GPU (kernels, copies, fills)."""
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def count_launches(fn) -> int:
    """CUDA kernels launched by one call of fn (after warm-up)."""
    return sum(1 for e in device_events(profiled(fn)) if "Memcpy" not in e.name and "Memset" not in e.name)


def kernel_times(fn, top: int = 6) -> list[tuple[str, float, int]]:
    """(kernel, device ms, calls) of one call of fn, the most expensive first."""
    rows = [(e.key, e.device_time_total / 1e3, e.count) for e in profiled(fn).key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])[:top]


def kernel_sequence(fn) -> list[tuple[str, float]]:
    """(kernel, device ms) of every launch of one call of fn, in launch order (variants of one
    kernel class share a name: the order tells them apart)."""
    kernels = sorted(device_events(profiled(fn)), key=lambda e: e.time_range.start)
    return [(e.name, (e.time_range.end - e.time_range.start) / 1e3) for e in kernels]


def device_span(fn, calls: int = 5) -> tuple[float, float]:
    """(kernel-busy ms, first-start-to-last-end ms) per call over ``calls`` back-to-back calls:
    their difference is the device time between kernels (launch gaps, tails)."""
    kernels = device_events(profiled(fn, calls))
    busy = sum(e.time_range.end - e.time_range.start for e in kernels)
    span = max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)
    return busy / calls / 1e3, span / calls / 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="dsv3,qwen3,dsv3-zipf,qwen3-small")
    parser.add_argument("--backward", action="store_true", help="time forward + backward")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (one process per GPU)")
    parser.add_argument(
        "--sustained", type=float, default=3.0, metavar="S",
        help="each path alone at its own steady state: S s of calls, then S s timed, with its mean SM clock, power and "
        "temperature (default 3; nvidia-smi's power reading is averaged over about a second, so shorter windows can misread it); "
        "0: the paths timed in turn instead (mok.bench.time_ms_interleaved)",
    )
    parser.add_argument("--paths", default="", help="MoK paths to time, comma-separated (default: all; torch and dense always)")
    parser.add_argument("--profile", type=int, default=0, help="print (rank 0's) N most expensive kernels; at EP 1 every launch of one call in order")
    parser.add_argument("--profile-paths", default="mok", help="at EP 1: the paths whose kernels are printed, comma-separated (default: mok)")
    parser.add_argument(
        "--share-gpu", action="store_true",
        help="with --ep N: all N processes on GPU 0 over gloo, MoK's paths only (a smoke run of the EP benchmark on one GPU; "
        "its times mean nothing)",
    )
    args = parser.parse_args()
    if args.share_gpu and args.ep < 2:
        parser.error("--share-gpu: only with --ep 2 or more")
    if args.ep > 1:
        from bench_ep import CONFIGS as EP_CONFIGS, run

        names = args.configs.split(",") if args.configs != parser.get_default("configs") else list(EP_CONFIGS)
        return run(args.ep, names, backward=args.backward, profile_top=args.profile, sustained=args.sustained, share_gpu=args.share_gpu)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    header = f"{'config':<12}{'path':<17}{'ms':>9}{'TFLOP/s':>9}{'vs torch':>9}{'of dense':>9}{'launches':>9}"
    if args.sustained:
        header += f"{'MHz':>7}{'W':>6}{'C':>4}"
    print(header)
    for name in args.configs.split(","):
        T, H, I, E, k, s_inter, routing = CONFIGS[name]
        inputs = make_inputs(T, H, I, E, k, s_inter, routing)
        stacked = stacked_inputs(inputs)
        flops = 6 * T * k * H * I + (6 * T * H * s_inter if s_inter else 0)
        dense_a = torch.randn(T * k, H, device="cuda").bfloat16()
        dense_b = torch.randn(H, 3 * I + (3 * s_inter // k if s_inter else 0), device="cuda").bfloat16()
        if args.backward:
            flops *= 3  # backward: dx and dW, twice the forward's products
            dout = torch.randn(T, H, device="cuda").bfloat16()
            paths = {
                "mok": lambda: mok_train_step(inputs, dout),
                "mok (graph)": graph_of(lambda: mok_train_step(inputs, dout)),
                "mok gather": lambda: mok_train_step(inputs, dout, gather_first=True),
                "torch": lambda: torch_train_step(inputs, dout),
                "dense gemm": lambda: [dense_a @ dense_b for _ in range(3)],
            }
            if stacked is not None:
                paths["mok shared-in"] = lambda: mok_train_step(stacked, dout)
            main_grads = tuple(torch.zeros(t.shape, device="cuda") for t in (*inputs[3], *(inputs[4] or ())))
            paths["main_grad add"] = lambda: mok_train_step_then_add(inputs, dout, main_grads)
            paths["main_grad fused"] = lambda: mok_train_step(inputs, dout, main_grads=main_grads)
            paths["mok mxfp8 h"] = lambda: mok_train_step(inputs, dout, mxfp8_h=True)
        else:
            paths = {
                "mok": lambda: moe_forward(*inputs[:3], *inputs[3], inputs[4], check_routing=False).out,
                "mok (graph)": graph_of(lambda: moe_forward(*inputs[:3], *inputs[3], inputs[4], check_routing=False).out),
                "mok 3-launch": lambda: moe_forward(*inputs[:3], *inputs[3], inputs[4], check_routing=False, combine_in_gemm=True).out,
                "mok gather": lambda: moe_forward(*inputs[:3], *inputs[3], inputs[4], check_routing=False, gather_first=True).out,
                "mok 1-MLP": lambda: moe_forward(*inputs[:3], *inputs[3], inputs[4], check_routing=False, one_launch_mlp=True).out,
                "mok 1-MLP+c": lambda: moe_forward(
                    *inputs[:3], *inputs[3], inputs[4], check_routing=False, one_launch_mlp=True, combine_in_gemm=True
                ).out,
                "mok 1-launch": lambda: moe_forward(*inputs[:3], *inputs[3], inputs[4], check_routing=False, one_launch=True).out,
                "mok 1L gather": lambda: moe_forward(
                    *inputs[:3], *inputs[3], inputs[4], check_routing=False, one_launch=True, gather_first=True
                ).out,
                "torch": lambda: torch_forward(*inputs),
                "dense gemm": lambda: dense_a @ dense_b,
            }
            if stacked is not None:  # the shared expert in the routed launches (four, or one)
                paths["mok shared-in"] = lambda: moe_forward(*stacked[:3], *stacked[3], stacked[4], check_routing=False).out
                paths["mok 1L shared-in"] = lambda: moe_forward(
                    *stacked[:3], *stacked[3], stacked[4], check_routing=False, one_launch=True
                ).out
        if args.paths:
            keep = {"mok", "torch", "dense gemm", *args.paths.split(",")}  # (the default path: the others' bits are checked against it)
            unknown = keep - set(paths)
            if unknown:
                raise SystemExit(f"--paths: no path(s) {sorted(unknown)}; known: {list(paths)}")
            paths = {p: fn for p, fn in paths.items() if p in keep}
        unprofiled = set(args.profile_paths.split(",")) - set(paths)
        if unprofiled:
            raise SystemExit(f"--profile-paths: no timed path(s) {sorted(unprofiled)} (name them in --paths too); timed: {list(paths)}")
        state = {p: "" for p in paths}
        if args.sustained:  # each path alone at the clock its own power draw allows
            ms = {}
            for p, fn in paths.items():
                ms[p], gpu = time_ms_sustained(fn, args.sustained)
                state[p] = format_gpu(gpu)
        else:
            ms = time_ms_interleaved(paths, batch=5, repeats=10)  # (in turn: every path sees the same clock drift)
        launches = {p: count_launches(fn) for p, fn in paths.items()}
        mok_result = paths["mok"]()
        same = {p: same_bits(paths[p](), mok_result) for p in paths if p.startswith("mok ") and p != "mok mxfp8 h"}  # MoK's ways: the same bits
        mok_out, torch_out = mok_result, paths["torch"]()
        if args.backward:  # compare dx
            mok_out, torch_out = mok_out.dx, torch_out[0]
        agree = float((mok_out.float() - torch_out.float()).norm() / torch_out.float().norm())
        for p in paths:
            tflops = flops / ms[p] / 1e9
            ratios = f"{ms['torch'] / ms[p]:>8.2f}x{ms['dense gemm'] / ms[p] * 100:>8.0f}%"
            print(f"{name:<12}{p:<17}{ms[p]:>9.3f}{tflops:>9.0f}{ratios}{launches[p]:>9}{state[p]}")
        print(f"{name:<12}mok vs torch {'dx' if args.backward else 'output'}: relative difference {agree:.2e}")
        print(f"{name:<12}every other MoK path gives the default path's bits: {same}")
        print(f"{name:<12}{gpu_state()}")
        for p in [p for p in ("mok", "mok (graph)") if p in paths]:
            busy, span = device_span(paths[p])
            print(f"{name:<12}{p} on the device: kernels {busy:.3f} ms of {span:.3f} ms per call (5 back to back)")
        for p in args.profile_paths.split(","):
            print(f"{name:<12}{p}: kernels")
            if args.profile:
                for kernel, ms_k in kernel_sequence(paths[p])[: args.profile]:
                    print(f"{'':<11}  {ms_k:8.3f} ms  {kernel[:100]}")
            else:
                for kernel, ms_k, _ in kernel_times(paths[p], top=12 if args.backward else 6):
                    print(f"{'':<11}  {ms_k:8.3f} ms  {kernel[:90]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
