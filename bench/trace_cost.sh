#!/usr/bin/env bash
# What capture (allocator/src/trace.c) costs a program while it is on:
# ns per malloc+free pair of bench/pair.c with capture off, SAMPLED
# (HAKMEM_TRACE_SAMPLE, default 1 MiB mean) and FULL, best of REPEAT runs,
# and the trace's bytes per event. Off must cost what it always did (the
# fast paths are unchanged: bench/callgrind.sh); on, every FULL call takes
# the slow path and is recorded, and SAMPLED sends every free there.
#   bench/trace_cost.sh [--pairs N] [--sizes "64 4096"] [--repeat R] [--sample BYTES] [LIB]
# The trace goes to a temporary directory under $TMPDIR (tmpfs is best: the
# figure is then the allocator's cost, not the disk's).
set -euo pipefail
cd "$(dirname "$0")/.."
pairs=2000000 sizes="64 4096" repeat=3 sample=1048576
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) sed -n 2,10p "$0" | sed 's/^# \{0,1\}//'; exit 0;;
    --pairs) pairs=$2; shift 2;;
    --sizes) sizes=$2; shift 2;;
    --repeat) repeat=$2; shift 2;;
    --sample) sample=$2; shift 2;;
    -*) echo "trace_cost.sh: error: unknown option $1" >&2; exit 2;;
    *) break;;
  esac
done
lib=$(readlink -f "${1:-${BUILD:-build}/libhakmem.so}")
[ -r "$lib" ] || { echo "trace_cost.sh: error: $lib: not found (make lib)" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cc -O2 -fno-builtin-malloc -fno-builtin-free -o "$tmp/pair" bench/pair.c
best() {   # best MODE SIZE -> "ns_per_pair bytes events"
  local b="" bytes=0 t
  for _ in $(seq "$repeat"); do
    rm -f "$tmp/t.trace"
    local env=(env -u HAKMEM_TRACE -u HAKMEM_TRACE_SAMPLE HAKMEM_TELEMETRY=0 LD_PRELOAD="$lib")
    case "$1" in
      full) env+=(HAKMEM_TRACE="$tmp/t.trace");;
      sampled) env+=(HAKMEM_TRACE="$tmp/t.trace" HAKMEM_TRACE_SAMPLE="$sample");;
    esac
    local t0 t1
    t0=$(date +%s%N); "${env[@]}" "$tmp/pair" "$pairs" "$2"; t1=$(date +%s%N)
    t=$(( (t1 - t0) ))
    if [ -z "$b" ] || [ "$t" -lt "$b" ]; then b=$t; fi
    bytes=$( [ -f "$tmp/t.trace" ] && stat -c %s "$tmp/t.trace" || echo 0)
  done
  awk -v t="$b" -v n="$pairs" -v by="$bytes" 'BEGIN { printf "%.1f %d", t / n, by }'
}
printf '%-8s %8s %12s %12s %14s\n' mode size ns/pair "x off" "trace bytes/ev"
for s in $sizes; do
  read -r off _ <<<"$(best off "$s")"
  for m in off sampled full; do
    read -r ns bytes <<<"$(best "$m" "$s")"
    per_ev=$(awk -v b="$bytes" -v n="$pairs" -v m="$m" 'BEGIN { if (m == "full" && b > 0) printf "%.1f", b / (2 * n); else print "-" }')
    printf '%-8s %8s %12s %12s %14s\n' "$m" "$s" "$ns" "$(awk -v a="$ns" -v b="$off" 'BEGIN { printf "%.2f", a / b }')" "$per_ev"
  done
done
