"""Backend "auto" on the CPU: which ops lower to the C++ handler and which to XLA's code of the
reference (jax_tq.backend.auto_uses_reference), checked in the lowered module."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tq as tq
from jax_tq import backend

pytestmark = pytest.mark.skipif(not tq.kernels_available("cpu"), reason="no CPU kernels in this build")


def _custom_calls(fn, *args) -> set[str]:
    """The jax_tq FFI targets called by ``fn`` lowered for the CPU under backend "auto"."""
    with tq.use_backend("auto"):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cpu",)).as_text()
    return {t for t in ("jax_tq_compress", "jax_tq_decompress", "jax_tq_write_cache", "jax_tq_paged_decode",
                        "jax_tq_paged_prefill", "jax_tq_qjl_compress", "jax_tq_qjl_scores") if f"@{t}" in text
            or f'"{t}"' in text}


def _cache(preset_or_codecs, head_dim=128):
    if isinstance(preset_or_codecs, str):
        return tq.PagedKVCache.create(num_pages=64, page_size=16, num_kv_heads=8, preset=preset_or_codecs,
                                      head_dim=head_dim, num_windows=2)
    k_codec, v_codec = preset_or_codecs
    return tq.PagedKVCache.create(num_pages=64, page_size=16, num_kv_heads=8, k_codec=k_codec, v_codec=v_codec)


def _write(cache, num_tokens, rng):
    k = jnp.asarray(rng.normal(size=(num_tokens, 8, cache.head_dim)), jnp.bfloat16)
    slots = jnp.arange(num_tokens, dtype=jnp.int32)
    window_slots = slots % cache.window if cache.window else None
    return _custom_calls(lambda c, k, s: tq.write_cache(c, k, k, s, window_slots), cache, k, slots)


def test_plain_codec_ops_run_xla_code_on_the_cpu(rng):
    codec = tq.TurboQuant(128, 4, 0)
    x = jnp.asarray(rng.normal(size=(4096, 128)), jnp.float32)
    assert _custom_calls(lambda x: tq.compress(x, codec), x) == set()
    codes, norms = tq.compress(x, codec)
    assert _custom_calls(lambda c, n: tq.decompress(c, n, codec), codes, norms) == set()
    plain = _cache((codec, tq.TurboQuant(128, 4, 1)))
    assert _write(plain, 2048, rng) == set()


def test_fitted_writes_switch_to_the_handler_at_cpu_fit_rows(rng):
    cache = _cache("k4v4")
    tokens = backend.CPU_FIT_ROWS // cache.num_kv_heads
    assert _write(cache, tokens - 1, rng) == set()
    assert _write(cache, tokens, rng) == {"jax_tq_write_cache"}
    fitted = tq.TurboQuant(128, 4, 0, scale="fit")
    x = jnp.asarray(rng.normal(size=(backend.CPU_FIT_ROWS, 128)), jnp.float32)
    assert _custom_calls(lambda x: tq.compress(x, fitted), x) == {"jax_tq_compress"}


def test_qjl_ops_run_xla_code_and_attention_the_handlers(rng):
    codec = tq.TurboQuantProd(128, 4, 0)
    x = jnp.asarray(rng.normal(size=(256, 128)), jnp.float32)
    assert _custom_calls(lambda x: tq.qjl_compress(x, codec), x) == set()
    keys = tq.qjl_compress(x, codec)
    assert _custom_calls(lambda q: tq.qjl_scores(q, keys, codec), x[:4]) == set()
    cache = _cache("k4v4")
    tables = jnp.arange(64, dtype=jnp.int32).reshape(2, 32)
    lens = jnp.asarray([100, 37], jnp.int32)
    q = jnp.asarray(rng.normal(size=(2, 32, 128)), jnp.bfloat16)
    assert _custom_calls(lambda q: tq.paged_decode(q, cache, tables, lens), q) == {"jax_tq_paged_decode"}
    starts = jnp.asarray([0, 3, 5], jnp.int32)
    rows = jnp.asarray(rng.normal(size=(5, 32, 128)), jnp.bfloat16)
    assert _custom_calls(lambda q: tq.paged_prefill(q, cache, tables, lens, starts), rows) == {"jax_tq_paged_prefill"}


def test_the_policy_leaves_other_platforms_and_explicit_backends_alone(rng):
    aval = jax.core.ShapedArray((16, 128), jnp.float32)
    assert backend.auto_uses_reference("cpu", "jax_tq_compress", [aval], {"fit_scale": False})
    assert not backend.auto_uses_reference("cuda", "jax_tq_compress", [aval], {"fit_scale": False})
    assert not backend.auto_uses_reference("cpu", "jax_tq_paged_decode", [aval], {})
    codec = tq.TurboQuant(128, 4, 0)
    x = jnp.asarray(rng.normal(size=(32, 128)), jnp.float32)
    with tq.use_backend("ffi"):
        text = jax.jit(lambda x: tq.compress(x, codec)).trace(x).lower(lowering_platforms=("cpu",)).as_text()
    assert "jax_tq_compress" in text
