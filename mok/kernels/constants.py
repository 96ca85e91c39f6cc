"""Sizes that kernels and their host-side callers both need (plain Python: importing it loads no CuTe DSL)."""

SCHEDULE_THREADS = 512  # threads per CTA of the schedule launch
# the gated activations the SwiGLU epilogues compute (common/gated_activation.py): a = act(h_gate, h_up)
ACTIVATIONS = ("swiglu", "clamped_swiglu", "geglu")
CLAMP_LIMIT = 7.0  # clamped_swiglu (gpt-oss's): the gate at most 7, up within [-7, 7]
CLAMPED_ALPHA = 1.702  # clamped_swiglu: gate·σ(1.702·gate)
GELU_SCALE = 0.7978845608028654  # geglu, gelu's tanh approximation: √(2/π)
GELU_CUBIC = 0.044715
GRID_SYNC_WORDS = 4  # int32 words of a grid barrier's state (common/waits.py: grid_barrier): arrived, generation, timeouts, left


def check_activation(activation: str) -> None:
    """ValueError for an activation the kernels do not compute."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
