#!/usr/bin/env python3
"""Does a replay predict the live program? (issue 14's target)

For each workload, a grid of static policies is ranked twice:

  live    the program itself, preloaded with libhakmem and the policy given
          by environment knobs (HAKMEM_TCACHE_CAP, HAKMEM_WARM_SLABS,
          HAKMEM_DRAIN_MS: the allocator fits each to every class's bounds)
  replay  one trace of the program under the default policy (HAKMEM_TRACE),
          replayed by $BUILD/hakmem-replay under each policy (--policy: the
          same knobs, fitted to each class as the allocator fits them),
          --repeat N

and the two rankings are compared by Spearman's rho (target: >= 0.8). The
objective is the bench-learn one, cores plus a price of memory:

  live    J = D_ref / X + lambda * peak RSS / GiB   (bench-learn workloads:
          X = ops per busy CPU-second, D_ref = the default run's ops per
          wall second; a real program: its CPU seconds / the default's wall
          seconds)
  replay  J = CPU seconds of the replay / the trace's duration + lambda *
          the replay's peak RSS above its RSS before the first event (hakmem-replay reports it so) / GiB
          (the median of the repeats)

with lambda = bench/learn.py's LAMBDA. Workloads: the three of `make
bench-learn` (bench/learn_workload.c: burst, idle-threads, phases) and one
real program (sqlite3 running a fixed SQL script).

  BUILD=build .venv/bin/python bench/replay_predict.py [--quick] [--seconds S]
        [--repeat N] [--workloads a,b] [--out DIR]

Outputs (in --out, default bench/results/): replay_predict.json (every
measurement), replay_predict.md (the tables, also printed). Exit status 0
when every run completed (a rho under 0.8 is reported, not an error;
--strict makes it exit 1), 1 on a failed run or a missing build.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "learner"))
BUILD = ROOT / os.environ.get("BUILD", "build")
LIB = BUILD / "libhakmem.so"
WORKLOAD = BUILD / "bench" / "learn_workload"
REPLAYER = Path(os.environ.get("HAKMEM_REPLAY", BUILD / "hakmem-replay"))
GIB = float(1 << 30)
LAMBDA = 0.5          # bench/learn.py's price of memory: a GiB resident costs half a core
TARGET = 0.8

# bench/learn.py's grid, as environment knobs (values past a class's bounds
# are fitted to them by the allocator: 4096 is every class's greatest cap,
# 1048576 its greatest warm pool).
GRID = [
    ("default", {}),
    ("cap=max", {"HAKMEM_TCACHE_CAP": 4096}),
    ("cap=32", {"HAKMEM_TCACHE_CAP": 32}),
    ("cap=4", {"HAKMEM_TCACHE_CAP": 4}),
    ("cap=4 drain=100", {"HAKMEM_TCACHE_CAP": 4, "HAKMEM_DRAIN_MS": 100}),
    ("warm=max", {"HAKMEM_WARM_SLABS": 1048576}),
    ("warm=0", {"HAKMEM_WARM_SLABS": 0}),
    ("cap=4 warm=max", {"HAKMEM_TCACHE_CAP": 4, "HAKMEM_WARM_SLABS": 1048576}),
    ("cap=max warm=max", {"HAKMEM_TCACHE_CAP": 4096, "HAKMEM_WARM_SLABS": 1048576}),
]
QUICK_GRID = ("default", "cap=max", "cap=4", "warm=max", "warm=0")

SQL_ROWS = 60000


def sql_script() -> str:
    rows = [f"INSERT INTO t VALUES({i}, {i % 37}, 'name_{i}_{'x' * (i % 60)}');" for i in range(1, SQL_ROWS + 1)]
    return "\n".join(["CREATE TABLE t(id INTEGER PRIMARY KEY, grp INTEGER, name TEXT);", "BEGIN;", *rows,
                      "COMMIT;", "CREATE INDEX tg ON t(grp);", "CREATE INDEX tn ON t(name);",
                      "SELECT grp, count(*), sum(length(name)) FROM t GROUP BY grp ORDER BY grp LIMIT 3;",
                      "UPDATE t SET name = name || '_updated' WHERE id % 3 = 0;", "DELETE FROM t WHERE id % 5 = 0;",
                      "SELECT count(*), sum(length(name)) FROM t;", "VACUUM;", ""])


WORKLOADS = ("burst", "idle-threads", "phases", "sqlite3")


class SetupError(Exception):
    pass


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAKMEM_")}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rho with average ranks for ties."""
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return r
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va and vb else float("nan")


def rank_of(values: list[float]) -> list[int]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    r = [0] * len(values)
    for pos, i in enumerate(order):
        r[i] = pos + 1
    return r


# ---------------------------------------------------------------- runs

def run_one(argv, env, stdin=None, timeout=600) -> dict:
    """Runs argv; its stdout, stderr, wall seconds, and its own CPU seconds
    and peak RSS (os.wait4's rusage of this child alone)."""
    t0 = time.monotonic()
    p = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    res = {}
    # communicate() would reap the child and lose its rusage: the pipes are
    # read by threads and the child reaped here with wait4.
    th = threading.Thread(target=lambda: (res.__setitem__("out", p.stdout.read()),), daemon=True)
    te = threading.Thread(target=lambda: (res.__setitem__("err", p.stderr.read()),), daemon=True)
    th.start()
    te.start()
    if stdin is not None:
        try:
            p.stdin.write(stdin)
            p.stdin.close()
        except BrokenPipeError:
            pass
    deadline = time.monotonic() + timeout
    while True:
        pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            p.kill()
            os.wait4(p.pid, 0)
            raise SetupError(f"{argv[0]} ran past {timeout} s")
        time.sleep(0.01)
    p.returncode = os.waitstatus_to_exitcode(status)
    th.join()
    te.join()
    return {"rc": p.returncode, "out": res.get("out", ""), "err": res.get("err", ""),
            "wall_s": time.monotonic() - t0, "cpu_s": ru.ru_utime + ru.ru_stime, "peak_rss_bytes": ru.ru_maxrss * 1024}


def workload_argv(name: str, seconds: float, work: Path):
    if name == "sqlite3":
        sqlite = shutil.which("sqlite3")
        if not sqlite:
            raise SetupError("sqlite3 is not installed (make deps)")
        db = work / "db.sqlite"
        return [sqlite, str(db)], sql_script(), db
    return [str(WORKLOAD), name, f"{seconds:g}", "42"], None, None


def live(name: str, knobs: dict, seconds: float, work: Path, trace: Path | None = None) -> dict:
    argv, stdin, db = workload_argv(name, seconds, work)
    if db is not None and db.exists():
        db.unlink()
    env = clean_env(LD_PRELOAD=str(LIB), **knobs)
    if trace is not None:
        env["HAKMEM_TRACE"] = str(trace)
    r = run_one(argv, env, stdin)
    if r["rc"] != 0:
        raise SetupError(f"{name} exited {r['rc']}: {r['err'].strip().splitlines()[-1:] or ''}")
    m = {"wall_s": r["wall_s"], "cpu_s": r["cpu_s"], "peak_rss_bytes": r["peak_rss_bytes"]}
    if name != "sqlite3":
        last = [json.loads(ln) for ln in r["out"].splitlines() if ln.startswith("{")][-1]
        m.update(ops=last["ops"], busy=last["busy"], t=last["t"])
    return m


def live_cost(m: dict, ref: dict) -> float:
    if "ops" in m:
        d_ref = ref["ops"] / ref["t"]
        x = m["ops"] / max(m["busy"], 1e-9)
        t = d_ref / x
    else:
        t = m["cpu_s"] / ref["wall_s"]
    return t + LAMBDA * m["peak_rss_bytes"] / GIB


def replay_policy(env_knobs: dict, class_size: list) -> dict:
    """The replayer's --policy for a grid point's environment knobs, set as
    the allocator sets them from its environment (options.c): the cap
    fitted to each class's bounds with the batch following it (cap/2, at
    most 256, at least 1); warm_slabs as one number the replayer fits to
    each class's bounds; drain_ms as it is. (hakmem-replay runs with a
    clean environment: HAKMEM_* variables do not reach the allocator.)"""
    from hakmem import knobs as K
    from hakmem.replay import cap_max
    pol = {}
    if "HAKMEM_TCACHE_CAP" in env_knobs:
        v = int(env_knobs["HAKMEM_TCACHE_CAP"])
        top = cap_max(class_size)
        caps = [0] + [max(int(K.SPEC["tcache_cap"]["min"]), min(v, top[c])) for c in range(1, len(class_size))]
        pol["tcache_cap"] = caps
        pol["tcache_batch"] = [0] + [min(K.default_batch(cp, K.SPEC["tcache_batch"]["max"]), max(cp, 1))
                                     for cp in caps[1:]]
    if "HAKMEM_WARM_SLABS" in env_knobs:
        pol["warm_slabs"] = int(env_knobs["HAKMEM_WARM_SLABS"])
    if "HAKMEM_DRAIN_MS" in env_knobs:
        pol["drain_ms"] = int(env_knobs["HAKMEM_DRAIN_MS"])
    return pol


def replay(trace: Path, env_knobs: dict, class_size: list, repeat: int, work: Path) -> dict:
    argv = [str(REPLAYER), "--repeat", str(repeat), "--json"]
    pol = replay_policy(env_knobs, class_size)
    if pol:
        pf = work / "policy.json"
        pf.write_text(json.dumps(pol))
        argv += ["--policy", str(pf)]
    r = run_one(argv + [str(trace)], clean_env())
    if r["rc"] != 0:
        raise SetupError(f"hakmem-replay exited {r['rc']}: {r['err'].strip()[-300:]}")
    out = json.loads(r["out"])
    out["policy_asked"] = pol
    return out


def replay_cost(res: dict, duration_s: float) -> tuple[float, list[float]]:
    # Memory: the peak over what the replay had resident before its first
    # event (its own tables: the trace, the object map), which no policy changes.
    costs = [run["cpu_s"] / duration_s + LAMBDA * run["peak_rss_bytes"] / GIB
             for run in res["runs"]]
    return statistics.median(costs), costs


# ---------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--quick", action="store_true", help=f"a smaller grid ({', '.join(QUICK_GRID)}), shorter runs")
    ap.add_argument("--seconds", type=float, default=None, help="length of a live run (default 3, --quick 1)")
    ap.add_argument("--capture-seconds", type=float, default=1.0,
                    help="length of the run whose trace is replayed (default 1: burst writes ~70 MB a second)")
    ap.add_argument("--repeat", type=int, default=None, help="replays per policy (default 3, --quick 2)")
    ap.add_argument("--live-repeat", type=int, default=None, help="live runs per policy, median (default 2, --quick 1)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"default {','.join(WORKLOADS)}")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a workload's rho is under 0.8")
    ap.add_argument("--live-only", action="store_true",
                    help="no capture or replay: the live runs alone, and how well two live runs of each policy "
                         "rank alike (the ceiling any prediction has on this machine)")
    a = ap.parse_args(argv)
    seconds = a.seconds or (1.0 if a.quick else 3.0)
    repeat = a.repeat or (2 if a.quick else 3)
    live_repeat = a.live_repeat or (1 if a.quick else 2)
    grid = [g for g in GRID if not a.quick or g[0] in QUICK_GRID]
    names = [w for w in a.workloads.split(",") if w]
    try:
        for n in names:
            if n not in WORKLOADS:
                raise SetupError(f"unknown workload {n!r} (one of {', '.join(WORKLOADS)})")
        for p, how in ((LIB, "make lib"), (WORKLOAD, "make bench-learn"), (REPLAYER, "make")):
            if not p.exists() and not (a.live_only and p == REPLAYER):
                raise SetupError(f"{p} missing: run `{how}` (BUILD={BUILD.name})")
        if a.live_only and live_repeat < 2:
            raise SetupError("--live-only compares live runs: --live-repeat must be at least 2")
        result = run(names, grid, seconds, repeat, live_repeat, a.live_only, a.capture_seconds)
    except SetupError as e:
        print(f"replay_predict: error: {e}", file=sys.stderr)
        return 1
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "replay_predict.json").write_text(json.dumps(result, indent=1) + "\n")
    md = render(result)
    (a.out / "replay_predict.md").write_text(md)
    print(md)
    bad = [w for w, r in result["workloads"].items() if not (r["rho"] or 0) >= TARGET]
    return 1 if a.strict and bad else 0


def run(names, grid, seconds, repeat, live_repeat, live_only=False, capture_s=1.0) -> dict:
    from hakmem import trace as T
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "lambda": LAMBDA, "seconds": seconds, "capture_seconds": capture_s, "repeat": repeat,
           "live_repeat": live_repeat,
           "live_only": live_only, "nproc": os.cpu_count(), "loadavg_start": os.getloadavg(), "workloads": {}}
    for name in names:
        with tempfile.TemporaryDirectory(prefix="replay-predict-") as tmp:
            work = Path(tmp)
            trace = work / "w.trace"
            ev, dur = None, None
            if not live_only:
                log(f"{name}: capturing a trace (default policy, {capture_s:g} s)")
                live(name, {}, capture_s, work, trace=trace)
                it = T.iter_chunks(trace)
                for _ in it:            # checks it whole; the counts are all we need
                    pass
                if not it.footer.duration_ns:
                    raise SetupError(f"{trace}: a trace without a duration")
                ev, dur = it.events, it.footer.duration_ns / 1e9
                class_size = list(it.header.class_size)
            rows = []
            ref = None
            for label, knobs in grid:
                ms = [live(name, knobs, seconds, work) for _ in range(live_repeat)]
                if label == "default":
                    ref = ms[0]
                rows.append({"policy": label, "env": knobs, "live_runs": ms})
            for row in rows:
                costs = [live_cost(m, ref) for m in row["live_runs"]]
                row["live_J"] = statistics.median(costs)
                row["live_J_runs"] = costs
                if live_only:
                    log(f"{name}: {row['policy']}: live J {row['live_J']:.5f} ({', '.join(f'{c:.5f}' for c in costs)})")
                    continue
                log(f"{name}: {row['policy']}: live J {row['live_J']:.5f}; replaying x{repeat}")
                res = replay(trace, row["env"], class_size, repeat, work)
                row["replay_policy"] = res["policy"]
                row["replay_J"], row["replay_J_runs"] = replay_cost(res, dur)
                row["replay_spread"] = res.get("spread")
                row["replay_ops"] = [run.get("ops") for run in res["runs"]]
            lj = [r["live_J"] for r in rows]
            # The noise ceiling: the first live run of each policy against the second.
            self_rho = (spearman([r["live_J_runs"][0] for r in rows], [r["live_J_runs"][1] for r in rows])
                        if live_repeat >= 2 else None)
            rho = None
            if not live_only:
                rj = [r["replay_J"] for r in rows]
                for r, b in zip(rows, rank_of(rj)):
                    r["replay_rank"] = b
                rho = spearman(lj, rj)
            for r, a in zip(rows, rank_of(lj)):
                r["live_rank"] = a
            out["workloads"][name] = {"events": ev,
                                      "trace_bytes": trace.stat().st_size if ev is not None else None,
                                      "trace_duration_s": dur, "rho": rho, "live_self_rho": self_rho, "rows": rows}
            log(f"{name}: Spearman rho {_f(rho)} (live against live: {_f(self_rho)}) over {len(rows)} policies")
    return out


def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def render(res: dict) -> str:
    lines = [f"# Replay predicts the live program ({res['date']})", "",
             f"J = cores + {res['lambda']} x GiB resident (lower is better); live runs of {res['seconds']:g} s, "
             f"traces of {res['capture_seconds']:g} s "
             f"(median of {res['live_repeat']}), replays median of {res['repeat']}; {res['nproc']} CPUs, "
             f"load {res['loadavg_start'][0]:.1f} at start. \"live vs live\": the first live run of each "
             f"policy ranked against the second, the most any prediction can reach here.", "",
             "| workload | events | policies | Spearman rho (replay vs live) | live vs live | target 0.8 |",
             "|---|---:|---:|---:|---:|---|"]
    for w, r in res["workloads"].items():
        met = "-" if r["rho"] is None else ("met" if r["rho"] >= TARGET else "NOT met")
        lines.append(f"| {w} | {_f(r['events'], '{:,}')} | {len(r['rows'])} | {_f(r['rho'])} | "
                     f"{_f(r['live_self_rho'])} | {met} |")
    for w, r in res["workloads"].items():
        lines += ["", f"## {w}", "", "| policy | live J (runs) | live rank | replay J | replay rank |",
                  "|---|---:|---:|---:|---:|"]
        for row in r["rows"]:
            runs = ", ".join(f"{c:.5f}" for c in row["live_J_runs"])
            lines.append(f"| {row['policy']} | {row['live_J']:.5f} ({runs}) | {row['live_rank']} | "
                         f"{_f(row.get('replay_J'), '{:.5f}')} | {_f(row.get('replay_rank'), '{}')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
