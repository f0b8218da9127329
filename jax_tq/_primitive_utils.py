"""Machinery shared by the primitive modules (compress.py, paged_decode.py, paged_prefill.py, qjl.py).

A jax_tq primitive has: an impl that jit-compiles its own bind, an abstract eval, a lowering per
platform (the FFI kernel, or the reference through ``mlir.lower_fun`` when the backend is "auto"
and no kernel exists for that platform or :func:`jax_tq.backend.auto_uses_reference` prefers it),
and a batching rule; each op module gives them in one :func:`define_op` call per op.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_tq import _compat, _ffi, partitioning
from jax_tq.backend import BackendUnavailableError, auto_uses_reference, kernel_lacks
from jax_tq.format import INDEX_MAX

_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


@functools.lru_cache(maxsize=None)
def _jitted_bind(prim, params: tuple):
    return jax.jit(functools.partial(prim.bind, **dict(params)))


def bind(prim, *operands, **params):
    """``prim.bind(*operands, **params)``, with the zero-size operands (a mode of the kernels: no
    rotation spec, no window, no sinks) made inside a ``jax.jit`` around the bind instead of passed
    in. An eager ``shard_map`` compiles each primitive it meets with its operands as they are, and
    XLA's compiler of jax 0.11 (Shardy, CPU) crashed on such a program given a zero-size array;
    the jit makes the whole bind one program that creates them itself. Under an outer jit the
    inner one is inlined."""
    empty = tuple((i, tuple(x.shape), jnp.dtype(x.dtype)) for i, x in enumerate(operands) if 0 in tuple(x.shape))
    if not empty:
        return prim.bind(*operands, **params)
    empty_at = {i for i, _, _ in empty}
    kept = [x for i, x in enumerate(operands) if i not in empty_at]
    return _bind_making_empty(prim, tuple(sorted(params.items())), empty)(*kept)


@functools.lru_cache(maxsize=None)
def _bind_making_empty(prim, params: tuple, empty: tuple):
    def call(*kept):
        operands = list(kept)
        for i, shape, dtype in empty:  # ascending indices: each lands where it was
            operands.insert(i, jnp.zeros(shape, dtype))
        return prim.bind(*operands, **dict(params))

    return jax.jit(call)


def define_op(prim, *, abstract: Callable, reference: Callable, ffi: Callable, batch: Callable,
              may_be_empty: Sequence[int] = (), results_may_be_empty: Sequence[int] = (),
              layout: partitioning.Layout | None = None) -> None:
    """Everything JAX needs of a jax_tq primitive (its results a tuple), given in one place per op.

    Args:
      prim: the primitive, named as its FFI target ("jax_tq_<op>").
      abstract: the abstract eval, ``(*avals, **params) -> tuple of avals``.
      reference: the pure-jnp version, ``(*operands, **params without backend) -> tuple``.
      ffi: the FFI lowering, ``(ctx, *operands, **params without backend) -> results``.
      batch: the batching rule (vmap), ``(args, dims, **params) -> (outputs, out_dims)``.
      may_be_empty, results_may_be_empty: see :func:`register_lowerings`.
      layout: the dim roles of the op's operands and results (:class:`jax_tq.partitioning.Layout`):
        with one (and :func:`jax_tq.partitioning.enabled`), ``prim`` lowers through
        custom_partitioning to a per-shard twin primitive that carries the lowerings, so that a
        jitted call with sharded inputs runs on each device's slice.
    """
    prim.multiple_results = True
    prim.def_abstract_eval(abstract)
    define_impl(prim)
    if layout is None or not partitioning.enabled():
        register_lowerings(prim, reference, ffi, may_be_empty, results_may_be_empty)
    else:
        _compat.require_devices_at_lowering(prim)
        twin = partitioning.twin_primitive(prim)
        twin.def_abstract_eval(abstract)
        register_lowerings(twin, reference, ffi, may_be_empty, results_may_be_empty, target=prim.name)
        for platform in _PLATFORMS:
            _compat.mlir.register_lowering(prim, partitioning.lowering(prim, twin, layout), platform=platform)
    _compat.batching.primitive_batchers[prim] = batch


def define_impl(prim) -> None:
    """Eager calls of ``prim`` run through a cached ``jax.jit`` of its bind."""

    def impl(*args, **params):
        return _jitted_bind(prim, tuple(sorted(params.items())))(*args)

    prim.def_impl(impl)


def has_zero_size(avals: Sequence[Any]) -> bool:
    """Whether any of ``avals`` has no elements (kernels are never launched on empty arrays)."""
    return any(int(np.prod(a.shape)) == 0 for a in avals)


def register_lowerings(
    prim,
    reference_impl: Callable[..., Any],
    ffi_rule: Callable[..., Any],
    may_be_empty: Sequence[int] = (),
    results_may_be_empty: Sequence[int] = (),
    target: str | None = None,
) -> None:
    """Register a lowering for every platform.

    ``ffi_rule(ctx, *operands, **params)`` emits the FFI custom call; ``reference_impl(*operands,
    **params)`` is the pure-jnp version used for empty arrays and, under backend "auto", on platforms
    without kernels. Both receive the primitive's params without ``backend``. ``may_be_empty``: the
    operand indices whose zero size is a mode of the kernel (e.g. no rotation, no window), not an
    empty input; ``results_may_be_empty`` likewise for results. ``target``: the FFI target
    (default ``prim.name``).
    """
    for platform in _PLATFORMS:
        _compat.mlir.register_lowering(
            prim, functools.partial(_lower, platform, target or prim.name, reference_impl, ffi_rule, tuple(may_be_empty),
                                    tuple(results_may_be_empty)),
            platform=platform,
        )


def _lower(platform, target, reference_impl, ffi_rule, may_be_empty, results_may_be_empty, ctx, *operands,
           backend: str, **params):
    use_kernel = _ffi.kernels_available(platform) and _ffi.has_target(platform, target)
    if not use_kernel and backend == "ffi":
        reason = (_ffi.unavailable_reason(platform) if not _ffi.kernels_available(platform)
                  else _ffi.missing_target_reason(platform, target))
        raise BackendUnavailableError(
            f"jax_tq backend 'ffi' was chosen but cannot serve {platform!r}: {reason}. Use backend 'auto' or 'xla'."
        )
    lacks = use_kernel and backend == "ffi" and kernel_lacks(platform, target, ctx.avals_in, params)
    if lacks:
        raise BackendUnavailableError(
            f"jax_tq backend 'ffi' was chosen but cannot serve this {target} call on {platform!r}: {lacks}. Use "
            "backend 'auto' (it runs XLA's code of the reference there) or 'xla'."
        )
    inputs = [a for i, a in enumerate(ctx.avals_in) if i not in may_be_empty]
    results = [a for i, a in enumerate(ctx.avals_out) if i not in results_may_be_empty]
    faster_reference = backend == "auto" and auto_uses_reference(platform, target, ctx.avals_in, params)
    if not use_kernel or faster_reference or has_zero_size(inputs) or has_zero_size(results):
        fallback = functools.partial(reference_impl, **params)
        return _compat.mlir.lower_fun(fallback, multiple_results=True)(ctx, *operands)
    return ffi_rule(ctx, *operands, **params)


def move_batch_to_front(x, bdim, size: int):
    """Move ``bdim`` of ``x`` to axis 0, broadcasting an unbatched operand to ``size``."""
    if bdim is _compat.NOT_MAPPED:
        return jax.numpy.broadcast_to(x, (size,) + x.shape)
    return jax.numpy.moveaxis(x, bdim, 0)


def batch_size(args, dims) -> int:
    """The vmapped axis size from the first batched operand."""
    for x, d in zip(args, dims):
        if d is not _compat.NOT_MAPPED:
            return x.shape[d]
    raise AssertionError("batching rule called with no batched operand")


def require_unbatched(names: Sequence[str], dims: Sequence[Any], op: str) -> None:
    """Raise a clear error if a codec operand (rotation, centroids) is vmapped."""
    for name, d in zip(names, dims):
        if d is not _compat.NOT_MAPPED:
            raise NotImplementedError(
                f"jax_tq.{op}: vmap over the codec's {name} is not supported; close over one codec "
                "(the same rotation and centroids for the whole batch)."
            )


def require_unbatched_sinks(dim, op: str) -> None:
    """Raise a clear error if the attention sinks (one logit per query head) are vmapped."""
    if dim is not _compat.NOT_MAPPED:
        raise NotImplementedError(
            f"jax_tq.{op}: vmap over sinks is not supported: they are one logit per query head, shared by the "
            "batch; close over one sinks array (or fold the batch into the sequences yourself)."
        )


def rows_batch(prim, n_row_operands: int, codec_names: Sequence[str], args, dims, **params):
    """Batching rule of a row-wise primitive: fold the vmapped axis into the row axis (axis 0) of the
    first ``n_row_operands`` operands; the rest are the codec's (named ``codec_names``, never
    batched). Returns (outputs [size, rows, ...], batch dims)."""
    require_unbatched(codec_names, dims[n_row_operands:], prim.name)
    size = batch_size(args, dims)
    rows = [move_batch_to_front(a, d, size) for a, d in zip(args[:n_row_operands], dims[:n_row_operands])]
    n = rows[0].shape[1]
    folded = [r.reshape((size * n,) + r.shape[2:]) for r in rows]
    outs = prim.bind(*folded, *args[n_row_operands:], **params)
    return [o.reshape((size, n) + o.shape[1:]) for o in outs], [0] * len(outs)


def fold_pool_batch(block_ids, batch: int, pool_size: int):
    """Offset per-batch page (or slot) ids into a pool of ``batch * pool_size`` entries.

    ``block_ids`` is [batch, ...] int32; entries outside [0, pool_size) stay invalid (become -1).

    Raises:
      ValueError: the folded pool has more entries than int32 ids address (a vmap over caches whose
        pages or slots add up past 2^31 - 1: their ids would wrap and the writes or reads be skipped).
    """
    batch, pool_size = int(batch), int(pool_size)
    largest_id = (batch - 1) * pool_size + min(pool_size, INDEX_MAX + 1) - 1  # ids are int32: < 2^31 each
    if batch > 1 and largest_id > INDEX_MAX:
        raise ValueError(f"jax_tq: vmap over {batch} caches of {pool_size} pages or slots each folds them into one "
                         f"pool whose ids reach {largest_id}, past int32 (2^31 - 1); vmap over fewer caches at a "
                         "time (e.g. lax.map over chunks of the batch)")
    jnp = jax.numpy
    offsets = (jnp.arange(batch, dtype=jnp.int32) * pool_size).reshape((batch,) + (1,) * (block_ids.ndim - 1))
    valid = (block_ids >= 0) & (block_ids < pool_size)
    return jnp.where(valid, block_ids + offsets, -1).astype(jnp.int32)
