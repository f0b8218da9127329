"""llama.cpp's quantized KV caches on jax_tq's quality protocol: a baseline, not a test.

Measures, through llama.cpp (the ``llama-cpp-python`` bindings, CPU, flash attention), the
perplexity of SmolLM2-135M-Instruct Q4_1 (the GGUF jax_tq evaluates) with each KV-cache type
(K and V the same type), and the mean KL divergence KL(p_f16 || p_type) of its next-token
distributions from those with llama.cpp's own f16 KV cache.

Protocol (as :func:`jax_tq.models.evaluate.wikitext_perplexity`): the text is tokenized by jax_tq's
tokenizer without BOS and cut into consecutive chunks from its start; each chunk is evaluated from
an empty cache (n_ctx = chunk length, one batch) and every next token is scored (chunk_len - 1
predictions per chunk). ppl = exp(mean NLL); kl = mean over the same predictions of
sum_v p_f16(v) (log p_f16(v) - log p_type(v)), from the log-softmax of the full logits. Every
position attends to the cached (quantized) K/V of itself and all earlier positions.

Needs ``pip install llama-cpp-python`` (it builds llama.cpp from source; not a jax_tq dependency).
jax_tq is used only for the tokenizer and the GGUF path. Rerun (about 80 minutes on 2 CPU cores)::

    python benchmarks/llama_cpp_kv_quality.py
    python benchmarks/llama_cpp_kv_quality.py --texts wikitext2 --chunkings 4x512 --types f16,q4_0 \
        --out /tmp/kv.json

Recent llama.cpp rotates quantized K and V by a 64 x 64 Walsh-Hadamard matrix (``attn_rot_k`` /
``attn_rot_v`` in ``src/llama-kv-cache.cpp``); the JSON's ``hadamard_rotation`` is read from
llama.cpp's log, and ``--no-rotation`` turns it off (``LLAMA_ATTN_ROT_DISABLE=1``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import llama_cpp
import numpy as np
from tqdm import tqdm

from jax_tq.models.gguf_loader import build_tokenizer, default_smollm2_path, read_gguf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = {"wikitext2": "data/wikitext2_test.txt", "tiny_shakespeare": "data/tiny_shakespeare_100k.txt"}
#: KV-cache type -> bytes per block of 32 values (ggml's block sizes).
BLOCK_BYTES = {"f16": 64, "q8_0": 34, "q5_1": 24, "q5_0": 22, "q4_1": 20, "q4_0": 18}
#: llama.cpp commit vendored by each llama-cpp-python release (from its CHANGELOG).
LLAMA_CPP_COMMITS = {"0.3.36": "0c1e57098bba43ac29e6e3b677cdceebdd22334f (b11312)"}
LOG: list[str] = []  # llama.cpp's log lines, to read whether it rotated K / V


@llama_cpp.llama_log_callback
def _keep_log(level, text, user_data):
    LOG.append(text.decode(errors="replace"))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def chunk_logits(model_path: str, chunks: np.ndarray, kv_type: str, bar):
    """Yields the float32 logits [chunk_len - 1, vocab] of each chunk (its last row dropped)."""
    n = chunks.shape[1]
    ggml_type = getattr(llama_cpp, f"GGML_TYPE_{kv_type.upper()}")
    llm = llama_cpp.Llama(model_path=model_path, n_ctx=n, n_batch=n, n_ubatch=n, logits_all=True,
                          type_k=ggml_type, type_v=ggml_type, flash_attn=True,
                          n_threads=2, n_threads_batch=2, verbose=False)
    try:
        for chunk in chunks:
            llm.reset()
            llm.eval(chunk.tolist())
            bar.update()
            yield np.array(llm.scores[: n - 1], np.float32)
    finally:
        llm.close()


def evaluate(model_path: str, chunks: np.ndarray, types: list[str], bar) -> dict:
    """{type: {"ppl", "kl"}} for ``chunks`` [num_chunks, chunk_len]; the f16 reference runs first."""
    ref = list(chunk_logits(model_path, chunks, "f16", bar))
    rows = np.arange(chunks.shape[1] - 1)
    out = {}
    for t in types:
        nll = kl = 0.0
        logits = ref if t == "f16" else chunk_logits(model_path, chunks, t, bar)
        for chunk, lr, lt in zip(chunks, ref, logits):
            lp_ref, lp = log_softmax(lr), log_softmax(lt)
            nll -= lp[rows, chunk[1:]].sum()
            kl += (np.exp(lp_ref) * (lp_ref - lp)).sum()
        count = chunks.size - len(chunks)
        out[t] = {"ppl": float(np.exp(nll / count)), "kl": float(kl / count)}
        tqdm.write(f"  {t:5s} ppl {out[t]['ppl']:.4f}  kl {out[t]['kl']:.6f}")
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--texts", default=",".join(TEXTS), help=f"comma list of {list(TEXTS)}")
    p.add_argument("--chunkings", default="16x512,4x2048", help="comma list of NUMxLEN")
    p.add_argument("--types", default=",".join(BLOCK_BYTES), help=f"comma list of {list(BLOCK_BYTES)}")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks/results/llama_cpp_kv_quality.json"))
    p.add_argument("--no-rotation", action="store_true",
                   help="disable llama.cpp's Hadamard rotation of quantized K/V")
    args = p.parse_args()
    texts, chunkings, types = (s.split(",") for s in (args.texts, args.chunkings, args.types))
    if bad := [t for t in types if t not in BLOCK_BYTES] + [t for t in texts if t not in TEXTS]:
        p.error(f"unknown text or type: {bad}")
    if args.no_rotation:
        os.environ["LLAMA_ATTN_ROT_DISABLE"] = "1"
    llama_cpp.llama_log_set(_keep_log, None)
    model_path = default_smollm2_path()
    tokenizer = build_tokenizer(read_gguf(model_path))
    version = llama_cpp.__version__
    result = {
        "source": "benchmarks/llama_cpp_kv_quality.py: llama.cpp via llama-cpp-python, CPU, "
                  "flash attention, K and V of the same type; protocol in the script's docstring",
        "llama_cpp_python_version": version,
        "llama_cpp_commit": LLAMA_CPP_COMMITS.get(version, "unknown"),
        "hadamard_rotation": None,
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "date": datetime.date.today().isoformat(),
        "model": os.path.basename(model_path),
        "bytes_per_vector_head_dim_64": {t: 2 * BLOCK_BYTES[t] for t in types},
        "results": {},
    }
    start = time.time()
    for name in texts:
        with open(os.path.join(REPO, TEXTS[name]), encoding="utf-8") as f:
            ids = np.asarray(tokenizer.encode(f.read(), add_special_tokens=False).ids)
        for chunking in chunkings:
            num, length = map(int, chunking.split("x"))
            chunks = ids[: num * length].reshape(num, length)
            runs = num * (len(types) + ("f16" not in types))
            with tqdm(total=runs, desc=f"{name} {chunking}", unit="chunk") as bar:
                res = evaluate(model_path, chunks, types, bar)
            result["results"].setdefault(name, {})[chunking] = res
    log = "".join(LOG)
    result["hadamard_rotation"] = {kv: f"attn_rot_{kv} = 1" in log for kv in "kv"}
    result["seconds"] = round(time.time() - start)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
