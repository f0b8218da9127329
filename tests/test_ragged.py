"""ragged_paged_attention (one serving step: write, then causal attention of decode and prefill
rows over the cache), prompt_attention (fresh prompts, exact attention over their own K / V, and
the write) and slot_mapping, against float64 oracles in numpy: the expected slots computed here, the
cache they give through write_cache, every token of it decoded with the reference decompression,
exact softmax attention. Backend "ffi" (the CPU kernels: their writes are deterministic, so the
returned cache must equal write_cache's bit for bit)."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tq as tq
from jax_tq.compress import write_cache_p
from jax_tq.paged_decode import paged_decode_p
from jax_tq.paged_prefill import paged_prefill_p
from conftest import poison_device_memory
from oracle import attend_f64, decompress_f64, primitive_count, random_cache, random_window_cache, rel_err, to_f64

pytestmark = pytest.mark.backend("ffi")


# ----------------------------------------------------------------------------- oracle

def disjoint_tables(rng, kv_lens, page_size, num_pages, max_pages):
    """Block tables giving each sequence its own pages (no page shared: every write has one
    writer); entries a sequence does not need hold garbage ids, some outside the pool."""
    tables = rng.integers(-3, num_pages + 3, size=(len(kv_lens), max_pages)).astype(np.int32)
    free = list(rng.permutation(num_pages))
    for s, n in enumerate(kv_lens):
        needed = min(-(-max(int(n), 0) // page_size), max_pages)
        tables[s, :needed] = [free.pop() for _ in range(needed)]
    return tables


def expected_slots(tables, kv_lens, cu_q_lens, num_tokens, page_size, window=0, window_ids=None):
    """The slots (and window slots) the step must write: row i of sequence s at position
    kv_lens[s] - q_len + i, -1 for padding, negative positions and sequences past the table."""
    slots = np.full(num_tokens, -1, np.int32)
    window_slots = np.full(num_tokens, -1, np.int32)
    capacity = tables.shape[1] * page_size
    for s, kv in enumerate(kv_lens):
        begin, end = int(cu_q_lens[s]), int(cu_q_lens[s + 1])
        if not 0 <= kv <= capacity:
            continue
        for i, row in enumerate(range(begin, end)):
            p = kv - (end - begin) + i
            if p < 0:
                continue
            slots[row] = tables[s, p // page_size] * page_size + p % page_size
            if window and p >= kv - window:
                window_slots[row] = window_ids[s] * window + p % window
    return slots, window_slots


def cache_rows_f64(cache):
    """float64 K, V of every page slot [num_pages * page_size, num_kv_heads, head_dim] (compressed
    ones through the reference decompression) and of every window entry, rotated back
    ([num_windows, num_kv_heads, window, head_dim]; None without a window)."""
    if cache.compressed:
        k = decompress_f64(np.asarray(cache.k_codes), np.asarray(cache.k_norms), cache.k_codec)
        v = decompress_f64(np.asarray(cache.v_codes), np.asarray(cache.v_norms), cache.v_codec)
    else:
        k, v = to_f64(cache.k_pages), to_f64(cache.v_pages)
    P, H, page_size, d = k.shape
    k, v = (x.transpose(0, 2, 1, 3).reshape(P * page_size, H, d) for x in (k, v))
    if not cache.window:
        return k, v, None, None
    return (k, v, to_f64(cache.k_window) @ to_f64(cache.k_codec.rotation),
            to_f64(cache.v_window) @ to_f64(cache.v_codec.rotation))


def ragged_f64(q, cache, kv_lens, tables, cu_q_lens, window_ids=None, scale=None):
    """Row i of sequence s (at position p = kv_lens[s] - q_len + i) attends to the sequence's
    tokens 0 .. p as ``cache`` (after the write) holds them: the last ``window`` of its kv_lens
    tokens from its window, the others from the pages; float64. Rows that write nothing are 0."""
    q = to_f64(q)
    k_rows, v_rows, k_win, v_win = cache_rows_f64(cache)
    page_size, window = cache.page_size, cache.window
    capacity = tables.shape[1] * page_size
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    out = np.zeros(q.shape)
    for s, kv in enumerate(kv_lens):
        begin, end = int(cu_q_lens[s]), int(cu_q_lens[s + 1])
        if not 0 <= kv <= capacity or end == begin:
            continue
        first_window = max(kv - window, 0) if window else kv
        keys, values, valid = [], [], []
        for p in range(kv):
            if p < first_window:
                entry = int(tables[s, p // page_size])
                valid.append(0 <= entry < cache.num_pages)
                slot = max(entry, 0) * page_size + p % page_size if valid[-1] else 0
                keys.append(k_rows[slot]), values.append(v_rows[slot])
            else:
                keys.append(k_win[window_ids[s], :, p % window]), values.append(v_win[window_ids[s], :, p % window])
                valid.append(True)
        keys, values, valid = np.asarray(keys), np.asarray(values), np.asarray(valid, bool)
        for i, row in enumerate(range(begin, end)):
            p = kv - (end - begin) + i
            if p >= 0:
                out[row] = attend_f64(q[row], keys[:p + 1], values[:p + 1], valid[:p + 1], scale)
    return out


def prompt_f64(q, k, v, prompt_lens, scale=None, sliding_window=None, soft_cap=None, sinks=None):
    """Exact causal attention of each prompt over its own K / V in float64 (GQA), with the variants
    of jax_tq.variants; rows past prompt_lens are 0."""
    q, k, v = to_f64(q), to_f64(k), to_f64(v)
    batch, seq_len, heads, d = q.shape
    group = heads // k.shape[2]
    scale = 1 / np.sqrt(d) if scale is None else scale
    out = np.zeros(q.shape)
    for b in range(batch):
        n = int(np.clip(prompt_lens[b], 0, seq_len))
        for t in range(n):
            lo = 0 if sliding_window is None else max(0, t - sliding_window + 1)
            for h in range(heads):
                s = k[b, lo:t + 1, h // group] @ q[b, t, h] * scale
                if soft_cap is not None:
                    s = soft_cap * np.tanh(s / soft_cap)
                top = s.max() if sinks is None else max(s.max(), float(sinks[h]))
                p = np.exp(s - top)
                total = p.sum() + (0.0 if sinks is None else np.exp(float(sinks[h]) - top))
                out[b, t, h] = (p / total) @ v[b, lo:t + 1, h // group]
    return out


def random_pages_cache(rng, *, num_pages, page_size, num_kv_heads, head_dim, dtype=jnp.float32):
    cache = tq.PagedKVCache.create(num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv_heads,
                                   preset="none", head_dim=head_dim, dtype=dtype)
    return dataclasses.replace(cache, k_pages=jnp.asarray(rng.normal(size=cache.k_pages.shape), dtype),
                               v_pages=jnp.asarray(rng.normal(size=cache.v_pages.shape), dtype))


def make_cache(rng, kind, *, head_dim=64, bits=4, num_kv_heads=2, page_size=8, num_pages=40, window=5,
               num_windows=8):
    """A cache of ``kind`` ("haar", "hadamard": compressed; "window": compressed with a window;
    "none": uncompressed) whose every slot holds random values."""
    if kind == "none":
        return random_pages_cache(rng, num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv_heads,
                                  head_dim=head_dim)
    if kind == "window":
        return random_window_cache(rng, head_dim=head_dim, num_kv_heads=num_kv_heads, page_size=page_size,
                                   num_pages=num_pages, window=window, num_windows=num_windows, k_bits=bits,
                                   v_bits=bits)
    return random_cache(rng, num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                        k_bits=bits, v_bits=bits, seed=int(rng.integers(1 << 16)), rotation=kind)


def step_case(rng, cache, kv_lens, q_lens, *, group=2, pad_rows=0, dtype=jnp.float32, max_pages=None):
    """Fresh random q, k, v in the ragged layout (padding rows NaN), disjoint block tables,
    kv_lens and cu_q_lens."""
    kv_lens, q_lens = np.asarray(kv_lens, np.int32), np.asarray(q_lens, np.int32)
    page_size = cache.page_size
    max_pages = max_pages or max(1, max(-(-int(n) // page_size) for n in kv_lens))
    tables = disjoint_tables(rng, kv_lens, page_size, cache.num_pages, max_pages)
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_tokens = int(cu_q_lens[-1]) + pad_rows
    heads, d = cache.num_kv_heads, cache.head_dim
    q = rng.normal(size=(num_tokens, heads * group, d))
    k = rng.normal(size=(num_tokens, heads, d)) * 2
    v = rng.normal(size=(num_tokens, heads, d))
    for x in (q, k, v):
        x[cu_q_lens[-1]:] = np.nan  # padding: never written, never read
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), kv_lens, tables, cu_q_lens)


def leaves(cache):
    return {name: np.asarray(getattr(cache, name)) for name in ("k_codes", "k_norms", "v_codes", "v_norms",
                                                                "k_window", "v_window", "k_pages", "v_pages")
            if getattr(cache, name) is not None}


def assert_cache_is_the_write(got, before, k, v, slots, window_slots):
    """``got`` equals write_cache(before, k, v, slots, window_slots) bit for bit, and every page
    slot and window entry the slots do not address holds what it held before."""
    want = tq.write_cache(before, k, v, jnp.asarray(slots), jnp.asarray(window_slots) if before.window else None)
    got_leaves, want_leaves, old = leaves(got), leaves(want), leaves(before)
    assert got_leaves.keys() == want_leaves.keys()
    for name in got_leaves:
        np.testing.assert_array_equal(got_leaves[name], want_leaves[name], err_msg=name)
    written = np.zeros(before.num_slots, bool)
    written[slots[slots >= 0]] = True
    for name, pool in old.items():
        if "window" in name:
            w = before.window
            kept = np.ones(pool.shape[0] * w, bool)
            kept[window_slots[window_slots >= 0]] = False
            flat_got = got_leaves[name].transpose(0, 2, 1, 3).reshape(-1, *pool.shape[1:2], pool.shape[3])
            flat_old = pool.transpose(0, 2, 1, 3).reshape(-1, *pool.shape[1:2], pool.shape[3])
        else:
            kept = ~written
            flat_got = np.swapaxes(got_leaves[name], 1, 2).reshape(before.num_slots, -1)
            flat_old = np.swapaxes(pool, 1, 2).reshape(before.num_slots, -1)
        np.testing.assert_array_equal(flat_got[kept], flat_old[kept], err_msg=f"{name}: a slot not addressed changed")
    return want


def run_step(q, k, v, cache, kv_lens, tables, cu_q_lens, *, window_ids=None, jit=True, scale=None):
    fn = jax.jit(tq.ragged_paged_attention, static_argnames="scale") if jit else tq.ragged_paged_attention
    poison_device_memory(q.size * 4 * 4)
    return fn(q, k, v, cache, jnp.asarray(kv_lens), jnp.asarray(tables), jnp.asarray(cu_q_lens), scale=scale,
              window_ids=None if window_ids is None else jnp.asarray(window_ids))


def check_step(rng, cache, kv_lens, q_lens, *, group=2, pad_rows=0, dtype=jnp.float32, window_ids=None,
               max_pages=None, tol=None, scale=None):
    """One step against the oracle: the cache is write_cache's with the expected slots, the rows
    the oracle's attention over it, padding and rows that write nothing exactly 0."""
    q, k, v, kv_lens, tables, cu_q_lens = step_case(rng, cache, kv_lens, q_lens, group=group, pad_rows=pad_rows,
                                                    dtype=dtype, max_pages=max_pages)
    if cache.window and window_ids is None:
        window_ids = np.arange(len(kv_lens), dtype=np.int32)
    out, new = run_step(q, k, v, cache, kv_lens, tables, cu_q_lens, window_ids=window_ids, scale=scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    slots, window_slots = expected_slots(tables, kv_lens, cu_q_lens, q.shape[0], cache.page_size, cache.window,
                                         window_ids)
    want_cache = assert_cache_is_the_write(new, cache, k, v, slots, window_slots)
    want = ragged_f64(q.astype(jnp.float32), want_cache, kv_lens, tables, cu_q_lens, window_ids, scale)
    got = np.asarray(out, np.float32)
    tol = tol or (2e-5 if dtype == jnp.float32 else 1e-2)
    assert rel_err(got, want) < tol
    zero = np.all(want == 0, axis=(1, 2))
    assert np.all(got[zero] == 0), f"rows {np.nonzero(zero & np.any(got != 0, axis=(1, 2)))[0]} should be 0"
    return got, new, (q, k, v, kv_lens, tables, cu_q_lens)


# ----------------------------------------------------------------------------- ragged_paged_attention

@pytest.mark.parametrize("kind", ["haar", "window", "none"])
def test_mixed_step_with_idle_sequences_chunked_prefill_and_padding(rng, kind):
    """Decode rows (q_len 1), idle sequences (q_len 0), a whole prompt (7 of 7), a chunk after
    cached tokens (12 new of 30), a decode at a page boundary, and 3 NaN padding rows."""
    cache = make_cache(rng, kind)
    check_step(rng, cache, kv_lens=(20, 15, 7, 9, 0, 30, 17), q_lens=(1, 0, 7, 1, 0, 12, 1), pad_rows=3)


def test_decode_only_step_is_paged_decode_after_the_write(rng):
    """A decode-only batch: each row is what paged_decode gives over the written cache, bit for
    bit (the decode path), and the jaxpr holds one write, one decode and one prefill."""
    cache = make_cache(rng, "hadamard", head_dim=128)
    got, new, (q, _, _, kv_lens, tables, _) = check_step(rng, cache, kv_lens=(37, 5, 1, 64), q_lens=(1, 1, 1, 1),
                                                         group=4)
    decode = jax.jit(tq.paged_decode)(q, new, jnp.asarray(tables), jnp.asarray(kv_lens))
    np.testing.assert_array_equal(got, np.asarray(decode))
    args = (q, q[:, :2], q[:, :2], cache, jnp.asarray(kv_lens), jnp.asarray(tables), jnp.arange(5, dtype=jnp.int32))
    jaxpr = jax.make_jaxpr(tq.ragged_paged_attention)(*args).jaxpr
    assert [primitive_count(jaxpr, p) for p in (write_cache_p, paged_decode_p, paged_prefill_p)] == [1, 1, 1]


@pytest.mark.parametrize("head_dim,bits,group,dtype", [(64, 3, 1, jnp.float32), (128, 4, 4, jnp.bfloat16)])
def test_prefill_only_step(rng, head_dim, bits, group, dtype):
    """Fresh prompts (q_len = kv_lens), one of a single token (the decode path), GQA."""
    cache = make_cache(rng, "haar", head_dim=head_dim, bits=bits, page_size=16)
    check_step(rng, cache, kv_lens=(10, 33, 1, 16), q_lens=(10, 33, 1, 16), group=group, dtype=dtype)


@pytest.mark.parametrize("kind", ["hadamard", "window"])
def test_chunked_prefill_after_cached_tokens_and_gqa(rng, kind):
    """Chunks of 2 and 9 new rows after cached tokens (pages already full of earlier tokens),
    bf16 rows, 4 query heads per KV head, head_dim 128, 3-bit codes."""
    cache = make_cache(rng, kind, head_dim=128, bits=3, page_size=16, window=16)
    check_step(rng, cache, kv_lens=(40, 25, 3), q_lens=(2, 9, 1), group=4, dtype=jnp.bfloat16, pad_rows=2)


def test_rows_that_write_nothing_are_zero_and_write_nothing(rng):
    """More new rows than tokens (the first 3 of 5 rows sit before the sequence's start), a
    sequence longer than its table (kv_lens 40 > 2 pages of 8: nothing of it written), a decode
    row of a sequence with kv_lens 0, NaN queries in all of them, and a custom scale."""
    cache = make_cache(rng, "haar")
    q, k, v, kv_lens, tables, cu_q_lens = step_case(rng, cache, (2, 40, 0, 12), (5, 3, 1, 2), max_pages=2)
    dead = np.r_[0:3, 5:8, 8]
    q = q.at[dead].set(jnp.nan)
    out, new = run_step(q, k, v, cache, kv_lens, tables, cu_q_lens, scale=0.3)
    slots, _ = expected_slots(tables, kv_lens, cu_q_lens, q.shape[0], cache.page_size)
    assert np.all(slots[dead] == -1) and np.all(slots[np.r_[3:5, 9:11]] >= 0)
    want_cache = assert_cache_is_the_write(new, cache, k, v, slots, slots)
    out = np.asarray(out)
    assert np.all(out[dead] == 0)
    want = ragged_f64(q, want_cache, kv_lens, tables, cu_q_lens, scale=0.3)
    assert rel_err(out, want) < 2e-5
    # a decreasing cu_q_lens acts as its running maximum: sequence 1 gets no rows
    bad_cu, fixed_cu = np.asarray([0, 5, 3, 9, 11], np.int32), np.asarray([0, 5, 5, 9, 11], np.int32)
    out_bad, cache_bad = run_step(q, k, v, cache, kv_lens, tables, bad_cu)
    out_fixed, cache_fixed = run_step(q, k, v, cache, kv_lens, tables, fixed_cu)
    np.testing.assert_array_equal(np.asarray(out_bad), np.asarray(out_fixed))
    np.testing.assert_array_equal(np.asarray(cache_bad.k_codes), np.asarray(cache_fixed.k_codes))


def test_jit_with_the_cache_donated_and_two_steps(rng):
    """Under jax.jit(..., donate_argnums=3) the cache is updated in place (the input's buffers
    are consumed); a second step (decode after the prefill) reads the first one's tokens."""
    cache = make_cache(rng, "window")
    q, k, v, kv_lens, tables, cu_q_lens = step_case(rng, cache, (9, 4), (9, 4))
    ids = jnp.asarray([3, 1], jnp.int32)
    step = jax.jit(tq.ragged_paged_attention, donate_argnums=3)
    donated = jax.tree_util.tree_map(jnp.copy, cache)
    out, cache1 = step(q, k, v, donated, kv_lens, tables, cu_q_lens, window_ids=ids)
    assert donated.k_codes.is_deleted() and donated.k_window.is_deleted()
    slots = expected_slots(tables, kv_lens, cu_q_lens, q.shape[0], cache.page_size, cache.window, [3, 1])
    want_cache = assert_cache_is_the_write(cache1, cache, k, v, *slots)
    assert rel_err(out, ragged_f64(q, want_cache, kv_lens, tables, cu_q_lens, [3, 1])) < 2e-5
    q2, k2, v2 = (jnp.asarray(rng.normal(size=(2,) + x.shape[1:]), jnp.float32) for x in (q, k, v))
    kv2, cu2 = kv_lens + 1, np.asarray([0, 1, 2], np.int32)
    before = jax.tree_util.tree_map(jnp.copy, cache1)
    out2, cache2 = step(q2, k2, v2, cache1, kv2, tables, cu2, window_ids=ids)
    slots = expected_slots(tables, kv2, cu2, 2, cache.page_size, cache.window, [3, 1])
    want_cache = assert_cache_is_the_write(cache2, before, k2, v2, *slots)
    assert rel_err(out2, ragged_f64(q2, want_cache, kv2, tables, cu2, [3, 1])) < 2e-5


def test_checked_mode_names_the_step_s_arguments(rng):
    cache = make_cache(rng, "window")
    q, k, v, kv_lens, tables, cu_q_lens = step_case(rng, cache, (9, 4, 3), (2, 1, 3), pad_rows=2)
    step = jax.jit(tq.checked(tq.ragged_paged_attention))
    err, _ = step(q, k, v, cache, kv_lens, tables, cu_q_lens)   # padding rows and decode rows are legal
    err.throw()
    cases = [
        (dict(kv_lens=np.asarray([9, 4, 99], np.int32)), r"ragged_paged_attention: kv_lens\[2\] = 99 is outside"),
        (dict(cu_q_lens=np.asarray([0, 2, 1, 6], np.int32)), "cu_q_lens decreases from 2 to 1 at sequence 1"),
        (dict(cu_q_lens=np.asarray([0, 2, 3, 9], np.int32)), r"cu_q_lens\[-1\] = 9 must be <= num_tokens = 8"),
        (dict(kv_lens=np.asarray([9, 4, 2], np.int32)), r"sequence 2 has 3 new query rows but kv_lens\[2\] = 2"),
        (dict(window_ids=np.asarray([0, 8, 1], np.int32)), r"window_ids\[1\] = 8 is outside \[0, 8\)"),
    ]
    for change, match in cases:
        args = dict(kv_lens=kv_lens, cu_q_lens=cu_q_lens, window_ids=None) | change
        err, _ = step(q, k, v, cache, args["kv_lens"], tables, args["cu_q_lens"], window_ids=args["window_ids"])
        with pytest.raises(Exception, match=match):
            err.throw()


def test_bad_arguments_raise_naming_them(rng):
    cache = make_cache(rng, "haar")
    q, k, v, kv_lens, tables, cu_q_lens = step_case(rng, cache, (9, 4), (2, 1))
    f = tq.ragged_paged_attention
    cases = [
        ((q, k, v, cache, kv_lens.astype(np.int64), tables, cu_q_lens), TypeError,
         r"ragged_paged_attention: kv_lens must be int32 \[num_seqs\], got int64\(2,\)"),
        ((q, k, v, cache, kv_lens, tables, cu_q_lens[:-1]), ValueError,
         r"cu_q_lens must be int32 \[num_seqs \+ 1 = 3\] \(kv_lens. length \+ 1\), got int32\(2,\)"),
        ((q, k, v, cache, kv_lens, tables[:1], cu_q_lens), ValueError,
         r"block_tables must be int32 \[num_seqs=2 \(kv_lens. length\), max_pages\], got int32\(1, 2\)"),
        ((q[:, :3], k, v, cache, kv_lens, tables, cu_q_lens), ValueError,
         "num_heads 3 is not a positive multiple of the cache's num_kv_heads 2"),
        ((q[:, :0], k, v, cache, kv_lens, tables, cu_q_lens), ValueError,
         "ragged_paged_attention: num_heads 0 is not a positive multiple"),
        ((q, k[:, :1], v, cache, kv_lens, tables, cu_q_lens), ValueError,
         r"k must be \[num_tokens, num_kv_heads, head_dim\] = \(3, 2, 64\)"),
        ((q, k, v[:2], cache, kv_lens, tables, cu_q_lens), ValueError, r"v must be \[num_tokens"),
        ((q, k, v.astype(jnp.int32), cache, kv_lens, tables, cu_q_lens), TypeError,
         "v must be float32, bfloat16 or float16"),
        ((q[0], k, v, cache, kv_lens, tables, cu_q_lens), ValueError, r"q must be \[num_tokens, num_heads, head_dim\]"),
        ((q[..., :32], k, v, cache, kv_lens, tables, cu_q_lens), ValueError, "q has head_dim 32 but the cache"),
        ((q, k, v, None, kv_lens, tables, cu_q_lens), TypeError, "cache must be a jax_tq.PagedKVCache"),
        # not arrays at all (were JAX's errors naming neither the argument nor the op)
        ((None, k, v, cache, kv_lens, tables, cu_q_lens), TypeError,
         "ragged_paged_attention: q must be an array, got NoneType"),
        ((q, k, "v", cache, kv_lens, tables, cu_q_lens), TypeError, "ragged_paged_attention: v must be an array, got str"),
        ((q, k, v, cache, None, tables, cu_q_lens), TypeError, r"kv_lens must be int32 \[num_seqs\], got NoneType"),
        ((q, k, v, cache, kv_lens, "tables", cu_q_lens), TypeError, "block_tables must be int32 .*, got str"),
    ]
    for args, error, match in cases:
        with pytest.raises(error, match=match):
            f(*args)
    with pytest.raises(ValueError, match="ragged_paged_attention: window_ids given but the cache has no window"):
        f(q, k, v, cache, kv_lens, tables, cu_q_lens, window_ids=np.zeros(2, np.int32))
    with pytest.raises(ValueError, match="ragged_paged_attention: scale must be finite"):
        f(q, k, v, cache, kv_lens, tables, cu_q_lens, scale=float("nan"))
    with pytest.raises(ValueError, match="ragged_paged_attention: precision must be"):
        f(q, k, v, cache, kv_lens, tables, cu_q_lens, precision="bogus")
    window_cache = make_cache(rng, "window")
    with pytest.raises(ValueError, match=r"window_ids must be int32 \[num_seqs=2\]"):
        f(q, k, v, window_cache, kv_lens, tables, cu_q_lens, window_ids=np.zeros(3, np.int32))


# ----------------------------------------------------------------------------- prompt_attention

def prompt_case(rng, cache, prompt_lens, seq_len, *, group=2, dtype=jnp.float32, max_pages=None):
    prompt_lens = np.asarray(prompt_lens, np.int32)
    batch, heads, d = len(prompt_lens), cache.num_kv_heads, cache.head_dim
    max_pages = max_pages or -(-seq_len // cache.page_size)
    tables = disjoint_tables(rng, prompt_lens, cache.page_size, cache.num_pages, max_pages)
    q = rng.normal(size=(batch, seq_len, heads * group, d))
    k = rng.normal(size=(batch, seq_len, heads, d)) * 2
    v = rng.normal(size=(batch, seq_len, heads, d))
    for b, n in enumerate(prompt_lens):
        for x in (q, k, v):
            x[b, max(n, 0):] = np.nan   # padding: never written, never read
    return jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), tables, prompt_lens


def prompt_slots(tables, prompt_lens, seq_len, page_size, window, window_ids):
    """The (slots, window slots) int32 [batch * seq_len] prompt_attention writes: position p of prompt
    b at its page where the table covers it, and its window entry among the prompt's last ``window``."""
    batch = len(prompt_lens)
    slots, window_slots = np.full((batch, seq_len), -1, np.int32), np.full((batch, seq_len), -1, np.int32)
    for b, n in enumerate(prompt_lens):
        for p in range(min(int(n), seq_len, tables.shape[1] * page_size)):   # the positions the table covers
            slots[b, p] = tables[b, p // page_size] * page_size + p % page_size
            if window and p >= n - window:
                window_slots[b, p] = window_ids[b] * window + p % window
    return slots.reshape(-1), window_slots.reshape(-1)


def check_prompts(rng, cache, prompt_lens, seq_len, *, group=2, dtype=jnp.float32, window_ids=None, max_pages=None):
    q, k, v, tables, prompt_lens = prompt_case(rng, cache, prompt_lens, seq_len, group=group, dtype=dtype,
                                               max_pages=max_pages)
    poison_device_memory(q.size * 4 * 4)
    out, new = jax.jit(tq.prompt_attention)(q, k, v, cache, tables, prompt_lens,
                                            window_ids=None if window_ids is None else jnp.asarray(window_ids))
    assert out.shape == q.shape and out.dtype == q.dtype
    ids = np.arange(len(prompt_lens)) if window_ids is None else np.asarray(window_ids)
    slots, window_slots = prompt_slots(tables, prompt_lens, seq_len, cache.page_size, cache.window, ids)
    flat = (-1,) + k.shape[2:]
    assert_cache_is_the_write(new, cache, k.reshape(flat), v.reshape(flat), slots, window_slots)
    want = prompt_f64(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), prompt_lens)
    got = np.asarray(out, np.float32)
    assert rel_err(got, want) < (1e-5 if dtype == jnp.float32 else 2e-2)
    real = np.arange(seq_len)[None, :] < prompt_lens[:, None]
    assert np.all(got[~real] == 0)
    return got


@pytest.mark.parametrize("kind,head_dim,group,dtype", [
    ("haar", 64, 2, jnp.float32), ("window", 64, 4, jnp.bfloat16), ("none", 64, 1, jnp.float32),
    ("hadamard", 128, 4, jnp.float16)])
def test_prompt_attention_is_exact_and_writes_the_prompts(rng, kind, head_dim, group, dtype):
    """Prompts of 13, 1, 0 and 16 tokens padded to 16 (NaN padding): exact causal attention over
    their own K / V, padding rows 0, the K / V in the cache at positions 0 .. len - 1."""
    cache = make_cache(rng, kind, head_dim=head_dim, window=8)
    check_prompts(rng, cache, (13, 1, 0, 16), 16, group=group, dtype=dtype,
                  window_ids=[2, 0, 1, 5] if kind == "window" else None)


@pytest.mark.parametrize("kind,dtype,variants", [("hadamard", jnp.bfloat16, {}), ("window", jnp.float32, {}),
                                                 ("haar", jnp.float32, {"soft_cap": 20.0, "sliding_window": 5})])
def test_prompt_attention_without_prompt_lens_takes_every_prompt_whole(rng, kind, dtype, variants):
    """prompt_lens None (no padding masks): the output and cache of prompt_lens = seq_len for every
    prompt, exact against float64, every token written."""
    cache = make_cache(rng, kind, head_dim=64, window=8)
    q, k, v, tables, lens = prompt_case(rng, cache, (16, 16, 16), 16, dtype=dtype)
    f = jax.jit(functools.partial(tq.prompt_attention, **variants))
    out, new = f(q, k, v, cache, tables)
    out_lens, new_lens = f(q, k, v, cache, tables, lens)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(out_lens, np.float32), rtol=1e-6, atol=1e-6)
    for name in ("k_codes", "v_codes", "k_norms", "v_norms", "k_window", "v_window"):
        if getattr(new, name) is not None:
            np.testing.assert_array_equal(np.asarray(getattr(new, name)), np.asarray(getattr(new_lens, name)))
    want = prompt_f64(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), lens, **variants)
    assert rel_err(np.asarray(out, np.float32), want) < (1e-5 if dtype == jnp.float32 else 2e-2)
    slots = np.asarray(tables)[:, np.arange(16) // cache.page_size] * cache.page_size + np.arange(16) % cache.page_size
    window_slots = (np.arange(3)[:, None] * cache.window + np.arange(16) % max(cache.window, 1)
                    if cache.window else np.full((3, 16), -1))
    window_slots = np.where(np.arange(16) >= 16 - cache.window, window_slots, -1)
    assert_cache_is_the_write(new, cache, k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]),
                              slots.reshape(-1).astype(np.int32), window_slots.reshape(-1).astype(np.int32))


@pytest.mark.parametrize("variant,dtype", [
    ("window", jnp.float32), ("window", jnp.bfloat16), ("soft_cap", jnp.float32), ("sinks", jnp.float32),
    ("all", jnp.bfloat16)])
def test_prompt_attention_variants_against_float64(rng, monkeypatch, variant, dtype):
    """sliding_window (through jax.nn's local_window_size), soft_cap and sinks (the exact float32
    path, 5 query rows a step here so that steps and a partial last one are exercised) against the
    float64 oracle; padding rows 0; the write is the same as without variants."""
    monkeypatch.setattr(tq.ragged, "_EXACT_ROWS", 5)
    cache = make_cache(rng, "haar")
    q, k, v, tables, lens = prompt_case(rng, cache, (13, 1, 0, 16), 16, group=2, dtype=dtype)
    heads = q.shape[2]
    options = dict(sliding_window=4 if variant in ("window", "all") else None,
                   soft_cap=1.5 if variant in ("soft_cap", "all") else None,
                   sinks=rng.normal(size=heads).astype(np.float32) * 2 if variant in ("sinks", "all") else None)
    poison_device_memory(q.size * 4 * 4)
    f = jax.jit(functools.partial(tq.prompt_attention, **{n: x for n, x in options.items() if n != "sinks"}))
    out, new = f(q, k, v, cache, tables, lens, sinks=options["sinks"])
    want = prompt_f64(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), lens, **options)
    got = np.asarray(out, np.float32)
    assert rel_err(got, want) < (1e-5 if dtype == jnp.float32 else 2e-2)
    assert np.all(got[np.arange(16)[None, :] >= lens[:, None]] == 0)
    plain = prompt_f64(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), lens)
    assert rel_err(plain, want) > 0.05  # the variant changes the answer
    _, plain_cache = tq.prompt_attention(q, k, v, cache, tables, lens)
    want_leaves = leaves(plain_cache)
    for name, got_leaf in leaves(new).items():
        np.testing.assert_array_equal(got_leaf, want_leaves[name])


@pytest.mark.parametrize("variant", ["plain", "soft_cap", "sinks"])
def test_prompt_attention_nan_padding_queries_leave_gradients_finite(rng, variant):
    """A NaN query in a padding row (its output is 0) gave NaN gradients for the real tokens' K / V
    and the sinks (a review found it): padding rows are zeroed before any product."""
    cache = make_cache(rng, "haar")
    q, k, v, tables, lens = prompt_case(rng, cache, (3,), 6)  # rows 3 .. 5 of q, k, v are NaN
    sinks = jnp.asarray(rng.normal(size=q.shape[2]), jnp.float32) if variant == "sinks" else None
    soft_cap = 2.0 if variant == "soft_cap" else None

    def loss(q, k, v, sinks):
        out, _ = tq.prompt_attention(q, k, v, cache, tables, lens, soft_cap=soft_cap, sinks=sinks)
        return jnp.sum(jnp.sin(out))

    grads = jax.grad(loss, argnums=(0, 1, 2, 3) if sinks is not None else (0, 1, 2))(q, k, v, sinks)
    for g in grads:
        assert np.isfinite(np.asarray(g)).all()
    assert np.all(np.asarray(grads[0])[0, 3:] == 0) and np.abs(np.asarray(grads[1])[0, :3]).max() > 0


def test_prompt_attention_variants_bad_arguments(rng):
    cache = make_cache(rng, "haar")
    q, k, v, tables, lens = prompt_case(rng, cache, (5, 3), 6)
    with pytest.raises(ValueError, match="prompt_attention: sliding_window must be >= 1"):
        tq.prompt_attention(q, k, v, cache, tables, lens, sliding_window=0)
    with pytest.raises(ValueError, match="prompt_attention: soft_cap must be finite and > 0"):
        tq.prompt_attention(q, k, v, cache, tables, lens, soft_cap=-1.0)
    with pytest.raises(ValueError, match=r"prompt_attention: sinks must be float32 \[num_heads=4\]"):
        tq.prompt_attention(q, k, v, cache, tables, lens, sinks=np.zeros(3, np.float32))


@pytest.mark.parametrize("kind", ["hadamard", "window"])
def test_prompt_attention_chain_with_the_cache_donated_writes_every_prompt(rng, kind):
    """Three jitted prompt_attention calls on one donated cache, each on new pages and windows: the
    cache after each is write_cache of the calls so far bit for bit (the pools updated in place
    call after call), the outputs exact."""
    cache = make_cache(rng, kind, head_dim=128, num_pages=3 * 4 * 64 // 8, window=8, num_windows=12)
    step = jax.jit(tq.prompt_attention, donate_argnums=3)
    want = jax.tree_util.tree_map(jnp.copy, cache)
    free = rng.permutation(cache.num_pages)
    for call in range(3):
        q, k, v, _, lens = prompt_case(rng, cache, (64, 50, 64, 9), 64, dtype=jnp.bfloat16)
        tables = free[call * 32:(call + 1) * 32].reshape(4, 8).astype(np.int32)
        ids = np.arange(4, dtype=np.int32) + 4 * call
        out, cache = step(q, k, v, cache, tables, lens, window_ids=jnp.asarray(ids) if kind == "window" else None)
        slots, wslots = prompt_slots(tables, lens, 64, cache.page_size, cache.window, ids)
        flat = (-1,) + k.shape[2:]
        want = tq.write_cache(want, k.reshape(flat), v.reshape(flat), jnp.asarray(slots),
                              jnp.asarray(wslots) if kind == "window" else None)
        for name, leaf in leaves(cache).items():
            np.testing.assert_array_equal(leaf, leaves(want)[name], err_msg=f"call {call}: {name}")
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        assert rel_err(np.asarray(out, np.float32), prompt_f64(f32(q), f32(k), f32(v), lens)) < 2e-2


def test_prompt_attention_is_not_the_compressed_prefill(rng):
    """The same prompt through ragged_paged_attention reads its tokens back compressed: the two
    differ by the quantization error (and agree over an uncompressed float32 cache)."""
    for kind in ("haar", "none"):
        cache = make_cache(rng, kind)
        q, k, v, tables, lens = prompt_case(rng, cache, (12,), 12)
        exact, _ = tq.prompt_attention(q, k, v, cache, tables, lens)
        paged, _ = tq.ragged_paged_attention(q[0], k[0], v[0], cache, lens, tables, jnp.asarray([0, 12], jnp.int32))
        err = rel_err(paged, exact[0])
        assert (err > 1e-3) if kind == "haar" else (err < 1e-5)


def test_prompt_past_its_block_table_and_checked_mode(rng):
    """A prompt longer than its table writes only the positions the table covers (attending over
    all of them); checked mode names prompt_lens. Without prompt_lens every prompt is seq_len long:
    a seq_len past the table's capacity is a trace-time error (tokens that would be lost)."""
    cache = make_cache(rng, "haar")
    check_prompts(rng, cache, (12, 5), 12, max_pages=1)   # 8 positions covered
    q, k, v, tables, lens = prompt_case(rng, cache, (12, 5), 12, max_pages=1)
    step = jax.jit(tq.checked(tq.prompt_attention))
    err, _ = step(q, k, v, cache, tables, lens)
    with pytest.raises(Exception, match=r"prompt_attention: prompt_lens\[0\] = 12 is outside \[0, 8\]"):
        err.throw()
    with pytest.raises(ValueError, match=r"prompt_attention: seq_len 12 \(every prompt's length, prompt_lens None\) "
                       r"exceeds the block_tables' capacity max_pages \* page_size = 1 \* 8 = 8 tokens"):
        step(q, k, v, cache, tables)  # no prompt_lens: every prompt is seq_len = 12 long
    out, written = jax.jit(tq.prompt_attention)(q[:, :8], k[:, :8], v[:, :8], cache, tables)  # exactly the capacity
    want, _ = jax.jit(tq.prompt_attention)(q[:, :8], k[:, :8], v[:, :8], cache, tables, np.asarray([8, 8], np.int32))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    q, k, v, tables, lens = prompt_case(rng, cache, (12, 12), 12)  # both rows' pages valid up to 16 positions
    err, _ = step(q, k, v, cache, tables, np.asarray([12, 13], np.int32))
    with pytest.raises(Exception, match=r"prompt_lens\[1\] = 13 is past seq_len = 12"):
        err.throw()
    err, _ = step(q, k, v, cache, tables, lens)
    err.throw()


def test_prompt_attention_bad_arguments(rng):
    cache = make_cache(rng, "haar")
    q, k, v, tables, lens = prompt_case(rng, cache, (5, 3), 6)
    f = tq.prompt_attention
    with pytest.raises(TypeError, match=r"prompt_attention: prompt_lens must be int32 \[batch=2\], got int64"):
        f(q, k, v, cache, tables, lens.astype(np.int64))
    with pytest.raises(TypeError, match="k must have q's dtype float32, got bfloat16"):
        f(q, k.astype(jnp.bfloat16), v, cache, tables, lens)
    with pytest.raises(ValueError, match=r"v must be \[batch, seq_len, num_kv_heads, head_dim\] = \(2, 6, 2, 64\)"):
        f(q, k, v[:, :5], cache, tables, lens)
    with pytest.raises(ValueError, match=r"q must be \[batch, seq_len, num_heads, head_dim\]"):
        f(q[0], k, v, cache, tables, lens)
    with pytest.raises(ValueError, match="num_heads 3 is not a positive multiple"):
        f(q[:, :, :3], k, v, cache, tables, lens)
    with pytest.raises(ValueError, match=r"block_tables must be int32 \[batch=2, max_pages\]"):
        f(q, k, v, cache, tables[0], lens)
    with pytest.raises(ValueError, match="implementation must be None, 'xla' or 'cudnn'"):
        f(q, k, v, cache, tables, lens, implementation="flash")
    if jax.devices()[0].platform == "cpu":  # no cuDNN: named as this op's argument
        with pytest.raises(ValueError, match="prompt_attention: implementation='cudnn' cannot serve this call"):
            f(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), cache, tables, lens,
              implementation="cudnn")


def test_more_sequences_than_windows_need_window_ids_and_lengths_are_named():
    """The default window ids (arange) would run past the cache's windows: a trace-time error, not
    silent zero rows; a kv_lens / block_tables length mismatch names kv_lens as the source of num_seqs."""
    cache = tq.PagedKVCache.create(num_pages=8, page_size=16, num_kv_heads=2, preset="k4v4", head_dim=64, num_windows=2)
    q = jnp.zeros((3, 4, 64), jnp.float32)
    kv = jnp.zeros((3, 2, 64), jnp.float32)
    tables = jnp.arange(6, dtype=jnp.int32).reshape(3, 2)
    lens = jnp.ones((3,), jnp.int32)
    starts = jnp.arange(4, dtype=jnp.int32)
    with pytest.raises(ValueError, match="3 sequences but the cache has 2 window ids"):
        tq.ragged_paged_attention(q, kv, kv, cache, lens, tables, starts)
    out, _ = tq.ragged_paged_attention(q, kv, kv, cache, lens, tables, starts, window_ids=jnp.asarray([0, 1, 1], jnp.int32))
    assert out.shape == q.shape
    with pytest.raises(ValueError, match="3 sequences but the cache has 2 window ids"):
        tq.prompt_attention(q[:, None], kv[:, None], kv[:, None], cache, tables, lens)
    with pytest.raises(ValueError, match="kv_lens' length"):
        tq.ragged_paged_attention(q, kv, kv, cache, lens[:2], tables, starts)


def test_a_table_wider_than_int32_positions_is_served(rng):
    """block_tables' width x page_size past 2^31 tokens: kv_lens (int32) all fit, nothing overflows."""
    cache = tq.PagedKVCache.create(num_pages=4, page_size=256, num_kv_heads=1, k_codec=tq.TurboQuant(64, 4, 0),
                                   v_codec=tq.TurboQuant(64, 4, 1))
    tables = jnp.full((1, 2**23 + 1), -1, jnp.int32).at[0, 0].set(0)
    q = jnp.asarray(rng.normal(size=(2, 2, 64)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(2, 1, 64)), jnp.float32)
    lens, starts = jnp.asarray([2], jnp.int32), jnp.asarray([0, 2], jnp.int32)
    out, _ = tq.ragged_paged_attention(q, k, k, cache, lens, tables, starts)
    narrow, _ = tq.ragged_paged_attention(q, k, k, cache, lens, tables[:, :1], starts)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(narrow))
    assert np.abs(np.asarray(out)).max() > 0
