"""The decode planner (cuda_ops/include/jax_tq/decode_plan.h): which kernel, split count and
rotations a call gets, through the CPU module's plan_decode for a described GPU (runs everywhere; the
GPU tests check the plan on the device and that every split count gives the same output)."""
from __future__ import annotations

import importlib
import math

import pytest

from jax_tq import _ffi

pd = importlib.import_module("jax_tq.paged_decode")  # the module (jax_tq.paged_decode is also the function)

H200 = dict(sm_count=132, f32_ctas_per_sm=3, f16_ctas_per_sm=2, ring_fits=True, items_fit=True)
A100 = dict(sm_count=108, f32_ctas_per_sm=2, f16_ctas_per_sm=2, ring_fits=False, items_fit=False)

pytestmark = pytest.mark.skipif(not _ffi.kernels_available("cpu"), reason="jax_tq._cpu_ops not built")


def plan(num_seqs, num_kv_heads, max_pages, *, group=4, head_dim=128, page_size=16, k_bits=4, v_bits=4,
         f16_products=True, window=False, hadamard=False, num_splits=0, kernel=0, variants=False, device=H200):
    return _ffi.module("cpu").plan_decode(num_seqs, num_kv_heads * group, num_kv_heads, head_dim, max_pages,
                                          page_size, k_bits, v_bits, f16_products, window, hadamard,
                                          num_splits=num_splits, kernel=kernel, variants=variants, device=device)


def splits(*args, **kw):
    return plan(*args, **kw)["num_splits"]


def kernel(*args, **kw):
    return plan(8, 8, 64, **kw)["kernel"]


def test_the_cpu_plan():
    got = plan(32, 8, 512, device=None, hadamard=True)
    assert got["kernel"] == "cpu" and got["num_splits"] == 1 and got["fused_rotation"]
    assert plan(32, 8, 512, device=None, hadamard=True, head_dim=64)["fused_rotation"]
    assert not plan(32, 8, 512, device=None, hadamard=True, head_dim=256)["fused_rotation"]
    assert plan(32, 8, 512, device=None, num_splits=7)["num_splits"] == 7
    assert plan(32, 8, 5, device=None, num_splits=7)["num_splits"] == 5  # at most max_pages


def test_kernel_families():
    for group in (1, 2, 3, 4, 6, 8, 16):
        for head_dim in (64, 128):
            assert kernel(group=group, head_dim=head_dim) == "tensor-core-f16"
            assert kernel(group=group, head_dim=head_dim, f16_products=False) == "tensor-core-f32"
    for kb, vb in ((2, 2), (4, 2), (2, 4), (3, 4), (4, 3), (3, 3)):
        assert kernel(k_bits=kb, v_bits=vb) == "tensor-core-f16"
        assert kernel(k_bits=kb, v_bits=vb, f16_products=False) == "tensor-core-f32"
        for head_dim in (80, 96, 256):  # the float16 kernel's ring (padded rows, warp pairs)
            assert kernel(head_dim=head_dim, k_bits=kb, v_bits=vb) == "tensor-core-f16"
            assert kernel(head_dim=head_dim, k_bits=kb, v_bits=vb, f16_products=False) == "cuda-core"
            assert kernel(head_dim=head_dim, k_bits=kb, v_bits=vb, device=A100) == "cuda-core"  # the ring does not fit
            assert kernel(head_dim=head_dim, k_bits=kb, v_bits=vb, page_size=8) == "cuda-core"  # whole-page tiles
        assert kernel(head_dim=192, k_bits=kb, v_bits=vb) == "cuda-core"  # 192: K4V4 only
    assert kernel(head_dim=192) == "tensor-core-f16"
    assert plan(8, 8, 64, head_dim=256)["halves"] == 2 and plan(8, 8, 64, head_dim=256, group=8)["head_tile"] == 4


def test_float16_kernel_variants():
    assert plan(32, 8, 512)["ring"] and plan(32, 8, 512)["items"] == 2           # (32, 8192): 2 rows per CTA
    assert plan(64, 8, 256)["items"] == 4 and plan(128, 8, 128)["items"] == 8   # (64, 4096), (128, 2048)
    assert plan(32, 8, 512, k_bits=2)["items"] == 1 and plan(32, 8, 512, k_bits=2)["ring"]  # items: K4V4 only
    assert plan(32, 8, 512, group=8)["items"] == 1                                  # and head tiles of 4
    register = plan(32, 8, 512, page_size=8)  # pages of 8 tokens: tiles in registers
    assert not register["ring"] and register["items"] == 1 and register["kernel"] == "tensor-core-f16"
    assert not plan(32, 8, 512, device=A100)["ring"]
    assert plan(32, 8, 512, window=True)["folds_window"] and not plan(32, 8, 512, window=True, head_dim=96)["folds_window"]
    assert not plan(32, 8, 512, window=True, f16_products=False)["folds_window"]
    assert plan(32, 8, 512)["f16_rounding"] and not plan(32, 8, 512, f16_products=False)["f16_rounding"]


def test_fused_rotation_where_a_tensor_core_kernel_runs_at_head_dim_64_and_128():
    for head_dim in (64, 128):
        for shape in (dict(), dict(f16_products=False), dict(page_size=8), dict(group=8), dict(k_bits=3, v_bits=2)):
            assert plan(8, 8, 64, hadamard=True, head_dim=head_dim, **shape)["fused_rotation"], (head_dim, shape)
        assert plan(1, 4, 2048, hadamard=True, head_dim=head_dim)["num_splits"] > 1  # several splits: the combine's
        assert plan(1, 4, 2048, hadamard=True, head_dim=head_dim)["fused_rotation"]
        assert plan(32, 8, 512, hadamard=True, head_dim=head_dim, window=True, variants=True)["fused_rotation"]
        assert not plan(8, 8, 64, hadamard=True, head_dim=head_dim, kernel=1)["fused_rotation"]  # CUDA-core: GEMMs
    for head_dim in (256, 96):  # the float16 kernel's warp pairs and padded rows: XLA GEMMs
        got = plan(8, 8, 64, hadamard=True, head_dim=head_dim)
        assert got["kernel"] == "tensor-core-f16" and not got["fused_rotation"], (head_dim, got)
    assert not plan(8, 8, 64)["fused_rotation"]


def test_the_attention_variants_run_on_the_float16_ring_or_the_cuda_core_kernel():
    """sliding_window / soft_cap / sinks on a GPU: the float16 kernel's ring at head_dim 64 / 128 with K
    and V of one width (decode_plan.h masks_fit), as it would run without them (same splits, items,
    fused rotation, folded window), whatever tensor-core family was requested; everywhere else the
    CUDA-core kernel (never the float32-accurate one); the CPU kernel serves them as it is."""
    for head_dim in (64, 128):
        for bits in (2, 3, 4):
            shape = dict(head_dim=head_dim, k_bits=bits, v_bits=bits, hadamard=True, window=True)
            plain = plan(32, 8, 512, **shape)
            assert plain["kernel"] == "tensor-core-f16" and plain["ring"], plain
            for requested in (0, 2, 3):
                assert plan(32, 8, 512, kernel=requested, variants=True, **shape) == plain
    assert plan(32, 8, 512, variants=True)["items"] > 1  # (32, 8192): the measured plan, items included
    cuda_core = [dict(k_bits=4, v_bits=3), dict(head_dim=96), dict(head_dim=256), dict(page_size=8),
                 dict(f16_products=False), dict(device=A100), dict(kernel=1)]
    for shape in cuda_core:
        got = plan(32, 8, 512, variants=True, hadamard=True, window=True, **shape)
        assert got["kernel"] == "cuda-core" and not got["fused_rotation"] and not got["folds_window"], (shape, got)
    assert plan(32, 8, 512, hadamard=True, variants=False, f16_products=False)["kernel"] == "tensor-core-f32"
    got = plan(32, 8, 512, device=None, hadamard=True, variants=True)
    assert got["kernel"] == "cpu" and got["fused_rotation"]


def test_a_requested_family_runs_wherever_it_can():
    assert kernel(kernel=1) == "cuda-core" and kernel(kernel=1, head_dim=256) == "cuda-core"
    assert kernel(kernel=2) == "tensor-core-f32" and not plan(8, 8, 64, kernel=2)["f16_rounding"]
    assert kernel(kernel=2, head_dim=256) == "tensor-core-f16"   # no float32-accurate kernel there
    assert kernel(kernel=3, f16_products=False) == "tensor-core-f32"  # float16 products were not allowed
    with pytest.raises(ValueError, match="kernel"):
        plan(8, 8, 64, kernel=4)


@pytest.mark.parametrize("units,slots,expected", [
    (256, 396, 3),    # (32 seqs x 8 KV heads): 1.94 waves beats 1.29 (2 splits) and 2.59 (4)
    (64, 396, 6),     # (8, 8192): 3.88 waves
    (8, 396, 49),     # (1, 32768): one full wave of 392 CTAs
    (1024, 396, 1),   # more units than a wave already
])
def test_whole_waves_of_the_float32_kernel(units, slots, expected):
    """3 resident CTAs per SM on 132 SMs; one (sequence, KV head) unit per CTA at a group of 4."""
    assert splits(units // 8, 8, 100_000, f16_products=False) == expected
    fill = lambda s: (units * s / slots) / math.ceil(units * s / slots)
    assert fill(expected) >= max(fill(s) for s in range(1, expected + 1)) - 0.02


def test_split_counts():
    # The float16 kernel: whole waves of 2 CTAs per SM; the float32-accurate one: 3.
    assert splits(32, 8, 512) == 1        # 256 of 264 slots
    assert splits(1, 8, 2048) == 33       # 264 of 264
    # A folded window: several splits bring one more CTA per unit (its own).
    assert splits(1, 8, 2048, window=True) == 32  # (32 + 1) * 8 = 264
    assert splits(32, 8, 512, window=True) == 1   # folded into split 0
    assert splits(1, 8, 2048, head_dim=96, window=True) == splits(1, 8, 2048, head_dim=96)  # not folded there
    assert splits(32, 8, 512, f16_products=False) == 3
    assert splits(1, 8, 2048, f16_products=False) == 49
    assert splits(32, 8, 512, kernel=2) == 3
    # Length bound: at least 256 tokens (16 pages of 16) per split.
    assert splits(1, 8, 64) == 4
    assert splits(32, 8, 512, head_dim=64) == 1 and splits(32, 8, 512, group=1) == 1
    # The CUDA-core kernel: one wave of 2 CTAs per SM (head tiles of 4 or 8) or 4 CTAs per SM.
    assert splits(4, 8, 2048, head_dim=80, k_bits=3, f16_products=False) == math.ceil(264 / 32)
    assert splits(4, 8, 2048, group=1, head_dim=192, k_bits=3) == math.ceil(528 / 32)
    assert splits(32, 8, 512, kernel=1) == 2
    # Warp pairs (head_dim 192 / 256): head tiles of 4.
    assert splits(32, 8, 512, group=2, head_dim=256) == 1
    assert splits(8, 8, 2048, group=8, head_dim=256) == 2  # 128 units
    assert splits(8, 8, 2048, group=8, head_dim=192) == 2
    assert splits(8, 8, 2048, group=8, head_dim=128) == 4  # 64 units
    assert splits(4, 8, 2048, group=1, head_dim=256, f16_products=False) == math.ceil(528 / 32)
    # A100: 108 SMs. 256 units on 2 x 108 slots: 3 splits fill 3.56 of 4 waves (89%), 4 splits
    # 4.74 of 5 (95%); the search stops at the first count reaching 4 waves.
    assert splits(32, 8, 512, device=A100) == 4
    assert splits(32, 8, 512, num_splits=5) == 5


def _rotation_precisions(monkeypatch, qdtype, backend="auto", head_dim=128, group=4, env=None, device=H200):
    """The precisions of the dot products paged_decode traces (the two rotations, here), planned as
    on a described GPU."""
    import jax
    import jax.numpy as jnp
    import jax_tq as tq

    class DescribedGpu:  # the CUDA module's plan_decode, for a described device
        @staticmethod
        def plan_decode(*args, **kw):
            return _ffi.module("cpu").plan_decode(*args, **kw, device=device)

    real_available = _ffi.kernels_available
    monkeypatch.setattr(_ffi, "kernels_available", lambda p: device is not None if p == "cuda" else real_available(p))
    monkeypatch.setattr(_ffi, "module", lambda p: DescribedGpu if p == "cuda" else _ffi._load(p)[0])
    if env is None:
        monkeypatch.delenv(pd.KERNEL_ENV, raising=False)
    else:
        monkeypatch.setenv(pd.KERNEL_ENV, env)
    cache = tq.PagedKVCache.create(num_pages=2, page_size=16, num_kv_heads=2,
                                   k_codec=tq.TurboQuant(head_dim, 4), v_codec=tq.TurboQuant(head_dim, 4))
    q = jnp.zeros((1, 2 * group, head_dim), qdtype)
    tables, lens = jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32)
    with tq.use_backend(backend):
        jaxpr = jax.make_jaxpr(lambda q: tq.paged_decode(q, cache, tables, lens))(q)
    return [str(e.params["precision"]) for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]


def test_rotations_run_at_high_only_where_the_float16_kernel_runs(monkeypatch):
    for kw in ({}, {"head_dim": 64}, {"group": 1}, {"group": 2}):
        precisions = _rotation_precisions(monkeypatch, "bfloat16", **kw)
        assert len(precisions) == 2 and all("HIGH" in p and "HIGHEST" not in p for p in precisions), (kw, precisions)
    import jax
    with jax.default_matmul_precision("float32"):  # an enclosing request for float32 products wins
        precisions = _rotation_precisions(monkeypatch, "bfloat16")
    assert len(precisions) == 2 and all("HIGHEST" in p for p in precisions), precisions
    for args, kw in [(("bfloat16",), {"device": None}),        # no CUDA kernels: the CPU kernel / reference
                     (("float32",), {}),                       # float32 queries: float32-accurate products
                     (("bfloat16",), {"backend": "xla"}),      # the reference backend
                     (("float16",), {"env": "cuda-core"}),
                     (("bfloat16",), {"env": "tensor-core-f32"})]:
        precisions = _rotation_precisions(monkeypatch, *args, **kw)
        assert len(precisions) == 2 and all("HIGHEST" in p for p in precisions), (args, kw, precisions)


@pytest.mark.parametrize("backend", ["xla", "ffi"])
@pytest.mark.parametrize("qdtype", ["float32", "bfloat16"])
def test_a_misspelt_kernel_choice_raises_on_every_backend(monkeypatch, backend, qdtype):
    import jax.numpy as jnp

    import jax_tq as tq

    codec = tq.TurboQuant(head_dim=64, bits=4, seed=0)
    cache = tq.PagedKVCache.create(num_pages=2, page_size=8, num_kv_heads=1, k_codec=codec, v_codec=codec)
    q = jnp.ones((1, 2, 64), qdtype)
    tables, lens = jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32)
    for bad in ("v1", "tensor-core", " cuda-core", "CUDA-CORE"):
        monkeypatch.setenv(pd.KERNEL_ENV, bad)
        with tq.use_backend(backend), pytest.raises(ValueError, match=f"JAX_TQ_DECODE_KERNEL={bad!r}"):
            tq.paged_decode(q, cache, tables, lens)
    for good, expected in (("", 0), ("cuda-core", 1), ("tensor-core-f32", 2), ("tensor-core-f16", 3)):
        monkeypatch.setenv(pd.KERNEL_ENV, good)
        assert pd.requested_kernel() == expected
        with tq.use_backend(backend):
            assert tq.paged_decode(q, cache, tables, lens).shape == (1, 2, 64)


def test_plan_decode_reports_what_paged_decode_runs():
    """jax_tq.plan_decode from paged_decode's arguments: the default device's plan (on a CPU the CPU
    kernel; fused rotation for the presets' Hadamard codecs at head_dim 64 and 128, one split for this short
    call unless asked), None under the xla backend, and the lowered call carries the rotation operand
    exactly when the plan says so."""
    import jax
    import jax.numpy as jnp

    import jax_tq as tq

    platform = jax.default_backend()
    for head_dim in (64, 128):
        cache = tq.PagedKVCache.create(num_pages=8, page_size=16, num_kv_heads=2, preset="k4v4", head_dim=head_dim,
                                       num_windows=2)
        q = jnp.ones((2, 8, head_dim), jnp.bfloat16)
        tables, lens = jnp.zeros((2, 4), jnp.int32), jnp.full((2,), 20, jnp.int32)
        got = tq.plan_decode(q, cache, tables)
        assert (got["kernel"] == "cpu") == (platform == "cpu")
        assert got["num_splits"] == 1 and got["fused_rotation"]
        assert tq.plan_decode(q, cache, tables, num_splits=3)["num_splits"] == 3
        assert tq.plan_decode(q, cache, tables, platform=platform) == got
        text = jax.jit(lambda q: tq.paged_decode(q, cache, tables, lens)).lower(q).as_text()
        assert (f"tensor<2x{head_dim}xi32>" in text) == got["fused_rotation"]
        with tq.use_backend("xla"):
            assert tq.plan_decode(q, cache, tables) is None


def test_invalid_problems_and_devices_raise():
    """A problem no kernel accepts, or a GPU description that makes no sense, is refused by name;
    absurd but valid sizes plan quickly (the wave search is bounded by the device, not max_pages)."""
    m = _ffi.module("cpu")
    ok = (8, 32, 8, 128, 64, 16, 4, 4, True, False, False)
    for i, bad, name in ((1, 30, "num_heads"), (2, 0, "num_kv_heads"), (3, 100, "head_dim"), (5, 0, "page_size"),
                         (6, 5, "k_bits"), (4, -1, "max_pages"), (0, -1, "num_seqs")):
        args = list(ok)
        args[i] = bad
        with pytest.raises(ValueError, match=name):
            m.plan_decode(*args)
    with pytest.raises(ValueError, match="num_splits"):
        m.plan_decode(*ok, num_splits=-3)
    for device, error, name in ((dict(H200, f16_ctas_per_sm=-1), ValueError, "f16_ctas_per_sm"),
                                (dict(H200, sm_count=0), ValueError, "sm_count"),
                                (dict(H200, sm_count=132.5), TypeError, "sm_count"),
                                ([1, 2], TypeError, "device")):
        with pytest.raises(error, match=name):
            m.plan_decode(*ok, device=device)
    huge = dict(H200, sm_count=1 << 16, f16_ctas_per_sm=64)
    assert m.plan_decode(1, 32, 8, 128, 2**31 - 1, 16, 4, 4, True, False, False, device=huge)["num_splits"] > 1


def test_plan_decode_checks_arguments_like_paged_decode():
    import jax.numpy as jnp

    import jax_tq as tq

    cache = tq.PagedKVCache.create(num_pages=8, page_size=16, num_kv_heads=2, preset="k4v4", head_dim=128,
                                   num_windows=2)
    q, tables = jnp.ones((2, 8, 128), jnp.bfloat16), jnp.zeros((2, 4), jnp.int32)
    for kw, error in ((dict(num_splits=0), ValueError), (dict(num_splits=2.5), TypeError),
                      (dict(num_splits=True), TypeError), (dict(platform="gpu"), ValueError)):
        with pytest.raises(error):
            tq.plan_decode(q, cache, tables, **kw)
    assert tq.plan_decode(q, cache, tables, num_splits=10**30)["num_splits"] == 4  # capped to max_pages
    for bad_q, bad_tables, match in ((jnp.ones((2, 7, 128)), tables, "GQA"), (jnp.ones((2, 8, 64)), tables, "head_dim"),
                                     (q, tables.astype(jnp.float32), "block_tables"),
                                     (q, jnp.zeros((5, 4), jnp.int32), "block_tables")):
        with pytest.raises((TypeError, ValueError), match=match):
            tq.plan_decode(bad_q, cache, bad_tables)
