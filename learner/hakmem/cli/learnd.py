"""The commands that talk to hakmem-learnd, or read its database when it is
not running: `hakmem status`, `procs` and `events` here, `policy ...` in
policy.py, and what they share (which backend answers, how programs,
users and policies are shown)."""
import contextlib
import json
import os
import time

from .. import store
from .._pb import hakmem_pb2 as pb
from ..backend import StoreBackend
from ..config import default_db, default_run_dir, users_names
from ..control import (Client, ClientBackend, ControlError, control_path, is_running, recv_event, subscribe,
                       to_dict)
from ..ring import RingError
from ..store import StoreError
from .common import _fail, _out_json, _span, _table, _when

ERRORS = (RingError, ControlError, StoreError)      # what main() reports as one line
CLIENT_TIMEOUT_S = 5.0     # learnd answers what only reads within a turn's step (control.Server) ...
CLIENT_WRITE_TIMEOUT_S = 60.0   # ... and a pin, unpin or import at the end of its turn, which a learner's
                                # computation on a loaded machine can make seconds long


@contextlib.contextmanager
def _backend(args, write=False, create=False):
    """(backend, running): learnd's when it answers, else the database's
    (read-only unless write; create: a missing database is made)."""
    run_dir = os.path.abspath(args.run_dir or default_run_dir())
    if is_running(run_dir):
        with Client(run_dir, timeout=CLIENT_WRITE_TIMEOUT_S if write else CLIENT_TIMEOUT_S) as c:
            yield ClientBackend(c), True
        return
    db = os.path.abspath(args.db or default_db())
    if not create and not os.path.exists(db):
        raise ControlError(f"no database at {db} (hakmem-learnd has not run yet, or use --db)")
    st = store.Store(db, readonly=not write)
    try:
        yield StoreBackend(st, run_dir), False
    finally:
        st.close()


def _base(key):
    """A program key's executable base name (keys are exe@build_id#users)."""
    return os.path.basename(key.rsplit("@", 1)[0]) or key


def _names(users):
    """A program's users for a person: names where uids have one, "-" for none."""
    return users_names(users) or "-"


def _label(key, users=None):
    """A program key with its users' names when they say more than the uids:
    /usr/bin/python3.11@ab12#0 (root)."""
    if users is None:
        users = key.rsplit("#", 1)[1] if "#" in key else ""
    names = users_names(users)
    return f"{key} ({names})" if names and names != users else key


def _user(uid):
    return users_names(str(uid))


def _origin(p):
    return pb.Origin.Name(p.origin).lower() if p.origin in pb.Origin.values() else str(p.origin)


def _objective(p):
    if not p.has_objective:
        return "not measured"
    return f"{p.objective:.5g} ± {p.objective_sd:.2g} over {p.evaluations} windows"


def _not_running_note(running, db):
    if not running:
        print(f"hakmem-learnd is not running; read from {db}")



def _program_of(b, key):
    for p in b.programs():
        if p.key == key:
            return p
    raise ControlError(f"program {key} is gone from the store")


def _default_policy(policies):
    d = [p for p in policies if p.origin == pb.DEFAULT]
    return min(d, key=lambda p: p.version) if d else None


def _flags(p):
    return ", ".join(x for x, on in (("pinned", p.pinned), ("best", p.best)) if on)



def cmd_status(args):
    with _backend(args) as (b, running):
        st = b.status()
        progs = b.programs()
    if args.json:
        _out_json({"status": to_dict(st), "programs": [to_dict(p) for p in progs]})
        return 0
    if st.running:
        print(f"hakmem-learnd {st.version} running, pid {st.pid}, up {_span(time.time() - st.started)}")
        print(f"learner {st.learner or '?'}, exploration {'on' if st.exploration else 'off'}, objective "
              f"{st.objective or '?'}, a window every {st.sample_period_s:g} s")
        print(f"database {st.db_path}, {st.windows_stored} windows stored")
        print(f"telemetry {st.shm_dir}, run dir {st.run_dir}")
        print(f"{st.processes} live processes of {st.programs} programs")
        if st.kernel_source:
            print(f"kernel-side cost: {st.kernel_source}, {st.kernel_why}"
                  + (f", restarted {st.kernel_restarts} times" if st.kernel_restarts else ""))
        if st.fleet:
            print(f"fleet: {st.fleet}")
    else:
        print(f"hakmem-learnd is not running; read from {st.db_path}")
        print(f"{len(progs)} programs known, {st.windows_stored} windows stored, {st.processes} of their "
              f"processes still running")
    for w in st.warnings:
        print(f"warning: {w}")
    if progs:
        rows = []
        for p in progs:
            rows.append((p.id, _base(p.key), _names(p.users), p.live_processes, p.processes_seen, p.state or "-",
                         f"v{p.pinned.version}" if p.HasField("pinned") else "-",
                         f"v{p.best.version}" if p.HasField("best") else "-",
                         f"{p.best.objective:.4g}" if p.HasField("best") and p.best.has_objective else "-",
                         _when(p.last_seen), p.kernel_source or "-"))
        print()
        _table(("id", "program", "users", "live", "seen", "state", "pinned", "best", "best cost", "last seen",
                "kernel"), rows)
        for p in progs:      # hakmem-bpf's figures, or why /proc (kernel.py)
            if p.kernel_source:
                figs = ", ".join(f"{n} {v:,.4g}/s" for n, v in zip(st.kernel_counters, p.kernel))
                print(f"{_base(p.key)}: kernel-side from {p.kernel_source}"
                      + (f" ({p.kernel_why})" if p.kernel_why else "") + (f": {figs}" if figs else ""))
    return 0


def cmd_procs(args):
    with _backend(args) as (b, running):
        procs = b.processes(args.all)
        db = None if running else b.store.path
    if args.json:
        _out_json({"running": running, "processes": [to_dict(p) for p in procs]})
        return 0
    _not_running_note(running, db)
    if not procs:
        print("no process" + ("" if args.all else " running (--all shows exited ones)"))
        return 0
    if running:
        rows = [(p.pid, "live" if p.alive else "gone", _base(p.program), _user(p.uid), p.threads,
                 f"{p.rss_bytes / 2**20:.1f}", f"{p.allocs_per_s:,.0f}", f"{p.cost:.4g}", p.applied_version,
                 p.windows, _when(p.first_seen), p.kernel_source or "-") for p in procs]
        _table(("pid", "state", "program", "user", "threads", "rss MiB", "allocs/s", "cost", "policy", "windows",
                "first seen", "kernel"), rows)
    else:
        rows = [(p.pid, "live" if p.alive else "gone", _base(p.program), _user(p.uid), p.windows,
                 _when(p.first_seen), _when(p.last_seen)) for p in procs]
        _table(("pid", "state", "program", "user", "windows", "first seen", "last seen"), rows)
    return 0



def cmd_events(args):
    run_dir = os.path.abspath(args.run_dir or default_run_dir())
    if not is_running(run_dir):
        return _fail(f"hakmem-learnd is not running on {run_dir} (events come from a running learnd only)")
    sub = subscribe(run_dir, args.kind or ())
    n = 0
    try:
        while args.count == 0 or n < args.count:
            ev = recv_event(sub, timeout=1.0)
            if ev is None:
                if not os.path.exists(control_path(run_dir)):
                    return _fail("hakmem-learnd stopped")
                continue
            n += 1
            if args.json:
                print(json.dumps(to_dict(ev)), flush=True)
            else:
                print(f"{time.strftime('%H:%M:%S', time.localtime(ev.time))} {ev.kind} "
                      f"{_base(ev.program) if ev.program else '-'} {ev.pid or '-'} {ev.message}", flush=True)
    finally:
        sub.close()
    return 0

