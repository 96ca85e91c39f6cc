"""``mok.MoELayer``: a drop-in MoE MLP block (router + routed SwiGLU experts + optional shared expert).

Parameters are named as Hugging Face MoE models name them, so checkpoints map over by name:
``gate_proj``/``up_proj`` [E_local, I, H], ``down_proj`` [E_local, H, I], ``shared_gate_proj``/
``shared_up_proj`` [I_s, H], ``shared_down_proj`` [H, I_s], and the router ``router``
(``nn.Linear(H, E, bias=False)``: softmax over all E, top-k, weights renormalised over the k).
On CUDA its logits and their gradients run on MoK's GEMMs (mok/router.py), whose bits do not
depend on the token count, so a token's routing is batch- and EP-invariant as its experts' work is.

Where it runs:
- CUDA on Hopper: the op ``mok::moe_forward`` (mok/torch_ops.py: MoK's pipelines, as the
  configuration's plan says) and its backward; another GPU arch raises an error naming the
  supported ones. External expert ids are
  range-checked (one host read) except under torch.compile or CUDA-graph capture, or with
  ``layer(x, topk_idx=..., topk_w=..., check_routing=False)``.
- CPU: the same op's reference implementation (one warning), so model code runs in CPU tests.
- ``group`` with more than one rank (one process per rank): on CUDA, MoK's expert-parallel
  pipelines (the same op) over a symmetric workspace shared by every MoELayer of
  the same configuration (shapes and options), ``max_tokens`` and ``capacity_factor`` on the
  group, sized for ``max_tokens`` tokens per rank and call; the shared
  expert's and the router's weight gradients then cover this rank's tokens (sum them over
  ranks as data-parallel gradients are summed). On CPU, the reference expert-parallel path
  over torch.distributed (all_to_all, fp32 math), with a one-time warning. torch.compile and
  CUDA graphs work as at EP = 1, as long as every rank runs the same model code (the exchange
  needs every rank to make the same calls). The workspace is built at construction on a CUDA device (a
  collective), else by the first call.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import MoKConfig
from .main_grad import refuse_compiling
from .pipeline.stages import shared_expert_as_last
from .pipeline.workspace import workspace_by_handle
from .runtime.arch import check_fused_layer_device
from .torch_ops import config_text, route, router_logits  # noqa: F401 (route: the layer's routing, importable from here)
from .validation import check_capacity_factor, check_index_range, check_moe_inputs, check_tensor, check_timeout, warn_at_caller

_EP_WARNED = False


def _may_sync(x: torch.Tensor) -> bool:
    """True unless tracing for torch.compile or capturing a CUDA graph (where reading a value back is not allowed)."""
    if torch.compiler.is_compiling():
        return False
    return not (x.is_cuda and torch.cuda.is_current_stream_capturing())


def _restack_after_load(module: "MoELayer", incompatible_keys) -> None:
    """load_state_dict's post hook: the shared expert's weights back after the routed experts'."""
    module._restack_shared()


class MoELayer(nn.Module):
    """Mixture-of-Experts gated MLP (SwiGLU by default) on MoK's fused kernels. ``layer(x)`` routes with the built-in
    router; ``layer(x, topk_idx=..., topk_w=...)`` uses the given routing (topk_w then gets the
    router gradient). x: [..., H]; returns the same shape and dtype. With a ``group`` of more
    than one rank, ``max_tokens`` bounds the tokens one rank passes per call (it sizes the
    expert-parallel workspace; more raises), and ``capacity_factor`` optionally bounds the
    expert rows a rank holds per call (:func:`mok.pipeline.workspace.capacity_rows`; default None: the worst
    case). Past that bound the dropped pairs come out NaN and the layer raises at a later call,
    once the error record's copy reached the host (``layer.workspace().check()`` raises at
    once): tokens are never dropped silently. ``timeout_s`` bounds every wait on a peer (a
    rank that does not make the same call makes the others raise, naming it, instead of hang).
    ``one_launch``: the forward as one persistent kernel (:class:`mok.config.MoKConfig`), the same bits.
    ``fuse_wgrad_accumulation``: the backward adds the expert weights' gradients straight into
    their fp32 ``main_grad`` buffers (Megatron's protocol, eager mode; see mok/main_grad.py) instead
    of returning them; the router's gradient is returned as usual.
    ``saved_h_format="mxfp8"``: h, the SwiGLU inputs kept for the backward (the layer's largest
    saved activation, k·2I values per token), is kept in MXFP8 (mok/saved_mxfp8.py): 33/64 of the
    bytes, ~3-4% relative error in the expert gradients. ``saved_h_format="recompute"``: h is not
    kept; the backward runs the gate/up GEMM again (the same bits as keeping it, about a fifth more
    FLOPs a step); ``"recompute_gate"``: h's up half kept, the gate half computed again by the gate
    GEMM alone (the same bits, half of h's bytes, about a ninth more FLOPs a step; bf16).
    ``dispatch_format="mxfp8"`` (EP > 1): x crosses to the experts' ranks in MXFP8 and the routed
    experts compute on its rounding (mok/pipeline/exchange.py); ``"fp8_block"`` (with
    precision="fp8_block"): x crosses as the FP8 rows its fc1 takes (the forward's bits unchanged);
    not on the CPU reference path.
    ``precision="mxfp8"``: every routed-expert GEMM of forward and backward on MXFP8 operands (the
    weights quantized on every call; SM100 only, compile-verified, never run); ``"mxfp8_emulated"``:
    the same numerics on any GPU, the operands dequantized into the bf16 GEMMs (slower than bf16);
    ``"fp8_block"``: the expert GEMMs in FP8 with 128-block scales (DeepSeek-V3's recipe, Hopper's
    FP8 WGMMAs, the weights quantized once per version), the weight gradients in bf16 unless
    ``wgrad_format="fp8_block"`` (on FP8 too, the rows' transposes quantized with 1 x 128 blocks
    along the rows); one GPU or expert parallelism, see :class:`mok.config.MoKConfig` for what it
    does not combine with yet; ``fp8_scales="power_of_two"``: its scales powers of two (exact divisions).
    ``activation``: the experts' gated activation, "swiglu" (default), "clamped_swiglu" (gpt-oss's) or
    "geglu" (:class:`mok.config.MoKConfig`). ``bias=True``: the routed experts have biases
    (``gate_bias``, ``up_bias`` [E, I], ``down_bias`` [E, H], initialised to zero; gpt-oss's; the
    config's ``expert_bias``). ``row_tile_pairs=True``: the staged bf16 GEMMs (fp8_block: its gate/up GEMM) on clusters
    sharing each weight tile (the same bits; off by default, no faster on an H100: MoKConfig.row_tile_pairs).
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        topk: int,
        shared_intermediate: int | None = None,
        group: "torch.distributed.ProcessGroup | None" = None,
        precision: str = "bf16",
        *,
        device: "torch.device | str | None" = None,
        dtype: torch.dtype | None = None,
        max_tokens: int = 4096,
        capacity_factor: float | None = None,
        timeout_s: float = 5.0,
        one_launch: bool = False,
        fuse_wgrad_accumulation: bool = False,
        saved_h_format: str = "bf16",
        dispatch_format: str = "bf16",
        activation: str = "swiglu",
        bias: bool = False,
        fp8_scales: str = "fp32",
        wgrad_format: str | None = None,
        row_tile_pairs: bool = False,
    ) -> None:
        super().__init__()
        if device is not None and torch.device(device).type == "cuda" and not torch.cuda.is_available():
            build = "this torch build has no CUDA" if torch.version.cuda is None else "torch.cuda.is_available() is False"
            raise RuntimeError(
                f"MoELayer: device={str(device)!r}, but no CUDA GPU is visible ({build}); construct the layer on the CPU "
                "(the reference path, for tests) or run on a machine with a Hopper GPU and a CUDA build of torch"
            )
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens: expected a positive int (tokens per rank and call, EP only), got {max_tokens!r}")
        check_capacity_factor(capacity_factor)
        check_timeout(timeout_s)
        self.max_tokens, self.capacity_factor, self.timeout_s = max_tokens, capacity_factor, float(timeout_s)
        ep_size = 1
        if group is not None:
            import torch.distributed as dist

            ep_size = dist.get_world_size(group)
        self.config = MoKConfig(
            hidden, intermediate, num_experts, topk, shared_intermediate, ep_size=ep_size, precision=precision, one_launch=one_launch,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation, saved_h_format=saved_h_format, dispatch_format=dispatch_format,
            activation=activation, expert_bias=bias, fp8_scales=fp8_scales, wgrad_format=wgrad_format, row_tile_pairs=row_tile_pairs,
        )
        self.group = group if ep_size > 1 else None
        if self.group is not None:  # one collective now: ranks that disagree raise here, not hang in a later exchange
            from .runtime.workspace import agree_on_spec

            agree_on_spec({**self.config.as_dict(), "dtype": str(dtype or torch.bfloat16)}, self.group)
        local = self.config.experts_per_rank
        kw = dict(device=device, dtype=dtype or torch.bfloat16)
        shapes = ((intermediate, hidden), (intermediate, hidden), (hidden, intermediate))
        # a shared expert of the routed experts' shapes runs in their launches (single GPU, routed
        # experts without biases): its weights then sit after theirs, one buffer per projection (see _apply)
        self.shared_in_routed = shared_intermediate == intermediate and self.group is None and not bias
        if self.shared_in_routed:
            bufs = [torch.empty(local + 1, *shape, **kw) for shape in shapes]
            self.gate_proj, self.up_proj, self.down_proj = (nn.Parameter(buf[:local]) for buf in bufs)
            self.shared_gate_proj, self.shared_up_proj, self.shared_down_proj = (nn.Parameter(buf[local]) for buf in bufs)
        else:
            self.gate_proj, self.up_proj, self.down_proj = (nn.Parameter(torch.empty(local, *shape, **kw)) for shape in shapes)
            if shared_intermediate is not None:
                self.shared_gate_proj = nn.Parameter(torch.empty(shared_intermediate, hidden, **kw))
                self.shared_up_proj = nn.Parameter(torch.empty(shared_intermediate, hidden, **kw))
                self.shared_down_proj = nn.Parameter(torch.empty(hidden, shared_intermediate, **kw))
            else:
                self.register_parameter("shared_gate_proj", None)
                self.register_parameter("shared_up_proj", None)
                self.register_parameter("shared_down_proj", None)
        for name, width in (("gate_bias", intermediate), ("up_bias", intermediate), ("down_bias", hidden)):
            self.register_parameter(name, nn.Parameter(torch.empty(local, width, **kw)) if bias else None)
        self.router = nn.Linear(hidden, num_experts, bias=False, **kw)
        self.reset_parameters()
        self.register_load_state_dict_post_hook(_restack_after_load)  # (load_state_dict(..., assign=True) replaces the tensors)
        self._ep_handle = None  # the expert-parallel workspace's handle, once built (mok/torch_ops.py takes it)
        if self.group is not None and self.gate_proj.is_cuda:  # build it now: torch.compile can then trace the first call
            self.workspace()

    @property
    def config(self) -> MoKConfig:
        """The layer's static configuration; one assigned later (e.g. ``dataclasses.replace(layer.config,
        fuse_wgrad_accumulation=True)``) takes effect at the next call."""
        return self._config

    @config.setter
    def config(self, value: MoKConfig) -> None:
        self._config = value
        self._config_text = config_text(value)  # (the op's configuration argument, kept with the config it spells)

    def _apply(self, fn, *args, **kwargs):
        """nn.Module._apply (``.to()``, ``.cuda()``, ``.half()``), then the shared expert's weights put
        back after the routed experts' (the conversion gives every parameter its own storage)."""
        super()._apply(fn, *args, **kwargs)
        self._restack_shared()
        return self

    def __deepcopy__(self, memo: dict) -> "MoELayer":
        """copy.deepcopy (an EMA or reference copy of a model): parameters and buffers copied, the
        process group shared (a group cannot be copied; the copy's calls are collectives on it too)."""
        import copy

        if self.group is not None:
            memo[id(self.group)] = self.group
        return copy._reconstruct(self, memo, *self.__reduce_ex__(4))

    def __setstate__(self, state) -> None:
        """Unpickling and copy.deepcopy: the layout of the shared expert's weights restored too."""
        super().__setstate__(state)
        self._restack_shared()

    def _restack_shared(self) -> None:
        """Where the shared expert runs in the routed launches, put its weights right after the
        routed experts' again (one buffer per projection) if a conversion, a copy or an assigning
        load gave them storages of their own; else every call would copy them together."""
        if not getattr(self, "shared_in_routed", False):  # (a layer pickled by an older MoK has no such attribute)
            return
        routed, shared = (self.gate_proj, self.up_proj, self.down_proj), self.shared_weights()
        if shared_expert_as_last(*routed, shared) is None:
            with torch.no_grad():
                for r, s in zip(routed, shared):
                    buf = torch.cat([r.data, s.data[None]])
                    r.data, s.data = buf[: r.shape[0]], buf[r.shape[0]]

    def reset_parameters(self) -> None:
        """Every projection as nn.Linear initialises its weight: U(-1/√fan_in, 1/√fan_in); biases zero."""
        for weight in (self.gate_proj, self.up_proj, self.down_proj, self.shared_gate_proj, self.shared_up_proj, self.shared_down_proj):
            if weight is not None:
                bound = 1.0 / math.sqrt(weight.shape[-1])
                nn.init.uniform_(weight, -bound, bound)
        for bias in self.expert_biases() or ():
            nn.init.zeros_(bias)
        self.router.reset_parameters()

    def extra_repr(self) -> str:
        c = self.config
        extra = (f", activation={c.activation!r}" if c.activation != "swiglu" else "") + (", bias=True" if c.expert_bias else "")
        return (
            f"hidden={c.hidden}, intermediate={c.intermediate}, num_experts={c.num_experts}, topk={c.topk}, "
            f"shared_intermediate={c.shared_intermediate}, ep_size={c.ep_size}{extra}"
        )

    def workspace(self):
        """The expert-parallel workspace this layer's calls use (:class:`mok.pipeline.workspace.EPWorkspace`; None without a group).

        ``layer.workspace().check()`` raises at once for an error an earlier call recorded
        (a capacity overflow, a peer that did not make the same call)."""
        if self.group is None:
            return None
        from .api import get_workspace

        ws = get_workspace(self.config, self.group, max_tokens=self.max_tokens, capacity_factor=self.capacity_factor)
        self._ep_handle = ws.handle
        return ws

    def _router_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """The built-in router's logits: on MoK's batch-invariant GEMMs (mok/router.py) while
        ``self.router`` is the bias-free ``nn.Linear`` it was built as, without hooks; a router
        module replaced or hooked by the user is called as it is."""
        r = self.router
        if type(r) is nn.Linear and r.bias is None and not (r._forward_hooks or r._forward_pre_hooks):
            return router_logits(tokens, r.weight)
        return r(tokens)

    def shared_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        return None if self.shared_gate_proj is None else (self.shared_gate_proj, self.shared_up_proj, self.shared_down_proj)

    def expert_biases(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The routed experts' (gate, up, down) biases, or None (``bias=False``)."""
        return None if self.gate_bias is None else (self.gate_bias, self.up_bias, self.down_bias)

    def forward(
        self, x: torch.Tensor, topk_idx: torch.Tensor | None = None, topk_w: torch.Tensor | None = None, *, check_routing: bool = True
    ) -> torch.Tensor:
        """The layer's output for ``x`` [..., H]: routed by the built-in router, or by ``topk_idx``
        [..., k] (int32/int64 expert ids) and ``topk_w`` [..., k] given together. External ids are
        range-checked with one host read unless ``check_routing=False`` (the caller vouches for
        them) or under torch.compile / CUDA-graph capture."""
        c = self.config
        if c.fuse_wgrad_accumulation:  # (refused while tracing, not first in the traced backward)
            refuse_compiling()
        check_tensor("x", x, dtypes=(self.gate_proj.dtype,), device=self.gate_proj.device)
        if x.is_cuda and self.gate_proj.dtype != torch.bfloat16:
            raise TypeError(
                f"MoELayer: the fused CUDA path takes bf16 parameters and inputs, this layer's are {self.gate_proj.dtype}; "
                "construct it with dtype=torch.bfloat16 (the default) or call .bfloat16() on it"
            )
        if x.dim() < 1 or x.shape[-1] != c.hidden:
            raise ValueError(f"x: expected shape [..., {c.hidden}], got {list(x.shape)}")
        lead = x.shape[:-1]
        tokens = x.reshape(-1, c.hidden).contiguous()  # a non-contiguous x is copied, never rejected
        external = topk_idx is not None
        if external != (topk_w is not None):
            raise ValueError("topk_idx, topk_w: give both (external routing) or neither (built-in router)")
        if external:
            check_tensor("topk_idx", topk_idx, dtypes=(torch.int32, torch.int64), shape=(*lead, c.topk), device=x.device)
            check_tensor("topk_w", topk_w, dtypes=(torch.float32, torch.bfloat16, torch.float16), shape=(*lead, c.topk), device=x.device)
            if check_routing and _may_sync(tokens):  # on the ids as given: an int64 id would wrap in the int32 cast (one host read)
                check_index_range("topk_idx", topk_idx, c.num_experts)
            topk_idx = topk_idx.reshape(-1, c.topk).to(torch.int32).contiguous()
            topk_w = topk_w.reshape(-1, c.topk).float().contiguous()
        else:
            topk_idx, topk_w = route(self._router_logits(tokens), c.topk)
        if self.group is not None and tokens.shape[0] > self.max_tokens:
            raise ValueError(f"x: expected at most max_tokens={self.max_tokens} tokens per rank and call, got {tokens.shape[0]}")
        if self.group is not None and not tokens.is_cuda:
            out = self._reference_ep(tokens, topk_idx, topk_w)
        else:
            out = self._fused(tokens, topk_idx, topk_w)
        return out.reshape(*lead, c.hidden)

    def _needs_saving(self, x, topk_w, shared) -> bool:
        """Whether the forward must keep what its backward reads (a gradient is wanted of anything it uses)."""
        return torch.is_grad_enabled() and any(
            t.requires_grad for t in (x, topk_w, self.gate_proj, self.up_proj, self.down_proj, *(shared or ()), *(self.expert_biases() or ()))
        )

    def _fused(self, x, topk_idx, topk_w):
        """The op ``mok::moe_forward`` (mok/torch_ops.py): MoK's pipelines on CUDA, the reference on the CPU."""
        c = self.config
        shared = self.shared_weights()
        biases = self.expert_biases()
        check_moe_inputs(  # (the ids were range-checked in forward, where a host read is allowed)
            x, topk_idx, topk_w, self.gate_proj, self.up_proj, self.down_proj, shared, check_range=False, experts_total=c.num_experts,
            biases=biases,
        )
        if c.precision != "bf16" and not x.is_cuda:
            raise NotImplementedError(
                f"precision={c.precision!r}: the FP8 layer runs on a GPU only (no CPU reference of its numerics); "
                "use precision='bf16' on the CPU"
            )
        if x.is_cuda:  # (a GPU the fused layer runs on, the current device: before the op, with its own message)
            check_fused_layer_device(x.device.index)
        save, (sg, su, sd) = self._needs_saving(x, topk_w, shared), shared or (None, None, None)
        return torch.ops.mok.moe_forward(
            x, topk_idx, topk_w, self.gate_proj, self.up_proj, self.down_proj, sg, su, sd, self._config_text, self._workspace_handle(),
            save, self.shared_in_routed, self.timeout_s, *(biases or ()),
        )[0]

    def _workspace_handle(self) -> int:
        """The expert-parallel workspace's handle for the op (0 without a group), rebuilt after a close."""
        if self.group is None:
            return 0
        handle = self._ep_handle
        if handle is not None and not torch.compiler.is_compiling() and workspace_by_handle(handle).closed:
            handle = None  # closed after an error: the next call builds a new one
        if handle is None:
            if torch.compiler.is_compiling():
                raise RuntimeError(
                    "MoELayer: the expert-parallel workspace is built at construction on a CUDA device, or by the first "
                    "eager call; construct the layer on the GPU (device='cuda') or run one eager call before torch.compile"
                )
            handle = self.workspace().handle
        return handle

    def _reference_ep(self, x, topk_idx, topk_w):
        global _EP_WARNED
        from .reference import moe_reference_ep

        if self.config.fuse_wgrad_accumulation:
            raise NotImplementedError(
                "fuse_wgrad_accumulation: not on the CPU expert-parallel reference path (it returns the weight gradients); "
                "run the layer on GPUs, or without the option"
            )
        if self.config.dispatch_format != "bf16":
            raise NotImplementedError(
                f"dispatch_format={self.config.dispatch_format!r}: not on the CPU expert-parallel reference path; run the layer on GPUs"
            )

        if not _EP_WARNED:
            _EP_WARNED = True
            warn_at_caller(
                "MoK: expert parallelism on CPU tensors runs through the reference path (all_to_all + fp32 math); "
                "the fused expert-parallel kernels need the layer and its inputs on GPUs"
            )
        out = moe_reference_ep(x, topk_idx, topk_w, self.gate_proj, self.up_proj, self.down_proj, self.shared_weights(), group=self.group,
                               activation=self.config.activation, biases=self.expert_biases())
        return out.to(x.dtype)
