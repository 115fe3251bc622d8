#!/usr/bin/env bash
# Instructions per malloc+free pair, counted by callgrind: the fast path's
# cost, repeatable to the instruction (timings on a shared machine drift).
#   bench/callgrind.sh [--sizes "16 64 4096"] [LIB ...]   (default LIB: build/libhakmem.so)
# Each figure is (instructions of N pairs - instructions of 0 pairs) / N,
# so start-up and exit cancel out; it includes the loop's own 4 instructions
# and the amortized check-ins (alloc.c "check-in").
set -euo pipefail
cd "$(dirname "$0")/.."
sizes="16 64 512 4096 100000"
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then sed -n 2,7p "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
if [ "${1:-}" = "--sizes" ]; then sizes=$2; shift 2; fi
libs=("$@")
[ ${#libs[@]} -gt 0 ] || libs=("${BUILD:-build}/libhakmem.so")
command -v valgrind >/dev/null || { echo "callgrind.sh: valgrind is not installed (tools/install-deps.sh)" >&2; exit 1; }
for l in "${libs[@]}"; do [ -r "$l" ] || { echo "callgrind.sh: $l: not found (make lib)" >&2; exit 1; }; done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cc -O2 -fno-builtin-malloc -fno-builtin-free -o "$tmp/pair" bench/pair.c
N=1000000
count() {   # count LIB PAIRS SIZE -> instructions of the pair program
  LD_PRELOAD="$(readlink -f "$1")" valgrind --tool=callgrind --callgrind-out-file="$tmp/out" \
    "$tmp/pair" "$2" "$3" 2>&1 >/dev/null | sed -n 's/.*Collected : \([0-9]*\).*/\1/p' | tail -n1
}
printf '%-40s' "instructions per pair, size:"
for s in $sizes; do printf '%9s' "$s"; done
echo
for l in "${libs[@]}"; do
  printf '%-40s' "$l"
  for s in $sizes; do
    a=$(count "$l" 0 "$s"); b=$(count "$l" $N "$s")
    printf '%9s' "$(awk -v a="$a" -v b="$b" -v n=$N 'BEGIN { printf "%.2f", (b - a) / n }')"
  done
  echo
done
