#!/usr/bin/env bash
# `dsv4 bench serve` against a real `dsv4 serve` (the embedded model) on loopback: every request succeeds, on
# both endpoints, and the result file holds the counts and the latency figures.
# usage: bench_serve_check.sh DSV4_BINARY
set -euo pipefail
dsv4="$1"
work="$(mktemp -d)"
trap 'kill -TERM "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; rm -rf "$work"' EXIT
"$dsv4" serve --port 0 --max-num-seqs 64 >"$work/serve.log" 2>&1 &
server=$!
for _ in $(seq 1 600); do
  grep -q 'on http://' "$work/serve.log" && break
  sleep 0.1
done
port=$(sed -n 's/.*on http:\/\/[^:]*:\([0-9]*\).*/\1/p' "$work/serve.log")
[ -n "$port" ] || { echo "FAIL: the server did not start"; cat "$work/serve.log"; exit 1; }
for endpoint in /v1/completions /v1/chat/completions; do
  "$dsv4" bench serve --base-url "http://127.0.0.1:$port" --endpoint "$endpoint" --num-prompts 40 \
    --request-rate 50 --input-len 64 --output-len 8 --seed 3 --result-file "$work/result.json" >"$work/bench.log" 2>&1 ||
    { echo "FAIL: bench serve $endpoint"; cat "$work/bench.log"; exit 1; }
  if python3 - "$work/result.json" "$endpoint" <<'PY'
import json, sys
result = json.load(open(sys.argv[1]))
flat = json.dumps(result)
def find(key):
    stack = [result]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if key in node and not isinstance(node[key], (dict, list)): return node[key]
            stack.extend(node.values())
    raise SystemExit(f"FAIL: no '{key}' in the result file: {flat[:400]}")
completed, failed = find("completed"), find("failed")
if completed != 40 or failed != 0:
    errors = sorted({e for e in result.get("errors", []) if e})
    raise SystemExit(f"FAIL {sys.argv[2]}: {completed} completed, {failed} failed: {errors}")
assert find("mean_ttft_ms") > 0 and find("output_throughput") > 0
print(f"ok {sys.argv[2]}: {completed} requests, mean TTFT {find('mean_ttft_ms'):.1f} ms")
PY
  then :; else echo "--- bench log"; cat "$work/bench.log"; echo "--- server log (tail)"; tail -n 40 "$work/serve.log"; exit 1; fi
done
