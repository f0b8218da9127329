"""Pure-jnp reference ops vs independent numpy float64 implementations."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_tq import codebook, codec, reference

MSE_EXACT_D128 = {2: 0.11600, 3: 0.03397, 4: 0.00932}


# ---------------------------------------------------------------------------------------------
# independent numpy helpers
# ---------------------------------------------------------------------------------------------
def np_unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """LSB-first bit stream -> int64 codes [..., d] (independent of jax_tq.format)."""
    flat = np.unpackbits(np.asarray(packed, np.uint8), axis=-1, bitorder="little")
    code_bits = flat.reshape(flat.shape[:-1] + (-1, bits)).astype(np.int64)
    return np.sum(code_bits << np.arange(bits), axis=-1)


def np_pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """codes [..., d] -> LSB-first bytes (independent of jax_tq.format)."""
    code_bits = (np.asarray(codes, np.int64)[..., None] >> np.arange(bits)) & 1
    flat = code_bits.reshape(codes.shape[:-1] + (-1,)).astype(np.uint8)
    return np.packbits(flat, axis=-1, bitorder="little")


def np_dequantize(packed, norm, centroids, bits):
    """Rotated-domain token: norm * c[codes], float64 [d]."""
    return float(norm) * np.asarray(centroids, np.float64)[np_unpack(packed, bits)]


def np_paged_decode(q_rot, k_codes, k_norms, v_codes, v_norms, k_centroids, v_centroids,
                    block_tables, seq_lens, k_bits, v_bits, scale):
    """Loop implementation in float64: gather each valid token, dequantize, softmax attention."""
    num_seqs, num_heads, head_dim = q_rot.shape
    num_pages, num_kv_heads, page_size, _ = k_codes.shape
    group = num_heads // num_kv_heads
    out = np.zeros((num_seqs, num_heads, head_dim))
    for seq in range(num_seqs):
        length = int(np.clip(seq_lens[seq], 0, block_tables.shape[1] * page_size))
        for head in range(num_heads):
            kv_head = head // group
            scores, values = [], []
            for position in range(length):
                page = int(block_tables[seq, position // page_size])
                offset = position % page_size
                if not 0 <= page < num_pages:
                    continue
                key = np_dequantize(k_codes[page, kv_head, offset], k_norms[page, kv_head, offset],
                                    k_centroids, k_bits)
                scores.append(scale * float(np.dot(np.asarray(q_rot[seq, head], np.float64), key)))
                values.append(np_dequantize(v_codes[page, kv_head, offset],
                                            v_norms[page, kv_head, offset], v_centroids, v_bits))
            if scores:
                weights = np.exp(np.array(scores) - max(scores))
                out[seq, head] = (weights / weights.sum()) @ np.array(values)
    return out


def random_unit_vectors(rng, count, head_dim):
    vectors = rng.standard_normal((count, head_dim))
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def codec_arrays(head_dim, bits, seed=0, kind="haar"):
    tq = codec.TurboQuant(head_dim, bits, seed, kind)
    return tq.rotation, tq.centroids


# ---------------------------------------------------------------------------------------------
# compress / decompress
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_measured_mse_matches_exact_beta(bits):
    """TurboQuant_mse distortion on 20000 random unit vectors, d = 128, within 3% of theory."""
    rng = np.random.default_rng(20250401 + bits)  # independent of the codec seed stream
    unit = random_unit_vectors(rng, 20000, 128).astype(np.float32)
    rotation_matrix, centroids = codec_arrays(128, bits, seed=12345)
    codes, norms = reference.compress(unit, rotation_matrix, centroids, bits)
    decoded = np.asarray(reference.decompress(codes, norms, rotation_matrix, centroids, bits))
    mse = np.mean(np.sum((decoded.astype(np.float64) - unit) ** 2, axis=1))
    assert mse == pytest.approx(codebook.mse_per_unit_vector(128, bits), rel=0.03)
    assert mse == pytest.approx(MSE_EXACT_D128[bits], rel=0.03)


def test_measured_mse_hadamard_d80():
    rng = np.random.default_rng(777)
    unit = random_unit_vectors(rng, 20000, 80).astype(np.float32)
    rotation_matrix, centroids = codec_arrays(80, 3, seed=4, kind="hadamard")
    codes, norms = reference.compress(unit, rotation_matrix, centroids, 3)
    decoded = np.asarray(reference.decompress(codes, norms, rotation_matrix, centroids, 3))
    mse = np.mean(np.sum((decoded.astype(np.float64) - unit) ** 2, axis=1))
    assert mse == pytest.approx(codebook.mse_per_unit_vector(80, 3), rel=0.03)


@pytest.mark.parametrize("head_dim,bits", [(64, 2), (80, 3), (128, 4), (192, 3), (256, 2)])
def test_compress_decompress_match_numpy_float64(head_dim, bits):
    rng = np.random.default_rng(head_dim * 10 + bits)
    x = rng.standard_normal((2, 7, head_dim)) * rng.uniform(0.1, 10.0, size=(2, 7, 1))
    rotation_matrix = np.asarray(codec_arrays(head_dim, bits, seed=3)[0], np.float64)
    centroids = np.asarray(codec_arrays(head_dim, bits, seed=3)[1], np.float64)
    with jax.enable_x64(True):
        codes, norms = reference.compress(jnp.asarray(x), jnp.asarray(rotation_matrix),
                                          jnp.asarray(centroids), bits)
        decoded = reference.decompress(codes, norms, jnp.asarray(rotation_matrix),
                                       jnp.asarray(centroids), bits, jnp.float64)
        assert norms.dtype == jnp.float64 and decoded.dtype == jnp.float64
        codes, norms, decoded = np.asarray(codes), np.asarray(norms), np.asarray(decoded)
    expected_norms = np.linalg.norm(x, axis=-1)
    rotated = (x / expected_norms[..., None]) @ rotation_matrix.T
    boundaries = (centroids[1:] + centroids[:-1]) / 2
    expected_codes = np.searchsorted(boundaries, rotated, side="left")  # count of b < y
    np.testing.assert_allclose(norms, expected_norms, rtol=1e-13)
    np.testing.assert_array_equal(codes, np_pack(expected_codes, bits))
    expected_decoded = expected_norms[..., None] * (centroids[expected_codes] @ rotation_matrix)
    np.testing.assert_allclose(decoded, expected_decoded, rtol=1e-12, atol=1e-12)


def test_compress_float32_close_to_float64():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((256, 128)).astype(np.float32)
    rotation_matrix, centroids = codec_arrays(128, 4, seed=1)
    codes32, norms32 = reference.compress(x, rotation_matrix, centroids, 4)
    assert codes32.dtype == jnp.uint8 and codes32.shape == (256, 64)
    assert norms32.dtype == jnp.float32 and norms32.shape == (256,)
    np.testing.assert_allclose(norms32, np.linalg.norm(x.astype(np.float64), axis=1), rtol=1e-6)
    with jax.enable_x64(True):
        codes64, _ = reference.compress(jnp.asarray(x, jnp.float64), rotation_matrix.astype(
            jnp.float64), centroids.astype(jnp.float64), 4)
    mismatched = np.mean(np_unpack(codes32, 4) != np_unpack(np.asarray(codes64), 4))
    assert mismatched < 1e-3  # only coordinates within float32 rounding of a boundary


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_low_precision_inputs_and_outputs(dtype):
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.standard_normal((4, 3, 96)), dtype)
    rotation_matrix, centroids = codec_arrays(96, 3)
    codes, norms = reference.compress(x, rotation_matrix, centroids, 3)
    assert norms.dtype == jnp.float32 and codes.shape == (4, 3, 36)
    decoded = reference.decompress(codes, norms, rotation_matrix, centroids, 3, dtype)
    assert decoded.dtype == dtype and decoded.shape == (4, 3, 96)
    x64 = np.asarray(x, np.float64)
    relative = np.sum((np.asarray(decoded, np.float64) - x64) ** 2) / np.sum(x64 ** 2)
    assert relative < 0.06


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_zero_vector_round_trips_to_zero(bits):
    rotation_matrix, centroids = codec_arrays(128, bits)
    x = np.random.default_rng(2).standard_normal((3, 128)).astype(np.float32)
    x[1] = 0.0
    codes, norms = reference.compress(x, rotation_matrix, centroids, bits)
    assert float(norms[1]) == 0.0 and float(norms[0]) > 0
    assert np.all(np_unpack(codes[1], bits) == 2 ** (bits - 1) - 1)
    decoded = np.asarray(reference.decompress(codes, norms, rotation_matrix, centroids, bits))
    assert np.all(np.isfinite(decoded))
    assert np.all(decoded[1] == 0.0) and np.any(decoded[0] != 0.0)
    grad = jax.grad(lambda v: jnp.sum(reference.compress(v, rotation_matrix, centroids,
                                                         bits)[1]))(jnp.asarray(x))
    assert np.all(np.isfinite(np.asarray(grad)))


def test_quantizer_boundary_goes_to_lower_code():
    centroids = jnp.asarray(codebook.lloyd_max_centroids(128, 3), jnp.float32)
    boundaries = (centroids[1:] + centroids[:-1]) * 0.5
    np.testing.assert_array_equal(reference.quantize_rotated(boundaries, centroids), np.arange(7))
    above = jnp.nextafter(boundaries, jnp.inf)
    above = jnp.where(boundaries == 0, 1e-30, above)  # XLA CPU flushes denormals to zero
    np.testing.assert_array_equal(reference.quantize_rotated(above, centroids), np.arange(1, 8))
    extremes = jnp.asarray([-1.0, 1.0, 0.0], jnp.float32)
    np.testing.assert_array_equal(reference.quantize_rotated(extremes, centroids), [0, 7, 3])


def test_compress_is_jittable():
    rotation_matrix, centroids = codec_arrays(64, 2)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((5, 64)), jnp.float32)
    eager = reference.compress(x, rotation_matrix, centroids, 2)
    jitted = jax.jit(reference.compress, static_argnums=3)(x, rotation_matrix, centroids, 2)
    np.testing.assert_array_equal(eager[0], jitted[0])
    np.testing.assert_allclose(eager[1], jitted[1], rtol=1e-6)


def test_compress_errors():
    rotation_matrix, centroids = codec_arrays(128, 4)
    x = jnp.zeros((2, 128), jnp.float32)
    with pytest.raises(TypeError, match="x"):
        reference.compress(jnp.zeros((2, 128), jnp.int32), rotation_matrix, centroids, 4)
    with pytest.raises(ValueError, match="rotation"):
        reference.compress(jnp.zeros((2, 64), jnp.float32), rotation_matrix, centroids, 4)
    with pytest.raises(ValueError, match="centroids"):
        reference.compress(x, rotation_matrix, centroids, 3)
    with pytest.raises(ValueError, match="bits"):
        reference.compress(x, rotation_matrix, centroids[:2], 1)
    with pytest.raises(ValueError, match="head_dim"):
        reference.compress(jnp.zeros((2, 100)), jnp.eye(100), centroids, 4)


# ---------------------------------------------------------------------------------------------
# write_cache_pool
# ---------------------------------------------------------------------------------------------
def test_write_cache_pool_scatter_and_skip():
    rng = np.random.default_rng(9)
    num_pages, num_kv_heads, page_size, head_dim, bits = 3, 2, 4, 64, 3
    rotation_matrix, centroids = codec_arrays(head_dim, bits)
    packed = head_dim * bits // 8
    old_codes = rng.integers(0, 256, (num_pages, num_kv_heads, page_size, packed), dtype=np.uint8)
    old_norms = rng.uniform(1, 2, (num_pages, num_kv_heads, page_size)).astype(np.float32)
    x = rng.standard_normal((6, num_kv_heads, head_dim)).astype(np.float32)
    slots = np.array([0, 5, -1, 11, 12, 1000], np.int32)  # 12 = P*page is out of range
    new_codes, new_norms = jax.jit(reference.write_cache_pool, static_argnums=6)(
        x, old_codes, old_norms, rotation_matrix, centroids, slots, bits)
    token_codes, token_norms = reference.compress(x, rotation_matrix, centroids, bits)
    expected_codes, expected_norms = old_codes.copy(), old_norms.copy()
    for token, slot in enumerate(slots):
        if 0 <= slot < num_pages * page_size:
            expected_codes[slot // page_size, :, slot % page_size] = token_codes[token]
            expected_norms[slot // page_size, :, slot % page_size] = token_norms[token]
    np.testing.assert_array_equal(new_codes, expected_codes)
    np.testing.assert_array_equal(new_norms, expected_norms)
    assert new_codes.dtype == jnp.uint8 and new_norms.dtype == jnp.float32
    assert not np.array_equal(expected_codes, old_codes)  # something was written
    np.testing.assert_array_equal(expected_codes[0, :, 2], old_codes[0, :, 2])  # untouched slot


def test_write_cache_pool_errors():
    rotation_matrix, centroids = codec_arrays(64, 2)
    codes = jnp.zeros((2, 1, 4, 16), jnp.uint8)
    norms = jnp.zeros((2, 1, 4), jnp.float32)
    x = jnp.zeros((3, 1, 64), jnp.float32)
    with pytest.raises(ValueError, match="slot_mapping"):
        reference.write_cache_pool(x, codes, norms, rotation_matrix, centroids,
                                 jnp.zeros((2,), jnp.int32), 2)
    with pytest.raises(TypeError, match="slot_mapping"):
        reference.write_cache_pool(x, codes, norms, rotation_matrix, centroids,
                                 jnp.zeros((3,), jnp.float32), 2)
    with pytest.raises(TypeError, match="codes"):
        reference.write_cache_pool(x, codes.astype(jnp.int32), norms, rotation_matrix, centroids,
                                 jnp.zeros((3,), jnp.int32), 2)
    with pytest.raises(ValueError, match="norms"):
        reference.write_cache_pool(x, codes, norms[:1], rotation_matrix, centroids,
                                 jnp.zeros((3,), jnp.int32), 2)
    with pytest.raises(ValueError, match="x"):
        reference.write_cache_pool(x[:, :, :32], codes, norms, rotation_matrix, centroids,
                                 jnp.zeros((3,), jnp.int32), 2)


# ---------------------------------------------------------------------------------------------
# paged decode
# ---------------------------------------------------------------------------------------------
def random_paged_case(rng, *, head_dim=64, k_bits=4, v_bits=3, num_pages=9, page_size=4,
                      num_kv_heads=2, num_heads=6):
    """Random pools + tables: GQA, ragged seq_lens, seq_len 0, garbage entries past seq_len,
    an invalid page inside one sequence, and a sequence whose only page is invalid."""
    def pool(bits):
        codes = rng.integers(0, 256, (num_pages, num_kv_heads, page_size, head_dim * bits // 8),
                             dtype=np.uint8)
        norms = rng.uniform(0.5, 2.0, (num_pages, num_kv_heads, page_size)).astype(np.float32)
        return codes, norms
    k_codes, k_norms = pool(k_bits)
    v_codes, v_norms = pool(v_bits)
    max_pages = 4
    seq_lens = np.array([0, 7, 13, 16, 3, 2], np.int32)
    block_tables = np.array([
        [-1, 99, -7, 1000],   # seq_len 0: everything ignored
        [3, 0, -5, 77],       # 7 tokens: pages 3, 0; garbage after
        [1, 2, 4, 6],         # 13 tokens: 4 pages, last one partial
        [5, 8, 7, 2],         # full
        [num_pages, 1, 1, 1], # first page invalid: row contributes nothing -> 0
        [6, -3, 2, 2],
    ], np.int32)
    block_tables[2, 1] = -2  # invalid page inside a sequence: its 4 tokens are skipped
    q_rot = rng.standard_normal((len(seq_lens), num_heads, head_dim)).astype(np.float32)
    k_centroids = codebook.lloyd_max_centroids(head_dim, k_bits).astype(np.float32)
    v_centroids = codebook.lloyd_max_centroids(head_dim, v_bits).astype(np.float32)
    scale = float(head_dim) ** -0.5 * 8.0  # sharpen: centroids are ~1/sqrt(d)
    return (q_rot, k_codes, k_norms, v_codes, v_norms, k_centroids, v_centroids, block_tables,
            seq_lens, k_bits, v_bits, scale)


@pytest.mark.parametrize("k_bits,v_bits", [(4, 3), (2, 4), (3, 2)])
def test_paged_decode_matches_numpy_loop(k_bits, v_bits):
    rng = np.random.default_rng(100 + 10 * k_bits + v_bits)
    args = random_paged_case(rng, k_bits=k_bits, v_bits=v_bits)
    expected = np_paged_decode(*args)
    assert np.abs(expected[1:4]).max() > 1e-3  # the oracle produces non-trivial rows
    decode = jax.jit(reference.paged_decode_rotated, static_argnums=(9, 10))
    out32 = np.asarray(decode(*args))
    assert out32.dtype == np.float32 and out32.shape == expected.shape
    np.testing.assert_allclose(out32, expected, rtol=2e-5, atol=2e-6)
    with jax.enable_x64(True):
        args64 = [jnp.asarray(a, jnp.float64) if isinstance(a, np.ndarray) and a.dtype == np.float32
                  else a for a in args]
        out64 = np.asarray(reference.paged_decode_rotated(*args64))
    assert out64.dtype == np.float64
    np.testing.assert_allclose(out64, expected, rtol=1e-11, atol=1e-13)


def test_paged_decode_empty_rows_exactly_zero_and_clean_gradients():
    rng = np.random.default_rng(31)
    args = list(random_paged_case(rng))
    out = np.asarray(reference.paged_decode_rotated(*args))
    assert np.all(out[0] == 0.0) and np.all(out[4] == 0.0)  # seq_len 0; only page invalid
    assert np.all(np.abs(out[1]).sum(-1) > 0)
    q_grad = jax.grad(lambda q: jnp.sum(reference.paged_decode_rotated(q, *args[1:]) ** 2))(
        jnp.asarray(args[0]))
    q_grad = np.asarray(q_grad)
    assert np.all(np.isfinite(q_grad))
    assert np.all(q_grad[0] == 0.0) and np.any(q_grad[1] != 0.0)


def test_paged_decode_ignores_garbage_past_seq_len_and_unread_pages():
    rng = np.random.default_rng(41)
    args = list(random_paged_case(rng))
    baseline = np.asarray(reference.paged_decode_rotated(*args))
    tables = args[7].copy()
    tables[1, 2:] = [2, 4]      # entries past ceil(7/4) = 2 pages: now valid ids, still unread
    args[7] = tables
    k_codes = args[1].copy()
    k_codes[3, :, 3] ^= 0xFF    # seq 1 token 3 (page 3 offset 3) is valid: must change output
    changed_args = list(args)
    changed_args[1] = k_codes
    np.testing.assert_array_equal(np.asarray(reference.paged_decode_rotated(*args)), baseline)
    assert not np.allclose(np.asarray(reference.paged_decode_rotated(*changed_args))[1],
                           baseline[1])
    seq_lens = args[8].copy()
    seq_lens[3] = 10 ** 6       # clamped to max_pages * page_size = 16
    args[8] = seq_lens
    np.testing.assert_array_equal(np.asarray(reference.paged_decode_rotated(*args)), baseline)


@pytest.mark.slow
def test_paged_decode_full_pipeline_matches_dense_attention():
    """write_cache_pool K/V into pages, paged_decode (rotate in/out) == dense attention on the
    decompressed K/V."""
    rng = np.random.default_rng(55)
    head_dim, num_kv_heads, num_heads, page_size, num_pages = 80, 2, 4, 8, 12
    k_codec = codec.TurboQuant(head_dim, 4, seed=1, rotation="hadamard")
    v_codec = codec.TurboQuant(head_dim, 3, seed=2)
    seq_lens = np.array([19, 0, 24], np.int32)
    max_pages = 3
    block_tables = np.array([[4, 0, 9], [-1, -1, -1], [1, 11, 3]], np.int32)
    num_tokens = max_pages * page_size
    k = rng.standard_normal((3, num_tokens, num_kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((3, num_tokens, num_kv_heads, head_dim)).astype(np.float32)
    k_codes = jnp.zeros((num_pages, num_kv_heads, page_size, head_dim * 4 // 8), jnp.uint8)
    v_codes = jnp.zeros((num_pages, num_kv_heads, page_size, head_dim * 3 // 8), jnp.uint8)
    k_norms = jnp.zeros((num_pages, num_kv_heads, page_size), jnp.float32)
    v_norms = jnp.zeros_like(k_norms)
    positions = np.arange(num_tokens)
    slots = (block_tables[:, positions // page_size] * page_size + positions % page_size)
    slots = np.where(block_tables[:, positions // page_size] >= 0, slots, -1).astype(np.int32)
    flat_slots = slots.reshape(-1)
    k_codes, k_norms = reference.write_cache_pool(k.reshape(-1, num_kv_heads, head_dim), k_codes,
                                                k_norms, k_codec.rotation, k_codec.centroids,
                                                flat_slots, 4)
    v_codes, v_norms = reference.write_cache_pool(v.reshape(-1, num_kv_heads, head_dim), v_codes,
                                                v_norms, v_codec.rotation, v_codec.centroids,
                                                flat_slots, 3)
    k_hat = reference.decompress(*reference.compress(k, k_codec.rotation, k_codec.centroids, 4),
                                 k_codec.rotation, k_codec.centroids, 4)
    v_hat = reference.decompress(*reference.compress(v, v_codec.rotation, v_codec.centroids, 3),
                                 v_codec.rotation, v_codec.centroids, 3)
    q = rng.standard_normal((3, num_heads, head_dim)).astype(np.float32)
    scale = head_dim ** -0.5
    out = reference.paged_decode(q, k_codes, k_norms, v_codes, v_norms, k_codec.rotation,
                                 v_codec.rotation, k_codec.centroids, v_codec.centroids,
                                 block_tables, seq_lens, 4, 3, scale)
    expected = reference.attention_dense(q, k_hat, v_hat, seq_lens, scale)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=2e-5)
    assert np.all(np.asarray(out)[1] == 0.0)
    exact = reference.attention_dense(q, k, v, seq_lens, scale)
    error = np.linalg.norm(np.asarray(out) - exact) / np.linalg.norm(exact)
    assert error < 0.35  # close to uncompressed attention (3-bit V: ~0.2 on random data)


def test_attention_dense_matches_numpy():
    rng = np.random.default_rng(66)
    q = rng.standard_normal((2, 4, 64))
    k = rng.standard_normal((2, 5, 2, 64))
    v = rng.standard_normal((2, 5, 2, 64))
    seq_lens = np.array([3, 5], np.int32)
    out = np.asarray(reference.attention_dense(q.astype(np.float32), k.astype(np.float32),
                                               v.astype(np.float32), seq_lens, 0.125))
    for seq in range(2):
        for head in range(4):
            kv_head = head // 2
            scores = 0.125 * k[seq, :seq_lens[seq], kv_head] @ q[seq, head]
            weights = np.exp(scores - scores.max())
            expected = weights / weights.sum() @ v[seq, :seq_lens[seq], kv_head]
            np.testing.assert_allclose(out[seq, head], expected, rtol=1e-4, atol=1e-5)


def test_paged_decode_errors():
    rng = np.random.default_rng(1)
    args = list(random_paged_case(rng))
    bad = list(args)
    bad[0] = args[0][:, :5]  # 5 heads, Hkv = 2
    with pytest.raises(ValueError, match="multiple"):
        reference.paged_decode_rotated(*bad)
    bad = list(args)
    bad[7] = args[7].astype(np.float32)
    with pytest.raises(TypeError, match="block_tables"):
        reference.paged_decode_rotated(*bad)
    bad = list(args)
    bad[5] = args[5][:8]
    with pytest.raises(ValueError, match="k_centroids"):
        reference.paged_decode_rotated(*bad)
    bad = list(args)
    bad[8] = args[8][:3]
    with pytest.raises(ValueError, match="seq_lens"):
        reference.paged_decode_rotated(*bad)
    bad = list(args)
    bad[9] = 5
    with pytest.raises(ValueError, match="bits"):
        reference.paged_decode_rotated(*bad)
