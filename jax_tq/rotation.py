"""Random orthogonal rotations Pi for TurboQuant (y = Pi @ u).

TurboQuant_mse (Zandieh et al., arXiv 2504.19874, Algorithm 1, line 2) draws Pi uniformly from
the orthogonal group (Haar measure) so that y = Pi u is a uniformly random point of the sphere.
Two constructions are offered, both float64 numpy [d, d], exactly orthonormal up to rounding:

* ``"haar"``: QR of a standard Gaussian matrix with the sign fix Q <- Q diag(sign(diag(R))),
  which makes Q exactly Haar distributed (Mezzadri, "How to generate random matrices from the
  classical compact groups", 2007).
* ``"hadamard"``: a randomized Hadamard transform, the usual fast substitute. For
  d = 2^k it is the normalized Sylvester Hadamard matrix. For other supported d it is a
  block-diagonal of normalized power-of-two Hadamards, one block per set bit of d
  (80 = 64 + 16, 96 = 64 + 32, 192 = 128 + 64), so it stays exactly orthonormal (never a
  larger Hadamard rescaled by the wrong norm). To mix energy across the blocks it is applied
  twice with independent random sign flips and a random permutation in between:

      Pi = H @ D2 @ P @ H @ D1

  with H the (block-)Hadamard, D1, D2 random +-1 diagonals and P a random permutation matrix.
  Pi is orthonormal as a product of orthonormal matrices. It is not Haar distributed; it makes
  the coordinate law of y close to the Beta law the codebook is designed for.
"""

from __future__ import annotations

import functools

import numpy as np

from jax_tq.format import SUPPORTED_HEAD_DIMS

__all__ = ["ROTATION_KINDS", "gaussian_sketch", "haar_rotation", "hadamard_rotation", "hadamard_factors",
           "make_rotation", "block_hadamard"]

#: Accepted values of the ``kind`` argument of :func:`make_rotation`.
ROTATION_KINDS = ("haar", "hadamard")

#: head_dims for which the block-diagonal Hadamard construction is defined and tested.
HADAMARD_HEAD_DIMS = SUPPORTED_HEAD_DIMS  # every head_dim of the format (jax_tq/format.py)


#: Second entropy word of the rotations' random streams: the rotation of seed s is drawn from
#: ``np.random.default_rng([s, ROTATION_STREAM])``, not from ``default_rng(s)``, so that test data
#: drawn from ``default_rng(s)`` (the usual way to make it, with the same small seed) is not
#: correlated with the rotation. (With the bare stream, the first head_dim rows of such data are
#: the Gaussian matrix whose QR is the Haar rotation: their rotated coordinates are far from the
#: codebook's law and 4-bit codes lost ~16x more than expected.)
ROTATION_STREAM = 0x7451_726F74  # "tQrot"


def _rotation_rng(seed: int) -> np.random.Generator:
    return np.random.default_rng([seed, ROTATION_STREAM])


def _check_int(name: str, value, minimum: int) -> int:
    """Return ``value`` as int; TypeError if not an int, ValueError if below ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


@functools.lru_cache(maxsize=None)
def _haar_cached(head_dim: int, seed: int) -> np.ndarray:
    """Haar-distributed orthogonal matrix for (head_dim, seed), read-only."""
    gaussian = _rotation_rng(seed).standard_normal((head_dim, head_dim))
    q, r = np.linalg.qr(gaussian)
    signs = np.sign(np.diag(r))
    signs[signs == 0] = 1.0
    rotation = q * signs[None, :]
    rotation.setflags(write=False)
    return rotation


def haar_rotation(head_dim: int, seed: int) -> np.ndarray:
    """Haar-random orthogonal matrix Pi (y = Pi @ u).

    Args:
      head_dim: int d >= 1.
      seed: int >= 0, with ROTATION_STREAM the entropy of ``np.random.default_rng``; the result
        is deterministic per seed.
    Returns:
      float64 numpy array [d, d], orthonormal (Pi @ Pi.T = I to ~1e-15); a fresh copy.
    Raises:
      TypeError: head_dim or seed not an int.  ValueError: head_dim < 1 or seed < 0.
    Source: TurboQuant (arXiv 2504.19874), Algorithm 1 line 2 (random rotation via QR of a
      Gaussian matrix), with the sign fix of Mezzadri (2007) so the law is exactly Haar.
    """
    head_dim = _check_int("head_dim", head_dim, 1)
    seed = _check_int("seed", seed, 0)
    return np.array(_haar_cached(head_dim, seed), copy=True)


def _sylvester_hadamard(size: int) -> np.ndarray:
    """Normalized Sylvester Hadamard matrix of a power-of-two ``size`` (float64, orthonormal)."""
    matrix = np.ones((1, 1))
    while matrix.shape[0] < size:
        matrix = np.block([[matrix, matrix], [matrix, -matrix]])
    return matrix / np.sqrt(size)


def _power_of_two_blocks(head_dim: int) -> list[int]:
    """Powers of two summing to head_dim, largest first (its binary expansion)."""
    return [1 << k for k in reversed(range(head_dim.bit_length())) if head_dim >> k & 1]


def block_hadamard(head_dim: int) -> np.ndarray:
    """Block-diagonal normalized Hadamard matrix, one block per set bit of head_dim.

    Args:
      head_dim: int >= 1 (e.g. 80 -> blocks 64, 16; 192 -> 128, 64; 128 -> one block).
    Returns:
      float64 numpy array [head_dim, head_dim], exactly orthonormal (entries +-1/sqrt(block)).
    Raises:
      TypeError / ValueError: head_dim not an int >= 1.
    """
    head_dim = _check_int("head_dim", head_dim, 1)
    matrix = np.zeros((head_dim, head_dim))
    start = 0
    for size in _power_of_two_blocks(head_dim):
        matrix[start:start + size, start:start + size] = _sylvester_hadamard(size)
        start += size
    return matrix


def hadamard_factors(head_dim: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The random factors of :func:`hadamard_rotation`: (signs_first, permutation, signs_second).

    Returns:
      float64 [d] of +-1 (D1), int64 [d] permutation (P, (P v)_i = v_{perm[i]}), float64 [d] of
      +-1 (D2), with Pi = H D2 P H D1; deterministic per seed (``np.random.default_rng([seed,
      ROTATION_STREAM])``).
    Raises:
      TypeError: head_dim or seed not an int.  ValueError: seed < 0 or head_dim < 1.
    """
    head_dim = _check_int("head_dim", head_dim, 1)
    rng = _rotation_rng(_check_int("seed", seed, 0))
    signs_first = rng.choice(np.array([-1.0, 1.0]), size=head_dim)
    permutation = rng.permutation(head_dim)
    signs_second = rng.choice(np.array([-1.0, 1.0]), size=head_dim)
    return signs_first, permutation, signs_second


@functools.lru_cache(maxsize=None)
def _hadamard_cached(head_dim: int, seed: int) -> np.ndarray:
    """Pi = H D2 P H D1 for (head_dim, seed), read-only."""
    signs_first, permutation, signs_second = hadamard_factors(head_dim, seed)
    hadamard = block_hadamard(head_dim)
    first_round = hadamard * signs_first[None, :]              # H @ D1
    mixed = first_round[permutation, :] * signs_second[:, None]  # D2 @ P @ (H D1)
    rotation = hadamard @ mixed                                 # H @ D2 @ P @ H @ D1
    rotation.setflags(write=False)
    return rotation


def hadamard_rotation(head_dim: int, seed: int) -> np.ndarray:
    """Randomized (block-)Hadamard rotation Pi = H D2 P H D1 (y = Pi @ u); see the module doc.

    Args:
      head_dim: int in (64, 80, 96, 128, 192, 256).
      seed: int >= 0, with ROTATION_STREAM seeds ``np.random.default_rng`` for the signs and the
        permutation.
    Returns:
      float64 numpy array [d, d], exactly orthonormal up to float64 rounding; a fresh copy.
    Raises:
      TypeError: head_dim or seed not an int.
      ValueError: head_dim not supported, or seed < 0.
    Source: TurboQuant (arXiv 2504.19874), Sec. 3 (random rotation; a randomized Hadamard
      transform is the standard fast substitute for the Haar rotation).
    """
    head_dim = _check_int("head_dim", head_dim, 1)
    seed = _check_int("seed", seed, 0)
    if head_dim not in HADAMARD_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HADAMARD_HEAD_DIMS} for the Hadamard "
                         f"rotation, got {head_dim}")
    return np.array(_hadamard_cached(head_dim, seed), copy=True)


def make_rotation(kind: str, head_dim: int, seed: int) -> np.ndarray:
    """Rotation of the given kind: ``"haar"`` -> :func:`haar_rotation`, ``"hadamard"`` ->
    :func:`hadamard_rotation`.

    Returns:
      float64 numpy array [head_dim, head_dim], orthonormal, y = Pi @ u.
    Raises:
      ValueError: unknown ``kind`` (or invalid head_dim / seed, see the two constructors).
      TypeError: ``kind`` not a str, or head_dim / seed not ints.
    """
    if not isinstance(kind, str):
        raise TypeError(f"kind must be a str in {ROTATION_KINDS}, got {type(kind).__name__}")
    if kind == "haar":
        return haar_rotation(head_dim, seed)
    if kind == "hadamard":
        return hadamard_rotation(head_dim, seed)
    raise ValueError(f"kind must be one of {ROTATION_KINDS}, got {kind!r}")


#: Second entropy word of the QJL sketch's random stream (independent of the rotation's).
SKETCH_STREAM = 0x7451_716A6C  # "tQqjl"


@functools.lru_cache(maxsize=None)
def _sketch_cached(head_dim: int, seed: int) -> np.ndarray:
    sketch = np.random.default_rng([seed, SKETCH_STREAM]).standard_normal((head_dim, head_dim))
    sketch.setflags(write=False)
    return sketch


def gaussian_sketch(head_dim: int, seed: int) -> np.ndarray:
    """The QJL sketch S: i.i.d. N(0, 1) entries, drawn from ``default_rng([seed, SKETCH_STREAM])``.

    Args:
      head_dim: int d >= 1.
      seed: int >= 0.
    Returns:
      float64 numpy array [d, d] (rows not normalised: the QJL estimator's scale sqrt(pi/2) / d
      is for N(0, 1) entries); a fresh copy.
    Raises:
      TypeError: head_dim or seed not an int.  ValueError: head_dim < 1 or seed < 0.
    Source: QJL (Zandieh et al., arXiv 2406.03482), the Gaussian JL matrix of the 1-bit sketch;
      TurboQuant (arXiv 2504.19874), Algorithm 2 (TurboQuant_prod) applies it to the residual.
    """
    head_dim = _check_int("head_dim", head_dim, 1)
    seed = _check_int("seed", seed, 0)
    return np.array(_sketch_cached(head_dim, seed), copy=True)
