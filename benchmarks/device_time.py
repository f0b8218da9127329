"""Device time of a jitted program from the GPU timeline (JAX profiler, CUPTI kernel events).

A host clock around one dispatch of a short program also counts the dispatch itself (measured at
~300 us for a program of 48 kernels on the H200, against ~110 us per decode call), so the
benchmarks report, next to host medians, the span of the program's kernels on the GPU: first
kernel start to last kernel end, per repetition, median over repetitions.

Used by bench_decode.py (``--device-time``) and trace_decode.py. Without a GPU (or CUPTI) there
are no kernel events and the functions return None. Under the profiler XLA launches the kernels of
its command buffers (CUDA graphs) one by one, so launch gaps count in the span; in the decode
programs traced so far the GPU had no idle gap inside a program (trace_decode.py prints it).
"""
from __future__ import annotations

import glob
import gzip
import json
import os
import statistics
import tempfile
import time

import jax

#: Kernels more than this far apart (us) belong to different repetitions (the host waits between
#: repetitions; kernels of one program follow each other within a few us).
RUN_GAP_US = 1000.0


def gpu_kernel_events(trace_dir):
    """The perfetto trace's GPU kernel events (dicts with name, ts, dur in us) sorted by start, and
    the names of the trace's processes (for diagnostics)."""
    paths = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
        return [], []
    with gzip.open(paths[0], "rt") as f:
        events = json.load(f)["traceEvents"]
    meta = [e for e in events if e.get("ph") == "M"]
    gpu_pids = {e["pid"] for e in meta
                if e.get("name") == "process_name" and "GPU" in str(e.get("args", {}).get("name", ""))}
    # the GPU process also holds derived lines ("XLA Ops", "XLA Modules") over the same time: keep
    # the stream lines, where the kernels are
    streams = {(e["pid"], e.get("tid")) for e in meta
               if e.get("name") == "thread_name" and e.get("pid") in gpu_pids
               and "stream" in str(e.get("args", {}).get("name", "")).lower()}
    kernels = [e for e in events if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams
               and e.get("dur", 0) > 0]
    names = sorted({str(e.get("args", {}).get("name", "")) for e in meta if e.get("name") == "process_name"})
    return sorted(kernels, key=lambda e: e["ts"]), names


def split_runs(kernels, gap_us=RUN_GAP_US):
    """Kernel events grouped into repetitions: a new group starts after an idle gap > gap_us."""
    runs, latest_end = [], float("-inf")
    for e in kernels:
        if runs and e["ts"] - latest_end <= gap_us:
            runs[-1].append(e)
        else:
            runs.append([e])
            latest_end = float("-inf")
        latest_end = max(latest_end, e["ts"] + e["dur"])
    return runs


def span_us(run):
    """First kernel start to last kernel end of one repetition, in us."""
    return max(e["ts"] + e["dur"] for e in run) - min(e["ts"] for e in run)


def _traced_kernels(run, repeats):
    """(GPU kernel events, process names) of ``repeats`` calls of ``run()``, or None (the reason
    printed) when the trace cannot be taken."""
    try:
        with tempfile.TemporaryDirectory() as trace_dir:
            with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
                for _ in range(repeats):
                    run()
                    time.sleep(0.005)  # an idle gap that separates the repetitions on the timeline
            return gpu_kernel_events(trace_dir)
    except Exception as err:  # noqa: BLE001 - a failed trace must not lose the host timings
        print(f"  device time unavailable: {type(err).__name__}: {str(err)[:200]}")
        return None


def traced_runs(run, repeats=5):
    """Kernel events of ``repeats`` calls of ``run()`` (which must block until its results are
    ready), one list per repetition; None (with the reason printed) when the trace cannot be taken,
    has no GPU kernel events, or its repetitions cannot be told apart."""
    traced = _traced_kernels(run, repeats)
    if traced is None:
        return None
    kernels, processes = traced
    if not kernels:
        if any("GPU" in name for name in processes):
            print(f"  device time unavailable: no kernel events on GPU stream lines ({processes})")
        return None
    runs = split_runs(kernels)
    if len(runs) != repeats:
        print(f"  device time unavailable: {len(runs)} groups of kernels for {repeats} repetitions")
        return None
    return runs


def device_seconds_per_call(run, calls_per_run, repeats=5):
    """Median GPU span of one ``run()`` divided by ``calls_per_run``, in seconds; None without GPU
    kernel events (or when the repetitions could not be told apart)."""
    runs = traced_runs(run, repeats)
    if runs is None:
        return None
    return statistics.median(span_us(r) for r in runs) * 1e-6 / calls_per_run


def kernel_seconds_by_name(run, calls_per_run, repeats=5):
    """{kernel name: its summed duration per call, in seconds, over ``repeats`` traced ``run()``s}
    (a mean: the repetitions need not be told apart, so programs with host round trips inside, e.g.
    a conditional, are measured too); None without GPU kernel events."""
    traced = _traced_kernels(run, repeats)
    if traced is None or not traced[0]:
        return None
    kernels = traced[0]
    totals = {}
    for e in kernels:
        name = str(e.get("name", ""))
        totals[name] = totals.get(name, 0.0) + e["dur"] * 1e-6 / (repeats * calls_per_run)
    return totals


def median_longest_kernel_seconds(run, count, repeats=3):
    """Median duration, in seconds, of the ``count`` longest kernels of each traced ``run()``: the
    time of one pass of a loop of ``count`` identical passes, without the loop's bookkeeping
    (copies, predicate transfers); None without GPU kernel events."""
    runs = traced_runs(run, repeats)
    if runs is None:
        return None
    longest = [d for r in runs for d in sorted((e["dur"] for e in r), reverse=True)[:count]]
    return statistics.median(longest) * 1e-6


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__.splitlines()[0],
                            epilog="A helper module for the benchmarks: nothing to run on its own.").parse_args()


def seconds_per_call(run, inner, reps):
    """GPU span of one ``run()`` per call (``inner`` calls per run, after one warm-up run), or the
    host clock's median over ``reps`` runs per call where there are no GPU kernel events (CPU)."""
    import time

    run()
    dev = device_seconds_per_call(run, inner)
    if dev is not None:
        return dev
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / inner
