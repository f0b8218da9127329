"""TurboQuant_prod (QJL): compress and scores through the FFI kernels (the CPU's; on the GPU the scores
kernel, and XLA's code of qjl_compress's reference, which has no CUDA kernel) against the float64 oracle,
the estimator's bias and variance, the worked example, vmap, errors."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tq as tq
from jax_tq import _compat, reference
from jax_tq.format import unpack_codes, unpack_signs
from jax_tq.qjl import qjl_compress_p, qjl_scores_p
from conftest import kernel_backend, slow_unless
from oracle import primitive_count, rel_err

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


TARGETS = ("jax_tq_qjl_compress", "jax_tq_qjl_scores")


@pytest.fixture(autouse=True)
def ffi_backend(request):
    """Backend "ffi" on the CPU, "auto" on the GPU; a gpu-marked scores test is skipped where the CUDA
    module has no scores kernel."""
    no_kernel = request.function is test_gpu_compress_matches_oracle
    with kernel_backend(request, TARGETS, gpu_targets=() if no_kernel else ("jax_tq_qjl_scores",)):
        yield


def _f64(a):
    return np.asarray(a, np.float64)


def qjl_compress_f64(x, codec):
    """The float64 oracle's (codes, norms, signs, gamma, rotated y, sketched residual S r)."""
    mse = codec.mse
    x = _f64(x).reshape(-1, codec.head_dim)
    with _compat.enable_x64():
        out = reference.qjl_compress(jnp.asarray(x), jnp.asarray(_f64(mse.rotation)), jnp.asarray(_f64(mse.centroids)),
                                     jnp.asarray(_f64(codec.sketch)), mse.bits)
        out = [np.asarray(a) for a in out]
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    y = x / np.where(norms > 0, norms, 1.0) @ _f64(mse.rotation).T
    residual = y - _f64(mse.centroids)[unpack_codes(out[0], mse.bits, codec.head_dim)]
    return (*out, y, residual @ _f64(codec.sketch).T)


def qjl_scores_f64(q, keys, codec):
    """float64 oracle scores: q [B, Q, d] and keys [B, S] -> [B, Q, S]."""
    mse = codec.mse
    q_rot = _f64(q) @ _f64(mse.rotation).T
    q_sketch = q_rot @ _f64(codec.sketch).T
    with _compat.enable_x64():
        return np.asarray(reference.qjl_scores_rotated(
            jnp.asarray(q_rot), jnp.asarray(q_sketch), keys.codes, jnp.asarray(_f64(keys.norms)), keys.signs,
            jnp.asarray(_f64(keys.gamma)), jnp.asarray(_f64(mse.centroids)), mse.bits, codec.qjl_scale))


def random_keys(rng, codec, shape):
    """QJLCodes of random codes / signs bytes and positive random norms / gamma (no zeros)."""
    def bytes_(n):
        return jnp.asarray(rng.integers(0, 256, size=shape + (n,), dtype=np.uint8))
    def positive():
        return jnp.asarray(rng.uniform(0.5, 2.0, size=shape).astype(np.float32))
    return tq.QJLCodes(bytes_(codec.packed_bytes), positive(), bytes_(codec.sign_bytes), positive() * 0.2)


def assert_compress_matches_oracle(got, x, codec, tie_tol=1e-4):
    """Codes and signs as the float64 oracle's except within tie_tol of a boundary / of 0; norms and
    gamma to float32 accuracy."""
    codes, norms, signs, gamma, y, sketched = qjl_compress_f64(x, codec)
    d, bits = codec.head_dim, codec.mse.bits
    got_codes = unpack_codes(np.asarray(got.codes).reshape(codes.shape), bits, d).astype(int)
    want_codes = unpack_codes(codes, bits, d).astype(int)
    differ = got_codes != want_codes
    boundaries = (_f64(codec.mse.centroids)[1:] + _f64(codec.mse.centroids)[:-1]) / 2
    gap = np.abs(y[differ] - boundaries[np.minimum(got_codes, want_codes)[differ]])
    assert np.all(np.abs(got_codes - want_codes) <= 1) and np.all(gap <= tie_tol), "a code differs away from a tie"
    same_codes = ~differ.any(axis=1)  # a code at a tie moves the residual: compare those vectors' signs only
    got_signs = unpack_signs(np.asarray(got.signs).reshape(signs.shape), d)[same_codes]
    want_signs = unpack_signs(signs, d)[same_codes]
    scale = np.linalg.norm(sketched[same_codes], axis=1, keepdims=True) / np.sqrt(d)
    flips = (got_signs != want_signs) & (np.abs(sketched[same_codes]) > tie_tol * np.maximum(scale, 1e-30))
    assert not flips.any(), f"{int(flips.sum())} sign bits differ away from 0"
    assert rel_err(np.asarray(got.norms).reshape(-1), norms) < 1e-6
    assert np.max(np.abs(np.asarray(got.gamma).reshape(-1) - gamma)[same_codes], initial=0.0) < 1e-5


# ----------------------------------------------------------------------------- the estimator

def test_worked_example_of_turboquant_md():
    """TURBOQUANT.md: q = [1, 2], Pi = I, S = [[1, 1], [1, -1]], codebook [-.75, -.25, .25, .75]."""
    q = jnp.asarray([[1.0, 2.0]])
    sketch = jnp.asarray([[1.0, 1.0], [1.0, -1.0]])
    values = jnp.asarray([[-0.75, -0.25], [0.25, 0.75]])          # indices [0, 1] and [2, 3]
    signs = jnp.asarray([[1.0, 1.0], [1.0, -1.0]])
    got = reference.qjl_estimate(q, q @ sketch.T, values, signs, jnp.ones(2), jnp.asarray([0.2, 0.4]),
                                 np.sqrt(np.pi / 2) / 2)
    np.testing.assert_allclose(np.asarray(got), [[-0.999337, 2.752651]], atol=1e-6)


@pytest.mark.parametrize("bits", [3, 4, 5])
def test_estimator_is_unbiased_and_its_variance_is_the_papers(rng, bits):
    """With q correlated with k (q = k + noise) the mse-only estimate shrinks by ~D_mse(bits-1), while
    TurboQuant_prod's is unbiased, with variance (pi/2) D_mse(bits-1) / d ||q||^2 ||k||^2."""
    d, n = 128, 8192
    codec = tq.TurboQuantProd(d, bits, seed=int(rng.integers(1 << 16)))
    k = rng.normal(size=(n, d))
    q = k + 0.5 * rng.normal(size=(n, d))
    true = np.sum(q * k, axis=1)
    keys = tq.qjl_compress(jnp.asarray(k, jnp.float32)[:, None], codec)       # [n, 1] keys
    est = np.asarray(tq.qjl_scores(jnp.asarray(q, jnp.float32)[:, None], keys, codec))[:, 0, 0]
    k_mse = np.asarray(tq.decompress(*tq.compress(jnp.asarray(k, jnp.float32), codec.mse), codec.mse), np.float64)
    mse_bias = np.mean(np.sum(q * k_mse, axis=1) - true) / np.mean(true)
    prod_bias = np.mean(est - true) / np.mean(true)
    d_mse = {2: 0.11600, 3: 0.03397, 4: 0.00932}[bits - 1]  # exact-Beta D_mse at d = 128 (TURBOQUANT.md)
    assert -1.3 * d_mse < mse_bias < -0.7 * d_mse
    assert abs(prod_bias) < 0.15 * d_mse
    predicted_var = np.mean(np.pi / 2 * d_mse / d * np.sum(q * q, axis=1) * np.sum(k * k, axis=1))
    assert 0.7 < np.var(est - true) / predicted_var < 1.3


# ----------------------------------------------------------------------------- compress

@pytest.mark.parametrize("head_dim,bits,dtype", [(64, 3, jnp.float32), (80, 4, jnp.bfloat16), (96, 5, jnp.float16),
                                                 (128, 4, jnp.float32), (192, 3, jnp.bfloat16), (256, 5, jnp.float32)])
def test_compress_matches_float64_oracle(rng, head_dim, bits, dtype):
    codec = tq.TurboQuantProd(head_dim, bits, seed=int(rng.integers(1 << 16)), rotation=("haar", "hadamard")[bits % 2])
    x = jnp.asarray(rng.normal(size=(3, 23, head_dim)) * rng.uniform(0.1, 10, size=(3, 23, 1)), dtype)
    got = jax.jit(tq.qjl_compress, static_argnums=1)(x, codec)
    assert got.codes.shape == (3, 23, codec.packed_bytes) and got.signs.shape == (3, 23, head_dim // 8)
    assert got.norms.shape == got.gamma.shape == (3, 23)
    assert_compress_matches_oracle(got, x, codec)
    codes, norms = tq.compress(x, codec.mse)  # the mse half is TurboQuant_mse's
    np.testing.assert_array_equal(np.asarray(got.codes), np.asarray(codes))
    if jax.default_backend() == "cpu":  # one code path: the same float32 sums
        np.testing.assert_array_equal(np.asarray(got.norms), np.asarray(norms))
    else:  # on the GPU the compress kernel and XLA's code of qjl_compress sum in different orders
        np.testing.assert_allclose(np.asarray(got.norms), np.asarray(norms), rtol=4e-7)


def test_compress_zero_vector_and_backends_agree(rng):
    """A zero vector and one of norm below MIN_NORM = 2^-64 (docs/FORMAT.md: stored as zero; its
    entries normal floats): norm 0, the codes of y = 0, a finite gamma, scores 0, on every backend."""
    codec = tq.TurboQuantProd(128, 4)
    x = jnp.asarray(rng.normal(size=(6, 128)), jnp.float32).at[2].set(0.0).at[4].set(-4e-21)
    got = tq.qjl_compress(x, codec)
    assert np.all(np.asarray(got.norms)[[2, 4]] == 0.0) and np.all(np.isfinite(np.asarray(got.gamma)))
    np.testing.assert_array_equal(np.asarray(got.codes)[4], np.asarray(got.codes)[2])
    with tq.use_backend("xla"):
        want = tq.qjl_compress(x, codec)
    assert np.all(np.asarray(want.norms)[[2, 4]] == 0.0)
    assert_compress_matches_oracle(want, x.at[4].set(0.0), codec)
    np.testing.assert_allclose(np.asarray(got.gamma), np.asarray(want.gamma), atol=1e-5)
    q = jnp.asarray(rng.normal(size=(3, 128)), jnp.float32)
    assert np.all(np.asarray(tq.qjl_scores(q, got, codec))[:, [2, 4]] == 0.0)


# ----------------------------------------------------------------------------- scores

@pytest.mark.parametrize("head_dim,bits,dtype,lead,num_queries,num_keys", slow_unless([
    (64, 3, jnp.float32, (), 5, 37), (80, 4, jnp.bfloat16, (2,), 3, 130), (96, 5, jnp.float16, (2, 3), 9, 17),
    (128, 4, jnp.float32, (4,), 32, 300), (192, 3, jnp.float32, (1,), 1, 8), (256, 5, jnp.bfloat16, (), 8, 129)],
    lambda head_dim, *_: head_dim in (64, 96)))
def test_scores_match_float64_oracle(rng, head_dim, bits, dtype, lead, num_queries, num_keys):
    codec = tq.TurboQuantProd(head_dim, bits, seed=int(rng.integers(1 << 16)))
    q = jnp.asarray(rng.normal(size=lead + (num_queries, head_dim)), dtype)
    keys = random_keys(rng, codec, lead + (num_keys,))
    got = jax.jit(tq.qjl_scores, static_argnums=2)(q, keys, codec)
    assert got.shape == lead + (num_queries, num_keys) and got.dtype == jnp.float32
    b = int(np.prod(lead))
    want = qjl_scores_f64(np.asarray(q.astype(jnp.float32)).reshape(b, num_queries, head_dim),
                          tq.QJLCodes(*(a.reshape((b,) + a.shape[len(lead):]) for a in keys)), codec)
    assert rel_err(np.asarray(got).reshape(want.shape), want) < 1e-5
    with tq.use_backend("xla"):
        assert rel_err(tq.qjl_scores(q, keys, codec), np.asarray(got)) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("head_dim,bits,dtype", [(64, 3, jnp.float32), (128, 4, jnp.bfloat16), (96, 5, jnp.float32)])
def test_decompress_inner_products_are_the_scores(rng, head_dim, bits, dtype):
    codec = tq.TurboQuantProd(head_dim, bits, seed=int(rng.integers(1 << 16)))
    keys = tq.qjl_compress(jnp.asarray(rng.normal(size=(2, 50, head_dim)), jnp.float32), codec)
    q = jnp.asarray(rng.normal(size=(2, 7, head_dim)), jnp.float32)
    x_hat = tq.qjl_decompress(keys, codec, dtype)
    assert x_hat.shape == (2, 50, head_dim) and x_hat.dtype == dtype
    got = np.einsum("bqd,bsd->bqs", _f64(q), _f64(x_hat))
    want = qjl_scores_f64(np.asarray(q), keys, codec)
    assert rel_err(got, want) < (1e-5 if dtype == jnp.float32 else 1e-2)
    with pytest.raises(TypeError, match="dtype"):
        tq.qjl_decompress(keys, codec, jnp.int32)


def test_vmap_over_queries_reads_the_keys_once(rng):
    codec = tq.TurboQuantProd(64, 4)
    keys = random_keys(rng, codec, (2, 40))
    q = jnp.asarray(rng.normal(size=(3, 2, 5, 64)), jnp.float32)
    fn = jax.vmap(tq.qjl_scores, in_axes=(0, None, None))
    jaxpr = jax.make_jaxpr(lambda q, k: fn(q, k, codec))(q, keys).jaxpr
    assert primitive_count(jaxpr, qjl_scores_p) == 1
    got = fn(q, keys, codec)
    for v in range(3):
        want = qjl_scores_f64(np.asarray(q[v]), keys, codec)
        assert rel_err(got[v], want) < 1e-5


def test_vmap_over_keys_and_compress(rng):
    codec = tq.TurboQuantProd(64, 3)
    x = jnp.asarray(rng.normal(size=(4, 2, 30, 64)), jnp.float32)
    q = jnp.asarray(rng.normal(size=(2, 6, 64)), jnp.float32)
    compress = jax.vmap(tq.qjl_compress, in_axes=(1, None), out_axes=1)
    keys = compress(x, codec)
    jaxpr = jax.make_jaxpr(lambda x: compress(x, codec))(x).jaxpr
    assert primitive_count(jaxpr, qjl_compress_p) == 1
    np.testing.assert_array_equal(np.asarray(keys.codes), np.asarray(tq.qjl_compress(x, codec).codes))
    scores = jax.vmap(tq.qjl_scores, in_axes=(None, 0, None))(q, keys, codec)      # [4, 2, 6, 30]
    for i in range(4):
        want = qjl_scores_f64(np.asarray(q), tq.QJLCodes(*(a[i] for a in keys)), codec)
        assert rel_err(scores[i], want) < 1e-5


@pytest.mark.slow
def test_derivatives_are_the_references_on_every_backend(rng):
    codec = tq.TurboQuantProd(64, 4)
    x = jnp.asarray(rng.normal(size=(2, 20, 64)), jnp.float32)
    q = jnp.asarray(rng.normal(size=(2, 5, 64)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(2, 5, 20)), jnp.float32)

    def loss(q, x):
        keys = tq.qjl_compress(x, codec)
        return jnp.sum(w * tq.qjl_scores(q, keys, codec))

    dq, dx = jax.jit(jax.grad(loss, argnums=(0, 1)))(q, x)
    _, tangent = jax.jvp(loss, (q, x), (w[..., :1] * q, x))
    with tq.use_backend("xla"):
        want_dq, want_dx = jax.grad(loss, argnums=(0, 1))(q, x)
        _, want_tangent = jax.jvp(loss, (q, x), (w[..., :1] * q, x))
    assert rel_err(dq, want_dq) < 1e-5 and rel_err(dx, want_dx) < 1e-4
    assert abs(float(tangent - want_tangent)) < 1e-4 * max(1.0, abs(float(want_tangent)))
    assert float(jnp.abs(dx).max()) > 0
    keys = tq.qjl_compress(x, codec)  # scores are linear in q: the gradient is the reconstruction
    dq_one = jax.grad(lambda q: jnp.sum(tq.qjl_scores(q, keys, codec)[0, 0, 3]))(q)
    assert rel_err(dq_one[0, 0], tq.qjl_decompress(keys, codec)[0, 3]) < 1e-5


# ----------------------------------------------------------------------------- errors

def test_bad_inputs_raise_clear_errors(rng):
    codec = tq.TurboQuantProd(64, 4)
    keys = random_keys(rng, codec, (2, 10))
    q = jnp.zeros((2, 3, 64), jnp.float32)
    for bits in (2, 6):
        with pytest.raises(ValueError, match="TurboQuantProd: bits must be one of"):
            tq.TurboQuantProd(64, bits)
    with pytest.raises(ValueError, match=r"^jax_tq.TurboQuantProd: head_dim must be one of"):
        tq.TurboQuantProd(63, 4)
    with pytest.raises(ValueError, match=r"^jax_tq.TurboQuant: seed must be >= 0, got -1"):  # the class named
        tq.TurboQuant(64, 4, seed=-1)
    with pytest.raises(TypeError, match="TurboQuantProd"):
        tq.qjl_scores(q, keys, tq.TurboQuant(64, 3))
    with pytest.raises(TypeError, match="TurboQuantProd"):
        tq.qjl_compress(q, codec.mse)
    with pytest.raises(ValueError, match="head_dim 64"):
        tq.qjl_scores(jnp.zeros((2, 3, 128)), keys, codec)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        tq.qjl_compress(jnp.zeros((4, 64), jnp.int32), codec)
    with pytest.raises(TypeError, match="keys.norms must be float32"):
        tq.qjl_scores(q, keys._replace(norms=keys.norms.astype(jnp.float16)), codec)
    with pytest.raises(ValueError, match=r"keys.signs has shape \(2, 10, 4\), expected \(2, 10, 8\)"):
        tq.qjl_scores(q, keys._replace(signs=keys.signs[..., :4]), codec)
    with pytest.raises(ValueError, match="leading axes"):
        tq.qjl_scores(q[:1], keys, codec)
    with pytest.raises(TypeError, match="QJLCodes"):
        tq.qjl_scores(q, keys.codes, codec)
    q_random = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    np.testing.assert_array_equal(np.asarray(tq.qjl_scores(q_random, list(keys), codec)),
                                  np.asarray(tq.qjl_scores(q_random, keys, codec)))
    with pytest.raises(TypeError, match="qjl_decompress: dtype must be float32, bfloat16 or float16, got None"):
        tq.qjl_decompress(keys, codec, None)   # jnp.dtype(None) is float64: the message said float64
    for bad, shown in (("foo", "'foo'"), (3, "3"), (jnp.int8, "int8")):  # were NumPy's own errors
        with pytest.raises(TypeError, match=f"qjl_decompress: dtype must be float32, bfloat16 or float16, got {shown}"):
            tq.qjl_decompress(keys, codec, bad)
    with pytest.raises(TypeError, match="qjl_scores: q must be an array, got NoneType"):
        tq.qjl_scores(None, keys, codec)
    with pytest.raises(TypeError, match="qjl_scores: keys.gamma must be an array, got str"):
        tq.qjl_scores(q, keys._replace(gamma="gamma"), codec)
    with pytest.raises(TypeError, match="qjl_compress: x must be an array, got TurboQuantProd"):
        tq.qjl_compress(codec, codec)
    with pytest.raises(AttributeError, match="immutable"):
        codec.bits = 3


# ----------------------------------------------------------------------------- CUDA (marked gpu: skipped
# without one, conftest.py); backend "auto" (the autouse fixture) runs the scores kernel

def _poison_gpu(nbytes: int) -> None:
    buf = jnp.full((max(1, nbytes // 4),), jnp.nan, jnp.float32)
    buf.block_until_ready()
    del buf


@pytest.mark.parametrize("head_dim,bits,dtype", [(d, b, DTYPES[(i + b) % 3]) for i, d in enumerate((64, 80, 96, 128, 192, 256))
                                                 for b in (3, 4, 5)])
@pytest.mark.parametrize("n", [13, 1000])
@pytest.mark.gpu
def test_gpu_compress_matches_oracle(rng, head_dim, bits, dtype, n):
    """qjl_compress has no CUDA kernel: XLA's code of its reference on the GPU against the float64 oracle."""
    codec = tq.TurboQuantProd(head_dim, bits, seed=int(rng.integers(1 << 16)))
    x = jnp.asarray(rng.normal(size=(n, head_dim)) * rng.uniform(0.01, 100, size=(n, 1)), dtype).at[3].set(0.0)
    _poison_gpu(n * head_dim * 8)
    got = jax.jit(tq.qjl_compress, static_argnums=1)(x, codec)
    assert np.all(np.isfinite(np.asarray(got.norms))) and np.all(np.isfinite(np.asarray(got.gamma)))
    assert_compress_matches_oracle(got, x, codec, tie_tol=1e-4)


@pytest.mark.parametrize("head_dim,bits,num_queries,num_keys", [(64, 3, 1, 1), (80, 4, 7, 129), (96, 5, 9, 300),
                                                                (128, 4, 32, 4099), (192, 3, 8, 128), (256, 5, 17, 257)])
@pytest.mark.gpu
def test_gpu_scores_match_oracle(rng, head_dim, bits, num_queries, num_keys):
    codec = tq.TurboQuantProd(head_dim, bits, seed=int(rng.integers(1 << 16)))
    q = jnp.asarray(rng.normal(size=(3, num_queries, head_dim)), jnp.bfloat16)
    keys = random_keys(rng, codec, (3, num_keys))
    _poison_gpu(3 * num_queries * num_keys * 4 * 2)
    got = jax.jit(tq.qjl_scores, static_argnums=2)(q, keys, codec)
    assert np.all(np.isfinite(np.asarray(got))), "an output element was not written"
    want = qjl_scores_f64(np.asarray(q.astype(jnp.float32)), keys, codec)
    assert rel_err(got, want) < 1e-5
    vmapped = jax.vmap(tq.qjl_scores, in_axes=(0, None, None))(jnp.stack([q, -q]), keys, codec)
    assert rel_err(vmapped[1], -want) < 1e-5


@pytest.mark.gpu
def test_gpu_scores_more_batch_entries_than_grid_y(rng):
    """70000 batch entries: more than a grid's y extent (65535); the kernel strides over them."""
    codec = tq.TurboQuantProd(64, 4)
    q = jnp.asarray(rng.normal(size=(70000, 1, 64)), jnp.float32)
    keys = random_keys(rng, codec, (70000, 3))
    _poison_gpu(70000 * 3 * 4 * 2)
    got = tq.qjl_scores(q, keys, codec)
    assert np.all(np.isfinite(np.asarray(got)))
    assert rel_err(got, qjl_scores_f64(np.asarray(q), keys, codec)) < 1e-5
