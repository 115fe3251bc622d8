"""The `hakmem` command. `hakmem ring ...` reads and writes telemetry files;
`hakmem status|procs|policy|events` talk to hakmem-learnd over ZeroMQ
(control.py), or read its database directly when it is not running (writes
then go to the database too, and learnd applies a stored pin at its next
start).

Every failure prints one line, `hakmem: error: <why>`, and exits non-zero
(2 for usage, 1 for everything else); data goes to stdout, with --json as
one JSON document.
"""
import argparse
import contextlib
import json
import os
import signal
import sys
import time

from . import __version__
from . import layout as L
from . import ring as ring_mod
from .lease import Lease, LeaseError, LeaseHeld
from .ring import REJECT_REASONS, Ring, RingError, list_files, parse_assignment, resolve, window

CLIENT_TIMEOUT_S = 5.0     # learnd answered a status already; a busy turn may still take a while


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"hakmem: error: {message} (see --help)\n")


def _fail(msg, code=1):
    print(f"hakmem: error: {msg}", file=sys.stderr)
    return code


class _Usage(Exception):
    """A command line argparse cannot catch on its own (exit 2)."""


def _kib(n):
    return f"{n / 1024:.0f}"


def _summary(ring, span):
    """The figures `ring dump` shows, as plain data."""
    h = ring.header()
    recs = ring.records()
    pol = ring.policy_in_force()
    now_ns = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    out = {
        "file": ring.path, "pid": h["pid"], "alive": ring.alive, "exited": ring.exited(),
        "exe": h["exe"], "build_id": h["build_id"], "hakmem_version": h["hakmem_version"],
        "start_time": h["start_time"], "created_ns": h["created_ns"], "uid": h["uid"],
        "epoch_ms": h["epoch_ms"], "records": int(len(recs)), "ring_head": h["ring_head"],
        "policy": {"in_force": pol, "applied_snapshot": h["applied_version"],
                   "seen_snapshot": h["seen_version"], "published_snapshot": ring.published_version(),
                   "rejected": h["rejected"], "last_reject_reason": REJECT_REASONS.get(h["reject_reason"], "?")},
        "class_size": h["class_size"],
    }
    if not len(recs):
        out["totals"] = None
        out["window"] = None
        return out
    last = recs[-1]
    out["age_s"] = max(0.0, (now_ns - int(last["time_ns"])) / 1e9)
    out["totals"] = {"proc": {n: int(last["proc"][n]) for n in L.PROC_COUNTERS},
                     "cls": {n: [int(x) for x in last["cls"][n]] for n in L.CLASS_COUNTERS}}
    # The window: the oldest record within `span` seconds of the newest.
    first = recs[0]
    for r in recs:
        if int(last["time_ns"]) - int(r["time_ns"]) <= span * 1e9:
            first = r
            break
    if first["index"] != last["index"]:
        w = window(first, last)
        out["window"] = {"seconds": w["seconds"],
                         "proc": {k: float(v) for k, v in w["proc"].items()},
                         "cls": {k: [float(x) for x in v] for k, v in w["cls"].items()}}
    else:
        out["window"] = None
    return out


def _print_dump(s, show_all):
    print(f"pid {s['pid']}  {s['exe'] or '?'}  hakmem {s['hakmem_version']}"
          f"{'' if s['alive'] else '  (process has exited)'}")
    if s["build_id"]:
        print(f"build id {s['build_id']}")
    pol = s["policy"]
    rej = f"{pol['rejected']} rejected" + (f" (last: {pol['last_reject_reason']})" if pol["rejected"] else "")
    print(f"policy: v{pol['in_force']['version']} in force; snapshot {pol['applied_snapshot']} applied, "
          f"{pol['published_snapshot']} published; {rej}; drain {pol['in_force']['drain_ms']} ms")
    if s["totals"] is None:
        print(f"ring: no record yet (one is written every {s['epoch_ms']} ms from the allocator's slow path)")
        return
    t = s["totals"]["proc"]
    print(f"ring: {s['records']} of {s['ring_head']} records kept, one at most every {s['epoch_ms']} ms; "
          f"newest {s['age_s']:.2f} s old")
    print(f"process: {t['threads']} threads ({t['threads_total']} ever), committed {t['committed_bytes'] / 2**20:.1f} MiB, "
          f"mmap {t['mmap_calls']}, munmap {t['munmap_calls']}, madvise {t['madvise_calls']}, "
          f"huge {t['huge_allocs']} ({t['huge_cache_hits']} from cache)")
    if s["alive"] and s["age_s"] > max(2 * s["epoch_ms"] / 1000, 0.5):
        print(f"note: no allocator slow path for {s['age_s']:.1f} s: the thread caches serve every "
              f"call, so nothing newer is recorded (records come from slow paths only); the rates "
              f"below are from the last window with activity")
    w = s["window"]
    c = s["totals"]["cls"]
    sizes = s["class_size"]
    inforce = pol["in_force"]
    if w:
        print(f"last {w['seconds']:.2f} s, per second:")
        head = ("class", "size", "allocs/s", "hit%", "refills/s", "drains/s", "remote/s",
                "live KiB", "cached KiB", "slow us/s", "cap", "batch", "warm")
        rows = []
        for k in range(1, L.NUM_CLASSES):
            a = w["cls"]["allocs"][k]
            if not show_all and a == 0 and c["live_bytes"][k] == 0:
                continue
            hit = 100.0 * w["cls"]["hits"][k] / a if a else 0.0
            rows.append((k, sizes[k], f"{a:,.0f}", f"{hit:.1f}", f"{w['cls']['refills'][k]:,.0f}",
                         f"{w['cls']['drains'][k]:,.0f}", f"{w['cls']['remote_frees'][k]:,.0f}",
                         _kib(c["live_bytes"][k]), _kib(c["cached_bytes"][k]),
                         f"{w['cls']['slow_ns'][k] / 1000:,.0f}", inforce["tcache_cap"][k],
                         inforce["tcache_batch"][k], inforce["warm_slabs"][k]))
    else:
        print("totals (one record so far):")
        head = ("class", "size", "allocs", "hits", "refills", "drains", "remote", "live KiB",
                "cached KiB", "slow us", "cap", "batch", "warm")
        rows = []
        for k in range(1, L.NUM_CLASSES):
            if not show_all and c["allocs"][k] == 0:
                continue
            rows.append((k, sizes[k], c["allocs"][k], c["hits"][k], c["refills"][k], c["drains"][k],
                         c["remote_frees"][k], _kib(c["live_bytes"][k]), _kib(c["cached_bytes"][k]),
                         c["slow_ns"][k] // 1000, inforce["tcache_cap"][k], inforce["tcache_batch"][k],
                         inforce["warm_slabs"][k]))
    if not rows:
        print("  (no allocation in this window; --all shows every class)")
        return
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    for row in (head, *rows):
        print("  " + "  ".join(str(x).rjust(wd) for x, wd in zip(row, widths)))


def cmd_dump(args):
    with Ring(resolve(args.target, args.dir)) as ring:
        s = _summary(ring, args.window)
    if args.json:
        json.dump(s, sys.stdout)
        print()
    else:
        _print_dump(s, args.all)
    return 0


def cmd_set_policy(args):
    with Ring(resolve(args.target, args.dir), writable=True) as ring:
        pol = ring.policy_in_force()
        header = ring.header()
        for a in args.assignments:
            parse_assignment(pol, a, header)
        version = ring.write_policy(pol)
        applied, status = ring.wait_applied(version, args.wait) if args.wait > 0 else (None, ring.status())
    result = {"version": version, "applied": applied, **status,
              "reject_reason_text": REJECT_REASONS.get(status["reject_reason"], "?")}
    if args.json:
        json.dump(result, sys.stdout)
        print()
    elif applied is None:
        print(f"published snapshot {version}")
    elif applied:
        print(f"snapshot {version} applied")
    if applied is False:
        if status["seen_version"] >= version:
            return _fail(f"snapshot {version} rejected by the allocator: {result['reject_reason_text']}")
        return _fail(f"snapshot {version} not examined within {args.wait:g} s (the process has not "
                     f"allocated since, or is stopped)")
    return 0


def cmd_list(args):
    rows = []
    for path in list_files(args.dir):
        try:
            with Ring(path) as ring:
                h = ring.header()
                rows.append({"file": path, "pid": h["pid"], "alive": ring.alive, "exe": h["exe"],
                             "records": h["ring_head"], "applied_snapshot": h["applied_version"]})
        except RingError as e:
            rows.append({"file": path, "error": str(e)})
    if args.json:
        json.dump(rows, sys.stdout)
        print()
    else:
        for r in rows:
            if "error" in r:
                print(f"{r['file']}: {r['error']}")
            else:
                print(f"{r['pid']:>8}  {'live ' if r['alive'] else 'gone '} {r['records']:>7} records  {r['exe']}")
    return 0


def _lease(directory, what):
    """Holds the directory's lease when nobody does (processes make their
    files only while somebody reads them); None when learnd or another
    reader holds it already, which is as good."""
    d = ring_mod.shm_dir(directory)
    try:
        return Lease(d, what).acquire()
    except LeaseHeld:
        return None
    except LeaseError as e:
        raise RingError(str(e)) from None


def cmd_watch(args):
    """Samples every ring in a directory until stopped: what a learner's
    reader costs a program, without the learner (the bench runner uses it).
    It holds the lease while it runs, unless learnd does."""
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    lease = _lease(args.dir, "hakmem ring watch")
    rings, samples, n = {}, 0, 0
    while not stop and (args.count == 0 or n < args.count):
        n += 1
        try:
            paths = set(list_files(args.dir))
        except RingError:
            paths = set()
        for p in list(rings):
            if p not in paths:
                rings.pop(p).close()
        for p in paths - rings.keys():
            try:
                rings[p] = Ring(p)
            except RingError:
                pass
        for p, ring in list(rings.items()):
            try:
                rec = ring.latest()
            except RingError:        # cut short under us: its owner's doing
                rings.pop(p).close()
                continue
            if rec is None:
                continue
            samples += 1
            if args.json:
                print(json.dumps({"pid": ring.pid, "index": int(rec["index"]),
                                  "allocs": int(rec["cls"]["allocs"].sum())}), flush=True)
        time.sleep(args.interval)
    for ring in rings.values():
        ring.close()
    if lease:
        lease.release()
    print(f"hakmem ring watch: {samples} samples from {len(rings)} open rings", file=sys.stderr)
    return 0


def cmd_hold(args):
    """Holds the telemetry directory's lease until stopped, so that preloaded
    processes publish without learnd (for `ring dump` and `set-policy` by
    hand, scripts and tests)."""
    d = ring_mod.shm_dir(args.dir)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    try:
        os.mkdir(d, 0o700)      # a private one when there is none: this user's processes only
    except FileExistsError:
        pass
    except OSError as e:
        return _fail(f"cannot create {d}: {e.strerror}")
    try:
        lease = Lease(d, "hakmem ring hold").acquire()
    except LeaseError as e:
        return _fail(str(e))
    print(f"holding {d}: processes started with hakmem publish there until this stops", file=sys.stderr, flush=True)
    end = time.monotonic() + args.seconds if args.seconds else None
    try:
        while not stop and (end is None or time.monotonic() < end):
            time.sleep(0.05)
            if not lease.held():
                return _fail(f"lost the lease on {d} (learnd.lock was removed or replaced)")
    finally:
        lease.release()
    return 0


# ---- learnd: status, processes, policies, events ------------------------------
def _import_learnd():
    """The learnd commands' modules, imported by main() for them only: zmq,
    protobuf and the store would cost every `hakmem ring` start (the tests
    and the bench runner start many) about 0.1 s."""
    global ClientBackend, Client, ControlError, StoreBackend, control_path, is_running, knobs_from_pb
    global read_export, recv_event, subscribe, to_dict, default_db, default_run_dir, pb, Store, StoreError
    global users_names
    from .config import default_db, default_run_dir, users_names
    from .control import (ClientBackend, Client, ControlError, StoreBackend, control_path, is_running,
                          knobs_from_pb, read_export, recv_event, subscribe, to_dict)
    from ._pb import hakmem_pb2 as pb
    from .store import Store, StoreError
    return ControlError, StoreError


@contextlib.contextmanager
def _backend(args, write=False, create=False):
    """(backend, running): learnd's when it answers, else the database's
    (read-only unless write; create: a missing database is made)."""
    run_dir = os.path.abspath(args.run_dir or default_run_dir())
    if is_running(run_dir):
        with Client(run_dir, timeout=CLIENT_TIMEOUT_S) as c:
            yield ClientBackend(c), True
        return
    db = os.path.abspath(args.db or default_db())
    if not create and not os.path.exists(db):
        raise ControlError(f"no database at {db} (hakmem-learnd has not run yet, or use --db)")
    store = Store(db, readonly=not write)
    try:
        yield StoreBackend(store, run_dir), False
    finally:
        store.close()


def _out_json(data):
    json.dump(data, sys.stdout)
    print()


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


def _when(t):
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def _span(s):
    s = max(0, int(s))
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}d{h:02d}h"
    if h:
        return f"{h}h{m:02d}m"
    return f"{m}m{s:02d}s" if m else f"{s}s"


def _origin(p):
    return pb.Origin.Name(p.origin).lower() if p.origin in pb.Origin.values() else str(p.origin)


def _objective(p):
    if not p.has_objective:
        return "not measured"
    return f"{p.objective:.5g} ± {p.objective_sd:.2g} over {p.evaluations} windows"


def _table(head, rows, indent="  "):
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    for row in (head, *rows):
        print((indent + "  ".join(str(x).rjust(w) for x, w in zip(row, widths))).rstrip())


def _not_running_note(running, db):
    if not running:
        print(f"hakmem-learnd is not running; read from {db}")


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
                         _when(p.last_seen)))
        print()
        _table(("id", "program", "users", "live", "seen", "state", "pinned", "best", "best cost", "last seen"),
               rows)
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
                 p.windows, _when(p.first_seen)) for p in procs]
        _table(("pid", "state", "program", "user", "threads", "rss MiB", "allocs/s", "cost", "policy", "windows",
                "first seen"), rows)
    else:
        rows = [(p.pid, "live" if p.alive else "gone", _base(p.program), _user(p.uid), p.windows,
                 _when(p.first_seen), _when(p.last_seen)) for p in procs]
        _table(("pid", "state", "program", "user", "windows", "first seen", "last seen"), rows)
    return 0


def _version_arg(text):
    t = text[1:] if text[:1] in "vV" else text
    if not t.isdigit() or int(t) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a policy version (1, 2, ... or v1, v2, ...)")
    return int(t)


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


def cmd_policy_list(args):
    with _backend(args) as (b, running):
        pols = b.policies(args.program or "")
        db = None if running else b.store.path
    if args.json:
        _out_json([to_dict(p) for p in pols])
        return 0
    _not_running_note(running, db)
    if not pols:
        print("no policy stored" + (f" for {args.program}" if args.program else ""))
        return 0
    by_prog: dict = {}
    for p in pols:
        by_prog.setdefault(p.program, []).append(p)
    for i, (key, ps) in enumerate(by_prog.items()):
        if i:
            print()
        print(_label(key))
        rows = [(f"v{p.version}", _origin(p), _flags(p) or "-",
                 f"{p.objective:.5g}" if p.has_objective else "-",
                 f"{p.objective_sd:.2g}" if p.has_objective else "-", p.evaluations, _when(p.created),
                 p.note or "") for p in ps]
        _table(("version", "origin", "", "cost", "sd", "windows", "created", "note"), rows)
    return 0


def _knob_rows(k, base, sizes, show_all):
    """Rows class, size, cap, batch, warm: the classes whose knobs differ
    from base (every class with show_all or without a base); a value that
    differs is shown with base's in parentheses. Neighbouring classes with
    the same cells share one row (classes 1-4, sizes 16-64)."""
    rows, run = [], None
    for c in range(1, L.NUM_CLASSES):
        vals = [(k[n][c], base[n][c] if base else None) for n in L.KNOBS_PER_CLASS]
        differs = any(b is not None and a != b for a, b in vals)
        if not (show_all or differs or base is None):
            run = None
            continue
        cells = tuple(f"{a} ({b})" if b is not None and a != b else str(a) for a, b in vals)
        size = sizes[c] if c < len(sizes) else "?"
        if run is not None and run[2] == cells and run[1] == c - 1:
            run[1], run[4] = c, size
        else:
            run = [c, c, cells, size, size]
            rows.append(run)
    return [(f"{r[0]}" if r[0] == r[1] else f"{r[0]}-{r[1]}", f"{r[3]}" if r[0] == r[1] else f"{r[3]}-{r[4]}",
             *r[2]) for r in rows]


def cmd_policy_show(args):
    with _backend(args) as (b, running):
        p = b.policy(args.program, args.version or 0)
        prog = _program_of(b, p.program)
        default = _default_policy(b.policies(p.program))
    if args.json:
        _out_json(to_dict(p))
        return 0
    k = knobs_from_pb(p.knobs)
    base = knobs_from_pb(default.knobs) if default and default.version != p.version else None
    flags = _flags(p)
    print(f"{_label(p.program)}  v{p.version} {_origin(p)}{f' ({flags})' if flags else ''}")
    print(f"cost {_objective(p)}; created {_when(p.created)}")
    if p.note:
        print(f"note: {p.note}")
    drain = f"drain_ms {k['drain_ms']}"
    if base and base["drain_ms"] != k["drain_ms"]:
        drain += f" (default v{default.version}: {base['drain_ms']})"
    print(drain)
    rows = _knob_rows(k, base, list(prog.class_size), args.all)
    if default is None:
        print("(no default policy stored for this program: every class shown)")
    elif default.version == p.version and not args.all:
        print("this is the program's default policy; --all shows every class")
        return 0
    elif not rows:
        print(f"every class as in the default policy v{default.version}; --all shows them")
        return 0
    elif base:
        print(f"classes that differ from the default policy v{default.version} (its value in parentheses)"
              f"{'' if args.all else '; --all shows every class'}:")
    _table(("class", "size", "tcache_cap", "tcache_batch", "warm_slabs"), rows)
    return 0


def cmd_policy_diff(args):
    with _backend(args) as (b, running):
        a = b.policy(args.program, args.v1)
        c = b.policy(args.program, args.v2 or 0)
        prog = _program_of(b, a.program)
    ka, kc = knobs_from_pb(a.knobs), knobs_from_pb(c.knobs)
    sizes = list(prog.class_size)
    changes = []
    if ka["drain_ms"] != kc["drain_ms"]:
        changes.append({"knob": "drain_ms", "class": None, "size": None, "old": ka["drain_ms"], "new": kc["drain_ms"]})
    for cl in range(L.NUM_CLASSES):
        for n in L.KNOBS_PER_CLASS:
            if ka[n][cl] != kc[n][cl]:
                changes.append({"knob": n, "class": cl, "size": sizes[cl] if cl < len(sizes) else None,
                                "old": ka[n][cl], "new": kc[n][cl]})
    if args.json:
        _out_json({"program": a.program, "from": to_dict(a), "to": to_dict(c), "changes": changes})
        return 0
    fa, fc = _flags(a), _flags(c)
    print(f"{_label(a.program)}: v{a.version} ({_origin(a)}{', ' + fa if fa else ''}) -> "
          f"v{c.version} ({_origin(c)}{', ' + fc if fc else ''})")
    if not changes:
        print("no difference")
        return 0
    line, cur = [], None
    for ch in changes:
        if ch["class"] is None:
            print(f"drain_ms {ch['old']} -> {ch['new']}")
            continue
        if ch["class"] != cur:
            if line:
                print(", ".join(line))
            cur = ch["class"]
            line = [f"class {cur} ({ch['size']} B): {ch['knob']} {ch['old']} -> {ch['new']}"]
        else:
            line.append(f"{ch['knob']} {ch['old']} -> {ch['new']}")
    if line:
        print(", ".join(line))
    ncls = len({ch["class"] for ch in changes if ch["class"] is not None})
    print(f"{len(changes)} changes in {ncls} classes")
    return 0


def _applied_when(running):
    return "hakmem-learnd applies it now" if running else "hakmem-learnd applies it when it next starts"


def cmd_policy_pin(args):
    if args.version and args.assignments:
        raise _Usage("give a VERSION or --set, not both")
    if not args.version and not args.assignments:
        raise _Usage("give a VERSION to pin, or --set key=value ... for new knobs")
    with _backend(args, write=True) as (b, running):
        if args.version:
            p = b.pin(args.program, args.version, None, args.note or "")
        else:
            pols = b.policies(args.program)
            start = (next((x for x in pols if x.pinned), None) or next((x for x in pols if x.best), None)
                     or _default_policy(pols))
            if start is None:
                raise ControlError(f"{args.program} has no stored policy to start from (learnd stores the "
                                   f"default when it first sees the program); pin a version")
            prog = _program_of(b, start.program)
            knobs = knobs_from_pb(start.knobs)
            for a in args.assignments:
                parse_assignment(knobs, a, {"class_size": list(prog.class_size)})
            note = args.note or f"v{start.version} with {' '.join(args.assignments)}"
            p = b.pin(args.program, 0, knobs, note)
    if args.json:
        _out_json(to_dict(p))
    else:
        print(f"pinned v{p.version} ({_origin(p)}) of {_label(p.program)}; {_applied_when(running)}")
    return 0


def cmd_policy_unpin(args):
    with _backend(args, write=True) as (b, running):
        msg = b.unpin(args.program)
    if not running and msg.startswith("unpinned"):
        msg += "; hakmem-learnd learns again when it next starts"
    if args.json:
        _out_json({"message": msg})
    else:
        print(msg)
    return 0


def cmd_policy_export(args):
    if args.output == "-" and sys.stdout.isatty():
        raise _Usage("the policy file is binary: not written to a terminal (use -o FILE)")
    with _backend(args) as (b, running):
        f = b.export(args.program, args.version or 0)
    data = f.SerializeToString()
    if args.output == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
        return 0
    tmp = f"{args.output}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as out:
            out.write(data)
        os.replace(tmp, args.output)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise ControlError(f"cannot write {args.output}: {e.strerror}") from None
    print(f"exported v{f.policy.version} ({_origin(f.policy)}) of {_label(f'{f.exe}@{f.build_id}#{f.users}')} "
          f"to {args.output}")
    return 0


def cmd_policy_import(args):
    try:
        if args.file == "-":
            data = sys.stdin.buffer.read()
        else:
            with open(args.file, "rb") as f:
                data = f.read()
    except OSError as e:
        raise ControlError(f"cannot read {args.file}: {e.strerror}") from None
    f = read_export(data, args.file)
    with _backend(args, write=True, create=True) as (b, running):
        p = b.import_(f, args.pin, args.users or "")
    if args.json:
        _out_json(to_dict(p))
        return 0
    print(f"imported as v{p.version} ({_origin(p)}) of {_label(p.program)}"
          + (f"; pinned: {_applied_when(running)}" if args.pin else ""))
    if not args.users and f.users_names and f.users_names != users_names(f.users):
        # The same uids, other people: uids differ between machines.
        print(f"note: the file was exported for {f.users_names} (uids {f.users}) on {f.exported_from}; "
              f"here uids {f.users} are {users_names(f.users)}; --users names the users here")
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


def _learnd_parent():
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--run-dir", metavar="DIR",
                   help="hakmem-learnd's run directory (default $HAKMEM_RUN_DIR, else "
                        "$XDG_RUNTIME_DIR/hakmem, /tmp/hakmem-UID or /run/hakmem for root)")
    p.add_argument("--db", metavar="PATH",
                   help="the database, read when hakmem-learnd is not running (default $HAKMEM_DB, else "
                        "$XDG_STATE_HOME/hakmem/learn.db or /var/lib/hakmem/learn.db for root)")
    return p


def _json_arg(p, what="print it as JSON"):
    p.add_argument("--json", action="store_true", help=what)


def _add_learnd_commands(sub):
    common = _learnd_parent()
    prog_help = ("a program: its id, key (exe@build_id#users), executable path or base name, the last "
                 "two with #USERS to pick one user's (python3.11#1000, python3.11#root)")

    st = sub.add_parser("status", parents=[common], help="hakmem-learnd's state and the programs it knows",
                        description="Asks hakmem-learnd; when it is not running, reads its database.")
    _json_arg(st)
    st.set_defaults(func=cmd_status)

    pr = sub.add_parser("procs", parents=[common], help="the processes hakmem-learnd tracks",
                        description="Live figures from hakmem-learnd; when it is not running, the processes "
                                    "its database records (alive: the same pid and start time still run).")
    pr.add_argument("--all", action="store_true", help="exited processes too")
    _json_arg(pr)
    pr.set_defaults(func=cmd_procs)

    pol = sub.add_parser("policy", help="list, show, compare, pin, export and import programs' policies")
    ps = pol.add_subparsers(dest="policy_command", metavar="SUBCOMMAND", parser_class=_Parser)
    ps.required = True

    li = ps.add_parser("list", parents=[common], help="the stored policies (of one program, or all)")
    li.add_argument("program", nargs="?", metavar="PROGRAM", help=prog_help)
    _json_arg(li)
    li.set_defaults(func=cmd_policy_list)

    sh = ps.add_parser("show", parents=[common], help="one policy's knobs",
                       description="Shows the classes whose knobs differ from the program's default policy.")
    sh.add_argument("program", metavar="PROGRAM", help=prog_help)
    sh.add_argument("version", nargs="?", type=_version_arg, metavar="VERSION",
                    help="default: the pinned policy, else the best")
    sh.add_argument("--all", action="store_true", help="every class")
    _json_arg(sh)
    sh.set_defaults(func=cmd_policy_show)

    di = ps.add_parser("diff", parents=[common], help="what changes between two policies of a program")
    di.add_argument("program", metavar="PROGRAM", help=prog_help)
    di.add_argument("v1", type=_version_arg, metavar="V1")
    di.add_argument("v2", nargs="?", type=_version_arg, metavar="V2", help="default: the pinned policy, else the best")
    _json_arg(di)
    di.set_defaults(func=cmd_policy_diff)

    pi = ps.add_parser("pin", parents=[common], help="make hakmem-learnd apply one policy and stop exploring",
                       description="Pins a stored VERSION, or new knobs: --set starts from the program's pinned "
                                   "(else best, else default) policy. Keys as in `hakmem ring set-policy`: "
                                   "drain_ms=MS; tcache_cap, tcache_batch, warm_slabs as KNOB=N (every class), "
                                   "KNOB[CLASS]=N, or KNOB@SIZE=N.")
    pi.add_argument("program", metavar="PROGRAM", help=prog_help)
    pi.add_argument("version", nargs="?", type=_version_arg, metavar="VERSION")
    pi.add_argument("--set", nargs="+", action="extend", dest="assignments", metavar="KEY=VALUE")
    pi.add_argument("--note", help="a note stored with new knobs")
    _json_arg(pi)
    pi.set_defaults(func=cmd_policy_pin)

    un = ps.add_parser("unpin", parents=[common], help="let hakmem-learnd learn the program's policy again")
    un.add_argument("program", metavar="PROGRAM", help=prog_help)
    _json_arg(un)
    un.set_defaults(func=cmd_policy_unpin)

    ex = ps.add_parser("export", parents=[common], help="write a policy to a file (protobuf PolicyExport)")
    ex.add_argument("program", metavar="PROGRAM", help=prog_help)
    ex.add_argument("version", nargs="?", type=_version_arg, metavar="VERSION",
                    help="default: the pinned policy, else the best")
    ex.add_argument("-o", "--output", required=True, metavar="FILE", help="the file to write (-: stdout)")
    ex.set_defaults(func=cmd_policy_export)

    im = ps.add_parser("import", parents=[common], help="store a policy from a file made by `policy export`",
                       description="The program is matched by executable, build id and users (and made if "
                                   "new): the users the file was exported for (the same uids), or --users; a "
                                   "file whose class table differs from the program's is refused. Without "
                                   "hakmem-learnd running, the database is written (and made if missing).")
    im.add_argument("file", metavar="FILE", help="the policy file (-: stdin)")
    im.add_argument("--users", metavar="UIDS|NAMES",
                    help="the users here whose program gets it, separated by commas (root,postgres or 0,101): "
                         "uids differ between machines; default: the file's uids")
    im.add_argument("--pin", action="store_true", help="pin it too")
    _json_arg(im)
    im.set_defaults(func=cmd_policy_import)

    ev = sub.add_parser("events", parents=[common], help="follow hakmem-learnd's events",
                        description="One line per event: time, kind, program, pid, message. Needs a "
                                    "running hakmem-learnd.")
    ev.add_argument("--count", type=int, default=0, metavar="N", help="stop after N events (default: never)")
    ev.add_argument("--kind", action="append", metavar="K",
                    help="only events whose kind starts with K (repeatable), e.g. policy_ or process_started")
    _json_arg(ev, "one JSON object per event")
    ev.set_defaults(func=cmd_events)


def build_parser():
    p = _Parser(prog="hakmem", description="hakmem: inspect and steer programs that use libhakmem.")
    p.add_argument("--version", action="version", version=f"hakmem {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    ring = sub.add_parser("ring", help="read a process's telemetry file, write its policy snapshot",
                          description="Telemetry files live in HAKMEM_SHM_DIR (default /dev/shm/hakmem).")
    rs = ring.add_subparsers(dest="ring_command", metavar="SUBCOMMAND", parser_class=_Parser)
    rs.required = True

    d = rs.add_parser("dump", help="what a process's allocator is doing now")
    d.add_argument("target", metavar="FILE|PID")
    d.add_argument("--dir", help="telemetry directory (default $HAKMEM_SHM_DIR or /dev/shm/hakmem)")
    d.add_argument("--window", type=float, default=1.0, help="seconds of history for rates (default 1)")
    d.add_argument("--all", action="store_true", help="every class, not only those in use")
    d.add_argument("--json", action="store_true", help="print the figures as JSON")
    d.set_defaults(func=cmd_dump)

    s = rs.add_parser("set-policy", help="publish a policy snapshot (starting from the one in force)",
                      description="Keys: drain_ms=MS; tcache_cap, tcache_batch, warm_slabs as KNOB=N "
                                  "(every class), KNOB[CLASS]=N, or KNOB@SIZE=N (the class serving SIZE bytes).")
    s.add_argument("target", metavar="FILE|PID")
    s.add_argument("assignments", nargs="+", metavar="key=value")
    s.add_argument("--dir", help="telemetry directory")
    s.add_argument("--wait", type=float, default=1.0,
                   help="seconds to wait for the allocator to apply it (0: do not wait; default 1)")
    s.add_argument("--json", action="store_true", help="print the outcome as JSON")
    s.set_defaults(func=cmd_set_policy)

    li = rs.add_parser("list", help="the telemetry files in the directory")
    li.add_argument("--dir", help="telemetry directory")
    li.add_argument("--json", action="store_true")
    li.set_defaults(func=cmd_list)

    w = rs.add_parser("watch", help="sample every ring in a directory until stopped")
    w.add_argument("dir", nargs="?", help="telemetry directory")
    w.add_argument("--interval", type=float, default=0.1, help="seconds between samples (default 0.1)")
    w.add_argument("--count", type=int, default=0, help="stop after N rounds (default: at SIGTERM)")
    w.add_argument("--json", action="store_true", help="one JSON line per sample")
    w.set_defaults(func=cmd_watch)

    h = rs.add_parser("hold", help="let processes publish without learnd: hold the directory's lease until stopped",
                      description="Preloaded processes make their telemetry file only while a reader holds "
                                  "the directory's lease (learnd.lock): hakmem-learnd, `ring watch`, or this. "
                                  "Run it in the background to use `ring dump` and `ring set-policy` by hand.")
    h.add_argument("dir", nargs="?", help="telemetry directory (default $HAKMEM_SHM_DIR or /dev/shm/hakmem)")
    h.add_argument("--seconds", type=float, default=0, help="stop after this long (default: at SIGTERM/SIGINT)")
    h.set_defaults(func=cmd_hold)

    _add_learnd_commands(sub)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    errors: tuple = (RingError,)
    if args.command != "ring":
        errors += _import_learnd()
    try:
        return args.func(args)
    except _Usage as e:
        return _fail(f"{e} (see --help)", 2)
    except errors as e:
        return _fail(str(e))
    except BrokenPipeError:
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
