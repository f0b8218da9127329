"""Flax integration: TurboQuant attention for ``flax.nnx`` / ``flax.linen`` attention modules, and the
decode-step attention over a paged compressed cache.

* :func:`turboquant_attention_fn` returns an ``attention_fn`` for ``nnx.MultiHeadAttention`` (and
  ``linen.MultiHeadDotProductAttention``): keys and values pass through the TurboQuant codec (the
  compress and decompress kernels) before the module's dot-product attention, so a model sees
  exactly the K/V a compressed cache would give it (prefill / evaluation).
* :class:`PagedAttention` (:mod:`jax_tq.nn_paged`): an ``nnx.MultiHeadAttention`` replacement whose
  decode state is a :class:`PagedKVCache` (prefill and decode through the library's ops).
* :func:`paged_attention` is the decode-step attention of a layer holding a :class:`PagedKVCache`:
  write the new tokens' K/V (fused compress + scatter), then split-K paged decode.
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable

import jax
import jax.numpy as jnp

from jax_tq.cache import PagedKVCache, window_ids_of, write_cache
from jax_tq.checks import index_array
from jax_tq.format import window_slot_mapping
from jax_tq.codec import TurboQuant
from jax_tq.compress import check_float_input, check_packed_codec, compress, decompress
from jax_tq.paged_decode import paged_decode

__all__ = ["turboquant_attention_fn", "paged_attention", "PagedAttention", "linen_paged_attention"]


def turboquant_attention_fn(k_codec: TurboQuant, v_codec: TurboQuant, base_attention_fn: Callable | None = None):
    """An ``attention_fn`` that compresses K and V with TurboQuant before ``base_attention_fn``.

    It compresses the K/V it is given at every call and keeps nothing: it measures quantization's
    effect in prefill and evaluation. In a module's ``decode=True`` mode flax caches the
    uncompressed K/V itself (no memory saved, and every step compresses the whole cache again); for
    decoding from a compressed cache use :class:`jax_tq.PagedKVCache` with :func:`paged_attention`.

    Args:
      k_codec, v_codec: codecs whose head_dim is the attention head size.
      base_attention_fn: the attention to run on the reconstructed K/V, called with the module's
        arguments. Default: ``flax.linen.dot_product_attention`` when called from a flax.linen
        module (which passes its own arguments: ``force_fp32_for_softmax``, the einsum overrides,
        and with ``sow_weights=True`` itself as ``module``, so the weights are sown into linen's
        ``'intermediates'``), else ``flax.nnx.dot_product_attention``. ``jax.nn.dot_product_attention``
        does not take flax's arguments (``dropout_rng``, float masks) and needs a wrapper inside flax
        modules.

    Returns:
      ``fn(query, key, value, *args, **kwargs)``, with ``base_attention_fn``'s signature, or by
      default the union of linen's and nnx's ``dot_product_attention`` parameters (as
      ``inspect.signature`` reports it: flax.linen passes an attention function only the arguments
      it finds there by name): query [..., q_len, num_heads, head_dim], key and
      value [..., kv_len, num_kv_heads, head_dim] (any float dtype the kernels take); returns what
      ``base_attention_fn`` returns. Reconstructed K/V keep the input dtype. Differentiable: the
      compress/decompress round trip passes gradients straight through (identity; the
      straight-through estimator of quantization-aware training, Bengio et al. 2013), so
      ``jax.grad`` / ``nnx.grad`` work through the module.

    Raises:
      TypeError: a codec is not a :class:`jax_tq.TurboQuant` (when the function is built); key or
        value not float32/bfloat16/float16 (when it is called).
      ValueError: a codec's bits have no packed format (not 2, 3 or 4; when built); head_dim of
        key / value differs from its codec's (naming which).
    """
    check_packed_codec(k_codec, "nn.turboquant_attention_fn", "k_codec")
    check_packed_codec(v_codec, "nn.turboquant_attention_fn", "v_codec")
    def attention_fn(query, key, value, *args, **kwargs):
        for name, x, codec in (("key", key, k_codec), ("value", value, v_codec)):
            check_float_input(jnp.asarray(x), name, "nn.turboquant_attention_fn")
            if jnp.ndim(x) < 1 or jnp.shape(x)[-1] != codec.head_dim:
                raise ValueError(f"jax_tq.nn.turboquant_attention_fn: {name} must be [..., kv_len, num_kv_heads, "
                                 f"{codec.head_dim}] (the codec's head_dim), got shape {tuple(jnp.shape(x))}")
        key_hat = _round_trip(key, k_codec)
        value_hat = _round_trip(value, v_codec)
        if base_attention_fn is not None:
            return base_attention_fn(query, key_hat, value_hat, *args, **kwargs)
        return _default_base_attention(query, key_hat, value_hat, *args, **kwargs)

    if base_attention_fn is not None:  # inspect.signature (through __wrapped__) sees the base's
        return functools.wraps(base_attention_fn)(attention_fn)
    attention_fn.__signature__ = _flax_attention_signature()
    return attention_fn


#: Parameters of flax.linen.dot_product_attention that flax.nnx's does not take: only a linen
#: module passes them (it passes an attention function the arguments its signature names).
_LINEN_ONLY = ("force_fp32_for_softmax", "einsum_dot_general", "qk_attn_weights_einsum", "attn_weights_value_einsum")


def _flax_modules():
    """(flax.linen, flax.nnx). Raises ModuleNotFoundError naming what to install when flax is missing."""
    try:
        from flax import linen, nnx
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError("jax_tq's flax integration needs flax: pip install flax (or jax_tq's "
                                  "'examples' extra)") from err
    return linen, nnx


@functools.cache
def _flax_attention_signature() -> inspect.Signature:
    """nnx.dot_product_attention's signature plus linen's own keyword parameters."""
    linen, nnx = _flax_modules()

    params = dict(inspect.signature(nnx.dot_product_attention).parameters)
    for name, param in inspect.signature(linen.dot_product_attention).parameters.items():
        if name not in params:
            params[name] = param.replace(kind=inspect.Parameter.KEYWORD_ONLY)
    ordered = sorted(params.values(), key=lambda p: p.kind == inspect.Parameter.KEYWORD_ONLY)
    return inspect.Signature(ordered)


def _default_base_attention(query, key, value, *args, **kwargs):
    """flax.linen's dot_product_attention when a linen module calls (it passes linen-only arguments,
    or itself as ``module``: the weights are sown into linen's 'intermediates'), else flax.nnx's."""
    linen, nnx = _flax_modules()

    from_linen = isinstance(kwargs.get("module"), linen.Module) or any(name in kwargs for name in _LINEN_ONLY)
    fn = linen.dot_product_attention if from_linen else nnx.dot_product_attention
    return fn(query, key, value, *args, **kwargs)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _round_trip(x, codec):
    """decompress(compress(x)) in x's dtype, with the identity as its derivative."""
    return decompress(*compress(x, codec), codec, dtype=x.dtype)


@_round_trip.defjvp
def _round_trip_jvp(codec, primals, tangents):
    (x,), (dx,) = primals, tangents
    return _round_trip(x, codec), dx


def paged_attention(q, k, v, cache: PagedKVCache, slot_mapping, block_tables, seq_lens, *, window_ids=None,
                    scale=None, num_splits=None, precision=None, sliding_window=None, soft_cap=None, sinks=None):
    """One decode step of attention over a paged cache (compressed or uncompressed): write, then attend.

    Args:
      q: [num_seqs, num_heads, head_dim] float32/bfloat16/float16 queries of the new token of each
        sequence.
      k, v: [num_seqs, num_kv_heads, head_dim] float32/bfloat16/float16 keys/values of those tokens
        (after RoPE).
      cache: the layer's :class:`PagedKVCache` (donate it to the enclosing jit for an in-place update).
      slot_mapping: int32 [num_seqs], where each new token is stored.
      block_tables: int32 [num_seqs, max_pages]; seq_lens: int32 [num_seqs], lengths INCLUDING the new token.
      window_ids: int32 [num_seqs] window id of each sequence, for a cache with a window (default
        ``arange(num_seqs)``): the new token also goes to entry (seq_lens - 1) % window of it.
      scale, num_splits, precision, sliding_window, soft_cap, sinks: as in
        :func:`jax_tq.paged_decode` (softmax scale, default 1/sqrt(head_dim); split-K count; product
        precision; the query's last sliding_window tokens only; Gemma 2's logit soft cap; gpt-oss's
        float32 [num_heads] per-head sink logits).

    Returns:
      (out [num_seqs, num_heads, head_dim] of q's dtype, updated cache). Gradients: as in
      :func:`jax_tq.write_cache` and :func:`jax_tq.paged_decode`, k and v are differentiated
      through their norms only (the codes are integers), so d out / d k and d out / d v are the
      radial parts of the exact gradients; for quantization-aware training with full (straight-
      through) gradients use :func:`turboquant_attention_fn`.

    Raises:
      ValueError: k or v without one token per sequence of q (their first axis must be num_seqs).
      TypeError / ValueError: seq_lens not int32 [num_seqs].
      TypeError / ValueError from :func:`jax_tq.write_cache` and :func:`jax_tq.paged_decode`.
    """
    for name, x in (("k", k), ("v", v)):
        if jnp.ndim(q) >= 1 and jnp.ndim(x) >= 1 and jnp.shape(x)[0] != jnp.shape(q)[0]:
            raise ValueError(f"jax_tq.nn.paged_attention: {name} must hold one token per sequence, "
                             f"[num_seqs={jnp.shape(q)[0]}, num_kv_heads, head_dim], got shape {tuple(jnp.shape(x))}")
    seq_lens = index_array(seq_lens, "seq_lens", "[num_seqs]", "nn.paged_attention", ndim=1)
    window_slots = None
    if cache.window:
        window_ids = window_ids_of(cache, window_ids, seq_lens.shape[0], "nn.paged_attention", block_tables)
        window_slots = window_slot_mapping(window_ids, seq_lens - 1, seq_lens, cache.window)
    cache = write_cache(cache, k, v, slot_mapping, window_slots)
    out = paged_decode(q, cache, block_tables, seq_lens, window_ids=window_ids, scale=scale, num_splits=num_splits,
                       precision=precision, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
    return out, cache


def __getattr__(name):
    """``PagedAttention`` and ``linen_paged_attention`` (:mod:`jax_tq.nn_paged`), imported on first
    use: flax is imported only then."""
    if name in ("PagedAttention", "linen_paged_attention"):
        from jax_tq import nn_paged
        return getattr(nn_paged, name)
    raise AttributeError(f"module 'jax_tq.nn' has no attribute {name!r}")
