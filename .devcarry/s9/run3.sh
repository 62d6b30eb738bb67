set -uo pipefail
C=.devcarry/s9
export DSV4_FIXTURES="$PWD/tests/fixtures"
export LD_LIBRARY_PATH="$C:/usr/local/cuda/lib64:/usr/local/cuda/lib"
which nsys ncu > $OUT/tools.txt 2>&1; ls /usr/local/cuda/bin | grep -iE "nsys|ncu" >> $OUT/tools.txt; ls /opt/nvidia 2>/dev/null >> $OUT/tools.txt
s=$(date +%s); timeout 150 $C/dsv4_kbench --suite fp8_gemm > $OUT/kbench.log 2>&1; echo "kbench rc=$? $(( $(date +%s)-s ))s" >> $OUT/rc.txt
NSYS=$(which nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
if [ -n "$NSYS" ]; then
  s=$(date +%s); timeout 200 $NSYS profile --cuda-graph-trace=node -t cuda -o $OUT/lat4 $C/dsv4 bench latency --model bench/configs/v4_flash_4layer.json --load-format dummy --device cuda --input-len 1024 --output-len 32 --batch-size 1 --num-iters 1 > $OUT/nsys_run.log 2>&1; echo "nsys rc=$? $(( $(date +%s)-s ))s" >> $OUT/rc.txt
  timeout 100 $NSYS stats --report cuda_gpu_kern_sum --format csv -o $OUT/kern $OUT/lat4.nsys-rep > $OUT/stats.log 2>&1
  timeout 100 $NSYS stats --report cuda_gpu_trace --format csv -o $OUT/trace $OUT/lat4.nsys-rep >> $OUT/stats.log 2>&1
  rm -f $OUT/lat4.sqlite; gzip $OUT/trace*.csv; ls -la $OUT
fi
cat $OUT/tools.txt $OUT/rc.txt
grep -E "^bf16 (chain|lt|wq|wkv|wo)" $OUT/kbench.log | grep -v "r64\|r512\|r4096" | cut -c1-140
head -40 $OUT/kern*.csv | cut -c1-220
