"""Keeping a sequence's window ring true to its pages when the sequence did not write its last
tokens itself: pages shared from another sequence (prefix reuse), or tokens rolled back
(speculative decoding) whose ring entries now hold rejected tokens (:func:`fill_window`)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_tq import format as tq_format
from jax_tq import reference
from jax_tq.cache import PagedKVCache, check_cache, window_ids_of
from jax_tq.checks import check_decode_indices, check_window_ids, index_array

__all__ = ["fill_window"]


def fill_window(cache: PagedKVCache, block_tables, seq_lens, *, window_ids=None, stop=None) -> PagedKVCache:
    """Rewrite window entries from the pages: the attention ops read a sequence's last
    ``min(seq_len, window)`` tokens from its window ring only, so the ring must hold them.

    For each sequence s, the ring entry of every position p with ``seq_lens[s] - window <= p <
    min(stop[s], seq_lens[s])`` and ``p >= 0`` gets that token as its page stores it: the bfloat16
    row ``norm * c[code]`` (rotated, what the pages decode to; the exact row is not kept anywhere
    else). Entries of other positions, sequences whose window id is outside [0, num_windows), and
    positions whose block-table entry is outside [0, num_pages) are left as they are.

    Two uses::

        # prefix reuse: sequence s's table starts with pages another sequence wrote (prefix_lens
        # tokens); before its first step, its window gets the prefix's last tokens
        cache = tq.fill_window(cache, block_tables, prefix_lens, window_ids=ids)
        # rollback (speculative decoding) from old_lens to new_lens < old_lens tokens: the entries
        # of positions new_lens - window .. old_lens - window - 1 hold rejected tokens
        cache = tq.fill_window(cache, block_tables, new_lens, window_ids=ids, stop=old_lens - cache.window)

    Args:
      cache: a :class:`PagedKVCache`; one without a window (or uncompressed) is returned as it is
        (after the checks).
      block_tables: int32 [num_seqs, max_pages], the sequences' pages.
      seq_lens: int32 [num_seqs], each sequence's tokens (its positions 0 .. seq_len - 1 are in its
        pages); lengths are clipped to [0, max_pages * page_size].
      window_ids: int32 [num_seqs], distinct per sequence with tokens (default ``arange(num_seqs)``,
        which needs num_seqs <= num_windows; checked mode reports a shared one).
      stop: int32 [num_seqs] or None (``seq_lens``): positions at or past ``stop[s]`` keep their
        entries.
    Returns:
      The cache with new ``k_window`` / ``v_window`` (jit with the cache donated to update them in
      place).
    Raises:
      TypeError / ValueError: a cache that is not a PagedKVCache; an argument of the wrong dtype or
        shape (naming it); window_ids=None with more sequences than window ids, or window_ids given
        for a cache without a window.

    Source: the window is KIVI's full-precision residual (Liu et al., arXiv 2402.02750); the rows
    decoded from codes are TurboQuant's Quant_mse dequantization (arXiv 2504.19874, Algorithm 1)
    before the inverse rotation.
    """
    op = "fill_window"
    check_cache(cache, op)
    block_tables = index_array(block_tables, "block_tables", "[num_seqs, max_pages]", op, ndim=2)
    num_seqs = block_tables.shape[0]
    seq_lens = index_array(seq_lens, "seq_lens", f"[num_seqs={num_seqs}]", op, shape=(num_seqs,))
    stop = seq_lens if stop is None else index_array(stop, "stop", f"[num_seqs={num_seqs}]", op, shape=(num_seqs,))
    window_ids = window_ids_of(cache, window_ids, num_seqs, op, block_tables)
    check_decode_indices(block_tables, seq_lens, num_pages=cache.num_pages, page_size=cache.page_size, op=op)
    if window_ids is None:
        return cache
    check_window_ids(window_ids, seq_lens, num_windows=cache.num_windows, op=op, distinct=True)
    return _fill(cache, block_tables, seq_lens, window_ids, stop)


@jax.jit
def _fill(cache, block_tables, seq_lens, window_ids, stop):
    """fill_window after the checks."""
    length, page_size = cache.window, cache.page_size
    capacity = block_tables.shape[1] * page_size
    ends = jnp.clip(seq_lens, 0, min(capacity, tq_format.INDEX_MAX))
    lo = jnp.maximum(ends - length, 0)
    entries = jnp.arange(length, dtype=jnp.int32)[None, :]
    positions = lo[:, None] + jnp.mod(entries - lo[:, None], length)  # [S, W]: the position entry e holds
    column = positions // page_size
    page = jnp.take_along_axis(block_tables, jnp.minimum(column, block_tables.shape[1] - 1), axis=1)
    fill = ((positions < jnp.minimum(ends, stop)[:, None]) & (page >= 0) & (page < cache.num_pages)
            & ((window_ids >= 0) & (window_ids < cache.num_windows))[:, None])
    page = jnp.where(fill, page, 0)
    offset = positions % page_size
    ids = jnp.where(fill, window_ids[:, None], cache.num_windows)  # not filled: dropped by the scatter

    def refill(ring, codes, norms, codec):
        rows = reference.dequantize_rotated(codes[page, :, offset], norms[page, :, offset], codec.centroids,
                                            codec.bits)  # [S, W, Hkv, d]
        return ring.at[ids, :, entries].set(rows.astype(ring.dtype), mode="drop")

    return dataclasses.replace(cache, k_window=refill(cache.k_window, cache.k_codes, cache.k_norms, cache.k_codec),
                               v_window=refill(cache.v_window, cache.v_codes, cache.v_norms, cache.v_codec))
