"""hakmem-learnd against a hostile local user (issue "Trust and faults").

Root runs learnd on a telemetry directory every user can write to (root's,
1777, as learnd makes it); an unprivileged account of its own (conftest:
mallory, alice) does what any local user can: runs preloaded programs,
truncates its own telemetry file, makes FIFOs, links and junk named like
other processes' files, squats names before learnd starts. Each test names
the finding it covers and what main did before.

These need root (accounts, setpriv, chown). CI runs as root; elsewhere they
skip and say why."""
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import (ROOT, USERS, WORKLOAD, as_user, clean_env, need_accounts, proc_start_time, ring_path, run_cli,
                      scaled, start, start_as, wait_for)
from test_learnd import CLS64, PERIOD, Learnd, db_rows, finish, settled

sys.path.insert(0, str(ROOT / "learner"))
from hakmem import layout as L  # noqa: E402
from hakmem.lease import Lease  # noqa: E402
from hakmem.ring import Ring  # noqa: E402


@pytest.fixture(autouse=True)
def _root():
    need_accounts()


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat", "rb") as f:
        rest = f.read().rsplit(b")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def sleepers(ids, n, seconds=60):
    """n processes of another user that do nothing: live pids to name files after."""
    return [as_user(ids, ["sleep", str(seconds)]) for _ in range(n)]


def kill_all(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(scaled(10))


def learnd_in(tmp_path, shm, *extra, **kw):
    return Learnd(tmp_path, *extra, shm=shm, **kw)


def windows_of(db, pid):
    return db_rows(db, "SELECT count(*) FROM windows w JOIN processes p ON p.id = w.process_id "
                       "WHERE p.pid = ?", pid)[0][0]


# ---- finding 2: truncating one's own file --------------------------------------
def test_a_user_truncating_its_own_file_does_not_kill_learnd(tmp_path, shared_shm, mallory, public_bin):
    """Before: learnd mapped every file; mallory truncated her own process's
    file and root's learnd died of SIGBUS with nothing in its log. Now
    learnd reads with pread: the file becomes unusable, is left with one
    line, and root's process goes on being sampled."""
    d = learnd_in(tmp_path, shared_shm, "--learner", "static")
    evil = start_as(mallory, public_bin, ["burst", 64, 2000, scaled(8)], shared_shm)
    mine = start(["burst", 64, 2000, scaled(6)], shared_shm)
    try:
        path = ring_path(shared_shm, evil.pid)
        ring_path(shared_shm, mine.pid)
        d.wait_log(f"process_started workload[{evil.pid}]")
        d.wait_log(f"process_started workload[{mine.pid}]")
        assert os.stat(path).st_uid == mallory[0]
        os.truncate(path, L.HEADER_SIZE + 100)       # as its owner could; root only keeps the owner
        d.wait_log(f"workload[{evil.pid}]: its telemetry file became unusable")
        before = windows_of(d.db, mine.pid)
        wait_for(lambda: windows_of(d.db, mine.pid) >= before + 2 or d.proc.poll() is not None, 5,
                 "two windows of root's process sampled after the truncation")
        assert d.proc.poll() is None, f"learnd died ({d.proc.returncode}):\n{d.text()[-2000:]}"
        finish(mine)
    finally:
        kill_all([evil])
        assert d.stop() == 0, d.text()
    said = [ln for ln in d.text().splitlines() if path.name in ln]
    assert 1 <= len(said) <= 2, f"the truncated file is reported once per reason: {said}"


# ---- finding 3: a FIFO or a dangling link named like a live process's file -----
def test_fifos_and_dangling_links_named_like_live_files_do_not_hang_learnd(tmp_path, shared_shm, mallory,
                                                                           public_bin):
    """Before: discovery opened names with a plain open() before any check;
    a FIFO named after a live process blocked learnd for good, and ignored
    names were opened again every turn. Now names are opened O_NONBLOCK |
    O_NOFOLLOW and fstat'ed; learnd answers, discovers later processes, and
    reports each bad name once."""
    d = learnd_in(tmp_path, shared_shm, "--learner", "static")
    held = sleepers(mallory, 2)
    try:
        fifo = shared_shm / f"{held[0].pid}-{proc_start_time(held[0].pid)}"
        link = shared_shm / f"{held[1].pid}-{proc_start_time(held[1].pid)}"
        assert as_user(mallory, ["mkfifo", fifo]).wait(scaled(10)) == 0
        assert as_user(mallory, ["ln", "-s", "/nonexistent/hakmem", link]).wait(scaled(10)) == 0
        d.wait_log(f"{fifo.name}: not a regular file")
        d.wait_log(f"{link.name}: is a symbolic link")
        w = start(["burst", 64, 2000, scaled(2)], shared_shm)
        d.wait_log(f"process_started workload[{w.pid}]")
        r = run_cli("status", "--run-dir", d.run, "--json")
        assert r.returncode == 0 and json.loads(r.stdout)["status"]["running"], r.stderr
        finish(w)
        t0 = cpu_seconds(d.proc.pid)
        time.sleep(3)           # the measuring interval
        assert cpu_seconds(d.proc.pid) - t0 < 0.3, "ignored names must not cost a look every turn"
    finally:
        kill_all(held)
        assert d.stop() == 0, d.text()
    log = d.text()
    assert log.count(f"{fifo.name}: not a regular file") == 1, log
    assert log.count(f"{link.name}: is a symbolic link") == 1, log


# ---- finding 4: cross-user policy poisoning -------------------------------------
def learned_cap(db, users):
    """The 64-byte class's capacity in the best policy of the workload's program for users."""
    rows = db_rows(db, "SELECT p.knobs FROM programs g JOIN policies p ON p.id = g.best_policy "
                       "WHERE g.users = ? AND g.exe LIKE '%/workload'", users)
    return json.loads(rows[0][0])["tcache_cap"][CLS64] if rows else None


def default_cap(tmp_path):
    shm = tmp_path / "shm-default"
    shm.mkdir(exist_ok=True)
    with Lease(shm, "test"):
        w = start(["burst", 64, 4000, scaled(0.5)], shm)
        with Ring(ring_path(shm, w.pid)) as r:
            cap = r.policy_in_force()["tcache_cap"][CLS64]
        finish(w)
    return cap


def learn_for(ids, d, shm, public_bin, users, base):
    """Runs a bursty program of ids under d until learnd stored a deeper
    64-byte cache as its program's best."""
    w = start_as(ids, public_bin, ["burst", 64, 4000, scaled(40)], shm)
    try:
        wait_for(lambda: (learned_cap(d.db, users) or 0) > base, 40, f"a deeper cache learned for users {users}")
    finally:
        kill_all([w])
    # The program idle again, its last verdict stored: its best no longer moves.
    d.wait_log(f"process_exited workload[{w.pid}]")
    return settled(lambda: learned_cap(d.db, users), 2 * PERIOD, what=f"the best policy of users {users}")


def root_cap_at_start(d, shm, public_bin):
    """The 64-byte capacity root's new process of the same executable runs
    once learnd has seen it (a warm start applies within a second)."""
    w = start_as((0, 0), public_bin, ["burst", 64, 2000, scaled(3)], shm)
    try:
        path = ring_path(shm, w.pid)
        d.wait_log(f"process_started workload[{w.pid}]")
        # learnd has taken the process up (a window of it stored: its program
        # was activated before, and any stored policy written then), and the
        # allocator has examined whatever snapshot learnd published.
        wait_for(lambda: windows_of(d.db, w.pid) >= 1, 5, "a window of root's process")
        with Ring(path) as r:
            wait_for(lambda: r.status()["seen_version"] == r.published_version(), 2,
                     "the allocator to examine learnd's snapshot")
            return r.policy_in_force()["tcache_cap"][CLS64]
    finally:
        finish(w)


def test_one_users_evidence_never_sets_another_users_policy(tmp_path, shared_shm, mallory, alice, public_bin):
    """Before: programs were grouped by executable and build id whatever the
    user; what mallory's processes showed (forged counters included) became
    the best policy that root's next process of the same executable got at
    start. Now a program is (executable, build id, user): mallory's learned
    policy stays hers. Pooling is opt-in: with `--pool-users root,alice`,
    alice's learned policy is root's too (which shows this test can see a
    policy cross users when it does)."""
    base = default_cap(tmp_path)
    d = learnd_in(tmp_path, shared_shm, "--learner", "gp")
    try:
        learn_for(mallory, d, shared_shm, public_bin, str(mallory[0]), base)
        assert root_cap_at_start(d, shared_shm, public_bin) == base
    finally:
        assert d.stop() == 0, d.text()
    assert learned_cap(d.db, "0") in (None, base), "root's program learned nothing of mallory's"
    users = {u for (u,) in db_rows(d.db, "SELECT users FROM programs WHERE exe LIKE '%/workload'")}
    assert {str(mallory[0]), "0"} <= users, users

    pooled = f"0,{alice[0]}"
    d = learnd_in(tmp_path, shared_shm, "--learner", "gp", "--pool-users", f"root,{alice[0]}")
    try:
        best = learn_for(alice, d, shared_shm, public_bin, pooled, base)
        got = root_cap_at_start(d, shared_shm, public_bin)
    finally:
        assert d.stop() == 0, d.text()
    # What root's process got at start is the best learned from alice's (the
    # pooled program goes on learning from root's process after that).
    assert got == best > base, (got, best, base)


def test_a_process_that_never_takes_up_a_policy_holds_back_only_its_own_user(tmp_path, shared_shm, mallory,
                                                                              public_bin):
    """Before: a process that never applies a candidate (stopped, or served
    from its caches) made learnd abandon the candidate and settle the whole
    program, for every user's processes of it. Now mallory's stopped process
    is a program of its own: root's process of the same executable is still
    tuned (a deeper cache accepted)."""
    d = learnd_in(tmp_path, shared_shm, "--learner", "gp")
    stuck = start_as(mallory, public_bin, ["burst", 64, 4000, scaled(60)], shared_shm)
    try:
        ring_path(shared_shm, stuck.pid)
        d.wait_log(f"process_started workload[{stuck.pid}]")
        stuck.send_signal(signal.SIGSTOP)
        w = start_as((0, 0), public_bin, ["burst", 64, 4000, scaled(30)], shared_shm)
        wait_for(lambda: db_rows(d.db, "SELECT count(*) FROM evaluations e JOIN programs g ON g.id = e.program_id "
                                       "WHERE g.users = '0' AND e.verdict = 'accepted'")[0][0] > 0,
                 30, f"an accepted policy for root's program:\n{d.text()[-3000:]}")
        kill_all([w])
    finally:
        stuck.send_signal(signal.SIGCONT)
        kill_all([stuck])
        assert d.stop() == 0, d.text()
    cap = learned_cap(d.db, "0")
    assert cap is not None and cap > default_cap(tmp_path)


# ---- finding 5, learnd's side: a squatted or linked telemetry directory -----------
def test_a_directory_another_user_made_first_does_not_keep_learnd_out(tmp_path, shared_shm, mallory):
    """Before: a telemetry directory created first by another user made
    learnd refuse to start (a denial of service), and a link in its place
    was followed. Now root takes a squatted directory over (root's, 1777)
    and replaces a link with a directory of its own; nothing is created
    where the link pointed."""
    squat = shared_shm / "squat"
    assert as_user(mallory, ["mkdir", "-m", "0777", squat]).wait(scaled(10)) == 0
    d = learnd_in(tmp_path / "a", squat, "--learner", "static")
    assert d.stop() == 0, d.text()
    st = os.stat(squat)
    assert (st.st_uid, st.st_mode & 0o7777) == (0, 0o1777), oct(st.st_mode)
    assert f"{squat} was made by uid {mallory[0]}: took it over" in d.text()

    target = shared_shm / "mallorys"
    assert as_user(mallory, ["mkdir", target]).wait(scaled(10)) == 0
    link = shared_shm / "linked"
    assert as_user(mallory, ["ln", "-s", target, link]).wait(scaled(10)) == 0
    d = learnd_in(tmp_path / "b", link, "--learner", "static")
    try:
        w = start(["burst", 64, 2000, scaled(1)], link)
        finish(w)
    finally:
        assert d.stop() == 0, d.text()
    assert not link.is_symlink() and link.is_dir()
    assert list(target.iterdir()) == [], "nothing of root's where the link pointed"


# ---- finding 6: one user stalling learning for everyone ------------------------------
def forged_copy(src: pathlib.Path, dst: pathlib.Path, pid, start_time, ids):
    """A copy of a real telemetry file, made out to (pid, start_time) and
    owned by ids, whose policy in force never checksums. Made beside the
    directory and moved in once it is ids': learnd must never see it as
    root's (it would rightly call that a file it cannot trust, and root's
    summary line would then hold back the owner's for a minute)."""
    stage = dst.parent.with_name(dst.parent.name + "-stage")
    stage.mkdir(exist_ok=True)
    tmp = stage / dst.name
    data = bytearray(src.read_bytes())
    data[L.offset_of("header", "pid"):L.offset_of("header", "pid") + 4] = pid.to_bytes(4, "little")
    o = L.offset_of("header", "start_time")
    data[o:o + 8] = start_time.to_bytes(8, "little")
    pol = int.from_bytes(data[L.offset_of("header", "policy_offset"):][:8], "little")
    chk = pol + L.offset_of("policy_area", "in_force") + 8
    data[chk:chk + 8] = (int.from_bytes(data[chk:chk + 8], "little") ^ 0x5A5A).to_bytes(8, "little")
    tmp.write_bytes(data)
    os.chown(tmp, *ids)
    os.rename(tmp, dst)


JUNK = r'''
import os, sys
d, n = sys.argv[1], int(sys.argv[2])
for i in range(n):                       # names of pids above pid_max: never a live process
    open(os.path.join(d, f"{5000000 + i}-{i}"), "w").close()
for i in range(n // 4):                  # and names no process could have
    open(os.path.join(d, f"junk-{i}"), "w").close()
'''


def test_one_user_cannot_stall_learning_for_everyone(tmp_path, shared_shm, mallory):
    """Before: 100 files whose policy in force never checksums cost learnd
    about 100 ms of retries each per turn, and a root process running 10 s
    got no window at all; 20,000 junk names cost 13% of a core and a log
    line each. Now: reads are bounded per file and per turn, names are
    examined within a budget per user, and junk is told in one summary line
    per user; root's process is sampled at its usual rate meanwhile."""
    src_w = start(["burst", 64, 2000, scaled(1.5)], shared_shm)
    d = learnd_in(tmp_path, shared_shm, "--learner", "static")
    held = sleepers(mallory, 100)
    try:
        src = ring_path(shared_shm, src_w.pid)
        d.wait_log(f"process_started workload[{src_w.pid}]")
        copy = tmp_path / "ring.bin"
        copy.write_bytes(src.read_bytes())
        finish(src_w)
        for s in held:
            st = proc_start_time(s.pid)
            forged_copy(copy, shared_shm / f"{s.pid}-{st}", s.pid, st, mallory)
        junk = subprocess.run(["setpriv", f"--reuid={mallory[0]}", f"--regid={mallory[1]}", "--clear-groups",
                               "/usr/bin/python3", "-c", JUNK, str(shared_shm), "20000"], capture_output=True,
                              text=True, timeout=scaled(120))
        assert junk.returncode == 0, junk.stderr
        t0, c0 = time.monotonic(), cpu_seconds(d.proc.pid)
        w = start(["burst", 64, 2000, 10], shared_shm)      # 10 s: the rate it is sampled at is measured
        ring_path(shared_shm, w.pid)
        wait_for(lambda: windows_of(d.db, w.pid) >= 3, 4, f"windows of root's process:\n{d.text()[-2000:]}")
        finish(w, timeout=30)
        n = windows_of(d.db, w.pid)
        cpu = (cpu_seconds(d.proc.pid) - c0) / (time.monotonic() - t0)
    finally:
        kill_all(held)
        shutil.rmtree(shared_shm.with_name(shared_shm.name + "-stage"), ignore_errors=True)
        assert d.stop() == 0, d.text()
    # Alone it gets 19; the listing budget (a 25,000-name directory is listed
    # about once a second) may cost its first second or two, never more.
    assert n >= 12, f"root's 10 s process got {n} windows of 0.5 s"
    assert cpu < 0.10, f"learnd used {cpu:.1%} of a core among the junk"
    log = d.text().splitlines()
    assert len(log) < 40, f"{len(log)} log lines:\n" + "\n".join(log[-20:])
    assert any(f"files of {USERS[0]} (uid {mallory[0]})" in ln for ln in log), "\n".join(log)
    print(f"learnd among 100 unreadable files and 25,000 junk names: {cpu:.1%} of a core, "
          f"{n} windows for root's 10 s process, {len(log)} log lines")


# ---- finding 9: `hakmem ring dump PID` and a spoofed name ----------------------------
def test_ring_dump_of_a_pid_reads_the_live_processes_own_file(shm):
    """Before: `hakmem ring dump PID` took the file with the newest start
    time among `PID-*`, which anyone can make. Now it takes the one whose
    start time is the live process's."""
    w = start(["burst", 64, 2000, scaled(3)], shm)
    try:
        real = ring_path(shm, w.pid)
        st = proc_start_time(w.pid)
        spoof = shm / f"{w.pid}-{st + 100000}"
        data = bytearray(real.read_bytes())
        o = L.offset_of("header", "start_time")
        data[o:o + 8] = (st + 100000).to_bytes(8, "little")
        spoof.write_bytes(data)
        r = run_cli("ring", "dump", "--dir", shm, w.pid, "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["start_time"] == st
        # A live process with no file of its own: a spoof named after it is
        # refused, never read in its place.
        other = subprocess.Popen(["sleep", "30"])
        try:
            fake = shm / f"{other.pid}-{proc_start_time(other.pid) + 7}"
            fake.write_bytes(data)
            r = run_cli("ring", "dump", "--dir", shm, other.pid, "--json")
            assert r.returncode != 0 and "no telemetry file for the running process" in r.stderr, r
        finally:
            other.kill()
            other.wait()
    finally:
        finish(w)


# ---- the lease itself: a hard link under its name --------------------------------
def test_a_hard_link_named_like_the_lease_is_neither_a_lease_nor_written(tmp_path, shared_shm):
    """Where users may link to files they do not own (fs.protected_hardlinks
    = 0), a user could name a hard link to some file of root's `learnd.lock`:
    root's learnd would have locked and rewritten that file as its lease,
    and if anything held a write lock on it, root's processes would have
    believed a reader is there. (The link is made by root here, standing in
    for such a user.) A file with more than one name is never the lease:
    learnd replaces the name and leaves the file alone, and the allocator
    does not believe it."""
    import fcntl
    import struct
    victim = shared_shm / "victim"
    victim.write_text("a file of root's\n")
    fd = os.open(victim, os.O_RDWR)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("hhqqi4x", fcntl.F_WRLCK, 0, 0, 0, 0))
        os.link(victim, shared_shm / "learnd.lock")
        w = start(["burst", 64, 4000, scaled(1.5)], shared_shm, HAKMEM_STATS=1)
        _, err = w.communicate(timeout=scaled(30))
        assert w.returncode == 0, err
        assert "no lease" in err and "with one name" in err, err[-600:]
        assert [p.name for p in shared_shm.iterdir() if p.name not in ("victim", "learnd.lock")] == []
        d = learnd_in(tmp_path, shared_shm, "--learner", "static")
        try:
            lease = shared_shm / "learnd.lock"
            assert os.stat(lease).st_ino != os.stat(victim).st_ino
            w = start(["burst", 64, 2000, scaled(1)], shared_shm)
            d.wait_log(f"process_started workload[{w.pid}]")
            finish(w)
        finally:
            assert d.stop() == 0, d.text()
    finally:
        os.close(fd)
    assert victim.read_text() == "a file of root's\n" and os.stat(victim).st_nlink == 1
