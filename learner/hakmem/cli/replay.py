"""`hakmem replay`: a trace replayed under one policy or a sweep of them
(replay.py does the work), and `hakmem replay --learner NAME PROGRAM`, a
program's stored history through a learner."""
import json
import os
import sys

from .. import config as C
from .. import knobs as K
from .. import replay as R
from ..backend import read_export
from ..control import ControlError, knobs_from_pb
from ..objective import Objective, ObjectiveError, Prices
from ..store import StoreError, program_key
from ..trace import TraceError
from .common import _Usage, _out_json, _table

ERRORS = (R.ReplayError, TraceError, StoreError, ControlError, ObjectiveError, K.KnobsError, C.ConfigError)


# ---- policies named on the command line --------------------------------------------
def _policy_arg(text, db) -> tuple[dict, str]:
    """(knobs to ask for, a label) from --policy: default, PROGRAM@VERSION, a
    JSON knobs file, or a `hakmem policy export` file."""
    if text in (None, "", "default"):
        return {}, "default"
    if os.path.exists(text):
        try:
            with open(text, "rb") as f:
                data = f.read(1 << 20)
        except OSError as e:
            raise R.ReplayError(f"cannot read the policy file {text}: {e.strerror}") from None
        try:
            d = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            f = read_export(data, text)
            return knobs_from_pb(f.policy.knobs), f"{os.path.basename(text)} (v{f.policy.version})"
        if not isinstance(d, dict):
            raise R.ReplayError(f"{text}: a JSON policy file is an object of knobs "
                                f"({', '.join(K.NAMES)}), not {type(d).__name__}")
        bad = sorted(set(d) - set(K.NAMES) - {"version"})
        if bad:
            raise R.ReplayError(f"{text}: unknown knob {bad[0]!r} (knobs: {', '.join(K.NAMES)})")
        for n, v in d.items():
            ok = (isinstance(v, int) and not isinstance(v, bool) and v >= 0) or \
                (n in K.PER_CLASS and isinstance(v, list) and len(v) == _classes()
                 and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v))
            if n != "version" and not ok:
                raise R.ReplayError(f"{text}: {n} must be a whole number >= 0"
                                    + (f" or a list of {_classes()}, one per class" if n in K.PER_CLASS else ""))
        d.pop("version", None)
        return d, os.path.basename(text)
    if "@" in text:
        prog, _, ver = text.rpartition("@")
        v = ver[1:] if ver[:1] in "vV" else ver
        if not v.isdigit():
            raise R.ReplayError(f"--policy {text}: not a file, and {ver!r} is not a policy version "
                                f"(PROGRAM@VERSION, e.g. python3@3)")
        st = _store(db, readonly=True)
        try:
            p = st.find_program(prog)
            pol = st.policy_by_version(p["id"], int(v))
        finally:
            st.close()
        return K.Knobs(pol["knobs"]).to_dict(), f"{os.path.basename(p['exe'])}@v{pol['version']}"
    raise R.ReplayError(f"--policy {text}: no such file, and not PROGRAM@VERSION or default")


def _classes():
    from .. import layout as L
    return L.NUM_CLASSES


def _store(db, readonly=False):
    from ..store import Store
    path = os.path.abspath(db or C.default_db())
    if readonly and not os.path.exists(path):
        raise StoreError(f"no database at {path} (hakmem-learnd has not run yet, or use --db)")
    st = Store(path, readonly=readonly)
    if not readonly and not st.db.execute("SELECT 1 FROM sqlite_master WHERE name = 'replay_runs'").fetchone():
        st.close()
        raise StoreError(f"{path}: no replay_runs table (this hakmem's migrations lack 0005_replay.sql)")
    return st


# ---- output ----------------------------------------------------------------------------
def _mib(b):
    return f"{b / 2**20:.1f}"


def _rows(results, labels, default_cost, front):
    rows = []
    for i, (r, lab) in enumerate(zip(results, labels), 1):
        vs = f"{(r.cost / default_cost - 1) * 100:+.1f}%" if default_cost else "-"
        rows.append((i, ("*" if i - 1 in front else "") + lab[:40], f"{r.time_cost:.4g}", _mib(r.peak_rss_bytes),
                     f"{r.os_calls:.0f}", f"{r.cost:.4g}", f"{r.spread * 100:.1f}%", vs, "stored" if r.stored else ""))
    return rows


def _promote(args, facts, result, st, note):
    """Stores result's policy as the trace's program's best, origin replay."""
    knobs = R.full_knobs(result.policy)
    if knobs is None:
        raise R.ReplayError("the replayer did not report every knob in force; cannot promote")
    try:
        users = C.users_text(C.parse_users(args.users, "--users")) if args.users else str(facts.uid)
    except C.ConfigError as e:
        raise R.ReplayError(str(e)) from None
    if not facts.exe:
        raise R.ReplayError(f"{facts.path}: the trace names no program (its header has no exe); cannot promote")
    build_id = facts.build_id or _build_identity(facts.exe)
    pid = st.program(facts.exe, build_id, users, facts.class_size)
    pol_id = st.policy(pid, knobs, "replay", note=note)
    st.set_best(pid, pol_id)
    with st.tx() as db:
        db.execute("UPDATE replay_runs SET program_id = ? WHERE trace_hash = ?", (pid, facts.hash))
    pol = st.policy_by_id(pol_id)
    prog = st.program_by_id(pid)
    return {"program": program_key(facts.exe, build_id, users), "version": pol["version"],
            "origin": pol["origin"], "knobs": pol["knobs"], "pinned_elsewhere": bool(prog.get("pinned_policy"))
            and prog["pinned_policy"] != pol_id}


def _build_identity(exe):
    """A program's build identity as learnd's discovery makes it
    (procfs.program_identity) when the trace has no GNU build id: the
    executable's size and time, as it is now."""
    from ..procfs import elf_build_id
    try:
        st = os.stat(exe)
    except OSError as e:
        raise R.ReplayError(f"the trace has no build id and its program {exe} cannot be read ({e.strerror}); "
                            f"cannot name the program to promote to") from None
    return elf_build_id(exe) or f"stat:{st.st_size}:{int(st.st_mtime)}"


# ---- the command --------------------------------------------------------------------------
def cmd_replay(args):
    if args.learner:
        return _learner(args)
    if not args.target:
        raise _Usage("give a TRACE to replay (or --learner NAME PROGRAM)")
    if args.repeat < 1 or args.repeat > 100:
        raise _Usage("--repeat is 1 to 100")
    if args.jobs is not None and args.jobs < 1:
        raise _Usage("--jobs is at least 1")
    if args.sweep and args.policy:
        raise _Usage("--sweep replays many policies; --policy names one: not both")
    if args.png and not args.sweep:
        raise _Usage("--png draws a sweep's Pareto chart: it needs --sweep")
    objective = Objective.parse(args.objective) if args.objective else Objective()
    replayer = R.find_replayer(args.replayer)
    # Faults and OS calls priced as hakmem-learnd prices them, measured on
    # this machine: with the fixed defaults a replay here ranked policies
    # unlike learnd's screening of the same trace (faults at 0.7 us against
    # the 1.4 us measured beside it).
    prices = Prices.calibrate()
    knobs, label = _policy_arg(args.policy, args.db)
    facts = R.trace_facts(args.target, partial=args.partial)
    st = _store(args.db) if (args.sweep or args.promote or args.db) else None
    try:
        if args.sweep:
            return _sweep(args, facts, st, objective, replayer, prices)
        sw = R.Sweep(facts, st, objective, prices=prices, repeat=args.repeat, partial=args.partial,
                     replayer=replayer, jobs=1)
        r = sw.one(knobs)
        promoted = _promote(args, facts, r, st, f"replay of {os.path.basename(facts.path)} ({label})") \
            if args.promote else None
    finally:
        if st is not None:
            st.close()
    if args.json:
        _out_json({"trace": r.raw.get("trace", {}) | {"hash": facts.hash}, "policy_asked": knobs, "label": label,
                   "objective": objective.describe(), "prices": _prices_json(prices), "result": r.as_json(),
                   "replayer": r.raw,
                   "promoted": promoted})
        return 0
    t = r.raw.get("trace", {})
    cut = f" (partial: {t.get('cut_reason')})" if t.get("partial") else ""
    print(f"{facts.path}: {t.get('events', facts.events)} events, {t.get('threads', '?')} threads, "
          f"{facts.mode} trace of {facts.exe or '?'}{cut}")
    print(f"policy {label}; {r.repeat} run{'s' if r.repeat > 1 else ''}{' (stored result)' if r.stored else ''}")
    _table(("wall s", "cpu s", "peak RSS MiB", "os calls", "minflt", "time cost", "cost", "spread"),
           [(f"{r.wall_s:.4f}", f"{r.cpu_s:.4f}", _mib(r.peak_rss_bytes), f"{r.os_calls:.0f}", f"{r.minflt:.0f}",
             f"{r.time_cost:.4g}", f"{r.cost:.4g}", f"{r.spread * 100:.1f}%")])
    print(f"cost: {objective.describe()}, per second of the traced program's {facts.duration_s:.3g} s; "
          f"{_prices_text(prices)}")
    if promoted:
        _say_promoted(promoted)
    return 0


def _say_promoted(p):
    print(f"promoted: v{p['version']} ({p['origin']}) is now the best policy of {p['program']}; "
          f"hakmem-learnd applies it when the program next starts")
    if p["pinned_elsewhere"]:
        print("note: the program has another policy pinned, which wins; `hakmem policy unpin` lets this one apply")


def _prices_json(prices: Prices) -> dict:
    return {"fault_s": prices.fault_s, "syscall_s": prices.syscall_s, "zap_s": prices.zap_s}


def _prices_text(prices: Prices, where="measured here") -> str:
    return (f"a fault {prices.fault_s * 1e6:.2f} us, an OS call {prices.syscall_s * 1e6:.2f} us, "
            f"a page given back {prices.zap_s * 1e9:.0f} ns ({where})")


def _sweep(args, facts, st, objective, replayer, prices):
    from ..progress import progress
    kind = args.sweep
    budget = args.budget
    where = "measured here"
    if kind == "learner" and st is not None:
        # A learner's search continued from the store runs at the prices it
        # began with, so that it picks the same policies and replays only
        # what it has not; a grid is priced afresh (every point is replayed
        # or reused whatever the prices, and ranked at today's).
        began = R.search_prices(st, facts, objective)
        if began is not None:
            prices, where = began, "as when this search began"
    bar = progress(total=None, desc=f"replay {kind}", unit="policy")

    def tick(r):
        bar.update(1)
        bar.set_postfix_str(f"cost {r.cost:.4g}")
    sw = R.Sweep(facts, st, objective, prices=prices, repeat=args.repeat, partial=args.partial, replayer=replayer,
                 jobs=args.jobs, on_result=tick)
    interrupted = False
    try:
        with bar:
            base = sw.one({})
            default = R.full_knobs(base.policy)
            if default is None:
                raise R.ReplayError("the replayer did not report the default policy's knobs; cannot sweep")
            if kind == "grid":
                pts = R.grid(default, facts)
                if budget:
                    pts = pts[:max(1, budget)]
                bar.total = len(pts)
                sw.many([k for _, k in pts])
            else:
                bar.total = budget or 12
                R.learner_sweep(sw, default, name=args.sweep_learner, budget=budget or 12, seed=args.seed)
    except KeyboardInterrupt:
        interrupted = True
    results = list(sw.results.values())
    if interrupted:
        print(f"hakmem: interrupted: {len(results)} results stored in {st.path}; run the same command again to "
              f"continue", file=sys.stderr)
        return 130
    cs = facts.class_size
    labels = [R.label_of(r.knobs if not r.knobs or set(r.knobs) == set(K.ORDER) else
                         dict(default, **r.knobs), default, cs) for r in results]
    order = sorted(range(len(results)), key=lambda i: results[i].cost)
    results, labels = [results[i] for i in order], [labels[i] for i in order]
    front = R.pareto([(r.time_cost, r.peak_rss_bytes) for r in results])
    dcost = base.cost
    best = results[0]
    promoted = None
    if args.promote:
        pick = best
        if args.promote != "best":
            n = int(args.promote[1:] if args.promote[:1] in "#vV" else args.promote) \
                if (args.promote.lstrip("#vV").isdigit()) else 0
            if not 1 <= n <= len(results):
                raise _Usage(f"--promote {args.promote}: give best or a row number 1..{len(results)} of the table")
            pick = results[n - 1]
        promoted = _promote(args, facts, pick, st, f"replay sweep ({kind}) of {os.path.basename(facts.path)}: "
                                                   f"cost {pick.cost:.4g} vs default {dcost:.4g}")
    if args.png:
        R.chart(results, labels, args.png, f"{os.path.basename(facts.path)}: {len(results)} policies, "
                                           f"{objective.describe()}")
    if args.json:
        _out_json({"trace": {"path": facts.path, "hash": facts.hash, "exe": facts.exe, "build_id": facts.build_id,
                             "events": facts.events, "duration_s": facts.duration_s,
                             "hot_classes": facts.hot_classes()},
                   "kind": kind, "objective": objective.describe(),
                   "prices": dict(_prices_json(prices), source=where),
                   "repeat": args.repeat,
                   "replayed": sw.replayed, "default": base.as_json(),
                   "results": [dict(r.as_json(), label=lab, pareto=i in front, rank=i + 1)
                               for i, (r, lab) in enumerate(zip(results, labels))],
                   "best": dict(best.as_json(), label=labels[0]),
                   "beats_default": best.cost < dcost * (1 - max(best.spread, base.spread)),
                   "png": args.png, "promoted": promoted})
        return 0
    print(f"{facts.path}: {kind} sweep of {len(results)} policies ({sw.replayed} replayed now, "
          f"{len(results) - sw.replayed} stored), {args.repeat} runs each; cost {objective.describe()}; "
          f"{_prices_text(prices, where)}")
    _table(("#", "policy (* Pareto)", "time cost", "RSS MiB", "os calls", "cost", "spread", "vs default", ""),
           _rows(results, labels, dcost, front))
    verdict = ("beats the default beyond the spread" if best.cost < dcost * (1 - max(best.spread, base.spread))
               else "does not beat the default beyond the spread")
    print(f"best: #1 {labels[0]} {verdict}")
    if args.png:
        print(f"chart: {args.png}")
    if promoted:
        _say_promoted(promoted)
    return 0


def _learner(args):
    if not args.target:
        raise _Usage("--learner NAME needs the PROGRAM whose history to replay")
    if args.sweep or args.policy or args.promote or args.png:
        raise _Usage("--learner replays a program's stored history: --sweep, --policy, --promote and --png "
                     "are for traces")
    objective = Objective.parse(args.objective) if args.objective else None
    st = _store(args.db, readonly=True)
    try:
        prog = st.find_program(args.target)
        out = R.replay_learner(st, prog, args.learner, seed=args.seed, objective=objective)
    finally:
        st.close()
    if args.json:
        _out_json(out)
        return 0
    print(f"{out['program']}: {out['windows']} stored windows through learner {out['learner']} (seed {out['seed']})")
    rows = []
    for s in out["steps"]:
        d = s["decision"]
        if d is None and not s.get("live_changed") and not s.get("live_verdicts"):
            continue
        live_note = ", ".join((["changed"] if s.get("live_changed") else []) + s.get("live_verdicts", []))
        rows.append((s["step"], f"v{s['live_version']}" if s["live_version"] else "-", live_note[:30],
                     d["kind"] if d else "-",
                     (d["label"] + (f" (v{d['stored_version']})" if d and d["stored_version"] else ""))[:40]
                     if d else "", (d["reason"][:60] if d else "")))
    if rows:
        _table(("window", "live", "live decided", "would", "policy", "why"), rows)
    print(f"{out['decisions']} decisions replayed; live: {out['live_changes']} policy changes, "
          f"{len(out['live_evaluations'])} evaluations "
          f"({', '.join(sorted({e['verdict'] for e in out['live_evaluations']})) or 'none'})")
    inc = out["incumbent"]
    cost = f"{inc['cost']:.4g}" if inc["cost"] is not None else "unmeasured"
    print(f"its incumbent at the end: {inc['label']} (cost {cost}); state {out['state']}")
    return 0
