"""jax_tq.nn.PagedAttention: prefill + decode through the paged cache against a float64 numpy oracle,
against the library ops called by hand, under nnx.jit with donation, and its errors."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tq as tq

nnx = pytest.importorskip("flax.nnx")
from jax_tq.nn import PagedAttention  # noqa: E402


def rope_jnp(x, positions):
    """Half-split RoPE (theta 10000) of x [B, L, heads, d] at int positions [B, L]."""
    half = x.shape[-1] // 2
    inv = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
    ang = positions[..., None, None].astype(jnp.float32) * inv
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def rope_np(x, positions):
    half = x.shape[-1] // 2
    inv = 1.0 / (10000.0 ** (np.arange(half, dtype=np.float64) / half))
    ang = np.asarray(positions, np.float64)[:, None, None] * inv
    cos, sin = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def params64(module):
    """The module's projection weights in float64 (biases 0 where it has none)."""
    p = {}
    for name in ("query", "key", "value", "out"):
        lin = getattr(module, name)
        p[name] = np.asarray(lin.kernel[...], np.float64)
        p[name + "_b"] = np.asarray(lin.bias[...], np.float64) if lin.bias is not None else 0.0
    return p


def attention_oracle(module, tokens, rope=None):
    """float64 causal GQA attention of one sequence tokens [T, F] through the module's weights, with
    its sliding_window / soft_cap / sinks: [T, out]."""
    p = params64(module)
    x = np.asarray(tokens, np.float64)
    q = np.einsum("tf,fhd->thd", x, p["query"]) + p["query_b"]
    k = np.einsum("tf,fhd->thd", x, p["key"]) + p["key_b"]
    v = np.einsum("tf,fhd->thd", x, p["value"]) + p["value_b"]
    if rope is not None:
        pos = np.arange(x.shape[0])
        q, k = rope_np(q, pos), rope_np(k, pos)
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = np.einsum("thd,shd->hts", q, k) / np.sqrt(q.shape[-1])
    if module.soft_cap:
        s = module.soft_cap * np.tanh(s / module.soft_cap)
    seen = np.tril(np.ones((x.shape[0], x.shape[0]), bool))
    if module.sliding_window:
        seen &= ~np.tril(seen, -module.sliding_window)
    s = np.where(seen[None], s, -np.inf)
    sinks = None if module.sinks is None else np.asarray(module.sinks[...], np.float64)[:, None, None]
    top = s.max(-1, keepdims=True) if sinks is None else np.maximum(s.max(-1, keepdims=True), sinks)
    w = np.exp(s - top)
    w /= w.sum(-1, keepdims=True) + (0.0 if sinks is None else np.exp(sinks - top))
    attn = np.einsum("hts,shd->thd", w, v)
    return np.einsum("thd,hdo->to", attn, p["out"]) + p["out_b"]


def make(rng, preset="none", *, heads=4, kv_heads=2, features=64, head_dim=16, page_size=4, rope=None, **kw):
    m = PagedAttention(heads, features, heads * head_dim, num_kv_heads=kv_heads, preset=preset, page_size=page_size,
                       rope=rope, rngs=nnx.Rngs(int(rng.integers(1 << 30))), **kw)
    for name in ("query", "key", "value", "out"):  # non-zero biases, so the oracle sees them
        lin = getattr(m, name)
        lin.bias[...] = jnp.asarray(rng.normal(size=lin.bias.shape) * 0.3, jnp.float32)
    return m


@nnx.jit(donate_argnums=0)
def decode_step(module, token):
    return module(token, decode=True)


def run(module, prompt, lens, steps):
    """Prefill prompt [B, L, F] with lens, then each steps[:, i] [B, 1, F] under nnx.jit with donation."""
    outs = [np.asarray(module(prompt, decode=False, lengths=lens))]
    for i in range(steps.shape[1]):
        outs.append(np.asarray(decode_step(module, steps[:, i:i + 1])))
    return outs


def oracle_rows(module, prompt, lens, steps, rope=None):
    """Each row's sequence (its real prompt tokens, then its decode tokens) through the oracle."""
    rows = []
    for b, n in enumerate(np.asarray(lens)):
        rows.append(attention_oracle(module, np.concatenate([prompt[b, :n], steps[b]]), rope))
    return rows


@pytest.mark.parametrize("rope", [None, rope_jnp], ids=["no_rope", "rope"])
def test_uncompressed_prefill_and_decode_equal_float64_attention(rng, rope):
    batch, length, steps_n = 3, 7, 4
    m = make(rng, rope=rope)
    m.init_cache(batch, length + steps_n)
    prompt = rng.normal(size=(batch, length, 64)).astype(np.float32)
    steps = rng.normal(size=(batch, steps_n, 64)).astype(np.float32)
    lens = np.asarray([7, 3, 5], np.int32)  # padded prompts of different lengths; decode positions differ per row
    outs = run(m, jnp.asarray(prompt), jnp.asarray(lens), jnp.asarray(steps))
    want = oracle_rows(m, prompt, lens, steps, rope_np if rope else None)
    for b, n in enumerate(lens):
        np.testing.assert_allclose(outs[0][b, :n], want[b][:n], rtol=2e-5, atol=2e-5)
        bias = np.asarray(m.out.bias[...])  # padded rows: the projection of 0
        np.testing.assert_allclose(outs[0][b, n:], np.broadcast_to(bias, outs[0][b, n:].shape), atol=1e-6)
        for i in range(steps_n):
            np.testing.assert_allclose(outs[1 + i][b, 0], want[b][n + i], rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(m.lengths[...]), lens + steps_n)


@pytest.mark.parametrize("variant", ["window", "soft_cap", "sinks", "all"])
def test_variants_in_prefill_decode_and_without_cache_equal_float64(rng, variant):
    """sliding_window, soft_cap and learned sinks reach prompt_attention, paged_decode and the
    cache-less path: uncompressed cache against the float64 oracle, and they change the answer."""
    options = dict(sliding_window=3 if variant in ("window", "all") else None,
                   soft_cap=1.5 if variant in ("soft_cap", "all") else None, sinks=variant in ("sinks", "all"))
    batch, length, steps_n = 2, 6, 3
    m = make(rng, **options)
    if m.sinks is not None:
        m.sinks[...] = jnp.asarray(rng.normal(size=m.sinks.shape) * 2, jnp.float32)
    prompt = rng.normal(size=(batch, length, 64)).astype(np.float32)
    steps = rng.normal(size=(batch, steps_n, 64)).astype(np.float32)
    lens = np.asarray([6, 4], np.int32)
    plain = np.asarray(m(jnp.asarray(prompt), decode=False, lengths=jnp.asarray(lens)))  # no cache yet
    m.init_cache(batch, length + steps_n)
    outs = run(m, jnp.asarray(prompt), jnp.asarray(lens), jnp.asarray(steps))
    want = oracle_rows(m, prompt, lens, steps)
    for b, n in enumerate(lens):
        np.testing.assert_allclose(plain[b, :n], want[b][:n], rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(outs[0][b, :n], want[b][:n], rtol=2e-5, atol=2e-5)
        for i in range(steps_n):
            np.testing.assert_allclose(outs[1 + i][b, 0], want[b][n + i], rtol=2e-5, atol=2e-5)
    base = make(rng)
    for name in ("query", "key", "value", "out"):  # m's weights without its variants
        nnx.update(getattr(base, name), nnx.state(getattr(m, name)))
    base_out = np.asarray(base(jnp.asarray(prompt), decode=False, lengths=jnp.asarray(lens)))
    assert np.abs(base_out[0, 3:] - plain[0, 3:]).max() > 1e-3


def test_variant_arguments_are_checked(rng):
    with pytest.raises(ValueError, match="nn.PagedAttention: sliding_window must be >= 1"):
        make(rng, sliding_window=0)
    with pytest.raises(TypeError, match="nn.PagedAttention: soft_cap must be a positive Python number"):
        make(rng, soft_cap="big")
    for bad in (jnp.zeros(4), 0.5, "yes"):  # the functional ops take an array; the module learns its own
        with pytest.raises(TypeError, match="sinks must be a bool"):
            make(rng, sinks=bad)


def test_traced_prefill_lengths_past_the_prompt_are_stored_clamped(rng):
    """lengths > L under jit (unchecked there) used to be stored as given: the next decode step
    then attended over slots the prefill never wrote."""
    m = make(rng)
    m.init_cache(1, 16)
    prefill = nnx.jit(lambda m, x, n: m(x, decode=False, lengths=n))
    prefill(m, jnp.asarray(rng.normal(size=(1, 5, 64)), jnp.float32), jnp.asarray([9], jnp.int32))
    np.testing.assert_array_equal(np.asarray(m.lengths[...]), [5])


def test_without_cache_is_causal_attention_and_matches_multihead_attention(rng):
    m = make(rng, heads=4, kv_heads=4)
    mha = nnx.MultiHeadAttention(4, 64, 64, num_kv_heads=4, decode=False, rngs=nnx.Rngs(0))
    nnx.update(mha, jax.tree.map(jnp.copy, nnx.state(m, nnx.Param)))  # same parameter tree
    x = rng.normal(size=(2, 6, 64)).astype(np.float32)
    out = np.asarray(m(jnp.asarray(x), decode=False))
    for b in range(2):
        np.testing.assert_allclose(out[b], attention_oracle(m, x[b]), rtol=2e-5, atol=2e-5)
    mask = nnx.make_causal_mask(jnp.ones((2, 6)))
    np.testing.assert_allclose(out, np.asarray(mha(jnp.asarray(x), mask=mask)), rtol=1e-5, atol=1e-5)


def test_k4v4_equals_the_library_ops_by_hand_and_is_close_to_float64(rng):
    # 70-token prompts: beyond the preset's 64-token window, so decode reads TurboQuant codes too.
    batch, length, steps_n, head_dim = 2, 70, 3, 64
    m = make(rng, "k4v4", heads=4, kv_heads=2, features=64, head_dim=head_dim, page_size=16)
    m.init_cache(batch, length + steps_n)
    prompt = rng.normal(size=(batch, length, 64)).astype(np.float32)
    steps = rng.normal(size=(batch, steps_n, 64)).astype(np.float32)
    lens = np.asarray([70, 66], np.int32)
    outs = run(m, jnp.asarray(prompt), jnp.asarray(lens), jnp.asarray(steps))

    # by hand: the same projections, the cache the module builds, prompt_attention, write_cache + paged_decode
    pages = -(-(length + steps_n) // 16)
    cache = tq.PagedKVCache.create(num_pages=batch * pages, page_size=16, num_kv_heads=2, preset="k4v4",
                                   head_dim=head_dim, num_windows=batch)
    tables = jnp.arange(batch * pages, dtype=jnp.int32).reshape(batch, pages)
    x = jnp.asarray(prompt)
    attn, cache = tq.prompt_attention(m.query(x), m.key(x), m.value(x), cache, tables, jnp.asarray(lens))
    np.testing.assert_allclose(outs[0], np.asarray(m.out(attn)), rtol=1e-6, atol=1e-6)
    seq = jnp.asarray(lens)
    wids = jnp.arange(batch, dtype=jnp.int32)
    for i in range(steps_n):
        t = jnp.asarray(steps[:, i:i + 1])
        q, k, v = m.query(t)[:, 0], m.key(t)[:, 0], m.value(t)[:, 0]
        slots = tq.slot_mapping(tables, seq, 16)
        cache = tq.write_cache(cache, k, v, slots, tq.window_slot_mapping(wids, seq, seq + 1, 64))
        seq = seq + 1
        out = m.out(tq.paged_decode(q, cache, tables, seq)[:, None])
        np.testing.assert_allclose(outs[1 + i], np.asarray(out), rtol=1e-6, atol=1e-6)

    # against exact attention: prefill is exact (float32). Decode reads the last 64 tokens as bf16
    # (2^-9 relative) and the oldest 6 (row 0: 76 tokens) / 2 (row 1) as 4-bit codes, each K / V
    # vector off by ~0.1 relative (fitted 4-bit MSE ~0.009). Random weights make the attention
    # near-uniform, so the output is ~ the mean of n values and the coded tokens' errors add up to
    # ~0.1 * sqrt(coded / n) of it: 0.028 for row 0, 0.017 for row 1. Measured over 6 seeds:
    # 0.006-0.023. Bound: twice the estimate.
    want = oracle_rows(m, prompt, lens, steps)
    for b, n in enumerate(lens):
        np.testing.assert_allclose(outs[0][b, :n], want[b][:n], rtol=2e-5, atol=2e-5)
        got = np.stack([outs[1 + i][b, 0] for i in range(steps_n)])
        ref = want[b][n:n + steps_n]
        err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert 1e-5 < err < 0.06, err


def test_jit_donation_updates_the_cache_in_place(rng):
    m = make(rng, "k4v4", heads=2, kv_heads=1, features=32, head_dim=64, page_size=8)
    m.init_cache(2, 16)
    m(jnp.asarray(rng.normal(size=(2, 4, 32)), jnp.float32), decode=False)
    before = m.cache.get_value().k_norms.unsafe_buffer_pointer()
    old = m.cache.get_value().k_norms
    decode_step(m, jnp.asarray(rng.normal(size=(2, 1, 32)), jnp.float32))
    assert old.is_deleted()  # donated
    assert m.cache.get_value().k_norms.unsafe_buffer_pointer() == before  # and reused for the result
    np.testing.assert_array_equal(np.asarray(m.lengths[...]), [5, 5])


def test_errors(rng):
    m = make(rng, heads=2, kv_heads=1, features=32, head_dim=8)
    tok = jnp.zeros((2, 1, 32), jnp.float32)
    with pytest.raises(ValueError, match="init_cache"):
        m(tok, decode=True)
    with pytest.raises(ValueError, match="in_features=32"):
        m(jnp.zeros((2, 3, 31), jnp.float32), decode=False)
    m.init_cache(2, 5)
    with pytest.raises(ValueError, match="max_length 5"):
        m(jnp.zeros((2, 6, 32), jnp.float32), decode=False)
    with pytest.raises(ValueError, match="a prompt of 6 tokens does not fit the cache's max_length 5"):
        m(jnp.zeros((2, 8, 32), jnp.float32), decode=False, lengths=jnp.asarray([6, 1], jnp.int32))
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, L=4\]"):
        m(jnp.zeros((2, 4, 32), jnp.float32), decode=False, lengths=jnp.asarray([5, 1]))
    with pytest.raises(ValueError, match="one token per cached row"):
        m(jnp.zeros((2, 2, 32), jnp.float32), decode=True)
    with pytest.raises(ValueError, match="one token per cached row"):
        m(jnp.zeros((3, 1, 32), jnp.float32), decode=True)
    m(jnp.zeros((2, 4, 32), jnp.float32), decode=False, lengths=jnp.asarray([4, 2], jnp.int32))
    m(tok, decode=True)  # row 0 now holds 5 = max_length tokens
    with pytest.raises(ValueError, match=r"full rows \[0\]"):
        m(tok, decode=True)
    with pytest.raises(Exception, match=r"full rows \[0\]"):  # under jit: the host callback's error
        jax.block_until_ready(nnx.jit(lambda mod, t: mod(t, decode=True))(m, tok))
    with pytest.raises(ValueError, match="head_dim"):  # head_dim 16: no packed format (attend alone needs none)
        PagedAttention(2, 32, 32, preset="k4v4", rngs=nnx.Rngs(0)).init_cache(2, 8)
    with pytest.raises(ValueError, match="num_kv_heads"):
        PagedAttention(4, 32, num_kv_heads=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="preset"):
        PagedAttention(4, 32, preset="k5v5", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"input shape \(batch_size, max_length, features=32\), got \(2, 4, 16\)"):
        PagedAttention(4, 32, preset="none", rngs=nnx.Rngs(0)).init_cache((2, 4, 16))
    assert PagedAttention(4, 32, preset=" K4V4 ", rngs=nnx.Rngs(0)).preset == "k4v4"  # as PagedKVCache.create
    for kwargs, exc, match in ((dict(decode="no"), TypeError, "decode must be a bool or None, got 'no'"),
                               (dict(check_capacity="yes"), TypeError, "check_capacity must be a bool, got 'yes'"),
                               (dict(normalize_qk=1.0), ValueError, "normalize_qk must be False, True")):
        with pytest.raises(exc, match=match):  # were taken as truthy
            PagedAttention(4, 32, rngs=nnx.Rngs(0), **kwargs)
    for bad in (True, 0, 257, 16.0):
        with pytest.raises(ValueError, match=rf"page_size must be an int in \[1, 256\], got {bad!r}"):
            PagedAttention(4, 32, page_size=bad, rngs=nnx.Rngs(0))
    # a NumPy int is an int (it was refused as "must be an int in [1, 256], got np.int64(8)")
    numpy_sized = PagedAttention(2, 32, num_kv_heads=1, preset="none", page_size=np.int64(8), rngs=nnx.Rngs(0))
    assert numpy_sized.page_size == 8 and type(numpy_sized.page_size) is int
    numpy_sized.init_cache(2, 20)
    assert numpy_sized.cache.get_value().page_size == 8 and numpy_sized.block_tables.shape == (2, 3)


def test_full_rows_give_nan_without_the_check(rng):
    m = make(rng, heads=2, kv_heads=1, features=32, head_dim=8, check_capacity=False)
    m.init_cache(2, 3)
    m(jnp.asarray(rng.normal(size=(2, 3, 32)), jnp.float32), decode=False, lengths=jnp.asarray([3, 1], jnp.int32))
    out = np.asarray(nnx.jit(lambda mod, t: mod(t, decode=True))(m, jnp.ones((2, 1, 32), jnp.float32)))
    assert np.all(np.isnan(out[0])) and np.all(np.isfinite(out[1]))
    np.testing.assert_array_equal(np.asarray(m.lengths[...]), [3, 2])   # the full row wrote nothing


def test_example_converts_a_decoder_with_identical_uncompressed_tokens():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "nnx_decoder_to_paged.py"
    spec = importlib.util.spec_from_file_location("nnx_decoder_to_paged", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    res = example.main(["--layers", "1", "--vocab", "32", "--prompt-len", "6", "--new-tokens", "3",
                        "--presets", "none,k4v4"])
    assert res["plain"].shape == (2, 3) and np.all((0 <= res["plain"]) & (res["plain"] < 32))
    np.testing.assert_array_equal(res["none"], res["plain"])
    assert res["k4v4"].shape == (2, 3) and 0.0 <= res["k4v4_agreement"] <= 1.0


def test_linen_wrapper_prefills_and_decodes_as_float64_attention(rng):
    """jax_tq.nn.linen_paged_attention: linen init / apply with the cache in the "cache" collection
    (prefill of padded prompts, then decode steps jitted with the cache donated) against the
    float64 oracle through the module's own parameters."""
    import types

    from jax_tq.nn import linen_paged_attention
    batch, length, steps_n, features = 2, 6, 3, 64
    attn = linen_paged_attention(4, features, qkv_features=64, num_kv_heads=2, preset="none", page_size=4,
                                 batch_size=batch, max_length=length + steps_n)
    prompt = jnp.asarray(rng.normal(size=(batch, length, features)), jnp.float32)
    steps = jnp.asarray(rng.normal(size=(batch, steps_n, features)), jnp.float32)
    lens = jnp.asarray([6, 4], jnp.int32)
    variables = attn.init(jax.random.key(int(rng.integers(1 << 30))), prompt, decode=False)
    assert (np.asarray(variables["cache"]["lengths"]) == 0).all()  # as the docstring says: prefill with apply
    params = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape) * 0.3, a.dtype) if a.ndim == 1 else a,
                          variables["params"])   # non-zero biases, so the oracle sees them
    variables = {**variables, "params": params}
    out, mutated = attn.apply(variables, prompt, decode=False, lengths=lens, mutable=["cache"])
    variables = {**variables, **mutated}
    step = jax.jit(lambda params, cache, x: attn.apply({"params": params, "cache": cache}, x, decode=True,
                                                       mutable=["cache"]), donate_argnums=1)
    outs = [np.asarray(out)]
    for i in range(steps_n):
        y, mutated = step(params, variables["cache"], steps[:, i:i + 1])
        variables = {"params": params, **mutated}
        outs.append(np.asarray(y))
    lin = {name: types.SimpleNamespace(kernel=np.asarray(params[name]["kernel"]), bias=np.asarray(params[name]["bias"]))
           for name in ("query", "key", "value", "out")}
    module = types.SimpleNamespace(**lin, soft_cap=None, sliding_window=None, sinks=None)
    for b, n in enumerate(np.asarray(lens)):
        want = attention_oracle(module, np.concatenate([np.asarray(prompt)[b, :n], np.asarray(steps)[b]]))
        np.testing.assert_allclose(outs[0][b, :n], want[:n], rtol=2e-5, atol=2e-5)
        for i in range(steps_n):
            np.testing.assert_allclose(outs[1 + i][b, 0], want[n + i], rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(variables["cache"]["lengths"]), np.asarray(lens) + steps_n)


def test_attend_over_the_callers_shared_pool_equals_float64_attention(rng):
    """PagedAttention.attend with the caller's cache: two sequences on scattered pages of one
    float32 pool, through prompt rows (padded prompts), a chunk of sequence 0 after its prompt and
    a decode step of both, with RoPE at the given positions and a soft cap, against float64."""
    m = make(rng, rope=rope_jnp, soft_cap=4.0)
    feats, page = 64, 4
    cache = tq.PagedKVCache.create(num_pages=7, page_size=page, num_kv_heads=2, preset="none", head_dim=16)
    cache = jax.tree.map(lambda a: jnp.full_like(a, jnp.nan), cache)  # poisoned: only written slots are read
    tables = jnp.asarray([[5, 1, 3], [0, 6, 2]], jnp.int32)
    seqs = [rng.normal(size=(9, feats)).astype(np.float32), rng.normal(size=(4, feats)).astype(np.float32)]
    want = [attention_oracle(m, s, rope_np) for s in seqs]

    prompts = np.zeros((2, 5, feats), np.float32)
    prompts[0], prompts[1, :3] = seqs[0][:5], seqs[1][:3]
    rows = tq.prompt_rows(cache, tables, jnp.asarray([5, 3], jnp.int32), 5)
    out, cache = m.attend(jnp.asarray(prompts.reshape(10, feats)), jnp.tile(jnp.arange(5, dtype=jnp.int32), 2),
                          cache, rows)
    np.testing.assert_allclose(np.asarray(out)[:5], want[0][:5], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(out)[5:8], want[1][:3], rtol=2e-5, atol=2e-5)

    chunk = nnx.jit(lambda mod, x, pos, c, r: mod.attend(x, pos, c, r))
    out, cache = chunk(m, jnp.asarray(seqs[0][5:8]), jnp.arange(5, 8, dtype=jnp.int32), cache,
                       tq.chunk_rows(cache, tables[0], 5, 3))
    np.testing.assert_allclose(np.asarray(out), want[0][5:8], rtol=2e-5, atol=2e-5)

    position = jnp.asarray([8, 3], jnp.int32)
    rows = tq.decode_rows(cache, tables, [8, 3], [9, 4])   # Python lists, as the other ops take them
    out, cache = m.attend(jnp.asarray(np.stack([seqs[0][8], seqs[1][3]])), position, cache, rows)
    np.testing.assert_allclose(np.asarray(out), np.stack([want[0][8], want[1][3]]), rtol=2e-5, atol=2e-5)


def test_attend_with_decode_rows_equals_the_modules_own_cache(rng):
    """The two ways to hold a k4v4 cache give the same decode step: the module's own cache, and
    attend over a copy of it with decode_rows (the same ops: equal to float32 rounding)."""
    m = make(rng, "k4v4", heads=4, kv_heads=2, features=64, head_dim=64, page_size=16)
    m.init_cache(2, 80)
    m(jnp.asarray(rng.normal(size=(2, 70, 64)), jnp.float32), decode=False, lengths=jnp.asarray([70, 66], jnp.int32))
    cache, tables = jax.tree.map(jnp.copy, m.cache.get_value()), m.block_tables[...]
    token = jnp.asarray(rng.normal(size=(2, 1, 64)), jnp.float32)
    own = np.asarray(m(token, decode=True))[:, 0]
    position = jnp.asarray([70, 66], jnp.int32)
    out, cache = m.attend(token[:, 0], position, cache, tq.decode_rows(cache, tables, position, position + 1))
    np.testing.assert_allclose(np.asarray(out), own, rtol=1e-6, atol=1e-6)
    for name in ("k_codes", "k_norms", "v_codes", "k_window", "v_window"):
        np.testing.assert_array_equal(np.asarray(getattr(cache, name)), np.asarray(getattr(m.cache.get_value(), name)))


def test_attend_and_qk_norm_errors(rng):
    m = make(rng, heads=2, kv_heads=1, features=32, head_dim=8)
    cache = tq.PagedKVCache.create(num_pages=2, page_size=4, num_kv_heads=1, preset="none", head_dim=8)
    tables = jnp.asarray([[0, 1]], jnp.int32)
    rows = tq.chunk_rows(cache, tables[0], 0, 3)
    with pytest.raises(ValueError, match=r"inputs must be \[T, in_features=32\]"):
        m.attend(jnp.zeros((3, 31)), jnp.arange(3), cache, rows)
    with pytest.raises(ValueError, match=r"positions must be \[T=3\]"):
        m.attend(jnp.zeros((3, 32)), jnp.arange(4), cache, rows)
    with pytest.raises(ValueError, match=r"len\(rows.slots\) = 3 rows, got 2"):
        m.attend(jnp.zeros((2, 32)), jnp.arange(2), cache, rows)
    with pytest.raises(TypeError, match="positions must be integers"):
        m.attend(jnp.zeros((3, 32)), jnp.arange(3.0), cache, rows)
    with pytest.raises(TypeError, match="rows must be a jax_tq.CacheRows"):
        m.attend(jnp.zeros((3, 32)), jnp.arange(3), cache, None)
    with pytest.raises(TypeError, match="cache must be a jax_tq.PagedKVCache"):
        m.attend(jnp.zeros((3, 32)), jnp.arange(3), None, rows)
    other = tq.PagedKVCache.create(num_pages=2, page_size=8, num_kv_heads=1, preset="none", head_dim=8)
    with pytest.raises(ValueError, match="built for page_size 4, the cache's is 8"):
        m.attend(jnp.zeros((3, 32)), jnp.arange(3), other, rows)
    with pytest.raises(ValueError, match=r"positions 6..8 run past the block table's 8 tokens"):
        tq.chunk_rows(cache, tables[0], 6, 3)  # rows 6, 7 would see a clamped length: shifted positions
    with pytest.raises(ValueError, match="num_tokens must be >= 1"):
        tq.chunk_rows(cache, tables[0], 0, 0)
    with pytest.raises(TypeError, match="start must be a Python int"):
        jax.jit(lambda s: tq.chunk_rows(cache, tables[0], s, 2))(1)
    with pytest.raises(ValueError, match=r"prompt_lens must lie in \[0, prompt_len=3\]"):
        tq.prompt_rows(cache, tables, jnp.asarray([4], jnp.int32), 3)
    with pytest.raises(ValueError, match="normalize_qk"):
        PagedAttention(2, 32, normalize_qk="batch", preset="none", rngs=nnx.Rngs(0))
    rms = PagedAttention(2, 32, normalize_qk="rms", qk_norm_epsilon=1e-5, out_bias=False, preset="none",
                         rngs=nnx.Rngs(0))
    assert isinstance(rms.query_ln, nnx.RMSNorm) and rms.query_ln.epsilon == 1e-5
    assert rms.out.bias is None and rms.query.bias is not None


def test_prefill_padded_past_max_length_where_the_prompts_fit(rng):
    """A batch padded to 8 tokens into a cache of max_length 5, real prompts of 5 and 3 tokens:
    the same outputs, cache and lengths as the batch cut to 5, and decode goes on from there."""
    m = make(rng, heads=2, kv_heads=1, features=32, head_dim=8)
    prompt = jnp.asarray(rng.normal(size=(2, 8, 32)), jnp.float32)
    lens = jnp.asarray([5, 3], jnp.int32)
    results = []
    for x in (prompt, prompt[:, :5]):
        m.init_cache(2, 6)
        out = np.asarray(m(x, decode=False, lengths=lens))
        results.append((out[:, :5], np.asarray(m.lengths[...]), jax.tree.leaves(m.cache.get_value())))
    np.testing.assert_allclose(results[0][0][0], results[1][0][0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(results[0][0][1, :3], results[1][0][1, :3], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(results[0][1], [5, 3])
    for a, b in zip(results[0][2], results[1][2]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
