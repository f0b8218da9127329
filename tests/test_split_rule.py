"""The split-count rule (jax_tq.paged_decode.choose_num_splits) and the kernel selection it mirrors.
Pure Python: runs everywhere; the GPU tests check that every split count gives the same output."""
from __future__ import annotations

import importlib
import math

import pytest

pd = importlib.import_module("jax_tq.paged_decode")  # the module (jax_tq.paged_decode is also the function)


def _fill(units, splits, slots):
    waves = units * splits / slots
    return waves / math.ceil(waves)


@pytest.mark.parametrize("units,slots,expected", [
    (256, 396, 3),    # (32 seqs x 8 KV heads): 1.94 waves beats 1.29 (2 splits) and 2.59 (4)
    (64, 396, 6),     # (8, 8192): 3.88 waves
    (8, 396, 49),     # (1, 32768): one full wave of 392 CTAs
    (1024, 396, 1),   # more units than a wave already
    (1, 396, 392),    # 392 of 396 slots: within 2 points of a full wave (max_splits caps it in practice)
])
def test_whole_wave_splits_picks_the_best_filled_wave(units, slots, expected):
    got = pd.whole_wave_splits(units, slots, max_splits=10_000)
    assert got == expected
    # No split count up to 4 waves fills whole waves clearly (>= 2 points) better.
    best = max(_fill(units, s, slots) for s in range(1, got + 1))
    assert _fill(units, got, slots) >= best - 1e-12


def test_whole_wave_splits_respects_max_splits():
    assert pd.whole_wave_splits(8, 396, max_splits=16) <= 16
    assert pd.whole_wave_splits(8, 396, max_splits=0) == 1


def test_tensor_core_kernel_selection_follows_the_environment(monkeypatch):
    monkeypatch.delenv("JAX_TQ_CUDA_DECODE", raising=False)
    for group in (1, 2, 3, 4, 6, 8, 16):
        assert pd.uses_tensor_core_kernel(128, 4, 4, group) and pd.uses_tensor_core_kernel(64, 4, 4, group)
    for args in ((128, 2, 2, 4), (128, 4, 2, 1), (64, 2, 4, 8), (128, 3, 4, 4), (128, 4, 3, 4), (64, 3, 3, 1)):
        assert pd.uses_tensor_core_kernel(*args), args
    for args in ((192, 3, 3, 4), (192, 4, 2, 8), (192, 2, 2, 1)):
        assert not pd.uses_tensor_core_kernel(*args), args
    # head_dim 80 / 96 (K, V of 2, 3 or 4 bits), rows padded to 128, and 192 (K4V4, pairs of padded
    # halves, head tiles of 4): f16 products only
    assert pd.uses_tensor_core_kernel(80, 3, 3, 4) and pd.uses_tensor_core_kernel(80, 4, 2, 2)
    assert pd.uses_tensor_core_kernel(80, 2, 3, 8) and not pd.uses_tensor_core_kernel(80, 2, 2, 4, f16_products=False)
    assert pd.uses_tensor_core_kernel(96, 3, 3, 4) and pd.uses_tensor_core_kernel(96, 4, 3, 1)
    assert pd.uses_tensor_core_kernel(96, 3, 2, 8) and not pd.uses_tensor_core_kernel(96, 3, 3, 4, f16_products=False)
    assert pd.uses_tensor_core_kernel(80, 4, 4, 8) and pd.uses_tensor_core_kernel(80, 4, 4, 1)
    assert pd.uses_tensor_core_kernel(96, 4, 4, 8) and pd.uses_tensor_core_kernel(192, 4, 4, 4)
    assert pd.uses_tensor_core_kernel(96, 2, 2, 4) and pd.uses_tensor_core_kernel(96, 4, 2, 1)
    assert pd.uses_tensor_core_kernel(192, 4, 4, 8) and pd.uses_tensor_core_kernel(192, 4, 4, 16)
    assert not pd.uses_tensor_core_kernel(96, 4, 4, 4, f16_products=False)
    assert not pd.uses_tensor_core_kernel(80, 4, 4, 4, f16_products=False)
    # head_dim 256: v4's warp pairs, 2- / 3- / 4-bit K and V with float16 products only
    assert pd.uses_tensor_core_kernel(256, 4, 4, 8) and pd.uses_tensor_core_kernel(256, 4, 4, 1)
    assert pd.uses_tensor_core_kernel(256, 2, 2, 2) and pd.uses_tensor_core_kernel(256, 4, 2, 4)
    assert pd.uses_tensor_core_kernel(256, 3, 3, 2) and pd.uses_tensor_core_kernel(256, 4, 3, 4)
    assert not pd.uses_tensor_core_kernel(256, 4, 4, 4, f16_products=False)
    assert pd.uses_tensor_core_kernel(128, 4, 4, 4, f16_products=False)  # v3 there
    monkeypatch.setenv("JAX_TQ_CUDA_DECODE", "v1")
    assert not pd.uses_tensor_core_kernel(128, 4, 4, 4)
    monkeypatch.setenv("JAX_TQ_CUDA_DECODE", "v3")
    assert pd.uses_tensor_core_kernel(128, 4, 4, 4)
    assert not pd.uses_tensor_core_kernel(256, 4, 4, 4)  # no v3 at head_dim 256
    monkeypatch.setenv("JAX_TQ_CUDA_DECODE", "v5")
    assert pd.uses_tensor_core_kernel(256, 4, 4, 4)
    # a value the handler would take for the default is refused here rather than mismatching it
    for bad in ("V3", "v9", " v1", "default"):
        monkeypatch.setenv("JAX_TQ_CUDA_DECODE", bad)
        with pytest.raises(ValueError, match="JAX_TQ_CUDA_DECODE"):
            pd.uses_tensor_core_kernel(128, 4, 4, 4)
        with pytest.raises(ValueError, match="JAX_TQ_CUDA_DECODE"):
            pd.uses_v4(True)
    monkeypatch.delenv("JAX_TQ_CUDA_DECODE")
    # the warp pairs need 228 KB of shared memory per SM for 2 CTAs: not on sm_80 / sm_89
    for cc, fits in (((9, 0), True), ((10, 0), True), ((8, 0), False), ((8, 9), False)):
        monkeypatch.setattr(pd._compat, "gpu_compute_capability", lambda default=(9, 0), cc=cc: cc)
        assert pd.uses_tensor_core_kernel(256, 4, 4, 4) == fits, cc


@pytest.mark.parametrize("name,read,good,bad", [
    ("JAX_TQ_V4_ITEMS", "requested_v4_items", {"1": "1", "2": "2", "4": "4", "8": "8", "": ""},
     ("0", "one", "1 ", "3", "16")),
    ("JAX_TQ_TRACE_PHASES", "requested_trace_phases", {"0": False, "1": True, "": False}, ("true", "10", "1x", "on")),
])
def test_kernel_env_switches_are_read_exactly(monkeypatch, name, read, good, bad):
    """The CUDA handler reads these switches by exact value; any other value raises here instead of
    being taken for the default."""
    for value, expected in good.items():
        monkeypatch.setenv(name, value)
        assert getattr(pd, read)() == expected, value
    for value in bad:
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=name):
            getattr(pd, read)()


def test_choose_num_splits(monkeypatch):
    monkeypatch.delenv("JAX_TQ_CUDA_DECODE", raising=False)
    monkeypatch.setattr(pd._compat, "gpu_core_count", lambda default=132: 132)
    assert pd.choose_num_splits("cpu", 32, 8, 512, group=4) == 1
    # Tensor-core kernels, whole waves: v4 (f16 products) 2 CTAs per SM, v3 3 CTAs per SM.
    assert pd.choose_num_splits("cuda", 32, 8, 512, group=4) == 1        # 256 of 264 slots
    assert pd.choose_num_splits("cuda", 1, 8, 2048, group=4) == 33       # 264 of 264
    # A window folded into v4's loop: several splits bring one more CTA per unit (its own).
    assert pd.choose_num_splits("cuda", 1, 8, 2048, group=4, window=True) == 32  # (32 + 1) * 8 = 264
    assert pd.choose_num_splits("cuda", 32, 8, 512, group=4, window=True) == 1   # folded into split 0
    assert pd.choose_num_splits("cuda", 1, 8, 2048, group=4, head_dim=96, window=True) == \
        pd.choose_num_splits("cuda", 1, 8, 2048, group=4, head_dim=96)         # not folded there
    assert pd.choose_num_splits("cuda", 32, 8, 512, group=4, f16_products=False) == 3
    assert pd.choose_num_splits("cuda", 1, 8, 2048, group=4, f16_products=False) == 49
    monkeypatch.setenv("JAX_TQ_CUDA_DECODE", "v3")
    assert pd.choose_num_splits("cuda", 32, 8, 512, group=4) == 3
    monkeypatch.delenv("JAX_TQ_CUDA_DECODE")
    # Length bound: at least MIN_TOKENS_PER_SPLIT tokens (16 pages of 16) per split.
    assert pd.choose_num_splits("cuda", 1, 8, 64, group=4) == 4
    # head_dim 64 and groups of 1 / 2 run the tensor-core kernels too (one head tile per KV head).
    assert pd.choose_num_splits("cuda", 32, 8, 512, group=4, head_dim=64) == 1
    assert pd.choose_num_splits("cuda", 32, 8, 512, group=1) == 1
    # Other configurations (v1): one wave of 2 CTAs/SM (tiles of 4-8 heads) or 4 CTAs/SM.
    assert pd.choose_num_splits("cuda", 4, 8, 2048, group=4, head_dim=80, k_bits=3,
                                f16_products=False) == math.ceil(264 / 32)
    assert pd.choose_num_splits("cuda", 4, 8, 2048, group=1, head_dim=192, k_bits=3) == math.ceil(528 / 32)
    # head_dim 256 K4V4 (warp pairs): head tiles of 4, whole waves of 2 CTAs per SM
    assert pd.choose_num_splits("cuda", 32, 8, 512, group=2, head_dim=256) == 1
    assert pd.choose_num_splits("cuda", 8, 8, 2048, group=8, head_dim=256) == 2  # 128 units (4 at 128)
    assert pd.choose_num_splits("cuda", 8, 8, 2048, group=8, head_dim=192) == 2  # pairs: head tiles of 4
    assert pd.choose_num_splits("cuda", 8, 8, 2048, group=8, head_dim=128) == 4  # 64 units
    assert pd.choose_num_splits("cuda", 4, 8, 2048, group=1, head_dim=256, f16_products=False) == math.ceil(528 / 32)
    monkeypatch.setenv("JAX_TQ_CUDA_DECODE", "v1")
    assert pd.choose_num_splits("cuda", 32, 8, 512, group=4) == 2


def test_v3_residency_follows_shared_memory():
    assert pd.v3_ctas_per_sm((9, 0)) == 3      # H100 / H200: 228 KB per SM
    assert pd.v3_ctas_per_sm((8, 0)) == 2      # A100: 164 KB
    assert pd.v3_ctas_per_sm((8, 9)) == 1      # L4 / RTX 40xx: 100 KB
    assert pd.v3_ctas_per_sm((10, 0)) == 3     # B200: 228 KB
    assert pd.v3_ctas_per_sm((12, 0)) == 1     # RTX 50xx: 100 KB
    assert pd.v4_ctas_per_sm((12, 0)) == 1
    assert pd.v4_ctas_per_sm((9, 0)) == 2
    assert pd.v4_ctas_per_sm((8, 0)) == 2
    assert pd.v4_ctas_per_sm((8, 9)) == 1


def test_v4_ring_variant_fits_two_ctas_only_where_the_handler_runs_it():
    # the CUDA handler runs the ring variant only where 2 of its CTAs fit per SM (sm_90); the split
    # rule's 2 CTAs per SM then holds for whichever variant runs
    assert pd._shared_memory_per_sm((9, 0)) // pd.V4_RING_SMEM_PER_CTA == 2
    assert pd._shared_memory_per_sm((8, 0)) // pd.V4_RING_SMEM_PER_CTA == 1
    assert pd._shared_memory_per_sm((8, 0)) // pd.V4_SMEM_PER_CTA == 2


def test_choose_num_splits_on_an_a100(monkeypatch):
    monkeypatch.delenv("JAX_TQ_CUDA_DECODE", raising=False)
    monkeypatch.setattr(pd._compat, "gpu_core_count", lambda default=132: 108)
    monkeypatch.setattr(pd._compat, "gpu_compute_capability", lambda default=(9, 0): (8, 0))
    # 256 units on 2 x 108 slots: 3 splits fill 3.56 of 4 waves (89%), 4 splits 4.74 of 5 (95%);
    # the search stops at the first count reaching 4 waves.
    got = pd.choose_num_splits("cuda", 32, 8, 512, group=4)
    fills = {s: (256 * s / 216) / math.ceil(256 * s / 216) for s in range(1, 5)}
    assert got == max(fills, key=fills.get) == 4


def _rotation_precisions(monkeypatch, cuda_built, qdtype, backend="auto", head_dim=128, group=4, env=None):
    """The precisions of the dot products paged_decode traces (the two rotations, here)."""
    import jax
    import jax.numpy as jnp
    import jax_tq as tq
    from jax_tq import _ffi

    monkeypatch.setattr(_ffi, "kernels_available", lambda platform: cuda_built if platform == "cuda" else True)
    if env is None:
        monkeypatch.delenv("JAX_TQ_CUDA_DECODE", raising=False)
    else:
        monkeypatch.setenv("JAX_TQ_CUDA_DECODE", env)
    cache = tq.PagedKVCache.create(num_pages=2, page_size=16, num_kv_heads=2,
                                   k_codec=tq.TurboQuant(head_dim, 4), v_codec=tq.TurboQuant(head_dim, 4))
    q = jnp.zeros((1, 2 * group, head_dim), qdtype)
    tables, lens = jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32)
    with tq.use_backend(backend):
        jaxpr = jax.make_jaxpr(lambda q: tq.paged_decode(q, cache, tables, lens))(q)
    return [str(e.params["precision"]) for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]


def test_rotations_run_at_high_only_where_the_float16_kernel_runs(monkeypatch):
    for kw in ({}, {"head_dim": 64}, {"group": 1}, {"group": 2}):  # the float16 tensor-core kernel (v4)
        precisions = _rotation_precisions(monkeypatch, True, "bfloat16", **kw)
        assert len(precisions) == 2 and all("HIGH" in p and "HIGHEST" not in p for p in precisions), (kw, precisions)
    import jax
    with jax.default_matmul_precision("float32"):  # an enclosing request for float32 products wins
        precisions = _rotation_precisions(monkeypatch, True, "bfloat16")
    assert len(precisions) == 2 and all("HIGHEST" in p for p in precisions), precisions
    for args, kw in [((False, "bfloat16"), {}),                 # no CUDA kernels built: the reference runs on a GPU
                     ((True, "float32"), {}),                   # float32 queries: v3, float32-accurate
                     ((True, "bfloat16"), {"backend": "xla"}),  # the reference backend
                     ((True, "float16"), {"env": "v1"}),      # v1 forced
                     ((True, "bfloat16"), {"env": "v3"})]:      # v3 forced
        precisions = _rotation_precisions(monkeypatch, *args, **kw)
        assert len(precisions) == 2 and all("HIGHEST" in p for p in precisions), (args, kw, precisions)


@pytest.mark.parametrize("backend", ["xla", "ffi"])
@pytest.mark.parametrize("qdtype", ["float32", "bfloat16"])
def test_a_misspelt_cuda_decode_choice_raises_on_every_backend(monkeypatch, backend, qdtype):
    """JAX_TQ_CUDA_DECODE was read only where the kernel choice mattered (bf16 queries on a kernel
    backend): a typo went unnoticed for float32 queries and the xla backend (documentation trial)."""
    import jax.numpy as jnp

    import jax_tq as tq

    codec = tq.TurboQuant(head_dim=64, bits=4, seed=0)
    cache = tq.PagedKVCache.create(num_pages=2, page_size=8, num_kv_heads=1, k_codec=codec, v_codec=codec)
    q = jnp.ones((1, 2, 64), qdtype)
    tables, lens = jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32)
    monkeypatch.setenv("JAX_TQ_CUDA_DECODE", "v9")
    with tq.use_backend(backend), pytest.raises(ValueError, match="JAX_TQ_CUDA_DECODE='v9'"):
        tq.paged_decode(q, cache, tables, lens)
    monkeypatch.delenv("JAX_TQ_CUDA_DECODE")
    monkeypatch.setenv("JAX_TQ_V4_ITEMS", "0")
    with tq.use_backend(backend), pytest.raises(ValueError, match="JAX_TQ_V4_ITEMS='0'"):
        tq.paged_decode(q, cache, tables, lens)
    monkeypatch.delenv("JAX_TQ_V4_ITEMS")
    monkeypatch.setenv("JAX_TQ_TRACE_PHASES", "yes")
    with tq.use_backend(backend), pytest.raises(ValueError, match="JAX_TQ_TRACE_PHASES='yes'"):
        tq.paged_decode(q, cache, tables, lens)
    monkeypatch.delenv("JAX_TQ_TRACE_PHASES")
    with tq.use_backend(backend):
        assert tq.paged_decode(q, cache, tables, lens).shape == (1, 2, 64)
