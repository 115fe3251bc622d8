"""`hakmem fleet ...`: the fleet database (fleet.py), for its owner and its hosts."""
import json
import os

from ..config import ConfigError, load
from ..fleet import FleetDB, FleetError, redact
from .common import _Usage, _out_json, _table, _when

ERRORS = (FleetError, ConfigError)


def _url_and_config(args):
    cfg = load(args.config) if args.config else None
    url = args.url or os.environ.get("HAKMEM_FLEET_URL") or (cfg.fleet if cfg else None)
    if not url:
        raise _Usage("no fleet database: give --url, $HAKMEM_FLEET_URL, or --config with fleet = \"...\"")
    return url, cfg


def _db(args):
    url, _ = _url_and_config(args)
    return FleetDB(url)


def _read(args, what):
    """what(db) on a connection of its own; printed as JSON with --json
    (then None: nothing more to print)."""
    db = _db(args)
    try:
        out = what(db)
    finally:
        db.close()
    if args.json:
        _out_json(out)
        return None
    return out


def cmd_migrate(args):
    url, cfg = _url_and_config(args)
    k = args.k if args.k is not None else (cfg.fleet_k if cfg else None)
    canary = args.canary if args.canary is not None else (cfg.fleet_canary if cfg else None)
    if k is not None and not 1 <= k <= 10_000:
        raise _Usage(f"--k must be between 1 and 10000, got {k}")
    if canary is not None and not 0.0 <= canary <= 1.0:
        raise _Usage(f"--canary must be a fraction between 0 and 1, got {canary}")
    if args.confirm is not None and not 0 <= args.confirm <= 10_000:
        raise _Usage(f"--confirm must be between 0 and 10000, got {args.confirm}")
    db = FleetDB(url)
    try:
        before, after = db.migrate(k=k, canary=canary, confirm=args.confirm)
        settings = db.settings()
    finally:
        db.close()
    if args.json:
        _out_json({"url": redact(url), "version_before": before, "version": after, "settings": settings})
    else:
        what = "up to date" if before == after else f"migrated from version {before}"
        print(f"fleet schema version {after} ({what}); k={settings['k']:g}, canary_fraction="
              f"{settings['canary_fraction']:g}, canary_confirm={settings['canary_confirm']:g}")
    return 0


def cmd_add_host(args):
    password = None
    if args.password_file:
        try:
            with open(args.password_file) as f:
                password = f.readline().rstrip("\n")
        except OSError as e:
            raise FleetError(f"cannot read {args.password_file}: {e.strerror}") from None
        if not password:
            raise FleetError(f"{args.password_file}: empty password")
    db = _db(args)
    try:
        role = db.add_host(args.host, password)
    finally:
        db.close()
    if args.json:
        _out_json({"host": args.host, "role": role})
    else:
        print(f"host {args.host}: role {role}" + ("" if password else " (no password set)"))
    return 0


def _exclusion(args, exclude):
    db = _db(args)
    try:
        db.exclude(args.host, getattr(args, "why", None), exclude=exclude)
    finally:
        db.close()
    if args.json:
        _out_json({"host": args.host, "excluded": exclude})
    else:
        print(f"host {args.host}: {'excluded: its rows count for nothing' if exclude else 'counted again'}")
    return 0


def cmd_exclude(args):
    return _exclusion(args, True)


def cmd_include(args):
    return _exclusion(args, False)


def cmd_status(args):
    st = _read(args, lambda db: db.status())
    if st is None:
        return 0
    s = st["settings"]
    print(f"schema version {st['schema_version']}; k={s['k']:g}, canary_fraction={s['canary_fraction']:g}, "
          f"canary_confirm={s['canary_confirm']:g}")
    print(f"{st['hosts']} hosts ({st['excluded']} excluded), {st['programs']} programs, "
          f"{st['evaluations']} evaluations")
    print(f"policies: {st['offered']} offered, {st['canary']} with their canaries, {st['stopped']} stopped")
    return 0


def cmd_hosts(args):
    rows = _read(args, lambda db: db.hosts())
    if rows is None:
        return 0
    if not rows:
        print("no hosts (the owner adds them: hakmem fleet add-host HOST)")
        return 0
    _table(("host", "class", "last seen", "evaluations", "verdicts", "disagree", "state"),
           [(r["host"], r["hw_class"] or "-", _when(r["last_seen"]), r["evaluations"], r["verdicts"],
             f"{r['disagree']}/{r['compared']}",
             "excluded" + (f" ({r['excluded_why']})" if r["excluded_why"] else "") if r["excluded"] else
             ("OUTLIER" if r["outlier"] else "ok")) for r in rows], indent="")
    return 0


def cmd_programs(args):
    rows = _read(args, lambda db: db.programs())
    if rows is None:
        return 0
    if not rows:
        print("no programs yet")
        return 0
    _table(("id", "program", "build", "users", "class", "hosts", "evaluations", "fleet policy"),
           [(r["id"], r["exe_name"], r["build_id"][:12], r["users"], r["hw_class"], r["hosts"], r["evaluations"],
             r["stage"] or "-") for r in rows], indent="")
    return 0


def cmd_policy(args):
    rows = _read(args, lambda db: db.policy(args.program))
    if rows is None:
        return 0
    if not rows:
        print(f"{args.program}: no host measured a policy against its default yet")
        return 0
    for r in rows:
        rel = f"{(r['rel'] - 1) * 100:+.1f}%" if r["rel"] is not None else "-"
        print(f"{r['exe_name']} ({r['hw_class']}, program {r['program_id']}): {r['stage']}: {r['agree']} hosts "
              f"better (median {rel}), {r['against']} worse; canaries {r['canaries']}, kept by {r['kept']}, "
              f"rolled back by {r['worse']}")
        print(f"  {json.dumps(r['knobs'], separators=(',', ':'))[:400]}")
    return 0
