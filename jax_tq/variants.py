"""The attention variants of the attention ops (:func:`jax_tq.paged_decode`,
:func:`jax_tq.paged_prefill`, :func:`jax_tq.ragged_paged_attention`, :func:`jax_tq.prompt_attention`):
their trace-time checks and their names in the FFI targets.

Semantics (the same on every backend; the reference is :mod:`jax_tq.reference`):
  ``sliding_window`` w: the query at position p sees the keys at positions p - w + 1 .. p (the
      last w tokens, itself included; vLLM's / Mistral's ``sliding_window``, tpu-inference's
      ``sliding_window``: a key at position k is seen when k > p - w).
  ``soft_cap`` c: each logit l = scale * <q, k> becomes c * tanh(l / c) before masking and
      softmax (Gemma 2's ``attn_logit_softcapping``; tpu-inference's ``soft_cap``).
  ``sinks`` [num_heads]: a per-head logit that joins the softmax denominator only (gpt-oss's
      attention sinks): out = sum_j exp(l_j - m) v_j / (exp(sink - m) + sum_j exp(l_j - m)); it is
      neither scaled nor capped, and a row with no visible token outputs 0 whatever its sink. A
      sink of -inf is no sink; NaN gives its head's other rows NaN; +inf gives them 0 (the limit)
      or NaN, depending on the op and backend: pass finite sinks.

The CPU handlers and the CUDA kernels serve them; where a platform's kernels do not (e.g. TPU, or a
GPU build without CUDA kernels) backend "auto" runs XLA's code of the reference for a call that sets
any of them (:func:`jax_tq.backend.kernel_lacks`).
"""
from __future__ import annotations

import math
import operator

import jax
import jax.numpy as jnp
import numpy as np

_FLOAT32_MAX = float(np.finfo(np.float32).max)
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)


def check_variants(sliding_window, soft_cap, sinks, num_heads: int, op: str):
    """The variants of an attention call, checked at trace time.

    Args:
      sliding_window: None, or a concrete Python / NumPy integer >= 1 (static).
      soft_cap: None, or a concrete finite Python / NumPy number > 0 (static), a normal float32.
      sinks: None, or a float array [num_heads] (float32; bfloat16 / float16 / float64 are cast to
        float32; traced is fine).
      num_heads: the query heads; op: the public op's name for the messages.

    Returns:
      (sliding_window int, 0 for none; soft_cap float rounded to float32, 0.0 for none; sinks
      float32 [num_heads], or float32 [0] for none).

    Raises:
      TypeError: sliding_window not an int (a bool, a float, a traced value), soft_cap not a
        concrete real number, sinks not of a float dtype.
      ValueError: sliding_window < 1; soft_cap <= 0, not finite, or outside float32's normal
        range; sinks not of shape [num_heads].
    """
    return (_static_window(sliding_window, op), _static_soft_cap(soft_cap, op),
            _sinks_operand(sinks, num_heads, op))


def _static_window(sliding_window, op: str) -> int:
    if sliding_window is None:
        return 0
    if isinstance(sliding_window, (bool, np.bool_)):
        raise TypeError(f"jax_tq.{op}: sliding_window must be an int >= 1 or None, got bool {sliding_window!r}")
    try:
        value = operator.index(sliding_window)
    except TypeError as err:
        raise TypeError(f"jax_tq.{op}: sliding_window must be a concrete Python int >= 1 (static) or None, got "
                        f"{type(sliding_window).__name__} {sliding_window!r}") from err
    if value < 1:
        raise ValueError(f"jax_tq.{op}: sliding_window must be >= 1 (the tokens a query sees, itself included), "
                         f"got {value}")
    return min(value, np.iinfo(np.int32).max)  # past int32 every window sees every token


def _static_soft_cap(soft_cap, op: str) -> float:
    if soft_cap is None:
        return 0.0
    if isinstance(soft_cap, (bool, np.bool_, str, bytes)):
        raise TypeError(f"jax_tq.{op}: soft_cap must be a positive Python number or None, got "
                        f"{type(soft_cap).__name__} {soft_cap!r}")
    try:
        value = float(soft_cap)
    except (TypeError, jax.errors.ConcretizationTypeError) as err:
        raise TypeError(f"jax_tq.{op}: soft_cap must be a concrete Python number (static) or None, got "
                        f"{type(soft_cap).__name__}; pass it as a static argument under jit") from err
    if not math.isfinite(value) or not _FLOAT32_TINY <= value <= _FLOAT32_MAX:
        raise ValueError(f"jax_tq.{op}: soft_cap must be finite and > 0 (a normal float32, "
                         f"{_FLOAT32_TINY:.3g} .. {_FLOAT32_MAX:.3g}), got {value}")
    return float(np.float32(value))


def _sinks_operand(sinks, num_heads: int, op: str):
    if sinks is None:
        return jnp.zeros((0,), jnp.float32)
    sinks = jnp.asarray(sinks)
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise TypeError(f"jax_tq.{op}: sinks must be a float array [num_heads={num_heads}] (float32; other float "
                        f"dtypes are cast), got {sinks.dtype}{tuple(sinks.shape)}")
    if sinks.shape != (num_heads,):
        raise ValueError(f"jax_tq.{op}: sinks must be float32 [num_heads={num_heads}] (one logit per query head), "
                         f"got {sinks.dtype}{tuple(sinks.shape)}")
    return sinks.astype(jnp.float32)


def as_keywords(sliding_window: int, soft_cap: float, sinks):
    """Keyword arguments (None for a variant not in use) of the reference functions and the public
    ops, from check_variants' values."""
    return dict(sliding_window=sliding_window or None, soft_cap=soft_cap or None,
                sinks=sinks if sinks.shape[0] else None)
