"""Backend selection (use_backend, JAX_TQ_BACKEND, "ffi" where no kernel, a module without a target)
and the kernels' availability."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tq as tq
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
    """A kernel module built without some kernels (the CUDA module without JAX_TQ_CUDA_UNVERIFIED):
    backend "auto" runs those ops' reference, "ffi" names the missing target."""
    from jax_tq import _ffi
    monkeypatch.setattr(_ffi, "has_target", lambda platform, target: target != "jax_tq_qjl_scores")
    codec = tq.TurboQuantProd(64, 4)
    keys = tq.qjl_compress(jnp.asarray(rng.normal(size=(9, 64)), jnp.float32), codec)
    q = jnp.asarray(rng.normal(size=(3, 64)), jnp.float32)
    with pytest.raises(tq.BackendUnavailableError, match="built without jax_tq_qjl_scores"):
        jax.jit(lambda q: tq.qjl_scores(q, keys, codec))(q)
    with tq.use_backend("auto"):
        got = jax.jit(lambda q: tq.qjl_scores(q, keys, codec))(q)
    with tq.use_backend("xla"):
        want = tq.qjl_scores(q, keys, codec)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


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
