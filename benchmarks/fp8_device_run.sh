#!/bin/bash
# One call on the GPU machine for the FP8 experts: the carried library (or a build,
# split into 15 MB parts under $OUT so it can be carried by later calls), the FP8 GPU tests
# (two pytest processes, a limit per test), then the FP8 kernel benchmark over the tiles.
#   bash benchmarks/fp8_device_run.sh [TEST_BUDGET_S] [BENCH_BUDGET_S] [BENCH_ARGS...]
# TESTS_A / TESTS_B: the test files of the two processes (default the quantization tests and
# the FP8 GEMM tests); BENCH_BUDGET_S=0 skips the benchmark. Logs and JSON under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/fp8_out}
mkdir -p "$OUT"
TEST_T=${1:-240}
BENCH_T=${2:-200}
shift 2 2>/dev/null
TESTS_A=${TESTS_A:-tests/test_fp8_quant_gpu.py}
TESTS_B=${TESTS_B:-tests/test_fp8_gpu.py}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
if ! python3 -c "from moe_praxis.ops import backend; ok, why = backend.load_library(); print(why); raise SystemExit(0 if ok else 1)"; then
  S=$(date +%s)
  python3 -m moe_praxis.build_kernels --jobs 16 > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
  echo "built in $(( $(date +%s) - S )) s"
  split -b 15M -d moe_praxis/lib/libmoe_praxis_kernels.so "$OUT/lib.part"
fi
PYT="python3 -m pytest -v -m gpu --tb=short -rfE -p no:cacheprovider --timeout 90 --timeout_method=thread"
S=$(date +%s)
# shellcheck disable=SC2086
timeout "$TEST_T" $PYT $TESTS_A > "$OUT/tests_a.log" 2>&1 &
# shellcheck disable=SC2086
timeout "$TEST_T" $PYT $TESTS_B > "$OUT/tests_b.log" 2>&1 &
wait
echo "tests done in $(( $(date +%s) - S )) s"
for f in tests_a tests_b; do
  echo "=== $f"; grep -E "FAILED|ERROR|Timeout|passed|failed" "$OUT/$f.log" | tail -15
done
[ "$BENCH_T" -gt 0 ] || exit 0
timeout $(( BENCH_T + 60 )) python3 -m benchmarks.bench_fp8 --time-budget "$BENCH_T" \
  --out "$OUT/fp8_bench.json" "$@" 2>&1 | tee "$OUT/bench_fp8.log" | tail -40
echo "bench rc=$?"
