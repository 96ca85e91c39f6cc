"""``python -m mok bench``: the MoE layer at model presets, MoK against PyTorch and a dense GEMM.

Forward and forward + backward, MoK (``mok.forward`` / ``mok.backward``) against the PyTorch
baseline (mok.bench.baseline) and a dense bf16 GEMM of the same FLOPs, each path alone at its own
steady state (mok.bench.timing.time_ms_sustained); a table (:func:`format_table`), optionally JSON
records and a bar chart (:func:`plot_records`): docs/benchmarking.md. ``--kernel combine`` times
the combine kernel (memory-bound) against the same math in eager PyTorch and a device-to-device
copy of the same bytes.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import sys
import textwrap
import time
from dataclasses import asdict, dataclass

import torch

from .baseline import torch_forward, torch_train_step
from .timing import host_us, time_ms, time_ms_sustained

FORWARD, TRAIN = "forward", "forward+backward"
PASSES = (FORWARD, TRAIN)
PASS_ALIASES = {"fwd": FORWARD, "train": TRAIN, "backward": TRAIN, "fwd+bwd": TRAIN}
PATHS = ("mok", "torch", "dense")  # MoK's fused layer, the PyTorch path (torch_forward), one dense bf16 GEMM of the same FLOPs
AGREEMENT_TOLERANCE = 3e-2  # mok vs torch, relative difference (both bf16 between GEMMs): above it something is wrong
FP8_AGREEMENT_TOLERANCE = 1e-1  # the same with MoK's GEMMs on FP8 operands (E4M3 keeps 3 mantissa bits: ~6% from bf16)


def agreement_tolerance(precision: str) -> float:
    """The largest relative difference from the bf16 PyTorch path that MoK's result of ``precision`` may show."""
    return AGREEMENT_TOLERANCE if precision == "bf16" else FP8_AGREEMENT_TOLERANCE


@dataclass(frozen=True)
class Shape:
    """One MoE layer on one GPU as ``mok bench`` runs it: ``tokens`` on the GPU, ``experts`` on the
    GPU (all of them at EP = 1), ``topk`` of them per token, SwiGLU experts of width
    ``intermediate`` and an optional shared expert of width ``shared_intermediate`` (None: none);
    ``precision``: MoK's expert GEMMs' (MoKConfig.precision; the PyTorch path and the dense GEMM
    stay bf16); ``wgrad_format``: their weight gradients' (MoKConfig.wgrad_format; None: the
    precision's own)."""

    model: str
    tokens: int
    hidden: int
    intermediate: int
    experts: int
    topk: int
    shared_intermediate: int | None = None
    precision: str = "bf16"
    wgrad_format: str | None = None

    def forward_flops(self) -> int:
        """6·T·k·H·I (gate, up and down GEMMs of every routed pair) + 6·T·H·I_s (the shared expert)."""
        shared = 6 * self.tokens * self.hidden * self.shared_intermediate if self.shared_intermediate else 0
        return 6 * self.tokens * self.topk * self.hidden * self.intermediate + shared

    def flops(self, pass_: str) -> int:
        """The FLOPs of one call of ``pass_``: the backward's products (dx and the weight gradients) twice the forward's."""
        return self.forward_flops() * (3 if pass_ == TRAIN else 1)

    def config(self, **options):
        """The layer's MoKConfig (one GPU), with ``options``."""
        from ..config import MoKConfig

        options = {"precision": self.precision, "wgrad_format": self.wgrad_format, **options}
        return MoKConfig(self.hidden, self.intermediate, self.experts, self.topk, self.shared_intermediate, **options)

    def check(self, tiled: bool = True) -> None:
        """ValueError for a shape MoK's layer does not take: MoKConfig's rules, and (``tiled``) the
        widths the fused kernels take where the benchmark runs them (mok.config.width_rule)."""
        from ..config import width_rule
        from ..plan import check_tiled_widths

        if self.tokens < 1:
            raise ValueError(f"{self.model}: expected at least one token, got {self.tokens}")
        config = self.config()
        if tiled:
            shared = {"shared_intermediate": self.shared_intermediate} if self.shared_intermediate else {}
            widths = {"hidden": self.hidden, "intermediate": self.intermediate, **shared}
            check_tiled_widths(self.model, widths, width_rule(config))

    def describe(self) -> str:
        shared = f"shared expert I_s {self.shared_intermediate}" if self.shared_intermediate else "no shared expert"
        precision = "" if self.precision == "bf16" else f", MoK's expert GEMMs {self.precision}"
        if self.wgrad_format is not None:
            precision += f", weight gradients {self.wgrad_format}"
        return (f"{self.tokens} tokens, H {self.hidden}, I {self.intermediate}, {self.experts} experts on the GPU, top-{self.topk}, "
                f"{shared}{precision}; {self.forward_flops() / 1e12:.2f} TFLOP a forward")


# Per model, the one-GPU shape a user runs: H, the routed experts' width I (moe_intermediate_size), the
# experts on the GPU, top-k, the shared expert's width (all shared experts together) and tokens on the
# GPU: 4096 for the models of H >= 4096, 8192 for the H = 2048 ones (smaller activations per token).
# gpt-oss's H = I = 2880 is not a multiple of the 128-wide tile: its last tiles are partial (Hopper).
PRESETS: dict[str, Shape] = {
    "deepseek-v3": Shape("deepseek-v3", 4096, 7168, 2048, 32, 8, 2048),
    "deepseek-v2-lite": Shape("deepseek-v2-lite", 8192, 2048, 1408, 64, 6, 2816),
    "qwen3-30b-a3b": Shape("qwen3-30b-a3b", 8192, 2048, 768, 128, 8),
    "qwen3-235b-a22b": Shape("qwen3-235b-a22b", 4096, 4096, 1536, 128, 8),
    "qwen1.5-moe-a2.7b": Shape("qwen1.5-moe-a2.7b", 8192, 2048, 1408, 60, 4, 5632),
    "mixtral-8x7b": Shape("mixtral-8x7b", 4096, 4096, 14336, 8, 2),
    "mixtral-8x22b": Shape("mixtral-8x22b", 4096, 6144, 16384, 8, 2),
    "olmoe-1b-7b": Shape("olmoe-1b-7b", 8192, 2048, 1024, 64, 8),
    "gpt-oss-20b": Shape("gpt-oss-20b", 4096, 2880, 2880, 32, 4),
    "gpt-oss-120b": Shape("gpt-oss-120b", 4096, 2880, 2880, 128, 4),
}
PRESET_NOTES: dict[str, str] = {
    "deepseek-v3": "32 of its 256 routed experts: one EP = 8 rank's share (that rank's expert work at T tokens a rank); 1 shared expert",
    "deepseek-v2-lite": "all 64 routed experts; 2 shared experts of 1408 as one of 2816",
    "qwen3-30b-a3b": "all 128 experts",
    "qwen3-235b-a22b": "all 128 experts (a rank at EP = W holds 128/W: --experts)",
    "qwen1.5-moe-a2.7b": "Hugging Face's Qwen2-MoE architecture; all 60 experts; its shared expert (sigmoid-gated there) at unit weight",
    "mixtral-8x7b": "all 8 experts",
    "mixtral-8x22b": "all 8 experts",
    "olmoe-1b-7b": "all 64 experts",
    "gpt-oss-20b": "all 32 experts; MoK's SwiGLU without gpt-oss's expert biases and clamp (the same GEMM FLOPs)",
    "gpt-oss-120b": "all 128 experts; as gpt-oss-20b",
}
DEFAULT_MODEL = "deepseek-v3"


def parse_models(text: str) -> list[str]:
    """Comma-separated preset names, or "all" (every preset); ValueError naming the presets for an unknown one."""
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        return list(PRESETS)
    unknown = [n for n in names if n not in PRESETS]
    if unknown or not names:
        raise ValueError(f"unknown model preset(s) {unknown or [text]}; known: {', '.join(PRESETS)}, or all")
    return list(dict.fromkeys(names))


def parse_choices(text: str, known: tuple, aliases: dict | None = None, what: str = "value") -> list[str]:
    """Comma-separated names out of ``known`` (``aliases`` map other spellings), in ``known``'s order."""
    aliases = aliases or {}
    names = [aliases.get(n.strip().lower(), n.strip().lower()) for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"unknown {what}(s) {unknown or [text]}; known: {', '.join(known)}")
    return [n for n in known if n in names]


def resolve_shapes(
    models: list[str] | None = None, *, tokens: int | None = None, hidden: int | None = None, intermediate: int | None = None,
    experts: int | None = None, topk: int | None = None, shared_intermediate: int | None = None, tiled: bool = True,
    precisions: tuple = ("bf16",), wgrad_format: str | None = None,
) -> list[Shape]:
    """The shapes to run: each preset of ``models`` with the given values in place of its own; without
    ``models``, a shape of one's own when any of hidden, intermediate, experts, topk is given (then all
    four are needed; 4096 tokens unless given; ``shared_intermediate`` 0 or None: no shared expert),
    else the default preset (deepseek-v3); each once per precision of ``precisions`` (MoK's expert
    GEMMs'), with ``wgrad_format`` (their weight gradients', where it goes with the precision: the
    bf16 row of an FP8 run keeps bf16's). Each is checked (:meth:`Shape.check`)."""
    from ..config import PRECISIONS, WGRAD_PRECISIONS

    widths = {"hidden": hidden, "intermediate": intermediate, "experts": experts, "topk": topk}
    if models is None and any(v is not None for v in widths.values()):
        missing = [f"--{name}" for name, value in widths.items() if value is None]
        if missing:
            raise ValueError(f"a shape of one's own needs --hidden, --intermediate, --experts and --topk (missing {', '.join(missing)}); "
                             f"or --model PRESET, whose values these then replace")
        shapes = [Shape("custom", tokens or 4096, hidden, intermediate, experts, topk, shared_intermediate or None)]
    else:
        given = {"tokens": tokens, **widths, "shared_intermediate": shared_intermediate}
        given = {name: value for name, value in given.items() if value is not None}
        if "shared_intermediate" in given:
            given["shared_intermediate"] = given["shared_intermediate"] or None
        shapes = [Shape(**{**asdict(PRESETS[name]), **given}) for name in (models or [DEFAULT_MODEL])]
    takes_wgrad = WGRAD_PRECISIONS.get(wgrad_format, PRECISIONS)  # (the precisions it goes with)
    if wgrad_format is not None and not set(precisions) & set(takes_wgrad):
        raise ValueError(f"wgrad_format={wgrad_format!r}: only with precision {' or '.join(map(repr, takes_wgrad))}, got "
                         f"{', '.join(precisions)}")
    shapes = [Shape(**{**asdict(shape), "precision": precision, "wgrad_format": wgrad_format if precision in takes_wgrad else None})
              for shape in shapes for precision in precisions]
    for shape in shapes:
        shape.check(tiled)
    return shapes


def presets_table() -> str:
    """The presets as text (``mok bench --help``)."""
    lines = [f"{'preset':<19}{'H':>6}{'I':>7}{'experts':>8}{'top-k':>6}{'shared':>7}{'tokens':>7}"]
    for name, s in PRESETS.items():
        lines.append(f"{name:<19}{s.hidden:>6}{s.intermediate:>7}{s.experts:>8}{s.topk:>6}{s.shared_intermediate or '-':>7}{s.tokens:>7}")
        lines.append(f"{'':<21}{PRESET_NOTES[name]}")
    return "\n".join(lines)


def layer_inputs(shape: Shape, device="cuda", seed: int = 0):
    """(x, topk_idx, topk_w, (w_gate, w_up, w_down), shared) of ``shape``: random bf16 x, uniform
    routing (the top-k of random scores), softmax router weights, weights scaled by 1/sqrt(fan-in) (as
    perf/bench_layer.py). A shared expert of the routed experts' width lies after them in one
    [E + 1, ...] buffer per projection, as mok.MoELayer allocates it, so that MoK runs it in the
    routed launches (the layer's default); of another width, in tensors of its own."""
    g = torch.Generator(device=device).manual_seed(seed)
    T, H, I, E, k, S = shape.tokens, shape.hidden, shape.intermediate, shape.experts, shape.topk, shape.shared_intermediate

    def weight(*dims):  # (in fp32, then rounded: the same values as perf/bench_layer.py's)
        return (torch.randn(*dims, device=device, generator=g) * dims[-1] ** -0.5).bfloat16()

    x = torch.randn(T, H, device=device, generator=g).bfloat16()
    idx = torch.rand(T, E, device=device, generator=g).topk(k, dim=1).indices.int()
    w = torch.softmax(torch.randn(T, k, device=device, generator=g), dim=1)
    if S is not None and S == I:
        buffers = (weight(E + 1, I, H), weight(E + 1, I, H), weight(E + 1, H, I))
        return x, idx, w, tuple(b[:-1] for b in buffers), tuple(b[-1] for b in buffers)
    experts = (weight(E, I, H), weight(E, I, H), weight(E, H, I))
    shared = (weight(S, H), weight(S, H), weight(H, S)) if S else None
    return x, idx, w, experts, shared


def dense_shape(shape: Shape) -> tuple[int, int, int]:
    """(M, K, N) of the dense bf16 GEMM of the layer's forward FLOPs: [T·k, H] · [H, 3I + 3I_s/k] (as perf/bench_layer.py)."""
    shared = round(3 * shape.shared_intermediate / shape.topk) if shape.shared_intermediate else 0
    return shape.tokens * shape.topk, shape.hidden, 3 * shape.intermediate + shared


def dense_flops(shape: Shape, pass_: str) -> int:
    """The dense GEMM's FLOPs (one GEMM a forward, three for forward + backward)."""
    m, k, n = dense_shape(shape)
    return 2 * m * k * n * (3 if pass_ == TRAIN else 1)


def mok_callables(shape: Shape, inputs, dout) -> dict:
    """{pass: callable} of MoK's layer (``mok.forward`` without keeping anything; ``mok.forward`` +
    ``mok.backward``, every gradient), routing not range-checked (no host read)."""
    from .. import api

    config = shape.config()
    x, idx, w, experts, shared = inputs

    def forward():
        return api.forward(config, None, x, idx, w, *experts, shared, save_for_backward=False, check_routing=False)[0]

    def train():
        _, ctx = api.forward(config, None, x, idx, w, *experts, shared, check_routing=False)
        return api.backward(config, None, ctx, dout)

    return {FORWARD: forward, TRAIN: train}


def torch_callables(inputs, dout) -> dict:
    """{pass: callable} of the PyTorch path (:func:`torch_forward`; :func:`torch_train_step`: autograd, every gradient)."""
    return {FORWARD: lambda: torch_forward(*inputs), TRAIN: lambda: torch_train_step(inputs, dout)}


def dense_callables(shape: Shape, device="cuda", seed: int = 1) -> dict:
    """{pass: callable} of the dense ceiling: one bf16 GEMM of the forward's FLOPs (:func:`dense_shape`), three for forward + backward."""
    g = torch.Generator(device=device).manual_seed(seed)
    m, k, n = dense_shape(shape)
    a = torch.randn(m, k, device=device, generator=g).bfloat16()
    b = torch.randn(k, n, device=device, generator=g).bfloat16()
    return {FORWARD: lambda: a @ b, TRAIN: lambda: [a @ b for _ in range(3)]}


GRADIENT_NAMES = ("dx", "d_topk_w", "d_w_gate", "d_w_up", "d_w_down", "d_shared_gate", "d_shared_up", "d_shared_down")


def named_results(result) -> dict:
    """A path's result as {name: tensor}: a forward's output; MoK's Gradients; the PyTorch path's
    autograd gradients (x, router weights, gate, up, down, then the shared expert's)."""
    if isinstance(result, torch.Tensor):
        return {"output": result}
    if hasattr(result, "_fields"):  # (mok.reference_backward.Gradients)
        tensors = [result.dx, result.d_topk_w, result.d_w_gate, result.d_w_up, result.d_w_down, *(result.d_shared or ())]
    else:
        tensors = list(result)
    return {name: t for name, t in zip(GRADIENT_NAMES, tensors) if t is not None}


def relative_differences(got, want) -> dict:
    """{name: ||got - want|| / ||want||} over the results both have (:func:`named_results`)."""
    got, want = named_results(got), named_results(want)
    diffs = {}
    for name in want:
        if name in got:
            a, b = got[name].float(), want[name].float()
            norm = float(b.norm())
            diffs[name] = float((a - b).norm()) / norm if norm else float((a - b).norm())
    return diffs


def run_meta(seconds: float, device="cuda") -> dict:
    """What every record of a run carries: the GPU, torch's and MoK's versions, the date, the timing window."""
    from .. import __version__

    gpu = torch.cuda.get_device_name() if torch.device(device).type == "cuda" else str(device)
    return {"gpu": gpu, "torch": torch.__version__, "mok": __version__,
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "seconds": seconds}


def pass_records(shape: Shape, pass_: str, ms: dict, gpu: dict | None = None, meta: dict | None = None, diffs: dict | None = None) -> list:
    """The records of one shape and pass: {model, the shape, pass, path, ms, flops, tflops, speedup
    (TFLOP/s over the torch path's; None without it), of_dense (TFLOP/s over the dense GEMM's; None
    without it), the SM clock, power and temperature it ran at (None without nvidia-smi), the run's
    meta (gpu, torch, mok, date, seconds), and on MoK's the relative differences from torch's result}.
    ``ms``: {path: ms per call}; ``gpu``: {path: GpuSampler.means()}."""
    gpu, meta = gpu or {}, meta or {}
    flops = {p: dense_flops(shape, pass_) if p == "dense" else shape.flops(pass_) for p in ms}
    tflops = {p: flops[p] / ms[p] / 1e9 for p in ms}
    records = []
    for p in [p for p in PATHS if p in ms] + [p for p in ms if p not in PATHS]:
        means = gpu.get(p) or {}
        record = {
            **asdict(shape), "pass": pass_, "path": p, "ms": ms[p], "flops": flops[p], "tflops": tflops[p],
            "speedup": tflops[p] / tflops["torch"] if "torch" in tflops else None,
            "of_dense": tflops[p] / tflops["dense"] if "dense" in tflops else None,
            "clock_mhz": means.get("clock_mhz"), "power_w": means.get("power_w"), "temp_c": means.get("temp_c"),
            **meta,
        }
        if p == "mok" and diffs is not None:
            record["rel_diff"] = diffs
        records.append(record)
    return records


SHAPE_FIELDS = ("model", "tokens", "hidden", "intermediate", "experts", "topk", "shared_intermediate", "precision", "wgrad_format")


def shape_of(record: dict) -> Shape:
    """The shape a record was taken at (records written before ``precision`` or ``wgrad_format`` existed: their defaults)."""
    return Shape(**{f: record.get(f) for f in SHAPE_FIELDS if f in record})


def format_header(record: dict) -> str:
    """The table's first lines: GPU, versions, date, how it was timed, how FLOPs are counted."""
    seconds = record.get("seconds")
    timing = f"{seconds:g} s untimed, then {seconds:g} s timed, median" if seconds else "see docs/benchmarking.md"
    return (f"# {record.get('gpu')}, torch {record.get('torch')}, mok {record.get('mok')}, {record.get('date')}\n"
            f"# each path alone at its own steady state ({timing}); TFLOP/s: 6·T·k·H·I (+ 6·T·H·I_s) a forward, 3x for "
            f"forward+backward; dense: one bf16 GEMM of those FLOPs")


COLUMNS = f"{'pass':<18}{'path':<7}{'ms':>10}{'TFLOP/s':>9}{'vs torch':>10}{'of dense':>10}{'MHz':>7}{'W':>6}"


def _cell(value, fmt: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:>{width}{fmt}}"


def format_row(r: dict) -> str:
    speedup = None if r.get("speedup") is None else f"{r['speedup']:.2f}x"
    of_dense = None if r.get("of_dense") is None else f"{r['of_dense'] * 100:.0f}%"
    return (f"{r['pass']:<18}{r['path']:<7}{_cell(r['ms'], '.3f', 10)}{_cell(r['tflops'], '.0f', 9)}{_cell(speedup, '', 10)}"
            f"{_cell(of_dense, '', 10)}{_cell(r.get('clock_mhz'), '.0f', 7)}{_cell(r.get('power_w'), '.0f', 6)}")


def format_agreement(records: list) -> str | None:
    """MoK's results against the PyTorch path's, per pass (relative differences: the forward's output;
    every gradient), with a verdict (:func:`agreement_tolerance`), or None where they were not compared."""
    lines, suspect = [], []
    precision = shape_of(records[0]).precision
    tolerance = agreement_tolerance(precision)
    for r in records:
        diffs = r.get("rel_diff")
        if r["path"] != "mok" or not diffs:
            continue
        lines.append(f"#   {r['pass']}: " + ", ".join(f"{name} {d:.1e}" for name, d in diffs.items()))
        suspect += [f"{r['pass']} {name}" for name, d in diffs.items() if not d <= tolerance]
    if not lines:
        return None
    verdict = f"SUSPECT, above {tolerance:.0e}: {', '.join(suspect)}" if suspect else f"ok, all within {tolerance:.0e}"
    between = "bf16 between the GEMMs on both sides" if precision == "bf16" else f"MoK's GEMMs {precision}, torch's bf16"
    return "\n".join([f"# mok vs torch, relative difference ({between}): {verdict}"] + lines)


def format_block(records: list) -> str:
    """One shape's lines: the shape, the column header, a row per pass and path, and the agreement line."""
    shape = shape_of(records[0])
    note = PRESET_NOTES.get(shape.model) if PRESETS.get(shape.model) == shape else None
    lines = [f"# {shape.model}: {shape.describe()}" + (f" ({note})" if note else ""), COLUMNS]
    lines += [format_row(r) for r in records]
    agreement = format_agreement(records)
    return "\n".join(lines + ([agreement] if agreement else []))


def group_by_shape(records: list) -> list[list]:
    """The records grouped by shape, in order of appearance."""
    groups: dict = {}
    for r in records:
        groups.setdefault(tuple(r.get(f) for f in SHAPE_FIELDS), []).append(r)
    return list(groups.values())


def format_table(records: list) -> str:
    """The whole table: :func:`format_header`, then a :func:`format_block` per shape."""
    if not records:
        return "(no figures)"
    return "\n\n".join([format_header(records[0])] + [format_block(group) for group in group_by_shape(records)])


def write_records(records: list, path) -> None:
    """The records as a JSON list (written whole each time: a run cut short keeps the shapes done)."""
    with open(path, "w") as f:
        json.dump(records, f, indent=1)
        f.write("\n")


def load_records(path) -> list:
    """Records written by :func:`write_records` (``mok bench --json``)."""
    with open(path) as f:
        records = json.load(f)
    if not isinstance(records, list) or not all(isinstance(r, dict) and "path" in r and "pass" in r for r in records):
        raise ValueError(f"{path}: expected a list of `mok bench --json` records")
    return records


PATH_COLORS = {"mok": "#1f77b4", "torch": "#ff7f0e", "dense": "#9e9e9e"}
PLOT_METRICS = {"tflops": "TFLOP/s", "ms": "ms per call"}


def require_matplotlib():
    """matplotlib.pyplot on the Agg backend (files, no display), or a RuntimeError that says how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--plot needs matplotlib, which is not installed: pip install 'mok[bench]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_records(records: list, path, metric: str = "tflops") -> None:
    """A grouped bar chart of the records into ``path`` (PNG, SVG, PDF: by its suffix): a panel per
    pass, a group of bars per shape, a bar per path (``metric``: "tflops" or "ms"), MoK's bars
    labelled with the speedup over the PyTorch path."""
    if metric not in PLOT_METRICS:
        raise ValueError(f"metric: expected one of {', '.join(PLOT_METRICS)}, got {metric!r}")
    if not records:
        raise ValueError("no figures to plot")
    plt = require_matplotlib()
    passes = [p for p in PASSES if any(r["pass"] == p for r in records)] + sorted({r["pass"] for r in records} - set(PASSES))
    paths = [p for p in PATHS if any(r["path"] == p for r in records)] + sorted({r["path"] for r in records} - set(PATHS))
    groups = group_by_shape(records)
    labels = [g[0]["model"] if sum(h[0]["model"] == g[0]["model"] for h in groups) == 1 else f"{g[0]['model']}\nT={g[0]['tokens']}" for g in groups]
    fig, axes = plt.subplots(1, len(passes), figsize=(max(6.0, 1.1 * len(groups) * len(passes) + 2.5), 4.8), squeeze=False)
    width = 0.8 / len(paths)
    for ax, pass_ in zip(axes[0], passes):
        for j, p in enumerate(paths):
            found = [next((r for r in g if r["pass"] == pass_ and r["path"] == p), None) for g in groups]
            values = [float("nan") if r is None else r[metric] for r in found]
            xs = [i + (j - (len(paths) - 1) / 2) * width for i in range(len(groups))]
            ax.bar(xs, values, width, label=p, color=PATH_COLORS.get(p))
            if p == "mok":
                for x, r in zip(xs, found):
                    if r is not None and r.get("speedup") is not None:
                        ax.annotate(f"{r['speedup']:.2f}x", (x, r[metric]), xytext=(0, 2), textcoords="offset points",
                                    ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(labels, rotation=30 if len(groups) > 3 else 0, ha="right" if len(groups) > 3 else "center", fontsize=8)
        ax.set_title(pass_)
        ax.set_ylabel(PLOT_METRICS[metric])
        ax.margins(y=0.12)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    first = records[0]
    title = (f"MoE layer on {first.get('gpu')}: MoK against PyTorch (torch._grouped_mm) and a dense GEMM of the same FLOPs; "
             f"torch {first.get('torch')}, mok {first.get('mok')}, {str(first.get('date'))[:10]}; labels: MoK's speedup over PyTorch")
    width_chars = int(fig.get_figwidth() * 13)  # (about what a line of 9-point text holds per inch)
    fig.suptitle("\n".join(textwrap.wrap(title, width_chars)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


class _LineHandler(logging.Handler):
    """Writes each log record's message as a line to a stream (MoK's kernel compiles, as they finish)."""

    def __init__(self, stream) -> None:
        super().__init__(logging.INFO)
        self.stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        print(f"  {record.getMessage()}", file=self.stream, flush=True)


class compile_progress:
    """A ``with`` block around the first call of MoK's path: a line before (compiling, first use),
    each kernel as it compiles (the "mok" logger's INFO records), and a line after with the time and
    what was compiled or loaded from the disk cache."""

    def __init__(self, what: str, err=None) -> None:
        self.what, self.err = what, err if err is not None else sys.stderr

    def __enter__(self) -> "compile_progress":
        from ..runtime.cache import default_cache

        self.cache = default_cache()
        self.before = (self.cache.stats.compiles, self.cache.stats.disk_loads)
        print(f"compiling MoK's kernels for {self.what} (first use; `python -m mok precompile` does it ahead of time)...",
              file=self.err, flush=True)
        self.logger = logging.getLogger("mok")
        self.level = self.logger.level
        self.handler = _LineHandler(self.err)
        self.logger.addHandler(self.handler)
        if self.logger.getEffectiveLevel() > logging.INFO:
            self.logger.setLevel(logging.INFO)
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        seconds = time.perf_counter() - self.start
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)
        compiled = self.cache.stats.compiles - self.before[0]
        loaded = self.cache.stats.disk_loads - self.before[1]
        state = "failed" if exc[0] is not None else "ready"
        print(f"MoK's kernels for {self.what}: {state} after {seconds:.1f} s ({compiled} compiled, {loaded} loaded from "
              f"{self.cache.directory})", file=self.err, flush=True)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def run_layer_benchmarks(
    shapes: list, passes=PASSES, paths=PATHS, seconds: float = 2.0, *, json_path=None, out=None, err=None, device="cuda",
    timer=None, mok_impl=None, meta: dict | None = None,
) -> tuple[list, list]:
    """``mok bench``: for each shape, on the same inputs, each pass's paths: MoK's first call (its
    kernels compile, with :class:`compile_progress`), the PyTorch path's, their results compared
    (:func:`relative_differences`: the forward's output, or every gradient), then each path timed
    alone at its own steady state (``timer(fn, seconds) -> (ms, GpuSampler means)``, default
    :func:`time_ms_sustained`). Prints each shape's block of the table to ``out`` as it is done
    (progress to ``err``) and rewrites ``json_path`` with every record so far. A shape that raises
    is reported and skipped. Returns (records, failures: "model: error" lines).
    ``mok_impl(shape, inputs, dout) -> {pass: callable}``: MoK's path (default :func:`mok_callables`)."""
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    timer = timer or time_ms_sustained
    mok_impl = mok_impl or mok_callables
    meta = meta if meta is not None else run_meta(seconds, device)
    records, failures = [], []
    print(format_header({**meta, "seconds": seconds}), file=out, flush=True)
    for shape in shapes:
        shape_records = []
        try:
            inputs = layer_inputs(shape, device)
            dout = torch.randn(shape.tokens, shape.hidden, device=device, generator=torch.Generator(device=device).manual_seed(2)).bfloat16()
            fns = {}
            if "mok" in paths:
                fns["mok"] = mok_impl(shape, inputs, dout)
            if "torch" in paths:
                fns["torch"] = torch_callables(inputs, dout)
            if "dense" in paths:
                fns["dense"] = dense_callables(shape, device)
            for pass_ in passes:
                first = {}
                if "mok" in fns:
                    with compile_progress(f"{shape.model} {pass_}", err):
                        first["mok"] = fns["mok"][pass_]()
                        _sync(device)
                if "torch" in fns:
                    first["torch"] = fns["torch"][pass_]()
                diffs = relative_differences(first["mok"], first["torch"]) if len(first) == 2 else None
                del first
                ms, gpu = {}, {}
                for p in fns:
                    print(f"{shape.model} {pass_}: timing {p} ({seconds:g} s untimed, then {seconds:g} s timed)...", file=err, flush=True)
                    ms[p], gpu[p] = timer(fns[p][pass_], seconds)
                shape_records += pass_records(shape, pass_, ms, gpu, meta, diffs)
        except Exception as error:  # (reported; the other shapes still run)
            failures.append(f"{shape.model}: {type(error).__name__}: {error}")
            print(f"error: {failures[-1]}", file=err, flush=True)
        finally:
            inputs = dout = fns = None
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()
        if shape_records:
            records += shape_records
            print("\n" + format_block(shape_records), file=out, flush=True)
            if json_path:
                write_records(records, json_path)
    return records, failures


def bench_combine(tokens: int, hidden: int, topk: int) -> list[tuple[str, float, float, float]]:
    """(name, device ms, GB/s, host µs per call) for MoK's combine, eager PyTorch, and a copy of the same bytes."""
    from ..ops import combine

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
    from ..runtime.cache import default_cache

    print(f"# {torch.cuda.get_device_name()}, combine T={tokens} H={hidden} k={topk} (bf16 y and shared, fp32 weights)")
    rows = bench_combine(tokens, hidden, topk)
    base = rows[1][1]
    print(f"{'kernel':<16}{'ms':>10}{'GB/s':>10}{'vs eager':>10}{'host us':>10}")
    for name, ms, gbs, us in rows:
        print(f"{name:<16}{ms:>10.4f}{gbs:>10.0f}{base / ms:>9.2f}x{us:>10.1f}")
    stats = default_cache().stats
    print(f"kernel cache: {stats.compiles} compiled, {stats.disk_loads} loaded from disk, {stats.memory_hits} memory hits")
    return 0
