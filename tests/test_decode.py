"""paged_decode: the kernels (CPU here, CUDA on a GPU machine) against the float64 oracle over
head_dims, bits, page sizes, GQA groups and split counts; poisoned unused slots and pages, empty
sequences, huge logits, non-finite queries, vmap, jit and gradients, the fused Hadamard rotation,
the window, the refusals of bad arguments; marked gpu, the CUDA kernel families against float64
and the CPU kernels."""
from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tq as tq
from jax_tq import _compat
from jax_tq.format import unpack_codes
from jax_tq.paged_decode import paged_decode_p

from conftest import kernel_backend, poison_device_memory, slow_unless
from oracle import (attend_f64, compress_f64, decode_args, decode_f64, decode_setup, decompress_f64, on_cpu,
                    primitive_count, random_cache, random_tables, random_window_cache, rel_err, sequence_tokens,
                    small_cache)

pytestmark = pytest.mark.backend("ffi")


DECODE_CASES = [
    # head_dim, k_bits, v_bits, page_size, num_kv_heads, group, seq_lens, num_splits
    (64, 4, 4, 16, 3, 3, [37, 0, 5, 64], 1),
    (128, 4, 2, 16, 2, 4, [100, 1, 17], 3),
    (80, 3, 3, 8, 1, 5, [33, 9], 7),
    (96, 2, 4, 48, 2, 1, [96, 200, 0], 2),
    (192, 3, 2, 8, 1, 8, [15, 70], 20),
    (256, 4, 3, 32, 1, 6, [31, 64, 65], None),
    (128, 2, 2, 256, 2, 8, [300, 1], 2),
    (64, 4, 4, 96, 1, 16, [97, 191], 1),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=[str(i) for i in range(len(DECODE_CASES))])
@pytest.mark.parametrize("q_dtype", slow_unless((jnp.float32, jnp.bfloat16), lambda dtype: dtype == jnp.float32))
def test_paged_decode_matches_f64(rng, case, q_dtype):
    head_dim, k_bits, v_bits, page_size, num_kv_heads, group, seq_lens, num_splits = case
    num_pages = 3 + sum(-(-n // page_size) for n in seq_lens)
    cache = random_cache(rng, num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, k_bits=k_bits, v_bits=v_bits, seed=int(rng.integers(100)))
    seq_lens = jnp.asarray(seq_lens, jnp.int32)
    tables = random_tables(rng, np.asarray(seq_lens), page_size, num_pages, max_pages=1 + max(-(-int(n) // page_size) for n in seq_lens))
    q = jnp.asarray(rng.normal(size=(len(seq_lens), num_kv_heads * group, head_dim)) * 3, q_dtype)
    fn = jax.jit(lambda q, c, t, s: tq.paged_decode(q, c, t, s, num_splits=num_splits))
    got = fn(q, cache, tables, seq_lens)
    want = decode_f64(np.asarray(q, np.float64), cache, tables, seq_lens)
    assert got.shape == q.shape and got.dtype == q_dtype
    tol = 1e-5 if q_dtype == jnp.float32 else 1e-2
    assert rel_err(got, want) < tol
    empty = np.asarray(seq_lens) == 0
    assert np.all(np.asarray(got)[empty] == 0)


@pytest.mark.parametrize("q_scale", (1e3, 1e4))
def test_paged_decode_huge_logits(rng, q_scale):
    cache = random_cache(rng, num_pages=12, page_size=16, num_kv_heads=2, head_dim=128, k_bits=4, v_bits=4)
    seq_lens = jnp.asarray([150, 7, 33], jnp.int32)
    tables = random_tables(rng, np.asarray(seq_lens), 16, 12)
    q = jnp.asarray(rng.normal(size=(3, 4, 128)) * q_scale, jnp.float32)
    for splits in (1, 4, 11):
        got = tq.paged_decode(q, cache, tables, seq_lens, num_splits=splits)
        want = decode_f64(np.asarray(q, np.float64), cache, tables, seq_lens)
        assert rel_err(got, want) < 1e-3
        assert np.abs(np.asarray(got)).max() > 0


def _lowered_rotation_operand(fn, *args, head_dim=128) -> bool:
    """Whether the lowered program passes the fused rotation operand (int32 [2, head_dim]) to the
    kernel (and that it calls the kernel: with or without the rotation, never the jnp reference)."""
    text = jax.jit(fn).lower(*args).as_text()
    assert "jax_tq_paged_decode" in text, "the paged_decode kernel is not called"
    return f"tensor<2x{head_dim}xi32>" in text


@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("k_bits,v_bits,group,num_splits,q_dtype", [
    (4, 4, 4, 1, jnp.bfloat16), (4, 4, 3, 3, jnp.float32), (3, 2, 8, 2, jnp.float16), (2, 4, 1, 5, jnp.float32)])
def test_paged_decode_fused_hadamard_rotation(rng, head_dim, k_bits, v_bits, group, num_splits, q_dtype):
    """Hadamard codecs (head_dim 64 / 128): the kernel applies q_rot = Pi_k q and out = Pi_v^T o_rot itself
    (the rotation operand reaches the FFI call; no rotation GEMM), with the same values as the
    float64 oracle, as the xla backend (rotation GEMMs around the reference), and NaN rows where q is
    not finite."""
    seq_lens = jnp.asarray([70, 0, 33, 160], jnp.int32)
    num_pages = 3 + sum(-(-int(n) // 16) for n in seq_lens)
    cache = random_cache(rng, num_pages=num_pages, page_size=16, num_kv_heads=2, head_dim=head_dim, k_bits=k_bits,
                         v_bits=v_bits, seed=int(rng.integers(100)), rotation="hadamard")
    tables = random_tables(rng, np.asarray(seq_lens), 16, num_pages)
    q = jnp.asarray(rng.normal(size=(4, 2 * group, head_dim)) * 3, q_dtype).at[2, 1, 9].set(jnp.nan)
    bad = np.zeros(q.shape[:2], bool)
    bad[2, 1] = True

    def fn(q, t, s):
        return tq.paged_decode(q, cache, t, s, num_splits=num_splits)

    # The CPU kernel and (on a GPU) the tensor-core kernels rotate for every one of these configurations.
    assert _lowered_rotation_operand(fn, q, tables, seq_lens, head_dim=head_dim)
    got = np.asarray(jax.jit(fn)(q, tables, seq_lens).astype(jnp.float32), np.float64)
    assert got.dtype == np.float64 and np.all(np.isnan(got[bad])) and np.all(np.isfinite(got[~bad]))
    want = decode_f64(np.asarray(jnp.where(jnp.isnan(q), 0, q), np.float64), cache, tables, seq_lens)
    tol = 1e-5 if q_dtype == jnp.float32 else 1e-2
    assert rel_err(got[~bad], want[~bad]) < tol
    assert np.all(got[1] == 0)
    with tq.use_backend("xla"):
        dense = np.asarray(jax.jit(fn)(q, tables, seq_lens).astype(jnp.float32), np.float64)
    assert np.array_equal(np.isnan(dense), np.isnan(got))
    assert rel_err(got[~bad], dense[~bad]) < tol


@pytest.mark.slow
def test_paged_decode_fused_rotation_grad_vmap_and_reference_lowering(rng):
    """The fused rotation under grad (q and the norms, against the xla backend), vmap (against the
    unbatched call) and the reference lowering of a zero-size block table (NaN rows, zeros)."""
    cache = random_cache(rng, num_pages=12, page_size=16, num_kv_heads=2, head_dim=128, k_bits=4, v_bits=4,
                         rotation="hadamard")
    seq_lens = jnp.asarray([90, 17, 40], jnp.int32)
    tables = random_tables(rng, np.asarray(seq_lens), 16, 12)
    q = jnp.asarray(rng.normal(size=(3, 8, 128)), jnp.float32)

    def loss(q, k_norms, v_norms):
        c = dataclasses.replace(cache, k_norms=k_norms, v_norms=v_norms)
        return jnp.sum(jnp.sin(tq.paged_decode(q, c, tables, seq_lens)))

    assert _lowered_rotation_operand(lambda q: tq.paged_decode(q, cache, tables, seq_lens), q)  # K4V4, group 4
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, cache.k_norms, cache.v_norms)
    with tq.use_backend("xla"):
        want = jax.grad(loss, argnums=(0, 1, 2))(q, cache.k_norms, cache.v_norms)
    for g, w in zip(grads, want):
        assert rel_err(g, w) < 1e-5 and np.abs(np.asarray(w)).max() > 0
    batch = jnp.stack([q, 2 * q])
    mapped = jax.vmap(lambda x: tq.paged_decode(x, cache, tables, seq_lens))(batch)
    assert rel_err(mapped[1], tq.paged_decode(2 * q, cache, tables, seq_lens)) < 1e-6
    empty = jnp.zeros((3, 0), jnp.int32)
    q_bad = q.at[1, 3, 0].set(jnp.inf)
    out = np.asarray(tq.paged_decode(q_bad, cache, empty, jnp.zeros(3, jnp.int32)))
    assert np.all(np.isnan(out[1, 3])) and np.count_nonzero(np.isnan(out)) == 128
    assert np.all(out[~np.isnan(out)] == 0)


# ---------------------------------------------------------- poisoned pools, empty and extreme inputs


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


# Every (head_dim, k_bits), (head_dim, v_bits) and (k_bits, v_bits) pair occurs (a Latin-square cover).
HD_BITS = [(hd, 2 + b, 2 + (b + i) % 3) for i, hd in enumerate((64, 80, 96, 128, 192, 256)) for b in range(3)]


@pytest.mark.parametrize("head_dim,k_bits,v_bits", slow_unless(HD_BITS, lambda head_dim, *_: head_dim == 128),
                         ids=[f"d{d}-k{k}-v{v}" for d, k, v in HD_BITS])
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
    # A soft softmax (q * 0.1), so that a K quantization error rarely flips a peaked row: over 300
    # seeds (d 64 and 128) the error's max was 0.48 / 0.27 / 0.14 at 2 / 3 / 4 bits (means 0.39 /
    # 0.21 / 0.11; with q * 0.25 its tail reached the old 3-bit bound of 0.5 in CI). A zero output is 1.
    q_mild = q * 0.1
    got_mild = _decode(q_mild, cache, jnp.asarray(tables), jnp.asarray(lens, jnp.int32), num_splits=2)
    dense = _dense_f64(np.asarray(q_mild, np.float64), k, v, lens)
    err = rel_err(got_mild, dense)
    assert err < {2: 0.65, 3: 0.35, 4: 0.2}[min(k_bits, v_bits)], "decode is far from attention on the uncompressed K/V"


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


# -------------------------------------------------------------------------------- vmap and gradients


def test_vmap_over_sequences_with_shared_cache(rng):
    cache, tables, lens = decode_setup(rng)
    batch = 3
    q = jnp.asarray(rng.normal(size=(batch, 4, 6, 64)), jnp.float32)
    tables_b = jnp.stack([jnp.roll(tables, i, axis=0) for i in range(batch)])
    lens_b = jnp.stack([jnp.roll(lens, i) for i in range(batch)])
    fn = jax.vmap(tq.paged_decode, in_axes=(0, None, 0, 0))
    jaxpr = jax.make_jaxpr(fn)(q, cache, tables_b, lens_b).jaxpr
    assert primitive_count(jaxpr, paged_decode_p) == 1, "vmap must fold into one kernel call"
    got = jax.jit(fn)(q, cache, tables_b, lens_b)
    for b in range(batch):
        want = decode_f64(np.asarray(q[b], np.float64), cache, tables_b[b], lens_b[b])
        assert rel_err(got[b], want) < 1e-5


def test_vmap_non_leading_axes(rng):
    cache, tables, lens = decode_setup(rng)
    q = jnp.asarray(rng.normal(size=(4, 6, 2, 64)), jnp.float32)  # batch on axis 2 of q
    fn = jax.vmap(tq.paged_decode, in_axes=(2, None, None, None), out_axes=1)
    got = fn(q, cache, tables, lens)
    assert got.shape == (4, 2, 6, 64)
    for b in range(2):
        want = decode_f64(np.asarray(q[:, :, b], np.float64), cache, tables, lens)
        assert rel_err(got[:, b], want) < 1e-5


def test_nested_vmap_over_different_arguments(rng):
    cache, tables, lens = decode_setup(rng)
    q = jnp.asarray(rng.normal(size=(2, 4, 6, 64)), jnp.float32)
    lens_b = jnp.stack([lens, jnp.minimum(lens, 9), jnp.maximum(lens - 3, 0)])  # [3, num_seqs]
    inner = jax.vmap(tq.paged_decode, in_axes=(0, None, None, None))        # over q
    outer = jax.vmap(inner, in_axes=(None, None, None, 0))                  # over seq_lens
    fn = jax.jit(outer)
    jaxpr = jax.make_jaxpr(outer)(q, cache, tables, lens_b).jaxpr
    assert primitive_count(jaxpr, paged_decode_p) == 1
    got = fn(q, cache, tables, lens_b)
    assert got.shape == (3, 2, 4, 6, 64)
    for i in range(3):
        for j in range(2):
            want = decode_f64(np.asarray(q[j], np.float64), cache, tables, lens_b[i])
            assert rel_err(got[i, j], want) < 1e-5


def test_vmap_over_caches_folds_pools(rng):
    caches = [decode_setup(rng)[0] for _ in range(2)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *caches)
    _, tables, lens = decode_setup(rng)
    q = jnp.asarray(rng.normal(size=(2, 4, 6, 64)), jnp.float32)
    got = jax.vmap(tq.paged_decode, in_axes=(0, 0, None, None))(q, stacked, tables, lens)
    for b in range(2):
        want = decode_f64(np.asarray(q[b], np.float64), caches[b], tables, lens)
        assert rel_err(got[b], want) < 1e-5


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


def test_paged_decode_batch_of_size_zero(rng):
    cache, tables, lens = decode_setup(rng)
    q = jnp.zeros((0, 4, 6, 64), jnp.float32)
    out = jax.vmap(tq.paged_decode, in_axes=(0, None, None, None))(q, cache, tables, lens)
    assert out.shape == (0, 4, 6, 64)


def test_grad_of_paged_decode_matches_the_reference(rng):
    cache, tables, lens = decode_setup(rng)
    q = jnp.asarray(rng.normal(size=(4, 6, 64)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(4, 6, 64)), jnp.float32)

    def loss(q, k_norms):
        c = dataclasses.replace(cache, k_norms=k_norms)
        return jnp.sum(w * tq.paged_decode(q, c, tables, lens))

    dq, dkn = jax.jit(jax.grad(loss, argnums=(0, 1)))(q, cache.k_norms)
    with tq.use_backend("xla"):
        want_dq, want_dkn = jax.grad(loss, argnums=(0, 1))(q, cache.k_norms)
    assert rel_err(dq, want_dq) < 1e-5 and rel_err(dkn, want_dkn) < 1e-5
    assert float(jnp.abs(dq).max()) > 0
    # and the gradient is the true one: central finite differences of the float64 oracle along
    # random directions (float32 differences lose ~1e-3 to rounding, which made this check flaky)
    w64, q64, kn64 = (np.asarray(a, np.float64) for a in (w, q, cache.k_norms))
    def loss_f64(q, k_norms):
        return float(np.sum(w64 * decode_f64(q, dataclasses.replace(cache, k_norms=k_norms), tables, lens)))
    dir_q = rng.normal(size=q64.shape)
    dir_kn = rng.normal(size=kn64.shape)
    eps = 1e-5
    fd_q = (loss_f64(q64 + eps * dir_q, kn64) - loss_f64(q64 - eps * dir_q, kn64)) / (2 * eps)
    fd_kn = (loss_f64(q64, kn64 + eps * dir_kn) - loss_f64(q64, kn64 - eps * dir_kn)) / (2 * eps)
    assert abs(fd_q - float(np.sum(np.asarray(dq, np.float64) * dir_q))) < 1e-4 * max(1.0, abs(fd_q))
    assert abs(fd_kn - float(np.sum(np.asarray(dkn, np.float64) * dir_kn))) < 1e-4 * max(1.0, abs(fd_kn))


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


# ------------------------------------------------------------------------------------------ refusals


def test_refuses_bad_decode_arguments_at_trace_time():
    cache = small_cache()
    q, tables, lens = decode_args()
    trace = lambda *a, **kw: jax.eval_shape(lambda q, c, t, s: tq.paged_decode(q, c, t, s, **kw), *a)  # noqa: E731
    trace(q, cache, tables, lens)  # the valid call traces
    with pytest.raises(ValueError, match=r"num_heads 5 is not a positive multiple of the cache's num_kv_heads 2"):
        trace(jnp.zeros((2, 5, 64)), cache, tables, lens)
    with pytest.raises(ValueError, match=r"paged_decode: num_heads 0 is not a positive multiple"):
        trace(jnp.zeros((2, 0, 64)), cache, tables, lens)
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


def test_numpy_scalars_are_static_decode_options(rng):
    """scale and num_splits as NumPy scalars (documented): the same result as Python numbers."""
    cache = random_cache(rng, num_pages=3, page_size=8, num_kv_heads=2, head_dim=64, k_bits=4, v_bits=3)
    q = jnp.asarray(rng.normal(size=(2, 4, 64)), jnp.float32)
    tables, lens = jnp.asarray([[2, 0, 1], [1, 2, 0]], jnp.int32), jnp.asarray([19, 11], jnp.int32)
    want = tq.paged_decode(q, cache, tables, lens, scale=0.25, num_splits=2)
    assert np.all(np.isfinite(np.asarray(want))) and np.any(np.asarray(want) != 0)
    got = jax.jit(lambda *a: tq.paged_decode(*a, scale=np.float32(0.25), num_splits=np.int64(2)))(q, cache, tables, lens)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_refuses_bad_static_decode_options():
    cache = small_cache()
    q, tables, lens = decode_args()
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


# -------------------------------------------------------------------------------------------- window
# The window's cases pick their backend themselves (a backend parameter, kernel_backend).


BACKENDS = ("ffi", "xla")


DECODE_TARGETS = ["jax_tq_write_cache", "jax_tq_paged_decode"]


@pytest.mark.backend(None)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("group,num_splits", [(1, 1), (4, 3)])
def test_decode_reads_the_last_tokens_from_the_window(rng, backend, group, num_splits):
    cache = random_window_cache(rng)
    tables = np.stack([rng.permutation(24)[:6] for _ in range(5)]).astype(np.int32)
    tables[4, 1] = 99  # an invalid page: its tokens contribute nothing
    seq_lens = np.asarray([0, 3, 5, 23, 40], np.int32)  # empty, shorter than, equal to, longer than the window
    window_ids = np.asarray([0, 2, 1, 0, 2], np.int32)
    q = rng.normal(size=(5, 2 * group, 64)).astype(np.float32)
    with tq.use_backend(backend):
        out = jax.jit(tq.paged_decode, static_argnames="num_splits")(
            q, cache, tables, seq_lens, window_ids=window_ids, num_splits=num_splits)
    for s in range(5):
        keys, values, valid = sequence_tokens(cache, tables[s], seq_lens[s], window_ids[s])
        want = attend_f64(q[s], keys, values, valid, 1 / 8)
        assert rel_err(out[s], want) < 2e-5 if valid.any() else np.all(np.asarray(out[s]) == 0)
    # the window matters: the same call reading those tokens from the pages differs
    no_window = dataclasses.replace(cache, k_window=None, v_window=None)
    with tq.use_backend(backend):
        plain = tq.paged_decode(q, no_window, tables, seq_lens)
    assert rel_err(plain[3], out[3]) > 1e-2


@pytest.mark.backend(None)
@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_with_an_invalid_window_id_drops_the_window_tokens(rng, backend):
    cache = random_window_cache(rng)
    table = rng.permutation(24)[:6].astype(np.int32)[None]
    q = rng.normal(size=(1, 2, 64)).astype(np.float32)
    for bad in (-1, 3):
        with tq.use_backend(backend):
            out = tq.paged_decode(q, cache, table, np.asarray([20], np.int32), window_ids=np.asarray([bad], np.int32))
        keys, values, valid = sequence_tokens(cache, table[0], 20, bad)
        assert valid.sum() == 15
        assert rel_err(out[0], attend_f64(q[0], keys, values, valid, 1 / 8)) < 2e-5


@pytest.mark.backend(None)
def test_decode_steps_through_a_window_match_a_dense_float64_attention(rng):
    """write_cache + paged_decode one token at a time (the public API as a model uses it): while the
    sequence fits the window the output is exact attention over the bfloat16 rows."""
    cache = tq.PagedKVCache.create(num_pages=8, page_size=4, num_kv_heads=2, preset="k4v4", head_dim=64,
                                   num_windows=2)
    tables = np.arange(8, dtype=np.int32).reshape(2, 4)
    k = rng.normal(size=(12, 2, 2, 64)).astype(np.float32)
    v = rng.normal(size=(12, 2, 2, 64)).astype(np.float32)
    q = rng.normal(size=(12, 2, 4, 64)).astype(np.float32)
    step = jax.jit(lambda c, q, k, v, pos: tq.nn.paged_attention(q, k, v, c, tables[:, 0] * 4 + pos, tables,
                                                                   jnp.full((2,), pos + 1, jnp.int32)),
                   donate_argnums=0)
    for t in range(12):
        pos = jnp.full((2,), t, jnp.int32)
        out, cache = step(cache, q[t], k[t], v[t], pos)
        if t < 12:
            for s in range(2):
                keys = k[:t + 1, s].astype(np.float64)
                want = attend_f64(q[t, s], keys, v[:t + 1, s].astype(np.float64), np.ones(t + 1, bool), 1 / 8)
                assert rel_err(out[s], want) < 1.5e-2  # bfloat16 rows: ~2^-9 per element
    assert cache.window == 64 and t + 1 <= cache.window


@pytest.mark.slow
@pytest.mark.backend(None)
@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_over_caches_with_windows(rng, backend):
    caches = [random_window_cache(rng, seed=5) for _ in range(2)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *caches)
    tables = jnp.asarray(np.stack([rng.permutation(24)[:6] for _ in range(4)]).reshape(2, 2, 6).astype(np.int32))
    lens = jnp.asarray([[9, 30], [3, 17]], jnp.int32)
    ids = jnp.asarray([[0, 2], [1, 1]], jnp.int32)
    q = jnp.asarray(rng.normal(size=(2, 2, 4, 64)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(2, 2, 2, 64)), jnp.float32)
    slots = jnp.asarray([[5, 40], [7, -1]], jnp.int32)
    wslots = jnp.asarray([[0, 14], [4, 9]], jnp.int32)
    with tq.use_backend(backend):
        out = jax.vmap(lambda c, q, t, n, i: tq.paged_decode(q, c, t, n, window_ids=i))(stacked, q, tables, lens, ids)
        written = jax.jit(jax.vmap(tq.write_cache))(stacked, k, -k, slots, wslots)
        for b in range(2):
            want = tq.paged_decode(q[b], caches[b], tables[b], lens[b], window_ids=ids[b])
            assert rel_err(out[b], want) < 1e-6
            one = tq.write_cache(caches[b], k[b], -k[b], slots[b], wslots[b])
            for name in ("k_window", "v_window", "k_codes", "k_norms"):
                np.testing.assert_array_equal(np.asarray(getattr(written, name)[b]), np.asarray(getattr(one, name)))


@pytest.mark.backend(None)
@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_gradient_with_a_window(rng, backend):
    """The gradient in q and the page norms flows through the reference on every backend (the
    window rows': test_window.py)."""
    cache = random_window_cache(rng)
    tables = jnp.asarray(np.stack([rng.permutation(24)[:6] for _ in range(2)]).astype(np.int32))
    lens = jnp.asarray([12, 30], jnp.int32)
    q = jnp.asarray(rng.normal(size=(2, 2, 64)), jnp.float32)

    def loss(q, k_norms):
        c = dataclasses.replace(cache, k_norms=k_norms)
        return jnp.sum(tq.paged_decode(q, c, tables, lens) * jnp.arange(64.0))

    with tq.use_backend(backend):
        dq, dk = jax.grad(loss, argnums=(0, 1))(q, cache.k_norms)
    with tq.use_backend("xla"):
        want_dq, want_dk = jax.grad(loss, argnums=(0, 1))(q, cache.k_norms)
    assert rel_err(dq, want_dq) < 1e-5 and rel_err(dk, want_dk) < 1e-5
    assert float(jnp.abs(dk).sum()) > 0  # the pages' tokens before the window get gradients


@pytest.mark.backend(None)
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,rotation,group", [(128, "hadamard", 4), (128, "haar", 4), (64, "hadamard", 3),
                                                     (128, "hadamard", 1), (96, "haar", 4), (256, "haar", 2)])
@pytest.mark.parametrize("bits", [(4, 4), (3, 3), (2, 2)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_decode_with_a_window_matches_the_float64_oracle(request, rng, head_dim, rotation, group, bits, dtype):
    check_gpu_decode_with_a_window(request, rng, head_dim, rotation, group, bits, dtype, page_size=16,
                                   ids=[5, 4, 3, 2, 1, 0])


@pytest.mark.backend(None)
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,group,page_size", [(128, 4, 16), (128, 8, 8), (64, 2, 8)])
def test_gpu_decode_with_invalid_window_ids_and_any_page_size(request, rng, head_dim, group, page_size):
    """Ids outside [0, num_windows) drop the window's tokens; pages of 8 tokens run the tensor-core
    kernel's register variant (the window folded into its tile loop there too)."""
    check_gpu_decode_with_a_window(request, rng, head_dim, "hadamard", group, (4, 4), jnp.bfloat16,
                                   page_size=page_size, ids=[5, -1, 3, 6, 1, 0])


def check_gpu_decode_with_a_window(request, rng, head_dim, rotation, group, bits, dtype, *, page_size, ids):
    num_pages = 64 * 16 // page_size
    cache = random_window_cache(rng, head_dim=head_dim, num_kv_heads=2, page_size=page_size, num_pages=num_pages, window=64,
                       num_windows=6, k_bits=bits[0], v_bits=bits[1], rotation=rotation)
    width = 160 // page_size
    tables = np.stack([rng.permutation(num_pages)[:width] for _ in range(6)]).astype(np.int32)
    seq_lens = np.asarray([0, 1, 64, 65, 100, 160], np.int32)
    ids = np.asarray(ids, np.int32)
    q = rng.normal(size=(6, 2 * group, head_dim)).astype(np.float32)
    poison_device_memory(1 << 26)
    with kernel_backend(request, DECODE_TARGETS):
        for splits in (1, 3):
            out = jax.jit(tq.paged_decode, static_argnames="num_splits")(
                jnp.asarray(q, dtype), cache, tables, seq_lens, window_ids=ids, num_splits=splits)
            for s in range(6):
                keys, values, valid = sequence_tokens(cache, tables[s], seq_lens[s], ids[s])
                want = attend_f64(np.asarray(jnp.asarray(q[s], dtype), np.float64), keys, values, valid,
                                  1 / np.sqrt(head_dim))
                # bf16 output: its rounding alone is 1.5-1.9e-3 norm-wise (48 seeds x 4 cases on the H200)
                tol = 3e-3 if dtype == jnp.bfloat16 else 2e-5
                assert (rel_err(out[s], want) < tol) if valid.any() else np.all(np.asarray(out[s]) == 0), (s, splits)


# ---------------------------------------------------------------------------------------------- CUDA
# Marked gpu (skipped without one, conftest.py): the kernels on the GPU against float64 and the CPU's.


# (head_dim, k_bits, v_bits, page_size, group, num_kv_heads, num_splits, q dtype)
GPU_DECODE_CASES = [
    (128, 4, 4, 16, 4, 2, None, jnp.bfloat16),
    (128, 4, 4, 16, 4, 2, 1, jnp.float32),
    (128, 4, 4, 16, 4, 2, 3, jnp.float32),
    (128, 3, 2, 8, 8, 1, 64, jnp.float32),   # more splits than pages
    (128, 2, 4, 48, 16, 2, 3, jnp.float16),  # group 16: two head tiles
    (64, 4, 3, 16, 1, 3, 3, jnp.float32),
    (64, 2, 2, 256, 2, 2, 1, jnp.bfloat16),
    (80, 3, 3, 16, 3, 2, 3, jnp.float32),
    (80, 4, 2, 48, 6, 1, 5, jnp.float16),
    (96, 3, 4, 8, 4, 2, 3, jnp.float32),
    (96, 2, 3, 16, 7, 1, 1, jnp.float32),
    (192, 4, 4, 16, 8, 1, 3, jnp.float32),
    (192, 3, 2, 256, 2, 2, 2, jnp.bfloat16),
    (256, 4, 4, 16, 8, 1, 3, jnp.float32),   # group 8 at d=256: two tiles of 4
    (256, 2, 3, 48, 4, 2, 64, jnp.float32),
    (256, 3, 3, 8, 24, 1, 3, jnp.float32),   # group 24: three tiles
]


#: The float16 tensor-core kernel's phase trace (builds with JAX_TQ_TRACE_PHASES=ON):
#: [CTAs][warps][stamps][globaltimer ns, SM id] (kTrace* in paged_decode.cu).
PHASE_TRACE_SHAPE = (2048, 8, 10, 2)


def _read_phase_trace(module):
    """The CUDA module's phase trace as uint64 PHASE_TRACE_SHAPE (the read clears it)."""
    return np.frombuffer(module.phase_trace(), np.uint64).reshape(PHASE_TRACE_SHAPE)


def _decode_inputs(rng, head_dim, k_bits, v_bits, page_size, group, hkv, qdtype, num_seqs=5, max_len=700,
                   rotation="haar", seq_lens=None):
    """Random decode inputs; seq_lens: given lengths instead of random ones (then num_seqs and
    max_len are unused)."""
    if seq_lens is None:
        seq_lens = rng.integers(1, max_len, size=num_seqs).astype(np.int32)
        seq_lens[0] = 0  # empty sequence -> zeros
        seq_lens[-1] = page_size * int(rng.integers(1, 4))  # an exact multiple of the page size
    seq_lens = np.asarray(seq_lens, np.int32)
    num_seqs = len(seq_lens)
    need = sum(-(-int(n) // page_size) for n in seq_lens)
    num_pages = need + 3
    cache = random_cache(rng, num_pages=num_pages, page_size=page_size, num_kv_heads=hkv, head_dim=head_dim,
                         k_bits=k_bits, v_bits=v_bits, seed=int(rng.integers(1000)), rotation=rotation)
    tables = np.array(random_tables(rng, seq_lens, page_size, num_pages))
    # An invalid page id among the attended pages of one sequence: its tokens are skipped.
    if -(-int(seq_lens[1]) // page_size) >= 2:
        tables[1, 1] = -3
    q = jnp.asarray(rng.normal(size=(num_seqs, hkv * group, head_dim)), qdtype)
    return q, cache, jnp.asarray(tables), jnp.asarray(seq_lens)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,k_bits,v_bits,page_size,group,hkv,num_splits,qdtype", GPU_DECODE_CASES)
def test_paged_decode_gpu(rng, head_dim, k_bits, v_bits, page_size, group, hkv, num_splits, qdtype):
    q, cache, tables, lens = _decode_inputs(rng, head_dim, k_bits, v_bits, page_size, group, hkv, qdtype)
    poison_device_memory(q.size * 4 * 8 * 70)
    got = _decode(q, cache, tables, lens, num_splits=num_splits)
    assert got.shape == q.shape and got.dtype == q.dtype
    got64 = np.asarray(got.astype(jnp.float32), np.float64)
    assert np.all(np.isfinite(got64))
    assert np.all(got64[0] == 0.0), "seq_len 0 must give an all-zero row"
    want = on_cpu(decode_f64, np.asarray(q.astype(jnp.float32)), cache, tables, lens)
    tol = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.bfloat16): 1e-2, jnp.dtype(jnp.float16): 2e-3}[jnp.dtype(qdtype)]
    assert rel_err(got64, want) < tol
    # Every row individually (a wrong row could hide in the global norm).
    for s in range(1, q.shape[0]):
        assert rel_err(got64[s], want[s]) < 5 * tol, f"sequence {s}"
    cpu = on_cpu(_decode, q, cache, tables, lens, num_splits=num_splits)
    assert rel_err(got64, np.asarray(cpu.astype(jnp.float32), np.float64)) < tol


# The tensor-core kernels (head_dim 64 / 128, K4V4, any group): one-page tiles (page_size a
# multiple of 16) and the per-token path (8, 24), head tiles of 4 and 8 with padding (1, 2, 3, 6,
# 12), both product precisions (v4: float16, v3: float32-accurate). Tolerances: HIGHEST ~f32;
# DEFAULT rounds q, p and centroids to f16.
TC_CASES = [
    (128, 16, 4, None, jnp.bfloat16, None, 1e-2),
    (128, 16, 3, 2, jnp.float32, "highest", 2e-5),
    (128, 32, 8, 5, jnp.float32, None, 2e-5),
    (128, 8, 6, 3, jnp.float32, "default", 3e-3),
    (128, 24, 12, 4, jnp.float16, None, 3e-3),
    (128, 64, 4, 1, jnp.float32, jax.lax.Precision.DEFAULT, 3e-3),
    (128, 256, 8, 2, jnp.bfloat16, "highest", 1e-2),
    (128, 16, 1, None, jnp.bfloat16, None, 1e-2),   # group 1: one head in the 4-head tile
    (128, 16, 2, 3, jnp.float32, "highest", 2e-5),
    (128, 24, 2, 1, jnp.float16, None, 3e-3),
    (64, 16, 4, None, jnp.bfloat16, None, 1e-2),
    (64, 16, 3, 2, jnp.float32, "highest", 2e-5),
    (64, 32, 1, 3, jnp.float32, None, 2e-5),
    (64, 8, 6, 3, jnp.float32, "default", 3e-3),
    (64, 24, 2, 4, jnp.float16, None, 3e-3),
    (64, 48, 12, 1, jnp.bfloat16, None, 1e-2),
    (64, 256, 8, 2, jnp.bfloat16, "highest", 1e-2),
    # head_dim 256: v4's warp pairs (float16 products, page_size a multiple of 16; head tiles of 4),
    # else v1 (float32 products or page_size 8)
    (256, 16, 4, None, jnp.bfloat16, None, 1e-2),
    (256, 32, 2, 3, jnp.float16, None, 3e-3),
    (256, 16, 8, 2, jnp.float32, "default", 3e-3),   # group 8: two head tiles
    (256, 64, 1, 5, jnp.bfloat16, None, 1e-2),
    (256, 48, 3, 1, jnp.float16, None, 3e-3),
    (256, 16, 6, 64, jnp.float32, "default", 3e-3),  # more splits than pages
    (256, 256, 4, 2, jnp.bfloat16, None, 1e-2),
    (256, 8, 4, 2, jnp.bfloat16, None, 1e-2),        # v1: pages of 8
    (256, 16, 4, 2, jnp.float32, "highest", 2e-5),   # v1: float32 products
    # head_dim 80 / 96: rows padded to 128 coordinates (v4's ring, head tiles of 4 and 8; 80: 8-byte
    # copy units); 192: warp pairs of padded halves (head tiles of 4); else v1
    (80, 16, 4, None, jnp.bfloat16, None, 1e-2),
    (80, 32, 8, 3, jnp.float16, None, 3e-3),
    (80, 16, 1, 2, jnp.float32, "default", 3e-3),
    (80, 48, 5, 1, jnp.bfloat16, None, 1e-2),
    (80, 16, 6, 64, jnp.bfloat16, None, 1e-2),        # more splits than pages
    (80, 8, 4, 2, jnp.bfloat16, None, 1e-2),          # v1: pages of 8
    (96, 16, 4, None, jnp.bfloat16, None, 1e-2),
    (96, 32, 8, 3, jnp.float16, None, 3e-3),
    (96, 16, 1, 2, jnp.float32, "default", 3e-3),
    (96, 48, 6, 1, jnp.bfloat16, None, 1e-2),
    (96, 64, 3, 64, jnp.bfloat16, None, 1e-2),
    (96, 8, 4, 2, jnp.bfloat16, None, 1e-2),          # v1: pages of 8
    (192, 16, 4, None, jnp.bfloat16, None, 1e-2),
    (192, 32, 2, 3, jnp.float16, None, 3e-3),
    (192, 16, 1, 1, jnp.float32, "default", 3e-3),
    (192, 16, 8, 2, jnp.bfloat16, None, 1e-2),        # group 8: two head tiles of 4
    (192, 32, 16, 1, jnp.float16, None, 3e-3),
    (192, 16, 4, 2, jnp.float32, "highest", 2e-5),   # v1: float32 products
]


# 2- and 3-bit K and / or V (spread to nibbles as they are loaded), both head_dims, both precisions:
# v4's ring (float16 products, page_size a multiple of 16: 2-4 stages by width), its register
# variant (page_size 8 / 24) and v3 (float32-accurate products).
TC_BITS_CASES = [
    (128, 2, 2, 16, 4, None, jnp.bfloat16, None, 1e-2),
    (128, 4, 2, 16, 1, 3, jnp.float32, "highest", 2e-5),
    (128, 2, 4, 24, 8, 2, jnp.float16, None, 3e-3),
    (128, 2, 2, 256, 8, 2, jnp.bfloat16, None, 1e-2),
    (128, 3, 3, 16, 4, None, jnp.bfloat16, None, 1e-2),
    (128, 3, 3, 24, 8, 2, jnp.float16, None, 3e-3),
    (128, 3, 3, 16, 2, 3, jnp.float32, "highest", 2e-5),
    (128, 4, 3, 32, 4, 3, jnp.bfloat16, None, 1e-2),
    (128, 3, 4, 64, 1, None, jnp.float32, "default", 3e-3),
    (128, 3, 2, 16, 6, 4, jnp.bfloat16, None, 1e-2),
    (128, 2, 3, 8, 3, 2, jnp.float32, "highest", 2e-5),
    (64, 2, 2, 32, 3, 1, jnp.float32, None, 2e-5),
    (64, 4, 2, 8, 2, 4, jnp.bfloat16, None, 1e-2),
    (64, 2, 4, 16, 6, None, jnp.float32, "default", 3e-3),
    (64, 3, 3, 16, 4, None, jnp.bfloat16, None, 1e-2),
    (64, 3, 3, 8, 2, 3, jnp.float32, "highest", 2e-5),
    (64, 3, 2, 32, 8, 2, jnp.float16, None, 3e-3),
    (64, 2, 3, 24, 1, None, jnp.bfloat16, None, 1e-2),
    (64, 4, 3, 48, 3, 2, jnp.bfloat16, None, 1e-2),
    # the other ring configurations (added after the last GPU run of this list)
    (128, 4, 2, 16, 4, 2, jnp.bfloat16, None, 1e-2),
    (128, 2, 3, 32, 2, None, jnp.bfloat16, None, 1e-2),
    (128, 2, 4, 16, 8, 3, jnp.float16, None, 3e-3),
    (64, 4, 2, 16, 4, None, jnp.bfloat16, None, 1e-2),
    (64, 3, 4, 32, 2, 2, jnp.float16, None, 3e-3),
    (64, 2, 4, 64, 1, 3, jnp.bfloat16, None, 1e-2),
    # head_dim 256: v4's warp pairs with 2- / 3-bit K and / or V (2-4 ring stages: tiles of either
    # parity per stage; 3-bit half rows of 3 copy units)
    (256, 2, 2, 16, 4, None, jnp.bfloat16, None, 1e-2),
    (256, 4, 2, 32, 2, 3, jnp.float16, None, 3e-3),
    (256, 2, 4, 16, 1, 2, jnp.float32, "default", 3e-3),
    (256, 3, 4, 16, 4, 2, jnp.bfloat16, None, 1e-2),
    (256, 3, 3, 32, 2, None, jnp.bfloat16, None, 1e-2),
    (256, 4, 3, 16, 4, 3, jnp.float16, None, 3e-3),
    (256, 2, 3, 48, 1, 2, jnp.float32, "default", 3e-3),
    (256, 3, 2, 16, 3, None, jnp.bfloat16, None, 1e-2),
    # head_dim 96 with 2-bit K and / or V: padded rows of 24 bytes (8-byte copy units)
    (96, 2, 2, 16, 4, None, jnp.bfloat16, None, 1e-2),
    (96, 4, 2, 32, 8, 3, jnp.float16, None, 3e-3),
    (96, 2, 4, 16, 1, 2, jnp.float32, "default", 3e-3),
    (96, 2, 2, 48, 6, 64, jnp.bfloat16, None, 1e-2),
    # head_dim 96 with 3-bit K and / or V: stage rows packed at the pool's 36-byte stride
    (96, 3, 3, 16, 4, None, jnp.bfloat16, None, 1e-2),
    (96, 3, 4, 32, 8, 3, jnp.float16, None, 3e-3),
    (96, 4, 3, 16, 1, 2, jnp.float32, "default", 3e-3),
    (96, 3, 2, 48, 6, 64, jnp.bfloat16, None, 1e-2),
    (96, 2, 3, 16, 3, 1, jnp.bfloat16, None, 1e-2),
    (96, 3, 3, 256, 2, 2, jnp.float16, None, 3e-3),
    # head_dim 80 with 2- / 3-bit K and / or V: packed rows of 20 / 30 bytes (2- to 8-byte aligned
    # lane loads), and 4-bit rows packed beside them
    (80, 3, 3, 16, 4, None, jnp.bfloat16, None, 1e-2),
    (80, 2, 2, 32, 8, 3, jnp.float16, None, 3e-3),
    (80, 4, 2, 16, 1, 2, jnp.float32, "default", 3e-3),
    (80, 2, 4, 48, 6, 64, jnp.bfloat16, None, 1e-2),
    (80, 3, 4, 16, 3, 1, jnp.bfloat16, None, 1e-2),
    (80, 4, 3, 256, 2, 2, jnp.float16, None, 3e-3),
    (80, 2, 3, 16, 5, None, jnp.bfloat16, None, 1e-2),
    (80, 3, 2, 64, 4, 4, jnp.float16, None, 3e-3),
]


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,k_bits,v_bits,page_size,group,num_splits,qdtype,precision,tol", TC_BITS_CASES)
def test_paged_decode_tensor_core_bits(rng, head_dim, k_bits, v_bits, page_size, group, num_splits, qdtype,
                                       precision, tol):
    _check_tensor_core_case(rng, head_dim, k_bits, v_bits, page_size, group, num_splits, qdtype, precision, tol)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,page_size,group,num_splits,qdtype,precision,tol", TC_CASES)
def test_paged_decode_tensor_core_cases(rng, head_dim, page_size, group, num_splits, qdtype, precision, tol):
    _check_tensor_core_case(rng, head_dim, 4, 4, page_size, group, num_splits, qdtype, precision, tol)


def _check_tensor_core_case(rng, head_dim, k_bits, v_bits, page_size, group, num_splits, qdtype, precision, tol):
    q, cache, tables, lens = _decode_inputs(rng, head_dim, k_bits, v_bits, page_size, group, 2, qdtype, max_len=900)
    poison_device_memory(q.size * 4 * 8 * 70)
    fn = jax.jit(lambda *a: tq.paged_decode(*a, num_splits=num_splits, precision=precision))
    got = np.asarray(fn(q, cache, tables, lens).astype(jnp.float32), np.float64)
    assert np.all(np.isfinite(got)) and np.all(got[0] == 0.0)
    want = on_cpu(decode_f64, np.asarray(q.astype(jnp.float32)), cache, tables, lens)
    assert rel_err(got, want) < tol
    for s in range(1, q.shape[0]):
        assert rel_err(got[s], want[s]) < 5 * tol, f"sequence {s}"


@pytest.mark.gpu
@pytest.mark.parametrize("qdtype", [jnp.float32, jnp.bfloat16])
def test_paged_decode_huge_v_norms(rng, qdtype):
    """V norms far beyond the f16 range (1e6 .. 1e30) stay finite and exact in relative terms."""
    q, cache, tables, lens = _decode_inputs(rng, 128, 4, 4, 16, 4, 2, qdtype, num_seqs=4, max_len=800)
    big = jnp.asarray(10.0 ** rng.uniform(6, 30, size=cache.v_norms.shape), jnp.float32)
    cache = dataclasses.replace(cache, v_norms=big)
    got = np.asarray(_decode(q, cache, tables, lens, num_splits=3).astype(jnp.float32), np.float64)
    want = on_cpu(decode_f64, np.asarray(q.astype(jnp.float32)), cache, tables, lens)
    assert np.all(np.isfinite(got))
    tol = 2e-5 if qdtype == jnp.float32 else 1e-2
    for s in range(1, q.shape[0]):
        assert rel_err(got[s], want[s]) < tol, f"sequence {s}"


@pytest.mark.gpu
@pytest.mark.parametrize("num_seqs,qdtype,head_dim,group", [
    (2, jnp.bfloat16, 128, 4), (11, jnp.float16, 128, 4), (43, jnp.float32, 128, 4), (171, jnp.bfloat16, 128, 4),
    (13, jnp.bfloat16, 64, 4), (9, jnp.float32, 64, 2), (7, jnp.bfloat16, 256, 2), (5, jnp.float16, 256, 5)])
def test_paged_decode_row_counts(rng, num_seqs, qdtype, head_dim, group):
    """Up to 2052 query rows with NaN / inf query rows among them: NaN rows exactly there, every
    other row against float64; the device memory is poisoned first."""
    q, cache, tables, lens = _decode_inputs(rng, head_dim, 4, 4, 16, group, 3, qdtype, num_seqs=num_seqs, max_len=90)
    bad = np.zeros(q.shape[:2], bool)
    bad[-1, 5] = bad[num_seqs // 2, 0] = True
    q = q.at[-1, 5, 7].set(jnp.nan).at[num_seqs // 2, 0, head_dim - 28].set(-jnp.inf)
    for splits in (1, 3):
        poison_device_memory(q.size * 4 * 8 * 10)
        got = np.asarray(_decode(q, cache, tables, lens, num_splits=splits).astype(jnp.float32), np.float64)
        assert np.all(np.isnan(got[bad])) and np.all(np.isfinite(got[~bad]))
        want = on_cpu(decode_f64, np.asarray(jnp.where(jnp.isfinite(q), q, 0).astype(jnp.float32)), cache,
                       tables, lens)
        tol = 2e-5 if qdtype == jnp.float32 else 1e-2
        assert rel_err(got[~bad], want[~bad]) < tol
        for s in range(1, num_seqs):
            ok = ~bad[s]
            assert rel_err(got[s][ok], want[s][ok]) < 5 * tol, f"sequence {s}"


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_v4_query_rotation_overflow_row(rng, num_splits):
    """A finite bfloat16 query of 3e38 in every coordinate has a q_rot beyond float32: v4 flags the
    row when it stages q and writes a NaN row (through the combine with splits), as the reference
    does; a query of 1e-30 keeps its float64 value, and so do the other rows."""
    q, cache, tables, lens = _decode_inputs(rng, 128, 4, 4, 16, 4, 2, jnp.bfloat16, num_seqs=3, max_len=300)
    q = q.at[1, 2].set(3e38).at[2, 5].multiply(1e-30)
    poison_device_memory(q.size * 4 * 8 * 10)
    got = np.asarray(_decode(q, cache, tables, lens, num_splits=num_splits).astype(jnp.float32), np.float64)
    bad = np.zeros(q.shape[:2], bool)
    bad[1, 2] = True
    assert np.all(np.isnan(got[bad])) and np.all(np.isfinite(got[~bad]))
    want = on_cpu(decode_f64, np.asarray(q.astype(jnp.float32)).clip(-1e30, 1e30), cache, tables, lens)
    assert rel_err(got[~bad], want[~bad]) < 1e-2
    assert rel_err(got[2, 5], want[2, 5]) < 5e-2


# Hadamard codecs: the tensor-core kernels rotate q in their prologue and the output in their
# epilogue (one split) or in the combine (splits). v4 ring (page 16 / 32), v4's per-token path
# (page 24), v3 (float32-accurate products), head tiles of 4 and 8 with padding (3, 6, 12).
FUSED_CASES = [
    (16, 4, 1, jnp.bfloat16, None, 1e-2),
    (16, 4, 3, jnp.bfloat16, None, 1e-2),
    (32, 8, None, jnp.float16, None, 3e-3),
    (24, 6, 2, jnp.bfloat16, None, 1e-2),
    (16, 3, 1, jnp.float32, "highest", 2e-5),
    (64, 12, 4, jnp.float32, "highest", 2e-5),
    (16, 4, 1, jnp.float32, None, 3e-3),
    (16, 2, 1, jnp.bfloat16, None, 1e-2, 2),   # K2V2 (v4 ring), group 2
    (32, 4, 3, jnp.float32, "highest", 2e-5, 2),
    (16, 4, 2, jnp.bfloat16, None, 1e-2, 3),   # K3V3 (v4 ring)
    (24, 8, 1, jnp.float16, None, 3e-3, 3),    # K3V3 (v4 register variant)
]


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("page_size,group,num_splits,qdtype,precision,tol,bits",
                         [c if len(c) == 7 else (*c, 4) for c in FUSED_CASES])
def test_paged_decode_fused_rotation(rng, head_dim, page_size, group, num_splits, qdtype, precision, tol, bits):
    """Against float64, with NaN rows where q is not finite and where a finite q's rotation passes
    float32 (3e38 in every coordinate); the memory is poisoned first, and the rotation operand must
    reach the kernel wherever the tensor-core kernels run (all of these cases)."""
    q, cache, tables, lens = _decode_inputs(rng, head_dim, bits, bits, page_size, group, 2, qdtype, max_len=900,
                                            rotation="hadamard")
    q = q.at[2, 1, 17].set(jnp.nan)
    bad = np.zeros(q.shape[:2], bool)
    bad[2, 1] = True
    if qdtype != jnp.float16:
        q = q.at[3, 0].set(3e38)
        bad[3, 0] = True
    fn = jax.jit(lambda *a: tq.paged_decode(*a, num_splits=num_splits, precision=precision))
    fused = f"tensor<2x{head_dim}xi32>" in fn.lower(q, cache, tables, lens).as_text()
    assert fused == tq.plan_decode(q, cache, tables, num_splits=num_splits, precision=precision)["fused_rotation"]
    assert fused or os.environ.get("JAX_TQ_DECODE_KERNEL") == "cuda-core"  # which rotates in XLA
    poison_device_memory(q.size * 4 * 8 * 70)
    got = np.asarray(fn(q, cache, tables, lens).astype(jnp.float32), np.float64)
    assert np.all(np.isnan(got[bad])) and np.all(np.isfinite(got[~bad])) and np.all(got[0] == 0.0)
    want = on_cpu(decode_f64, np.asarray(jnp.where(jnp.asarray(bad)[..., None], 0, q).astype(jnp.float32)),
                   cache, tables, lens)
    assert rel_err(got[~bad], want[~bad]) < tol
    for s in range(1, q.shape[0]):
        ok = ~bad[s]
        assert rel_err(got[s][ok], want[s][ok]) < 5 * tol, f"sequence {s}"


@pytest.mark.gpu
@pytest.mark.parametrize("hkv,group,num_splits,rotation", [
    (2, 1, 1, "hadamard"), (4, 3, 1, "haar"), (4, 4, 3, "hadamard"), (6, 2, 2, "haar"),
    (3, 4, 1, "hadamard"), (1, 2, 5, "haar"), (2, 4, 200, "hadamard"),
])
def test_paged_decode_two_item_rows(rng, hkv, group, num_splits, rotation):
    """head_dim 128 K4V4 with head tiles of 4: an even number of KV heads runs two per CTA (v4's
    ITEMS = 2, on sm_90), an odd number one per CTA; every KV head's rows against float64, with the
    fused (Hadamard) epilogue and without, with one split and with more splits than pages."""
    q, cache, tables, lens = _decode_inputs(rng, 128, 4, 4, 16, group, hkv, jnp.bfloat16, num_seqs=4, max_len=1200,
                                            rotation=rotation)
    poison_device_memory(q.size * 4 * 8 * 70)
    got = np.asarray(_decode(q, cache, tables, lens, num_splits=num_splits).astype(jnp.float32), np.float64)
    assert np.all(np.isfinite(got)) and np.all(got[0] == 0.0)
    want = on_cpu(decode_f64, np.asarray(q.astype(jnp.float32)), cache, tables, lens)
    for s in range(1, q.shape[0]):
        for h in range(hkv):
            rows = slice(h * group, (h + 1) * group)
            assert rel_err(got[s, rows], want[s, rows]) < 2e-2, (s, h)


@pytest.mark.gpu
@pytest.mark.parametrize("num_seqs,items,num_splits,rotation,group", [
    (40, 4, 1, "hadamard", 4), (40, 4, 1, "haar", 4), (100, 8, 1, "hadamard", 4), (100, 8, 1, "haar", 4),
    (20, 4, 2, "hadamard", 4), (50, 8, 2, "hadamard", 4), (40, 4, 1, "hadamard", 2), (100, 8, 1, "haar", 3),
])
def test_paged_decode_many_item_rows(rng, num_seqs, items, num_splits, rotation, group):
    """head_dim 128 K4V4, 8 KV heads in head tiles of 4 (groups of 2 and 3 padded), grids of more
    than two items per SM: 40
    sequences (160 CTAs of two items, 2 waves on 132 SMs) run 4 KV heads per CTA, 100 sequences
    8 (one wave each). The phase trace shows the KV heads of each CTA on one SM (and the next
    CTA's on another); every KV head's rows against float64, fused epilogue (one split, Hadamard)
    and not."""
    from jax_tq import _ffi
    module = _ffi.cuda_module()
    tracing = hasattr(module, "phase_trace")
    q, cache, tables, lens = _decode_inputs(rng, 128, 4, 4, 16, group, 8, jnp.bfloat16, num_seqs=num_seqs,
                                            max_len=700, rotation=rotation)
    if tracing:
        module.phase_trace()
    poison_device_memory(q.size * 4 * 8 * 70)
    got = np.asarray(_decode(q, cache, tables, lens, num_splits=num_splits).astype(jnp.float32), np.float64)
    sms = _read_phase_trace(module)[..., 0, 0, 1] if tracing else None
    assert np.all(np.isfinite(got)) and np.all(got[0] == 0.0)
    want = on_cpu(decode_f64, np.asarray(q.astype(jnp.float32)), cache, tables, lens)
    for s in range(1, num_seqs):
        for h in range(8):
            rows = slice(h * group, (h + 1) * group)
            assert rel_err(got[s, rows], want[s, rows]) < 2e-2, (s, h)
    planned = tq.plan_decode(q, cache, tables, num_splits=num_splits)
    if module.device_info().get("sm_count") == 132 and _default_kernel():
        assert planned["kernel"] == "tensor-core-f16" and planned["items"] == items, planned
    if tracing and planned["items"] == items:  # the KV heads of each CTA on one SM, the next CTA's on another
        cols = num_seqs * num_splits
        for x in range(cols):
            on = [sms[x + cols * row] for row in range(8)]
            for row in range(8):
                assert on[row] == on[row - row % items], (x, row, on)
            if items < 8:
                assert on[0] != on[items], (x, on)


def _default_kernel() -> bool:
    return os.environ.get("JAX_TQ_DECODE_KERNEL", "") in ("", "tensor-core-f16")


@pytest.mark.gpu
@pytest.mark.parametrize("hkv,page_size,num_splits,rotation", [
    (2, 16, 1, "hadamard"), (2, 16, 1, "haar"), (4, 64, 2, "hadamard"), (6, 32, 2, "haar"),
])
def test_paged_decode_long_sequences(rng, hkv, page_size, num_splits, rotation):
    """Sequences of 9,000-12,000 tokens (head_dim 128 K4V4, an even number of KV heads: two items
    per CTA on sm_90, 8 warps each) in 1 or 2 splits: 35-94 tiles per warp, many passes over each
    warp's ring, more than 32 tiles per warp in every split (the other decode tests stay under
    2,000 tokens), second splits (tok0 > 0), pages of several tiles; every KV head's rows against
    float64."""
    group = 4
    q, cache, tables, lens = _decode_inputs(rng, 128, 4, 4, page_size, group, hkv, jnp.bfloat16,
                                            rotation=rotation, seq_lens=[0, 12000 - 5, 9000])
    poison_device_memory(q.size * 4 * 8 * 70)
    got = np.asarray(_decode(q, cache, tables, lens, num_splits=num_splits).astype(jnp.float32), np.float64)
    assert np.all(np.isfinite(got)) and np.all(got[0] == 0.0)
    want = on_cpu(decode_f64, np.asarray(q.astype(jnp.float32)), cache, tables, lens)
    for s in (1, 2):
        for h in range(hkv):
            rows = slice(group * h, group * h + group)
            assert rel_err(got[s, rows], want[s, rows]) < 2e-2, (s, h)


@pytest.mark.gpu
def test_paged_decode_split_counts_agree(rng):
    q, cache, tables, lens = _decode_inputs(rng, 128, 4, 4, 16, 4, 2, jnp.float32, num_seqs=3, max_len=2000)
    outs = [np.asarray(_decode(q, cache, tables, lens, num_splits=s)) for s in (1, 2, 3, 7, 200)]
    for o in outs[1:]:
        assert rel_err(o, outs[0]) < 1e-5


@pytest.mark.gpu
def test_paged_decode_huge_logits_on_gpu(rng):
    q, cache, tables, lens = _decode_inputs(rng, 128, 4, 4, 16, 4, 2, jnp.float32, num_seqs=4, max_len=1500)
    q = q * 1e4
    for splits in (1, 5):
        got = np.asarray(_decode(q, cache, tables, lens, num_splits=splits), np.float64)
        assert np.all(np.isfinite(got))
        want = on_cpu(decode_f64, np.asarray(q), cache, tables, lens)
        # near one-hot softmax: fp32 logits of magnitude ~1e5 carry ~1e-2 absolute rounding
        assert rel_err(got, want) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("qdtype,head_dim", [(jnp.bfloat16, 128), (jnp.float32, 128), (jnp.bfloat16, 256)])
def test_paged_decode_negative_and_nan_v_norms(rng, qdtype, head_dim):
    """Tensor-core kernels (bf16: v4's f16 products, at head_dim 256 its warp pairs; float32: v3):
    V norms weigh with their sign, and a NaN V norm of an attended token gives NaN rows for its KV
    head's query heads, as in the float64 oracle."""
    q, cache, tables, lens = _decode_inputs(rng, head_dim, 4, 4, 16, 4, 2, qdtype, num_seqs=4, max_len=600)
    v_norms = np.array(cache.v_norms)  # [num_pages, num_kv_heads, page_size]
    v_norms *= np.where(rng.random(v_norms.shape) < 0.3, -1.0, 1.0)
    v_norms[int(tables[2, 0]), 1, 0] = np.nan  # sequence 2, KV head 1, token 0
    cache = dataclasses.replace(cache, v_norms=jnp.asarray(v_norms, jnp.float32))
    got = np.asarray(_decode(q, cache, tables, lens, num_splits=2).astype(jnp.float32), np.float64)
    want = on_cpu(decode_f64, np.asarray(q.astype(jnp.float32)), cache, tables, lens)
    nan_rows = np.isnan(want).any(axis=-1)
    assert nan_rows[2, 4:8].all()  # (other sequences may share the page)
    assert np.isnan(got[nan_rows]).all() and np.isfinite(got[~nan_rows]).all()
    assert rel_err(got[~nan_rows], want[~nan_rows]) < (2e-2 if qdtype == jnp.bfloat16 else 2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 256])
def test_paged_decode_v4_logits_beyond_float32_spacing(rng, head_dim):
    """bf16 queries scaled so that scores reach ~2^28 in log2 units (float32 spacing 32 there) with V
    norms of 1e6 (beyond float16): every output is finite and, being a convex combination of V
    vectors, no longer than the longest attended one."""
    q, cache, tables, lens = _decode_inputs(rng, head_dim, 4, 4, 16, 4, 2, jnp.bfloat16, num_seqs=4, max_len=600)
    v_norms = 10.0 ** rng.uniform(5, 6, size=cache.v_norms.shape)
    cache = dataclasses.replace(cache, v_norms=jnp.asarray(v_norms, jnp.float32))
    q = (q.astype(jnp.float32) * 1e9).astype(jnp.bfloat16)
    got = np.asarray(_decode(q, cache, tables, lens, num_splits=2).astype(jnp.float32), np.float64)
    assert np.all(np.isfinite(got))
    unit = np.asarray(cache.v_codec.centroids, np.float64)[unpack_codes(np.asarray(cache.v_codes), 4, head_dim)]
    longest_v = np.max(np.linalg.norm(unit, axis=-1) * v_norms)
    assert np.all(np.linalg.norm(got, axis=-1) <= 1.01 * longest_v)
    assert np.all(np.linalg.norm(got[1:], axis=-1) > 0)  # sequence 0 is empty (zeros)


@pytest.mark.gpu
def test_the_float16_kernel_runs_its_fastest_variants_on_sm_90():
    """On sm_90 the planner puts every head_dim / width the float16 tensor-core kernel serves on its
    ring (2 CTAs per SM; head_dim 256 and 192: warp pairs), and head_dim 128 K4V4 on several work
    items per CTA; a kernel that no longer fits would quietly fall back to a slower variant."""
    from jax_tq import _ffi
    mod = _ffi.cuda_module()
    info = mod.device_info()
    if (info["cc_major"], info["cc_minor"]) != (9, 0) or not _default_kernel():
        pytest.skip("the rings' shared memory is planned for sm_90")

    def plan(head_dim, k_bits, v_bits, num_seqs=32, group=4):
        return mod.plan_decode(num_seqs, 8 * group, 8, head_dim, 512, 16, k_bits, v_bits, True, False, False)

    for head_dim in (64, 128, 80, 96, 256):
        for k_bits in (2, 3, 4):
            for v_bits in (2, 3, 4):
                got = plan(head_dim, k_bits, v_bits)
                assert got["kernel"] == "tensor-core-f16" and got["ring"], (head_dim, k_bits, v_bits, got)
    assert plan(192, 4, 4)["ring"] and plan(192, 4, 4)["halves"] == 2 and plan(192, 2, 4)["kernel"] == "cuda-core"
    for num_seqs, items in ((32, 2), (64, 4), (128, 8)):
        assert plan(128, 4, 4, num_seqs)["items"] == items, f"head_dim 128 K4V4: one CTA of {items} work items per SM"
    assert mod.plan_decode(32, 32, 8, 128, 512, 16, 4, 4, False, False, False)["kernel"] == "tensor-core-f32"


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 2])
def test_paged_decode_phase_trace(rng, num_splits):
    """Builds with JAX_TQ_TRACE_PHASES=ON (benchmarks/phase_trace.py): the float16 kernel stamps every
    warp of every CTA, in time order, with one SM per CTA, and nothing past the grid; reading the
    trace clears it."""
    from jax_tq import _ffi
    module = _ffi.cuda_module()
    if not hasattr(module, "phase_trace") or not _default_kernel():
        pytest.skip("a build without the phase trace (JAX_TQ_TRACE_PHASES=ON builds it)")
    q, cache, tables, lens = _decode_inputs(rng, 128, 4, 4, 16, 4, 2, jnp.bfloat16, num_seqs=3, max_len=2000,
                                            rotation="hadamard")
    module.phase_trace()
    traced = np.asarray(jax.jit(lambda *a: tq.paged_decode(*a, num_splits=num_splits))(q, cache, tables, lens))
    raw = _read_phase_trace(module)
    assert np.all(np.isfinite(traced))
    ctas = q.shape[0] * num_splits * cache.num_kv_heads  # one head tile of 4 per KV head
    stamps, sms = raw[..., 0], raw[..., 1]
    assert np.all(stamps[:ctas] > 0), "every warp of every CTA stamps all ten phases"
    assert np.all(np.diff(stamps[:ctas].astype(np.int64), axis=-1) >= 0), "stamps in time order"
    assert np.all(sms[:ctas] == sms[:ctas, :1, :1]), "one SM per CTA"
    assert np.all(raw[ctas:] == 0), "nothing past the grid"
    if tq.plan_decode(q, cache, tables, num_splits=num_splits)["items"] == 2:
        # Two work items per CTA: the KV heads 2b and 2b + 1 of a (sequence, split) on one SM.
        cols = q.shape[0] * num_splits
        for x in range(cols):
            for b in range(0, cache.num_kv_heads, 2):
                assert sms[x + cols * b, 0, 0] == sms[x + cols * (b + 1), 0, 0], (x, b)
    assert not np.any(np.frombuffer(module.phase_trace(), np.uint64)), "a read clears the trace"


@pytest.mark.gpu
def test_paged_decode_vmap_and_jit(rng):
    caches, qs, tabs, lens_ = [], [], [], []
    for _ in range(3):
        q, cache, tables, lens = _decode_inputs(rng, 64, 4, 2, 16, 2, 2, jnp.float32, num_seqs=2, max_len=300)
        # make pools the same shape for stacking
        caches.append(cache)
        qs.append(q)
        tabs.append(tables)
        lens_.append(lens)
    shapes = {c.k_codes.shape for c in caches}
    if len(shapes) != 1:  # different page counts: pad to the largest pool
        p = max(c.num_pages for c in caches)
        def pad(c):
            extra = p - c.num_pages
            padded = {n: jnp.concatenate([getattr(c, n), jnp.zeros((extra,) + getattr(c, n).shape[1:], getattr(c, n).dtype)])
                      for n in ("k_codes", "k_norms", "v_codes", "v_norms")}
            return dataclasses.replace(c, **padded)
        caches = [pad(c) for c in caches]
    mp = max(t.shape[1] for t in tabs)
    tabs = [jnp.pad(t, ((0, 0), (0, mp - t.shape[1])), constant_values=-1) for t in tabs]
    # All three caches must share the codecs for stacking: rebuild with the first one's codecs.
    caches = [dataclasses.replace(c, k_codec=caches[0].k_codec, v_codec=caches[0].v_codec) for c in caches]
    stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *caches)
    batched = jax.jit(jax.vmap(lambda q, c, t, l: tq.paged_decode(q, c, t, l, num_splits=2)))(
        jnp.stack(qs), stacked, jnp.stack(tabs), jnp.stack(lens_))
    for i in range(3):
        one = _decode(qs[i], caches[i], tabs[i], lens_[i], num_splits=2)
        assert rel_err(batched[i], one) < 1e-6
        want = on_cpu(decode_f64, np.asarray(qs[i]), caches[i], tabs[i], lens_[i])
        assert rel_err(batched[i], want) < 2e-5
