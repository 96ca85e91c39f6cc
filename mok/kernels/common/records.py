"""Every kernel family's launch arguments, named once (plain Python: importing it loads no CuTe DSL).

Each record is read by its kernel's ``__call__`` (held to it by a test: LaunchArgs.check_signature),
by the compile step (its stand-ins) and by the launcher in mok/ops/ (its values, by name).
"""

from __future__ import annotations

from .launch_args import LaunchArgs, int32, int64, ptr


OPERAND_FORMATS = {  # a GEMM operand format: (its elements' pointer kind, its scales' pointer kind)
    "bf16": ("bf16", "e8m0"),  # (no scales: the pointers are null, never read)
    "e4m3": ("e4m3", "e8m0"),  # MXFP8: an E8M0 scale per 32 along K (SM100's block-scaled MMAs)
    "e4m3_block": ("e4m3", "f32"),  # DeepSeek-V3's FP8: an fp32 scale per 128 along K (Hopper: mok/kernels/sm90/block_scaled.py)
}


def grouped_gemm_args(operand: str = "bf16", out: str = "bf16") -> LaunchArgs:
    """The grouped GEMM's launch arguments (either arch; ``operand`` one of OPERAND_FORMATS: bf16, or
    E4M3 elements whose scales come with them; a bf16 kernel never reads the scales). C is [R, N]
    ([R, 2N] for swiglu_bwd, the rank-0 slots for scatter), bf16, or with ``out`` "e4m3_block" (the
    SwiGLU forward on Hopper's FP8) E4M3 with its row scales c_scale [ceil(N / 128), R]; h, a_scaled, partial, row_token,
    row_slot and topk_w are the epilogue's row tensors, null where a variant does not use them;
    bias and bias2 the experts' biases [E, N] of B's and B2's products (read with ``bias`` only); rows_per_rank and rank_stride place the scattered rows (mok/kernels/sm90/grouped_gemm.py)."""
    elements, scales = OPERAND_FORMATS[operand]
    return LaunchArgs(
        ptr("a", elements), ptr("a_scale", scales), ptr("b", elements), ptr("b_scale", scales), ptr("b2", elements),
        ptr("b2_scale", scales), ptr("c", OPERAND_FORMATS[out][0]), ptr("c_scale", "f32", 4), ptr("tile_expert", "i32", 4), ptr("h", "bf16"), ptr("a_scaled", "bf16"),
        ptr("partial", "f32", 4), ptr("row_token", "i32", 4), ptr("row_slot", "i32", 4), ptr("topk_w", "f32", 4),
        ptr("bias", "bf16", 4), ptr("bias2", "bf16", 4), int32("num_rows"), int32("num_experts"), int32("num_tokens", 1), int32("max_ctas"), int32("rows_per_rank", 1),
        int32("rank_stride", 0),
    )


def weight_grad_args(operand: str = "bf16", out: str = "bf16") -> LaunchArgs:
    """The weight-gradient GEMM's launch arguments (either arch): A [R, M] and B [R, N] (``operand``
    "bf16", or "e4m3" with their E8M0 scales, or "e4m3_block": their transposes [M, R], [N, R] in
    E4M3 with fp32 scales [R / 128, M], [R / 128, N]), the output (``out`` "bf16" or "f32";
    split_out's two halves ``half_stride`` elements apart, ``upper_first`` when the second lies
    lower), the experts' row offsets and counts (``counted`` 0: the counts are not read)."""
    element, scale = ("e4m3", "f32") if operand == "e4m3_block" else (operand, "e8m0")
    return LaunchArgs(
        ptr("a", element), ptr("a_scale", scale), ptr("b", element), ptr("b_scale", scale), ptr("out", out),
        ptr("offsets", "i32", 4), ptr("counts", "i32", 4), int32("counted", 0), int32("num_rows"), int32("num_experts"),
        int32("max_ctas"), int64("half_stride", 0), int32("upper_first", 0),
    )


EXPERT_MLP_ARGS = LaunchArgs(
    # the layer's tensors, the schedule's, the counters and grid-barrier words (mok/kernels/common/expert_mlp.py)
    ptr("x", "bf16"), ptr("w_gate", "bf16"), ptr("w_up", "bf16"), ptr("w_down", "bf16"), ptr("a", "bf16"), ptr("h", "bf16"),
    ptr("y", "bf16"), ptr("tile_expert", "i32", 4), ptr("row_token", "i32", 4), ptr("row_slot", "i32", 4),
    ptr("topk_w", "f32", 4), ptr("slot_row", "i32", 4), ptr("shared", "bf16"), ptr("out", "bf16"), ptr("counters", "i32", 4),
    ptr("offsets", "i32", 4), ptr("topk_idx", "i32", 4), ptr("counts", "i32", 4), ptr("overflow", "i32", 4),
    ptr("sync", "i32", 4),
    ptr("bias_gate", "bf16", 4), ptr("bias_up", "bf16", 4), ptr("bias_down", "bf16", 4),  # the experts' biases [E, I], [E, I], [E, H] (``bias``)
    # expert parallelism: rank 0's regions of the workspace, this rank's inputs, their rank strides in elements
    ptr("flags", "i32", 4), ptr("x_pub", "bf16"), ptr("idx_pub", "i32", 4), ptr("slots", "bf16"), ptr("x_in", "bf16"),
    ptr("idx_in", "i32", 4),
    int32("num_rows"), int32("num_experts"), int32("num_tokens"), int32("max_ctas"), int64("timeout_ns"), int32("rank", 0),
    int32("t_max", 0), int32("my_tokens", 0), int32("flags_stride", 0), int32("x_stride", 0), int32("idx_stride", 0),
    int32("slots_stride", 0),
)

COMBINE_ARGS = LaunchArgs(  # y [T, k, H] or gathered rows [R, H] with slot_row; topk_w null for unit weights
    ptr("y", "bf16"), ptr("slot", "i32", 4), ptr("w", "f32", 4), ptr("shared", "bf16"), ptr("out", "bf16"), int32("num_tokens"),
    int32("num_rows"),
)
COMBINE_ROUTER_GRAD_ARGS = LaunchArgs(  # the backward's dx combine with the router-weight gradient from the pieces
    ptr("y", "bf16"), ptr("slot", "i32", 4), ptr("partial", "f32", 4), ptr("shared", "bf16"), ptr("out", "bf16"),
    ptr("d_w", "f32", 4), int32("num_tokens"), int32("num_rows"),
)
GATHER_ARGS = LaunchArgs(  # rows_used: read by a bounded gather only (null otherwise)
    ptr("src", "bf16"), ptr("index", "i32", 4), ptr("out", "bf16"), ptr("rows_used", "i32", 4), int32("num_src"), int32("num_out"),
)
GATHER_TWO_ARGS = LaunchArgs(
    ptr("src_a", "bf16"), ptr("src_b", "bf16"), ptr("index", "i32", 4), ptr("out_a", "bf16"), ptr("out_b", "bf16"), ptr("rows_used", "i32", 4),
    int32("num_src"), int32("num_out"),
)
GATHER_FP8_ARGS = LaunchArgs(  # E4M3 rows (as bf16 lanes) with their 1 x 128 blocks' fp32 scales [blocks, rows]
    ptr("src", "bf16"), ptr("src_scales", "f32", 4), ptr("index", "i32", 4), ptr("out", "bf16"), ptr("out_scales", "f32", 4),
    ptr("rows_used", "i32", 4), int32("num_src"), int32("num_out"),
)
ROUTER_GRAD_ARGS = LaunchArgs(ptr("partial", "f32", 4), ptr("slot_row", "i32", 4), ptr("out", "f32", 4), int32("num_tokens"), int32("num_rows"))
COLUMN_SUMS_ARGS = LaunchArgs(  # per-expert column sums of rows (mok/kernels/common/bias_grads.py); the weights' tensors: weighted only
    ptr("rows", "bf16"), ptr("offsets", "i32", 4), ptr("counts", "i32", 4), ptr("row_token", "i32", 4), ptr("row_slot", "i32", 4),
    ptr("topk_w", "f32", 4), ptr("out", "f32"), int32("num_rows"), int32("num_experts"), int32("num_tokens", 1),
)
ROW_DOTS_ARGS = LaunchArgs(  # <rows[r], bias[e(r)]> into a column of the SwiGLU backward's pieces (out: 4-byte aligned)
    ptr("rows", "bf16"), ptr("bias", "bf16"), ptr("tile_expert", "i32", 4), ptr("row_token", "i32", 4), ptr("out", "f32", 4),
    int32("num_rows"), int32("num_experts"),
)
FP8_BLOCK_QUANTIZE_ARGS = LaunchArgs(  # bf16 rows -> E4M3 with 128-block fp32 scales (mok/kernels/common/fp8_block_quantize.py)
    ptr("x", "bf16"), ptr("elements", "e4m3"), ptr("scales", "f32", 4), ptr("rows_used", "i32", 4), ptr("row_source", "i32", 4),
    ptr("rows_copy", "bf16"), int32("num_rows"), int32("num_src", 0),
)
