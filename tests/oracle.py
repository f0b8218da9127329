"""Float64 oracles built on jax_tq.reference (run under x64), random cache builders, and small helpers
the op test files share."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import jax_tq as tq
from jax_tq import _compat, codebook, reference
from jax_tq.format import paged_tokens, unpack_codes


def to_f64(x):
    return np.asarray(x, dtype=np.float64)


def decode_f64(q, cache, block_tables, seq_lens, scale=None):
    """paged_decode in float64: rotate q, reference attention over the codes, rotate back."""
    k, v = cache.k_codec, cache.v_codec
    scale = 1.0 / np.sqrt(k.head_dim) if scale is None else scale
    with _compat.enable_x64():
        q_rot = to_f64(q) @ to_f64(k.rotation).T
        out_rot = reference.paged_decode_rotated(
            jnp.asarray(q_rot), cache.k_codes, jnp.asarray(to_f64(cache.k_norms)), cache.v_codes,
            jnp.asarray(to_f64(cache.v_norms)), jnp.asarray(to_f64(k.centroids)), jnp.asarray(to_f64(v.centroids)),
            jnp.asarray(block_tables), jnp.asarray(seq_lens), k.bits, v.bits, scale,
        )
        return np.asarray(out_rot) @ to_f64(v.rotation)


def compress_f64(x, codec):
    with _compat.enable_x64():
        codes, norms = reference.compress(jnp.asarray(to_f64(x)), jnp.asarray(to_f64(codec.rotation)),
                                          jnp.asarray(to_f64(codec.centroids)), codec.bits)
        return np.asarray(codes), np.asarray(norms)


def decompress_f64(codes, norms, codec):
    with _compat.enable_x64():
        return np.asarray(reference.decompress(jnp.asarray(codes), jnp.asarray(to_f64(norms)),
                                               jnp.asarray(to_f64(codec.rotation)), jnp.asarray(to_f64(codec.centroids)),
                                               codec.bits, jnp.float64))


def random_cache(rng, *, num_pages, page_size, num_kv_heads, head_dim, k_bits, v_bits, seed=0, rotation="haar"):
    """A cache whose every slot holds random codes and positive random norms (no zeros)."""
    k_codec = tq.TurboQuant(head_dim=head_dim, bits=k_bits, seed=seed, rotation=rotation)
    v_codec = tq.TurboQuant(head_dim=head_dim, bits=v_bits, seed=seed + 1, rotation=rotation)
    cache = tq.PagedKVCache.create(num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv_heads,
                                   k_codec=k_codec, v_codec=v_codec)
    def codes(shape):
        return jnp.asarray(rng.integers(0, 256, size=shape, dtype=np.uint8))
    def norms(shape):
        return jnp.asarray(rng.uniform(0.5, 2.0, size=shape).astype(np.float32))
    return dataclasses.replace(cache, k_codes=codes(cache.k_codes.shape), k_norms=norms(cache.k_norms.shape),
                               v_codes=codes(cache.v_codes.shape), v_norms=norms(cache.v_norms.shape))


def random_tables(rng, seq_lens, page_size, num_pages, max_pages=None):
    """Block tables mapping each sequence to distinct random pages, no page shared by two sequences
    where the pool has room (as an allocator gives them: two sequences writing one slot would leave
    which token stays to the device's scatter order); unused entries hold garbage ids."""
    needed = [-(-int(n) // page_size) for n in seq_lens]
    max_pages = max_pages or max(1, max(needed))
    tables = rng.integers(-5, num_pages + 5, size=(len(seq_lens), max_pages)).astype(np.int32)
    disjoint = sum(needed) <= num_pages
    pages, used = rng.permutation(num_pages), 0
    for i, n in enumerate(needed):
        tables[i, :n] = pages[used:used + n] if disjoint else rng.choice(num_pages, size=n, replace=False)
        used += n
    return jnp.asarray(tables)


def close_centroids(codec):
    """The codec's Lloyd-Max centroids with two moved next to their lower neighbour (1e-3 apart):
    boundaries closer than any codebook of the library has (monkeypatched in as the codecs'
    centroids, they send the CUDA writes to their search paths)."""
    c = codebook.lloyd_max_centroids(codec.head_dim, codec.bits).astype(np.float64)
    mid = len(c) // 2
    c[mid], c[mid + 1] = c[mid - 1] + 1e-3, c[mid - 1] + 2e-3
    return jnp.asarray(c, jnp.float32)


def rel_err(got, want):
    got, want = to_f64(got), to_f64(want)
    assert np.all(np.isfinite(got)), "non-finite output"
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def primitive_count(jaxpr, prim):
    """Occurrences of ``prim`` in ``jaxpr`` and the jaxprs nested in it (custom_jvp/vjp, pjit, ...)."""
    from jax.extend.core import jaxprs_in_params

    total = 0
    for eqn in jaxpr.eqns:
        total += eqn.primitive is prim
        total += sum(primitive_count(getattr(sub, "jaxpr", sub), prim) for sub in jaxprs_in_params(eqn.params))
    return total


def on_cpu(fn, *args, **kwargs):
    """Run fn with every array argument (pytrees included) on the CPU: the CPU kernel / oracle."""
    cpu = jax.devices("cpu")[0]
    def to_cpu(a):
        return jax.device_put(a, cpu) if isinstance(a, (jax.Array, np.ndarray)) else a
    with jax.default_device(cpu):
        return fn(*jax.tree_util.tree_map(to_cpu, args), **kwargs)


def codes_agree(got, want, bits, head_dim, x=None, codec=None, tie_tol=1e-4):
    """The codes agree except at boundary ties: codes differ by at most one level and, with the
    inputs x [n, head_dim] and their codec, only where the float64 rotated coordinate lies within
    tie_tol (unit-sphere scale; the kernels' products are ~1e-5 accurate) of the boundary between
    the two levels. Without x, at most 0.1% of the codes may differ."""
    g = unpack_codes(np.asarray(got), bits, head_dim).astype(int).reshape(-1, head_dim)
    w = unpack_codes(np.asarray(want), bits, head_dim).astype(int).reshape(-1, head_dim)
    assert np.all(np.abs(g - w) <= 1), "a code differs by more than one level (not a boundary tie)"
    differ = g != w
    if x is None:
        assert np.mean(~differ) >= 0.999, f"only {np.mean(~differ):.5f} of the codes agree"
        return
    x = np.asarray(x, np.float64).reshape(-1, head_dim)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    y = x @ np.asarray(codec.rotation, np.float64).T / np.where(norms > 0, norms, 1.0)
    cent = np.asarray(codec.centroids, np.float64)
    boundaries = (cent[1:] + cent[:-1]) / 2
    gap = np.abs(y[differ] - boundaries[np.minimum(g, w)[differ]])
    assert np.all(gap <= tie_tol), f"{int(np.sum(gap > tie_tol))} codes differ away from a boundary (max gap {gap.max():.2e})"


def jaxpr_count(fn, prim, *args):
    """Equations of ``prim`` in fn's jaxpr, nested ones included (custom_jvp calls, pjit, ...)."""
    return primitive_count(jax.make_jaxpr(fn)(*args).jaxpr, prim)


def small_cache(num_kv_heads=2, head_dim=64, k_bits=4, v_bits=3):
    """An empty cache of 3 pages of 8 tokens, for argument checks."""
    return tq.PagedKVCache.create(num_pages=3, page_size=8, num_kv_heads=num_kv_heads,
                                  k_codec=tq.TurboQuant(head_dim, bits=k_bits, seed=0),
                                  v_codec=tq.TurboQuant(head_dim, bits=v_bits, seed=1))


def decode_args(num_seqs=2, num_heads=4, head_dim=64, q_dtype=jnp.float32):
    """Zero q, block tables and seq_lens of 5 for small_cache."""
    q = jnp.zeros((num_seqs, num_heads, head_dim), q_dtype)
    return q, jnp.zeros((num_seqs, 3), jnp.int32), jnp.full((num_seqs,), 5, jnp.int32)


def decode_setup(rng, num_seqs=4, lens=(37, 5, 0, 64)):
    """A random cache of 16 pages of 16 tokens with tables and seq_lens for ``num_seqs`` sequences."""
    cache = random_cache(rng, num_pages=16, page_size=16, num_kv_heads=2, head_dim=64, k_bits=4, v_bits=3)
    seq_lens = jnp.asarray(lens[:num_seqs], jnp.int32)
    tables = random_tables(rng, np.asarray(seq_lens), 16, 16, max_pages=5)
    return cache, tables, seq_lens


def random_window_cache(rng, *, head_dim=64, num_kv_heads=2, page_size=8, num_pages=24, window=5, num_windows=3,
               k_bits=4, v_bits=3, rotation="hadamard", seed=None):
    """A cache whose pages and window rows hold random values (nothing zero by accident)."""
    seed = int(rng.integers(100)) if seed is None else seed
    k_codec = tq.TurboQuant(head_dim, k_bits, seed, rotation, "fit")
    v_codec = tq.TurboQuant(head_dim, v_bits, seed + 1, rotation, "fit")
    cache = tq.PagedKVCache.create(num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv_heads,
                                   k_codec=k_codec, v_codec=v_codec, window=window, num_windows=num_windows)

    def rows(shape):
        return jnp.asarray(rng.normal(size=shape) * 2, jnp.bfloat16)

    return dataclasses.replace(
        cache, k_codes=jnp.asarray(rng.integers(0, 256, cache.k_codes.shape, dtype=np.uint8)),
        v_codes=jnp.asarray(rng.integers(0, 256, cache.v_codes.shape, dtype=np.uint8)),
        k_norms=jnp.asarray(rng.uniform(0.5, 2, cache.k_norms.shape), jnp.float32),
        v_norms=jnp.asarray(rng.uniform(0.5, 2, cache.v_norms.shape), jnp.float32),
        k_window=rows(cache.k_window.shape), v_window=rows(cache.v_window.shape))


def sequence_tokens(cache, table, length, window_id):
    """float64 K and V [L, Hkv, d] of one sequence as the window format says it reads them: pages
    for positions < paged_tokens, the window's rows (rotated back) after; (K, V, valid [L])."""
    d, page_size = cache.head_dim, cache.page_size
    capacity = len(table) * page_size
    length = int(np.clip(length, 0, capacity))
    first_window = int(paged_tokens(np.asarray(length), capacity, cache.window))
    keys, values, valid = [], [], []
    for p in range(length):
        if p < first_window:
            page = int(table[p // page_size])
            ok = 0 <= page < cache.num_pages
            page = page if ok else 0
            k = decompress_f64(np.asarray(cache.k_codes[page, :, p % page_size]),
                               np.asarray(cache.k_norms[page, :, p % page_size]), cache.k_codec)
            v = decompress_f64(np.asarray(cache.v_codes[page, :, p % page_size]),
                               np.asarray(cache.v_norms[page, :, p % page_size]), cache.v_codec)
        else:
            ok = 0 <= window_id < cache.num_windows
            w = window_id if ok else 0
            k = np.asarray(cache.k_window[w, :, p % cache.window], np.float64) @ np.asarray(cache.k_codec.rotation, np.float64)
            v = np.asarray(cache.v_window[w, :, p % cache.window], np.float64) @ np.asarray(cache.v_codec.rotation, np.float64)
        keys.append(k)
        values.append(v)
        valid.append(ok)
    empty = np.zeros((0, cache.num_kv_heads, d))
    return (np.stack(keys) if keys else empty), (np.stack(values) if values else empty), np.asarray(valid, bool)


def attend_f64(q, keys, values, valid, scale):
    """q [H, d] over keys / values [L, Hkv, d] (valid [L]) in float64; GQA h -> h // group."""
    heads, d = q.shape
    group = heads // keys.shape[1] if keys.shape[0] else 1
    out = np.zeros((heads, d))
    for h in range(heads):
        if not valid.any():
            continue
        s = keys[valid, h // group] @ np.asarray(q[h], np.float64) * scale
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ values[valid, h // group]
    return out


def exact_attend(q, k, v, q_lens, kv_lens, *, scale: float, causal: bool, q_offsets, kv_offsets):
    """Attention of segments with its log-sum-exp, the contract of
    ``jax_tq._compat.cudnn_attention_with_lse`` (q [B, T, N, H], k / v [B, S, K, H]; q_offsets /
    kv_offsets int32 [B, M + 1] segment starts and q_lens / kv_lens [B, M], -1 where a segment is
    absent) computed by XLA in promote(q.dtype, float32): the CPU tests' stand-in for cuDNN in
    ``jax_tq.paged_prefill_dense``. Segment m's rows see its keys (causal: key j <= row i, both
    counted from the segment's start). A row that sees no key gets lse -inf (its output is
    unspecified); rows in no segment get NaN (cuDNN leaves them unspecified)."""
    assert q_offsets.shape[1] >= 3, "JAX reads one segment as no packing"
    batch, rows, num_heads, head_dim = q.shape
    keys, num_kv_heads = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    dtype = jnp.promote_types(q.dtype, jnp.float32)
    qg = q.astype(dtype).reshape(batch, rows, num_kv_heads, group, head_dim)
    scores = jnp.einsum("btkgh,bskh->bkgts", qg, k.astype(dtype), precision=jax.lax.Precision.HIGHEST) * scale
    t = jnp.arange(rows)[None, :, None]                  # [1, T, 1] against segments [B, 1, M]
    s = jnp.arange(keys)[None, :, None]
    present = (q_offsets[:, :-1] >= 0) & (q_lens >= 0)
    row_in = present[:, None, :] & (t >= q_offsets[:, None, :-1]) & (t < (q_offsets[:, :-1] + q_lens)[:, None, :])
    key_in = present[:, None, :] & (s >= kv_offsets[:, None, :-1]) & (s < (kv_offsets[:, :-1] + kv_lens)[:, None, :])
    mask = jnp.einsum("btm,bsm->bts", row_in.astype(jnp.int32), key_in.astype(jnp.int32)) > 0
    if causal:
        row_pos = jnp.sum(jnp.where(row_in, t - q_offsets[:, None, :-1], 0), axis=-1)        # [B, T]
        key_pos = jnp.sum(jnp.where(key_in, s - kv_offsets[:, None, :-1], 0), axis=-1)      # [B, S]
        mask = mask & (key_pos[:, None, :] <= row_pos[:, :, None])
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    weights = jnp.exp(scores - peak)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    out = jnp.einsum("bkgts,bskh->btkgh", weights / jnp.maximum(total, 1e-30), v.astype(dtype),
                     precision=jax.lax.Precision.HIGHEST)
    lse = (peak + jnp.log(total))[..., 0]                                            # [B, K, G, T]
    in_none = ~jnp.any(row_in, axis=-1)                                              # [B, T]
    out = jnp.where(in_none[..., None, None], jnp.nan, out.reshape(batch, rows, num_heads, head_dim))
    lse = jnp.transpose(lse, (0, 3, 1, 2)).reshape(batch, rows, num_heads)
    return out.astype(q.dtype), jnp.where(in_none[..., None], jnp.nan, lse)
