"""Grouped GEMM alone at the layer's shapes: MoK's kernels (column tile, persistent or not) vs torch._grouped_mm vs dense.

    python perf/gemm_sweep.py                  # every shape, then the gathered fc1
    python perf/gemm_sweep.py --gathered-fc1   # fc1 gathering its rows against gather + fc1 only
    python perf/gemm_sweep.py --scattered-fc2  # fc2 writing its rows into the slots against fc2 into rows
    python perf/gemm_sweep.py --counted-wgrad  # weight gradients stopping at each expert's last row block
    python perf/gemm_sweep.py --weight-grads   # the weight-gradient GEMM only (tiles 128 and 256 wide, ping-pong)
    python perf/gemm_sweep.py --fp8-block      # FP8 with 128-block scales (DeepSeek-V3's recipe) against bf16, same run
                                               # (plain shapes: also with one set of block accumulators, "x1");
                                               # then fc1 gathering FP8 rows against gathering bf16 rows first
                                               # and the SwiGLU-backward GEMM on FP8 (one or two block sets)
    python perf/gemm_sweep.py --gathered-fp8-fc1  # the gathered fc1 part only
    python perf/gemm_sweep.py --fp8-swiglu-bwd    # the SwiGLU-backward part only (one or two block sets, deep turns)
    python perf/gemm_sweep.py --fp8-dense         # the FP8 grouped GEMMs against dense torch._scaled_mm (cuBLAS) of the same FLOPs
    python perf/gemm_sweep.py --fp8-schedules     # the FP8 GEMMs' schedules: one or two block sets, deep turns (bits and ms)
    python perf/gemm_sweep.py --fp8-row-quantizers  # the FP8 rows' quantizer: gathering, gathering with the bf16 copy, rows
    python perf/gemm_sweep.py --fp8-activation-out  # the FP8 gate/up GEMM's activation: bf16 then quantized, or FP8 from its
                                                    # epilogue (bits compared; with --ncu: untimed, for Nsight Compute)
    python perf/gemm_sweep.py --fp8-ncu           # dsv3's FP8 fc2 and fc1, bf16's fc2, FP8 fc1's FLOPs on the plain kernel,
                                                  # cuBLAS's recipe kernel on its rows, twice each, untimed (ncu)
    python perf/gemm_sweep.py --fp8-weight-grads  # dW_gate + dW_up on FP8 transposes against bf16 (and with the quantizers)
    python perf/gemm_sweep.py --fp8-wgrad-ncu [qwen3-235b]  # dsv3's (or qwen3-235b's) dW_gate + dW_up on FP8, then bf16, twice each, untimed (ncu)
    python perf/gemm_sweep.py --fp8-wgrad-stages  # the FP8 dW_gate + dW_up with one or two stages issued before the previous tile's epilogue
    python perf/gemm_sweep.py --fp8-yield-hints   # the FP8 gate/up (a in E4M3, h), down, SwiGLU-backward and dW_gate + dW_up GEMMs
                                                  # with the promotions' FFMAs allowed to yield: none, half, all (variants.PROMOTIONS_YIELD)
    python perf/gemm_sweep.py --fp8-issue-order   # those GEMMs with the MMA warpgroups' WGMMAs issued in the free order
                                                  # and in a fixed one (variants.ISSUE_ORDER)
    python perf/gemm_sweep.py --fp8-wgrad-issue-order  # the same for the FP8 dW_gate + dW_up alone (two kernels to build)
    python perf/gemm_sweep.py --fp8-tile-ingress  # the plain FP8 kernel 64 and 128 wide, bf16's 128 and 256, cuBLAS's FP8 recipe:
                                                  # ms and the rate the tiles' operand bytes enter the SMs
    python perf/gemm_sweep.py --fp8-wgrad-rows    # dW_gate + dW_up at dsv3's widths against rows an expert, bf16 / FP8, fresh / main_grad
    python perf/gemm_sweep.py --tail-split        # bf16's down (also its EP scatter form) and dx GEMMs with the walk's last round in half tiles or whole
    python perf/gemm_sweep.py --bounded-walk      # the layer's bf16 gate/up, down and SwiGLU-backward GEMMs, walks free or bounded
    python perf/gemm_sweep.py --row-tile-pairs    # the layer's bf16 GEMMs (fc1 gathering, fc2, dx) with cluster_m 1 and 2
                                                  # (pairs of row tiles sharing B by TMA multicast), interleaved
    python perf/gemm_sweep.py --fp8-row-tile-pairs  # the FP8 forward GEMMs (fp8_block) with cluster_m 1 and 2, interleaved
    python perf/gemm_sweep.py --fp8-forward-levers  # the fp8_block forward at dsv3 and qwen3-235b: its gate/up GEMM's turns and pairs, x's
                                                    # FP8 rows gathered, each off: kernels (profiler) and ms, interleaved

Rows: E experts x rows_per_expert (whole 128-row tiles), as the schedule lays them out.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from mok import ops
from mok.bench import time_ms, time_ms_interleaved

SHAPES = {  # name: (E, rows per expert, N, K, swiglu)
    "dsv3 fc1": (32, 1024, 2048, 7168, True),
    "dsv3 fc2": (32, 1024, 7168, 2048, False),
    "qwen3 fc1": (64, 1024, 768, 2048, True),
    "qwen3 fc2": (64, 1024, 2048, 768, False),
}


def uniform_schedule(T: int, E: int, k: int):
    """The schedule of T tokens routed uniformly to k of E experts (a random top-k)."""
    return ops.device_schedule(torch.rand(T, E, device="cuda").topk(k, dim=1).indices.int(), E)


def shape_operands(E, per, N, K, swiglu):
    """A shape's rows (E x per, whole tiles), weights (B2 for SwiGLU), tile experts and FLOPs."""
    R = E * per
    a = torch.randn(R, K, device="cuda").bfloat16()
    b = (torch.randn(E, N, K, device="cuda") * K**-0.5).bfloat16()
    b2 = (torch.randn(E, N, K, device="cuda") * K**-0.5).bfloat16() if swiglu else None
    tiles = torch.arange(R // 128, device="cuda", dtype=torch.int32) // (per // 128)
    return R, a, b, b2, tiles, 2 * R * N * K * (2 if swiglu else 1)


def fp8_shape_operands(E, per, N, K, swiglu):
    """:func:`shape_operands`, and its rows and weights quantized by mok.fp8_block's rule (A, B, B2 or None)."""
    from mok import fp8_block as fp8

    operands = shape_operands(E, per, N, K, swiglu)
    _, a, b, b2, _, _ = operands
    return operands, (fp8.quantize_rows(a), fp8.quantize_weights(b), fp8.quantize_weights(b2) if swiglu else None)


def main() -> None:
    print(f"# {torch.cuda.get_device_name()}")
    print(f"{'shape':<11}{'kernel':<22}{'ms':>8}{'TFLOP/s':>9}")
    for name, (E, per, N, K, swiglu) in SHAPES.items():
        R, a, b, b2, tiles, flops = shape_operands(E, per, N, K, swiglu)
        runs = {}
        for tile_n in (128,) if swiglu else (128, 256):
            for persistent in (False, True):
                if N % tile_n == 0:
                    runs[f"mok n{tile_n}{' persist' if persistent else ''}"] = (
                        lambda t=tile_n, p=persistent: ops.grouped_gemm(a, b, tiles, b2=b2, tile_n=t, persistent=p)
                    )
        offs = torch.full((E,), per, device="cuda", dtype=torch.int32).cumsum(0).int()
        bt = b.transpose(1, 2)
        runs["torch._grouped_mm"] = lambda: [torch._grouped_mm(a, bt, offs=offs) for _ in range(2 if swiglu else 1)]
        dense_b = torch.randn(K, N * (2 if swiglu else 1), device="cuda").bfloat16()
        runs["dense mm"] = lambda: a @ dense_b
        for kname, fn in runs.items():
            ms = time_ms(fn, batch=10, repeats=5)
            print(f"{name:<11}{kname:<22}{ms:>8.3f}{flops / ms / 1e9:>9.0f}")


WEIGHT_GRAD_SHAPES = {  # name: (E, rows per expert, M, N): out[e] = A[rows of e]ᵀ·B[rows of e], [M, N]
    "dsv3 dW_down": (32, 1024, 7168, 2048),
    "dsv3 dW_gate": (32, 1024, 2048, 7168),
    "qwen3 dW_down": (64, 1024, 2048, 768),
    "qwen3 dW_gate": (64, 1024, 768, 2048),
    "e128 dW_down": (128, 384, 7168, 2048),  # one dsv3 EP = 2 rank: 128 experts of 2-3 row tiles
    "e128 dW_gate": (128, 384, 2048, 7168),
}


def weight_grads() -> None:
    """The K-grouped weight-gradient GEMM, one tile per CTA against persistent, and a dense GEMM of the same FLOPs."""
    
    for name, (E, per, M, N) in WEIGHT_GRAD_SHAPES.items():
        R = E * per
        a = torch.randn(R, M, device="cuda").bfloat16()
        b = torch.randn(R, N, device="cuda").bfloat16()
        offsets = torch.arange(E + 1, device="cuda", dtype=torch.int32) * per
        out = torch.empty(E, M, N, device="cuda").bfloat16()
        flops = 2 * R * M * N
        runs = {
            "mok weight_grad": lambda: ops.weight_grad(a, b, offsets, out=out, persistent=False),
            "mok weight_grad persist": lambda: ops.weight_grad(a, b, offsets, out=out, pingpong=False),
            "mok persist n256": lambda: ops.weight_grad(a, b, offsets, out=out, tile_n=256),
            "mok ping-pong": lambda: ops.weight_grad(a, b, offsets, out=out),  # (the default)
            "dense mm": lambda: a[:per * 8].T @ b[:per * 8],  # (8 experts' rows: FLOPs scaled below)
        }
        for kname, fn in runs.items():
            ms = time_ms(fn, batch=10, repeats=5)
            scale = 8 * per / R if kname == "dense mm" else 1.0
            print(f"{name:<14}{kname:<25}{ms:>8.3f}{flops * scale / ms / 1e9:>9.0f}")


def gathered_fc1() -> None:
    """fc1 with its A rows gathered by the GEMM's producer against the gather kernel + fc1, on a real schedule."""
    for name, (T, H, I, E, k) in {"dsv3 fc1": (4096, 7168, 2048, 32, 8), "qwen3 fc1": (8192, 2048, 768, 64, 8)}.items():
        x = torch.randn(T, H, device="cuda").bfloat16()
        sched = uniform_schedule(T, E, k)
        wg, wu = ((torch.randn(E, I, H, device="cuda") * H**-0.5).bfloat16() for _ in range(2))
        x_rows = ops.gather_rows(x, sched.row_token)
        out = torch.empty(x_rows.shape[0], I, device="cuda").bfloat16()
        runs = {
            "gather + fc1": lambda: ops.grouped_gemm(ops.gather_rows(x, sched.row_token, out=x_rows), wg, sched.tile_expert, b2=wu, out=out),
            "fc1 on x_rows": lambda: ops.grouped_gemm(x_rows, wg, sched.tile_expert, b2=wu, out=out),
            "fc1 gathering A": lambda: ops.grouped_gemm(x, wg, sched.tile_expert, b2=wu, out=out, gather=sched.row_token),
        }
        for kname, fn in runs.items():
            print(f"{name:<11}{kname:<24}{time_ms(fn, batch=10, repeats=5):>8.3f}")


def scattered_fc2() -> None:
    """The down projection writing each row into its (token, slot) slot (the EP push inside the GEMM)
    against the same GEMM into y_rows, on a real schedule, one rank (local slots)."""
    for name, (T, H, I, E, k) in {"dsv3 fc2": (4096, 7168, 2048, 32, 8), "qwen3 fc2": (8192, 2048, 768, 64, 8)}.items():
        sched = uniform_schedule(T, E, k)
        a = torch.randn(sched.capacity, I, device="cuda").bfloat16()
        wd = (torch.randn(E, H, I, device="cuda") * I**-0.5).bfloat16()
        y_rows = torch.empty(sched.capacity, H, device="cuda").bfloat16()
        slots = torch.empty(T, k, H, device="cuda").bfloat16()
        rows = torch.arange(sched.capacity, device="cuda", dtype=torch.int32)  # (row r -> y_rows[r]: the stores alone)
        zeros = torch.zeros_like(rows)
        runs = {
            "fc2 -> y_rows": lambda: ops.grouped_gemm(a, wd, sched.tile_expert, out=y_rows),
            "fc2 scattering": lambda: ops.grouped_gemm_scatter(a, wd, sched.tile_expert, sched.row_token, sched.row_slot, slots),
            "fc2 scattering in order": lambda: ops.grouped_gemm_scatter(a, wd, sched.tile_expert, rows, zeros, y_rows.view(-1, 1, H)),
        }
        for kname, fn in runs.items():
            print(f"{name:<11}{kname:<24}{time_ms(fn, batch=10, repeats=5):>8.3f}")


def counted_weight_grads() -> None:
    """The weight gradients on real uniform schedules (zero padding rows), reducing every padded
    row against stopping at each expert's last 64-row block (``counts``), as the backward calls them."""
    for name, (T, H, I, E, k) in {"dsv3 E128": (4096, 7168, 2048, 128, 8), "qwen3 E128": (8192, 2048, 768, 128, 8)}.items():
        sched = uniform_schedule(T, E, k)
        token, used = sched.row_token, int(sched.expert_offsets[-1])
        blocks = int(((sched.expert_offsets[1:] - sched.expert_offsets[:-1]) // 64).sum())
        kept = int(((sched.expert_counts + 63) // 64).sum())
        print(f"{name:<11}padding {1 - T * k / used:.1%} of {used} rows; {1 - kept / blocks:.1%} of 64-row blocks skipped")
        x_rows = ops.gather_rows(torch.randn(T, H, device="cuda").bfloat16(), token)
        dh = ops.gather_rows(torch.randn(T, 2 * I, device="cuda").bfloat16(), token)
        offsets, counts = sched.expert_offsets, sched.expert_counts
        out = torch.empty(E, I, H, device="cuda").bfloat16()
        runs = {
            "dW_gate": lambda: ops.weight_grad(dh[:, :I], x_rows, offsets, out=out),
            "dW_gate counted": lambda: ops.weight_grad(dh[:, :I], x_rows, offsets, counts=counts, out=out),
        }
        for kname, fn in runs.items():
            print(f"{name:<11}{kname:<24}{time_ms(fn, batch=10, repeats=5):>8.3f}")


def fp8_block() -> None:
    """The forward's expert GEMMs on FP8 operands with 128-block scales (mok.fp8_block, the Hopper
    kernel of mok/kernels/sm90/block_scaled.py) against MoK's bf16 kernel on the same values, and the
    FP8 result's relative difference from the float64 product of its own (dequantized) operands."""
    from mok import fp8_block as fp8

    print(f"# {torch.cuda.get_device_name()}: FP8 block-scaled vs bf16 grouped GEMMs")
    print(f"{'shape':<11}{'kernel':<22}{'ms':>8}{'TFLOP/s':>9}{'vs bf16':>9}")
    for name, (E, per, N, K, swiglu) in SHAPES.items():
        (R, a, b, b2, tiles, flops), (a_q, b_q, b2_q) = fp8_shape_operands(E, per, N, K, swiglu)
        runs = {"mok bf16": lambda: ops.grouped_gemm(a, b, tiles, b2=b2), "mok fp8 block": lambda: ops.grouped_gemm(a_q, b_q, tiles, b2=b2_q)}
        if not swiglu:  # (two sets of block accumulators, the plain form's default, against one)
            runs["mok fp8 block x1"] = lambda: ops.grouped_gemm(a_q, b_q, tiles, block_buffers=1)
        ms = time_ms_interleaved(runs, batch=10, repeats=5)
        for kname, t in ms.items():
            print(f"{name:<11}{kname:<22}{t:>8.3f}{flops / t / 1e9:>9.0f}{ms['mok bf16'] / t:>8.2f}x")
        if not swiglu:
            rows = slice(0, 4 * 128)  # (a few tiles: the float64 reference is slow)
            want = fp8.block_scaled_gemm_reference((a_q[0][rows], a_q[1][:, rows]), b_q, tiles.repeat_interleave(128)[rows])
            got = runs["mok fp8 block"]()[rows].double()
            print(f"{name:<11}fp8 vs float64 of its operands: relative difference {float((got - want).norm() / want.norm()):.2e}")


FP8_DENSE_SHAPES = {  # name: (E, rows per expert, N, K, swiglu): the layer's expert GEMMs at T = 4096, top-8, uniform
    "dsv3 fc1": (32, 1024, 2048, 7168, True), "dsv3 fc2": (32, 1024, 7168, 2048, False),
    "dsv3 fc1 plain": (32, 1024, 4096, 7168, False),  # (fc1's FLOPs and K on the plain kernel: SwiGLU's stacking apart from K's length)
    "qwen3-235b fc1": (128, 256, 1536, 4096, True), "qwen3-235b fc2": (128, 256, 4096, 1536, False),
}


def dense_fp8_recipe(a_q: tuple, width: int) -> tuple:
    """One dense [R, K] x [K, width] GEMM through torch._scaled_mm (cuBLAS) on ``a_q``'s E4M3 rows
    with the recipe's scale layouts (A per 1 x 128, B per 128 x 128; unit scales), B random: a
    callable, and the dense B (for the other dense forms)."""
    R, K = a_q[0].shape
    dense_b = (torch.randn(width, K, device="cuda") * K**-0.5).to(torch.float8_e4m3fn)
    block_a = torch.ones(K // 128, R, device="cuda").t()  # (R, K / 128), column-major: cuBLAS's 1 x 128 layout
    block_b = torch.ones(width // 128, K // 128, device="cuda").t()  # (K / 128, N / 128): 128 x 128
    return (lambda: torch._scaled_mm(a_q[0], dense_b.t(), block_a, block_b, out_dtype=torch.bfloat16)), dense_b


def fp8_dense() -> None:
    """MoK's FP8 grouped GEMMs (128-block scales; SwiGLU's gate and up as one) against one dense GEMM
    of the same FLOPs through torch._scaled_mm (cuBLAS): the same recipe (A per 1 x 128, B per
    128 x 128, scales fp32), and per-row x per-column scales (no promotion in the mainloop); bf16
    mm beside. A ceiling, not a peer: one matrix, no expert boundaries, no gather."""
    print(f"# {torch.cuda.get_device_name()}: FP8 grouped GEMMs against dense torch._scaled_mm of the same FLOPs")
    print(f"{'shape':<16}{'kernel':<28}{'ms':>8}{'TFLOP/s':>9}")
    for name, (E, per, N, K, swiglu) in FP8_DENSE_SHAPES.items():
        (R, a, b, b2, tiles, flops), (a_q, b_q, b2_q) = fp8_shape_operands(E, per, N, K, swiglu)
        width = N * (2 if swiglu else 1)  # (the dense B: every output column of the grouped GEMM, for one matrix of R rows)
        recipe, dense_b = dense_fp8_recipe(a_q, width)
        runs = {
            "mok fp8 block (grouped)": lambda: ops.grouped_gemm(a_q, b_q, tiles, b2=b2_q),
            "scaled_mm 1x128 / 128x128": recipe,
            "scaled_mm rowwise": lambda: torch._scaled_mm(a_q[0], dense_b.t(), torch.ones(R, 1, device="cuda"),
                                                          torch.ones(1, width, device="cuda"), out_dtype=torch.bfloat16),
            "bf16 mm": lambda: a @ dense_b.bfloat16().t(),
        }
        ms = time_ms_interleaved(runs, batch=10, repeats=5)
        for kname, t in ms.items():
            print(f"{name:<16}{kname:<28}{t:>8.3f}{flops / t / 1e9:>9.0f}")


def fp8_weight_grad_inputs(T: int, H: int, I: int, E: int, k: int) -> SimpleNamespace:
    """dW_gate + dW_up's operands both ways on a real uniform schedule of T tokens, top-k of E
    experts: the schedule, x [T, H], dh [rows, 2I] (padding rows zero) and x's gathered bf16 rows;
    the FP8 transposes of dh and x (ops.quantize_fp8_columns, x's rows gathered as they are
    quantized), the rows in use."""
    sched = uniform_schedule(T, E, k)
    x = torch.randn(T, H, device="cuda").bfloat16()
    dh = torch.randn(sched.capacity, 2 * I, device="cuda").bfloat16().masked_fill((sched.row_token < 0)[:, None], 0)
    used = sched.expert_offsets[-1:]
    return SimpleNamespace(sched=sched, x=x, dh=dh, x_rows=ops.gather_rows(x, sched.row_token), used=used,
                           dh_q=ops.quantize_fp8_columns(dh, rows_used=used),
                           x_q=ops.quantize_fp8_columns(x, rows_used=used, row_source=sched.row_token))


def fp8_weight_grads() -> None:
    """The weight gradients on FP8 with 1 x 128 blocks along the rows (the rows' transposes,
    ops.quantize_fp8_columns, then ops.weight_grad on them) against bf16's weight-gradient GEMM on
    the same rows, on a real uniform schedule (padding rows zero): the GEMM alone, the GEMM with its
    two transposing quantizers (x's rows gathered from x as they are quantized), and the FP8
    result's relative difference from bf16's."""
    shapes = {"dsv3": (4096, 7168, 2048, 32, 8), "qwen3": (8192, 2048, 768, 64, 8)}
    for name, (T, H, I, E, k) in shapes.items():
        v = fp8_weight_grad_inputs(T, H, I, E, k)
        rows = dict(offsets=v.sched.expert_offsets, counts=v.sched.expert_counts, split_out=True)
        runs = {
            "bf16 dW_gate+up": lambda: ops.weight_grad(v.dh, v.x_rows, **rows),
            "fp8 dW_gate+up": lambda: ops.weight_grad(v.dh_q, v.x_q, **rows),
            "fp8 quantize + dW": lambda: ops.weight_grad(ops.quantize_fp8_columns(v.dh, rows_used=v.used),
                                                        ops.quantize_fp8_columns(v.x, rows_used=v.used, row_source=v.sched.row_token),
                                                        **rows),
        }
        ms = time_ms_interleaved(runs, batch=10, repeats=5)
        flops = 2 * T * k * 2 * I * H
        for kname, t in ms.items():
            print(f"{name:<7}{kname:<22}{t:>8.3f}{flops / t / 1e9:>9.0f}{ms['bf16 dW_gate+up'] / t:>8.2f}x")
        want = torch.cat(runs["bf16 dW_gate+up"](), 1).float()
        got = torch.cat(runs["fp8 dW_gate+up"](), 1).float()
        print(f"{name:<7}fp8 vs bf16 weight gradients: relative difference {float((got - want).norm() / want.norm()):.2e}")


def fp8_weight_grad_rows() -> None:
    """dW_gate + dW_up at dsv3's widths (H 7168, I 2048, 32 experts, top-8) for T 512-8192 tokens
    (rows an expert ~T/4): bf16's ping-pong kernel and FP8's, each into fresh bf16 (FP8 also into
    fp32) and added into fp32 main_grad tensors, interleaved, ms (TFLOP/s): how their time splits
    between the rows reduced and the gradient written."""
    H, I, E, k = 7168, 2048, 32, 8
    print(f"# {torch.cuda.get_device_name()}: dW_gate + dW_up at dsv3's widths, ms (TFLOP/s)")
    for T in (512, 1024, 2048, 4096, 8192):
        v = fp8_weight_grad_inputs(T, H, I, E, k)
        rows = dict(offsets=v.sched.expert_offsets, counts=v.sched.expert_counts, split_out=True)
        main = (torch.zeros(E, I, H, device="cuda"), torch.zeros(E, I, H, device="cuda"))
        runs = {
            "bf16": lambda: ops.weight_grad(v.dh, v.x_rows, **rows),
            "fp8": lambda: ops.weight_grad(v.dh_q, v.x_q, **rows),
            "fp8 f32": lambda: ops.weight_grad(v.dh_q, v.x_q, **rows, out_dtype=torch.float32),
            "bf16 main_grad": lambda: ops.weight_grad(v.dh, v.x_rows, **rows, out=main, accumulate=True),
            "fp8 main_grad": lambda: ops.weight_grad(v.dh_q, v.x_q, **rows, out=main, accumulate=True),
        }
        ms = time_ms_interleaved(runs, batch=5, repeats=5)
        used = int(v.used.item())
        flops = 2 * 2 * I * H * used
        print(f"T {T:>5} rows an expert {used // E:>5}  " + "  ".join(f"{n} {t:.3f} ({flops / t / 1e9:.0f})" for n, t in ms.items()))


def fp8_for_ncu() -> None:
    """dsv3's fc2 (plain) and fc1 (SwiGLU) on FP8 with block scales, then bf16's fc2, then fc1's
    FLOPs and K on the plain FP8 kernel (N 4096: the stacked SwiGLU form's mainloop without its
    stacking), each called twice (the first compiles), for Nsight Compute to profile the second
    calls (tools/sass_stalls.py says how), then cuBLAS's kernel for the recipe on the same rows
    twice (``-k regex:nvjet --launch-skip 1``): nothing timed."""
    from mok import fp8_block as fp8

    for name in ("dsv3 fc2", "dsv3 fc1"):
        R, a, b, b2, tiles, _ = shape_operands(*SHAPES[name])
        a_q, b_q = fp8.quantize_rows(a), fp8.quantize_weights(b)
        b2_q = fp8.quantize_weights(b2) if b2 is not None else None
        for _ in range(2):
            ops.grouped_gemm(a_q, b_q, tiles, b2=b2_q)
    R, a, b, _, tiles, _ = shape_operands(*SHAPES["dsv3 fc2"])
    for _ in range(2):
        ops.grouped_gemm(a, b, tiles)
    (_, _, _, _, tiles, _), (a_q, b_q, _) = fp8_shape_operands(*FP8_DENSE_SHAPES["dsv3 fc1 plain"])
    for _ in range(2):
        ops.grouped_gemm(a_q, b_q, tiles)
    recipe, _ = dense_fp8_recipe(a_q, b_q[0].shape[1])
    for _ in range(2):
        recipe()
    torch.cuda.synchronize()


FP8_SCHEDULES = {"plain": ((1, 0), (2, 0), (2, 4), (2, 8)), "swiglu": ((1, 0), (2, 0), (2, 4), (2, 8))}  # (block sets, deep turn)
FP8_WGRAD_TURNS = (0, 4, 8)
FP8_WGRAD_SHAPES = {"dsv3": (4096, 7168, 2048, 32, 8), "qwen3": (8192, 2048, 768, 64, 8)}  # (T, H, I, E, top-k)


def _compile_one(spec: tuple) -> None:
    from mok.kernels import get_kernel
    from mok.kernels.variants import grouped_gemm_variant, weight_grad_variant

    kind, options = spec
    get_kernel((grouped_gemm_variant if kind == "grouped" else weight_grad_variant)(**options), "sm_90a")


def compile_in_parallel(specs: list, jobs: int = 12) -> None:
    """Compile kernels into the disk cache from ``jobs`` processes first (``specs``: ("grouped" or
    "wgrad", the variant's options)), so that a sweep of many variants spends its device time timing."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_compile_one, specs))


def fp8_schedules() -> None:
    """The FP8 block-scaled GEMMs' schedules (mok/kernels/sm90/block_scaled.py) at the forward's
    shapes: one or two sets of block accumulators, and two stages in flight for turns of d stages
    ("x2 dN"), against MoK's bf16 kernel, interleaved; each schedule's bits against one set's.
    Then the FP8 weight gradient (dW_gate + dW_up) with and without deep turns."""
    specs = []
    for E, per, N, K, swiglu in SHAPES.values():
        epilogue = "swiglu" if swiglu else "plain"
        specs.append(("grouped", dict(n=N, k=K, epilogue=epilogue)))
        specs += [("grouped", dict(n=N, k=K, epilogue=epilogue, operand="e4m3_block", block_buffers=sets, deep_turn=turn))
                  for sets, turn in FP8_SCHEDULES[epilogue]]
    for T, H, I, E, k in FP8_WGRAD_SHAPES.values():
        specs += [("wgrad", dict(m=2 * I, n=H, operand="e4m3_block", pingpong=False, split_out=True, deep_turn=turn)) for turn in FP8_WGRAD_TURNS]
    compile_in_parallel(specs)
    print(f"# {torch.cuda.get_device_name()}: FP8 schedules, ms (TFLOP/s, vs bf16)")
    for name, (E, per, N, K, swiglu) in SHAPES.items():
        (R, a, b, b2, tiles, flops), (a_q, b_q, b2_q) = fp8_shape_operands(E, per, N, K, swiglu)
        runs = {"bf16": lambda: ops.grouped_gemm(a, b, tiles, b2=b2)}
        for sets, turn in FP8_SCHEDULES["swiglu" if swiglu else "plain"]:
            runs[f"x{sets}" + (f" d{turn}" if turn else "")] = (
                lambda sets=sets, turn=turn: ops.grouped_gemm(a_q, b_q, tiles, b2=b2_q, block_buffers=sets, deep_turn=turn))
        outs = {kname: run() for kname, run in runs.items() if kname != "bf16"}
        same = all(torch.equal(out, outs["x1"]) for out in outs.values())
        ms = time_ms_interleaved(runs, batch=10, repeats=5)
        print(f"{name:<10} bits equal {same}  " + "  ".join(f"{kname} {t:.3f} ({flops / t / 1e9:.0f}, {ms['bf16'] / t:.2f}x)"
                                                          for kname, t in ms.items()))
    for name, shape in FP8_WGRAD_SHAPES.items():
        v = fp8_weight_grad_inputs(*shape)
        flops = 2 * 2 * shape[2] * shape[1] * int(v.used.item())
        runs = {f"d{turn}": (lambda turn=turn: ops.weight_grad(v.dh_q, v.x_q, v.sched.expert_offsets, counts=v.sched.expert_counts,
                                                              split_out=True, deep_turn=turn)) for turn in FP8_WGRAD_TURNS}
        outs = [run() for run in runs.values()]
        same = all(torch.equal(p, q) for out in outs[1:] for p, q in zip(outs[0], out))
        ms = time_ms_interleaved(runs, batch=10, repeats=5)
        print(f"wgrad {name:<5} bits equal {same}  " + "  ".join(f"{kname} {t:.3f} ({flops / t / 1e9:.0f})" for kname, t in ms.items()))


def fp8_row_quantizers() -> None:
    """ops.quantize_fp8_rows at the layer's shapes (T = 4096, top-8, a uniform schedule): x's rows
    gathered as they are quantized (the forward's), with their bf16 copy too (the backward's dout
    rows), and rows already gathered (a, dh), ms."""
    print(f"# {torch.cuda.get_device_name()}: the FP8 rows' quantizer, ms")
    for name, (T, H, E) in {"dsv3": (4096, 7168, 32), "qwen3-235b": (4096, 4096, 128)}.items():
        x = torch.randn(T, H, device="cuda").bfloat16()
        sched = uniform_schedule(T, E, 8)
        used = sched.expert_offsets[-1:]
        copy = torch.empty(sched.row_token.shape[0], H, device="cuda", dtype=torch.bfloat16)
        rows = ops.gather_rows(x, sched.row_token)
        runs = {
            "gathered": lambda: ops.quantize_fp8_rows(x, row_source=sched.row_token, rows_used=used),
            "gathered + copy": lambda: ops.quantize_fp8_rows(x, row_source=sched.row_token, rows_used=used, rows_out=copy),
            "rows": lambda: ops.quantize_fp8_rows(rows, rows_used=used),
        }
        print(f"{name:<11}" + "  ".join(f"{kname} {time_ms(fn, batch=10, repeats=5):.3f}" for kname, fn in runs.items()))


def fp8_activation_out() -> None:
    """The FP8 gate/up GEMM with h at dsv3's and qwen3-235b's rows (whole tiles), its activation out
    in bf16 then quantized (ops.quantize_fp8_rows) against out in FP8 from its epilogue
    (out_format="fp8_block"): the two forms' bits compared, then interleaved ms; with ``--ncu`` the
    two forms twice each at each shape, untimed (for Nsight Compute)."""
    import sys

    print(f"# {torch.cuda.get_device_name()}: the FP8 gate/up GEMM's activation, bf16 + quantizer against FP8 out, ms")
    shapes = {"dsv3": (32, 1024, 2048, 7168), "qwen3-235b": (128, 256, 1536, 4096)}
    for name, (E, per, N, K) in shapes.items():
        (R, _, _, _, tiles, _), (a_q, b_q, b2_q) = fp8_shape_operands(E, per, N, K, True)
        h = torch.empty(R, 2 * N, device="cuda", dtype=torch.bfloat16)
        used = torch.tensor([R], device="cuda", dtype=torch.int32)
        runs = {"bf16 + quantizer": lambda: ops.quantize_fp8_rows(ops.grouped_gemm(a_q, b_q, tiles, b2=b2_q, h_out=h), rows_used=used),
                "fp8 out": lambda: ops.grouped_gemm(a_q, b_q, tiles, b2=b2_q, h_out=h, out_format="fp8_block")}
        (q0, s0), (q1, s1) = (run() for run in runs.values())
        same = torch.equal(q0.view(torch.uint8), q1.view(torch.uint8)) and torch.equal(s0, s1)
        if "--ncu" in sys.argv:
            for run in runs.values():
                run(), run()
            torch.cuda.synchronize()
            continue
        ms = time_ms_interleaved(runs, batch=10, repeats=5)
        print(f"{name:<11}bits equal {same}  " + "  ".join(f"{k} {t:.3f}" for k, t in ms.items()))


def setting_compared(knob: str, settings: dict, run, rows=None, repeats: int = 7) -> tuple[bool, dict]:
    """``run`` (a tuple of output tensors, or one) under each of ``settings`` (label: value) of the
    module setting ``mok.kernels.variants.<knob>``, read as each value's kernels are built: whether
    every value gives the first one's bytes (``rows``: of those rows only), and each label's ms,
    interleaved in one process. The setting is restored after."""
    from mok.kernels import variants

    default = getattr(variants, knob)

    def under(value):
        setattr(variants, knob, value)
        out = run()
        return out if isinstance(out, tuple) else (out,)

    def picked(t):
        return (t if rows is None else t[rows]).contiguous().view(torch.uint8)

    try:
        values = list(settings.values())
        first = [picked(t).clone() for t in under(values[0])]
        same = all(torch.equal(x, picked(y)) for value in values[1:] for x, y in zip(first, under(value)))
        ms = time_ms_interleaved({label: lambda value=value: under(value) for label, value in settings.items()}, batch=10, repeats=repeats)
    finally:
        setattr(variants, knob, default)
    return same, ms


def fp8_weight_grad_stages() -> None:
    """The FP8 weight gradient (dW_gate + dW_up on a real uniform schedule) with a tile's first
    stage, or first two, issued before the previous tile's epilogue
    (variants.WEIGHT_GRAD_STAGES_UNDER_EPILOGUE): bits compared, then interleaved ms, at qwen3-235b
    (two or three 128-row blocks a tile) and dsv3 (eight)."""
    shapes = {"qwen3-235b": (4096, 4096, 1536, 128, 8), "dsv3": (4096, 7168, 2048, 32, 8)}
    for name, (T, H, I, E, k) in shapes.items():
        v = fp8_weight_grad_inputs(T, H, I, E, k)
        same, ms = setting_compared("WEIGHT_GRAD_STAGES_UNDER_EPILOGUE", {f"{stages} under": stages for stages in (1, 2)},
                                    lambda v=v: ops.weight_grad(v.dh_q, v.x_q, v.sched.expert_offsets, counts=v.sched.expert_counts,
                                                                split_out=True), repeats=5)
        print(f"{name:<11}bits equal {same}  " + "  ".join(f"{label} {t:.3f}" for label, t in ms.items()))


def fp8_knob_settings(knob: str, settings: dict, weight_grads: bool = True, only: tuple[str, ...] | None = None) -> None:
    """The FP8 gate/up GEMM (a out in E4M3, h saved), the down GEMM (whole tiles), the SwiGLU
    backward and (``weight_grads``) dW_gate + dW_up (a uniform schedule) at dsv3 and qwen3-235b
    (``only``: those of these names), under each of ``settings`` (label: value) of the module
    setting ``mok.kernels.variants.<knob>`` (each value's kernels entries of their own): bits
    compared with the first value's, then all interleaved in one process, ms."""
    shapes = {"dsv3": (32, 1024, 7168, 2048), "qwen3-235b": (128, 256, 4096, 1536)}
    for name, (E, per, H, I) in shapes.items():
        (R, _, _, _, tiles, _), (a_q, b_q, b2_q) = fp8_shape_operands(E, per, I, H, True)
        h = torch.empty(R, 2 * I, device="cuda", dtype=torch.bfloat16)
        (_, _, _, _, tiles2, _), (a2_q, w2_q, _) = fp8_shape_operands(E, per, H, I, False)
        h_bwd = torch.randn(R, 2 * I, device="cuda").bfloat16()  # (the SwiGLU backward: a_q as dout's rows, b_q as W_down's transpose)
        rows = torch.arange(R, device="cuda", dtype=torch.int32)
        router = dict(row_token=rows // 8, row_slot=rows % 8, topk_w=torch.rand(R // 8, 8, device="cuda"))
        kernels = {"gate/up": lambda: (*ops.grouped_gemm(a_q, b_q, tiles, b2=b2_q, h_out=h, out_format="fp8_block"), h),
                   "down": lambda: (ops.grouped_gemm(a2_q, w2_q, tiles2),),
                   "swiglu bwd": lambda: tuple(t for t in ops.swiglu_backward_gemm(a_q, b_q, tiles, h_bwd, **router) if t is not None)}
        if weight_grads:
            v = fp8_weight_grad_inputs(E * per // 8, H, I, E, 8)
            kernels["dW_gate + dW_up"] = lambda: ops.weight_grad(v.dh_q, v.x_q, v.sched.expert_offsets, counts=v.sched.expert_counts,
                                                                 split_out=True)
        for kernel, run in kernels.items():
            if only is None or kernel in only:
                same, ms = setting_compared(knob, settings, run)
                print(f"{name:<11}{kernel:<16}bits equal {same}  " + "  ".join(f"{key} {t:.3f}" for key, t in ms.items()))


def tail_split() -> None:
    """bf16's plain grouped GEMMs with 256-wide tiles, the last round of the persistent walk taken
    in 128-wide halves or whole (variants.TAIL_SPLIT), on a uniform schedule's rows: the down
    projection (and dx, K-split over the transposed gate and up weights, and EP's scatter form of
    the down projection) at shapes of few rounds (mixtral: 8 experts, K = 14336; the scatter form
    there only) and many (dx where its K reaches TAIL_SPLIT_MIN_K). Prints each GEMM's tiles with rows, its rounds on
    this GPU's SMs and the tiles of the last one; bits compared; both interleaved, ms."""
    from mok.kernels import variants
    from mok.ops.common import sm_count

    shapes = {"mixtral": (4096, 4096, 14336, 8, 2), "qwen3-30b": (4096, 2048, 768, 128, 8), "qwen3-235b": (4096, 4096, 1536, 128, 8),
              "dsv3": (4096, 7168, 2048, 32, 8)}
    default = variants.TAIL_SPLIT_MIN_K
    variants.TAIL_SPLIT_MIN_K = 0  # (every K: the default takes half tiles only where K >= TAIL_SPLIT_MIN_K)
    sms = sm_count(torch.device("cuda"))
    try:
        for name, (T, H, I, E, k) in shapes.items():
            sched = uniform_schedule(T, E, k)
            R = sched.row_token.shape[0]
            a = torch.randn(R, I, device="cuda").bfloat16()
            w_down = (torch.randn(E, H, I, device="cuda") * I**-0.5).bfloat16()
            tiles = sched.tile_expert
            whole = int((tiles >= 0).sum()) * (H // 256)
            kernels = {"down": lambda: ops.grouped_gemm(a, w_down, tiles)}
            if 2 * I >= default:  # (dx, where the default splits it: its rounds are the down projection's, its K twice theirs)
                dh = torch.randn(R, 2 * I, device="cuda").bfloat16()
                w_gate, w_up = ((torch.randn(E, I, H, device="cuda") * I**-0.5).bfloat16() for _ in range(2))
                kernels["dx"] = lambda: ops.grouped_gemm(dh, w_gate, tiles, b2=w_up, b_major="n", k_split=True)
            if E <= 8:  # (EP's scatter form: a rank given as many rows)
                slots = torch.empty(T, k, H, device="cuda").bfloat16()

                def scatter():
                    ops.grouped_gemm_scatter(a, w_down, tiles, sched.row_token, sched.row_slot, slots)
                    return slots
                kernels["scatter"] = scatter
            for kernel, run in kernels.items():
                used = tiles.repeat_interleave(128)[:R] >= 0 if kernel != "scatter" else None  # (the scatter form: every slot)
                same, ms = setting_compared("TAIL_SPLIT", {"whole": False, "tail split": True}, run, rows=used)
                print(f"{name:<11}{kernel:<6}tiles {whole} rounds {-(-whole // sms)} last {whole - (-(-whole // sms) - 1) * sms:>3}  "
                      f"bits equal {same}  whole {ms['whole']:.3f}  tail split {ms['tail split']:.3f}  ({ms['whole'] / ms['tail split']:.3f}x)")
    finally:
        variants.TAIL_SPLIT_MIN_K = default


def bounded_walk() -> None:
    """The layer's bf16 grouped GEMMs (the gate/up GEMM gathering its rows and saving h, the down
    projection, the SwiGLU backward) walking the schedule's capacity or bounded at the last row tile
    with rows (variants.BOUNDED_WALK; the tail split's forms, mixtral's down projection here, always
    bounded), on a uniform schedule: prints the row tiles with rows and the capacity's, whether the
    bounded walk's bits equal the free one's, both interleaved, ms (docs/notes/grouped-gemms-vs-quack.md,
    "The walk's bound")."""
    shapes = {"mixtral": (4096, 4096, 14336, 8, 2), "qwen3-30b": (4096, 2048, 768, 128, 8), "qwen3-235b": (4096, 4096, 1536, 128, 8),
              "dsv3": (4096, 7168, 2048, 32, 8)}
    for name, (T, H, I, E, k) in shapes.items():
        sched = uniform_schedule(T, E, k)
        tiles, rows = sched.tile_expert, sched.row_token.shape[0]
        x = torch.randn(T, H, device="cuda").bfloat16()
        wg, wu = ((torch.randn(E, I, H, device="cuda") * H**-0.5).bfloat16() for _ in range(2))
        wd = (torch.randn(E, H, I, device="cuda") * I**-0.5).bfloat16()
        a, h = torch.randn(rows, I, device="cuda").bfloat16(), torch.empty(rows, 2 * I, device="cuda").bfloat16()
        dout_rows, h_bwd = torch.randn(rows, H, device="cuda").bfloat16(), torch.randn(rows, 2 * I, device="cuda").bfloat16()
        router = dict(row_token=sched.row_token, row_slot=torch.arange(rows, device="cuda", dtype=torch.int32) % k,
                      topk_w=torch.rand(T, k, device="cuda"))
        kernels = {
            "gate/up": lambda: (ops.grouped_gemm(x, wg, tiles, b2=wu, h_out=h, gather=sched.row_token), h),
            "down": lambda: (ops.grouped_gemm(a, wd, tiles),),
            "swiglu bwd": lambda: tuple(t for t in ops.swiglu_backward_gemm(dout_rows, wd, tiles, h_bwd, **router) if t is not None),
        }
        with_rows = int((tiles >= 0).sum())
        used = tiles.repeat_interleave(128)[:rows] >= 0
        for kernel, run in kernels.items():
            same, ms = setting_compared("BOUNDED_WALK", {"free": False, "bounded": True}, run, rows=used)
            print(f"{name:<11}{kernel:<11}row tiles {with_rows} of {tiles.shape[0]}  bits equal {same}  "
                  f"free {ms['free']:.3f}  bounded {ms['bounded']:.3f}  ({ms['free'] / ms['bounded']:.3f}x)", flush=True)


def fp8_tile_ingress() -> None:
    """Whether the FP8 GEMMs are bound by the bytes each SM takes in from L2 a stage: the plain
    FP8 kernel (two block sets, its default schedule) on dsv3's fc1 rows (32 experts x 1024, N
    4096, K 7168: cuBLAS's dense recipe kernel beside, the same FLOPs) with 64- and 128-wide tiles,
    and bf16's kernel with 128- and 256-wide ones, interleaved in one process: ms, TFLOP/s, and
    the rate at which the tiles' operand bytes enter the SMs (every tile loads its A rows and B
    columns over all of K; TB/s summed over the SMs). One bound for all: that rate level across
    the widths while TFLOP/s follows the FLOPs a byte (docs/notes/fp8-block-hopper.md). (The FP8
    kernel 64 wide hands registers over past its launch count, as one that ran did:
    docs/notes/kernel-pitfalls.md; run this under `timeout`.)"""
    E, per, N, K = 32, 1024, 4096, 7168
    (R, a, b, _, tiles, flops), (a_q, b_q, _) = fp8_shape_operands(E, per, N, K, False)
    recipe, _ = dense_fp8_recipe(a_q, N)
    runs, loaded = {}, {}
    for kind, (a_in, b_in), widths, element_bytes in (("fp8", (a_q, b_q), (64, 128), 1), ("bf16", (a, b), (128, 256), 2)):
        for tile_n in widths:
            key = f"{kind} tile 128 x {tile_n}"
            runs[key] = lambda a_in=a_in, b_in=b_in, tile_n=tile_n: ops.grouped_gemm(a_in, b_in, tiles, tile_n=tile_n)
            loaded[key] = (R // 128) * (N // tile_n) * (128 + tile_n) * K * element_bytes
    runs["cublas fp8 recipe (dense)"] = recipe
    ms = time_ms_interleaved(runs, batch=10, repeats=5)
    print(f"# {torch.cuda.get_device_name()}: dsv3 fc1 rows, {E} x {per} rows, N {N}, K {K}")
    print(f"{'kernel':<28}{'ms':>8}{'TFLOP/s':>9}{'FLOP/B':>8}{'into SMs TB/s':>15}")
    for key, t in ms.items():
        into = f"{loaded[key] / t / 1e9:>15.2f}" if key in loaded else ""
        per_byte = f"{flops / loaded[key]:>8.0f}" if key in loaded else f"{'':>8}"
        print(f"{key:<28}{t:>8.3f}{flops / t / 1e9:>9.0f}{per_byte}{into}")


def fp8_yield_hints() -> None:
    """:func:`fp8_knob_settings` over variants.PROMOTIONS_YIELD 0, 0.5 and 1: none, each burst's first
    half or all of the promotions' FFMAs allowed to yield (patched cubins)."""
    fp8_knob_settings("PROMOTIONS_YIELD", {f"yield {share}": share for share in (0.0, 0.5, 1.0)})


def fp8_issue_order() -> None:
    """:func:`fp8_knob_settings` over variants.ISSUE_ORDER: the MMA warpgroups issuing each stage's
    WGMMAs in the free order or in a fixed one (warpgroup 1 after warpgroup 0, as cuBLAS's FP8
    kernel) in every form, the weight gradient's too."""
    from mok.kernels.common.grouped_gemm import EPILOGUES

    fp8_knob_settings("ISSUE_ORDER", {"free": frozenset(), "ordered": frozenset(EPILOGUES) | {"weight_grad"}})


def fp8_weight_grad_issue_order() -> None:
    """:func:`fp8_issue_order` for the FP8 weight gradient alone (dW_gate + dW_up at dsv3 and
    qwen3-235b, the other forms' order as the default has it): two kernels to build, not sixteen."""
    from mok.kernels import variants

    free = variants.ISSUE_ORDER - {"weight_grad"}
    fp8_knob_settings("ISSUE_ORDER", {"free": free, "ordered": free | {"weight_grad"}}, only=("dW_gate + dW_up",))


def fp8_weight_grads_for_ncu() -> None:
    """dsv3's dW_gate + dW_up (qwen3-235b's with ``qwen3-235b`` among the arguments) on FP8
    transposes, then on bf16 rows, each called twice (the first compiles), for Nsight Compute
    (-k regex:weight_grad --launch-skip 1 --launch-count 3): nothing timed."""
    import sys

    v = fp8_weight_grad_inputs(*((4096, 4096, 1536, 128, 8) if "qwen3-235b" in sys.argv else (4096, 7168, 2048, 32, 8)))
    for a, b in ((v.dh_q, v.x_q), (v.dh, v.x_rows)):
        for _ in range(2):
            ops.weight_grad(a, b, v.sched.expert_offsets, counts=v.sched.expert_counts, split_out=True)
    torch.cuda.synchronize()


def fp8_swiglu_backward() -> None:
    """The SwiGLU-backward GEMM (dA = dout·W_downᵀ per expert, the SwiGLU backward and the router
    pieces in its epilogue) on FP8 operands with 128-block scales, one or two block sets (h loaded
    after the mainloop with two), two with deep turns of 4, against MoK's bf16 kernel (ping-pong)
    on the same values, and against the plain FP8 GEMM on the same operands (dA only: the same
    mainloop, so the difference is the SwiGLU epilogue's cost); E experts x rows each (qwen3-235b:
    the 256 rows a uniform router gives its experts); the FP8 schedules' bits compared."""
    from mok import fp8_block as fp8

    shapes = {"dsv3 swiglu bwd": (32, 1024, 2048, 7168, 8), "qwen3 swiglu bwd": (64, 1024, 768, 2048, 8),
              "qwen3-235b swiglu bwd": (128, 256, 1536, 4096, 8)}
    for name, (E, per, I, H, k) in shapes.items():
        R = E * per
        dout = torch.randn(R, H, device="cuda").bfloat16()
        w_down = (torch.randn(E, H, I, device="cuda") * I**-0.5).bfloat16()
        h = torch.randn(R, 2 * I, device="cuda").bfloat16()
        tiles = torch.arange(R // 128, device="cuda", dtype=torch.int32) // (per // 128)
        router = dict(row_token=torch.arange(R, device="cuda", dtype=torch.int32) // k,
                      row_slot=torch.arange(R, device="cuda", dtype=torch.int32) % k, topk_w=torch.rand(R // k, k, device="cuda"))
        dout_q, w_q = fp8.quantize_rows(dout), fp8.quantize_weights(w_down.transpose(1, 2).contiguous())
        runs = {"mok bf16": lambda: ops.swiglu_backward_gemm(dout, w_down, tiles, h, **router)}
        for label, options in {"x1": dict(block_buffers=1), "x2": dict(block_buffers=2, deep_turn=0), "x2 d4": dict(block_buffers=2, deep_turn=4)}.items():
            runs[f"mok fp8 block {label}"] = lambda options=options: ops.swiglu_backward_gemm(dout_q, w_q, tiles, h, **options, **router)
        outputs = {kname: [t.clone() for t in run() if t is not None] for kname, run in runs.items() if "fp8" in kname}
        d_a = torch.empty(R, I, device="cuda").bfloat16()
        runs["fp8 plain, same operands"] = lambda: ops.grouped_gemm(dout_q, w_q, tiles, out=d_a)
        first = next(iter(outputs.values()))
        print(name, "fp8 schedules give the same bits:", all(all(torch.equal(x, y) for x, y in zip(first, out)) for out in outputs.values()))
        ms = time_ms_interleaved(runs, batch=10, repeats=5)
        for kname, t in ms.items():
            print(f"{name:<17}{kname:<24}{t:>8.3f}{2 * R * H * I / t / 1e9:>9.0f}{ms['mok bf16'] / t:>8.2f}x")


def gathered_fp8_fc1() -> None:
    """fc1 on FP8 operands as the one-GPU layer runs it (x quantized once per token, its E4M3 rows
    and scales gathered by the GEMM's producer) against gathering the bf16 rows first, quantizing
    the rows in use and loading them by TMA (the EP path's form), against gathering the rows as
    they are quantized (one pass; the one-GPU layer's form: plan.quantizes_gathered_rows), and
    bf16's gathering fc1, on a real schedule: whether the gather in the producer holds FP8's
    64-wide SwiGLU tiles back (docs/notes/fp8-block-hopper.md)."""
    from mok.pipeline.fp8_weights import fp8_block_weights

    shapes = {"dsv3 fc1": (4096, 7168, 2048, 32, 8), "qwen3-235b fc1": (4096, 4096, 1536, 128, 8), "gpt-oss fc1": (4096, 2880, 2880, 32, 4),
              "qwen3 fc1": (8192, 2048, 768, 64, 8), "qwen3-30b fc1": (4096, 2048, 768, 128, 8)}
    for name, (T, H, I, E, k) in shapes.items():
        x = torch.randn(T, H, device="cuda").bfloat16()
        sched = uniform_schedule(T, E, k)
        wg, wu = ((torch.randn(E, I, H, device="cuda") * H**-0.5).bfloat16() for _ in range(2))
        q = fp8_block_weights(wg, wu, wu)
        used = sched.expert_offsets[-1:]
        x_rows = ops.gather_rows(x, sched.row_token)
        out = torch.empty(x_rows.shape[0], I, device="cuda").bfloat16()
        runs = {
            "bf16 fc1 gathering A": lambda: ops.grouped_gemm(x, wg, sched.tile_expert, b2=wu, out=out, gather=sched.row_token),
            "fp8 fc1 gathering A": lambda: ops.grouped_gemm(ops.quantize_fp8_rows(x), q.gate, sched.tile_expert, b2=q.up, out=out,
                                                            gather=sched.row_token),
            "fp8 gather, quantize, fc1": lambda: ops.grouped_gemm(
                ops.quantize_fp8_rows(ops.gather_rows(x, sched.row_token, out=x_rows), rows_used=used), q.gate, sched.tile_expert,
                b2=q.up, out=out),
            "fp8 quantize gathering, fc1": lambda: ops.grouped_gemm(
                ops.quantize_fp8_rows(x, rows_used=used, row_source=sched.row_token), q.gate, sched.tile_expert, b2=q.up, out=out),
        }
        ms = time_ms_interleaved(runs, batch=10, repeats=5)
        for kname, t in ms.items():
            print(f"{name:<15}{kname:<28}{t:>8.3f}")


PAIR_SHAPES = {  # name: (T, H, I, E, k), one GPU (issue 42's shapes)
    "qwen3-30b": (4096, 2048, 768, 128, 8),
    "qwen3-235b": (4096, 4096, 1536, 128, 8),
    "dsv3": (4096, 7168, 2048, 32, 8),
    "mixtral": (4096, 4096, 14336, 8, 2),
}


def row_tile_pairs() -> None:
    """The layer's bf16 grouped GEMMs on a uniform routing's schedule, each with cluster_m=1 and
    cluster_m=2 (two CTAs on two row tiles of one column tile, B multicast where one expert has
    both), interleaved; also the share of row-tile pairs that one expert has."""
    print(f"# {torch.cuda.get_device_name()}")
    print(f"{'shape':<12}{'GEMM':<14}{'cluster 1 ms':>13}{'cluster 2 ms':>13}{'speedup':>9}{'shared pairs':>14}")
    for name, (T, H, I, E, k) in PAIR_SHAPES.items():
        x = torch.randn(T, H, device="cuda").bfloat16()
        sched = uniform_schedule(T, E, k)
        wg, wu = ((torch.randn(E, I, H, device="cuda") * H**-0.5).bfloat16() for _ in range(2))
        wd = (torch.randn(E, H, I, device="cuda") * I**-0.5).bfloat16()
        rows = sched.row_token.shape[0]
        a, h = torch.empty(rows, I, device="cuda").bfloat16(), torch.empty(rows, 2 * I, device="cuda").bfloat16()
        dh = torch.randn(rows, 2 * I, device="cuda").bfloat16()
        y, dx = (torch.empty(rows, H, device="cuda").bfloat16() for _ in range(2))
        tiles = sched.tile_expert
        used = tiles[: tiles.shape[0] // 2 * 2].view(-1, 2)
        shared = ((used[:, 0] == used[:, 1]) & (used[:, 0] >= 0)).sum().item() / max((used >= 0).any(1).sum().item(), 1)
        gemms = {
            "fc1 gathering": lambda c: ops.grouped_gemm(x, wg, tiles, b2=wu, h_out=h, out=a, gather=sched.row_token, cluster_m=c),
            "fc2": lambda c: ops.grouped_gemm(a, wd, tiles, out=y, cluster_m=c),
            "dx": lambda c: ops.grouped_gemm(dh, wg, tiles, b2=wu, b_major="n", k_split=True, out=dx, cluster_m=c),
        }
        for gemm, fn in gemms.items():
            ms = time_ms_interleaved({c: (lambda c=c: fn(c)) for c in (1, 2)}, batch=10, repeats=5)
            print(f"{name:<12}{gemm:<14}{ms[1]:>13.3f}{ms[2]:>13.3f}{ms[1] / ms[2]:>8.2f}x{shared:>14.2f}")


def fp8_row_tile_pairs() -> None:
    """The FP8 forward GEMMs (fp8_block: the gate/up GEMM with SwiGLU and h on rows gathered as they
    are quantized, the down GEMM on a's quantized rows) with cluster_m=1 and cluster_m=2 (B's tile
    multicast to both CTAs where one expert has both row tiles), interleaved, and whether the two
    give the same bits."""
    from mok import fp8_block as fp8

    print(f"# {torch.cuda.get_device_name()}: FP8 row-tile pairs")
    print(f"{'shape':<12}{'GEMM':<14}{'cluster 1 ms':>13}{'cluster 2 ms':>13}{'speedup':>9}{'shared pairs':>14}  bits")
    for name, (T, H, I, E, k) in PAIR_SHAPES.items():
        x = torch.randn(T, H, device="cuda").bfloat16()
        sched = uniform_schedule(T, E, k)
        used = sched.expert_offsets[-1:]
        wg, wu = (fp8.quantize_weights((torch.randn(E, I, H, device="cuda") * H**-0.5).bfloat16()) for _ in range(2))
        wd = fp8.quantize_weights((torch.randn(E, H, I, device="cuda") * I**-0.5).bfloat16())
        rows = sched.row_token.shape[0]
        x_q = ops.quantize_fp8_rows(x, row_source=sched.row_token, rows_used=used)
        a_q = ops.quantize_fp8_rows(torch.randn(rows, I, device="cuda").bfloat16(), rows_used=used)
        h = torch.empty(rows, 2 * I, device="cuda").bfloat16()
        dout_q = ops.quantize_fp8_rows(x, row_source=sched.row_token, rows_used=used)
        dh_q = ops.quantize_fp8_rows(torch.randn(rows, 2 * I, device="cuda").bfloat16(), rows_used=used, segments=2)
        topk_w = torch.rand(T, k, device="cuda")
        wd_t = fp8.quantize_weights((torch.randn(E, I, H, device="cuda") * H**-0.5).bfloat16())
        wg_t, wu_t = (fp8.quantize_weights((torch.randn(E, H, I, device="cuda") * I**-0.5).bfloat16()) for _ in range(2))
        tiles = sched.tile_expert
        pairs = tiles[: tiles.shape[0] // 2 * 2].view(-1, 2)
        shared = ((pairs[:, 0] == pairs[:, 1]) & (pairs[:, 0] >= 0)).sum().item() / max((pairs >= 0).any(1).sum().item(), 1)
        gemms = {
            "fc1": lambda c: ops.grouped_gemm(x_q, wg, tiles, b2=wu, h_out=h, cluster_m=c),
            "fc2": lambda c: ops.grouped_gemm(a_q, wd, tiles, cluster_m=c),
            "swiglu bwd": lambda c: ops.swiglu_backward_gemm(dout_q, wd_t, tiles, h, row_token=sched.row_token, row_slot=sched.row_slot,
                                                             topk_w=topk_w, cluster_m=c)[0],
            "dx": lambda c: ops.grouped_gemm(dh_q, wg_t, tiles, b2=wu_t, k_split=True, cluster_m=c),
        }
        h.copy_(torch.randn_like(h))  # (the SwiGLU backward reads h)
        for gemm, fn in gemms.items():
            n_used = int(used.item())
            same = torch.equal(fn(1)[:n_used], fn(2)[:n_used])
            ms = time_ms_interleaved({c: (lambda c=c: fn(c)) for c in (1, 2)}, batch=10, repeats=5)
            print(f"{name:<12}{gemm:<14}{ms[1]:>13.3f}{ms[2]:>13.3f}{ms[1] / ms[2]:>8.2f}x{shared:>14.2f}  {same}")


def fp8_forward_levers() -> None:
    """The one-GPU fp8_block forward at dsv3 and qwen3-235b (T 4096, uniform routing) as the plan
    runs it ("default": the gate/up GEMM in turns of 4 on one CTA a tile, x's tokens quantized once
    and their FP8 rows gathered) against its gate/up GEMM on row-tile pairs (``row_tile_pairs``),
    without turns, both (the defaults before turns of 4), and without the FP8 row gather (the rows
    gathered as they are quantized: Plan.gathers_fp8_rows overridden for the run): each one's
    kernels per forward (torch.profiler), then all interleaved twice; the same bits, checked."""
    import collections

    import mok.kernels.variants as variants
    import mok.plan as plan_module
    from mok import pipeline
    from mok.config import MoKConfig
    from mok.runtime.arch import device_arch

    gathers, turns = plan_module.Plan.gathers_fp8_rows, dict(variants.DEEP_TURNS)
    settings = {"default": (4, False, True), "pairs": (4, True, True), "no turns": (0, False, True), "pairs, no turns": (0, True, True),
                "no gather": (4, False, False)}  # (the gate/up GEMM's turn, row-tile pairs, the FP8 rows gathered)
    try:
        for name, (T, H, I, E, k) in {"dsv3": (4096, 7168, 2048, 32, 8), "qwen3-235b": (4096, 4096, 1536, 128, 8)}.items():
            x = torch.randn(T, H, device="cuda").bfloat16()
            idx = torch.rand(T, E, device="cuda").topk(k, dim=1).indices.int()
            w = torch.rand(T, k, device="cuda") + 0.05
            experts = tuple((torch.randn(E, n, kk, device="cuda") * kk**-0.5).bfloat16() for n, kk in ((I, H), (I, H), (H, I)))
            plans = {pairs: plan_module.Plan(MoKConfig(H, I, E, k, precision="fp8_block", row_tile_pairs=pairs), device_arch())
                     for pairs in (False, True)}

            def forward(setting):
                turn, pairs, gather = settings[setting]
                variants.DEEP_TURNS.update(swiglu=turn, swiglu_save=turn)
                plan_module.Plan.gathers_fp8_rows = gathers if gather else property(lambda self: False)
                return pipeline.forward(plans[pairs], x, idx, w, experts, None, check_routing=False).out

            print(f"# {torch.cuda.get_device_name()}: the fp8_block forward at {name}, kernels ms a call")
            outs = [forward(s) for s in settings]
            print("bits equal", all(torch.equal(out, outs[0]) for out in outs))
            for setting in settings:
                for _ in range(5):
                    forward(setting)
                torch.cuda.synchronize()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        forward(setting)
                    torch.cuda.synchronize()
                kernels = collections.Counter()
                for event in prof.events():
                    if event.device_type == torch.autograd.DeviceType.CUDA:
                        kernels[event.name[:60]] += event.device_time_total / 10 / 1000
                print(f"{setting:<16} {sum(kernels.values()):.3f}: " + "; ".join(f"{n} {t:.3f}" for n, t in kernels.most_common(5)))
            for _ in range(2):
                ms = time_ms_interleaved({s: (lambda s=s: forward(s)) for s in settings}, batch=10, repeats=10)
                print("forward ms " + "  ".join(f"{s} {t:.3f}" for s, t in ms.items()))
    finally:
        plan_module.Plan.gathers_fp8_rows = gathers
        variants.DEEP_TURNS.clear()
        variants.DEEP_TURNS.update(turns)


SINGLE_MODES = {  # a flag that runs one sweep alone, in the order the flags are looked for
    "--fp8-dense": fp8_dense, "--fp8-forward-levers": fp8_forward_levers, "--fp8-row-tile-pairs": fp8_row_tile_pairs,
    "--row-tile-pairs": row_tile_pairs, "--fp8-schedules": fp8_schedules, "--fp8-row-quantizers": fp8_row_quantizers,
    "--fp8-ncu": fp8_for_ncu, "--fp8-wgrad-ncu": fp8_weight_grads_for_ncu, "--fp8-wgrad-stages": fp8_weight_grad_stages, "--fp8-wgrad-rows": fp8_weight_grad_rows,
    "--fp8-yield-hints": fp8_yield_hints, "--fp8-issue-order": fp8_issue_order, "--fp8-wgrad-issue-order": fp8_weight_grad_issue_order, "--fp8-tile-ingress": fp8_tile_ingress, "--bounded-walk": bounded_walk,
    "--fp8-weight-grads": fp8_weight_grads, "--fp8-activation-out": fp8_activation_out, "--tail-split": tail_split,
}
LATER_MODES = {"--counted-wgrad": counted_weight_grads, "--weight-grads": weight_grads, "--scattered-fc2": scattered_fc2}


if __name__ == "__main__":
    import sys

    single = next((flag for flag in SINGLE_MODES if flag in sys.argv), None)
    later = next((flag for flag in LATER_MODES if flag in sys.argv), None)
    if single:
        SINGLE_MODES[single]()
    elif "--fp8-block" in sys.argv or "--gathered-fp8-fc1" in sys.argv or "--fp8-swiglu-bwd" in sys.argv:
        if "--fp8-block" in sys.argv:
            fp8_block()
        if "--fp8-swiglu-bwd" not in sys.argv:
            gathered_fp8_fc1()
        if "--gathered-fp8-fc1" not in sys.argv:
            fp8_swiglu_backward()
    elif later:
        LATER_MODES[later]()
    else:
        if "--gathered-fc1" not in sys.argv:
            main()
            weight_grads()
        gathered_fc1()
