"""build/hakmem-replay (replay/hakmem-replay.c): a trace replayed through the
real allocator gives back exactly the operations it holds, threads and
cross-thread frees included; runs repeat in fresh processes; a policy changes
what the allocator does; bad traces are refused in one line with the byte
offset, or replayed up to the damage with --partial."""
import json
import os
import subprocess

import numpy as np
import pytest

from conftest import BUILD, clean_env, scaled
from hakmem import layout as L
from hakmem.trace import ALIGNED, CALLOC, FREE, MALLOC, REALLOC, THREAD_EXIT, TraceWriter

REPLAY = BUILD / "hakmem-replay"


@pytest.fixture(autouse=True)
def _built():
    if not REPLAY.exists():
        pytest.fail(f"{REPLAY} missing: `make tests` builds it")


def replay(*args, check=True):
    r = subprocess.run([str(REPLAY), *map(str, args)], capture_output=True, text=True,
                       timeout=scaled(60), env=clean_env())
    if check and r.returncode != 0:
        raise AssertionError(f"hakmem-replay exit {r.returncode}: {r.stderr}")
    return r


def replay_json(*args):
    return json.loads(replay("--json", *args).stdout)


def handoff_trace(path, n=2000, size=64, layout_version=None):
    """Thread 1 allocates n blocks; thread 2 frees every other one (remote
    frees), thread 1 the rest; a realloc, a calloc and an aligned allocation
    on the way; then both threads exit. Addresses are reused as an allocator
    would reuse them, so renaming by time matters."""
    w = TraceWriter(path, pid=4242, exe="/usr/bin/handoff", layout_version=layout_version)
    t = 1000
    ev1, ev2 = [], []
    base = 0x10000
    # Thread 2 frees a block at the very nanosecond thread 1 gets the same
    # address back: the free sorts first (trace.proto), two objects, no
    # unmatched free.
    ev1.append((MALLOC, 48, 0, 0x700000, 0, 500))
    for i in range(n):
        ev1.append((MALLOC, size, 0, base + 64 * i, 0, t)); t += 10
    for i in range(0, n, 2):
        ev2.append((FREE, 0, 0, base + 64 * i, 0, t)); t += 10
    for i in range(1, n, 2):
        ev1.append((FREE, 0, 0, base + 64 * i, 0, t)); t += 10
    # The addresses freed above come back for new objects.
    ev1.append((CALLOC, 256, 0, base, 0, t)); t += 10
    ev1.append((REALLOC, 4096, 0, 0x900000, base, t)); t += 10
    ev1.append((ALIGNED, 100, 256, base + 64, 0, t)); t += 10
    ev2.append((FREE, 0, 0, 0x900000, 0, t)); t += 10
    ev2.append((FREE, 0, 0, base + 64, 0, t)); t += 10
    ev2.append((FREE, 0, 0, 0xdead000, 0, t)); t += 10   # never allocated in the trace
    ev2.append((FREE, 0, 0, 0x700000, 0, t))
    ev1.append((MALLOC, 48, 0, 0x700000, 0, t)); t += 10
    ev1.append((FREE, 0, 0, 0x700000, 0, t)); t += 10
    ev1.append((THREAD_EXIT, 0, 0, 0, 0, t)); t += 10
    ev2.append((THREAD_EXIT, 0, 0, 0, 0, t))
    w.chunk(1, ev1[: n // 2]).chunk(2, ev2[:10]).chunk(1, ev1[n // 2:]).chunk(2, ev2[10:])
    w.close()
    return len(ev1) + len(ev2)


def test_operation_counts_are_exact(tmp_path):
    tr = tmp_path / "h.trace"
    events = handoff_trace(tr)
    d = replay_json(tr)
    t = d["trace"]
    assert t["events"] == events
    assert t["threads"] == 2
    assert t["objects"] == 2000 + 3 + 2
    assert t["unmatched_frees"] == 1
    assert t["partial"] is False and t["cut_reason"] is None
    assert t["layout_version"] == L.LAYOUT_VERSION and t["exe"] == "/usr/bin/handoff"
    run = d["runs"][0]
    # Every event but the two thread exits and the unmatched free ran.
    assert run["ops"] == events - 3
    c = run["counters"]
    # 2000 mallocs + calloc + realloc (moved: a bigger class) + aligned.
    assert c["allocs"] >= 2003
    assert c["frees"] == c["allocs"]        # all of them freed again
    assert c["remote_frees"] >= 900         # thread 2 freed thread 1's blocks
    assert run["wall_s"] > 0 and run["peak_rss_bytes"] > 0
    assert set(run["os_calls"]) >= {"mmap", "munmap", "madvise"}


def test_repeat_runs_fresh_processes_with_a_spread(tmp_path):
    tr = tmp_path / "h.trace"
    handoff_trace(tr)
    d = replay_json("--repeat", 3, tr)
    assert d["repeat"] == 3 and len(d["runs"]) == 3
    # Fresh processes: the same operations every time (refills and drains
    # depend on how the two threads interleave; timings differ).
    assert len({(r["ops"], r["counters"]["allocs"], r["counters"]["frees"]) for r in d["runs"]}) == 1
    walls = sorted(r["wall_s"] for r in d["runs"])
    assert d["median"]["wall_s"] == pytest.approx(walls[1], rel=1e-6)
    assert d["spread"]["wall_s"] == pytest.approx((walls[2] - walls[0]) / walls[1], rel=0.01, abs=2e-3)
    # User time is the part of the CPU time outside the kernel (screening
    # prices faults from their count instead of the kernel's time).
    for r in d["runs"]:
        assert 0 <= r["user_s"] <= r["cpu_s"] + 1e-6, r


def test_policy_changes_what_the_allocator_does(tmp_path):
    tr = tmp_path / "h.trace"
    handoff_trace(tr, n=6000)
    tight, roomy = tmp_path / "tight.json", tmp_path / "roomy.json"
    tight.write_text('{"tcache_cap": 1, "tcache_batch": 1, "drain_ms": 0}')
    roomy.write_text('{"tcache_cap": 4096, "tcache_batch": 1024}')
    a = replay_json("--policy", tight, tr)
    b = replay_json("--policy", roomy, tr)
    cls = 4   # 64-byte blocks
    assert a["policy"]["tcache_cap"][cls] == 1 and a["policy"]["drain_ms"] == 0
    assert b["policy"]["tcache_cap"][cls] > 1000
    ra, rb = a["runs"][0]["counters"]["refills"], b["runs"][0]["counters"]["refills"]
    assert ra > 10 * rb, (ra, rb)


def test_bad_policies_are_refused(tmp_path):
    tr = tmp_path / "h.trace"
    handoff_trace(tr, n=10)
    for text, why in [('{"tcache_cap": }', "expected a number"), ('{"no_such_knob": 3}', "unknown knob"),
                      ('[1, 2]', "expected a JSON object"), ('{"tcache_cap": -1}', "negative")]:
        p = tmp_path / "p.json"
        p.write_text(text)
        r = replay("--policy", p, tr, check=False)
        assert r.returncode == 2, (text, r.stderr)
        assert why in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_a_cut_trace_names_the_offset_and_partial_replays_the_rest(tmp_path):
    tr = tmp_path / "h.trace"
    handoff_trace(tr)
    data = tr.read_bytes()
    cut = tmp_path / "cut.trace"
    cut.write_bytes(data[: len(data) - 100])
    r = replay(cut, check=False)
    assert r.returncode == 1
    line = r.stderr.strip()
    assert "\n" not in line and "cut short" in line and "at byte" in line and "--partial" in line
    offset = int(line.split("at byte ")[1].split()[0])
    assert 8 < offset < len(data) - 100
    d = replay_json("--partial", cut)
    assert d["trace"]["partial"] is True and d["trace"]["valid_bytes"] == offset
    assert 0 < d["trace"]["events"] < 4000


@pytest.mark.parametrize("damage, why", [
    (lambda d: b"NOTATRCE" + d[8:], "no HKTRACE1 magic"),
    (lambda d: d[:8] + b"\xff" * 11 + d[19:], "bad chunk length"),
    (lambda d: d[:8] + b"\xff\xff\xff\xff\x0f" + d[13:], "more than any writer makes"),
])
def test_damaged_traces_are_refused(tmp_path, damage, why):
    tr = tmp_path / "h.trace"
    handoff_trace(tr, n=20)
    bad = tmp_path / "bad.trace"
    bad.write_bytes(damage(tr.read_bytes()))
    r = replay(bad, check=False)
    assert r.returncode == 1 and why in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_columns_of_different_lengths_are_refused(tmp_path):
    from hakmem._pb import trace_pb2
    from hakmem.trace import _varint
    tr = tmp_path / "c.trace"
    w = TraceWriter(tr, pid=1, exe="x")
    c = trace_pb2.TraceChunk(thread=1, seq=1)
    c.op.extend([MALLOC, MALLOC])
    c.size.extend([16])
    c.align.extend([0, 0]); c.addr.extend([16, 32]); c.old_addr.extend([0, 0]); c.dt_ns.extend([1, 1])
    data = c.SerializeToString()
    w.f.write(_varint(len(data)) + data)
    w.f.close()
    r = replay(tr, check=False)
    assert r.returncode == 1 and "columns of different lengths" in r.stderr


def test_another_layout_version_is_refused_even_with_partial(tmp_path):
    tr = tmp_path / "old.trace"
    handoff_trace(tr, n=10, layout_version=L.LAYOUT_VERSION - 1)
    r = replay("--partial", tr, check=False)
    assert r.returncode == 1
    assert f"layout version {L.LAYOUT_VERSION - 1}, this replayer is layout {L.LAYOUT_VERSION}" in r.stderr


def test_a_symlink_is_not_followed(tmp_path):
    tr = tmp_path / "h.trace"
    handoff_trace(tr, n=10)
    link = tmp_path / "link.trace"
    os.symlink(tr, link)
    r = replay(link, check=False)
    assert r.returncode == 1 and r.stderr.count("\n") == 1


def test_a_captured_real_program_replays_with_identical_counts(tmp_path):
    """counted.c (learner/tests), captured whole with HAKMEM_TRACE, replays
    every one of its operations, twice with the same counts."""
    from hakmem import trace as T
    prog = BUILD / "learner" / "counted"
    out = tmp_path / "t.%p"
    env = clean_env(LD_PRELOAD=str((BUILD / "libhakmem.so").resolve()), HAKMEM_TRACE=str(out),
                    HAKMEM_TELEMETRY="0")
    r = subprocess.run([str(prog), "3"], input="go\n", capture_output=True, text=True, env=env,
                       timeout=scaled(60))
    assert r.returncode == 0, r.stderr
    traces = sorted(tmp_path.glob("t.*"), key=lambda p: p.stat().st_size)
    assert traces, "no trace written"
    ev = T.events(traces[-1])
    objs = T.rename_objects(ev)
    exits = int((ev.op == THREAD_EXIT).sum())
    failed = int((((ev.op == MALLOC) | (ev.op == CALLOC) | (ev.op == ALIGNED) | (ev.op == REALLOC))
                  & (ev.addr == 0)).sum())
    want = len(ev.op) - exits - objs.unmatched_frees - failed
    d = replay_json("--repeat", 2, traces[-1])
    t = d["trace"]
    assert t["events"] == len(ev.op) and t["unmatched_frees"] == objs.unmatched_frees == 0
    assert t["threads"] == 4   # main and three workers
    assert [run["ops"] for run in d["runs"]] == [want, want]
    # The program's own report: the trace holds exactly its allocations of
    # each of its sizes, and the replay's allocator made at least as many.
    did = json.loads(r.stdout.strip().splitlines()[-1])
    total = 0
    for s in did["sizes"]:
        assert int(((ev.op == MALLOC) & (ev.size == s["size"])).sum()) == s["allocs"], s
        assert int(((ev.op == FREE) & np.isin(ev.addr, ev.addr[(ev.op == MALLOC) & (ev.size == s["size"])])).sum()) >= s["frees"]
        total += s["allocs"]
    c = d["runs"][0]["counters"]
    assert c["allocs"] >= total


def test_idle_gaps_are_kept(tmp_path):
    """--pace idle (the default) keeps a thread's gaps of 1 ms or more: a
    trace with 0.3 s of idle time takes at least that long to replay, and
    its objects freed after the gap meet a drain interval that passed;
    --pace none runs it back to back."""
    tr = tmp_path / "gap.trace"
    gap_trace(tr)
    paced = replay_json(tr)
    assert paced["pace"] == "idle"
    assert paced["runs"][0]["wall_s"] >= 0.29 and paced["runs"][0]["idle_s"] >= 0.25
    fast = replay_json("--pace", "none", tr)
    assert fast["pace"] == "none" and fast["runs"][0]["wall_s"] < 0.25 and fast["runs"][0]["idle_s"] == 0
    assert paced["runs"][0]["ops"] == fast["runs"][0]["ops"] == 200


def spike_trace(path, mib=48, idle_ms=600):
    """One thread: mib MiB of 1-8 KiB blocks (eight classes) allocated,
    freed, then idle_ms of nothing, and one last small allocation (the end
    of the idle time)."""
    w = TraceWriter(path, pid=4343, exe="/usr/bin/spike")
    n = (mib << 20) // 4608
    t, ev = 1000, []
    for i in range(n):
        ev.append((MALLOC, 1024 * (1 + i % 8), 0, 0x10000000 + 8192 * i, 0, t)); t += 100
    for i in range(n):
        ev.append((FREE, 0, 0, 0x10000000 + 8192 * i, 0, t)); t += 100
    t += idle_ms * 1_000_000
    ev.append((MALLOC, 64, 0, 0x900000, 0, t))
    ev.append((FREE, 0, 0, 0x900000, 0, t + 10))
    w.chunk(1, ev)
    w.close()


def test_mean_resident_memory_shows_what_a_policy_keeps_through_idle_time(tmp_path):
    """A spike freed before a long idle time: its peak is the same whatever
    the policy, but the mean over the replay is not (learnd's windows price
    the mean): shallow caches and no warm pool keep less of it."""
    tr = tmp_path / "s.trace"
    spike_trace(tr)
    keep = replay_json(tr)["runs"][0]
    pol = tmp_path / "lean.json"
    pol.write_text(json.dumps({"tcache_cap": 1, "tcache_batch": 1, "warm_slabs": 0}))
    lean = replay_json("--policy", pol, tr)["runs"][0]
    for run in (keep, lean):
        assert 0 < run["mean_rss_bytes"] <= run["peak_rss_bytes"], run
        assert run["wall_s"] >= 0.6
    assert lean["mean_rss_bytes"] < 0.75 * keep["mean_rss_bytes"], (lean["mean_rss_bytes"], keep["mean_rss_bytes"])
    assert "mean " in replay(tr).stdout


def gap_trace(path):
    """One thread: 100 small allocations, 0.3 s of nothing, their frees."""
    w = TraceWriter(path, pid=1, exe="/usr/bin/gap")
    evs = [(MALLOC, 64, 0, 0x1000 + 64 * i, 0, 1000 + i) for i in range(100)]
    evs += [(FREE, 0, 0, 0x1000 + 64 * i, 0, 300_000_000 + i) for i in range(100)]
    w.chunk(1, evs)
    w.close()


def test_a_closed_gate_holds_the_replay_before_it_reads_its_trace(tmp_path):
    """--gate (learnd's screening of an intermittent program): a replay
    started while the gate's byte is set does not load its trace (decoding
    it is as much work as a burst) until the gate opens; the wait is not the
    replay's (held_s), and the trace's 0.3 s gap is kept after it."""
    import time
    tr, gate = tmp_path / "gap.trace", tmp_path / "gate"
    gate.write_bytes(b"\1")
    p = subprocess.Popen([str(REPLAY), "--json", "--gate", str(gate), str(tr)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=clean_env())
    try:
        time.sleep(0.7)
        assert p.poll() is None, "a closed gate held nothing: " + (p.stderr.read() if p.stderr else "")
        gap_trace(tr)         # written while the replay waits: it has not looked for it yet
        with open(gate, "r+b") as f:
            f.write(b"\0")
        out, err = p.communicate(timeout=scaled(30))
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err
    run = json.loads(out)["runs"][0]
    assert run["ops"] == 200
    assert run["held_s"] < 0.2 and run["wall_s"] >= 0.28, run
    free = replay_json("--gate", gate, tr)["runs"][0]
    assert free["held_s"] == 0 and free["wall_s"] < 0.6


def test_a_gate_nobody_opens_slows_a_replay_and_never_stops_it(tmp_path):
    """Held before loading and before each of its two events, 2 s at most
    each time; the holds between events are the replay's held_s, and kept
    out of its pacing: the trace's 0.3 s gap still comes after them."""
    tr, gate = tmp_path / "two.trace", tmp_path / "gate"
    w = TraceWriter(tr, pid=1, exe="/usr/bin/two")
    w.chunk(1, [(MALLOC, 64, 0, 0x1000, 0, 1000), (FREE, 0, 0, 0x1000, 0, 300_000_000)])
    w.close()
    gate.write_bytes(b"\1")
    run = replay_json("--gate", gate, tr)["runs"][0]
    assert run["ops"] == 2 and 3.8 <= run["held_s"] <= 5.5, run
    assert run["wall_s"] >= run["held_s"] + 0.28, "the trace's gap was eaten by the holds"


@pytest.mark.parametrize("kind", ["link", "missing", "empty", "directory", "fifo"])
def test_a_gate_that_is_not_a_regular_file_is_refused_in_one_line(tmp_path, kind):
    tr, gate = tmp_path / "gap.trace", tmp_path / "gate"
    gap_trace(tr)
    if kind == "link":
        (tmp_path / "real").write_bytes(b"\0")
        os.symlink(tmp_path / "real", gate)
    elif kind == "empty":
        gate.write_bytes(b"")
    elif kind == "directory":
        gate.mkdir()
    elif kind == "fifo":
        os.mkfifo(gate)       # opened without blocking, then refused
    r = replay("--gate", gate, tr, check=False)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "--gate" in r.stderr, r.stderr
