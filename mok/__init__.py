"""MoK: a fused, deterministic Mixture-of-Experts training kernel in CuTe DSL.

Public API so far: the static :class:`MoKConfig`, the reference semantics
(:func:`moe_reference`, :func:`moe_reference_ep`), the routing schedule
(:func:`build_schedule`) and the combine op (:func:`combine`).
"""

from .config import DEFAULT_CONFIG, MoKConfig
from .reference import SharedExpert, combine_reference, moe_reference, moe_reference_ep
from .schedule import Schedule, build_schedule, worst_case_capacity

__version__ = "0.1.0"


def combine(*args, **kwargs):
    """See :func:`mok.ops.combine` (imported lazily: CuTe DSL loads only when a kernel is used)."""
    from .ops import combine as _combine

    return _combine(*args, **kwargs)


__all__ = [
    "DEFAULT_CONFIG",
    "MoKConfig",
    "Schedule",
    "SharedExpert",
    "build_schedule",
    "combine",
    "combine_reference",
    "moe_reference",
    "moe_reference_ep",
    "worst_case_capacity",
]
