"""Float64 oracles built on jax_tq.reference (run under x64) and random cache builders for tests."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jax_tq as tq
from jax_tq import _compat, reference


def to_f64(x):
    return np.asarray(x, dtype=np.float64)


def decode_f64(q, cache, block_tables, seq_lens, scale=None):
    """paged_decode in float64: rotate q, reference attention over the codes, rotate back."""
    k, v = cache.k_codec, cache.v_codec
    scale = 1.0 / np.sqrt(k.head_dim) if scale is None else scale
    with _compat.enable_x64():
        q_rot = to_f64(q) @ to_f64(k.rotation).T
        out_rot = reference.paged_decode_rotated(
            jnp.asarray(q_rot), cache.k_codes, jnp.asarray(to_f64(cache.k_norms)), cache.v_codes,
            jnp.asarray(to_f64(cache.v_norms)), jnp.asarray(to_f64(k.centroids)), jnp.asarray(to_f64(v.centroids)),
            jnp.asarray(block_tables), jnp.asarray(seq_lens), k.bits, v.bits, scale,
        )
        return np.asarray(out_rot) @ to_f64(v.rotation)


def compress_f64(x, codec):
    with _compat.enable_x64():
        codes, norms = reference.compress(jnp.asarray(to_f64(x)), jnp.asarray(to_f64(codec.rotation)),
                                          jnp.asarray(to_f64(codec.centroids)), codec.bits)
        return np.asarray(codes), np.asarray(norms)


def decompress_f64(codes, norms, codec):
    with _compat.enable_x64():
        return np.asarray(reference.decompress(jnp.asarray(codes), jnp.asarray(to_f64(norms)),
                                               jnp.asarray(to_f64(codec.rotation)), jnp.asarray(to_f64(codec.centroids)),
                                               codec.bits, jnp.float64))


def random_cache(rng, *, num_pages, page_size, num_kv_heads, head_dim, k_bits, v_bits, seed=0, rotation="haar"):
    """A cache whose every slot holds random codes and positive random norms (no zeros)."""
    k_codec = tq.TurboQuant(head_dim=head_dim, bits=k_bits, seed=seed, rotation=rotation)
    v_codec = tq.TurboQuant(head_dim=head_dim, bits=v_bits, seed=seed + 1, rotation=rotation)
    cache = tq.PagedKVCache.create(num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv_heads,
                                   k_codec=k_codec, v_codec=v_codec)
    def codes(shape):
        return jnp.asarray(rng.integers(0, 256, size=shape, dtype=np.uint8))
    def norms(shape):
        return jnp.asarray(rng.uniform(0.5, 2.0, size=shape).astype(np.float32))
    import dataclasses
    return dataclasses.replace(cache, k_codes=codes(cache.k_codes.shape), k_norms=norms(cache.k_norms.shape),
                               v_codes=codes(cache.v_codes.shape), v_norms=norms(cache.v_norms.shape))


def random_tables(rng, seq_lens, page_size, num_pages, max_pages=None):
    """Block tables mapping each sequence to distinct random pages; unused entries hold garbage ids."""
    needed = [-(-int(n) // page_size) for n in seq_lens]
    max_pages = max_pages or max(1, max(needed))
    tables = rng.integers(-5, num_pages + 5, size=(len(seq_lens), max_pages)).astype(np.int32)
    for i, n in enumerate(needed):
        tables[i, :n] = rng.choice(num_pages, size=n, replace=False)
    return jnp.asarray(tables)


def rel_err(got, want):
    got, want = to_f64(got), to_f64(want)
    assert np.all(np.isfinite(got)), "non-finite output"
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def primitive_count(jaxpr, prim):
    """Occurrences of ``prim`` in ``jaxpr`` and the jaxprs nested in it (custom_jvp/vjp, pjit, ...)."""
    from jax.extend.core import jaxprs_in_params

    total = 0
    for eqn in jaxpr.eqns:
        total += eqn.primitive is prim
        total += sum(primitive_count(getattr(sub, "jaxpr", sub), prim) for sub in jaxprs_in_params(eqn.params))
    return total
