"""The Llama family's generic layers in flax.nnx: RMSNorm, rotary position embeddings and the
SwiGLU feed-forward (no cache, no attention: jax_tq.models.llama assembles them)."""
from __future__ import annotations

from typing import Sequence

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .config import LlamaConfig

__all__ = ["MLP", "RMSNorm", "Rope", "apply_rope", "dense_param", "rope_cos_sin"]


class RMSNorm(nnx.Module):
    """Root-mean-square layer norm: ``x / sqrt(mean(x^2) + eps) * weight`` (computed in float32).

    RMSNorm: Zhang & Sennrich 2019, "Root Mean Square Layer Normalization".

    Args:
      dim: feature size; ``weight`` is ``[dim]``, initialised to ones.
      eps: epsilon added to the mean square.
      dtype: dtype of ``weight``.
    """

    def __init__(self, dim: int, eps: float = 1e-5, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        """Normalise float ``x [..., dim]`` over its last axis; ``[..., dim]`` in ``x.dtype``."""
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (y * self.weight[...].astype(jnp.float32)).astype(x.dtype)


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float,
                 freq_factors: Sequence[float] | None = None):
    """RoPE tables for the ``rotate_half`` (NeoX / HF) layout (Su et al. 2021).

    Args:
      positions: int ``[...]`` absolute token positions.
      head_dim: even rotary dimension.
      theta: base frequency.
      freq_factors: optional ``head_dim // 2`` positive divisors of the inverse frequencies
        (llama.cpp's ``rope_freqs.weight``: ggml's ``rope_yarn(theta / freq_factors[i0 / 2])``;
        Llama 3.1's scaling, ``convert_hf_to_gguf.py`` ``LlamaModel.generate_extra_tensors``;
        linear scaling by ``s`` (position interpolation) is every factor equal to ``s``).
    Returns:
      ``(cos, sin)`` float32 ``[..., head_dim]`` where entries ``i`` and ``i + head_dim/2`` share
      the frequency ``theta ** (-2i / head_dim) / freq_factors[i]`` (radians per position).
    Raises:
      ValueError: ``freq_factors`` is not of length ``head_dim // 2``.
    """
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if freq_factors is not None:
        if len(freq_factors) != head_dim // 2:
            raise ValueError(f"rope freq_factors must have head_dim // 2 = {head_dim // 2} entries, got "
                             f"{len(freq_factors)}")
        inv_freq = inv_freq / np.asarray(freq_factors, np.float64)
    inv_freq = jnp.asarray(inv_freq, jnp.float32)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x [..., heads, d]`` with tables ``cos, sin [..., d]``: ``x*cos + rotate_half(x)*sin``.

    RoPE (Su et al. 2021, "RoFormer") in the NeoX / HF ``rotate_half`` layout: coordinate ``i``
    pairs with ``i + d/2``. Computed in float32.

    Args:
      x: float ``[..., heads, d]`` (``d`` even), e.g. ``[T, heads, d]``.
      cos, sin: float32 ``[..., d]`` from :func:`rope_cos_sin` (x's leading shape).
    Returns:
      ``[..., heads, d]`` in ``x.dtype``.
    """
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[..., None, :] + rot * sin[..., None, :]).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class Rope:
    """RoPE as :class:`jax_tq.nn.PagedAttention`'s ``rope``: ``Rope(...)(x, positions)`` rotates
    ``x [..., heads, head_dim]`` at int ``positions`` of x's leading shape (:func:`rope_cos_sin`,
    :func:`apply_rope`). A frozen dataclass, so equal settings compare equal (a jit cache key).

    Attributes:
      head_dim: even rotary dimension; theta: base frequency;
      freq_factors: None or a tuple of ``head_dim // 2`` divisors of the inverse frequencies.
    """

    head_dim: int
    theta: float
    freq_factors: tuple | None = None

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        cos, sin = rope_cos_sin(positions, self.head_dim, self.theta, self.freq_factors)
        return apply_rope(x, cos, sin)


def dense_param(rngs: nnx.Rngs, n_in: int, n_out: int, dtype) -> nnx.Param:
    """A ``[n_in, n_out]`` weight (``y = x @ w``) of ``dtype``, random ``N(0, 1/n_in)``."""
    w = jax.random.normal(rngs.params(), (n_in, n_out), jnp.float32) / np.sqrt(n_in)
    return nnx.Param(w.astype(dtype))


class MLP(nnx.Module):
    """SwiGLU feed-forward: ``(silu(x @ w_gate) * (x @ w_up)) @ w_down`` (Shazeer 2020).

    Args:
      config: :class:`LlamaConfig` (``hidden_size``, ``intermediate_size``).
      dtype: weight dtype.
      rngs: ``nnx.Rngs`` for the random weight initialisation.
    """

    def __init__(self, config: LlamaConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.w_gate = dense_param(rngs, config.hidden_size, config.intermediate_size, dtype)
        self.w_up = dense_param(rngs, config.hidden_size, config.intermediate_size, dtype)
        self.w_down = dense_param(rngs, config.intermediate_size, config.hidden_size, dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """The feed-forward of float ``x [..., hidden]``: ``[..., hidden]``."""
        return (jax.nn.silu(x @ self.w_gate[...]) * (x @ self.w_up[...])) @ self.w_down[...]
