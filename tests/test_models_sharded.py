"""jax_tq.models with its sequences split over a mesh's data axis (pages and windows per data shard,
KV heads over "model"): the prefill and the decode loop under a plain jax.jit give the unsharded
run's tokens, the caches keep their sharding, and no collective moves a cache-shaped operand (the
KV-head split's all-reduce of a layer's activations is the usual tensor-parallel one). Runs in a
subprocess with 4 host-platform CPU devices (fixed at JAX start)."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("flax.nnx")

SCRIPT = textwrap.dedent(r'''
import os, sys, re
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
sys.path.insert(0, os.environ["JAX_TQ_TESTS_DIR"])
import numpy as np, jax, jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jax_tq as tq
from tiny_llama import tiny_llama, TINY
from jax_tq.models import config_caches, parse_cache_config, make_prefill, make_decode_loop, greedy_generate
from jax_tq.models import llama

COLLECTIVE = re.compile(r"\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(-start)?\(")
model = tiny_llama()
rng = np.random.default_rng(int(os.environ.get("JAX_TQ_TEST_SEED", "0")))
S, L, steps, page = 4, 70, 5, 16
lens = np.array([70, 41, 66, 9], np.int32)
prompts = rng.integers(0, 97, (S, L)).astype(np.int32)
n_pages = -(-(L + steps + 1) // page)
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
seq = NamedSharding(mesh, P("data"))
for spec in ("k4v4", "4:4"):
    cfg = parse_cache_config(spec)
    prefill, loop = make_prefill(model), make_decode_loop(model)
    tables = np.arange(S * n_pages, dtype=np.int32).reshape(S, n_pages)

    def run(caches, tables, window_ids, put):
        logits, caches = prefill(caches, put(prompts), put(lens), put(tables), window_ids=window_ids)
        first = jnp.argmax(logits, -1).astype(jnp.int32)
        tokens, caches = loop(caches, first, put(lens), put(tables), put(lens + 1), steps, window_ids=window_ids)
        return np.concatenate([np.asarray(first)[:, None], np.asarray(tokens)], 1), caches

    want, _ = run(config_caches(TINY, cfg, S * n_pages, num_windows=S), tables, None, jnp.asarray)
    caches = [tq.shard_cache(c, mesh, kv_head_axis="model", page_axis="data")
              for c in config_caches(TINY, cfg, S * n_pages, num_windows=S)]
    local = tables % (S // 2 * n_pages)
    wids = jax.device_put(np.arange(S, dtype=np.int32) % (S // 2), seq) if cfg.window else None
    got, caches = run(caches, local, wids, lambda x: jax.device_put(x, seq))
    assert np.array_equal(got, want), (spec, got, want)
    assert len(set(want[:, 0])) > 1 or len(set(map(tuple, want))) > 1, want  # the sequences differ
    spec_cache = tq.cache_partition_specs(caches[0], kv_head_axis="model", page_axis="data")
    for leaf, ps in zip(jax.tree_util.tree_leaves(caches[0]), jax.tree_util.tree_leaves(spec_cache)):
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, ps), leaf.ndim), (leaf.sharding, ps)
    cache_shapes = set()
    for leaf in jax.tree_util.tree_leaves(caches):
        cache_shapes |= {tuple(leaf.shape), tuple(leaf.sharding.shard_shape(leaf.shape))}

    def cache_sized(hlo):
        """Collectives of cache-shaped operands (the KV-head split's all-reduce of a layer's
        activations [rows, hidden] is the tensor-parallel one every such model has)."""
        found = []
        for line in hlo.splitlines():
            if COLLECTIVE.search(line):
                dims = re.search(r"= \(?\w+\[([0-9,]*)\]", line).group(1)
                if tuple(int(d) for d in dims.split(",") if d) in cache_shapes:
                    found.append(line.strip()[:160])
        return found

    gd, st = nnx.split(model)
    put = lambda x: jax.device_put(x, seq)
    hlo = llama._decode_loop_pure.lower(gd, st, caches, put(want[:, 0]), put(lens), put(local), put(lens + 1),
                                        steps, wids).compile().as_text()
    assert not cache_sized(hlo), cache_sized(hlo)
    n_loop = len([l for l in hlo.splitlines() if COLLECTIVE.search(l)])
    assert n_loop > 0, "the KV-head split's activation all-reduce not found: the collective check sees nothing"
    hlo = llama._prefill_pure.lower(gd, st, put(prompts), caches, put(local), put(lens), wids).compile().as_text()
    assert not cache_sized(hlo), cache_sized(hlo)
    found = [l.strip()[:110] for l in hlo.splitlines() if COLLECTIVE.search(l)]
    print(spec, "ok: collectives (none cache-sized): loop", n_loop, "prefill", len(found))

prompt = prompts[1, :20].tolist()
want = greedy_generate(model, prompt, 4, "k4v4", batch=4)
got = greedy_generate(model, prompt, 4, "k4v4", batch=4, mesh=mesh)
assert np.array_equal(got["all_ids"], want["all_ids"]), (got["all_ids"], want["all_ids"])
for bad, match in (((Mesh(np.array(jax.devices()), ("model",))), "'data' axis"),
                   (Mesh(np.array(jax.devices()[:3]), ("data",)), "multiple of")):
    try:
        greedy_generate(model, prompt, 2, "k4v4", batch=4, mesh=bad)
    except ValueError as err:
        assert match in str(err), err
    else:
        raise AssertionError(match)
print("greedy_generate ok")
''')


def test_prefill_and_decode_loop_with_sequences_split_over_data(rng):
    env = dict(os.environ, JAX_TQ_TESTS_DIR=str(pathlib.Path(__file__).resolve().parent),
               JAX_TQ_TEST_SEED=str(int(rng.integers(1 << 30))))
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=1200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    assert "k4v4 ok" in res.stdout and "4:4 ok" in res.stdout and "greedy_generate ok" in res.stdout, res.stdout
