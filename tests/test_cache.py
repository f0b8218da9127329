"""PagedKVCache and write_cache (the kernels, CPU here, CUDA on a GPU machine): the written slots
against the float64 oracle and everything else untouched, donation, vmap, gradients, the window rows
and presets, the refusals of bad caches and arguments; marked gpu, the CUDA kernel into poisoned
pools."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tq as tq
from jax_tq import _compat
from jax_tq.compress import write_cache_p

from conftest import kernel_backend, slow_unless
from oracle import (close_centroids, codes_agree, compress_f64, decode_args, decode_setup, jaxpr_count, primitive_count,
                    random_cache, random_window_cache, rel_err, small_cache)

pytestmark = pytest.mark.backend("ffi")


@pytest.mark.parametrize("head_dim,k_bits,v_bits,page_size,num_kv_heads", slow_unless(
    [(64, 4, 4, 16, 3), (80, 3, 2, 8, 2), (96, 2, 4, 48, 1), (128, 4, 2, 16, 2), (192, 3, 3, 8, 1), (256, 4, 3, 32, 2)],
    lambda head_dim, *_: head_dim in (64, 128)))
def test_write_cache_matches_f64_and_keeps_other_slots(rng, head_dim, k_bits, v_bits, page_size, num_kv_heads):
    num_pages, num_tokens = 6, 20
    cache = random_cache(rng, num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, k_bits=k_bits, v_bits=v_bits)  # random bytes = poison
    slots = rng.choice(num_pages * page_size, size=num_tokens, replace=False).astype(np.int32)
    slots[3] = -1                      # padding token: skipped
    slots[7] = num_pages * page_size   # outside the pool: skipped
    k = jnp.asarray(rng.normal(size=(num_tokens, num_kv_heads, head_dim)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(num_tokens, num_kv_heads, head_dim)), jnp.float32)
    new = jax.jit(tq.write_cache)(cache, k, v, jnp.asarray(slots))
    for name, x, codec in (("k", k, cache.k_codec), ("v", v, cache.v_codec)):
        codes_before = np.asarray(getattr(cache, f"{name}_codes")).reshape(num_pages, num_kv_heads, page_size, -1)
        norms_before = np.asarray(getattr(cache, f"{name}_norms"))
        codes_after = np.asarray(getattr(new, f"{name}_codes"))
        norms_after = np.asarray(getattr(new, f"{name}_norms"))
        want_codes, want_norms = compress_f64(np.asarray(x, np.float64), codec)
        written = np.zeros((num_pages, page_size), bool)
        for t, s in enumerate(slots):
            if not 0 <= s < num_pages * page_size:
                continue
            p, o = divmod(int(s), page_size)
            written[p, o] = True
            np.testing.assert_allclose(norms_after[p, :, o], want_norms[t], rtol=2e-6)
            assert np.mean(codes_after[p, :, o] == want_codes[t]) > 0.97
        keep = ~written
        np.testing.assert_array_equal(codes_after.transpose(0, 2, 1, 3)[keep], codes_before.transpose(0, 2, 1, 3)[keep])
        np.testing.assert_array_equal(norms_after.transpose(0, 2, 1)[keep], norms_before.transpose(0, 2, 1)[keep])


# ---------------------------------------------------------------------- donation, vmap and gradients


def test_write_cache_is_in_place_under_donation(rng):
    cache, _, _ = decode_setup(rng)
    k = jnp.asarray(rng.normal(size=(4, 2, 64)), jnp.float32)
    slots = jnp.asarray([3, 40, 41, 200], jnp.int32)
    step = jax.jit(tq.write_cache, donate_argnums=0)
    hlo = step.lower(cache, k, k, slots).compile().as_text()
    assert hlo.count("custom_call_target=\"jax_tq_write_cache\"") == 1  # K and V in one call
    assert "output_to_operand_aliasing" in hlo
    pointers = [x.unsafe_buffer_pointer() for x in (cache.k_codes, cache.k_norms, cache.v_codes, cache.v_norms)]
    new = step(cache, k, k, slots)
    after = [x.unsafe_buffer_pointer() for x in (new.k_codes, new.k_norms, new.v_codes, new.v_norms)]
    assert after == pointers, "donated cache buffers must be updated in place"


def test_vmap_write_cache_is_in_place_under_donation(rng):
    """Stacked per-layer caches written under vmap: the pools keep their batch axis into the FFI
    call, so XLA aliases the donated buffers instead of copying every pool twice."""
    caches = jax.tree.map(lambda *xs: jnp.stack(xs), *[decode_setup(rng)[0] for _ in range(3)])
    k = jnp.asarray(rng.normal(size=(3, 4, 2, 64)), jnp.float32)
    slots = jnp.asarray(np.stack([rng.choice(256, 4, replace=False) for _ in range(3)]).astype(np.int32))
    want = [tq.write_cache(jax.tree.map(lambda a, b=b: a[b], caches), k[b], -k[b], slots[b]) for b in range(3)]
    step = jax.jit(jax.vmap(tq.write_cache), donate_argnums=0)
    hlo = step.lower(caches, k, -k, slots).compile().as_text()
    assert " copy(" not in hlo and "copy_fusion" not in hlo, "the donated pools must not be copied"
    pointers = [x.unsafe_buffer_pointer() for x in (caches.k_codes, caches.k_norms, caches.v_codes, caches.v_norms)]
    new = step(caches, k, -k, slots)
    assert [x.unsafe_buffer_pointer() for x in (new.k_codes, new.k_norms, new.v_codes, new.v_norms)] == pointers
    for b in range(3):
        for name in ("k_codes", "k_norms", "v_codes", "v_norms"):
            np.testing.assert_array_equal(np.asarray(getattr(new, name)[b]), np.asarray(getattr(want[b], name)))


def test_write_cache_without_donation_leaves_input_untouched(rng):
    cache, _, _ = decode_setup(rng)
    before = jax.tree.map(np.asarray, cache)
    k = jnp.asarray(rng.normal(size=(4, 2, 64)), jnp.float32)
    new = jax.jit(tq.write_cache)(cache, k, k, jnp.asarray([3, 40, 41, 200], jnp.int32))
    jax.block_until_ready(new)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(cache)):
        np.testing.assert_array_equal(a, np.asarray(b))
    assert not np.array_equal(np.asarray(new.k_norms), before.k_norms)


def test_vmap_write_cache_gives_each_element_its_writes(rng):
    cache, _, _ = decode_setup(rng)
    k = jnp.asarray(rng.normal(size=(3, 5, 2, 64)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(3, 5, 2, 64)), jnp.float32)
    slots = jnp.asarray(np.stack([rng.choice(256, 5, replace=False) for _ in range(3)]).astype(np.int32))
    fn = jax.vmap(tq.write_cache, in_axes=(None, 0, 0, 0))
    jaxpr = jax.make_jaxpr(fn)(cache, k, v, slots).jaxpr
    assert primitive_count(jaxpr, write_cache_p) == 1  # K and V: one call
    got = fn(cache, k, v, slots)
    for b in range(3):
        want = tq.write_cache(cache, k[b], v[b], slots[b])
        for name in ("k_codes", "k_norms", "v_codes", "v_norms"):
            np.testing.assert_array_equal(np.asarray(getattr(got, name)[b]), np.asarray(getattr(want, name)))


def test_vmap_write_cache_axis_1_in_and_out(rng):
    from jax_tq.compress import write_cache_p
    base = random_cache(rng, num_pages=4, page_size=8, num_kv_heads=2, head_dim=64, k_bits=3, v_bits=2)
    other = random_cache(rng, num_pages=4, page_size=8, num_kv_heads=2, head_dim=64, k_bits=3, v_bits=2)
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs, axis=1), base, other)  # pools batched on axis 1
    k = jnp.asarray(rng.normal(size=(6, 2, 2, 64)), jnp.float32)             # [T, B, Hkv, d]
    v = jnp.asarray(rng.normal(size=(6, 2, 2, 64)), jnp.bfloat16)
    slots = jnp.asarray(np.stack([rng.choice(32, 6, replace=False) for _ in range(2)], axis=1).astype(np.int32))
    slots = slots.at[4, 1].set(-1).at[5, 0].set(32)  # padding / outside the pool: skipped
    fn = jax.vmap(tq.write_cache, in_axes=(1, 1, 1, 1), out_axes=1)
    assert jaxpr_count(fn, write_cache_p, stacked, k, v, slots) == 1
    got = jax.jit(fn)(stacked, k, v, slots)
    assert got.k_codes.shape == (4, 2, 2, 8, 24) and got.v_norms.shape == (4, 2, 2, 8)
    for b, cache in enumerate((base, other)):
        want = tq.write_cache(cache, k[:, b], v[:, b], slots[:, b])
        for name in ("k_codes", "k_norms", "v_codes", "v_norms"):
            np.testing.assert_array_equal(np.asarray(getattr(got, name)[:, b]), np.asarray(getattr(want, name)))
        assert not np.array_equal(np.asarray(want.k_norms), np.asarray(cache.k_norms))
    # Nested: outer over the cache (axis 1), inner over k/v (axis 0) with a shared slot mapping.
    k2 = jnp.asarray(rng.normal(size=(3, 6, 2, 64)), jnp.float32)
    inner = jax.vmap(tq.write_cache, in_axes=(None, 0, 0, None))
    outer = jax.vmap(inner, in_axes=(1, None, None, None))
    nested = outer(stacked, k2, k2, slots[:, 0])
    assert nested.k_norms.shape == (2, 3, 4, 2, 8)
    for b, cache in enumerate((base, other)):
        for i in range(3):
            want = tq.write_cache(cache, k2[i], k2[i], slots[:, 0])
            np.testing.assert_array_equal(np.asarray(nested.v_codes[b, i]), np.asarray(want.v_codes))
            np.testing.assert_array_equal(np.asarray(nested.k_norms[b, i]), np.asarray(want.k_norms))


def test_write_cache_gradients_match_across_backends(rng):
    """d/dk, d/dv through the written norms, and the pool norms' gradient kept at the unwritten
    slots only; a padding token (slot -1) gets none."""
    cache, _, _ = decode_setup(rng)
    k = jnp.asarray(rng.normal(size=(4, 2, 64)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(4, 2, 64)), jnp.float32)
    slots = jnp.asarray([3, -1, 40, 200], jnp.int32)
    weights = jnp.asarray(rng.normal(size=cache.k_norms.shape), jnp.float32)

    def loss(k, v, k_norms):
        new = tq.write_cache(dataclasses.replace(cache, k_norms=k_norms), k, v, slots)
        return jnp.sum(new.k_norms * weights) + jnp.sum(new.v_norms ** 2)

    grads = {}
    for backend in ("ffi", "xla"):
        with tq.use_backend(backend):
            grads[backend] = [np.asarray(g) for g in jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(k, v, cache.k_norms)]
    for got, want in zip(grads["ffi"], grads["xla"]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    dk, dv, dpool = grads["ffi"]
    assert np.all(dk[1] == 0) and np.all(dv[1] == 0) and np.any(dk[0] != 0)
    page_size = cache.k_norms.shape[2]
    for s in (3, 40, 200):  # written slots: the pool's old norms no longer matter
        assert np.all(dpool[s // page_size, :, s % page_size] == 0)
    np.testing.assert_array_equal(dpool[1], np.asarray(weights)[1])  # an unwritten page: pass-through


@pytest.mark.parametrize("backend", ["ffi", "xla"])
def test_write_cache_gradient_of_a_repeated_slot_follows_the_stored_token(rng, backend):
    """Tokens sharing a slot: whichever one is stored, the stored norm's gradient is that token's
    d norm / dk = k / |k|, and the other tokens of the slot get none."""
    cache, _, _ = decode_setup(rng)
    page_size = cache.k_norms.shape[2]
    k = jnp.asarray(rng.normal(size=(5, 2, 64)) * np.arange(1, 6)[:, None, None], jnp.float32)  # distinct norms
    slots = jnp.asarray([7, 12, 7, 7, 12], jnp.int32)

    def stored(k):
        new = tq.write_cache(cache, k, k, slots)
        return new.k_norms[7 // page_size, :, 7 % page_size], new.k_norms[12 // page_size, :, 12 % page_size]

    with tq.use_backend(backend):
        (n7, n12), vjp = jax.vjp(jax.jit(stored), k)
        (dk,) = vjp((jnp.ones_like(n7), jnp.ones_like(n12)))
    k64, dk = np.asarray(k, np.float64), np.asarray(dk)
    norms = np.linalg.norm(k64, axis=-1)  # [token, head]
    for slot_tokens, got in (((0, 2, 3), np.asarray(n7)), ((1, 4), np.asarray(n12))):
        for h in range(2):
            winner = [t for t in slot_tokens if abs(norms[t, h] - got[h]) < 1e-4 * norms[t, h]]
            assert len(winner) == 1, (slot_tokens, h)
            for t in slot_tokens:
                want = k64[t, h] / norms[t, h] if t == winner[0] else np.zeros(64)
                np.testing.assert_allclose(dk[t, h], want, rtol=1e-5, atol=1e-6)


def test_write_cache_gradient_with_no_tokens(rng):
    cache, _, _ = decode_setup(rng)
    k = jnp.zeros((0, 2, 64), jnp.float32)
    loss = lambda k, k_norms: jnp.sum(tq.write_cache(dataclasses.replace(cache, k_norms=k_norms), k, k,  # noqa: E731
                                                     jnp.zeros((0,), jnp.int32)).k_norms)
    for backend in ("ffi", "xla"):
        with tq.use_backend(backend):
            dk, dpool = jax.grad(loss, argnums=(0, 1))(k, cache.k_norms)
        assert dk.shape == (0, 2, 64)
        np.testing.assert_array_equal(np.asarray(dpool), 1.0)  # nothing written: every norm passes through


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ffi", "xla"])
def test_skipped_padding_token_with_nan_gets_zero_gradient(backend, rng):
    """A padding token (slot -1 or beyond the pool) is never written: even holding NaN / inf its
    gradient is exactly 0, and the written tokens' gradients are d||x|| = x / ||x||."""
    cache = tq.PagedKVCache.create(num_pages=2, page_size=4, num_kv_heads=2, k_codec=tq.TurboQuant(64, 4),
                                   v_codec=tq.TurboQuant(64, 3, seed=1))
    k = jnp.asarray(rng.normal(size=(4, 2, 64)), jnp.float32).at[1].set(jnp.nan).at[3, 0, 5].set(jnp.inf)
    slots = jnp.asarray([0, -1, 5, 8], jnp.int32)  # 8 = num_slots: skipped too
    with tq.use_backend(backend):
        loss = lambda kk, vv: (tq.write_cache(cache, kk, vv, slots).k_norms.sum()
                               + tq.write_cache(cache, kk, vv, slots).v_norms.sum())
        gk, gv = jax.grad(loss, argnums=(0, 1))(k, k)
    for g in (gk, gv):
        assert np.all(np.asarray(g[1]) == 0) and np.all(np.asarray(g[3]) == 0)
        for t in (0, 2):
            want = np.asarray(k[t]) / np.linalg.norm(np.asarray(k[t]), axis=-1, keepdims=True)
            np.testing.assert_allclose(np.asarray(g[t]), want, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------------------------ refusals


def test_refuses_bad_codec_and_cache_parameters():
    with pytest.raises(ValueError, match=r"head_dim must be one of \(64, 80, 96, 128, 192, 256\), got 100"):
        tq.TurboQuant(head_dim=100, bits=4)
    with pytest.raises(ValueError, match=r"^PagedKVCache.create: head_dim must be one of .*, got 100"):
        tq.PagedKVCache.create(num_pages=2, page_size=4, num_kv_heads=1, preset="k4v4", head_dim=100, num_windows=1)
    with pytest.raises(ValueError, match=r"bits must be one of \(1, 2, 3, 4\), got 5"):
        tq.TurboQuant(head_dim=64, bits=5)
    one_bit = tq.TurboQuant(head_dim=64, bits=1)
    with pytest.raises(ValueError, match=r"k_codec\.bits must be one of \(2, 3, 4\) for packed storage, got 1"):
        tq.PagedKVCache.create(num_pages=2, page_size=8, num_kv_heads=1, k_codec=one_bit, v_codec=tq.TurboQuant(64, 4))
    with pytest.raises(ValueError, match=r"v_codec\.bits must be one of \(2, 3, 4\) for packed storage, got 1"):
        tq.PagedKVCache.create(num_pages=2, page_size=8, num_kv_heads=1, k_codec=tq.TurboQuant(64, 4), v_codec=one_bit)
    with pytest.raises(ValueError, match=r"codec\.bits must be one of \(2, 3, 4\) for packed storage, got 1"):
        jax.eval_shape(lambda x: tq.compress(x, one_bit), jnp.zeros((3, 64)))
    for page_size, match in ((0, r"page_size must be >= 1, got 0"), (300, r"page_size must be <= 256, got 300")):
        with pytest.raises(ValueError, match=match):
            tq.PagedKVCache.create(num_pages=2, page_size=page_size, num_kv_heads=1,
                                   k_codec=tq.TurboQuant(64, 4), v_codec=tq.TurboQuant(64, 4))
    with pytest.raises(ValueError, match=r"num_pages \* page_size = 8388608 \* 256 = 2147483648 slots exceed int32"):
        jax.eval_shape(lambda: tq.PagedKVCache.create(num_pages=2**23, page_size=256, num_kv_heads=1, preset="k4v4",
                                                      head_dim=64, num_windows=1))   # one slot past int32: refused, as PageAllocator does
    jax.eval_shape(lambda: tq.PagedKVCache.create(num_pages=2**23 - 1, page_size=256, num_kv_heads=1, preset="k4v4",
                                                  head_dim=64, num_windows=1))
    with pytest.raises(ValueError, match=r"num_windows \* window = 33554432 \* 64 = 2147483648 window slots exceed int32"):
        jax.eval_shape(lambda: tq.PagedKVCache.create(num_pages=4, page_size=16, num_kv_heads=1, preset="k2v2",
                                                      head_dim=64, num_windows=2**25))  # window slot ids are int32 too
    jax.eval_shape(lambda: tq.PagedKVCache.create(num_pages=4, page_size=16, num_kv_heads=1, preset="k2v2",
                                                  head_dim=64, num_windows=2**25 - 1))
    with pytest.raises(ValueError, match=r"k_codec\.head_dim 64 != v_codec\.head_dim 128"):
        tq.PagedKVCache.create(num_pages=2, page_size=8, num_kv_heads=1,
                               k_codec=tq.TurboQuant(64, 4), v_codec=tq.TurboQuant(128, 4))


def test_refuses_cache_whose_codec_does_not_match_its_pools():
    """A codec swapped on an existing cache (same head_dim, other bits) is caught when tracing, not by the kernel."""
    cache = small_cache(k_bits=4, v_bits=3)
    q, tables, lens = decode_args()
    trace = lambda c: jax.eval_shape(tq.paged_decode, q, c, tables, lens)  # noqa: E731
    with pytest.raises(ValueError, match=r"k_codes is uint8\(3, 2, 8, 32\), expected uint8\(3, 2, 8, 16\) .*bits 2"):
        trace(dataclasses.replace(cache, k_codec=tq.TurboQuant(64, bits=2)))
    with pytest.raises(ValueError, match=r"v_codes is uint8\(3, 2, 8, 24\), expected uint8\(3, 2, 8, 32\) .*bits 4"):
        trace(dataclasses.replace(cache, v_codec=tq.TurboQuant(64, bits=4)))
    # A pool whose (num_pages, num_kv_heads, page_size) differ from the others' is the one named with
    # its shape (k_norms' axes are the cache's, so its own mistake must not blame another pool).
    agree = r"paged_decode: the pools must agree on \(num_pages, num_kv_heads, page_size\); got .*"
    with pytest.raises(ValueError, match=agree + r"cache.v_norms \(3, 1, 8\) \(shape \(3, 1, 8\)\)"):
        trace(dataclasses.replace(cache, v_norms=cache.v_norms[:, :1]))
    with pytest.raises(ValueError, match=agree + r"cache.k_norms \(3, 1, 8\) \(shape \(3, 1, 8\)\), cache.v_codes \(3, 2, 8\)"):
        trace(dataclasses.replace(cache, k_norms=cache.k_norms[:, :1]))
    with pytest.raises(ValueError, match=agree + r"cache.k_codes \(2, 2, 8\) \(shape \(2, 2, 8, 32\)\), cache.k_norms \(3, 2, 8\)"):
        trace(dataclasses.replace(cache, k_codes=cache.k_codes[:2]))
    with pytest.raises(ValueError, match=r"cache.k_codes has shape \(3, 2, 8, 32\), expected \[num_pages, 2, page_size, 16\]"):
        jax.eval_shape(tq.write_cache, dataclasses.replace(cache, k_codec=tq.TurboQuant(64, bits=2)),
                       jnp.zeros((1, 2, 64)), jnp.zeros((1, 2, 64)), jnp.zeros((1,), jnp.int32))


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_refuses_cache_pools_without_pages_heads_or_slots(axis):
    """Sizes PagedKVCache.create refuses, in a hand-built cache: a named error, not an internal one."""
    cache = small_cache()
    empty = jax.tree_util.tree_map(lambda a: jax.lax.slice_in_dim(a, 0, 0, axis=axis), cache)
    q = jnp.zeros((2, 4, 64), jnp.float32)
    tables, lens = jnp.zeros((2, 3), jnp.int32), jnp.ones((2,), jnp.int32)
    with pytest.raises(ValueError, match=r"paged_decode: cache.k_codes has shape .*must each be >= 1"):
        jax.eval_shape(tq.paged_decode, q, empty, tables, lens)
    k = jnp.zeros((3, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match=r"write_cache: cache.k_codes has shape .*must each be >= 1"):
        jax.eval_shape(tq.write_cache, empty, k, k, jnp.zeros((3,), jnp.int32))


def test_refuses_hand_built_caches_create_would_refuse():
    """Pages of more than 256 slots and K / V codecs of different head_dims (PagedKVCache.create's
    limits) in a cache built directly: named errors from write_cache and paged_decode too."""
    spec = jax.ShapeDtypeStruct
    c64 = tq.TurboQuant(64, 4)
    big = tq.PagedKVCache(k_codes=spec((2, 1, 300, 32), jnp.uint8), k_norms=spec((2, 1, 300), jnp.float32),
                          v_codes=spec((2, 1, 300, 32), jnp.uint8), v_norms=spec((2, 1, 300), jnp.float32),
                          k_codec=c64, v_codec=c64)
    q, kv = jnp.zeros((1, 1, 64)), jnp.zeros((1, 1, 64))
    tables, lens, slots = jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32), jnp.zeros((1,), jnp.int32)
    with pytest.raises(ValueError, match=r"paged_decode: cache.k_codes has shape \(2, 1, 300, 32\): page_size 300 is above 256"):
        jax.eval_shape(tq.paged_decode, q, big, tables, lens)
    with pytest.raises(ValueError, match=r"write_cache: cache.k_codes has shape .*page_size 300 is above 256"):
        jax.eval_shape(tq.write_cache, big, kv, kv, slots)
    mixed = tq.PagedKVCache(k_codes=spec((2, 1, 8, 32), jnp.uint8), k_norms=spec((2, 1, 8), jnp.float32),
                            v_codes=spec((2, 1, 8, 64), jnp.uint8), v_norms=spec((2, 1, 8), jnp.float32),
                            k_codec=c64, v_codec=tq.TurboQuant(128, 4))
    with pytest.raises(ValueError, match=r"write_cache: cache.k_codec.head_dim 64 != cache.v_codec.head_dim 128"):
        jax.eval_shape(tq.write_cache, mixed, kv, kv, slots)
    with pytest.raises(ValueError, match=r"paged_decode: cache.k_codec.head_dim 64 != cache.v_codec.head_dim 128"):
        jax.eval_shape(tq.paged_decode, q, mixed, tables, lens)


def test_vmap_over_caches_past_int32_ids_is_refused():
    """The kernels' vmap folds a batch of caches into one pool: ids past int32 would wrap, and their
    writes and reads be skipped silently. Traced only (abstract pools of ~100 GB); a fold that fits
    still traces. (The xla backend's jnp reference vmaps without folding.)"""
    spec = jax.ShapeDtypeStruct
    codec = tq.TurboQuant(64, 4)

    def caches(batch, pages, page_size):
        return tq.PagedKVCache(k_codes=spec((batch, pages, 1, page_size, 32), jnp.uint8),
                               k_norms=spec((batch, pages, 1, page_size), jnp.float32),
                               v_codes=spec((batch, pages, 1, page_size, 32), jnp.uint8),
                               v_norms=spec((batch, pages, 1, page_size), jnp.float32), k_codec=codec, v_codec=codec)
    kv, slots = spec((3, 2, 1, 64), jnp.float32), spec((3, 2), jnp.int32)
    q, tables, lens = spec((3, 1, 1, 64), jnp.float32), spec((3, 1, 4), jnp.int32), spec((3, 1), jnp.int32)
    with tq.use_backend("ffi"):
        with pytest.raises(ValueError, match=r"vmap over 3 caches of 1073741824 pages or slots .*past int32"):
            jax.eval_shape(jax.vmap(tq.write_cache), caches(3, 2**24, 64), kv, kv, slots)
        with pytest.raises(ValueError, match=r"vmap over 3 caches of 1073741824 pages .*past int32"):
            jax.eval_shape(jax.vmap(tq.paged_decode), q, caches(3, 2**30, 1), tables, lens)
        jax.eval_shape(jax.vmap(tq.write_cache), caches(2, 2**24, 64), spec((2, 2, 1, 64), jnp.float32),
                       spec((2, 2, 1, 64), jnp.float32), spec((2, 2), jnp.int32))  # ids up to 2^31 - 1: fits


def test_refuses_bad_write_and_codec_op_arguments_at_trace_time():
    cache = small_cache()
    codec = cache.k_codec
    k = jnp.zeros((3, 2, 64), jnp.float32)
    slots = jnp.zeros((3,), jnp.int32)
    trace = lambda c, k, v, s: jax.eval_shape(tq.write_cache, c, k, v, s)  # noqa: E731
    trace(cache, k, k, slots)
    with pytest.raises(ValueError, match=r"write_cache: k has shape \(3, 2, 80\); its last axis must be the codec's head_dim 64"):
        trace(cache, jnp.zeros((3, 2, 80)), jnp.zeros((3, 2, 80)), slots)
    with pytest.raises(ValueError, match=r"write_cache: k has 3 KV heads \(shape \(3, 3, 64\)\) but the cache has 2"):
        trace(cache, jnp.zeros((3, 3, 64)), jnp.zeros((3, 3, 64)), slots)
    with pytest.raises(ValueError, match=r"write_cache: k must be \[num_tokens, num_kv_heads, head_dim\], got shape \(3, 64\)"):
        trace(cache, k[:, 0], k[:, 0], slots)
    with pytest.raises(TypeError, match=r"write_cache: v must be float32, bfloat16 or float16, got int32"):
        trace(cache, k, k.astype(jnp.int32), slots)
    with pytest.raises(ValueError, match=r"write_cache: k has 3 tokens but v has 2"):
        trace(cache, k, k[:2], slots)
    bigger_v = dataclasses.replace(cache, v_codes=jnp.concatenate([cache.v_codes] * 2),
                                   v_norms=jnp.concatenate([cache.v_norms] * 2))
    with pytest.raises(ValueError, match=r"write_cache: the pools must agree on \(num_pages, num_kv_heads, page_size\); "
                                         r"got .*cache.v_codes \(6, 2, 8\) .*cache.v_norms \(6, 2, 8\)"):
        trace(bigger_v, k, k, slots)
    with pytest.raises(TypeError, match=r"slot_mapping must be int32 \[3\], got float32\(3,\)"):
        trace(cache, k, k, slots.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"slot_mapping must be int32 \[3\], got int32\(3, 1\)"):
        trace(cache, k, k, slots[:, None])
    with pytest.raises(ValueError, match=r"slot_mapping must be int32 \[3\], got int32\(4,\)"):
        trace(cache, k, k, jnp.zeros((4,), jnp.int32))
    windowed = tq.PagedKVCache.create(num_pages=3, page_size=8, num_kv_heads=2, preset="k4v4", head_dim=64,
                                      num_windows=1)
    for bad in (jnp.zeros((5,), jnp.int32), slots[:, None]):   # checked before the window's slots use it
        with pytest.raises(ValueError, match=r"slot_mapping must be int32 \[3\], got int32"):
            jax.eval_shape(lambda c, s: tq.write_cache(c, k, k, s, window_slots=jnp.zeros((3,), jnp.int32)),
                           windowed, bad)
    with _compat.enable_x64():
        with pytest.raises(TypeError, match=r"write_cache: k must be float32, bfloat16 or float16, got float64"):
            trace(cache, k.astype(jnp.float64), k, slots)
        with pytest.raises(TypeError, match=r"slot_mapping must be int32 \[3\], got int64"):
            trace(cache, k, k, slots.astype(jnp.int64))
    with pytest.raises(TypeError, match=r"compress: x must be float32, bfloat16 or float16, got uint8"):
        jax.eval_shape(lambda x: tq.compress(x, codec), jnp.zeros((3, 64), jnp.uint8))
    with pytest.raises(ValueError, match=r"compress: x has shape \(3, 100\); its last axis must be the codec's head_dim 64"):
        jax.eval_shape(lambda x: tq.compress(x, codec), jnp.zeros((3, 100)))
    dec = lambda c, n, dtype=jnp.float32: jax.eval_shape(lambda c, n: tq.decompress(c, n, codec, dtype), c, n)  # noqa: E731
    dec(jnp.zeros((3, 32), jnp.uint8), jnp.zeros((3,)))
    with pytest.raises(ValueError, match=r"codes \(3, 24\) and norms \(3,\) do not match codes \[\.\.\., 32\]"):
        dec(jnp.zeros((3, 24), jnp.uint8), jnp.zeros((3,)))  # codes of a 3-bit codec, decoded as 4-bit
    with pytest.raises(ValueError, match=r"codes \(3, 32\) and norms \(4,\) do not match"):
        dec(jnp.zeros((3, 32), jnp.uint8), jnp.zeros((4,)))
    with pytest.raises(TypeError, match=r"codes must be uint8, got int32"):
        dec(jnp.zeros((3, 32), jnp.int32), jnp.zeros((3,)))
    with pytest.raises(TypeError, match=r"norms must be float32, got bfloat16"):
        dec(jnp.zeros((3, 32), jnp.uint8), jnp.zeros((3,), jnp.bfloat16))
    with pytest.raises(TypeError, match=r"dtype must be float32, bfloat16 or float16, got int8"):
        dec(jnp.zeros((3, 32), jnp.uint8), jnp.zeros((3,)), jnp.int8)
    with pytest.raises(TypeError, match=r"dtype must be float32, bfloat16 or float16, got None"):
        dec(jnp.zeros((3, 32), jnp.uint8), jnp.zeros((3,)), None)  # jnp.dtype(None) is float64


def test_write_cache_names_a_wrong_rank():
    codec = tq.TurboQuant(64, 4)
    cache = tq.PagedKVCache.create(num_pages=2, page_size=4, num_kv_heads=1, k_codec=codec, v_codec=codec)
    good = jnp.zeros((3, 1, 64))
    with pytest.raises(ValueError, match=r"k must be \[num_tokens, num_kv_heads, head_dim\], got shape \(1, 3, 1, 64\)"):
        tq.write_cache(cache, good[None], good, jnp.arange(3, dtype=jnp.int32))
    with pytest.raises(ValueError, match=r"v must be \[num_tokens, num_kv_heads, head_dim\], got shape \(3, 64\)"):
        tq.write_cache(cache, good, good[:, 0], jnp.arange(3, dtype=jnp.int32))


def test_cache_repr_shows_shapes_and_codecs_not_pool_contents():
    cache = tq.PagedKVCache.create(num_pages=300, page_size=16, num_kv_heads=2, k_codec=tq.TurboQuant(128, 4),
                                   v_codec=tq.TurboQuant(128, 3, seed=1))
    text = repr(cache)
    assert len(text) < 400 and "\n" not in text
    assert "k_codes=uint8[300, 2, 16, 64]" in text and "v_codes=uint8[300, 2, 16, 48]" in text
    assert "bits=3" in text and "v_norms=float32[300, 2, 16]" in text
    assert cache.bytes_per_token() == 2 * (64 + 48 + 4 + 4)


def test_cache_repr_of_a_tree_mapped_cache_shows_its_leaves():
    """jax.tree.map(lambda x: x.shape, cache) leaves tuples in the pools: repr shows them (it raised
    IndexError through the window property)."""
    cache = tq.PagedKVCache.create(num_pages=4, page_size=16, num_kv_heads=2, head_dim=64, preset="k4v4",
                                   num_windows=3)
    shapes = jax.tree.map(lambda x: x.shape, cache)
    text = repr(shapes)
    assert "k_codes=(4, 2, 16, 32)" in text and "v_window=(3, 2, 64, 64)" in text
    dtypes = jax.tree.map(lambda x: str(x.dtype), tq.PagedKVCache.create(num_pages=2, page_size=8, num_kv_heads=1,
                                                                        head_dim=64, preset="none"))
    assert "k_pages='float32'" in repr(dtypes) or "k_pages='bfloat16'" in repr(dtypes)


# -------------------------------------------------------------------------------------------- window
# The window's cases pick their backend themselves (a backend parameter, kernel_backend).


BACKENDS = ("ffi", "xla")


@pytest.mark.backend(None)
@pytest.mark.parametrize("backend", BACKENDS)
def test_write_cache_fills_pages_and_window(rng, backend):
    cache = random_window_cache(rng)
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
                # the kernel's y may differ by 1 bf16 ulp, and both round y in float32 first: a few
                # float32 ulps of the row's norm, more than a bf16 ulp of a coordinate near zero
                row = np.linalg.norm((k if name == "k_window" else v)[written[entry]], axis=-1, keepdims=True)
                assert np.all(np.abs(got[entry] - want) <= np.abs(want) * 2.0 ** -7 + row * 2.0 ** -20)
            else:
                np.testing.assert_array_equal(got[entry], before[entry])
    # the rows are Pi x rounded to bfloat16
    rotated = (k @ np.asarray(cache.k_codec.rotation, np.float64).T)[0]
    assert rel_err(entries(new.k_window)[2], rotated) < 4e-3
    assert np.all(np.asarray(new.k_norms[0, :, 0]) != np.asarray(cache.k_norms[0, :, 0]))  # the page too


@pytest.mark.backend(None)
def test_slot_mapping_values_and_the_rows_it_refuses(rng):
    """write_cache's slots from block tables and positions: -1 wherever a token has no slot of its own."""
    tables = rng.integers(-2, 50, size=(5, 7)).astype(np.int32)
    positions = rng.integers(-3, 7 * 6 + 3, size=200).astype(np.int32)
    seq_ids = rng.integers(-1, 6, size=200).astype(np.int32)
    want = [tables[s, p // 6] * 6 + p % 6 if 0 <= s < 5 and 0 <= p < 42 and tables[s, p // 6] >= 0 else -1
            for s, p in zip(seq_ids, positions)]
    np.testing.assert_array_equal(np.asarray(tq.slot_mapping(tables, positions, 6, seq_ids)), want)
    tables = jnp.asarray([[3, 1], [0, -2], [2**29, 5]], jnp.int32)
    positions = jnp.asarray([0, 5, 7, 8, -1, 4, 5, 3, 2, 0], jnp.int32)
    seq_ids = jnp.asarray([0, 0, 0, 0, 0, 1, 1, 2, 3, -1], jnp.int32)
    got = tq.slot_mapping(tables, positions, 4, seq_ids)
    # position 8 is past the 2-page table, -1 negative, entry -2 negative, 2**29 * 4 + 3 past int32,
    # sequences 3 and -1 do not exist
    np.testing.assert_array_equal(np.asarray(got), [12, 5, 7, -1, -1, -1, -1, -1, -1, -1])
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(tq.slot_mapping(tables[0], positions[:4], 4)), [12, 5, 7, -1])
    np.testing.assert_array_equal(np.asarray(jax.jit(tq.slot_mapping, static_argnums=2)(
        tables, jnp.asarray([6, 1, 4], jnp.int32), 4)), [6, 1, 20])   # row s: sequence s
    with pytest.raises(TypeError, match=r"slot_mapping: positions must be int32 \[num_tokens\], got int64"):
        tq.slot_mapping(tables, np.zeros(3, np.int64), 4)
    with pytest.raises(ValueError, match="positions has 2 tokens but block_tables 3 sequences; pass seq_ids"):
        tq.slot_mapping(tables, jnp.zeros(2, jnp.int32), 4)
    with pytest.raises(ValueError, match=r"seq_ids must be int32 \[num_tokens=2\]"):
        tq.slot_mapping(tables, jnp.zeros(2, jnp.int32), 4, jnp.zeros(3, jnp.int32))
    with pytest.raises(TypeError, match="page_size must be a Python int"):
        tq.slot_mapping(tables, jnp.zeros(3, jnp.int32), 4.0)


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
    with pytest.raises(ValueError, match=r"must be \[num_tokens\] each .*window_ids \(3,\), positions \(7,\), "
                                         r"seq_lens \(7,\)"):
        tq.window_slot_mapping(ids[:3], positions, lens, 3)
    with pytest.raises(ValueError, match=r"seq_lens \(\)"):
        tq.window_slot_mapping(ids, positions, 4, 3)
    with pytest.raises(TypeError, match="window must be an int"):
        tq.window_slot_mapping(ids, positions, lens, 3.0)
    with pytest.raises(ValueError, match=r"window must be an int in \[1, 2\^31 - 1\], got 2147483648"):
        tq.window_slot_mapping(ids, positions, lens, 2**31)  # was NumPy's bare OverflowError
    with pytest.raises(TypeError, match="jax_tq.window_slot_mapping: positions must be an integer array, got NoneType"):
        tq.window_slot_mapping(jnp.asarray(ids), None, lens, 3)
    # numpy ids with traced positions: the jnp path
    traced = jax.jit(lambda p: tq.window_slot_mapping(ids, p, lens, 3))(jnp.asarray(positions))
    np.testing.assert_array_equal(traced, got)


@pytest.mark.backend(None)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_padding_token_is_written_nowhere_not_even_in_the_window(rng, backend):
    """A negative slot (padding) skips the window too, whatever its window slot says (the padding
    row of sequence 0 at position 0 gets window entry 0 from window_slot_mapping)."""
    cache = random_window_cache(rng, window=8, num_windows=2)
    k = jnp.asarray(rng.normal(size=(4, 2, 64)), jnp.float32)
    slots = jnp.asarray([0, 1, 2, -1], jnp.int32)
    window_slots = tq.window_slot_mapping(jnp.zeros(4, jnp.int32), jnp.asarray([0, 1, 2, 0], jnp.int32),
                                          jnp.full(4, 3, jnp.int32), 8)
    assert int(window_slots[3]) == 0
    with tq.use_backend(backend):
        new = jax.jit(tq.write_cache)(cache, k, k, slots, window_slots)
    want = np.asarray(tq.window_rows(k[:1], cache.k_codec), np.float32)
    np.testing.assert_allclose(np.asarray(new.k_window[0, :, 0], np.float32), want[0], rtol=1e-2, atol=1e-2)


@pytest.mark.backend(None)
def test_window_presets_and_create():
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


@pytest.mark.backend(None)
def test_window_arguments_are_checked_at_trace_time(rng):
    cache = random_window_cache(rng)
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


# ---------------------------------------------------------------------------------------------- CUDA
# Marked gpu (skipped without one, conftest.py): the kernels on the GPU against float64 and the CPU's.


WRITE_CASES = [(128, 4, 4, 16, 8, "haar"), (64, 2, 3, 8, 2, "haar"), (80, 3, 3, 48, 1, "haar"),
               (96, 4, 2, 256, 4, "haar"), (192, 3, 4, 16, 3, "haar"), (256, 2, 2, 8, 2, "haar"),
               (128, 4, 4, 16, 8, "hadamard"), (64, 2, 3, 8, 2, "hadamard"), (128, 3, 2, 16, 3, "hadamard")]


# K and V of one dtype run in ONE launch (grid.z = 2); of different dtypes in two. Hadamard codecs of
# head_dim 64 / 128 are written by the fast transform (one warp per vector): their codes may differ
# from compress's (a dense product) at boundary ties, so they are checked against float64 alone.
@pytest.mark.gpu
@pytest.mark.parametrize("donate,k_dtype,v_dtype", [(False, jnp.bfloat16, jnp.float16), (True, jnp.bfloat16, jnp.bfloat16),
                                                    (False, jnp.float32, jnp.float32), (True, jnp.float16, jnp.float32)])
@pytest.mark.parametrize("head_dim,k_bits,v_bits,page_size,hkv,rotation", WRITE_CASES)
def test_write_cache_poisoned_pools(rng, head_dim, k_bits, v_bits, page_size, hkv, rotation, donate, k_dtype,
                                    v_dtype):
    num_pages = 7
    k_codec = tq.TurboQuant(head_dim=head_dim, bits=k_bits, seed=int(rng.integers(1000)), rotation=rotation)
    v_codec = tq.TurboQuant(head_dim=head_dim, bits=v_bits, seed=int(rng.integers(1000)), rotation=rotation)
    cache = tq.PagedKVCache.create(num_pages=num_pages, page_size=page_size, num_kv_heads=hkv,
                                   k_codec=k_codec, v_codec=v_codec)
    poison = dict(
        k_codes=jnp.full(cache.k_codes.shape, 0xAB, jnp.uint8), v_codes=jnp.full(cache.v_codes.shape, 0xAB, jnp.uint8),
        k_norms=jnp.full(cache.k_norms.shape, jnp.nan, jnp.float32),
        v_norms=jnp.full(cache.v_norms.shape, jnp.nan, jnp.float32))
    cache = dataclasses.replace(cache, **poison)
    total = num_pages * page_size
    t = int(rng.integers(1, min(total, 70) + 1))
    slots = rng.choice(total, size=t, replace=False).astype(np.int32)
    # Some padding / out-of-range slots that must be skipped.
    bad = rng.random(t) < 0.2
    slots[bad] = rng.choice(np.array([-1, -7, total, total + 5], np.int32), size=int(bad.sum()))
    k = jnp.asarray(rng.normal(size=(t, hkv, head_dim)) * 3, k_dtype)
    v = jnp.asarray(rng.normal(size=(t, hkv, head_dim)), v_dtype)
    write = jax.jit(tq.write_cache, donate_argnums=(0,) if donate else ())
    before = {n: np.asarray(getattr(cache, n)) for n in ("k_codes", "v_codes", "k_norms", "v_norms")}
    out = write(cache, k, v, jnp.asarray(slots))
    jax.block_until_ready(out)
    if not donate:  # the caller's pools are untouched
        for name in ("k_codes", "v_codes", "k_norms", "v_norms"):
            np.testing.assert_array_equal(np.asarray(getattr(cache, name)), before[name])
    kc, kn = jax.jit(tq.compress)(k, k_codec)
    vc, vn = jax.jit(tq.compress)(v, v_codec)
    written = np.zeros((num_pages, page_size), bool)
    for i, s in enumerate(slots):
        if 0 <= s < total:
            written[s // page_size, s % page_size] = True
    for name, codes_new, norms_new, bits in (("k", kc, kn, k_bits), ("v", vc, vn, v_bits)):
        got_codes = np.asarray(getattr(out, f"{name}_codes"))
        got_norms = np.asarray(getattr(out, f"{name}_norms"))
        x = np.asarray((k if name == "k" else v).astype(jnp.float32), np.float64)
        codec = k_codec if name == "k" else v_codec
        want_codes, want_norms = compress_f64(x.reshape(-1, head_dim), codec)
        for i, s in enumerate(slots):
            if not 0 <= s < total:
                continue
            p, o = divmod(int(s), page_size)
            if rotation == "haar":
                np.testing.assert_array_equal(got_codes[p, :, o], np.asarray(codes_new[i]))
                np.testing.assert_array_equal(got_norms[p, :, o], np.asarray(norms_new[i]))
            else:
                codes_agree(got_codes[p, :, o], want_codes.reshape(t, hkv, -1)[i], bits, head_dim, x[i], codec)
                np.testing.assert_allclose(got_norms[p, :, o], want_norms.reshape(t, hkv)[i], rtol=2e-6)
        # everything else untouched
        assert np.all(got_codes.transpose(0, 2, 1, 3)[~written] == 0xAB)
        assert np.all(np.isnan(got_norms.transpose(0, 2, 1)[~written]))
        # and the written values agree with the float64 reference
        codes_agree(np.asarray(codes_new).reshape(-1, codec.packed_bytes), want_codes, bits, head_dim, x, codec)
        np.testing.assert_allclose(np.asarray(norms_new).reshape(-1), want_norms, rtol=2e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("rotation", ("haar", "hadamard"))
def test_write_cache_prefill_size_one_launch(rng, rotation):
    """A prefill-size write (24k vectors per pool: the large-tile kernel, or the Hadamard warp kernel;
    K and V in one launch) writes what compress gives (Hadamard: the float64 oracle's codes up to
    boundary ties), at every slot, and nothing else."""
    hkv, d, page_size, num_pages, t = 8, 128, 16, 256, 3000
    k_codec = tq.TurboQuant(head_dim=d, bits=4, seed=3, rotation=rotation)
    v_codec = tq.TurboQuant(head_dim=d, bits=3, seed=4, rotation=rotation)
    cache = tq.PagedKVCache.create(num_pages=num_pages, page_size=page_size, num_kv_heads=hkv,
                                   k_codec=k_codec, v_codec=v_codec)
    cache = dataclasses.replace(cache, k_norms=jnp.full(cache.k_norms.shape, jnp.nan, jnp.float32),
                                v_norms=jnp.full(cache.v_norms.shape, jnp.nan, jnp.float32))
    slots = rng.choice(num_pages * page_size, size=t, replace=False).astype(np.int32)
    k = jnp.asarray(rng.normal(size=(t, hkv, d)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(t, hkv, d)) * 0.1, jnp.bfloat16)
    out = jax.jit(tq.write_cache, donate_argnums=0)(cache, k, v, jnp.asarray(slots))
    p, o = slots // page_size, slots % page_size
    for name, x, codec in (("k", k, k_codec), ("v", v, v_codec)):
        got_codes = np.asarray(getattr(out, f"{name}_codes"))[p, :, o]
        got_norms = np.asarray(getattr(out, f"{name}_norms"))[p, :, o]
        if rotation == "haar":
            codes, norms = jax.jit(tq.compress)(x, codec)
            np.testing.assert_array_equal(got_codes, np.asarray(codes))
            np.testing.assert_array_equal(got_norms, np.asarray(norms))
        else:
            x64 = np.asarray(x.astype(jnp.float32), np.float64).reshape(-1, d)
            want_codes, want_norms = compress_f64(x64, codec)
            codes_agree(got_codes.reshape(-1, codec.packed_bytes), want_codes, codec.bits, d, x64, codec)
            np.testing.assert_allclose(got_norms.reshape(-1), want_norms, rtol=2e-6)
        assert int(np.isnan(np.asarray(getattr(out, f"{name}_norms"))).sum()) == (num_pages * page_size - t) * hkv


def hadamard_write_check(request, rng, head_dim, bits, dtype, special=True, tokens=201):
    """write_cache of plain Hadamard codecs into poisoned pools: 3 x ``tokens`` vectors per pool (201:
    603, the quad-per-vector CUDA kernel, groups of 8 per warp, the last one partly empty; from 16384
    bfloat16 / float16 vectors the tensor-core kernel, 16 per warp), zero, one-spike, NaN and
    (for bfloat16 / float32) huge, dense ~2^120, tiny, 2^127-spike and below-MIN_NORM (stored as zero)
    vectors, a padding and an out-of-pool slot.
    Every written token has the float64 oracle's codes (ties aside) and norm (NaN for the NaN rows);
    every other slot keeps its poison."""
    hkv, page_size, t = 3, 16, tokens
    num_pages = t // page_size + 4
    k_codec = tq.TurboQuant(head_dim, bits[0], int(rng.integers(1000)), "hadamard")
    v_codec = tq.TurboQuant(head_dim, bits[1], int(rng.integers(1000)), "hadamard")
    cache = tq.PagedKVCache.create(num_pages=num_pages, page_size=page_size, num_kv_heads=hkv, k_codec=k_codec,
                                   v_codec=v_codec)
    cache = dataclasses.replace(
        cache, k_codes=jnp.full(cache.k_codes.shape, 0xAB, jnp.uint8), v_codes=jnp.full(cache.v_codes.shape, 0xAB, jnp.uint8),
        k_norms=jnp.full(cache.k_norms.shape, jnp.nan, jnp.float32), v_norms=jnp.full(cache.v_norms.shape, jnp.nan, jnp.float32))
    x = rng.normal(size=(2, t, hkv, head_dim)) * rng.uniform(0.01, 50, size=(2, t, hkv, 1))
    if special:
        x[:, 0] = 0.0
        x[:, 1] = 0.0
        x[:, 1, :, 3] = -2.0
        if dtype != jnp.float16:
            x[:, 2] *= 1e25   # sum of squares past float32: the scaled norm
            x[:, 3] = rng.normal(size=x[:, 3].shape) * 2.0**-66  # squares subnormal: the scaled norm; norm > 2^-64
            x[:, 4] = 0.0
            x[:, 4, :, 5] = 2.0 ** 127  # the scaled norm at the top exponent: 2^127, not inf
            x[:, 8] = rng.normal(size=x[:, 8].shape) * 2.0**120  # dense and huge: d Pi x before normalising overflows
            x[:, 9] = 0.0
            x[:, 9, :, 2] = 5e-20  # norm below MIN_NORM = 2^-64: stored as the zero vector (not NaN)
        x[:, 7, :, 9] = np.nan  # norm NaN, codes 0 (every comparison with a NaN is false)
    x = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)
    total = num_pages * page_size
    slots = rng.permutation(total)[:t].astype(np.int32)
    slots[5], slots[6] = -1, total
    with kernel_backend(request, ["jax_tq_write_cache"]):
        out = jax.jit(lambda c, k, v, s: tq.write_cache(c, k, v, s))(cache, jnp.asarray(x[0], dtype),
                                                                    jnp.asarray(x[1], dtype), jnp.asarray(slots))
    ok = (slots >= 0) & (slots < total)
    page_of, off = slots[ok] // page_size, slots[ok] % page_size
    for which, codec, codes_pool, norms_pool in ((0, k_codec, out.k_codes, out.k_norms), (1, v_codec, out.v_codes, out.v_norms)):
        rows = x[which][ok].reshape(-1, head_dim)
        want_codes, want_norms = compress_f64(rows, codec)
        got = np.asarray(codes_pool)[page_of, :, off].reshape(-1, codec.packed_bytes)
        got_norms = np.asarray(norms_pool)[page_of, :, off].reshape(-1)
        finite = np.all(np.isfinite(rows), axis=-1)
        codes_agree(got[finite], want_codes[finite], codec.bits, head_dim, rows[finite], codec)
        np.testing.assert_allclose(got_norms[finite], want_norms[finite], rtol=2e-6)
        assert np.all(np.isnan(got_norms[~finite])) and np.all(got[~finite] == 0)
        written = np.zeros((num_pages, page_size), bool)
        written[page_of, off] = True
        assert np.all(np.asarray(codes_pool).transpose(0, 2, 1, 3)[~written] == 0xAB)
        assert np.all(np.isnan(np.asarray(norms_pool).transpose(0, 2, 1)[~written]))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("bits", ((4, 3), (2, 4)))
@pytest.mark.parametrize("dtype", (jnp.bfloat16, jnp.float32, jnp.float16))
def test_gpu_hadamard_write_matches_the_float64_oracle(request, rng, head_dim, bits, dtype):
    hadamard_write_check(request, rng, head_dim, bits, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("bits", ((4, 3), (2, 4)))
@pytest.mark.parametrize("dtype", (jnp.bfloat16, jnp.float16))
def test_gpu_tensor_core_hadamard_write_matches_the_float64_oracle(request, rng, head_dim, bits, dtype):
    """A prompt-size write (16500 vectors per pool: the tensor-core kernel), the same special rows."""
    hadamard_write_check(request, rng, head_dim, bits, dtype, tokens=5500)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", (201, 5500))
def test_gpu_hadamard_write_with_close_boundaries(request, rng, monkeypatch, tokens):
    """Centroids two of whose boundaries lie closer than a cell of the kernel's code table (no codec
    of the library has such; the kernel then searches the boundaries): the same checks, on the quad
    and the tensor-core kernel."""
    monkeypatch.setattr(tq.TurboQuant, "centroids", property(close_centroids))
    hadamard_write_check(request, rng, 128, (4, 3), jnp.bfloat16, special=False, tokens=tokens)


def test_code_table_is_exact_for_the_codebooks_of_the_hadamard_write():
    """The CUDA write of Hadamard codecs (head_dim 64 / 128, 2-4 bits) reads codes from a table of
    cells 1 / 119 wide (compress.cu kLutScale; the wgmma kernel's 1 / 56, kLutScale4): exact where
    no two boundaries are closer than a cell, which holds for every codebook it serves (else the
    kernels search the boundaries: correct, slower)."""
    for head_dim in (64, 128):
        for bits in (2, 3, 4):
            boundaries = np.asarray(tq.TurboQuant(head_dim, bits, 0, "hadamard").boundaries, np.float64)
            assert np.min(np.diff(boundaries)) > 1.5 / 119, (head_dim, bits)
            assert np.min(np.diff(boundaries)) > 1.2 / 56, (head_dim, bits)


@pytest.mark.gpu
def test_write_cache_chain_with_produced_inputs(rng):
    """Decode-step writes chained in one program, each step's K / V made by the XLA kernel just
    before its write and every step writing the same slots (on sm_90 the write is a programmatic
    dependent launch that may start before that kernel ends): the pools hold exactly the last
    step's compress of the last step's K / V."""
    hkv, d, page_size, num_pages, t, steps = 8, 128, 16, 64, 64, 6
    k_codec, v_codec = tq.TurboQuant(head_dim=d, bits=4, seed=5), tq.TurboQuant(head_dim=d, bits=4, seed=6)
    cache = tq.PagedKVCache.create(num_pages=num_pages, page_size=page_size, num_kv_heads=hkv,
                                   k_codec=k_codec, v_codec=v_codec)
    slots = jnp.asarray(rng.choice(num_pages * page_size, size=t, replace=False).astype(np.int32))
    x = jnp.asarray(rng.normal(size=(t, hkv, d)), jnp.float32)

    def produced(i):  # a fresh XLA kernel per step, the write's immediate predecessor
        return (jnp.sin(x * (i + 1.0)) * (i + 2.0)).astype(jnp.bfloat16), (jnp.cos(x * (i + 3.0))).astype(jnp.bfloat16)

    @jax.jit
    def chain(cache, x):
        for i in range(steps):
            k, v = produced(i)
            cache = tq.write_cache(cache, k, v, slots)
        return cache, k, v  # the last step's K / V as this program computed them

    out, k_last, v_last = chain(cache, x)
    p, o = np.asarray(slots) // page_size, np.asarray(slots) % page_size
    for name, y, codec in (("k", k_last, k_codec), ("v", v_last, v_codec)):
        codes, norms = jax.jit(tq.compress)(y, codec)
        np.testing.assert_array_equal(np.asarray(getattr(out, f"{name}_codes"))[p, :, o], np.asarray(codes))
        np.testing.assert_array_equal(np.asarray(getattr(out, f"{name}_norms"))[p, :, o], np.asarray(norms))
        want_codes, want_norms = compress_f64(np.asarray(y.astype(jnp.float32), np.float64).reshape(-1, d), codec)
        codes_agree(np.asarray(codes).reshape(-1, codec.packed_bytes), want_codes, 4, d,
                     np.asarray(y.astype(jnp.float32), np.float64), codec)
        np.testing.assert_allclose(np.asarray(norms).reshape(-1), want_norms, rtol=2e-6)


@pytest.mark.backend(None)
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("fit", ("norm", "fit"))
@pytest.mark.parametrize("tokens", (40, 8200))  # 8200 x 2 plain: the tensor-core write
def test_gpu_write_cache_window_rows_match_the_cpu_s(request, rng, head_dim, fit, tokens):
    num_pages = tokens // 16 + 8
    cache = random_window_cache(rng, head_dim=head_dim, window=64, num_windows=2, num_pages=num_pages, page_size=16)
    cache = dataclasses.replace(cache, k_codec=tq.TurboQuant(head_dim, 4, 1, "hadamard", fit),
                                v_codec=tq.TurboQuant(head_dim, 3, 2, "hadamard", fit))
    k = jnp.asarray(rng.normal(size=(tokens, 2, head_dim)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(tokens, 2, head_dim)), jnp.bfloat16)
    slots = jnp.asarray(rng.permutation(num_pages * 16)[:tokens].astype(np.int32))
    wslots = np.full(tokens, -1, np.int32)  # 128 window entries, each written by one token at most
    chosen = rng.choice(tokens, size=min(tokens, 128), replace=False)
    wslots[chosen] = rng.permutation(128)[:len(chosen)]
    wslots[chosen[::3]] = -1
    wslots = jnp.asarray(wslots)
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
