"""TurboQuant_prod: QJL 1-bit residual compression and unbiased attention scores (functions and
their primitives).

Implements TurboQuant_prod (Zandieh et al., "TurboQuant", arXiv 2504.19874, Algorithm 2): a vector
is stored as TurboQuant_mse at ``bits - 1`` bits plus the QJL sign sketch of its residual (Zandieh
et al., "QJL: 1-Bit Quantized JL Transform for KV Cache Quantization with Zero Overhead",
arXiv 2406.03482), which makes inner products with it unbiased. The storage is
docs/FORMAT.md's (codes and norms as TurboQuant_mse, sign bits LSB-first, gamma fp32).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_tq import _compat, reference
from jax_tq import _primitive_utils as pu
from jax_tq.backend import get_backend
from jax_tq.codec import TurboQuantProd
from jax_tq.checks import as_array
from jax_tq.compress import check_float_input, check_last_dim, decompress, output_dtype
from jax_tq.format import unpack_signs

__all__ = ["QJLCodes", "qjl_compress", "qjl_decompress", "qjl_scores"]

qjl_compress_p = _compat.Primitive("jax_tq_qjl_compress")
qjl_scores_p = _compat.Primitive("jax_tq_qjl_scores")


class QJLCodes(NamedTuple):
    """TurboQuant_prod storage of vectors [...] (a pytree; docs/FORMAT.md).

    Attributes:
      codes: uint8 [..., head_dim * (bits - 1) / 8], the packed TurboQuant_mse codes.
      norms: float32 [...], ||x||.
      signs: uint8 [..., head_dim / 8], QJL sign bits of the sketched residual.
      gamma: float32 [...], the residual's norm ||Pi x / ||x|| - c[codes]|| (unit-sphere scale).
    """

    codes: jax.Array
    norms: jax.Array
    signs: jax.Array
    gamma: jax.Array


def _check_prod_codec(codec, op: str) -> None:
    if not isinstance(codec, TurboQuantProd):
        raise TypeError(f"jax_tq.{op}: codec must be a jax_tq.TurboQuantProd, got {type(codec).__name__}")


# ----------------------------------------------------------------------------- public API

def qjl_compress(x, codec):
    """Compress vectors with TurboQuant_prod (mse codes at bits - 1 + QJL sign bits of the residual).

    Args:
      x: [..., head_dim] float32, bfloat16 or float16.
      codec: :class:`jax_tq.TurboQuantProd` with ``head_dim == x.shape[-1]``.

    Returns:
      :class:`QJLCodes` (codes uint8 [..., head_dim * (bits-1) / 8], norms float32 [...],
      signs uint8 [..., head_dim / 8], gamma float32 [...]). codes and norms are exactly what
      :func:`jax_tq.compress` gives with ``codec.mse``; with y = Pi x / ||x|| and r = y - c[codes],
      gamma = ||r|| and signs[j] = (S r)_j >= 0. A zero vector gets norm 0 (its scores are 0).

    Raises:
      BackendUnavailableError: backend "ffi" where no kernel serves the call (when it is lowered).
      TypeError: x not a float32/bfloat16/float16 array; codec not a TurboQuantProd.
      ValueError: the last axis of x is not codec.head_dim.

    float64 x is cast to float32 where x64 is off (as ``jnp.asarray`` does). A NaN in a vector gives a
    NaN norm (so NaN scores); its gamma, codes and signs are then unspecified.

    Source: TurboQuant (arXiv 2504.19874), Algorithm 2 (Quant_prod), with the sketch applied to the
    rotated residual (S Pi is again an i.i.d. Gaussian matrix). Differentiable in x through norms
    and gamma (the reference's derivatives on every backend); codes and signs get none.
    """
    x = as_array(x, "x", "qjl_compress")
    _check_prod_codec(codec, "qjl_compress")
    check_float_input(x, "x", "qjl_compress")
    check_last_dim(x, codec.head_dim, "x", "qjl_compress")
    lead = x.shape[:-1]
    flat = x.reshape((-1, codec.head_dim))
    mse = codec.mse
    operands = (flat, mse.rotation, mse.centroids, codec.sketch)
    backend = get_backend()
    if backend == "xla":
        outs = reference.qjl_compress(*operands, mse.bits)
    else:
        outs = _compress_kernel(*operands, mse.bits, backend)
    codes, norms, signs, gamma = outs
    return QJLCodes(codes.reshape(lead + (codec.packed_bytes,)), norms.reshape(lead),
                    signs.reshape(lead + (codec.sign_bytes,)), gamma.reshape(lead))


def qjl_scores(q, keys, codec):
    """Unbiased raw attention scores <q, k> of queries against TurboQuant_prod-compressed keys.

    scores[..., i, s] = norms[s] * (<Pi q_i, c[codes_s]> + sqrt(pi/2) / head_dim * gamma[s] *
    <S Pi q_i, signs_s>): no softmax and no 1/sqrt(head_dim) (scale them as the model does).

    Args:
      q: [..., num_queries, head_dim] float32, bfloat16 or float16.
      keys: :class:`QJLCodes` of keys [..., num_keys] from :func:`qjl_compress` with ``codec``
        (the same leading axes ``...`` as q); a plain tuple or list must hold the fields in the
        order (codes, norms, signs, gamma).
      codec: the :class:`jax_tq.TurboQuantProd` of the keys. Keys carry no codec: a codec of
        another seed or rotation gives plausible but wrong scores (another bits or head_dim is
        caught by the packed widths).

    Returns:
      float32 [..., num_queries, num_keys]. E[scores] = q . k over the sketch's randomness; the
      variance is (pi/2) D_mse(bits-1) / head_dim * ||q||^2 ||k||^2 (QJL's (pi/2) / d ||q||^2 ||r||^2
      with E ||r||^2 = D_mse(bits-1) per unit key, arXiv 2504.19874 / 2406.03482).

    Raises:
      BackendUnavailableError: backend "ffi" where no kernel serves the call (when it is lowered).
      TypeError: q not a float32/bfloat16/float16 array, key arrays not arrays or of the wrong dtype,
        codec not a TurboQuantProd.
      ValueError: q's last axis is not codec.head_dim, or the key arrays' shapes do not match each
        other, the codec, or q's leading axes.

    Source: TurboQuant (arXiv 2504.19874), Algorithm 2 (DeQuant_prod) in inner-product form; QJL
    (arXiv 2406.03482), the sign-sketch estimator with scale sqrt(pi/2) / d for N(0, 1) sketches.
    Differentiable in q, keys.norms and keys.gamma on every backend (the reference's derivatives).
    float64 q is cast to float32 where x64 is off.
    """
    q = as_array(q, "q", "qjl_scores")
    _check_prod_codec(codec, "qjl_scores")
    check_float_input(q, "q", "qjl_scores")
    check_last_dim(q, codec.head_dim, "q", "qjl_scores")
    if q.ndim < 2:
        raise ValueError(f"jax_tq.qjl_scores: q must be [..., num_queries, head_dim], got shape {tuple(q.shape)}")
    keys = _check_keys(keys, codec, q.shape[:-2])
    lead, num_queries, num_keys = q.shape[:-2], q.shape[-2], keys.norms.shape[-1]
    batch = int(np.prod(lead, dtype=np.int64))
    mse = codec.mse
    q_flat = q.reshape((batch, num_queries, codec.head_dim)).astype(jnp.float32)
    q_rot = jnp.matmul(q_flat, mse.rotation.T, precision=jax.lax.Precision.HIGHEST)
    q_sketch = jnp.matmul(q_rot, codec.sketch.T, precision=jax.lax.Precision.HIGHEST)
    operands = (q_rot, q_sketch, keys.codes.reshape((batch, num_keys, codec.packed_bytes)),
                keys.norms.reshape((batch, num_keys)), keys.signs.reshape((batch, num_keys, codec.sign_bytes)),
                keys.gamma.reshape((batch, num_keys)), mse.centroids)
    backend = get_backend()
    if backend == "xla":
        scores = reference.qjl_scores_rotated(*operands, mse.bits, codec.qjl_scale)
    else:
        scores = _scores_kernel(*operands, mse.bits, codec.qjl_scale, backend)
    return scores.reshape(lead + (num_queries, num_keys))


# The kernels' derivatives are the reference's: the same on every backend (codes and signs are
# integers and get none; a tie that the kernel and the reference round apart moves gamma's only).
@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5))
def _compress_kernel(x, rotation, centroids, sketch, bits, backend):
    return tuple(qjl_compress_p.bind(x, rotation, centroids, sketch, bits=bits, backend=backend))


@_compress_kernel.defjvp
def _compress_kernel_jvp(bits, backend, primals, tangents):
    outs = _compress_kernel(*primals, bits, backend)
    _, (_, d_norms, _, d_gamma) = jax.jvp(lambda x: reference.qjl_compress(x, *primals[1:], bits), primals[:1],
                                          tangents[:1])
    return outs, (_compat.float0_zeros_like(outs[0]), d_norms, _compat.float0_zeros_like(outs[2]), d_gamma)


@functools.partial(jax.custom_jvp, nondiff_argnums=(7, 8, 9))
def _scores_kernel(q_rot, q_sketch, codes, norms, signs, gamma, centroids, bits, qjl_scale, backend):
    (scores,) = qjl_scores_p.bind(q_rot, q_sketch, codes, norms, signs, gamma, centroids, bits=bits,
                                  qjl_scale=qjl_scale, backend=backend)
    return scores


@_scores_kernel.defjvp
def _scores_kernel_jvp(bits, qjl_scale, backend, primals, tangents):
    q_rot, q_sketch, codes, norms, signs, gamma, centroids = primals

    def estimate(q_rot, q_sketch, norms, gamma):
        return reference.qjl_scores_rotated(q_rot, q_sketch, codes, norms, signs, gamma, centroids, bits, qjl_scale)

    differentiable = (0, 1, 3, 5)
    _, d_scores = jax.jvp(estimate, tuple(primals[i] for i in differentiable),
                          tuple(tangents[i] for i in differentiable))
    return _scores_kernel(*primals, bits, qjl_scale, backend), d_scores


def qjl_decompress(keys, codec, dtype=jnp.float32):
    """Unbiased reconstructions x_hat of TurboQuant_prod-compressed vectors (Algorithm 2, DeQuant_prod).

    x_hat = norm * Pi^T (c[codes] + sqrt(pi/2) / head_dim * gamma * S^T signs), so that <q, x_hat>
    is exactly :func:`qjl_scores`' estimate of <q, x> for every q. The vector itself is noisy
    (its error has variance ~ (pi/2 - 1) gamma^2 per unit norm on top of the mse part): use it where
    only inner products matter, e.g. keys in attention.

    Args:
      keys: :class:`QJLCodes` [...] from :func:`qjl_compress` with ``codec``.
      codec: :class:`jax_tq.TurboQuantProd`.
      dtype: output dtype, float32, bfloat16 or float16.
    Returns:
      [..., head_dim] array of ``dtype``.
    Raises:
      BackendUnavailableError: backend "ffi" where no kernel serves the call (when it is lowered).
      TypeError / ValueError: as :func:`qjl_scores` for the key arrays; an unsupported dtype.
    Source: TurboQuant (arXiv 2504.19874), Algorithm 2 (DeQuant_prod), with the sketch on the
    rotated residual. The mse part runs the decompress kernel, the sign part one XLA product.
    """
    _check_prod_codec(codec, "qjl_decompress")
    dtype = output_dtype(dtype, "qjl_decompress")
    keys = _check_keys(keys, codec, None, "jax_tq.qjl_decompress")
    mse = decompress(keys.codes, keys.norms, codec.mse, jnp.float32)
    signs = unpack_signs(keys.signs, codec.head_dim).astype(jnp.float32)
    sketch_back = jnp.matmul(jnp.matmul(signs, codec.sketch, precision=jax.lax.Precision.HIGHEST),
                             codec.mse.rotation, precision=jax.lax.Precision.HIGHEST)   # (Pi^T S^T s) as rows
    weight = keys.norms * jnp.float32(codec.qjl_scale) * keys.gamma
    return (mse + weight[..., None] * sketch_back).astype(dtype)


def _check_keys(keys, codec, lead, op="jax_tq.qjl_scores") -> QJLCodes:
    """The keys as a QJLCodes of jnp arrays; TypeError / ValueError naming the field that is wrong.
    ``lead``: the leading axes the keys must have before num_keys (None: any)."""
    if not isinstance(keys, (tuple, list)) or len(keys) != 4:
        raise TypeError(f"{op}: keys must be a jax_tq.QJLCodes (codes, norms, signs, gamma), got {type(keys).__name__}")
    keys = QJLCodes(*(as_array(a, f"keys.{f}", op.removeprefix("jax_tq.")) for f, a in zip(QJLCodes._fields, keys)))
    for name, want in (("codes", jnp.uint8), ("norms", jnp.float32), ("signs", jnp.uint8), ("gamma", jnp.float32)):
        got = getattr(keys, name).dtype
        if got != want:
            raise TypeError(f"{op}: keys.{name} must be {jnp.dtype(want).name}, got {got}")
    if lead is not None and (keys.norms.ndim != len(lead) + 1 or keys.norms.shape[:-1] != lead):
        raise ValueError(f"{op}: keys.norms must be [..., num_keys] with q's leading axes {tuple(lead)}, got "
                         f"shape {tuple(keys.norms.shape)}")
    token_shape = keys.norms.shape
    expected = {"codes": token_shape + (codec.packed_bytes,), "signs": token_shape + (codec.sign_bytes,),
                "gamma": token_shape}
    for name, shape in expected.items():
        if getattr(keys, name).shape != shape:
            raise ValueError(f"{op}: keys.{name} has shape {tuple(getattr(keys, name).shape)}, expected {shape} for "
                             f"norms {tuple(token_shape)} and {codec!r}")
    return keys


# ----------------------------------------------------------------------------- abstract eval

def _qjl_compress_abstract(x, rotation, centroids, sketch, *, bits, backend):
    n, d = x.shape
    inputs = (x, rotation, centroids, sketch)
    return (_compat.output_aval((n, d * bits // 8), jnp.uint8, *inputs),
            _compat.output_aval((n,), jnp.float32, *inputs),
            _compat.output_aval((n, d // 8), jnp.uint8, *inputs),
            _compat.output_aval((n,), jnp.float32, *inputs))


def _qjl_scores_abstract(q_rot, q_sketch, codes, norms, signs, gamma, centroids, *, bits, qjl_scale, backend):
    b, num_queries, _ = q_rot.shape
    inputs = (q_rot, q_sketch, codes, norms, signs, gamma, centroids)
    return (_compat.output_aval((b, num_queries, norms.shape[1]), jnp.float32, *inputs),)


# ----------------------------------------------------------------------------- lowering

def _qjl_compress_reference(x, rotation, centroids, sketch, *, bits):
    return reference.qjl_compress(x, rotation, centroids, sketch, bits)


def _qjl_scores_reference(*operands, bits, qjl_scale):
    return (reference.qjl_scores_rotated(*operands, bits, qjl_scale).astype(jnp.float32),)


def _qjl_compress_ffi(ctx, *operands, bits):
    return _compat.ffi_lowering("jax_tq_qjl_compress")(ctx, *operands, bits=np.int32(bits))


def _qjl_scores_ffi(ctx, *operands, bits, qjl_scale):
    return _compat.ffi_lowering("jax_tq_qjl_scores")(ctx, *operands, bits=np.int32(bits),
                                                     qjl_scale=np.float32(qjl_scale))


# ----------------------------------------------------------------------------- batching

def _qjl_compress_batch(args, dims, **params):
    return pu.rows_batch(qjl_compress_p, 1, ("rotation", "centroids", "sketch"), args, dims, **params)


def _qjl_scores_batch(args, dims, **params):
    """vmap over queries only folds into num_queries (the keys are read once); otherwise every
    operand gets the vmapped axis and it folds into the batch axis."""
    pu.require_unbatched(("centroids",), dims[6:], "qjl_scores")
    size = pu.batch_size(args, dims)
    queries, keys = args[:2], args[2:6]
    if all(d is _compat.NOT_MAPPED for d in dims[2:6]):
        moved = [pu.move_batch_to_front(a, d, size) for a, d in zip(queries, dims[:2])]  # [V, B, Q, d]
        b, num_queries, head_dim = moved[0].shape[1:]
        folded = [jnp.swapaxes(a, 0, 1).reshape((b, size * num_queries, head_dim)) for a in moved]
        (scores,) = qjl_scores_p.bind(*folded, *keys, args[6], **params)
        return [scores.reshape((b, size, num_queries, scores.shape[-1]))], [1]
    moved = [pu.move_batch_to_front(a, d, size) for a, d in zip(args[:6], dims[:6])]
    folded = [a.reshape((-1,) + a.shape[2:]) for a in moved]
    (scores,) = qjl_scores_p.bind(*folded, args[6], **params)
    return [scores.reshape((size, moved[0].shape[1]) + scores.shape[1:])], [0]


# ----------------------------------------------------------------------------- the ops

pu.define_op(qjl_compress_p, abstract=_qjl_compress_abstract, reference=_qjl_compress_reference,
             ffi=_qjl_compress_ffi, batch=_qjl_compress_batch)
pu.define_op(qjl_scores_p, abstract=_qjl_scores_abstract, reference=_qjl_scores_reference, ffi=_qjl_scores_ffi,
             batch=_qjl_scores_batch)
