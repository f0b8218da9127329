"""Compression benchmark on one GPU: jax_tq CUDA kernels (backend "ffi") against the XLA reference
(jax_tq.reference, jitted; backend "xla").

  1. one decode step's cache write: 64 tokens x 8 KV heads, head_dim 128, bf16 K and V, K4V4, into a
     4096-page cache (write_cache = compress_write of K and of V, donated: in place);
  2. bulk compress of 1M vectors, head_dim 128, bf16, 4 bits;
  3. bulk decompress of 1M vectors to bf16.

Timing: jitted programs of R back-to-back calls on distinct inputs (chained through the donated
cache for the write), host clock around block_until_ready, median over repetitions, divided by R.
Usage: python benchmarks/bench_compress.py [--quick]
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_tq as tq
from jax_tq import reference

HEAD_DIM, BITS = 128, 4


def median_time(run, reps, warmup=2):
    for _ in range(warmup):
        run()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), min(ts)


def bench_write(backend, reps, inner=50):
    k_codec = tq.TurboQuant(head_dim=HEAD_DIM, bits=BITS, seed=0)
    v_codec = tq.TurboQuant(head_dim=HEAD_DIM, bits=BITS, seed=1)
    num_pages, page, hkv, tokens = 4096, 16, 8, 64
    key = jax.random.PRNGKey(0)
    # One array per step, as a decode step's K / V projections arrive: slicing one stacked array
    # inside the program would add a copy kernel per operand per step to what is timed.
    ks = list(jax.random.normal(key, (inner, tokens, hkv, HEAD_DIM), jnp.bfloat16))
    vs = list(jax.random.normal(jax.random.fold_in(key, 1), (inner, tokens, hkv, HEAD_DIM), jnp.bfloat16))
    # distinct random slots per step (a decode step of 64 sequences writes 64 scattered slots)
    slots = list(jax.random.randint(jax.random.fold_in(key, 2), (inner, tokens), 0, num_pages * page, jnp.int32))

    def steps(cache, ks, vs, slots):
        with tq.use_backend(backend):
            for i in range(inner):
                cache = tq.write_cache(cache, ks[i], vs[i], slots[i])
        return cache

    f = jax.jit(steps, donate_argnums=(0,))
    state = {"cache": tq.PagedKVCache.create(num_pages=num_pages, page_size=page, num_kv_heads=hkv,
                                             k_codec=k_codec, v_codec=v_codec)}

    def run():
        state["cache"] = f(state["cache"], ks, vs, slots)
        jax.block_until_ready(state["cache"])

    med, best = median_time(run, reps)
    return med / inner, best / inner


def bench_bulk(backend, reps, n=1 << 20, inner=8):
    """Bulk compress and decompress, each of ``inner`` DISTINCT inputs in one program: identical
    calls on the same input would be merged by XLA's common-subexpression elimination (the FFI
    calls too: they have no side effects), and the duplicated results copied."""
    codec = tq.TurboQuant(head_dim=HEAD_DIM, bits=BITS, seed=0)
    xs = [jax.random.normal(jax.random.PRNGKey(i), (n, HEAD_DIM), jnp.bfloat16) for i in range(inner)]

    def comp(xs):
        with tq.use_backend(backend):
            return [tq.compress(x, codec) for x in xs]

    fc = jax.jit(comp)
    t_c = median_time(lambda: jax.block_until_ready(fc(xs)), reps)
    pairs = jax.jit(lambda xs: [tq.compress(x, codec) for x in xs])(xs)
    del xs

    def decomp(pairs):
        with tq.use_backend(backend):
            return [tq.decompress(c, nrm, codec, jnp.bfloat16) for c, nrm in pairs]

    fd = jax.jit(decomp)
    t_d = median_time(lambda: jax.block_until_ready(fd(pairs)), reps)
    return (t_c[0] / inner, t_c[1] / inner), (t_d[0] / inner, t_d[1] / inner)


def check_agreement(n=4096):
    """Sanity: FFI and XLA codes agree (>= 99.9%) on the benchmark's data."""
    codec = tq.TurboQuant(head_dim=HEAD_DIM, bits=BITS, seed=0)
    x = jax.random.normal(jax.random.PRNGKey(7), (n, HEAD_DIM), jnp.bfloat16)
    with tq.use_backend("ffi"):
        a, na = jax.jit(lambda x: tq.compress(x, codec))(x)
    with tq.use_backend("xla"):
        b, nb = jax.jit(lambda x: tq.compress(x, codec))(x)
    from jax_tq.format import unpack_codes
    ia, ib = unpack_codes(np.asarray(a), BITS, HEAD_DIM), unpack_codes(np.asarray(b), BITS, HEAD_DIM)
    return float(np.mean(ia == ib)), float(np.max(np.abs(np.asarray(na) - np.asarray(nb)) / np.asarray(nb)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--n", type=int, default=1 << 20, help="vectors in the bulk benchmarks")
    args = ap.parse_args()
    reps = 5 if args.quick else 15
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}")
    agree, nerr = check_agreement()
    print(f"ffi vs xla: {100 * agree:.3f}% codes equal, max norm rel diff {nerr:.2e}")
    rows = []
    for backend in ("ffi", "xla"):
        w = bench_write(backend, reps)
        c, d = bench_bulk(backend, reps, n=args.n)
        rows.append((backend, w, c, d))
        print(f"{backend}: write_cache step {w[0] * 1e6:.1f} us, compress {c[0] * 1e6:.1f} us, "
              f"decompress {d[0] * 1e6:.1f} us")
    ffi, xla = rows[0], rows[1]
    n = args.n
    flops = 2.0 * n * HEAD_DIM * HEAD_DIM
    in_bytes = n * HEAD_DIM * 2
    out_bytes = n * (HEAD_DIM * BITS // 8 + 4)
    print()
    print("| op | jax_tq CUDA (us) | XLA reference (us) | speedup | CUDA GFLOP/s | CUDA GB/s |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| write_cache, 64 tok x 8 heads x d128 bf16, K+V | {ffi[1][0] * 1e6:.1f} | {xla[1][0] * 1e6:.1f} | "
          f"{xla[1][0] / ffi[1][0]:.2f} | - | - |")
    print(f"| compress {n} x d128 bf16, 4 bit | {ffi[2][0] * 1e6:.1f} | {xla[2][0] * 1e6:.1f} | "
          f"{xla[2][0] / ffi[2][0]:.2f} | {flops / ffi[2][0] / 1e9:.0f} | {(in_bytes + out_bytes) / ffi[2][0] / 1e9:.0f} |")
    print(f"| decompress {n} x d128 -> bf16 | {ffi[3][0] * 1e6:.1f} | {xla[3][0] * 1e6:.1f} | "
          f"{xla[3][0] / ffi[3][0]:.2f} | {flops / ffi[3][0] / 1e9:.0f} | {(in_bytes + out_bytes) / ffi[3][0] / 1e9:.0f} |")


if __name__ == "__main__":
    main()
