"""Paged prefill of many query rows as flash attention over the sequences' decoded tokens.

The compressed tokens a chunk attends to are decoded once (norm * centroid, in K's / V's rotated
space, the window's bfloat16 rows on its last tokens) into a bfloat16 [S, max_tokens, Hkv, d] span;
tensor-core flash attention (cuDNN on the GPU) then serves every query row and head from it, the
rows that see tokens packed sequence after sequence (several sequences: segments of cuDNN's packed
layout). A chunk after cached tokens is two attentions merged by their log-sum-exp
(FlashAttention's split-KV merge, arXiv 2307.08691 section 3.1.1): the rows over the cached prefix
(no mask) and over the chunk's own tokens (causal, square, so the diagonal's alignment does not
matter).

Key slots the kernel would skip (a block-table entry outside the pool, a window id of none, a
non-finite K norm) enter as zero keys and values: each adds exactly exp(0) = 1 to its rows' softmax
sum and nothing to their numerator, and that 1 is subtracted again from the statistics. Where a row
sees such a slot and every logit it sees is far below 0 (below ~-15: the 1 dominates the float32
sum), the subtraction cancels and the row loses precision; the kernel has no such limit.

:func:`jax_tq.paged_prefill` chooses this path (one place: ``paged_prefill._dense_planned``); the
functions here take the primitive's operands.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_tq import _compat, reference
from jax_tq import format as tq_format

__all__ = ["span_tokens", "dense_prefill_rotated"]


def span_tokens(codes, norms, centroids, bits: int, block_tables, seq_lens, window_rows, window_ids, dtype):
    """Each sequence's tokens in position order, decoded in the rotated space.

    Args:
      codes: uint8 [num_pages, Hkv, page_size, d * bits / 8]; norms float32 [num_pages, Hkv, page_size];
        centroids float32 [2**bits]; bits 2, 3 or 4.
      block_tables: int32 [S, max_pages].  seq_lens: int32 [S] (clamped to [0, max_pages * page_size]).
      window_rows: bfloat16 [num_windows, Hkv, W, d] (num_windows * W == 0: no window), position p of a
        sequence in entry p % W of its ring; window_ids int32 [S].
      dtype: the result's dtype.
    Returns:
      (tokens [S, max_pages * page_size, Hkv, d] of ``dtype``, zero where not valid or not finite;
       valid bool [S, max_pages * page_size]: a position < seq_len whose page id is in the pool, or
       whose window id is one;
       finite bool [S, max_pages * page_size, Hkv]: its norm (a window row: every entry) is finite).
    """
    num_pages, num_kv_heads, page_size, _ = codes.shape
    num_seqs, max_pages = block_tables.shape
    capacity = max_pages * page_size
    page_ok = (block_tables >= 0) & (block_tables < num_pages)
    safe = jnp.where(page_ok, block_tables, 0)
    decoded = reference._dequantize_rotated_impl(codes[safe], norms[safe], centroids, bits=bits)
    head_dim = decoded.shape[-1]
    tokens = jnp.transpose(decoded, (0, 1, 3, 2, 4)).reshape(num_seqs, capacity, num_kv_heads, head_dim)
    valid = jnp.repeat(page_ok, page_size, axis=1)
    finite = jnp.isfinite(jnp.transpose(norms[safe], (0, 1, 3, 2)).reshape(num_seqs, capacity, num_kv_heads))
    positions = jnp.arange(capacity, dtype=jnp.int32)[None, :]
    lengths = jnp.clip(seq_lens, 0, min(capacity, tq_format.INDEX_MAX))
    num_windows, _, length, _ = window_rows.shape
    if num_windows * length:
        from_window = (positions >= tq_format.paged_tokens(seq_lens, capacity, length)[:, None]) & (
            positions < lengths[:, None])
        id_ok = (window_ids >= 0) & (window_ids < num_windows)
        ring = window_rows[jnp.where(id_ok, window_ids, 0)]                       # [S, Hkv, W, d]
        rows = jnp.transpose(jnp.take(ring, positions[0] % length, axis=2), (0, 2, 1, 3))
        tokens = jnp.where(from_window[..., None, None], rows.astype(tokens.dtype), tokens)
        valid = jnp.where(from_window, id_ok[:, None], valid)
        finite = jnp.where(from_window[..., None], jnp.all(jnp.isfinite(rows), axis=-1), finite)
    valid = valid & (positions < lengths[:, None])
    keep = valid[..., None] & finite
    return jnp.where(keep[..., None], tokens, 0).astype(dtype), valid, finite


def dense_prefill_rotated(q_rot, k_codes, k_norms, v_codes, v_norms, k_centroids, v_centroids, block_tables,
                          seq_lens, k_window, v_window, window_ids, query_start_loc, *, k_bits: int, v_bits: int,
                          scale: float, sinks=None, attend=None, dtype=jnp.bfloat16):
    """The paged prefill primitive's forward semantics (``paged_prefill._reference``) by attention
    over the decoded span: out_rot [T, H, d], float32 (float64 for float64 operands).

    The rows that see tokens are packed, sequence after sequence, into one [1, T, H, d] batch; with
    several sequences each is a segment of cuDNN's packed layout (``q_offsets`` / ``kv_offsets``).

    Args:
      q_rot ... query_start_loc: the primitive's operands (sinks below; no sliding window or soft cap).
      k_bits, v_bits, scale: its parameters.
      sinks: None, or float [H]: a per-head logit joining every row's softmax denominator only
        (attention sinks, as the reference's ``sinks``): one more term of the merge.
      attend: ``(q, k, v, q_lens, kv_lens, *, scale, causal, q_offsets=None, kv_offsets=None) ->
        (out, lse)`` as :func:`jax_tq._compat.cudnn_attention_with_lse` (the default); the CPU tests
        pass XLA's exact attention (``tests/oracle.py``).
      dtype: the dtype of the queries and decoded tokens handed to ``attend``.
    Memory: the span (2 x S x max_pages x page_size x Hkv x d of ``dtype``), the packed queries and
    the chunk's own K / V (T x (H + 2 Hkv) x d of ``dtype``), two attention outputs and the float32
    merge (~4 x T x H x d x 4 bytes). Rows of ranges that overlap (a decreasing query_start_loc,
    which ``jax_tq.checked`` reports) past T packed rows come out NaN.
    """
    attend = _compat.cudnn_attention_with_lse if attend is None else attend
    num_rows = q_rot.shape[0]
    num_seqs, max_pages = block_tables.shape
    capacity = max_pages * k_codes.shape[2]
    keys, valid, k_finite = span_tokens(k_codes, k_norms, k_centroids, k_bits, block_tables, seq_lens, k_window,
                                        window_ids, dtype)
    values, _, v_finite = span_tokens(v_codes, v_norms, v_centroids, v_bits, block_tables, seq_lens, v_window,
                                      window_ids, dtype)
    group = q_rot.shape[1] // keys.shape[2]
    values = jnp.where(k_finite[..., None], values, 0)   # a skipped key's value adds nothing either
    seg = _segments(query_start_loc, seq_lens, num_rows, capacity)
    packed = _packed_rows(seg, num_rows)
    queries = jnp.where(packed.inside[:, None, None], q_rot[packed.source], 0).astype(dtype)
    # Key segments start at multiples of the GQA group (the packed layout's contract, _compat).
    align = group if num_seqs > 1 else 1
    own_offsets, own_seq, own_token = _own_key_layout(seg, num_rows + num_seqs * (align - 1), align)
    own_keys = keys[own_seq, own_token]                           # [T', Hkv, d]: the chunks' own tokens
    own_values = values[own_seq, own_token]
    own_call = _attend_call(attend, scale, num_seqs, seg.offsets, seg.seen, own_offsets, seg.seen, seg.seen > 0)
    out_own, lse_own = own_call(queries, own_keys, own_values, causal=True)
    stride = -(-capacity // align) * align
    prefix_call = _attend_call(attend, scale, num_seqs, seg.offsets, seg.seen,
                               jnp.arange(num_seqs, dtype=jnp.int32) * stride, seg.prefix,
                               (seg.seen > 0) & (seg.prefix > 0))
    padding = ((0, 0), (0, stride - capacity), (0, 0), (0, 0))
    flat_keys = jnp.pad(keys, padding).reshape(num_seqs * stride, *keys.shape[2:])
    flat_values = jnp.pad(values, padding).reshape(flat_keys.shape)

    def prefix_attention(operands):
        return prefix_call(*operands, causal=False)

    def no_prefix(operands):  # no sequence has cached tokens (a fresh prompt): part a is empty
        return tuple(jnp.zeros(a.shape, a.dtype) for a in jax.eval_shape(prefix_attention, operands))

    out_prefix, lse_prefix = jax.lax.cond(jnp.any((seg.prefix > 0) & (seg.seen > 0)), prefix_attention, no_prefix,
                                          (queries, flat_keys, flat_values))
    # Per KV head. Zero keys (slots the kernel skips: an invalid page or window id, a non-finite K
    # norm) each add 1 to the softmax sums: the prefix's to all its rows, the chunk's causally. A
    # non-finite V norm makes NaN the rows that see its token (zeroed in the span, so that no 0 x NaN
    # reaches the others).
    before_len = jnp.arange(capacity)[None, :] < seg.lengths[:, None]
    missing = (before_len[..., None] & ~(valid[..., None] & k_finite)).astype(jnp.int32)   # [S, cap, Hkv]
    poisoned = (valid[..., None] & ~v_finite).astype(jnp.int32)
    skipped_prefix, skipped_own = (_per_head(x, group) for x in _prefix_and_own(missing, seg, packed))
    nan_prefix, nan_own = (_per_head(x, group) for x in _prefix_and_own(poisoned, seg, packed))
    has_prefix = packed.inside & (seg.prefix[packed.seq] > 0)
    # Rounded to ``dtype`` here: the output rotation rounds its operand to it anyway (half the traffic
    # of the row gather below in bfloat16; the float32 result is the primitive's contract).
    merged = _merge(out_prefix, lse_prefix, has_prefix, skipped_prefix, out_own, lse_own, skipped_own, sinks)
    merged = jnp.where(((nan_prefix > 0) | (nan_own > 0))[..., None], jnp.nan, merged).astype(dtype)
    row_seq, _, owned = reference.prefill_row_lens(query_start_loc, seq_lens, num_rows, capacity)
    index = jnp.arange(num_rows, dtype=jnp.int32) - seg.begin[row_seq] - seg.before[row_seq]
    inside = owned & (index >= 0) & (index < seg.seen[row_seq])
    slot = seg.offsets[row_seq] + index
    out_rot = jnp.where(inside[:, None, None], merged[jnp.clip(slot, 0, num_rows - 1)], 0.0)
    out_rot = jnp.where((inside & (slot >= num_rows))[:, None, None], jnp.nan, out_rot)
    finite = jnp.all(jnp.isfinite(q_rot), axis=-1)
    out_rot = jnp.where((~finite & owned[:, None])[..., None], jnp.nan, out_rot)
    return out_rot.astype(jnp.promote_types(q_rot.dtype, jnp.float32))


class _Segments(NamedTuple):
    """Per sequence (int32 [S]): its first row, its rows placed before its first token (they get 0),
    the rows that see tokens, its tokens before the chunk, its clamped length, and its first row in
    the packed layout."""
    begin: jax.Array
    before: jax.Array
    seen: jax.Array
    prefix: jax.Array
    lengths: jax.Array
    offsets: jax.Array


def _segments(query_start_loc, seq_lens, num_rows: int, capacity: int) -> _Segments:
    begin = jnp.clip(query_start_loc[:-1], 0, num_rows)
    end = jnp.clip(query_start_loc[1:], begin, num_rows)
    lengths = jnp.clip(seq_lens, 0, min(capacity, tq_format.INDEX_MAX))
    q_lens = end - begin
    before = jnp.maximum(q_lens - lengths, 0)
    seen = q_lens - before                   # rows at positions prefix .. length - 1
    offsets = jnp.cumsum(seen) - seen
    return _Segments(begin, before, seen, lengths - seen, lengths, offsets.astype(jnp.int32))


class _Packed(NamedTuple):
    """Per packed row (int32 / bool [T]): its sequence, whether it holds a row, the query row it holds,
    its index among its sequence's rows, and its own token's position."""
    seq: jax.Array
    inside: jax.Array
    source: jax.Array
    index: jax.Array
    own: jax.Array


def _packed_rows(seg: _Segments, num_rows: int) -> _Packed:
    slots = jnp.arange(num_rows, dtype=jnp.int32)
    ends = seg.offsets + seg.seen
    seq = jnp.clip(jnp.searchsorted(ends, slots, side="right"), 0, ends.shape[0] - 1).astype(jnp.int32)
    index = slots - seg.offsets[seq]
    inside = (index >= 0) & (index < seg.seen[seq])
    source = jnp.clip(seg.begin[seq] + seg.before[seq] + index, 0, num_rows - 1)
    capacity_last = jnp.maximum(seg.lengths[seq] - 1, 0)
    own = jnp.clip(seg.prefix[seq] + index, 0, capacity_last)
    return _Packed(seq, inside, source, index, own)


def _own_key_layout(seg: _Segments, length: int, align: int):
    """The chunks' own keys laid out sequence after sequence, each starting at a multiple of
    ``align``: (offsets int32 [S], and per key slot [length] its sequence and token position)."""
    rounded = -(-seg.seen // align) * align
    offsets = (jnp.cumsum(rounded) - rounded).astype(jnp.int32)
    slots = jnp.arange(length, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(offsets + rounded, slots, side="right"), 0, offsets.shape[0] - 1)
    index = jnp.clip(slots - offsets[seq], 0, jnp.maximum(seg.seen[seq] - 1, 0))
    token = jnp.clip(seg.prefix[seq] + index, 0, jnp.maximum(seg.lengths[seq] - 1, 0))
    return offsets, seq.astype(jnp.int32), token


def _attend_call(attend, scale, num_seqs, q_offsets, q_lens, kv_offsets, kv_lens, active):
    """``attend`` over the packed rows (q [T, H, d], k / v [N, Hkv, d], as batch element 0): one
    sequence with padding lengths; several as segments of cuDNN's packed layout (inactive ones -1,
    which JAX's cuDNN call drops). Returns (out [T, H, d], lse [T, H])."""
    def call(q, k, v, *, causal):
        lens = jnp.where(active, q_lens, 0), jnp.where(active, kv_lens, 0)     # [1]: batch element 0's
        packing = {}
        if num_seqs > 1:
            def pick(x):
                return jnp.where(active, x, -1).astype(jnp.int32)[None]          # [1, S]
            end = jnp.full((1, 1), -1, jnp.int32)
            lens = pick(q_lens), pick(kv_lens)
            packing = dict(q_offsets=jnp.concatenate([pick(q_offsets), end], axis=1),
                           kv_offsets=jnp.concatenate([pick(kv_offsets), end], axis=1))
        out, lse = attend(q[None], k[None], v[None], *lens, scale=scale, causal=causal, **packing)
        return out[0], lse[0]
    return call


def _prefix_and_own(flags, seg: _Segments, packed: _Packed):
    """Counts of flagged slots ([S, cap, Hkv] int32) each packed row sees: over its sequence's
    prefix ([T, Hkv]) and causally over its chunk ([T, Hkv])."""
    capacity = flags.shape[1]
    in_prefix = (jnp.arange(capacity)[None, :] < seg.prefix[:, None])[..., None]
    prefix = jnp.sum(flags * in_prefix, axis=1)[packed.seq]
    own = flags[packed.seq, packed.own] * packed.inside[:, None]
    running = jnp.cumsum(own, axis=0)
    first = jnp.clip(seg.offsets[packed.seq], 0, own.shape[0] - 1)
    before_segment = running[first] - own[first]
    return prefix * packed.inside[:, None], jnp.where(packed.inside[:, None], running - before_segment, 0)


def _per_head(x, group: int):
    return jnp.repeat(x, group, axis=-1)


def _merge(out_a, lse_a, has_a, skipped_a, out_b, lse_b, skipped_b, sinks=None):
    """Softmax-weighted merge of two attentions over disjoint key sets ([T, H, d] outputs, [T, H]
    log-sum-exps; has_a [T]: part a has keys for the row), each sum less its ``skipped`` zero slots
    ([T, H]), plus exp(sinks [H]) in the denominator where given, in promote(lse dtype, float32)."""
    dtype = jnp.promote_types(lse_b.dtype, jnp.float32)
    lse_a, lse_b = lse_a.astype(dtype), lse_b.astype(dtype)
    lse_a = jnp.where(has_a[:, None], lse_a, -jnp.inf)
    top = jnp.maximum(lse_a, lse_b)
    if sinks is not None:
        sinks = sinks.astype(dtype)[None, :]
        top = jnp.maximum(top, sinks)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weight_a = jnp.exp(lse_a - top)
    weight_b = jnp.exp(lse_b - top)

    def less_skipped(weight, skipped):
        skipped = skipped.astype(dtype)
        return weight - jnp.where(skipped > 0, skipped * jnp.exp(-top), 0.0)

    total = less_skipped(weight_a, skipped_a) + less_skipped(weight_b, skipped_b)
    if sinks is not None:
        total = total + jnp.exp(sinks - top)
    numerator = (jnp.where(has_a[:, None, None], out_a.astype(dtype) * weight_a[..., None], 0.0)
                 + out_b.astype(dtype) * weight_b[..., None])
    return jnp.where(total[..., None] > 0, numerator / jnp.where(total > 0, total, 1.0)[..., None], 0.0)
