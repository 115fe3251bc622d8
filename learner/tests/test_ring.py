"""The telemetry file end to end: a preloaded workload publishes, the Python
reader reads, policies written through the snapshot take effect."""
import json
import os
import re
import shutil
import stat
import subprocess
import time

import numpy as np
import pytest

from conftest import LIB, WORKLOAD, clean_env, proc_start_time, ring_path, run_cli, scaled, start, wait_for
from hakmem import layout as L
from hakmem.ring import Ring, RingError

CLS64 = 4   # the class serving 64-byte blocks


def ring_files(d):
    """What processes left in a telemetry directory: all but the lease."""
    return sorted(p for p in d.iterdir() if p.name != "learnd.lock")


# ---- the file's life ---------------------------------------------------------
def test_no_file_when_directory_is_absent(tmp_path):
    absent = tmp_path / "absent"
    p = start(["burst", 64, 2000, 0.3], absent)
    assert p.wait(timeout=scaled(30)) == 0
    assert not absent.exists()
    assert list(tmp_path.iterdir()) == []


def test_no_file_when_telemetry_is_off(shm):
    p = start(["burst", 64, 2000, 0.3], shm, HAKMEM_TELEMETRY=0)
    assert p.wait(timeout=scaled(30)) == 0
    assert ring_files(shm) == []


def test_file_name_mode_owner_and_removal(shm):
    p = start(["burst", 64, 2000, 1.0], shm)
    path = ring_path(shm, p.pid)
    assert path.name == f"{p.pid}-{proc_start_time(p.pid)}"
    st = path.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == os.getuid()
    with Ring(str(path)) as r:
        h = r.header()
        assert h["pid"] == p.pid and r.alive
        assert h["exe"].endswith("/workload")
        assert re.fullmatch(r"[0-9a-f]{40}", h["build_id"]), h["build_id"]
        assert h["class_size"][CLS64] == 64
    assert p.wait(timeout=scaled(30)) == 0
    assert not path.exists(), "the file must go at normal exit"


def test_exec_replaces_the_file_of_the_image_before(shm):
    # bash (preloaded, so it publishes) execs the workload: same pid, same
    # start time, so the same name; the new image replaces the old file.
    env = clean_env(LD_PRELOAD=str(LIB), HAKMEM_SHM_DIR=str(shm))
    p = subprocess.Popen(["bash", "-c", f"exec {WORKLOAD} burst 64 2000 1.0"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def workload_file():
        files = list(shm.glob(f"{p.pid}-*"))
        if len(files) != 1:
            return None
        try:
            with Ring(str(files[0])) as r:
                return files[0] if r.header()["exe"].endswith("/workload") else None
        except RingError:
            return None
    wait_for(workload_file, 5, "the exec'd image's own file")
    assert p.wait(timeout=scaled(30)) == 0
    assert ring_files(shm) == []


def test_forked_child_has_its_own_file(shm):
    p = start(["fork", 1.0], shm)
    parent_file = ring_path(shm, p.pid)
    line = json.loads(p.stdout.readline())
    child = line["child"]
    child_file = ring_path(shm, child)
    assert child_file != parent_file
    with Ring(str(child_file)) as r:
        assert r.header()["pid"] == child
        # The child writes its own records into its own ring.
        wait_for(lambda: r.ring_head() > 0, 5, "a record in the child's ring")
    with Ring(str(parent_file)) as r:
        assert r.header()["pid"] == p.pid
    assert p.wait(timeout=scaled(30)) == 0
    assert ring_files(shm) == [], "both files must go at exit"


# ---- counters ----------------------------------------------------------------
def parse_stats(text):
    """The HAKMEM_STATS=1 table: {class: {column: value}} and the os line."""
    os_line = re.search(r"os: mmap (\d+)\s+munmap (\d+)\s+madvise (\d+)", text)
    rows, cols = {}, None
    for line in text.splitlines():
        parts = line.split()
        if parts[:2] == ["class", "size"]:
            cols = parts
        elif cols and len(parts) == len(cols) and all(x.isdigit() for x in parts):
            rows[int(parts[0])] = dict(zip(cols, map(int, parts)))
    assert os_line and rows, f"no stats table in:\n{text}"
    return rows, tuple(map(int, os_line.groups()))


def test_counters_monotonic_and_exit_totals_match_stats(shm):
    p = start(["mixed", 2, scaled(2.0)], shm, HAKMEM_STATS=1)
    ring = Ring(str(ring_path(shm, p.pid)))
    prev = None
    samples = 0
    while p.poll() is None:
        recs = ring.records()
        for r in recs:
            if prev is not None and r["index"] > prev["index"]:
                for name in L.CLASS_COUNTERS:
                    if name in L.GAUGES:
                        continue
                    bad = np.nonzero(r["cls"][name] < prev["cls"][name])[0]
                    assert not len(bad), f"{name} went down in classes {bad.tolist()}"
                for name in L.PROC_COUNTERS:
                    if name not in L.GAUGES:
                        assert r["proc"][name] >= prev["proc"][name], name
            if prev is None or r["index"] > prev["index"]:
                prev = r
        samples += 1
        time.sleep(0.03)        # the sampling interval
    out, err = p.communicate(timeout=scaled(30))
    assert p.returncode == 0, err
    assert samples > 10 and prev is not None and prev["index"] >= 10
    # The file is gone, but our mapping still holds the final record.
    assert ring.exited()
    last = ring.latest()
    ring.close()
    rows, (mmap_calls, munmap_calls, madvise_calls) = parse_stats(err)
    assert (int(last["proc"]["mmap_calls"]), int(last["proc"]["munmap_calls"]),
            int(last["proc"]["madvise_calls"])) == (mmap_calls, munmap_calls, madvise_calls)
    column = {"allocs": "allocs", "frees": "frees", "refills": "refills", "refill_blk": "refill_blocks",
              "drains": "drains", "drain_blk": "drain_blocks", "remote": "remote_frees",
              "slab<warm": "slabs_from_warm", "slab<os": "slabs_from_os", "slab>warm": "slabs_to_warm",
              "slab>os": "slabs_to_os"}
    for c in range(1, L.NUM_CLASSES):
        rec = last["cls"][c]
        if c not in rows:
            assert rec["allocs"] == 0 and rec["refills"] == 0, f"class {c} missing from the table"
            continue
        for col, field in column.items():
            assert rows[c][col] == int(rec[field]), f"class {c} {field}: table {rows[c][col]}, ring {int(rec[field])}"
        assert rows[c]["live_KiB"] == int(rec["live_bytes"]) >> 10
        assert rows[c]["cache_KiB"] == int(rec["cached_bytes"]) >> 10
        assert rows[c]["slow_us"] == int(rec["slow_ns"]) // 1000
    assert sum(r["allocs"] for r in rows.values()) > 1_000_000


def test_records_every_epoch(shm):
    p = start(["burst", 64, 3000, scaled(1.5)], shm, HAKMEM_TELEMETRY_MS=50)
    with Ring(str(ring_path(shm, p.pid))) as ring:
        assert ring.header()["epoch_ms"] == 50
        # The deadline under test: 12 records (20 epochs' worth at most) within
        # a second of the file appearing.
        recs = wait_for(lambda: (lambda r: (r,) if len(r) >= 12 else None)(ring.records()), 1.0,
                        "12 records in 1 s at 50 ms")[0]
        gaps = np.diff(recs["time_ns"].astype(np.int64)) / 1e6
        assert len(recs) >= 12, f"{len(recs)} records in 1 s at 50 ms"
        assert gaps.min() >= 40, f"records closer than the epoch: {gaps.min():.1f} ms"
        assert np.all(np.diff(recs["index"].astype(np.int64)) == 1)
        # latest() reads one slot; it is the newest record or a newer one.
        last = ring.latest()
        assert int(last["index"]) >= int(recs[-1]["index"])
        assert int(last["cls"]["allocs"][CLS64]) >= int(recs[-1]["cls"]["allocs"][CLS64])
    assert p.wait(timeout=scaled(30)) == 0


def test_check_mode_publishes_too(shm):
    # HAKMEM_CHECK=1 runs without thread caches: every call is a slow path
    # that bypasses refills, and must still tick the ring.
    p = start(["burst", 64, 200, 1.0], shm, HAKMEM_CHECK=1)
    with Ring(str(ring_path(shm, p.pid))) as ring:
        wait_for(lambda: ring.ring_head() >= 3, 5, "records in check mode")
        assert ring.policy_in_force()["tcache_cap"][CLS64] > 0   # the policy; check mode ignores it
    assert p.wait(timeout=scaled(30)) == 0


# ---- policy through the snapshot ---------------------------------------------
def refills_per_op(a, b):
    d_refills = int(b["cls"]["refills"][CLS64]) - int(a["cls"]["refills"][CLS64])
    d_allocs = int(b["cls"]["allocs"][CLS64]) - int(a["cls"]["allocs"][CLS64])
    return d_refills / max(d_allocs, 1), d_allocs


def test_raising_capacity_lowers_refills(shm):
    # Bursts of 3000 64-byte blocks against the default capacity (1024)
    # refill all the time; 4096 holds a whole burst. Records come from slow
    # paths only, so once the bigger cache stops the refills the next record
    # is the one written at exit, which the mapping still shows.
    p = start(["burst", 64, 3000, scaled(3.0)], shm)
    with Ring(str(ring_path(shm, p.pid)), writable=True) as ring:
        wait_for(lambda: ring.ring_head() >= 3, 5, "records")
        a = ring.latest()
        b = wait_for(lambda: (lambda r: r if refills_per_op(a, r)[1] >= 500_000 else None)(ring.latest()), 5,
                     "500,000 allocations under the default policy")
        before, ops_before = refills_per_op(a, b)
        pol = ring.policy_in_force()
        assert pol["tcache_cap"][CLS64] == 1024
        pol["tcache_cap"][CLS64] = 4096
        pol["tcache_batch"][CLS64] = 256
        t0 = time.monotonic()
        v = ring.write_policy(pol)
        applied, status = ring.wait_applied(v, timeout=scaled(1.0))
        took = time.monotonic() - t0
        assert applied, status
        assert took <= scaled(0.2), f"applied after {took * 1000:.0f} ms"   # the deadline under test
        assert ring.policy_in_force()["tcache_cap"][CLS64] == 4096
        # From here to exit: the refills that fill the bigger cache count
        # against it (a few, against millions of allocations).
        c = ring.latest()
        assert p.wait(timeout=scaled(30)) == 0
        assert ring.exited()
        after, ops_after = refills_per_op(c, ring.latest())
    assert ops_before > 100_000 and ops_after > 100_000, (ops_before, ops_after)
    assert before > 0.001, f"refills per op before: {before}"
    assert after < before / 5, f"refills per op {before:.5f} -> {after:.5f}"


def test_set_policy_cli(shm):
    # Long enough for eight CLI runs on a loaded machine; stopped at the end.
    p = start(["burst", 64, 2000, scaled(60)], shm)
    ring_path(shm, p.pid)
    r = run_cli("ring", "set-policy", "--dir", shm, p.pid, "tcache_cap@64=2000", "drain_ms=250", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["applied"] is True and out["applied_version"] == out["version"]
    d = run_cli("ring", "dump", "--dir", shm, p.pid, "--json")
    assert d.returncode == 0, d.stderr
    s = json.loads(d.stdout)
    assert s["policy"]["in_force"]["tcache_cap"][CLS64] == 2000
    assert s["policy"]["in_force"]["drain_ms"] == 250
    assert s["pid"] == p.pid and s["alive"]
    assert s["totals"]["cls"]["allocs"][CLS64] > 0
    # Out of bounds: refused by the CLI before anything is written.
    bad = run_cli("ring", "set-policy", "--dir", shm, p.pid, "tcache_cap@64=999999")
    assert bad.returncode == 1
    assert bad.stderr.startswith("hakmem: error: tcache_cap[4]=999999") and bad.stderr.count("\n") == 1
    for args in (["nonsense=1"], ["tcache_cap[99]=1"], ["drain_ms=x"], ["drain_ms"]):
        e = run_cli("ring", "set-policy", "--dir", shm, p.pid, *args)
        assert e.returncode == 1 and e.stderr.count("\n") == 1 and "Traceback" not in e.stderr, e.stderr
    human = run_cli("ring", "dump", "--dir", shm, p.pid)
    assert human.returncode == 0 and "allocs/s" in human.stdout and "policy: v" in human.stdout
    assert p.poll() is None, "the workload survived every policy written"
    p.kill()
    p.wait(timeout=scaled(30))


def test_an_idle_process_takes_policies_and_keeps_publishing(shm):
    """A process that makes no call still looks at its telemetry file (the
    allocator's background thread): a policy written while it idles is in
    force within about a second, and a record comes about once a second.
    Before, both waited for its next allocation: learnd could not switch a
    policy, nor measure one, while a program idled, which is when a policy
    that gives memory back acts."""
    p = start(["idle", 1.5, scaled(30)], shm, HAKMEM_TELEMETRY_MS=100)
    try:
        path = ring_path(shm, p.pid)
        assert json.loads(p.stdout.readline())["mode"] == "idle-start"
        with Ring(str(path)) as ring:
            time.sleep(0.3)        # the last slow path's tick is behind us
            head = ring.ring_head()
            r = run_cli("ring", "set-policy", "--dir", shm, p.pid, "drain_ms=250", "--wait", scaled(3), "--json")
            assert r.returncode == 0, r.stderr
            out = json.loads(r.stdout)
            assert out["applied"] is True, out
            assert ring.policy_in_force()["drain_ms"] == 250
            # With the drain at 250 ms the thread wakes four times a second;
            # records keep the 100 ms epoch at most, and come while it sleeps.
            wait_for(lambda: ring.ring_head() >= head + 3, 3.0, "records from an idle process")
        assert p.poll() is None, "the process is still asleep"
    finally:
        p.kill()
        p.wait(timeout=scaled(30))


def test_a_status_read_while_the_allocator_answers_never_says_seen_but_not_applied(shm):
    """The allocator stores a snapshot's outcome (applied_version, or the
    rejection) and then seen_version. A reader that copied the header in one
    read took applied_version (offset 88) before seen_version (96): when
    the allocator's two stores fell between those loads, the copy said
    "seen, not applied" of a policy that was applied, and bench-learn's
    burst best-static run failed on it. Here every read that reaches
    seen_version is the moment the allocator answers: the bytes before 96
    of that read are from before, the rest from after."""
    p = start(["idle", 1.5, scaled(30)], shm, HAKMEM_TELEMETRY_MS=100)
    try:
        path = ring_path(shm, p.pid)
        assert json.loads(p.stdout.readline())["mode"] == "idle-start"
        with Ring(str(path), writable=True) as ring:
            v = ring.write_policy(ring.policy_in_force())
            ok, st = ring.wait_applied(v, timeout=scaled(5))
            assert ok, st
            after = ring.read(0, L.HEADER_SIZE)
            before = bytearray(after)
            for name in ("applied_version", "seen_version"):
                o = L.offset_of("header", name)
                before[o:o + 8] = (v - 1).to_bytes(8, "little")
            seen_at = L.offset_of("header", "seen_version")
            answered = [False]

            def read(offset, n):
                if answered[0]:
                    return after[offset:offset + n]
                if offset + n <= seen_at:
                    return bytes(before[offset:offset + n])
                answered[0] = True      # the allocator answers while this read is under way
                cut = max(seen_at, offset)
                return bytes(before[offset:cut]) + after[cut:offset + n]
            ring.read = read
            st = ring.status()
            assert st["seen_version"] < v or st["applied_version"] == v, st
            answered[0] = False
            assert ring.wait_applied(v, timeout=1.0) == (True, ring.status())
    finally:
        p.kill()
        p.wait(timeout=scaled(30))


# ---- the reader facing bad files ---------------------------------------------
def one_line_error(path, expect):
    r = run_cli("ring", "dump", path)
    assert r.returncode == 1, r.stdout
    assert "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("hakmem: error: "), r.stderr
    assert expect in r.stderr, r.stderr
    with pytest.raises(RingError):
        Ring(str(path))


def test_reader_rejects_bad_files(shm, tmp_path):
    p = start(["burst", 64, 2000, 1.0], shm)
    src = ring_path(shm, p.pid)
    wait_for(lambda: Ring(str(src)).ring_head() > 0, 5, "a record")
    good = tmp_path / "copy"
    shutil.copy(src, good)
    assert p.wait(timeout=scaled(30)) == 0
    data = good.read_bytes()
    assert run_cli("ring", "dump", good).returncode == 0

    def variant(name, blob):
        f = tmp_path / name
        f.write_bytes(blob)
        return f

    one_line_error(variant("short", data[:1000]), "truncated")
    one_line_error(variant("cut", data[:len(data) // 2]), "truncated")
    one_line_error(variant("empty", b""), "truncated")
    one_line_error(variant("magic", b"XXXXXXXX" + data[8:]), "bad magic")
    newer = bytearray(data)
    newer[8:12] = (L.LAYOUT_VERSION + 1).to_bytes(4, "little")
    one_line_error(variant("newer", bytes(newer)), "newer than this reader")
    geometry = bytearray(data)
    off = L.offset_of("header", "record_size")
    geometry[off:off + 4] = (12345).to_bytes(4, "little")
    one_line_error(variant("geometry", bytes(geometry)), "record_size")
    one_line_error(tmp_path / "missing", "No such file")
    os.symlink(good, tmp_path / "link")
    one_line_error(tmp_path / "link", "symbolic link")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user (chown)")
def test_reader_distrusts_a_file_owned_by_another_user(shm):
    p = start(["burst", 64, 2000, 2.0], shm)
    path = ring_path(shm, p.pid)
    os.chown(path, 65534, 65534)
    one_line_error(path, "not trusted")
    r = run_cli("ring", "set-policy", "--dir", shm, p.pid, "drain_ms=10")
    assert r.returncode == 1 and "not trusted" in r.stderr
    assert p.wait(timeout=scaled(30)) == 0


def test_cli_usage_errors():
    assert run_cli("--help").returncode == 0
    for sub in (["ring", "dump", "--help"], ["ring", "set-policy", "--help"], ["ring", "watch", "--help"]):
        assert run_cli(*sub).returncode == 0
    r = run_cli("ring")
    assert r.returncode == 2 and r.stderr.startswith("hakmem: error:")
    r = run_cli("ring", "dump", "999999999", "--dir", "/nonexistent-dir")
    assert r.returncode == 1 and r.stderr.count("\n") == 1


def test_watch_samples_and_stops(shm):
    p = start(["burst", 64, 2000, 1.0], shm)
    ring_path(shm, p.pid)
    r = run_cli("ring", "watch", shm, "--interval", "0.05", "--count", "10", "--json")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(l) for l in r.stdout.splitlines()]
    assert lines and all(l["pid"] == p.pid for l in lines)
    assert p.wait(timeout=scaled(30)) == 0
