"""Command line: ``python -m mok {bench, precompile, cache}`` (``mok`` where the package is installed).

``bench`` times the MoE layer on this GPU at model presets, MoK against the PyTorch path
(mok/bench.py, docs/benchmarking.md); ``precompile`` fills the kernel cache for a configuration
without a GPU; ``cache`` lists or clears it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from . import __version__
from .bench.layer import PASS_ALIASES, PASSES, PATHS, PLOT_METRICS, PRESETS, parse_choices, parse_models, presets_table, resolve_shapes
from .config import DEFAULT_CONFIG, DISPATCH_FORMATS, FP8_SCALES, GATE_UP_LAYOUTS, PRECISIONS, SAVED_H_FORMATS, WGRAD_FORMATS, MoKConfig
from .kernels.constants import ACTIVATIONS

NO_GPU_MESSAGE = (
    "No CUDA GPU is visible, so there is nothing to benchmark: MoK's layer runs on Hopper (sm_90a) GPUs "
    "(Blackwell, sm_100a: compile-verified, never run; opt in with MOK_UNVERIFIED_SM100=1).\nOn this machine you "
    "can compile them ahead of time: `python -m mok precompile --arch sm_90a{model}`."
)
CACHE_DIR_HELP = "cache directory (default $MOK_CACHE_DIR or ~/.cache/mok)"
SHAPE_NAMES = ("hidden", "intermediate", "experts", "topk", "shared_intermediate")


def _argument_type(parse, name: str):
    """An argparse type that calls ``parse`` and reports its ValueError as a usage error."""

    def convert(text: str):
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    convert.__name__ = name  # (argparse names the type in its messages)
    return convert


_models = _argument_type(parse_models, "model")


# ----- precompile


def _add_shape_options(p: argparse.ArgumentParser) -> None:
    """precompile's shape and layer options. A shape option left out takes the --model preset's value,
    else the default configuration's (DeepSeek-V3: :data:`mok.config.DEFAULT_CONFIG`); --ep-size left
    out: :func:`_resolve_config` picks it for the target."""
    d = DEFAULT_CONFIG
    p.add_argument("--hidden", type=int, default=None, help=f"model width H (default {d.hidden}, or the --model preset's)")
    p.add_argument("--intermediate", type=int, default=None,
                   help=f"routed-expert width I (default {d.intermediate}, or the --model preset's)")
    p.add_argument("--experts", type=int, default=None,
                   help=f"experts E over all ranks (default {d.num_experts}; {d.num_experts // d.ep_size} where --ep-size defaults to 1; "
                        "or the --model preset's)")
    p.add_argument("--topk", type=int, default=None, help=f"experts per token k (default {d.topk}, or the --model preset's)")
    p.add_argument("--shared-intermediate", type=int, default=None,
                   help=f"shared-expert width, 0 for none (default {d.shared_intermediate}, or the --model preset's)")
    p.add_argument("--ep-size", type=int, default=None,
                   help=f"expert-parallel ranks (default: {d.ep_size}, DeepSeek-V3's EP, where a layer at EP {d.ep_size} with the other "
                        f"options runs on --arch; else 1, with one "
                        f"EP={d.ep_size} rank's {d.num_experts // d.ep_size} experts on one GPU unless --experts is given; 1 with --model)")
    p.add_argument("--one-launch", action="store_true", help="also the one-launch forward's kernels (MoKConfig.one_launch)")
    p.add_argument("--fuse-wgrad-accumulation", action="store_true",
                   help="the weight gradients added into fp32 main_grad buffers (MoKConfig.fuse_wgrad_accumulation)")
    p.add_argument("--dispatch-format", choices=DISPATCH_FORMATS, default="bf16",
                   help="how x crosses to the experts' ranks (EP > 1); mxfp8 and fp8_block add their kernels (MoKConfig.dispatch_format)")
    p.add_argument("--precision", choices=PRECISIONS, default="bf16",
                   help="the routed experts' GEMM operands; mxfp8 (sm_100a), mxfp8_emulated and fp8_block (sm_90a) add their kernels "
                        "(MoKConfig.precision)")
    p.add_argument("--saved-h-format", choices=SAVED_H_FORMATS, default="bf16",
                   help="how h is kept for the backward; mxfp8 adds its quantize kernels, recompute the gate/up GEMM in the backward, "
                        "recompute_gate the gate GEMM (MoKConfig.saved_h_format)")
    p.add_argument("--gate-up-layout", choices=GATE_UP_LAYOUTS, default="separate",
                   help="how the gate and up weights are stored; concatenated (one [E, 2I, H] tensor, as transformers' "
                        "gate_up_proj) or interleaved (its rows alternating gate and up, gpt-oss's) adds the kernels that read "
                        "them in place (MoKConfig.gate_up_layout)")
    p.add_argument("--activation", choices=ACTIVATIONS, default="swiglu",
                   help="the experts' gated activation (MoKConfig.activation; gpt-oss: clamped_swiglu)")
    p.add_argument("--expert-bias", action="store_true", help="the routed experts have biases (MoKConfig.expert_bias; gpt-oss)")
    p.add_argument("--fp8-scales", choices=FP8_SCALES, default="fp32",
                   help="precision fp8_block's scale rule; power_of_two builds its quantizers that way (MoKConfig.fp8_scales)")
    p.add_argument("--wgrad-format", choices=WGRAD_FORMATS, default=None,
                   help="the expert weight gradients' operands (default: the precision's own); fp8_block (with precision "
                        "fp8_block) adds the transposing quantizers and the FP8 weight-gradient kernels (sm_100a / sm_103a: power_of_two "
                        "scales, the MXFP8 ones) (MoKConfig.wgrad_format)")
    p.add_argument("--row-tile-pairs", action="store_true",
                   help="the staged bf16 grouped GEMMs (fp8_block: its gate/up GEMM) on clusters sharing each weight tile (MoKConfig.row_tile_pairs)")


def _resolve_config(args: argparse.Namespace, arch: str | None = None, shape=None) -> tuple[MoKConfig, str | None]:
    """(the configuration precompile builds, why the default ep_size was not taken or None).

    The shape: ``shape`` (a mok.bench.Shape, e.g. a --model preset: its experts on one GPU, ep_size
    1) or else DeepSeek-V3's (DEFAULT_CONFIG), each option given on the command line in place of its
    value. ``--ep-size`` left out, DeepSeek-V3's default is its own EP, 8, where MoKConfig accepts the
    configuration at EP 8 and the plan runs it on ``arch`` (mok.plan.refusal; any arch when ``arch``
    is None); elsewhere (options that do not go with EP, or that the arch does not run at EP) ep_size 1 with one EP = 8 rank's share of the experts (32, unless --experts is
    given): the expert kernels of that rank, the configuration a user runs on one such GPU."""
    from .plan import refusal

    if shape is not None:
        base = dict(hidden=shape.hidden, intermediate=shape.intermediate, num_experts=shape.experts, topk=shape.topk,
                    shared_intermediate=shape.shared_intermediate)
        default_ep = 1
    else:
        d = DEFAULT_CONFIG
        base = dict(hidden=d.hidden, intermediate=d.intermediate, num_experts=d.num_experts, topk=d.topk, shared_intermediate=d.shared_intermediate)
        default_ep = d.ep_size
    given = {"hidden": args.hidden, "intermediate": args.intermediate, "num_experts": args.experts, "topk": args.topk,
             "shared_intermediate": args.shared_intermediate}
    given = {name: value for name, value in given.items() if value is not None}
    if "shared_intermediate" in given:
        given["shared_intermediate"] = given["shared_intermediate"] or None
    values = {**base, **given, "one_launch": args.one_launch, "fuse_wgrad_accumulation": args.fuse_wgrad_accumulation,
              "saved_h_format": args.saved_h_format, "dispatch_format": args.dispatch_format, "precision": args.precision,
              "gate_up_layout": args.gate_up_layout, "activation": args.activation, "expert_bias": args.expert_bias,
              "fp8_scales": args.fp8_scales, "wgrad_format": args.wgrad_format, "row_tile_pairs": args.row_tile_pairs}
    if args.ep_size is not None or default_ep == 1:
        return MoKConfig(**values, ep_size=args.ep_size if args.ep_size is not None else default_ep), None
    try:
        config = MoKConfig(**values, ep_size=default_ep)
        why = refusal(config, arch) if arch is not None else None
    except ValueError as err:
        why = str(err)
    if why is None:
        return config, None
    if "num_experts" not in given:
        values["num_experts"] //= default_ep  # (one rank's share: that rank's expert kernels)
    try:
        config = MoKConfig(**values, ep_size=1)
    except ValueError as err:
        raise ValueError(f"{err} (with --ep-size left out; the default EP = {default_ep} does not run here: {why})") from None
    return config, f"DeepSeek-V3's default EP = {default_ep} does not run {'on ' + arch if arch else 'with these options'} ({why})"


def _config_from(args: argparse.Namespace, arch: str | None = None) -> MoKConfig:
    """The configuration precompile builds from its options for ``arch`` (:func:`_resolve_config`; with
    --model, the first preset's)."""
    models = getattr(args, "model", None)
    return _resolve_config(args, arch, PRESETS[models[0]] if models else None)[0]


def _instead(config: MoKConfig, arch: str) -> str | None:
    """The command-line option that makes a configuration the plan refuses on ``arch`` one it runs
    (the plan's refusal names the fields, mok.plan.refusal), or None where none does: MXFP8 where
    the arch has no block-scaled MMAs runs emulated."""
    from .plan import refusal

    why = refusal(config, arch)
    if why is None or "precision" not in why or config.precision != "mxfp8":
        return None
    try:
        emulated = dataclasses.replace(config, precision="mxfp8_emulated")
    except ValueError:
        return None
    return "--precision mxfp8_emulated" if refusal(emulated, arch) is None else None


def _describe(config: MoKConfig) -> str:
    shared = f"shared expert {config.shared_intermediate}" if config.has_shared_expert else "no shared expert"
    options = [f"{f}={getattr(config, f)!r}" for f in ("precision", "saved_h_format", "dispatch_format") if getattr(config, f) != "bf16"]
    options += [f for f in ("one_launch", "fuse_wgrad_accumulation") if getattr(config, f)]
    options += [f"gate_up_layout={config.gate_up_layout!r}"] if config.gate_up_joined else []
    options += ([f"activation={config.activation!r}"] if config.activation != "swiglu" else []) + (["expert_bias"] if config.expert_bias else [])
    options += [f"fp8_scales={config.fp8_scales!r}"] if config.fp8_power_of_two else []
    options += [f"wgrad_format={config.wgrad_format!r}"] if config.wgrad_format is not None else []
    return (f"H {config.hidden}, I {config.intermediate}, {config.num_experts} experts, top-{config.topk}, {shared}, "
            f"ep_size {config.ep_size}" + (f", {', '.join(options)}" if options else ""))


def _cmd_precompile(args: argparse.Namespace) -> int:
    from .plan import refusal
    from .runtime.arch import normalize_arch
    from .runtime.cache import KernelCache
    from .runtime.precompile import precompile

    arch = normalize_arch(args.arch)
    shapes = [PRESETS[name] for name in args.model] if args.model else [None]
    cache = KernelCache(args.cache_dir)
    for shape in shapes:
        config, fallback = _resolve_config(args, arch, shape)
        refused = refusal(config, arch) is not None
        if not refused:
            name = f"{shape.model} preset: " if shape is not None else ""
            print(f"precompile for {arch}: {name}{_describe(config)}", file=sys.stderr)
            if fallback:
                print(f"  ({fallback}: ep_size 1 instead, one EP = {DEFAULT_CONFIG.ep_size} rank's experts on one GPU)", file=sys.stderr)
        try:
            stats = precompile(config, arch, cache)  # (refuses, before compiling anything, what the plan does not run)
        except ValueError as err:
            instead = _instead(config, arch) if refused else None
            if instead is None:
                raise
            raise ValueError(f"{err}. On the command line: {instead}") from None
        print(f"{arch}: {stats.compiles} compiled, {stats.disk_loads} already in the cache ({cache.directory})")
    return 0


# ----- cache


def _cmd_cache(args: argparse.Namespace) -> int:
    from .runtime.cache import KernelCache

    cache = KernelCache(args.cache_dir)
    if args.action == "clear":
        print(f"removed {cache.clear(args.kernel)} entries from {cache.directory}")
        return 0
    entries = cache.entries()
    for e in entries:
        key = e["key"]
        params = ", ".join(f"{k}={v}" for k, v in dict(key.get("config") or {}).items())
        print(f"{key.get('name')}({params})  {key.get('arch')}  dsl {key.get('dsl_version')}  {e['bytes']} B  {e.get('created')}")
    print(f"{len(entries)} entries in {cache.directory}")
    return 0


# ----- bench


def _bench_shapes(args: argparse.Namespace) -> list:
    """The shapes ``bench`` runs (mok.bench.resolve_shapes on its options)."""
    return resolve_shapes(
        args.model, tokens=args.tokens, hidden=args.hidden, intermediate=args.intermediate, experts=args.experts, topk=args.topk,
        shared_intermediate=args.shared_intermediate, tiled="mok" in args.paths or args.kernel == "combine", precisions=args.precision,
        wgrad_format=args.wgrad_format,
    )


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.from_json:  # (no GPU needed)
        from .bench.layer import format_table, load_records, plot_records

        records = load_records(args.from_json)
        print(format_table(records))
        if args.plot:
            plot_records(records, args.plot, args.plot_metric)
            print(f"wrote {args.plot}", file=sys.stderr)
        return 0
    try:
        shapes = _bench_shapes(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        model = f" --model {','.join(s.model for s in shapes)}" if all(s.model in PRESETS for s in shapes) else ""
        print(NO_GPU_MESSAGE.format(model=model), file=sys.stderr)
        return 2
    if args.kernel == "combine":
        from .bench.layer import run_benchmarks

        return run_benchmarks(shapes[0].tokens, shapes[0].hidden, shapes[0].topk)
    plot_problem = None
    if args.plot:
        from .bench.layer import require_matplotlib

        try:
            require_matplotlib()
        except RuntimeError as err:  # (found out now; the table and --json still come)
            plot_problem = str(err)
            print(f"warning: {plot_problem}; the figures will be printed{' and written to ' + args.json if args.json else ''}, "
                  f"not drawn (later: python -m mok bench --from-json FILE --plot {args.plot})", file=sys.stderr)
    if "mok" in args.paths:
        from .runtime.arch import check_fused_layer_device

        check_fused_layer_device()  # (a GPU MoK's layer does not run on: the reason, before anything is allocated)
    from .bench.layer import plot_records, run_layer_benchmarks

    total = 2 * args.seconds * len(args.paths) * len(args.passes) * len(shapes)
    print(f"mok bench: {len(shapes)} shape(s) x {len(args.passes)} pass(es) x {len(args.paths)} path(s), about {total:.0f} s of timing "
          "plus each shape's first calls (kernel compiles)", file=sys.stderr)
    records, failures = run_layer_benchmarks(shapes, args.passes, args.paths, args.seconds, json_path=args.json)
    status = 1 if failures else 0
    if args.json and records:
        print(f"wrote {len(records)} records to {args.json}", file=sys.stderr)
    if args.plot and records:
        if plot_problem:
            print(f"error: {plot_problem}", file=sys.stderr)
            status = 1
        else:
            plot_records(records, args.plot, args.plot_metric)
            print(f"wrote {args.plot}", file=sys.stderr)
    for failure in failures:
        print(f"error: {failure}", file=sys.stderr)
    return status


def _add_bench_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=_models, default=None, metavar="PRESET[,PRESET...]",
                   help="model preset(s), comma-separated, or all (default deepseek-v3; the presets are listed below)")
    p.add_argument("--tokens", type=int, default=None, help="tokens on the GPU (default: the preset's; 4096 for a shape of one's own)")
    p.add_argument("--hidden", type=int, default=None, help="model width H (with --model: in place of the preset's)")
    p.add_argument("--intermediate", type=int, default=None, help="routed-expert width I (with --model: in place of the preset's)")
    p.add_argument("--experts", type=int, default=None, help="experts on this GPU (with --model: in place of the preset's)")
    p.add_argument("--topk", type=int, default=None, help="experts per token k (with --model: in place of the preset's)")
    p.add_argument("--shared-intermediate", type=int, default=None,
                   help="shared-expert width, 0 for none (default: the preset's; none for a shape of one's own)")
    p.add_argument("--precision", type=_argument_type(lambda t: parse_choices(t, PRECISIONS, None, "precision"), "precision"),
                   default=["bf16"], metavar="P[,P...]",
                   help="MoK's expert GEMMs: bf16 (default), fp8_block (DeepSeek-V3's FP8, Hopper), mxfp8_emulated, mxfp8 (SM100); "
                        "comma-separated: each shape once per precision, the PyTorch path (bf16) timed beside each")
    p.add_argument("--wgrad-format", choices=WGRAD_FORMATS, default=None,
                   help="MoK's expert weight gradients (default: each precision's own); fp8_block: on FP8 too, for the fp8_block "
                        "precision (Hopper; the bf16 run beside it keeps bf16's)")
    p.add_argument("--passes", type=_argument_type(lambda t: parse_choices(t, PASSES, PASS_ALIASES, "pass"), "passes"),
                   default=list(PASSES), metavar="PASS[,PASS]", help=f"what is timed, comma-separated: {', '.join(PASSES)} (default both)")
    p.add_argument("--paths", type=_argument_type(lambda t: parse_choices(t, PATHS, None, "path"), "paths"), default=list(PATHS),
                   metavar="PATH[,PATH...]",
                   help="mok (MoK's layer), torch (torch._grouped_mm, SwiGLU, index_add_; autograd), dense (one bf16 GEMM of the same "
                        "FLOPs), comma-separated (default all three)")
    p.add_argument("--seconds", type=float, default=2.0,
                   help="per path and pass: this many seconds of untimed calls, then as many timed (default 2)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the figures as a JSON list of records (rewritten after each model)")
    p.add_argument("--plot", default=None, metavar="FILE",
                   help="also draw a bar chart (PNG, SVG or PDF by the suffix; needs matplotlib: pip install 'mok[bench]')")
    p.add_argument("--plot-metric", choices=tuple(PLOT_METRICS), default="tflops", help="what --plot's bars show (default tflops)")
    p.add_argument("--from-json", default=None, metavar="FILE",
                   help="print the table (and --plot) from an earlier run's --json file instead of running anything (no GPU needed)")
    p.add_argument("--kernel", choices=("layer", "combine"), default="layer",
                   help="layer (default): the MoE layer; combine: only the combine kernel against eager PyTorch and a copy of its "
                        "bytes (--tokens, --hidden, --topk of the shape)")


BENCH_DESCRIPTION = """\
How fast is the MoE layer on this GPU, against what you would use otherwise? For each model preset
(or a shape of your own), on the same random inputs with uniform routing: MoK's layer (mok.forward,
mok.forward + mok.backward), the PyTorch path (router-grouped torch._grouped_mm, SwiGLU, index_add_
combine; autograd for the backward) and a dense bf16 GEMM of the same FLOPs (the ceiling), forward
and forward + backward, each alone at its own steady state. Prints ms, TFLOP/s, the speedup over
PyTorch and the share of the dense GEMM's TFLOP/s, and how far MoK's result is from PyTorch's."""

BENCH_EPILOG = """\
presets (one GPU's shape: experts on the GPU; shared = the shared experts' width; on Hopper
any widths that are multiples of 8 run):
{table}

examples:
  python -m mok bench                                   # deepseek-v3, forward and forward+backward
  python -m mok bench --model all --json bench.json --plot bench.png
  python -m mok bench --model qwen3-30b-a3b --tokens 16384
  python -m mok bench --hidden 4096 --intermediate 1024 --experts 64 --topk 6
  python -m mok bench --model qwen3-235b-a22b --precision bf16,fp8_block   # FP8 with block scales beside bf16
  python -m mok bench --from-json bench.json --plot bench.png   # redraw on another machine

Kernels compile on a shape's first call (seconds to a minute); `python -m mok precompile --arch
sm_90a --model PRESET` does it ahead of time. docs/benchmarking.md says more."""


def _prog() -> str:
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "mok" if name == "mok" else "python -m mok"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=_prog(), description="MoK: fused Mixture-of-Experts kernels")
    parser.add_argument("--version", action="version", version=f"mok {__version__}", help="print MoK's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help="what to do")
    raw = argparse.RawDescriptionHelpFormatter

    p = sub.add_parser("bench", help="time the MoE layer on this GPU: MoK against PyTorch, at model presets",
                       description=BENCH_DESCRIPTION, epilog=BENCH_EPILOG.format(table=presets_table()), formatter_class=raw)
    _add_bench_options(p)
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser(
        "precompile", help="compile every kernel a configuration needs into the cache (no GPU needed)",
        description="Compile every kernel a layer configuration's plan lists for a target into the kernel cache, without a GPU; "
                    "a later process on a GPU of that architecture loads them and compiles nothing. Without shape options: "
                    "DeepSeek-V3 (H 7168, I 2048, 256 experts, top-8, a shared expert of 2048), one rank of EP 8 where the "
                    "target runs that configuration at EP 8, else that rank's 32 experts on one GPU. "
                    "A configuration the target does not run is refused before anything compiles, with what to pass instead.",
    )
    p.add_argument("--arch", required=True, help="target: sm_90a (Hopper), sm_100a or sm_103a (Blackwell)")
    p.add_argument("--model", type=_models, default=None, metavar="PRESET[,PRESET...]",
                   help=f"the shape(s) of `mok bench` preset(s), on one GPU (ep_size 1 unless given), or all: {', '.join(PRESETS)}")
    p.add_argument("--cache-dir", default=None, help=CACHE_DIR_HELP)
    _add_shape_options(p)
    p.set_defaults(func=_cmd_precompile)

    p = sub.add_parser("cache", help="list or clear compiled kernels on disk",
                       description="The compiled kernels on disk ($MOK_CACHE_DIR, default ~/.cache/mok): list or clear them.")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION", help="list or clear")
    a = actions.add_parser("list", help="one line per compiled kernel on disk: name and configuration, arch, DSL version, size, date",
                           description="List the compiled kernels on disk: name and static configuration, target arch, CuTe DSL "
                                       "version, object size and date, then the count.")
    a.add_argument("--cache-dir", default=None, help=CACHE_DIR_HELP)
    a = actions.add_parser("clear", help="delete compiled kernels on disk (all, or one kernel's)",
                           description="Delete compiled kernels on disk: all of them, or with --kernel one kernel's entries. "
                                       "Later processes compile them again on first use.")
    a.add_argument("--kernel", default=None, help="only this kernel's entries (a name as `cache list` prints it, e.g. grouped_gemm)")
    a.add_argument("--cache-dir", default=None, help=CACHE_DIR_HELP)
    p.set_defaults(func=_cmd_cache)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, RuntimeError, NotImplementedError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
