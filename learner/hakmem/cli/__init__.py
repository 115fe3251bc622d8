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
from .common import _Usage, _fail


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
    d.set_defaults(func=("ring", "cmd_dump"))

    s = rs.add_parser("set-policy", help="publish a policy snapshot (starting from the one in force)",
                      description="Keys: drain_ms=MS; tcache_cap, tcache_batch, warm_slabs as KNOB=N "
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
    return p



def main(argv=None):
    args = build_parser().parse_args(argv)
    # The command's module is imported only now: `hakmem --help` and the ring
    # commands need neither zmq, protobuf nor the store, and numpy only for
    # the ring (the tests and the bench runner start many `hakmem ring`).
    module, name = args.func
    mod = importlib.import_module(f"{__name__}.{module}")
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
