"""Fresh prompts: cuDNN's causal attention alone against ``jax_tq.prompt_attention`` (the same
attention plus the cache write), as one jitted program of chained calls with the cache donated.

Per shape and program it prints, for a 4-call program, the host clock per call (median of 7 runs),
the GPU span and kernel time per call (JAX profiler, CUPTI) and the first three calls kernel by
kernel (start, duration, stream): which kernels run, in what order, and the launch gaps between
them. The two 24-call programs run alternately (21 pairs: drifts of the GPU's clock or memory
placement reach both alike): each one's host median per call, and a "ratio" line with
prompt_attention's time over cuDNN's alone, the median of the pairs' ratios and their range.

Usage: PYTHONPATH=benchmarks python benchmarks/trace_prompt.py [1x2048 8x1024 ...] (num_seqs x
prompt_len; a GPU with cuDNN, elsewhere XLA's attention; 32 / 8 heads, head_dim 128, K4V4
Hadamard, bf16 queries, as bench_prefill.py)
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

import jax_tq as tq
import bench_prefill as bp
import device_time as dt

REPS = 7
PAIRS = 21


def programs(num_seqs, seq_len, inner):
    """(cache, queries, {name: fn(cache, queries) -> (outs, cache)}) at one shape."""
    key = jax.random.PRNGKey(0)
    cache, tables, k, v = bp.compressed_setup(num_seqs, seq_len, key)
    qs = [jax.random.normal(jax.random.fold_in(key, 100 + i), (num_seqs, seq_len, bp.HEADS, bp.HEAD_DIM),
                            jnp.bfloat16) for i in range(inner)]
    kd = k.reshape(num_seqs, seq_len, bp.KV_HEADS, bp.HEAD_DIM)
    vd = v.reshape(num_seqs, seq_len, bp.KV_HEADS, bp.HEAD_DIM)

    impl = "cudnn" if jax.default_backend() == "gpu" else None  # (XLA's code elsewhere: a smoke run)

    def cudnn(cache, qs):
        return [jax.nn.dot_product_attention(q, kd, vd, is_causal=True, implementation=impl) for q in qs], cache

    def prompt(cache, qs):
        outs = []
        for q in qs:
            out, cache = tq.prompt_attention(q, kd, vd, cache, tables)
            outs.append(out)
        return outs, cache
    return cache, qs, {"cudnn": cudnn, "prompt_attention": prompt}


def runner(fn, cache, qs):
    """A blocking run() of fn jitted over its own copy of the cache (donated, so updated in place)."""
    f = jax.jit(fn, donate_argnums=(0,))
    state = [jax.tree.map(jnp.copy, cache)]

    def run():
        out = f(state[0], qs)
        state[0] = out[1]
        jax.block_until_ready(out)
    run()
    run()
    return run


def report(shape, name, inner, run):
    times = []
    for _ in range(REPS):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    line = f"{shape} {name:17s} inner {inner:2d}: host {statistics.median(times) / inner * 1e6:7.1f} us/call"
    runs = dt.traced_runs(run, 3)
    if not runs:
        print(line, flush=True)
        return
    middle = sorted(runs, key=dt.span_us)[1]
    t0 = min(e["ts"] for e in middle)
    print(f"{line}; span {dt.span_us(middle) / inner:.1f} us/call, kernels "
          f"{sum(e['dur'] for e in middle) / inner:.1f}")
    for e in middle[: 3 * len(middle) // inner + 2]:
        print(f"    {e['ts'] - t0:8.1f} +{e['dur']:7.1f}  tid {str(e.get('tid'))[-6:]:>6s}  {str(e.get('name'))[:70]}")


def report_pairs(shape, inner, runs):
    """The programs of ``runs`` ({name: run}) run alternately PAIRS times: each one's host median per
    call, and the median (range) of the later program's time over the first's."""
    times = {name: [] for name in runs}
    for _ in range(PAIRS):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    for name, ts in times.items():
        print(f"{shape} {name:17s} inner {inner:2d}: host {statistics.median(ts) / inner * 1e6:7.1f} us/call",
              flush=True)
    base, other = times.values()
    ratios = sorted(b / a for a, b in zip(base, other))
    names = list(times)
    print(f"{shape} ratio {names[1]} / {names[0]}, inner {inner}: {statistics.median(ratios):.3f} "
          f"(range {ratios[0]:.3f} .. {ratios[-1]:.3f} over {PAIRS} pairs)", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shapes", nargs="*", default=["1x2048", "8x1024"], help="num_seqs x prompt_len")
    args = ap.parse_args()
    for shape in args.shapes:
        num_seqs, seq_len = (int(x) for x in shape.split("x"))
        for inner in (4, 24):
            cache, qs, progs = programs(num_seqs, seq_len, inner)
            runs = {name: runner(fn, cache, qs) for name, fn in progs.items()}
            if inner == 24:
                report_pairs((num_seqs, seq_len), inner, runs)
            else:
                for name, run in runs.items():
                    report((num_seqs, seq_len), name, inner, run)
            del cache, qs, runs


if __name__ == "__main__":
    main()
