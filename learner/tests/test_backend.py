"""backend.py: what a control request does to the store, without sockets.
Pin takes a stored version or new knobs; unpin says what it did; export
and import carry a policy to the program of the same executable, build id
and users on another machine, and refuse a file for another class table or
one that does not say whose program it was. The live hooks (on_pin,
on_unpin: what a running learnd does at once) are called after the store
is written."""
import contextlib
import os

import pytest

from hakmem import layout as L
from hakmem._pb import hakmem_pb2 as pb
from hakmem.backend import StoreBackend, check_export, read_export
from hakmem.control import ControlError
from hakmem.learning import canonical
from hakmem.store import Store

EXE, BUILD = "/usr/bin/fakeprog", "b1d0"
USERS = str(os.getuid())
SIZES = [0] + [16 * i for i in range(1, L.NUM_CLASSES)]


def knobs(drain=100, cap=64):
    n = L.NUM_CLASSES - 1
    return {"drain_ms": drain, "tcache_cap": [0] + [cap] * n, "tcache_batch": [0] + [16] * n,
            "warm_slabs": [0] + [1] * n}


class Recording(StoreBackend):
    def __init__(self, store):
        super().__init__(store, "/nonexistent-run")
        self.calls = []

    def on_pin(self, program, policy):
        assert program["pinned_policy"] == policy["id"]           # the store is written first
        self.calls.append(("pin", program["key"], policy["version"]))

    def on_unpin(self, program, was):
        assert program["pinned_policy"] is None
        self.calls.append(("unpin", program["key"], was["version"]))


@pytest.fixture
def backend(tmp_path):
    with contextlib.closing(Store(tmp_path / "learn.db")) as s:
        prog = s.program(EXE, BUILD, USERS, SIZES)
        s.policy(prog, knobs(), "default")
        s.policy(prog, knobs(drain=50), "learned")
        yield Recording(s)


def test_pin_a_version_or_knobs_never_both(backend):
    with pytest.raises(ControlError, match="one of the two"):
        backend.pin("fakeprog", 2, knobs(), "")
    with pytest.raises(ControlError, match="one of the two"):
        backend.pin("fakeprog", 0, None, "")
    p = backend.pin("fakeprog", 2, None, "")
    assert (p.version, p.origin, p.pinned) == (2, pb.LEARNED, True)
    p = backend.pin("fakeprog", 0, knobs(drain=7), "by hand")
    assert (p.version, p.origin, p.note, p.knobs.drain_ms) == (3, pb.PINNED, "by hand", 7)
    assert backend.pin("fakeprog", 0, knobs(), "").version == 1    # knobs already stored: that version
    assert backend.calls == [("pin", f"{EXE}@{BUILD}#{USERS}", v) for v in (2, 3, 1)]


def test_pin_refuses_knobs_the_allocator_cannot_take(backend):
    bad = canonical(knobs())
    bad["tcache_cap"] = bad["tcache_cap"][:10]
    with pytest.raises(ControlError, match="tcache_cap has 10 classes"):
        backend.pin("fakeprog", 0, bad, "")
    neg = canonical(knobs())
    neg["warm_slabs"][4] = -1
    with pytest.raises(ControlError, match=r"warm_slabs\[4\]=-1 \(class 64 B\) is outside"):
        backend.pin("fakeprog", 0, neg, "")
    over = canonical(knobs())
    over["tcache_batch"][4] = over["tcache_cap"][4] + 1          # under 2^32, over its capacity
    with pytest.raises(ControlError, match=r"tcache_batch\[4\]=\d+ \(class 64 B\) is outside 1\.\.\d+ \(at most the "
                                           r"capacity\); the allocator would refuse this policy, nothing was stored"):
        backend.pin("fakeprog", 0, over, "")
    assert backend.calls == [] and [p.version for p in backend.policies("fakeprog")] == [1, 2]


def test_unpin_says_what_it_did(backend):
    key = f"{EXE}@{BUILD}#{USERS}"
    assert backend.unpin("fakeprog") == f"{key} has no pinned policy"
    backend.pin("fakeprog", 2, None, "")
    assert backend.unpin("fakeprog") == f"unpinned v2 of {key}"
    assert backend.calls[-1] == ("unpin", key, 2)


def test_export_and_import_to_another_store(backend, tmp_path):
    f = backend.export("fakeprog", 2)
    assert (f.exe, f.build_id, f.users, f.policy.id, f.policy.version) == (EXE, BUILD, USERS, 0, 2)
    check_export(f)
    assert read_export(f.SerializeToString(), "x") == f
    with contextlib.closing(Store(tmp_path / "other.db")) as s:
        other = Recording(s)
        p = other.import_(f, pin=True)                            # the program is made
        assert (p.program, p.version, p.origin, p.pinned) == (f"{EXE}@{BUILD}#{USERS}", 1, pb.LEARNED, True)
        assert p.note.startswith("imported from ")
        assert other.calls == [("pin", p.program, 1)]
        theirs = other.import_(f, pin=False, users="0,65534")     # another set of users: another program
        assert theirs.program == f"{EXE}@{BUILD}#0,65534" and not theirs.pinned


def test_import_refuses_another_class_table_and_files_without_users(backend):
    f = backend.export("fakeprog", 1)
    f.class_size[5] += 8
    f.policy.knobs.drain_ms = 3
    with pytest.raises(ControlError, match=r"class table differs .* \(class 5: 88 B in the file, 80 B here\)"):
        backend.import_(f, pin=True)
    assert [p.version for p in backend.policies("fakeprog")] == [1, 2] and backend.calls == []
    g = backend.export("fakeprog", 1)
    g.format, g.users, g.users_names = 1, "", ""
    with pytest.raises(ControlError, match="does not say whose program it was"):
        backend.import_(g, pin=False)
    assert backend.import_(g, pin=False, users=USERS).version == 1


def test_read_export_refuses_a_file_cut_anywhere(backend):
    data = backend.export("fakeprog", 2).SerializeToString()
    for n in range(len(data)):
        with pytest.raises(ControlError, match=r"^cut: not a hakmem policy file \("):
            read_export(data[:n], "cut")


def test_status_from_the_store_alone(backend):
    st = backend.status()
    assert (st.running, st.pid, st.db_path, st.run_dir) == (False, 0, backend.store.path, "/nonexistent-run")


def test_programs_take_a_few_queries_however_many_programs_there_are(tmp_path):
    """`hakmem programs` made three store queries a program (its best and
    pinned policies, its latest evaluation). In learnd each query lets
    another thread take the GIL, and with one busy (a screening reading its
    trace) each cost up to a switch interval: several hundred programs
    kept learnd answering for 7 s in the chaos walk. Now a fixed few, with
    the same answers."""
    with contextlib.closing(Store(tmp_path / "learn.db")) as s:
        for i in range(40):
            prog = s.program(f"/usr/bin/p{i}", BUILD, USERS, SIZES)
            a = s.policy(prog, knobs(), "default")
            b = s.policy(prog, knobs(drain=50 + i), "learned")
            s.set_best(prog, b)
            if i % 2:
                s.pin(prog, a)
            for t, obj in ((10.0, f"older{i}"), (20.0, f"latest{i}")) if i % 3 else ():
                s.db.execute("INSERT INTO evaluations (program_id, policy_id, t_start, t_end, windows, cost_mean, "
                             "verdict, learner, objective) VALUES (?, ?, ?, ?, 5, 1.0, 'measured', 'gp', ?)",
                             (prog, b, t - 5, t, obj))
        s.db.commit()
        backend = StoreBackend(s, "/nonexistent-run")
        queries = []
        s.db.set_trace_callback(queries.append)
        try:
            progs = backend.programs()
        finally:
            s.db.set_trace_callback(None)
        assert len(progs) == 40
        assert len(queries) <= 4, f"{len(queries)} queries for 40 programs"
        for p in progs:
            i = int(p.exe.rsplit("p", 1)[1])
            assert p.best.version == 2 and p.best.knobs.drain_ms == 50 + i
            assert (p.pinned.version if p.HasField("pinned") else None) == (1 if i % 2 else None)
            assert p.state == ("pinned" if i % 2 else "")
            assert p.objective == (f"latest{i}" if i % 3 else ""), p.objective
