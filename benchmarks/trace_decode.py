"""Device timeline of one decode call inside the benchmark's chain (bench_decode.py): every GPU
kernel of a call with its duration and the idle gap before it, from a JAX profiler trace (CUPTI).

It answers where a call's time goes beyond the split kernel: the XLA ops around it (rotations,
NaN mask, cast), the combine, the chain's own add / sum, and the launch gaps between them.

Usage: python benchmarks/trace_decode.py [32x8192 ...]   (a GPU; prints one table per shape)
"""
from __future__ import annotations

import glob
import gzip
import json
import os
import sys
import tempfile

import jax
import jax.numpy as jnp

import jax_tq as tq
from bench_decode import make_tq_inputs

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


def gpu_kernel_events(trace_dir):
    """The trace's GPU events (perfetto JSON written by jax.profiler), sorted by start time."""
    paths = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
        raise RuntimeError(f"no perfetto trace under {trace_dir}")
    with gzip.open(paths[0], "rt") as f:
        events = json.load(f)["traceEvents"]
    gpu_pids = {e["pid"] for e in events
                if e.get("ph") == "M" and e.get("name") == "process_name"
                and "GPU" in str(e.get("args", {}).get("name", ""))}
    # the GPU process also holds derived lines ("XLA Ops", "XLA Modules") over the same time: keep
    # the stream lines, where the kernels are
    streams = {(e["pid"], e.get("tid")) for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name" and e.get("pid") in gpu_pids
               and "stream" in str(e.get("args", {}).get("name", "")).lower()}
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu_pids and e.get("dur", 0) > 0
               and (not streams or (e["pid"], e.get("tid")) in streams)]
    names = sorted({str(e.get("args", {}).get("name", "")) for e in events if e.get("ph") == "M"})
    return sorted(kernels, key=lambda e: e["ts"]), names


def one_shape(num_seqs, seq_len):
    (q, cache, tables, lens), = make_tq_inputs(num_seqs, seq_len, jax.random.PRNGKey(0), 1)
    chain = chain_fn(INNER)
    for _ in range(3):
        jax.block_until_ready(chain(q, cache, tables, lens))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            jax.block_until_ready(chain(q, cache, tables, lens))
        kernels, process_names = gpu_kernel_events(trace_dir)
    if not kernels:
        print(f"no GPU kernel events; trace processes: {process_names}")
        return
    # Calls are delimited by the split kernel; show the kernels from one split kernel's predecessor
    # set (the middle call) to the next, then per-call averages over the whole chain.
    split_idx = [i for i, e in enumerate(kernels) if "paged_decode" in e["name"] and "combine" not in e["name"]]
    span = (kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]) / INNER
    busy = sum(e["dur"] for e in kernels) / INNER
    print(f"== {num_seqs}x{seq_len}: {len(kernels)} kernels in {INNER} calls; per call: span {span:.1f} us, "
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
    for spec in sys.argv[1:] or ["32x8192", "1x32768"]:
        num_seqs, seq_len = (int(v) for v in spec.split("x"))
        try:
            one_shape(num_seqs, seq_len)
        except Exception as err:  # noqa: BLE001 - a profiler without CUPTI must not end the run
            print(f"== {spec}: trace failed: {type(err).__name__}: {str(err)[:300]}")


if __name__ == "__main__":
    main()
