"""fill_window: window entries rewritten from the pages (prefix reuse, rollback) against a float64
oracle on random pages and poisoned rings; the attention ops after it read the tokens the pages
hold; the checks, the default window ids and donation."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tq as tq
from jax_tq import _compat
from jax_tq.format import unpack_codes
from oracle import (attend_f64, decompress_f64, random_tables, random_window_cache, rel_err, sequence_tokens,
                    to_f64)

BF16_ULP = 2.0 ** -8  # bfloat16's relative spacing (8 significant bits)


def filled_rings_f64(cache, tables, seq_lens, window_ids, stop):
    """The rings fill_window must leave (float64): entry p % W of window window_ids[s] holds the
    decoded rotated row norm * c[code] of position p of sequence s for max(L - W, 0) <= p < min(stop, L)
    where the page is in the pool; every other entry keeps the cache's row."""
    tables, window = np.asarray(tables), cache.window
    rings = []
    for ring, codes, norms, codec in ((cache.k_window, cache.k_codes, cache.k_norms, cache.k_codec),
                                      (cache.v_window, cache.v_codes, cache.v_norms, cache.v_codec)):
        ring = to_f64(ring).copy()
        centroids = to_f64(codec.centroids)
        for s, length in enumerate(np.asarray(seq_lens)):
            w = int(window_ids[s])
            if not 0 <= w < cache.num_windows:
                continue
            for p in range(max(int(length) - window, 0), min(int(stop[s]), int(length))):
                page = int(tables[s, p // cache.page_size])
                if 0 <= page < cache.num_pages:
                    code = unpack_codes(np.asarray(codes[page, :, p % cache.page_size]), codec.bits, cache.head_dim)
                    ring[w, :, p % window] = to_f64(norms[page, :, p % cache.page_size])[:, None] * centroids[code]
        rings.append(ring)
    return rings


def assert_rings(got, want):
    """Equal to want up to the final rounding to bfloat16 (one ulp)."""
    for ring, expected in zip((got.k_window, got.v_window), want):
        np.testing.assert_allclose(to_f64(ring), expected, rtol=BF16_ULP, atol=0)


def test_fill_window_matches_float64_oracle(rng):
    cache = random_window_cache(rng, window=5, num_windows=4, page_size=4, num_pages=24)
    seq_lens = np.asarray([13, 3, 0, 9, 7, 6], np.int32)
    tables = np.array(random_tables(rng, seq_lens, 4, 24, max_pages=4))
    tables[3, 1] = -1        # positions 4 .. 7 of sequence 3 have no page: their entries stay
    window_ids = np.asarray([2, 0, 4, 3, 1, 7], np.int32)   # ids 4 and 7 are past the windows: nothing written
    stop = np.asarray([11, 100, 0, 8, 4, 100], np.int32)
    got = tq.fill_window(cache, jnp.asarray(tables), jnp.asarray(seq_lens), window_ids=jnp.asarray(window_ids),
                         stop=jnp.asarray(stop))
    want = filled_rings_f64(cache, tables, seq_lens, window_ids, stop)
    assert_rings(got, want)
    changed = np.any(to_f64(got.k_window) != to_f64(cache.k_window), axis=(1, 3))   # [num_windows, W]
    assert changed.sum() == 3 + 3 + 2, changed   # positions 8 .. 10 of sequence 0, 0 .. 2 of 1, 2 .. 3 of 4
    for name in ("k_codes", "k_norms", "v_codes", "v_norms"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(cache, name)))


def sequence_f64(cache, table, positions, new_rows=None):
    """float64 K and V [len(positions), Hkv, d] as the pages decode them (and, for positions in
    ``new_rows`` {p: (k, v)}, the given exact rows)."""
    keys, values = [], []
    for p in positions:
        if new_rows is not None and p in new_rows:
            k, v = new_rows[p]
        else:
            page, offset = int(table[p // cache.page_size]), p % cache.page_size
            k = decompress_f64(np.asarray(cache.k_codes[page, :, offset]), np.asarray(cache.k_norms[page, :, offset]),
                               cache.k_codec)
            v = decompress_f64(np.asarray(cache.v_codes[page, :, offset]), np.asarray(cache.v_norms[page, :, offset]),
                               cache.v_codec)
        keys.append(k)
        values.append(v)
    return np.stack(keys), np.stack(values)


def write_tokens(cache, k, v, table, start, window_id, seq_len):
    """write_cache of tokens at positions start .. of one sequence (its length after: seq_len)."""
    n = k.shape[0]
    positions = jnp.arange(start, start + n, dtype=jnp.int32)
    slots = tq.slot_mapping(jnp.asarray(table)[None], positions, cache.page_size, jnp.zeros(n, jnp.int32))
    window_slots = tq.window_slot_mapping(jnp.full(n, window_id, jnp.int32), positions,
                                          jnp.full(n, seq_len, jnp.int32), cache.window)
    return tq.write_cache(cache, k, v, slots, window_slots)


def small_window_cache(window):
    codecs = [tq.TurboQuant(64, bits, seed, "hadamard", "fit") for bits, seed in ((4, 0), (3, 1))]
    return tq.PagedKVCache.create(num_pages=12, page_size=4, num_kv_heads=2, k_codec=codecs[0], v_codec=codecs[1],
                                  window=window, num_windows=2)


def test_prefix_reuse_reads_the_shared_pages(rng):
    """Sequence B's table starts with two pages that sequence A wrote (8 tokens); after fill_window,
    B's step of 3 new tokens attends over the prefix as the pages hold it and its own tokens."""
    cache = small_window_cache(8)
    table_a, table_b = np.asarray([0, 1, 2, 3], np.int32), np.asarray([0, 1, 6, 7], np.int32)
    k, v = (jnp.asarray(rng.normal(size=(14, 2, 64)), jnp.float32) for _ in range(2))
    cache = write_tokens(cache, k, v, table_a, 0, 0, 14)
    k_new, v_new = (jnp.asarray(rng.normal(size=(3, 2, 64)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.normal(size=(3, 4, 64)), jnp.float32)
    tables, ids = jnp.asarray(table_b[None]), jnp.asarray([1], jnp.int32)

    def step(cache):
        return tq.ragged_paged_attention(q, k_new, v_new, cache, jnp.asarray([11], jnp.int32), tables,
                                         jnp.asarray([0, 3], jnp.int32), window_ids=ids)[0]

    filled = tq.fill_window(cache, tables, jnp.asarray([8], jnp.int32), window_ids=ids)
    new_rows = {8 + i: (np.asarray(k_new[i], np.float64), np.asarray(v_new[i], np.float64)) for i in range(3)}
    keys, values = sequence_f64(cache, table_b, range(11), new_rows)
    want = np.stack([attend_f64(np.asarray(q[i]), keys[:9 + i], values[:9 + i], np.ones(9 + i, bool), 1 / 8)
                     for i in range(3)])
    assert rel_err(np.asarray(step(filled)), want) < 1e-2   # the window's bf16 rows
    assert rel_err(np.asarray(step(cache)), want) > 0.1     # without it: B's ring holds nothing of the prefix


def test_rollback_restores_the_overwritten_entries(rng):
    """14 tokens written, the last 3 rejected: the entries of positions 6 .. 8 (overwritten by 11 .. 13)
    come back from the pages, those of 9, 10 keep their exact rows, and decode reads 11 tokens."""
    window, old, new = 5, 14, 11
    table = np.asarray([3, 7, 1, 9], np.int32)
    k, v = (jnp.asarray(rng.normal(size=(old, 2, 64)), jnp.float32) for _ in range(2))
    cache = write_tokens(small_window_cache(window), k, v, table, 0, 1, old)
    tables, ids = jnp.asarray(table[None]), jnp.asarray([1], jnp.int32)
    rolled = jax.jit(tq.fill_window, donate_argnums=0)(jax.tree.map(jnp.copy, cache), tables,
                                                       jnp.asarray([new], jnp.int32), window_ids=ids,
                                                       stop=jnp.asarray([old - window], jnp.int32))
    exact = write_tokens(small_window_cache(window), k[:new], v[:new], table, 0, 1, new)
    for ring, want in ((rolled.k_window, exact.k_window), (rolled.v_window, exact.v_window)):
        for p in (9, 10):
            np.testing.assert_array_equal(np.asarray(ring[1, :, p % window]), np.asarray(want[1, :, p % window]))
    assert_rings(rolled, filled_rings_f64(cache, table[None], [new], [1], [old - window]))
    q = jnp.asarray(rng.normal(size=(1, 4, 64)), jnp.float32)
    exact_rows = {p: (np.asarray(k[p], np.float64), np.asarray(v[p], np.float64)) for p in (9, 10)}
    keys, values = sequence_f64(cache, table, range(new), exact_rows)
    want = attend_f64(np.asarray(q[0]), keys, values, np.ones(new, bool), 1 / 8)

    def decode(c):
        return np.asarray(tq.paged_decode(q, c, tables, jnp.asarray([new], jnp.int32), window_ids=ids))[0]

    assert rel_err(decode(rolled), want) < 1e-2
    assert rel_err(decode(cache), want) > 0.05   # the rejected tokens' rows in entries 1 .. 3


def test_fill_window_checks_its_arguments(rng):
    cache = small_window_cache(5)
    tables, lens = jnp.zeros((3, 4), jnp.int32), jnp.asarray([1, 2, 3], jnp.int32)
    with pytest.raises(ValueError, match="fill_window: 3 sequences but the cache has 2 window ids"):
        tq.fill_window(cache, tables, lens)
    with pytest.raises(TypeError, match="fill_window: seq_lens must be int32"):
        tq.fill_window(cache, tables[:2], np.asarray([1, 2], np.int64))
    with pytest.raises(ValueError, match="fill_window: stop must be int32 \\[num_seqs=2\\]"):
        tq.fill_window(cache, tables[:2], lens[:2], stop=lens)
    with pytest.raises(ValueError, match="fill_window: block_tables must be int32"):
        tq.fill_window(cache, tables[0], lens[:1])
    with pytest.raises(TypeError, match="fill_window: window_ids must be int32"):
        tq.fill_window(cache, tables, lens, window_ids=jnp.zeros(3, jnp.float32))
    plain = tq.PagedKVCache.create(num_pages=4, page_size=4, num_kv_heads=2, k_codec=cache.k_codec,
                                   v_codec=cache.v_codec)
    assert tq.fill_window(plain, tables, lens) is plain
    with pytest.raises(ValueError, match="fill_window: window_ids given but the cache has no window"):
        tq.fill_window(plain, tables, lens, window_ids=lens)


def test_default_window_ids_of_more_sequences_than_windows_raise(rng):
    """paged_decode / paged_prefill's default ids arange(num_seqs) would run past the windows (those
    sequences' last tokens silently missing): a trace-time error, as in ragged_paged_attention."""
    cache = small_window_cache(5)
    tables, lens = jnp.zeros((3, 4), jnp.int32), jnp.asarray([1, 2, 3], jnp.int32)
    q = jnp.zeros((3, 4, 64), jnp.float32)
    with pytest.raises(ValueError, match="paged_decode: 3 sequences but the cache has 2 window ids"):
        tq.paged_decode(q, cache, tables, lens)
    with pytest.raises(ValueError, match="paged_prefill: 3 sequences but the cache has 2 window ids"):
        tq.paged_prefill(q, cache, tables, lens, jnp.asarray([0, 1, 2, 3], jnp.int32))
    out = tq.paged_decode(q, cache, tables, lens, window_ids=jnp.asarray([0, 1, 5], jnp.int32))
    assert out.shape == q.shape   # explicit ids past the windows stay legal (checked mode reports them)


@pytest.mark.parametrize("backend", ["ffi", "xla"])
def test_vmap_over_sequences_gives_each_its_own_default_window(rng, backend):
    """jax.vmap of a one-sequence paged_decode / paged_prefill over sequences sharing a window cache:
    element b's default window id is b, as in one call over all the sequences (each element saw
    window 0 before: relative error ~0.85); the float64 oracle of ids arange(3)."""
    cache = random_window_cache(rng, window=5, num_windows=4, page_size=4, num_pages=24)
    lens = np.asarray([9, 3, 14], np.int32)
    tables = random_tables(rng, lens, 4, 24, max_pages=4)
    q = jnp.asarray(rng.normal(size=(3, 4, 64)), jnp.float32)
    with _compat.enable_x64():
        want = np.asarray(decode_f64_of_rings(q, cache, tables, lens, np.arange(3), to_f64(cache.k_window),
                                              to_f64(cache.v_window)))
    one_row = jnp.asarray([0, 1], jnp.int32)   # query_start_loc of one sequence's one row
    with tq.use_backend(backend):
        decode = jax.jit(jax.vmap(lambda q, t, n: tq.paged_decode(q[None], cache, t[None], n[None])[0]))
        prefill = jax.jit(jax.vmap(lambda q, t, n: tq.paged_prefill(q[None], cache, t[None], n[None], one_row)[0]))
        for f in (decode, prefill):
            assert rel_err(np.asarray(f(q, tables, jnp.asarray(lens))), want) < 1e-5


def test_nn_paged_attention_under_vmap_over_sequences_equals_one_call(rng):
    """jax_tq.nn.paged_attention's default window ids follow default_window_ids too: a vmap of its
    one-sequence step over three sequences of a shared cache gives the three-sequence call's
    outputs (it read window 0 for each before). The sequences' pages are disjoint: vmapped, each
    element writes into its own copy of the cache and would not see another's token on a shared page."""
    from jax_tq import nn as tq_nn
    cache = random_window_cache(rng, window=5, num_windows=3, page_size=4, num_pages=24)
    lens = np.asarray([9, 3, 14], np.int32)
    tables = jnp.asarray(rng.permutation(24)[:12].reshape(3, 4), jnp.int32)
    q = jnp.asarray(rng.normal(size=(3, 4, 64)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(3, 2, 64)), jnp.float32) for _ in range(2))
    slots = tq.slot_mapping(tables, jnp.asarray(lens) - 1, 4)
    want, _ = tq_nn.paged_attention(q, k, v, cache, slots, tables, jnp.asarray(lens))
    step = jax.vmap(lambda q, k, v, s, t, n: tq_nn.paged_attention(q[None], k[None], v[None], cache, s[None], t[None],
                                                                  n[None])[0][0])
    got = jax.jit(step)(q, k, v, slots, tables, jnp.asarray(lens))
    assert rel_err(np.asarray(got), np.asarray(want)) < 1e-6


def test_default_window_ids_under_vmap():
    """The default ids under vmap: numbered across elements whose block tables differ over shared
    windows (nested vmaps too), arange(num_seqs) in each element that has the same tables or its own
    cache; too many sequences for the windows raise naming window_ids."""
    cache = small_window_cache(5)   # 2 windows
    ids = lambda c, t: tq.cache.default_window_ids(c, t, t.shape[0], "paged_decode")
    tables = jnp.zeros((2, 1, 3), jnp.int32)
    np.testing.assert_array_equal(jax.vmap(lambda t: ids(cache, t))(tables), [[0], [1]])
    np.testing.assert_array_equal(jax.vmap(jax.vmap(lambda t: ids(cache, t)))(tables[:, None]), [[[0]], [[1]]])
    np.testing.assert_array_equal(jax.vmap(lambda x: ids(cache, tables[0]) + 0 * x)(jnp.arange(3)), [[0]] * 3)
    caches = jax.tree.map(lambda x: jnp.stack([x, x]), cache)
    np.testing.assert_array_equal(jax.vmap(ids)(caches, tables), [[0], [0]])
    with pytest.raises(ValueError, match="paged_decode: window_ids=None under vmap numbers the 3 x 1 sequences"):
        jax.vmap(lambda t: ids(cache, t))(jnp.zeros((3, 1, 3), jnp.int32))
    q = jnp.zeros((3, 1, 4, 64), jnp.float32)
    with pytest.raises(ValueError, match="pass window_ids"):
        jax.vmap(lambda q, t: tq.paged_decode(q, cache, t, jnp.ones(1, jnp.int32)))(q, jnp.zeros((3, 1, 4), jnp.int32))


def test_chunk_rows_needs_the_window_id_where_the_cache_has_several():
    table = jnp.arange(4, dtype=jnp.int32)
    with pytest.raises(ValueError, match="chunk_rows: window_id is required: the cache has 2 windows"):
        tq.chunk_rows(small_window_cache(5), table, 0, 3)
    rows = tq.chunk_rows(small_window_cache(5), table, 0, 3, window_id=1)
    np.testing.assert_array_equal(np.asarray(rows.window_slots), [5, 6, 7])   # entries 1 * 5 + p % 5
    single = tq.PagedKVCache.create(num_pages=4, page_size=4, num_kv_heads=2, preset="k4v4", head_dim=64,
                                    num_windows=1)
    np.testing.assert_array_equal(np.asarray(tq.chunk_rows(single, table, 0, 3).window_slots), [0, 1, 2])


@pytest.mark.parametrize("window_id", [5, -1])
def test_chunk_rows_with_a_window_id_outside_the_windows(rng, window_id):
    """A concrete id outside [0, num_windows) raises naming window_id (it used to be clamped by the
    view's indexing: the chunk read window 1, another sequence's ring); a traced one reads no window
    and writes none, as the ops do for such an id: each row sees its pages' tokens before its
    last `window` positions only (float64 oracle over the written cache)."""
    cache = random_window_cache(rng, num_windows=2, window=5, page_size=8, num_pages=24)
    table, start, T = jnp.asarray([4, 5, 6], jnp.int32), 10, 3
    q = jnp.asarray(rng.normal(size=(T, 4, 64)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(T, 2, 64)), jnp.float32) for _ in range(2))
    with pytest.raises(ValueError, match=rf"chunk_rows: window_id={window_id} is outside the cache's window ids "
                                         r"\[0, 2\)"):
        tq.chunk_rows(cache, table, start, T, window_id=window_id)
    with pytest.raises(TypeError, match="chunk_rows: window_id must be an integer scalar"):
        tq.chunk_rows(cache, table, start, T, window_id=1.0)
    with pytest.raises(ValueError, match="chunk_rows: window_id must be a scalar"):
        tq.chunk_rows(cache, table, start, T, window_id=jnp.asarray([1, 0], jnp.int32))

    @jax.jit
    def step(cache, wid):
        return tq.attend_rows(q, k, v, cache, tq.chunk_rows(cache, table, start, T, window_id=wid))

    out, written = step(cache, jnp.asarray(window_id, jnp.int32))
    for name in ("k_window", "v_window"):
        np.testing.assert_array_equal(np.asarray(getattr(written, name)), np.asarray(getattr(cache, name)))
    want = np.stack([attend_f64(q[t], *sequence_tokens(written, np.asarray(table), start + t + 1, window_id),
                                1 / np.sqrt(64)) for t in range(T)])
    assert rel_err(out, want) < 1e-5


def test_rows_take_python_lists_as_their_arrays():
    """chunk_rows / prompt_rows / decode_rows of lists equal those of int32 arrays (lists raised an
    AttributeError in the first two, and decode_rows kept the table as a list: a pytree of its ints);
    a list of floats is refused as a float array is."""
    cache = small_window_cache(5)
    for rows, want in ((tq.chunk_rows(cache, [3, 1], 2, 3, window_id=1),
                        tq.chunk_rows(cache, jnp.asarray([3, 1], jnp.int32), 2, 3, window_id=1)),
                       (tq.prompt_rows(cache, [[0, 1], [2, 3]], [3, 4], 5),
                        tq.prompt_rows(cache, jnp.asarray([[0, 1], [2, 3]], jnp.int32), jnp.asarray([3, 4], jnp.int32), 5)),
                       (tq.decode_rows(cache, [[0, 1], [2, 3]], [4, 2], [5, 3]),
                        tq.decode_rows(cache, jnp.asarray([[0, 1], [2, 3]], jnp.int32), jnp.asarray([4, 2], jnp.int32),
                                       jnp.asarray([5, 3], jnp.int32)))):
        for a, b in zip(jax.tree_util.tree_leaves(rows), jax.tree_util.tree_leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(TypeError, match="block_tables must be int32"):
        tq.chunk_rows(cache, [3.0, 1.0], 2, 3, window_id=1)


# ------------------------------------------------------------------------ gradients through the window

def decode_f64_of_rings(q, cache, tables, lens, ids, k_ring, v_ring):
    """paged_decode in float64 (jnp under x64, differentiable in the rings): sequence s's last
    min(L, W) tokens are its ring's rows rotated back, the others its pages' decoded tokens."""
    window, group = cache.window, q.shape[1] // cache.num_kv_heads
    k_rot, v_rot = to_f64(cache.k_codec.rotation), to_f64(cache.v_codec.rotation)
    outs = []
    for s, length in enumerate(np.asarray(lens)):
        first = max(int(length) - window, 0)
        keys, values = sequence_f64(cache, np.asarray(tables[s]), range(first)) if first else (None, None)
        ring_k = jnp.stack([k_ring[ids[s], :, p % window] for p in range(first, int(length))]) @ k_rot
        ring_v = jnp.stack([v_ring[ids[s], :, p % window] for p in range(first, int(length))]) @ v_rot
        keys = ring_k if keys is None else jnp.concatenate([jnp.asarray(keys), ring_k])
        values = ring_v if values is None else jnp.concatenate([jnp.asarray(values), ring_v])
        heads = []
        for h in range(q.shape[1]):
            p = jax.nn.softmax(keys[:, h // group] @ to_f64(q[s, h]) / np.sqrt(cache.head_dim))
            heads.append(p @ values[:, h // group])
        outs.append(jnp.stack(heads))
    return jnp.stack(outs)


@pytest.mark.parametrize("backend", ["ffi", "xla"])
def test_decode_and_prefill_gradients_in_the_window_rows(rng, backend):
    """d loss / d rings of paged_decode (and of paged_prefill with one row per sequence) against the
    float64 oracle's autodiff; the cotangents are bfloat16 like the rings."""
    cache = random_window_cache(rng, window=5, num_windows=3, page_size=4, num_pages=24)
    lens = np.asarray([9, 3, 14], np.int32)
    tables = random_tables(rng, lens, 4, 24, max_pages=4)
    ids = np.asarray([2, 0, 1], np.int32)
    q = jnp.asarray(rng.normal(size=(3, 4, 64)), jnp.float32)
    weights = jnp.asarray(rng.normal(size=(3, 4, 64)), jnp.float32)
    args = (tables, jnp.asarray(lens))

    def decode(k_ring, v_ring):
        c = dataclasses.replace(cache, k_window=k_ring, v_window=v_ring)
        return jnp.sum(tq.paged_decode(q, c, *args, window_ids=jnp.asarray(ids)) * weights)

    def prefill(k_ring, v_ring):
        c = dataclasses.replace(cache, k_window=k_ring, v_window=v_ring)
        out = tq.paged_prefill(q, c, *args, jnp.arange(4, dtype=jnp.int32), window_ids=jnp.asarray(ids))
        return jnp.sum(out * weights)

    with tq.use_backend(backend):
        got = [jax.jit(jax.grad(f, argnums=(0, 1)))(cache.k_window, cache.v_window) for f in (decode, prefill)]
    with _compat.enable_x64():
        want = jax.grad(lambda kr, vr: jnp.sum(decode_f64_of_rings(q, cache, tables, lens, ids, kr, vr)
                                               * to_f64(weights)), argnums=(0, 1))(
            jnp.asarray(to_f64(cache.k_window)), jnp.asarray(to_f64(cache.v_window)))
        want = [np.asarray(w) for w in want]
    for grads in got:
        for g, w in zip(grads, want):
            assert g.dtype == jnp.bfloat16
            assert rel_err(to_f64(g), w) < 1e-2
    assert np.abs(want[0]).sum() > 0


@pytest.mark.parametrize("backend", ["ffi", "xla"])
def test_write_cache_tangent_of_the_window_rows(rng, backend):
    """The written entries' tangent is Pi k_dot (the rows are Pi k, rounded to bfloat16); the other
    entries keep the ring's tangent; a padding token's entry is not written."""
    cache = random_window_cache(rng, window=4, num_windows=2)
    k, v, k_dot, v_dot = (jnp.asarray(rng.normal(size=(3, 2, 64)), jnp.float32) for _ in range(4))
    ring_dot = jnp.asarray(rng.normal(size=cache.k_window.shape), jnp.bfloat16)
    slots = jnp.asarray([0, -1, 2], jnp.int32)            # token 1 is padding: not written anywhere
    window_slots = jnp.asarray([5, 6, 1], jnp.int32)      # window 1 entry 1, -, window 0 entry 1

    def write(k, v, k_ring, v_ring):
        c = dataclasses.replace(cache, k_window=k_ring, v_window=v_ring)
        new = tq.write_cache(c, k, v, slots, window_slots)
        return new.k_window, new.v_window

    with tq.use_backend(backend):
        _, (dk_ring, dv_ring) = jax.jvp(write, (k, v, cache.k_window, cache.v_window),
                                        (k_dot, v_dot, ring_dot, ring_dot))
    for got, x_dot, codec in ((dk_ring, k_dot, cache.k_codec), (dv_ring, v_dot, cache.v_codec)):
        want = to_f64(ring_dot).copy()
        rows = to_f64(x_dot) @ to_f64(codec.rotation).T
        want[1, :, 1], want[0, :, 1] = rows[0], rows[2]
        assert got.dtype == jnp.bfloat16
        np.testing.assert_allclose(to_f64(got), want, rtol=2 * BF16_ULP, atol=1e-6 * np.abs(rows).max())


def test_gradient_through_write_and_decode_reaches_the_window_tokens(rng):
    """A sequence of 6 tokens with a window of 4: d loss / d k of its last 4 tokens is the float64
    oracle's for the exact rows (not 0), on both backends alike."""
    cache = small_window_cache(4)
    table = np.asarray([2, 5], np.int32)
    k, v = (jnp.asarray(rng.normal(size=(6, 2, 64)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.normal(size=(1, 4, 64)), jnp.float32)

    def loss(k, v):
        c = write_tokens(cache, k, v, table, 0, 1, 6)
        return jnp.sum(tq.paged_decode(q, c, jnp.asarray(table[None]), jnp.asarray([6], jnp.int32),
                                       window_ids=jnp.asarray([1], jnp.int32)))

    grads = {}
    for backend in ("ffi", "xla"):
        with tq.use_backend(backend):
            grads[backend] = jax.grad(loss, argnums=(0, 1))(k, v)
    written = write_tokens(cache, k, v, table, 0, 1, 6)
    pages = sequence_f64(written, table, range(2))

    def oracle(k_last, v_last):   # the last 4 tokens exact, the first 2 as their pages hold them
        keys = jnp.concatenate([jnp.asarray(pages[0]), k_last])
        values = jnp.concatenate([jnp.asarray(pages[1]), v_last])
        heads = [jax.nn.softmax(keys[:, h // 2] @ to_f64(q[0, h]) / 8.0) @ values[:, h // 2] for h in range(4)]
        return jnp.sum(jnp.stack(heads))

    with _compat.enable_x64():
        want = [np.asarray(w) for w in jax.grad(oracle, argnums=(0, 1))(jnp.asarray(to_f64(k[2:])),
                                                                         jnp.asarray(to_f64(v[2:])))]
    for backend, (dk, dv) in grads.items():
        assert rel_err(to_f64(dk[2:]), want[0]) < 2e-2, backend
        assert rel_err(to_f64(dv[2:]), want[1]) < 2e-2, backend
        assert np.abs(to_f64(dk[:2])).sum() > 0, backend   # the pages' tokens: through their scales


def test_window_gradient_of_a_zero_vector_and_a_nan_padding_token(rng):
    """A zero K vector in the window gets the gradient Pi^T (its row's cotangent) on both backends;
    a NaN padding token (slot -1) gets exactly 0 and leaves every gradient finite."""
    cache = small_window_cache(8)
    k = rng.normal(size=(4, 2, 64)).astype(np.float32)
    k[1], k[3] = 0.0, np.nan
    k, v = jnp.asarray(k), jnp.asarray(rng.normal(size=(4, 2, 64)), jnp.float32)
    table = np.asarray([0, 1], np.int32)
    slots = jnp.asarray([0, 1, 2, -1], jnp.int32)
    positions = jnp.arange(4, dtype=jnp.int32)
    window_slots = tq.window_slot_mapping(jnp.zeros(4, jnp.int32), positions, jnp.full(4, 3, jnp.int32), 8)
    q = jnp.asarray(rng.normal(size=(1, 4, 64)), jnp.float32)

    def loss(k, v):
        c = tq.write_cache(cache, k, v, slots, window_slots)
        return jnp.sum(tq.paged_decode(q, c, jnp.asarray(table[None]), jnp.asarray([3], jnp.int32)))

    grads = []
    for backend in ("ffi", "xla"):
        with tq.use_backend(backend):
            grads.append([np.asarray(g) for g in jax.grad(loss, argnums=(0, 1))(k, v)])
    for dk, dv in grads:
        assert np.isfinite(dk).all() and np.isfinite(dv).all()
        assert np.all(dk[3] == 0) and np.all(dv[3] == 0)
        assert np.abs(dk[1]).max() > 0.01
    np.testing.assert_allclose(grads[0][0], grads[1][0], rtol=1e-2, atol=1e-3)


def test_checked_reports_a_window_shared_by_two_live_sequences(rng):
    """Ops that write the rings (ragged_paged_attention, prompt_attention, decode_rows, fill_window)
    report two sequences with tokens sharing a window id, naming both; an idle one may share it.
    decode_rows names its own arguments before write_cache sees the slots made of them."""
    cache = small_window_cache(5)
    cache = dataclasses.replace(cache, k_window=jnp.zeros((3,) + cache.k_window.shape[1:], jnp.bfloat16),
                                v_window=jnp.zeros((3,) + cache.v_window.shape[1:], jnp.bfloat16))
    q = jnp.asarray(rng.normal(size=(4, 4, 64)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(4, 2, 64)), jnp.float32)
    tables = jnp.asarray([[0, 1, 2], [3, 4, 5]], jnp.int32)
    ragged = jax.jit(tq.checked(tq.ragged_paged_attention))

    def ragged_error(kv_lens, cu_q_lens, ids):
        err, _ = ragged(q, k, k, cache, jnp.asarray(kv_lens, jnp.int32), tables, jnp.asarray(cu_q_lens, jnp.int32),
                        window_ids=jnp.asarray(ids, jnp.int32))
        return err.get()

    assert "ragged_paged_attention: window_ids[0] = window_ids[1] = 2: two sequences with tokens share a window" in \
        ragged_error([9, 3], [0, 1, 4], [2, 2])
    assert ragged_error([9, 3], [0, 1, 4], [2, 0]) is None
    assert ragged_error([9, 0], [0, 1, 1], [2, 2]) is None   # sequence 1 has no tokens

    prompt = jax.jit(tq.checked(tq.prompt_attention))
    err, _ = prompt(q.reshape(2, 2, 4, 64), k.reshape(2, 2, 2, 64), k.reshape(2, 2, 2, 64), cache, tables,
                    jnp.asarray([2, 1], jnp.int32), window_ids=jnp.asarray([1, 1], jnp.int32))
    assert "prompt_attention: window_ids[0] = window_ids[1] = 1" in err.get()

    def decode_error(tables, ids):
        step = jax.jit(tq.checked(lambda c, t, w: tq.attend_rows(
            q[:2], k[:2], k[:2], c, tq.decode_rows(c, t, jnp.asarray([5, 2]), jnp.asarray([6, 3]), w))))
        return step(cache, jnp.asarray(tables, jnp.int32), jnp.asarray(ids, jnp.int32))[0].get()

    assert "decode_rows: window_ids[0] = window_ids[1] = 1" in decode_error([[0, 1, 2], [3, 4, 5]], [1, 1])
    assert "decode_rows: window_ids[1] = 7 is outside [0, 3)" in decode_error([[0, 1, 2], [3, 4, 5]], [0, 7])
    assert "decode_rows: block_tables[0, 1] = 12 is outside the pool [0, 12)" in \
        decode_error([[0, 12, 2], [3, 4, 5]], [0, 1])
    assert decode_error([[0, 1, 2], [3, 4, 5]], [0, 1]) is None

    fill = jax.jit(tq.checked(tq.fill_window))
    err, _ = fill(cache, tables, jnp.asarray([4, 4], jnp.int32), window_ids=jnp.asarray([0, 0], jnp.int32))
    assert "fill_window: window_ids[0] = window_ids[1] = 0" in err.get()


@pytest.mark.parametrize("path", ["ragged", "decode_rows"])
@pytest.mark.parametrize("backend", ["ffi", "xla"])
def test_a_token_past_the_allocated_pages_enters_its_ring(rng, path, backend):
    """Sequence B takes over window id 0 from a finished A and decodes past its allocated page (its
    next entry -1, no extend): the token enters B's ring (not the pages), and B attends over its own
    five tokens, not over A's token 4 left in the ring (float64 oracle; A's pages untouched)."""
    cache = small_window_cache(8)
    k_a, v_a = (jnp.asarray(rng.normal(size=(8, 2, 64)), jnp.float32) for _ in range(2))
    cache = write_tokens(cache, k_a, v_a, np.asarray([0, 1, -1, -1], np.int32), 0, 0, 8)
    k_b, v_b = (jnp.asarray(rng.normal(size=(5, 2, 64)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.normal(size=(1, 4, 64)), jnp.float32)
    table_b, ids = jnp.asarray([[2, -1, -1, -1]], jnp.int32), jnp.asarray([0], jnp.int32)
    with tq.use_backend(backend):
        _, cache = tq.ragged_paged_attention(jnp.zeros((4, 4, 64)), k_b[:4], v_b[:4], cache,
                                             jnp.asarray([4], jnp.int32), table_b, jnp.asarray([0, 4], jnp.int32),
                                             window_ids=ids)
        pages_before = [np.asarray(x) for x in (cache.k_codes, cache.k_norms, cache.v_codes, cache.v_norms)]
        if path == "ragged":
            out, cache = tq.ragged_paged_attention(q, k_b[4:], v_b[4:], cache, jnp.asarray([5], jnp.int32), table_b,
                                                   jnp.asarray([0, 1], jnp.int32), window_ids=ids)
        else:
            rows = tq.decode_rows(cache, table_b, jnp.asarray([4], jnp.int32), jnp.asarray([5], jnp.int32), ids)
            out, cache = tq.attend_rows(q, k_b[4:], v_b[4:], cache, rows)
    for before, after in zip(pages_before, (cache.k_codes, cache.k_norms, cache.v_codes, cache.v_norms)):
        np.testing.assert_array_equal(before, np.asarray(after))   # no page holds token 4
    keys, values = to_f64(k_b), to_f64(v_b)
    want = attend_f64(np.asarray(q[0]), keys, values, np.ones(5, bool), 1 / 8)
    stale_keys, stale_values = keys.copy(), values.copy()
    stale_keys[4], stale_values[4] = to_f64(k_a[4]), to_f64(v_a[4])
    stale = attend_f64(np.asarray(q[0]), stale_keys, stale_values, np.ones(5, bool), 1 / 8)
    assert rel_err(np.asarray(out[0]), want) < 1e-2   # the ring's bf16 rows
    assert rel_err(stale, want) > 0.05                # the two outcomes are told apart


def test_rows_with_default_window_ids_past_the_caches_are_refused():
    """decode_rows / prompt_rows with window_ids=None and more rows than window ids raise (the rows
    past them would write no window), as the attention ops do; explicit ids within range pass."""
    cache = small_window_cache(8)   # 2 window ids
    tables = jnp.asarray([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], jnp.int32)
    with pytest.raises(ValueError, match="decode_rows: 3 sequences but the cache has 2 window ids"):
        tq.decode_rows(cache, tables, jnp.zeros(3, jnp.int32), jnp.ones(3, jnp.int32))
    with pytest.raises(ValueError, match="prompt_rows: 3 sequences but the cache has 2 window ids"):
        tq.prompt_rows(cache, tables, jnp.ones(3, jnp.int32), 4)
    rows = tq.decode_rows(cache, tables, jnp.zeros(3, jnp.int32), jnp.asarray([1, 0, 1], jnp.int32),
                          jnp.asarray([0, 1, 1], jnp.int32))   # rows 1 (idle) and 2 share id 1
    assert rows.window_ids.tolist() == [0, 1, 1]
    # float positions and lengths are refused, not truncated (2.9 was position 2 without a window)
    plain = tq.PagedKVCache.create(num_pages=12, page_size=4, num_kv_heads=1, preset="none", head_dim=64)
    for c in (plain, cache):
        with pytest.raises(TypeError, match=r"decode_rows: position must be int32 \[num_seqs\], got float32\(2,\)"):
            tq.decode_rows(c, tables[:2], jnp.asarray([2.9, 5.5]), jnp.asarray([3, 6], jnp.int32))
        with pytest.raises(TypeError, match=r"decode_rows: seq_lens must be int32 \[num_seqs=2\]"):
            tq.decode_rows(c, tables[:2], jnp.asarray([2, 5], jnp.int32), jnp.asarray([3.0, 6.0]))
