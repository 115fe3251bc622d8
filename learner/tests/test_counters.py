"""The telemetry ring's counters against what the workload itself did.

learnd learns from these counters, so they are compared with the truth, not
with another rendering of the same snapshot: `counted.c` reports exactly
how many blocks of each size it allocated, freed and left live, and with
how many threads. The allocator publishes other threads' counts on their
slow paths only, so the exact comparison is made where the contract makes
it exact: the last record, written at exit from the same snapshot as the
HAKMEM_STATS=1 table, after every thread has been joined. Every record read
while the program runs is held to the invariants that need no truth:
blocks out of slabs = live + cached, refills > 0 whenever refill blocks
grew, drains > 0 whenever drain blocks grew, a drain moves at most a cache
(4096 blocks) and a refill at most a batch (1024), cumulative counters never
go down; and the exit record to the derived ones as well (frees = allocs -
live, hits = allocs - refills, local >= frees - remote)."""
import json
import re
import subprocess
import time

from conftest import BUILD, LIB, clean_env, ring_path
from hakmem import layout as L
from hakmem.ring import Ring

COUNTED = BUILD / "learner" / "counted"
THREADS = 4


def start_counted(shm, threads=THREADS, **env):
    e = clean_env(LD_PRELOAD=str(LIB), HAKMEM_SHM_DIR=str(shm), HAKMEM_TELEMETRY_MS=10, HAKMEM_STATS=1, **env)
    return subprocess.Popen([str(COUNTED), str(threads)], env=e, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def check_invariants(rec, class_size, where, final=False):
    """The relations between one record's counters. Any record: blocks out
    of slabs = live + cached (both derived from the same reads), and a
    refill (drain) counted before its blocks. The final record (every
    thread joined, nothing racing): the derived counters exactly too, which
    mid-run may be held at their previous value while threads publish."""
    cls = rec["cls"]
    for c in range(1, L.NUM_CLASSES):
        k = {name: int(cls[name][c]) for name in L.CLASS_COUNTERS}
        if not k["refill_blocks"] and not k["allocs"]:
            continue
        msg = f"{where}: class {c}: {k}"
        assert k["live_bytes"] % class_size[c] == 0 and k["cached_bytes"] % class_size[c] == 0, msg
        live, cached = k["live_bytes"] // class_size[c], k["cached_bytes"] // class_size[c]
        assert k["refill_blocks"] - k["drain_blocks"] - k["lost_blocks"] == live + cached, msg
        assert k["refills"] > 0 or k["refill_blocks"] == 0, msg
        assert k["drains"] > 0 or k["drain_blocks"] == 0, msg
        assert k["drain_blocks"] <= k["drains"] * 4096, msg
        assert k["refill_blocks"] <= k["refills"] * 1024, msg
        if final:
            assert k["frees"] == k["allocs"] - live, msg
            assert k["hits"] == k["allocs"] - k["refills"], msg
            # local_frees = frees - remote_frees can go down (a block freed into
            # a cache counts as local until a drain finds its slab is another
            # thread's), and the ring holds every cumulative counter at its
            # previous value: here it can only be at least that (hk_stats_get,
            # which holds nothing, is checked for equality by test_counters.c).
            assert k["local_frees"] >= k["frees"] - k["remote_frees"], msg
            assert k["remote_frees"] <= k["drain_blocks"], msg


def check_grew_with(prev, rec, where):
    """Between two records: refill (drain) blocks grow only with refills
    (drains), and cumulative counters never go down."""
    for c in range(1, L.NUM_CLASSES):
        d = {name: int(rec["cls"][name][c]) - int(prev["cls"][name][c]) for name in L.CLASS_COUNTERS}
        msg = f"{where}: class {c} changed by {d}"
        for name in L.CLASS_COUNTERS:
            if name not in L.GAUGES:
                assert d[name] >= 0, msg
        if d["refill_blocks"] > 0:
            assert d["refills"] > 0, msg
        if d["drain_blocks"] > 0:
            assert d["drains"] > 0, msg
        assert d["drain_blocks"] <= d["drains"] * 4096, msg


def parse_table(text):
    """{class: allocs} and the huge line of the HAKMEM_STATS=1 table."""
    rows = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 16 and all(x.isdigit() for x in parts):
            rows[int(parts[0])] = int(parts[2])
    huge = re.search(r"huge: (\d+) allocs \((\d+) from cache\), (\d+) live bytes", text)
    assert huge, text
    return rows, tuple(map(int, huge.groups()))


def test_ring_counters_equal_what_the_workload_did(shm):
    p = start_counted(shm)
    try:
        ring = Ring(str(ring_path(shm, p.pid)))
        header = ring.header()
        class_size = header["class_size"]
        # Records while it churns: invariants, and the measured classes untouched.
        before = ring.latest()
        p.stdin.write("go\n")
        p.stdin.flush()
        prev = None
        while p.poll() is None:
            for r in ring.records():
                check_invariants(r, class_size, f"record {int(r['index'])}")
                if prev is not None and r["index"] > prev["index"]:
                    check_grew_with(prev, r, f"records {int(prev['index'])}..{int(r['index'])}")
                if prev is None or r["index"] > prev["index"]:
                    prev = r
            time.sleep(0.01)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert ring.exited()
    last = ring.latest()
    ring.close()
    check_invariants(last, class_size, "the exit record", final=True)
    if prev is not None:
        check_grew_with(prev, last, "the last record read .. the exit record")

    huge_allocs = 0
    for s in report["sizes"]:
        size, allocs, frees, live = s["size"], s["allocs"], s["frees"], s["live"]
        assert allocs == frees + live and live > 0
        c = next((c for c in range(1, L.NUM_CLASSES) if class_size[c] >= size), 0)
        if before is not None:
            assert int(before["cls"]["allocs"][c]) == 0, f"class {c} was used before the workload started"
        got = {name: int(last["cls"][name][c]) for name in L.CLASS_COUNTERS}
        where = f"{size} B (class {c}): the workload says {s}, the exit record {got}"
        assert got["allocs"] == allocs, where
        assert got["frees"] == frees, where
        if c == 0:
            huge_allocs += allocs
            assert got["live_bytes"] == live * size, where
            continue
        assert got["live_bytes"] == live * class_size[c], where
        # Exited threads keep nothing cached; the main thread never used the class.
        assert got["cached_bytes"] == 0, where
        assert got["refill_blocks"] - got["drain_blocks"] - got["lost_blocks"] == live, where
        assert got["refills"] > 0 and got["drains"] > 0, where
    proc = {name: int(last["proc"][name]) for name in L.PROC_COUNTERS}
    assert proc["huge_allocs"] == huge_allocs, proc
    assert proc["threads_total"] == report["threads"] + 1, proc   # the workers and main
    assert proc["threads"] == 1, proc

    # The table printed at exit says the same.
    rows, (t_huge, _, t_huge_live) = parse_table(err)
    assert t_huge == huge_allocs
    assert t_huge_live == int(last["cls"]["live_bytes"][0])
    for s in report["sizes"]:
        c = next((c for c in range(1, L.NUM_CLASSES) if class_size[c] >= s["size"]), 0)
        if c:
            assert rows[c] == s["allocs"], (c, rows.get(c), s)
