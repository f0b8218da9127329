"""Checked mode: run-time index validation through checkify; without it, bad indices are harmless."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tq as tq
from oracle import decode_f64, random_cache, random_window_cache, rel_err


def _cache(rng):
    return random_cache(rng, num_pages=8, page_size=16, num_kv_heads=1, head_dim=64, k_bits=4, v_bits=4)


def test_checked_decode_passes_on_valid_input(rng):
    cache = _cache(rng)
    q = jnp.asarray(rng.normal(size=(2, 2, 64)), jnp.float32)
    tables = jnp.asarray([[0, 1, 99], [2, -1, -1]], jnp.int32)  # unused entries may hold anything
    lens = jnp.asarray([20, 16], jnp.int32)
    err, out = jax.jit(tq.checked(tq.paged_decode))(q, cache, tables, lens)
    err.throw()
    assert rel_err(out, decode_f64(np.asarray(q, np.float64), cache, tables, lens)) < 1e-5


@pytest.mark.parametrize("tables,lens,match", [
    ([[0, 9, 1], [2, 3, 4]], [20, 5], r"block_tables\[0, 1\] = 9"),
    ([[0, 1, 2], [2, -3, 4]], [5, 17], r"block_tables\[1, 1\] = -3"),
    ([[0, 1, 2], [3, 4, 5]], [5, 49], r"seq_lens\[1\] = 49"),
])
def test_checked_decode_reports_bad_indices(rng, tables, lens, match):
    cache = _cache(rng)
    q = jnp.asarray(rng.normal(size=(2, 2, 64)), jnp.float32)
    err, _ = jax.jit(tq.checked(tq.paged_decode))(q, cache, jnp.asarray(tables, jnp.int32), jnp.asarray(lens, jnp.int32))
    with pytest.raises(Exception, match=match):
        err.throw()


def test_checked_write_reports_slot_outside_pool(rng):
    cache = _cache(rng)
    k = jnp.asarray(rng.normal(size=(3, 1, 64)), jnp.float32)
    step = jax.jit(tq.checked(tq.write_cache))
    err, _ = step(cache, k, k, jnp.asarray([5, -1, 127], jnp.int32))
    err.throw()  # -1 is padding, 127 is the last slot: valid
    err, _ = step(cache, k, k, jnp.asarray([5, 128, 0], jnp.int32))
    with pytest.raises(Exception, match=r"slot_mapping\[1\] = 128"):
        err.throw()


def test_unchecked_bad_indices_are_skipped_not_read(rng):
    """Without checked mode an out-of-pool page contributes nothing (documented behaviour)."""
    cache = _cache(rng)
    q = jnp.asarray(rng.normal(size=(1, 2, 64)), jnp.float32)
    with tq.use_backend("ffi"):
        got = tq.paged_decode(q, cache, jnp.asarray([[3, 1000]], jnp.int32), jnp.asarray([32], jnp.int32))
    want = decode_f64(np.asarray(q, np.float64), cache, jnp.asarray([[3, 0]], jnp.int32), jnp.asarray([16], jnp.int32))
    assert rel_err(got, want) < 1e-5


def test_checked_accepts_a_jitted_function_without_poisoning_its_cache(rng):
    cache = _cache(rng)
    q = jnp.asarray(rng.normal(size=(1, 2, 64)), jnp.float32)
    step = jax.jit(lambda q, c, t, s: tq.paged_decode(q, c, t, s))
    good, bad = jnp.asarray([[0, 1]], jnp.int32), jnp.asarray([[0, 57]], jnp.int32)
    lens = jnp.asarray([20], jnp.int32)
    step(q, cache, good, lens)                       # traced unchecked first
    err, _ = tq.checked(step)(q, cache, bad, lens)   # still checked
    with pytest.raises(Exception, match=r"block_tables\[0, 1\] = 57"):
        err.throw()
    out = step(q, cache, good, lens)                 # and the plain jit still works
    assert np.all(np.isfinite(np.asarray(out)))


def test_checked_mode_on_empty_inputs(rng):
    """No sequence, no page column, no token: checked mode runs (it used to fail on argmax of an
    empty array); a positive length over a zero-width block table is still reported."""
    cache = _cache(rng)
    q = jnp.asarray(rng.normal(size=(2, 2, 64)), jnp.float32)
    decode = jax.jit(tq.checked(tq.paged_decode))
    err, out = decode(q[:0], cache, jnp.zeros((0, 3), jnp.int32), jnp.zeros((0,), jnp.int32))
    err.throw()
    assert out.shape == (0, 2, 64)
    err, out = decode(q, cache, jnp.zeros((2, 0), jnp.int32), jnp.zeros((2,), jnp.int32))
    err.throw()
    assert np.all(np.asarray(out) == 0)
    err, _ = decode(q, cache, jnp.zeros((2, 0), jnp.int32), jnp.asarray([0, 3], jnp.int32))
    with pytest.raises(Exception, match=r"seq_lens\[1\] = 3 is outside \[0, 0\]"):
        err.throw()
    none = jnp.zeros((0, 1, 64), jnp.float32)
    err, written = jax.jit(tq.checked(tq.write_cache))(cache, none, none, jnp.zeros((0,), jnp.int32))
    err.throw()
    assert np.array_equal(np.asarray(written.k_codes), np.asarray(cache.k_codes))


@pytest.mark.parametrize("backend", ["ffi", "xla"])
def test_checked_mode_traces_for_pools_beyond_int32(backend):
    """A pool of 2**32 slots (or a block table of 2**31 tokens) is past int32: the checks' static
    bounds must not be passed as int32 (OverflowError at trace time). Lowered only: no memory."""
    codec = tq.TurboQuant(64, 2)
    pages, page_size = 2**24, 256
    spec = jax.ShapeDtypeStruct
    cache = tq.PagedKVCache(k_codes=spec((pages, 1, page_size, 16), jnp.uint8), k_norms=spec((pages, 1, page_size), jnp.float32),
                            v_codes=spec((pages, 1, page_size, 16), jnp.uint8), v_norms=spec((pages, 1, page_size), jnp.float32),
                            k_codec=codec, v_codec=codec)
    kv, slots = spec((2, 1, 64), jnp.float32), spec((2,), jnp.int32)
    q, tables, lens = spec((1, 1, 64), jnp.float32), spec((1, 2**23), jnp.int32), spec((1,), jnp.int32)
    with tq.use_backend(backend):
        for fn in (tq.write_cache, tq.checked(tq.write_cache)):
            jax.jit(fn).lower(cache, kv, kv, slots)
        for fn in (tq.paged_decode, tq.checked(tq.paged_decode)):
            jax.jit(fn).lower(q, cache, tables, lens)


def test_grad_inside_the_check_works_and_outside_it_says_why(rng):
    """checked(jax.grad(f)) checks and differentiates; jax.grad of a checked paged_decode (which JAX
    cannot serve: it hands the backward pass checkify's state for the residuals) raises a TypeError
    that says what to do instead."""
    cache = _cache(rng)
    q = jnp.asarray(rng.normal(size=(2, 2, 64)), jnp.float32)
    tables, lens = jnp.asarray([[0, 1], [2, 3]], jnp.int32), jnp.asarray([20, 9], jnp.int32)

    def loss(q):
        return tq.paged_decode(q, cache, tables, lens).sum()

    err, grad = jax.jit(tq.checked(jax.grad(loss)))(q)
    err.throw()
    with tq.use_backend("xla"):
        want = jax.grad(lambda q: tq.paged_decode(q, cache, tables, lens).sum())(q)
    assert rel_err(grad, want) < 1e-5
    with pytest.raises(TypeError, match=r"jax.grad of a checked function \(here of its paged_decode.*is not supported.*checked\(jax.grad\(f\)\)"):
        jax.jit(jax.grad(lambda q: tq.checked(tq.paged_decode)(q, cache, tables, lens)[1].sum()))(q)


def test_checked_mode_names_bad_window_ids_and_slots(rng):
    cache = random_window_cache(rng)
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


def test_checked_mode_accepts_pages_freed_before_a_sliding_window(rng):
    """With a sliding window, pages wholly before the first query row's window may be freed (-1):
    checked mode accepts them, the outputs equal those over the real pages, and a freed page inside
    the window is still reported."""
    cache = _cache(rng)
    q = jnp.asarray(rng.normal(size=(3, 2, 64)), jnp.float32)
    full = jnp.asarray([[3, 4, 5, 6]], jnp.int32)
    lens, starts = jnp.asarray([60], jnp.int32), jnp.asarray([0, 3], jnp.int32)  # prefill rows at 57, 58, 59
    decode = jax.jit(tq.checked(lambda q, t: tq.paged_decode(q, cache, t, lens, sliding_window=20)))
    prefill = jax.jit(tq.checked(lambda q, t: tq.paged_prefill(q, cache, t, lens, starts, sliding_window=20)))
    freed = jnp.asarray([[-1, -1, 5, 6]], jnp.int32)  # tokens 0-31: before position 59 - 19 = 40 and 57 - 19 = 38
    for call, rows in ((decode, q[:1]), (prefill, q)):
        err, got = call(rows, freed)
        err.throw()
        _, want = call(rows, full)
        assert np.all(np.isfinite(np.asarray(want)))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        err, _ = call(rows, jnp.asarray([[-1, 4, -1, 6]], jnp.int32))  # tokens 32-47: inside the window
        with pytest.raises(Exception, match=r"block_tables\[0, 2\] = -1 .*inside its sliding window"):
            err.throw()
    err, _ = jax.jit(tq.checked(lambda q, t: tq.paged_prefill(q, cache, t, lens, starts, sliding_window=27)))(q, freed)
    with pytest.raises(Exception, match=r"block_tables\[0, 1\] = -1"):  # row 57 sees position 31
        err.throw()
