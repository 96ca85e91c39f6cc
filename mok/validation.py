"""Input checks shared by every public entry point.

Each check raises ``TypeError`` (wrong type or dtype) or ``ValueError`` (wrong shape,
device, layout or value) whose message names the argument, what was expected and what
was given, so that bad input fails in Python before anything is launched.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    name: str,
    value: object,
    *,
    dtypes: Sequence[torch.dtype] | None = None,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    device: torch.device | None = None,
    contiguous: bool = False,
) -> torch.Tensor:
    """Check one tensor argument; ``None`` entries of ``shape`` match any extent."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if dtypes is not None and value.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {_dtype_names(dtypes)}, got {str(value.dtype).replace('torch.', '')}")
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-d tensor, got {value.dim()}-d with shape {tuple(value.shape)}")
    if shape is not None:
        if value.dim() != len(shape) or any(s is not None and s != v for s, v in zip(shape, value.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name}: expected shape {want}, got {list(value.shape)}")
    if device is not None and value.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {value.device}")
    if contiguous and not value.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {value.stride()} for shape {tuple(value.shape)}")
    return value


def expert_blocks_contiguous(w: torch.Tensor) -> bool:
    """Per-expert weights [E, N, K] whose each expert's [N, K] block is contiguous: the experts
    packed, or further apart (a half of one [E, 2N, K] tensor)."""
    experts, n, k = w.shape
    return w.stride(2) == 1 and w.stride(1) == k and (experts <= 1 or w.stride(0) >= n * k)


def weight_strides(name: str, w: torch.Tensor, like: torch.Tensor | None = None) -> tuple[int | None, int | None]:
    """(expert stride, row stride) of per-expert weights ``w`` [E, N, K] whose rows are each
    contiguous, the rows a multiple of 8 elements (16 bytes) apart and the experts too, one
    expert's rows before the next's: each None where packed (a contiguous tensor gives (None,
    None)). E.g. the gate or up half of one [E, 2I, H] tensor: expert stride 2·I·H; its even or
    odd rows (gate and up interleaved, gpt-oss's layout): expert stride 2·I·H, row stride 2·H; the
    kernels read either in place. ``like``: the weights this one must be strided as (b with b2:
    one set of strides for both). ValueError otherwise."""
    experts, n, k = w.shape
    row = w.stride(1) if n > 1 else k
    if w.stride(2) != 1 or row < k or row % 8 or (experts > 1 and (w.stride(0) < n * row or w.stride(0) % 8)):
        raise ValueError(
            f"{name}: expected each row contiguous, the rows and the experts multiples of 8 elements (16 bytes) apart, one "
            f"expert's [{n}, {k}] rows before the next's (a contiguous tensor, a half of one [E, 2·{n}, {k}] tensor, or its even "
            f"or odd rows), got strides {w.stride()} for shape {tuple(w.shape)}"
        )
    if like is not None and experts > 1 and w.stride() != like.stride():
        raise ValueError(f"{name}: expected the strides of its partner weights {like.stride()}, got {w.stride()}")
    if row == k:
        return None if experts <= 1 or w.stride(0) == n * k else w.stride(0), None
    return w.stride(0) if experts > 1 else n * row, row  # (a given row stride: the expert stride given too)


def expert_stride(name: str, w: torch.Tensor, like: torch.Tensor | None = None) -> int | None:
    """The expert stride of per-expert weights ``w`` [E, N, K] whose every expert's [N, K] block is
    contiguous (:func:`weight_strides` with packed rows): None when the experts are packed too.
    ValueError otherwise."""
    experts, n, k = w.shape
    if not expert_blocks_contiguous(w):
        raise ValueError(
            f"{name}: expected each expert's [{n}, {k}] block contiguous (a contiguous tensor, or a half of one [E, 2·{n}, {k}] "
            f"tensor), got strides {w.stride()} for shape {tuple(w.shape)}"
        )
    return weight_strides(name, w, like)[0]


def gate_up_strides(w_gate: torch.Tensor, w_up: torch.Tensor) -> tuple[int | None, int | None]:
    """The (expert stride, row stride) w_gate and w_up share (:func:`weight_strides`; None: packed)."""
    strides = weight_strides("w_gate", w_gate)
    weight_strides("w_up", w_up, like=w_gate)
    return strides


def check_gate_up_parts(w_gate: torch.Tensor, w_up: torch.Tensor, layout: str) -> None:
    """``w_gate`` and ``w_up`` [E, I, H] are the parts of one [E, 2I, H] tensor ``layout`` says:
    its halves, gate first ("concatenated"), or its even and odd rows ("interleaved"); ValueError
    otherwise."""
    experts, inter, hidden = w_gate.shape
    interleaved = layout == "interleaved"
    whole = (2 * inter * hidden, 2 * hidden if interleaved else hidden, 1)
    parts = "the even and odd rows [:, 0::2] and [:, 1::2]" if interleaved else f"the halves [:, :{inter}] and [:, {inter}:]"
    same_storage = w_up.untyped_storage().data_ptr() == w_gate.untyped_storage().data_ptr()
    sizes = (experts, inter, hidden)  # (a stride along a dimension of size 1 is arbitrary)
    strides_ok = all(size <= 1 or (w.stride(d) == whole[d]) for w in (w_gate, w_up) for d, size in enumerate(sizes))
    if not same_storage or w_up.storage_offset() != w_gate.storage_offset() + (hidden if interleaved else inter * hidden) or not strides_ok:
        raise ValueError(
            f"w_gate, w_up: gate_up_layout={layout!r} expects {parts} of one [{experts}, {2 * inter}, {hidden}] tensor, got strides "
            f"{w_gate.stride()} and {w_up.stride()}, storage offsets {w_gate.storage_offset()} and {w_up.storage_offset()}"
            + ("" if same_storage else " in different storages")
        )


def check_positive_int(name: str, value: object, *, minimum: int = 1) -> int:
    """Check an integer argument (bools are refused: ``True`` is not a size)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def check_index_range(name: str, index: torch.Tensor, upper: int) -> None:
    """Check that every entry of ``index`` lies in ``[0, upper)``.

    Reads two scalars back from the device: the entry points call it by default
    (``check_routing``), and skip it where a host sync is not allowed (CUDA-graph capture,
    torch.compile). The kernels do not check ids: an id outside the experts' range gets no
    row (its slot contributes nothing), so a caller that skips the check must pass valid ids.
    """
    if index.numel() == 0:
        return
    lo, hi = torch.stack(torch.aminmax(index)).tolist()  # (one read back, not two)
    if lo < 0 or hi >= upper:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{name}: expected every entry in [0, {upper}), got {bad}")


def check_moe_inputs(
    x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
    shared: tuple | None,
    *,
    dtypes: Sequence[torch.dtype] = FLOAT_DTYPES,
    router_dtypes: Sequence[torch.dtype] = (torch.float32, torch.float64),
    contiguous: bool = False,
    experts_total: int | None = None,
    check_range: bool = True,
    biases: tuple | None = None,
) -> tuple[int, int, int, int, int]:
    """Validate one MoE layer call; returns (T, H, I, E_local, k).

    x [T, H]; w_gate, w_up [E_local, I, H]; w_down [E_local, H, I]; topk_idx [T, k] with ids in
    [0, experts_total) (default E_local); topk_w [T, k]; shared None or (gate [I_s, H],
    up [I_s, H], down [H, I_s]); biases None or the routed experts' (gate [E_local, I], up
    [E_local, I], down [E_local, H]) in the weights' dtype. ``check_range`` reads two scalars back
    from the device.
    """
    check_tensor("x", x, dtypes=dtypes, ndim=2, contiguous=contiguous)
    num_tokens, hidden = x.shape
    dev = x.device
    check_tensor("w_gate", w_gate, dtypes=dtypes, ndim=3, device=dev)
    num_local, inter, _ = w_gate.shape
    check_tensor("w_gate", w_gate, shape=(num_local, inter, hidden))
    check_tensor("w_up", w_up, dtypes=dtypes, shape=(num_local, inter, hidden), device=dev)
    if contiguous:  # (w_gate and w_up: their rows; the two may be the halves of one [E, 2I, H] tensor, or its even and odd rows)
        gate_up_strides(w_gate, w_up)
    check_tensor("w_down", w_down, dtypes=dtypes, shape=(num_local, hidden, inter), device=dev, contiguous=contiguous)
    experts_total = num_local if experts_total is None else experts_total
    check_tensor("topk_idx", topk_idx, dtypes=INDEX_DTYPES, ndim=2, device=dev)
    if topk_idx.shape[0] != num_tokens:
        raise ValueError(f"topk_idx: expected {num_tokens} rows (as x), got {topk_idx.shape[0]}")
    topk = topk_idx.shape[1]
    if topk < 1:
        raise ValueError(f"topk_idx: expected at least one column (k >= 1), got shape {list(topk_idx.shape)}")
    if topk > experts_total:
        raise ValueError(f"topk_idx: expected k <= num_experts={experts_total}, got k={topk}")
    check_tensor("topk_w", topk_w, dtypes=router_dtypes, shape=(num_tokens, topk), device=dev, contiguous=contiguous)
    if shared is not None:
        if not isinstance(shared, tuple) or len(shared) != 3:
            raise TypeError(f"shared: expected None or (gate, up, down) weights, got {type(shared).__name__}")
        gate, up, down = shared
        check_tensor("shared.gate", gate, dtypes=dtypes, ndim=2, device=dev, contiguous=contiguous)
        s_inter = gate.shape[0]
        check_tensor("shared.gate", gate, shape=(s_inter, hidden))
        check_tensor("shared.up", up, dtypes=dtypes, shape=(s_inter, hidden), device=dev, contiguous=contiguous)
        check_tensor("shared.down", down, dtypes=dtypes, shape=(hidden, s_inter), device=dev, contiguous=contiguous)
    if biases is not None:
        if not isinstance(biases, tuple) or len(biases) != 3:
            raise TypeError(f"biases: expected None or the experts' (gate, up, down) biases, got {type(biases).__name__}")
        for name, bias, width in zip(("gate", "up", "down"), biases, (inter, inter, hidden)):
            check_tensor(f"biases.{name}", bias, dtypes=(w_gate.dtype,), shape=(num_local, width), device=dev, contiguous=contiguous)
    if check_range:
        check_index_range("topk_idx", topk_idx, experts_total)
    return num_tokens, hidden, inter, num_local, topk


def check_capacity_factor(value: "float | None") -> None:
    """A capacity factor is None (no bound) or a positive finite number."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf):
        raise ValueError(f"capacity_factor: expected a positive finite number (or None: no bound), got {value!r}")


def check_main_grads(main_grads: "tuple | None", weights: tuple, shared: "tuple | None", weight_grads: bool = True) -> None:
    """``main_grads``: None, or one fp32 buffer per weight (gate, up, down[, shared gate, up, down]),
    each contiguous, shaped like its weight and on its device (checked before anything launches);
    not with ``weight_grads=False`` (a backward that computes no weight gradient)."""
    if main_grads is None:
        return
    owners = (*weights, *(shared or ()))
    names = ("d_w_gate", "d_w_up", "d_w_down", "d_shared_gate", "d_shared_up", "d_shared_down")
    if not isinstance(main_grads, (tuple, list)) or len(main_grads) != len(owners):
        got = len(main_grads) if isinstance(main_grads, (tuple, list)) else type(main_grads).__name__
        raise ValueError(f"main_grads: expected {len(owners)} fp32 buffers, got {got}")
    for name, buf, weight in zip(names, main_grads, owners):
        check_tensor(f"main_grads ({name})", buf, dtypes=(torch.float32,), shape=tuple(weight.shape), device=weight.device, contiguous=True)
        if buf.data_ptr() % 16:  # (the weight-gradient kernels add into it with 16-byte TMA stores)
            raise ValueError(f"main_grads ({name}): expected a 16-byte aligned start, got address {buf.data_ptr():#x}")
    spans = [(buf.device, buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size(), name) for name, buf in zip(names, main_grads)]
    for i, (dev, lo, hi, name) in enumerate(spans):  # (each gradient is added into its own buffer: two sharing memory would mix)
        for dev2, lo2, hi2, name2 in spans[i + 1:]:
            if dev == dev2 and lo < hi2 and lo2 < hi:
                raise ValueError(f"main_grads ({name}, {name2}): expected separate buffers, got two that overlap in memory")
    if not weight_grads:
        raise ValueError("main_grads: given with weight_grads=False (nothing would be added into them)")


MAX_TIMEOUT_S = 1e9  # the kernels take the bound in int64 nanoseconds (and no run waits 30 years)


def check_timeout(value: float) -> None:
    """A wait bound is a positive number of seconds, at most MAX_TIMEOUT_S (finite: the kernels
    take it in int64 nanoseconds)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_TIMEOUT_S:
        raise ValueError(f"timeout_s: expected a positive number of seconds up to {MAX_TIMEOUT_S:g}, got {value!r}")


_INTERNAL_DIRS = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.abspath(torch.__file__)))


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn, attributed to the first frame outside MoK and torch: the user's line that called into
    the layer or an op, not torch's dispatch that ran MoK's code."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_INTERNAL_DIRS):
        level, frame = level + 1, frame.f_back
    warnings.warn(message, category, stacklevel=level + 1)
