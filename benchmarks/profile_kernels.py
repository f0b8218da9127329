"""A few launches of each jax_tq CUDA kernel, for `ncu` (Nsight Compute) to profile: decode, a
decode step's write, a prefill's write of Hadamard codecs (8192 tokens), a compress.

Usage: ncu --clock-control none -k regex:"tq_|decode_" --section SpeedOfLight \
           --section LaunchStats --section Occupancy python3 benchmarks/profile_kernels.py
"""
from __future__ import annotations

import argparse

import dataclasses

import jax
import jax.numpy as jnp

import jax_tq as tq

H, HKV, D, PAGE = 32, 8, 128, 16


def decode_inputs(num_seqs, seq_len, key, rotation="haar"):
    k_codec, v_codec = tq.TurboQuant(D, 4, 0, rotation), tq.TurboQuant(D, 4, 1, rotation)
    pages = num_seqs * (seq_len // PAGE)
    cache = tq.PagedKVCache.create(num_pages=pages, page_size=PAGE, num_kv_heads=HKV, k_codec=k_codec, v_codec=v_codec)
    k1, k2, k3 = jax.random.split(key, 3)
    cache = dataclasses.replace(
        cache,
        k_codes=jax.random.randint(k1, cache.k_codes.shape, 0, 256, jnp.int32).astype(jnp.uint8),
        v_codes=jax.random.randint(k2, cache.v_codes.shape, 0, 256, jnp.int32).astype(jnp.uint8),
        k_norms=cache.k_norms + 1.0, v_norms=cache.v_norms + 1.0)
    tables = jax.random.permutation(k3, pages).astype(jnp.int32).reshape(num_seqs, -1)
    q = jax.random.normal(key, (num_seqs, H, D), jnp.bfloat16)
    return q, cache, tables, jnp.full((num_seqs,), seq_len, jnp.int32)


def main():
    key = jax.random.PRNGKey(0)
    decode = jax.jit(tq.paged_decode)
    for shape in ((1, 32768), (32, 8192)):
        args = decode_inputs(*shape, key)
        for _ in range(2):
            jax.block_until_ready(decode(*args))
    cache = tq.PagedKVCache.create(num_pages=4096, page_size=PAGE, num_kv_heads=HKV,
                                   k_codec=tq.TurboQuant(D, 4, 0), v_codec=tq.TurboQuant(D, 4, 1))
    write = jax.jit(tq.write_cache, donate_argnums=0)
    k = jax.random.normal(key, (64, HKV, D), jnp.bfloat16)
    slots = jax.random.randint(key, (64,), 0, 4096 * PAGE, jnp.int32)
    for _ in range(2):
        cache = write(cache, k, k, slots)
    jax.block_until_ready(cache)
    # A prefill's write of Hadamard codecs (tq_hadamard_quad_kernel): 8192 tokens x HKV heads, K and V.
    prompt = tq.PagedKVCache.create(num_pages=8192 // PAGE, page_size=PAGE, num_kv_heads=HKV,
                                    k_codec=tq.TurboQuant(D, 4, 0, "hadamard"), v_codec=tq.TurboQuant(D, 4, 1, "hadamard"))
    k = jax.random.normal(key, (8192, HKV, D), jnp.bfloat16)
    for _ in range(2):
        prompt = write(prompt, k, k, jnp.arange(8192, dtype=jnp.int32))
    jax.block_until_ready(prompt)
    x = jax.random.normal(key, (1 << 20, D), jnp.bfloat16)
    jax.block_until_ready(jax.jit(tq.compress, static_argnums=1)(x, tq.TurboQuant(D, 4, 0)))
    print("profile_kernels: done")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help; no options
    main()
