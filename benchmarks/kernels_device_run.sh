#!/bin/bash
# One call on the GPU machine for the CUDA kernels: load the carried library (or build it), run
# the GPU tests (pytest-timeout per test, so a hang names its test), then the kernel benchmark;
# everything is logged under $OUT.
#   bash benchmarks/kernels_device_run.sh [TEST_BUDGET_S] [BENCH_BUDGET_S] [PYTEST_ARGS...]
# BENCH_BUDGET_S=0 skips the benchmarks; NCU_CASES="case,case" adds an Nsight Compute pass over
# those bench cases (ncu has segfaulted under JAX); GG_BENCH_S=N adds the grouped GEMM
# benchmark with an N-second limit (GG_BENCH_ARGS: its options, e.g. "--skip ragged,tiles"),
# GATE_UP_BENCH_S=N the fused gate/up one.
# Building there: the GPU machine has no nvidia-cutlass package, and its jaxlib's FFI headers
# fail this build's -Werror; carry this machine's CUTLASS headers as a package folder
# (.cutlass/cutlass_library/source/{include,tools/util/include} + an empty __init__.py, on
# PYTHONPATH) and the oldest supported jaxlib's include/ copied over jax.ffi.include_dir() there.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/kernels_out}
mkdir -p "$OUT"
TEST_T=${1:-300}
BENCH_T=${2:-150}
shift 2 2>/dev/null
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
  nvcc --version | tail -2
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if ! python3 -c "from moe_praxis.ops import backend; ok, why = backend.load_library(); print(why); raise SystemExit(0 if ok else 1)" 2>&1 | tee -a "$OUT/env.txt"; then
  echo "carried library not loadable: building here"
  python3 -m moe_praxis.build_kernels --jobs 16 2>&1 | tee "$OUT/build.log"
fi
python3 -c "import moe_praxis.ops as o; print(o.backend_info())" 2>&1 | tee -a "$OUT/env.txt"
# Three pytest processes share the GPU (no preallocation; compiles are CPU-bound, 16 cores);
# -v names each test as it ends; a test past 100 s has its stacks dumped and the process ends.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
PYT="python3 -m pytest -v -m gpu --tb=short -rfE -p no:cacheprovider --timeout 100 --timeout_method=thread --durations=8"
START=$(date +%s)
timeout "$TEST_T" $PYT tests/test_kernels_gpu.py -k router "$@" > "$OUT/tests_router.log" 2>&1 &
timeout "$TEST_T" $PYT tests/test_kernels_gpu.py -k "not router" "$@" > "$OUT/tests.log" 2>&1 &
timeout "$TEST_T" $PYT tests/test_grouped_gemm_cuda.py tests/test_grouped_gemm_sm80_gpu.py \
  tests/test_gate_up.py tests/test_gate_up_moe.py tests/test_ep_exchange.py "$@" \
  > "$OUT/tests_gg.log" 2>&1 &
wait
echo "tests done in $(( $(date +%s) - START )) s"
for f in tests_router tests tests_gg; do
  echo "=== $f"; grep -E "PASSED|FAILED|ERROR|Timeout|passed|failed|done in|err|case" "$OUT/$f.log" \
    | grep -v "^tests/.*PASSED" | tail -25
done
[ "$BENCH_T" -gt 0 ] || exit 0
# kernel durations (Nsight Compute, clocks left alone) and the optimized HLO of the small ops
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ -n "$NCU" ] && [ -n "${NCU_CASES:-}" ]; then
  timeout 150 "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv \
    --log-file "$OUT/ncu.csv" python3 -m benchmarks.bench_kernels --only "$NCU_CASES" --n 1 \
    --reps 1 --no-copy-bw --hlo-dir /tmp/hlo --out /tmp/ncu_bench.json > /tmp/ncu_run.log 2>&1
  echo "ncu rc=$? ($(wc -l < "$OUT/ncu.csv") lines)"; tail -3 /tmp/ncu_run.log
  tar czf "$OUT/hlo.tgz" -C /tmp hlo 2>/dev/null
fi
timeout "$BENCH_T" python3 -m benchmarks.bench_kernels --device-time --out "$OUT/bench_kernels.json" 2>&1 \
  | tee "$OUT/bench.log" | tail -26
echo "bench rc=$?"
if [ "${GATE_UP_BENCH_S:-0}" -gt 0 ]; then
  timeout "$GATE_UP_BENCH_S" python3 -m benchmarks.bench_gate_up --out "$OUT/bench_gate_up.json" \
    2>&1 | tee "$OUT/bench_gate_up.log" | tail -10
  echo "gate/up bench rc=$?"
fi
if [ "${GG_BENCH_S:-0}" -gt 0 ]; then
  timeout "$GG_BENCH_S" python3 -m benchmarks.bench_grouped_gemm --out "$OUT/bench_grouped_gemm.json" \
    ${GG_BENCH_ARGS:-} \
    2>&1 | tee "$OUT/bench_gg.log" | tail -30
  echo "grouped GEMM bench rc=$?"
fi
