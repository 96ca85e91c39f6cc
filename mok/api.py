"""The functional API: a static :class:`MoKConfig`, a workspace, ``forward`` and ``backward``.

    config = MoKConfig(hidden=H, intermediate=I, num_experts=E, topk=k)
    ws = get_workspace(config)                        # None at EP = 1: nothing to share (create_workspace: uncached)
    out, ctx = forward(config, ws, x, topk_idx, topk_w, w_gate, w_up, w_down)
    grads = backward(config, ws, ctx, dout)           # mok.reference_backward.Gradients

Expert parallel (``config.ep_size`` > 1, one process per rank of ``group``):
``get_workspace(config, group, max_tokens=T_max)`` builds the symmetric workspace once (a
collective: every rank must call it), and every rank passes its own tokens (at most T_max)
and its E / ep_size experts to ``forward`` and ``backward``, in the same sequence of calls.

Both check the tensors against the config and raise before any launch. For autograd use
:class:`mok.MoELayer` (or the op ``torch.ops.mok.moe_forward``, mok/torch_ops.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import pipeline
from .config import MoKConfig
from .pipeline.forward import check_inputs
from .pipeline.stages import ForwardResult
from .plan import Plan, plan_for_device
from .reference import SharedExpert
from .reference_backward import Gradients
from .runtime.workspace import PerGroupCache
from .saved_h import pack_saved


@dataclass
class LayerContext:
    """What ``backward`` needs from ``forward``: its inputs and the saved activations."""

    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_w: torch.Tensor
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    shared: SharedExpert | tuple | None
    saved: ForwardResult
    config: MoKConfig | None = None  # (the forward's; backward refuses another)
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # the routed experts' (config.expert_bias)


_WORKSPACES = PerGroupCache()  # group -> {settings: workspace}


def get_workspace(
    config: MoKConfig,
    group: "torch.distributed.ProcessGroup | None" = None,
    *,
    max_tokens: int | None = None,
    capacity_factor: float | None = None,
):
    """The communication workspace for ``config`` on ``group``, built once and reused (None at EP = 1);
    built again (a collective, as the first time) once it was closed, e.g. after an error it recorded.
    Kept for as long as ``group`` lives: once the group is destroyed and nothing else holds it (a
    layer holds its group) or the workspace, the workspace's memory is released."""
    if group is None:  # (EP = 1: nothing to build or keep; else create_workspace says what was expected)
        return create_workspace(config, group, max_tokens=max_tokens, capacity_factor=capacity_factor)
    key = (tuple(sorted(config.as_dict().items())), max_tokens, capacity_factor)
    return _WORKSPACES.get(group, key, lambda: create_workspace(config, group, max_tokens=max_tokens, capacity_factor=capacity_factor))


def create_workspace(
    config: MoKConfig,
    group: "torch.distributed.ProcessGroup | None" = None,
    *,
    max_tokens: int | None = None,
    capacity_factor: float | None = None,
):
    """A new communication workspace for ``config`` on ``group`` (None at EP = 1, where none is needed).

    At EP > 1, a :class:`mok.pipeline.workspace.EPWorkspace` over a
    :class:`mok.runtime.workspace.SymmetricWorkspace` sized for ``max_tokens`` tokens per rank and
    call. ``capacity_factor`` bounds the expert rows each rank holds per call to that many times an
    even routing's (see :func:`mok.pipeline.workspace.capacity_rows`; None: the worst case, which never overflows); past the bound
    the pairs that did not fit come out NaN and a later call raises (the workspace's ``check()``
    at once): tokens are never dropped silently.
    Collective: every rank of ``group`` calls it with the same config (checked: ranks that
    disagree all raise).
    """
    if not isinstance(config, MoKConfig):
        raise TypeError(f"config: expected a MoKConfig, got {type(config).__name__}")
    ranks = 1 if group is None else torch.distributed.get_world_size(group)
    if ranks != config.ep_size:
        raise ValueError(f"group: expected {config.ep_size} ranks (config.ep_size), got {ranks}")
    if config.ep_size == 1:
        return None
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens: expected the most tokens one rank passes per call (a positive int), got {max_tokens!r}")
    from .pipeline.workspace import EPLayout, EPWorkspace, capacity_rows
    from .runtime.workspace import SymmetricWorkspace

    layout = EPLayout(world=config.ep_size, max_tokens=max_tokens, hidden=config.hidden, topk=config.topk)
    capacity = capacity_rows(layout, config.experts_per_rank, capacity_factor, config.block_m)
    spec = {**config.as_dict(), "max_tokens": max_tokens, "capacity_factor": capacity_factor}
    symmetric = SymmetricWorkspace(layout.stride, group, spec=spec)
    return EPWorkspace.from_symmetric(symmetric, layout, capacity=capacity)


def _check_config(config: MoKConfig) -> None:
    if not isinstance(config, MoKConfig):
        raise TypeError(f"config: expected a MoKConfig, got {type(config).__name__}")


def _plan(config: MoKConfig, workspace, x, topk_idx, topk_w, weights, shared, check_routing: bool = False, biases=None) -> Plan:
    """The plan of ``config`` on x's GPU (TypeError/ValueError for what is not a MoKConfig or a CUDA
    tensor). Off a GPU the tensors are checked first as the pipelines check them (against each other,
    the config and the workspace: mok.pipeline.forward.check_inputs), so that what is wrong with
    them is named on any device."""
    _check_config(config)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.device.type != "cuda":
        check_inputs(config, workspace, x, topk_idx, topk_w, weights, shared, check_routing=check_routing, biases=biases)
        raise ValueError(f"x: expected a CUDA tensor, got one on {x.device} (mok.MoELayer runs the reference path on the CPU)")
    return plan_for_device(config, x.device)


def forward(
    config: MoKConfig,
    workspace,
    x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
    shared: SharedExpert | tuple | None = None,
    *,
    save_for_backward: bool = True,
    check_routing: bool = True,
    timeout_s: float = 5.0,
    biases: tuple | None = None,
) -> tuple[torch.Tensor, LayerContext]:
    """Layer output [T, H] bf16 and the context ``backward`` takes (mok.pipeline.forward, as
    ``config`` says: precision, one launch, saved-h format, dispatch format; with
    ``saved_h_format="mxfp8"`` the context keeps h packed, with "recompute_gate" its up half,
    mok/saved_h.py; with "recompute" no h, the backward computes it again). ``check_routing`` range-checks the expert ids (one host read;
    pass False inside CUDA-graph capture); ``timeout_s`` (EP > 1) bounds every wait on a peer rank.
    ``biases``: the routed experts' (b_gate, b_up [E_local, I], b_down [E_local, H], e.g. an
    ExpertBiases), exactly when ``config.expert_bias``; the backward then returns their gradients."""
    biases = None if biases is None else tuple(biases)
    plan = _plan(config, workspace, x, topk_idx, topk_w, (w_gate, w_up, w_down), shared, check_routing, biases)
    res = pipeline.forward(
        plan, x, topk_idx, topk_w, (w_gate, w_up, w_down), shared, workspace=workspace, save=save_for_backward,
        check_routing=check_routing, timeout_s=timeout_s, biases=biases,
    )
    if save_for_backward:
        res = pack_saved(res, config.saved_h_format)
    return res.out, LayerContext(x, topk_idx, topk_w, (w_gate, w_up, w_down), shared, res, config, biases)


def backward(
    config: MoKConfig,
    workspace,
    ctx: LayerContext,
    dout: torch.Tensor,
    *,
    grad_dtype: torch.dtype = torch.bfloat16,
    main_grads: tuple | None = None,
    timeout_s: float = 5.0,
) -> Gradients:
    """All gradients for ``dout`` [T, H] (mok.pipeline.backward). ``main_grads`` (one fp32 buffer
    per weight) accumulates the weight gradients: given exactly when ``config.fuse_wgrad_accumulation``
    (precompile builds the accumulating kernels by it); ``config`` must be the forward's.
    With ``config.gate_up_layout="concatenated"`` d_w_gate is [dW_gate; dW_up] per expert as one
    [E, 2I, H] tensor ("interleaved": the two interleaved row by row) and d_w_up None.

    With the forward's ``biases`` their gradients come as ``d_biases`` (gate, up, down).

    At EP > 1: this rank's dx and d_topk_w, its experts' weight gradients, and the shared
    expert's over this rank's tokens (sum those over ranks, as data-parallel gradients).
    """
    if not isinstance(ctx, LayerContext):
        raise TypeError(f"ctx: expected the LayerContext that forward returned, got {type(ctx).__name__}")
    _check_config(config)
    if ctx.config is not None and ctx.config != config:
        changed = [k for k, v in config.as_dict().items() if ctx.config.as_dict()[k] != v]
        raise ValueError(f"config: not the forward's (differs in {', '.join(changed)}); pass the config forward ran with")
    if config.fuse_wgrad_accumulation != (main_grads is not None):
        raise ValueError(
            f"main_grads: config.fuse_wgrad_accumulation is {config.fuse_wgrad_accumulation}, so expected "
            f"{'one fp32 buffer per weight' if config.fuse_wgrad_accumulation else 'None'}, got "
            f"{'None' if main_grads is None else type(main_grads).__name__}"
        )
    plan = _plan(config, workspace, ctx.x, ctx.topk_idx, ctx.topk_w, ctx.weights, ctx.shared, biases=ctx.biases)
    return pipeline.backward(
        plan, dout, ctx.x, ctx.topk_idx, ctx.topk_w, ctx.weights, ctx.shared, ctx.saved, workspace=workspace, grad_dtype=grad_dtype,
        main_grads=main_grads, timeout_s=timeout_s, biases=ctx.biases,
    )
