"""A kernel's launch arguments named once: the record its ``__call__``, its compile stand-ins and
its launcher all read.

A MoK kernel takes raw pointers, 32/64-bit integers and a CUDA stream, in a fixed order. The
order is written here once per kernel family, as a :class:`LaunchArgs` record; the compile step
builds its placeholder arguments from it (:meth:`LaunchArgs.stand_ins`), the launcher builds
the real ones by name from it (:meth:`LaunchArgs.values`: a pointer not given is null, an integer
not given takes its default), and :meth:`LaunchArgs.check_signature` holds the kernel's
``__call__`` parameters to it (pointer ``x`` is parameter ``x_ptr``; the stream comes last).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

POINTER_KINDS = ("bf16", "f32", "i32", "e4m3", "e8m0", "u8")  # element types of pointer arguments
INTEGER_KINDS = ("int32", "int64")


@dataclass(frozen=True)
class Arg:
    """One argument: ``kind`` a pointer's element type (POINTER_KINDS, ``align`` bytes assumed by the
    compiled code) or an integer (INTEGER_KINDS, ``default`` when a launch does not give it)."""

    name: str
    kind: str
    align: int = 16
    default: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in POINTER_KINDS + INTEGER_KINDS:
            raise ValueError(f"{self.name}: expected a kind in {POINTER_KINDS + INTEGER_KINDS}, got {self.kind!r}")

    @property
    def is_pointer(self) -> bool:
        return self.kind in POINTER_KINDS

    @property
    def parameter(self) -> str:
        """The kernel ``__call__``'s name for it."""
        return f"{self.name}_ptr" if self.is_pointer else self.name


def ptr(name: str, kind: str, align: int = 16) -> Arg:
    """A pointer argument (16-byte aligned unless said otherwise)."""
    return Arg(name, kind, align)


def int32(name: str, default: int | None = None) -> Arg:
    return Arg(name, "int32", default=default)


def int64(name: str, default: int | None = None) -> Arg:
    return Arg(name, "int64", default=default)


class LaunchArgs:
    """The ordered arguments of one kernel family (the CUDA stream follows them)."""

    def __init__(self, *args: Arg) -> None:
        names = [a.name for a in args]
        if len(set(names)) != len(names):
            raise ValueError(f"launch arguments: expected distinct names, got {names}")
        self.args = args
        self.by_name = {a.name: a for a in args}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.args)

    def values(self, **given) -> tuple:
        """The runtime arguments in order (without the stream): tensors (or None, a null pointer)
        for pointers, ints for integers (mok.runtime.launch's convention)."""
        from ...runtime import launch

        unknown = set(given) - set(self.by_name)
        if unknown:
            raise TypeError(f"launch arguments: no argument(s) {sorted(unknown)}; expected some of {self.names}")
        out = []
        for a in self.args:
            value = given.get(a.name, None if a.is_pointer else a.default)
            if a.is_pointer:
                out.append(launch.ptr(a.kind, value, a.align))
            elif value is None:
                raise TypeError(f"launch arguments: {a.name} (an integer without a default) was not given")
            else:
                out.append(launch.i32(value) if a.kind == "int32" else launch.i64(value))
        return tuple(out)

    def stand_ins(self) -> tuple:
        """Compile-time placeholders of every argument, the stream last (their values do not enter
        the compiled code: pointers are null, integers dynamic)."""
        import cutlass
        from cutlass.cute.runtime import make_fake_stream, make_ptr

        dtypes = {"bf16": cutlass.BFloat16, "f32": cutlass.Float32, "i32": cutlass.Int32, "e4m3": cutlass.Float8E4M3FN,
                  "e8m0": cutlass.Float8E8M0FNU, "u8": cutlass.Uint8}
        gmem = cutlass.cute.AddressSpace.gmem
        out = []
        for a in self.args:
            if a.is_pointer:
                out.append(make_ptr(dtypes[a.kind], 0, gmem, assumed_align=a.align))
            else:
                value = 1 if a.default is None else a.default
                out.append(cutlass.Int32(value) if a.kind == "int32" else cutlass.Int64(value))
        return (*out, make_fake_stream())

    def check_signature(self, call) -> None:
        """Raise unless ``call``'s parameters (after self) are this record's, in order, then the stream."""
        params = [p for p in inspect.signature(call).parameters if p != "self"]
        want = [a.parameter for a in self.args] + ["stream"]
        if params != want:
            raise TypeError(f"{getattr(call, '__qualname__', call)}: parameters {params} are not the record's {want}")
