#!/bin/bash
# One call on the GPU machine for the FP8 training-quality runs (python -m benchmarks.fp8_quality)
# of the Mixtral-like preset: base, FP8, the control router_f32 (exact router logits: the noise
# floor) and the variants named in VARIANTS, on the standard-library corpus; the log and JSON
# under $OUT, the runs' metrics and records as $OUT/fq_runs.tgz.
#   bash benchmarks/fp8_quality_device_run.sh [BUDGET_S]
# BUDGET_S (default 570): the benchmark's hard limit (a SIGTERM stops the run in flight, which
# saves its step; the same command again, on the same machine, reads the finished runs and
# resumes it). STEPS (default 300), EVAL (default 100), LR (default: the preset's, 1e-4; at 3e-4
# two bf16 runs drift apart by 9%, docs/performance.md), ZLOSS (default: the preset's, none) the
# router z-loss weight of every run, RSCALE (default: the preset's, 1) the router init scale of
# every run (router_init_scale), BRANCH (default none) the step at which every run, the base
# runs too, branches from its seed's bf16 trunk (--branch_at), KEEP (default /tmp/fq) the job
# directories; SEEDS=N base and fp8 at N seeds each (--seeds); CONTROL=0 leaves the control
# out (where its floor was measured on this GPU before), CONTROL=repeat makes it the base's own
# config run again (train.seed=0, the experiment's seed: how far the GPU alone moves a run);
# DETERMINISTIC=1 runs everything under XLA_FLAGS --xla_gpu_deterministic_ops=true (recorded
# with each run, which is read back only under the same flags).
# VARIANTS (default "wi_fwd wo_fwd"; set empty for none), each one of:
#   fwd_only (fp8_gemms='fwd'), wgrad_bf16 ('fwd+dgrad'), wi_fwd ('wi=fwd'), wo_fwd ('wo=fwd'),
#   wo_fwd_bf16 ('wi=all,wo=dgrad+wgrad': every expert GEMM in FP8 but the down projection's
#   forward), fp8_router_f32 (FP8 with the control's change: how far FP8 itself drifts under it).
# With SEEDS=N every variant also runs at train.seed=1 .. N-1 (runs V.s1, ...), to be read
# against the bf16 run of its own seed.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/fq_out}
mkdir -p "$OUT"
BUDGET=${1:-570}
KEEP=${KEEP:-/tmp/fq}
P=model.stacked_transformer_tpl.block.moe_layer_tpl
source "$(dirname "$0")/device_common.sh"
device_env "$OUT/env_fq.txt"
ensure_library "$OUT" | tee -a "$OUT/env_fq.txt"
ARGS=(--base mixtral_moe_gpu --fp8 mixtral_moe_gpu_fp8 --steps "${STEPS:-300}"
      --eval_every "${EVAL:-100}" --stdlib_corpus /tmp/stdlib.txt --keep "$KEEP")
case ${CONTROL:-1} in
  0) ;;
  1) ARGS+=(--control router_f32 "$P.router_precision='float32'") ;;
  repeat) ARGS+=(--control repeat "train.seed=0") ;;
  *) echo "CONTROL=$CONTROL: give 1 (router_f32), repeat (the base again) or 0 (none)"; exit 2 ;;
esac
[ "${DETERMINISTIC:-0}" = 1 ] && export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_deterministic_ops=true"
[ -n "${LR:-}" ] && ARGS+=(--fdl_set "optimizer.learning_rate=$LR")
[ -n "${ZLOSS:-}" ] && ARGS+=(--fdl_set "$P.router_z_loss_weight=$ZLOSS")
[ -n "${RSCALE:-}" ] && ARGS+=(--fdl_set "$P.router_init_scale=$RSCALE")
[ -n "${SEEDS:-}" ] && ARGS+=(--seeds "$SEEDS")
[ -n "${BRANCH:-}" ] && ARGS+=(--branch_at "$BRANCH")
for V in ${VARIANTS-wi_fwd wo_fwd}; do
  case $V in
    fwd_only) C="fp8_gemms='fwd'" ;;
    wgrad_bf16) C="fp8_gemms='fwd+dgrad'" ;;
    wi_fwd) C="fp8_gemms='wi=fwd'" ;;
    wo_fwd) C="fp8_gemms='wo=fwd'" ;;
    wo_fwd_bf16) C="fp8_gemms='wi=all,wo=dgrad+wgrad'" ;;
    fp8_router_f32) C="router_precision='float32'" ;;
    *) echo "VARIANTS: unknown $V (fwd_only, wgrad_bf16, wi_fwd, wo_fwd, wo_fwd_bf16," \
            "fp8_router_f32)"; exit 2 ;;
  esac
  ARGS+=(--variant "$V" "$P.$C")
  for (( K = 1; K < ${SEEDS:-1}; K++ )); do ARGS+=(--variant "$V.s$K" "$P.$C" "train.seed=$K"); done
done
S=$(date +%s)
timeout "$BUDGET" python3 -m benchmarks.fp8_quality "${ARGS[@]}" --out "$OUT/fp8_quality.json" \
  > "$OUT/fp8_quality.log" 2>&1
echo "fp8_quality rc=$? in $(( $(date +%s) - S )) s"
grep -v -E "it/s|s/it|^\s*$" "$OUT/fp8_quality.log" | tail -40
(cd "$KEEP" && tar czf "$OUT/fq_runs.tgz" $(find . -name metrics.jsonl -o -name fp8_quality_run.json))
