"""jax_tq_merge_attention (the dense prefill's merge of two attentions, in place) through the CPU
handler ("ffi"), XLA's code of the reference ("xla") and, where marked gpu, the CUDA kernel: against
a float64 oracle on fresh random rows, with the rows the op must not read poisoned with NaN."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tq as tq
from jax_tq import _compat
from jax_tq.merge_attention import merge_attention

#: relative error of one rounding to each dtype, doubled (float32 sum, then the dtype's rounding)
TOLERANCE = {jnp.float32: 2 ** -22, jnp.bfloat16: 2 ** -7, jnp.float16: 2 ** -10, jnp.float64: 2 ** -50}


def _case(rng, num_rows, num_heads, head_dim, dtype):
    """Operands covering every kind of row, poisoned where the op must not read, and the float64
    oracle of the result."""
    shape = (num_rows, num_heads, head_dim)
    out = rng.normal(size=shape) * rng.uniform(0.1, 10, size=shape[:2] + (1,))
    other = rng.normal(size=shape)
    q = rng.normal(size=shape)
    kind = rng.integers(0, 6, size=shape[:2])   # 0 (1, 0)  1 (0, 0)  2 (0, w)  3 (w, 0)  4 (w, w')  5 NaN
    w = rng.uniform(0.01, 1, size=shape[:2] + (2,))
    w[kind == 0] = (1, 0)
    w[kind == 1] = 0
    w[kind == 2, 0] = 0
    w[kind == 3, 1] = 0
    w[kind == 5] = np.nan
    out[w[..., 0] == 0] = np.nan                  # unread: a zero weight's term is 0
    other[w[..., 1] == 0] = np.nan
    out[(kind == 0) & (rng.random(shape[:2]) < 0.2)] = np.inf   # a (1, 0) row is left as it is
    check = rng.random(shape[:2]) < 0.3
    bad = rng.random(shape[:2]) < 0.5
    for (t, h) in zip(*np.nonzero(bad)):
        q[t, h, rng.integers(head_dim)] = rng.choice([np.nan, np.inf, -np.inf])
    operands = (jnp.asarray(out, dtype), jnp.asarray(other, dtype), jnp.asarray(w, jnp.float32), jnp.asarray(q, dtype),
                jnp.asarray(check))
    out, other, w, q = (np.asarray(x, np.float64) for x in operands[:4])   # as the op sees them
    with np.errstate(invalid="ignore"):
        terms = np.where(w[..., :1] != 0, w[..., :1] * out, 0), np.where(w[..., 1:] != 0, w[..., 1:] * other, 0)
    want = terms[0] + terms[1]
    want[kind == 0] = out[kind == 0]
    want[check & ~np.isfinite(q).all(-1)] = np.nan
    return operands, (want, np.abs(terms[0]) + np.abs(terms[1]))


def _assert_matches(got, oracle, dtype):
    """NaN and infinities where the oracle has them; elsewhere within the dtype's rounding of the
    terms' magnitude (the float32 sum of two products may cancel) and its subnormal spacing."""
    want, magnitude = oracle
    got = np.asarray(got, np.float64)
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(np.isinf(got), np.isinf(want))
    finite = np.isfinite(want)
    assert np.array_equal(got[~finite & ~np.isnan(want)], want[~finite & ~np.isnan(want)])
    bound = TOLERANCE[dtype] * magnitude[finite] + float(jnp.finfo(dtype).smallest_subnormal)   # subnormal results
    excess = np.abs(got[finite] - want[finite]) - bound
    assert excess.max() <= 0, excess.max()
    assert np.any(got[finite] != 0)


@pytest.mark.parametrize("backend", ["ffi", "xla"])
@pytest.mark.parametrize("head_dim,dtype", [(64, jnp.bfloat16), (128, jnp.float32), (80, jnp.float16),
                                            (256, jnp.bfloat16)])
def test_merge_matches_the_float64_oracle(rng, backend, head_dim, dtype):
    operands, want = _case(rng, 37, 6, head_dim, dtype)
    with tq.use_backend(backend):   # a fresh jit per backend: a jitted function's cache ignores the backend
        got = jax.jit(lambda *a: merge_attention(*a))(*operands)
    assert got.dtype == dtype
    _assert_matches(got, want, dtype)


def test_merge_under_vmap_is_one_call_over_the_folded_rows(rng):
    cases = [_case(rng, 9, 4, 64, jnp.bfloat16) for _ in range(3)]
    stacked = [jnp.stack(xs) for xs in zip(*(c[0] for c in cases))]
    with tq.use_backend("ffi"):
        jaxpr = jax.make_jaxpr(jax.vmap(merge_attention))(*stacked)
        got = jax.vmap(merge_attention)(*stacked)
    assert str(jaxpr).count("jax_tq_merge_attention") == 1
    for g, (_, want) in zip(got, cases):
        _assert_matches(g, want, jnp.bfloat16)


def test_float64_rows_merge_through_the_reference_in_float64(rng):
    with _compat.enable_x64():
        operands, (want, magnitude) = _case(rng, 5, 2, 64, jnp.float64)
        weights = operands[2].astype(jnp.float64) * (1 + 1e-12)   # not representable in float32
        got = merge_attention(*operands[:2], weights, *operands[3:])
        assert got.dtype == jnp.float64
        _assert_matches(got, (want * (1 + 1e-12), magnitude), jnp.float64)


@pytest.mark.parametrize("backend", ["ffi", "xla"])
def test_bad_operands_raise_on_every_backend(backend):
    out = jnp.zeros((4, 2, 64), jnp.bfloat16)
    w, check = jnp.zeros((4, 2, 2), jnp.float32), jnp.zeros((4, 2), bool)
    with tq.use_backend(backend), pytest.raises(TypeError, match="weights"):
        merge_attention(out, out, w[:1], out, check)
    with tq.use_backend(backend), pytest.raises(TypeError, match="q must be"):
        merge_attention(out, out, w, out.astype(jnp.float32), check)


def test_bad_operands_raise_naming_them():
    out = jnp.zeros((4, 2, 64), jnp.bfloat16)
    w, check = jnp.zeros((4, 2, 2), jnp.float32), jnp.zeros((4, 2), bool)
    with pytest.raises(TypeError, match="other"):
        merge_attention(out, out.astype(jnp.float32), w, out, check)
    with pytest.raises(TypeError, match="q must be"):
        merge_attention(out, out, w, out[:3], check)
    with pytest.raises(TypeError, match="weights"):
        merge_attention(out, out, w[..., :1], out, check)
    with pytest.raises(TypeError, match="weights must be float32"):   # the kernels read float32 weights
        merge_attention(out, out, w.astype(jnp.bfloat16), out, check)
    with pytest.raises(TypeError, match="check"):
        merge_attention(out, out, w, out, check.astype(jnp.int32))
    with pytest.raises(TypeError, match="out must be"):
        merge_attention(out.astype(jnp.int32), out, w, out, check)
    odd = jnp.zeros((4, 2, 63), jnp.bfloat16)
    with pytest.raises(ValueError, match="head_dim"):
        merge_attention(odd, odd, w, odd, check)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,dtype", [(128, jnp.bfloat16), (64, jnp.float16), (96, jnp.float32)])
def test_gpu_merge_matches_the_float64_oracle(rng, head_dim, dtype):
    """The CUDA kernel, over more rows than one wave of CTAs."""
    operands, want = _case(rng, 3001, 8, head_dim, dtype)
    with tq.use_backend("ffi"):
        got = jax.jit(merge_attention)(*operands)
    _assert_matches(got, want, dtype)
