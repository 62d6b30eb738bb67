#!/usr/bin/env bash
# Runs the node tests of dsv4 serve with the official `openai` client (installed by scripts/setup.sh into
# tests/server/node_modules). Exit 77 (ctest: skipped) when node or the package is missing.
# usage: run_node_tests.sh DSV4_BINARY TEST_FILE...
set -euo pipefail
binary="$1"; shift
here="$(cd "$(dirname "$0")" && pwd)"
if ! command -v node >/dev/null || [ ! -f "$here/node_modules/openai/package.json" ]; then
  echo "skipped: node or the openai npm package is missing (run scripts/setup.sh)"
  exit 77
fi
cd "$here"
DSV4_BIN="$binary" exec node --test --test-reporter=spec "$@"
