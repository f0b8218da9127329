"""Edge cases of the FFI kernels (backend "ffi"; CPU here, CUDA on a GPU machine) against the float64 oracle.

Covers: poisoned unused slots / pages, empty sequences, huge logits (also splits whose every logit is far
below the global max), split counts beyond the page count, GQA head mapping, page sizes up to 256 (no token
skipped), every head_dim with K/V bit widths, zero and huge-magnitude inputs, vmap axes and empty batches,
trace-time refusals and non-donated inputs left untouched.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tq as tq
from jax_tq import _compat
from jax_tq.format import unpack_codes
from oracle import compress_f64, decode_f64, decompress_f64, primitive_count, random_cache, random_tables, rel_err


@pytest.fixture(autouse=True)
def ffi_backend():
    with tq.use_backend("ffi"):
        yield


_decode = jax.jit(tq.paged_decode, static_argnames=("scale", "num_splits"))
_write = jax.jit(tq.write_cache)


def _pages_needed(n, page_size):
    return -(-int(n) // page_size)


def _valid_slots(tables, seq_lens, num_pages, page_size):
    """bool [num_pages, page_size]: slots some sequence attends to."""
    valid = np.zeros((num_pages, page_size), bool)
    tables = np.asarray(tables)
    for i, n in enumerate(np.asarray(seq_lens)):
        for p in range(int(n)):
            page = int(tables[i, p // page_size])
            if 0 <= page < num_pages:
                valid[page, p % page_size] = True
    return valid


def _poison(rng, cache, valid):
    """(poisoned, clean): every slot outside ``valid`` gets NaN/inf norms and random code bytes in
    ``poisoned`` and zero norms / zero codes in ``clean``; valid slots are the same in both."""
    bad = ~valid  # [P, page]
    poison_vals = np.array([np.nan, np.inf, -np.inf, 3e38], np.float32)
    out_p, out_c = {}, {}
    for name in ("k", "v"):
        codes = np.array(getattr(cache, f"{name}_codes"))
        norms = np.array(getattr(cache, f"{name}_norms"))
        garbage = rng.integers(0, 256, size=codes.shape, dtype=np.uint8)
        mask4 = np.broadcast_to(bad[:, None, :, None], codes.shape)
        mask3 = np.broadcast_to(bad[:, None, :], norms.shape)
        # Half NaN, the rest +-inf or 3e38: any read of such a slot turns the output non-finite or wrong.
        pois = np.where(rng.random(norms.shape) < 0.5, np.float32(np.nan),
                        poison_vals[rng.integers(0, 4, size=norms.shape)])
        out_p[f"{name}_codes"] = jnp.asarray(np.where(mask4, garbage, codes))
        out_p[f"{name}_norms"] = jnp.asarray(np.where(mask3, pois, norms).astype(np.float32))
        out_c[f"{name}_codes"] = jnp.asarray(np.where(mask4, 0, codes).astype(np.uint8))
        out_c[f"{name}_norms"] = jnp.asarray(np.where(mask3, 0, norms).astype(np.float32))
    return dataclasses.replace(cache, **out_p), dataclasses.replace(cache, **out_c)


def _poisoned_setup(rng, *, seq_lens, page_size, num_kv_heads=2, head_dim=64, k_bits=4, v_bits=3,
                    spare_pages=4, max_pages=None):
    """A cache whose only finite data are the slots the sequences attend to; unused block-table
    entries point at (valid, in-pool) poisoned pages."""
    used = [_pages_needed(n, page_size) for n in seq_lens]
    num_pages = sum(used) + spare_pages
    max_pages = max_pages or max(used) + 2
    cache = random_cache(rng, num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, k_bits=k_bits, v_bits=v_bits, seed=int(rng.integers(50)))
    perm = rng.permutation(num_pages)
    spare = perm[sum(used):]
    tables = np.empty((len(seq_lens), max_pages), np.int32)
    start = 0
    for i, n in enumerate(used):
        tables[i, :n] = perm[start:start + n]
        tables[i, n:] = rng.choice(spare, size=max_pages - n)  # in-pool pages full of poison
        start += n
    seq_lens = jnp.asarray(seq_lens, jnp.int32)
    tables = jnp.asarray(tables)
    poisoned, clean = _poison(rng, cache, _valid_slots(tables, seq_lens, num_pages, page_size))
    return poisoned, clean, tables, seq_lens


def _token_rows(cache, name, page, head, offset):
    """(unpacked code indices, norm) of one stored token."""
    codec = getattr(cache, f"{name}_codec")
    codes = np.asarray(getattr(cache, f"{name}_codes"))[page, head, offset]
    idx = unpack_codes(codes[None], codec.bits, codec.head_dim)[0]
    return idx, float(np.asarray(getattr(cache, f"{name}_norms"))[page, head, offset])


def _value_f64(cache, page, head, offset):
    """The decoded V vector (float64, original domain) of one stored token."""
    idx, norm = _token_rows(cache, "v", page, head, offset)
    c = np.asarray(cache.v_codec.centroids, np.float64)
    return norm * (c[idx] @ np.asarray(cache.v_codec.rotation, np.float64))


def _aligned_query(cache, page, head, offset, magnitude):
    """A query (original domain) parallel to one stored key's decoded direction, |q| = magnitude."""
    idx, _ = _token_rows(cache, "k", page, head, offset)
    k_rot = np.asarray(cache.k_codec.centroids, np.float64)[idx]
    q_rot = k_rot / np.linalg.norm(k_rot) * magnitude
    return q_rot @ np.asarray(cache.k_codec.rotation, np.float64)  # q_rot = Pi_k q


# ----------------------------------------------------------------------------- 1. partial last page, poison

@pytest.mark.parametrize("page_size,seq_lens,num_splits", [
    (16, [37, 5, 16, 1], 1),
    (16, [37, 5, 16, 1], 3),
    (8, [23, 9, 2], 5),
    (48, [49, 95, 7], 2),
])
def test_poisoned_unused_slots_and_pages_are_never_read(rng, page_size, seq_lens, num_splits):
    poisoned, clean, tables, lens = _poisoned_setup(rng, seq_lens=seq_lens, page_size=page_size)
    assert np.isnan(np.asarray(poisoned.k_norms)).any() and np.isnan(np.asarray(poisoned.v_norms)).any()
    q = jnp.asarray(rng.normal(size=(len(seq_lens), 4, 64)) * 2, jnp.float32)
    got = _decode(q, poisoned, tables, lens, num_splits=num_splits)
    want = decode_f64(np.asarray(q, np.float64), clean, tables, lens)
    assert rel_err(got, want) < 1e-5
    assert rel_err(got, _decode(q, clean, tables, lens, num_splits=num_splits)) < 1e-6
    # The oracle is not trivially satisfied: attending to one more token (the first unused slot) differs.
    longer = decode_f64(np.asarray(q, np.float64), clean, tables, lens + 1)
    assert rel_err(longer, want) > 1e-3


def test_poisoned_slots_with_the_xla_backend_too(rng):
    """The pure-jnp backend (also the fallback under "auto") must not let 0 * NaN from unused slots leak in."""
    poisoned, clean, tables, lens = _poisoned_setup(rng, seq_lens=[37, 0, 9], page_size=16)
    q = jnp.asarray(rng.normal(size=(3, 4, 64)), jnp.float32)
    with tq.use_backend("xla"):
        got = np.asarray(tq.paged_decode(q, poisoned, tables, lens))
        out = np.asarray(tq.paged_decode(q, poisoned, jnp.zeros((3, 0), jnp.int32), lens))  # no pages at all
    assert rel_err(got, decode_f64(np.asarray(q, np.float64), clean, tables, lens)) < 1e-5
    assert np.all(got[1] == 0) and np.all(out == 0)


# ----------------------------------------------------------------------------- 2. empty sequences

@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("q_dtype", [jnp.float32, jnp.bfloat16])
def test_empty_sequences_give_exact_zeros(rng, num_splits, q_dtype):
    lens = [0, 5, 0, 37, 0]
    poisoned, clean, tables, seq_lens = _poisoned_setup(rng, seq_lens=lens, page_size=16)
    tables = np.asarray(tables).copy()
    tables[0, 0] = -7  # empty rows: garbage, in-pool poison or out-of-pool ids; never read
    tables[2, 0] = 10_000
    q = jnp.asarray(rng.normal(size=(len(lens), 6, 64)) * 3, q_dtype)
    got = np.asarray(_decode(q, poisoned, jnp.asarray(tables), seq_lens, num_splits=num_splits), np.float32)
    assert not np.isnan(got).any()
    empty = np.asarray(lens) == 0
    assert np.all(got[empty] == 0.0)
    want = decode_f64(np.asarray(q, np.float64), clean, tables, seq_lens)
    tol = 1e-5 if q_dtype == jnp.float32 else 1e-2
    assert rel_err(got[~empty], want[~empty]) < tol
    assert np.all(np.abs(got[~empty]).max(axis=-1) > 0)


def test_sequence_whose_pages_are_all_invalid_gives_zeros(rng):
    cache = random_cache(rng, num_pages=6, page_size=16, num_kv_heads=1, head_dim=64, k_bits=4, v_bits=4)
    tables = jnp.asarray([[-1, 6, 99], [2, 3, 0]], jnp.int32)
    lens = jnp.asarray([40, 20], jnp.int32)
    q = jnp.asarray(rng.normal(size=(2, 2, 64)), jnp.float32)
    got = np.asarray(_decode(q, cache, tables, lens, num_splits=2))
    assert np.all(got[0] == 0.0) and np.abs(got[1]).max() > 0
    assert rel_err(got[1], decode_f64(np.asarray(q, np.float64), cache, tables, lens)[1]) < 1e-5


# ----------------------------------------------------------------------------- 3. huge logits

@pytest.mark.parametrize("magnitude", [1e3, 1e4])
@pytest.mark.parametrize("position", ["first", "middle", "last"])
def test_one_dominant_token_other_splits_far_below_max(rng, magnitude, position):
    """q aligned with one key and scaled: that token's split holds the max, every other split's logits
    are hundreds to thousands below it (exp underflows even in float64 at 1e4)."""
    page_size, seq_len = 16, 8 * 16 - 3
    cache = random_cache(rng, num_pages=12, page_size=page_size, num_kv_heads=2, head_dim=128, k_bits=4, v_bits=4)
    lens = jnp.asarray([seq_len, 40], jnp.int32)
    tables = random_tables(rng, np.asarray(lens), page_size, 12, max_pages=9)
    t = {"first": 0, "middle": 61, "last": seq_len - 1}[position]
    page, off = int(tables[0, t // page_size]), t % page_size
    cache = dataclasses.replace(cache, k_norms=cache.k_norms.at[page, 1, off].set(2.0))
    q = rng.normal(size=(2, 4, 128)) * magnitude / np.sqrt(128)  # sequence 1: random huge queries
    q[0, 2] = _aligned_query(cache, page, 1, off, magnitude)     # head 2 reads KV head 1
    q[0, 3] = -q[0, 2]                                           # the same token is now the minimum
    q = jnp.asarray(q, jnp.float32)
    want = decode_f64(np.asarray(q, np.float64), cache, tables, lens)
    v_star = _value_f64(cache, page, 1, off)
    assert rel_err(want[0, 2], v_star) < 1e-6, "construction: the dominant token must own the softmax"
    for splits in (1, 2, 3, 8, 11):
        got = np.asarray(_decode(q, cache, tables, lens, num_splits=splits))
        assert np.isfinite(got).all()
        assert rel_err(got, want) < 1e-3  # logits ~1e3: float32 rounding of q_rot alone moves weights by ~1e-4
        assert rel_err(got[0, 2], v_star) < 1e-5
        assert np.abs(got[0, 3]).max() > 0


@pytest.mark.parametrize("q_scale", [1e3, 1e4])
def test_huge_logits_with_bf16_queries_and_empty_rows(rng, q_scale):
    poisoned, clean, tables, lens = _poisoned_setup(rng, seq_lens=[70, 0, 3, 33], page_size=16)
    q = jnp.asarray(rng.normal(size=(4, 4, 64)) * q_scale, jnp.bfloat16)
    want = decode_f64(np.asarray(q, np.float64), clean, tables, lens)
    for splits in (1, 5):
        got = np.asarray(_decode(q, poisoned, tables, lens, num_splits=splits), np.float32)
        assert np.isfinite(got).all() and np.all(got[1] == 0)
        # bf16 output rounding only: each row's softmax is dominated by a few tokens, nothing collapses.
        assert rel_err(got, want) < 1e-2
        assert np.abs(got[[0, 2, 3]]).max(axis=-1).min() > 0


# ----------------------------------------------------------------------------- 4. split counts

def test_split_counts_from_one_to_beyond_the_page_count(rng):
    lens = [1, 2, 15, 16, 17, 33, 100, 0]  # up to 7 pages of 16
    poisoned, clean, tables, seq_lens = _poisoned_setup(rng, seq_lens=lens, page_size=16, max_pages=8)
    q = jnp.asarray(rng.normal(size=(len(lens), 4, 64)) * 2, jnp.float32)
    want = decode_f64(np.asarray(q, np.float64), clean, tables, seq_lens)
    outs = {}
    for splits in (1, 2, 3, 4, 6, 7, 8, 13, 64):
        got = np.asarray(_decode(q, poisoned, tables, seq_lens, num_splits=splits))
        assert rel_err(got, want) < 1e-5, f"num_splits={splits}"
        assert np.all(got[-1] == 0)
        outs[splits] = got
    # The result does not depend on the split count beyond float rounding.
    for splits, got in outs.items():
        assert rel_err(got, outs[1]) < 3e-6, f"num_splits={splits}"


# ----------------------------------------------------------------------------- 5. GQA

GQA_CASES = [(1, 1), (1, 3), (3, 2), (5, 1), (5, 3), (6, 2), (7, 1), (7, 3), (8, 2), (16, 1), (16, 3), (24, 2)]


@pytest.mark.parametrize("group,num_kv_heads", GQA_CASES, ids=[f"g{g}-kv{h}" for g, h in GQA_CASES])
def test_gqa_query_heads_read_their_kv_head(rng, group, num_kv_heads):
    page_size, num_pages = 16, 8
    cache = random_cache(rng, num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv_heads,
                         head_dim=64, k_bits=3, v_bits=4, seed=int(rng.integers(50)))
    lens = jnp.asarray([45, 9], jnp.int32)
    tables = random_tables(rng, np.asarray(lens), page_size, num_pages)
    num_heads = group * num_kv_heads
    q = jnp.asarray(rng.normal(size=(2, num_heads, 64)) * 3, jnp.float32)
    got = _decode(q, cache, tables, lens, num_splits=2)
    assert rel_err(got, decode_f64(np.asarray(q, np.float64), cache, tables, lens)) < 1e-5

    # Direct check: every token of KV head g holds the same V (its own code pattern, norm g + 1), so
    # query head h must output exactly KV head h // group's vector whatever the softmax weights.
    patterns = rng.integers(0, 256, size=(num_kv_heads, cache.v_codec.packed_bytes), dtype=np.uint8)
    v_codes = np.broadcast_to(patterns[None, :, None, :], cache.v_codes.shape)
    v_norms = np.broadcast_to((np.arange(num_kv_heads, dtype=np.float32) + 1)[None, :, None], cache.v_norms.shape)
    marked = dataclasses.replace(cache, v_codes=jnp.asarray(v_codes), v_norms=jnp.asarray(v_norms))
    got = np.asarray(_decode(q, marked, tables, lens, num_splits=2))
    heads = [_value_f64(marked, 0, g, 0) for g in range(num_kv_heads)]
    for h in range(num_heads):
        for s in range(2):
            assert rel_err(got[s, h], heads[h // group]) < 1e-5, f"query head {h} read the wrong KV head"


# ----------------------------------------------------------------------------- 6. page sizes

@pytest.mark.parametrize("page_size", [8, 16, 48, 96, 192, 256])
def test_page_sizes_no_token_skipped(rng, page_size):
    lens = [2 * page_size + 1, 3 * page_size, page_size - 1]
    num_pages = sum(_pages_needed(n, page_size) for n in lens) + 1
    cache = random_cache(rng, num_pages=num_pages, page_size=page_size, num_kv_heads=1, head_dim=64,
                         k_bits=4, v_bits=2, seed=int(rng.integers(50)))
    seq_lens = jnp.asarray(lens, jnp.int32)
    tables = random_tables(rng, lens, page_size, num_pages, max_pages=4)
    q = rng.normal(size=(3, 2, 64))
    # Head 1 of every sequence: only the very last token gets a huge score.
    last = []
    for s, n in enumerate(lens):
        page, off = int(tables[s, (n - 1) // page_size]), (n - 1) % page_size
        cache = dataclasses.replace(cache, k_norms=cache.k_norms.at[page, 0, off].set(2.0))
        last.append((page, off))
    for s, (page, off) in enumerate(last):
        q[s, 1] = _aligned_query(cache, page, 0, off, 1e4)
    q = jnp.asarray(q, jnp.float32)
    want = decode_f64(np.asarray(q, np.float64), cache, tables, seq_lens)
    for splits in (1, 3):
        got = np.asarray(_decode(q, cache, tables, seq_lens, num_splits=splits))
        assert rel_err(got, want) < 1e-5
        for s, (page, off) in enumerate(last):
            assert rel_err(got[s, 1], _value_f64(cache, page, 0, off)) < 1e-5, f"last token of sequence {s} skipped"
    # Dropping any one token moves head 0 well past the tolerance used above.
    shorter = decode_f64(np.asarray(q, np.float64), cache, tables, seq_lens - 1)
    assert min(rel_err(shorter[s, 0], want[s, 0]) for s in range(3)) > 1e-4


# ----------------------------------------------------------------------------- 7. head_dim x bits

# Every (head_dim, k_bits), (head_dim, v_bits) and (k_bits, v_bits) pair occurs (a Latin-square cover).
HD_BITS = [(hd, 2 + b, 2 + (b + i) % 3) for i, hd in enumerate((64, 80, 96, 128, 192, 256)) for b in range(3)]


@pytest.mark.parametrize("head_dim,k_bits,v_bits", HD_BITS, ids=[f"d{d}-k{k}-v{v}" for d, k, v in HD_BITS])
def test_head_dim_and_bits_write_then_decode(rng, head_dim, k_bits, v_bits):
    page_size, num_kv_heads, num_pages = 16, 2, 6
    k_codec = tq.TurboQuant(head_dim=head_dim, bits=k_bits, seed=3)
    v_codec = tq.TurboQuant(head_dim=head_dim, bits=v_bits, seed=4, rotation="hadamard" if k_bits == 3 else "haar")
    cache = tq.PagedKVCache.create(num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv_heads,
                                   k_codec=k_codec, v_codec=v_codec)
    lens = [37, 13]
    order = rng.permutation(num_pages)
    tables = np.full((2, 4), -1, np.int32)
    tables[0, :3], tables[1, :1] = order[:3], order[3:4]
    slots = np.concatenate([tables[s, np.arange(n) // page_size] * page_size + np.arange(n) % page_size
                            for s, n in enumerate(lens)]).astype(np.int32)
    num_tokens = sum(lens)
    k = rng.normal(size=(num_tokens, num_kv_heads, head_dim)) * rng.uniform(0.1, 5, size=(num_tokens, num_kv_heads, 1))
    v = np.asarray(jnp.asarray(rng.normal(size=(num_tokens, num_kv_heads, head_dim)), jnp.bfloat16), np.float64)
    cache = _write(cache, jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.bfloat16), jnp.asarray(slots))
    pages, offs = slots // page_size, slots % page_size
    for name, x, codec in (("k", np.asarray(jnp.asarray(k, jnp.float32), np.float64), k_codec), ("v", v, v_codec)):
        want_codes, want_norms = compress_f64(x, codec)
        got_norms = np.asarray(getattr(cache, f"{name}_norms"))[pages, :, offs]
        got_codes = np.asarray(getattr(cache, f"{name}_codes"))[pages, :, offs]
        np.testing.assert_allclose(got_norms, want_norms, rtol=2e-6)
        got_idx = unpack_codes(got_codes, codec.bits, head_dim).astype(int)
        want_idx = unpack_codes(want_codes, codec.bits, head_dim).astype(int)
        assert np.mean(got_idx == want_idx) > 0.999 and np.abs(got_idx - want_idx).max() <= 1
    q = jnp.asarray(rng.normal(size=(2, 2 * num_kv_heads, head_dim)) * 2, jnp.float32)
    got = _decode(q, cache, jnp.asarray(tables), jnp.asarray(lens, jnp.int32), num_splits=2)
    want = decode_f64(np.asarray(q, np.float64), cache, tables, jnp.asarray(lens, jnp.int32))
    assert rel_err(got, want) < 1e-5
    # End to end against attention on the uncompressed K/V: only the quantization error remains.
    q_mild = q * 0.25  # a softer softmax, so the K quantization error does not dominate
    got_mild = _decode(q_mild, cache, jnp.asarray(tables), jnp.asarray(lens, jnp.int32), num_splits=2)
    dense = _dense_f64(np.asarray(q_mild, np.float64), k, v, lens)
    err = rel_err(got_mild, dense)
    assert err < {2: 0.9, 3: 0.5, 4: 0.3}[min(k_bits, v_bits)], "decode is far from attention on the uncompressed K/V"


def _dense_f64(q, k, v, lens):
    """Plain float64 attention; sequence s holds tokens sum(lens[:s]) .. + lens[s] of k/v [T, Hkv, d]."""
    out = np.zeros_like(q)
    group = q.shape[1] // k.shape[1]
    start = 0
    for s, n in enumerate(lens):
        ks, vs = k[start:start + n], v[start:start + n]
        for h in range(q.shape[1]):
            logits = ks[:, h // group] @ q[s, h] / np.sqrt(q.shape[-1])
            w = np.exp(logits - logits.max())
            out[s, h] = (w / w.sum()) @ vs[:, h // group]
        start += n
    return out


# ----------------------------------------------------------------------------- 8. zero and huge vectors

@pytest.mark.parametrize("v_bits", [3, 4])
def test_zero_and_huge_bf16_vectors_written_then_decoded(rng, v_bits):
    """Zero and huge (1e5 per coordinate, logits ~1e5) vectors written then decoded against float64.
    On a GPU, float32 queries run the tensor-core kernel v3 (float32-accurate products), whose V
    weights once came from exp2((s + log2 |v_norm|) - m): at logits of 1e5 the sum rounds by ~0.01
    and the output was off by up to 1e-2 here."""
    head_dim, num_kv_heads, page_size = 128, 2, 16
    cache = tq.PagedKVCache.create(num_pages=4, page_size=page_size, num_kv_heads=num_kv_heads,
                                   k_codec=tq.TurboQuant(head_dim, bits=4, seed=5),
                                   v_codec=tq.TurboQuant(head_dim, bits=v_bits, seed=6))
    cache = dataclasses.replace(cache, k_norms=cache.k_norms + jnp.nan, v_norms=cache.v_norms + jnp.nan)
    shape = (4, num_kv_heads, head_dim)
    zeros = np.zeros(shape)
    huge = rng.uniform(0.5, 1.0, size=shape) * rng.choice([-1.0, 1.0], size=shape) * 1e5
    normal = rng.normal(size=shape)
    k = jnp.asarray(np.concatenate([zeros, zeros, huge, normal]), jnp.bfloat16)
    v = jnp.asarray(np.concatenate([zeros, zeros, huge[::-1], normal]), jnp.bfloat16)
    slots = jnp.asarray(np.r_[0:4, 16:28].astype(np.int32))  # seq 0: page 0 (zeros); seq 1: page 1 (all kinds)
    new = _write(cache, k, v, slots)
    pages, offs = np.asarray(slots) // page_size, np.asarray(slots) % page_size
    for name, x in (("k", k), ("v", v)):
        codec = getattr(new, f"{name}_codec")
        x64 = np.asarray(x, np.float64)
        norms = np.asarray(getattr(new, f"{name}_norms"))[pages, :, offs]
        codes = np.asarray(getattr(new, f"{name}_codes"))[pages, :, offs]
        assert getattr(new, f"{name}_norms").dtype == jnp.float32 and np.isfinite(norms).all()
        np.testing.assert_allclose(norms, np.linalg.norm(x64, axis=-1), rtol=2e-6)
        assert np.all(norms[:8] == 0.0) and norms[8:12].min() > 5e5  # ~1e6: fp32, not bf16
        zero_idx = unpack_codes(codes[:8], codec.bits, head_dim)
        assert np.all(zero_idx == 2 ** (codec.bits - 1) - 1), "zero vector: every code is the code of 0"
        want_codes, _ = compress_f64(x64, codec)
        got_idx = unpack_codes(codes, codec.bits, head_dim).astype(int)
        want_idx = unpack_codes(want_codes, codec.bits, head_dim).astype(int)
        assert np.mean(got_idx == want_idx) > 0.999 and np.abs(got_idx - want_idx).max() <= 1
        for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
            x_hat = np.asarray(tq.decompress(jnp.asarray(codes[:4]), jnp.asarray(norms[:4]), codec, dtype), np.float32)
            assert np.all(x_hat == 0.0)
        x_hat = tq.decompress(jnp.asarray(codes), jnp.asarray(norms), codec)
        assert rel_err(x_hat, decompress_f64(codes, norms, codec)) < 1e-6
    tables = jnp.asarray([[0, 3], [1, 2]], jnp.int32)
    lens = jnp.asarray([4, 12], jnp.int32)
    # The oracle multiplies masked weights by every slot, so it needs the unwritten NaN slots zeroed.
    clean = dataclasses.replace(new, k_norms=jnp.nan_to_num(new.k_norms, nan=0.0),
                                v_norms=jnp.nan_to_num(new.v_norms, nan=0.0))
    for q_dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)):
        q = jnp.asarray(rng.normal(size=(2, 4, head_dim)), q_dtype)
        got = np.asarray(_decode(q, new, tables, lens, num_splits=2), np.float32)
        assert not np.isnan(got).any()
        assert np.all(got[0] == 0.0), "attention over zero (padding) vectors only is exactly 0"
        want = decode_f64(np.asarray(q, np.float64), clean, tables, lens)
        assert rel_err(got[1], want[1]) < tol and np.abs(got[1]).max() > 1e3


@pytest.mark.parametrize("dtype,scale", [(jnp.float16, 6e4), (jnp.bfloat16, 1e5)])
def test_compress_norms_beyond_input_dtype_range(rng, dtype, scale):
    """Vectors near fp16's max have norms beyond fp16's range: the fp32 norm must still be exact."""
    codec = tq.TurboQuant(head_dim=96, bits=3, seed=2)
    x = jnp.asarray(rng.uniform(0.5, 1.0, size=(6, 96)) * rng.choice([-1.0, 1.0], size=(6, 96)) * scale, dtype)
    x = x.at[2].set(0)
    codes, norms = tq.compress(x, codec)
    want_codes, want_norms = compress_f64(np.asarray(x, np.float64), codec)
    assert norms.dtype == jnp.float32 and np.isfinite(np.asarray(norms)).all()
    np.testing.assert_allclose(np.asarray(norms), want_norms, rtol=2e-6)
    assert float(norms[2]) == 0.0
    got_idx = unpack_codes(np.asarray(codes), 3, 96).astype(int)
    want_idx = unpack_codes(want_codes, 3, 96).astype(int)
    assert np.mean(got_idx == want_idx) > 0.99 and np.abs(got_idx - want_idx).max() <= 1
    x_hat = np.asarray(tq.decompress(codes, norms, codec, jnp.float32))
    assert np.all(x_hat[2] == 0.0)
    assert rel_err(x_hat, decompress_f64(np.asarray(codes), np.asarray(norms), codec)) < 1e-6
    assert rel_err(x_hat, np.asarray(x, np.float64)) < 0.25  # 3-bit quantization error only


# ----------------------------------------------------------------------------- 9. vmap axes, empty batches

def _count(fn, prim, *args):
    """Equations of ``prim`` in fn's jaxpr, nested ones included (custom_jvp calls, pjit, ...)."""
    return primitive_count(jax.make_jaxpr(fn)(*args).jaxpr, prim)


def test_vmap_compress_and_decompress_axis_1(rng):
    from jax_tq.compress import compress_p, decompress_p
    codec = tq.TurboQuant(head_dim=80, bits=3, seed=1)
    x = jnp.asarray(rng.normal(size=(5, 3, 2, 80)), jnp.float32)  # batch on axis 1
    fn = jax.vmap(lambda x: tq.compress(x, codec), in_axes=1, out_axes=1)
    assert _count(fn, compress_p, x) == 1
    codes, norms = fn(x)
    assert codes.shape == (5, 3, 2, 30) and norms.shape == (5, 3, 2)
    for b in range(3):
        want_codes, want_norms = tq.compress(x[:, b], codec)
        np.testing.assert_array_equal(np.asarray(codes[:, b]), np.asarray(want_codes))
        np.testing.assert_array_equal(np.asarray(norms[:, b]), np.asarray(want_norms))
    # decompress with codes batched on axis 1 and norms on axis 0, output batch on axis 2.
    dfn = jax.vmap(lambda c, n: tq.decompress(c, n, codec), in_axes=(1, 0), out_axes=2)
    norms_b0 = jnp.moveaxis(norms, 1, 0)
    assert _count(dfn, decompress_p, codes, norms_b0) == 1
    x_hat = dfn(codes, norms_b0)
    assert x_hat.shape == (5, 2, 3, 80)
    want = decompress_f64(np.asarray(codes), np.asarray(norms), codec)  # [5, 3, 2, 80]
    assert rel_err(x_hat, np.moveaxis(want, 1, 2)) < 1e-6


def test_vmap_write_cache_axis_1_in_and_out(rng):
    from jax_tq.compress import write_cache_p
    base = random_cache(rng, num_pages=4, page_size=8, num_kv_heads=2, head_dim=64, k_bits=3, v_bits=2)
    other = random_cache(rng, num_pages=4, page_size=8, num_kv_heads=2, head_dim=64, k_bits=3, v_bits=2)
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs, axis=1), base, other)  # pools batched on axis 1
    k = jnp.asarray(rng.normal(size=(6, 2, 2, 64)), jnp.float32)             # [T, B, Hkv, d]
    v = jnp.asarray(rng.normal(size=(6, 2, 2, 64)), jnp.bfloat16)
    slots = jnp.asarray(np.stack([rng.choice(32, 6, replace=False) for _ in range(2)], axis=1).astype(np.int32))
    slots = slots.at[4, 1].set(-1).at[5, 0].set(32)  # padding / outside the pool: skipped
    fn = jax.vmap(tq.write_cache, in_axes=(1, 1, 1, 1), out_axes=1)
    assert _count(fn, write_cache_p, stacked, k, v, slots) == 1
    got = jax.jit(fn)(stacked, k, v, slots)
    assert got.k_codes.shape == (4, 2, 2, 8, 24) and got.v_norms.shape == (4, 2, 2, 8)
    for b, cache in enumerate((base, other)):
        want = tq.write_cache(cache, k[:, b], v[:, b], slots[:, b])
        for name in ("k_codes", "k_norms", "v_codes", "v_norms"):
            np.testing.assert_array_equal(np.asarray(getattr(got, name)[:, b]), np.asarray(getattr(want, name)))
        assert not np.array_equal(np.asarray(want.k_norms), np.asarray(cache.k_norms))
    # Nested: outer over the cache (axis 1), inner over k/v (axis 0) with a shared slot mapping.
    k2 = jnp.asarray(rng.normal(size=(3, 6, 2, 64)), jnp.float32)
    inner = jax.vmap(tq.write_cache, in_axes=(None, 0, 0, None))
    outer = jax.vmap(inner, in_axes=(1, None, None, None))
    nested = outer(stacked, k2, k2, slots[:, 0])
    assert nested.k_norms.shape == (2, 3, 4, 2, 8)
    for b, cache in enumerate((base, other)):
        for i in range(3):
            want = tq.write_cache(cache, k2[i], k2[i], slots[:, 0])
            np.testing.assert_array_equal(np.asarray(nested.v_codes[b, i]), np.asarray(want.v_codes))
            np.testing.assert_array_equal(np.asarray(nested.k_norms[b, i]), np.asarray(want.k_norms))


def test_vmap_paged_decode_axis_1_with_batched_cache_and_tables(rng):
    caches = [random_cache(rng, num_pages=5, page_size=16, num_kv_heads=1, head_dim=64, k_bits=4, v_bits=4)
              for _ in range(2)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs, axis=1), *caches)
    lens = jnp.asarray([[20, 3], [0, 70]], jnp.int32)           # [num_seqs, B]: batch on axis 1
    tables = jnp.stack([random_tables(rng, [20, 0], 16, 5, max_pages=5),
                        random_tables(rng, [3, 70], 16, 5, max_pages=5)], axis=1)  # [S, B, max_pages]
    q = jnp.asarray(rng.normal(size=(2, 2, 3, 64)), jnp.float32)  # [S, B, H, d]
    fn = jax.vmap(lambda q, c, t, s: tq.paged_decode(q, c, t, s, num_splits=2), in_axes=1, out_axes=1)
    got = jax.jit(fn)(q, stacked, tables, lens)
    assert got.shape == (2, 2, 3, 64)
    for b in range(2):
        want = decode_f64(np.asarray(q[:, b], np.float64), caches[b], tables[:, b], lens[:, b])
        assert rel_err(got[:, b], want) < 1e-5
    assert np.all(np.asarray(got[1, 0]) == 0)


def test_empty_batches(rng):
    codec = tq.TurboQuant(head_dim=64, bits=2)
    cache = random_cache(rng, num_pages=3, page_size=8, num_kv_heads=2, head_dim=64, k_bits=2, v_bits=4)
    # decompress: no rows, directly and under vmap.
    x = tq.decompress(jnp.zeros((0, 16), jnp.uint8), jnp.zeros((0,), jnp.float32), codec, jnp.bfloat16)
    assert x.shape == (0, 64) and x.dtype == jnp.bfloat16
    x = jax.vmap(lambda c, n: tq.decompress(c, n, codec), in_axes=(0, 0))(jnp.zeros((0, 3, 16), jnp.uint8),
                                                                        jnp.zeros((0, 3), jnp.float32))
    assert x.shape == (0, 3, 64)
    codes, norms = jax.jit(lambda x: tq.compress(x, codec))(jnp.zeros((2, 0, 64), jnp.float16))
    assert codes.shape == (2, 0, 16) and norms.shape == (2, 0)
    # write_cache: zero tokens leaves the cache as it was; a vmap of size 0 gives empty pools.
    new = _write(cache, jnp.zeros((0, 2, 64), jnp.float32), jnp.zeros((0, 2, 64), jnp.float32),
                 jnp.zeros((0,), jnp.int32))
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(cache)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    empty = jax.vmap(tq.write_cache, in_axes=(None, 0, 0, 0))(
        cache, jnp.zeros((0, 5, 2, 64), jnp.float32), jnp.zeros((0, 5, 2, 64), jnp.float32),
        jnp.zeros((0, 5), jnp.int32))
    assert empty.k_codes.shape == (0,) + cache.k_codes.shape and empty.v_norms.shape == (0,) + cache.v_norms.shape
    # paged_decode: no sequences; and sequences over an empty block table (no pages: zero output).
    out = _decode(jnp.zeros((0, 4, 64), jnp.float32), cache, jnp.zeros((0, 2), jnp.int32), jnp.zeros((0,), jnp.int32))
    assert out.shape == (0, 4, 64)
    q = jnp.asarray(rng.normal(size=(2, 4, 64)), jnp.float32)
    out = _decode(q, cache, jnp.zeros((2, 0), jnp.int32), jnp.asarray([0, 5], jnp.int32))
    assert out.shape == (2, 4, 64) and np.all(np.asarray(out) == 0)


# ----------------------------------------------------------------------------- refusals (trace time)

def _small_cache(num_kv_heads=2, head_dim=64, k_bits=4, v_bits=3):
    return tq.PagedKVCache.create(num_pages=3, page_size=8, num_kv_heads=num_kv_heads,
                                  k_codec=tq.TurboQuant(head_dim, bits=k_bits, seed=0),
                                  v_codec=tq.TurboQuant(head_dim, bits=v_bits, seed=1))


def _decode_args(num_seqs=2, num_heads=4, head_dim=64, q_dtype=jnp.float32):
    q = jnp.zeros((num_seqs, num_heads, head_dim), q_dtype)
    return q, jnp.zeros((num_seqs, 3), jnp.int32), jnp.full((num_seqs,), 5, jnp.int32)


def test_refuses_bad_codec_and_cache_parameters():
    with pytest.raises(ValueError, match=r"head_dim must be one of \(64, 80, 96, 128, 192, 256\), got 100"):
        tq.TurboQuant(head_dim=100, bits=4)
    with pytest.raises(ValueError, match=r"bits must be one of \(1, 2, 3, 4\), got 5"):
        tq.TurboQuant(head_dim=64, bits=5)
    one_bit = tq.TurboQuant(head_dim=64, bits=1)
    with pytest.raises(ValueError, match=r"k_codec\.bits must be one of \(2, 3, 4\) for packed storage, got 1"):
        tq.PagedKVCache.create(num_pages=2, page_size=8, num_kv_heads=1, k_codec=one_bit, v_codec=tq.TurboQuant(64, 4))
    with pytest.raises(ValueError, match=r"v_codec\.bits must be one of \(2, 3, 4\) for packed storage, got 1"):
        tq.PagedKVCache.create(num_pages=2, page_size=8, num_kv_heads=1, k_codec=tq.TurboQuant(64, 4), v_codec=one_bit)
    with pytest.raises(ValueError, match=r"codec\.bits must be one of \(2, 3, 4\) for packed storage, got 1"):
        jax.eval_shape(lambda x: tq.compress(x, one_bit), jnp.zeros((3, 64)))
    for page_size, match in ((0, r"page_size must be >= 1, got 0"), (300, r"page_size must be <= 256, got 300")):
        with pytest.raises(ValueError, match=match):
            tq.PagedKVCache.create(num_pages=2, page_size=page_size, num_kv_heads=1,
                                   k_codec=tq.TurboQuant(64, 4), v_codec=tq.TurboQuant(64, 4))
    with pytest.raises(ValueError, match=r"k_codec\.head_dim 64 != v_codec\.head_dim 128"):
        tq.PagedKVCache.create(num_pages=2, page_size=8, num_kv_heads=1,
                               k_codec=tq.TurboQuant(64, 4), v_codec=tq.TurboQuant(128, 4))


def test_numpy_int64_indices_are_refused_not_wrapped():
    """With x64 off, jnp.asarray casts NumPy int64 to int32, so 2^32 + 5 would have become slot /
    page 5 and a seq_len of 2^32 zero; they are refused with the dtype the caller passed
    (new-user trial 16)."""
    assert not jax.config.jax_enable_x64
    cache = _small_cache(num_kv_heads=1)
    q, tables, lens = _decode_args(num_heads=2)
    k = np.ones((1, 1, 64), np.float32)
    before = np.asarray(cache.k_norms).copy()
    with pytest.raises(TypeError, match=r"write_cache: slot_mapping must be int32 \[1\], got int64\(1,\)"):
        tq.write_cache(cache, k, k, np.array([2**32 + 5], np.int64))
    np.testing.assert_array_equal(np.asarray(cache.k_norms), before)
    with pytest.raises(TypeError, match=r"block_tables must be int32 \[num_seqs=2, max_pages\], got int64\(2, 1\)"):
        tq.paged_decode(q, cache, np.full((2, 1), 2**32 + 1, np.int64), lens)
    with pytest.raises(TypeError, match=r"seq_lens must be int32 \[num_seqs=2\], got int64\(2,\)"):
        tq.paged_decode(q, cache, tables, np.full((2,), 2**32, np.int64))
    with pytest.raises(TypeError, match=r"block_tables must be int32 .*, got float64\(2, 3\)"):
        tq.paged_decode(q, cache, np.zeros((2, 3)), lens)
    # NumPy int32 and Python lists stay accepted
    out = tq.paged_decode(q, cache, np.asarray(tables), [5, 5])
    assert out.shape == q.shape
    tq.write_cache(cache, k, k, np.array([5], np.int32))


def test_refuses_bad_decode_arguments_at_trace_time():
    cache = _small_cache()
    q, tables, lens = _decode_args()
    trace = lambda *a, **kw: jax.eval_shape(lambda q, c, t, s: tq.paged_decode(q, c, t, s, **kw), *a)  # noqa: E731
    trace(q, cache, tables, lens)  # the valid call traces
    with pytest.raises(ValueError, match=r"num_heads 5 is not a multiple of the cache's num_kv_heads 2"):
        trace(jnp.zeros((2, 5, 64)), cache, tables, lens)
    with pytest.raises(ValueError, match=r"q has head_dim 100 but the cache's k_codec has head_dim 64"):
        trace(jnp.zeros((2, 4, 100)), cache, tables, lens)
    with pytest.raises(TypeError, match=r"q must be float32, bfloat16 or float16, got int32"):
        trace(q.astype(jnp.int32), cache, tables, lens)
    with pytest.raises(ValueError, match=r"q must be \[num_seqs, num_heads, head_dim\], got shape \(4, 64\)"):
        trace(q[0], cache, tables, lens)
    with pytest.raises(TypeError, match=r"block_tables must be int32 \[num_seqs=2, max_pages\], got float32\(2, 3\)"):
        trace(q, cache, tables.astype(jnp.float32), lens)
    for bad in (tables[0], tables[None]):
        with pytest.raises(ValueError, match=r"block_tables must be int32 \[num_seqs=2, max_pages\], got int32"):
            trace(q, cache, bad, lens)
    with pytest.raises(ValueError, match=r"block_tables must be int32 \[num_seqs=2, max_pages\], got int32\(3, 3\)"):
        trace(q, cache, jnp.zeros((3, 3), jnp.int32), lens)
    with pytest.raises(TypeError, match=r"seq_lens must be int32 \[num_seqs=2\], got float32\(2,\)"):
        trace(q, cache, tables, lens.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"seq_lens must be int32 \[num_seqs=2\], got int32\(2, 1\)"):
        trace(q, cache, tables, lens[:, None])
    with pytest.raises(ValueError, match=r"num_splits must be >= 1"):
        trace(q, cache, tables, lens, num_splits=0)
    for bad in ("fast", 3.5, None.__class__):
        with pytest.raises(ValueError, match=r"precision must be a jax.lax.Precision"):
            trace(q, cache, tables, lens, precision=bad)
    for good in ("highest", "DEFAULT", jax.lax.Precision.HIGH):
        trace(q, cache, tables, lens, precision=good)
    with _compat.enable_x64():
        with pytest.raises(TypeError, match=r"block_tables must be int32 .* got int64"):
            trace(q, cache, jnp.zeros((2, 3), jnp.int64), lens)
        with pytest.raises(TypeError, match=r"seq_lens must be int32 .* got int64"):
            trace(q, cache, tables, jnp.full((2,), 5, jnp.int64))
        with pytest.raises(TypeError, match=r"q must be float32, bfloat16 or float16, got float64"):
            trace(q.astype(jnp.float64), cache, tables, lens)


def test_refuses_cache_whose_codec_does_not_match_its_pools():
    """A codec swapped on an existing cache (same head_dim, other bits) is caught when tracing, not by the kernel."""
    cache = _small_cache(k_bits=4, v_bits=3)
    q, tables, lens = _decode_args()
    trace = lambda c: jax.eval_shape(tq.paged_decode, q, c, tables, lens)  # noqa: E731
    with pytest.raises(ValueError, match=r"k_codes is uint8\(3, 2, 8, 32\), expected uint8\(3, 2, 8, 16\) .*bits 2"):
        trace(dataclasses.replace(cache, k_codec=tq.TurboQuant(64, bits=2)))
    with pytest.raises(ValueError, match=r"v_codes is uint8\(3, 2, 8, 24\), expected uint8\(3, 2, 8, 32\) .*bits 4"):
        trace(dataclasses.replace(cache, v_codec=tq.TurboQuant(64, bits=4)))
    with pytest.raises(ValueError, match=r"v_norms is float32\(3, 1, 8\), expected float32\(3, 2, 8\)"):
        trace(dataclasses.replace(cache, v_norms=cache.v_norms[:, :1]))
    with pytest.raises(ValueError, match=r"cache k codes have shape \(3, 2, 8, 32\), expected \[num_pages, 2, page_size, 16\]"):
        jax.eval_shape(tq.write_cache, dataclasses.replace(cache, k_codec=tq.TurboQuant(64, bits=2)),
                       jnp.zeros((1, 2, 64)), jnp.zeros((1, 2, 64)), jnp.zeros((1,), jnp.int32))


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_refuses_cache_pools_without_pages_heads_or_slots(axis):
    """Sizes PagedKVCache.create refuses, in a hand-built cache: a named error, not an internal one."""
    cache = _small_cache()
    empty = jax.tree_util.tree_map(lambda a: jax.lax.slice_in_dim(a, 0, 0, axis=axis), cache)
    q = jnp.zeros((2, 4, 64), jnp.float32)
    tables, lens = jnp.zeros((2, 3), jnp.int32), jnp.ones((2,), jnp.int32)
    with pytest.raises(ValueError, match=r"paged_decode: cache.k_codes has shape .*must each be >= 1"):
        jax.eval_shape(tq.paged_decode, q, empty, tables, lens)
    k = jnp.zeros((3, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match=r"write_cache: cache.k_codes has shape .*must each be >= 1"):
        jax.eval_shape(tq.write_cache, empty, k, k, jnp.zeros((3,), jnp.int32))


def test_refuses_hand_built_caches_create_would_refuse():
    """Pages of more than 256 slots and K / V codecs of different head_dims (PagedKVCache.create's
    limits) in a cache built directly: named errors from write_cache and paged_decode too."""
    spec = jax.ShapeDtypeStruct
    c64 = tq.TurboQuant(64, 4)
    big = tq.PagedKVCache(k_codes=spec((2, 1, 300, 32), jnp.uint8), k_norms=spec((2, 1, 300), jnp.float32),
                          v_codes=spec((2, 1, 300, 32), jnp.uint8), v_norms=spec((2, 1, 300), jnp.float32),
                          k_codec=c64, v_codec=c64)
    q, kv = jnp.zeros((1, 1, 64)), jnp.zeros((1, 1, 64))
    tables, lens, slots = jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32), jnp.zeros((1,), jnp.int32)
    with pytest.raises(ValueError, match=r"paged_decode: cache.k_codes has shape \(2, 1, 300, 32\): page_size 300 is above 256"):
        jax.eval_shape(tq.paged_decode, q, big, tables, lens)
    with pytest.raises(ValueError, match=r"write_cache: cache.k_codes has shape .*page_size 300 is above 256"):
        jax.eval_shape(tq.write_cache, big, kv, kv, slots)
    mixed = tq.PagedKVCache(k_codes=spec((2, 1, 8, 32), jnp.uint8), k_norms=spec((2, 1, 8), jnp.float32),
                            v_codes=spec((2, 1, 8, 64), jnp.uint8), v_norms=spec((2, 1, 8), jnp.float32),
                            k_codec=c64, v_codec=tq.TurboQuant(128, 4))
    with pytest.raises(ValueError, match=r"write_cache: cache.k_codec.head_dim 64 != cache.v_codec.head_dim 128"):
        jax.eval_shape(tq.write_cache, mixed, kv, kv, slots)
    with pytest.raises(ValueError, match=r"paged_decode: cache.k_codec.head_dim 64 != cache.v_codec.head_dim 128"):
        jax.eval_shape(tq.paged_decode, q, mixed, tables, lens)


def test_vmap_over_caches_past_int32_ids_is_refused():
    """The kernels' vmap folds a batch of caches into one pool: ids past int32 would wrap, and their
    writes and reads be skipped silently. Traced only (abstract pools of ~100 GB); a fold that fits
    still traces. (The xla backend's jnp reference vmaps without folding.)"""
    spec = jax.ShapeDtypeStruct
    codec = tq.TurboQuant(64, 4)

    def caches(batch, pages, page_size):
        return tq.PagedKVCache(k_codes=spec((batch, pages, 1, page_size, 32), jnp.uint8),
                               k_norms=spec((batch, pages, 1, page_size), jnp.float32),
                               v_codes=spec((batch, pages, 1, page_size, 32), jnp.uint8),
                               v_norms=spec((batch, pages, 1, page_size), jnp.float32), k_codec=codec, v_codec=codec)
    kv, slots = spec((3, 2, 1, 64), jnp.float32), spec((3, 2), jnp.int32)
    q, tables, lens = spec((3, 1, 1, 64), jnp.float32), spec((3, 1, 4), jnp.int32), spec((3, 1), jnp.int32)
    with tq.use_backend("ffi"):
        with pytest.raises(ValueError, match=r"vmap over 3 caches of 1073741824 pages or slots .*past int32"):
            jax.eval_shape(jax.vmap(tq.write_cache), caches(3, 2**24, 64), kv, kv, slots)
        with pytest.raises(ValueError, match=r"vmap over 3 caches of 1073741824 pages .*past int32"):
            jax.eval_shape(jax.vmap(tq.paged_decode), q, caches(3, 2**30, 1), tables, lens)
        jax.eval_shape(jax.vmap(tq.write_cache), caches(2, 2**24, 64), spec((2, 2, 1, 64), jnp.float32),
                       spec((2, 2, 1, 64), jnp.float32), spec((2, 2), jnp.int32))  # ids up to 2^31 - 1: fits


def test_numpy_scalars_are_static_decode_options(rng):
    """scale and num_splits as NumPy scalars (documented): the same result as Python numbers."""
    cache = random_cache(rng, num_pages=3, page_size=8, num_kv_heads=2, head_dim=64, k_bits=4, v_bits=3)
    q = jnp.asarray(rng.normal(size=(2, 4, 64)), jnp.float32)
    tables, lens = jnp.asarray([[2, 0, 1], [1, 2, 0]], jnp.int32), jnp.asarray([19, 11], jnp.int32)
    want = tq.paged_decode(q, cache, tables, lens, scale=0.25, num_splits=2)
    assert np.all(np.isfinite(np.asarray(want))) and np.any(np.asarray(want) != 0)
    got = jax.jit(lambda *a: tq.paged_decode(*a, scale=np.float32(0.25), num_splits=np.int64(2)))(q, cache, tables, lens)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_refuses_bad_write_and_codec_op_arguments_at_trace_time():
    cache = _small_cache()
    codec = cache.k_codec
    k = jnp.zeros((3, 2, 64), jnp.float32)
    slots = jnp.zeros((3,), jnp.int32)
    trace = lambda c, k, v, s: jax.eval_shape(tq.write_cache, c, k, v, s)  # noqa: E731
    trace(cache, k, k, slots)
    with pytest.raises(ValueError, match=r"write_cache: k has shape \(3, 2, 80\); its last axis must be the codec's head_dim 64"):
        trace(cache, jnp.zeros((3, 2, 80)), jnp.zeros((3, 2, 80)), slots)
    with pytest.raises(ValueError, match=r"write_cache: k has 3 KV heads \(shape \(3, 3, 64\)\) but the cache has 2"):
        trace(cache, jnp.zeros((3, 3, 64)), jnp.zeros((3, 3, 64)), slots)
    with pytest.raises(ValueError, match=r"write_cache: k must be \[num_tokens, num_kv_heads, head_dim\], got shape \(3, 64\)"):
        trace(cache, k[:, 0], k[:, 0], slots)
    with pytest.raises(TypeError, match=r"write_cache: v must be float32, bfloat16 or float16, got int32"):
        trace(cache, k, k.astype(jnp.int32), slots)
    with pytest.raises(ValueError, match=r"write_cache: k has 3 tokens but v has 2"):
        trace(cache, k, k[:2], slots)
    bigger_v = dataclasses.replace(cache, v_codes=jnp.concatenate([cache.v_codes] * 2),
                                   v_norms=jnp.concatenate([cache.v_norms] * 2))
    with pytest.raises(ValueError, match=r"K and V pools must have the same num_pages and page_size .*"
                                         r"K norms \(3, 2, 8\) and V norms \(6, 2, 8\)"):
        trace(bigger_v, k, k, slots)
    with pytest.raises(TypeError, match=r"slot_mapping must be int32 \[3\], got float32\(3,\)"):
        trace(cache, k, k, slots.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"slot_mapping must be int32 \[3\], got int32\(3, 1\)"):
        trace(cache, k, k, slots[:, None])
    with pytest.raises(ValueError, match=r"slot_mapping must be int32 \[3\], got int32\(4,\)"):
        trace(cache, k, k, jnp.zeros((4,), jnp.int32))
    with _compat.enable_x64():
        with pytest.raises(TypeError, match=r"write_cache: k must be float32, bfloat16 or float16, got float64"):
            trace(cache, k.astype(jnp.float64), k, slots)
        with pytest.raises(TypeError, match=r"slot_mapping must be int32 \[3\], got int64"):
            trace(cache, k, k, slots.astype(jnp.int64))
    with pytest.raises(TypeError, match=r"compress: x must be float32, bfloat16 or float16, got uint8"):
        jax.eval_shape(lambda x: tq.compress(x, codec), jnp.zeros((3, 64), jnp.uint8))
    with pytest.raises(ValueError, match=r"compress: x has shape \(3, 100\); its last axis must be the codec's head_dim 64"):
        jax.eval_shape(lambda x: tq.compress(x, codec), jnp.zeros((3, 100)))
    dec = lambda c, n, dtype=jnp.float32: jax.eval_shape(lambda c, n: tq.decompress(c, n, codec, dtype), c, n)  # noqa: E731
    dec(jnp.zeros((3, 32), jnp.uint8), jnp.zeros((3,)))
    with pytest.raises(ValueError, match=r"codes \(3, 24\) and norms \(3,\) do not match codes \[\.\.\., 32\]"):
        dec(jnp.zeros((3, 24), jnp.uint8), jnp.zeros((3,)))  # codes of a 3-bit codec, decoded as 4-bit
    with pytest.raises(ValueError, match=r"codes \(3, 32\) and norms \(4,\) do not match"):
        dec(jnp.zeros((3, 32), jnp.uint8), jnp.zeros((4,)))
    with pytest.raises(TypeError, match=r"codes must be uint8, got int32"):
        dec(jnp.zeros((3, 32), jnp.int32), jnp.zeros((3,)))
    with pytest.raises(TypeError, match=r"norms must be float32, got bfloat16"):
        dec(jnp.zeros((3, 32), jnp.uint8), jnp.zeros((3,), jnp.bfloat16))
    with pytest.raises(TypeError, match=r"dtype must be float32, bfloat16 or float16, got int8"):
        dec(jnp.zeros((3, 32), jnp.uint8), jnp.zeros((3,)), jnp.int8)
    with pytest.raises(TypeError, match=r"dtype must be float32, bfloat16 or float16, got None"):
        dec(jnp.zeros((3, 32), jnp.uint8), jnp.zeros((3,)), None)  # jnp.dtype(None) is float64


def test_write_cache_names_a_wrong_rank():
    codec = tq.TurboQuant(64, 4)
    cache = tq.PagedKVCache.create(num_pages=2, page_size=4, num_kv_heads=1, k_codec=codec, v_codec=codec)
    good = jnp.zeros((3, 1, 64))
    with pytest.raises(ValueError, match=r"k must be \[num_tokens, num_kv_heads, head_dim\], got shape \(1, 3, 1, 64\)"):
        tq.write_cache(cache, good[None], good, jnp.arange(3, dtype=jnp.int32))
    with pytest.raises(ValueError, match=r"v must be \[num_tokens, num_kv_heads, head_dim\], got shape \(3, 64\)"):
        tq.write_cache(cache, good, good[:, 0], jnp.arange(3, dtype=jnp.int32))


# ----------------------------------------------------------------------------- inputs are not modified

def _snapshot(tree):
    return [np.array(x, copy=True) for x in jax.tree.leaves(tree)]


def _assert_unchanged(before, tree):
    after = jax.tree.leaves(tree)
    assert len(before) == len(after)
    for a, b in zip(before, after):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == np.asarray(b).tobytes()


@pytest.mark.parametrize("jit", [False, True])
def test_inputs_are_not_modified_without_donation(rng, jit):
    cache = random_cache(rng, num_pages=4, page_size=8, num_kv_heads=2, head_dim=64, k_bits=4, v_bits=2)
    k = jnp.asarray(rng.normal(size=(5, 2, 64)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(5, 2, 64)), jnp.float32)
    slots = jnp.asarray([0, 9, -1, 31, 100], jnp.int32)
    q = jnp.asarray(rng.normal(size=(2, 4, 64)), jnp.float32)
    tables = jnp.asarray([[3, 0, 1, 2], [1, -1, 7, 2]], jnp.int32)
    lens = jnp.asarray([29, 8], jnp.int32)
    wrap = jax.jit if jit else (lambda f: f)
    before = _snapshot((cache, k, v, slots))
    new = wrap(tq.write_cache)(cache, k, v, slots)
    jax.block_until_ready(new)
    _assert_unchanged(before, (cache, k, v, slots))
    assert not np.array_equal(np.asarray(new.v_codes), before[2])  # the write happened (on a copy)
    before = _snapshot((q, new, tables, lens))
    out = wrap(tq.paged_decode)(q, new, tables, lens)
    jax.block_until_ready(out)
    _assert_unchanged(before, (q, new, tables, lens))
    assert np.abs(np.asarray(out)).max() > 0
    codes, norms = wrap(tq.compress)(v, new.v_codec)
    before = _snapshot((v, codes, norms))
    x_hat = wrap(tq.decompress)(codes, norms, new.v_codec)
    jax.block_until_ready((codes, norms, x_hat))
    _assert_unchanged(before, (v, codes, norms))


# ----------------------------------------------------------------------------- static options, extremes

def test_refuses_bad_static_decode_options():
    cache = _small_cache()
    q, tables, lens = _decode_args()
    call = lambda **kw: jax.eval_shape(lambda q: tq.paged_decode(q, cache, tables, lens, **kw), q)  # noqa: E731
    for bad in (1.5, True, "2"):
        with pytest.raises(TypeError, match=r"num_splits must be"):
            call(num_splits=bad)
    for bad in ("0.1", True, b"1"):
        with pytest.raises(TypeError, match=r"scale must be a Python number"):
            call(scale=bad)
    for bad in (float("nan"), float("inf"), -float("inf"), 1e300, -3.5e38, 2.4e38):
        with pytest.raises(ValueError, match=r"scale must be finite"):
            call(scale=bad)
    for backend in ("ffi", "xla"):  # scale * log2(e) still a finite float32: a finite output
        with tq.use_backend(backend):
            assert np.all(np.isfinite(np.asarray(tq.paged_decode(q, cache, tables, lens, scale=2.3e38)))), backend
    with pytest.raises(TypeError, match=r"scale must be a concrete Python number \(static\)"):
        jax.jit(lambda q, s: tq.paged_decode(q, cache, tables, lens, scale=s))(q, 0.1)
    with pytest.raises(TypeError, match=r"num_splits must be a concrete Python int \(static\)"):
        jax.jit(lambda q, n: tq.paged_decode(q, cache, tables, lens, num_splits=n))(q, 2)
    for bad in (True, 1, 2.0, (jax.lax.Precision.HIGHEST,)):
        with pytest.raises(ValueError, match=r"precision must be a jax.lax.Precision"):
            call(precision=bad)
    for bad in (None, (cache,), {"k_codes": cache.k_codes}):
        with pytest.raises(TypeError, match=r"cache must be a jax_tq.PagedKVCache"):
            tq.paged_decode(q, bad, tables, lens)
        with pytest.raises(TypeError, match=r"write_cache: cache must be a jax_tq.PagedKVCache"):
            tq.write_cache(bad, q[:, :2], q[:, :2], jnp.zeros((2,), jnp.int32))
    for fn, args in ((tq.compress, (q, 4)), (tq.decompress, (jnp.zeros((2, 32), jnp.uint8), jnp.ones((2,)), None))):
        with pytest.raises(TypeError, match=r"codec must be a jax_tq.TurboQuant"):
            fn(*args)
    for name, bad in (("num_pages", None), ("page_size", "16"), ("num_kv_heads", 2.0), ("num_pages", True)):
        sizes = dict(num_pages=3, page_size=8, num_kv_heads=2) | {name: bad}
        with pytest.raises(TypeError, match=rf"{name} must be an int"):
            tq.PagedKVCache.create(**sizes, k_codec=tq.TurboQuant(64, 4), v_codec=tq.TurboQuant(64, 4))
    # A pool of the wrong dtype: the same TypeError naming the pool from both ops.
    for name, dtype in (("k_codes", jnp.int8), ("v_codes", jnp.int32), ("k_norms", jnp.float16),
                        ("v_norms", jnp.bfloat16)):
        bad = dataclasses.replace(cache, **{name: getattr(cache, name).astype(dtype)})
        want = rf"cache.{name} must be {'uint8' if 'codes' in name else 'float32'}, got {jnp.dtype(dtype).name}"
        with pytest.raises(TypeError, match=want):
            tq.write_cache(bad, q[:, :2], q[:, :2], jnp.zeros((2,), jnp.int32))
        with pytest.raises(TypeError, match=want):
            tq.paged_decode(q, bad, jnp.zeros((q.shape[0], 1), jnp.int32), jnp.zeros((q.shape[0],), jnp.int32))


@pytest.mark.parametrize("backend", ["ffi", "xla"])
def test_huge_num_splits_act_as_max_pages(rng, backend):
    cache = random_cache(rng, num_pages=12, page_size=8, num_kv_heads=2, head_dim=64, k_bits=4, v_bits=3)
    lens = jnp.asarray([40, 17, 1], jnp.int32)
    tables = random_tables(rng, np.asarray(lens), 8, 12, max_pages=5)
    q = jnp.asarray(rng.normal(size=(3, 4, 64)), jnp.float32)
    want = decode_f64(q, cache, tables, lens)
    with tq.use_backend(backend):
        for splits in (5, 10**7, 2**31, 2**40):
            assert rel_err(tq.paged_decode(q, cache, tables, lens, num_splits=splits), want) < 2e-5


@pytest.mark.parametrize("backend", ["ffi", "xla"])
def test_non_finite_query_rows_give_nan_rows_only(rng, backend):
    cache = random_cache(rng, num_pages=6, page_size=8, num_kv_heads=2, head_dim=64, k_bits=4, v_bits=4)
    lens = jnp.asarray([30, 9], jnp.int32)
    tables = random_tables(rng, np.asarray(lens), 8, 6)
    q = jnp.asarray(rng.normal(size=(2, 4, 64)), jnp.float32)
    q = q.at[0, 1, 5].set(jnp.nan).at[1, 3, 0].set(jnp.inf)
    with tq.use_backend(backend):
        got = np.asarray(tq.paged_decode(q, cache, tables, lens))
    bad = np.zeros((2, 4), bool)
    bad[0, 1] = bad[1, 3] = True
    assert np.all(np.isnan(got[bad]))
    assert np.all(np.isfinite(got[~bad]))
    want = decode_f64(jnp.where(jnp.isfinite(q), q, 0.0), cache, tables, lens)
    assert rel_err(got[~bad], np.asarray(want)[~bad]) < 2e-5


@pytest.mark.parametrize("magnitude,scale", [(1e9, None), (1e12, None), (1e28, None), (1.0, 1e30), (1.0, -1e30)])
def test_reference_backend_survives_huge_logits_and_its_gradient(rng, magnitude, scale):
    """XLA fuses the logits into each of their consumers and may round them differently in each;
    the reference must neither overflow nor lose a row (every weight underflowing gave 0 rows at
    logits ~1e31), and a negative scale makes the smallest score the one that counts."""
    cache = random_cache(rng, num_pages=6, page_size=8, num_kv_heads=2, head_dim=64, k_bits=4, v_bits=4)
    lens = jnp.asarray([40, 13], jnp.int32)
    tables = random_tables(rng, np.asarray(lens), 8, 6)
    q = jnp.asarray(rng.normal(size=(2, 4, 64)), jnp.float32) * magnitude
    decode = jax.jit(lambda q: tq.paged_decode(q, cache, tables, lens, scale=scale))
    with tq.use_backend("ffi"):
        kernel = decode(q)
    with tq.use_backend("xla"):
        ref = decode(q)
    assert np.all(np.isfinite(np.asarray(ref)))
    assert np.abs(np.asarray(ref)).max(axis=-1).min() > 0  # no row lost
    assert rel_err(ref, kernel) < 1e-3
    if magnitude * abs(scale or 1.0) >= 1e20:  # one token owns each row: the float64 oracle agrees
        assert rel_err(ref, decode_f64(np.asarray(q, np.float64), cache, tables, lens, scale=scale)) < 1e-5
    grad = jax.grad(lambda q: jnp.sum(tq.paged_decode(q, cache, tables, lens, scale=scale)))(q)
    assert np.all(np.isfinite(np.asarray(grad)))


@pytest.mark.parametrize("value", [1e30, 1e-30, 3e-38])
def test_compress_norms_neither_overflow_nor_underflow(value):
    codec = tq.TurboQuant(128, 4)
    x = jnp.full((3, 128), value, jnp.float32).at[1].multiply(-2.0)
    expected = np.array([1, 2, 1]) * value * np.sqrt(128.0)
    results = {}
    for backend in ("ffi", "xla"):
        with tq.use_backend(backend):
            codes, norms = tq.compress(x, codec)
        np.testing.assert_allclose(np.asarray(norms, np.float64), expected, rtol=1e-6)
        results[backend] = np.asarray(codes)
    np.testing.assert_array_equal(results["ffi"], results["xla"])


@pytest.mark.parametrize("value", [1e38, 3e38])
def test_compress_norm_beyond_float32_is_inf_in_both_backends(value):
    """||x|| above FLT_MAX is inf on both backends (the reference's x / max|x| used to flush to 0
    on the CPU, giving norm 0); a row of ordinary size next to it is unaffected."""
    codec = tq.TurboQuant(128, 4)
    x = jnp.full((2, 128), value, jnp.float32).at[1].set(0.5)
    for backend in ("ffi", "xla"):
        with tq.use_backend(backend):
            _, norms = tq.compress(x, codec)
        assert np.isposinf(float(norms[0])), backend
        np.testing.assert_allclose(float(norms[1]), 0.5 * np.sqrt(128.0), rtol=1e-6)


def test_compress_nan_vector_gives_nan_norm_in_both_backends():
    codec = tq.TurboQuant(64, 4)
    x = jnp.ones((2, 64), jnp.float32).at[1, 3].set(jnp.nan)
    for backend in ("ffi", "xla"):
        with tq.use_backend(backend):
            _, norms = tq.compress(x, codec)
        assert np.isfinite(float(norms[0])) and np.isnan(float(norms[1])), backend


@pytest.mark.parametrize("norm", [9e37, 3e38 / np.sqrt(2.0)])
def test_compress_finite_norms_near_float32_max_keep_their_codes(rng, norm):
    """A finite norm above ~8.5e37 has a reciprocal below float32's normal range, which XLA's CPU
    threads flush to 0: the CPU kernel stored every code as the zero code. Both backends must
    give the codes of the unit vector (the same as at norm 1), and the norm itself."""
    codec = tq.TurboQuant(128, 4)
    unit = rng.normal(size=(4, 128))
    unit /= np.linalg.norm(unit, axis=-1, keepdims=True)
    for backend in ("ffi", "xla"):
        with tq.use_backend(backend):
            small_codes, _ = tq.compress(jnp.asarray(unit, jnp.float32), codec)
            codes, norms = tq.compress(jnp.asarray(unit * norm, jnp.float32), codec)
        np.testing.assert_allclose(np.asarray(norms, np.float64), norm, rtol=1e-6, err_msg=backend)
        assert np.mean(np.asarray(codes) == np.asarray(small_codes)) > 0.99, backend


@pytest.mark.parametrize("rows", [2, 64, 300])
def test_compress_nan_rows_give_nan_norms_in_batches_of_any_size(rows):
    """XLA's CPU max-reduction drops NaN in larger arrays: the reference's norm used to be 0 for
    a NaN row once a batch had 64 rows."""
    codec = tq.TurboQuant(64, 4)
    x = jnp.ones((rows, 64), jnp.float32).at[1, 3].set(jnp.nan).at[rows - 1].set(jnp.nan)
    for backend in ("ffi", "xla"):
        with tq.use_backend(backend):
            _, norms = tq.compress(x, codec)
        norms = np.asarray(norms)
        assert np.isnan(norms[1]) and np.isnan(norms[rows - 1]), backend
        assert np.all(np.isfinite(np.delete(norms, [1, rows - 1]))), backend


@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_decode_gradient_ignores_poisoned_unused_k_norms(rng, poison):
    """Slots past a sequence's end may hold anything (docs/FORMAT.md): a NaN / inf K norm there
    must not reach the gradient (the backward pass multiplied the masked scores' zero cotangent
    by the poisoned key)."""
    codec = tq.TurboQuant(64, 4)
    cache = tq.PagedKVCache.create(num_pages=3, page_size=4, num_kv_heads=1, k_codec=codec, v_codec=codec)
    kv = jnp.asarray(rng.normal(size=(12, 1, 64)), jnp.float32)
    cache = tq.write_cache(cache, kv, kv, jnp.arange(12, dtype=jnp.int32))
    poisoned = dataclasses.replace(cache, k_norms=cache.k_norms.at[0, 0, 3].set(poison).at[2, 0, 1].set(poison))
    tables, lens = jnp.array([[0, 1, 2]], jnp.int32), jnp.array([3], jnp.int32)
    q = jnp.asarray(rng.normal(size=(1, 2, 64)), jnp.float32)
    for backend in ("ffi", "xla"):
        with tq.use_backend(backend):
            def loss(q, c):
                return jnp.sum(tq.paged_decode(q, c, tables, lens) ** 2)
            clean = jax.grad(loss)(q, cache)
            grad = jax.grad(loss)(q, poisoned)
        assert np.all(np.isfinite(np.asarray(grad))), backend
        np.testing.assert_allclose(np.asarray(grad), np.asarray(clean), rtol=1e-5, atol=1e-7, err_msg=backend)


def test_query_whose_rotation_overflows_gives_a_nan_row(rng):
    """A finite query with ||q|| beyond float32 has a non-finite rotation: the kernels then saw
    only NaN / inf scores and returned a silent zero row. Every backend gives a NaN row (as for a
    non-finite query); the other rows are unaffected."""
    cache = random_cache(rng, num_pages=2, page_size=4, num_kv_heads=1, head_dim=64, k_bits=4, v_bits=4)
    tables, lens = jnp.array([[0, 1], [1, 0]], jnp.int32), jnp.array([8, 5], jnp.int32)
    q = jnp.asarray(rng.normal(size=(2, 1, 64)), jnp.float32).at[0].set(3e38)
    want = decode_f64(q[1:], cache, tables[1:], lens[1:])
    for backend in ("ffi", "xla"):
        with tq.use_backend(backend):
            out = np.asarray(tq.paged_decode(q, cache, tables, lens))
        assert np.all(np.isnan(out[0])), backend
        assert rel_err(want, out[1:]) < 1e-5, backend


def test_reference_lowering_gives_the_kernels_nan_rows(rng, monkeypatch):
    """Under backend "auto" a platform without kernels lowers the decode primitive to the jnp
    reference: a NaN query (here on an empty sequence, where the reference alone would give 0) and a
    finite one whose rotation overflows float32 give NaN rows there too (the kernels write them; no
    mask is left around the primitive), the other rows unchanged."""
    from jax_tq import _ffi
    cache = random_cache(rng, num_pages=4, page_size=4, num_kv_heads=2, head_dim=64, k_bits=4, v_bits=4)
    tables, lens = random_tables(rng, np.array([9, 0]), 4, 4), jnp.array([9, 0], jnp.int32)
    q = jnp.asarray(rng.normal(size=(2, 4, 64)), jnp.float32).at[0, 1].set(3e38).at[1, 2, 7].set(jnp.nan)
    bad = np.zeros((2, 4), bool)
    bad[0, 1] = bad[1, 2] = True
    with tq.use_backend("ffi"):
        kernel = np.asarray(tq.paged_decode(q, cache, tables, lens))
    monkeypatch.setattr(_ffi, "kernels_available", lambda platform: False)
    with tq.use_backend("auto"):
        fallback = np.asarray(jax.jit(lambda q: tq.paged_decode(q, cache, tables, lens))(q))
    for got in (kernel, fallback):
        assert np.all(np.isnan(got[bad])) and np.all(np.isfinite(got[~bad]))
    assert rel_err(fallback[~bad], kernel[~bad]) < 1e-5


@pytest.mark.parametrize("backend", ["ffi", "xla"])
def test_empty_block_table_gives_nan_rows_for_non_finite_queries(backend):
    """block_tables of shape [S, 0] make the primitive lower to the jnp reference (a zero-size
    operand): a NaN query and one whose rotation overflows still give NaN rows, the others 0."""
    codec = tq.TurboQuant(64, 4)
    cache = tq.PagedKVCache.create(num_pages=2, page_size=4, num_kv_heads=1, k_codec=codec, v_codec=codec)
    q = jnp.ones((3, 1, 64), jnp.float32).at[0, 0, 0].set(jnp.nan).at[1, 0].set(3e38)
    with tq.use_backend(backend):
        out = np.asarray(tq.paged_decode(q, cache, jnp.zeros((3, 0), jnp.int32), jnp.zeros((3,), jnp.int32)))
    assert np.all(np.isnan(out[:2])) and np.all(out[2] == 0.0)


@pytest.mark.parametrize("backend", ["ffi", "xla"])
def test_masked_nan_query_row_leaves_every_gradient_finite(rng, backend):
    """A NaN query row that the loss masks out: the gradients in q and in the cache norms equal those
    of the same loss with a finite query in that row (its KV head's norms were NaN before: the
    reference's softmax of the NaN row met a zero cotangent)."""
    cache = random_cache(rng, num_pages=6, page_size=8, num_kv_heads=2, head_dim=64, k_bits=4, v_bits=4)
    lens = jnp.asarray([30, 9], jnp.int32)
    tables = random_tables(rng, np.asarray(lens), 8, 6)
    q = jnp.asarray(rng.normal(size=(2, 4, 64)), jnp.float32)
    masked = jnp.zeros((2, 4, 1), bool).at[0, 1].set(True)

    def loss(q, k_norms, v_norms):
        c = dataclasses.replace(cache, k_norms=k_norms, v_norms=v_norms)
        return jnp.sum(jnp.where(masked, 0.0, tq.paged_decode(q, c, tables, lens)) ** 2)

    with tq.use_backend(backend):
        grads = jax.grad(loss, argnums=(0, 1, 2))(q.at[0, 1, 5].set(jnp.nan), cache.k_norms, cache.v_norms)
        clean = jax.grad(loss, argnums=(0, 1, 2))(q, cache.k_norms, cache.v_norms)
    for got, want in zip(grads, clean):
        assert np.all(np.isfinite(np.asarray(got)))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-9)


def test_api_errors_found_by_the_docs_audit():
    """Errors the docstrings promise, with the argument named (a docs audit found them raised as
    AttributeError / unnamed ValueError or not at all)."""
    codec = tq.TurboQuant(64, 4)
    cache = tq.PagedKVCache.create(num_pages=2, page_size=4, num_kv_heads=1, k_codec=codec, v_codec=codec)
    with pytest.raises(TypeError, match=r"jax_tq.decompress: dtype must be float32, bfloat16 or float16, got 'foo'"):
        tq.decompress(jnp.zeros((2, 32), jnp.uint8), jnp.ones((2,)), codec, dtype="foo")
    with pytest.raises(TypeError, match=r"nn.turboquant_attention_fn: k_codec must be a jax_tq.TurboQuant"):
        tq.nn.turboquant_attention_fn(None, codec)
    q, tables, lens = jnp.ones((1, 1, 64)), jnp.zeros((1, 2), jnp.int32), jnp.array([3], jnp.int32)
    with pytest.raises(TypeError, match=r"jax_tq.paged_decode: cache.k_codec must be a jax_tq.TurboQuant"):
        tq.paged_decode(q, dataclasses.replace(cache, k_codec=None), tables, lens)
    with pytest.raises(ValueError, match=r"jax_tq.paged_decode: cache.v_codec.bits"):
        tq.paged_decode(q, dataclasses.replace(cache, v_codec=tq.TurboQuant(64, 1)), tables, lens)
    with pytest.raises(ValueError, match=r"bits"):
        tq.reference.decompress(jnp.zeros((2, 40), jnp.uint8), jnp.ones((2,)), codec.rotation, codec.centroids, 5)
    with pytest.raises(TypeError, match=r"dtype must be a float dtype, got int32"):
        tq.reference.decompress(jnp.zeros((2, 32), jnp.uint8), jnp.ones((2,)), codec.rotation, codec.centroids, 4,
                                dtype=jnp.int32)
    with pytest.raises(TypeError, match=r"y must have a floating dtype"):
        tq.reference.quantize_rotated(jnp.zeros((2, 64), jnp.int32), codec.centroids)


def test_cache_repr_shows_shapes_and_codecs_not_pool_contents():
    cache = tq.PagedKVCache.create(num_pages=300, page_size=16, num_kv_heads=2, k_codec=tq.TurboQuant(128, 4),
                                   v_codec=tq.TurboQuant(128, 3, seed=1))
    text = repr(cache)
    assert len(text) < 400 and "\n" not in text
    assert "k_codes=uint8[300, 2, 16, 64]" in text and "v_codes=uint8[300, 2, 16, 48]" in text
    assert "bits=3" in text and "v_norms=float32[300, 2, 16]" in text
    assert cache.bytes_per_token() == 2 * (64 + 48 + 4 + 4)


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
