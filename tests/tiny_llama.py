"""The tiny random Llama the model tests share (2 layers, 4 / 2 heads, head_dim 64, vocab 97), with
non-trivial norm weights so that a missing norm weight would be caught. Needs flax."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_tq.models import LlamaConfig
from jax_tq.models.llama import Llama

TINY = LlamaConfig(vocab_size=97, hidden_size=96, intermediate_size=160, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=64, rope_theta=10000.0,
                   rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=False)


def tiny_llama() -> Llama:
    from flax import nnx

    model = Llama(TINY, rngs=nnx.Rngs(1234))
    rng = np.random.default_rng(0)
    for blk in model.layers:
        blk.attn_norm.weight[...] = jnp.asarray(1 + 0.3 * rng.standard_normal(TINY.hidden_size), jnp.float32)
        blk.ffn_norm.weight[...] = jnp.asarray(1 + 0.3 * rng.standard_normal(TINY.hidden_size), jnp.float32)
    return model
