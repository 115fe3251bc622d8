#!/usr/bin/env bash
# 01_python.sh — proves CPython runs unchanged with hakmem preloaded: an
# allocation-heavy script (dicts, lists, strings, tuples, sets, bytes/bytearray
# growth, objects freed and rebuilt, a few hundred thousand live objects) gives
# byte-identical stdout and exit status with and without LD_PRELOAD. It runs
# twice per mode: with pymalloc (default) and with PYTHONMALLOC=malloc, so that
# every object, small ones included, goes through hakmem's malloc/realloc/free.
#
# Env: LIB = absolute path of libhakmem.so (required); WORK = scratch dir
# (optional). Exit 0 pass, 77 skip (python3 missing), anything else = fail.
name=01_python
. "$(dirname "$0")/lib/common.sh" || exit 1
if [ -x /usr/bin/python3 ]; then PY=/usr/bin/python3
elif command -v python3 >/dev/null 2>&1; then PY=$(command -v python3)
else skip "python3 not installed"; fi
setup_scratch 60

cat > "$T/work.py" <<'PY'
import sys, zlib, hashlib, random, gc, json
random.seed(12345)
h = hashlib.sha256()
def feed(*xs):
    for x in xs:
        h.update(repr(x).encode())

# 1. many small dicts/lists/strings, built, mutated, freed, rebuilt
for rnd in range(3):
    recs = []
    for i in range(60000):
        d = {"id": i, "name": "n%07d" % (i * 7919 % 1000003), "tags": [str(j) * (j % 5 + 1) for j in range(i % 7)],
             "pt": (i, i * 2.5, -i), "s": {i % 13, i % 17}}
        recs.append(d)
    # free every other record, then rebuild with different sizes
    del recs[::2]
    for i in range(0, len(recs), 3):
        recs[i] = {"id": -i, "blob": "x" * (i % 300), "more": list(range(i % 40))}
    acc = 0
    for r in recs:
        acc = (acc * 31 + r["id"] + len(r.get("name", "")) + len(r.get("blob", "")) + sum(r.get("more", ()))) & 0xFFFFFFFF
    feed(rnd, len(recs), acc)
    del recs
    gc.collect()

# 2. a big dict of strings, resized many times, keys deleted and reinserted
big = {}
for i in range(200000):
    big["k%x" % (i * 2654435761 & 0xFFFFFFFF)] = i
for i in range(0, 200000, 2):
    del big["k%x" % (i * 2654435761 & 0xFFFFFFFF)]
for i in range(0, 200000, 4):
    big["r%d" % i] = "v" * (i % 64)
feed(len(big), sum(len(k) for k in big), sum(v if isinstance(v, int) else len(v) for v in big.values()))
feed(sorted(big.items(), key=lambda kv: kv[0])[:50:7])
del big

# 3. string building, splitting, joining, bytes and bytearray growth
words = ["".join(chr(97 + (i * j) % 26) for j in range(1 + i % 12)) for i in range(50000)]
text = " ".join(words)
parts = text.split(" ")
feed(len(text), len(parts), zlib.crc32(text.encode()))
ba = bytearray()
for i in range(100000):
    ba += bytes([i & 0xFF]) * (i % 9)
    if i % 1000 == 999:
        ba = ba[len(ba) // 2:]     # shrink: copy and free the old buffer
feed(len(ba), zlib.adler32(bytes(ba)))
counts = {}
for w in parts:
    counts[w] = counts.get(w, 0) + 1
top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:20]
feed(top)

# 4. object graphs with cycles, collected by the GC
class Node:
    __slots__ = ("v", "nxt", "data")
    def __init__(self, v):
        self.v = v; self.nxt = None; self.data = [v] * (v % 10)
for rnd in range(4):
    nodes = [Node(i) for i in range(50000)]
    for i, n in enumerate(nodes):
        n.nxt = nodes[(i * 7 + 3) % len(nodes)]
    s = sum(n.nxt.v for n in nodes[::11])
    feed(rnd, s)
    del nodes, n
    feed(gc.collect() >= 0)

# 5. random-sized list growth and shrink (realloc heavy), json round trip
lists = [[] for _ in range(500)]
for i in range(200000):
    l = lists[random.randrange(500)]
    l.append(i)
    if len(l) > random.randrange(50, 2000):
        del l[: len(l) // 2]
feed([len(l) for l in lists][:40], sum(map(sum, lists)) & 0xFFFFFFFF)
doc = {"a%d" % i: [i, str(i) * 3, {"x": i / 7}] for i in range(20000)}
js = json.dumps(doc, sort_keys=True)
back = json.loads(js)
feed(len(js), zlib.crc32(js.encode()), back == doc)

print("python-workload", h.hexdigest())
PY

# run MODE: "plain" or "pre"; PYMODE: "" or "malloc"
run() {
  local mode=$1 pym=$2 tag="$1.${2:-pymalloc}"
  if [ "$mode" = pre ]; then
    (cd "$T" && env PYTHONHASHSEED=0 PYTHONDONTWRITEBYTECODE=1 ${pym:+PYTHONMALLOC=$pym} LD_PRELOAD="$LIB" \
       $TO "$PY" -S work.py >"$T/$tag.out" 2>"$T/$tag.err"); echo $? >"$T/$tag.rc"
  else
    (cd "$T" && env PYTHONHASHSEED=0 PYTHONDONTWRITEBYTECODE=1 ${pym:+PYTHONMALLOC=$pym} \
       $TO "$PY" -S work.py >"$T/$tag.out" 2>"$T/$tag.err"); echo $? >"$T/$tag.rc"
  fi
}
# Allocations hakmem must count in one preloaded run (measured: about 15k
# with pymalloc, which keeps small objects to itself, and 12.5M without).
served_min() { if [ "$1" = malloc ]; then echo 5000000; else echo 5000; fi; }
check() {   # check PYMODE
  local p="plain.${1:-pymalloc}" q="pre.${1:-pymalloc}"
  check_preloaded_stderr "$q" "preloaded run ($q)"
  check_served "$T/$q.err" "$(served_min "$1")" "preloaded run ($q)"
  check_plain_rc "$p" "test bug or broken python" "plain run ($p)"
  [ -s "$T/$p.out" ] || fail "plain run ($p) printed nothing" "$T/$p.err"
  check_same "$p" "$q" "preloaded run ($q)" "stdout differs ($p vs $q)"
}
for pym in "" malloc; do
  run plain "$pym"; run pre "$pym"; check "$pym"
done
echo "$name: PASS ($(cat "$T/plain.pymalloc.out"))"
exit 0
