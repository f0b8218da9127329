"""Device timeline of one decode call inside the benchmark's chain (bench_decode.py): every GPU
kernel of a call with its duration and the idle gap before it, from a JAX profiler trace (CUPTI).

It answers where a call's time goes beyond the split kernel: the XLA ops around it (rotations,
NaN mask, cast), the combine, the chain's own add / sum, and the launch gaps between them.

Usage: python benchmarks/trace_decode.py [32x8192 ...] [--preset k4v4] [--head-dim 64] (a GPU; one table per shape;
--preset: a cache of that preset, window filled, and also the timeline of a decode step's write)
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import bench_decode
import jax_tq as tq
from device_time import span_us, traced_runs

INNER = 8


def chain_fn(inner):
    @jax.jit
    def chain(q, cache, tables, lens):
        carry = jnp.zeros((), jnp.float32)
        for _ in range(inner):
            out = tq.paged_decode(q + (carry * 0).astype(q.dtype), cache, tables, lens)
            carry = jnp.sum(out.astype(jnp.float32))
        return carry
    return chain


def one_shape(num_seqs, seq_len, rotation, preset=None):
    if preset:
        from bench_format import filled_caches
        sets, _ = filled_caches(num_seqs, seq_len, int(preset[1]), True)
        cache, tables, lens = sets[0]
        q = jax.random.normal(jax.random.PRNGKey(0), (num_seqs, 32, 128), jnp.bfloat16)
    else:
        (q, cache, tables, lens), = bench_decode.make_tq_inputs(num_seqs, seq_len, jax.random.PRNGKey(0), 1,
                                                                  rotation=rotation)
    chain = chain_fn(INNER)
    for _ in range(3):
        jax.block_until_ready(chain(q, cache, tables, lens))
    runs = traced_runs(lambda: jax.block_until_ready(chain(q, cache, tables, lens)), repeats=3)
    if runs is None:
        print(f"== {num_seqs}x{seq_len}: no GPU kernel events in the trace (no GPU, or no CUPTI)")
        return
    print_timeline(f"{num_seqs}x{seq_len} ({preset or rotation})", runs[-1])
    if preset:  # a decode step's write of num_seqs tokens into the same cache (pages and window)
        k = jax.random.normal(jax.random.PRNGKey(1), (num_seqs, 8, 128), jnp.bfloat16)
        slots = jnp.arange(num_seqs, dtype=jnp.int32) * 7
        window = tq.window_slot_mapping(jnp.arange(num_seqs, dtype=jnp.int32), lens, lens + 1, cache.window)

        @jax.jit
        def writes(cache):
            for _ in range(INNER):
                cache = tq.write_cache(cache, k, k, slots, window)
            return cache.k_norms[0, 0, 0]

        for _ in range(3):
            jax.block_until_ready(writes(cache))
        runs = traced_runs(lambda: jax.block_until_ready(writes(cache)), repeats=3)
        writes_seen = [e for e in runs[-1] if "tq_" in e["name"]][-2:]  # the last write's kernels
        for e in writes_seen:
            print(f"| write: {e['name'][:70]} | {e['dur']:.1f} |")


def print_timeline(label, kernels):
    # Calls are delimited by the split kernel (the longest): show the kernels after one split kernel (the middle
    # call's) up to the next, then per-call averages over the whole chain.
    longest = max(kernels, key=lambda e: e["dur"])["name"]  # the split kernel, once per call
    split_idx = [i for i, e in enumerate(kernels) if e["name"] == longest]
    span, busy = span_us(kernels) / INNER, sum(e["dur"] for e in kernels) / INNER
    print(f"== {label}: {len(kernels)} kernels in {INNER} calls; per call: span {span:.1f} us, "
          f"kernels busy {busy:.1f} us, idle {span - busy:.1f} us")
    if len(split_idx) >= 3:
        a, b = split_idx[len(split_idx) // 2 - 1], split_idx[len(split_idx) // 2]
        print("| kernel | us | gap before (us) |")
        print("|---|---:|---:|")
        for i in range(a + 1, b + 1):
            e, prev = kernels[i], kernels[i - 1]
            gap = e["ts"] - (prev["ts"] + prev["dur"])
            print(f"| {e['name'][:70]} | {e['dur']:.1f} | {gap:.1f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shapes", nargs="*", default=["32x8192", "1x32768"], help="NUM_SEQSxSEQ_LEN (default 32x8192 1x32768)")
    ap.add_argument("--rotation", default="haar", choices=["haar", "hadamard"], help="the codecs' rotation kind")
    ap.add_argument("--preset", default=None, choices=["k4v4", "k3v3", "k2v2"], help="a preset's cache instead")
    ap.add_argument("--head-dim", type=int, default=128, help="head_dim of the plain codecs' cache (default 128)")
    args = ap.parse_args()
    bench_decode.HEAD_DIM = args.head_dim
    for spec in args.shapes:
        num_seqs, seq_len = (int(v) for v in spec.split("x"))
        try:
            one_shape(num_seqs, seq_len, args.rotation, args.preset)
        except Exception as err:  # noqa: BLE001 - a profiler without CUPTI must not end the run
            print(f"== {spec}: trace failed: {type(err).__name__}: {str(err)[:300]}")


if __name__ == "__main__":
    main()
