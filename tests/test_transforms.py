"""jit, vmap (batching rules fold into the kernel batch), in-place cache update, backend selection."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tq as tq
from jax_tq.compress import write_cache_p
from jax_tq.paged_decode import paged_decode_p
from oracle import decode_f64, decompress_f64, primitive_count as _primitive_count, random_cache, random_tables, rel_err


@pytest.fixture(autouse=True)
def ffi_backend():
    with tq.use_backend("ffi"):
        yield


def _setup(rng, num_seqs=4, lens=(37, 5, 0, 64)):
    cache = random_cache(rng, num_pages=16, page_size=16, num_kv_heads=2, head_dim=64, k_bits=4, v_bits=3)
    seq_lens = jnp.asarray(lens[:num_seqs], jnp.int32)
    tables = random_tables(rng, np.asarray(seq_lens), 16, 16, max_pages=5)
    return cache, tables, seq_lens


def test_vmap_over_sequences_with_shared_cache(rng):
    cache, tables, lens = _setup(rng)
    batch = 3
    q = jnp.asarray(rng.normal(size=(batch, 4, 6, 64)), jnp.float32)
    tables_b = jnp.stack([jnp.roll(tables, i, axis=0) for i in range(batch)])
    lens_b = jnp.stack([jnp.roll(lens, i) for i in range(batch)])
    fn = jax.vmap(tq.paged_decode, in_axes=(0, None, 0, 0))
    jaxpr = jax.make_jaxpr(fn)(q, cache, tables_b, lens_b).jaxpr
    assert _primitive_count(jaxpr, paged_decode_p) == 1, "vmap must fold into one kernel call"
    got = jax.jit(fn)(q, cache, tables_b, lens_b)
    for b in range(batch):
        want = decode_f64(np.asarray(q[b], np.float64), cache, tables_b[b], lens_b[b])
        assert rel_err(got[b], want) < 1e-5


def test_vmap_non_leading_axes(rng):
    cache, tables, lens = _setup(rng)
    q = jnp.asarray(rng.normal(size=(4, 6, 2, 64)), jnp.float32)  # batch on axis 2 of q
    fn = jax.vmap(tq.paged_decode, in_axes=(2, None, None, None), out_axes=1)
    got = fn(q, cache, tables, lens)
    assert got.shape == (4, 2, 6, 64)
    for b in range(2):
        want = decode_f64(np.asarray(q[:, :, b], np.float64), cache, tables, lens)
        assert rel_err(got[:, b], want) < 1e-5


def test_nested_vmap_over_different_arguments(rng):
    cache, tables, lens = _setup(rng)
    q = jnp.asarray(rng.normal(size=(2, 4, 6, 64)), jnp.float32)
    lens_b = jnp.stack([lens, jnp.minimum(lens, 9), jnp.maximum(lens - 3, 0)])  # [3, num_seqs]
    inner = jax.vmap(tq.paged_decode, in_axes=(0, None, None, None))        # over q
    outer = jax.vmap(inner, in_axes=(None, None, None, 0))                  # over seq_lens
    fn = jax.jit(outer)
    jaxpr = jax.make_jaxpr(outer)(q, cache, tables, lens_b).jaxpr
    assert _primitive_count(jaxpr, paged_decode_p) == 1
    got = fn(q, cache, tables, lens_b)
    assert got.shape == (3, 2, 4, 6, 64)
    for i in range(3):
        for j in range(2):
            want = decode_f64(np.asarray(q[j], np.float64), cache, tables, lens_b[i])
            assert rel_err(got[i, j], want) < 1e-5


def test_vmap_over_caches_folds_pools(rng):
    caches = [_setup(rng)[0] for _ in range(2)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *caches)
    _, tables, lens = _setup(rng)
    q = jnp.asarray(rng.normal(size=(2, 4, 6, 64)), jnp.float32)
    got = jax.vmap(tq.paged_decode, in_axes=(0, 0, None, None))(q, stacked, tables, lens)
    for b in range(2):
        want = decode_f64(np.asarray(q[b], np.float64), caches[b], tables, lens)
        assert rel_err(got[b], want) < 1e-5


def test_vmap_write_cache_gives_each_element_its_writes(rng):
    cache, _, _ = _setup(rng)
    k = jnp.asarray(rng.normal(size=(3, 5, 2, 64)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(3, 5, 2, 64)), jnp.float32)
    slots = jnp.asarray(np.stack([rng.choice(256, 5, replace=False) for _ in range(3)]).astype(np.int32))
    fn = jax.vmap(tq.write_cache, in_axes=(None, 0, 0, 0))
    jaxpr = jax.make_jaxpr(fn)(cache, k, v, slots).jaxpr
    assert _primitive_count(jaxpr, write_cache_p) == 1  # K and V: one call
    got = fn(cache, k, v, slots)
    for b in range(3):
        want = tq.write_cache(cache, k[b], v[b], slots[b])
        for name in ("k_codes", "k_norms", "v_codes", "v_norms"):
            np.testing.assert_array_equal(np.asarray(getattr(got, name)[b]), np.asarray(getattr(want, name)))


def test_vmap_compress_batch_of_size_zero(rng):
    codec = tq.TurboQuant(head_dim=64, bits=4)
    x = jnp.zeros((0, 3, 64), jnp.float32)
    codes, norms = jax.vmap(tq.compress, in_axes=(0, None))(x, codec)
    assert codes.shape == (0, 3, 32) and norms.shape == (0, 3)


def test_paged_decode_batch_of_size_zero(rng):
    cache, tables, lens = _setup(rng)
    q = jnp.zeros((0, 4, 6, 64), jnp.float32)
    out = jax.vmap(tq.paged_decode, in_axes=(0, None, None, None))(q, cache, tables, lens)
    assert out.shape == (0, 4, 6, 64)


def test_write_cache_is_in_place_under_donation(rng):
    cache, _, _ = _setup(rng)
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
    caches = jax.tree.map(lambda *xs: jnp.stack(xs), *[_setup(rng)[0] for _ in range(3)])
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
    cache, _, _ = _setup(rng)
    before = jax.tree.map(np.asarray, cache)
    k = jnp.asarray(rng.normal(size=(4, 2, 64)), jnp.float32)
    new = jax.jit(tq.write_cache)(cache, k, k, jnp.asarray([3, 40, 41, 200], jnp.int32))
    jax.block_until_ready(new)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(cache)):
        np.testing.assert_array_equal(a, np.asarray(b))
    assert not np.array_equal(np.asarray(new.k_norms), before.k_norms)


def test_backends_agree_and_context_manager_switches(rng):
    cache, tables, lens = _setup(rng)
    q = jnp.asarray(rng.normal(size=(4, 6, 64)), jnp.float32)
    ffi_out = tq.paged_decode(q, cache, tables, lens)
    with tq.use_backend("xla"):
        assert tq.get_backend() == "xla"
        jaxpr = jax.make_jaxpr(tq.paged_decode)(q, cache, tables, lens).jaxpr
        assert _primitive_count(jaxpr, paged_decode_p) == 0
        xla_out = tq.paged_decode(q, cache, tables, lens)
    assert tq.get_backend() == "ffi"
    assert rel_err(ffi_out, xla_out) < 1e-5


def test_backend_env_var(monkeypatch):
    from jax_tq import backend
    token = backend._override.set(None)  # no use_backend context in force
    try:
        monkeypatch.setenv("JAX_TQ_BACKEND", "xla")
        assert tq.get_backend() == "xla"
        monkeypatch.delenv("JAX_TQ_BACKEND")
        assert tq.get_backend() == "auto"
        monkeypatch.setenv("JAX_TQ_BACKEND", "bogus")
        with pytest.raises(ValueError, match="JAX_TQ_BACKEND"):
            tq.get_backend()
    finally:
        backend._override.reset(token)
    with pytest.raises(ValueError, match="use_backend"):
        with tq.use_backend("cuda"):
            pass
    with pytest.raises(ValueError, match="use_backend"):  # at the call, not only on entering
        tq.use_backend("cuda")


def test_use_backend_without_with_warns_and_changes_nothing():
    before = tq.get_backend()
    with pytest.warns(RuntimeWarning, match="without `with`"):
        tq.use_backend("xla")
    assert tq.get_backend() == before
    scope = tq.use_backend("xla")
    with scope:  # the same scope entered twice, nested
        with scope:
            assert tq.get_backend() == "xla"
        assert tq.get_backend() == "xla"
    assert tq.get_backend() == before


def test_explicit_ffi_backend_raises_where_no_kernel(monkeypatch, rng):
    from jax_tq import _ffi
    monkeypatch.setattr(_ffi, "kernels_available", lambda platform: False)
    codec = tq.TurboQuant(head_dim=64, bits=4)
    x = jnp.asarray(rng.normal(size=(7, 64)), jnp.float32)  # a shape no other test compiles
    with pytest.raises(tq.BackendUnavailableError, match="ffi"):
        jax.jit(lambda x: tq.compress(x, codec))(x)
    with tq.use_backend("auto"):  # auto falls back to the reference (a fresh trace: jit keeps the backend it traced with)
        codes, _ = jax.jit(lambda x: tq.compress(x, codec))(x)
    with tq.use_backend("xla"):
        want, _ = tq.compress(x, codec)
    np.testing.assert_array_equal(np.asarray(codes), np.asarray(want))


def test_a_module_without_a_target_serves_it_with_the_reference(monkeypatch, rng):
    """A kernel module built without some kernels (the CUDA module without JAX_TQ_CUDA_UNVERIFIED):
    backend "auto" runs those ops' reference, "ffi" names the missing target."""
    from jax_tq import _ffi
    monkeypatch.setattr(_ffi, "has_target", lambda platform, target: target != "jax_tq_qjl_scores")
    codec = tq.TurboQuantProd(64, 4)
    keys = tq.qjl_compress(jnp.asarray(rng.normal(size=(9, 64)), jnp.float32), codec)
    q = jnp.asarray(rng.normal(size=(3, 64)), jnp.float32)
    with pytest.raises(tq.BackendUnavailableError, match="built without jax_tq_qjl_scores"):
        jax.jit(lambda q: tq.qjl_scores(q, keys, codec))(q)
    with tq.use_backend("auto"):
        got = jax.jit(lambda q: tq.qjl_scores(q, keys, codec))(q)
    with tq.use_backend("xla"):
        want = tq.qjl_scores(q, keys, codec)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_grad_of_paged_decode_matches_the_reference(rng):
    cache, tables, lens = _setup(rng)
    q = jnp.asarray(rng.normal(size=(4, 6, 64)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(4, 6, 64)), jnp.float32)

    def loss(q, k_norms):
        c = dataclasses.replace(cache, k_norms=k_norms)
        return jnp.sum(w * tq.paged_decode(q, c, tables, lens))

    dq, dkn = jax.jit(jax.grad(loss, argnums=(0, 1)))(q, cache.k_norms)
    with tq.use_backend("xla"):
        want_dq, want_dkn = jax.grad(loss, argnums=(0, 1))(q, cache.k_norms)
    assert rel_err(dq, want_dq) < 1e-5 and rel_err(dkn, want_dkn) < 1e-5
    assert float(jnp.abs(dq).max()) > 0
    # and the gradient is the true one: central finite differences of the float64 oracle along
    # random directions (float32 differences lose ~1e-3 to rounding, which made this check flaky)
    w64, q64, kn64 = (np.asarray(a, np.float64) for a in (w, q, cache.k_norms))
    def loss_f64(q, k_norms):
        return float(np.sum(w64 * decode_f64(q, dataclasses.replace(cache, k_norms=k_norms), tables, lens)))
    dir_q = rng.normal(size=q64.shape)
    dir_kn = rng.normal(size=kn64.shape)
    eps = 1e-5
    fd_q = (loss_f64(q64 + eps * dir_q, kn64) - loss_f64(q64 - eps * dir_q, kn64)) / (2 * eps)
    fd_kn = (loss_f64(q64, kn64 + eps * dir_kn) - loss_f64(q64, kn64 - eps * dir_kn)) / (2 * eps)
    assert abs(fd_q - float(np.sum(np.asarray(dq, np.float64) * dir_q))) < 1e-4 * max(1.0, abs(fd_q))
    assert abs(fd_kn - float(np.sum(np.asarray(dkn, np.float64) * dir_kn))) < 1e-4 * max(1.0, abs(fd_kn))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decompress_is_differentiable_in_norms_on_every_backend(rng, dtype):
    codec = tq.TurboQuant(64, bits=3, seed=4)
    codes, norms = tq.compress(jnp.asarray(rng.normal(size=(2, 5, 64)), jnp.float32), codec)
    weights = jnp.asarray(rng.normal(size=(2, 5, 64)), jnp.float32)
    loss = lambda n: jnp.sum(tq.decompress(codes, n, codec, dtype=dtype).astype(jnp.float32) * weights)  # noqa: E731
    grads = {}
    for backend in ("ffi", "xla"):
        with tq.use_backend(backend):
            grads[backend] = np.asarray(jax.jit(jax.grad(loss))(norms))
            # forward mode too: the tangent is d_norm * Pi^T c[codes]
            _, tangent = jax.jvp(lambda n: tq.decompress(codes, n, codec), (norms,), (jnp.ones_like(norms),))
            np.testing.assert_allclose(np.asarray(tangent), np.asarray(tq.decompress(codes, jnp.ones_like(norms), codec)),
                                       rtol=1e-5, atol=1e-6)
    # d loss / d norm = <weights, Pi^T c[codes]>
    want = np.sum(np.asarray(weights) * np.asarray(decompress_f64(codes, np.ones(norms.shape), codec)), axis=-1)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    assert rel_err(grads["ffi"], want) < tol
    assert rel_err(grads["xla"], want) < tol


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_compress_is_differentiable_through_its_norms_on_every_backend(rng, dtype):
    codec = tq.TurboQuant(64, bits=3, seed=5)
    x = jnp.asarray(rng.normal(size=(3, 4, 64)) * 2, dtype).at[1, 2].set(0)  # one zero vector
    w = jnp.asarray(rng.normal(size=(3, 4)), jnp.float32)
    loss = lambda x: jnp.sum(tq.compress(x, codec)[1] * w)  # noqa: E731
    x64 = np.asarray(x, np.float64)
    norm = np.linalg.norm(x64, axis=-1, keepdims=True)
    want = np.asarray(w, np.float64)[..., None] * np.divide(x64, norm, out=np.zeros_like(x64), where=norm > 0)
    for backend in ("ffi", "xla"):
        with tq.use_backend(backend):
            got = np.asarray(jax.jit(jax.grad(loss))(x), np.float64)
        assert np.all(got[1, 2] == 0), backend  # the zero vector: no gradient, no NaN
        assert rel_err(got, want) < (1e-5 if dtype == jnp.float32 else 1e-2), backend


def test_write_cache_gradients_match_across_backends(rng):
    """d/dk, d/dv through the written norms, and the pool norms' gradient kept at the unwritten
    slots only; a padding token (slot -1) gets none."""
    cache, _, _ = _setup(rng)
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
    cache, _, _ = _setup(rng)
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
    cache, _, _ = _setup(rng)
    k = jnp.zeros((0, 2, 64), jnp.float32)
    loss = lambda k, k_norms: jnp.sum(tq.write_cache(dataclasses.replace(cache, k_norms=k_norms), k, k,  # noqa: E731
                                                     jnp.zeros((0,), jnp.int32)).k_norms)
    for backend in ("ffi", "xla"):
        with tq.use_backend(backend):
            dk, dpool = jax.grad(loss, argnums=(0, 1))(k, cache.k_norms)
        assert dk.shape == (0, 2, 64)
        np.testing.assert_array_equal(np.asarray(dpool), 1.0)  # nothing written: every norm passes through


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
