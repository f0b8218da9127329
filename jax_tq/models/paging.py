"""A model's paged KV caches: one per layer (:func:`init_caches`, which reads the model config) and
the slots of new tokens (:func:`slot_mapping_for`). What each query row attends to
(:class:`jax_tq.CacheRows` and its builders) lives in :mod:`jax_tq.cache_rows`, re-exported here."""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import jax_tq as tq
from jax_tq.cache_rows import CacheRows, chunk_rows, decode_rows, prompt_rows, row_windows, rows_cache

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
      rotation: codec rotation, ``"haar"`` or ``"hadamard"`` (at head_dim 64 and 128
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
    exact = layer_indices(exact_layers, config.num_layers)
    plain = tq.PagedKVCache.create(**sizes, preset="none", head_dim=config.head_dim, dtype=dtype)
    if k_bits is None:
        cache = plain
    else:
        cache = tq.PagedKVCache.create(**sizes, k_codec=tq.TurboQuant(config.head_dim, k_bits, seed, rotation, scale),
                                       v_codec=tq.TurboQuant(config.head_dim, v_bits, seed + 1, rotation, scale),
                                       window=window, num_windows=num_windows if window else 0)
    return [jax.tree_util.tree_map(jnp.copy, plain if i in exact else cache) for i in range(config.num_layers)]


def layer_indices(layers: Sequence[int], num_layers: int, where: str = "init_caches") -> set:
    """``layers`` (a sequence or array of ints) as indices in [0, num_layers); TypeError for a
    scalar or None, ValueError for an entry outside [-num_layers, num_layers) or not an int (the
    messages name ``where``'s exact_layers)."""
    if layers is None or np.ndim(layers) != 1:
        raise TypeError(f"{where}: exact_layers must be a sequence of layer indices, e.g. (0, -1), got "
                        f"{type(layers).__name__} {layers!r}")
    out = set()
    for i in np.asarray(layers).tolist() if hasattr(layers, "shape") else layers:
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)) or not -num_layers <= i < num_layers:
            raise ValueError(f"{where}: exact_layers entries must be ints in [-{num_layers}, {num_layers}), got "
                             f"{i!r}")
        out.add(int(i) % num_layers)
    return out


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
