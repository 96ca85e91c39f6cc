"""The layer's weight gradients added straight into fp32 ``param.main_grad`` buffers (Megatron's protocol).

With ``MoELayer(..., fuse_wgrad_accumulation=True)`` the backward's weight-gradient GEMMs add
into each expert weight's ``main_grad`` (fp32, the weight's shape) with their TMA reduce-add
stores, instead of writing a fresh bf16 gradient that a separate pass would add there: no
[E, I, H] gradient tensor is allocated and the fp32 buffers are read and written once. Each
output tile is still owned by one CTA, so the sums keep their fixed order.

What autograd then gets for the weight, as Megatron-Core's and Transformer Engine's fused
accumulation do: a parameter with a ``grad_added_to_main_grad`` attribute has it set to True and
gets a placeholder gradient of its shape (uninitialised; zeros when ``zero_out_wgrad`` is set),
so that gradient hooks still fire and know the add is done; any other parameter gets None.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def refuse_compiling() -> None:
    """fuse_wgrad_accumulation reads each weight's ``main_grad`` attribute, which torch.compile does
    not trace (traced, the weights are stand-ins without their attributes): refuse it there."""
    if torch.compiler.is_compiling():
        raise RuntimeError(
            "fuse_wgrad_accumulation: eager mode only (the backward reads each weight's main_grad attribute, which "
            "torch.compile does not trace); compile the layer without it, or run it eagerly"
        )


def main_grads_of(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each parameter's ``main_grad``, checked: fp32, contiguous, of the parameter's shape and device."""
    refuse_compiling()
    buffers = []
    for i, p in enumerate(params):
        buf = getattr(p, "main_grad", None)
        where = f"expert weight {i} (shape {list(p.shape)})"
        if not isinstance(buf, torch.Tensor):
            raise RuntimeError(
                f"fuse_wgrad_accumulation: {where} has no main_grad tensor; give every expert weight an fp32 "
                "main_grad of its shape before the backward (as Megatron's DDP does)"
            )
        if buf.dtype != torch.float32 or tuple(buf.shape) != tuple(p.shape) or buf.device != p.device or not buf.is_contiguous():
            raise RuntimeError(
                f"fuse_wgrad_accumulation: {where}: expected a contiguous float32 main_grad of shape {list(p.shape)} on "
                f"{p.device}, got {buf.dtype} {list(buf.shape)} on {buf.device}{'' if buf.is_contiguous() else ', not contiguous'}"
            )
        buffers.append(buf)
    return buffers


def grads_after_accumulation(params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """What autograd gets for each parameter once its gradient was added into its main_grad."""
    grads = []
    for p in params:
        if hasattr(p, "grad_added_to_main_grad"):
            p.grad_added_to_main_grad = True
            make = torch.zeros if getattr(p, "zero_out_wgrad", False) else torch.empty
            grads.append(make(p.shape, dtype=p.dtype, device=p.device))
        else:
            grads.append(None)
    return grads


def accumulating_weights(fuse_wgrad: bool, *weights: torch.Tensor | None) -> tuple | None:
    """The weights whose gradients a backward adds into main_grad: all of them when the forward asked
    for it and every one wants a gradient (frozen experts keep the plain path), else None."""
    weights = tuple(w for w in weights if w is not None)
    return weights if fuse_wgrad and all(w.requires_grad for w in weights) else None
