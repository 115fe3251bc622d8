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
LD_PRELOAD="$LIB" HAKMEM_SHM_DIR="$SHM" PYTHONMALLOC=malloc "$PY" - <<'PY' &
import time
end = time.time() + 3
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
echo
echo "hakmem-learnd (the next milestone) does what set-policy did here, per program, from evidence."
