#!/bin/bash
# One call on the GPU machine for the issue-6 kernels: load the carried library (or build it),
# run the GPU tests, run the benchmark; everything is logged under $OUT.
#   bash experiments/kernels_device_run.sh [TEST_TIMEOUT_S] [BENCH_TIMEOUT_S] [PYTEST_ARGS...]
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-/tmp/kernels_out}
mkdir -p "$OUT"
TEST_T=${1:-240}
BENCH_T=${2:-200}
shift 2 2>/dev/null
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
  nvcc --version | tail -2
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if ! python3 -c "from moe_praxis.ops import cuda; ok, why = cuda.load_library(); print(why); raise SystemExit(0 if ok else 1)" 2>&1 | tee "$OUT/load.log"; then
  echo "carried library not loadable: building here"
  python3 -m moe_praxis.build_kernels --jobs 16 2>&1 | tee "$OUT/build.log"
fi
python3 -c "import moe_praxis.ops as o; print(o.backend_info())" 2>&1 | tee -a "$OUT/load.log"
# router tests first (their failures print before anything can time out), then the rest
START=$(date +%s)
timeout "$TEST_T" python3 -m pytest -q -m gpu tests/test_kernels_gpu.py -k router --tb=short \
  -rfE "$@" 2>&1 | tee "$OUT/tests_router.log" | tail -40
LEFT=$(( TEST_T - ($(date +%s) - START) ))
[ "$LEFT" -lt 30 ] && LEFT=30
timeout "$LEFT" python3 -m pytest -q -m gpu tests/test_kernels_gpu.py -k "not router" \
  --tb=short --durations=8 -rfE "$@" 2>&1 | tee "$OUT/tests.log" | tail -40
echo "tests rc=$?"
timeout "$BENCH_T" python3 -m experiments.bench_kernels --out "$OUT/bench_kernels.json" 2>&1 \
  | tee "$OUT/bench.log" | tail -30
echo "bench rc=$?"
