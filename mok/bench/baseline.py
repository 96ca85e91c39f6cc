"""The PyTorch baseline MoK is measured against, and the profiling helpers the layer benchmarks share.

The baseline is the MoE layer as users write it in PyTorch: rows sorted by expert,
``torch._grouped_mm`` for gate/up and down, SwiGLU, weighting and an ``index_add_`` combine
(autograd for the backward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .timing import smi_command

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


def kernel_sequence(fn, calls: int = 1) -> list[tuple[str, float]]:
    """(kernel, device ms) of every launch of one call of fn, in launch order (variants of one
    kernel class share a name: the order tells them apart); each launch's mean over ``calls``
    back-to-back calls, which launch the same sequence."""
    kernels = sorted(device_events(profiled(fn, calls)), key=lambda e: e.time_range.start)
    per_call = len(kernels) // calls
    return [(kernels[i].name, sum(kernels[c * per_call + i].time_range.end - kernels[c * per_call + i].time_range.start
                                  for c in range(calls)) / calls / 1e3) for i in range(per_call)]


def device_span(fn, calls: int = 5) -> tuple[float, float]:
    """(kernel-busy ms, first-start-to-last-end ms) per call over ``calls`` back-to-back calls:
    their difference is the device time between kernels (launch gaps, tails)."""
    kernels = device_events(profiled(fn, calls))
    busy = sum(e.time_range.end - e.time_range.start for e in kernels)
    span = max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)
    return busy / calls / 1e3, span / calls / 1e3


def torch_train_step(inputs, dout):
    """The PyTorch path's forward and autograd backward: gradients of x, router weights and weights."""
    x, idx, w, experts, shared = inputs
    leaves = [t.detach().requires_grad_() for t in (x, w, *experts, *(shared or ()))]
    xl, wl, wg, wu, wd, *sh = leaves
    out = torch_forward(xl, idx, wl, (wg, wu, wd), tuple(sh) if sh else None)
    return torch.autograd.grad(out, leaves, dout)
