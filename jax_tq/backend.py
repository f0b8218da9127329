"""Backend selection: which implementation serves an op.

Backends:
  ``"auto"`` (default): the faster of the compiled FFI kernel and the pure-jnp reference for the
      platform the op is lowered for (:func:`auto_uses_reference`: on the GPU the kernels, except
      for the attention variants they do not implement yet, :func:`kernel_lacks`; on the CPU the
      C++ handlers of the attention ops and of fitted-scale compress / writes, XLA's code of the
      rest); the reference for float64 operands (x64) and where there is no kernel (e.g. a GPU
      build without CUDA kernels, or TPU).
  ``"ffi"``: the compiled FFI kernel only; lowering for a platform without one raises
      :class:`BackendUnavailableError`.
  ``"xla"``: the pure-jnp reference (:mod:`jax_tq.reference`), compiled by XLA.

The choice is read when an op is traced: the innermost :func:`use_backend` context wins, then the
environment variable ``JAX_TQ_BACKEND``, then ``"auto"``.
"""
from __future__ import annotations

import contextvars
import os
import warnings

import numpy as np

from jax_tq import _ffi

BACKENDS = ("auto", "ffi", "xla")
ENV_VAR = "JAX_TQ_BACKEND"

_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("jax_tq_backend", default=None)


#: Backend "auto" on the CPU: the ops whose jnp reference, compiled by XLA, beats the C++ handler
#: (2 cores, head_dim 64 / 128; docs/performance.md "CPU"): the handlers rotate in float64 one row at
#: a time, XLA in float32 as a matrix product. Fitted-scale compress / write_cache keep the handler
#: at every size: XLA's candidate search compiles 20-30x slower per call site (1.3-1.8 s: a 30-layer
#: model's prefill and decode loop spend a minute compiling it), and runs at most ~2x faster (64-256
#: tokens x 8 heads, d128), slower from 1024 rows at 2 and 3 bits (k2v2, 1024 tokens x 8 heads, d64:
#: 53.0 ms against 28.8); a fitted row's codes then do not depend on the call's size or sharding
#: (the two paths round the candidates' ties differently), and the handler is the path the quality
#: tables were measured through.
_CPU_REFERENCE_OPS = ("jax_tq_compress", "jax_tq_decompress", "jax_tq_write_cache", "jax_tq_qjl_compress",
                      "jax_tq_qjl_scores")


def auto_uses_reference(platform: str, target: str, avals_in, params: dict) -> bool:
    """Whether backend "auto" lowers FFI target ``target`` on ``platform`` to its jnp reference
    although a kernel exists, because XLA's code of the reference is faster there.

    Args:
      platform: "cpu", "cuda", ...; target: the FFI target name ("jax_tq_compress", ...).
      avals_in: the call's operand avals.
      params: the primitive's params (``fit_scale``, or ``k_fit_scale`` / ``v_fit_scale``).
    """
    if kernel_lacks(platform, target, avals_in, params):
        return True
    if platform != "cpu" or target not in _CPU_REFERENCE_OPS:
        return False
    return not any(params.get(prefix + "fit_scale") for prefix in ("", "k_", "v_"))


#: The attention targets, whose last operand is the per-head sinks (float32 [num_heads], or [0]: none).
ATTENTION_TARGETS = ("jax_tq_paged_decode", "jax_tq_paged_prefill")


def kernel_lacks(platform: str, target: str, avals_in, params: dict) -> str | None:
    """What the kernel of ``target`` on ``platform`` does not implement in this call, or None.

    No kernel takes float64 operands (the reference's, under ``jax_enable_x64``). The attention
    variants (``sliding_window``, ``soft_cap``, ``sinks``: :mod:`jax_tq.variants`) are served where
    the platform's kernel module lists the target in its ``variant_targets``: the CPU handlers and
    the CUDA ``paged_decode`` and ``paged_prefill`` kernels (a module without the list, e.g. an
    older build, serves none). Backend "auto" lowers another such call to the
    reference (XLA's code); backend "ffi" raises :class:`BackendUnavailableError` with this reason.

    Args:
      platform, target, avals_in, params: as :func:`auto_uses_reference`.
    """
    if any(getattr(a, "dtype", None) == np.float64 for a in avals_in):
        return "float64 operands (the kernels take float32, bfloat16 and float16; float64 is the reference's)"
    if platform == "cpu" or target not in ATTENTION_TARGETS:
        return None
    used = [name for name in ("sliding_window", "soft_cap") if params.get(name)]
    if avals_in and int(np.prod(avals_in[-1].shape)) > 0:
        used.append("sinks")
    if not used:
        return None
    if target in getattr(_ffi.module(platform), "variant_targets", ()):
        return None
    return f"the {platform.upper()} kernels do not implement {', '.join(used)} yet"


class BackendUnavailableError(RuntimeError):
    """An explicitly chosen backend cannot serve a call (e.g. ``"ffi"`` with no kernel built)."""


def _checked(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{source}: unknown jax_tq backend {name!r}; expected one of {BACKENDS}")
    return name


def get_backend() -> str:
    """The backend in force: ``"auto"``, ``"ffi"`` or ``"xla"``.

    Raises:
      ValueError: ``JAX_TQ_BACKEND`` holds an unknown name.
    """
    chosen = _override.get()
    if chosen is not None:
        return chosen
    return _checked(os.environ.get(ENV_VAR, "auto").strip().lower() or "auto", ENV_VAR)


def use_backend(name: str):
    """Context manager choosing the backend for ops traced inside it (``with`` only: a plain call
    changes nothing, and warns when its unused result is dropped).

    Example::

        with jax_tq.use_backend("xla"):
            out = jax_tq.paged_decode(q, cache, block_tables, seq_lens)

    Note that a ``jax.jit`` function traced once keeps the backend it was traced with: JAX caches
    the trace of ``jax.jit(jax_tq.paged_decode)``, so to compare backends jit a fresh wrapper inside
    each block (``jax.jit(lambda *a: jax_tq.paged_decode(*a))``) or call ``jax.clear_caches()``.
    The name is case-insensitive, as in ``JAX_TQ_BACKEND``; to set a process-wide default, use
    that environment variable.

    Raises:
      ValueError: ``name`` is not one of ``"auto"``, ``"ffi"``, ``"xla"`` (at the call, before the
        ``with`` block is entered).
    """
    return _BackendScope(_checked(name.strip().lower() if isinstance(name, str) else name, "use_backend"))


class _BackendScope:
    """The ``with`` block of :func:`use_backend` (re-entrant, nestable)."""

    def __init__(self, name: str):
        self._name = name
        self._tokens: list[contextvars.Token] = []
        self._entered = False

    def __enter__(self):
        self._entered = True
        self._tokens.append(_override.set(self._name))
        return self

    def __exit__(self, *exc_info):
        _override.reset(self._tokens.pop())
        return False

    def __del__(self, _warn=warnings.warn, _env=ENV_VAR):  # bound now: at exit the module globals may be None
        if not self._entered:
            _warn(f"jax_tq.use_backend({self._name!r}) was called without `with`, so it changed "
                  f"nothing: use `with jax_tq.use_backend({self._name!r}):`, or the {_env} "
                  f"environment variable for a process-wide default", RuntimeWarning, stacklevel=2)
