#!/usr/bin/env bash
# bench/smoke.sh [LIB] — runs every benchmark for well under a second with
# LIB preloaded (default build/libhakmem.so) and checks its result line:
# valid JSON, the right "bench", "allocator":"hakmem", ops_per_sec > 0.
# Not a measurement: it proves each benchmark runs, and runs under hakmem.
set -euo pipefail
cd "$(dirname "$0")/.."
lib=${1:-${BUILD:-build}/libhakmem.so}
bin=${BUILD:-build}/bench
[ -f "$lib" ] || { echo "smoke: $lib not found: run \`make lib\` first" >&2; exit 1; }
lib=$(realpath "$lib")

# name, then arguments: tiny sizes
cases=(
  "random_mixed 200000 400 42"
  "tiny_hot 200000"
  "mid_large_mt 1 20000 100 42"
  "mid_large_mt 2 20000 100 42"
  "larson 2 0.1 16 1024 200 2000 42"
  "prodcons 2 50000 16 1024 42"
  "realloc_grow 10 65536 42"
  "aligned 50000 42"
  "large_churn 5 4 1 4 42"
  "startup 10 500"
  "xthread_mixed 4 2 2000 500 42"
  "burst_foreign 2 50 100 25 1000 42"
  "shared_slots 2 20000 500 42"
  "batch_handoff 40960 4096 64 4"
  "false_sharing active 2 10 100 8"
  "false_sharing passive 2 10 100 8"
  "object_replace 100 16 4096 1048576 42"
)

# Reads the result line on stdin; argv[1] is the expected "bench".
check='
import json, sys
want = sys.argv[1]
try:
    r = json.loads(sys.stdin.read())
except ValueError:
    sys.exit("last line is not JSON")
if not isinstance(r, dict) or r.get("bench") != want:
    sys.exit("bench is %r, expected %r" % (r.get("bench") if isinstance(r, dict) else r, want))
if r.get("allocator") != "hakmem":
    sys.exit("allocator is %r, expected hakmem (was the library preloaded?)" % r.get("allocator"))
ops = r.get("ops_per_sec")
if not (isinstance(ops, (int, float)) and ops > 0):
    sys.exit("ops_per_sec is %r" % ops)
print("%.3g ops/s" % ops)
'

fail=0
for c in "${cases[@]}"; do
  read -r name args <<<"$c"
  if [ ! -x "$bin/$name" ]; then
    echo "smoke: $bin/$name missing: run \`make bench-build\` first" >&2
    exit 1
  fi
  # shellcheck disable=SC2086 # args is a list of numbers
  out=$(LD_PRELOAD=$lib timeout 30 "$bin/$name" $args 2>&1) && rc=0 || rc=$?
  if [ $rc -ne 0 ]; then
    echo "FAIL $c: exit status $rc: $(tail -n1 <<<"$out")"
    fail=1
  elif msg=$(tail -n1 <<<"$out" | python3 -c "$check" "$name" 2>&1); then
    echo "ok   $c: $msg"
  else
    echo "FAIL $c: $msg"
    fail=1
  fi
done
[ $fail -eq 0 ] || { echo "smoke: some benchmarks failed" >&2; exit 1; }
echo "smoke: ${#cases[@]} benchmarks ran under hakmem"
