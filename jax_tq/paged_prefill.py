"""Paged prefill: causal attention of several sequences' new query rows over a TurboQuant-compressed
paged KV cache (the new tokens already written with :func:`jax_tq.write_cache`).

The queries are rotated once into K's rotated space, scored against the K centroids scaled by each
key's fp32 norm, and the softmax-weighted V centroids rotated back once (TurboQuant, arXiv
2504.19874, Algorithm 1, applied to attention), with a causal mask per query row. Each K / V token
is decoded once per (sequence, KV head, tile of query rows) instead of once per query row.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_tq import _compat, paged_prefill_dense, reference
from jax_tq import format as tq_format
from jax_tq import _primitive_utils as pu
from jax_tq.backend import get_backend
from jax_tq.cache import check_cache
from jax_tq.checks import as_array, check_decode_indices, check_query_start_loc, reject_checkify_residuals
from jax_tq.paged_decode import (POOLS, WINDOWS, _check_decode_args, _static_scale, allows_f16_products,
                                 fold_batched_pools, window_operands)
from jax_tq.partitioning import Layout
from jax_tq.variants import check_variants, as_keywords

__all__ = ["paged_prefill"]

paged_prefill_p = _compat.Primitive("jax_tq_paged_prefill")

_HIGHEST = jax.lax.Precision.HIGHEST


def paged_prefill(q, cache, block_tables, seq_lens, query_start_loc, *, window_ids=None, scale=None, precision=None,
                  sliding_window=None, soft_cap=None, sinks=None):
    """Causal attention of new query rows (a prompt, or a chunk of one) over a compressed paged cache.

    Args:
      q: [num_tokens, num_heads, head_dim] float32/bfloat16/float16, the new tokens of every
        sequence concatenated: sequence s owns rows [query_start_loc[s], query_start_loc[s + 1]).
        num_heads must be a multiple of ``cache.num_kv_heads`` (GQA).
      cache: :class:`jax_tq.PagedKVCache` holding every token of each sequence, the new ones
        included (write them first with :func:`jax_tq.write_cache`). An uncompressed one
        (``preset="none"``) is served by jnp code compiled by XLA
        (:func:`jax_tq.reference.paged_prefill_pages`, no jax_tq kernel, on every backend).
      block_tables: int32 [num_seqs, max_pages], as for :func:`jax_tq.paged_decode`.
      seq_lens: int32 [num_seqs], each sequence's tokens in the cache (new ones included), clamped
        to [0, max_pages * page_size].
      query_start_loc: int32 [num_seqs + 1], non-decreasing from 0 to num_tokens (vLLM's name;
        FlashInfer's qo_indptr, flash-attn's cu_seqlens_q). Row i of sequence s (of q_len_s rows)
        sits at position seq_lens[s] - q_len_s + i and attends to the sequence's tokens [0, that
        position]: chunked prefill (earlier tokens already cached) is the case q_len_s < seq_lens[s].
      window_ids: int32 [num_seqs], for a cache with a window (default ``arange(num_seqs)``, which
        needs num_seqs <= num_windows, numbered across the elements of a ``jax.vmap`` over sequences
        as :func:`jax_tq.cache.default_window_ids` says; None without one). Rows see the cache as it stands: the
        sequence's last min(seq_len, window) tokens from its window, the others from the pages (a
        row earlier than the window's first token sees only compressed tokens).
      scale: softmax scale, a finite Python number (static); default 1 / sqrt(head_dim).
      precision: as for :func:`jax_tq.paged_decode`: ``HIGHEST`` keeps the products float32-accurate;
        ``DEFAULT`` / ``HIGH`` let the CUDA kernel round q (scaled by a power of two), the softmax
        weights and the centroids to float16 in tensor-core products with float32 accumulation
        (head_dim 64 and 128; a relative error of ~2^-11 per term, below a bfloat16 query's own
        rounding). Default: ``HIGHEST`` for float32 queries, ``DEFAULT`` for bfloat16 / float16 ones.
        No effect on the CPU (float64) or the reference. On CUDA (Hopper or later), bfloat16 queries
        under ``DEFAULT`` / ``HIGH`` with at least DENSE_MIN_ROWS (128) rows per sequence
        (num_tokens >= 128 x num_seqs), head_dim 64 / 128 and neither sliding_window nor soft_cap
        run as cuDNN flash attention over the sequences' tokens decoded once into bfloat16 and
        rotated back to the model's space (each sequence a segment of cuDNN's packed layout; K, V
        and q rounded to bfloat16, ~2^-9 per term, as attention over a bfloat16 cache; transient
        memory: the span and its rotation, 2 x 2 x num_seqs x max_pages x page_size x num_kv_heads x
        head_dim x 2 bytes, the span at most 1 GiB, and ~4 bfloat16 copies of the output). There, a
        block-table entry outside the pool or a window id of none inside a sequence's length
        (``jax_tq.checked`` reports both) loses precision where every logit its rows see is far
        below 0, instead of being skipped exactly, and a non-finite V norm or window entry makes NaN
        every coordinate of the rows that see it (the kernel: the coordinates it reaches).
      sliding_window: None, or an int >= 1 (static): the row at position p sees only positions
        p - sliding_window + 1 .. p (the last sliding_window tokens, itself included; vLLM's /
        Mistral's convention; :mod:`jax_tq.variants`).
      soft_cap: None, or a finite number > 0 (static): logits l = scale * <q, k> become
        soft_cap * tanh(l / soft_cap) before masking and softmax (Gemma 2).
      sinks: None, or float32 [num_heads]: a per-head logit joining the softmax denominator only
        (gpt-oss's attention sinks; as :func:`jax_tq.paged_decode`). Differentiable.
        On the GPU the prefill kernels serve them (sinks alone: the cuDNN path above where it is
        chosen, the sinks one more term of its merge).

    Returns:
      [num_tokens, num_heads, head_dim] of q's dtype. Rows that no sequence owns are 0 whatever
      their query holds; rows placed before their sequence's start (q_len_s > seq_lens[s]) are 0;
      an owned row whose query holds a NaN or inf is NaN. Out-of-range values of query_start_loc are clamped to [0, num_tokens];
      if it decreases, which sequence a row belongs to is unspecified (``jax_tq.checked`` reports it).
      Differentiable in q, the cache's norms and sinks (reverse mode: a custom VJP through the reference,
      16 rows at a time with rematerialisation, :func:`jax_tq.reference.paged_prefill_rotated`; the
      ``xla`` backend's forward pass is that reference too).

    Raises:
      TypeError: q not float32/bfloat16/float16; an index array not int32; cache not a PagedKVCache.
      ValueError: wrong ranks or shapes, head_dim differs from the cache's codecs, num_heads not a
        positive multiple of num_kv_heads, query_start_loc not [num_seqs + 1], a bad scale; window_ids None
        with more sequences than the cache's num_windows, or given for a cache without a window.
      TypeError / ValueError: a bad sliding_window (not an int >= 1), soft_cap (not a finite
        number > 0) or sinks (not float [num_heads]), naming it.
      BackendUnavailableError: backend "ffi" where no kernel serves the call (when it is lowered).

    Source: TurboQuant (arXiv 2504.19874), Algorithm 1 applied to attention (scores
    <Pi_k q, c[idx]> * ||k||, output rotated back by Pi_v^T once); causal prefill over a paged cache
    as in vLLM / FlashInfer. Variants: sliding windows (Mistral 7B, arXiv 2310.06825), logit
    soft-capping (Gemma 2, arXiv 2408.00118), attention sinks (arXiv 2309.17453; gpt-oss).
    """
    check_cache(cache, "paged_prefill")
    q = as_array(q, "q", "paged_prefill")
    scale = _static_scale(scale, "jax_tq.paged_prefill")
    f16_products = allows_f16_products(precision, q.dtype, "jax_tq.paged_prefill")
    block_tables, seq_lens = _check_decode_args(q, cache, block_tables, seq_lens, None, op="jax_tq.paged_prefill",
                                                rows="num_tokens")
    query_start_loc = _check_query_start_loc(query_start_loc, seq_lens.shape[0])
    sliding_window, soft_cap, sinks = check_variants(sliding_window, soft_cap, sinks, q.shape[1], "paged_prefill")
    check_decode_indices(block_tables, seq_lens, num_pages=cache.num_pages, page_size=cache.page_size,
                         op="paged_prefill", sliding_window=sliding_window, row_starts=query_start_loc)
    check_query_start_loc(query_start_loc, seq_lens, num_rows=q.shape[0])
    windows = window_operands(cache, window_ids, block_tables, seq_lens, "paged_prefill")
    scale = 1.0 / math.sqrt(cache.head_dim) if scale is None else scale
    if not cache.compressed:
        out = reference.paged_prefill_pages(q, cache.k_pages, cache.v_pages, block_tables, seq_lens, query_start_loc,
                                            scale, **as_keywords(sliding_window, soft_cap, sinks))
        return out.astype(q.dtype)
    k_codec, v_codec = cache.k_codec, cache.v_codec
    backend = get_backend()
    dense = backend != "xla" and _dense_planned(q, cache, *block_tables.shape, f16_products, backend,
                                                bool(sliding_window or soft_cap))
    pools = (cache.k_codes, cache.k_norms, cache.v_codes, cache.v_norms, k_codec.centroids, v_codec.centroids,
             block_tables, seq_lens, *windows, query_start_loc, sinks)
    if dense:
        return _prefill_dense(q, k_codec.rotation, v_codec.rotation, *pools, k_codec.bits, v_codec.bits, scale,
                              f16_products, backend).astype(q.dtype)
    q_rot = _rotate(q, k_codec.rotation.T)
    variants = dict(sliding_window=sliding_window, soft_cap=soft_cap)
    if backend == "xla":
        out_rot = _reference(q_rot, *pools, k_bits=k_codec.bits, v_bits=v_codec.bits, scale=scale, **variants)[0]
    else:
        out_rot = _prefill(q_rot, *pools, k_codec.bits, v_codec.bits, scale, f16_products, backend, sliding_window,
                           soft_cap)
    return _rotate(out_rot, v_codec.rotation).astype(q.dtype)


def _rotate(x, matrix, bf16: bool = False):
    """x [T, H, d] @ matrix [d, d]: float32-accurate in float32, or (``bf16``: the dense plan, whose
    operands are bfloat16 anyway) bfloat16 in and out with float32 accumulation."""
    if bf16:
        return jnp.einsum("thd,de->the", x.astype(jnp.bfloat16), matrix.astype(jnp.bfloat16))
    return jnp.einsum("thd,de->the", x.astype(jnp.float32), matrix, precision=_HIGHEST)


#: Query rows per sequence from which a prefill on CUDA runs as cuDNN flash attention over the decoded
#: tokens (:mod:`jax_tq.paged_prefill_dense`) rather than the fused kernel, which decodes each K / V
#: tile once per 16 query tokens (H200, 32 / 8 heads, d128, K4V4: 128 rows after 8064 cached tokens
#: 168 us against the kernel's 371; 2048 after 6144: 629 against 1763).
DENSE_MIN_ROWS = 128
#: The most bytes of decoded bfloat16 K and V as cuDNN reads them (2 x num_seqs x max_pages x page_size x
#: KV heads x d x 2, the KV heads repeated per query head under a JAX whose packed call needs it) the
#: dense path may hold; past it, the kernel (which keeps memory O(rows)).
DENSE_MAX_SPAN_BYTES = 1 << 30


def _dense_planned(q, cache, num_seqs: int, max_pages: int, f16_products: bool, backend: str, variant: bool) -> bool:
    """Whether the prefill runs as attention over the decoded span (on CUDA; the kernel elsewhere):
    backend "auto", bfloat16 queries with float16-class products allowed (the span is bfloat16), at
    least DENSE_MIN_ROWS rows per sequence on average (the span decodes every sequence's tokens, so
    decode-like rows stay on the kernel), a span of 1 .. DENSE_MAX_SPAN_BYTES, a packing that fits
    (int32 element offsets, cuDNN's statistics: ``paged_prefill_dense.packing_fits``), head_dim 64 /
    128, no sliding window or soft cap (``variant``; sinks are served), and JAX's cuDNN attention with
    its packed layout (Hopper or later)."""
    if not (backend == "auto" and f16_products and jnp.dtype(q.dtype) == jnp.dtype(jnp.bfloat16) and num_seqs >= 1
            and q.shape[0] >= DENSE_MIN_ROWS * num_seqs and cache.head_dim in (64, 128) and not variant
            and _compat.has_cudnn_attention()):
        return False
    tokens = num_seqs * max_pages * cache.page_size
    handed = _compat.packed_kv_heads(q.shape[1], cache.num_kv_heads)   # KV heads as cuDNN reads them
    span_bytes = 2 * tokens * handed * cache.head_dim * 2
    return 0 < span_bytes <= DENSE_MAX_SPAN_BYTES and paged_prefill_dense.packing_fits(
        q.shape[0], q.shape[1], tokens, cache.num_kv_heads, cache.head_dim, num_seqs + 1)


def _check_query_start_loc(query_start_loc, num_seqs: int):
    spec = f"jax_tq.paged_prefill: query_start_loc must be int32 [num_seqs + 1 = {num_seqs + 1}]"
    tq_format.check_index_dtype(query_start_loc, spec)
    query_start_loc = jnp.asarray(query_start_loc)
    if query_start_loc.dtype != jnp.int32 or query_start_loc.shape != (num_seqs + 1,):
        error = TypeError if query_start_loc.dtype != jnp.int32 else ValueError
        raise error(f"{spec}, got {query_start_loc.dtype}{tuple(query_start_loc.shape)}")
    return query_start_loc


def _owned_rows(num_rows, max_tokens, lens, starts):
    """bool [num_rows, 1, 1]: the rows some sequence owns (the others are 0 whatever their query
    holds); max_tokens: a block table's tokens (max_pages * page_size)."""
    return reference.prefill_row_lens(starts, lens, num_rows, max_tokens)[2][:, None, None]


def _reference(q_rot, k_codes, k_norms, v_codes, v_norms, k_cent, v_cent, tables, lens, k_window, v_window,
               window_ids, starts, sinks, *, k_bits, v_bits, scale, f16_products=False, sliding_window=0, soft_cap=0.0):
    """The primitive's semantics in jnp: an owned row whose q_rot is not all finite gives a NaN row
    (and enters the reference as zeros, so that no NaN reaches its neighbours' gradients). sinks
    float32 [H] or [0] (none); sliding_window 0 and soft_cap 0.0: none."""
    finite = jnp.all(jnp.isfinite(q_rot), axis=-1, keepdims=True)
    out_rot = reference.paged_prefill_rotated(jnp.where(finite, q_rot, 0), k_codes, k_norms, v_codes, v_norms,
                                              k_cent, v_cent, tables, lens, starts, k_bits, v_bits, scale,
                                              window=(k_window, v_window, window_ids),
                                              **as_keywords(sliding_window, soft_cap, sinks))
    nan_rows = ~finite & _owned_rows(q_rot.shape[0], tables.shape[1] * k_codes.shape[2], lens, starts)
    return (jnp.where(nan_rows, jnp.nan, out_rot).astype(jnp.float32),)


_NUM_OPERANDS = 14  # q_rot, the four pools, two centroids, block_tables, seq_lens, two windows, ids, query_start_loc,
#                    sinks


def _bind(operands, sinks, k_bits, v_bits, scale, f16_products, backend, sliding_window=0, soft_cap=0.0):
    (out,) = pu.bind(paged_prefill_p, *operands, sinks, k_bits=k_bits, v_bits=v_bits, scale=scale,
                     f16_products=f16_products, backend=backend, sliding_window=sliding_window, soft_cap=soft_cap)
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=tuple(range(_NUM_OPERANDS, _NUM_OPERANDS + 7)))
def _prefill(q_rot, k_codes, k_norms, v_codes, v_norms, k_cent, v_cent, tables, lens, k_window, v_window, window_ids,
             starts, sinks, k_bits, v_bits, scale, f16_products, backend, sliding_window, soft_cap):
    """The kernel call, differentiable in q_rot, k_norms, v_norms, the window rows and sinks (the
    codes are integers)."""
    operands = (q_rot, k_codes, k_norms, v_codes, v_norms, k_cent, v_cent, tables, lens, k_window, v_window, window_ids,
                starts)
    return _bind(operands, sinks, k_bits, v_bits, scale, f16_products, backend, sliding_window, soft_cap)


def _prefill_fwd(*args):
    return _prefill(*args), args[:_NUM_OPERANDS]


def _prefill_bwd(k_bits, v_bits, scale, f16_products, backend, sliding_window, soft_cap, operands, cotangent):
    """Backward pass through the reference (the same gradient on every backend)."""
    attend = _reference_of(operands, k_bits, v_bits, scale, sliding_window, soft_cap)
    _, vjp = jax.vjp(attend, *_differentiable(operands))
    return _cotangents(vjp(cotangent.astype(jnp.float32)))


_prefill.defvjp(_prefill_fwd, _prefill_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=tuple(range(_NUM_OPERANDS + 2, _NUM_OPERANDS + 7)))
def _prefill_dense(q, k_rotation, v_rotation, k_codes, k_norms, v_codes, v_norms, k_cent, v_cent, tables, lens,
                   k_window, v_window, window_ids, starts, sinks, k_bits, v_bits, scale, f16_products, backend):
    """The dense plan: on CUDA attention over the decoded span in the model's space (no query rotated),
    elsewhere the kernel between bfloat16 rotations; bfloat16 [T, H, d] either way, differentiable in
    q, k_norms, v_norms, the window rows and sinks (through the reference)."""
    operands = (k_codes, k_norms, v_codes, v_norms, k_cent, v_cent, tables, lens, k_window, v_window, window_ids,
                starts)

    def kernel(q, k_rotation, v_rotation, *operands):
        q_rot = _rotate(q, k_rotation.T, True).astype(jnp.float32)   # the kernel's q_rot operand is float32
        out_rot = _bind((q_rot, *operands), sinks, k_bits, v_bits, scale, f16_products, backend)
        return _rotate(out_rot, v_rotation, True)

    def over_span(q, k_rotation, v_rotation, *operands):
        return paged_prefill_dense.dense_prefill(q, *operands, k_bits=k_bits, v_bits=v_bits, scale=scale,
                                                 k_rotation=k_rotation, v_rotation=v_rotation,
                                                 sinks=sinks if sinks.size else None)

    return jax.lax.platform_dependent(q, k_rotation, v_rotation, *operands, cuda=over_span, default=kernel)


def _prefill_dense_fwd(*args):
    return _prefill_dense(*args), args[:_NUM_OPERANDS + 2]


def _prefill_dense_bwd(k_bits, v_bits, scale, f16_products, backend, residuals, cotangent):
    """Backward pass through the reference between float32 rotations (the kernel path's gradient)."""
    q, k_rotation, v_rotation, *operands = residuals
    reference_of = _reference_of((q, *operands), k_bits, v_bits, scale, 0, 0.0)

    def attend(q, *differentiable):
        return _rotate(reference_of(_rotate(q, k_rotation.T), *differentiable), v_rotation)

    _, vjp = jax.vjp(attend, q, *_differentiable((q, *operands))[1:])
    dq, *rest = vjp(cotangent.astype(jnp.float32))
    return (dq.astype(q.dtype), None, None) + _cotangents((None, *rest))[1:]


_prefill_dense.defvjp(_prefill_dense_fwd, _prefill_dense_bwd)


def _differentiable(operands):
    """(q_rot, k_norms, v_norms, k_window, v_window, sinks) of the primitive's operands."""
    return operands[0], operands[2], operands[4], operands[9], operands[10], operands[13]


def _reference_of(operands, k_bits, v_bits, scale, sliding_window, soft_cap):
    """The reference as a function of the differentiable operands (q_rot, k_norms, v_norms, k_window,
    v_window, sinks)."""
    (_, k_codes, _, v_codes, _, k_cent, v_cent, tables, lens, _, _, ids, starts, _) = operands
    reject_checkify_residuals("paged_prefill", k_codes=(k_codes, jnp.uint8), v_codes=(v_codes, jnp.uint8),
                              block_tables=(tables, jnp.int32), seq_lens=(lens, jnp.int32),
                              window_ids=(ids, jnp.int32), query_start_loc=(starts, jnp.int32))

    def attend(q_rot, k_norms, v_norms, k_window, v_window, sinks):
        return _reference(q_rot, k_codes, k_norms, v_codes, v_norms, k_cent, v_cent, tables, lens, k_window,
                          v_window, ids, starts, sinks, k_bits=k_bits, v_bits=v_bits, scale=scale,
                          sliding_window=sliding_window, soft_cap=soft_cap)[0]
    return attend


def _cotangents(grads):
    """The primitive's operands' cotangents from those of (q_rot, k_norms, v_norms, k_window,
    v_window, sinks)."""
    dq, dk_norms, dv_norms, dk_window, dv_window, dsinks = grads
    return (dq, None, dk_norms, None, dv_norms, None, None, None, None, dk_window, dv_window, None, None, dsinks)


def _abstract(q_rot, *operands, **params):
    return (_compat.output_aval(q_rot.shape, jnp.float32, q_rot, *operands),)


def _ffi(ctx, *operands, k_bits, v_bits, scale, f16_products, sliding_window, soft_cap):
    return _compat.ffi_lowering("jax_tq_paged_prefill")(ctx, *operands, k_bits=np.int32(k_bits),
                                                         v_bits=np.int32(v_bits), scale=np.float32(scale),
                                                         f16_products=np.bool_(f16_products),
                                                         sliding_window=np.int32(sliding_window),
                                                         soft_cap=np.float32(soft_cap))


def _batch(args, dims, **params):
    """Fold vmapped axes into the token and sequence axes: element b's rows follow element b - 1's
    and its sequences are followed by one empty sequence (no tokens) that owns its rows after its last
    boundary, so that no row changes owner (rows of no sequence stay 0). A batched cache is folded into
    one page pool, each element's block tables offset into its own slice."""
    q, k_codes, k_norms, v_codes, v_norms, k_cent, v_cent, tables, lens, k_window, v_window, ids, starts, sinks = args
    pu.require_unbatched(("k centroids", "v centroids"), dims[5:7], "paged_prefill")
    pu.require_unbatched_sinks(dims[13], "paged_prefill")
    size = pu.batch_size(args, dims)
    pools, tables = fold_batched_pools(args[1:5], dims[1:5], tables, dims[7], size, lambda p: p.shape[1])
    windows, ids = fold_batched_pools(args[9:11], dims[9:11], ids, dims[11], size, lambda w: w.shape[1])
    q = pu.move_batch_to_front(q, dims[0], size)
    lens = pu.move_batch_to_front(lens, dims[8], size)
    starts = pu.move_batch_to_front(starts, dims[12], size)
    num_tokens, max_pages = q.shape[1], tables.shape[-1]
    owned = jax.vmap(lambda lens, starts: _owned_rows(num_tokens, max_pages * pools[0].shape[2], lens, starts))(
        lens, starts)
    q = jnp.where(owned, q, 0)  # rows of no sequence stay 0 once a gap sequence owns them
    # Each element's boundaries clamped to its own rows before the offset (the kernel clamps to all rows).
    starts = jnp.clip(starts, 0, num_tokens) + (jnp.arange(size, dtype=jnp.int32) * num_tokens)[:, None]
    folded_starts = jnp.concatenate([starts.reshape(-1), jnp.asarray([size * num_tokens], jnp.int32)])
    folded_tables = jnp.concatenate([tables, jnp.zeros((size, 1, max_pages), jnp.int32)], axis=1)
    folded_lens = jnp.concatenate([lens, jnp.zeros((size, 1), jnp.int32)], axis=1)
    folded_ids = jnp.concatenate([ids, jnp.full((size, 1), -1, jnp.int32)], axis=1)
    (out,) = paged_prefill_p.bind(q.reshape((-1,) + q.shape[2:]), *pools, k_cent, v_cent,
                                  folded_tables.reshape(-1, max_pages), folded_lens.reshape(-1), *windows,
                                  folded_ids.reshape(-1), folded_starts, sinks, **params)
    return [out.reshape((size, num_tokens) + out.shape[1:])], [0]


# Dim roles for partitioning (jax_tq/partitioning.py): KV heads only; the token rows and sequences
# stay whole (query_start_loc addresses all rows).
_LAYOUT = Layout(operands=(("tok", "head", None),) + POOLS + ((None,), (None,), ("seq", None), ("seq",)) + WINDOWS
                 + (("seq",), (None,), ("head",)), results=(("tok", "head", None),), whole=frozenset({"seq", "tok"}))
pu.define_op(paged_prefill_p, abstract=_abstract, reference=_reference, ffi=_ffi, batch=_batch,
             may_be_empty=(7, 8, 9, 10, 11, 12, 13), layout=_LAYOUT)  # no sequences / window / sinks
