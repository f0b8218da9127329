"""The recent-token window (docs/FORMAT.md "Window") and the cache presets: write_cache's window rows,
paged_decode / paged_prefill over pages + window against an independent float64 oracle (on every
backend and, marked gpu, the CUDA kernels), vmap, checked mode, the API's errors."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tq as tq
from jax_tq.format import paged_tokens
from conftest import kernel_backend, poison_device_memory
from oracle import decompress_f64, rel_err

BACKENDS = ("ffi", "xla")
DECODE_TARGETS = ["jax_tq_write_cache", "jax_tq_paged_decode"]


def make_cache(rng, *, head_dim=64, num_kv_heads=2, page_size=8, num_pages=24, window=5, num_windows=3,
               k_bits=4, v_bits=3, rotation="hadamard", seed=None):
    """A cache whose pages and window rows hold random values (nothing zero by accident)."""
    seed = int(rng.integers(100)) if seed is None else seed
    k_codec = tq.TurboQuant(head_dim, k_bits, seed, rotation, "fit")
    v_codec = tq.TurboQuant(head_dim, v_bits, seed + 1, rotation, "fit")
    cache = tq.PagedKVCache.create(num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv_heads,
                                   k_codec=k_codec, v_codec=v_codec, window=window, num_windows=num_windows)

    def rows(shape):
        return jnp.asarray(rng.normal(size=shape) * 2, jnp.bfloat16)

    return dataclasses.replace(
        cache, k_codes=jnp.asarray(rng.integers(0, 256, cache.k_codes.shape, dtype=np.uint8)),
        v_codes=jnp.asarray(rng.integers(0, 256, cache.v_codes.shape, dtype=np.uint8)),
        k_norms=jnp.asarray(rng.uniform(0.5, 2, cache.k_norms.shape), jnp.float32),
        v_norms=jnp.asarray(rng.uniform(0.5, 2, cache.v_norms.shape), jnp.float32),
        k_window=rows(cache.k_window.shape), v_window=rows(cache.v_window.shape))


def sequence_tokens(cache, table, length, window_id):
    """float64 K and V [L, Hkv, d] of one sequence as the window format says it reads them: pages
    for positions < paged_tokens, the window's rows (rotated back) after; (K, V, valid [L])."""
    d, page_size = cache.head_dim, cache.page_size
    capacity = len(table) * page_size
    length = int(np.clip(length, 0, capacity))
    first_window = int(paged_tokens(np.asarray(length), capacity, cache.window))
    keys, values, valid = [], [], []
    for p in range(length):
        if p < first_window:
            page = int(table[p // page_size])
            ok = 0 <= page < cache.num_pages
            page = page if ok else 0
            k = decompress_f64(np.asarray(cache.k_codes[page, :, p % page_size]),
                               np.asarray(cache.k_norms[page, :, p % page_size]), cache.k_codec)
            v = decompress_f64(np.asarray(cache.v_codes[page, :, p % page_size]),
                               np.asarray(cache.v_norms[page, :, p % page_size]), cache.v_codec)
        else:
            ok = 0 <= window_id < cache.num_windows
            w = window_id if ok else 0
            k = np.asarray(cache.k_window[w, :, p % cache.window], np.float64) @ np.asarray(cache.k_codec.rotation, np.float64)
            v = np.asarray(cache.v_window[w, :, p % cache.window], np.float64) @ np.asarray(cache.v_codec.rotation, np.float64)
        keys.append(k)
        values.append(v)
        valid.append(ok)
    empty = np.zeros((0, cache.num_kv_heads, d))
    return (np.stack(keys) if keys else empty), (np.stack(values) if values else empty), np.asarray(valid, bool)


def attend_f64(q, keys, values, valid, scale):
    """q [H, d] over keys / values [L, Hkv, d] (valid [L]) in float64; GQA h -> h // group."""
    heads, d = q.shape
    group = heads // keys.shape[1] if keys.shape[0] else 1
    out = np.zeros((heads, d))
    for h in range(heads):
        if not valid.any():
            continue
        s = keys[valid, h // group] @ np.asarray(q[h], np.float64) * scale
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ values[valid, h // group]
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("group,num_splits", [(1, 1), (4, 3)])
def test_decode_reads_the_last_tokens_from_the_window(rng, backend, group, num_splits):
    cache = make_cache(rng)
    tables = np.stack([rng.permutation(24)[:6] for _ in range(5)]).astype(np.int32)
    tables[4, 1] = 99  # an invalid page: its tokens contribute nothing
    seq_lens = np.asarray([0, 3, 5, 23, 40], np.int32)  # empty, shorter than, equal to, longer than the window
    window_ids = np.asarray([0, 2, 1, 0, 2], np.int32)
    q = rng.normal(size=(5, 2 * group, 64)).astype(np.float32)
    with tq.use_backend(backend):
        out = jax.jit(tq.paged_decode, static_argnames="num_splits")(
            q, cache, tables, seq_lens, window_ids=window_ids, num_splits=num_splits)
    for s in range(5):
        keys, values, valid = sequence_tokens(cache, tables[s], seq_lens[s], window_ids[s])
        want = attend_f64(q[s], keys, values, valid, 1 / 8)
        assert rel_err(out[s], want) < 2e-5 if valid.any() else np.all(np.asarray(out[s]) == 0)
    # the window matters: the same call reading those tokens from the pages differs
    no_window = dataclasses.replace(cache, k_window=None, v_window=None)
    with tq.use_backend(backend):
        plain = tq.paged_decode(q, no_window, tables, seq_lens)
    assert rel_err(plain[3], out[3]) > 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_with_an_invalid_window_id_drops_the_window_tokens(rng, backend):
    cache = make_cache(rng)
    table = rng.permutation(24)[:6].astype(np.int32)[None]
    q = rng.normal(size=(1, 2, 64)).astype(np.float32)
    for bad in (-1, 3):
        with tq.use_backend(backend):
            out = tq.paged_decode(q, cache, table, np.asarray([20], np.int32), window_ids=np.asarray([bad], np.int32))
        keys, values, valid = sequence_tokens(cache, table[0], 20, bad)
        assert valid.sum() == 15
        assert rel_err(out[0], attend_f64(q[0], keys, values, valid, 1 / 8)) < 2e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_reads_the_cache_as_it_stands(rng, backend):
    """Rows of two sequences (chunked prefill: 7 of 23 tokens new, and 4 of 4): row i attends to the
    tokens up to its position, the sequence's last `window` from its window."""
    cache = make_cache(rng, num_kv_heads=1)
    tables = np.stack([rng.permutation(24)[:4] for _ in range(2)]).astype(np.int32)
    seq_lens = np.asarray([23, 4], np.int32)
    starts = np.asarray([0, 7, 11], np.int32)
    window_ids = np.asarray([1, 0], np.int32)
    q = rng.normal(size=(11, 4, 64)).astype(np.float32)
    with tq.use_backend(backend):
        out = np.asarray(tq.paged_prefill(q, cache, tables, seq_lens, starts, window_ids=window_ids))
    for s in range(2):
        keys, values, valid = sequence_tokens(cache, tables[s], seq_lens[s], window_ids[s])
        rows = range(starts[s], starts[s + 1])
        for i, row in enumerate(rows):
            n = seq_lens[s] - len(rows) + i + 1
            want = attend_f64(q[row], keys[:n], values[:n], valid[:n], 1 / 8)
            assert rel_err(out[row], want) < 2e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_cache_fills_pages_and_window(rng, backend):
    cache = make_cache(rng)
    k = rng.normal(size=(6, 2, 64)).astype(np.float32)
    v = rng.normal(size=(6, 2, 64)).astype(np.float32)
    slots = np.asarray([0, 9, -1, 30, 11, -1], np.int32)
    # 15 = 3 * 5: past the pool, skipped; token 2 is padding (slot -1): its window slot is ignored
    window_slots = np.asarray([2, -1, 14, 7, 15, -1], np.int32)
    with tq.use_backend(backend):
        new = jax.jit(tq.write_cache)(cache, jnp.asarray(k), jnp.asarray(v), slots, window_slots)
        rows_k, rows_v = tq.window_rows(k, cache.k_codec), tq.window_rows(v, cache.v_codec)
    written = {2: 0, 7: 3}

    def entries(pool):  # [num_windows, Hkv, W, d] -> [num_windows * W, Hkv, d]: entry w * W + e
        return np.swapaxes(np.asarray(pool, np.float32), 1, 2).reshape(15, 2, 64)

    for name, rows in (("k_window", rows_k), ("v_window", rows_v)):
        got, before = entries(getattr(new, name)), entries(getattr(cache, name))
        for entry in range(15):
            if entry in written:
                want = np.asarray(rows[written[entry]], np.float32)
                ulp = np.abs(want) * 2.0 ** -7 + 1e-30  # the kernel's y may differ by 1 bf16 ulp
                assert np.all(np.abs(got[entry] - want) <= ulp)
            else:
                np.testing.assert_array_equal(got[entry], before[entry])
    # the rows are Pi x rounded to bfloat16
    rotated = (k @ np.asarray(cache.k_codec.rotation, np.float64).T)[0]
    assert rel_err(entries(new.k_window)[2], rotated) < 4e-3
    assert np.all(np.asarray(new.k_norms[0, :, 0]) != np.asarray(cache.k_norms[0, :, 0]))  # the page too


def test_window_slot_mapping_keeps_each_sequence_s_last_tokens():
    ids = np.asarray([0, 0, 0, 0, 2, 2, -1], np.int32)
    positions = np.asarray([0, 1, 2, 3, 7, 8, 0], np.int32)
    lens = np.asarray([4, 4, 4, 4, 9, 9, 1], np.int32)
    got = tq.window_slot_mapping(ids, positions, lens, 3)
    np.testing.assert_array_equal(got, [-1, 1, 2, 0, 7, 8, -1])
    np.testing.assert_array_equal(tq.window_slot_mapping(jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(lens), 3),
                                  got)
    with pytest.raises(ValueError, match="window must be"):
        tq.window_slot_mapping(ids, positions, lens, 0)
    # An id whose entries would pass int32 is no entry (not a wrapped-around valid one).
    np.testing.assert_array_equal(tq.window_slot_mapping([2**30, 2**25 - 1], [0, 0], [1, 1], 64), [-1, 2**31 - 64])
    with pytest.raises(ValueError, match="window_ids holds values outside int32"):
        tq.window_slot_mapping(np.asarray([2**40]), [3], [4], 2)
    with pytest.raises(TypeError, match="positions must be integers"):
        tq.window_slot_mapping([1], [3.7], [4], 2)
    # numpy ids with traced positions: the jnp path
    traced = jax.jit(lambda p: tq.window_slot_mapping(ids, p, lens, 3))(jnp.asarray(positions))
    np.testing.assert_array_equal(traced, got)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_padding_token_is_written_nowhere(rng, backend):
    """A negative slot (padding) skips the window too, whatever its window slot says (the padding
    row of sequence 0 at position 0 gets window entry 0 from window_slot_mapping)."""
    cache = make_cache(rng, window=8, num_windows=2)
    k = jnp.asarray(rng.normal(size=(4, 2, 64)), jnp.float32)
    slots = jnp.asarray([0, 1, 2, -1], jnp.int32)
    window_slots = tq.window_slot_mapping(jnp.zeros(4, jnp.int32), jnp.asarray([0, 1, 2, 0], jnp.int32),
                                          jnp.full(4, 3, jnp.int32), 8)
    assert int(window_slots[3]) == 0
    with tq.use_backend(backend):
        new = jax.jit(tq.write_cache)(cache, k, k, slots, window_slots)
    want = np.asarray(tq.window_rows(k[:1], cache.k_codec), np.float32)
    np.testing.assert_allclose(np.asarray(new.k_window[0, :, 0], np.float32), want[0], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_rows_get_no_gradient_on_any_backend(rng, backend):
    cache = make_cache(rng, window=8, num_windows=2)
    k = jnp.asarray(rng.normal(size=(3, 2, 64)), jnp.float32)
    slots = jnp.asarray([0, 1, 2], jnp.int32)
    window_slots = jnp.asarray([0, 1, 2], jnp.int32)
    tables = jnp.asarray([[0, 1, 2], [3, 4, 5]], jnp.int32)
    lens = jnp.asarray([3, 3], jnp.int32)
    q = jnp.asarray(rng.normal(size=(2, 2, 64)), jnp.float32)
    with tq.use_backend(backend):
        via_write = jax.jit(jax.grad(
            lambda kk: tq.write_cache(cache, kk, kk, slots, window_slots).k_window.astype(jnp.float32).sum()))(k)
        via_decode = jax.jit(jax.grad(
            lambda w: tq.paged_decode(q, dataclasses.replace(cache, k_window=w), tables, lens).sum()))(cache.k_window)
    assert float(jnp.abs(via_write).max()) == 0.0 and float(jnp.abs(via_decode.astype(jnp.float32)).max()) == 0.0


def test_decode_steps_through_a_window_match_a_dense_float64_attention(rng):
    """write_cache + paged_decode one token at a time (the public API as a model uses it): while the
    sequence fits the window the output is exact attention over the bfloat16 rows."""
    cache = tq.PagedKVCache.create(num_pages=8, page_size=4, num_kv_heads=2, preset="k4v4", head_dim=64,
                                   num_windows=2)
    tables = np.arange(8, dtype=np.int32).reshape(2, 4)
    k = rng.normal(size=(12, 2, 2, 64)).astype(np.float32)
    v = rng.normal(size=(12, 2, 2, 64)).astype(np.float32)
    q = rng.normal(size=(12, 2, 4, 64)).astype(np.float32)
    step = jax.jit(lambda c, q, k, v, pos: tq.nn.paged_attention(q, k, v, c, tables[:, 0] * 4 + pos, tables,
                                                                   jnp.full((2,), pos + 1, jnp.int32)),
                   donate_argnums=0)
    for t in range(12):
        pos = jnp.full((2,), t, jnp.int32)
        out, cache = step(cache, q[t], k[t], v[t], pos)
        if t < 12:
            for s in range(2):
                keys = k[:t + 1, s].astype(np.float64)
                want = attend_f64(q[t, s], keys, v[:t + 1, s].astype(np.float64), np.ones(t + 1, bool), 1 / 8)
                assert rel_err(out[s], want) < 1.5e-2  # bfloat16 rows: ~2^-9 per element
    assert cache.window == 64 and t + 1 <= cache.window


def test_presets_and_create():
    assert set(tq.PRESETS) == {"k4v4", "k3v3", "k2v2"}
    p = tq.get_preset("K4V4")
    assert (p.k_bits, p.v_bits, p.scale, p.window, p.rotation) == (4, 4, "fit", 64, "hadamard")
    cache = tq.PagedKVCache.create(num_pages=3, page_size=16, num_kv_heads=2, preset="k3v3", head_dim=128,
                                   num_windows=4, seed=7)
    assert cache.k_codec == tq.TurboQuant(128, 3, 7, "hadamard", "fit")
    assert cache.v_codec == tq.TurboQuant(128, 3, 8, "hadamard", "fit")
    assert cache.k_window.shape == (4, 2, 64, 128) and cache.k_window.dtype == jnp.bfloat16
    assert cache.window_bytes() == 2 * 4 * 2 * 64 * 128 * 2
    assert cache.bytes_per_token() == 2 * (48 + 48 + 8)
    assert "k_window=bfloat16[4, 2, 64, 128]" in repr(cache)
    plain = tq.PagedKVCache.create(num_pages=3, page_size=16, num_kv_heads=2, preset="k2v2", head_dim=64,
                                   window=0)
    assert plain.k_window is None and plain.window == 0 and plain.window_bytes() == 0
    for kwargs, error, match in [
        (dict(preset="k5v5", head_dim=64, num_windows=1), ValueError, "unknown cache preset"),
        (dict(preset="k4v4", num_windows=1), ValueError, "needs head_dim"),
        (dict(preset="k4v4", head_dim=64), ValueError, "num_windows >= 1"),
        (dict(preset="k4v4", head_dim=64, num_windows=1, window=300), ValueError, "window must be in"),
        (dict(preset="k4v4", head_dim=64, num_windows=1, k_codec=tq.TurboQuant(64)), ValueError, "not both"),
        (dict(), ValueError, "pass k_codec and v_codec"),
        (dict(preset=4, head_dim=64, num_windows=1), TypeError, "preset must be"),
        (dict(preset="k4v4", head_dim=64, window=0, num_windows=2), ValueError, "without a window"),
        (dict(k_codec=tq.TurboQuant(64), v_codec=tq.TurboQuant(64), num_windows=2), ValueError, "without a window"),
        (dict(k_codec=tq.TurboQuant(64), v_codec=tq.TurboQuant(64), head_dim=64), ValueError, "go with a preset"),
        (dict(k_codec=tq.TurboQuant(64), v_codec=tq.TurboQuant(64), seed=3), ValueError, "go with a preset"),
    ]:
        with pytest.raises(error, match=match):
            tq.PagedKVCache.create(num_pages=3, page_size=16, num_kv_heads=2, **kwargs)


def test_window_arguments_are_checked_at_trace_time(rng):
    cache = make_cache(rng)
    plain = dataclasses.replace(cache, k_window=None, v_window=None)
    k = jnp.zeros((2, 2, 64))
    slots = jnp.asarray([0, 1], jnp.int32)
    with pytest.raises(ValueError, match="window_slots must be int32 \\[2\\] for a cache with a window"):
        tq.write_cache(cache, k, k, slots)
    with pytest.raises(ValueError, match="window_slots given but the cache has no window"):
        tq.write_cache(plain, k, k, slots, slots)
    with pytest.raises(TypeError, match="window_slots must be int32"):
        tq.write_cache(cache, k, k, slots, slots.astype(jnp.float32))
    q = jnp.zeros((2, 2, 64))
    tables, lens = jnp.zeros((2, 3), jnp.int32), jnp.ones((2,), jnp.int32)
    with pytest.raises(ValueError, match="window_ids given but the cache has no window"):
        tq.paged_decode(q, plain, tables, lens, window_ids=jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="window_ids must be int32 \\[num_seqs=2\\]"):
        tq.paged_decode(q, cache, tables, lens, window_ids=jnp.zeros(3, jnp.int32))
    with pytest.raises(TypeError, match="cache.k_window must be bfloat16"):
        tq.paged_decode(q, dataclasses.replace(cache, k_window=cache.k_window.astype(jnp.float32)), tables, lens)
    with pytest.raises(ValueError, match="both be arrays or both None"):
        tq.paged_decode(q, dataclasses.replace(cache, v_window=None), tables, lens)


def test_checked_mode_names_bad_window_ids_and_slots(rng):
    cache = make_cache(rng)
    q = jnp.zeros((2, 2, 64))
    tables = jnp.zeros((2, 3), jnp.int32)
    lens = jnp.asarray([0, 4], jnp.int32)
    err, _ = jax.jit(tq.checked(tq.paged_decode))(q, cache, tables, lens, window_ids=jnp.asarray([7, 3], jnp.int32))
    with pytest.raises(Exception, match=r"window_ids\[1\] = 3 is outside \[0, 3\) but sequence 1 has tokens"):
        err.throw()
    err, _ = jax.jit(tq.checked(tq.paged_decode))(q, cache, tables, lens, window_ids=jnp.asarray([7, 2], jnp.int32))
    err.throw()  # sequence 0 is empty: its id is never read
    k = jnp.zeros((2, 2, 64))
    err, _ = jax.jit(tq.checked(tq.write_cache))(cache, k, k, jnp.asarray([0, 1], jnp.int32),
                                                 jnp.asarray([-1, 15], jnp.int32))
    with pytest.raises(Exception, match=r"window_slots\[1\] = 15 is outside the window"):
        err.throw()


@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_over_caches_with_windows(rng, backend):
    caches = [make_cache(rng, seed=5) for _ in range(2)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *caches)
    tables = jnp.asarray(np.stack([rng.permutation(24)[:6] for _ in range(4)]).reshape(2, 2, 6).astype(np.int32))
    lens = jnp.asarray([[9, 30], [3, 17]], jnp.int32)
    ids = jnp.asarray([[0, 2], [1, 1]], jnp.int32)
    q = jnp.asarray(rng.normal(size=(2, 2, 4, 64)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(2, 2, 2, 64)), jnp.float32)
    slots = jnp.asarray([[5, 40], [7, -1]], jnp.int32)
    wslots = jnp.asarray([[0, 14], [4, 9]], jnp.int32)
    with tq.use_backend(backend):
        out = jax.vmap(lambda c, q, t, n, i: tq.paged_decode(q, c, t, n, window_ids=i))(stacked, q, tables, lens, ids)
        written = jax.jit(jax.vmap(tq.write_cache))(stacked, k, -k, slots, wslots)
        for b in range(2):
            want = tq.paged_decode(q[b], caches[b], tables[b], lens[b], window_ids=ids[b])
            assert rel_err(out[b], want) < 1e-6
            one = tq.write_cache(caches[b], k[b], -k[b], slots[b], wslots[b])
            for name in ("k_window", "v_window", "k_codes", "k_norms"):
                np.testing.assert_array_equal(np.asarray(getattr(written, name)[b]), np.asarray(getattr(one, name)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_gradient_with_a_window(rng, backend):
    """The gradient in q and the page norms flows through the reference on every backend; the
    window rows are bfloat16 copies without one."""
    cache = make_cache(rng)
    tables = jnp.asarray(np.stack([rng.permutation(24)[:6] for _ in range(2)]).astype(np.int32))
    lens = jnp.asarray([12, 30], jnp.int32)
    q = jnp.asarray(rng.normal(size=(2, 2, 64)), jnp.float32)

    def loss(q, k_norms):
        c = dataclasses.replace(cache, k_norms=k_norms)
        return jnp.sum(tq.paged_decode(q, c, tables, lens) * jnp.arange(64.0))

    with tq.use_backend(backend):
        dq, dk = jax.grad(loss, argnums=(0, 1))(q, cache.k_norms)
    with tq.use_backend("xla"):
        want_dq, want_dk = jax.grad(loss, argnums=(0, 1))(q, cache.k_norms)
    assert rel_err(dq, want_dq) < 1e-5 and rel_err(dk, want_dk) < 1e-5
    assert float(jnp.abs(dk).sum()) > 0  # the pages' tokens before the window get gradients


# --------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,rotation,group", [(128, "hadamard", 4), (128, "haar", 4), (64, "hadamard", 3),
                                                     (128, "hadamard", 1), (96, "haar", 4), (256, "haar", 2)])
@pytest.mark.parametrize("bits", [(4, 4), (3, 3), (2, 2)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_decode_with_a_window_matches_the_float64_oracle(request, rng, head_dim, rotation, group, bits, dtype):
    check_gpu_decode_with_a_window(request, rng, head_dim, rotation, group, bits, dtype, page_size=16,
                                   ids=[5, 4, 3, 2, 1, 0])


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,group,page_size", [(128, 4, 16), (128, 8, 8), (64, 2, 8)])
def test_gpu_decode_with_invalid_window_ids_and_any_page_size(request, rng, head_dim, group, page_size):
    """Ids outside [0, num_windows) drop the window's tokens; pages of 8 tokens run the tensor-core
    kernel's register variant (the window folded into its tile loop there too)."""
    check_gpu_decode_with_a_window(request, rng, head_dim, "hadamard", group, (4, 4), jnp.bfloat16,
                                   page_size=page_size, ids=[5, -1, 3, 6, 1, 0])


def check_gpu_decode_with_a_window(request, rng, head_dim, rotation, group, bits, dtype, *, page_size, ids):
    num_pages = 64 * 16 // page_size
    cache = make_cache(rng, head_dim=head_dim, num_kv_heads=2, page_size=page_size, num_pages=num_pages, window=64,
                       num_windows=6, k_bits=bits[0], v_bits=bits[1], rotation=rotation)
    width = 160 // page_size
    tables = np.stack([rng.permutation(num_pages)[:width] for _ in range(6)]).astype(np.int32)
    seq_lens = np.asarray([0, 1, 64, 65, 100, 160], np.int32)
    ids = np.asarray(ids, np.int32)
    q = rng.normal(size=(6, 2 * group, head_dim)).astype(np.float32)
    poison_device_memory(1 << 26)
    with kernel_backend(request, DECODE_TARGETS):
        for splits in (1, 3):
            out = jax.jit(tq.paged_decode, static_argnames="num_splits")(
                jnp.asarray(q, dtype), cache, tables, seq_lens, window_ids=ids, num_splits=splits)
            for s in range(6):
                keys, values, valid = sequence_tokens(cache, tables[s], seq_lens[s], ids[s])
                want = attend_f64(np.asarray(jnp.asarray(q[s], dtype), np.float64), keys, values, valid,
                                  1 / np.sqrt(head_dim))
                # bf16 output: its rounding alone is 1.5-1.9e-3 norm-wise (48 seeds x 4 cases on the H200)
                tol = 3e-3 if dtype == jnp.bfloat16 else 2e-5
                assert (rel_err(out[s], want) < tol) if valid.any() else np.all(np.asarray(out[s]) == 0), (s, splits)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("fit", ("norm", "fit"))
def test_gpu_write_cache_window_rows_match_the_cpu_s(request, rng, head_dim, fit):
    cache = make_cache(rng, head_dim=head_dim, window=64, num_windows=2, num_pages=8, page_size=16)
    cache = dataclasses.replace(cache, k_codec=tq.TurboQuant(head_dim, 4, 1, "hadamard", fit),
                                v_codec=tq.TurboQuant(head_dim, 3, 2, "hadamard", fit))
    k = jnp.asarray(rng.normal(size=(40, 2, head_dim)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(40, 2, head_dim)), jnp.bfloat16)
    slots = jnp.asarray(rng.permutation(128)[:40].astype(np.int32))
    wslots = jnp.asarray(np.where(np.arange(40) % 3 == 0, -1, rng.permutation(128)[:40]).astype(np.int32))
    with kernel_backend(request, ["jax_tq_write_cache"]):
        gpu = jax.jit(tq.write_cache)(cache, k, v, slots, wslots)
    cpu_device = jax.devices("cpu")[0]
    with jax.default_device(cpu_device), tq.use_backend("auto"):
        cpu = tq.write_cache(jax.device_put(cache, cpu_device), jax.device_put(k, cpu_device),
                             jax.device_put(v, cpu_device), jax.device_put(slots, cpu_device),
                             jax.device_put(wslots, cpu_device))
    for name in ("k_window", "v_window"):
        # The GPU rotates on the tensor cores (bf16 hi / lo products, ~2^-16 of the row's norm per
        # coordinate): a small coordinate's bf16 may differ by more than one of its own ulps.
        a, b = np.asarray(getattr(gpu, name), np.float32), np.asarray(getattr(cpu, name), np.float32)
        row = np.linalg.norm(b, axis=-1, keepdims=True)
        assert np.all(np.abs(a - b) <= np.abs(b) * 2.0 ** -7 + row * 2.0 ** -13), name
        assert rel_err(a, b) < 4e-3, name
    for name in ("k_norms", "v_norms"):
        same = np.asarray(gpu.k_codes == cpu.k_codes).all(-1) if name == "k_norms" else np.asarray(
            gpu.v_codes == cpu.v_codes).all(-1)
        assert same.mean() > 0.97
        np.testing.assert_allclose(np.asarray(getattr(gpu, name))[same], np.asarray(getattr(cpu, name))[same], rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,group", [(128, 4), (64, 3)])
def test_gpu_prefill_with_a_window_matches_the_float64_oracle(request, rng, head_dim, group):
    cache = make_cache(rng, head_dim=head_dim, num_kv_heads=2, page_size=16, num_pages=32, window=64, num_windows=3)
    tables = np.stack([rng.permutation(32)[:8] for _ in range(3)]).astype(np.int32)
    seq_lens = np.asarray([100, 40, 128], np.int32)   # chunked: 30 of 100 new; 40 of 40; 10 of 128
    starts = np.asarray([0, 30, 70, 80], np.int32)
    ids = np.asarray([2, 0, 1], np.int32)
    q = rng.normal(size=(80, 2 * group, head_dim)).astype(np.float32)
    poison_device_memory(1 << 26)
    with kernel_backend(request, ["jax_tq_paged_prefill"]):
        out = np.asarray(jax.jit(tq.paged_prefill)(q, cache, tables, seq_lens, starts, window_ids=ids))
    for s in range(3):
        keys, values, valid = sequence_tokens(cache, tables[s], seq_lens[s], ids[s])
        rows = range(starts[s], starts[s + 1])
        for i, row in enumerate(rows):
            n = seq_lens[s] - len(rows) + i + 1
            assert rel_err(out[row], attend_f64(q[row], keys[:n], values[:n], valid[:n], 1 / np.sqrt(head_dim))) < 2e-5
