"""Decode and cache-write time of the cache presets (fitted scales + 64-token window) against the plain
codecs of the same bits, and cuDNN on a bf16 cache, on one GPU.

Decode: each implementation as a jitted chain of N dependent calls (q_{i+1} = q_i + 1e-3 * out_i)
over 3 rotating input sets (so L2 does not hold them), host-timed end to end and divided by N: the
method of the decode targets' harness. The presets' windows hold their sequences' last 64 tokens
(read every call); bytes per call: pages + window + q + output. Write: one decode step's write of
`num_seqs` tokens (K and V, pages and window), and a prefill write of 8192 tokens, chained the same way;
with --kernel-time, the write's kernels' summed duration per call instead (GPU kernel events: no
launch gaps, the number that tells two write kernels apart).
32 / 8 heads, head_dim 128, page_size 16, bf16 queries; Hadamard codecs (the presets' rotation).

Usage: python benchmarks/bench_format.py [--shapes 32x8192,1x32768] [--bits 4,3,2] [--tokens ...] [--kernel-time]
Prints markdown tables.
"""
from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

import device_time
import jax_tq as tq

N, COPIES = 24, 3
HQ, HKV, D, P = 32, 8, 128, 16


def seconds_per_call(fn, *args, reps=7):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) / N


def copy_bandwidth():
    x = jnp.full((1 << 30,), 1.5, jnp.float32)
    double = jax.jit(lambda a: a * 2.0)
    return 2 * x.nbytes / (seconds_per_call(double, x) * N)


def decode_chain(call):
    def run(q0, sets):
        q, acc = q0, 0.0
        for i in range(N):
            out = call(q, *sets[i % len(sets)])
            q = q + (1e-3 * out).astype(q.dtype)
            acc = acc + out[0, 0, 0].astype(jnp.float32)
        return acc
    return jax.jit(run)


def filled_caches(B, S, bits, preset):
    """COPIES caches of B sequences of S tokens (random bf16 K / V written through write_cache) and
    their tables and lengths; the bytes one decode call reads (pools + window)."""
    pages = -(-S // P)
    if preset:
        create = functools.partial(tq.PagedKVCache.create, preset=f"k{bits}v{bits}", head_dim=D, num_windows=B)
    else:
        codecs = (tq.TurboQuant(D, bits, 1, "hadamard"), tq.TurboQuant(D, bits, 2, "hadamard"))
        create = functools.partial(tq.PagedKVCache.create, k_codec=codecs[0], v_codec=codecs[1])
    write = jax.jit(tq.write_cache, donate_argnums=0)
    sets = []
    for c in range(COPIES):
        cache = create(num_pages=B * pages, page_size=P, num_kv_heads=HKV)
        tables = np.random.default_rng(c).permutation(B * pages).reshape(B, pages).astype(np.int32)
        key = jax.random.PRNGKey(7 + c)
        step = max(1, (1 << 18) // S)  # sequences per write call
        for b0 in range(0, B, step):
            rows = np.arange(b0, min(B, b0 + step))
            pos = np.tile(np.arange(S), len(rows))
            seq = np.repeat(rows, S)
            slots = jnp.asarray(tables[seq, pos // P] * P + pos % P, jnp.int32)
            key, k1, k2 = jax.random.split(key, 3)
            k = jax.random.normal(k1, (len(pos), HKV, D), jnp.bfloat16)
            v = jax.random.normal(k2, (len(pos), HKV, D), jnp.bfloat16)
            window = None
            if preset:
                window = tq.window_slot_mapping(seq.astype(np.int32), pos.astype(np.int32),
                                                np.full(len(pos), S, np.int32), cache.window)
            cache = write(cache, k, v, slots, window)
        sets.append((cache, jnp.asarray(tables), jnp.full((B,), S, jnp.int32)))
    cache = sets[0][0]
    pools = cache.k_codes.nbytes + cache.k_norms.nbytes + cache.v_codes.nbytes + cache.v_norms.nbytes
    return sets, pools + cache.window_bytes()


def decode_rows(shapes, bits_list, bandwidth):
    print("\n## Decode, us per call (chain of 24, 3 input sets; bf16 queries, 32 / 8 heads, head_dim 128)\n")
    head = "| num_seqs x seq_len | cuDNN bf16 |"
    for bits in bits_list:
        head += f" K{bits}V{bits} plain | k{bits}v{bits} preset | preset / plain |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for B, S in shapes:
        q0 = jax.random.normal(jax.random.PRNGKey(1), (B, HQ, D), jnp.bfloat16)
        dense = [(jax.random.normal(jax.random.PRNGKey(10 + c), (B, S, HKV, D), jnp.bfloat16),
                  jax.random.normal(jax.random.PRNGKey(20 + c), (B, S, HKV, D), jnp.bfloat16)) for c in range(COPIES)]
        cudnn = functools.partial(jax.nn.dot_product_attention, implementation="cudnn")
        t_dense = seconds_per_call(decode_chain(lambda q, k, v: cudnn(q[:, None], k, v)[:, 0]), q0, dense)
        del dense
        cells = [f"{B} x {S}", f"{t_dense * 1e6:.1f}"]
        for bits in bits_list:
            times = []
            for preset in (False, True):
                sets, nbytes = filled_caches(B, S, bits, preset)
                t = seconds_per_call(decode_chain(tq.paged_decode), q0, sets)
                times.append(t)
                cells.append(f"{t * 1e6:.1f} ({t_dense / t:.2f}x cuDNN, {100 * nbytes / t / bandwidth:.0f}% copy bw)")
                del sets
            cells.append(f"{times[1] / times[0]:.3f}")
        print("| " + " | ".join(cells) + " |", flush=True)


def write_chain(num_tokens):
    def run(cache, ks, vs, slots, window):
        for i in range(N):
            cache = tq.write_cache(cache, ks[i % COPIES], vs[i % COPIES], slots[i % COPIES],
                                   None if window is None else window[i % COPIES])
        return cache.k_norms[0, 0, 0]
    return jax.jit(run)


def write_kernel_seconds(chain, *args):
    """Summed duration per call of the chain's jax_tq kernels (device_time's kernel events), or None
    without them (no GPU)."""
    jax.block_until_ready(chain(*args))
    kernels = device_time.kernel_seconds_by_name(lambda: jax.block_until_ready(chain(*args)), N)
    if not kernels:
        return None
    return sum(t for name, t in kernels.items() if "jax_tq" in name)


def write_rows(bits_list, token_counts, kernel_time=False):
    what = "the write kernels' time" if kernel_time else "chain of 24"
    print(f"\n## Cache write, us per call (K and V; {what})\n")
    print("| tokens written | " + " | ".join(f"K{b}V{b} plain | k{b}v{b} preset" for b in bits_list) + " |")
    print("|" + "---|" * (1 + 2 * len(bits_list)))
    for num_tokens in token_counts:
        cells = [f"{num_tokens} ({'decode step' if num_tokens <= 128 else 'prefill'})"]
        decode_step = num_tokens <= 128
        pages = max(64, 2 * num_tokens // P)  # the chain's one copy of the pools per run: < 0.5 us per call
        for bits in bits_list:
            for preset in (False, True):
                if preset:
                    cache = tq.PagedKVCache.create(num_pages=pages, page_size=P, num_kv_heads=HKV,
                                                   preset=f"k{bits}v{bits}", head_dim=D,
                                                   num_windows=num_tokens if decode_step else 1)
                else:
                    cache = tq.PagedKVCache.create(num_pages=pages, page_size=P, num_kv_heads=HKV,
                                                   k_codec=tq.TurboQuant(D, bits, 1, "hadamard"),
                                                   v_codec=tq.TurboQuant(D, bits, 2, "hadamard"))
                key = jax.random.PRNGKey(bits)
                ks = [jax.random.normal(jax.random.fold_in(key, c), (num_tokens, HKV, D), jnp.bfloat16)
                      for c in range(COPIES)]
                vs = [x * 0.5 for x in ks]
                slots = [jnp.asarray(np.random.default_rng(c).permutation(pages * P)[:num_tokens], jnp.int32)
                         for c in range(COPIES)]
                window = None
                if preset:  # a decode step: one token per sequence; a prefill: one sequence's last 64
                    ids = np.arange(num_tokens) if decode_step else np.zeros(num_tokens)
                    pos = np.full(num_tokens, 100) if decode_step else np.arange(num_tokens)
                    lens = pos + 1 if decode_step else np.full(num_tokens, num_tokens)
                    window = [tq.window_slot_mapping(ids.astype(np.int32), pos.astype(np.int32), lens.astype(np.int32),
                                                     cache.window)] * COPIES
                args = (cache, ks, vs, slots, window)
                t = write_kernel_seconds(write_chain(num_tokens), *args) if kernel_time else None
                t = seconds_per_call(write_chain(num_tokens), *args) if t is None else t
                cells.append(f"{t * 1e6:.1f}")
        print("| " + " | ".join(cells) + " |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="32x8192,1x32768", help="decode shapes; empty: the writes only")
    parser.add_argument("--bits", default="4,3,2")
    parser.add_argument("--tokens", default="32,128,8192", help="tokens per timed write (8 KV heads, K and V)")
    parser.add_argument("--kernel-time", action="store_true",
                        help="writes: the kernels' summed duration per call (GPU) instead of the host-timed chain")
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    bits_list = [int(b) for b in args.bits.split(",")]
    bandwidth = copy_bandwidth()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; copy bandwidth (read + write) "
          f"{bandwidth / 1e9:.0f} GB/s")
    if shapes:
        decode_rows(shapes, bits_list, bandwidth)
    write_rows(bits_list, [int(t) for t in args.tokens.split(",")], args.kernel_time)


if __name__ == "__main__":
    main()
