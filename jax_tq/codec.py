"""The TurboQuant codec: rotation + codebook + static (head_dim, bits, seed, rotation kind).

Implements the parameters of TurboQuant_mse (Zandieh et al., "TurboQuant", arXiv 2504.19874,
Algorithm 1): the random rotation Pi (line 2) and the Lloyd-Max codebook of the Beta coordinate
law (line 3). The codec is a JAX pytree with no array leaves: the float32 ``rotation`` [d, d] and
``centroids`` [2**bits] are fixed by the static fields, so it passes through ``jax.jit``, ``vmap``
and donation as static data and can be stored inside other pytrees.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_tq import _compat, codebook, format as tq_format, rotation as tq_rotation

__all__ = ["TurboQuant", "TurboQuantProd", "CODEC_BITS", "PROD_BITS"]

#: Bit widths the codec accepts (packed storage additionally requires bits in 2..4).
CODEC_BITS = (1, 2, 3, 4)
#: Total bit widths of TurboQuantProd: a packed TurboQuant_mse code of bits - 1 (2..4) + 1 QJL bit.
PROD_BITS = (3, 4, 5)


def _validate_scale(scale) -> None:
    if not isinstance(scale, str) or scale not in tq_format.SCALE_KINDS:
        raise ValueError(f"scale must be one of {tq_format.SCALE_KINDS}, got {scale!r}")


def _named(where: str, check, *args) -> None:
    """check(*args), its TypeError / ValueError prefixed with ``where`` (the constructor)."""
    try:
        check(*args)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{where}: {e}") from None


def _validate_spec(head_dim, bits, seed, rotation) -> None:
    """Raise TypeError / ValueError naming the offending constructor argument."""
    tq_format.check_head_dim(head_dim)
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)):
        raise TypeError(f"bits must be an int, got {type(bits).__name__} ({bits!r})")
    if bits not in CODEC_BITS:
        raise ValueError(f"bits must be one of {CODEC_BITS}, got {bits}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int, got {type(seed).__name__} ({seed!r})")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if not isinstance(rotation, str) or rotation not in tq_rotation.ROTATION_KINDS:
        raise ValueError(f"rotation must be one of {tq_rotation.ROTATION_KINDS}, got {rotation!r}")


@functools.lru_cache(maxsize=None)
def _float32_parameters(head_dim: int, bits: int, seed: int, kind: str):
    """Read-only float32 numpy (rotation [d, d], centroids [2**bits]) for one spec."""
    rotation = tq_rotation.make_rotation(kind, head_dim, seed).astype(np.float32)
    centroids = codebook.lloyd_max_centroids(head_dim, bits).astype(np.float32)
    rotation.setflags(write=False)
    centroids.setflags(write=False)
    return rotation, centroids


_DEVICE_PARAMETERS: dict = {}


def _device_parameters(spec):
    """jnp float32 (rotation, centroids) for one spec; cached once made outside any trace."""
    cached = _DEVICE_PARAMETERS.get(spec)
    if cached is not None:
        return cached
    params = tuple(jnp.asarray(a) for a in _float32_parameters(*spec))
    if not any(isinstance(a, jax.core.Tracer) for a in params):
        _DEVICE_PARAMETERS[spec] = params
    return params


class _SpecCodec:
    """A codec fixed by its spec (head_dim, bits, seed, rotation_kind): a pytree with no leaves,
    compared and hashed by type and spec."""

    __slots__ = ("head_dim", "bits", "seed", "rotation_kind")

    def _set_fields(self, spec) -> None:
        for name, value in zip(_SpecCodec.__slots__, spec):
            object.__setattr__(self, name, value)

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is immutable (its spec fixes its rotation, codebook and hash); "
                             f"make a new codec instead of setting {name!r}")

    def __reduce__(self):  # pickle / copy rebuild through the constructor (the fields are read-only)
        return (type(self), self.spec)

    def same_spec(self, other) -> bool:
        """True if ``other`` is a codec of the same type and (head_dim, bits, seed, rotation_kind)."""
        return self == other

    def tree_flatten(self):
        """No leaves; aux data = spec tuple."""
        return (), self.spec

    @classmethod
    def tree_unflatten(cls, spec, leaves):
        """Rebuild without validation or recomputation."""
        codec = object.__new__(cls)
        codec._set_fields(spec)
        return codec

    @property
    def spec(self) -> tuple[int, int, int, str]:
        """Static configuration (head_dim, bits, seed, rotation_kind)."""
        return (self.head_dim, self.bits, self.seed, self.rotation_kind)

    def __eq__(self, other):
        return type(other) is type(self) and self.spec == other.spec

    def __hash__(self):
        return hash((type(self).__name__, self.spec))


@_compat.exportable_pytree
@jax.tree_util.register_pytree_node_class
class TurboQuant(_SpecCodec):
    """TurboQuant_mse codec parameters (arXiv 2504.19874, Algorithm 1).

    Args:
      head_dim: int in (64, 80, 96, 128, 192, 256).
      bits: int in 1..4 (packed cache storage needs 2..4; see ``jax_tq.format``).
      seed: int >= 0, seeds the rotation (``np.random.default_rng([seed, rotation.ROTATION_STREAM])``).
      rotation: ``"haar"`` (QR of a Gaussian, sign-fixed) or ``"hadamard"`` (randomized
        block-Hadamard); see ``jax_tq.rotation``.
      scale: what the per-vector float32 slot holds. ``"norm"`` (default): ||x||, TurboQuant_mse
        exactly as published, with its Lloyd-Max distortion. ``"fit"``: the codes of the best of 17
        pre-scalings of the rotated unit vector and the least-squares scale of the result
        (``jax_tq.format.FIT_GRID``; docs/FORMAT.md "Fitted scale"): 13-25% lower MSE at 4 bits,
        ~12% at 3, ~3% at 2 (head_dim 64-128), the same bytes, and decoding unchanged
        (x_hat = scale * Pi^T c[codes]).
    Attributes:
      rotation: float32 jax array [head_dim, head_dim], Pi with y = Pi @ u.
      centroids: float32 jax array [2**bits], sorted ascending, unit-sphere scale.
      head_dim, bits, seed, rotation_kind, scale (``spec`` is the tuple of them).
    Raises:
      TypeError / ValueError: an argument of the wrong type or an unsupported value (the message
        names the argument).

    The codec is a pytree with no array leaves: rotation and codebook are fixed by the spec, so
    they travel as static data (compile-time constants). A cache holding the same codec for K and
    V can be donated, stacked per layer, scanned or vmapped without duplicating or batching them.
    Codecs compare and hash by spec, so they can also be static arguments of ``jax.jit``.
    """

    __slots__ = ("scale",)

    def __init__(self, head_dim: int = 128, bits: int = 4, seed: int = 0,
                 rotation: str = "haar", scale: str = "norm"):
        _named("jax_tq.TurboQuant", _validate_spec, head_dim, bits, seed, rotation)
        _named("jax_tq.TurboQuant", _validate_scale, scale)
        spec = (int(head_dim), int(bits), int(seed), rotation, scale)
        _float32_parameters(*spec[:4])  # computed (and cached) now, not inside a trace
        self._set_fields(spec)

    def _set_fields(self, spec) -> None:
        super()._set_fields(spec[:4])
        object.__setattr__(self, "scale", spec[4])

    @property
    def spec(self) -> tuple[int, int, int, str, str]:
        """Static configuration (head_dim, bits, seed, rotation_kind, scale)."""
        return (self.head_dim, self.bits, self.seed, self.rotation_kind, self.scale)

    @property
    def fit_scale(self) -> bool:
        """True for ``scale="fit"`` (the norm slot holds the fitted least-squares scale)."""
        return self.scale == "fit"

    @property
    def rotation(self):
        """float32 [head_dim, head_dim] rotation Pi (y = Pi @ u)."""
        return _device_parameters(self.spec[:4])[0]

    @property
    def centroids(self):
        """float32 [2**bits] Lloyd-Max centroids, ascending, unit-sphere scale."""
        return _device_parameters(self.spec[:4])[1]

    # ---- derived properties ----------------------------------------------------------------
    @property
    def num_levels(self) -> int:
        """Number of centroids, 2**bits."""
        return 1 << self.bits

    @property
    def packed_bytes(self) -> int:
        """Bytes of packed codes per vector, head_dim * bits / 8.

        Raises ValueError for bits = 1 (no packed storage format)."""
        return tq_format.packed_bytes(self.head_dim, self.bits)

    @property
    def boundaries(self):
        """Quantizer boundaries (c_i + c_{i+1}) / 2, float32 [2**bits - 1] (DESIGN.md rule:
        code = number of boundaries strictly less than y)."""
        return (self.centroids[1:] + self.centroids[:-1]) * jnp.float32(0.5)

    @property
    def hadamard_spec(self):
        """int32 numpy [head_dim], the factors of a power-of-two Hadamard rotation as spec words
        (:func:`jax_tq.format.hadamard_spec`), or None for a Haar rotation or a head_dim that is not
        a power of two (a block-diagonal Hadamard): the kernels that apply the rotation themselves
        (``paged_decode``) read it."""
        if self.rotation_kind != "hadamard" or self.head_dim & (self.head_dim - 1):
            return None
        return tq_format.hadamard_spec(*tq_rotation.hadamard_factors(self.head_dim, self.seed))

    def __repr__(self) -> str:
        scale = "" if self.scale == "norm" else f", scale={self.scale!r}"
        return (f"TurboQuant(head_dim={self.head_dim}, bits={self.bits}, seed={self.seed}, "
                f"rotation={self.rotation_kind!r}{scale})")


_SKETCHES: dict = {}


def _device_sketch(head_dim: int, seed: int):
    """jnp float32 [d, d] QJL sketch; cached once made outside any trace."""
    cached = _SKETCHES.get((head_dim, seed))
    if cached is not None:
        return cached
    sketch = jnp.asarray(tq_rotation.gaussian_sketch(head_dim, seed).astype(np.float32))
    if not isinstance(sketch, jax.core.Tracer):
        _SKETCHES[(head_dim, seed)] = sketch
    return sketch


@_compat.exportable_pytree
@jax.tree_util.register_pytree_node_class
class TurboQuantProd(_SpecCodec):
    """TurboQuant_prod codec: unbiased inner products (arXiv 2504.19874, Algorithm 2).

    A vector x is stored as TurboQuant_mse at ``bits - 1`` bits (codes + fp32 norm, exactly what
    :class:`TurboQuant` stores) plus the QJL 1-bit sketch of the residual: ``signs = sign(S r)``
    (``head_dim`` bits) and ``gamma = ||r||`` (fp32), with ``r = Pi x / ||x|| - c[codes]`` the
    residual of the unit vector in the rotated domain and S the Gaussian sketch. The estimate

        <q, x> ~ ||x|| * (<Pi q, c[codes]> + sqrt(pi/2) / head_dim * gamma * <S Pi q, signs>)

    is unbiased (QJL, arXiv 2406.03482) with variance (pi/2) D_mse(bits-1) / d * ||q||^2 ||x||^2.
    S is applied in the rotated domain: S Pi is again an i.i.d. Gaussian matrix, so this is the
    paper's sign(S' r) with S' = S Pi, and q needs one rotation and one sketch product per query.

    Args:
      head_dim: int in (64, 80, 96, 128, 192, 256).
      bits: total bits per coordinate, 3, 4 or 5 (the mse code gets bits - 1 in 2..4).
      seed: int >= 0, seeds the rotation and (on its own stream) the sketch.
      rotation: ``"haar"`` or ``"hadamard"`` (see :class:`TurboQuant`).
    Attributes:
      mse: the :class:`TurboQuant` of ``bits - 1`` bits that stores codes and norms.
      sketch: float32 jax array [head_dim, head_dim], S with i.i.d. N(0, 1) entries.
      qjl_scale: sqrt(pi/2) / head_dim (the QJL scale for N(0, 1) entries; sqrt(pi/2) / sqrt(d)
        would be right for unit-norm rows only).
    Raises:
      TypeError / ValueError: an argument of the wrong type or an unsupported value.

    Like :class:`TurboQuant` it is a pytree with no array leaves, compared and hashed by spec.
    """

    __slots__ = ()

    def __init__(self, head_dim: int = 128, bits: int = 4, seed: int = 0, rotation: str = "haar"):
        if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)):
            raise TypeError(f"jax_tq.TurboQuantProd: bits must be an int, got {type(bits).__name__} ({bits!r})")
        if bits not in PROD_BITS:
            raise ValueError(f"jax_tq.TurboQuantProd: bits must be one of {PROD_BITS} (a packed mse code of bits - 1 "
                             f"in 2..4 plus one QJL bit), got {bits}")
        _named("jax_tq.TurboQuantProd", _validate_spec, head_dim, bits - 1, seed, rotation)
        spec = (int(head_dim), int(bits), int(seed), rotation)
        _float32_parameters(spec[0], spec[1] - 1, spec[2], spec[3])
        tq_rotation.gaussian_sketch(spec[0], spec[2])
        self._set_fields(spec)

    @property
    def mse(self) -> TurboQuant:
        """The TurboQuant_mse codec of ``bits - 1`` bits (codes, norms, rotation, centroids)."""
        return TurboQuant(self.head_dim, self.bits - 1, self.seed, self.rotation_kind)

    @property
    def sketch(self):
        """float32 [head_dim, head_dim] QJL sketch S (applied to rotated residuals)."""
        return _device_sketch(self.head_dim, self.seed)

    @property
    def qjl_scale(self) -> float:
        """sqrt(pi/2) / head_dim: the QJL estimator's scale for a sketch of N(0, 1) entries."""
        return float(np.sqrt(np.pi / 2) / self.head_dim)

    @property
    def packed_bytes(self) -> int:
        """Bytes of packed mse codes per vector, head_dim * (bits - 1) / 8."""
        return tq_format.packed_bytes(self.head_dim, self.bits - 1)

    @property
    def sign_bytes(self) -> int:
        """Bytes of QJL sign bits per vector, head_dim / 8."""
        return tq_format.sign_bytes(self.head_dim)

    def __repr__(self) -> str:
        return (f"TurboQuantProd(head_dim={self.head_dim}, bits={self.bits}, seed={self.seed}, "
                f"rotation={self.rotation_kind!r})")
