"""Every shim over JAX internals that differ between the supported versions (0.10, 0.11).

Nothing else in jax_tq imports from ``jax._src`` or relies on a version-specific name.
"""
from __future__ import annotations

import jax
from jax.extend.core import Primitive  # noqa: F401  (re-exported)
from jax.interpreters import batching, mlir  # noqa: F401  (re-exported)

try:  # public through 0.10; moved later
    from jax.core import ShapedArray
except (ImportError, AttributeError):  # pragma: no cover - newer JAX
    from jax._src.core import ShapedArray  # type: ignore[no-redef]

#: What a batching rule receives for an operand that is not batched.
NOT_MAPPED = None


def ffi_lowering(target: str, **kwargs):
    """``jax.ffi.ffi_lowering`` (public since JAX 0.4.36)."""
    return jax.ffi.ffi_lowering(target, **kwargs)


def register_ffi_target(name: str, capsule, platform: str) -> None:
    """Register an XLA FFI handler capsule under ``name`` for ``platform`` ("cpu" or "CUDA")."""
    jax.ffi.register_ffi_target(name, capsule, platform=platform)


def lowering_platforms(ctx) -> tuple[str, ...]:
    """Platforms a lowering rule is being lowered for (e.g. ("cpu",) or ("cuda",))."""
    platforms = getattr(ctx.module_context, "platforms", None)
    if platforms is None:  # pragma: no cover - very old JAX
        platforms = (ctx.module_context.platform,)
    return tuple(platforms)


def _first_gpu():
    """The first GPU device, or None when JAX has none."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return None
    return gpus[0] if gpus else None


def gpu_core_count(default: int = 132) -> int:
    """Number of streaming multiprocessors of the first GPU, or ``default`` when unknown."""
    return int(getattr(_first_gpu(), "core_count", default) or default)


def gpu_compute_capability(default: tuple[int, int] = (9, 0)) -> tuple[int, int]:
    """(major, minor) compute capability of the first GPU, or ``default`` when unknown."""
    text = str(getattr(_first_gpu(), "compute_capability", "") or "")
    try:
        major, minor = (int(v) for v in text.split(".")[:2])
    except ValueError:
        return default
    return major, minor


def enable_x64():
    """Context manager turning on 64-bit types (``jax.enable_x64(True)``; older: jax.experimental)."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64 as _enable_x64  # pragma: no cover - older JAX

    return _enable_x64()
