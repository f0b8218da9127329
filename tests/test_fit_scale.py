"""The fitted scale (TurboQuant(scale="fit"), docs/FORMAT.md "Fitted scale"): every backend against
an independent float64 numpy oracle, the FORMAT.md test vectors, its error against the plain codec's,
its gradient, and the cache write that uses it."""
from __future__ import annotations

import dataclasses
import itertools
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tq as tq
from jax_tq import codebook, reference
from jax_tq.compress import compress_p
from jax_tq.format import FIT_GRID, MIN_NORM, pack_codes, unpack_codes
from conftest import kernel_backend, slow_unless
from oracle import close_centroids

FORMAT_MD = pathlib.Path(__file__).resolve().parents[1] / "docs" / "FORMAT.md"
BACKENDS = ("ffi", "xla")


def fit_candidates(x, rotation, centroids):
    """float64 oracle of the fitted scale's search: y [n, d] (computed in float64), the scaled
    boundaries [K, 2^bits - 1] (the format's float32 products), every pre-scaling's codes [K, n, d],
    gains <y, c>^2 / |c|^2 [K, n] and stored scales [K, n]."""
    x = np.asarray(x, np.float64)
    norms = np.linalg.norm(x, axis=-1)
    norms = np.where(norms < MIN_NORM, 0.0, norms)  # stored as the zero vector below it
    y = (x * np.where(norms > 0, 1 / np.where(norms > 0, norms, 1), 0)[:, None]) @ np.asarray(rotation, np.float64).T
    c32 = np.asarray(centroids, np.float32)
    boundaries = ((c32[1:] + c32[:-1]) * np.float32(0.5)).astype(np.float32)
    scaled = np.stack([(np.float32(s) * boundaries).astype(np.float64) for s in FIT_GRID])
    codes = np.sum(y[None, ..., None] > scaled[:, None, None, :], axis=-1)
    c = c32.astype(np.float64)[codes]
    dot, sq = np.sum(y * c, axis=-1), np.sum(c * c, axis=-1)
    return y, scaled, codes, dot * dot / sq, norms * dot / sq


def fit_oracle(x, rotation, centroids):
    """float64 oracle of the fitted scale: (codes [n, d] of the winning pre-scaling, its gain
    <y, c>^2 / |c|^2 [n], the best gain [n], the stored scale [n]); the scaled boundaries are the
    format's float32 products, y is computed in float64."""
    _, _, codes, gains, scales = fit_candidates(x, rotation, centroids)
    best = np.argmax(gains, axis=0)  # the first maximum
    rows = np.arange(gains.shape[1])
    return codes[best, rows], gains[best, rows], gains.max(axis=0), scales[best, rows]


def float32_choices(x, rotation, centroids, got_codes, y_tol=1e-6, gain_tol=2e-6, max_near=6):
    """Per row, whether got_codes is a choice a backend computing y and the gains in float32 may
    make (docs/FORMAT.md "Rounding"). A coordinate whose y lies within y_tol of one of pre-scaling
    k's boundaries may take either neighbouring code under k, which moves k's gain at first order
    (~1e-5 relative), not only by the rounding of the sums; so each k's gain spans [lo_k, hi_k] over
    those variants of its codes. got_codes is a choice where it is one of some k's variants and
    hi_k >= max_k lo_k * (1 - gain_tol). A row with more than max_near such coordinates under one k
    (a zero row: y = 0 on a boundary 0) is not constrained."""
    y, scaled, codes, gains, _ = fit_candidates(x, rotation, centroids)
    c64 = np.asarray(centroids, np.float32).astype(np.float64)
    num_k, n, _ = codes.shape
    lo, hi = gains.copy(), gains.copy()
    chosen = np.all(got_codes[None] == codes, axis=-1)  # [K, n]: got_codes are k's own
    free = np.zeros(n, bool)
    for k in range(num_k):
        near = np.abs(y[:, :, None] - scaled[k][None, None, :]) <= y_tol  # [n, d, boundaries]
        for r in np.flatnonzero(near.any(axis=(1, 2))):
            coords, bounds = np.nonzero(near[r])
            if len(coords) > max_near:
                free[r] = True
                continue
            others = np.where(codes[k, r, coords] == bounds + 1, bounds, bounds + 1)
            variant_gains = []
            for flip in itertools.product((False, True), repeat=len(coords)):
                variant = codes[k, r].copy()
                variant[coords[list(flip)]] = others[list(flip)]
                c = c64[variant]
                variant_gains.append((y[r] @ c) ** 2 / (c @ c))
                chosen[k, r] |= np.array_equal(got_codes[r], variant)
            lo[k, r], hi[k, r] = min(variant_gains), max(variant_gains)
    floor = lo.max(axis=0) * (1 - gain_tol)
    return free | np.any(chosen & (hi >= floor[None]), axis=0)


def fit_vectors():
    """Rows '| fit | bits | scale | codes |' of docs/FORMAT.md."""
    pattern = re.compile(r"^\|\s*fit\s*\|\s*([234])\s*\|\s*([\d.]+)\s*\|\s*([0-9a-f]+)\s*\|\s*$")
    return [(int(m.group(1)), float(m.group(2)), bytes.fromhex(m.group(3)))
            for m in map(pattern.match, FORMAT_MD.read_text().splitlines()) if m]


def test_format_md_fit_vectors_on_every_backend():
    vectors = fit_vectors()
    assert [bits for bits, _, _ in vectors] == [4, 3, 2]
    j = np.arange(64)
    x = (np.sin(1.7 * j + 0.3) + 0.05 * j / 64).astype(np.float32)[None]
    for bits, scale, packed in vectors:
        centroids = jnp.asarray(codebook.lloyd_max_centroids(64, bits), jnp.float32)
        for backend in BACKENDS:
            codes, norms = compress_p.bind(jnp.asarray(x), jnp.eye(64, dtype=jnp.float32), centroids, bits=bits,
                                           fit_scale=True, backend=backend)
            assert np.asarray(codes)[0].tobytes() == packed, (bits, backend)
            np.testing.assert_allclose(float(norms[0]), scale, rtol=2e-6)
        oracle_codes, _, _, oracle_scale = fit_oracle(x, np.eye(64), centroids)
        assert pack_codes(oracle_codes.astype(np.uint8), bits)[0].tobytes() == packed
        np.testing.assert_allclose(oracle_scale[0], scale, rtol=2e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", slow_unless((64, 96, 128, 256), lambda d: d in (64, 128)))
@pytest.mark.parametrize("bits", (2, 3, 4))
def test_fit_compress_matches_the_float64_oracle(rng, backend, head_dim, bits):
    codec = tq.TurboQuant(head_dim, bits, int(rng.integers(1000)), "hadamard" if head_dim != 96 else "haar", "fit")
    n = 301
    x = rng.normal(size=(n, head_dim)) * rng.uniform(0.01, 50, size=(n, 1))
    x[0] = 0.0  # the zero vector: scale 0, the codes of y = 0
    x[1, :] = 0.0
    x[1, 3] = -2.0  # one coordinate: a spike the candidates must place
    x = x.astype(np.float32)
    with tq.use_backend(backend):
        codes, scales = jax.jit(tq.compress)(jnp.asarray(x), codec)
    want_codes, want_gain, best_gain, want_scale = fit_oracle(x, codec.rotation, codec.centroids)
    got_codes = unpack_codes(np.asarray(codes), bits, head_dim).astype(np.int64)
    same = np.all(got_codes == want_codes, axis=-1)
    # Another choice only where float32 rounding allows it (of y, or of u before the CPU kernel's
    # float64 rotation): a candidate whose gain ties the best, a coordinate on a boundary.
    bad = ~same & ~float32_choices(x, codec.rotation, codec.centroids, got_codes)
    assert not np.any(bad), f"rows {np.flatnonzero(bad)} chose codes that rounding does not explain"
    assert same.mean() > 0.98
    np.testing.assert_allclose(np.asarray(scales)[same], want_scale[same], rtol=1e-5, atol=1e-30)
    assert float(scales[0]) == 0.0 and np.all(got_codes[0] == (1 << (bits - 1)) - 1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim,bits,ratio", [(64, 4, 0.85), (128, 4, 0.90), (64, 3, 0.93), (64, 2, 0.99)])
def test_fit_scale_lowers_the_reconstruction_error(rng, backend, head_dim, bits, ratio):
    """The fitted scale's mean squared error against the plain codec's on Gaussian rows: below
    ``ratio`` of it (measured 0.75, 0.84, 0.88, 0.97)."""
    x = jnp.asarray(rng.normal(size=(4000, head_dim)), jnp.float32)
    errors = {}
    with tq.use_backend(backend):
        for scale in ("norm", "fit"):
            codec = tq.TurboQuant(head_dim, bits, 3, "hadamard", scale)
            x_hat = tq.decompress(*tq.compress(x, codec), codec)
            errors[scale] = float(jnp.mean(jnp.sum((x - x_hat) ** 2, -1) / jnp.sum(x * x, -1)))
    assert errors["fit"] < ratio * errors["norm"], errors
    assert errors["norm"] < 1.05 * codebook.mse_per_unit_vector(head_dim, bits)  # the plain codec is unchanged


@pytest.mark.parametrize("backend", BACKENDS)
def test_fit_scale_gradient_is_the_least_squares_scale_s(rng, backend):
    """scale = <x, Pi^T c[codes]> / |c[codes]|^2 is linear in x for fixed codes: its gradient is
    Pi^T c[codes] / |c[codes]|^2, checked against float64 finite differences that keep the codes."""
    codec = tq.TurboQuant(64, 3, 2, "haar", "fit")
    x = jnp.asarray(rng.normal(size=(5, 64)), jnp.float32)
    with tq.use_backend(backend):
        grad = jax.grad(lambda x: jnp.sum(tq.compress(x, codec)[1] * jnp.arange(1.0, 6.0)))(x)
        codes, _ = tq.compress(x, codec)
    direction = np.asarray(reference.decompress(codes, jnp.ones(5), codec.rotation, codec.centroids, 3), np.float64)
    want = direction / np.sum(direction ** 2, -1, keepdims=True) * np.arange(1.0, 6.0)[:, None]
    np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_cache_with_fitted_codecs_stores_compress_s_rows(rng, backend):
    k_codec = tq.TurboQuant(64, 4, 0, "hadamard", "fit")
    v_codec = tq.TurboQuant(64, 2, 1, "haar", "fit")
    cache = tq.PagedKVCache.create(num_pages=4, page_size=8, num_kv_heads=2, k_codec=k_codec, v_codec=v_codec)
    k = jnp.asarray(rng.normal(size=(6, 2, 64)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(6, 2, 64)), jnp.bfloat16)
    slots = jnp.asarray([3, 9, -1, 31, 17, 0], jnp.int32)
    with tq.use_backend(backend):
        new = jax.jit(tq.write_cache)(cache, k, v, slots)
        k_codes, k_scales = tq.compress(k, k_codec)
        v_codes, v_scales = tq.compress(v, v_codec)
    for t, slot in enumerate(np.asarray(slots)):
        if slot < 0:
            continue
        page, off = divmod(int(slot), 8)
        np.testing.assert_array_equal(np.asarray(new.k_codes[page, :, off]), np.asarray(k_codes[t]))
        np.testing.assert_array_equal(np.asarray(new.v_codes[page, :, off]), np.asarray(v_codes[t]))
        # (XLA may round the two programs' float32 sums differently in the last bit)
        np.testing.assert_allclose(np.asarray(new.k_norms[page, :, off]), np.asarray(k_scales[t]), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(new.v_norms[page, :, off]), np.asarray(v_scales[t]), rtol=1e-6)
    assert int(jnp.sum(new.k_norms != 0)) == 5 * 2


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("bits", (2, 3, 4))
@pytest.mark.parametrize("rows", (1000, 4101))
def test_fit_compress_on_the_gpu_matches_the_float64_oracle(request, rng, head_dim, bits, rows):
    """One warp per row below 4096 rows, the quad kernel from there: codes a choice float32 rounding
    allows (97% the float64 oracle's own, their scale within 2e-5)."""
    codec = tq.TurboQuant(head_dim, bits, int(rng.integers(1000)), "hadamard", "fit")
    x = (rng.normal(size=(rows, head_dim)) * rng.uniform(0.01, 50, size=(rows, 1))).astype(np.float32)
    with kernel_backend(request, ["jax_tq_compress"]):
        codes, scales = jax.jit(tq.compress)(jnp.asarray(x, jnp.bfloat16), codec)
    x = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)
    want_codes, _, best_gain, want_scale = fit_oracle(x, codec.rotation, codec.centroids)
    got_codes = unpack_codes(np.asarray(codes), bits, head_dim).astype(np.int64)
    same = np.all(got_codes == want_codes, axis=-1)
    bad = ~same & ~float32_choices(x, codec.rotation, codec.centroids, got_codes)
    assert not np.any(bad), np.flatnonzero(bad)
    assert same.mean() > 0.97
    np.testing.assert_allclose(np.asarray(scales)[same], want_scale[same], rtol=2e-5)


def many_rows_fit_write_check(request, rng, head_dim, bits, dtype, special=True):
    """write_cache of fitted Hadamard codecs with 4101 vectors per pool (the CUDA write's quad
    kernel from 4096: groups of 8 per warp, the last one partly empty) into poisoned pools and
    window rows: zero, one-spike, NaN and (bfloat16 / float32) huge, tiny, 2^127-spike and
    below-MIN_NORM vectors, a padding and an out-of-pool slot. Every written token's codes are a choice float32 rounding
    allows (98% the float64 oracle's own, their scale within 2e-5); zero vectors (and norms below
    2^-64) store 0 and the codes of y = 0, NaN vectors NaN and codes 0; the window rows are bf16(Pi x); every other slot
    and entry keeps its poison."""
    hkv, page_size, num_pages, t, num_windows, window = 3, 16, 96, 1367, 4, 256
    k_codec = tq.TurboQuant(head_dim, bits[0], int(rng.integers(1000)), "hadamard", "fit")
    v_codec = tq.TurboQuant(head_dim, bits[1], int(rng.integers(1000)), "hadamard", "fit")
    cache = tq.PagedKVCache.create(num_pages=num_pages, page_size=page_size, num_kv_heads=hkv, k_codec=k_codec,
                                   v_codec=v_codec, window=window, num_windows=num_windows)
    cache = dataclasses.replace(
        cache, k_codes=jnp.full(cache.k_codes.shape, 0xAB, jnp.uint8), v_codes=jnp.full(cache.v_codes.shape, 0xAB, jnp.uint8),
        k_norms=jnp.full(cache.k_norms.shape, jnp.nan, jnp.float32), v_norms=jnp.full(cache.v_norms.shape, jnp.nan, jnp.float32),
        k_window=jnp.full(cache.k_window.shape, 7.0, jnp.bfloat16), v_window=jnp.full(cache.v_window.shape, 7.0, jnp.bfloat16))
    x = rng.normal(size=(2, t, hkv, head_dim)) * rng.uniform(0.01, 50, size=(2, t, hkv, 1))
    if special:
        x[:, 0] = 0.0
        x[:, 1] = 0.0
        x[:, 1, :, 3] = -2.0
        if dtype != jnp.float16:
            x[:, 2] *= 1e25   # sum of squares past float32: the scaled norm
            x[:, 3] = rng.normal(size=x[:, 3].shape) * 2.0**-66  # squares subnormal: the scaled norm; norm > 2^-64
            x[:, 4] = 0.0
            x[:, 4, :, 5] = 2.0 ** 127
            x[:, 9] = 0.0
            x[:, 9, :, 2] = 5e-20  # norm below MIN_NORM = 2^-64: stored as the zero vector
        x[:, 7, :, 9] = np.nan
    x = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)
    total = num_pages * page_size
    slots = rng.permutation(total)[:t].astype(np.int32)
    slots[5], slots[6] = -1, total
    window_slots = np.full(t, -1, np.int32)
    window_slots[:num_windows * window] = rng.permutation(num_windows * window)[:t]
    window_slots[5:9] = -1  # (a token without a page slot writes no window row either)
    with kernel_backend(request, ["jax_tq_write_cache"]):
        out = jax.jit(tq.write_cache)(cache, jnp.asarray(x[0], dtype), jnp.asarray(x[1], dtype), jnp.asarray(slots),
                                      jnp.asarray(window_slots))
    ok = (slots >= 0) & (slots < total)
    page_of, off = slots[ok] // page_size, slots[ok] % page_size
    for which, codec in ((0, k_codec), (1, v_codec)):
        name = "kv"[which]
        codes_pool, norms_pool = np.asarray(getattr(out, f"{name}_codes")), np.asarray(getattr(out, f"{name}_norms"))
        rows = x[which][ok].reshape(-1, head_dim)
        got_codes = unpack_codes(codes_pool[page_of, :, off].reshape(-1, codec.packed_bytes), codec.bits,
                                 head_dim).astype(np.int64)
        got_scale = norms_pool[page_of, :, off].reshape(-1)
        finite = np.all(np.isfinite(rows), axis=-1)
        assert np.all(np.isnan(got_scale[~finite])) and np.all(got_codes[~finite] == 0)
        rows, got_codes, got_scale = rows[finite], got_codes[finite], got_scale[finite]
        want_codes, _, _, want_scale = fit_oracle(rows, codec.rotation, codec.centroids)
        same = np.all(got_codes == want_codes, axis=-1)
        bad = ~same & ~float32_choices(rows, codec.rotation, codec.centroids, got_codes)
        assert not np.any(bad), (name, np.flatnonzero(bad))
        assert same.mean() > 0.98, (name, same.mean())
        np.testing.assert_allclose(got_scale[same], want_scale[same], rtol=2e-5, atol=1e-30)
        zero = np.linalg.norm(rows, axis=-1) < MIN_NORM
        assert np.all(got_scale[zero] == 0.0) and np.all(got_codes[zero] == (1 << (codec.bits - 1)) - 1)
        written = np.zeros((num_pages, page_size), bool)
        written[page_of, off] = True
        assert np.all(codes_pool.transpose(0, 2, 1, 3)[~written] == 0xAB)
        assert np.all(np.isnan(norms_pool.transpose(0, 2, 1)[~written]))
        window_pool = np.asarray(getattr(out, f"{name}_window"), np.float64)
        wok = ok & (window_slots >= 0)
        entries = window_slots[wok]
        want_rows = x[which][wok] @ np.asarray(codec.rotation, np.float64).T          # [n, hkv, d]
        want_rows[np.linalg.norm(x[which][wok], axis=-1) < MIN_NORM] = 0.0        # the zero vector
        got_rows = window_pool[entries // window, :, entries % window]
        fin = np.all(np.isfinite(want_rows), axis=-1) & (np.abs(want_rows).max(-1) < 1e30)
        top = np.abs(want_rows).max(-1, keepdims=True)
        np.testing.assert_allclose((got_rows / np.where(top > 0, top, 1))[fin],
                                   (want_rows / np.where(top > 0, top, 1))[fin], atol=1e-2)
        filled = np.zeros((num_windows, window), bool)
        filled[entries // window, entries % window] = True
        assert np.all(window_pool.transpose(0, 2, 1, 3)[~filled] == 7.0)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("bits", ((4, 3), (2, 4)))
@pytest.mark.parametrize("dtype", (jnp.bfloat16, jnp.float32, jnp.float16))
def test_gpu_fit_write_of_many_rows_matches_the_float64_oracle(request, rng, head_dim, bits, dtype):
    many_rows_fit_write_check(request, rng, head_dim, bits, dtype)


@pytest.mark.gpu
def test_gpu_fit_write_of_many_rows_with_close_boundaries(request, rng, monkeypatch):
    """Centroids two of whose boundaries lie closer than a cell of the kernel's code table (no codec
    of the library has such): K's codes under candidate 0 by search, V's under every candidate
    (test_close_centroids_take_both_fallbacks_of_the_fitted_quad_write); the same checks."""
    monkeypatch.setattr(tq.TurboQuant, "centroids", property(close_centroids))
    many_rows_fit_write_check(request, rng, 128, (4, 3), jnp.bfloat16, special=False)


def walk_conditions(centroids):
    """The two conditions the CUDA fitted quad write checks on its tables (compress.cu
    fill_fit_walk, fill_code_lut): whether no step between neighbouring pre-scalings moves a code by
    more than one (T_{k,i} <= T_{k-1,i+1} and T_{k-1,i} <= T_{k,i+1} for the scaled boundaries
    T_{k,i} = fl32(s_k b_i)), and whether no two of candidate 0's lie within a cell (1 / 119) of its
    code table."""
    c = np.asarray(centroids, np.float32)
    b = ((c[1:] + c[:-1]) * np.float32(0.5)).astype(np.float32)
    t = np.stack([(np.float32(s) * b).astype(np.float32) for s in FIT_GRID]).astype(np.float64)
    one_step = bool(np.all(t[1:, :-1] <= t[:-1, 1:]) and np.all(t[:-1, :-1] <= t[1:, 1:]))
    return one_step, bool(np.min(np.diff(t[0])) >= 1 / 119)


def test_fit_walk_is_exact_for_the_codebooks_of_the_hadamard_write():
    """The CUDA fitted write of Hadamard codecs (head_dim 64 / 128, 2-4 bits, from 4096 rows) finds
    each coordinate's code under pre-scaling k from its code under k - 1 and its code under
    candidate 0 from a table: exact where walk_conditions hold, which they do for every codebook it
    serves (with a margin on the table's cells)."""
    for head_dim in (64, 128):
        for bits in (2, 3, 4):
            c = tq.TurboQuant(head_dim, bits, 0, "hadamard", "fit").centroids
            assert walk_conditions(c) == (True, True), (head_dim, bits)
            b = np.asarray(c, np.float32)
            assert np.min(np.diff((b[1:] + b[:-1]) / 2)) * FIT_GRID[0] > 1.5 / 119, (head_dim, bits)


def test_close_centroids_take_both_fallbacks_of_the_fitted_quad_write():
    """The close-boundaries GPU test's codebooks (oracle.close_centroids) reach both fallbacks of the
    kernel: K's (4 bits) still walks but finds candidate 0's codes by search, V's (3 bits) searches
    every candidate."""
    k_codec, v_codec = (tq.TurboQuant(128, bits, 0, "hadamard", "fit") for bits in (4, 3))
    assert walk_conditions(close_centroids(k_codec)) == (True, False)
    assert walk_conditions(close_centroids(v_codec))[0] is False


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("bits", ((4, 3), (2, 4)))
@pytest.mark.parametrize("dtype", (jnp.bfloat16, jnp.float32))
def test_gpu_write_cache_of_hadamard_codecs_matches_the_float64_oracle(request, rng, head_dim, bits, dtype):
    """write_cache of fitted Hadamard codecs rotates by the fast transform on the GPU (the codecs'
    spec words): every written token's codes and scale as the float64 oracle's (ties aside), its
    window row bf16(Pi x); zero, one-spike, huge and tiny vectors; skipped slots (token 5's window
    entry is left as it was: a padding token writes neither)."""
    k_codec = tq.TurboQuant(head_dim, bits[0], int(rng.integers(1000)), "hadamard", "fit")
    v_codec = tq.TurboQuant(head_dim, bits[1], int(rng.integers(1000)), "hadamard", "fit")
    num_tokens, heads, page = 200, 2, 16
    cache = tq.PagedKVCache.create(num_pages=32, page_size=page, num_kv_heads=heads, k_codec=k_codec,
                                   v_codec=v_codec, window=64, num_windows=4)
    x = rng.normal(size=(2, num_tokens, heads, head_dim)) * rng.uniform(0.01, 50, size=(2, num_tokens, heads, 1))
    x[:, 0] = 0.0
    x[:, 1] = 0.0
    x[:, 1, :, 3] = -2.0
    x[:, 2] *= 1e25   # sum of squares past float32: the scaled norm
    x[:, 3] = rng.normal(size=x[:, 3].shape) * 2.0**-66  # squares subnormal: the scaled norm; norm > 2^-64
    x = np.asarray(jnp.asarray(x, dtype), np.float64)
    slots = rng.permutation(32 * page)[:num_tokens].astype(np.int32)
    slots[5] = -1
    window_slots = rng.permutation(4 * 64)[:num_tokens].astype(np.int32)
    window_slots[6] = -1
    with kernel_backend(request, ["jax_tq_write_cache"]):
        new = jax.jit(tq.write_cache)(cache, jnp.asarray(x[0], dtype), jnp.asarray(x[1], dtype), jnp.asarray(slots),
                                      jnp.asarray(window_slots))
    for which, codec, codes_pool, norms_pool, window in ((0, k_codec, new.k_codes, new.k_norms, new.k_window),
                                                        (1, v_codec, new.v_codes, new.v_norms, new.v_window)):
        rows = x[which].reshape(-1, head_dim)
        want_codes, _, best_gain, want_scale = fit_oracle(rows, codec.rotation, codec.centroids)
        ok = np.repeat(slots >= 0, heads)
        page_of, off = np.repeat(slots // page, heads), np.repeat(slots % page, heads)
        head = np.tile(np.arange(heads), num_tokens)
        got = np.asarray(codes_pool)[page_of[ok], head[ok], off[ok]]
        got_codes = unpack_codes(got, codec.bits, head_dim).astype(np.int64)
        same = np.all(got_codes == want_codes[ok], axis=-1)
        assert same.mean() > 0.97, (which, same.mean())
        got_scale = np.asarray(norms_pool)[page_of[ok], head[ok], off[ok]]
        np.testing.assert_allclose(got_scale[same], want_scale[ok][same], rtol=2e-5)
        assert np.all(got_scale[[0, 1]] == 0.0)  # token 0: zero vectors
        entries = np.repeat(window_slots, heads)
        wok = (entries >= 0) & ok  # a token with no page slot (padding) writes no window row either
        want_rows = rows @ np.asarray(codec.rotation, np.float64).T
        got_rows = np.asarray(window, np.float64)[entries[wok] // 64, head[wok], entries[wok] % 64]
        scale = np.abs(want_rows[wok]).max(-1, keepdims=True)
        np.testing.assert_allclose(got_rows / np.where(scale > 0, scale, 1), want_rows[wok] / np.where(scale > 0, scale, 1),
                                   atol=1e-2)
        before = np.asarray(cache.k_window if which == 0 else cache.v_window)
        padding = window_slots[5]
        np.testing.assert_array_equal(np.asarray(window)[padding // 64, :, padding % 64], before[padding // 64, :, padding % 64])
