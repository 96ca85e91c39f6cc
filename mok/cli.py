"""Command line: ``python -m mok {precompile, cache, bench}``."""

from __future__ import annotations

import argparse
import sys

from .config import DEFAULT_CONFIG, DISPATCH_FORMATS, PRECISIONS, SAVED_H_FORMATS, MoKConfig


def _add_shape_options(p: argparse.ArgumentParser) -> None:
    d = DEFAULT_CONFIG
    p.add_argument("--hidden", type=int, default=d.hidden, help=f"model width H (default {d.hidden})")
    p.add_argument("--intermediate", type=int, default=d.intermediate, help=f"expert width I (default {d.intermediate})")
    p.add_argument("--experts", type=int, default=d.num_experts, help=f"experts E over all ranks (default {d.num_experts})")
    p.add_argument("--topk", type=int, default=d.topk, help=f"experts per token k (default {d.topk})")
    p.add_argument("--shared-intermediate", type=int, default=d.shared_intermediate,
                   help=f"shared-expert width, 0 for none (default {d.shared_intermediate})")
    p.add_argument("--ep-size", type=int, default=d.ep_size, help=f"expert-parallel ranks (default {d.ep_size})")
    p.add_argument("--one-launch", action="store_true", help="also the one-launch forward's kernels (MoKConfig.one_launch)")
    p.add_argument("--fuse-wgrad-accumulation", action="store_true",
                   help="the weight gradients added into fp32 main_grad buffers (MoKConfig.fuse_wgrad_accumulation)")
    p.add_argument("--dispatch-format", choices=DISPATCH_FORMATS, default="bf16",
                   help="how x crosses to the experts' ranks (EP > 1); mxfp8 adds its kernels (MoKConfig.dispatch_format)")
    p.add_argument("--precision", choices=PRECISIONS, default="bf16",
                   help="the routed experts' GEMM operands; mxfp8 (sm_100a) and mxfp8_emulated add their kernels (MoKConfig.precision)")
    p.add_argument("--saved-h-format", choices=SAVED_H_FORMATS, default="bf16",
                   help="how h is kept for the backward; mxfp8 adds its quantize kernels (MoKConfig.saved_h_format)")


def _config_from(args: argparse.Namespace) -> MoKConfig:
    return MoKConfig(
        hidden=args.hidden, intermediate=args.intermediate, num_experts=args.experts, topk=args.topk,
        shared_intermediate=args.shared_intermediate or None, ep_size=args.ep_size, one_launch=args.one_launch,
        fuse_wgrad_accumulation=args.fuse_wgrad_accumulation, saved_h_format=args.saved_h_format, dispatch_format=args.dispatch_format,
        precision=args.precision,
    )


def _cmd_precompile(args: argparse.Namespace) -> int:
    from .runtime.cache import KernelCache
    from .runtime.precompile import precompile

    config = _config_from(args)
    cache = KernelCache(args.cache_dir)
    stats = precompile(config, args.arch, cache)
    print(f"{args.arch}: {stats.compiles} compiled, {stats.disk_loads} already in the cache ({cache.directory})")
    return 0


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


def _cmd_bench(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print(
            "No CUDA GPU is visible, so there is nothing to benchmark: MoK's layer runs on Hopper (sm_90a) GPUs "
            "(Blackwell, sm_100a: compile-verified, never run; opt in with MOK_UNVERIFIED_SM100=1).\nOn this machine you "
            "can compile them ahead of time: `python -m mok precompile --arch sm_90a`.",
            file=sys.stderr,
        )
        return 2
    from .bench import run_benchmarks

    return run_benchmarks(args.tokens, args.hidden, args.topk)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mok", description="MoK: fused Mixture-of-Experts kernels")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("precompile", help="compile every kernel a configuration needs into the cache (no GPU needed)")
    p.add_argument("--arch", required=True, help="target: sm_90a (Hopper), sm_100a or sm_103a (Blackwell)")
    p.add_argument("--cache-dir", default=None, help="cache directory (default $MOK_CACHE_DIR or ~/.cache/mok)")
    _add_shape_options(p)
    p.set_defaults(func=_cmd_precompile)

    p = sub.add_parser("cache", help="list or clear compiled kernels on disk")
    p.add_argument("action", choices=("list", "clear"))
    p.add_argument("--kernel", default=None, help="with clear: only this kernel's entries")
    p.add_argument("--cache-dir", default=None, help="cache directory (default $MOK_CACHE_DIR or ~/.cache/mok)")
    p.set_defaults(func=_cmd_cache)

    p = sub.add_parser("bench", help="benchmark MoK's kernels against PyTorch on this GPU")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=DEFAULT_CONFIG.hidden)
    p.add_argument("--topk", type=int, default=DEFAULT_CONFIG.topk)
    p.set_defaults(func=_cmd_bench)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
