"""Pure-jnp reference of every jax_tq op: the test oracle and the "xla" backend; and the
implementation of the uncompressed page layout (``write_pages``, ``paged_decode_pages``,
``paged_prefill_pages``: jnp code compiled by XLA on every platform, no kernel).

Imports no kernels / FFI. Signatures mirror the FFI targets of docs/DESIGN.md (with optional
leading batch axes where noted). Algorithm: TurboQuant_mse (Zandieh et al., "TurboQuant",
arXiv 2504.19874, Algorithm 1) for compress / decompress, and attention in the rotated domain
(<Pi q, c[idx]> = <q, Pi^T c[idx]>) for paged decode.

Precision: the compute dtype is promote(input dtype, float32). With float64 inputs under
``jax.enable_x64(True)`` (``jax.experimental.enable_x64`` no longer exists in jax 0.10) everything,
norms included, is computed and returned in float64; otherwise float32. Matrix products use
Precision.HIGHEST.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_tq import format as tq_format

__all__ = [
    "compress", "decompress", "write_cache_pool", "dequantize_rotated", "paged_decode_rotated",
    "paged_decode", "attention_dense", "quantize_rotated", "qjl_compress", "qjl_scores_rotated",
    "qjl_estimate", "paged_prefill_rotated", "prefill_row_lens", "write_pages", "paged_decode_pages",
    "paged_prefill_pages",
]

_HIGHEST = jax.lax.Precision.HIGHEST


def _jit(*static_argnames):
    """jax.jit with static argument names (one compile per shape instead of per-op dispatch)."""
    return functools.partial(jax.jit, static_argnames=static_argnames)


# ---------------------------------------------------------------------------------------------
# validation helpers
# ---------------------------------------------------------------------------------------------
def _compute_dtype(*dtypes):
    """promote(dtypes..., float32): float32 normally, float64 for float64 inputs under x64."""
    return jnp.result_type(jnp.float32, *dtypes)


def _check_float(name: str, array) -> None:
    """TypeError unless ``array`` has a floating dtype."""
    if not jnp.issubdtype(array.dtype, jnp.floating):
        raise TypeError(f"{name} must have a floating dtype, got {array.dtype}")


def _check_rotation(rotation, head_dim: int) -> None:
    """ValueError unless rotation is [head_dim, head_dim] and head_dim is supported."""
    tq_format.check_head_dim(head_dim)
    if rotation.shape != (head_dim, head_dim):
        raise ValueError(f"rotation must have shape ({head_dim}, {head_dim}), got {rotation.shape}")
    _check_float("rotation", rotation)


def _check_centroids(name: str, centroids, bits: int) -> None:
    """ValueError unless centroids is [2**bits] with bits a packed width."""
    tq_format.check_bits(bits)
    if centroids.shape != (1 << bits,):
        raise ValueError(f"{name} must have shape ({1 << bits},) for bits={bits}, "
                         f"got {centroids.shape}")
    _check_float(name, centroids)


def _check_int_array(name: str, array, ndim: int) -> None:
    """TypeError unless integer dtype, ValueError unless ``ndim`` dims."""
    if not jnp.issubdtype(array.dtype, jnp.integer):
        raise TypeError(f"{name} must have an integer dtype (int32), got {array.dtype}")
    if array.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {array.shape}")


# ---------------------------------------------------------------------------------------------
# compress / decompress
# ---------------------------------------------------------------------------------------------
def quantize_rotated(y, centroids):
    """Scalar quantizer: code = number of boundaries (c_i + c_{i+1})/2 strictly less than y.

    Args:
      y: float array [..., d] (rotated unit-vector coordinates).
      centroids: float [2**bits], ascending.
    Returns:
      uint8 codes [..., d]; a y exactly on a boundary gets the lower code. (XLA on the CPU flushes
      float32 subnormals to zero, so a subnormal y next to the middle boundary 0 gets the code of
      0; compress never produces one: its y are coordinates of unit vectors.)
    Raises:
      TypeError: y or centroids not floating.
    Source: TurboQuant (arXiv 2504.19874), Algorithm 1 line 5 (nearest centroid).
    """
    y, centroids = jnp.asarray(y), jnp.asarray(centroids)
    _check_float("y", y)
    _check_float("centroids", centroids)
    boundaries = ((centroids[1:] + centroids[:-1]) * 0.5).astype(y.dtype)
    return jnp.sum(y[..., None] > boundaries, axis=-1, dtype=jnp.int32).astype(jnp.uint8)


def compress(x, rotation, centroids, bits: int, fit_scale: bool = False):
    """TurboQuant_mse quantization of vectors x (FFI target ``jax_tq_compress``).

    Args:
      x: float32 | bfloat16 | float16 (| float64 under x64) array [..., d].
      rotation: float [d, d], Pi (y = Pi @ u).
      centroids: float [2**bits], ascending.
      bits: 2, 3 or 4.
      fit_scale: False: codes of y and norms = ||x||. True: the fitted scale (docs/FORMAT.md
        "Fitted scale", :func:`fit_codes`): codes of the best pre-scaling of y and norms =
        ||x|| <y, c[codes]> / |c[codes]|^2.
    Returns:
      (codes uint8 [..., d*bits/8], norms [...]) with norms = ||x||_2 (or the fitted scale) in the
      compute dtype (float32, or float64 for float64 x under x64). A zero vector gets norm 0 and
      all codes equal to the code of y = 0 (it decodes to exactly 0 because its norm is 0).
    Raises:
      TypeError: non-floating x / rotation / centroids.  ValueError: bad shapes, bits, head_dim.
    Source: TurboQuant (arXiv 2504.19874), Algorithm 1 (Quant_mse): y = Pi x / ||x||, idx_j =
      argmin_k |y_j - c_k|; the fitted scale is the least-squares gain of a gain-shape quantizer
      (Gersho & Gray, "Vector Quantization and Signal Compression", 1992, ch. 12).
    """
    x, rotation, centroids = jnp.asarray(x), jnp.asarray(rotation), jnp.asarray(centroids)
    _check_float("x", x)
    head_dim = x.shape[-1] if x.ndim else 0
    _check_rotation(rotation, head_dim)
    _check_centroids("centroids", centroids, bits)
    _check_float("rotation", rotation)
    _check_float("centroids", centroids)
    return _compress_impl(x, rotation, centroids, bits=bits, fit_scale=bool(fit_scale))


def _norm_and_unit(x):
    """(||x||_2 over the last axis, x / ||x||), computed on x scaled by a power of two 2^-e with
    max|x_i| < 2^e, so that the squares neither overflow (|x| ~1e30) nor underflow (|x| ~1e-20).
    The scaling is two exact multiplies by 2^-(e/2)-ish factors, never by a subnormal reciprocal
    (x / 1e38 was flushed to 0 on the CPU). A zero vector gives (0, 0) with a gradient of 0 (not
    NaN); a NaN anywhere in x gives a NaN norm (tested explicitly: XLA's CPU max-reduction may
    drop NaN); a norm beyond the dtype's range is inf; a norm below format.MIN_NORM gives (0, 0)."""
    has_nan = jnp.any(jnp.isnan(x), axis=-1)
    largest = jnp.max(jnp.abs(x), axis=-1)
    positive = (largest > 0) & ~has_nan  # False for 0 and NaN
    _, exponent = jnp.frexp(jnp.where(positive & jnp.isfinite(largest), largest, 1.0))
    half = exponent // 2
    one = jnp.ones_like(largest)
    down_a, down_b = jnp.ldexp(one, -half), jnp.ldexp(one, half - exponent)
    scaled = x * down_a[..., None] * down_b[..., None]
    root = jnp.sqrt(jnp.where(positive, jnp.sum(scaled * scaled, axis=-1), 1.0))
    up = root * jnp.ldexp(one, half) * jnp.ldexp(one, exponent - half)
    kept = positive & (up >= tq_format.MIN_NORM)  # below: stored as the zero vector
    norms = jnp.where(kept, up, jnp.where(has_nan, jnp.nan, 0.0))
    unit = jnp.where(kept[..., None], scaled / root[..., None], 0.0)
    return norms.astype(x.dtype), unit.astype(x.dtype)


def _rotated_unit(x, rotation):
    """(||x||, y = Pi x / ||x||) in the compute dtype (see :func:`_norm_and_unit`)."""
    compute_dtype = _compute_dtype(x.dtype)
    norms, unit = _norm_and_unit(x.astype(compute_dtype))
    return norms, jnp.matmul(unit, rotation.astype(compute_dtype).T, precision=_HIGHEST)


@_jit("bits", "fit_scale")
def _compress_impl(x, rotation, centroids, bits, fit_scale=False):
    """compress after validation."""
    norms, rotated = _rotated_unit(x, rotation)
    if fit_scale:
        codes, gain = fit_codes(rotated, centroids)
        norms = norms * gain
    else:
        codes = quantize_rotated(rotated, centroids.astype(rotated.dtype))
    return tq_format.pack_codes(codes, bits), norms


def fit_codes(y, centroids):
    """The fitted scale's quantizer (docs/FORMAT.md "Fitted scale"): for each pre-scaling s_k of
    ``jax_tq.format.FIT_GRID``, codes_k = number of boundaries b_i with fl32(s_k b_i) < y; the k
    with the largest <y, c[codes_k]>^2 / |c[codes_k]|^2 wins (the first on ties).

    Args:
      y: float [..., d], rotated unit vectors (float32, or float64 under x64).
      centroids: float [2**bits], ascending.
    Returns:
      (codes uint8 [..., d], gain [...] = <y, c[codes]> / |c[codes]|^2 in y's dtype): the stored
      scale of x is ||x|| * gain.
    """
    boundaries = ((centroids[1:] + centroids[:-1]) * 0.5).astype(jnp.float32)
    values = centroids.astype(y.dtype)
    # fl32(s_k * b_i) for every candidate, exact in y's dtype; one loop body (lax.scan) rather than
    # FIT_GRID's 17 unrolled copies keeps the compiled program small (XLA's compile time).
    scaled = (jnp.asarray(tq_format.FIT_GRID, jnp.float32)[:, None] * boundaries).astype(y.dtype)

    def candidate(best, scaled_k):
        best_codes, best_dot, best_sq, best_gain = best
        codes = jnp.sum(y[..., None] > scaled_k, axis=-1, dtype=jnp.int32)
        c = values[codes]
        dot = jnp.sum(y * c, axis=-1)
        sq = jnp.sum(c * c, axis=-1)
        gain = dot * dot / sq
        better = gain > best_gain
        return (jnp.where(better[..., None], codes.astype(jnp.uint8), best_codes), jnp.where(better, dot, best_dot),
                jnp.where(better, sq, best_sq), jnp.where(better, gain, best_gain)), None

    first = (jnp.zeros(y.shape, jnp.uint8), jnp.zeros(y.shape[:-1], y.dtype), jnp.ones(y.shape[:-1], y.dtype),
             jnp.full(y.shape[:-1], -1.0, y.dtype))
    (best_codes, best_dot, best_sq, _), _ = jax.lax.scan(candidate, first, scaled)
    return best_codes, best_dot / best_sq


@jax.custom_jvp
def window_rows(x, rotation):
    """The window's stored rows of vectors x: bfloat16 of ||x|| * (Pi x / ||x||), i.e. Pi x
    rounded once to bfloat16 (docs/FORMAT.md "Window"). Differentiable as Pi x (the rounding taken
    as exact), the zero vector included.

    Args:
      x: float [..., d].  rotation: float [d, d], Pi.
    Returns:
      bfloat16 [..., d].
    """
    norms, rotated = _rotated_unit(jnp.asarray(x), jnp.asarray(rotation))
    return (norms[..., None] * rotated).astype(jnp.float32).astype(jnp.bfloat16)


@window_rows.defjvp
def _window_rows_jvp(primals, tangents):
    (x, rotation), (x_dot, rotation_dot) = primals, tangents
    dot = (jnp.matmul(jnp.asarray(x_dot, jnp.float32), jnp.asarray(rotation, jnp.float32).T, precision=_HIGHEST)
           + jnp.matmul(jnp.asarray(x, jnp.float32), jnp.asarray(rotation_dot, jnp.float32).T, precision=_HIGHEST))
    return window_rows(x, rotation), dot.astype(jnp.bfloat16)


def window_write(x, window, rotation, window_slots):
    """Write tokens' rows into a window pool (the window half of ``jax_tq_write_cache``).

    Args:
      x: float [T, Hkv, d].  window: bfloat16 [num_windows, Hkv, W, d].
      rotation: float [d, d].  window_slots: int32 [T], entry w * W + p % W of each token;
        negative or >= num_windows * W: not written.
    Returns:
      the updated pool (a copy).
    """
    num_windows, _, length, _ = window.shape
    slots = jnp.asarray(window_slots, jnp.int32)
    valid = (slots >= 0) & (slots < num_windows * length)
    rows = window_rows(jnp.where(valid[:, None, None], x, 0), rotation)
    ids = jnp.where(valid, slots // max(length, 1), num_windows)  # out of range: dropped
    entries = jnp.where(valid, slots % max(length, 1), 0)
    return window.at[ids, :, entries].set(rows, mode="drop")


def dequantize_rotated(codes, norms, centroids, bits: int):
    """Decoded vectors in the ROTATED domain: norm * c[idx] (no Pi^T applied).

    Args:
      codes: uint8 [..., d*bits/8].  norms: float [...].  centroids: float [2**bits].
      bits: 2, 3 or 4.
    Returns:
      array [..., d] in promote(norms.dtype, centroids.dtype, float32); d = 8*codes.shape[-1]/bits.
    Raises:
      TypeError / ValueError: bad dtypes, shapes or bits.
    """
    codes, norms, centroids = jnp.asarray(codes), jnp.asarray(norms), jnp.asarray(centroids)
    _check_centroids("centroids", centroids, bits)
    _check_float("norms", norms)
    head_dim = codes.shape[-1] * 8 // bits if codes.ndim else 0
    if codes.shape[:-1] != norms.shape:
        raise ValueError(f"codes.shape[:-1] {codes.shape[:-1]} must equal norms.shape {norms.shape}")
    if codes.dtype != jnp.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    tq_format.check_head_dim(head_dim, name="codes head_dim (8*codes.shape[-1]/bits)")
    return _dequantize_rotated_impl(codes, norms, centroids, bits=bits)


@_jit("bits")
def _dequantize_rotated_impl(codes, norms, centroids, bits):
    """dequantize_rotated after validation."""
    head_dim = codes.shape[-1] * 8 // bits
    indices = tq_format.unpack_codes(codes, bits, head_dim)
    compute_dtype = _compute_dtype(norms.dtype, centroids.dtype)
    values = centroids.astype(compute_dtype)[indices.astype(jnp.int32)]
    return norms.astype(compute_dtype)[..., None] * values


def decompress(codes, norms, rotation, centroids, bits: int, dtype=jnp.float32):
    """TurboQuant_mse dequantization (FFI target ``jax_tq_decompress``).

    Args:
      codes: uint8 [..., d*bits/8].  norms: float [...].  rotation: float [d, d].
      centroids: float [2**bits].  bits: 2, 3 or 4.
      dtype: output dtype (float32, bfloat16, float16; float64 under x64).
    Returns:
      x_hat = norm * (c[idx] @ Pi), shape [..., d], ``dtype``; computed in
      promote(dtype, norms, rotation, centroids, float32).
    Raises:
      TypeError / ValueError: bad dtypes, shapes, bits or head_dim.
    Source: TurboQuant (arXiv 2504.19874), Algorithm 1 (DeQuant_mse): x_hat = Pi^T c[idx].
    """
    tq_format.check_bits(bits)
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"dtype must be a float dtype, got {dtype}")
    rotation = jnp.asarray(rotation)
    _check_rotation(rotation, rotation.shape[0] if rotation.ndim else 0)
    if rotation.shape[0] * bits != jnp.shape(codes)[-1] * 8:
        raise ValueError(f"codes.shape[-1] must be d*bits/8 = {rotation.shape[0] * bits // 8}, "
                         f"got {jnp.shape(codes)[-1]}")
    rotated = dequantize_rotated(codes, norms, centroids, bits)
    return _rotate_back(rotated, rotation, dtype=dtype)


@_jit("dtype")
def _rotate_back(rotated, rotation, dtype):
    """(norm * c[idx]) @ Pi in promote(dtype, inputs, float32), cast to dtype."""
    compute_dtype = _compute_dtype(dtype, rotated.dtype, rotation.dtype)
    decoded = jnp.matmul(rotated.astype(compute_dtype), rotation.astype(compute_dtype),
                         precision=_HIGHEST)
    return decoded.astype(dtype)


def write_cache_pool(x, codes, norms, rotation, centroids, slot_mapping, bits: int, fit_scale: bool = False):
    """Compress tokens and scatter them into the paged pools (one pool of FFI target ``jax_tq_write_cache``).

    Args:
      x: float [T, Hkv, d].
      codes: uint8 [P, Hkv, page_size, d*bits/8] pool.
      norms: float [P, Hkv, page_size] pool (float32 in a PagedKVCache; as the oracle, any float
        dtype, kept in the result).
      rotation: float [d, d].  centroids: float [2**bits].
      slot_mapping: int32 [T]; token t goes to page slot // page_size, offset slot % page_size.
        Slots < 0 or >= P * page_size are skipped. Duplicates: one writer wins (unspecified).
      bits: 2, 3 or 4.  fit_scale: as :func:`compress`.
    Returns:
      (codes, norms): updated copies of the pools (same shapes / dtypes).
    Raises:
      TypeError / ValueError: bad dtypes or shapes (message names the argument).
    Source: TurboQuant (arXiv 2504.19874), Algorithm 1 applied per token; layout of DESIGN.md.
    """
    x, codes, norms = jnp.asarray(x), jnp.asarray(codes), jnp.asarray(norms)
    slot_mapping = jnp.asarray(slot_mapping)
    _check_pools("codes", "norms", codes, norms, bits)
    if x.ndim != 3 or x.shape[1:] != (codes.shape[1], codes.shape[3] * 8 // bits):
        raise ValueError(f"x must have shape [T, {codes.shape[1]}, {codes.shape[3] * 8 // bits}], "
                         f"got {x.shape}")
    _check_int_array("slot_mapping", slot_mapping, 1)
    if slot_mapping.shape[0] != x.shape[0]:
        raise ValueError(f"slot_mapping must have shape [{x.shape[0]}], got {slot_mapping.shape}")
    # Skipped tokens (padding) enter as zeros: never stored, and their gradient is then exactly 0
    # even where they hold NaN or inf.
    x = jnp.where(_written(slot_mapping, norms.shape[0] * norms.shape[2])[:, None, None], x, 0)
    new_codes, new_norms = compress(x, rotation, centroids, bits, fit_scale)
    return _scatter_slots(codes, norms, new_codes, new_norms, slot_mapping)


def _written(slot_mapping, num_slots: int):
    """bool [T]: the slots that land in a pool of num_slots slots (the others are skipped)."""
    slots = slot_mapping.astype(jnp.int32)
    # An int32 slot is always below a pool of more than 2**31 - 1 slots (no int32 bound for it).
    return (slots >= 0) & (slots < num_slots) if num_slots <= tq_format.INDEX_MAX else slots >= 0


@jax.jit
def _scatter_slots(codes, norms, new_codes, new_norms, slot_mapping):
    """Write token rows into their slots, dropping slots outside [0, P*page_size)."""
    return _scatter_rows(codes, new_codes, slot_mapping), _scatter_rows(norms, new_norms, slot_mapping)


def _scatter_rows(pool, rows, slot_mapping):
    """``pool`` [P, Hkv, page_size, ...] with ``rows`` [T, Hkv, ...] (cast to the pool's dtype)
    written at their slots; slots outside [0, P*page_size) are dropped."""
    num_pages, _, page_size = pool.shape[:3]
    slots = slot_mapping.astype(jnp.int32)
    valid = _written(slots, num_pages * page_size)
    pages = jnp.where(valid, slots // page_size, num_pages)  # out of range -> dropped
    offsets = jnp.where(valid, slots % page_size, 0)
    return pool.at[pages, :, offsets].set(rows.astype(pool.dtype), mode="drop")


def _check_pools(codes_name: str, norms_name: str, codes, norms, bits: int) -> None:
    """Validate a (codes, norms) pool pair against the DESIGN.md layout."""
    tq_format.check_bits(bits)
    if codes.dtype != jnp.uint8:
        raise TypeError(f"{codes_name} must be uint8, got {codes.dtype}")
    if codes.ndim != 4:
        raise ValueError(f"{codes_name} must be [P, Hkv, page_size, packed], got {codes.shape}")
    if codes.shape[3] * 8 % bits:
        raise ValueError(f"{codes_name}.shape[3]={codes.shape[3]} is not d*bits/8 for bits={bits}")
    tq_format.check_head_dim(codes.shape[3] * 8 // bits, name=f"{codes_name} head_dim")
    _check_float(norms_name, norms)
    if norms.shape != codes.shape[:3]:
        raise ValueError(f"{norms_name} must have shape {codes.shape[:3]}, got {norms.shape}")


# ---------------------------------------------------------------------------------------------
# paged decode
# ---------------------------------------------------------------------------------------------
def _gather_sequence_tokens(codes, norms, centroids, bits, safe_pages):
    """Dequantized rotated tokens per sequence: [S, Hkv, max_pages*page_size, d]."""
    return _sequence_tokens(_dequantize_rotated_impl(codes[safe_pages], norms[safe_pages], centroids, bits=bits))


def _sequence_tokens(gathered):
    """[S, max_pages, Hkv, page_size, d] pages of each sequence -> its tokens [S, Hkv, max_pages*page_size, d]."""
    num_seqs, max_pages, num_kv_heads, page_size, head_dim = gathered.shape
    tokens = jnp.transpose(gathered, (0, 2, 1, 3, 4))
    return tokens.reshape(num_seqs, num_kv_heads, max_pages * page_size, head_dim)


def _valid_token_mask(block_tables, seq_lens, num_pages, page_size):
    """bool [S, max_pages*page_size]: token < clamped seq_len and its page id in [0, P)."""
    max_pages = block_tables.shape[1]
    lengths = jnp.clip(seq_lens.astype(jnp.int32), 0, min(max_pages * page_size, tq_format.INDEX_MAX))
    positions = jnp.arange(max_pages * page_size, dtype=jnp.int32)
    page_ok = (block_tables >= 0) & (block_tables < num_pages)
    token_page_ok = jnp.repeat(page_ok, page_size, axis=1)
    return (positions[None, :] < lengths[:, None]) & token_page_ok


def _soft_capped(logits, cap):
    """cap * tanh(logits / cap) (Gemma 2's logit soft cap, arXiv 2408.00118), with the logit itself
    where |logits| <= cap * 2**-12 (tanh x rounds to x in float32 there): for a cap near float32's
    largest, logits / cap is a subnormal that XLA:CPU flushes to 0, which made every logit 0."""
    small = jnp.abs(logits) <= cap * 2.0**-12
    return jnp.where(small, logits, cap * jnp.tanh(logits / cap))


def _masked_softmax_weights(scores, valid, scale, soft_cap=None, sinks=None):
    """softmax_t(logit_t) over the last axis restricted to ``valid``, logit_t = scale * scores_t
    (soft-capped to soft_cap * tanh(logit_t / soft_cap) where soft_cap is given); all-invalid rows
    give 0. ``sinks`` (broadcastable to scores[..., :1]): a per-row extra logit that joins the
    denominator only (attention sinks): weight_t = exp(logit_t) / (exp(sink) + sum_u exp(logit_u)).

    The scale multiplies the difference to the row's max, not the scores: XLA fuses the product
    into each consumer separately and may round it differently there, so at |logits| ~1e9 and
    above a row's own max could shift to +-2**8 or more (exp overflows, or every weight underflows
    and the row comes out 0). ``|scale| * (s - max s)`` is exactly 0 at the max and
    <= 0 elsewhere however it is fused; a negative scale flips the scores' sign first (exact).
    Soft-capped logits are bounded by soft_cap, so they are shifted by their own max."""
    scores = scores * jnp.where(scale < 0, -1.0, 1.0).astype(scores.dtype)
    magnitude = jnp.abs(scale).astype(scores.dtype)
    if soft_cap is not None:
        scores = _soft_capped(magnitude * scores, jnp.asarray(soft_cap, scores.dtype))
        magnitude = jnp.ones((), scores.dtype)
    row_max = jnp.max(jnp.where(valid, scores, -jnp.inf), axis=-1, keepdims=True, initial=-jnp.inf)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    shifted = magnitude * (scores - row_max)
    shifted = jnp.minimum(jnp.where(valid, shifted, 0.0), 0.0)
    if sinks is None:
        weights = jnp.where(valid, jnp.exp(shifted), 0.0)
        total = jnp.sum(weights, axis=-1, keepdims=True)
        return weights / jnp.where(total > 0, total, 1.0)
    # The sink's logit against the row's largest logit; both shifted by the larger of the two.
    sink_shift = sinks.astype(scores.dtype) - magnitude * row_max
    lift = jnp.maximum(sink_shift, 0.0)
    weights = jnp.where(valid, jnp.exp(shifted - lift), 0.0)
    total = jnp.sum(weights, axis=-1, keepdims=True) + jnp.exp(sink_shift - lift)
    weights = weights / jnp.where(total == 0, 1.0, total)  # (no 0 / 0: no valid token, a sink of -inf)
    return jnp.where(jnp.any(valid, axis=-1, keepdims=True), weights, 0.0)  # no valid token: 0 whatever the sink


def paged_decode_rotated(q_rot, k_codes, k_norms, v_codes, v_norms, k_centroids, v_centroids,
                         block_tables, seq_lens, k_bits: int, v_bits: int, scale: float, window=None, *,
                         sliding_window=None, soft_cap=None, sinks=None):
    """Single-query attention over a TurboQuant paged cache, in the rotated domain
    (FFI target ``jax_tq_paged_decode``, without the split-K workspace).

    Args:
      q_rot: float [S, H, d], queries already rotated by K's Pi, not scaled.
      k_codes: uint8 [P, Hkv, page_size, d*k_bits/8];  k_norms: float32 [P, Hkv, page_size].
      v_codes: uint8 [P, Hkv, page_size, d*v_bits/8];  v_norms: float32 [P, Hkv, page_size].
      k_centroids: float [2**k_bits];  v_centroids: float [2**v_bits].
      block_tables: int32 [S, max_pages]; logical page j of sequence i is physical page
        block_tables[i, j]; ids outside [0, P) are skipped (never read out of bounds).
      seq_lens: int32 [S], clamped to [0, max_pages*page_size].
      k_bits, v_bits: 2, 3 or 4.  scale: softmax scale (float).
      window: None, or (k_window, v_window, window_ids): bfloat16 [num_windows, Hkv, W, d] rings of
        rotated rows and int32 [S]; sequence s then reads its last min(L, W) tokens (L its clamped
        length) from entries p % W of window window_ids[s] (none if that id is outside
        [0, num_windows)) and the others from the pages (docs/FORMAT.md "Window").
      sliding_window, soft_cap, sinks: the attention variants (:mod:`jax_tq.variants`): the query
        at position L - 1 sees only positions >= L - sliding_window; logits scale * s_t become
        soft_cap * tanh(scale * s_t / soft_cap); sinks float [H] joins each head's denominator.
    Returns:
      out_rot [S, H, d] in promote(q_rot.dtype, float32): sum_t p_t v_t over the valid tokens, with
      v_t = v_norm_t c_v[vcode_t] (pages) or the window's V row, and p = softmax_t(scale * s_t),
      s_t = k_norm_t <q_rot, c_k[kcode_t]> (pages) or <q_rot, K row> (window); query head h uses
      KV head h // (H / Hkv). Rows with no valid token are exactly 0.
    Raises:
      TypeError / ValueError: bad dtypes / shapes, H not a multiple of Hkv, bad bits.
    Source: TurboQuant (arXiv 2504.19874), Algorithm 1 applied to a KV cache; scores use
      <Pi q, c[idx]> = <q, Pi^T c[idx]> (Algorithm 1 DeQuant_mse), so keys are never un-rotated;
      the window is KIVI's full-precision residual (Liu et al., arXiv 2402.02750).
    """
    q_rot, k_codes, k_norms, v_codes, v_norms, k_centroids, v_centroids = (
        jnp.asarray(a) for a in (q_rot, k_codes, k_norms, v_codes, v_norms, k_centroids,
                                 v_centroids))
    block_tables, seq_lens = jnp.asarray(block_tables), jnp.asarray(seq_lens)
    _check_decode_args(q_rot, k_codes, k_norms, v_codes, v_norms, k_centroids, v_centroids,
                       block_tables, seq_lens, k_bits, v_bits)
    window = _check_window(window, k_codes.shape[1], q_rot.shape[2], q_rot.shape[0])
    capacity = block_tables.shape[1] * k_codes.shape[2]
    length = 0 if window is None else window[0].shape[2]
    paged = tq_format.paged_tokens(seq_lens.astype(jnp.int32), capacity, length)
    ends = jnp.clip(seq_lens.astype(jnp.int32), 0, min(capacity, tq_format.INDEX_MAX))
    return _attend_rotated(q_rot, k_codes, k_norms, v_codes, v_norms, k_centroids, v_centroids,
                           block_tables, paged, window, paged, ends, scale, ends, _sinks_or_none(sinks),
                           k_bits=k_bits, v_bits=v_bits, sliding_window=sliding_window, soft_cap=soft_cap)


def _sinks_or_none(sinks):
    """None for no sinks (None or an empty array), else the array."""
    if sinks is None:
        return None
    sinks = jnp.asarray(sinks)
    return None if sinks.size == 0 else sinks


def _check_window(window, num_kv_heads: int, head_dim: int, num_seqs: int):
    """None, or the (k_window, v_window, window_ids) triple as arrays, validated; an empty window
    (num_windows * W == 0) becomes None."""
    if window is None:
        return None
    k_window, v_window, window_ids = (jnp.asarray(a) for a in window)
    if (k_window.ndim != 4 or k_window.shape[1] != num_kv_heads or k_window.shape[3] != head_dim
            or v_window.shape != k_window.shape):
        raise ValueError(f"k_window / v_window must be [num_windows, {num_kv_heads}, window, {head_dim}], got "
                         f"{k_window.shape} and {v_window.shape}")
    _check_float("k_window", k_window)
    _check_float("v_window", v_window)
    _check_int_array("window_ids", window_ids, 1)
    if window_ids.shape != (num_seqs,):
        raise ValueError(f"window_ids must be [{num_seqs}], got {window_ids.shape}")
    if k_window.shape[0] * k_window.shape[2] == 0:
        return None
    return k_window, v_window, window_ids


def _window_tokens(window, lo, hi):
    """Keys / values [S, Hkv, W, d] of each row's window ring and a bool [S, W] mask of the entries
    holding positions [lo, hi) (at most W of them: entry p % W), none where the id is invalid."""
    k_window, v_window, ids = window
    num_windows, _, length, _ = k_window.shape
    id_ok = (ids >= 0) & (ids < num_windows)
    safe = jnp.where(id_ok, ids, 0)
    entries = jnp.arange(length, dtype=jnp.int32)[None, :]
    offset = jnp.mod(entries - lo[:, None], length)          # position lo + offset sits in this entry
    mask = id_ok[:, None] & (offset < (hi - lo)[:, None])
    return k_window[safe], v_window[safe], mask, lo[:, None] + offset


@_jit("k_bits", "v_bits", "sliding_window", "soft_cap")
def _attend_rotated(q_rot, k_codes, k_norms, v_codes, v_norms, k_centroids, v_centroids, block_tables,
                    paged_len, window, win_lo, win_hi, scale, row_len, sinks, k_bits, v_bits, sliding_window=None,
                    soft_cap=None):
    """One query row per table row: the pages' tokens [0, paged_len) and the window's positions
    [win_lo, win_hi) (window None: none), one softmax. The row sits at position row_len - 1: with a
    sliding window it sees positions >= row_len - sliding_window only. sinks: float [H] or None."""
    num_seqs, num_heads, head_dim = q_rot.shape
    num_pages, num_kv_heads, page_size, _ = k_codes.shape
    group = num_heads // num_kv_heads
    compute_dtype = _compute_dtype(q_rot.dtype)
    page_ok = (block_tables >= 0) & (block_tables < num_pages)
    safe_pages = jnp.where(page_ok, block_tables, 0)
    keys = _gather_sequence_tokens(k_codes, k_norms, k_centroids, k_bits, safe_pages)
    values = _gather_sequence_tokens(v_codes, v_norms, v_centroids, v_bits, safe_pages)
    valid = _valid_token_mask(block_tables, paged_len, num_pages, page_size)
    positions = jnp.broadcast_to(jnp.arange(valid.shape[1], dtype=jnp.int32)[None, :], valid.shape)
    if window is not None:
        win_keys, win_values, win_valid, win_positions = _window_tokens(window, win_lo, win_hi)
        keys = jnp.concatenate([keys.astype(compute_dtype), win_keys.astype(compute_dtype)], axis=2)
        values = jnp.concatenate([values.astype(compute_dtype), win_values.astype(compute_dtype)], axis=2)
        valid = jnp.concatenate([valid, win_valid], axis=1)
        positions = jnp.concatenate([positions, win_positions], axis=1)
    if sliding_window is not None:
        valid = valid & (positions >= (row_len.astype(jnp.int32) - sliding_window)[:, None])
    queries = q_rot.astype(compute_dtype).reshape(num_seqs, num_kv_heads, group, head_dim)
    head_sinks = None if sinks is None else sinks.reshape(1, num_kv_heads, group, 1)
    # one query position per row: the tokens it sees are also the only ones its products touch
    out = _attend_tokens(queries, keys, values, valid[:, None, None, :], valid[:, None, :, None], scale,
                         soft_cap, head_sinks)
    return out.reshape(num_seqs, num_heads, head_dim)


def _attend_tokens(queries, keys, values, valid, token_ok, scale, soft_cap=None, sinks=None):
    """Masked softmax attention: queries [B, Hkv, ..., d] over keys / values [B, Hkv, L, d] ->
    [B, Hkv, ..., d] in promote(inputs, float32); ``valid`` (broadcast to the scores
    [B, Hkv, ..., L]) says which tokens each query sees (none: a zero row), ``token_ok`` (broadcast
    to the keys) which tokens any query sees; soft_cap and sinks (broadcast to the scores'
    [B, Hkv, ..., 1]) as :func:`_masked_softmax_weights`."""
    dtype = _compute_dtype(queries.dtype, keys.dtype, values.dtype)
    # Slots outside the sequences may hold anything (NaN included): masked before any product, so
    # that 0 * NaN leaks into neither the output nor its gradient.
    keys = jnp.where(token_ok, keys.astype(dtype), 0)
    values = jnp.where(token_ok, values.astype(dtype), 0)
    scores = jnp.einsum("bk...d,bkld->bk...l", queries.astype(dtype), keys, precision=_HIGHEST)
    weights = _masked_softmax_weights(scores, valid, jnp.asarray(scale, dtype), soft_cap, sinks)
    return jnp.einsum("bk...l,bkld->bk...d", weights, values, precision=_HIGHEST)


def merge_attention(out, other, weights, q, check):
    """Two attentions' outputs merged (the ``jax_tq_merge_attention`` kernels' semantics).

    Args:
      out, other, q: [T, H, d] of one float dtype; weights float32 [T, H, 2]; check bool [T, H].
    Returns:
      [T, H, d] of out's dtype: weights[..., 0] x out + weights[..., 1] x other in float32 (float64
      for float64 out; a zero weight's term exactly 0, whatever its operand holds), NaN where
      ``check`` and q[t, h, :] is not all finite.
    Source: the log-sum-exp merge of split-KV attention (FlashAttention-2, arXiv 2307.08691, 3.1.1).
    """
    compute = jnp.promote_types(out.dtype, jnp.float32)

    def term(w, x):
        return jnp.where(w[..., None] != 0, w[..., None].astype(compute) * x.astype(compute), 0.0)

    merged = term(weights[..., 0], out) + term(weights[..., 1], other)
    poisoned = check & ~jnp.all(jnp.isfinite(q), axis=-1)
    return jnp.where(poisoned[..., None], jnp.nan, merged).astype(out.dtype)


def prefill_row_lens(query_start_loc, seq_lens, num_rows: int, max_tokens: int):
    """Each query row's sequence and causal length (the semantics of format.h's prefill_rows).

    Sequence s owns rows [begin_s, end_s): query_start_loc clamped to [0, num_rows], end_s >= begin_s.
    Its seq_len is clamped to [0, max_tokens]; its row i sits at position
    seq_len - (end_s - begin_s) + (i - begin_s) and attends to tokens [0, that position].

    Args:
      query_start_loc: int32 [S + 1].  seq_lens: int32 [S].  num_rows: T.  max_tokens: max_pages * page_size.
    Returns:
      (seq int32 [T], lens int32 [T], owned bool [T]): the sequence of each row (0 for a row of
      none), its causal length (0 for a row of none, so that it gets a zero output) and whether a
      sequence owns it. Where ranges overlap (a decreasing query_start_loc) the last sequence owns
      the row.
    """
    starts = jnp.clip(query_start_loc[:-1], 0, num_rows)
    ends = jnp.clip(query_start_loc[1:], starts, num_rows)
    lens = jnp.clip(seq_lens, 0, max_tokens)
    rows = jnp.arange(num_rows, dtype=jnp.int32)[:, None]
    inside = (rows >= starts[None, :]) & (rows < ends[None, :])                  # [T, S]
    num_seqs = starts.shape[0]
    if num_seqs == 0:
        return (jnp.zeros(num_rows, jnp.int32), jnp.zeros(num_rows, jnp.int32), jnp.zeros(num_rows, bool))
    last = num_seqs - 1 - jnp.argmax(inside[:, ::-1], axis=1)                   # the last s holding the row
    owned = jnp.any(inside, axis=1)
    seq = jnp.where(owned, last, 0).astype(jnp.int32)
    position = lens[seq] - (ends[seq] - starts[seq]) + (rows[:, 0] - starts[seq])
    causal = jnp.clip(position + 1, 0, lens[seq])
    return seq, jnp.where(owned, causal, 0).astype(jnp.int32), owned


#: Query rows the prefill reference decodes at a time (its memory is O(chunk x max_pages x page_size
#: x num_kv_heads x head_dim), in the forward and, rematerialised, in the backward pass).
PREFILL_ROW_CHUNK = 16


def paged_prefill_rotated(q_rot, k_codes, k_norms, v_codes, v_norms, k_centroids, v_centroids,
                          block_tables, seq_lens, query_start_loc, k_bits: int, v_bits: int, scale: float,
                          window=None, *, sliding_window=None, soft_cap=None, sinks=None):
    """Causal attention of several sequences' new query rows over a TurboQuant paged cache, in the
    rotated domain (FFI target ``jax_tq_paged_prefill``).

    Each row attends to its sequence's tokens up to its own position (:func:`prefill_row_lens`), as
    they stand in the cache: with a window, the sequence's last min(L, W) tokens (L its clamped
    length) from the window, the others from the pages. Rows are computed PREFILL_ROW_CHUNK at a
    time (``lax.map`` of a rematerialised function), so that memory stays
    O(PREFILL_ROW_CHUNK x max_pages x page_size x num_kv_heads x head_dim) in the forward and the
    backward pass; time O(T x max_pages x page_size), sequential over the chunks.

    Args:
      q_rot: float [T, H, d], the new tokens' queries (sequence s owns rows
        [query_start_loc[s], query_start_loc[s + 1])), rotated by K's Pi, not scaled.
      k_codes, k_norms, v_codes, v_norms, k_centroids, v_centroids: as :func:`paged_decode_rotated`.
      block_tables: int32 [S, max_pages].  seq_lens: int32 [S], every token of each sequence in the
        cache, the new ones included.  query_start_loc: int32 [S + 1].
      k_bits, v_bits: 2, 3 or 4.  scale: softmax scale.
      window: None or (k_window, v_window, window_ids [S]), as :func:`paged_decode_rotated`.
      sliding_window, soft_cap, sinks: as :func:`paged_decode_rotated`; row i at position p sees
        positions [max(0, p + 1 - sliding_window), p].
    Returns:
      out_rot [T, H, d]; rows of no sequence, and rows before their sequence's start, are 0.
    Raises:
      TypeError / ValueError: as :func:`paged_decode_rotated`; query_start_loc not [S + 1].
    Source: TurboQuant (arXiv 2504.19874), Algorithm 1 applied to a KV cache, with a causal mask.
    """
    block_tables, seq_lens = jnp.asarray(block_tables), jnp.asarray(seq_lens)
    query_start_loc = jnp.asarray(query_start_loc)
    if query_start_loc.shape != (seq_lens.shape[0] + 1,):
        raise ValueError(f"query_start_loc must be [num_seqs + 1 = {seq_lens.shape[0] + 1}], got {query_start_loc.shape}")
    if seq_lens.shape[0] == 0:  # no sequence: every row is one of none
        return jnp.zeros(jnp.shape(q_rot), _compute_dtype(jnp.result_type(q_rot)))
    _check_decode_args(jnp.asarray(q_rot)[:0].reshape((0,) + jnp.shape(q_rot)[1:]), k_codes, k_norms, v_codes,
                       v_norms, k_centroids, v_centroids, block_tables[:0], seq_lens[:0], k_bits, v_bits)
    window = _check_window(window, jnp.shape(k_codes)[1], jnp.shape(q_rot)[2], seq_lens.shape[0])
    page_size = jnp.shape(k_codes)[2]
    num_rows = jnp.shape(q_rot)[0]
    capacity = block_tables.shape[1] * page_size
    seq, lens, _ = prefill_row_lens(query_start_loc, seq_lens, num_rows, capacity)
    length = 0 if window is None else window[0].shape[2]
    seq_paged = tq_format.paged_tokens(seq_lens.astype(jnp.int32), capacity, length)
    sinks = _sinks_or_none(sinks)

    def rows(chunk):  # one chunk of rows as one-query attentions; rematerialised in the backward pass
        q_chunk, seq_chunk, lens_chunk = chunk
        paged = jnp.minimum(lens_chunk, seq_paged[seq_chunk])
        rows_window = None if window is None else (window[0], window[1], window[2][seq_chunk])
        return _attend_rotated(jnp.asarray(q_chunk), k_codes, k_norms, v_codes, v_norms, k_centroids, v_centroids,
                               block_tables[seq_chunk], paged, rows_window, seq_paged[seq_chunk],
                               jnp.maximum(lens_chunk, seq_paged[seq_chunk]), scale, lens_chunk, sinks,
                               k_bits=k_bits, v_bits=v_bits, sliding_window=sliding_window, soft_cap=soft_cap)

    if num_rows <= PREFILL_ROW_CHUNK:
        return rows((q_rot, seq, lens))
    chunks = -(-num_rows // PREFILL_ROW_CHUNK)
    pad = chunks * PREFILL_ROW_CHUNK - num_rows

    def split(a):  # [num_rows, ...] -> [chunks, PREFILL_ROW_CHUNK, ...] (padding rows: length 0)
        a = jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1))
        return a.reshape((chunks, PREFILL_ROW_CHUNK) + a.shape[1:])

    out = jax.lax.map(jax.checkpoint(rows), (split(jnp.asarray(q_rot)), split(seq), split(lens)))
    return out.reshape((-1,) + out.shape[2:])[:num_rows]


def _check_decode_args(q_rot, k_codes, k_norms, v_codes, v_norms, k_centroids, v_centroids,
                       block_tables, seq_lens, k_bits, v_bits) -> None:
    """Shape / dtype validation for paged_decode_rotated (messages name the argument)."""
    _check_float("q_rot", q_rot)
    if q_rot.ndim != 3:
        raise ValueError(f"q_rot must be [S, H, d], got shape {q_rot.shape}")
    _check_pools("k_codes", "k_norms", k_codes, k_norms, k_bits)
    _check_pools("v_codes", "v_norms", v_codes, v_norms, v_bits)
    _check_centroids("k_centroids", k_centroids, k_bits)
    _check_centroids("v_centroids", v_centroids, v_bits)
    num_seqs, num_heads, head_dim = q_rot.shape
    num_pages, num_kv_heads, page_size, k_packed = k_codes.shape
    if k_packed * 8 // k_bits != head_dim or v_codes.shape[3] * 8 // v_bits != head_dim:
        raise ValueError(f"k_codes / v_codes head_dim must equal q_rot head_dim {head_dim}")
    if v_codes.shape[:3] != k_codes.shape[:3]:
        raise ValueError(f"v_codes.shape[:3] {v_codes.shape[:3]} must equal k_codes.shape[:3] "
                         f"{k_codes.shape[:3]}")
    if num_heads % num_kv_heads:
        raise ValueError(f"q_rot heads H={num_heads} must be a multiple of Hkv={num_kv_heads}")
    _check_int_array("block_tables", block_tables, 2)
    _check_int_array("seq_lens", seq_lens, 1)
    if block_tables.shape[0] != num_seqs or seq_lens.shape[0] != num_seqs:
        raise ValueError(f"block_tables [{block_tables.shape}] and seq_lens [{seq_lens.shape}] "
                         f"must have S={num_seqs} rows")


def paged_decode(q, k_codes, k_norms, v_codes, v_norms, k_rotation, v_rotation, k_centroids,
                 v_centroids, block_tables, seq_lens, k_bits: int, v_bits: int, scale: float):
    """Paged decode in the original domain: rotate q by Pi_k, attend, rotate out by Pi_v^T.

    Args:
      q: float [S, H, d] (not scaled).  k_rotation, v_rotation: float [d, d].
      Others as :func:`paged_decode_rotated`.
    Returns:
      out [S, H, d] in promote(q.dtype, float32): (attention output in V's rotated space) @ Pi_v.
    Raises:
      TypeError / ValueError: as :func:`paged_decode_rotated`, or bad rotation shapes.
    Source: TurboQuant (arXiv 2504.19874), Algorithm 1 (x_hat = Pi^T c[idx]), applied once to q
      and once to the output instead of to every key and value.
    """
    q = jnp.asarray(q)
    _check_float("q", q)
    head_dim = q.shape[-1] if q.ndim else 0
    k_rotation, v_rotation = jnp.asarray(k_rotation), jnp.asarray(v_rotation)
    _check_rotation(k_rotation, head_dim)
    _check_rotation(v_rotation, head_dim)
    compute_dtype = _compute_dtype(q.dtype)
    q_rot = jnp.matmul(q.astype(compute_dtype), k_rotation.astype(compute_dtype).T,
                       precision=_HIGHEST)
    out_rot = paged_decode_rotated(q_rot, k_codes, k_norms, v_codes, v_norms, k_centroids,
                                   v_centroids, block_tables, seq_lens, k_bits, v_bits, scale)
    return jnp.matmul(out_rot, v_rotation.astype(compute_dtype), precision=_HIGHEST)


def attention_dense(q, k, v, seq_lens, scale: float):
    """Plain masked softmax attention on uncompressed K/V (test reference).

    Args:
      q: float [S, H, d].  k, v: float [S, T, Hkv, d] (token t of sequence s at [s, t]).
      seq_lens: int [S]; tokens t >= seq_lens[s] are masked (clamped to [0, T]).
      scale: softmax scale.
    Returns:
      [S, H, d] in promote(q, k, v, float32); query head h uses KV head h // (H / Hkv); rows with
      seq_len 0 are exactly 0.
    Raises:
      TypeError / ValueError: non-float inputs, inconsistent shapes, H not a multiple of Hkv.
    """
    q, k, v, seq_lens = (jnp.asarray(a) for a in (q, k, v, seq_lens))
    for name, array in (("q", q), ("k", k), ("v", v)):
        _check_float(name, array)
    if q.ndim != 3 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"q must be [S,H,d] and k, v [S,T,Hkv,d]; got {q.shape}, {k.shape}, "
                         f"{v.shape}")
    num_seqs, num_heads, head_dim = q.shape
    _, num_tokens, num_kv_heads, _ = k.shape
    if k.shape[0] != num_seqs or k.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"inconsistent shapes q {q.shape}, k {k.shape}")
    _check_int_array("seq_lens", seq_lens, 1)
    if seq_lens.shape[0] != num_seqs:
        raise ValueError(f"seq_lens must have shape [{num_seqs}], got {seq_lens.shape}")
    return _attention_dense_impl(q, k, v, seq_lens, scale)


@jax.jit
def _attention_dense_impl(q, k, v, seq_lens, scale):
    """attention_dense after validation."""
    num_seqs, num_heads, head_dim = q.shape
    _, num_tokens, num_kv_heads, _ = k.shape
    compute_dtype = _compute_dtype(q.dtype, k.dtype, v.dtype)
    queries = q.astype(compute_dtype).reshape(num_seqs, num_kv_heads, -1, head_dim)
    scores = jnp.einsum("skgd,stkd->skgt", queries, k.astype(compute_dtype), precision=_HIGHEST)
    lengths = jnp.clip(seq_lens, 0, num_tokens)
    valid = (jnp.arange(num_tokens)[None, :] < lengths[:, None])[:, None, None, :]
    weights = _masked_softmax_weights(scores, valid, jnp.asarray(scale, compute_dtype))
    out = jnp.einsum("skgt,stkd->skgd", weights, v.astype(compute_dtype), precision=_HIGHEST)
    return out.reshape(num_seqs, num_heads, head_dim)


# ---------------------------------------------------------------------------------------------
# uncompressed pages: not a reference of a kernel but the implementation of that layout
# ---------------------------------------------------------------------------------------------
@jax.jit
def write_pages(k_pages, v_pages, k, v, slot_mapping):
    """Write new tokens' K and V rows into uncompressed page pools (``jax_tq.write_cache`` of a
    cache made with ``preset="none"``).

    Args:
      k_pages, v_pages: float [P, Hkv, page_size, d] pools (any float dtype, kept).
      k, v: float [T, Hkv, d], rounded to the pools' dtype.
      slot_mapping: int32 [T]; token t goes to page slot // page_size, offset slot % page_size.
        Slots < 0 or >= P * page_size are skipped. Duplicates: one writer wins (unspecified).
    Returns:
      (k_pages, v_pages): updated copies. Differentiable in k, v and the pools' other slots.
    """
    return _scatter_rows(k_pages, k, slot_mapping), _scatter_rows(v_pages, v, slot_mapping)


def _sequence_pages(k_pages, v_pages, block_tables, seq_lens):
    """Each sequence's keys and values [S, Hkv, max_pages*page_size, d] and bool [S, max_pages*page_size]
    of its tokens (< its clamped length, on a page id in [0, P))."""
    num_pages, _, page_size, _ = k_pages.shape
    page_ok = (block_tables >= 0) & (block_tables < num_pages)
    safe_pages = jnp.where(page_ok, block_tables, 0)
    valid = _valid_token_mask(block_tables, seq_lens, num_pages, page_size)
    return _sequence_tokens(k_pages[safe_pages]), _sequence_tokens(v_pages[safe_pages]), valid


@_jit("sliding_window", "soft_cap")
def paged_decode_pages(q, k_pages, v_pages, block_tables, seq_lens, scale, *, sliding_window=None, soft_cap=None,
                       sinks=None):
    """One query row per sequence over uncompressed pages (``jax_tq.paged_decode`` of a cache made
    with ``preset="none"``).

    Args:
      q: float [S, H, d] (not scaled); query head h uses KV head h // (H / Hkv).
      k_pages, v_pages: float [P, Hkv, page_size, d].
      block_tables: int32 [S, max_pages]; ids outside [0, P) are skipped.
      seq_lens: int32 [S], clamped to [0, max_pages*page_size].
      scale: softmax scale.
      sliding_window, soft_cap, sinks: as :func:`paged_decode_rotated` (sinks float [H] or None).
    Returns:
      [S, H, d] in promote(q, pages, float32): softmax_t(scale * <q, k_t>) . v over each
      sequence's tokens; rows with no token are 0, rows whose q is not all finite NaN (as the
      compressed caches' decode). Memory: one copy of each sequence's pages.
    """
    num_seqs, num_heads, head_dim = q.shape
    keys, values, valid = _sequence_pages(k_pages, v_pages, block_tables, seq_lens)
    num_kv_heads = k_pages.shape[1]
    finite = jnp.all(jnp.isfinite(q), axis=-1, keepdims=True)
    # A row that is not all finite attends as zeros (its output is NaN below), so that no 0 x NaN
    # reaches the gradients of the tokens it shares (a NaN row that the loss masks out)
    queries = jnp.where(finite, q, 0).reshape(num_seqs, num_kv_heads, -1, head_dim)
    sees = valid
    if sliding_window is not None:
        ends = jnp.clip(seq_lens.astype(jnp.int32), 0, valid.shape[1])
        sees = valid & (jnp.arange(valid.shape[1])[None, :] >= (ends - sliding_window)[:, None])
    sinks = _sinks_or_none(sinks)
    head_sinks = None if sinks is None else sinks.reshape(1, num_kv_heads, -1, 1)
    out = _attend_tokens(queries, keys, values, sees[:, None, None, :], sees[:, None, :, None], scale, soft_cap,
                         head_sinks)
    out = out.reshape(num_seqs, num_heads, head_dim)
    return jnp.where(finite, out, jnp.nan).astype(out.dtype)


@_jit("sliding_window", "soft_cap")
def paged_prefill_pages(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, scale, *, sliding_window=None,
                        soft_cap=None, sinks=None):
    """Causal attention of several sequences' new query rows over uncompressed pages
    (``jax_tq.paged_prefill`` of a cache made with ``preset="none"``).

    Args:
      q: float [T, H, d] (not scaled); sequence s owns rows [query_start_loc[s], query_start_loc[s + 1]).
      k_pages, v_pages: float [P, Hkv, page_size, d], every token of each sequence written.
      block_tables: int32 [S, max_pages].  seq_lens: int32 [S], new tokens included.
      query_start_loc: int32 [S + 1].  scale: softmax scale.
      sliding_window, soft_cap, sinks: as :func:`paged_prefill_rotated` (sinks float [H] or None).
    Returns:
      [T, H, d] in promote(q, pages, float32): row i attends to its sequence's tokens up to its
      position (:func:`prefill_row_lens`); rows of no sequence, or before their sequence's start,
      are 0; rows a sequence owns whose q is not all finite NaN (as the compressed caches'
      prefill). Every row is scored against every sequence's tokens (then masked): memory and time
      O(T x H x S x max_pages x page_size), the cost of causal attention for one sequence.
    """
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[1]
    keys, values, valid = _sequence_pages(k_pages, v_pages, block_tables, seq_lens)
    num_seqs, length = valid.shape
    seq, lens, owned = prefill_row_lens(query_start_loc, seq_lens, num_rows, length)
    sees = ((seq[:, None] == jnp.arange(num_seqs)[None, :])[:, :, None]
            & (jnp.arange(length)[None, None, :] < lens[:, None, None]) & valid[None])      # [T, S, L]
    if sliding_window is not None:
        sees = sees & (jnp.arange(length)[None, None, :] >= (lens - sliding_window)[:, None, None])
    sinks = _sinks_or_none(sinks)
    group = num_heads // num_kv_heads  # explicit sizes: -1 is ambiguous when a call has 0 rows or tokens
    head_sinks = None if sinks is None else sinks.reshape(1, num_kv_heads, 1, group, 1)

    def flat(tokens):  # [S, Hkv, L, d] -> [1, Hkv, S*L, d]: one key sequence for all rows
        return jnp.swapaxes(tokens, 0, 1).reshape(1, num_kv_heads, num_seqs * length, head_dim)

    finite = jnp.all(jnp.isfinite(q), axis=-1, keepdims=True)
    # as in paged_decode_pages; rows of no sequence too: they are scored against every token
    queries = jnp.where(finite, q, 0).reshape(num_rows, num_kv_heads, group, head_dim)
    queries = jnp.swapaxes(queries, 0, 1)[None]  # [1, Hkv, T, G, d]
    token_ok = jnp.any(sees, axis=0).reshape(1, 1, num_seqs * length, 1)  # the tokens some row sees
    out = _attend_tokens(queries, flat(keys), flat(values), sees.reshape(1, 1, num_rows, 1, num_seqs * length),
                         token_ok, scale, soft_cap, head_sinks)
    out = jnp.swapaxes(out[0], 0, 1).reshape(num_rows, num_heads, head_dim)
    return jnp.where(~finite & owned[:, None, None], jnp.nan, out).astype(out.dtype)


# ---------------------------------------------------------------------------------------------
# TurboQuant_prod: QJL 1-bit residual, unbiased inner products
# ---------------------------------------------------------------------------------------------
def qjl_compress(x, rotation, centroids, sketch, bits: int):
    """TurboQuant_prod quantization (FFI target ``jax_tq_qjl_compress``).

    Args:
      x: float32 | bfloat16 | float16 (| float64 under x64) array [..., d].
      rotation: float [d, d], Pi.  centroids: float [2**bits], the mse codebook.
      sketch: float [d, d], S (i.i.d. N(0, 1)).  bits: the mse width, 2, 3 or 4.
    Returns:
      (codes uint8 [..., d*bits/8], norms [...], signs uint8 [..., d/8], gamma [...]): codes and
      norms exactly as :func:`compress`; with y = Pi x / ||x|| and r = y - c[codes], gamma = ||r||
      and signs the bits of S r >= 0 (docs/FORMAT.md). A zero vector has y = 0, so r = -c[codes].
    Raises:
      TypeError / ValueError: bad dtypes, shapes, bits or head_dim.
    Source: TurboQuant (arXiv 2504.19874), Algorithm 2 (Quant_prod): Quant_mse at bits - 1, then
      qjl = sign(S r), gamma = ||r||; here on the rotated residual (S Pi is again Gaussian).
    """
    x, rotation = jnp.asarray(x), jnp.asarray(rotation)
    centroids, sketch = jnp.asarray(centroids), jnp.asarray(sketch)
    _check_float("x", x)
    head_dim = x.shape[-1] if x.ndim else 0
    _check_rotation(rotation, head_dim)
    _check_centroids("centroids", centroids, bits)
    if sketch.shape != (head_dim, head_dim):
        raise ValueError(f"sketch must have shape ({head_dim}, {head_dim}), got {sketch.shape}")
    _check_float("sketch", sketch)
    return _qjl_compress_impl(x, rotation, centroids, sketch, bits=bits)


@_jit("bits")
def _qjl_compress_impl(x, rotation, centroids, sketch, bits):
    compute_dtype = _compute_dtype(x.dtype)
    x = x.astype(compute_dtype)
    norms, unit = _norm_and_unit(x)
    rotated = jnp.matmul(unit, rotation.astype(compute_dtype).T, precision=_HIGHEST)
    centroids = centroids.astype(compute_dtype)
    codes = quantize_rotated(rotated, centroids)
    residual = rotated - centroids[codes.astype(jnp.int32)]
    gamma = jnp.sqrt(jnp.sum(residual * residual, axis=-1))
    sketched = jnp.matmul(residual, sketch.astype(compute_dtype).T, precision=_HIGHEST)
    return tq_format.pack_codes(codes, bits), norms, tq_format.pack_signs(sketched >= 0), gamma


def qjl_estimate(q_rot, q_sketch, key_values, key_signs, norms, gamma, qjl_scale):
    """The TurboQuant_prod inner-product estimate on unpacked keys (any d, the worked example's too).

    Args:
      q_rot: float [..., Q, d], Pi q.  q_sketch: float [..., Q, d], S Pi q.
      key_values: float [..., S, d], c[codes] per key.  key_signs: float [..., S, d] of +-1.
      norms, gamma: float [..., S].  qjl_scale: sqrt(pi/2) / d for N(0, 1) sketches.
    Returns:
      [..., Q, S] = norms * (<q_rot, c[codes]> + qjl_scale * gamma * <q_sketch, signs>), raw scores
      (no softmax, no 1/sqrt(d)), in promote(inputs, float32).
    Source: TurboQuant (arXiv 2504.19874), Algorithm 2 (DeQuant_prod) in inner-product form;
      QJL (arXiv 2406.03482), the unbiased sign-sketch estimator.
    """
    dtype = _compute_dtype(q_rot.dtype, q_sketch.dtype, key_values.dtype, norms.dtype, gamma.dtype)
    mse = jnp.einsum("...qd,...sd->...qs", q_rot.astype(dtype), key_values.astype(dtype), precision=_HIGHEST)
    qjl = jnp.einsum("...qd,...sd->...qs", q_sketch.astype(dtype), key_signs.astype(dtype), precision=_HIGHEST)
    return norms.astype(dtype)[..., None, :] * (mse + qjl_scale * gamma.astype(dtype)[..., None, :] * qjl)


def qjl_scores_rotated(q_rot, q_sketch, codes, norms, signs, gamma, centroids, bits: int, qjl_scale: float):
    """Raw TurboQuant_prod attention scores over packed keys (FFI target ``jax_tq_qjl_scores``).

    Args:
      q_rot, q_sketch: float [..., Q, d] (Pi q and S Pi q).
      codes: uint8 [..., S, d*bits/8].  norms: float [..., S].  signs: uint8 [..., S, d/8].
      gamma: float [..., S].  centroids: float [2**bits].  bits: mse width 2, 3 or 4.
      qjl_scale: float, sqrt(pi/2) / d.
    Returns:
      [..., Q, S] scores (see :func:`qjl_estimate`), float32 (float64 for float64 inputs under x64).
    Raises:
      ValueError: bits / head_dim unsupported or packed widths that do not match d.
    """
    d = q_rot.shape[-1]
    values = jnp.asarray(centroids)[tq_format.unpack_codes(codes, bits, d).astype(jnp.int32)]
    key_signs = tq_format.unpack_signs(signs, d)
    return qjl_estimate(q_rot, q_sketch, values, key_signs, norms, gamma, qjl_scale)
