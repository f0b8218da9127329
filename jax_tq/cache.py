"""Paged TurboQuant KV cache: page pools for K and V, and the compress-and-write into them."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_tq.checks import check_slot_mapping
from jax_tq.codec import TurboQuant
from jax_tq.compress import check_packed_codec, write_kv
from jax_tq.format import cache_codes_shape, cache_norms_shape, check_bits, check_index_dtype


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """A paged, TurboQuant-compressed KV cache for one attention layer (a JAX pytree).

    Fields (layout in docs/FORMAT.md):
      k_codes: uint8 [num_pages, num_kv_heads, page_size, head_dim * k_bits / 8]
      k_norms: float32 [num_pages, num_kv_heads, page_size]
      v_codes: uint8 [num_pages, num_kv_heads, page_size, head_dim * v_bits / 8]
      v_norms: float32 [num_pages, num_kv_heads, page_size]
      k_codec, v_codec: the :class:`jax_tq.TurboQuant` codecs (K and V may use different bit widths).
    """

    k_codes: jax.Array
    k_norms: jax.Array
    v_codes: jax.Array
    v_norms: jax.Array
    k_codec: TurboQuant
    v_codec: TurboQuant

    @classmethod
    def create(cls, *, num_pages: int, page_size: int, num_kv_heads: int, k_codec: TurboQuant, v_codec: TurboQuant):
        """An empty cache (all codes 0, all norms 0: every slot decodes to the zero vector).

        Args:
          num_pages: pages in each pool (>= 1).
          page_size: tokens per page, 1 to 256 (any value, not only powers of two).
          num_kv_heads: KV heads (>= 1).
          k_codec, v_codec: codecs with the same head_dim and bits in {2, 3, 4}.

        Returns:
          A :class:`PagedKVCache` with pools k_codes / v_codes uint8
          [num_pages, num_kv_heads, page_size, head_dim * bits / 8] and k_norms / v_norms float32
          [num_pages, num_kv_heads, page_size] (layout: docs/FORMAT.md).

        Raises:
          TypeError: a size that is not a Python int; a codec that is not a TurboQuant.
          ValueError: non-positive sizes, page_size > 256, codecs with different head_dim or
            unsupported bits.
        """
        for name, value in (("num_pages", num_pages), ("page_size", page_size), ("num_kv_heads", num_kv_heads)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"PagedKVCache.create: {name} must be an int, got {type(value).__name__} {value!r}")
            if int(value) < 1:
                raise ValueError(f"PagedKVCache.create: {name} must be >= 1, got {value}")
        if page_size > MAX_PAGE_SIZE:
            raise ValueError(f"PagedKVCache.create: page_size must be <= {MAX_PAGE_SIZE}, got {page_size}")
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
        return cls(
            k_codes=jnp.zeros(cache_codes_shape(num_pages, num_kv_heads, page_size, d, k_codec.bits), jnp.uint8),
            k_norms=jnp.zeros(cache_norms_shape(num_pages, num_kv_heads, page_size), jnp.float32),
            v_codes=jnp.zeros(cache_codes_shape(num_pages, num_kv_heads, page_size, d, v_codec.bits), jnp.uint8),
            v_norms=jnp.zeros(cache_norms_shape(num_pages, num_kv_heads, page_size), jnp.float32),
            k_codec=k_codec,
            v_codec=v_codec,
        )

    @property
    def num_pages(self) -> int:
        """Pages in each pool (axis -3 of the norms)."""
        return self.k_norms.shape[-3]

    @property
    def num_kv_heads(self) -> int:
        """KV heads stored per page (axis -2 of the norms)."""
        return self.k_norms.shape[-2]

    @property
    def page_size(self) -> int:
        """Tokens per page (axis -1 of the norms)."""
        return self.k_norms.shape[-1]

    @property
    def head_dim(self) -> int:
        """Vector length of K and V before compression (the codecs' head_dim)."""
        return self.k_codec.head_dim

    @property
    def num_slots(self) -> int:
        """Token slots in the cache: num_pages * page_size (valid slot_mapping values are 0 .. num_slots-1)."""
        return self.num_pages * self.page_size

    def bytes_per_token(self) -> int:
        """Bytes one token occupies across all KV heads, K and V: the packed codes of K and V plus
        their two float32 norms, per KV head (e.g. 136 = 64 + 64 + 4 + 4 at head_dim 128, K4V4)."""
        per_head = self.k_codec.packed_bytes + self.v_codec.packed_bytes + 8
        return per_head * self.num_kv_heads

    def __repr__(self) -> str:
        """Shapes and codecs only (the pools can hold millions of elements); abstract (traced)
        pools show their shape too."""
        def pool(name):
            x = getattr(self, name)
            return f"{name}={getattr(x, 'dtype', '?')}{list(getattr(x, 'shape', ()))}"
        pools = ", ".join(pool(n) for n in ("k_codes", "k_norms", "v_codes", "v_norms"))
        return f"PagedKVCache({pools}, k_codec={self.k_codec!r}, v_codec={self.v_codec!r})"


#: Largest page_size (tokens per page) the kernels serve.
MAX_PAGE_SIZE = 256

_POOL_DTYPES = {"k_codes": jnp.uint8, "k_norms": jnp.float32, "v_codes": jnp.uint8, "v_norms": jnp.float32}


def check_cache(cache, op: str) -> None:
    """Raise TypeError unless ``cache`` is a :class:`PagedKVCache` with TurboQuant codecs and pools
    of the storage dtypes (uint8 codes, float32 norms); ValueError if a codec's bits have no packed
    format, the codecs' head_dims differ, a pool has no page, KV head or slot per page, or pages of
    more than 256 slots (what :meth:`PagedKVCache.create` refuses, for caches built otherwise)."""
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"jax_tq.{op}: cache must be a jax_tq.PagedKVCache, got {type(cache).__name__}")
    check_packed_codec(cache.k_codec, op, "cache.k_codec")
    check_packed_codec(cache.v_codec, op, "cache.v_codec")
    for name, dtype in _POOL_DTYPES.items():
        got = getattr(getattr(cache, name), "dtype", None)
        if got is not None and jnp.dtype(got) != jnp.dtype(dtype):
            raise TypeError(f"jax_tq.{op}: cache.{name} must be {jnp.dtype(dtype).name}, got {jnp.dtype(got).name}")
    if cache.k_codec.head_dim != cache.v_codec.head_dim:
        raise ValueError(f"jax_tq.{op}: cache.k_codec.head_dim {cache.k_codec.head_dim} != cache.v_codec.head_dim "
                         f"{cache.v_codec.head_dim}")
    for name in _POOL_DTYPES:
        shape = tuple(getattr(getattr(cache, name), "shape", ()))
        if len(shape) >= 3 and min(shape[:3]) < 1:
            raise ValueError(f"jax_tq.{op}: cache.{name} has shape {shape}: num_pages, num_kv_heads and "
                             "page_size must each be >= 1")
        if len(shape) >= 3 and shape[2] > MAX_PAGE_SIZE:
            raise ValueError(f"jax_tq.{op}: cache.{name} has shape {shape}: page_size {shape[2]} is above "
                             f"{MAX_PAGE_SIZE}")


def write_cache(cache: PagedKVCache, k, v, slot_mapping) -> PagedKVCache:
    """Compress K and V of new tokens and write them into the cache's pages (fused: one kernel call for both).

    Args:
      cache: the :class:`PagedKVCache` to update.
      k, v: [num_tokens, num_kv_heads, head_dim] float32/bfloat16/float16.
      slot_mapping: int32 [num_tokens]; token i goes to page slot_mapping[i] // page_size at offset
        slot_mapping[i] % page_size. Negative slots (padding) and slots >= num_pages * page_size are
        skipped. Tokens that share a slot leave one of them (unspecified; under differentiation the
        last one, and the gradient follows the stored token).

    Returns:
      The updated cache. The pools are aliased to the inputs of the FFI call: donate the cache to the
      enclosing ``jax.jit`` (``donate_argnums``) and it is updated in place. Without donation the
      caller's arrays are left untouched (XLA copies first).

    Raises:
      TypeError / ValueError: cache not a PagedKVCache; dtypes or shapes that do not match the cache
        (message names the argument).

    Differentiable in k and v through the written norms (d norm = <x, dx> / norm), and in the
    pools' norms for the slots not written, the same on every backend; the codes get no gradient.

    Source: TurboQuant (arXiv 2504.19874), Algorithm 1 (Quant_mse) per token and KV head; page
    layout of docs/FORMAT.md.
    """
    check_cache(cache, "write_cache")
    k, v = jnp.asarray(k), jnp.asarray(v)
    for name, x in (("k", k), ("v", v)):
        if x.ndim != 3:
            raise ValueError(f"jax_tq.write_cache: {name} must be [num_tokens, num_kv_heads, head_dim], got shape "
                             f"{tuple(x.shape)}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"jax_tq.write_cache: k has {k.shape[0]} tokens but v has {v.shape[0]}")
    check_index_dtype(slot_mapping, f"jax_tq.write_cache: slot_mapping must be int32 [{k.shape[0]}]")
    slot_mapping = jnp.asarray(slot_mapping)
    check_slot_mapping(slot_mapping, num_slots=cache.num_slots)
    k_codes, k_norms, v_codes, v_norms = write_kv(k, v, (cache.k_codes, cache.k_norms), (cache.v_codes, cache.v_norms),
                                                  cache.k_codec, cache.v_codec, slot_mapping)
    return dataclasses.replace(cache, k_codes=k_codes, k_norms=k_norms, v_codes=v_codes, v_norms=v_norms)
