"""Paged prefill of one sequence's many query rows as flash attention over its decoded tokens.

The compressed tokens a chunk attends to are decoded once (norm * centroid, in K's / V's rotated
space, the window's bfloat16 rows on its last tokens) into a bfloat16 [1, max_tokens, Hkv, d] span;
tensor-core flash attention (cuDNN on the GPU) then serves every query row and head from it. A
chunk after cached tokens is two attentions merged by their log-sum-exp
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
    """The paged prefill primitive's forward semantics (``paged_prefill._reference``) for one
    sequence by attention over its decoded span: out_rot [T, H, d], float32 (float64 for float64
    operands).

    Args:
      q_rot ... query_start_loc: the primitive's operands (sinks below; no sliding window or soft
        cap), with one sequence (block_tables [1, max_pages]).
      k_bits, v_bits, scale: its parameters.
      sinks: None, or float [H]: a per-head logit joining every row's softmax denominator only
        (attention sinks, as the reference's ``sinks``): one more term of the merge.
      attend: ``(q, k, v, q_lens, kv_lens, *, scale, causal) -> (out, lse)`` as
        :func:`jax_tq._compat.cudnn_attention_with_lse` (the default); the CPU tests pass XLA's
        exact attention (``tests/oracle.py``).
      dtype: the dtype of the queries and decoded tokens handed to ``attend``.
    Memory: the span (2 x max_pages x page_size x Hkv x d of ``dtype``), the rows that see tokens
    and their own K / V (T x (H + 2 Hkv) x d of ``dtype``), two attention outputs and the float32
    merge (~4 x T x H x d x 4 bytes).
    Raises:
      ValueError: several sequences (cuDNN's packed layout, which would serve them in one call, gave
        wrong rows past the first segment with GQA on the H200, jax 0.11.2).
    """
    if block_tables.shape[0] != 1:
        raise ValueError(f"dense_prefill_rotated: one sequence, got block_tables {block_tables.shape}")
    attend = _compat.cudnn_attention_with_lse if attend is None else attend
    num_rows = q_rot.shape[0]
    capacity = block_tables.shape[1] * k_codes.shape[2]
    keys, valid, k_finite = span_tokens(k_codes, k_norms, k_centroids, k_bits, block_tables, seq_lens, k_window,
                                        window_ids, dtype)
    values, _, v_finite = span_tokens(v_codes, v_norms, v_centroids, v_bits, block_tables, seq_lens, v_window,
                                      window_ids, dtype)
    group = q_rot.shape[1] // keys.shape[2]
    values = jnp.where(k_finite[..., None], values, 0)   # a skipped key's value adds nothing either
    rows = _rows(query_start_loc, seq_lens, num_rows, capacity)
    index = jnp.arange(num_rows, dtype=jnp.int32)        # row i of those that see tokens, position prefix + i
    sees = index < rows.seen
    queries = jnp.where(sees[:, None, None], q_rot[jnp.clip(rows.first + index, 0, num_rows - 1)], 0).astype(dtype)
    own = jnp.clip(rows.prefix + index, 0, jnp.maximum(rows.length - 1, 0))
    seen, prefix = rows.seen[None], rows.prefix[None]

    def prefix_attention(operands):
        return attend(*operands, seen, prefix, scale=scale, causal=False)

    def no_prefix(operands):  # a fresh prompt: part a is empty
        return tuple(jnp.zeros(a.shape, a.dtype) for a in jax.eval_shape(prefix_attention, operands))

    out_prefix, lse_prefix = jax.lax.cond(rows.prefix > 0, prefix_attention, no_prefix,
                                          (queries[None], keys, values))
    out_own, lse_own = attend(queries[None], keys[:, own], values[:, own], seen, seen, scale=scale, causal=True)
    # Per KV head. Zero keys (slots the kernel skips: an invalid page or window id, a non-finite K
    # norm) each add 1 to the softmax sums: the prefix's to all rows, the chunk's causally. A
    # non-finite V norm (of a key not skipped) makes NaN the rows that see its token, all of their
    # coordinates (the kernel's: those the infinity reaches), zeroed in the span so that no 0 x NaN
    # reaches the others.
    before_len = jnp.arange(capacity) < rows.length
    missing = (before_len[:, None] & ~(valid[0][:, None] & k_finite[0])).astype(jnp.int32)   # [cap, Hkv]
    poisoned = (valid[0][:, None] & k_finite[0] & ~v_finite[0]).astype(jnp.int32)   # a skipped key poisons nothing
    skipped_prefix, skipped_own = (_per_head(x, group) for x in _prefix_and_own(missing, rows.prefix, own, sees))
    nan_prefix, nan_own = (_per_head(x, group) for x in _prefix_and_own(poisoned, rows.prefix, own, sees))
    # Rounded to ``dtype`` here: the output rotation rounds its operand to it anyway (half the traffic
    # of the row gather below in bfloat16; the float32 result is the primitive's contract).
    merged = _merge(out_prefix[0], lse_prefix[0], rows.prefix > 0, skipped_prefix, out_own[0], lse_own[0],
                    skipped_own, sinks)
    merged = jnp.where(((nan_prefix > 0) | (nan_own > 0))[..., None], jnp.nan, merged).astype(dtype)
    _, _, owned = reference.prefill_row_lens(query_start_loc, seq_lens, num_rows, capacity)
    at = index - rows.first
    inside = owned & (at >= 0) & (at < rows.seen)
    out_rot = jnp.where(inside[:, None, None], merged[jnp.clip(at, 0, num_rows - 1)], 0.0)
    finite = jnp.all(jnp.isfinite(q_rot), axis=-1)
    out_rot = jnp.where((~finite & owned[:, None])[..., None], jnp.nan, out_rot)
    return out_rot.astype(jnp.promote_types(q_rot.dtype, jnp.float32))


class _Rows(NamedTuple):
    """The sequence's (int32 scalars): its first row that sees tokens (rows placed before its first
    token get 0), how many rows see tokens, its tokens before the chunk, its clamped length."""
    first: jax.Array
    seen: jax.Array
    prefix: jax.Array
    length: jax.Array


def _rows(query_start_loc, seq_lens, num_rows: int, capacity: int) -> _Rows:
    begin = jnp.clip(query_start_loc[0], 0, num_rows)
    end = jnp.clip(query_start_loc[1], begin, num_rows)
    length = jnp.clip(seq_lens[0], 0, min(capacity, tq_format.INDEX_MAX))
    before = jnp.maximum(end - begin - length, 0)
    seen = end - begin - before              # rows at positions prefix .. length - 1
    return _Rows(begin + before, seen, length - seen, length)


def _prefix_and_own(flags, prefix, own, sees):
    """Counts of flagged slots ([cap, Hkv] int32) each row sees: over the prefix ([Hkv], every row)
    and causally over the chunk ([T, Hkv])."""
    in_prefix = (jnp.arange(flags.shape[0]) < prefix)[:, None]
    return jnp.sum(flags * in_prefix, axis=0, keepdims=True), jnp.cumsum(flags[own] * sees[:, None], axis=0)


def _per_head(x, group: int):
    return jnp.repeat(x, group, axis=-1)


def _merge(out_a, lse_a, has_a, skipped_a, out_b, lse_b, skipped_b, sinks=None):
    """Softmax-weighted merge of two attentions over disjoint key sets ([T, H, d] outputs, [T, H]
    log-sum-exps; has_a: part a has keys), each sum less its ``skipped`` zero slots ([1, H] /
    [T, H]), plus exp(sinks [H]) in the denominator where given, in promote(lse dtype, float32)."""
    dtype = jnp.promote_types(lse_b.dtype, jnp.float32)
    lse_a, lse_b = lse_a.astype(dtype), lse_b.astype(dtype)
    lse_a = jnp.where(has_a, lse_a, -jnp.inf)
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
    numerator = (jnp.where(has_a, out_a.astype(dtype) * weight_a[..., None], 0.0)
                 + out_b.astype(dtype) * weight_b[..., None])
    return jnp.where(total[..., None] > 0, numerator / jnp.where(total > 0, total, 1.0)[..., None], 0.0)
