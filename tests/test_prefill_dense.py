"""paged_prefill as attention over the decoded span (jax_tq.paged_prefill_dense): the merge of the
prefix and the chunk's own causal attention, rows before a sequence's start, skipped slots (invalid
page ids, a window id of none), windows and NaN rows, against the float64 oracle; with XLA's exact
attention standing in for cuDNN on the CPU, and through jax_tq.paged_prefill (cuDNN) where marked gpu."""
from __future__ import annotations

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tq as tq
from jax_tq import _compat, paged_prefill_dense
from jax_tq.paged_decode import window_operands
from oracle import exact_attend, on_cpu, random_cache, random_tables, random_window_cache, rel_err, to_f64

prefill_module = importlib.import_module("jax_tq.paged_prefill")  # the module (jax_tq.paged_prefill is the function)


@pytest.fixture(autouse=True)
def on_the_cpu_unless_marked_gpu(request):
    """The unmarked tests compare the dense path in float64 (and float32 to 1e-5) with the CPU
    handlers: on a machine with a GPU they run on its CPU, where they mean the same (the CUDA
    kernels take no float64, and XLA's float32 products on the GPU default to TF32)."""
    if "gpu" in request.keywords or jax.devices()[0].platform == "cpu":
        yield
        return
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _operands(cache, q, tables, lens, starts, window_ids=None):
    """The primitive's operands (q rotated by K's Pi), in float64."""
    k, v = cache.k_codec, cache.v_codec
    windows = window_operands(cache, None if window_ids is None else jnp.asarray(window_ids, jnp.int32),
                              jnp.asarray(tables, jnp.int32), jnp.asarray(lens, jnp.int32), "paged_prefill")
    q_rot = to_f64(q) @ to_f64(k.rotation).T
    return (jnp.asarray(q_rot), cache.k_codes, jnp.asarray(to_f64(cache.k_norms)), cache.v_codes,
            jnp.asarray(to_f64(cache.v_norms)), jnp.asarray(to_f64(k.centroids)), jnp.asarray(to_f64(v.centroids)),
            jnp.asarray(tables), jnp.asarray(lens, jnp.int32), *windows, jnp.asarray(starts, jnp.int32))


def _both(cache, operands, sinks=None):
    """(dense path in float64 with the exact attention, the primitive's reference in float64, rounded to
    float32 at its end: the two agree to ~1e-7)."""
    scale = 1 / np.sqrt(cache.head_dim)
    bits = dict(k_bits=cache.k_codec.bits, v_bits=cache.v_codec.bits, scale=scale)
    got = paged_prefill_dense.dense_prefill(*operands, **bits, attend=exact_attend, dtype=jnp.float64, sinks=sinks)
    sink_operand = jnp.zeros((0,), jnp.float64) if sinks is None else sinks
    want = prefill_module._reference(*operands, sink_operand, **bits)[0]
    return np.asarray(got), np.asarray(to_f64(want))


@pytest.mark.parametrize("seq_lens,q_lens,lead,tail", [
    ((300,), (130,), 0, 0),                 # a chunk after 170 cached tokens
    ((64,), (64,), 2, 3),                   # a whole prompt, rows of no sequence around it
    ((40,), (55,), 0, 0),                   # 15 rows placed before the sequence's start
    ((129,), (1,), 4, 0),                   # one row (a decode row) after 128 cached tokens
    ((0,), (0,), 3, 2),                     # an idle sequence: every row 0
    ((300, 77, 5, 0, 129), (45, 77, 7, 0, 1), 3, 5),   # several sequences, one empty, one decode row
    ((90, 77, 300), (60, 77, 45), 1, 2),               # fresh prompts beside a chunk after cached tokens
    ((10, 50), (30, 50), 0, 0),                        # 20 rows of sequence 0 before its start
])
def test_dense_path_equals_the_float64_reference(rng, seq_lens, q_lens, lead, tail):
    with _compat.enable_x64():
        cache = random_cache(rng, num_pages=80, page_size=16, num_kv_heads=2, head_dim=64, k_bits=4, v_bits=3,
                             seed=int(rng.integers(1 << 16)))
        tables = random_tables(rng, seq_lens, 16, 80)
        starts = lead + np.concatenate([[0], np.cumsum(q_lens)])
        q = rng.normal(size=(int(starts[-1]) + tail, 6, 64))
        got, want = _both(cache, _operands(cache, q, tables, seq_lens, starts))
    assert rel_err(got, want) < 2e-7 if sum(q_lens) else np.all(got == 0)
    assert np.all(got[:lead] == 0) and np.all(got[got.shape[0] - tail:] == 0)


def test_dense_path_reads_a_decreasing_query_start_loc_as_its_running_maximum(rng):
    """An invalid query_start_loc (``jax_tq.checked`` reports it) gives finite rows of some sequence,
    those of no sequence 0: sequence 1's range [40, 25) is empty, sequence 2 owns 40 .. 59."""
    with _compat.enable_x64():
        cache = random_cache(rng, num_pages=40, page_size=16, num_kv_heads=2, head_dim=64, k_bits=4, v_bits=4,
                             seed=int(rng.integers(1 << 16)))
        tables = random_tables(rng, (100, 100, 100), 16, 40)
        q = rng.normal(size=(64, 4, 64))
        operands = _operands(cache, q, tables, (100, 100, 100), (0, 40, 25, 60))
        got = np.asarray(paged_prefill_dense.dense_prefill(*operands, k_bits=4, v_bits=4, scale=0.125,
                                                           attend=exact_attend, dtype=jnp.float64))
        fixed = _operands(cache, q, tables, (100, 100, 100), (0, 40, 40, 60))
        want = np.asarray(prefill_module._reference(*fixed, jnp.zeros((0,), jnp.float64), k_bits=4, v_bits=4,
                                                    scale=0.125)[0])
    assert np.all(np.isfinite(got)) and np.all(got[60:] == 0) and rel_err(got, want) < 2e-7


@pytest.mark.parametrize("bad_page,window_id", [(1, 2), (6, 1), (None, -1)])
def test_dense_path_skips_invalid_pages_and_missing_windows_and_keeps_nan_rows(rng, bad_page, window_id):
    """A page id outside the pool inside the prefix (page 1) or inside the chunk (page 6; skipped by
    the kernel: the zero slots' share is taken out of the sums), a window id of -1, a NaN query."""
    with _compat.enable_x64():
        cache = random_window_cache(rng, head_dim=64, num_kv_heads=2, page_size=16, num_pages=32, window=24,
                                    num_windows=3)
        cache = jax.tree.map(lambda a: a.astype(jnp.float64) if a.dtype == jnp.float32 else a, cache)
        tables = rng.permutation(32)[None, :8].astype(np.int32)
        if bad_page is not None:
            tables[0, bad_page] = 99 if bad_page == 1 else -7
        starts = np.asarray([0, 60], np.int32)
        q = rng.normal(size=(60, 4, 64))
        q[35, 1, 3] = np.nan
        got, want = _both(cache, _operands(cache, q, tables, (128,), starts, window_ids=[window_id]))
    nan = np.isnan(got)
    assert np.array_equal(nan, np.isnan(want)) and nan[35, 1].all() and nan.sum() == 64
    assert rel_err(np.where(nan, 0, got), np.where(nan, 0, want)) < 2e-7


def test_dense_path_with_sinks_equals_the_float64_reference(rng):
    """Per-head sink logits (one far above every score, one far below) join each row's denominator;
    with skipped slots (an invalid page), rows placed before a sequence's start, a chunk after cached
    tokens and a fresh prompt."""
    with _compat.enable_x64():
        cache = random_cache(rng, num_pages=80, page_size=16, num_kv_heads=2, head_dim=64, k_bits=4, v_bits=3,
                             seed=int(rng.integers(1 << 16)))
        tables = np.array(random_tables(rng, (100, 300, 40), 16, 80))
        tables[0, 3] = 500
        starts = np.asarray([0, 130, 150, 185])
        q = rng.normal(size=(185, 6, 64))
        sinks = jnp.asarray([0.5, -2.0, 40.0, -40.0, 3.0, 0.0], jnp.float64)
        got, want = _both(cache, _operands(cache, q, tables, (100, 300, 40), starts), sinks=sinks)
    assert rel_err(got, want) < 2e-7
    assert np.abs(got[:, 2]).max() < 1e-12 < np.abs(got[:, 3]).max()   # the sink of 40 takes every row's weight


@pytest.mark.parametrize("window_ids", [None, (2, 0, 1), (1, -1, 5)])
def test_dense_path_in_the_models_space_equals_the_reference_between_rotations(rng, window_ids):
    """With the codecs' rotations the decoded K / V are rotated back and q is used as it is: the result
    is the reference's out_rot @ Pi_v. No window: two chunks after cached tokens and a fresh prompt,
    GQA 3. A window (the presets' format): each sequence's last W tokens come from its ring, rotated
    back too; a window id of none (-1) or outside [0, num_windows) skips them; sequences longer than,
    equal to and shorter than W, GQA 2."""
    with _compat.enable_x64():
        if window_ids is None:
            cache = random_cache(rng, num_pages=80, page_size=16, num_kv_heads=2, head_dim=64, k_bits=3, v_bits=4,
                                 seed=int(rng.integers(1 << 16)))
            lens, starts, num_heads = (300, 90, 200), np.asarray([0, 100, 190, 290]), 6
        else:
            cache = random_window_cache(rng, head_dim=64, num_kv_heads=2, page_size=16, num_pages=80, window=24,
                                        num_windows=3, k_bits=3, v_bits=4)
            lens, starts, num_heads = (150, 24, 10), np.asarray([0, 40, 64, 70]), 4
        tables = random_tables(rng, lens, 16, 80)
        q = rng.normal(size=(int(starts[-1]), num_heads, 64))
        operands = _operands(cache, q, tables, lens, starts, window_ids=window_ids)
        k_rotation, v_rotation = to_f64(cache.k_codec.rotation), to_f64(cache.v_codec.rotation)
        got = paged_prefill_dense.dense_prefill(jnp.asarray(q), *operands[1:], k_bits=3, v_bits=4, scale=0.125,
                                                k_rotation=jnp.asarray(k_rotation), v_rotation=jnp.asarray(v_rotation),
                                                attend=exact_attend, dtype=jnp.float64)
        out_rot = prefill_module._reference(*operands, jnp.zeros((0,), jnp.float64), k_bits=3, v_bits=4, scale=0.125)[0]
    assert rel_err(np.asarray(got), to_f64(out_rot) @ v_rotation) < 2e-7


def test_dense_path_treats_non_finite_window_rows_as_the_kernel_does(rng):
    """A K window row with a NaN entry is a skipped key (its value too); a V row with an infinite
    entry makes NaN the rows of its KV head that see it (the CPU kernel's are inf or NaN there; the
    reference propagates both instead), in the model's space."""
    cache = random_window_cache(rng, head_dim=64, num_kv_heads=2, page_size=16, num_pages=40, window=24,
                                num_windows=3, k_bits=4, v_bits=3)
    k_window = np.array(cache.k_window.astype(jnp.float32))
    v_window = np.array(cache.v_window.astype(jnp.float32))
    k_window[0, 1, 7, 5] = np.nan     # window 0 (sequence 1), KV head 1, ring entry 7
    v_window[2, 0, 3, 9] = np.inf     # window 2 (sequence 0), KV head 0, ring entry 3 (position 147)
    cache = dataclasses.replace(cache, k_window=jnp.asarray(k_window, jnp.bfloat16),
                                v_window=jnp.asarray(v_window, jnp.bfloat16))
    lens = jnp.asarray((150, 24, 10), jnp.int32)
    tables = jnp.asarray(random_tables(rng, (150, 24, 10), 16, 40))
    starts = jnp.asarray([0, 40, 64, 70], jnp.int32)
    q = jnp.asarray(rng.normal(size=(70, 4, 64)), jnp.float32)
    k_rotation, v_rotation = cache.k_codec.rotation, cache.v_codec.rotation
    ops = (q @ k_rotation.T, cache.k_codes, cache.k_norms, cache.v_codes, cache.v_norms, cache.k_codec.centroids,
           cache.v_codec.centroids, tables, lens,
           *window_operands(cache, jnp.asarray([2, 0, 1], jnp.int32), tables, lens, "paged_prefill"), starts)
    with tq.use_backend("ffi"):
        out_rot = np.asarray(prefill_module._prefill(*ops, jnp.zeros((0,), jnp.float32), 4, 3, 0.125, False, "ffi",
                                                     0, 0.0), np.float64)
    with np.errstate(invalid="ignore"):   # inf x 0
        kernel = out_rot @ np.asarray(v_rotation, np.float64)
    dense = np.asarray(paged_prefill_dense.dense_prefill(q, *ops[1:], k_bits=4, v_bits=3, scale=0.125,
                                                         k_rotation=k_rotation, v_rotation=v_rotation,
                                                         attend=exact_attend, dtype=jnp.float32))
    bad = ~np.isfinite(kernel).all(axis=-1)   # [T, H]: the kernel's rows reached by the infinity (inf or NaN)
    assert np.array_equal(np.isnan(dense).all(axis=-1), bad) and np.isfinite(dense[~bad]).all()
    assert np.array_equal(np.nonzero(bad.any(axis=1))[0], [37, 38, 39]) and not bad[:, 2:].any()
    assert rel_err(dense[~bad], kernel[~bad]) < 1e-5


def test_dense_path_in_float32_is_close_to_the_float64_reference(rng):
    cache = random_cache(rng, num_pages=64, page_size=16, num_kv_heads=2, head_dim=128, k_bits=4, v_bits=4,
                         seed=int(rng.integers(1 << 16)))
    tables = random_tables(rng, (700,), 16, 64)
    q = rng.normal(size=(200, 8, 128))
    operands = _operands(cache, q, tables, (700,), (0, 200))
    got = paged_prefill_dense.dense_prefill(
        *(o.astype(jnp.float32) if o.dtype == jnp.float64 else o for o in operands), k_bits=4, v_bits=4,
        scale=1 / np.sqrt(128), attend=exact_attend, dtype=jnp.float32)
    with _compat.enable_x64():
        _, want = _both(cache, _operands(cache, q, tables, (700,), (0, 200)))
    assert got.dtype == jnp.float32 and rel_err(got, want) < 1e-5


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (4, 4), (6, 1)])
def test_packed_keys_are_read_at_their_segments_offsets(num_heads, num_kv_heads):
    """What JAX's cuDNN call hands cuDNN for the keys _compat passes: each segment's element offset is
    its token offset x the keys' own heads x head_dim (JAX before jax-ml/jax#39521 scaled it by the
    query's heads: then the keys are repeated per query head)."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn
    q = jnp.zeros((1, 40, num_heads, 16), jnp.bfloat16)
    k = jnp.zeros((1, 40, num_kv_heads, 16), jnp.bfloat16)
    keys, values = _compat.packed_keys(q, k, k)
    assert keys.shape == values.shape and keys.shape[2] in (num_kv_heads, num_heads)
    offsets = jnp.asarray([[0, 7, 30, -1]], jnp.int32)
    lens = jnp.asarray([[7, 20, 10]], jnp.int32)
    kv = cudnn._fix_seqlen_offsets(lens, lens, offsets, offsets, q, keys)[3]
    np.testing.assert_array_equal(np.asarray(kv)[0, :3], np.asarray([0, 7, 30]) * keys.shape[2] * 16)


def test_the_offset_rule_is_asked_the_same_inside_a_trace():
    """First asked while jit traces the dense path (as it is in use), the answer is JAX's eager one."""
    _compat.packed_kv_offsets_follow_key_heads.cache_clear()
    inside = jax.jit(lambda x: x + _compat.packed_kv_offsets_follow_key_heads())(0)
    _compat.packed_kv_offsets_follow_key_heads.cache_clear()
    with jax.ensure_compile_time_eval():
        outside = _compat.packed_kv_offsets_follow_key_heads()
    from jax._src.cudnn import fused_attention_stablehlo as cudnn
    offsets = np.asarray([[0, 3, -1]], np.int32)
    lens = np.asarray([[3, 3]], np.int32)
    scaled = cudnn._fix_seqlen_offsets(lens, lens, offsets, offsets, jnp.zeros((1, 6, 4, 2)), jnp.zeros((1, 6, 1, 2)))[3]
    assert bool(inside) == outside == (int(np.asarray(scaled)[0, 1]) == 3 * 1 * 2)


def test_packing_fits_int32_element_offsets_and_the_statistics():
    """JAX hands cuDNN int32 element offsets (token x heads x head_dim): a packing past 2^31 elements of
    q or of the keys as handed (KV heads repeated where JAX needs it) does not fit; nor do statistics
    past MAX_STATS_BYTES."""
    fits = paged_prefill_dense.packing_fits
    handed = _compat.packed_kv_heads(32, 1)
    assert fits(1024, 32, (2**31 - 1) // (handed * 128), 1, 128, 9)
    assert not fits(1024, 32, 2**31 // (handed * 128), 1, 128, 9)
    assert fits(2**31 // (32 * 128) - 1, 32, 16, 8, 128, 1) and not fits(2**31 // (32 * 128), 32, 16, 8, 128, 1)
    limit = paged_prefill_dense.MAX_STATS_BYTES
    assert fits(1024, 32, 4096, 8, 128, limit // (32 * 1024 * 4))
    assert not fits(1024, 32, 4096, 8, 128, limit // (32 * 1024 * 4) + 1)


def test_dense_path_is_planned_for_long_bf16_sequences_only(monkeypatch):
    """The one place that chooses it: backend auto, bf16 queries with default precision, DENSE_MIN_ROWS
    rows per sequence or more, a span of 1 .. DENSE_MAX_SPAN_BYTES (every sequence's), head_dim 64 /
    128, no sliding window or soft cap, cuDNN's packed attention present."""
    monkeypatch.setattr(_compat, "has_cudnn_attention", lambda: True)
    cache = tq.PagedKVCache.create(num_pages=8, page_size=16, num_kv_heads=2, k_codec=tq.TurboQuant(head_dim=128),
                                   v_codec=tq.TurboQuant(head_dim=128, seed=1))
    rows = prefill_module.DENSE_MIN_ROWS
    q = jnp.zeros((2 * rows, 4, 128), jnp.bfloat16)
    plan = prefill_module._dense_planned
    assert plan(q, cache, 1, 64, True, "auto", False) and plan(q[:rows], cache, 1, 64, True, "auto", False)
    assert plan(q, cache, 2, 64, True, "auto", False) and not plan(q[:-1], cache, 2, 64, True, "auto", False)
    assert not plan(q[:rows - 1], cache, 1, 64, True, "auto", False)
    handed = _compat.packed_kv_heads(4, 2)   # 2, or 4 where JAX's packed call needs the KV heads repeated
    too_many_pages = prefill_module.DENSE_MAX_SPAN_BYTES // (2 * 16 * handed * 128 * 2) + 1
    assert plan(q, cache, 1, too_many_pages - 1, True, "auto", False)
    assert not plan(q, cache, 1, too_many_pages, True, "auto", False)
    assert not plan(q, cache, 2, too_many_pages // 2 + 1, True, "auto", False)   # the span counts every sequence
    monkeypatch.setattr(paged_prefill_dense, "MAX_STATS_BYTES", 3 * 4 * 2 * rows * 4 - 1)   # [3, 4, 2 rows] f32
    assert plan(q, cache, 1, 64, True, "auto", False) and not plan(q, cache, 2, 64, True, "auto", False)
    monkeypatch.undo()
    monkeypatch.setattr(_compat, "has_cudnn_attention", lambda: True)
    assert not plan(q, cache, 1, 0, True, "auto", False)
    assert not plan(q, cache, 1, 64, False, "auto", False)
    assert not plan(q, cache, 1, 64, True, "ffi", False)
    assert not plan(q.astype(jnp.float16), cache, 1, 64, True, "auto", False)
    assert not plan(q, cache, 1, 64, True, "auto", True)
    monkeypatch.setattr(_compat, "has_cudnn_attention", lambda: False)
    assert not plan(q, cache, 1, 64, True, "auto", False)


@pytest.mark.parametrize("q_lens,dense", [((300,), True), ((200, 100), True), ((150, 100, 50), False)])
def test_paged_prefill_takes_the_dense_path_for_long_sequences(monkeypatch, rng, q_lens, dense):
    """Through jax_tq.paged_prefill with the CUDA branch taken on the CPU (XLA's exact attention in
    cuDNN's place): 300 rows of one or two sequences run over the decoded span, of three sequences
    (100 per sequence, under DENSE_MIN_ROWS) the kernel; all match the float64 oracle."""
    from test_prefill import prefill_f64
    monkeypatch.setattr(_compat, "has_cudnn_attention", lambda: True)
    monkeypatch.setattr(_compat, "cudnn_attention_with_lse", exact_attend)
    monkeypatch.setattr(jax.lax, "platform_dependent", lambda *args, cuda, default: cuda(*args))
    seq_lens = (400, 300, 60)[:len(q_lens)]
    cache = random_cache(rng, num_pages=80, page_size=16, num_kv_heads=2, head_dim=64, k_bits=4, v_bits=4,
                         seed=int(rng.integers(1 << 16)))
    tables = random_tables(rng, seq_lens, 16, 80)
    starts = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    q = jnp.asarray(rng.normal(size=(300, 4, 64)), jnp.bfloat16)
    lens = jnp.asarray(seq_lens, jnp.int32)
    with tq.use_backend("auto"):
        got = np.asarray(tq.paged_prefill(q, cache, tables, lens, starts), np.float32)
    assert rel_err(got, prefill_f64(q.astype(jnp.float32), cache, tables, lens, starts)) < 1e-2
    with tq.use_backend("ffi"):
        kernel = np.asarray(tq.paged_prefill(q, cache, tables, lens, starts), np.float32)
    # The kernel's result exactly where it runs; the bfloat16 span's and rotations' rounding where not.
    assert (rel_err(got, kernel) > 1e-4) if dense else np.array_equal(got, kernel)
    monkeypatch.undo()   # the dense plan lowered for the CPU: its default branch, the kernel between bf16 rotations
    monkeypatch.setattr(_compat, "has_cudnn_attention", lambda: True)
    with tq.use_backend("auto"):
        elsewhere = np.asarray(tq.paged_prefill(q, cache, tables, lens, starts), np.float32)
    assert (rel_err(elsewhere, kernel) < 1e-2) if dense else np.array_equal(elsewhere, kernel)


def test_dense_path_gradient_is_the_references(monkeypatch, rng):
    """jax.grad through the dense plan (q, K norms, V norms, sinks) is the reference's, as on every
    other path (XLA's backend: the reference's own gradient, in float32)."""
    monkeypatch.setattr(_compat, "has_cudnn_attention", lambda: True)
    monkeypatch.setattr(_compat, "cudnn_attention_with_lse", exact_attend)
    monkeypatch.setattr(jax.lax, "platform_dependent", lambda *args, cuda, default: cuda(*args))
    cache = random_cache(rng, num_pages=40, page_size=16, num_kv_heads=2, head_dim=64, k_bits=4, v_bits=4,
                         seed=int(rng.integers(1 << 16)))
    tables, lens = random_tables(rng, (300, 180), 16, 40), jnp.asarray([300, 180], jnp.int32)
    starts = jnp.asarray([0, 150, 330], jnp.int32)
    q = jnp.asarray(rng.normal(size=(330, 4, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    sinks = jnp.asarray(rng.normal(size=(4,)), jnp.float32)

    def loss(q, k_norms, v_norms, sinks):
        c = dataclasses.replace(cache, k_norms=k_norms, v_norms=v_norms)
        return jnp.sum(w * tq.paged_prefill(q, c, tables, lens, starts, sinks=sinks).astype(jnp.float32))

    args = (q, cache.k_norms, cache.v_norms, sinks)
    with tq.use_backend("auto"):
        assert "jax_tq_paged_prefill" not in jax.jit(loss).lower(*args).as_text()   # the dense plan
        got = jax.grad(loss, argnums=(0, 1, 2, 3))(*args)
    with tq.use_backend("xla"):
        want = jax.grad(loss, argnums=(0, 1, 2, 3))(*args)
    assert got[0].dtype == jnp.bfloat16
    for g, r in zip(got, want):
        assert rel_err(np.asarray(g, np.float32), np.asarray(r, np.float32)) < 1e-6


@pytest.mark.parametrize("packed", [True, False])
def test_dense_path_under_vmap_with_batched_query_start_loc(monkeypatch, rng, packed):
    """vmap over the queries and query_start_loc of two sequences (the elements' segments packed into
    one attention call; not packed: a map over the elements, where the packing would not fit): each
    result is its own call's and the float64 oracle's; no kernel call is traced."""
    monkeypatch.setattr(_compat, "has_cudnn_attention", lambda: True)
    if not packed:   # the statistics of one element's calls fit, of two packed ones not
        monkeypatch.setattr(paged_prefill_dense, "MAX_STATS_BYTES", 3 * 4 * 280 * 4)
    mapped = []
    lax_map = jax.lax.map
    monkeypatch.setattr(jax.lax, "map", lambda *a, **k: mapped.append(1) or lax_map(*a, **k))
    monkeypatch.setattr(_compat, "cudnn_attention_with_lse", exact_attend)
    monkeypatch.setattr(jax.lax, "platform_dependent", lambda *args, cuda, default: cuda(*args))
    cache = random_cache(rng, num_pages=64, page_size=16, num_kv_heads=2, head_dim=64, k_bits=4, v_bits=4,
                         seed=int(rng.integers(1 << 16)))
    lens = jnp.asarray([300, 280], jnp.int32)
    tables = random_tables(rng, (300, 280), 16, 64)
    q = jnp.asarray(rng.normal(size=(2, 280, 4, 64)), jnp.bfloat16)
    starts = jnp.asarray([[0, 150, 280], [0, 0, 280]], jnp.int32)   # two chunks; one fresh prompt
    from test_prefill import prefill_f64
    with tq.use_backend("auto"):
        call = jax.jit(lambda q, s: tq.paged_prefill(q, cache, tables, lens, s))
        assert "jax_tq_paged_prefill" not in call.lower(q[0], starts[0]).as_text()   # the dense path
        both = np.asarray(jax.vmap(call)(q, starts), np.float32)
        assert bool(mapped) != packed
        for i in range(2):
            # bfloat16 rotations: XLA may round a batched and an unbatched product differently
            assert rel_err(both[i], np.asarray(call(q[i], starts[i]), np.float32)) < 1e-3
            assert rel_err(both[i], prefill_f64(q[i].astype(jnp.float32), cache, tables, lens, starts[i])) < 1e-2


def test_dense_path_treats_non_finite_norms_as_the_kernel_does(rng):
    """A NaN K norm is a skipped token (weight 0, its V norm too: a NaN token's) and a NaN V norm makes
    NaN the rows of its KV head that see it (docs/USAGE.md), as the CPU kernel does: in the prefix
    (every row sees it) and in the chunk (rows at or after it)."""
    cache = random_cache(rng, num_pages=16, page_size=16, num_kv_heads=2, head_dim=64, k_bits=4, v_bits=4,
                         seed=int(rng.integers(1 << 16)))
    tables = jnp.arange(8, dtype=jnp.int32)[None, :]
    q_rot = jnp.asarray(rng.normal(size=(40, 4, 64)), jnp.float32)
    lens, starts = jnp.asarray([100], jnp.int32), jnp.asarray([0, 40], jnp.int32)
    for names, page, slot, head in ((("k_norms",), 1, 4, 0), (("k_norms",), 5, 10, 1), (("v_norms",), 5, 10, 1),
                                    (("v_norms",), 0, 3, 0), (("k_norms", "v_norms"), 2, 7, 1)):
        changed = {}
        for name in names:   # both: what write_cache stores for a NaN token (a skipped key, no NaN)
            norms = np.array(getattr(cache, name))
            norms[page, head, slot] = np.nan
            changed[name] = jnp.asarray(norms)
        bad = dataclasses.replace(cache, **changed)
        ops = (q_rot, bad.k_codes, bad.k_norms, bad.v_codes, bad.v_norms, bad.k_codec.centroids,
               bad.v_codec.centroids, tables, lens, *window_operands(bad, None, tables, lens, "paged_prefill"), starts)
        with tq.use_backend("ffi"):
            kernel = np.asarray(prefill_module._prefill(*ops, jnp.zeros((0,), jnp.float32), 4, 4, 0.125, False, "ffi",
                                                        0, 0.0))
        dense = np.asarray(paged_prefill_dense.dense_prefill(*ops, k_bits=4, v_bits=4, scale=0.125,
                                                             attend=exact_attend, dtype=jnp.float32))
        nan = np.isnan(kernel)
        assert np.array_equal(np.isnan(dense), nan) and (nan.any() == (names == ("v_norms",)))
        assert rel_err(np.where(nan, 0, dense), np.where(nan, 0, kernel)) < 1e-5


# ----------------------------------------------------------------------------- CUDA: cuDNN over the span

@pytest.mark.gpu
@pytest.mark.parametrize("seq_len,q_len,lead,tail,bad_page", [
    (2048, 2048, 0, 0, None), (3000, 1000, 0, 0, None), (500, 700, 4, 9, None), (1000, 300, 0, 0, 5),
    (1000, 300, 0, 0, 60)])
def test_gpu_dense_prefill_matches_the_float64_oracle(rng, seq_len, q_len, lead, tail, bad_page):
    """jax_tq.paged_prefill with bf16 queries on one sequence (the planned dense path): a whole prompt,
    a chunk after cached tokens, rows before the start, a page id outside the pool in the prefix
    (page 5) or in the chunk (page 60); rows whose query holds NaN or an infinity are NaN."""
    from test_prefill import prefill_f64
    cache = random_cache(rng, num_pages=200, page_size=16, num_kv_heads=2, head_dim=128, k_bits=4, v_bits=4,
                         seed=int(rng.integers(1 << 16)))
    tables = np.array(random_tables(rng, (seq_len,), 16, 200))
    if bad_page is not None:
        tables[0, bad_page] = 1000
    starts = np.asarray([lead, lead + q_len], np.int32)
    q = jnp.asarray(rng.normal(size=(lead + q_len + tail, 8, 128)), jnp.bfloat16)
    q = q.at[lead + q_len // 2, 3, 0].set(jnp.nan)
    # +inf and -inf in one coordinate of two heads of the first row (one KV head): on a row that
    # sees one key, one of them makes every score -inf (cuDNN's lse -inf, its output finite)
    q = q.at[lead, 0, 7].set(jnp.inf).at[lead, 1, 7].set(-jnp.inf)
    call = jax.jit(tq.paged_prefill)
    args = (q, cache, jnp.asarray(tables), jnp.asarray([seq_len], jnp.int32), jnp.asarray(starts))
    hlo = call.lower(*args).as_text()
    assert "cudnn" in hlo and "jax_tq_paged_prefill" not in hlo   # the dense path, not the kernel
    got = np.asarray(call(*args), np.float32)
    # the float64 oracle on the CPU: on the GPU its 5.75 GiB ran out beside 7 other test workers
    want = on_cpu(prefill_f64, q.astype(jnp.float32), cache, tables, [seq_len], starts)
    nan = np.isnan(got)
    assert nan[lead + q_len // 2, 3].all() and nan[lead, :2].all() and nan.sum() == 3 * 128
    assert rel_err(np.where(nan, 0, got), np.where(nan, 0, want)) < 1e-2
    assert np.all(got[:lead] == 0) and np.all(got[got.shape[0] - tail:] == 0)


@pytest.mark.gpu
def test_gpu_dense_prefill_with_sinks_matches_the_float64_reference(rng):
    """Sinks on the cuDNN path (one more term of the merge): 1000 rows after 500 cached tokens."""
    cache = random_cache(rng, num_pages=120, page_size=16, num_kv_heads=2, head_dim=128, k_bits=4, v_bits=4,
                         seed=int(rng.integers(1 << 16)))
    tables = random_tables(rng, (1500,), 16, 120)
    starts = np.asarray([0, 1000], np.int32)
    q = jnp.asarray(rng.normal(size=(1000, 8, 128)), jnp.bfloat16)
    sinks = jnp.asarray(rng.normal(size=(8,)) * 3, jnp.float32)
    args = (q, cache, tables, jnp.asarray([1500], jnp.int32), jnp.asarray(starts))
    call = jax.jit(lambda *a: tq.paged_prefill(*a, sinks=sinks))
    assert "cudnn" in call.lower(*args).as_text()
    got = np.asarray(call(*args), np.float32)
    with _compat.enable_x64():
        operands = _operands(cache, np.asarray(q, np.float64), tables, (1500,), starts)
        out_rot = prefill_module._reference(*operands, jnp.asarray(sinks, jnp.float64), k_bits=4, v_bits=4,
                                            scale=1 / np.sqrt(128))[0]
        want = np.asarray(out_rot, np.float64) @ to_f64(cache.v_codec.rotation)
    assert rel_err(got, want) < 1e-2


@pytest.mark.gpu
def test_gpu_dense_prefill_of_several_sequences_matches_the_float64_oracle(rng):
    """Several sequences as segments of cuDNN's packed layout (GQA 4): a fresh prompt, a chunk after
    cached tokens with a page id outside the pool in its prefix, an idle sequence, rows before a
    sequence's start, rows of no sequence; then two query sets with their own query_start_loc
    under vmap."""
    from test_prefill import prefill_f64
    seq_lens = np.asarray([700, 1500, 0, 300], np.int32)
    cache = random_cache(rng, num_pages=200, page_size=16, num_kv_heads=2, head_dim=128, k_bits=4, v_bits=4,
                         seed=int(rng.integers(1 << 16)))
    tables = np.array(random_tables(rng, seq_lens, 16, 200))
    tables[1, 10] = 1000
    starts = 3 + np.concatenate([[0], np.cumsum([701, 400, 0, 420])]).astype(np.int32)
    other = np.concatenate([[0], np.cumsum([500, 401, 0, 623])]).astype(np.int32)
    q = jnp.asarray(rng.normal(size=(2, int(starts[-1]) + 5, 8, 128)), jnp.bfloat16)
    args = (cache, jnp.asarray(tables), jnp.asarray(seq_lens))
    call = jax.jit(lambda q, starts: tq.paged_prefill(q, *args, starts))
    hlo = call.lower(q[0], jnp.asarray(starts)).as_text()
    assert "cudnn" in hlo and "jax_tq_paged_prefill" not in hlo   # the dense path, not the kernel
    got = np.asarray(call(q[0], jnp.asarray(starts)), np.float32)
    assert rel_err(got, on_cpu(prefill_f64, q[0].astype(jnp.float32), cache, tables, seq_lens, starts)) < 1e-2
    assert np.all(got[:4] == 0) and np.all(got[-5:] == 0)   # before the start, of no sequence
    both = np.asarray(jax.jit(jax.vmap(call))(q, jnp.asarray(np.stack([starts, other]))), np.float32)
    for i, s in enumerate((starts, other)):
        assert rel_err(both[i], on_cpu(prefill_f64, q[i].astype(jnp.float32), cache, tables, seq_lens, s)) < 1e-2
