"""The MoE layer's forward: the stages composed as the plan says.

    schedule     routing -> expert-grouped row slots (device_schedule; no host sync)
    rows in      one GPU: the gate/up GEMM's producer gathers x[row_token] itself (bf16 on Hopper), or
                 the rows are gathered first (fp8_block: as they are quantized); EP: publish x and the routing, gather every rank's
                 routing, schedule this rank's experts over it, pull each row from its token's owner
    gate/up      a = silu(rows·W_gateᵀ) ⊙ rows·W_upᵀ (h = [rows·W_gateᵀ | rows·W_upᵀ] kept for the backward)
    down         y = a·W_downᵀ; EP: each y row pushed straight into its token's slot on the token's rank
    shared       the shared expert over x (launches of its own, or as expert E in the routed launches,
                 its rows first, where its weights lie after the routed experts')
    combine      out[t] = shared[t] + Σ_j w[t, j]·y[t, j] in fp32, j in order; EP: after every rank pushed

With ``one_launch`` every stage but the shared expert's (when it runs on its own) is ONE persistent
launch, at one GPU or per rank at EP > 1: the same operations in the same order, the same bits.
Every kernel's configuration depends on static shapes only, so a token's output does not depend
on the rest of the batch, and at EP > 1 it is the single-GPU forward's of the concatenated batch,
bit for bit. Saved for the backward: h (unless saved_h_format="recompute": then the backward runs
the gate/up GEMM again), the schedule (and at EP > 1 the pulled rows and every rank's routing),
never a or y.
"""

from __future__ import annotations

import torch

from .. import ops
from ..config import MoKConfig
from ..ops.common import check_32bit_rows
from ..plan import Plan
from ..runtime import launch
from ..schedule import shared_prefix_rows, worst_case_capacity
from ..validation import check_gate_up_parts, check_index_range, check_moe_inputs, check_tensor, check_timeout
from . import exchange, stages
from .stages import TILE_M, ForwardResult
from .workspace import EPWorkspace


def check_inputs(config: MoKConfig, workspace, x, topk_idx, topk_w, weights, shared, *, check_routing: bool = False,
                 biases: tuple | None = None) -> tuple:
    """Check one call's tensors against each other, the configuration and (EP) the workspace;
    returns (T, H, I, E_local, k). ``check_routing`` also range-checks the expert ids (one host read).
    On any device (the device itself: :func:`check_on_gpu`), so that what is wrong is named first."""
    c = config
    if not isinstance(weights, (tuple, list)) or len(weights) != 3:
        raise TypeError(f"weights: expected (w_gate, w_up, w_down), got {type(weights).__name__}")
    num_tokens, hidden, inter, num_local, topk = check_moe_inputs(
        x, topk_idx, topk_w, *weights, shared, dtypes=(torch.bfloat16,), router_dtypes=(torch.float32,), contiguous=True,
        experts_total=c.num_experts, check_range=False,
    )
    if c.gate_up_joined:
        check_gate_up_parts(weights[0], weights[1], c.gate_up_layout)
    got = dict(hidden=hidden, intermediate=inter, experts_per_rank=num_local, topk=topk,
               shared_intermediate=None if shared is None else shared[0].shape[0])
    for field, value in got.items():
        if getattr(c, field) != value:
            raise ValueError(f"{field}: the config says {getattr(c, field)}, the tensors have {value}")
    if c.ep_size > 1:
        check_workspace(c, workspace, x)
        if num_tokens > workspace.layout.max_tokens:
            raise ValueError(f"x: expected at most the workspace's max_tokens={workspace.layout.max_tokens} tokens, got {num_tokens}")
    elif workspace is not None:
        raise ValueError(f"workspace: expected None at ep_size 1, got {type(workspace).__name__}")
    check_biases(c, biases, num_local, x)
    if check_routing:
        check_index_range("topk_idx", topk_idx, c.num_experts)
    return num_tokens, hidden, inter, num_local, topk


def check_biases(config: MoKConfig, biases, num_local: int, x: torch.Tensor) -> None:
    """The routed experts' biases (b_gate, b_up [E_local, I], b_down [E_local, H], x's dtype and
    device, contiguous): given exactly when the config's expert_bias."""
    config.check_biases_given(biases is not None)
    if biases is None:
        return
    if not isinstance(biases, (tuple, list)) or len(biases) != 3:
        raise TypeError(f"biases: expected (b_gate, b_up, b_down), got {type(biases).__name__}")
    widths = (config.intermediate, config.intermediate, config.hidden)
    for name, b, width in zip(("b_gate", "b_up", "b_down"), biases, widths):
        check_tensor(name, b, dtypes=(x.dtype,), shape=(num_local, width), device=x.device, contiguous=True)


def check_on_gpu(x: torch.Tensor) -> None:
    """The pipelines launch on x's device: a CUDA one (checked after the tensors' own checks)."""
    if x.device.type != "cuda":
        raise ValueError(f"x: expected a CUDA tensor, got one on {x.device}")


def check_workspace(config: MoKConfig, ws, x: torch.Tensor) -> None:
    """An expert-parallel call's workspace: this configuration's layout, on x's device, still open."""
    c = config
    if not isinstance(ws, EPWorkspace) or ws.layout.world != c.ep_size:
        raise ValueError(f"workspace: expected get_workspace(config, group, max_tokens=...) for ep_size {c.ep_size}, got {type(ws).__name__}")
    if (ws.layout.hidden, ws.layout.topk) != (c.hidden, c.topk):
        raise ValueError(f"workspace: expected a layout for H={c.hidden}, k={c.topk}, got H={ws.layout.hidden}, k={ws.layout.topk}")
    if x.device != ws.buffer.device:
        raise ValueError(f"x: expected a tensor on the workspace's device {ws.buffer.device}, got one on {x.device}")
    if x.data_ptr() % 16:  # (published with 16-byte vectors)
        raise ValueError(f"x: expected a 16-byte aligned data pointer, got address {x.data_ptr():#x}")
    if ws.closed:
        raise RuntimeError(
            "workspace: its symmetric memory was closed (close()); build a new one (mok.get_workspace; a MoELayer does so on "
            "its next eager call, or, compiled, on layer.workspace())"
        )


def forward(
    plan: Plan,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    weights: tuple,
    shared: tuple | None = None,
    *,
    workspace: EPWorkspace | None = None,
    save: bool = False,
    out: torch.Tensor | None = None,
    shared_in_routed: bool | None = None,
    check_routing: bool = True,
    timeout_s: float = 5.0,
    biases: tuple | None = None,
) -> ForwardResult:
    """The layer's output [T, H] bf16 (module docstring) and, with ``save``, what the backward needs.

    x [T, H] bf16; topk_idx [T, k] int32/int64 global expert ids; topk_w [T, k] fp32; ``weights`` =
    (w_gate, w_up [E_local, I, H], w_down [E_local, H, I]) bf16; ``shared``: None or (gate [I_s, H],
    up [I_s, H], down [H, I_s]). ``workspace``: the expert-parallel workspace (EP > 1; every rank
    makes the same sequence of calls, each ordered after the previous on the GPU; at most
    max_tokens tokens per rank). ``out``: an optional [T, H] bf16 destination (one GPU).
    ``shared_in_routed``: None (default), the shared expert runs in the routed launches where the
    plan allows it and its weights lie right after the routed experts' (mok.MoELayer's layout);
    True: always where the plan allows it (other weights are copied together per call); False:
    never. ``check_routing`` range-checks the ids (one host read; pass False inside CUDA-graph
    capture). ``timeout_s`` (EP) bounds every wait on a peer. ``biases`` (b_gate, b_up [E_local, I],
    b_down [E_local, H]) bf16: exactly when the config's expert_bias.
    """
    num_tokens, hidden, inter, num_local, topk = check_inputs(plan.config, workspace, x, topk_idx, topk_w, weights, shared,
                                                              check_routing=check_routing, biases=biases)
    check_on_gpu(x)
    topk_idx = topk_idx.to(torch.int32).contiguous()
    if plan.ep:
        if out is not None:
            raise ValueError("out: not at EP > 1 (the output is the combine of this rank's slots)")
        check_timeout(timeout_s)
        return _ep_forward(plan, workspace, x, topk_idx, topk_w, weights, shared, save, timeout_s, biases)
    stacked = _stacked_weights(plan, weights, shared, shared_in_routed)
    capacity = worst_case_capacity(num_tokens, topk, num_local, TILE_M)
    prefix = shared_prefix_rows(num_tokens, TILE_M) if stacked is not None else 0
    # (refused before any launch: the expert rows' buffers, h [rows, 2I], a [rows, I], y [rows, H], are 32-bit indexed)
    check_32bit_rows("the expert rows (h, a, y)", prefix + capacity, max(hidden, (2 if save else 1) * inter))
    keep_h = keeps_h(plan, save)
    h = torch.empty(prefix + capacity, 2 * inter, dtype=x.dtype, device=x.device) if keep_h else None
    shared_h = None
    if stacked is not None:
        shared_h = None if h is None else h[:num_tokens]
    elif keep_h and shared is not None:
        shared_h = torch.empty(num_tokens, 2 * shared[0].shape[0], dtype=x.dtype, device=x.device)
    if plan.one_launch:
        shared_out = None if shared is None or stacked is not None else stages.shared_expert_forward(plan, x, shared, shared_h)
        launch_weights = stacked if stacked is not None else weights
        out, sched = ops.scheduled_expert_mlp(
            x, topk_idx, topk_w, *launch_weights, h_out=h, shared_out=shared_out, out=out, shared_in_routed=stacked is not None,
            activation=plan.activation, biases=biases,
        )
        return ForwardResult(out, sched, h, shared_h)
    sched = ops.device_schedule(topk_idx, num_local, block_m=TILE_M, capacity=capacity, shared_prefix=stacked is not None)
    expert_weights = stages.routed_weights(plan, weights, stacked)
    a = stages.gate_up_from_tokens(plan, x, sched, expert_weights, h, biases)
    shared_out = None if shared is None or stacked is not None else stages.shared_expert_forward(plan, x, shared, shared_h)
    y_rows = stages.down(plan, a, sched, expert_weights, biases)
    if stacked is not None:
        shared_out = y_rows[:num_tokens]  # (the shared expert's rows lead the buffer)
    out = ops.combine(y_rows, topk_w, shared_out, slot_row=sched.slot_row, out=out)
    return ForwardResult(out, sched, h, shared_h)


def keeps_h(plan: Plan, save: bool) -> bool:
    """Whether a forward keeps h for its backward: when saving, unless the backward recomputes it."""
    return save and not plan.config.recomputes_h


def _stacked_weights(plan: Plan, weights: tuple, shared: tuple | None, shared_in_routed: bool | None) -> tuple | None:
    """The [E + 1, ...] weights when the shared expert runs in the routed launches (see forward), else None."""
    if shared_in_routed is None:
        return stages.shared_expert_as_last(*weights, shared) if plan.shared_in_routed else None
    if not shared_in_routed:
        return None
    if shared is None or not plan.shared_in_routed:
        raise ValueError(
            "shared_in_routed: needs a shared expert of the routed experts' shapes, bf16 precision and one GPU, got "
            f"{'no shared expert' if shared is None else f'shared I_s={shared[0].shape[0]}'} with I={plan.config.intermediate}, "
            f"precision={plan.config.precision!r}, ep_size={plan.config.ep_size}"
        )
    return stages.stacked_weights(*weights, shared)


def _ep_forward(plan: Plan, ws: EPWorkspace, x, topk_idx, topk_w, weights, shared, save: bool, timeout_s: float,
                biases: tuple | None) -> ForwardResult:
    """This rank's forward over the workspace: its tokens' output, and with ``save`` the schedule of its
    experts over every rank's tokens, the rows it pulled, h and every rank's routing."""
    c, dev = plan.config, x.device
    num_tokens, num_local, inter = x.shape[0], weights[0].shape[0], weights[0].shape[1]
    ws.raise_pending()
    keep_h = keeps_h(plan, save)
    if plan.one_launch:
        h = torch.empty(ws.expert_rows(num_local, TILE_M), 2 * inter, dtype=x.dtype, device=dev) if keep_h else None
        shared_h = torch.empty(num_tokens, 2 * shared[0].shape[0], dtype=x.dtype, device=dev) if keep_h and shared is not None else None
        shared_out = None if shared is None else stages.shared_expert_forward(plan, x, shared, shared_h)
        out, sched, routing, x_all = exchange.one_launch_forward(
            ws, x, topk_idx, topk_w, weights, shared_out, h, timeout_s=timeout_s, dispatch_format=c.dispatch_format,
            activation=plan.activation, biases=biases,
        )
        x_rows = ops.gather_rows(x_all, sched.row_token) if save else None  # the backward's rows (training only)
        ws.copy_record()
        return ForwardResult(out, sched, h, shared_h, x_rows, routing)
    kernels = exchange.exchange_kernels(ws, dev, c.dispatch_format, c.fp8_power_of_two, plan.fp8_scale_order)
    stream = launch.stream(dev)
    exchange.publish(ws, kernels, ("x", x), ("idx", topk_idx), stream, rows_format=c.dispatch_format, power_of_two=c.fp8_power_of_two)
    routing = exchange.gather_ranks(ws, kernels, "idx", timeout_s, stream)  # every rank's routing -> this rank's schedule -> pull
    sched = ops.device_schedule(routing, c.num_experts, rank=ws.rank, world_size=c.ep_size, capacity=ws.capacity)
    h = torch.empty(sched.capacity, 2 * inter, dtype=x.dtype, device=dev) if keep_h else None
    shared_h = torch.empty(num_tokens, 2 * shared[0].shape[0], dtype=x.dtype, device=dev) if keep_h and shared is not None else None
    x_rows = exchange.pull_rows(ws, kernels, "x", sched, stream, rows_format=c.dispatch_format,  # (fp8_block: FP8 rows, kept so)
                                scale_order=plan.fp8_scale_order)
    expert_weights = stages.routed_weights(plan, weights, None)
    a = stages.gate_up(plan, x_rows, sched, expert_weights, h, gather=False, biases=biases)
    down_bias = {} if biases is None else dict(bias=biases[2])
    # each y row straight into its token's slot on the token's rank
    exchange.push_rows(ws, *stages.down_operands(plan, a, sched, expert_weights), sched, **down_bias, **plan.pairs)
    exchange.announce_pushed(ws, kernels, sched, routing, stream, gradient=False)
    shared_out = None if shared is None else stages.shared_expert_forward(plan, x, shared, shared_h)  # (overlaps the peers' pushes)
    exchange.wait_pushed(ws, kernels, timeout_s, stream)
    out = ops.combine(exchange.own_slots(ws, num_tokens), topk_w, shared_out)
    ws.copy_record()
    return ForwardResult(out, sched, h, shared_h, x_rows, routing)


def x_rows_shape(config, num_rows: int) -> tuple[int, int]:
    """The shape of the rows an EP forward keeps for the backward: [R, H] bf16, or with
    dispatch_format="fp8_block" the FP8 rows as they crossed (stages.packed_fp8_rows, uint8)."""
    if config.dispatch_format == "fp8_block":
        return num_rows, stages.packed_fp8_width(config.hidden)
    return num_rows, config.hidden


def check_saved(name: str, saved, plan: Plan, num_tokens: int, topk: int, num_local: int, device, workspace=None):
    """``saved`` is a forward of this call's shapes (EP: on this workspace) that kept h: its schedule
    this rank's experts over the call's pairs, and at EP > 1 its pulled rows and routing sized by it."""
    from ..schedule import check_schedule

    if not isinstance(saved, ForwardResult):
        raise TypeError(f"{name}: expected the ForwardResult of a forward with save=True, got {type(saved).__name__}")
    if saved.h is None and not plan.config.recomputes_h:
        raise ValueError(f"{name}: the forward did not keep h; call it with save=True")
    pairs = workspace.layout.world * workspace.layout.max_tokens if plan.ep else num_tokens
    sched = check_schedule(f"{name}.schedule", saved.schedule, num_tokens=pairs, topk=topk, num_experts=num_local, device=device)
    if plan.ep:
        if saved.out is not None:  # (an op's backward rebuilds the result without it)
            check_tensor(f"{name}.out", saved.out, shape=(num_tokens, plan.config.hidden), device=device)
        rows = x_rows_shape(plan.config, sched.capacity)
        dtype = torch.uint8 if plan.config.dispatch_format == "fp8_block" else torch.bfloat16  # (FP8 rows as they crossed, packed)
        check_tensor(f"{name}.x_rows", saved.x_rows, dtypes=(dtype,), shape=rows, device=device, contiguous=True)
        check_tensor(f"{name}.routing", saved.routing, dtypes=(torch.int32,), shape=(pairs, topk), device=device)
    return sched
