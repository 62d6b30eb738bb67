set -uo pipefail
C=.devcarry/s9
export DSV4_FIXTURES="$PWD/tests/fixtures"
export LD_LIBRARY_PATH="$C:/usr/local/cuda/lib64:/usr/local/cuda/lib"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader > $OUT/gpu.txt
ldd $C/dsv4 $C/dsv4_gpu_tests | grep -i "not found" > $OUT/ldd.txt
s=$(date +%s); timeout 60 $C/dsv4_gpu_tests --gtest_filter='CudaSkinny*:CudaGemm*' > $OUT/skinny_tests.log 2>&1; echo "skinny tests rc=$? $(( $(date +%s)-s ))s" >> $OUT/rc.txt
s=$(date +%s); timeout 120 $C/dsv4_kbench --suite fp8_gemm > $OUT/kbench.log 2>&1; echo "kbench rc=$? $(( $(date +%s)-s ))s" >> $OUT/rc.txt
for mode in 1 0; do
  s=$(date +%s); DSV4_SKINNY_GEMM=$mode timeout 100 $C/dsv4 bench latency --model bench/configs/v4_flash_4layer.json --load-format dummy --device cuda --input-len 1024 --output-len 64 --batch-size 1,8 > $OUT/lat4_skinny$mode.log 2>&1; echo "lat4 skinny=$mode rc=$? $(( $(date +%s)-s ))s" >> $OUT/rc.txt
done
s=$(date +%s); timeout 200 $C/dsv4_gpu_tests > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc=$? $(( $(date +%s)-s ))s" >> $OUT/rc.txt
cat $OUT/gpu.txt $OUT/ldd.txt $OUT/rc.txt
grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|Failure|Expected|Which is" $OUT/skinny_tests.log $OUT/gpu_tests.log | head -30
grep -E "tests? ran" $OUT/gpu_tests.log
sed -n '/^device:/,/^ceilings:/p' $OUT/kbench.log
grep -E "^case|bf16" $OUT/kbench.log | head -60
for m in 1 0; do echo "== skinny=$m"; grep -E "^bench latency|^Prefill|^Per step|error" $OUT/lat4_skinny$m.log; done
