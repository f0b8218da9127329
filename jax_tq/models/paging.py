"""How a model's forward addresses jax_tq's paged KV caches: the per-layer caches
(:func:`init_caches`), the slots of new tokens (:func:`slot_mapping_for`) and what each query row
attends to (:class:`CacheRows`, made by :func:`chunk_rows` for a chunk of one sequence, by
:func:`decode_rows` for one new token per sequence and by :func:`prompt_rows` for fresh prompts). Only init_caches reads the model config (layer
count, KV heads, head_dim); the rest serves any decoder."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import jax_tq as tq
from jax_tq.format import window_slot_mapping

from .config import LlamaConfig

__all__ = ["CacheRows", "chunk_rows", "decode_rows", "init_caches", "prompt_rows", "row_windows", "rows_cache",
           "slot_mapping_for"]


def init_caches(config: LlamaConfig, k_bits: int | None, v_bits: int | None, num_pages: int, page_size: int = 16,
                seed: int = 0, rotation: str = "haar", *, scale: str = "norm", window: int = 0, num_windows: int = 1,
                dtype=jnp.float32, exact_layers: Sequence[int] = ()):
    """One empty :class:`jax_tq.PagedKVCache` per layer, all with the same codecs, but for the
    layers in ``exact_layers``, which keep uncompressed pages of ``dtype``.

    Compressed: the K codec uses ``seed`` and the V codec ``seed + 1``, both with ``rotation`` and
    ``scale`` (a preset ``p = jax_tq.get_preset("k4v4")``: ``init_caches(config, p.k_bits,
    p.v_bits, ..., rotation=p.rotation, scale=p.scale, window=p.window)``, or
    :func:`jax_tq.models.config_caches`). Uncompressed: ``k_bits = v_bits = None``, pages of ``dtype``.

    Args:
      config: model config (``num_layers``, ``num_kv_heads``, ``head_dim``).
      k_bits, v_bits: TurboQuant bits per coordinate (2, 3 or 4), or both None (uncompressed).
      num_pages: physical pages per layer pool; page_size: tokens per page (1 to 256).
      seed: codec seed.
      rotation: codec rotation, ``"haar"`` or ``"hadamard"`` (at head_dim 128
        :func:`jax_tq.paged_decode` applies it inside the kernel where one runs).
      scale: the codecs' per-vector scale, ``"norm"`` or ``"fit"`` (:class:`jax_tq.TurboQuant`).
      window: recent tokens kept exactly per sequence (0: none); num_windows: window ids (one per
        sequence decoded at once; row ``b`` of a decode step uses id ``b``).
      dtype: the uncompressed pages' dtype (float32, bfloat16 or float16).
      exact_layers: layer indices (negative ones count from the end, e.g. ``(0, -1)``) whose caches
        are uncompressed pages of ``dtype`` among compressed ones: the layers a model's quality
        depends on most (KIVI and KVQuant keep some layers or tokens in full precision). They
        take no window; every model entry point accepts such a mix.
    Returns:
      list of ``num_layers`` caches.
    Raises:
      ValueError: one of ``k_bits`` / ``v_bits`` None and not the other; an ``exact_layers`` entry
        outside ``[-num_layers, num_layers)`` or not an int.
      TypeError / ValueError: from :class:`jax_tq.TurboQuant` / :meth:`jax_tq.PagedKVCache.create`
        (unsupported ``head_dim``, bits, ``rotation`` or ``scale``, bad sizes, a bad window).
    """
    sizes = dict(num_pages=num_pages, page_size=page_size, num_kv_heads=config.num_kv_heads)
    if (k_bits is None) != (v_bits is None):
        raise ValueError(f"init_caches: k_bits and v_bits must both be None (uncompressed) or both bits, got "
                         f"{k_bits!r} and {v_bits!r}")
    exact = _layer_indices(exact_layers, config.num_layers)
    plain = tq.PagedKVCache.create(**sizes, preset="none", head_dim=config.head_dim, dtype=dtype)
    if k_bits is None:
        cache = plain
    else:
        cache = tq.PagedKVCache.create(**sizes, k_codec=tq.TurboQuant(config.head_dim, k_bits, seed, rotation, scale),
                                       v_codec=tq.TurboQuant(config.head_dim, v_bits, seed + 1, rotation, scale),
                                       window=window, num_windows=num_windows if window else 0)
    return [jax.tree_util.tree_map(jnp.copy, plain if i in exact else cache) for i in range(config.num_layers)]


def _layer_indices(layers: Sequence[int], num_layers: int) -> set:
    """``layers`` (a sequence or array of ints) as indices in [0, num_layers); TypeError for a
    scalar or None, ValueError for an entry outside [-num_layers, num_layers) or not an int."""
    if layers is None or np.ndim(layers) != 1:
        raise TypeError(f"init_caches: exact_layers must be a sequence of layer indices, e.g. (0, -1), got "
                        f"{type(layers).__name__} {layers!r}")
    out = set()
    for i in np.asarray(layers).tolist() if hasattr(layers, "shape") else layers:
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)) or not -num_layers <= i < num_layers:
            raise ValueError(f"init_caches: exact_layers entries must be ints in [-{num_layers}, {num_layers}), got "
                             f"{i!r}")
        out.add(int(i) % num_layers)
    return out


def rows_cache(caches: Sequence):
    """The layer cache whose settings make the :class:`CacheRows` of a forward: the first with a
    window (window slots, one-row views), else the first; layers without a window ignore the
    window parts of the rows."""
    return next((c for c in caches if c.window), caches[0])


def slot_mapping_for(block_tables: jax.Array, positions: jax.Array, page_size: int) -> jax.Array:
    """Cache slots of ``positions`` for sequences with ``block_tables``: :func:`jax_tq.slot_mapping`
    with one position per table row (positions cast to int32).

    Args:
      block_tables: int32 ``[S, max_pages]`` (or ``[max_pages]`` broadcast to every position).
      positions: integer ``[S]`` token positions within each sequence.
      page_size: tokens per cache page.
    Returns:
      int32 ``[S]``: ``block_tables[s, pos // page_size] * page_size + pos % page_size``, or -1
      (padding: :func:`jax_tq.write_cache` skips it) for a position outside
      ``[0, max_pages * page_size)``, which the table does not cover (indexing would clamp it onto
      the last page and overwrite a valid token), or a negative table entry.
    """
    return tq.slot_mapping(block_tables, jnp.asarray(positions).astype(jnp.int32), page_size)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CacheRows:
    """Where a forward's new tokens go in the caches and what each query row attends to (the same
    for every layer); :func:`chunk_rows` and :func:`decode_rows` make it.

    Attributes:
      slots: int32 ``[T]`` cache slots of the new tokens (-1: not written).
      block_tables: int32 ``[S, max_pages]``; seq_lens: int32 ``[S]`` (new tokens included).
      query_start_loc: int32 ``[S + 1]``: the rows of each sequence (:func:`jax_tq.paged_prefill`),
        or None: row ``s`` is sequence ``s``'s one new token (:func:`jax_tq.paged_decode`).
      window_slots, window_ids: int32 ``[T]`` window ring entries of the new tokens and ``[S]`` the
        sequences' window ids, for caches with a window (else None).
      view_start, view_window_id: for a chunk of one sequence through caches with a window, the
        position of row 0 (static) and the sequence's window id: each row is then a sequence of its
        own over :func:`row_windows`'s view, reading its own last ``window`` tokens exactly, as
        decoding would; else None.
      prompt_len: for fresh prompts (:func:`prompt_rows`), the padded length L of each prompt
        (static): the T = S x L rows are prompt ``t // L``'s token ``t % L``, ``seq_lens`` the
        prompts' lengths, and attention is :func:`jax_tq.prompt_attention` (exact over the
        prompt's own K / V, which it writes); else None.
    """

    slots: jax.Array
    block_tables: jax.Array
    seq_lens: jax.Array
    query_start_loc: jax.Array | None = None
    window_slots: jax.Array | None = None
    window_ids: jax.Array | None = None
    view_window_id: jax.Array | None = None
    view_start: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    prompt_len: int | None = dataclasses.field(default=None, metadata=dict(static=True))


def chunk_rows(cache, block_table, start: int, num_tokens: int, window_id=0) -> CacheRows:
    """The :class:`CacheRows` of positions ``start .. start + num_tokens - 1`` of one sequence with
    ``block_table`` (int32 ``[max_pages]``) and, with a window, window id ``window_id``; ``cache``
    (one layer's) gives the page size and window."""
    positions = start + jnp.arange(num_tokens, dtype=jnp.int32)
    slots = slot_mapping_for(block_table, positions, cache.page_size)
    if not cache.window:
        return CacheRows(slots, block_table[None], jnp.asarray([start + num_tokens], jnp.int32),
                         jnp.asarray([0, num_tokens], jnp.int32))
    ids = jnp.full((num_tokens,), window_id, jnp.int32)
    ends = jnp.full((num_tokens,), start + num_tokens, jnp.int32)
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    return CacheRows(slots, jnp.broadcast_to(block_table, (num_tokens, block_table.shape[0])), positions + 1,
                     jnp.arange(num_tokens + 1, dtype=jnp.int32), window_slot_mapping(ids, positions, ends, cache.window),
                     rows, jnp.asarray(window_id, jnp.int32), start)


def decode_rows(cache, block_tables, position, seq_lens) -> CacheRows:
    """The :class:`CacheRows` of one new token per sequence at ``position`` (int32 ``[S]``): row
    ``s`` uses window id ``s``; a row with ``seq_lens`` 0 writes nothing."""
    slots = jnp.where(seq_lens > 0, slot_mapping_for(block_tables, position, cache.page_size), -1)
    if not cache.window:
        return CacheRows(slots, block_tables, seq_lens)
    ids = jnp.arange(position.shape[0], dtype=jnp.int32)
    return CacheRows(slots, block_tables, seq_lens, window_slots=window_slot_mapping(ids, position, seq_lens,
                                                                                     cache.window), window_ids=ids)


def prompt_rows(cache, block_tables, prompt_lens, prompt_len: int) -> CacheRows:
    """The :class:`CacheRows` of fresh prompts padded to ``prompt_len`` tokens: int32
    ``block_tables [S, max_pages]`` and ``prompt_lens [S]``; prompt ``s`` uses window id ``s``
    (caches with a window)."""
    ids = jnp.arange(prompt_lens.shape[0], dtype=jnp.int32) if cache.window else None
    unused = jnp.full((prompt_lens.shape[0] * prompt_len,), -1, jnp.int32)  # prompt_attention writes
    return CacheRows(unused, block_tables, prompt_lens, window_ids=ids, prompt_len=prompt_len)


def row_windows(cache, before, k, v, start: int, window_id):
    """A view of ``cache`` whose window id ``t`` holds what row ``t`` of one sequence's positions
    ``start .. start + T - 1`` reads exactly: the rotated rows of positions ``(p - window, p]``
    (p = start + t), for this call's tokens as :func:`jax_tq.write_cache` writes them (the same
    kernel, into a scratch window of T entries) and for earlier ones from the window ``window_id``
    of ``before`` (the cache as it was before this call's write).

    Args:
      cache: :class:`jax_tq.PagedKVCache` with a window, after the write of k, v (its pages are kept).
      before: the same cache before that write.
      k, v: float ``[T, Hkv, d]`` this call's keys and values.
      start: static position of k[0].  window_id: int32 scalar, the sequence's window id.
    Returns:
      the cache with k_window / v_window of ``[T, Hkv, window, d]`` (memory O(T x window)).
    """
    import jax_tq as tq

    W = cache.window
    T = k.shape[0]
    # A scratch cache of T page slots (page size 1) and T window entries: write_cache writes a
    # token's window row only with its page slot (a token without one is padding).
    def pool(codes):
        return jnp.zeros((T, cache.num_kv_heads, 1, codes.shape[-1]), jnp.uint8)

    norms = jnp.zeros((T, cache.num_kv_heads, 1), jnp.float32)
    window = jnp.zeros((1, cache.num_kv_heads, T, cache.head_dim), jnp.bfloat16)
    scratch = dataclasses.replace(before, k_codes=pool(before.k_codes), k_norms=norms, v_codes=pool(before.v_codes),
                                  v_norms=norms, k_window=window, v_window=window)
    slots = jnp.arange(T, dtype=jnp.int32)
    written = tq.write_cache(scratch, k, v, slots, slots)
    # Rows of positions start - W .. start + T - 1: the ring's (entries p % W) then this call's.
    earlier = (start - W + jnp.arange(W)) % W
    seq_k = jnp.concatenate([before.k_window[window_id][:, earlier], written.k_window[0]], axis=1)
    seq_v = jnp.concatenate([before.v_window[window_id][:, earlier], written.v_window[0]], axis=1)
    t = jnp.arange(T)[:, None]
    entries = jnp.arange(W)[None, :]
    # Row t's entry e holds position p - ((p - e) mod W), p = start + t: index W + t - that offset.
    index = W + t - jnp.mod(start + t - entries, W)
    rows_k = jnp.swapaxes(seq_k[:, index], 0, 1)  # [Hkv, T, W, d] -> [T, Hkv, W, d]
    rows_v = jnp.swapaxes(seq_v[:, index], 0, 1)
    return dataclasses.replace(cache, k_window=rows_k, v_window=rows_v)
