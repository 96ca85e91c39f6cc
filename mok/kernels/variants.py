"""The kernel variants MoK compiles: one constructor per kernel family, and the tuning rules they follow.

A variant names one specialisation by static configuration only (shapes, top-k, flags, never
token counts: batch invariance) and knows how to compile it for each target. The ops build the
variant they launch with these constructors; :mod:`mok.plan` lists the variants a layer
configuration needs with the same constructors (what ``python -m mok precompile`` builds).
"""

from __future__ import annotations

import functools
from typing import Any

from ..runtime.arch import MXFP8_GEMM_ARCHS
from . import KernelVariant
from .constants import SCHEDULE_THREADS, check_activation

OPERANDS = ("bf16", "e4m3", "e4m3_block")  # GEMM operands: bf16; MXFP8 (E4M3, an E8M0 scale per 32 along K; SM100);
# FP8 with an fp32 scale per 128 along K (rows) and per 128 x 128 block (weights): DeepSeek-V3's recipe (Hopper)


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
    if unit_weights:
        config["unit_weights"] = True
    if router_parts:
        config["router_parts"] = router_parts
    return KernelVariant("combine", config, build)


def gather_variant(width: int, sources: int = 1, fp8: bool = False, bounded: bool = False) -> KernelVariant:
    """Row gather into the expert-grouped buffer (zeros for padding rows); ``sources`` 2: the same
    rows of two tensors in one launch; ``bounded``: up to a row count on the device; ``fp8``: E4M3
    rows ``width`` elements wide with their 128-blocks' fp32 scales, always bounded
    (mok/kernels/common/gather.py)."""
    if sources not in (1, 2) or (fp8 and sources != 1):
        raise ValueError(f"sources: expected 1 or 2 (1 with fp8), got {sources}")
    bounded = bounded and not fp8

    def build(arch: str, options: str = "") -> Any:
        from .common.gather import compile_gather

        return compile_gather(width, arch, options, sources=sources, fp8=fp8, bounded=bounded)

    key = {"width": width} | ({"sources": 2} if sources == 2 else {}) | ({"fp8": True} if fp8 else {}) | ({"bounded": True} if bounded else {})
    return KernelVariant("gather", key, build)


def quantize_mxfp8_variant(back: bool = False, bounded: bool = False, mma_order: bool = False, columns: bool = False, *,
                           width: int | None = None, segments: int = 1, matrix_rows: int | None = None) -> KernelVariant:
    """bf16 rows -> MXFP8 elements and E8M0 scales (mok/mxfp8.py's rule), or with ``back`` MXFP8 ->
    bf16; no static shape. ``bounded``: only the rows a device count says are in use. ``mma_order``
    (quantizing): the scales in the order SM100's block-scaled MMAs read (mok.mxfp8.mma_scale_layout).
    ``columns`` (quantizing): blocks of 32 rows down each column (the transpose's MXFP8). ``width``,
    ``segments``, ``matrix_rows``: rows whose blocks or chunks the width does not tile, as
    :func:`mxfp8_row_shape` gives them (mok/kernels/common/mxfp8_quantize.py)."""
    if back and (mma_order or columns or matrix_rows is not None):
        raise ValueError("mma_order, columns, matrix_rows: only when quantizing")

    def build(arch: str, options: str = "") -> Any:
        from .common.mxfp8_quantize import compile_mxfp8

        return compile_mxfp8(arch, options, back=back, bounded=bounded, mma_order=mma_order, columns=columns, width=width,
                             segments=segments, matrix_rows=matrix_rows)

    flags = {"bounded": bounded, "mma_order": mma_order, "columns": columns}
    config = {name: True for name, on in flags.items() if on}
    shape = {"width": width, "segments": segments if segments != 1 else None, "matrix_rows": matrix_rows}
    config |= {name: value for name, value in shape.items() if value is not None}
    return KernelVariant("dequantize_mxfp8" if back else "quantize_mxfp8", config, build)


def mxfp8_row_shape(width: int, *, segments: int = 1, mma_order: bool = False, matrix_rows: int | None = None) -> dict:
    """The static shape MXFP8's row quantizer or dequantizer takes for rows of ``width`` values
    (``segments`` 2: each half blocked on its own; ``matrix_rows``: a stack of matrices of that many
    rows, chunked one at a time in the MMA's order): none where the rows are one run of whole
    blocks (every segment whole 32-blocks, and with ``mma_order`` whole 128-value chunks and
    matrices of whole 128-row chunks: the kernel that does not know the width), else the keyword
    arguments of :func:`quantize_mxfp8_variant` (a segment's width, ...)."""
    segment = width // segments
    whole_rows = segment % (128 if mma_order else 32) == 0
    whole_matrices = not mma_order or matrix_rows is None or matrix_rows % 128 == 0
    if whole_rows and whole_matrices:
        return {}
    return dict(width=segment, segments=segments) | ({} if whole_matrices else dict(matrix_rows=matrix_rows))


def mxfp8_column_shape(columns: int, *, segments: int = 1) -> dict:
    """The static shape MXFP8's column quantizer (the weight gradients' operands, scales in the MMA's
    order) takes for a matrix of ``columns`` (``segments`` 2: each half chunked on its own, dh's):
    none where every segment starts a chunk anyway (one segment, or halves of whole chunks: the
    kernel that reads the column count at run time), else the keyword arguments of
    :func:`quantize_mxfp8_variant` (a half's columns, two segments)."""
    half = columns // segments
    return {} if segments == 1 or half % 128 == 0 else dict(width=half, segments=segments)


def quantize_fp8_block_variant(width: int, block_rows: int = 1, power_of_two: bool = False, bounded: bool = False, *,
                               segments: int = 1, matrix_rows: int | None = None, mma_scales: bool = False,
                               gathered: bool = False, columns: bool = False, back: bool = False,
                               copies_rows: bool = False) -> KernelVariant:
    """bf16 -> E4M3 with fp32 scales per 128 values (mok.fp8_block's rule, DeepSeek-V3's recipe):
    ``block_rows`` 1 for rows (1 x 128 blocks, the scales transposed), 128 for weights (128 x 128).
    ``bounded``: only the rows a device count says are in use. ``width`` a multiple of 16 (a
    partial last block); ``segments`` 2: each half of a row blocked on its own (dh for the dx
    GEMM's K halves); ``matrix_rows``: weights whose N (given) is no multiple of 128, each expert's
    rows tiled on their own; ``mma_scales`` (power_of_two): the scales as E8M0 bytes in the order
    SM100's block-scaled MMAs read; ``gathered`` (rows): output row r quantizes source row
    row_source[r], zeros where negative; ``columns`` (rows, one segment): the rows' transpose
    quantized, 128-row blocks down each column (mok/kernels/common/fp8_block_quantize.py; with
    ``mma_scales`` the elements in the rows' layout and E8M0 scales in the MMA order, SM100's MXFP8
    weight-gradient operands); ``back`` (rows, one segment, fp32 scales): E4M3 rows with their
    scales back to bf16; ``copies_rows`` (gathered): the gathered bf16 rows written too."""
    if (columns or back) and (block_rows != 1 or (segments != 1 and not (columns and mma_scales)) or matrix_rows is not None):
        raise ValueError(f"{'columns' if columns else 'back'}: rows (block_rows 1) in one segment (columns: two with mma_scales) only")
    if back and mma_scales:
        raise ValueError("back: fp32 scales only (E8M0 rows in the MMA order are MXFP8's: mok.ops.dequantize_mxfp8)")
    if back and (columns or gathered or power_of_two):
        raise ValueError("back: not with columns, gathered or power_of_two (the scales are what they are)")
    if copies_rows and (not gathered or columns):
        raise ValueError("copies_rows: the gathered rows' bf16 copy, with gathered rows (not columns) only")

    def build(arch: str, options: str = "") -> Any:
        from .common.fp8_block_quantize import compile_fp8_block_quantize

        return compile_fp8_block_quantize(width, block_rows, power_of_two, bounded, arch, options, segments, matrix_rows, mma_scales,
                                          gathered, columns, back, copies_rows)

    flags = {"power_of_two": power_of_two, "bounded": bounded, "mma_scales": mma_scales, "gathered": gathered, "columns": columns,
             "back": back, "copies_rows": copies_rows}
    config = {"width": width, "block_rows": block_rows, **{name: True for name, on in flags.items() if on}}
    if segments != 1:
        config["segments"] = segments
    if matrix_rows is not None:
        config["matrix_rows"] = matrix_rows
    return KernelVariant("quantize_fp8_block", config, build)


def fp8_weights_quantizer(n: int, k: int, power_of_two: bool = False, mma_scales: bool = False) -> KernelVariant:
    """The 128 x 128 quantizer of expert weights [E, N, K] (mok.ops.quantize_fp8_weights): each
    expert's rows tiled on their own where 128 does not divide N; ``mma_scales`` as there."""
    return quantize_fp8_block_variant(k, 128, power_of_two, matrix_rows=n if n % 128 else None, mma_scales=mma_scales)


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


def ep_variant(kind: str, world: int, *, phase: int = 0, width: int = 8, topk: int = 1, power_of_two: bool = False,
               scale_order: str = "rows") -> KernelVariant:
    """One expert-parallel exchange kernel (mok/kernels/common/ep.py): signal, wait, publish,
    publish_mxfp8, publish_fp8_block (``power_of_two``: its scale rule), routing, dispatch,
    dispatch_mxfp8, dispatch_fp8_block (``scale_order`` "mma": the scales as E8M0 in the MMA order,
    SM100's) or overflow."""

    def build(arch: str, options: str = "") -> Any:
        from .common.ep import compile_ep

        return compile_ep(kind, world, arch, options, phase=phase, width=width, topk=topk, power_of_two=power_of_two,
                          scale_order=scale_order)

    config = {"world": world, "phase": phase, "width": width, "topk": topk}
    if power_of_two:
        config["power_of_two"] = True
    if scale_order != "rows":
        config["scale_order"] = scale_order
    return KernelVariant(f"ep_{kind}", config, build)


SWIGLU_BACKWARD_TILE_N = 128  # the SwiGLU-backward GEMM's column tile, every operand (one product; FP8: see below)


def default_tile_n(n: int, k: int, swiglu: bool, operand: str = "bf16") -> int:
    """Column tile of the grouped GEMM, from static shapes only (batch invariance).

    SwiGLU holds two accumulators, so 128 wide; a plain GEMM takes 256 where N allows
    (docs/notes/tile-shapes-and-padding.md: 256 won at qwen3's down projection, the two were within noise
    of each other at dsv3's). FP8 with block scales ("e4m3_block") holds each K block's product
    beside the running sum, twice the accumulators: 128 wide, 64 for SwiGLU's two products. (The
    SwiGLU backward, one product, takes SWIGLU_BACKWARD_TILE_N on every operand: on FP8 its block
    accumulators beside the epilogue fit with the register hand-over, and the 64-wide tile ran it
    1.2-1.3x slower: docs/notes/fp8-block-hopper.md.)"""
    if operand == "e4m3_block":
        return 64 if swiglu else 128
    return 256 if not swiglu and n % 256 == 0 else 128


def swiglu_backward_pingpong(persistent: bool, tile_n: int = 128) -> bool:
    """Whether the SwiGLU-backward GEMM runs ping-pong: wherever it can (persistent, 128-wide
    tiles; 4-16% faster than the cooperative kernel, docs/notes/pingpong-backward-gemms.md)."""
    return persistent and tile_n == 128


def weight_grad_pingpong(persistent: bool, tile_n: int, operand: str = "bf16") -> bool:
    """Whether the weight-gradient GEMM runs ping-pong: wherever it can (persistent, 128-wide
    tiles, bf16 operands; 4-21% faster than the cooperative kernel, docs/notes/pingpong-backward-gemms.md;
    the FP8 kernel is cooperative, MXFP8's SM100 one has no ping-pong)."""
    return persistent and tile_n == 128 and operand == "bf16"


def _check_operand(operand: str, persistent: bool, b_major: str = "k") -> None:
    if operand not in OPERANDS:
        raise ValueError(f"operand: expected one of {OPERANDS}, got {operand!r}")
    if operand == "e4m3" and b_major != "k":
        raise ValueError("operand='e4m3': the block-scaled (SM100) kernels take K-major B: pass b_major='k' (the weights transposed)")
    if operand == "e4m3_block" and (not persistent or b_major != "k"):
        raise ValueError("operand='e4m3_block': the FP8 (Hopper) kernel is persistent with K-major B: pass persistent=True and b_major='k'")


def check_deep_turn(deep_turn: int, block_buffers: int) -> None:
    """``deep_turn`` (the FP8 two-set schedule's stages a turn with two stages' WGMMAs in flight,
    mok/kernels/sm90/block_scaled.py): 0 (off), or an even count >= 2 with two block sets."""
    if deep_turn and (deep_turn < 2 or deep_turn % 2 or block_buffers != 2):
        raise ValueError(f"deep_turn: expected 0, or an even count >= 2 with block_buffers=2, got {deep_turn} with block_buffers={block_buffers}")


DEEP_TURNS = {"plain": 4, "swiglu": 4, "swiglu_save": 4, "swiglu_bwd": 4, "weight_grad": 8}  # the FP8 GEMM forms' default turns (the others: none)
# the FP8 weight gradient's stages of a tile issued before the previous tile's epilogue: 2 measured
# 2-7% faster than 1, the same bits (docs/notes/fp8-block-hopper.md); perf/gemm_sweep.py
# --fp8-wgrad-stages times the two
WEIGHT_GRAD_STAGES_UNDER_EPILOGUE = 2
# the share of each FP8 promotion's FFMAs marked so that the warp scheduler may switch warps among
# them (mok/runtime/sass_hints.py; Hopper's kernels, the same bits): 0, none; half or all of them
# measured 0-10% slower on the forward's GEMMs and no faster on the weight gradient
# (docs/notes/fp8-block-hopper.md); perf/gemm_sweep.py --fp8-yield-hints times 0, 1/2 and 1
PROMOTIONS_YIELD = 0.0
# the FP8 GEMM forms (the grouped GEMM's epilogues, "weight_grad") whose two MMA warpgroups issue
# each stage's WGMMAs in a fixed order, warpgroup 1's after warpgroup 0's (cuBLAS's FP8 kernel does;
# mok/kernels/sm90/block_scaled.py, the same bits): the gate/up GEMM's, 3-4% faster at dsv3 and
# level at qwen3-235b; the down GEMM 2-7% and the SwiGLU backward 0-3% slower so (H100); the
# weight gradient's not measured yet (perf/gemm_sweep.py --fp8-issue-order times each form both
# ways, --fp8-wgrad-issue-order the weight gradient alone; docs/notes/fp8-block-hopper.md)
ISSUE_ORDER: frozenset[str] = frozenset({"swiglu", "swiglu_save"})
# Hopper's bf16 plain grouped GEMM (the down projection, its EP scatter form, dx) with 256-wide tiles and K of at least
# TAIL_SPLIT_MIN_K: where the persistent walk's last round would keep at most half the CTAs busy,
# its tiles are taken in 128-wide halves by twice the CTAs (GroupedGemmSm90.tail_walk; the same
# bits), its walk bounded at the last row tile with rows. Mixtral's down projection (K = 14336,
# 8-9 rounds) 5-12% faster, its dx 6-13%, the scatter form 12% (the walk's bound most of it where
# the rows ended inside its last group), dsv3's dx 1.5%; at K = 768 and 1536 1% slower (qwen3-30b,
# split: a half round of ~6 us saves less than the walk's bound and the half tiles cost; qwen3-235b,
# its last round too full to split) (H100, perf/gemm_sweep.py --tail-split)
TAIL_SPLIT = True
TAIL_SPLIT_MIN_K = 4096
# every other persistent grouped GEMM on Hopper walks its tiles up to the last row tile with rows,
# not over the schedule's capacity (GroupedGemmSm90.bounded_walk; the tail split's kernels always do;
# the same bits): 12-13% on mixtral's down projection where the rows ended inside the walk's last
# group of 8 row tiles; on the other forms (perf/gemm_sweep.py --bounded-walk, H100) mixtral's
# gate/up GEMM 1-2% faster, inside the spread, the qwen3-30b forms 1-3% slower (the scan of ~380
# row tiles), the rest level: off (docs/notes/grouped-gemms-vs-quack.md, "The walk's bound")
BOUNDED_WALK = False
# the settings above read each time a kernel variant is built, so that a benchmark may change them
# for one run (perf/bench_layer.py and perf/step_kernels.py --set NAME=VALUE)
TUNABLE_SETTINGS = ("DEEP_TURNS", "WEIGHT_GRAD_STAGES_UNDER_EPILOGUE", "PROMOTIONS_YIELD", "ISSUE_ORDER", "TAIL_SPLIT", "BOUNDED_WALK")


def ordered_issue_for(form: str, operand: str) -> bool:
    """Whether the FP8 kernel of ``form`` (a grouped GEMM's epilogue, or "weight_grad") issues each
    stage's WGMMAs in the fixed order (:data:`ISSUE_ORDER`); never on other operands."""
    return operand == "e4m3_block" and form in ISSUE_ORDER


def tail_split_for(k: int, epilogue: str, operand: str, tile_n: int, options: dict) -> bool:
    """Whether Hopper's grouped GEMM of this form takes its last round in half tiles
    (:data:`TAIL_SPLIT`): the persistent cooperative bf16 plain GEMM (k_split too; EP's scatter
    form too) with 256-wide tiles and K >= TAIL_SPLIT_MIN_K, no gather, pairs of row tiles or
    biases (``options``: the variant's)."""
    others = ("gather_a", "pingpong", "bias", "cluster_m")
    return (TAIL_SPLIT and k >= TAIL_SPLIT_MIN_K and epilogue == "plain" and operand == "bf16" and tile_n == 256 and options["persistent"]
            and not any(options.get(name) for name in others))


def with_yield_hints(variant: KernelVariant, operand: str) -> KernelVariant:
    """``variant`` with :data:`PROMOTIONS_YIELD`'s hints patched into its sm_90 code where its operands
    are FP8 with 128-block scales (the share named in its config: entries of their own), else as it is."""
    if operand != "e4m3_block" or not PROMOTIONS_YIELD:
        return variant
    from ..runtime.sass_hints import let_promotions_yield

    share = float(PROMOTIONS_YIELD)
    if not 0 < share <= 1:
        raise ValueError(f"variants.PROMOTIONS_YIELD: expected a share in [0, 1], got {PROMOTIONS_YIELD!r}")
    return KernelVariant(variant.name, {**variant.config, "yield_hints": share}, variant.compile,
                         functools.partial(let_promotions_yield, share=share))


def deep_turn_for(deep_turn: int | None, block_buffers: int, form: str) -> int:
    """``deep_turn`` checked (:func:`check_deep_turn`), None resolved to what measured fastest
    (perf/RESULTS.md, "FP8 schedules" and "FP8 gate/up GEMM in turns of 4") for ``form`` (a grouped
    GEMM's epilogue, or "weight_grad"): turns of 4 for the two-set plain GEMMs (the down
    projection, dx: 8-12% faster than none on the H200, turns of 8 no better) and the gate/up GEMM
    (SwiGLU's forward: 3-9% faster on an H100, within -1% .. +2% on the H200), of 8 for the FP8
    weight gradient (2-4%), of 4 in the SwiGLU backward (2.4-3.3% faster than none since it reads h
    from shared memory; 3-4% slower while it loaded h into registers, H100:
    docs/notes/fp8-block-hopper.md), 0 without two sets."""
    if deep_turn is None:
        deep_turn = DEEP_TURNS.get(form, 0) if block_buffers == 2 else 0
    check_deep_turn(deep_turn, block_buffers)
    return deep_turn


def weight_grad_block_sets(operand: str) -> int:
    """The weight gradient's sets of block accumulators: 2 on FP8 with block scales (used in turn:
    mok/kernels/sm90/block_scaled.py consume_outer_scaled_tile), else none beyond the one."""
    return 2 if operand == "e4m3_block" else 1


def block_buffers_for(block_buffers: int | None, operand: str) -> int:
    """The FP8 GEMM's sets of block accumulators (mok/kernels/sm90/block_scaled.py): 1, or 2 with
    operand "e4m3_block" (every epilogue; the SwiGLU backward's then reads h from shared memory).
    None: 2 where allowed (a stage's WGMMAs then overlap the previous stage's promotion; the same
    bits; measured 8-26% faster than one set in the forward forms), else 1."""
    allowed = operand == "e4m3_block"
    if block_buffers is None:
        return 2 if allowed else 1
    if block_buffers not in (1, 2) or (block_buffers == 2 and not allowed):
        raise ValueError(f"block_buffers: expected 1, or 2 with operand='e4m3_block', got {block_buffers} with operand={operand!r}")
    return block_buffers


def _no_mxfp8_here(what: str, arch: str) -> NotImplementedError:
    return NotImplementedError(
        f"{what} on MXFP8 operands on {arch}: needs block-scaled MMAs, which only {', '.join(MXFP8_GEMM_ARCHS)} have "
        "(on Hopper MoK keeps MXFP8 as a storage and transport format and computes in bf16)"
    )


def grouped_gemm_variant(
    n: int,
    k: int,
    *,
    epilogue: str = "plain",
    tile_n: int | None = None,
    stages: int | None = None,
    b_major: str = "k",
    k_split: bool = False,
    topk: int = 1,
    unit_scale: bool = False,
    persistent: bool = True,
    gather_a: bool = False,
    scatter: bool = False,
    pingpong: bool = False,
    operand: str = "bf16",
    b_expert_stride: int | None = None,
    activation: str = "swiglu",
    bias: bool = False,
    block_buffers: int | None = None,
    b_row_stride: int | None = None,
    cluster_m: int = 1,
    deep_turn: int | None = None,
    out_format: str = "bf16",
    power_of_two: bool = False,
) -> KernelVariant:
    """Expert-grouped GEMM (sm_90a: WGMMA + TMA, mok/kernels/sm90/grouped_gemm.py; sm_100a / sm_103a:
    tcgen05, mok/kernels/sm100/grouped_gemm.py, compile-verified, never run).

    ``epilogue``: plain, swiglu, swiglu_save (also writes h) or swiglu_bwd (SwiGLU backward with
    the router-weight gradient's partial sums; needs ``topk``, or ``unit_scale`` for the shared
    expert). ``b_major`` "n" reads B as [E, K, N]; ``k_split`` takes the two K halves from B and
    B2. ``persistent``: one CTA per SM walks the tiles, loads running ahead while the epilogue of
    the last tile runs (Hopper: a producer warpgroup, two MMA warpgroups; SM100: a load warp, an
    MMA warp, four epilogue warps, two accumulator stages). ``stages``: shared-memory pipeline depth;
    None fills shared memory. ``gather_a`` (persistent): A is the token matrix, its rows gathered
    by the schedule's row_token. ``scatter`` (the down projection): each row goes to its (token,
    slot) row of the combine slots of the token's rank (``topk`` slots per token). ``pingpong``
    (Hopper, persistent swiglu_bwd, 128-wide tiles): the MMA warpgroups take whole tiles in turn
    (SM100's kernel overlaps its epilogue anyway: no effect there).
    ``operand`` "e4m3": MXFP8 operands with E8M0 scales (block-scaled tcgen05 MMAs, SM100 only;
    K-major B). ``b_expert_stride``: elements from one expert's B to the next
    (None: N·K, packed; 2·I·H for the halves of one [E, 2I, H] gate/up tensor, read in place);
    ``b_row_stride``: from one of its rows in memory to the next (None: packed; 2·H for the even
    or odd rows of one [E, 2I, H] tensor, gate and up interleaved as gpt-oss stores them).
    ``activation``: the SwiGLU epilogues' gated activation (swiglu, clamped_swiglu, geglu:
    mok/kernels/common/gated_activation.py). ``bias`` (Hopper): the experts' biases added in the
    plain and SwiGLU epilogues; swiglu_bwd leaves the down bias's router-gradient piece a column
    (mok/kernels/common/grouped_gemm.py). ``block_buffers`` (operand "e4m3_block", every epilogue):
    2 lets a stage's WGMMAs run while the previous stage's product is promoted
    (mok/kernels/sm90/block_scaled.py; the same bits); None: :func:`block_buffers_for`'s choice.
    ``deep_turn`` (with two block sets): turns of that many stages with two stages' WGMMAs in flight
    (0: one); None: :func:`deep_turn_for`'s choice.
    ``cluster_m`` (bf16, or Hopper's e4m3_block; Hopper: the persistent cooperative kernel): 2 runs clusters of two CTAs on
    two row tiles of one column tile, which load B's tile once for both (TMA multicast) where one
    expert has both row tiles (mok/kernels/sm90/grouped_gemm.py, sm100/grouped_gemm.py; the same
    bits as 1).
    ``out_format`` "e4m3_block" (Hopper, operand "e4m3_block", the SwiGLU forward epilogues): the
    activation leaves as E4M3 with 1 x 128 block scales (``power_of_two``: that rule's scales),
    the down GEMM's operand with no bf16 copy and no quantizer pass (GroupedGemmSm90.store_activation_e4m3).
    """
    _check_operand(operand, persistent, b_major)
    block_buffers = block_buffers_for(block_buffers, operand)
    deep_turn = deep_turn_for(deep_turn, block_buffers, epilogue)
    check_activation(activation)
    if (b_expert_stride is not None or b_row_stride is not None) and operand != "bf16":
        raise ValueError("b_expert_stride, b_row_stride: bf16 weights only (quantized weights are packed tensors)")
    if tile_n is None:
        tile_n = SWIGLU_BACKWARD_TILE_N if epilogue == "swiglu_bwd" else default_tile_n(n, k, epilogue != "plain", operand)
    topk = topk if (epilogue == "swiglu_bwd" and not unit_scale) or scatter else 1
    options = dict(epilogue=epilogue, b_major=b_major, k_split=k_split, topk=topk, unit_scale=unit_scale, persistent=persistent)
    for flag, on in (("gather_a", gather_a), ("scatter", scatter), ("pingpong", pingpong), ("bias", bias)):
        if on:  # (absent when off: fewer keys to read in a cache listing)
            options[flag] = True
    if cluster_m != 1:
        if cluster_m != 2 or operand not in ("bf16", "e4m3_block"):
            raise ValueError(f"cluster_m: expected 1, or 2 with bf16 or e4m3_block operands, got {cluster_m} with operand={operand!r}")
        options["cluster_m"] = cluster_m
    if b_expert_stride is not None:
        options["b_expert_stride"] = b_expert_stride
    if b_row_stride is not None:
        options["b_row_stride"] = b_row_stride
    if activation != "swiglu" and epilogue != "plain":  # (absent by default and where no activation is computed)
        options["activation"] = activation
    if out_format != "bf16" or power_of_two:
        if operand != "e4m3_block":
            raise ValueError(f"out_format={out_format!r}, power_of_two={power_of_two}: E4M3 output is the FP8 (operand 'e4m3_block') "
                             f"SwiGLU forward's, got operand={operand!r}")
        options["out_format"] = out_format
        if power_of_two:
            options["power_of_two"] = True
    if ordered_issue_for(epilogue, operand):
        options["ordered_issue"] = True
    hopper_only = {"tail_split": True} if tail_split_for(k, epilogue, operand, tile_n, options) else {}
    if BOUNDED_WALK and options["persistent"] and not hopper_only:
        hopper_only["bounded_walk"] = True

    def build(arch: str, compile_options: str = "") -> Any:
        if arch in MXFP8_GEMM_ARCHS:  # tcgen05 (compile-verified only)
            if operand == "e4m3_block":
                raise NotImplementedError(f"grouped GEMM on FP8 with fp32 128-block scales on {arch}: Hopper's kernel only (SM100 runs "
                                          "power-of-two block scales as MXFP8 operands: operand 'e4m3', mok.ops.quantize_fp8_rows(scale_order='mma'))")
            from .sm100.grouped_gemm import compile_grouped_gemm_sm100

            return compile_grouped_gemm_sm100(n, k, arch, compile_options, operand=operand, tile_n=tile_n, stages=stages, **options)
        if operand == "e4m3":
            raise _no_mxfp8_here("grouped GEMM", arch)
        from .sm90.grouped_gemm import compile_grouped_gemm

        precision = {"operand": operand} if operand != "bf16" else {}
        if block_buffers != 1:
            precision["block_buffers"] = block_buffers
        if deep_turn:
            precision["deep_turn"] = deep_turn
        return compile_grouped_gemm(n, k, arch, compile_options, tile_n=tile_n, stages=stages, **options, **precision, **hopper_only)

    config = {"n": n, "k": k, "tile_n": tile_n, "stages": stages or 0, **options, **hopper_only}  # stages 0: as deep as fits
    if operand != "bf16":
        config["operand"] = operand
    if block_buffers != 1:
        config["block_buffers"] = block_buffers
    if deep_turn:
        config["deep_turn"] = deep_turn
    return with_yield_hints(KernelVariant("grouped_gemm", config, build), operand)


def weight_grad_variant(
    m: int, n: int, out_dtype: str = "bf16", accumulate: bool = False, a_stride: int | None = None, tile_n: int = 128,
    persistent: bool = True, pingpong: bool | None = None, split_out: bool = False, operand: str = "bf16",
    interleaved_out: bool = False, deep_turn: int | None = None,
) -> KernelVariant:
    """Per-expert weight gradient out[e] (+)= Aᵀ·B over the expert's rows (sm_90a: WGMMA + TMA;
    sm_100a / sm_103a: tcgen05, compile-verified, never run).

    ``persistent``: one CTA per SM walks the output tiles; ``pingpong`` (Hopper, persistent,
    128-wide tiles): its two MMA warpgroups take whole tiles in turn (no effect on SM100, whose
    kernel overlaps its epilogue anyway); None: :func:`weight_grad_pingpong`. ``split_out``: the two halves of M into two [E, M/2, N] tensors
    (dW_gate and dW_up in one launch); ``interleaved_out``: those two are the even and odd rows of
    one [E, M, N] tensor (gpt-oss's gate_up_proj gradient, its rows interleaved). ``operand``
    "e4m3": MXFP8 operands quantized along the rows (block-scaled MMAs on MN-major operands, SM100
    only); "e4m3_block": FP8 with 1 x 128 blocks along the rows, the operands the rows' transposes
    (Hopper's FP8 WGMMAs, K-major; persistent, cooperative, 128-wide tiles, two block sets in turn;
    ``deep_turn`` as in :func:`grouped_gemm_variant`, None: :func:`deep_turn_for`'s choice).
    """
    _check_operand(operand, persistent)
    deep_turn = deep_turn_for(deep_turn, weight_grad_block_sets(operand), "weight_grad")
    a_stride = m if a_stride is None else a_stride
    pingpong = weight_grad_pingpong(persistent, tile_n, operand) if pingpong is None else pingpong
    options = dict(a_stride=a_stride, tile_n=tile_n, persistent=persistent, pingpong=pingpong, split_out=split_out)
    if interleaved_out:
        options["interleaved_out"] = True

    under = WEIGHT_GRAD_STAGES_UNDER_EPILOGUE if operand == "e4m3_block" else 1
    ordered = ordered_issue_for("weight_grad", operand)

    def build(arch: str, compile_options: str = "") -> Any:
        turn = {"deep_turn": deep_turn} if deep_turn else {}
        if under != 1:
            turn["stages_under_epilogue"] = under
        if ordered:
            turn["ordered_issue"] = True
        if arch in MXFP8_GEMM_ARCHS:
            from .sm100.weight_grad_gemm import compile_weight_grad_sm100

            if operand == "e4m3_block":
                raise NotImplementedError(f"weight-gradient GEMM on FP8 with fp32 128-block scales on {arch}: Hopper's kernel only "
                                          "(SM100 takes MXFP8 operands: operand 'e4m3')")
            return compile_weight_grad_sm100(m, n, out_dtype, accumulate, arch, compile_options, operand=operand, **options)
        if operand == "e4m3":
            raise _no_mxfp8_here("weight-gradient GEMM", arch)
        from .sm90.weight_grad_gemm import compile_weight_grad

        return compile_weight_grad(m, n, out_dtype, accumulate, arch, compile_options, operand=operand, **options, **turn)

    config = {
        "m": m, "n": n, "out_dtype": out_dtype, "accumulate": accumulate, "a_stride": a_stride, "tile_n": tile_n,
        "persistent": persistent,
    }
    for flag, on in (("pingpong", pingpong), ("split_out", split_out), ("interleaved_out", interleaved_out)):
        if on:
            config[flag] = True
    if operand != "bf16":
        config["operand"] = operand
    if deep_turn:
        config["deep_turn"] = deep_turn
    if under != 1:
        config["stages_under_epilogue"] = under
    if ordered:
        config["ordered_issue"] = True
    return with_yield_hints(KernelVariant("weight_grad", config, build), operand)


def router_grad_variant(topk: int, parts: int) -> KernelVariant:
    """d_topk_w[t, j] = Σ_c partial[slot_row[t, j], c] in column order (the SwiGLU backward's pieces)."""

    def build(arch: str, compile_options: str = "") -> Any:
        from .common.router_grad import compile_router_grad

        return compile_router_grad(topk, parts, arch, compile_options)

    return KernelVariant("router_grad", {"topk": topk, "parts": parts}, build)


def column_sums_variant(width: int, weighted: bool = False, topk: int = 1) -> KernelVariant:
    """Per-expert column sums of expert-grouped rows in a fixed order (the biases' gradients;
    ``weighted``: each row times its router weight, ``topk`` slots per token)."""

    def build(arch: str, compile_options: str = "") -> Any:
        from .common.bias_grads import compile_column_sums

        return compile_column_sums(width, weighted, topk, arch, compile_options)

    config = {"width": width, **({"weighted": True, "topk": topk} if weighted else {})}
    return KernelVariant("column_sums", config, build)


def row_dots_variant(width: int, out_stride: int) -> KernelVariant:
    """<rows[r], bias[e(r)]> per expert-grouped row into every ``out_stride``-th element (the down
    bias's piece of the router-weight gradient, the last column of the SwiGLU backward's pieces)."""

    def build(arch: str, compile_options: str = "") -> Any:
        from .common.bias_grads import compile_row_dots

        return compile_row_dots(width, out_stride, arch, compile_options)

    return KernelVariant("row_dots", {"width": width, "out_stride": out_stride}, build)


def expert_mlp_variant(
    hidden: int, inter: int, topk: int, num_experts: int, *, save_h: bool = False, has_shared: bool = False,
    ep_world: int | None = None, shared_prefix: bool = False, dispatch_format: str = "bf16", gate_up_stride: int | None = None,
    activation: str = "swiglu", gate_up_row_stride: int | None = None, bias: bool = False,
) -> KernelVariant:
    """The routed experts' whole forward in one persistent launch: the schedule of the
    routing over ``num_experts`` experts, a grid barrier, fc1 (gathered rows, SwiGLU; ``save_h``
    also writes h) and fc2 tiles in one global order, each fc2 row tile waiting for its fc1 row
    tile, a second grid barrier, the combine (with a shared expert's output: ``has_shared``).
    ``ep_world`` (W): the whole expert-parallel forward of one rank of W, exchanges included;
    ``shared_prefix`` (with ``has_shared``, one GPU): the shared expert runs as expert E, its rows
    first; ``dispatch_format`` "mxfp8" (with ``ep_world``): x published in MXFP8, dequantized as it
    arrives; ``gate_up_stride``, ``gate_up_row_stride``: w_gate's and w_up's expert and row strides
    (None: packed); ``activation``: fc1's gated activation; ``bias``: the experts' biases. See mok/kernels/common/expert_mlp.py (Hopper's kernel: sm90/, SM100's: sm100/)."""
    check_activation(activation)
    options = dict(save_h=save_h, has_shared=has_shared, num_experts=num_experts)
    if ep_world is not None:
        options["ep_world"] = ep_world
    if shared_prefix:
        options["shared_prefix"] = True
    if dispatch_format != "bf16":
        options["dispatch_format"] = dispatch_format
    if gate_up_stride is not None:
        options["gate_up_stride"] = gate_up_stride
    if activation != "swiglu":
        options["activation"] = activation
    if gate_up_row_stride is not None:
        options["gate_up_row_stride"] = gate_up_row_stride
    if bias:
        options["bias"] = True

    def build(arch: str, compile_options: str = "") -> Any:
        if arch in MXFP8_GEMM_ARCHS:  # tcgen05 (compile-verified only): fc2 in 128-column tiles, its stages fc1's
            from .sm100.expert_mlp import compile_expert_mlp_sm100

            return compile_expert_mlp_sm100(hidden, inter, topk, arch, compile_options, **options)
        from .sm90.expert_mlp import compile_expert_mlp

        # fc2 in the column tile the down projection takes on its own (the same bits either way; see default_tile_n)
        return compile_expert_mlp(hidden, inter, topk, arch, compile_options, fc2_tile_n=default_tile_n(hidden, inter, False), **options)

    return KernelVariant("expert_mlp", {"hidden": hidden, "inter": inter, "topk": topk, **options}, build)
