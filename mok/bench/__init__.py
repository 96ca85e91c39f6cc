"""Benchmark tools and ``python -m mok bench``.

    timing     timers: steady state (each path alone, with the GPU's clock, power and temperature),
               in turn, per batch; host time per call
    baseline   the PyTorch layer MoK is measured against; profiling helpers the benchmarks share
    layer      ``mok bench``: the layer at model presets against the baseline and a dense GEMM
               (docs/benchmarking.md); ``--kernel combine``

The developers' benchmarks, with more paths and options, are perf/bench_layer.py (one GPU),
perf/bench_ep.py (expert parallel), perf/bench_router.py and perf/gemm_sweep.py.
"""

from .baseline import (
    count_launches, device_events, device_span, expert_offsets, gpu_state, graph_of, kernel_sequence, kernel_times, profiled,
    same_bits, torch_forward, torch_train_step,
)
from .layer import (
    AGREEMENT_TOLERANCE, FORWARD, PASSES, PATHS, PRESET_NOTES, PRESETS, TRAIN, Shape, dense_flops, dense_shape, format_table,
    layer_inputs, load_records, pass_records, plot_records, run_benchmarks, run_layer_benchmarks, torch_callables, write_records,
)
from .timing import (
    GpuSampler, batch_ms, format_gpu, host_profile, host_us, parse_samples, smi_command, time_ms, time_ms_interleaved,
    time_ms_sustained,
)

__all__ = [
    "AGREEMENT_TOLERANCE",
    "FORWARD",
    "GpuSampler",
    "PASSES",
    "PATHS",
    "PRESETS",
    "PRESET_NOTES",
    "Shape",
    "TRAIN",
    "batch_ms",
    "count_launches",
    "dense_flops",
    "dense_shape",
    "device_events",
    "device_span",
    "expert_offsets",
    "format_gpu",
    "format_table",
    "gpu_state",
    "graph_of",
    "host_profile",
    "host_us",
    "kernel_sequence",
    "kernel_times",
    "layer_inputs",
    "load_records",
    "parse_samples",
    "pass_records",
    "plot_records",
    "profiled",
    "run_benchmarks",
    "run_layer_benchmarks",
    "same_bits",
    "smi_command",
    "time_ms",
    "time_ms_interleaved",
    "time_ms_sustained",
    "torch_callables",
    "torch_forward",
    "torch_train_step",
    "write_records",
]
