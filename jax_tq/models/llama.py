"""Llama-architecture decoder in flax.nnx with an optional TurboQuant-compressed paged KV cache.

Architecture (Touvron et al. 2023, "LLaMA: Open and Efficient Foundation Language Models"):
pre-norm blocks with RMSNorm (Zhang & Sennrich 2019), rotary position embeddings in the
Hugging Face / GPT-NeoX ``rotate_half`` layout (Su et al. 2021, "RoFormer"), grouped-query
attention (Ainslie et al. 2023, "GQA"), SwiGLU MLP (Shazeer 2020) and a tied or untied lm head.
The same module covers the Llama family as llama.cpp reads it from GGUF: Llama 3.x (RoPE frequency
factors), Qwen2 / Qwen2.5 (q/k/v biases) and Qwen3 (per-head RMSNorm of q and k), see
:class:`LlamaConfig`.

Three execution paths, all jit-compiled through ``nnx.split`` / ``nnx.merge`` into pure functions:

* :func:`forward_logits` - uncompressed, full causal attention over a token sequence (baseline
  perplexity, reference).
* :func:`forward_compressed` - evaluation / prefill through the compressed paged cache: each
  layer writes K (after RoPE) and V of all tokens with :func:`jax_tq.write_cache`, then calls
  :func:`jax_tq.paged_decode` once with one "sequence" per query position (the chunk's block
  table repeated, ``seq_lens = position + 1``), i.e. exactly decoding attention, batched.
* :func:`decode_step` - one new token per sequence: write its K/V into the cache, attend with
  :func:`jax_tq.paged_decode`; the caches are donated.
* :func:`make_dense_decode_step` - the uncompressed baseline for decoding: one new token per
  sequence into a dense per-layer K/V cache (bfloat16 by default; see :func:`init_dense_caches`),
  masked softmax attention over the valid prefix; the caches are donated.
* :func:`make_decode_loop` / :func:`make_dense_decode_loop` - greedy decoding of ``num_steps``
  tokens per sequence in one jitted ``lax.scan`` of the step above (one dispatch for all steps:
  a jitted step takes the model's ~270 parameter arrays and the caches as arguments, whose
  dispatch costs milliseconds of host time per step, more than the GPU's work for a small model).

A compressed "cache" is a Python list with one :class:`jax_tq.PagedKVCache` per layer (see
:func:`init_caches`); all layers share the same two codecs, which have no array leaves, so the
whole list is donated as is. A dense cache is a list of ``(k, v)`` array pairs per layer.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_tq.format import window_slot_mapping

from .config import LlamaConfig

__all__ = [
    "LlamaConfig",
    "RMSNorm",
    "Attention",
    "MLP",
    "Block",
    "Llama",
    "rope_cos_sin",
    "apply_rope",
    "init_caches",
    "slot_mapping_for",
    "forward_logits",
    "forward_compressed",
    "decode_step",
    "make_decode_step",
    "init_dense_caches",
    "dense_decode_attention",
    "make_dense_decode_step",
    "make_decode_loop",
    "make_dense_decode_loop",
]


# ----------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------


class RMSNorm(nnx.Module):
    """Root-mean-square layer norm: ``x / sqrt(mean(x^2) + eps) * weight`` (computed in float32).

    RMSNorm: Zhang & Sennrich 2019, "Root Mean Square Layer Normalization".

    Args:
      dim: feature size; ``weight`` is ``[dim]``, initialised to ones.
      eps: epsilon added to the mean square.
      dtype: dtype of ``weight``.
    """

    def __init__(self, dim: int, eps: float = 1e-5, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        """Normalise over the last axis.

        Args:
          x: float ``[..., dim]``.
        Returns:
          ``[..., dim]`` in ``x.dtype``.
        """
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (y * self.weight[...].astype(jnp.float32)).astype(x.dtype)


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float,
                 freq_factors: Sequence[float] | None = None):
    """RoPE tables for the ``rotate_half`` (NeoX / HF) layout (Su et al. 2021).

    Args:
      positions: int ``[...]`` absolute token positions.
      head_dim: even rotary dimension.
      theta: base frequency.
      freq_factors: optional ``head_dim // 2`` positive divisors of the inverse frequencies
        (llama.cpp's ``rope_freqs.weight``: ggml's ``rope_yarn(theta / freq_factors[i0 / 2])``;
        Llama 3.1's scaling, ``convert_hf_to_gguf.py`` ``LlamaModel.generate_extra_tensors``;
        linear scaling by ``s`` (position interpolation) is every factor equal to ``s``).
    Returns:
      ``(cos, sin)`` float32 ``[..., head_dim]`` where entries ``i`` and ``i + head_dim/2`` share
      the frequency ``theta ** (-2i / head_dim) / freq_factors[i]`` (radians per position).
    Raises:
      ValueError: ``freq_factors`` is not of length ``head_dim // 2``.
    """
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if freq_factors is not None:
        if len(freq_factors) != head_dim // 2:
            raise ValueError(f"rope freq_factors must have head_dim // 2 = {head_dim // 2} entries, got "
                             f"{len(freq_factors)}")
        inv_freq = inv_freq / np.asarray(freq_factors, np.float64)
    inv_freq = jnp.asarray(inv_freq, jnp.float32)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x [T, heads, d]`` with tables ``cos, sin [T, d]``: ``x*cos + rotate_half(x)*sin``.

    RoPE (Su et al. 2021, "RoFormer") in the NeoX / HF ``rotate_half`` layout: coordinate ``i``
    pairs with ``i + d/2``. Computed in float32.

    Args:
      x: float ``[T, heads, d]`` (``d`` even).
      cos, sin: float32 ``[T, d]`` from :func:`rope_cos_sin`.
    Returns:
      ``[T, heads, d]`` in ``x.dtype``.
    """
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, None, :] + rot * sin[:, None, :]).astype(x.dtype)


def _dense(rngs: nnx.Rngs, n_in: int, n_out: int, dtype) -> nnx.Param:
    w = jax.random.normal(rngs.params(), (n_in, n_out), jnp.float32) / np.sqrt(n_in)
    return nnx.Param(w.astype(dtype))


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE, optional q/k/v biases and optional QK norm.

    GQA: Ainslie et al. 2023; RoPE: Su et al. 2021. Weights (``y = x @ W``): ``wq [hidden, H*d]``,
    ``wk, wv [hidden, Hkv*d]``, ``wo [H*d, hidden]``. Query head ``h`` uses KV head
    ``h // (H // Hkv)`` (same grouping as :func:`jax_tq.paged_decode`). With
    ``config.attention_bias`` (Qwen2 / Qwen2.5): biases ``bq [H*d]``, ``bk, bv [Hkv*d]`` (none on
    ``wo``), else None. With ``config.qk_norm`` (Qwen3, HF ``modeling_qwen3.py``): ``q_norm``,
    ``k_norm``, :class:`RMSNorm` over each head's ``d`` features of q and k before RoPE, else None.

    Args:
      config: :class:`LlamaConfig` (``hidden_size``, ``num_heads`` = H, ``num_kv_heads`` = Hkv,
        ``head_dim`` = d, ``rope_theta``, ``rope_freq_factors``, ``attention_bias``, ``qk_norm``,
        ``rms_norm_eps``).
      dtype: weight dtype.
      rngs: ``nnx.Rngs`` for the random (``N(0, 1/n_in)``) weight initialisation (biases 0, norms 1).
    """

    def __init__(self, config: LlamaConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        c = config
        self.num_heads = c.num_heads
        self.num_kv_heads = c.num_kv_heads
        self.head_dim = c.head_dim
        self.rope_theta = c.rope_theta
        self.rope_freq_factors = c.rope_freq_factors
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.wq = _dense(rngs, c.hidden_size, q_dim, dtype)
        self.wk = _dense(rngs, c.hidden_size, kv_dim, dtype)
        self.wv = _dense(rngs, c.hidden_size, kv_dim, dtype)
        self.wo = _dense(rngs, q_dim, c.hidden_size, dtype)
        bias = (lambda n: nnx.Param(jnp.zeros((n,), dtype))) if c.attention_bias else (lambda n: None)
        self.bq, self.bk, self.bv = bias(q_dim), bias(kv_dim), bias(kv_dim)
        norm = (lambda: RMSNorm(c.head_dim, c.rms_norm_eps, dtype)) if c.qk_norm else (lambda: None)
        self.q_norm, self.k_norm = norm(), norm()

    def qkv(self, x: jax.Array, positions: jax.Array):
        """Project (plus bias), normalise q and k per head (QK norm), rotate q and k (RoPE).

        Args:
          x: float ``[T, hidden]``.
          positions: int32 ``[T]`` RoPE positions.
        Returns:
          ``q [T, H, d]``, ``k [T, Hkv, d]`` (both after RoPE), ``v [T, Hkv, d]``, in the
          dtype of ``x @ W``.
        """
        T = x.shape[0]

        def project(w, b, n_heads, norm=None):
            y = x @ w[...]
            if b is not None:
                y = y + b[...]
            y = y.reshape(T, n_heads, self.head_dim)
            return y if norm is None else norm(y)

        q = project(self.wq, self.bq, self.num_heads, self.q_norm)
        k = project(self.wk, self.bk, self.num_kv_heads, self.k_norm)
        v = project(self.wv, self.bv, self.num_kv_heads)
        cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_theta, self.rope_freq_factors)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def out(self, attn: jax.Array) -> jax.Array:
        """Output projection.

        Args:
          attn: float ``[T, H, d]`` attention output (cast to the ``wo`` dtype).
        Returns:
          ``[T, hidden]`` in the ``wo`` dtype.
        """
        return attn.reshape(attn.shape[0], -1).astype(self.wo.dtype) @ self.wo[...]

    def causal(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Uncompressed causal attention over the whole sequence.

        Args:
          x: float ``[T, hidden]``.
          positions: int32 ``[T]`` RoPE positions.
        Returns:
          ``[T, hidden]``.
        """
        q, k, v = self.qkv(x, positions)
        return self.out(causal_attention(q, k, v))

    def compressed(self, x, positions, cache, slot_mapping, block_tables, seq_lens, window=None):
        """Attention through a compressed paged cache.

        Writes this call's K/V (``[T, Hkv, d]``) at ``slot_mapping [T]`` with
        :func:`jax_tq.write_cache`, then runs :func:`jax_tq.paged_decode` with query row ``t``
        as sequence ``t`` (``block_tables [T, max_pages]``, ``seq_lens [T]``).

        Args:
          x: float ``[T, hidden]``.
          positions: int32 ``[T]`` RoPE positions.
          cache: this layer's :class:`jax_tq.PagedKVCache`.
          slot_mapping: int32 ``[T]`` cache slots to write (negative: not written).
          block_tables: int32 ``[T, max_pages]``.
          seq_lens: int32 ``[T]`` cached tokens row ``t`` attends to (including itself).
          window: for a cache with a window, a :class:`WindowUse`: which window ids the rows use and
            where the new tokens go (None without a window).
        Returns:
          ``(y [T, hidden], new_cache)``.
        Raises:
          TypeError / ValueError: propagated from :func:`jax_tq.write_cache` /
            :func:`jax_tq.paged_decode`.
        """
        import jax_tq as tq

        q, k, v = self.qkv(x, positions)
        if window is None:
            cache = tq.write_cache(cache, k, v, slot_mapping)
            return self.out(tq.paged_decode(q, cache, block_tables, seq_lens)), cache
        before = cache
        cache = tq.write_cache(cache, k, v, slot_mapping, window.slots)
        if window.row_start is None:  # decode: row t is sequence t, window id window.ids[t]
            o = tq.paged_decode(q, cache, block_tables, seq_lens, window_ids=window.ids)
        else:  # one sequence's T positions: each row reads its own last tokens exactly
            rows = row_windows(cache, before, k, v, window.row_start, window.ids[0])
            o = tq.paged_decode(q, rows, block_tables, seq_lens, window_ids=jnp.arange(q.shape[0], dtype=jnp.int32))
        return self.out(o), cache

    def dense(self, x, positions, k_cache, v_cache):
        """Decode attention through a dense (uncompressed) cache, one new token per sequence.

        Args:
          x: ``[B, hidden]``; positions: int32 ``[B]`` (must be ``< max_len``);
          k_cache, v_cache: ``[B, Hkv, max_len, d]``.
        Returns:
          ``(y [B, hidden], k_cache, v_cache)``: this token's K/V written at ``positions``
          (``dynamic_update_slice``, in the cache dtype); row ``b`` attends to cache rows
          ``0 .. positions[b]``.
        """
        q, k, v = self.qkv(x, positions)

        def put(cache, new, pos):  # cache [Hkv, max_len, d], new [Hkv, d]
            return jax.lax.dynamic_update_slice_in_dim(cache, new[:, None].astype(cache.dtype), pos, 1)

        k_cache = jax.vmap(put)(k_cache, k, positions)
        v_cache = jax.vmap(put)(v_cache, v, positions)
        o = dense_decode_attention(q, k_cache, v_cache, positions + 1)
        return self.out(o), k_cache, v_cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WindowUse:
    """How a compressed forward uses the caches' recent-token windows.

    Attributes:
      ids: int32 ``[T]`` window id of each query row's sequence (decode), or ``[T]`` all equal to
        the one sequence's id (``row_start`` set).
      slots: int32 ``[T]`` ring entries the new tokens are written to (``write_cache``'s
        ``window_slots``; -1: not written).
      row_start: None for decode steps (row ``t`` is sequence ``t``); for one sequence's
        positions ``row_start .. row_start + T - 1`` (prefill / evaluation) the position of row 0:
        each row then reads its own last ``window`` tokens exactly (:func:`row_windows`).
    """

    ids: jax.Array
    slots: jax.Array
    row_start: int | None = dataclasses.field(default=None, metadata=dict(static=True))


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


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float | None = None):
    """Plain causal GQA softmax attention.

    Args:
      q: ``[T, H, d]``; k, v: ``[T, Hkv, d]`` with ``H % Hkv == 0``.
      scale: softmax scale, default ``1/sqrt(d)``.
    Returns:
      ``[T, H, d]`` in ``q.dtype``; logits and softmax in float32.
    """
    T, H, d = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    scale = (1.0 / np.sqrt(d)) if scale is None else scale
    qg = q.reshape(T, Hkv, G, d).astype(jnp.float32)
    s = jnp.einsum("tkgd,skd->kgts", qg, k.astype(jnp.float32)) * scale
    mask = jnp.tril(jnp.ones((T, T), bool))
    s = jnp.where(mask, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("kgts,skd->tkgd", p, v.astype(jnp.float32))
    return o.reshape(T, H, d).astype(q.dtype)


def dense_decode_attention(q, k_cache, v_cache, seq_lens, scale: float | None = None):
    """Masked GQA softmax attention of one query per sequence over a dense cache.

    Args:
      q: ``[B, H, d]``; k_cache, v_cache: ``[B, Hkv, max_len, d]`` (any float dtype; each (sequence,
        KV head) a contiguous ``[max_len, d]`` block, so both products are batched GEMMs over the
        cache as stored, with no transpose of it);
      seq_lens: int32 ``[B]`` >= 1, number of valid cache rows of each sequence.
      scale: softmax scale, default ``1/sqrt(d)``.
    Returns:
      ``[B, H, d]`` in ``q.dtype``; logits, softmax and accumulation in float32.
    """
    B, H, d = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    scale = (1.0 / np.sqrt(d)) if scale is None else scale
    qg = q.reshape(B, Hkv, H // Hkv, d)
    s = jnp.einsum("bkgd,bksd->bkgs", qg, k_cache, preferred_element_type=jnp.float32) * scale
    valid = jnp.arange(S, dtype=jnp.int32)[None, :] < seq_lens[:, None]  # [B, S]
    s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgs,bksd->bkgd", p, v_cache, preferred_element_type=jnp.float32)
    return o.reshape(B, H, d).astype(q.dtype)


class MLP(nnx.Module):
    """SwiGLU feed-forward: ``(silu(x @ w_gate) * (x @ w_up)) @ w_down`` (Shazeer 2020).

    Args:
      config: :class:`LlamaConfig` (``hidden_size``, ``intermediate_size``).
      dtype: weight dtype.
      rngs: ``nnx.Rngs`` for the random weight initialisation.
    """

    def __init__(self, config: LlamaConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.w_gate = _dense(rngs, config.hidden_size, config.intermediate_size, dtype)
        self.w_up = _dense(rngs, config.hidden_size, config.intermediate_size, dtype)
        self.w_down = _dense(rngs, config.intermediate_size, config.hidden_size, dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Apply the feed-forward.

        Args:
          x: float ``[..., hidden]``.
        Returns:
          ``[..., hidden]``.
        """
        return (jax.nn.silu(x @ self.w_gate[...]) * (x @ self.w_up[...])) @ self.w_down[...]


class Block(nnx.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    Args:
      config: :class:`LlamaConfig`.
      dtype: parameter dtype.
      rngs: ``nnx.Rngs`` for the random weight initialisation.
    """

    def __init__(self, config: LlamaConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.attn = Attention(config, dtype=dtype, rngs=rngs)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype=dtype, rngs=rngs)

    def causal(self, x, positions):
        """Uncompressed block (full causal attention).

        Args:
          x: float ``[T, hidden]``.
          positions: int32 ``[T]`` RoPE positions.
        Returns:
          ``[T, hidden]``.
        """
        x = x + self.attn.causal(self.attn_norm(x), positions)
        return x + self.mlp(self.ffn_norm(x))

    def compressed(self, x, positions, cache, slot_mapping, block_tables, seq_lens, window=None):
        """Block with attention through the compressed cache.

        Args:
          x: float ``[T, hidden]``; the other arguments as in :meth:`Attention.compressed`.
        Returns:
          ``(x [T, hidden], new_cache)``.
        Raises:
          TypeError / ValueError: propagated from :meth:`Attention.compressed`.
        """
        h, cache = self.attn.compressed(self.attn_norm(x), positions, cache, slot_mapping,
                                        block_tables, seq_lens, window)
        x = x + h
        return x + self.mlp(self.ffn_norm(x)), cache

    def dense(self, x, positions, k_cache, v_cache):
        """Block with decode attention through a dense cache (one new token per sequence).

        Args:
          x: float ``[B, hidden]``.
          positions: int32 ``[B]`` (``< max_len``).
          k_cache, v_cache: ``[B, Hkv, max_len, d]``.
        Returns:
          ``(x [B, hidden], k_cache, v_cache)``, see :meth:`Attention.dense`.
        """
        h, k_cache, v_cache = self.attn.dense(self.attn_norm(x), positions, k_cache, v_cache)
        x = x + h
        return x + self.mlp(self.ffn_norm(x)), k_cache, v_cache


class Llama(nnx.Module):
    """Llama decoder-only language model (Touvron et al. 2023) in flax.nnx.

    Args:
      config: :class:`LlamaConfig`.
      dtype: parameter / activation dtype (float32 recommended on CPU).
      rngs: ``nnx.Rngs`` for random initialisation (use :meth:`from_params` for real weights).

    Attributes:
      embed: ``nnx.Param [vocab, hidden]``; layers: list of :class:`Block`; final_norm;
      lm_head: ``nnx.Param [hidden, vocab]`` or None when tied to ``embed``.
    """

    def __init__(self, config: LlamaConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.embed = nnx.Param(
            (jax.random.normal(rngs.params(), (config.vocab_size, config.hidden_size)) * 0.02)
            .astype(dtype))
        self.layers = nnx.List([Block(config, dtype=dtype, rngs=rngs)
                                for _ in range(config.num_layers)])
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = _dense(rngs, config.hidden_size, config.vocab_size, dtype)

    @classmethod
    def from_params(cls, config: LlamaConfig, params: dict, dtype=jnp.float32) -> "Llama":
        """Build a model from the nested numpy dict produced by
        :func:`jax_tq.models.gguf_loader.load_params` (linear weights ``[in, out]``).

        Args:
          config: :class:`LlamaConfig` matching ``params``.
          params: nested dict of float arrays (keys as in ``load_params``; ``bq``, ``bk``, ``bv``
            only with ``config.attention_bias``, ``q_norm``, ``k_norm`` only with ``config.qk_norm``).
          dtype: parameter dtype.
        Returns:
          a :class:`Llama` holding ``params`` cast to ``dtype``.
        Raises:
          ValueError: on a shape mismatch, or ``len(params["layers"]) != config.num_layers``.
          KeyError: a missing key in ``params``.
        """
        if len(params["layers"]) != config.num_layers:
            raise ValueError(f"params['layers'] has {len(params['layers'])} layers, config.num_layers is "
                             f"{config.num_layers}")
        model = nnx.eval_shape(lambda: cls(config, dtype=dtype, rngs=nnx.Rngs(0)))

        def put(var, value):
            value = np.asarray(value)
            if tuple(var.shape) != tuple(value.shape):
                raise ValueError(f"shape mismatch: expected {var.shape}, got {value.shape}")
            return jnp.asarray(value, dtype)

        model.embed = nnx.Param(put(model.embed, params["embed"]))
        model.final_norm.weight = nnx.Param(put(model.final_norm.weight, params["final_norm"]))
        if model.lm_head is not None:
            model.lm_head = nnx.Param(put(model.lm_head, params["lm_head"]))
        for blk, p in zip(model.layers, params["layers"], strict=True):
            blk.attn_norm.weight = nnx.Param(put(blk.attn_norm.weight, p["attn_norm"]))
            blk.ffn_norm.weight = nnx.Param(put(blk.ffn_norm.weight, p["ffn_norm"]))
            for name in ("wq", "wk", "wv", "wo", "bq", "bk", "bv"):
                if getattr(blk.attn, name) is not None:
                    setattr(blk.attn, name, nnx.Param(put(getattr(blk.attn, name), p[name])))
            for name in ("q_norm", "k_norm"):
                if getattr(blk.attn, name) is not None:
                    getattr(blk.attn, name).weight = nnx.Param(put(getattr(blk.attn, name).weight, p[name]))
            for name in ("w_gate", "w_up", "w_down"):
                setattr(blk.mlp, name, nnx.Param(put(getattr(blk.mlp, name), p[name])))
        return model

    # -- pieces ---------------------------------------------------------------------------------
    def logits(self, h: jax.Array) -> jax.Array:
        """Final norm + lm head (the tied ``embed.T`` when ``lm_head`` is None).

        Args:
          h: float ``[..., hidden]`` hidden states.
        Returns:
          float32 logits ``[..., vocab]``.
        """
        h = self.final_norm(h)
        w = self.embed[...].T if self.lm_head is None else self.lm_head[...]
        return (h @ w).astype(jnp.float32)

    # -- un-jitted implementations (call inside jit) --------------------------------------------
    def apply_causal(self, token_ids: jax.Array, start_pos: int = 0) -> jax.Array:
        """Uncompressed causal forward (call inside ``jit``).

        Args:
          token_ids: int32 ``[T]``.
          start_pos: RoPE position of ``token_ids[0]``.
        Returns:
          float32 logits ``[T, vocab]``.
        """
        positions = start_pos + jnp.arange(token_ids.shape[0], dtype=jnp.int32)
        x = self.embed[...][token_ids]
        for blk in self.layers:
            x = blk.causal(x, positions)
        return self.logits(x)

    def apply_compressed(self, token_ids, positions, caches, slot_mapping, block_tables, seq_lens, window=None):
        """Forward through the compressed caches (one :class:`jax_tq.PagedKVCache` per layer).

        Args:
          token_ids: int32 ``[T]``; positions: int32 ``[T]`` (RoPE positions);
          caches: list (len ``num_layers``); slot_mapping: int32 ``[T]`` cache slots to write;
          block_tables: int32 ``[T, max_pages]``; seq_lens: int32 ``[T]`` (row ``t`` attends to
          ``seq_lens[t]`` cached tokens of its table, including itself);
          window: a :class:`WindowUse` for caches with a window, else None.
        Returns:
          ``(logits float32 [T, vocab], new_caches list)``.
        Raises:
          ValueError: ``len(caches) != num_layers``.
          TypeError / ValueError: propagated from :func:`jax_tq.write_cache` /
            :func:`jax_tq.paged_decode`.
        """
        if len(caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} caches, got {len(caches)}")
        x = self.embed[...][token_ids]
        new = []
        for blk, cache in zip(self.layers, caches):
            x, cache = blk.compressed(x, positions, cache, slot_mapping, block_tables, seq_lens, window)
            new.append(cache)
        return self.logits(x), new

    def apply_dense(self, token, position, caches):
        """One decode step through dense caches (one ``(k, v)`` pair per layer).

        Args:
          token, position: int32 ``[B]``; caches: list of ``(k [B, Hkv, max_len, d], v)``.
        Returns:
          ``(logits float32 [B, vocab], new_caches list)``.
        Raises:
          ValueError: ``len(caches) != num_layers``.
        """
        if len(caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} caches, got {len(caches)}")
        x = self.embed[...][token]
        new = []
        for blk, (k_cache, v_cache) in zip(self.layers, caches):
            x, k_cache, v_cache = blk.dense(x, position, k_cache, v_cache)
            new.append((k_cache, v_cache))
        return self.logits(x), new

    # -- jitted conveniences ----------------------------------------------------------------------
    def forward_logits(self, token_ids) -> jax.Array:
        """Jitted uncompressed causal forward; see :func:`forward_logits`.

        Args:
          token_ids: int ``[T]``.
        Returns:
          float32 logits ``[T, vocab]``.
        """
        return forward_logits(self, token_ids)

    def forward_compressed(self, token_ids, caches, block_table, start_pos: int = 0):
        """Jitted evaluation path through the compressed cache; see :func:`forward_compressed`.

        Args:
          token_ids: int ``[T]``; caches: per-layer :class:`jax_tq.PagedKVCache` list (donated);
          block_table: int32 ``[max_pages]``; start_pos: position of ``token_ids[0]``.
        Returns:
          ``(logits float32 [T, vocab], new_caches)``.
        Raises:
          TypeError / ValueError: as :func:`forward_compressed`.
        """
        return forward_compressed(self, token_ids, caches, block_table, start_pos)


# ----------------------------------------------------------------------------------------------
# Caches
# ----------------------------------------------------------------------------------------------


def init_caches(config: LlamaConfig, k_bits: int, v_bits: int, num_pages: int,
                page_size: int = 16, seed: int = 0, rotation: str = "haar", *, scale: str = "norm",
                window: int = 0, num_windows: int = 1):
    """One empty :class:`jax_tq.PagedKVCache` per layer with TurboQuant K/V codecs.

    The K codec uses ``seed`` and the V codec ``seed + 1``, both with ``rotation`` and ``scale``;
    all layers share the codecs. (A preset: ``init_caches(config, p.k_bits, p.v_bits, ...,
    rotation=p.rotation, scale=p.scale, window=p.window)`` for ``p = jax_tq.get_preset("k4v4")``,
    or :func:`jax_tq.models.cache_config_caches`.)

    Args:
      config: model config (``num_layers``, ``num_kv_heads``, ``head_dim``).
      k_bits, v_bits: TurboQuant bits per coordinate (2, 3 or 4).
      num_pages: physical pages per layer pool; page_size: tokens per page (1 to 256).
      seed: codec seed.
      rotation: codec rotation, ``"haar"`` (QR of a Gaussian) or ``"hadamard"`` (randomized
        Hadamard; at head_dim 128 :func:`jax_tq.paged_decode` then applies the rotations inside
        the kernel where one runs, see its docstring; at other head_dims, e.g. SmolLM2's 64, they
        stay two rotation GEMMs around it, as with Haar codecs).
      scale: the codecs' per-vector scale, ``"norm"`` or ``"fit"`` (:class:`jax_tq.TurboQuant`).
      window: recent tokens kept exactly per sequence (0: none); num_windows: window ids (one per
        sequence decoded at once; row ``b`` of a decode step uses id ``b``).
    Returns:
      list of ``num_layers`` caches.
    Raises:
      TypeError / ValueError: propagated from :class:`jax_tq.TurboQuant` /
        :meth:`jax_tq.PagedKVCache.create` (unsupported ``head_dim``, bits, ``rotation`` or
        ``scale``, non-int or non-positive sizes, ``page_size > 256``, a bad window).
    """
    import jax_tq as tq

    k_codec = tq.TurboQuant(config.head_dim, k_bits, seed, rotation, scale)
    v_codec = tq.TurboQuant(config.head_dim, v_bits, seed + 1, rotation, scale)
    cache = tq.PagedKVCache.create(num_pages=num_pages, page_size=page_size, num_kv_heads=config.num_kv_heads,
                                   k_codec=k_codec, v_codec=v_codec, window=window,
                                   num_windows=num_windows if window else 0)
    return [jax.tree_util.tree_map(jnp.copy, cache) for _ in range(config.num_layers)]


def init_dense_caches(config: LlamaConfig, batch: int, max_len: int, dtype=jnp.bfloat16):
    """Uncompressed decode caches for :func:`make_dense_decode_step`.

    Args:
      config: model config (``num_layers``, ``num_kv_heads``, ``head_dim``).
      batch: number of sequences; max_len: token capacity per sequence.
      dtype: cache dtype (bfloat16 by default).
    Returns:
      list of ``num_layers`` pairs of zero arrays ``(k, v)``, each
      ``[batch, num_kv_heads, max_len, head_dim]`` in ``dtype`` (a sequence's KV head is one
      contiguous ``[max_len, head_dim]`` block: the decode products read it without a transpose).
    """
    shape = (batch, config.num_kv_heads, max_len, config.head_dim)
    return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(config.num_layers)]


def _page_size(cache) -> int:
    return int(cache.page_size)


def check_token_ids(token_ids, vocab_size: int, where: str, values: bool = True) -> None:
    """Raise unless ``token_ids`` are integers (TypeError) in ``[0, vocab_size)`` (ValueError; with
    ``values`` and for concrete arrays only: a traced array has no values at trace time, and a
    decode loop's device-side tokens are not pulled to the host every step)."""
    traced = isinstance(token_ids, jax.core.Tracer)
    if not traced and np.size(token_ids) == 0:  # no ids to check (the callers check the length)
        return
    dtype = token_ids.dtype if hasattr(token_ids, "dtype") else np.asarray(token_ids).dtype
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{where}: token ids must be integers, got dtype {dtype}")
    if traced or not values:
        return
    ids = np.asarray(token_ids)
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"{where}: token ids must lie in [0, vocab_size={vocab_size}), got values "
                         f"{ids.min()}..{ids.max()}")


def _is_traced(*xs) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in xs)


_INT32_RANGE = (int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max))


def _int32(x, name: str, where: str) -> jax.Array:
    """``x`` as int32; TypeError unless its dtype is an integer one (floats would be truncated),
    ValueError for a concrete value outside int32 (it would wrap, e.g. 2**32 + 3 to 3)."""
    dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{where}: {name} must be integers, got dtype {dtype}")
    info = np.iinfo(dtype)
    if (info.min < _INT32_RANGE[0] or info.max > _INT32_RANGE[1]) and not _is_traced(x):
        values = np.asarray(x)
        if values.size and (values.min() < _INT32_RANGE[0] or values.max() > _INT32_RANGE[1]):
            raise ValueError(f"{where}: {name} must fit int32, got values {values.min()}..{values.max()}")
    return jnp.asarray(x, jnp.int32)


def _host_values(x) -> bool:
    """Whether ``x`` is a host value (numpy / Python), whose values are checked without waiting for
    a device."""
    return not isinstance(x, (jax.Array, jax.core.Tracer))


def _static_start(start_pos, where: str) -> int:
    """``start_pos`` as an int >= 0: TypeError unless a Python / numpy int (not bool or float: a
    float would be truncated), ValueError below 0."""
    if isinstance(start_pos, (bool, np.bool_)) or not isinstance(start_pos, (int, np.integer)):
        raise TypeError(f"{where}: start_pos must be a Python int, got {start_pos!r}")
    if start_pos < 0:
        raise ValueError(f"{where}: start_pos must be >= 0, got {start_pos}")
    return int(start_pos)


def _token_vector(token_ids, vocab_size: int, where: str) -> jax.Array:
    """int32 ``[T >= 1]`` token ids: TypeError / ValueError as :func:`check_token_ids`, ValueError for
    any other shape."""
    check_token_ids(token_ids, vocab_size, where)
    shape = tuple(np.shape(token_ids))
    if len(shape) != 1 or shape[0] < 1:
        raise ValueError(f"{where}: token_ids must be [T] with T >= 1 (one sequence, no batch axis), got shape {shape}")
    return jnp.asarray(token_ids, jnp.int32)


def _num_steps(num_steps, where: str) -> int:
    """``num_steps`` as an int >= 1: TypeError unless a Python / numpy int (not bool, float or a
    traced value: it sets the loop's length at trace time), ValueError below 1."""
    if isinstance(num_steps, (bool, np.bool_)) or not isinstance(num_steps, (int, np.integer)):
        raise TypeError(f"{where}: num_steps must be a Python int (static), got {num_steps!r}")
    if num_steps < 1:
        raise ValueError(f"{where}: num_steps must be >= 1, got {num_steps}")
    return int(num_steps)


def _check_paged_caches(caches: Sequence, where: str) -> int:
    """The caches' common page_size; TypeError for a non-PagedKVCache entry, ValueError when the
    layers' page sizes or page counts differ (one block table and one set of slots serve all
    layers: a smaller pool would silently drop the pages beyond it)."""
    from jax_tq.cache import PagedKVCache

    for i, c in enumerate(caches):
        if not isinstance(c, PagedKVCache):
            raise TypeError(f"{where}: caches[{i}] must be a jax_tq.PagedKVCache (see init_caches), got "
                            f"{type(c).__name__}")
    sizes = sorted({_page_size(c) for c in caches})
    if len(sizes) > 1:
        raise ValueError(f"{where}: every layer's cache must have the same page_size, got {sizes}")
    pages = sorted({int(c.num_pages) for c in caches})
    if len(pages) > 1:
        raise ValueError(f"{where}: every layer's cache must have the same num_pages (one block table serves "
                         f"all layers), got {pages}")
    return sizes[0]


def _check_dense_caches(model: Llama, caches: Sequence, num_seqs: int, where: str) -> int:
    """The dense caches' max_len; TypeError / ValueError unless every entry is a ``(k, v)`` pair of
    floating arrays ``[num_seqs, num_kv_heads, max_len, head_dim]`` (init_dense_caches)."""
    cfg = model.config
    want = (num_seqs, cfg.num_kv_heads, None, cfg.head_dim)
    max_lens = set()
    for i, entry in enumerate(caches):
        if not isinstance(entry, (tuple, list)) or len(entry) != 2:
            raise TypeError(f"{where}: caches[{i}] must be a (k, v) pair from init_dense_caches, got "
                            f"{type(entry).__name__}")
        for name, x in zip("kv", entry):
            shape, dtype = tuple(getattr(x, "shape", ())), getattr(x, "dtype", None)
            if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
                raise TypeError(f"{where}: caches[{i}] {name} must be a floating array, got dtype {dtype}")
            if len(shape) != 4 or any(w is not None and w != d for w, d in zip(want, shape)):
                raise ValueError(f"{where}: caches[{i}] {name} must be [B={num_seqs}, num_kv_heads={cfg.num_kv_heads}, "
                                 f"max_len, head_dim={cfg.head_dim}], got shape {shape}")
            max_lens.add(shape[2])
    if len(max_lens) != 1:
        raise ValueError(f"{where}: every cache must have the same max_len, got {sorted(max_lens)}")
    return max_lens.pop()


def _check_dense_positions(position, num_steps: int, max_len: int, where: str) -> None:
    """ValueError unless 0 <= position and position + num_steps <= max_len (concrete positions only):
    dynamic_update_slice would clamp the write onto a valid cached row."""
    if _is_traced(position):
        return
    pos = np.asarray(position)
    if pos.size and (pos.min() < 0 or pos.max() + num_steps > max_len):
        raise ValueError(f"{where}: positions {pos.min()}..{pos.max()} with {num_steps} step(s) do not fit the "
                         f"caches' max_len {max_len} (need 0 <= position and position + steps <= max_len)")


def slot_mapping_for(block_tables: jax.Array, positions: jax.Array, page_size: int) -> jax.Array:
    """Cache slots of ``positions`` for sequences with ``block_tables``.

    Args:
      block_tables: int32 ``[S, max_pages]`` (or ``[max_pages]`` broadcast to every position).
      positions: int32 ``[S]`` token positions within each sequence.
      page_size: tokens per cache page.
    Returns:
      int32 ``[S]``: ``block_tables[s, pos // page_size] * page_size + pos % page_size``, or -1
      (padding: :func:`jax_tq.write_cache` skips it) for a position outside
      ``[0, max_pages * page_size)``, which the table does not cover (indexing would clamp it onto
      the last page and overwrite a valid token).
    """
    positions = positions.astype(jnp.int32)
    max_pages = block_tables.shape[-1]
    page = positions // page_size
    covered = (positions >= 0) & (page < max_pages)
    page = jnp.clip(page, 0, max(max_pages - 1, 0))
    if block_tables.ndim == 1:
        phys = block_tables[page]
    else:
        phys = jnp.take_along_axis(block_tables, page[:, None], axis=1)[:, 0]
    return jnp.where(covered, phys * page_size + positions % page_size, -1).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------
# Jitted pure functions (split / merge)
# ----------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(0, 3))
def _causal_pure(graphdef, state, token_ids, start_pos):
    model = nnx.merge(graphdef, state)
    return model.apply_causal(token_ids, start_pos)


def forward_logits(model: Llama, token_ids, start_pos: int = 0) -> jax.Array:
    """Uncompressed full causal forward (jit-compiled per length).

    Args:
      model: :class:`Llama`.
      token_ids: int ``[T]`` token ids (no batch axis).
      start_pos: RoPE position of the first token.
    Returns:
      float32 logits ``[T, vocab]``; row ``t`` predicts token ``t + 1``.
    Raises:
      TypeError: token ids not integers; ``start_pos`` not an int.
      ValueError: token ids outside ``[0, vocab_size)`` or not of shape ``[T >= 1]``;
        ``start_pos < 0``.
    """
    token_ids = _token_vector(token_ids, model.config.vocab_size, "forward_logits")
    start_pos = _static_start(start_pos, "forward_logits")
    graphdef, state = nnx.split(model)
    return _causal_pure(graphdef, state, token_ids, start_pos)


@functools.partial(jax.jit, static_argnums=(0, 5), donate_argnums=(3,))
def _compressed_pure(graphdef, state, token_ids, caches, block_table, start_pos, window_id):
    model = nnx.merge(graphdef, state)
    T = token_ids.shape[0]
    positions = start_pos + jnp.arange(T, dtype=jnp.int32)
    page_size = _page_size(caches[0])
    slots = slot_mapping_for(block_table, positions, page_size)
    tables = jnp.broadcast_to(block_table[None, :], (T, block_table.shape[0]))
    window = None
    if caches[0].window:
        ids = jnp.full((T,), window_id, jnp.int32)
        window_slots = window_slot_mapping(ids, positions, jnp.full((T,), start_pos + T, jnp.int32), caches[0].window)
        window = WindowUse(ids, window_slots, start_pos)
    return model.apply_compressed(token_ids, positions, caches, slots, tables, positions + 1, window)


def forward_compressed(model: Llama, token_ids, caches: Sequence, block_table, start_pos: int = 0,
                       window_id: int = 0):
    """Evaluation / prefill path through the compressed paged caches (jit-compiled, caches donated).

    Token ``t`` (position ``start_pos + t``) is written to its slot given by ``block_table`` (and,
    with a window, the last ``window`` tokens to the window ``window_id``); then every position
    attends, via :func:`jax_tq.paged_decode`, to the compressed K/V of itself and all earlier
    positions of the sequence (including any tokens cached before ``start_pos``), its own last
    ``window`` positions exactly - exactly what decoding would see.

    Args:
      model: :class:`Llama`.
      token_ids: int ``[T]``.
      caches: list of per-layer :class:`jax_tq.PagedKVCache` (donated: do not reuse the inputs).
      block_table: int32 ``[max_pages]`` physical pages of this sequence; must cover
        ``start_pos + T`` tokens.
      start_pos: position of ``token_ids[0]`` (tokens before it must already be cached).
      window_id: the sequence's window id (caches with a window).
    Returns:
      ``(logits float32 [T, vocab], new_caches)``. With a window the attention holds
      ``[T, num_kv_heads, window, head_dim]`` rows per layer for the rows' own windows.
    Raises:
      TypeError: token ids or ``block_table`` not integers; ``start_pos`` not an int; a cache that is
        not a :class:`jax_tq.PagedKVCache`.
      ValueError: ``len(caches) != num_layers``; layers of different page sizes or page counts;
        ``token_ids`` not 1-D with >= 1 token, or token ids outside ``[0, vocab_size)``;
        ``block_table`` not 1-D; ``start_pos < 0`` or ``start_pos + T`` beyond the table's
        ``max_pages * page_size`` tokens.
      TypeError / ValueError: propagated from :func:`jax_tq.write_cache` /
        :func:`jax_tq.paged_decode`.
    """
    where = "forward_compressed"
    _check_num_caches(model, caches)
    page_size = _check_paged_caches(caches, where)
    token_ids = _token_vector(token_ids, model.config.vocab_size, where)
    block_table = _int32(block_table, "block_table", where)
    start_pos = _static_start(start_pos, where)
    if block_table.ndim != 1:
        raise ValueError(f"forward_compressed: block_table must be [max_pages] (1-D), got shape {block_table.shape}")
    capacity = block_table.shape[0] * page_size
    if start_pos < 0 or start_pos + token_ids.shape[0] > capacity:
        raise ValueError(f"forward_compressed: positions {start_pos}..{start_pos + token_ids.shape[0] - 1} are not "
                         f"covered by block_table ({block_table.shape[0]} pages x page_size {page_size} = "
                         f"{capacity} tokens)")
    graphdef, state = nnx.split(model)
    window_id = _int32(window_id, "window_id", where)
    return _compressed_pure(graphdef, state, token_ids, list(caches), block_table, start_pos, window_id)


def _check_num_caches(model: Llama, caches: Sequence) -> None:
    if len(caches) != model.config.num_layers:
        raise ValueError(f"expected {model.config.num_layers} caches, got {len(caches)}")


def _decode_window(caches, position, seq_lens):
    """The :class:`WindowUse` of a decode step (row b uses window id b), or None without a window."""
    window = caches[0].window
    if not window:
        return None
    ids = jnp.arange(position.shape[0], dtype=jnp.int32)
    return WindowUse(ids, window_slot_mapping(ids, position, seq_lens, window))


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _decode_pure(graphdef, state, caches, token, position, block_tables, seq_lens):
    model = nnx.merge(graphdef, state)
    page_size = _page_size(caches[0])
    slots = slot_mapping_for(block_tables, position, page_size)
    # A sequence with seq_len 0 (inactive) writes nothing.
    slots = jnp.where(seq_lens > 0, slots, -1)
    return model.apply_compressed(token, position, caches, slots, block_tables, seq_lens,
                                  _decode_window(caches, position, seq_lens))


def decode_step(model: Llama, caches: Sequence, token, position, block_tables, seq_lens):
    """One decoding step for a batch of sequences (jit-compiled; caches donated).

    Args:
      model: :class:`Llama`.
      caches: list of per-layer :class:`jax_tq.PagedKVCache` (donated).
      token: int32 ``[S]`` the new token of each sequence.
      position: int32 ``[S]`` its position (number of tokens already cached for the sequence).
      block_tables: int32 ``[S, max_pages]``.
      seq_lens: int32 ``[S]`` sequence length INCLUDING the new token (normally ``position + 1``);
        0 marks an inactive row (nothing written, zero attention output). A position at or
        beyond ``max_pages * page_size`` (the table is full) is not written; the attention then
        sees the cached tokens only (seq_lens is clamped as in paged_decode).
    Returns:
      ``(logits float32 [S, vocab], new_caches)``.
    Raises:
      TypeError: non-integer token, position, block_tables or seq_lens; a cache that is not a
        :class:`jax_tq.PagedKVCache`.
      ValueError: ``len(caches) != num_layers``; layers of different page sizes or page counts;
        token, position or seq_lens not of shape ``[S]``, block_tables not ``[S, max_pages]``;
        integers outside int32. For host (numpy / Python) inputs also: token ids outside
        ``[0, vocab_size)``, an active row at a negative position. Inputs held in device arrays
        are not read back every step: there an out-of-vocab id is clamped by the embedding
        lookup, and a negative position writes nothing.
      TypeError / ValueError: propagated from :func:`jax_tq.write_cache` /
        :func:`jax_tq.paged_decode`.
    """
    return make_decode_step(model)(caches, token, position, block_tables, seq_lens)


def _check_active_positions(position, seq_lens, where: str) -> None:
    """ValueError for an active row (seq_lens > 0) at a negative position (nothing would be
    written, and the row would attend to an unwritten slot)."""
    pos, active = np.asarray(position), np.asarray(seq_lens) > 0
    if active.any() and pos[active].min() < 0:
        raise ValueError(f"{where}: active rows' positions must be >= 0, got {pos[active].min()}")


def _check_decode_shapes(token, position, block_tables, seq_lens) -> None:
    """ValueError naming the first of token, position, seq_lens ([S]) and block_tables
    ([S, max_pages]) whose shape is wrong."""
    if token.ndim != 1:
        raise ValueError(f"decode_step: token must be [S] (one token per sequence), got shape {token.shape}")
    num_seqs = token.shape[0]
    if num_seqs < 1:
        raise ValueError("decode_step: need at least one sequence (token is empty)")
    for name, x in (("position", position), ("seq_lens", seq_lens)):
        if x.shape != (num_seqs,):
            raise ValueError(f"decode_step: {name} must be [S={num_seqs}] like token, got shape {x.shape}")
    if block_tables.ndim != 2 or block_tables.shape[0] != num_seqs or block_tables.shape[1] < 1:
        raise ValueError(f"decode_step: block_tables must be [S={num_seqs}, max_pages >= 1], got shape "
                         f"{block_tables.shape}")


def make_decode_step(model: Llama):
    """Return ``step(caches, token, position, block_tables, seq_lens) -> (logits, caches)``.

    Same as :func:`decode_step` but splits the model once (lower Python overhead per token).
    Later in-place changes to ``model`` are not seen by the returned function.

    Args:
      model: :class:`Llama`.
    Returns:
      the jitted ``step``; arguments, results and errors as in :func:`decode_step` (caches
      donated, logits float32 ``[S, vocab]``).
    """
    graphdef, state = nnx.split(model)

    def step(caches, token, position, block_tables, seq_lens):
        where = "decode_step"
        check_token_ids(token, model.config.vocab_size, where, values=_host_values(token))
        _check_num_caches(model, caches)
        _check_paged_caches(caches, where)
        host_position, host_seq_lens = position, seq_lens
        token, position = _int32(token, "token", where), _int32(position, "position", where)
        block_tables = _int32(block_tables, "block_tables", where)
        seq_lens = _int32(seq_lens, "seq_lens", where)
        _check_decode_shapes(token, position, block_tables, seq_lens)
        if _host_values(host_position) and _host_values(host_seq_lens):  # no device read per step
            _check_active_positions(host_position, host_seq_lens, where)
        return _decode_pure(graphdef, state, list(caches), token, position, block_tables, seq_lens)

    return step


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _dense_decode_pure(graphdef, state, caches, token, position):
    model = nnx.merge(graphdef, state)
    return model.apply_dense(token, position, caches)


def _dense_args(model: Llama, caches, token, position, num_steps: int, where: str, device_values: bool = True):
    """The checked int32 (token, position) of a dense decode step or loop. ``device_values``: also
    range-check positions held in device arrays (a host read that waits for them: a loop's one call,
    not every step)."""
    _check_num_caches(model, caches)
    check_token_ids(token, model.config.vocab_size, where, values=device_values or _host_values(token))
    given_position = position
    token, position = _int32(token, "token", where), _int32(position, "position", where)
    if token.ndim != 1 or token.shape[0] < 1 or position.shape != token.shape:
        raise ValueError(f"{where}: token and position must be [B] with B >= 1, got shapes {token.shape} and "
                         f"{position.shape}")
    max_len = _check_dense_caches(model, caches, token.shape[0], where)
    if device_values or _host_values(given_position):
        _check_dense_positions(given_position, num_steps, max_len, where)
    return token, position


def make_dense_decode_step(model: Llama):
    """Return ``step(caches, token, position) -> (logits, caches)`` for dense caches.

    The uncompressed baseline of :func:`make_decode_step`; splits the model once.

    Args:
      model: :class:`Llama`.
    Returns:
      the jitted ``step``: ``caches`` from :func:`init_dense_caches` (donated); ``token``,
      ``position`` int ``[B]`` (``position`` = tokens already cached for the sequence,
      ``< max_len``); returns ``(logits float32 [B, vocab], new_caches)``. It raises TypeError for
      non-integer tokens / positions or caches that are not ``(k, v)`` pairs of floating arrays,
      and ValueError for a wrong number of caches, shapes that do not match ``[B]`` /
      ``[B, num_kv_heads, max_len, head_dim]``, integers outside int32, or host (numpy / Python)
      token ids outside ``[0, vocab_size)`` or positions outside ``[0, max_len)``. Tokens and
      positions in device arrays are not read back every step: an out-of-vocab id is clamped by
      the embedding lookup, a position past ``max_len`` is clamped by ``dynamic_update_slice``
      onto a cached row, and a negative one gives NaN logits (its row has no valid cache row).
    """
    graphdef, state = nnx.split(model)

    def step(caches, token, position):
        token, position = _dense_args(model, caches, token, position, 1, "dense decode step", device_values=False)
        return _dense_decode_pure(graphdef, state, list(caches), token, position)

    return step


def _greedy_tokens(logits):
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(0, 7), donate_argnums=(2,))
def _decode_loop_pure(graphdef, state, caches, token, position, block_tables, seq_lens, num_steps):
    model = nnx.merge(graphdef, state)
    page_size = _page_size(caches[0])

    def body(carry, _):
        caches, token, position, seq_lens = carry
        active = seq_lens > 0
        slots = jnp.where(active, slot_mapping_for(block_tables, position, page_size), -1)
        logits, caches = model.apply_compressed(token, position, caches, slots, block_tables, seq_lens,
                                                _decode_window(caches, position, seq_lens))
        nxt = _greedy_tokens(logits)
        step = active.astype(jnp.int32)
        return (caches, nxt, position + step, seq_lens + step), nxt

    (caches, _, _, _), tokens = jax.lax.scan(body, (caches, token, position, seq_lens), None, length=num_steps)
    return tokens.T, caches


def _check_loop_capacity(position, seq_lens, capacity: int, num_steps: int, where: str) -> None:
    """ValueError when an active row (seq_lens > 0) would step past its block table (concrete
    values only): decode_step writes nothing there, so later tokens would not see their own K / V."""
    if _is_traced(position, seq_lens):
        return
    pos, active = np.asarray(position), np.asarray(seq_lens) > 0
    if active.any() and (pos[active].min() < 0 or pos[active].max() + num_steps > capacity):
        raise ValueError(f"{where}: active rows' positions {pos[active].min()}..{pos[active].max()} with "
                         f"{num_steps} step(s) do not fit the block tables' {capacity} tokens (max_pages x "
                         f"page_size); give the rows more pages or take fewer steps")


def make_decode_loop(model: Llama):
    """Return ``loop(caches, token, position, block_tables, seq_lens, num_steps) -> (tokens, caches)``:
    ``num_steps`` greedy decoding steps through the compressed caches in one jitted call.

    Step ``i`` is :func:`decode_step` with the previous step's argmax token (the given ``token``
    first), ``position + i`` and ``seq_lens + i`` for the active rows (``seq_lens > 0``). Inactive
    rows write nothing and stay at 0; their tokens are the argmax of logits from a zero attention
    output, meaningless. A loop of ``num_steps`` is compiled once per value.

    Args:
      model: :class:`Llama`; later in-place changes to it are not seen by ``loop``.
    Returns:
      the function ``loop``: ``caches`` (per-layer :class:`jax_tq.PagedKVCache` list, donated),
      ``token``, ``position``, ``seq_lens`` int32 ``[S]`` and ``block_tables`` int32
      ``[S, max_pages]`` as in :func:`decode_step`, ``num_steps`` a Python int >= 1; returns int32
      ``tokens [S, num_steps]`` (the token chosen at each step) and the new caches. It raises
      TypeError for a ``num_steps`` that is not an int, non-integer inputs or caches that are not
      :class:`jax_tq.PagedKVCache`; ValueError for ``num_steps < 1``, token ids outside
      ``[0, vocab_size)``, bad shapes (as :func:`decode_step`), layers of different page sizes, or
      (concrete values) an active row whose ``position + num_steps`` exceeds its block table's
      ``max_pages * page_size`` tokens.
    """
    graphdef, state = nnx.split(model)

    def loop(caches, token, position, block_tables, seq_lens, num_steps: int):
        where = "decode loop"
        steps = _num_steps(num_steps, where)
        check_token_ids(token, model.config.vocab_size, where)
        _check_num_caches(model, caches)
        page_size = _check_paged_caches(caches, where)
        token, position = _int32(token, "token", where), _int32(position, "position", where)
        block_tables, seq_lens = _int32(block_tables, "block_tables", where), _int32(seq_lens, "seq_lens", where)
        _check_decode_shapes(token, position, block_tables, seq_lens)
        _check_loop_capacity(position, seq_lens, block_tables.shape[1] * page_size, steps, where)
        return _decode_loop_pure(graphdef, state, list(caches), token, position, block_tables, seq_lens, steps)

    return loop


@functools.partial(jax.jit, static_argnums=(0, 5), donate_argnums=(2,))
def _dense_decode_loop_pure(graphdef, state, caches, token, position, num_steps):
    model = nnx.merge(graphdef, state)

    def body(carry, _):
        caches, token, position = carry
        logits, caches = model.apply_dense(token, position, caches)
        nxt = _greedy_tokens(logits)
        return (caches, nxt, position + 1), nxt

    (caches, _, _), tokens = jax.lax.scan(body, (caches, token, position), None, length=num_steps)
    return tokens.T, caches


def make_dense_decode_loop(model: Llama):
    """Return ``loop(caches, token, position, num_steps) -> (tokens, caches)``: ``num_steps``
    greedy steps of :func:`make_dense_decode_step`'s step in one jitted call (the uncompressed
    baseline of :func:`make_decode_loop`).

    Args:
      model: :class:`Llama`; later in-place changes to it are not seen by ``loop``.
    Returns:
      the function ``loop``: ``caches`` from :func:`init_dense_caches` (donated), ``token`` and
      ``position`` int ``[B]``, ``num_steps`` a Python int >= 1; returns int32
      ``tokens [B, num_steps]`` and the new caches. It raises as the dense step does (with the
      positions' range ``0 <= position`` and ``position + num_steps <= max_len``, and token ids in
      ``[0, vocab_size)``, checked on concrete values, device arrays included: one host read per
      call; traced ones, under an outer ``jax.jit``, are not checked), and also for a
      ``num_steps`` that is not an int (TypeError) or below 1 (ValueError).
    """
    graphdef, state = nnx.split(model)

    def loop(caches, token, position, num_steps: int):
        where = "dense decode loop"
        steps = _num_steps(num_steps, where)
        token, position = _dense_args(model, caches, token, position, steps, where)
        return _dense_decode_loop_pure(graphdef, state, list(caches), token, position, steps)

    return loop
