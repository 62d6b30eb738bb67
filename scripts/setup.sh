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
