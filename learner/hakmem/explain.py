"""The evidence for a program's policy in force, from the store alone
(`hakmem policy explain PROGRAM`): why learnd chose it, in the figures it
chose it by.

  - the policy in force (pinned, else the best) and the default;
  - the trial that made it the incumbent: its windows' mean cost against the
    incumbent's before it (the paired difference learnd judged on), and every
    other trial's verdict with its own difference;
  - every policy's windows since: how many, and their mean cost;
  - the screening's replay ranking (screen.py), where the policy stood in it.

Costs are the objective's units (core-seconds per second + lambda per GiB
resident), the same for every learner and for the replay, so figures of
different origins compare."""
from __future__ import annotations

import json

from .knobs import Knobs
from .store import Store, StoreError


def _label(knobs: dict, default: dict | None, class_size) -> str:
    """What a policy changes from the default, for a person; a knob set to
    one value in many classes (the screening's corners) reads as one part."""
    from .replay import label_of
    if default is None:
        return label_of(knobs, default, class_size)
    if Knobs.of(knobs) == Knobs.of(default):
        return "default"
    parts, rest = [], dict(knobs)
    for name, word in (("tcache_cap", "cap"), ("warm_slabs", "warm")):
        diff = [c for c, (a, b) in enumerate(zip(knobs[name], default[name])) if a != b]
        vals = {knobs[name][c] for c in diff}
        up = all(knobs[name][c] > default[name][c] for c in diff)
        down = all(knobs[name][c] < default[name][c] for c in diff)
        if len(diff) >= 8 and (len(vals) <= 2 or up or down):
            what = ("=" + "/".join(str(v) for v in sorted(vals)) if len(vals) <= 2 else
                    " raised" if up else " lowered")
            parts.append(f"{word}{what} ({len(diff)} classes)")
            rest[name] = list(default[name])
            if name == "tcache_cap":
                rest["tcache_batch"] = list(default["tcache_batch"])
    more = label_of(rest, default, class_size)
    return " ".join(parts + ([more] if more != "default" else [])) or "default"


def evidence(store: Store, program: str) -> dict:
    """Everything the store says about the program's policy in force."""
    prog = store.find_program(program)
    pid = prog["id"]
    pols = {p["id"]: p for p in store.policies(pid)}
    chosen = store.chosen(pid)
    default = next((p for p in pols.values() if p["origin"] == "default"), None)
    dk = default["knobs"] if default else None
    sizes = prog["class_sizes"]

    def pol(pid_):
        p = pols.get(pid_)
        if p is None:
            return None
        return {"version": p["version"], "origin": p["origin"], "label": _label(p["knobs"], dk, sizes)}

    evs = list(reversed(store.evaluations(pid, limit=10_000)))   # oldest first
    trials = []
    for e in evs:
        if e["verdict"] == "measured":
            continue
        base = e["baseline_cost"]
        trials.append({"policy": pol(e["policy_id"]), "baseline": pol(e["baseline_policy_id"]),
                       "verdict": e["verdict"], "learner": e["learner"], "windows": e["windows"],
                       "cost": e["cost_mean"], "cost_sd": e["cost_sd"], "baseline_cost": base,
                       "difference": (e["cost_mean"] - base) if base is not None else None,
                       "relative": (e["cost_mean"] / base - 1) if base else None, "t_end": e["t_end"]})
    measured = {}
    for r in store.db.execute(
            "SELECT w.policy_id AS policy_id, count(*) AS n, avg(w.cost) AS cost, min(w.t_start) AS since "
            "FROM windows w JOIN processes p ON p.id = w.process_id WHERE p.program_id = ? "
            "AND w.policy_id IS NOT NULL GROUP BY w.policy_id", (pid,)):
        measured[r["policy_id"]] = {"policy": pol(r["policy_id"]), "windows": r["n"], "cost": r["cost"]}
    replay = None
    row = store.db.execute("SELECT trace_hash FROM replay_runs WHERE program_id = ? ORDER BY created DESC LIMIT 1",
                           (pid,)).fetchone()
    if row:
        runs = store.db.execute("SELECT knobs, cost, spread, peak_rss_bytes, time_cost, objective FROM replay_runs "
                                "WHERE program_id = ? AND trace_hash = ? ORDER BY cost", (pid, row[0])).fetchall()
        ranking = []
        for i, r in enumerate(runs):
            k = json.loads(r["knobs"])
            full = dict(dk, **k) if dk and k else (k or dk)
            ranking.append({"rank": i + 1, "label": _label(full, dk, sizes) if full else "default",
                            "cost": r["cost"], "spread": r["spread"], "peak_rss_bytes": r["peak_rss_bytes"],
                            "in_force": bool(chosen and full and Knobs.of(full) == Knobs.of(chosen["knobs"]))})
        base = next((x["cost"] for x in ranking if x["label"] == "default"), None)
        for x in ranking:
            x["vs_default"] = (x["cost"] / base - 1) if base else None
        replay = {"trace": row[0][:12], "objective": runs[0]["objective"] if runs else None, "ranking": ranking}
    won = None
    if chosen is not None:
        won = next((t for t in reversed(trials) if t["verdict"] == "accepted" and t["policy"]
                    and t["policy"]["version"] == chosen["version"]), None)
    return {"program": prog["key"], "objective": None if not evs else evs[-1]["objective"],
            "in_force": None if chosen is None else {**pol(chosen["id"]), "pinned": chosen["pinned"]},
            "default": pol(default["id"]) if default else None, "accepted_by": won, "trials": trials,
            "measured": sorted(measured.values(), key=lambda m: m["policy"]["version"]), "replay": replay}


def _pct(x):
    return "-" if x is None else f"{100 * x:+.1f}%"


def _v(p):
    return "?" if p is None else f"v{p['version']} ({p['label']})"


def words(ev: dict) -> list[str]:
    """The evidence for a person, a line each."""
    out = [f"{ev['program']}"]
    inf = ev["in_force"]
    if inf is None:
        out.append("no policy stored: new processes run the allocator's default")
        return out
    how = "pinned by hand" if inf["pinned"] else f"{inf['origin']}"
    out.append(f"in force: {_v(inf)}, {how}; costs in {ev['objective'] or 'the objective'} units")
    a = ev["accepted_by"]
    if a:
        out.append(f"why: accepted against {_v(a['baseline'])} after {a['windows']} windows: cost {a['cost']:.4g} "
                   f"vs {a['baseline_cost']:.4g} ({_pct(a['relative'])}; learner {a['learner']})")
    elif inf["origin"] == "default":
        out.append("why: no candidate beat it beyond the noise" if ev["trials"] else
                   "why: nothing was tried yet")
    rp = ev["replay"]
    if rp:
        mine = next((x for x in rp["ranking"] if x["in_force"]), None)
        where = (f"ranked #{mine['rank']} of {len(rp['ranking'])} ({_pct(mine['vs_default'])} vs default)"
                 if mine else f"not among the {len(rp['ranking'])} policies replayed")
        top = ", ".join(f"{x['label']} {_pct(x['vs_default'])}" for x in rp["ranking"][:3])
        out.append(f"replay (trace {rp['trace']}): {where}; best three: {top}")
    if ev["trials"]:
        out.append(f"trials ({len(ev['trials'])}):")
        for t in ev["trials"]:
            out.append(f"  {_v(t['policy'])} vs {_v(t['baseline'])}: {t['verdict']}, {_pct(t['relative'])} "
                       f"over {t['windows']} windows")
    if ev["measured"]:
        out.append("windows measured per policy:")
        for m in ev["measured"]:
            out.append(f"  {_v(m['policy'])}: {m['windows']} windows, mean cost {m['cost']:.4g}")
    return out


__all__ = ["evidence", "words", "StoreError"]
