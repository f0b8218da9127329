"""The hyper-parameters of a Llama-family decoder (jax_tq.models.llama's model, read from GGUF by
jax_tq.models.gguf_loader). No dependencies: the loader reads it without importing flax."""
from __future__ import annotations

import dataclasses

__all__ = ["LlamaConfig"]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Static hyper-parameters of a Llama-architecture decoder (Touvron et al. 2023, "LLaMA").

    Attributes:
      vocab_size: number of tokens.
      hidden_size: model width (``llama.embedding_length``).
      intermediate_size: SwiGLU hidden width (``llama.feed_forward_length``).
      num_layers: number of transformer blocks (``llama.block_count``).
      num_heads: query heads (``llama.attention.head_count``).
      num_kv_heads: key/value heads, GQA (``llama.attention.head_count_kv``).
      head_dim: per-head width; ``hidden_size // num_heads`` unless given by the file.
      rope_theta: RoPE base frequency (``llama.rope.freq_base``).
      rms_norm_eps: RMSNorm epsilon (``llama.attention.layer_norm_rms_epsilon``).
      max_position_embeddings: trained context length (``llama.context_length``).
      tie_word_embeddings: True when the lm head reuses the token embedding (no ``output.weight``).
      bos_token_id / eos_token_id: special token ids (may be None).
      architecture: ``general.architecture`` of the file (``llama``, ``qwen2`` or ``qwen3``).
      attention_bias: q/k/v projections have biases (Qwen2 / Qwen2.5; ``blk.N.attn_q.bias``).
      qk_norm: per-head RMSNorm of q and k before RoPE (Qwen3; ``blk.N.attn_q_norm.weight``).
      rope_freq_factors: None, or ``head_dim // 2`` divisors of the RoPE inverse frequencies
        (llama.cpp's ``rope_freqs.weight``, Llama 3.1's scaling, times a linear
        ``rope.scaling.factor``); see :func:`jax_tq.models.layers.rope_cos_sin`.
      add_bos_token: the tokenizer metadata says a BOS token starts each text
        (``tokenizer.ggml.add_bos_token``, else llama.cpp's default for ``tokenizer.ggml.pre``:
        True for Llama 3). Informational: jax_tq never adds BOS itself.
    """

    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_layers: int = 30
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    rope_theta: float = 100000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    architecture: str = "llama"
    attention_bias: bool = False
    qk_norm: bool = False
    rope_freq_factors: tuple[float, ...] | None = None
    add_bos_token: bool = False
