"""MoE layer on one GPU: MoK's fused path against the plain PyTorch path, side by side.

    python perf/bench_layer.py [--configs dsv3,qwen3,dsv3-zipf] [--backward]
    (expert parallel: perf/bench_ep.py --ep 2)

For each config, on the same inputs in one process: MoK's forward (``mok.forward`` with the
configuration's options), the PyTorch path users write (mok.bench.torch_forward: router-grouped
torch._grouped_mm for gate/up and down, SwiGLU, weighting and index_add combine), and a dense
bf16 GEMM of the same FLOPs as the ceiling. Prints ms, TFLOP/s (6·T·k·H·I per forward, plus
6·T·H·I_s for a shared expert), the ratios, and the number of kernel launches per forward
(torch.profiler). "mok 1-launch" is the forward in one launch (``one_launch=True``: plus 2 for a
shared expert; "mok 1L shared-in": one, the shared expert in it). With ``--backward`` each path
runs forward + backward (MoK: ``mok.forward`` + ``mok.backward``; PyTorch: autograd through the
same path, gradients of x, router weights and all weights), counted as 3x the forward's FLOPs,
against the dense GEMM at 3x its FLOPs; "main_grad fused" adds the weight gradients into fp32
main_grad buffers inside the backward (``fuse_wgrad_accumulation``), "main_grad add" takes bf16
gradients and adds them afterwards, as a loop without it would; "mok mxfp8 h" keeps h in MXFP8
between forward and backward (``saved_h_format="mxfp8"``: other bits, so it is left out of the
same-bits check); "mok recompute" keeps no h and runs the gate/up GEMM again in the backward
(``saved_h_format="recompute"``: the same bits); "mok recompute gate" keeps h's up half and runs
the gate GEMM alone again (``saved_h_format="recompute_gate"``: the same bits); "mok pairs" runs the
grouped GEMMs on row-tile pairs sharing each weight tile (``row_tile_pairs``: the same bits).
"mok fp8 block" runs the forward's expert GEMMs in
FP8 with 128-block scales (``precision="fp8_block"``, other bits; the weight gradients bf16),
"mok fp8 block wgrad" (forward + backward) its weight gradients on FP8 too
(``wgrad_format="fp8_block"``); widths that are multiples of 128 only. At the gpt-oss configs "mok gpt-oss" runs gpt-oss's
experts as they are, clamped SwiGLU and expert biases (other bits).

``--memory`` measures instead, per saved_h_format (bf16; and precision="fp8_block" where the
widths are multiples of 128): what ``mok.forward`` keeps for the backward beyond x (bytes per
token and layer), and a forward + backward through a stack of 4 layers (mok.MoELayer, the
config's routing in every layer): what is held between them and the peak
(torch.cuda.max_memory_allocated), both above the weights and inputs (FP8: the weights' FP8
copies count as held).

Each path is timed alone at its own steady state (``--sustained S``, mok.bench.time_ms_sustained),
with the SM clock, power and temperature it ran at: an H200 under these loads sits at its 700 W
limit, and a path that draws less keeps a higher clock on its own. Timed in turn instead
(``--sustained 0``), the paths share clocks, which flatters the power-hungry ones
(docs/notes/timing-method.md: at dsv3-e128 PyTorch's path took 9.06 ms alone, 10.15 amid MoK's).
The current figures are in perf/RESULTS.md.
"""

from __future__ import annotations

import argparse
import ast

import torch

import mok
from mok.bench import (
    count_launches, device_span, format_gpu, gpu_state, graph_of, kernel_sequence, kernel_times, same_bits, time_ms_interleaved,
    time_ms_sustained, torch_forward, torch_train_step,
)

CONFIGS = {
    # name: (T, H, I, E, k, shared I_s, routing)
    "dsv3": (4096, 7168, 2048, 32, 8, None, "uniform"),
    "qwen3": (8192, 2048, 768, 64, 8, None, "uniform"),
    "dsv3-zipf": (4096, 7168, 2048, 32, 8, None, "zipf"),
    "dsv3-e128": (4096, 7168, 2048, 128, 8, None, "uniform"),  # one EP=2 rank's expert work (bench_ep's dsv3)
    "dsv3-shared": (4096, 7168, 2048, 32, 8, 2048, "uniform"),  # with DeepSeek-V3's shared expert
    "qwen3-small": (256, 2048, 768, 64, 8, None, "uniform"),  # few tokens: launch-bound
    # one GPU's whole model layer, T = 4096 (the small-expert shapes: ~256 rows an expert at 128 experts)
    "qwen3-30b": (4096, 2048, 768, 128, 8, None, "uniform"),
    "qwen3-30b-32k": (32768, 2048, 768, 128, 8, None, "uniform"),
    "qwen3-235b": (4096, 4096, 1536, 128, 8, None, "uniform"),
    "mixtral": (4096, 4096, 14336, 8, 2, None, "uniform"),
    # gpt-oss's widths (H = I = 2880: partial last tiles; MoK's SwiGLU without gpt-oss's biases and
    # clamp, which the "mok gpt-oss" path adds), and the same layer at 3072 (whole tiles) to see what
    # the partial tiles cost
    "gpt-oss-20b": (4096, 2880, 2880, 32, 4, None, "uniform"),
    "gpt-oss-120b": (4096, 2880, 2880, 128, 4, None, "uniform"),
    "gpt-oss-20b-3072": (4096, 3072, 3072, 32, 4, None, "uniform"),
    "gpt-oss-20b-16k": (16384, 2880, 2880, 32, 4, None, "uniform"),
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


def quack_gemms(inputs, tuned: bool = False):
    """quack-kernels' two grouped GEMMs alone, the peer whose GEMMs SonicMoE is built on: its varlen-M
    gate/up GEMM gathering the token rows with SwiGLU in the epilogue, then its varlen-M down GEMM,
    on rows sorted by expert beforehand (no routing metadata, no weighting, no combine). Returns
    (the forward's callable, a check of its rows against float32 torch), or None where quack is not
    installed (a benchmark-only peer: ``tools/carry-quack`` for the GPU machine). ``tuned``: quack's
    autotuner (slow to start) instead of its default Hopper config."""
    try:
        from quack.gemm_interface import gemm, gemm_act
    except ImportError:
        return None
    x, idx, _, (wg, wu, wd), _ = inputs
    E, k = wg.shape[0], idx.shape[1]
    expert_of_slot = idx.flatten().long()
    order = torch.argsort(expert_of_slot, stable=True)
    token_of_row = (order // k).int()
    cu_rows = torch.zeros(E + 1, dtype=torch.int32, device=x.device)
    cu_rows[1:] = torch.cumsum(torch.bincount(expert_of_slot, minlength=E), 0)
    w_gate_up = torch.cat([wg, wu], dim=1).transpose(1, 2)  # (E, H, 2I), K-major, N = [gate; up]
    w_down = wd.transpose(1, 2)  # (E, I, H)

    def forward():
        _, h = gemm_act(x, w_gate_up, activation="swiglu", cu_seqlens_m=cu_rows, A_idx=token_of_row, store_preact=False,
                        tuned=tuned, concat_layout=("B",))
        return gemm(h, w_down, cu_seqlens_m=cu_rows, tuned=tuned)

    def check() -> float:
        """Relative difference of the first expert's rows from float32 torch."""
        rows = slice(0, int(cu_rows[1]))
        xe = x[token_of_row[rows].long()].float()
        want = (torch.nn.functional.silu(xe @ wg[0].float().T) * (xe @ wu[0].float().T)) @ wd[0].float().T
        got = forward()[rows].float()
        return float((got - want).norm() / want.norm())

    return forward, check


def stacked_inputs(inputs):
    """The inputs with each projection's routed and shared weights in one [E + 1, ...] buffer (the
    shared expert last, as mok.MoELayer allocates them), or None without a shared expert of the
    routed experts' shapes: MoK then runs the shared expert in the routed launches."""
    x, idx, w, experts, shared = inputs
    if shared is None or shared[0].shape != experts[0].shape[1:]:
        return None
    bufs = [torch.cat([routed, one[None]]) for routed, one in zip(experts, shared)]
    return x, idx, w, tuple(b[:-1] for b in bufs), tuple(b[-1] for b in bufs)


def variant_setting(text: str) -> tuple[str, object]:
    """``--set NAME=VALUE``: one of mok.kernels.variants' TUNABLE_SETTINGS (read each time a kernel
    variant is built) and its new value, a Python literal (a list or set for a frozenset setting),
    checked against the setting's type."""
    from mok.kernels import variants

    name, sep, literal = text.partition("=")
    if not sep or name not in variants.TUNABLE_SETTINGS:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE with NAME one of {list(variants.TUNABLE_SETTINGS)}, got {text!r}")
    current = getattr(variants, name)
    try:
        value = ast.literal_eval(literal)
    except (ValueError, SyntaxError):
        raise argparse.ArgumentTypeError(f"{name}: expected a Python literal, got {literal!r}") from None
    if isinstance(current, frozenset) and isinstance(value, (list, tuple, set)):
        value = frozenset(value)
    elif isinstance(current, float) and type(value) is int:
        value = float(value)
    if type(value) is not type(current):
        raise argparse.ArgumentTypeError(f"{name}: expected a {type(current).__name__} like {current!r}, got {value!r}")
    return name, value


def apply_variant_settings(settings: list[tuple[str, object]]) -> None:
    """Set each (name, value) of :func:`variant_setting` on mok.kernels.variants, announced in the
    output (the kernels built from then on are entries of their own in the cache)."""
    from mok.kernels import variants

    for name, value in settings:
        setattr(variants, name, value)
        print(f"# mok.kernels.variants.{name} = {value!r}")


def config_of(inputs, **options) -> mok.MoKConfig:
    """The layer configuration of these inputs, with ``options``."""
    x, idx, _, experts, shared = inputs
    return mok.MoKConfig(
        x.shape[1], experts[0].shape[1], experts[0].shape[0], idx.shape[1], None if shared is None else shared[0].shape[0], **options
    )


def mok_forward(inputs, **options):
    """MoK's forward output (``mok.forward``, nothing kept for a backward)."""
    x, idx, w, experts, shared = inputs
    return mok.forward(config_of(inputs, **options), None, x, idx, w, *experts, shared, save_for_backward=False, check_routing=False)[0]


def mok_train_step(inputs, dout, main_grads=None, **options):
    """MoK forward (keeping h) and backward: all gradients (``main_grads``: fp32 buffers the weight
    gradients are added into, in the backward's GEMMs; ``options``: the configuration's)."""
    x, idx, w, experts, shared = inputs
    config = config_of(inputs, fuse_wgrad_accumulation=main_grads is not None, **options)
    _, ctx = mok.forward(config, None, x, idx, w, *experts, shared, check_routing=False)
    return mok.backward(config, None, ctx, dout, main_grads=main_grads)


def gpt_oss_plan(inputs):
    """(plan, biases) of gpt-oss's own experts at these inputs' shapes: clamped SwiGLU, expert biases
    of a few tenths (mok.plan.Plan directly: see the module docstring)."""
    from mok.plan import Plan

    x, _, _, experts, _ = inputs
    E, I, H = experts[0].shape
    g = torch.Generator(device="cuda").manual_seed(1)
    biases = tuple((torch.randn(E, n, device="cuda", generator=g) * 0.3).bfloat16() for n in (I, I, H))
    return Plan(config_of(inputs, activation="clamped_swiglu", expert_bias=True), "sm_90a"), biases


PATHS_OF_SOME_CONFIGS = {  # (--paths may name them for every config)
    "mok gpt-oss", "mok fp8 block", "mok fp8 block wgrad", "mok shared-in", "mok 1L shared-in",
}


def fp8_block_plan(inputs):
    """The plan of these inputs with precision="fp8_block" (mok.plan.Plan directly: see the module
    docstring), or None where a width is not a multiple of 128."""
    from mok.plan import Plan

    config = config_of(inputs)
    widths = [config.hidden, config.intermediate] + ([config.shared_intermediate] if config.has_shared_expert else [])
    return None if any(w % 128 for w in widths) else Plan(config_of(inputs, precision="fp8_block"), "sm_90a")


def mok_plan_forward(inputs, plan):
    x, idx, w, experts, shared = inputs
    return mok.pipeline.forward(plan, x, idx, w, experts, shared, check_routing=False).out


def mok_plan_train_step(inputs, dout, plan, wgrad_format: str | None = None):
    x, idx, w, experts, shared = inputs
    saved = mok.pipeline.forward(plan, x, idx, w, experts, shared, save=True, check_routing=False)
    return mok.pipeline.backward(plan, dout, x, idx, w, experts, shared, saved, wgrad_format=wgrad_format)


def mok_gpt_oss_forward(inputs, plan, biases):
    x, idx, w, experts, _ = inputs
    return mok.pipeline.forward(plan, x, idx, w, experts, None, check_routing=False, biases=biases).out


def mok_gpt_oss_train_step(inputs, dout, plan, biases):
    x, idx, w, experts, _ = inputs
    saved = mok.pipeline.forward(plan, x, idx, w, experts, None, save=True, check_routing=False, biases=biases)
    return mok.pipeline.backward(plan, dout, x, idx, w, experts, None, saved, biases=biases)


def mok_train_step_then_add(inputs, dout, main_grads):
    """What a training loop without the fused accumulation does: bf16 weight gradients, then an
    add of each into its fp32 main_grad."""
    grads = mok_train_step(inputs, dout)
    for buffer, grad in zip(main_grads, (grads.d_w_gate, grads.d_w_up, grads.d_w_down, *(grads.d_shared or ()))):
        buffer.add_(grad)
    return grads


def saved_bytes_per_token(inputs, saved_h_format: str, precision: str = "bf16") -> float:
    """What ``mok.forward`` keeps for the backward beyond x (h, the shared expert's h, the
    schedule's tensors, as allocated), per token."""
    x, idx, w, experts, shared = inputs
    config = config_of(inputs, saved_h_format=saved_h_format, precision=precision)
    _, ctx = mok.forward(config, None, x, idx, w, *experts, shared, check_routing=False)
    s = ctx.saved
    kept = [s.h, s.shared_h, s.x_rows, s.routing, *s.schedule.tensors()]
    return sum(t.numel() * t.element_size() for t in kept if t is not None) / x.shape[0]


def stack_memory_gib(inputs, saved_h_format: str, layers: int = 4, precision: str = "bf16") -> tuple[float, float]:
    """(held between forward and backward, peak of the step) in GiB above the weights and inputs,
    for forward + backward through ``layers`` MoE layers of these shapes and this routing (FP8: the
    weights' FP8 copies, made by the first forward, count as held)."""
    x, idx, w, experts, shared = inputs
    H, I, E, k = x.shape[1], experts[0].shape[1], experts[0].shape[0], idx.shape[1]
    stack = [mok.MoELayer(H, I, E, k, shared_intermediate=None if shared is None else shared[0].shape[0], device="cuda",
                          saved_h_format=saved_h_format, precision=precision) for _ in range(layers)]
    x_in, dout = x.clone().requires_grad_(), torch.randn_like(x)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y = x_in
    for layer in stack:
        y = layer(y, topk_idx=idx, topk_w=w)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    y.backward(dout)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del stack, y, x_in
    torch.cuda.empty_cache()
    return held / 2**30, peak / 2**30


def print_memory(configs: list[str]) -> None:
    """The --memory table (module docstring)."""
    print(f"{'config':<12}{'precision':<11}{'saved_h_format':<16}{'saved B/token':>14}{'4 layers held GiB':>19}{'peak GiB':>10}")
    for name in configs:
        inputs = make_inputs(*CONFIGS[name])
        fp8 = fp8_block_plan(inputs) is not None
        for precision, fmt in [("bf16", f) for f in ("bf16", "mxfp8", "recompute", "recompute_gate")] + (
                [("fp8_block", f) for f in ("bf16", "mxfp8", "recompute")] if fp8 else []):
            per_token = saved_bytes_per_token(inputs, fmt, precision)
            held, peak = stack_memory_gib(inputs, fmt, precision=precision)
            print(f"{name:<12}{precision:<11}{fmt:<16}{per_token:>14.0f}{held:>19.2f}{peak:>10.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="dsv3,qwen3,dsv3-zipf,qwen3-small")
    parser.add_argument("--backward", action="store_true", help="time forward + backward")
    parser.add_argument(
        "--sustained", type=float, default=3.0, metavar="S",
        help="each path alone at its own steady state: S s of calls, then S s timed, with its mean SM clock, power and "
        "temperature (default 3; nvidia-smi's power reading is averaged over about a second, so shorter windows can misread it); "
        "0: the paths timed in turn instead (mok.bench.time_ms_interleaved)",
    )
    parser.add_argument("--paths", default="", help="MoK paths to time, comma-separated (default: all; torch and dense always)")
    parser.add_argument("--profile", type=int, default=0, help="print (rank 0's) N most expensive kernels; at EP 1 every launch of one call in order")
    parser.add_argument("--profile-paths", default="mok", help="at EP 1: the paths whose kernels are printed, comma-separated (default: mok)")
    parser.add_argument("--quack-tuned", action="store_true", help="the quack gemms path with quack's autotuner (default: its default config)")
    parser.add_argument("--memory", action="store_true", help="measure what each saved_h_format keeps and a 4-layer step's peak instead")
    parser.add_argument("--set", type=variant_setting, action="append", default=[], metavar="NAME=VALUE",
                        help="a mok.kernels.variants setting for this run (repeatable), e.g. ISSUE_ORDER=[] or 'DEEP_TURNS={\"plain\": 8}'")
    args = parser.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    apply_variant_settings(args.set)
    if args.memory:
        print_memory(args.configs.split(","))
        return 0
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
        gpt_oss = gpt_oss_plan(inputs) if name.startswith("gpt-oss") else None
        fp8 = fp8_block_plan(inputs)
        if args.backward:
            flops *= 3  # backward: dx and dW, twice the forward's products
            dout = torch.randn(T, H, device="cuda").bfloat16()
            paths = {
                "mok": lambda: mok_train_step(inputs, dout),
                "mok (graph)": graph_of(lambda: mok_train_step(inputs, dout)),
                "torch": lambda: torch_train_step(inputs, dout),
                "dense gemm": lambda: [dense_a @ dense_b for _ in range(3)],
            }
            if stacked is not None:
                paths["mok shared-in"] = lambda: mok_train_step(stacked, dout)
            main_grads = tuple(torch.zeros(t.shape, device="cuda") for t in (*inputs[3], *(inputs[4] or ())))
            paths["main_grad add"] = lambda: mok_train_step_then_add(inputs, dout, main_grads)
            paths["main_grad fused"] = lambda: mok_train_step(inputs, dout, main_grads=main_grads)
            paths["mok mxfp8 h"] = lambda: mok_train_step(inputs, dout, saved_h_format="mxfp8")
            paths["mok recompute"] = lambda: mok_train_step(inputs, dout, saved_h_format="recompute")
            paths["mok recompute gate"] = lambda: mok_train_step(inputs, dout, saved_h_format="recompute_gate")
            paths["mok pairs"] = lambda: mok_train_step(inputs, dout, row_tile_pairs=True)
            if gpt_oss is not None:
                paths["mok gpt-oss"] = lambda: mok_gpt_oss_train_step(inputs, dout, *gpt_oss)
            if fp8 is not None:
                paths["mok fp8 block"] = lambda: mok_plan_train_step(inputs, dout, fp8)
                paths["mok fp8 block wgrad"] = lambda: mok_plan_train_step(inputs, dout, fp8, wgrad_format="fp8_block")
        else:
            paths = {
                "mok": lambda: mok_forward(inputs),
                "mok (graph)": graph_of(lambda: mok_forward(inputs)),
                "mok 1-launch": lambda: mok_forward(inputs, one_launch=True),
                "mok pairs": lambda: mok_forward(inputs, row_tile_pairs=True),
                "torch": lambda: torch_forward(*inputs),
                "dense gemm": lambda: dense_a @ dense_b,
            }
            quack = quack_gemms(inputs, tuned=args.quack_tuned) if s_inter is None else None
            if quack is not None:
                paths["quack gemms"] = quack[0]
            if gpt_oss is not None:
                paths["mok gpt-oss"] = lambda: mok_gpt_oss_forward(inputs, *gpt_oss)
            if fp8 is not None:
                paths["mok fp8 block"] = lambda: mok_plan_forward(inputs, fp8)
            if stacked is not None:  # the shared expert in the routed launches (four, or one)
                paths["mok shared-in"] = lambda: mok_forward(stacked)
                paths["mok 1L shared-in"] = lambda: mok_forward(stacked, one_launch=True)
        if args.paths:
            # (the default path: the others' bits are checked against it; quack wherever it is installed)
            keep = ({"mok", "torch", "dense gemm", *args.paths.split(",")} - {"quack gemms"}) | ({"quack gemms"} & set(paths))
            unknown = keep - set(paths) - PATHS_OF_SOME_CONFIGS
            if unknown:
                raise SystemExit(f"--paths: no path(s) {sorted(unknown)}; known: {list(paths)}")
            for absent in sorted(keep - set(paths)):
                print(f"# {name}: no '{absent}' path at this config")
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
        other_bits = ("mok mxfp8 h", "mok gpt-oss", "mok fp8 block", "mok fp8 block wgrad")  # (other numerics: left out of the same-bits check)
        same = {p: same_bits(paths[p](), mok_result) for p in paths if p.startswith("mok ") and p not in other_bits}  # MoK's ways: the same bits
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
        if "quack gemms" in paths:
            print(f"{name:<12}quack gemms' first expert's rows vs float32 torch: relative difference {quack[1]():.2e}")
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
