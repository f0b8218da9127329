"""Time to first token of the main job's model: SmolLM2-135M's shapes (30 layers, 9 / 3 heads,
head_dim 64; random bfloat16 weights: time does not depend on their values, and the GGUF does not
travel to the GPU machine), fresh prompts through ``jax_tq.models.llama.make_prefill`` (each layer:
``prompt_attention``, i.e. flash attention over the prompt's own K / V plus the write into the
caches), with a bf16 paged cache (``none``), the ``k4v4`` preset and the plain K4V4 codec; and, for
one prompt, the same prompt through ``forward_compressed`` (every layer's attention read back from
the compressed pages by ``paged_prefill``).

Timing: benchmarks/device_time.py's seconds_per_call, the caches passed from call to call (donated):
the GPU span per call where the profiler's kernel events split into repetitions, else the host
clock (median; dispatch included), which is what the H200 runs of this program gave.
Usage: python benchmarks/bench_ttft.py [--shapes 1x2048,8x1024] [--configs none,k4v4,4:4]
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_tq.models import LlamaConfig
from jax_tq.models import evaluate as ev
from jax_tq.models.llama import Llama, forward_compressed, make_prefill
from jax_tq.models.paging import init_caches

import device_time

PAGE = 16


def caches_for(model, spec, num_pages, batch):
    cfg = ev.parse_cache_config(spec)
    if cfg is None:
        return init_caches(model.config, None, None, num_pages, PAGE, dtype=jnp.bfloat16)
    return ev.config_caches(model.config, cfg.with_run(PAGE, 0), num_pages, num_windows=batch)


def ttft(model, spec, batch, length, reps):
    pages = -(-length // PAGE)
    tables = np.arange(batch * pages, dtype=np.int32).reshape(batch, pages)
    prompts = np.random.default_rng(0).integers(0, model.config.vocab_size, (batch, length)).astype(np.int32)
    lens = np.full((batch,), length, np.int32)
    prefill = make_prefill(model)
    state = {"caches": caches_for(model, spec, batch * pages, batch)}

    def run():
        logits, state["caches"] = prefill(state["caches"], prompts, lens, tables)
        jax.block_until_ready(logits)

    return device_time.seconds_per_call(run, 1, reps)


def chunk_over_pages(model, spec, length, reps):
    """One prompt through forward_compressed (attention read back from the pages)."""
    pages = -(-length // PAGE)
    table = np.arange(pages, dtype=np.int32)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, length).astype(np.int32)
    state = {"caches": caches_for(model, spec, pages, 1)}

    def run():
        logits, state["caches"] = forward_compressed(model, ids, state["caches"], table)
        jax.block_until_ready(logits)

    return device_time.seconds_per_call(run, 1, reps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1x2048,1x8192,8x1024", help="comma-separated BATCHxPROMPT_LEN")
    ap.add_argument("--configs", default="none,k4v4,4:4", help="caches: none (bf16 pages), presets, K:V plain codecs")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}")
    model = Llama(LlamaConfig(), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    configs = args.configs.split(",")
    print(f"\nSmolLM2-135M shapes, bf16 weights; time to first token (ms): make_prefill per cache, "
          "and forward_compressed (attention over the compressed pages) for k4v4")
    print("| (batch, prompt_len) | " + " | ".join(f"prefill, {c}" for c in configs) + " | over pages, k4v4 |")
    print("|---|" + "---:|" * (len(configs) + 1))
    for shape in args.shapes.split(","):
        batch, length = (int(x) for x in shape.split("x"))
        times = [ttft(model, c, batch, length, args.reps) for c in configs]
        pages = chunk_over_pages(model, "k4v4", length, args.reps) if batch == 1 else float("nan")
        print(f"| ({batch}, {length}) | " + " | ".join(f"{t * 1e3:.2f}" for t in times) + f" | {pages * 1e3:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
