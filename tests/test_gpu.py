"""CUDA kernels (backend "ffi" on a GPU) against the float64 reference (computed on the CPU) and the
CPU kernels, on fresh random inputs. Skipped unless the default JAX device is a GPU.

Covers: compress / decompress for every head_dim x bits x dtype (small and large batches: the two
tile shapes of the CUDA GEMM), write_cache_pool into poisoned pools (written slots match compress,
every other byte untouched, donated and non-donated), paged decode over a cross product of
head_dim, K/V bits, page sizes, GQA groups, split counts (1, 3, more than pages), seq_lens with 0
and non-multiples of the page size, invalid block-table entries, q dtypes, huge logits, jit and
vmap.
"""
from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tq as tq
from jax_tq.format import unpack_codes
from oracle import compress_f64, decode_f64, decompress_f64, random_cache, random_tables, rel_err


def _has_gpu() -> bool:
    try:
        return jax.devices()[0].platform == "gpu"
    except RuntimeError:
        return False


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _has_gpu(), reason="needs a CUDA GPU")]

HEAD_DIMS = (64, 80, 96, 128, 192, 256)


@pytest.fixture(autouse=True)
def ffi_backend():
    with tq.use_backend("ffi"):
        yield


def _cpu():
    return jax.devices("cpu")[0]


def _gpu():
    return jax.devices()[0]


def _on_cpu(fn, *args, **kwargs):
    """Run fn with every array argument (pytrees included) on the CPU: the CPU kernel / oracle."""
    def to_cpu(a):
        return jax.device_put(a, _cpu()) if isinstance(a, (jax.Array, np.ndarray)) else a
    with jax.default_device(_cpu()):
        return fn(*jax.tree_util.tree_map(to_cpu, args), **kwargs)


def _poison_device(nbytes: int) -> None:
    buf = jnp.full((max(1, nbytes // 4),), jnp.nan, jnp.float32, device=_gpu())
    buf.block_until_ready()
    del buf


def _codes_agree(got, want, bits, head_dim, x=None, codec=None, tie_tol=1e-4):
    """The codes agree except at boundary ties: codes differ by at most one level and, with the
    inputs x [n, head_dim] and their codec, only where the float64 rotated coordinate lies within
    tie_tol (unit-sphere scale; the kernels' products are ~1e-5 accurate) of the boundary between
    the two levels. Without x, at most 0.1% of the codes may differ."""
    g = unpack_codes(np.asarray(got), bits, head_dim).astype(int).reshape(-1, head_dim)
    w = unpack_codes(np.asarray(want), bits, head_dim).astype(int).reshape(-1, head_dim)
    assert np.all(np.abs(g - w) <= 1), "a code differs by more than one level (not a boundary tie)"
    differ = g != w
    if x is None:
        assert np.mean(~differ) >= 0.999, f"only {np.mean(~differ):.5f} of the codes agree"
        return
    x = np.asarray(x, np.float64).reshape(-1, head_dim)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    y = x @ np.asarray(codec.rotation, np.float64).T / np.where(norms > 0, norms, 1.0)
    cent = np.asarray(codec.centroids, np.float64)
    boundaries = (cent[1:] + cent[:-1]) / 2
    gap = np.abs(y[differ] - boundaries[np.minimum(g, w)[differ]])
    assert np.all(gap <= tie_tol), f"{int(np.sum(gap > tie_tol))} codes differ away from a boundary (max gap {gap.max():.2e})"


# ----------------------------------------------------------------------------- compress / decompress

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# every head_dim x bits once, the dtype cycling; all three dtypes at d=128, 4 bits
COMPRESS_CASES = [(d, b, DTYPES[(i + b) % 3]) for i, d in enumerate(HEAD_DIMS) for b in (2, 3, 4)]
COMPRESS_CASES += [(128, 4, dt) for dt in DTYPES if (128, 4, dt) not in COMPRESS_CASES]


@pytest.mark.parametrize("head_dim,bits,dtype", COMPRESS_CASES)
def test_compress_gpu_vs_reference_and_cpu(rng, head_dim, bits, dtype):
    codec = tq.TurboQuant(head_dim=head_dim, bits=bits, seed=int(rng.integers(1000)))
    n = int(rng.integers(1, 300))
    x = jnp.asarray(rng.normal(size=(n, head_dim)) * rng.uniform(0.1, 10, size=(n, 1)), dtype)
    x = x.at[0].set(0)  # a zero vector: norm 0, decodes to 0
    codes, norms = jax.jit(tq.compress)(x, codec)
    assert codes.devices() == {_gpu()}
    want_codes, want_norms = compress_f64(np.asarray(x.astype(jnp.float32), np.float64), codec)
    np.testing.assert_allclose(np.asarray(norms), want_norms, rtol=2e-6)
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    _codes_agree(codes, want_codes, bits, head_dim, x64, codec)
    cpu_codes, cpu_norms = _on_cpu(jax.jit(tq.compress), x, codec)
    np.testing.assert_allclose(np.asarray(norms), np.asarray(cpu_norms), rtol=2e-6)
    _codes_agree(codes, cpu_codes, bits, head_dim, x64, codec)
    assert float(norms[0]) == 0.0


@pytest.mark.parametrize("head_dim,bits", [(128, 4), (80, 3), (256, 2)])
def test_compress_large_batch(rng, head_dim, bits):
    """Large N takes the 64-vectors-per-CTA tile; N not a multiple of it."""
    codec = tq.TurboQuant(head_dim=head_dim, bits=bits, seed=int(rng.integers(1000)))
    n = 20000 + int(rng.integers(1, 63))
    x = jnp.asarray(rng.normal(size=(n, head_dim)), jnp.bfloat16)
    codes, norms = jax.jit(tq.compress)(x, codec)
    want_codes, want_norms = compress_f64(np.asarray(x.astype(jnp.float32), np.float64), codec)
    np.testing.assert_allclose(np.asarray(norms), want_norms, rtol=2e-6)
    _codes_agree(codes, want_codes, bits, head_dim, np.asarray(x.astype(jnp.float32), np.float64), codec)
    # Same vectors through the small-batch tile give identical codes (same fp32 operation order).
    small_codes, small_norms = jax.jit(tq.compress)(x[:100], codec)
    np.testing.assert_array_equal(np.asarray(small_codes), np.asarray(codes[:100]))
    np.testing.assert_array_equal(np.asarray(small_norms), np.asarray(norms[:100]))


@pytest.mark.parametrize("head_dim,bits,dtype", COMPRESS_CASES)
def test_decompress_gpu_vs_reference(rng, head_dim, bits, dtype):
    codec = tq.TurboQuant(head_dim=head_dim, bits=bits, seed=int(rng.integers(1000)))
    n = int(rng.integers(1, 200))
    codes = jnp.asarray(rng.integers(0, 256, size=(n, codec.packed_bytes), dtype=np.uint8))
    norms = jnp.asarray(rng.uniform(0.1, 5, size=(n,)).astype(np.float32))
    _poison_device(n * head_dim * 4 * 4)
    got = jax.jit(tq.decompress, static_argnums=(2, 3))(codes, norms, codec, dtype)
    want = decompress_f64(np.asarray(codes), np.asarray(norms), codec)
    assert got.dtype == dtype and got.shape == (n, head_dim)
    tol = {jnp.float32: 1e-6, jnp.bfloat16: 8e-3, jnp.float16: 1e-3}[dtype]
    assert rel_err(got, want) < tol
    cpu = _on_cpu(jax.jit(tq.decompress, static_argnums=(2, 3)), codes, norms, codec, dtype)
    assert rel_err(got, cpu) < tol


def test_decompress_large_batch(rng):
    codec = tq.TurboQuant(head_dim=128, bits=4, seed=3)
    n = 20000 + 17
    codes = jnp.asarray(rng.integers(0, 256, size=(n, codec.packed_bytes), dtype=np.uint8))
    norms = jnp.asarray(rng.uniform(0.1, 5, size=(n,)).astype(np.float32))
    got = jax.jit(tq.decompress, static_argnums=(2, 3))(codes, norms, codec, jnp.float32)
    want = decompress_f64(np.asarray(codes), np.asarray(norms), codec)
    assert rel_err(got, want) < 1e-6
    small = jax.jit(tq.decompress, static_argnums=(2, 3))(codes[-50:], norms[-50:], codec, jnp.float32)
    assert rel_err(small, want[-50:]) < 1e-6


# ----------------------------------------------------------------------------- write_cache_pool

WRITE_CASES = [(128, 4, 4, 16, 8), (64, 2, 3, 8, 2), (80, 3, 3, 48, 1), (96, 4, 2, 256, 4),
               (192, 3, 4, 16, 3), (256, 2, 2, 8, 2)]


# K and V of one dtype run in ONE launch (grid.z = 2); of different dtypes in two.
@pytest.mark.parametrize("donate,k_dtype,v_dtype", [(False, jnp.bfloat16, jnp.float16), (True, jnp.bfloat16, jnp.bfloat16),
                                                    (False, jnp.float32, jnp.float32), (True, jnp.float16, jnp.float32)])
@pytest.mark.parametrize("head_dim,k_bits,v_bits,page_size,hkv", WRITE_CASES)
def test_write_cache_poisoned_pools(rng, head_dim, k_bits, v_bits, page_size, hkv, donate, k_dtype, v_dtype):
    num_pages = 7
    k_codec = tq.TurboQuant(head_dim=head_dim, bits=k_bits, seed=int(rng.integers(1000)))
    v_codec = tq.TurboQuant(head_dim=head_dim, bits=v_bits, seed=int(rng.integers(1000)))
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
        for i, s in enumerate(slots):
            if not 0 <= s < total:
                continue
            p, o = divmod(int(s), page_size)
            np.testing.assert_array_equal(got_codes[p, :, o], np.asarray(codes_new[i]))
            np.testing.assert_array_equal(got_norms[p, :, o], np.asarray(norms_new[i]))
        # everything else untouched
        assert np.all(got_codes.transpose(0, 2, 1, 3)[~written] == 0xAB)
        assert np.all(np.isnan(got_norms.transpose(0, 2, 1)[~written]))
        # and the written values agree with the float64 reference
        x = np.asarray((k if name == "k" else v).astype(jnp.float32), np.float64)
        codec = k_codec if name == "k" else v_codec
        want_codes, want_norms = compress_f64(x.reshape(-1, head_dim), codec)
        _codes_agree(np.asarray(codes_new).reshape(-1, codec.packed_bytes), want_codes, bits, head_dim, x, codec)
        np.testing.assert_allclose(np.asarray(norms_new).reshape(-1), want_norms, rtol=2e-6)


def test_write_cache_prefill_size_one_launch(rng):
    """A prefill-size write (24k vectors per pool: the large-tile kernel, K and V in one launch)
    writes exactly what compress gives, at every slot, and nothing else."""
    hkv, d, page_size, num_pages, t = 8, 128, 16, 256, 3000
    k_codec, v_codec = tq.TurboQuant(head_dim=d, bits=4, seed=3), tq.TurboQuant(head_dim=d, bits=3, seed=4)
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
        codes, norms = jax.jit(tq.compress)(x, codec)
        np.testing.assert_array_equal(np.asarray(getattr(out, f"{name}_codes"))[p, :, o], np.asarray(codes))
        np.testing.assert_array_equal(np.asarray(getattr(out, f"{name}_norms"))[p, :, o], np.asarray(norms))
        assert int(np.isnan(np.asarray(getattr(out, f"{name}_norms"))).sum()) == (num_pages * page_size - t) * hkv


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
        _codes_agree(np.asarray(codes).reshape(-1, codec.packed_bytes), want_codes, 4, d,
                     np.asarray(y.astype(jnp.float32), np.float64), codec)
        np.testing.assert_allclose(np.asarray(norms).reshape(-1), want_norms, rtol=2e-6)


# ----------------------------------------------------------------------------- paged decode

# (head_dim, k_bits, v_bits, page_size, group, num_kv_heads, num_splits, q dtype)
DECODE_CASES = [
    (128, 4, 4, 16, 4, 2, None, jnp.bfloat16),
    (128, 4, 4, 16, 4, 2, 1, jnp.float32),
    (128, 4, 4, 16, 4, 2, 3, jnp.float32),
    (128, 3, 2, 8, 8, 1, 64, jnp.float32),   # more splits than pages
    (128, 2, 4, 48, 16, 2, 3, jnp.float16),  # group 16: two head tiles
    (64, 4, 3, 16, 1, 3, 3, jnp.float32),
    (64, 2, 2, 256, 2, 2, 1, jnp.bfloat16),
    (80, 3, 3, 16, 3, 2, 3, jnp.float32),
    (80, 4, 2, 48, 6, 1, 5, jnp.float16),
    (96, 3, 4, 8, 4, 2, 3, jnp.float32),
    (96, 2, 3, 16, 7, 1, 1, jnp.float32),
    (192, 4, 4, 16, 8, 1, 3, jnp.float32),
    (192, 3, 2, 256, 2, 2, 2, jnp.bfloat16),
    (256, 4, 4, 16, 8, 1, 3, jnp.float32),   # group 8 at d=256: two tiles of 4
    (256, 2, 3, 48, 4, 2, 64, jnp.float32),
    (256, 3, 3, 8, 24, 1, 3, jnp.float32),   # group 24: three tiles
]


#: The float16 tensor-core kernel's phase trace (builds with JAX_TQ_TRACE_PHASES=ON):
#: [CTAs][warps][stamps][globaltimer ns, SM id] (kTrace* in paged_decode.cu).
PHASE_TRACE_SHAPE = (2048, 8, 10, 2)


def _read_phase_trace(module):
    """The CUDA module's phase trace as uint64 PHASE_TRACE_SHAPE (the read clears it)."""
    return np.frombuffer(module.phase_trace(), np.uint64).reshape(PHASE_TRACE_SHAPE)


def _decode_inputs(rng, head_dim, k_bits, v_bits, page_size, group, hkv, qdtype, num_seqs=5, max_len=700,
                   rotation="haar", seq_lens=None):
    """Random decode inputs; seq_lens: given lengths instead of random ones (then num_seqs and
    max_len are unused)."""
    if seq_lens is None:
        seq_lens = rng.integers(1, max_len, size=num_seqs).astype(np.int32)
        seq_lens[0] = 0  # empty sequence -> zeros
        seq_lens[-1] = page_size * int(rng.integers(1, 4))  # an exact multiple of the page size
    seq_lens = np.asarray(seq_lens, np.int32)
    num_seqs = len(seq_lens)
    need = sum(-(-int(n) // page_size) for n in seq_lens)
    num_pages = need + 3
    cache = random_cache(rng, num_pages=num_pages, page_size=page_size, num_kv_heads=hkv, head_dim=head_dim,
                         k_bits=k_bits, v_bits=v_bits, seed=int(rng.integers(1000)), rotation=rotation)
    tables = np.array(random_tables(rng, seq_lens, page_size, num_pages))
    # An invalid page id among the attended pages of one sequence: its tokens are skipped.
    if -(-int(seq_lens[1]) // page_size) >= 2:
        tables[1, 1] = -3
    q = jnp.asarray(rng.normal(size=(num_seqs, hkv * group, head_dim)), qdtype)
    return q, cache, jnp.asarray(tables), jnp.asarray(seq_lens)


_decode = jax.jit(tq.paged_decode, static_argnames=("scale", "num_splits"))


@pytest.mark.parametrize("head_dim,k_bits,v_bits,page_size,group,hkv,num_splits,qdtype", DECODE_CASES)
def test_paged_decode_gpu(rng, head_dim, k_bits, v_bits, page_size, group, hkv, num_splits, qdtype):
    q, cache, tables, lens = _decode_inputs(rng, head_dim, k_bits, v_bits, page_size, group, hkv, qdtype)
    _poison_device(q.size * 4 * 8 * 70)
    got = _decode(q, cache, tables, lens, num_splits=num_splits)
    assert got.shape == q.shape and got.dtype == q.dtype
    got64 = np.asarray(got.astype(jnp.float32), np.float64)
    assert np.all(np.isfinite(got64))
    assert np.all(got64[0] == 0.0), "seq_len 0 must give an all-zero row"
    want = _on_cpu(decode_f64, np.asarray(q.astype(jnp.float32)), cache, tables, lens)
    tol = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.bfloat16): 1e-2, jnp.dtype(jnp.float16): 2e-3}[jnp.dtype(qdtype)]
    assert rel_err(got64, want) < tol
    # Every row individually (a wrong row could hide in the global norm).
    for s in range(1, q.shape[0]):
        assert rel_err(got64[s], want[s]) < 5 * tol, f"sequence {s}"
    cpu = _on_cpu(_decode, q, cache, tables, lens, num_splits=num_splits)
    assert rel_err(got64, np.asarray(cpu.astype(jnp.float32), np.float64)) < tol


# The tensor-core kernels (head_dim 64 / 128, K4V4, any group): one-page tiles (page_size a
# multiple of 16) and the per-token path (8, 24), head tiles of 4 and 8 with padding (1, 2, 3, 6,
# 12), both product precisions (v4: float16, v3: float32-accurate). Tolerances: HIGHEST ~f32;
# DEFAULT rounds q, p and centroids to f16.
TC_CASES = [
    (128, 16, 4, None, jnp.bfloat16, None, 1e-2),
    (128, 16, 3, 2, jnp.float32, "highest", 2e-5),
    (128, 32, 8, 5, jnp.float32, None, 2e-5),
    (128, 8, 6, 3, jnp.float32, "default", 3e-3),
    (128, 24, 12, 4, jnp.float16, None, 3e-3),
    (128, 64, 4, 1, jnp.float32, jax.lax.Precision.DEFAULT, 3e-3),
    (128, 256, 8, 2, jnp.bfloat16, "highest", 1e-2),
    (128, 16, 1, None, jnp.bfloat16, None, 1e-2),   # group 1: one head in the 4-head tile
    (128, 16, 2, 3, jnp.float32, "highest", 2e-5),
    (128, 24, 2, 1, jnp.float16, None, 3e-3),
    (64, 16, 4, None, jnp.bfloat16, None, 1e-2),
    (64, 16, 3, 2, jnp.float32, "highest", 2e-5),
    (64, 32, 1, 3, jnp.float32, None, 2e-5),
    (64, 8, 6, 3, jnp.float32, "default", 3e-3),
    (64, 24, 2, 4, jnp.float16, None, 3e-3),
    (64, 48, 12, 1, jnp.bfloat16, None, 1e-2),
    (64, 256, 8, 2, jnp.bfloat16, "highest", 1e-2),
    # head_dim 256: v4's warp pairs (float16 products, page_size a multiple of 16; head tiles of 4),
    # else v1 (float32 products or page_size 8)
    (256, 16, 4, None, jnp.bfloat16, None, 1e-2),
    (256, 32, 2, 3, jnp.float16, None, 3e-3),
    (256, 16, 8, 2, jnp.float32, "default", 3e-3),   # group 8: two head tiles
    (256, 64, 1, 5, jnp.bfloat16, None, 1e-2),
    (256, 48, 3, 1, jnp.float16, None, 3e-3),
    (256, 16, 6, 64, jnp.float32, "default", 3e-3),  # more splits than pages
    (256, 256, 4, 2, jnp.bfloat16, None, 1e-2),
    (256, 8, 4, 2, jnp.bfloat16, None, 1e-2),        # v1: pages of 8
    (256, 16, 4, 2, jnp.float32, "highest", 2e-5),   # v1: float32 products
    # head_dim 80 / 96: rows padded to 128 coordinates (v4's ring, head tiles of 4 and 8; 80: 8-byte
    # copy units); 192: warp pairs of padded halves (head tiles of 4); else v1
    (80, 16, 4, None, jnp.bfloat16, None, 1e-2),
    (80, 32, 8, 3, jnp.float16, None, 3e-3),
    (80, 16, 1, 2, jnp.float32, "default", 3e-3),
    (80, 48, 5, 1, jnp.bfloat16, None, 1e-2),
    (80, 16, 6, 64, jnp.bfloat16, None, 1e-2),        # more splits than pages
    (80, 8, 4, 2, jnp.bfloat16, None, 1e-2),          # v1: pages of 8
    (96, 16, 4, None, jnp.bfloat16, None, 1e-2),
    (96, 32, 8, 3, jnp.float16, None, 3e-3),
    (96, 16, 1, 2, jnp.float32, "default", 3e-3),
    (96, 48, 6, 1, jnp.bfloat16, None, 1e-2),
    (96, 64, 3, 64, jnp.bfloat16, None, 1e-2),
    (96, 8, 4, 2, jnp.bfloat16, None, 1e-2),          # v1: pages of 8
    (192, 16, 4, None, jnp.bfloat16, None, 1e-2),
    (192, 32, 2, 3, jnp.float16, None, 3e-3),
    (192, 16, 1, 1, jnp.float32, "default", 3e-3),
    (192, 16, 8, 2, jnp.bfloat16, None, 1e-2),        # group 8: two head tiles of 4
    (192, 32, 16, 1, jnp.float16, None, 3e-3),
    (192, 16, 4, 2, jnp.float32, "highest", 2e-5),   # v1: float32 products
]


# 2- and 3-bit K and / or V (spread to nibbles as they are loaded), both head_dims, both precisions:
# v4's ring (float16 products, page_size a multiple of 16: 2-4 stages by width), its register
# variant (page_size 8 / 24) and v3 (float32-accurate products).
TC_BITS_CASES = [
    (128, 2, 2, 16, 4, None, jnp.bfloat16, None, 1e-2),
    (128, 4, 2, 16, 1, 3, jnp.float32, "highest", 2e-5),
    (128, 2, 4, 24, 8, 2, jnp.float16, None, 3e-3),
    (128, 2, 2, 256, 8, 2, jnp.bfloat16, None, 1e-2),
    (128, 3, 3, 16, 4, None, jnp.bfloat16, None, 1e-2),
    (128, 3, 3, 24, 8, 2, jnp.float16, None, 3e-3),
    (128, 3, 3, 16, 2, 3, jnp.float32, "highest", 2e-5),
    (128, 4, 3, 32, 4, 3, jnp.bfloat16, None, 1e-2),
    (128, 3, 4, 64, 1, None, jnp.float32, "default", 3e-3),
    (128, 3, 2, 16, 6, 4, jnp.bfloat16, None, 1e-2),
    (128, 2, 3, 8, 3, 2, jnp.float32, "highest", 2e-5),
    (64, 2, 2, 32, 3, 1, jnp.float32, None, 2e-5),
    (64, 4, 2, 8, 2, 4, jnp.bfloat16, None, 1e-2),
    (64, 2, 4, 16, 6, None, jnp.float32, "default", 3e-3),
    (64, 3, 3, 16, 4, None, jnp.bfloat16, None, 1e-2),
    (64, 3, 3, 8, 2, 3, jnp.float32, "highest", 2e-5),
    (64, 3, 2, 32, 8, 2, jnp.float16, None, 3e-3),
    (64, 2, 3, 24, 1, None, jnp.bfloat16, None, 1e-2),
    (64, 4, 3, 48, 3, 2, jnp.bfloat16, None, 1e-2),
    # the other ring configurations (added after the last GPU run of this list)
    (128, 4, 2, 16, 4, 2, jnp.bfloat16, None, 1e-2),
    (128, 2, 3, 32, 2, None, jnp.bfloat16, None, 1e-2),
    (128, 2, 4, 16, 8, 3, jnp.float16, None, 3e-3),
    (64, 4, 2, 16, 4, None, jnp.bfloat16, None, 1e-2),
    (64, 3, 4, 32, 2, 2, jnp.float16, None, 3e-3),
    (64, 2, 4, 64, 1, 3, jnp.bfloat16, None, 1e-2),
    # head_dim 256: v4's warp pairs with 2- / 3-bit K and / or V (2-4 ring stages: tiles of either
    # parity per stage; 3-bit half rows of 3 copy units)
    (256, 2, 2, 16, 4, None, jnp.bfloat16, None, 1e-2),
    (256, 4, 2, 32, 2, 3, jnp.float16, None, 3e-3),
    (256, 2, 4, 16, 1, 2, jnp.float32, "default", 3e-3),
    (256, 3, 4, 16, 4, 2, jnp.bfloat16, None, 1e-2),
    (256, 3, 3, 32, 2, None, jnp.bfloat16, None, 1e-2),
    (256, 4, 3, 16, 4, 3, jnp.float16, None, 3e-3),
    (256, 2, 3, 48, 1, 2, jnp.float32, "default", 3e-3),
    (256, 3, 2, 16, 3, None, jnp.bfloat16, None, 1e-2),
    # head_dim 96 with 2-bit K and / or V: padded rows of 24 bytes (8-byte copy units)
    (96, 2, 2, 16, 4, None, jnp.bfloat16, None, 1e-2),
    (96, 4, 2, 32, 8, 3, jnp.float16, None, 3e-3),
    (96, 2, 4, 16, 1, 2, jnp.float32, "default", 3e-3),
    (96, 2, 2, 48, 6, 64, jnp.bfloat16, None, 1e-2),
    # head_dim 96 with 3-bit K and / or V: stage rows packed at the pool's 36-byte stride
    (96, 3, 3, 16, 4, None, jnp.bfloat16, None, 1e-2),
    (96, 3, 4, 32, 8, 3, jnp.float16, None, 3e-3),
    (96, 4, 3, 16, 1, 2, jnp.float32, "default", 3e-3),
    (96, 3, 2, 48, 6, 64, jnp.bfloat16, None, 1e-2),
    (96, 2, 3, 16, 3, 1, jnp.bfloat16, None, 1e-2),
    (96, 3, 3, 256, 2, 2, jnp.float16, None, 3e-3),
    # head_dim 80 with 2- / 3-bit K and / or V: packed rows of 20 / 30 bytes (2- to 8-byte aligned
    # lane loads), and 4-bit rows packed beside them
    (80, 3, 3, 16, 4, None, jnp.bfloat16, None, 1e-2),
    (80, 2, 2, 32, 8, 3, jnp.float16, None, 3e-3),
    (80, 4, 2, 16, 1, 2, jnp.float32, "default", 3e-3),
    (80, 2, 4, 48, 6, 64, jnp.bfloat16, None, 1e-2),
    (80, 3, 4, 16, 3, 1, jnp.bfloat16, None, 1e-2),
    (80, 4, 3, 256, 2, 2, jnp.float16, None, 3e-3),
    (80, 2, 3, 16, 5, None, jnp.bfloat16, None, 1e-2),
    (80, 3, 2, 64, 4, 4, jnp.float16, None, 3e-3),
]


@pytest.mark.parametrize("head_dim,k_bits,v_bits,page_size,group,num_splits,qdtype,precision,tol", TC_BITS_CASES)
def test_paged_decode_tensor_core_bits(rng, head_dim, k_bits, v_bits, page_size, group, num_splits, qdtype,
                                       precision, tol):
    _check_tensor_core_case(rng, head_dim, k_bits, v_bits, page_size, group, num_splits, qdtype, precision, tol)


@pytest.mark.parametrize("head_dim,page_size,group,num_splits,qdtype,precision,tol", TC_CASES)
def test_paged_decode_tensor_core_cases(rng, head_dim, page_size, group, num_splits, qdtype, precision, tol):
    _check_tensor_core_case(rng, head_dim, 4, 4, page_size, group, num_splits, qdtype, precision, tol)


def _check_tensor_core_case(rng, head_dim, k_bits, v_bits, page_size, group, num_splits, qdtype, precision, tol):
    q, cache, tables, lens = _decode_inputs(rng, head_dim, k_bits, v_bits, page_size, group, 2, qdtype, max_len=900)
    _poison_device(q.size * 4 * 8 * 70)
    fn = jax.jit(lambda *a: tq.paged_decode(*a, num_splits=num_splits, precision=precision))
    got = np.asarray(fn(q, cache, tables, lens).astype(jnp.float32), np.float64)
    assert np.all(np.isfinite(got)) and np.all(got[0] == 0.0)
    want = _on_cpu(decode_f64, np.asarray(q.astype(jnp.float32)), cache, tables, lens)
    assert rel_err(got, want) < tol
    for s in range(1, q.shape[0]):
        assert rel_err(got[s], want[s]) < 5 * tol, f"sequence {s}"


@pytest.mark.parametrize("qdtype", [jnp.float32, jnp.bfloat16])
def test_paged_decode_huge_v_norms(rng, qdtype):
    """V norms far beyond the f16 range (1e6 .. 1e30) stay finite and exact in relative terms."""
    q, cache, tables, lens = _decode_inputs(rng, 128, 4, 4, 16, 4, 2, qdtype, num_seqs=4, max_len=800)
    big = jnp.asarray(10.0 ** rng.uniform(6, 30, size=cache.v_norms.shape), jnp.float32)
    cache = dataclasses.replace(cache, v_norms=big)
    got = np.asarray(_decode(q, cache, tables, lens, num_splits=3).astype(jnp.float32), np.float64)
    want = _on_cpu(decode_f64, np.asarray(q.astype(jnp.float32)), cache, tables, lens)
    assert np.all(np.isfinite(got))
    tol = 2e-5 if qdtype == jnp.float32 else 1e-2
    for s in range(1, q.shape[0]):
        assert rel_err(got[s], want[s]) < tol, f"sequence {s}"


@pytest.mark.parametrize("num_seqs,qdtype,head_dim,group", [
    (2, jnp.bfloat16, 128, 4), (11, jnp.float16, 128, 4), (43, jnp.float32, 128, 4), (171, jnp.bfloat16, 128, 4),
    (13, jnp.bfloat16, 64, 4), (9, jnp.float32, 64, 2), (7, jnp.bfloat16, 256, 2), (5, jnp.float16, 256, 5)])
def test_paged_decode_row_counts(rng, num_seqs, qdtype, head_dim, group):
    """Up to 2052 query rows with NaN / inf query rows among them: NaN rows exactly there, every
    other row against float64; the device memory is poisoned first."""
    q, cache, tables, lens = _decode_inputs(rng, head_dim, 4, 4, 16, group, 3, qdtype, num_seqs=num_seqs, max_len=90)
    bad = np.zeros(q.shape[:2], bool)
    bad[-1, 5] = bad[num_seqs // 2, 0] = True
    q = q.at[-1, 5, 7].set(jnp.nan).at[num_seqs // 2, 0, head_dim - 28].set(-jnp.inf)
    for splits in (1, 3):
        _poison_device(q.size * 4 * 8 * 10)
        got = np.asarray(_decode(q, cache, tables, lens, num_splits=splits).astype(jnp.float32), np.float64)
        assert np.all(np.isnan(got[bad])) and np.all(np.isfinite(got[~bad]))
        want = _on_cpu(decode_f64, np.asarray(jnp.where(jnp.isfinite(q), q, 0).astype(jnp.float32)), cache,
                       tables, lens)
        tol = 2e-5 if qdtype == jnp.float32 else 1e-2
        assert rel_err(got[~bad], want[~bad]) < tol
        for s in range(1, num_seqs):
            ok = ~bad[s]
            assert rel_err(got[s][ok], want[s][ok]) < 5 * tol, f"sequence {s}"


@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_v4_query_rotation_overflow_row(rng, num_splits):
    """A finite bfloat16 query of 3e38 in every coordinate has a q_rot beyond float32: v4 flags the
    row when it stages q and writes a NaN row (through the combine with splits), as the reference
    does; a query of 1e-30 keeps its float64 value, and so do the other rows."""
    q, cache, tables, lens = _decode_inputs(rng, 128, 4, 4, 16, 4, 2, jnp.bfloat16, num_seqs=3, max_len=300)
    q = q.at[1, 2].set(3e38).at[2, 5].multiply(1e-30)
    _poison_device(q.size * 4 * 8 * 10)
    got = np.asarray(_decode(q, cache, tables, lens, num_splits=num_splits).astype(jnp.float32), np.float64)
    bad = np.zeros(q.shape[:2], bool)
    bad[1, 2] = True
    assert np.all(np.isnan(got[bad])) and np.all(np.isfinite(got[~bad]))
    want = _on_cpu(decode_f64, np.asarray(q.astype(jnp.float32)).clip(-1e30, 1e30), cache, tables, lens)
    assert rel_err(got[~bad], want[~bad]) < 1e-2
    assert rel_err(got[2, 5], want[2, 5]) < 5e-2


# Hadamard codecs: the tensor-core kernels rotate q in their prologue and the output in their
# epilogue (one split) or in the combine (splits). v4 ring (page 16 / 32), v4's per-token path
# (page 24), v3 (float32-accurate products), head tiles of 4 and 8 with padding (3, 6, 12).
FUSED_CASES = [
    (16, 4, 1, jnp.bfloat16, None, 1e-2),
    (16, 4, 3, jnp.bfloat16, None, 1e-2),
    (32, 8, None, jnp.float16, None, 3e-3),
    (24, 6, 2, jnp.bfloat16, None, 1e-2),
    (16, 3, 1, jnp.float32, "highest", 2e-5),
    (64, 12, 4, jnp.float32, "highest", 2e-5),
    (16, 4, 1, jnp.float32, None, 3e-3),
    (16, 2, 1, jnp.bfloat16, None, 1e-2, 2),   # K2V2 (v4 ring), group 2
    (32, 4, 3, jnp.float32, "highest", 2e-5, 2),
    (16, 4, 2, jnp.bfloat16, None, 1e-2, 3),   # K3V3 (v4 ring)
    (24, 8, 1, jnp.float16, None, 3e-3, 3),    # K3V3 (v4 register variant)
]


@pytest.mark.parametrize("page_size,group,num_splits,qdtype,precision,tol,bits",
                         [c if len(c) == 7 else (*c, 4) for c in FUSED_CASES])
def test_paged_decode_fused_rotation(rng, page_size, group, num_splits, qdtype, precision, tol, bits):
    """Against float64, with NaN rows where q is not finite and where a finite q's rotation passes
    float32 (3e38 in every coordinate); the memory is poisoned first, and the rotation operand must
    reach the kernel wherever the tensor-core kernels run."""
    q, cache, tables, lens = _decode_inputs(rng, 128, bits, bits, page_size, group, 2, qdtype, max_len=900,
                                            rotation="hadamard")
    q = q.at[2, 1, 17].set(jnp.nan)
    bad = np.zeros(q.shape[:2], bool)
    bad[2, 1] = True
    if qdtype != jnp.float16:
        q = q.at[3, 0].set(3e38)
        bad[3, 0] = True
    fn = jax.jit(lambda *a: tq.paged_decode(*a, num_splits=num_splits, precision=precision))
    fused = "tensor<2x128xi32>" in fn.lower(q, cache, tables, lens).as_text()
    assert fused == tq.plan_decode(q, cache, tables, num_splits=num_splits, precision=precision)["fused_rotation"]
    _poison_device(q.size * 4 * 8 * 70)
    got = np.asarray(fn(q, cache, tables, lens).astype(jnp.float32), np.float64)
    assert np.all(np.isnan(got[bad])) and np.all(np.isfinite(got[~bad])) and np.all(got[0] == 0.0)
    want = _on_cpu(decode_f64, np.asarray(jnp.where(jnp.asarray(bad)[..., None], 0, q).astype(jnp.float32)),
                   cache, tables, lens)
    assert rel_err(got[~bad], want[~bad]) < tol
    for s in range(1, q.shape[0]):
        ok = ~bad[s]
        assert rel_err(got[s][ok], want[s][ok]) < 5 * tol, f"sequence {s}"


@pytest.mark.parametrize("hkv,group,num_splits,rotation", [
    (2, 1, 1, "hadamard"), (4, 3, 1, "haar"), (4, 4, 3, "hadamard"), (6, 2, 2, "haar"),
    (3, 4, 1, "hadamard"), (1, 2, 5, "haar"), (2, 4, 200, "hadamard"),
])
def test_paged_decode_two_item_rows(rng, hkv, group, num_splits, rotation):
    """head_dim 128 K4V4 with head tiles of 4: an even number of KV heads runs two per CTA (v4's
    ITEMS = 2, on sm_90), an odd number one per CTA; every KV head's rows against float64, with the
    fused (Hadamard) epilogue and without, with one split and with more splits than pages."""
    q, cache, tables, lens = _decode_inputs(rng, 128, 4, 4, 16, group, hkv, jnp.bfloat16, num_seqs=4, max_len=1200,
                                            rotation=rotation)
    _poison_device(q.size * 4 * 8 * 70)
    got = np.asarray(_decode(q, cache, tables, lens, num_splits=num_splits).astype(jnp.float32), np.float64)
    assert np.all(np.isfinite(got)) and np.all(got[0] == 0.0)
    want = _on_cpu(decode_f64, np.asarray(q.astype(jnp.float32)), cache, tables, lens)
    for s in range(1, q.shape[0]):
        for h in range(hkv):
            rows = slice(h * group, (h + 1) * group)
            assert rel_err(got[s, rows], want[s, rows]) < 2e-2, (s, h)


@pytest.mark.parametrize("num_seqs,items,num_splits,rotation,group", [
    (40, 4, 1, "hadamard", 4), (40, 4, 1, "haar", 4), (100, 8, 1, "hadamard", 4), (100, 8, 1, "haar", 4),
    (20, 4, 2, "hadamard", 4), (50, 8, 2, "hadamard", 4), (40, 4, 1, "hadamard", 2), (100, 8, 1, "haar", 3),
])
def test_paged_decode_many_item_rows(rng, num_seqs, items, num_splits, rotation, group):
    """head_dim 128 K4V4, 8 KV heads in head tiles of 4 (groups of 2 and 3 padded), grids of more
    than two items per SM: 40
    sequences (160 CTAs of two items, 2 waves on 132 SMs) run 4 KV heads per CTA, 100 sequences
    8 (one wave each). The phase trace shows the KV heads of each CTA on one SM (and the next
    CTA's on another); every KV head's rows against float64, fused epilogue (one split, Hadamard)
    and not."""
    from jax_tq import _ffi
    module = _ffi.cuda_module()
    tracing = hasattr(module, "phase_trace")
    q, cache, tables, lens = _decode_inputs(rng, 128, 4, 4, 16, group, 8, jnp.bfloat16, num_seqs=num_seqs,
                                            max_len=700, rotation=rotation)
    if tracing:
        module.phase_trace()
    _poison_device(q.size * 4 * 8 * 70)
    got = np.asarray(_decode(q, cache, tables, lens, num_splits=num_splits).astype(jnp.float32), np.float64)
    sms = _read_phase_trace(module)[..., 0, 0, 1] if tracing else None
    assert np.all(np.isfinite(got)) and np.all(got[0] == 0.0)
    want = _on_cpu(decode_f64, np.asarray(q.astype(jnp.float32)), cache, tables, lens)
    for s in range(1, num_seqs):
        for h in range(8):
            rows = slice(h * group, (h + 1) * group)
            assert rel_err(got[s, rows], want[s, rows]) < 2e-2, (s, h)
    planned = tq.plan_decode(q, cache, tables, num_splits=num_splits)
    if module.device_info().get("sm_count") == 132 and _default_kernel():
        assert planned["kernel"] == "tensor-core-f16" and planned["items"] == items, planned
    if tracing and planned["items"] == items:  # the KV heads of each CTA on one SM, the next CTA's on another
        cols = num_seqs * num_splits
        for x in range(cols):
            on = [sms[x + cols * row] for row in range(8)]
            for row in range(8):
                assert on[row] == on[row - row % items], (x, row, on)
            if items < 8:
                assert on[0] != on[items], (x, on)


def _default_kernel() -> bool:
    return os.environ.get("JAX_TQ_DECODE_KERNEL", "") in ("", "tensor-core-f16")


@pytest.mark.parametrize("hkv,page_size,num_splits,rotation", [
    (2, 16, 1, "hadamard"), (2, 16, 1, "haar"), (4, 64, 2, "hadamard"), (6, 32, 2, "haar"),
])
def test_paged_decode_long_sequences(rng, hkv, page_size, num_splits, rotation):
    """Sequences of 9,000-12,000 tokens (head_dim 128 K4V4, an even number of KV heads: two items
    per CTA on sm_90, 8 warps each) in 1 or 2 splits: 35-94 tiles per warp, many passes over each
    warp's ring, more than 32 tiles per warp in every split (the other decode tests stay under
    2,000 tokens), second splits (tok0 > 0), pages of several tiles; every KV head's rows against
    float64."""
    group = 4
    q, cache, tables, lens = _decode_inputs(rng, 128, 4, 4, page_size, group, hkv, jnp.bfloat16,
                                            rotation=rotation, seq_lens=[0, 12000 - 5, 9000])
    _poison_device(q.size * 4 * 8 * 70)
    got = np.asarray(_decode(q, cache, tables, lens, num_splits=num_splits).astype(jnp.float32), np.float64)
    assert np.all(np.isfinite(got)) and np.all(got[0] == 0.0)
    want = _on_cpu(decode_f64, np.asarray(q.astype(jnp.float32)), cache, tables, lens)
    for s in (1, 2):
        for h in range(hkv):
            rows = slice(group * h, group * h + group)
            assert rel_err(got[s, rows], want[s, rows]) < 2e-2, (s, h)


def test_paged_decode_split_counts_agree(rng):
    q, cache, tables, lens = _decode_inputs(rng, 128, 4, 4, 16, 4, 2, jnp.float32, num_seqs=3, max_len=2000)
    outs = [np.asarray(_decode(q, cache, tables, lens, num_splits=s)) for s in (1, 2, 3, 7, 200)]
    for o in outs[1:]:
        assert rel_err(o, outs[0]) < 1e-5


def test_paged_decode_huge_logits(rng):
    q, cache, tables, lens = _decode_inputs(rng, 128, 4, 4, 16, 4, 2, jnp.float32, num_seqs=4, max_len=1500)
    q = q * 1e4
    for splits in (1, 5):
        got = np.asarray(_decode(q, cache, tables, lens, num_splits=splits), np.float64)
        assert np.all(np.isfinite(got))
        want = _on_cpu(decode_f64, np.asarray(q), cache, tables, lens)
        # near one-hot softmax: fp32 logits of magnitude ~1e5 carry ~1e-2 absolute rounding
        assert rel_err(got, want) < 2e-2


@pytest.mark.parametrize("qdtype,head_dim", [(jnp.bfloat16, 128), (jnp.float32, 128), (jnp.bfloat16, 256)])
def test_paged_decode_negative_and_nan_v_norms(rng, qdtype, head_dim):
    """Tensor-core kernels (bf16: v4's f16 products, at head_dim 256 its warp pairs; float32: v3):
    V norms weigh with their sign, and a NaN V norm of an attended token gives NaN rows for its KV
    head's query heads, as in the float64 oracle."""
    q, cache, tables, lens = _decode_inputs(rng, head_dim, 4, 4, 16, 4, 2, qdtype, num_seqs=4, max_len=600)
    v_norms = np.array(cache.v_norms)  # [num_pages, num_kv_heads, page_size]
    v_norms *= np.where(rng.random(v_norms.shape) < 0.3, -1.0, 1.0)
    v_norms[int(tables[2, 0]), 1, 0] = np.nan  # sequence 2, KV head 1, token 0
    cache = dataclasses.replace(cache, v_norms=jnp.asarray(v_norms, jnp.float32))
    got = np.asarray(_decode(q, cache, tables, lens, num_splits=2).astype(jnp.float32), np.float64)
    want = _on_cpu(decode_f64, np.asarray(q.astype(jnp.float32)), cache, tables, lens)
    nan_rows = np.isnan(want).any(axis=-1)
    assert nan_rows[2, 4:8].all()  # (other sequences may share the page)
    assert np.isnan(got[nan_rows]).all() and np.isfinite(got[~nan_rows]).all()
    assert rel_err(got[~nan_rows], want[~nan_rows]) < (2e-2 if qdtype == jnp.bfloat16 else 2e-5)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_paged_decode_v4_logits_beyond_float32_spacing(rng, head_dim):
    """bf16 queries scaled so that scores reach ~2^28 in log2 units (float32 spacing 32 there) with V
    norms of 1e6 (beyond float16): every output is finite and, being a convex combination of V
    vectors, no longer than the longest attended one."""
    q, cache, tables, lens = _decode_inputs(rng, head_dim, 4, 4, 16, 4, 2, jnp.bfloat16, num_seqs=4, max_len=600)
    v_norms = 10.0 ** rng.uniform(5, 6, size=cache.v_norms.shape)
    cache = dataclasses.replace(cache, v_norms=jnp.asarray(v_norms, jnp.float32))
    q = (q.astype(jnp.float32) * 1e9).astype(jnp.bfloat16)
    got = np.asarray(_decode(q, cache, tables, lens, num_splits=2).astype(jnp.float32), np.float64)
    assert np.all(np.isfinite(got))
    unit = np.asarray(cache.v_codec.centroids, np.float64)[unpack_codes(np.asarray(cache.v_codes), 4, head_dim)]
    longest_v = np.max(np.linalg.norm(unit, axis=-1) * v_norms)
    assert np.all(np.linalg.norm(got, axis=-1) <= 1.01 * longest_v)
    assert np.all(np.linalg.norm(got[1:], axis=-1) > 0)  # sequence 0 is empty (zeros)


def test_the_float16_kernel_runs_its_fastest_variants_on_sm_90():
    """On sm_90 the planner puts every head_dim / width the float16 tensor-core kernel serves on its
    ring (2 CTAs per SM; head_dim 256 and 192: warp pairs), and head_dim 128 K4V4 on several work
    items per CTA; a kernel that no longer fits would quietly fall back to a slower variant."""
    from jax_tq import _ffi
    mod = _ffi.cuda_module()
    info = mod.device_info()
    if (info["cc_major"], info["cc_minor"]) != (9, 0) or not _default_kernel():
        pytest.skip("the rings' shared memory is planned for sm_90")

    def plan(head_dim, k_bits, v_bits, num_seqs=32, group=4):
        return mod.plan_decode(num_seqs, 8 * group, 8, head_dim, 512, 16, k_bits, v_bits, True, False, False)

    for head_dim in (64, 128, 80, 96, 256):
        for k_bits in (2, 3, 4):
            for v_bits in (2, 3, 4):
                got = plan(head_dim, k_bits, v_bits)
                assert got["kernel"] == "tensor-core-f16" and got["ring"], (head_dim, k_bits, v_bits, got)
    assert plan(192, 4, 4)["ring"] and plan(192, 4, 4)["halves"] == 2 and plan(192, 2, 4)["kernel"] == "cuda-core"
    for num_seqs, items in ((32, 2), (64, 4), (128, 8)):
        assert plan(128, 4, 4, num_seqs)["items"] == items, f"head_dim 128 K4V4: one CTA of {items} work items per SM"
    assert mod.plan_decode(32, 32, 8, 128, 512, 16, 4, 4, False, False, False)["kernel"] == "tensor-core-f32"


@pytest.mark.parametrize("num_splits", [1, 2])
def test_paged_decode_phase_trace(rng, num_splits):
    """Builds with JAX_TQ_TRACE_PHASES=ON (benchmarks/phase_trace.py): the float16 kernel stamps every
    warp of every CTA, in time order, with one SM per CTA, and nothing past the grid; reading the
    trace clears it."""
    from jax_tq import _ffi
    module = _ffi.cuda_module()
    if not hasattr(module, "phase_trace") or not _default_kernel():
        pytest.skip("a build without the phase trace (JAX_TQ_TRACE_PHASES=ON builds it)")
    q, cache, tables, lens = _decode_inputs(rng, 128, 4, 4, 16, 4, 2, jnp.bfloat16, num_seqs=3, max_len=2000,
                                            rotation="hadamard")
    module.phase_trace()
    traced = np.asarray(jax.jit(lambda *a: tq.paged_decode(*a, num_splits=num_splits))(q, cache, tables, lens))
    raw = _read_phase_trace(module)
    assert np.all(np.isfinite(traced))
    ctas = q.shape[0] * num_splits * cache.num_kv_heads  # one head tile of 4 per KV head
    stamps, sms = raw[..., 0], raw[..., 1]
    assert np.all(stamps[:ctas] > 0), "every warp of every CTA stamps all ten phases"
    assert np.all(np.diff(stamps[:ctas].astype(np.int64), axis=-1) >= 0), "stamps in time order"
    assert np.all(sms[:ctas] == sms[:ctas, :1, :1]), "one SM per CTA"
    assert np.all(raw[ctas:] == 0), "nothing past the grid"
    if tq.plan_decode(q, cache, tables, num_splits=num_splits)["items"] == 2:
        # Two work items per CTA: the KV heads 2b and 2b + 1 of a (sequence, split) on one SM.
        cols = q.shape[0] * num_splits
        for x in range(cols):
            for b in range(0, cache.num_kv_heads, 2):
                assert sms[x + cols * b, 0, 0] == sms[x + cols * (b + 1), 0, 0], (x, b)
    assert not np.any(np.frombuffer(module.phase_trace(), np.uint64)), "a read clears the trace"


def test_paged_decode_vmap_and_jit(rng):
    caches, qs, tabs, lens_ = [], [], [], []
    for _ in range(3):
        q, cache, tables, lens = _decode_inputs(rng, 64, 4, 2, 16, 2, 2, jnp.float32, num_seqs=2, max_len=300)
        # make pools the same shape for stacking
        caches.append(cache)
        qs.append(q)
        tabs.append(tables)
        lens_.append(lens)
    shapes = {c.k_codes.shape for c in caches}
    if len(shapes) != 1:  # different page counts: pad to the largest pool
        p = max(c.num_pages for c in caches)
        def pad(c):
            extra = p - c.num_pages
            padded = {n: jnp.concatenate([getattr(c, n), jnp.zeros((extra,) + getattr(c, n).shape[1:], getattr(c, n).dtype)])
                      for n in ("k_codes", "k_norms", "v_codes", "v_norms")}
            return dataclasses.replace(c, **padded)
        caches = [pad(c) for c in caches]
    mp = max(t.shape[1] for t in tabs)
    tabs = [jnp.pad(t, ((0, 0), (0, mp - t.shape[1])), constant_values=-1) for t in tabs]
    # All three caches must share the codecs for stacking: rebuild with the first one's codecs.
    caches = [dataclasses.replace(c, k_codec=caches[0].k_codec, v_codec=caches[0].v_codec) for c in caches]
    stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *caches)
    batched = jax.jit(jax.vmap(lambda q, c, t, l: tq.paged_decode(q, c, t, l, num_splits=2)))(
        jnp.stack(qs), stacked, jnp.stack(tabs), jnp.stack(lens_))
    for i in range(3):
        one = _decode(qs[i], caches[i], tabs[i], lens_[i], num_splits=2)
        assert rel_err(batched[i], one) < 1e-6
        want = _on_cpu(decode_f64, np.asarray(qs[i]), caches[i], tabs[i], lens_[i])
        assert rel_err(batched[i], want) < 2e-5
