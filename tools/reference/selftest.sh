#!/usr/bin/env bash
# Self-test of the reference scripts on a machine with torch + transformers 5.17:
#   1. make_goldens.py writes every case into $GOLD (default /tmp/dsv4-goldens);
#   2. check_hf_load.py must PASS on each fixture, fed the fixture's own ids and logits.npy;
#   3. check_hf_load.py must FAIL on a corrupted copy (one tensor dropped, sinks zeroed,
#      a tid2eid row with a repeated expert).
# Usage: bash tools/reference/selftest.sh [GOLD_DIR] [--device cuda|cpu]
set -u -o pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
GOLD="${1:-/tmp/dsv4-goldens}"
shift || true
DEV=("$@")
export PYTHONUNBUFFERED=1
fail=0

python3 "$HERE/make_goldens.py" --out "$GOLD" "${DEV[@]}" || { echo "SELFTEST: make_goldens failed"; fail=1; }

for d in "$GOLD"/*/; do
  c="$(basename "$d")"
  [ -f "$d/golden.json" ] || continue
  python3 -c "import json,sys; print(','.join(map(str, json.load(open(sys.argv[1]))['ids'])))" \
    "$d/golden.json" > "/tmp/dsv4-ids-$c.txt"
  if python3 "$HERE/check_hf_load.py" "$d" --ids "@/tmp/dsv4-ids-$c.txt" --logits "$d/logits.npy" \
      --quiet-table "${DEV[@]}" > "/tmp/dsv4-check-$c.log" 2>&1; then
    echo "SELFTEST: check_hf_load PASS on $c (as expected)"
  else
    echo "SELFTEST: check_hf_load FAILED on good fixture $c:"; tail -30 "/tmp/dsv4-check-$c.log"; fail=1
  fi
  # chunked logits must also be within tolerance of HF one-shot
  if ! python3 "$HERE/check_hf_load.py" "$d" --ids "@/tmp/dsv4-ids-$c.txt" --logits "$d/logits_chunked.npy" \
      --quiet-table "${DEV[@]}" > "/tmp/dsv4-check-chunked-$c.log" 2>&1; then
    echo "SELFTEST: check_hf_load vs logits_chunked FAILED on $c"; tail -30 "/tmp/dsv4-check-chunked-$c.log"; fail=1
  fi
done

first="$(ls -d "$GOLD"/*/ 2>/dev/null | head -1)"
if [ -n "$first" ]; then
  BAD=/tmp/dsv4-bad-fixture
  rm -rf "$BAD"; mkdir -p "$BAD"
  cp "$first/config.json" "$BAD/"
  python3 - "$first/model.safetensors" "$BAD/model.safetensors" <<'EOF'
import sys, torch
from safetensors.torch import load_file, save_file
sd = load_file(sys.argv[1])
drop = sorted(k for k in sd if k.endswith("attn.wq_a.weight"))[0]
del sd[drop]
for k in sd:
    if k.endswith("attn_sink"):
        sd[k] = torch.zeros_like(sd[k])
    if k.endswith("tid2eid"):
        t = sd[k].clone(); t[5, 1] = t[5, 0]; sd[k] = t
save_file(sd, sys.argv[2], metadata={"format": "pt"})
print("corrupted copy: dropped", drop)
EOF
  if python3 "$HERE/check_hf_load.py" "$BAD" --quiet-table "${DEV[@]}" > /tmp/dsv4-check-bad.log 2>&1; then
    echo "SELFTEST: check_hf_load PASSED a corrupted fixture (wrong)"; tail -30 /tmp/dsv4-check-bad.log; fail=1
  else
    echo "SELFTEST: check_hf_load rejected the corrupted fixture (as expected):"
    grep -E "^  FAIL" /tmp/dsv4-check-bad.log | head -12
  fi
fi
echo "SELFTEST: $([ $fail = 0 ] && echo PASS || echo FAIL)"
exit $fail
