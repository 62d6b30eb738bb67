#!/usr/bin/env bash
# One device run for top-k (docs/kernels/indexer_topk.md), most important first (each step logs under $OUT, so a
# cut-off run still returns what it finished): the top-k GPU tests, dsv4_kbench --suite top_k with the default
# choice and with each path forced (DSV4_TOPK_PATH), side by side, torch.topk at the same shapes, ncu's stall
# reasons for the sampled path at three shapes, the SASS size of each top-k kernel, then the whole-model GPU tests
# that run the top-k (FILTER). Carry the build in .devcarry/new (dsv4_gpu_tests, dsv4_kbench), an unstripped
# dsv4_kbench as .devcarry/kbench_unstripped, and optionally a second build's dsv4_kbench as .devcarry/base (A/B).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TORCH_CUBLAS=$(python3 -c "import nvidia.cublas, os; print(os.path.join(list(nvidia.cublas.__path__)[0], 'lib'))" 2>/dev/null)
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${TORCH_CUBLAS}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
NEW=.devcarry/new
table() { sed -n '/^case /,$p' "$1" | cut -c1-60; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 90 $NEW/dsv4_gpu_tests --gtest_filter='CudaIndexer*TopK*' > "$OUT/topk_tests.log" 2>&1; echo "top-k tests rc=$?"
grep -E "^\[  (PASSED|FAILED) |Failure|Expected|Which" "$OUT/topk_tests.log" | head -12
for path in default sampled cluster chunked; do
  DSV4_TOPK_PATH=${path#default} timeout 90 $NEW/dsv4_kbench --suite top_k > "$OUT/kbench_$path.log" 2>&1
  echo "kbench $path rc=$?"
done
echo "columns: default | sampled | cluster | chunked (us)"
paste -d'|' <(table "$OUT/kbench_default.log") <(table "$OUT/kbench_sampled.log" | cut -c47-60) \
  <(table "$OUT/kbench_cluster.log" | cut -c47-60) <(table "$OUT/kbench_chunked.log" | cut -c47-60)
# A/B: with a second build carried as .devcarry/base/dsv4_kbench (e.g. main, against a branch in .devcarry/new), its
# default and sampled path beside this build's, from the same run.
if [[ -x .devcarry/base/dsv4_kbench ]]; then
  for path in default sampled; do
    DSV4_TOPK_PATH=${path#default} timeout 90 .devcarry/base/dsv4_kbench --suite top_k > "$OUT/base_$path.log" 2>&1
    echo "base kbench $path rc=$?"
  done
  echo "columns: base default | new default | base sampled | new sampled (us)"
  paste -d'|' <(table "$OUT/base_default.log") <(table "$OUT/kbench_default.log" | cut -c47-60) \
    <(table "$OUT/base_sampled.log" | cut -c47-60) <(table "$OUT/kbench_sampled.log" | cut -c47-60)
fi
timeout 90 python3 bench/kbench/torch_topk.py > "$OUT/torch.log" 2>&1; echo "torch rc=$?"; tail -26 "$OUT/torch.log"
for c in "top_k 512 256K b1" "top_k 512 2K b1" "top_k 512 256K b64"; do
  f="$OUT/ncu_sampled_$(echo $c | tr ' ' '_').txt"
  DSV4_TOPK_PATH=sampled timeout 60 ncu --metrics \
    'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,gpu__time_duration.sum,smsp__inst_executed.sum' \
    --kernel-name regex:top_k_ --launch-skip 2 --launch-count 1 $NEW/dsv4_kbench --suite top_k --quick --case "$c" \
    > "$f" 2>&1
  echo "ncu $c rc=$?"
  grep -E "duration|inst_executed|stalled" "$f" | awk '{v=$NF; gsub(",","",v); if (v+0 >= 0.2 || /duration|inst_exec/) print}'
done
if [[ -f .devcarry/kbench_unstripped ]]; then
  echo "SASS instructions per top-k kernel:"
  $(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump) -sass .devcarry/kbench_unstripped 2>/dev/null |
    awk '/Function :/{name=$3} /^ +\/\*[0-9a-f]+\*\//{n[name]++} END{for (k in n) if (k ~ /top_k/) print n[k], k}'
fi
timeout 150 $NEW/dsv4_gpu_tests --gtest_filter="${FILTER:-CudaModel.Fp32MatchesCpuOnTheTinyModel:CudaModel.Bf16GreedyTop1*:CudaModel.EngineGreedy*}" \
  > "$OUT/model_tests.log" 2>&1; echo "model tests rc=$?"
grep -E "^\[  (PASSED|FAILED) |Failure|Expected|Which|greedy top-1" "$OUT/model_tests.log" | head -12
