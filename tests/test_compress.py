"""compress / decompress: the kernels (CPU here, CUDA on a GPU machine) against the float64 oracle:
every head_dim x bits x dtype, zero, huge and non-finite inputs, vmap, gradients; marked gpu, the
CUDA kernels' tile shapes against float64 and the CPU kernels."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tq as tq
from jax_tq.format import MIN_NORM, unpack_codes

from conftest import poison_device_memory, slow_unless
from oracle import codes_agree, compress_f64, decompress_f64, jaxpr_count, on_cpu, rel_err

pytestmark = pytest.mark.backend("ffi")


HEAD_DIMS = (64, 80, 96, 128, 192, 256)


@pytest.mark.parametrize("head_dim", slow_unless(HEAD_DIMS, lambda d: d in (64, 128)))
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


@pytest.mark.parametrize("head_dim", slow_unless(HEAD_DIMS, lambda d: d in (64, 128)))
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


# ------------------------------------------------------------------------------------ extreme inputs


@pytest.mark.parametrize("dtype,scale", [(jnp.float16, 6e4), (jnp.bfloat16, 1e5)])
def test_compress_norms_beyond_input_dtype_range(rng, dtype, scale):
    """Vectors near fp16's max have norms beyond fp16's range: the fp32 norm must still be exact."""
    codec = tq.TurboQuant(head_dim=96, bits=3, seed=2)
    x = jnp.asarray(rng.uniform(0.5, 1.0, size=(6, 96)) * rng.choice([-1.0, 1.0], size=(6, 96)) * scale, dtype)
    x = x.at[2].set(0)
    codes, norms = tq.compress(x, codec)
    want_codes, want_norms = compress_f64(np.asarray(x, np.float64), codec)
    assert norms.dtype == jnp.float32 and np.isfinite(np.asarray(norms)).all()
    np.testing.assert_allclose(np.asarray(norms), want_norms, rtol=2e-6)
    assert float(norms[2]) == 0.0
    got_idx = unpack_codes(np.asarray(codes), 3, 96).astype(int)
    want_idx = unpack_codes(want_codes, 3, 96).astype(int)
    assert np.mean(got_idx == want_idx) > 0.99 and np.abs(got_idx - want_idx).max() <= 1
    x_hat = np.asarray(tq.decompress(codes, norms, codec, jnp.float32))
    assert np.all(x_hat[2] == 0.0)
    assert rel_err(x_hat, decompress_f64(np.asarray(codes), np.asarray(norms), codec)) < 1e-6
    assert rel_err(x_hat, np.asarray(x, np.float64)) < 0.25  # 3-bit quantization error only


@pytest.mark.parametrize("value", [1e30, 1e-18, 6e-21])
def test_compress_norms_neither_overflow_nor_underflow(value):
    codec = tq.TurboQuant(128, 4)
    x = jnp.full((3, 128), value, jnp.float32).at[1].multiply(-2.0)
    expected = np.array([1, 2, 1]) * value * np.sqrt(128.0)
    results = {}
    for backend in ("ffi", "xla"):
        with tq.use_backend(backend):
            codes, norms = tq.compress(x, codec)
        np.testing.assert_allclose(np.asarray(norms, np.float64), expected, rtol=1e-6)
        results[backend] = np.asarray(codes)
    np.testing.assert_array_equal(results["ffi"], results["xla"])


@pytest.mark.parametrize("rotation,scale,head_dim", [("haar", "norm", 128), ("hadamard", "norm", 128), ("haar", "fit", 64),
                                                     ("hadamard", "fit", 64), ("haar", "norm", 256), ("haar", "fit", 256)])
def test_compress_vector_of_norm_below_min_norm_is_stored_as_the_zero_vector(rng, rotation, scale, head_dim):
    """A norm below MIN_NORM = 2^-64 (docs/FORMAT.md) is stored as the zero vector on every backend,
    not NaN, with a derivative of 0: subnormal entries, alone or everywhere, and normal ones whose
    norm is just below it. A norm just above it keeps the codes and the scale of the same direction
    at unit scale, also for a random direction scaled by 2^-62 (its sums of squares take the scaled
    path); a fitted scale to 2e-5, test_fit_scale.py's tolerance (the CUDA fit's float32 sums: 5e-6
    seen at head_dim 64). On the default device: on a GPU the CUDA kernels of each family
    (tensor-core, Hadamard, fitted, head_dim 256)."""
    codec = tq.TurboQuant(head_dim, 4, int(rng.integers(1000)), rotation, scale)
    direction = rng.normal(size=head_dim)
    x = np.zeros((8, head_dim), np.float32)
    x[1, 5] = 1e-39                                                        # one subnormal entry
    x[2, :] = -1e-39                                                       # all subnormal
    x[3, :] = np.where(np.arange(head_dim) % 3, 0.99, -0.99) * MIN_NORM / np.sqrt(head_dim)  # norm 0.99 MIN_NORM
    x[4, 5] = 1.01 * MIN_NORM                                              # a spike just above it
    x[5, 5] = 1.0                                                          # its direction at unit scale
    x[6] = direction * 2.0**-62
    x[7] = direction
    for backend in ("ffi", "xla"):
        with tq.use_backend(backend):
            codes, norms = jax.jit(tq.compress)(jnp.asarray(x), codec)
            _, tangent = jax.jvp(lambda a: tq.compress(a, codec)[1], (jnp.asarray(x),), (jnp.ones(x.shape, jnp.float32),))
        codes, norms = np.asarray(codes), np.asarray(norms)
        assert np.all(norms[:4] == 0.0), (backend, norms)
        assert np.all(np.asarray(tangent)[:4] == 0.0), (backend, tangent)
        assert np.all(codes[1:4] == codes[0]), backend
        np.testing.assert_array_equal(codes[4], codes[5], err_msg=backend)
        np.testing.assert_array_equal(codes[6], codes[7], err_msg=backend)
        rtol = 2e-5 if scale == "fit" else 1e-6
        np.testing.assert_allclose(norms[4], norms[5] * np.float32(1.01 * MIN_NORM), rtol=rtol, err_msg=backend)
        np.testing.assert_allclose(norms[6], norms[7] * 2.0**-62, rtol=rtol, err_msg=backend)


@pytest.mark.parametrize("value", [1e38, 3e38])
def test_compress_norm_beyond_float32_is_inf_in_both_backends(value):
    """||x|| above FLT_MAX is inf on both backends (the reference's x / max|x| used to flush to 0
    on the CPU, giving norm 0); a row of ordinary size next to it is unaffected."""
    codec = tq.TurboQuant(128, 4)
    x = jnp.full((2, 128), value, jnp.float32).at[1].set(0.5)
    for backend in ("ffi", "xla"):
        with tq.use_backend(backend):
            _, norms = tq.compress(x, codec)
        assert np.isposinf(float(norms[0])), backend
        np.testing.assert_allclose(float(norms[1]), 0.5 * np.sqrt(128.0), rtol=1e-6)


def test_compress_nan_vector_gives_nan_norm_in_both_backends():
    codec = tq.TurboQuant(64, 4)
    x = jnp.ones((2, 64), jnp.float32).at[1, 3].set(jnp.nan)
    for backend in ("ffi", "xla"):
        with tq.use_backend(backend):
            _, norms = tq.compress(x, codec)
        assert np.isfinite(float(norms[0])) and np.isnan(float(norms[1])), backend


@pytest.mark.parametrize("norm", [9e37, 3e38 / np.sqrt(2.0)])
def test_compress_finite_norms_near_float32_max_keep_their_codes(rng, norm):
    """A finite norm above ~8.5e37 has a reciprocal below float32's normal range, which XLA's CPU
    threads flush to 0: the CPU kernel stored every code as the zero code. Both backends must
    give the codes of the unit vector (the same as at norm 1), and the norm itself."""
    codec = tq.TurboQuant(128, 4)
    unit = rng.normal(size=(4, 128))
    unit /= np.linalg.norm(unit, axis=-1, keepdims=True)
    for backend in ("ffi", "xla"):
        with tq.use_backend(backend):
            small_codes, _ = tq.compress(jnp.asarray(unit, jnp.float32), codec)
            codes, norms = tq.compress(jnp.asarray(unit * norm, jnp.float32), codec)
        np.testing.assert_allclose(np.asarray(norms, np.float64), norm, rtol=1e-6, err_msg=backend)
        assert np.mean(np.asarray(codes) == np.asarray(small_codes)) > 0.99, backend


@pytest.mark.parametrize("rows", [2, 64, 300])
def test_compress_nan_rows_give_nan_norms_in_batches_of_any_size(rows):
    """XLA's CPU max-reduction drops NaN in larger arrays: the reference's norm used to be 0 for
    a NaN row once a batch had 64 rows."""
    codec = tq.TurboQuant(64, 4)
    x = jnp.ones((rows, 64), jnp.float32).at[1, 3].set(jnp.nan).at[rows - 1].set(jnp.nan)
    for backend in ("ffi", "xla"):
        with tq.use_backend(backend):
            _, norms = tq.compress(x, codec)
        norms = np.asarray(norms)
        assert np.isnan(norms[1]) and np.isnan(norms[rows - 1]), backend
        assert np.all(np.isfinite(np.delete(norms, [1, rows - 1]))), backend


# -------------------------------------------------------------------------------- vmap and gradients


def test_vmap_compress_and_decompress_axis_1(rng):
    from jax_tq.compress import compress_p, decompress_p
    codec = tq.TurboQuant(head_dim=80, bits=3, seed=1)
    x = jnp.asarray(rng.normal(size=(5, 3, 2, 80)), jnp.float32)  # batch on axis 1
    fn = jax.vmap(lambda x: tq.compress(x, codec), in_axes=1, out_axes=1)
    assert jaxpr_count(fn, compress_p, x) == 1
    codes, norms = fn(x)
    assert codes.shape == (5, 3, 2, 30) and norms.shape == (5, 3, 2)
    for b in range(3):
        want_codes, want_norms = tq.compress(x[:, b], codec)
        np.testing.assert_array_equal(np.asarray(codes[:, b]), np.asarray(want_codes))
        np.testing.assert_array_equal(np.asarray(norms[:, b]), np.asarray(want_norms))
    # decompress with codes batched on axis 1 and norms on axis 0, output batch on axis 2.
    dfn = jax.vmap(lambda c, n: tq.decompress(c, n, codec), in_axes=(1, 0), out_axes=2)
    norms_b0 = jnp.moveaxis(norms, 1, 0)
    assert jaxpr_count(dfn, decompress_p, codes, norms_b0) == 1
    x_hat = dfn(codes, norms_b0)
    assert x_hat.shape == (5, 2, 3, 80)
    want = decompress_f64(np.asarray(codes), np.asarray(norms), codec)  # [5, 3, 2, 80]
    assert rel_err(x_hat, np.moveaxis(want, 1, 2)) < 1e-6


def test_vmap_compress_batch_of_size_zero(rng):
    codec = tq.TurboQuant(head_dim=64, bits=4)
    x = jnp.zeros((0, 3, 64), jnp.float32)
    codes, norms = jax.vmap(tq.compress, in_axes=(0, None))(x, codec)
    assert codes.shape == (0, 3, 32) and norms.shape == (0, 3)


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


# ---------------------------------------------------------------------------------------------- CUDA
# Marked gpu (skipped without one, conftest.py): the kernels on the GPU against float64 and the CPU's.


def _gpu():
    return jax.devices()[0]


DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


# every head_dim x bits once, the dtype cycling; all three dtypes at d=128, 4 bits
COMPRESS_CASES = [(d, b, DTYPES[(i + b) % 3]) for i, d in enumerate(HEAD_DIMS) for b in (2, 3, 4)]


COMPRESS_CASES += [(128, 4, dt) for dt in DTYPES if (128, 4, dt) not in COMPRESS_CASES]


@pytest.mark.gpu
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
    codes_agree(codes, want_codes, bits, head_dim, x64, codec)
    cpu_codes, cpu_norms = on_cpu(jax.jit(tq.compress), x, codec)
    np.testing.assert_allclose(np.asarray(norms), np.asarray(cpu_norms), rtol=2e-6)
    codes_agree(codes, cpu_codes, bits, head_dim, x64, codec)
    assert float(norms[0]) == 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,bits", [(128, 4), (80, 3), (256, 2)])
def test_compress_large_batch(rng, head_dim, bits):
    """Large N takes the 64-vectors-per-CTA tile; N not a multiple of it."""
    codec = tq.TurboQuant(head_dim=head_dim, bits=bits, seed=int(rng.integers(1000)))
    n = 20000 + int(rng.integers(1, 63))
    x = jnp.asarray(rng.normal(size=(n, head_dim)), jnp.bfloat16)
    codes, norms = jax.jit(tq.compress)(x, codec)
    want_codes, want_norms = compress_f64(np.asarray(x.astype(jnp.float32), np.float64), codec)
    np.testing.assert_allclose(np.asarray(norms), want_norms, rtol=2e-6)
    codes_agree(codes, want_codes, bits, head_dim, np.asarray(x.astype(jnp.float32), np.float64), codec)
    # Same vectors through the small-batch tile give identical codes (same fp32 operation order).
    small_codes, small_norms = jax.jit(tq.compress)(x[:100], codec)
    np.testing.assert_array_equal(np.asarray(small_codes), np.asarray(codes[:100]))
    np.testing.assert_array_equal(np.asarray(small_norms), np.asarray(norms[:100]))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,bits,dtype", COMPRESS_CASES)
def test_decompress_gpu_vs_reference(rng, head_dim, bits, dtype):
    codec = tq.TurboQuant(head_dim=head_dim, bits=bits, seed=int(rng.integers(1000)))
    n = int(rng.integers(1, 200))
    codes = jnp.asarray(rng.integers(0, 256, size=(n, codec.packed_bytes), dtype=np.uint8))
    norms = jnp.asarray(rng.uniform(0.1, 5, size=(n,)).astype(np.float32))
    poison_device_memory(n * head_dim * 4 * 4)
    got = jax.jit(tq.decompress, static_argnums=(2, 3))(codes, norms, codec, dtype)
    want = decompress_f64(np.asarray(codes), np.asarray(norms), codec)
    assert got.dtype == dtype and got.shape == (n, head_dim)
    tol = {jnp.float32: 1e-6, jnp.bfloat16: 8e-3, jnp.float16: 1e-3}[dtype]
    assert rel_err(got, want) < tol
    cpu = on_cpu(jax.jit(tq.decompress, static_argnums=(2, 3)), codes, norms, codec, dtype)
    assert rel_err(got, cpu) < tol


@pytest.mark.gpu
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
