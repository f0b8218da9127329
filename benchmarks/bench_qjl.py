"""TurboQuant_prod (QJL) benchmark: raw attention scores over compressed keys, and bulk compress.

  1. scores [B, Q, S] of B x Q queries against S keys (head_dim 128, 3-bit mse codes + 1 QJL bit):
     jax_tq ``qjl_scores`` (backend "ffi": the CUDA kernel) against its XLA reference and against
     the bf16 product q @ K^T of the uncompressed keys (what a bf16 key cache costs);
  2. bulk ``qjl_compress`` of 1M bf16 vectors: XLA's code of the reference, and backend "ffi" where
     the platform's module has a compress kernel (the CPU's; the CUDA module has none, XLA's code
     being faster).

Timing: one jitted program of ``inner`` calls on DISTINCT inputs (more bytes than the L2 holds, and
no common-subexpression elimination), median over repetitions of the GPU span (profiler kernel
events) divided by ``inner``; host clock where there are no kernel events (CPU).
Usage: python benchmarks/bench_qjl.py [--quick]
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jax_tq as tq
from jax_tq import _ffi

import device_time

HEAD_DIM, BITS = 128, 4
SHAPES = ((1, 32, 32768), (8, 4, 32768), (32, 8, 8192))  # (B, Q, S)


def bench_scores(shape, inner, reps):
    b, q_len, s = shape
    codec = tq.TurboQuantProd(HEAD_DIM, BITS)
    key = jax.random.PRNGKey(0)
    ks = [jax.random.normal(jax.random.fold_in(key, i), (b, s, HEAD_DIM), jnp.bfloat16) for i in range(inner)]
    qs = [jax.random.normal(jax.random.fold_in(key, 1000 + i), (b, q_len, HEAD_DIM), jnp.bfloat16) for i in range(inner)]
    packed = jax.jit(lambda ks: [tq.qjl_compress(k, codec) for k in ks])(ks)
    times = {}
    for backend in ("ffi", "xla"):
        def scores(qs, packed, backend=backend):
            with tq.use_backend(backend):
                return [tq.qjl_scores(q, k, codec) for q, k in zip(qs, packed)]
        f = jax.jit(scores)
        times[backend] = device_time.seconds_per_call(lambda: jax.block_until_ready(f(qs, packed)), inner, reps)
    dense = jax.jit(lambda qs, ks: [jnp.einsum("bqd,bsd->bqs", q, k, preferred_element_type=jnp.float32)
                                    for q, k in zip(qs, ks)])
    times["bf16"] = device_time.seconds_per_call(lambda: jax.block_until_ready(dense(qs, ks)), inner, reps)
    key_bytes = b * s * (codec.packed_bytes + codec.sign_bytes + 8)
    out_bytes = b * q_len * s * 4
    return times, key_bytes, out_bytes, 4.0 * b * q_len * s * HEAD_DIM


def bench_compress(n, inner, reps, backends):
    codec = tq.TurboQuantProd(HEAD_DIM, BITS)
    xs = [jax.random.normal(jax.random.PRNGKey(i), (n, HEAD_DIM), jnp.bfloat16) for i in range(inner)]
    times = {}
    for backend in backends:
        def comp(xs, backend=backend):
            with tq.use_backend(backend):
                return [tq.qjl_compress(x, codec) for x in xs]
        f = jax.jit(comp)
        times[backend] = device_time.seconds_per_call(lambda: jax.block_until_ready(f(xs)), inner, reps)
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small shapes (a CPU smoke run)")
    args = ap.parse_args()
    reps = 5 if args.quick else 15
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}")
    shapes = ((1, 4, 1024),) if args.quick else SHAPES
    inner = 4 if args.quick else 32
    print(f"\n| qjl_scores (B, Q, S), d {HEAD_DIM}, {BITS} bits | jax_tq (us) | XLA ref (us) | bf16 q @ K^T (us) "
          "| key + score bytes (MB) | GB/s | GFLOP/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for shape in shapes:
        times, key_bytes, out_bytes, flops = bench_scores(shape, inner, reps)
        t = times["ffi"]
        print(f"| {shape} | {t * 1e6:.1f} | {times['xla'] * 1e6:.1f} | {times['bf16'] * 1e6:.1f} | "
              f"{(key_bytes + out_bytes) / 1e6:.2f} | {(key_bytes + out_bytes) / t / 1e9:.0f} | {flops / t / 1e9:.0f} |")
    n = 4096 if args.quick else 1 << 20
    platform = "cuda" if dev.platform == "gpu" else dev.platform
    kernel = tq.kernels_available(platform) and _ffi.has_target(platform, "jax_tq_qjl_compress")
    times = bench_compress(n, 2 if args.quick else 4, reps, ("ffi", "xla") if kernel else ("xla",))
    print(f"\n| qjl_compress of {n} bf16 vectors, d {HEAD_DIM} | jax_tq (us) | XLA ref (us) | speedup |")
    print("|---|---:|---:|---:|")
    if kernel:
        print(f"| per call | {times['ffi'] * 1e6:.1f} | {times['xla'] * 1e6:.1f} | {times['xla'] / times['ffi']:.2f} |")
    else:
        print(f"| per call | no kernel on {platform} | {times['xla'] * 1e6:.1f} | - |")


if __name__ == "__main__":
    main()
