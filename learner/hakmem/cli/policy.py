"""`hakmem policy ...`: list, show, compare, pin, unpin, export and import
programs' policies, through hakmem-learnd or its database (learnd.py)."""
import contextlib
import copy
import os
import sys

from .. import knobs as K
from .. import layout as L
from ..backend import read_export
from ..config import users_names
from ..control import ControlError, knobs_from_pb, to_dict
from ..ring import batches_note, fit_batches, parse_assignment
from .common import _Usage, _out_json, _table, _when
from .learnd import (ERRORS, _backend, _default_policy, _flags, _label, _not_running_note, _objective, _origin,
                     _program_of)

__all__ = ["ERRORS"]


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
    for n in K.PER_PROCESS:
        line = f"{n} {k[n]}"
        if base and base[n] != k[n]:
            line += f" (default v{default.version}: {base[n]})"
        print(line)
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
    for n in K.PER_PROCESS:
        if ka[n] != kc[n]:
            changes.append({"knob": n, "class": None, "size": None, "old": ka[n], "new": kc[n]})
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
            print(f"{ch['knob']} {ch['old']} -> {ch['new']}")
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
            before = copy.deepcopy(knobs)
            header = {"class_size": list(prog.class_size), "batch_max": K.SPEC["tcache_batch"]["max"]}
            named: dict[str, set] = {}
            for a in args.assignments:
                name, classes = parse_assignment(knobs, a, header)
                named.setdefault(name, set()).update(classes)
            fitted = fit_batches(knobs, before, named, header)
            note = args.note or f"v{start.version} with {' '.join(args.assignments)}"
            p = b.pin(args.program, 0, knobs, note)
    if args.json:
        _out_json(to_dict(p))
    else:
        if not args.version and fitted:
            print(batches_note(fitted, knobs, header["class_size"]))
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


def cmd_policy_explain(args):
    from .. import explain, store
    from ..config import default_db
    db = os.path.abspath(args.db or default_db())
    if not os.path.exists(db):
        raise ControlError(f"no database at {db} (hakmem-learnd has not run yet, or use --db)")
    st = store.Store(db, readonly=True)
    try:
        ev = explain.evidence(st, args.program)
    finally:
        st.close()
    if args.json:
        _out_json(ev)
    else:
        print("\n".join(explain.words(ev)))
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

