"""Batches of different sequences through a model and its paged caches: :func:`generate` (prompts of
different lengths, greedy or sampled, per-sequence stop tokens) and :func:`batch_log_likelihoods`
(next-token log-likelihoods of several sequences in one forward). Pages come from a
:class:`jax_tq.PageAllocator`."""
from __future__ import annotations

import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jax_tq as tq

from .checks import check_token_ids, static_int
from .evaluate import CacheConfig, config_caches, parse_cache_config, token_log_likelihoods
from .llama import Llama, make_prefill
from .sampling import _check_sampling, make_sampling_loop, sample_tokens, stop_token_array
from .paging import CacheRows, init_caches

__all__ = ["batch_log_likelihoods", "generate"]


def _sequences(seqs, vocab_size: int, min_len: int, name: str, where: str) -> list[np.ndarray]:
    """``seqs`` (a non-empty list of 1-D integer id sequences, each of >= ``min_len`` ids in
    ``[0, vocab_size)``) as int32 arrays, or TypeError / ValueError naming ``name[i]``."""
    if isinstance(seqs, (str, bytes, np.ndarray)) or not isinstance(seqs, Sequence):
        raise TypeError(f"{where}: {name} must be a list of token-id lists (one per sequence), got "
                        f"{type(seqs).__name__}")
    if not len(seqs):
        raise ValueError(f"{where}: {name} is empty (need at least one sequence)")
    out = []
    for i, s in enumerate(seqs):
        if isinstance(s, (str, bytes)):
            raise TypeError(f"{where}: {name}[{i}] must be token ids, got a string")
        ids = np.asarray(s)
        if ids.ndim != 1 or ids.shape[0] < min_len:
            raise ValueError(f"{where}: {name}[{i}] must be a 1-D list of >= {min_len} token id(s), got shape "
                             f"{ids.shape}")
        check_token_ids(ids, vocab_size, f"{where}: {name}[{i}]")
        out.append(ids.astype(np.int32))
    return out


def generate(model: Llama, prompts, max_new_tokens: int = 32, cache_config="k4v4", *, temperature: float = 0.0,
             top_k: int | None = None, seed: int = 0, stop_tokens=(), uncompressed_dtype=jnp.bfloat16) -> dict:
    """Generate from a batch of different prompts: one prefill for all of them, then one jitted
    decoding loop in which each sequence stops on its own.

    The prompts, padded to the longest, go through :func:`jax_tq.models.llama.make_prefill` (exact
    attention over each prompt's own K / V, written into the caches; ``prompt_lens`` per prompt);
    the first new token of each is sampled from its logits. The rest come from one call of
    :func:`jax_tq.models.llama.make_sampling_loop`: each step samples every active sequence's next
    token; a sequence that produced one of ``stop_tokens`` goes inactive (nothing more is written
    for it) and the loop ends when none is active or after ``max_new_tokens - 1`` steps. Sequence
    ``b`` gets the pages of its ``len(prompts[b]) + max_new_tokens - 1`` written tokens from a
    :class:`jax_tq.PageAllocator` over a pool of exactly those pages (block-table entries past them
    are -1); with a window it uses window id ``b``.

    Sampling: ``temperature`` 0 is greedy (argmax; ``seed`` unused); above 0, tokens are drawn from
    ``softmax(logits / temperature)``, restricted to the ``top_k`` largest logits when given, with
    ``jax.random`` keys from ``seed`` (the same seed, prompts and settings give the same tokens).

    Args:
      model: :class:`jax_tq.models.Llama`.
      prompts: list of prompts, each a non-empty list (or 1-D array) of token ids.
      max_new_tokens: an int >= 1, tokens generated per prompt at most.
      cache_config: a compressed cache spec (:func:`jax_tq.models.parse_cache_config`: a preset's
        name, by default ``"k4v4"``; ``(k, v)`` for the plain codecs; a
        :class:`jax_tq.models.CacheConfig`), or None / ``"none"``: uncompressed pages of
        ``uncompressed_dtype``, 16 tokens each.
      temperature: a number >= 0; top_k: None or an int in ``[1, vocab_size]`` (1: greedy).
      seed: an int, the ``jax.random.PRNGKey`` seed.
      stop_tokens: a sequence of token ids (e.g. ``(eos_id,)``); a sequence stops after the first.
      uncompressed_dtype: dtype of the uncompressed cache's pages (float32, bfloat16, float16).
    Returns:
      dict: ``ids`` (list of per-prompt lists of generated ids, prompt excluded, ending with the
      stop token where one came), ``stopped`` (list of bools: the sequence produced a stop token),
      ``all_ids`` (int32 ``[num_prompts, max_new_tokens]``, -1 after a sequence stopped),
      ``compile_s`` (compiling the prefill and sampling once, on a copy of the caches),
      ``prefill_s`` (the prefill's call until the first new tokens are ready: time to first
      token), ``loop_compile_s`` (compiling the loop and running it once on a copy of the caches),
      ``decode_steps`` (``max_new_tokens - 1``, the loop's steps at most), ``decode_s`` (the loop's
      call until its tokens are ready), ``tokens_per_s`` (tokens the loop generated / ``decode_s``;
      NaN when it generated none).
    Raises:
      TypeError: ``prompts`` not a list of id lists, non-integer ids, ``max_new_tokens`` or ``seed``
        not an int, ``temperature`` not a number, ``top_k`` not an int, ``stop_tokens`` not a
        sequence of ids.
      ValueError: an empty prompt list or prompt, ids or stop tokens outside ``[0, vocab_size)``,
        ``max_new_tokens < 1``, a negative or non-finite ``temperature``, ``top_k`` outside
        ``[1, vocab_size]``, an unparseable ``cache_config``.
      TypeError / ValueError: from :func:`jax_tq.models.init_caches` and the jax_tq ops.
    """
    where = "generate"
    vocab = model.config.vocab_size
    seqs = _sequences(prompts, vocab, 1, "prompts", where)
    max_new_tokens = static_int(max_new_tokens, "max_new_tokens", where, 1)
    temperature, top_k = _check_sampling(temperature, top_k, vocab, where)
    seed = static_int(seed, "seed", where, 0)
    stop = stop_token_array(stop_tokens, vocab, where)
    cfg = parse_cache_config(cache_config)
    num = len(seqs)
    lens = np.array([len(s) for s in seqs], np.int32)
    page_size = (cfg or CacheConfig()).page_size
    written = lens + max_new_tokens - 1  # the last new token is returned, never written
    alloc = tq.PageAllocator(int(sum(-(-int(n) // page_size) for n in written)), page_size,
                             -(-int(written.max()) // page_size))
    for b, n in enumerate(written):
        alloc.allocate(b, int(n))
    tables = alloc.block_tables(range(num))
    if cfg is None:
        caches = init_caches(model.config, None, None, alloc.num_pages, page_size, dtype=uncompressed_dtype)
    else:
        caches = config_caches(model.config, cfg, alloc.num_pages, num_windows=num)
    prompt_ids = np.zeros((num, int(lens.max())), np.int32)  # padding: id 0, never attended to or written
    for b, s in enumerate(seqs):
        prompt_ids[b, :len(s)] = s
    key_first, key_loop = jax.random.split(jax.random.PRNGKey(seed))
    prefill = make_prefill(model)

    t0 = time.perf_counter()
    spare = jax.tree_util.tree_map(jnp.copy, caches)  # donated to the compiling call
    sample_tokens(prefill(spare, prompt_ids, lens, tables)[0], key_first, temperature, top_k).block_until_ready()
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    logits, caches = prefill(caches, prompt_ids, lens, tables)
    first = sample_tokens(logits, key_first, temperature, top_k)
    first.block_until_ready()
    prefill_s = time.perf_counter() - t0

    first = np.asarray(first)
    all_ids = np.full((num, max_new_tokens), -1, np.int32)
    all_ids[:, 0] = first
    steps = max_new_tokens - 1
    active = ~np.isin(first, stop)
    loop_compile_s = decode_s = 0.0
    generated = 0
    if steps and active.any():
        loop = make_sampling_loop(model)
        seq_lens = np.where(active, lens + 1, 0).astype(np.int32)
        kwargs = dict(temperature=temperature, top_k=top_k, stop_tokens=tuple(int(t) for t in stop))
        t0 = time.perf_counter()
        spare = jax.tree_util.tree_map(jnp.copy, caches)
        loop(spare, first, lens, tables, seq_lens, steps, key_loop, **kwargs)[0].block_until_ready()
        loop_compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        tokens, caches = loop(caches, first, lens, tables, seq_lens, steps, key_loop, **kwargs)
        tokens.block_until_ready()
        decode_s = time.perf_counter() - t0
        all_ids[:, 1:] = np.asarray(tokens)
        generated = int((all_ids[:, 1:] >= 0).sum())
    ids, stopped = [], []
    for row in all_ids:
        out = [int(t) for t in row if t >= 0]
        hits = [i for i, t in enumerate(out) if t in set(stop.tolist())]
        stopped.append(bool(hits))
        ids.append(out[:hits[0] + 1] if hits else out)
    return {"ids": ids, "stopped": stopped, "all_ids": all_ids, "compile_s": compile_s, "prefill_s": prefill_s,
            "loop_compile_s": loop_compile_s, "decode_steps": steps, "decode_s": decode_s,
            "tokens_per_s": generated / decode_s if decode_s > 0 and generated else float("nan")}


@functools.partial(jax.jit, static_argnums=(0,))
def _ragged_log_likelihoods(graphdef, state, token_ids, caches, block_tables, seq_ids, positions, query_start_loc):
    """Log p(token_ids[t + 1] | ...) for each row t of a ragged batch (rows of one sequence together)."""
    model = nnx.merge(graphdef, state)
    seq_lens = query_start_loc[1:] - query_start_loc[:-1]
    slots = tq.slot_mapping(block_tables, positions, caches[0].page_size, seq_ids)
    logits, _ = model(token_ids, positions, caches, CacheRows(slots, block_tables, seq_lens, query_start_loc))
    log_probs = jax.nn.log_softmax(logits[:-1], axis=-1)
    return jnp.take_along_axis(log_probs, token_ids[1:, None], axis=-1)[:, 0]


def batch_log_likelihoods(model: Llama, sequences, cache_config=None) -> list[np.ndarray]:
    """Next-token log-likelihoods of several sequences, :func:`jax_tq.models.token_log_likelihoods`
    of each, in one forward where the cache keeps no window.

    Without a window the sequences go through one ragged forward (jit-compiled per total length and
    count): each gets the pages of its tokens from a :class:`jax_tq.PageAllocator`, every layer writes
    all tokens with :func:`jax_tq.write_cache` and attends with one :func:`jax_tq.paged_prefill`
    (causal, each sequence over its own compressed tokens; uncompressed: a temporary float32 cache,
    as :func:`jax_tq.models.forward_logits`). Caches with a window (the presets) need each
    position's own view of the window, which :func:`jax_tq.models.forward_compressed` builds for
    one sequence at a time: those sequences go through :func:`token_log_likelihoods` one by one.

    Args:
      model: :class:`jax_tq.models.Llama`.
      sequences: list of token-id lists (or 1-D arrays), each of >= 2 ids.
      cache_config: None (uncompressed) or a compressed cache spec
        (:func:`jax_tq.models.parse_cache_config`).
    Returns:
      list of float64 ``[len(sequences[i]) - 1]``: ``log p(seq[t] | seq[:t])`` for t >= 1 (natural log).
    Raises:
      TypeError: ``sequences`` not a list of id lists, non-integer ids.
      ValueError: an empty list, a sequence of fewer than 2 ids, ids outside ``[0, vocab_size)``,
        an unparseable ``cache_config``.
      TypeError / ValueError: from :func:`jax_tq.models.init_caches` and the jax_tq ops.
    """
    where = "batch_log_likelihoods"
    seqs = _sequences(sequences, model.config.vocab_size, 2, "sequences", where)
    cfg = parse_cache_config(cache_config)
    if cfg is not None and cfg.window:
        return [token_log_likelihoods(model, s, cfg) for s in seqs]
    page_size = 16 if cfg is None else cfg.page_size
    lens = [len(s) for s in seqs]
    alloc = tq.PageAllocator(sum(-(-n // page_size) for n in lens), page_size, -(-max(lens) // page_size))
    for b, n in enumerate(lens):
        alloc.allocate(b, n)
    if cfg is None:
        caches = init_caches(model.config, None, None, alloc.num_pages, page_size, dtype=jnp.float32)
    else:
        caches = config_caches(model.config, cfg, alloc.num_pages)
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    token_ids = np.concatenate(seqs).astype(np.int32)
    seq_ids = np.repeat(np.arange(len(seqs), dtype=np.int32), lens)
    positions = np.concatenate([np.arange(n, dtype=np.int32) for n in lens])
    graphdef, state = nnx.split(model)
    ll = np.asarray(_ragged_log_likelihoods(graphdef, state, token_ids, caches, alloc.block_tables(range(len(seqs))),
                                            seq_ids, positions, starts), np.float64)
    # Row t predicts row t + 1; the last row of a sequence would predict the next sequence's first.
    return [ll[starts[b]:starts[b + 1] - 1] for b in range(len(seqs))]
