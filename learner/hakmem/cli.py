"""The `hakmem` command. `hakmem ring ...` reads and writes telemetry files.

Every failure prints one line, `hakmem: error: <why>`, and exits non-zero
(2 for usage, 1 for everything else); data goes to stdout, with --json as
one JSON document.
"""
import argparse
import json
import signal
import sys
import time


from . import __version__
from . import layout as L
from .ring import REJECT_REASONS, Ring, RingError, list_files, parse_assignment, resolve, window


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"hakmem: error: {message} (see --help)\n")


def _fail(msg, code=1):
    print(f"hakmem: error: {msg}", file=sys.stderr)
    return code


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
        return _fail(f"snapshot {version} not examined within {args.wait:g} s (the process makes no "
                     f"allocator slow-path calls, or is stopped)")
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


def cmd_watch(args):
    """Samples every ring in a directory until stopped: what a learner's
    reader costs a program, without the learner (the bench runner uses it)."""
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
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
        for p, ring in rings.items():
            rec = ring.latest()
            if rec is None:
                continue
            samples += 1
            if args.json:
                print(json.dumps({"pid": ring.pid, "index": int(rec["index"]),
                                  "allocs": int(rec["cls"]["allocs"].sum())}), flush=True)
        time.sleep(args.interval)
    for ring in rings.values():
        ring.close()
    print(f"hakmem ring watch: {samples} samples from {len(rings)} open rings", file=sys.stderr)
    return 0


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
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except RingError as e:
        return _fail(str(e))
    except BrokenPipeError:
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
