#!/usr/bin/env bash
# One device call on the GPU machine: build jax_tq with CUDA, run the GPU tests, the benchmarks,
# and optionally the main job; print short tables. Usage: bash scripts/gpu_run.sh [build tests bench model]
# stages: build ab kernels phases ncu ncuw trace prompt tests dtests ftests fbench regress qjl variants prefill ttft sharded cmdbuf bits hd rot bench graphs profile breakdown mstep model (default: build tests bench). Logs go to $OUT (the device tool brings them back).
# One device call may run 600 s at most: "build tests" (~9 min on the H200) and "bench" (~4 min) fit
# in two back-to-back calls; the build stays while the machine is warm (30 s after a call).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/jax_tq_out}; mkdir -p "$OUT"
stages=${*:-build tests bench}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
has() { [[ " $stages " == *" $1 "* ]]; }
# pip install -e . with CUDA in the current directory. CMake reads CUDAFLAGS only when it first
# configures a build directory, so one configured under other flags (the ab stage's
# -DJTQ_DEV_ONLY_D=128, which builds head_dim 128 only) is removed first: on a warm machine it
# once made a later full build a head_dim-128 one, and 89 decode GPU tests failed with "head_dim
# 64 not compiled in".
cuda_install() {
  local stamp="build/.cudaflags" want="flags:${CUDAFLAGS:-} trace:${JAX_TQ_TRACE_PHASES:-OFF}"
  if [[ -d build && "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then rm -rf build; fi
  JAX_TQ_CUDA=ON JAX_TQ_CUDA_ARCHS=${JAX_TQ_CUDA_ARCHS:-90a} \
    python3 -m pip install --no-build-isolation --no-deps -e . \
    && mkdir -p build && printf '%s' "$want" >"$stamp"
}
# Under Nsight Compute: no preallocation of 75% of the GPU by XLA (kernel replay saves and restores
# the device memory a kernel may touch; suspected in ncu's segfaults since the eleventh session).
ncu_env="XLA_PYTHON_CLIENT_PREALLOCATE=false"

t0=$(date +%s)
if has build; then
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
  if ! cuda_install >"$OUT/build.log" 2>&1; then
    tail -n 80 "$OUT/build.log"; echo "BUILD FAILED"; exit 1
  fi
  python3 -c "import jax, jax_tq, jax_tq._cuda_ops as m; from jax_tq import _ffi; print('jax', jax.__version__, jax.devices(), 'cuda kernels:', _ffi.kernels_available('cuda'), _ffi.unavailable_reason('cuda'))"
  echo "build: $(( $(date +%s) - t0 )) s"
fi
if has phases; then  # a build with the phase trace (JAX_TQ_TRACE_PHASES=ON), its test and report; then the plain build again
  if JAX_TQ_TRACE_PHASES=ON cuda_install >"$OUT/build_trace.log" 2>&1; then
    JAX_TQ_TRACE_PHASES=ON timeout 100 python3 -m pytest -q -m gpu tests/test_decode.py -k "phase_trace or many_item" 2>&1 | tail -n 3
    PYTHONPATH=benchmarks:${PYTHONPATH:-} timeout 100 python3 benchmarks/phase_trace.py ${PHASE_SHAPES:-32x8192} 2>&1 \
      | grep -E "^==|kernel span|loop end \(|^  end|later|earlier|^  [a-z].*p50"
  else
    tail -n 40 "$OUT/build_trace.log"; echo "TRACE BUILD FAILED"
  fi
  cuda_install >"$OUT/build.log" 2>&1
fi
if has ab; then  # A/B in one call, on one machine: each source tree of AB_TREES (default ". ab/base") built
  # with CUDA side by side (pip install --target /tmp/ab_site_N, all at once: ~2 min for three trees
  # of head_dim 128 kernels on 16 cores), then timed in turn at AB_SHAPES (through
  # scripts/with_site.py: the editable install stays out of the way); the trees run twice, in
  # order and back (drifts of the GPU reach all alike). "." is the working tree. Make another
  # commit's tree with: mkdir -p ab/base && git archive <rev> | tar -x -C ab/base (untracked, so it
  # travels; delete it afterwards). CUDAFLAGS=-DJTQ_DEV_ONLY_D=128 builds head_dim 128's kernels only.
  # AB_BITS="2:2 4:4" times those K:V widths (AB_HEAD_DIM=64: at head_dim 64, with CUDAFLAGS=-DJTQ_DEV_ONLY_D=64); AB_PREFILL=1 times bench_prefill.py instead of
  # bench_decode.py; AB_PROMPT=1 runs trace_prompt.py (prompt_attention against cuDNN alone).
  trees=(${AB_TREES:-. ab/base}); n=${#trees[@]}
  for i in "${!trees[@]}"; do
    # A build directory of its own (not the tree's build/, which the editable install and earlier
    # CUDAFLAGS may hold).
    (cd "${trees[$i]}" && rm -rf /tmp/ab_site_$i /tmp/ab_build_$i && JAX_TQ_CUDA=ON JAX_TQ_CUDA_ARCHS=${JAX_TQ_CUDA_ARCHS:-90a} \
      python3 -m pip install -q --no-build-isolation --no-deps -C build-dir=/tmp/ab_build_$i --target /tmp/ab_site_$i . \
      >"$OUT/build_ab_$i.log" 2>&1 \
      || echo "A/B BUILD FAILED: ${trees[$i]} (build_ab_$i.log)") &
  done
  wait; echo "ab builds: $(( $(date +%s) - t0 )) s"
  root=$PWD
  for i in $(seq 0 $((n - 1))) $(seq $((n - 1)) -1 0); do
    tree=${trees[$i]}; [ -d /tmp/ab_site_$i/jax_tq ] || continue
    echo "== A/B: $tree"
    run="python3 $root/scripts/with_site.py /tmp/ab_site_$i"
    if [ "${AB_PROMPT:-0}" = 1 ]; then
      (cd "$tree" && timeout ${BENCH_TIMEOUT:-150} $run benchmarks/trace_prompt.py ${PROMPT_SHAPES:-1x2048 8x1024} 2>&1 | grep -v "^    ")
    elif [ "${AB_PREFILL:-0}" = 1 ]; then
      (cd "$tree" && timeout ${BENCH_TIMEOUT:-150} $run benchmarks/bench_prefill.py --no-decode-rows 2>&1 | grep "^| (" | cut -d'|' -f2-5)
    else
      for b in ${AB_BITS:-4:4}; do
        (cd "$tree" && timeout ${BENCH_TIMEOUT:-150} $run benchmarks/bench_decode.py --only-tq --device-time --rotations hadamard \
          --bits "$b" --head-dim ${AB_HEAD_DIM:-128} --shapes ${AB_SHAPES:-32x8192} 2>&1 | grep "^|" | grep -v -- "---" | cut -d'|' -f2-3,5)
      done
    fi
  done
  echo "ab: $(( $(date +%s) - t0 )) s"
fi
if has kernels; then  # each kernel family (JAX_TQ_DECODE_KERNEL) wherever it runs: the decode GPU tests, then timing
  for k in ${KERNELS:-cuda-core tensor-core-f32 tensor-core-f16}; do
    echo "== $k"
    JAX_TQ_DECODE_KERNEL=$k timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -x -m gpu tests/test_decode.py -k paged_decode 2>&1 \
      | tee "$OUT/kernel_tests_$k.log" | tail -n 3
    JAX_TQ_DECODE_KERNEL=$k timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/bench_decode.py --only-tq --device-time \
      --shapes ${KERNEL_SHAPES:-32x8192,1x32768} 2>&1 | tee "$OUT/kernel_bench_$k.txt" | grep "^|" | grep -v -- "---" | cut -d'|' -f2-6
  done
  echo "kernels: $(( $(date +%s) - t0 )) s"
fi
if has tests; then  # the CUDA cases of compress, write_cache and decode (not the window's), the device-time helper's
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m gpu tests/test_compress.py tests/test_cache.py tests/test_decode.py tests/test_device_time.py -k "not window" 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -n 25
  # The same decode cases on the other kernel families (the planner routes most of them to the float16 one).
  for k in ${TEST_KERNELS:-cuda-core tensor-core-f32}; do
    JAX_TQ_DECODE_KERNEL=$k timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -m gpu tests/test_decode.py -k paged_decode 2>&1 \
      | tee "$OUT/gpu_tests_$k.log" | tail -n 5
  done
  # The op tests run on the default device: on this machine they test the CUDA kernels against float64
  # (-k: not the window's cases, which ftests runs; the gpu-marked ones of QJL and prefill only, the
  # others ran above; a marker's name matches -k as a test's name does).
  timeout ${OP_TEST_TIMEOUT:-300} python3 -m pytest -q tests/test_compress.py tests/test_cache.py tests/test_decode.py tests/test_api.py tests/test_backend.py \
    tests/test_checks.py tests/test_sharding.py tests/test_qjl.py tests/test_prefill.py -k "not window and (test_qjl or test_prefill or not gpu)" 2>&1 | tee "$OUT/op_tests.log" | tail -n 15
  echo "tests: $(( $(date +%s) - t0 )) s"
fi
if has ftests; then  # the fitted scale (its quad write included) and the window on the CUDA kernels (against float64 / the CPU)
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m gpu tests/test_fit_scale.py tests/test_cache.py tests/test_decode.py tests/test_prefill.py -k "fit_scale or window" 2>&1 \
    | tee "$OUT/format_gpu_tests.log" | tail -n 12
  echo "ftests: $(( $(date +%s) - t0 )) s"
fi
if has fbench; then  # decode and write time of the presets against the plain codecs and cuDNN (FBENCH_ARGS)
  timeout ${BENCH_TIMEOUT:-400} python3 benchmarks/bench_format.py ${FBENCH_ARGS:-} 2>&1 | tee "$OUT/bench_format.txt" | grep -E "^\||^#|^jax"
  echo "fbench: $(( $(date +%s) - t0 )) s"
fi
if has regress; then  # the decode GPU tests on the default kernels (a change of the format's paths must not move them)
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -x -m gpu tests/test_decode.py -k paged_decode 2>&1 | tee "$OUT/gpu_decode_tests.log" | tail -n 6
  echo "regress: $(( $(date +%s) - t0 )) s"
fi
if has qjl; then  # TurboQuant_prod: the QJL tests (the scores kernel against float64), then its benchmark
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q tests/test_qjl.py 2>&1 | tee "$OUT/qjl_tests.log" | tail -n 8
  PYTHONPATH=benchmarks:${PYTHONPATH:-} timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/bench_qjl.py 2>&1 \
    | tee "$OUT/bench_qjl.txt" | tail -n 12
  echo "qjl: $(( $(date +%s) - t0 )) s"
fi
if has prefill; then  # paged prefill (kernel and cuDNN over the decoded span) and the serving calls: their tests (against float64, 8 processes), then the benchmark (PREFILL_ARGS, e.g. --breakdown; PREFILL_TAIL lines shown)
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -n 8 -p no:cacheprovider \
    tests/test_prefill.py tests/test_prefill_dense.py tests/test_ragged.py 2>&1 | tee "$OUT/prefill_tests.log" | tail -n 8
  PYTHONPATH=benchmarks:${PYTHONPATH:-} timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/bench_prefill.py ${PREFILL_ARGS:-} 2>&1 \
    | tee "$OUT/bench_prefill.txt" | tail -n ${PREFILL_TAIL:-8}
  echo "prefill: $(( $(date +%s) - t0 )) s"
fi
if has dtests; then  # the decode GPU tests on the planner's kernels and the device-time helper's, then on the other families
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -m gpu tests/test_compress.py tests/test_cache.py tests/test_decode.py tests/test_device_time.py \
    -k "(paged_decode or device_time or float16) and not window" 2>&1 \
    | tee "$OUT/gpu_decode_tests.log" | tail -n 8
  for k in ${DTEST_KERNELS:-tensor-core-f32 cuda-core}; do
    JAX_TQ_DECODE_KERNEL=$k timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -x -m gpu tests/test_decode.py -k paged_decode 2>&1 \
      | tee "$OUT/gpu_decode_tests_$k.log" | tail -n 5
  done
  echo "dtests: $(( $(date +%s) - t0 )) s"
fi
if has bits; then  # jax_tq alone per (head_dim, K bits, V bits): BITS_CONFIGS="128:3:3 64:4:4 ..."
  for cfg in ${BITS_CONFIGS:-128:4:4 128:3:3 128:2:2 64:4:4}; do
    IFS=: read -r d kb vb <<<"$cfg"
    echo "== head_dim $d, K${kb}V${vb}"
    timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/bench_decode.py --only-tq --device-time --head-dim "$d" --bits "$kb:$vb" \
      --rotations ${BITS_ROTATIONS:-hadamard} \
      --shapes ${BITS_SHAPES:-32x8192,1x32768} 2>&1 | tee "$OUT/bits_${d}_${kb}${vb}.txt" | grep "^|" | grep -v -- "---"
  done
  echo "bits: $(( $(date +%s) - t0 )) s"
fi
if has hd; then  # one head_dim against the bf16 paths (HD, HD_HEADS, HD_SHAPES), then jax_tq on the CUDA-core kernel (HD_V1=0 skips it)
  timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/bench_decode.py --device-time --head-dim ${HD:-256} --heads ${HD_HEADS:-16:8} \
    --rotations ${HD_ROTATIONS:-haar} --shapes ${HD_SHAPES:-32x8192,8x8192,1x32768} 2>&1 | tee "$OUT/hd_${HD:-256}.txt" | grep "^|" | grep -v -- "---"
  if [ "${HD_V1:-1}" != 0 ]; then
    JAX_TQ_DECODE_KERNEL=cuda-core timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/bench_decode.py --only-tq --device-time --head-dim ${HD:-256} \
      --heads ${HD_HEADS:-16:8} --rotations ${HD_ROTATIONS:-haar} --shapes ${HD_SHAPES:-32x8192,8x8192,1x32768} 2>&1 \
      | tee "$OUT/hd_${HD:-256}_v1.txt" | grep "^|" | grep -v -- "---"
  fi
  echo "hd: $(( $(date +%s) - t0 )) s"
fi
if has rot; then  # the rotation GEMM alone at each precision (GPU time, error against float64)
  PYTHONPATH=benchmarks:${PYTHONPATH:-} timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/bench_rotation.py 2>&1 | tee "$OUT/bench_rotation.txt" | tail -n 18
fi
if has bench; then
  timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/bench_compress.py ${COMPRESS_ARGS:-} 2>&1 | tee "$OUT/bench_compress.txt" | tail -n 20
  timeout ${BENCH_TIMEOUT:-250} python3 benchmarks/bench_decode.py ${DECODE_ARGS:---device-time} 2>&1 | tee "$OUT/bench_decode.txt" | tail -n 30
  echo "bench: $(( $(date +%s) - t0 )) s"
fi
if has profile; then
  env $ncu_env ncu --clock-control none -k regex:"tq_|decode_" --section SpeedOfLight --section LaunchStats \
      --section Occupancy python3 benchmarks/profile_kernels.py >"$OUT/ncu.txt" 2>&1
  grep -E "tq_|decode_|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Registers Per|Achieved Occupancy|Grid Size" "$OUT/ncu.txt" | head -n 80
fi
if has graphs; then  # the same decode timing with XLA command buffers (CUDA graphs) including custom calls
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN --xla_gpu_graph_min_graph_size=1" \
    timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/bench_decode.py ${DECODE_ARGS:-} 2>&1 | tee "$OUT/bench_decode_graphs.txt" | tail -n 30
fi
if has ncu; then  # decode kernels under Nsight Compute (NCU_KERNELS default "default": the planner's; or kernel families; NCU_SHAPES default 32x8192)
  for v in ${NCU_KERNELS:-default}; do
    sel=""; [ "$v" != default ] && sel="$v"
    env $ncu_env JAX_TQ_DECODE_KERNEL=$sel PYTHONPATH=benchmarks:${PYTHONPATH:-} timeout ${NCU_TIMEOUT:-200} \
      ncu --clock-control none -k regex:"decode_(cuda_core|tc_f32|tc_f16)_kernel" --launch-skip 1 --launch-count ${NCU_COUNT:-1} \
      --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
      --section MemoryWorkloadAnalysis --section SchedulerStats --section InstructionStats --section SourceCounters \
      --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,sm__inst_executed.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed \
      --export "$OUT/ncu_$v" --force-overwrite python3 benchmarks/ncu_decode.py ${NCU_SHAPES:-32x8192} >"$OUT/ncu_run_$v.txt" 2>&1
    ncu -i "$OUT/ncu_$v.ncu-rep" --page details >"$OUT/ncu_$v.txt" 2>&1
    # per-SASS-instruction counters (shared wavefronts, ideal wavefronts, stalls) of the same kernel
    ncu -i "$OUT/ncu_$v.ncu-rep" --page source --csv --print-source sass 2>"$OUT/ncu_source_$v.err" | gzip >"$OUT/ncu_source_$v.csv.gz"
    echo "== ncu decode $v"
    grep -E "  [a-z_:<>0-9 ]*decode_|Duration|DRAM Throughput|L1/TEX Cache Thr|Compute \(SM\) Thr|Registers Per|Achieved Occupancy|Issued Warp Per|Executed Ipc A|issue_stalled|wavefronts|conflicts|inst_executed|Bank" "$OUT/ncu_$v.txt" \
      | grep -vE "ratio +0(\.0[0-9])?$" | sed -E 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' | head -n 80
  done
fi
if has ncuw; then  # the prefill write kernels under Nsight Compute, one report per kind of NCUW_KINDS (default: plain k4v4;
  # k4v4 runs the fitted quad kernel): stall reasons, issue rate, shared-memory conflicts
  for kind in ${NCUW_KINDS:-plain k4v4}; do
    env $ncu_env PYTHONPATH=benchmarks:${PYTHONPATH:-} timeout ${NCU_TIMEOUT:-200} \
      ncu --clock-control none -k regex:"tq_hadamard" --launch-skip 1 --launch-count 1 \
      --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats \
      --section InstructionStats --section MemoryWorkloadAnalysis \
      --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,sm__inst_executed.sum \
      --export "$OUT/ncuw_$kind" --force-overwrite python3 benchmarks/ncu_write.py "$kind" >"$OUT/ncuw_run_$kind.txt" 2>&1
    ncu -i "$OUT/ncuw_$kind.ncu-rep" --page details >"$OUT/ncuw_$kind.txt" 2>&1
    echo "== ncu write $kind"
    grep -E "  [a-z_:<>0-9 ]*tq_hadamard|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Issued Warp Per|Executed Ipc A|issue_stalled|wavefronts|conflicts|inst_executed" "$OUT/ncuw_$kind.txt" \
      | grep -vE "ratio +0(\.0[0-9])?$" | sed -E 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' | head -n 50
  done
fi
if has trace; then  # the device timeline of one call in the benchmark chain (JAX profiler, CUPTI)
  PYTHONPATH=benchmarks:${PYTHONPATH:-} timeout ${TRACE_TIMEOUT:-150} python3 benchmarks/trace_decode.py ${TRACE_SHAPES:-32x8192 1x32768} 2>&1 \
    | tee "$OUT/trace.txt" | grep -E "^==|^\|" | head -n 60
fi
if has prompt; then  # fresh prompts: prompt_attention against cuDNN alone (host-timed chains, each call's kernels)
  PYTHONPATH=benchmarks:${PYTHONPATH:-} timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/trace_prompt.py \
    ${PROMPT_SHAPES:-1x2048 8x1024} 2>&1 | tee "$OUT/trace_prompt.txt" | grep -v "^    "
fi
if has breakdown; then  # every kernel of profile_kernels.py (decode calls, a cache write, a compress) with its duration
  env $ncu_env timeout ${NCU_TIMEOUT:-200} ncu --clock-control none --metrics gpu__time_duration.sum --csv \
    --log-file "$OUT/breakdown.csv" python3 benchmarks/profile_kernels.py >/dev/null 2>&1
  python3 - "$OUT/breakdown.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 5]
head, rows = rows[0], rows[1:]
name, val, unit = head.index("Kernel Name"), head.index("Metric Value"), head.index("Metric Unit")
scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
noise = ("Redzone", "DelayKernel", "fp_comparison")
rows = [r for r in rows if not any(k in r[name] for k in noise)]
first = next((i for i, r in enumerate(rows) if "paged_decode" in r[name]), 0)
for r in rows[max(0, first - 3):]:
    print(f"{float(r[val].replace(',', '')) * scale.get(r[unit], float('nan')):9.1f} us  {r[name][:90]}")
PY
fi
if has ttft; then  # the main job's time to first token (SmolLM2-135M shapes, random bf16 weights): TTFT_ARGS
  PYTHONPATH=benchmarks:${PYTHONPATH:-} timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_ttft.py ${TTFT_ARGS:-} 2>&1 \
    | tee "$OUT/bench_ttft.txt" | grep -E "^\||^device"
  echo "ttft: $(( $(date +%s) - t0 )) s"
fi
if has variants; then  # sliding_window / soft_cap / sinks in paged_decode's float16 ring and CUDA-core kernels
  # and both paged_prefill kernels against float64 ("ffi": the CUDA kernels; "xla": the reference); then the
  # decode times at (32, 8192) K4V4 with each variant (VARIANT_ARGS)
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q tests/test_masks.py -k "variants" 2>&1 \
    | tee "$OUT/variant_tests.log" | tail -n 12
  timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/bench_decode.py --only-tq --device-time --rotations hadamard \
    --shapes 32x8192 --variants none,soft_cap=50,sliding_window=4096,sinks,soft_cap=50+sliding_window=4096+sinks \
    ${VARIANT_ARGS:-} 2>&1 | tee "$OUT/bench_variants.txt" | grep -E "^\||^device"
  echo "variants: $(( $(date +%s) - t0 )) s"
fi
if has sharded; then  # issue 34 (an nvidia-h200-x2 machine): the decode step with KV heads over the GPUs vs one GPU,
  # then the main job's greedy decode with its sequences split over them (SHARDED_ARGS, SHARDED_MODEL_ARGS)
  timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_sharded.py --devices "$(python3 -c 'import jax; print(len(jax.devices()))')" \
    ${SHARDED_ARGS:-} 2>&1 | tee "$OUT/bench_sharded.txt" | grep -E "^\||largest|collectives"
  timeout ${BENCH_TIMEOUT:-300} python3 examples/smollm2_wikitext.py --chunks 1x64 --configs k4v4 --check-tokens 0 \
    --decode-batch 64 --max-new-tokens 64 --data-devices 2 ${SHARDED_MODEL_ARGS:-} 2>&1 | tee "$OUT/model_sharded.txt" \
    | grep -E "^\| (uncompressed|jax_tq)|split over"
  echo "sharded: $(( $(date +%s) - t0 )) s"
fi
if has cmdbuf; then  # the over-pages crash (issue 31): one 8192-token prompt, windowed k4v4, CMDBUF_LAYERS layers,
  # under each XLA command-buffer set of CMDBUF_SETS ("default" = XLA's; names joined by +, "none" = off);
  # CMDBUF_SANITIZE=1: then under compute-sanitizer (branch exp/write-cmdbuf has write_cache captured)
  for set in ${CMDBUF_SETS:-default FUSION+CUBLAS+CUBLASLT+CUDNN+DYNAMIC_SLICE_FUSION FUSION+CUBLAS+CUBLASLT+CUSTOM_CALL+CUDNN}; do
    flags="${XLA_FLAGS:-}"  # no stray space: XLA reads a XLA_FLAGS that does not start with -- as a file name
    [ "$set" != default ] && flags="${flags:+$flags }--xla_gpu_enable_command_buffer=$( [ "$set" = none ] || echo "${set//+/,}")"
    echo "== command buffers: $set"
    (cd benchmarks && XLA_FLAGS="$flags" timeout ${BENCH_TIMEOUT:-150} python3 -c "import bench_ttft as b, jax.numpy as jnp; from flax import nnx; m = b.Llama(b.LlamaConfig(num_layers=${CMDBUF_LAYERS:-8}), dtype=jnp.bfloat16, rngs=nnx.Rngs(0)); print('ok', b.chunk_over_pages(m, 'k4v4', 8192, 1))" 2>&1 | grep -iE "^ok|error" | cut -c1-200 | head -4)
  done
  if [ -n "${CMDBUF_SANITIZE:-}" ]; then  # XLA's default set under compute-sanitizer: which kernel faults, where
    (cd benchmarks && timeout ${SANITIZE_TIMEOUT:-400} compute-sanitizer --tool memcheck --print-limit 5 python3 -c "import bench_ttft as b, jax.numpy as jnp; from flax import nnx; m = b.Llama(b.LlamaConfig(num_layers=${CMDBUF_LAYERS:-8}), dtype=jnp.bfloat16, rngs=nnx.Rngs(0)); print('ok', b.chunk_over_pages(m, 'k4v4', 8192, 1))" 2>&1 \
      | grep -E "^ok|=========" | head -n 30)
  fi
  echo "cmdbuf: $(( $(date +%s) - t0 )) s"
fi
if has mstep; then  # one SmolLM2 decode step's time, dense bf16 vs paged K4V4 (needs $JAX_TQ_GGUF; MSTEP_ARGS)
  PYTHONPATH=benchmarks:${PYTHONPATH:-} timeout ${MODEL_TIMEOUT:-400} python3 benchmarks/profile_model_step.py \
    ${MSTEP_ARGS:---batch 64 --contexts 37,2048,8192} 2>&1 | tee "$OUT/model_step.txt" | grep "^|"
fi
if has model; then
  timeout ${MODEL_TIMEOUT:-400} python3 examples/smollm2_wikitext.py ${MODEL_ARGS:-} 2>&1 | tee "$OUT/model.txt" | tail -n 40
fi
