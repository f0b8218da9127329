"""Flax integration: the TurboQuant attention_fn inside nnx.MultiHeadAttention, and paged_attention."""
from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tq as tq
from jax_tq.nn import paged_attention, turboquant_attention_fn
from oracle import rel_err

nnx = pytest.importorskip("flax.nnx")


def test_nnx_multihead_attention_with_turboquant_kv(rng):
    codec_k = tq.TurboQuant(head_dim=64, bits=4, seed=1)
    codec_v = tq.TurboQuant(head_dim=64, bits=4, seed=2)
    kwargs = dict(num_heads=4, in_features=256, qkv_features=256, decode=False)
    plain = nnx.MultiHeadAttention(**kwargs, rngs=nnx.Rngs(0))
    compressed = nnx.MultiHeadAttention(**kwargs, rngs=nnx.Rngs(0), attention_fn=turboquant_attention_fn(codec_k, codec_v))
    x = jnp.asarray(rng.normal(size=(2, 10, 256)), jnp.float32)
    seen = {}

    def spy(q, k, v, *args, **kw):
        seen["k"], seen["v"] = k, v
        return nnx.dot_product_attention(q, k, v, *args, **kw)

    spying = nnx.MultiHeadAttention(**kwargs, rngs=nnx.Rngs(0), attention_fn=turboquant_attention_fn(codec_k, codec_v, spy))
    out_plain, out_tq = plain(x), compressed(x)
    spying(x)
    # The module really attended over reconstructed K/V: they equal decompress(compress(K)).
    k_proj = plain.key(x)
    k_hat = tq.decompress(*tq.compress(k_proj, codec_k), codec_k)
    np.testing.assert_allclose(np.asarray(seen["k"]), np.asarray(k_hat), rtol=1e-5, atol=1e-6)
    err = rel_err(out_tq, out_plain)
    assert 1e-4 < err < 0.2, f"4-bit K/V should perturb the output a little, got rel err {err}"


@pytest.mark.slow
def test_nnx_grad_flows_straight_through_the_compressed_kv(rng):
    codec = tq.TurboQuant(head_dim=64, bits=4, seed=1)
    kwargs = dict(num_heads=4, in_features=256, qkv_features=256, decode=False)
    plain = nnx.MultiHeadAttention(**kwargs, rngs=nnx.Rngs(0))
    model = nnx.MultiHeadAttention(**kwargs, rngs=nnx.Rngs(0), attention_fn=turboquant_attention_fn(codec, codec))
    x = jnp.asarray(rng.normal(size=(2, 10, 256)), jnp.float32)
    loss = lambda m: jnp.sum(m(x) ** 2)  # noqa: E731
    grads, plain_grads = nnx.grad(loss)(model), nnx.grad(loss)(plain)
    g_key, g_plain = np.asarray(grads.key.kernel[...]), np.asarray(plain_grads.key.kernel[...])
    assert np.all(np.isfinite(g_key)) and np.any(g_key != 0)
    # The straight-through estimator: the same gradient as the uncompressed module, evaluated
    # at the reconstructed K/V (4-bit: close, not equal).
    assert 1e-4 < rel_err(g_key, g_plain) < 0.3
    # jvp of the round trip is the identity.
    k = jnp.asarray(rng.normal(size=(3, 64)), jnp.float32)
    dk = jnp.asarray(rng.normal(size=(3, 64)), jnp.float32)
    from jax_tq.nn import _round_trip
    primal, tangent = jax.jvp(lambda k: _round_trip(k, codec), (k,), (dk,))
    np.testing.assert_array_equal(np.asarray(tangent), np.asarray(dk))
    np.testing.assert_array_equal(np.asarray(primal), np.asarray(tq.decompress(*tq.compress(k, codec), codec)))


def test_paged_attention_step_equals_write_then_decode(rng):
    codec = tq.TurboQuant(head_dim=64, bits=4)
    cache = tq.PagedKVCache.create(num_pages=4, page_size=8, num_kv_heads=2, k_codec=codec, v_codec=codec)
    k0 = jnp.asarray(rng.normal(size=(12, 2, 64)), jnp.float32)
    cache = tq.write_cache(cache, k0, -k0, jnp.arange(12, dtype=jnp.int32))
    q = jnp.asarray(rng.normal(size=(1, 4, 64)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 2, 64)), jnp.float32)
    tables, lens, slots = jnp.asarray([[0, 1, 2]], jnp.int32), jnp.asarray([13], jnp.int32), jnp.asarray([12], jnp.int32)
    out, new_cache = jax.jit(paged_attention, donate_argnums=3)(q, k, k, cache, slots, tables, lens)
    assert out.shape == q.shape and np.all(np.isfinite(np.asarray(out)))
    again = tq.paged_decode(q, new_cache, tables, lens)
    np.testing.assert_allclose(np.asarray(out), np.asarray(again), rtol=1e-6, atol=1e-6)
    assert float(new_cache.k_norms[1, 0, 4]) == pytest.approx(float(jnp.linalg.norm(k[0, 0])), rel=1e-6)
    # the variants reach the decode: the same as paged_decode with them, and not the plain output
    variants = dict(sliding_window=5, soft_cap=0.5, sinks=jnp.asarray(rng.normal(size=4), jnp.float32))
    varied, _ = paged_attention(q, k, k, new_cache, slots, tables, lens, **variants)  # the same slot again
    np.testing.assert_allclose(np.asarray(varied), np.asarray(tq.paged_decode(q, new_cache, tables, lens, **variants)),
                               rtol=1e-6, atol=1e-6)
    assert float(jnp.max(jnp.abs(varied - out))) > 1e-2


def test_paged_attention_refuses_k_v_without_one_token_per_sequence():
    codec = tq.TurboQuant(head_dim=64, bits=4)
    cache = tq.PagedKVCache.create(num_pages=4, page_size=8, num_kv_heads=2, k_codec=codec, v_codec=codec)
    q, kv = jnp.zeros((2, 4, 64)), jnp.zeros((2, 2, 64))
    tables, lens, slots = jnp.zeros((2, 1), jnp.int32), jnp.ones((2,), jnp.int32), jnp.arange(2, dtype=jnp.int32)
    jax.eval_shape(paged_attention, q, kv, kv, cache, slots, tables, lens)
    with pytest.raises(ValueError, match=r"paged_attention: k must hold one token per sequence, \[num_seqs=2"):
        jax.eval_shape(paged_attention, q, jnp.zeros((3, 2, 64)), jnp.zeros((3, 2, 64)), cache,
                       jnp.arange(3, dtype=jnp.int32), tables, lens)
    with pytest.raises(ValueError, match=r"paged_attention: v must hold one token per sequence"):
        jax.eval_shape(paged_attention, q, kv, jnp.zeros((3, 2, 64)), cache, slots, tables, lens)
    # float seq_lens: named here (on a window cache the error came from window_slot_mapping's positions)
    windowed = tq.PagedKVCache.create(num_pages=4, page_size=8, num_kv_heads=2, preset="k4v4", head_dim=64,
                                      num_windows=2)
    for c in (cache, windowed):
        with pytest.raises(TypeError, match=r"nn.paged_attention: seq_lens must be int32 \[num_seqs\], got float32"):
            jax.eval_shape(paged_attention, q, kv, kv, c, slots, tables, lens.astype(jnp.float32))


def test_linen_multihead_attention_with_turboquant_kv(rng):
    linen = pytest.importorskip("flax.linen")
    codec_k = tq.TurboQuant(head_dim=64, bits=4, seed=1)
    codec_v = tq.TurboQuant(head_dim=64, bits=3, seed=2)
    seen = {}

    def spy(q, k, v, *args, **kw):
        seen["k"], seen["v"] = k, v
        return linen.dot_product_attention(q, k, v, *args, **kw)

    plain = linen.MultiHeadDotProductAttention(num_heads=4, qkv_features=256)
    compressed = linen.MultiHeadDotProductAttention(num_heads=4, qkv_features=256,
                                                    attention_fn=turboquant_attention_fn(codec_k, codec_v, spy))
    x = jnp.asarray(rng.normal(size=(2, 10, 256)), jnp.float32)
    params = plain.init(jax.random.PRNGKey(0), x)
    out_plain, out_tq = plain.apply(params, x), compressed.apply(params, x)
    # The attention ran over decompress(compress(V)) of the module's own V projection.
    v_proj = linen.DenseGeneral(features=(4, 64), name="value").apply({"params": params["params"]["value"]}, x)
    v_hat = tq.decompress(*tq.compress(v_proj, codec_v), codec_v)
    np.testing.assert_allclose(np.asarray(seen["v"]), np.asarray(v_hat), rtol=1e-5, atol=1e-6)
    err = rel_err(out_tq, out_plain)
    assert 1e-4 < err < 0.3, f"4/3-bit K/V should perturb the output a little, got rel err {err}"


@pytest.mark.parametrize("base", ["nnx", "linen"])
def test_linen_attention_gets_the_mask_and_dropout(rng, base):
    """flax.linen passes mask / dropout arguments only to parameters it sees in attention_fn's
    signature: the wrapper must show the base function's. With a causal mask, position 0 must not
    depend on later tokens; dropout must change the output."""
    linen = pytest.importorskip("flax.linen")
    from flax import nnx
    codec = tq.TurboQuant(head_dim=64, bits=4, seed=1)
    base_fn = nnx.dot_product_attention if base == "nnx" else linen.dot_product_attention
    module = linen.MultiHeadDotProductAttention(num_heads=4, qkv_features=256, dropout_rate=0.5,
                                                attention_fn=turboquant_attention_fn(codec, codec, base_fn))
    x = jnp.asarray(rng.normal(size=(2, 6, 256)), jnp.float32)
    params = module.init(jax.random.PRNGKey(0), x, deterministic=True)
    causal = linen.make_causal_mask(jnp.ones((2, 6)))
    out = module.apply(params, x, mask=causal, deterministic=True)
    later_changed = x.at[:, 1:].add(1.0)
    np.testing.assert_allclose(np.asarray(module.apply(params, later_changed, mask=causal, deterministic=True)[:, 0]),
                               np.asarray(out[:, 0]), rtol=1e-5, atol=1e-6)
    assert rel_err(module.apply(params, x, deterministic=True), out) > 1e-2  # without the mask: different
    dropped = module.apply(params, x, mask=causal, deterministic=False, rngs={"dropout": jax.random.PRNGKey(1)})
    assert rel_err(dropped, out) > 1e-2


def test_linen_module_with_the_default_base_sows_its_attention_weights(rng):
    """A linen module that passes itself as ``module`` (sow_weights) gets linen's attention, whose
    weights land in 'intermediates' (nnx's would sow under a class key that breaks the state)."""
    linen = pytest.importorskip("flax.linen")
    codec = tq.TurboQuant(head_dim=64, bits=4, seed=1)
    module = linen.MultiHeadDotProductAttention(num_heads=2, qkv_features=128,
                                                attention_fn=turboquant_attention_fn(codec, codec))
    x = jnp.asarray(rng.normal(size=(1, 5, 128)), jnp.float32)
    params = module.init(jax.random.PRNGKey(0), x)
    out, state = module.apply(params, x, mutable=["intermediates"], sow_weights=True)
    (weights,) = state["intermediates"]["attention_weights"]
    assert weights.shape == (1, 2, 5, 5)
    np.testing.assert_allclose(np.asarray(weights.sum(-1)), 1.0, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(out), np.asarray(module.apply(params, x)), rtol=1e-6, atol=1e-6)
    _, state = module.apply(params, x, mutable=True, sow_weights=True)
    assert sorted(state) == ["intermediates", "params"]
    jax.tree_util.tree_map(jnp.shape, state)  # a usable pytree


def test_linen_module_with_the_default_base_gets_its_own_arguments(rng):
    """With the default base, a linen module passes its linen-only arguments (the einsum overrides,
    force_fp32_for_softmax) and runs linen's attention with or without sow_weights: the output
    equals linen's attention on the reconstructed K / V with the same overrides (the wrapper used
    to show nnx's signature, so linen dropped them, and ran nnx's attention unless sow_weights)."""
    linen = pytest.importorskip("flax.linen")
    import functools

    codec = tq.TurboQuant(head_dim=64, bits=4, seed=1)
    def tripled():  # a qk einsum override (linen instantiates the class it is given)
        return lambda subscripts, a, b, **kw: 3.0 * jnp.einsum(subscripts, a, b, **kw)
    seen = {}

    @functools.wraps(linen.dot_product_attention)  # linen passes what this signature names
    def reference(q, k, v, *args, **kw):
        seen["kwargs"] = sorted(kw)
        return linen.dot_product_attention(q, tq.decompress(*tq.compress(k, codec), codec, dtype=k.dtype),
                                           tq.decompress(*tq.compress(v, codec), codec, dtype=v.dtype), *args, **kw)

    def module(attention_fn):
        return linen.MultiHeadDotProductAttention(num_heads=2, qkv_features=128, dtype=jnp.bfloat16,
                                                  force_fp32_for_softmax=True,
                                                  qk_attn_weights_einsum_cls=tripled,
                                                  attn_weights_value_einsum_cls=lambda: jnp.einsum,
                                                  attention_fn=attention_fn)

    x = jnp.asarray(rng.normal(size=(2, 6, 128)), jnp.float32)
    want_mod, tq_mod = module(reference), module(turboquant_attention_fn(codec, codec))
    params = want_mod.init(jax.random.PRNGKey(0), x)
    want = want_mod.apply(params, x)
    assert "qk_attn_weights_einsum" in seen["kwargs"] and "force_fp32_for_softmax" in seen["kwargs"]
    np.testing.assert_array_equal(np.asarray(tq_mod.apply(params, x)), np.asarray(want))
    out, _ = tq_mod.apply(params, x, mutable=["intermediates"], sow_weights=True)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))


def test_attention_fn_names_the_tensor_with_the_wrong_head_dim():
    fn = turboquant_attention_fn(tq.TurboQuant(head_dim=64, bits=4), tq.TurboQuant(head_dim=64, bits=4))
    ok, short = jnp.zeros((1, 4, 2, 64)), jnp.zeros((1, 4, 2, 32))
    with pytest.raises(ValueError, match=r"turboquant_attention_fn: value must be .* got shape \(1, 4, 2, 32\)"):
        fn(ok, ok, short)
    with pytest.raises(ValueError, match=r"turboquant_attention_fn: key must be"):
        fn(ok, short, ok)


def test_attention_fn_names_the_tensor_with_the_wrong_dtype():
    fn = turboquant_attention_fn(tq.TurboQuant(head_dim=64, bits=4), tq.TurboQuant(head_dim=64, bits=4))
    ok = jnp.ones((1, 4, 2, 64))
    with pytest.raises(TypeError, match=r"turboquant_attention_fn: key must be float32, bfloat16 or float16, got int32"):
        fn(ok, ok.astype(jnp.int32), ok)
    with pytest.raises(TypeError, match=r"turboquant_attention_fn: value must be .* got uint8"):
        fn(ok, ok, ok.astype(jnp.uint8))


def test_missing_flax_names_what_to_install():
    """Without flax, jax_tq.models and the flax attention say what to install instead of a bare
    "No module named 'flax'" (run in a child process whose flax import fails)."""
    code = ("import sys; sys.modules['flax'] = None\n"
            "import jax_tq.nn as nn\n"
            "try:\n    nn._flax_modules()\nexcept ModuleNotFoundError as e:\n    print('nn:', e)\n"
            "try:\n    import jax_tq.models\nexcept ModuleNotFoundError as e:\n    print('models:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True).stdout
    assert "nn: jax_tq's flax integration needs flax: pip install flax" in out
    assert "models: jax_tq.models needs flax (and gguf, tokenizers to load weights)" in out
