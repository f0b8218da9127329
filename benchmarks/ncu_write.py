"""A prefill's cache write for Nsight Compute: 8192 tokens x 8 KV heads, head_dim 128, bf16 K / V,
written twice per codec (the first call warms up), for the plain Hadamard codec (K4V4,
tq_hadamard_wgmma_kernel on Hopper: bf16 K / V from 16384 rows per pool) and the k4v4 preset (fitted scale, 65536 rows per call:
tq_hadamard_quad_fit_kernel).

Usage: ncu --clock-control none -k regex:tq_hadamard --launch-skip 1 --launch-count 1 \
           --section SpeedOfLight ... python3 benchmarks/ncu_write.py [plain|k4v4 ...]
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jax_tq as tq

TOKENS, HKV, D, PAGE = 8192, 8, 128, 16


def prefill_cache(kind: str) -> tq.PagedKVCache:
    """An empty cache of one 8192-token prompt for ``kind`` ("plain": K4V4 Hadamard; else a preset)."""
    pages = TOKENS // PAGE
    if kind == "plain":
        return tq.PagedKVCache.create(num_pages=pages, page_size=PAGE, num_kv_heads=HKV,
                                      k_codec=tq.TurboQuant(D, 4, 0, "hadamard"), v_codec=tq.TurboQuant(D, 4, 1, "hadamard"))
    return tq.PagedKVCache.create(num_pages=pages, page_size=PAGE, num_kv_heads=HKV, preset=kind, head_dim=D, window=0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kinds", nargs="*", default=["plain", "k4v4"], help="plain and / or preset names (default both)")
    kinds = ap.parse_args().kinds
    key = jax.random.PRNGKey(0)
    k, v = (jax.random.normal(kk, (TOKENS, HKV, D), jnp.bfloat16) for kk in jax.random.split(key))
    slots = jnp.arange(TOKENS, dtype=jnp.int32)
    write = jax.jit(tq.write_cache, donate_argnums=0)
    for kind in kinds:
        cache = prefill_cache(kind)
        for _ in range(2):
            cache = write(cache, k, v, slots)
        jax.block_until_ready(cache)
    print("ncu_write: done")


if __name__ == "__main__":
    main()
