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

and the two rankings are compared by Spearman's rho (target: >= 0.8).

Ranks at each side's resolution. Several policies of the grid cost a program
the same (a cache cap it never fills): their live order changes from one
run to the next, and no prediction can match it. So each side's ranking is
taken at the resolution its own runs show: policies sorted by median J; a
tier starts at its cheapest policy, and a later policy whose runs'
interquartile range reaches down to that policy's upper quartile joins it;
policies of one tier share the average rank. Live runs are interleaved
(each policy once, then each again). The target is on rho over those tier ranks; the plain rho (every
policy its own rank) and the ceiling (live run 1 against live run 2, plain)
are reported beside it. A workload whose live runs all fall into one tier
has no ranking to predict: it is reported, the target not applied. (Two
tiers are a ranking: which policies cost more, which less.)

The objective is the bench-learn one, cores plus a price of memory:

  live    J = D_ref / X + lambda * peak RSS / GiB   (bench-learn workloads:
          X = ops per busy CPU-second, D_ref = the default run's ops per
          wall second; a real program: its CPU seconds / the default's wall
          seconds)
  replay  J = CPU seconds of the replay / the trace's duration + lambda *
          the replay's peak RSS above its RSS before the first event (hakmem-replay reports it so) / GiB
          (the median of the repeats)

with lambda = bench/learn.py's LAMBDA. Workloads: the three of `make
bench-learn` (bench/learn_workload.c: burst, idle-threads, phases) and two
real programs: python3 (Debian's, PYTHONMALLOC=malloc, building and pruning
dicts of strings and tuples) and sqlite3 (a fixed SQL script, in memory).
Real programs run --real-repeat times live (default 7): they are short and
noisier than the synthetic workloads.

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

# bench/learn.py's grid, as environment knobs. The allocator refuses an
# environment value past the knob's greatest bound in any class (it warns and
# keeps the default), and fits one within it to each class's own bounds; so
# "max" is that greatest bound, from the layout (_layout: TCACHE_CAP_MAX,
# WARM_SLABS_MAX). live() fails a run whose allocator warned about an option.
from hakmem import _layout as _L  # noqa: E402

CAP_MAX, WARM_MAX = _L.TCACHE_CAP_MAX, _L.WARM_SLABS_MAX
GRID = [
    ("default", {}),
    ("cap=max", {"HAKMEM_TCACHE_CAP": CAP_MAX}),
    ("cap=32", {"HAKMEM_TCACHE_CAP": 32}),
    ("cap=4", {"HAKMEM_TCACHE_CAP": 4}),
    ("cap=4 drain=100", {"HAKMEM_TCACHE_CAP": 4, "HAKMEM_DRAIN_MS": 100}),
    ("warm=max", {"HAKMEM_WARM_SLABS": WARM_MAX}),
    ("warm=0", {"HAKMEM_WARM_SLABS": 0}),
    ("cap=4 warm=max", {"HAKMEM_TCACHE_CAP": 4, "HAKMEM_WARM_SLABS": WARM_MAX}),
    ("cap=max warm=max", {"HAKMEM_TCACHE_CAP": CAP_MAX, "HAKMEM_WARM_SLABS": WARM_MAX}),
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


# CPython with PYTHONMALLOC=malloc: every object, small ones included, from
# the preloaded allocator (as deployments that preload an allocator for
# CPython run it), so the allocator's policy moves the program's cost by
# more than this machine's run-to-run noise.
PY_SCRIPT = """
import random
r = random.Random(42)
d = {}
total = 0
for rnd in range(8):
    rows = [(i, "x" * r.randrange(0, 600), [r.random() for _ in range(r.randrange(1, 12))]) for i in range(40000)]
    for i, s, l in rows:
        d[f"k{r.randrange(60000)}"] = (s, tuple(l))
    for k in list(d)[::3]:
        del d[k]
    total += sum(len(v[0]) for v in d.values())
print(total, len(d))
"""

WORKLOADS = ("burst", "idle-threads", "phases", "sqlite3", "python3")
REAL = ("sqlite3", "python3")


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
    if not (va and vb):
        return float("nan")
    # Rounding can carry a perfect correlation a hair past 1 (seen in CI:
    # 1.0000000000000002 over tied ranks); rho is in [-1, 1] by definition.
    return max(-1.0, min(1.0, cov / (va * vb)))


def _iqr(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    if len(xs) < 3:
        return xs[0], xs[-1]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def tiers(medians: list[float], runs: list[list[float]]) -> list[int]:
    """Each policy's tier (0 = cheapest). Sorted by median, a tier starts at
    its cheapest policy; a later policy joins it while that policy's runs'
    interquartile range reaches down to the first one's upper quartile, and
    starts the next tier when it lies wholly above it. (Measured against the
    tier's first policy, not its last: one noisy policy cannot chain the whole
    grid into one tier.)"""
    order = sorted(range(len(medians)), key=lambda i: medians[i])
    out = [0] * len(medians)
    tier, top = 0, None
    for i in order:
        lo, hi = _iqr(runs[i])
        if top is None:
            top = hi
        elif lo > top:
            tier, top = tier + 1, hi
        out[i] = tier
    return out


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
    """argv, stdin text, extra environment of a workload."""
    if name in REAL:
        # Debian's own binary: a wrapper found first on PATH (pyenv's shim is a
        # shell script) would run, and trace, other processes first.
        exe = f"/usr/bin/{name}" if os.access(f"/usr/bin/{name}", os.X_OK) else shutil.which(name)
        if not exe:
            raise SetupError(f"{name} is not installed (make deps)")
        if name == "sqlite3":
            # In memory: the file's fsyncs would add the disk's noise to every run.
            return [exe, ":memory:"], sql_script(), {}
        return [exe, "-c", PY_SCRIPT], None, {"PYTHONMALLOC": "malloc"}
    return [str(WORKLOAD), name, f"{seconds:g}", "42"], None, {}


def live(name: str, knobs: dict, seconds: float, work: Path, trace: Path | None = None) -> dict:
    argv, stdin, extra = workload_argv(name, seconds, work)
    env = clean_env(LD_PRELOAD=str(LIB), **extra, **knobs)
    if trace is not None:
        env["HAKMEM_TRACE"] = str(trace)
    r = run_one(argv, env, stdin)
    if r["rc"] != 0:
        raise SetupError(f"{name} exited {r['rc']}: {r['err'].strip().splitlines()[-1:] or ''}")
    warned = [ln for ln in r["err"].splitlines() if ln.startswith("hakmem:")]
    if warned:
        # A refused knob runs the default under the grid point's name (how
        # warm=max once ranked as the default did).
        raise SetupError(f"{name} under {knobs}: the allocator said: {warned[0]}")
    m = {"wall_s": r["wall_s"], "cpu_s": r["cpu_s"], "peak_rss_bytes": r["peak_rss_bytes"]}
    if name not in REAL:
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
    ap.add_argument("--real-repeat", type=int, default=None,
                    help="live runs per policy of a real program, median (default 7, --quick 2)")
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
    real_repeat = a.real_repeat or (2 if a.quick else 7)
    grid = [g for g in GRID if not a.quick or g[0] in QUICK_GRID]
    names = [w for w in a.workloads.split(",") if w]
    try:
        for n in names:
            if n not in WORKLOADS:
                raise SetupError(f"unknown workload {n!r} (one of {', '.join(WORKLOADS)})")
        for p, how in ((LIB, "make lib"), (WORKLOAD, "make bench-learn"), (REPLAYER, "make")):
            if not p.exists() and not (a.live_only and p == REPLAYER):
                raise SetupError(f"{p} missing: run `{how}` (BUILD={BUILD.name})")
        if a.live_only and min(live_repeat, real_repeat) < 2:
            raise SetupError("--live-only compares live runs: --live-repeat and --real-repeat must be at least 2")
        result = run(names, grid, seconds, repeat, live_repeat, a.live_only, a.capture_seconds, real_repeat)
    except SetupError as e:
        print(f"replay_predict: error: {e}", file=sys.stderr)
        return 1
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "replay_predict.json").write_text(json.dumps(result, indent=1) + "\n")
    md = render(result)
    (a.out / "replay_predict.md").write_text(md)
    print(md)
    bad = [w for w, r in result["workloads"].items() if verdict(r) == "NOT met"]
    return 1 if a.strict and bad else 0


def run(names, grid, seconds, repeat, live_repeat, live_only=False, capture_s=1.0, real_repeat=7) -> dict:
    from hakmem import trace as T
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "lambda": LAMBDA, "seconds": seconds, "capture_seconds": capture_s, "repeat": repeat,
           "live_repeat": live_repeat, "real_repeat": real_repeat,
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
            n_live = real_repeat if name in REAL else live_repeat
            # Interleaved (every policy once, then again): a slow spell of the
            # machine lands on every policy's runs alike, not on one policy's.
            runs = {label: [] for label, _ in grid}
            for _ in range(n_live):
                for label, knobs in grid:
                    runs[label].append(live(name, knobs, seconds, work))
            for label, knobs in grid:
                ms = runs[label]
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
                log(f"{name}: {row['policy']}: live J {row['live_J']:.5f}")
            if not live_only:
                # Replays interleaved too: one run of every policy, then the next.
                for k in range(repeat):
                    log(f"{name}: replaying every policy ({k + 1} of {repeat})")
                    for row in rows:
                        res = replay(trace, row["env"], class_size, 1, work)
                        row["replay_policy"] = res["policy"]
                        row.setdefault("replay_runs", []).extend(res["runs"])
                for row in rows:
                    row["replay_J"], row["replay_J_runs"] = replay_cost({"runs": row["replay_runs"]}, dur)
                    row["replay_ops"] = [run.get("ops") for run in row["replay_runs"]]
            lj = [r["live_J"] for r in rows]
            # The noise ceiling: the first live run of each policy against the second.
            self_rho = (spearman([r["live_J_runs"][0] for r in rows], [r["live_J_runs"][1] for r in rows])
                        if n_live >= 2 else None)
            rho = rho_tiers = None
            live_tiers = tiers(lj, [r["live_J_runs"] for r in rows])
            if not live_only:
                rj = [r["replay_J"] for r in rows]
                replay_tiers = tiers(rj, [r["replay_J_runs"] for r in rows])
                for r, b, t in zip(rows, rank_of(rj), replay_tiers):
                    r["replay_rank"], r["replay_tier"] = b, t
                rho = spearman(lj, rj)
                rho_tiers = spearman(live_tiers, replay_tiers)
            for r, a, t in zip(rows, rank_of(lj), live_tiers):
                r["live_rank"], r["live_tier"] = a, t
            out["workloads"][name] = {"events": ev,
                                      "trace_bytes": trace.stat().st_size if ev is not None else None,
                                      "trace_duration_s": dur, "rho": rho, "rho_tiers": rho_tiers,
                                      "live_tiers": max(live_tiers) + 1, "live_self_rho": self_rho,
                                      "live_repeat": n_live, "rows": rows}
            log(f"{name}: Spearman rho over tiers {_f(rho_tiers)}, plain {_f(rho)} (live against live: "
                f"{_f(self_rho)}) over {len(rows)} policies, {max(live_tiers) + 1} live tiers")
    return out


def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def verdict(r: dict) -> str:
    if r["rho_tiers"] is None:
        return "-"
    if r["live_tiers"] < 2:
        return "no ranking live (1 tier)"
    return "met" if r["rho_tiers"] >= TARGET else "NOT met"


def render(res: dict) -> str:
    lines = [f"# Replay predicts the live program ({res['date']})", "",
             f"J = cores + {res['lambda']} x GiB resident (lower is better); live runs of {res['seconds']:g} s "
             f"(median of {res['live_repeat']}; real programs: their own length, median of "
             f"{res.get('real_repeat', res['live_repeat'])}), traces of {res['capture_seconds']:g} s, replays "
             f"median of {res['repeat']}; {res['nproc']} CPUs, load {res['loadavg_start'][0]:.1f} at start. "
             f"\"rho over tiers\": each side ranked at the resolution of its own runs (policies whose "
             f"runs' interquartile ranges overlap share a tier and its rank); \"live vs live\": the first "
             f"live run of each policy ranked against the second, plain.", "",
             "| workload | events | live tiers | rho over tiers (target) | rho, plain | live vs live | target 0.8 |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for w, r in res["workloads"].items():
        lines.append(f"| {w} | {_f(r['events'], '{:,}')} | {r.get('live_tiers', '-')} | "
                     f"{_f(r.get('rho_tiers'))} | {_f(r['rho'])} | {_f(r['live_self_rho'])} | {verdict(r)} |")
    for w, r in res["workloads"].items():
        lines += ["", f"## {w}", "",
                  "| policy | live J (runs) | live rank (tier) | replay J (runs) | replay rank (tier) |",
                  "|---|---:|---:|---:|---:|"]
        for row in r["rows"]:
            runs = ", ".join(f"{c:.5f}" for c in row["live_J_runs"])
            rruns = ", ".join(f"{c:.5f}" for c in row.get("replay_J_runs", []))
            rep = "-" if row.get("replay_J") is None else f"{row['replay_J']:.5f} ({rruns})"
            rrank = "-" if row.get("replay_rank") is None else f"{row['replay_rank']} ({row['replay_tier']})"
            lines.append(f"| {row['policy']} | {row['live_J']:.5f} ({runs}) | {row['live_rank']} "
                         f"({row['live_tier']}) | {rep} | {rrank} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
