#!/usr/bin/env bash
# The test command: set-up (install, build, data), every test through ctest, then the sanitizer
# build's tests and fuzzing smoke.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
ctest --test-dir build --output-on-failure -j"$(nproc)"
# The torch-free tests again under AddressSanitizer + UndefinedBehaviorSanitizer, and a few
# seconds of libFuzzer per parser of outside input (scripts/fuzz.sh runs longer campaigns).
cmake --preset sanitize >/dev/null
cmake --build --preset sanitize -j"$(nproc)"
ctest --preset sanitize -j"$(nproc)"
