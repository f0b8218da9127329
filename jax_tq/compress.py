"""TurboQuant compress / decompress / cache write (K and V): functions and their primitives.

Implements TurboQuant_mse (Zandieh et al., "TurboQuant: Online Vector Quantization with Near-optimal
Distortion Rate", arXiv 2504.19874, Algorithm 1): store ||x|| in fp32, rotate x/||x|| by the codec's
random orthogonal Pi, quantize each rotated coordinate to the nearest Lloyd-Max centroid, pack the
b-bit indices (docs/FORMAT.md).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_tq import _compat, reference
from jax_tq import _primitive_utils as pu
from jax_tq.partitioning import Layout
from jax_tq.backend import get_backend
from jax_tq.codec import TurboQuant
from jax_tq.checks import as_array
from jax_tq.format import check_bits, packed_bytes

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)

compress_p = _compat.Primitive("jax_tq_compress")
decompress_p = _compat.Primitive("jax_tq_decompress")
write_cache_p = _compat.Primitive("jax_tq_write_cache")  # compress and write of K and V in one call


# ----------------------------------------------------------------------------- validation

def check_float_input(x, name: str, op: str) -> None:
    """Raise TypeError unless ``x`` is float32, bfloat16 or float16."""
    if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
        raise TypeError(f"jax_tq.{op}: {name} must be float32, bfloat16 or float16, got {x.dtype}")


def output_dtype(dtype, op: str):
    """``dtype`` as a jnp.dtype of FLOAT_DTYPES; TypeError naming ``jax_tq.{op}`` otherwise (None
    included: ``jnp.dtype(None)`` is float64)."""
    try:
        got = None if dtype is None else jnp.dtype(dtype)
    except TypeError:
        got = None
    if got is None or got not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
        shown = repr(dtype) if got is None else got.name
        raise TypeError(f"jax_tq.{op}: dtype must be float32, bfloat16 or float16, got {shown}")
    return got


def check_last_dim(x, head_dim: int, name: str, op: str) -> None:
    """Raise ValueError unless the last axis of ``x`` is the codec's ``head_dim``."""
    if x.ndim < 1 or x.shape[-1] != head_dim:
        raise ValueError(
            f"jax_tq.{op}: {name} has shape {tuple(x.shape)}; its last axis must be the codec's "
            f"head_dim {head_dim}"
        )


def check_packed_codec(codec, op: str, name: str = "codec") -> None:
    """Raise TypeError unless ``codec`` is a TurboQuant, ValueError unless ``codec.bits`` has a
    packed storage format (2, 3 or 4); messages call it ``name``."""
    if not isinstance(codec, TurboQuant):
        raise TypeError(f"jax_tq.{op}: {name} must be a jax_tq.TurboQuant, got {type(codec).__name__}")
    check_bits(codec.bits, name=f"jax_tq.{op}: {name}.bits")


# ----------------------------------------------------------------------------- public API

def compress(x, codec):
    """Compress vectors with TurboQuant_mse.

    Args:
      x: [..., head_dim] float32, bfloat16 or float16.
      codec: :class:`jax_tq.TurboQuant` with ``bits`` in {2, 3, 4} and ``head_dim == x.shape[-1]``.

    Returns:
      (codes, norms): codes uint8 [..., head_dim * bits / 8] packed as in docs/FORMAT.md, norms float32
      [...] (the L2 norm of each vector, in the units of x; for a ``scale="fit"`` codec the fitted
      least-squares scale, docs/FORMAT.md "Fitted scale"). A zero vector, or one whose norm is below
      ``jax_tq.format.MIN_NORM`` (2^-64), gives norm 0 and the codes of the zero vector.

    Raises:
      BackendUnavailableError: backend "ffi" where no kernel serves the call (when it is lowered).
      TypeError: x is not a float32/bfloat16/float16 array; codec is not a TurboQuant.
      ValueError: the last axis of x is not codec.head_dim; codec.bits has no packed format.

    Source: TurboQuant (arXiv 2504.19874), Algorithm 1 (Quant_mse) with the norm stored apart.

    Differentiable in x through the norms only, on every backend: d norm = <x, dx> / norm (0 for a
    vector stored as zero; for fitted scales d scale = <dx, Pi^T c[codes]> / |c[codes]|^2, the scale being
    linear in x for fixed codes); the codes are integers and get no gradient (rounding to centroids
    has none worth using).
    """
    x = as_array(x, "x", "compress")
    check_packed_codec(codec, "compress")
    check_float_input(x, "x", "compress")
    check_last_dim(x, codec.head_dim, "x", "compress")
    lead = x.shape[:-1]
    flat = x.reshape((-1, codec.head_dim))
    backend = get_backend()
    if backend == "xla":
        codes, norms = reference.compress(flat, codec.rotation, codec.centroids, codec.bits, codec.fit_scale)
    else:
        codes, norms = _compress_kernel(flat, codec, backend)
    return codes.reshape(lead + (codec.packed_bytes,)), norms.reshape(lead)


def decompress(codes, norms, codec, dtype=jnp.float32):
    """Reconstruct vectors: x_hat = norm * Pi^T c[codes] (TurboQuant, Algorithm 1, DeQuant).

    Args:
      codes: uint8 [..., head_dim * bits / 8] from :func:`compress`.
      norms: float32 [...] (same leading shape as codes).
      codec: the :class:`jax_tq.TurboQuant` that produced them. Codes carry no codec metadata: a
        codec of another head_dim and bits with the same packed row size (e.g. head_dim 64 at 3
        bits and 96 at 2 bits, 24 bytes each) is not detected, and the vectors decoded are wrong.
      dtype: output dtype, float32, bfloat16 or float16.

    Returns:
      [..., head_dim] array of ``dtype``.

    Raises:
      BackendUnavailableError: backend "ffi" where no kernel serves the call (when it is lowered).
      TypeError: codes not uint8, norms not float32 (or either not an array), unsupported dtype, codec
        not a TurboQuant.
      ValueError: shapes disagree with each other or with the codec; codec.bits has no packed
        format.

    Differentiable in ``norms`` (x_hat is linear in them: d x_hat = d norm * Pi^T c[codes]) on every
    backend; the codes are integers and get no gradient.
    """
    codes, norms = as_array(codes, "codes", "decompress"), as_array(norms, "norms", "decompress")
    check_packed_codec(codec, "decompress")
    dtype = output_dtype(dtype, "decompress")
    if codes.dtype != jnp.uint8:
        raise TypeError(f"jax_tq.decompress: codes must be uint8, got {codes.dtype}")
    if norms.dtype != jnp.float32:
        raise TypeError(f"jax_tq.decompress: norms must be float32, got {norms.dtype}")
    if codes.ndim < 1 or codes.shape[-1] != codec.packed_bytes or codes.shape[:-1] != norms.shape:
        raise ValueError(
            f"jax_tq.decompress: codes {tuple(codes.shape)} and norms {tuple(norms.shape)} do not match "
            f"codes [..., {codec.packed_bytes}] and norms [...] for head_dim {codec.head_dim}, bits {codec.bits}"
        )
    lead = norms.shape
    flat_codes = codes.reshape((-1, codec.packed_bytes))
    flat_norms = norms.reshape((-1,))
    backend = get_backend()
    if backend == "xla":
        x = reference.decompress(flat_codes, flat_norms, codec.rotation, codec.centroids, codec.bits, dtype)
    else:
        x = _decompress_kernel(flat_codes, flat_norms, codec, dtype, backend)
    return x.reshape(lead + (codec.head_dim,))


def window_rows(x, codec):
    """The rows a cache's recent-token window stores for vectors x: Pi x (the codec's rotation)
    rounded once to bfloat16 (docs/FORMAT.md "Window"); what :func:`jax_tq.write_cache` writes
    into the window to within one bfloat16 ulp (0.01-0.2% of the entries differ: the kernels round
    y in float32 differently), computed in jnp (float32, highest precision).

    Args:
      x: [..., head_dim] float32 / bfloat16 / float16.
      codec: :class:`jax_tq.TurboQuant` of head_dim ``x.shape[-1]``.
    Returns:
      bfloat16 [..., head_dim].
    Raises:
      TypeError / ValueError: as :func:`compress` (x's dtype, a codec that is not a TurboQuant, a
        last axis other than codec.head_dim).
    """
    x = as_array(x, "x", "window_rows")
    if not isinstance(codec, TurboQuant):
        raise TypeError(f"jax_tq.window_rows: codec must be a jax_tq.TurboQuant, got {type(codec).__name__}")
    check_float_input(x, "x", "window_rows")
    check_last_dim(x, codec.head_dim, "x", "window_rows")
    return reference.window_rows(x, codec.rotation)


def _norm_tangent(x, dx, norms):
    """d ||x|| = <x / ||x||, dx> per row of x [n, d] (0 for a zero row), float32 [n]."""
    inv = jnp.where(norms > 0, 1.0 / jnp.where(norms > 0, norms, 1.0), 0.0)
    return jnp.sum(x.astype(jnp.float32) * inv[:, None] * dx.astype(jnp.float32), axis=-1)


def _scale_tangent(x, dx, norms, codes, codec):
    """The tangent of the stored per-vector scale of rows x [n, d] along dx: d ||x|| for a
    ``scale="norm"`` codec; for ``"fit"``, <dx, r> / |r|^2 with r = Pi^T c[codes] (the fitted
    scale ||x|| <y, c> / |c|^2 = <x, r> / |r|^2 is linear in x for fixed codes). float32 [n]."""
    if not codec.fit_scale:
        return _norm_tangent(x, dx, norms)
    ones = jnp.ones(codes.shape[:-1], jnp.float32)
    direction = reference.decompress(codes, ones, codec.rotation, codec.centroids, codec.bits)
    tangent = jnp.sum(dx.astype(jnp.float32) * direction, axis=-1) / jnp.sum(direction * direction, axis=-1)
    return jnp.where(norms == 0, 0.0, tangent)   # stored as zero: 0 on every backend


def _float0_zeros(a):
    return _compat.float0_zeros_like(a)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _compress_kernel(flat, codec, backend):
    """The compress kernel on flat rows; its JVP is the norms' (the codes are integers)."""
    return tuple(compress_p.bind(flat, codec.rotation, codec.centroids, bits=codec.bits, fit_scale=codec.fit_scale,
                                 backend=backend))


@_compress_kernel.defjvp
def _compress_kernel_jvp(codec, backend, primals, tangents):
    codes, norms = _compress_kernel(primals[0], codec, backend)
    return (codes, norms), (_float0_zeros(codes), _scale_tangent(primals[0], tangents[0], norms, codes, codec))


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3, 4))
def _decompress_kernel(codes, norms, codec, dtype, backend):
    """The decompress kernel on flat rows; its JVP in norms is norms' tangent times Pi^T c[codes]."""
    (x,) = decompress_p.bind(codes, norms, codec.rotation, codec.centroids, bits=codec.bits, dtype=dtype,
                             backend=backend)
    return x


@_decompress_kernel.defjvp
def _decompress_kernel_jvp(codec, dtype, backend, primals, tangents):
    codes, norms = primals
    d_norms = tangents[1]
    directions = _decompress_kernel(codes, jnp.ones_like(norms), codec, jnp.dtype(jnp.float32), backend)
    return _decompress_kernel(codes, norms, codec, dtype, backend), (d_norms[:, None] * directions).astype(dtype)


def write_cache_pools(k, v, k_pools, v_pools, k_codec, v_codec, slot_mapping, windows=None, window_slots=None):
    """Compress K and V of new tokens and write both into their page pools (and windows) in ONE kernel call.

    What :func:`jax_tq.write_cache` runs: on the GPU one launch serves both (a decode step's write
    is latency-bound, so a second launch would cost as much as the first).

    Args:
      k, v: [num_tokens, num_kv_heads, head_dim] float32/bfloat16/float16.
      k_pools, v_pools: (codes uint8 [num_pages, num_kv_heads, page_size, packed_bytes],
        norms float32 [num_pages, num_kv_heads, page_size]) of K and of V.
      k_codec, v_codec: the pools' :class:`jax_tq.TurboQuant` codecs.
      slot_mapping: int32 [num_tokens], shared by K and V; token i goes to page
        slot_mapping[i] // page_size, offset slot_mapping[i] % page_size. Negative or out-of-pool
        slots are skipped; tokens sharing a slot leave one of them (under differentiation the last).
      windows: None, or (k_window, v_window) bfloat16 [num_windows, num_kv_heads, window, head_dim].
      window_slots: int32 [num_tokens] ring entries (with ``windows``; negative or past the pool:
        not written).

    Returns:
      (k_codes, k_norms, v_codes, v_norms, k_window, v_window), the updated pools (the windows None
      without ``windows``), aliased to the inputs of the FFI call (in place under donation).

    Raises:
      TypeError / ValueError on dtypes and shapes that do not match (message names the argument),
      and ValueError when the K and V pools differ in num_pages or page_size.
    Source: TurboQuant (arXiv 2504.19874), Algorithm 1 per token; page layout of docs/FORMAT.md.
    """
    check_packed_codec(k_codec, "write_cache", "k_codec")
    check_packed_codec(v_codec, "write_cache", "v_codec")
    _check_write_args(k, *k_pools, k_codec, slot_mapping, "k")
    _check_write_args(v, *v_pools, v_codec, slot_mapping, "v")
    if k_pools[1].shape[::2] != v_pools[1].shape[::2]:  # (num_pages, page_size): one slot_mapping
        raise ValueError(
            f"jax_tq.write_cache: the K and V pools must have the same num_pages and page_size (one "
            f"slot_mapping addresses both), got K norms {tuple(k_pools[1].shape)} and V norms "
            f"{tuple(v_pools[1].shape)}")
    has_window = windows is not None
    if not has_window:
        windows = tuple(empty_window(k.shape[1], k_codec.head_dim) for _ in range(2))
        window_slots = jnp.full(k.shape[:1], -1, jnp.int32)
    backend = get_backend()
    if backend == "xla":
        outs = _write_cache_reference(k, v, *k_pools, *v_pools, k_codec.rotation, k_codec.centroids, v_codec.rotation,
                                   v_codec.centroids, slot_mapping, *windows, window_slots, k_bits=k_codec.bits,
                                   v_bits=v_codec.bits, k_fit_scale=k_codec.fit_scale, v_fit_scale=v_codec.fit_scale)
    else:
        outs = _write_cache_kernel(k, v, *k_pools, *v_pools, slot_mapping, *windows, window_slots, k_codec, v_codec,
                                backend)
    return tuple(outs[:4]) + (tuple(outs[4:]) if has_window else (None, None))


def empty_window(num_kv_heads: int, head_dim: int):
    """The window operand of a cache without a window: bfloat16 [0, num_kv_heads, 0, head_dim]."""
    return jnp.zeros((0, num_kv_heads, 0, head_dim), jnp.bfloat16)


@functools.partial(jax.custom_jvp, nondiff_argnums=(10, 11, 12))
def _write_cache_kernel(k, v, k_codes, k_norms, v_codes, v_norms, slot_mapping, k_window, v_window, window_slots,
                     k_codec, v_codec, backend):
    """The fused K+V write; its JVP carries the pools' norm tangents, with the written slots'
    replaced by the new tokens' scale tangents, and the windows' tangents, with the written entries'
    replaced by Pi k_dot / Pi v_dot (the codes are integers)."""
    return tuple(pu.bind(
        write_cache_p, k, v, k_codes, k_norms, v_codes, v_norms, k_codec.rotation, k_codec.centroids, v_codec.rotation,
        v_codec.centroids, slot_mapping, k_window, v_window, window_slots, rotation_spec(k_codec, v_codec),
        k_bits=k_codec.bits, v_bits=v_codec.bits, k_fit_scale=k_codec.fit_scale, v_fit_scale=v_codec.fit_scale,
        backend=backend))


def rotation_spec(k_codec: TurboQuant, v_codec: TurboQuant):
    """The write kernels' rotation_spec operand: int32 [2, d], the Hadamard spec rows
    (:func:`jax_tq.format.hadamard_spec`) of K's and V's rotation where both are Hadamard rotations of
    one head_dim (the CUDA handler may then rotate in O(d log d)), else int32 [2, 0]. Either way the
    dense rotations define Pi."""
    k_spec, v_spec = k_codec.hadamard_spec, v_codec.hadamard_spec
    if k_spec is None or v_spec is None or k_codec.head_dim != v_codec.head_dim:
        return jnp.zeros((2, 0), jnp.int32)
    return jnp.asarray(np.stack([k_spec, v_spec]), jnp.int32)


def _last_writer_slots(slots):
    """``slots`` with every token but the last of each repeated slot set to -1 (skipped): one writer
    per slot, so the tangents follow the token that was stored."""
    order = jnp.argsort(slots, stable=True)  # equal slots keep token order: the last is the latest
    sorted_slots = slots[order]
    last_in_run = jnp.concatenate([sorted_slots[1:] != sorted_slots[:-1], jnp.ones(min(1, slots.shape[0]), bool)])
    keep = jnp.zeros(slots.shape, bool).at[order].set(last_in_run)
    return jnp.where(keep, slots, -1)


@_write_cache_kernel.defjvp
def _write_cache_kernel_jvp(k_codec, v_codec, backend, primals, tangents):
    # Under differentiation a repeated slot keeps its last token (one of the outcomes write_cache
    # allows), so that the stored norm and its tangent come from the same token.
    k, v, k_codes, k_norms, v_codes, v_norms, slots, k_window, v_window, window_slots = primals
    slots = _last_writer_slots(slots)
    outs = _write_cache_kernel(k, v, k_codes, k_norms, v_codes, v_norms, slots, k_window, v_window, window_slots,
                            k_codec, v_codec, backend)
    num_pages, _, page_size = k_norms.shape
    valid = (slots >= 0) & (slots < num_pages * page_size)
    page = jnp.where(valid, slots // page_size, num_pages)  # out of range: dropped by the scatter
    offset = jnp.where(valid, slots % page_size, 0)

    def scatter(pool_dot, x, x_dot, new_codes, new_norms, codec):
        # skipped tokens (padding, maybe NaN / inf) as zeros: their gradient is exactly 0
        x = jnp.where(valid[:, None, None], x, 0)
        flat_x, flat_dot = x.reshape(-1, x.shape[-1]), x_dot.reshape(-1, x.shape[-1])
        heads = jnp.arange(x.shape[1])[None, :]
        rows_norms = new_norms[page[:, None], heads, offset[:, None]].reshape(-1)
        rows_codes = new_codes[jnp.minimum(page, num_pages - 1)[:, None], heads, offset[:, None]]
        dn = _scale_tangent(flat_x, flat_dot, rows_norms, rows_codes.reshape(-1, rows_codes.shape[-1]), codec)
        dn = jnp.where(valid[:, None], dn.reshape(x.shape[:2]), 0.0)
        return _tangent_set(pool_dot, page, offset, dn)

    k_norms_dot = scatter(tangents[3], k, tangents[0], outs[0], outs[1], k_codec)
    v_norms_dot = scatter(tangents[5], v, tangents[1], outs[2], outs[3], v_codec)
    k_window_dot = _compat.varying_like(_window_tangent(tangents[7], tangents[0], window_slots, k_codec.rotation),
                                        outs[4])
    v_window_dot = _compat.varying_like(_window_tangent(tangents[8], tangents[1], window_slots, v_codec.rotation),
                                        outs[5])
    zero = _float0_zeros
    return outs, (zero(k_codes), k_norms_dot, zero(v_codes), v_norms_dot, k_window_dot, v_window_dot)


def _window_tangent(window_dot, x_dot, window_slots, rotation):
    """The window pool's tangent after a write: Pi x_dot (the rows are Pi x, rounded to bfloat16,
    taken as exact) at the entries written, the pool's own tangent at the others."""
    num_windows, _, length, _ = window_dot.shape
    if num_windows * length == 0:
        return window_dot
    valid = (window_slots >= 0) & (window_slots < num_windows * length)
    ids = jnp.where(valid, window_slots // length, num_windows)   # not written: dropped by the scatters
    entries = jnp.where(valid, window_slots % length, 0)
    rows = jnp.matmul(x_dot.astype(jnp.float32), rotation.T, precision=jax.lax.Precision.HIGHEST)
    return _tangent_set(window_dot, ids, entries, rows)


def _tangent_set(pool_dot, first, second, values):
    """``pool_dot`` with entries ``[first[i], :, second[i]]`` set to ``values[i]`` (out of range:
    dropped), as the unwritten entries kept plus a scatter-add at the written ones: a scatter-add
    transposes, a scatter-set does only with unique indices."""
    zeros = jnp.zeros(pool_dot.shape, jnp.float32)
    written = zeros.at[first, :, second].add(1.0, mode="drop") > 0
    kept = jnp.where(written, 0.0, pool_dot.astype(jnp.float32))
    return (kept + zeros.at[first, :, second].add(values, mode="drop")).astype(pool_dot.dtype)


def _check_write_args(x, codes, norms, codec, slot_mapping, name="k/v") -> None:
    op = "write_cache"
    check_float_input(x, name, op)
    if x.ndim != 3:
        raise ValueError(f"jax_tq.{op}: {name} must be [num_tokens, num_kv_heads, head_dim], got shape {tuple(x.shape)}")
    check_last_dim(x, codec.head_dim, name, op)
    num_tokens, num_kv_heads, _ = x.shape
    if codes.ndim == 4 and codes.shape[3] == codec.packed_bytes and codes.shape[1] != num_kv_heads:
        raise ValueError(
            f"jax_tq.{op}: {name} has {num_kv_heads} KV heads (shape {tuple(x.shape)}) but the cache has "
            f"{codes.shape[1]} (its {name}_codes are {tuple(codes.shape)} = [num_pages, num_kv_heads, page_size, "
            f"packed_bytes])"
        )
    if codes.ndim != 4 or codes.shape[3] != codec.packed_bytes:
        raise ValueError(
            f"jax_tq.{op}: cache.{name}_codes has shape {tuple(codes.shape)}, expected [num_pages, {num_kv_heads}, "
            f"page_size, {codec.packed_bytes}] for {name} with {num_kv_heads} KV heads and the codec "
            f"(head_dim {codec.head_dim}, bits {codec.bits})"
        )
    if codes.dtype != jnp.uint8:
        raise TypeError(f"jax_tq.{op}: cache {name} codes must be uint8, got {codes.dtype}")
    if norms.dtype != jnp.float32 or norms.shape != codes.shape[:3]:
        raise ValueError(
            f"jax_tq.{op}: cache {name} norms {norms.dtype}{tuple(norms.shape)} do not match codes "
            f"{tuple(codes.shape)}: expected float32{tuple(codes.shape[:3])}"
        )
    check_slot_mapping_shape(slot_mapping, num_tokens)


def check_slot_mapping_shape(slot_mapping, num_tokens: int) -> None:
    """TypeError unless ``slot_mapping`` is int32, ValueError unless of shape [num_tokens]."""
    if slot_mapping.dtype != jnp.int32 or slot_mapping.shape != (num_tokens,):
        raise (TypeError if slot_mapping.dtype != jnp.int32 else ValueError)(
            f"jax_tq.write_cache: slot_mapping must be int32 [{num_tokens}], got "
            f"{slot_mapping.dtype}{tuple(slot_mapping.shape)}"
        )


# ----------------------------------------------------------------------------- abstract eval

def _compress_abstract(x, rotation, centroids, *, bits, fit_scale, backend):
    n, d = x.shape
    inputs = (x, rotation, centroids)
    return (_compat.output_aval((n, packed_bytes(d, bits)), jnp.uint8, *inputs),
            _compat.output_aval((n,), jnp.float32, *inputs))


def _decompress_abstract(codes, norms, rotation, centroids, *, bits, dtype, backend):
    return (_compat.output_aval((codes.shape[0], rotation.shape[0]), dtype, codes, norms, rotation, centroids),)


def _write_cache_abstract(k, v, k_codes, k_norms, v_codes, v_norms, k_rot, k_cent, v_rot, v_cent, slots, k_window,
                       v_window, window_slots, rotation_spec, **params):
    inputs = (k, v, k_codes, k_norms, v_codes, v_norms, k_rot, k_cent, v_rot, v_cent, slots, k_window, v_window,
              window_slots)
    return tuple(_compat.output_aval(a.shape, a.dtype, *inputs)
                 for a in (k_codes, k_norms, v_codes, v_norms, k_window, v_window))


# ----------------------------------------------------------------------------- lowering

def _compress_reference(x, rotation, centroids, *, bits, fit_scale):
    return reference.compress(x, rotation, centroids, bits, fit_scale)


def _decompress_reference(codes, norms, rotation, centroids, *, bits, dtype):
    return (reference.decompress(codes, norms, rotation, centroids, bits, dtype),)


def _flat_pools(codes, norms):
    """Pools with vmap's leading batch axes folded into num_pages (the FFI handlers do the same)."""
    return codes.reshape((-1,) + codes.shape[-3:]), norms.reshape((-1,) + norms.shape[-2:])


def _pool_write_reference(x, codes, norms, rotation, centroids, slot_mapping, *, bits, fit_scale):
    new_codes, new_norms = reference.write_cache_pool(x, *_flat_pools(codes, norms), rotation, centroids,
                                                    slot_mapping, bits, fit_scale)
    return new_codes.reshape(codes.shape), new_norms.reshape(norms.shape)


def _window_write_reference(x, window, rotation, window_slots):
    if window.size == 0:  # no window
        return window
    flat = window.reshape((-1,) + window.shape[-3:])  # vmap's leading axes folded into num_windows
    rows = reference.window_write(x, flat, rotation, window_slots)
    return rows.reshape(window.shape)


def _write_cache_reference(k, v, k_codes, k_norms, v_codes, v_norms, k_rot, k_cent, v_rot, v_cent, slots, k_window,
                        v_window, window_slots, rotation_spec=None, *, k_bits, v_bits, k_fit_scale, v_fit_scale):
    k_new = _pool_write_reference(k, k_codes, k_norms, k_rot, k_cent, slots, bits=k_bits, fit_scale=k_fit_scale)
    v_new = _pool_write_reference(v, v_codes, v_norms, v_rot, v_cent, slots, bits=v_bits, fit_scale=v_fit_scale)
    return (*k_new, *v_new, _window_write_reference(k, k_window, k_rot, window_slots),
            _window_write_reference(v, v_window, v_rot, window_slots))


def _compress_ffi(ctx, *operands, bits, fit_scale):
    return _compat.ffi_lowering("jax_tq_compress")(ctx, *operands, bits=np.int32(bits), fit_scale=np.int32(fit_scale))


def _decompress_ffi(ctx, *operands, bits, dtype):
    return _compat.ffi_lowering("jax_tq_decompress")(ctx, *operands, bits=np.int32(bits))


def _write_cache_ffi(ctx, *operands, k_bits, v_bits, k_fit_scale, v_fit_scale):
    aliases = {2: 0, 3: 1, 4: 2, 5: 3}
    if not pu.has_zero_size(ctx.avals_in[11:13]):  # a window (an empty one is a constant: no alias, no copy)
        aliases.update({11: 4, 12: 5})
    rule = _compat.ffi_lowering("jax_tq_write_cache", operand_output_aliases=aliases)
    return rule(ctx, *operands, k_bits=np.int32(k_bits), v_bits=np.int32(v_bits), k_fit_scale=np.int32(k_fit_scale),
                v_fit_scale=np.int32(v_fit_scale))




# ----------------------------------------------------------------------------- batching

def _compress_batch(args, dims, **params):
    return pu.rows_batch(compress_p, 1, ("rotation", "centroids"), args, dims, **params)


def _decompress_batch(args, dims, **params):
    return pu.rows_batch(decompress_p, 2, ("rotation", "centroids"), args, dims, **params)


def _pool_slots(norms_batched):
    """Slots of one batch element's pool: norms [batch, ..., num_pages, num_kv_heads, page_size]."""
    return math.prod(norms_batched.shape[1:-2]) * norms_batched.shape[-1]


def _write_cache_batch(args, dims, **params):
    """vmap of a K+V cache write: each batch element gets its own pools and windows (shared ones are
    broadcast); they keep their batch axis, the handlers fold it into num_pages / num_windows."""
    k, v, kc, kn, vc, vn, k_rot, k_cent, v_rot, v_cent, slots, kw, vw, wslots, spec = args
    pu.require_unbatched(("k rotation", "k centroids", "v rotation", "v centroids"), dims[6:10], "write_cache")
    pu.require_unbatched(("rotation spec",), dims[14:], "write_cache")
    size = pu.batch_size(args, dims)
    batched = (k, v, kc, kn, vc, vn, slots, kw, vw, wslots)
    batched_dims = dims[:6] + dims[10:14]
    k, v, kc, kn, vc, vn, slots, kw, vw, wslots = [pu.move_batch_to_front(a, d, size)
                                                   for a, d in zip(batched, batched_dims)]
    folded_slots = pu.fold_pool_batch(slots, size, _pool_slots(kn)).reshape(-1)
    folded_wslots = pu.fold_pool_batch(wslots, size, math.prod(kw.shape[1:-3]) * kw.shape[-2]).reshape(-1)
    fold = lambda a: a.reshape((-1,) + a.shape[2:])  # noqa: E731
    # The pools keep their batch axis: a reshape would make XLA copy the donated pools.
    outs = write_cache_p.bind(fold(k), fold(v), kc, kn, vc, vn, k_rot, k_cent, v_rot, v_cent,
                           folded_slots, kw, vw, folded_wslots, spec, **params)
    return list(outs), [0] * 6


# ----------------------------------------------------------------------------- the ops

# Dim roles for partitioning (jax_tq/partitioning.py): rows are split over any mesh axes; a write
# splits KV heads, and its new tokens only together with the pages (each shard owning its pages).
_CODEC = ((None, None), (None,))  # rotation [d, d], centroids [2^bits]
_POOLS = (("page", "kv", None, None), ("page", "kv", None))  # codes, norms
_WINDOW = ("window", "kv", None, None)
_COMPRESS_LAYOUT = Layout(operands=(("seq", None),) + _CODEC, results=(("seq", None), ("seq",)))
_DECOMPRESS_LAYOUT = Layout(operands=(("seq", None), ("seq",)) + _CODEC, results=(("seq", None),))
_WRITE_LAYOUT = Layout(
    operands=(("seq", "kv", None),) * 2 + _POOLS * 2 + _CODEC * 2
    + (("seq",), _WINDOW, _WINDOW, ("seq",), (None, None)),
    results=_POOLS * 2 + (_WINDOW, _WINDOW), seq_needs_pages=True)

pu.define_op(compress_p, abstract=_compress_abstract, reference=_compress_reference, ffi=_compress_ffi,
             batch=_compress_batch, layout=_COMPRESS_LAYOUT)
pu.define_op(decompress_p, abstract=_decompress_abstract, reference=_decompress_reference, ffi=_decompress_ffi,
             batch=_decompress_batch, layout=_DECOMPRESS_LAYOUT)
pu.define_op(write_cache_p, abstract=_write_cache_abstract, reference=_write_cache_reference, ffi=_write_cache_ffi,
             batch=_write_cache_batch, may_be_empty=(11, 12, 14),  # no window; no rotation spec
             results_may_be_empty=(4, 5), layout=_WRITE_LAYOUT)
