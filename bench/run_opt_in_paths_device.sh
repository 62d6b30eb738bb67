#!/usr/bin/env bash
# One device run that decides the opt-in paths of 2026-12-06 and 12-07 (docs/gpu.md "opt-in"; DSV4_HC_FINISH=keep is
# session 31's, never timed): the GPU tests that turn them
# on, then the 4-layer V4-Flash cut's decode (batch 1 and 8, 1K context) and 4K prefill with each switch alone and
# all together, against the defaults, alternating, two runs each; the kbench hc cases of the fused post + mixes.
# A path becomes the default once its tests pass and its figures here are better than the default's.
#   CARRY=.devcarry/new bench/run_opt_in_paths_device.sh
set -uo pipefail
CARRY=${CARRY:-.devcarry/new}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH="$CARRY:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 "$CARRY/dsv4_gpu_tests" \
  --gtest_filter='CudaHyperConnection.*:CudaSkinnyGemm.*:CudaMoeCombine.*:CudaModel.OptInDecodePaths*:CudaModel.Fp32*:CudaModel.Bf16*' \
  > "$OUT/opt_in_tests.log" 2>&1
echo "opt-in tests rc=$?"
grep -E "^\[  (PASSED|FAILED) |Failure|Expected|actual|trace:" "$OUT/opt_in_tests.log" | head -20
MODEL=(--model bench/configs/v4_flash_4layer.json --load-format dummy --device cuda)
ALL="DSV4_HC_FINISH=keep DSV4_HC_POST_MIX=1 DSV4_SKINNY_F32=1 DSV4_SHARED_EXPERT_GEMV=1 DSV4_ROUTED_EXPERT_GEMV=1 DSV4_EARLY_WINDOW_WRITE=1"
decode() {  # $1: label, rest: environment assignments
  local label=$1; shift
  env "$@" timeout 90 "$CARRY/dsv4" bench latency "${MODEL[@]}" --input-len 1024 --output-len 64 --batch-size 1,8 \
    --num-iters 2 2>&1 | grep -E "Decode|rror" | sed "s/^/decode $label: /"
}
for run in 1 2; do
  decode default DSV4_UNUSED=0
  decode all $ALL
  for switch in $ALL; do decode "$switch" "$switch"; done
done
for run in 1 2; do
  for setting in DSV4_UNUSED=0 DSV4_HC_POST_MIX=1; do
    env "$setting" timeout 60 "$CARRY/dsv4" bench latency "${MODEL[@]}" --input-len 4096 --output-len 2 --batch-size 1 \
      --num-iters 3 2>&1 | grep -E "Prefill|rror" | sed "s/^/4K prefill $setting: /"
  done
done
timeout 90 "$CARRY/dsv4_kbench" --suite hc 2>&1 | grep -E "^hc_post|^hc_pre"
