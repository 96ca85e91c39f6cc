"""Input checks shared by every public entry point.

Each check raises ``TypeError`` (wrong type or dtype) or ``ValueError`` (wrong shape,
device, layout or value) whose message names the argument, what was expected and what
was given, so that bad input fails in Python before anything is launched.
"""

from __future__ import annotations

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


def check_positive_int(name: str, value: object, *, minimum: int = 1) -> int:
    """Check an integer argument (bools are refused: ``True`` is not a size)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def check_index_range(name: str, index: torch.Tensor, upper: int) -> None:
    """Check that every entry of ``index`` lies in ``[0, upper)``.

    Reads two scalars back from the device: use it at the edge of reference and test
    code, never on a fused kernel's hot path (that path reports bad indices through its
    device error flag instead).
    """
    if index.numel() == 0:
        return
    lo = int(index.min())
    hi = int(index.max())
    if lo < 0 or hi >= upper:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{name}: expected every entry in [0, {upper}), got {bad}")
