"""The attention variants (sliding_window, soft_cap, sinks: jax_tq/variants.py) of paged_decode,
paged_prefill and ragged_paged_attention against a float64 oracle in numpy: every token of the cache
decoded with the reference decompression (or read from the uncompressed pages, or from the recent-token
window), then an explicit masked / capped / sinked softmax. Backends "ffi" (the CPU handlers; on a
GPU the CUDA kernels) and "xla" (the reference) on fresh random inputs; GQA everywhere; a compressed
cache, one with a window, an uncompressed one. Also: gradients in sinks, vmap, the GPU policy (a CUDA
module serves the variants of the targets it lists in variant_targets; elsewhere backend "auto"
lowers to the reference there, "ffi" refuses), argument errors."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tq as tq
from jax_tq import _ffi, backend
from oracle import random_cache, random_tables, random_window_cache, rel_err, sequence_tokens, to_f64

HEADS, KV_HEADS, HEAD_DIM, PAGE, PAGES, MAX_PAGES = 8, 2, 64, 8, 24, 5
WINDOW_IDS = np.asarray([2, 0, 1, 1], np.int32)  # a window cache's ids (3 windows)
#: Relative error against the float64 oracle: float32 inputs, float64 (CPU handler) or float32 (XLA) sums.
TOLERANCE = 3e-5
VARIANTS = {
    "sliding_window": dict(sliding_window=6),
    "soft_cap": dict(soft_cap=0.75),
    "sinks": dict(sinks=True),
    "all": dict(sliding_window=3, soft_cap=1.5, sinks=True),
    "window_one": dict(sliding_window=1),  # the query's own token only
}
KINDS = ("compressed", "window", "none")


# ----------------------------------------------------------------------------- oracle

def make_cache(rng, kind):
    if kind == "compressed":
        return random_cache(rng, num_pages=PAGES, page_size=PAGE, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, k_bits=4,
                            v_bits=3, seed=int(rng.integers(100)))
    if kind == "window":
        return random_window_cache(rng, head_dim=HEAD_DIM, num_kv_heads=KV_HEADS, page_size=PAGE, num_pages=PAGES,
                                   window=5, num_windows=3)
    cache = tq.PagedKVCache.create(num_pages=PAGES, page_size=PAGE, num_kv_heads=KV_HEADS, preset="none",
                                   head_dim=HEAD_DIM)
    pages = [jnp.asarray(rng.normal(size=cache.k_pages.shape), cache.k_pages.dtype) for _ in range(2)]
    return dataclasses.replace(cache, k_pages=pages[0], v_pages=pages[1])


def tokens_f64(cache, table, length, window_id):
    """float64 K, V [L, Hkv, d] of one sequence as the cache holds them, and valid [L]."""
    if cache.compressed:
        return sequence_tokens(cache, np.asarray(table), length, window_id)
    table = np.asarray(table)
    pages = table[np.arange(length) // PAGE]
    ok = (pages >= 0) & (pages < cache.num_pages)
    safe = np.where(ok, pages, 0)
    offsets = np.arange(length) % PAGE
    keys = to_f64(cache.k_pages)[safe, :, offsets]
    values = to_f64(cache.v_pages)[safe, :, offsets]
    return keys, values, ok


def attend_row_f64(q, keys, values, valid, position, scale, sliding_window=None, soft_cap=None, sinks=None):
    """One query row [H, d] at ``position`` over a sequence's tokens [L, Hkv, d] (valid [L]): it sees
    positions (position - sliding_window, position]; logits soft_cap * tanh(scale * s / soft_cap);
    the head's sink in the denominator. float64."""
    q = to_f64(q)
    heads, d = q.shape
    group = heads // KV_HEADS
    positions = np.arange(keys.shape[0])
    sees = valid & (positions <= position)
    if sliding_window is not None:
        sees &= positions > position - sliding_window
    out = np.zeros((heads, d))
    if position < 0 or not sees.any():
        return out
    for h in range(heads):
        logits = keys[sees, h // group] @ q[h] * scale
        if soft_cap is not None:
            logits = soft_cap * np.tanh(logits / soft_cap)
        top = logits.max() if sinks is None else max(logits.max(), float(sinks[h]))
        weights = np.exp(logits - top)
        denominator = weights.sum() + (0.0 if sinks is None else np.exp(float(sinks[h]) - top))
        out[h] = weights @ values[sees, h // group] / denominator
    return out


def variant_kwargs(rng, variant):
    """The op's keyword arguments of a VARIANTS entry (sinks: fresh random float32 [HEADS])."""
    kwargs = dict(VARIANTS[variant])
    if kwargs.pop("sinks", False):
        kwargs["sinks"] = jnp.asarray(rng.normal(size=HEADS) * 2 + 6, jnp.float32)  # near the largest logits
    return kwargs


def rows_f64(cache, tables, lens, ids, q, row_seq, row_pos, scale, **kwargs):
    """The oracle of every query row r: sequence row_seq[r] (-1: none, a zero row) at row_pos[r]."""
    out = np.zeros(q.shape)
    tokens = {}
    for r, (s, p) in enumerate(zip(row_seq, row_pos)):
        if s < 0:
            continue
        if s not in tokens:
            tokens[s] = tokens_f64(cache, tables[s], int(lens[s]), int(ids[s]))
        out[r] = attend_row_f64(q[r], *tokens[s], int(p), scale, **kwargs)
    return out


def window_ids_of(cache, num_seqs):
    return jnp.asarray(WINDOW_IDS[:num_seqs]) if cache.window else None


def backends_agree(call, want, plain_want, tolerance=TOLERANCE):
    """call() under "ffi" (the CPU handler, or a CUDA kernel on a GPU) and "xla" matches want within
    ``tolerance``; the variant changed the oracle by far more."""
    assert rel_err(plain_want, want) > max(1e-2, 5 * tolerance), "the variant does not change this case enough"
    outs = {}
    for name in ("ffi", "xla"):
        with tq.use_backend(name):
            outs[name] = np.asarray(call(), np.float32)
        assert rel_err(outs[name], want) < tolerance, name
    assert rel_err(outs["ffi"], outs["xla"]) < 2 * tolerance


# ----------------------------------------------------------------------------- decode, prefill, ragged

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_decode_variants_match_float64_oracle(rng, kind, variant):
    cache = make_cache(rng, kind)
    lens = np.asarray([29, 5, 0, 17], np.int32)
    tables = random_tables(rng, lens, PAGE, PAGES, max_pages=MAX_PAGES)
    ids = window_ids_of(cache, 4)
    q = jnp.asarray(rng.normal(size=(4, HEADS, HEAD_DIM)) * 3, jnp.float32)
    kwargs = variant_kwargs(rng, variant)
    scale = 1 / 8
    oracle_ids = WINDOW_IDS if cache.window else np.zeros(4, np.int32)
    f64 = dict(kwargs, sinks=None if "sinks" not in kwargs else np.asarray(kwargs["sinks"]))
    want = rows_f64(cache, np.asarray(tables), lens, oracle_ids, to_f64(q), range(4), lens - 1, scale, **f64)
    plain = rows_f64(cache, np.asarray(tables), lens, oracle_ids, to_f64(q), range(4), lens - 1, scale)
    sinks = kwargs.pop("sinks", None)
    num_splits = 1 if variant in ("sinks", "window_one") else 2  # one split: the sinks' only combine on CUDA

    def call():
        fn = jax.jit(lambda q, sinks: tq.paged_decode(q, cache, tables, jnp.asarray(lens), window_ids=ids,
                                                      num_splits=num_splits, sinks=sinks, **kwargs))
        return fn(q, sinks)

    backends_agree(call, want, plain)


@pytest.mark.parametrize("head_dim", (64, 128))
def test_decode_variants_with_the_fused_hadamard_rotation(rng, head_dim):
    """Hadamard codecs of head_dim 64 / 128: the CPU handler rotates q and the output itself (plan_decode)."""
    cache = random_cache(rng, num_pages=PAGES, page_size=PAGE, num_kv_heads=KV_HEADS, head_dim=head_dim, k_bits=3,
                         v_bits=4, seed=3, rotation="hadamard")
    lens = np.asarray([29, 17], np.int32)
    tables = random_tables(rng, lens, PAGE, PAGES, max_pages=MAX_PAGES)
    q = jnp.asarray(rng.normal(size=(2, HEADS, head_dim)) * 3, jnp.float32)
    with tq.use_backend("ffi"):
        assert tq.plan_decode(q, cache, tables)["fused_rotation"]
    kwargs = variant_kwargs(rng, "all")
    f64 = dict(kwargs, sinks=np.asarray(kwargs["sinks"]))
    scale = head_dim ** -0.5
    want = rows_f64(cache, np.asarray(tables), lens, np.zeros(2, np.int32), to_f64(q), range(2), lens - 1, scale,
                    **f64)
    plain = rows_f64(cache, np.asarray(tables), lens, np.zeros(2, np.int32), to_f64(q), range(2), lens - 1, scale)
    backends_agree(lambda: tq.paged_decode(q, cache, tables, jnp.asarray(lens), **kwargs), want, plain)


def prefill_layout():
    """Three sequences: a chunk of 6 rows after 23 cached tokens, a whole prompt of 11, one decode-like
    row after 16; then 2 padding rows. (lens, query_start_loc, row_seq, row_pos)."""
    lens = np.asarray([29, 11, 17], np.int32)
    starts = np.asarray([0, 6, 17, 18], np.int32)
    row_seq = np.asarray([0] * 6 + [1] * 11 + [2] + [-1, -1])
    row_pos = np.asarray([23 + i for i in range(6)] + list(range(11)) + [16, 0, 0])
    return lens, starts, row_seq, row_pos


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_variants_match_float64_oracle(rng, kind, variant):
    cache = make_cache(rng, kind)
    lens, starts, row_seq, row_pos = prefill_layout()
    tables = random_tables(rng, lens, PAGE, PAGES, max_pages=MAX_PAGES)
    ids = window_ids_of(cache, 3)
    q = jnp.asarray(rng.normal(size=(len(row_seq), HEADS, HEAD_DIM)) * 3, jnp.float32)
    kwargs = variant_kwargs(rng, variant)
    oracle_ids = WINDOW_IDS if cache.window else np.zeros(4, np.int32)
    f64 = dict(kwargs, sinks=None if "sinks" not in kwargs else np.asarray(kwargs["sinks"]))
    scale = 0.2
    want = rows_f64(cache, np.asarray(tables), lens, oracle_ids, to_f64(q), row_seq, row_pos, scale, **f64)
    plain = rows_f64(cache, np.asarray(tables), lens, oracle_ids, to_f64(q), row_seq, row_pos, scale)
    sinks = kwargs.pop("sinks", None)

    def call():
        fn = jax.jit(lambda q, sinks: tq.paged_prefill(q, cache, tables, jnp.asarray(lens), jnp.asarray(starts),
                                                       window_ids=ids, scale=scale, sinks=sinks, **kwargs))
        return fn(q, sinks)

    backends_agree(call, want, plain)


LONG_VARIANTS = {
    "sliding_window": dict(sliding_window=70),
    "soft_cap": dict(soft_cap=0.5),
    "sinks": dict(sinks=True),
    "all": dict(sliding_window=100, soft_cap=1.0, sinks=True),
}


def long_cache(rng, kind, head_dim, page, pages):
    """A k4v4 cache of random codes, or a k3v3 one with a 24-token window (K and V of one width: on a
    GPU the float16 kernel's ring serves decode variants there)."""
    if kind == "compressed":
        return random_cache(rng, num_pages=pages, page_size=page, num_kv_heads=KV_HEADS, head_dim=head_dim, k_bits=4,
                            v_bits=4, seed=int(rng.integers(100)))
    return random_window_cache(rng, head_dim=head_dim, num_kv_heads=KV_HEADS, page_size=page, num_pages=pages,
                               window=24, num_windows=3, k_bits=3, v_bits=3)


def long_variant_kwargs(rng, variant):
    kwargs = dict(LONG_VARIANTS[variant])
    if kwargs.pop("sinks", False):
        kwargs["sinks"] = jnp.asarray(rng.normal(size=HEADS) * 2 + 8, jnp.float32)
    return kwargs


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kind", ["compressed", "window"])
@pytest.mark.parametrize("variant", list(LONG_VARIANTS))
def test_decode_variants_over_several_pages(rng, head_dim, num_splits, dtype, kind, variant):
    """Sequences of up to 13 pages of 16 tokens at head_dim 64 / 128 (on a GPU: the float16 kernel's
    ring with bfloat16 queries, its masking variants' late-mask paths among them, the CUDA-core kernel
    with float32 ones): windows of 70 / 100 start inside a page, the splits share the window's pages
    only; sinks at one split with a folded window. With a window cache (whose bf16 rows outweigh the
    pages' tokens) the sliding window is 20, inside it."""
    d, page, pages = head_dim, 16, 40
    cache = long_cache(rng, kind, d, page, pages)
    lens = np.asarray([200, 37, 0, 129], np.int32)
    tables = random_tables(rng, lens, page, pages, max_pages=16)
    q = jnp.asarray(rng.normal(size=(4, HEADS, d)) * 3, dtype)
    kwargs = long_variant_kwargs(rng, variant)
    if kind == "window" and variant == "sliding_window":
        kwargs["sliding_window"] = 20
    f64 = dict(kwargs, sinks=None if "sinks" not in kwargs else np.asarray(kwargs["sinks"]))
    oracle_ids = WINDOW_IDS if cache.window else np.zeros(4, np.int32)
    scale = d ** -0.5
    args = (cache, np.asarray(tables), lens, oracle_ids, to_f64(q), range(4), lens - 1, scale)
    want, plain = rows_f64(*args, **f64), rows_f64(*args)
    sinks = kwargs.pop("sinks", None)

    def call():
        fn = jax.jit(lambda q, sinks: tq.paged_decode(q, cache, tables, jnp.asarray(lens), window_ids=window_ids_of(
            cache, 4), scale=scale, num_splits=num_splits, sinks=sinks, **kwargs))
        return fn(q, sinks)

    backends_agree(call, want, plain, TOLERANCE if dtype == jnp.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kind", ["compressed", "window"])
@pytest.mark.parametrize("variant", list(LONG_VARIANTS))
def test_prefill_variants_over_several_tiles(rng, dtype, kind, variant):
    """Sequences of several 64-token tiles at head_dim 128 (the GPU's tensor-core kernel with bfloat16
    queries, its CUDA-core one with float32): a chunk of 40 rows after 160 cached tokens, a prompt of
    130. A window of 70 skips whole tiles before the chunk's first visible token and masks inside others
    (20 with a window cache, whose bf16 rows outweigh the pages' tokens)."""
    d, page, pages = 128, 16, 32
    cache = long_cache(rng, kind, d, page, pages)
    lens, starts = np.asarray([200, 130], np.int32), np.asarray([0, 40, 170], np.int32)
    row_seq = np.asarray([0] * 40 + [1] * 130)
    row_pos = np.asarray(list(range(160, 200)) + list(range(130)))
    tables = random_tables(rng, lens, page, pages, max_pages=16)
    q = jnp.asarray(rng.normal(size=(len(row_seq), HEADS, d)) * 3, dtype)
    kwargs = long_variant_kwargs(rng, variant)
    if kind == "window" and variant == "sliding_window":
        kwargs["sliding_window"] = 20
    f64 = dict(kwargs, sinks=None if "sinks" not in kwargs else np.asarray(kwargs["sinks"]))
    oracle_ids = WINDOW_IDS[:2] if cache.window else np.zeros(2, np.int32)
    scale = d ** -0.5
    args = (cache, np.asarray(tables), lens, oracle_ids, to_f64(q), row_seq, row_pos, scale)
    want, plain = rows_f64(*args, **f64), rows_f64(*args)
    sinks = kwargs.pop("sinks", None)

    def call():
        fn = jax.jit(lambda q, sinks: tq.paged_prefill(q, cache, tables, jnp.asarray(lens), jnp.asarray(starts),
                                                       window_ids=window_ids_of(cache, 2), scale=scale, sinks=sinks,
                                                       **kwargs))
        return fn(q, sinks)

    backends_agree(call, want, plain, TOLERANCE if dtype == jnp.float32 else 1e-2)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("variant", ["sliding_window", "soft_cap", "sinks", "all"])
def test_ragged_variants_match_float64_oracle(rng, kind, variant):
    """A mixed step: a decode row (the 23rd token), a whole prompt of 9, a chunk of 3 after 11 cached
    tokens, 2 padding rows; the oracle reads the cache the step returns."""
    cache = make_cache(rng, kind)
    kv_lens = np.asarray([23, 9, 14], np.int32)
    cu_q_lens = np.asarray([0, 1, 10, 13], np.int32)
    row_seq = np.asarray([0] + [1] * 9 + [2] * 3 + [-1, -1])
    row_pos = np.asarray([22] + list(range(9)) + [11, 12, 13, 0, 0])
    tables = random_tables(rng, kv_lens, PAGE, PAGES, max_pages=MAX_PAGES)
    ids = window_ids_of(cache, 3)
    oracle_ids = WINDOW_IDS if cache.window else np.zeros(4, np.int32)
    num_tokens = len(row_seq)
    q = jnp.asarray(rng.normal(size=(num_tokens, HEADS, HEAD_DIM)) * 3, jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(num_tokens, KV_HEADS, HEAD_DIM)), jnp.float32) for _ in range(2))
    kwargs = variant_kwargs(rng, variant)
    f64 = dict(kwargs, sinks=None if "sinks" not in kwargs else np.asarray(kwargs["sinks"]))
    sinks = kwargs.pop("sinks", None)
    scale = 1 / 8
    step = jax.jit(lambda q, k, v, cache, sinks: tq.ragged_paged_attention(
        q, k, v, cache, jnp.asarray(kv_lens), tables, jnp.asarray(cu_q_lens), window_ids=ids, sinks=sinks, **kwargs))
    outs = {}
    for name in ("ffi", "xla"):
        with tq.use_backend(name):
            out, written = step(q, k, v, cache, sinks)
        args = (written, np.asarray(tables), kv_lens, oracle_ids, to_f64(q), row_seq, row_pos, scale)
        want = rows_f64(*args, **f64)
        assert rel_err(rows_f64(*args), want) > 1e-2, "the variant does not change this case"
        assert rel_err(out, want) < TOLERANCE, name
        assert not np.any(np.asarray(out)[-2:]), "padding rows are 0"
        outs[name] = np.asarray(out)
    assert rel_err(outs["ffi"], outs["xla"]) < 1e-3  # their caches may round a fitted scale's tie apart


# ----------------------------------------------------------------------------- gradients, vmap

@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_gradient_in_sinks_matches_float64_finite_differences(rng, op):
    cache = make_cache(rng, "window")
    lens, starts, row_seq, row_pos = prefill_layout()
    if op == "decode":
        row_seq, row_pos = np.arange(3), lens - 1
    tables = random_tables(rng, lens, PAGE, PAGES, max_pages=MAX_PAGES)
    q = jnp.asarray(rng.normal(size=(len(row_seq), HEADS, HEAD_DIM)) * 3, jnp.float32)
    sinks = rng.normal(size=HEADS) + 1
    weights = rng.normal(size=q.shape)
    ids = jnp.asarray(WINDOW_IDS[:3])

    def loss(sinks):
        if op == "decode":
            out = tq.paged_decode(q, cache, tables, jnp.asarray(lens), window_ids=ids, sinks=sinks, soft_cap=2.0)
        else:
            out = tq.paged_prefill(q, cache, tables, jnp.asarray(lens), jnp.asarray(starts), window_ids=ids,
                                   sinks=sinks, soft_cap=2.0)
        return jnp.sum(out * weights)

    def loss_f64(sinks):
        out = rows_f64(cache, np.asarray(tables), lens, WINDOW_IDS, to_f64(q), row_seq, row_pos, 1 / 8,
                       soft_cap=float(np.float32(2.0)), sinks=sinks)
        return float(np.sum(out * weights))

    eps = 1e-5
    want = np.asarray([(loss_f64(sinks + eps * e) - loss_f64(sinks - eps * e)) / (2 * eps) for e in np.eye(HEADS)])
    assert np.linalg.norm(want) > 1e-2
    for name in ("ffi", "xla"):
        with tq.use_backend(name):
            got = jax.jit(jax.grad(loss))(jnp.asarray(sinks, jnp.float32))
        assert rel_err(got, want) < 1e-4, name


def test_vmap_passes_the_variants_through_and_refuses_batched_sinks(rng):
    cache = make_cache(rng, "compressed")
    lens = jnp.asarray([29, 17], jnp.int32)
    tables = random_tables(rng, np.asarray(lens), PAGE, PAGES, max_pages=MAX_PAGES)
    q = jnp.asarray(rng.normal(size=(3, 2, HEADS, HEAD_DIM)) * 3, jnp.float32)
    sinks = jnp.asarray(rng.normal(size=HEADS), jnp.float32)
    kwargs = dict(sliding_window=4, soft_cap=1.0)

    def decode(q, sinks):
        return tq.paged_decode(q, cache, tables, lens, sinks=sinks, **kwargs)

    with tq.use_backend("ffi"):
        got = jax.jit(jax.vmap(decode, in_axes=(0, None)))(q, sinks)
        want = np.stack([np.asarray(decode(q[b], sinks)) for b in range(3)])
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-7)
        plain = np.stack([np.asarray(tq.paged_decode(q[b], cache, tables, lens)) for b in range(3)])
        assert rel_err(want, plain) > 1e-2
        with pytest.raises(NotImplementedError, match="sinks"):
            jax.vmap(decode)(q, jnp.stack([sinks] * 3))

        starts = jnp.asarray([0, 1, 2], jnp.int32)

        def prefill(q, sinks):
            return tq.paged_prefill(q, cache, tables, lens, starts, sinks=sinks, **kwargs)

        got = jax.jit(jax.vmap(prefill, in_axes=(0, None)))(q, sinks)
        want = np.stack([np.asarray(prefill(q[b], sinks)) for b in range(3)])
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-7)
        with pytest.raises(NotImplementedError, match="sinks"):
            jax.vmap(prefill)(q, jnp.stack([sinks] * 3))


@pytest.mark.parametrize("name", ["ffi", "xla"])
def test_a_sliding_window_covering_every_token_changes_nothing(rng, name):
    cache = make_cache(rng, "window")
    lens, starts, _, _ = prefill_layout()
    tables = random_tables(rng, lens, PAGE, PAGES, max_pages=MAX_PAGES)
    ids = jnp.asarray(WINDOW_IDS[:3])
    q = jnp.asarray(rng.normal(size=(20, HEADS, HEAD_DIM)) * 3, jnp.float32)
    with tq.use_backend(name):
        for window in (MAX_PAGES * PAGE, 2**40):
            np.testing.assert_allclose(
                np.asarray(tq.paged_decode(q[:3], cache, tables, jnp.asarray(lens), window_ids=ids,
                                           sliding_window=window)),
                np.asarray(tq.paged_decode(q[:3], cache, tables, jnp.asarray(lens), window_ids=ids)),
                rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(
                np.asarray(tq.paged_prefill(q, cache, tables, jnp.asarray(lens), jnp.asarray(starts), window_ids=ids,
                                            sliding_window=window)),
                np.asarray(tq.paged_prefill(q, cache, tables, jnp.asarray(lens), jnp.asarray(starts), window_ids=ids)),
                rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["ffi", "xla"])
def test_a_soft_cap_near_float32s_largest_changes_nothing(rng, name):
    """A cap of 1e38 .. 3.4e38 (accepted: any normal float32) leaves logits of ~1 as they are, in the
    outputs and in the gradient (the reference's: logit / cap is a subnormal that XLA:CPU flushes to 0)."""
    cache = make_cache(rng, "window")
    lens, starts, _, _ = prefill_layout()
    tables = random_tables(rng, lens, PAGE, PAGES, max_pages=MAX_PAGES)
    ids = jnp.asarray(WINDOW_IDS[:3])
    q = jnp.asarray(rng.normal(size=(20, HEADS, HEAD_DIM)) * 3, jnp.float32)
    lens, starts = jnp.asarray(lens), jnp.asarray(starts)
    decode = lambda q, **kw: tq.paged_decode(q, cache, tables, lens, window_ids=ids, **kw)
    prefill = lambda q, **kw: tq.paged_prefill(q, cache, tables, lens, starts, window_ids=ids, **kw)
    weights = jnp.asarray(rng.normal(size=(3, HEADS, HEAD_DIM)), jnp.float32)
    loss = lambda q, **kw: jnp.sum(decode(q, **kw) * weights)
    with tq.use_backend(name):
        plain = [np.asarray(decode(q[:3])), np.asarray(prefill(q)), np.asarray(jax.grad(loss)(q[:3]))]
        for cap in (1e38, 3.4e38):
            capped = [np.asarray(decode(q[:3], soft_cap=cap)), np.asarray(prefill(q, soft_cap=cap)),
                      np.asarray(jax.grad(lambda q: loss(q, soft_cap=cap))(q[:3]))]
            for got, want in zip(capped, plain):
                assert np.all(np.isfinite(want)) and np.abs(want).max() > 0.1
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["ffi", "xla"])
def test_non_finite_sinks_as_documented(rng, name):
    """A sink of -inf is no sink (the same rows up to rounding, rows with no visible token 0 included); NaN makes
    its head's rows with visible tokens NaN, +inf makes them 0 (its limit) or NaN; the other heads'
    rows stay as with their own sinks (variants.py)."""
    cache = make_cache(rng, "compressed")
    lens, starts, _, _ = prefill_layout()
    tables = random_tables(rng, lens, PAGE, PAGES, max_pages=MAX_PAGES)
    q = jnp.asarray(rng.normal(size=(20, HEADS, HEAD_DIM)) * 3, jnp.float32)
    finite = jnp.asarray(rng.normal(size=HEADS), jnp.float32)
    rows = int(starts[-1])  # prefill rows past it belong to no sequence
    with tq.use_backend(name):
        decode = lambda sinks: np.asarray(tq.paged_decode(q[:3], cache, tables, jnp.asarray(lens), sinks=sinks))  # noqa: E731
        prefill = lambda sinks: np.asarray(tq.paged_prefill(q, cache, tables, jnp.asarray(lens), jnp.asarray(starts),  # noqa: E731
                                                            sinks=sinks))
        for run, real in ((decode, 3), (prefill, rows)):
            # the same rows up to float32 rounding: on a GPU any sink sends decode through the split
            # partials and their combine, another order of the same sums
            np.testing.assert_allclose(run(jnp.full((HEADS,), -jnp.inf)), run(None), rtol=1e-6, atol=1e-7)
            want = run(finite)
            assert not np.isnan(want).any()
            for bad in (jnp.inf, jnp.nan):
                got = run(finite.at[3].set(bad))
                head = got[:real, 3]
                if bad != bad:
                    assert np.isnan(head).all()
                else:
                    assert all(np.isnan(r).all() or (r == 0).all() for r in head), head
                np.testing.assert_array_equal(np.delete(got, 3, axis=1), np.delete(want, 3, axis=1))
        # a row with no visible token outputs 0 whatever its sink (the kernels' combine and the reference)
        for bad in (jnp.nan, jnp.inf, -jnp.inf):
            empty = np.asarray(tq.paged_decode(q[:3], cache, tables, jnp.asarray([0, lens[1], 0]),
                                               sinks=finite.at[3].set(bad)))
            assert (empty[[0, 2]] == 0).all() and np.isfinite(np.delete(empty[1], 3, axis=0)).all()


# ----------------------------------------------------------------------------- the GPU policy

def test_a_kernel_module_that_lists_a_target_serves_its_variants(monkeypatch):
    """kernel_lacks reads the module's variant_targets: a module listing paged_decode only serves its
    variants; paged_prefill's calls with a variant go to the reference."""
    import types

    served = types.SimpleNamespace(variant_targets=("jax_tq_paged_decode",))
    monkeypatch.setattr(_ffi, "module", lambda platform: served if platform == "cuda" else None)
    params = {"sliding_window": 8, "soft_cap": 0.0}
    assert backend.kernel_lacks("cuda", "jax_tq_paged_decode", [], params) is None
    assert "sliding_window" in backend.kernel_lacks("cuda", "jax_tq_paged_prefill", [], params)
    monkeypatch.setattr(_ffi, "module", lambda platform: None)
    assert "sliding_window" in backend.kernel_lacks("cuda", "jax_tq_paged_decode", [], params)


def test_cuda_kernels_lack_the_variants_auto_runs_the_reference_and_ffi_refuses(rng, monkeypatch):
    """Lowered for CUDA (as if its kernels were loaded): without a variant the kernel's custom call;
    with one, backend "auto" emits XLA's code of the reference and "ffi" raises naming the variant."""
    assert backend.kernel_lacks("cpu", "jax_tq_paged_decode", [], {"soft_cap": 1.0}) is None
    assert backend.kernel_lacks("cuda", "jax_tq_paged_decode", [], {"sliding_window": 0, "soft_cap": 0.0}) is None
    monkeypatch.setattr(_ffi, "kernels_available", lambda platform: True)
    monkeypatch.setattr(_ffi, "has_target", lambda platform, target: True)
    module = _ffi.module  # a CUDA module that serves no variant (the built one lists both targets)
    monkeypatch.setattr(_ffi, "module", lambda platform: None if platform == "cuda" else module(platform))
    cache = make_cache(rng, "compressed")
    lens = jnp.asarray([29, 17], jnp.int32)
    tables = random_tables(rng, np.asarray(lens), PAGE, PAGES, max_pages=MAX_PAGES)
    q = jnp.asarray(rng.normal(size=(2, HEADS, HEAD_DIM)), jnp.float32)
    starts = jnp.asarray([0, 1, 2], jnp.int32)
    sinks = jnp.zeros((HEADS,), jnp.float32)
    ops = {
        "jax_tq_paged_decode": lambda **kw: (lambda q: tq.paged_decode(q, cache, tables, lens, num_splits=2, **kw)),
        "jax_tq_paged_prefill": lambda **kw: (lambda q: tq.paged_prefill(q, cache, tables, lens, starts, **kw)),
    }

    def lowered(fn, name):
        with tq.use_backend(name):
            return jax.jit(fn).trace(q).lower(lowering_platforms=("cuda",)).as_text()

    for target, op in ops.items():
        assert target in lowered(op(), "auto")
        for kwargs, names in ((dict(sliding_window=4), "sliding_window"), (dict(soft_cap=2.0), "soft_cap"),
                              (dict(sinks=sinks), "sinks")):
            assert target not in lowered(op(**kwargs), "auto")
            with pytest.raises(tq.BackendUnavailableError, match=f"CUDA kernels do not implement {names}"):
                lowered(op(**kwargs), "ffi")


# ----------------------------------------------------------------------------- argument errors

BAD = [
    (dict(sliding_window=0), ValueError, "sliding_window must be >= 1"),
    (dict(sliding_window=-3), ValueError, "sliding_window must be >= 1"),
    (dict(sliding_window=2.5), TypeError, "sliding_window"),
    (dict(sliding_window=True), TypeError, "sliding_window"),
    (dict(soft_cap=0.0), ValueError, "soft_cap must be finite and > 0"),
    (dict(soft_cap=-1.0), ValueError, "soft_cap must be finite and > 0"),
    (dict(soft_cap=float("inf")), ValueError, "soft_cap"),
    (dict(soft_cap=float("nan")), ValueError, "soft_cap"),
    (dict(soft_cap=1e39), ValueError, "soft_cap"),
    (dict(soft_cap="1"), TypeError, "soft_cap"),
    (dict(sinks=np.zeros(HEADS + 1, np.float32)), ValueError, r"sinks must be float32 \[num_heads=8\]"),
    (dict(sinks=np.zeros((1, HEADS), np.float32)), ValueError, "sinks"),
    (dict(sinks=np.zeros(HEADS, np.int32)), TypeError, "sinks"),
]


@pytest.mark.parametrize("op", ["paged_decode", "paged_prefill", "ragged_paged_attention"])
@pytest.mark.parametrize("kwargs,error,message", BAD)
def test_bad_variants_raise_naming_the_argument(op, kwargs, error, message):
    cache = make_cache(np.random.default_rng(0), "compressed")
    q = jnp.zeros((2, HEADS, HEAD_DIM), jnp.float32)
    lens, tables = jnp.asarray([3, 5], jnp.int32), jnp.zeros((2, 2), jnp.int32)
    starts = jnp.asarray([0, 1, 2], jnp.int32)
    calls = {
        "paged_decode": lambda: tq.paged_decode(q, cache, tables, lens, **kwargs),
        "paged_prefill": lambda: tq.paged_prefill(q, cache, tables, lens, starts, **kwargs),
        "ragged_paged_attention": lambda: tq.ragged_paged_attention(
            q, q[:, :KV_HEADS], q[:, :KV_HEADS], cache, lens, tables, starts, **kwargs),
    }
    with pytest.raises(error, match=f"jax_tq.{op}: {message}" if message.startswith(("sliding", "soft", "sinks"))
                       else message):
        calls[op]()


def test_a_traced_sliding_window_or_soft_cap_is_refused():
    cache = make_cache(np.random.default_rng(0), "compressed")
    q = jnp.zeros((2, HEADS, HEAD_DIM), jnp.float32)
    lens, tables = jnp.asarray([3, 5], jnp.int32), jnp.zeros((2, 2), jnp.int32)
    with pytest.raises(TypeError, match="soft_cap must be a concrete"):
        jax.jit(lambda c: tq.paged_decode(q, cache, tables, lens, soft_cap=c))(2.0)
    with pytest.raises(TypeError, match="sliding_window must be a concrete"):
        jax.jit(lambda w: tq.paged_decode(q, cache, tables, lens, sliding_window=w))(3)


def _poisoned_pair(rng, preset, poison):
    """Two caches of one 40-token sequence (pages 0-2 of 16 tokens), the second with `poison`
    applied to its K / V before the write; plus the block tables and seq_lens."""
    n, tables, pos = 40, jnp.asarray([[0, 1, 2]], jnp.int32), jnp.arange(40, dtype=jnp.int32)
    k = jnp.asarray(rng.normal(size=(n, 2, HEAD_DIM)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(n, 2, HEAD_DIM)), jnp.float32)
    slots = tq.slot_mapping(tables, pos, 16, jnp.zeros(n, jnp.int32))

    def cache(k, v):
        if preset == "none":
            empty = tq.PagedKVCache.create(num_pages=4, page_size=16, num_kv_heads=2, preset="none", head_dim=HEAD_DIM)
        else:
            empty = tq.PagedKVCache.create(num_pages=4, page_size=16, num_kv_heads=2,
                                           k_codec=tq.TurboQuant(HEAD_DIM, 4, seed=1),
                                           v_codec=tq.TurboQuant(HEAD_DIM, 4, seed=2))
        return tq.write_cache(empty, k, v, slots)

    return cache(k, v), cache(*poison(k, v)), tables, jnp.asarray([n], jnp.int32)


@pytest.mark.parametrize("preset", ["none", "plain"])
@pytest.mark.parametrize("name", ["ffi", "xla"])
def test_non_finite_tokens_reach_only_the_rows_that_see_them(rng, preset, name):
    """NaN / infinities in K / V of a token a row does not see (before its sliding window; after its
    position in a compressed cache's prefill) change neither its output nor its gradient."""
    def hide_first(k, v):  # token 0: outside every row's 8-token window below
        return k.at[0, :, 3].set(jnp.inf), v.at[0].set(jnp.nan)

    clean, poisoned, tables, lens = _poisoned_pair(rng, preset, hide_first)
    q = jnp.asarray(rng.normal(size=(4, 4, HEAD_DIM)), jnp.float32)
    starts = jnp.asarray([0, 4], jnp.int32)  # prefill rows at positions 36..39
    weights = jnp.asarray(rng.normal(size=(1, 4, HEAD_DIM)), jnp.float32)
    with tq.use_backend(name):
        outs = []
        for cache in (clean, poisoned):
            decode = lambda q: tq.paged_decode(q, cache, tables, lens, sliding_window=8)
            outs.append([np.asarray(decode(q[:1])),
                         np.asarray(jax.grad(lambda q: jnp.sum(decode(q) * weights))(q[:1])),
                         np.asarray(tq.paged_prefill(q, cache, tables, lens, starts, sliding_window=8))])
    for want, got in zip(*outs):
        assert np.all(np.isfinite(want)) and np.abs(want).max() > 1e-3
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)

    if preset == "none":  # (its prefill's rows share one product: a token one of them sees reaches all)
        return

    def poison_last(k, v):  # token 39: seen by the last prefill row only
        return k, v.at[39, :, 5].set(jnp.nan)

    clean, poisoned, tables, lens = _poisoned_pair(rng, preset, poison_last)
    with tq.use_backend(name):
        want = np.asarray(tq.paged_prefill(q, clean, tables, lens, starts))
        got = np.asarray(tq.paged_prefill(q, poisoned, tables, lens, starts))
    np.testing.assert_allclose(got[:3], want[:3], rtol=1e-6, atol=1e-7)
    assert np.all(np.isnan(got[3]))  # (a compressed vector with a NaN is NaN throughout: its norm)
