"""Which GPU architecture to build kernels for.

The target comes, in this order, from an explicit argument, the ``CUTE_DSL_ARCH``
environment variable, or the current CUDA device. There is no silent default: with none
of the three, or with a target MoK has no kernels for, a clear error says what to pass.
(CuTe DSL itself falls back to sm_100a when it sees no GPU, which would quietly build
the wrong code on a CPU machine.)
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

SUPPORTED_ARCHS = ("sm_90a", "sm_100a", "sm_103a")
_BY_CAPABILITY = {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_103a"}
ARCH_ENV = "CUTE_DSL_ARCH"


def normalize_arch(arch: str) -> str:
    """Check and return a target name; ``sm_90`` without the ``a`` is refused with a hint."""
    if not isinstance(arch, str):
        raise TypeError(f"arch: expected a string such as 'sm_90a', got {type(arch).__name__}")
    name = arch.strip().lower()
    if name in SUPPORTED_ARCHS:
        return name
    if name + "a" in SUPPORTED_ARCHS:
        raise ValueError(
            f"arch: expected one of {', '.join(SUPPORTED_ARCHS)}, got {arch!r}; MoK needs the "
            f"arch-specific target {name}a (WGMMA, TMA multicast and tcgen05 exist only there)"
        )
    raise ValueError(f"arch: expected one of {', '.join(SUPPORTED_ARCHS)}, got {arch!r}")


def device_arch(device: "int | None" = None) -> str | None:
    """Target of a visible CUDA device (what kernels launched on it must be built for).

    None when no device is visible; a clear error for GPUs MoK has no kernels for.
    """
    import torch

    if not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device() if device is None else device
    capability = torch.cuda.get_device_capability(index)
    if capability not in _BY_CAPABILITY:
        name = torch.cuda.get_device_name(index)
        raise RuntimeError(
            f"MoK has no kernels for {name} (compute capability {capability[0]}.{capability[1]}); "
            f"supported targets: {', '.join(SUPPORTED_ARCHS)} (H100/H200, B200/GB200, B300/GB300)"
        )
    return _BY_CAPABILITY[capability]


FUSED_LAYER_ARCHS = ("sm_90a",)  # where the whole layer (its GEMMs included) has kernels that have run and been tested
UNVERIFIED_ARCHS = ("sm_100a", "sm_103a")  # GEMMs written and compile-verified, never run (no SM100 GPU here)
UNVERIFIED_ENV = "MOK_UNVERIFIED_SM100"  # "1": run the layer on them anyway
PERSISTENT_GEMM_ARCHS = ("sm_90a", "sm_100a", "sm_103a")  # persistent, warp-specialised grouped and weight-gradient GEMMs
# GEMMs on FP8 with 128-block fp32 scales (SM100 runs fp8_block's power-of-two scales as E8M0 bytes on its block-scaled MMAs:
# mok.plan.fp8_on_block_scaled_mma_refusal); every persistent arch gathers and scatters rows, adds biases, takes partial
# tiles and runs the one-launch expert MLP
FP8_BLOCK_GEMM_ARCHS = ("sm_90a",)
MXFP8_GEMM_ARCHS = ("sm_100a", "sm_103a")  # block-scaled MMAs (tcgen05 kind::mxf8f6f4); Hopper has none


def has_persistent_gemms(arch: str | None) -> bool:
    """Whether ``arch`` has the persistent, warp-specialised GEMM kernels (Hopper and SM100; the
    SM100 ones compile-verified only)."""
    return arch in PERSISTENT_GEMM_ARCHS


def require_mxfp8_gemms(what: str, arch: str | None, emulated_hint: bool = True) -> None:
    """Raise NotImplementedError unless ``arch`` has block-scaled MMAs (the MXFP8 GEMMs): the one
    place that refuses MXFP8 compute elsewhere, naming ``what`` asked for it."""
    if arch not in MXFP8_GEMM_ARCHS:
        hint = "; precision='mxfp8_emulated' runs the same numerics there (slower than bf16)" if emulated_hint and arch else ""
        raise NotImplementedError(
            f"{what}: needs block-scaled MMAs ({', '.join(MXFP8_GEMM_ARCHS)}: SM100), got {arch or 'no GPU'}{hint}"
        )


def fused_layer_archs() -> tuple[str, ...]:
    """The targets the fused layer runs on: Hopper, and SM100/SM103 when ``MOK_UNVERIFIED_SM100=1``."""
    return FUSED_LAYER_ARCHS + (UNVERIFIED_ARCHS if os.environ.get(UNVERIFIED_ENV) == "1" else ())


def check_fused_layer_device(device: "int | None" = None) -> str:
    """The device's target if MoK's fused layer runs there; a clear error naming the supported ones
    if not, or if ``device`` is not the current CUDA device (MoK's kernels launch on the current
    device, with the stream of the tensors' device: on another device that fails in the driver
    with no word of why)."""
    arch = device_arch(device)
    if arch not in fused_layer_archs():
        unverified = (
            f": MoK's SM100 kernels are written and compile-verified but have never run on an SM100 GPU; set "
            f"{UNVERIFIED_ENV}=1 to use them (fp8_block with power-of-two scales), after `CUDA_LAUNCH_BLOCKING=1 python -m pytest -q -x -m "
            f"sm100` passes on this GPU." if arch in UNVERIFIED_ARCHS else ""
        )
        raise RuntimeError(
            f"MoK's fused MoE layer runs on {', '.join(FUSED_LAYER_ARCHS)} (Hopper: H100/H200) so far; "
            f"this GPU is {arch or 'not visible'}{unverified or ' (its grouped GEMMs are not written yet for it)'}"
        )
    if device is not None:
        import torch

        if torch.compiler.is_compiling():  # (traced once; the ops check again where they run)
            return arch
        current = torch.cuda.current_device()
        if device != current:
            raise ValueError(
                f"x: on cuda:{device}, but the current CUDA device is cuda:{current}; MoK launches on the current "
                f"device: call it under `with torch.cuda.device({device}):` (or torch.cuda.set_device({device}))"
            )
    return arch


def resolve_arch(arch: str | None = None, device: "int | None" = None) -> str:
    """The target to build for: ``arch`` if given, else ``$CUTE_DSL_ARCH``, else the device's."""
    if arch is not None:
        return normalize_arch(arch)
    from_env = os.environ.get(ARCH_ENV)
    if from_env:
        try:
            return normalize_arch(from_env)
        except ValueError as err:
            raise ValueError(f"{ARCH_ENV}: {err}") from None
    found = device_arch(device)
    if found is None:
        raise RuntimeError(
            "MoK cannot tell which GPU to build for: no CUDA device is visible and neither an "
            f"arch argument nor {ARCH_ENV} is set. Pass arch='sm_90a' (Hopper) or 'sm_100a' "
            "(Blackwell), e.g. `python -m mok precompile --arch sm_90a`."
        )
    return found


_TARGET_LOCK = threading.RLock()  # the DSL's target is one setting per process
_TARGETS: list[str] = []  # the targets of the dsl_target blocks open now (nested in one thread)


@contextlib.contextmanager
def dsl_target(arch: str) -> Iterator[None]:
    """Make CuTe DSL compile for ``arch`` whatever GPU this machine has (or lacks).

    The DSL takes its notion of "this machine" from ``CUTE_DSL_ARCH`` or a GPU probe, and
    refuses to export code for another target (and, with no GPU, fails to export at all).
    Inside this block it is told the target itself; afterwards it goes back to the enclosing
    block's target, or to what the environment says. The setting is the whole process's: one
    thread at a time holds a block (others wait), so no compile or export runs under another
    thread's target. The ``--gpu-arch`` option of every compile names the target too.
    """
    from cutlass.cutlass_dsl import CuTeDSL

    with _TARGET_LOCK:
        envar = CuTeDSL._get_dsl().envar
        _TARGETS.append(normalize_arch(arch))
        envar.arch = _TARGETS[-1]
        try:
            yield
        finally:
            _TARGETS.pop()
            if _TARGETS:
                envar.arch = _TARGETS[-1]
            else:
                del envar.arch  # back to $CUTE_DSL_ARCH, or to probing the GPU on first use
