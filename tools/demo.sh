#!/usr/bin/env bash
# make demo: real programs with hakmem preloaded, and what hakmem saw.
set -euo pipefail
BUILD=${1:-build}
LIB=$(readlink -f "$BUILD/libhakmem.so")
PY=/usr/bin/python3; [ -x "$PY" ] || PY=python3
echo "== python3 building and dropping a million small objects, hakmem preloaded"
LD_PRELOAD="$LIB" HAKMEM_STATS=1 "$PY" - <<'PY'
import random
random.seed(1)
d = {}
for r in range(5):
    d = {i: [str(i) * (i % 7), (i, r)] for i in range(200000)}
    s = [x for x in d.values() if len(x[0]) > 3]
print("python3: rebuilt 5 x 200k dicts,", len(s), "kept")
PY
echo
echo "== sqlite3 inserting and querying 200k rows, hakmem preloaded"
LD_PRELOAD="$LIB" HAKMEM_STATS=1 sqlite3 :memory: <<'SQL'
CREATE TABLE t(id INTEGER PRIMARY KEY, name TEXT, v REAL);
WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c WHERE x < 200000)
INSERT INTO t SELECT x, 'name-' || (x % 977), x * 0.5 FROM c;
CREATE INDEX t_name ON t(name);
SELECT 'sqlite3: ' || count(*) || ' rows, ' || count(DISTINCT name) || ' names' FROM t;
SQL
echo
echo "The tables above are HAKMEM_STATS=1: per size class, blocks handed out, thread-cache"
echo "refills and drains, slabs taken from and given back to the warm pool and the OS, then the"
echo "policy knobs in force."
echo
echo "== the telemetry file: a running python3 seen from outside, and its policy changed live"
SHM=$(mktemp -d /dev/shm/hakmem-demo.XXXXXX)
trap 'rm -rf "$SHM"' EXIT
# A reader's lease on the directory, as learnd holds its own: a process makes
# its file only while somebody holds it (learner/hakmem/lease.py).
exec 3< <(exec .venv/bin/python -c 'import sys, time
from hakmem.lease import Lease
Lease(sys.argv[1], "tools/demo.sh").acquire()
print("held", flush=True)
time.sleep(600)' "$SHM")
lease=$!
trap 'kill $lease 2>/dev/null || true; rm -rf "$SHM"' EXIT
read -r -u 3 _ || { echo "demo: cannot hold the lease on $SHM"; exit 1; }
LD_PRELOAD="$LIB" HAKMEM_SHM_DIR="$SHM" PYTHONMALLOC=malloc "$PY" - <<'PY' &
import time
end = time.time() + 6
while time.time() < end:
    d = [bytes(48) + str(i).encode() for i in range(3000)]   # 64..80-byte objects, in bursts
PY
pid=$!
sleep 1
echo "\$ hakmem ring dump $pid"
.venv/bin/hakmem ring dump --dir "$SHM" "$pid"
echo
echo "\$ hakmem ring set-policy $pid tcache_cap@96=4096"
.venv/bin/hakmem ring set-policy --dir "$SHM" "$pid" tcache_cap@96=4096
sleep 1
echo
echo "\$ hakmem ring dump $pid    # 4096 holds a whole burst: no refills, so no slow path at all"
.venv/bin/hakmem ring dump --dir "$SHM" "$pid"
wait "$pid"
kill $lease 2>/dev/null || true
exec 3<&-
echo
echo "== hakmem-learnd tuning a program it has never seen, then remembering it"
# A private database and directories under build/, so the demo never touches
# a real installation's /var/lib/hakmem or /dev/shm/hakmem.
D=$(readlink -f "$BUILD")/demo
rm -rf "$D"; mkdir -p "$D"
LEARND=(.venv/bin/hakmem-learnd --foreground --db "$D/learn.db" --shm-dir "$D/shm" --run-dir "$D/run"
        --sample-period 0.5)
hk() { .venv/bin/hakmem "$@" --db "$D/learn.db" --run-dir "$D/run"; }
"${LEARND[@]}" 2>"$D/learnd.log" &
learnd=$!
trap 'kill $learnd 2>/dev/null || true; rm -rf "$SHM"' EXIT
for _ in $(seq 100); do grep -q "ready:" "$D/learnd.log" 2>/dev/null && break; sleep 0.2; done
hk events >"$D/events.log" 2>&1 &
events=$!
echo "\$ workload burst 64 4000 20   # bursts of 4000 64-byte blocks: the default 1024-block cache overflows"
LD_PRELOAD="$LIB" HAKMEM_SHM_DIR="$D/shm" "$BUILD/learner/workload" burst 64 4000 20 >"$D/workload.out" &
wl=$!
sleep 8
echo "\$ hakmem status"
hk status
wait $wl
sleep 1
kill $events 2>/dev/null; wait $events 2>/dev/null || true
echo
echo "\$ hakmem events    # what learnd published while it ran"
sed -n '1,25p' "$D/events.log"
echo
echo "\$ hakmem policy list workload"
hk policy list workload
echo
echo "\$ hakmem policy show workload    # the best policy, where it differs from the default"
hk policy show workload
echo
echo "\$ sqlite3 $D/learn.db 'SELECT ... FROM evaluations'"
sqlite3 -header -column "$D/learn.db" "SELECT p.version, e.verdict, e.windows, printf('%.4f', e.cost_mean) AS cost,
  printf('%.4f', e.baseline_cost) AS baseline FROM evaluations e JOIN policies p ON p.id = e.policy_id ORDER BY e.id"
echo
echo "\$ workload burst 64 4000 3   # the same program again: learnd applies its best policy at start"
LD_PRELOAD="$LIB" HAKMEM_SHM_DIR="$D/shm" "$BUILD/learner/workload" burst 64 4000 3 >/dev/null
sleep 1
grep "warm_start" "$D/learnd.log" | tail -n 1
kill $learnd; wait $learnd || true
echo
echo "learnd's own log: $D/learnd.log; its database: $D/learn.db (sqlite3 works on it)."
