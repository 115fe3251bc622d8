#!/usr/bin/env python3
"""How many hakmem-learnd hosts can one PostgreSQL serve as their fleet?

For each fleet size N (--hosts, default 10, 100 and 1000) this starts a
PostgreSQL 15 of its own (learner/tests/pgcluster.py: initdb in a temporary
directory, run as the `postgres` account, a unix socket only, fsync off),
makes a database, migrates it as its owner (k = 3 hosts must agree, canary
fraction 0.1: FleetDB.migrate) and adds N hosts (FleetDB.add_host: each host
a database role of its own with a password, scram-sha-256, as in production;
nothing here uses SET ROLE or a superuser for the hosts' traffic). P worker
processes (--workers) then play the hosts: each holds one real connection
per host it plays, logged in as that host's role, and sends exactly what
learnd's fleet worker sends (fleet.FleetLink): FleetDB.push(epoch, rows,
class, version) with outbox rows made by fleet.outbox_evaluation, the
function learnd queues its evaluations with, and FleetDB.offers(class).
A worker sends one statement at a time, so P is the number of concurrent
clients; the other connections are idle, as learnd's are between turns.

The fleet's state is a realistic one, made by the hosts' own pushes:
8 hosts in 10 are of class c2-m16 (30 programs), one in 10 each of c4-m32
and c16-m64 (6 programs each). A host runs about 4 in 5 of its class's
programs; each program has 4 candidate policies, which a host's own search
measured against its default with a verdict (better / within / worse,
either way round: the candidate against the default or the default against
the candidate) drawn from the candidate's kind: "good" (mostly better),
"mixed", "bad" (mostly worse) and "rare" (measured by 2 hosts only, fewer
than k). Once every host pushed its verdicts, each host pulls its offers
and, where it is a canary of a policy, pushes its fleet trial of it: kept
(within) for 2 programs in 5, rolled back (worse) for 1 in 5, none yet for
the rest. So some policies are offered, some are at their canary stage,
some were stopped and most stay evidence; the standing is printed.

Then, per N:

  connect   every host's connection made (scram login as its role) and an
            empty push (its class known), before anything is measured
  warm-up   one push per host and a few pulls per worker, not measured
  load      --seconds (default 20): every worker pushes batches of --batch
            evaluations (default 10; 3 in 10 of them verdicts of the host's
            own search, measured again, the rest plain measurements, and
            every 10th batch one best-policy row) as fast as the database
            takes them, cycling through its hosts with increasing seq under
            each host's epoch, and times one offers() pull every
            --pull-every pushes (default 10) as a host of c2-m16 (the class
            with the most programs) where it plays one
  idle      then --idle-pulls (default 50) pulls one after the other from one
            worker, nothing else running: the pull's latency on a database
            at rest

Reported per N: evaluations per second the database took (new evaluation
rows, as push() counts them), pushes per second, the push latency, the pull
latency under load (median, p95, p99, count) and at rest (median, p95), the
offers a pull returned, the standing (stages of the policies), the
statements the server logged as slow (log_min_duration_statement) and any
statement that failed (statement_timeout is learnd's 5 s, as in
production). For scale: learnd pulls every 5 s (fleet_pull), so N hosts
pull N/5 times a second.

The PostgreSQL settings chosen (max_connections: the largest N plus 50,
shared_buffers 256MB, WAL and checkpoints large enough that no checkpoint
falls into a measurement, slow statements logged) are printed with the
values the server runs with, pgcluster.py's fixed ones (fsync,
synchronous_commit and full_page_writes off) among them; --set NAME=VALUE
adds or overrides one.

    .venv/bin/python bench/fleet.py [--hosts 10,100,1000] [--workers 8] [--seconds 20] [--json]

Needs root (PostgreSQL runs as the `postgres` account; install it with
tools/install-deps.sh postgresql) and psycopg 3 (`make venv`). Progress on
stderr, the table (or --json) on stdout; the cluster and the workers are
stopped at the end, on an error or on Ctrl-C.

Exit status: 0 when every run completed and no host statement failed, 1
otherwise (the figures are printed all the same), 2 on bad arguments."""
from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import pwd
import queue
import random
import re
import resource
import signal
import sys
import time
import types
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "learner" / "tests"))
sys.path.insert(0, str(ROOT / "learner"))
from pgcluster import PG_BIN, Cluster  # noqa: E402  the tests' private cluster
from hakmem import fleet as F  # noqa: E402
from hakmem import knobs as K  # noqa: E402

CLASS = "c2-m16"                          # the fleet's main class: most hosts, most programs
OTHER_CLASSES = ("c4-m32", "c16-m64")     # one host in 10 each
PROGRAMS = {CLASS: 30, "c4-m32": 6, "c16-m64": 6}
KINDS = ("good", "mixed", "bad", "rare")  # a program's candidate policies
# P(better), P(within) of a host's own A/B of a candidate against its default (the rest: worse)
ODDS = {"good": (0.8, 0.15), "mixed": (0.4, 0.2), "bad": (0.05, 0.35), "rare": (0.9, 0.1)}
RUNS_P, EVAL_P, RARE_HOSTS = 0.8, 0.8, 2  # a host runs a program / measured a candidate; "rare": 2 hosts
CANARY_OUTCOME = ("keep", "none", "keep", "none", "rollback")   # by program index mod 5
VERDICT_SHARE = 0.3                        # of a load batch's evaluations: verdicts; the rest plain measurements
BEST_EVERY = 10                            # one best-policy row every this many load batches
K_AGREE, CANARY = 3, 0.1                   # FleetDB.migrate(k=3, canary=0.1)
VERSION = "bench-fleet"
OBJECTIVE = "time + 0.5/GiB"               # objective.Objective.describe() of learnd's default
LEARNER = "gp"
EXES = ("postgres", "redis-server", "python3", "nginx", "node", "java", "mysqld", "memcached", "envoy", "haproxy",
        "php-fpm", "ruby", "perl", "sqlite3", "git", "gcc", "clang", "jq", "rustc", "mongod", "etcd", "varnishd",
        "squid", "unbound", "influxd", "beam.smp", "dotnet", "ffmpeg", "rg", "make")
FIXED = ("fsync=off", "synchronous_commit=off", "full_page_writes=off")   # pgcluster.py's
SHOWN = ("max_connections", "superuser_reserved_connections", "shared_buffers", "work_mem", "effective_cache_size",
         "max_wal_size", "checkpoint_timeout", "fsync", "synchronous_commit", "full_page_writes", "wal_level", "jit",
         "autovacuum", "password_encryption", "log_min_duration_statement", "max_worker_processes")
PULL_DEMAND_S = 5.0                        # config.py fleet_pull: learnd pulls every 5 s


class BenchError(Exception):
    """The benchmark cannot go on, with the reason in one line."""


def say(msg: str) -> None:
    print(f"fleet: {msg}", file=sys.stderr, flush=True)


# ---- the fleet's programs and policies --------------------------------------------------
def _rule(rules, size: int, slab: int) -> int:
    """A knob's default for a class of `size`-byte blocks (the layout's default rules)."""
    for r in rules:
        if r.get("size_max") is None or size <= r["size_max"]:
            per = size if r["per"] == "block" else slab
            return max(int(r["lo"]), min(int(r["worth"]) // max(per, 1), int(r["hi"])))
    return 0


def default_knobs() -> dict:
    """The allocator's default policy for its default class table (what a
    ring header publishes as the policy in force before learnd changes it)."""
    from hakmem.trace import default_class_sizes
    sizes = default_class_sizes()
    cap, warm = [0], [0]
    for s in sizes[1:]:
        cap.append(_rule(K.SPEC["tcache_cap"]["default"], s, s))
        warm.append(_rule(K.SPEC["warm_slabs"]["default"], s, K.slab_bytes(s)))
    batch = [0] + [K.default_batch(c) for c in cap[1:]]
    return K.Knobs({"drain_ms": K.SPEC["drain_ms"]["default"], "tcache_cap": cap, "tcache_batch": batch,
                    "warm_slabs": warm}).to_dict()


def candidates(p: int, default: dict) -> list[dict]:
    """Four policies a search could find for program p, one per KINDS."""
    def cap_times(k, classes, f):
        k["tcache_cap"] = list(k["tcache_cap"])
        k["tcache_batch"] = list(k["tcache_batch"])
        for c in classes:
            k["tcache_cap"][c] = min(4096, max(1, int(k["tcache_cap"][c] * f)))
            k["tcache_batch"][c] = K.default_batch(k["tcache_cap"][c])
        return k
    good = cap_times(dict(default), range(1, 5 + p % 5), 2 + p % 3)
    mixed = dict(default, drain_ms=100 + 50 * (p % 7))
    mixed["warm_slabs"] = [w // 2 if 9 <= c <= 24 else w for c, w in enumerate(default["warm_slabs"])]
    bad = dict(default, warm_slabs=[0] * len(default["warm_slabs"]), drain_ms=10 + p % 9)
    rare = cap_times(dict(default, drain_ms=5000 + 100 * p), range(9, 21), 4)
    return [K.Knobs(k).to_dict() for k in (good, mixed, bad, rare)]


def make_programs() -> list[dict]:
    default = default_knobs()
    out = []
    for klass, n in PROGRAMS.items():
        for i in range(n):
            p = len(out)
            build = uuid.UUID(int=random.Random(f"build:{p}").getrandbits(128)).hex + \
                uuid.UUID(int=random.Random(f"build2:{p}").getrandbits(128)).hex[:8]
            out.append({"p": p, "klass": klass,
                        "ident": F.program_ident(f"/usr/bin/{EXES[i % len(EXES)]}", build, "0" if i % 4 else "1000"),
                        "scale": 0.5 + 0.3 * (p % 7), "default": default, "cands": candidates(p, default)})
    return out


def host_class(h: int) -> str:
    return OTHER_CLASSES[h % 10 - 8] if h % 10 >= 8 else CLASS


def host_name(h: int) -> str:
    return f"h{h:04d}"


def runs(h: int, p: int) -> bool:
    return random.Random(f"runs:{h}:{p}").random() < RUNS_P


def rare_hosts(g: dict, n_hosts: int) -> list[int]:
    """The hosts whose search measured program g's "rare" candidate: the
    first RARE_HOSTS of its class that run it."""
    out = []
    for x in range(n_hosts):
        if len(out) == RARE_HOSTS:
            break
        if host_class(x) == g["klass"] and runs(x, g["p"]):
            out.append(x)
    return out


def measured(h: int, g: dict, c: int) -> bool:
    """Whether host h's own search measured candidate c of program g."""
    if host_class(h) != g["klass"] or not runs(h, g["p"]):
        return False
    if KINDS[c] == "rare":
        return h in g["rare_hosts"]
    return random.Random(f"eval:{h}:{g['p']}:{c}").random() < EVAL_P


def outcome(h: int, p: int, c: int) -> tuple[str, float, bool]:
    """(vs_default, cost ratio, measured the default against the candidate)."""
    r = random.Random(f"verdict:{h}:{p}:{c}")
    u = r.random()
    better, within = ODDS[KINDS[c]]
    vs = "better" if u < better else "within" if u < better + within else "worse"
    rel = {"better": r.uniform(0.82, 0.96), "within": r.uniform(0.985, 1.015), "worse": r.uniform(1.05, 1.25)}[vs]
    return vs, rel, r.random() < 0.25


# ---- a worker: the hosts it plays ------------------------------------------------------
VERDICT = {side: {vs: v for v, vs in m.items()} for side, m in F.VERDICT_VS_DEFAULT.items()}


class Host:
    """One simulated learnd host: its connection, epoch, outbox seq and
    what its own search measured."""

    def __init__(self, h, url, programs, rng):
        self.h, self.name, self.klass, self.url = h, host_name(h), host_class(h), url
        self.db: F.FleetDB | None = None
        self.epoch = uuid.uuid4().hex
        self.seq = 0
        self.rng = rng
        self.programs = [g for g in programs if g["klass"] == self.klass and runs(h, g["p"])] or \
            [next(g for g in programs if g["klass"] == self.klass)]
        self.local = []           # (program, candidate) its own search measured
        self.in_force = {}        # program index -> the policy it runs
        for g in self.programs:
            self.in_force[g["p"]] = g["default"]
            for c in range(len(KINDS)):
                if measured(h, g, c):
                    self.local.append((g, c))
                    if KINDS[c] == "good" and outcome(h, g["p"], c)[0] == "better":
                        self.in_force[g["p"]] = g["cands"][c]
        self._tpl = {}

    def connect(self):
        self.db = F.FleetDB(self.url)

    def _body(self, g, knobs, baseline, verdict, cost, base_cost, source, windows):
        now = time.time()
        ev = types.SimpleNamespace(knobs=knobs, baseline_knobs=baseline, verdict=verdict, windows=windows,
                                   cost_mean=cost, cost_sd=cost * 0.02, baseline_cost=base_cost,
                                   t_start=now - 5.0 * windows, t_end=now)
        return F.outbox_evaluation(g["ident"], ev, g["default"], source, LEARNER, OBJECTIVE)

    def verdict_body(self, g, c, source="local", vs=None):
        """An A/B of candidate c against the default, as learnd queues it:
        the outcome this host's search had (vs for a fleet trial)."""
        key = (g["p"], c, source, vs)
        tpl = self._tpl.get(key)
        if tpl is None:
            o_vs, rel, flipped = outcome(self.h, g["p"], c)
            vs = vs or o_vs
            if source == "fleet":
                rel, flipped = {"better": 0.93, "within": 1.0, "worse": 1.12}[vs], False
            d_cost = g["scale"] * (0.9 + 0.2 * random.Random(f"cost:{self.h}:{g['p']}").random())
            cand = g["cands"][c]
            if flipped:      # the default measured against the candidate (the baseline)
                tpl = self._body(g, g["default"], cand, VERDICT["default"][vs], d_cost, d_cost * rel, source, 16)
            else:
                tpl = self._body(g, cand, g["default"], VERDICT["candidate"][vs], d_cost * rel, d_cost, source, 16)
            tpl["knobs"], tpl["baseline_knobs"] = (g["default"], cand) if flipped else (cand, g["default"])
            if tpl["vs_default"] is not None:
                tpl["vs_default"]["knobs"] = cand      # one object per policy, not one per body
            self._tpl[key] = tpl
        now = time.time()
        return dict(tpl, t_start=now - 80.0, t_end=now)

    def measurement_body(self, g):
        knobs = self.in_force[g["p"]]
        key = (g["p"], "measured")
        tpl = self._tpl.get(key)
        if tpl is None:
            tpl = self._body(g, knobs, None, "measured", g["scale"], None, "local", 1)
            tpl["knobs"] = knobs
            self._tpl[key] = tpl
        now = time.time()
        return dict(tpl, cost_mean=g["scale"] * self.rng.uniform(0.9, 1.1), t_start=now - 5.0, t_end=now)

    def best_row(self, g):
        knobs = self.in_force[g["p"]]
        return {"program": g["ident"], "knobs": knobs, "origin": "default" if knobs is g["default"] else "learned",
                "t": time.time()}

    def rows(self, bodies):
        out = []
        for kind, body in bodies:
            self.seq += 1
            out.append((self.seq, kind, body))
        return out

    def load_batch(self, n, best):
        bodies = []
        for _ in range(n):
            if self.local and self.rng.random() < VERDICT_SHARE:
                g, c = self.rng.choice(self.local)
                bodies.append(("evaluation", self.verdict_body(g, c)))
            else:
                bodies.append(("evaluation", self.measurement_body(self.rng.choice(self.programs))))
        if best:
            bodies.append(("best", self.best_row(self.rng.choice(self.programs))))
        return self.rows(bodies)

    def push(self, rows):
        return self.db.push(self.epoch, rows, self.klass, VERSION)

    def pull(self):
        return self.db.offers(self.klass)


def _raise_nofile():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass


def worker_main(wid, hosts, programs, cfg, ctl, res):
    """A worker process: plays `hosts` [(h, url)], one command at a time
    from ctl, each answered on res as (wid, command, result)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)       # the main process stops us
    _raise_nofile()
    F._psycopg()          # imported now: the first connection's time is the login's, not the import's
    rng = random.Random(f"worker:{wid}")
    sims = [Host(h, url, programs, random.Random(f"host:{h}")) for h, url in hosts]
    pullers = [s for s in sims if s.klass == CLASS] or sims
    by_build = {g["ident"]["build_id"]: g for g in programs}
    while True:
        cmd = ctl.get()
        if cmd is None or cmd[0] == "close":
            break
        try:
            res.put((wid, cmd[0], _command(cmd, sims, pullers, by_build, rng, cfg)))
        except F.FleetError as e:
            res.put((wid, "error", f"{cmd[0]}: {e}"))
        except Exception as e:     # a bug: said in one line, the main process stops
            res.put((wid, "error", f"{cmd[0]}: internal error: {type(e).__name__}: {e}"))
    for s in sims:
        if s.db is not None:
            s.db.close()


def _command(cmd, sims, pullers, by_build, rng, cfg):
    what = cmd[0]
    if what == "connect":
        took = []
        for s in sims:
            t = time.perf_counter()
            s.connect()
            took.append((time.perf_counter() - t) * 1e3)
            s.push([])           # as FleetLink's first push: the host's class known
        return {"connect_ms": took}
    if what == "seed":
        # Each host's backlog of its own search's verdicts and its best
        # policies, in outbox batches (fleet.BATCH rows a push, as learnd).
        new = rows = 0
        errors = collections.Counter()
        for s in sims:
            bodies = [("evaluation", s.verdict_body(g, c)) for g, c in s.local]
            bodies += [("best", s.best_row(g)) for g in s.programs]
            outbox = s.rows(bodies)
            for i in range(0, len(outbox), F.BATCH):
                new += _push_seed(s, outbox[i:i + F.BATCH], cfg["batch"], errors)
            rows += len(outbox)
        return {"rows": rows, "new": new, "errors": dict(errors)}
    if what == "canary":
        # A host that is a canary of a policy tries it and pushes its trial.
        trials, errors = collections.Counter(), collections.Counter()
        for s in sims:
            bodies = []
            try:
                offers = s.pull()
            except F.FleetError as e:      # a pull over learnd's statement_timeout, say: counted, not fatal
                errors[f"pull: {e}"[:160]] += 1
                _reconnect(s)
                continue
            for (build, _exe, _users), offer in offers.items():
                if offer.stage != "canary":
                    continue
                g = by_build[build]
                c = next((i for i, k in enumerate(g["cands"]) if k == offer.knobs), None)
                outcome = CANARY_OUTCOME[g["p"] % len(CANARY_OUTCOME)]
                if c is None or outcome == "none":
                    continue
                vs = "within" if outcome == "keep" else "worse"
                bodies.append(("evaluation", s.verdict_body(g, c, source="fleet", vs=vs)))
                trials[outcome] += 1
            if bodies:
                _push_seed(s, s.rows(bodies), 1, errors)
        return {"trials": dict(trials), "errors": dict(errors)}
    if what == "warm":
        errors = collections.Counter()
        for s in sims:
            try:
                s.push(s.load_batch(cfg["batch"], best=False))
            except F.FleetError as e:
                errors[f"push: {e}"[:160]] += 1
                _reconnect(s)
        for s in pullers[:3]:
            try:
                s.pull()
            except F.FleetError as e:
                errors[f"pull: {e}"[:160]] += 1
                _reconnect(s)
        return {"errors": dict(errors)}
    if what == "run":
        t0, seconds = cmd[1], cmd[2]
        return _run(sims, pullers, rng, cfg, t0, t0 + seconds)
    if what == "idle":
        ms, offers, errors = [], [], collections.Counter()
        for i in range(cmd[1]):
            s = pullers[i % len(pullers)]
            t = time.perf_counter()
            try:
                got = s.pull()
            except F.FleetError as e:
                errors[f"pull: {e}"[:160]] += 1
                _reconnect(s)
                continue
            ms.append((time.perf_counter() - t) * 1e3)
            offers.append(len(got))
        return {"pull_ms": ms, "offers": offers, "errors": dict(errors)}
    raise BenchError(f"unknown command {what!r}")


def _push_seed(s, rows, small, errors):
    """A seed batch pushed; if the database refuses it (a statement over
    learnd's timeout, say), counted and sent again in batches of `small`
    rows (the same seqs: what went in before counts once), each tried twice."""
    try:
        return s.push(rows)
    except F.FleetError as e:
        errors[f"push of {len(rows)} rows: {e}"[:160]] += 1
        _reconnect(s)
    new = 0
    for i in range(0, len(rows), small):
        try:
            new += s.push(rows[i:i + small])
        except F.FleetError as e:
            errors[f"push of {len(rows[i:i + small])} rows: {e}"[:160]] += 1
            _reconnect(s)
            new += s.push(rows[i:i + small])
    return new


def _run(sims, pullers, rng, cfg, t0, deadline):
    push_ms, pull_ms, offers = [], [], []
    pushes = new = rows = 0
    errors = collections.Counter()
    while time.monotonic() < t0:
        time.sleep(0.001)
    i = 0
    while time.monotonic() < deadline:
        s = sims[i % len(sims)]
        i += 1
        batch = s.load_batch(cfg["batch"], best=(i % BEST_EVERY == 0))
        t = time.perf_counter()
        try:
            new += s.push(batch)
            push_ms.append((time.perf_counter() - t) * 1e3)
            pushes += 1
            rows += len(batch)
        except F.FleetError as e:
            errors[f"push: {e}"[:160]] += 1
            _reconnect(s)
        if i % cfg["pull_every"] == 0:
            p = rng.choice(pullers)
            t = time.perf_counter()
            try:
                got = p.pull()
                pull_ms.append((time.perf_counter() - t) * 1e3)
                offers.append(len(got))
                p.db.settle()        # what learnd's worker does after its pull (not the pull's latency)
            except F.FleetError as e:
                errors[f"pull: {e}"[:160]] += 1
                _reconnect(p)
    return {"pushes": pushes, "new": new, "rows": rows, "push_ms": push_ms, "pull_ms": pull_ms, "offers": offers,
            "errors": dict(errors), "end": time.monotonic()}


def _reconnect(s):
    """A broken connection is made again, as learnd's worker does."""
    if s.db is None or s.db.conn.closed or s.db.conn.broken:
        if s.db is not None:
            s.db.close()
        s.connect()


# ---- the main process ------------------------------------------------------------------
def pct(xs, q):
    """The q-th percentile (0..100) of xs, linear between ranks; None if empty."""
    if not xs:
        return None
    s = sorted(xs)
    x = (len(s) - 1) * q / 100.0
    lo = int(x)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (x - lo)


def summary(xs, qs=(50, 95, 99)) -> dict:
    out = {"count": len(xs)}
    for q in qs:
        v = pct(xs, q)
        out[f"p{q}"] = None if v is None else round(v, 3)
    if xs:
        out["max"] = round(max(xs), 3)
    return out


class Workers:
    """P worker processes and the phases they go through together."""

    def __init__(self, n_workers, host_urls, programs, cfg):
        ctx = mp.get_context("spawn")        # nothing of the parent's (its owner connection) is inherited
        self.res = ctx.Queue()
        self.ctls, self.procs = [], []
        for w in range(n_workers):
            ctl = ctx.Queue()
            mine = [(h, url) for h, url in host_urls if h % n_workers == w]
            p = ctx.Process(target=worker_main, args=(w, mine, programs, cfg, ctl, self.res),
                            name=f"fleet-worker-{w}", daemon=True)
            p.start()
            self.ctls.append(ctl)
            self.procs.append(p)

    def phase(self, cmd, timeout, only=None) -> list:
        who = range(len(self.procs)) if only is None else only
        for w in who:
            self.ctls[w].put(cmd)
        out, end = {}, time.monotonic() + timeout
        while len(out) < len(who):
            try:
                wid, what, r = self.res.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in self.procs if not p.is_alive()]
                if dead:
                    raise BenchError(f"worker {dead[0].name} exited ({dead[0].exitcode}) during {cmd[0]}")
                if time.monotonic() > end:
                    raise BenchError(f"{cmd[0]}: the workers did not finish in {timeout:.0f} s")
                continue
            if what == "error":
                raise BenchError(f"worker {wid}: {r}")
            out[wid] = r
        return [out[w] for w in who]

    def close(self, wait=10.0):
        """Each worker told to close its connections and exit; stopped if it
        has not within `wait` seconds (0: at once, on an error or Ctrl-C)."""
        for ctl in self.ctls:
            try:
                ctl.put(("close",))
            except (OSError, ValueError):
                pass
        end = time.monotonic() + wait
        for p in self.procs:
            p.join(max(0.0, end - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        self.procs = []


def pg_settings(a) -> list[str]:
    s = {"max_connections": str(max(a.hosts) + 50),     # every host a connection, the owner and margin
         "shared_buffers": "256MB",
         "max_wal_size": "8GB",                           # no checkpoint forced by WAL in a measurement
         "checkpoint_timeout": "30min",
         "log_min_duration_statement": str(a.slow_ms),   # the slow statements, counted from the log
         "log_line_prefix": "%m [%p] %u ",
         }
    for item in a.set:
        name, _, value = item.partition("=")
        s[name.strip()] = value.strip()
    return [f"{k}={v}" for k, v in s.items()]


def slow_statements(log: str, since: int) -> dict:
    """The statements the server logged as slower than log_min_duration_statement."""
    out = collections.Counter()
    ms = []
    for line in log[since:].splitlines():
        m = re.search(r"duration: ([0-9.]+) ms\s+(?:statement|execute [^:]*): (.*)", line)
        if m:
            ms.append(float(m.group(1)))
            out[re.sub(r"\s+", " ", m.group(2))[:120]] += 1
    return {"count": len(ms), "ms": summary(ms), "statements": dict(out.most_common(5))}


def run_size(a, ids, n, settings) -> dict:
    """One fleet of n hosts, from initdb to cleanup."""
    n_workers = min(a.workers, n)
    programs = make_programs()
    for g in programs:
        g["rare_hosts"] = rare_hosts(g, n)
    cluster = Cluster(ids, settings=settings)
    workers = owner = None
    done = False
    out = {"hosts": n, "workers": n_workers, "seconds": a.seconds, "batch": a.batch, "pull_every": a.pull_every}
    try:
        say(f"{n} hosts: initdb and start PostgreSQL in {cluster.dir}")
        cluster.initdb().start()
        admin = F.FleetDB(cluster.url())
        admin.conn.execute("CREATE DATABASE fleet")
        admin.close()
        owner = F.FleetDB(cluster.url(db="fleet"), statement_ms=600_000)
        owner.migrate(k=K_AGREE, canary=CANARY)
        out["pg"] = dict(owner.conn.execute("SELECT name, current_setting(name) FROM pg_settings "
                                            "WHERE name = ANY(%s) ORDER BY name",
                                            (list(SHOWN) + [s.split("=")[0] for s in settings],)).fetchall())
        out["pg_version"] = owner.conn.execute("SHOW server_version").fetchone()[0]
        t = time.monotonic()
        urls = []
        for h in range(n):
            pw = uuid.uuid4().hex
            role = owner.add_host(host_name(h), pw)
            urls.append((h, cluster.url(role, pw, db="fleet")))
        out["add_hosts_s"] = round(time.monotonic() - t, 3)
        say(f"{n} hosts: {n} host roles added in {out['add_hosts_s']:.2f} s; starting {n_workers} workers")
        cfg = {"batch": a.batch, "pull_every": a.pull_every}
        workers = Workers(n_workers, urls, programs, cfg)
        slack = 120 + n * 0.5

        t = time.monotonic()
        rs = workers.phase(("connect",), slack)
        conn_ms = [x for r in rs for x in r["connect_ms"]]
        out["connect"] = {"wall_s": round(time.monotonic() - t, 3), "ms": summary(conn_ms)}
        say(f"{n} hosts: {len(conn_ms)} host connections made (scram login) in {out['connect']['wall_s']:.1f} s, "
            f"{out['connect']['ms']['p50']:.1f} ms median each")

        t, log_at = time.monotonic(), len(cluster.text())
        rs = workers.phase(("seed",), slack + n * 2)
        errors = collections.Counter()
        for r in rs:
            errors.update(r["errors"])
        out["seed"] = {"rows": sum(r["rows"] for r in rs), "evaluations": sum(r["new"] for r in rs),
                       "wall_s": round(time.monotonic() - t, 3), "push_errors": dict(errors)}
        if errors:
            say(f"{n} hosts: {sum(errors.values())} seed pushes failed and were sent again in smaller batches: "
                + "; ".join(errors))
        # The standings the seed marked, recomputed now (the hosts' own pulls
        # and pushes would, a second later): the canaries then see them.
        owner.settle_all()
        rs = workers.phase(("canary",), slack + n * 2)
        trials, errors = collections.Counter(), collections.Counter()
        for r in rs:
            trials.update(r["trials"])
            errors.update(r["errors"])
        out["seed"]["canary_trials"] = dict(trials)
        out["seed"]["canary_errors"] = dict(errors)
        if errors:
            say(f"{n} hosts: {sum(errors.values())} canary-phase statements failed: " + "; ".join(errors))
        out["seed"]["wall_s"] = round(time.monotonic() - t, 3)
        owner.settle_all()
        out["standing_before"] = standing(owner)
        out["slow_seed"] = slow_statements(cluster.text(), log_at)
        say(f"{n} hosts: seeded {out['seed']['evaluations']} evaluations of the hosts' own searches and "
            f"{sum(trials.values())} canary trials in {out['seed']['wall_s']:.1f} s; standing: "
            + ", ".join(f"{k} {v}" for k, v in out["standing_before"].items()))

        rs = workers.phase(("warm",), slack)
        errors = collections.Counter()
        for r in rs:
            errors.update(r["errors"])
        out["warm_errors"] = dict(errors)
        if errors:
            say(f"{n} hosts: {sum(errors.values())} warm-up statements failed: " + "; ".join(errors))
        log_at = len(cluster.text())
        say(f"{n} hosts: warmed up; measuring {a.seconds:g} s of pushes (batches of {a.batch}) with a pull every "
            f"{a.pull_every} pushes, {n_workers} workers")
        t0 = time.monotonic() + 0.5
        rs = workers.phase(("run", t0, a.seconds), a.seconds + slack)
        elapsed = max(r["end"] for r in rs) - t0
        pushes = sum(r["pushes"] for r in rs)
        new = sum(r["new"] for r in rs)
        errors = collections.Counter()
        for r in rs:
            errors.update(r["errors"])
        pull_ms = [x for r in rs for x in r["pull_ms"]]
        out["load"] = {"elapsed_s": round(elapsed, 3), "pushes": pushes, "evaluations": new,
                       "rows": sum(r["rows"] for r in rs),
                       "evaluations_per_s": round(new / elapsed, 1), "pushes_per_s": round(pushes / elapsed, 1),
                       "pulls_per_s": round(len(pull_ms) / elapsed, 1),
                       "push_ms": summary([x for r in rs for x in r["push_ms"]]), "pull_ms": summary(pull_ms),
                       "offers_per_pull": summary([x for r in rs for x in r["offers"]], (50,)),
                       "errors": dict(errors)}
        out["slow_load"] = slow_statements(cluster.text(), log_at)
        L = out["load"]
        say(f"{n} hosts: {L['evaluations_per_s']:.0f} evaluations/s, {L['pushes_per_s']:.0f} pushes/s, "
            f"pull {fmt(L['pull_ms']['p50'])} ms median under load ({L['pull_ms']['count']} pulls)"
            + (f"; {sum(errors.values())} statements failed" if errors else ""))

        log_at = len(cluster.text())
        r, = workers.phase(("idle", a.idle_pulls), slack + a.idle_pulls * 10, only=[0])
        out["idle"] = {"pull_ms": summary(r["pull_ms"]), "offers_per_pull": summary(r["offers"], (50,)),
                       "errors": r["errors"]}
        out["slow_idle"] = slow_statements(cluster.text(), log_at)
        say(f"{n} hosts: idle pull {fmt(out['idle']['pull_ms']['p50'])} ms median ({a.idle_pulls} pulls)")

        st = owner.status()
        out["standing_after"] = standing(owner)
        out["database"] = {"programs": st["programs"], "evaluations": st["evaluations"],
                           "bytes": owner.conn.execute("SELECT pg_database_size('fleet')").fetchone()[0],
                           "verdicts": owner.conn.execute("SELECT count(*) FROM hakmem.verdicts").fetchone()[0]}
        out["pull_demand_per_s"] = n / PULL_DEMAND_S
        done = True
        return out
    finally:
        if workers is not None:
            workers.close(10.0 if done else 0.0)
        if owner is not None:
            owner.close()
        cluster.cleanup()


def standing(owner) -> dict:
    rows = owner.conn.execute("SELECT stage, count(*) FROM hakmem.standing GROUP BY stage").fetchall()
    d = dict(rows)
    return {k: d.get(k, 0) for k in ("offered", "canary", "stopped", "evidence")}


def fmt(v, w=0, d=1):
    return f"{'-':>{w}}" if v is None else f"{v:{w}.{d}f}"


def table(res) -> str:
    head = (f"{'hosts':>6} {'workers':>7} {'evals/s':>8} {'pushes/s':>8} {'push p50':>8} {'p95':>7} {'pulls':>6} "
            f"{'pull p50':>8} {'p95':>7} {'p99':>7} {'idle p50':>8} {'p95':>7}")
    lines = ["fleet database: simulated hakmem-learnd hosts pushing evaluations and pulling offers "
             "(latencies in ms: pushes and pulls under load, then pulls at rest)", head, "-" * len(head)]
    for r in res["runs"]:
        L, P, I = r["load"], r["load"]["pull_ms"], r["idle"]["pull_ms"]
        lines.append(f"{r['hosts']:>6} {r['workers']:>7} {L['evaluations_per_s']:>8.0f} {L['pushes_per_s']:>8.1f} "
                     f"{fmt(L['push_ms']['p50'], 8)} {fmt(L['push_ms']['p95'], 7)} {P['count']:>6} "
                     f"{fmt(P['p50'], 8)} {fmt(P['p95'], 7)} {fmt(P['p99'], 7)} {fmt(I['p50'], 8)} {fmt(I['p95'], 7)}")
    lines.append("")
    for r in res["runs"]:
        L, s = r["load"], r["standing_after"]
        lines.append(f"{r['hosts']} hosts: {r['database']['programs']} programs, {r['database']['verdicts']} "
                     f"verdicts, {r['database']['evaluations']} evaluations, "
                     f"{r['database']['bytes'] / 2**20:.0f} MiB; standing: offered {s['offered']}, canary "
                     f"{s['canary']}, stopped {s['stopped']}, evidence {s['evidence']}; "
                     f"{fmt(L['offers_per_pull']['p50'], d=0)} offers a pull; connect "
                     f"{fmt(r['connect']['ms']['p50'])} ms median per host; "
                     f"{L['evaluations_per_s'] * 60 / r['hosts']:.0f} evaluations per host per minute sustained; "
                     f"learnd's pulls would be {r['pull_demand_per_s']:g}/s, measured {L['pulls_per_s']:g}/s "
                     f"beside the pushes")
        for key, when in (("slow_seed", "seeding"), ("slow_load", "under load"), ("slow_idle", "at rest")):
            sl = r[key]
            if sl["count"]:
                top = "; ".join(f"{c}x {stmt}" for stmt, c in list(sl["statements"].items())[:3])
                lines.append(f"  slow statements {when} (>= {res['slow_ms']} ms): {sl['count']}, "
                             f"max {sl['ms']['max']:.0f} ms: {top}")
        for when, errors in (("under load", L["errors"]), ("seeding", r["seed"]["push_errors"]),
                             ("in the canary phase", r["seed"]["canary_errors"]), ("in the warm-up", r["warm_errors"]),
                             ("at rest", r["idle"]["errors"])):
            if errors:
                lines.append(f"  failed {when}: " + "; ".join(f"{c}x {e}" for e, c in errors.items()))
    lines.append("")
    lines.append("PostgreSQL " + res["runs"][0]["pg_version"] + ": " +
                 ", ".join(f"{k}={v}" for k, v in res["runs"][0]["pg"].items()))
    return "\n".join(lines)


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="bench/fleet.py", description=__doc__.split("\n\n")[0],
                                 epilog="Example: bench/fleet.py --hosts 10,100 --seconds 10 (as root). "
                                        "The measurement is described at the top of bench/fleet.py.")
    ap.add_argument("--hosts", default="10,100,1000", help="fleet sizes, comma-separated (default %(default)s)")
    ap.add_argument("--workers", type=int, default=8,
                    help="worker processes, each a client sending one statement at a time (default %(default)s)")
    ap.add_argument("--seconds", type=float, default=20.0, help="measured seconds per fleet size (default %(default)s)")
    ap.add_argument("--batch", type=int, default=10, help="evaluations per push (default %(default)s)")
    ap.add_argument("--pull-every", type=int, default=10,
                    help="a worker pulls once every this many pushes (default %(default)s)")
    ap.add_argument("--idle-pulls", type=int, default=50,
                    help="pulls timed one after the other on the idle database (default %(default)s)")
    ap.add_argument("--slow-ms", type=int, default=250,
                    help="log_min_duration_statement: slower statements are counted (default %(default)s)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="one more PostgreSQL setting, or another value for one of ours (repeatable)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON instead of the table")
    a = ap.parse_args(argv)
    try:
        a.hosts = [int(x) for x in a.hosts.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--hosts {a.hosts!r}: comma-separated numbers of hosts")
    if not a.hosts or min(a.hosts) < 1 or max(a.hosts) > 9999:
        ap.error("--hosts: between 1 and 9999 hosts each")
    if a.workers < 1 or a.seconds <= 0 or a.batch < 1 or a.pull_every < 1 or a.idle_pulls < 1 or a.slow_ms < 0:
        ap.error("--workers, --batch, --pull-every and --idle-pulls must be ≥ 1, --seconds > 0, --slow-ms ≥ 0")
    for s in a.set:
        if not re.match(r"^[a-z_.]+=\S.*$", s):
            ap.error(f"--set {s!r}: want NAME=VALUE (a PostgreSQL setting)")
    return a


def main(argv=None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    if os.geteuid() != 0:
        print("fleet: error: needs root (PostgreSQL runs as the postgres account)", file=sys.stderr)
        return 1
    if not (PG_BIN / "postgres").exists():
        print(f"fleet: error: {PG_BIN}/postgres missing: run tools/install-deps.sh postgresql", file=sys.stderr)
        return 1
    try:
        F._psycopg()
        pw = pwd.getpwnam("postgres")
    except F.FleetError as e:
        print(f"fleet: error: {e}", file=sys.stderr)
        return 1
    except KeyError:
        print("fleet: error: no `postgres` account (Debian's postgresql package makes it)", file=sys.stderr)
        return 1
    _raise_nofile()
    settings = pg_settings(a)
    say("PostgreSQL settings: " + " ".join(settings) + " (and pgcluster.py's " + " ".join(FIXED) + ")")
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    res = {"settings": settings, "fixed_settings": list(FIXED), "slow_ms": a.slow_ms, "k": K_AGREE,
           "canary_fraction": CANARY, "classes": PROGRAMS, "kinds": list(KINDS), "verdict_share": VERDICT_SHARE,
           "runs": []}
    try:
        for n in a.hosts:
            res["runs"].append(run_size(a, (pw.pw_uid, pw.pw_gid), n, settings))
    except KeyboardInterrupt:
        print("fleet: interrupted", file=sys.stderr)
        return 1
    except (BenchError, F.FleetError, RuntimeError, OSError) as e:
        line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"fleet: error: {line}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps(res, indent=1))
    else:
        print(table(res))
    failed = sum(sum(e.values()) for r in res["runs"] for e in (r["load"]["errors"], r["seed"]["push_errors"],
                                                                r["seed"]["canary_errors"], r["warm_errors"],
                                                                r["idle"]["errors"]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
