"""Where one decode step of SmolLM2-135M spends its GPU time: an uncompressed bf16 paged cache
(``preset="none"``: jnp code compiled by XLA) against the TurboQuant paged cache, per kernel name
(JAX profiler, CUPTI kernel events).

For each cache and context length: the wall time per step with one dispatch per step (steps
dispatched back to back), the same with all steps in one dispatch (``make_decode_loop``, as
examples/smollm2_wikitext.py times it), the GPU span of one step
(first kernel start to last kernel end), the summed kernel time, the kernel count, and the kernels
that take the most time. A step whose time per dispatch exceeds its GPU span is bound by the
dispatch (the jitted step takes ~270 parameter arrays and the caches as arguments), not by the GPU.

Usage (GPU machine; with ``--gguf`` the real weights, else SmolLM2-135M's shapes with random
weights: the step's time does not depend on their values, and the GGUF does not travel):
    python benchmarks/profile_model_step.py [--gguf /tmp/smollm2.gguf] --batch 64 --contexts 37,1024
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import jax
import jax.numpy as jnp

import device_time
from flax import nnx

from jax_tq.models import LlamaConfig, llama, load_smollm2


#: Steps of one timed decode loop (the caches have room for them after the context).
LOOP_STEPS = 16


def paged_step_fn(model, cfg, batch, context, k_bits, v_bits, page_size=16):
    """(step(), loop(n)) at `context` cached tokens per sequence (the empty cache's zero codes are
    fine for timing: the kernels' work does not depend on the values); k_bits = v_bits = None:
    uncompressed bfloat16 pages."""
    n_pages = -(-(context + LOOP_STEPS) // page_size)
    caches = llama.init_caches(cfg, k_bits, v_bits, batch * n_pages, page_size, 0, "haar", dtype=jnp.bfloat16)
    tables = jnp.arange(batch * n_pages, dtype=jnp.int32).reshape(batch, n_pages)
    step = llama.make_decode_step(model)
    tok = jnp.zeros((batch,), jnp.int32)
    pos = jnp.full((batch,), context, jnp.int32)
    lens = pos + 1
    state = {"caches": caches}
    loop = llama.make_decode_loop(model)

    def run():
        logits, state["caches"] = step(state["caches"], tok, pos, tables, lens)
        return logits

    def run_loop(n):
        tokens, state["caches"] = loop(state["caches"], tok, pos, tables, lens, n)
        return tokens

    return run, run_loop


def host_ms_per_step(run, steps=20):
    run().block_until_ready()
    t0 = time.perf_counter()
    for _ in range(steps):
        out = run()
    out.block_until_ready()
    return 1e3 * (time.perf_counter() - t0) / steps


def loop_ms_per_step(run_loop, steps=LOOP_STEPS, repeats=3):
    run_loop(steps).block_until_ready()  # compiles
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run_loop(steps).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times) / steps


def profile(name, fns, top):
    run, run_loop = fns
    host = host_ms_per_step(run)
    looped = loop_ms_per_step(run_loop)
    runs = device_time.traced_runs(lambda: run().block_until_ready(), repeats=3)
    if runs is None:
        print(f"| {name} | {host:.2f} | {looped:.2f} | n/a | n/a | n/a |")
        return
    span = statistics.median(device_time.span_us(r) for r in runs) / 1e3
    busy = statistics.median(sum(e["dur"] for e in r) for r in runs) / 1e3
    count = statistics.median(len(r) for r in runs)
    print(f"| {name} | {host:.2f} | {looped:.2f} | {span:.2f} | {busy:.2f} | {count:.0f} |")
    by_name = defaultdict(list)
    for r in runs:
        totals = defaultdict(float)
        for e in r:
            totals[str(e.get("name", ""))] += e["dur"]
        for k, v in totals.items():
            by_name[k].append(v)
    ranked = sorted(((statistics.median(v) / 1e3, k) for k, v in by_name.items()), reverse=True)
    for ms, k in ranked[:top]:
        print(f"|   {k[:90]} | | | | {ms:.3f} | |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--contexts", default="37,1024")
    ap.add_argument("--bits", default="4:4")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    kb, vb = (int(x) for x in args.bits.split(":"))
    if args.gguf is None:
        cfg = LlamaConfig()
        model = llama.Llama(cfg, dtype=jnp.dtype(args.dtype), rngs=nnx.Rngs(0))
    else:
        model, _, cfg = load_smollm2(args.gguf, dtype=jnp.dtype(args.dtype))
    print(f"jax {jax.__version__}, {jax.devices()}, batch {args.batch}, {args.dtype} model\n")
    print("| step | ms/step, one dispatch per step | ms/step, one loop | GPU span ms | kernel ms | kernels |")
    print("|---|---:|---:|---:|---:|---:|")
    for context in (int(c) for c in args.contexts.split(",")):
        profile(f"uncompressed bf16 paged, context {context}",
                paged_step_fn(model, cfg, args.batch, context, None, None), args.top)
        profile(f"K{kb}V{vb} paged, context {context}",
                paged_step_fn(model, cfg, args.batch, context, kb, vb), args.top)


if __name__ == "__main__":
    main()
