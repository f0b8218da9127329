"""``PagedAttention``: a flax.nnx self-attention module whose decode state is a :class:`jax_tq.PagedKVCache`.

A drop-in for ``nnx.MultiHeadAttention`` in a decoder (self-attention, causal): the same
constructor essentials and the same parameter tree (``query``, ``key``, ``value``, ``out``
``nnx.LinearGeneral``, optional ``query_ln`` / ``key_ln``), so a trained ``MultiHeadAttention``'s
parameters load into it with ``nnx.update(paged, nnx.state(mha, nnx.Param))``. Its cache, made by
:meth:`PagedAttention.init_cache`, is one :class:`jax_tq.PagedKVCache` (TurboQuant codes, or
uncompressed pages with ``preset="none"``) with contiguous pages per batch row, and each row's
length. ``decode=False`` on a cache = prefill (:func:`jax_tq.prompt_attention`: exact causal
attention over the prompt's own K / V and one cache write); ``decode=True`` = one new token per row
(:func:`jax_tq.write_cache` + :func:`jax_tq.paged_decode`). An engine that holds the caches itself
(pages shared by sequences through a :class:`jax_tq.PageAllocator`, chunked prefill, ragged
batches) calls :meth:`PagedAttention.attend` with a cache and :class:`jax_tq.CacheRows` instead;
:mod:`jax_tq.models` runs its decoders that way. Imported from :mod:`jax_tq.nn`.
"""
from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_tq.cache import PRESETS, UNCOMPRESSED, PagedKVCache, slot_mapping
from jax_tq.cache_rows import CacheRows, attend_rows, prompt_rows
from jax_tq.format import SUPPORTED_HEAD_DIMS, _is_int, window_slot_mapping
from jax_tq.ragged import causal_self_attention
from jax_tq.variants import check_variants

__all__ = ["PagedAttention", "linen_paged_attention"]

_PRESETS = (*PRESETS, UNCOMPRESSED)


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


class PagedAttention(nnx.Module):
    """Causal multi-head (GQA) self-attention whose autoregressive cache is a :class:`jax_tq.PagedKVCache`.

    Replaces ``nnx.MultiHeadAttention`` in a decoder: construct it with the same sizes, call
    :meth:`init_cache` before generating, then call it with ``decode=False`` on the prompts
    (prefill: fills the cache and sets each row's length) and with ``decode=True`` on one token per
    row (appends it and attends over the row's cached tokens). Its parameters have
    ``nnx.MultiHeadAttention``'s names and shapes (``query.kernel [in_features, num_heads,
    head_dim]``, ``key.kernel`` / ``value.kernel [in_features, num_kv_heads, head_dim]``,
    ``out.kernel [num_heads, head_dim, out_features]``, biases likewise). Attention is always
    causal self-attention (no ``inputs_k`` / ``inputs_v``, no ``mask``: padded prompts pass
    ``lengths``), no dropout.

    Positions: with ``rope=None`` the module adds no position information (as
    ``nnx.MultiHeadAttention``: a decoder with absolute position embeddings adds them to its
    inputs). With ``rope=fn``, ``fn(x, positions)`` rotates q ``[..., num_heads, head_dim]`` and k
    ``[..., num_kv_heads, head_dim]`` after the projections (and QK norm) with int32 ``positions``
    of x's leading shape: ``[batch, L]`` in the module's own modes (``0 .. L - 1`` in prefill, each
    row's cached length in decode, so the caller never tracks positions for it), ``[T]`` in
    :meth:`attend` (the caller's).

    Two ways to hold the cache: the module's own (:meth:`init_cache`, then ``__call__``: one row
    per sequence, contiguous pages per row), or the caller's (:meth:`attend`: any
    :class:`jax_tq.PagedKVCache`, block tables and ragged rows, the cache passed in and returned).

    Args:
      num_heads: query heads H.
      in_features: input features (last axis of ``inputs_q``).
      qkv_features: H * head_dim (default ``in_features``); must be a multiple of ``num_heads``.
      out_features: output features (default ``in_features``).
      num_kv_heads: K / V heads (default ``num_heads``); a divisor of ``num_heads`` (GQA).
      dtype: computation dtype of the projections (default: promoted from inputs and params);
        q / k / v reach the cache ops in it (float32, bfloat16 or float16).
      param_dtype: parameter dtype (default float32).
      use_bias: biases on the four projections (as ``nnx.MultiHeadAttention``).
      out_bias: a bias on the output projection (default ``use_bias``; Qwen2 has q / k / v biases only).
      normalize_qk: normalisation of q and k per head before RoPE: False; True or ``"layer"``
        (LayerNorm without bias, as ``nnx.MultiHeadAttention``); ``"rms"`` (``nnx.RMSNorm``: Qwen3's
        and Gemma 3's QK norm).
      qk_norm_epsilon: the QK norm's epsilon (default 1e-6).
      kernel_init, bias_init, out_kernel_init, out_bias_init, precision: as ``nnx.MultiHeadAttention``.
      decode: default mode when ``__call__`` gets none.
      rope: None or ``fn(x, positions) -> x`` (see Positions).
      preset: the cache: ``"k4v4"``, ``"k3v3"``, ``"k2v2"`` (TurboQuant codes, fitted scales and a
        64-token exact window per row: :data:`jax_tq.PRESETS`; head_dim 64, 80, 96, 128, 192 or
        256) or ``"none"`` (uncompressed pages of ``cache_dtype``, any head_dim).
      page_size: tokens per cache page (1 to 256).
      seed: the codecs' seed (K ``seed``, V ``seed + 1``).
      cache_dtype: the pages' dtype with ``preset="none"`` (float32, bfloat16, float16).
      check_capacity: decoding a token into a full row raises: eagerly a ValueError before
        anything runs; under ``jit`` a host callback (``jax.debug.callback``, one per call: a
        device-to-host copy of the lengths) fails the run, and with the module donated its cache
        buffers are gone (call :meth:`init_cache` again). False skips the callback (no host
        round trip); such a row's output is then NaN, nothing is written and its length stays
        ``max_length``.
      sliding_window, soft_cap: the attention variants of :mod:`jax_tq.variants` (static; row p
        sees positions p - sliding_window + 1 .. p; logits capped to soft_cap * tanh(l / soft_cap)),
        in every mode.
      sinks: True adds a parameter ``sinks`` float ``[num_heads]`` (zeros), a per-head logit in the
        softmax denominator only (gpt-oss's attention sinks), in every mode.
      rngs: ``nnx.Rngs`` for the parameter initialisers.

    Attributes (after :meth:`init_cache`; ``nnx.Cache`` variables, donated with the module):
      cache: ``nnx.Cache`` holding the :class:`jax_tq.PagedKVCache`, ``batch * pages_per_row``
        pages, row b owning pages ``[b * pages_per_row, (b + 1) * pages_per_row)``.
      block_tables: ``nnx.Cache`` int32 ``[batch, pages_per_row]``.
      lengths: ``nnx.Cache`` int32 ``[batch]``, tokens cached per row.
      max_length: tokens a row may hold (Python int).

    Raises:
      ValueError: ``num_heads`` not a multiple of ``num_kv_heads``, ``qkv_features`` not a multiple of
        ``num_heads``, an unknown ``preset``, a bad ``page_size``, a non-positive size,
        ``sliding_window < 1``, ``soft_cap <= 0``, a ``normalize_qk`` other than False, True,
        ``"layer"`` or ``"rms"``. (A compressed preset's head_dim is checked by :meth:`init_cache`.)
      TypeError: ``rope`` not callable; ``sliding_window`` / ``soft_cap`` not numbers; ``sinks`` or
        ``check_capacity`` not a bool; ``decode`` neither a bool nor None.
    """

    def __init__(self, num_heads: int, in_features: int, qkv_features: int | None = None,
                 out_features: int | None = None, num_kv_heads: int | None = None, *, dtype=None,
                 param_dtype=jnp.float32, use_bias: bool = True, normalize_qk: bool | str = False,
                 kernel_init=nnx.initializers.lecun_normal(), bias_init=nnx.initializers.zeros_init(),
                 out_kernel_init=None, out_bias_init=None, precision=None, decode: bool | None = None,
                 out_bias: bool | None = None, qk_norm_epsilon: float = 1e-6,
                 rope: Callable | None = None, preset: str = "k4v4", page_size: int = 16, seed: int = 0,
                 cache_dtype=jnp.float32, check_capacity: bool = True, sliding_window: int | None = None,
                 soft_cap: float | None = None, sinks: bool = False, rngs: nnx.Rngs):
        where = "jax_tq.nn.PagedAttention"
        self.num_heads = _positive(num_heads, "num_heads", where)
        self.in_features = _positive(in_features, "in_features", where)
        self.qkv_features = _positive(in_features if qkv_features is None else qkv_features, "qkv_features", where)
        self.out_features = _positive(in_features if out_features is None else out_features, "out_features", where)
        self.num_kv_heads = _positive(num_heads if num_kv_heads is None else num_kv_heads, "num_kv_heads", where)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{where}: num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.qkv_features % self.num_heads:
            raise ValueError(f"{where}: qkv_features ({self.qkv_features}) must be a multiple of num_heads "
                             f"({self.num_heads})")
        if isinstance(preset, str):  # case and spaces as PagedKVCache.create
            preset = preset.strip().lower()
        if preset not in _PRESETS:
            raise ValueError(f"{where}: preset must be one of {_PRESETS}, got {preset!r}")
        if not _is_int(page_size) or not 1 <= page_size <= 256:  # NumPy ints too, as PagedKVCache.create
            raise ValueError(f"{where}: page_size must be an int in [1, 256], got {page_size!r}")
        if rope is not None and not callable(rope):
            raise TypeError(f"{where}: rope must be None or a callable fn(x, positions), got {type(rope).__name__}")
        self.head_dim = self.qkv_features // self.num_heads
        if not (isinstance(normalize_qk, (bool, np.bool_)) or normalize_qk in ("layer", "rms")):
            raise ValueError(f"{where}: normalize_qk must be False, True, 'layer' or 'rms', got {normalize_qk!r}")
        for name, flag, may_be_none in (("decode", decode, True), ("check_capacity", check_capacity, False)):
            if not (isinstance(flag, (bool, np.bool_)) or (may_be_none and flag is None)):
                raise TypeError(f"{where}: {name} must be a bool{' or None' if may_be_none else ''}, got {flag!r}")
        self.dtype, self.param_dtype, self.precision = dtype, param_dtype, precision
        self.use_bias, self.normalize_qk, self.decode = use_bias, bool(normalize_qk), decode
        self.rope, self.preset, self.page_size, self.seed = rope, preset, int(page_size), seed
        self.cache_dtype, self.check_capacity = cache_dtype, check_capacity
        self.sliding_window, self.soft_cap, _ = check_variants(sliding_window, soft_cap, None, self.num_heads,
                                                               "nn.PagedAttention")
        if not isinstance(sinks, (bool, np.bool_)):
            raise TypeError(f"{where}: sinks must be a bool (True adds a learned [num_heads] sinks parameter; the "
                            f"functional ops take the array), got {type(sinks).__name__}")
        # gpt-oss's learned sinks: one logit per query head, initialised to 0 (exp(0) = one more token's worth)
        self.sinks = nnx.Param(jnp.zeros((self.num_heads,), param_dtype)) if sinks else nnx.data(None)

        def linear(n_in, n_out, axis=-1, k_init=kernel_init, b_init=bias_init, bias=use_bias):
            return nnx.LinearGeneral(n_in, n_out, axis=axis, dtype=dtype, param_dtype=param_dtype,
                                     kernel_init=k_init, bias_init=b_init, use_bias=bias, precision=precision,
                                     rngs=rngs)

        self.query = linear(self.in_features, (self.num_heads, self.head_dim))
        self.key = linear(self.in_features, (self.num_kv_heads, self.head_dim))
        self.value = linear(self.in_features, (self.num_kv_heads, self.head_dim))
        if normalize_qk:
            self.query_ln, self.key_ln = (_qk_norm(normalize_qk, self.head_dim, qk_norm_epsilon, dtype, param_dtype,
                                                   rngs) for _ in range(2))
        else:
            self.query_ln, self.key_ln = nnx.data(None), nnx.data(None)
        self.out = linear((self.num_heads, self.head_dim), self.out_features, axis=(-2, -1),
                          k_init=out_kernel_init or kernel_init, b_init=out_bias_init or bias_init,
                          bias=use_bias if out_bias is None else out_bias)
        self.cache = nnx.data(None)
        self.block_tables = nnx.data(None)
        self.lengths = nnx.data(None)
        self.max_length = None

    def init_cache(self, batch_size, max_length: int | None = None) -> None:
        """Create an empty cache for ``batch_size`` rows of up to ``max_length`` tokens each.

        ``init_cache(batch_size, max_length)``, or ``init_cache((batch_size, max_length, features))``
        as ``nnx.MultiHeadAttention.init_cache(input_shape)`` is called. Each row gets
        ``ceil(max_length / page_size)`` pages of its own; presets with a window get one window per
        row. Memory: ``PagedKVCache.nbytes``-style pools of ``batch * pages_per_row * page_size``
        tokens per K and V, plus the windows (64 bf16 tokens per row and KV head for the presets).
        Calling it again discards the old cache.

        Raises:
          ValueError: a size that is not a positive int, or a shape tuple that is not
            ``(batch_size, max_length, features)``.
          TypeError / ValueError: from :meth:`jax_tq.PagedKVCache.create` (e.g. a head_dim the
            compressed presets do not support).
        """
        where = "jax_tq.nn.PagedAttention.init_cache"
        if self.preset != "none" and self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"{where}: preset {self.preset!r} needs head_dim = qkv_features / num_heads in "
                             f"{SUPPORTED_HEAD_DIMS}, got {self.qkv_features} / {self.num_heads} = {self.head_dim} "
                             f"(preset='none' takes any head_dim)")
        if isinstance(batch_size, (tuple, list)):
            if max_length is not None or len(batch_size) != 3 or batch_size[2] != self.in_features:
                raise ValueError(f"{where}: give (batch_size, max_length) or an input shape (batch_size, max_length, "
                                 f"features={self.in_features}), got {batch_size!r} and max_length={max_length!r}")
            batch_size, max_length = batch_size[0], batch_size[1]
        batch = _positive(batch_size, "batch_size", where)
        max_length = _positive(max_length, "max_length", where)
        pages = -(-max_length // self.page_size)
        sizes = dict(num_pages=batch * pages, page_size=self.page_size, num_kv_heads=self.num_kv_heads,
                     head_dim=self.head_dim)
        if self.preset == "none":
            cache = PagedKVCache.create(**sizes, preset="none", dtype=self.cache_dtype)
        else:
            cache = PagedKVCache.create(**sizes, preset=self.preset, seed=self.seed, num_windows=batch)
        self.cache = nnx.Cache(cache)
        self.block_tables = nnx.Cache(jnp.arange(batch * pages, dtype=jnp.int32).reshape(batch, pages))
        self.lengths = nnx.Cache(jnp.zeros((batch,), jnp.int32))
        self.max_length = max_length

    def __call__(self, inputs_q: jax.Array, *, decode: bool | None = None, lengths=None) -> jax.Array:
        """Causal self-attention of ``inputs_q``; with a cache, prefill (``decode=False``) or one decode step.

        * ``decode=False`` without a cache: causal attention over ``inputs_q`` itself (training,
          scoring), rows past ``lengths`` 0 before the output projection.
        * ``decode=False`` with a cache (:meth:`init_cache`): prefill. Every row starts a new
          sequence: its prompt ``inputs_q[b, :lengths[b]]`` attends causally over its own K / V,
          exactly (:func:`jax_tq.prompt_attention`), the K / V are written to the row's pages and
          ``self.lengths[b] = lengths[b]``; whatever the row held before is forgotten.
        * ``decode=True``: ``inputs_q [batch, 1, features]``, one new token per row at position
          ``self.lengths[b]``: written (:func:`jax_tq.write_cache`), attended with the row's
          cached tokens (:func:`jax_tq.paged_decode`), and ``self.lengths += 1`` (a full row's stays).

        Under ``nnx.jit(..., donate_argnums=...)`` with the module (or a model holding it)
        donated, the cache is updated in place.

        Args:
          inputs_q: float ``[batch, L, in_features]`` (L = 1 in decode); batch must be the cache's.
          decode: the mode (default: the constructor's ``decode``).
          lengths: prefill only: int ``[batch]`` real tokens per row (the rest padding, right-padded),
            default L for every row; values must lie in ``[0, L]`` (checked when concrete).

        Returns:
          ``[batch, L, out_features]`` in the output projection's dtype. In prefill, rows at or past
          ``lengths[b]`` are the output projection of 0 (its bias).

        Raises:
          ValueError: ``inputs_q`` not ``[batch, L, in_features]``; decode with no cache
            (call ``init_cache`` first), with ``L != 1``, another batch or ``lengths``; prefill of
            another batch than the cache's rows, or longer than ``max_length``; ``lengths`` of the
            wrong shape or (concrete) outside ``[0, L]``; a decode step into a row holding
            ``max_length`` tokens (eagerly; under ``jit`` the run fails with the same message from
            a host callback unless ``check_capacity=False``).
          TypeError: ``lengths`` not integer, ``decode`` not given anywhere.
        """
        where = "jax_tq.nn.PagedAttention"
        decode = self.decode if decode is None else decode
        if decode is None:
            raise TypeError(f"{where}: pass decode=True or False (to __call__ or the constructor)")
        x = jnp.asarray(inputs_q)
        if x.ndim != 3 or x.shape[-1] != self.in_features:
            raise ValueError(f"{where}: inputs_q must be [batch, length, in_features={self.in_features}], got shape "
                             f"{tuple(x.shape)}")
        batch, length = x.shape[:2]
        if decode:
            if self.cache is None:
                raise ValueError(f"{where}: decode=True needs a cache: call init_cache(batch_size, max_length) first")
            if lengths is not None:
                raise ValueError(f"{where}: lengths is for prefill (decode=False); a decode step adds one token per row")
            if length != 1 or batch != self.lengths.shape[0]:
                raise ValueError(f"{where}: decode takes one token per cached row, inputs_q [batch="
                                 f"{self.lengths.shape[0]}, 1, {self.in_features}], got shape {tuple(x.shape)}")
            return self._decode(x)
        lens = self._prompt_lengths(lengths, batch, length, where)
        if self.cache is not None:
            if batch != self.lengths.shape[0]:
                raise ValueError(f"{where}: the cache holds {self.lengths.shape[0]} rows, inputs_q has batch {batch}")
            # padding past max_length is fine where the real prompts (concrete lengths) fit
            longest = int(np.max(np.asarray(lens), initial=0)) if lengths is not None and _is_concrete(lens) else length
            if longest > self.max_length:
                raise ValueError(f"{where}: a prompt of {longest} tokens does not fit the cache's max_length "
                                 f"{self.max_length} (init_cache(batch_size, max_length))")
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        q, k, v = self._qkv(x, positions)
        if self.cache is None:
            variants = check_variants(**self._variants(), num_heads=self.num_heads, op="nn.PagedAttention")
            return self.out(causal_self_attention(q, k, v, lens, 1.0 / math.sqrt(self.head_dim), None, *variants))
        cache = self.cache.get_value()
        flat = lambda a: a.reshape((batch * length,) + a.shape[2:])  # noqa: E731
        attn, cache = attend_rows(flat(q), flat(k), flat(v), cache, prompt_rows(cache, self.block_tables[...], lens,
                                                                                  length), **self._variants())
        self.cache.set_value(cache)
        # as prompt_attention read them, at most what the cache holds (traced lengths are unchecked)
        self.lengths[...] = jnp.clip(lens, 0, min(length, self.max_length))
        return self.out(attn.reshape(q.shape))

    def attend(self, inputs: jax.Array, positions: jax.Array, cache: PagedKVCache, rows: CacheRows):
        """This layer over a cache the caller holds: project ``inputs``, rotate q and k at ``positions``,
        write the new K / V into ``cache`` and attend as ``rows`` say (:func:`jax_tq.attend_rows`:
        prompts, a chunk after cached tokens, decode rows or a ragged batch), project the output.

        The module's own cache (:meth:`init_cache`) is neither read nor changed; ``preset``,
        ``page_size``, ``seed``, ``cache_dtype`` and ``check_capacity`` do not apply. Several layers
        share one :class:`jax_tq.CacheRows` per forward (:mod:`jax_tq.models` runs its decoders
        so, with a cache per layer). Gradients: as :func:`jax_tq.attend_rows` says (to k / v only
        through fresh prompts and uncompressed pages).

        Args:
          inputs: float ``[T, in_features]``, the forward's T token rows.
          positions: int32 ``[T]`` each row's position (given to ``rope``).
          cache: a :class:`jax_tq.PagedKVCache` of this layer's ``num_kv_heads`` and head_dim.
          rows: :class:`jax_tq.CacheRows` for T rows (:func:`jax_tq.prompt_rows`,
            :func:`jax_tq.chunk_rows`, :func:`jax_tq.decode_rows`, or filled by the caller).
        Returns:
          ``(out [T, out_features], the cache with the new tokens)``.
        Raises:
          ValueError: ``inputs`` not ``[T, in_features]``, ``positions`` not ``[T]``.
          TypeError: ``positions`` not integers.
          TypeError / ValueError: what :func:`jax_tq.attend_rows` raises (a ``cache`` or ``rows`` of the
            wrong type, rows for another page size).
        """
        where = "jax_tq.nn.PagedAttention.attend"
        x = jnp.asarray(inputs)
        if x.ndim != 2 or x.shape[-1] != self.in_features:
            raise ValueError(f"{where}: inputs must be [T, in_features={self.in_features}], got shape "
                             f"{tuple(x.shape)}")
        positions = jnp.asarray(positions)
        if not jnp.issubdtype(positions.dtype, jnp.integer):
            raise TypeError(f"{where}: positions must be integers, got {positions.dtype}")
        if positions.shape != x.shape[:1]:
            raise ValueError(f"{where}: positions must be [T={x.shape[0]}], got shape {tuple(positions.shape)}")
        q, k, v = self._qkv(x, positions.astype(jnp.int32))
        out, cache = attend_rows(q, k, v, cache, rows, **self._variants())
        return self.out(out), cache

    def _decode(self, x):
        lens = self.lengths[...]
        if self.check_capacity and _is_concrete(lens) and np.any(np.asarray(lens) >= self.max_length):
            raise ValueError(_full_message(np.asarray(lens), self.max_length))
        q, k, v = self._qkv(x, lens[:, None])
        full = lens >= self.max_length
        if self.check_capacity and not _is_concrete(lens):
            jax.debug.callback(_raise_if_full, lens, self.max_length)
        cache = self.cache.get_value()
        slots = slot_mapping(self.block_tables[...], jnp.where(full, -1, lens), self.page_size)
        new_lens = jnp.where(full, lens, lens + 1)
        window_ids = window_slots = None
        if cache.window:
            window_ids = jnp.arange(lens.shape[0], dtype=jnp.int32)
            window_slots = jnp.where(full, -1, window_slot_mapping(window_ids, lens, new_lens, cache.window))
        rows = CacheRows(slots, self.block_tables[...], new_lens, window_slots=window_slots, window_ids=window_ids,
                         page_size=cache.page_size)
        out, cache = attend_rows(q[:, 0], k[:, 0], v[:, 0], cache, rows, **self._variants())
        out = jnp.where(full[:, None, None], jnp.nan, out)
        self.cache.set_value(cache)
        self.lengths[...] = new_lens  # a full row keeps max_length
        return self.out(out[:, None])

    def _qkv(self, x, positions):
        q, k, v = self.query(x), self.key(x), self.value(x)
        if self.normalize_qk:
            q, k = self.query_ln(q), self.key_ln(k)
        if self.rope is not None:
            q, k = self.rope(q, positions), self.rope(k, positions)
        dtype = jnp.result_type(q, k, v)
        return q.astype(dtype), k.astype(dtype), v.astype(dtype)

    def _variants(self) -> dict:
        return dict(sliding_window=self.sliding_window or None, soft_cap=self.soft_cap or None,
                    sinks=None if self.sinks is None else self.sinks[...])

    @staticmethod
    def _prompt_lengths(lengths, batch, length, where):
        if lengths is None:
            return jnp.full((batch,), length, jnp.int32)
        arr = jnp.asarray(lengths)
        if not jnp.issubdtype(arr.dtype, jnp.integer):
            raise TypeError(f"{where}: lengths must be integer [batch={batch}], got {arr.dtype}")
        if arr.shape != (batch,):
            raise ValueError(f"{where}: lengths must be [batch={batch}], got shape {tuple(arr.shape)}")
        if _is_concrete(lengths) and (np.any(np.asarray(arr) < 0) or np.any(np.asarray(arr) > length)):
            raise ValueError(f"{where}: lengths must lie in [0, L={length}], got {np.asarray(arr).tolist()}")
        return arr.astype(jnp.int32)


class _PagedAttentionWithCache(PagedAttention):
    """PagedAttention that creates its cache when constructed (a linen module rebuilds its nnx
    module at every ``apply``; the cache's shapes must then exist before the variables are loaded)."""

    def __init__(self, *args, batch_size: int, max_length: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.init_cache(batch_size, max_length)


def linen_paged_attention(num_heads: int, in_features: int, *, batch_size: int, max_length: int, **kwargs):
    """:class:`PagedAttention` as a ``flax.linen`` module, its cache in the ``"cache"`` collection
    (as linen's ``MultiHeadDotProductAttention`` keeps its decode cache), through
    ``flax.nnx.bridge.ToLinen``.

    Usage::

        attn = jax_tq.nn.linen_paged_attention(8, 512, num_kv_heads=2, batch_size=4, max_length=2048)
        variables = attn.init(key, prompt, decode=False)          # params and an empty cache
        out, mutated = attn.apply(variables, prompt, decode=False, lengths=lens, mutable=["cache"])
        variables = {**variables, **mutated}
        step = jax.jit(lambda params, cache, x: attn.apply({"params": params, "cache": cache}, x,
                                                           decode=True, mutable=["cache"]), donate_argnums=1)
        out, mutated = step(variables["params"], variables["cache"], token)   # the cache updated in place

    Args:
      num_heads, in_features, kwargs: as :class:`PagedAttention` (``rngs`` comes from linen's
        ``init`` / ``apply`` rngs).
      batch_size, max_length: the cache's rows and tokens per row (:meth:`PagedAttention.init_cache`),
        fixed for the module.
    Returns:
      A ``flax.nnx.bridge.ToLinen`` module whose ``__call__`` takes ``PagedAttention.__call__``'s
      arguments (``inputs_q``, ``decode=``, ``lengths=``). Variables: ``"params"`` (the projections,
      named as :class:`PagedAttention`'s) and ``"cache"`` (``cache``: the
      :class:`jax_tq.PagedKVCache`; ``block_tables``; ``lengths``). ``init`` returns the cache
      before the call it runs (flax's ToLinen keeps the variables as initialised): empty, lengths
      0; the prefill ``apply`` above fills it.
    Raises:
      As :class:`PagedAttention` and :meth:`PagedAttention.init_cache`, when the module is first
      initialised.
    """
    from flax.nnx import bridge
    return bridge.ToLinen(_PagedAttentionWithCache, args=(num_heads, in_features),
                          kwargs=dict(kwargs, batch_size=batch_size, max_length=max_length))


def _qk_norm(kind, head_dim, epsilon, dtype, param_dtype, rngs):
    if kind == "rms":
        return nnx.RMSNorm(head_dim, epsilon=epsilon, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    return nnx.LayerNorm(head_dim, epsilon=epsilon, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)


def _full_message(lens, max_length):
    rows = np.flatnonzero(lens >= max_length).tolist()
    return (f"jax_tq.nn.PagedAttention: decode step into full rows {rows}: the cache holds max_length={max_length} "
            f"tokens per row (init_cache(batch_size, max_length) with a larger max_length)")


def _raise_if_full(lens, max_length):
    lens = np.asarray(lens)
    if np.any(lens >= max_length):
        raise ValueError(_full_message(lens, max_length))


def _positive(x, name, where):
    if not _is_int(x) or x < 1:
        raise ValueError(f"{where}: {name} must be a positive int, got {x!r}")
    return int(x)
