"""What a decoder layer's forward does with its paged cache, said once for every layer: where the
new tokens' K / V go and what each query row attends to (:class:`CacheRows`), and the call that
writes and attends as they say (:func:`attend_rows`).

A model builds one :class:`CacheRows` per forward (the same for all its layers) with
:func:`prompt_rows` (fresh prompts: exact attention over each prompt's own K / V),
:func:`chunk_rows` (a chunk of one sequence after its cached tokens: chunked prefill, scoring) or
:func:`decode_rows` (one new token per sequence), or builds one itself for a ragged batch (rows of
several sequences, :func:`jax_tq.paged_prefill`'s ``query_start_loc``). :class:`jax_tq.nn.PagedAttention`'s
``attend`` and the models of :mod:`jax_tq.models` run every layer through :func:`attend_rows`.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_tq import _compat
from jax_tq.cache import PagedKVCache, slot_mapping, window_ids_of, write_cache, write_tokens
from jax_tq.checks import check_decode_indices, check_window_ids, index_array
from jax_tq.format import INDEX_MAX, window_slot_mapping
from jax_tq.paged_decode import paged_decode
from jax_tq.paged_prefill import paged_prefill
from jax_tq.ragged import prompt_attention

__all__ = ["CacheRows", "attend_rows", "chunk_rows", "decode_rows", "prompt_rows", "row_windows", "rows_cache"]


@_compat.exportable_pytree
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CacheRows:
    """Where a forward's T new tokens go in a layer's cache and what each query row attends to (the
    same for every layer of a model); :func:`prompt_rows`, :func:`chunk_rows` and :func:`decode_rows`
    make it, or a caller fills it for a ragged batch.

    Attributes:
      slots: int32 ``[T]`` cache slots of the new tokens (:func:`jax_tq.slot_mapping`; -1: not written).
      block_tables: int32 ``[S, max_pages]``; seq_lens: int32 ``[S]`` (new tokens included).
      query_start_loc: int32 ``[S + 1]``: the rows of each sequence (:func:`jax_tq.paged_prefill`),
        or None: row ``s`` is sequence ``s``'s one new token (:func:`jax_tq.paged_decode`).
      window_slots, window_ids: int32 ``[T]`` window ring entries of the new tokens (-1: not
        written; an entry is written even where the token's slot is -1, a page not allocated, as
        the ring is what a sequence's last ``window`` positions read: give padding tokens -1) and
        ``[S]`` the sequences' window ids, for caches with a window (else None; caches without
        one ignore them).
      view_start, view_window_id: for a chunk of one sequence through caches with a window, the
        position of row 0 (static) and the sequence's window id: each row is then a sequence of its
        own over :func:`row_windows`'s view, reading its own last ``window`` tokens exactly, as
        decoding would; else None.
      prompt_len: for fresh prompts (:func:`prompt_rows`), the padded length L of each prompt
        (static): the T = S x L rows are prompt ``t // L``'s token ``t % L``, ``seq_lens`` the
        prompts' lengths, and attention is :func:`jax_tq.prompt_attention` (exact over the
        prompt's own K / V, which it writes); else None.
      page_size: the page size the slots were computed for (static; the builders set it,
        :func:`attend_rows` refuses a cache of another), or None: not recorded.
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
    page_size: int | None = dataclasses.field(default=None, metadata=dict(static=True))


def attend_rows(q, k, v, cache: PagedKVCache, rows: CacheRows, *, sliding_window=None, soft_cap=None, sinks=None):
    """Write a layer's new K / V into its cache and attend to it, as ``rows`` say.

    Fresh prompts (``rows.prompt_len``): :func:`jax_tq.prompt_attention` (exact causal attention over
    each prompt's own K / V, which it writes). Otherwise :func:`jax_tq.write_cache` of the T tokens at
    ``rows.slots`` (and ``rows.window_slots``), then :func:`jax_tq.paged_decode` (one row per
    sequence) or :func:`jax_tq.paged_prefill` (``rows.query_start_loc``) over the written cache; with
    ``rows.view_start`` each row reads its own window view (:func:`row_windows`). The window parts of
    ``rows`` are ignored for a cache without a window (a model's uncompressed layers).

    Gradients flow to q always, and to k / v where the attention reads them as given: fresh prompts
    (``prompt_attention`` attends over the k / v passed in) and uncompressed pages. Compressed pages
    hold integer codes (a gradient reaches k / v through their norms only); the window's bfloat16 rows
    pass it on as Pi k / Pi v (:func:`jax_tq.write_cache`).

    Args:
      q: float ``[T, num_heads, head_dim]`` (float32, bfloat16 or float16).
      k, v: float ``[T, num_kv_heads, head_dim]``, the new tokens' keys and values.
      cache: the layer's :class:`jax_tq.PagedKVCache` (compressed or uncompressed pages).
      rows: :class:`CacheRows` of this forward.
      sliding_window, soft_cap, sinks: the attention variants (:mod:`jax_tq.variants`), passed to the op.
    Returns:
      ``(out [T, num_heads, head_dim] in q's dtype, the cache with the new tokens)``.
    Raises:
      TypeError: ``cache`` not a :class:`jax_tq.PagedKVCache` or ``rows`` not a :class:`CacheRows`.
      ValueError: q, k, v not 3-D, k and v of different shapes, T differing between q, k and
        ``rows.slots`` (prompts: ``T != S * prompt_len``), or rows built for another page size.
      TypeError / ValueError: what :func:`jax_tq.write_cache`, :func:`jax_tq.prompt_attention`,
        :func:`jax_tq.paged_decode` and :func:`jax_tq.paged_prefill` raise.
    """
    _check_rows(q, k, v, cache, rows)
    if not cache.window:
        rows = dataclasses.replace(rows, window_slots=None, window_ids=None, view_start=None, view_window_id=None)
    variants = dict(sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
    if rows.prompt_len is not None:
        shape = (rows.seq_lens.shape[0], rows.prompt_len)
        out, written = prompt_attention(q.reshape(shape + q.shape[1:]), k.reshape(shape + k.shape[1:]).astype(q.dtype),
                                        v.reshape(shape + v.shape[1:]).astype(q.dtype), cache, rows.block_tables,
                                        rows.seq_lens, window_ids=rows.window_ids, **variants)
        return out.reshape(q.shape), written
    written = write_tokens(cache, k, v, rows.slots, rows.window_slots, window_needs_slot=False)
    seen = written if rows.view_start is None else row_windows(written, cache, k, v, rows.view_start,
                                                               rows.view_window_id)
    if rows.query_start_loc is None:
        out = paged_decode(q, seen, rows.block_tables, rows.seq_lens, window_ids=rows.window_ids, **variants)
    else:
        out = paged_prefill(q, seen, rows.block_tables, rows.seq_lens, rows.query_start_loc,
                            window_ids=rows.window_ids, **variants)
    return out, written


def _check_rows(q, k, v, cache, rows: CacheRows) -> None:
    where = "attend_rows"
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"{where}: cache must be a jax_tq.PagedKVCache, got {type(cache).__name__}")
    if not isinstance(rows, CacheRows):
        raise TypeError(f"{where}: rows must be a jax_tq.CacheRows (prompt_rows / chunk_rows / decode_rows), got "
                        f"{type(rows).__name__}")
    if rows.page_size is not None and rows.page_size != cache.page_size:
        raise ValueError(f"{where}: rows were built for page_size {rows.page_size}, the cache's is {cache.page_size}")
    if q.ndim != 3 or k.ndim != 3 or k.shape != v.shape:
        raise ValueError(f"{where}: q must be [T, num_heads, head_dim] and k, v [T, num_kv_heads, head_dim], got "
                         f"shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if rows.prompt_len is not None:
        expected, what = rows.seq_lens.shape[0] * rows.prompt_len, "len(rows.seq_lens) * rows.prompt_len"
    else:
        expected, what = rows.slots.shape[0], "len(rows.slots)"
    if q.shape[0] != expected or k.shape[0] != expected:
        raise ValueError(f"{where}: q and k must have {what} = {expected} rows, got {q.shape[0]} and {k.shape[0]}")


def rows_cache(caches: Sequence[PagedKVCache]) -> PagedKVCache:
    """The layer cache whose settings make a model's :class:`CacheRows`: the first with a window
    (window slots, one-row views), else the first; :func:`attend_rows` ignores the window parts of
    the rows for layers without one."""
    return next((c for c in caches if c.window), caches[0])


def chunk_rows(cache: PagedKVCache, block_table, start: int, num_tokens: int, window_id=None) -> CacheRows:
    """The :class:`CacheRows` of positions ``start .. start + num_tokens - 1`` of one sequence.

    Args:
      cache: a layer's cache (its page size and window).
      block_table: int32 ``[max_pages]``, the sequence's pages.
      start: static int, the position of the chunk's first token (tokens before it are cached).
      num_tokens: static int >= 1.
      window_id: integer scalar, the sequence's window id: required for a cache with several windows
        (default: 0 where the cache has one window; ignored without a window). A traced id outside
        [0, num_windows) reads no window and writes none (as the ops do for such an id).
    Returns:
      rows for :func:`jax_tq.paged_prefill`: one sequence, or (with a window) one sequence per row over
      its own window view (``view_start``).
    Raises:
      TypeError: ``start`` or ``num_tokens`` not a Python int (they fix shapes and positions);
        ``window_id`` not an integer.
      ValueError: ``start < 0``, ``num_tokens < 1``, ``block_table`` not 1-D, the chunk running past
        the table's ``max_pages * page_size`` tokens (its rows' positions would shift), no
        ``window_id`` for a cache with several windows (another sequence's ring would be overwritten),
        a ``window_id`` that is not a scalar, or a concrete one outside [0, num_windows).
    """
    where = "chunk_rows"
    block_table = _listed_as_array(block_table)
    for name, value, least in (("start", start, 0), ("num_tokens", num_tokens, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{where}: {name} must be a Python int, got {type(value).__name__}")
        if value < least:
            raise ValueError(f"{where}: {name} must be >= {least}, got {value}")
    if jnp.ndim(block_table) != 1:
        raise ValueError(f"{where}: block_table must be [max_pages], got shape {tuple(jnp.shape(block_table))}")
    capacity = jnp.shape(block_table)[0] * cache.page_size
    if start + num_tokens > capacity:
        raise ValueError(f"{where}: positions {start}..{start + num_tokens - 1} run past the block table's "
                         f"{capacity} tokens (max_pages * page_size)")
    start, num_tokens = int(start), int(num_tokens)
    positions = start + jnp.arange(num_tokens, dtype=jnp.int32)
    slots = slot_mapping(block_table, positions, cache.page_size)
    if not cache.window:
        return CacheRows(slots, block_table[None], jnp.asarray([start + num_tokens], jnp.int32),
                         jnp.asarray([0, num_tokens], jnp.int32), page_size=cache.page_size)
    window_id = _chunk_window_id(window_id, cache, where)
    ids = jnp.full((num_tokens,), window_id, jnp.int32)
    ends = jnp.full((num_tokens,), start + num_tokens, jnp.int32)
    # Row t reads view window t (row_windows); a (traced) id outside the cache's windows reads none,
    # as the ops read none for such an id, instead of the ring its clamped index would give.
    known = (window_id >= 0) & (window_id < cache.num_windows)
    rows = jnp.where(known, jnp.arange(num_tokens, dtype=jnp.int32), num_tokens)
    return CacheRows(slots, jnp.broadcast_to(block_table, (num_tokens, block_table.shape[0])), positions + 1,
                     jnp.arange(num_tokens + 1, dtype=jnp.int32),
                     window_slot_mapping(ids, positions, ends, cache.window), rows, window_id,
                     start, page_size=cache.page_size)


def _chunk_window_id(window_id, cache: PagedKVCache, where: str):
    """chunk_rows' ``window_id`` as an int32 scalar: 0 where the cache has one window and none is
    given; TypeError for a non-integer, ValueError for another shape, a missing id where the cache
    has several windows, or a concrete id outside [0, num_windows)."""
    if window_id is None:
        if cache.num_windows > 1:
            raise ValueError(f"{where}: window_id is required: the cache has {cache.num_windows} windows (the "
                             "sequence's own ring; another sequence's would be overwritten)")
        return jnp.asarray(0, jnp.int32)
    if isinstance(window_id, (bool, np.bool_)) or not jnp.issubdtype(jnp.result_type(window_id), jnp.integer):
        raise TypeError(f"{where}: window_id must be an integer scalar, got {window_id!r}")
    if jnp.ndim(window_id) != 0:
        raise ValueError(f"{where}: window_id must be a scalar (the sequence's window id), got shape "
                         f"{tuple(jnp.shape(window_id))}")
    if not isinstance(window_id, jax.core.Tracer) and not 0 <= int(window_id) < cache.num_windows:
        raise ValueError(f"{where}: window_id={int(window_id)} is outside the cache's window ids "
                         f"[0, {cache.num_windows}) (the chunk would read another sequence's ring)")
    return jnp.asarray(window_id, jnp.int32)


def decode_rows(cache: PagedKVCache, block_tables, position, seq_lens, window_ids=None) -> CacheRows:
    """The :class:`CacheRows` of one new token per sequence.

    Args:
      cache: a layer's cache (its page size and window).
      block_tables: int32 ``[S, max_pages]``.
      position: int32 ``[S]``, each new token's position.
      seq_lens: int32 ``[S]``, tokens after the step (normally ``position + 1``); 0: an idle row,
        nothing written.
      window_ids: int32 ``[S]`` the sequences' window ids (caches with a window); default
        ``arange(S)``, row s's id s: an engine whose rows are not its sequences' fixed window slots
        (a subset, a new order, a sequence admitted later) passes each sequence's own id. Windows
        split over a mesh's data axis take shard-local ids (``cache_partition_specs(page_axis=...)``).
    Returns:
      rows for :func:`jax_tq.paged_decode`. A position the block table does not cover (past its
      pages, or an entry of -1: a page not yet allocated) is neither written to the pages nor read
      from them; with a window its token still enters the sequence's ring, which serves the
      sequence's last ``window`` positions.
    Raises:
      TypeError / ValueError: position or seq_lens not int32 ``[S]``.
      ValueError: window_ids not integer ``[S]``; window_ids=None with more rows than the cache's
        window ids (the default ids past them would write no window).
    """
    block_tables = _listed_as_array(block_tables)
    position = index_array(position, "position", "[num_seqs]", "decode_rows", ndim=1)
    seq_lens = index_array(seq_lens, "seq_lens", f"[num_seqs={position.shape[0]}] (position's length)", "decode_rows",
                           shape=position.shape)
    slots = jnp.where(seq_lens > 0, slot_mapping(block_tables, position, cache.page_size), -1)
    # checked mode: the arguments named here, before write_cache sees the slots made of them
    check_decode_indices(jnp.asarray(block_tables), seq_lens, num_pages=cache.num_pages, page_size=cache.page_size,
                         op="decode_rows")
    if not cache.window:
        return CacheRows(slots, block_tables, seq_lens, page_size=cache.page_size)
    ids = _window_ids(window_ids, position.shape[0], cache, "decode_rows", block_tables)
    check_window_ids(ids, seq_lens, num_windows=cache.num_windows, op="decode_rows", distinct=True)
    return CacheRows(slots, block_tables, seq_lens, window_slots=window_slot_mapping(ids, position, seq_lens,
                                                                                     cache.window), window_ids=ids,
                     page_size=cache.page_size)


def prompt_rows(cache: PagedKVCache, block_tables, prompt_lens, prompt_len: int, window_ids=None) -> CacheRows:
    """The :class:`CacheRows` of fresh prompts, each padded to ``prompt_len`` tokens.

    Args:
      cache: a layer's cache (its window).
      block_tables: int32 ``[S, max_pages]`` covering each prompt.
      prompt_lens: int32 ``[S]`` in ``[0, prompt_len]``.
      prompt_len: static int, the padded length L (the forward's T = S x L rows).
      window_ids: as :func:`decode_rows`'s (default ``arange(S)``).
    Returns:
      rows for :func:`jax_tq.prompt_attention`.
    Raises:
      TypeError: ``prompt_len`` not a Python int.
      ValueError: ``prompt_len < 1``; concrete ``prompt_lens`` outside ``[0, prompt_len]``; window_ids
        not integer ``[S]``, or None with more prompts than the cache's window ids.
    """
    if isinstance(prompt_len, bool) or not isinstance(prompt_len, (int, np.integer)):
        raise TypeError(f"prompt_rows: prompt_len must be a Python int, got {type(prompt_len).__name__}")
    if prompt_len < 1:
        raise ValueError(f"prompt_rows: prompt_len must be >= 1, got {prompt_len}")
    block_tables, prompt_lens = _listed_as_array(block_tables), _listed_as_array(prompt_lens)
    if not isinstance(prompt_lens, jax.core.Tracer):
        lens = np.asarray(prompt_lens)
        if lens.size and (lens.min() < 0 or lens.max() > prompt_len):
            raise ValueError(f"prompt_rows: prompt_lens must lie in [0, prompt_len={prompt_len}], got {lens.tolist()}")
    ids = _window_ids(window_ids, prompt_lens.shape[0], cache, "prompt_rows", block_tables) if cache.window else None
    unused = jnp.full((prompt_lens.shape[0] * prompt_len,), -1, jnp.int32)  # prompt_attention writes
    return CacheRows(unused, block_tables, prompt_lens, window_ids=ids, prompt_len=int(prompt_len),
                     page_size=cache.page_size)


def _listed_as_array(x):
    """A Python list or tuple as a numpy array, int32 where its ints fit (the callers check the rest)."""
    if not isinstance(x, (list, tuple)):
        return x
    a = np.asarray(x)
    fits = np.issubdtype(a.dtype, np.integer) and (a.size == 0 or (a.min() >= -INDEX_MAX - 1 and a.max() <= INDEX_MAX))
    return a.astype(np.int32) if fits else a


def _window_ids(window_ids, num_seqs: int, cache: PagedKVCache, where: str, block_tables):
    if window_ids is None:  # the default ids 0 .. num_seqs - 1, refused past the cache's window ids
        return window_ids_of(cache, None, num_seqs, where, block_tables)
    ids = jnp.asarray(window_ids)
    if ids.shape != (num_seqs,) or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"{where}: window_ids must be integer [num_seqs={num_seqs}], got {ids.dtype} "
                         f"{tuple(ids.shape)}")
    return ids.astype(jnp.int32)


def row_windows(cache: PagedKVCache, before: PagedKVCache, k, v, start: int, window_id) -> PagedKVCache:
    """A view of ``cache`` whose window id ``t`` holds what row ``t`` of one sequence's positions
    ``start .. start + T - 1`` reads exactly: the rotated rows of positions ``(p - window, p]``
    (p = start + t), for this call's tokens as :func:`jax_tq.write_cache` writes them (the same
    kernel, into a scratch window of T entries) and for earlier ones from the window ``window_id``
    of ``before`` (the cache as it was before this call's write).

    Args:
      cache: :class:`jax_tq.PagedKVCache` with a window, after the write of k, v (its pages are kept).
      before: the same cache before that write.
      k, v: float ``[T, num_kv_heads, head_dim]`` this call's keys and values.
      start: static position of k[0].  window_id: int32 scalar, the sequence's window id.
    Returns:
      the cache with k_window / v_window of ``[T, num_kv_heads, window, head_dim]`` (memory O(T x window)).
    """
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
    written = write_cache(scratch, k, v, slots, slots)
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
