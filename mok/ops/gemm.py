"""The expert-grouped GEMM on tensors: forward products, the scattering down projection, the SwiGLU backward.

    grouped_gemm          out[rows of tile m] = epilogue(a[rows of tile m] · B[tile_expert[m]])
    grouped_gemm_scatter  the same, each row written into its (token, slot) row of the combine slots
    swiglu_backward_gemm  dout_rows · W_down with the SwiGLU backward and the router-gradient pieces

The operand format is a parameter: a bf16 tensor, or an MXFP8 pair (E4M3 elements, E8M0 scales
in the order SM100's block-scaled MMAs read them, mok.mxfp8.mma_scale_layout) for the
block-scaled kernels (SM100 only; compile-verified, never run). Every launch takes the grouped
GEMM's one argument record (mok/kernels/common/gemm_args.py).
"""

from __future__ import annotations

import torch

from ..kernels.common.records import grouped_gemm_args
from ..kernels.variants import SWIGLU_BACKWARD_TILE_N, block_buffers_for, deep_turn_for, grouped_gemm_variant, swiglu_backward_pingpong
from ..fp8_block import BLOCK as FP8_BLOCK
from ..mxfp8 import ROW_STEP as MXFP8_ROW_STEP, mma_chunks_of
from ..runtime import launch
from ..runtime.arch import require_mxfp8_gemms
from ..validation import check_tensor, weight_strides
from .common import (
    BF16, E4M3, I32, arch_of, bf16_out, check_disjoint, check_launchable, check_rank_stride,
    check_weights_launchable, kernel_for, persistent_default, sm_count,
)

RECORDS = {(operand, "bf16"): grouped_gemm_args(operand) for operand in ("bf16", "e4m3", "e4m3_block")}
RECORDS["e4m3_block", "e4m3_block"] = grouped_gemm_args("e4m3_block", "e4m3_block")  # (E4M3 output: the FP8 SwiGLU forward's)
Operand = torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # bf16 values, or MXFP8 (elements, scales)


def launch_grouped_gemm(variant, device: torch.device, **arguments) -> None:
    """Launch a checked grouped-GEMM variant on ``device`` with its record's named arguments (a
    pointer not given is null; max_ctas defaults to the SM count)."""
    arguments.setdefault("max_ctas", sm_count(device))
    record = RECORDS[variant.config.get("operand", "bf16"), variant.config.get("out_format", "bf16")]
    kernel_for(variant, device)(*record.values(**arguments), launch.stream(device))


def operand_parts(name: str, value: Operand) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(values, scales) of an operand: a bf16 tensor has no scales; an MXFP8 one is a pair."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise TypeError(f"{name}: expected a tensor or an (elements, scales) pair, got {len(value)} items")
        return value[0], value[1]
    return value, None


def check_mxfp8_rows(name: str, a: torch.Tensor, scales: torch.Tensor, segments: int = 1) -> None:
    """MXFP8 rows [R, K] (E4M3, K a multiple of 16, of 32 with two segments) with their scales uint8
    [ceil(R / 128), segments · ceil(K / segments / 128), 512] in the MMA's order (``segments`` 2:
    each half of a row chunked on its own, ops.quantize_mxfp8(..., segments=2))."""
    check_tensor(name, a, dtypes=E4M3, ndim=2, contiguous=True)
    rows, k = a.shape
    if k % (segments * MXFP8_ROW_STEP):
        raise ValueError(f"{name}: expected K a multiple of {segments * MXFP8_ROW_STEP} with MXFP8 operands (16-byte E4M3 rows"
                         f"{', each half' if segments == 2 else ''}), got K={k}")
    chunks = segments * mma_chunks_of(k // segments)
    check_tensor(f"{name} scales", scales, dtypes=(torch.uint8,), shape=(-(-rows // 128), chunks, 512), device=a.device, contiguous=True)


def check_mxfp8_weights(name: str, b: torch.Tensor, scales: torch.Tensor, device: torch.device, k: int) -> tuple[int, int]:
    """MXFP8 weights [E, N, k] (E4M3, K-major, N and k multiples of 16) with their scales uint8
    [E, ceil(N / 128), ceil(k / 128), 512] in the MMA's order (each expert chunked on its own, as
    ops.quantize_mxfp8 gives them for the stack); returns (E, N)."""
    check_tensor(name, b, dtypes=E4M3, ndim=3, device=device, contiguous=True)
    num_experts, n = b.shape[0], b.shape[1]
    check_tensor(name, b, shape=(num_experts, n, k))
    if n % MXFP8_ROW_STEP or k % MXFP8_ROW_STEP:
        raise ValueError(f"{name}: expected N and K multiples of {MXFP8_ROW_STEP} with MXFP8 operands (16-byte E4M3 rows), got N={n}, K={k}")
    chunks = (mma_chunks_of(n), mma_chunks_of(k))
    check_tensor(f"{name} scales", scales, dtypes=(torch.uint8,), shape=(num_experts, *chunks, 512), device=device, contiguous=True)
    return num_experts, n


def _bf16_weights(a: torch.Tensor, b: torch.Tensor, b2: torch.Tensor | None, b_major: str, k_split: bool) -> tuple[int, int, dict]:
    """Check a bf16 grouped GEMM's B (and B2) against A [R, K] (contiguous rows, one set of strides
    for both: :func:`weight_strides`); returns (E, N, the variant's stride options: expert and row
    strides where not packed)."""
    k = a.shape[1]
    if b_major not in ("k", "n"):
        raise ValueError(f"b_major: expected 'k' or 'n', got {b_major!r}")
    if k_split and b2 is None:
        raise ValueError("k_split: needs b2, the weights of K's second half")
    check_tensor("b", b, dtypes=BF16, ndim=3, device=a.device)
    num_experts = b.shape[0]
    n = b.shape[1] if b_major == "k" else b.shape[2]
    b_k = k // 2 if k_split else k
    b_shape = (num_experts, n, b_k) if b_major == "k" else (num_experts, b_k, n)
    check_tensor("b", b, shape=b_shape)
    expert, row = weight_strides("b", b)
    if b2 is not None:
        check_tensor("b2", b2, dtypes=BF16, shape=b_shape, device=a.device)
        weight_strides("b2", b2, like=b)
    if n % 8 or k % (16 if k_split else 8):
        raise ValueError(f"b: expected N % 8 == 0 and K % {16 if k_split else 8} == 0 (16-byte rows), got N={n}, K={k}")
    return num_experts, n, dict(b_expert_stride=expert, b_row_stride=row)


def _mxfp8_operands(a: Operand, b: Operand, b2: Operand | None, k_split: bool) -> dict:
    """Check MXFP8 A, B (and B2) of a grouped GEMM (K-major B; K % 16, % 32 with k_split, A's rows
    then in two segments; where they may launch: :func:`check_mxfp8_launchable`); returns the
    record's pointer arguments."""
    (a_q, a_s), (b_q, b_s) = operand_parts("a", a), operand_parts("b", b)
    if a_s is None or b_s is None or (b2 is not None and operand_parts("b2", b2)[1] is None):
        raise TypeError("a, b, b2: expected MXFP8 (elements, scales) pairs for all of them, or bf16 tensors for all")
    check_mxfp8_rows("a", a_q, a_s, segments=2 if k_split else 1)
    k = a_q.shape[1]
    if k_split and b2 is None:
        raise ValueError("k_split: needs b2, the weights of K's second half")
    check_mxfp8_weights("b", b_q, b_s, a_q.device, k // 2 if k_split else k)
    b2_q, b2_s = (b_q, b_s) if b2 is None else operand_parts("b2", b2)
    check_tensor("b2", b2_q, dtypes=E4M3, shape=tuple(b_q.shape), device=a_q.device, contiguous=True)
    check_tensor("b2 scales", b2_s, dtypes=(torch.uint8,), shape=tuple(b_s.shape), device=a_q.device, contiguous=True)
    return dict(a=a_q, a_scale=a_s, b=b_q, b_scale=b_s, b2=b2_q, b2_scale=b2_s)


def _fp8_block_scales(a: Operand) -> bool:
    """Whether an (elements, scales) operand is FP8 with fp32 block scales (else MXFP8's E8M0 bytes)."""
    return len(a) == 2 and isinstance(a[1], torch.Tensor) and a[1].dtype == torch.float32


def _operand_format(a: Operand) -> str:
    """A GEMM's A operand's format, as the kernels' records name it: "bf16" (a tensor), "e4m3_block"
    (FP8 with fp32 block scales) or "e4m3" (MXFP8)."""
    if not isinstance(a, (tuple, list)):
        return "bf16"
    return "e4m3_block" if _fp8_block_scales(a) else "e4m3"


def _fp8_block_operands(a: Operand, b: Operand, b2: Operand | None, k_split: bool, gathered: bool = False) -> dict:
    """Check FP8 block-scaled A, B (and B2) of a grouped GEMM (mok.fp8_block's layouts; ``gathered``:
    A is x's rows, gathered with their scales by the kernel's producer); returns the record's
    pointer arguments."""
    (a_q, a_s), (b_q, b_s) = operand_parts("a", a), operand_parts("b", b)
    check_tensor("a", a_q, dtypes=E4M3, ndim=2, contiguous=True)
    rows, k = a_q.shape
    halves = 2 if k_split else 1
    if k % (halves * 16) or not k:
        raise ValueError(f"a: expected K a positive multiple of {halves * 16} with FP8 block-scaled operands (16-byte rows"
                         f"{', each half' if k_split else ''}), got K={k}")
    k_blocks = -(-k // halves // 128)  # (each half's: k_split's rows quantized a half at a time, segments=2)
    check_tensor("a scales", a_s, dtypes=(torch.float32,), shape=(halves * k_blocks, rows), device=a_q.device, contiguous=True)
    if rows % 4 and not gathered:
        raise ValueError(f"a: expected a row count that is a multiple of 4 (the scales' rows are read by TMA in 16-byte units), got {rows}")
    if k_split and b2 is None:
        raise ValueError("k_split: needs b2, the weights of K's second half")
    check_tensor("b", b_q, dtypes=E4M3, ndim=3, device=a_q.device, contiguous=True)
    num_experts, n = b_q.shape[:2]
    check_tensor("b", b_q, shape=(num_experts, n, k // halves))
    if n % 16 or not n:
        raise ValueError(f"b: expected N a positive multiple of 16 with FP8 block-scaled operands, got N={n}")
    scale_shape = (num_experts, -(-n // 128), k_blocks)
    check_tensor("b scales", b_s, dtypes=(torch.float32,), shape=scale_shape, device=a_q.device, contiguous=True)
    b2_q, b2_s = (b_q, b_s) if b2 is None else operand_parts("b2", b2)
    check_tensor("b2", b2_q, dtypes=E4M3, shape=tuple(b_q.shape), device=a_q.device, contiguous=True)
    check_tensor("b2 scales", b2_s, dtypes=(torch.float32,), shape=scale_shape, device=a_q.device, contiguous=True)
    check_launchable(a=a_q, a_scales=a_s)
    check_weights_launchable(b=b_q, b_scales=b_s, b2=b2_q, b2_scales=b2_s)
    return dict(a=a_q, a_scale=a_s, b=b_q, b_scale=b_s, b2=b2_q, b2_scale=b2_s)


def _operands(a: Operand, b: Operand, b2: Operand | None, b_major: str, k_split: bool, gathered: bool = False) -> tuple:
    """A grouped GEMM's A, B (and B2), checked: (the record's pointer arguments, the operand format
    "bf16" / "e4m3_block" / "e4m3", E, N, B's strides as the variant takes them). bf16 tensors, FP8
    with block scales or MXFP8 (elements, scales) pairs (``gathered``: FP8 A is x's rows)."""
    operand = _operand_format(a)
    if operand != "bf16":
        pointers = _fp8_block_operands(a, b, b2, k_split, gathered=gathered) if operand == "e4m3_block" else _mxfp8_operands(a, b, b2, k_split)
        return (pointers, operand, *pointers["b"].shape[:2], {})
    check_tensor("a", a, dtypes=BF16, ndim=2, contiguous=True)
    num_experts, n, b_strides = _bf16_weights(a, b, b2, b_major, k_split)
    return dict(a=a, b=b, b2=b if b2 is None else b2), "bf16", num_experts, n, b_strides


def check_mxfp8_launchable(op: str, pointers: dict) -> None:
    """The MXFP8 operands of :func:`_mxfp8_operands` where they may launch (after the call's other
    checks): on a CUDA device, aligned, on an SM100 GPU."""
    check_launchable(a=pointers["a"], a_scales=pointers["a_scale"])
    check_weights_launchable(b=pointers["b"], b_scales=pointers["b_scale"], b2=pointers["b2"], b2_scales=pointers["b2_scale"])
    if pointers["a"].device.type == "cuda":
        require_mxfp8_gemms(op, arch_of(pointers["a"].device.index))


def grouped_gemm(
    a: Operand,
    b: Operand,
    tile_expert: torch.Tensor,
    *,
    b2: Operand | None = None,
    out: torch.Tensor | None = None,
    h_out: torch.Tensor | None = None,
    b_major: str = "k",
    k_split: bool = False,
    tile_n: int | None = None,
    stages: int | None = None,
    persistent: bool | None = None,
    gather: torch.Tensor | None = None,
    activation: str = "swiglu",
    bias: torch.Tensor | None = None,
    bias2: torch.Tensor | None = None,
    block_buffers: int | None = None,
    cluster_m: int = 1,
    deep_turn: int | None = None,
    out_format: str = "bf16",
    power_of_two: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Expert-grouped GEMM: out[rows of tile m] = a[rows of tile m] · B[tile_expert[m]] (fp32 accumulation, bf16 out).

    a: [R, K], rows grouped by expert in 128-row tiles. tile_expert: [ceil(R / 128)] int32, the
    expert of each row tile, -1 to skip the tile (its output rows are left unwritten). b: [E, N, K]
    (``b_major="k"``: B = bᵀ, the forward's weights) or [E, K, N] (``b_major="n"``: B = b, the same
    weights in the backward); each row contiguous, the rows and experts packed or further apart
    (:func:`mok.validation.weight_strides`: the gate and up halves of one [E, 2I, H] tensor, or its
    even and odd rows, are read in place), b2 strided as b. With ``b2`` shaped like b: SwiGLU, out = silu(a·B)⊙(a·B2) (or the
    gated ``activation`` "clamped_swiglu" or "geglu": mok.kernels.common.gated_activation), and
    ``h_out`` [R, 2N] (optional) receives the pre-activations [a·B | a·B2] for the backward; or,
    with ``k_split``, b and b2 hold the two halves of K (out = a[:, :K/2]·B + a[:, K/2:]·B2).
    Needs N % 8 == 0 and K % 8 == 0 (K % 16 with ``k_split``): the last column and K tiles may be
    partial (TMA zero-fills the loads past N and K, nothing is stored past N; with k_split each
    half of K on its own). ``tile_n`` overrides the column
    tile (64, 128 or 256; default from the static shape), ``stages`` the shared-memory
    pipeline depth (default: as deep as fits), ``persistent=False`` selects the one-tile-per-CTA
    kernel (the same bits); None: the persistent kernel (SM100's compile-verified, never run;
    without ``gather``). Hopper's persistent bf16 plain GEMM (k_split too, and
    :func:`grouped_gemm_scatter`'s) with 256-wide tiles and a long K takes the walk's last round
    in 128-wide halves where that round would be at most half full
    (mok.kernels.variants.TAIL_SPLIT, TAIL_SPLIT_MIN_K; the same bits).
    ``gather`` [R] int32 (the schedule's row_token): A is not materialised; a is the token matrix
    x [T, K] and row r of A is x[gather[r]], or zeros where gather[r] < 0 (each entry < T).
    ``bias`` [E, N] bf16 (bf16 or FP8 block-scaled operands, not k_split): added to a·B before anything else (so to h's
    gate half and before the activation), ``bias2`` likewise to a·B2 (both or neither with b2).

    MXFP8 operands (SM100 only): a = (elements float8_e4m3fn [R, K], scales uint8 [ceil(R / 128),
    ceil(K / 128), 512]) and b, b2 = (elements [E, N, K] K-major, scales [E, ceil(N / 128),
    ceil(K / 128), 512]), each scale in the MMA's order (mok.ops.quantize_mxfp8(..., scale_order="mma"),
    the padding blocks' scales 1); N and K multiples of 16 (each half of K with k_split, whose a
    is quantized with segments=2: scales [ceil(R / 128), 2·ceil(K / 256), 512]); partial tiles as
    above; the SwiGLU and k_split forms as above (b_major "k" only, no gather).

    FP8 with block scales (Hopper, DeepSeek-V3's recipe, mok.fp8_block): a = (elements [R, K]
    float8_e4m3fn, scales float32 [K / 128, R]) and b, b2 = (elements [E, N, K] K-major, scales
    float32 [E, N / 128, K / 128]); N and K multiples of 16 (each half of K with k_split), a
    partial last block ceil()'d in the scales' shapes (with k_split a's rows blocked a half at a
    time: ops.quantize_fp8_rows(segments=2)); the persistent kernel, b_major "k"; with ``gather`` a
    is x's rows [T, K] and their scales [K / 128, T]
    (ops.quantize_fp8_rows(x): each token quantized once, its rows gathered with their scales);
    every epilogue as with bf16. ``block_buffers``: 2 (the default for the plain, k_split and
    SwiGLU forward forms) lets each stage's WGMMAs overlap the previous stage's promotion, 1
    does not; ``deep_turn`` (with 2; 0 off, else even) keeps two stages' WGMMAs in flight for turns
    of that many stages (the same bits: mok/kernels/sm90/block_scaled.py); None: 4 for the plain,
    k_split and SwiGLU forms (mok.kernels.variants.deep_turn_for).

    ``cluster_m`` = 2 (bf16 or FP8 block-scaled operands, the persistent kernel; FP8 rows
    gathered first, not with ``gather``; SM100's bf16 compile-verified only): clusters of two CTAs
    on two row tiles of one column tile, which load each B tile once for both (TMA multicast)
    where one expert has both row tiles; the same bits as 1 (mok/kernels/sm90/grouped_gemm.py).
    The fp8_block layer runs its gate/up GEMM so with ``row_tile_pairs`` (mok.plan.Plan.gate_up_pairs).

    ``out_format`` "fp8_block" (FP8 block-scaled operands, the SwiGLU form, ``cluster_m`` 1, the
    default tile): the activation is returned quantized as the down projection's FP8 operand,
    (elements float8_e4m3fn [R, N], scales float32 [ceil(N / 128), R]), by mok.fp8_block's rule
    (``power_of_two`` scales or fp32 ones) on the bf16 values ``out`` would hold: bit for bit
    quantize_fp8_rows of the bf16 output, with no bf16 copy written and no pass over it. Rows of
    skipped tiles are left unwritten, elements and scales alike; ``out`` is not taken.
    """
    operand = _operand_format(a)
    fp8_block = operand == "e4m3_block"
    epilogue = "plain" if b2 is None or k_split else ("swiglu" if h_out is None else "swiglu_save")
    fp8_out = _check_out_format(out_format, power_of_two, operand, epilogue, out, cluster_m, tile_n)
    deep_turn_for(deep_turn, block_buffers_for(block_buffers, operand), epilogue)  # (before the operands' checks: the options' own errors)
    if fp8_block and (b_major != "k" or persistent is False):
        raise ValueError("FP8 block-scaled operands: K-major B (b_major='k'), the persistent kernel")
    _check_cluster_m(cluster_m, operand, persistent)
    if cluster_m == 2 and fp8_block and gather is not None:
        raise ValueError("cluster_m=2 with FP8 block-scaled operands: rows gathered first (quantize_fp8_rows or gather_fp8_rows), "
                         "not by the GEMM's producer (gather)")
    pointers, _, num_experts, n, b_strides = _operands(a, b, b2, b_major, k_split, gathered=gather is not None)
    a_values = pointers["a"]
    if operand == "e4m3" and (b_major != "k" or gather is not None):
        raise ValueError("MXFP8 operands: K-major B (b_major='k'), no gather")
    if persistent is None or fp8_block:  # (FP8 block scales: the persistent kernel only)
        persistent = fp8_block or persistent_default(a_values.device)
    num_rows = a_values.shape[0]
    if gather is not None:
        check_tensor("gather", gather, dtypes=I32, ndim=1, device=a_values.device, contiguous=True)
        if not persistent:
            raise ValueError("gather: only with the persistent kernel")
        num_rows = gather.shape[0]
    if h_out is not None:
        if b2 is None or k_split:
            raise ValueError("h_out: only with the SwiGLU epilogue (b2 given, no k_split)")
        check_tensor("h_out", h_out, dtypes=BF16, shape=(num_rows, 2 * n), device=a_values.device, contiguous=True)
    check_tensor("tile_expert", tile_expert, dtypes=I32, shape=(-(-num_rows // 128),), device=a_values.device, contiguous=True)
    given = out
    if fp8_out:  # (elements and their row scales, as ops.quantize_fp8_rows lays them out)
        out = (torch.empty((num_rows, n), dtype=torch.float8_e4m3fn, device=a_values.device),
               torch.empty((-(-n // FP8_BLOCK), num_rows), dtype=torch.float32, device=a_values.device))
    else:
        out = bf16_out(out, (num_rows, n), a_values.device)
    _check_biases(bias, bias2, b2 is not None and not k_split, num_experts, n, a_values.device, k_split)
    if operand == "e4m3":
        check_mxfp8_launchable("grouped_gemm", pointers)
    c, c_scale = out if fp8_out else (out, None)
    check_launchable(a=a_values, out=c, out_scales=c_scale, h_out=h_out, bias=bias, bias2=bias2)
    check_weights_launchable(b=pointers["b"], b2=pointers["b2"])
    check_disjoint({"out": given, "h_out": h_out}, {"a": a_values, "b": pointers["b"], "b2": pointers["b2"]})
    if num_rows == 0 or a_values.shape[0] == 0:  # (gather from no tokens: every row is padding)
        return out
    variant = grouped_gemm_variant(
        n, a_values.shape[1], tile_n=tile_n, stages=stages, epilogue=epilogue, b_major=b_major, k_split=k_split,
        persistent=persistent, gather_a=gather is not None, operand=operand, activation=activation, bias=bias is not None,
        block_buffers=block_buffers, cluster_m=cluster_m, deep_turn=deep_turn, out_format="e4m3_block" if fp8_out else "bf16",
        power_of_two=power_of_two, **b_strides,
    )
    launch_grouped_gemm(
        variant, a_values.device, **pointers, c=c, c_scale=c_scale, tile_expert=tile_expert, h=h_out, row_token=gather, num_rows=num_rows,
        num_experts=num_experts, num_tokens=a_values.shape[0] if gather is not None else 1, bias=bias, bias2=bias2,
    )
    return out


def _check_out_format(out_format: str, power_of_two: bool, operand: str, epilogue: str, out, cluster_m: int, tile_n: int | None) -> bool:
    """:func:`grouped_gemm`'s ``out_format`` and ``power_of_two``; whether the output is FP8."""
    if out_format not in ("bf16", "fp8_block"):
        raise ValueError(f"out_format: expected 'bf16' or 'fp8_block', got {out_format!r}")
    if out_format == "bf16":
        if power_of_two:
            raise ValueError("power_of_two: the rule of out_format='fp8_block''s scales, not with bf16 output")
        return False
    problems = [what for what, bad in (
        ("FP8 block-scaled operands", operand != "e4m3_block"), ("the SwiGLU form (b2, no k_split)", epilogue == "plain"),
        ("no out (the pair is returned)", out is not None), ("cluster_m=1", cluster_m != 1),
        (f"the default tile_n ({FP8_BLOCK // 2})", tile_n not in (None, FP8_BLOCK // 2)),
    ) if bad]
    if problems:
        raise ValueError(f"out_format='fp8_block': needs {', '.join(problems)}")
    return True


def _check_cluster_m(cluster_m: int, operand: str, persistent: bool | None) -> None:
    """``cluster_m``: 1, or 2 with bf16 or FP8 block-scaled operands in the persistent kernel."""
    if cluster_m not in (1, 2):
        raise ValueError(f"cluster_m: expected 1 or 2, got {cluster_m!r}")
    if cluster_m == 2 and (operand not in ("bf16", "e4m3_block") or persistent is False):
        raise ValueError(f"cluster_m=2: bf16 or FP8 block-scaled operands in the persistent kernel, got operand={operand!r}, "
                         f"persistent={persistent}")


def _check_biases(bias, bias2, two: bool, num_experts: int, n: int, device, k_split: bool) -> None:
    """A GEMM's expert biases: none, or ``bias`` [E, N] bf16 (and ``bias2`` with ``two`` products, the
    SwiGLU form), contiguous, without k_split (where they may launch: check_launchable): every
    operand format's kernels add them."""
    if bias is None and bias2 is None:
        return
    if k_split:
        raise ValueError("bias: not with k_split (dx has no bias)")
    if bias is None or (bias2 is None) == two:
        raise ValueError("bias, bias2: give bias for a plain GEMM, bias and bias2 for the SwiGLU form (b2 given)")
    for name, t in (("bias", bias), ("bias2", bias2)):
        if t is not None:
            check_tensor(name, t, dtypes=BF16, shape=(num_experts, n), device=device, contiguous=True)


def grouped_gemm_scatter(
    a: Operand,
    b: Operand,
    tile_expert: torch.Tensor,
    row_token: torch.Tensor,
    row_slot: torch.Tensor,
    slots: torch.Tensor,
    *,
    slot_ranks: tuple[int, int] | None = None,
    b2: Operand | None = None,
    b_major: str = "k",
    k_split: bool = False,
    bias: torch.Tensor | None = None,
    cluster_m: int = 1,
) -> None:
    """The plain :func:`grouped_gemm` (``b``, ``b_major``, ``k_split`` with ``b2``, ``bias``, ``cluster_m`` as there; bf16
    operands, FP8 with block scales or MXFP8 (SM100) as there), each row written into the (token,
    slot) row of ``slots`` instead of an [R, N] output (no rows buffer, no copy).

    a [R, K] bf16 in the schedule's row order, b [E, N, K] (or [E, K, N] for "n"), tile_expert
    [ceil(R / 128)]; row r belongs to token g = row_token[r] (-1: padding, not written) and slot
    j = row_slot[r] (int32 [R]). ``slots`` [T, k, N] bf16 receives row r at [g, j]; with
    ``slot_ranks`` = (W, rank stride in elements) it is rank 0's slots in an expert-parallel
    workspace, the W ranks' slots ``rank stride`` elements apart in one mapping, and g = p·T + t
    goes to rank p's [t, j] (the down projection pushing y, and the backward's dx GEMM pushing
    dx, to the tokens' owners). Slots no row maps to are left as they were.
    """
    if b2 is not None and not k_split:
        raise ValueError("b2: only with k_split (the scattering GEMM has the plain epilogue)")
    if isinstance(a, (tuple, list)) and b_major != "k":
        raise ValueError("a: FP8 operands (block scales, or MXFP8) take K-major B (b_major='k')")
    pointers, operand, num_experts, n, b_strides = _operands(a, b, b2, b_major, k_split)
    a_values = pointers["a"]
    _check_cluster_m(cluster_m, operand, True)
    num_rows, dev = a_values.shape[0], a_values.device
    check_tensor("tile_expert", tile_expert, dtypes=I32, shape=(-(-num_rows // 128),), device=dev, contiguous=True)
    for name, t in (("row_token", row_token), ("row_slot", row_slot)):
        check_tensor(name, t, dtypes=I32, shape=(num_rows,), device=dev, contiguous=True)
    check_tensor("slots", slots, dtypes=BF16, ndim=3, device=dev, contiguous=True)
    if slots.shape[2] != n:
        raise ValueError(f"slots: expected [T, k, {n}] (N of b), got {list(slots.shape)}")
    slot_ranks = slot_ranks if slot_ranks is not None else (1, slots.numel())
    check_rank_stride("slot_ranks", slot_ranks, slots.numel(), 2**31 - 8, "2^31 - 8 elements")  # (the kernel's vector indices)
    _check_biases(bias, None, False, num_experts, n, dev, k_split)
    check_launchable(a=a_values, slots=slots, bias=bias)
    if operand == "bf16":  # (FP8's: with its operands' checks)
        check_weights_launchable(b=b, b2=b2)
    elif operand == "e4m3":
        check_mxfp8_launchable("grouped_gemm_scatter", pointers)
    if num_rows == 0:
        return
    num_tokens, topk, _ = slots.shape
    variant = grouped_gemm_variant(n, a_values.shape[1], scatter=True, topk=topk, b_major=b_major, k_split=k_split, bias=bias is not None,
                                   operand=operand, cluster_m=cluster_m, **b_strides)
    launch_grouped_gemm(
        variant, dev, **pointers, c=slots, tile_expert=tile_expert, row_token=row_token, row_slot=row_slot, num_rows=num_rows,
        num_experts=num_experts, rows_per_rank=num_tokens, rank_stride=slot_ranks[1], bias=bias,
    )


def _check_router_rows(row_token, row_slot, topk_w, num_rows: int, device) -> tuple[bool, int, int]:
    """The SwiGLU backward's router inputs: all three (routed experts: row_token, row_slot [R] int32,
    topk_w [T, k] fp32) or none (the shared expert, s = 1). Returns (unit_scale, T, k)."""
    unit_scale = topk_w is None
    if unit_scale != (row_token is None) or unit_scale != (row_slot is None):
        raise ValueError("row_token, row_slot, topk_w: give all three (routed experts) or none (shared expert)")
    if unit_scale:
        return True, 1, 1
    check_tensor("topk_w", topk_w, dtypes=(torch.float32,), ndim=2, device=device, contiguous=True)
    check_tensor("row_token", row_token, dtypes=I32, shape=(num_rows,), device=device, contiguous=True)
    check_tensor("row_slot", row_slot, dtypes=I32, shape=(num_rows,), device=device, contiguous=True)
    return False, *topk_w.shape


def swiglu_backward_gemm(
    dout_rows: Operand,
    w_down: Operand,
    tile_expert: torch.Tensor,
    h: torch.Tensor,
    *,
    row_token: torch.Tensor | None = None,
    row_slot: torch.Tensor | None = None,
    topk_w: torch.Tensor | None = None,
    persistent: bool | None = None,
    pingpong: bool | None = None,
    activation: str = "swiglu",
    bias_piece: bool = False,
    tile_n: int | None = None,
    cluster_m: int = 1,
    block_buffers: int | None = None,
    deep_turn: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Down-projection backward with the SwiGLU backward and the router gradient's pieces fused in.

    Per buffer row r (expert e of its tile, token t, slot j, router weight s = topk_w[t, j]):
    dA_u = dout_rows[r]·w_down[e] (w_down [E, H, I], read N-major); with the saved
    h[r] = [h_gate | h_up] ([R, 2I] bf16) and a = act(h_gate, h_up) (``activation``: silu(h_gate)·h_up
    by default) it returns dh [R, 2I] = [s·dA_u·∂a/∂h_gate | s·dA_u·∂a/∂h_up] (bf16), a_scaled [R, I] = s·a
    (bf16, for dW_down) and partial [R, ceil(I / tile_n)] fp32, Σ over each column tile of dA_u·a
    (:func:`mok.ops.router_grad` adds them up). row_token/row_slot [R] int32 and topk_w [T, k] fp32
    give s (0 for padding rows); all None for the shared expert (s = 1, partial is None).
    Rows of tiles with tile_expert -1 are left unwritten. ``persistent``: as in :func:`grouped_gemm`.
    ``pingpong`` (persistent; the default there): the two MMA warpgroups take whole tiles in turn,
    one's epilogue under the other's WGMMAs (the same bits; docs/notes/pingpong-backward-gemms.md).
    ``bias_piece`` (the experts have biases; routed experts): partial gets one more column,
    the last, left unwritten for the down bias's piece (:func:`mok.ops.bias_router_pieces`).
    ``tile_n`` (FP8 block scales: 64 or 128) overrides the column tile (SWIGLU_BACKWARD_TILE_N),
    and with it partial's columns. ``cluster_m`` = 2 (FP8 block scales): row-tile pairs, as in
    :func:`grouped_gemm`. ``block_buffers``, ``deep_turn`` (FP8 block scales): as in
    :func:`grouped_gemm` (None: two block sets, h then TMA-loaded into shared memory; no deep turns).

    MXFP8 operands (SM100 only, 128-wide tiles, no ping-pong): dout_rows = (elements [R, H],
    scales in the MMA's order) and w_down = the down projection's weights TRANSPOSED, K-major for
    this product, in MXFP8 along H: (elements [E, I, H], scales [E, ceil(I / 128), ceil(H / 128), 512])
    (e.g. mok.pipeline.stages.quantize_weights(w_down.transpose(1, 2).contiguous())). FP8 with block
    scales (Hopper, persistent, no ping-pong): dout_rows = (elements [R, H], scales
    float32 [H / 128, R]) and w_down transposed likewise: (elements [E, I, H], scales [E, I / 128,
    H / 128]) (mok.fp8_block's layouts).
    """
    operand = _operand_format(dout_rows)
    fp8_block, mxfp8 = operand == "e4m3_block", operand == "e4m3"
    deep_turn_for(deep_turn, block_buffers_for(block_buffers, operand), "swiglu_bwd")  # (the options' own errors first)
    if cluster_m != 1 and not fp8_block:
        raise ValueError(f"cluster_m: 1, or 2 with FP8 block-scaled operands (the cooperative kernel), got {cluster_m!r} with "
                         f"{'MXFP8' if mxfp8 else 'bf16'} operands")
    if fp8_block:
        if persistent is False or pingpong:
            raise ValueError("FP8 block-scaled operands: the persistent kernel, no ping-pong")
        pointers = _fp8_block_operands(dout_rows, w_down, None, False)
        (num_rows, hidden), (num_experts, inter) = pointers["a"].shape, pointers["b"].shape[:2]
        dev = pointers["a"].device
        persistent, pingpong = True, False
        if tile_n not in (None, 64, 128):
            raise ValueError(f"tile_n: expected None, 64 or 128 for FP8 block-scaled operands, got {tile_n}")
        tile_n = SWIGLU_BACKWARD_TILE_N if tile_n is None else tile_n
    elif tile_n is not None:
        raise ValueError(f"tile_n: only with FP8 block-scaled operands, got tile_n={tile_n} with {'MXFP8' if mxfp8 else 'bf16'} ones")
    elif mxfp8:
        (dout_q, dout_s), (w_q, w_s) = operand_parts("dout_rows", dout_rows), operand_parts("w_down", w_down)
        if w_s is None or pingpong:
            raise ValueError("MXFP8 operands: w_down as an (elements, scales) pair too, no ping-pong")
        check_mxfp8_rows("dout_rows", dout_q, dout_s)
        num_rows, hidden = dout_q.shape
        dev = dout_q.device
        num_experts, inter = check_mxfp8_weights("w_down", w_q, w_s, dev, hidden)
        persistent, pingpong = persistent_default(dev) if persistent is None else persistent, False
        tile_n = SWIGLU_BACKWARD_TILE_N
        pointers = dict(a=dout_q, a_scale=dout_s, b=w_q, b_scale=w_s, b2=w_q, b2_scale=w_s)
    else:
        check_tensor("dout_rows", dout_rows, dtypes=BF16, ndim=2, contiguous=True)
        num_rows, hidden = dout_rows.shape
        dev = dout_rows.device
        persistent = persistent_default(dev) if persistent is None else persistent
        check_tensor("w_down", w_down, dtypes=BF16, ndim=3, device=dev, contiguous=True)
        num_experts, _, inter = w_down.shape
        check_tensor("w_down", w_down, shape=(num_experts, hidden, inter))
        if inter % 8 or hidden % 8:
            raise ValueError(f"w_down: expected I % 8 == 0 and H % 8 == 0 (16-byte rows), got I={inter}, H={hidden}")
        tile_n = SWIGLU_BACKWARD_TILE_N
        if pingpong is None:
            pingpong = swiglu_backward_pingpong(persistent, tile_n)
        if pingpong and not persistent:
            raise ValueError("pingpong: only with persistent=True")
        pointers = dict(a=dout_rows, b=w_down, b2=w_down)
    check_tensor("h", h, dtypes=BF16, shape=(num_rows, 2 * inter), device=dev, contiguous=True)
    check_tensor("tile_expert", tile_expert, dtypes=I32, shape=(-(-num_rows // 128),), device=dev, contiguous=True)
    unit_scale, num_tokens, topk = _check_router_rows(row_token, row_slot, topk_w, num_rows, dev)
    if bias_piece and unit_scale:
        raise ValueError("bias_piece: only for the routed experts' backward (the router-weight gradient's pieces)")
    dh = torch.empty(num_rows, 2 * inter, dtype=torch.bfloat16, device=dev)
    a_scaled = torch.empty(num_rows, inter, dtype=torch.bfloat16, device=dev)
    pieces = -(-inter // tile_n) + int(bias_piece)
    partial = None if unit_scale else torch.empty(num_rows, pieces, dtype=torch.float32, device=dev)
    check_launchable(dout_rows=pointers["a"], h=h, dh=dh)
    check_weights_launchable(w_down=pointers["b"])
    if mxfp8 and dev.type == "cuda":
        require_mxfp8_gemms("swiglu_backward_gemm", arch_of(dev.index))
    _check_cluster_m(cluster_m, operand, persistent)
    if num_rows == 0:
        return dh, a_scaled, partial
    variant = grouped_gemm_variant(
        inter, hidden, tile_n=tile_n, epilogue="swiglu_bwd", b_major="k" if mxfp8 or fp8_block else "n", topk=topk, unit_scale=unit_scale,
        persistent=persistent, pingpong=pingpong, operand=operand, activation=activation, bias=bias_piece, cluster_m=cluster_m,
        block_buffers=block_buffers, deep_turn=deep_turn,
    )
    launch_grouped_gemm(
        variant, dev, **pointers, c=dh, tile_expert=tile_expert, h=h, a_scaled=a_scaled, partial=partial, row_token=row_token,
        row_slot=row_slot, topk_w=topk_w, num_rows=num_rows, num_experts=num_experts, num_tokens=num_tokens,
    )
    return dh, a_scaled, partial
