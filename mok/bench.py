"""Benchmark tools: timers (steady state, in turn, host time), the GPU's clocks, the PyTorch
baseline MoK is measured against, and ``python -m mok bench``.

The baseline is the MoE layer as users write it in PyTorch: rows sorted by expert,
``torch._grouped_mm`` for gate/up and down, SwiGLU, weighting and an ``index_add_`` combine
(autograd for the backward). ``python -m mok bench`` times the combine kernel (memory-bound)
against the same math in eager PyTorch and a device-to-device copy of the same bytes; the layer
benchmarks are perf/bench_layer.py (one GPU) and perf/bench_ep.py (expert parallel).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F


def time_ms(fn, batch: int = 20, repeats: int = 10, warmup: int = 3) -> float:
    """Median over ``repeats`` of the mean milliseconds of ``batch`` back-to-back ``fn()`` calls.

    Timed with CUDA events around a batch, so the host's launch work overlaps the device's
    (as in a training step) instead of being counted once per call.
    """
    return time_ms_interleaved({"fn": fn}, batch, repeats, warmup)["fn"]


def time_ms_interleaved(
    fns: dict, batch: int = 5, repeats: int = 10, warmup: int = 2, *, before_batch=None, per_batch=None
) -> dict:
    """:func:`time_ms` of several callables taken in turn: each repeat times one batch of every
    callable, starting one further along each time, and each gets the median of its batches.

    A GPU's clock drifts during a long run (power and heat: an H200 at sustained bf16 load
    moved 6% between two timings of the same kernel), and timing one callable after another
    hands that drift to whichever ran later; taken in turn, all of them see the same clocks.
    ``before_batch()`` runs before each batch, untimed, and ``per_batch(ms)`` maps each batch's
    time before it is kept (with several ranks: a barrier, and the slowest rank's time).
    """
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    times: dict = {name: [] for name in names}
    for r in range(repeats):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            ms = batch_ms(fns[name], batch, before_batch)
            times[name].append(ms if per_batch is None else per_batch(ms))
    return {name: statistics.median(t) for name, t in times.items()}


def batch_ms(fn, batch: int, before_batch=None) -> float:
    """Mean milliseconds per call of ``batch`` back-to-back ``fn()`` calls, by CUDA events around
    the batch (``before_batch()`` runs first, untimed); waits for the batch to finish."""
    if before_batch is not None:
        before_batch()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(batch):
        fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / batch


def smi_command(fields: str, device: int, *, units: bool = True, period_ms: int | None = None) -> list[str]:
    """The nvidia-smi command line that reads ``fields`` (its --query-gpu names, comma-separated)
    of GPU ``device`` as CSV lines without a header (``units``: "1980 MHz", else "1980"), once,
    or every ``period_ms`` until stopped."""
    fmt = "csv,noheader" if units else "csv,noheader,nounits"
    command = ["nvidia-smi", f"--query-gpu={fields}", f"--format={fmt}", "-i", str(device)]
    return command if period_ms is None else [*command, f"-lms={period_ms}"]


class GpuSampler:
    """Samples the GPU's SM clock (MHz), power (W) and temperature (C) every ``period_ms`` from
    ``nvidia-smi`` in the background while the ``with`` block runs; ``means()`` averages them.

    An H200 under sustained bf16 load is held at its power limit: its clock then depends on
    what runs (a kernel that moves more bytes per FLOP into the SMs draws more per cycle and gets
    a lower clock), so a timing means little without the clock it ran at. Where nvidia-smi is
    missing ``means()`` is empty.
    """

    FIELDS = "clocks.sm,power.draw,temperature.gpu"

    def __init__(self, device: int | None = None, period_ms: int = 50) -> None:
        self.device = torch.cuda.current_device() if device is None else device
        self.period_ms = period_ms
        self.samples: list[tuple[float, float, float]] = []
        self._proc = None

    def __enter__(self) -> "GpuSampler":
        import subprocess

        try:
            self._proc = subprocess.Popen(
                smi_command(self.FIELDS, self.device, units=False, period_ms=self.period_ms),
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )
        except OSError:
            self._proc = None
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            out, _ = self._proc.communicate(timeout=10)
        except Exception:  # (a sampler that will not stop must not hang the benchmark)
            self._proc.kill()
            out, _ = self._proc.communicate()
        self.samples = parse_samples(out)

    def means(self) -> dict:
        """{"clock_mhz", "power_w", "temp_c", "samples"} over the block, or {} without samples."""
        if not self.samples:
            return {}
        n = len(self.samples)
        clock, power, temp = (sum(s[i] for s in self.samples) / n for i in range(3))
        return {"clock_mhz": clock, "power_w": power, "temp_c": temp, "samples": n}


def format_gpu(means: dict) -> str:
    """A :meth:`GpuSampler.means` as the benchmarks' "MHz W C" columns (widths 7, 6, 4), or ""
    without samples."""
    return f"{means['clock_mhz']:>7.0f}{means['power_w']:>6.0f}{means['temp_c']:>4.0f}" if means else ""


def parse_samples(text: str) -> list[tuple[float, float, float]]:
    """nvidia-smi's "clock, power, temperature" lines (no units) as floats; lines that do not
    parse (the last one cut short when the sampler stops, "[N/A]") are skipped."""
    samples = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            values = tuple(float(p) for p in parts)
        except ValueError:
            continue
        if len(values) == 3:
            samples.append(values)
    return samples


def time_ms_sustained(
    fn, seconds: float = 3.0, batch: int = 5, *, before_batch=None, per_batch=None, agree_done=None
) -> tuple[float, dict]:
    """fn alone under sustained load: ``seconds`` of untimed batches (the GPU settles at the clock
    its power limit allows for this fn), then batches timed for ``seconds`` more while a
    :class:`GpuSampler` runs. Returns (median ms per call, the sampler's means).

    :func:`time_ms_interleaved` gives every path the same clocks, which is fair only to paths of
    one power draw: a path that draws less (an H200 ran PyTorch's MoE path at 1.73 GHz on its
    own, MoK's at 1.44) runs slower amid power-hungry neighbours than it would on its own, and
    they run faster in its company. A user runs one path, sustained: this timer measures that.
    ``before_batch``, ``per_batch`` as in :func:`time_ms_interleaved`; ``agree_done(done) ->
    bool``: with several ranks, whether any rank's time is up (every rank then runs the same
    number of batches).
    """
    def run_for(limit: float, timed: bool) -> list[float]:
        times = []
        end = time.perf_counter() + limit
        while True:  # (at least one batch)
            ms = batch_ms(fn, batch, before_batch)
            if timed:
                times.append(ms if per_batch is None else per_batch(ms))
            done = time.perf_counter() >= end
            if (done if agree_done is None else agree_done(done)):
                return times

    run_for(seconds, timed=False)
    with GpuSampler() as sampler:
        times = run_for(seconds, timed=True)
    return statistics.median(times), sampler.means()


def host_profile(fn, calls: int):
    """cProfile statistics (pstats.Stats) of ``calls`` calls of fn, the device drained before and after."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    return pstats.Stats(prof)


def host_us(fn, calls: int = 200) -> float:
    """Host microseconds per call (argument checks, packing, launch), device left running."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def bench_combine(tokens: int, hidden: int, topk: int) -> list[tuple[str, float, float, float]]:
    """(name, device ms, GB/s, host µs per call) for MoK's combine, eager PyTorch, and a copy of the same bytes."""
    from .ops import combine

    dev = torch.device("cuda")
    y = torch.randn(tokens, topk, hidden, device=dev).bfloat16()
    w = torch.rand(tokens, topk, device=dev)
    shared = torch.randn(tokens, hidden, device=dev).bfloat16()
    out = torch.empty(tokens, hidden, device=dev, dtype=torch.bfloat16)
    moved = y.numel() * 2 + w.numel() * 4 + shared.numel() * 2 + out.numel() * 2

    def eager():
        return (shared.float() + (w[..., None] * y).sum(1)).bfloat16()  # (fp32 weights times bf16 y: fp32, one pass)

    src = torch.empty(moved // 2, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    rows = []
    for name, fn, nbytes in (
        ("mok combine", lambda: combine(y, w, shared, out=out), moved),
        ("torch eager", eager, moved),
        ("copy (ceiling)", lambda: dst.copy_(src), 2 * src.numel()),
    ):
        ms = time_ms(fn)
        rows.append((name, ms, nbytes / ms / 1e6, host_us(fn)))
    return rows


def run_benchmarks(tokens: int, hidden: int, topk: int) -> int:
    from .runtime.cache import default_cache

    print(f"# {torch.cuda.get_device_name()}, combine T={tokens} H={hidden} k={topk} (bf16 y and shared, fp32 weights)")
    rows = bench_combine(tokens, hidden, topk)
    base = rows[1][1]
    print(f"{'kernel':<16}{'ms':>10}{'GB/s':>10}{'vs eager':>10}{'host us':>10}")
    for name, ms, gbs, us in rows:
        print(f"{name:<16}{ms:>10.4f}{gbs:>10.0f}{base / ms:>9.2f}x{us:>10.1f}")
    stats = default_cache().stats
    print(f"kernel cache: {stats.compiles} compiled, {stats.disk_loads} loaded from disk, {stats.memory_hits} memory hits")
    return 0


# ----- the PyTorch baseline and what the layer benchmarks share


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


def torch_train_step(inputs, dout):
    """The PyTorch path's forward and autograd backward: gradients of x, router weights and weights."""
    x, idx, w, experts, shared = inputs
    leaves = [t.detach().requires_grad_() for t in (x, w, *experts, *(shared or ()))]
    xl, wl, wg, wu, wd, *sh = leaves
    out = torch_forward(xl, idx, wl, (wg, wu, wd), tuple(sh) if sh else None)
    return torch.autograd.grad(out, leaves, dout)
