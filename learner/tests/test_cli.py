"""The `hakmem` commands that talk to hakmem-learnd (status, procs, policy,
events) and the control endpoint under them (hakmem/control.py).

Real sockets and real database files: a database built with Store, the CLI
reading it directly (learnd not running), and a stand-in learnd (a thread
running control.bind + control.serve over a StoreBackend) answering on ipc.
"""
import contextlib
import json
import os
import pwd
import re
import shutil
import socket
import sqlite3
import stat
import subprocess
import tempfile
import threading
import time

import pytest
import zmq

from conftest import HAKMEM, ROOT, proc_start_time, run_cli, scaled, wait_for
from hakmem import __version__, control
from hakmem import layout as L
from hakmem._pb import hakmem_pb2 as pb
from hakmem.cli import main
from hakmem.config import users_names
from hakmem.backend import StoreBackend, read_export
from hakmem.control import ControlError, NotRunning
from hakmem.learning import Evaluation, canonical
from hakmem.store import Store

SIZES = [0] + [16 * i for i in range(1, L.NUM_CLASSES)]
EXE, BUILD = "/usr/bin/fakeprog", "b1d0"
USERS = str(os.getuid())                      # the processes make_db records are this test's
ME = pwd.getpwuid(os.getuid()).pw_name
KEY = f"{EXE}@{BUILD}#{USERS}"
LABEL = f"{KEY} ({ME})"                       # a key as the CLI shows it to a person
OTHER = f"/opt/tools/otherprog@cafe#{USERS}"
NOBODY = pwd.getpwnam("nobody").pw_uid
THEM = NOBODY if os.getuid() != NOBODY else 0      # another user than this test's
THEM_NAME = pwd.getpwuid(THEM).pw_name
OBJECTIVE = "time + 0.125/GiB"


def knobs(drain=100, cap=64, batch=16, warm=1, **per_class):
    """Knobs with the same values in every class; per_class: knob=(class, value)."""
    n = L.NUM_CLASSES - 1
    k = {"drain_ms": drain, "tcache_cap": [0] + [cap] * n, "tcache_batch": [0] + [batch] * n,
         "warm_slabs": [0] + [warm] * n}
    for name, (c, v) in per_class.items():
        k[name.rstrip("_0123456789")][c] = v
    return k


DEFAULT = knobs()
LEARNED = knobs(drain=50, tcache_cap=(5, 128), warm_slabs=(5, 2))
THIRD = knobs(tcache_cap=(7, 32))


def make_db(path, exe=EXE, build_id=BUILD, sizes=SIZES):
    """A program with three policies (v2 the best), a second program, three
    processes (this test process: alive; one exited; one stale row), windows
    and evaluations. Returns the row ids."""
    s = Store(path)
    now = time.time()
    prog = s.program(exe, build_id, USERS, sizes, now=now - 3600)
    other = s.program("/opt/tools/otherprog", "cafe", USERS, sizes, now=now - 7200)
    me = s.process(prog, os.getpid(), proc_start_time(os.getpid()), os.getuid(), now=now - 600)
    gone = s.process(prog, 4_000_000, 1, os.getuid(), now=now - 3000)   # above pid_max: never a live pid
    s.process_exited(gone, now=now - 2000)
    s.process(prog, os.getpid(), 1, os.getuid(), now=now - 900)          # stale: same pid, other start time
    v1 = s.policy(prog, DEFAULT, "default", now=now - 3500)
    v2 = s.policy(prog, LEARNED, "learned", note="found by gp", now=now - 3000)
    v3 = s.policy(prog, THIRD, "learned", now=now - 2500)
    s.policy(other, DEFAULT, "default")
    s.add_evaluation(prog, v1, Evaluation(DEFAULT, now - 500, now - 400, 20, 0.020, 0.001, 0.015, 0.005,
                                          "measured"), "gp", OBJECTIVE)
    s.add_evaluation(prog, v2, Evaluation(LEARNED, now - 400, now - 300, 30, 0.015, 0.001, 0.011, 0.004,
                                          "accepted", baseline_cost=0.02), "gp", OBJECTIVE, baseline_policy_id=v1)
    mix = [0.0] * L.NUM_CLASSES
    mix[5], mix[7] = 0.6, 0.4
    s.set_best(prog, v2, mix=mix)
    row = {c: 1.0 for c in ("allocs", "refills", "drains", "remote_frees", "slow_ns", "os_calls", "minflt",
                            "rss_bytes", "cached_bytes", "live_bytes", "committed_bytes", "time_cost",
                            "mem_cost", "cost")}
    s.add_windows([row | {"process_id": me, "policy_id": v2, "t_start": now - 3 + i, "t_end": now - 2 + i}
                   for i in range(3)])
    s.close()
    return {"prog": prog, "other": other, "v1": v1, "v2": v2, "v3": v3, "me": me}


def sql(path, q, *args):
    db = sqlite3.connect(path)
    try:
        return db.execute(q, args).fetchall()
    finally:
        db.close()


@pytest.fixture
def tmp():
    # ipc paths are limited to ~107 bytes: a short directory, not tmp_path.
    d = tempfile.mkdtemp(prefix="hk", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_real_learnd(monkeypatch, tmp):
    # Whatever a test forgets to name, it never reaches a real learnd or database.
    monkeypatch.setenv("HAKMEM_RUN_DIR", os.path.join(tmp, "default-run"))
    monkeypatch.setenv("HAKMEM_DB", os.path.join(tmp, "default.db"))


@pytest.fixture
def db(tmp):
    path = os.path.join(tmp, "learn.db")
    ids = make_db(path)
    return path, ids


@pytest.fixture
def run_dir(tmp):
    return os.path.join(tmp, "run")


def cli(capsys, *args):
    """main() in this process: (exit code, stdout, stderr)."""
    try:
        code = main([str(a) for a in args])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def ok(capsys, *args):
    code, out, err = cli(capsys, *args)
    assert code == 0, err
    assert err == ""
    return out


def one_error(code, err, want_code=1):
    """A failure: the exit code, and one line `hakmem: error: ...` on stderr."""
    assert code == want_code, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hakmem: error: "), err
    return lines[0][len("hakmem: error: "):]


# ---- a stand-in learnd ------------------------------------------------------------
class LiveBackend(StoreBackend):
    """What the daemon does to StoreBackend: a running status, live processes,
    pins applied at once (here: recorded)."""

    def __init__(self, store, run_dir):
        super().__init__(store, run_dir)
        self.started = time.time()
        self.pins = []

    def status(self):
        st = super().status()
        st.running, st.pid, st.started, st.learner = True, os.getpid(), self.started, "fake"
        return st

    def live_processes(self):
        return [pb.Process(pid=os.getpid(), start_time=proc_start_time(os.getpid()), program=KEY, alive=True,
                           uid=os.getuid(), threads=7, rss_bytes=3 << 20, allocs_per_s=12345.0, first_seen=time.time())]

    def on_pin(self, program, policy):
        self.pins.append((program["key"], policy["version"]))


class FakeLearnd:
    """bind() + serve() in a thread; publishes `events` every 20 ms while set."""

    def __init__(self, run_dir, db_path, backend_cls=LiveBackend):
        self.run_dir, self.db_path, self.backend_cls = run_dir, db_path, backend_cls
        self.stop = threading.Event()
        self.ready = threading.Event()
        self.error = None
        self.events: list[pb.Event] = []
        self.backend = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        try:
            rep, pub = control.bind(zmq.Context.instance(), self.run_dir)
        except Exception as e:
            self.error = e
            self.ready.set()
            return
        store = Store(self.db_path)
        self.backend = self.backend_cls(store, self.run_dir)
        self.ready.set()
        last = 0.0
        try:
            while not self.stop.is_set():
                if rep.poll(10):
                    control.serve(rep, self.backend)
                if self.events and time.monotonic() - last > 0.02:
                    last = time.monotonic()
                    for ev in list(self.events):
                        control.publish(pub, ev)
        finally:
            rep.close()
            pub.close()
            store.close()

    def __enter__(self):
        self.thread.start()
        self.ready.wait(scaled(10))
        if self.error:
            raise self.error
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(scaled(10))


@pytest.fixture
def learnd(run_dir, db):
    with FakeLearnd(run_dir, db[0]) as f:
        yield f


# ---- offline: the database read directly ----------------------------------------------
def test_status_offline(capsys, db, run_dir):
    path, ids = db
    out = ok(capsys, "status", "--db", path, "--run-dir", run_dir)
    assert out.startswith(f"hakmem-learnd is not running; read from {path}\n")
    assert "2 programs known, 3 windows stored, 1 of their processes still running" in out
    assert re.search(rf"^\s+1\s+fakeprog\s+{ME}\s+1\s+3\s+-\s+-\s+v2\s+0\.015\s", out, re.M), out
    data = json.loads(ok(capsys, "status", "--json", "--db", path, "--run-dir", run_dir))
    st = data["status"]
    assert st["running"] is False and st["db_path"] == path and st["windows_stored"] == 3
    assert st["processes"] == 1 and st["programs"] == 1
    progs = {p["key"]: p for p in data["programs"]}
    assert set(progs) == {KEY, OTHER}
    p = progs[KEY]
    assert p["users"] == USERS and p["users_names"] == ME
    assert p["best"]["version"] == 2 and p["pinned"] is None and p["hot_classes"] == [5, 7]
    assert p["processes_seen"] == 3 and p["live_processes"] == 1 and p["objective"] == OBJECTIVE
    assert isinstance(p["id"], int) and p["class_size"] == SIZES


def test_procs_offline(capsys, db, run_dir):
    path, _ = db
    out = ok(capsys, "procs", "--db", path, "--run-dir", run_dir)
    assert out.startswith("hakmem-learnd is not running; read from")
    assert re.search(rf"^\s*{os.getpid()}\s+live\s+fakeprog\s+{ME}\s", out, re.M), out
    assert "4000000" not in out and out.count(f"{os.getpid()} ") == 1     # the stale row is not shown
    data = json.loads(ok(capsys, "procs", "--json", "--db", path, "--run-dir", run_dir))
    assert data["running"] is False
    assert [(p["pid"], p["alive"]) for p in data["processes"]] == [(os.getpid(), True)]
    assert data["processes"][0]["windows"] == 3 and data["processes"][0]["program"] == KEY
    assert data["processes"][0]["users"] == USERS
    data = json.loads(ok(capsys, "procs", "--all", "--json", "--db", path, "--run-dir", run_dir))
    assert sorted((p["pid"], p["start_time"] == 1, p["alive"]) for p in data["processes"]) == \
        sorted([(os.getpid(), False, True), (4_000_000, True, False), (os.getpid(), True, False)])
    out = ok(capsys, "procs", "--all", "--db", path, "--run-dir", run_dir)
    assert re.search(r"^\s*4000000\s+gone\s+fakeprog", out, re.M), out


def test_policy_list_offline(capsys, db, run_dir):
    path, _ = db
    out = ok(capsys, "policy", "list", "--db", path, "--run-dir", run_dir)
    assert f"\n{LABEL}\n" in f"\n{out}" and f"\n{OTHER} ({ME})\n" in out
    assert re.search(r"^\s+v2\s+learned\s+best\s+0\.015\s+0\.001\s+30\s.*found by gp$", out, re.M), out
    assert re.search(r"^\s+v1\s+default\s+-\s+0\.02\s", out, re.M), out
    rows = json.loads(ok(capsys, "policy", "list", "--json", "--db", path, "--run-dir", run_dir))
    assert len(rows) == 4
    rows = json.loads(ok(capsys, "policy", "list", "fakeprog", "--json", "--db", path, "--run-dir", run_dir))
    assert [(r["version"], r["origin"], r["best"], r["pinned"]) for r in rows] == \
        [(1, "default", False, False), (2, "learned", True, False), (3, "learned", False, False)]
    assert rows[1]["knobs"]["tcache_cap"][5] == 128 and rows[1]["has_objective"] and rows[2]["evaluations"] == 0
    assert {r["users"] for r in rows} == {USERS} and {r["program"] for r in rows} == {KEY}


def test_policy_show_offline(capsys, db, run_dir):
    path, _ = db
    out = ok(capsys, "policy", "show", "fakeprog", "--db", path, "--run-dir", run_dir)
    assert out.splitlines()[0] == f"{LABEL}  v2 learned (best)"
    assert "drain_ms 50 (default v1: 100)" in out and "note: found by gp" in out
    assert re.search(r"^\s+5\s+80\s+128 \(64\)\s+16\s+2 \(1\)$", out, re.M), out
    assert re.findall(r"^\s+([-\d]+)\s+([-\d]+)\s", out, re.M) == [("5", "80")]   # only what differs
    out = ok(capsys, "policy", "show", "fakeprog", "v1", "--db", path, "--run-dir", run_dir)
    assert "this is the program's default policy" in out
    p = json.loads(ok(capsys, "policy", "show", "fakeprog", "--json", "--db", path, "--run-dir", run_dir))
    assert p["version"] == 2 and p["knobs"] == canonical(LEARNED) and p["program"] == KEY
    out = ok(capsys, "policy", "show", "fakeprog", "3", "--all", "--db", path, "--run-dir", run_dir)
    # Every class, neighbours with the same knobs on one row.
    assert re.findall(r"^\s+([-\d]+)\s+([-\d]+)\s+(.+?)\s{2,}(\S+)\s+(\S+)$", out, re.M) == [
        ("1-6", "16-96", "64", "16", "1"), ("7", "112", "32 (64)", "16", "1"),
        (f"8-{L.NUM_CLASSES - 1}", f"128-{SIZES[-1]}", "64", "16", "1")], out
    ok(capsys, "policy", "pin", "fakeprog", "--set", "warm_slabs=4", "tcache_cap[9]=1", "--db", path,
       "--run-dir", run_dir)
    out = ok(capsys, "policy", "show", "fakeprog", "--db", path, "--run-dir", run_dir)     # the pinned one now
    assert re.findall(r"^\s+([-\d]+)\s+([-\d]+)\s", out, re.M) == [
        ("1-4", "16-64"), ("5", "80"), ("6-8", "96-128"), ("9", "144"), (f"10-{L.NUM_CLASSES - 1}", f"160-{SIZES[-1]}")]


def test_policy_diff_offline(capsys, db, run_dir):
    path, _ = db
    out = ok(capsys, "policy", "diff", "fakeprog", "1", "--db", path, "--run-dir", run_dir)
    assert out.splitlines() == [f"{LABEL}: v1 (default) -> v2 (learned, best)", "drain_ms 100 -> 50",
                                "class 5 (80 B): tcache_cap 64 -> 128, warm_slabs 1 -> 2", "3 changes in 1 classes"]
    d = json.loads(ok(capsys, "policy", "diff", "fakeprog", "2", "3", "--json", "--db", path, "--run-dir", run_dir))
    assert d["from"]["version"] == 2 and d["to"]["version"] == 3
    assert sorted((c["knob"], c["class"], c["old"], c["new"]) for c in d["changes"]) == sorted(
        [("drain_ms", None, 50, 100), ("tcache_cap", 5, 128, 64), ("warm_slabs", 5, 2, 1), ("tcache_cap", 7, 64, 32)])
    out = ok(capsys, "policy", "diff", "fakeprog", "2", "--db", path, "--run-dir", run_dir)
    assert out.splitlines()[-1] == "no difference"


def test_programs_are_named_like_find_program(capsys, db, run_dir):
    path, ids = db
    for name in (str(ids["prog"]), KEY, EXE, "fakeprog", f"fakeprog#{USERS}", f"fakeprog#{ME}", f"{EXE}#{USERS}",
                 f"{EXE}@{BUILD}"):
        p = json.loads(ok(capsys, "policy", "show", name, "1", "--json", "--db", path, "--run-dir", run_dir))
        assert p["program"] == KEY
    msg = one_error(*cli(capsys, "policy", "show", "nosuch", "--db", path, "--run-dir", run_dir)[::2])
    assert "no program matches 'nosuch'" in msg
    msg = one_error(*cli(capsys, "policy", "list", "/", "--db", path, "--run-dir", run_dir)[::2])
    assert "names 2 programs" in msg
    msg = one_error(*cli(capsys, "policy", "show", "fakeprog", "9", "--db", path, "--run-dir", run_dir)[::2])
    assert "no policy version 9" in msg
    msg = one_error(*cli(capsys, "policy", "show", "otherprog", "--db", path, "--run-dir", run_dir)[::2])
    assert "no pinned or best policy yet" in msg

    # Another user's processes of the same executable: another program, and
    # the base name alone no longer says which.
    with contextlib.closing(Store(path)) as s:
        theirs = s.program(EXE, BUILD, str(THEM), SIZES)
        s.policy(theirs, DEFAULT, "default")
    msg = one_error(*cli(capsys, "policy", "show", "fakeprog", "--db", path, "--run-dir", run_dir)[::2])
    assert msg.startswith("'fakeprog' names 2 programs: ") and msg.endswith("name one of them as shown, or by id")
    assert f"fakeprog#{USERS} (id {ids['prog']}, users {ME})" in msg and \
        f"fakeprog#{THEM} (id {theirs}, users {THEM_NAME})" in msg, msg
    for name in (f"fakeprog#{THEM}", f"fakeprog#{THEM_NAME}", str(theirs)):
        rows = json.loads(ok(capsys, "policy", "list", name, "--json", "--db", path, "--run-dir", run_dir))
        assert [(r["program"], r["users"], r["version"]) for r in rows] == [(f"{EXE}@{BUILD}#{THEM}", str(THEM), 1)]
    rows = json.loads(ok(capsys, "policy", "list", f"fakeprog#{ME}", "--json", "--db", path, "--run-dir", run_dir))
    assert [r["version"] for r in rows] == [1, 2, 3]
    out = ok(capsys, "status", "--db", path, "--run-dir", run_dir)
    assert re.search(rf"^\s+{theirs}\s+fakeprog\s+{THEM_NAME}\s+0\s+0\s", out, re.M), out
    assert re.search(rf"^\s+{ids['prog']}\s+fakeprog\s+{ME}\s+1\s+3\s", out, re.M), out


def test_missing_database(capsys, tmp, run_dir):
    missing = os.path.join(tmp, "nope.db")
    for args in (("status",), ("procs",), ("policy", "list"), ("policy", "pin", "x", "1"), ("policy", "unpin", "x")):
        msg = one_error(*cli(capsys, *args, "--db", missing, "--run-dir", run_dir)[::2])
        assert msg == f"no database at {missing} (hakmem-learnd has not run yet, or use --db)"
    assert not os.path.exists(missing)


def test_pin_and_unpin_offline(capsys, db, run_dir):
    path, ids = db
    pinned = lambda: sql(path, "SELECT pinned_policy FROM programs WHERE id = ?", ids["prog"])[0][0]  # noqa: E731
    out = ok(capsys, "policy", "pin", "fakeprog", "3", "--db", path, "--run-dir", run_dir)
    assert out == f"pinned v3 (learned) of {LABEL}; hakmem-learnd applies it when it next starts\n"
    assert pinned() == ids["v3"]
    p = json.loads(ok(capsys, "policy", "show", "fakeprog", "--json", "--db", path, "--run-dir", run_dir))
    assert p["version"] == 3 and p["pinned"] is True           # version 0: the pinned one first
    out = ok(capsys, "policy", "unpin", "fakeprog", "--db", path, "--run-dir", run_dir)
    assert out.startswith(f"unpinned v3 of {KEY}") and pinned() is None
    assert json.loads(ok(capsys, "policy", "unpin", "fakeprog", "--json", "--db", path, "--run-dir", run_dir)) == \
        {"message": f"{KEY} has no pinned policy"}

    # New knobs: from the best (v2), with two changes, stored with origin "pinned".
    p = json.loads(ok(capsys, "policy", "pin", "fakeprog", "--set", "drain_ms=7", "tcache_cap@80=99",
                      "--json", "--db", path, "--run-dir", run_dir))
    assert p["version"] == 4 and p["origin"] == "pinned" and p["pinned"] is True
    (pid, origin, raw, note), = sql(path, "SELECT id, origin, knobs, note FROM policies WHERE program_id = ? "
                                          "AND version = 4", ids["prog"])
    want = canonical(LEARNED)
    want["drain_ms"], want["tcache_cap"][5] = 7, 99
    assert pinned() == pid and origin == "pinned" and json.loads(raw) == want and "v2" in note
    # From the default when nothing is chosen (the other program has only its default).
    ok(capsys, "policy", "pin", "otherprog", "--set", "warm_slabs[3]=0", "--db", path, "--run-dir", run_dir)
    raw, = sql(path, "SELECT p.knobs FROM programs g JOIN policies p ON p.id = g.pinned_policy WHERE g.id = ?",
               ids["other"])[0]
    want = canonical(DEFAULT)
    want["warm_slabs"][3] = 0
    assert json.loads(raw) == want

    one_error(*cli(capsys, "policy", "pin", "fakeprog", "2", "--set", "drain_ms=1", "--db", path)[::2], 2)
    one_error(*cli(capsys, "policy", "pin", "fakeprog", "--db", path)[::2], 2)
    assert "unknown knob 'bogus'" in one_error(*cli(capsys, "policy", "pin", "fakeprog", "--set", "bogus=1",
                                                    "--db", path, "--run-dir", run_dir)[::2])
    assert "no policy version 42" in one_error(*cli(capsys, "policy", "pin", "fakeprog", "42", "--db", path,
                                                    "--run-dir", run_dir)[::2])


def test_reads_do_not_write_the_database(capsys, monkeypatch, db, run_dir, tmp):
    import hakmem.store
    opened = []

    class Recorded(Store):
        def __init__(self, path, readonly=False, **kw):
            opened.append((os.path.basename(path), readonly))
            super().__init__(path, readonly=readonly, **kw)

    monkeypatch.setattr(hakmem.store, "Store", Recorded)      # what the CLI imports when it runs
    path, _ = db
    before = sql(path, "SELECT count(*), total(version) FROM policies") + sql(path, "SELECT * FROM programs")
    os.chmod(path, 0o444)
    try:
        for args in (("status",), ("procs", "--all"), ("policy", "list"), ("policy", "show", "fakeprog"),
                     ("policy", "diff", "fakeprog", "1")):
            ok(capsys, *args, "--db", path, "--run-dir", run_dir)
    finally:
        os.chmod(path, 0o644)
    assert sql(path, "SELECT count(*), total(version) FROM policies") + sql(path, "SELECT * FROM programs") == before
    assert opened == [("learn.db", True)] * 5
    opened.clear()
    f = os.path.join(tmp, "p.hkpol")
    ok(capsys, "policy", "export", "fakeprog", "-o", f, "--db", path, "--run-dir", run_dir)
    for args in (("policy", "pin", "fakeprog", "1"), ("policy", "unpin", "fakeprog"), ("policy", "import", f)):
        ok(capsys, *args, "--db", path, "--run-dir", run_dir)
    assert opened == [("learn.db", True)] + [("learn.db", False)] * 3


# ---- export and import ----------------------------------------------------------------
def test_export_import_roundtrip(capsys, db, tmp, run_dir):
    path, ids = db
    f = os.path.join(tmp, "p.hkpol")
    out = ok(capsys, "policy", "export", "fakeprog", "2", "-o", f, "--db", path, "--run-dir", run_dir)
    assert out == f"exported v2 (learned) of {LABEL} to {f}\n"
    e = pb.PolicyExport.FromString(open(f, "rb").read())
    assert e.format == 2 and e.exe == EXE and e.build_id == BUILD and list(e.class_size) == SIZES
    assert e.users == USERS and e.users_names == ME
    assert e.exported_from == socket.gethostname() and abs(e.exported_at - time.time()) < 60
    assert e.policy.id == 0 and e.policy.version == 2 and e.policy.origin == pb.LEARNED

    fresh = os.path.join(tmp, "fresh", "learn.db")          # not there yet: import makes it
    p = json.loads(ok(capsys, "policy", "import", f, "--pin", "--json", "--db", fresh, "--run-dir", run_dir))
    assert p["version"] == 1 and p["origin"] == "learned" and p["pinned"] is True and p["program"] == KEY
    (exe, build, users, sizes, raw, origin, note), = sql(
        fresh, "SELECT g.exe, g.build_id, g.users, g.class_sizes, p.knobs, p.origin, p.note FROM programs g "
               "JOIN policies p ON p.id = g.pinned_policy")
    assert (exe, build, users, json.loads(sizes)) == (EXE, BUILD, USERS, SIZES)
    assert json.loads(raw) == canonical(LEARNED) and origin == "learned" and note == "found by gp"
    # Again: the same knobs are the same stored policy.
    out = ok(capsys, "policy", "import", f, "--db", fresh, "--run-dir", run_dir)
    assert out == f"imported as v1 (learned) of {LABEL}\n"
    assert sql(fresh, "SELECT count(*) FROM policies") == [(1,)]

    # -o - writes the same bytes to stdout (no version: the best).
    r = subprocess.run([*HAKMEM, "policy", "export", "fakeprog", "-o", "-", "--db", path, "--run-dir", run_dir],
                       capture_output=True, cwd=ROOT, timeout=scaled(60))
    assert r.returncode == 0, r.stderr
    e2 = pb.PolicyExport.FromString(r.stdout)
    assert e2.policy == e.policy and e2.exe == EXE
    # An export of the default into another program's existing database keeps origin "default".
    ok(capsys, "policy", "export", "fakeprog", "1", "-o", f, "--db", path, "--run-dir", run_dir)
    p = json.loads(ok(capsys, "policy", "import", f, "--json", "--db", fresh, "--run-dir", run_dir))
    assert p["version"] == 2 and p["origin"] == "default" and p["knobs"] == canonical(DEFAULT)


def test_import_for_other_users(capsys, db, tmp, run_dir):
    """policy import goes to the program of the file's users, or of --users:
    never to another user's program."""
    path, ids = db
    f = os.path.join(tmp, "p.hkpol")
    ok(capsys, "policy", "export", "fakeprog", "3", "-o", f, "--db", path, "--run-dir", run_dir)
    def mine():
        return sql(path, "SELECT count(*), max(version) FROM policies WHERE program_id = ?", ids["prog"])
    before = mine()

    p = json.loads(ok(capsys, "policy", "import", f, "--users", THEM_NAME, "--pin", "--json", "--db", path,
                      "--run-dir", run_dir))
    assert p["program"] == f"{EXE}@{BUILD}#{THEM}" and p["users"] == str(THEM) and p["version"] == 1
    assert p["pinned"] and p["knobs"] == canonical(THIRD)
    assert mine() == before
    assert sql(path, "SELECT pinned_policy FROM programs WHERE id = ?", ids["prog"]) == [(None,)]
    both = ",".join(str(u) for u in sorted({os.getuid(), THEM}))
    out = ok(capsys, "policy", "import", f, "--users", f"{THEM},{ME}", "--db", path, "--run-dir", run_dir)
    assert out == f"imported as v1 (learned) of {EXE}@{BUILD}#{both} ({users_names(both)})\n"
    assert sql(path, "SELECT users FROM programs ORDER BY id") == [(USERS,), (USERS,), (str(THEM),), (both,)]

    msg = one_error(*cli(capsys, "policy", "import", f, "--users", "no-such-user-hk", "--db", path,
                         "--run-dir", run_dir)[::2])
    assert msg == "--users: no user named 'no-such-user-hk' on this machine"
    assert one_error(*cli(capsys, "policy", "import", f, "--users", ",", "--db", path,
                          "--run-dir", run_dir)[::2]) == "--users names no user"

    # Exported for the same uid by someone of another name: imported for the uid, with a note.
    e = pb.PolicyExport.FromString(open(f, "rb").read())
    e.users_names = "someone-else"
    open(f, "wb").write(e.SerializeToString())
    out = ok(capsys, "policy", "import", f, "--db", path, "--run-dir", run_dir)
    assert out.splitlines() == [
        f"imported as v3 (learned) of {LABEL}",
        f"note: the file was exported for someone-else (uids {USERS}) on {e.exported_from}; here uids {USERS} "
        f"are {ME}; --users names the users here"]
    assert mine() == before

    # A file made before programs were per user says no users: --users is needed.
    e.format, e.users, e.users_names = 1, "", ""
    open(f, "wb").write(e.SerializeToString())
    msg = one_error(*cli(capsys, "policy", "import", f, "--db", path, "--run-dir", run_dir)[::2])
    assert msg.startswith("the file does not say whose program it was") and msg.endswith("with --users")
    p = json.loads(ok(capsys, "policy", "import", f, "--users", USERS, "--json", "--db", path, "--run-dir", run_dir))
    assert p["program"] == KEY and p["version"] == 3 and mine() == before
    # A format-2 file without its users is cut short.
    e.format = 2
    with pytest.raises(ControlError, match=r"^x: not a hakmem policy file \(incomplete: no users \(truncated\?\)\)$"):
        read_export(e.SerializeToString(), "x")


def test_import_refuses_corrupt_files(capsys, db, tmp, run_dir):
    path, _ = db
    f = os.path.join(tmp, "p.hkpol")
    ok(capsys, "policy", "export", "fakeprog", "-o", f, "--db", path, "--run-dir", run_dir)
    data = open(f, "rb").read()
    read_export(data, "whole")                                   # the whole file is fine
    for n in range(len(data)):                                    # cut anywhere: refused
        with pytest.raises(ControlError, match=r"^cut: not a hakmem policy file \("):
            read_export(data[:n], "cut")
    before = sql(path, "SELECT count(*) FROM policies")
    for name, content in (("truncated", data[: len(data) // 2]), ("empty", b""),
                          ("garbage", bytes(range(256)) * 4), ("text", b"drain_ms = 5\n")):
        bad = os.path.join(tmp, name)
        open(bad, "wb").write(content)
        msg = one_error(*cli(capsys, "policy", "import", bad, "--db", path, "--run-dir", run_dir)[::2])
        assert msg.startswith(f"{bad}: not a hakmem policy file ("), msg
    assert sql(path, "SELECT count(*) FROM policies") == before
    msg = one_error(*cli(capsys, "policy", "import", os.path.join(tmp, "absent"), "--db", path)[::2])
    assert msg == f"cannot read {os.path.join(tmp, 'absent')}: No such file or directory"


def test_import_refuses_another_class_table(capsys, db, tmp, run_dir):
    path, ids = db
    f = os.path.join(tmp, "p.hkpol")
    ok(capsys, "policy", "export", "fakeprog", "-o", f, "--db", path, "--run-dir", run_dir)
    e = pb.PolicyExport.FromString(open(f, "rb").read())
    e.class_size[5] += 8
    e.policy.knobs.drain_ms = 3                                   # new knobs: would be stored if accepted
    open(f, "wb").write(e.SerializeToString())
    before = sql(path, "SELECT count(*) FROM policies")
    msg = one_error(*cli(capsys, "policy", "import", f, "--pin", "--db", path, "--run-dir", run_dir)[::2])
    assert msg.startswith(f"the file's class table differs from {KEY}'s (class 5: 88 B in the file, 80 B here)")
    assert sql(path, "SELECT count(*) FROM policies") == before
    assert sql(path, "SELECT pinned_policy FROM programs WHERE id = ?", ids["prog"]) == [(None,)]
    # A table of another length is not for this hakmem at all.
    del e.class_size[-1]
    open(f, "wb").write(e.SerializeToString())
    msg = one_error(*cli(capsys, "policy", "import", f, "--db", path, "--run-dir", run_dir)[::2])
    assert msg == f"{f}: not a hakmem policy file (its class table has {L.NUM_CLASSES - 1} classes, " \
                  f"this hakmem has {L.NUM_CLASSES})"


# ---- through a running learnd -----------------------------------------------------------
def test_commands_through_learnd(capsys, learnd, db, tmp, run_dir):
    path, ids = db
    nodb = os.path.join(tmp, "unused.db")           # learnd answers: the --db is not read
    out = ok(capsys, "status", "--run-dir", run_dir, "--db", nodb)
    assert out.startswith(f"hakmem-learnd {__version__} running, pid {os.getpid()}, up ")
    st = json.loads(ok(capsys, "status", "--json", "--run-dir", run_dir, "--db", nodb))["status"]
    assert st["running"] is True and st["pid"] == os.getpid() and st["db_path"] == path and st["learner"] == "fake"

    procs = json.loads(ok(capsys, "procs", "--json", "--run-dir", run_dir, "--db", nodb))
    assert procs["running"] is True
    assert [(p["pid"], p["threads"], p["rss_bytes"]) for p in procs["processes"]] == [(os.getpid(), 7, 3 << 20)]
    out = ok(capsys, "procs", "--run-dir", run_dir, "--db", nodb)
    assert "not running" not in out
    assert re.search(rf"^\s*{os.getpid()}\s+live\s+fakeprog\s+{ME}\s+7\s+3\.0\s+12,345\s", out, re.M), out
    assert procs["processes"][0]["users"] == USERS     # learnd's message lacks it: taken from the key

    rows = json.loads(ok(capsys, "policy", "list", "fakeprog", "--json", "--run-dir", run_dir, "--db", nodb))
    assert [r["version"] for r in rows] == [1, 2, 3]
    out = ok(capsys, "policy", "show", "fakeprog", "--run-dir", run_dir, "--db", nodb)
    assert re.search(r"^\s+5\s+80\s+128 \(64\)\s+16\s+2 \(1\)$", out, re.M), out
    out = ok(capsys, "policy", "diff", "fakeprog", "1", "3", "--run-dir", run_dir, "--db", nodb)
    assert "class 7 (112 B): tcache_cap 64 -> 32" in out

    out = ok(capsys, "policy", "pin", "fakeprog", "1", "--run-dir", run_dir, "--db", nodb)
    assert out == f"pinned v1 (default) of {LABEL}; hakmem-learnd applies it now\n"
    assert learnd.backend.pins == [(KEY, 1)]
    assert sql(path, "SELECT pinned_policy FROM programs WHERE id = ?", ids["prog"]) == [(ids["v1"],)]
    out = ok(capsys, "policy", "unpin", "fakeprog", "--run-dir", run_dir, "--db", nodb)
    assert out == f"unpinned v1 of {KEY}\n"
    assert sql(path, "SELECT pinned_policy FROM programs WHERE id = ?", ids["prog"]) == [(None,)]

    f = os.path.join(tmp, "p.hkpol")
    ok(capsys, "policy", "export", "fakeprog", "3", "-o", f, "--run-dir", run_dir, "--db", nodb)
    e = pb.PolicyExport.FromString(open(f, "rb").read())
    e.policy.knobs.drain_ms = 11
    open(f, "wb").write(e.SerializeToString())
    p = json.loads(ok(capsys, "policy", "import", f, "--pin", "--json", "--run-dir", run_dir, "--db", nodb))
    assert p["version"] == 4 and p["pinned"] and learnd.backend.pins[-1] == (KEY, 4)
    p = json.loads(ok(capsys, "policy", "import", f, "--users", THEM_NAME, "--json", "--run-dir", run_dir,
                      "--db", nodb))
    assert p["program"] == f"{EXE}@{BUILD}#{THEM}" and p["version"] == 1 and not p["pinned"]
    assert not os.path.exists(nodb)
    msg = one_error(*cli(capsys, "policy", "show", "nosuch", "--run-dir", run_dir)[::2])
    assert "no program matches 'nosuch'" in msg


def test_malformed_requests_do_not_stop_the_server(learnd, run_dir):
    s = zmq.Context.instance().socket(zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(control.control_endpoint(run_dir))
    try:
        for bad, want in ((b"\xff\xff\xff\xff", "malformed request: "), (b"", "malformed request: no request"),
                          (pb.Request(policy_show=pb.PolicyShowRequest(program="fakeprog", version=77))
                           .SerializeToString(), "program 1 has no policy version 77")):
            s.send(bad)
            assert s.poll(5000)
            r = pb.Reply.FromString(s.recv())
            assert not r.ok and r.error.startswith(want), r.error
            assert "\n" not in r.error
        s.send_multipart([b"a", b"b"])
        assert s.poll(5000)
        r = pb.Reply.FromString(s.recv())
        assert not r.ok and r.error == "malformed request: 2 frames, expected 1"
    finally:
        s.close()
    with control.Client(run_dir) as c:
        r = c.call(pb.Request(status=pb.StatusRequest()))
    assert r.ok and r.status.running and r.status.pid == os.getpid()


def test_serve_answers_what_waits_and_survives_internal_errors(db, run_dir):
    class Broken(StoreBackend):
        def status(self):
            raise RuntimeError("boom\nsecond line")

    ctx = zmq.Context.instance()
    rep, pub = control.bind(ctx, run_dir)
    store = Store(db[0], readonly=True)
    clients = []
    try:
        backend = Broken(store, run_dir)
        assert control.serve(rep, backend) == 0                   # nothing waiting: returns at once
        for _ in range(3):
            c = ctx.socket(zmq.REQ)
            c.setsockopt(zmq.LINGER, 0)
            c.connect(control.control_endpoint(run_dir))
            clients.append(c)
        clients[0].send(pb.Request(status=pb.StatusRequest()).SerializeToString())
        for c in clients[1:]:
            c.send(pb.Request(policy_list=pb.PolicyListRequest()).SerializeToString())
        wait_for(lambda: rep.poll(0), what="requests")
        # All three queued. ZeroMQ shows no queue to poll: the other two were
        # sent with the first, so a tenth of a second (scaled) is room to spare.
        time.sleep(scaled(0.1))
        served = control.serve(rep, backend, max_requests=2)
        assert served == 2
        served += wait_for(lambda: control.serve(rep, backend), what="the third request")
        assert served == 3
        replies = []
        for c in clients:
            assert c.poll(5000)
            replies.append(pb.Reply.FromString(c.recv()))
        assert not replies[0].ok and replies[0].error == "internal error: RuntimeError: boom second line"
        assert all(r.ok and len(r.policies) == 4 for r in replies[1:])
    finally:
        for c in clients:
            c.close()
        rep.close()
        pub.close()
        store.close()


def test_a_server_inside_a_computation_answers_reads_and_keeps_changes_for_later(db, run_dir):
    """learnd answers between the steps of a learner's long computation
    (control.Server.serve(readonly=True)): what only reads is answered then,
    also when it came after a request that changes a program (here a pin),
    which is kept, unanswered, until the serve() between turns answers it
    first; past control.KEPT_MAX kept changes, a change is refused at once."""
    ctx = zmq.Context.instance()
    rep, pub = control.bind(ctx, run_dir)
    store = Store(db[0])
    clients = []

    def client(req):
        c = ctx.socket(zmq.REQ)
        c.setsockopt(zmq.LINGER, 0)
        c.connect(control.control_endpoint(run_dir))
        c.send(req.SerializeToString())
        clients.append(c)
        return c
    try:
        server = control.Server(rep, StoreBackend(store, run_dir))
        a = client(pb.Request(status=pb.StatusRequest()))
        assert wait_for(lambda: server.serve(readonly=True), what="the status answered inside") == 1
        b = client(pb.Request(policy_pin=pb.PolicyPinRequest(program="fakeprog", version=2)))
        wait_for(lambda: rep.poll(0) or server.kept, what="the pin")
        assert server.serve(readonly=True) == 0 and server.kept is not None, "the pin kept, not answered"
        c = client(pb.Request(status=pb.StatusRequest()))
        assert wait_for(lambda: server.serve(readonly=True), what="the status behind the pin") == 1
        assert c.poll(5000) and not b.poll(0), "the status answered, the pin still kept"
        assert store.find_program("fakeprog")["pinned_policy"] is None, "not pinned before its turn"
        assert server.serve() == 1 and not server.kept, "the kept pin answered first between turns"
        for sock in (a, b):
            assert sock.poll(5000)
        replies = [pb.Reply.FromString(sock.recv()) for sock in (a, b, c)]
        assert all(r.ok for r in replies), replies
        assert replies[1].policies[0].pinned and replies[1].policies[0].version == 2
        # A flood of changes inside a computation: KEPT_MAX kept, the rest refused at once.
        flood = [client(pb.Request(policy_unpin=pb.PolicyUnpinRequest(program="fakeprog")))
                 for _ in range(control.KEPT_MAX + 3)]
        refused = [0]

        def refusals():   # serve(readonly=True) answers nothing here but the refusals
            refused[0] += server.serve(readonly=True)
            return refused[0] >= 3
        wait_for(refusals, what="three changes refused")
        busy = wait_for(lambda: (lambda b: b if len(b) >= 3 else None)([k for k in flood if k.poll(0)]),
                        what="the refusals' replies")
        assert len(server.kept) == control.KEPT_MAX and len(busy) == 3, (len(server.kept), len(busy))
        assert all("busy" in pb.Reply.FromString(sock.recv()).error for sock in busy)
        served = 0
        while served < control.KEPT_MAX:
            served += server.serve(max_requests=1000)
        assert all(sock.poll(5000) for sock in flood if sock not in busy)
        # A serve inside a serve (a learner computing inside an answer) answers nothing.
        server.serving = True
        d = client(pb.Request(status=pb.StatusRequest()))
        time.sleep(scaled(0.1))
        assert server.serve() == 0 and not d.poll(0)
        server.serving = False
        assert wait_for(lambda: server.serve(), what="the last status") == 1
    finally:
        for sock in clients:
            sock.close()
        rep.close()
        pub.close()
        store.close()


def test_client_times_out_and_does_not_reuse_the_socket(db, run_dir):
    ctx = zmq.Context.instance()
    rep, pub = control.bind(ctx, run_dir)
    done = threading.Event()

    def serve_until_done():
        with contextlib.closing(Store(db[0], readonly=True)) as store:
            backend = StoreBackend(store, run_dir)
            while not done.is_set():
                if rep.poll(10):
                    control.serve(rep, backend)

    th = threading.Thread(target=serve_until_done)
    c = control.Client(run_dir, timeout=0.2)
    try:
        t = time.monotonic()
        with pytest.raises(NotRunning, match=r"did not answer within 0\.2 s"):
            c.call(pb.Request(status=pb.StatusRequest()))          # nobody serves yet
        assert 0.15 < time.monotonic() - t < scaled(2)      # the client waited its own 0.2 s (not scaled)
        th.start()                  # answers the lost request first: its reply must go nowhere
        c.timeout = 5
        r = c.call(pb.Request(policy_list=pb.PolicyListRequest(program="fakeprog")))
        assert r.ok and [p.version for p in r.policies] == [1, 2, 3]   # this request's reply
        r = c.call(pb.Request(status=pb.StatusRequest()))
        assert r.ok and r.status.db_path == db[0]
    finally:
        done.set()
        if th.is_alive():
            th.join()
        c.close()
        rep.close()
        pub.close()


def test_is_running(db, run_dir):
    assert not control.is_running(run_dir)                          # no directory
    with FakeLearnd(run_dir, db[0]):
        assert control.is_running(run_dir)
    assert not os.path.exists(control.control_path(run_dir)) or not control.is_running(run_dir)
    with pytest.raises(NotRunning, match="is not running"):
        control.Client(os.path.join(run_dir, "nope")).call(pb.Request(status=pb.StatusRequest()))


# ---- events ---------------------------------------------------------------------------
def _event(kind, pid=1234, msg="pinned v3"):
    return pb.Event(time=time.time(), kind=kind, program=KEY, pid=pid, message=msg)


def events_cli(*args):
    try:
        return subprocess.run([*HAKMEM, "events", *args], capture_output=True, text=True, cwd=ROOT, timeout=scaled(20))
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"hakmem events got no event in {scaled(20):g} s: {e.stdout!r}") from None


def test_events(learnd, run_dir):
    learnd.events = [_event("policy_pinned"), _event("process_started", pid=0, msg="new process")]
    r = events_cli("--count", "4", "--run-dir", run_dir)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 4
    for ln in lines:
        assert re.fullmatch(r"\d\d:\d\d:\d\d (policy_pinned fakeprog 1234 pinned v3|process_started fakeprog - "
                            r"new process)", ln), ln
    assert {ln.split()[1] for ln in lines} == {"policy_pinned", "process_started"}
    r = events_cli("--json", "--count", "3", "--kind", "policy_", "--run-dir", run_dir)
    assert r.returncode == 0, r.stderr
    evs = [json.loads(ln) for ln in r.stdout.splitlines()]
    assert len(evs) == 3 and all(e["kind"] == "policy_pinned" and e["pid"] == 1234 and e["program"] == KEY
                                 for e in evs)


def test_events_need_learnd(capsys, run_dir):
    msg = one_error(*cli(capsys, "events", "--count", "1", "--run-dir", run_dir)[::2])
    assert msg.startswith(f"hakmem-learnd is not running on {run_dir}")


def test_publish_and_subscribe(run_dir):
    ctx = zmq.Context.instance()
    rep, pub = control.bind(ctx, run_dir)
    sub = control.subscribe(run_dir, ["relearn"])
    try:
        def got():
            control.publish(pub, _event("warm_start"))
            control.publish(pub, _event("relearn", msg="mix changed"))
            return control.recv_event(sub, timeout=0.05)
        ev = wait_for(got, what="an event")             # the subscription has reached the publisher
        assert ev.kind == "relearn" and ev.message == "mix changed"
        while sub.poll(50):
            sub.recv_multipart()
        control.publish(pub, _event("warm_start"))
        control.publish(pub, _event("relearn", msg="again"))
        assert sub.poll(5000)
        topic, data = sub.recv_multipart()              # two frames: the kind, then the event
        assert topic == b"relearn" and pb.Event.FromString(data).message == "again"
        assert not sub.poll(100)                        # warm_start was filtered out
    finally:
        sub.close()
        rep.close()
        pub.close()


# ---- bind: the run directory and its sockets --------------------------------------------
def test_bind_makes_a_private_directory_and_sockets(run_dir):
    rep, pub = control.bind(zmq.Context.instance(), run_dir)
    try:
        assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
        for p in (control.control_path(run_dir), control.events_path(run_dir)):
            st = os.stat(p)
            assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
    finally:
        rep.close()
        pub.close()


def test_bind_replaces_stale_sockets(run_dir, db):
    os.mkdir(run_dir, 0o700)
    for p in (control.control_path(run_dir), control.events_path(run_dir)):
        s = socket.socket(socket.AF_UNIX)
        s.bind(p)           # a socket file nobody listens on: a learnd that was killed
        s.close()
    t = time.monotonic()
    with FakeLearnd(run_dir, db[0]):
        assert time.monotonic() - t < scaled(2)
        assert control.is_running(run_dir)


def test_bind_refuses_unsafe_directories(tmp):
    ctx = zmq.Context.instance()
    d = os.path.join(tmp, "open")
    os.mkdir(d)
    os.chmod(d, 0o777)
    with pytest.raises(ControlError, match=r"writable by group or others \(mode 0777\); refusing"):
        control.bind(ctx, d)
    os.chmod(d, 0o770)
    with pytest.raises(ControlError, match="writable by group or others"):
        control.bind(ctx, d)
    assert os.listdir(d) == []
    link = os.path.join(tmp, "link")
    os.symlink(tmp, link)
    with pytest.raises(ControlError, match="not a directory"):
        control.bind(ctx, link)
    if os.geteuid() == 0:
        theirs = os.path.join(tmp, "theirs")
        os.mkdir(theirs, 0o700)
        os.chown(theirs, 65534, 65534)
        with pytest.raises(ControlError, match=r"owned by uid 65534, not by this user \(uid 0\)"):
            control.bind(ctx, theirs)


def test_run_directory_lock_refuses_a_second_learnd(learnd, run_dir):
    fd = control.lock_run_dir(run_dir)
    try:
        assert open(os.path.join(run_dir, "learnd.lock")).read() == f"{os.getpid()}\n"
        with pytest.raises(ControlError) as e:
            control.lock_run_dir(run_dir)
        assert str(e.value) == f"another hakmem-learnd is running on {run_dir} (pid {os.getpid()}, it holds " \
                               f"learnd.lock)"
        with control.Client(run_dir) as c:                            # the first one still answers
            assert c.call(pb.Request(status=pb.StatusRequest())).ok
    finally:
        os.close(fd)
    os.close(control.lock_run_dir(run_dir))                           # released with its descriptor


# ---- conversions ----------------------------------------------------------------------
def test_knob_conversions():
    k = control.knobs_to_pb(LEARNED)
    assert control.knobs_from_pb(k) == canonical(LEARNED)
    del k.warm_slabs[-1]
    with pytest.raises(ControlError, match=f"warm_slabs has {L.NUM_CLASSES - 1} classes, this hakmem has "
                                           f"{L.NUM_CLASSES}"):
        control.knobs_from_pb(k)
    d = control.to_dict(pb.Process(pid=3, start_time=1 << 40, rss_bytes=5))
    assert d["start_time"] == 1 << 40 and d["rss_bytes"] == 5 and d["alive"] is False
    assert control.to_dict(pb.Policy(origin=pb.REPLAY))["origin"] == "replay"
    assert control.to_dict(pb.Policy())["knobs"] is None


def test_pin_knobs_through_the_backend(db):
    path, ids = db
    with contextlib.closing(Store(path)) as s:
        b = StoreBackend(s)
        bad = canonical(DEFAULT)
        bad["tcache_cap"] = bad["tcache_cap"][:10]
        with pytest.raises(ControlError, match="tcache_cap has 10 classes"):
            b.pin("fakeprog", 0, bad, "")
        neg = canonical(DEFAULT)
        neg["warm_slabs"][4] = -1
        with pytest.raises(ControlError, match=r"warm_slabs\[4\]=-1 \(class 64 B\) is outside 0\.\.1024"):
            b.pin("fakeprog", 0, neg, "")
        big = canonical(DEFAULT)
        big["drain_ms"] = 2**32 - 1
        with pytest.raises(ControlError, match="drain_ms=4294967295 is outside 0..3600000; the allocator would "
                                               "refuse this policy, nothing was stored"):
            b.pin("fakeprog", 0, big, "")
        with pytest.raises(ControlError, match="one of the two"):
            b.pin("fakeprog", 2, canonical(DEFAULT), "")
        p = b.pin("fakeprog", 0, canonical(DEFAULT), "")          # the default's knobs: the stored v1
        assert p.version == 1 and p.origin == pb.DEFAULT and p.pinned


# ---- the command line ---------------------------------------------------------------------
COMMANDS = [("status",), ("procs",), ("events",), ("policy",), ("policy", "list"), ("policy", "show"),
            ("policy", "diff"), ("policy", "pin"), ("policy", "unpin"), ("policy", "export"),
            ("policy", "import"), ("ring",)]


@pytest.mark.parametrize("cmd", COMMANDS, ids=" ".join)
def test_help(capsys, cmd):
    code, out, err = cli(capsys, *cmd, "--help")
    assert code == 0 and out.startswith(f"usage: hakmem {' '.join(cmd)}"), out
    if cmd[0] != "policy" or len(cmd) > 1:
        assert cmd == ("ring",) or "--run-dir" in out


def test_help_as_a_program():
    r = run_cli("policy", "pin", "--help")
    assert r.returncode == 0 and "--set KEY=VALUE" in r.stdout and "KNOB@SIZE=N" in r.stdout


@pytest.mark.parametrize("args", [
    ("policy",), ("policy", "show"), ("policy", "show", "fakeprog", "x"), ("policy", "show", "fakeprog", "0"),
    ("policy", "export", "fakeprog"), ("policy", "bogus"), ("events", "--count", "many"), ("procs", "extra"),
    ("status", "--bogus"), ("policy", "diff", "fakeprog"), ("policy", "import"),
], ids=" ".join)
def test_usage_errors(capsys, db, args):
    code, out, err = cli(capsys, *args, "--db", db[0])
    one_error(code, err, 2)
    assert out == ""


def test_ring_commands_still_there(capsys, tmp):
    d = os.path.join(tmp, "shm")
    os.mkdir(d)
    assert json.loads(ok(capsys, "ring", "list", "--dir", d, "--json")) == []
