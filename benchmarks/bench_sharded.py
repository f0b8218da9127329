"""A decode step on several devices of one host against the same step on one (issue 34).

One step = ``write_cache`` of one new token per sequence + ``paged_decode`` over the cache, the
cache donated, under a plain ``jax.jit``. Sharded: the KV heads over a "model" axis of the first
``--devices`` devices (``tq.shard_cache``: each device holds its heads of every page and window;
q, k, v split by heads; block tables and lengths whole). Each run is one jitted chain of ``--steps``
dependent steps (the next q adds 1e-3 x this step's output), host-timed, median of ``--reps``.

Prints per-step time, decode tokens/s (sequences x steps / time) and the speedup, the largest
difference between the two runs' outputs (the same ops on each device's slice: float32
rounding), and the collectives in the sharded chain's compiled HLO (none expected).

Floor: a K4V4 step at (64, 8192), 8 KV heads, head_dim 128 reads 64 x 8192 x 8 x 2 x 68 B
= 571 MB (codes + norms) plus the 64-token windows; one H200 at ~3.7 TB/s: ~155 us; two at half the
bytes each: ~78 us, so 1.8x needs the per-device step within ~10% of its floor plus launch costs.

  python benchmarks/bench_sharded.py --shape 64x8192 --devices 2
  XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
      python benchmarks/bench_sharded.py --shape 4x256 --heads 4/2 --head-dim 64 --steps 2 --reps 1
"""
from __future__ import annotations

import argparse
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_tq as tq

COLLECTIVE = re.compile(r"\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(-start)?\(")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="64x8192", help="num_seqs x cached tokens per sequence")
    ap.add_argument("--heads", default="32/8", help="query heads / KV heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--preset", default="k4v4", help="the cache preset (k4v4, k3v3, k2v2, none)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--devices", type=int, default=2, help="devices of the 'model' axis (KV heads split)")
    ap.add_argument("--steps", type=int, default=16, help="dependent decode steps per timed call")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    try:
        args.num_seqs, args.seq_len = (int(v) for v in args.shape.lower().split("x"))
        args.num_heads, args.num_kv_heads = (int(v) for v in args.heads.split("/"))
    except ValueError:
        ap.error(f"--shape must be SxL and --heads H/Hkv, got {args.shape!r}, {args.heads!r}")
    if args.devices > len(jax.devices()):
        ap.error(f"--devices {args.devices}: only {len(jax.devices())} devices")
    if args.num_kv_heads % args.devices or args.num_heads % args.num_kv_heads:
        ap.error("--devices must divide the KV heads, and the KV heads the query heads")
    return args


def filled_cache(args, key):
    """A cache holding seq_len tokens per sequence (random codes, norms and window rows: any codes
    are valid), sequence s on pages [s * n, (s + 1) * n), room for the chain's new tokens."""
    pages = -(-(args.seq_len + args.steps) // args.page_size)
    sizes = dict(num_pages=args.num_seqs * pages, page_size=args.page_size, num_kv_heads=args.num_kv_heads,
                 head_dim=args.head_dim)
    if args.preset == "none":
        cache = tq.PagedKVCache.create(**sizes, preset="none", dtype=jnp.bfloat16)
    else:
        cache = tq.PagedKVCache.create(**sizes, preset=args.preset, num_windows=args.num_seqs)
    leaves, tree = jax.tree_util.tree_flatten(cache)
    keys = jax.random.split(key, len(leaves))
    filled = []
    for k, leaf in zip(keys, leaves):
        if jnp.issubdtype(leaf.dtype, jnp.integer):
            filled.append(jax.random.randint(k, leaf.shape, 0, 256, jnp.int32).astype(leaf.dtype))
        else:
            filled.append(jax.random.uniform(k, leaf.shape, jnp.float32, 0.5, 1.5).astype(leaf.dtype))
    tables = jnp.arange(args.num_seqs * pages, dtype=jnp.int32).reshape(args.num_seqs, pages)
    return jax.tree_util.tree_unflatten(tree, filled), tables


def chain(steps):
    """jit of ``steps`` dependent decode steps: (cache, q, k, v, tables, lens) -> (cache, outputs)."""
    def run(cache, q, k, v, tables, lens):
        outs = []
        for i in range(steps):
            position = lens + i
            slots = tq.slot_mapping(tables, position, cache.page_size)
            window_slots = None
            if cache.window:
                ids = jnp.arange(lens.shape[0], dtype=jnp.int32)
                window_slots = tq.window_slot_mapping(ids, position, position + 1, cache.window)
            cache = tq.write_cache(cache, k, v, slots, window_slots)
            out = tq.paged_decode(q, cache, tables, position + 1)
            q = q + (1e-3 * out).astype(q.dtype)
            outs.append(out[..., :4])  # every head (each device its own): no gather for the result
        return cache, jnp.stack(outs)
    return jax.jit(run, donate_argnums=0)


def timed(fn, cache, operands, reps):
    """Median seconds of fn(cache, *operands), the cache threaded through the calls (donated)."""
    cache, first = fn(cache, *operands)
    jax.block_until_ready(first)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        cache, out = fn(cache, *operands)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), first


def main(argv=None) -> dict:
    args = parse_args(argv)
    key = jax.random.PRNGKey(0)
    kq, kk, kv, kc = jax.random.split(key, 4)
    S, H, Hkv, d = args.num_seqs, args.num_heads, args.num_kv_heads, args.head_dim
    q = jax.random.normal(kq, (S, H, d), jnp.bfloat16)
    k = jax.random.normal(kk, (S, Hkv, d), jnp.bfloat16)
    v = jax.random.normal(kv, (S, Hkv, d), jnp.bfloat16)
    lens = jnp.full((S,), args.seq_len, jnp.int32)
    run = chain(args.steps)

    one = jax.devices()[0]
    cache, tables = filled_cache(args, kc)
    on_one = [jax.device_put(x, one) for x in (q, k, v, tables, lens)]
    t_one, out_one = timed(run, jax.device_put(cache, one), on_one, args.reps)

    mesh = Mesh(np.array(jax.devices()[:args.devices]), ("model",))
    heads = NamedSharding(mesh, P(None, "model"))
    whole = NamedSharding(mesh, P())
    sharded = [jax.device_put(q, heads), jax.device_put(k, heads), jax.device_put(v, heads),
               jax.device_put(tables, whole), jax.device_put(lens, whole)]
    cache, _ = filled_cache(args, kc)
    cache = tq.shard_cache(cache, mesh, kv_head_axis="model")
    hlo = run.lower(cache, *sharded).compile().as_text()
    collectives = [line.strip()[:140] for line in hlo.splitlines() if COLLECTIVE.search(line)]
    t_many, out_many = timed(run, cache, sharded, args.reps)

    diff = float(jnp.max(jnp.abs(out_many.astype(jnp.float32) - jax.device_put(out_one, out_many.sharding))))
    per_one, per_many = t_one / args.steps, t_many / args.steps
    print(f"decode step (write_cache + paged_decode), {args.preset}, S={S}, {args.seq_len} cached tokens, "
          f"{H}/{Hkv} heads, head_dim {d}, page {args.page_size}; {args.steps} dependent steps per call, "
          f"median of {args.reps}; {jax.devices()[0].device_kind}\n")
    print("| devices | us / step | decode tokens/s | speedup |")
    print("|---:|---:|---:|---:|")
    print(f"| 1 | {per_one * 1e6:.1f} | {S / per_one:,.0f} | 1.00x |")
    print(f"| {args.devices} (KV heads split) | {per_many * 1e6:.1f} | {S / per_many:,.0f} | {per_one / per_many:.2f}x |")
    print(f"\nlargest |sharded - one device| over the chain's outputs: {diff:.2e}")
    print(f"collectives in the sharded chain: {len(collectives)}" + "".join("\n  " + c for c in collectives[:5]))
    return dict(one_s=per_one, many_s=per_many, diff=diff, collectives=collectives)


if __name__ == "__main__":
    main()
