"""What runs where: a layer configuration and a target resolved once into a :class:`Plan`.

The plan is the one place that says which combination of precision (bf16, mxfp8, mxfp8_emulated),
parallelism (one GPU, or expert parallel over a workspace), fusion (staged launches, or one
launch) and arch (sm_90a, sm_100a, sm_103a) runs on a target and why a combination is refused there
(:func:`refusal`; the combinations no target runs are refused by MoKConfig itself,
mok.config.check_combination),
and which kernels each stage launches (:meth:`Plan.variants`, what ``python -m mok precompile``
builds). The pipelines (mok/pipeline/) read their branches from it; the layer, the functional
API and the torch ops only resolve it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .config import MoKConfig, width_rule
from .kernels import KernelVariant
from .kernels.variants import (
    SWIGLU_BACKWARD_TILE_N,
    column_sums_variant, combine_variant, default_tile_n, ep_variant, expert_mlp_variant, gather_variant, grouped_gemm_variant, quantize_mxfp8_variant,
    fp8_weights_quantizer, mxfp8_column_shape, mxfp8_row_shape, quantize_fp8_block_variant, router_grad_variant, row_dots_variant, schedule_variant,
    swiglu_backward_pingpong, weight_grad_variant,
)
from .runtime.arch import FP8_BLOCK_GEMM_ARCHS, MXFP8_GEMM_ARCHS, PERSISTENT_GEMM_ARCHS, check_fused_layer_device, normalize_arch, require_mxfp8_gemms

TILE = 128  # the fused kernels' tile of every width (H, I, I_s), and the grouped GEMMs' row tile


def check_tiled_widths(name: str, widths: dict, rule: tuple[int, str] = (TILE, "the fused kernels' tile")) -> None:
    """Refuse widths of the layer (H, I, a shared expert's I_s) that the kernels do not take,
    naming them, before anything is compiled or launched: ``rule`` = (step, why), e.g.
    mok.config.width_rule's (the reference path takes any)."""
    step, why = rule
    if any(width % step or width < step for width in widths.values()):
        got = ", ".join(f"{width_name}={width}" for width_name, width in widths.items())
        raise ValueError(f"{name}: expected {', '.join(widths)} multiples of {step} ({why}), got {got}")


def refusal(config: MoKConfig, arch: str) -> str | None:
    """Why a layer of ``config`` does not run on ``arch`` (None when it does)."""
    if config.precision == "mxfp8" and arch not in MXFP8_GEMM_ARCHS:
        return f"precision='mxfp8' needs block-scaled MMAs ({', '.join(MXFP8_GEMM_ARCHS)}); on {arch} use precision='mxfp8_emulated'"
    if config.precision == "fp8_block" and arch not in FP8_BLOCK_GEMM_ARCHS:
        return fp8_on_block_scaled_mma_refusal(config, arch)
    return None


def fp8_on_block_scaled_mma_refusal(config: MoKConfig, arch: str) -> str | None:
    """Why precision="fp8_block" does not run on ``arch``'s block-scaled MMAs (SM100: its
    power-of-two 128-block scales as E8M0 bytes through the MXFP8 kernels, with every option
    Hopper's runs: wgrad_format and dispatch_format "fp8_block" too; None where it does)."""
    if arch not in MXFP8_GEMM_ARCHS:
        return f"precision='fp8_block': Hopper's FP8 WGMMAs or SM100's block-scaled MMAs ({', '.join(MXFP8_GEMM_ARCHS)}), got {arch}"
    if not config.fp8_power_of_two:
        return (f"precision='fp8_block' on {arch} runs on its block-scaled MMAs and needs fp8_scales='power_of_two' (the MMAs' "
                "scales are E8M0: powers of two)")
    return None


def shared_in_routed_possible(config: MoKConfig) -> bool:
    """Whether a shared expert of the routed experts' shapes may run in their launches, as expert E
    with its rows first (bf16 on one GPU, the routed experts without biases, which it has not; the
    weights' layout decides per call)."""
    return (config.precision == "bf16" and config.ep_size == 1 and config.shared_intermediate == config.intermediate
            and not config.expert_bias)


@dataclass(frozen=True)
class Plan:
    """A configuration resolved for one target: every branch the pipelines take, read from here."""

    config: MoKConfig
    arch: str

    @property
    def precision(self) -> str:
        """The routed experts' forward GEMM operands: "bf16", "mxfp8" (emulated or not) or "fp8_block"."""
        return {"mxfp8_emulated": "mxfp8"}.get(self.config.precision, self.config.precision)


    @property
    def activation(self) -> str:
        """The experts' gated activation (the SwiGLU epilogues compute it)."""
        return self.config.activation

    @property
    def emulate(self) -> bool:
        """MXFP8's numerics on bf16 GEMMs (the operands dequantized, exactly): any target."""
        return self.config.precision == "mxfp8_emulated"

    @property
    def persistent(self) -> bool:
        """The persistent, warp-specialised GEMMs (every target MoK has; else one tile per CTA)."""
        return self.arch in PERSISTENT_GEMM_ARCHS

    @property
    def ep(self) -> bool:
        return self.config.ep_size > 1

    @property
    def pairs(self) -> dict:
        """The routed experts' staged bf16 grouped GEMMs' cluster option: ``cluster_m`` 2 with
        row_tile_pairs (MoKConfig: bf16 not in one launch; fp8_block's: :attr:`gate_up_pairs`), else none."""
        return {"cluster_m": 2} if self.config.row_tile_pairs and self.precision == "bf16" else {}

    @property
    def gate_up_pairs(self) -> dict:
        """The FP8 gate/up GEMM's cluster option (fp8_block on Hopper): ``cluster_m`` 2, B's tile
        multicast to two row tiles of one expert, with row_tile_pairs, else none (the same sums
        either way: the pairs only share loads). Off by default: with the GEMM's turns of 4 the
        pairs made the forward 2-3% slower (H100, perf/RESULTS.md)."""
        if self.precision != "fp8_block" or self.fp8_on_block_scaled_mma:
            return {}
        return {"cluster_m": 2} if self.config.row_tile_pairs else {}

    @property
    def quantizes_activation_in_gemm(self) -> bool:
        """Whether the gate/up GEMM's epilogue hands the down projection its FP8 operand (fp8_block
        on Hopper, one CTA a gate/up tile: ops.grouped_gemm(out_format="fp8_block")), so that no
        bf16 activation is written and no quantizer passes over it; the same bits as quantizing it."""
        return self.precision == "fp8_block" and self.fp8_scale_order == "rows" and not self.gate_up_pairs

    @property
    def one_launch(self) -> bool:
        return self.config.one_launch

    @property
    def gather_in_gemm(self) -> bool:
        """Whether the gate/up GEMM's producer gathers its rows from x (bf16 at one GPU); else they
        are gathered first (fp8_block: as they are quantized, :attr:`quantizes_gathered_rows`) or
        pulled from the peers. (The FP8 kernel's producer can gather E4M3 rows too, the same bits;
        it was slower than quantizing the gathered rows at every shape measured:
        docs/notes/fp8-block-hopper.md.)"""
        return self.precision == "bf16" and self.persistent and not self.ep

    @property
    def quantizes_gathered_rows(self) -> bool:
        """Whether the gate/up GEMM's FP8 rows come from x's tokens quantized (fp8_block at one GPU),
        never from a bf16 copy of the gathered rows: each token quantized once and its E4M3 row
        gathered (:attr:`gathers_fp8_rows`), or the rows gathered as they are quantized."""
        return self.precision == "fp8_block" and not self.ep

    @property
    def gathers_fp8_rows(self) -> bool:
        """Whether gathered FP8 rows are quantized once per token and then gathered with their
        scales (ops.gather_fp8_rows: half of bf16's bytes moved; Hopper's fp32 row scales), where
        no bf16 copy of the gathered rows is written in the same pass; else (SM100's MMA-ordered
        scales) gathered as they are quantized. The same bits either way."""
        return self.precision == "fp8_block" and self.fp8_scale_order == "rows"

    def gathered_rows_quantizers(self, width: int, copies_rows: bool = False) -> list[KernelVariant]:
        """The kernels that make x's (or dout's) FP8 rows in the schedule's order at one GPU
        (:attr:`gathers_fp8_rows`; ``copies_rows``: their bf16 copy written in the same pass)."""
        pow2, mma = self.config.fp8_power_of_two, self.fp8_on_block_scaled_mma
        if self.gathers_fp8_rows and not copies_rows:
            return [quantize_fp8_block_variant(width, power_of_two=pow2), gather_variant(width, fp8=True)]
        return [quantize_fp8_block_variant(width, power_of_two=pow2, bounded=True, mma_scales=mma, gathered=True, copies_rows=copies_rows)]

    @property
    def fp8_on_block_scaled_mma(self) -> bool:
        """precision="fp8_block" on SM100: its power-of-two 128-block scales as E8M0 bytes in the
        order the block-scaled MMAs read (ops.quantize_fp8_rows(scale_order="mma")), the GEMMs the
        MXFP8 kernels (Hopper: the FP8 WGMMA kernel with fp32 scales)."""
        return self.precision == "fp8_block" and self.arch in MXFP8_GEMM_ARCHS

    @property
    def fp8_scale_order(self) -> str:
        """How precision="fp8_block" hands its scales to the GEMMs: "rows" (fp32, Hopper) or "mma" (E8M0, SM100)."""
        return "mma" if self.fp8_on_block_scaled_mma else "rows"

    @property
    def shared_in_routed(self) -> bool:
        """Whether a shared expert may run in the routed experts' launches (:func:`shared_in_routed_possible`)."""
        return shared_in_routed_possible(self.config)

    @property
    def _bias(self) -> dict:
        """The grouped GEMMs' ``bias`` option where the experts have biases (only then a key)."""
        return {"bias": True} if self.config.expert_bias else {}

    def variants(self) -> list[KernelVariant]:
        """Every kernel variant this plan's forward and backward launch (the built-in router's GEMMs
        included), each once: what precompile builds."""
        found = {}
        listed = self._forward_variants() + self._backward_variants() + self._gate_up_in_place_variants()
        for variant in listed + router_variants(self.config.hidden, self.config.num_experts, self.persistent):
            found.setdefault((variant.name, tuple(sorted(variant.config.items()))), variant)
        return list(found.values())

    def _forward_variants(self) -> list[KernelVariant]:
        c, persistent = self.config, self.persistent
        h, i, k, shared, act = c.hidden, c.intermediate, c.topk, c.has_shared_expert, c.activation
        v = self._exchange_variants() if self.ep else []
        if not self.one_launch:  # (the one-launch kernel combines in its last phase)
            v.append(combine_variant(h, k, shared, gathered=not self.ep))
        if self.one_launch:
            ep_world = c.ep_size if self.ep else None
            for save_h in (False, True):
                v.append(expert_mlp_variant(h, i, k, c.experts_per_rank, save_h=save_h, has_shared=shared, ep_world=ep_world,
                                            dispatch_format=c.dispatch_format, activation=act, bias=c.expert_bias))
                if self.shared_in_routed:
                    v.append(expert_mlp_variant(h, i, k, c.experts_per_rank, save_h=save_h, has_shared=True, shared_prefix=True,
                                                activation=act))
            if self.ep:
                v.append(gather_variant(h))  # (the backward's rows, from the tokens the launch copied)
        else:
            v.append(schedule_variant(c.experts_per_rank, k, TILE))
            if not self.gather_in_gemm and not self.ep and not self.quantizes_gathered_rows:
                v.append(gather_variant(h, bounded=True))  # (up to the schedule's rows in use)
            for save_h in (False, True):
                v += self._gemm_variants(i, h, epilogue="swiglu_save" if save_h else "swiglu", gather_a=self.gather_in_gemm, activation=act,
                                         rows_gathered=self.quantizes_gathered_rows, **self._bias)
            a_quantized = self.quantizes_activation_in_gemm
            if self.ep:
                v += self._gemm_variants(h, i, scatter=True, topk=k, rows_quantized=a_quantized, **self._bias)
            else:
                v += self._gemm_variants(h, i, rows_quantized=a_quantized, **self._bias)
        if shared:  # in launches of its own (weights that do not lie after the routed experts', or EP)
            for epilogue in ("swiglu", "swiglu_save"):
                v.append(grouped_gemm_variant(c.shared_intermediate, h, epilogue=epilogue, persistent=persistent, activation=act))
            v.append(grouped_gemm_variant(h, c.shared_intermediate, persistent=persistent))
        if c.saved_h_format == "mxfp8":  # h kept in MXFP8: the rows in use; a shared expert's own h, every row
            v += [quantize_mxfp8_variant(bounded=True), quantize_mxfp8_variant(back=True, bounded=True)]
            if shared:
                v += [quantize_mxfp8_variant(), quantize_mxfp8_variant(back=True)]
        return v

    def _backward_variants(self) -> list[KernelVariant]:
        c, persistent = self.config, self.persistent
        h, i, k, shared = c.hidden, c.intermediate, c.topk, c.has_shared_expert
        # the rows' gathers at one GPU, up to the rows in use: dout's and x's in one launch, or x's alone (dout's gathered as quantized)
        v = []
        if not self.ep and not self.quantizes_gathered_rows:
            v += [gather_variant(h, bounded=True), gather_variant(h, sources=2, bounded=True)]
        elif not self.ep and c.weight_grad_format != "fp8_block":
            v.append(gather_variant(h, bounded=True))
        v += self._swiglu_backward_variants(i, h, topk=k)
        parts = -(-i // SWIGLU_BACKWARD_TILE_N) + int(c.expert_bias)  # the router-gradient pieces per row (the down bias's last)
        if self.ep:
            v += self._gemm_variants(h, 2 * i, scatter=True, topk=k, b_major="n", k_split=True)
            v.append(router_grad_variant(k, parts))
            v.append(combine_variant(h, k, shared, gathered=False, unit_weights=True))
        else:
            v += self._gemm_variants(h, 2 * i, b_major="n", k_split=True)
            v.append(combine_variant(h, k, shared, gathered=True, unit_weights=True, router_parts=parts))
        if c.expert_bias:  # their gradients (column sums of dh and of the weighted dout rows) and the down bias's piece
            v += [column_sums_variant(2 * i), column_sums_variant(h, weighted=True, topk=k), row_dots_variant(h, parts)]
        if c.recomputes_h:  # the gate/up GEMM again, as the forward's stages run it (also after a one-launch forward)
            v += self._gemm_variants(i, h, epilogue="swiglu_save", gather_a=self.gather_in_gemm, activation=c.activation,
                                     rows_gathered=self.quantizes_gathered_rows, **self._bias)
        if c.recomputes_gate:
            v.append(self._gate_variant())
        v += self._weight_grad_variants(h, i, c.weight_grad_format)
        if shared:
            s = c.shared_intermediate
            v.append(grouped_gemm_variant(s, h, epilogue="swiglu_bwd", b_major="n", unit_scale=True, persistent=persistent,
                                          pingpong=swiglu_backward_pingpong(persistent, SWIGLU_BACKWARD_TILE_N), activation=c.activation))
            v.append(grouped_gemm_variant(h, 2 * s, b_major="n", k_split=True, persistent=persistent))
            v += self._weight_grad_variants(h, s, "bf16")
        return v

    def _gate_up_in_place_variants(self) -> list[KernelVariant]:
        """gate_up_layout "concatenated" or "interleaved": the kernels that read w_gate and w_up as
        the halves of one [E, 2I, H] tensor (their expert stride 2·I·H) or as its even and odd rows
        (also their row stride 2·H), and write their gradient as one (bf16 only), beside the packed
        ones (which run where the weights are copied together, e.g. with a shared expert)."""
        c = self.config
        if not c.gate_up_joined:
            return []
        h, i, k = c.hidden, c.intermediate, c.topk
        interleaved = c.gate_up_layout == "interleaved"
        strides = dict(b_expert_stride=2 * i * h) | (dict(b_row_stride=2 * h) if interleaved else {})
        epilogues = (("swiglu", "swiglu_save") if not self.one_launch else ()) + (("swiglu_save",) if c.recomputes_h else ())
        v = [grouped_gemm_variant(i, h, epilogue=e, gather_a=self.gather_in_gemm, persistent=self.persistent, activation=c.activation,
                                  **self._bias, **strides, **self.pairs) for e in epilogues]
        if self.one_launch:
            ep_world = c.ep_size if self.ep else None
            v += [expert_mlp_variant(h, i, k, c.experts_per_rank, save_h=save_h, has_shared=c.has_shared_expert, ep_world=ep_world,
                                     dispatch_format=c.dispatch_format, gate_up_stride=strides["b_expert_stride"],
                                     gate_up_row_stride=strides.get("b_row_stride"), activation=c.activation, bias=c.expert_bias)
                  for save_h in (False, True)]
        if c.recomputes_gate:  # (from w_gate in place)
            v.append(self._gate_variant(**strides))
        dx = dict(scatter=True, topk=k) if self.ep else dict(persistent=self.persistent)
        v.append(grouped_gemm_variant(h, 2 * i, b_major="n", k_split=True, **strides, **dx, **self.pairs))
        if interleaved:  # dW_gate, dW_up into the even and odd rows of one [E, 2I, H]
            v.append(weight_grad_variant(2 * i, h, "bf16", False, split_out=True, interleaved_out=True, persistent=self.persistent))
        else:  # [dW_gate; dW_up] as one [E, 2I, H]
            v.append(weight_grad_variant(2 * i, h, "bf16", False, persistent=self.persistent))
        return v

    def _gate_variant(self, **strides) -> KernelVariant:
        """saved_h_format="recompute_gate": h's gate half again, the gate GEMM alone in the gate/up
        GEMM's column tile (bf16; mok.pipeline.stages.gate_from_tokens); ``strides``: w_gate's."""
        c = self.config
        return grouped_gemm_variant(c.intermediate, c.hidden, tile_n=default_tile_n(c.intermediate, c.hidden, True),
                                    gather_a=self.gather_in_gemm, persistent=self.persistent, **self._bias, **strides, **self.pairs)

    def _exchange_variants(self) -> list[KernelVariant]:
        c, w = self.config, self.config.ep_size
        rows = dict(width=c.hidden, topk=c.topk)
        v = [ep_variant(kind, w, phase=1) for kind in ("signal", "wait")]
        v += [ep_variant("publish", w, **rows), ep_variant("routing", w, topk=c.topk), ep_variant("dispatch", w, **rows)]
        v += [ep_variant("overflow", w, phase=phase, **rows) for phase in (0, 1)]  # (a capacity bound only)
        if c.dispatch_format == "mxfp8":
            v += [ep_variant("publish_mxfp8", w, **rows), ep_variant("dispatch_mxfp8", w, **rows)]
        if c.dispatch_format == "fp8_block":  # (and the backward's x rows back to bf16: SM100's E8M0 rows by MXFP8's dequantizer)
            mma = self.fp8_scale_order == "mma"
            v += [ep_variant("publish_fp8_block", w, **rows, power_of_two=c.fp8_power_of_two),
                  ep_variant("dispatch_fp8_block", w, **rows, scale_order=self.fp8_scale_order),
                  quantize_mxfp8_variant(back=True, bounded=True, **mxfp8_row_shape(c.hidden)) if mma
                  else quantize_fp8_block_variant(c.hidden, bounded=True, back=True)]
        return v

    def _gemm_variants(self, n: int, k: int, rows_gathered: bool = False, rows_quantized: bool = False, **options) -> list[KernelVariant]:
        """A routed-expert GEMM in this plan's precision: bf16; MXFP8 (its rows quantized, the weights
        quantized once per call); emulated (the same operands dequantized into the bf16 GEMM); FP8
        with block scales (its rows quantized, gathered from x as they are with ``rows_gathered``, or
        with ``rows_quantized`` by the GEMM that made them; the weights once per version, transposed
        for the backward's: K-major either way)."""
        if self.precision == "bf16":
            return [grouped_gemm_variant(n, k, persistent=self.persistent, **options, **self.pairs)]
        if self.precision == "fp8_block":  # (gathering: x quantized whole; else the rows in use, with k_split a half at a time)
            options.pop("b_major", None)
            halves = 2 if options.get("k_split") else 1
            pow2, mma = self.config.fp8_power_of_two, self.fp8_on_block_scaled_mma
            gate_up = options.get("epilogue") in ("swiglu", "swiglu_save")
            if rows_gathered:
                rows = self.gathered_rows_quantizers(k)
            elif rows_quantized:  # (the activation, quantized by the gate/up GEMM: quantizes_activation_in_gemm)
                rows = []
            else:
                rows = [quantize_fp8_block_variant(k, power_of_two=pow2, bounded=mma or not options.get("gather_a"), mma_scales=mma,
                                                   segments=halves)]
            if mma:  # (SM100: the MXFP8 kernels; the rows gathered first; dh's halves each starting a chunk)
                options.pop("gather_a", None)
                gemms = [grouped_gemm_variant(n, k, persistent=self.persistent, operand="e4m3", **options)]
            else:  # (the gate/up GEMM: with row_tile_pairs on pairs, gate_up_pairs; else its activation out in FP8)
                out = dict(out_format="e4m3_block", power_of_two=pow2) if gate_up and self.quantizes_activation_in_gemm else {}
                gemms = [grouped_gemm_variant(n, k, operand="e4m3_block", **options, **(self.gate_up_pairs if gate_up else {}), **out)]
            return [*rows, fp8_weights_quantizer(n, k // halves, pow2, mma_scales=mma), *gemms]
        options.pop("gather_a", None)
        options.pop("b_major", None)  # (the transposed copies, K-major)
        conversions = self._mxfp8_conversions(n, k, halves=2 if options.get("k_split") else 1)
        if self.emulate:
            return conversions + [grouped_gemm_variant(n, k, persistent=self.persistent, **options)]
        return conversions + [grouped_gemm_variant(n, k, persistent=self.persistent, operand="e4m3", **options)]

    def _mxfp8_conversions(self, n: int, k: int, halves: int = 1) -> list[KernelVariant]:
        """An MXFP8 GEMM's conversions (its B [E, n, k / halves]): the rows quantized with MMA-ordered
        scales (those in use, each of ``halves`` blocked on its own; or every row: x, which the
        GEMM gathers), the weights (each expert's matrix chunked on its own), and with the emulation
        each of them back to bf16; static shapes where the widths do not tile into whole blocks
        (mok.kernels.variants.mxfp8_row_shape)."""
        weights = mxfp8_row_shape(k // halves, mma_order=True, matrix_rows=n)
        v = [quantize_mxfp8_variant(bounded=True, mma_order=True, **mxfp8_row_shape(k, segments=halves, mma_order=True)),
             quantize_mxfp8_variant(mma_order=True, **weights)]
        if halves == 1:
            v.append(quantize_mxfp8_variant(mma_order=True, **mxfp8_row_shape(k, mma_order=True)))
        if self.emulate:
            v += [quantize_mxfp8_variant(back=True, bounded=True, **mxfp8_row_shape(k, segments=halves)),
                  quantize_mxfp8_variant(back=True, **mxfp8_row_shape(k // halves))]
        return v

    def _swiglu_backward_variants(self, i: int, h: int, topk: int) -> list[KernelVariant]:
        if self.precision == "fp8_block":  # dout's rows and w_down's transpose [E, I, H] quantized along H
            c = self.config
            pow2, mma = c.fp8_power_of_two, self.fp8_on_block_scaled_mma
            # (one GPU: dout's FP8 rows from its tokens (gathered_rows_quantizers), with their bf16 copy where the weight gradients or the
            # biases' sums read them; at EP the rows pulled)
            if self.ep:
                rows = [quantize_fp8_block_variant(h, power_of_two=pow2, bounded=True, mma_scales=mma)]
            else:
                rows = self.gathered_rows_quantizers(h, copies_rows=c.weight_grad_format != "fp8_block" or c.expert_bias)
            quantizers = rows + [fp8_weights_quantizer(i, h, pow2, mma)]
            if mma:  # (SM100's MXFP8 kernel, as precision="mxfp8" runs it)
                return quantizers + [grouped_gemm_variant(i, h, epilogue="swiglu_bwd", tile_n=128, topk=topk, persistent=self.persistent,
                                                          operand="e4m3", activation=self.activation, **self._bias)]
            return quantizers + [grouped_gemm_variant(i, h, epilogue="swiglu_bwd", topk=topk, operand="e4m3_block", activation=self.activation,
                                                      **self._bias)]
        if self.precision == "mxfp8" and not self.emulate:
            return self._mxfp8_conversions(i, h) + [grouped_gemm_variant(i, h, epilogue="swiglu_bwd", tile_n=128, topk=topk,
                                                                          persistent=self.persistent, operand="e4m3", activation=self.activation,
                                                                          **self._bias)]
        v = self._mxfp8_conversions(i, h) if self.emulate else []
        tile_n = default_tile_n(i, h, True)
        return v + [grouped_gemm_variant(i, h, epilogue="swiglu_bwd", b_major="n", topk=topk, persistent=self.persistent,
                                         pingpong=swiglu_backward_pingpong(self.persistent, tile_n), activation=self.activation, **self._bias)]

    def _weight_grad_variants(self, h: int, i: int, wgrad_format: str) -> list[KernelVariant]:
        """dW_down [E, H, I] and [dW_gate; dW_up] [E, 2I, H] (one launch), fresh bf16, and with
        fuse_wgrad_accumulation added into fp32 buffers (also a half of dh alone: the split-out
        fallback where the two buffers lie too far apart for one TMA descriptor), on ``wgrad_format``'s
        operands (MoKConfig.weight_grad_format), with their quantizers."""
        persistent, operand, v, fp8 = self.persistent, "bf16", [], wgrad_format == "fp8_block"
        if wgrad_format == "mxfp8":
            operand = "bf16" if self.emulate else "e4m3"
            v = [quantize_mxfp8_variant(bounded=True, mma_order=True, columns=True)]
            dh_halves = mxfp8_column_shape(2 * i, segments=2)  # (dh's halves chunked apart where 128 does not divide I)
            if dh_halves:
                v.append(quantize_mxfp8_variant(bounded=True, mma_order=True, columns=True, **dh_halves))
            if self.emulate:
                v.append(quantize_mxfp8_variant(back=True))
        if fp8:  # the four rows' transposes (quantizers of (width, rows gathered from the tokens)): FP8 WGMMAs, or SM100's MXFP8 kernel
            mma, pow2 = self.fp8_on_block_scaled_mma, self.config.fp8_power_of_two
            operand = "e4m3" if mma else "e4m3_block"
            columns = [(i, False, 1), (2 * i, False, 2 if mma else 1)]  # s·a's and dh's (SM100: its halves each starting a chunk)
            if self.ep or self.config.expert_bias:  # dout's rows as they are (the biases' sums read them), at EP x's pulled ones
                columns.append((h, False, 1))
            if not self.ep:  # x's, and dout's, rows gathered from the tokens as they are quantized
                columns.append((h, True, 1))
            v = [quantize_fp8_block_variant(width, power_of_two=pow2, bounded=True, columns=True, gathered=gathered, mma_scales=mma,
                                            segments=segments) for width, gathered, segments in columns]
        kinds = [("bf16", False)] + ([("f32", True)] if self.config.fuse_wgrad_accumulation else [])
        for out, accumulate in kinds:
            v += [
                weight_grad_variant(h, i, out, accumulate, persistent=persistent, operand=operand),
                weight_grad_variant(2 * i, h, out, accumulate, split_out=True, persistent=persistent, operand=operand),
            ]
            if accumulate:
                half_stride = None if operand == "e4m3_block" else 2 * i  # (Hopper's FP8: the half of dh's transpose, packed)
                v.append(weight_grad_variant(i, h, out, accumulate, a_stride=half_stride, persistent=persistent, operand=operand))
        return v


ROUTER_LOGITS_TILE_N = 128  # the router logits' column tile: a narrow output (E columns) gets twice the CTAs of 256-wide tiles
EXPERT_TILE = 128  # the router's experts are padded to a multiple of the GEMMs' column tile


def padded_experts(num_experts: int) -> int:
    """E rounded up to the GEMMs' column tile (the router logits' width inside its GEMM)."""
    return -(-num_experts // EXPERT_TILE) * EXPERT_TILE


def router_variants(hidden: int, num_experts: int, persistent: bool = True) -> list[KernelVariant]:
    """The built-in router's GEMMs (mok/router.py), experts padded to a multiple of 128: the
    logits, their dx (B read [K, N]) and the router weight's gradient (bf16)."""
    experts = padded_experts(num_experts)
    return [
        grouped_gemm_variant(experts, hidden, tile_n=ROUTER_LOGITS_TILE_N, persistent=persistent),
        grouped_gemm_variant(hidden, experts, b_major="n", persistent=persistent),
        weight_grad_variant(experts, hidden, "bf16", False, a_stride=experts, persistent=persistent),
    ]


@functools.cache
def plan_for(config: MoKConfig, arch: str) -> Plan:
    """The plan of ``config`` on ``arch``; raises (naming what to pass instead) where that layer does
    not run: widths the scale blocks do not tile, MXFP8 GEMMs without block-scaled MMAs, FP8 block
    scales that SM100's block-scaled MMAs cannot take (fp32, partial tiles)."""
    if not isinstance(config, MoKConfig):
        raise TypeError(f"config: expected a MoKConfig, got {type(config).__name__}")
    arch = normalize_arch(arch)
    check_tiled_widths("config", config.widths, width_rule(config))
    if config.precision == "mxfp8":
        require_mxfp8_gemms("precision='mxfp8'", arch)
    why = refusal(config, arch)
    if why is not None:
        raise NotImplementedError(why)
    return Plan(config, arch)


def plan_for_device(config: MoKConfig, device) -> Plan:
    """The plan of ``config`` on a CUDA device's target, where MoK's fused layer runs there and the
    device is the current one (mok.runtime.arch.check_fused_layer_device says why not)."""
    return plan_for(config, check_fused_layer_device(device.index))
