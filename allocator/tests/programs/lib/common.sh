# lib/common.sh — shared by the programs/NN_*.sh tests. It lives in lib/ so
# that run.sh (which runs every programs/*.sh) does not take it for a test.
# A test sets name=NN_x, then sources this file relative to its own location:
#   name=01_python
#   . "$(dirname "$0")/lib/common.sh" || exit 1
# which sets -u and LC_ALL=C, defines fail/skip and checks LIB. The test then
# checks its own prerequisites (need_cmd, skip) and calls setup_scratch, writes
# its workload, runs it plain and preloaded into $T/TAG.{out,err,rc}, and
# compares the two runs with check_preloaded_stderr, check_plain_rc and
# check_same (its own extra checks in between), and check_served: the
# preloaded run's HAKMEM_STATS=1 tables (one per process, on stderr) must
# count at least as many allocations as the workload is known to make, so a
# library that is mapped but not called (a program that links its own
# malloc, a preload that lost to another) fails.
#
# Env: LIB = absolute path of libhakmem.so (required); WORK = scratch dir
# (optional); KEEP = non-empty keeps the scratch dir.
set -u
export LC_ALL=C
# Every preloaded process prints its counters at exit (stderr), which
# check_served reads; plain runs ignore it.
export HAKMEM_STATS=1

# fail MSG [FILE]: report a failure (with the head of FILE) and exit 1.
fail() { echo "$name: FAIL: $1"; [ -n "${2:-}" ] && [ -f "$2" ] && head -n 30 "$2"; exit 1; }
# skip MSG: report a skip and exit 77.
skip() { echo "$name: SKIP: $1"; exit 77; }
# need_cmd CMD: skip unless CMD is installed.
need_cmd() { command -v "$1" >/dev/null 2>&1 || skip "$1 not installed"; }

[ -n "${LIB:-}" ] && [ -f "$LIB" ] || fail "LIB is unset or not a file: '${LIB:-}'"
case "$LIB" in /*) ;; *) fail "LIB must be an absolute path: '$LIB'";; esac

# setup_scratch [SECONDS]: makes the scratch dir $T (removed at exit unless
# KEEP is set), sets $TO to a timeout prefix (SECONDS, default 60; empty when
# timeout is missing) and checks that LD_PRELOAD really maps $LIB.
setup_scratch() {
  local base=${WORK:-${TMPDIR:-/tmp}}; mkdir -p "$base" || fail "cannot create WORK '$base'"
  T=$(mktemp -d "$base/$name.XXXXXX") || fail "mktemp failed"
  trap '[ -n "${KEEP:-}" ] || rm -rf "$T"' EXIT
  TO=$(command -v timeout >/dev/null 2>&1 && echo "timeout -k 5 ${1:-60}" || echo "")
  # Smoke test: the library must really be mapped into a preloaded process.
  LD_PRELOAD="$LIB" cat /proc/self/maps >"$T/maps" 2>"$T/maps.err" || fail "preloaded /bin/cat failed (rc $?)" "$T/maps.err"
  grep -qF "$(basename "$LIB")" "$T/maps" || fail "'$LIB' is not mapped in a preloaded process (LD_PRELOAD ignored?)" "$T/maps.err"
}

# check_preloaded_stderr Q [LABEL]: the preloaded run Q printed no "hakmem:"
# but its stats tables, and ld.so did not refuse to preload. LABEL names Q
# in the message.
check_preloaded_stderr() {
  local q=$1 what=${2:-preloaded run}
  grep "hakmem:" "$T/$q.err" | grep -qv "^hakmem: stats (" &&
    { echo "$name: FAIL: $what printed 'hakmem:' on stderr"; grep "hakmem:" "$T/$q.err" | grep -v "^hakmem: stats (" | head -n 5; exit 1; }
  grep -q "cannot be preloaded" "$T/$q.err" && fail "LD_PRELOAD of '$LIB' was ignored by ld.so" "$T/$q.err"
}

# check_plain_rc P WHY [LABEL]: the plain run P exited 0 (else the test, not
# hakmem, is broken: WHY says how).
check_plain_rc() {
  local p=$1 why=$2 what=${3:-plain run}
  [ "$(cat "$T/$p.rc")" = 0 ] || fail "$what exited $(cat "$T/$p.rc") ($why)" "$T/$p.err"
}

# check_same P Q [LABEL [DIFFERS]]: the preloaded run Q exited like the plain
# run P and printed the same stdout. LABEL names Q; DIFFERS is the message
# for differing output.
check_same() {
  local p=$1 q=$2 what=${3:-preloaded run} differs=${4:-stdout differs (plain vs preloaded)}
  if [ "$(cat "$T/$q.rc")" != "$(cat "$T/$p.rc")" ]; then
    echo "$name: FAIL: $what exited $(cat "$T/$q.rc"), plain exited $(cat "$T/$p.rc")"; tail -n 20 "$T/$q.err"; exit 1
  fi
  if ! cmp -s "$T/$p.out" "$T/$q.out"; then
    echo "$name: FAIL: $differs"; diff "$T/$p.out" "$T/$q.out" | head -n 20; tail -n 5 "$T/$q.err"; exit 1
  fi
}

# served_allocs FILE: "ALLOCS TABLES": the allocations counted by every
# HAKMEM_STATS=1 table in FILE (class rows' allocs column, plus huge
# allocations) and how many tables (processes) there were.
served_allocs() {
  # Processes that share the file may interleave their lines (each line is
  # one write), so a class row is any line of 16 numbers.
  awk '
    /^hakmem: stats \(/ { tables++; next }
    /^  huge: [0-9]+ allocs/ { total += $2; next }
    NF == 16 { for (i = 1; i <= 16; i++) if ($i !~ /^[0-9]+$/) next; total += $3 }
    END { printf "%d %d\n", total, tables }' "$1"
}

# check_served FILE MIN [LABEL]: the tables in FILE count at least MIN
# allocations: hakmem really served the program.
check_served() {
  local file=$1 min=$2 what=${3:-preloaded run} n tables
  read -r n tables <<<"$(served_allocs "$file")"
  [ "${tables:-0}" -gt 0 ] || fail "$what printed no HAKMEM_STATS=1 table: was hakmem the allocator?" "$file"
  [ "$n" -ge "$min" ] || fail "$what: hakmem counted $n allocations in $tables processes, expected at least $min" "$file"
  echo "$name: $what: hakmem served $n allocations in $tables processes (at least $min expected)"
}
