"""Capture (allocator/src/trace.c) against what the program really did, read
on the Python side with the code protoc generates from proto/trace.proto:
the C writer and the Python reader agree on the format.

- FULL: `counted.c` reports exactly how many blocks of each of its four
  sizes (used by nothing else in the process) it allocated, freed and left
  live, and with how many threads; the trace must say the same, with the
  header and footer right and the time-stamping rule holding across threads.
- SAMPLED: only picked objects appear, and each one's realloc and free.
- LIVE: `hakmem trace record PID` on a running preloaded program, bounded
  by bytes; with nobody holding the lease (the command holds it itself); a
  hostile link at the name the process would use is not followed; another
  user can neither write a request nor aim the capture with a planted link.
- Disk full (a 64 KiB tmpfs): the program is unaffected, drops are counted
  and the file stays well framed.
"""
import errno
import json
import os
import subprocess
import sys
from collections import Counter, defaultdict

import pytest

from conftest import BUILD, LIB, WORKLOAD, clean_env, proc_start_time, ring_path, run_cli, scaled, wait_for
from hakmem import layout as L
from hakmem._pb import trace_pb2
from hakmem.capture import REFUSED, answer
from hakmem.ring import Ring

COUNTED = BUILD / "learner" / "counted"
PY_SYS = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else "python3"   # runs as another user
OP = trace_pb2.Op


def decode(path):
    """(chunks, events) of a trace file; events as dicts with absolute
    times. Asserts the framing: magic, whole chunks, seq 0.., equal columns."""
    data = open(path, "rb").read()
    assert data[:8] == b"HKTRACE1"
    i, chunks, events = 8, [], []
    while i < len(data):
        n = shift = 0
        while True:
            b = data[i]
            i += 1
            n |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                break
        assert i + n <= len(data), f"chunk at {i} cut short"
        c = trace_pb2.TraceChunk()
        c.ParseFromString(data[i:i + n])
        i += n
        assert c.seq == len(chunks)
        m = len(c.op)
        assert len(c.size) == len(c.align) == len(c.addr) == len(c.old_addr) == len(c.dt_ns) == m
        t = 0
        for k in range(m):
            t += c.dt_ns[k]
            events.append({"op": c.op[k], "size": c.size[k], "align": c.align[k], "addr": c.addr[k],
                           "old": c.old_addr[k], "t": t, "thread": c.thread})
        chunks.append(c)
    return chunks, events


def lifetimes(events):
    """Replays events in time order by address: returns (allocs, frees,
    violations), where allocs[i] is (event, freed_by) and a violation is an
    allocation that found its address still live (its free stamped later)."""
    live, out, bad = {}, [], 0
    for e in sorted(events, key=lambda e: e["t"]):
        op, a = e["op"], e["addr"]
        if op == OP.THREAD_EXIT or a == 0:
            continue
        if op == OP.FREE:
            if a in live:
                out[live.pop(a)][1] = e
            continue
        if op == OP.REALLOC:
            if e["old"] in live:
                out[live.pop(e["old"])][1] = e
        if a in live:
            bad += 1
        live[a] = len(out)
        out.append([e, None])
    return out, bad


def run_counted(tmp_path, threads=4, **env):
    e = clean_env(LD_PRELOAD=str(LIB), HAKMEM_STATS=1, HAKMEM_TELEMETRY=0, **env)
    p = subprocess.run([str(COUNTED), str(threads)], env=e, input="go\n", capture_output=True, text=True,
                       timeout=scaled(60))
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1]), p


def test_full_capture_says_exactly_what_the_program_did(tmp_path):
    path = tmp_path / "full.trace"
    report, p = run_counted(tmp_path, HAKMEM_TRACE=str(path))
    assert os.stat(path).st_mode & 0o777 == 0o600
    chunks, events = decode(path)
    h = chunks[0].header
    assert chunks[0].HasField("header") and not chunks[0].op
    assert h.format == 1 and h.mode == trace_pb2.FULL and h.layout_version == L.LAYOUT_VERSION
    assert h.exe.endswith("/counted") and h.argv0.endswith("counted")
    assert h.hakmem_version and abs(h.start_unix - os.path.getmtime(path)) < scaled(60)
    assert len(h.class_size) == L.NUM_CLASSES and h.class_size[0] == 0
    assert list(h.class_size[1:]) == sorted(h.class_size[1:])
    f = chunks[-1].footer
    assert chunks[-1].HasField("footer")
    assert f.events == len(events) and f.dropped == 0 and f.chunks == len(chunks) - 1
    assert f.end_reason == "exit" and f.duration_ns > 0

    objs, bad = lifetimes(events)
    assert bad == 0, "an allocation reused a live address: a free stamped after the reuse"
    by_size = defaultdict(lambda: Counter())
    threads_of = defaultdict(set)
    for alloc, end in objs:
        if alloc["op"] != OP.MALLOC:
            continue
        s = alloc["size"]
        by_size[s]["allocs"] += 1
        by_size[s]["frees" if end is not None else "live"] += 1
        threads_of[s].add(alloc["thread"])
    for want in report["sizes"]:
        got = by_size[want["size"]]
        assert (got["allocs"], got["frees"], got["live"]) == (want["allocs"], want["frees"], want["live"]), want
        assert len(threads_of[want["size"]]) == report["threads"]
    # the workers exited (THREAD_EXIT once each, nothing after it in its thread)
    exits = [e for e in events if e["op"] == OP.THREAD_EXIT]
    assert len(exits) >= report["threads"]
    assert len({e["thread"] for e in exits}) == len(exits)
    assert f.threads == len({e["thread"] for e in events})
    per_thread = defaultdict(list)
    for e in events:
        per_thread[e["thread"]].append(e)
    for evs in per_thread.values():
        assert all(e["op"] != OP.THREAD_EXIT for e in evs[:-1])
    # HAKMEM_STATS shows the capture
    assert f"trace: full (ended), {path}: {len(events)} events" in p.stderr


def test_sampled_capture_has_only_picked_objects_and_all_their_frees(tmp_path):
    path = tmp_path / "sampled.trace"
    full_report, _ = run_counted(tmp_path)
    report, p = run_counted(tmp_path, HAKMEM_TRACE=str(path), HAKMEM_TRACE_SAMPLE=131072)
    chunks, events = decode(path)
    h = chunks[0].header
    assert h.mode == trace_pb2.SAMPLED and h.sample_bytes == 131072
    objs, bad = lifetimes(events)
    assert bad == 0
    # Every free and realloc follows an allocation of its address recorded
    # before it: nothing of an object that was not picked.
    seen = set()
    for e in sorted(events, key=lambda e: e["t"]):
        if e["op"] == OP.FREE:
            assert e["addr"] in seen
            seen.discard(e["addr"])
        elif e["op"] == OP.REALLOC:
            assert e["old"] in seen
            seen.discard(e["old"])
            seen.add(e["addr"])
        elif e["op"] != OP.THREAD_EXIT:
            seen.add(e["addr"])
    # Picked: every 320 KiB and huge block (each past 3/2 of the mean, the most a
    # draw can be), some of the
    # 2.5 KiB ones, not all; and each picked object's free when it had one.
    sizes = {s["size"]: s for s in report["sizes"]}
    picked = Counter(a["size"] for a, _ in objs if a["op"] == OP.MALLOC)
    assert picked[327680] == sizes[327680]["allocs"]
    assert picked[3 * 1024 * 1024 + 12345] == sizes[3 * 1024 * 1024 + 12345]["allocs"]
    assert 0 < picked[2560] < sizes[2560]["allocs"] // 2
    freed = Counter(a["size"] for a, end in objs if a["op"] == OP.MALLOC and end is not None)
    assert freed[327680] == sizes[327680]["frees"]
    assert chunks[-1].footer.events == len(events)


def test_live_record_of_a_running_process(shm, tmp_path):
    out = tmp_path / "live.trace"
    e = clean_env(LD_PRELOAD=str(LIB), HAKMEM_SHM_DIR=str(shm))
    w = subprocess.Popen([str(WORKLOAD), "hot", "64", "100", str(scaled(8))], env=e,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ring_path(shm, w.pid)
        r = run_cli("trace", "record", w.pid, "--seconds", "5", "--max-bytes", 1 << 20, "-o", out,
                    "--shm-dir", shm, "--json")
        assert r.returncode == 0, r.stderr
        res = json.loads(r.stdout)
        assert res["end_reason"] == "limit_bytes" and res["events"] > 1000 and res["dropped"] == 0
        assert res["threads"] == 1
        assert w.poll() is None          # still running, not restarted
    finally:
        wout, werr = w.communicate(timeout=scaled(30))
    assert w.returncode == 0, werr
    assert json.loads(wout.strip().splitlines()[-1])["ops"] > 0
    assert out.stat().st_size <= (1 << 20) + 4096
    chunks, events = decode(out)
    h = chunks[0].header
    assert h.mode == trace_pb2.LIVE and h.pid == w.pid and h.limit_seconds == 5 and h.limit_bytes == 1 << 20
    assert chunks[-1].footer.events == len(events) == res["events"]
    ops = Counter(e["op"] for e in events)
    assert set(ops) <= {OP.MALLOC, OP.FREE} and abs(ops[OP.MALLOC] - ops[OP.FREE]) <= 2
    assert all(e["size"] == 64 for e in events if e["op"] == OP.MALLOC)
    # the process's own copy is gone from the telemetry directory
    assert not [n for n in os.listdir(shm) if ".trace-" in n]


def test_live_record_without_learnd_holds_the_lease_itself(tmp_path):
    d = tmp_path / "shm"
    d.mkdir(mode=0o700)
    out = tmp_path / "live.trace"
    e = clean_env(LD_PRELOAD=str(LIB), HAKMEM_SHM_DIR=str(d))
    w = subprocess.Popen([str(WORKLOAD), "hot", "64", "100", str(scaled(20))], env=e,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        r = run_cli("trace", "record", w.pid, "--seconds", "1", "--max-bytes", 65536, "-o", out,
                    "--shm-dir", d)
        assert r.returncode == 0, r.stderr
        assert f"process {w.pid}:" in r.stdout and str(out) in r.stdout
    finally:
        w.kill()
        w.communicate()
    chunks, events = decode(out)
    assert chunks[-1].footer.end_reason == "limit_bytes" and events


def ask(ring_file, req, seconds=1, max_bytes=65536):
    """Writes capture request number req by hand (capture.request picks a
    random one): a test that must know the trace's name ahead."""
    from hakmem import layout as L
    with Ring(ring_file, writable=True) as ring:
        po = ring.policy_offset
        ring.write(po + L.offset_of("policy_area", "trace_max_bytes"), int(max_bytes).to_bytes(8, "little"))
        ring.write(po + L.offset_of("policy_area", "trace_seconds"), int(seconds).to_bytes(4, "little"))
        ring.write(po + L.offset_of("policy_area", "trace_request"), int(req).to_bytes(8, "little"))
        wait_for(lambda: answer(ring, req), 10, f"the process to take request {req}")
        return answer(ring, req)


def test_live_record_refuses_a_hostile_link_and_fails_in_one_line(shm, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    e = clean_env(LD_PRELOAD=str(LIB), HAKMEM_SHM_DIR=str(shm))
    w = subprocess.Popen([str(WORKLOAD), "hot", "64", "100", str(scaled(8))], env=e,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        path = ring_path(shm, w.pid)
        # A link where the process would write request 7's trace: the
        # process makes its trace O_EXCL|O_NOFOLLOW, refuses the request,
        # and never writes through the link.
        os.symlink(victim, shm / f"{w.pid}-{proc_start_time(w.pid)}.trace-7")
        state, err = ask(path, 7)
        assert (state, err) == (REFUSED, errno.EEXIST)
        assert victim.read_text() == "keep"
        # `hakmem trace record` picks a number nobody can guess: links at the
        # small ones change nothing.
        for i in (1, 2, 3, 4, 5, 6, 8):
            os.symlink(victim, shm / f"{w.pid}-{proc_start_time(w.pid)}.trace-{i}")
        r = run_cli("trace", "record", w.pid, "--seconds", "1", "--max-bytes", 65536, "-o",
                    tmp_path / "y.trace", "--shm-dir", shm)
        assert r.returncode == 0, r.stderr
        assert victim.read_text() == "keep"
        assert w.poll() is None
    finally:
        wout, werr = w.communicate(timeout=scaled(30))
    assert w.returncode == 0, werr
    # bad arguments: one line each
    for args in (["999999999"], [str(os.getpid()), "--seconds", "0"], [str(w.pid)]):
        r = run_cli("trace", "record", *args, "-o", tmp_path / "y.trace", "--shm-dir", shm)
        assert r.returncode != 0 and r.stderr.startswith("hakmem: error: ")
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_disk_full_drops_chunks_and_the_program_goes_on(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a 64 KiB tmpfs")
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], check=True)
    try:
        path = mnt / "t.trace"
        report, p = run_counted(tmp_path, HAKMEM_TRACE=str(path))
        assert report["threads"] == 4                    # ran to the end, said what it did
        line = [ln for ln in p.stderr.splitlines() if "trace: full" in ln]
        assert line and " 0 dropped" not in line[0], p.stderr
        data = open(path, "rb").read()
        assert len(data) <= 64 * 1024
        # whatever made it in is whole chunks: the framing holds to the end
        chunks, events = decode(path)
        assert chunks[0].HasField("header")
        if chunks[-1].HasField("footer"):
            assert chunks[-1].footer.dropped > 0 and chunks[-1].footer.events == len(events)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_another_user_can_neither_ask_nor_aim_the_capture(mallory, shared_shm, tmp_path):
    """The threat model: the directory is shared by every user. Mallory
    cannot write a request into root's telemetry file (only its owner can),
    and a link she plants at the name the process will use for its trace is
    not followed: the process refuses that request, the link's target is
    untouched, and the next request (a fresh name) works."""
    import subprocess as sp
    from hakmem.lease import Lease
    from conftest import as_user
    victim = tmp_path / "victim"
    victim.write_text("keep")
    with Lease(shared_shm, "test"):
        e = clean_env(LD_PRELOAD=str(LIB), HAKMEM_SHM_DIR=str(shared_shm))
        w = sp.Popen([str(WORKLOAD), "hot", "64", "100", str(scaled(8))], env=e, stdout=sp.PIPE,
                     stderr=sp.PIPE, text=True)
        try:
            ring = ring_path(shared_shm, w.pid)
            script = ("import os, sys\n"
                      "try:\n    os.open(sys.argv[1], os.O_RDWR | os.O_NOFOLLOW)\n    print('opened')\n"
                      "except OSError as e:\n    print(e.errno)\n"
                      "os.symlink(sys.argv[2], sys.argv[3])\n")
            name = f"{w.pid}-{proc_start_time(w.pid)}.trace-1"
            m = as_user(mallory, [PY_SYS, "-c", script, ring, victim, shared_shm / name], stdout=sp.PIPE, text=True)
            out, _ = m.communicate(timeout=scaled(10))
            assert out.split()[0] in ("13", "1"), out          # EACCES / EPERM
            assert (shared_shm / name).is_symlink()
            # The name she aimed at is one the process would use only for
            # request 1 (root asks for it here, by hand): refused, not followed.
            assert ask(ring, 1) == (REFUSED, errno.EEXIST)
            assert victim.read_text() == "keep"
            # `hakmem trace record` asks with a number she cannot know.
            r = run_cli("trace", "record", w.pid, "--seconds", "1", "--max-bytes", 65536, "-o",
                        tmp_path / "b.trace", "--shm-dir", shared_shm)
            assert r.returncode == 0, r.stderr
            assert victim.read_text() == "keep"
        finally:
            w.communicate(timeout=scaled(30))
    assert w.returncode == 0


def test_live_requests_one_after_another_and_busy_while_capturing(shm, tmp_path):
    """Two captures in a row of one process are two whole traces (threads
    numbered from 1 in each); a process still capturing from start (sampled
    here, so the file stays small) refuses a live request with EBUSY, in one
    line, and goes on."""
    e = clean_env(LD_PRELOAD=str(LIB), HAKMEM_SHM_DIR=str(shm))
    w = subprocess.Popen([str(WORKLOAD), "hot", "64", "100", str(scaled(8))], env=e,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    full = tmp_path / "from-start.trace"
    b = subprocess.Popen([str(WORKLOAD), "hot", "64", "100", str(scaled(8))],
                         env={**e, "HAKMEM_TRACE": str(full), "HAKMEM_TRACE_SAMPLE": str(1 << 20)},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ring_path(shm, w.pid)
        for k in (1, 2):
            r = run_cli("trace", "record", w.pid, "--seconds", "1", "--max-bytes", 65536, "-o",
                        tmp_path / f"{k}.trace", "--shm-dir", shm, "--json")
            assert r.returncode == 0, r.stderr
            chunks, events = decode(tmp_path / f"{k}.trace")
            assert {e["thread"] for e in events} == {1} and chunks[-1].footer.threads == 1
        ring_path(shm, b.pid)
        r = run_cli("trace", "record", b.pid, "--seconds", "1", "-o", tmp_path / "busy.trace", "--shm-dir", shm)
        assert r.returncode != 0 and "a capture is already on" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    finally:
        w.communicate(timeout=scaled(30))
        b.communicate(timeout=scaled(30))
    assert w.returncode == 0 and b.returncode == 0
    chunks, _ = decode(full)          # the from-start capture went on to the end
    assert chunks[0].header.mode == trace_pb2.SAMPLED and chunks[-1].footer.end_reason == "exit"


def test_a_request_not_yet_taken_is_withdrawn_and_one_taken_is_left_alone(shm, tmp_path):
    """learnd's screening withdraws a request its process did not take
    within ACK_WAIT_S (an idle process would take it at its next call and
    record for nobody). Withdrawn in time: the process, running again, never
    records, and still takes the next request. Too late: the request stays
    as it was, and the process does not take the withdrawal for one more."""
    import signal
    import time
    from hakmem import capture as C
    e = clean_env(LD_PRELOAD=str(LIB), HAKMEM_SHM_DIR=str(shm))
    w = subprocess.Popen([str(WORKLOAD), "hot", "64", "100", str(scaled(8))], env=e,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with Ring(ring_path(shm, w.pid), writable=True) as ring:
            os.kill(w.pid, signal.SIGSTOP)          # asleep: it cannot take the request
            try:
                req = C.request(ring, 1, 65536)
                assert C.withdraw(ring, req) is True
            finally:
                os.kill(w.pid, signal.SIGCONT)
            time.sleep(scaled(0.5))                 # dozens of its telemetry ticks
            assert C.answer(ring, req) is None and ring.header()["trace_seen"] == 0
            assert not [n for n in os.listdir(shm) if ".trace-" in n]
            # It still takes the next one; withdrawn once taken, it stays.
            req = C.request(ring, 1, 65536)
            wait_for(lambda: C.answer(ring, req), 10, "the process to take the second request")
            assert C.withdraw(ring, req) is False
            assert C._u64(ring, "policy_area", "trace_request") == req
            wait_for(lambda: C.answer(ring, req)[0] == C.DONE, 10, "the second capture to end")
            assert C.answer(ring, req) == (C.DONE, 0)
            assert [n for n in os.listdir(shm) if ".trace-" in n] == [C.trace_name(ring, req)]
    finally:
        w.communicate(timeout=scaled(30))
    assert w.returncode == 0


def test_a_withdrawal_that_crosses_the_process_taking_the_request_puts_it_back():
    """The race the live test cannot time: the process takes the request
    between withdraw's read and its write. The old number left there would
    be one more request to the process; withdraw puts the taken one back."""
    from hakmem import capture as C

    class Racing:
        policy_offset = 4096

        def __init__(self, seen, req):
            self.mem = bytearray(8192)
            self._put("header", "trace_seen", seen)
            self._put("policy_area", "trace_request", req)
            self.req, self.writes = req, []

        def _put(self, struct, field, v):
            at = (0 if struct == "header" else self.policy_offset) + L.offset_of(struct, field)
            self.mem[at:at + 8] = int(v).to_bytes(8, "little")

        def read(self, off, n):
            return bytes(self.mem[off:off + n])

        def write(self, off, data):
            if not self.writes:                     # the process takes it just before our first write
                self._put("header", "trace_seen", self.req)
            self.writes.append(int.from_bytes(data, "little"))
            self.mem[off:off + len(data)] = data

    ring = Racing(seen=7, req=99)
    assert C.withdraw(ring, 99) is False
    assert ring.writes == [7, 99] and C._u64(ring, "policy_area", "trace_request") == 99
