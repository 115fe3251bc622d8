#!/usr/bin/env bash
# bench/fastpath_budget.sh [LIB] — fails when a malloc+free pair costs more
# instructions (callgrind, bench/callgrind.sh) than bench/fastpath_budget.txt
# allows for its size. Instruction counts are repeatable to the instruction,
# so the budget holds on any machine, loaded or not.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then sed -n 2,5p "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
lib=${1:-${BUILD:-build}/libhakmem.so}
budget=bench/fastpath_budget.txt
sizes=$(awk '!/^#/ && NF == 2 { printf "%s ", $1 }' "$budget")
out=$(bench/callgrind.sh --sizes "$sizes" "$lib")
echo "$out"
measured=$(echo "$out" | tail -n1 | awk '{ for (i = 2; i <= NF; i++) printf "%s ", $i }')
fail=0
set -- $measured
for s in $sizes; do
  limit=$(awk -v s="$s" '$1 == s { print $2 }' "$budget")
  if awk -v m="$1" -v l="$limit" 'BEGIN { exit !(m > l) }'; then
    echo "fastpath_budget: size $s: $1 instructions per pair, over the budget of $limit ($budget)" >&2
    fail=1
  else
    echo "size $s: $1 <= $limit"
  fi
  shift
done
exit $fail
