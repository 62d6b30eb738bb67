#!/usr/bin/env bash
# Sets up, builds (Release) and runs the whole CPU test suite. GPU tests (label `gpu`) skip without a device.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSV4_BUILD_TESTS=ON >/dev/null
cmake --build build
ctest --test-dir build --output-on-failure -j "$(nproc)"
