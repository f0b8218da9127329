"""Evaluation of a Llama model with and without a TurboQuant-compressed paged KV cache.

* :func:`token_log_likelihoods` - per-token next-token log-likelihoods of one token sequence,
  uncompressed (plain causal attention) or through the compressed cache (each position attends to
  the compressed K/V of itself and all earlier positions, as in decoding).
* :func:`wikitext_perplexity` - the WikiText-2 protocol used by ``examples/smollm2_wikitext.py``:
  tokenize the raw text WITHOUT BOS, cut ``num_chunks`` consecutive ``chunk_len``-token chunks
  from its start, score every next token of each chunk (``chunk_len - 1`` predictions per chunk),
  perplexity = ``exp(mean NLL)`` over all predictions. WikiText-2: Merity et al. 2016,
  "Pointer Sentinel Mixture Models" (CC BY-SA 3.0).
* :func:`kv_bytes_per_token`, :func:`compression_ratio_vs_bf16` - KV memory accounting.
* :func:`check_decode_matches_eval` - the jitted decode step reproduces the evaluation path.
* :func:`greedy_generate` - batched greedy decoding with timings, through a compressed paged cache
  or an uncompressed bf16 one (the decode-speed baseline), with the same decode step and loop.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jax_tq.cache import MAX_PAGE_SIZE, PRESETS, CachePreset, get_preset
from jax_tq.format import MAX_WINDOW, PACKED_BITS, SCALE_KINDS, check_bits
from jax_tq.sharding import shard_cache

from .checks import check_token_ids, token_vector
from .config import LlamaConfig
from .llama import Llama, forward_compressed, forward_logits, make_decode_loop, make_decode_step, make_prefill
from .paging import init_caches, layer_indices

__all__ = [
    "CacheConfig",
    "parse_cache_config",
    "token_log_likelihoods",
    "chunk_token_ids",
    "wikitext_perplexity",
    "kv_bytes_per_token",
    "compression_ratio_vs_bf16",
    "check_decode_matches_eval",
    "compare_caches",
    "config_caches",
    "greedy_generate",
    "window_bytes_per_sequence",
]


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Compressed KV cache settings.

    Attributes:
      k_bits, v_bits: TurboQuant bits per coordinate for K and V (2, 3 or 4).
      page_size: tokens per cache page.
      seed: codec seed (K uses ``seed``, V ``seed + 1``).
      rotation: codec rotation, ``"haar"`` or ``"hadamard"`` (:class:`jax_tq.TurboQuant`).
      scale: the codecs' per-vector scale, ``"norm"`` (TurboQuant_mse) or ``"fit"``.
      window: recent tokens of each sequence kept exactly (0: none; at most 256).
      exact_layers: layers whose caches stay uncompressed (float32 pages; negative indices count
        from the end): :func:`jax_tq.models.init_caches`'s ``exact_layers``.

    Raises:
      ValueError: bits not 2, 3 or 4, page_size not an int in [1, 256], seed not an int >= 0, an
        unknown rotation or scale, a window outside [0, 256], or exact_layers not a tuple of ints
        (at construction).
    """

    k_bits: int = 4
    v_bits: int = 4
    page_size: int = 16
    seed: int = 0
    rotation: str = "haar"
    scale: str = "norm"
    window: int = 0
    exact_layers: tuple = ()

    @classmethod
    def from_preset(cls, preset, page_size: int = 16, seed: int = 0) -> "CacheConfig":
        """The config of a :data:`jax_tq.PRESETS` entry (a name such as ``"k4v4"`` or a
        :class:`jax_tq.CachePreset`).

        Raises:
          ValueError / TypeError: an unknown preset (from :func:`jax_tq.get_preset`).
          ValueError: page_size or seed as :class:`CacheConfig` refuses them.
        """
        p = get_preset(preset)
        return cls(p.k_bits, p.v_bits, page_size, seed, p.rotation, p.scale, p.window)

    def with_run(self, page_size: int, seed: int, rotation: str | None = None) -> "CacheConfig":
        """This config with another page size, seed and (unless None) rotation. ValueError: those
        :class:`CacheConfig` refuses (a page_size outside [1, 256], a negative seed, an unknown
        rotation)."""
        return dataclasses.replace(self, page_size=page_size, seed=seed, rotation=rotation or self.rotation)

    @property
    def name(self) -> str:
        """The preset's name where the settings are a preset's (``"k4v4"``), else ``"K4V2"``-style,
        with ``fit`` / ``W64`` / ``hadamard`` where they differ from the plain codec."""
        exact = "@" + ":".join(str(i) for i in self.exact_layers) if self.exact_layers else ""
        for name, p in PRESETS.items():
            if (p.k_bits, p.v_bits, p.scale, p.window, p.rotation) == (
                    self.k_bits, self.v_bits, self.scale, self.window, self.rotation):
                return name + exact
        extra = [self.scale] if self.scale != "norm" else []
        extra += [f"W{self.window}"] if self.window else []
        extra += [self.rotation] if self.rotation != "haar" else []
        return f"K{self.k_bits}V{self.v_bits}{exact}" + (f" ({', '.join(extra)})" if extra else "")

    def __post_init__(self):
        for name in ("k_bits", "v_bits"):
            if not _is_int(getattr(self, name)) or getattr(self, name) not in PACKED_BITS:
                raise ValueError(f"CacheConfig: {name} must be one of {PACKED_BITS}, got {getattr(self, name)!r}")
        if not _is_int(self.page_size) or not 1 <= self.page_size <= MAX_PAGE_SIZE:
            raise ValueError(f"CacheConfig: page_size must be an int in [1, {MAX_PAGE_SIZE}], got {self.page_size!r}")
        if not _is_int(self.seed) or self.seed < 0:
            raise ValueError(f"CacheConfig: seed must be an int >= 0, got {self.seed!r}")
        if self.rotation not in ("haar", "hadamard"):
            raise ValueError(f"CacheConfig: rotation must be 'haar' or 'hadamard', got {self.rotation!r}")
        if self.scale not in SCALE_KINDS:
            raise ValueError(f"CacheConfig: scale must be one of {SCALE_KINDS}, got {self.scale!r}")
        if not _is_int(self.window) or not 0 <= self.window <= MAX_WINDOW:
            raise ValueError(f"CacheConfig: window must be an int in [0, {MAX_WINDOW}], got {self.window!r}")
        if not isinstance(self.exact_layers, tuple) or not all(_is_int(i) for i in self.exact_layers):
            raise ValueError(f"CacheConfig: exact_layers must be a tuple of layer indices (ints), got "
                             f"{self.exact_layers!r}")


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_counts(num_chunks, chunk_len, where: str) -> None:
    """TypeError unless ``num_chunks`` and ``chunk_len`` are ints (not bools or floats)."""
    for name, value in (("num_chunks", num_chunks), ("chunk_len", chunk_len)):
        if not _is_int(value):
            raise TypeError(f"{where}: {name} must be an int, got {value!r}")


#: "4:2", "k4v2", "k4:v2", "k4 v2" (lower-cased): K bits first, then V bits, ASCII digits only.
_CACHE_SPEC = re.compile(r"(?:k\s*)?([0-9]+)\s*(?::\s*v?|v|\s+v?)\s*([0-9]+)", re.ASCII)


def parse_cache_config(spec) -> CacheConfig | None:
    """Normalise a cache spec: None / "none" -> None (uncompressed); a preset name (``"k4v4"``,
    ``"k3v3"``, ``"k2v2"``: :data:`jax_tq.PRESETS`) -> that preset; ``(k, v)`` or "k:v" or a
    :class:`CacheConfig` -> :class:`CacheConfig` (the plain TurboQuant codec for tuples / strings).
    A string may end in ``@i:j:...``: those layers' caches stay uncompressed (``"k2v2@0:-1"``:
    the first and last layers; :class:`CacheConfig`'s ``exact_layers``).

    Args:
      spec: None, a :class:`CacheConfig` or :class:`jax_tq.CachePreset`, a 2-tuple / list
        ``(k_bits, v_bits)`` or a string (``"none"``, ``"fp32"``, ``"uncompressed"``, ``""``, a
        preset name, ``"4:2"``, ``"k4v2"``, ``"K4V2"``, ``"k4:v2"``: K first, then V; ASCII digits,
        case and spaces around the parts ignored). A preset's name wins over the K/V reading
        (``"k4v4"`` is the preset, ``"4:4"`` the plain 4-bit codec).
    Returns:
      a :class:`CacheConfig` (default page size and seed for tuples / strings), or None.
    Raises:
      ValueError: unparseable spec, or bits not 2, 3 or 4 (from :class:`CacheConfig`).
    """
    if spec is None or isinstance(spec, CacheConfig):
        return spec
    if isinstance(spec, CachePreset):
        return CacheConfig.from_preset(spec)
    if isinstance(spec, str):
        s = spec.strip().lower()
        if "@" in s:
            base, layers = s.split("@", 1)
            cfg = parse_cache_config(base)
            parts = layers.split(":")
            if not all(re.fullmatch(r"-?[0-9]+", part.strip(), re.ASCII) for part in parts):
                raise ValueError(f"cannot parse the exact layers of cache spec {spec!r}; use e.g. 'k2v2@0:-1'")
            exact = tuple(int(part) for part in parts)
            if cfg is None:
                raise ValueError(f"cache spec {spec!r}: exact layers of an uncompressed cache")
            return dataclasses.replace(cfg, exact_layers=exact)
        if s in ("none", "fp32", "uncompressed", ""):
            return None
        if s in PRESETS:
            return CacheConfig.from_preset(s)
        match = _CACHE_SPEC.fullmatch(s)
        if match is None:
            raise ValueError(f"cannot parse cache spec {spec!r}; use 'none' or 'K:V' (K first), e.g. '4:2' or 'K4V2'")
        return CacheConfig(int(match.group(1)), int(match.group(2)))
    if isinstance(spec, (tuple, list)) and len(spec) == 2:
        return CacheConfig(*spec)
    raise ValueError(f"cannot interpret cache spec {spec!r}")


@jax.jit
def _next_token_ll(logits, token_ids):
    lp = jax.nn.log_softmax(logits[:-1].astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(lp, token_ids[1:, None], axis=-1)[:, 0]


def compressed_logits(model: Llama, token_ids, cache_config: CacheConfig) -> jax.Array:
    """Logits ``[T, vocab]`` of ``token_ids [T]`` through a fresh compressed paged cache.

    The sequence gets ``ceil(T / page_size)`` pages laid out in REVERSED physical order (to
    exercise the block table); all positions are evaluated in one :func:`jax_tq.models.forward_compressed`
    call (one :func:`jax_tq.paged_prefill` per layer).

    Args:
      model: :class:`jax_tq.models.Llama`.
      token_ids: int ``[T]``.
      cache_config: :class:`CacheConfig`.
    Returns:
      float32 logits ``[T, vocab]``.
    Raises:
      TypeError / ValueError: propagated from :func:`jax_tq.models.init_caches` (unsupported
        bits or page size) and the jax_tq ops.
    """
    T = int(np.asarray(token_ids).shape[0])
    n_pages = -(-T // cache_config.page_size)
    caches = config_caches(model.config, cache_config, num_pages=n_pages)
    block_table = np.arange(n_pages, dtype=np.int32)[::-1].copy()
    logits, _ = forward_compressed(model, token_ids, caches, block_table)
    return logits


def config_caches(config: LlamaConfig, cache_config: CacheConfig, num_pages: int, num_windows: int = 1):
    """:func:`jax_tq.models.init_caches` of a :class:`CacheConfig` (``num_windows`` window ids when
    it keeps a window).

    Raises:
      TypeError / ValueError: as :func:`jax_tq.models.init_caches`.
    """
    c = cache_config
    return init_caches(config, c.k_bits, c.v_bits, num_pages, c.page_size, c.seed, c.rotation, scale=c.scale,
                       window=c.window, num_windows=num_windows, exact_layers=c.exact_layers)


def token_log_likelihoods(model: Llama, token_ids, cache_config=None) -> np.ndarray:
    """Natural-log likelihoods of each next token of one sequence.

    Args:
      model: :class:`jax_tq.models.Llama`.
      token_ids: int ``[T]`` (T >= 2).
      cache_config: None for uncompressed causal attention, else a :class:`CacheConfig`,
        ``(k_bits, v_bits)`` or ``"k:v"``: every position attends to the TurboQuant-compressed
        K/V of itself and all earlier positions.
    Returns:
      float64 ``[T - 1]``: ``log p(token[t + 1] | token[:t + 1])``.
    Raises:
      TypeError: token_ids not integers.
      ValueError: fewer than 2 tokens, a token id outside ``[0, vocab_size)``, or an unparseable
        ``cache_config`` (bits not 2, 3 or 4).
    """
    raw = np.asarray(token_ids)
    if raw.ndim != 1 or raw.shape[0] < 2:
        raise ValueError(f"token_ids must be 1-D with >= 2 tokens, got shape {raw.shape}")
    check_token_ids(raw, model.config.vocab_size, "token_log_likelihoods")
    ids = jnp.asarray(raw, jnp.int32)
    cfg = parse_cache_config(cache_config)
    logits = forward_logits(model, ids) if cfg is None else compressed_logits(model, ids, cfg)
    return np.asarray(_next_token_ll(logits, ids), dtype=np.float64)


@jax.jit
def _chunk_scores(logits, base_log_probs, token_ids):
    """(next-token NLL [T-1], KL(base || these logits) [T-1]) of one chunk, in float32."""
    log_probs = jax.nn.log_softmax(logits[:-1].astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(log_probs, token_ids[1:, None], axis=-1)[:, 0]
    kl = jnp.sum(jnp.exp(base_log_probs) * (base_log_probs - log_probs), axis=-1)
    return nll, kl


def compare_caches(model: Llama, chunks, configs: Sequence, progress: Callable[[Iterable], Iterable] | None = None):
    """Perplexity and KL divergence from the uncompressed model of several KV caches on the same chunks.

    Each chunk is scored from an empty cache, every next token (``chunk_len - 1`` predictions per
    chunk), as :func:`token_log_likelihoods`; the uncompressed model's next-token distributions are
    computed once per chunk.

    Args:
      model: :class:`jax_tq.models.Llama`.
      chunks: int ``[num_chunks, chunk_len]`` token ids (:func:`chunk_token_ids`).
      configs: cache specs (:func:`parse_cache_config`; None / ``"none"`` is the uncompressed model).
      progress: optional wrapper over the (chunk, config) iterator (e.g. ``tqdm.tqdm``).
    Returns:
      list of dicts, one per config in order: ``config`` (the parsed :class:`CacheConfig` or None),
      ``ppl`` (exp of the mean NLL, nats), ``kl`` (mean KL(uncompressed || cache) per prediction,
      nats; 0 for the uncompressed model), ``seconds`` (evaluation time).
    Raises:
      ValueError: an unparseable config, chunks not ``[num_chunks, chunk_len >= 2]`` or token ids
        outside the vocabulary.
    Source: KL over the full next-token distribution, as llama.cpp's ``llama-perplexity
      --kl-divergence`` reports it.
    """
    chunks = np.asarray(chunks)
    if chunks.ndim != 2 or chunks.shape[1] < 2:
        raise ValueError(f"compare_caches: chunks must be [num_chunks, chunk_len >= 2], got shape {chunks.shape}")
    check_token_ids(chunks, model.config.vocab_size, "compare_caches")
    parsed = [parse_cache_config(c) for c in configs]
    sums = [dict(config=c, nll=0.0, kl=0.0, n=0, seconds=0.0) for c in parsed]
    work = [(i, j) for i in range(len(chunks)) for j in range(len(parsed))]
    base = None
    for i, j in (progress(work) if progress is not None else work):
        ids = jnp.asarray(chunks[i], jnp.int32)
        if j == 0:
            base = jax.nn.log_softmax(forward_logits(model, ids)[:-1].astype(jnp.float32), axis=-1)
        t0 = time.perf_counter()
        cfg = parsed[j]
        logits = forward_logits(model, ids) if cfg is None else compressed_logits(model, ids, cfg)
        nll, kl = (np.asarray(a, np.float64) for a in _chunk_scores(logits, base, ids))
        entry = sums[j]
        entry["nll"] += nll.sum()
        entry["kl"] += 0.0 if cfg is None else kl.sum()
        entry["n"] += nll.size
        entry["seconds"] += time.perf_counter() - t0
    return [dict(config=e["config"], ppl=math.exp(e["nll"] / e["n"]), kl=e["kl"] / e["n"], seconds=e["seconds"])
            for e in sums]


def chunk_token_ids(tokenizer, text: str, num_chunks: int = 4, chunk_len: int = 512) -> np.ndarray:
    """Tokenize ``text`` without BOS and cut consecutive chunks from its start.

    Args:
      tokenizer: a ``tokenizers.Tokenizer`` (e.g. from :func:`jax_tq.models.load_smollm2`).
      text: raw text.
      num_chunks, chunk_len: number and length (tokens) of chunks.
    Returns:
      int32 ``[num_chunks, chunk_len]``.
    Raises:
      TypeError: ``num_chunks`` or ``chunk_len`` not an int.
      ValueError: ``num_chunks < 1`` or ``chunk_len < 2``; the text has fewer than
        ``num_chunks * chunk_len`` tokens.
    """
    _check_counts(num_chunks, chunk_len, "chunk_token_ids")
    if num_chunks < 1 or chunk_len < 2:
        raise ValueError(f"num_chunks must be >= 1 and chunk_len >= 2, got {num_chunks} and {chunk_len}")
    need = num_chunks * chunk_len
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if len(ids) < need:
        raise ValueError(f"text has {len(ids)} tokens, need {need} "
                         f"({num_chunks} chunks x {chunk_len})")
    return np.asarray(ids[:need], np.int32).reshape(num_chunks, chunk_len)


def wikitext_perplexity(model: Llama, tokenizer, text: str, num_chunks: int = 4,
                        chunk_len: int = 512, kv_bits=None,
                        progress: Callable[[Iterable], Iterable] | None = None) -> float:
    """Perplexity on raw text with the chunked protocol described in the module docstring.

    Args:
      model, tokenizer: from :func:`jax_tq.models.load_smollm2`.
      text: raw WikiText-2 test split.
      num_chunks, chunk_len: number and length (tokens) of chunks.
      kv_bits: None (uncompressed) or ``(k_bits, v_bits)`` / ``"k:v"`` / :class:`CacheConfig`.
      progress: optional wrapper over the chunk iterator (e.g. ``tqdm.tqdm``).
    Returns:
      ``exp(mean negative log-likelihood)`` over ``num_chunks * (chunk_len - 1)`` predictions.
    Raises:
      TypeError: ``num_chunks`` or ``chunk_len`` not an int.
      ValueError: ``num_chunks < 1``, ``chunk_len < 2`` or too few tokens in ``text`` (see
        :func:`chunk_token_ids`), or an unparseable ``kv_bits``.
    """
    chunks = chunk_token_ids(tokenizer, text, num_chunks, chunk_len)
    it = progress(chunks) if progress is not None else chunks
    lls = [token_log_likelihoods(model, c, kv_bits) for c in it]
    return float(math.exp(-np.mean(np.concatenate(lls))))


def kv_bytes_per_token(config: LlamaConfig, k_bits: int | None, v_bits: int | None,
                       exact_layers: Sequence[int] = ()) -> float:
    """KV-cache bytes per token over all layers and KV heads.

    Compressed (TurboQuant): ``head_dim * bits / 8`` bytes of packed codes plus a 4-byte float32
    norm per head vector, for K and for V. Uncompressed (``k_bits is None``, and the layers of
    ``exact_layers``): bfloat16, 2 bytes per element for K and V.

    Args:
      config: model config (``num_layers``, ``num_kv_heads``, ``head_dim``).
      k_bits, v_bits: bits per coordinate, or None (either None: uncompressed bfloat16).
      exact_layers: layers kept uncompressed (:class:`CacheConfig`; negative indices from the end).
    Returns:
      bytes per token (float).
    Raises:
      TypeError / ValueError: a bit width other than an int 2, 3, 4 or None (no packed format);
        exact_layers not ints in [-num_layers, num_layers) (as :func:`init_caches`).
    """
    d, h, L = config.head_dim, config.num_kv_heads, config.num_layers
    exact = len(layer_indices(exact_layers, L, "kv_bytes_per_token"))
    if k_bits is None or v_bits is None:
        return float(L * h * 2 * d * 2)
    for name, bits in (("k_bits", k_bits), ("v_bits", v_bits)):
        check_bits(bits, name=name)
    return float((L - exact) * h * (d * k_bits / 8 + 4 + d * v_bits / 8 + 4) + exact * h * 2 * d * 2)


def window_bytes_per_sequence(config: LlamaConfig, window: int, exact_layers: Sequence[int] = ()) -> int:
    """Bytes of a recent-token window per sequence, all layers but ``exact_layers`` (uncompressed,
    no window): ``window`` tokens of bfloat16 K and V rows per KV head (a fixed cost, whatever the
    sequence's length).

    Args:
      config: model config (``num_layers``, ``num_kv_heads``, ``head_dim``).
      window: tokens kept exactly (0: none).
      exact_layers: layers kept uncompressed (negative indices from the end).
    Returns:
      bytes (int).
    Raises:
      TypeError / ValueError: exact_layers not ints in [-num_layers, num_layers).
    """
    layers = config.num_layers - len(layer_indices(exact_layers, config.num_layers, "window_bytes_per_sequence"))
    return int(layers * config.num_kv_heads * window * config.head_dim * 2 * 2)


def compression_ratio_vs_bf16(config: LlamaConfig, k_bits: int | None, v_bits: int | None) -> float:
    """``kv_bytes_per_token(bf16) / kv_bytes_per_token(k_bits, v_bits)`` (1.0 when uncompressed).

    Args:
      config: model config.
      k_bits, v_bits: bits per coordinate, or None (uncompressed).
    Returns:
      the compression ratio (float).
    Raises:
      TypeError / ValueError: as :func:`kv_bytes_per_token`.
    """
    return kv_bytes_per_token(config, None, None) / kv_bytes_per_token(config, k_bits, v_bits)


def check_decode_matches_eval(model: Llama, token_ids, cache_config=(4, 4),
                              atol: float = 1e-2) -> dict:
    """Check that the jitted decode step reproduces the evaluation path's logits.

    For a float32 model (cast a bfloat16 one first: bfloat16 queries let the GPU decode kernel use
    float16 products), matrix products run at full float32 precision for the check,
    paged_decode's rotations included (on GPUs XLA's default is TF32).

    Runs ``token_ids [n]`` (a) through :func:`jax_tq.models.forward_compressed` in one call, and
    (b) one token at a time through the jitted decode step (batch of 2 sequences sharing the pool:
    the real one, with a scrambled block table, and an inactive row with ``seq_len 0``), then
    compares the logits at every position, two ways:

    * teacher-forced (the check): step t starts from the cache the evaluation path wrote, with token
      t's own entry cleared (NaN norms), so it sees the same compressed K/V of tokens < t and must
      write token t's own in its slot. Where those codes (all layers) equal the evaluation path's,
      its norms must match (relative 1e-3) and the logits agree to float32 rounding (the batched
      and one-token matrix products round differently). Rarely the rounding moves one of token
      t's codes across a bucket boundary, and that position's later layers and logits differ by
      more (counted; at most a quarter of the positions may).
    * free-running (reported, not checked): the decode step writes every token itself. A
      rounding-level difference that flips one code changes later layers' inputs, which flips
      more codes: over 30 layers the two paths can drift apart by whole logits (SmolLM2, 48
      tokens: max differences of 1e-4 to ~4 depending on the text and the codec seed, for Haar and
      Hadamard codecs alike), as any two numerically different but equivalent paths into a 4-bit
      cache would. ``code_bytes_differ`` counts the code bytes of the two final caches that differ.

    Args:
      model: :class:`jax_tq.models.Llama`.
      token_ids: int ``[n]`` (n >= 1).
      cache_config: compressed cache spec (see :func:`parse_cache_config`); None / ``"none"``
        fall back to the default ``CacheConfig()`` (4:4).
      atol: tolerance on the teacher-forced max absolute logit difference at the positions whose
        own codes equal the evaluation path's.
    Returns:
      dict with ``num_tokens``; teacher-forced ``max_abs_diff`` (all positions),
      ``same_codes_max_abs_diff`` (positions whose own codes match), ``positions_with_own_flips``,
      ``own_norms_max_rel_diff`` (the written norms against the evaluation path's at those
      positions; inf if NaN),
      ``last_max_abs_diff``, ``argmax_agree`` (fraction of positions with equal argmax),
      ``last_argmax_equal``; free-running ``free_max_abs_diff``, ``free_argmax_agree``,
      ``code_bytes_differ`` and ``code_bytes`` (of the pages the sequence uses, all layers);
      and ``ok`` (``same_codes_max_abs_diff <= atol``, ``own_norms_max_rel_diff <= 1e-3`` and
      ``positions_with_own_flips <= num_tokens // 4``; with a window ``max_abs_diff <=
      WINDOW_CHECK_ATOL`` (0.25) and ``argmax_agree >= 0.95``: the window's bfloat16 rows of the two
      paths' activations, which round differently in the last float32 bit, differ by a bfloat16 ulp
      now and then, and later layers' codes then differ too, so code equality is no criterion).
      With a window, step t reads the rows the teacher-forced step t - 1 wrote.
    Raises:
      TypeError: token ids not integers.
      ValueError: an unparseable ``cache_config``; ``token_ids`` not ``[n >= 1]`` or outside
        ``[0, vocab_size)``.
      TypeError / ValueError: propagated from :func:`jax_tq.models.init_caches` (e.g. bits not
        in 2..4).
    """
    with jax.default_matmul_precision("float32"):
        return _check_decode_matches_eval(model, token_ids, cache_config, atol)


def _check_decode_matches_eval(model, token_ids, cache_config, atol):
    cfg = parse_cache_config(cache_config) or CacheConfig()
    ids = np.asarray(token_vector(token_ids, model.config.vocab_size, "check_decode_matches_eval"))
    n = ids.shape[0]
    ps = cfg.page_size
    n_pages = -(-n // ps)
    rng = np.random.default_rng(0)
    table = rng.permutation(2 * n_pages)[:n_pages].astype(np.int32)
    tables = np.stack([table, np.zeros_like(table)])

    def fresh_caches():
        return config_caches(model.config, cfg, 2 * n_pages, num_windows=2)

    eval_logits, eval_caches = forward_compressed(model, ids, fresh_caches(), table)
    eval_logits = np.asarray(eval_logits)
    step = make_decode_step(model)

    def run_step(caches, t):  # the step donates its caches
        logits, caches = step(caches, np.array([ids[t], 0], np.int32), np.array([t, 0], np.int32),
                              tables, np.array([t + 1, 0], np.int32))
        return np.asarray(logits[0]), caches

    def token_entry(cache, name, t):  # token t's entry of one pool, [num_kv_heads, ...]
        return np.asarray(getattr(cache, name)[table[t // ps], :, t % ps])

    def cleared(caches, t):  # a copy without token t's entry (NaN norms): the step must write it
        page, slot = table[t // ps], t % ps
        return [dataclasses.replace(c, k_codes=c.k_codes.at[page, :, slot].set(0),
                                    v_codes=c.v_codes.at[page, :, slot].set(0),
                                    k_norms=c.k_norms.at[page, :, slot].set(jnp.nan),
                                    v_norms=c.v_norms.at[page, :, slot].set(jnp.nan)) for c in caches]

    def norm_error(caches, t):  # max relative error of token t's written norms (inf if NaN)
        errs = []
        for a, b in zip(eval_caches, caches):
            for name in ("k_norms", "v_norms"):
                want = token_entry(a, name, t)
                errs.append(np.max(np.abs(token_entry(b, name, t) - want) / np.maximum(np.abs(want), 1e-30)))
        err = float(max(errs))
        return err if np.isfinite(err) else np.inf

    forced, flipped, norm_err = [], [], []
    windows = fresh_caches()  # the window the teacher-forced steps have written so far (step t-1's)
    for t in range(n):
        start = [dataclasses.replace(c, k_window=w.k_window, v_window=w.v_window)
                 for c, w in zip(cleared(eval_caches, t), windows)]
        logits, caches = run_step(start, t)
        windows = caches
        forced.append(logits)
        flipped.append(any(np.any(token_entry(a, name, t) != token_entry(b, name, t))
                           for a, b in zip(eval_caches, caches) for name in ("k_codes", "v_codes")))
        norm_err.append(norm_error(caches, t))
    forced, flipped, norm_err = np.stack(forced), np.asarray(flipped), np.asarray(norm_err)
    free, caches = [], fresh_caches()
    for t in range(n):
        logits, caches = run_step(caches, t)
        free.append(logits)
    free = np.stack(free)
    used = np.asarray(table)
    differ = sum(int(np.sum(np.asarray(getattr(a, name))[used] != np.asarray(getattr(b, name))[used]))
                 for a, b in zip(eval_caches, caches) for name in ("k_codes", "v_codes"))
    total = sum(int(np.asarray(getattr(a, name))[used].size) for a in eval_caches for name in ("k_codes", "v_codes"))
    diff = np.abs(forced - eval_logits).max(-1)
    same_codes = ~flipped
    res = {
        "num_tokens": int(n),
        "max_abs_diff": float(diff.max()),
        "same_codes_max_abs_diff": float(diff[same_codes].max()) if same_codes.any() else 0.0,
        "positions_with_own_flips": int(flipped.sum()),
        "own_norms_max_rel_diff": float(norm_err[same_codes].max()) if same_codes.any() else 0.0,
        "last_max_abs_diff": float(diff[-1]),
        "argmax_agree": float(np.mean(forced.argmax(-1) == eval_logits.argmax(-1))),
        "last_argmax_equal": bool(forced[-1].argmax() == eval_logits[-1].argmax()),
        "free_max_abs_diff": float(np.abs(free - eval_logits).max()),
        "free_argmax_agree": float(np.mean(free.argmax(-1) == eval_logits.argmax(-1))),
        "code_bytes_differ": differ,
        "code_bytes": total,
    }
    if cfg.window:  # bfloat16 window rows of differently rounded activations: compare the logits
        res["ok"] = bool(res["max_abs_diff"] <= WINDOW_CHECK_ATOL and res["argmax_agree"] >= 0.95)
    else:
        res["ok"] = bool(res["same_codes_max_abs_diff"] <= atol and res["own_norms_max_rel_diff"] <= 1e-3
                         and res["positions_with_own_flips"] <= n // 4)
    return res


#: Teacher-forced logit tolerance of :func:`check_decode_matches_eval` for caches with a window.
WINDOW_CHECK_ATOL = 0.25


@jax.jit
def _greedy_next(logits):
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _split_sequences(mesh, config: LlamaConfig, caches, tables, positions, prompts, prompt_lens):
    """greedy_generate's arguments with the sequences split over ``mesh``'s "data" axis: caches with
    their pages and windows split (KV heads over "model" where it divides them), shard-local block
    tables and window ids, the per-sequence arrays placed P("data")."""
    if "data" not in mesh.shape:
        raise ValueError(f"greedy_generate: mesh needs a 'data' axis to split the sequences over, got axes "
                         f"{tuple(mesh.shape)}")
    data, batch = mesh.shape["data"], tables.shape[0]
    if batch % data:
        raise ValueError(f"greedy_generate: batch ({batch}) must be a multiple of the mesh's data axis ({data})")
    model_axis = mesh.shape.get("model", 1)
    heads = "model" if model_axis > 1 and config.num_kv_heads % model_axis == 0 else None
    caches = [shard_cache(c, mesh, kv_head_axis=heads, page_axis="data") for c in caches]
    per_shard = batch // data  # sequences per shard; sequence b owns pages [b * n, (b + 1) * n)
    by_seq = NamedSharding(mesh, PartitionSpec("data"))
    put = lambda x: jax.device_put(x, by_seq)  # noqa: E731
    local_tables = tables % (per_shard * tables.shape[1])
    window_ids = jnp.arange(batch, dtype=jnp.int32) % per_shard
    return (caches, put(local_tables), put(window_ids), [put(p) for p in positions], put(prompts), put(prompt_lens))


def greedy_generate(model: Llama, prompt_ids: Sequence[int], max_new_tokens: int = 32,
                    cache_config="k4v4", eos_token_id: int | None = None, batch: int = 1,
                    uncompressed_dtype=jnp.bfloat16, mesh=None) -> dict:
    """Greedy decoding of ``batch`` copies of one prompt with a jitted decode step.

    Args:
      model: :class:`jax_tq.models.Llama`.
      prompt_ids: prompt token ids (non-empty).
      max_new_tokens: tokens generated per sequence (>= 1).
      cache_config: see below.
      eos_token_id: if given, ``ids`` is cut after its first occurrence.
      batch: number of identical sequences decoded together (>= 1).
      uncompressed_dtype: dtype of the uncompressed baseline cache's pages.
      mesh: None, or a ``jax.sharding.Mesh`` with a ``"data"`` axis (and optionally ``"model"``): the
        sequences are split over ``"data"`` (``batch`` a multiple of its size), each device holding
        its sequences' pages and windows (:func:`jax_tq.cache_partition_specs` with
        ``page_axis="data"``; block tables and window ids shard-local), and the KV heads over
        ``"model"`` where that axis divides them. Under the plain ``jax.jit`` of the prefill and
        the decode loop every op then runs on each device's slice (no gather of the caches), and
        the tokens are the unsharded run's.

    ``cache_config``: a compressed paged cache spec (see :func:`parse_cache_config`; by default
    the ``"k4v4"`` preset), or None / ``"none"`` for the uncompressed baseline, paged too
    (``preset="none"``, pages of ``uncompressed_dtype``, 16 tokens each); sequence ``b`` owns its
    own pages.

    The prompts go through one forward (:func:`jax_tq.models.llama.make_prefill`: exact attention
    over the prompt's own K / V, which it writes into the caches), compiled before it is timed; the
    first new token comes from it, the other ``max_new_tokens - 1`` from one call of
    :func:`jax_tq.models.llama.make_decode_loop`: all decode steps in one dispatch, the next token
    chosen on the device, compiled before it is timed. ``ids`` is cut after the first ``eos_token_id``.

    Returns:
      dict: ``ids`` (sequence 0's generated ids, prompt excluded, cut after EOS), ``all_ids``
      (int32 ``[batch, max_new_tokens]``, uncut), ``rows_agree`` (all sequences generated the
      same ids), ``compile_s`` (compiling the prefill and running it once on a copy of the caches),
      ``prefill_s`` (the prefill's call until the first new token is ready: time to first token),
      ``loop_compile_s`` (compiling the decode loop and running it once on a copy of the
      caches, which holds a second copy of them in memory meanwhile),
      ``decode_steps`` (``max_new_tokens - 1``: the first new token comes from the prefill),
      ``decode_s`` (the decode loop's call, until its tokens are ready) and ``tokens_per_s``
      (``batch * decode_steps / decode_s``; NaN without decode steps).
    Raises:
      TypeError: ``batch`` or ``max_new_tokens`` not an int.
      ValueError: empty or not 1-D prompt, token ids outside ``[0, vocab_size)``, ``batch < 1``,
        ``max_new_tokens < 1``, an unparseable ``cache_config``, a ``mesh`` without a ``"data"``
        axis or one whose size does not divide ``batch``.
      TypeError / ValueError: propagated from :func:`jax_tq.models.init_caches` (e.g. bits not
        in 2..4).
    """
    cfg = parse_cache_config(cache_config)
    if np.ndim(prompt_ids) != 1:
        raise ValueError(f"greedy_generate: prompt_ids must be a 1-D sequence of token ids, got shape "
                         f"{np.shape(prompt_ids)}")
    if not len(prompt_ids):
        raise ValueError("empty prompt")
    check_token_ids(np.asarray(prompt_ids), model.config.vocab_size, "greedy_generate")
    prompt = [int(t) for t in prompt_ids]
    for name, value in (("batch", batch), ("max_new_tokens", max_new_tokens)):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"greedy_generate: {name} must be an int, got {value!r}")
    if batch < 1 or max_new_tokens < 1:
        raise ValueError(f"need batch >= 1 and max_new_tokens >= 1, got {batch}, {max_new_tokens}")
    total = len(prompt) + max_new_tokens
    positions = [jnp.full((batch,), p, jnp.int32) for p in range(total + 1)]
    n_pages = -(-total // (cfg or CacheConfig()).page_size)
    if cfg is None:
        caches = init_caches(model.config, None, None, batch * n_pages, dtype=uncompressed_dtype)
    else:
        caches = config_caches(model.config, cfg, batch * n_pages, num_windows=batch)
    tables = jnp.arange(batch * n_pages, dtype=jnp.int32).reshape(batch, n_pages)
    prompts = np.tile(np.asarray(prompt, np.int32), (batch, 1))
    prompt_lens = np.full((batch,), len(prompt), np.int32)
    window_ids = None
    if mesh is not None:
        caches, tables, window_ids, positions, prompts, prompt_lens = _split_sequences(
            mesh, model.config, caches, tables, positions, prompts, prompt_lens)
    prefill, paged_loop = make_prefill(model), make_decode_loop(model)

    def loop(caches, tok, pos, n):
        return paged_loop(caches, tok, positions[pos], tables, positions[pos + 1], n, window_ids=window_ids)

    t0 = time.perf_counter()
    spare = jax.tree_util.tree_map(jnp.copy, caches)  # donated to the compiling call
    _greedy_next(prefill(spare, prompts, prompt_lens, tables, window_ids=window_ids)[0]).block_until_ready()
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    logits, caches = prefill(caches, prompts, prompt_lens, tables, window_ids=window_ids)
    nxt = _greedy_next(logits)
    nxt.block_until_ready()
    prefill_s = time.perf_counter() - t0
    steps = max_new_tokens - 1
    out = [np.asarray(nxt)[:, None]]
    loop_compile_s = decode_s = 0.0
    if steps:
        t0 = time.perf_counter()
        spare = jax.tree_util.tree_map(jnp.copy, caches)  # donated to the compiling call
        loop(spare, nxt, len(prompt), steps)[0].block_until_ready()
        loop_compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        tokens, caches = loop(caches, nxt, len(prompt), steps)
        tokens.block_until_ready()
        decode_s = time.perf_counter() - t0
        out.append(np.asarray(tokens))
    all_ids = np.concatenate(out, axis=1)
    ids = [int(t) for t in all_ids[0]]
    if eos_token_id is not None and eos_token_id in ids:
        ids = ids[:ids.index(eos_token_id) + 1]
    return {"ids": ids, "all_ids": all_ids, "rows_agree": bool((all_ids == all_ids[:1]).all()),
            "compile_s": compile_s, "prefill_s": prefill_s, "loop_compile_s": loop_compile_s,
            "decode_steps": steps, "decode_s": decode_s,
            "tokens_per_s": batch * steps / decode_s if decode_s > 0 and steps else float("nan")}
