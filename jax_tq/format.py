"""THE Python specification of the jax_tq storage format (mirrors cuda_ops/include/jax_tq/format.h).

See docs/DESIGN.md and docs/FORMAT.md. Summary:

* Codes are b-bit indices (b in 2, 3, 4) into the 2**b centroids, one per coordinate of the
  rotated unit vector (TurboQuant, Zandieh et al., arXiv 2504.19874, Algorithm 1, "idx").
* Packing is an LSB-first bit stream: code i occupies bits [i*b, (i+1)*b) of the little-endian
  byte stream, so ``packed_bytes = head_dim * b / 8``. Every group of 8 codes is exactly b bytes:
  the group word w = sum_k c[8g+k] << (b*k) (< 2**32) is stored as bytes (w >> 8j) & 255,
  j = 0 .. b-1. For b = 4 this is byte j = c[2j] | c[2j+1] << 4; for b = 2,
  byte j = c[4j] | c[4j+1] << 2 | c[4j+2] << 4 | c[4j+3] << 6; for b = 3, 3 bytes per 8 codes.
* Paged cache pools: codes uint8 [num_pages, num_kv_heads, page_size, packed_bytes],
  norms float32 [num_pages, num_kv_heads, page_size] (the per-vector scale: ||x||, or the fitted
  least-squares scale of a codec with ``scale="fit"``, see :data:`FIT_GRID`).
* Recent-token window (optional): bfloat16 [num_windows, num_kv_heads, window, head_dim] rings of
  the rotated vectors Pi x; token position p of window id w in entry [w, :, p % window]
  (:func:`window_slot_mapping`, :func:`paged_tokens`).

:func:`pack_codes` / :func:`unpack_codes` accept numpy arrays (computed with numpy) or jax arrays /
tracers (computed with jnp; jit-able, vectorised, uint32 integer ops only).
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "SUPPORTED_HEAD_DIMS", "PACKED_BITS", "CODES_PER_GROUP", "packed_bytes", "check_head_dim",
    "check_bits", "pack_codes", "unpack_codes", "cache_codes_shape", "cache_norms_shape",
    "hadamard_spec", "ROT_NEG1_BIT", "ROT_NEG2_BIT", "sign_bytes", "pack_signs", "unpack_signs",
    "FIT_GRID", "SCALE_KINDS", "MAX_WINDOW", "paged_tokens", "window_slot_mapping", "window_shape",
]

#: head_dims the storage format (and the kernels) support; the C++ table is format.h's
#: SupportedHeadDims (tests/test_format.py checks the two agree).
SUPPORTED_HEAD_DIMS = (64, 80, 96, 128, 192, 256)
#: Bit widths of packed storage (format.h's PackedBits).
PACKED_BITS = (2, 3, 4)
#: Codes per packing group; a group of 8 b-bit codes is exactly b bytes.
CODES_PER_GROUP = 8
#: The largest index (slot_mapping, block_tables, seq_lens are int32); a pool or block table
#: beyond it can hold no out-of-range int32 index.
INDEX_MAX = 2**31 - 1
#: A norm below 2^-64 (~5.4e-20) is stored as the zero vector, norm 0 and the codes of y = 0, on
#: every backend (format.h kMinNorm): a margin above the ~2^-100 from which the kernels' float32
#: products of the vector's entries with the rotation fall below 2^-126 and lose precision.
MIN_NORM = 2.0**-64
#: Per-vector scale kinds of a codec: "norm" stores ||x|| (TurboQuant_mse as published), "fit" the
#: least-squares scale of the best of the FIT_GRID pre-scalings (docs/FORMAT.md "Fitted scale").
SCALE_KINDS = ("norm", "fit")
#: Pre-scalings s_k = (45 + 3k) / 64, k = 0..16 (exact in float32) of a ``scale="fit"`` codec: the
#: unit rotated vector y is quantized against the boundaries times s_k, the k whose codes keep the
#: most of y (<y, c>^2 / |c|^2, first k on ties) wins, and ||x|| <y, c> / |c|^2 is stored in the
#: norm slot. Within 0.6% of a continuous search's MSE (Gaussian rows, d 64 and 128, 2-4 bits).
FIT_GRID = tuple((45 + 3 * k) / 64 for k in range(17))
#: Longest recent-token window of a cache (tokens kept exactly per sequence).
MAX_WINDOW = 256
#: Hadamard rotation spec words (see :func:`hadamard_spec`): bits 0-15 hold perm[i].
ROT_NEG1_BIT = 1 << 16
ROT_NEG2_BIT = 1 << 17


def check_index_dtype(x, what: str) -> None:
    """Refuses an index operand (block_tables, seq_lens, slot_mapping) given with a dtype other than
    int32, before ``jnp.asarray`` sees it: with x64 off that casts NumPy int64 to int32, wrapping
    values past 2^31 - 1 into valid-looking indices, and float64 to float32 (the error would then
    name the wrong dtype). Values without a dtype (lists, Python ints) are left to ``jnp.asarray``,
    after a check that their integers fit int32 (``jnp.asarray`` raises a bare OverflowError).

    Args:
      x: the operand as the user passed it (NumPy or JAX array, list, scalar).
      what: the message's start, e.g. "jax_tq.paged_decode: block_tables must be int32 [num_seqs=2, max_pages]".
    Raises:
      TypeError: "{what}, got {dtype}{shape}" where x has a dtype other than int32; x neither an
        array nor a number or list (None, a string).
      ValueError: a list or Python int holding an integer outside int32.
    """
    dtype = getattr(x, "dtype", None)
    if dtype is not None and np.dtype(dtype) != np.int32:
        raise TypeError(f"{what}, got {np.dtype(dtype)}{tuple(np.shape(x))}")
    if dtype is None and not isinstance(x, (int, float, list, tuple)):  # None, a string, another object
        raise TypeError(f"{what}, got {type(x).__name__}")
    if dtype is None and isinstance(x, (int, list, tuple)):
        info = np.iinfo(np.int32)
        try:
            values = np.asarray(x, np.int64)
        except OverflowError:  # past int64
            raise ValueError(f"{what}, got an integer outside int32") from None
        except (TypeError, ValueError):  # not integers alone (tracers, ragged lists): jnp.asarray decides
            return
        outside = values[(values < info.min) | (values > info.max)]
        if outside.size:
            raise ValueError(f"{what}, got {outside[0]}, outside int32")


def _is_int(value) -> bool:
    """True for Python / numpy integers (bool excluded)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_head_dim(head_dim, name: str = "head_dim") -> int:
    """Validate a head_dim for packed storage and return it as int.

    Raises:
      TypeError: not an int.  ValueError: not in SUPPORTED_HEAD_DIMS (64, 80, 96, 128, 192, 256).
    """
    if not _is_int(head_dim):
        raise TypeError(f"{name} must be an int, got {type(head_dim).__name__} ({head_dim!r})")
    if int(head_dim) not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"{name} must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    return int(head_dim)


def check_bits(bits, name: str = "bits") -> int:
    """Validate a bit width for packed storage and return it as int.

    Raises:
      TypeError: not an int.  ValueError: not in PACKED_BITS (2, 3, 4); 1-bit codebooks exist
      for the codec but have no packed storage format.
    """
    if not _is_int(bits):
        raise TypeError(f"{name} must be an int, got {type(bits).__name__} ({bits!r})")
    if int(bits) not in PACKED_BITS:
        raise ValueError(f"{name} must be one of {PACKED_BITS} for packed storage, got {bits}")
    return int(bits)


def packed_bytes(head_dim: int, bits: int) -> int:
    """Bytes of packed codes per token per KV head: head_dim * bits / 8 (e.g. 128, 4 -> 64).

    Raises:
      TypeError / ValueError: unsupported head_dim or bits (see check_head_dim / check_bits).
    """
    return check_head_dim(head_dim) * check_bits(bits) // 8


def _check_positive_int(name: str, value) -> int:
    """Return value as int; TypeError if not an int, ValueError if < 1."""
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def cache_codes_shape(num_pages: int, num_kv_heads: int, page_size: int, head_dim: int,
                      bits: int) -> tuple[int, int, int, int]:
    """Shape of one codes pool: (num_pages, num_kv_heads, page_size, packed_bytes), dtype uint8.

    Raises:
      TypeError / ValueError: a size that is not a positive int, or unsupported head_dim / bits.
    """
    return (_check_positive_int("num_pages", num_pages),
            _check_positive_int("num_kv_heads", num_kv_heads),
            _check_positive_int("page_size", page_size),
            packed_bytes(head_dim, bits))


def cache_norms_shape(num_pages: int, num_kv_heads: int, page_size: int) -> tuple[int, int, int]:
    """Shape of one norms pool: (num_pages, num_kv_heads, page_size), dtype float32.

    Raises:
      TypeError / ValueError: a size that is not a positive int.
    """
    return (_check_positive_int("num_pages", num_pages),
            _check_positive_int("num_kv_heads", num_kv_heads),
            _check_positive_int("page_size", page_size))


def _array_module(array):
    """numpy for numpy arrays / scalars / lists, jax.numpy for jax arrays and tracers."""
    if isinstance(array, (np.ndarray, np.generic, list, tuple)):
        return np
    import jax.numpy as jnp  # deferred so the numpy path works without importing jax
    return jnp


def _check_integer_dtype(name: str, dtype) -> None:
    """TypeError unless dtype is an integer dtype."""
    if not np.issubdtype(np.dtype(dtype), np.integer):
        raise TypeError(f"{name} must have an integer dtype, got {np.dtype(dtype)}")


def _bitwise_or_last_axis(xp, array):
    """Bitwise OR over the (short) last axis of a uint32 array.

    numpy: a loop over the few columns (much faster than a ufunc reduce over a length-8 axis).
    jnp: one lax.reduce (a chain of masked ORs makes XLA:CPU compile for seconds).
    """
    if xp is np:
        result = array[..., 0].copy()
        for column in range(1, array.shape[-1]):
            result |= array[..., column]
        return result
    import jax
    return jax.lax.reduce(array, np.uint32(0), jax.lax.bitwise_or, (array.ndim - 1,))


def pack_codes(codes, bits: int):
    """Pack b-bit codes into the LSB-first byte stream of the storage format.

    Args:
      codes: integer array [..., head_dim] (numpy or jax), values in [0, 2**bits);
        head_dim in SUPPORTED_HEAD_DIMS.
      bits: 2, 3 or 4.
    Returns:
      uint8 array [..., head_dim * bits / 8], same array module as the input.
    Raises:
      TypeError: codes not of an integer dtype.
      ValueError: unsupported bits or head_dim (last axis); for numpy input also a code value
        outside [0, 2**bits). (jax input cannot be checked under jit: values are masked to the
        low ``bits`` bits.)
    Source: storage format of docs/DESIGN.md (TurboQuant, arXiv 2504.19874, Algorithm 1 "idx").
    """
    xp = _array_module(codes)
    codes = xp.asarray(codes)
    bits = check_bits(bits)
    _check_integer_dtype("codes", codes.dtype)
    head_dim = check_head_dim(codes.shape[-1] if codes.ndim else 0, name="codes.shape[-1]")
    if xp is np and codes.size and (codes.min() < 0 or codes.max() >= 1 << bits):
        raise ValueError(f"codes must lie in [0, {1 << bits}) for bits={bits}, got values in "
                         f"[{codes.min()}, {codes.max()}]")
    groups = codes.reshape(codes.shape[:-1] + (head_dim // 8, 8)).astype(xp.uint32)
    groups = groups & xp.uint32((1 << bits) - 1)
    code_shifts = xp.asarray(bits * np.arange(8, dtype=np.uint32))
    words = _bitwise_or_last_axis(xp, groups << code_shifts)            # [..., d/8] uint32
    byte_shifts = xp.asarray(8 * np.arange(bits, dtype=np.uint32))
    group_bytes = (words[..., None] >> byte_shifts).astype(xp.uint8)   # keeps the low 8 bits
    return group_bytes.reshape(codes.shape[:-1] + (head_dim * bits // 8,))


def sign_bytes(head_dim: int) -> int:
    """Bytes of QJL sign bits per vector: head_dim / 8 (one bit per coordinate; 128 -> 16).

    Raises:
      TypeError / ValueError: unsupported head_dim (see check_head_dim).
    """
    return check_head_dim(head_dim) // 8


def pack_signs(positive):
    """Pack QJL sign bits: the 1-bit case of the codes' LSB-first stream.

    Coordinate j is bit j % 8 of byte j // 8; a set bit means sign +1 (the sketched residual was
    >= 0), a clear bit -1.

    Args:
      positive: bool (or integer 0/1) array [..., head_dim] (numpy or jax), head_dim in
        SUPPORTED_HEAD_DIMS.
    Returns:
      uint8 array [..., head_dim / 8], same array module as the input.
    Raises:
      ValueError: unsupported head_dim (last axis).
    Source: QJL (Zandieh et al., arXiv 2406.03482) sign(S r) bits, stored as in docs/FORMAT.md.
    """
    xp = _array_module(positive)
    positive = xp.asarray(positive)
    head_dim = check_head_dim(positive.shape[-1] if positive.ndim else 0, name="positive.shape[-1]")
    bits = (positive != 0).astype(xp.uint32).reshape(positive.shape[:-1] + (head_dim // 8, 8))
    words = _bitwise_or_last_axis(xp, bits << xp.asarray(np.arange(8, dtype=np.uint32)))
    return words.astype(xp.uint8)


def unpack_signs(packed, head_dim: int):
    """Unpack QJL sign bits to +-1 (inverse of :func:`pack_signs`).

    Args:
      packed: uint8 array [..., head_dim / 8] (numpy or jax).
      head_dim: int in SUPPORTED_HEAD_DIMS.
    Returns:
      int8 array [..., head_dim] of +1 / -1, same array module as the input.
    Raises:
      TypeError: packed not uint8.  ValueError: unsupported head_dim or a last axis other than
        head_dim / 8.
    """
    xp = _array_module(packed)
    packed = xp.asarray(packed)
    num_bytes = sign_bytes(head_dim)
    if np.dtype(packed.dtype) != np.uint8:
        raise TypeError(f"packed signs must be uint8, got {np.dtype(packed.dtype)}")
    if packed.ndim == 0 or packed.shape[-1] != num_bytes:
        raise ValueError(f"packed signs must be [..., head_dim/8 = {num_bytes}] for head_dim={head_dim}, "
                         f"got shape {packed.shape}")
    bits = (packed.astype(xp.uint32)[..., None] >> xp.asarray(np.arange(8, dtype=np.uint32))) & xp.uint32(1)
    return (bits.astype(xp.int8) * 2 - 1).reshape(packed.shape[:-1] + (head_dim,))


def unpack_codes(packed, bits: int, head_dim: int):
    """Unpack the storage byte stream back to b-bit codes (inverse of :func:`pack_codes`).

    Args:
      packed: uint8 array [..., head_dim * bits / 8] (numpy or jax).
      bits: 2, 3 or 4.
      head_dim: int in SUPPORTED_HEAD_DIMS.
    Returns:
      uint8 array [..., head_dim] of codes in [0, 2**bits), same array module as the input.
    Raises:
      TypeError: packed not uint8.
      ValueError: unsupported bits / head_dim, or packed.shape[-1] != head_dim * bits / 8.
    Source: storage format of docs/DESIGN.md.
    """
    xp = _array_module(packed)
    packed = xp.asarray(packed)
    num_bytes = packed_bytes(head_dim, bits)
    if np.dtype(packed.dtype) != np.uint8:
        raise TypeError(f"packed must be uint8, got {np.dtype(packed.dtype)}")
    if packed.ndim == 0 or packed.shape[-1] != num_bytes:
        raise ValueError(f"packed.shape[-1] must be head_dim*bits/8 = {num_bytes} for "
                         f"head_dim={head_dim}, bits={bits}, got shape {packed.shape}")
    group_bytes = packed.reshape(packed.shape[:-1] + (head_dim // 8, bits)).astype(xp.uint32)
    byte_shifts = xp.asarray(8 * np.arange(bits, dtype=np.uint32))
    words = _bitwise_or_last_axis(xp, group_bytes << byte_shifts)      # [..., d/8] uint32
    code_shifts = xp.asarray(bits * np.arange(8, dtype=np.uint32))
    codes = (words[..., None] >> code_shifts) & xp.uint32((1 << bits) - 1)
    return codes.astype(xp.uint8).reshape(packed.shape[:-1] + (head_dim,))


def hadamard_spec(signs_first, permutation, signs_second) -> np.ndarray:
    """The int32 spec row of a randomized Hadamard rotation Pi = H D2 P H D1 (one word per coordinate).

    H is the normalized Sylvester Hadamard matrix, D1 = diag(signs_first), D2 = diag(signs_second)
    and (P v)_i = v_{permutation[i]} (see :mod:`jax_tq.rotation`). Word i holds permutation[i] in
    bits 0-15, ``ROT_NEG1_BIT`` where signs_first[i] < 0 and ``ROT_NEG2_BIT`` where
    signs_second[i] < 0; the kernels read it with rot_perm / rot_neg1 / rot_neg2 (format.h) and
    apply Pi (and Pi^T) in O(d log d) instead of a d x d product.

    Args:
      signs_first, signs_second: [d] arrays of +-1.
      permutation: [d] integer array, a permutation of 0 .. d-1.
    Returns:
      numpy int32 [d].
    Raises:
      ValueError: d not a power of two up to 2^15, the three lengths differ, a sign not +-1, or
        ``permutation`` not a permutation.
    """
    first = np.asarray(signs_first, dtype=np.float64)
    second = np.asarray(signs_second, dtype=np.float64)
    perm = np.asarray(permutation)
    d = perm.shape[0] if perm.ndim == 1 else -1
    if d < 1 or d & (d - 1) or d > 1 << 15:
        raise ValueError(f"hadamard_spec: the permutation must be [d] with d a power of two <= 2^15, got shape {perm.shape}")
    if first.shape != (d,) or second.shape != (d,):
        raise ValueError(f"hadamard_spec: signs must be [{d}], got {first.shape} and {second.shape}")
    if not (np.all(np.abs(first) == 1) and np.all(np.abs(second) == 1)):
        raise ValueError("hadamard_spec: signs must be +-1")
    if not np.array_equal(np.sort(perm), np.arange(d)):
        raise ValueError("hadamard_spec: permutation is not a permutation of 0 .. d-1")
    words = perm.astype(np.int64) | np.where(first < 0, ROT_NEG1_BIT, 0) | np.where(second < 0, ROT_NEG2_BIT, 0)
    return words.astype(np.int32)


def window_shape(num_windows: int, num_kv_heads: int, window: int, head_dim: int) -> tuple[int, int, int, int]:
    """Shape of one window pool (K or V): (num_windows, num_kv_heads, window, head_dim), bfloat16.

    Raises:
      TypeError / ValueError: a size that is not a positive int, window above MAX_WINDOW, or an
        unsupported head_dim.
    """
    window = _check_positive_int("window", window)
    if window > MAX_WINDOW:
        raise ValueError(f"window must be <= {MAX_WINDOW}, got {window}")
    return (_check_positive_int("num_windows", num_windows), _check_positive_int("num_kv_heads", num_kv_heads),
            window, check_head_dim(head_dim))


def paged_tokens(seq_lens, capacity: int, window: int):
    """Tokens of each sequence read from the pages when the last ``window`` come from the window:
    ``max(clip(seq_lens, 0, capacity) - window, 0)`` (jnp or numpy, elementwise).

    Args:
      seq_lens: integer array (any shape).  capacity: max_pages * page_size.  window: tokens kept
        in the window (0: none).
    Returns:
      an array like ``seq_lens``.
    """
    xp = _array_module(seq_lens)
    lens = xp.clip(xp.asarray(seq_lens), 0, min(capacity, INDEX_MAX))  # int32 lengths: no larger bound
    return xp.maximum(lens - window, 0)


def window_slot_mapping(window_ids, positions, seq_lens, window: int):
    """Ring entries of written tokens in a window pool (``write_cache``'s ``window_slots``).

    A token at ``position`` of a sequence with window id ``w`` and, after the write, ``seq_len``
    tokens goes to entry ``w * window + position % window`` if it is among the sequence's last
    ``window`` tokens (``seq_len - window <= position < seq_len``), else -1 (not written: a later
    token of the same write takes its entry). Negative window ids or positions give -1, and so do
    ids whose entries would pass int32 (``w * window + window - 1 >= 2**31``).

    Args:
      window_ids, positions, seq_lens: integer arrays [num_tokens] (jnp or numpy; jnp if any of
        them is a jax array or tracer), per token: its sequence's window id, its position, and its
        sequence's length after the write; numpy values must fit int32.
      window: the cache's window (>= 1).
    Returns:
      int32 [num_tokens].
    Raises:
      ValueError: window < 1 or past int32; the three not of one shape [num_tokens]; numpy values
        outside int32.
      TypeError: window not an int; a non-integer array, or not an array (None, a string).
    """
    if not _is_int(window):
        raise TypeError(f"jax_tq.window_slot_mapping: window must be an int >= 1, got {window!r}")
    if window < 1 or window > np.iinfo(np.int32).max:
        hint = " (a cache without a window: write_cache takes no window_slots)" if window == 0 else ""
        raise ValueError(f"jax_tq.window_slot_mapping: window must be an int in [1, 2^31 - 1], got {window!r}{hint}")
    named = (("window_ids", window_ids), ("positions", positions), ("seq_lens", seq_lens))
    modules = {_array_module(a) for _, a in named}
    xp = np if modules == {np} else (modules - {np}).pop()
    arrays = []
    for name, a in named:
        try:
            a = xp.asarray(a)
        except (TypeError, ValueError):
            raise TypeError(f"jax_tq.window_slot_mapping: {name} must be an integer array, got {type(a).__name__}") from None
        if not np.issubdtype(a.dtype, np.integer):
            raise TypeError(f"jax_tq.window_slot_mapping: {name} must be integers, got {a.dtype}")
        if xp is np and a.size and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
            raise ValueError(f"jax_tq.window_slot_mapping: {name} holds values outside int32")
        arrays.append(a.astype(xp.int32))
    if arrays[0].ndim != 1 or any(a.shape != arrays[0].shape for a in arrays):
        shapes = ", ".join(f"{name} {tuple(a.shape)}" for (name, _), a in zip(named, arrays))
        raise ValueError(f"jax_tq.window_slot_mapping: window_ids, positions and seq_lens must be [num_tokens] "
                         f"each (one per token), got {shapes}")
    window_ids, positions, seq_lens = arrays
    max_id = (np.iinfo(np.int32).max - (window - 1)) // window
    kept = ((window_ids >= 0) & (window_ids <= max_id) & (positions >= 0) & (positions < seq_lens)
            & (positions >= seq_lens - window))
    return xp.where(kept, xp.where(kept, window_ids, 0) * window + positions % window, -1).astype(xp.int32)
