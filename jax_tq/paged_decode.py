"""Split-K paged decode attention over a TurboQuant-compressed KV cache.

Queries are rotated once into K's rotated space (q_rot = Pi_k q), scored against the K centroids
scaled by each key's fp32 norm, and the softmax-weighted V centroids (scaled by V norms) are rotated
back once (out = Pi_v^T o_rot): TurboQuant (arXiv 2504.19874), Algorithm 1, applied to attention; split-K
"flash decoding" with a log-sum-exp combine (Dao et al., Flash-Decoding, 2023).
"""
from __future__ import annotations

import functools
import math
import operator
import os

import jax
import jax.numpy as jnp
import numpy as np

from jax_tq import _compat, reference
from jax_tq import format as tq_format, rotation as tq_rotation
from jax_tq import _ffi as ffi_loader
from jax_tq import _primitive_utils as pu
from jax_tq.backend import get_backend
from jax_tq.cache import check_cache
from jax_tq.checks import check_decode_indices, check_window_ids, reject_checkify_residuals
from jax_tq.compress import empty_window

paged_decode_p = _compat.Primitive("jax_tq_paged_decode")
paged_decode_p.multiple_results = True

_FLOAT32_MAX = float(np.finfo(np.float32).max)
_LOG2E = 1.4426950408889634  # the kernels take scores in log2 units: scale * log2(e) in float32

#: Each split streams at least this many tokens, so its prefetch has work to overlap and the
#: combine stays cheap next to the split's own work.
MIN_TOKENS_PER_SPLIT = 256


def paged_decode(q, cache, block_tables, seq_lens, *, window_ids=None, scale=None, num_splits=None,
                 precision=None):
    """Decode attention of one query token per sequence over a compressed paged KV cache.

    Args:
      q: [num_seqs, num_heads, head_dim] float32/bfloat16/float16 queries (one token per sequence).
        num_heads must be a multiple of ``cache.num_kv_heads`` (GQA); query head h reads KV head
        h // (num_heads // num_kv_heads).
      cache: :class:`jax_tq.PagedKVCache`.
      block_tables: int32 [num_seqs, max_pages]; logical page j of sequence i is physical page
        block_tables[i, j]. Only the first ceil(seq_lens[i] / page_size) entries are read; an entry
        outside [0, num_pages) is skipped (see docs/FORMAT.md; use checked mode to catch it).
      seq_lens: int32 [num_seqs], number of cached tokens each query attends to, clamped to
        [0, max_pages * page_size]. A sequence with 0 tokens gets an all-zero output.
      window_ids: int32 [num_seqs], for a cache with a window: the window id of each sequence, whose
        last min(seq_len, window) tokens are read from the window (exact) instead of the pages, in the
        same softmax; default ``arange(num_seqs)``. An id outside [0, num_windows) contributes no
        window token (checked mode reports it). Must be None for a cache without a window.
      scale: softmax scale, a finite Python or NumPy number with |scale| * log2(e) within float32
        (|scale| <= ~2.36e38; static: not a traced value); default 1 / sqrt(head_dim).
      num_splits: split-K count, a Python or NumPy integer >= 1 (static); default chosen per platform to fill
        the device (1 on CPU). Any value is correct; values above max_pages act as max_pages (the
        extra splits would be empty).
      precision: ``jax.lax.Precision`` (or any of its names, e.g. ``"highest"``, ``"float32"``,
        ``"bfloat16"``) of the kernel's q.k and p.v products.
        ``HIGHEST``: float32-accurate (relative error ~1e-5 or less). ``DEFAULT``/``HIGH``: the GPU kernel
        may round q, the softmax weights and the centroids to float16 inside its tensor-core
        products (relative error ~2^-11 per term, below a bfloat16 query's own rounding of 2^-9);
        where the kernel that runs does so (head_dim 64 or 128, K and V of 2, 3 or 4 bits, with jax_tq's CUDA
        kernels built and ``JAX_TQ_CUDA_DECODE`` not asking for v1 / v2 / v3), the query and output
        rotations run at ``HIGH`` too (TF32 on the GPU, ~3e-4; no effect on the CPU), unless
        inside ``jax.default_matmul_precision("highest")`` (or ``"float32"``).
        Default: ``HIGHEST`` for float32 queries, ``DEFAULT`` for bfloat16/float16 queries. The
        CPU kernel and the reference always compute in float64/float32.

    Rotations: with Hadamard codecs (``rotation="hadamard"``) of head_dim 128 the kernel itself
    computes q_rot = Pi_k q and out = Pi_v^T o_rot (two fast Walsh-Hadamard transforms per row:
    float32 in the CUDA kernels, float64 in the CPU kernel), so no rotation GEMM runs around it.
    That holds on the CPU (the ``ffi``/``auto`` backends) and, on a GPU, where the tensor-core
    kernel runs (:func:`uses_tensor_core_kernel`).
    Everywhere else (Haar codecs, other head_dims, the ``xla`` backend, or
    ``JAX_TQ_FUSED_ROTATION`` set to ``0``/``false``/``off``/``no``) the rotations are two XLA GEMMs
    around the kernel. The choice is made when the call is traced (a jitted function keeps it).

    Returns:
      [num_seqs, num_heads, head_dim] array of q's dtype. A query row holding a NaN or inf gives a
      NaN output row, and so does a finite one whose rotation overflows float32 (|q| near
      float32's max). Differentiable in q and in the cache's norms (``jax.grad``/``vjp``, reverse
      mode only: a custom VJP whose backward pass runs the jnp reference). The codes are integers
      and get no gradient (:func:`jax_tq.compress` passes gradients through the norms only).

    Raises:
      TypeError: q not float32/bfloat16/float16; block_tables or seq_lens not int32; cache not a
        PagedKVCache, or a pool not of its storage dtype (uint8 codes, float32 norms); scale or
        num_splits not a concrete Python number of the right kind.
      ValueError: wrong ranks or shapes, head_dim differs from the cache's codecs, num_heads not a
        multiple of num_kv_heads, num_splits < 1, a non-finite or float32-overflowing scale, an
        unknown precision; ``JAX_TQ_FUSED_ROTATION`` set to something other than 1/true/on/yes or
        0/false/off/no; ``JAX_TQ_CUDA_DECODE`` set to something other than v1 ... v5.

    Source: TurboQuant (arXiv 2504.19874), Algorithm 1: scores <Pi_k q, c[idx]> * ||k|| against the
    stored codes, the output rotated back once by Pi_v^T; split-K with a log-sum-exp combine
    (Flash-Decoding); the fast Walsh-Hadamard transform for Pi = H D2 P H D1 (docs/FORMAT.md).
    """
    check_cache(cache, "paged_decode")
    requested_cuda_decode()  # a misspelt kernel choice raises on every backend and query dtype
    requested_v4_items()
    requested_trace_phases()
    q = jnp.asarray(q)
    scale, num_splits = _static_scale(scale), _static_num_splits(num_splits)
    block_tables, seq_lens = _check_decode_args(q, cache, block_tables, seq_lens, num_splits)
    f16_products = _allows_f16_products(precision, q.dtype)
    if num_splits is not None:
        num_splits = min(num_splits, max(1, block_tables.shape[1]))
    check_decode_indices(block_tables, seq_lens, num_pages=cache.num_pages, page_size=cache.page_size)
    windows = window_operands(cache, window_ids, seq_lens, "paged_decode")
    k_codec, v_codec = cache.k_codec, cache.v_codec
    scale = 1.0 / math.sqrt(k_codec.head_dim) if scale is None else scale
    backend = get_backend()
    group = q.shape[1] // cache.num_kv_heads
    pools = (cache.k_codes, cache.k_norms, cache.v_codes, cache.v_norms, k_codec.centroids, v_codec.centroids,
             block_tables, seq_lens, *windows)
    fused = _fused_rotation(k_codec, v_codec, backend, group)
    if fused is not None:  # the kernel rotates q and the output itself
        out = _decode(q.astype(jnp.float32), *pools, fused, k_codec.bits, v_codec.bits, scale,
                      int(num_splits or 0), f16_products, backend)
        return out.astype(q.dtype)
    kernel_rounds_to_f16 = (backend != "xla" and uses_v4(f16_products) and ffi_loader.kernels_available("cuda")
                            and uses_tensor_core_kernel(k_codec.head_dim, k_codec.bits, v_codec.bits, group,
                                                        f16_products=f16_products))
    rotation_precision = _rotation_precision(kernel_rounds_to_f16)
    q_rot = jnp.einsum("shd,ed->she", q.astype(jnp.float32), k_codec.rotation, precision=rotation_precision)
    operands = (q_rot, *pools)
    # A query row holding an inf or NaN makes every element of its q_rot row inf or NaN (inf * 0 is
    # NaN), and so does a finite one whose rotation overflows float32: such a q_rot row gives a NaN
    # output row (the kernels write it themselves: no mask, no extra XLA reduction around them).
    if backend == "xla":
        out_rot = _reference_rotated(*operands, k_codec.bits, v_codec.bits, scale)
    else:
        out_rot = _decode(*operands, _NO_ROTATION, k_codec.bits, v_codec.bits, scale, int(num_splits or 0),
                          f16_products, backend)
    out = jnp.einsum("she,ed->shd", out_rot, v_codec.rotation, precision=rotation_precision)
    return out.astype(q.dtype)


def _reference_rotated(q_rot, k_codes, k_norms, v_codes, v_norms, k_cent, v_cent, tables, lens, k_window, v_window,
                       window_ids, k_bits, v_bits, scale):
    """reference.paged_decode_rotated with the kernels' NaN rows where q_rot is not all finite.
    Such a row enters the reference as zeros, so that neither its output nor its gradient (zero
    for q, none into the cache norms) carries its NaN into the rows and norms it shares a KV head
    with (a NaN query that the loss masks out leaves every other gradient finite)."""
    finite = jnp.all(jnp.isfinite(q_rot), axis=-1, keepdims=True)
    out_rot = reference.paged_decode_rotated(jnp.where(finite, q_rot, 0), k_codes, k_norms, v_codes, v_norms, k_cent,
                                             v_cent, tables, lens, k_bits, v_bits, scale,
                                             window=(k_window, v_window, window_ids))
    return jnp.where(finite, out_rot, jnp.nan)


def window_operands(cache, window_ids, seq_lens, op: str):
    """(k_window, v_window, window_ids) operands of an attention primitive: the cache's window and
    int32 [num_seqs] ids (default arange), or an empty window and zero ids for a cache without one.

    Raises:
      TypeError / ValueError: window_ids given for a cache without a window, or not int32 [num_seqs].
    """
    num_seqs = seq_lens.shape[0]
    if not cache.window:
        if window_ids is not None:
            raise ValueError(f"jax_tq.{op}: window_ids given but the cache has no window")
        empty = empty_window(cache.num_kv_heads, cache.head_dim)
        return empty, empty, jnp.zeros((num_seqs,), jnp.int32)
    spec = f"jax_tq.{op}: window_ids must be int32 [num_seqs={num_seqs}]"
    if window_ids is None:
        window_ids = jnp.arange(num_seqs, dtype=jnp.int32)
    tq_format.check_index_dtype(window_ids, spec)
    window_ids = jnp.asarray(window_ids)
    if window_ids.dtype != jnp.int32 or window_ids.shape != (num_seqs,):
        error = TypeError if window_ids.dtype != jnp.int32 else ValueError
        raise error(f"{spec}, got {window_ids.dtype}{tuple(window_ids.shape)}")
    check_window_ids(window_ids, seq_lens, num_windows=cache.num_windows, op=op)
    # The window rows are bfloat16 copies that get no gradient, on every backend (the kernels' rules).
    return jax.lax.stop_gradient(cache.k_window), jax.lax.stop_gradient(cache.v_window), window_ids


#: The primitive's rotation operand when q is already rotated (q_rot) and the output stays rotated.
_NO_ROTATION = np.zeros((2, 0), np.int32)

#: head_dim of the kernels that apply a Hadamard rotation themselves.
FUSED_ROTATION_HEAD_DIM = 128
FUSED_ROTATION_ENV = "JAX_TQ_FUSED_ROTATION"  # 0 / false / off / no: the rotations stay XLA GEMMs


def _fused_rotation(k_codec, v_codec, backend: str, group: int):
    """The primitive's rotation operand, int32 [2, head_dim] (the K and V codecs' Hadamard spec
    words, docs/FORMAT.md), where the kernel that runs applies q_rot = Pi_k q and out = Pi_v^T o_rot
    itself (no rotation GEMMs around it); else None. That needs Hadamard codecs of head_dim 128
    (powers of two), a kernel backend, and on a GPU the tensor-core kernels
    (:func:`uses_tensor_core_kernel`). ``JAX_TQ_FUSED_ROTATION=0`` turns it off (A/B timing).

    Raises:
      ValueError: ``JAX_TQ_FUSED_ROTATION`` is not one of 1/true/on/yes or 0/false/off/no.
    """
    if not _env_flag(FUSED_ROTATION_ENV, default=True) or backend == "xla":
        return None
    k_spec, v_spec = k_codec.hadamard_spec, v_codec.hadamard_spec
    if k_spec is None or v_spec is None or k_codec.head_dim != FUSED_ROTATION_HEAD_DIM:
        return None
    if ffi_loader.kernels_available("cuda") and not uses_tensor_core_kernel(
            k_codec.head_dim, k_codec.bits, v_codec.bits, group):
        return None
    return jnp.asarray(np.stack([k_spec, v_spec]))


def _env_flag(name: str, default: bool) -> bool:
    """Boolean environment variable: unset or empty -> default; 1/true/on/yes or 0/false/off/no
    (any case, surrounding spaces ignored).

    Raises:
      ValueError: any other value (a typo must not silently keep the default).
    """
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{name}={os.environ[name]!r}: expected 1/true/on/yes or 0/false/off/no")


def _rotation_from_spec(words):
    """float32 [d, d] Pi = H D2 P H D1 from its int32 [d] spec words (jnp, traceable)."""
    d = words.shape[0]
    hadamard = jnp.asarray(tq_rotation.block_hadamard(d), jnp.float32)
    perm = words & (tq_format.ROT_NEG1_BIT - 1)
    first = jnp.where(words & tq_format.ROT_NEG1_BIT, -1.0, 1.0).astype(jnp.float32)
    second = jnp.where(words & tq_format.ROT_NEG2_BIT, -1.0, 1.0).astype(jnp.float32)
    mixed = second[:, None] * (hadamard * first[None, :])[perm, :]
    return jnp.matmul(hadamard, mixed, precision=jax.lax.Precision.HIGHEST)


def _reference_any(q, *operands_and_rotation, k_bits, v_bits, scale):
    """The primitive's semantics in jnp: :func:`_reference_rotated` on q (rotation [2, 0]), or with
    the fused rotation ([2, d]) between q = Pi_k^T q_rot and out = Pi_v^T out_rot (float32)."""
    *operands, rotation = operands_and_rotation
    if rotation.shape[1] == 0:
        return _reference_rotated(q, *operands, k_bits, v_bits, scale)
    highest = jax.lax.Precision.HIGHEST
    q_rot = jnp.einsum("shd,ed->she", q, _rotation_from_spec(rotation[0]), precision=highest)
    out_rot = _reference_rotated(q_rot, *operands, k_bits, v_bits, scale)
    return jnp.einsum("she,ed->shd", out_rot, _rotation_from_spec(rotation[1]), precision=highest)


def _static_scale(scale, op="jax_tq.paged_decode"):
    """``scale`` as a Python float (None stays None); TypeError / ValueError naming it otherwise."""
    if scale is None:
        return None
    if isinstance(scale, (bool, str, bytes)):
        raise TypeError(f"{op}: scale must be a Python number, got {type(scale).__name__} {scale!r}")
    try:
        value = float(scale)
    except (TypeError, jax.errors.ConcretizationTypeError) as err:
        raise TypeError(f"{op}: scale must be a concrete Python number (static), got "
                        f"{type(scale).__name__}; pass it as a static argument under jit") from err
    if not math.isfinite(value) or abs(value) * _LOG2E > _FLOAT32_MAX:
        raise ValueError(f"{op}: scale must be finite, and |scale| <= "
                         f"{_FLOAT32_MAX / _LOG2E:.3g} so that scale * log2(e) is a finite float32; got {value}")
    return value


def _static_num_splits(num_splits):
    """``num_splits`` as a Python int (None stays None); TypeError naming it otherwise."""
    if num_splits is None:
        return None
    if isinstance(num_splits, bool):
        raise TypeError(f"jax_tq.paged_decode: num_splits must be an int, got bool {num_splits!r}")
    try:
        return operator.index(num_splits)
    except TypeError as err:
        raise TypeError(f"jax_tq.paged_decode: num_splits must be a concrete Python int (static), got "
                        f"{type(num_splits).__name__} {num_splits!r}; pass it as a static argument under jit "
                        f"(e.g. jax.jit(tq.paged_decode, static_argnames='num_splits'))") from err


def _rotation_precision(kernel_rounds_to_f16: bool) -> jax.lax.Precision:
    """Precision of the two rotation GEMMs: ``HIGH`` (TF32 on the GPU, relative error ~3e-4, about
    the kernel's own float16 rounding; 1.8-2x faster there at 8-128 sequences, see
    benchmarks/bench_rotation.py) where the decode kernel that runs rounds to float16 (v4), else
    ``HIGHEST``; also ``HIGHEST`` inside ``jax.default_matmul_precision("highest" / "float32")``."""
    forced_highest = jax.config.jax_default_matmul_precision in ("highest", "float32")
    return jax.lax.Precision.HIGH if kernel_rounds_to_f16 and not forced_highest else jax.lax.Precision.HIGHEST


def _allows_f16_products(precision, q_dtype) -> bool:
    """Whether ``precision`` (see paged_decode) lets the kernel use float16 products."""
    if precision is None:
        return jnp.dtype(q_dtype) != jnp.dtype(jnp.float32)
    if not isinstance(precision, (str, jax.lax.Precision)):
        raise ValueError(f"jax_tq.paged_decode: precision must be a jax.lax.Precision or one of "
                         f"'default', 'high', 'highest' (or another jax.lax.Precision name), got {type(precision).__name__} {precision!r}")
    try:
        precision = jax.lax.Precision(precision.lower() if isinstance(precision, str) else precision)
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"jax_tq.paged_decode: precision must be a jax.lax.Precision or one of "
                         f"'default', 'high', 'highest' (or another jax.lax.Precision name), got {precision!r}") from err
    return precision != jax.lax.Precision.HIGHEST


_NUM_OPERANDS = 13  # q, the four pools, two centroids, block_tables, seq_lens, two windows, window_ids, rotation


@functools.partial(jax.custom_vjp, nondiff_argnums=tuple(range(_NUM_OPERANDS, _NUM_OPERANDS + 6)))
def _decode(q, k_codes, k_norms, v_codes, v_norms, k_cent, v_cent, tables, lens, k_window, v_window, window_ids,
            rotation, k_bits, v_bits, scale, num_splits, f16_products, backend):
    """The kernel call, differentiable in q, k_norms and v_norms (the codes are integers, the window
    rows bfloat16 copies). With rotation [2, 0], q is q_rot and the result out_rot; with [2, d] (the
    fused rotation) both are unrotated. A row whose q_rot is not all finite gives a NaN output row."""
    (out,) = paged_decode_p.bind(
        q, k_codes, k_norms, v_codes, v_norms, k_cent, v_cent, tables, lens, k_window, v_window, window_ids,
        rotation, k_bits=k_bits, v_bits=v_bits, scale=scale, num_splits=num_splits, f16_products=f16_products,
        backend=backend,
    )
    return out


def _decode_fwd(*args):
    operands, static = args[:_NUM_OPERANDS], args[_NUM_OPERANDS:]
    return _decode(*operands, *static), operands


def _decode_bwd(k_bits, v_bits, scale, num_splits, f16_products, backend, operands, cotangent):
    """Backward pass through the reference (recomputes the softmax; memory O(num_seqs x tokens))."""
    q, k_codes, k_norms, v_codes, v_norms, k_cent, v_cent, tables, lens, k_window, v_window, ids, rotation = operands
    reject_checkify_residuals("paged_decode", k_codes=(k_codes, jnp.uint8), v_codes=(v_codes, jnp.uint8),
                              block_tables=(tables, jnp.int32), seq_lens=(lens, jnp.int32),
                              window_ids=(ids, jnp.int32), rotation=(rotation, jnp.int32))

    def attend(q, kn, vn):  # the xla backend's function: the same gradient on both backends
        return _reference_any(q, k_codes, kn, v_codes, vn, k_cent, v_cent, tables, lens, k_window, v_window, ids,
                              rotation, k_bits=k_bits, v_bits=v_bits, scale=scale)

    _, vjp = jax.vjp(attend, q, k_norms, v_norms)
    dq, dk_norms, dv_norms = vjp(cotangent)
    return (dq, None, dk_norms, None, dv_norms) + (None,) * (_NUM_OPERANDS - 5)


_decode.defvjp(_decode_fwd, _decode_bwd)


def _check_decode_args(q, cache, block_tables, seq_lens, num_splits, op="jax_tq.paged_decode", rows="num_seqs"):
    """The trace-time checks of paged_decode's arguments (and paged_prefill's, whose q rows are
    ``rows="num_tokens"`` and whose num_seqs is block_tables'); returns (block_tables, seq_lens) as arrays."""
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise TypeError(f"{op}: q must be float32, bfloat16 or float16, got {q.dtype}")
    if q.ndim != 3:
        raise ValueError(f"{op}: q must be [{rows}, num_heads, head_dim], got shape {tuple(q.shape)}")
    num_seqs, num_heads, head_dim = q.shape
    if rows != "num_seqs":
        num_seqs = jnp.shape(block_tables)[0] if jnp.ndim(block_tables) == 2 else "num_seqs"
    for name, codec in (("k_codec", cache.k_codec), ("v_codec", cache.v_codec)):
        if codec.head_dim != head_dim:
            raise ValueError(f"{op}: q has head_dim {head_dim} but the cache's {name} has head_dim {codec.head_dim}")
    for name, codec in (("k", cache.k_codec), ("v", cache.v_codec)):
        codes, norms = getattr(cache, f"{name}_codes"), getattr(cache, f"{name}_norms")
        expected = (cache.num_pages, cache.num_kv_heads, cache.page_size, codec.packed_bytes)
        if codes.dtype != jnp.uint8 or tuple(codes.shape) != expected:
            raise ValueError(
                f"{op}: cache {name}_codes is {codes.dtype}{tuple(codes.shape)}, expected uint8{expected} for the "
                f"cache's {name}_codec (head_dim {codec.head_dim}, bits {codec.bits})"
            )
        if norms.dtype != jnp.float32 or tuple(norms.shape) != expected[:3]:
            raise ValueError(f"{op}: cache {name}_norms is {norms.dtype}{tuple(norms.shape)}, expected float32{expected[:3]}")
    if num_heads % cache.num_kv_heads != 0:
        raise ValueError(
            f"{op}: num_heads {num_heads} is not a multiple of the cache's num_kv_heads {cache.num_kv_heads} (GQA)"
        )
    tables_spec = f"{op}: block_tables must be int32 [num_seqs={num_seqs}, max_pages]"
    lens_spec = f"{op}: seq_lens must be int32 [num_seqs={num_seqs}]"
    tq_format.check_index_dtype(block_tables, tables_spec)
    tq_format.check_index_dtype(seq_lens, lens_spec)
    block_tables, seq_lens = jnp.asarray(block_tables), jnp.asarray(seq_lens)
    if block_tables.dtype != jnp.int32 or block_tables.ndim != 2 or block_tables.shape[0] != num_seqs:
        error = TypeError if block_tables.dtype != jnp.int32 else ValueError
        raise error(f"{tables_spec}, got {block_tables.dtype}{tuple(block_tables.shape)}")
    if seq_lens.dtype != jnp.int32 or seq_lens.shape != (num_seqs,):
        error = TypeError if seq_lens.dtype != jnp.int32 else ValueError
        raise error(f"{lens_spec}, got {seq_lens.dtype}{tuple(seq_lens.shape)}")
    if num_splits is not None and int(num_splits) < 1:
        raise ValueError(f"{op}: num_splits must be >= 1 (or None for automatic), got {num_splits}")
    return block_tables, seq_lens


#: Shared memory of one tensor-core decode CTA (v3): 64 KB of tables + static arrays + the
#: driver's per-CTA reserve; its registers allow 3 CTAs per SM.
V3_SMEM_PER_CTA = 65536 + 2848 + 1024
V3_MAX_CTAS_BY_REGISTERS = 3


#: v4 (the tensor-core kernel for float16 products): 8 warps per CTA share the 64 KB of tables;
#: 128 registers per thread allow 2 CTAs per SM. Its ring variant adds at most 40 KB of per-warp
#: cp.async stages (V4_RING_SMEM_PER_CTA; 34 KB at head_dim 128 and 4 bits); the handler runs it
#: only where 2 such CTAs fit per SM (sm_90), and the register variant elsewhere, so 2 CTAs per SM
#: hold for both.
V4_SMEM_PER_CTA = 65536 + 4640 + 1024
V4_RING_SMEM_PER_CTA = V4_SMEM_PER_CTA + 8 * 5120
V4_MAX_CTAS_BY_REGISTERS = 2


def _shared_memory_per_sm(compute_capability: tuple[int, int]) -> int:
    """Shared memory per SM (CUDA programming guide, compute capabilities table): 228 KB on sm_90 /
    sm_10x (H100, H200, B200), 164 KB on sm_80 / sm_87, 100 KB on the other sm_8x and on sm_12x
    (RTX 40xx / 50xx class); 100 KB (the smallest) for any other."""
    major, minor = compute_capability
    if major in (9, 10):
        return 228 * 1024
    return 164 * 1024 if (major, minor) in ((8, 0), (8, 7)) else 100 * 1024


def v3_ctas_per_sm(compute_capability: tuple[int, int]) -> int:
    """Resident v3 CTAs per SM: 3 on sm_90 (228 KB shared memory per SM), 2 on sm_80 / sm_87
    (164 KB), 1 on other sm_8x (100 KB)."""
    smem_per_sm = _shared_memory_per_sm(compute_capability)
    return max(1, min(V3_MAX_CTAS_BY_REGISTERS, smem_per_sm // V3_SMEM_PER_CTA))


def v4_ctas_per_sm(compute_capability: tuple[int, int]) -> int:
    """Resident v4 CTAs (8 warps each) per SM: 2 on sm_90 and sm_80 / sm_87, 1 on other sm_8x."""
    smem_per_sm = _shared_memory_per_sm(compute_capability)
    return max(1, min(V4_MAX_CTAS_BY_REGISTERS, smem_per_sm // V4_SMEM_PER_CTA))


def uses_tensor_core_kernel(head_dim: int, k_bits: int, v_bits: int, group: int, *,
                            f16_products: bool = True) -> bool:
    """Whether the CUDA decode runs a tensor-core kernel (v3 / v4) for this configuration: head_dim
    64 or 128, K and V of 2, 3 or 4 bits each, any GQA group (groups of 1 or 2 query heads run
    padded to 4), unless ``JAX_TQ_CUDA_DECODE`` asks for v1 or v2 (the kernel handler reads the same
    variable). With float16 products (``f16_products``) and unless ``JAX_TQ_CUDA_DECODE`` names any
    kernel, also head_dim 256 with K and V of 2, 3 or 4 bits each (v4's warp pairs), head_dim 80
    and 96 with K and V of 2, 3 or 4 bits each (rows padded to 128 coordinates), and head_dim
    192 with K4V4 (warp pairs of padded halves, head tiles of 4), on GPUs with 228 KB of shared
    memory per SM (sm_90, sm_10x), where two CTAs of these kernels fit (the handler asks the device;
    elsewhere they run v1).

    Raises:
      ValueError: ``JAX_TQ_CUDA_DECODE`` holds a value other than v1 ... v5 (or empty).
    """
    requested = requested_cuda_decode()
    wide_fit = _shared_memory_per_sm(_compat.gpu_compute_capability()) >= PAIRS_SMEM_PER_SM
    default_kernel = requested in ("", "v5") and f16_products and wide_fit
    if head_dim == 256:
        return default_kernel and k_bits in (2, 3, 4) and v_bits in (2, 3, 4)
    if head_dim in (80, 96):
        return default_kernel and k_bits in (2, 3, 4) and v_bits in (2, 3, 4)
    if head_dim == 192:
        return default_kernel and k_bits == 4 and v_bits == 4
    return requested not in ("v1", "v2") and head_dim in (64, 128) and k_bits in (2, 3, 4) and v_bits in (2, 3, 4)


def uses_v4(f16_products: bool) -> bool:
    """Of the tensor-core kernels, whether the handler runs v4 (float16 products, unless
    ``JAX_TQ_CUDA_DECODE=v3``) rather than v3 (float32-accurate products).

    Raises:
      ValueError: ``JAX_TQ_CUDA_DECODE`` holds a value other than v1 ... v5 (or empty).
    """
    return f16_products and requested_cuda_decode() != "v3"


#: Values of ``JAX_TQ_CUDA_DECODE`` (read by the CUDA handler too; empty: the default choice).
CUDA_DECODE_CHOICES = ("", "v1", "v2", "v3", "v4", "v5")
#: Shared memory per SM that two CTAs of v4's head_dim-256 warp pairs need (~114 KB each).
PAIRS_SMEM_PER_SM = 228 * 1024


def requested_cuda_decode() -> str:
    """``JAX_TQ_CUDA_DECODE`` as the CUDA handler reads it (exact match; empty when unset).

    Raises:
      ValueError: any other value (the handler would quietly take it for the default, so that the
        split count and the rotations' precision chosen here could not match the kernel that runs).
    """
    return _env_choice("JAX_TQ_CUDA_DECODE", CUDA_DECODE_CHOICES, "one of v1, v2, v3, v4, v5")


def _env_choice(name: str, choices, expected: str) -> str:
    """Environment variable ``name`` ("" when unset), which must be one of ``choices``.

    Raises:
      ValueError: any other value, naming ``expected``.
    """
    value = os.environ.get(name, "")
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected {expected} (or unset)")
    return value


V4_ITEMS_CHOICES = ("", "1", "2", "4", "8")


def requested_v4_items() -> str:
    """``JAX_TQ_V4_ITEMS`` as the CUDA handler reads it (once per process), for v4's head_dim-128
    K4V4 ring kernel with head tiles of 4: ``""`` (unset), the default, runs 2, 4 or 8 KV heads
    per CTA of 16 warps, the count that needs the fewest waves of one CTA per SM for the least work
    per SM; ``"1"`` keeps one KV head per CTA; ``"2"``, ``"4"`` or ``"8"`` asks for that count
    where it divides ``num_kv_heads`` (else the default's choice). It changes only which kernel
    runs, not the result's accuracy.

    Raises:
      ValueError: any other value (the handler would quietly take it for the default).
    """
    return _env_choice("JAX_TQ_V4_ITEMS", V4_ITEMS_CHOICES, "1, 2, 4 or 8")


def requested_trace_phases() -> bool:
    """``JAX_TQ_TRACE_PHASES``, as the CUDA handler reads it at each call: ``"1"`` records v4's phase
    trace (``benchmarks/phase_trace.py``); ``""`` (unset) or ``"0"`` does not.

    Raises:
      ValueError: any other value (the handler would quietly take it for off).
    """
    return _env_choice("JAX_TQ_TRACE_PHASES", ("", "0", "1"), "0 or 1") == "1"


def whole_wave_splits(units: int, slots: int, max_splits: int, extra: int = 0) -> int:
    """The split count whose ``units * splits`` CTAs best fill whole waves of ``slots`` resident
    CTAs (a last, partly filled wave leaves SMs idle), preferring fewer splits unless more fill
    clearly (>= 2 points) better; searched up to ~4 waves or ``max_splits``. ``extra``: CTAs per
    unit beside its splits' when there are several (a folded window's own CTA)."""
    best, best_fill = 1, 0.0
    for splits in range(1, max(1, max_splits) + 1):
        waves = units * (splits + (extra if splits > 1 else 0)) / slots
        fill = waves / math.ceil(waves)
        if fill > best_fill + 0.02:
            best, best_fill = splits, fill
        if waves >= 4:
            break
    return best


def _max_head_tile(head_dim: int) -> int:
    """Largest query-head tile of the CUDA decode kernels (max_gt in paged_decode.cu): 4 from
    head_dim 192 on (the warp pairs), else 8."""
    return 4 if head_dim >= 192 else 8


def choose_num_splits(platform: str, num_seqs: int, num_kv_heads: int, max_pages: int, *,
                      group: int = 1, page_size: int = 16, head_dim: int = 128, k_bits: int = 4,
                      v_bits: int = 4, f16_products: bool = True, window: bool = False) -> int:
    """Split-K count for a launch: 1 on CPU. On a GPU, with at most one split per
    ``MIN_TOKENS_PER_SPLIT`` tokens (and 4 pages):

    * tensor-core kernel (:func:`uses_tensor_core_kernel`): the count whose (sequence, KV head,
      head tile, split) CTAs best fill whole waves of :func:`v4_ctas_per_sm` (``f16_products``)
      or :func:`v3_ctas_per_sm` CTAs per SM; with a ``window`` that v4 folds into its tile loop
      (head_dim 64 / 128), several splits come with one more CTA per unit, the window's;
    * otherwise one wave: 2 resident CTAs per SM for head tiles of 4 or 8 query heads, 4 else.
    """
    if platform == "cpu":
        return 1
    by_length = max(1, max_pages // max(4, MIN_TOKENS_PER_SPLIT // page_size))
    if uses_tensor_core_kernel(head_dim, k_bits, v_bits, group, f16_products=f16_products):
        units = num_seqs * num_kv_heads * -(-group // (4 if group <= 4 else _max_head_tile(head_dim)))
        per_sm = v4_ctas_per_sm if uses_v4(f16_products) else v3_ctas_per_sm
        slots = per_sm(_compat.gpu_compute_capability()) * _compat.gpu_core_count()
        folded = window and uses_v4(f16_products) and head_dim in (64, 128)
        return whole_wave_splits(max(1, units), slots, by_length, extra=1 if folded else 0)
    tile = 1 if group <= 1 else 2 if group <= 2 else 4 if group <= 4 else _max_head_tile(head_dim)
    head_tiles = -(-group // tile)
    ctas_wanted = (2 if tile >= 4 else 4) * _compat.gpu_core_count()
    by_occupancy = -(-ctas_wanted // max(1, num_seqs * num_kv_heads * head_tiles))
    return int(max(1, min(by_occupancy, by_length)))


# ----------------------------------------------------------------------------- primitive

def _abstract(q, *operands, **params):
    return (_compat.output_aval(q.shape, jnp.float32, q, *operands),)


def _reference(*operands, k_bits, v_bits, scale, num_splits, f16_products):
    return (_reference_any(*operands, k_bits=k_bits, v_bits=v_bits, scale=scale),)


def _ffi(ctx, *operands, k_bits, v_bits, scale, num_splits, f16_products):
    q_aval = ctx.avals_in[0]
    num_seqs, num_heads, head_dim = q_aval.shape
    window = not pu.has_zero_size(ctx.avals_in[9:10])
    if num_splits == 0:
        platform = _compat.lowering_platforms(ctx)[0]
        num_kv_heads, page_size = ctx.avals_in[2].shape[1], ctx.avals_in[2].shape[2]
        num_splits = choose_num_splits(platform, num_seqs, num_kv_heads, ctx.avals_in[7].shape[1],
                                       group=num_heads // num_kv_heads, page_size=page_size, head_dim=head_dim,
                                       k_bits=k_bits, v_bits=v_bits, f16_products=bool(f16_products),
                                       window=window)
    partials = num_splits + (1 if window else 0)  # + the window's
    workspace = (
        _compat.ShapedArray((num_seqs, num_heads, partials, head_dim), jnp.float32),
        _compat.ShapedArray((num_seqs, num_heads, partials), jnp.float32),
    )
    ctx = ctx.replace(avals_out=[ctx.avals_out[0], *workspace])
    results = _compat.ffi_lowering("jax_tq_paged_decode")(
        ctx, *operands, k_bits=np.int32(k_bits), v_bits=np.int32(v_bits),
        num_splits=np.int32(num_splits), scale=np.float32(scale), f16_products=np.int32(f16_products),
    )
    return results[:1]


paged_decode_p.def_abstract_eval(_abstract)
pu.define_impl(paged_decode_p)
# rotation [2, 0]: q is q_rot; windows [0, Hkv, 0, d]: none
pu.register_lowerings(paged_decode_p, _reference, _ffi, may_be_empty=(9, 10, 12))


def fold_batched_pools(pools, pool_dims, ids, ids_dim, size: int, pool_size):
    """vmap of an attention primitive's pools (the four page pools, or the two windows): batched
    pools are folded into one pool, each element's ids (block tables, window ids) offset into its
    own slice; unbatched ones stay shared. Returns (pools, ids [size, ...])."""
    ids = pu.move_batch_to_front(ids, ids_dim, size)
    if all(d is _compat.NOT_MAPPED for d in pool_dims):
        return list(pools), ids
    pools = [pu.move_batch_to_front(a, d, size) for a, d in zip(pools, pool_dims)]
    ids = pu.fold_pool_batch(ids, size, pool_size(pools[0]))
    return [p.reshape((-1,) + p.shape[2:]) for p in pools], ids


def _batch(args, dims, **params):
    """Fold vmapped axes into the kernel's sequence axis; a batched cache is folded into one page pool
    (each batch element's block table is offset into its own slice of the pool) and one window pool."""
    q, k_codes, k_norms, v_codes, v_norms, k_cent, v_cent, tables, lens, k_window, v_window, ids, rotation = args
    pu.require_unbatched(("k centroids", "v centroids", "rotation"), dims[5:7] + dims[12:13], "paged_decode")
    size = pu.batch_size(args, dims)
    pools, tables = fold_batched_pools(args[1:5], dims[1:5], tables, dims[7], size, lambda p: p.shape[1])
    windows, ids = fold_batched_pools(args[9:11], dims[9:11], ids, dims[11], size, lambda w: w.shape[1])
    q = pu.move_batch_to_front(q, dims[0], size)
    lens = pu.move_batch_to_front(lens, dims[8], size)
    num_seqs = q.shape[1]
    (out,) = paged_decode_p.bind(
        q.reshape((-1,) + q.shape[2:]), *pools, k_cent, v_cent,
        tables.reshape((-1, tables.shape[-1])), lens.reshape(-1), *windows, ids.reshape(-1), rotation, **params,
    )
    return [out.reshape((size, num_seqs) + out.shape[1:])], [0]


_compat.batching.primitive_batchers[paged_decode_p] = _batch
