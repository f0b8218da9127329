"""What the public ops share (backend "ffi"): empty batches, inputs left as they were without
donation, NumPy int64 indices refused, the errors the docstrings promise."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tq as tq

from oracle import decode_args, random_cache, small_cache

pytestmark = pytest.mark.backend("ffi")


_decode = jax.jit(tq.paged_decode, static_argnames=("scale", "num_splits"))


_write = jax.jit(tq.write_cache)


def test_empty_batches(rng):
    codec = tq.TurboQuant(head_dim=64, bits=2)
    cache = random_cache(rng, num_pages=3, page_size=8, num_kv_heads=2, head_dim=64, k_bits=2, v_bits=4)
    # decompress: no rows, directly and under vmap.
    x = tq.decompress(jnp.zeros((0, 16), jnp.uint8), jnp.zeros((0,), jnp.float32), codec, jnp.bfloat16)
    assert x.shape == (0, 64) and x.dtype == jnp.bfloat16
    x = jax.vmap(lambda c, n: tq.decompress(c, n, codec), in_axes=(0, 0))(jnp.zeros((0, 3, 16), jnp.uint8),
                                                                        jnp.zeros((0, 3), jnp.float32))
    assert x.shape == (0, 3, 64)
    codes, norms = jax.jit(lambda x: tq.compress(x, codec))(jnp.zeros((2, 0, 64), jnp.float16))
    assert codes.shape == (2, 0, 16) and norms.shape == (2, 0)
    # write_cache: zero tokens leaves the cache as it was; a vmap of size 0 gives empty pools.
    new = _write(cache, jnp.zeros((0, 2, 64), jnp.float32), jnp.zeros((0, 2, 64), jnp.float32),
                 jnp.zeros((0,), jnp.int32))
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(cache)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    empty = jax.vmap(tq.write_cache, in_axes=(None, 0, 0, 0))(
        cache, jnp.zeros((0, 5, 2, 64), jnp.float32), jnp.zeros((0, 5, 2, 64), jnp.float32),
        jnp.zeros((0, 5), jnp.int32))
    assert empty.k_codes.shape == (0,) + cache.k_codes.shape and empty.v_norms.shape == (0,) + cache.v_norms.shape
    # paged_decode: no sequences; and sequences over an empty block table (no pages: zero output).
    out = _decode(jnp.zeros((0, 4, 64), jnp.float32), cache, jnp.zeros((0, 2), jnp.int32), jnp.zeros((0,), jnp.int32))
    assert out.shape == (0, 4, 64)
    q = jnp.asarray(rng.normal(size=(2, 4, 64)), jnp.float32)
    out = _decode(q, cache, jnp.zeros((2, 0), jnp.int32), jnp.asarray([0, 5], jnp.int32))
    assert out.shape == (2, 4, 64) and np.all(np.asarray(out) == 0)


@pytest.mark.parametrize("backend", ["ffi", "xla"])
def test_vmap_of_size_zero_over_the_attention_ops(rng, backend):
    """jax.vmap over a batch of 0 (legal in JAX) gives empty outputs for prefill and the serving call
    over a shared cache or a cache per element, with and without windows (the batching rules took
    element 0 of their inputs: IndexError; a fresh helper's trial)."""
    heads, d = 4, 64
    plain = random_cache(rng, num_pages=4, page_size=4, num_kv_heads=2, head_dim=d, k_bits=4, v_bits=4)
    windowed = tq.PagedKVCache.create(num_pages=4, page_size=4, num_kv_heads=2, preset="k4v4", head_dim=d,
                                      num_windows=1)
    tables, lens, starts = jnp.asarray([[0, 1]], jnp.int32), jnp.asarray([3], jnp.int32), jnp.asarray([0, 3], jnp.int32)
    per_element = lambda c, n: jax.tree.map(lambda x: jnp.broadcast_to(x[None], (n,) + x.shape), c)  # noqa: E731

    def prefill(q, c):
        return tq.paged_prefill(q, c, tables, lens, starts)

    def ragged(q, c):
        kv = q[:, :2]
        return tq.ragged_paged_attention(q, kv, kv, c, lens, tables, starts)[0]

    def decode(q, c):
        return tq.paged_decode(q[:1], c, tables, lens)

    with tq.use_backend(backend):
        for cache in (plain, windowed):
            for fn in (prefill, ragged, decode):
                for n in (2, 0):
                    q = jnp.asarray(rng.normal(size=(n, 3, heads, d)), jnp.float32)
                    rows = 1 if fn is decode else 3
                    shared = jax.vmap(fn, in_axes=(0, None))(q, cache)
                    own = jax.vmap(fn)(q, per_element(cache, n))
                    assert shared.shape == own.shape == (n, rows, heads, d), (fn.__name__, n)
                    if n:  # the batch's results are each element's
                        np.testing.assert_allclose(np.asarray(own[1]), np.asarray(fn(q[1], cache)), rtol=1e-5, atol=1e-6)


def test_numpy_int64_indices_are_refused_not_wrapped():
    """With x64 off, jnp.asarray casts NumPy int64 to int32, so 2^32 + 5 would have become slot /
    page 5 and a seq_len of 2^32 zero; they are refused with the dtype the caller passed
    (new-user trial 16)."""
    assert not jax.config.jax_enable_x64
    cache = small_cache(num_kv_heads=1)
    q, tables, lens = decode_args(num_heads=2)
    k = np.ones((1, 1, 64), np.float32)
    before = np.asarray(cache.k_norms).copy()
    with pytest.raises(TypeError, match=r"write_cache: slot_mapping must be int32 \[1\], got int64\(1,\)"):
        tq.write_cache(cache, k, k, np.array([2**32 + 5], np.int64))
    np.testing.assert_array_equal(np.asarray(cache.k_norms), before)
    with pytest.raises(TypeError, match=r"block_tables must be int32 \[num_seqs=2, max_pages\], got int64\(2, 1\)"):
        tq.paged_decode(q, cache, np.full((2, 1), 2**32 + 1, np.int64), lens)
    with pytest.raises(TypeError, match=r"seq_lens must be int32 \[num_seqs=2\], got int64\(2,\)"):
        tq.paged_decode(q, cache, tables, np.full((2,), 2**32, np.int64))
    with pytest.raises(TypeError, match=r"block_tables must be int32 .*, got float64\(2, 3\)"):
        tq.paged_decode(q, cache, np.zeros((2, 3)), lens)
    # Python lists / ints past int32 name the argument (jnp.asarray's bare OverflowError did not)
    with pytest.raises(ValueError, match=r"paged_decode: seq_lens must be int32 \[num_seqs=2\], got 4294967296, outside"):
        tq.paged_decode(q, cache, tables, [5, 2**32])
    with pytest.raises(ValueError, match=r"write_cache: slot_mapping must be int32 \[1\], got -2147483649, outside"):
        tq.write_cache(cache, k, k, [-2**31 - 1])
    with pytest.raises(ValueError, match=r"ragged_paged_attention: kv_lens must be int32 .*, got an integer outside"):
        tq.ragged_paged_attention(q[:1], k, k, cache, [2**70], tables[:1], [0, 1])
    # NumPy int32 and Python lists stay accepted
    out = tq.paged_decode(q, cache, np.asarray(tables), [5, 5])
    assert out.shape == q.shape
    tq.write_cache(cache, k, k, np.array([5], np.int32))


def _snapshot(tree):
    return [np.array(x, copy=True) for x in jax.tree.leaves(tree)]


def _assert_unchanged(before, tree):
    after = jax.tree.leaves(tree)
    assert len(before) == len(after)
    for a, b in zip(before, after):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == np.asarray(b).tobytes()


@pytest.mark.parametrize("jit", [False, True])
def test_inputs_are_not_modified_without_donation(rng, jit):
    cache = random_cache(rng, num_pages=4, page_size=8, num_kv_heads=2, head_dim=64, k_bits=4, v_bits=2)
    k = jnp.asarray(rng.normal(size=(5, 2, 64)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(5, 2, 64)), jnp.float32)
    slots = jnp.asarray([0, 9, -1, 31, 100], jnp.int32)
    q = jnp.asarray(rng.normal(size=(2, 4, 64)), jnp.float32)
    tables = jnp.asarray([[3, 0, 1, 2], [1, -1, 7, 2]], jnp.int32)
    lens = jnp.asarray([29, 8], jnp.int32)
    wrap = jax.jit if jit else (lambda f: f)
    before = _snapshot((cache, k, v, slots))
    new = wrap(tq.write_cache)(cache, k, v, slots)
    jax.block_until_ready(new)
    _assert_unchanged(before, (cache, k, v, slots))
    assert not np.array_equal(np.asarray(new.v_codes), before[2])  # the write happened (on a copy)
    before = _snapshot((q, new, tables, lens))
    out = wrap(tq.paged_decode)(q, new, tables, lens)
    jax.block_until_ready(out)
    _assert_unchanged(before, (q, new, tables, lens))
    assert np.abs(np.asarray(out)).max() > 0
    codes, norms = wrap(tq.compress)(v, new.v_codec)
    before = _snapshot((v, codes, norms))
    x_hat = wrap(tq.decompress)(codes, norms, new.v_codec)
    jax.block_until_ready((codes, norms, x_hat))
    _assert_unchanged(before, (v, codes, norms))


def test_api_errors_found_by_the_docs_audit():
    """Errors the docstrings promise, with the argument named (a docs audit found them raised as
    AttributeError / unnamed ValueError or not at all)."""
    codec = tq.TurboQuant(64, 4)
    cache = tq.PagedKVCache.create(num_pages=2, page_size=4, num_kv_heads=1, k_codec=codec, v_codec=codec)
    with pytest.raises(TypeError, match=r"jax_tq.decompress: dtype must be float32, bfloat16 or float16, got 'foo'"):
        tq.decompress(jnp.zeros((2, 32), jnp.uint8), jnp.ones((2,)), codec, dtype="foo")
    # Not arrays at all (JAX's own errors named neither the argument nor the op):
    with pytest.raises(TypeError, match=r"jax_tq.compress: x must be an array, got NoneType"):
        tq.compress(None, codec)
    with pytest.raises(TypeError, match=r"jax_tq.compress: x must be an array, got TurboQuant"):
        tq.compress(codec, jnp.ones((2, 64)))  # arguments swapped
    with pytest.raises(TypeError, match=r"jax_tq.decompress: norms must be an array, got str"):
        tq.decompress(jnp.zeros((2, 32), jnp.uint8), "norms", codec)
    with pytest.raises(TypeError, match=r"jax_tq.window_rows: x must be an array, got NoneType"):
        tq.window_rows(None, codec)
    with pytest.raises(TypeError, match=r"nn.turboquant_attention_fn: k_codec must be a jax_tq.TurboQuant"):
        tq.nn.turboquant_attention_fn(None, codec)
    q, tables, lens = jnp.ones((1, 1, 64)), jnp.zeros((1, 2), jnp.int32), jnp.array([3], jnp.int32)
    with pytest.raises(TypeError, match=r"jax_tq.paged_decode: cache.k_codec must be a jax_tq.TurboQuant"):
        tq.paged_decode(q, dataclasses.replace(cache, k_codec=None), tables, lens)
    with pytest.raises(ValueError, match=r"jax_tq.paged_decode: cache.v_codec.bits"):
        tq.paged_decode(q, dataclasses.replace(cache, v_codec=tq.TurboQuant(64, 1)), tables, lens)
    with pytest.raises(ValueError, match=r"bits"):
        tq.reference.decompress(jnp.zeros((2, 40), jnp.uint8), jnp.ones((2,)), codec.rotation, codec.centroids, 5)
    with pytest.raises(TypeError, match=r"dtype must be a float dtype, got int32"):
        tq.reference.decompress(jnp.zeros((2, 32), jnp.uint8), jnp.ones((2,)), codec.rotation, codec.centroids, 4,
                                dtype=jnp.int32)
    with pytest.raises(TypeError, match=r"y must have a floating dtype"):
        tq.reference.quantize_rotated(jnp.zeros((2, 64), jnp.int32), codec.centroids)


def test_xla_backend_programs_serialize_and_kernel_ones_are_refused(rng):
    """jax.export of paged_decode over a cache (codecs in its tree) serializes under the xla backend
    and the deserialized call equals the jitted one; under ffi jax.export refuses the kernel."""
    from jax import export
    cache = random_cache(rng, num_pages=6, page_size=4, num_kv_heads=2, head_dim=64, k_bits=4, v_bits=3)
    q = jnp.asarray(rng.normal(size=(2, 4, 64)), jnp.float32)
    tables, lens = jnp.asarray([[0, 1, 2], [3, 4, 5]], jnp.int32), jnp.asarray([9, 12], jnp.int32)
    with tq.use_backend("xla"):
        exported = export.export(jax.jit(tq.paged_decode))(q, cache, tables, lens)
        want = np.asarray(jax.jit(lambda *a: tq.paged_decode(*a))(q, cache, tables, lens))
    got = np.asarray(export.deserialize(exported.serialize()).call(q, cache, tables, lens))
    assert np.abs(want).max() > 0
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    with tq.use_backend("ffi"), pytest.raises(ValueError, match="custom calls whose targets have no compatibility"):
        export.export(jax.jit(lambda *a: tq.paged_decode(*a)))(q, cache, tables, lens).serialize()
