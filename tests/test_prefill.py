"""paged_prefill (causal attention of new query rows over the compressed paged cache) through the
FFI kernels (CPU here, CUDA where marked) against the float64 oracle: each row is a one-query decode
of its sequence cut at its own position; with a window, attention over pages + window rows."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tq as tq
from jax_tq.paged_prefill import paged_prefill_p
from conftest import kernel_backend, poison_device_memory, slow_unless
from oracle import (attend_f64, decode_f64, primitive_count, random_cache, random_tables, random_window_cache, rel_err,
                    sequence_tokens)


TARGETS = ("jax_tq_paged_prefill",)
BACKENDS = ("ffi", "xla")


@pytest.fixture(autouse=True)
def ffi_backend(request):
    with kernel_backend(request, TARGETS):
        yield


def prefill_f64(q, cache, tables, seq_lens, query_start_loc):
    """float64 oracle: rows of sequence s (valid, non-decreasing query_start_loc) decode with the
    sequence's table and their causal length (a head whose query is not all finite: NaN, also in
    rows placed before the sequence's start, which see no token); every other row is 0."""
    q = np.asarray(q, np.float64)
    tables, seq_lens, starts = (np.asarray(a) for a in (tables, seq_lens, query_start_loc))
    want = np.zeros(q.shape)
    for s in range(len(seq_lens)):
        begin, end = int(starts[s]), int(starts[s + 1])
        if end <= begin:
            continue
        lens = np.clip(int(seq_lens[s]) - (end - begin) + np.arange(end - begin) + 1, 0, int(seq_lens[s]))
        row_tables = jnp.asarray(np.repeat(tables[s:s + 1], end - begin, axis=0))
        rows = decode_f64(q[begin:end], cache, row_tables, jnp.asarray(lens.astype(np.int32)))
        want[begin:end] = np.where(np.isfinite(q[begin:end]).all(-1, keepdims=True), rows, np.nan)
    return want


def _case(rng, *, head_dim=64, k_bits=4, v_bits=3, page_size=8, num_kv_heads=2, group=3, seq_lens=(10, 33, 5, 0),
          q_lens=(4, 33, 2, 0), lead_rows=0, tail_rows=0, num_pages=40, dtype=jnp.float32, rotation="haar"):
    cache = random_cache(rng, num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, k_bits=k_bits, v_bits=v_bits, seed=int(rng.integers(1 << 16)),
                         rotation=rotation)
    tables = random_tables(rng, seq_lens, page_size, num_pages)
    starts = lead_rows + np.concatenate([[0], np.cumsum(q_lens)])
    num_tokens = int(starts[-1]) + tail_rows
    q = jnp.asarray(rng.normal(size=(num_tokens, num_kv_heads * group, head_dim)), dtype)
    return q, cache, tables, jnp.asarray(seq_lens, jnp.int32), jnp.asarray(starts, jnp.int32)


@pytest.mark.parametrize("head_dim,k_bits,v_bits,page_size,group,dtype", slow_unless([
    (64, 4, 3, 8, 3, jnp.float32), (80, 2, 4, 16, 1, jnp.bfloat16), (128, 4, 4, 16, 4, jnp.float16),
    (96, 3, 2, 32, 2, jnp.float32), (256, 4, 2, 8, 8, jnp.bfloat16)], lambda head_dim, *_: head_dim == 64))
def test_prefill_matches_float64_oracle(rng, head_dim, k_bits, v_bits, page_size, group, dtype):
    """Chunked (4 new rows of 10 tokens), whole (33 of 33), more rows than tokens (3 of 2: one row
    before the start), no rows, and rows of no sequence before and after."""
    q, cache, tables, lens, starts = _case(rng, head_dim=head_dim, k_bits=k_bits, v_bits=v_bits, page_size=page_size,
                                           group=group, seq_lens=(10, 33, 2, 0, 7), q_lens=(4, 33, 3, 0, 7),
                                           lead_rows=2, tail_rows=3, dtype=dtype)
    got = jax.jit(tq.paged_prefill)(q, cache, tables, lens, starts)
    assert got.shape == q.shape and got.dtype == q.dtype
    want = prefill_f64(q.astype(jnp.float32), cache, tables, lens, starts)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    assert rel_err(got, want) < tol
    zero_rows = np.r_[0:2, 2 + 4 + 33, q.shape[0] - 3:q.shape[0]]  # lead, the row before its start, tail
    assert np.all(np.asarray(got, np.float32)[zero_rows] == 0)
    with tq.use_backend("xla"):
        assert rel_err(jax.jit(lambda *a: tq.paged_prefill(*a))(q, cache, tables, lens, starts), want) < tol


def test_last_row_of_a_prefill_is_the_decode_of_the_sequence(rng):
    q, cache, tables, lens, starts = _case(rng, seq_lens=(21, 40), q_lens=(21, 9))
    out = tq.paged_prefill(q, cache, tables, lens, starts)
    last = jnp.asarray([20, 29])
    decode = tq.paged_decode(q[last], cache, tables, lens)
    assert rel_err(out[last], decode) < 1e-5


def test_prefill_after_write_cache_is_causal_attention_over_the_decoded_cache(rng):
    """End to end: write a prompt's K / V, prefill it, compare with dense causal softmax attention
    over decompress(compress(K / V))."""
    num_tokens, hkv, group, d, page_size = 37, 2, 2, 64, 8
    k_codec, v_codec = tq.TurboQuant(d, 4, seed=3), tq.TurboQuant(d, 3, seed=4)
    cache = tq.PagedKVCache.create(num_pages=8, page_size=page_size, num_kv_heads=hkv, k_codec=k_codec,
                                   v_codec=v_codec)
    k, v = (jnp.asarray(rng.normal(size=(num_tokens, hkv, d)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.normal(size=(num_tokens, hkv * group, d)), jnp.float32)
    pages = rng.permutation(8)[:5]
    slots = jnp.asarray(pages[np.arange(num_tokens) // page_size] * page_size + np.arange(num_tokens) % page_size,
                        jnp.int32)
    cache = tq.write_cache(cache, k, v, slots)
    out = tq.paged_prefill(q, cache, jnp.asarray(pages[None], jnp.int32), jnp.asarray([num_tokens], jnp.int32),
                           jnp.asarray([0, num_tokens], jnp.int32))
    k_hat = np.asarray(tq.decompress(*tq.compress(k, k_codec), k_codec), np.float64)
    v_hat = np.asarray(tq.decompress(*tq.compress(v, v_codec), v_codec), np.float64)
    # query head h reads KV head h // group
    scores = np.einsum("thd,shd->hts", np.asarray(q, np.float64), np.repeat(k_hat, group, axis=1)) / np.sqrt(d)
    scores = np.where(np.tril(np.ones((num_tokens, num_tokens), bool))[None], scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    want = np.einsum("hts,shd->thd", weights, np.repeat(v_hat, group, axis=1))
    assert rel_err(out, want) < 1e-5


def test_nan_query_row_gives_a_nan_row_only(rng):
    q, cache, tables, lens, starts = _case(rng)
    q = q.at[5, 1].set(jnp.nan)
    out = np.asarray(tq.paged_prefill(q, cache, tables, lens, starts))
    assert np.all(np.isnan(out[5, 1])) and np.isfinite(np.delete(out.reshape(-1, 64), 5 * 6 + 1, axis=0)).all()


def test_nan_query_in_a_row_before_its_sequences_start_is_nan_as_the_oracle_says(rng):
    """A row placed before its sequence's start (3 rows of a 2-token sequence) sees no token: 0 for a
    finite query, NaN for a head whose query is not finite (an owned row), in the library and the oracle."""
    q, cache, tables, lens, starts = _case(rng, seq_lens=(10, 2, 7), q_lens=(4, 3, 7))
    q = q.at[4, 1].set(jnp.nan).at[5, 0, 3].set(jnp.inf)  # row 4: before sequence 1's start; row 5: its first token
    got = np.asarray(tq.paged_prefill(q, cache, tables, lens, starts))
    want = prefill_f64(q, cache, tables, lens, starts)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # NaN where want is NaN, and only there
    assert np.isnan(got[4, 1]).all() and np.all(got[4, [0, 2, 3, 4, 5]] == 0) and np.isnan(got[5, 0]).all()


@pytest.mark.slow
def test_nan_query_rows_of_no_sequence_stay_zero_on_every_path(rng):
    q, cache, tables, lens, starts = _case(rng, lead_rows=1, tail_rows=2)
    q = q.at[0, 2].set(jnp.nan).at[-1, 0].set(jnp.inf).at[3, 0].set(jnp.nan)  # rows 0 and -1 owned by none
    outs = [tq.paged_prefill(q, cache, tables, lens, starts),
            jax.vmap(tq.paged_prefill, in_axes=(0, None, None, None, None))(jnp.stack([q, q]), cache, tables, lens,
                                                                            starts)[1]]
    with tq.use_backend("xla"):
        outs.append(jax.jit(lambda *a: tq.paged_prefill(*a))(q, cache, tables, lens, starts))
    for out in map(np.asarray, outs):
        assert np.all(out[0] == 0) and np.all(out[-1] == 0) and np.all(np.isnan(out[3, 0]))
        assert np.all(np.isfinite(out[1:-1].reshape(-1, 64)[np.arange(out[1:-1].size // 64) != 2 * 6]))


def test_checked_prefill_without_sequences_and_grad_outside_the_check(rng):
    q, cache, _, _, _ = _case(rng)
    err, out = jax.jit(tq.checked(tq.paged_prefill))(q, cache, jnp.zeros((0, 1), jnp.int32), jnp.zeros((0,), jnp.int32),
                                                     jnp.zeros((1,), jnp.int32))
    with pytest.raises(Exception, match=r"query_start_loc\[-1\] = 0 must be num_tokens"):
        err.throw()
    assert np.all(np.asarray(out) == 0)
    _, _, tables, lens, starts = _case(rng)
    with pytest.raises(TypeError, match=r"jax.grad of a checked function \(here of its paged_prefill"):
        jax.grad(lambda q: tq.checked(lambda q: tq.paged_prefill(q, cache, tables, lens, starts).sum())(q)[1])(q)


@pytest.mark.slow
def test_vmap_folds_into_one_kernel_call(rng):
    q, cache, tables, lens, starts = _case(rng, seq_lens=(10, 33, 5), q_lens=(4, 30, 2), tail_rows=2)
    qs = jnp.stack([q, -q, 2 * q])
    starts_b = jnp.stack([starts, starts, jnp.asarray([0, 0, 36, 36], jnp.int32)])  # element 2: one sequence of 36 rows
    lens_b = jnp.stack([lens, lens, jnp.asarray([0, 36, 0], jnp.int32)])
    fn = jax.vmap(tq.paged_prefill, in_axes=(0, None, None, 0, 0))
    jaxpr = jax.make_jaxpr(fn)(qs, cache, tables, lens_b, starts_b).jaxpr
    assert primitive_count(jaxpr, paged_prefill_p) == 1
    got = jax.jit(fn)(qs, cache, tables, lens_b, starts_b)
    for b in range(3):
        assert rel_err(got[b], prefill_f64(qs[b], cache, tables, lens_b[b], starts_b[b])) < 1e-5
    caches = jax.tree_util.tree_map(lambda a: jnp.stack([a, a]), cache)           # a batched cache too
    got = jax.vmap(tq.paged_prefill, in_axes=(0, 0, None, None, None))(qs[:2], caches, tables, lens, starts)
    assert rel_err(got[1], prefill_f64(qs[1], cache, tables, lens, starts)) < 1e-5


@pytest.mark.slow
def test_gradient_matches_the_reference_and_finite_differences(rng):
    q, cache, tables, lens, starts = _case(rng, seq_lens=(9, 12), q_lens=(3, 12))
    w = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

    def loss(q, k_norms):
        return jnp.sum(w * tq.paged_prefill(q, dataclasses.replace(cache, k_norms=k_norms), tables, lens, starts))

    dq, dkn = jax.jit(jax.grad(loss, argnums=(0, 1)))(q, cache.k_norms)
    with tq.use_backend("xla"):
        want_dq, want_dkn = jax.grad(loss, argnums=(0, 1))(q, cache.k_norms)
    assert rel_err(dq, want_dq) < 1e-5 and rel_err(dkn, want_dkn) < 1e-5
    direction = rng.normal(size=q.shape)
    w64, q64 = np.asarray(w, np.float64), np.asarray(q, np.float64)
    eps = 1e-5
    fd = (np.sum(w64 * prefill_f64(q64 + eps * direction, cache, tables, lens, starts))
          - np.sum(w64 * prefill_f64(q64 - eps * direction, cache, tables, lens, starts))) / (2 * eps)
    assert abs(fd - float(np.sum(np.asarray(dq, np.float64) * direction))) < 1e-4 * max(1.0, abs(fd))


def test_bad_inputs_raise_clear_errors(rng):
    q, cache, tables, lens, starts = _case(rng)
    with pytest.raises(ValueError, match=r"query_start_loc must be int32 \[num_seqs \+ 1 = 5\]"):
        tq.paged_prefill(q, cache, tables, lens, starts[:-1])
    with pytest.raises(TypeError, match="query_start_loc must be int32"):
        tq.paged_prefill(q, cache, tables, lens, np.asarray(starts, np.int64))
    with pytest.raises(ValueError, match=r"q must be \[num_tokens, num_heads, head_dim\]"):
        tq.paged_prefill(q[0], cache, tables, lens, starts)
    with pytest.raises(ValueError, match="not a positive multiple of the cache's num_kv_heads"):
        tq.paged_prefill(q[:, :5], cache, tables, lens, starts)
    with pytest.raises(ValueError, match=r"seq_lens must be int32 \[num_seqs=4\]"):
        tq.paged_prefill(q, cache, tables, lens[:3], starts)
    with pytest.raises(ValueError, match="jax_tq.paged_prefill: scale must be finite"):
        tq.paged_prefill(q, cache, tables, lens, starts, scale=float("inf"))
    with pytest.raises(ValueError, match=r"block_tables must be int32 \[num_seqs, max_pages\], got int32\(1, "):
        tq.paged_prefill(q, cache, tables[None], lens, starts)  # said [num_seqs=num_seqs, max_pages]
    with pytest.raises(TypeError, match="jax_tq.paged_prefill: q must be an array, got NoneType"):
        tq.paged_prefill(None, cache, tables, lens, starts)
    with pytest.raises(TypeError, match=r"query_start_loc must be int32 \[num_seqs \+ 1 = 5\], got str"):
        tq.paged_prefill(q, cache, tables, lens, "starts")


@pytest.mark.parametrize("starts,lens,match", [
    ([0, 4, 3, 39, 39], [10, 33, 5, 0], "query_start_loc decreases from 4 to 3 at sequence 1"),
    ([0, 4, 37, 39, 20], [10, 33, 5, 0], "query_start_loc decreases from 39 to 20 at sequence 3"),   # not its end
    ([1, 4, 37, 39, 39], [10, 33, 5, 0], r"query_start_loc\[0\] = 1 must be 0"),
    ([0, 4, 37, 38, 38], [10, 33, 5, 0], r"query_start_loc\[-1\] = 38 must be num_tokens = 39"),
    ([0, 4, 37, 39, 39], [10, 32, 5, 0], r"sequence 1 has 33 new query rows but seq_lens\[1\] = 32"),
])
def test_checked_prefill_reports_bad_query_start_loc(rng, starts, lens, match):
    q, cache, tables, _, _ = _case(rng)
    err, _ = jax.jit(tq.checked(tq.paged_prefill))(q, cache, tables, jnp.asarray(lens, jnp.int32),
                                                   jnp.asarray(starts, jnp.int32))
    with pytest.raises(Exception, match=match):
        err.throw()


# ----------------------------------------------------------------------------- the window

@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_reads_pages_and_window_as_they_stand(rng, backend):
    """Rows of two sequences (chunked prefill: 7 of 23 tokens new, and 4 of 4): row i attends to the
    tokens up to its position, the sequence's last `window` from its window."""
    cache = random_window_cache(rng, num_kv_heads=1)
    tables = np.stack([rng.permutation(24)[:4] for _ in range(2)]).astype(np.int32)
    seq_lens = np.asarray([23, 4], np.int32)
    starts = np.asarray([0, 7, 11], np.int32)
    window_ids = np.asarray([1, 0], np.int32)
    q = rng.normal(size=(11, 4, 64)).astype(np.float32)
    with tq.use_backend(backend):
        out = np.asarray(tq.paged_prefill(q, cache, tables, seq_lens, starts, window_ids=window_ids))
    for s in range(2):
        keys, values, valid = sequence_tokens(cache, tables[s], seq_lens[s], window_ids[s])
        rows = range(starts[s], starts[s + 1])
        for i, row in enumerate(rows):
            n = seq_lens[s] - len(rows) + i + 1
            want = attend_f64(q[row], keys[:n], values[:n], valid[:n], 1 / 8)
            assert rel_err(out[row], want) < 2e-5


# ----------------------------------------------------------------------------- CUDA (marked gpu: skipped
# without one, conftest.py); the autouse fixture selects the "ffi" backend, so these run the CUDA kernel

def _poison_gpu(nbytes: int) -> None:
    buf = jnp.full((max(1, nbytes // 4),), jnp.nan, jnp.float32)
    buf.block_until_ready()
    del buf


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,k_bits,v_bits,page_size,group,num_kv_heads,dtype", [
    (64, 4, 4, 16, 4, 2, jnp.bfloat16), (128, 4, 4, 16, 4, 8, jnp.bfloat16), (128, 3, 2, 8, 1, 4, jnp.float32),
    (80, 2, 3, 32, 3, 2, jnp.float16), (96, 4, 2, 16, 6, 1, jnp.float32), (192, 3, 4, 64, 2, 2, jnp.bfloat16),
    (256, 4, 4, 16, 16, 1, jnp.bfloat16), (64, 2, 2, 256, 32, 1, jnp.float32)])
def test_gpu_prefill_matches_oracle(rng, head_dim, k_bits, v_bits, page_size, group, num_kv_heads, dtype):
    """Sequences straddling CTA tiles, chunked and whole prompts, rows of no sequence, groups up to 32
    (two head chunks per KV head), every head_dim."""
    q, cache, tables, lens, starts = _case(rng, head_dim=head_dim, k_bits=k_bits, v_bits=v_bits, page_size=page_size,
                                           group=group, num_kv_heads=num_kv_heads, seq_lens=(300, 77, 5, 0, 129),
                                           q_lens=(45, 77, 7, 0, 1), lead_rows=3, tail_rows=5, num_pages=80,
                                           dtype=dtype)
    _poison_gpu(q.size * 4 * 4)
    got = jax.jit(tq.paged_prefill)(q, cache, tables, lens, starts)
    want = prefill_f64(q.astype(jnp.float32), cache, tables, lens, starts)
    assert rel_err(got, want) < (1e-5 if dtype == jnp.float32 else 1e-2)
    assert np.all(np.asarray(got, np.float32)[:3] == 0) and np.all(np.asarray(got, np.float32)[-5:] == 0)


@pytest.mark.gpu
def test_gpu_prefill_long_prompt_vmap_and_grad(rng):
    q, cache, tables, lens, starts = _case(rng, head_dim=128, page_size=16, group=4, num_kv_heads=2,
                                           seq_lens=(2048,), q_lens=(1024,), num_pages=160)
    got = tq.paged_prefill(q, cache, tables, lens, starts)
    assert rel_err(got, prefill_f64(q, cache, tables, lens, starts)) < 1e-5
    both = jax.vmap(tq.paged_prefill, in_axes=(0, None, None, None, None))(jnp.stack([q, -q]), cache, tables, lens,
                                                                            starts)
    assert rel_err(both[0], got) < 1e-6
    dq = jax.grad(lambda q: jnp.sum(tq.paged_prefill(q, cache, tables, lens, starts)[-4:]))(q)
    with tq.use_backend("xla"):
        want = jax.grad(lambda q: jnp.sum(tq.paged_prefill(q, cache, tables, lens, starts)[-4:]))(q)
    assert rel_err(dq, want) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,group", [(128, 4), (64, 3)])
def test_gpu_prefill_with_a_window_matches_the_float64_oracle(request, rng, head_dim, group):
    cache = random_window_cache(rng, head_dim=head_dim, num_kv_heads=2, page_size=16, num_pages=32, window=64, num_windows=3)
    tables = np.stack([rng.permutation(32)[:8] for _ in range(3)]).astype(np.int32)
    seq_lens = np.asarray([100, 40, 128], np.int32)   # chunked: 30 of 100 new; 40 of 40; 10 of 128
    starts = np.asarray([0, 30, 70, 80], np.int32)
    ids = np.asarray([2, 0, 1], np.int32)
    q = rng.normal(size=(80, 2 * group, head_dim)).astype(np.float32)
    poison_device_memory(1 << 26)
    with kernel_backend(request, ["jax_tq_paged_prefill"]):
        out = np.asarray(jax.jit(tq.paged_prefill)(q, cache, tables, seq_lens, starts, window_ids=ids))
    for s in range(3):
        keys, values, valid = sequence_tokens(cache, tables[s], seq_lens[s], ids[s])
        rows = range(starts[s], starts[s + 1])
        for i, row in enumerate(rows):
            n = seq_lens[s] - len(rows) + i + 1
            assert rel_err(out[row], attend_f64(q[row], keys[:n], values[:n], valid[:n], 1 / np.sqrt(head_dim))) < 2e-5


# The tensor-core kernel (head_dim 64 / 128, float16 products: bf16 / f16 queries, or float32 ones with
# precision "default"): its error is the float16 rounding of q, the weights and the centroids (~2^-11
# per term), norm-wise ~1e-3 against the float64 oracle; bf16 outputs add their own ~2e-3.
TC_CASES = [  # head_dim, k_bits, v_bits, page_size, group, num_kv_heads
    (128, 4, 4, 16, 4, 2), (128, 3, 3, 16, 1, 2), (128, 2, 2, 8, 8, 1), (128, 4, 2, 32, 3, 2),
    (64, 4, 4, 16, 4, 2), (64, 3, 4, 16, 6, 1), (64, 2, 3, 64, 16, 1), (64, 4, 4, 16, 128, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,k_bits,v_bits,page_size,group,num_kv_heads", TC_CASES)
def test_gpu_tensor_core_prefill_matches_oracle(rng, head_dim, k_bits, v_bits, page_size, group, num_kv_heads):
    """Chunked prefill after cached tokens (130 new of 300: tiles that straddle the causal diagonal),
    whole prompts, a row before its sequence's start, sequences sharing CTA tiles, rows of no sequence
    (lead / tail: 0), one NaN query row (NaN), groups from 1 to 128 (two head chunks per KV head)."""
    q, cache, tables, lens, starts = _case(rng, head_dim=head_dim, k_bits=k_bits, v_bits=v_bits, page_size=page_size,
                                           group=group, num_kv_heads=num_kv_heads, seq_lens=(300, 77, 2, 0, 129, 1),
                                           q_lens=(130, 77, 3, 0, 1, 1), lead_rows=3, tail_rows=5, num_pages=80)
    q = q.at[3 + 50, 0, 7].set(jnp.nan)
    poison_device_memory(q.size * 4 * 4)
    got = np.asarray(jax.jit(lambda *a: tq.paged_prefill(*a, precision="default"))(q, cache, tables, lens, starts))
    want = prefill_f64(q, cache, tables, lens, starts)
    nan_row = np.zeros(q.shape[:2], bool)
    nan_row[3 + 50, 0] = True
    assert np.all(np.isnan(got[nan_row])) and not np.any(np.isnan(got[~nan_row]))
    keep = ~nan_row[..., None] & np.ones(got.shape, bool)
    assert rel_err(np.where(keep, got, 0), np.where(keep, want, 0)) < 2e-3
    zero_rows = np.r_[0:3, 3 + 130 + 77, q.shape[0] - 5:q.shape[0]]  # lead, the row before its start, tail
    assert np.all(got[zero_rows] == 0)
    bf16 = jax.jit(tq.paged_prefill)(q.astype(jnp.bfloat16), cache, tables, lens, starts)
    want16 = prefill_f64(q.astype(jnp.bfloat16).astype(jnp.float32), cache, tables, lens, starts)
    assert rel_err(np.where(keep, np.asarray(bf16, np.float32), 0), np.where(keep, want16, 0)) < 5e-3


@pytest.mark.gpu
def test_gpu_tensor_core_prefill_long_chunk_huge_and_tiny_queries(rng):
    """A 1024-row chunk after 1024 cached tokens (pages in random order), rows scaled by 1e-6 .. 1e4
    (the per-row power-of-two scaling keeps them inside float16), against the float64 oracle: each
    sampled row within 3e-3, or within 1.5x the error that rounding that row's q to bfloat16 alone
    makes (the documented contract: the float16 products err less than a bfloat16 query's own
    rounding; rows scaled by ~10-1e4 have peaked softmaxes that amplify any logit's rounding). A row
    overflowing or flushing to zero in float16 errs by ~1."""
    q, cache, tables, lens, starts = _case(rng, head_dim=128, page_size=16, group=4, num_kv_heads=2,
                                           seq_lens=(2048,), q_lens=(1024,), num_pages=160)
    scales = jnp.asarray(10.0 ** rng.uniform(-6, 4, size=(q.shape[0], q.shape[1], 1)), jnp.float32)
    q = q * scales
    got = jax.jit(lambda *a: tq.paged_prefill(*a, precision="default"))(q, cache, tables, lens, starts)
    want = prefill_f64(q, cache, tables, lens, starts)
    want_bf16 = prefill_f64(q.astype(jnp.bfloat16).astype(jnp.float32), cache, tables, lens, starts)
    rows = range(0, q.shape[0], 97)
    per_row = [rel_err(np.asarray(got)[i], want[i]) for i in rows]
    bf16_rounding = [rel_err(want_bf16[i], want[i]) for i in rows]
    assert all(e < max(3e-3, 1.5 * b) for e, b in zip(per_row, bf16_rounding)), (per_row, bf16_rounding)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,group", [(128, 4), (64, 3)])
def test_gpu_tensor_core_prefill_with_a_window(request, rng, head_dim, group):
    cache = random_window_cache(rng, head_dim=head_dim, num_kv_heads=2, page_size=16, num_pages=32, window=64,
                                num_windows=3)
    tables = np.stack([rng.permutation(32)[:8] for _ in range(3)]).astype(np.int32)
    seq_lens = np.asarray([100, 40, 128], np.int32)
    starts = np.asarray([0, 30, 70, 80], np.int32)
    ids = np.asarray([2, -1, 1], np.int32)  # sequence 1: no window (its last tokens are not there)
    q = rng.normal(size=(80, 2 * group, head_dim)).astype(np.float32)
    poison_device_memory(1 << 26)
    with kernel_backend(request, ["jax_tq_paged_prefill"]):
        out = np.asarray(jax.jit(lambda *a, **k: tq.paged_prefill(*a, **k, precision="default"))(
            q, cache, tables, seq_lens, starts, window_ids=ids))
    for s in range(3):
        keys, values, valid = sequence_tokens(cache, tables[s], seq_lens[s], ids[s])
        rows = range(starts[s], starts[s + 1])
        for i, row in enumerate(rows):
            n = seq_lens[s] - len(rows) + i + 1
            want = attend_f64(q[row], keys[:n], values[:n], valid[:n], 1 / np.sqrt(head_dim))
            assert rel_err(out[row], want) < 3e-3 if valid[:n].any() else np.all(out[row] == 0)
