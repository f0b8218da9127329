"""Prefill benchmark (32 query / 8 KV heads, head_dim 128, page_size 16, K4V4 Hadamard, bf16 queries):

* ``paged_prefill``: causal attention of a chunk of new rows over the compressed pages (every token,
  the chunk's own included, read compressed: chunked prefill, prefix reuse, speculative verification);
* ``decode rows``: the same rows as one-query ``paged_decode`` calls (per-row block tables);
* ``cuDNN + write``: a fresh prompt as a serving engine runs it (``jax_tq.prompt_attention``'s
  composition): bf16 causal flash attention over the prompt's own K / V
  (``jax.nn.dot_product_attention``, cuDNN) plus one ``write_cache`` of its K / V into the pages;
* ``prompt_attention``: the same through ``jax_tq.prompt_attention`` (no ``prompt_lens``: no masks), and
  ``padded``: with ``prompt_lens`` (its padding masks: passes over q, k, v and the output);
* ``cuDNN``: that attention alone (the reference), and XLA's bf16 attention.

Shapes: (num_seqs, new rows, cached tokens before them). Each implementation's FLOP rate is the
causal attention's 4 * d * heads * (visible tokens summed over rows) per second; for a chunk after
cached tokens the cuDNN column times the whole (cached + new) causal prompt, whose rate is the
reference. Timing: one jitted program of ``inner`` calls on distinct queries, median GPU span per call
(profiler kernel events, benchmarks/device_time.py); host clock without kernel events (CPU).
``--breakdown`` lists each program's longest kernels (summed duration per call, mean of 5 traced runs) after its row.
Usage: python benchmarks/bench_prefill.py [--quick] [--no-decode-rows] [--breakdown] [--shapes ...]
"""
from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

import jax_tq as tq

import device_time

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
SHAPES = ((1, 2048, 0), (1, 8192, 0), (8, 1024, 0), (1, 2048, 6144))  # (num_seqs, new rows, cached)


def codecs():
    return (tq.TurboQuant(HEAD_DIM, 4, rotation="hadamard"), tq.TurboQuant(HEAD_DIM, 4, seed=1, rotation="hadamard"))


def compressed_setup(num_seqs, seq_len, key):
    """A K4V4 cache holding every sequence's seq_len tokens (sequence s on pages [s * pages, (s + 1) * pages))."""
    pages = -(-seq_len // PAGE)
    k_codec, v_codec = codecs()
    cache = tq.PagedKVCache.create(num_pages=num_seqs * pages, page_size=PAGE, num_kv_heads=KV_HEADS,
                                   k_codec=k_codec, v_codec=v_codec)
    tokens = num_seqs * seq_len
    k = jax.random.normal(key, (tokens, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    v = jax.random.normal(jax.random.fold_in(key, 1), (tokens, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    slots = slot_mapping(num_seqs, seq_len, pages)
    cache = jax.jit(tq.write_cache)(cache, k, v, slots)
    tables = jnp.asarray(np.arange(num_seqs * pages).reshape(num_seqs, pages), jnp.int32)
    return cache, tables, k, v


def slot_mapping(num_seqs, seq_len, pages):
    seq = np.repeat(np.arange(num_seqs), seq_len)
    pos = np.tile(np.arange(seq_len), num_seqs)
    return jnp.asarray(seq * pages * PAGE + pos, jnp.int32)


def causal_flops(num_seqs, new, cached):
    """4 d H x the (row, visible token) pairs of causal attention: rows at positions cached .. cached + new - 1."""
    pairs = new * cached + new * (new + 1) / 2
    return 4.0 * HEAD_DIM * HEADS * num_seqs * pairs


BREAKDOWN = {}   # program name -> {kernel name: seconds per call}, filled with --breakdown


def timed(fn, args, inner, reps, name=None, donate=False):
    """Device time per call of ``fn(*args)`` (``inner`` calls per run). donate: args[0] is a cache that
    ``fn`` returns second and that is donated to it (updated in place, as a model's prefill does;
    without donation every run would copy the pools first)."""
    f = jax.jit(fn, donate_argnums=(0,) if donate else ())
    state = list(args)

    def run():
        out = f(*state)
        if donate:
            state[0] = out[1]
        jax.block_until_ready(out)
    if name is not None:
        run()   # compiled (and autotuned) before the trace
        BREAKDOWN[name] = device_time.kernel_seconds_by_name(run, inner)
    return device_time.seconds_per_call(run, inner, reps)


def print_breakdown(top=8):
    for name, kernels in BREAKDOWN.items():
        if not kernels:
            continue
        total = sum(kernels.values())
        print(f"  {name}: kernels {total * 1e6:.1f} us per call; longest:")
        for kernel, seconds in sorted(kernels.items(), key=lambda kv: -kv[1])[:top]:
            print(f"    {seconds * 1e6:8.1f} us  {kernel[:110]}")
    BREAKDOWN.clear()


def bench(num_seqs, new, cached, inner, reps, decode_rows=True, breakdown=False):
    key = jax.random.PRNGKey(0)
    seq_len = cached + new
    cache, tables, k, v = compressed_setup(num_seqs, seq_len, key)
    tokens = num_seqs * new
    qs = [jax.random.normal(jax.random.fold_in(key, 10 + i), (tokens, HEADS, HEAD_DIM), jnp.bfloat16)
          for i in range(inner)]
    lens = jnp.full((num_seqs,), seq_len, jnp.int32)
    starts = jnp.asarray(np.arange(num_seqs + 1) * new, jnp.int32)
    times = {"prefill": timed(lambda qs: [tq.paged_prefill(q, cache, tables, lens, starts) for q in qs], (qs,),
                              inner, reps, "paged_prefill" if breakdown else None)}
    if decode_rows:
        row_tables = jnp.repeat(tables, new, axis=0)
        row_lens = jnp.asarray(np.tile(np.arange(cached + 1, seq_len + 1), num_seqs), jnp.int32)
        times["decode rows"] = timed(lambda qs: [tq.paged_decode(q, cache, row_tables, row_lens) for q in qs], (qs,),
                                     inner, reps)
    # The reference: bf16 causal attention over the whole (cached + new) prompt.
    full_qs = [jax.random.normal(jax.random.fold_in(key, 100 + i), (num_seqs, seq_len, HEADS, HEAD_DIM), jnp.bfloat16)
               for i in range(inner)]
    kd = k.reshape(num_seqs, seq_len, KV_HEADS, HEAD_DIM)
    vd = v.reshape(num_seqs, seq_len, KV_HEADS, HEAD_DIM)
    for impl in ("xla", "cudnn"):
        def dense(qs, impl=impl):
            return [jax.nn.dot_product_attention(q, kd, vd, is_causal=True, implementation=impl) for q in qs]
        try:
            times[impl] = timed(dense, (full_qs,), inner, reps)
        except Exception as err:  # cuDNN absent (CPU) or refusing the shape
            print(f"  {impl}: unavailable ({type(err).__name__})")
            times[impl] = float("nan")
    if cached == 0:  # a fresh prompt: cuDNN over its own K / V plus the fused compress-and-write
        slots = slot_mapping(num_seqs, seq_len, -(-seq_len // PAGE))

        def fresh(cache, qs):
            outs = []
            for q in qs:
                outs.append(jax.nn.dot_product_attention(q, kd, vd, is_causal=True, implementation="cudnn"))
                cache = tq.write_cache(cache, k, v, slots)
            return outs, cache
        def prompt(cache, qs, prompt_lens=None):  # the library's call for it
            outs = []
            for q in qs:
                out, cache = tq.prompt_attention(q, kd, vd, cache, tables, prompt_lens)
                outs.append(out)
            return outs, cache
        padded = functools.partial(prompt, prompt_lens=lens)  # with its padding masks
        for name, fn in (("cudnn + write", fresh), ("prompt_attention", prompt), ("prompt_attention padded", padded)):
            try:
                own = jax.tree.map(jnp.copy, cache)   # donated: each program writes its own copy
                times[name] = timed(fn, (own, full_qs), inner, reps, name if breakdown else None, donate=True)
            except Exception as err:
                print(f"  {name}: unavailable ({type(err).__name__})")
                times[name] = float("nan")
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one small shape (a CPU smoke run)")
    ap.add_argument("--no-decode-rows", action="store_true", help="skip the per-row paged_decode column")
    ap.add_argument("--breakdown", action="store_true", help="each program's longest kernels after its row")
    ap.add_argument("--shapes", default=None,
                    help="comma-separated num_seqs x new x cached, e.g. 1x128x8064,1x512x7680 (default: the issue's)")
    args = ap.parse_args()
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}")
    shapes = ((2, 64, 0), (1, 32, 64)) if args.quick else SHAPES
    if args.shapes:
        shapes = tuple(tuple(int(n) for n in s.split("x")) for s in args.shapes.split(","))
    inner, reps = (2, 3) if args.quick else (4, 10)
    print(f"\n{HEADS}/{KV_HEADS} heads, d {HEAD_DIM}, K4V4 Hadamard, bf16 queries; time (us) and TFLOP/s of causal "
          "attention; ratio = jax_tq paged_prefill's TFLOP/s over cuDNN's")
    print("| (num_seqs, new rows, cached) | paged_prefill | TFLOP/s | ratio | decode rows | cuDNN + write "
          "| / cuDNN | prompt_attention | / cuDNN | padded | / cuDNN | XLA bf16 | cuDNN bf16 (new + cached) "
          "| cuDNN TFLOP/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for shape in shapes:
        t = bench(*shape, inner, reps, decode_rows=not args.no_decode_rows, breakdown=args.breakdown)
        ours = causal_flops(*shape) / t["prefill"] / 1e12
        ref = causal_flops(shape[0], shape[1] + shape[2], 0) / t["cudnn"] / 1e12
        write, prompt, padded = (t.get(n, float("nan")) for n in ("cudnn + write", "prompt_attention",
                                                                  "prompt_attention padded"))
        print(f"| {shape} | {t['prefill'] * 1e6:.1f} | {ours:.1f} | {ours / ref:.2f} | "
              f"{t.get('decode rows', float('nan')) * 1e6:.1f} | {write * 1e6:.1f} | {write / t['cudnn']:.3f} | "
              f"{prompt * 1e6:.1f} | {prompt / t['cudnn']:.3f} | {padded * 1e6:.1f} | {padded / t['cudnn']:.3f} | "
              f"{t['xla'] * 1e6:.1f} | {t['cudnn'] * 1e6:.1f} | {ref:.1f} |", flush=True)
        print_breakdown()


if __name__ == "__main__":
    main()
