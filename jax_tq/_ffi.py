"""FFI loader: imports the compiled kernel modules and registers their XLA FFI targets.

``jax_tq._cpu_ops`` holds the C++ CPU handlers, ``jax_tq._cuda_ops`` the CUDA ones (built only where
nvcc was found). Both expose ``registrations() -> {target_name: capsule}`` with the same target names.
"""
from __future__ import annotations

import functools
import importlib
import os
import re

from jax_tq import _compat

# platform name as lowering rules see it -> (module, platform name for register_ffi_target)
_MODULES = {"cpu": ("jax_tq._cpu_ops", "cpu"), "cuda": ("jax_tq._cuda_ops", "CUDA")}


@functools.lru_cache(maxsize=None)
def _load(platform: str):
    """Import and register the module for ``platform``; returns (module or None, error message)."""
    module_name, ffi_platform = _MODULES[platform]
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        return None, f"{module_name} is not built or cannot be imported ({err})"
    mismatch = _ffi_api_mismatch(module, module_name)
    if mismatch:
        return None, mismatch
    if platform == "cuda" and not _jax_has_cuda():
        return None, "JAX has no CUDA backend"
    for name, capsule in module.registrations().items():
        _compat.register_ffi_target(name, capsule, ffi_platform)
    return module, ""


@functools.lru_cache(maxsize=None)
def installed_ffi_api_version():
    """(major, minor) of the XLA FFI API in the installed jaxlib's headers, or None when they
    cannot be read."""
    import jax

    try:
        path = os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h")
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, AttributeError):
        return None
    found = [re.search(rf"#define XLA_FFI_API_{part}\s+(\d+)", text) for part in ("MAJOR", "MINOR")]
    return None if None in found else tuple(int(m.group(1)) for m in found)


def _ffi_api_mismatch(module, module_name: str) -> str:
    """Why ``module`` must not be registered with this jaxlib ('' when it may): it was compiled
    against a newer XLA FFI API than the installed jaxlib serves (a build-isolated ``pip install``
    may build against a newer jax than the one installed), and XLA would refuse its handlers when it
    starts a backend, taking the backend down for every JAX computation."""
    built = tuple(module.ffi_api_version()) if hasattr(module, "ffi_api_version") else None
    running = installed_ffi_api_version()
    if built is None or running is None:
        return ""
    if built[0] == running[0] and built[1] <= running[1]:
        return ""
    return (f"{module_name} was compiled against XLA FFI API {built[0]}.{built[1]} (a newer jaxlib's "
            f"headers) but the installed jaxlib serves {running[0]}.{running[1]}: reinstall jax_tq with "
            "`pip install --no-build-isolation .` so that it builds against the installed jax")


def _jax_has_cuda() -> bool:
    import jax

    try:
        return any(d.platform == "gpu" for d in jax.devices("gpu"))
    except RuntimeError:
        return False


def kernels_available(platform: str) -> bool:
    """Whether this install's FFI kernels for ``platform`` are built and registered with JAX
    (public as ``jax_tq.kernels_available``).

    Args:
      platform: ``"cpu"`` or ``"cuda"`` (any other name: False).

    Returns:
      True when the compiled module loaded and its targets are registered; for ``"cuda"`` that also
      needs a JAX with a CUDA backend, so it is False on a machine without a GPU even when the CUDA
      kernels were built. Importing the module happens on the first call.
    """
    return platform in _MODULES and _load(platform)[0] is not None


def unavailable_reason(platform: str) -> str:
    """Why :func:`kernels_available` is False for ``platform`` (empty string when it is True);
    public as ``jax_tq.kernels_unavailable_reason``."""
    if platform not in _MODULES:
        return f"jax_tq has no FFI kernels for platform {platform!r}"
    return _load(platform)[1]


@functools.lru_cache(maxsize=None)
def _registered_targets(platform: str) -> frozenset:
    module = _load(platform)[0] if platform in _MODULES else None
    return frozenset(module.registrations()) if module is not None else frozenset()


def has_target(platform: str, target: str) -> bool:
    """Whether the loaded module for ``platform`` registers the FFI target ``target``: the CUDA module
    has no qjl_compress (XLA's code is faster), which then runs the reference on the GPU (backend "auto")."""
    return target in _registered_targets(platform)


def missing_target_reason(platform: str, target: str) -> str:
    """Why ``target`` has no kernel on ``platform`` although the module loaded."""
    module_name = _MODULES[platform][0]
    return (f"{module_name} has no {target} (an op without a kernel on this platform, e.g. jax_tq_qjl_compress "
            "on CUDA, whose XLA code is faster); backend 'auto' runs the op's reference")


def module(platform: str):
    """The loaded kernel module for ``platform`` ("cpu" or "cuda"), or None."""
    return _load(platform)[0] if platform in _MODULES else None


def cuda_module():
    """The loaded CUDA module, or None."""
    return module("cuda")
