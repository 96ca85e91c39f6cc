"""Timers for benchmarks: steady state (each path alone, with the GPU's clock, power and
temperature it ran at), in turn, per batch, and host time per call."""

from __future__ import annotations

import statistics
import time

import torch

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
