set -uo pipefail
C=.devcarry/s9
export DSV4_FIXTURES="$PWD/tests/fixtures"
export LD_LIBRARY_PATH="$C:/usr/local/cuda/lib64:/usr/local/cuda/lib"
s=$(date +%s); DSV4_CUDA_GRAPHS=0 timeout 240 ncu --metrics gpu__time_duration.sum --csv --print-units base --cache-control none --clock-control none $C/dsv4 bench latency --model bench/configs/v4_flash_4layer.json --load-format dummy --device cuda --input-len 256 --output-len 6 --batch-size 1 --num-iters-warmup 0 --num-iters 1 > $OUT/ncu.csv 2> $OUT/ncu.err; echo "ncu rc=$? $(( $(date +%s)-s ))s" >> $OUT/rc.txt
gzip -k $OUT/ncu.csv
for mode in 1 0; do
  s=$(date +%s); DSV4_SKINNY_GEMM=$mode timeout 100 $C/dsv4 bench latency --model bench/configs/v4_flash_4layer.json --load-format dummy --device cuda --input-len 1024 --output-len 64 --batch-size 1,8 > $OUT/lat4_skinny$mode.log 2>&1; echo "lat4 skinny=$mode rc=$? $(( $(date +%s)-s ))s" >> $OUT/rc.txt
done
s=$(date +%s); timeout 200 $C/dsv4_gpu_tests > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc=$? $(( $(date +%s)-s ))s" >> $OUT/rc.txt
cat $OUT/rc.txt; tail -3 $OUT/ncu.err
grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|Failure" $OUT/gpu_tests.log | head
wc -l $OUT/ncu.csv
for m in 1 0; do echo "== skinny=$m"; grep -E "^Prefill|error" $OUT/lat4_skinny$m.log; done
