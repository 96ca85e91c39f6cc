"""MoK as a Hugging Face transformers experts backend.

transformers (5.x) runs an MoE model's experts through its ``ExpertsInterface``
(``transformers.integrations.moe``): every experts class decorated with
``@use_experts_implementation(...)`` looks its forward up by ``config._experts_implementation``
("eager", "grouped_mm", "batched_mm", "deepgemm", "sonicmoe", ...). Importing this module registers
one more, ``"mok"``::

    import mok.integrations.transformers as mok_hf   # registers experts_implementation="mok"

    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16, experts_implementation="mok")
    model.set_experts_implementation("mok")          # or switch a model already built
    mok_hf.apply(model)                              # or: check every experts module now, switch them, and
                                                     # run DeepSeek-V3's shared experts in MoK's launches too
    mok_hf.apply(model, saved_h_format="recompute")  # with the layer's options (see apply)

What runs on MoK: the routed experts, ``out[t] = Σ_j w[t, j]·(silu(x[t]·W_gateᵀ)·(x[t]·W_upᵀ))·W_downᵀ``
with the model's own router's top-k ids and weights (softmax or sigmoid, group-limited top-k, bias
correction, scaling all stay the model's code; the weights' gradient flows back through it). The
op is ``torch.ops.mok.moe_forward`` (mok/torch_ops.py): MoK's fused kernels on a Hopper GPU (bf16,
H and I multiples of 8), the fp32 reference on the CPU (any widths MoKConfig takes).

Weights: transformers stores each family's experts as ``gate_up_proj`` [E, 2I, H] (gate rows first)
and ``down_proj`` [E, H, I]. Both are used in place: ``down_proj`` is MoK's ``w_down`` as it is,
and the gate and up halves of ``gate_up_proj`` are views with an expert stride of 2·I·H, which
MoK's kernels read as they are (each expert's block is contiguous). The backward's weight-gradient
GEMM writes ``gate_up_proj``'s gradient as one tensor. (A transposed layout, ``is_transposed``, is copied
per call; under autocast the weights are cast per call.) Parameters, their names, ``state_dict``
and ``save_pretrained`` stay transformers' own.

Shared experts: DeepSeek-V3's (unit weight, ``shared_experts``) run inside MoK's op once
:func:`apply` fused its MoE blocks; Qwen2-MoE's is gated (``sigmoid(x·g)·shared(x)``, which MoK's
unit-weight shared expert cannot express) and stays the model's own code, as do the shared experts
of any model not passed through :func:`apply`.

gpt-oss: its interleaved, transposed gate/up weights, its biases (``gate_up_proj_bias``,
``down_proj_bias``) and its clamped SwiGLU ``(up + 1)·gate·σ(1.702·gate)`` (MoK's
``activation="clamped_swiglu"`` and ``expert_bias``) run in Hopper's kernels (and on the CPU
reference path).

Not supported yet (refused with the reason): other biases and gate activations, ungated experts; on
the GPU other dtypes than bf16.
"""

from __future__ import annotations

import functools
import importlib
import re
import warnings

import torch
from torch import nn

try:
    from transformers.integrations import moe as _hf_moe
except ImportError as error:  # (no transformers, or one without transformers.integrations.moe)
    raise ImportError(
        "mok.integrations.transformers needs transformers >= 5.0 (its ExpertsInterface, transformers.integrations.moe); "
        "install MoK's extra: pip install 'mok[hf]'"
    ) from error
if not hasattr(_hf_moe, "ExpertsInterface"):
    raise ImportError(
        "mok.integrations.transformers: this transformers has no ExpertsInterface (transformers.integrations.moe); "
        "install MoK's extra: pip install 'mok[hf]'"
    )

from ..config import MoKConfig
from ..runtime.arch import check_fused_layer_device
from ..torch_ops import config_text

__all__ = [
    "BACKEND",
    "SUPPORTED_FAMILIES",
    "UnsupportedModelError",
    "apply",
    "check_experts",
    "copied_weights",
    "describe",
    "experts_modules",
    "layer_options",
    "mok_experts_forward",
    "mok_layout",
    "moe_experts",
    "register",
]

BACKEND = "mok"  # the experts_implementation name

# Families whose experts transformers runs through the ExpertsInterface and MoK covers, tested
# (tests/test_hf.py, tests/test_hf_gpu.py): experts class -> family. Other experts classes of the same
# layout (SwiGLU, no biases) are accepted by their declared layout too; these are the ones tested.
SUPPORTED_FAMILIES = {
    "Qwen3MoeExperts": "Qwen3-MoE",
    "Qwen2MoeExperts": "Qwen2-MoE",
    "MixtralExperts": "Mixtral",
    "DeepseekV3Experts": "DeepSeek-V3",
    "OlmoeExperts": "OLMoE",
    "GptOssExperts": "gpt-oss",
}
_KNOWN_UNSUPPORTED: dict[str, str] = {}
GPT_OSS_GATE = {"alpha": 1.702, "limit": 7.0}  # GptOssExperts' clamped SwiGLU: MoK's activation="clamped_swiglu"

# MoE blocks whose shared expert MoK runs in its own op (unit weight: out = routed + shared(x)):
# block class -> (its module, router attribute, experts attribute, shared-expert attribute).
_SHARED_BLOCKS = {
    "DeepseekV3MoE": ("transformers.models.deepseek_v3.modeling_deepseek_v3", "gate", "experts", "shared_experts"),
}

# The layer options apply() takes (MoKConfig's fields of one GPU), with their defaults; kept on
# each experts module as OPTIONS_ATTR: the options that differ from these, as (name, value) pairs.
LAYER_OPTIONS = {"saved_h_format": "bf16", "one_launch": False, "precision": "bf16", "fp8_scales": "fp32", "wgrad_format": None}
OPTIONS_ATTR = "mok_options"


class UnsupportedModelError(ValueError):
    """The model has no MoE experts MoK can run, or experts MoK does not run yet (the message says why)."""


def _families() -> str:
    return ", ".join(SUPPORTED_FAMILIES.values())


def _what_mok_runs() -> str:
    return (
        "MoK runs gated experts, act(x·W_gateᵀ + b_gate, x·W_upᵀ + b_up)·W_downᵀ + b_down with SwiGLU (or gpt-oss's clamped "
        "SwiGLU, with biases), stored as transformers' gate_up_proj (gate and up concatenated or interleaved), down_proj and "
        "their biases (on the GPU: bf16, H and I multiples of 8); "
        f"supported families: {_families()}"
    )


# ----- the experts' layout


def _is_silu(act: object) -> bool:
    from transformers.activations import SiLUActivation

    return type(act) in (nn.SiLU, SiLUActivation) or act is torch.nn.functional.silu


def _uses_default_gate(cls: type) -> bool:
    """Whether the class's gate is transformers' default, ``act_fn(gate)·up`` of the two halves."""
    return getattr(cls, "_apply_gate", _hf_moe._default_apply_gate) is _hf_moe._default_apply_gate


def _is_gpt_oss_gate(experts: nn.Module) -> bool:
    """Whether ``experts`` computes gpt-oss's clamped SwiGLU: GptOssExperts' own _apply_gate with its
    constants (MoK's activation="clamped_swiglu")."""
    cls = type(experts)
    if cls.__name__ != "GptOssExperts" or "_apply_gate" not in vars(cls):
        return False
    return all(getattr(experts, name, None) == value for name, value in GPT_OSS_GATE.items())


def activation_of(experts: nn.Module) -> str:
    """MoK's activation for an experts module MoK runs (mok.config.MoKConfig.activation)."""
    return "clamped_swiglu" if _is_gpt_oss_gate(experts) else "swiglu"


def _has_biases(experts: nn.Module) -> bool:
    """Whether the experts have gate_up_proj_bias and down_proj_bias (gpt-oss's layout of biases)."""
    return getattr(experts, "gate_up_proj_bias", None) is not None and getattr(experts, "down_proj_bias", None) is not None


def _layout_problems(experts: nn.Module) -> list[str]:
    """What keeps MoK from running ``experts`` exactly (empty: nothing)."""
    cls = type(experts)
    problems = []
    if not getattr(experts, "has_gate", True):
        problems.append("ungated experts (has_gate=False: act(x·W_upᵀ)·W_downᵀ; MoK's are gated)")
    biases = [n for n in ("gate_up_proj_bias", "up_proj_bias", "down_proj_bias") if getattr(experts, n, None) is not None]
    if (getattr(experts, "has_bias", False) or biases) and not (_has_biases(experts) and len(biases) == 2):
        problems.append(f"expert biases other than gate_up_proj_bias and down_proj_bias ({', '.join(biases) or 'has_bias=True'})")
    gpt_oss = _is_gpt_oss_gate(experts)
    if not gpt_oss and not _uses_default_gate(cls):
        problems.append(f"its own gate activation ({cls.__name__}._apply_gate: MoK computes silu(gate)·up and gpt-oss's clamped SwiGLU)")
    elif not gpt_oss and not _is_silu(getattr(experts, "act_fn", None)):
        act = getattr(experts, "act_fn", None)
        problems.append(f"the activation {getattr(act, '__name__', type(act).__name__)} (MoK's SwiGLU applies silu: hidden_act='silu')")
    extra = [n for n, _ in experts.named_children() if n != "act_fn"]
    if getattr(experts, "has_post_expert_norm", False) or extra:  # (transformers >= 5.2x: a norm after each expert)
        problems.append(f"modules inside the experts MoK does not run ({', '.join(extra) or 'has_post_expert_norm=True'})")
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and gate_up.dim() == 3 and isinstance(down, torch.Tensor) and down.dim() == 3):
        problems.append("no 3-d gate_up_proj and down_proj weights")
    else:
        E, rows, cols = gate_up.shape
        two_i, hidden = (cols, rows) if getattr(experts, "is_transposed", False) else (rows, cols)
        want = (E, two_i // 2, hidden) if getattr(experts, "is_transposed", False) else (E, hidden, two_i // 2)
        if two_i % 2 or tuple(down.shape) != want:
            problems.append(f"gate_up_proj {list(gate_up.shape)} and down_proj {list(down.shape)} do not fit together")
    return problems


def _refusal(name: str, experts: nn.Module, problems: list[str]) -> str:
    cls = type(experts).__name__
    family = SUPPORTED_FAMILIES.get(cls) or _KNOWN_UNSUPPORTED.get(cls)
    what = f"{cls}" + (f" ({family})" if family else "")
    where = f" at {name!r}" if name else ""
    return f"MoK does not run the experts{where}, {what}, yet: {'; '.join(problems)}. {_what_mok_runs()}"


def check_experts(experts: nn.Module, name: str = "") -> None:
    """Raise :class:`UnsupportedModelError` unless MoK runs ``experts`` (an experts module of the
    ExpertsInterface) exactly as transformers' own backends do."""
    problems = _layout_problems(experts)
    if problems:
        raise UnsupportedModelError(_refusal(name, experts, problems))


def _widths(gate_up: torch.Tensor, transposed: bool) -> tuple[int, int]:
    """(H, I) of a ``gate_up_proj`` [E, 2I, H] (or [E, H, 2I] transposed)."""
    return (gate_up.shape[1], gate_up.shape[2] // 2) if transposed else (gate_up.shape[2], gate_up.shape[1] // 2)


def _halves(gate_up: torch.Tensor, transposed: bool, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up weights [E, I, H] as views of ``gate_up`` ([E, 2I, H], or [E, H, 2I] transposed):
    its two halves, gate first (transformers' default gate, ``act_fn(gate)·up`` of ``chunk(2)``), or
    with ``interleaved`` (is_concatenated=False: gpt-oss's) its even and odd rows."""
    inter = _widths(gate_up, transposed)[1]
    gate, up = (slice(0, None, 2), slice(1, None, 2)) if interleaved else (slice(0, inter), slice(inter, None))
    if transposed:
        return gate_up[..., gate].transpose(1, 2), gate_up[..., up].transpose(1, 2)
    return gate_up[:, gate], gate_up[:, up]


def _gate_up_rows(gate_up: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``gate_up_proj`` as [E, 2I, H] (a view: transposed back where it is [E, H, 2I])."""
    return gate_up.transpose(1, 2) if transposed else gate_up


def mok_layout(
    gate_up: torch.Tensor, down: torch.Tensor, transposed: bool, dtype: torch.dtype | None = None, interleaved: bool = False,
    joined: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w_gate, w_up [E, I, H], w_down [E, H, I]) in ``dtype`` (default: theirs), as MoK's op takes
    them, from an experts module's ``gate_up_proj`` and ``down_proj``. With ``joined`` (MoK's
    gate_up_layout "concatenated", or "interleaved" for gpt-oss's alternating gate and up) they
    are parts of one [E, 2I, H] tensor, its halves or its even and odd rows: views of the parameter
    where its rows lie so in memory (MoK's kernels read them in place; gpt-oss's [E, H, 2I] once
    :func:`store_for_mok` stored it transposed), else of one copy (a cast copy under autocast).
    Without ``joined`` each part is its own packed copy. ``down_proj`` is used as it is where its
    [E, H, I] rows are contiguous (cast where needed), else copied. Not autograd-tracked:
    :class:`_Experts` calls it in its forward and again in its backward."""
    w_down = _as(down.transpose(1, 2) if transposed else down, dtype)
    rows = _gate_up_rows(gate_up, transposed)
    if joined:
        return (*_halves(_as(rows, dtype), False, interleaved), w_down)
    return (*(_as(t, dtype) for t in _halves(rows, False, interleaved)), w_down)


def store_for_mok(experts: nn.Module) -> bool:
    """Store a transposed experts module's weights (is_transposed: gpt-oss's ``gate_up_proj``
    [E, H, 2I], ``down_proj`` [E, I, H]) transposed in memory, once: the same tensors (shapes,
    values, names, state_dict), each expert's [2I, H] and [H, I] rows contiguous, which MoK's
    kernels then read in place on every call instead of copying them. The Parameters stay the same
    objects (their ``.data`` is replaced; optimizer state made afterwards follows their strides).
    Returns whether anything moved."""
    if not getattr(experts, "is_transposed", False):
        return False
    moved = False
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            param = getattr(experts, name)
            if not param.transpose(1, 2).is_contiguous():
                param.data = param.data.transpose(1, 2).contiguous().transpose(1, 2)
                moved = True
    return moved


def mok_biases(
    gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None, dtype: torch.dtype | None = None, interleaved: bool = False
) -> tuple[torch.Tensor, ...]:
    """(b_gate, b_up [E, I], b_down [E, H]) in ``dtype`` from ``gate_up_proj_bias`` [E, 2I] (halves, or
    even and odd columns with ``interleaved``) and ``down_proj_bias``; () without biases."""
    if gate_up_bias is None:
        return ()
    gate, up = _halves(gate_up_bias[:, :, None], False, interleaved)  # (as [E, 2I, 1] weights: [E, I, 1] halves)
    return _as(gate[..., 0], dtype), _as(up[..., 0], dtype), _as(down_bias, dtype)


def _as(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """``t`` contiguous in ``dtype`` (itself where it is already; a copy where not)."""
    if t is None or (t.is_contiguous() and dtype in (None, t.dtype)):
        return t
    return t.to(dtype=dtype or t.dtype, memory_format=torch.contiguous_format, copy=True)


def _joined(gate: torch.Tensor, up: torch.Tensor, dim: int, interleaved: bool) -> torch.Tensor:
    """``gate`` and ``up`` side by side along ``dim`` (a gradient in gate_up_proj's layout): concatenated, or interleaved."""
    if not interleaved:
        return torch.cat([gate, up], dim=dim)
    pairs = torch.stack([gate, up], dim=dim + 1)  # (.., I, 2, ..)
    return pairs.flatten(dim, dim + 1)


def _gate_up_grad(d_gate: torch.Tensor, d_up: torch.Tensor, transposed: bool, interleaved: bool = False) -> torch.Tensor:
    """The gradient of ``gate_up_proj`` from those of its two halves."""
    if transposed:
        return _joined(d_gate.transpose(1, 2), d_up.transpose(1, 2), 2, interleaved)
    return _joined(d_gate, d_up, 1, interleaved)


TIMEOUT_S = 5.0  # (the op's wait bound; only expert parallelism waits, which this backend does not use)


class _Experts(torch.autograd.Function):
    """``mok::moe_forward`` / ``mok::moe_backward`` over an experts module's own parameters, in
    ``dtype`` (the parameters' own, or autocast's: then every weight is cast per call, as autocast
    casts a Linear's, and its gradient cast back).

    The op's own autograd keeps the weights it was given for its backward: a per-call copy (a cast
    under autocast, the transposed layout) would stay alive from the forward to the backward (as
    much memory as gate_up_proj itself, per layer). This Function keeps the parameters instead and
    makes the weights again in the backward (views where they are MoK's layout, :func:`mok_layout`);
    with ``joined_grad`` (the config's gate_up_layout "concatenated" or "interleaved") gate_up_proj's gradient comes
    from the weight-gradient GEMM as one [E, 2I, H] tensor. The op pair and what it saves are the same.
    Autocast is off inside: MoK's op computes at its own precision (its CPU reference in fp32)."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_w, gate_up, down, shared_gate, shared_up, shared_down, gate_up_bias, down_bias, layout, config, save,
                dtype, joined_grad):
        transposed, interleaved = layout
        weights = (*mok_layout(gate_up, down, transposed, dtype, interleaved, joined_grad),
                   *(_as(t, dtype) for t in (shared_gate, shared_up, shared_down)))
        biases = mok_biases(gate_up_bias, down_bias, dtype, interleaved)
        with torch.autocast(x.device.type, enabled=False):
            out, *saved = torch.ops.mok.moe_forward(x, topk_idx, topk_w, *weights, config, 0, save, False, TIMEOUT_S, *biases)
        ctx.layout, ctx.config, ctx.saved_state, ctx.dtype, ctx.joined_grad = layout, config, save, dtype, joined_grad
        if save:
            ctx.save_for_backward(x, topk_idx, topk_w, gate_up, down, shared_gate, shared_up, shared_down, gate_up_bias, down_bias, *saved)
        return out

    @staticmethod
    def backward(ctx, d_out):
        if not ctx.saved_state:
            raise RuntimeError("MoK experts backend: the forward ran without a gradient wanted, so it kept nothing for a backward")
        x, topk_idx, topk_w, gate_up, down, shared_gate, shared_up, shared_down, gate_up_bias, down_bias, *saved = ctx.saved_tensors
        want = any(ctx.needs_input_grad[3:10])  # any expert weight or bias (routed or shared); all frozen: no weight-gradient GEMM
        transposed, interleaved = ctx.layout
        shared = (shared_gate, shared_up, shared_down)
        weights = (*mok_layout(gate_up, down, transposed, ctx.dtype, interleaved, ctx.joined_grad), *(_as(t, ctx.dtype) for t in shared))
        biases = mok_biases(gate_up_bias, down_bias, ctx.dtype, interleaved)
        with torch.autocast(x.device.type, enabled=False):
            dx, d_topk_w, d_gate, d_up, d_down, *rest = torch.ops.mok.moe_backward(
                d_out.to(x.dtype).contiguous(), x, topk_idx, topk_w, *weights, saved, ctx.config, 0, TIMEOUT_S, [], want, *biases,
            )
        d_shared, d_biases = rest[:3], rest[3:]
        if not want:
            grads = [None] * 7
        else:
            d_down = d_down.transpose(1, 2) if transposed else d_down
            d_gate_up = _gate_up_rows(d_gate, transposed) if ctx.joined_grad else _gate_up_grad(d_gate, d_up, transposed, interleaved)
            grads = [d_gate_up.to(gate_up.dtype), d_down.to(down.dtype)]
            grads += [g.to(p.dtype) for g, p in zip(d_shared, shared)] if shared_gate is not None else [None] * 3
            has_bias = gate_up_bias is not None
            grads += [_joined(*d_biases[:2], 1, interleaved).to(gate_up_bias.dtype), d_biases[2].to(down_bias.dtype)] if has_bias else [None] * 2
        return dx, None, d_topk_w, *grads, None, None, None, None, None


def copied_weights(experts: nn.Module) -> tuple[str, ...]:
    """The experts' parameters MoK copies on every call (their rows do not lie as MoK's kernels
    read them: gpt-oss's until :func:`store_for_mok`), by name (bf16 precision)."""
    transposed = bool(getattr(experts, "is_transposed", False))
    interleaved = not getattr(experts, "is_concatenated", True)
    down = experts.down_proj.transpose(1, 2) if transposed else experts.down_proj
    gate_up_copied = not _gate_up_rows(experts.gate_up_proj, transposed).is_contiguous()
    copied = (("gate_up_proj",) if gate_up_copied else ()) + (("down_proj",) if not down.is_contiguous() else ())
    return copied + (("gate_up_proj_bias",) if interleaved and _has_biases(experts) else ())


# ----- the backend


@functools.lru_cache(maxsize=None)
def _config_text_of(hidden: int, inter: int, num_experts: int, topk: int, shared_inter: int | None, options: tuple = ()) -> str:
    return config_text(MoKConfig(hidden, inter, num_experts, topk, shared_inter, **dict(options)))


@torch.compiler.assume_constant_result
def _config_text(hidden: int, inter: int, num_experts: int, topk: int, shared_inter: int | None, options: tuple = ()) -> str:
    """The op's configuration string (a constant in a compiled graph: torch.compile runs this once
    while tracing instead of tracing MoKConfig and json); ``options``: the experts module's
    OPTIONS_ATTR."""
    return _config_text_of(hidden, inter, num_experts, topk, shared_inter, options)


def _check_device(x: torch.Tensor, widths: dict) -> None:
    """What MoK's GPU path takes (tokens and weights in bf16: ``x`` in the dtype the call computes
    in; a Hopper GPU; the widths: the layer's plan checks them); the CPU runs the reference."""
    if x.device.type == "cpu":
        return
    if x.device.type != "cuda":
        raise ValueError(f"MoK experts backend: runs on a CUDA GPU (Hopper) or the CPU, got tensors on {x.device}")
    if x.dtype != torch.bfloat16:
        raise TypeError(
            f"MoK experts backend: MoK's GPU kernels compute in bf16, this model's experts are {x.dtype}; "
            "load it with dtype=torch.bfloat16 (or call model.bfloat16()), or run it under torch.autocast('cuda', dtype=torch.bfloat16)"
        )
    if not torch.compiler.is_compiling():
        check_fused_layer_device(x.device.index)


def moe_experts(
    experts: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The experts' output [T, H] for tokens [T, H] and the model's routing (ids and weights [T, k]),
    plus ``shared`` (gate [I_s, H], up [I_s, H], down [H, I_s]: a unit-weight SwiGLU expert on
    every token) when given: one ``mok::moe_forward`` (its autograd gives every weight, the tokens
    and the routing weights their gradients)."""
    check_experts(experts)
    transposed = bool(getattr(experts, "is_transposed", False))
    gate_up, down = experts.gate_up_proj, experts.down_proj
    device = hidden_states.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else gate_up.dtype  # (autocast: what a Linear gets)
    x = hidden_states.to(dtype).contiguous()
    num_tokens, hidden = x.shape
    topk = top_k_index.shape[-1]
    num_experts, inter = gate_up.shape[0], _widths(gate_up, transposed)[1]
    shared_inter = None if shared is None else shared[0].shape[0]
    widths = {"hidden": hidden, "intermediate": inter, "shared_intermediate": shared_inter}
    _check_device(x, widths)
    options = getattr(experts, OPTIONS_ATTR, ())
    interleaved = not getattr(experts, "is_concatenated", True)
    layout = gate_up_layout(experts, dict(options))
    joined_grad = layout != "separate"
    model_options = {"gate_up_layout": layout if joined_grad else None, "activation": activation_of(experts),
                     "expert_bias": _has_biases(experts)}
    options = tuple(sorted((*options, *((k, v) for k, v in model_options.items() if v not in (None, "swiglu", False)))))
    config = _config_text(hidden, inter, num_experts, topk, shared_inter, options)
    idx = top_k_index.reshape(num_tokens, topk).to(torch.int32).contiguous()
    weights = top_k_weights.reshape(num_tokens, topk).to(torch.float32).contiguous()
    sg, su, sd = shared if shared is not None else (None, None, None)
    biases = (experts.gate_up_proj_bias, experts.down_proj_bias) if _has_biases(experts) else (None, None)
    save = torch.is_grad_enabled() and any(t.requires_grad for t in (x, weights, gate_up, down, *(shared or ()), *(b for b in biases if b is not None)))
    out = _Experts.apply(x, idx, weights, gate_up, down, sg, su, sd, *biases, (transposed, interleaved), config, save, dtype, joined_grad)
    return out.to(hidden_states.dtype)


def mok_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The ``"mok"`` entry of transformers' ExpertsInterface: an experts module's forward
    (tokens [T, H], the router's top-k ids [T, k] and weights [T, k]) on MoK."""
    return moe_experts(self, hidden_states, top_k_index, top_k_weights)


def register() -> None:
    """Register ``"mok"`` in transformers' ExpertsInterface (done on import; idempotent)."""
    _hf_moe.ExpertsInterface.register(BACKEND, mok_experts_forward)


register()


# ----- shared experts in MoK's launches (DeepSeek-V3)


def _plain_swiglu_mlp(mlp: nn.Module) -> bool:
    """A bias-free SwiGLU MLP (gate_proj, up_proj, down_proj nn.Linear, silu) computed by its own
    class's forward, nothing hooked: MoK's shared expert computes exactly that."""
    linears = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(type(m) is nn.Linear and m.bias is None and not (m._forward_hooks or m._forward_pre_hooks) for m in linears):
        return False
    if mlp._forward_hooks or mlp._forward_pre_hooks or "forward" in mlp.__dict__ or not _is_silu(getattr(mlp, "act_fn", None)):
        return False
    return type(mlp).__name__.endswith("MLP")


def _shared_weights(mlp: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight


def _fused_forward(base: type, router: str, experts_attr: str, shared_attr: str):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        experts, mlp = getattr(self, experts_attr), getattr(self, shared_attr)
        if getattr(experts.config, "_experts_implementation", None) != BACKEND or not _plain_swiglu_mlp(mlp):
            return base.forward(self, hidden_states)  # (switched back to another backend, or the MLP was changed)
        shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, shape[-1])
        _, topk_weights, topk_indices = getattr(self, router)(tokens)
        return moe_experts(experts, tokens, topk_indices, topk_weights, shared=_shared_weights(mlp)).view(shape)

    forward.__doc__ = f"{base.__name__}.forward with the routed and the shared experts in one MoK op (mok.integrations.transformers.apply)"
    return forward


def _fused_block_class(name: str) -> type:
    """``MoK<Block>``: the MoE block class whose forward runs its shared expert inside MoK's op; a
    subclass adding nothing but the forward (the same parameters, names and state_dict), defined in
    this module so that pickling a model finds it."""
    fused_name = f"MoK{name}"
    cls = globals().get(fused_name)
    if cls is None:
        module, router, experts_attr, shared_attr = _SHARED_BLOCKS[name]
        base = getattr(importlib.import_module(module), name)
        cls = type(fused_name, (base,), {"forward": _fused_forward(base, router, experts_attr, shared_attr), "__module__": __name__})
        cls.__qualname__ = fused_name
        globals()[fused_name] = cls
    return cls


def __getattr__(name: str):
    """``MoK<Block>`` classes on demand (unpickling a model :func:`apply` changed, in a new process)."""
    if name.startswith("MoK") and name[3:] in _SHARED_BLOCKS:
        return _fused_block_class(name[3:])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----- the model


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every experts module transformers runs through its ExpertsInterface."""
    return [
        (name, m) for name, m in model.named_modules()
        if all(hasattr(m, flag) for flag in ("has_gate", "has_bias", "is_transposed", "is_concatenated")) and hasattr(m, "config")
    ]


_MOE_NAME = re.compile(r"Experts|Sparse(MLP|Mo[Ee])|Mo[Ee](Block|Layer)?$")  # (DbrxExperts, JetMoeMoE, ...; not NllbMoeModel)


def _moe_outside_interface(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """MoE modules that do not run through the ExpertsInterface (their experts a ModuleList or
    ModuleDict of per-expert MLPs, or a class of their own), the experts themselves first."""
    found = [
        (name, m) for name, m in model.named_modules()
        if name and (_MOE_NAME.search(type(m).__name__) or isinstance(getattr(m, "experts", None), (nn.ModuleList, nn.ModuleDict)))
    ]
    return sorted(found, key=lambda nm: "Experts" not in type(nm[1]).__name__)


def gate_up_layout(experts: nn.Module, options: dict) -> str:
    """The gate_up_layout MoK's op gets for ``experts`` under the layer ``options``: in bf16 the
    parts of gate_up_proj's [E, 2I, H] rows, read in place and given one gradient ("concatenated",
    or "interleaved" where gate and up alternate, gpt-oss's); "separate" copies otherwise (the
    other precisions quantize the weights anyway)."""
    if options.get("precision", "bf16") != "bf16":
        return "separate"
    return "concatenated" if getattr(experts, "is_concatenated", True) else "interleaved"


def layer_options(experts: nn.Module, **options) -> tuple:
    """``options`` (names of LAYER_OPTIONS) checked against this experts module's shapes as
    MoKConfig checks them (ValueError naming the option and what it takes), as the (name, value)
    pairs that differ from the defaults."""
    unknown = sorted(set(options) - set(LAYER_OPTIONS))
    if unknown:
        raise TypeError(f"MoK experts backend: unknown layer option(s) {unknown}; expected some of {sorted(LAYER_OPTIONS)}")
    transposed = bool(getattr(experts, "is_transposed", False))
    gate_up = experts.gate_up_proj
    hidden, inter = _widths(gate_up, transposed)
    topk = min(getattr(experts.config, "num_experts_per_tok", 1), gate_up.shape[0])
    MoKConfig(hidden, inter, gate_up.shape[0], topk, activation=activation_of(experts), expert_bias=_has_biases(experts),
              gate_up_layout=gate_up_layout(experts, options), **options)
    return tuple(sorted((k, v) for k, v in options.items() if v != LAYER_OPTIONS[k]))


def apply(
    model: nn.Module, *, fuse_shared_experts: bool = True, saved_h_format: str = "bf16", one_launch: bool = False,
    precision: str = "bf16", fp8_scales: str = "fp32", wgrad_format: str | None = None,
) -> nn.Module:
    """Run ``model``'s experts on MoK: check every experts module (UnsupportedModelError, naming the
    module, what MoK lacks for it and the supported families, before anything changes), switch the
    model to ``experts_implementation="mok"``, and with ``fuse_shared_experts`` run DeepSeek-V3's
    shared experts inside MoK's op too (the blocks' class becomes ``MoK<Block>``, a subclass with
    only its forward changed: parameters, names, state_dict and save_pretrained stay the same).
    ``saved_h_format``, ``one_launch``, ``precision``, ``fp8_scales`` and ``wgrad_format`` are
    MoKConfig's (mok.MoKConfig says what each does; e.g. ``saved_h_format="recompute"`` keeps no
    expert activations between forward and backward, ``precision="fp8_block",
    wgrad_format="fp8_block"`` trains the experts in DeepSeek-V3's FP8 on Hopper), checked against every experts module's shapes before anything changes and kept on
    each as its ``mok_options`` attribute (not a parameter or buffer: the state_dict is unchanged).
    Transposed experts weights (gpt-oss's) are stored transposed in memory once (:func:`store_for_mok`:
    the same tensors, read in place by MoK's kernels instead of copied on every call). Returns
    ``model``. ``model.set_experts_implementation(...)`` switches back."""
    register()
    found = experts_modules(model)
    if not found:
        outside = _moe_outside_interface(model)
        if outside:
            name, block = outside[0]
            raise UnsupportedModelError(
                f"MoK: {type(model).__name__} runs its experts outside transformers' ExpertsInterface ({name!r}: "
                f"{type(block).__name__}), the hook MoK's backend uses; its family is not covered. {_what_mok_runs()}"
            )
        raise UnsupportedModelError(
            f"MoK: {type(model).__name__} has no MoE experts (no module runs through transformers' ExpertsInterface, "
            f"transformers.integrations.moe). {_what_mok_runs()}"
        )
    options = {"saved_h_format": saved_h_format, "one_launch": one_launch, "precision": precision, "fp8_scales": fp8_scales,
               "wgrad_format": wgrad_format}
    for name, experts in found:
        check_experts(experts, name)
    chosen = [layer_options(experts, **options) for _, experts in found]
    untested = sorted({type(e).__name__ for _, e in found} - set(SUPPORTED_FAMILIES))
    if untested:
        warnings.warn(
            f"MoK: {', '.join(untested)} declare transformers' experts layout MoK runs (SwiGLU, no biases) but are not among the "
            f"families tested with MoK ({_families()}); compare a few steps against experts_implementation='grouped_mm'",
            stacklevel=2,
        )
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(BACKEND)
    for (_, experts), pairs in zip(found, chosen):
        setattr(experts, OPTIONS_ATTR, pairs)
        store_for_mok(experts)
    for _, experts in found:  # (a submodel transformers does not switch: its config directly)
        if experts.config._experts_implementation != BACKEND:
            experts.config._experts_implementation_internal = BACKEND
    if fuse_shared_experts:
        for _, block in model.named_modules():
            name = type(block).__name__
            if name in _SHARED_BLOCKS and _plain_swiglu_mlp(getattr(block, _SHARED_BLOCKS[name][3])):
                block.__class__ = _fused_block_class(name)
    return model


def describe(model: nn.Module) -> list[dict]:
    """One entry per experts module: its name, class, family, whether MoK runs it (and why not),
    which parameters every call copies, whether its shared expert runs inside MoK's op, and the
    layer options :func:`apply` gave it."""
    fused = {name for name, m in model.named_modules() if type(m).__name__.startswith("MoK") and type(m).__name__[3:] in _SHARED_BLOCKS}
    out = []
    for name, experts in experts_modules(model):
        cls = type(experts).__name__
        problems = _layout_problems(experts)
        out.append({
            "module": name,
            "class": cls,
            "family": SUPPORTED_FAMILIES.get(cls) or _KNOWN_UNSUPPORTED.get(cls),
            "runs_on_mok": not problems,
            "problems": problems,
            "copied_per_call": copied_weights(experts) if not problems else (),
            "shared_expert_in_mok": name.rpartition(".")[0] in fused,
            "options": dict(getattr(experts, OPTIONS_ATTR, ())),
        })
    return out
