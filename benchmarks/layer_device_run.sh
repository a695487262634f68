#!/bin/bash
# One call on the GPU machine for the layer benchmark (python -m benchmarks.layer): load
# the carried kernel library (or build it), then the benchmark within a time budget; everything
# is logged under $OUT and the JSON is written there too.
#   bash benchmarks/layer_device_run.sh [BUDGET_S] [SHAPES] [BENCH_ARGS...]
# BUDGET_S (default 540): the benchmark's --time-budget (no new shape starts past it) and, with
# a margin, its hard timeout; SHAPES: comma-separated (default mixtral,qwen3,deepseek). The JSON
# is $OUT/layer_bench_<shapes>.json, the log $OUT/layer_<shapes>.log.
# BREAKDOWN_S=N adds the per-stage breakdown (--breakdown, 'cuda' and 'cuda+fuse', no skew) as a
# second process limited to N seconds, with XLA's command buffers off so that every kernel in the
# trace carries its HLO op (rerun with them on if this XLA rejects the flag); BREAKDOWN_ARGS: more
# options for that process (e.g. "--quick").
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/layer_out}
mkdir -p "$OUT"
BUDGET=${1:-540}
SHAPES=${2:-mixtral,qwen3,deepseek}
shift 2 2>/dev/null
TAG=${SHAPES//,/_}
source "$(dirname "$0")/device_common.sh"
device_env "$OUT/env_layer.txt"
ensure_library "$OUT" | tee -a "$OUT/env_layer.txt"
START=$(date +%s)
timeout $(( BUDGET + 60 )) python3 -m benchmarks.layer --shapes "$SHAPES" --time-budget "$BUDGET" \
  --json "$OUT/layer_bench_$TAG.json" "$@" > "$OUT/layer_$TAG.log" 2>&1
RC=$?
echo "layer bench rc=$RC in $(( $(date +%s) - START )) s"
grep -E "^check|^skew|^note|OOM|FAIL|failed" "$OUT/layer_$TAG.log" | head -40
sed -n '/^| shape | load |/,$p' "$OUT/layer_$TAG.log" | tail -80
if [ "${BREAKDOWN_S:-0}" -gt 0 ]; then
  BD="python3 -m benchmarks.layer --shapes $SHAPES --methods cuda,cuda+fuse --no-skew --breakdown \
--reps 3 --json $OUT/layer_breakdown_$TAG.json ${BREAKDOWN_ARGS:-}"
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" timeout "$BREAKDOWN_S" $BD \
    > "$OUT/layer_breakdown_$TAG.log" 2>&1
  BRC=$?
  if [ $BRC -ne 0 ] && grep -q "xla_gpu_enable_command_buffer" "$OUT/layer_breakdown_$TAG.log"; then
    echo "command-buffer flag rejected: breakdown with command buffers on"
    timeout "$BREAKDOWN_S" $BD > "$OUT/layer_breakdown_$TAG.log" 2>&1
    BRC=$?
  fi
  echo "breakdown rc=$BRC"
  grep -E "^breakdown|^\| |^attributed" "$OUT/layer_breakdown_$TAG.log" \
    | grep -vE "^\| (shape|mixtral|qwen3|deepseek) \|" | tail -60
fi
exit $RC
