"""Every MoK op PyTorch sees: ``mok::moe_forward`` / ``mok::moe_backward``, the router's
``mok::router_logits`` / ``mok::router_logits_backward`` and ``mok::route`` / ``mok::route_backward``.

Registered with torch.library so that autograd, ``torch.compile(fullgraph=True)`` and CUDA graphs
see opaque ops with known output shapes instead of the Python that launches the kernels. One op
pair serves every plan (precision, EP, one launch, saved-h format, dispatch format): the layer's
static configuration travels as one string (:func:`config_text`), an expert-parallel workspace as
its handle (0: none). The output shapes come from one function, :func:`forward_outputs`, for the
fake and the real implementations alike; they depend on static shapes (T, H, I, I_s, E, k, the
workspace's layout and capacity) and never on the routing. Only ``mok::moe_backward`` writes into
an input: the main_grad buffers it may be given (declared mutated); every output is new.

- CUDA: MoK's pipelines (mok/pipeline/).
- CPU (one GPU's configuration, bf16 precision): the reference (mok/reference.py, fp32 math), with
  a one-time warning, so that the same model code runs in CPU tests; the same outputs.
"""

from __future__ import annotations

import functools
import json
from typing import Optional

import torch
from torch import Tensor

from . import main_grad, pipeline, router
from .config import MoKConfig
from .pipeline.forward import x_rows_shape
from .pipeline.stages import ForwardResult
from .pipeline.workspace import workspace_by_handle
from .plan import TILE, plan_for_device, shared_in_routed_possible
from .saved_h import pack_saved, saved_h_shape, up_half
from .saved_mxfp8 import pack_h
from .schedule import Schedule, build_schedule, shared_prefix_rows, worst_case_capacity
from .validation import warn_at_caller

_CPU_WARNED = False


def config_text(config: MoKConfig) -> str:
    """The configuration as the ops take it (a constant torch.compile keeps in the graph)."""
    return json.dumps(config.as_dict(), sort_keys=True)


@functools.cache
def config_of(text: str) -> MoKConfig:
    return MoKConfig(**json.loads(text))


def _warn_cpu_once() -> None:
    global _CPU_WARNED
    if not _CPU_WARNED:
        _CPU_WARNED = True
        warn_at_caller(
            "MoK: running the MoE layer on the CPU through the reference path (fp32 math, no fused "
            "kernels); put the layer and its inputs on a Hopper GPU for the fused kernels"
        )


def _shared(sg, su, sd):
    return None if sg is None else (sg, su, sd)


def _biases(config: MoKConfig, bg, bu, bd) -> tuple | None:
    """The routed experts' biases as the pipelines take them (contiguous): given exactly when ``config.expert_bias``."""
    given = bg is not None
    config.check_biases_given(given)
    if given and (bu is None or bd is None):
        raise ValueError("biases: expected the gate, up and down biases together, got some of them")
    return tuple(b.contiguous() for b in (bg, bu, bd)) if given else None


def forward_outputs(config: MoKConfig, x: Tensor, topk_idx: Tensor, workspace: int, save: bool, stacked: bool) -> dict:
    """Every output of ``mok::moe_forward`` as (shape, dtype), by name in output order: out, h,
    shared_h, x_rows, routing, then the schedule's tensors (mok.schedule.Schedule.FIELDS). h and
    shared_h are empty unless saved (and not with saved_h_format="recompute"; h is its up half with
    "recompute_gate"; shared_h also when the shared expert ran as expert E, ``stacked``: h[:T] holds
    it; outputs may not alias), x_rows and routing unless at EP > 1."""
    num_tokens, topk = topk_idx.shape
    num_local, inter, hidden = config.experts_per_rank, config.intermediate, config.hidden
    if workspace:
        ws = workspace_by_handle(workspace)
        pairs, rows = ws.layout.world * ws.layout.max_tokens, ws.expert_rows(num_local, TILE)
    else:
        pairs = num_tokens
        rows = worst_case_capacity(num_tokens, topk, num_local, TILE) + (shared_prefix_rows(num_tokens, TILE) if stacked else 0)
    shared_inter = config.shared_intermediate or 0
    h_width, h_dtype = saved_h_shape(config.saved_h_format, 2 * inter, x.dtype)
    shared_width, shared_dtype = saved_h_shape(config.saved_h_format, 2 * shared_inter, x.dtype, shared=True)
    keep_h = save and not config.recomputes_h
    own_shared_h = keep_h and config.has_shared_expert and not stacked
    return {
        "out": ((num_tokens, hidden), x.dtype),
        "h": ((rows if keep_h else 0, h_width), h_dtype),
        "shared_h": ((num_tokens if own_shared_h else 0, shared_width), shared_dtype),
        "x_rows": (x_rows_shape(config, rows if save and workspace else 0),
                   torch.uint8 if config.dispatch_format == "fp8_block" else x.dtype),  # (FP8 rows as they crossed, packed)
        "routing": ((pairs if workspace else 0, topk), torch.int32),
        **{name: (shape, torch.int32) for name, shape in zip(Schedule.FIELDS, Schedule.shapes(pairs, topk, num_local, rows, TILE))},
    }


def _empty(shape_dtype, device) -> Tensor:
    shape, dtype = shape_dtype
    return torch.empty(shape, dtype=dtype, device=device)


def _stacked(config: MoKConfig, shared_in_routed: bool) -> bool:
    """Whether this call runs the shared expert as expert E (the layout says so and the plan allows it)."""
    return shared_in_routed and shared_in_routed_possible(config)


@torch.library.custom_op("mok::moe_forward", mutates_args=(), device_types="cuda")
def moe_forward_op(
    x: Tensor, topk_idx: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
    shared_gate: Optional[Tensor], shared_up: Optional[Tensor], shared_down: Optional[Tensor],
    config: str,
    workspace: int,
    save: bool,
    shared_in_routed: bool,
    timeout_s: float,
    bias_gate: Optional[Tensor] = None, bias_up: Optional[Tensor] = None, bias_down: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out, h, shared_h, x_rows, routing, *schedule) (:func:`forward_outputs`): the layer's forward
    (mok.pipeline.forward) and what its backward needs. ``config``: :func:`config_text` of the
    layer's MoKConfig; ``workspace``: an EP workspace's handle (0 at EP = 1); ``shared_in_routed``:
    the shared expert's weights lie after the routed experts' (it then runs in their launches
    where the plan allows it); the routed experts' biases [E, I], [E, I], [E, H] exactly when the
    config's expert_bias (on a GPU: Hopper's staged bf16 kernels, mok.plan.refusal).
    Expert ids are not range-checked here (that reads the device): ``mok.MoELayer`` checks external
    routing outside graph capture and compilation."""
    cfg = config_of(config)
    biases = _biases(cfg, bias_gate, bias_up, bias_down)
    stacked = _stacked(cfg, shared_in_routed)
    res = pipeline.forward(
        plan_for_device(cfg, x.device), x, topk_idx, topk_w, (w_gate, w_up, w_down), _shared(shared_gate, shared_up, shared_down),
        workspace=workspace_by_handle(workspace) if workspace else None, save=save, shared_in_routed=stacked,
        check_routing=False, timeout_s=timeout_s, biases=biases,
    )
    if save:
        res = pack_saved(res, cfg.saved_h_format)
    shapes = forward_outputs(cfg, x, topk_idx, workspace, save, stacked)
    given = {"out": res.out, "h": res.h, "shared_h": None if stacked else res.shared_h, "x_rows": res.x_rows, "routing": res.routing}
    given |= dict(zip(Schedule.FIELDS, res.schedule.tensors()))
    return tuple(given[name] if given[name] is not None else _empty(shape, x.device) for name, shape in shapes.items())


@moe_forward_op.register_fake
def _(x, topk_idx, topk_w, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, config, workspace, save, shared_in_routed, timeout_s,
      bias_gate=None, bias_up=None, bias_down=None):
    cfg = config_of(config)
    return tuple(_empty(shape, x.device) for shape in forward_outputs(cfg, x, topk_idx, workspace, save, _stacked(cfg, shared_in_routed)).values())


@moe_forward_op.register_kernel("cpu")
def _(x, topk_idx, topk_w, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, config, workspace, save, shared_in_routed, timeout_s,
      bias_gate=None, bias_up=None, bias_down=None):
    from .reference import moe_reference

    cfg = config_of(config)
    biases = _biases(cfg, bias_gate, bias_up, bias_down)
    if workspace or cfg.precision != "bf16":
        raise NotImplementedError("mok::moe_forward on the CPU: one GPU's bf16 configuration only (the reference path)")
    _warn_cpu_once()
    stacked = _stacked(cfg, shared_in_routed)
    shared = _shared(shared_gate, shared_up, shared_down)
    shapes = forward_outputs(cfg, x, topk_idx, workspace, save, stacked)
    outs = {name: _empty(shape, x.device) for name, shape in shapes.items()}
    outs["out"] = moe_reference(x, topk_idx, topk_w, w_gate, w_up, w_down, shared, activation=cfg.activation, biases=biases).to(x.dtype)
    sched = build_schedule(topk_idx, w_gate.shape[0], block_m=TILE, shared_prefix=stacked)
    outs |= dict(zip(Schedule.FIELDS, [t.to(torch.int32) for t in sched.tensors()]))
    if save and not cfg.recomputes_h:  # what the fused gate/up GEMM saves: [x_row·w_gateᵀ | x_row·w_upᵀ] per buffer row
        h = x.new_zeros(sched.capacity, 2 * cfg.intermediate)
        rows = sched.row_token.long()
        experts = sched.tile_expert.long().repeat_interleave(TILE)
        gates, ups = [*w_gate, *([shared_gate] if stacked else [])], [*w_up, *([shared_up] if stacked else [])]
        for e, (wg, wu) in enumerate(zip(gates, ups)):
            sel = ((experts == e) & (rows >= 0)).nonzero().flatten()
            xr = x[rows[sel]].float()
            h[sel] = torch.cat([xr @ wg.float().T, xr @ wu.float().T], 1).to(x.dtype)
        outs["h"] = h
        if shared is not None and not stacked:
            xf = x.float()
            outs["shared_h"] = torch.cat([xf @ shared_gate.float().T, xf @ shared_up.float().T], 1).to(x.dtype)
        if cfg.saved_h_format == "mxfp8":  # (packed as the CUDA op packs; the reference backward recomputes h)
            outs["h"], outs["shared_h"] = (pack_h(outs[n].to(torch.bfloat16)) if outs[n].shape[0] else outs[n] for n in ("h", "shared_h"))
        if cfg.recomputes_gate:  # (the up half, as the CUDA op keeps it)
            outs["h"] = up_half(outs["h"])
    return tuple(outs.values())


@torch.library.custom_op("mok::moe_backward", mutates_args=("main_grads",), device_types="cuda")
def moe_backward_op(
    dout: Tensor,
    x: Tensor, topk_idx: Tensor, topk_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
    shared_gate: Optional[Tensor], shared_up: Optional[Tensor], shared_down: Optional[Tensor],
    saved: list[Tensor],
    config: str,
    workspace: int,
    timeout_s: float,
    main_grads: list[Tensor],
    weight_grads: bool = True,
    bias_gate: Optional[Tensor] = None, bias_up: Optional[Tensor] = None, bias_down: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, d_topk_w, d_w_gate, d_w_up, d_w_down, d_shared_gate, d_shared_up, d_shared_down,
    d_bias_gate, d_bias_up, d_bias_down) of mok.pipeline.backward, ``saved`` being the forward op's
    outputs after out. The shared expert's gradients are empty tensors when there is none, the
    biases' when there are none (the biases: as the forward op's). ``main_grads`` (one fp32 buffer
    per weight: gate, up, down[, shared gate, up, down], or none): the weight gradients are added
    into them by the weight-gradient GEMMs themselves, and come out as empty tensors (the biases'
    come out as without them: Megatron's DDP adds a bias's gradient into its main_grad).
    ``weight_grads=False`` (every expert weight frozen): none computed, all nine empty. With
    gate_up_layout "concatenated" (or "interleaved") d_w_gate is [dW_gate; dW_up] per expert (or
    the two interleaved row by row) as one [E, 2I, H] tensor and d_w_up empty."""
    cfg = config_of(config)
    biases = _biases(cfg, bias_gate, bias_up, bias_down)
    ws = workspace_by_handle(workspace) if workspace else None
    h, shared_h, x_rows, routing, *schedule = saved
    shared = _shared(shared_gate, shared_up, shared_down)
    if ws is None:
        routed_rows = worst_case_capacity(x.shape[0], topk_idx.shape[1], cfg.experts_per_rank, TILE)
        sched = Schedule.of_tensors(schedule, TILE, shared_rows=schedule[2].shape[0] - routed_rows)
    else:
        sched = Schedule.of_tensors(schedule, TILE, world_size=ws.layout.world)
    if cfg.recomputes_h:  # (none kept: the backward computes them again)
        h = shared_h = None
    res = ForwardResult(None, sched, h, shared_h if shared is not None else None, x_rows if ws is not None else None,
                        routing if ws is not None else None)
    g = pipeline.backward(
        plan_for_device(cfg, x.device), dout.contiguous(), x, topk_idx, topk_w, (w_gate, w_up, w_down), shared, res, workspace=ws,
        grad_dtype=w_gate.dtype, main_grads=tuple(main_grads) or None, weight_grads=weight_grads, timeout_s=timeout_s, biases=biases,
    )
    return g.dx, g.d_topk_w, *_weight_grads_out(g, x, len(main_grads) > 0)


def _weight_grads_out(g, x: Tensor, added: bool) -> list[Tensor]:
    """The nine weight-gradient outputs (routed, shared, biases): empty where there is no shared
    expert or no bias, where they were not computed, and the weights' where they went into
    main_grad buffers (an output may not alias an input)."""
    if g.d_w_gate is None:
        return [x.new_empty(0) for _ in range(9)]
    biases = g.d_biases or [x.new_empty(0) for _ in range(3)]
    if added:
        return [x.new_empty(0) for _ in range(6)] + list(biases)
    shared = g.d_shared or [x.new_empty(0) for _ in range(3)]
    return [g.d_w_gate, x.new_empty(0) if g.d_w_up is None else g.d_w_up, g.d_w_down, *shared, *biases]


@moe_backward_op.register_fake
def _(dout, x, topk_idx, topk_w, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, saved, config, workspace, timeout_s, main_grads,
      weight_grads=True, bias_gate=None, bias_up=None, bias_down=None):
    added = len(main_grads) > 0 or not weight_grads
    params = (w_gate, w_up, w_down, shared_gate, shared_up, shared_down)
    grads = [x.new_empty(0) if w is None or added else w.new_empty(w.shape) for w in params]
    grads += [x.new_empty(0) if b is None or not weight_grads else b.new_empty(b.shape) for b in (bias_gate, bias_up, bias_down)]
    if config_of(config).gate_up_joined and not added:
        experts, inter, hidden = w_gate.shape
        grads[:2] = [w_gate.new_empty(experts, 2 * inter, hidden), x.new_empty(0)]
    return torch.empty_like(x), torch.empty_like(topk_w), *grads


@moe_backward_op.register_kernel("cpu")
def _(dout, x, topk_idx, topk_w, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, saved, config, workspace, timeout_s, main_grads,
      weight_grads=True, bias_gate=None, bias_up=None, bias_down=None):
    from .reference_backward import moe_backward_reference

    _warn_cpu_once()
    cfg = config_of(config)
    shared, biases = _shared(shared_gate, shared_up, shared_down), _biases(cfg, bias_gate, bias_up, bias_down)
    g = moe_backward_reference(x, topk_idx, topk_w, w_gate, w_up, w_down, shared, dout, activation=cfg.activation, biases=biases)
    dx, d_topk_w = g.dx.to(x.dtype), g.d_topk_w.to(topk_w.dtype)

    def empty(count: int) -> list[Tensor]:  # (each output its own tensor: outputs may not alias)
        return [x.new_empty(0) for _ in range(count)]

    if not weight_grads:
        return dx, d_topk_w, *empty(9)
    grads = (g.d_w_gate, g.d_w_up, g.d_w_down, *(g.d_shared or ()))
    d_biases = empty(3) if biases is None else [grad.to(b.dtype) for grad, b in zip(g.d_biases, biases)]
    for buf, grad in zip(main_grads, grads):
        buf.add_(grad.float())
    if main_grads:
        return dx, d_topk_w, *empty(6), *d_biases
    outs = [grad.to(w.dtype) for grad, w in zip(grads, (w_gate, w_up, w_down, *(shared or ())))]
    if cfg.gate_up_joined:  # (one [E, 2I, H] gradient in the weights' layout: halves, or rows interleaved)
        joined = torch.cat(outs[:2], dim=1) if cfg.gate_up_layout == "concatenated" else torch.stack(outs[:2], dim=2).flatten(1, 2)
        outs[:2] = [joined, x.new_empty(0)]
    return dx, d_topk_w, *outs, *empty(6 - len(outs)), *d_biases


BIAS_INPUTS = slice(14, 17)  # mok::moe_forward's bias_gate, bias_up, bias_down


def _setup_context(ctx, inputs, output):
    (x, topk_idx, topk_w, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, config, workspace, save, _stacked_in,
     timeout_s) = inputs[:14]
    biases = (*inputs[BIAS_INPUTS], None, None, None)[:3]
    _, *saved = output
    ctx.saved_h, ctx.has_shared, ctx.config, ctx.workspace, ctx.timeout_s = save, shared_gate is not None, config, workspace, timeout_s
    ctx.has_biases = biases[0] is not None
    weights = (w_gate, w_up, w_down, shared_gate, shared_up, shared_down)
    ctx.params = main_grad.accumulating_weights(config_of(config).fuse_wgrad_accumulation, *weights)
    ctx.save_for_backward(x, topk_idx, topk_w, *weights, *biases, *saved)
    ctx.mark_non_differentiable(*(t for t in saved if t.is_floating_point()))  # (saved state: a gradient flowing into it would be dropped)


def _backward(ctx, d_out, *_unused):
    if not ctx.saved_h:
        raise RuntimeError("mok::moe_forward: called with save=False, so it kept nothing for the backward")
    x, topk_idx, topk_w, *rest = ctx.saved_tensors
    weights, biases, saved = rest[:6], rest[6:9], rest[9:]
    # any expert weight or bias (routed or shared); all frozen: no weight-gradient GEMM
    want = any(ctx.needs_input_grad[3:9]) or any(ctx.needs_input_grad[BIAS_INPUTS])
    mains = main_grad.main_grads_of(ctx.params) if want and ctx.params is not None else []
    dx, d_topk_w, *weight_grads = moe_backward_op(
        d_out.contiguous(), x, topk_idx, topk_w, *weights, saved, ctx.config, ctx.workspace, ctx.timeout_s, mains, want,
        *(biases if ctx.has_biases else ()),
    )
    if not want:
        grads = [None] * 9
    elif ctx.params is not None:  # (added into main_grad: what Megatron's protocol hands autograd; the biases' as they are)
        grads = main_grad.grads_after_accumulation(ctx.params)
        grads += [None] * (6 - len(grads)) + list(weight_grads[6:])
    else:
        grads = list(weight_grads)
    if not ctx.has_shared:
        grads[3:6] = [None] * 3
    if not ctx.has_biases:
        grads[6:9] = [None] * 3
    return dx, None, d_topk_w, *grads[:6], None, None, None, None, None, *grads[6:]


moe_forward_op.register_autograd(_backward, setup_context=_setup_context)


# ----- the built-in router's logits on MoK's GEMMs (mok/router.py)


@torch.library.custom_op("mok::router_logits", mutates_args=(), device_types="cuda")
def router_logits_op(x: Tensor, weight: Tensor) -> Tensor:
    """:func:`mok.router.padded_logits` as an op torch.compile sees whole."""
    return router.padded_logits(x, weight)


@router_logits_op.register_fake
def _(x: Tensor, weight: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], router.padded_experts(weight.shape[0]))


@torch.library.custom_op("mok::router_logits_backward", mutates_args=(), device_types="cuda")
def router_logits_backward_op(d_logits: Tensor, x: Tensor, weight: Tensor, want_dx: bool, want_dw: bool) -> tuple[Tensor, Tensor]:
    """:func:`mok.router.padded_logits_backward` as an op torch.compile sees whole."""
    return router.padded_logits_backward(d_logits, x, weight, want_dx, want_dw)


@router_logits_backward_op.register_fake
def _(d_logits: Tensor, x: Tensor, weight: Tensor, want_dx: bool, want_dw: bool) -> tuple[Tensor, Tensor]:
    return (x.new_empty(x.shape) if want_dx else x.new_empty(0)), (weight.new_empty(weight.shape) if want_dw else weight.new_empty(0))


def _router_setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _router_backward(ctx, d_logits: Tensor):
    x, weight = ctx.saved_tensors
    want_dx, want_dw = ctx.needs_input_grad
    if not (want_dx or want_dw):
        return None, None
    dx, d_weight = router_logits_backward_op(d_logits, x, weight, want_dx, want_dw)
    return (dx if want_dx else None), (d_weight if want_dw else None)


router_logits_op.register_autograd(_router_backward, setup_context=_router_setup_context)


def router_logits(x: Tensor, weight: Tensor) -> Tensor:
    """logits [T, E] = x [T, H] · weightᵀ (weight [E, H]) in x's dtype: on MoK's GEMMs for bf16 CUDA
    tensors (batch-invariant bits, H % 128 == 0), through the op under torch.compile and an
    autograd.Function over the same two functions eagerly (torch.library's dispatch costs several
    hundred µs of host time a call: docs/notes/router-batch-invariance.md); ``F.linear`` otherwise."""
    if not router.runs_on_mok(x, weight):
        return torch.nn.functional.linear(x, weight)
    logits = router_logits_op if torch.compiler.is_compiling() else router.EagerRouterLogits.apply
    return logits(x.contiguous(), weight.contiguous())[:, : weight.shape[0]]


# ----- the built-in router's routing (softmax, top-k, renormalised weights)


@torch.library.custom_op("mok::route", mutates_args=())
def route_op(logits: Tensor, topk: int) -> tuple[Tensor, Tensor]:
    """:func:`mok.router.route` as an op torch.compile sees whole (fused, its fp32 arithmetic would
    round otherwise: compiled steps would route with other weights than eager ones)."""
    return router.route(logits, topk)


@route_op.register_fake
def _(logits: Tensor, topk: int) -> tuple[Tensor, Tensor]:
    shape = (*logits.shape[:-1], topk)
    return logits.new_empty(shape, dtype=torch.int32), logits.new_empty(shape, dtype=torch.float32)


@torch.library.custom_op("mok::route_backward", mutates_args=())
def route_backward_op(d_weights: Tensor, logits: Tensor, topk: int) -> Tensor:
    """:func:`mok.router.route_backward` as an op."""
    return router.route_backward(d_weights, logits, topk)


@route_backward_op.register_fake
def _(d_weights: Tensor, logits: Tensor, topk: int) -> Tensor:
    return torch.empty_like(logits)


def _route_setup_context(ctx, inputs, output) -> None:
    logits, topk = inputs
    ctx.save_for_backward(logits)
    ctx.topk = topk
    ctx.mark_non_differentiable(output[0])


def _route_backward(ctx, _d_idx, d_weights: Tensor):
    (logits,) = ctx.saved_tensors
    return route_backward_op(d_weights.contiguous(), logits, ctx.topk), None


route_op.register_autograd(_route_backward, setup_context=_route_setup_context)


def route(logits: Tensor, topk: int) -> tuple[Tensor, Tensor]:
    """The built-in router's routing (:func:`mok.router.route`): through the op under torch.compile,
    so that a compiled step routes with the bits of an eager one; directly otherwise (the same
    functions; an op call costs host time)."""
    return route_op(logits, topk) if torch.compiler.is_compiling() else router.route(logits, topk)
