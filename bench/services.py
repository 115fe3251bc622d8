#!/usr/bin/env python3
"""hakmem against glibc, mimalloc, jemalloc and tcmalloc inside real services:
PostgreSQL 15 under pgbench and redis-server under redis-benchmark.

Each allocator is preloaded into a fresh server for each measured run; the
runs are interleaved, ROUNDS times, the order rotated by one from round to
round so that no allocator always runs first or after the same one (a slow
stretch of this shared machine, or what one run leaves behind, such as a
grown pgbench history table, falls on all of them alike). hakmem runs with
its default policy: its telemetry directory does not exist, so no learnd
steers it (tools/tune_pg.py and `make demo` measure learned policies).

  postgres  a cluster made once by initdb in a temporary directory (a unix
            socket there only; fsync off), `pgbench -i -s SCALE` once under
            glibc; each run starts the postmaster as the postgres account
            with the allocator preloaded, runs `pgbench -c 4 -j 2 -T
            PG_SECONDS -n` (TPS) and samples the server's proportional set
            size (Pss, summed over the postmaster and its children: shared
            buffers count once) every 0.5 s: the median of the samples after
            the first quarter, and the peak.
  redis     each run starts redis-server (unix socket only, no persistence)
            with the allocator preloaded, loads the data set (SET of
            100,000 random keys, 256-byte values), then `redis-benchmark -t
            set,get,lpush,lpop,hset -n REQUESTS -c 16 -d 256 -r 100000`
            (requests/s of each test) and reads the server's VmRSS at the
            end and VmHWM (its peak).

Ratios are of medians; each row also gives hakmem ÷ glibc per round (paired:
the two ran minutes apart at most), their mean and a t statistic over the
rounds, so a difference can be told from this machine's noise. The target
(issue "Speed: first on the field's standard benchmark programs too"): hakmem
at least as fast as glibc on both services.

Needs root for PostgreSQL (it runs as the postgres account); installs
Debian's postgresql, redis and the peer allocators when missing. Progress on
stderr, the table (or --json) on stdout; everything started is stopped at
the end, on an error or on Ctrl-C.

Exit status: 0 when every hakmem run succeeded (a peer may fail: that is
reported), 1 otherwise, 2 on bad arguments."""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import pwd
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "bench"))
import tune_pg  # noqa: E402  the PostgreSQL cluster, shared with tools/tune_pg.py
import run as bench_run  # noqa: E402  the allocators, shared with bench/run.py
from hakmem import procfs  # noqa: E402  (learner/ is on the path through bench/run.py)

SERVICES = ("postgres", "redis")
ALLOCATORS = ("glibc", "hakmem", "mimalloc", "jemalloc", "tcmalloc")
REDIS = "/usr/bin/redis-server"
REDIS_BENCH = "/usr/bin/redis-benchmark"
REDIS_TESTS = ("SET", "GET", "LPUSH", "LPOP", "HSET")
REDIS_ARGS = ["-c", "16", "-d", "256", "-r", "100000"]
BEGIN, END = bench_run.readme_markers("services")
# Two-sided 95% critical values of Student's t by degrees of freedom (rounds - 1).
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23}


class ServiceError(Exception):
    """A run that failed, with a one-line reason."""


def say(msg: str) -> None:
    print(f"services: {msg}", file=sys.stderr, flush=True)


def server_env(lib: str | None, nodir: str, **extra) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith("HAKMEM_") and k != "LD_PRELOAD"}
    if lib:
        e["LD_PRELOAD"] = lib
    e["HAKMEM_SHM_DIR"] = nodir     # absent: hakmem keeps its default policy, no telemetry
    e.update(extra)
    return e


def status_kib(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for ln in f:
                if ln.startswith(field + ":"):
                    return int(ln.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def cpu_s(pid: int, reaped: bool = False) -> float:
    """A process's user + system seconds (all its threads), and with reaped
    its waited-for children's too; 0 when it is gone."""
    st = procfs.proc_stat(pid)
    if st is None:
        return 0.0
    return st["utime"] + st["stime"] + ((st["cutime"] + st["cstime"]) if reaped else 0.0)


# ---- PostgreSQL ----------------------------------------------------------------------
class Postgres:
    name = "postgres"
    metrics = ("tps",)
    work_unit = "transaction"

    def __init__(self, work: pathlib.Path, nodir: str, seconds: int, scale: int):
        if os.geteuid() != 0:
            raise ServiceError("PostgreSQL needs root (it runs as the postgres account): run as root or --only redis")
        if not (tune_pg.PG_BIN / "pgbench").exists():
            subprocess.run([str(ROOT / "tools" / "install-deps.sh"), "postgresql"], check=True)
        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            raise ServiceError("no postgres account after installing postgresql")
        self.nodir, self.seconds = nodir, seconds
        self.cl = tune_pg.Cluster("", (pw.pw_uid, pw.pw_gid))
        say(f"postgres: initdb and pgbench -i -s {scale} in {self.cl.dir}")
        try:
            self.cl.initdb()
            self._start(None)
            b = self.cl.pgbench("-i", "-s", scale, "-q")
            _, err = b.communicate(timeout=600)
            if b.returncode != 0:
                raise ServiceError(f"pgbench -i failed ({b.returncode}): {err.strip()[-300:]}")
        except tune_pg.TuneError as e:
            raise ServiceError(str(e))
        finally:
            self.cl.stop()

    def _start(self, lib):
        self.cl.lib = lib or ""
        # tune_pg's Cluster preloads self.lib and points hakmem at the
        # directory given: an absent one leaves hakmem's default policy.
        self.cl.start(self.nodir)

    def server_cpu(self) -> float:
        """The server's CPU seconds so far: the postmaster, its live children and
        those it reaped (backends of earlier connections)."""
        pm = self.cl.pm.pid
        return cpu_s(pm, reaped=True) + sum(cpu_s(c) for c in procfs.proc_children(pm))

    def run(self, lib: str | None) -> dict:
        try:
            self._start(lib)
            idle = len(procfs.proc_children(self.cl.pm.pid))
            cpu0 = self.server_cpu()
            b = self.cl.pgbench("-c", tune_pg.CLIENTS, "-j", 2, "-T", self.seconds, "-n")
            samples = []
            while b.poll() is None:
                time.sleep(0.5)
                samples.append(self.cl.pss_kib())
            out, err = b.communicate()
            # The backends exit as pgbench disconnects; reaped, their time is the postmaster's.
            end = time.monotonic() + 5
            while len(procfs.proc_children(self.cl.pm.pid)) > idle and time.monotonic() < end:
                time.sleep(0.02)
            cpu = self.server_cpu() - cpu0
            alive = self.cl.pm is not None and self.cl.pm.poll() is None
            if b.returncode != 0 or not alive:
                why = err.strip().splitlines()[-1:] or [f"exit {b.returncode}"]
                raise ServiceError(f"pgbench failed ({b.returncode}){'' if alive else ', the server died'}: {why[0][:200]}")
            tps = [float(ln.split("=")[1].split()[0]) for ln in out.splitlines() if ln.startswith("tps =")]
            if not tps:
                raise ServiceError(f"pgbench printed no tps: {out.strip()[-200:]}")
            done = [int(ln.split(":")[1].split("/")[0]) for ln in out.splitlines()
                    if ln.startswith("number of transactions actually processed:")]
            kept = samples[len(samples) // 4:] or [0]
            return {"tps": tps[0], "mem_kib": statistics.median(kept), "peak_kib": max(samples or [0]),
                    "cpu_us": cpu * 1e6 / done[0] if done and done[0] else 0.0}
        except tune_pg.TuneError as e:
            raise ServiceError(str(e))
        finally:
            self.cl.stop()

    def close(self):
        self.cl.cleanup()


# ---- redis ---------------------------------------------------------------------------
class Redis:
    name = "redis"
    metrics = tuple(t.lower() for t in REDIS_TESTS)
    work_unit = "request"

    def __init__(self, work: pathlib.Path, nodir: str, requests: int):
        if not (os.path.exists(REDIS) and os.path.exists(REDIS_BENCH)):
            subprocess.run([str(ROOT / "tools" / "install-deps.sh"), "redis"], check=True)
        self.work, self.nodir, self.requests = work / "redis", nodir, requests
        self.work.mkdir()
        self.sock = self.work / "redis.sock"
        self.p = None

    def _start(self, lib):
        self.sock.unlink(missing_ok=True)
        self.p = subprocess.Popen([REDIS, "--port", "0", "--unixsocket", str(self.sock), "--unixsocketperm", "700",
                                   "--save", "", "--appendonly", "no", "--dir", str(self.work),
                                   "--logfile", str(self.work / "redis.log")],
                                  env=server_env(lib, self.nodir), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, start_new_session=True)
        end = time.monotonic() + 15
        while time.monotonic() < end:
            if self.p.poll() is not None:
                raise ServiceError(f"redis-server exited at start ({self.p.returncode})")
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.settimeout(2)
                    s.connect(str(self.sock))
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise ServiceError("redis-server did not answer in 15 s")

    def _bench(self, tests: str, n: int, *extra) -> str:
        r = subprocess.run([REDIS_BENCH, "-s", str(self.sock), "-t", tests, "-n", str(n), *REDIS_ARGS, *extra],
                           env=server_env(None, self.nodir), capture_output=True, text=True, timeout=600)
        if r.returncode != 0 or (self.p and self.p.poll() is not None):
            raise ServiceError(f"redis-benchmark failed ({r.returncode}"
                               f"{'' if self.p.poll() is None else ', the server died'}): {r.stderr.strip()[-200:]}")
        return r.stdout

    def run(self, lib: str | None) -> dict:
        try:
            self._start(lib)
            self._bench("set", 100000, "-q")           # the data set the tests read
            cpu0 = cpu_s(self.p.pid)
            out = self._bench(",".join(t.lower() for t in REDIS_TESTS), self.requests, "--csv")
            cpu = cpu_s(self.p.pid) - cpu0
            res = {}
            for ln in out.splitlines()[1:]:
                cells = [c.strip('"') for c in ln.split(",")]
                if len(cells) > 1 and cells[0] in REDIS_TESTS:
                    res[cells[0].lower()] = float(cells[1])
            missing = [t for t in self.metrics if t not in res]
            if missing:
                raise ServiceError(f"redis-benchmark printed no result for {', '.join(missing)}")
            res["mem_kib"] = status_kib(self.p.pid, "VmRSS")
            res["peak_kib"] = status_kib(self.p.pid, "VmHWM")
            res["cpu_us"] = cpu * 1e6 / (self.requests * len(REDIS_TESTS))
            return res
        finally:
            self.stop()

    def stop(self):
        if self.p is None:
            return
        if self.p.poll() is None:
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.settimeout(2)
                    s.connect(str(self.sock))
                    s.sendall(b"SHUTDOWN NOSAVE\r\n")
                self.p.wait(15)
            except (OSError, subprocess.TimeoutExpired):
                pass
            if self.p.poll() is None:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait()
        self.p = None

    def close(self):
        self.stop()


def redis_version() -> str:
    try:
        out = subprocess.run([REDIS, "--version"], capture_output=True, text=True, timeout=10).stdout
        return next((w.split("=")[1] for w in out.split() if w.startswith("v=")), "")
    except (OSError, subprocess.SubprocessError):
        return ""


# ---- statistics ----------------------------------------------------------------------
def paired(hak: list[float], base: list[float]) -> dict:
    """hakmem ÷ base per round (both ran in that round): their mean and a
    t statistic of the mean's difference from 1 (None under two rounds)."""
    r = [h / b for h, b in zip(hak, base) if h and b]
    out = {"per_round": r, "mean": statistics.fmean(r) if r else None, "t": None}
    if len(r) >= 2:
        sd = statistics.stdev(r)
        out["t"] = (out["mean"] - 1) / (sd / math.sqrt(len(r))) if sd > 0 else None
    return out


def summarize(service, runs: dict[str, list[dict]], failed: dict[str, str]) -> dict:
    rows = {}
    for m in (*service.metrics, "cpu_us", "mem_kib", "peak_kib"):
        med, spread = {}, {}
        for a, rs in runs.items():
            v = [r[m] for r in rs]
            if v and a not in failed:
                med[a] = statistics.median(v)
                spread[a] = (max(v) - min(v)) / med[a] if med[a] else 0.0
        peers = [a for a in med if a != "hakmem"]
        row = {"median": med, "spread": spread}
        h = med.get("hakmem")
        if m in service.metrics:
            best = max(peers, key=lambda a: med[a]) if peers else None
            row["best_peer"] = best
            row["vs_best"] = h / med[best] if h and best else None
            row["vs_glibc"] = h / med["glibc"] if h and med.get("glibc") else None
            if "hakmem" in med and "glibc" in med:
                row["paired_glibc"] = paired([r[m] for r in runs["hakmem"]], [r[m] for r in runs["glibc"]])
        else:
            pm = statistics.median(med[a] for a in peers) if peers else None
            row["vs_peer_median"] = h / pm if h and pm else None
            row["vs_glibc"] = h / med["glibc"] if h and med.get("glibc") else None
        rows[m] = row
    return rows


# ---- output --------------------------------------------------------------------------
def fmt_num(x: float) -> str:
    for div, suf in ((1e6, "M"), (1e3, "k")):
        if x >= div:
            return f"{x / div:.3g}{suf}"
    return f"{x:.4g}"


def table(result: dict) -> str:
    allocs = result["allocators"]
    lines = ["| service | measure | " + " | ".join(allocs) + " | hakmem ÷ glibc (per round: mean, t) "
             "| hakmem ÷ best peer | verdict |",
             "|---|---|" + "---:|" * len(allocs) + "---:|---:|---|"]
    for sname, s in result["services"].items():
        for m, row in s["rows"].items():
            is_mem = m in ("mem_kib", "peak_kib", "cpu_us")
            label = {"tps": "TPS", "cpu_us": f"server CPU per {'transaction' if sname == 'postgres' else 'request'} (µs)",
                     "mem_kib": "server memory (MiB)" + (" Pss" if sname == "postgres" else " RSS"),
                     "peak_kib": "peak memory (MiB)" + (" Pss" if sname == "postgres" else " VmHWM")}.get(m, f"{m.upper()} req/s")

            def cell(a):
                if a in s["failed"]:
                    return "failed"
                v = row["median"].get(a)
                if v is None:
                    return "–"
                sp = row["spread"].get(a, 0)
                shown = f"{v:.1f}" if m == "cpu_us" else f"{v / 1024:.1f}" if is_mem else fmt_num(v)
                return shown + f" ±{sp * 50:.0f}%"
            if is_mem:
                vg = row.get("vs_glibc")
                vp = row.get("vs_peer_median")
                ratio = f"{vg:.2f}×" if vg else "–"
                best = f"{vp:.2f}× peers' median" if vp else "–"
                verdict = ""
            else:
                vg, pg = row.get("vs_glibc"), row.get("paired_glibc") or {}
                ratio = "–" if vg is None else f"{vg:.3f}×"
                if pg.get("mean") is not None:
                    ratio += f" ({pg['mean']:.3f}×" + (f", t {pg['t']:+.1f}" if pg.get("t") is not None else "") + ")"
                best = "–" if row.get("vs_best") is None else f"{row['vs_best']:.3f}× ({row['best_peer']})"
                verdict = "–" if vg is None else ("pass" if vg >= 1.0 else "FAIL")
                crit = T95.get(len(pg.get("per_round", [])) - 1, 2.0)
                if vg is not None and vg < 1.0 and pg.get("t") is not None and abs(pg["t"]) < crit:
                    verdict += f" (within noise: \\|t\\| < {crit})"
            lines.append(f"| {sname} | {label} | " + " | ".join(cell(a) for a in allocs) +
                         f" | {ratio} | {best} | {verdict} |")
    notes = [f"{sname}: {a} failed: {why}" for sname, s in result["services"].items() for a, why in s["failed"].items()]
    foot = (f"Medians of {result['rounds']} interleaved rounds (the order rotated each round), ± half the spread "
            "((max − min) ÷ median). hakmem ÷ glibc: ratio of medians; in brackets the per-round ratios' mean and "
            "its t statistic against 1 (Student's, over the rounds; a |t| under the two-sided 95% critical value, 2.78 at "
            "5 rounds, does not tell the difference from noise). Verdict: the issue's target, hakmem's median at "
            "least glibc's. " + result["setup"])
    return "\n".join(lines + [""] + ([*notes, ""] if notes else []) + [foot])


# ---- main ----------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench/services.py", description=__doc__.split("\n\n")[0],
                                 epilog="Example: make bench-services (as root).")
    ap.add_argument("--only", default=",".join(SERVICES), help=f"services, comma-separated (default {','.join(SERVICES)})")
    ap.add_argument("--allocators", default=",".join(ALLOCATORS),
                    help=f"comma-separated, hakmem and glibc among them (default {','.join(ALLOCATORS)})")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--pg-seconds", type=int, default=15, help="pgbench seconds per run (default 15)")
    ap.add_argument("--pg-scale", type=int, default=10, help="pgbench -i scale (default 10)")
    ap.add_argument("--redis-requests", type=int, default=200000,
                    help="redis-benchmark requests per test per run (default 200000)")
    ap.add_argument("--quick", action="store_true", help="1 round, 3 s pgbench at scale 1, 20000 requests: a check that it runs")
    ap.add_argument("--json", action="store_true", help="print the result as JSON instead of the table")
    ap.add_argument("--out", help="also write services.json and services.md into this directory")
    ap.add_argument("--update-readme", metavar="PATH",
                    help=f"replace the text between {BEGIN} and {END} in PATH with the table")
    ap.add_argument("--build", default=os.environ.get("BUILD", "build"), help="where libhakmem.so is (default build)")
    a = ap.parse_args(argv)
    if a.quick:
        a.rounds, a.pg_seconds, a.pg_scale, a.redis_requests = 1, 3, 1, 20000
    services = [s for s in a.only.split(",") if s]
    names = [n for n in a.allocators.split(",") if n]
    bad = [s for s in services if s not in SERVICES] + [n for n in names if n not in ALLOCATORS]
    if bad or not services or "hakmem" not in names or "glibc" not in names:
        ap.error(f"unknown or missing: {', '.join(bad) or 'hakmem and glibc are needed'} "
                 f"(services: {', '.join(SERVICES)}; allocators: {', '.join(ALLOCATORS)})")
    if a.rounds < 1 or a.pg_seconds < 1 or a.redis_requests < 1 or a.pg_scale < 1:
        ap.error("--rounds, --pg-seconds, --pg-scale and --redis-requests must be positive")
    if a.update_readme:       # said now, not after minutes of measuring
        text = pathlib.Path(a.update_readme).read_text() if pathlib.Path(a.update_readme).is_file() else ""
        if [ln.strip() for ln in text.splitlines()].count(BEGIN) != 1 or \
                [ln.strip() for ln in text.splitlines()].count(END) != 1:
            ap.error(f"--update-readme: {a.update_readme} needs one line {BEGIN} and one line {END}")
    lib = (ROOT / a.build / "libhakmem.so").resolve()
    if not lib.exists():
        print(f"services: error: {lib} missing: run `make lib`", file=sys.stderr)
        return 1
    bench_run.HAKMEM_LIB = lib
    allocs, skipped = bench_run.setup_allocators(names, bench_run.DEFAULT_TEL_READER)
    libs = {x.name: x.lib for x in allocs}
    order = [n for n in names if n in libs]

    work = pathlib.Path(tempfile.mkdtemp(prefix="hakmem-services-"))
    os.chmod(work, 0o755)
    nodir = str(work / "no-telemetry-dir")
    opened = []
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    result = {"allocators": order, "skipped": skipped, "rounds": a.rounds,
              "libraries": {x.name: x.info for x in allocs}, "services": {}}
    try:
        for s in services:
            svc = (Postgres(work, nodir, a.pg_seconds, a.pg_scale) if s == "postgres"
                   else Redis(work, nodir, a.redis_requests))
            opened.append(svc)
            runs = {n: [] for n in order}
            failed: dict[str, str] = {}
            for rnd in range(a.rounds):
                k = rnd % len(order)
                for n in order[k:] + order[:k]:
                    if n in failed:
                        continue
                    say(f"{s} round {rnd + 1}/{a.rounds}: {n}")
                    try:
                        r = svc.run(libs[n])
                    except ServiceError as e:
                        failed[n] = str(e)
                        say(f"{s}: {n} failed: {e}")
                        continue
                    runs[n].append(r)
                    say(f"{s} round {rnd + 1}/{a.rounds}: {n}: " +
                        ", ".join(f"{m} {fmt_num(r[m])}" for m in svc.metrics) +
                        f", server CPU {r['cpu_us']:.1f} µs per {svc.work_unit}, memory {r['mem_kib'] / 1024:.1f} MiB")
            svc.close()
            result["services"][s] = {"runs": runs, "failed": failed, "rows": summarize(svc, runs, failed)}
        how = {"postgres": f"PostgreSQL 15: pgbench -c {tune_pg.CLIENTS} -j 2 -T {a.pg_seconds} at scale {a.pg_scale}",
               "redis": f"redis {redis_version()}: redis-benchmark -n {a.redis_requests} {' '.join(REDIS_ARGS)}"}
        result["setup"] = ("; ".join(how[s] for s in services) +
                           "; a fresh server per run; hakmem's default policy (no learnd). Libraries: " +
                           "; ".join(f"{n}: {result['libraries'][n].get('package') or result['libraries'][n].get('lib')}"
                                     for n in order) + ".")
        md = table(result)
        if a.out:
            out = pathlib.Path(a.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "services.json").write_text(json.dumps(result, indent=1))
            (out / "services.md").write_text(md + "\n")
        if a.update_readme:
            try:
                bench_run.update_readme(pathlib.Path(a.update_readme), md + "\n", "services")
            except bench_run.SetupError as e:
                raise ServiceError(str(e))
        print(json.dumps(result, indent=1) if a.json else md)
        hak_failed = [s for s, v in result["services"].items() if "hakmem" in v["failed"]]
        if hak_failed:
            print(f"services: error: hakmem failed on {', '.join(hak_failed)}", file=sys.stderr)
            return 1
        return 0
    except ServiceError as e:
        print(f"services: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        say("interrupted: stopping everything")
        return 130
    finally:
        for svc in opened:
            svc.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
