"""Partitioning under a plain jax.jit: with NamedSharding inputs over a (2 data x 4 model) mesh, each
device runs the kernels on its slice (no collective in the compiled program), the results equal the
unsharded call, and write_cache gives back the cache with the sharding it came in with.
The mesh tests run in a subprocess with 8 host-platform CPU devices (fixed at JAX start)."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jax_tq as tq
from jax_tq import partitioning

SCRIPT = textwrap.dedent('''
    import os
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import re
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jax_tq as tq

    rng = np.random.default_rng(int(os.environ.get("JAX_TQ_TEST_SEED", "0")))
    S, HKV, G, D, PAGE, NP = 4, 4, 2, 64, 8, 16
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))  # noqa: E731
    COLLECTIVE = re.compile(r"\\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(-start)?\\(")

    def collectives(jitted, *args):
        """The result types of the collectives in the compiled HLO (e.g. "u8[16,4,8,32]")."""
        hlo = jitted.lower(*args).compile().as_text()
        return [line.split("=", 1)[1].split(COLLECTIVE.search(line).group(0))[0].strip()
                for line in hlo.splitlines() if COLLECTIVE.search(line)]

    def no_collectives(jitted, *args):
        found = collectives(jitted, *args)
        assert not found, found

    def assert_same_shardings(tree, shardings):  # P(None, "model") is P(None, "model", None, None)
        leaves = jax.tree_util.tree_leaves(tree)
        assert all(x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(leaves, shardings, strict=True)), \
            [(x.sharding, s) for x, s in zip(leaves, shardings)]

    def assert_equal_trees(got, want, **tol):
        """Equal codes and window rows; float32 values (norms, outputs) to ``tol`` (norms: 1e-6 relative,
        the per-shard CPU write's fitted scales may differ from the unsharded call's in the last bits)."""
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
            if a.dtype == jnp.float32:
                tol = tol or dict(rtol=1e-6, atol=0)
                np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol)
            else:
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    def assert_same_writes(got, want):
        """Caches written by a sharded and an unsharded program. Their float32 rounding differs, so
        at most 1 in 128 vectors may differ, in one of two ways once decoded. A rotated coordinate
        on a codebook boundary takes a neighbouring code: the vectors differ by at most 10% of the
        norm. Two scales of the fit's grid tie: each vector is a least-squares fit of the same input
        (its norm is ||x|| sqrt(gain)), so the norms agree to 1e-5 and the vectors differ by at most
        half the norm. Every other vector has the same codes and its norm to 1e-6, and the exact
        window rows are equal."""
        assert_equal_trees((got.k_window, got.v_window), (want.k_window, want.v_window))
        for pools in (("k_codes", "k_norms", "k_codec"), ("v_codes", "v_norms", "v_codec")):
            codes, norms = ([np.asarray(getattr(c, name)) for c in (got, want)] for name in pools[:2])
            codec = getattr(want, pools[2])
            same = np.all(codes[0] == codes[1], axis=-1) & np.isclose(norms[0], norms[1], rtol=1e-6, atol=0)
            assert same.mean() >= 1 - 1 / 128, (pools[0], int((~same).sum()))
            a, b = (np.asarray(tq.decompress(c[~same], n[~same], codec)) for c, n in zip(codes, norms))
            size, gap = np.linalg.norm(b, axis=-1), np.linalg.norm(a - b, axis=-1)
            scale_tie = np.isclose(np.linalg.norm(a, axis=-1), size, rtol=1e-5, atol=0) & (gap <= 0.5 * size)
            assert np.all((gap <= 0.1 * size) | scale_tie), (pools[0], gap / size)

    def unsharded(cache):
        """The cache's values on one device: the reference calls of the ops that read it."""
        return jax.tree_util.tree_map(lambda x: jnp.asarray(np.asarray(x)), cache)

    # --- pages shared by all sequence shards; KV heads over "model"; a window per sequence
    cache = tq.PagedKVCache.create(num_pages=NP, page_size=PAGE, num_kv_heads=HKV, preset="k4v4", head_dim=D,
                                   num_windows=S)
    n = NP * PAGE // 2
    seq_ids = np.repeat(np.arange(S), n // S)
    pos = np.tile(np.arange(n // S), S)
    tables = jnp.asarray(rng.permutation(NP).reshape(S, NP // S), jnp.int32)
    lens = jnp.full((S,), n // S, jnp.int32)
    slots = tq.slot_mapping(tables, jnp.asarray(pos, jnp.int32), PAGE, jnp.asarray(seq_ids, jnp.int32))
    wslots = jnp.asarray(tq.window_slot_mapping(seq_ids, pos, np.asarray(lens)[seq_ids], cache.window), jnp.int32)
    k = jnp.asarray(rng.normal(size=(n, HKV, D)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(n, HKV, D)), jnp.float32)
    want = tq.write_cache(cache, k, v, slots, wslots)

    sharded = tq.shard_cache(cache, mesh)
    in_shardings = [x.sharding for x in jax.tree_util.tree_leaves(sharded)]
    write = jax.jit(tq.write_cache, donate_argnums=0)
    args = (sharded, put(k, None, "model"), put(v, None, "model"), slots, wslots)
    no_collectives(write, *args)
    got = write(*args)
    assert_same_shardings(got, in_shardings)
    assert got.k_codes.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "model")), 4), got.k_codes.sharding
    assert_same_writes(got, want)
    want = unsharded(got)

    q = jnp.asarray(rng.normal(size=(S, HKV * G, D)), jnp.float32)
    decode = jax.jit(tq.paged_decode)
    args = (put(q, "data", "model"), got, put(tables, "data"), put(lens, "data"))
    no_collectives(decode, *args)
    out = decode(*args)
    assert out.sharding.spec == P("data", "model"), out.sharding
    assert_equal_trees(out, tq.paged_decode(q, want, tables, lens), rtol=1e-6, atol=1e-6)
    # Per-head sinks follow their query heads; a sliding window changes no layout.
    sinks = jnp.asarray(rng.normal(size=(HKV * G,)), jnp.float32)
    variant = jax.jit(lambda q, c, t, l, s: tq.paged_decode(q, c, t, l, sinks=s, sliding_window=5))
    args = (put(q, "data", "model"), got, put(tables, "data"), put(lens, "data"), put(sinks, "model"))
    no_collectives(variant, *args)
    assert_equal_trees(variant(*args), tq.paged_decode(q, want, tables, lens, sinks=sinks, sliding_window=5),
                       rtol=1e-6, atol=1e-6)

    # q's heads split over "data" and its sequences over "model" (a layout that does not fit the
    # cache's): q is resharded (it is small), the cache stays where it is, the result is the same.
    args = (put(q, "model", "data"), got, put(tables, "model"), put(lens, "model"))
    moved = collectives(decode, *args)
    assert moved and not [t for t in moved if "u8[" in t or f"[{NP}," in t], moved  # q / tables only, no pool
    out = decode(*args)
    assert_equal_trees(out, tq.paged_decode(q, want, tables, lens), rtol=1e-6, atol=1e-6)

    starts = jnp.asarray([0, 3, 5, 8, 8], jnp.int32)  # 8 new tokens of 4 sequences
    qp = jnp.asarray(rng.normal(size=(8, HKV * G, D)), jnp.float32)
    prefill = jax.jit(tq.paged_prefill)
    args = (put(qp, None, "model"), got, tables, lens, starts)
    no_collectives(prefill, *args)
    assert_equal_trees(prefill(*args), tq.paged_prefill(qp, want, tables, lens, starts), rtol=1e-6, atol=1e-6)

    kn = jnp.asarray(rng.normal(size=(8, HKV, D)), jnp.float32)
    kv_lens = lens + jnp.diff(starts)
    ragged = jax.jit(tq.ragged_paged_attention, donate_argnums=3)
    want_out, want_cache = tq.ragged_paged_attention(qp, kn, kn, want, kv_lens, tables, starts)
    args = (put(qp, None, "model"), put(kn, None, "model"), put(kn, None, "model"), got, kv_lens, tables, starts)
    no_collectives(ragged, *args)
    out, new_cache = ragged(*args)
    assert_same_shardings(new_cache, in_shardings)
    assert_equal_trees(out, want_out, rtol=1e-6, atol=1e-6)
    assert_same_writes(new_cache, want_cache)

    # --- pages split over "data" too: each sequence shard owns NP / 2 pages, its tables shard-local
    cache = tq.PagedKVCache.create(num_pages=NP, page_size=PAGE, num_kv_heads=HKV, preset="k3v3", head_dim=D,
                                   window=0)
    half = NP // 2
    global_tables = np.concatenate([rng.permutation(half).reshape(S // 2, -1) + d * half for d in range(2)])
    local_tables = jnp.asarray(global_tables % half, jnp.int32)
    global_tables = jnp.asarray(global_tables, jnp.int32)
    tok_seq = np.repeat(np.arange(S), n // S)  # tokens of sequences 0, 1 on data shard 0, of 2, 3 on shard 1
    slots_global = tq.slot_mapping(global_tables, jnp.asarray(pos, jnp.int32), PAGE, jnp.asarray(tok_seq, jnp.int32))
    slots_local = slots_global % (half * PAGE)
    want = tq.write_cache(cache, k, v, slots_global)
    sharded = tq.shard_cache(cache, mesh, page_axis="data")
    in_shardings = [x.sharding for x in jax.tree_util.tree_leaves(sharded)]
    args = (sharded, put(k, "data", "model"), put(v, "data", "model"), put(slots_local, "data"))
    no_collectives(write, *args)
    got = write(*args)
    assert_same_shardings(got, in_shardings)
    assert got.k_codes.sharding.is_equivalent_to(NamedSharding(mesh, P("data", "model")), 4), got.k_codes.sharding
    assert_same_writes(got, want)
    want = unsharded(got)
    args = (put(q, "data", "model"), got, put(local_tables, "data"), put(lens, "data"))
    no_collectives(decode, *args)
    assert_equal_trees(decode(*args), tq.paged_decode(q, want, global_tables, lens), rtol=1e-6, atol=1e-6)

    # paged_prefill never splits its sequences: over split pages it is refused, not run with local ids as global
    try:
        jax.jit(tq.paged_prefill)(put(qp, None, "model"), got, put(local_tables, "data"), put(lens, "data"), starts)
        raise AssertionError("paged_prefill over split pages ran")
    except Exception as err:  # XLA wraps the partitioner's ValueError
        assert "does not run per page shard" in str(err), str(err)[-500:]

    # shard_map (every mesh axis manual) still runs the per-shard kernel as it is
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:  # older JAX
        from jax.experimental.shard_map import shard_map
    specs = tq.cache_partition_specs(cache, page_axis="data")
    per_shard = jax.jit(shard_map(tq.paged_decode, mesh=mesh, out_specs=P("data", "model"),
                                  in_specs=(P("data", "model"), specs, P("data"), P("data"))))
    assert_equal_trees(per_shard(q, got, local_tables, lens), tq.paged_decode(q, want, global_tables, lens),
                       rtol=1e-6, atol=1e-6)

    # compress / decompress: rows split over any mesh axes
    codec = cache.k_codec
    x = jnp.asarray(rng.normal(size=(64, D)), jnp.float32)
    rows = jax.jit(lambda x: tq.decompress(*tq.compress(x, codec), codec))
    no_collectives(rows, put(x, ("data", "model")))
    assert_equal_trees(rows(put(x, ("data", "model"))), tq.decompress(*tq.compress(x, codec), codec),
                       rtol=1e-6, atol=1e-6)

    # merge_attention (the dense prefill's merge): rows over "data", heads over "model"
    from jax_tq.merge_attention import merge_attention
    parts = [jnp.asarray(rng.normal(size=(16, 8, D)), jnp.bfloat16) for _ in range(3)]
    w = jnp.asarray(rng.uniform(size=(16, 8, 2)), jnp.float32).at[::3].set(jnp.asarray([1.0, 0.0]))
    check = jnp.asarray(rng.random((16, 8)) < 0.5)
    merge = jax.jit(merge_attention)
    args = [put(x, "data", "model") for x in (parts[0], parts[1], w, parts[2], check)]
    no_collectives(merge, *args)
    assert_equal_trees(merge(*args), merge_attention(parts[0], parts[1], w, parts[2], check))

    # q's 8 heads over 8 devices, the 4 KV heads of an unsharded cache: q is gathered, the result the same
    mesh8 = Mesh(np.array(jax.devices()), ("model",))
    q8 = jax.device_put(q, NamedSharding(mesh8, P(None, "model")))
    assert_equal_trees(decode(q8, want, tables, lens), tq.paged_decode(q, want, tables, lens), rtol=1e-6, atol=1e-6)

    try:
        tq.shard_cache(tq.PagedKVCache.create(num_pages=NP, page_size=PAGE, num_kv_heads=2, preset="k4v4",
                                              head_dim=D, window=0), mesh)
        raise AssertionError("2 KV heads over a model axis of 4 were accepted")
    except ValueError as err:
        assert "kv_head_axis" in str(err), err
    print("PARTITIONING OK")
''')


@pytest.mark.skipif(not partitioning.enabled(), reason="custom_partitioning not verified on this JAX "
                    f"({jax.__version__}; partitioning.VERIFIED_JAX): the primitives lower whole")
@pytest.mark.parametrize("partitioner", ["shardy", "gspmd"])
def test_plain_jit_runs_each_op_on_its_shard(partitioner):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_USE_SHARDY_PARTITIONER=str(partitioner == "shardy").lower())
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0 and "PARTITIONING OK" in run.stdout, run.stdout[-2000:] + run.stderr[-4000:]


def _cache(num_kv_heads=4, **kw):
    return tq.PagedKVCache.create(num_pages=8, page_size=8, num_kv_heads=num_kv_heads, preset="k4v4", head_dim=64,
                                  **kw)


def test_cache_partition_specs():
    cache = _cache(num_windows=2)
    specs = tq.cache_partition_specs(cache)
    assert specs.k_codes == P(None, "model", None, None) and specs.v_norms == P(None, "model", None)
    assert specs.k_window == P(None, "model", None, None)
    specs = tq.cache_partition_specs(cache, kv_head_axis=("x", "y"), page_axis="data")
    assert specs.v_codes == P("data", ("x", "y"), None, None)
    leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P))
    assert len(leaves) == len(jax.tree_util.tree_leaves(cache))
    assert leaves.count(P()) == len(jax.tree_util.tree_leaves((cache.k_codec, cache.v_codec)))
    assert tq.cache_partition_specs(_cache(window=0)).k_window is None
    with pytest.raises(ValueError, match="share a mesh axis"):
        tq.cache_partition_specs(cache, kv_head_axis="data", page_axis="data")
    with pytest.raises(TypeError, match="PagedKVCache"):
        tq.cache_partition_specs({"k": 1})


def test_shard_cache_on_one_device_mesh():
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    cache = _cache(window=0)
    sharded = tq.shard_cache(cache, mesh)
    assert sharded.k_codes.sharding.spec == P(None, "model", None, None)
    np.testing.assert_array_equal(np.asarray(sharded.k_norms), np.asarray(cache.k_norms))
    with pytest.raises(ValueError, match="mesh axis 'heads'"):
        tq.shard_cache(cache, mesh, kv_head_axis="heads")


class _Mesh:  # what decide reads of a mesh
    shape = {"data": 2, "model": 4}


def _named(*spec):
    class Sharding:
        pass
    s = Sharding()
    s.spec = P(*spec)
    return s


def test_decide_falls_back_to_whole_dims_that_do_not_divide():
    layout = partitioning.Layout(operands=(("seq", "head", None), ("page", "kv", None)),
                                 results=(("seq", "head", None),))
    shapes = [(4, 12, 64), (16, 4, 8)]
    axes = partitioning.decide(layout, _Mesh, shapes, [_named("data", "model"), _named(None, "model")])
    assert axes["kv"] == ("model",) and axes["head"] == ("model",) and axes["seq"] == ("data",)
    assert axes["page"] == ()  # pages shared: not split with the sequences
    axes = partitioning.decide(layout, _Mesh, [(4, 18, 64), (16, 6, 8)], [_named("data", "model"),
                                                                          _named(None, "model")])
    assert axes["kv"] == () and axes["seq"] == ("data",)  # 6 KV heads do not split 4 ways: whole
    # 3 sequences over 2 cannot follow pages split over "data" (their ids are shard-local): refused,
    # not gathered and read as global ids
    with pytest.raises(ValueError, match=r"jax_tq.op: the page pools are split over \('data',\).*come in split over "
                                         r"no axis; pass them split over \('data',\)"):
        partitioning.decide(layout, _Mesh, [(3, 12, 64), (16, 4, 8)], [_named("data"), _named("data", "model")])
    prefill = dataclasses.replace(layout, whole=frozenset({"seq"}))
    with pytest.raises(ValueError, match="does not run per page shard; keep the pages whole"):
        partitioning.decide(prefill, _Mesh, shapes, [_named("data"), _named("data", "model")])
    axes = partitioning.decide(layout, _Mesh, shapes, [_named("data"), _named("data", "model")])
    assert axes["page"] == ("data",)  # pages split with the sequences
    write = partitioning.Layout(operands=(("seq", "kv"), ("page", "kv")), results=(("page", "kv"),),
                                seq_needs_pages=True)
    axes = partitioning.decide(write, _Mesh, [(8, 4), (16, 4)], [_named("data", "model"), _named(None, "model")])
    assert axes["seq"] == () and axes["kv"] == ("model",)  # tokens into shared pages: whole
