"""Sampled decoding for :mod:`jax_tq.models`: :func:`sample_tokens` (greedy, temperature, top-k) and
:func:`make_sampling_loop`, :func:`jax_tq.models.llama.make_decode_loop` with a sampler, a PRNG key
in the carry and per-row stop tokens."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import checks
from .llama import Llama, _decode

__all__ = ["make_sampling_loop", "sample_tokens", "stop_token_array"]


def _check_sampling(temperature, top_k, vocab_size: int, where: str):
    """``(temperature as a float, top_k as an int or None)``: TypeError for a non-number temperature or
    a non-int top_k, ValueError for a temperature that is negative or not finite, or top_k outside
    ``[1, vocab_size]``."""
    if isinstance(temperature, (bool, np.bool_)) or not isinstance(temperature, (int, float, np.integer,
                                                                                 np.floating)):
        raise TypeError(f"{where}: temperature must be a Python number, got {temperature!r}")
    if not np.isfinite(temperature) or temperature < 0:
        raise ValueError(f"{where}: temperature must be finite and >= 0 (0: greedy), got {temperature}")
    if top_k is not None:
        top_k = checks.static_int(top_k, "top_k", where, 1)
        if top_k > vocab_size:
            raise ValueError(f"{where}: top_k must be in [1, vocab_size={vocab_size}], got {top_k}")
    return float(temperature), top_k


def stop_token_array(stop_tokens, vocab_size: int, where: str) -> np.ndarray:
    """``stop_tokens`` (a sequence of token ids, possibly empty) as int32 ``[n]``: TypeError for a
    single int or a string (not a sequence of ids) or non-integer ids, ValueError for ids outside
    ``[0, vocab_size)``."""
    if isinstance(stop_tokens, (str, bytes, int, np.integer)) or not hasattr(stop_tokens, "__iter__"):
        raise TypeError(f"{where}: stop_tokens must be a sequence of token ids (e.g. (eos_id,)), got {stop_tokens!r}")
    stop = list(stop_tokens)
    if not stop:
        return np.zeros(0, np.int32)
    ids = np.asarray(stop)
    if ids.ndim != 1:
        raise TypeError(f"{where}: stop_tokens must be a flat sequence of token ids, got {stop_tokens!r}")
    checks.check_token_ids(ids, vocab_size, f"{where}: stop_tokens")
    return ids.astype(np.int32)


def _sample(logits, key, temperature: float, top_k):
    if temperature < np.finfo(np.float32).tiny:  # 0, or a float32 subnormal that may flush to 0
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32)
    # shifted so that the largest is 0: a tiny temperature sends the others to -inf, never the largest
    scaled = (logits - jnp.max(logits, axis=-1, keepdims=True)) / jnp.float32(temperature)
    if top_k is not None and top_k < scaled.shape[-1]:
        kth = jax.lax.top_k(scaled, top_k)[0][..., -1:]
        scaled = jnp.where(scaled >= kth, scaled, -jnp.inf)
    return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)


_sample_jit = jax.jit(_sample, static_argnums=(2, 3))


def sample_tokens(logits, key, temperature: float = 0.0, top_k: int | None = None) -> jax.Array:
    """One token per row of ``logits``: greedy (argmax) at ``temperature`` 0 (and below float32's
    smallest normal, ~1.2e-38), else a draw from ``softmax(logits / temperature)`` restricted to the
    ``top_k`` largest logits (ties with the k-th kept) when ``top_k`` is given.

    Args:
      logits: float ``[..., vocab]``.
      key: a ``jax.random`` key (unused at temperature 0); one draw per row from it.
      temperature: a Python number >= 0 (static: one compilation per value).
      top_k: None (the whole vocabulary) or a Python int in ``[1, vocab]``; 1 is greedy.
    Returns:
      int32 ``[...]`` token ids.
    Raises:
      TypeError: temperature not a number, top_k not an int.
      ValueError: logits without a vocabulary axis (0-d, or vocab 0), temperature negative or not
        finite, top_k outside ``[1, vocab]``.
    Source: softmax sampling with a temperature, truncated to the top k logits (top-k sampling:
      Fan, Lewis and Dauphin, "Hierarchical Neural Story Generation", arXiv 1805.04833).
    """
    if np.ndim(logits) < 1 or np.shape(logits)[-1] < 1:
        raise ValueError(f"sample_tokens: logits must be float [..., vocab] with vocab >= 1, got shape "
                         f"{tuple(np.shape(logits))}")
    temperature, top_k = _check_sampling(temperature, top_k, int(np.shape(logits)[-1]), "sample_tokens")
    return _sample_jit(logits, key, temperature, top_k)


@functools.partial(jax.jit, static_argnums=(0, 7, 9, 10), donate_argnums=(2,))
def _sampling_loop_pure(graphdef, state, caches, token, position, block_tables, seq_lens, num_steps, key,
                        temperature, top_k, stop_tokens, window_ids):
    model = nnx.merge(graphdef, state)
    tokens = jnp.full((token.shape[0], num_steps), -1, jnp.int32)

    def cond(carry):
        i, _, _, _, seq_lens, _, _ = carry
        return (i < num_steps) & jnp.any(seq_lens > 0)

    def body(carry):
        i, caches, token, position, seq_lens, key, tokens = carry
        logits, caches = _decode(model, caches, token, position, block_tables, seq_lens, window_ids)
        key, sub = jax.random.split(key)
        active = seq_lens > 0
        nxt = jnp.where(active, _sample(logits, sub, temperature, top_k), -1)
        tokens = jax.lax.dynamic_update_index_in_dim(tokens, nxt, i, axis=1)
        stopped = active & jnp.isin(nxt, stop_tokens)
        step = active.astype(jnp.int32)
        seq_lens = jnp.where(stopped, 0, seq_lens + step)  # a stopped row writes nothing more
        return i + 1, caches, jnp.maximum(nxt, 0), position + step, seq_lens, key, tokens

    carry = (jnp.int32(0), caches, token, position, seq_lens, key, tokens)
    _, caches, _, _, _, _, tokens = jax.lax.while_loop(cond, body, carry)
    return tokens, caches


def make_sampling_loop(model: Llama):
    """Return ``loop(caches, token, position, block_tables, seq_lens, num_steps, key, *, temperature=0.0,
    top_k=None, stop_tokens=(), window_ids=None) -> (tokens, caches)``: up to ``num_steps`` decoding steps in one
    jitted call (a ``lax.while_loop``), each row's next token from :func:`sample_tokens`, rows
    stopping on their own.

    :func:`make_decode_loop` with three changes: the next token is sampled (greedy at temperature
    0; a ``jax.random`` key in the carry, split once per step, so a given key reproduces the
    tokens); a row that samples one of ``stop_tokens`` goes inactive (``seq_lens`` 0: its stop token
    is not written, nothing more is) and its later tokens are -1; the loop ends early once no row is
    active. Rows with ``seq_lens`` 0 on entry are inactive throughout (tokens all -1). Compiled
    once per ``num_steps``, ``temperature``, ``top_k`` and number of stop tokens. Later in-place
    changes to ``model`` are not seen by ``loop``.

    Returns:
      the function ``loop``: arguments as :func:`decode_step`'s (caches donated), ``num_steps`` a
      Python int >= 1, ``key`` a ``jax.random`` key, ``temperature`` / ``top_k`` as
      :func:`sample_tokens`'s, ``stop_tokens`` a sequence of token ids; returns int32
      ``tokens [S, num_steps]`` (-1 where a row was inactive) and the new caches. It raises as
      :func:`make_decode_loop`'s loop does, and as :func:`sample_tokens` for ``temperature`` /
      ``top_k``; TypeError / ValueError for stop tokens that are not integer ids in
      ``[0, vocab_size)``.
    """
    graphdef, state = nnx.split(model)
    cfg = model.config

    def loop(caches, token, position, block_tables, seq_lens, num_steps: int, key, *, temperature=0.0, top_k=None,
             stop_tokens=(), window_ids=None):
        where = "sampling loop"
        steps = checks.static_int(num_steps, "num_steps", where, 1)
        temperature, top_k = _check_sampling(temperature, top_k, cfg.vocab_size, where)
        stop = stop_token_array(stop_tokens, cfg.vocab_size, where)
        page_size, *args = checks.decode_args(caches, cfg.num_layers, cfg.vocab_size, token, position, block_tables,
                                              seq_lens, where)
        checks.check_active_positions(position, seq_lens, where, steps, args[2].shape[1] * page_size)
        checks.check_host_rows(caches, position, block_tables, seq_lens, where, steps)
        wids = checks.window_ids(window_ids, args[0].shape[0], caches, where)
        return _sampling_loop_pure(graphdef, state, list(caches), *args, steps, key, temperature, top_k,
                                   jnp.asarray(stop, jnp.int32), wids)

    return loop
