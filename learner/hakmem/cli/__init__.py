"""The `hakmem` command. `hakmem ring ...` reads and writes telemetry files
(ring.py); `hakmem status|procs|events` (learnd.py) and `hakmem policy ...`
(policy.py) talk to hakmem-learnd over ZeroMQ (control.py), or read its
database directly when it is not running (writes then go to the database
too, and learnd applies a stored pin at its next start).

Every failure prints one line, `hakmem: error: <why>`, and exits non-zero
(2 for usage, 1 for everything else); data goes to stdout, with --json as
one JSON document.

This module holds the command line (every command, its flags and help) and
main(); each command is a function `cmd_*(args)` in the module named by its
parser's `func` default, with that module's ERRORS: the exceptions main()
reports as one line.
"""
import argparse
import importlib
import sys

from .. import __version__
from .common import Printable, _Usage, _fail


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"hakmem: error: {message} (see --help)\n")


def _version_arg(text):
    t = text[1:] if text[:1] in "vV" else text
    if not t.isdigit() or int(t) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a policy version (1, 2, ... or v1, v2, ...)")
    return int(t)



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
    st.set_defaults(func=("learnd", "cmd_status"))

    pr = sub.add_parser("procs", parents=[common], help="the processes hakmem-learnd tracks",
                        description="Live figures from hakmem-learnd; when it is not running, the processes "
                                    "its database records (alive: the same pid and start time still run).")
    pr.add_argument("--all", action="store_true", help="exited processes too")
    _json_arg(pr)
    pr.set_defaults(func=("learnd", "cmd_procs"))

    pol = sub.add_parser("policy", help="list, show, compare, pin, export and import programs' policies")
    ps = pol.add_subparsers(dest="policy_command", metavar="SUBCOMMAND", parser_class=_Parser)
    ps.required = True

    li = ps.add_parser("list", parents=[common], help="the stored policies (of one program, or all)")
    li.add_argument("program", nargs="?", metavar="PROGRAM", help=prog_help)
    _json_arg(li)
    li.set_defaults(func=("policy", "cmd_policy_list"))

    sh = ps.add_parser("show", parents=[common], help="one policy's knobs",
                       description="Shows the classes whose knobs differ from the program's default policy.")
    sh.add_argument("program", metavar="PROGRAM", help=prog_help)
    sh.add_argument("version", nargs="?", type=_version_arg, metavar="VERSION",
                    help="default: the pinned policy, else the best")
    sh.add_argument("--all", action="store_true", help="every class")
    _json_arg(sh)
    sh.set_defaults(func=("policy", "cmd_policy_show"))

    di = ps.add_parser("diff", parents=[common], help="what changes between two policies of a program")
    di.add_argument("program", metavar="PROGRAM", help=prog_help)
    di.add_argument("v1", type=_version_arg, metavar="V1")
    di.add_argument("v2", nargs="?", type=_version_arg, metavar="V2", help="default: the pinned policy, else the best")
    _json_arg(di)
    di.set_defaults(func=("policy", "cmd_policy_diff"))

    xp = ps.add_parser("explain", parents=[common], help="the evidence for the policy in force",
                       description="Why learnd chose the program's policy in force, from its database: the "
                                   "trial that made it the incumbent (its cost against the policy before it), "
                                   "every other trial's verdict, the windows measured per policy, and where the "
                                   "screening's replay ranked it. Reads the database even while learnd runs.")
    xp.add_argument("program", metavar="PROGRAM", help=prog_help)
    _json_arg(xp)
    xp.set_defaults(func=("policy", "cmd_policy_explain"))

    pi = ps.add_parser("pin", parents=[common], help="make hakmem-learnd apply one policy and stop exploring",
                       description="Pins a stored VERSION, or new knobs: --set starts from the program's pinned "
                                   "(else best, else default) policy. Keys as in `hakmem ring set-policy`: "
                                   "drain_ms=MS, retain_mib=MIB; tcache_cap, tcache_batch, warm_slabs as KNOB=N (every class), "
                                   "KNOB[CLASS]=N, or KNOB@SIZE=N.")
    pi.add_argument("program", metavar="PROGRAM", help=prog_help)
    pi.add_argument("version", nargs="?", type=_version_arg, metavar="VERSION")
    pi.add_argument("--set", nargs="+", action="extend", dest="assignments", metavar="KEY=VALUE")
    pi.add_argument("--note", help="a note stored with new knobs")
    _json_arg(pi)
    pi.set_defaults(func=("policy", "cmd_policy_pin"))

    un = ps.add_parser("unpin", parents=[common], help="let hakmem-learnd learn the program's policy again")
    un.add_argument("program", metavar="PROGRAM", help=prog_help)
    _json_arg(un)
    un.set_defaults(func=("policy", "cmd_policy_unpin"))

    ex = ps.add_parser("export", parents=[common], help="write a policy to a file (protobuf PolicyExport)")
    ex.add_argument("program", metavar="PROGRAM", help=prog_help)
    ex.add_argument("version", nargs="?", type=_version_arg, metavar="VERSION",
                    help="default: the pinned policy, else the best")
    ex.add_argument("-o", "--output", required=True, metavar="FILE", help="the file to write (-: stdout)")
    ex.set_defaults(func=("policy", "cmd_policy_export"))

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
    im.set_defaults(func=("policy", "cmd_policy_import"))

    ev = sub.add_parser("events", parents=[common], help="follow hakmem-learnd's events",
                        description="One line per event: time, kind, program, pid, message. Needs a "
                                    "running hakmem-learnd.")
    ev.add_argument("--count", type=int, default=0, metavar="N", help="stop after N events (default: never)")
    ev.add_argument("--kind", action="append", metavar="K",
                    help="only events whose kind starts with K (repeatable), e.g. policy_ or process_started")
    _json_arg(ev, "one JSON object per event")
    ev.set_defaults(func=("learnd", "cmd_events"))


# ---- trace (issue 14: offline replay) -----------------------------------------
def _add_trace_commands(sub):
    tr = sub.add_parser(
        "trace", help="record a program's allocations to a trace file, and read one",
        description="A trace is every malloc, calloc, realloc, free and aligned allocation a program "
                    "made (or a sample of its objects), with sizes, addresses, threads and times: "
                    "written by libhakmem itself (HAKMEM_TRACE=PATH from the start, HAKMEM_TRACE_SAMPLE "
                    "for a sampled capture, or `hakmem trace record PID` for a live process), read by "
                    "`hakmem trace info`, and replayed under any policy by `hakmem replay`. The format "
                    "is proto/trace.proto.")
    ts = tr.add_subparsers(dest="trace_command", metavar="SUBCOMMAND", parser_class=_Parser)
    ts.required = True

    inf = ts.add_parser(
        "info", help="what a trace holds: operations, threads, bytes, size classes, lifetimes, live bytes",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Reads a trace file and shows:\n"
                    "  - how it was captured (program, pid, mode: full, sampled with its mean bytes\n"
                    "    between picks, or live with its bounds) and how it ended (the footer's end\n"
                    "    reason and dropped events, or where the file was cut short);\n"
                    "  - operations per kind, threads, duration, bytes allocated;\n"
                    "  - a size-class histogram by the size asked for, with the class table the\n"
                    "    writer used (a size's class is the first class at least that big; class 0,\n"
                    "    huge, is above the largest), and per class the lifetimes of the objects\n"
                    "    freed in the trace (median and 90th percentile, in milliseconds and in\n"
                    "    operations of the whole program between allocation and free);\n"
                    "  - live bytes over time (a sparkline; --png draws it).\n"
                    "Addresses are renamed into objects by time: a free ends the latest allocation\n"
                    "of its address; frees of blocks allocated before the capture began (or not\n"
                    "sampled) are counted and left out.\n\n"
                    "A truncated or corrupt file is an error naming the byte offset of the bad\n"
                    "chunk; so is a file written by another layout version, and one without its\n"
                    "footer (the writer died). --partial reads the valid chunks before the problem.\n"
                    "Exit status: 0, or 1 on any error (one line on stderr).")
    inf.add_argument("file", metavar="FILE", help="the trace file (a regular file; symbolic links are refused)")
    inf.add_argument("--json", action="store_true",
                     help="print everything as one JSON document (live bytes as [time_ns, bytes] points)")
    inf.add_argument("--png", metavar="OUT.png",
                     help="also draw live bytes over time and the size-class histogram into this PNG file")
    inf.add_argument("--partial", action="store_true",
                     help="read a cut-short or damaged trace up to its first bad chunk instead of failing; "
                          "says where it stopped and why")
    inf.set_defaults(func=("trace", "cmd_trace_info"))

    rec = ts.add_parser(
        "record", help="capture a live process's allocations for a bounded time or size, without restarting it",
        description="Asks the allocator of process PID (which runs with libhakmem preloaded) to write "
                    "a trace of every allocation from now on, until --seconds have passed or the trace "
                    "reaches --max-bytes, whichever comes first. The request travels through the "
                    "process's telemetry file (only its owner or root may write it; when no "
                    "hakmem-learnd holds the directory's lease, this command holds it meanwhile), and "
                    "the allocator sees it at its next telemetry tick. The process writes the trace "
                    "itself, in the telemetry directory under a name of its own; when its footer is "
                    "written the trace is copied to --output and the original removed. Reports the "
                    "file, its events and how the capture ended.")
    rec.add_argument("pid", type=int, metavar="PID", help="the process to record")
    rec.add_argument("--seconds", type=float, default=10.0, metavar="S",
                     help="stop the capture after this many seconds (whole seconds, rounded up; default 10)")
    rec.add_argument("--max-bytes", type=int, default=64 << 20, metavar="N",
                     help="stop the capture once the trace file has this many bytes (4096 to 1 GiB; "
                          "default 64 MiB)")
    rec.add_argument("-o", "--output", required=True, metavar="FILE",
                     help="where to copy the finished trace (an existing file is never overwritten)")
    rec.add_argument("--shm-dir", metavar="DIR",
                     help="telemetry directory (default $HAKMEM_SHM_DIR or /dev/shm/hakmem)")
    rec.add_argument("--json", action="store_true", help="print the outcome as JSON")
    rec.set_defaults(func=("trace_record", "cmd_trace_record"))
# ---- end trace ----------------------------------------------------------------


# ---- replay (issue 14: offline replay; cli/replay.py) -------------------------
def _add_replay_commands(sub):
    rp = sub.add_parser(
        "replay", help="replay a trace under a policy or a sweep of policies; a program's history through a learner",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="hakmem replay TRACE [--policy FILE|PROGRAM@VERSION|default]\n"
                    "    replays a trace (`hakmem trace info` describes one) through build/hakmem-replay,\n"
                    "    the real allocator under that policy: time, peak RSS, OS calls, faults, and the\n"
                    "    cost the live objective gives them (per second of the traced program).\n"
                    "hakmem replay TRACE --sweep [grid|learner]\n"
                    "    grid: the default; each hot class's tcache_cap (the <= 2 classes with >= 5% of\n"
                    "    the allocations) at 1/4, 1, 2, 4 and 16 times its default, every combination; and\n"
                    "    drain_ms at 10, 100, 10000; retain_mib at 0 and 64. learner: the GP learner's\n"
                    "    own search, each replay's runs its windows (--budget policies). Replays run\n"
                    "    --jobs at a time; each result\n"
                    "    is stored in the database (table replay_runs) as it completes, keyed by the\n"
                    "    trace's content and the policy, so a rerun after Ctrl-C skips what is stored.\n"
                    "    --png draws time cost against peak RSS with the Pareto front; --promote makes\n"
                    "    a result the best policy of the trace's program (origin replay), which\n"
                    "    hakmem-learnd applies when the program next starts.\n"
                    "hakmem replay --learner NAME PROGRAM\n"
                    "    feeds the program's stored windows through learner NAME (gp, missdriven,\n"
                    "    static) and shows what it would have decided, beside what was live.\n\n"
                    "Exit status: 0; 1 on any error (one line); 2 on bad usage; 130 interrupted.")
    rp.add_argument("target", nargs="?", metavar="TRACE|PROGRAM",
                    help="the trace file; with --learner, the program (as `hakmem policy show` names one)")
    rp.add_argument("--policy", metavar="FILE|PROGRAM@VERSION|default",
                    help="a JSON knobs file ({\"drain_ms\": N, \"tcache_cap\": N or [per class], ...}), a "
                         "`hakmem policy export` file, a stored policy (python3@3), or default (the default)")
    rp.add_argument("--repeat", type=int, default=3, metavar="N", help="runs per policy, for the spread (default 3)")
    rp.add_argument("--partial", action="store_true", help="replay the valid chunks of a cut-short trace")
    rp.add_argument("--sweep", nargs="?", const="grid", choices=("grid", "learner"),
                    help="replay many policies: the grid (default) or the learner's search")
    rp.add_argument("--sweep-learner", default="gp", metavar="NAME", help="the learner of --sweep learner (gp)")
    rp.add_argument("--jobs", type=int, metavar="N", help="replays at a time (default: the cores)")
    rp.add_argument("--budget", type=int, metavar="K", help="at most K policies (grid: its first K; learner: 12)")
    rp.add_argument("--png", metavar="OUT.png", help="draw the sweep's time/memory Pareto chart")
    rp.add_argument("--promote", nargs="?", const="best", metavar="N|best",
                    help="make a result the trace's program's best policy (origin replay): the sweep's best "
                         "(default) or its row N; without --sweep, the policy replayed")
    rp.add_argument("--users", metavar="UIDS|NAMES",
                    help="--promote: whose program (default: the owner of the trace file)")
    rp.add_argument("--objective", metavar="lambda=N|budget=SIZE", help="the cost's memory term (default lambda=0.125)")
    rp.add_argument("--learner", metavar="NAME", help="replay PROGRAM's stored windows through this learner")
    rp.add_argument("--seed", type=int, default=0, help="the learner's seed (default 0)")
    rp.add_argument("--db", metavar="PATH", help="the database (default $HAKMEM_DB, else learnd's)")
    rp.add_argument("--replayer", metavar="PATH", help="the hakmem-replay binary (default $HAKMEM_REPLAY, build/)")
    rp.add_argument("--json", action="store_true", help="print the outcome as one JSON document")
    rp.set_defaults(func=("replay", "cmd_replay"))
# ---- end replay ---------------------------------------------------------------


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
    d.add_argument("--run-dir", metavar="DIR", help="hakmem-learnd's run directory, asked for the process's "
                   "kernel-side figures (hakmem-bpf) when it runs (default as for `hakmem status`)")
    d.set_defaults(func=("ring", "cmd_dump"))

    s = rs.add_parser("set-policy", help="publish a policy snapshot (starting from the one in force)",
                      description="Keys: drain_ms=MS, retain_mib=MIB; tcache_cap, tcache_batch, warm_slabs as KNOB=N "
                                  "(every class), KNOB[CLASS]=N, or KNOB@SIZE=N (the class serving SIZE bytes).")
    s.add_argument("target", metavar="FILE|PID")
    s.add_argument("assignments", nargs="+", metavar="key=value")
    s.add_argument("--dir", help="telemetry directory")
    s.add_argument("--wait", type=float, default=1.0,
                   help="seconds to wait for the allocator to apply it (0: do not wait; default 1)")
    s.add_argument("--json", action="store_true", help="print the outcome as JSON")
    s.set_defaults(func=("ring", "cmd_set_policy"))

    li = rs.add_parser("list", help="the telemetry files in the directory")
    li.add_argument("--dir", help="telemetry directory")
    li.add_argument("--json", action="store_true")
    li.set_defaults(func=("ring", "cmd_list"))

    w = rs.add_parser("watch", help="sample every ring in a directory until stopped")
    w.add_argument("dir", nargs="?", help="telemetry directory")
    w.add_argument("--interval", type=float, default=0.1, help="seconds between samples (default 0.1)")
    w.add_argument("--count", type=int, default=0, help="stop after N rounds (default: at SIGTERM)")
    w.add_argument("--json", action="store_true", help="one JSON line per sample")
    w.set_defaults(func=("ring", "cmd_watch"))

    h = rs.add_parser("hold", help="let processes publish without learnd: hold the directory's lease until stopped",
                      description="Preloaded processes make their telemetry file only while a reader holds "
                                  "the directory's lease (learnd.lock): hakmem-learnd, `ring watch`, or this. "
                                  "Run it in the background to use `ring dump` and `ring set-policy` by hand.")
    h.add_argument("dir", nargs="?", help="telemetry directory (default $HAKMEM_SHM_DIR or /dev/shm/hakmem)")
    h.add_argument("--seconds", type=float, default=0, help="stop after this long (default: at SIGTERM/SIGINT)")
    h.set_defaults(func=("ring", "cmd_hold"))

    _add_learnd_commands(sub)
    _add_trace_commands(sub)
    _add_replay_commands(sub)
    _add_fleet_commands(sub)
    return p


def _add_fleet_commands(sub):
    url = argparse.ArgumentParser(add_help=False)
    url.add_argument("--url", metavar="URL", help="the fleet database, postgresql://ROLE@HOST/DB (default "
                                                  "$HAKMEM_FLEET_URL, else `fleet` in --config)")
    url.add_argument("--config", metavar="FILE", help="learnd's TOML file: its fleet, fleet_k and fleet_canary")
    fl = sub.add_parser("fleet", help="the fleet of hosts sharing what they learn through PostgreSQL",
                        description="Hosts run hakmem-learnd --fleet URL, each as a database role of its own. "
                                    "migrate and add-host/exclude/include need the database's owner; the rest "
                                    "reads, as any host or the owner.")
    fs = fl.add_subparsers(dest="fleet_command", metavar="SUBCOMMAND", parser_class=_Parser)
    fs.required = True

    mi = fs.add_parser("migrate", parents=[url], help="create or update the fleet schema (the owner)",
                       description="Applies the fleet's migrations (schemas/fleet/) that the database lacks, "
                                   "each in one transaction, then the settings given (or fleet_k and "
                                   "fleet_canary from --config).")
    mi.add_argument("--k", type=int, metavar="N", help="hosts that must measure a policy better than their "
                                                       "default before it is offered (default 3)")
    mi.add_argument("--canary", type=float, metavar="FRACTION",
                    help="the share of a class's hosts a new fleet policy reaches first (default 0.10)")
    mi.add_argument("--confirm", type=int, metavar="N", help="canaries that must keep it before the rest get it "
                                                             "(default 1)")
    _json_arg(mi)
    mi.set_defaults(func=("fleet", "cmd_migrate"))

    ah = fs.add_parser("add-host", parents=[url], help="a host's database role and its row (the owner)",
                       description="Makes the role hakmem_host_<HOST> (a member of hakmem_host) that the "
                                   "host's learnd connects as; with --password-file, sets its password.")
    ah.add_argument("host", metavar="HOST")
    ah.add_argument("--password-file", metavar="FILE", help="the role's password, the file's first line")
    _json_arg(ah)
    ah.set_defaults(func=("fleet", "cmd_add_host"))

    for name, what in (("exclude", "count nothing a host pushed (the owner)"),
                       ("include", "count a host's rows again (the owner)")):
        x = fs.add_parser(name, parents=[url], help=what)
        x.add_argument("host", metavar="HOST")
        if name == "exclude":
            x.add_argument("--why", help="a note kept with the exclusion")
        _json_arg(x)
        x.set_defaults(func=("fleet", f"cmd_{name}"))

    st = fs.add_parser("status", parents=[url], help="the fleet's size, schema and settings")
    _json_arg(st)
    st.set_defaults(func=("fleet", "cmd_status"))

    ho = fs.add_parser("hosts", parents=[url], help="every host: last seen, what it pushed, whether it is an outlier",
                       description="An outlier is a host whose own verdicts disagree with the other hosts' "
                                   "on the same policies more often than not (3 compared at least).")
    _json_arg(ho)
    ho.set_defaults(func=("fleet", "cmd_hosts"))

    pg = fs.add_parser("programs", parents=[url], help="the programs hosts pushed evaluations of")
    _json_arg(pg)
    pg.set_defaults(func=("fleet", "cmd_programs"))

    po = fs.add_parser("policy", parents=[url], help="where each policy of a program stands in the fleet")
    po.add_argument("program", metavar="PROGRAM", help="a fleet program id, an executable name, or NAME@BUILD_ID")
    _json_arg(po)
    po.set_defaults(func=("fleet", "cmd_policy"))



def main(argv=None):
    args = build_parser().parse_args(argv)
    # The command's module is imported only now: `hakmem --help` and the ring
    # commands need neither zmq, protobuf nor the store, and numpy only for
    # the ring (the tests and the bench runner start many `hakmem ring`).
    module, name = args.func
    mod = importlib.import_module(f"{__name__}.{module}")
    sys.stdout = Printable(sys.stdout)
    try:
        return getattr(mod, name)(args)
    except _Usage as e:
        return _fail(f"{e} (see --help)", 2)
    except mod.ERRORS as e:
        return _fail(str(e))
    except BrokenPipeError:
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
