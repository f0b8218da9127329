"""Kernel time of ``write_cache`` per call: bf16 K and V of plain Hadamard codecs into a paged cache.

A jitted chain of 8 writes (distinct K / V, the same slots, the cache donated) per shape; the GPU's
kernel events give each kernel's summed duration per call (``device_time.kernel_seconds_by_name``),
printed for the two longest kernels (the write kernel first); without a GPU, the host clock per call.
8 KV heads, head_dim 128, page_size 16.

Usage: PYTHONPATH=benchmarks python benchmarks/bench_write.py [--tokens 64,1024,2048,4096,8192] [--bits 4/4,4/3]
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jax_tq as tq
import device_time

HKV, HEAD_DIM, PAGE, CALLS = 8, 128, 16, 8


def write_chain(k_bits: int, v_bits: int, tokens: int):
    """(run, calls): ``run()`` writes CALLS times into one donated cache and waits."""
    rng = np.random.default_rng(0)
    pages = max(64, 2 * tokens // PAGE)
    cache = tq.PagedKVCache.create(num_pages=pages, page_size=PAGE, num_kv_heads=HKV,
                                   k_codec=tq.TurboQuant(HEAD_DIM, k_bits, 1, "hadamard"),
                                   v_codec=tq.TurboQuant(HEAD_DIM, v_bits, 2, "hadamard"))
    ks = [jnp.asarray(rng.normal(size=(tokens, HKV, HEAD_DIM)), jnp.bfloat16) for _ in range(CALLS)]
    vs = [jnp.asarray(rng.normal(size=(tokens, HKV, HEAD_DIM)), jnp.bfloat16) for _ in range(CALLS)]
    slots = jnp.asarray(rng.permutation(pages * PAGE)[:tokens].astype(np.int32))

    @jax.jit
    def chain(cache, ks, vs):
        for k, v in zip(ks, vs):
            cache = tq.write_cache(cache, k, v, slots)
        return cache

    donated = jax.jit(chain, donate_argnums=0)
    state = {"cache": cache}

    def run():
        state["cache"] = donated(state["cache"], ks, vs)
        jax.block_until_ready(state["cache"])

    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="64,1024,2048,4096,8192", help="tokens per write, comma-separated")
    ap.add_argument("--bits", default="4/4,4/3", help="K/V bit widths, comma-separated")
    args = ap.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    for bits in args.bits.split(","):
        k_bits, v_bits = (int(b) for b in bits.split("/"))
        for tokens in (int(t) for t in args.tokens.split(",")):
            run = write_chain(k_bits, v_bits, tokens)
            run()  # compiled before the trace
            kernels = device_time.kernel_seconds_by_name(run, CALLS)
            if kernels is None:  # no GPU kernel events (CPU): the host clock per call
                kernels = {"host clock per call": device_time.seconds_per_call(run, CALLS, 5)}
            top = sorted(kernels.items(), key=lambda kv: -kv[1])[:2]
            print(f"K{k_bits}V{v_bits} tokens {tokens:5d}: "
                  + "; ".join(f"{sec * 1e6:7.1f} us {name[:70]}" for name, sec in top), flush=True)


if __name__ == "__main__":
    main()
