"""Trust and faults, round 2 (issue 36): the surfaces added after the first
round (metrics, screening, capture, import) against a hostile local user and
a careless operator. Root runs learnd on the shared telemetry directory; an
unprivileged account (conftest: mallory) does what any user can with its own
processes and the shared directories. Each test names its finding and what
main did before the fix (e326505).

Most need root (accounts, setpriv, chown); CI runs as root, elsewhere they
skip and say why."""
import json
import os
import pathlib
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import (LIB, ROOT, WORKLOAD, as_user, clean_env, need_accounts, need_root, proc_start_time,
                      ring_path, run_cli, scaled, start, start_as, wait_for)
from test_learnd import CLS64, Learnd, db_rows, finish

sys.path.insert(0, str(ROOT / "learner"))
from hakmem import layout as L  # noqa: E402
from hakmem._pb import hakmem_pb2 as pb  # noqa: E402
from hakmem.ring import Ring  # noqa: E402


# ---- helpers -----------------------------------------------------------------------
def gone_pid():
    """A pid no process can have (above pid_max)."""
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read()) + 100


def replayers(uid=None):
    """(pid, argv) of the hakmem-replay processes running (of uid)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            argv = pathlib.Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
            st = os.stat(f"/proc/{d}")
        except OSError:
            continue
        if argv and argv[0].endswith(b"hakmem-replay") and (uid is None or st.st_uid == uid):
            out.append((int(d), [a.decode(errors="replace") for a in argv if a]))
    return out


@pytest.fixture
def programs():
    """A directory every user can read, to put copies of the workload in:
    each copy is a program of its own (a program is its executable), so a
    test can make as many cold programs (screened anew) as it needs."""
    d = pathlib.Path(tempfile.mkdtemp(prefix="hakmem-progs-"))
    d.chmod(0o755)
    shutil.copy2(LIB, d / LIB.name)
    (d / LIB.name).chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def program(d: pathlib.Path, name: str) -> pathlib.Path:
    exe = d / name
    if not exe.exists():
        shutil.copy2(WORKLOAD, exe)
        exe.chmod(0o755)
    return exe


def run_as(ids, exe: pathlib.Path, args, shm, **env):
    e = clean_env(LD_PRELOAD=str(exe.parent / LIB.name), HAKMEM_SHM_DIR=str(shm), **env)
    if ids is None:
        return subprocess.Popen([str(exe), *map(str, args)], env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    return as_user(ids, [exe, *args], env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def stop(*procs):
    for p in procs:
        if p is not None and p.poll() is None:
            p.kill()
        if p is not None:
            p.wait(scaled(10))


def alive(d):
    assert d.proc.poll() is None, f"learnd died ({d.proc.returncode}):\n{d.text()[-3000:]}"


def no_internal_errors(d):
    log = d.text()
    assert "internal error" not in log and "Traceback" not in log, log[-3000:]


def status(d):
    r = run_cli("status", "--run-dir", d.run, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


# ---- finding 1: one user's process ending during its screening ----------------------
def test_a_users_process_ending_during_its_screening_never_stops_another_programs(tmp_path, shared_shm, mallory,
                                                                                   programs):
    """Before: mallory ended her own preloaded program while learnd replayed
    its screening trace; Screen.close() set a process-wide "stopping" flag
    that nothing cleared, the next screening (root's next new service)
    raised KeyboardInterrupt, and learnd exited 130. Now each screening
    owns its replays (replay.Runner): ending one ends only its own, and
    root's program is screened."""
    need_accounts()
    d = Learnd(tmp_path, "--learner", "gp", shm=shared_shm)
    evil = run_as(mallory, program(programs, "mallorys"), ["burst", 64, 4000, scaled(60)], shared_shm)
    mine = None
    try:
        wait_for(lambda: replayers(mallory[0]), 40, lambda: f"mallory's program's replays:\n{d.text()[-2000:]}")
        evil.kill()
        evil.wait(scaled(10))
        d.wait_log(f"process_exited mallorys[{evil.pid}]", 10)
        wait_for(lambda: not replayers(mallory[0]), 10, "her screening's replays to end with it")
        mine = run_as(None, program(programs, "rootwork"), ["burst", 64, 4000, scaled(30)], shared_shm)
        d.wait_log("screened rootwork", 45)
        alive(d)
    finally:
        stop(evil, mine)
        assert d.stop() == 0, d.text()
    no_internal_errors(d)


# ---- finding 2: the metrics endpoint under a flood ---------------------------------
def open_fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def threads(pid):
    return len(os.listdir(f"/proc/{pid}/task"))


FLOOD = r'''
import resource, socket, sys, time
port, n, hold = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
resource.setrlimit(resource.RLIMIT_NOFILE, (n + 64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
socks = []
for i in range(n):
    s = socket.socket()
    s.settimeout(5)
    try:
        s.connect(("127.0.0.1", port))
    except OSError:
        s.close()
        continue
    socks.append(s)
print(len(socks), flush=True)
time.sleep(hold)
'''


def test_a_flood_of_idle_metrics_clients_costs_answers_never_learnd(tmp_path):
    """Before: every connection to --metrics that sent nothing kept a thread
    and a descriptor of learnd's (prometheus-client's threaded server, no
    timeout, no limit); about 1,000 of them took learnd's last descriptor,
    and libzmq aborted it at the next `hakmem status`. Now the endpoint
    holds at most MAX_CLIENTS connections (a new one evicts the oldest) in
    one thread: 5,000 idle connections leave learnd's descriptors and
    threads where they were, `hakmem status` answers throughout, and a
    scrape after the flood is served."""
    import hakmem.metrics
    MAX_CLIENTS = getattr(hakmem.metrics, "MAX_CLIENTS", 64)      # (e326505 had no bound to import)
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 5100:
        pytest.skip("needs a hard RLIMIT_NOFILE of 5,100 for the flood's own sockets")
    d = Learnd(tmp_path, "--learner", "static", "--metrics", "127.0.0.1:0")
    flood = None
    try:
        url = re.search(r"metrics (http://\S+/metrics)", d.text()).group(1)
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        fds0, threads0 = open_fds(d.proc.pid), threads(d.proc.pid)
        flood = subprocess.Popen([sys.executable, "-c", FLOOD, str(port), "5000", str(scaled(20))],
                                 stdout=subprocess.PIPE, text=True)
        most_fds = most_threads = answered = 0
        t_end = time.monotonic() + scaled(60)
        line = None
        while time.monotonic() < t_end:
            most_fds = max(most_fds, open_fds(d.proc.pid))
            most_threads = max(most_threads, threads(d.proc.pid))
            st = status(d)
            assert st["status"]["running"]
            answered += 1
            alive(d)
            if line is None and flood.stdout.readable():
                import select
                if select.select([flood.stdout], [], [], 0)[0]:
                    line = flood.stdout.readline()
            if line is not None and answered >= 10:
                break
            time.sleep(0.2)
        assert most_fds <= fds0 + MAX_CLIENTS + 8, f"learnd's descriptors: {fds0} -> {most_fds}"
        assert most_threads <= threads0 + 2, f"learnd's threads: {threads0} -> {most_threads}"
        assert line is not None and int(line) == 5000, f"the flood connected {line!r}"
        flood.kill()
        flood.wait()
        import urllib.request
        with urllib.request.urlopen(url, timeout=scaled(5)) as r:
            body = r.read().decode()
        # The bound at work: idle clients went at a newer one's coming or at
        # their 5 s. (How many of the 5,000 the kernel handed learnd at all
        # depends on its listening queue: a client may count itself
        # connected while its connection waits for room there.)
        dropped = sum(float(v) for v in re.findall(
            r'hakmem_learnd_metrics_clients_dropped_total\{why="(?:evicted|timeout)"\} (\S+)', body))
        assert dropped >= MAX_CLIENTS, body[-1500:]
        alive(d)
    finally:
        stop(flood)
        assert d.stop() == 0, d.text()
    print(f"5,000 idle metrics clients: learnd's descriptors {fds0} -> at most {most_fds}, threads {threads0} -> "
          f"at most {most_threads}; {dropped:.0f} clients dropped by the bounds; `hakmem status` answered "
          f"{answered} times meanwhile")


# ---- finding 3: an operator pins a policy during a screening -------------------------
def test_a_pin_or_unpin_during_a_screening_ends_that_screening_and_nothing_else(tmp_path):
    """Before: `hakmem policy pin` during a screening swapped the learner for
    StaticLearner while the screening went on; when it ended, learnd died of
    AttributeError ('StaticLearner' object has no attribute 'screened').
    Now a pin ends the screening it meets, with its replays, and the program
    runs the pinned policy; an unpin starts the learner afresh, and a pin
    during another program's screening ends that one too."""
    d = Learnd(tmp_path, "--learner", "gp")
    w = w2 = None
    try:
        w = start(["burst", 64, 4000, scaled(60)], d.shm)
        ring_path(d.shm, w.pid)
        wait_for(lambda: replayers(), 40, lambda: f"the screening's replays:\n{d.text()[-2000:]}")
        r = run_cli("policy", "pin", "workload", "1", "--run-dir", d.run, "--db", d.db)
        assert r.returncode == 0, r.stderr
        d.wait_log("policy_pinned workload", 10)
        # Ended, not left to run out (the replays of a 2 s trace take longer
        # on a loaded machine, not always on a quiet one: the log says it).
        assert "workload: its screening ended with the learner it was for" in d.text(), d.text()[-2000:]
        wait_for(lambda: not replayers(), 1.5, "the screening's replays to end at the pin")
        assert [p["state"] for p in status(d)["programs"]] == ["pinned"]
        from hakmem.knobs import Knobs
        with Ring(ring_path(d.shm, w.pid)) as ring:
            v1 = Knobs(json.loads(db_rows(d.db, "SELECT knobs FROM policies WHERE version = 1")[0][0]))
            wait_for(lambda: Knobs(ring.policy_in_force()) == v1, 5, "the pinned policy in force")
        r = run_cli("policy", "unpin", "workload", "--run-dir", d.run, "--db", d.db)
        assert r.returncode == 0, r.stderr
        d.wait_log("policy_unpinned workload", 10)
        stop(w)
        d.wait_log(f"process_exited workload[{w.pid}]", 10)
        wait_for(lambda: not replayers(), 10, "no replay left of the first program")
        # Another program, cold: pinned in the middle of its own screening.
        exe = tmp_path / "second"
        shutil.copy2(WORKLOAD, exe)
        w2 = subprocess.Popen([str(exe), "burst", "64", "4000", str(scaled(60))], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=clean_env(LD_PRELOAD=str(LIB), HAKMEM_SHM_DIR=str(d.shm)))
        wait_for(lambda: replayers(), 40, lambda: f"the second program's replays:\n{d.text()[-2000:]}")
        r = run_cli("policy", "pin", "second", "1", "--run-dir", d.run, "--db", d.db)
        assert r.returncode == 0, r.stderr
        d.wait_log("second: its screening ended with the learner it was for", 10)
        wait_for(lambda: not replayers(), 1.5, "the second screening's replays to end at its pin")
        time.sleep(scaled(4))      # a measuring interval: past where the screening would have ended
        alive(d)
    finally:
        stop(w, w2)
        assert d.stop() == 0, d.text()
    no_internal_errors(d)


# ---- finding 4: learnd's screening copy of a user's trace ----------------------------
def test_the_screening_copy_has_no_name_a_user_could_swap_and_old_ones_are_swept(tmp_path, shared_shm, mallory,
                                                                                  programs):
    """Before: learnd copied the capture into /tmp/hakmem-screen-*.trace,
    chowned it to the traced user and opened it again by name in its worker:
    she could rename a 100 GB sparse file over it and root's learnd hashed
    it for seconds, deaf to SIGTERM; copies a killed learnd left (chowned to
    her) were never swept. Now the copy is an anonymous sealed file (a
    memfd) that learnd reads, and the replays (run as her) get, through a
    descriptor: nothing of the screening appears in any directory, and
    leftovers of earlier learnds are removed whoever owns them."""
    need_accounts()
    tmp = tmp_path / "tmp"
    tmp.mkdir(mode=0o1777)
    tmp.chmod(0o1777)
    old = tmp / f"hakmem-screen-{gone_pid()}-abcd.trace"    # a learnd long gone left it, given to mallory
    old.write_bytes(b"HKTRACE1" + b"\0" * 4096)
    os.chown(old, *mallory)
    gate = tmp / f"hakmem-screen-{gone_pid()}-efgh.gate"
    gate.write_bytes(b"\0")
    d = Learnd(tmp_path, "--learner", "gp", shm=shared_shm, env={"TMPDIR": str(tmp)})
    w = run_as(mallory, program(programs, "mallorys"), ["burst", 64, 4000, scaled(40)], shared_shm)
    seen_args = []
    try:
        assert not old.exists() and not gate.exists(), "leftovers of a learnd that is gone are swept at start"
        deadline = time.monotonic() + scaled(40)
        while "screened mallorys" not in d.text() and time.monotonic() < deadline:
            assert [p.name for p in tmp.iterdir()] == [], "nothing of the screening in learnd's temporary directory"
            assert not [n for n in os.listdir("/tmp") if n.startswith("hakmem-screen-")]
            for pid, argv in replayers(mallory[0]):
                seen_args.append(argv)
            time.sleep(0.01)
        d.wait_log("screened mallorys", 5)
        alive(d)
    finally:
        stop(w)
        assert d.stop() == 0, d.text()
    assert seen_args, "the replays ran as the program's user"
    for argv in seen_args:
        assert "--trace-fd" in argv and "--policy" not in argv, argv
        assert not any(a.startswith(("/tmp/", str(tmp))) for a in argv[1:]), argv     # argv[0]: the replayer
    no_internal_errors(d)


# ---- finding 7: capture names another user can occupy --------------------------------
def test_capture_names_cannot_be_taken_first_by_another_user(tmp_path, shared_shm, mallory, programs):
    """Before: a live capture of process P was written to the predictable
    <pid>-<start>.trace-1, -2, ...: mallory made those names first in the
    sticky directory, and screening root's program failed (`refused the
    capture: File exists`), as did root's `hakmem trace record`; nothing
    ever removed them. Now the request number (and so the name) is random
    and known only to the file's owner and root: root's program is
    screened and recorded, and mallory's files are swept."""
    need_accounts()
    d = Learnd(tmp_path, "--learner", "gp", shm=shared_shm)
    w = run_as(None, program(programs, "rootwork"), ["burst", 64, 4000, scaled(40)], shared_shm)
    squats, squatter = [], None
    try:
        ring_path(shared_shm, w.pid)
        start_time = proc_start_time(w.pid)
        names = [f"{w.pid}-{start_time}.trace-{i}" for i in range(1, 65)]
        # She makes them again as fast as learnd's sweep removes them.
        squatter = as_user(mallory, [sys.executable, "-c", SQUAT, shared_shm, *names])
        squats = [shared_shm / n for n in names]
        wait_for(lambda: all(p.exists() for p in squats), 10, "mallory's names")
        wait_for(lambda: "screened rootwork" in d.text() or "screen_failed" in d.text(), 45,
                 lambda: f"root's program screened:\n{d.text()[-2000:]}")
        assert "screen_failed" not in d.text(), d.text()[-2000:]
        r = run_cli("trace", "record", w.pid, "--seconds", "1", "--max-bytes", 1 << 20, "-o", tmp_path / "r.trace",
                    "--shm-dir", shared_shm)
        assert r.returncode == 0, r.stderr
        stop(squatter)
        wait_for(lambda: not any(p.exists() for p in squats), 25, "mallory's squatting names to be swept")
        alive(d)
    finally:
        stop(w, squatter)
        assert d.stop() == 0, d.text()
    no_internal_errors(d)


SQUAT = r"""
import os, sys, time
d, names = sys.argv[1], sys.argv[2:]
while True:
    for n in names:
        try:
            os.close(os.open(os.path.join(d, n), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            pass
    time.sleep(0.005)
"""


# ---- finding 8: captures nobody takes ------------------------------------------------
def captures(shm):
    return sorted(p.name for p in pathlib.Path(shm).iterdir() if ".trace-" in p.name)


def test_captures_nobody_will_take_are_swept(tmp_path):
    """Before: a live capture whose process exited mid-capture stayed in the
    telemetry directory (RAM) for ever, through learnd's restarts: discovery
    looked only at <pid>-<start> names. Now learnd removes captures whose
    process is gone (found at start too), and finished ones nobody took
    within a minute (a `hakmem trace record` killed while it waited)."""
    shm = tmp_path / "shm"
    shm.mkdir()
    left = shm / f"{gone_pid()}-12345.trace-777"           # from a process long gone
    left.write_bytes(b"HKTRACE1" + b"\0" * 100)
    d = Learnd(tmp_path, "--learner", "static", shm=shm)
    a = b = None
    try:
        wait_for(lambda: not left.exists(), 15, "a capture of a process that is gone, removed at start")
        # A process killed in the middle of a capture.
        a = start(["burst", 64, 2000, scaled(60)], shm)
        ring_path(shm, a.pid)
        rec = subprocess.Popen([sys.executable, "-m", "hakmem", "trace", "record", str(a.pid), "--seconds", "30",
                                "-o", str(tmp_path / "a.trace"), "--shm-dir", str(shm)], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=clean_env())
        wait_for(lambda: captures(shm), 10, "the capture under way")
        a.kill()
        a.wait()
        rec.wait(scaled(20))
        wait_for(lambda: not captures(shm), 25, "the dead process's capture to be removed")
        # A capture whose asker was killed: it ends; nobody takes it.
        b = start(["burst", 64, 2000, scaled(60)], shm)
        ring_path(shm, b.pid)
        rec = subprocess.Popen([sys.executable, "-m", "hakmem", "trace", "record", str(b.pid), "--seconds", "1",
                                "-o", str(tmp_path / "b.trace"), "--shm-dir", str(shm)], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=clean_env())
        name = wait_for(lambda: captures(shm), 10, "the second capture")[0]
        rec.kill()
        rec.wait()
        with Ring(ring_path(shm, b.pid)) as r:
            from hakmem.capture import answer, DONE
            req = int(name.rsplit("-", 1)[1])
            wait_for(lambda: (answer(r, req) or (0,))[0] == DONE, 15, "the capture to end")
        time.sleep(scaled(2))          # a measuring interval: a finished capture is kept a minute ...
        assert captures(shm) == [name]
        t = time.time() - 120          # ... and this one is two minutes old
        os.utime(shm / name, (t, t))
        wait_for(lambda: not captures(shm), 25, "the capture nobody took to be removed")
        assert b.poll() is None, "the process goes on"
        alive(d)
    finally:
        stop(a, b)
        assert d.stop() == 0, d.text()
    no_internal_errors(d)


# ---- finding 9: `hakmem policy import` and `pin --set` out of bounds -----------------
def export_file(path, knobs, note="", exe="/usr/bin/x", build_id="abc", class_size=None):
    from hakmem.knobs import Knobs
    from hakmem.trace import default_class_sizes
    f = pb.PolicyExport(format=2, exe=exe, build_id=build_id,
                        class_size=class_size or default_class_sizes(),
                        policy=pb.Policy(version=1, origin=pb.LEARNED, knobs=Knobs(knobs).to_pb(), note=note),
                        exported_at=time.time(), exported_from="elsewhere", users="0", users_names="root")
    path.write_bytes(f.SerializeToString())
    return path


def default_knobs():
    from hakmem.knobs import Bounds, Knobs
    w = None
    d = pathlib.Path(tempfile.mkdtemp(prefix="hakmem-defaults-"))
    try:
        from hakmem.lease import Lease
        with Lease(d, "test"):
            w = start(["burst", 64, 100, scaled(1)], d)
            with Ring(ring_path(d, w.pid)) as r:
                k, h = r.policy_in_force(), r.header()
            finish(w)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return Knobs(k).to_dict(), h


@pytest.mark.parametrize("running", [False, True], ids=["store", "learnd"])
def test_import_and_pin_refuse_knobs_the_allocator_would_reject(tmp_path, running):
    """Before: `hakmem policy import` stored and pinned a file with every
    knob at 2^32-1 (or a batch above its capacity); learnd then logged
    `cannot write its policy: drain_ms=4294967295 is outside 0..3600000`,
    the process kept its old policy, and `policy show` reported the pin as
    in force; `pin --set` took any value below 2^32. Now both check the
    allocator's own bounds (from each knob's one definition): one line
    naming the knob, exit 1, nothing stored. A note's escape sequences are
    printed written out, never sent to the terminal."""
    knobs, header = default_knobs()
    db = tmp_path / "learn.db"
    d = Learnd(tmp_path, "--learner", "static") if running else None
    where = ["--db", db, "--run-dir", d.run if d else tmp_path / "run"]
    try:
        def counts():
            if not db.exists():
                return (0, 0)
            return tuple(db_rows(db, f"SELECT count(*) FROM {t}")[0][0] for t in ("programs", "policies"))
        huge = dict(knobs, drain_ms=2**32 - 1, tcache_cap=[0] + [2**32 - 1] * (L.NUM_CLASSES - 1),
                    tcache_batch=[0] + [2**32 - 1] * (L.NUM_CLASSES - 1),
                    warm_slabs=[0] + [2**32 - 1] * (L.NUM_CLASSES - 1))
        batch = dict(knobs)
        batch["tcache_batch"] = list(knobs["tcache_batch"])
        batch["tcache_batch"][CLS64] = knobs["tcache_cap"][CLS64] + 1
        warm = dict(knobs)
        warm["warm_slabs"] = list(knobs["warm_slabs"])
        warm["warm_slabs"][-1] = header["warm_max"][-1] + 1
        before = counts()
        for bad, knob in ((huge, "drain_ms"), (batch, f"tcache_batch[{CLS64}]"), (warm, "warm_slabs[60]")):
            f = export_file(tmp_path / "bad.hkpolicy", bad)
            r = run_cli("policy", "import", f, "--pin", *where)
            assert r.returncode == 1 and r.stdout == "", (r.stdout, r.stderr)
            assert len(r.stderr.splitlines()) == 1 and knob in r.stderr and "nothing was stored" in r.stderr, r.stderr
            assert counts() == before, "nothing stored"
        # The bounds are the allocator's: its own largest values are taken.
        top = dict(knobs, drain_ms=3600000)
        top["warm_slabs"] = list(header["warm_max"])
        note = "ok\x1b[2J\x1b]0;owned\x07\rdone"
        r = run_cli("policy", "import", export_file(tmp_path / "good.hkpolicy", top, note=note), "--pin", *where)
        assert r.returncode == 0, r.stderr
        r = run_cli("policy", "show", "x#root", *where)
        assert r.returncode == 0, r.stderr
        assert "\x1b" not in r.stdout and "\x07" not in r.stdout and "\r" not in r.stdout, repr(r.stdout)
        assert "ok\\x1b[2J\\x1b]0;owned\\x07\\x0ddone" in r.stdout, r.stdout
        # pin --set: the same bounds.
        r = run_cli("policy", "pin", "x#root", "--set", "drain_ms=3600001", *where)
        assert r.returncode == 1 and "drain_ms=3600001 is outside 0..3600000" in r.stderr, r.stderr
        r = run_cli("policy", "pin", "x#root", "--set", f"tcache_cap@64=77", *where)
        assert r.returncode == 0 and "tcache_batch[" in r.stdout, (r.stdout, r.stderr)
        if d:
            alive(d)
    finally:
        if d:
            assert d.stop() == 0, d.text()
    if d:
        no_internal_errors(d)


def test_a_stored_policy_out_of_bounds_is_not_applied(tmp_path):
    """A policy stored by an earlier hakmem that took any value (before the
    import check) is not written to the program's processes: learnd says so
    once and the program starts from its default."""
    d = Learnd(tmp_path, "--learner", "static")
    try:
        w = start(["burst", 64, 1000, scaled(1)], d.shm)
        d.wait_log(f"process_started workload[{w.pid}]")
        finish(w)
        d.wait_log(f"process_exited workload[{w.pid}]")
    finally:
        assert d.stop() == 0, d.text()
    import sqlite3
    con = sqlite3.connect(d.db)
    (pid, knobs), = con.execute("SELECT program_id, knobs FROM policies WHERE origin = 'default'").fetchall()
    k = json.loads(knobs)
    k["drain_ms"] = 2**32 - 1
    con.execute("INSERT INTO policies (program_id, version, origin, knobs, digest, created) "
                "VALUES (?, 2, 'pinned', ?, 'x', 0)", (pid, json.dumps(k)))
    con.execute("UPDATE programs SET pinned_policy = (SELECT id FROM policies WHERE version = 2)")
    con.commit()
    con.close()
    d = Learnd(tmp_path / "again", "--learner", "static", db=d.db)
    try:
        w = start(["burst", 64, 1000, scaled(2)], d.shm)
        d.wait_log("stored policy v2 (pinned) is outside the allocator's bounds", 10)
        finish(w)
        alive(d)
    finally:
        assert d.stop() == 0, d.text()
    assert "cannot write its policy" not in d.text(), d.text()


def test_set_policy_fits_the_batch_to_a_capacity_the_user_named(shm):
    """Before: `hakmem ring set-policy PID tcache_cap@64=77` was refused
    whole (`tcache_batch[4]=256 (class 64 B) is outside 1..77`) although the
    user named only the capacity. Now the batch goes with it, as the
    allocator's own HAKMEM_TCACHE_CAP does, and the CLI says so."""
    w = start(["burst", 64, 1000, scaled(6)], shm)
    try:
        path = ring_path(shm, w.pid)
        r = run_cli("ring", "set-policy", w.pid, "tcache_cap@64=77", "--dir", shm)
        assert r.returncode == 0, r.stderr
        assert f"note: tcache_batch[{CLS64}] (64 B)" in r.stdout and "-> 38" in r.stdout, r.stdout
        with Ring(path) as ring:
            pol = ring.policy_in_force()
        assert (pol["tcache_cap"][CLS64], pol["tcache_batch"][CLS64]) == (77, 38)
        # A batch the user names is taken as named, and refused when it does not fit.
        r = run_cli("ring", "set-policy", w.pid, "tcache_cap@64=77", "tcache_batch@64=78", "--dir", shm)
        assert r.returncode == 1 and "tcache_batch" in r.stderr and "outside 1..77" in r.stderr, r.stderr
        r = run_cli("ring", "set-policy", w.pid, "tcache_cap@64=60", "tcache_batch@64=60", "--json", "--dir", shm)
        assert r.returncode == 0 and json.loads(r.stdout)["batch_fitted"] == [], r.stdout
    finally:
        finish(w)
