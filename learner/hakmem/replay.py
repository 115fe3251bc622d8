"""Offline replay (issue 14): a trace replayed through build/hakmem-replay
under one policy or many, priced with the live objective, stored in SQLite
beside the live evaluations, drawn as a time/memory Pareto chart, and
promoted to the trace's program; and learner replay: a program's stored
window history fed back through a learner.

The replayer (C, the real allocator) is the measurement; this module only
drives it: `hakmem-replay --policy FILE --repeat N --json TRACE` per policy,
its JSON turned into the objective's cost (objective.py) in the units of a
live window, so a replay result and a live evaluation compare:

    time_cost = slow_ns/D * 1e-9 + minflt/D * fault_s + os_calls/D * syscall_s
    cost      = time_cost + mem_cost(peak_rss_bytes)

with D the trace's duration in seconds (what the program spent doing the
work the replay compresses). Without an allocator slow_ns counter in the
replayer's output the time term is cpu_s/D instead. Each run of --repeat
gets its cost; the result is the median run's, its spread (max-min)/median.

Results are keyed by (sha256 of the trace's bytes, sha256 of the policy
asked for, objective): a sweep stores each as it completes and a rerun skips
what is stored, so Ctrl-C loses only the replays under way.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import pathlib
import pwd
import shutil
import signal
import subprocess
import threading
import time

import numpy as np

from . import knobs as K
from . import layout as L
from .knobs import default_batch
from .objective import Objective, Prices
from .procfs import PAGE

REPLAYER_ENV = "HAKMEM_REPLAY"
BUILD_HINT = "build it with `make` in the hakmem checkout (it makes build/hakmem-replay), or set HAKMEM_REPLAY=PATH"
CAP_FACTORS = (0.25, 1, 2, 4, 16)   # the grid: each hot class's tcache_cap times these
DRAIN_GRID = (10, 100, 10000)       # ... and drain_ms at these, with the default caps
RETAIN_GRID = (0, 64)               # ... and retain_mib at these (the freed memory kept)
MAX_GRID_HOT = 2                    # hot classes with a grid dimension of their own
HOT_SHARE = 0.05                    # a class with this share of the allocations is hot


class ReplayError(Exception):
    """A replay that could not be done, in one line."""


# ---- the replayer ------------------------------------------------------------------
def find_replayer(explicit: str | None = None) -> str:
    """The hakmem-replay binary: explicit, $HAKMEM_REPLAY, the checkout's
    build directory ($BUILD or build/), or one on PATH."""
    root = pathlib.Path(__file__).resolve().parents[2]
    cands = [explicit] if explicit else []
    if os.environ.get(REPLAYER_ENV):
        cands.append(os.environ[REPLAYER_ENV])
    if not explicit and not os.environ.get(REPLAYER_ENV):
        if os.environ.get("BUILD"):
            b = pathlib.Path(os.environ["BUILD"])
            cands.append(str(b if b.is_absolute() else root / b) + "/hakmem-replay")
        cands.append(str(root / "build" / "hakmem-replay"))
        on_path = shutil.which("hakmem-replay")
        if on_path:
            cands.append(on_path)
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    looked = ", ".join(c for c in cands if c) or "nowhere"
    raise ReplayError(f"the replayer hakmem-replay was not found (looked at {looked}); {BUILD_HINT}")


class ReplayStopped(Exception):
    """The replays' owner stopped them (learnd's screening closed, Ctrl-C in a sweep)."""


class Runner:
    """The replayer processes one owner started (a screening, a sweep), so
    that the owner can end them: stop() ends those under way and makes the
    owner's later run_replayer calls raise ReplayStopped. Each owner has its
    own: one screening stopping (its program's process exited) never stops
    another program's, nor a sweep's."""

    def __init__(self):
        self.lock = threading.Lock()
        self.procs: set = set()
        self.stopping = False

    def stop(self):
        with self.lock:
            self.stopping = True
            for p in list(self.procs):
                with contextlib.suppress(OSError):
                    p.send_signal(signal.SIGTERM)


def sealed_copy(name: str, data: bytes) -> int:
    """A read-only descriptor of an anonymous file holding data (a memfd,
    sealed): what learnd hands a replayer it runs as another user. There is
    no name for anybody to rename over or open, and nobody can change it,
    the replayer included. Closed by the caller."""
    import fcntl
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL)
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(fd)


def run_replayer(trace, policy: dict | None, *, repeat=1, partial=False, replayer=None, timeout=None,
                 user: int | None = None, gate=None, runner: Runner | None = None, label: str | None = None,
                 nice: int | None = None, cpus=None, nice_group: bool = False) -> dict:
    """One replay: the replayer's --json output as a dict. trace: a path, or
    a descriptor (int) the replayer reads without opening a name (learnd's
    private copy, sealed_copy). policy: the knobs to set (a partial dict;
    None or {} = the allocator's default), handed over the same way. user: a
    uid to run the replayer as (root only). gate: a path or a descriptor
    whose first byte holds the replay while nonzero (screen.Gate). runner:
    the owner's Runner (its stop() ends this replay); label: the trace's
    name in messages (default: the path). nice, cpus: the niceness (0-19)
    and the CPUs the replayer and its runs take, set by the replayer itself
    (the calling thread keeps its own); nice_group: the replay's session's
    scheduling group niced too (screen.py says when)."""
    exe = replayer or find_replayer()
    runner = runner or Runner()
    label = label or str(trace)
    argv = [exe]
    fds: list[int] = []
    creds = {}
    if user is not None:
        try:
            gid = pwd.getpwuid(user).pw_gid
        except KeyError:
            gid = user
        creds = {"user": user, "group": gid, "extra_groups": []}
    pfd = None
    try:
        if policy:
            pfd = sealed_copy("hakmem-replay-policy", json.dumps(policy).encode())
            fds.append(pfd)
            argv += ["--policy-fd", str(pfd)]
        argv += ["--repeat", str(int(repeat)), "--json"]
        if nice is not None:
            argv += ["--nice", str(int(nice))] + (["--nice-group"] if nice_group else [])
        if cpus:
            argv += ["--cpus", ",".join(str(int(c)) for c in sorted(cpus))]
        if partial:
            argv.append("--partial")
        if isinstance(gate, int):
            fds.append(gate)
            argv += ["--gate-fd", str(gate)]
        elif gate:
            argv += ["--gate", str(gate)]
        if isinstance(trace, int):
            fds.append(trace)
            argv += ["--trace-fd", str(trace)]
        else:
            argv.append(str(trace))
        if runner.stopping:
            raise ReplayStopped(f"{label}: replays stopped")
        # Its own session: the terminal's Ctrl-C is the caller's to handle
        # (below); the replayer dies with its parent all the same
        # (PR_SET_PDEATHSIG), so a killed caller leaves no replay behind.
        # Where the kernel schedules each session as a group (autogroup), a
        # session of its own weighs as much as the program's whatever the
        # replay's niceness: with --nice-group the replayer nices its group too.
        # Not under runner.lock: on a machine whose CPUs are taken a replay
        # may wait long for its exec, and stop() (learnd's loop, closing a
        # screening) would wait as long for the lock.
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True, pass_fds=fds, **creds)
        with runner.lock:
            runner.procs.add(p)
            if runner.stopping:             # stop() came while it started: it did not see this one
                with contextlib.suppress(OSError):
                    p.send_signal(signal.SIGTERM)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            raise ReplayError(f"{label}: the replayer ran past {timeout} s; killed") from None
        except BaseException:
            # Ctrl-C here: the replayer is in a session of its own (the
            # terminal's SIGINT does not reach it), so it is ended here.
            p.kill()
            p.wait()
            raise
        finally:
            with runner.lock:
                runner.procs.discard(p)
    finally:
        if pfd is not None:
            os.close(pfd)
    if runner.stopping and p.returncode < 0:
        raise ReplayStopped(f"{label}: replays stopped")
    if p.returncode != 0:
        lines = [ln for ln in err.splitlines() if ln.strip()]
        line = lines[-1] if lines else f"exit status {p.returncode}, nothing on stderr"
        if pfd is not None:
            line = line.replace(f"descriptor {pfd}", f"the policy {json.dumps(policy, separators=(',', ':'))[:80]}")
        if isinstance(trace, int):
            line = line.replace(f"descriptor {trace}", label)
        # The replayer's own one line ("hakmem-replay: error: TRACE: why at byte N") passes through.
        raise ReplayError(line.split("error: ", 1)[1] if line.startswith("hakmem-replay: error: ") else
                          f"hakmem-replay: {line}")
    try:
        res = json.loads(out)
        res["runs"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ReplayError(f"{label}: the replayer's output is not the JSON it promises ({out[:80]!r})") from None
    return res


# ---- traces --------------------------------------------------------------------------
def trace_hash(path) -> str:
    """sha256 of the trace's bytes (opened as the trace reader opens files)."""
    from .trace import _open
    f, _size = _open(path)
    h = hashlib.sha256()
    with f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclasses.dataclass
class TraceFacts:
    """What replay needs to know of a trace besides the replayer's figures."""
    path: str
    hash: str
    exe: str
    build_id: str
    uid: int
    class_size: list
    duration_s: float
    allocs: np.ndarray          # allocations per class
    events: int
    mode: str
    on_disk: bool = True        # False: a private copy that has no name (screening), `path` only says what it was

    def hot_classes(self, share=HOT_SHARE, most=3) -> list[int]:
        tot = float(self.allocs.sum())
        if tot <= 0:
            return []
        order = [int(c) for c in np.argsort(-self.allocs, kind="stable") if c > 0 and self.allocs[c] / tot >= share]
        return order[:most]


def trace_facts(path, partial=False, on_progress=None) -> TraceFacts:
    """Reads the trace once (TraceError on a bad one). on_progress(bytes
    read, size) after each chunk (it may raise to stop the reading)."""
    from . import trace as T
    ev = T.events(path, partial=partial, on_progress=on_progress)
    h = ev.header
    cs = list(h.class_size)
    alloc = np.isin(ev.op, T.ALLOC_OPS)
    cls = T.size_classes(ev.size[alloc], cs)
    allocs = np.bincount(cls, minlength=len(cs)).astype(float)
    dur_ns = int(ev.footer.duration_ns) if ev.footer is not None and ev.footer.duration_ns else \
        (int(ev.time_ns.max()) if len(ev.op) else 0)
    from .trace import Opened
    st = os.fstat(path.fd) if isinstance(path, Opened) else os.stat(str(path))
    return TraceFacts(path=str(path), hash=trace_hash(path), exe=h.exe, build_id=h.build_id, uid=st.st_uid,
                      class_size=cs, duration_s=max(dur_ns / 1e9, 1e-3), allocs=allocs, events=len(ev.op),
                      mode=T.MODE_NAMES.get(h.mode, str(h.mode)), on_disk=not isinstance(path, Opened))


# ---- costs ---------------------------------------------------------------------------------
def _total(v) -> float:
    if isinstance(v, (list, tuple)):
        return float(sum(v))
    try:
        return float(v)
    except (TypeError, ValueError):
        return 0.0


def run_cost(run: dict, facts: TraceFacts, objective: Objective, prices: Prices) -> tuple[float, float, float]:
    """(time_cost, mem_cost, cost) of one replayer run, in live-window units:
    the allocator's slow-path time, its page faults and OS calls priced by
    their counts, and its mean resident memory. Screening ranks by this too,
    not by the replay's CPU time: side by side, a replay's system time varies
    with what the others fault at the same moment (bench-learn's phases, 17
    replays at once: 0.06 to 0.47 s of it for the same 30-60 thousand
    faults), which ranked a policy the program cannot tell from the default
    45% cheaper; the counts are the policy's own. slow_ns holds none of the
    kernel's time (the allocator subtracts its faults and memory calls). The
    decay thread's calls are left out and the pages the replaying threads
    gave back are priced (objective.time_cost); a replayer before layout 6
    reports neither, and its runs are priced by their calls alone."""
    from .objective import time_cost
    D = facts.duration_s
    counters = run.get("counters") or {}
    os_calls = _total(run.get("os_calls")) if not isinstance(run.get("os_calls"), dict) else \
        sum(_total(v) for v in run["os_calls"].values())
    os_calls = max(0.0, os_calls - _total(counters.get("decay_syscalls", 0)))
    pages = _total(counters.get("returned_bytes", 0)) / PAGE
    if "slow_ns" in counters:
        t = time_cost(_total(counters["slow_ns"]) / D, float(run.get("minflt", 0)) / D, os_calls / D, prices,
                      pages / D)
    else:
        t = float(run.get("cpu_s", run.get("wall_s", 0.0))) / D
    # Resident memory as a live window prices it: its mean (a replayer before
    # mean_rss_bytes reported only the peak).
    rss = float(run.get("mean_rss_bytes", run.get("peak_rss_bytes", 0)))
    m = objective.mem_cost(rss)
    return t, m, t + m


@dataclasses.dataclass
class Result:
    """One policy replayed on one trace (a replay_runs row)."""
    knobs: dict                 # asked for
    policy: dict                # in force (the replayer's report)
    repeat: int
    wall_s: float
    cpu_s: float
    peak_rss_bytes: float
    os_calls: float
    minflt: float
    time_cost: float
    mem_cost: float
    cost: float
    spread: float
    run_costs: list
    raw: dict
    stored: bool = False        # found in the store, not replayed now
    mean_rss_bytes: float = 0.0  # resident memory averaged over the replay (what the cost prices)

    def as_json(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("raw")
        d["knobs_hash"] = knobs_hash(self.knobs)
        return d


def result_of(res: dict, knobs: dict, facts: TraceFacts, objective: Objective, prices: Prices) -> Result:
    costs = [run_cost(r, facts, objective, prices) for r in res["runs"]]
    c = np.array([x[2] for x in costs])
    i = int(np.argsort(c)[len(c) // 2]) if len(c) else 0
    med = float(np.median(c))
    runs = res["runs"]

    def med_of(key):
        vals = []
        for r in runs:
            v = r.get(key)
            vals.append(sum(_total(x) for x in v.values()) if isinstance(v, dict) else _total(v))
        return float(np.median(vals)) if vals else 0.0
    return Result(knobs=knobs, policy=res.get("policy") or {}, repeat=len(runs), wall_s=med_of("wall_s"),
                  cpu_s=med_of("cpu_s"), peak_rss_bytes=med_of("peak_rss_bytes"), os_calls=med_of("os_calls"),
                  minflt=med_of("minflt"), time_cost=costs[i][0], mem_cost=costs[i][1], cost=costs[i][2],
                  mean_rss_bytes=med_of("mean_rss_bytes"),
                  spread=float((c.max() - c.min()) / med) if med > 0 else 0.0,
                  run_costs=[float(x) for x in c], raw=res)


def knobs_hash(knobs: dict) -> str:
    return hashlib.sha256(json.dumps(knobs or {}, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# ---- the store -------------------------------------------------------------------------------
def open_store(db):
    from .store import Store
    return Store(db)


def stored(store, facts: TraceFacts, objective: Objective, prices: Prices | None = None) -> dict:
    """knobs_hash -> Result for what the store holds of this trace. With
    prices, each is priced again from its stored runs: a fault and an OS call
    cost what they cost on this machine now, the same for a stored result as
    for one replayed beside it."""
    out = {}
    for r in store.db.execute("SELECT * FROM replay_runs WHERE trace_hash = ? AND objective = ?",
                              (facts.hash, objective.describe())):
        raw = json.loads(r["result"]) if r["result"] else {"runs": []}
        res = Result(knobs=json.loads(r["knobs"]), policy=json.loads(r["policy"] or "{}"), repeat=r["repeat"],
                     wall_s=r["wall_s"], cpu_s=r["cpu_s"], peak_rss_bytes=r["peak_rss_bytes"],
                     os_calls=r["os_calls"], minflt=r["minflt"], time_cost=r["time_cost"], mem_cost=r["mem_cost"],
                     cost=r["cost"], spread=r["spread"], run_costs=raw.get("_run_costs", []), raw=raw, stored=True)
        if prices is not None and raw.get("runs"):
            res = dataclasses.replace(result_of(raw, res.knobs, facts, objective, prices), stored=True)
        out[r["knobs_hash"]] = res
    return out


def search_prices(store, facts: TraceFacts, objective: Objective) -> Prices | None:
    """The prices this trace's first stored result was priced at, or None
    (nothing stored, or stored before results kept their prices). A learner's
    search continued from the store is the same search only at the same
    prices: calibrated again, a fault's price moves a few percent between
    runs, the costs with it, and the search's next pick."""
    row = store.db.execute("SELECT result FROM replay_runs WHERE trace_hash = ? AND objective = ? "
                           "ORDER BY created, rowid LIMIT 1", (facts.hash, objective.describe())).fetchone()
    try:
        p = json.loads(row["result"] or "{}").get("_prices") if row else None
        if not isinstance(p, dict):
            return None
        f, s = float(p["fault_s"]), float(p["syscall_s"])
        z = float(p.get("zap_s", Prices.zap_s))      # stored before pages given back were priced: the default
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    # A stored figure is not trusted blindly: a price outside what any
    # machine measures is no price to search at.
    if not (1e-9 <= f <= 1e-3 and 1e-9 <= s <= 1e-3 and 1e-11 <= z <= 1e-4):
        return None
    return Prices(fault_s=f, syscall_s=s, zap_s=z)


def save(store, facts: TraceFacts, objective: Objective, r: Result, program_id=None, prices=None) -> None:
    raw = dict(r.raw, _run_costs=r.run_costs)
    if prices is not None:
        raw["_prices"] = {"fault_s": prices.fault_s, "syscall_s": prices.syscall_s, "zap_s": prices.zap_s}
    with store.tx() as db:
        db.execute(
            "INSERT OR REPLACE INTO replay_runs (trace_hash, trace_path, exe, build_id, program_id, knobs, knobs_hash, "
            "policy, objective, repeat, wall_s, cpu_s, peak_rss_bytes, os_calls, minflt, time_cost, mem_cost, cost, "
            "spread, result, created) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (facts.hash, os.path.abspath(facts.path) if facts.on_disk else facts.path, facts.exe, facts.build_id,
             program_id,
             json.dumps(r.knobs, sort_keys=True), knobs_hash(r.knobs), json.dumps(r.policy), objective.describe(),
             r.repeat, r.wall_s, r.cpu_s, r.peak_rss_bytes, r.os_calls, r.minflt, r.time_cost, r.mem_cost, r.cost,
             r.spread, json.dumps(raw), time.time()))


# ---- policies -------------------------------------------------------------------------------
def full_knobs(policy: dict) -> dict | None:
    """The replayer's "policy" report as canonical knobs (None if incomplete)."""
    try:
        return K.Knobs({n: policy[n] for n in K.ORDER}).to_dict()
    except (K.KnobsError, KeyError, TypeError):
        return None


def cap_max(class_size) -> list[int]:
    """The allocator's greatest tcache_cap per class (the layout's max rule)."""
    m = K.SPEC["tcache_cap"]["max"]
    return [0] + [max(m["lo"], min(m["worth"] // max(int(s), 1), m["hi"])) for s in class_size[1:]]


def _with_cap(default: dict, caps: dict) -> dict:
    k = {"tcache_cap": list(default["tcache_cap"]), "tcache_batch": list(default["tcache_batch"])}
    for c, cap in caps.items():
        k["tcache_cap"][c] = cap
        k["tcache_batch"][c] = default_batch(cap, K.SPEC["tcache_batch"]["max"])
    return k


def grid(default: dict, facts: TraceFacts) -> list[tuple[str, dict]]:
    """The documented grid, as (label, knobs asked for): the default ({}); each
    hot class's tcache_cap (at most MAX_GRID_HOT classes, each with at least
    HOT_SHARE of the allocations) at CAP_FACTORS times its default, every
    combination, the batch following the allocator's rule (cap/2, at most
    256); drain_ms at DRAIN_GRID and retain_mib at RETAIN_GRID with the
    default caps."""
    hot = facts.hot_classes(most=MAX_GRID_HOT)
    top = cap_max(facts.class_size)
    out = [("default", {})]
    seen = {knobs_hash({})}
    for combo in itertools.product(CAP_FACTORS, repeat=len(hot)):
        if all(f == 1 for f in combo):
            continue
        caps = {c: max(1, min(top[c], int(round(default["tcache_cap"][c] * f)))) for c, f in zip(hot, combo)}
        k = _with_cap(default, caps)
        if knobs_hash(k) in seen or all(caps[c] == default["tcache_cap"][c] for c in caps):
            continue
        seen.add(knobs_hash(k))
        label = " ".join(f"cap[{facts.class_size[c]}B]={caps[c]}" for c in hot)
        out.append((label, k))
    for d in DRAIN_GRID:
        if d != default["drain_ms"]:
            out.append((f"drain_ms={d}", {"drain_ms": d}))
    for r in RETAIN_GRID:
        if r != default.get("retain_mib", K.LATER["retain_mib"]):
            out.append((f"retain_mib={r}", {"retain_mib": r}))
    return out


def label_of(knobs: dict, default: dict | None, class_size) -> str:
    """What a policy changes from the default, for a person."""
    if not knobs:
        return "default"
    if default is None:
        return json.dumps(knobs, sort_keys=True)[:60]
    parts = []
    full = dict(default, **knobs)
    for n in K.PER_PROCESS:
        if full.get(n) != default.get(n):
            parts.append(f"{n}={full[n]}")
    for n in K.PER_CLASS:
        if n == "tcache_batch":
            continue
        for c, (a, b) in enumerate(zip(full[n], default[n])):
            if a != b:
                parts.append(f"{'cap' if n == 'tcache_cap' else 'warm'}[{class_size[c]}B]={a}")
    if len(parts) > 4:
        parts = parts[:3] + [f"(+{len(parts) - 3} classes)"]
    return " ".join(parts) or "default"


# ---- sweeps ------------------------------------------------------------------------------------
class Sweep:
    """Replays many policies of one trace: the stored ones are skipped, the
    rest run `jobs` at a time, each stored as it completes. on_result(r)
    is called for each (progress)."""

    def __init__(self, facts: TraceFacts, store, objective: Objective, *, prices=None, repeat=3, partial=False,
                 replayer=None, jobs=None, on_result=None, timeout=None):
        self.facts, self.store, self.objective = facts, store, objective
        self.prices = prices or Prices()
        self.repeat, self.partial, self.replayer = repeat, partial, replayer
        self.jobs = max(1, int(jobs or os.cpu_count() or 1))
        self.on_result = on_result or (lambda r: None)
        self.timeout = timeout
        self.known = stored(store, facts, objective, self.prices) if store is not None else {}
        self.runner = Runner()
        self.results: dict[str, Result] = {}
        self.replayed = 0

    def one(self, knobs: dict) -> Result:
        h = knobs_hash(knobs)
        if h in self.results:           # asked again (a learner measuring its incumbent again)
            return self.results[h]
        if h in self.known and self.known[h].repeat >= self.repeat:
            r = self.known[h]
        else:
            r = self._replay(knobs)
            self._save(r)
        self.results[h] = r
        self.on_result(r)
        return r

    def _replay(self, knobs):
        res = run_replayer(self.facts.path, knobs, repeat=self.repeat, partial=self.partial, replayer=self.replayer,
                           timeout=self.timeout, runner=self.runner)
        self.replayed += 1
        return result_of(res, knobs, self.facts, self.objective, self.prices)

    def _save(self, r):
        if self.store is not None:
            save(self.store, self.facts, self.objective, r, prices=self.prices)

    def many(self, policies: list[dict]) -> list[Result]:
        """Every policy's result; Ctrl-C ends the replays under way and
        raises KeyboardInterrupt with what completed stored."""
        pending = []
        for k in policies:
            h = knobs_hash(k)
            if h in self.results:
                continue
            if h in self.known and self.known[h].repeat >= self.repeat:
                self.results[h] = self.known[h]
                self.on_result(self.known[h])
            elif h not in {knobs_hash(t) for t in pending}:
                pending.append(k)
        if pending:
            ex = cf.ThreadPoolExecutor(max_workers=self.jobs)
            try:
                futs = {ex.submit(self._replay, k): k for k in pending}
                for f in cf.as_completed(futs):
                    r = f.result()
                    self._save(r)
                    self.results[knobs_hash(r.knobs)] = r
                    self.on_result(r)
            except BaseException:
                self.runner.stop()
                ex.shutdown(wait=True, cancel_futures=True)
                raise
            ex.shutdown(wait=True)
        return [self.results[knobs_hash(k)] for k in policies if knobs_hash(k) in self.results]


def learner_sweep(sweep: Sweep, default: dict, name="gp", budget=12, seed=0, on_decision=None) -> list[Result]:
    """The learner's own search driven by replays: each replay's runs are
    its windows (the cost of each run, the trace's per-class allocation
    rates, the replayer's counters as rates), its decisions pick the next
    policy to replay, until `budget` distinct policies were replayed."""
    from .learners import LEARNERS
    from .learning import Context, Window
    f = sweep.facts
    ctx = Context(program=f"{f.exe}@{f.build_id}", class_size=tuple(f.class_size), cap_max=tuple(cap_max(f.class_size)),
                  warm_max=tuple(min(1024, max(v, 1) * 16) if c else 0 for c, v in enumerate(default["warm_slabs"])),
                  batch_max=int(K.SPEC["tcache_batch"]["max"]), drain_ms_max=int(K.SPEC["drain_ms"]["max"]),
                  default=default, objective=sweep.objective, sample_period_s=f.duration_s, explore=True)
    learner = LEARNERS[name](seed=seed)
    dec = learner.start(ctx, default, [])
    current = K.Knobs(dec.knobs).to_dict() if dec else dict(default)
    if dec and on_decision:
        on_decision(dec)
    seen: list[str] = []
    t = 0.0
    out = []
    guard = 0
    while guard < budget * 20:
        guard += 1
        asked = {} if K.Knobs(current) == K.Knobs(default) else current
        h = knobs_hash(asked)
        if h not in seen:
            if len(seen) >= budget:
                break
            seen.append(h)
        r = sweep.one(asked)
        out.append(r)
        allocs = f.allocs / f.duration_s
        for rc in (r.run_costs or [r.cost]):
            cls = {"allocs": allocs}
            for name_, v in (r.raw.get("runs", [{}])[0].get("counters") or {}).items():
                if name_ in L.CLASS_COUNTERS and isinstance(v, list) and len(v) == L.NUM_CLASSES:
                    cls[name_] = np.asarray(v, dtype=float) / f.duration_s
            w = Window(t, t + f.duration_s, knobs=current, cls=cls, active=True, rss_bytes=r.peak_rss_bytes,
                       time_cost=rc - r.mem_cost, mem_cost=r.mem_cost, cost=rc)
            t += f.duration_s
            d = learner.observe(w)
            if d is not None:
                if on_decision:
                    on_decision(d)
                current = K.Knobs(d.knobs).to_dict()
                break
        if learner.state() == "settled" and len(seen) > 1:
            break
    return out


# ---- the Pareto front and its chart -------------------------------------------------------------
def pareto(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points (time, memory) no other point beats in both
    (lower is better), by time."""
    idx = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    out, best_mem = [], float("inf")
    for i in idx:
        if points[i][1] < best_mem:
            out.append(i)
            best_mem = points[i][1]
    return out


def chart(results: list[Result], labels: list[str], out_png: str, title: str) -> None:
    """Time cost against peak RSS, one dot per policy; the Pareto front
    joined and ringed, the default a star, the best by cost labelled."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pts = [(r.time_cost, r.peak_rss_bytes / 2**20) for r in results]
    front = pareto(pts)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=18, color="0.6", label="policy", zorder=2)
    fp = [pts[i] for i in front]
    ax.plot([p[0] for p in fp], [p[1] for p in fp], "-o", color="tab:red", ms=6, mfc="none", label="Pareto front",
            zorder=3)
    for i, lab in enumerate(labels):
        if lab == "default":
            ax.scatter([pts[i][0]], [pts[i][1]], marker="*", s=220, color="tab:blue", label="default", zorder=4)
    best = min(range(len(results)), key=lambda i: results[i].cost)
    for i in front:
        if i != best:
            ax.annotate(labels[i][:40], pts[i], textcoords="offset points", xytext=(6, -12), fontsize=7,
                        color="tab:red")
    ax.annotate(f"best: {labels[best]}"[:48], pts[best], textcoords="offset points", xytext=(6, 8), fontsize=8)
    ax.set_xlabel("time cost (core-s per s of the traced program)")
    ax.set_ylabel("peak RSS (MiB)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)


# ---- learner replay: a program's stored windows through a learner --------------------------------
def history(store, program: dict) -> list[dict]:
    """The program's stored windows, merged per sampling period as learnd
    merged them for its learner (the sum over its live processes), in time
    order: [{"window": learning.Window, "policy_version": int|None}]. Per-class
    counters other than allocations are stored summed over classes; they
    are spread over the classes by the stored allocation mix."""
    from .learning import Window
    cols = [c for c in store.window_columns()]
    measures = store.window_measures()
    rows = store.db.execute(
        f"SELECT {', '.join('w.' + c for c in cols)}, p.knobs AS pknobs, p.version AS pversion "
        "FROM windows w JOIN processes pr ON pr.id = w.process_id LEFT JOIN policies p ON p.id = w.policy_id "
        "WHERE pr.program_id = ? ORDER BY w.t_end, w.id", (program["id"],)).fetchall()
    groups: dict = {}
    for r in rows:
        groups.setdefault(round(float(r["t_end"]), 3), []).append(r)
    out = []
    for t_end in sorted(groups):
        parts = []
        for r in groups[t_end]:
            mix = np.frombuffer(r["mix"], dtype="<f4").astype(float) if r["mix"] else np.zeros(L.NUM_CLASSES)
            if len(mix) != L.NUM_CLASSES:
                mix = np.zeros(L.NUM_CLASSES)
            share = mix / mix.sum() if mix.sum() > 0 else mix
            cls, proc = {"allocs": mix}, {}
            for m in measures:
                if m in L.CLASS_COUNTERS and m != "allocs":
                    cls[m] = share * float(r[m])
                elif m in L.PROC_COUNTERS:
                    proc[m] = float(r[m])
            knobs = json.loads(r["pknobs"]) if r["pknobs"] else None
            parts.append((Window(r["t_start"], r["t_end"], knobs=knobs, cls=cls, proc=proc,
                                 active=bool(mix.sum() > 0 or float(r["slow_ns"]) > 0),
                                 os_calls=float(r["os_calls"]), minflt=float(r["minflt"]),
                                 rss_bytes=float(r["rss_bytes"]), time_cost=float(r["time_cost"]),
                                 mem_cost=float(r["mem_cost"]), cost=float(r["cost"])), r["pversion"]))
        w = Window.merge([p[0] for p in parts])
        versions = {p[1] for p in parts}
        out.append({"window": w, "policy_version": versions.pop() if len(versions) == 1 else None})
    return out


def replay_learner(store, program: dict, name: str, seed: int = 0, objective: Objective | None = None) -> dict:
    """What learner `name` would have decided on the program's stored
    history, step by step, beside what was in force live."""
    from .learners import LEARNERS
    from .learning import Context
    if name not in LEARNERS:
        raise ReplayError(f"unknown learner {name!r} (learners: {', '.join(sorted(LEARNERS))})")
    pols = store.policies(program["id"])
    default = next((p for p in pols if p["origin"] == "default"), None)
    if default is None:
        raise ReplayError(f"{program['key']} has no default policy stored (learnd stores it when it first sees "
                          f"the program)")
    hist = history(store, program)
    if not hist:
        raise ReplayError(f"{program['key']} has no stored windows to replay")
    dk = K.Knobs(default["knobs"]).to_dict()
    cs = list(program["class_sizes"])
    objective = objective or Objective()
    ctx = Context(program=program["key"], class_size=tuple(cs), cap_max=tuple(cap_max(cs)),
                  warm_max=tuple(min(1024, max(v, 1) * 16) if c else 0 for c, v in enumerate(dk["warm_slabs"])),
                  batch_max=int(K.SPEC["tcache_batch"]["max"]), drain_ms_max=int(K.SPEC["drain_ms"]["max"]),
                  default=dk, objective=objective, sample_period_s=max(hist[0]["window"].seconds, 1e-3))
    learner = LEARNERS[name](seed=seed)
    by_digest = {K.Knobs(p["knobs"]).digest(): p["version"] for p in pols}

    def version_of(knobs):
        return by_digest.get(K.Knobs(knobs).digest())

    def dec_json(d):
        return None if d is None else {"kind": d.kind, "reason": d.reason, "knobs": K.Knobs(d.knobs).to_dict(),
                                       "label": label_of(K.Knobs(d.knobs).to_dict(), dk, cs),
                                       "stored_version": version_of(d.knobs),
                                       "verdicts": [e.verdict for e in d.evaluations]}
    version_by_id = {p["id"]: p["version"] for p in pols}
    live_evs = [{"t_end": e["t_end"], "version": version_by_id.get(e["policy_id"]), "verdict": e["verdict"],
                 "cost": e["cost_mean"]}
                for e in sorted(store.evaluations(program["id"], limit=100000), key=lambda e: e["t_end"])]
    steps = [{"step": 0, "t_end": None, "live_version": None, "decision": dec_json(learner.start(ctx, dk, []))}]
    prev_live, prev_t, k = None, float("-inf"), 0
    for i, h in enumerate(hist, 1):
        w = h["window"]
        d = learner.observe(w)
        live = h["policy_version"]
        verdicts = []           # what learnd decided live, stored up to this window's end
        while k < len(live_evs) and prev_t < live_evs[k]["t_end"] <= w.t_end + 1e-6:
            if live_evs[k]["verdict"] != "measured":
                verdicts.append(f"v{live_evs[k]['version']} {live_evs[k]['verdict']}")
            k += 1
        steps.append({"step": i, "t_end": w.t_end, "cost": w.cost, "live_version": live,
                      "live_changed": prev_live is not None and live is not None and live != prev_live,
                      "live_verdicts": verdicts, "decision": dec_json(d)})
        prev_t = w.t_end + 1e-6
        if live is not None:
            prev_live = live
    inc, inc_cost = learner.incumbent()
    return {"program": program["key"], "learner": name, "seed": seed, "windows": len(hist), "steps": steps,
            "decisions": sum(1 for s in steps if s["decision"]),
            "live_changes": sum(1 for s in steps if s.get("live_changed")),
            "live_evaluations": live_evs,
            "incumbent": {"knobs": K.Knobs(inc).to_dict(), "label": label_of(K.Knobs(inc).to_dict(), dk, cs),
                          "cost": inc_cost, "stored_version": version_of(inc)},
            "state": learner.state()}
