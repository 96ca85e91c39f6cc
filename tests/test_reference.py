"""The reference layer against an independent float64 computation, and its input checks."""

from fractions import Fraction

import numpy as np
import pytest
import torch

from helpers import random_layer
from mok.reference import combine_reference, fma_f32, moe_reference


def numpy_moe(x, topk_idx, topk_w, experts, shared):
    """Token-by-token float64 loop in numpy: the independent oracle for the oracle."""
    x = x.double().numpy()
    idx = topk_idx.numpy()
    w = topk_w.double().numpy()
    gate, up, down = (t.double().numpy() for t in experts)

    def mlp(v, g, u, d):
        hg, hu = g @ v, u @ v
        return d @ (hg / (1.0 + np.exp(-hg)) * hu)

    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        acc = mlp(x[t], *(s.double().numpy() for s in shared)) if shared is not None else np.zeros(x.shape[1])
        for j in range(idx.shape[1]):
            e = idx[t, j]
            acc = acc + w[t, j] * mlp(x[t], gate[e], up[e], down[e])
        out[t] = acc
    return out


def rel_err(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("shared_inter", [None, 24])
@pytest.mark.parametrize("num_tokens,num_experts,topk", [(1, 4, 1), (13, 5, 2), (40, 16, 8), (9, 256, 8)])
def test_reference_matches_float64_loop(num_tokens, num_experts, topk, shared_inter):
    x, idx, w, experts, shared = random_layer(num_tokens, 32, 16, num_experts, topk, shared_inter, seed=num_tokens)
    want = numpy_moe(x, idx, w, experts, shared)
    got32 = moe_reference(x, idx, w, *experts, shared)
    got64 = moe_reference(x, idx, w, *experts, shared, dtype=torch.float64)
    assert got32.dtype == torch.float32 and got64.dtype == torch.float64
    assert rel_err(got32, want) < 1e-6
    assert rel_err(got64, want) < 1e-13


def test_reference_accepts_bf16_inputs_and_upcasts():
    x, idx, w, experts, shared = random_layer(7, 16, 8, 4, 2, 8, seed=3, dtype=torch.bfloat16)
    want = numpy_moe(x, idx, w, experts, shared)
    assert rel_err(moe_reference(x, idx, w, *experts, shared), want) < 1e-6


def test_expert_with_all_tokens_and_empty_experts():
    x, _, w, experts, _ = random_layer(10, 16, 8, 6, 2, seed=5)
    idx = torch.tensor([[2, 4]] * 10, dtype=torch.int64)  # experts 0, 1, 3, 5 get nothing
    want = numpy_moe(x, idx, w, experts, None)
    assert rel_err(moe_reference(x, idx, w, *experts), want) < 1e-6


def test_gradcheck_of_reference_in_float64():
    x, idx, w, experts, shared = random_layer(5, 6, 4, 3, 2, 3, seed=11, dtype=torch.float64)
    w = w.double()
    leaves = [t.clone().requires_grad_() for t in (x, w, *experts, *shared)]

    def f(x, w, g, u, d, sg, su, sd):
        return moe_reference(x, idx, w, g, u, d, (sg, su, sd), dtype=torch.float64)

    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-8, rtol=1e-6)


def _round_to_f32(value: Fraction) -> np.float32:
    """Exact round-to-nearest-even of a rational to float32 (normal range)."""
    if value == 0:
        return np.float32(0.0)
    sign = -1 if value < 0 else 1
    mag = abs(value)
    exp = mag.numerator.bit_length() - mag.denominator.bit_length()
    while Fraction(2) ** exp > mag:
        exp -= 1
    while Fraction(2) ** (exp + 1) <= mag:
        exp += 1
    ulp = Fraction(2) ** (exp - 23)
    q = mag / ulp
    n = q.numerator // q.denominator
    rem = q - n
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and n % 2 == 1):
        n += 1
    return np.float32(sign * float(n * ulp))


@pytest.mark.parametrize("c_scale", [1e-2, 1e-30])
def test_fma_f32_is_a_single_rounding(c_scale):
    """Against exact rational arithmetic, also where c is far below a·b and b is a bf16 value
    (a·b then often lies on an fp32 midpoint: rounding the float64 sum to nearest first fails)."""
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(2000, generator=g) * s for s in (1.0, 1e3, c_scale))
    b[1000:] = b[1000:].bfloat16().float()
    a[:4], b[:4], c[:4] = torch.tensor([1 + 2**-23] * 4), torch.tensor([1.5] * 4), torch.tensor([-1e-30, 1e-30, -0.0, 0.0])
    got = fma_f32(a, b, c)
    for i in range(2000):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        assert got[i].item() == float(_round_to_f32(exact)), i


def test_combine_reference_operation_order():
    g = torch.Generator().manual_seed(1)
    y = torch.randn(6, 3, 16, generator=g).bfloat16()
    w = torch.rand(6, 3, generator=g)
    s = torch.randn(6, 16, generator=g).bfloat16()
    acc = [float(v) for v in s.float().flatten()]
    y32, w32 = y.float(), w.float()
    for j in range(3):
        prod = w32[:, j, None].expand(6, 16).flatten()
        acc = [float(_round_to_f32(Fraction(float(p)) * Fraction(float(q)) + Fraction(r)))
               for p, q, r in zip(prod, y32[:, j].flatten(), acc)]
    want = torch.tensor(acc).view(6, 16).bfloat16()
    assert torch.equal(combine_reference(y, w, s), want)
    # without a shared expert the chain starts from +0
    no_shared = torch.zeros(6, 16)
    for j in range(3):
        no_shared = fma_f32(w32[:, j, None], y32[:, j], no_shared)
    assert torch.equal(combine_reference(y, w), no_shared.bfloat16())


# ---- bad input ---------------------------------------------------------------------------

def _good():
    x, idx, w, experts, shared = random_layer(4, 16, 8, 4, 2, 8, seed=2)
    return dict(x=x, topk_idx=idx, topk_w=w, w_gate=experts[0], w_up=experts[1], w_down=experts[2], shared=shared)


@pytest.mark.parametrize(
    "change,error,words",
    [
        (lambda a: a.update(x=a["x"][0]), ValueError, "x: expected a 2-d tensor"),
        (lambda a: a.update(x=a["x"].int()), TypeError, "x: expected dtype"),
        (lambda a: a.update(topk_idx=a["topk_idx"].float()), TypeError, "topk_idx: expected dtype int32 or int64, got float32"),
        (lambda a: a.update(topk_idx=a["topk_idx"][:3]), ValueError, "topk_idx: expected 4 rows"),
        (lambda a: a.update(topk_idx=a["topk_idx"] + 4), ValueError, "topk_idx: expected every entry in [0, 4)"),
        (lambda a: a.update(topk_idx=a["topk_idx"] - 9), ValueError, "topk_idx: expected every entry in [0, 4)"),
        (lambda a: a.update(topk_idx=torch.zeros(4, 5, dtype=torch.int32)), ValueError, "expected k <= num_experts=4, got k=5"),
        (lambda a: a.update(topk_w=a["topk_w"][:, :1]), ValueError, "topk_w: expected shape [4, 2]"),
        (lambda a: a.update(topk_w=a["topk_w"].bfloat16()), TypeError, "topk_w: expected dtype float32 or float64"),
        (lambda a: a.update(w_up=a["w_up"][:, :4]), ValueError, "w_up: expected shape [4, 8, 16]"),
        (lambda a: a.update(w_down=a["w_down"].transpose(1, 2)), ValueError, "w_down: expected shape [4, 16, 8]"),
        (lambda a: a.update(w_gate=a["w_gate"][0]), ValueError, "w_gate: expected a 3-d tensor"),
        (lambda a: a.update(shared=a["shared"][:2]), TypeError, "shared: expected None or (gate, up, down)"),
        (lambda a: a.update(shared=(a["shared"][0], a["shared"][1], a["shared"][2].T)), ValueError, "shared.down: expected shape [16, 8]"),
    ],
)
def test_reference_rejects_bad_input(change, error, words):
    args = _good()
    change(args)
    with pytest.raises(error) as info:
        moe_reference(**args)
    assert words in str(info.value)


def test_reference_rejects_bad_compute_dtype():
    with pytest.raises(TypeError, match="dtype: expected float32 or float64"):
        moe_reference(**_good(), dtype=torch.bfloat16)
