"""Decode-attention benchmark on one GPU: jax_tq paged decode (K4V4 TurboQuant cache) against bf16
attention through XLA (jax.nn.dot_product_attention implementation="xla"), cuDNN
(implementation="cudnn") and the Pallas GPU paged-attention kernel, plus a device copy for the
bandwidth ceiling.

Shapes: 32 query heads, 8 KV heads, head_dim 128, page_size 16, bf16 queries, one query token per
sequence, (num_seqs, seq_len) in (1, 32768), (8, 8192), (32, 8192), (64, 4096), (128, 2048).

Timing: each measured function is jitted as R chained calls over distinct input copies (each call's
queries depend on the sum of the previous call's output, so XLA cannot merge or overlap them; the copies
together exceed the 60 MB L2 several times, so no call finds its K/V in L2), timed with
block_until_ready and a host clock; the time per call is the median over many such runs divided by
R (the one dispatch per run is amortised over R calls). With --device-time also the GPU span of the
same program per call, from the profiler's kernel events (benchmarks/device_time.py). The chain's own
cost per call (the add, the sum, the amortised dispatch) is timed around an op that returns q
unchanged. Bytes counted: K/V bytes the op must read (codes + fp32 norms for jax_tq, bf16 K/V for the
others) + q + output.

Usage: python benchmarks/bench_decode.py [--quick] [--device-time] [--splits auto,1,2,4,8] [--shapes 32x8192,...]
       [--rotations haar,hadamard] [--heads 32:8] [--head-dim 128] [--bits 4:4] [--page-order random]
       [--variants none,soft_cap=50,sliding_window=4096,sinks,soft_cap=50+sliding_window=4096+sinks]
(--heads / --head-dim / --bits / --page-order: other configurations than the issue's, for exploration;
--variants: jax_tq with the attention variants too, each a '+'-joined set, auto splits; a sliding window's
bytes are its pages' only.)
Prints a markdown table at the end.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_tq as tq

import device_time

DEVICE_TIME = False  # --device-time: also the GPU span per call from a profiler trace

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16  # --heads, --head-dim change them
K_BITS, V_BITS = 4, 4  # --bits
SHAPES = ((1, 32768), (8, 8192), (32, 8192), (64, 4096), (128, 2048))
L2_BYTES = 60 * 2**20
ROTATE_BYTES = 4 * L2_BYTES  # the distinct copies of one benchmark's inputs add up to at least this
NAN = float("nan")
CHAIN_ROW = "benchmark chain alone (add + sum, no op)"
CHAIN_KERNEL = re.compile(r"fusion|reduce|wrapped|convert|copy|memset", re.IGNORECASE)  # XLA's kernels
ROTATIONS = ("haar", "hadamard")  # --rotations: the codecs' rotation kinds to time
PAGE_ORDER = "random"  # --page-order: jax_tq block tables a random permutation of the pool, or sequential
VARIANTS = ("none",)  # --variants: the attention variant sets timed for jax_tq


def parse_variant(spec: str) -> dict:
    """paged_decode keyword arguments of a --variants entry: 'none', or '+'-joined 'soft_cap=C',
    'sliding_window=W', 'sinks' (every head's sink logit 1.0)."""
    kwargs = {}
    for part in filter(None, spec.split("+")):
        name, _, value = part.partition("=")
        if name == "none":
            continue
        if name == "sinks":
            kwargs["sinks"] = np.ones((NUM_HEADS,), np.float32)
        elif name == "soft_cap":
            kwargs["soft_cap"] = float(value)
        elif name == "sliding_window":
            kwargs["sliding_window"] = int(value)
        else:
            raise SystemExit(f"--variants: unknown variant {part!r} (soft_cap=C, sliding_window=W, sinks, none)")
    return kwargs


def window_tokens(seq_len, sliding_window):
    """Tokens of the pages a query at position seq_len - 1 reads: those from its window's first page on."""
    if not sliding_window or sliding_window >= seq_len:
        return seq_len
    first_page = (seq_len - sliding_window) // PAGE_SIZE
    return min(seq_len, -(-seq_len // PAGE_SIZE) * PAGE_SIZE) - first_page * PAGE_SIZE


def time_calls(fn, arg_sets, inner=None, outer=15, warmup=2):
    """Median seconds per call of fn(*args), cycling over arg_sets inside one jitted program.

    The calls are chained: call i's first argument (the queries) gets ``0 * out_{i-1}[0]`` added, so
    XLA can neither merge identical calls (CSE) nor run them concurrently, and every call reads its
    K/V from HBM (the distinct sets together exceed L2, or one set alone does).
    """
    inner = inner or max(8, len(arg_sets))
    chain = chained(fn, inner)

    for _ in range(warmup):
        jax.block_until_ready(chain(arg_sets))
    times = []
    for _ in range(outer):
        t0 = time.perf_counter()
        jax.block_until_ready(chain(arg_sets))
        times.append((time.perf_counter() - t0) / inner)
    dev = None
    if DEVICE_TIME:
        dev = device_time.device_seconds_per_call(lambda: jax.block_until_ready(chain(arg_sets)), inner)
    return statistics.median(times), min(times), NAN if dev is None else dev


def chained(fn, inner):
    """One jitted program of ``inner`` calls of fn over the argument sets (see time_calls)."""
    @jax.jit
    def chain(sets):
        carry = jnp.zeros((), jnp.float32)
        for i in range(inner):
            args = list(sets[i % len(sets)])
            args[0] = args[0] + (carry * 0).astype(args[0].dtype)
            carry = jnp.sum(fn(*args).astype(jnp.float32))  # outputs are small; a slice could be sunk into XLA ops
        return carry

    return chain


def kernel_breakdown(fn, arg_sets):
    """{kernel name: device seconds per call} of the same chained program as time_calls."""
    inner = max(8, len(arg_sets))
    chain = chained(fn, inner)
    jax.block_until_ready(chain(arg_sets))
    return device_time.kernel_seconds_by_name(lambda: jax.block_until_ready(chain(arg_sets)), inner)


def op_kernel_seconds(fn, arg_sets, label):
    """Device seconds per call of ``fn``'s own kernels in the chained program: every kernel but XLA's
    fusions and reductions (the chain's add on q and sum of the output)."""
    by_name = kernel_breakdown(fn, arg_sets)
    if not by_name:
        return NAN
    print(f"  {label}:")
    for name, sec in sorted(by_name.items(), key=lambda kv: -kv[1]):
        print(f"    kernel {sec * 1e6:8.2f} us  {name[:110]}")
    return sum(sec for name, sec in by_name.items() if not CHAIN_KERNEL.search(name))


def copy_bandwidth():
    """Device-to-device copy (read + write) bandwidth in bytes/s over a 2 GiB f32 buffer: (host
    clock, device time or nan). The device figure is the median duration of the pass kernels (the
    `inner` longest kernels of each traced program), so neither a copy XLA may put before the
    loop nor the loop's per-iteration host round trip counts; the input is donated so that the
    loop can run in place."""
    n = 512 * 2**20
    inner = 8

    def passes(a):  # each pass reads 4n bytes and writes 4n bytes; pass i+1 reads pass i's output
        return jax.lax.fori_loop(0, inner, lambda i, b: b * 1.0001 + 1.0, a)

    passes = jax.jit(passes, donate_argnums=0)
    state = {"x": passes(jnp.arange(n, dtype=jnp.float32))}

    def run():
        state["x"] = passes(state["x"])
        jax.block_until_ready(state["x"])

    run()
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        run()
        times.append((time.perf_counter() - t0) / inner)
    host = 2 * 4 * n / statistics.median(times)
    pass_seconds = device_time.median_longest_kernel_seconds(run, inner) if DEVICE_TIME else None
    return host, (NAN if pass_seconds is None else 2 * 4 * n / pass_seconds)


def n_copies(bytes_one):
    return min(32, max(1, math.ceil(ROTATE_BYTES / max(bytes_one, 1))))


def make_tq_inputs(num_seqs, seq_len, key, copies, rotation="haar"):
    k_codec = tq.TurboQuant(head_dim=HEAD_DIM, bits=K_BITS, seed=0, rotation=rotation)
    v_codec = tq.TurboQuant(head_dim=HEAD_DIM, bits=V_BITS, seed=1, rotation=rotation)
    pages_per_seq = -(-seq_len // PAGE_SIZE)
    num_pages = num_seqs * pages_per_seq
    sets = []
    for c in range(copies):
        kc = jax.random.fold_in(key, c)
        k1, k2, k3, k4, k5, k6 = jax.random.split(kc, 6)
        cache = tq.PagedKVCache.create(num_pages=num_pages, page_size=PAGE_SIZE, num_kv_heads=NUM_KV_HEADS,
                                       k_codec=k_codec, v_codec=v_codec)
        cache = dataclasses.replace(
            cache,
            k_codes=jax.random.randint(k1, cache.k_codes.shape, 0, 256, jnp.int32).astype(jnp.uint8),
            v_codes=jax.random.randint(k2, cache.v_codes.shape, 0, 256, jnp.int32).astype(jnp.uint8),
            k_norms=jax.random.uniform(k3, cache.k_norms.shape, jnp.float32, 0.5, 2.0) * math.sqrt(HEAD_DIM),
            v_norms=jax.random.uniform(k4, cache.v_norms.shape, jnp.float32, 0.5, 2.0),
        )
        perm = jax.random.permutation(k5, num_pages).astype(jnp.int32)
        if PAGE_ORDER == "sequential":  # each sequence's pages consecutive in the pool (diagnostic)
            perm = jnp.arange(num_pages, dtype=jnp.int32)
        tables = perm.reshape(num_seqs, pages_per_seq)
        lens = jnp.full((num_seqs,), seq_len, jnp.int32)
        q = jax.random.normal(k6, (num_seqs, NUM_HEADS, HEAD_DIM), jnp.bfloat16)
        sets.append((q, cache, tables, lens))
    return sets


def tq_bytes(num_seqs, seq_len, num_splits):
    kv = num_seqs * seq_len * NUM_KV_HEADS * (HEAD_DIM * (K_BITS + V_BITS) // 8 + 8)
    q_out = num_seqs * NUM_HEADS * HEAD_DIM * (4 + 4)  # q_rot f32 in, out_rot f32 out
    return kv + q_out


def bf16_bytes(num_seqs, seq_len):
    kv = 2 * num_seqs * seq_len * NUM_KV_HEADS * HEAD_DIM * 2
    return kv + 2 * num_seqs * NUM_HEADS * HEAD_DIM * 2


def make_dense_inputs(num_seqs, seq_len, key, copies):
    sets = []
    for c in range(copies):
        k1, k2, k3 = jax.random.split(jax.random.fold_in(key, 1000 + c), 3)
        q = jax.random.normal(k1, (num_seqs, 1, NUM_HEADS, HEAD_DIM), jnp.bfloat16)
        k = jax.random.normal(k2, (num_seqs, seq_len, NUM_KV_HEADS, HEAD_DIM), jnp.bfloat16)
        v = jax.random.normal(k3, (num_seqs, seq_len, NUM_KV_HEADS, HEAD_DIM), jnp.bfloat16)
        lens = jnp.full((num_seqs,), seq_len, jnp.int32)
        sets.append((q, k, v, lens))
    return sets


def make_pallas_inputs(num_seqs, seq_len, key, copies):
    pages_per_seq = -(-seq_len // PAGE_SIZE)
    num_pages = num_seqs * pages_per_seq
    sets = []
    for c in range(copies):
        k1, k2, k3, k4 = jax.random.split(jax.random.fold_in(key, 2000 + c), 4)
        q = jax.random.normal(k1, (num_seqs, NUM_HEADS, HEAD_DIM), jnp.bfloat16)
        kp = jax.random.normal(k2, (NUM_KV_HEADS, num_pages, PAGE_SIZE, HEAD_DIM), jnp.bfloat16)
        vp = jax.random.normal(k3, (NUM_KV_HEADS, num_pages, PAGE_SIZE, HEAD_DIM), jnp.bfloat16)
        tables = jax.random.permutation(k4, num_pages).astype(jnp.int32).reshape(num_seqs, pages_per_seq)
        lens = jnp.full((num_seqs,), seq_len, jnp.int32)
        sets.append((q, kp, vp, tables, lens))
    return sets


def bench_shape(num_seqs, seq_len, splits_list, copy_bw, quick, only_tq=False):
    key = jax.random.PRNGKey(num_seqs * 100003 + seq_len)
    outer = 5 if quick else 15
    rows = []
    # ---- jax_tq --------------------------------------------------------------------------------
    one = tq_bytes(num_seqs, seq_len, 1)
    for rotation in ROTATIONS:
        # haar: the rotations are XLA GEMMs around the kernel; hadamard: the kernel applies them
        sets = make_tq_inputs(num_seqs, seq_len, key, n_copies(one), rotation)
        for splits in splits_list:
            ns = None if splits == "auto" else int(splits)
            fn = lambda q, c, t, l, ns=ns: tq.paged_decode(q, c, t, l, num_splits=ns)
            rows.append((f"jax_tq K{K_BITS}V{V_BITS} {rotation} (splits={splits})", *time_calls(fn, sets, outer=outer), one))
        for spec in VARIANTS:
            kwargs = parse_variant(spec)
            if not kwargs:
                continue
            fn = lambda q, c, t, l, kw=kwargs: tq.paged_decode(q, c, t, l, **kw)
            read = tq_bytes(num_seqs, window_tokens(seq_len, kwargs.get("sliding_window")), 1)
            rows.append((f"jax_tq K{K_BITS}V{V_BITS} {rotation} {spec}", *time_calls(fn, sets, outer=outer), read))
        # the kernels of one call (device time per kernel name; the split kernel row: the decode's
        # own split (+ combine) kernels, without the rotation GEMMs, XLA's fusions and the chain's ops)
        if DEVICE_TIME:
            fn = lambda q, c, t, l: tq.paged_decode(q, c, t, l)
            by_name = kernel_breakdown(fn, sets)
            if by_name:
                print(f"  {rotation}:")
                for name, sec in sorted(by_name.items(), key=lambda kv: -kv[1]):
                    print(f"    kernel {sec * 1e6:8.2f} us  {name[:110]}")
                split = sum(sec for name, sec in by_name.items() if "jax_tq" in name)  # the library's kernels
                rows.append((f"jax_tq K{K_BITS}V{V_BITS} {rotation} split kernel (+ combine)", NAN, NAN, split, one))
    # the chain's own cost per call (the add on q, the sum of the output, the amortised dispatch):
    # the same chain around an op that returns q unchanged
    rows.append((CHAIN_ROW, *time_calls(lambda q, c, t, l: q, sets, outer=outer), 0))
    del sets
    if only_tq:
        return rows
    # ---- dense bf16 baselines -------------------------------------------------------------------
    dense = bf16_bytes(num_seqs, seq_len)
    dsets = make_dense_inputs(num_seqs, seq_len, key, n_copies(dense))
    for impl in ("cudnn", "xla"):
        def attn(q, k, v, l, impl=impl):
            return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=l, implementation=impl)
        try:
            rows.append((f"bf16 dot_product_attention {impl}", *time_calls(attn, dsets, outer=outer), dense))
            if DEVICE_TIME and impl == "cudnn":
                rows.append((f"bf16 {impl} own kernels", NAN, NAN, op_kernel_seconds(attn, dsets, impl), dense))
        except Exception as err:  # noqa: BLE001
            print(f"  {impl} failed: {type(err).__name__}: {str(err)[:200]}")
            rows.append((f"bf16 dot_product_attention {impl}", NAN, NAN, NAN, dense))
    del dsets
    try:
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
        psets = make_pallas_inputs(num_seqs, seq_len, key, n_copies(dense))
        fn = lambda q, kp, vp, t, l: paged_attention(q, kp, vp, t, l)
        rows.append(("bf16 Pallas paged_attention", *time_calls(fn, psets, outer=outer), dense))
        del psets
    except Exception as err:  # noqa: BLE001
        print(f"  pallas paged_attention failed: {type(err).__name__}: {str(err)[:200]}")
        rows.append(("bf16 Pallas paged_attention", NAN, NAN, NAN, dense))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--splits", default="auto", help="comma list of split counts to time for jax_tq (auto = library choice)")
    ap.add_argument("--only-tq", action="store_true", help="time jax_tq only (split sweeps)")
    ap.add_argument("--shapes", default=None, help="comma list like 32x8192,1x32768")
    ap.add_argument("--device-time", action="store_true", help="also the GPU span per call (profiler trace)")
    ap.add_argument("--rotations", default="haar,hadamard",
                    help="comma list of codec rotations for jax_tq: haar (rotation GEMMs around the kernel), "
                         "hadamard (the kernel rotates q and the output itself)")
    ap.add_argument("--page-order", default="random", choices=("random", "sequential"),
                    help="jax_tq block tables: a random permutation of the page pool (default) or each "
                         "sequence's pages consecutive (diagnostic: DRAM locality)")
    ap.add_argument("--heads", default="32:8", help="num_heads:num_kv_heads (default 32:8)")
    ap.add_argument("--head-dim", type=int, default=128, help="head_dim (default 128)")
    ap.add_argument("--bits", default="4:4", help="jax_tq K:V bits (default 4:4)")
    ap.add_argument("--variants", default="none",
                    help="comma list of attention variant sets also timed for jax_tq: none, or '+'-joined "
                         "soft_cap=C, sliding_window=W, sinks (e.g. soft_cap=50,sliding_window=4096+sinks)")
    args = ap.parse_args()
    global DEVICE_TIME, ROTATIONS, PAGE_ORDER, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, K_BITS, V_BITS, VARIANTS
    NUM_HEADS, NUM_KV_HEADS = (int(v) for v in args.heads.split(":"))
    HEAD_DIM = args.head_dim
    K_BITS, V_BITS = (int(v) for v in args.bits.split(":"))
    PAGE_ORDER = args.page_order
    DEVICE_TIME = args.device_time
    ROTATIONS = tuple(args.rotations.split(","))
    VARIANTS = tuple(args.variants.split(","))
    for spec in VARIANTS:
        parse_variant(spec)  # a bad entry fails before any timing
    shapes = SHAPES if args.shapes is None else tuple(tuple(int(v) for v in s.split("x")) for s in args.shapes.split(","))
    splits_list = args.splits.split(",")
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}")
    print(f"config: {NUM_HEADS} query / {NUM_KV_HEADS} KV heads, head_dim {HEAD_DIM}, jax_tq K{K_BITS}V{V_BITS}, "
          f"page_size {PAGE_SIZE}, page order {PAGE_ORDER}")
    try:
        from jax_tq import _ffi
        mod = _ffi.cuda_module()
        if mod is not None and hasattr(mod, "device_info"):
            print("device_info:", mod.device_info())
    except Exception as err:  # noqa: BLE001
        print("device_info unavailable:", err)
    bw_host, bw_dev = copy_bandwidth()
    print(f"device copy bandwidth (read + write): host clock {bw_host / 1e12:.2f} TB/s, device time "
          f"{bw_dev / 1e12:.2f} TB/s")
    table = []
    for num_seqs, seq_len in shapes:
        print(f"== num_seqs={num_seqs} seq_len={seq_len}")
        rows = bench_shape(num_seqs, seq_len, splits_list, bw_host, args.quick, args.only_tq)
        table += table_rows(f"{num_seqs}x{seq_len}", rows, bw_host, bw_dev)
    print()
    print(f"copy bandwidth {bw_host / 1e12:.2f} TB/s (host clock), {bw_dev / 1e12:.2f} TB/s (device time); "
          f"bytes = K/V read + q + out. host: median host-clock time per call "
          f"of a program of chained calls (its one dispatch included); device: the GPU span of that program per call "
          f"(profiler kernel events, median of 5; --device-time). GB/s, % copy bw (against the copy timed on the same "
          f"clock) and speedups use the device times where every row of the shape and the copy have one, else the "
          f"host times.")
    print()
    print("| shape (seqs x len) | implementation | host time (us) | device time (us) | MB read+written | GB/s "
          "| % copy bw | speedup vs cuDNN | speedup vs XLA |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in table:
        print(f"| {r['shape']} | {r['impl']} | {num(r['us'], '.1f')} | {num(r['dev_us'], '.1f')} | {r['mb']:.1f} | "
              f"{num(r['gbs'], '.0f')} | {num(r['pct'], '.1f')} | {num(r['vs_cudnn'], '.2f')} | {num(r['vs_xla'], '.2f')} |")


def num(value, spec):
    """``value`` formatted with ``spec``, or "n/a" for nan (a time or ratio this run could not take)."""
    return "n/a" if value != value else format(value, spec)


def table_rows(shape, rows, bw_host, bw_dev):
    """Table lines of one shape; the derived columns use the device times (and the device copy
    bandwidth) where every timed row and the copy have one, so no ratio mixes the two clocks."""
    use_dev = bw_dev == bw_dev and all(r[3] == r[3] for r in rows if r[1] == r[1])
    bw = bw_dev if use_dev else bw_host
    times = [r[3] if use_dev else r[1] for r in rows]
    t_cudnn = next((t for r, t in zip(rows, times) if r[0].endswith("cudnn")), NAN)
    t_xla = next((t for r, t in zip(rows, times) if r[0].endswith(" xla")), NAN)
    lines = []
    for (name, med, best, dev, nbytes), t in zip(rows, times):
        chain = name == CHAIN_ROW or not t > 0  # no bytes of its own (or no time taken): no bandwidth, no speedup
        line = dict(shape=shape, impl=name, us=med * 1e6, best_us=best * 1e6, dev_us=dev * 1e6, mb=nbytes / 1e6,
                    gbs=NAN if chain else nbytes / t / 1e9, pct=NAN if chain else 100 * nbytes / t / bw,
                    vs_cudnn=NAN if chain else t_cudnn / t, vs_xla=NAN if chain else t_xla / t)
        print(f"  {name:42s} host {line['us']:8.1f} us (best {line['best_us']:.1f})  device {line['dev_us']:8.1f} us  "
              f"{line['mb']:8.1f} MB  {line['gbs']:7.0f} GB/s  {line['pct']:5.1f}% copy bw  "
              f"x{line['vs_cudnn']:.2f} vs cuDNN  x{line['vs_xla']:.2f} vs XLA")
        lines.append(line)
    return lines


if __name__ == "__main__":
    main()
