"""Compression benchmark on one GPU: jax_tq CUDA kernels (backend "ffi") against the XLA reference
(jax_tq.reference, jitted; backend "xla").

  1. one decode step's cache write: 64 tokens x 8 KV heads, head_dim 128, bf16 K and V, K4V4, into a
     4096-page cache (write_cache: K and V in one fused call, donated: in place);
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

import device_time

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


def _write_program(backend, reps, inner, device=False):
    """Median and best host seconds of one program of ``inner`` chained write_cache steps, and
    (``device``) its GPU span per step (nan without a GPU or when not asked)."""
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
    dev = device_time.device_seconds_per_call(run, inner) if device else None
    return med, best, float("nan") if dev is None else dev


def bench_write(backend, reps, short=20, long=80):
    """Seconds per decode-step write: the slope between programs of ``short`` and ``long`` steps,
    so that the program's one host dispatch (tens of us) is not spread over the steps. Also
    returns the plain per-step time of the long program (dispatch included) and its GPU span per
    step (profiler kernel events; nan without a GPU)."""
    t_short, t_long = _write_program(backend, reps, short), _write_program(backend, reps, long, device=True)
    slope = (t_long[0] - t_short[0]) / (long - short)
    return slope, t_long[0] / long, t_long[2]


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
    ap.add_argument("--write-only", action="store_true", help="only the decode-step write")
    args = ap.parse_args()
    reps = 5 if args.quick else 15
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}")
    agree, nerr = check_agreement()
    print(f"ffi vs xla: {100 * agree:.3f}% codes equal, max norm rel diff {nerr:.2e}")
    writes = {b: bench_write(b, reps) for b in ("ffi", "xla")}
    print()
    kernel = "CUDA" if dev.platform == "gpu" else "CPU"  # the FFI kernels of the platform that runs
    print(f"| write_cache step, 64 tok x 8 heads x d128 bf16, K+V | jax_tq {kernel} (us) | XLA reference (us) | speedup |")
    print("|---|---:|---:|---:|")
    print(f"| per step (slope, 20 -> 80 steps) | {writes['ffi'][0] * 1e6:.1f} | {writes['xla'][0] * 1e6:.1f} | "
          f"{writes['xla'][0] / writes['ffi'][0]:.2f} |")
    print(f"| per step of an 80-step program (its one dispatch included) | {writes['ffi'][1] * 1e6:.1f} | "
          f"{writes['xla'][1] * 1e6:.1f} | {writes['xla'][1] / writes['ffi'][1]:.2f} |")
    if writes["ffi"][2] == writes["ffi"][2]:  # no GPU span without a GPU (nan)
        print(f"| per step, GPU span of the 80-step program / 80 (profiler) | {writes['ffi'][2] * 1e6:.1f} | "
              f"{writes['xla'][2] * 1e6:.1f} | {writes['xla'][2] / writes['ffi'][2]:.2f} |")
    if args.write_only:
        return
    bulk = {b: bench_bulk(b, reps, n=args.n) for b in ("ffi", "xla")}
    (fc, fd), (xc, xd) = bulk["ffi"], bulk["xla"]
    n = args.n
    flops = 2.0 * n * HEAD_DIM * HEAD_DIM
    in_bytes = n * HEAD_DIM * 2
    out_bytes = n * (HEAD_DIM * BITS // 8 + 4)
    print()
    print(f"| op | jax_tq {kernel} (us) | XLA reference (us) | speedup | {kernel} GFLOP/s | {kernel} GB/s |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| compress {n} x d128 bf16, 4 bit | {fc[0] * 1e6:.1f} | {xc[0] * 1e6:.1f} | "
          f"{xc[0] / fc[0]:.2f} | {flops / fc[0] / 1e9:.0f} | {(in_bytes + out_bytes) / fc[0] / 1e9:.0f} |")
    print(f"| decompress {n} x d128 -> bf16 | {fd[0] * 1e6:.1f} | {xd[0] * 1e6:.1f} | "
          f"{xd[0] / fd[0]:.2f} | {flops / fd[0] / 1e9:.0f} | {(in_bytes + out_bytes) / fd[0] / 1e9:.0f} |")

if __name__ == "__main__":
    main()
