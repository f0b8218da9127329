"""Sharding: the primitives run per shard under shard_map (KV heads on one mesh axis, sequences on
another) and give the unsharded result exactly, with no collective in the compiled program.
Runs in a subprocess with 4 host-platform CPU devices (the device count is fixed at JAX start)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import os
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import jax_tq as tq

    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:  # older JAX
        from jax.experimental.shard_map import shard_map
    rng = np.random.default_rng(int(os.environ.get("JAX_TQ_TEST_SEED", "0")))
    S, HKV, G, D, PAGE, NP = 4, 4, 3, 64, 8, 16
    cache = tq.PagedKVCache.create(num_pages=NP, page_size=PAGE, num_kv_heads=HKV,
                                   k_codec=tq.TurboQuant(D, 4, 0), v_codec=tq.TurboQuant(D, 3, 1))
    k = jnp.asarray(rng.normal(size=(NP * PAGE, HKV, D)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(NP * PAGE, HKV, D)), jnp.float32)
    slots = jnp.asarray(rng.permutation(NP * PAGE), jnp.int32)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    cache_spec = jax.tree_util.tree_map(lambda _: P(None, "model"), cache)

    write = jax.jit(shard_map(tq.write_cache, mesh=mesh, in_specs=(cache_spec, P(None, "model"), P(None, "model"), P()),
                              out_specs=cache_spec))
    sharded_cache = write(cache, k, v, slots)
    cache = tq.write_cache(cache, k, v, slots)
    for a, b in zip(jax.tree_util.tree_leaves(sharded_cache), jax.tree_util.tree_leaves(cache)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    tables = jnp.asarray(rng.permutation(NP).reshape(S, NP // S), jnp.int32)
    lens = jnp.asarray(rng.integers(0, NP // S * PAGE + 1, size=S), jnp.int32)
    q = jnp.asarray(rng.normal(size=(S, HKV * G, D)), jnp.float32)
    decode = jax.jit(shard_map(tq.paged_decode, mesh=mesh, in_specs=(P("data", "model"), cache_spec, P("data"), P("data")),
                               out_specs=P("data", "model")))
    got, want = decode(q, cache, tables, lens), tq.paged_decode(q, cache, tables, lens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)
    hlo = decode.lower(q, cache, tables, lens).compile().as_text()
    assert "all-gather" not in hlo and "all-reduce" not in hlo, "per-shard decode needs no collective"

    # Gradients through the primitives inside shard_map (check_vma on, the default): the outputs
    # must carry the inputs' varying mesh axes, or JAX's type check refuses them.
    loss = lambda out: jnp.sum(jnp.sin(out))  # noqa: E731
    grad_sharded = jax.grad(lambda q: loss(decode(q, cache, tables, lens)))(q)
    grad_plain = jax.grad(lambda q: loss(tq.paged_decode(q, cache, tables, lens)))(q)
    np.testing.assert_allclose(np.asarray(grad_sharded), np.asarray(grad_plain), rtol=1e-5, atol=1e-6)
    codec = tq.TurboQuant(D, 4, 0)
    x = jnp.asarray(rng.normal(size=(8, D)), jnp.float32)
    norms_sharded = shard_map(lambda x: tq.compress(x, codec)[1], mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    np.testing.assert_allclose(np.asarray(jax.grad(lambda x: jnp.sum(norms_sharded(x) ** 2))(x)),
                               np.asarray(jax.grad(lambda x: jnp.sum(tq.compress(x, codec)[1] ** 2))(x)), rtol=1e-5)
    codes, norms = tq.compress(x, codec)
    dec_sharded = shard_map(lambda c, n: tq.decompress(c, n, codec), mesh=mesh, in_specs=(P("data"), P("data")),
                            out_specs=P("data"))
    np.testing.assert_allclose(np.asarray(jax.grad(lambda n: loss(dec_sharded(codes, n)))(norms)),
                               np.asarray(jax.grad(lambda n: loss(tq.decompress(codes, n, codec)))(norms)), rtol=1e-5)
    write_sharded = shard_map(tq.write_cache, mesh=mesh, in_specs=(cache_spec, P(None, "model"), P(None, "model"), P()),
                              out_specs=cache_spec)
    write_loss = lambda w, k: jnp.sum(w(cache, k, k, slots).k_norms)  # noqa: E731
    np.testing.assert_allclose(np.asarray(jax.grad(lambda k: write_loss(write_sharded, k))(k)),
                               np.asarray(jax.grad(lambda k: write_loss(tq.write_cache, k))(k)), rtol=1e-5, atol=1e-7)
    # An output that varies over a mesh axis cannot be returned as replicated (it used to pass, silently).
    try:
        shard_map(lambda x: tq.compress(x, codec)[1], mesh=mesh, in_specs=P("data"), out_specs=P())(x)
        raise AssertionError("a varying output returned as replicated was accepted")
    except ValueError as err:
        assert "replication" in str(err), err
    print("SHARDING OK")
''')


@pytest.mark.slow
def test_shard_map_over_kv_heads_and_sequences():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0 and "SHARDING OK" in run.stdout, run.stdout[-2000:] + run.stderr[-4000:]
