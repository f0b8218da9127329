"""Paged TurboQuant KV cache: page pools for K and V, an optional window of recent tokens kept
exactly, named presets, and the compress-and-write into them; or the same pages uncompressed
(``preset="none"``), served by jnp code."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_tq import _compat, reference
from jax_tq.checks import as_array, check_slot_mapping, check_window_slots, index_array
from jax_tq.codec import TurboQuant
from jax_tq.compress import (FLOAT_DTYPES, check_float_input, check_packed_codec, check_slot_mapping_shape,
                             write_cache_pools)
from jax_tq.format import (INDEX_MAX, MAX_WINDOW, cache_codes_shape, cache_norms_shape, check_bits, check_head_dim,
                           check_index_dtype, window_shape)


@dataclasses.dataclass(frozen=True)
class CachePreset:
    """A named cache setting: codec bits, per-vector scale, rotation and recent-token window.

    Attributes:
      name: e.g. ``"k4v4"``.
      k_bits, v_bits: TurboQuant bits per coordinate of K and V (2, 3 or 4).
      scale: the codecs' per-vector scale (``"fit"``: the fitted least-squares scale).
      window: recent tokens of each sequence kept exactly (bfloat16 rows of the rotated vectors).
      rotation: the codecs' rotation (``"hadamard"``: applied inside the decode kernel at head_dim 64 and 128).

    Compressed bytes per token and KV head: ``head_dim * (k_bits + v_bits) / 8 + 8`` (the same as the
    plain codec's: the fitted scale takes the norm's slot); the window costs ``4 * head_dim`` bytes
    per token, KV head and window slot, a fixed amount per sequence.

    Raises:
      TypeError / ValueError: bits not an int in (2, 3, 4), or a window outside [0, 256] (at
        construction).
    """

    name: str
    k_bits: int
    v_bits: int
    scale: str = "fit"
    window: int = 64
    rotation: str = "hadamard"

    def __post_init__(self):
        check_bits(self.k_bits, "CachePreset k_bits")
        check_bits(self.v_bits, "CachePreset v_bits")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or not 0 <= self.window <= MAX_WINDOW:
            raise ValueError(f"CachePreset window must be an int in [0, {MAX_WINDOW}], got {self.window!r}")

    def codecs(self, head_dim: int, seed: int = 0) -> tuple[TurboQuant, TurboQuant]:
        """(K codec, V codec) of this preset: K seeded ``seed``, V ``seed + 1``.

        Raises:
          TypeError / ValueError: an unsupported head_dim or seed (from :class:`TurboQuant`).
        """
        return (TurboQuant(head_dim, self.k_bits, seed, self.rotation, self.scale),
                TurboQuant(head_dim, self.v_bits, seed + 1, self.rotation, self.scale))


#: The presets, each the best setting measured at its byte budget (docs/performance.md, "Quality"):
#: fitted scales, Hadamard codecs and a 64-token window.
PRESETS = {name: CachePreset(name, bits, bits) for name, bits in (("k4v4", 4), ("k3v3", 3), ("k2v2", 2))}


#: The preset name of the uncompressed page layout (:meth:`PagedKVCache.create`).
UNCOMPRESSED = "none"


def _is_uncompressed(preset) -> bool:
    return isinstance(preset, str) and preset.strip().lower() == UNCOMPRESSED


def get_preset(preset) -> CachePreset:
    """The :class:`CachePreset` named ``preset`` (case-insensitive), or ``preset`` itself if it is one.

    Raises:
      ValueError: an unknown name (the message lists the presets).
      TypeError: neither a string nor a CachePreset.
    """
    if isinstance(preset, CachePreset):
        return preset
    if not isinstance(preset, str):
        raise TypeError(f"preset must be a preset name or a CachePreset, got {type(preset).__name__}")
    found = PRESETS.get(preset.strip().lower())
    if found is None:
        raise ValueError(f"unknown cache preset {preset!r}; presets: {', '.join(PRESETS)}")
    return found


@_compat.exportable_pytree
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """A paged KV cache for one attention layer (a JAX pytree): TurboQuant-compressed, or uncompressed.

    Compressed fields (layout in docs/FORMAT.md; None in an uncompressed cache):
      k_codes: uint8 [num_pages, num_kv_heads, page_size, head_dim * k_bits / 8]
      k_norms: float32 [num_pages, num_kv_heads, page_size] (the per-vector scale)
      v_codes: uint8 [num_pages, num_kv_heads, page_size, head_dim * v_bits / 8]
      v_norms: float32 [num_pages, num_kv_heads, page_size]
      k_codec, v_codec: the :class:`jax_tq.TurboQuant` codecs (K and V may use different bit widths).
      k_window, v_window: None (no window), or bfloat16 [num_windows, num_kv_heads, window, head_dim]:
        the last ``window`` tokens of each sequence, exactly (the rotated vectors Pi_k k, Pi_v v),
        in a ring per window id (docs/FORMAT.md "Window"). The attention ops read a sequence's last
        min(seq_len, window) tokens from here and the others from the pages; :func:`write_cache`
        fills both.

    Uncompressed fields (``create(preset="none")``; None in a compressed cache):
      k_pages, v_pages: float32 / bfloat16 / float16 [num_pages, num_kv_heads, page_size, head_dim],
        the K and V rows themselves. :func:`write_cache`, :func:`jax_tq.paged_decode` and
        :func:`jax_tq.paged_prefill` serve this layout with jnp code compiled by XLA on every
        platform (no jax_tq kernel; :mod:`jax_tq.reference`'s ``*_pages`` functions): a quality
        reference and a baseline through the same API as the compressed caches.
    """

    k_codes: jax.Array | None = None
    k_norms: jax.Array | None = None
    v_codes: jax.Array | None = None
    v_norms: jax.Array | None = None
    k_codec: TurboQuant | None = None
    v_codec: TurboQuant | None = None
    k_window: jax.Array | None = None
    v_window: jax.Array | None = None
    k_pages: jax.Array | None = None
    v_pages: jax.Array | None = None

    @classmethod
    def create(cls, *, num_pages: int, page_size: int, num_kv_heads: int, k_codec: TurboQuant | None = None,
               v_codec: TurboQuant | None = None, preset=None, head_dim: int | None = None, seed: int = 0,
               window: int | None = None, num_windows: int = 0, dtype=None):
        """An empty cache (all codes 0, all norms 0: every slot decodes to the zero vector; or, with
        ``preset="none"``, zero pages).

        Args:
          num_pages: pages in each pool (>= 1).
          page_size: tokens per page, 1 to 256 (any value, not only powers of two).
          num_kv_heads: KV heads (>= 1).
          k_codec, v_codec: codecs with the same head_dim and bits in {2, 3, 4}; or
          preset: a preset name (``"k4v4"``, ``"k3v3"``, ``"k2v2"``, :data:`PRESETS`) or
            :class:`CachePreset`, with ``head_dim`` and ``seed`` (K seeded ``seed``, V ``seed + 1``);
            or ``"none"`` with ``head_dim`` (any >= 1) and ``dtype``: the uncompressed layout.
          window: recent tokens kept exactly per sequence, 0 to 256 (default: the preset's, else 0).
          num_windows: sequences that can hold a window at once (window ids 0 .. num_windows - 1);
            needed (>= 1) when the window is not 0.
          dtype: the uncompressed pages' dtype, float32 (default), bfloat16 or float16; only with
            ``preset="none"``.

        Returns:
          A :class:`PagedKVCache` with pools k_codes / v_codes uint8
          [num_pages, num_kv_heads, page_size, head_dim * bits / 8], k_norms / v_norms float32
          [num_pages, num_kv_heads, page_size] and, with a window, k_window / v_window bfloat16
          [num_windows, num_kv_heads, window, head_dim] (zeros) (layout: docs/FORMAT.md); with
          ``preset="none"``, k_pages / v_pages of ``dtype`` [num_pages, num_kv_heads, page_size, head_dim].

        Raises:
          TypeError: a size that is not a Python int; a codec that is not a TurboQuant; a preset
            that is not a name or CachePreset.
          ValueError: non-positive sizes, page_size > 256, num_pages * page_size or num_windows *
            window past int32, codecs with different head_dim or unsupported bits; both or neither
            of codecs and preset; a preset without head_dim; an unknown preset; a window outside
            [0, 256] or one without num_windows >= 1; num_windows without a window; head_dim or seed
            with codecs (they carry their own); dtype without ``preset="none"``, or a window, a seed
            or a dtype other than float32 / bfloat16 / float16 with it.
        """
        _check_sizes(num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv_heads)
        if _is_uncompressed(preset):
            if k_codec is not None or v_codec is not None:
                raise ValueError("PagedKVCache.create: pass either k_codec / v_codec or preset, not both "
                                 "(preset='none' stores uncompressed pages: no codec)")
            return cls._uncompressed(num_pages, page_size, num_kv_heads, head_dim, seed, window, num_windows, dtype)
        if dtype is not None:
            raise ValueError("PagedKVCache.create: dtype goes with preset='none' (compressed pools have fixed dtypes)")
        if preset is not None:
            if k_codec is not None or v_codec is not None:
                raise ValueError("PagedKVCache.create: pass either k_codec / v_codec or preset, not both")
            if head_dim is None:
                raise ValueError("PagedKVCache.create: a preset needs head_dim")
            preset = get_preset(preset)
            check_head_dim(head_dim, name="PagedKVCache.create: head_dim")
            k_codec, v_codec = preset.codecs(head_dim, seed)
            window = preset.window if window is None else window
        elif k_codec is None or v_codec is None:
            raise ValueError("PagedKVCache.create: pass k_codec and v_codec, or preset (with head_dim)")
        elif head_dim is not None or seed != 0:
            raise ValueError("PagedKVCache.create: head_dim and seed go with a preset; the codecs carry their own")
        window = 0 if window is None else window
        for name, value in (("window", window), ("num_windows", num_windows)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"PagedKVCache.create: {name} must be an int, got {type(value).__name__} {value!r}")
        if not 0 <= window <= MAX_WINDOW:
            raise ValueError(f"PagedKVCache.create: window must be in [0, {MAX_WINDOW}], got {window}")
        if window and num_windows < 1:
            raise ValueError(f"PagedKVCache.create: a window of {window} tokens needs num_windows >= 1 (one per "
                             f"sequence that can be live at once), got {num_windows}")
        if not window and num_windows:
            raise ValueError(f"PagedKVCache.create: num_windows={num_windows} given without a window (window=0)")
        if window and int(num_windows) * window > INDEX_MAX:  # window slot ids are int32, as page slots
            raise ValueError(f"PagedKVCache.create: num_windows * window = {num_windows} * {window} = "
                             f"{int(num_windows) * window} window slots exceed int32 (the ops' window_slots)")
        for name, codec in (("k_codec", k_codec), ("v_codec", v_codec)):
            if not isinstance(codec, TurboQuant):
                raise TypeError(f"PagedKVCache.create: {name} must be a jax_tq.TurboQuant, got {type(codec).__name__}")
        if k_codec.head_dim != v_codec.head_dim:
            raise ValueError(
                f"PagedKVCache.create: k_codec.head_dim {k_codec.head_dim} != v_codec.head_dim {v_codec.head_dim}"
            )
        check_bits(k_codec.bits, name="PagedKVCache.create: k_codec.bits")
        check_bits(v_codec.bits, name="PagedKVCache.create: v_codec.bits")
        d = k_codec.head_dim
        windows = (None, None)
        if window:
            shape = window_shape(num_windows, num_kv_heads, window, d)
            windows = (jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16))
        return cls(
            k_codes=jnp.zeros(cache_codes_shape(num_pages, num_kv_heads, page_size, d, k_codec.bits), jnp.uint8),
            k_norms=jnp.zeros(cache_norms_shape(num_pages, num_kv_heads, page_size), jnp.float32),
            v_codes=jnp.zeros(cache_codes_shape(num_pages, num_kv_heads, page_size, d, v_codec.bits), jnp.uint8),
            v_norms=jnp.zeros(cache_norms_shape(num_pages, num_kv_heads, page_size), jnp.float32),
            k_codec=k_codec,
            v_codec=v_codec,
            k_window=windows[0],
            v_window=windows[1],
        )

    @classmethod
    def _uncompressed(cls, num_pages, page_size, num_kv_heads, head_dim, seed, window, num_windows, dtype):
        """create(preset="none", ...): zero pages of ``dtype`` (float32 by default)."""
        if isinstance(head_dim, bool) or not isinstance(head_dim, (int, np.integer)) or head_dim < 1:
            raise ValueError(f"PagedKVCache.create: preset='none' needs head_dim, an int >= 1, got {head_dim!r}")
        if seed != 0 or window or num_windows:
            raise ValueError("PagedKVCache.create: preset='none' takes no seed, window or num_windows (nothing "
                             "is compressed: every token is exact)")
        dtype = jnp.dtype(jnp.float32 if dtype is None else dtype)
        if dtype not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
            raise ValueError(f"PagedKVCache.create: dtype must be float32, bfloat16 or float16, got {dtype}")
        shape = (num_pages, num_kv_heads, page_size, head_dim)
        return cls(k_pages=jnp.zeros(shape, dtype), v_pages=jnp.zeros(shape, dtype))

    @property
    def compressed(self) -> bool:
        """False for the uncompressed layout (``create(preset="none")``: k_pages / v_pages)."""
        return self.k_pages is None

    def _slots_shape(self) -> tuple:
        """(num_pages, num_kv_heads, page_size): the last three axes of the norms, or the pages' axes -4 to -2."""
        return tuple(self.k_norms.shape[-3:]) if self.compressed else tuple(self.k_pages.shape[-4:-1])

    @property
    def num_pages(self) -> int:
        """Pages in each pool."""
        return self._slots_shape()[0]

    @property
    def num_kv_heads(self) -> int:
        """KV heads stored per page."""
        return self._slots_shape()[1]

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self._slots_shape()[2]

    @property
    def head_dim(self) -> int:
        """Vector length of K and V (before compression: the codecs' head_dim)."""
        return self.k_codec.head_dim if self.compressed else int(self.k_pages.shape[-1])

    @property
    def window(self) -> int:
        """Recent tokens kept exactly per sequence (0: no window)."""
        return 0 if self.k_window is None else int(np.shape(self.k_window)[-2])

    @property
    def num_windows(self) -> int:
        """Window ids 0 .. num_windows - 1 (0 without a window)."""
        return 0 if self.k_window is None else int(np.shape(self.k_window)[-4])

    def window_bytes(self) -> int:
        """Bytes of the window pools (K and V, all window ids): ``4 * head_dim * num_kv_heads *
        window * num_windows``, a fixed cost per sequence slot (0 without a window)."""
        return 2 * 2 * self.head_dim * self.num_kv_heads * self.window * self.num_windows

    @property
    def num_slots(self) -> int:
        """Token slots in the cache: num_pages * page_size (valid slot_mapping values are 0 .. num_slots-1)."""
        return self.num_pages * self.page_size

    def bytes_per_token(self) -> int:
        """Bytes one token occupies across all KV heads, K and V: the packed codes of K and V plus
        their two float32 norms, per KV head (e.g. 136 = 64 + 64 + 4 + 4 at head_dim 128, K4V4);
        uncompressed, 2 * head_dim elements of the pages' dtype per KV head (512 in bfloat16 at 128)."""
        if not self.compressed:
            return 2 * self.head_dim * jnp.dtype(self.k_pages.dtype).itemsize * self.num_kv_heads
        per_head = self.k_codec.packed_bytes + self.v_codec.packed_bytes + 8
        return per_head * self.num_kv_heads

    def __repr__(self) -> str:
        """Shapes and codecs only (the pools can hold millions of elements); abstract (traced)
        pools show their shape too, leaves that are not arrays (a ``jax.tree.map`` of the cache)
        their own repr."""
        def pool(name):
            x = getattr(self, name)
            if hasattr(x, "shape") and hasattr(x, "dtype"):
                return f"{name}={x.dtype}{list(x.shape)}"
            return f"{name}={x!r}"
        if not self.compressed:
            return f"PagedKVCache({pool('k_pages')}, {pool('v_pages')}, uncompressed)"
        windows = ("k_window", "v_window") if self.k_window is not None else ()
        names = ("k_codes", "k_norms", "v_codes", "v_norms") + windows
        pools = ", ".join(pool(n) for n in names)
        return f"PagedKVCache({pools}, k_codec={self.k_codec!r}, v_codec={self.v_codec!r})"


def _check_sizes(**sizes) -> None:
    """TypeError unless each size is an int, ValueError unless >= 1 (and a page_size <= 256, and
    num_pages * page_size within int32)."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"PagedKVCache.create: {name} must be an int, got {type(value).__name__} {value!r}")
        if int(value) < 1:
            raise ValueError(f"PagedKVCache.create: {name} must be >= 1, got {value}")
    if sizes["page_size"] > MAX_PAGE_SIZE:
        raise ValueError(f"PagedKVCache.create: page_size must be <= {MAX_PAGE_SIZE}, got {sizes['page_size']}")
    slots = int(sizes["num_pages"]) * int(sizes["page_size"])
    if slots > INDEX_MAX:  # slot ids are int32 (slot_mapping, the kernels), as PageAllocator requires
        raise ValueError(f"PagedKVCache.create: num_pages * page_size = {sizes['num_pages']} * {sizes['page_size']} = "
                         f"{slots} slots exceed int32 (the ops' slot indices)")


#: Largest page_size (tokens per page) the kernels serve.
MAX_PAGE_SIZE = 256

_POOL_DTYPES = {"k_codes": jnp.uint8, "k_norms": jnp.float32, "v_codes": jnp.uint8, "v_norms": jnp.float32}


def check_cache(cache, op: str) -> None:
    """Raise TypeError unless ``cache`` is a :class:`PagedKVCache` with TurboQuant codecs and pools
    of the storage dtypes (uint8 codes, float32 norms); ValueError if a codec's bits have no packed
    format, the codecs' head_dims differ, a pool has no page, KV head or slot per page, or pages of
    more than 256 slots (what :meth:`PagedKVCache.create` refuses, for caches built otherwise).
    An uncompressed cache: :func:`_check_pages`."""
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"jax_tq.{op}: cache must be a jax_tq.PagedKVCache, got {type(cache).__name__}")
    if not cache.compressed:
        _check_pages(cache, op)
        return
    check_packed_codec(cache.k_codec, op, "cache.k_codec")
    check_packed_codec(cache.v_codec, op, "cache.v_codec")
    for name, dtype in _POOL_DTYPES.items():
        got = getattr(getattr(cache, name), "dtype", None)
        if got is not None and jnp.dtype(got) != jnp.dtype(dtype):
            raise TypeError(f"jax_tq.{op}: cache.{name} must be {jnp.dtype(dtype).name}, got {jnp.dtype(got).name}")
    if cache.k_codec.head_dim != cache.v_codec.head_dim:
        raise ValueError(f"jax_tq.{op}: cache.k_codec.head_dim {cache.k_codec.head_dim} != cache.v_codec.head_dim "
                         f"{cache.v_codec.head_dim}")
    _check_pool_slots(cache, op)
    if (cache.k_window is None) != (cache.v_window is None):
        raise ValueError(f"jax_tq.{op}: cache.k_window and cache.v_window must both be arrays or both None")
    if cache.k_window is not None:
        for name in ("k_window", "v_window"):
            pool = getattr(cache, name)
            if jnp.dtype(getattr(pool, "dtype", None)) != jnp.dtype(jnp.bfloat16):
                raise TypeError(f"jax_tq.{op}: cache.{name} must be bfloat16, got {getattr(pool, 'dtype', None)}")
            want = (cache.num_kv_heads, cache.head_dim)
            shape = tuple(pool.shape)
            if name == "v_window" and shape != tuple(cache.k_window.shape):
                raise ValueError(f"jax_tq.{op}: cache.k_window has shape {tuple(cache.k_window.shape)} and "
                                 f"cache.v_window {shape}: they must be equal")
            if len(shape) < 4 or (shape[-3], shape[-1]) != want or (shape[-2] < 1 or shape[-4] < 1):
                raise ValueError(f"jax_tq.{op}: cache.{name} has shape {shape}, expected [num_windows >= 1, "
                                 f"{want[0]}, window >= 1, {want[1]}]")
    for name in _POOL_DTYPES:
        shape = tuple(getattr(getattr(cache, name), "shape", ()))
        if len(shape) >= 3 and min(shape[:3]) < 1:
            raise ValueError(f"jax_tq.{op}: cache.{name} has shape {shape}: num_pages, num_kv_heads and "
                             "page_size must each be >= 1")
        if len(shape) >= 3 and shape[2] > MAX_PAGE_SIZE:
            raise ValueError(f"jax_tq.{op}: cache.{name} has shape {shape}: page_size {shape[2]} is above "
                             f"{MAX_PAGE_SIZE}")


def _check_pool_slots(cache, op: str) -> None:
    """ValueError unless the four pools agree on (num_pages, num_kv_heads, page_size): the norms'
    last three axes, the codes' axes -4 to -2. The message lists every pool's, so that the odd one
    shows."""
    axes = {"k_codes": slice(-4, -1), "k_norms": slice(-3, None), "v_codes": slice(-4, -1), "v_norms": slice(-3, None)}
    shapes = {name: tuple(getattr(getattr(cache, name), "shape", ())) for name in axes}
    if any(len(shape) < 3 for shape in shapes.values()):
        return  # wrong ranks: the ops' shape checks name them
    slots = {name: shapes[name][axes[name]] for name in axes}
    if len(set(slots.values())) > 1:
        listed = ", ".join(f"cache.{name} {slots[name]} (shape {shapes[name]})" for name in axes)
        raise ValueError(f"jax_tq.{op}: the pools must agree on (num_pages, num_kv_heads, page_size); got {listed}")


def _check_pages(cache, op: str) -> None:
    """An uncompressed cache: TypeError unless k_pages and v_pages are float32 / bfloat16 / float16
    (the same), ValueError unless both are [num_pages, num_kv_heads, page_size <= 256, head_dim] of
    the same shape with every axis >= 1 and no compressed pool, codec or window is set."""
    for name in ("k_codes", "k_norms", "v_codes", "v_norms", "k_codec", "v_codec", "k_window", "v_window"):
        if getattr(cache, name) is not None:
            raise ValueError(f"jax_tq.{op}: an uncompressed cache (k_pages) must have no {name}")
    k_pages, v_pages = cache.k_pages, cache.v_pages
    if v_pages is None:
        raise TypeError(f"jax_tq.{op}: an uncompressed cache needs both k_pages and v_pages (v_pages is None); "
                        "make it with PagedKVCache.create(..., preset='none')")
    for name, pages in (("k_pages", k_pages), ("v_pages", v_pages)):
        check_float_input(pages, f"cache.{name}", op)
    if k_pages.dtype != v_pages.dtype:
        raise TypeError(f"jax_tq.{op}: cache.k_pages is {k_pages.dtype} but cache.v_pages is {v_pages.dtype}")
    shape = tuple(k_pages.shape)
    if len(shape) != 4 or min(shape) < 1 or shape[2] > MAX_PAGE_SIZE or tuple(v_pages.shape) != shape:
        raise ValueError(f"jax_tq.{op}: cache.k_pages {shape} and cache.v_pages {tuple(v_pages.shape)} must both "
                         f"be [num_pages, num_kv_heads, page_size <= {MAX_PAGE_SIZE}, head_dim], each >= 1")


def write_cache(cache: PagedKVCache, k, v, slot_mapping, window_slots=None) -> PagedKVCache:
    """Compress K and V of new tokens and write them into the cache's pages (fused: one kernel call for both),
    and, for a cache with a window, their exact rows into the window.

    Args:
      cache: the :class:`PagedKVCache` to update. An uncompressed one (``preset="none"``) gets the
        rows themselves, rounded to its pages' dtype (jnp scatter, no kernel:
        :func:`jax_tq.reference.write_pages`).
      k, v: [num_tokens, num_kv_heads, head_dim] float32/bfloat16/float16.
      slot_mapping: int32 [num_tokens]; token i goes to page slot_mapping[i] // page_size at offset
        slot_mapping[i] % page_size. Negative slots (padding) and slots >= num_pages * page_size are
        skipped; a padding token (negative slot) is not written to the window either. Tokens that
        share a slot leave one of them (unspecified; under differentiation the last one, and the
        gradient follows the stored token).
      window_slots: int32 [num_tokens], required when the cache has a window (else must be None):
        token i's ring entry ``w * window + position % window`` (w its sequence's window id), or -1
        to skip it; :func:`jax_tq.window_slot_mapping` makes it from window ids, positions and
        sequence lengths, and skips the tokens that are not among their sequence's last ``window``
        (two tokens of one write must not share an entry: which one stays is unspecified). Every
        token is written to the pages too, so the window may be dropped later.

    Returns:
      The updated cache. The pools are aliased to the inputs of the FFI call: donate the cache to the
      enclosing ``jax.jit`` (``donate_argnums``) and it is updated in place. Without donation the
      caller's arrays are left untouched (XLA copies first).

    Raises:
      BackendUnavailableError: backend "ffi" where no kernel serves the call (when it is lowered).
      TypeError / ValueError: cache not a PagedKVCache; dtypes or shapes that do not match the cache
        (message names the argument); window_slots missing for a cache with a window, or given for
        one without.

    Differentiable in k and v through the written norms (d norm = <x, dx> / norm; for fitted scales
    d scale = <dx, Pi^T c[codes]> / |c[codes]|^2), and in the pools' norms for the slots not
    written, and in the window rows: a written entry's tangent is Pi k_dot (the row Pi k with its
    rounding to bfloat16 taken as exact), the others keep the pool's; the same on every backend. The
    codes are integers and get no gradient.

    Source: TurboQuant (arXiv 2504.19874), Algorithm 1 (Quant_mse) per token and KV head; page
    layout of docs/FORMAT.md; the exact recent-token window of KIVI (Liu et al., arXiv 2402.02750).
    """
    return write_tokens(cache, k, v, slot_mapping, window_slots, window_needs_slot=True)


def write_tokens(cache: PagedKVCache, k, v, slot_mapping, window_slots=None, *, window_needs_slot: bool):
    """:func:`write_cache`, and for the library's serving ops (``window_needs_slot=False``) the same
    with ``window_slots`` taken as given: a live token whose page entry is missing (slot -1) still
    enters its ring, which the attention ops read for a sequence's last ``window`` positions
    whatever its table says (the callers pass -1 for their padding tokens themselves)."""
    check_cache(cache, "write_cache")
    k, v = as_array(k, "k", "write_cache"), as_array(v, "v", "write_cache")
    for name, x in (("k", k), ("v", v)):
        if x.ndim != 3:
            raise ValueError(f"jax_tq.write_cache: {name} must be [num_tokens, num_kv_heads, head_dim], got shape "
                             f"{tuple(x.shape)}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"jax_tq.write_cache: k has {k.shape[0]} tokens but v has {v.shape[0]}")
    check_index_dtype(slot_mapping, f"jax_tq.write_cache: slot_mapping must be int32 [{k.shape[0]}]")
    slot_mapping = jnp.asarray(slot_mapping)
    check_slot_mapping_shape(slot_mapping, k.shape[0])
    check_slot_mapping(slot_mapping, num_slots=cache.num_slots)
    window_slots = _window_slots(cache, window_slots, k.shape[0])
    if not cache.compressed:
        return _write_pages(cache, k, v, slot_mapping)
    if window_slots is not None and window_needs_slot:  # a padding token (negative slot) is written nowhere
        window_slots = jnp.where(slot_mapping < 0, -1, window_slots)
    windows = (cache.k_window, cache.v_window) if cache.window else None
    outs = write_cache_pools(k, v, (cache.k_codes, cache.k_norms), (cache.v_codes, cache.v_norms), cache.k_codec,
                    cache.v_codec, slot_mapping, windows, window_slots)
    k_codes, k_norms, v_codes, v_norms = outs[:4]
    new = dataclasses.replace(cache, k_codes=k_codes, k_norms=k_norms, v_codes=v_codes, v_norms=v_norms)
    return dataclasses.replace(new, k_window=outs[4], v_window=outs[5]) if cache.window else new


def _write_pages(cache, k, v, slot_mapping) -> PagedKVCache:
    """write_cache into an uncompressed cache, after the shared checks (slot_mapping's included):
    TypeError / ValueError naming k or v when their dtypes or shapes do not fit the pages."""
    want = (k.shape[0], cache.num_kv_heads, cache.head_dim)
    for name, x in (("k", k), ("v", v)):
        check_float_input(x, name, "write_cache")
        if tuple(x.shape) != want:
            raise ValueError(f"jax_tq.write_cache: {name} has shape {tuple(x.shape)}, expected [num_tokens, "
                             f"num_kv_heads, head_dim] = {want} for the cache's pages")
    k_pages, v_pages = reference.write_pages(cache.k_pages, cache.v_pages, k, v, slot_mapping)
    return dataclasses.replace(cache, k_pages=k_pages, v_pages=v_pages)


def _window_slots(cache, window_slots, num_tokens: int):
    """window_slots as an int32 [num_tokens] array (None without a window); TypeError / ValueError
    naming it when missing, superfluous, or of the wrong dtype or shape."""
    if not cache.window:
        if window_slots is not None:
            raise ValueError("jax_tq.write_cache: window_slots given but the cache has no window")
        return None
    spec = f"jax_tq.write_cache: window_slots must be int32 [{num_tokens}]"
    if window_slots is None:
        raise ValueError(f"{spec} for a cache with a window of {cache.window} tokens (jax_tq.window_slot_mapping "
                         "makes it; -1 skips a token)")
    check_index_dtype(window_slots, spec)
    window_slots = jnp.asarray(window_slots)
    if window_slots.dtype != jnp.int32 or window_slots.shape != (num_tokens,):
        error = TypeError if window_slots.dtype != jnp.int32 else ValueError
        raise error(f"{spec}, got {window_slots.dtype}{tuple(window_slots.shape)}")
    check_window_slots(window_slots, num_entries=cache.num_windows * cache.window)
    return window_slots


def window_ids_of(cache: PagedKVCache, window_ids, num_seqs: int, op: str, block_tables):
    """int32 [num_seqs] window ids for a cache with a window; None without one. The default:
    sequence s uses window s (:func:`default_window_ids`: numbered across the elements of a
    ``jax.vmap`` over sequences, ``block_tables`` telling which).

    Raises:
      ValueError: window_ids given for a cache without a window; window_ids=None with more
        sequences than the cache has window ids (the default ids would drop the last tokens of the
        sequences past them).
      TypeError / ValueError: window_ids not int32 [num_seqs].
    """
    if not cache.window:
        if window_ids is not None:
            raise ValueError(f"jax_tq.{op}: window_ids given but the cache has no window")
        return None
    if window_ids is None:
        if num_seqs > cache.num_windows:
            raise ValueError(f"jax_tq.{op}: {num_seqs} sequences but the cache has {cache.num_windows} window ids; "
                             "pass window_ids (each sequence's window id) or create the cache with num_windows >= "
                             "the number of sequences")
        return default_window_ids(cache, block_tables, num_seqs, op)
    return index_array(window_ids, "window_ids", f"[num_seqs={num_seqs}]", op, shape=(num_seqs,))


def default_window_ids(cache: PagedKVCache, block_tables, num_seqs: int, op: str):
    """The window ids of ``window_ids=None``: int32 [num_seqs], ``arange(num_seqs)``, sequence s
    uses window s, also under ``jax.vmap``: where the vmapped calls' block tables differ and they
    share the cache's windows, element b's sequence s uses window ``b * num_seqs + s`` (the
    numbering of one call over all of them); where the block tables are the same in every element
    (the same sequences), or each element has a cache of its own, every element's ids are
    ``arange(num_seqs)``. The windows of a cache that a vmapped :func:`jax_tq.write_cache` wrote are
    mapped (each element a copy): pass the ids the write used (as :func:`jax_tq.nn.paged_attention`
    does) rather than None.

    Args:
      cache: a :class:`PagedKVCache` with a window.  block_tables: int32 [num_seqs, max_pages] (a
        [max_pages] table: the same for every sequence).  num_seqs: the call's sequences.
    Raises:
      ValueError (under vmap): the elements' sequences together outnumber the cache's window ids.
    """
    tables = jnp.asarray(block_tables)
    seqs = tables[:, :0] if tables.ndim == 2 else jnp.broadcast_to(tables[None, :0], (num_seqs, 0))
    windows = jnp.asarray(cache.k_window)[:, 0, 0, :0].astype(jnp.int32)  # [num_windows, 0]
    return _numbered_ids(op)(seqs.astype(jnp.int32), windows)


@functools.lru_cache(maxsize=None)
def _numbered_ids(op: str):
    """arange over seqs' rows [num_seqs, 0] with default_window_ids' vmap rule (windows
    [num_windows, 0]: the window pool, batched where each element has a cache of its own)."""
    @jax.custom_batching.custom_vmap
    def ids(seqs, windows):
        return jnp.arange(seqs.shape[0], dtype=jnp.int32)

    @ids.def_vmap
    def numbered(size, batched, seqs, windows):
        seqs_batched, windows_batched = batched
        if windows_batched or not seqs_batched:  # each element its own windows, or the same sequences
            # element 0's (empty) arrays: [:1] and a reshape, which a batch of size 0 also has
            first = lambda x, batched: x[:1].reshape(x.shape[1:]) if batched else x  # noqa: E731
            one = ids(first(seqs, seqs_batched), first(windows, windows_batched))
            return jnp.broadcast_to(one, (size,) + one.shape), True
        total, num_windows = size * seqs.shape[1], windows.shape[0]
        if total > num_windows:
            raise ValueError(f"jax_tq.{op}: window_ids=None under vmap numbers the {size} x {seqs.shape[1]} sequences "
                             f"of the vmapped calls 0 .. {total - 1} but the cache has {num_windows} window ids; pass "
                             "window_ids (each sequence's window id)")
        return ids(seqs.reshape((total, 0)), windows).reshape((size, seqs.shape[1])), True

    return ids


def slot_mapping(block_tables, positions, page_size: int, seq_ids=None):
    """Cache slots of tokens from their positions and their sequences' block tables: the
    ``slot_mapping`` of :func:`write_cache`.

    Token i of sequence s = ``seq_ids[i]`` at position p = ``positions[i]`` goes to slot
    ``block_tables[s, p // page_size] * page_size + p % page_size`` (page p // page_size of the
    sequence, offset p % page_size: docs/FORMAT.md), or to -1 (padding: :func:`write_cache` skips
    it) where it has no slot of its own: p outside [0, max_pages * page_size) (the table does not
    cover it; indexing would clamp p onto the last page and overwrite a valid token), s outside
    [0, num_seqs), a negative table entry, or one whose slot would pass int32. An entry at or past
    the pool gives a slot past it, which :func:`write_cache` skips too.

    Args:
      block_tables: int32 [num_seqs, max_pages] (logical page j of sequence s is physical page
        block_tables[s, j]), or [max_pages]: one table for every token.
      positions: int32 [num_tokens], each token's position within its sequence.
      page_size: tokens per page (``cache.page_size``), a Python int >= 1.
      seq_ids: int32 [num_tokens], each token's row of ``block_tables``; None: token i uses row i
        (num_tokens == num_seqs: one new token per sequence) or the one table of a [max_pages]
        ``block_tables``.

    Returns:
      int32 [num_tokens].

    Raises:
      TypeError: an index array not int32 (NumPy int64 would wrap), page_size not an int.
      ValueError: block_tables not of rank 1 or 2, positions or seq_ids not [num_tokens],
        num_tokens != num_seqs without seq_ids, page_size < 1.

    Source: vLLM's slot_mapping (PagedAttention, Kwon et al., arXiv 2309.06180), the page layout
    of docs/FORMAT.md.
    """
    op = "jax_tq.slot_mapping"
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)):
        raise TypeError(f"{op}: page_size must be a Python int (cache.page_size), got {type(page_size).__name__}")
    if page_size < 1:
        raise ValueError(f"{op}: page_size must be >= 1, got {page_size}")
    page_size = int(page_size)
    check_index_dtype(block_tables, f"{op}: block_tables must be int32 [num_seqs, max_pages] or [max_pages]")
    check_index_dtype(positions, f"{op}: positions must be int32 [num_tokens]")
    block_tables, positions = jnp.asarray(block_tables), jnp.asarray(positions)
    for name, x, ranks in (("block_tables", block_tables, (1, 2)), ("positions", positions, (1,))):
        if x.dtype != jnp.int32:
            raise TypeError(f"{op}: {name} must be int32, got {x.dtype}{tuple(x.shape)}")
        if x.ndim not in ranks:
            raise ValueError(f"{op}: {name} must be of rank {' or '.join(map(str, ranks))}, got shape "
                             f"{tuple(x.shape)}")
    num_tokens, max_pages = positions.shape[0], block_tables.shape[-1]
    if seq_ids is not None:
        spec = f"{op}: seq_ids must be int32 [num_tokens={num_tokens}]"
        check_index_dtype(seq_ids, spec)
        seq_ids = jnp.asarray(seq_ids)
        if seq_ids.dtype != jnp.int32 or seq_ids.shape != (num_tokens,):
            error = TypeError if seq_ids.dtype != jnp.int32 else ValueError
            raise error(f"{spec}, got {seq_ids.dtype}{tuple(seq_ids.shape)}")
    elif block_tables.ndim == 2 and block_tables.shape[0] != num_tokens:
        raise ValueError(f"{op}: positions has {num_tokens} tokens but block_tables {block_tables.shape[0]} "
                         "sequences; pass seq_ids (each token's sequence) or one position per sequence")
    page = positions // page_size
    offset = positions % page_size
    covered = (positions >= 0) & (page < max_pages)
    page = jnp.clip(page, 0, max(max_pages - 1, 0))
    if max_pages == 0:
        return jnp.full((num_tokens,), -1, jnp.int32)
    if block_tables.ndim == 1:
        entry = block_tables[page]
    elif seq_ids is None:
        entry = jnp.take_along_axis(block_tables, page[:, None], axis=1)[:, 0]
    else:
        num_seqs = block_tables.shape[0]
        covered &= (seq_ids >= 0) & (seq_ids < num_seqs)
        entry = block_tables[jnp.clip(seq_ids, 0, max(num_seqs - 1, 0)), page] if num_seqs else jnp.zeros_like(page)
    # entry * page_size + offset stays within int32 (no wrap onto a valid slot)
    covered &= (entry >= 0) & (entry <= (INDEX_MAX - offset) // page_size)
    return jnp.where(covered, entry * page_size + offset, -1).astype(jnp.int32)
