"""The gated activations' per-value math in the GEMM epilogues, forward and backward (arch-neutral:
plain fp32 instructions, the same source for sm_90a and sm_100a). ``kind`` (static) is one of
mok.kernels.constants.ACTIVATIONS; a = act(h_g, h_u) for the gate and up pre-activations h_g, h_u of one value:

    swiglu:          a = silu(h_g)·h_u,  silu(g) = g / (1 + exp(-g))
    clamped_swiglu:  a = g·σ(1.702·g)·(u + 1) with g = min(h_g, 7), u = clamp(h_u, -7, 7)  (gpt-oss's)
    geglu:           a = gelu(h_g)·h_u, gelu's tanh approximation 0.5·g·(1 + tanh(√(2/π)·(g + 0.044715·g³)))

    backward: from dA_u (dout_row·W_down, unscaled) and the row's router weight s,
              d h_g = s·dA_u·∂a/∂h_g,  d h_u = s·dA_u·∂a/∂h_u,  s·a and a
              (a clamp passes the gradient where its input is within the bounds, ends included, as torch.clamp's)

The IEEE division and reciprocal (div.rn.f32, rcp.rn.f32) branch per value between a fast path
and a slow one; that branch kept the compiler from interleaving an epilogue's values (ncu: one
dependent chain per value). For denominators d >= 1, which 1 + exp(-z) always is, the fast path
alone gives their bits below 2^126; d is clamped there. tests/test_forward_gpu.py and
tests/test_backward_gpu.py check them against div.rn and rcp.rn bit for bit. GeGLU's tanh is
tanh.approx.f32 (one instruction; within 2^-10.7 of tanh).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from ..constants import CLAMP_LIMIT, CLAMPED_ALPHA, GELU_CUBIC, GELU_SCALE

RECIPROCAL_MAX_DENOMINATOR = 2.0**126  # above it the fast path would give a denormal or 0: clamped


@cute.jit
def refined_reciprocal(d):
    """1/d for 1 <= d <= RECIPROCAL_MAX_DENOMINATOR (already clamped): the approximate
    reciprocal and one Newton step."""
    r = cute.arch.rcp_approx(d)
    e = cute.math.fma(d, r, -1.0)
    return cute.math.fma(r, -e, r)


@cute.jit
def reciprocal_at_least_one(d):
    """1/d for d >= 1, as rcp.rn.f32 rounds it, without its branch: the approximate reciprocal
    and one Newton step are what rcp.rn computes for d below 2^126 (its fast path; the same bits),
    and d is clamped there (1/d then 2^-126 instead of a denormal or 0)."""
    return refined_reciprocal(cute.arch.fmin(d, RECIPROCAL_MAX_DENOMINATOR))


@cute.jit
def divide_by_at_least_one(a, d):
    """a / d for d >= 1 without div.rn.f32's branch: a refined reciprocal, the quotient and one
    correction (the fast path of the IEEE division: the same bits wherever the quotient is a
    normal float and d is below 2^126), d clamped as in :func:`reciprocal_at_least_one`."""
    d = cute.arch.fmin(d, RECIPROCAL_MAX_DENOMINATOR)
    r = refined_reciprocal(d)
    q = a * r
    rem = cute.math.fma(-d, q, a)
    return cute.math.fma(r, rem, q)


@cute.jit
def gelu_tanh_parts(g):
    """geglu: (gelu(g), gelu'(g)) of the tanh approximation."""
    inner = GELU_SCALE * cute.math.fma(GELU_CUBIC * g, g * g, g)
    t = cute.math.tanh(inner, approx=True)
    half_one_plus_t = 0.5 * (1.0 + t)
    d_inner = GELU_SCALE * cute.math.fma(3.0 * GELU_CUBIC * g, g, 1.0)
    return g * half_one_plus_t, cute.math.fma(0.5 * g * (1.0 - t * t), d_inner, half_one_plus_t)


@cute.jit
def glu_value(kind: cutlass.Constexpr, h_g, h_u):
    """The gated activation ``kind`` of one value (see the module docstring)."""
    if cutlass.const_expr(kind == "clamped_swiglu"):
        g = cute.arch.fmin(h_g, CLAMP_LIMIT)
        u = cute.arch.fmax(cute.arch.fmin(h_u, CLAMP_LIMIT), -CLAMP_LIMIT)
        return divide_by_at_least_one(g, 1.0 + cute.math.exp(-CLAMPED_ALPHA * g, fastmath=True)) * (u + 1.0)
    elif cutlass.const_expr(kind == "geglu"):
        gelu, _ = gelu_tanh_parts(h_g)
        return gelu * h_u
    else:  # swiglu
        return divide_by_at_least_one(h_g, 1.0 + cute.math.exp(-h_g, fastmath=True)) * h_u


@cute.jit
def glu_backward_values(kind: cutlass.Constexpr, d_a, s, h_g, h_u):
    """The backward of ``kind`` for one value: from dA_u (not yet scaled), the row's router weight s
    and the saved h_gate, h_up: (d h_gate, d h_up, s·a, a)."""
    if cutlass.const_expr(kind == "clamped_swiglu"):
        d_s = d_a * s
        g = cute.arch.fmin(h_g, CLAMP_LIMIT)
        u = cute.arch.fmax(cute.arch.fmin(h_u, CLAMP_LIMIT), -CLAMP_LIMIT)
        sig = reciprocal_at_least_one(1.0 + cute.math.exp(-CLAMPED_ALPHA * g, fastmath=True))
        act = g * sig
        up1 = u + 1.0
        d_act = sig * cute.math.fma(CLAMPED_ALPHA * g, 1.0 - sig, 1.0)
        # (the clamps pass the gradient where they left their input: as factors 1 or 0, no predicate kept)
        d_gate = d_s * up1 * d_act * cutlass.Float32(h_g <= CLAMP_LIMIT)
        d_up = d_s * act * cutlass.Float32(u == h_u)
        a_val = act * up1
        return d_gate, d_up, s * a_val, a_val
    elif cutlass.const_expr(kind == "geglu"):
        d_s = d_a * s
        gelu, d_gelu = gelu_tanh_parts(h_g)
        a_val = gelu * h_u
        return d_s * h_u * d_gelu, d_s * gelu, s * a_val, a_val
    else:  # swiglu
        sig = reciprocal_at_least_one(1.0 + cute.math.exp(-h_g, fastmath=True))
        act = h_g * sig
        a_val = act * h_u
        d_s = d_a * s
        return d_s * h_u * (sig * (1.0 + h_g * (1.0 - sig))), d_s * act, s * a_val, a_val
