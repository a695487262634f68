#!/bin/bash
# One call on the GPU machine for the end-to-end step benchmark (python -m benchmarks.e2e): load
# the carried kernel library (or build it), then one process per run, most important first, each
# writing $OUT/e2e_<exp>_<attention>_<remat>.json and its log; a run that starts past BUDGET_S is
# left out (and listed). One table of every run at the end.
#   bash benchmarks/e2e_device_run.sh [BUDGET_S] [STEPS]
# BUDGET_S (default 400): no run starts after it; STEPS (default 5): timed steps per run (after 2
# warm-up steps). RUNS="exp:attention:remat[:PATH=VALUE+PATH=VALUE] ..." replaces the default list
# (attention 'default' or remat 'default': the experiment's own; the optional fourth field:
# config changes, each passed as --fdl_set, e.g.
# train.cast_weights_once=True+optimizer.mu_dtype='bfloat16'). BREAKDOWN=1 adds --breakdown to
# the cuDNN runs with the experiment's remat (XLA's command buffers off so every kernel carries
# its HLO op), BREAKDOWN=all to every cuDNN run.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/e2e_out}
mkdir -p "$OUT"
BUDGET=${1:-400}
STEPS=${2:-5}
# Baselines first (today: XLA attention, the experiment's remat), then cuDNN attention, then
# the candidate remat policies with cuDNN attention.
RUNS=${RUNS:-"mixtral_moe_gpu:xla:default mixtral_moe_gpu:cudnn:default \
qwen3_moe_gpu:xla:default qwen3_moe_gpu:cudnn:default \
small_gpu:xla:default small_gpu:cudnn:default \
mixtral_moe_gpu:cudnn:none qwen3_moe_gpu:cudnn:none \
mixtral_moe_gpu:cudnn:save_attention_and_moe_gemms qwen3_moe_gpu:cudnn:save_attention_and_moe_gemms \
mixtral_moe_gpu:cudnn:save_dot_except_mlp qwen3_moe_gpu:cudnn:save_dot_except_mlp \
small_gpu:cudnn:none"}
source "$(dirname "$0")/device_common.sh"
device_env "$OUT/env_e2e.txt"
ensure_library "$OUT" | tee -a "$OUT/env_e2e.txt"
START=$(date +%s)
SKIPPED=""
for RUN in $RUNS; do
  IFS=: read -r EXP ATT REMAT SETS <<< "$RUN"
  TAG="${EXP}_${ATT}_${REMAT}"
  [ -n "$SETS" ] && TAG="${TAG}_$(echo "$SETS" | tr -c 'A-Za-z0-9_.\n' '_')"
  if [ $(( $(date +%s) - START )) -gt "$BUDGET" ]; then
    SKIPPED="$SKIPPED $RUN"
    continue
  fi
  ARGS="--exp $EXP --steps $STEPS --json $OUT/e2e_$TAG.json"
  [ "$ATT" != default ] && ARGS="$ARGS --attention $ATT"
  [ "$REMAT" != default ] && ARGS="$ARGS --remat $REMAT"
  SET_ARGS=()
  IFS=+ read -r -a SET_LIST <<< "$SETS"
  for S in "${SET_LIST[@]}"; do SET_ARGS+=(--fdl_set "$S"); done
  FLAGS=""
  if [ "$ATT" = cudnn ] && { [ "${BREAKDOWN:-0}" = all ] ||
                             { [ "${BREAKDOWN:-0}" = 1 ] && [ "$REMAT" = default ]; }; }; then
    ARGS="$ARGS --breakdown"
    FLAGS="--xla_gpu_enable_command_buffer="
  fi
  T0=$(date +%s)
  # XLA reads an XLA_FLAGS of blanks as a file name: set it only when it holds a flag
  XF=$(echo "${XLA_FLAGS:-} $FLAGS" | xargs)
  env -u XLA_FLAGS ${XF:+XLA_FLAGS="$XF"} timeout 300 python3 -m benchmarks.e2e $ARGS "${SET_ARGS[@]}" \
    > "$OUT/e2e_$TAG.log" 2>&1
  RC=$?
  echo "== $RUN rc=$RC in $(( $(date +%s) - T0 )) s"
  grep -E "^\| $EXP|^attention|^note|^model FLOPs|RESOURCE_EXHAUSTED|Error|error:" "$OUT/e2e_$TAG.log" | head -8
  [ $RC -ne 0 ] && tail -5 "$OUT/e2e_$TAG.log"
done
[ -n "$SKIPPED" ] && echo "not run (past the ${BUDGET} s budget):$SKIPPED"
python3 -m benchmarks.e2e --summary "$OUT"
