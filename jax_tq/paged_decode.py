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
from jax_tq.partitioning import Layout
from jax_tq.backend import get_backend
from jax_tq.cache import check_cache, window_ids_of
from jax_tq.checks import as_array, check_decode_indices, check_window_ids, reject_checkify_residuals
from jax_tq.compress import empty_window
from jax_tq.variants import check_variants, as_keywords

paged_decode_p = _compat.Primitive("jax_tq_paged_decode")

_FLOAT32_MAX = float(np.finfo(np.float32).max)
_LOG2E = 1.4426950408889634  # the kernels take scores in log2 units: scale * log2(e) in float32

def paged_decode(q, cache, block_tables, seq_lens, *, window_ids=None, scale=None, num_splits=None,
                 precision=None, sliding_window=None, soft_cap=None, sinks=None):
    """Decode attention of one query token per sequence over a compressed paged KV cache.

    Args:
      q: [num_seqs, num_heads, head_dim] float32/bfloat16/float16 queries (one token per sequence).
        num_heads must be a multiple of ``cache.num_kv_heads`` (GQA); query head h reads KV head
        h // (num_heads // num_kv_heads).
      cache: :class:`jax_tq.PagedKVCache`. An uncompressed one (``preset="none"``) is served by
        jnp code compiled by XLA (:func:`jax_tq.reference.paged_decode_pages`, no jax_tq kernel,
        on every backend): num_splits and precision are checked but have no effect.
      block_tables: int32 [num_seqs, max_pages]; logical page j of sequence i is physical page
        block_tables[i, j]. Only the first ceil(seq_lens[i] / page_size) entries are read; an entry
        outside [0, num_pages) is skipped (see docs/FORMAT.md; use checked mode to catch it).
      seq_lens: int32 [num_seqs], number of cached tokens each query attends to, clamped to
        [0, max_pages * page_size]. A sequence with 0 tokens gets an all-zero output.
      window_ids: int32 [num_seqs], for a cache with a window: the window id of each sequence, whose
        last min(seq_len, window) tokens are read from the window (exact) instead of the pages, in the
        same softmax; default ``arange(num_seqs)`` (num_seqs <= num_windows; under ``jax.vmap`` over
        sequences numbered across the elements: :func:`jax_tq.cache.default_window_ids`). An id outside
        [0, num_windows) contributes no window token (checked mode reports it). Must be None for a
        cache without a window. The ring must hold those tokens (:func:`jax_tq.fill_window` after
        sharing pages or rolling back).
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
        where the kernel that runs does so (the tensor-core float16 kernel: :func:`plan_decode`), the query and output
        rotations run at ``HIGH`` too (TF32 on the GPU, ~3e-4; no effect on the CPU), unless
        inside ``jax.default_matmul_precision("highest")`` (or ``"float32"``).
        Default: ``HIGHEST`` for float32 queries, ``DEFAULT`` for bfloat16/float16 queries. The
        CPU kernel and the reference always compute in float64/float32.
      sliding_window: None, or an int >= 1 (static): the query (at position seq_lens[i] - 1) sees
        only the last sliding_window tokens, itself included: positions > seq_lens[i] - 1 -
        sliding_window (vLLM's / Mistral's convention; :mod:`jax_tq.variants`).
      soft_cap: None, or a finite number > 0 (static): each logit l = scale * <q, k> becomes
        soft_cap * tanh(l / soft_cap) before the softmax (Gemma 2's logit soft-capping).
      sinks: None, or float32 [num_heads] (other float dtypes are cast): a per-head logit that joins
        the softmax denominator only (gpt-oss's attention sinks), neither scaled nor capped:
        out = sum_t exp(l_t - m) v_t / (exp(sinks[h] - m) + sum_t exp(l_t - m)). Differentiable.
        A sink of -inf is none; NaN or +inf gives head h NaN rows (pass finite sinks).
        On the GPU the float16 tensor-core kernel (head_dim 64 / 128, K and V of one width, pages of
        a multiple of 16 tokens; its soft cap through tanh.approx, an error like rounding the capped
        logit to float16) or else the CUDA-core kernel serves them.

    Rotations: with Hadamard codecs (``rotation="hadamard"``) of head_dim 64 or 128 the kernel itself
    computes q_rot = Pi_k q and out = Pi_v^T o_rot (two fast Walsh-Hadamard transforms per row:
    float32 in the CUDA kernels, float64 in the CPU kernel), so no rotation GEMM runs around it.
    That holds on the CPU (the ``ffi``/``auto`` backends) and, on a GPU, where a tensor-core
    kernel runs (:func:`plan_decode`). Everywhere else (Haar codecs, other head_dims, the ``xla`` backend)
    the rotations are two XLA GEMMs around the kernel. The kernel, its split count and the rotations
    are chosen by one C++ planner (:func:`plan_decode` shows its plan) when the call is traced (a jitted function keeps
    them); ``JAX_TQ_DECODE_KERNEL`` (:func:`requested_kernel`) overrides the kernel family, for tests.

    Returns:
      [num_seqs, num_heads, head_dim] array of q's dtype. A query row holding a NaN or inf gives a
      NaN output row, and so does a finite one whose rotation overflows float32 (|q| near
      float32's max). Differentiable in q, in the cache's norms, window rows and sinks
      (``jax.grad``/``vjp``, reverse mode only: a custom VJP whose backward pass runs the jnp
      reference; the rows' cotangents are bfloat16). The codes are integers and get no gradient
      (:func:`jax_tq.compress` passes gradients through the norms only).

    Raises:
      TypeError: q not float32/bfloat16/float16; block_tables or seq_lens not int32; cache not a
        PagedKVCache, or a pool not of its storage dtype (uint8 codes, float32 norms); scale or
        num_splits not a concrete Python number of the right kind; sliding_window not an int,
        soft_cap not a concrete number, sinks not of a float dtype.
      ValueError: wrong ranks or shapes, head_dim differs from the cache's codecs, num_heads not a
        positive multiple of num_kv_heads, num_splits < 1, a non-finite or float32-overflowing scale, an
        unknown precision; ``JAX_TQ_DECODE_KERNEL`` set to something other than a kernel family;
        sliding_window < 1, soft_cap <= 0 or not finite, sinks not [num_heads]; window_ids None
        with more sequences than the cache's num_windows, or given for a cache without a window.
      BackendUnavailableError: backend "ffi" where no kernel serves the call (when it is lowered).

    Source: TurboQuant (arXiv 2504.19874), Algorithm 1: scores <Pi_k q, c[idx]> * ||k|| against the
    stored codes, the output rotated back once by Pi_v^T; split-K with a log-sum-exp combine
    (Flash-Decoding); the fast Walsh-Hadamard transform for Pi = H D2 P H D1 (docs/FORMAT.md).
    Variants: sliding windows (Mistral 7B, arXiv 2310.06825), logit soft-capping (Gemma 2, arXiv
    2408.00118), attention sinks (Xiao et al., arXiv 2309.17453; gpt-oss's learned per-head sinks).
    """
    check_cache(cache, "paged_decode")
    kernel = requested_kernel()  # a misspelt kernel choice raises on every backend and query dtype
    q = as_array(q, "q", "paged_decode")
    scale, num_splits = _static_scale(scale), _static_num_splits(num_splits)
    block_tables, seq_lens = _check_decode_args(q, cache, block_tables, seq_lens, num_splits)
    sliding_window, soft_cap, sinks = check_variants(sliding_window, soft_cap, sinks, q.shape[1], "paged_decode")
    f16_products = allows_f16_products(precision, q.dtype)
    if num_splits is not None:
        num_splits = min(num_splits, max(1, block_tables.shape[1]))
    check_decode_indices(block_tables, seq_lens, num_pages=cache.num_pages, page_size=cache.page_size,
                         sliding_window=sliding_window)
    windows = window_operands(cache, window_ids, block_tables, seq_lens, "paged_decode")
    scale = 1.0 / math.sqrt(cache.head_dim) if scale is None else scale
    if not cache.compressed:
        out = reference.paged_decode_pages(q, cache.k_pages, cache.v_pages, block_tables, seq_lens, scale,
                                           **as_keywords(sliding_window, soft_cap, sinks))
        return out.astype(q.dtype)
    k_codec, v_codec = cache.k_codec, cache.v_codec
    backend = get_backend()
    pools = (cache.k_codes, cache.k_norms, cache.v_codes, cache.v_norms, k_codec.centroids, v_codec.centroids,
             block_tables, seq_lens, *windows)
    platform = _trace_platform(backend)
    variants = bool(sliding_window or soft_cap or sinks.shape[0])
    chosen = platform and _plan_call(platform, q, cache, block_tables, f16_products, 0, kernel, variants)
    static = (k_codec.bits, v_codec.bits, scale, int(num_splits or 0), f16_products, kernel, backend, sliding_window,
              soft_cap)
    if chosen and chosen["fused_rotation"]:  # the kernel rotates q and the output itself
        rotation = jnp.asarray(np.stack([k_codec.hadamard_spec, v_codec.hadamard_spec]))
        return _decode(q.astype(jnp.float32), *pools, rotation, sinks, *static).astype(q.dtype)
    rotation_precision = _rotation_precision(bool(chosen and platform == "cuda" and chosen["f16_rounding"]))
    q_rot = jnp.einsum("shd,ed->she", q.astype(jnp.float32), k_codec.rotation, precision=rotation_precision)
    operands = (q_rot, *pools)
    # A query row holding an inf or NaN makes every element of its q_rot row inf or NaN (inf * 0 is
    # NaN), and so does a finite one whose rotation overflows float32: such a q_rot row gives a NaN
    # output row (the kernels write it themselves: no mask, no extra XLA reduction around them).
    if backend == "xla":
        out_rot = _reference_rotated(*operands, k_codec.bits, v_codec.bits, scale, sinks=sinks,
                                     sliding_window=sliding_window, soft_cap=soft_cap)
    else:
        out_rot = _decode(*operands, _NO_ROTATION, sinks, *static)
    out = jnp.einsum("she,ed->shd", out_rot, v_codec.rotation, precision=rotation_precision)
    return out.astype(q.dtype)


def _reference_rotated(q_rot, k_codes, k_norms, v_codes, v_norms, k_cent, v_cent, tables, lens, k_window, v_window,
                       window_ids, k_bits, v_bits, scale, *, sinks, sliding_window=0, soft_cap=0.0):
    """reference.paged_decode_rotated with the kernels' NaN rows where q_rot is not all finite
    (sinks float32 [H] or [0]; sliding_window 0 and soft_cap 0.0: none).
    Such a row enters the reference as zeros, so that neither its output nor its gradient (zero
    for q, none into the cache norms) carries its NaN into the rows and norms it shares a KV head
    with (a NaN query that the loss masks out leaves every other gradient finite)."""
    finite = jnp.all(jnp.isfinite(q_rot), axis=-1, keepdims=True)
    out_rot = reference.paged_decode_rotated(jnp.where(finite, q_rot, 0), k_codes, k_norms, v_codes, v_norms, k_cent,
                                             v_cent, tables, lens, k_bits, v_bits, scale,
                                             window=(k_window, v_window, window_ids),
                                             **as_keywords(sliding_window, soft_cap, sinks))
    return jnp.where(finite, out_rot, jnp.nan)


def window_operands(cache, window_ids, block_tables, seq_lens, op: str):
    """(k_window, v_window, window_ids) operands of an attention primitive: the cache's window and
    int32 [num_seqs] ids (default arange), or an empty window and zero ids for a cache without one.

    Raises:
      TypeError / ValueError: window_ids given for a cache without a window, or not int32 [num_seqs];
        window_ids=None with more sequences than window ids (:func:`jax_tq.cache.window_ids_of`).
    """
    num_seqs = seq_lens.shape[0]
    window_ids = window_ids_of(cache, window_ids, num_seqs, op, block_tables)
    if window_ids is None:
        empty = empty_window(cache.num_kv_heads, cache.head_dim)
        return empty, empty, jnp.zeros((num_seqs,), jnp.int32)
    check_window_ids(window_ids, seq_lens, num_windows=cache.num_windows, op=op)
    return cache.k_window, cache.v_window, window_ids


#: The primitive's rotation operand when q is already rotated (q_rot) and the output stays rotated.
_NO_ROTATION = np.zeros((2, 0), np.int32)

#: The run-time override of the CUDA kernel family, for tests and A/B timing: one of DECODE_KERNELS
#: (that family wherever it can run the call; the planner's choice elsewhere), unset or empty: the planner's.
KERNEL_ENV = "JAX_TQ_DECODE_KERNEL"
#: The CUDA kernel families (cuda_ops/include/jax_tq/decode_plan.h), in the order of their ids 1, 2, 3.
DECODE_KERNELS = ("cuda-core", "tensor-core-f32", "tensor-core-f16")


def requested_kernel() -> int:
    """``JAX_TQ_DECODE_KERNEL`` as the id the planner and the CUDA handler take: 0 (unset or empty:
    the planner's choice), 1 ``cuda-core``, 2 ``tensor-core-f32``, 3 ``tensor-core-f16``. Read when a
    call is traced; a jitted function keeps its choice.

    Raises:
      ValueError: any other value (a typo must not silently run the default).
    """
    value = os.environ.get(KERNEL_ENV, "")
    if value and value not in DECODE_KERNELS:
        raise ValueError(f"{KERNEL_ENV}={value!r}: expected one of {', '.join(DECODE_KERNELS)} (or unset)")
    return DECODE_KERNELS.index(value) + 1 if value else 0


def plan(platform: str, *, num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, max_pages: int,
         page_size: int, k_bits: int, v_bits: int, f16_products: bool = True, window: bool = False,
         hadamard: bool = False, num_splits: int = 0, kernel: int = 0, variants: bool = False) -> dict:
    """The decode plan of the kernel module for ``platform`` ("cpu" or "cuda"): the C++ planner
    (``cuda_ops/include/jax_tq/decode_plan.h``) that the CUDA handler runs at each launch.

    Returns:
      dict with ``kernel`` (``"cpu"``, ``"cuda-core"``, ``"tensor-core-f32"`` or ``"tensor-core-f16"``),
      ``num_splits`` (split-K parts; ``num_splits`` when given, else the count that best fills the
      GPU's waves: 1 on the CPU), ``fused_rotation`` (the kernel rotates q and the output itself:
      Hadamard codecs of head_dim 64 or 128, on the CPU kernel and the tensor-core ones), ``f16_rounding``
      (products round to float16), ``folds_window``, ``head_tile``, ``ring``, ``halves``, ``items``
      (the float16 kernel's variant). None where the module is not loaded. ``variants``: the call
      sets sliding_window, soft_cap or sinks (on CUDA the float16 tensor-core kernel where they fit,
      else the CUDA-core kernel).
    """
    module = ffi_loader.module(platform)
    if module is None:
        return None
    return _plan_cached(module, int(num_seqs), int(num_heads), int(num_kv_heads), int(head_dim), int(max_pages),
                        int(page_size), int(k_bits), int(v_bits), bool(f16_products), bool(window), bool(hadamard),
                        int(num_splits), int(kernel), bool(variants))


def plan_decode(q, cache, block_tables, *, num_splits=None, precision=None, platform=None, sliding_window=None,
                soft_cap=None, sinks=None) -> dict | None:
    """What :func:`paged_decode` runs for these arguments: the kernel, its split count and whether
    it applies the rotations itself, as the C++ planner decides (:func:`plan`).

    Args:
      q, cache, block_tables, num_splits, precision, sliding_window, soft_cap, sinks: as for
        :func:`paged_decode` (only shapes, dtypes, the variants' presence and the cache's codecs are
        read: ``jax.ShapeDtypeStruct`` works for q and block_tables).
      platform: ``"cpu"`` or ``"cuda"``; default: where :func:`paged_decode` would plan (``"cuda"``
        where jax_tq's CUDA kernels are loaded, else ``"cpu"``).

    Returns:
      :func:`plan`'s dict, or None where jnp code runs: the ``xla`` backend (unless ``platform`` is
      given), the platform's kernels not loaded, or an uncompressed cache.

    Raises:
      TypeError / ValueError: what :func:`paged_decode` raises for these arguments (shapes, dtypes,
        GQA, head_dim, num_splits, precision); a platform other than "cpu", "cuda" or None;
        ``JAX_TQ_DECODE_KERNEL`` not a kernel family.
    """
    check_cache(cache, "plan_decode")
    kernel = requested_kernel()
    if platform not in (None, "cpu", "cuda"):
        raise ValueError(f"jax_tq.plan_decode: platform must be 'cpu', 'cuda' or None, got {platform!r}")
    q = _array_or_shape(q)
    num_splits = _static_num_splits(num_splits)
    lens = jax.ShapeDtypeStruct((q.shape[0],) if q.ndim == 3 else (0,), jnp.int32)
    block_tables, _ = _check_decode_args(q, cache, block_tables, lens, num_splits, op="jax_tq.plan_decode")
    if num_splits is not None:
        num_splits = min(num_splits, max(1, block_tables.shape[1]))
    f16_products = allows_f16_products(precision, q.dtype, "jax_tq.plan_decode")
    sliding_window, soft_cap, sinks = check_variants(sliding_window, soft_cap, sinks, q.shape[1], "plan_decode")
    platform = platform or _trace_platform(get_backend())
    if platform is None or not cache.compressed:
        return None
    return _plan_call(platform, q, cache, block_tables, f16_products, int(num_splits or 0), kernel,
                      bool(sliding_window or soft_cap or sinks.shape[0]))


def _plan_call(platform, q, cache, block_tables, f16_products, num_splits, kernel, variants=False):
    k_codec, v_codec = cache.k_codec, cache.v_codec
    hadamard = k_codec.hadamard_spec is not None and v_codec.hadamard_spec is not None
    return plan(platform, num_seqs=q.shape[0], num_heads=q.shape[1], num_kv_heads=cache.num_kv_heads,
                head_dim=k_codec.head_dim, max_pages=block_tables.shape[1], page_size=cache.page_size,
                k_bits=k_codec.bits, v_bits=v_codec.bits, f16_products=f16_products, window=bool(cache.window),
                hadamard=hadamard, num_splits=num_splits, kernel=kernel, variants=variants)


@functools.lru_cache(maxsize=4096)
def _plan_cached(module, *args):
    return module.plan_decode(*args)


def _trace_platform(backend: str) -> str | None:
    """The kernel module a traced call plans for: "cuda" where jax_tq's CUDA kernels are loaded,
    else "cpu"; None for the xla backend (no kernel)."""
    if backend == "xla":
        return None
    return "cuda" if ffi_loader.kernels_available("cuda") else "cpu"


def _rotation_from_spec(words):
    """float32 [d, d] Pi = H D2 P H D1 from its int32 [d] spec words (jnp, traceable)."""
    d = words.shape[0]
    hadamard = jnp.asarray(tq_rotation.block_hadamard(d), jnp.float32)
    perm = words & (tq_format.ROT_NEG1_BIT - 1)
    first = jnp.where(words & tq_format.ROT_NEG1_BIT, -1.0, 1.0).astype(jnp.float32)
    second = jnp.where(words & tq_format.ROT_NEG2_BIT, -1.0, 1.0).astype(jnp.float32)
    mixed = second[:, None] * (hadamard * first[None, :])[perm, :]
    return jnp.matmul(hadamard, mixed, precision=jax.lax.Precision.HIGHEST)


def _reference_any(q, *operands_rotation_sinks, k_bits, v_bits, scale, sliding_window=0, soft_cap=0.0):
    """The primitive's semantics in jnp: :func:`_reference_rotated` on q (rotation [2, 0]), or with
    the fused rotation ([2, d]) between q = Pi_k^T q_rot and out = Pi_v^T out_rot (float32)."""
    *operands, rotation, sinks = operands_rotation_sinks
    variants = dict(sinks=sinks, sliding_window=sliding_window, soft_cap=soft_cap)
    if rotation.shape[1] == 0:
        return _reference_rotated(q, *operands, k_bits, v_bits, scale, **variants)
    highest = jax.lax.Precision.HIGHEST
    q_rot = jnp.einsum("shd,ed->she", q, _rotation_from_spec(rotation[0]), precision=highest)
    out_rot = _reference_rotated(q_rot, *operands, k_bits, v_bits, scale, **variants)
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
    benchmarks/bench_rotation.py) where the decode kernel that runs rounds to float16, else
    ``HIGHEST``; also ``HIGHEST`` inside ``jax.default_matmul_precision("highest" / "float32")``."""
    forced_highest = jax.config.jax_default_matmul_precision in ("highest", "float32")
    return jax.lax.Precision.HIGH if kernel_rounds_to_f16 and not forced_highest else jax.lax.Precision.HIGHEST


def allows_f16_products(precision, q_dtype, op: str = "jax_tq.paged_decode") -> bool:
    """Whether ``precision`` (see paged_decode) lets the kernel use float16 products."""
    if precision is None:
        return jnp.dtype(q_dtype) != jnp.dtype(jnp.float32)
    if not isinstance(precision, (str, jax.lax.Precision)):
        raise ValueError(f"{op}: precision must be a jax.lax.Precision or one of "
                         f"'default', 'high', 'highest' (or another jax.lax.Precision name), got {type(precision).__name__} {precision!r}")
    try:
        precision = jax.lax.Precision(precision.lower() if isinstance(precision, str) else precision)
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{op}: precision must be a jax.lax.Precision or one of "
                         f"'default', 'high', 'highest' (or another jax.lax.Precision name), got {precision!r}") from err
    return precision != jax.lax.Precision.HIGHEST


_NUM_OPERANDS = 14  # q, the four pools, two centroids, block_tables, seq_lens, two windows, window_ids, rotation, sinks


@functools.partial(jax.custom_vjp, nondiff_argnums=tuple(range(_NUM_OPERANDS, _NUM_OPERANDS + 9)))
def _decode(q, k_codes, k_norms, v_codes, v_norms, k_cent, v_cent, tables, lens, k_window, v_window, window_ids,
            rotation, sinks, k_bits, v_bits, scale, num_splits, f16_products, kernel, backend, sliding_window,
            soft_cap):
    """The kernel call, differentiable in q, k_norms, v_norms, the window rows and sinks (the codes
    are integers). With rotation [2, 0], q is q_rot and the result out_rot; with [2, d]
    (the fused rotation) both are unrotated. A row whose q_rot is not all finite gives a NaN output
    row. sinks float32 [H] or [0] (none); sliding_window 0 and soft_cap 0.0: none."""
    (out,) = pu.bind(
        paged_decode_p, q, k_codes, k_norms, v_codes, v_norms, k_cent, v_cent, tables, lens, k_window, v_window,
        window_ids, rotation, sinks, k_bits=k_bits, v_bits=v_bits, scale=scale, num_splits=num_splits, f16_products=f16_products,
        kernel=kernel, backend=backend, sliding_window=sliding_window, soft_cap=soft_cap,
    )
    return out


def _decode_fwd(*args):
    operands, static = args[:_NUM_OPERANDS], args[_NUM_OPERANDS:]
    return _decode(*operands, *static), operands


def _decode_bwd(k_bits, v_bits, scale, num_splits, f16_products, kernel, backend, sliding_window, soft_cap, operands,
                cotangent):
    """Backward pass through the reference (recomputes the softmax; memory O(num_seqs x tokens))."""
    (q, k_codes, k_norms, v_codes, v_norms, k_cent, v_cent, tables, lens, k_window, v_window, ids, rotation,
     sinks) = operands
    reject_checkify_residuals("paged_decode", k_codes=(k_codes, jnp.uint8), v_codes=(v_codes, jnp.uint8),
                              block_tables=(tables, jnp.int32), seq_lens=(lens, jnp.int32),
                              window_ids=(ids, jnp.int32), rotation=(rotation, jnp.int32))

    def attend(q, kn, vn, kw, vw, sinks):  # the xla backend's function: the same gradient on both backends
        return _reference_any(q, k_codes, kn, v_codes, vn, k_cent, v_cent, tables, lens, kw, vw, ids,
                              rotation, sinks, k_bits=k_bits, v_bits=v_bits, scale=scale,
                              sliding_window=sliding_window, soft_cap=soft_cap)

    _, vjp = jax.vjp(attend, q, k_norms, v_norms, k_window, v_window, sinks)
    dq, dk_norms, dv_norms, dk_window, dv_window, dsinks = vjp(cotangent)
    return (dq, None, dk_norms, None, dv_norms, None, None, None, None, dk_window, dv_window, None, None, dsinks)


_decode.defvjp(_decode_fwd, _decode_bwd)


def _array_or_shape(x):
    """x as a jnp array, or a jax.ShapeDtypeStruct left as it is (shapes only: plan_decode)."""
    return x if isinstance(x, jax.ShapeDtypeStruct) else jnp.asarray(x)


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
    if cache.compressed:
        _check_code_pools(cache, head_dim, op)
    elif cache.head_dim != head_dim:
        raise ValueError(f"{op}: q has head_dim {head_dim} but the cache's pages have head_dim {cache.head_dim}")
    if num_heads == 0 or num_heads % cache.num_kv_heads != 0:
        raise ValueError(f"{op}: num_heads {num_heads} is not a positive multiple of the cache's num_kv_heads "
                         f"{cache.num_kv_heads} (GQA)")
    seqs = "num_seqs" if isinstance(num_seqs, str) else f"num_seqs={num_seqs}"
    tables_spec = f"{op}: block_tables must be int32 [{seqs}, max_pages]"
    lens_spec = f"{op}: seq_lens must be int32 [{seqs}]"
    tq_format.check_index_dtype(block_tables, tables_spec)
    tq_format.check_index_dtype(seq_lens, lens_spec)
    block_tables, seq_lens = _array_or_shape(block_tables), _array_or_shape(seq_lens)
    if block_tables.dtype != jnp.int32 or block_tables.ndim != 2 or block_tables.shape[0] != num_seqs:
        error = TypeError if block_tables.dtype != jnp.int32 else ValueError
        raise error(f"{tables_spec}, got {block_tables.dtype}{tuple(block_tables.shape)}")
    if seq_lens.dtype != jnp.int32 or seq_lens.shape != (num_seqs,):
        error = TypeError if seq_lens.dtype != jnp.int32 else ValueError
        raise error(f"{lens_spec}, got {seq_lens.dtype}{tuple(seq_lens.shape)}")
    if num_splits is not None and int(num_splits) < 1:
        raise ValueError(f"{op}: num_splits must be >= 1 (or None for automatic), got {num_splits}")
    return block_tables, seq_lens


def _check_code_pools(cache, head_dim: int, op: str) -> None:
    """ValueError unless the codecs have q's head_dim and the code / norm pools their shapes."""
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


# ----------------------------------------------------------------------------- primitive

def _abstract(q, *operands, **params):
    return (_compat.output_aval(q.shape, jnp.float32, q, *operands),)


def _reference(*operands, k_bits, v_bits, scale, num_splits, f16_products, kernel, sliding_window, soft_cap):
    return (_reference_any(*operands, k_bits=k_bits, v_bits=v_bits, scale=scale, sliding_window=sliding_window,
                           soft_cap=soft_cap),)


def _ffi(ctx, *operands, k_bits, v_bits, scale, num_splits, f16_products, kernel, sliding_window, soft_cap):
    q_aval = ctx.avals_in[0]
    num_seqs, num_heads, head_dim = q_aval.shape
    window = not pu.has_zero_size(ctx.avals_in[9:10])
    if num_splits == 0:
        platform = _compat.lowering_platforms(ctx)[0]
        num_kv_heads, page_size = ctx.avals_in[2].shape[1], ctx.avals_in[2].shape[2]
        num_splits = plan(platform, num_seqs=num_seqs, num_heads=num_heads, num_kv_heads=num_kv_heads,
                          head_dim=head_dim, max_pages=ctx.avals_in[7].shape[1], page_size=page_size, k_bits=k_bits,
                          v_bits=v_bits, f16_products=bool(f16_products), window=window,
                          hadamard=ctx.avals_in[12].shape[1] > 0, kernel=kernel,
                          variants=bool(sliding_window or soft_cap or ctx.avals_in[13].shape[0]))["num_splits"]
    partials = num_splits + (1 if window else 0)  # + the window's
    workspace = (
        _compat.ShapedArray((num_seqs, num_heads, partials, head_dim), jnp.float32),
        _compat.ShapedArray((num_seqs, num_heads, partials), jnp.float32),
    )
    ctx = ctx.replace(avals_out=[ctx.avals_out[0], *workspace])
    results = _compat.ffi_lowering("jax_tq_paged_decode")(
        ctx, *operands, k_bits=np.int32(k_bits), v_bits=np.int32(v_bits), num_splits=np.int32(num_splits),
        scale=np.float32(scale), f16_products=np.int32(f16_products), kernel=np.int32(kernel),
        sliding_window=np.int32(sliding_window), soft_cap=np.float32(soft_cap),
    )
    return results[:1]


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
    q, k_codes, k_norms, v_codes, v_norms, k_cent, v_cent, tables, lens, k_window, v_window, ids, rotation, sinks = args
    pu.require_unbatched(("k centroids", "v centroids", "rotation"), dims[5:7] + dims[12:13], "paged_decode")
    pu.require_unbatched_sinks(dims[13], "paged_decode")
    size = pu.batch_size(args, dims)
    pools, tables = fold_batched_pools(args[1:5], dims[1:5], tables, dims[7], size, lambda p: p.shape[1])
    windows, ids = fold_batched_pools(args[9:11], dims[9:11], ids, dims[11], size, lambda w: w.shape[1])
    q = pu.move_batch_to_front(q, dims[0], size)
    lens = pu.move_batch_to_front(lens, dims[8], size)
    num_seqs = q.shape[1]
    (out,) = paged_decode_p.bind(
        q.reshape((-1,) + q.shape[2:]), *pools, k_cent, v_cent,
        tables.reshape((-1, tables.shape[-1])), lens.reshape(-1), *windows, ids.reshape(-1), rotation, sinks, **params,
    )
    return [out.reshape((size, num_seqs) + out.shape[1:])], [0]


# rotation [2, 0]: q is q_rot; windows [0, Hkv, 0, d]: none; sinks [0]: none
#: Dim roles for partitioning (jax_tq/partitioning.py): sequences, KV heads with their query heads,
#: and pages / windows (split only with the sequences).
POOLS = (("page", "kv", None, None), ("page", "kv", None)) * 2
WINDOWS = (("window", "kv", None, None),) * 2
_LAYOUT = Layout(operands=(("seq", "head", None),) + POOLS + ((None,), (None,), ("seq", None), ("seq",)) + WINDOWS
                 + (("seq",), (None, None), ("head",)), results=(("seq", "head", None),))
pu.define_op(paged_decode_p, abstract=_abstract, reference=_reference, ffi=_ffi, batch=_batch,
             may_be_empty=(9, 10, 12, 13), layout=_LAYOUT)
