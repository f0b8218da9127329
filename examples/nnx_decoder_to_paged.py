"""Convert a small flax.nnx decoder from nnx.MultiHeadAttention to jax_tq.nn.PagedAttention.

A GPT-style decoder (learned position embeddings, pre-LayerNorm blocks, random weights) written
the plain way with ``nnx.MultiHeadAttention`` and its own decode cache, and the same decoder with
``jax_tq.nn.PagedAttention``: the lines that change are marked ``# CHANGED``. The converted model
loads the plain one's weights (same parameter tree), prefills the prompts in one call and decodes
one token per step from a paged cache (uncompressed with ``--preset none``, TurboQuant codes with
``k4v4``). Both generate greedily; uncompressed they give the same tokens, ``k4v4`` reports the
agreement.

    python examples/nnx_decoder_to_paged.py                   # k4v4 and none, ~10 s on 2 CPU cores
    python examples/nnx_decoder_to_paged.py --prompt-len 200 --new-tokens 32
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_tq.nn import PagedAttention  # CHANGED (import)


# ----------------------------------------------------------------------------- the plain decoder
class Block(nnx.Module):
    """Pre-LayerNorm block with nnx.MultiHeadAttention."""

    def __init__(self, d_model: int, num_heads: int, *, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(d_model, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads, d_model, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d_model, rngs=rngs)
        self.mlp = nnx.Sequential(nnx.Linear(d_model, 4 * d_model, rngs=rngs), nnx.gelu,
                                  nnx.Linear(4 * d_model, d_model, rngs=rngs))

    def __call__(self, x, *, decode: bool):
        mask = None if decode else nnx.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + self.attn(self.ln1(x), mask=mask, decode=decode)
        return x + self.mlp(self.ln2(x))


# ----------------------------------------------------------------------------- converted
class PagedBlock(nnx.Module):
    """The same block with jax_tq.nn.PagedAttention (causal and cached by itself)."""

    def __init__(self, d_model: int, num_heads: int, *, preset: str = "k4v4", rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(d_model, rngs=rngs)
        self.attn = PagedAttention(num_heads, d_model, preset=preset, page_size=16, rngs=rngs)  # CHANGED
        self.ln2 = nnx.LayerNorm(d_model, rngs=rngs)
        self.mlp = nnx.Sequential(nnx.Linear(d_model, 4 * d_model, rngs=rngs), nnx.gelu,
                                  nnx.Linear(4 * d_model, d_model, rngs=rngs))

    def __call__(self, x, *, decode: bool):
        x = x + self.attn(self.ln1(x), decode=decode)  # CHANGED: no mask (causal built in)
        return x + self.mlp(self.ln2(x))


class Decoder(nnx.Module):
    """Token + position embeddings, blocks (``block_cls``), final LayerNorm, lm head."""

    def __init__(self, vocab: int, d_model: int, num_heads: int, num_layers: int, max_len: int, *,
                 block_cls=Block, rngs: nnx.Rngs, **block_kw):
        self.embed = nnx.Embed(vocab, d_model, rngs=rngs)
        self.pos = nnx.Embed(max_len, d_model, rngs=rngs)
        self.blocks = nnx.List([block_cls(d_model, num_heads, rngs=rngs, **block_kw) for _ in range(num_layers)])
        self.ln_f = nnx.LayerNorm(d_model, rngs=rngs)
        self.head = nnx.Linear(d_model, vocab, rngs=rngs)

    def __call__(self, tokens, positions, *, decode: bool):
        x = self.embed(tokens) + self.pos(positions)
        for blk in self.blocks:
            x = blk(x, decode=decode)
        return self.head(self.ln_f(x))

    def init_cache(self, batch: int, max_len: int):
        for blk in self.blocks:
            if isinstance(blk.attn, PagedAttention):
                blk.attn.init_cache(batch, max_len)  # CHANGED: (batch, max_len) instead of an input shape
            else:
                blk.attn.init_cache((batch, max_len, blk.ln1.num_features))


@nnx.jit(donate_argnums=0)
def _step(model, tokens, positions):
    return model(tokens, positions, decode=True)


@nnx.jit(donate_argnums=0)
def _prefill(model, tokens, positions):
    return model(tokens, positions, decode=False)


def _greedy_decode(model: Decoder, logits, length: int, new_tokens: int) -> np.ndarray:
    """The greedy tokens [batch, new_tokens] from the prompt's last logits, one decode call per token."""
    out = []
    for t in range(length, length + new_tokens):
        out.append(jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32))
        if t < length + new_tokens - 1:
            logits = _step(model, out[-1][:, None], jnp.full((logits.shape[0], 1), t, jnp.int32))
    return np.asarray(jnp.stack(out, axis=1))


def generate_plain(model: Decoder, prompt: np.ndarray, new_tokens: int) -> np.ndarray:
    """Greedy tokens [batch, new_tokens]: nnx.MultiHeadAttention's cache takes one token per call."""
    batch, length = prompt.shape
    model.init_cache(batch, length + new_tokens)
    for t in range(length):  # the prompt, token by token
        logits = _step(model, jnp.asarray(prompt[:, t:t + 1]), jnp.full((batch, 1), t, jnp.int32))
    return _greedy_decode(model, logits, length, new_tokens)


def generate_paged(model: Decoder, prompt: np.ndarray, new_tokens: int) -> np.ndarray:
    """Greedy tokens [batch, new_tokens]: one prefill call, then one decode call per token."""
    batch, length = prompt.shape
    model.init_cache(batch, length + new_tokens)
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    logits = _prefill(model, jnp.asarray(prompt), positions)  # CHANGED: the whole prompt at once
    return _greedy_decode(model, logits, length, new_tokens)


def main(argv=None) -> dict:
    """Build, convert, generate; print and return ``{preset: agreement}`` and the token arrays."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=2, help="head_dim = d_model / heads (64+ for the compressed presets)")
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=96, help="above 64, k4v4 decodes the older tokens from codes")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--presets", default="none,k4v4")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for flag in ("layers", "d_model", "heads", "vocab", "batch", "prompt_len", "new_tokens"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.d_model % args.heads:
        ap.error(f"--heads ({args.heads}) must divide --d-model ({args.d_model})")
    max_len = args.prompt_len + args.new_tokens
    size = (args.vocab, args.d_model, args.heads, args.layers, max_len)

    plain = Decoder(*size, rngs=nnx.Rngs(args.seed))
    prompt = np.asarray(jax.random.randint(jax.random.PRNGKey(args.seed + 1), (args.batch, args.prompt_len), 0,
                                           args.vocab), np.int32)
    weights = nnx.state(plain, nnx.Param)
    t0 = time.perf_counter()
    want = generate_plain(plain, prompt, args.new_tokens)
    print(f"nnx.MultiHeadAttention: {want.tolist()}  ({time.perf_counter() - t0:.1f} s)")
    result = {"plain": want}
    for preset in args.presets.split(","):
        paged = Decoder(*size, block_cls=PagedBlock, preset=preset, rngs=nnx.Rngs(args.seed))  # CHANGED
        nnx.update(paged, jax.tree.map(jnp.copy, weights))  # the plain model's weights (copies: donated below)
        t0 = time.perf_counter()
        got = generate_paged(paged, prompt, args.new_tokens)
        agree = float(np.mean(got == want))
        print(f"PagedAttention {preset}: {got.tolist()}  agreement {agree:.1%}  ({time.perf_counter() - t0:.1f} s)")
        result[preset] = got
        result[preset + "_agreement"] = agree
    return result


if __name__ == "__main__":
    main()
