"""`hakmem ring ...`: read a process's telemetry file, write its policy
snapshot, hold the directory's lease, watch every ring."""
import copy
import json
import os
import signal
import sys
import time

from .. import layout as L
from .. import ring as ring_mod
from ..lease import Lease, LeaseError, LeaseHeld
from ..ring import REJECT_REASONS, Ring, RingError, batches_note, fit_batches, list_files, parse_assignment, resolve, window
from .common import _fail

ERRORS = (RingError,)      # what main() reports as one line


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
          f"{pol['published_snapshot']} published; {rej}; drain {pol['in_force']['drain_ms']} ms, "
          f"retain {pol['in_force']['retain_mib']} MiB")
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


def _kernel(pid, run_dir):
    """The kernel-side figures learnd measured for pid in its last window
    (hakmem-bpf, or why /proc): they are not in the telemetry file. None
    when learnd is not running or does not track the process."""
    from ..config import default_run_dir
    from ..control import Client, ClientBackend, ControlError, is_running
    run_dir = os.path.abspath(run_dir or default_run_dir())
    try:
        if not is_running(run_dir):
            return None
        with Client(run_dir, timeout=2.0) as c:
            procs = ClientBackend(c).processes(False)
    except (ControlError, OSError):
        return None
    for p in procs:
        if p.pid == pid and p.kernel_source:
            return {"source": p.kernel_source, "why": p.kernel_why,
                    "per_s": dict(zip(L.KERNEL_COUNTERS, p.kernel)) if p.kernel else None}
    return None


def cmd_dump(args):
    with Ring(resolve(args.target, args.dir)) as ring:
        s = _summary(ring, args.window)
    s["kernel"] = _kernel(int(s["pid"]), getattr(args, "run_dir", None))
    if args.json:
        json.dump(s, sys.stdout)
        print()
    else:
        _print_dump(s, args.all)
        k = s["kernel"]
        if k is not None:
            figs = ", ".join(f"{n} {v:,.4g}/s" for n, v in k["per_s"].items()) if k["per_s"] else ""
            print(f"kernel (hakmem-learnd's last window): {k['source']}" + (f" ({k['why']})" if k["why"] else "")
                  + (f": {figs}" if figs else ""))
    return 0


def cmd_set_policy(args):
    with Ring(resolve(args.target, args.dir), writable=True) as ring:
        pol = ring.policy_in_force()
        before = copy.deepcopy(pol)
        header = ring.header()
        named: dict[str, set] = {}
        for a in args.assignments:
            name, classes = parse_assignment(pol, a, header)
            named.setdefault(name, set()).update(classes)
        fitted = fit_batches(pol, before, named, header)
        version = ring.write_policy(pol)
        applied, status = ring.wait_applied(version, args.wait) if args.wait > 0 else (None, ring.status())
    result = {"version": version, "applied": applied, **status,
              "reject_reason_text": REJECT_REASONS.get(status["reject_reason"], "?"),
              "batch_fitted": [{"class": c, "size": int(header["class_size"][c]), "was": a, "now": b}
                               for c, a, b in fitted]}
    if args.json:
        json.dump(result, sys.stdout)
        print()
    elif fitted:
        print(batches_note(fitted, pol, header["class_size"]))
    if args.json:
        pass
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
