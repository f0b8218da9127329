"""Each FFI op (CPU kernels, backend "ffi") against the float64 reference on fresh random inputs."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tq as tq
from oracle import compress_f64, decode_f64, decompress_f64, random_cache, random_tables, rel_err

HEAD_DIMS = (64, 80, 96, 128, 192, 256)


@pytest.fixture(autouse=True)
def ffi_backend():
    with tq.use_backend("ffi"):
        yield


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("bits", (2, 3, 4))
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16, jnp.float16))
def test_compress_matches_f64(rng, head_dim, bits, dtype):
    codec = tq.TurboQuant(head_dim=head_dim, bits=bits, seed=int(rng.integers(1000)))
    x = jnp.asarray(rng.normal(size=(257, head_dim)) * rng.uniform(0.1, 10, size=(257, 1)), dtype)
    codes, norms = jax.jit(tq.compress)(x, codec)
    want_codes, want_norms = compress_f64(np.asarray(x, np.float64), codec)
    assert codes.dtype == jnp.uint8 and codes.shape == (257, head_dim * bits // 8)
    np.testing.assert_allclose(np.asarray(norms), want_norms, rtol=2e-6)
    from jax_tq.format import unpack_codes
    got_idx = unpack_codes(np.asarray(codes), bits, head_dim)
    want_idx = unpack_codes(want_codes, bits, head_dim)
    assert np.mean(got_idx == want_idx) > 0.999, "codes differ beyond boundary ties"
    assert np.all(np.abs(got_idx.astype(int) - want_idx.astype(int)) <= 1)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_compress_gives_the_same_bits_for_a_row_alone_or_in_a_batch(rng, head_dim):
    """Large calls rotate with a transposed copy of Pi (CPU handler), small ones with Pi itself:
    both sum every coordinate in the same order, so a row's codes and norm do not depend on the
    batch it came in."""
    codec = tq.TurboQuant(head_dim=head_dim, bits=4, seed=int(rng.integers(1000)))
    with jax.default_device(jax.devices("cpu")[0]):  # the CPU handler, also on a GPU machine
        x = jnp.asarray(rng.normal(size=(64, head_dim)), jnp.float32)
        batch_codes, batch_norms = tq.compress(x, codec)
        for i in (0, 17, 63):
            codes, norms = tq.compress(x[i:i + 1], codec)
            np.testing.assert_array_equal(np.asarray(codes)[0], np.asarray(batch_codes)[i])
            assert np.asarray(norms)[0] == np.asarray(batch_norms)[i]


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("bits", (2, 3, 4))
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16, jnp.float16))
def test_decompress_matches_f64(rng, head_dim, bits, dtype):
    codec = tq.TurboQuant(head_dim=head_dim, bits=bits, seed=int(rng.integers(1000)))
    codes = jnp.asarray(rng.integers(0, 256, size=(33, codec.packed_bytes), dtype=np.uint8))
    norms = jnp.asarray(rng.uniform(0.1, 5, size=(33,)).astype(np.float32))
    got = jax.jit(tq.decompress, static_argnums=3)(codes, norms, codec, dtype)
    want = decompress_f64(np.asarray(codes), np.asarray(norms), codec)
    assert got.dtype == dtype and got.shape == (33, head_dim)
    tol = {jnp.float32: 1e-6, jnp.bfloat16: 8e-3, jnp.float16: 1e-3}[dtype]
    assert rel_err(got, want) < tol


def test_zero_vectors_round_trip_to_zero(rng):
    codec = tq.TurboQuant(head_dim=128, bits=4)
    x = jnp.asarray(rng.normal(size=(4, 128)).astype(np.float32)).at[1].set(0.0)
    codes, norms = tq.compress(x, codec)
    x_hat = tq.decompress(codes, norms, codec)
    assert float(norms[1]) == 0.0
    assert np.all(np.asarray(x_hat[1]) == 0.0)
    assert np.all(np.isfinite(np.asarray(x_hat)))


@pytest.mark.parametrize("head_dim,k_bits,v_bits,page_size,num_kv_heads",
                         [(64, 4, 4, 16, 3), (80, 3, 2, 8, 2), (96, 2, 4, 48, 1), (128, 4, 2, 16, 2),
                          (192, 3, 3, 8, 1), (256, 4, 3, 32, 2)])
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


DECODE_CASES = [
    # head_dim, k_bits, v_bits, page_size, num_kv_heads, group, seq_lens, num_splits
    (64, 4, 4, 16, 3, 3, [37, 0, 5, 64], 1),
    (128, 4, 2, 16, 2, 4, [100, 1, 17], 3),
    (80, 3, 3, 8, 1, 5, [33, 9], 7),
    (96, 2, 4, 48, 2, 1, [96, 200, 0], 2),
    (192, 3, 2, 8, 1, 8, [15, 70], 20),
    (256, 4, 3, 32, 1, 6, [31, 64, 65], None),
    (128, 2, 2, 256, 2, 8, [300, 1], 2),
    (64, 4, 4, 96, 1, 16, [97, 191], 1),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=[str(i) for i in range(len(DECODE_CASES))])
@pytest.mark.parametrize("q_dtype", (jnp.float32, jnp.bfloat16))
def test_paged_decode_matches_f64(rng, case, q_dtype):
    head_dim, k_bits, v_bits, page_size, num_kv_heads, group, seq_lens, num_splits = case
    num_pages = 3 + sum(-(-n // page_size) for n in seq_lens)
    cache = random_cache(rng, num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, k_bits=k_bits, v_bits=v_bits, seed=int(rng.integers(100)))
    seq_lens = jnp.asarray(seq_lens, jnp.int32)
    tables = random_tables(rng, np.asarray(seq_lens), page_size, num_pages, max_pages=1 + max(-(-int(n) // page_size) for n in seq_lens))
    q = jnp.asarray(rng.normal(size=(len(seq_lens), num_kv_heads * group, head_dim)) * 3, q_dtype)
    fn = jax.jit(lambda q, c, t, s: tq.paged_decode(q, c, t, s, num_splits=num_splits))
    got = fn(q, cache, tables, seq_lens)
    want = decode_f64(np.asarray(q, np.float64), cache, tables, seq_lens)
    assert got.shape == q.shape and got.dtype == q_dtype
    tol = 1e-5 if q_dtype == jnp.float32 else 1e-2
    assert rel_err(got, want) < tol
    empty = np.asarray(seq_lens) == 0
    assert np.all(np.asarray(got)[empty] == 0)


@pytest.mark.parametrize("q_scale", (1e3, 1e4))
def test_paged_decode_huge_logits(rng, q_scale):
    cache = random_cache(rng, num_pages=12, page_size=16, num_kv_heads=2, head_dim=128, k_bits=4, v_bits=4)
    seq_lens = jnp.asarray([150, 7, 33], jnp.int32)
    tables = random_tables(rng, np.asarray(seq_lens), 16, 12)
    q = jnp.asarray(rng.normal(size=(3, 4, 128)) * q_scale, jnp.float32)
    for splits in (1, 4, 11):
        got = tq.paged_decode(q, cache, tables, seq_lens, num_splits=splits)
        want = decode_f64(np.asarray(q, np.float64), cache, tables, seq_lens)
        assert rel_err(got, want) < 1e-3
        assert np.abs(np.asarray(got)).max() > 0


def _lowered_rotation_operand(fn, *args) -> bool:
    """Whether the lowered program passes the fused rotation operand (int32 [2, 128]) to the kernel
    (and that it calls the kernel: with or without the rotation, never the jnp reference)."""
    text = jax.jit(fn).lower(*args).as_text()
    assert "jax_tq_paged_decode" in text, "the paged_decode kernel is not called"
    return "tensor<2x128xi32>" in text


@pytest.mark.parametrize("k_bits,v_bits,group,num_splits,q_dtype", [
    (4, 4, 4, 1, jnp.bfloat16), (4, 4, 3, 3, jnp.float32), (3, 2, 8, 2, jnp.float16), (2, 4, 1, 5, jnp.float32)])
def test_paged_decode_fused_hadamard_rotation(rng, k_bits, v_bits, group, num_splits, q_dtype):
    """Hadamard codecs (head_dim 128): the kernel applies q_rot = Pi_k q and out = Pi_v^T o_rot itself
    (the rotation operand reaches the FFI call; no rotation GEMM), with the same values as the
    float64 oracle, as the xla backend (rotation GEMMs around the reference), and NaN rows where q is
    not finite."""
    seq_lens = jnp.asarray([70, 0, 33, 160], jnp.int32)
    num_pages = 3 + sum(-(-int(n) // 16) for n in seq_lens)
    cache = random_cache(rng, num_pages=num_pages, page_size=16, num_kv_heads=2, head_dim=128, k_bits=k_bits,
                         v_bits=v_bits, seed=int(rng.integers(100)), rotation="hadamard")
    tables = random_tables(rng, np.asarray(seq_lens), 16, num_pages)
    q = jnp.asarray(rng.normal(size=(4, 2 * group, 128)) * 3, q_dtype).at[2, 1, 9].set(jnp.nan)
    bad = np.zeros(q.shape[:2], bool)
    bad[2, 1] = True

    def fn(q, t, s):
        return tq.paged_decode(q, cache, t, s, num_splits=num_splits)

    # The CPU kernel and (on a GPU) the tensor-core kernels rotate for every one of these configurations.
    assert _lowered_rotation_operand(fn, q, tables, seq_lens)
    got = np.asarray(jax.jit(fn)(q, tables, seq_lens).astype(jnp.float32), np.float64)
    assert got.dtype == np.float64 and np.all(np.isnan(got[bad])) and np.all(np.isfinite(got[~bad]))
    want = decode_f64(np.asarray(jnp.where(jnp.isnan(q), 0, q), np.float64), cache, tables, seq_lens)
    tol = 1e-5 if q_dtype == jnp.float32 else 1e-2
    assert rel_err(got[~bad], want[~bad]) < tol
    assert np.all(got[1] == 0)
    with tq.use_backend("xla"):
        dense = np.asarray(jax.jit(fn)(q, tables, seq_lens).astype(jnp.float32), np.float64)
    assert np.array_equal(np.isnan(dense), np.isnan(got))
    assert rel_err(got[~bad], dense[~bad]) < tol


def test_paged_decode_fused_rotation_grad_vmap_and_reference_lowering(rng):
    """The fused rotation under grad (q and the norms, against the xla backend), vmap (against the
    unbatched call) and the reference lowering of a zero-size block table (NaN rows, zeros)."""
    cache = random_cache(rng, num_pages=12, page_size=16, num_kv_heads=2, head_dim=128, k_bits=4, v_bits=4,
                         rotation="hadamard")
    seq_lens = jnp.asarray([90, 17, 40], jnp.int32)
    tables = random_tables(rng, np.asarray(seq_lens), 16, 12)
    q = jnp.asarray(rng.normal(size=(3, 8, 128)), jnp.float32)

    def loss(q, k_norms, v_norms):
        c = dataclasses.replace(cache, k_norms=k_norms, v_norms=v_norms)
        return jnp.sum(jnp.sin(tq.paged_decode(q, c, tables, seq_lens)))

    assert _lowered_rotation_operand(lambda q: tq.paged_decode(q, cache, tables, seq_lens), q)  # K4V4, group 4
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, cache.k_norms, cache.v_norms)
    with tq.use_backend("xla"):
        want = jax.grad(loss, argnums=(0, 1, 2))(q, cache.k_norms, cache.v_norms)
    for g, w in zip(grads, want):
        assert rel_err(g, w) < 1e-5 and np.abs(np.asarray(w)).max() > 0
    batch = jnp.stack([q, 2 * q])
    mapped = jax.vmap(lambda x: tq.paged_decode(x, cache, tables, seq_lens))(batch)
    assert rel_err(mapped[1], tq.paged_decode(2 * q, cache, tables, seq_lens)) < 1e-6
    empty = jnp.zeros((3, 0), jnp.int32)
    q_bad = q.at[1, 3, 0].set(jnp.inf)
    out = np.asarray(tq.paged_decode(q_bad, cache, empty, jnp.zeros(3, jnp.int32)))
    assert np.all(np.isnan(out[1, 3])) and np.count_nonzero(np.isnan(out)) == 128
    assert np.all(out[~np.isnan(out)] == 0)
