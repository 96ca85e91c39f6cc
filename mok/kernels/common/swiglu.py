"""SwiGLU's per-value math in the GEMM epilogues, forward and backward (arch-neutral: plain fp32
instructions, the same source for sm_90a and sm_100a).

    forward:  a = silu(h_g)·h_u,  silu(g) = g / (1 + exp(-g))
    backward: from dA_u (dout_row·W_down, unscaled) and the row's router weight s,
              d h_g = s·dA_u·h_u·silu'(h_g),  d h_u = s·dA_u·silu(h_g),  s·a and a

The IEEE division and reciprocal (div.rn.f32, rcp.rn.f32) branch per value between a fast path
and a slow one; that branch kept the compiler from interleaving an epilogue's values (ncu: one
dependent chain per value). For denominators d >= 1, which 1 + exp(-g) always is, the fast path
alone gives their bits below 2^126; d is clamped there. tests/test_forward_gpu.py and
tests/test_backward_gpu.py check them against div.rn and rcp.rn bit for bit.
"""

from __future__ import annotations

import cutlass.cute as cute

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
def swiglu_value(h_g, h_u):
    """The SwiGLU of one value: silu(h_gate)·h_up, silu as gate / (1 + exp(-gate))."""
    return divide_by_at_least_one(h_g, 1.0 + cute.math.exp(-h_g, fastmath=True)) * h_u


@cute.jit
def swiglu_backward_values(d_a, s, h_g, h_u):
    """The SwiGLU backward of one value: from dA_u (not yet scaled), the row's router weight s and
    the saved h_gate, h_up: (d h_gate, d h_up, s·a, a) with a = silu(h_gate)·h_up."""
    sig = reciprocal_at_least_one(1.0 + cute.math.exp(-h_g, fastmath=True))
    act = h_g * sig
    a_val = act * h_u
    d_s = d_a * s
    return d_s * h_u * (sig * (1.0 + h_g * (1.0 - sig))), d_s * act, s * a_val, a_val
