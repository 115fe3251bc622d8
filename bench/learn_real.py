#!/usr/bin/env python3
"""Is there room for a policy on real programs, and does hakmem-learnd take it?

Nine unmodified programs from Debian, each under a workload a deployment
has: load that comes in waves, data that grows and is deleted, idle time,
many processes or threads. Every workload is a loop of cycles, each cycle a
fixed amount of work (so a policy that makes the program faster finishes
more cycles, never different ones):

  redis     redis-server (one process, a lazy-free thread): a keyspace that
            grows by SETs of one value size per cycle (64 B to 2 KiB), is
            read, gets lists pushed and popped, and is flushed (FLUSHALL
            ASYNC: freed on another thread); 1.5 s idle
  postgres  PostgreSQL 15, a backend process per connection, work_mem 256MB:
            pgbench (8 clients, a fixed number of transactions), then two
            analytic queries whose sort and hash go to malloc; 1 s idle
  python3   a stdlib service loop: JSON requests through an LRU cache, then
            a large batch (sort and group 200,000 records)
  perl      hashes of strings grown, sorted, rewritten by regex and deleted
            in waves
  sqlite3   the sqlite3 shell with a 256 MiB page cache: a large transaction,
            an index, an aggregate, half deleted, VACUUM
  git       repack -adf of a generated repository (delta search on 2
            threads), then log --stat
  gcc       gcc -O2 on a large generated translation unit
  jq        group_by and aggregates over a generated JSON array
  mariadb   MariaDB 10.11, a thread per connection: sysbench in waves, 64
            connections of OLTP read/write, then 8 of point selects; 1 s
            idle (the server keeps a few threads for reuse, ends the rest)

The long-lived ones (redis, postgres, python3, perl, sqlite3, mariadb) run one
process per run and are told to do a cycle at a time; git, gcc and jq start
a process per cycle, as their users do. Every process of the program runs
with hakmem preloaded (the load generators and clients do not). Measured
from outside, for each run: the cycles' work units done (the program's
own: requests, transactions, rows, functions), the wall time they took
(the idle time left out), the program's CPU time (its processes' rusage,
reaped descendants included), and its proportional set size summed over
its processes (/proc/PID/smaps_rollup, every 0.1 s): time-averaged and
peak. The objective is bench/learn.py's, with the same price of memory:

  J = D_ref / X + 0.5 * PSS / GiB

X = units per CPU-second, D_ref = the default run's units per busy second
(so D_ref / X is the cores the default's work needs at this run's speed).
With --objective budget=SIZE (learnd is given the same), memory is not
priced but bounded: J = D_ref / X while the mean PSS is under SIZE, plus
10 cores per 100% over it (learnd's own objective, objective.py).

  room     static policies (the HAKMEM_* variables, so every process of the
           program, short-lived ones too, starts under the policy) against
           the default, interleaved over --rounds rounds with the order
           rotated each round: medians and ranges of J, throughput and PSS
  learnd   hakmem-learnd (gp) from a cold start, then restarted on the
           database it left (warm), interleaved with the default and the
           best static policy of the room study; every run is also judged
           over its late half (from the first cycle ending past half of
           --seconds to the last: what learnd settled on, its learning left
           out), beside the whole run
  watched  (--watched) the price of being watched, the default policy in
           force throughout: watch-hold (the telemetry lease held by
           `hakmem ring hold`: every process makes its telemetry file and
           publishes, nobody reads), watch-static (learnd --learner static
           with HAKMEM_BPF=off: windows read and stored, nothing changed),
           watch-static-bpf (the same with hakmem-bpf's probes)

Where the programs' outputs are deterministic (every one but redis and
postgres's transactions), each cycle's answer is hashed and every run's
answers must equal the default's: the same answers under every policy.

Outputs in --out (default bench/results/): learn_real.json (every run),
learn_real.md (the tables, also printed). Progress on stderr. Needs root
for PostgreSQL (--only leaves it out otherwise); installs what is missing.

Exit status: 0 when every run completed with the same answers, 1 when a run
failed or answered differently, 2 on bad arguments."""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import pwd
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "learner"))
sys.path.insert(0, str(ROOT / "tools"))
from hakmem.objective import Objective, ObjectiveError  # noqa: E402
from hakmem.procfs import proc_descendants, proc_stat  # noqa: E402  one reader of /proc for learnd and the tools
from tune_pg import pss_kib  # noqa: E402  the same PSS reading as tools/tune_pg.py and bench/services.py
BUILD = ROOT / os.environ.get("BUILD", "build")
LIB = BUILD / "libhakmem.so"
VENV_BIN = ROOT / ".venv" / "bin" if (ROOT / ".venv" / "bin").is_dir() else Path(sys.executable).parent
LEARND = VENV_BIN / "hakmem-learnd"
HAKMEM_CLI = [str(VENV_BIN / "hakmem")]
PG_BIN = Path("/usr/lib/postgresql/15/bin")
GIB = float(1 << 30)
LAMBDA = 0.5            # bench/learn.py's price of memory: a GiB resident costs half a core
# The objective of J and of learnd (--objective): λ = LAMBDA by default, or a
# memory budget, J then D_ref / X while the mean PSS is under it and growing
# steeply past it (objective.OVER_BUDGET cores per 100% over), as learnd's.
OBJECTIVE = f"lambda={LAMBDA}"
SAMPLE_S = 0.1
# The late half: from the first cycle that ends past this share of --seconds
# to the last. learnd's learning (screening, trials) lands in the first half;
# what it settled on is judged here, as bench/learn.py judges J over its
# runs' last seconds, beside the whole run's figures, never instead of them.
LATE_FROM = 0.5

# Static policies as HAKMEM_* variables: each applies to every class,
# fitted into the class's bounds (knobs.h), the batch following the
# capacity; the same points as bench/learn.py's grid, which writes them
# into one process's telemetry file instead.
POINTS = {
    "default": {},
    "glibc": None,      # no hakmem: the reference for speed, memory and answers
    "cap=max": {"HAKMEM_TCACHE_CAP": 4096},
    "cap=32": {"HAKMEM_TCACHE_CAP": 32},
    "cap=4": {"HAKMEM_TCACHE_CAP": 4},
    "warm=max": {"HAKMEM_WARM_SLABS": 1024},
    "warm=0": {"HAKMEM_WARM_SLABS": 0},
    "drain=100": {"HAKMEM_DRAIN_MS": 100},
    "drain=300": {"HAKMEM_DRAIN_MS": 300},
    "drain=500": {"HAKMEM_DRAIN_MS": 500},
    "drain=10000": {"HAKMEM_DRAIN_MS": 10000},
    "cap=4 warm=0": {"HAKMEM_TCACHE_CAP": 4, "HAKMEM_WARM_SLABS": 0},
    "cap=max warm=max": {"HAKMEM_TCACHE_CAP": 4096, "HAKMEM_WARM_SLABS": 1024},
    "retain=0": {"HAKMEM_RETAIN_MIB": 0},
    "retain=16": {"HAKMEM_RETAIN_MIB": 16},
    "retain=64": {"HAKMEM_RETAIN_MIB": 64},
    "retain=128": {"HAKMEM_RETAIN_MIB": 128},
}
# --watched: who watches the default (None: only the lease, held by
# `hakmem ring hold`; else learnd's extra flags and environment).
WATCHERS = {
    "watch-hold": None,
    "watch-static": (("--learner", "static"), {"HAKMEM_BPF": "off"}),
    "watch-static-bpf": (("--learner", "static"), {}),
}
ROOM_POINTS = ("default", "cap=max warm=max", "cap=4", "warm=0", "drain=100", "drain=10000", "cap=4 warm=0",
               "retain=64", "retain=0")


class RunError(Exception):
    """A run that failed, with a one-line reason."""


def say(msg: str) -> None:
    print(f"learn-real: {msg}", file=sys.stderr, flush=True)


def clean_env(**extra) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith("HAKMEM_") and k != "LD_PRELOAD"}
    e["LC_ALL"] = "C"
    e.update({k: str(v) for k, v in extra.items()})
    return e


def digest(data) -> str:
    if isinstance(data, str):
        data = data.encode()
    return hashlib.sha256(data).hexdigest()[:16]


# ---------------------------------------------------------------- one run


def maps_whole(maps: str) -> bool:
    """Whether a read of /proc/PID/maps reached its end: the stack, near the
    top of the address space, is always listed. A process exiting while it is
    read gives back a prefix: its own mappings up to where its memory went
    away, without the preloaded library, which ld.so mapped above them (a
    fresh-clone make test of d593a20 counted one perl "without" it, a run
    that ended within a second of starting)."""
    return "[stack]" in maps


class Ctx:
    """One run of one program under one configuration: the processes it
    starts with hakmem preloaded, their CPU time and PSS, the work done."""

    def __init__(self, work: Path, lib: str | None, shm: Path, policy_env: dict, seconds: float, small: bool):
        self.work, self.small, self.seconds = work, small, seconds
        self.env = clean_env(HAKMEM_SHM_DIR=shm, **policy_env)
        if lib:
            self.env["LD_PRELOAD"] = lib
        self.plain = clean_env()
        self.procs: list[subprocess.Popen] = []
        self.cpu_s = 0.0
        self.units = 0
        self.cycles = 0
        self.idle_s = 0.0
        self.answers: list[str] = []
        self.marks: list[tuple[float, int, float, float]] = []   # at each cycle's end: t, units, idle s, CPU s
        self.preload_checked = self.not_preloaded = 0
        self.samples: list[tuple[float, int]] = []
        self.lock = threading.Lock()
        self.stop_sampling = threading.Event()
        self.t0 = time.monotonic()
        self.sampler = threading.Thread(target=self._sample, daemon=True)
        self.sampler.start()

    def _sample(self) -> None:
        nxt = time.monotonic()
        seen: dict[int, int] = {}
        missing: set[int] = set()      # seen once without the library: looked at again
        lib = os.path.realpath(self.env["LD_PRELOAD"]) if "LD_PRELOAD" in self.env else None
        while not self.stop_sampling.is_set():
            with self.lock:
                roots = [p.pid for p in self.procs if p.returncode is None]
            kib = sum(pss_kib(q) for r in roots for q in proc_descendants(r))
            for r in roots:
                # ld.so skips a preload it cannot open with a warning nobody
                # reads, and the run would measure glibc under hakmem's name.
                # A root seen twice has exec'd (the first look can fall
                # between fork and exec). One without the library is looked
                # at once more, a sample later: a fresh-clone CI run of
                # 71f47fd counted one redis-server "without" it, which every
                # other run of that test had preloaded (a look racing the
                # process's own exit, most likely); a preload ld.so skipped
                # is still missing a sample later.
                seen[r] = seen.get(r, 0) + 1
                if lib and seen[r] in (2, 3) and (seen[r] == 2 or r in missing):
                    try:
                        with open(f"/proc/{r}/maps") as f:
                            maps = f.read()
                    except OSError:
                        maps = ""
                    if not maps_whole(maps):    # exiting, a zombie, or gone: nothing to tell
                        missing.discard(r)
                    elif lib in maps:
                        self.preload_checked += 1
                        missing.discard(r)
                    elif seen[r] == 2:
                        missing.add(r)
                    else:
                        self.preload_checked += 1
                        self.not_preloaded += 1
                        missing.discard(r)
            self.samples.append((round(time.monotonic() - self.t0, 2), kib))
            nxt += SAMPLE_S
            self.stop_sampling.wait(max(0.0, nxt - time.monotonic()))

    def spawn(self, argv, env=None, **kw) -> subprocess.Popen:
        """A process of the program, hakmem preloaded (env: more variables)."""
        e = dict(self.env)
        e.update(env or {})
        p = subprocess.Popen([str(a) for a in argv], env=e, **kw)
        with self.lock:
            self.procs.append(p)
        return p

    def reap(self, p: subprocess.Popen, timeout: float = 60.0) -> int:
        """Waits for a program process and adds its CPU time (its reaped
        descendants' too: a postmaster's backends, gcc's cc1)."""
        if p.returncode is not None:        # reaped by a poll() already (a start that failed)
            return p.returncode
        end = time.monotonic() + timeout
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid == p.pid:
                break
            if time.monotonic() > end:
                p.kill()
                pid, status, ru = os.wait4(p.pid, 0)
                break
            time.sleep(0.01)
        p.returncode = os.waitstatus_to_exitcode(status)
        self.cpu_s += ru.ru_utime + ru.ru_stime
        return p.returncode

    def run(self, argv, what: str, timeout: float = 600.0, **kw) -> bytes:
        """One program process from start to end; its stdout."""
        p = self.spawn(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)
        out, err = [], []
        t_out = threading.Thread(target=lambda: out.append(p.stdout.read()), daemon=True)
        t_out.start()
        err.append(p.stderr.read())
        t_out.join()
        rc = self.reap(p, timeout)
        if rc != 0:
            raise RunError(f"{what} exited {rc}: {err[0].decode(errors='replace').strip()[-300:]}")
        return out[0]

    def client(self, argv, what: str, timeout: float = 600.0, env=None) -> str:
        """A client or load generator: not preloaded, not measured."""
        r = subprocess.run([str(a) for a in argv], env=env or self.plain, capture_output=True, text=True,
                           timeout=timeout)
        if r.returncode != 0:
            raise RunError(f"{what} exited {r.returncode}: {(r.stderr or r.stdout).strip()[-300:]}")
        return r.stdout

    def idle(self, s: float) -> None:
        if self.small:
            s = min(s, 0.2)
        self.idle_s += s
        time.sleep(s)

    def done_cycle(self, units: int, answer: str | None = None) -> None:
        self.units += units
        self.cycles += 1
        if answer is not None:
            self.answers.append(answer)
        self.marks.append((time.monotonic() - self.t0, self.units, self.idle_s, self.cpu_now()))

    def cpu_now(self) -> float:
        """The program's CPU seconds so far: the reaped processes' rusage,
        and for each live one its own and its waited-for children's (each
        process that ended is in its waiter's cutime; a live descendant in
        its own utime). /proc's ticks: 10 ms, against cycles of seconds."""
        cpu = self.cpu_s
        with self.lock:
            roots = [p.pid for p in self.procs if p.returncode is None]
        for r in roots:
            for q in proc_descendants(r):
                st = proc_stat(q)
                if st is not None:
                    cpu += st["utime"] + st["stime"] + st["cutime"] + st["cstime"]
        return cpu

    def late(self) -> dict | None:
        """The run's late half (LATE_FROM): its units per busy second and
        per CPU second, its mean PSS; None when fewer than one whole cycle
        falls in it."""
        cut = LATE_FROM * self.seconds
        start = next((i for i, m in enumerate(self.marks) if m[0] >= cut), None)
        if start is None or start + 1 >= len(self.marks):
            return None
        (t0, u0, i0, c0), (t1, u1, i1, c1) = self.marks[start], self.marks[-1]
        busy, cpu = (t1 - t0) - (i1 - i0), c1 - c0
        pss = [k for t, k in self.samples if t0 <= t <= t1]
        if busy <= 0 or cpu <= 0 or not pss:
            return None
        return {"from_s": round(t0, 2), "to_s": round(t1, 2), "throughput": (u1 - u0) / busy,
                "units_per_cpu_s": (u1 - u0) / cpu, "pss_mean_mib": statistics.fmean(pss) / 1024}

    def more(self) -> bool:
        """Whether to start another cycle: at least one, then until --seconds."""
        return self.cycles == 0 or time.monotonic() - self.t0 < self.seconds

    def close(self) -> dict:
        for p in self.procs:
            if p.returncode is None:
                try:
                    p.kill()
                except OSError:
                    pass
                self.reap(p, 10)
        wall = time.monotonic() - self.t0
        self.stop_sampling.set()
        self.sampler.join(timeout=5)
        pss = [k for _, k in self.samples]
        busy = max(1e-6, wall - self.idle_s)
        return {"units": self.units, "cycles": self.cycles, "wall_s": round(wall, 3), "busy_s": round(busy, 3),
                "cpu_s": round(self.cpu_s, 3), "throughput": self.units / busy,
                "units_per_cpu_s": self.units / self.cpu_s if self.cpu_s > 0 else None,
                "pss_mean_mib": statistics.fmean(pss) / 1024 if pss else 0.0,
                "pss_peak_mib": max(pss) / 1024 if pss else 0.0,
                "answers": [a if len(a) <= 16 else digest(a) for a in self.answers],
                "late": self.late(),
                "preload_checked": self.preload_checked, "not_preloaded": self.not_preloaded}


# ---------------------------------------------------------------- the programs


class Program:
    name = ""
    exe = ""            # the executable learnd groups by
    user = None         # run as this account (postgres)
    apt: tuple = ()     # install-deps.sh groups
    deterministic = True

    def __init__(self, work: Path, small: bool):
        self.work, self.small = work / self.name, small
        self.work.mkdir(parents=True, exist_ok=True)

    def available(self) -> str | None:
        """Why the program cannot run here, or None."""
        return None if shutil.which(self.exe) or Path(self.exe).exists() else f"{self.exe} is not installed"

    def setup(self) -> None:
        pass

    def workload(self, ctx: Ctx) -> None:
        raise NotImplementedError

    def cleanup(self) -> None:
        pass


class Redis(Program):
    name, exe, apt = "redis", "/usr/bin/redis-server", ("redis",)
    deterministic = False
    SIZES = (64, 512, 2048, 256)

    def workload(self, ctx: Ctx) -> None:
        sock = self.work / "redis.sock"
        p = ctx.spawn([self.exe, "--port", "0", "--unixsocket", sock, "--unixsocketperm", "700", "--save", "",
                       "--appendonly", "no", "--dir", self.work, "--lazyfree-lazy-user-flush", "yes",
                       "--logfile", self.work / "redis.log"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            self._wait(p, sock)
            n = 4000 if self.small else 100_000
            rb = ["/usr/bin/redis-benchmark", "-s", sock, "-q", "-P", "16", "-c", "8"]
            while ctx.more():
                d = self.SIZES[ctx.cycles % len(self.SIZES)]
                ctx.client([*rb, "-t", "set", "-n", n, "-r", n, "-d", d], "redis-benchmark set")
                ctx.client([*rb, "-t", "get", "-n", n, "-r", n], "redis-benchmark get")
                ctx.client([*rb, "-t", "lpush,lpop", "-n", n // 2], "redis-benchmark lpush,lpop")
                self._cmd(sock, b"FLUSHALL ASYNC")
                ctx.done_cycle(2 * n + n)
                ctx.idle(1.5)
        finally:
            self._cmd(sock, b"SHUTDOWN NOSAVE")
            ctx.reap(p, 30)

    @staticmethod
    def _cmd(sock: Path, line: bytes) -> bytes:
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(30)
                s.connect(str(sock))
                s.sendall(line + b"\r\n")
                return s.recv(256)
        except OSError:
            return b""

    def _wait(self, p, sock: Path) -> None:
        end = time.monotonic() + 15
        while time.monotonic() < end:
            if p.poll() is not None:
                raise RunError(f"redis-server exited at start ({p.returncode})")
            if self._cmd(sock, b"PING").startswith(b"+PONG"):
                return
            time.sleep(0.05)
        raise RunError("redis-server did not answer in 15 s")


class Postgres(Program):
    name, exe, apt = "postgres", str(PG_BIN / "postgres"), ("postgresql",)
    user = "postgres"
    deterministic = True        # the analytic queries' answers; the transactions' effects are not compared
    QUERIES = ("SELECT count(*) FROM (SELECT aid FROM pgbench_accounts ORDER BY filler DESC, abalance, aid) s;",
               "SELECT count(*), sum(n) FROM (SELECT aid % 50000 AS k, count(*) AS n, max(filler) "
               "FROM pgbench_accounts GROUP BY 1) s;")

    def available(self) -> str | None:
        if os.geteuid() != 0:
            return "PostgreSQL runs as the postgres account: needs root"
        return super().available()

    def setup(self) -> None:
        pw = pwd.getpwnam("postgres")
        self.ids = (pw.pw_uid, pw.pw_gid)
        os.chown(self.work, *self.ids)
        self.data = self.work / "data"
        self._as_pg([PG_BIN / "initdb", "-D", self.data, "-U", "postgres", "--auth=trust", "-E", "UTF8",
                     "--locale=C", "--no-sync"], "initdb")
        ctx = Ctx(self.work, None, self.work / "no-telemetry", {}, 0, True)
        try:
            pm = self._start(ctx)
            scale = 1 if self.small else 10
            ctx.client([PG_BIN / "pgbench", "-i", "-s", scale, "-q"], "pgbench -i", env=self._client_env())
            self._stop(ctx, pm)
        finally:
            ctx.close()

    def _as_pg(self, argv, what: str) -> None:
        r = subprocess.run(["setpriv", f"--reuid={self.ids[0]}", f"--regid={self.ids[1]}", "--clear-groups", "--",
                            *map(str, argv)], env=clean_env(), capture_output=True, text=True, cwd="/", timeout=300)
        if r.returncode != 0:
            raise RunError(f"{what} failed ({r.returncode}): {(r.stderr or r.stdout).strip()[-300:]}")

    def _client_env(self) -> dict:
        return clean_env(PGHOST=self.work, PGUSER="postgres", PGDATABASE="postgres")

    def _start(self, ctx: Ctx):
        pm = ctx.spawn(["setpriv", f"--reuid={self.ids[0]}", f"--regid={self.ids[1]}", "--clear-groups", "--",
                        self.exe, "-D", self.data, "-c", "listen_addresses=", "-c",
                        f"unix_socket_directories={self.work}", "-c", "fsync=off", "-c", "synchronous_commit=off",
                        "-c", "full_page_writes=off", "-c", "work_mem=256MB", "-c", "shared_buffers=128MB",
                        "-c", "max_parallel_workers_per_gather=0", "-c", "logging_collector=off"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/")
        end = time.monotonic() + 60
        while time.monotonic() < end:
            if pm.poll() is not None:
                raise RunError(f"postgres exited at start ({pm.returncode})")
            try:
                lines = (self.data / "postmaster.pid").read_text().splitlines()
                if len(lines) >= 8 and lines[7].strip() == "ready":
                    lib = ctx.env.get("LD_PRELOAD")
                    if lib and os.path.realpath(lib) not in Path(f"/proc/{pm.pid}/maps").read_text():
                        raise RunError(f"postgres did not load {lib} (can the postgres account read it?)")
                    return pm
            except OSError:
                pass
            time.sleep(0.05)
        raise RunError("postgres did not become ready within 60 s")

    def _stop(self, ctx: Ctx, pm) -> None:
        if pm.returncode is None:
            pm.send_signal(signal.SIGINT)       # fast shutdown
            ctx.reap(pm, 60)

    def workload(self, ctx: Ctx) -> None:
        pm = self._start(ctx)
        try:
            per_client = 25 if self.small else 300
            env = self._client_env()
            while ctx.more():
                ctx.client([PG_BIN / "pgbench", "-c", 8, "-j", 2, "-t", per_client, "-n"], "pgbench", env=env)
                ans = [ctx.client([PG_BIN / "psql", "-XAtq", "-c", q], "psql", env=env).strip() for q in self.QUERIES]
                ctx.done_cycle(8 * per_client, " ".join(ans))
                ctx.idle(1.0)
        finally:
            self._stop(ctx, pm)


class LineServer(Program):
    """A long-lived interpreter told to do one cycle per line on its stdin,
    answering one line per cycle: 'done UNITS ANSWER'."""
    argv: list = []
    idle_s = 0.5

    def workload(self, ctx: Ctx) -> None:
        p = ctx.spawn(self.command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                      cwd=self.work)
        try:
            while ctx.more():
                p.stdin.write(self.request(ctx.cycles))
                p.stdin.flush()
                units, answer = self.response(p, ctx.cycles)
                ctx.done_cycle(units, answer)
                ctx.idle(self.idle_s)
            p.stdin.close()
            rc = ctx.reap(p, 60)
            if rc != 0:
                raise RunError(f"{self.name} exited {rc}: {p.stderr.read().decode(errors='replace').strip()[-300:]}")
        except (BrokenPipeError, OSError) as e:
            raise RunError(f"{self.name} stopped answering ({e}): "
                           f"{p.stderr.read().decode(errors='replace').strip()[-300:]}")

    def command(self) -> list:
        return self.argv

    def request(self, cycle: int) -> bytes:
        return f"{cycle}\n".encode()

    def response(self, p, cycle: int) -> tuple[int, str]:
        line = p.stdout.readline().decode().split()
        if len(line) != 3 or line[0] != "done":
            raise RunError(f"{self.name} answered {' '.join(line)!r} to cycle {cycle}: "
                           f"{p.stderr.read().decode(errors='replace').strip()[-300:]}")
        return int(line[1]), line[2]


PY_SERVICE = r"""
import collections, hashlib, json, random, sys
SMALL = sys.argv[1] == "small"
REQ, BATCH, LRU = (2000, 20000, 5000) if SMALL else (20000, 200000, 50000)
cache = collections.OrderedDict()
for line in sys.stdin:
    cycle = int(line)
    rng = random.Random(cycle)
    h = hashlib.sha256()
    for i in range(REQ):                       # requests: parse, look up, answer
        key = rng.randrange(4 * LRU)
        req = json.dumps({"id": i, "key": key, "tags": [rng.choice("abcdefgh") * rng.randrange(1, 40)
                                                        for _ in range(rng.randrange(1, 8))]})
        r = json.loads(req)
        hit = cache.get(r["key"])
        if hit is None:
            hit = {"key": r["key"], "body": "x" * rng.randrange(16, 2048), "tags": r["tags"]}
            cache[r["key"]] = hit
            if len(cache) > LRU:
                cache.popitem(last=False)
        else:
            cache.move_to_end(r["key"])
        h.update(json.dumps({"id": r["id"], "n": len(hit["body"])}).encode())
    rows = [(rng.randrange(1000), rng.random(), "r%d" % rng.randrange(10**6)) for _ in range(BATCH)]
    rows.sort(key=lambda t: (t[0], t[2]))       # a large batch: sort, group, summarise, drop
    groups = collections.defaultdict(list)
    for k, v, s in rows:
        groups[k].append((v, s))
    h.update(repr(sorted((k, len(g), round(sum(v for v, _ in g), 6)) for k, g in groups.items())).encode())
    del rows, groups
    print("done", REQ + BATCH, h.hexdigest()[:16], flush=True)
"""


class Python(LineServer):
    name, exe = "python3", "/usr/bin/python3"

    def command(self) -> list:
        return [self.exe, "-I", "-c", PY_SERVICE, "small" if self.small else "full"]


PERL_SERVICE = r"""
use strict; use warnings; use Digest::MD5 qw(md5_hex);
$| = 1;
my $small = $ARGV[0] eq "small";
my $N = $small ? 20000 : 250000;
my %keep;
while (my $cycle = <STDIN>) {
    chomp $cycle;
    my $seed = $cycle * 7919 + 17;
    my %h;
    for my $i (1 .. $N) {                       # grow: a hash of strings
        $seed = ($seed * 1103515245 + 12345) % 2147483648;
        my $k = "k" . ($seed % (4 * $N));
        $h{$k} .= ("v" x (1 + $seed % 300)) . $i;
    }
    my @keys = sort { length($h{$a}) <=> length($h{$b}) or $a cmp $b } keys %h;
    my $total = 0;
    for my $k (@keys) {                         # rewrite by regex
        (my $v = $h{$k}) =~ s/v{3}/w/g;
        $total += length $v;
        $keep{$k} = $v if length($v) % 7 == 0;
    }
    for my $k (keys %keep) { delete $keep{$k} if (length($k) + $cycle) % 2 }   # a wave of deletes
    my $d = md5_hex(join ",", $total, scalar(@keys), scalar(keys %keep));
    undef %h; undef @keys;
    print "done $N ", substr($d, 0, 16), "\n";
}
"""


class Perl(LineServer):
    name, exe = "perl", "/usr/bin/perl"

    def command(self) -> list:
        return [self.exe, "-e", PERL_SERVICE, "small" if self.small else "full"]


class Sqlite(LineServer):
    name, exe = "sqlite3", "/usr/bin/sqlite3"

    def command(self) -> list:
        db = self.work / "t.db"
        for suffix in ("", "-journal", "-wal", "-shm"):
            Path(f"{db}{suffix}").unlink(missing_ok=True)
        return [self.exe, "-batch", db]

    def request(self, cycle: int) -> bytes:
        n = 5000 if self.small else 60000
        first = "PRAGMA cache_size=-262144; PRAGMA journal_mode=MEMORY; PRAGMA synchronous=OFF; " \
                "CREATE TABLE IF NOT EXISTS t(k INTEGER, v TEXT); " if cycle == 0 else ""
        return (f"{first}BEGIN; "
                f"WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c WHERE x<{n}) "
                f"INSERT INTO t SELECT (x*7919+{cycle}*104729)%1000003, "
                f"substr(hex(zeroblob(600)),1,50+(x*31+{cycle})%1100)||x FROM c; COMMIT; "
                f"CREATE INDEX IF NOT EXISTS tk ON t(k); "
                f"SELECT 'a', count(*), sum(length(v)) FROM t; "
                f"SELECT 'b', k%97, count(*), max(v) FROM t GROUP BY 1,2 ORDER BY 4 DESC, 2 LIMIT 3; "
                f"SELECT 'c', count(DISTINCT substr(v,1,300)) FROM t; "
                f"DELETE FROM t WHERE (k+{cycle})%2=0; VACUUM; SELECT 'done', {n};\n").encode()

    def response(self, p, cycle: int) -> tuple[int, str]:
        lines = []
        while True:
            ln = p.stdout.readline().decode()
            if not ln:
                raise RunError(f"sqlite3 ended in cycle {cycle}: {p.stderr.read().decode(errors='replace')[-300:]}")
            if ln.startswith("done|"):
                return int(ln.split("|")[1]), digest("".join(lines))
            lines.append(ln)


class Git(Program):
    name, exe = "git", "/usr/bin/git"

    def setup(self) -> None:
        repo = self.work / "repo"
        subprocess.run(["git", "init", "-q", "-b", "main", repo], check=True, env=clean_env())
        rng = random.Random(1)
        words = ["w%04d" % i for i in range(3000)]
        files = {f"src/f{i:02d}.txt": [" ".join(rng.choices(words, k=12)) for _ in range(400)] for i in range(24)}
        commits = 60 if self.small else 900
        fi = []
        for c in range(commits):
            changed = sorted(files) if c == 0 else rng.sample(sorted(files), 4)
            for name in changed:
                lines = files[name]
                for _ in range(6):
                    lines[rng.randrange(len(lines))] = " ".join(rng.choices(words, k=12))
                lines.insert(rng.randrange(len(lines)), " ".join(rng.choices(words, k=8)))
            msg = f"commit {c}\n"
            fi.append(f"commit refs/heads/main\ncommitter T <t@example.org> {1700000000 + c} +0000\n"
                      f"data {len(msg)}\n{msg}")
            for name in changed:
                lines = files[name]
                body = "\n".join(lines) + "\n"
                fi.append(f"M 100644 inline {name}\ndata {len(body.encode())}\n{body}\n")
        subprocess.run(["git", "-C", repo, "fast-import", "--quiet"], input="".join(fi).encode(), check=True,
                       env=clean_env())
        self.repo = repo

    def workload(self, ctx: Ctx) -> None:
        g = [self.exe, "-C", self.repo, "-c", "pack.threads=2", "-c", "gc.auto=0"]
        while ctx.more():
            ctx.run([*g, "repack", "-adf", "-q", "--window=30"], "git repack")
            out = ctx.run([*g, "log", "--stat", "--format=%H", "-n", "40" if self.small else "400"], "git log")
            ctx.done_cycle(1, digest(out))
            ctx.idle(0.5)


class Gcc(Program):
    name, exe = "gcc", "/usr/bin/gcc"

    def setup(self) -> None:
        n = 40 if self.small else 700
        rng = random.Random(2)
        parts = ["#include <string.h>\nstruct s { int a[8]; double d; char n[32]; };\n"]
        for i in range(n):
            cases = "".join(f"    case {j}: acc += p->a[{j % 8}] * {rng.randrange(1, 99)} + (int)p->d; "
                            f"memcpy(p->n, \"c{j}\", 3); break;\n" for j in range(12))
            parts.append(f"int f{i}(struct s *p, int k) {{\n  int acc = {i};\n"
                         f"  for (int j = 0; j < k; j++) {{\n   switch ((j * {rng.randrange(3, 17)}) % 12) {{\n"
                         f"{cases}   }}\n   p->d = p->d * 0.5 + acc;\n  }}\n  return acc;\n}}\n")
        self.src = self.work / "big.c"
        self.src.write_text("".join(parts))
        self.units = n

    def workload(self, ctx: Ctx) -> None:
        obj = self.work / "big.o"
        while ctx.more():
            ctx.run([self.exe, "-O2", "-c", self.src, "-o", obj], "gcc")
            ctx.done_cycle(self.units, digest(obj.read_bytes()))
            ctx.idle(0.5)


class Jq(Program):
    name, exe = "jq", "/usr/bin/jq"
    apt = ("learn-real",)
    QUERY = ("group_by(.k) | map({k: .[0].k, n: length, s: (map(.v) | add), "
             "t: (map(.tags[]) | unique | length)}) | sort_by(-.n) | .[:20]")

    def setup(self) -> None:
        n = 10000 if self.small else 150000
        rng = random.Random(3)
        rows = [{"k": "g%d" % rng.randrange(2000), "v": rng.randrange(10**6),
                 "tags": ["t%d" % rng.randrange(500) for _ in range(rng.randrange(1, 6))],
                 "text": "x" * rng.randrange(10, 200)} for _ in range(n)]
        self.data = self.work / "data.json"
        self.data.write_text(json.dumps(rows))
        self.units = n

    def workload(self, ctx: Ctx) -> None:
        while ctx.more():
            out = ctx.run([self.exe, "-c", self.QUERY, self.data], "jq")
            ctx.done_cycle(self.units, digest(out))
            ctx.idle(0.5)


class Mariadb(Program):
    """MariaDB with a thread per connection: waves of 64 sysbench clients
    (OLTP read/write), then 8 (point selects), then idle; MariaDB keeps a
    few of the connections' threads for reuse and ends the rest."""
    name, exe, apt = "mariadb", "/usr/sbin/mariadbd", ("mariadb",)
    deterministic = False       # sysbench's writes are random; only their count is fixed
    WAVES = (("oltp_read_write", 64, 1200), ("oltp_point_select", 8, 40000))

    def available(self) -> str | None:
        if not shutil.which("sysbench"):
            return "sysbench is not installed"
        return super().available()

    def _sysbench(self, ctx: Ctx, test: str, *args) -> str:
        return ctx.client(["sysbench", test, "--db-driver=mysql", f"--mysql-socket={self.sock}",
                           "--mysql-user=root", "--mysql-db=sbtest", "--tables=4",
                           f"--table-size={1000 if self.small else 20000}", *args], f"sysbench {test}")

    def setup(self) -> None:
        self.data, self.sock = self.work / "data", self.work / "mysqld.sock"
        shutil.rmtree(self.data, ignore_errors=True)
        r = subprocess.run(["mariadb-install-db", "--no-defaults", f"--datadir={self.data}", "--user=root",
                            "--auth-root-authentication-method=normal", "--skip-test-db"],
                           env=clean_env(), capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise RunError(f"mariadb-install-db failed ({r.returncode}): {(r.stderr or r.stdout).strip()[-300:]}")
        ctx = Ctx(self.work, None, self.work / "no-telemetry", {}, 0, True)
        try:
            p = self._start(ctx)
            ctx.client(["mariadb", f"--socket={self.sock}", "-uroot", "-e", "CREATE DATABASE sbtest"], "mariadb")
            self._sysbench(ctx, "oltp_read_write", "--threads=4", "prepare")
            self._stop(ctx, p)
        finally:
            ctx.close()

    def _start(self, ctx: Ctx):
        p = ctx.spawn([self.exe, "--no-defaults", f"--datadir={self.data}", f"--socket={self.sock}",
                       "--skip-networking", "--user=root", f"--pid-file={self.work / 'mysqld.pid'}",
                       f"--log-error={self.work / 'mysqld.err'}", "--innodb-buffer-pool-size=128M",
                       "--innodb-flush-log-at-trx-commit=0", "--skip-log-bin", "--max-connections=200",
                       "--performance-schema=OFF"],
                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        end = time.monotonic() + 60
        while time.monotonic() < end:
            if p.poll() is not None:
                raise RunError(f"mariadbd exited at start ({p.returncode}): "
                               f"{(self.work / 'mysqld.err').read_text(errors='replace')[-300:]}")
            if subprocess.run(["mariadb-admin", f"--socket={self.sock}", "-uroot", "ping"], env=clean_env(),
                              capture_output=True, timeout=10).returncode == 0:
                return p
            time.sleep(0.1)
        raise RunError("mariadbd did not answer in 60 s")

    def _stop(self, ctx: Ctx, p) -> None:
        if p.returncode is None:
            p.send_signal(signal.SIGTERM)       # a clean shutdown
            ctx.reap(p, 120)

    def workload(self, ctx: Ctx) -> None:
        p = self._start(ctx)
        try:
            while ctx.more():
                units = 0
                for test, threads, events in self.WAVES:
                    events = events // 20 if self.small else events
                    out = self._sysbench(ctx, test, f"--threads={threads}", f"--events={events}", "--time=0",
                                         "--rand-seed=1", "run")
                    done = re.search(r"total number of events:\s+(\d+)", out)
                    if not done or int(done.group(1)) != events:
                        raise RunError(f"sysbench {test} did not run its {events} events: {out.strip()[-300:]}")
                    units += events
                ctx.done_cycle(units)
                ctx.idle(1.0)
        finally:
            self._stop(ctx, p)


PROGRAMS = {c.name: c for c in (Redis, Postgres, Python, Perl, Sqlite, Git, Gcc, Jq, Mariadb)}


# ---------------------------------------------------------------- learnd


class Learnd:
    def __init__(self, work: Path, db: Path, shm: Path, objective: str, extra=(), env=None):
        self.log_path = work / f"learnd-{time.monotonic_ns()}.log"
        self.log = open(self.log_path, "w")
        self.p = subprocess.Popen([str(LEARND), "--foreground", "--db", str(db), "--shm-dir", str(shm),
                                   "--run-dir", str(work / f"run-{time.monotonic_ns()}"), "--objective", objective,
                                   "--pool-users", "root,postgres", *extra],
                                  stdout=self.log, stderr=subprocess.STDOUT, env=clean_env(**(env or {})))
        end = time.monotonic() + 60
        while "ready:" not in self.log_path.read_text(errors="replace"):
            if self.p.poll() is not None or time.monotonic() > end:
                raise RunError(f"learnd did not start: {self.log_path.read_text(errors='replace')[-400:]}")
            time.sleep(0.1)

    def stop(self) -> int:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(60)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.log.close()
        return self.p.returncode

    def tail(self, n: int = 30) -> list[str]:
        return self.log_path.read_text(errors="replace").splitlines()[-n:]


def stored_policy(db: Path) -> list[dict]:
    """What learnd stored: per program, its best policy's origin and knobs."""
    import sqlite3
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            rows = con.execute("SELECT p.exe, pol.origin, pol.knobs FROM programs p "
                               "JOIN policies pol ON pol.id = p.best_policy").fetchall()
        finally:
            con.close()
    except sqlite3.Error as e:
        return [{"error": str(e)}]
    return [{"exe": exe, "origin": origin, "knobs": json.loads(knobs)} for exe, origin, knobs in rows]


# ---------------------------------------------------------------- the study


class Study:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.tmp = Path(tempfile.mkdtemp(prefix="hakmem-learn-real-"))
        os.chmod(self.tmp, 0o755)      # the postgres account reaches its directory through it

    def one(self, prog: Program, config: str, shm: Path | None = None) -> dict:
        shm = shm or (self.tmp / "no-telemetry")      # absent: no telemetry, the policy the variables give
        lib = self.a.libs[config[4:]] if config.startswith("lib:") else None if config == "glibc" else str(LIB)
        ctx = Ctx(prog.work, lib, shm, POINTS.get(config) or {}, self.a.seconds, self.a.small)
        err = None
        try:
            prog.workload(ctx)
        except (RunError, OSError, subprocess.SubprocessError) as e:
            err = str(e)
        r = ctx.close()
        r["config"] = config
        if not err and r["not_preloaded"]:
            err = f"{r['not_preloaded']} of the program's processes ran without {lib} (can its user read it?)"
        if err:
            r["error"] = err
        return r

    def program(self, name: str) -> dict:
        prog = PROGRAMS[name](self.tmp, self.a.small)
        why = prog.available()
        if why and prog.apt:
            subprocess.run([str(ROOT / "tools" / "install-deps.sh"), *prog.apt], check=False)
            why = prog.available()
        if why:
            say(f"{name}: skipped: {why}")
            return {"skipped": why}
        say(f"{name}: setting up")
        try:
            prog.setup()
        except (RunError, OSError, subprocess.SubprocessError) as e:
            return {"error": f"setup: {e}"}
        res: dict = {"runs": [], "deterministic": prog.deterministic}
        # learnd's cold run and the warm run on the database it left are one
        # unit of the rotation (warm must follow cold); each round's cold run
        # starts on a fresh database.
        units = [[c] for c in self.a.points] + [[f"lib:{n}"] for n in self.a.libs]
        if self.a.learnd:
            units.append(["learnd-cold", "learnd-warm"])
        if self.a.watched:
            units += [[w] for w in WATCHERS]
        for rnd in range(self.a.rounds):
            order = units[rnd % len(units):] + units[:rnd % len(units)]
            for unit in order:
                for c in unit:
                    say(f"{name}: round {rnd + 1}/{self.a.rounds}: {c}")
                    r = (self.learnd_run(prog, c, rnd) if c.startswith("learnd-") else
                         self.watched_run(prog, c, rnd) if c in WATCHERS else self.one(prog, c))
                    r["round"] = rnd
                    res["runs"].append(r)
                    if "error" in r:
                        say(f"{name}: {c}: {r['error']}")
        prog.cleanup()
        summarise(res)
        return res

    def learnd_run(self, prog: Program, tag: str, rnd: int) -> dict:
        """A run beside hakmem-learnd (gp, the objective's λ): cold on a fresh
        database, warm restarted on the one the round's cold run left."""
        state = self.tmp / f"learnd-{prog.name}-{rnd}"
        r = self._beside_learnd(prog, tag, state, self.tmp / f"shm-{prog.name}-{rnd}")
        if "learnd_rc" in r:
            r["learned"] = stored_policy(state / "learn.db")
        return r

    def _beside_learnd(self, prog: Program, tag: str, state: Path, shm: Path, extra=(), env=None) -> dict:
        state.mkdir(mode=0o700, exist_ok=True)
        try:
            d = Learnd(state, state / "learn.db", shm, OBJECTIVE, extra, env)
        except RunError as e:
            return {"config": tag, "error": str(e)}
        try:
            r = self.one(prog, tag, shm)
        finally:
            rc = d.stop()
        r["learnd_rc"], r["learnd_log"] = rc, d.tail()
        if rc not in (0, None) and "error" not in r:
            r["error"] = f"learnd exited {rc}"
        return r

    def watched_run(self, prog: Program, tag: str, rnd: int) -> dict:
        """The default policy, watched by WATCHERS[tag]: what watching costs."""
        shm = self.tmp / f"shm-{tag}-{prog.name}-{rnd}"
        what = WATCHERS[tag]
        if what is None:
            shm.mkdir(mode=0o1777)
            os.chmod(shm, 0o1777)       # as learnd makes it: every user's processes publish there
            holder = subprocess.Popen([*HAKMEM_CLI, "ring", "hold", str(shm)], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True, env=clean_env(), cwd=ROOT)
            said = holder.stderr.readline()      # "holding DIR: ..." once the lease is held
            if not said.startswith("holding"):
                holder.kill()
                holder.wait()
                return {"config": tag, "error": f"hakmem ring hold did not start: {said.strip()[-300:]}"}
            try:
                return self.one(prog, tag, shm)
            finally:
                holder.terminate()
                holder.wait(30)
        return self._beside_learnd(prog, tag, self.tmp / f"{tag}-{prog.name}-{rnd}", shm, *what)

    def main(self) -> dict:
        out = {"when": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "commit": git_rev(), "seconds": self.a.seconds, "rounds": self.a.rounds, "small": self.a.small,
               "lambda": LAMBDA, "objective": OBJECTIVE, "library": str(LIB), "programs": {}}
        try:
            for name in self.a.only:
                out["programs"][name] = self.program(name)
        finally:
            if self.a.keep:
                say(f"kept {self.tmp} (learnd's logs and databases, the programs' data)")
            else:
                shutil.rmtree(self.tmp, ignore_errors=True)
        return out


def git_rev() -> str:
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short=10", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


# ---------------------------------------------------------------- figures


def summarise(res: dict) -> None:
    """J per run against the default's demand, then per configuration the
    median and range of J, throughput and PSS; the room: the best static
    policy, and whether its J's range clears the default's."""
    ok = [r for r in res["runs"] if "error" not in r and r.get("units_per_cpu_s")]
    defaults = [r for r in ok if r["config"] == "default"]
    if not defaults:
        res["error"] = "no default run completed"
        return
    d_ref = statistics.median(r["throughput"] for r in defaults)
    res["d_ref"] = d_ref
    obj = Objective.parse(OBJECTIVE)
    for r in ok:
        r["j"] = obj.cost(d_ref / r["units_per_cpu_s"], r["pss_mean_mib"] * (1 << 20))
        if r.get("late"):
            r["late"]["j"] = obj.cost(d_ref / r["late"]["units_per_cpu_s"], r["late"]["pss_mean_mib"] * (1 << 20))
    # Cycle k's answer must be the same in every run that did k cycles (the
    # longest run's answers are the reference; runs do different numbers).
    ref = max((r["answers"] for r in res["runs"] if "error" not in r), key=len, default=[])
    res["answers_differ"] = sorted({r["config"] for r in ok if res["deterministic"]
                                    and r["answers"] != ref[:len(r["answers"])]})
    per: dict = {}
    for r in ok:
        per.setdefault(r["config"], []).append(r)
    table = {}
    for c, rs in per.items():
        def stat(key):
            v = [r[key] for r in rs]
            return {"median": statistics.median(v), "lo": min(v), "hi": max(v), "n": len(v)}
        table[c] = {k: stat(k) for k in ("j", "throughput", "pss_mean_mib", "pss_peak_mib", "cpu_s")}
    res["table"] = table
    # The late half, where every run of a configuration has one.
    late = {}
    for c, rs in per.items():
        if all(r.get("late") for r in rs):
            late[c] = {k: {"median": statistics.median(r["late"][k] for r in rs), "lo": min(r["late"][k] for r in rs),
                           "hi": max(r["late"][k] for r in rs), "n": len(rs)}
                       for k in ("j", "throughput", "pss_mean_mib")}
    res["late_table"] = late
    base = table["default"]["j"]
    statics = {c: t for c, t in table.items() if c in POINTS and c not in ("default", "glibc")}
    if statics:
        best = min(statics, key=lambda c: statics[c]["j"]["median"])
        b = statics[best]["j"]
        res["best_static"] = best
        res["room"] = 1 - b["median"] / base["median"]
        res["room_beyond_noise"] = b["n"] >= 2 and base["n"] >= 2 and b["hi"] < base["lo"]


def pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def markdown(out: dict) -> str:
    def rng(s):
        return f"{s['median']:.4g} ({s['lo']:.4g}–{s['hi']:.4g})"

    lines = [f"Real programs, {out['when']}, hakmem {out['commit']}, {out['rounds']} interleaved rounds of "
             f"≥ {out['seconds']:g} s per run{' (small data)' if out['small'] else ''}; "
             f"{Objective.parse(out.get('objective') or f'lambda={LAMBDA}').describe().replace('time', 'J: D_ref/X')}. "
             "J: medians (ranges); room: 1 − best static ÷ default; beyond noise: the ranges do not overlap.", "",
             "| program | default J | best static | its J | room | beyond noise | its throughput ÷ default | "
             "its mean PSS ÷ default | learnd cold ÷ default | learnd warm ÷ default | same answers |",
             "|---|---:|---|---:|---:|---|---:|---:|---:|---:|---|"]
    for name, res in out["programs"].items():
        if "table" not in res:
            lines.append(f"| {name} | {res.get('skipped') or res.get('error')} |" + " |" * 10)
            continue
        t = res["table"]
        d = t["default"]
        best = res.get("best_static")
        cells = [name, rng(d["j"])]
        if best:
            b = t[best]
            cells += [best, rng(b["j"]), pct(res["room"]), "yes" if res["room_beyond_noise"] else "no",
                      f"{b['throughput']['median'] / d['throughput']['median']:.3f}×",
                      f"{b['pss_mean_mib']['median'] / max(1e-9, d['pss_mean_mib']['median']):.3f}×"]
        else:
            cells += [""] * 6
        for tag in ("learnd-cold", "learnd-warm"):
            cells.append(f"{t[tag]['j']['median'] / d['j']['median']:.3f}×" if tag in t else "")
        cells.append("no: " + ", ".join(res["answers_differ"]) if res["answers_differ"]
                     else ("yes" if res["deterministic"] else "n/a"))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Per configuration (medians, ranges in brackets):", "",
              "| program | config | runs | J | throughput (units/busy s) | mean PSS MiB | peak PSS MiB | CPU s |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, res in out["programs"].items():
        for c, s in res.get("table", {}).items():
            def f(k, fmt="{:.4g}"):
                return f"{fmt.format(s[k]['median'])} ({fmt.format(s[k]['lo'])}–{fmt.format(s[k]['hi'])})"
            lines.append(f"| {name} | {c} | {s['j']['n']} | {f('j')} | {f('throughput', '{:.4g}')} | "
                         f"{f('pss_mean_mib', '{:.1f}')} | {f('pss_peak_mib', '{:.1f}')} | {f('cpu_s', '{:.2f}')} |")
    if any(res.get("late_table") for res in out["programs"].values()):
        lines += ["", f"The late half (from the first cycle ending past {LATE_FROM:g} of the run's seconds to the last: "
                  "what learnd settled on, its learning left out; D_ref the whole runs' default), medians (ranges):", "",
                  "| program | config | runs | late J | ÷ default's | ÷ best static's | throughput (units/busy s) | "
                  "mean PSS MiB |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, res in out["programs"].items():
        late = res.get("late_table") or {}
        d, b = late.get("default"), late.get(res.get("best_static"))
        for c, s in late.items():
            def f(k, fmt="{:.4g}"):
                return f"{fmt.format(s[k]['median'])} ({fmt.format(s[k]['lo'])}–{fmt.format(s[k]['hi'])})"
            vs = [f"{s['j']['median'] / x['j']['median']:.3f}×" if x else "" for x in (d, b)]
            lines.append(f"| {name} | {c} | {s['j']['n']} | {f('j')} | {vs[0]} | {vs[1]} | {f('throughput')} | "
                         f"{f('pss_mean_mib', '{:.1f}')} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench/learn_real.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--only", default=",".join(PROGRAMS), help=f"programs, comma-separated (default all: "
                    f"{','.join(PROGRAMS)})")
    ap.add_argument("--points", default=",".join(ROOM_POINTS),
                    help=f"static policies for the room study (default %(default)s; known: {', '.join(POINTS)})")
    ap.add_argument("--seconds", type=float, default=120.0, help="least seconds per run (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default %(default)s)")
    ap.add_argument("--learnd", action="store_true",
                    help="also run learnd cold and warm in each round (a fresh database per round)")
    ap.add_argument("--watched", action="store_true",
                    help="also run the default watched: " + ", ".join(WATCHERS) + " (the price of watching)")
    ap.add_argument("--lib", action="append", default=[], metavar="NAME=PATH",
                    help="another build of hakmem as one more configuration, lib:NAME (e.g. base=/tmp/old/libhakmem.so)")
    ap.add_argument("--objective", default=OBJECTIVE,
                    help="J's and learnd's objective: lambda=L (a GiB of mean PSS costs L cores) or budget=SIZE "
                         "(the default's demand alone while the mean PSS is under SIZE; default %(default)s)")
    ap.add_argument("--small", action="store_true", help="small data and short idles: the check CI runs")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"), help="directory for learn_real.json/.md")
    ap.add_argument("--json", action="store_true", help="print the JSON instead of the tables")
    ap.add_argument("--keep", action="store_true",
                    help="keep the working directory (learnd's full logs and databases) and say where")
    a = ap.parse_args(argv)
    a.only = [s for s in a.only.split(",") if s]
    a.points = [s for s in a.points.split(",") if s]
    bad = [s for s in a.only if s not in PROGRAMS] + [s for s in a.points if s not in POINTS]
    if bad:
        ap.error(f"unknown program or policy: {', '.join(bad)}")
    if "default" not in a.points:
        a.points.insert(0, "default")
    a.libs = {}
    for spec in a.lib:
        n, _, path = spec.partition("=")
        if not n or not path or not Path(path).is_file():
            ap.error(f"--lib {spec}: want NAME=PATH to a library")
        a.libs[n] = str(Path(path).resolve())
    if a.rounds < 1 or a.seconds < 0:
        ap.error("--rounds must be ≥ 1 and --seconds ≥ 0")
    try:
        Objective.parse(a.objective)
    except ObjectiveError as e:
        ap.error(f"--objective: {e}")
    return a


def main(argv: list[str]) -> int:
    global OBJECTIVE
    a = parse_args(argv)
    OBJECTIVE = a.objective
    if not LIB.exists():
        print(f"learn-real: {LIB} is missing: run make first", file=sys.stderr)
        return 1
    if a.learnd and not LEARND.exists():
        print(f"learn-real: {LEARND} is missing: run make venv first", file=sys.stderr)
        return 1
    study = Study(a)

    def interrupted(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, interrupted)
    try:
        out = study.main()
    except KeyboardInterrupt:
        print("learn-real: interrupted", file=sys.stderr)
        return 1
    outdir = Path(a.out)
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "learn_real.json").write_text(json.dumps(out, indent=1) + "\n")
    md = markdown(out)
    (outdir / "learn_real.md").write_text(md)
    print(json.dumps(out, indent=1) if a.json else md)
    bad = [n for n, r in out["programs"].items()
           if r.get("error") or r.get("answers_differ") or any("error" in x for x in r.get("runs", []))]
    if bad:
        print(f"learn-real: failed or answered differently: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
