"""The functional API: a static :class:`MoKConfig`, a workspace, ``forward`` and ``backward``.

    config = MoKConfig(hidden=H, intermediate=I, num_experts=E, topk=k)
    ws = get_workspace(config)                        # None at EP = 1: nothing to share (create_workspace: uncached)
    out, ctx = forward(config, ws, x, topk_idx, topk_w, w_gate, w_up, w_down)
    grads = backward(config, ws, ctx, dout)           # mok.reference_backward.Gradients

Both check the tensors against the config and raise before any launch. For autograd and
torch.compile use :class:`mok.MoELayer` or the custom op ``torch.ops.mok.moe_forward``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import MoKConfig
from .fused_forward import ForwardResult, moe_forward
from .reference import SharedExpert
from .reference_backward import Gradients
from .validation import check_moe_inputs


@dataclass
class LayerContext:
    """What ``backward`` needs from ``forward``: its inputs and the saved activations."""

    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_w: torch.Tensor
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    shared: SharedExpert | tuple | None
    saved: ForwardResult


def get_workspace(config: MoKConfig, group: "torch.distributed.ProcessGroup | None" = None):
    """The communication workspace for ``config`` on ``group``, built once and reused (None at EP = 1)."""
    return create_workspace(config, group)  # (nothing to cache until the expert-parallel path exists)


def create_workspace(config: MoKConfig, group: "torch.distributed.ProcessGroup | None" = None):
    """A new communication workspace for ``config`` on ``group`` (None at EP = 1, where none is needed)."""
    ranks = 1 if group is None else torch.distributed.get_world_size(group)
    if ranks != config.ep_size:
        raise ValueError(f"group: expected {config.ep_size} ranks (config.ep_size), got {ranks}")
    if config.ep_size > 1:
        raise NotImplementedError(
            "the fused expert-parallel forward is not built yet; use mok.MoELayer(group=...), which runs the "
            "reference expert-parallel path meanwhile"
        )
    return None


def _check_config(config: MoKConfig, workspace, x, topk_idx, topk_w, w_gate, w_up, w_down, shared) -> None:
    if not isinstance(config, MoKConfig):
        raise TypeError(f"config: expected a MoKConfig, got {type(config).__name__}")
    if config.ep_size > 1 or workspace is not None:
        raise NotImplementedError("the fused expert-parallel path is not built yet: ep_size must be 1 and workspace None")
    num_tokens, hidden, inter, num_local, topk = check_moe_inputs(
        x, topk_idx, topk_w, w_gate, w_up, w_down, shared, check_range=False
    )
    got = dict(hidden=hidden, intermediate=inter, num_experts=num_local, topk=topk)
    got["shared_intermediate"] = None if shared is None else shared[0].shape[0]
    for field, value in got.items():
        if getattr(config, field) != value:
            raise ValueError(f"{field}: the config says {getattr(config, field)}, the tensors have {value}")


def forward(
    config: MoKConfig,
    workspace,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    shared: SharedExpert | tuple | None = None,
    *,
    save_for_backward: bool = True,
    check_routing: bool = True,
) -> tuple[torch.Tensor, LayerContext]:
    """Layer output [T, H] bf16 and the context ``backward`` takes (see :func:`mok.forward.moe_forward`)."""
    _check_config(config, workspace, x, topk_idx, topk_w, w_gate, w_up, w_down, shared)
    res = moe_forward(
        x, topk_idx, topk_w, w_gate, w_up, w_down, shared, check_routing=check_routing, save_for_backward=save_for_backward
    )
    return res.out, LayerContext(x, topk_idx, topk_w, (w_gate, w_up, w_down), shared, res)


def backward(
    config: MoKConfig,
    workspace,
    ctx: LayerContext,
    dout: torch.Tensor,
    *,
    grad_dtype: torch.dtype = torch.bfloat16,
    main_grads: tuple | None = None,
) -> Gradients:
    """All gradients for ``dout`` [T, H] (see :func:`mok.backward.moe_backward`; ``main_grads`` accumulates)."""
    from .fused_backward import moe_backward

    if not isinstance(ctx, LayerContext):
        raise TypeError(f"ctx: expected the LayerContext that forward returned, got {type(ctx).__name__}")
    _check_config(config, workspace, ctx.x, ctx.topk_idx, ctx.topk_w, *ctx.weights, ctx.shared)
    return moe_backward(
        dout, ctx.x, ctx.topk_idx, ctx.topk_w, *ctx.weights, ctx.shared, ctx.saved, grad_dtype=grad_dtype, main_grads=main_grads
    )
