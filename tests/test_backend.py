"""Backend selection (use_backend, JAX_TQ_BACKEND, "ffi" where no kernel, a module without a target)
and the kernels' availability."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tq as tq
from jax_tq import _primitive_utils as pu
from jax_tq.compress import decompress_p
from jax_tq import backend
from jax_tq.paged_decode import paged_decode_p

from oracle import decode_setup, primitive_count, rel_err

pytestmark = pytest.mark.backend("ffi")


def test_backends_agree_and_context_manager_switches(rng):
    cache, tables, lens = decode_setup(rng)
    q = jnp.asarray(rng.normal(size=(4, 6, 64)), jnp.float32)
    ffi_out = tq.paged_decode(q, cache, tables, lens)
    with tq.use_backend("xla"):
        assert tq.get_backend() == "xla"
        jaxpr = jax.make_jaxpr(tq.paged_decode)(q, cache, tables, lens).jaxpr
        assert primitive_count(jaxpr, paged_decode_p) == 0
        xla_out = tq.paged_decode(q, cache, tables, lens)
    assert tq.get_backend() == "ffi"
    assert rel_err(ffi_out, xla_out) < 1e-5


def test_backend_env_var(monkeypatch):
    from jax_tq import backend
    token = backend._override.set(None)  # no use_backend context in force
    try:
        monkeypatch.setenv("JAX_TQ_BACKEND", "xla")
        assert tq.get_backend() == "xla"
        monkeypatch.delenv("JAX_TQ_BACKEND")
        assert tq.get_backend() == "auto"
        monkeypatch.setenv("JAX_TQ_BACKEND", "bogus")
        with pytest.raises(ValueError, match="JAX_TQ_BACKEND"):
            tq.get_backend()
    finally:
        backend._override.reset(token)
    with pytest.raises(ValueError, match="use_backend"):
        with tq.use_backend("cuda"):
            pass
    with pytest.raises(ValueError, match="use_backend"):  # at the call, not only on entering
        tq.use_backend("cuda")


def test_use_backend_without_with_warns_and_changes_nothing():
    before = tq.get_backend()
    with pytest.warns(RuntimeWarning, match="without `with`"):
        tq.use_backend("xla")
    assert tq.get_backend() == before
    scope = tq.use_backend("xla")
    with scope:  # the same scope entered twice, nested
        with scope:
            assert tq.get_backend() == "xla"
        assert tq.get_backend() == "xla"
    assert tq.get_backend() == before


def test_bare_use_backend_kept_until_exit_warns_cleanly():
    """A bare call's scope that lives until interpreter exit still warns (its message intact), not
    an AttributeError from a module torn down before it."""
    import subprocess
    import sys
    code = "import jax_tq as tq\nkeep = tq.use_backend('xla')\n"
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stderr
    assert "Error" not in err, err
    assert "without `with`" in err and "JAX_TQ_BACKEND" in err, err


def test_explicit_ffi_backend_raises_where_no_kernel(monkeypatch, rng):
    from jax_tq import _ffi
    monkeypatch.setattr(_ffi, "kernels_available", lambda platform: False)
    codec = tq.TurboQuant(head_dim=64, bits=4)
    x = jnp.asarray(rng.normal(size=(7, 64)), jnp.float32)  # a shape no other test compiles
    with pytest.raises(tq.BackendUnavailableError, match="ffi"):
        jax.jit(lambda x: tq.compress(x, codec))(x)
    with tq.use_backend("auto"):  # auto falls back to the reference (a fresh trace: jit keeps the backend it traced with)
        codes, _ = jax.jit(lambda x: tq.compress(x, codec))(x)
    with tq.use_backend("xla"):
        want, _ = tq.compress(x, codec)
    np.testing.assert_array_equal(np.asarray(codes), np.asarray(want))


def test_a_module_without_a_target_serves_it_with_the_reference(monkeypatch, rng):
    """A kernel module without some op's kernel (the CUDA module has no jax_tq_qjl_compress): backend
    "auto" runs that op's reference, "ffi" names the missing target."""
    from jax_tq import _ffi
    monkeypatch.setattr(_ffi, "has_target", lambda platform, target: target != "jax_tq_qjl_compress")
    codec = tq.TurboQuantProd(64, 4)
    x = jnp.asarray(rng.normal(size=(9, 64)), jnp.float32)
    with pytest.raises(tq.BackendUnavailableError, match="has no jax_tq_qjl_compress"):
        jax.jit(lambda x: tq.qjl_compress(x, codec))(x)
    with tq.use_backend("auto"):
        got = jax.jit(lambda x: tq.qjl_compress(x, codec))(x)
    with tq.use_backend("xla"):
        want = jax.jit(lambda x: tq.qjl_compress(x, codec))(x)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_public_kernel_availability():
    assert tq.kernels_available("cpu") and tq.kernels_unavailable_reason("cpu") == ""
    assert not tq.kernels_available("tpu") and "tpu" in tq.kernels_unavailable_reason("tpu")
    assert tq.kernels_available("cuda") == (tq.kernels_unavailable_reason("cuda") == "")


def test_kernels_built_against_a_newer_ffi_api_are_not_registered(monkeypatch):
    """A module compiled against newer XLA FFI headers than the installed jaxlib's (a build-isolated
    pip install can pull a newer jax into its build) is reported unavailable, with the fix named,
    instead of registered: XLA would refuse its handlers when starting a backend, taking every JAX
    computation down. Same major and an older or equal minor is fine."""
    from jax_tq import _cpu_ops, _ffi
    built = tuple(_cpu_ops.ffi_api_version())
    assert _ffi.installed_ffi_api_version() is not None
    assert built[0] == _ffi.installed_ffi_api_version()[0] and built[1] <= _ffi.installed_ffi_api_version()[1]
    for running in ((built[0], built[1]), (built[0], built[1] + 1)):
        monkeypatch.setattr(_ffi, "installed_ffi_api_version", lambda running=running: running)
        assert _ffi._ffi_api_mismatch(_cpu_ops, "jax_tq._cpu_ops") == ""
    for running in ((built[0], built[1] - 1), (built[0] + 1, 0)):
        monkeypatch.setattr(_ffi, "installed_ffi_api_version", lambda running=running: running)
        module, reason = _ffi._load.__wrapped__("cpu")  # the loader itself, past its cache
        assert module is None
        assert f"compiled against XLA FFI API {built[0]}.{built[1]}" in reason
        assert f"serves {running[0]}.{running[1]}" in reason and "--no-build-isolation" in reason
    monkeypatch.setattr(_ffi, "installed_ffi_api_version", lambda: None)  # headers not found: no check
    assert _ffi._ffi_api_mismatch(_cpu_ops, "jax_tq._cpu_ops") == ""


# ---- backend "auto" on the CPU: which ops lower to the C++ handler and which to XLA's code of the
# ---- reference (jax_tq.backend.auto_uses_reference), checked in the lowered module

_cpu_kernels = pytest.mark.skipif(not tq.kernels_available("cpu"), reason="no CPU kernels in this build")


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


@_cpu_kernels
def test_plain_codec_ops_run_xla_code_on_the_cpu(rng):
    codec = tq.TurboQuant(128, 4, 0)
    x = jnp.asarray(rng.normal(size=(4096, 128)), jnp.float32)
    assert _custom_calls(lambda x: tq.compress(x, codec), x) == set()
    codes, norms = tq.compress(x, codec)
    assert _custom_calls(lambda c, n: tq.decompress(c, n, codec), codes, norms) == set()
    plain = _cache((codec, tq.TurboQuant(128, 4, 1)))
    assert _write(plain, 2048, rng) == set()


@_cpu_kernels
def test_fitted_writes_run_the_handler_at_every_size(rng):
    cache = _cache("k4v4")
    for tokens in (1, 7, 128, 1024 // cache.num_kv_heads):
        assert _write(cache, tokens, rng) == {"jax_tq_write_cache"}
    fitted = tq.TurboQuant(128, 2, 0, scale="fit")
    for rows in (1, 1024):
        x = jnp.asarray(rng.normal(size=(rows, 128)), jnp.float32)
        assert _custom_calls(lambda x: tq.compress(x, fitted), x) == {"jax_tq_compress"}
    plain = _cache((tq.TurboQuant(128, 4, 0), tq.TurboQuant(128, 4, 1)))
    assert _write(plain, 1, rng) == set()  # a plain decode step: XLA's code


@_cpu_kernels
@pytest.mark.parametrize("backend_name", ["auto", "ffi"])
def test_float64_operands_take_the_reference_or_raise_at_trace_time(rng, backend_name):
    """Under x64 the float64 operands of an internal decode (paged_prefill_dense's) are the
    reference's: "auto" runs it, "ffi" refuses the call when it is lowered (not the handler at run
    time, which takes float32)."""
    codec = tq.TurboQuant(64, 4, 0)
    codes, norms = tq.compress(jnp.asarray(rng.normal(size=(8, 64)), jnp.float32), codec)
    with jax.enable_x64(True):
        operands = (codes, norms.astype(jnp.float64), jnp.asarray(codec.rotation, jnp.float64),
                    jnp.asarray(codec.centroids, jnp.float64))

        def fn(*ops):
            return pu.bind(decompress_p, *ops, bits=4, dtype=jnp.dtype(jnp.float64), backend=backend_name)[0]

        traced = jax.jit(fn).trace(*operands)
        if backend_name == "ffi":
            with pytest.raises(backend.BackendUnavailableError, match="float64 operands"):
                traced.lower(lowering_platforms=("cpu",))
            return
        assert "jax_tq_decompress" not in traced.lower(lowering_platforms=("cpu",)).as_text()
        got = np.asarray(jax.jit(fn)(*operands))
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, np.asarray(tq.decompress(codes, norms, codec), np.float64), rtol=1e-5, atol=1e-6)


@_cpu_kernels
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


@_cpu_kernels
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
