#!/usr/bin/env bash
# Fuzzes every parser of outside input (tests/fuzz/fuzz_entries.h) with libFuzzer under ASan +
# UBSan, independently of the kvx binary: builds the "sanitize" preset, runs each target for a
# fixed time or number of inputs from its seeds and its growing corpus (build-sanitize/fuzz/
# <target>/corpus), and reports executions, corpus size and crashes (kept in .../crashes).
#   usage: scripts/fuzz.sh [--seconds S (default 60) | --runs N] [target ...]
# A crash found here is fixed, then its input goes to tests/fuzz/regressions/<target>/, which
# the test suite replays.
set -euo pipefail
cd "$(dirname "$0")/.."
limit="-max_total_time=60"
targets=()
while (($#)); do
  case "$1" in
    --seconds) limit="-max_total_time=$2"; shift 2 ;;
    --runs) limit="-runs=$2"; shift 2 ;;
    -h | --help) sed -n 2,8p "$0"; exit 0 ;;
    -*) echo "fuzz.sh: unknown option $1 (try --help)" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
((${#targets[@]})) || targets=($(ls tests/fuzz/seeds))
for t in "${targets[@]}"; do
  [ -d "tests/fuzz/seeds/$t" ] || { echo "fuzz.sh: no target '$t' (targets: $(ls tests/fuzz/seeds | tr '\n' ' '))" >&2; exit 2; }
done
cmake --preset sanitize >/dev/null
cmake --build --preset sanitize -j"$(nproc)" >/dev/null

failed=0
printf "%-16s %12s %10s %8s %8s\n" target executions exec/s corpus crashes
for t in "${targets[@]}"; do
  dir=build-sanitize/fuzz/$t
  mkdir -p "$dir/corpus" "$dir/crashes"
  status=0
  build-sanitize/fuzz_"$t" "$limit" -print_final_stats=1 -dict=tests/fuzz/json.dict -artifact_prefix="$dir/crashes/" \
    "$dir/corpus" "tests/fuzz/seeds/$t" >"$dir/last.log" 2>&1 || status=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$dir/last.log")
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$dir/last.log")
  printf "%-16s %12s %10s %8s %8s\n" "$t" "${execs:-?}" "${rate:-?}" "$(ls "$dir/corpus" | wc -l)" "$(ls "$dir/crashes" | wc -l)"
  if [ "$status" -ne 0 ]; then
    failed=1
    grep -m3 -E "ERROR|runtime error|SUMMARY" "$dir/last.log" | sed 's/^/    /'
    echo "    full log: $dir/last.log; inputs: $dir/crashes/"
  fi
done
exit $failed
