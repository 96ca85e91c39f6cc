"""MoK: a fused, deterministic Mixture-of-Experts training kernel in CuTe DSL.

Public API: the module :class:`MoELayer` (router + experts, autograd, torch.compile);
the functional API (:func:`forward`, :func:`backward`, :func:`get_workspace` with a static
:class:`MoKConfig`); the reference semantics (:func:`moe_reference`, :func:`moe_reference_ep`),
the routing schedule (:func:`build_schedule`) and the combine op (:func:`combine`).
Kernels (CuTe DSL) load only when a GPU op first runs.
"""

import torch.distributed

if torch.distributed.is_available():
    # Now, before any process group exists: torch imports this module lazily (torch._dynamo
    # does, which optimizers and custom ops load), and its functions take the default group as
    # a default argument when imported. Imported after init_process_group, it keeps that group
    # (and gloo's threads) alive past destroy_process_group, into the interpreter's shutdown.
    import torch.distributed.nn  # noqa: F401

from .config import DEFAULT_CONFIG, MoKConfig
from .reference import ExpertBiases, SharedExpert, combine_reference, moe_reference, moe_reference_ep
from .schedule import Schedule, build_schedule, worst_case_capacity

__version__ = "0.1.0"


_SUBMODULES = ("ops", "plan", "pipeline", "reference_backward", "mxfp8", "torch_ops", "kernels", "runtime", "bench")


def __getattr__(name: str):
    """MoELayer, the functional API and the public submodules (``mok.ops``, ``mok.plan``, ...):
    imported on first use (they pull in the torch.library ops and the kernels' registry)."""
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    if name == "MoELayer":
        from .layer import MoELayer

        return MoELayer
    if name in ("forward", "backward", "get_workspace", "create_workspace", "LayerContext"):
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'mok' has no attribute {name!r}")


def combine(*args, **kwargs):
    """See :func:`mok.ops.combine` (imported lazily: CuTe DSL loads only when a kernel is used)."""
    from .ops import combine as _combine

    return _combine(*args, **kwargs)


__all__ = [
    "DEFAULT_CONFIG",
    "LayerContext",
    "MoELayer",
    "backward",
    "create_workspace",
    "forward",
    "get_workspace",
    "MoKConfig",
    "Schedule",
    "ExpertBiases",
    "SharedExpert",
    "build_schedule",
    "combine",
    "combine_reference",
    "moe_reference",
    "moe_reference_ep",
    "worst_case_capacity",
]
