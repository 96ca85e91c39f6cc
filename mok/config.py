"""Static configuration of one MoE layer.

Everything a kernel's shape, tiling or specialisation depends on lives here, and only
here: token counts never enter (DESIGN.md, batch invariance). The config is frozen and
hashable so that it can key compiled kernels and workspaces.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .kernels.constants import check_activation
from .validation import check_positive_int

PRECISIONS = ("bf16", "mxfp8", "mxfp8_emulated", "fp8_block")  # the expert GEMMs' operands (mok/pipeline/stages.py)
SAVED_H_FORMATS = ("bf16", "mxfp8", "recompute", "recompute_gate")  # how h is kept for the backward (mok/saved_h.py), or not kept
DISPATCH_FORMATS = ("bf16", "mxfp8", "fp8_block")  # how x crosses to the experts' ranks at EP > 1 (mok/pipeline/exchange.py)
GATE_UP_LAYOUTS = ("separate", "concatenated", "interleaved")  # how w_gate and w_up are stored (the kernels read each in place)
FP8_SCALES = ("fp32", "power_of_two")  # precision="fp8_block"'s scale rule (mok/fp8_block.py)
WGRAD_FORMATS = ("bf16", "fp8_block", "mxfp8")  # the expert weight gradients' operands (mok/pipeline/stages.py)
OWN_WGRAD_FORMAT = {"bf16": "bf16", "fp8_block": "bf16", "mxfp8": "mxfp8", "mxfp8_emulated": "mxfp8"}  # each precision's default
WGRAD_PRECISIONS = {"fp8_block": ("fp8_block",), "mxfp8": ("mxfp8", "mxfp8_emulated")}  # the precisions a quantized one goes with


def check_wgrad_format(value: object, precision: str) -> str:
    """``value`` if it names weight-gradient operands that go with ``precision`` (MoKConfig.wgrad_format),
    else a ValueError."""
    if value not in WGRAD_FORMATS:
        raise ValueError(f"wgrad_format: expected None (the precision's own) or one of {WGRAD_FORMATS}, got {value!r}")
    if value in WGRAD_PRECISIONS and precision not in WGRAD_PRECISIONS[value]:
        raise ValueError(f"wgrad_format={value!r}: only with precision {' or '.join(map(repr, WGRAD_PRECISIONS[value]))} (its "
                         f"quantizers and scale rule), got precision={precision!r}")
    return value


def check_saved_h_format(value: object) -> str:
    """``value`` if it names a format h can be kept in for the backward, else a ValueError."""
    if value not in SAVED_H_FORMATS:
        raise ValueError(f"saved_h_format: expected one of {SAVED_H_FORMATS}, got {value!r}")
    return value


@dataclass(frozen=True)
class MoKConfig:
    """Shapes of one MoE layer and of its expert-parallel split.

    hidden: model width H. intermediate: routed-expert width I. num_experts: E, over all
    ranks. topk: experts per token. shared_intermediate: width of the optional shared
    expert (None for none). ep_size: ranks in the expert-parallel group (E must divide
    evenly). block_m: row tile of the grouped GEMMs (128, the only one the kernels have); each
    expert's rows are padded to a multiple of it. one_launch: run the forward as one persistent
    kernel (plus 2 launches for a shared expert) instead of several, at EP = 1 and per rank at
    EP > 1; the same bits.
    fuse_wgrad_accumulation: the backward adds the expert weights' gradients into fp32
    ``main_grad`` buffers (mok/main_grad.py); its weight-gradient kernels are then the fp32
    accumulating ones. saved_h_format: how h, the SwiGLU inputs the backward needs (k·2I values per
    token), lives between forward and backward: "bf16" (default); "mxfp8" (mok/saved_mxfp8.py; I and
    I_s multiples of 16): 33/64 of the bytes, a quantize launch in the forward and a dequantize
    launch in the backward (two each with a shared expert in launches of its own), ~3-4% relative
    error in the expert gradients; "recompute": not kept, the backward runs the gate/up GEMM again
    right before the SwiGLU backward (the same GEMM on the same rows: the same h, the same
    gradients, bit for bit; about a fifth more FLOPs a step; at EP > 1 the rows this rank pulled
    are kept, H values per row, and h comes from them); "recompute_gate" (bf16 precision): h's up
    half kept (half of bf16's bytes), its gate half computed again in the backward by the gate
    GEMM alone (the same bits; about a ninth more FLOPs a step; a shared expert in launches of its
    own keeps its h whole).
    dispatch_format: "bf16" (default) or "mxfp8" (ep_size > 1, H a multiple of 16; with or without
    one_launch): x crosses to the experts' ranks in MXFP8 (33/64 of the bytes) and the routed experts
    compute on its rounding (mok/pipeline/exchange.py); "fp8_block" (ep_size > 1, precision
    "fp8_block"; SM100: the scales written as E8M0 in its MMAs' order): x crosses as the FP8 rows its
    fc1 takes, quantized once by the sender
    (1 x 128 blocks by fp8_scales' rule: about half of bf16's bytes), the forward's bits those of
    the bf16 dispatch, and in the backward dout likewise as the rows the SwiGLU backward takes; the
    backward's x and dout rows are those FP8 rows' values.
    precision: the routed experts' GEMM operands: "bf16" (default), "mxfp8" (every expert GEMM of
    forward and backward on MXFP8 operands, block-scaled MMAs: SM100 only, compile-verified, never
    run) or "mxfp8_emulated" (the same numerics on any GPU MoK runs on, the operands dequantized
    into the bf16 GEMMs: to study MXFP8's accuracy, slower than bf16; both at one GPU or expert
    parallelism, not in one launch yet; widths multiples of 16: width_rule) or "fp8_block" (DeepSeek-V3's
    FP8: the expert GEMMs on E4M3 with fp32 scales per 1 x 128 of the rows and 128 x 128 of the
    weights, mok.fp8_block, on Hopper's FP8 WGMMAs, forward and backward dgrad; the weights
    quantized once per version; the weight gradients in bf16 unless wgrad_format says FP8); H, I
    and I_s multiples of 16 (a partial last scale block), one GPU or expert parallelism (the rows
    cross in bf16 or dispatch_format's MXFP8 and are quantized on the experts' rank, or cross in
    dispatch_format's fp8_block as fc1 takes them), without one_launch so far (with
    fuse_wgrad_accumulation, the bf16, mxfp8 and recompute saved_h_formats and expert_bias).
    fp8_scales (precision="fp8_block"): "fp32" (default: a block's scale is amax / 448) or
    "power_of_two" (the power of two at or above it, so that dividing by it is exact; mok.fp8_block),
    for every activation and weight the layer quantizes.
    wgrad_format: the routed experts' weight gradients' operands (None: the precision's own, bf16
    for bf16 and fp8_block, MXFP8 for mxfp8 and mxfp8_emulated): "bf16"; "fp8_block" (precision
    fp8_block: the rows' transposes quantized with 1 x 128 blocks along the rows, their K, and FP8
    WGMMAs, DeepSeek-V3's recipe, mok/kernels/sm90/weight_grad_gemm.py; on SM100 the same blocks as
    E8M0 through its MXFP8 weight-gradient kernel; on an H100 a faster step than bf16's at
    DeepSeek-V3's widths with ~1024 rows an expert, slower with narrower experts (Qwen3's H 2048,
    I 768) or ~256 rows an expert: perf/RESULTS.md); "mxfp8"
    (precision mxfp8 or mxfp8_emulated: quantized along the rows in blocks of 32).
    gate_up_layout: how w_gate and w_up are stored: "separate" (default: two tensors, each expert's
    [I, H] block contiguous), "concatenated" (the two halves of one [E, 2I, H] tensor, gate rows
    first, as transformers' gate_up_proj) or "interleaved" (its even and odd rows, w[:, 0::2] and
    w[:, 1::2]: gpt-oss's gate_up_proj, transposed): the GEMMs read them in place each way (their
    expert and row strides are kernel parameters); with "concatenated" or "interleaved" the
    backward returns their gradient as one [E, 2I, H] tensor in the same layout (d_w_gate, with
    d_w_up None) straight from the weight-gradient GEMM, and precompile builds the strided kernels
    (bf16 precision, fresh weight gradients so far).
    activation: the experts' gated activation a = act(x·W_gateᵀ, x·W_upᵀ), for the routed and the
    shared experts alike: "swiglu" (default, silu(gate)·up), "clamped_swiglu" (gpt-oss's: the gate
    clamped to at most 7, up to [-7, 7], (up + 1)·gate·σ(1.702·gate)) or "geglu" (gelu(gate)·up,
    gelu's tanh approximation); computed in the SwiGLU epilogues, forward and backward
    (mok/kernels/common/gated_activation.py), with the router-weight gradient as for SwiGLU.
    expert_bias: the routed experts have biases (gpt-oss's): b_gate, b_up [E, I] added to h_gate and
    h_up, b_down [E, H] to each expert's output y (so the router-weight gradient <dout, y> includes
    it); the backward returns their gradients (as plain gradients with fuse_wgrad_accumulation too:
    Megatron's fused accumulation covers the weights, its DDP adds a bias's gradient to main_grad).
    Every precision (bf16 staged or in one launch); a shared expert beside them (without biases)
    runs in launches of its own.
    row_tile_pairs: the routed experts' staged bf16 grouped GEMMs (gate/up, down, dx; their EP
    forms), or with fp8_block on Hopper its gate/up GEMM, on clusters of two CTAs over each pair
    of row tiles, which load a weight tile once for both where one expert has both tiles (TMA
    multicast; mok/kernels/sm90/grouped_gemm.py): the same bits; off by default: 0.95-1.01x on an
    H100 with bf16 (docs/notes/grouped-gemms-vs-quack.md), 2-3% slower with fp8_block's gate/up
    GEMM in turns of 4 (docs/notes/fp8-block-hopper.md).
    """

    hidden: int
    intermediate: int
    num_experts: int
    topk: int
    shared_intermediate: int | None = None
    ep_size: int = 1
    block_m: int = 128
    precision: str = "bf16"
    one_launch: bool = False
    fuse_wgrad_accumulation: bool = False
    saved_h_format: str = "bf16"
    dispatch_format: str = "bf16"
    gate_up_layout: str = "separate"
    activation: str = "swiglu"
    expert_bias: bool = False
    fp8_scales: str = "fp32"
    wgrad_format: str | None = None
    row_tile_pairs: bool = False

    def check_biases_given(self, given: bool) -> None:
        """Refuse routed-expert biases given without ``expert_bias`` or missing with it (ValueError)."""
        if given != self.expert_bias:
            raise ValueError(f"biases: config.expert_bias is {self.expert_bias}, so expected "
                             f"{'the gate, up and down biases' if self.expert_bias else 'none'}, got {'some' if given else 'none'}")

    def __post_init__(self) -> None:
        check_positive_int("hidden", self.hidden)
        check_positive_int("intermediate", self.intermediate)
        check_positive_int("num_experts", self.num_experts)
        check_positive_int("topk", self.topk)
        check_positive_int("ep_size", self.ep_size)
        check_positive_int("block_m", self.block_m)
        if self.block_m != 128:
            raise ValueError(f"block_m: expected 128 (the row tile every MoK kernel is built for), got {self.block_m}")
        if self.shared_intermediate is not None:
            check_positive_int("shared_intermediate", self.shared_intermediate)
        if self.hidden % 8:
            raise ValueError(f"hidden: expected a multiple of 8 (16-byte bf16 vectors), got {self.hidden}")
        if self.intermediate % 8:
            raise ValueError(f"intermediate: expected a multiple of 8 (16-byte bf16 vectors), got {self.intermediate}")
        if self.topk > self.num_experts:
            raise ValueError(f"topk: expected at most num_experts={self.num_experts}, got {self.topk}")
        if self.num_experts % self.ep_size:
            raise ValueError(
                f"num_experts: expected a multiple of ep_size={self.ep_size}, got {self.num_experts}"
            )
        for flag in ("one_launch", "fuse_wgrad_accumulation", "expert_bias", "row_tile_pairs"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag}: expected a bool, got {getattr(self, flag)!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision: expected one of {PRECISIONS}, got {self.precision!r}")
        check_saved_h_format(self.saved_h_format)
        if self.dispatch_format not in DISPATCH_FORMATS:
            raise ValueError(f"dispatch_format: expected one of {DISPATCH_FORMATS}, got {self.dispatch_format!r}")
        if self.gate_up_layout not in GATE_UP_LAYOUTS:
            raise ValueError(f"gate_up_layout: expected one of {GATE_UP_LAYOUTS}, got {self.gate_up_layout!r}")
        check_activation(self.activation)
        if self.fp8_scales not in FP8_SCALES:
            raise ValueError(f"fp8_scales: expected one of {FP8_SCALES}, got {self.fp8_scales!r}")
        check_combination(self)

    @property
    def experts_per_rank(self) -> int:
        """Local experts on each rank."""
        return self.num_experts // self.ep_size

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_intermediate is not None

    @property
    def gate_up_joined(self) -> bool:
        """Whether w_gate and w_up are parts of one [E, 2I, H] tensor, its halves or its even and odd
        rows (and their gradient one such tensor too)."""
        return self.gate_up_layout != "separate"

    @property
    def recomputes_h(self) -> bool:
        """Whether the backward computes h again instead of the forward keeping it."""
        return self.saved_h_format == "recompute"

    @property
    def widths(self) -> dict:
        """The layer's widths by name: hidden, intermediate and, with a shared expert, shared_intermediate
        (a width the user did not give is not named)."""
        return {"hidden": self.hidden, "intermediate": self.intermediate} | _shared_width(self)

    @property
    def fp8_power_of_two(self) -> bool:
        """Whether precision="fp8_block" scales by powers of two (``fp8_scales``)."""
        return self.fp8_scales == "power_of_two"

    @property
    def weight_grad_format(self) -> str:
        """The routed experts' weight gradients' operands: ``wgrad_format``, or the precision's own."""
        return OWN_WGRAD_FORMAT[self.precision] if self.wgrad_format is None else self.wgrad_format

    @property
    def recomputes_gate(self) -> bool:
        """Whether the forward keeps h's up half only and the backward computes its gate half again."""
        return self.saved_h_format == "recompute_gate"

    def as_dict(self) -> dict:
        return asdict(self)


def _shared_width(config: "MoKConfig") -> dict:
    """{"shared_intermediate": I_s} with a shared expert, else {} (a width the user did not give is not named)."""
    return {} if config.shared_intermediate is None else {"shared_intermediate": config.shared_intermediate}


def width_rule(config: "MoKConfig") -> tuple[int, str]:
    """(the step every width of a layer of ``config`` is a multiple of on a GPU, why): 8 in bf16
    (16-byte rows: the partial last tiles zero-filled by TMA on load and left unwritten past the
    width on store, the bf16 kernels of every arch, staged or in one launch), 16 with FP8 block
    scales and with MXFP8, emulated or on SM100's block-scaled MMAs (16-byte E4M3 rows; a partial
    last scale block: 16 values of a 32-block, the MMA order's padding blocks scale 1, the K tiles
    over ceil(K / 128) scale chunks). (The CPU reference path takes any width in bf16.)"""
    if config.precision == "bf16":
        return 8, "16-byte rows"
    return 16, "16-byte E4M3 rows"


def check_combination(config: "MoKConfig") -> None:
    """Refuse a combination of options no target runs (ValueError naming it); which ones a given
    target does not run is mok.plan's to say."""
    if config.precision != "bf16":
        if config.one_launch:
            raise ValueError(f"precision={config.precision!r}: not with one_launch (not written yet)")
        widths = config.widths
        step, why = width_rule(config)
        if any(v % step for v in widths.values()):
            raise ValueError(f"precision={config.precision!r}: expected widths that are multiples of {step} ({why}), got {widths}")
    if config.wgrad_format is not None:
        check_wgrad_format(config.wgrad_format, config.precision)
    if config.fp8_scales != "fp32" and config.precision != "fp8_block":
        raise ValueError(f"fp8_scales={config.fp8_scales!r}: only with precision='fp8_block' (its scale rule), got precision={config.precision!r}")
    if config.saved_h_format == "recompute_gate" and config.precision != "bf16":
        raise ValueError(f"saved_h_format='recompute_gate': bf16 precision only (its gate GEMM is bf16), got precision={config.precision!r}")
    if config.saved_h_format == "mxfp8":  # h [rows, 2I] in blocks of 32 along its rows: 2I and 2I_s multiples of 32
        widths = {"intermediate": config.intermediate} | _shared_width(config)
        if any(v % 16 for v in widths.values()):
            raise ValueError(f"saved_h_format='mxfp8': expected widths that are multiples of 16 (h's 2I in blocks of 32), got {widths}")
    if config.gate_up_joined:
        others = {f"precision={config.precision!r}": config.precision != "bf16", "fuse_wgrad_accumulation": config.fuse_wgrad_accumulation}
        if any(others.values()):
            raise ValueError(
                f"gate_up_layout={config.gate_up_layout!r}: not with {', '.join(k for k, v in others.items() if v)} (its one "
                "[E, 2I, H] gradient comes from the bf16 weight-gradient GEMM, fresh: not written yet for the others)"
            )
    if config.row_tile_pairs and (config.precision not in ("bf16", "fp8_block") or config.one_launch):
        raise ValueError(f"row_tile_pairs: the staged bf16 GEMMs' and fp8_block's option, not with precision={config.precision!r}"
                         f"{' and one_launch' if config.one_launch else ''}")
    if config.dispatch_format != "bf16" and config.ep_size == 1:
        raise ValueError(f"dispatch_format={config.dispatch_format!r}: only with ep_size > 1 (at one rank nothing is dispatched)")
    if config.dispatch_format == "fp8_block" and config.precision != "fp8_block":
        raise ValueError(f"dispatch_format='fp8_block': only with precision='fp8_block' (the rows cross as its fc1 takes them), "
                         f"got precision={config.precision!r}")
    if config.dispatch_format == "mxfp8":
        if config.hidden % 16:
            raise ValueError(f"dispatch_format='mxfp8': expected hidden a multiple of 16 (16-byte E4M3 rows), got {config.hidden}")


# The configuration `python -m mok precompile` builds when given no shape options:
# one rank of DeepSeek-V3 over EP8 (H 7168, I 2048, 256 experts, top-8, one shared expert).
DEFAULT_CONFIG = MoKConfig(
    hidden=7168, intermediate=2048, num_experts=256, topk=8, shared_intermediate=2048, ep_size=8
)
