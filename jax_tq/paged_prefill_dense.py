"""Paged prefill of many query rows as flash attention over the sequences' decoded tokens.

The compressed tokens the rows attend to are decoded once into a bfloat16 [S, max_tokens, Hkv, d]
span in the model's space: the pages by ``jax_tq.decompress``'s primitive (on the GPU its kernel,
norm x (c[codes] @ Pi) per token, skipped slots given norm 0), the window's rows rotated back and
scattered over each sequence's last tokens. Tensor-core flash attention (cuDNN on the GPU) then
serves every query row and head from it, each sequence a segment of cuDNN's packed layout over the
rows where they already sit and the keys where they sit in the span (nothing gathered). A chunk
after cached tokens is two attentions merged by their log-sum-exp (FlashAttention's split-KV merge,
arXiv 2307.08691 section 3.1.1): the rows over the cached prefix (no mask) and over the chunk's own
tokens (causal, square, so the diagonal's alignment does not matter). The merge runs in place over
the chunk's output (:mod:`jax_tq.merge_attention`): rows with no prefix and nothing to correct are
not touched, and the queries are read only where the statistics do not show them finite.

Key slots the kernel would skip (a block-table entry outside the pool, a window id of none, a
non-finite K norm) enter as zero keys and values: each adds exactly exp(0) = 1 to its rows' softmax
sum and nothing to their numerator, and that 1 is subtracted again from the statistics. Where a row
sees such a slot and every logit it sees is far below 0 (below ~-15: the 1 dominates the float32
sum), the subtraction cancels and the row loses precision; the kernel has no such limit.

:func:`jax_tq.paged_prefill` chooses this path (one place: ``paged_prefill._dense_planned``); the
functions here take the primitive's operands.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_tq import _compat, reference
from jax_tq import _primitive_utils as pu
from jax_tq import format as tq_format
from jax_tq.compress import decompress_p
from jax_tq.merge_attention import merge_attention

__all__ = ["span_tokens", "dense_prefill"]


def span_tokens(codes, norms, centroids, rotation, bits: int, block_tables, seq_lens, window_rows, window_ids, dtype,
                zeroed=None):
    """Each sequence's tokens in position order, decoded by ``jax_tq.decompress``'s primitive (on the GPU
    its kernel: norm x (c[codes] @ Pi) per token, one pass that writes the span).

    Args:
      codes: uint8 [num_pages, Hkv, page_size, d * bits / 8]; norms float32 [num_pages, Hkv, page_size];
        centroids float32 [2**bits]; rotation float32 [d, d] (Pi: the tokens come out in the model's
        space) or None (K's / V's rotated space); bits 2, 3 or 4.
      block_tables: int32 [S, max_pages].  seq_lens: int32 [S] (clamped to [0, max_pages * page_size]).
      window_rows: bfloat16 [num_windows, Hkv, W, d] in the rotated space (num_windows * W == 0: no
        window), position p of a sequence in entry p % W of its ring; window_ids int32 [S].
      dtype: the result's dtype.
      zeroed: None or bool [S, max_pages * page_size, Hkv]: slots whose token is zero as well (V's
        where K's is skipped).
    Returns:
      (tokens [S, max_pages * page_size, Hkv, d] of ``dtype``, zero where not valid, not finite or
       ``zeroed``;
       valid bool [S, max_pages * page_size]: a position < seq_len whose page id is in the pool, or
       whose window id is one;
       finite bool [S, max_pages * page_size, Hkv]: its norm (a window row: every entry) is finite).
    """
    num_pages, num_kv_heads, page_size, row_bytes = codes.shape
    num_seqs, max_pages = block_tables.shape
    capacity = max_pages * page_size
    head_dim = row_bytes * 8 // bits
    page_ok = (block_tables >= 0) & (block_tables < num_pages)
    safe = jnp.where(page_ok, block_tables, 0)
    slot_norms = jnp.transpose(norms[safe], (0, 1, 3, 2)).reshape(num_seqs, capacity, num_kv_heads)
    valid = jnp.repeat(page_ok, page_size, axis=1)
    finite = jnp.isfinite(slot_norms)
    lengths = jnp.clip(seq_lens, 0, min(capacity, tq_format.INDEX_MAX))
    window = _window_tokens(window_rows, window_ids, seq_lens, lengths, capacity) if window_rows.size else None
    if window is not None:   # the ring's positions: [paged_tokens, length) of each sequence
        valid = valid.at[window.seq, window.position].set(window.id_ok, mode="drop")
        finite = finite.at[window.seq, window.position].set(window.finite, mode="drop")
    valid = valid & (jnp.arange(capacity)[None, :] < lengths[:, None])
    keep = valid[..., None] & finite
    if zeroed is not None:
        keep = keep & ~zeroed
    compute = jnp.promote_types(dtype, jnp.float32)   # the kernel's operands: float32
    matrix = jnp.eye(head_dim, dtype=compute) if rotation is None else rotation.astype(compute)
    row_codes = jnp.transpose(codes[safe], (0, 1, 3, 2, 4)).reshape(-1, row_bytes)
    row_norms = jnp.where(keep, slot_norms, 0).astype(compute).reshape(-1)
    (tokens,) = pu.bind(decompress_p, row_codes, row_norms, matrix, centroids.astype(compute), bits=bits,
                        dtype=jnp.dtype(dtype), backend="auto")
    tokens = tokens.reshape(num_seqs, capacity, num_kv_heads, head_dim)
    if window is not None:
        rows = window.rows if rotation is None else jnp.einsum(
            "swhd,de->swhe", window.rows.astype(compute), matrix, precision=jax.lax.Precision.HIGHEST)
        kept = jnp.take_along_axis(keep, jnp.clip(window.position, 0, capacity - 1)[..., None], axis=1)
        tokens = tokens.at[window.seq, window.position].set(jnp.where(kept[..., None], rows, 0).astype(dtype),
                                                           mode="drop")
    return tokens, valid, finite


class _WindowTokens(NamedTuple):
    """The window's tokens of each sequence, W per sequence ([S, W] index pairs into the span; a
    position past the sequence's end is ``capacity``, which a scatter with mode "drop" skips):
    their rows [S, W, Hkv, d] (the ring's dtype), whether the window id is one [S, W], whether every
    entry of a row is finite [S, W, Hkv]."""
    seq: jax.Array
    position: jax.Array
    rows: jax.Array
    id_ok: jax.Array
    finite: jax.Array


def _window_tokens(window_rows, window_ids, seq_lens, lengths, capacity: int) -> _WindowTokens:
    """lengths: seq_lens clamped as span_tokens clamps them."""
    num_windows, _, length, _ = window_rows.shape
    num_seqs = seq_lens.shape[0]
    position = tq_format.paged_tokens(seq_lens, capacity, length)[:, None] + jnp.arange(length, dtype=jnp.int32)
    position = jnp.where(position < lengths[:, None], position, capacity)                  # [S, W]
    id_ok = (window_ids >= 0) & (window_ids < num_windows)
    ring = window_rows[jnp.where(id_ok, window_ids, 0)]                                     # [S, Hkv, W, d]
    rows = jnp.take_along_axis(ring, (position % length)[:, None, :, None], axis=2)
    rows = jnp.transpose(rows, (0, 2, 1, 3))                                                # [S, W, Hkv, d]
    seq = jnp.broadcast_to(jnp.arange(num_seqs, dtype=jnp.int32)[:, None], position.shape)
    return _WindowTokens(seq, position, rows, jnp.broadcast_to(id_ok[:, None], position.shape),
                         jnp.all(jnp.isfinite(rows), axis=-1))


def dense_prefill(q, k_codes, k_norms, v_codes, v_norms, k_centroids, v_centroids, block_tables, seq_lens, k_window,
                  v_window, window_ids, query_start_loc, *, k_bits: int, v_bits: int, scale: float, k_rotation=None,
                  v_rotation=None, sinks=None, attend=None, dtype=jnp.bfloat16):
    """The paged prefill primitive's forward semantics (``paged_prefill._reference``) by attention
    over the decoded span: out [T, H, d] of ``dtype``.

    Args:
      q ... query_start_loc: the primitive's operands (sinks below; no sliding window or soft cap),
        q [T, H, d] in the space of ``k_rotation``.
      k_bits, v_bits, scale: its parameters.
      k_rotation, v_rotation: None, or float [d, d]: the codecs' rotations Pi. With them q and the
        result are in the model's space (the decoded K / V rotated back, k = k_rot @ Pi_k, instead
        of every query row rotated in and out: num_kv_heads x tokens rows instead of num_heads x
        rows); None: q is K's rotated space and the result V's (the primitive's q_rot / out_rot).
      sinks: None, or float [H]: a per-head logit joining every row's softmax denominator only
        (attention sinks, as the reference's ``sinks``): one more term of the merge.
      attend: ``(q, k, v, q_lens, kv_lens, *, scale, causal, q_offsets, kv_offsets) -> (out, lse)``
        over segments, as :func:`jax_tq._compat.cudnn_attention_with_lse` (the default); the CPU
        tests pass XLA's exact attention (``tests/oracle.py``).
      dtype: the dtype of the queries and decoded tokens handed to ``attend``, and of the result.
    Memory: the span (2 x S x max_pages x page_size x Hkv x d of ``dtype``) and the pages' codes
    gathered into it, two attention outputs (T x H x d of ``dtype`` each). A
    decreasing query_start_loc (``jax_tq.checked`` reports it) is read as its running maximum.
    """
    attend = _compat.cudnn_attention_with_lse if attend is None else attend
    num_rows = q.shape[0]
    num_seqs, max_pages = block_tables.shape
    capacity = max_pages * k_codes.shape[2]
    keys, valid, k_finite = span_tokens(k_codes, k_norms, k_centroids, k_rotation, k_bits, block_tables, seq_lens,
                                        k_window, window_ids, dtype)
    values, _, v_finite = span_tokens(v_codes, v_norms, v_centroids, v_rotation, v_bits, block_tables, seq_lens,
                                      v_window, window_ids, dtype, zeroed=~k_finite)  # a skipped key's value adds nothing
    group = q.shape[1] // keys.shape[2]
    seg = _segments(query_start_loc, seq_lens, num_rows, capacity)
    row = _row_places(seg, num_rows)
    queries = q.astype(dtype)
    active = seg.seen > 0
    flat = (num_seqs * capacity,) + keys.shape[2:]
    keys, values = keys.reshape(flat), values.reshape(flat)
    span_starts = jnp.arange(num_seqs, dtype=jnp.int32) * capacity
    # Each sequence's chunk: causal over its own tokens, which sit in the span after its prefix.
    own_call = _packed_call(attend, scale, seg.first, seg.seen, span_starts + seg.prefix, seg.seen, active)
    out_own, lse_own = own_call(queries, keys, values, causal=True)
    # The cached prefixes: unmasked, every sequence's tokens before its chunk. Run whether or not any
    # sequence has one (a lax.cond would read its predicate on the host, one round trip per call).
    has_prefix = active & (seg.prefix > 0)
    prefix_call = _packed_call(attend, scale, seg.first, seg.seen, span_starts, seg.prefix, has_prefix)
    out_prefix, lse_prefix = prefix_call(queries, keys, values, causal=False)
    # Per KV head. Zero keys (slots the kernel skips: an invalid page or window id, a non-finite K
    # norm) each add 1 to the softmax sums: the prefix's to all its rows, the chunk's causally. A
    # non-finite V norm (of a key not skipped) makes NaN the rows that see its token, all of their
    # coordinates (the kernel's: those the infinity reaches), zeroed in the span so that no 0 x NaN
    # reaches the others.
    before_len = jnp.arange(capacity)[None, :] < seg.lengths[:, None]
    missing = before_len[..., None] & ~(valid[..., None] & k_finite)   # [S, cap, Hkv]
    poisoned = valid[..., None] & k_finite & ~v_finite   # a skipped key poisons nothing
    # Both counts in one pass ([S, cap, 2 Hkv]: one set of small kernels instead of two).
    flags = jnp.concatenate([missing, poisoned], axis=-1).astype(jnp.int32)
    prefix_counts, own_counts = (_per_head(x, group) for x in _prefix_and_own(flags, seg, row))
    skipped_prefix, nan_prefix = _split_heads(prefix_counts, q.shape[1])
    skipped_own, nan_own = _split_heads(own_counts, q.shape[1])
    part_a = (lse_prefix, row.inside & has_prefix[row.seq], skipped_prefix)
    weights = _merge_weights(part_a, lse_own, skipped_own, sinks)                               # [T, H, 2]
    weights = jnp.where(((nan_prefix > 0) | (nan_own > 0))[..., None], jnp.nan, weights)
    weights = jnp.where(row.inside[:, None, None], weights, 0.0)
    # An owned row whose query is not all finite is NaN. A row that sees tokens has a non-finite
    # lse_own then (its scores are NaN or infinite: checked for cuDNN on the GPU), so the query is
    # read only where lse_own is not finite, and for rows that see none.
    owned = reference.prefill_row_lens(query_start_loc, seq_lens, num_rows, capacity)[2]
    check = owned[:, None] & (~row.inside[:, None] | ~jnp.isfinite(lse_own))                  # [T, H]
    weights = weights.astype(jnp.promote_types(dtype, jnp.float32))   # float32 but for a float64 oracle
    return merge_attention(out_own.astype(dtype), out_prefix.astype(dtype), weights, queries, check)


class _Segments(NamedTuple):
    """Per sequence (int32 [S]): its first row that sees tokens (rows placed before its first token
    get 0), how many rows see tokens, its tokens before the chunk, its clamped length."""
    first: jax.Array
    seen: jax.Array
    prefix: jax.Array
    lengths: jax.Array


def _segments(query_start_loc, seq_lens, num_rows: int, capacity: int) -> _Segments:
    begin = jax.lax.cummax(jnp.clip(query_start_loc[:-1], 0, num_rows))
    end = jnp.clip(query_start_loc[1:], begin, num_rows)
    lengths = jnp.clip(seq_lens, 0, min(capacity, tq_format.INDEX_MAX))
    before = jnp.maximum(end - begin - lengths, 0)
    seen = end - begin - before              # rows at positions prefix .. length - 1
    return _Segments(begin + before, seen, lengths - seen, lengths)


class _RowPlaces(NamedTuple):
    """Per query row (int32 / bool [T]): its sequence, whether it sees tokens, and its own token's
    position (clamped into the span where it sees none)."""
    seq: jax.Array
    inside: jax.Array
    own: jax.Array


def _row_places(seg: _Segments, num_rows: int) -> _RowPlaces:
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(seg.first + seg.seen, rows, side="right"), 0, seg.first.shape[0] - 1)
    index = rows - seg.first[seq]
    inside = (index >= 0) & (index < seg.seen[seq])
    own = jnp.clip(seg.prefix[seq] + index, 0, jnp.maximum(seg.lengths[seq] - 1, 0))
    return _RowPlaces(seq.astype(jnp.int32), inside, own)


def _packed_call(attend, scale, q_offsets, q_lens, kv_offsets, kv_lens, active):
    """``attend`` over the rows (q [T, H, d], k / v [N, Hkv, d], as batch element 0), sequence s the
    segment of rows q_offsets[s] .. + q_lens[s] and keys kv_offsets[s] .. + kv_lens[s] where
    ``active`` (the others -1, which JAX's cuDNN call drops). One more segment, row 0 over key 0, is
    present when no sequence is, so that cuDNN always has one (its row is no active segment's: the
    caller ignores it); it also makes at least two entries, as JAX reads one as no packing. Returns
    (out [T, H, d], lse [T, H])."""
    spare = ~jnp.any(active)

    def pick(x, spare_value, end):
        x = jnp.concatenate([jnp.where(active, x, -1), jnp.where(spare, spare_value, -1)[None]]).astype(jnp.int32)
        return jnp.pad(x, (0, end), constant_values=-1)[None]

    def call(q, k, v, *, causal):
        attention = _batched_by_packing(functools.partial(attend, scale=scale, causal=causal))
        out, lse = attention(q[None], k[None], v[None], pick(q_lens, 1, 0), pick(kv_lens, 1, 0), pick(q_offsets, 0, 1),
                             pick(kv_offsets, 0, 1))
        return out[0], lse[0]
    return call


def _batched_by_packing(attend):
    """``attend`` of one batch element of segments (q [1, T, ...], k / v [1, S, ...], lens [1, M],
    offsets [1, M + 1]) whose vmap packs every mapped element into one call: element b's rows after
    b x T, its keys after b x S, its segments after b x M (JAX's cuDNN call has no batching rule for
    segments)."""
    @jax.custom_batching.custom_vmap
    def attention(q, k, v, q_lens, kv_lens, q_offsets, kv_offsets):
        return attend(q, k, v, q_lens, kv_lens, q_offsets=q_offsets, kv_offsets=kv_offsets)

    @attention.def_vmap
    def fold(size, batched, *args):
        q, k, v, q_lens, kv_lens, q_offsets, kv_offsets = (
            x if b else jnp.broadcast_to(x, (size,) + x.shape) for x, b in zip(args, batched))
        rows, keys = q.shape[2], k.shape[2]
        if not packing_fits(size * rows, q.shape[3], size * keys, k.shape[3], q.shape[4], size * q_lens.shape[2]):
            out, lse = jax.lax.map(lambda a: attention(*a), (q, k, v, q_lens, kv_lens, q_offsets, kv_offsets))
            return (out, lse), (True, True)

        def shifted(offsets, stride):   # [size, 1, M + 1] -> [1, size x M + 1]
            starts = offsets[:, 0, :-1]
            starts = jnp.where(starts >= 0, starts + (jnp.arange(size, dtype=jnp.int32) * stride)[:, None], -1)
            return jnp.concatenate([starts.reshape(1, -1), jnp.full((1, 1), -1, jnp.int32)], axis=1)

        def packed(x, length):
            return x.reshape((1, size * length) + x.shape[3:])

        out, lse = attention(packed(q, rows), packed(k, keys), packed(v, keys), q_lens.reshape(1, -1),
                             kv_lens.reshape(1, -1), shifted(q_offsets, rows), shifted(kv_offsets, keys))
        unpacked = (out.reshape((size, 1, rows) + out.shape[2:]), lse.reshape((size, 1, rows) + lse.shape[2:]))
        return unpacked, (True, True)
    return attention


#: The most bytes of cuDNN's softmax statistics (segments x heads x rows float32) one packed call holds.
MAX_STATS_BYTES = 1 << 30


def packing_fits(rows: int, num_heads: int, keys: int, num_kv_heads: int, head_dim: int, segments: int) -> bool:
    """Whether one packed call of ``rows`` query rows and ``keys`` keys in ``segments`` segments keeps
    JAX's int32 element offsets in range (the keys as handed to cuDNN: :func:`_compat.packed_kv_heads`)
    and cuDNN's statistics ([segments, num_heads, rows] float32) within MAX_STATS_BYTES."""
    kv_heads = _compat.packed_kv_heads(num_heads, num_kv_heads)
    return (rows * num_heads * head_dim < 2**31 and keys * kv_heads * head_dim < 2**31
            and segments * num_heads * rows * 4 <= MAX_STATS_BYTES)


def _prefix_and_own(flags, seg: _Segments, row: _RowPlaces):
    """Counts of flagged slots ([S, cap, F] int32, F flags per slot) each row sees: over its
    sequence's prefix ([T, F]) and causally over its chunk ([T, F])."""
    in_prefix = (jnp.arange(flags.shape[1])[None, :] < seg.prefix[:, None])[..., None]
    prefix = jnp.sum(flags * in_prefix, axis=1)[row.seq]
    own = flags[row.seq, row.own] * row.inside[:, None]
    running = jnp.cumsum(own, axis=0)
    first = jnp.clip(seg.first[row.seq], 0, own.shape[0] - 1)
    before_segment = running[first] - own[first]
    return prefix * row.inside[:, None], jnp.where(row.inside[:, None], running - before_segment, 0)


def _per_head(x, group: int):
    return jnp.repeat(x, group, axis=-1)


def _split_heads(x, num_heads: int):
    """[..., 2 num_heads] -> the two [..., num_heads] halves."""
    return x[..., :num_heads], x[..., num_heads:]


def _merge_weights(part_a, lse_b, skipped_b, sinks=None):
    """[T, H, 2] in promote(lse dtype, float32): the shares of part b's output and part a's in the
    softmax-weighted merge of two attentions over disjoint key sets (0 where the joint sum is not
    positive). part_a is (lse [T, H], has [T]: whether part a has keys for the row, skipped
    [T, H]), part b its lse; each sum less its ``skipped`` zero slots, plus exp(sinks [H]) in the
    denominator where given."""
    dtype = jnp.promote_types(lse_b.dtype, jnp.float32)
    lse_a, has_a, skipped_a = part_a
    lse_a = jnp.where(has_a[:, None], lse_a.astype(dtype), -jnp.inf)
    lse_b = lse_b.astype(dtype)
    top = jnp.maximum(lse_a, lse_b)
    if sinks is not None:
        sinks = sinks.astype(dtype)[None, :]
        top = jnp.maximum(top, sinks)
    top = jnp.where(jnp.isfinite(top), top, 0.0)

    def less_skipped(weight, skipped):
        skipped = skipped.astype(dtype)
        return weight - jnp.where(skipped > 0, skipped * jnp.exp(-top), 0.0)

    weight_a, weight_b = jnp.exp(lse_a - top), jnp.exp(lse_b - top)
    total = less_skipped(weight_a, skipped_a) + less_skipped(weight_b, skipped_b)
    if sinks is not None:
        total = total + jnp.exp(sinks - top)
    share = lambda weight: jnp.where(total > 0, weight / jnp.where(total > 0, total, 1.0), 0.0)  # noqa: E731
    return jnp.stack([share(weight_b), jnp.where(has_a[:, None], share(weight_a), 0.0)], axis=-1)
