"""jax_tq.models.generate (a batch of different prompts, greedy or sampled, per-sequence stop
tokens), make_sampling_loop, sample_tokens and batch_log_likelihoods on a tiny random Llama."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jax_tq.models import (  # noqa: E402
    LlamaConfig,
    batch_log_likelihoods,
    forward_logits,
    generate,
    greedy_generate,
    init_caches,
    make_prefill,
    make_sampling_loop,
    sample_tokens,
    token_log_likelihoods,
)
from jax_tq.models.llama import Llama  # noqa: E402

from tiny_llama import TINY, tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama()


def _prompts(rng, n=3, lo=2, hi=10):
    return [list(map(int, rng.integers(0, TINY.vocab_size, int(rng.integers(lo, hi))))) for _ in range(n)]


@pytest.mark.parametrize("cache", [None, pytest.param((4, 4), marks=pytest.mark.slow)])
def test_greedy_batch_of_different_prompts_equals_each_prompt_alone(tiny, cache, rng):
    prompts = _prompts(rng)
    prompts[1] = prompts[1][:2]  # lengths differ: padding in the prefill
    new = 6
    # float32 pages: the uncompressed cache's argmax is compared with the float32 forward's below (bf16
    # pages, the default, move logits by ~1e-3 and CI saw a near-tie flip at that size)
    got = generate(tiny, prompts, new, cache, uncompressed_dtype=jnp.float32)
    assert got["all_ids"].shape == (3, new) and got["decode_steps"] == new - 1 and not any(got["stopped"])
    assert got["prefill_s"] > 0 and got["decode_s"] > 0 and got["tokens_per_s"] > 0
    for b, prompt in enumerate(prompts):
        assert got["ids"][b] == list(got["all_ids"][b])
        alone = greedy_generate(tiny, prompt, new, cache, batch=1, uncompressed_dtype=jnp.float32)
        np.testing.assert_array_equal(got["all_ids"][b], alone["all_ids"][0])
        if cache is None:  # the argmax of the full causal forward over prompt + generated ids, up to float32
            seq = np.array(prompt + got["ids"][b], np.int32)  # near-ties within float32 rounding
            logits = np.asarray(forward_logits(tiny, seq))[len(prompt) - 1:-1]
            chosen = logits[np.arange(new), got["all_ids"][b]]
            np.testing.assert_allclose(chosen, logits.max(-1), rtol=0, atol=1e-4)
            assert np.mean(got["all_ids"][b] == logits.argmax(-1)) >= 0.8


def test_stop_tokens_cut_each_sequence_after_its_first_stop(tiny, rng):
    prompts = _prompts(rng, 4)
    new = 8
    free = generate(tiny, prompts, new, None)["all_ids"]
    stops = (int(free[0, 3]), int(free[1, 0]))  # row 1 stops at its first token (from the prefill)
    got = generate(tiny, prompts, new, None, stop_tokens=stops)
    for b in range(4):
        row = list(map(int, free[b]))
        hits = [i for i, t in enumerate(row) if t in stops]
        want = row[:hits[0] + 1] if hits else row
        assert got["ids"][b] == want and got["stopped"][b] == bool(hits)
        assert list(got["all_ids"][b, :len(want)]) == want and (got["all_ids"][b, len(want):] == -1).all()
    assert got["stopped"][0] and got["stopped"][1] and len(got["ids"][1]) == 1
    everyone = generate(tiny, prompts, new, None, stop_tokens=tuple(int(t) for t in free[:, 0]))
    assert everyone["ids"] == [[int(t)] for t in free[:, 0]] and everyone["decode_s"] == 0  # the loop never ran


def test_a_stopped_row_writes_nothing_more(tiny, rng):
    """make_sampling_loop: after row 0 samples the stop token at step j, the slots of its later
    positions stay empty while row 1 goes on writing; the loop's other tokens are the greedy ones."""
    lens = np.array([5, 3], np.int32)
    prompts = rng.integers(0, TINY.vocab_size, (2, 5)).astype(np.int32)
    ps, steps = 4, 6
    tables = np.array([[0, 1, 2], [3, 4, 5]], np.int32)
    caches = init_caches(TINY, None, None, num_pages=6, page_size=ps, dtype=jnp.float32)
    logits, caches = make_prefill(tiny)(caches, prompts, lens, tables)
    first = np.asarray(logits).argmax(-1).astype(np.int32)
    loop = make_sampling_loop(tiny)
    key = jax.random.PRNGKey(0)
    copy = jax.tree_util.tree_map(jnp.copy, caches)
    free, _ = loop(copy, first, lens, tables, lens + 1, steps, key)
    free = np.asarray(free)
    # The stop: row 0's token at the first step j whose token neither row produced before (row 1 never).
    js = [j for j in range(steps - 1) if free[0, j] not in free[0, :j] and free[0, j] not in free[1]]
    if not js:
        pytest.skip("every token of row 0 also comes earlier or in row 1")
    j = js[0]
    stop = int(free[0, j])
    tokens, caches = loop(caches, first, lens, tables, lens + 1, steps, key, stop_tokens=[stop])
    tokens = np.asarray(tokens)
    np.testing.assert_array_equal(tokens[0, :j + 1], free[0, :j + 1])
    assert (tokens[0, j + 1:] == -1).all()
    np.testing.assert_array_equal(tokens[1], free[1])
    k = np.asarray(caches[0].k_pages)  # [pages, Hkv, ps, d]

    def written(row, pos):
        return bool(np.abs(k[tables[row, pos // ps], :, pos % ps]).sum() > 0)

    # Row 0 wrote its prompt, its first token (position 5) and steps 0..j's inputs (5 + j at most).
    assert all(written(0, p) for p in range(lens[0] + j + 1))
    assert not any(written(0, p) for p in range(lens[0] + j + 1, 3 * ps))
    assert all(written(1, p) for p in range(lens[1] + steps))


def test_sampling_is_reproducible_and_its_limits_are_greedy(tiny, rng):
    prompts = _prompts(rng, 3)
    new = 8
    greedy = generate(tiny, prompts, new, None)["all_ids"]
    a = generate(tiny, prompts, new, None, temperature=1.0, seed=3)["all_ids"]
    b = generate(tiny, prompts, new, None, temperature=1.0, seed=3)["all_ids"]
    c = generate(tiny, prompts, new, None, temperature=1.0, seed=4)["all_ids"]
    np.testing.assert_array_equal(a, b)
    assert (a != c).any() and (a != greedy).any()
    np.testing.assert_array_equal(generate(tiny, prompts, new, None, temperature=1e-7, seed=5)["all_ids"], greedy)
    np.testing.assert_array_equal(generate(tiny, prompts, new, None, temperature=2.0, top_k=1, seed=6)["all_ids"],
                                  greedy)


def test_sample_tokens_draws_from_the_tempered_top_k_softmax(rng):
    logits = rng.normal(size=6).astype(np.float32)
    n, temperature, top_k = 40000, 0.7, 3
    key = jax.random.PRNGKey(int(rng.integers(2**31)))
    draws = np.asarray(sample_tokens(jnp.broadcast_to(jnp.asarray(logits), (n, 6)), key, temperature, top_k))
    keep = np.argsort(-logits.astype(np.float64))[:top_k]
    p = np.zeros(6)
    p[keep] = np.exp(logits[keep].astype(np.float64) / temperature)
    p /= p.sum()
    freq = np.bincount(draws, minlength=6) / n
    assert (freq[p == 0] == 0).all()
    assert (np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / n)).all(), (freq, p)  # 5 sigma
    np.testing.assert_array_equal(np.asarray(sample_tokens(jnp.asarray(logits)[None], None)), [logits.argmax()])


def test_sample_tokens_at_tiny_temperatures_is_greedy(rng):
    """logits / temperature overflows float32 (1e-30) or the temperature is a subnormal that the CPU
    flushes to 0 (1e-38): the largest logit still wins, not token 0."""
    logits = jnp.asarray(rng.normal(size=(8, 50)), jnp.float32).at[:, 0].set(-3.0)
    for temperature in (1e-30, 1e-38, 1e-45):
        for top_k in (None, 2):
            for seed in range(3):
                got = sample_tokens(logits, jax.random.PRNGKey(seed), temperature, top_k)
                np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(logits, axis=-1)))


def test_generate_and_sampling_refuse_bad_arguments(tiny):
    ok = [[1, 2, 3]]
    for bad, exc, match in (([], ValueError, "prompts is empty"), ([[1], []], ValueError, r"prompts\[1\]"),
                            ([[1, 97]], ValueError, r"prompts\[0\]: token ids must lie in \[0, vocab_size=97\)"),
                            ([[1.5]], TypeError, "integers"), ("abc", TypeError, "list of token-id lists"),
                            (np.zeros((2, 3), np.int32), TypeError, "list of token-id lists")):
        with pytest.raises(exc, match=match):
            generate(tiny, bad, 3, None)
    for kwargs, exc, match in ((dict(max_new_tokens=0), ValueError, "max_new_tokens must be >= 1"),
                               (dict(max_new_tokens=2.0), TypeError, "max_new_tokens"),
                               (dict(temperature=-1.0), ValueError, "temperature"),
                               (dict(temperature=float("nan")), ValueError, "temperature"),
                               (dict(temperature="hot"), TypeError, "temperature"),
                               (dict(top_k=0), ValueError, "top_k"), (dict(top_k=98), ValueError, "top_k"),
                               (dict(top_k=2.0), TypeError, "top_k"), (dict(seed=-1), ValueError, "seed"),
                               (dict(stop_tokens=5), TypeError, "stop_tokens must be a sequence"),
                               (dict(stop_tokens=(97,)), ValueError, "stop_tokens"),
                               (dict(cache_config="k9v9"), ValueError, "k_bits must be one of")):
        with pytest.raises(exc, match=match):
            generate(tiny, ok, **(dict(max_new_tokens=3) | kwargs))
    with pytest.raises(ValueError, match="top_k"):
        sample_tokens(jnp.zeros((2, 5)), jax.random.PRNGKey(0), 1.0, 6)
    for logits in (jnp.float32(1.0), jnp.zeros((2, 0))):  # no vocabulary axis (IndexError), or an empty one
        with pytest.raises(ValueError, match=r"sample_tokens: logits must be float \[..., vocab\] with vocab >= 1"):
            sample_tokens(logits, jax.random.PRNGKey(0), 1.0)


@pytest.mark.parametrize("cache", [None, (4, 3)])
def test_batch_log_likelihoods_equal_each_sequence_alone(tiny, cache, rng):
    seqs = _prompts(rng, 3, 2, 30)
    seqs[0] = seqs[0][:2]
    got = batch_log_likelihoods(tiny, seqs, cache)
    assert [g.shape for g in got] == [(len(s) - 1,) for s in seqs]
    # With a compressed cache the batched and the lone forwards may store different codes: their
    # float32 K / V differ by rounding (XLA's reductions over other shapes), and a coordinate within
    # that of a codebook boundary takes the neighbouring code (one CI run: later tokens moved by
    # 2.8e-3). The cache itself moves these log-likelihoods by ~0.6-0.9 against none, and attending to
    # another sequence's tokens by 1-3.
    atol = 1e-5 if cache is None else 2e-2
    for s, g in zip(seqs, got):
        assert g.dtype == np.float64 and (g < 0).all()
        np.testing.assert_allclose(g, token_log_likelihoods(tiny, s, cache), rtol=1e-5, atol=atol)
    if cache is None:  # the float64 log-softmax of each sequence's own forward
        for s, g in zip(seqs, got):
            logits = np.asarray(forward_logits(tiny, np.asarray(s, np.int32)), np.float64)
            lp = logits - logits.max(-1, keepdims=True)
            lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
            np.testing.assert_allclose(g, lp[np.arange(len(s) - 1), s[1:]], atol=1e-5)
    with pytest.raises(ValueError, match=r"sequences\[1\]"):
        batch_log_likelihoods(tiny, [[1, 2], [3]], cache)
