#!/usr/bin/env bash
# Issue 8's headline comparison in one device run: the 4-layer V4-Flash cut (bench/configs/v4_flash_4layer.json)
# written once as a bf16 checkpoint (`dsv4 init-random`), then `dsv4 bench latency` and HF transformers'
# DeepseekV4ForCausalLM (tools/reference/hf_speed.py) on the same weights and card: decode at batch 1 and 8 with
# 1K context (with each step's share of its bandwidth roofline), prefill of 4K tokens. Prints the table of docs/PERF.md "HF on the same H100" with the ratios last.
#   CARRY=.devcarry/new bench/run_hf_side_by_side_device.sh      (a carried, stripped dsv4)
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/device_env.sh"
MODEL_DIR=${MODEL_DIR:-/tmp/flash4}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
SECONDS=0
timeout 120 "$CARRY/dsv4" init-random --config bench/configs/v4_flash_4layer.json --out "$MODEL_DIR" --dtype bf16 \
  --seed 1 > "$OUT/init.log" 2>&1
echo "init-random rc=$? t=$SECONDS"
for run in 1 2; do
  timeout 120 "$CARRY/dsv4" bench latency --model "$MODEL_DIR" --device cuda --input-len 1024 --output-len 64 \
    --batch-size 1,8 --num-iters 2 --roofline > "$OUT/dsv4_decode_$run.log" 2>&1
  echo "dsv4 decode run $run rc=$? t=$SECONDS"
done
timeout 120 "$CARRY/dsv4" bench latency --model "$MODEL_DIR" --device cuda --input-len 4096 --output-len 2 \
  --batch-size 1 --num-iters 3 > "$OUT/dsv4_prefill.log" 2>&1
echo "dsv4 prefill rc=$? t=$SECONDS"
timeout 300 python3 tools/reference/hf_speed.py "$MODEL_DIR" --context 1024 --steps 16 --batches 1,8 --prefill 4096 \
  --json "$OUT/hf.json" > "$OUT/hf.log" 2>&1
echo "hf rc=$? t=$SECONDS"
rm -rf "$MODEL_DIR"
grep -h "Decode roofline" "$OUT"/dsv4_decode_*.log  # each decode step against its bandwidth roofline (docs/bench.md)
python3 - "$OUT" <<'EOF'
import json, re, sys
out = sys.argv[1]

def decode_ms(path):
    """ms/step per batch size, in the order bench latency printed them."""
    batches, values = [], []
    for line in open(path, errors="replace"):
        m = re.search(r"batch (\d+), input", line)
        if m:
            batches.append(int(m.group(1)))
        m = re.search(r"Decode: ([0-9.]+) ms/step", line)
        if m:
            values.append(float(m.group(1)))
    return dict(zip(batches, values))

def prefill_ms(path):
    m = re.findall(r"Prefill: ([0-9.]+) ms", open(path, errors="replace").read())
    return float(m[-1]) if m else None

try:
    hf = json.load(open(f"{out}/hf.json"))
except (OSError, ValueError):
    sys.exit("no HF figures (see hf.log)")
runs = [decode_ms(f"{out}/dsv4_decode_{run}.log") for run in (1, 2)]
print("| case | dsv4 (run 1 / 2) | HF | dsv4 / HF |")
print("|---|---|---|---|")
for batch in (1, 8):
    ours = [r[batch] for r in runs if batch in r]
    theirs = hf["decode_ms"].get(str(batch))
    if ours and theirs:
        print(f"| decode, batch {batch}, 1K context | {' / '.join(f'{v:.3f}' for v in ours)} ms | {theirs:.2f} ms | "
              f"{theirs / min(ours):.1f}x |")
ours = prefill_ms(f"{out}/dsv4_prefill.log")
theirs = hf["prefill_tokens_per_s"].get("4096")
if ours and isinstance(theirs, (int, float)):
    print(f"| prefill 4,096 tokens | {ours:.2f} ms | {4096 / theirs * 1e3:.1f} ms | {4096 / theirs * 1e3 / ours:.1f}x |")
elif ours:
    print(f"| prefill 4,096 tokens | {ours:.2f} ms | {theirs} | |")
EOF
