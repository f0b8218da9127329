"""The uncompressed page layout (``PagedKVCache.create(preset="none")``): write_cache, paged_decode
and paged_prefill against a float64 oracle on fresh random inputs, and its argument checks."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tq as tq
from oracle import rel_err, to_f64

#: Relative error of an output against the float64 oracle: float32 accumulation, or a bfloat16 result.
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def _poisoned_cache(num_pages, page_size, num_kv_heads, head_dim, dtype):
    """An uncompressed cache whose every slot holds NaN: a slot read that should not be shows up."""
    cache = tq.PagedKVCache.create(num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv_heads,
                                   preset="none", head_dim=head_dim, dtype=dtype)
    nan = jnp.full(cache.k_pages.shape, jnp.nan, dtype)
    return tq.PagedKVCache(k_pages=nan, v_pages=nan)


def _slots(tables, lens, page_size):
    """int32 slot of every cached token, sequence after sequence ([sum(lens)])."""
    return np.concatenate([np.asarray(tables)[s, np.arange(n) // page_size] * page_size + np.arange(n) % page_size
                           for s, n in enumerate(lens)]).astype(np.int32)


def _filled(rng, lens, *, page_size, num_kv_heads, head_dim, dtype):
    """(cache, block_tables, per-sequence K and V float64 [n, Hkv, d] as stored) with each sequence's
    tokens written by one write_cache call, in pages of a NaN pool."""
    needed = [-(-n // page_size) for n in lens]
    num_pages = sum(needed) + 3
    tables = rng.integers(-5, num_pages + 5, (len(lens), max(needed) + 1)).astype(np.int32)  # garbage past the pages
    pages = rng.permutation(num_pages)
    for s, (start, n) in enumerate(zip(np.cumsum([0, *needed]), needed)):
        tables[s, :n] = pages[start:start + n]  # distinct pages for every sequence
    total = int(sum(lens))
    k, v = (jnp.asarray(rng.standard_normal((total, num_kv_heads, head_dim)), dtype) for _ in range(2))
    cache = _poisoned_cache(num_pages, page_size, num_kv_heads, head_dim, dtype)
    cache = tq.write_cache(cache, k, v, jnp.asarray(_slots(tables, lens, page_size)))
    bounds = np.cumsum([0, *lens])
    split = [(to_f64(k)[a:b], to_f64(v)[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    return cache, jnp.asarray(tables), split


def _attention_f64(q, k, v, scale):
    """Causal-free softmax attention of q [rows, H, d] over k, v [n, Hkv, d] in float64 (GQA)."""
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = np.einsum("rhd,nhd->rhn", q, k) * scale
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("rhn,nhd->rhd", weights / weights.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("page_size,num_heads,num_kv_heads", [(1, 4, 2), (3, 6, 3), (16, 8, 1)])
def test_write_then_decode_matches_float64_oracle(rng, dtype, page_size, num_heads, num_kv_heads):
    """Each sequence's query attends to exactly its written tokens (GQA), never to the NaN slots
    around them or to the garbage ids past its pages; an empty sequence gives a zero row."""
    head_dim, lens = 16, [int(n) for n in rng.integers(1, 40, 3)] + [0]
    cache, tables, kv = _filled(rng, lens, page_size=page_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                dtype=dtype)
    q = jnp.asarray(rng.standard_normal((len(lens), num_heads, head_dim)), dtype)
    scale = float(rng.uniform(0.1, 0.5))
    out = jax.jit(tq.paged_decode, static_argnames="scale")(q, cache, tables, jnp.asarray(lens, jnp.int32),
                                                             scale=scale)
    assert out.dtype == dtype and out.shape == q.shape
    want = [_attention_f64(to_f64(q)[s:s + 1], k, v, scale)[0] for s, (k, v) in enumerate(kv[:-1])]
    assert rel_err(out[:-1], np.stack(want)) < TOLERANCE[dtype]
    assert not np.any(np.asarray(out[-1], np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("page_size,num_heads,num_kv_heads", [(1, 2, 2), (5, 6, 2), (16, 4, 1)])
def test_write_then_prefill_matches_float64_oracle(rng, dtype, page_size, num_heads, num_kv_heads):
    """Chunked prefill: each sequence's last q_len tokens are new rows; row i of a sequence attends
    causally to its tokens [0, its position]; a row that no sequence owns is 0."""
    head_dim, lens = 8, [int(n) for n in rng.integers(1, 30, 3)]
    cache, tables, kv = _filled(rng, lens, page_size=page_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                dtype=dtype)
    q_lens = [int(rng.integers(1, n + 1)) for n in lens]
    starts = np.cumsum([0, *q_lens]).astype(np.int32)
    rows = int(starts[-1]) + 1  # one more row than the sequences own
    q = jnp.asarray(rng.standard_normal((rows, num_heads, head_dim)), dtype)
    out = tq.paged_prefill(q, cache, tables, jnp.asarray(lens, jnp.int32), jnp.asarray(starts))
    assert out.dtype == dtype and out.shape == q.shape
    scale = 1.0 / np.sqrt(head_dim)
    want = []
    for s, ((k, v), n, q_len) in enumerate(zip(kv, lens, q_lens)):
        for i in range(q_len):
            position = n - q_len + i
            row = to_f64(q)[starts[s] + i:starts[s] + i + 1]
            want.append(_attention_f64(row, k[:position + 1], v[:position + 1], scale)[0])
    assert rel_err(out[:-1], np.stack(want)) < TOLERANCE[dtype]
    assert not np.any(np.asarray(out[-1], np.float32))


@pytest.mark.parametrize("backend", ["ffi", "xla"])
def test_prefill_of_no_rows_or_no_sequences_is_empty(rng, backend):
    """0 query rows (with or without sequences): an empty output, as compressed caches give (the
    reference's reshapes divided by 0: ZeroDivisionError)."""
    cache, tables, _ = _filled(rng, [5, 9], page_size=4, num_kv_heads=2, head_dim=8, dtype=jnp.float32)
    lens = jnp.asarray([5, 9], jnp.int32)
    with tq.use_backend(backend):
        for q, t, n, starts in ((jnp.zeros((0, 4, 8)), tables, lens, jnp.zeros(3, jnp.int32)),
                                (jnp.zeros((0, 4, 8)), tables[:0], lens[:0], jnp.zeros(1, jnp.int32))):
            out = tq.paged_prefill(q, cache, t, n, starts)
            assert out.shape == (0, 4, 8) and out.dtype == jnp.float32
        q = jnp.asarray(rng.standard_normal((3, 4, 8)), jnp.float32)  # rows, no sequence: zeros
        out = tq.paged_prefill(q, cache, tables[:0], lens[:0], jnp.zeros(1, jnp.int32))
        assert out.shape == (3, 4, 8) and not np.any(np.asarray(out))


def test_write_cache_rounds_to_the_pages_and_skips_padding(rng):
    """Rows are stored in the pages' dtype at their slots; slots -1 and past the pool write nothing."""
    cache = tq.PagedKVCache.create(num_pages=2, page_size=3, num_kv_heads=1, preset="none", head_dim=4,
                                   dtype=jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((4, 1, 4)), jnp.float32)
    cache = tq.write_cache(cache, k, -k, jnp.asarray([4, -1, 6, 0], jnp.int32))
    pages = np.asarray(cache.k_pages.astype(jnp.float32)).reshape(6, 4)
    rounded = np.asarray(k.astype(jnp.bfloat16).astype(jnp.float32))[:, 0]
    np.testing.assert_array_equal(pages[[4, 0]], rounded[[0, 3]])
    assert not np.any(pages[[1, 2, 3, 5]])
    np.testing.assert_array_equal(np.asarray(cache.v_pages.astype(jnp.float32)).reshape(6, 4), -pages)
    assert cache.k_pages.dtype == jnp.bfloat16 and cache.bytes_per_token() == 2 * 4 * 2


def test_uncompressed_layout_refuses_what_does_not_fit():
    """Bad arguments raise at trace time, naming the argument."""
    def create(**kw):
        return tq.PagedKVCache.create(**(dict(num_pages=2, page_size=4, num_kv_heads=2, preset="none",
                                              head_dim=8) | kw))

    with pytest.raises(ValueError, match="dtype must be float32, bfloat16 or float16"):
        create(dtype=jnp.int8)
    with pytest.raises(ValueError, match="takes no seed, window or num_windows"):
        create(window=4, num_windows=1)
    with pytest.raises(ValueError, match="needs head_dim"):
        create(head_dim=None)
    with pytest.raises(ValueError, match="dtype goes with preset='none'"):
        create(preset="k4v4", dtype=jnp.float32)
    codec = tq.TurboQuant(64, 4)  # silently ignored before: an uncompressed cache came back
    for codecs in (dict(k_codec=codec, v_codec=codec), dict(k_codec=codec), dict(v_codec=codec)):
        with pytest.raises(ValueError, match=r"pass either k_codec / v_codec or preset, not both \(preset='none'"):
            create(**codecs)
    cache = create()
    k = jnp.zeros((3, 2, 8))
    with pytest.raises(ValueError, match=r"write_cache: v has shape \(3, 2, 4\)"):
        tq.write_cache(cache, k, k[..., :4], jnp.zeros(3, jnp.int32))
    with pytest.raises(TypeError, match="slot_mapping must be int32"):
        tq.write_cache(cache, k, k, np.zeros(3, np.int64))
    with pytest.raises(ValueError, match="window_slots given but the cache has no window"):
        tq.write_cache(cache, k, k, jnp.zeros(3, jnp.int32), jnp.zeros(3, jnp.int32))
    tables, lens = jnp.zeros((1, 2), jnp.int32), jnp.ones(1, jnp.int32)
    with pytest.raises(ValueError, match="q has head_dim 4 but the cache's pages have head_dim 8"):
        tq.paged_decode(jnp.zeros((1, 2, 4)), cache, tables, lens)
    with pytest.raises(ValueError, match="not a positive multiple of the cache's num_kv_heads 2"):
        tq.paged_decode(jnp.zeros((1, 3, 8)), cache, tables, lens)
    with pytest.raises(ValueError, match="window_ids given but the cache has no window"):
        tq.paged_prefill(jnp.zeros((1, 2, 8)), cache, tables, lens, jnp.asarray([0, 1], jnp.int32),
                         window_ids=jnp.zeros(1, jnp.int32))
    with pytest.raises(TypeError, match="cache.v_pages is float32"):
        tq.paged_decode(jnp.zeros((1, 2, 8)), tq.PagedKVCache(k_pages=cache.k_pages.astype(jnp.bfloat16),
                                                               v_pages=cache.v_pages), tables, lens)
    with pytest.raises(TypeError, match="needs both k_pages and v_pages"):
        tq.paged_decode(jnp.zeros((1, 2, 8)), tq.PagedKVCache(k_pages=cache.k_pages), tables, lens)


def test_a_non_finite_query_row_gives_nan_as_in_compressed_caches(rng):
    """Found by a review: a NaN query over an empty sequence gave 0 here and NaN from a compressed
    cache; rows with tokens and a finite q are unaffected."""
    cache = tq.PagedKVCache.create(num_pages=4, page_size=4, num_kv_heads=2, preset="none", head_dim=8)
    k = jnp.asarray(rng.normal(size=(6, 2, 8)), jnp.float32)
    cache = tq.write_cache(cache, k, k, jnp.arange(6, dtype=jnp.int32))
    q = jnp.asarray(rng.normal(size=(3, 4, 8)), jnp.float32).at[0, 1, 3].set(jnp.nan).at[2, 0, 0].set(jnp.inf)
    tables = jnp.asarray([[0, 1], [0, 1], [2, 3]], jnp.int32)
    out = np.asarray(tq.paged_decode(q, cache, tables, jnp.asarray([0, 6, 0], jnp.int32)))
    bad = np.zeros((3, 4), bool)
    bad[0, 1] = bad[2, 0] = True
    assert np.isnan(out[bad]).all()
    assert (out[0, [0, 2, 3]] == 0).all() and (out[2, 1:] == 0).all()  # no token: 0
    assert np.isfinite(out[1]).all() and np.abs(out[1]).max() > 0


@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_a_nan_query_row_leaves_the_other_gradients_as_with_a_finite_one(rng, op):
    """A NaN query in a row of no sequence (prefill's padding) or in a row the loss masks out: the
    gradients in q, K and V equal those with a finite query there, as with compressed caches (they
    were NaN for every token: 0 x NaN in dK; a fresh helper's trial). The masked row's output is NaN,
    the padding row's 0."""
    cache = tq.PagedKVCache.create(num_pages=4, page_size=4, num_kv_heads=2, preset="none", head_dim=8)
    tables, lens = jnp.asarray([[0, 1], [2, 3]], jnp.int32), jnp.asarray([6, 5], jnp.int32)
    slots = jnp.asarray(_slots(tables, [6, 5], 4))
    k, v = (jnp.asarray(rng.normal(size=(11, 2, 8)), jnp.float32) for _ in range(2))
    if op == "decode":
        q = jnp.asarray(rng.normal(size=(2, 4, 8)), jnp.float32)
        nan_rows = [(0, 1)]  # (row, head) the loss masks out
        attend = lambda q, c: tq.paged_decode(q, c, tables, lens)  # noqa: E731
    else:  # rows 0-2: sequence 0, rows 3-4: sequence 1, row 5: none
        q = jnp.asarray(rng.normal(size=(6, 4, 8)), jnp.float32)
        nan_rows = [(1, 2), (5, 0)]
        attend = lambda q, c: tq.paged_prefill(q, c, tables, lens, jnp.asarray([0, 3, 5], jnp.int32))  # noqa: E731
    masked = jnp.zeros(q.shape[:2] + (1,), bool)
    for row, head in nan_rows:
        masked = masked.at[row, head].set(True)

    def loss(q, k, v):
        out = attend(q, tq.write_cache(cache, k, v, slots))
        return jnp.sum(jnp.where(masked, 0.0, out) ** 2)

    poisoned = q
    for row, head in nan_rows:
        poisoned = poisoned.at[row, head, 3].set(jnp.nan)
    for backend in ("ffi", "xla"):
        with tq.use_backend(backend):
            grads = jax.grad(loss, argnums=(0, 1, 2))(poisoned, k, v)
            clean = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
            out = np.asarray(attend(poisoned, tq.write_cache(cache, k, v, slots)))
        for got, want in zip(grads, clean):
            assert np.abs(np.asarray(want)).max() > 0
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)
        assert np.isnan(out[nan_rows[0]]).all()
        if op == "prefill":
            assert (out[5] == 0).all()


def test_checked_mode_names_a_bad_block_table_entry():
    """jax_tq.checked reports an out-of-pool page of the uncompressed layout as of the compressed one."""
    cache = tq.PagedKVCache.create(num_pages=2, page_size=4, num_kv_heads=1, preset="none", head_dim=8)
    err, _ = jax.jit(tq.checked(tq.paged_decode))(jnp.ones((1, 1, 8)), cache, jnp.asarray([[0, 7]], jnp.int32),
                                                  jnp.asarray([6], jnp.int32))
    with pytest.raises(Exception, match=r"block_tables\[0, 1\] = 7 is outside the pool"):
        err.throw()
