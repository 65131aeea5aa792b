#!/usr/bin/env bash
# kvx set-up on Debian 12: installs what is missing (idempotent; as root or with sudo), builds
# into build/, and fetches the corpora into data/ (or $KVX_DATA_DIR).
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(cmake make g++ git ccache pkg-config libtorch-dev libopenblas0-pthread libcli11-dev
          nlohmann-json3-dev libicu-dev libgtest-dev googletest bible-kjv gnuplot-nox fonts-dejavu-core
          libgloo-dev clang libclang-rt-14-dev libomp-dev  # Gloo headers (c10d); then the sanitizer and fuzzing build
          pybind11-dev python3-dev python3-numpy python3-torch python3-pytest)  # the Python module and its tests
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
command -v npm >/dev/null 2>&1 || missing+=(npm)
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

jobs=$(nproc)
cmake --preset release >/dev/null
cmake --build --preset release -j"$jobs"
build/kvx data fetch
