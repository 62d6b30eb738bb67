#!/usr/bin/env bash
# --enable-expert-parallel on CUDA through the CLI (cli/model_loading.cpp load_expert_parallel_ranks): 2 and 3
# ranks give one GPU model's greedy tokens, fp32 mode (the routed sum per rank, then in rank order, moves the
# logits by summation order only). On a one-GPU machine the ranks share it through the device in-process group;
# with enough GPUs each rank takes one and NCCL connects them. Then plain data parallelism with a process per rank.
# Skips (77) without a GPU.
#   tests/cli/cuda_expert_parallel_check.sh path/to/dsv4
set -uo pipefail
dsv4=$1
nvidia-smi -L >/dev/null 2>&1 || { echo "no GPU: skipped"; exit 77; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
run() { "$dsv4" generate --device cuda --dtype f32 --ids 5,6,7,8,9,10,11 --max-tokens 12 -n 4 --temperature 0 "$@"; }
run >"$work/one.out" 2>"$work/one.err" || { echo "FAIL one rank"; cat "$work/one.err"; exit 1; }
grep '^\[' "$work/one.out" | sort >"$work/one"
[ -s "$work/one" ] || { echo "FAIL one rank printed no tokens"; exit 1; }
for ranks in 2 3; do
  if run --data-parallel-size "$ranks" --enable-expert-parallel --dist-timeout 120 >"$work/ep.out" 2>"$work/ep.err"; then
    if grep '^\[' "$work/ep.out" | sort | cmp -s - "$work/one"; then
      echo "ok   $ranks expert-parallel ranks on CUDA: one model's greedy tokens ($(grep -c 'share cuda' "$work/ep.err") shared-GPU notes)"
    else
      echo "FAIL $ranks expert-parallel ranks differ from one model"; diff <(grep '^\[' "$work/ep.out" | sort) "$work/one"
      failures=$((failures + 1))
    fi
  else
    echo "FAIL $ranks expert-parallel ranks"; cat "$work/ep.err"; failures=$((failures + 1))
  fi
done
# One process per rank (--data-parallel-backend mp, plain data parallelism): 2 processes on the visible GPUs (sharing
# one on a one-GPU machine) give one model's greedy tokens.
if run --data-parallel-size 2 --data-parallel-backend mp >"$work/mp.out" 2>"$work/mp.err"; then
  if grep '^\[' "$work/mp.out" | sort | cmp -s - "$work/one"; then
    echo "ok   2 rank processes on CUDA: one model's greedy tokens"
  else
    echo "FAIL 2 rank processes differ from one model"; diff <(grep '^\[' "$work/mp.out" | sort) "$work/one"
    failures=$((failures + 1))
  fi
else
  echo "FAIL 2 rank processes"; cat "$work/mp.err"; failures=$((failures + 1))
fi
exit $((failures > 0))
