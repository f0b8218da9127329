"""Llama-architecture decoder in flax.nnx whose attention runs through jax_tq's paged KV caches.

Architecture (Touvron et al. 2023, "LLaMA: Open and Efficient Foundation Language Models"):
pre-norm blocks with RMSNorm (Zhang & Sennrich 2019), rotary position embeddings in the
Hugging Face / GPT-NeoX ``rotate_half`` layout (Su et al. 2021, "RoFormer"), grouped-query
attention (Ainslie et al. 2023, "GQA"), SwiGLU MLP (Shazeer 2020) and a tied or untied lm head.
The same module covers the Llama family as llama.cpp reads it from GGUF: Llama 3.x (RoPE frequency
factors), Qwen2 / Qwen2.5 (q/k/v biases) and Qwen3 (per-head RMSNorm of q and k), see
:class:`LlamaConfig`.

One forward path: each layer's attention is a :class:`jax_tq.nn.PagedAttention`
(:func:`llama_attention`) run through its ``attend`` with the layer's :class:`jax_tq.PagedKVCache`
and the forward's :class:`jax_tq.CacheRows`: it projects q, k, v, applies RoPE, writes k and v into
the cache and attends with :func:`jax_tq.prompt_attention` (fresh prompts),
:func:`jax_tq.paged_prefill` (a chunk of one sequence, a ragged batch) or :func:`jax_tq.paged_decode`
(one new token per sequence). The caches, one per layer (:func:`init_caches`), are compressed or
uncompressed (``preset="none"``). Entry
points, jit-compiled through ``nnx.split`` / ``nnx.merge``: :func:`forward_logits` (a chunk
through a temporary uncompressed float32 cache: the reference), :func:`forward_compressed` (a chunk
through given caches), :func:`decode_step` / :func:`make_decode_step` (one token per sequence) and
:func:`make_decode_loop` (greedy steps in one ``lax.scan``: one dispatch, where a step's ~270
parameter arrays cost milliseconds of host time per dispatch), :func:`make_sampling_loop` (the same
with :func:`sample_tokens`, a PRNG key and per-row stop tokens).
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_tq.nn_paged import PagedAttention

from . import checks
from .config import LlamaConfig
from .layers import MLP, RMSNorm, Rope, apply_rope, dense_param, rope_cos_sin
from .paging import CacheRows, chunk_rows, decode_rows, init_caches, prompt_rows, rows_cache, slot_mapping_for

__all__ = [
    "LlamaConfig", "RMSNorm", "Rope", "llama_attention", "MLP", "Block", "Llama", "CacheRows", "rope_cos_sin",
    "apply_rope",
    "init_caches", "slot_mapping_for", "chunk_rows", "decode_rows", "forward_logits", "forward_compressed",
    "decode_step", "make_decode_step", "make_decode_loop", "make_prefill", "prompt_rows",
]

def llama_attention(config: LlamaConfig, *, dtype=jnp.float32, rngs: nnx.Rngs) -> PagedAttention:
    """A Llama-family layer's attention: a :class:`jax_tq.nn.PagedAttention` (run through its
    :meth:`~jax_tq.nn.PagedAttention.attend`, the caches passed per forward) with RoPE, optional
    q / k / v biases and optional QK norm.

    GQA: Ainslie et al. 2023; RoPE: Su et al. 2021 (:class:`Rope`). Parameters (``y = x @ W``):
    ``query.kernel [hidden, H, d]``, ``key.kernel`` / ``value.kernel [hidden, Hkv, d]``,
    ``out.kernel [H, d, hidden]``; query head ``h`` uses KV head ``h // (H // Hkv)`` (as
    :func:`jax_tq.paged_decode`). With ``config.attention_bias`` (Qwen2 / Qwen2.5): biases on
    query / key / value (none on out). With ``config.qk_norm`` (Qwen3, HF ``modeling_qwen3.py``):
    ``query_ln`` / ``key_ln``, RMSNorm over each head's ``d`` features of q and k before RoPE.

    Args:
      config: :class:`LlamaConfig` (``hidden_size``, ``num_heads`` = H, ``num_kv_heads`` = Hkv,
        ``head_dim`` = d, ``rope_theta``, ``rope_freq_factors``, ``attention_bias``, ``qk_norm``,
        ``rms_norm_eps``).
      dtype: parameter dtype (the projections compute in it).
      rngs: ``nnx.Rngs`` for the random weight initialisation (truncated normal of variance
        ``1 / n_in``; biases 0, norms 1).
    """
    c = config
    factors = None if c.rope_freq_factors is None else tuple(float(f) for f in c.rope_freq_factors)
    # preset "none": the module never builds a cache of its own (attend gets the layer's cache)
    return PagedAttention(c.num_heads, c.hidden_size, c.num_heads * c.head_dim, c.hidden_size, c.num_kv_heads,
                          param_dtype=dtype, use_bias=c.attention_bias, out_bias=False,
                          normalize_qk="rms" if c.qk_norm else False, qk_norm_epsilon=c.rms_norm_eps,
                          kernel_init=jax.nn.initializers.variance_scaling(1.0, "fan_in", "normal"),
                          rope=Rope(c.head_dim, c.rope_theta, factors), preset="none", rngs=rngs)


class Block(nnx.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    Args:
      config: :class:`LlamaConfig`.
      dtype: parameter dtype.
      rngs: ``nnx.Rngs`` for the random weight initialisation.
    """

    def __init__(self, config: LlamaConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.attn = llama_attention(config, dtype=dtype, rngs=rngs)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, cache, rows: CacheRows):
        """``(x [T, hidden], new cache)`` of float ``x [T, hidden]`` at int32 ``positions [T]`` (RoPE)
        through this layer's :class:`jax_tq.PagedKVCache` ``cache`` as ``rows`` say
        (:meth:`jax_tq.nn.PagedAttention.attend`)."""
        h, cache = self.attn.attend(self.attn_norm(x), positions, cache, rows)
        x = x + h
        return x + self.mlp(self.ffn_norm(x)), cache


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
            self.lm_head = dense_param(rngs, config.hidden_size, config.vocab_size, dtype)

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
            _put_attention(blk.attn, p, put)
            for name in ("w_gate", "w_up", "w_down"):
                setattr(blk.mlp, name, nnx.Param(put(getattr(blk.mlp, name), p[name])))
        return model

    def logits(self, h: jax.Array) -> jax.Array:
        """Final norm + lm head (the tied ``embed.T`` when ``lm_head`` is None) of hidden states
        ``h [..., hidden]``: float32 logits ``[..., vocab]``."""
        h = self.final_norm(h)
        w = self.embed[...].T if self.lm_head is None else self.lm_head[...]
        return (h @ w).astype(jnp.float32)

    def hidden(self, token_ids, positions, caches, rows: CacheRows):
        """The last block's hidden states ``[T, hidden]`` of ``token_ids`` (int32 ``[T]``, RoPE
        ``positions`` int32 ``[T]``) through the per-layer ``caches`` (call inside ``jit``), and the
        new caches list."""
        x = self.embed[...][token_ids]
        new = []
        for blk, cache in zip(self.layers, caches, strict=True):
            x, cache = blk(x, positions, cache, rows)
            new.append(cache)
        return x, new

    def __call__(self, token_ids, positions, caches, rows: CacheRows):
        """Forward of ``token_ids`` (int32 ``[T]``, RoPE ``positions`` int32 ``[T]``) through the
        per-layer ``caches`` (call inside ``jit``): ``(logits float32 [T, vocab], new caches list)``."""
        x, new = self.hidden(token_ids, positions, caches, rows)
        return self.logits(x), new


def _put_attention(attn: PagedAttention, p: dict, put) -> None:
    """Load a layer's ``load_params`` attention weights (``wq [hidden, H*d]``, ...) into ``attn``'s
    projections (``query.kernel [hidden, H, d]``, ...)."""
    heads = {"query": attn.num_heads, "key": attn.num_kv_heads, "value": attn.num_kv_heads}
    for proj, (w, b) in dict(query=("wq", "bq"), key=("wk", "bk"), value=("wv", "bv")).items():
        layer = getattr(attn, proj)
        layer.kernel = nnx.Param(put(layer.kernel, np.reshape(p[w], (np.shape(p[w])[0], heads[proj], -1))))
        if layer.bias is not None:
            layer.bias = nnx.Param(put(layer.bias, np.reshape(p[b], (heads[proj], -1))))
    attn.out.kernel = nnx.Param(put(attn.out.kernel, np.reshape(p["wo"], (attn.num_heads, -1, np.shape(p["wo"])[1]))))
    for norm, name in ((attn.query_ln, "q_norm"), (attn.key_ln, "k_norm")):
        if norm is not None:
            norm.scale = nnx.Param(put(norm.scale, p[name]))


#: Page size of forward_logits' temporary cache.
_CHUNK_PAGE_SIZE = 16


@functools.partial(jax.jit, static_argnums=(0, 3))
def _logits_pure(graphdef, state, token_ids, start_pos):
    model = nnx.merge(graphdef, state)
    num_pages = -(-token_ids.shape[0] // _CHUNK_PAGE_SIZE)
    caches = init_caches(model.config, None, None, num_pages, _CHUNK_PAGE_SIZE)
    return _chunk(model, token_ids, caches, jnp.arange(num_pages, dtype=jnp.int32), 0, start_pos)[0]


def _chunk(model, token_ids, caches, block_table, cache_start, rope_start, window_id=0):
    """The chunk's tokens at cache positions from ``cache_start``, RoPE positions from ``rope_start``."""
    rows = chunk_rows(rows_cache(caches), block_table, cache_start, token_ids.shape[0], window_id)
    return model(token_ids, rope_start + jnp.arange(token_ids.shape[0], dtype=jnp.int32), caches, rows)


def forward_logits(model: Llama, token_ids, start_pos: int = 0) -> jax.Array:
    """Uncompressed causal forward of one chunk (jit-compiled per length): the chunk's K / V go
    into a temporary float32 cache of its own (``preset="none"``), through the same path as
    :func:`forward_compressed`.

    Args:
      model: :class:`Llama`; token_ids: int ``[T]`` token ids (no batch axis).
      start_pos: RoPE position of the first token (the chunk attends to itself only).
    Returns:
      float32 logits ``[T, vocab]``; row ``t`` predicts token ``t + 1``.
    Raises:
      TypeError: token ids not integers; ``start_pos`` not an int.
      ValueError: token ids outside ``[0, vocab_size)`` or not of shape ``[T >= 1]``; ``start_pos < 0``.
    """
    token_ids = checks.token_vector(token_ids, model.config.vocab_size, "forward_logits")
    start_pos = checks.static_int(start_pos, "start_pos", "forward_logits", 0)
    graphdef, state = nnx.split(model)
    return _logits_pure(graphdef, state, token_ids, start_pos)


@functools.partial(jax.jit, static_argnums=(0, 5), donate_argnums=(3,))
def _chunk_pure(graphdef, state, token_ids, caches, block_table, start_pos, window_id):
    return _chunk(nnx.merge(graphdef, state), token_ids, caches, block_table, start_pos, start_pos, window_id)


def forward_compressed(model: Llama, token_ids, caches: Sequence, block_table, start_pos: int = 0,
                       window_id: int = 0):
    """A chunk of one sequence through the given paged caches (jit-compiled, caches donated):
    evaluation, or a prefill before decoding.

    Token ``t`` (position ``start_pos + t``) is written to its slot of ``block_table`` (and, with a
    window, the last ``window`` tokens to the window ``window_id``); then every row attends, with
    :func:`jax_tq.paged_prefill`, to the cached K / V of its position and all earlier ones
    (including tokens cached before ``start_pos``). With a window each row reads its own last
    ``window`` positions exactly, as decoding would (:class:`CacheRows`, ``view_start``; memory
    ``[T, num_kv_heads, window, head_dim]`` per layer).

    Args:
      model: :class:`Llama`; token_ids: int ``[T]``.
      caches: list of per-layer :class:`jax_tq.PagedKVCache`, compressed or not (donated).
      block_table: int ``[max_pages]`` physical pages of this sequence; must cover ``start_pos + T`` tokens.
      start_pos: position of ``token_ids[0]`` (tokens before it must already be cached).
      window_id: the sequence's window id (caches with a window).
    Returns:
      ``(logits float32 [T, vocab], new_caches)``.
    Raises:
      TypeError: token ids, ``block_table`` or ``window_id`` not integers; ``start_pos`` not an int;
        a cache that is not a :class:`jax_tq.PagedKVCache`.
      ValueError: ``len(caches) != num_layers``; layers of different page sizes or page counts;
        ``token_ids`` not ``[T >= 1]`` or outside ``[0, vocab_size)``; ``block_table`` not 1-D;
        ``start_pos < 0`` or ``start_pos + T`` beyond the table's ``max_pages * page_size`` tokens;
        a concrete ``window_id`` outside the caches' window ids.
      TypeError / ValueError: from the jax_tq ops.
    """
    where = "forward_compressed"
    page_size = checks.check_caches(caches, model.config.num_layers, where)
    token_ids = checks.token_vector(token_ids, model.config.vocab_size, where)
    host_table = checks.is_host_value(block_table)
    block_table = checks.int32(block_table, "block_table", where)
    start_pos = checks.static_int(start_pos, "start_pos", where, 0)
    checks.check_chunk(block_table, start_pos, token_ids.shape[0], page_size, where)
    if host_table:
        checks.check_pages_in_pool(np.asarray(block_table)[None], [start_pos + token_ids.shape[0]], page_size,
                                   int(caches[0].num_pages), where)
    window_id = checks.int32(window_id, "window_id", where)
    checks.check_window_id(window_id, caches, where)
    graphdef, state = nnx.split(model)
    return _chunk_pure(graphdef, state, token_ids, list(caches), block_table, start_pos, window_id)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(3,))
def _prefill_pure(graphdef, state, prompt_ids, caches, block_tables, prompt_lens, window_ids):
    model = nnx.merge(graphdef, state)
    num_prompts, length = prompt_ids.shape
    rows = prompt_rows(rows_cache(caches), block_tables, prompt_lens, length, window_ids)
    positions = jnp.tile(jnp.arange(length, dtype=jnp.int32), num_prompts)
    h, caches = model.hidden(prompt_ids.reshape(-1), positions, caches, rows)
    last = jnp.arange(num_prompts) * length + jnp.clip(prompt_lens - 1, 0, length - 1)
    return model.logits(h[last]), caches


def make_prefill(model: Llama):
    """Return ``prefill(caches, prompt_ids, prompt_lens, block_tables, *, window_ids=None) -> (logits,
    caches)``: fresh prompts of a batch in one forward (time to first token), compiled once per
    shape, caches donated.

    Each layer's attention is :func:`jax_tq.prompt_attention`: exact causal attention over the
    prompt's own K / V (cuDNN's flash attention for bfloat16 / float16 models on the GPU) while the
    K / V go into the caches' pages (and windows, prompt ``b`` using window id ``window_ids[b]``,
    default ``b``) for the decode steps that follow. :func:`forward_compressed` instead reads every
    token back from the caches (what the quality tables measure). Later in-place changes to
    ``model`` are not seen.

    The returned function takes the per-layer caches (donated), int ``prompt_ids [S, L]`` (padded
    to L), int ``prompt_lens [S]`` in ``[1, L]``, int ``block_tables [S, max_pages]`` covering
    each prompt and ``window_ids`` (None or int ``[S]``: :func:`decode_step`'s); it returns float32
    ``logits [S, vocab]`` of each prompt's last token and the caches. It raises TypeError for
    non-integer ids, lengths, tables or window ids, or a cache that is not a
    :class:`jax_tq.PagedKVCache`; ValueError for shapes other than these, ids outside
    ``[0, vocab_size)``, and (host values) a length outside ``[1, L]``, a prompt longer than its
    table's ``max_pages * page_size`` tokens, a table entry covering it outside the pool, or a
    window id outside the caches' window ids.
    """
    graphdef, state = nnx.split(model)
    cfg = model.config

    def prefill(caches, prompt_ids, prompt_lens, block_tables, *, window_ids=None):
        ids, lens, tables = checks.prompt_args(caches, cfg.num_layers, cfg.vocab_size, prompt_ids, prompt_lens,
                                               block_tables, "prefill")
        wids = checks.window_ids(window_ids, ids.shape[0], caches, "prefill")
        return _prefill_pure(graphdef, state, ids, list(caches), tables, lens, wids)

    return prefill


def _decode(model, caches, token, position, block_tables, seq_lens, window_ids=None):
    rows = decode_rows(rows_cache(caches), block_tables, position, seq_lens, window_ids)
    return model(token, position, caches, rows)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _decode_pure(graphdef, state, caches, token, position, block_tables, seq_lens, window_ids):
    return _decode(nnx.merge(graphdef, state), caches, token, position, block_tables, seq_lens, window_ids)


def decode_step(model: Llama, caches: Sequence, token, position, block_tables, seq_lens, *, window_ids=None):
    """One decoding step for a batch of sequences (jit-compiled; caches donated).

    Args:
      model: :class:`Llama`; caches: list of per-layer :class:`jax_tq.PagedKVCache` (donated).
      token: int ``[S]`` the new token of each sequence.
      position: int ``[S]`` its position (number of tokens already cached for the sequence).
      block_tables: int ``[S, max_pages]``.
      seq_lens: int ``[S]`` sequence length INCLUDING the new token (normally ``position + 1``);
        0 marks an inactive row (nothing written, zero attention output). A position at or beyond
        ``max_pages * page_size`` is not written; the attention then sees the cached tokens only.
      window_ids: None (row ``s`` uses window id ``s``) or int ``[S]``, each row's window id in caches
        with a window: shard-local ids where the caches' pages and windows are split over a mesh's
        data axis (``jax_tq.cache_partition_specs(page_axis="data")``; see
        :func:`jax_tq.models.greedy_generate`'s ``mesh``).
    Returns:
      ``(logits float32 [S, vocab], new_caches)``.
    Raises:
      TypeError: non-integer token, position, block_tables or seq_lens; a cache that is not a
        :class:`jax_tq.PagedKVCache`.
      ValueError: ``len(caches) != num_layers``; layers of different page sizes or page counts;
        token, position or seq_lens not ``[S >= 1]``, block_tables not ``[S, max_pages >= 1]``;
        integers outside int32. For host (numpy / Python) inputs also: token ids outside
        ``[0, vocab_size)``, an active row at a negative position (device arrays are not read
        back every step: there an out-of-vocab id is clamped by the embedding lookup, and a
        negative position writes nothing).
      TypeError / ValueError: from the jax_tq ops.
    """
    return make_decode_step(model)(caches, token, position, block_tables, seq_lens, window_ids=window_ids)


def make_decode_step(model: Llama):
    """Return ``step(caches, token, position, block_tables, seq_lens, *, window_ids=None) -> (logits, caches)``:
    :func:`decode_step` with the model split once (lower Python overhead per token). Later
    in-place changes to ``model`` are not seen by ``step``."""
    graphdef, state = nnx.split(model)
    cfg = model.config

    def step(caches, token, position, block_tables, seq_lens, *, window_ids=None):
        where = "decode_step"
        _, *args = checks.decode_args(caches, cfg.num_layers, cfg.vocab_size, token, position, block_tables, seq_lens,
                                      where, token_values=checks.is_host_value(token))
        checks.check_active_positions(position, seq_lens, where)
        checks.check_host_rows(caches, position, block_tables, seq_lens, where)
        wids = checks.window_ids(window_ids, args[0].shape[0], caches, where)
        return _decode_pure(graphdef, state, list(caches), *args, wids)

    return step


@functools.partial(jax.jit, static_argnums=(0, 7), donate_argnums=(2,))
def _decode_loop_pure(graphdef, state, caches, token, position, block_tables, seq_lens, num_steps, window_ids):
    model = nnx.merge(graphdef, state)

    def body(carry, _):
        caches, token, position, seq_lens = carry
        logits, caches = _decode(model, caches, token, position, block_tables, seq_lens, window_ids)
        nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        step = (seq_lens > 0).astype(jnp.int32)
        return (caches, nxt, position + step, seq_lens + step), nxt

    (caches, _, _, _), tokens = jax.lax.scan(body, (caches, token, position, seq_lens), None, length=num_steps)
    return tokens.T, caches


def make_decode_loop(model: Llama):
    """Return ``loop(caches, token, position, block_tables, seq_lens, num_steps, *, window_ids=None) -> (tokens,
    caches)``:
    ``num_steps`` greedy decoding steps in one jitted call (compiled once per ``num_steps``).

    Step ``i`` is :func:`decode_step` with the previous step's argmax token (the given ``token``
    first), ``position + i`` and ``seq_lens + i`` for the active rows (``seq_lens > 0``). Inactive
    rows write nothing and stay at 0; their tokens are meaningless. Later in-place changes to
    ``model`` are not seen by ``loop``.

    Returns:
      the function ``loop``: arguments as :func:`decode_step`'s (caches donated) and ``num_steps``
      a Python int >= 1; returns int32 ``tokens [S, num_steps]`` and the new caches. It raises as
      :func:`decode_step` does, TypeError for a ``num_steps`` that is not an int, and ValueError
      for ``num_steps < 1``, token ids outside ``[0, vocab_size)`` or (concrete values) an active
      row whose ``position + num_steps`` exceeds its block table's ``max_pages * page_size`` tokens.
    """
    graphdef, state = nnx.split(model)
    cfg = model.config

    def loop(caches, token, position, block_tables, seq_lens, num_steps: int, *, window_ids=None):
        where = "decode loop"
        steps = checks.static_int(num_steps, "num_steps", where, 1)
        page_size, *args = checks.decode_args(caches, cfg.num_layers, cfg.vocab_size, token, position, block_tables,
                                              seq_lens, where)
        checks.check_active_positions(position, seq_lens, where, steps, args[2].shape[1] * page_size)
        checks.check_host_rows(caches, position, block_tables, seq_lens, where, steps)
        wids = checks.window_ids(window_ids, args[0].shape[0], caches, where)
        return _decode_loop_pure(graphdef, state, list(caches), *args, steps, wids)

    return loop
