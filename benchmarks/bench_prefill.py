"""Paged prefill benchmark: causal attention of whole prompts over the compressed cache (K4V4,
head_dim 128, 32 query / 8 KV heads, page_size 16), against the same attention as one-query decodes
per row (``paged_decode`` with per-row tables: what jax_tq.models' evaluation path runs) and against
bf16 causal attention on uncompressed K / V (``jax.nn.dot_product_attention``, XLA and cuDNN).

Timing: one jitted program of ``inner`` calls on distinct queries, median GPU span per call
(profiler kernel events, benchmarks/device_time.py); host clock without kernel events (CPU).
Usage: python benchmarks/bench_prefill.py [--quick]
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jax_tq as tq

import device_time

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
SHAPES = ((1, 2048), (1, 8192), (8, 1024))  # (num_seqs, prompt_len)


def compressed_setup(num_seqs, prompt_len, key):
    """A K4V4 cache holding every prompt (sequence s on pages [s * pages, (s + 1) * pages))."""
    pages = -(-prompt_len // PAGE)
    cache = tq.PagedKVCache.create(num_pages=num_seqs * pages, page_size=PAGE, num_kv_heads=KV_HEADS,
                                   k_codec=tq.TurboQuant(HEAD_DIM, 4, rotation="hadamard"),
                                   v_codec=tq.TurboQuant(HEAD_DIM, 4, seed=1, rotation="hadamard"))
    tokens = num_seqs * prompt_len
    k = jax.random.normal(key, (tokens, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    v = jax.random.normal(jax.random.fold_in(key, 1), (tokens, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    seq = np.repeat(np.arange(num_seqs), prompt_len)
    pos = np.tile(np.arange(prompt_len), num_seqs)
    slots = jnp.asarray(seq * pages * PAGE + pos, jnp.int32)
    cache = jax.jit(tq.write_cache)(cache, k, v, slots)
    tables = jnp.asarray(np.arange(num_seqs * pages).reshape(num_seqs, pages), jnp.int32)
    return cache, tables, k, v


def bench(num_seqs, prompt_len, inner, reps):
    key = jax.random.PRNGKey(0)
    cache, tables, k, v = compressed_setup(num_seqs, prompt_len, key)
    tokens = num_seqs * prompt_len
    qs = [jax.random.normal(jax.random.fold_in(key, 10 + i), (tokens, HEADS, HEAD_DIM), jnp.bfloat16)
          for i in range(inner)]
    lens = jnp.full((num_seqs,), prompt_len, jnp.int32)
    starts = jnp.asarray(np.arange(num_seqs + 1) * prompt_len, jnp.int32)
    row_tables = jnp.repeat(tables, prompt_len, axis=0)
    row_lens = jnp.asarray(np.tile(np.arange(1, prompt_len + 1), num_seqs), jnp.int32)
    times = {}
    prefill = jax.jit(lambda qs: [tq.paged_prefill(q, cache, tables, lens, starts) for q in qs])
    times["prefill"] = device_time.seconds_per_call(lambda: jax.block_until_ready(prefill(qs)), inner, reps)
    per_row = jax.jit(lambda qs: [tq.paged_decode(q, cache, row_tables, row_lens) for q in qs])
    times["decode rows"] = device_time.seconds_per_call(lambda: jax.block_until_ready(per_row(qs)), inner, reps)
    kd = k.reshape(num_seqs, prompt_len, KV_HEADS, HEAD_DIM)
    vd = v.reshape(num_seqs, prompt_len, KV_HEADS, HEAD_DIM)
    for impl in ("xla", "cudnn"):
        def dense(qs, impl=impl):
            return [jax.nn.dot_product_attention(q.reshape(num_seqs, prompt_len, HEADS, HEAD_DIM), kd, vd,
                                                 is_causal=True, implementation=impl) for q in qs]
        try:
            f = jax.jit(dense)
            times[impl] = device_time.seconds_per_call(lambda: jax.block_until_ready(f(qs)), inner, reps)
        except Exception as err:  # cuDNN absent (CPU) or refusing the shape
            print(f"  {impl}: unavailable ({type(err).__name__})")
            times[impl] = float("nan")
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one small shape (a CPU smoke run)")
    args = ap.parse_args()
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}")
    shapes = ((2, 64),) if args.quick else SHAPES
    inner, reps = (2, 3) if args.quick else (4, 10)
    print(f"\n| (num_seqs, prompt_len), {HEADS}/{KV_HEADS} heads, d {HEAD_DIM} | jax_tq paged_prefill K4V4 (us) | "
          "paged_decode per row (us) | XLA bf16 causal (us) | cuDNN bf16 causal (us) |")
    print("|---|---:|---:|---:|---:|")
    for shape in shapes:
        t = bench(*shape, inner, reps)
        print(f"| {shape} | {t['prefill'] * 1e6:.1f} | {t['decode rows'] * 1e6:.1f} | {t['xla'] * 1e6:.1f} | "
              f"{t['cudnn'] * 1e6:.1f} |", flush=True)


if __name__ == "__main__":
    main()
