"""Serving entry points composed of the public ops (no primitive of their own): one mixed step of
decode and (chunked) prefill rows in the ragged layout of vLLM / tpu-inference
(:func:`ragged_paged_attention`), and fresh prompts attending exactly over their own K / V while
they are written into the cache (:func:`prompt_attention`).

Both write the new K / V with :func:`jax_tq.write_cache` (slots from :func:`jax_tq.slot_mapping`)
and return ``(out, cache)``; jit them with the cache donated so that the write is in place::

    step = jax.jit(tq.ragged_paged_attention, donate_argnums=3)
    out, cache = step(q, k, v, cache, kv_lens, block_tables, cu_q_lens)
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jax_tq import format as tq_format
from jax_tq.cache import PagedKVCache, check_cache, slot_mapping, window_ids_of, write_tokens
from jax_tq.checks import (as_array, check_at_most, check_decode_indices, check_query_start_loc, check_window_ids,
                            index_array, unchecked)
from jax_tq.compress import check_float_input
from jax_tq.paged_decode import _static_scale, allows_f16_products, paged_decode
from jax_tq.paged_prefill import paged_prefill
from jax_tq.reference import _attend_tokens
from jax_tq.variants import check_variants, as_keywords

__all__ = ["prompt_attention", "ragged_paged_attention"]


def ragged_paged_attention(q, k, v, cache: PagedKVCache, kv_lens, block_tables, cu_q_lens, *, scale=None,
                           window_ids=None, precision=None, sliding_window=None, soft_cap=None, sinks=None):
    """One serving step over a paged cache: write each sequence's new tokens, then attend causally.

    The ragged layout of vLLM's and tpu-inference's ``ragged_paged_attention``: this step's new
    tokens of every sequence concatenated, decode rows (one new token) and prefill rows (a prompt,
    or a chunk of one after cached tokens) in any mix, padding rows at the end.

    Sequence s owns rows ``cu_q_lens[s]:cu_q_lens[s + 1]`` (q_len_s rows); they are its tokens at
    positions ``kv_lens[s] - q_len_s .. kv_lens[s] - 1``. The call writes their K / V into the
    cache (:func:`jax_tq.write_cache` at the slots :func:`jax_tq.slot_mapping` gives those positions
    through ``block_tables``; with a window, also into window ``window_ids[s]``), then row i of the
    sequence attends to the sequence's tokens ``0 .. its own position`` as the cache holds them
    after the write: every token read back compressed (and, with a window, the sequence's last
    ``window`` tokens exactly), the row's own token included.

    Sequences with q_len 1 (decode) are attended by :func:`jax_tq.paged_decode`, at the speed of a
    decode step; those with q_len >= 2 (prefill, chunked prefill) by :func:`jax_tq.paged_prefill`,
    last row included. Both ops run at every call (their shapes are static: a sequence the other op
    serves is passed with length 0 and its rows are dropped), so a step also pays paged_prefill's
    fixed cost (the rotation of every row's query and one kernel call) when no sequence prefills:
    call :func:`jax_tq.paged_decode` yourself for a batch known to be decode only.

    Args:
      q: [num_tokens, num_heads, head_dim] float32 / bfloat16 / float16, the new tokens' queries
        (after RoPE); num_heads a multiple of ``cache.num_kv_heads`` (GQA: query head h reads KV
        head h // (num_heads // num_kv_heads)).
      k, v: [num_tokens, num_kv_heads, head_dim] float32 / bfloat16 / float16 (any of them, each its
        own), the new tokens' keys (after RoPE) and values.
      cache: :class:`jax_tq.PagedKVCache` (compressed, with or without a window, or uncompressed:
        ``preset="none"``). Donate it (``donate_argnums=3``) for an in-place update.
      kv_lens: int32 [num_seqs], each sequence's tokens after this step (cached + new).
      block_tables: int32 [num_seqs, max_pages], logical page j of sequence s is physical page
        block_tables[s, j] (as :func:`jax_tq.paged_decode`).
      cu_q_lens: int32 [num_seqs + 1], non-decreasing from 0 to at most num_tokens (vLLM's
        query_start_loc); rows from ``cu_q_lens[-1]`` on are padding.
      scale: softmax scale, a finite Python number (static); default 1 / sqrt(head_dim).
      window_ids: int32 [num_seqs], each sequence's window id, for a cache with a window (default
        ``arange(num_seqs)``); must be None for a cache without one.
      precision: the products' precision, as for :func:`jax_tq.paged_decode` and
        :func:`jax_tq.paged_prefill` (default: float16 tensor-core products for bfloat16 / float16
        queries on the GPU, float32-accurate ones for float32 queries).
      sliding_window: None, or an int >= 1 (static): the row at position p sees positions
        p - sliding_window + 1 .. p only (vLLM's / Mistral's / tpu-inference's convention).
      soft_cap: None, or a finite number > 0 (static): logits l become soft_cap * tanh(l / soft_cap)
        (Gemma 2; tpu-inference's ``soft_cap``).
      sinks: None, or float32 [num_heads]: per-head logits joining the softmax denominator only
        (gpt-oss's attention sinks). The three as :func:`jax_tq.paged_decode` (:mod:`jax_tq.variants`),
        served by the CPU and CUDA kernels of paged_decode / paged_prefill.

    Returns:
      ``(out, cache)``: out [num_tokens, num_heads, head_dim] of q's dtype, and the cache after the
      write. Rows that write nothing output 0, whatever their query holds: padding rows (no
      sequence owns them; also rows before ``cu_q_lens[0]``), rows at a negative position
      (q_len_s > kv_lens[s]: its first q_len_s - kv_lens[s] rows), and every row of a sequence
      whose kv_lens lies outside [0, max_pages * page_size] (the table cannot hold it: nothing of
      it is written). Where
      cu_q_lens decreases its values are raised to their running maximum (the sequence gets no
      rows), values outside [0, num_tokens] are clamped. A block-table entry outside the pool is
      neither written nor read (as in the ops); with a window a live token still enters its ring,
      which serves the sequence's last ``window`` positions whatever its table says
      (``jax_tq.checked`` reports the entry). Sequences whose tables share a page must not write
      the same slot (which token stays is unspecified, as in write_cache). Any other row whose
      query is not finite is NaN. ``jax_tq.checked`` reports kv_lens outside [0, capacity], a used block-table
      entry outside the pool, cu_q_lens not rising from 0 to at most num_tokens, q_len_s >
      kv_lens[s], and a window id outside [0, num_windows) of a sequence with tokens (naming these
      arguments); the ops' own checks are left out, since their arguments are derived ones.

    Raises:
      TypeError: q, k or v not float32 / bfloat16 / float16; kv_lens, block_tables, cu_q_lens or
        window_ids not int32; cache not a PagedKVCache; scale not a concrete Python number.
      ValueError: wrong ranks or shapes (naming the argument), head_dim or num_kv_heads of k / v
        other than the cache's, num_heads not a positive multiple of num_kv_heads, a bad scale or precision,
        window_ids given for a cache without a window; window_ids=None with more sequences than
        the cache has window ids.
      TypeError / ValueError: a bad sliding_window, soft_cap or sinks, naming it.
      BackendUnavailableError: backend "ffi" where no kernel serves the call (when it is lowered).

    Example::

        step = jax.jit(tq.ragged_paged_attention, donate_argnums=3)
        # sequence 0 decodes its 41st token, sequence 1 prefills 7 tokens after 16 cached ones
        out, cache = step(q, k, v, cache, jnp.asarray([41, 23], jnp.int32), block_tables,
                          jnp.asarray([0, 1, 8], jnp.int32))

    Source: the ragged paged attention interface of vLLM (``query_start_loc``, ``seq_lens``,
    ``slot_mapping``) and tpu-inference's ``ragged_paged_attention`` (``cu_q_lens``, ``kv_lens``,
    ``page_indices``); PagedAttention (Kwon et al., arXiv 2309.06180); over TurboQuant caches
    (arXiv 2504.19874) through :func:`jax_tq.write_cache`, :func:`jax_tq.paged_decode` and
    :func:`jax_tq.paged_prefill`.
    """
    op = "ragged_paged_attention"
    check_cache(cache, op)
    q, k, v = _check_new_tokens(q, k, v, cache, op, "num_tokens")
    num_tokens = q.shape[0]
    kv_lens = index_array(kv_lens, "kv_lens", "[num_seqs]", op, ndim=1)
    num_seqs = kv_lens.shape[0]
    block_tables = index_array(block_tables, "block_tables", f"[num_seqs={num_seqs} (kv_lens' length), max_pages]",
                               op, ndim=2, leading=num_seqs)
    cu_q_lens = index_array(cu_q_lens, "cu_q_lens", f"[num_seqs + 1 = {num_seqs + 1}] (kv_lens' length + 1)", op,
                            shape=(num_seqs + 1,))
    scale = _static_scale(scale, f"jax_tq.{op}")
    allows_f16_products(precision, q.dtype, f"jax_tq.{op}")  # a bad precision named as this op's
    sliding_window, soft_cap, sinks = check_variants(sliding_window, soft_cap, sinks, q.shape[1], op)
    variants = as_keywords(sliding_window, soft_cap, sinks)  # checked: the ops take them as they are
    window_ids = window_ids_of(cache, window_ids, num_seqs, op, block_tables)
    check_decode_indices(block_tables, kv_lens, num_pages=cache.num_pages, page_size=cache.page_size, op=op,
                         lens_name="kv_lens", sliding_window=sliding_window, row_starts=cu_q_lens)
    check_query_start_loc(cu_q_lens, kv_lens, num_rows=num_tokens, op=op, starts_name="cu_q_lens",
                          lens_name="kv_lens", padding=True, hint="kv_lens counts the new tokens too")
    if window_ids is not None:
        check_window_ids(window_ids, kv_lens, num_windows=cache.num_windows, op=op, distinct=True)

    if num_seqs == 0 or num_tokens == 0:  # nothing to write or attend to
        return jnp.zeros_like(q), cache

    capacity = min(block_tables.shape[1] * cache.page_size, tq_format.INDEX_MAX)  # kv_lens are int32
    starts = jax.lax.cummax(jnp.clip(cu_q_lens, 0, num_tokens))  # monotone: paged_prefill's rows own the same rows
    q_lens = starts[1:] - starts[:-1]
    served = (kv_lens >= 0) & (kv_lens <= capacity)
    lens = jnp.where(served, kv_lens, 0)
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(starts[1:], rows, side="right").astype(jnp.int32)  # the first s whose rows end after t
    owned = (seq < num_seqs) & (rows >= starts[0])
    seq = jnp.minimum(seq, num_seqs - 1)
    positions = lens[seq] - q_lens[seq] + rows - starts[seq]
    # Rows of no sequence or at a negative position (every row of a sequence not served: lens 0) write
    # nothing and output 0.
    live = owned & (positions >= 0)
    slots = slot_mapping(block_tables, jnp.where(live, positions, -1), cache.page_size, seq)
    window_slots = None
    if cache.window:  # a live token enters its ring even where its page is missing (the ring is read whatever)
        window_slots = jnp.where(live, tq_format.window_slot_mapping(window_ids[seq], positions, lens[seq],
                                                                     cache.window), -1)
    decoding = q_lens == 1
    q_decode = jnp.where(decoding[:, None, None], q[jnp.maximum(starts[1:] - 1, 0)], 0)
    with unchecked():  # the arguments are checked above; the ops' checks would name (or refuse) derived ones
        cache = write_tokens(cache, k, v, slots, window_slots, window_needs_slot=False)
        out_prefill = paged_prefill(q, cache, block_tables, jnp.where(q_lens >= 2, lens, 0), starts,
                                    window_ids=window_ids, scale=scale, precision=precision, **variants)
        out_decode = paged_decode(q_decode, cache, block_tables, jnp.where(decoding, lens, 0),
                                  window_ids=window_ids, scale=scale, precision=precision, **variants)
    out = jnp.where(decoding[seq][:, None, None], out_decode[seq], out_prefill)
    return jnp.where(live[:, None, None], out, 0).astype(q.dtype), cache


def prompt_attention(q, k, v, cache: PagedKVCache, block_tables, prompt_lens=None, *, scale=None, window_ids=None,
                     implementation=None, sliding_window=None, soft_cap=None, sinks=None):
    """Causal attention of fresh prompts over their own K / V, exactly, and the K / V written into the cache.

    For a serving engine's first step of new requests (time to first token): each prompt's rows
    attend over the prompt's own K / V as given (uncompressed, causal), through
    :func:`jax.nn.dot_product_attention`, while one :func:`jax_tq.write_cache` call stores the K / V
    in the cache's pages at positions ``0 .. prompt_lens[b] - 1`` for the decode steps that follow.
    Unlike :func:`jax_tq.paged_prefill` and :func:`ragged_paged_attention`, which read every token
    back from the (compressed) cache, this path's attention is exact: the prompt's own tokens are
    not read back compressed. No token may be cached before a prompt (use
    :func:`ragged_paged_attention` for a chunk after cached tokens).

    Args:
      q: [batch, seq_len, num_heads, head_dim] float32 / bfloat16 / float16, the prompts' queries
        (after RoPE), padded to seq_len; num_heads a multiple of ``cache.num_kv_heads`` (GQA).
      k, v: [batch, seq_len, num_kv_heads, head_dim] of q's dtype, the prompts' keys (after RoPE)
        and values.
      cache: :class:`jax_tq.PagedKVCache` (compressed, with or without a window, or uncompressed).
        Donate it (``donate_argnums=3``) for an in-place update.
      block_tables: int32 [batch, max_pages], the prompts' pages (as :func:`jax_tq.paged_decode`).
      prompt_lens: int32 [batch]: tokens 0 .. prompt_lens[b] - 1 of prompt b are real, the rest
        padding. Values are clamped to [0, seq_len]. None (default): every prompt fills seq_len;
        no padding masks are applied (the attention is cuDNN's alone, one pass fewer over q, k, v
        and the output).
      scale: softmax scale, a finite Python number (static); default 1 / sqrt(head_dim).
      window_ids: int32 [batch], each prompt's window id for a cache with a window (default
        ``arange(batch)``); must be None for a cache without one.
      implementation: :func:`jax.nn.dot_product_attention`'s ``implementation``: None (default:
        cuDNN's flash attention for bfloat16 / float16 prompts on an NVIDIA GPU where cuDNN takes
        the shapes, else XLA's code; JAX's own default never picks cuDNN), ``"xla"``, or
        ``"cudnn"`` (it raises where cuDNN cannot run the shapes). XLA's code of float16 prompts runs in float32 on the CPU (XLA:CPU has no float16
        products with float32 results).
      sliding_window: None, or an int >= 1 (static): row p sees positions p - sliding_window + 1 .. p
        (Mistral's window; :func:`jax.nn.dot_product_attention`'s ``local_window_size``, so cuDNN
        still serves it).
      soft_cap: None, or a number > 0 (static): logits l become soft_cap * tanh(l / soft_cap) (Gemma 2).
      sinks: None, or float [num_heads]: a per-head logit in the softmax denominator only (gpt-oss).
        With soft_cap or sinks the attention is exact float32 (XLA's code of
        :func:`jax_tq.reference`'s masked softmax, 256 query rows at a time: scores of
        batch x num_heads x 256 x seq_len floats), whatever ``implementation`` says.

    Returns:
      ``(out, cache)``: out [batch, seq_len, num_heads, head_dim] of q's dtype (rows past
      prompt_lens are 0), and the cache after the write. A token whose position the block table
      does not cover (at or past max_pages * page_size) is not written (its row still attends over
      the prompt exactly); a block-table entry outside the pool is not written either.
      ``jax_tq.checked`` reports prompt_lens (None: seq_len) outside [0, min(seq_len, max_pages *
      page_size)], a used block-table entry outside the pool and a window id outside
      [0, num_windows) of a prompt with tokens.

    Raises:
      TypeError: q not float32 / bfloat16 / float16, k or v not of q's dtype; block_tables,
        prompt_lens or window_ids not int32; cache not a PagedKVCache; scale not a concrete number;
        sliding_window, soft_cap or sinks of a wrong type (:func:`jax_tq.variants.check_variants`).
      ValueError: wrong ranks or shapes (naming the argument), head_dim or num_kv_heads of k / v
        other than the cache's, num_heads not a positive multiple of num_kv_heads, a bad scale or
        implementation, window_ids given for a cache without a window, window_ids=None with more
        sequences than the cache has window ids; prompt_lens None with
        seq_len > max_pages * page_size (tokens no page covers); sliding_window < 1, soft_cap <= 0,
        sinks not [num_heads].
      BackendUnavailableError: backend "ffi" where no kernel serves the cache write (when it is
        lowered).

    Source: scaled dot-product attention (Vaswani et al., arXiv 1706.03762) through
    :func:`jax.nn.dot_product_attention` (cuDNN's flash attention, Dao, arXiv 2307.08691, where
    chosen); the cache write of :func:`jax_tq.write_cache` (TurboQuant, arXiv 2504.19874).
    """
    op = "prompt_attention"
    check_cache(cache, op)
    q, k, v = (as_array(x, name, op) for x, name in ((q, "q"), (k, "k"), (v, "v")))
    check_float_input(q, "q", op)
    if q.ndim != 4:
        raise ValueError(f"jax_tq.{op}: q must be [batch, seq_len, num_heads, head_dim], got shape {tuple(q.shape)}")
    batch, seq_len = q.shape[:2]
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"jax_tq.{op}: {name} must have q's dtype {q.dtype}, got {x.dtype}")
        want = (batch, seq_len, cache.num_kv_heads, cache.head_dim)
        if tuple(x.shape) != want:
            raise ValueError(f"jax_tq.{op}: {name} must be [batch, seq_len, num_kv_heads, head_dim] = {want}, got "
                             f"shape {tuple(x.shape)}")
    _check_heads(q.shape[2], q.shape[3], cache, op)
    block_tables = index_array(block_tables, "block_tables", f"[batch={batch}, max_pages]", op, ndim=2,
                               leading=batch)
    padded = prompt_lens is not None
    if padded:
        prompt_lens = index_array(prompt_lens, "prompt_lens", f"[batch={batch}]", op, shape=(batch,))
    else:
        capacity = block_tables.shape[1] * cache.page_size
        if batch and seq_len > capacity:  # every prompt has tokens no page covers: they would be lost
            raise ValueError(f"jax_tq.{op}: seq_len {seq_len} (every prompt's length, prompt_lens None) exceeds the "
                             f"block_tables' capacity max_pages * page_size = {block_tables.shape[1]} * "
                             f"{cache.page_size} = {capacity} tokens")
        prompt_lens = jnp.full((batch,), seq_len, jnp.int32)
    scale = _static_scale(scale, f"jax_tq.{op}")
    if implementation not in (None, "xla", "cudnn"):
        raise ValueError(f"jax_tq.{op}: implementation must be None, 'xla' or 'cudnn', got {implementation!r}")
    window_ids = window_ids_of(cache, window_ids, batch, op, block_tables)
    sliding_window, soft_cap, sinks = check_variants(sliding_window, soft_cap, sinks, q.shape[2], op)
    check_decode_indices(block_tables, jnp.minimum(prompt_lens, seq_len), num_pages=cache.num_pages,
                         page_size=cache.page_size, op=op,
                         lens_name="prompt_lens" if padded else "the length (prompt_lens None: seq_len) of prompt")
    if padded:
        check_at_most(prompt_lens, seq_len, op=op, name="prompt_lens", bound_name="seq_len")
    if window_ids is not None:
        check_window_ids(window_ids, prompt_lens, num_windows=cache.num_windows, op=op, distinct=True)
    if batch == 0 or seq_len == 0:
        return jnp.zeros_like(q), cache

    lens = jnp.clip(prompt_lens, 0, seq_len)
    scale = 1.0 / math.sqrt(cache.head_dim) if scale is None else scale
    out = causal_self_attention(q, k, v, lens if padded else None, scale, implementation, sliding_window, soft_cap,
                                sinks)
    real = jnp.arange(seq_len, dtype=jnp.int32)[None, :] < lens[:, None]  # [batch, seq_len]
    positions = jnp.tile(jnp.arange(seq_len, dtype=jnp.int32), batch)
    seq = jnp.repeat(jnp.arange(batch, dtype=jnp.int32), seq_len)
    slots = slot_mapping(block_tables, jnp.where(real.reshape(-1), positions, -1), cache.page_size, seq)
    window_slots = None
    if cache.window:
        window_slots = tq_format.window_slot_mapping(window_ids[seq], positions, lens[seq], cache.window)
    flat = (batch * seq_len, cache.num_kv_heads, cache.head_dim)
    with unchecked():
        cache = write_tokens(cache, k.reshape(flat), v.reshape(flat), slots, window_slots, window_needs_slot=False)
    return out, cache


def causal_self_attention(q, k, v, lens, scale: float, implementation, sliding_window: int, soft_cap: float,
                          sinks):
    """Exact causal (GQA) attention of padded prompts q [B, L, H, d] over their own k / v [B, L, Hkv, d]
    (rows and keys at or past lens int32 [B] are padding; lens None: none are):
    :func:`jax.nn.dot_product_attention` (cuDNN for bfloat16 / float16 on CUDA when ``implementation``
    is None), or with soft_cap / sinks :func:`_exact_attention`. Variants as
    :func:`jax_tq.variants.check_variants` returns them. Returns [B, L, H, d] of q's dtype, padding
    rows 0."""
    batch, seq_len = q.shape[:2]
    padded = lens is not None
    if not padded:
        lens = jnp.full((batch,), seq_len, jnp.int32)
    keep = (jnp.arange(seq_len, dtype=jnp.int32)[None, :] < lens[:, None])[:, :, None, None]
    seq_lengths = lens if padded else None

    def attend(q, k, v, impl=implementation):
        # float32 prompts stay float32-accurate (XLA's GPU default would run the products in TF32)
        exact = q.dtype == jnp.float32 and jax.config.jax_default_matmul_precision is None
        with jax.default_matmul_precision("highest" if exact else jax.config.jax_default_matmul_precision):
            return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, query_seq_lengths=seq_lengths,
                                                key_value_seq_lengths=seq_lengths, implementation=impl,
                                                local_window_size=(sliding_window - 1, 0) if sliding_window else None)

    def attend_f32(q, k, v):  # XLA:CPU refuses the float16 products (F16_F16_F32) jax.nn asks for
        return attend(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32)).astype(q.dtype)

    def attend_cuda(q, k, v):  # cuDNN's flash attention where it takes the shapes, else XLA's code
        try:
            return attend(q, k, v, "cudnn")
        except Exception:  # refused at trace time (head_dim, dtype, cuDNN version): XLA's code serves
            return attend(q, k, v, "xla")

    # Padding rows are 0 whatever they hold: a NaN in padding K / V would reach real rows (0 * NaN in
    # p @ V), a NaN in a padding query their gradients (the masked rows' cotangents are 0, times NaN).
    if padded:
        q, k, v = jnp.where(keep, q, 0), jnp.where(keep, k, 0), jnp.where(keep, v, 0)
    half = q.dtype in (jnp.bfloat16, jnp.float16)
    if soft_cap or sinks.shape[0]:
        out = _exact_attention(q, k, v, lens, scale, sliding_window, soft_cap, sinks)
    elif implementation is None and half:  # only the branch of the platform lowered is lowered
        out = jax.lax.platform_dependent(q, k, v, cpu=attend_f32 if q.dtype == jnp.float16 else attend,
                                         cuda=attend_cuda, default=attend)
    elif q.dtype == jnp.float16 and implementation != "cudnn":
        out = jax.lax.platform_dependent(q, k, v, cpu=attend_f32, default=attend)
    elif implementation == "cudnn":
        try:
            out = attend(q, k, v)
        except RuntimeError as err:  # jax.nn's own message names neither the op nor the argument
            raise ValueError(f"jax_tq.prompt_attention: implementation='cudnn' cannot serve this call ({err}); "
                             "pass None to let the platform choose") from err
    else:
        out = attend(q, k, v)
    return (jnp.where(keep, out, 0) if padded else out).astype(q.dtype)


#: Query rows per step of _exact_attention (its scores: batch x num_heads x this x seq_len float32).
_EXACT_ROWS = 256


def _exact_attention(q, k, v, lens, scale: float, sliding_window: int, soft_cap: float, sinks):
    """Causal attention of q [B, L, H, d] over k / v [B, L, Hkv, d] (rows and keys past lens [B]
    masked) in float32 with the variants (sliding_window / soft_cap 0: none; sinks float32 [H] or
    [0]), _EXACT_ROWS query rows at a time; [B, L, H, d] float32."""
    batch, seq_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    rows = min(_EXACT_ROWS, seq_len)
    steps = -(-seq_len // rows)
    q = jnp.pad(q, ((0, 0), (0, steps * rows - seq_len), (0, 0), (0, 0)))
    keys, values = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, Hkv, L, d]
    positions = jnp.arange(seq_len, dtype=jnp.int32)
    key_ok = positions[None, :] < lens[:, None]  # [B, L]
    head_sinks = sinks.reshape(1, num_kv_heads, group, 1, 1) if sinks.shape[0] else None

    def step(start):
        chunk = jax.lax.dynamic_slice_in_dim(q, start, rows, axis=1)
        queries = chunk.reshape(batch, rows, num_kv_heads, group, head_dim).transpose(0, 2, 3, 1, 4)
        row_pos = start + jnp.arange(rows, dtype=jnp.int32)
        seen = positions[None, :] <= row_pos[:, None]  # [rows, L]
        if sliding_window:
            seen = seen & (positions[None, :] > row_pos[:, None] - sliding_window)
        valid = seen[None, None, None] & key_ok[:, None, None, None, :]
        out = _attend_tokens(queries, keys, values, valid, key_ok[:, None, :, None], scale, soft_cap or None,
                             head_sinks)  # [B, Hkv, G, rows, d]
        return out.transpose(0, 3, 1, 2, 4).reshape(batch, rows, num_heads, head_dim)

    outs = jax.lax.map(step, jnp.arange(steps, dtype=jnp.int32) * rows)  # [steps, B, rows, H, d]
    return jnp.swapaxes(outs, 0, 1).reshape(batch, steps * rows, num_heads, head_dim)[:, :seq_len]


def _check_new_tokens(q, k, v, cache, op: str, rows: str):
    """q, k, v as arrays; TypeError / ValueError naming the one whose dtype or shape is wrong."""
    q, k, v = (as_array(x, name, op) for x, name in ((q, "q"), (k, "k"), (v, "v")))
    check_float_input(q, "q", op)
    if q.ndim != 3:
        raise ValueError(f"jax_tq.{op}: q must be [{rows}, num_heads, head_dim], got shape {tuple(q.shape)}")
    want = (q.shape[0], cache.num_kv_heads, cache.head_dim)
    for name, x in (("k", k), ("v", v)):
        check_float_input(x, name, op)
        if tuple(x.shape) != want:
            raise ValueError(f"jax_tq.{op}: {name} must be [{rows}, num_kv_heads, head_dim] = {want} (q's rows, the "
                             f"cache's heads and head_dim), got shape {tuple(x.shape)}")
    _check_heads(q.shape[1], q.shape[2], cache, op)
    return q, k, v


def _check_heads(num_heads: int, head_dim: int, cache, op: str) -> None:
    if head_dim != cache.head_dim:
        raise ValueError(f"jax_tq.{op}: q has head_dim {head_dim} but the cache has head_dim {cache.head_dim}")
    if num_heads == 0 or num_heads % cache.num_kv_heads:
        raise ValueError(f"jax_tq.{op}: num_heads {num_heads} is not a positive multiple of the cache's num_kv_heads "
                         f"{cache.num_kv_heads} (GQA)")
