"""The layer's forward and backward pipelines: the stages composed as a :class:`mok.plan.Plan` says.

    forward.py    schedule -> rows in -> gate/up (+ h) -> down -> combine (+ shared expert), or one launch
    backward.py   rows in -> down backward (router gradient fused) -> gate/up backward -> weight
                  gradients -> dx combine (+ shared expert)
    stages.py     the GEMM stages, precision a parameter; the shared expert
    exchange.py   the expert-parallel stages (publish, pull, push, handshakes), format a parameter
    workspace.py  the expert-parallel workspace and its error record
"""

from .backward import backward
from .forward import forward
from .stages import ForwardResult

__all__ = ["ForwardResult", "backward", "forward"]
