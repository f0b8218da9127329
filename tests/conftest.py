"""Shared test helpers: fresh random inputs, float64 oracle, poisoning."""
from __future__ import annotations

import contextlib
import gc
import os
import zlib

import jax
import numpy as np
import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "backend(name): runs under jax_tq.use_backend(name); a test's own mark wins "
                                       "over its module's, and backend(None) keeps the default")
    config.addinivalue_line("markers", "slow: among the slowest on 2 CPU cores; -m \"not slow\" leaves them out (docs/BUILD.md)")


def pytest_collection_modifyitems(config, items):
    if any(d.platform == "gpu" for d in jax.devices()):
        return
    skip = pytest.mark.skip(reason="no GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# One seed per run: chosen here unless given, and put in the environment so that pytest-xdist's
# workers, started after this file is imported, draw from the same one.
os.environ.setdefault("JAX_TQ_TEST_SEED", str(np.random.SeedSequence().entropy))
_SEED = np.random.SeedSequence(int(os.environ["JAX_TQ_TEST_SEED"]))


def _seed_line():
    return f"jax_tq random inputs: JAX_TQ_TEST_SEED={_SEED.entropy} reproduces this run"


def pytest_report_header(config):
    return _seed_line()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if exitstatus != 0:  # the header is not printed under -q (CI's run)
        terminalreporter.write_line(_seed_line())


@pytest.fixture
def rng(request):
    """A fresh generator per test; the seed is printed on failure via the test id + entropy."""
    seed = np.random.SeedSequence(entropy=_SEED.entropy, spawn_key=(zlib.crc32(request.node.nodeid.encode()),))
    return np.random.default_rng(seed)


@pytest.fixture(autouse=True, scope="module")
def fresh_jax_caches():
    """Empty JAX's tracing and compilation caches after each test file: they keep every program
    traced in the session alive, and the garbage collector's passes over those objects slowed
    tracing-heavy tests later in a full run by up to ~1.7x (and the process grew past 3.5 GiB)."""
    yield
    jax.clear_caches()
    gc.collect()


def slow_unless(cases, quick):
    """``cases`` for pytest.mark.parametrize with those for which ``quick(*case)`` is false marked slow
    (a tuple case stands for several arguments)."""
    def args(case):
        return case if isinstance(case, tuple) else (case,)
    return [case if quick(*args(case)) else pytest.param(*args(case), marks=pytest.mark.slow) for case in cases]


@pytest.fixture(autouse=True)
def marked_backend(request):
    """The backend a test's nearest ``backend`` mark names, for the whole test."""
    mark = request.node.get_closest_marker("backend")
    if mark is None or mark.args[0] is None:
        yield
        return
    import jax_tq as tq
    with tq.use_backend(mark.args[0]):
        yield


def poison_device_memory(nbytes: int) -> None:
    """Fill and free a NaN buffer so a kernel that skips output elements leaves NaN, not stale values."""
    n = max(1, nbytes // 4)
    buf = jax.numpy.full((n,), jax.numpy.nan, jax.numpy.float32)
    buf.block_until_ready()
    del buf


def kernels_built(platform: str, targets) -> bool:
    """Whether this install's module for ``platform`` has kernels for every FFI target in ``targets``
    (the CUDA module has no jax_tq_qjl_compress one)."""
    from jax_tq import _ffi
    return _ffi.kernels_available(platform) and all(_ffi.has_target(platform, t) for t in targets)


@contextlib.contextmanager
def kernel_backend(request, targets, gpu_targets=None):
    """Backend "ffi" where the default device's module has ``targets``' kernels, else "auto" (the
    kernels it has, the reference of the rest); a test marked gpu is skipped when the CUDA module lacks
    ``gpu_targets``' kernels (default ``targets``; empty: a test of no kernel)."""
    import jax_tq as tq
    platform = "cuda" if jax.devices()[0].platform == "gpu" else jax.devices()[0].platform
    gpu_targets = targets if gpu_targets is None else gpu_targets
    if "gpu" in request.keywords and gpu_targets and not kernels_built("cuda", gpu_targets):
        pytest.skip(f"jax_tq._cuda_ops is not loaded or has no kernel of {', '.join(gpu_targets)}")
    with tq.use_backend("ffi" if kernels_built(platform, targets) else "auto"):
        yield
