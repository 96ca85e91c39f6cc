"""Registry of MoK's compiled kernels.

A :class:`KernelVariant` names one kernel specialisation by static configuration only
(shapes, top-k, flags, never token counts) and knows how to compile it for a target.
The ops build the variant they launch through these constructors (``grouped_gemm_variant``
and the like), and ``variants_for(config)`` lists every variant a layer configuration needs,
for the offline precompiler; tests/test_backward_gpu.py holds the list to what a training step
looks up. Not listed: fresh fp32 weight gradients (``grad_dtype=torch.float32``, compiled on first use).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..config import MoKConfig


@dataclass(frozen=True)
class KernelVariant:
    """One compiled kernel: ``name`` + static ``config``; ``compile(arch, options)`` builds it."""

    name: str
    config: Mapping[str, Any]
    compile: Callable[[str, str], Any] = field(compare=False, repr=False)

    def describe(self) -> str:
        params = ", ".join(f"{k}={v}" for k, v in sorted(self.config.items()))
        return f"{self.name}({params})"


def combine_variant(
    hidden: int, topk: int, has_shared: bool, gathered: bool = False, unit_weights: bool = False, router_parts: int = 0
) -> KernelVariant:
    """The final weighted combine of k expert rows (plus the shared expert's row) per token.

    ``unit_weights``: every weight 1 (the backward's sum of the slots' dx rows). ``router_parts``
    > 0 (gathered, unit weights): the router-weight gradient from that many pieces per row too.
    """
    if router_parts and not (gathered and unit_weights):
        raise ValueError("router_parts: only with gathered rows and unit weights (the backward's dx combine)")

    def build(arch: str, options: str = "") -> Any:
        from .common.combine import compile_combine

        return compile_combine(hidden, topk, has_shared, gathered, arch, options, unit_weights=unit_weights, router_parts=router_parts)

    config = {"hidden": hidden, "topk": topk, "has_shared": has_shared, "gathered": gathered}
    if unit_weights:  # (absent otherwise: the forward's cache keys stay as they were)
        config["unit_weights"] = True
    if router_parts:
        config["router_parts"] = router_parts
    return KernelVariant("combine", config, build)


def gather_variant(width: int, sources: int = 1) -> KernelVariant:
    """Row gather into the expert-grouped buffer (zeros for padding rows); ``sources`` 2: the same
    rows of two tensors in one launch."""
    if sources not in (1, 2):
        raise ValueError(f"sources: expected 1 or 2, got {sources}")

    def build(arch: str, options: str = "") -> Any:
        from .common.gather import compile_gather

        return compile_gather(width, arch, options, sources=sources)

    return KernelVariant("gather", {"width": width} | ({"sources": 2} if sources == 2 else {}), build)


def quantize_mxfp8_variant(back: bool = False, bounded: bool = False, mma_order: bool = False, columns: bool = False) -> KernelVariant:
    """bf16 rows -> MXFP8 elements and E8M0 scales (mok/mxfp8.py's rule), or with ``back`` MXFP8 ->
    bf16; no static shape. ``bounded``: only the rows a device count says are in use. ``mma_order``
    (quantizing): the scales in the order SM100's block-scaled MMAs read (mok.mxfp8.mma_scale_layout).
    ``columns`` (quantizing): blocks of 32 rows down each column (the transpose's MXFP8)."""
    if back and (mma_order or columns):
        raise ValueError("mma_order, columns: only when quantizing")

    def build(arch: str, options: str = "") -> Any:
        from .common.mxfp8_quantize import compile_mxfp8

        return compile_mxfp8(arch, options, back=back, bounded=bounded, mma_order=mma_order, columns=columns)

    flags = {"bounded": bounded, "mma_order": mma_order, "columns": columns}
    config = {name: True for name, on in flags.items() if on}
    return KernelVariant("dequantize_mxfp8" if back else "quantize_mxfp8", config, build)


SCHEDULE_THREADS = 512  # threads per CTA of the schedule launch
GRID_SYNC_WORDS = 4  # int32 words of a grid barrier's state (common/waits.py: grid_barrier)


def schedule_ctas(pairs: int, sm_count: int) -> int:
    """CTAs of a schedule launch: one per SM at most, at least one warp-step of pairs per warp.

    Each CTA reads all P expert ids once (its counts) and walks only its own chunk, so more
    CTAs shorten the serial walk; the placement does not depend on the count."""
    return max(1, min(sm_count, -(-pairs // SCHEDULE_THREADS)))


def schedule_variant(num_local_experts: int, topk: int, block_m: int) -> KernelVariant:
    """Routing -> row slots on the GPU (one launch), the device twin of mok/schedule.py."""

    def build(arch: str, options: str = "") -> Any:
        from .common.schedule import compile_schedule

        return compile_schedule(num_local_experts, topk, block_m, arch, options)

    return KernelVariant("schedule", {"experts": num_local_experts, "topk": topk, "block_m": block_m}, build)


def ep_variant(kind: str, world: int, *, phase: int = 0, width: int = 8, topk: int = 1) -> KernelVariant:
    """One expert-parallel exchange kernel (mok/kernels/common/ep.py): signal, wait, publish, publish_mxfp8, routing, dispatch,
    dispatch_mxfp8, push or overflow."""

    def build(arch: str, options: str = "") -> Any:
        from .common.ep import compile_ep

        return compile_ep(kind, world, arch, options, phase=phase, width=width, topk=topk)

    return KernelVariant(f"ep_{kind}", {"world": world, "phase": phase, "width": width, "topk": topk}, build)


def default_tile_n(n: int, k: int, swiglu: bool) -> int:
    """Column tile of the grouped GEMM, from static shapes only (batch invariance).

    SwiGLU holds two accumulators, so 128 wide; a plain GEMM takes 256 where N allows.
    Measured on H200 (perf/NOTES.md, 2026-12-01): two machines disagreed for the dsv3 down
    projection (128 ahead by 5% on one, 256 ahead by 12% on the other); 256 won at qwen3's.
    """
    return 256 if not swiglu and n % 256 == 0 else 128


def grouped_gemm_variant(
    n: int,
    k: int,
    swiglu: bool = False,
    tile_n: int | None = None,
    stages: int | None = None,
    *,
    epilogue: str | None = None,
    b_major: str = "k",
    k_split: bool = False,
    topk: int = 1,
    unit_scale: bool = False,
    persistent: bool = True,
    gather_a: bool = False,
    gather_ranks: bool = False,
    combine: bool = False,
    has_shared: bool = False,
    scatter: bool = False,
    skip_padding: bool = False,
    pull_a: bool = False,
    pingpong: bool = False,
) -> KernelVariant:
    """Expert-grouped GEMM (sm_90a: WGMMA + TMA, mok/kernels/sm90/grouped_gemm.py; sm_100a / sm_103a:
    tcgen05, mok/kernels/sm100/grouped_gemm.py: ``persistent=False`` only so far, without gather,
    scatter, combine, skip_padding, pull or ping-pong; compile-verified, never run).

    ``epilogue``: plain, swiglu, swiglu_save (also writes h) or swiglu_bwd (SwiGLU backward
    with the router-weight gradient's partial sums; needs ``topk``, or ``unit_scale`` for the
    shared expert). ``swiglu=True`` is shorthand for the swiglu epilogue. ``b_major`` "n"
    reads B as [E, K, N]; ``k_split`` takes the two K halves from B and B2. ``persistent`` (default): one
    CTA per SM walks the tiles, a producer warpgroup loading ahead while the MMA warpgroups
    run the epilogue (perf/NOTES.md: 0-20% faster than one CTA per tile, the same bits). ``stages``: shared-memory pipeline depth; None fills shared memory.
    ``gather_a`` (persistent only): A is the token matrix, its rows gathered by the schedule's row_token;
    with ``gather_ranks``, every rank's token matrix in the expert-parallel workspace (pulled in the GEMM).
    ``combine`` (the down projection): the kernel also writes the layer output, each token's
    columns combined by the CTA that brings its last slot (``topk`` slots, ``has_shared``).
    ``scatter`` (the down projection): each row goes to its (token, slot) row of the combine
    slots of the token's rank (``topk`` slots per token) instead of a [R, N] output.
    ``skip_padding`` (persistent only): an MMA warpgroup whose 64 rows of a tile are all padding
    (the row_token argument < 0) issues no WGMMA; its rows come out as zero A rows give them.
    ``pull_a`` (persistent, A by TMA): the kernel's idle producer warps also copy A's rows from
    their owners' token matrices, row tile by row tile, and each tile's loads wait for its rows
    (the expert-parallel dispatch overlapped with the gate/up GEMM).
    ``pingpong`` (persistent swiglu_bwd, 128-wide tiles): the MMA warpgroups take whole tiles in
    turn, one's epilogue under the other's WGMMAs (the same bits).
    """
    epilogue = epilogue or ("swiglu" if swiglu else "plain")
    tile_n = default_tile_n(n, k, epilogue in ("swiglu", "swiglu_save", "swiglu_bwd")) if tile_n is None else tile_n
    topk = topk if (epilogue == "swiglu_bwd" and not unit_scale) or combine or scatter else 1
    options = dict(epilogue=epilogue, b_major=b_major, k_split=k_split, topk=topk, unit_scale=unit_scale, persistent=persistent)
    if gather_a:  # (absent otherwise: the other variants' cache keys stay as they were)
        options["gather_a"] = True
    if gather_ranks:
        options["gather_ranks"] = True
    if combine:
        options.update(combine=True, has_shared=has_shared)
    if scatter:
        options["scatter"] = True
    if skip_padding:
        options["skip_padding"] = True
    if pull_a:
        options["pull_a"] = True
    if pingpong:
        options["pingpong"] = True

    def build(arch: str, compile_options: str = "") -> Any:
        if arch in ("sm_100a", "sm_103a"):  # tcgen05: the one-tile-per-CTA variants so far (compile-verified only)
            from .sm100.grouped_gemm import compile_grouped_gemm_sm100

            return compile_grouped_gemm_sm100(n, k, arch, compile_options, tile_n=tile_n, stages=stages, **options)
        from .sm90.grouped_gemm import compile_grouped_gemm

        return compile_grouped_gemm(n, k, arch, compile_options, tile_n=tile_n, stages=stages, **options)

    config = {"n": n, "k": k, "tile_n": tile_n, "stages": stages or 0, **options}  # stages 0: as deep as fits
    return KernelVariant("grouped_gemm", config, build)


MXFP8_GEMM_ARCHS = ("sm_100a", "sm_103a")  # block-scaled MMAs (tcgen05 kind::mxf8f6f4); Hopper has none


def grouped_gemm_mxfp8_variant(
    n: int, k: int, epilogue: str = "plain", tile_n: int | None = None, stages: int | None = None, *, k_split: bool = False,
    topk: int = 1, unit_scale: bool = False,
) -> KernelVariant:
    """Expert-grouped GEMM on MXFP8 operands (E4M3, an E8M0 scale per 32 along K), SM100 only:
    block-scaled tcgen05 MMAs, mok/kernels/sm100/grouped_gemm.py (compile-verified, never run).
    ``epilogue`` plain, swiglu, swiglu_save or swiglu_bwd (``topk``, or ``unit_scale``, as in
    :func:`grouped_gemm_variant`); ``k_split``: K's halves from B and B2; ``tile_n`` 128 or 256
    (default: 256 for the plain epilogue where N allows, else 128)."""
    tile_n = (256 if epilogue == "plain" and n % 256 == 0 else 128) if tile_n is None else tile_n
    topk = topk if epilogue == "swiglu_bwd" and not unit_scale else 1
    options = {"k_split": True} if k_split else {}  # (absent when off: the forward's cache keys stay as they were)
    if epilogue == "swiglu_bwd":
        options.update(topk=topk, unit_scale=unit_scale)

    def build(arch: str, compile_options: str = "") -> Any:
        if arch not in MXFP8_GEMM_ARCHS:
            raise NotImplementedError(
                f"MXFP8 grouped GEMM on {arch}: needs block-scaled MMAs, which only {', '.join(MXFP8_GEMM_ARCHS)} have "
                "(on Hopper MoK keeps MXFP8 as a storage and transport format and computes in bf16)"
            )
        from .sm100.grouped_gemm import compile_grouped_gemm_mxfp8_sm100

        return compile_grouped_gemm_mxfp8_sm100(n, k, arch, compile_options, epilogue=epilogue, tile_n=tile_n, stages=stages, **options)

    config = {"n": n, "k": k, "epilogue": epilogue, "tile_n": tile_n, "stages": stages or 0, **options}
    return KernelVariant("grouped_gemm_mxfp8", config, build)


def mxfp8_layer_variants(hidden: int, inter: int, topk: int, main_grads: bool = False) -> list[KernelVariant]:
    """What mok.mxfp8_forward and mok.mxfp8_backward run beyond the bf16 layer's kernels (SM100
    only): the MXFP8 GEMMs (gate/up with and without h, down; the SwiGLU backward, dx; the weight
    gradients, fresh bf16, and with ``main_grads`` also added into fp32 buffers: dW_gate with dW_up
    in one launch, or a half of dh alone) and the quantizer writing scales in the MMA's order (rows
    in use; the weights' every row; down the columns for the weight gradients)."""
    accumulating = [
        weight_grad_mxfp8_variant(hidden, inter, "f32", True),
        weight_grad_mxfp8_variant(2 * inter, hidden, "f32", True, split_out=True),
        weight_grad_mxfp8_variant(inter, hidden, "f32", True, a_stride=2 * inter),
    ]
    return (accumulating if main_grads else []) + [
        grouped_gemm_mxfp8_variant(inter, hidden, "swiglu"),
        grouped_gemm_mxfp8_variant(inter, hidden, "swiglu_save"),
        grouped_gemm_mxfp8_variant(hidden, inter),
        grouped_gemm_mxfp8_variant(inter, hidden, "swiglu_bwd", 128, topk=topk),
        grouped_gemm_mxfp8_variant(hidden, 2 * inter, k_split=True),
        weight_grad_mxfp8_variant(hidden, inter),
        weight_grad_mxfp8_variant(2 * inter, hidden, split_out=True),
        quantize_mxfp8_variant(bounded=True, mma_order=True),
        quantize_mxfp8_variant(mma_order=True),
        quantize_mxfp8_variant(bounded=True, mma_order=True, columns=True),
    ]


def mxfp8_emulated_variants(hidden: int, inter: int, persistent: bool = True) -> list[KernelVariant]:
    """What ``precision="mxfp8_emulated"`` runs beyond the bf16 layer's kernels (any arch): the
    quantizers writing MMA-ordered scales (as mxfp8_layer_variants), the dequantizers turning the
    operands back into bf16 (rows in use; every row of a weight), and the bf16 grouped GEMMs on those
    rows (gate/up without gathering, dx on the transposed weights' K-major copies)."""
    return [
        quantize_mxfp8_variant(bounded=True, mma_order=True),
        quantize_mxfp8_variant(mma_order=True),
        quantize_mxfp8_variant(bounded=True, mma_order=True, columns=True),
        quantize_mxfp8_variant(back=True),
        quantize_mxfp8_variant(back=True, bounded=True),
        grouped_gemm_variant(inter, hidden, epilogue="swiglu", persistent=persistent),
        grouped_gemm_variant(inter, hidden, epilogue="swiglu_save", persistent=persistent),
        grouped_gemm_variant(hidden, 2 * inter, k_split=True, persistent=persistent),
    ]


def unsupported_on(config: MoKConfig, arch: str) -> str | None:
    """Why a layer of ``config`` does not run on ``arch`` (None when it does): what precompile
    refuses instead of building a list of kernels no layer would use."""
    if config.precision == "mxfp8" and arch not in MXFP8_GEMM_ARCHS:
        return f"precision='mxfp8' needs block-scaled MMAs ({', '.join(MXFP8_GEMM_ARCHS)}); on {arch} use precision='mxfp8_emulated'"
    if arch != "sm_90a" and (config.ep_size > 1 or config.one_launch):
        what = "ep_size > 1" if config.ep_size > 1 else "one_launch"
        return f"{what}: not on {arch} yet (its kernels there are the single-GPU layer's one-tile GEMMs)"
    return None


def expert_mlp_variant(
    hidden: int, inter: int, topk: int, *, save_h: bool = False, combine: bool = False, has_shared: bool = False,
    schedule_experts: int | None = None, combine_phase: bool = False, ep_world: int | None = None, gather_phase: bool = False,
    shared_prefix: bool = False, dispatch_format: str = "bf16",
) -> KernelVariant:
    """fc1 (gathered rows, SwiGLU; ``save_h`` also writes h) and fc2 of every expert in one
    persistent launch, tiles taken in one global order, each fc2 row tile waiting for its fc1
    row tile; ``combine``: fc2 also writes the layer output (with a shared expert's output:
    ``has_shared``); ``schedule_experts`` (E, with ``combine``): the schedule of the routing is
    built in the same launch first, so the launch is the whole forward; ``combine_phase`` (with
    it): the combine as a last phase after a grid barrier, not in fc2's epilogue; ``ep_world`` (W,
    with both): the whole expert-parallel forward of one rank of W, exchanges included;
    ``gather_phase`` (with ``schedule_experts``, not ``ep_world``): the rows gathered into x_rows
    by all CTAs after the schedule, fc1 reading them by TMA; ``shared_prefix`` (with
    ``schedule_experts`` and ``has_shared``): the shared expert runs as expert E, its rows first;
    ``dispatch_format`` "mxfp8" (with ``ep_world``): x published in MXFP8, dequantized as it arrives.
    See mok/kernels/sm90/expert_mlp.py."""
    # fc2 in the column tile the down projection takes on its own (the same bits either way; see default_tile_n)
    fc2_tile_n = default_tile_n(hidden, inter, False)
    options = dict(save_h=save_h, combine=combine, has_shared=has_shared, order="dynamic", fc2_tile_n=fc2_tile_n)
    if schedule_experts is not None:
        options["schedule_experts"] = schedule_experts
    if combine_phase:
        options["combine_phase"] = True
    if ep_world is not None:
        options["ep_world"] = ep_world
    if gather_phase:
        options["gather_phase"] = True
    if shared_prefix:
        options["shared_prefix"] = True
    if dispatch_format != "bf16":
        options["dispatch_format"] = dispatch_format

    def build(arch: str, compile_options: str = "") -> Any:
        if arch != "sm_90a":
            raise NotImplementedError(f"expert MLP: only sm_90a has an implementation so far, not {arch}")
        from .sm90.expert_mlp import compile_expert_mlp

        return compile_expert_mlp(
            hidden, inter, topk if combine else 1, arch, compile_options, save_h=save_h, combine=combine, has_shared=has_shared,
            fc2_tile_n=fc2_tile_n, schedule_experts=schedule_experts, combine_phase=combine_phase, ep_world=ep_world,
            gather_phase=gather_phase, shared_prefix=shared_prefix, dispatch_format=dispatch_format,
        )

    return KernelVariant("expert_mlp", {"hidden": hidden, "inter": inter, "topk": topk if combine else 1, **options}, build)


def swiglu_backward_pingpong(persistent: bool, skip_padding: bool, tile_n: int = 128) -> bool:
    """Whether the SwiGLU-backward GEMM runs ping-pong by default: wherever it can (persistent,
    no skip_padding, 128-wide tiles; 4-16% faster than the cooperative kernel, perf/NOTES.md
    eleventh and twelfth sessions)."""
    return persistent and not skip_padding and tile_n == 128


def weight_grad_pingpong(persistent: bool, tile_n: int) -> bool:
    """Whether the weight-gradient GEMM runs ping-pong by default: wherever it can (persistent,
    128-wide tiles; 4-21% faster than the cooperative kernel, perf/NOTES.md eleventh session)."""
    return persistent and tile_n == 128


def weight_grad_variant(
    m: int, n: int, out_dtype: str = "bf16", accumulate: bool = False, a_stride: int | None = None, tile_n: int = 128,
    persistent: bool = True, pingpong: bool | None = None, split_out: bool = False,
) -> KernelVariant:
    """Per-expert weight gradient out[e] (+)= Aᵀ·B over the expert's rows (sm_90a: WGMMA + TMA;
    sm_100a / sm_103a: tcgen05, ``persistent=False`` only so far, compile-verified, never run).

    ``persistent`` (default): one CTA per SM walks the output tiles, as in the grouped GEMM;
    ``pingpong`` (persistent, 128-wide tiles): its two MMA warpgroups take whole tiles in turn,
    one's epilogue under the other's mainloop; None: :func:`weight_grad_pingpong` (what
    grad_ops.weight_grad launches, so that precompiling finds the same variants).
    ``split_out``: the two halves of M into two [E, M/2, N] tensors (dW_gate and dW_up in one launch).
    """
    a_stride = m if a_stride is None else a_stride
    pingpong = weight_grad_pingpong(persistent, tile_n) if pingpong is None else pingpong

    def build(arch: str, compile_options: str = "") -> Any:
        if arch in ("sm_100a", "sm_103a"):  # tcgen05: the one-tile-per-CTA kernel so far (compile-verified only)
            from .sm100.weight_grad_gemm import compile_weight_grad_sm100

            return compile_weight_grad_sm100(
                m, n, out_dtype, accumulate, arch, compile_options, a_stride=a_stride, tile_n=tile_n, persistent=persistent,
                pingpong=pingpong, split_out=split_out,
            )
        from .sm90.weight_grad_gemm import compile_weight_grad

        return compile_weight_grad(
            m, n, out_dtype, accumulate, arch, compile_options, a_stride=a_stride, tile_n=tile_n, persistent=persistent,
            pingpong=pingpong, split_out=split_out,
        )

    config = {
        "m": m, "n": n, "out_dtype": out_dtype, "accumulate": accumulate, "a_stride": a_stride, "tile_n": tile_n,
        "persistent": persistent,
    }
    if pingpong:  # (keys of existing variants unchanged)
        config["pingpong"] = True
    if split_out:
        config["split_out"] = True
    return KernelVariant("weight_grad", config, build)


def weight_grad_mxfp8_variant(
    m: int, n: int, out_dtype: str = "bf16", accumulate: bool = False, a_stride: int | None = None, tile_n: int = 128,
    split_out: bool = False,
) -> KernelVariant:
    """:func:`weight_grad_variant` on MXFP8 operands quantized along the rows (SM100 only:
    block-scaled tcgen05 MMAs on MN-major operands, mok/kernels/sm100/weight_grad_gemm.py;
    compile-verified, never run); one tile per CTA."""
    a_stride = m if a_stride is None else a_stride

    def build(arch: str, compile_options: str = "") -> Any:
        if arch not in MXFP8_GEMM_ARCHS:
            raise NotImplementedError(f"MXFP8 weight-gradient GEMM on {arch}: needs block-scaled MMAs, which only "
                                      f"{', '.join(MXFP8_GEMM_ARCHS)} have")
        from .sm100.weight_grad_gemm import compile_weight_grad_mxfp8_sm100

        return compile_weight_grad_mxfp8_sm100(
            m, n, out_dtype, accumulate, arch, compile_options, a_stride=a_stride, tile_n=tile_n, split_out=split_out
        )

    config = {"m": m, "n": n, "out_dtype": out_dtype, "accumulate": accumulate, "a_stride": a_stride, "tile_n": tile_n}
    if split_out:
        config["split_out"] = True
    return KernelVariant("weight_grad_mxfp8", config, build)


def router_grad_variant(topk: int, parts: int) -> KernelVariant:
    """d_topk_w[t, j] = Σ_c partial[slot_row[t, j], c] in column order (the SwiGLU backward's pieces)."""

    def build(arch: str, compile_options: str = "") -> Any:
        from .common.router_grad import compile_router_grad

        return compile_router_grad(topk, parts, arch, compile_options)

    return KernelVariant("router_grad", {"topk": topk, "parts": parts}, build)


ROUTER_LOGITS_TILE_N = 128  # the router logits' column tile: a narrow output (E columns) gets twice the CTAs of 256-wide tiles


def router_variants(hidden: int, num_experts: int, persistent: bool = True) -> list[KernelVariant]:
    """The built-in router's GEMMs (mok/router.py), experts padded to a multiple of 128: the
    logits, their dx (B read [K, N]) and the router weight's gradient (bf16)."""
    from ..router import padded_experts  # (one padding rule: the logits' width in mok/router.py)

    experts = padded_experts(num_experts)
    return [
        grouped_gemm_variant(experts, hidden, epilogue="plain", tile_n=ROUTER_LOGITS_TILE_N, persistent=persistent),
        grouped_gemm_variant(hidden, experts, epilogue="plain", b_major="n", persistent=persistent),
        weight_grad_variant(experts, hidden, "bf16", False, a_stride=experts, persistent=persistent),
    ]


def expert_mlp_variants(
    hidden: int, inter: int, topk: int, shared: bool = False, has_shared_expert: bool = False, main_grads: bool = False,
    persistent: bool = True,
) -> list[KernelVariant]:
    """The GEMM variants of one SwiGLU expert MLP (routed, or the shared expert), forward and backward.

    ``has_shared_expert``: the routed experts' down projection adds a shared expert's output as it combines.
    ``main_grads``: also the weight gradients added into fp32 buffers (dW_gate and dW_up in one launch,
    or, when the two buffers lie too far apart for one TMA descriptor, one launch each).
    ``persistent``: the persistent GEMMs (sm_90a), or the one-tile-per-CTA ones the layer runs on
    sm_100a / sm_103a (rows gathered first, no combining down projection).
    """
    gather = not shared and persistent
    variants = [
        grouped_gemm_variant(inter, hidden, epilogue="swiglu", gather_a=gather, persistent=persistent),
        grouped_gemm_variant(inter, hidden, epilogue="swiglu_save", gather_a=gather, persistent=persistent),
        grouped_gemm_variant(hidden, inter, persistent=persistent),  # the shared expert's down projection, and EP's
        grouped_gemm_variant(  # as grad_ops.swiglu_backward_gemm launches it for the layer (no skip_padding)
            inter, hidden, epilogue="swiglu_bwd", b_major="n", topk=topk, unit_scale=shared, persistent=persistent,
            pingpong=swiglu_backward_pingpong(persistent, False, default_tile_n(inter, hidden, True)),
        ),
        grouped_gemm_variant(hidden, 2 * inter, b_major="n", k_split=True, persistent=persistent),
        weight_grad_variant(hidden, inter, persistent=persistent),
        weight_grad_variant(2 * inter, hidden, split_out=True, persistent=persistent),  # dW_gate and dW_up in one launch over dh
    ]
    if main_grads:
        variants += [
            weight_grad_variant(hidden, inter, "f32", True, persistent=persistent),
            weight_grad_variant(2 * inter, hidden, "f32", True, split_out=True, persistent=persistent),
            weight_grad_variant(inter, hidden, "f32", True, a_stride=2 * inter, persistent=persistent),  # (a half of dh)
        ]
    if not shared:
        if persistent:
            variants.append(grouped_gemm_variant(hidden, inter, combine=True, topk=topk, has_shared=has_shared_expert))
        variants.append(router_grad_variant(topk, inter // default_tile_n(inter, hidden, True)))  # (EP's backward)
    return variants


def check_tiled_widths(name: str, widths: Mapping[str, int]) -> None:
    """The fused kernels tile every width of the layer (H, I, a shared expert's I_s) by 128:
    refuse others, naming them, before anything is compiled or launched (the reference path,
    mok.reference, takes any)."""
    if any(width % 128 or width < 128 for width in widths.values()):
        got = ", ".join(f"{width_name}={width}" for width_name, width in widths.items())
        raise ValueError(f"{name}: expected {', '.join(widths)} multiples of 128 (the fused kernels' tile), got {got}")


def variants_for(config: MoKConfig, arch: str = "sm_90a") -> list[KernelVariant]:
    """Every kernel variant a layer with this configuration uses on ``arch`` (forward and backward,
    the built-in router's GEMMs included: bf16 weight gradients, or fp32 ones added into main_grad
    buffers with ``fuse_wgrad_accumulation``).
    On sm_100a / sm_103a the layer's GEMMs exist for one GPU without ``one_launch`` (one tile per
    CTA), the MXFP8 path's GEMMs with ``precision="mxfp8"`` (mok.mxfp8_forward, mok.mxfp8_backward);
    other configurations list the arch-neutral kernels only there (:func:`unsupported_on` says why
    such a layer would not run). ``precision="mxfp8_emulated"`` adds its quantizers, dequantizers and
    bf16 GEMMs on any arch.
    Widths the fused kernels do not tile (not multiples of 128) are refused."""
    h, i = config.hidden, config.intermediate
    shared = {"shared_intermediate": config.shared_intermediate} if config.has_shared_expert else {}
    check_tiled_widths("config", {"hidden": h, "intermediate": i, **shared})
    variants = [
        schedule_variant(config.experts_per_rank, config.topk, config.block_m),
        gather_variant(h),  # (the EP forward's rows for the backward; gather_first)
        gather_variant(h, sources=2),  # the backward's dout and x rows
        combine_variant(h, config.topk, config.has_shared_expert, gathered=True),
        combine_variant(  # the backward's dx and router-weight gradient
            h, config.topk, config.has_shared_expert, gathered=True, unit_weights=True, router_parts=i // default_tile_n(i, h, True)
        ),
    ]
    if config.saved_h_format == "mxfp8":  # h kept for the backward in MXFP8 (mok/saved_mxfp8.py): the rows in use
        variants += [quantize_mxfp8_variant(bounded=True), quantize_mxfp8_variant(back=True, bounded=True)]
        if config.has_shared_expert:  # a shared expert of its own width: its h, every row
            variants += [quantize_mxfp8_variant(), quantize_mxfp8_variant(back=True)]
    if config.ep_size > 1:  # mok/ep.py: the exchange kernels and the combine over pushed [T, k] slots
        w, k = config.ep_size, config.topk
        variants += [ep_variant(kind, w, phase=1) for kind in ("signal", "wait")]  # (the publish phase: its own two)
        variants += [ep_variant("publish", w, width=h, topk=k), ep_variant("routing", w, topk=k), ep_variant("dispatch", w, width=h, topk=k)]
        variants += [ep_variant("overflow", w, phase=phase, width=h, topk=k) for phase in (0, 1)]  # capacity bound only
        if config.dispatch_format == "mxfp8":  # x quantized into the workspace as it is published, dequantized on arrival
            variants += [ep_variant("publish_mxfp8", w, width=h, topk=k), ep_variant("dispatch_mxfp8", w, width=h, topk=k)]
        variants.append(combine_variant(h, k, config.has_shared_expert, gathered=False))
        variants.append(combine_variant(h, k, config.has_shared_expert, gathered=False, unit_weights=True))  # backward dx
    main_grads = config.fuse_wgrad_accumulation
    if config.precision == "mxfp8_emulated":
        variants += mxfp8_emulated_variants(h, i, persistent=arch == "sm_90a")
    if arch == "sm_90a":
        variants += router_variants(h, config.num_experts)
        variants += expert_mlp_variants(h, i, config.topk, has_shared_expert=config.has_shared_expert, main_grads=main_grads)
        if config.ep_size > 1:  # mok/ep.py runs fc1 on the dispatched rows, already gathered; y and dx go out scattered
            k = config.topk
            variants += [grouped_gemm_variant(i, h, epilogue=epilogue) for epilogue in ("swiglu", "swiglu_save")]
            variants += [
                grouped_gemm_variant(h, i, scatter=True, topk=k),
                grouped_gemm_variant(h, 2 * i, scatter=True, topk=k, b_major="n", k_split=True),
            ]
        if config.has_shared_expert:
            variants += expert_mlp_variants(h, config.shared_intermediate, config.topk, shared=True, main_grads=main_grads)
        if config.one_launch:  # the forward in one launch, with and without h saved
            ep_world = config.ep_size if config.ep_size > 1 else None
            variants += [
                expert_mlp_variant(
                    h, i, config.topk, save_h=save_h, combine=True, has_shared=config.has_shared_expert,
                    schedule_experts=config.experts_per_rank, combine_phase=True, ep_world=ep_world,
                    dispatch_format=config.dispatch_format,
                )
                for save_h in (False, True)
            ]
            if config.has_shared_expert and config.shared_intermediate == i and ep_world is None:  # MoELayer's layout
                variants += [
                    expert_mlp_variant(
                        h, i, config.topk, save_h=save_h, combine=True, has_shared=True, schedule_experts=config.experts_per_rank,
                        combine_phase=True, shared_prefix=True,
                    )
                    for save_h in (False, True)
                ]
    elif config.ep_size == 1 and not config.one_launch:  # sm_100a / sm_103a: the single-GPU layer's one-tile GEMMs
        variants += router_variants(h, config.num_experts, persistent=False)
        if config.precision == "mxfp8":  # the routed experts' GEMMs on MXFP8; the rest (gathers, combine) above
            variants += mxfp8_layer_variants(h, i, config.topk, main_grads)
        else:
            variants += expert_mlp_variants(h, i, config.topk, main_grads=main_grads, persistent=False)
        if config.has_shared_expert:
            variants += expert_mlp_variants(
                h, config.shared_intermediate, config.topk, shared=True, main_grads=main_grads, persistent=False
            )
    unique = {(v.name, tuple(sorted(v.config.items()))): v for v in variants}  # the shared expert may repeat some
    return list(unique.values())


def get_kernel(variant: KernelVariant, arch: str, cache: "Any | None" = None) -> Any:
    """The compiled kernel for ``arch``: JIT-compiled on first use, then cached (memory and disk)."""
    from ..runtime.arch import dsl_target, normalize_arch
    from ..runtime.cache import default_cache
    from ..runtime.launch import compile_options

    cache = cache if cache is not None else default_cache()
    fn = cache.loaded(variant.name, variant.config, arch)  # the per-call path: one dict lookup
    if fn is not None:
        return fn
    arch = normalize_arch(arch)
    with dsl_target(arch):  # compile and export for arch, whatever GPU this machine has
        return cache.get(variant.name, variant.config, arch, lambda: variant.compile(arch, compile_options()))


def compiled_ptx(variant: KernelVariant, arch: str) -> str:
    """PTX of a fresh compile of ``variant`` for ``arch`` (for inspection and tests; bypasses the cache)."""
    from ..runtime.arch import dsl_target, normalize_arch

    arch = normalize_arch(arch)
    with dsl_target(arch), tempfile.TemporaryDirectory() as dump_dir:  # --keep-ptx also writes a file: keep it out of the cwd
        ptx = variant.compile(arch, f"--keep-ptx --dump-dir {dump_dir}").__ptx__
        if ptx and len(ptx) < 4096 and os.path.exists(ptx):  # some DSL versions hand back the path
            with open(ptx) as f:
                ptx = f.read()
    if not ptx:
        raise RuntimeError(f"CuTe DSL returned no PTX for {variant.describe()} on {arch}")
    return ptx


def compiled_sass(variant: KernelVariant, arch: str) -> str:
    """SASS (``cuobjdump -sass``) of a fresh compile of ``variant`` for ``arch``: what ptxas made of
    the PTX, for any target on any machine that has cuobjdump (bypasses the cache)."""
    import glob
    import subprocess

    from ..runtime.arch import dsl_target, normalize_arch

    arch = normalize_arch(arch)
    with dsl_target(arch), tempfile.TemporaryDirectory() as dump_dir:
        variant.compile(arch, f"--keep-cubin --dump-dir {dump_dir}")
        (cubin,) = glob.glob(os.path.join(dump_dir, "*.cubin"))
        return subprocess.run(["cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True).stdout
